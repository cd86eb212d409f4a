//! The engine's libfabric route between two real processes, over the real library (Debian's libfabric 1.17,
//! see tests/common/fabric.rs) with `GIXL_TRANSPORT=fabric` so that two processes of one host take it:
//! - the tcp provider (`tcp;ofi_rxm`) on this host's interface: READ and WRITE of 64 MiB and of 1024 × 16 KiB
//!   scattered blocks, data checked, notifications after the data, the route doctor and telemetry name, a
//!   region deregistered and registered again at the same address (the old handle refused with NOT_FOUND, the new
//!   region untouched), a target killed in the middle of a transfer (REMOTE_DISCONNECT within the bound), its
//!   restart under the same name (the stale handle NOT_FOUND, the new incarnation reached over libfabric);
//! - the shm provider on this host: READ and WRITE of 64 MiB and 1024 × 16 KiB;
//! - a provider without one-sided RMA (udp): its self-test fails, the peer goes over TCP, and the doctor's
//!   report says which device failed at which step;
//! - strangers on the greeting (the route's connection kind on the TCP listener) get nothing;
//! - the tcp provider between two network namespaces joined by a bridge (needs root: skipped as `netns`
//!   otherwise): 64 MiB READ and WRITE and 1024 × 16 KiB READ, data checked; and over two rails (two bridges):
//!   both carry data, a rail whose self-test failed (at either end) none, a target with one rail still served,
//!   and a region deregistered under a WRITE over both rails is quiet once deregistration returns.
//!
//! Each side names its provider by its full name (backend parameter `fabric_provider`). The child is this binary
//! re-run with `GIXL_CHILD=fabric-prefill` (its provider in `GIXL_FABRIC_PROVIDER`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command};
use std::time::{Duration, Instant};

use gixl::*;

mod common;
use common::fabric::{agent, setup};
use common::route_of;
use common::{hex, unhex};

const SIZE: usize = 64 << 20;
const BLOCK: usize = 16 << 10;

fn reg_list(buf: &[u8]) -> RegDList {
    let d = Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0);
    RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }])
}

/// The target: `SIZE` bytes, byte i = (i + seed) % 251; `@md <md> <addr>`; then commands.
fn prefill_child() {
    setup("fabric child").expect("the parent found libfabric");
    let seed: usize = std::env::var("GIXL_SEED").unwrap().parse().unwrap();
    if std::env::var("GIXL_TEST_STALE_SHM").is_ok() {
        // What a killed process with this process's id left behind: the shm provider's region under that id.
        let f = std::fs::File::create(format!("/dev/shm/{}:0:0", std::process::id())).unwrap();
        f.set_len(16 << 20).unwrap();
    }
    let a = agent("prefill", &std::env::var("GIXL_FABRIC_PROVIDER").unwrap());
    let mut buf = vec![0u8; SIZE];
    buf.iter_mut().enumerate().for_each(|(i, b)| *b = ((i + seed) % 251) as u8);
    a.register_mem(&reg_list(&buf), &[]).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "\n@md {} {}", hex(&a.local_md().unwrap()), buf.as_ptr() as u64).unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        match line.unwrap().as_str() {
            "notifs" => {
                for (from, msg) in a.notifs(&[]).unwrap() {
                    writeln!(out, "notif {from} {}", String::from_utf8_lossy(&msg)).unwrap();
                }
                writeln!(out, "end").unwrap();
            }
            "sum" => writeln!(out, "sum {}", buf.iter().map(|&b| b as u64).sum::<u64>()).unwrap(),
            // The process's CPU time (user + system, clock ticks), idle meanwhile.
            "cpu" => {
                let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
                let f: Vec<&str> = stat.rsplit(')').next().unwrap().split_whitespace().collect();
                let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
                writeln!(out, "cpu {ticks}").unwrap()
            }
            // Deregistered while a peer's WRITE may be landing: after deregistration returns, the buffer must
            // not change any more.
            "quiet" => {
                a.deregister_mem(&reg_list(&buf), &[]).unwrap();
                // One byte per page, read at once (a whole copy would take long enough for late bytes to land
                // before it), then again later: any that changed were written after deregistration returned.
                let first: Vec<u8> = buf.iter().step_by(4096).copied().collect();
                std::thread::sleep(Duration::from_millis(300));
                let changed = buf.iter().step_by(4096).zip(&first).filter(|(a, b)| a != b).count();
                let ones = first.iter().filter(|&&v| v == 1).count();
                writeln!(out, "quiet {changed} {ones}").unwrap();
            }
            "rereg" => {
                a.deregister_mem(&reg_list(&buf), &[]).unwrap();
                buf.iter_mut().for_each(|b| *b = 0xEE);
                a.register_mem(&reg_list(&buf), &[]).unwrap();
                writeln!(out, "@md {} {}", hex(&a.local_md().unwrap()), buf.as_ptr() as u64).unwrap();
            }
            _ => break,
        }
        out.flush().unwrap();
    }
}

