//! The engine's RDMA route between two processes over the fake fabric (`GIXL_FAKE_VERBS=1`,
//! `GIXL_TRANSPORT=rdma` so that two processes of one host take it): READ and WRITE of 16 MiB and of 1024 ×
//! 16 KiB blocks, a notification after the data, the route doctor and telemetry name, a region deregistered and
//! registered again at the same address while the NIC hands the same key value out again (the old handle is
//! refused, the new region untouched), a killed target (REMOTE_DISCONNECT within the bound) and its restart
//! under the same name (the old handle refused, the new incarnation reached over RDMA again), in a new process
//! and in the same one; GPU memory reached by the NIC directly (dma-buf, peer memory) or staged; the port nearest
//! a region's memory; strangers on the pair exchange.
//!
//! Every test of this file runs with the fake fabric in its environment (set by `fake_env`, before any agent
//! exists); the child is this binary re-run with `GIXL_CHILD=rdma-prefill`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdin, ChildStdout, Command};
use std::time::{Duration, Instant};

use gixl::*;

mod common;
use common::{hex, route_of, unhex};

const SIZE: usize = 16 << 20;
const BLOCK: usize = 16 << 10;

fn dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("gixl-rdma-fake-{}", std::process::id()))
}

/// The fake fabric for this process and its children. Its endpoints' directory lives as long as this process
/// (tests of this binary run side by side on it), so it is not removed when a test ends; those of earlier runs
/// whose process is gone are.
fn fake_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for e in std::fs::read_dir(std::env::temp_dir()).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name.strip_prefix("gixl-rdma-fake-").and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        std::fs::create_dir_all(dir()).unwrap();
    });
    // Two ports on each side: two paths, the pieces of a request spread over both.
    std::env::set_var("GIXL_FAKE_VERBS", "2");
    std::env::set_var("GIXL_FAKE_VERBS_DIR", dir());
    std::env::set_var("GIXL_FAKE_VERBS_REUSE_KEYS", "1");
}

fn agent(name: &str) -> Agent {
    let a = Agent::new(name, AgentConfig::default()).unwrap();
    let p: Params = [("transport".to_owned(), "rdma".to_owned())].into_iter().collect();
    a.create_backend("UCX", &p).unwrap();
    a
}

fn reg_list(buf: &[u8]) -> RegDList {
    reg_of(MemType::Dram, buf)
}

fn reg_of(mem: MemType, buf: &[u8]) -> RegDList {
    let d = Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0);
    RegDList::with_descs(mem, vec![RegDesc { desc: d, meta: vec![] }])
}

/// `SIZE` bytes of fake device memory on GPU 0 (host memory the fake device layer calls device memory).
fn fake_vram() -> &'static mut [u8] {
    fake_vram_of(1)
}

/// The same as `chunks` allocations mapped back to back (a VMM range such as PyTorch's expandable segments).
fn fake_vram_of(chunks: usize) -> &'static mut [u8] {
    let p = match chunks {
        0 | 1 => gixl::device::fake::alloc(0, SIZE, false, None).unwrap(),
        n => gixl::device::fake::alloc_chunks(0, &vec![SIZE / n; n], true, None).unwrap(),
    };
    // SAFETY: a fresh fake allocation of `SIZE` bytes in this process, never freed.
    unsafe { std::slice::from_raw_parts_mut(p as usize as *mut u8, SIZE) }
}

