//! VRAM between real processes, over the fake device layer (`gixl::device::fake`: device memory emulated in
//! memfd-backed shared memory, IPC handles as descriptors taken with `pidfd_getfd`): the same engine code
//! that runs over CUDA, minus the driver. The prefill child is this test binary re-run with
//! `GIXL_CHILD=vram-prefill`; it speaks a line protocol on stdin/stdout.
//! Fabric handles are emulated too (`GIXL_FAKE_FABRIC=1` in the exporter: a name under /dev/shm that the
//! importer opens without any descriptor passing).
//!
//! What the fake cannot show (copy engines, real IPC handles, contexts, bandwidth) is left to
//! `scripts/gpu-check.sh` on a machine with a GPU.

use std::io::{BufRead, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use gixl::device::fake;
use gixl::*;

mod common;
use common::dev::{one, reg, run, slice};
use common::{hex, unhex};

const MIB: usize = 1 << 20;

fn env<T: std::str::FromStr>(k: &str) -> Option<T> {
    std::env::var(k).ok().and_then(|v| v.parse().ok())
}

fn sum(p: u64, len: usize) -> u64 {
    slice(p, len).iter().map(|&b| b as u64).sum()
}

/// The prefill child: `size` bytes of fake VRAM on device 1 (at `GIXL_AT` if set) filled with `fill`, and
/// `size` bytes of DRAM filled with `!fill`, both registered. Prints `@md <md> <vram> <dram> <identity>`,
/// then answers `sum` (both buffers), `dereg` (deregisters the VRAM), anything else: exit.
fn prefill_child() {
    // `GIXL_NORAND=1`: run with ASLR off (as `setarch -R` does; kept across the `exec` command's exec).
    if env::<u8>("GIXL_NORAND") == Some(1) && !aslr_off() {
        // SAFETY: plain syscall; the flag is inherited by the image exec'd next.
        unsafe { libc::personality(ADDR_NO_RANDOMIZE as libc::c_ulong) };
        reexec(&[]);
    }
    let size: usize = env("GIXL_SIZE").unwrap();
    let fill: u8 = env("GIXL_FILL").unwrap();
    let vmm = env::<u8>("GIXL_VMM") == Some(1);
    assert!(gixl::device::select_fake());
    // `GIXL_CHUNKS=a,b,c`: one range backed by allocations of those sizes mapped back to back (a VMM range).
    let chunks: Vec<usize> = std::env::var("GIXL_CHUNKS")
        .map(|v| v.split(',').map(|n| n.parse().unwrap()).collect())
        .unwrap_or_else(|_| vec![size]);
    assert_eq!(chunks.iter().sum::<usize>(), size);
    let vram = if chunks.len() > 1 {
        fake::alloc_chunks(1, &chunks, vmm, env("GIXL_AT")).unwrap()
    } else {
        fake::alloc(1, size, vmm, env("GIXL_AT")).unwrap()
    };
    slice(vram, size).fill(fill);
    let dram = vec![!fill; size];
    let a = Agent::new("prefill", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let vl = RegDList::with_descs(MemType::Vram, vec![RegDesc { desc: Desc::new(vram, size as u64, 1), meta: vec![] }]);
    a.register_mem(&vl, &[]).unwrap();
    let dl = RegDList::with_descs(
        MemType::Dram,
        vec![RegDesc { desc: Desc::new(dram.as_ptr() as u64, size as u64, 0), meta: vec![] }],
    );
    a.register_mem(&dl, &[]).unwrap();
    let out = std::io::stdout();
    let mut out = out.lock();
    // The identity of each chunk (one unless GIXL_CHUNKS).
    let inos: Vec<String> = chunks
        .iter()
        .scan(vram, |at, &n| {
            let b = *at;
            *at += n as u64;
            Some(fake::identity(b).unwrap().to_string())
        })
        .collect();
    writeln!(out, "\n@md {} {vram} {} {}", hex(&a.local_md().unwrap()), dram.as_ptr() as u64, inos.join(" ")).unwrap();
    out.flush().unwrap();
    let mut snap = Vec::new();
    for line in std::io::stdin().lock().lines() {
        match line.unwrap().as_str() {
            "sum" => {
                let d: u64 = dram.iter().map(|&b| b as u64).sum();
                writeln!(out, "sum {} {d}", sum(vram, size)).unwrap()
            }
            "dereg" => {
                a.deregister_mem(&vl, &[]).unwrap();
                writeln!(out, "ok").unwrap()
            }
            // Deregister, then keep a copy of the buffer as it was when `deregister_mem` returned.
            "dereg-snap" => {
                a.deregister_mem(&vl, &[]).unwrap();
                snap = slice(vram, size).to_vec();
                writeln!(out, "ok").unwrap()
            }
            "same" => writeln!(out, "same {}", snap[..] == slice(vram, size)[..]).unwrap(),
            "pattern" => {
                for (i, b) in slice(vram, size).iter_mut().enumerate() {
                    *b = pattern(i, 1);
                }
                writeln!(out, "ok").unwrap()
            }
            "hash" => writeln!(out, "hash {}", fnv(slice(vram, size))).unwrap(),
            // Replace this image in place (same pid, same pipes), the new one with its VRAM at the same
            // address, filled with `exec <fill>`; it prints a new `@md` line.
            cmd if cmd.starts_with("exec ") => {
                let fill = cmd["exec ".len()..].to_owned();
                reexec(&[("GIXL_AT", vram.to_string()), ("GIXL_FILL", fill)]);
            }
            _ => break,
        }
        out.flush().unwrap();
    }
}

/// Byte `i` of test pattern `k` (differs from one 4 KiB block to the next and inside each).
fn pattern(i: usize, k: u8) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add((i >> 12) as u8).wrapping_add(k.wrapping_mul(101))
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x100000001b3))
}

