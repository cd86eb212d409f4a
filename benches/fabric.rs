//! gixl's libfabric route over the tcp provider (`tcp;ofi_rxm`) beside gixl's own TCP route and beside the
//! provider's own ceiling on the same link, between two processes in two network namespaces joined by a bridge
//! (veth pairs, as tests/netns.rs builds them), printed as a table: 64 MiB READ and WRITE, 1024 × 16 KiB
//! scattered READ and WRITE (GB/s, median of 9 rounds, the three ways' rounds taken in turn so that a load that
//! comes and goes weighs on each alike), and the 4 KiB READ latency (median µs); then what the
//! device's self-test cost. Every figure's data is checked: each READ's bytes against the target's pattern,
//! each WRITE's at the target (it answers whether its buffer holds what was written).
//!
//! Three processes: this one (it builds the network and waits), the initiator (this binary again, in the
//! second namespace) and the target (this binary again, in the first). The target holds three 64 MiB buffers:
//! one registered with an agent whose LIBFABRIC backend is forced onto the libfabric route
//! (`transport=fabric`), one with an agent forced onto gixl's TCP route (`transport=tcp`), and one registered
//! on a raw endpoint of the provider for the ceiling.
//!
//! The ceiling is a small program over the same wrappers the route uses (`gixl::fabric`): one RDM endpoint per
//! process, the same operations (8 MiB, or one per 16 KiB block), 64 in flight; the initiator reads its queue
//! without sleeping for the latency (sleeping at most 1 ms between reads, as the route does, for bandwidth),
//! the target's thread reads its queue whenever the provider wakes its descriptor (at most 100 ms apart), as
//! the route's target does (the provider moves data only when its queues are read). `fi_pingpong`
//! (libfabric-bin: RDM messages between the same two namespaces) gives the provider's own 4 KiB round trip
//! where it runs.
//!
//! Run: `cargo bench --bench fabric` as root (network namespaces; without them the two processes share this
//! namespace, and the table says so). The library as tests/fabric.rs finds it: ~/.cache/gixl/libfabric from
//! scripts/setup.sh, or GIXL_LIBFABRIC / GIXL_LIBFABRIC_ROOT.

use std::ffi::c_void;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gixl::fabric::{self as fi, Av, Cq, Domain, Endpoint, Fabric, Mr, RemoteKey};
use gixl::*;

#[path = "../tests/common/mod.rs"]
mod common;

const BIG: usize = 64 << 20;
const BLOCK: usize = 16 << 10;
const BLOCKS: usize = 1024;
const SMALL: usize = 4096;
const ROUNDS: usize = 9;
const LAT_ITERS: usize = 2000;
const PROVIDER: &str = "tcp;ofi_rxm";
/// The three target buffers' patterns: byte i = (i + seed) % 251.
const SEEDS: [usize; 3] = [11, 22, 33];
/// What the initiator WRITEs: byte i = (i * 7 + 5) % 251.
fn written(i: usize) -> u8 {
    ((i * 7 + 5) % 251) as u8
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    match std::env::var("GIXL_BENCH_ROLE").as_deref() {
        Ok("target") => return target(),
        Ok("initiator") => return initiator(),
        _ => {}
    }
    let Some(_root) = common::fabric::setup("fabric bench") else { return };
    let net = common::Net::new("fb", 2);
    let exe = std::env::current_exe().unwrap();
    let mut c = match &net {
        Some(n) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &n.ns(1)]).arg(&exe).env("GIXL_BENCH_TARGET_NS", n.ns(0));
            c.env("GIXL_BENCH_TARGET_IP", n.ip(0));
            c
        }
        None => Command::new(&exe),
    };
    let status = c.env("GIXL_BENCH_ROLE", "initiator").status().unwrap();
    assert!(status.success(), "the initiator failed: {status}");
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn pattern(seed: usize) -> Vec<u8> {
    (0..BIG).map(|i| ((i + seed) % 251) as u8).collect()
}

fn agent(name: &str, transport: &str) -> Agent {
    let a = Agent::new(name, AgentConfig::default()).unwrap();
    let p: Params = [("transport", transport), ("fabric_provider", PROVIDER)]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
    a.create_backend("LIBFABRIC", &p).unwrap();
    a
}