/// The target: `SIZE` bytes (VRAM of the fake device with `GIXL_VRAM=1`), byte i = (i + seed) % 251;
/// `@md <md> <addr>`; then commands.
fn prefill_child() {
    let seed: usize = std::env::var("GIXL_SEED").unwrap().parse().unwrap();
    let mem = if std::env::var("GIXL_VRAM").is_ok() { MemType::Vram } else { MemType::Dram };
    let a = agent("prefill");
    let mut own = Vec::new();
    let buf: &mut [u8] = match mem {
        MemType::Vram => fake_vram_of(std::env::var("GIXL_VRAM_CHUNKS").map_or(1, |v| v.parse().unwrap())),
        _ => {
            own.resize(SIZE, 0);
            &mut own
        }
    };
    buf.iter_mut().enumerate().for_each(|(i, b)| *b = ((i + seed) % 251) as u8);
    a.register_mem(&reg_of(mem, buf), &[]).unwrap();
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
            // Bytes this process's (fake) device layer copied: staging, where VRAM is served over TCP.
            "copied" => writeln!(out, "copied {}", gixl::device::fake::copied_bytes()).unwrap(),
            // Queue pairs alive on this process's ports.
            "qps" => {
                writeln!(out, "qps {}", gixl::verbs::fake::live_qps("fake0") + gixl::verbs::fake::live_qps("fake1"))
                    .unwrap()
            }
            // Requests each of this process's ports served as a target.
            "served" => {
                let (a, b) = (gixl::verbs::fake::served("fake0"), gixl::verbs::fake::served("fake1"));
                writeln!(out, "served {a} {b}").unwrap()
            }
            cmd if cmd.starts_with("failport ") => {
                // Pull the cable of one of this process's ports.
                let dev = &cmd["failport ".len()..];
                let ports = gixl::verbs::fabric().unwrap().ports().unwrap();
                gixl::verbs::fake::fail_port(ports.iter().find(|p| p.device == dev).unwrap());
                writeln!(out, "failed {dev}").unwrap();
            }
            "rereg" => {
                // Deregister, refill, register the same buffer again: its new metadata follows.
                a.deregister_mem(&reg_of(mem, buf), &[]).unwrap();
                buf.iter_mut().for_each(|b| *b = 0xEE);
                a.register_mem(&reg_of(mem, buf), &[]).unwrap();
                writeln!(out, "@md {} {}", hex(&a.local_md().unwrap()), buf.as_ptr() as u64).unwrap();
            }
            _ => break,
        }
        out.flush().unwrap();
    }
}