const ADDR_NO_RANDOMIZE: i32 = 0x0040000;

/// Whether this process runs with ASLR off.
fn aslr_off() -> bool {
    // SAFETY: 0xffffffff only queries the persona.
    unsafe { libc::personality(0xffffffff) & ADDR_NO_RANDOMIZE != 0 }
}

/// Exec this test binary in place as the same child, with `set` added to its environment.
fn reexec(set: &[(&str, String)]) -> ! {
    use std::os::unix::process::CommandExt;
    let mut c = Command::new("/proc/self/exe");
    c.args(std::env::args_os().skip(1));
    for (k, v) in set {
        c.env(k, v);
    }
    panic!("exec failed: {}", c.exec());
}

/// Without a device layer (no fake, and no `cuda` feature or no driver): VRAM registration is refused
/// with NOT_SUPPORTED and a message saying why. Prints `@status <status> <message>`.
fn nodevice_child() {
    let a = Agent::new("nodevice", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let buf = vec![0u8; 4096];
    let l = RegDList::with_descs(
        MemType::Vram,
        vec![RegDesc { desc: Desc::new(buf.as_ptr() as u64, 4096, 0), meta: vec![] }],
    );
    let r = a.register_mem(&l, &[]);
    match r {
        Ok(()) => println!("\n@status ok"),
        Err(e) => println!("\n@status {:?} {}", e.status(), e.message()),
    }
}

/// A decode agent run as `nobody` against a root prefill that allows that uid (`GIXL_ALLOW_UIDS`): the
/// kernel denies it `pidfd_getfd` and cross-memory attach. READs the prefill's VRAM (`GIXL_ADDR`, `GIXL_SIZE`
/// bytes of `GIXL_FILL`), then WRITEs 0x5c over it. Prints `@nobody <read> <data ok> <write>`.
fn nobody_child() {
    assert!(gixl::device::select_fake());
    let md = unhex(&std::env::var("GIXL_MD").unwrap());
    let (addr, size, fill): (u64, usize, u8) =
        (env("GIXL_ADDR").unwrap(), env("GIXL_SIZE").unwrap(), env("GIXL_FILL").unwrap());
    let d = decode("vram-nobody");
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    d.load_remote_md(&md).unwrap();
    let o = XferOpts::default();
    let v = MemType::Vram;
    let status = |op| {
        d.create_xfer_req(op, &one(v, lv, size, 0), &one(v, addr, size, 1), "prefill", &o)
            .and_then(|r| run(&d, &r))
            .map_or_else(|e| format!("{:?}", e.status()), |s| format!("{s:?}"))
    };
    let read = status(XferOp::Read);
    let ok = slice(lv, size).iter().all(|&b| b == fill);
    slice(lv, size).fill(0x5c);
    let write = status(XferOp::Write);
    println!("\n@nobody {read} {ok} {write}");
}

#[test]
fn child_entry() {
    match std::env::var("GIXL_CHILD").as_deref() {
        Ok("vram-prefill") => prefill_child(),
        Ok("vram-nodevice") => nodevice_child(),
        Ok("vram-nobody") => nobody_child(),
        _ => {}
    }
}

/// The prefill child.
type Prefill = common::dev::Peer;

impl Prefill {
    fn start(size: usize, fill: u8, vmm: bool, at: Option<u64>) -> Prefill {
        Prefill::start_with(size, fill, vmm, at, &[])
    }

    fn start_with(size: usize, fill: u8, vmm: bool, at: Option<u64>, env: &[(&str, &str)]) -> Prefill {
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.envs(env.iter().copied());
        c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env("GIXL_CHILD", "vram-prefill")
            .env("GIXL_SIZE", size.to_string())
            .env("GIXL_FILL", fill.to_string())
            .env("GIXL_VMM", if vmm { "1" } else { "0" });
        if let Some(at) = at {
            c.env("GIXL_AT", at.to_string());
        }
        Prefill::spawn(c)
    }

    /// Have the child exec itself in place; read the new image's `@md` line.
    fn exec(&mut self, fill: u8) {
        writeln!(self.stdin, "exec {fill}").unwrap();
        let mut line = String::new();
        let rest = loop {
            line.clear();
            assert!(self.stdout.read_line(&mut line).unwrap() > 0, "the exec'd child exited before its metadata");
            if let Some(rest) = line.trim().strip_prefix("@md ") {
                break rest.to_owned();
            }
        };
        self.set_md(&rest);
    }

    /// (sum of the VRAM buffer, sum of the DRAM buffer)
    fn sums(&mut self) -> (u64, u64) {
        self.ask_pair("sum")
    }
}

fn decode(name: &str) -> Agent {
    common::dev::agent(name, &Params::new())
}

#[test]
fn vram_cross_process_read_write_blocks_and_dram_both_ways() {
    let size = 8 * MIB;
    let mut p = Prefill::start(size, 3, true, None);
    let d = decode("vram-decode");
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    let host = vec![0u8; size];
    reg(&d, MemType::Dram, host.as_ptr() as u64, size, 0);
    d.load_remote_md(&p.md).unwrap();
    let o = XferOpts::default();
    let (v, dr) = (MemType::Vram, MemType::Dram);

    // VRAM → VRAM READ, whole buffer (split across copy threads).
    let r = d.create_xfer_req(XferOp::Read, &one(v, lv, size, 0), &one(v, p.vram, size, 1), "prefill", &o).unwrap();
    assert_eq!(run(&d, &r).unwrap(), Status::Success);
    assert!(slice(lv, size).iter().all(|&b| b == 3));

    // 1024 × 4 KiB blocks, remote side reversed (nothing merges), WRITE then READ back.
    let bs = 4096;
    let n = 1024;
    for (i, b) in slice(lv, n * bs).chunks_mut(bs).enumerate() {
        b.fill(i as u8 ^ 0x5a);
    }
    let local = XferDList::with_descs(v, (0..n).map(|i| Desc::new(lv + (i * bs) as u64, bs as u64, 0)).collect());
    let remote =
        XferDList::with_descs(v, (0..n).rev().map(|i| Desc::new(p.vram + (i * bs) as u64, bs as u64, 1)).collect());
    let wblk = d.create_xfer_req(XferOp::Write, &local, &remote, "prefill", &o).unwrap();
    assert_eq!(run(&d, &wblk).unwrap(), Status::Success);
    let want: u64 = (0..n).map(|i| (i as u8 ^ 0x5a) as u64 * bs as u64).sum::<u64>() + 3 * (size - n * bs) as u64;
    assert_eq!(p.sums().0, want);
    slice(lv, n * bs).fill(0);
    let rb = d.create_xfer_req(XferOp::Read, &local, &remote, "prefill", &o).unwrap();
    assert_eq!(run(&d, &rb).unwrap(), Status::Success);
    for (i, b) in slice(lv, n * bs).chunks(bs).enumerate() {
        assert!(b.iter().all(|&x| x == i as u8 ^ 0x5a), "block {i}");
    }

    // Local DRAM ↔ remote VRAM: through the opened handle.
    let r = d
        .create_xfer_req(XferOp::Read, &one(dr, host.as_ptr() as u64, size, 0), &one(v, p.vram, size, 1), "prefill", &o)
        .unwrap();
    assert_eq!(run(&d, &r).unwrap(), Status::Success);
    for (j, b) in host[..n * bs].chunks(bs).enumerate() {
        assert!(b.iter().all(|&x| x == (n - 1 - j) as u8 ^ 0x5a), "block {j}");
    }
    assert!(host[n * bs..].iter().all(|&b| b == 3));
    // Local VRAM ↔ remote DRAM: staged through a page-locked buffer and cross-memory attach.
    slice(lv, size).fill(0x11);
    let w = d.create_xfer_req(XferOp::Write, &one(v, lv, size, 0), &one(dr, p.dram, size, 0), "prefill", &o).unwrap();
    assert_eq!(run(&d, &w).unwrap(), Status::Success);
    assert_eq!(p.sums().1, 0x11 * size as u64);
    slice(lv, size).fill(0);
    let r = d.create_xfer_req(XferOp::Read, &one(v, lv, size, 0), &one(dr, p.dram, size, 0), "prefill", &o).unwrap();
    assert_eq!(run(&d, &r).unwrap(), Status::Success);
    assert!(slice(lv, size).iter().all(|&b| b == 0x11));

    // The peer's allocation was opened once for all those requests.
    assert_eq!(fake::counts(p.ino()).opens, 1);

    // The target deregisters: the gate refuses the old requests before any copy reaches the "driver".
    assert_eq!(p.ask("dereg"), "ok");
    let before = fake::counts(p.ino());
    let r = d.create_xfer_req(XferOp::Read, &one(v, lv, 4096, 0), &one(v, p.vram, 4096, 1), "prefill", &o);
    let e = r.and_then(|r| run(&d, &r)).unwrap_err();
    assert_eq!(e.status(), Status::NotFound, "{e}");
    assert_eq!(run(&d, &wblk).unwrap_err().status(), Status::NotFound);
    assert_eq!(fake::counts(p.ino()).copies, before.copies);
    // Its DRAM is still registered: the staged route still works.
    assert_eq!(run(&d, &w).unwrap(), Status::Success);
    p.kill();
}

#[test]
fn vram_peer_killed_with_a_handle_open_then_restarted_at_the_same_address() {
    let size = 4 * MIB;
    let p = Prefill::start(size, 5, false, None);
    let d = decode("vram-restart-decode");
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    d.load_remote_md(&p.md).unwrap();
    let o = XferOpts::default();
    let v = MemType::Vram;
    let r = d.create_xfer_req(XferOp::Read, &one(v, lv, size, 0), &one(v, p.vram, size, 1), "prefill", &o).unwrap();
    let w = d.create_xfer_req(XferOp::Write, &one(v, lv, 4096, 0), &one(v, p.vram, 4096, 1), "prefill", &o).unwrap();
    assert_eq!(run(&d, &r).unwrap(), Status::Success);
    assert!(slice(lv, size).iter().all(|&b| b == 5));
    let (old_vram, old_ino) = (p.vram, p.ino());
    assert_eq!(fake::counts(old_ino).opens, 1);

    // Killed while the handle is open: as with CUDA IPC, the mapping would still accept copies; the gate
    // must refuse them first.
    p.kill();
    let at_kill = fake::counts(old_ino);
    for req in [&r, &w] {
        let e = run(&d, req).unwrap_err();
        assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
    }

    // Restarted under the same name, its VRAM at the same device address.
    let mut p2 = Prefill::start(size, 9, false, Some(old_vram));
    assert_eq!(p2.vram, old_vram);
    assert_ne!(p2.ino(), old_ino);
    // Old requests: refused (not reloaded: REMOTE_DISCONNECT; after reload: NOT_FOUND); never a driver call.
    assert_eq!(run(&d, &w).unwrap_err().status(), Status::RemoteDisconnect);
    d.invalidate_remote_md("prefill").unwrap();
    d.load_remote_md(&p2.md).unwrap();
    for req in [&r, &w] {
        assert_eq!(run(&d, req).unwrap_err().status(), Status::NotFound);
    }
    let after = fake::counts(old_ino);
    assert_eq!((after.opens, after.copies), (at_kill.opens, at_kill.copies), "a stale handle reached the driver");
    assert_eq!(p2.sums().0, 9 * size as u64, "the new incarnation's memory changed");
    // The old mapping is closed once nothing holds it (the metadata was invalidated, the requests go).
    drop((r, w));
    assert_eq!(fake::counts(old_ino).closes, 1);

    // Fresh requests reach the new incarnation.
    let r = d.create_xfer_req(XferOp::Read, &one(v, lv, size, 0), &one(v, p2.vram, size, 1), "prefill", &o).unwrap();
    assert_eq!(run(&d, &r).unwrap(), Status::Success);
    assert!(slice(lv, size).iter().all(|&b| b == 9));
    p2.kill();
}

/// The target re-executes itself in place with ASLR off (same pid and start time, a new image, its VRAM at
/// the same device address): the initiator's next READ and WRITE through the handle it opened before are
/// REMOTE_DISCONNECT (the old incarnation's exit/exec sentinel was flipped by the kernel at exec), the old allocation
/// gets no copy, and the new image's memory is untouched. A pidfd check cannot see this (same process).
#[test]
fn vram_peer_exec_in_place_is_a_disconnect() {
    let size = MIB;
    let mut p = Prefill::start_with(size, 4, true, None, &[("GIXL_NORAND", "1")]);
    let d = decode("vram-exec-decode");
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    d.load_remote_md(&p.md).unwrap();
    let o = XferOpts::default();
    let v = MemType::Vram;
    let r = d.create_xfer_req(XferOp::Read, &one(v, lv, size, 0), &one(v, p.vram, size, 1), "prefill", &o).unwrap();
    let w = d.create_xfer_req(XferOp::Write, &one(v, lv, size, 0), &one(v, p.vram, size, 1), "prefill", &o).unwrap();
    assert_eq!(run(&d, &r).unwrap(), Status::Success);
    assert!(slice(lv, size).iter().all(|&b| b == 4));
    let (pid, old_vram, old_ino) = (p.child.id(), p.vram, p.ino());

    p.exec(8);
    assert_eq!(p.child.id(), pid);
    assert_eq!(p.vram, old_vram, "the new image's VRAM is at the old address");
    assert_ne!(p.ino(), old_ino);
    let before = fake::counts(old_ino);
    slice(lv, size).fill(0x66);
    for req in [&w, &r] {
        let e = run(&d, req).unwrap_err();
        assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
    }
    assert_eq!(fake::counts(old_ino).copies, before.copies, "a copy reached the old image's allocation");
    assert_eq!(p.sums().0, 8 * size as u64, "the new image's memory changed");
    assert!(slice(lv, size).iter().all(|&b| b == 0x66), "the READ landed");
    // Fresh metadata from the new image works.
    d.invalidate_remote_md("prefill").unwrap();
    d.load_remote_md(&p.md).unwrap();
    let r = d.create_xfer_req(XferOp::Read, &one(v, lv, size, 0), &one(v, p.vram, size, 1), "prefill", &o).unwrap();
    assert_eq!(run(&d, &r).unwrap(), Status::Success);
    assert!(slice(lv, size).iter().all(|&b| b == 8));
    p.kill();
}

/// Where the kernel refuses `pidfd_getfd` (another uid allowed by `GIXL_ALLOW_UIDS`, Yama, a container's
/// seccomp profile; forced here with the test fault `no_pidfd_getfd` on the initiator's engine), the peer's
/// transfer gate and its VMM allocation's descriptor come over its control socket with SCM_RIGHTS instead,
/// identity-checked: VRAM READ and WRITE (and the staged DRAM route) work byte for byte, the allocation
/// opened once.
#[test]
fn vram_descriptors_come_over_the_control_socket_when_pidfd_getfd_is_refused() {
    let size = 4 * MIB;
    let mut p = Prefill::start(size, 6, true, None);
    assert!(gixl::device::select_fake());
    let d = Agent::new("vram-scm-decode", AgentConfig::default()).unwrap();
    let params: Params = [("test_fault".to_owned(), "no_pidfd_getfd".to_owned())].into_iter().collect();
    d.create_backend("UCX", &params).unwrap();
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    d.load_remote_md(&p.md).unwrap();
    let o = XferOpts::default();
    let (v, dr) = (MemType::Vram, MemType::Dram);
    let r = d.create_xfer_req(XferOp::Read, &one(v, lv, size, 0), &one(v, p.vram, size, 1), "prefill", &o).unwrap();
    assert_eq!(run(&d, &r).unwrap(), Status::Success);
    assert!(slice(lv, size).iter().all(|&b| b == 6));
    for (i, b) in slice(lv, size).iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let w = d.create_xfer_req(XferOp::Write, &one(v, lv, size, 0), &one(v, p.vram, size, 1), "prefill", &o).unwrap();
    assert_eq!(run(&d, &w).unwrap(), Status::Success);
    let want: u64 = (0..size).map(|i| (i % 251) as u64).sum();
    assert_eq!(p.sums().0, want);
    assert_eq!(fake::counts(p.ino()).opens, 1);
    // Local VRAM → remote DRAM: cross-memory attach through the gate received the same way.
    let s = d.create_xfer_req(XferOp::Write, &one(v, lv, size, 0), &one(dr, p.dram, size, 0), "prefill", &o).unwrap();
    assert_eq!(run(&d, &s).unwrap(), Status::Success);
    assert_eq!(p.sums().1, want);
    p.kill();
}

/// A registered region spanning three allocations mapped back to back (as PyTorch's expandable segments
/// map physical chunks into one range): each chunk is exported and opened once on its own, and copies are
/// cut at chunk boundaries. READ and WRITE, whole and across both boundaries at odd offsets, in 4 KiB blocks
/// that straddle them, checked byte for byte (WRITE: by a hash the target computes).
#[test]
fn vram_region_spanning_three_chunks_cross_process() {
    let sizes = [MIB, 3 * MIB / 2, MIB / 2];
    let size: usize = sizes.iter().sum();
    let list = sizes.map(|n| n.to_string()).join(",");
    let mut p = Prefill::start_with(size, 0, true, None, &[("GIXL_CHUNKS", &list)]);
    assert_eq!(p.inos.len(), 3);
    assert_eq!(p.ask("pattern"), "ok");
    let d = decode("vram-chunks-decode");
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    d.load_remote_md(&p.md).unwrap();
    let o = XferOpts::default();
    let v = MemType::Vram;
    let want = |k: u8| (0..size).map(|i| pattern(i, k)).collect::<Vec<u8>>();

    // READ the whole region.
    let r = d.create_xfer_req(XferOp::Read, &one(v, lv, size, 0), &one(v, p.vram, size, 1), "prefill", &o).unwrap();
    assert_eq!(run(&d, &r).unwrap(), Status::Success);
    assert!(slice(lv, size)[..] == want(1)[..], "whole READ differs");
    // READ one descriptor over both boundaries, starting and ending at odd offsets.
    slice(lv, size).fill(0);
    let (from, len) = (MIB - 1001, 3 * MIB / 2 + 2003);
    let r = d
        .create_xfer_req(XferOp::Read, &one(v, lv + 5, len, 0), &one(v, p.vram + from as u64, len, 1), "prefill", &o)
        .unwrap();
    assert_eq!(run(&d, &r).unwrap(), Status::Success);
    assert!(slice(lv, size)[5..5 + len] == want(1)[from..from + len], "straddling READ differs");
    assert!(slice(lv, size)[..5].iter().chain(&slice(lv, size)[5 + len..]).all(|&b| b == 0), "READ spilled");

    // WRITE the whole region, then 4 KiB blocks at an offset of 100 (every boundary is inside a block),
    // the remote side in reverse order.
    for (i, b) in slice(lv, size).iter_mut().enumerate() {
        *b = pattern(i, 2);
    }
    let w = d.create_xfer_req(XferOp::Write, &one(v, lv, size, 0), &one(v, p.vram, size, 1), "prefill", &o).unwrap();
    assert_eq!(run(&d, &w).unwrap(), Status::Success);
    assert_eq!(p.ask("hash"), format!("hash {}", fnv(&want(2))));
    let bs = 4096;
    let n = (size - 100) / bs;
    let mut mirror = want(2);
    let mut local = Vec::new();
    let mut remote = Vec::new();
    for i in 0..n {
        let (l, r) = (i * bs, 100 + (n - 1 - i) * bs);
        for j in 0..bs {
            slice(lv, size)[l + j] = pattern(l + j, 3);
            mirror[r + j] = pattern(l + j, 3);
        }
        local.push(Desc::new(lv + l as u64, bs as u64, 0));
        remote.push(Desc::new(p.vram + r as u64, bs as u64, 1));
    }
    let (local, remote) = (XferDList::with_descs(v, local), XferDList::with_descs(v, remote));
    let wb = d.create_xfer_req(XferOp::Write, &local, &remote, "prefill", &o).unwrap();
    assert_eq!(run(&d, &wb).unwrap(), Status::Success);
    assert_eq!(p.ask("hash"), format!("hash {}", fnv(&mirror)), "block WRITE differs");
    // And back: READ the same blocks into a cleared buffer.
    slice(lv, size).fill(0);
    let rb = d.create_xfer_req(XferOp::Read, &local, &remote, "prefill", &o).unwrap();
    assert_eq!(run(&d, &rb).unwrap(), Status::Success);
    for i in 0..n {
        let (l, r) = (i * bs, 100 + (n - 1 - i) * bs);
        assert!(slice(lv, size)[l..l + bs] == mirror[r..r + bs], "block {i} READ differs");
    }

    // Each chunk opened exactly once, and copies went through every one of them.
    for ino in &p.inos {
        let c = fake::counts(*ino);
        assert_eq!(c.opens, 1, "chunk {ino}");
        assert!(c.copies > 0, "chunk {ino} was never copied through");
    }
    p.kill();
}

/// Fabric handles, as the fake emulates them (`GIXL_FAKE_FABRIC=1` in the exporter: each VMM chunk gets a
/// name under /dev/shm for as long as it is exported, and the 64-byte handle names it): the importer opens
/// every chunk by its fabric handle, taking no descriptor from the exporter, and READ and WRITE move the
/// bytes exactly; deregistration removes the names. Where the fabric export is refused
/// (`GIXL_FAKE_FABRIC=refuse`, as with no IMEX channel) the chunks go as POSIX fds, and where the importer
/// cannot import fabric handles (`fake::set_fabric_import(false)`) it takes the fd appended to each fabric
/// handle: the same transfers work either way.
#[test]
fn vram_fabric_handles_cross_process_and_the_posix_fd_fallback() {
    let size = 4 * MIB;
    // Only this test makes fabric handles, so switching imports off here affects no other test.
    for (mode, import) in [("1", true), ("refuse", true), ("1", false)] {
        fake::set_fabric_import(import);
        let exported = mode == "1";
        let fabric = exported && import;
        let list = format!("{},{}", 3 * MIB, MIB);
        let mut p =
            Prefill::start_with(size, 0, true, None, &[("GIXL_FAKE_FABRIC", mode), ("GIXL_CHUNKS", list.as_str())]);
        assert_eq!(p.inos.len(), 2);
        let names: Vec<String> =
            p.inos.iter().map(|ino| format!("/dev/shm/gixl-fake-fabric-{}-{ino}", p.child.id())).collect();
        for n in &names {
            assert_eq!(std::path::Path::new(n).exists(), exported, "{n} (mode {mode})");
        }
        assert_eq!(p.ask("pattern"), "ok");
        let d = decode(&format!("vram-fabric-decode-{mode}-{import}"));
        let lv = fake::alloc(0, size, false, None).unwrap();
        reg(&d, MemType::Vram, lv, size, 0);
        d.load_remote_md(&p.md).unwrap();
        let (o, v) = (XferOpts::default(), MemType::Vram);
        let want = |k: u8| (0..size).map(|i| pattern(i, k)).collect::<Vec<u8>>();
        let r = d.create_xfer_req(XferOp::Read, &one(v, lv, size, 0), &one(v, p.vram, size, 1), "prefill", &o).unwrap();
        assert_eq!(run(&d, &r).unwrap(), Status::Success);
        assert!(slice(lv, size)[..] == want(1)[..], "READ differs (mode {mode})");
        for (i, b) in slice(lv, size).iter_mut().enumerate() {
            *b = pattern(i, 2);
        }
        let w =
            d.create_xfer_req(XferOp::Write, &one(v, lv, size, 0), &one(v, p.vram, size, 1), "prefill", &o).unwrap();
        assert_eq!(run(&d, &w).unwrap(), Status::Success);
        assert_eq!(p.ask("hash"), format!("hash {}", fnv(&want(2))), "WRITE differs (mode {mode})");
        for ino in &p.inos {
            let c = fake::counts(*ino);
            assert_eq!((c.opens, c.fabric_opens), (1, fabric as u64), "chunk {ino} (mode {mode})");
            assert!(c.copies > 0, "chunk {ino} was never copied through");
        }
        assert_eq!(p.ask("dereg"), "ok");
        for n in &names {
            assert!(!std::path::Path::new(n).exists(), "{n} outlived its export");
        }
        p.kill();
    }
    fake::set_fabric_import(true);
}

/// Where the kernel denies the initiator both `pidfd_getfd` and cross-memory attach (it runs as `nobody`; the
/// target is root and allows that uid with `GIXL_ALLOW_UIDS`), the target's gate and its VMM allocation's
/// descriptor come over its control socket, and the identity check is the target's exit/exec sentinel in
/// that gate, which needs no ptrace permission: VRAM READ and WRITE through the IPC handle work, byte for
/// byte. Needs root; skips otherwise.
#[test]
fn vram_ipc_works_where_the_kernel_denies_ptrace() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        common::skip("cma", "needs root to start a child as another user");
        return;
    }
    use std::os::unix::process::CommandExt;
    let size = 2 * MIB;
    let mut p = Prefill::start_with(size, 7, true, None, &[("GIXL_ALLOW_UIDS", "65534")]);
    let exe = common::ExeForOthers::new();
    let out = Command::new(&exe.path)
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", "vram-nobody")
        .env("GIXL_MD", hex(&p.md))
        .env("GIXL_ADDR", p.vram.to_string())
        .env("GIXL_SIZE", size.to_string())
        .env("GIXL_FILL", "7")
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(line) = text.lines().find_map(|l| l.strip_prefix("@nobody ")) else {
        if !out.status.success() {
            common::skip("cma", &format!("the child could not run as nobody ({})", out.status));
            p.kill();
            return;
        }
        panic!("the child printed no result: {text}");
    };
    assert_eq!(line, "Success true Success", "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(p.sums().0, 0x5c * size as u64, "the WRITE did not land");
    p.kill();
}