/// The initiator in another network namespace: READ 64 MiB from the target (`GIXL_PEER_MD`, `GIXL_PEER_ADDR`)
/// and check it, READ 1024 × 16 KiB, WRITE 64 MiB of twos; `@decoded <route> <what failed, or ok>`.
fn decode_child() {
    setup("fabric decode child").expect("the parent found libfabric");
    let a = agent("decode-ns", &std::env::var("GIXL_FABRIC_PROVIDER").unwrap());
    let md = unhex(&std::env::var("GIXL_PEER_MD").unwrap());
    let raddr: u64 = std::env::var("GIXL_PEER_ADDR").unwrap().parse().unwrap();
    let dst = vec![0u8; SIZE];
    let twos = vec![2u8; SIZE];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    a.register_mem(&reg_list(&twos), &[]).unwrap();
    a.load_remote_md(&md).unwrap();
    let route = route_of("decode-ns", "prefill");
    let mut bad = Vec::new();
    if run(&a, XferOp::Read, &local(&dst, 0, SIZE), &remote(raddr, 0, SIZE), None).ok() != Some(Status::Success)
        || !dst.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8)
    {
        bad.push("64MiB-read");
    }
    let (l, r) = blocks(dst.as_ptr() as u64, raddr);
    let ok = run(&a, XferOp::Read, &l, &r, None).ok() == Some(Status::Success);
    if !ok || !(0..1024).all(|i| dst[i * BLOCK] == (((1023 - i) * BLOCK) % 251) as u8) {
        bad.push("blocks-read");
    }
    if run(&a, XferOp::Write, &local(&twos, 0, SIZE), &remote(raddr, 0, SIZE), None).ok() != Some(Status::Success) {
        bad.push("64MiB-write");
    }
    let verdict = if bad.is_empty() { "ok".to_owned() } else { bad.join(",") };
    // Each device's self-test as this process's doctor shows them.
    let doctor = gixl::telemetry::doctor::report(None);
    let rails: Vec<String> = gixl::fabric::selftest::records()
        .iter()
        .map(|r| format!("{}:{}:{}", r.device, if r.passed { "passed" } else { "failed" }, r.step.unwrap_or("-")))
        .filter(|r| doctor.contains(r.split(':').next().unwrap_or("")))
        .collect();
    println!("\n@rails {}", rails.join(" "));
    println!("\n@decoded {route} {verdict}");
}

/// An initiator in another network namespace: an 8 × 64 MiB WRITE of ones and twos in turn to the target
/// (`GIXL_PEER_MD`, `GIXL_PEER_ADDR`), `@posted` once posted, `@wrote <status>` once it ended.
fn writer_child() {
    setup("fabric writer child").expect("the parent found libfabric");
    let a = agent("writer-ns", &std::env::var("GIXL_FABRIC_PROVIDER").unwrap());
    let md = unhex(&std::env::var("GIXL_PEER_MD").unwrap());
    let raddr: u64 = std::env::var("GIXL_PEER_ADDR").unwrap().parse().unwrap();
    // Ones and twos in turn: every page keeps changing while the WRITE lands, so a byte landing after
    // deregistration shows, whatever was written before.
    let (ones, twos) = (vec![1u8; SIZE], vec![2u8; SIZE]);
    a.register_mem(&reg_list(&ones), &[]).unwrap();
    a.register_mem(&reg_list(&twos), &[]).unwrap();
    a.load_remote_md(&md).unwrap();
    let src = |i: usize| if i.is_multiple_of(2) { ones.as_ptr() as u64 } else { twos.as_ptr() as u64 };
    let l = XferDList::with_descs(MemType::Dram, (0..8).map(|i| Desc::new(src(i), SIZE as u64, 0)).collect());
    let r = XferDList::with_descs(MemType::Dram, (0..8).map(|_| Desc::new(raddr, SIZE as u64, 0)).collect());
    let req = a.create_xfer_req(XferOp::Write, &l, &r, "prefill", &XferOpts::default()).unwrap();
    let s = a.post_xfer_req(&req, NotifUpdate::Keep).unwrap();
    println!("\n@posted {}", route_of("writer-ns", "prefill"));
    let end = wait(&a, &req, s).map_or_else(|e| format!("{:?}", e.status()), |s| format!("{s:?}"));
    println!("\n@wrote {end}");
}

#[test]
fn child_entry() {
    match std::env::var("GIXL_CHILD").as_deref() {
        Ok("fabric-prefill") => prefill_child(),
        Ok("fabric-decode") => decode_child(),
        Ok("fabric-writer") => writer_child(),
        _ => {}
    }
}

struct Prefill {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    md: Vec<u8>,
    addr: u64,
}

impl Prefill {
    fn start(seed: usize, provider: &str) -> Prefill {
        Prefill::start_in(None, seed, provider)
    }

    /// In network namespace `ns`, where given.
    fn start_in(ns: Option<&str>, seed: usize, provider: &str) -> Prefill {
        Prefill::start_with(ns, seed, provider, &[])
    }