#[test]
fn child_entry() {
    if std::env::var("GIXL_CHILD").as_deref() == Ok("rdma-prefill") {
        prefill_child();
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
    fn start(seed: usize) -> Prefill {
        Prefill::start_with(seed, &[])
    }

    /// With `env` set in the child.
    fn start_with(seed: usize, env: &[(&str, &str)]) -> Prefill {
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env("GIXL_CHILD", "rdma-prefill")
            .env("GIXL_SEED", seed.to_string())
            .envs(env.iter().copied());
        let (child, stdin, stdout, rest) = common::spawn_until_md(c);
        let mut it = rest.split(' ');
        let md = unhex(it.next().unwrap());
        let addr = it.next().unwrap().parse().unwrap();
        Prefill { child, stdin, stdout, md, addr }
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

    /// Requests each of its ports (fake0, fake1) served as a target.
    fn served(&mut self) -> (u64, u64) {
        let l = self.ask("served", "served").pop().unwrap();
        let v: Vec<u64> = l.split(' ').skip(1).map(|x| x.parse().unwrap()).collect();
        (v[0], v[1])
    }

    /// Requests its ports served as a target, together.
    fn served_total(&mut self) -> u64 {
        let (f0, f1) = self.served();
        f0 + f1
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Prefill {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An initiator named `name` with `SIZE` bytes of DRAM registered, `p`'s metadata loaded.
fn decode(name: &str, p: &Prefill) -> (Agent, Vec<u8>) {
    let a = agent(name);
    let dst = vec![0u8; SIZE];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    a.load_remote_md(&p.md).unwrap();
    (a, dst)
}

fn remote(addr: u64, off: usize, len: usize) -> XferDList {
    XferDList::with_descs(MemType::Dram, vec![Desc::new(addr + off as u64, len as u64, 0)])
}

fn local(buf: &[u8], off: usize, len: usize) -> XferDList {
    XferDList::with_descs(MemType::Dram, vec![Desc::new(buf.as_ptr() as u64 + off as u64, len as u64, 0)])
}

/// Post and wait (sleeping between looks, as an application would).
fn run(a: &Agent, op: XferOp, l: &XferDList, r: &XferDList, notif: Option<&[u8]>) -> Result<Status> {
    let opts = XferOpts { notif: notif.map(<[u8]>::to_vec), ..Default::default() };
    let req = a.create_xfer_req(op, l, r, "prefill", &opts)?;
    let mut s = a.post_xfer_req(&req, NotifUpdate::Keep)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while s == Status::InProg {
        assert!(Instant::now() < deadline, "a request did not finish in 30 s");
        std::thread::sleep(Duration::from_micros(200));
        s = a.xfer_status(&req)?;
    }
    Ok(s)
}

/// Post `req`, which must fail (at post or while in flight): its error.
fn failure(a: &Agent, req: &XferReq) -> Error {
    match a.post_xfer_req(req, NotifUpdate::Keep) {
        Ok(Status::InProg) => loop {
            match a.xfer_status(req) {
                Ok(Status::InProg) => std::thread::sleep(Duration::from_millis(1)),
                other => break other.unwrap_err(),
            }
        },
        other => other.unwrap_err(),
    }
}

#[test]
fn two_processes_over_the_fake_fabric_read_write_notify_and_survive_deregistration_death_and_restart() {
    fake_env();
    let mut p = Prefill::start(0);
    let a = agent("decode");
    let dst = vec![0u8; SIZE];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    assert_eq!(a.load_remote_md(&p.md).unwrap(), "prefill");
    assert_eq!(route_of("decode", "prefill"), "rdma");

    // 16 MiB READ: one piece per worker, each on its own queue pair.
    assert_eq!(run(&a, XferOp::Read, &local(&dst, 0, SIZE), &remote(p.addr, 0, SIZE), None).unwrap(), Status::Success);
    assert!(dst.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "16 MiB READ");

    // 1024 × 16 KiB, the remote blocks reversed, with a notification after the data.
    let mut dst = dst;
    dst.iter_mut().for_each(|b| *b = 0);
    let n = SIZE / BLOCK;
    let l = XferDList::with_descs(
        MemType::Dram,
        (0..n).map(|i| Desc::new(dst.as_ptr() as u64 + (i * BLOCK) as u64, BLOCK as u64, 0)).collect(),
    );
    let r = XferDList::with_descs(
        MemType::Dram,
        (0..n).map(|i| Desc::new(p.addr + ((n - 1 - i) * BLOCK) as u64, BLOCK as u64, 0)).collect(),
    );
    assert_eq!(run(&a, XferOp::Read, &l, &r, Some(b"kv read")).unwrap(), Status::Success);
    for i in 0..n {
        let base = (n - 1 - i) * BLOCK;
        assert!(
            dst[i * BLOCK..(i + 1) * BLOCK].iter().enumerate().all(|(j, &b)| b == ((base + j) % 251) as u8),
            "block {i}"
        );
    }
    // WRITE ones over the whole target buffer as 1024 blocks, then as one: the target's sum is all ones.
    let ones = vec![1u8; SIZE];
    a.register_mem(&reg_list(&ones), &[]).unwrap();
    let l1 = XferDList::with_descs(
        MemType::Dram,
        (0..n).map(|i| Desc::new(ones.as_ptr() as u64 + (i * BLOCK) as u64, BLOCK as u64, 0)).collect(),
    );
    assert_eq!(run(&a, XferOp::Write, &l1, &r, None).unwrap(), Status::Success);
    assert_eq!(p.ask("sum", "sum")[0], format!("sum {SIZE}"));
    assert_eq!(
        run(&a, XferOp::Write, &local(&ones, 0, SIZE), &remote(p.addr, 0, SIZE), Some(b"kv written")).unwrap(),
        Status::Success
    );
    // Notifications arrive on their own (after the data, but not necessarily before the request completes here).
    let mut notifs = Vec::new();
    let t = Instant::now();
    while notifs.len() < 2 && t.elapsed() < Duration::from_secs(10) {
        notifs.extend(p.ask("notifs", "end").into_iter().filter(|l| l.starts_with("notif ")));
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(notifs, ["notif decode kv read", "notif decode kv written"]);
    assert_eq!(p.ask("sum", "sum")[0], format!("sum {SIZE}"));

    // The target deregisters and registers the same buffer again; the fake NIC would hand out the same key
    // value (GIXL_FAKE_VERBS_REUSE_KEYS=1). The handle made before is refused and the new region untouched.
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
    assert_eq!(p.ask("sum", "sum")[0], format!("sum {}", 0xEE * SIZE as u64), "the new region was written");
    // Its new metadata (the same incarnation with a changed region: loaded after invalidating, as NIXL
    // requires): reached again.
    let md = unhex(md.strip_prefix("@md ").unwrap().split(' ').next().unwrap());
    a.invalidate_remote_md("prefill").unwrap();
    a.load_remote_md(&md).unwrap();
    assert_eq!(route_of("decode", "prefill"), "rdma");
    assert_eq!(run(&a, XferOp::Read, &local(&dst, 0, 4096), &remote(p.addr, 0, 4096), None).unwrap(), Status::Success);
    assert!(dst[..4096].iter().all(|&b| b == 0xEE));

    // Killed: REMOTE_DISCONNECT, within the bound.
    let stale = a
        .create_xfer_req(XferOp::Read, &local(&dst, 0, 4096), &remote(p.addr, 0, 4096), "prefill", &XferOpts::default())
        .unwrap();
    p.kill();
    let t = Instant::now();
    let e = run(&a, XferOp::Read, &local(&dst, 0, 4096), &remote(p.addr, 0, 4096), None).unwrap_err();
    assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

    // Restarted under the same name: the old handle is refused; the new incarnation is reached over RDMA.
    let mut q = Prefill::start(7);
    a.invalidate_remote_md("prefill").unwrap();
    a.load_remote_md(&q.md).unwrap();
    let e = a.post_xfer_req(&stale, NotifUpdate::Keep).unwrap_err();
    assert_eq!(e.status(), Status::NotFound, "{e}");
    assert_eq!(route_of("decode", "prefill"), "rdma");
    assert_eq!(run(&a, XferOp::Read, &local(&dst, 0, SIZE), &remote(q.addr, 0, SIZE), None).unwrap(), Status::Success);
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + 7) % 251) as u8), "the new incarnation's bytes");
    q.kill();
}

/// Two ports each side: requests spread over both paths; one port of the target fails (its cable pulled) and
/// its share goes over the other, every request still succeeding; the second fails too: REMOTE_DISCONNECT.
#[test]
fn a_failed_port_takes_its_share_elsewhere_and_the_last_one_takes_the_peer_down() {
    fake_env();
    let mut p = Prefill::start(3);
    let (a, dst) = decode("decode2", &p);
    let raddr = p.addr;
    let read_all = |a: &Agent| run(a, XferOp::Read, &local(&dst, 0, SIZE), &remote(raddr, 0, SIZE), None);
    for _ in 0..3 {
        assert_eq!(read_all(&a).unwrap(), Status::Success);
    }
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + 3) % 251) as u8));
    assert_eq!(p.ask("failport fake1", "failed")[0], "failed fake1");
    for round in 0..3 {
        assert_eq!(read_all(&a).unwrap(), Status::Success, "round {round} after one port failed");
    }
    assert_eq!(route_of("decode2", "prefill"), "rdma");
    assert_eq!(p.ask("failport fake0", "failed")[0], "failed fake0");
    let e = read_all(&a).unwrap_err();
    assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
    p.kill();
}

