//! gixl's libfabric route over the tcp provider (`tcp;ofi_rxm`) beside gixl's own TCP route and beside the
//! provider's own ceiling on the same link, printed as a table: 64 MiB READ and WRITE, 1024 × 16 KiB scattered
//! READ and WRITE (GB/s, median of the rounds), and the 4 KiB READ latency (median µs); then what a device's
//! self-test costs. Two agents of this process on this host's interface (`GIXL_TRANSPORT=fabric` for the
//! libfabric route, `tcp` for gixl's TCP route; in-process peers still go over the route asked for, with the
//! target's side served by its own threads).
//!
//! The ceiling is a small program over the same wrappers the route uses (`gixl::fabric`): two RDM endpoints of
//! this process, the same operations (8 MiB, or one per 16 KiB block), 64 in flight, both queues read by the waiting thread (the provider
//! moves data only when its queues are read); and `fi_pingpong` (libfabric-bin's own program: RDM messages, two
//! processes) for the provider's own 4 KiB round trip.
//!
//! Run: `cargo bench --bench fabric` (about a minute; the library as tests/fabric.rs finds it:
//! ~/.cache/gixl/libfabric from scripts/setup.sh, or GIXL_LIBFABRIC / GIXL_LIBFABRIC_ROOT).

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gixl::fabric::{self as fi, Av, Cq, Domain, Endpoint, Fabric, Mr};
use gixl::*;

#[path = "../tests/common/fabric.rs"]
mod fabric_setup;

const BIG: usize = 64 << 20;
const BLOCK: usize = 16 << 10;
const BLOCKS: usize = 1024;
const SMALL: usize = 4096;
const ROUNDS: usize = 5;
const LAT_ITERS: usize = 2000;
const PROVIDER: &str = "tcp;ofi_rxm";

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let Some(root) = fabric_setup::setup("fabric bench") else { return };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "libfabric {PROVIDER}: gixl's libfabric route vs gixl's TCP route vs the provider's ceiling ({} cores, load {})",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    let fabric = Pair::new("fabric");
    let tcp = Pair::new("tcp");
    let ceiling = Ceiling::new();
    println!("| | gixl libfabric | gixl TCP | provider ceiling | libfabric / ceiling |");
    println!("|---|---|---|---|---|");
    for (name, op, scattered) in [
        ("64 MiB READ GB/s", XferOp::Read, false),
        ("64 MiB WRITE GB/s", XferOp::Write, false),
        ("1024 × 16 KiB READ GB/s", XferOp::Read, true),
        ("1024 × 16 KiB WRITE GB/s", XferOp::Write, true),
    ] {
        let bytes = if scattered { BLOCKS * BLOCK } else { BIG };
        let each = if scattered { BLOCK } else { 8 << 20 };
        let (f, t) = (fabric.bw(op, scattered), tcp.bw(op, scattered));
        let c = ceiling.bw(op == XferOp::Write, bytes, each);
        println!("| {name} | {f:.2} | {t:.2} | {c:.2} | {:.0} % |", 100.0 * f / c);
    }
    let (f, t, c) = (fabric.latency(), tcp.latency(), ceiling.latency());
    let pp = pingpong(&root);
    println!(
        "| 4 KiB READ median µs | {f:.1} | {t:.1} | {c:.1} (fi_pingpong 4 KiB RTT: {}) | {:.2}× |",
        pp.map_or_else(|e| format!("n/a: {e}"), |v| format!("{v:.1}")),
        f / c
    );
    fabric.check();
    tcp.check();
    let mut costs: Vec<f64> = (0..5)
        .map(|_| match fi::selftest::run_provider(PROVIDER, None, Duration::from_secs(10)).outcome {
            fi::selftest::Outcome::Passed { cost } => cost.as_secs_f64() * 1e3,
            fi::selftest::Outcome::Failed { step, error, .. } => panic!("self-test failed at {}: {error}", step.name()),
        })
        .collect();
    costs.sort_by(f64::total_cmp);
    let shm = fi::selftest::run_provider("shm", None, Duration::from_secs(10));
    println!("self-test {PROVIDER}: {costs:.1?} ms (5 runs, sorted); shm: {shm}");
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Two agents of this process, the initiator's regions (64 MiB) and the target's (64 MiB), over `transport`.
struct Pair {
    a: Agent,
    _b: Agent,
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Pair {
    fn new(transport: &str) -> Pair {
        let agent = |name: &str| {
            let a = Agent::new(name, AgentConfig::default()).unwrap();
            let p: Params = [("transport", transport), ("fabric_provider", PROVIDER)]
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect();
            a.create_backend("LIBFABRIC", &p).unwrap();
            a
        };
        let (a, b) = (agent(&format!("{transport}-a")), agent(&format!("{transport}-b")));
        let src: Vec<u8> = (0..BIG).map(|i| (i % 251) as u8).collect();
        let dst = vec![0u8; BIG];
        let reg = |buf: &[u8]| {
            RegDList::with_descs(
                MemType::Dram,
                vec![RegDesc { desc: Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0), meta: vec![] }],
            )
        };
        a.register_mem(&reg(&dst), &[]).unwrap();
        b.register_mem(&reg(&src), &[]).unwrap();
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let route = gixl::telemetry::live_agents()
            .into_iter()
            .find(|(n, _, _)| *n == format!("{transport}-a"))
            .and_then(|(_, _, rows)| rows.into_iter().next())
            .map(|r| r.route)
            .unwrap_or_default();
        let want = if transport == "fabric" { "libfabric" } else { "tcp" };
        assert_eq!(route, want, "the {transport} pair's route");
        Pair { a, _b: b, src, dst }
    }