fn reg(buf: &[u8]) -> RegDList {
    RegDList::with_descs(
        MemType::Dram,
        vec![RegDesc { desc: Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0), meta: vec![] }],
    )
}

/// The provider's device this process uses: the first not on the loopback interface (the namespace's eth0).
fn device() -> fi::Device {
    let all = fi::devices(Some(PROVIDER), None).unwrap();
    all.iter().find(|d| d.domain() != "lo").or(all.first()).expect("a tcp;ofi_rxm device").clone()
}

/// A raw endpoint of the provider with one registered buffer.
struct Raw {
    fabric: Fabric,
    _domain: Domain,
    av: Arc<Av>,
    ep: Arc<Endpoint>,
    mr: Mr,
    buf: Vec<u8>,
}

impl Raw {
    fn new(mut buf: Vec<u8>) -> Raw {
        let dev = device();
        let fabric = Fabric::open(&dev).unwrap();
        let domain = Domain::open(&fabric, &dev).unwrap();
        let (cq, av) = (Cq::open(&domain, 1024).unwrap(), Av::open(&domain, 4).unwrap());
        let ep = Arc::new(Endpoint::open(&domain, &dev, &cq, &av).unwrap());
        // SAFETY: the buffer lives in the returned value with its region (a Vec's heap storage does not move);
        // the region is closed before the buffer is freed (field order).
        let mr = unsafe { Mr::register(&domain, buf.as_mut_ptr(), buf.len(), &ep).unwrap() };
        Raw { fabric, _domain: domain, av, ep, mr, buf }
    }
}

/// The target: its three buffers, its agents' metadata and the raw endpoint's address and key on stdout; then
/// `check <0|1|2>` answers whether that buffer holds what the initiator WRITEs; stdin closed: gone.
fn target() {
    common::fabric::setup("fabric bench target").expect("the parent found libfabric");
    let (mut fab_buf, mut tcp_buf) = (pattern(SEEDS[0]), pattern(SEEDS[1]));
    let (fab, tcp) = (agent("fab-t", "fabric"), agent("tcp-t", "tcp"));
    fab.register_mem(&reg(&fab_buf), &[]).unwrap();
    tcp.register_mem(&reg(&tcp_buf), &[]).unwrap();
    let raw = Arc::new(Raw::new(pattern(SEEDS[2])));
    let RemoteKey { addr, key } = raw.mr.remote(raw.buf.as_ptr()).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "\n@md {}", common::hex(&fab.local_md().unwrap())).unwrap();
    writeln!(out, "@md {}", common::hex(&tcp.local_md().unwrap())).unwrap();
    writeln!(out, "@bufs {} {}", fab_buf.as_ptr() as u64, tcp_buf.as_ptr() as u64).unwrap();
    writeln!(out, "@raw {} {addr} {key}", common::hex(&raw.ep.name().unwrap())).unwrap();
    writeln!(out, "@ready").unwrap();
    out.flush().unwrap();
    // The raw endpoint's progress, as the route's target does it.
    let stop = Arc::new(AtomicBool::new(false));
    let pr = {
        let (raw, stop) = (raw.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let cqs = [&**raw.ep.cq()];
                fi::drain(&cqs, |_| {}).unwrap();
                fi::wait_up_to(&raw.fabric, &cqs, Duration::from_millis(100)).unwrap();
            }
        })
    };
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let Some((what, which)) = line.split_once(' ') else { continue };
        let b: &[u8] = match which {
            "0" => &fab_buf,
            "1" => &tcp_buf,
            _ => &raw.buf,
        };
        let ok = match what {
            // After the 64 MiB WRITE, the scattered one: remote block n-1-i holds local block 2i.
            "blocks" => (0..BLOCKS).all(|i| {
                let (loff, roff) = (2 * i * BLOCK % BIG, (BLOCKS - 1 - i) * BLOCK);
                (0..BLOCK).all(|j| b[roff + j] == written(loff + j))
            }),
            _ => b.iter().enumerate().all(|(i, &v)| v == written(i)),
        };
        writeln!(out, "@check {}", if ok { "ok" } else { "bad" }).unwrap();
        out.flush().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let _ = pr.join();
    let st: Vec<String> =
        gixl::fabric::selftest::records().iter().map(|r| format!("{} {:.1} ms", r.device, r.ms)).collect();
    eprintln!("target self-tests: {st:?}");
    fab_buf.clear();
    tcp_buf.clear();
}