    /// As `start_in`, with `env` set in the child.
    fn start_with(ns: Option<&str>, seed: usize, provider: &str, env: &[(&str, &str)]) -> Prefill {
        let mut c = child_in(ns);
        c.envs(env.iter().copied());
        c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env("GIXL_CHILD", "fabric-prefill")
            .env("GIXL_SEED", seed.to_string())
            .env("GIXL_FABRIC_PROVIDER", provider);
        let (child, stdin, stdout, rest) = common::spawn_until_md(c);
        let mut it = rest.split(' ');
        let md = unhex(it.next().unwrap());
        let addr = it.next().unwrap().parse().unwrap();
        Prefill { child, stdin, stdout, md, addr }
    }

    /// This binary as the initiator child `role` (`fabric-decode`, `fabric-writer`) in network namespace `ns`,
    /// over the tcp provider, pointed at this target; its stdout piped.
    fn initiator(&self, ns: &str, role: &str) -> Command {
        let mut c = child_in(Some(ns));
        c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env("GIXL_CHILD", role)
            .env("GIXL_FABRIC_PROVIDER", "tcp;ofi_rxm")
            .env("GIXL_PEER_MD", hex(&self.md))
            .env("GIXL_PEER_ADDR", self.addr.to_string())
            .stdout(std::process::Stdio::piped());
        c
    }

    fn ask(&mut self, cmd: &str, until: &str) -> Vec<String> {
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut lines = Vec::new();
        loop {
            let mut l = String::new();
            assert!(self.stdout.read_line(&mut l).unwrap() > 0, "the child exited");
            let l = l.trim().to_owned();
            let done = l.starts_with(until);
            lines.push(l);
            if done {
                return lines;
            }
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A killed child leaves its shm regions behind (tmpfs: memory).
        gixl::fabric::clear_shm_regions(self.child.id());
    }
}

/// This binary as a child, in network namespace `ns` where given.
fn child_in(ns: Option<&str>) -> Command {
    let exe = std::env::current_exe().unwrap();
    match ns {
        None => Command::new(exe),
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(exe);
            c
        }
    }
}

impl Drop for Prefill {
    fn drop(&mut self) {
        self.kill();
    }
}

fn remote(addr: u64, off: usize, len: usize) -> XferDList {
    XferDList::with_descs(MemType::Dram, vec![Desc::new(addr + off as u64, len as u64, 0)])
}

fn local(buf: &[u8], off: usize, len: usize) -> XferDList {
    XferDList::with_descs(MemType::Dram, vec![Desc::new(buf.as_ptr() as u64 + off as u64, len as u64, 0)])
}

/// 1024 blocks of `base` in order, and 1024 of the remote `raddr` reversed.
fn blocks(base: u64, raddr: u64) -> (XferDList, XferDList) {
    let n = 1024;
    let l = (0..n).map(|i| Desc::new(base + (i * BLOCK) as u64, BLOCK as u64, 0)).collect();
    let r = (0..n).map(|i| Desc::new(raddr + ((n - 1 - i) * BLOCK) as u64, BLOCK as u64, 0)).collect();
    (XferDList::with_descs(MemType::Dram, l), XferDList::with_descs(MemType::Dram, r))
}

/// Post and wait (sleeping between looks, as an application would).
fn run(a: &Agent, op: XferOp, l: &XferDList, r: &XferDList, notif: Option<&[u8]>) -> Result<Status> {
    let opts = XferOpts { notif: notif.map(<[u8]>::to_vec), ..Default::default() };
    let req = a.create_xfer_req(op, l, r, "prefill", &opts)?;
    let s = a.post_xfer_req(&req, NotifUpdate::Keep)?;
    wait(a, &req, s)
}

fn wait(a: &Agent, req: &XferReq, mut s: Status) -> Result<Status> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while s == Status::InProg {
        assert!(Instant::now() < deadline, "a request did not finish in 60 s");
        std::thread::sleep(Duration::from_micros(200));
        s = a.xfer_status(req)?;
    }
    Ok(s)
}

/// After the target deregistered its buffer and registered it again filled with 0xEE (`rereg`, which answered
/// `md_line`): the new region was not written, and its metadata loaded again reaches it over `route`.
fn reloaded(a: &Agent, me: &str, p: &mut Prefill, md_line: &str, dst: &mut [u8], route: &str) {
    assert_eq!(p.ask("sum", "sum")[0], format!("sum {}", 0xEE * SIZE as u64), "the new region was written");
    let md = unhex(md_line.strip_prefix("@md ").unwrap().split(' ').next().unwrap());
    a.invalidate_remote_md("prefill").unwrap();
    a.load_remote_md(&md).unwrap();
    assert_eq!(route_of(me, "prefill"), route);
    assert_eq!(run(a, XferOp::Read, &local(dst, 0, 4096), &remote(p.addr, 0, 4096), None).unwrap(), Status::Success);
    assert!(dst[..4096].iter().all(|&b| b == 0xEE));
}

fn failure(a: &Agent, req: &XferReq) -> Error {
    match a.post_xfer_req(req, NotifUpdate::Keep) {
        Ok(s) => wait(a, req, s).unwrap_err(),
        Err(e) => e,
    }
}