#[test]
fn vram_without_a_device_layer_is_not_supported() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", "vram-nodevice")
        .env_remove("GIXL_FAKE_DEVICE")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&out.stdout);
    let line = out.lines().find_map(|l| l.strip_prefix("@status ")).expect("child printed no status");
    let driver = std::path::Path::new("/dev/nvidiactl").exists();
    if cfg!(feature = "cuda") && driver {
        // A host pointer on a machine with a driver: refused as not device memory.
        assert!(line.contains("not device memory"), "{line}");
    } else if cfg!(feature = "cuda") {
        assert!(line.starts_with("NotSupported") && line.contains("VRAM is not available"), "{line}");
    } else {
        assert!(line.starts_with("NotSupported") && line.contains("`cuda` feature"), "{line}");
    }
}

/// `deregister_memory` racing a large WRITE from another process: whenever it returns (before, during or
/// after the copy), not one byte lands afterwards. The child snapshots its buffer when `deregister_mem`
/// returns; the parent waits for its request to end (DONE or NOT_FOUND), then the child compares.
#[test]
fn vram_deregistration_waits_for_copies_in_flight() {
    let size = 64 * MIB;
    let mut p = Prefill::start(size, 1, false, None);
    let d = decode("vram-inflight-decode");
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    let o = XferOpts::default();
    let mut outcomes = Vec::new();
    for round in 0..4u8 {
        if round > 0 {
            // Registered again for the next round, fresh metadata.
            p.kill();
            p = Prefill::start(size, 1, false, None);
            d.invalidate_remote_md("prefill").unwrap();
        }
        d.load_remote_md(&p.md).unwrap();
        slice(lv, size).fill(0xA0 + round);
        let w = d
            .create_xfer_req(
                XferOp::Write,
                &one(MemType::Vram, lv, size, 0),
                &one(MemType::Vram, p.vram, size, 1),
                "prefill",
                &o,
            )
            .unwrap();
        let posted = d.post_xfer_req(&w, NotifUpdate::Keep);
        assert_eq!(p.ask("dereg-snap"), "ok");
        let end = match posted {
            Ok(Status::InProg) => {
                let t = Instant::now();
                loop {
                    match d.xfer_status(&w) {
                        Ok(Status::InProg) if t.elapsed() < Duration::from_secs(20) => std::thread::yield_now(),
                        other => break other,
                    }
                }
            }
            other => other,
        };
        match &end {
            Ok(s) => assert_eq!(*s, Status::Success),
            Err(e) => assert_eq!(e.status(), Status::NotFound, "{e}"),
        }
        outcomes.push(end.map_err(|e| e.status()));
        assert_eq!(p.ask("same"), "same true", "round {round}: bytes landed after deregister_mem returned");
        // Whatever happened before, the request is refused now.
        assert_eq!(run(&d, &w).unwrap_err().status(), Status::NotFound);
    }
    eprintln!("outcomes of the racing WRITE: {outcomes:?}");
    p.kill();
}

