//! VRAM between two real processes over the TCP route, over the fake device layer (device memory emulated
//! in memfd-backed shared memory). Both agents run with `transport=tcp` on loopback, so every byte crosses a
//! socket: the initiator stages its VRAM through page-locked buffers, the target's serving loops stage
//! theirs. Neither side ever opens the other's allocation (the fake driver's counters prove it).
//!
//! The target child is this test binary re-run with `GIXL_CHILD=vram-tcp-target`; it speaks a line protocol
//! on stdin/stdout. Byte-for-byte checks: the child reports a digest of its buffers, the parent computes the
//! digest of what they must hold.

use std::io::{BufRead, BufReader, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use gixl::device::fake;
use gixl::*;

mod common;
use common::dev::{one, reg, run, slice, wait};
use common::{hex, unhex};

const MIB: usize = 1 << 20;

/// One test at a time: the fake driver's counters are per process.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}
/// Block size and count of the block tests: 1024 × 16 KiB.
const BS: usize = 16 << 10;
const NB: usize = 1024;

/// Byte `i` of pattern `seed`: position-dependent, so a misplaced block shows.
fn pat(seed: u8, i: usize) -> u8 {
    ((i as u64 ^ (seed as u64) << 40).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

fn fill(buf: &mut [u8], seed: u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pat(seed, i);
    }
}

/// FNV-1a over 8-byte words (then the tail).
fn digest(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let words = b.chunks_exact(8);
    let tail = words.remainder();
    for w in words {
        h = (h ^ u64::from_le_bytes(w.try_into().unwrap())).wrapping_mul(0x100_0000_01b3);
    }
    for &x in tail {
        h = (h ^ x as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn tcp_params() -> Params {
    [("transport", "tcp"), ("tcp_addr", "127.0.0.1"), ("disconnect_timeout_ms", "1000")]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The target child: `size` bytes of fake VRAM on device 1 and `size` bytes of DRAM, both registered.
/// Prints `@md <md> <vram> <dram> <identity of the VRAM allocation>`, then answers:
/// `fill v|d <seed>`, `digest v|d <len>`, `stats` (bytes its fake driver copied, page-locked bytes it
/// holds), `dereg-landing` (says `armed`, waits until a byte of its VRAM changes, deregisters it and makes
/// it read-only, so a later write kills the child), `alive`; anything else: exit.
fn target_child() {
    let size: usize = std::env::var("GIXL_SIZE").unwrap().parse().unwrap();
    assert!(gixl::device::select_fake());
    let vram = fake::alloc(1, size, false, None).unwrap();
    let mut dram = vec![0u8; size];
    let a = Agent::new("vt-target", AgentConfig::default()).unwrap();
    // In a network namespace of its own (`GIXL_HOST_IP`): the default route choice, the peer being on
    // "another host"; else forced onto TCP on loopback.
    let params = match std::env::var("GIXL_HOST_IP") {
        Ok(ip) => [("tcp_addr".to_owned(), ip)].into_iter().collect(),
        Err(_) => tcp_params(),
    };
    a.create_backend("UCX", &params).unwrap();
    let vl = RegDList::with_descs(MemType::Vram, vec![RegDesc { desc: Desc::new(vram, size as u64, 1), meta: vec![] }]);
    a.register_mem(&vl, &[]).unwrap();
    let dl = RegDList::with_descs(
        MemType::Dram,
        vec![RegDesc { desc: Desc::new(dram.as_ptr() as u64, size as u64, 0), meta: vec![] }],
    );
    a.register_mem(&dl, &[]).unwrap();
    let out = std::io::stdout();
    let mut out = out.lock();
    let ino = fake::identity(vram).unwrap();
    writeln!(out, "\n@md {} {vram} {} {ino}", hex(&a.local_md().unwrap()), dram.as_ptr() as u64).unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let f: Vec<&str> = line.split(' ').collect();
        let buf = |which: &str| -> &'static mut [u8] {
            match which {
                "v" => slice(vram, size),
                _ => slice(dram.as_ptr() as u64, size),
            }
        };
        match f[0] {
            "fill" => {
                fill(buf(f[1]), f[2].parse().unwrap());
                writeln!(out, "ok").unwrap()
            }
            "digest" => {
                let len: usize = f[2].parse().unwrap();
                writeln!(out, "digest {}", digest(&buf(f[1])[..len])).unwrap()
            }
            "stats" => writeln!(out, "stats {} {}", fake::copied_bytes(), fake::pinned_bytes()).unwrap(),
            "dereg-landing" => {
                let v = slice(vram, size);
                let before = v.to_vec();
                writeln!(out, "armed").unwrap();
                out.flush().unwrap();
                let t = Instant::now();
                // Wait until some byte has landed (a strided look; the writer is another process).
                while (0..size).step_by(4096).all(|i| {
                    // SAFETY: inside the buffer; volatile because another process writes it.
                    unsafe { std::ptr::read_volatile(&v[i]) == before[i] }
                }) {
                    assert!(t.elapsed() < Duration::from_secs(30), "nothing landed");
                    std::hint::spin_loop();
                }
                let t = Instant::now();
                a.deregister_mem(&vl, &[]).unwrap();
                let took = t.elapsed();
                // From here any write into the region kills this process (SIGSEGV): exact, not sampled.
                // SAFETY: our own mapping of `size` bytes; it is only read from now on.
                assert_eq!(unsafe { libc::mprotect(vram as usize as *mut libc::c_void, size, libc::PROT_READ) }, 0);
                let landed = v.iter().zip(&before).filter(|(a, b)| a != b).count();
                writeln!(out, "ok {landed} {}", took.as_millis()).unwrap()
            }
            // Still alive: nothing wrote into the region since `deregister_mem` returned.
            "alive" => writeln!(out, "alive").unwrap(),
            _ => break,
        }
        out.flush().unwrap();
    }
    dram.clear();
}

/// The initiator child of `vram_with_cross_memory_attach_denied_goes_over_tcp`, run as `nobody`: READ the
/// root target's VRAM into its own, check it, WRITE its own back. Prints `@started`, `@read <ok|bad>`,
/// `@log <fall-back warnings>`.
fn nobody_child() {
    println!("\n@started");
    let md = unhex(&std::env::var("GIXL_MD").unwrap());
    let raddr: u64 = std::env::var("GIXL_ADDR").unwrap().parse().unwrap();
    let size: usize = std::env::var("GIXL_SIZE").unwrap().parse().unwrap();
    static LINES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    gixl::telemetry::log::set_sink(Box::new(|_, msg| LINES.lock().unwrap().push(msg.to_owned())));
    assert!(gixl::device::select_fake());
    let lv = fake::alloc(0, size, false, None).unwrap();
    let a = Agent::new("vt-nobody", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    reg(&a, MemType::Vram, lv, size, 0);
    a.load_remote_md(&md).unwrap();
    let (l, r) = (one(MemType::Vram, lv, size, 0), one(MemType::Vram, raddr, size, 1));
    let o = XferOpts::default();
    let rd = a.create_xfer_req(XferOp::Read, &l, &r, "vt-root", &o).unwrap();
    assert_eq!(run(&a, &rd).unwrap(), Status::Success);
    let mut want = vec![0u8; size];
    fill(&mut want, 4);
    println!("\n@read {}", if slice(lv, size)[..] == want[..] { "ok" } else { "bad" });
    fill(slice(lv, size), 6);
    let wr = a.create_xfer_req(XferOp::Write, &l, &r, "vt-root", &o).unwrap();
    assert_eq!(run(&a, &wr).unwrap(), Status::Success);
    let fallback = LINES.lock().unwrap().iter().filter(|m| m.contains("route tcp (fall-back")).count();
    println!("\n@log {fallback}");
}

/// The initiator child of `vram_over_tcp_initiator_killed_mid_write`: WRITEs its VRAM into the parent's
/// over TCP, 16 KiB blocks, again and again until killed; prints `@writing` once the first is posted.
fn writer_child() {
    let md = unhex(&std::env::var("GIXL_MD").unwrap());
    let raddr: u64 = std::env::var("GIXL_ADDR").unwrap().parse().unwrap();
    let size: usize = std::env::var("GIXL_SIZE").unwrap().parse().unwrap();
    assert!(gixl::device::select_fake());
    let lv = fake::alloc(0, size, false, None).unwrap();
    fill(slice(lv, size), 8);
    let a = initiator("vt-writer");
    reg(&a, MemType::Vram, lv, size, 0);
    a.load_remote_md(&md).unwrap();
    let n = size / BS;
    let l =
        XferDList::with_descs(MemType::Vram, (0..n).map(|i| Desc::new(lv + (i * BS) as u64, BS as u64, 0)).collect());
    let r = XferDList::with_descs(
        MemType::Vram,
        (0..n).map(|i| Desc::new(raddr + (i * BS) as u64, BS as u64, 1)).collect(),
    );
    let w = a.create_xfer_req(XferOp::Write, &l, &r, "vt-victim", &XferOpts::default()).unwrap();
    let mut said = false;
    loop {
        let st = a.post_xfer_req(&w, NotifUpdate::Keep);
        if !said {
            println!("\n@writing");
            said = true;
        }
        if st.is_ok() {
            let _ = wait(&a, &w, Duration::from_secs(60));
        }
    }
}

/// The initiator child of `vram_between_hosts_in_network_namespaces`, in another namespace than the
/// target (so on "another host" by the engine's own route choice): WRITE its VRAM into the target's VRAM,
/// READ the target's DRAM into its VRAM. Prints `@read <ok|bad>` and `@route <tcp route log lines>`.
fn remote_child() {
    let md = unhex(&std::env::var("GIXL_MD").unwrap());
    let rv: u64 = std::env::var("GIXL_VRAM").unwrap().parse().unwrap();
    let rd: u64 = std::env::var("GIXL_DRAM").unwrap().parse().unwrap();
    let size: usize = std::env::var("GIXL_SIZE").unwrap().parse().unwrap();
    static LINES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    gixl::telemetry::log::set_sink(Box::new(|_, msg| LINES.lock().unwrap().push(msg.to_owned())));
    assert!(gixl::device::select_fake());
    let lv = fake::alloc(0, size, false, None).unwrap();
    fill(slice(lv, size), 21);
    let a = Agent::new("vt-remote", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    reg(&a, MemType::Vram, lv, size, 0);
    a.load_remote_md(&md).unwrap();
    let l = one(MemType::Vram, lv, size, 0);
    let o = XferOpts::default();
    let w = a.create_xfer_req(XferOp::Write, &l, &one(MemType::Vram, rv, size, 1), "vt-target", &o).unwrap();
    assert_eq!(run(&a, &w).unwrap(), Status::Success);
    let r = a.create_xfer_req(XferOp::Read, &l, &one(MemType::Dram, rd, size, 0), "vt-target", &o).unwrap();
    assert_eq!(run(&a, &r).unwrap(), Status::Success);
    let mut want = vec![0u8; size];
    fill(&mut want, 22);
    println!("\n@read {}", if slice(lv, size)[..] == want[..] { "ok" } else { "bad" });
    let route = LINES.lock().unwrap().iter().filter(|m| m.contains("route tcp (another host")).count();
    println!("\n@route {route}");
}

#[test]
fn child_entry() {
    match std::env::var("GIXL_CHILD").as_deref() {
        Ok("vram-tcp-remote") => remote_child(),
        Ok("vram-tcp-target") => target_child(),
        Ok("vram-tcp-nobody") => nobody_child(),
        Ok("vram-tcp-writer") => writer_child(),
        _ => {}
    }
}

/// The target child.
type Target = common::dev::Peer;

impl Target {
    fn start(size: usize) -> Target {
        Self::start_in(size, None)
    }

    /// In host `i` of `net` when given.
    fn start_in(size: usize, host: Option<(&common::Net, usize)>) -> Target {
        let mut c = match host {
            Some((net, i)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &net.ns(i)])
                    .arg(std::env::current_exe().unwrap())
                    .env("GIXL_HOST_IP", net.ip(i));
                c
            }
            None => Command::new(std::env::current_exe().unwrap()),
        };
        c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env("GIXL_CHILD", "vram-tcp-target")
            .env("GIXL_SIZE", size.to_string());
        Target::spawn(c)
    }

    fn digest(&mut self, which: &str, len: usize) -> u64 {
        self.ask(&format!("digest {which} {len}")).strip_prefix("digest ").unwrap().parse().unwrap()
    }

    /// (bytes the target's fake driver copied, page-locked bytes it holds)
    fn stats(&mut self) -> (u64, u64) {
        self.ask_pair("stats")
    }
}

fn initiator(name: &str) -> Agent {
    common::dev::agent(name, &tcp_params())
}

/// `NB` blocks of `BS` bytes from `base`; reversed: block `i` of the list is block `NB - 1 - i` there.
fn blocks(mem: MemType, base: u64, dev: u64, reversed: bool) -> XferDList {
    let idx: Vec<usize> = if reversed { (0..NB).rev().collect() } else { (0..NB).collect() };
    XferDList::with_descs(mem, idx.into_iter().map(|i| Desc::new(base + (i * BS) as u64, BS as u64, dev)).collect())
}

/// Run `r` to completion (DONE expected), checking where device copies happened: `bytes` must have been
/// staged through the device on each side whose memory is VRAM, and nothing on a side whose memory is DRAM.
fn run_staged(a: &Agent, t: &mut Target, r: &XferReq, what: &str, local_vram: bool, remote_vram: bool, bytes: usize) {
    let (here, there) = (fake::copied_bytes(), t.stats().0);
    assert_eq!(run(a, r).unwrap(), Status::Success, "{what}");
    let (here, there) = (fake::copied_bytes() - here, t.stats().0 - there);
    let want = |vram: bool| if vram { bytes as u64 } else { 0 };
    assert_eq!((here, there), (want(local_vram), want(remote_vram)), "{what}: bytes through the device (here, target)");
}

/// `NB` blocks of `src` with the block order reversed (what a reversed block transfer makes of it).
fn reversed_blocks(src: &[u8]) -> Vec<u8> {
    src[..NB * BS].chunks(BS).rev().flatten().copied().collect()
}

/// READ and WRITE of 64 MiB and of 1024 × 16 KiB blocks (remote side reversed, nothing merges) for local
/// VRAM ↔ remote DRAM, local DRAM ↔ remote VRAM and VRAM ↔ VRAM, checked byte for byte.
#[test]
fn vram_over_tcp_every_pairing_read_write_whole_and_blocks() {
    let _g = serial();
    let size = 64 * MIB;
    let mut t = Target::start(size);
    let d = initiator("vt-init");
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    let host = vec![0u8; size];
    reg(&d, MemType::Dram, host.as_ptr() as u64, size, 0);
    d.load_remote_md(&t.md).unwrap();
    let o = XferOpts::default();
    let (v, dr) = (MemType::Vram, MemType::Dram);
    let mut seed = 1u8;
    let mut expect = vec![0u8; size];
    for (lmem, rmem) in [(v, dr), (dr, v), (v, v)] {
        let what = format!("local {lmem:?} <-> remote {rmem:?}");
        let (laddr, ldev) = if lmem == v { (lv, 0) } else { (host.as_ptr() as u64, 0) };
        let (raddr, rdev, rname) = if rmem == v { (t.vram, 1, "v") } else { (t.dram, 0, "d") };
        let local = slice(laddr, size);

        // WRITE 64 MiB.
        seed += 1;
        fill(local, seed);
        let w = d
            .create_xfer_req(
                XferOp::Write,
                &one(lmem, laddr, size, ldev),
                &one(rmem, raddr, size, rdev),
                "vt-target",
                &o,
            )
            .unwrap();
        run_staged(&d, &mut t, &w, &format!("{what}: WRITE"), lmem == v, rmem == v, size);
        assert_eq!(t.digest(rname, size), digest(local), "{what}: WRITE landed wrong bytes");

        // READ 64 MiB.
        seed += 1;
        assert_eq!(t.ask(&format!("fill {rname} {seed}")), "ok");
        local.fill(0);
        let r = d
            .create_xfer_req(
                XferOp::Read,
                &one(lmem, laddr, size, ldev),
                &one(rmem, raddr, size, rdev),
                "vt-target",
                &o,
            )
            .unwrap();
        run_staged(&d, &mut t, &r, &format!("{what}: READ"), lmem == v, rmem == v, size);
        fill(&mut expect, seed);
        assert!(local[..] == expect[..], "{what}: READ brought wrong bytes");

        // 1024 × 16 KiB blocks, WRITE then READ back, the remote order reversed.
        seed += 1;
        fill(local, seed);
        let want = reversed_blocks(local);
        let (lb, rb) = (blocks(lmem, laddr, ldev, false), blocks(rmem, raddr, rdev, true));
        let wb = d.create_xfer_req(XferOp::Write, &lb, &rb, "vt-target", &o).unwrap();
        assert_eq!(wb.desc_count(), NB as u64);
        run_staged(&d, &mut t, &wb, &format!("{what}: block WRITE"), lmem == v, rmem == v, NB * BS);
        assert_eq!(t.digest(rname, NB * BS), digest(&want), "{what}: block WRITE landed wrong bytes");
        let before = local[..NB * BS].to_vec();
        local.fill(0);
        let rb2 = d.create_xfer_req(XferOp::Read, &lb, &rb, "vt-target", &o).unwrap();
        run_staged(&d, &mut t, &rb2, &format!("{what}: block READ"), lmem == v, rmem == v, NB * BS);
        assert!(local[..NB * BS] == before[..], "{what}: block READ brought wrong bytes");
    }
    // Over TCP nothing of the target's allocation was opened here.
    assert_eq!(fake::counts(t.ino()), fake::Counts::default(), "the target's allocation was opened over TCP");
    // Staging memory stays bounded: the target's serving loops hold at most 4 buffers of 2 MiB each (at
    // most 8 loops); the initiator keeps at most 8 buffers of 8 MiB for reuse.
    let (pinned_here, pinned_there) = (fake::pinned_bytes(), t.stats().1);
    eprintln!(
        "page-locked staging held after the transfers: here {} MiB, target {} MiB",
        pinned_here >> 20,
        pinned_there >> 20
    );
    assert!(pinned_there <= 64 << 20 && pinned_there > 0, "target holds {pinned_there} B pinned");
    assert!(pinned_here <= 64 << 20 && pinned_here > 0, "initiator holds {pinned_here} B pinned");
    t.kill();
}

/// A 64 MiB WRITE into the target's VRAM in 16 KiB blocks (many requests on every connection) is in
/// flight when the target deregisters the region: once `deregister_mem` returns not one byte changes, and
/// the request ends DONE (all landed) or with the status a refused TCP request gets.
#[test]
fn vram_over_tcp_deregistration_during_a_write_is_exact() {
    let _g = serial();
    let size = 64 * MIB;
    let mut t = Target::start(size);
    let d = initiator("vt-dereg-init");
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    d.load_remote_md(&t.md).unwrap();
    assert_eq!(t.ask("fill v 0"), "ok");
    fill(slice(lv, size), 5);
    let n = size / BS;
    let l =
        XferDList::with_descs(MemType::Vram, (0..n).map(|i| Desc::new(lv + (i * BS) as u64, BS as u64, 0)).collect());
    let r = XferDList::with_descs(
        MemType::Vram,
        (0..n).rev().map(|i| Desc::new(t.vram + (i * BS) as u64, BS as u64, 1)).collect(),
    );
    let req = d.create_xfer_req(XferOp::Write, &l, &r, "vt-target", &XferOpts::default()).unwrap();
    // The target watches its VRAM before the WRITE starts, and deregisters as soon as bytes land.
    assert_eq!(t.ask("dereg-landing"), "armed");
    assert_eq!(d.post_xfer_req(&req, NotifUpdate::Keep).unwrap(), Status::InProg);
    let mut ans = String::new();
    let n = t.stdout.read_line(&mut ans).unwrap_or(0);
    assert!(n > 0, "the target died during deregistration (a write into its region after deregister_mem returned?)");
    let ans = ans.trim();
    let f: Vec<&str> = ans.split(' ').collect();
    assert_eq!(f[0], "ok", "{ans}");
    let (landed, took): (usize, u64) = (f[1].parse().unwrap(), f[2].parse().unwrap());
    let end = wait(&d, &req, Duration::from_secs(30));
    // A write after `deregister_mem` returned would have killed the target (its region is read-only).
    let alive = writeln!(t.stdin, "alive").is_ok() && {
        let mut l = String::new();
        t.stdout.read_line(&mut l).unwrap_or(0) > 0 && l.trim() == "alive"
    };
    eprintln!(
        "deregister during a 64 MiB staged WRITE into VRAM: returned after {took} ms with {landed} bytes landed; \
         request ended {:?}; target alive after: {alive}",
        end.as_ref().map_err(|e| e.status())
    );
    assert!(alive, "the target died writing into its region after deregister_mem returned");
    assert!(took < 10_000, "deregistration took {took} ms");
    match end {
        Ok(Status::Success) => {
            let want: Vec<u8> = slice(lv, size).chunks(BS).rev().flatten().copied().collect();
            assert_eq!(t.digest("v", size), digest(&want), "DONE but not every byte landed");
        }
        Ok(s) => panic!("request still {s:?}"),
        Err(e) => assert!(matches!(e.status(), Status::Backend | Status::RemoteDisconnect), "{e}"),
    }
    // The region is gone: a new request on it is refused, and the target stays usable for its DRAM.
    assert_eq!(run(&d, &req).unwrap_err().status(), Status::Backend);
    let host = vec![7u8; 4096];
    reg(&d, MemType::Dram, host.as_ptr() as u64, 4096, 0);
    let w = d
        .create_xfer_req(
            XferOp::Write,
            &one(MemType::Dram, host.as_ptr() as u64, 4096, 0),
            &one(MemType::Dram, t.dram, 4096, 0),
            "vt-target",
            &XferOpts::default(),
        )
        .unwrap();
    assert_eq!(run(&d, &w).unwrap(), Status::Success);
    t.kill();
}

/// The target is killed while READs from its VRAM into ours are in flight: the request ends with
/// REMOTE_DISCONNECT within about the disconnect timeout (1 s here), and later posts fail the same way; a
/// target restarted under the same name is reached only through its new metadata.
#[test]
fn vram_over_tcp_peer_killed_mid_transfer_is_a_prompt_disconnect() {
    let _g = serial();
    let size = 64 * MIB;
    let mut t = Target::start(size);
    let d = initiator("vt-kill-init");
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    d.load_remote_md(&t.md).unwrap();
    assert_eq!(t.ask("fill v 9"), "ok");
    let r = d
        .create_xfer_req(
            XferOp::Read,
            &one(MemType::Vram, lv, size, 0),
            &one(MemType::Vram, t.vram, size, 1),
            "vt-target",
            &XferOpts::default(),
        )
        .unwrap();
    // Post until a READ is seen mid-way (its first bytes in, not done), then stop the target. Bytes it has
    // already written to its socket still arrive, and on a fast machine they can be the whole rest of the
    // READ, which then ends in SUCCESS with every byte right. So the target is killed only once the READ
    // has stayed in flight for a while with the target stopped: the target then holds bytes it never sent.
    let local = slice(lv, size);
    let mut want = vec![0u8; size];
    fill(&mut want, 9);
    let pid = t.child.id() as libc::pid_t;
    let mut tries = 0;
    loop {
        tries += 1;
        assert!(tries < 200, "never caught a READ in flight");
        local.fill(0);
        assert_eq!(d.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::InProg);
        let caught = loop {
            // SAFETY: volatile: a staging thread of this process writes it.
            let landed = unsafe { std::ptr::read_volatile(&local[0]) } != 0;
            match d.xfer_status(&r).unwrap() {
                Status::InProg if landed => break true,
                Status::InProg => std::hint::spin_loop(),
                _ => break false,
            }
        };
        if !caught {
            continue;
        }
        // SAFETY: signals our own child, which has not been waited for.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        let stopped = Instant::now();
        let mut drained = false;
        while stopped.elapsed() < Duration::from_millis(200) {
            match d.xfer_status(&r).unwrap() {
                Status::InProg => std::thread::sleep(Duration::from_millis(2)),
                Status::Success => {
                    drained = true;
                    break;
                }
                s => panic!("READ from a stopped target ended {s:?}"),
            }
        }
        if !drained {
            break;
        }
        // Everything had been sent before the stop: the bytes must be right; go again.
        eprintln!("try {tries}: the READ ended SUCCESS with the target stopped (all sent before the stop)");
        assert!(local[..] == want[..], "a READ that ended SUCCESS brought wrong bytes");
        // SAFETY: as above.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    }
    t.child.kill().unwrap();
    let killed = Instant::now();
    let end = wait(&d, &r, Duration::from_secs(30));
    let took = killed.elapsed();
    eprintln!(
        "target killed during a staged 64 MiB READ (try {tries}): ended {:?} after {took:?}",
        end.as_ref().map_err(|e| e.status())
    );
    let e = end.unwrap_err();
    assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(run(&d, &r).unwrap_err().status(), Status::RemoteDisconnect);
    t.child.wait().unwrap();

    // Restarted under the same name: the old request stays refused (REMOTE_DISCONNECT; NOT_FOUND once the
    // new metadata replaces the old), and a request built on the new metadata reads the new memory.
    let mut t2 = Target::start(size);
    assert_eq!(t2.ask("fill v 11"), "ok");
    assert_eq!(run(&d, &r).unwrap_err().status(), Status::RemoteDisconnect);
    d.invalidate_remote_md("vt-target").unwrap();
    d.load_remote_md(&t2.md).unwrap();
    assert_eq!(run(&d, &r).unwrap_err().status(), Status::NotFound);
    let r2 = d
        .create_xfer_req(
            XferOp::Read,
            &one(MemType::Vram, lv, size, 0),
            &one(MemType::Vram, t2.vram, size, 1),
            "vt-target",
            &XferOpts::default(),
        )
        .unwrap();
    assert_eq!(run(&d, &r2).unwrap(), Status::Success);
    fill(&mut want, 11);
    assert!(local[..] == want[..], "the READ from the restarted target brought wrong bytes");
    t2.kill();
}

/// Throughput of the staged VRAM routes against DRAM over the same TCP route, in one run (by hand:
/// `cargo test --release --test vram_tcp measure -- --ignored --nocapture`; `GIXL_ITERS` rounds of 64 MiB).
#[test]
#[ignore = "a measurement, not a check"]
fn measure_vram_over_tcp_against_dram() {
    let _g = serial();
    let size = 64 * MIB;
    let iters: usize = std::env::var("GIXL_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let t = Target::start(size);
    let d = initiator("vt-measure");
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    let host = vec![1u8; size];
    reg(&d, MemType::Dram, host.as_ptr() as u64, size, 0);
    d.load_remote_md(&t.md).unwrap();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!("64 MiB requests over TCP (loopback), {iters} rounds each, best round; load: {}", load.trim());
    eprintln!("{:<28} {:>10} {:>10}", "local <-> remote", "READ GB/s", "WRITE GB/s");
    let (v, dr) = (MemType::Vram, MemType::Dram);
    for (lmem, rmem) in [(dr, dr), (v, dr), (dr, v), (v, v)] {
        let laddr = if lmem == v { lv } else { host.as_ptr() as u64 };
        let (raddr, rdev) = if rmem == v { (t.vram, 1) } else { (t.dram, 0) };
        let mut row = Vec::new();
        for op in [XferOp::Read, XferOp::Write] {
            let r = d
                .create_xfer_req(
                    op,
                    &one(lmem, laddr, size, 0),
                    &one(rmem, raddr, size, rdev),
                    "vt-target",
                    &XferOpts::default(),
                )
                .unwrap();
            assert_eq!(run(&d, &r).unwrap(), Status::Success);
            let best = (0..iters)
                .map(|_| {
                    let t0 = Instant::now();
                    assert_eq!(run(&d, &r).unwrap(), Status::Success);
                    t0.elapsed()
                })
                .min()
                .unwrap();
            row.push(size as f64 / best.as_secs_f64() / 1e9);
        }
        eprintln!("{:<28} {:>10.2} {:>10.2}", format!("{lmem:?} <-> {rmem:?}"), row[0], row[1]);
    }
    t.kill();
}

/// Where the kernel denies cross-memory attach between two processes of one host (here the initiator runs
/// as `nobody`, the target as root, so taking the target's gate and allocation handles with `pidfd_getfd`
/// fails with EPERM), VRAM moves over TCP, staged, as for a peer on another host. When the target allows
/// that uid (`GIXL_ALLOW_UIDS`), its gate and handles come over its control socket and the same-host IPC
/// route stays preferred: nothing is staged. Needs root; skips otherwise.
#[test]
fn vram_with_cross_memory_attach_denied_goes_over_tcp() {
    let _g = serial();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        common::skip("cma", "needs root to start a child as another user");
        return;
    }
    if denied_case(false) {
        std::env::set_var("GIXL_ALLOW_UIDS", "65534");
        denied_case(true);
        std::env::remove_var("GIXL_ALLOW_UIDS");
    }
}

/// One run of the test above; false if the child could not run as nobody (skipped).
fn denied_case(allowed: bool) -> bool {
    use std::os::unix::process::CommandExt;
    let size = 16 * MIB;
    assert!(gixl::device::select_fake());
    let vram = fake::alloc(1, size, true, None).unwrap();
    fill(slice(vram, size), 4);
    let a = Agent::new("vt-root", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    reg(&a, MemType::Vram, vram, size, 1);
    let copied = fake::copied_bytes();
    let exe = common::ExeForOthers::new();
    let out = Command::new(&exe.path)
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", "vram-tcp-nobody")
        .env("GIXL_MD", hex(&a.local_md().unwrap()))
        .env("GIXL_ADDR", vram.to_string())
        .env("GIXL_SIZE", size.to_string())
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = |tag: &str| text.lines().find_map(|l| l.strip_prefix(tag)).map(str::to_owned);
    if !text.lines().any(|l| l == "@started") {
        // A child that cannot even start as nobody (binary not readable to it) says nothing about gixl.
        common::skip("cma", &format!("the child could not run as nobody ({})", out.status));
        return false;
    }
    let case = if allowed { "uid allowed" } else { "uid refused" };
    assert!(out.status.success(), "{case}: {text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(line("@read ").as_deref(), Some("ok"), "{case}: the READ brought wrong bytes");
    assert_eq!(line("@log ").as_deref(), Some("1"), "{case}: one fall-back warning when the peer was loaded");
    let mut want = vec![0u8; size];
    fill(&mut want, 6);
    assert!(slice(vram, size)[..] == want[..], "{case}: the WRITE landed wrong bytes");
    // Over TCP this side served both from its VRAM through its staging buffers; through the IPC handles
    // the initiator copied them itself.
    let staged = if allowed { 0 } else { 2 * size as u64 };
    assert_eq!(fake::copied_bytes() - copied, staged, "{case}: bytes staged by the target");
    drop(a);
    fake::free(vram).unwrap();
    true
}

/// The initiator is killed while its staged WRITE into our VRAM is being served: the serving loop lets go
/// of the lease and of its staging buffer, so deregistration returns without waiting for the disconnect
/// timeout, the pinned memory stays bounded, and the region (registered again) serves the next peer.
#[test]
fn vram_over_tcp_initiator_killed_mid_write() {
    let _g = serial();
    let size = 64 * MIB;
    assert!(gixl::device::select_fake());
    let vram = fake::alloc(1, size, false, None).unwrap();
    slice(vram, size).fill(0);
    let b = initiator("vt-victim");
    reg(&b, MemType::Vram, vram, size, 1);
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", "vram-tcp-writer")
        .env("GIXL_MD", hex(&b.local_md().unwrap()))
        .env("GIXL_ADDR", vram.to_string())
        .env("GIXL_SIZE", size.to_string())
        .stdout(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while line.trim() != "@writing" {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the writer exited");
    }
    // Bytes are landing: kill the writer in the middle of a request.
    let v = slice(vram, size);
    let t = Instant::now();
    // SAFETY: volatile: another process writes it through our serving loops.
    while (0..size).step_by(4096).all(|i| unsafe { std::ptr::read_volatile(&v[i]) } == 0) {
        assert!(t.elapsed() < Duration::from_secs(30), "nothing landed");
        std::hint::spin_loop();
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let l = RegDList::with_descs(MemType::Vram, vec![RegDesc { desc: Desc::new(vram, size as u64, 1), meta: vec![] }]);
    let t = Instant::now();
    b.deregister_mem(&l, &[]).unwrap();
    let took = t.elapsed();
    eprintln!(
        "initiator killed mid-WRITE: deregistration took {took:?}; pinned here {} MiB",
        fake::pinned_bytes() >> 20
    );
    // Well under the 1 s disconnect timeout after which a lease holder would be cut off.
    assert!(took < Duration::from_millis(500), "deregistration waited {took:?} for a dead peer's lease");
    assert!(fake::pinned_bytes() <= 128 << 20);
    // Registered again, served to a new peer (this process, over TCP).
    reg(&b, MemType::Vram, vram, size, 1);
    let a = initiator("vt-after");
    let lv = fake::alloc(0, size, false, None).unwrap();
    fill(slice(lv, size), 12);
    reg(&a, MemType::Vram, lv, size, 0);
    a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let w = a
        .create_xfer_req(
            XferOp::Write,
            &one(MemType::Vram, lv, size, 0),
            &one(MemType::Vram, vram, size, 1),
            "vt-victim",
            &XferOpts::default(),
        )
        .unwrap();
    assert_eq!(run(&a, &w).unwrap(), Status::Success);
    assert!(slice(vram, size)[..] == slice(lv, size)[..]);
}

/// Two "hosts" (network namespaces joined by a bridge): the engine picks TCP by itself (another host), the
/// VRAM regions' metadata crosses as it is, and VRAM moves both ways, staged. Needs root; skips otherwise.
#[test]
fn vram_between_hosts_in_network_namespaces() {
    let _g = serial();
    let Some(net) = common::Net::new("vt", 2) else { return };
    let size = 16 * MIB;
    let mut t = Target::start_in(size, Some((&net, 0)));
    assert_eq!(t.ask("fill d 22"), "ok");
    let out = Command::new("ip")
        .args(["netns", "exec", &net.ns(1)])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", "vram-tcp-remote")
        .env("GIXL_MD", hex(&t.md))
        .env("GIXL_VRAM", t.vram.to_string())
        .env("GIXL_DRAM", t.dram.to_string())
        .env("GIXL_SIZE", size.to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let line = |tag: &str| text.lines().find_map(|l| l.strip_prefix(tag)).map(str::to_owned);
    assert_eq!(line("@route ").as_deref(), Some("1"), "the engine's route to the other host");
    assert_eq!(line("@read ").as_deref(), Some("ok"), "the READ brought wrong bytes");
    let mut want = vec![0u8; size];
    fill(&mut want, 21);
    assert_eq!(t.digest("v", size), digest(&want), "the WRITE landed wrong bytes");
    // The target staged the WRITE into its VRAM; its DRAM went straight to the socket.
    assert_eq!(t.stats().0, size as u64);
    t.kill();
}