/// The target process and its answers.
struct Target {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: BufReader<std::process::ChildStdout>,
}

impl Target {
    fn line(&mut self, prefix: &str) -> String {
        loop {
            let mut l = String::new();
            assert!(self.stdout.read_line(&mut l).unwrap() > 0, "the target exited");
            if let Some(rest) = l.trim().strip_prefix(prefix) {
                return rest.trim().to_owned();
            }
        }
    }

    /// Whether buffer `which` holds what the initiator WROTE: all of it (`what` = "all"), or the scattered
    /// blocks ("blocks").
    fn check(&mut self, what: &str, which: usize) -> bool {
        writeln!(self.stdin, "{what} {which}").unwrap();
        self.stdin.flush().unwrap();
        self.line("@check") == "ok"
    }
}

/// One way of moving the data from the initiator: a gixl agent on a route, or the raw ceiling.
trait Way {
    /// Seconds for each of `iters` transfers of `op` (`scattered`: 1024 × 16 KiB blocks, else `len` bytes).
    fn time(&self, write: bool, len: usize, scattered: bool, iters: usize) -> Vec<f64>;
    fn local(&self) -> &[u8];
}

/// A gixl agent in this process and its peer's buffer.
struct Gixl {
    a: Agent,
    peer: String,
    local: Vec<u8>,
    raddr: u64,
}

impl Gixl {
    /// The agent, its buffer registered, the target's metadata loaded, and one 4 KiB READ (it opens the
    /// route, whose name is checked); the milliseconds from loading the metadata to that READ's completion.
    fn new(name: &str, transport: &str, md: &[u8], raddr: u64) -> (Gixl, f64) {
        let a = agent(name, transport);
        let local = vec![0u8; BIG];
        a.register_mem(&reg(&local), &[]).unwrap();
        let t = Instant::now();
        let peer = a.load_remote_md(md).unwrap();
        let g = Gixl { a, peer, local, raddr };
        g.time(false, SMALL, false, 1);
        let first = t.elapsed().as_secs_f64() * 1e3;
        let route = gixl::telemetry::live_agents()
            .into_iter()
            .find(|(n, _, _)| n == name)
            .and_then(|(_, _, rows)| rows.into_iter().next())
            .map(|r| r.route)
            .unwrap_or_default();
        assert_eq!(route, if transport == "fabric" { "libfabric" } else { "tcp" }, "the {transport} agent's route");
        (g, first)
    }

    fn lists(&self, len: usize, scattered: bool) -> (XferDList, XferDList) {
        let (l, r) = (self.local.as_ptr() as u64, self.raddr);
        let n = if scattered { BLOCKS } else { 1 };
        let each = if scattered { BLOCK } else { len };
        // Scattered: the remote blocks reversed, every other one of the local blocks (nothing merges).
        let ld = (0..n).map(|i| Desc::new(l + (2 * i * each % BIG) as u64, each as u64, 0)).collect();
        let rd = (0..n).map(|i| Desc::new(r + ((n - 1 - i) * each) as u64, each as u64, 0)).collect();
        (XferDList::with_descs(MemType::Dram, ld), XferDList::with_descs(MemType::Dram, rd))
    }
}

impl Way for Gixl {
    fn time(&self, write: bool, len: usize, scattered: bool, iters: usize) -> Vec<f64> {
        let (l, r) = self.lists(len, scattered);
        let op = if write { XferOp::Write } else { XferOp::Read };
        let req = self.a.create_xfer_req(op, &l, &r, &self.peer, &XferOpts::default()).unwrap();
        (0..iters)
            .map(|_| {
                let t = Instant::now();
                let mut s = self.a.post_xfer_req(&req, NotifUpdate::Keep).unwrap();
                while s == Status::InProg {
                    std::hint::spin_loop();
                    s = self.a.xfer_status(&req).unwrap();
                }
                assert_eq!(s, Status::Success);
                t.elapsed().as_secs_f64()
            })
            .collect()
    }
    fn local(&self) -> &[u8] {
        &self.local
    }
}