/// READ and WRITE of 64 MiB and of 1024 × 16 KiB (remote blocks reversed) to `p` (byte i = (i + seed) % 251),
/// data checked (WRITEs checked by the target's sum).
fn read_write(a: &Agent, me: &str, p: &mut Prefill, seed: usize, dst: &mut [u8], ones: &[u8]) {
    dst.iter_mut().for_each(|b| *b = 0);
    assert_eq!(run(a, XferOp::Read, &local(dst, 0, SIZE), &remote(p.addr, 0, SIZE), None).unwrap(), Status::Success);
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + seed) % 251) as u8), "64 MiB READ");
    dst.iter_mut().for_each(|b| *b = 0);
    let (l, r) = blocks(dst.as_ptr() as u64, p.addr);
    assert_eq!(run(a, XferOp::Read, &l, &r, Some(b"kv read")).unwrap(), Status::Success);
    for i in 0..1024 {
        let base = (1023 - i) * BLOCK;
        let ok = dst[i * BLOCK..(i + 1) * BLOCK].iter().enumerate().all(|(j, &b)| b == ((base + j + seed) % 251) as u8);
        assert!(ok, "block {i}");
    }
    let (l1, r1) = blocks(ones.as_ptr() as u64, p.addr);
    assert_eq!(run(a, XferOp::Write, &l1, &r1, None).unwrap(), Status::Success);
    // The blocks cover the first 16 MiB: ones there, the pattern after.
    let rest: u64 = (1024 * BLOCK..SIZE).map(|i| ((i + seed) % 251) as u64).sum();
    assert_eq!(p.ask("sum", "sum")[0], format!("sum {}", (1024 * BLOCK) as u64 + rest), "1024 × 16 KiB WRITE");
    let twos = vec![2u8; SIZE];
    a.register_mem(&reg_list(&twos), &[]).unwrap();
    assert_eq!(
        run(a, XferOp::Write, &local(&twos, 0, SIZE), &remote(p.addr, 0, SIZE), Some(b"kv written")).unwrap(),
        Status::Success
    );
    // The notification left after the data: when it is there, so are the bytes.
    let mut notifs = Vec::new();
    let t = Instant::now();
    while notifs.len() < 2 && t.elapsed() < Duration::from_secs(10) {
        notifs.extend(p.ask("notifs", "end").into_iter().filter(|l| l.starts_with("notif ")));
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(notifs, [format!("notif {me} kv read"), format!("notif {me} kv written")]);
    assert_eq!(p.ask("sum", "sum")[0], format!("sum {}", 2 * SIZE), "64 MiB WRITE");
    a.deregister_mem(&reg_list(&twos), &[]).unwrap();
}

#[test]
fn tcp_provider_between_two_processes_reads_writes_notifies_and_survives_deregistration_death_and_restart() {
    if setup("fabric route tcp").is_none() {
        return;
    }
    let mut p = Prefill::start(0, "tcp;ofi_rxm");
    let a = agent("decode", "tcp;ofi_rxm");
    let mut dst = vec![0u8; SIZE];
    let ones = vec![1u8; SIZE];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    a.register_mem(&reg_list(&ones), &[]).unwrap();
    assert_eq!(a.load_remote_md(&p.md).unwrap(), "prefill");
    assert_eq!(route_of("decode", "prefill"), "libfabric");
    read_write(&a, "decode", &mut p, 0, &mut dst, &ones);
    let doctor = gixl::telemetry::doctor::report(None);
    assert!(doctor.contains("tcp;ofi_rxm"), "{doctor}");
    // Connected but idle, the target's progress thread sleeps on its queue's descriptor (up to 100 ms a time):
    // its process spends next to nothing in a second.
    let cpu = |p: &mut Prefill| p.ask("cpu", "cpu")[0][4..].parse::<u64>().unwrap();
    let before = cpu(&mut p);
    std::thread::sleep(Duration::from_secs(1));
    let ticks = cpu(&mut p) - before;
    eprintln!("target's CPU while connected and idle: {ticks} ticks in 1 s");
    assert!(ticks <= 5, "{ticks} clock ticks of CPU in an idle second");

    // The target deregisters and registers the same buffer again: the handle made before is refused (its key is
    // closed; a provider that picks keys never hands that value out again) and the new region is untouched.
    let before = a
        .create_xfer_req(
            XferOp::Write,
            &local(&dst, 0, 4096),
            &remote(p.addr, 0, 4096),
            "prefill",
            &XferOpts::default(),
        )
        .unwrap();
    let md = p.ask("rereg", "@md").pop().unwrap();
    let e = failure(&a, &before);
    assert_eq!(e.status(), Status::NotFound, "{e}");
    reloaded(&a, "decode", &mut p, &md, &mut dst, "libfabric");

    // Killed in the middle of a transfer (8 × 64 MiB READ): REMOTE_DISCONNECT within the bound.
    let stale = a
        .create_xfer_req(XferOp::Read, &local(&dst, 0, 4096), &remote(p.addr, 0, 4096), "prefill", &XferOpts::default())
        .unwrap();
    let big_l =
        XferDList::with_descs(MemType::Dram, (0..8).map(|_| Desc::new(dst.as_ptr() as u64, SIZE as u64, 0)).collect());
    let big_r = XferDList::with_descs(MemType::Dram, (0..8).map(|_| Desc::new(p.addr, SIZE as u64, 0)).collect());
    let req = a.create_xfer_req(XferOp::Read, &big_l, &big_r, "prefill", &XferOpts::default()).unwrap();
    let s = a.post_xfer_req(&req, NotifUpdate::Keep).unwrap();
    assert_eq!(s, Status::InProg, "8 × 64 MiB finished at once");
    std::thread::sleep(Duration::from_millis(20));
    p.kill();
    let t = Instant::now();
    let e = wait(&a, &req, Status::InProg).unwrap_err();
    assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    eprintln!("killed mid-transfer: {e} after {:?}", t.elapsed());

    // Restarted under the same name: the stale handle is refused; the new incarnation is reached over libfabric.
    let mut q = Prefill::start(7, "tcp;ofi_rxm");
    a.invalidate_remote_md("prefill").unwrap();
    a.load_remote_md(&q.md).unwrap();
    let e = a.post_xfer_req(&stale, NotifUpdate::Keep).unwrap_err();
    assert_eq!(e.status(), Status::NotFound, "{e}");
    assert_eq!(route_of("decode", "prefill"), "libfabric");
    assert_eq!(run(&a, XferOp::Read, &local(&dst, 0, SIZE), &remote(q.addr, 0, SIZE), None).unwrap(), Status::Success);
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + 7) % 251) as u8), "the new incarnation's bytes");
    q.kill();
}