/// GPU memory on both sides (the fake device layer), over the fake fabric: where the target's NIC reaches its
/// region (through a dma-buf of it, or as peer memory) requests go with no device copy on either side (the
/// NICs move the bytes); where it reaches it neither way, the same requests are staged over the TCP link
/// (device copies on both sides), and still right.
/// A VRAM region deregistered and registered again under a reissued key refuses the old handle.
#[test]
fn gpu_memory_goes_over_the_fabric_directly_where_the_nic_reaches_it_else_staged() {
    fake_env();
    assert!(gixl::device::select_fake(), "this test process must use the fake device");
    let a = agent("decode-vram");
    let one = fake_vram();
    let four = fake_vram_of(4);
    a.register_mem(&reg_of(MemType::Vram, one), &[]).unwrap();
    a.register_mem(&reg_of(MemType::Vram, four), &[]).unwrap();
    let vram = |addr: u64, off: usize, len: usize| {
        XferDList::with_descs(MemType::Vram, vec![Desc::new(addr + off as u64, len as u64, 0)])
    };
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], bool);
    let cases: [Case; 4] = [
        ("dma-buf", &[("GIXL_VRAM", "1"), ("GIXL_FAKE_DEVICE", "1")], true),
        (
            "peer memory",
            &[
                ("GIXL_VRAM", "1"),
                ("GIXL_FAKE_DEVICE", "1"),
                ("GIXL_FAKE_DMABUF", "0"),
                ("GIXL_FAKE_VERBS_PEERMEM", "1"),
            ],
            true,
        ),
        ("staged", &[("GIXL_VRAM", "1"), ("GIXL_FAKE_DEVICE", "1"), ("GIXL_FAKE_DMABUF", "0")], false),
        // Both sides' regions span 4 allocations: one dma-buf and one memory region per allocation.
        (
            "dma-buf, 4 allocations each side",
            &[("GIXL_VRAM", "1"), ("GIXL_FAKE_DEVICE", "1"), ("GIXL_VRAM_CHUNKS", "4")],
            true,
        ),
    ];
    for (seed, (how, env, direct)) in cases.into_iter().enumerate() {
        let dst: &mut [u8] = if seed == 3 { &mut *four } else { &mut *one };
        let here = dst.as_ptr() as u64;
        let mut p = Prefill::start_with(seed, env);
        a.invalidate_remote_md("prefill").ok();
        a.load_remote_md(&p.md).unwrap();
        assert_eq!(route_of("decode-vram", "prefill"), "rdma", "{how}");
        dst.iter_mut().for_each(|b| *b = 0);
        let copied_here = gixl::device::fake::copied_bytes();
        let r = run(&a, XferOp::Read, &vram(here, 0, SIZE), &vram(p.addr, 0, SIZE), None).unwrap();
        assert_eq!(r, Status::Success, "{how}");
        assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + seed) % 251) as u8), "{how}: 16 MiB VRAM READ");
        let copied_here = gixl::device::fake::copied_bytes() - copied_here;
        let copied_there: u64 = p.ask("copied", "copied")[0]["copied ".len()..].parse().unwrap();
        if direct {
            assert_eq!((copied_here, copied_there), (0, 0), "{how}: nothing staged on either side");
        } else {
            assert!(copied_here >= SIZE as u64 && copied_there >= SIZE as u64, "{how}: {copied_here} {copied_there}");
        }
        // WRITE ones as 1024 blocks, the target's sum is all ones.
        dst.iter_mut().for_each(|b| *b = 1);
        let n = SIZE / BLOCK;
        let blocks = |addr: u64| {
            XferDList::with_descs(
                MemType::Vram,
                (0..n).map(|i| Desc::new(addr + (i * BLOCK) as u64, BLOCK as u64, 0)).collect(),
            )
        };
        assert_eq!(run(&a, XferOp::Write, &blocks(here), &blocks(p.addr), None).unwrap(), Status::Success, "{how}");
        assert_eq!(p.ask("sum", "sum")[0], format!("sum {SIZE}"), "{how}");
        if direct {
            // Registered again under the same key value: the old handle is refused, the new region untouched.
            let old = a
                .create_xfer_req(
                    XferOp::Write,
                    &vram(here, 0, 4096),
                    &vram(p.addr, 0, 4096),
                    "prefill",
                    &XferOpts::default(),
                )
                .unwrap();
            p.ask("rereg", "@md");
            let e = failure(&a, &old);
            assert_eq!(e.status(), Status::NotFound, "{how}: {e}");
            assert_eq!(
                p.ask("sum", "sum")[0],
                format!("sum {}", 0xEE * SIZE as u64),
                "{how}: the new region was written"
            );
        }
        p.kill();
    }
}