/// The ceiling's initiator: a raw endpoint, the target's raw endpoint in its address vector.
struct Ceiling {
    raw: Raw,
    peer: u64,
    remote: RemoteKey,
}

impl Ceiling {
    fn new(addr: &[u8], remote: RemoteKey) -> Ceiling {
        let raw = Raw::new(vec![0u8; BIG]);
        let peer = raw.av.insert(addr).unwrap();
        Ceiling { raw, peer, remote }
    }

    /// One transfer of `bytes` in operations of `op` bytes (64 in flight; `scattered`: the remote blocks
    /// reversed, the local ones every other), its completions read without sleeping where `spin`.
    fn once(&self, write: bool, bytes: usize, op: usize, scattered: bool, spin: bool) -> f64 {
        let op = op.min(bytes);
        let n = bytes / op;
        let ctx = std::ptr::without_provenance_mut::<c_void>(7);
        let cqs = [&**self.raw.ep.cq()];
        let t = Instant::now();
        let (mut pending, mut i) = (0usize, 0usize);
        while i < n || pending > 0 {
            if i < n && pending < 64 {
                let (loff, roff) = if scattered { (2 * i * op % BIG, (n - 1 - i) * op) } else { (i * op, i * op) };
                let remote = RemoteKey { addr: self.remote.addr + roff as u64, key: self.remote.key };
                // SAFETY: inside the registered local buffer, which outlives the operation (waited for here);
                // `remote` lies in the target's registered buffer.
                let posted = unsafe {
                    let ptr = self.raw.buf.as_ptr().add(loff) as *mut u8;
                    self.raw.ep.post(write, &self.raw.mr, (ptr, op), self.peer, remote, ctx).unwrap()
                };
                if posted {
                    pending += 1;
                    i += 1;
                    continue;
                }
            }
            fi::drain(&cqs, |c| pending -= usize::from(c == ctx)).unwrap();
            if pending > 0 && i >= n && !spin {
                fi::wait(&self.raw.fabric, &cqs, fi::SLICE).unwrap();
            }
            // WRITEs end as the route's do: a 1-byte READ of the last byte written, answered by the target
            // only once the WRITEs before it on the connection are placed (ofi_rxm over tcp completes a WRITE
            // when its data left, though delivery-complete is asked for): the data is then at the target.
            if write && i == n && pending == 0 {
                let roff = if scattered { 0 } else { (n - 1) * op };
                let last = RemoteKey { addr: self.remote.addr + (roff + op - 1) as u64, key: self.remote.key };
                // SAFETY: the local buffer's last byte, registered; every WRITE before has completed (its
                // source may be reused), and the byte READ back is the one written there (the scattered
                // blocks never reach it); `last` lies in the target's region.
                while !unsafe {
                    let ptr = self.raw.buf.as_ptr().add(BIG - 1) as *mut u8;
                    self.raw.ep.post(false, &self.raw.mr, (ptr, 1), self.peer, last, ctx).unwrap()
                } {
                    fi::drain(&cqs, |_| {}).unwrap();
                }
                pending = 1;
                i += 1;
            }
        }
        t.elapsed().as_secs_f64()
    }
}

impl Way for Ceiling {
    fn time(&self, write: bool, len: usize, scattered: bool, iters: usize) -> Vec<f64> {
        let (bytes, op) = if scattered { (BLOCKS * BLOCK, BLOCK) } else { (len, len.min(8 << 20)) };
        (0..iters).map(|_| self.once(write, bytes, op, scattered, len <= SMALL)).collect()
    }
    fn local(&self) -> &[u8] {
        &self.raw.buf
    }
}

/// GB/s of each way (by its index), its rounds taken in turn with the others' (one round of each, `ROUNDS`
/// times), so that a load that comes and goes on the machine weighs on every way alike.
fn bws(ways: &[(&dyn Way, usize)], write: bool, scattered: bool) -> [f64; 3] {
    let bytes = if scattered { BLOCKS * BLOCK } else { BIG };
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for &(w, _) in ways {
        w.time(write, BIG, scattered, 1);
    }
    for _ in 0..ROUNDS {
        for &(w, i) in ways {
            times[i].extend(w.time(write, BIG, scattered, 1));
        }
    }
    times.map(|t| if t.is_empty() { 0.0 } else { bytes as f64 / median(t) / 1e9 })
}