#[test]
fn shm_provider_between_two_processes_reads_and_writes() {
    if setup("fabric route shm").is_none() {
        return;
    }
    let mut p = Prefill::start(5, "shm");
    let a = agent("decode-shm", "shm");
    let mut dst = vec![0u8; SIZE];
    let ones = vec![1u8; SIZE];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    a.register_mem(&reg_list(&ones), &[]).unwrap();
    a.load_remote_md(&p.md).unwrap();
    assert_eq!(route_of("decode-shm", "prefill"), "libfabric");
    read_write(&a, "decode-shm", &mut p, 5, &mut dst, &ones);

    // The target deregisters and registers the same buffer again, under a 32 × 64 MiB READ in flight. shm never
    // answers an operation on a closed key; the target's closed-key notice (on the greeting connection) ends the
    // READ in flight with NOT_FOUND within the bound (its operations the target took after the key closed are
    // given up), and has the handles made before refused with NOT_FOUND, READ and WRITE, before posting; the new
    // region is untouched.
    let o = XferOpts::default();
    let before_w = a.create_xfer_req(XferOp::Write, &local(&dst, 0, 4096), &remote(p.addr, 0, 4096), "prefill", &o);
    let before_r = a.create_xfer_req(XferOp::Read, &local(&dst, 0, SIZE), &remote(p.addr, 0, SIZE), "prefill", &o);
    let big_l =
        XferDList::with_descs(MemType::Dram, (0..32).map(|_| Desc::new(dst.as_ptr() as u64, SIZE as u64, 0)).collect());
    let big_r = XferDList::with_descs(MemType::Dram, (0..32).map(|_| Desc::new(p.addr, SIZE as u64, 0)).collect());
    let big = a.create_xfer_req(XferOp::Read, &big_l, &big_r, "prefill", &o).unwrap();
    assert_eq!(a.post_xfer_req(&big, NotifUpdate::Keep).unwrap(), Status::InProg, "32 × 64 MiB finished at once");
    std::thread::sleep(Duration::from_millis(20));
    let md = p.ask("rereg", "@md").pop().unwrap();
    let t = Instant::now();
    let e = wait(&a, &big, Status::InProg).unwrap_err();
    assert_eq!(e.status(), Status::NotFound, "{e}");
    assert!(t.elapsed() < Duration::from_secs(2), "the READ in flight ended after {:?}", t.elapsed());
    eprintln!("shm, a region deregistered under a READ: {e} after {:?}", t.elapsed());
    dst.iter_mut().for_each(|b| *b = 0);
    for req in [before_w.unwrap(), before_r.unwrap()] {
        let t = Instant::now();
        let e = failure(&a, &req);
        assert_eq!(e.status(), Status::NotFound, "{e}");
        assert!(t.elapsed() < Duration::from_secs(2), "refused after {:?}", t.elapsed());
        eprintln!("shm, a deregistered region: {e} after {:?}", t.elapsed());
    }
    assert!(dst.iter().all(|&b| b == 0), "a READ of the deregistered region brought bytes");
    // shm answers its operations in order: the one it dropped holds back every later answer on this rail's
    // endpoint, so the rail was given up (one WARN line) and the peer, loaded again, goes over TCP.
    reloaded(&a, "decode-shm", &mut p, &md, &mut dst, "tcp");
    p.kill();
}