    fn lists(&self, len: usize, scattered: bool) -> (XferDList, XferDList) {
        let (l, r) = (self.dst.as_ptr() as u64, self.src.as_ptr() as u64);
        let n = if scattered { BLOCKS } else { 1 };
        let each = if scattered { BLOCK } else { len };
        // Scattered: the remote blocks reversed, every other one of the local blocks (nothing merges).
        let ld = (0..n).map(|i| Desc::new(l + (2 * i * each % BIG) as u64, each as u64, 0)).collect();
        let rd = (0..n).map(|i| Desc::new(r + ((n - 1 - i) * each) as u64, each as u64, 0)).collect();
        (XferDList::with_descs(MemType::Dram, ld), XferDList::with_descs(MemType::Dram, rd))
    }

    /// Seconds per post of a prepared request, each round.
    fn time(&self, op: XferOp, len: usize, scattered: bool, iters: usize) -> Vec<f64> {
        let (l, r) = self.lists(len, scattered);
        let peer = self._b.name().to_owned();
        let req = self.a.create_xfer_req(op, &l, &r, &peer, &XferOpts::default()).unwrap();
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

    fn bw(&self, op: XferOp, scattered: bool) -> f64 {
        let bytes = if scattered { BLOCKS * BLOCK } else { BIG };
        self.time(op, BIG, scattered, 1);
        bytes as f64 / median(self.time(op, BIG, scattered, ROUNDS)) / 1e9
    }

    fn latency(&self) -> f64 {
        self.time(XferOp::Read, SMALL, false, 50);
        median(self.time(XferOp::Read, SMALL, false, LAT_ITERS)) * 1e6
    }

    /// The bytes READ last are the target's.
    fn check(&self) {
        self.time(XferOp::Read, BIG, false, 1);
        assert!(self.dst == self.src, "the data READ differs from the target's");
    }
}

/// The provider's own ceiling: two endpoints of this process, raw operations.
struct Ceiling {
    fabric: Fabric,
    ep: Arc<Endpoint>,
    cq1: Arc<Cq>,
    peer: u64,
    mr0: Mr,
    mr1: Mr,
    local: Vec<u8>,
    target: Vec<u8>,
}

impl Ceiling {
    fn new() -> Ceiling {
        let all = fi::devices(Some(PROVIDER), None).unwrap();
        let dev = all.iter().find(|d| d.domain() != "lo").or(all.first()).expect("a tcp;ofi_rxm device").clone();
        let fabric = Fabric::open(&dev).unwrap();
        let domain = Domain::open(&fabric, &dev).unwrap();
        let (cq0, cq1) = (Cq::open(&domain, 1024).unwrap(), Cq::open(&domain, 1024).unwrap());
        let (av0, av1) = (Av::open(&domain, 4).unwrap(), Av::open(&domain, 4).unwrap());
        let ep = Arc::new(Endpoint::open(&domain, &dev, &cq0, &av0).unwrap());
        let ep1 = Arc::new(Endpoint::open(&domain, &dev, &cq1, &av1).unwrap());
        let peer = av0.insert(&ep1.name().unwrap()).unwrap();
        av1.insert(&ep.name().unwrap()).unwrap();
        let mut local = vec![0u8; BIG];
        let mut target: Vec<u8> = (0..BIG).map(|i| (i % 251) as u8).collect();
        // SAFETY: both buffers live in the returned value with their regions, which are dropped first (field
        // order does not matter for Vec heap storage: it does not move).
        let mr0 = unsafe { Mr::register(&domain, local.as_mut_ptr(), BIG, &ep).unwrap() };
        // SAFETY: as above.
        let mr1 = unsafe { Mr::register(&domain, target.as_mut_ptr(), BIG, &ep1).unwrap() };
        std::mem::forget(ep1);
        Ceiling { fabric, ep, cq1, peer, mr0, mr1, local, target }
    }