/// A request goes through the ports nearest its regions where the topology sets one apart: the target's host
/// memory (this host's NUMA node 0) through its port on node 0, its GPU memory through the NIC sharing the most
/// of the GPU's PCI path; when that port fails, its share goes over the other.
#[test]
fn requests_take_the_port_nearest_the_region_and_another_when_it_fails() {
    fake_env();
    assert!(gixl::device::select_fake(), "this test process must use the fake device");
    let a = agent("decode-near");
    let dst = vec![0u8; SIZE];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    // Host memory: the target's fake1 is on node 0, fake0 on node 1.
    let mut p = Prefill::start_with(11, &[("GIXL_FAKE_VERBS_NUMA", "1,0")]);
    a.load_remote_md(&p.md).unwrap();
    for _ in 0..3 {
        assert_eq!(
            run(&a, XferOp::Read, &local(&dst, 0, SIZE), &remote(p.addr, 0, SIZE), None).unwrap(),
            Status::Success
        );
    }
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + 11) % 251) as u8));
    let (f0, f1) = p.served();
    assert!(f0 == 0 && f1 > 0, "host memory on node 0 goes through the port on node 0: {f0} {f1}");
    assert_eq!(p.ask("failport fake1", "failed")[0], "failed fake1");
    assert_eq!(run(&a, XferOp::Read, &local(&dst, 0, SIZE), &remote(p.addr, 0, SIZE), None).unwrap(), Status::Success);
    let (f0, _) = p.served();
    assert!(f0 > 0, "the nearest port failed: the other one takes its share");
    p.kill();

    // GPU memory: GPU 0 sits under the PCI switch of the target's fake0; fake1 hangs off another root.
    let gpu = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0";
    let nics = "/sys/devices/pci0000:00/0000:00:01.0/0000:02:00.0,/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0";
    let env =
        [("GIXL_VRAM", "1"), ("GIXL_FAKE_DEVICE", "1"), ("GIXL_FAKE_DEVICE_PCI", gpu), ("GIXL_FAKE_VERBS_PCI", nics)];
    let mut q = Prefill::start_with(12, &env);
    a.invalidate_remote_md("prefill").unwrap();
    a.load_remote_md(&q.md).unwrap();
    let local_vram = fake_vram();
    a.register_mem(&reg_of(MemType::Vram, local_vram), &[]).unwrap();
    let vram = |addr: u64| XferDList::with_descs(MemType::Vram, vec![Desc::new(addr, SIZE as u64, 0)]);
    for _ in 0..3 {
        let r = run(&a, XferOp::Read, &vram(local_vram.as_ptr() as u64), &vram(q.addr), None).unwrap();
        assert_eq!(r, Status::Success);
    }
    assert!(local_vram.iter().enumerate().all(|(i, &b)| b == ((i + 12) % 251) as u8));
    let (f0, f1) = q.served();
    assert!(f0 > 0 && f1 == 0, "GPU memory goes through the NIC under its switch: {f0} {f1}");
    q.kill();
}