/// A killed process leaves the shm provider's region under its process id; a new process given that id must
/// still open its shm endpoint (Debian's 1.17 refuses it with `EBUSY` unless the dead one's region is removed
/// first, and the peer went over TCP).
#[test]
fn a_dead_process_shm_region_under_the_same_pid_does_not_keep_shm_away() {
    if setup("fabric route shm stale region").is_none() {
        return;
    }
    let mut p = Prefill::start_with(None, 6, "shm", &[("GIXL_TEST_STALE_SHM", "1")]);
    let a = agent("decode-stale", "shm");
    let dst = vec![0u8; 1 << 20];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    a.load_remote_md(&p.md).unwrap();
    assert_eq!(route_of("decode-stale", "prefill"), "libfabric");
    let r = run(&a, XferOp::Read, &local(&dst, 0, dst.len()), &remote(p.addr, 0, dst.len()), None);
    assert_eq!(r.unwrap(), Status::Success);
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + 6) % 251) as u8));
    p.kill();
}

#[test]
fn a_provider_without_rma_fails_its_self_test_and_the_peer_goes_over_tcp() {
    if setup("fabric route udp").is_none() {
        return;
    }
    let mut p = Prefill::start(3, "udp");
    let a = agent("decode-udp", "udp");
    let dst = vec![0u8; 1 << 20];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    a.load_remote_md(&p.md).unwrap();
    assert_eq!(route_of("decode-udp", "prefill"), "tcp");
    assert_eq!(
        run(&a, XferOp::Read, &local(&dst, 0, 1 << 20), &remote(p.addr, 0, 1 << 20), None).unwrap(),
        Status::Success
    );
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + 3) % 251) as u8));
    let rec = gixl::fabric::selftest::records();
    let udp = rec.iter().find(|r| r.device.starts_with("udp")).unwrap_or_else(|| panic!("{rec:?}"));
    assert!(!udp.passed && udp.step == Some("getinfo"), "{udp:?}");
    let doctor = gixl::telemetry::doctor::report(None);
    assert!(doctor.contains("getinfo"), "{doctor}");
    p.kill();
}

#[test]
fn tcp_provider_across_two_network_namespaces() {
    if setup("fabric route netns").is_none() {
        return;
    }
    let Some(net) = common::Net::new("fab", 2) else { return };
    let mut p = Prefill::start_in(Some(&net.ns(0)), 0, "tcp;ofi_rxm");
    let out = p.initiator(&net.ns(1), "fabric-decode").output().unwrap();
    let out = String::from_utf8_lossy(&out.stdout);
    let line = out.lines().find(|l| l.starts_with("@decoded ")).unwrap_or_else(|| panic!("{out}"));
    assert_eq!(line, "@decoded libfabric ok");
    assert_eq!(p.ask("sum", "sum")[0], format!("sum {}", 2 * SIZE), "the 64 MiB WRITE across namespaces");
    p.kill();
}

/// Two rails (two veth pairs on two subnets) between two network namespaces, the READs and WRITEs of
/// `decode_child` each time, data checked: with both rails healthy, both carry a good part of the bytes (pieces
/// spread over the rails: veths have no NUMA node or PCI place to set one apart); a rail whose self-test failed
/// carries none, at the initiator (its path not taken, the doctor naming the failure) or at the target (its
/// greeting refused there, the initiator's path to it dropped); and a target with one rail still works (only
/// the initiator's rail on its subnet is taken). Bytes counted on the target's interfaces.
#[test]
fn tcp_provider_over_two_rails_across_two_network_namespaces() {
    if setup("fabric route rails").is_none() {
        return;
    }
    let Some(net) = common::Net::with_rails("fr", 2, 2) else { return };
    type Env = &'static [(&'static str, &'static str)];
    // (case, the target's environment, the initiator's, which of the target's rails carry the data)
    let cases: [(&str, Env, Env, [bool; 2]); 4] = [
        ("both rails", &[], &[], [true, true]),
        ("the initiator's eth1 failed its self-test", &[], &[("GIXL_TEST_FABRIC_FAIL", "eth1")], [true, false]),
        ("the target's eth0 failed its self-test", &[("GIXL_TEST_FABRIC_FAIL", "eth0")], &[], [false, true]),
        ("the target has one rail", &[("GIXL_FABRIC_DOMAIN", "eth0")], &[], [true, false]),
    ];
    for (case, target_env, decode_env, used) in cases {
        let mut p = Prefill::start_with(Some(&net.ns(0)), 0, "tcp;ofi_rxm", target_env);
        let before = [net.rail_bytes(0, 0), net.rail_bytes(0, 1)];
        let out = p.initiator(&net.ns(1), "fabric-decode").envs(decode_env.iter().copied()).output().unwrap();
        let out = String::from_utf8_lossy(&out.stdout);
        let line = out.lines().find(|l| l.starts_with("@decoded ")).unwrap_or_else(|| panic!("{case}: {out}"));
        assert_eq!(line, "@decoded libfabric ok", "{case}");
        assert_eq!(p.ask("sum", "sum")[0], format!("sum {}", 2 * SIZE), "{case}: the 64 MiB WRITE");
        let rails = out.lines().find(|l| l.starts_with("@rails")).unwrap_or_default();
        assert!(rails.contains("tcp;ofi_rxm/eth0:passed"), "{case}: {rails}");
        let eth1 = if decode_env.is_empty() { "tcp;ofi_rxm/eth1:passed" } else { "tcp;ofi_rxm/eth1:failed:write" };
        assert!(rails.contains(eth1), "{case}: {rails}");
        let moved = [net.rail_bytes(0, 0) - before[0], net.rail_bytes(0, 1) - before[1]];
        eprintln!("{case}: the target's eth0 and eth1 carried {} and {} MiB", moved[0] >> 20, moved[1] >> 20);
        for r in 0..2 {
            if used[r] {
                assert!(moved[r] >= 32 << 20, "{case}: eth{r} carried {} bytes", moved[r]);
            } else {
                assert!(moved[r] < 8 << 20, "{case}: eth{r} carried {} bytes", moved[r]);
            }
        }
        p.kill();
    }
}