/// Per-batch cost of the cross-process VRAM route, end to end: median post → DONE of a 4 KiB READ and
/// WRITE (one batch each) to another process's fake VRAM. Run by hand:
/// `cargo test --release --test vram measure_small_vram_latency -- --ignored --nocapture`.
#[test]
#[ignore]
fn measure_small_vram_latency() {
    let size = MIB;
    let p = Prefill::start(size, 3, true, None);
    let d = decode("vram-lat-decode");
    let lv = fake::alloc(0, size, false, None).unwrap();
    reg(&d, MemType::Vram, lv, size, 0);
    d.load_remote_md(&p.md).unwrap();
    let o = XferOpts::default();
    let v = MemType::Vram;
    for op in [XferOp::Read, XferOp::Write] {
        let r = d.create_xfer_req(op, &one(v, lv, 4096, 0), &one(v, p.vram, 4096, 1), "prefill", &o).unwrap();
        let mut t: Vec<u64> = (0..3000)
            .map(|_| {
                let t0 = Instant::now();
                let mut s = d.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
                while s == Status::InProg {
                    s = d.xfer_status(&r).unwrap();
                }
                assert_eq!(s, Status::Success);
                t0.elapsed().as_nanos() as u64
            })
            .collect();
        t.sort_unstable();
        eprintln!(
            "4 KiB {op:?} cross-process VRAM: median {:.2} µs, p90 {:.2} µs",
            t[1500] as f64 / 1e3,
            t[2700] as f64 / 1e3
        );
    }
    p.kill();
}