fn latency(w: &dyn Way) -> f64 {
    w.time(false, SMALL, false, 50);
    median(w.time(false, SMALL, false, LAT_ITERS)) * 1e6
}

/// Whether what was READ last (of `len` bytes, or the scattered blocks) is the target's pattern `seed`.
fn read_ok(w: &dyn Way, seed: usize, scattered: bool) -> bool {
    let l = w.local();
    if scattered {
        (0..BLOCKS).all(|i| {
            let (loff, roff) = (2 * i * BLOCK % BIG, (BLOCKS - 1 - i) * BLOCK);
            (0..BLOCK).step_by(509).all(|j| l[loff + j] == ((roff + j + seed) % 251) as u8)
        })
    } else {
        l.iter().enumerate().all(|(i, &v)| v == ((i + seed) % 251) as u8)
    }
}

fn initiator() {
    let root = common::fabric::setup("fabric bench initiator").expect("the parent found libfabric");
    let ns = std::env::var("GIXL_BENCH_TARGET_NS").ok();
    let exe = std::env::current_exe().unwrap();
    let mut c = match &ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    c.env("GIXL_BENCH_ROLE", "target").stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let (stdin, stdout) = (child.stdin.take().unwrap(), BufReader::new(child.stdout.take().unwrap()));
    let mut t = Target { child, stdin, stdout };
    let (fab_md, tcp_md) = (common::unhex(&t.line("@md")), common::unhex(&t.line("@md")));
    let bufs: Vec<u64> = t.line("@bufs").split(' ').map(|v| v.parse().unwrap()).collect();
    let raw: Vec<String> = t.line("@raw").split(' ').map(str::to_owned).collect();
    t.line("@ready");

    let load = loadavg();
    let (mut fab, fab_first) = Gixl::new("fab-i", "fabric", &fab_md, bufs[0]);
    let (mut tcp, tcp_first) = Gixl::new("tcp-i", "tcp", &tcp_md, bufs[1]);
    let remote = RemoteKey { addr: raw[1].parse().unwrap(), key: raw[2].parse().unwrap() };
    let mut ceiling = Ceiling::new(&common::unhex(&raw[0]), remote);
    let mut rows: Vec<(&str, [f64; 3], bool)> = Vec::new();
    {
        // READs first (the target's patterns are still whole), then the latency, then a 64 MiB READ again.
        let ways: [(&dyn Way, usize); 3] = [(&fab, 0), (&tcp, 1), (&ceiling, 2)];
        for (name, scattered) in [("64 MiB READ GB/s", false), ("1024 × 16 KiB READ GB/s", true)] {
            let v = bws(&ways, false, scattered);
            let ok = ways.iter().all(|&(w, i)| read_ok(w, SEEDS[i], scattered));
            rows.push((name, v, ok));
        }
        let (mut v, mut ok) = ([0.0; 3], true);
        for (w, i) in ways {
            v[i] = latency(w);
            w.time(false, BIG, false, 1);
            ok &= read_ok(w, SEEDS[i], false);
        }
        rows.push(("4 KiB READ median µs", v, ok));
    }
    // Then WRITEs of a pattern of their own, checked at the target.
    for b in [&mut fab.local, &mut tcp.local, &mut ceiling.raw.buf] {
        b.iter_mut().enumerate().for_each(|(i, v)| *v = written(i));
    }
    let ways: [(&dyn Way, usize); 3] = [(&fab, 0), (&tcp, 1), (&ceiling, 2)];
    for (name, scattered) in [("64 MiB WRITE GB/s", false), ("1024 × 16 KiB WRITE GB/s", true)] {
        let v = bws(&ways, true, scattered);
        let ok = ways.iter().fold(true, |ok, &(_, i)| t.check(if scattered { "blocks" } else { "all" }, i) && ok);
        rows.push((name, v, ok));
    }
    let pp = pingpong(&root, ns.as_deref(), std::env::var("GIXL_BENCH_TARGET_IP").ok().as_deref());
    println!(
        "libfabric {PROVIDER} {}: gixl's libfabric route vs gixl's TCP route vs the provider's ceiling ({} cores, \
         load {load} at the start, {} at the end)",
        if ns.is_some() { "between two network namespaces (veth pairs on a bridge)" } else { "in one namespace" },
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        loadavg()
    );
    println!("| | gixl libfabric | gixl TCP | provider ceiling | libfabric / ceiling | data |");
    println!("|---|---|---|---|---|---|");
    for name in [
        "64 MiB READ GB/s",
        "64 MiB WRITE GB/s",
        "1024 × 16 KiB READ GB/s",
        "1024 × 16 KiB WRITE GB/s",
        "4 KiB READ median µs",
    ] {
        let Some((_, v, ok)) = rows.iter().find(|r| r.0 == name) else { continue };
        let lat = name.starts_with("4 KiB");
        let ratio = if lat { format!("{:.2}×", v[0] / v[2]) } else { format!("{:.0} %", 100.0 * v[0] / v[2]) };
        let ceil = if lat {
            format!(
                "{:.1} (fi_pingpong's 4 KiB round trip: {})",
                v[2],
                pp.as_ref().map_or_else(|e| format!("n/a: {e}"), |v| format!("{v:.1}"))
            )
        } else {
            format!("{:.2}", v[2])
        };
        let d = if lat { 1 } else { 2 };
        println!(
            "| {name} | {:.d$} | {:.d$} | {ceil} | {ratio} | {} |",
            v[0],
            v[1],
            if *ok { "checked" } else { "WRONG" }
        );
    }
    let route: Vec<String> =
        gixl::fabric::selftest::records().iter().map(|r| format!("{} {:.1} ms", r.device, r.ms)).collect();
    let mut own: Vec<f64> = (0..5)
        .map(|_| match fi::selftest::run(&device(), Duration::from_secs(10)).outcome {
            fi::selftest::Outcome::Passed { cost } => cost.as_secs_f64() * 1e3,
            fi::selftest::Outcome::Failed { step, error, .. } => panic!("self-test failed at {}: {error}", step.name()),
        })
        .collect();
    own.sort_by(f64::total_cmp);
    println!(
        "self-test: on the route's endpoint (started in the background when it opened, at the first \
         registration) {route:?}; from loading the peer's metadata to the first 4 KiB READ's completion: \
         libfabric {fab_first:.1} ms, TCP {tcp_first:.1} ms; on an endpoint of its own (as `gixl doctor` runs \
         it) {own:.1?} ms (5 runs, sorted)"
    );
    drop(t.stdin);
    let _ = t.child.wait();
    assert!(rows.iter().all(|r| r.2), "some data moved was wrong (see the table)");
}