/// The fence over two rails: a region deregistered while a peer in another namespace WRITEs to it over both
/// rails (8 × 64 MiB, its two pieces one per rail) is quiet once deregistration returns (each greeted path
/// fenced on the rail it reaches). Three rounds.
#[test]
fn a_region_deregistered_under_writes_on_two_rails_is_quiet_once_deregistration_returns() {
    if setup("fabric route rails fence").is_none() {
        return;
    }
    let Some(net) = common::Net::with_rails("fq", 2, 2) else { return };
    for round in 0..3 {
        let mut p = Prefill::start_in(Some(&net.ns(0)), round, "tcp;ofi_rxm");
        let before = [net.rail_bytes(0, 0), net.rail_bytes(0, 1)];
        let mut w = p.initiator(&net.ns(1), "fabric-writer").spawn().unwrap();
        let mut out = BufReader::new(w.stdout.take().unwrap());
        let mut line = String::new();
        while !line.starts_with("@posted") {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "the writer exited before posting");
        }
        assert_eq!(line.trim(), "@posted libfabric", "round {round}");
        std::thread::sleep(Duration::from_millis(15 + 10 * round as u64));
        let moved = [net.rail_bytes(0, 0) - before[0], net.rail_bytes(0, 1) - before[1]];
        let quiet = p.ask("quiet", "quiet").pop().unwrap();
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut rest);
        let _ = w.wait();
        let end = rest.lines().find(|l| l.starts_with("@wrote")).unwrap_or("@wrote ?").to_owned();
        eprintln!(
            "round {round}: eth0 and eth1 had carried {} and {} MiB when the target deregistered; {quiet} (pages \
             changed after, pages holding ones); {end}",
            moved[0] >> 20,
            moved[1] >> 20
        );
        assert!(quiet.starts_with("quiet 0 "), "round {round}: the region changed after deregistration: {quiet}");
        p.kill();
    }
}

/// A region deregistered while a peer's WRITE to it is landing: once deregistration returns, not one more byte
/// of it changes (the target fences each greeted initiator: a 1-byte READ of its scratch, answered on the same
/// connection after the WRITE bytes it was sending). Five times, the WRITE (8 × 64 MiB) in flight each time.
#[test]
fn a_region_deregistered_under_a_peers_write_is_quiet_once_deregistration_returns() {
    if setup("fabric route dereg fence").is_none() {
        return;
    }
    let a = agent("decode-q", "tcp;ofi_rxm");
    let ones = vec![1u8; SIZE];
    a.register_mem(&reg_list(&ones), &[]).unwrap();
    for round in 0..5 {
        let mut p = Prefill::start(round, "tcp;ofi_rxm");
        a.load_remote_md(&p.md).unwrap();
        assert_eq!(route_of("decode-q", "prefill"), "libfabric");
        let l = XferDList::with_descs(
            MemType::Dram,
            (0..8).map(|_| Desc::new(ones.as_ptr() as u64, SIZE as u64, 0)).collect(),
        );
        let r = XferDList::with_descs(MemType::Dram, (0..8).map(|_| Desc::new(p.addr, SIZE as u64, 0)).collect());
        let req = a.create_xfer_req(XferOp::Write, &l, &r, "prefill", &XferOpts::default()).unwrap();
        let s = a.post_xfer_req(&req, NotifUpdate::Keep).unwrap();
        std::thread::sleep(Duration::from_millis(15 + 10 * round as u64));
        let t = Instant::now();
        let quiet = p.ask("quiet", "quiet").pop().unwrap();
        let took = t.elapsed();
        let end = wait(&a, &req, s).map_err(|e| format!("{:?}: {}", e.status(), e.message()));
        eprintln!("round {round}: {quiet} (pages changed after, pages written before) in {took:?}; the WRITE: {end:?}");
        assert!(
            quiet.starts_with("quiet 0 "),
            "round {round}: the region changed after deregistration returned: {quiet}"
        );
        // The WRITE's own status is not checked: completed, or refused (NOT_FOUND), or, where the refusal of
        // another piece's operation made the provider drop the connection first, BACKEND or REMOTE_DISCONNECT
        // (docs/libfabric.md, "Not yet").
        a.invalidate_remote_md("prefill").unwrap();
        p.kill();
    }
}