/// Strangers on the RDMA exchange (a raw socket to the target's TCP listener, `KIND_RDMA`): without the engine's
/// secret the handshake fails and nothing is served; with it (a copy of the metadata), a garbage offer is
/// closed, an offer for a port the target does not have or for a pair nobody holds is refused, and none of it
/// leaves a queue pair behind; the real initiator is served before and after.
#[test]
fn strangers_on_the_rdma_exchange_get_no_queue_pair_and_break_nothing() {
    use gixl::backend::engine::wire;
    // The RDMA route's connection kind on the TCP listener (`route/rdma/wire.rs`): a wire byte a stranger knows.
    const KIND_RDMA: u8 = 3;
    fake_env();
    let mut p = Prefill::start(21);
    let (a, dst) = decode("decode-stranger", &p);
    let read = |a: &Agent, p: &Prefill| run(a, XferOp::Read, &local(&dst, 0, SIZE), &remote(p.addr, 0, SIZE), None);
    assert_eq!(read(&a, &p).unwrap(), Status::Success);
    let qps = |p: &mut Prefill| p.ask("qps", "qps").pop().unwrap();
    let before = qps(&mut p);

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
        let tag = wire::hello_tag(secret, KIND_RDMA, inc, &nonce, "mallory");
        s.write_all(&wire::encode_hello(&wire::Hello {
            kind: KIND_RDMA,
            incarnation: inc,
            tag,
            name: "mallory".into(),
        }))
        .unwrap();
        let mut b = [0u8; 1];
        let ok = matches!(s.read(&mut b), Ok(1) if b[0] == wire::ACK);
        (s, ok)
    };
    // The documented offer: "GXQP" | port | n | n × (gid 16 | lid u16 | qpn u32 | psn u32).
    let offer = |port: u8, n: u8, gid: [u8; 16]| {
        let mut o = b"GXQP".to_vec();
        o.extend_from_slice(&[port, n]);
        for i in 0..n {
            o.extend_from_slice(&gid);
            o.extend_from_slice(&0u16.to_le_bytes());
            o.extend_from_slice(&(0x900 + u32::from(i)).to_le_bytes());
            o.extend_from_slice(&7u32.to_le_bytes());
        }
        o
    };
    // Closed, or one refusal byte then closed: never an address.
    let answer = |mut s: TcpStream| {
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        got
    };

    // Without the secret: no ACK, and an offer sent anyway is never answered.
    let (mut s, ok) = hello(secret ^ 1);
    assert!(!ok, "a wrong tag must not be acknowledged");
    let _ = s.write_all(&offer(0, 1, [0; 16]));
    assert!(answer(s).iter().all(|&b| b == wire::NAK), "nothing but the refusal");
    // With it: garbage, a port it does not have, too many pairs, a pair that no endpoint holds.
    let (mut s, ok) = hello(secret);
    assert!(ok);
    s.write_all(&[0xAB; 64]).unwrap();
    assert_eq!(answer(s), Vec::<u8>::new(), "garbage: closed");
    let (mut s, _) = hello(secret);
    s.write_all(&offer(9, 1, [0; 16])).unwrap();
    assert_eq!(answer(s), vec![1], "no port 9: refused");
    let (mut s, _) = hello(secret);
    s.write_all(&offer(0, 200, [0; 16])).unwrap();
    assert_eq!(answer(s), Vec::<u8>::new(), "more pairs than an offer may carry: closed");
    let mut gid = [0u8; 16];
    gid[..4].copy_from_slice(b"gxfv");
    gid[4..].copy_from_slice(&[0x5a; 12]);
    let (mut s, _) = hello(secret);
    s.write_all(&offer(0, 2, gid)).unwrap();
    assert_eq!(answer(s), vec![1], "pairs nobody holds: refused");

    assert_eq!(qps(&mut p), before, "no queue pair left behind");
    assert_eq!(read(&a, &p).unwrap(), Status::Success, "the real initiator is still served");
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + 21) % 251) as u8));
    p.kill();
}