    /// `bytes` in operations of `op` bytes (64 in flight), waited for as the route waits; seconds.
    fn once(&self, write: bool, bytes: usize, op: usize) -> f64 {
        let op = op.min(bytes);
        let t = Instant::now();
        let mut pending = 0usize;
        let mut off = 0;
        let cqs = [&**self.ep.cq(), &*self.cq1];
        while off < bytes || pending > 0 {
            if off < bytes && pending < 64 {
                // SAFETY: inside both registered buffers, which outlive the operation (waited for here).
                let posted = unsafe {
                    let remote = self.mr1.remote(self.target.as_ptr().add(off)).unwrap();
                    let ptr = self.local.as_ptr().add(off) as *mut u8;
                    self.ep
                        .post(
                            write,
                            &self.mr0,
                            (ptr, op),
                            self.peer,
                            remote,
                            std::ptr::without_provenance_mut::<c_void>(7),
                        )
                        .unwrap()
                };
                if posted {
                    pending += 1;
                    off += op;
                    continue;
                }
            }
            fi::drain(&cqs, |c| pending -= usize::from(c == std::ptr::without_provenance_mut::<c_void>(7))).unwrap();
            if pending > 0 && off >= bytes {
                fi::wait(&self.fabric, &cqs, fi::SLICE).unwrap();
            }
        }
        t.elapsed().as_secs_f64()
    }

    fn bw(&self, write: bool, bytes: usize, op: usize) -> f64 {
        self.once(write, bytes, op);
        bytes as f64 / median((0..ROUNDS).map(|_| self.once(write, bytes, op)).collect()) / 1e9
    }

    fn latency(&self) -> f64 {
        (0..50).for_each(|_| _ = self.once(false, SMALL, SMALL));
        median((0..LAT_ITERS).map(|_| self.once(false, SMALL, SMALL)).collect()) * 1e6
    }
}

/// `fi_pingpong`'s 4 KiB round trip (µs) over the tcp provider between two processes on this host.
fn pingpong(root: &std::path::Path) -> std::result::Result<f64, String> {
    let bin = root.join("usr/bin/fi_pingpong");
    let libs = format!("{0}/usr/lib/x86_64-linux-gnu:{0}/lib/x86_64-linux-gnu", root.display());
    let server = std::thread::spawn({
        let bin = bin.clone();
        let libs = libs.clone();
        move || {
            std::process::Command::new(bin)
                .args(["-p", "tcp", "-e", "rdm", "-S", "4096", "-I", "2000", "-B", "47592"])
                .env("LD_LIBRARY_PATH", libs)
                .output()
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    let client = std::process::Command::new(&bin)
        .args(["-p", "tcp", "-e", "rdm", "-S", "4096", "-I", "2000", "127.0.0.1"])
        .env("LD_LIBRARY_PATH", &libs)
        .output()
        .map_err(|e| e.to_string())?;
    let _ = server.join();
    let out = String::from_utf8_lossy(&client.stdout).into_owned();
    // Its row: bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec, two transfers (ping and pong) an
    // iteration: a round trip is two.
    let row = out.lines().rev().find(|l| l.trim_start().starts_with("4k")).ok_or_else(|| {
        format!("no 4k row in its output: {} {}", out.trim(), String::from_utf8_lossy(&client.stderr).trim())
    })?;
    let usec: f64 = row.split_whitespace().nth(6).and_then(|v| v.parse().ok()).ok_or("no usec/xfer column")?;
    Ok(2.0 * usec)
}