fn loadavg() -> String {
    let l = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

/// `fi_pingpong`'s 4 KiB round trip (µs) over the tcp provider: its server in the target's namespace (`ns`,
/// at `ip`), its client here.
fn pingpong(root: &std::path::Path, ns: Option<&str>, ip: Option<&str>) -> std::result::Result<f64, String> {
    let bin = root.join("usr/bin/fi_pingpong");
    let libs = format!("{0}/usr/lib/x86_64-linux-gnu:{0}/lib/x86_64-linux-gnu", root.display());
    let args = ["-p", "tcp", "-e", "rdm", "-S", "4096", "-I", "2000", "-B", "47592"];
    let mut server = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&bin);
            c
        }
        None => Command::new(&bin),
    };
    let mut server = server
        .args(args)
        .env("LD_LIBRARY_PATH", &libs)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    std::thread::sleep(Duration::from_millis(500));
    let client = Command::new("timeout")
        .arg("30")
        .arg(&bin)
        .args(&args[..8])
        .arg(ip.unwrap_or("127.0.0.1"))
        .env("LD_LIBRARY_PATH", &libs)
        .output()
        .map_err(|e| e.to_string());
    let _ = server.kill();
    let _ = server.wait();
    let client = client?;
    let out = String::from_utf8_lossy(&client.stdout).into_owned();
    // Its row: bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec, two transfers (ping and pong) an
    // iteration: a round trip is two.
    let row = out.lines().rev().find(|l| l.trim_start().starts_with("4k")).ok_or_else(|| {
        format!("no 4k row in its output: {} {}", out.trim(), String::from_utf8_lossy(&client.stderr).trim())
    })?;
    let usec: f64 = row.split_whitespace().nth(6).and_then(|v| v.parse().ok()).ok_or("no usec/xfer column")?;
    Ok(2.0 * usec)
}