/// The target restarts in the same process (its agent destroyed and made again under the same name, the fake
/// NIC handing the same key values out again): the old handle is refused, the old peer is down, and the new
/// incarnation is reached over RDMA with its own bytes.
#[test]
fn a_target_restarted_in_the_same_process_is_a_new_incarnation_over_rdma() {
    fake_env();
    let a = agent("decode-same");
    let dst = vec![0u8; SIZE];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    let start = |seed: usize| {
        let t = agent("prefill-same");
        let buf: Vec<u8> = (0..SIZE).map(|i| ((i + seed) % 251) as u8).collect();
        t.register_mem(&reg_list(&buf), &[]).unwrap();
        (t, buf)
    };
    let read = |buf: &[u8]| {
        let req = a.create_xfer_req(
            XferOp::Read,
            &local(&dst, 0, SIZE),
            &local(buf, 0, SIZE),
            "prefill-same",
            &XferOpts::default(),
        );
        req.and_then(|r| {
            let mut s = a.post_xfer_req(&r, NotifUpdate::Keep)?;
            let t = Instant::now();
            while s == Status::InProg && t.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_micros(200));
                s = a.xfer_status(&r)?;
            }
            Ok((s, r))
        })
    };
    let (t, buf) = start(31);
    a.load_remote_md(&t.local_md().unwrap()).unwrap();
    assert_eq!(route_of("decode-same", "prefill-same"), "rdma");
    let (s, old) = read(&buf).unwrap();
    assert_eq!(s, Status::Success);
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + 31) % 251) as u8));
    drop(t);
    let (t2, buf2) = start(32);
    a.invalidate_remote_md("prefill-same").unwrap();
    a.load_remote_md(&t2.local_md().unwrap()).unwrap();
    let e = a.post_xfer_req(&old, NotifUpdate::Keep).unwrap_err();
    assert_eq!(e.status(), Status::NotFound, "{e}");
    assert_eq!(route_of("decode-same", "prefill-same"), "rdma");
    let (s, _) = read(&buf2).unwrap();
    assert_eq!(s, Status::Success);
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + 32) % 251) as u8), "the new incarnation's bytes");
    drop(buf);
}

/// A WRITE completes only after a 1-byte READ on the same queue pair (the flush that makes the target's memory
/// hold the data before the request completes and its notification leaves): the target's NIC serves two
/// requests for a 4 KiB WRITE, one for a 4 KiB READ.
#[test]
fn a_write_is_flushed_by_a_read_on_its_queue_pair_before_it_completes() {
    fake_env();
    let mut p = Prefill::start(41);
    let (a, dst) = decode("decode-flush", &p);
    let s0 = p.served_total();
    assert_eq!(run(&a, XferOp::Write, &local(&dst, 0, 4096), &remote(p.addr, 0, 4096), None).unwrap(), Status::Success);
    let s1 = p.served_total();
    assert_eq!(run(&a, XferOp::Read, &local(&dst, 0, 4096), &remote(p.addr, 0, 4096), None).unwrap(), Status::Success);
    let s2 = p.served_total();
    assert_eq!((s1 - s0, s2 - s1), (2, 1), "WRITE: the data and its flush; READ: the data");
    p.kill();
}