/// A peer destroyed and created again under its name in this process: the stale handle is refused
/// (NOT_FOUND), the new incarnation is reached over libfabric.
#[test]
fn a_peer_restarted_in_this_process_refuses_the_stale_handle() {
    if setup("fabric route restart in process").is_none() {
        return;
    }
    let a = agent("decode-inproc", "tcp;ofi_rxm");
    let dst = vec![0u8; 1 << 20];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    let src: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let b = agent("prefill", "tcp;ofi_rxm");
    b.register_mem(&reg_list(&src), &[]).unwrap();
    a.load_remote_md(&b.local_md().unwrap()).unwrap();
    assert_eq!(route_of("decode-inproc", "prefill"), "libfabric");
    let raddr = src.as_ptr() as u64;
    assert_eq!(
        run(&a, XferOp::Read, &local(&dst, 0, 1 << 20), &remote(raddr, 0, 1 << 20), None).unwrap(),
        Status::Success
    );
    assert!(dst == src);
    let stale = a
        .create_xfer_req(XferOp::Read, &local(&dst, 0, 4096), &remote(raddr, 0, 4096), "prefill", &XferOpts::default())
        .unwrap();
    drop(b);
    let b = agent("prefill", "tcp;ofi_rxm");
    let src2 = vec![9u8; 1 << 20];
    b.register_mem(&reg_list(&src2), &[]).unwrap();
    a.invalidate_remote_md("prefill").unwrap();
    a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let e = failure(&a, &stale);
    assert_eq!(e.status(), Status::NotFound, "{e}");
    assert_eq!(route_of("decode-inproc", "prefill"), "libfabric");
    let r2 = src2.as_ptr() as u64;
    assert_eq!(
        run(&a, XferOp::Read, &local(&dst, 0, 1 << 20), &remote(r2, 0, 1 << 20), None).unwrap(),
        Status::Success
    );
    assert!(dst.iter().all(|&x| x == 9));
}

/// Strangers on the greeting (the route's connection kind on the TCP listener): without the secret, no ACK and
/// a greeting is never answered; with it, garbage is closed without an answer and an address of the wrong
/// length refused (never read past); the real initiator is still served.
#[test]
fn strangers_on_the_greeting_get_nothing() {
    use gixl::backend::engine::wire;
    use std::io::Read;
    use std::net::TcpStream;
    // The route's connection kind (`route/fabric/wire.rs`): a wire byte a stranger knows.
    const KIND_FABRIC: u8 = 4;
    if setup("fabric route strangers").is_none() {
        return;
    }
    let mut p = Prefill::start(11, "tcp;ofi_rxm");
    let a = agent("decode-stranger", "tcp;ofi_rxm");
    let dst = vec![0u8; 1 << 20];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    a.load_remote_md(&p.md).unwrap();
    let read = |a: &Agent| run(a, XferOp::Read, &local(&dst, 0, 1 << 20), &remote(p.addr, 0, 1 << 20), None);
    assert_eq!(read(&a).unwrap(), Status::Success);
    assert_eq!(route_of("decode-stranger", "prefill"), "libfabric");

    let md = gixl::md::AgentMd::decode(&p.md).unwrap();
    let (addrs, secret) = gixl::backend::engine::tcp_endpoint(&md.conns[0].1).unwrap();
    let addr = addrs.iter().copied().find(|a| a.ip().is_loopback()).unwrap_or(addrs[0]);
    let inc = md.incarnation;
    let hello = |secret: u128| -> (TcpStream, bool) {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut c = [0u8; wire::CHALLENGE_BYTES];
        s.read_exact(&mut c).unwrap();
        let nonce = wire::parse_challenge(&c).unwrap();
        let tag = wire::hello_tag(secret, KIND_FABRIC, inc, &nonce, "mallory");
        let h = wire::Hello { kind: KIND_FABRIC, incarnation: inc, tag, name: "mallory".into() };
        s.write_all(&wire::encode_hello(&h)).unwrap();
        let mut b = [0u8; 1];
        let ok = matches!(s.read(&mut b), Ok(1) if b[0] == wire::ACK);
        (s, ok)
    };
    // The documented greeting: "GXFA" | u16 length | address.
    let greeting = |addr: &[u8]| {
        let mut g = b"GXFA".to_vec();
        g.extend_from_slice(&(addr.len() as u16).to_le_bytes());
        g.extend_from_slice(addr);
        g
    };
    let answer = |mut s: TcpStream| {
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        got
    };
    let (mut s, ok) = hello(secret ^ 1);
    assert!(!ok, "a wrong tag must not be acknowledged");
    let _ = s.write_all(&greeting(&[7; 16]));
    assert!(answer(s).iter().all(|&b| b == wire::NAK), "nothing but the refusal");
    let (mut s, ok) = hello(secret);
    assert!(ok);
    s.write_all(&[0xAB; 64]).unwrap();
    assert_eq!(answer(s), Vec::<u8>::new(), "garbage: closed");
    let (mut s, _) = hello(secret);
    s.write_all(&greeting(&[0xAB; 3])).unwrap();
    assert_eq!(answer(s), vec![1], "an address of the wrong length: refused");
    assert_eq!(read(&a).unwrap(), Status::Success, "the real initiator is still served");
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + 11) % 251) as u8));
    p.kill();
}