/// A million-entry list over RDMA: 1,048,576 descriptors of 16 bytes, adjacent on both sides, READ whole (the
/// adjacent entries share work requests: the target's NIC serves a handful of requests, not a million), then
/// 65,536 of them with the remote blocks reversed (one work request each), both checked byte for byte.
#[test]
fn a_million_entry_list_goes_over_rdma_in_a_handful_of_work_requests() {
    fake_env();
    let mut p = Prefill::start(51);
    let (a, dst) = decode("decode-million", &p);
    const E: usize = 16;
    let n = SIZE / E;
    assert_eq!(n, 1 << 20);
    let list = |base: u64, order: &dyn Fn(usize) -> usize, count: usize| {
        XferDList::with_descs(
            MemType::Dram,
            (0..count).map(|i| Desc::new(base + (order(i) * E) as u64, E as u64, 0)).collect(),
        )
    };
    let s0 = p.served_total();
    let r = run(&a, XferOp::Read, &list(dst.as_ptr() as u64, &|i| i, n), &list(p.addr, &|i| i, n), None).unwrap();
    assert_eq!(r, Status::Success);
    assert!(dst.iter().enumerate().all(|(i, &b)| b == ((i + 51) % 251) as u8), "a million adjacent entries");
    let s1 = p.served_total();
    assert!(s1 - s0 <= 64, "adjacent entries share work requests: the target served {}", s1 - s0);
    // 65,536 entries, the remote ones reversed: nothing adjacent.
    let m = 1 << 16;
    let mut dst = dst;
    dst.iter_mut().for_each(|b| *b = 0);
    let r =
        run(&a, XferOp::Read, &list(dst.as_ptr() as u64, &|i| i, m), &list(p.addr, &|i| m - 1 - i, m), None).unwrap();
    assert_eq!(r, Status::Success);
    for i in 0..m {
        let want = |j: usize| (((m - 1 - i) * E + j + 51) % 251) as u8;
        assert!((0..E).all(|j| dst[i * E + j] == want(j)), "entry {i}");
    }
    assert_eq!(p.served_total() - s1, m as u64, "one work request per scattered entry");
    p.kill();
}

/// A registration the NIC refuses (device memory declared as DRAM, where the peer-memory module is not loaded)
/// fails with the NIC's reason and keeps nothing: more of them than the engine has region slots leave the next
/// registration working, and a transfer over the fabric with it.
#[test]
fn a_registration_the_nic_refuses_fails_whole_and_keeps_nothing() {
    fake_env();
    let vram = fake_vram();
    let t = agent("prefill-refused");
    let e = t.register_mem(&reg_list(vram), &[]).unwrap_err();
    assert_eq!(e.status(), Status::Backend, "{e}");
    assert!(e.message().contains("device memory"), "{e}");
    // Each refused registration took a gate slot and a TCP range first: both must be given back.
    for _ in 0..(1 << 16) + 10 {
        t.register_mem(&reg_list(vram), &[]).unwrap_err();
    }
    let buf: Vec<u8> = (0..SIZE).map(|i| ((i + 61) % 251) as u8).collect();
    t.register_mem(&reg_list(&buf), &[]).unwrap();
    let a = agent("decode-refused");
    let dst = vec![0u8; SIZE];
    a.register_mem(&reg_list(&dst), &[]).unwrap();
    a.load_remote_md(&t.local_md().unwrap()).unwrap();
    assert_eq!(route_of("decode-refused", "prefill-refused"), "rdma");
    let req = a
        .create_xfer_req(
            XferOp::Read,
            &local(&dst, 0, SIZE),
            &local(&buf, 0, SIZE),
            "prefill-refused",
            &XferOpts::default(),
        )
        .unwrap();
    let mut s = a.post_xfer_req(&req, NotifUpdate::Keep).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while s == Status::InProg && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(200));
        s = a.xfer_status(&req).unwrap();
    }
    assert_eq!(s, Status::Success);
    assert!(dst == buf);
}
