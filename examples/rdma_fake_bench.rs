//! What the RDMA route costs to post, over the fake fabric, beside the TCP route, between two processes of this host:
//!
//!     cargo run --release --example rdma_fake_bench [REQUESTS]        # default 200
//!
//! A target process registers 16 MiB; this process READs it as KV blocks, 1024 × 16 KiB per request, REQUESTS
//! times after a warm-up: with `GIXL_TRANSPORT=rdma` over the fake fabric (`GIXL_FAKE_VERBS=1`) with the remote
//! blocks reversed (nothing adjacent: one work request per block) and in order (adjacent blocks share a work
//! request), then with `GIXL_TRANSPORT=tcp` (reversed). Printed per request: the route's work
//! requests and chains posted (RDMA only, from its counters), the CPU time of the threads that built, posted and
//! completed them (RDMA only: the route's own cost, not the NIC's), the wall time, and this process's whole CPU
//! time, which over the fake includes its "NIC" threads copying every byte through Unix sockets. The fake says
//! nothing about RDMA hardware's throughput; the posting figures are the route's own work on any fabric.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use gixl::*;

const SIZE: usize = 16 << 20;
const BLOCK: usize = 16 << 10;

fn agent(name: &str) -> Agent {
    let a = Agent::new(name, AgentConfig::default()).expect("agent");
    a.create_backend("UCX", &Params::new()).expect("UCX backend");
    a
}

fn reg(a: &Agent, buf: &[u8]) {
    let d = Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0);
    a.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }]), &[])
        .expect("register");
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex")).collect()
}

fn process_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn target() {
    let a = agent("bench-target");
    let buf = vec![7u8; SIZE];
    reg(&a, &buf);
    println!("@md {} {}", hex(&a.local_md().expect("md")), buf.as_ptr() as u64);
    std::io::stdout().flush().expect("stdout");
    // Serve until the initiator closes our stdin.
    let _ = std::io::stdin().lock().lines().count();
}

/// One run over `transport`, the remote blocks `reversed` or in order: (wall µs, process CPU µs, route WRs,
/// chains, route CPU µs) per request.
fn run(transport: &str, reversed: bool, requests: usize, dir: &std::path::Path) -> (f64, f64, f64, f64, f64) {
    let exe = std::env::current_exe().expect("exe");
    let mut child = Command::new(exe)
        .env("GIXL_BENCH_ROLE", "target")
        .env("GIXL_TRANSPORT", transport)
        .env("GIXL_FAKE_VERBS", "1")
        .env("GIXL_FAKE_VERBS_DIR", dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("target process");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("target's metadata");
    let f: Vec<&str> = line.trim().trim_start_matches("@md ").split(' ').collect();
    let (md, raddr) = (unhex(f[0]), f[1].parse::<u64>().expect("address"));

    std::env::set_var("GIXL_TRANSPORT", transport);
    let a = agent(&format!("bench-{transport}-{reversed}"));
    let dst = vec![0u8; SIZE];
    reg(&a, &dst);
    a.load_remote_md(&md).expect("load");
    let n = SIZE / BLOCK;
    let l = XferDList::with_descs(
        MemType::Dram,
        (0..n).map(|i| Desc::new(dst.as_ptr() as u64 + (i * BLOCK) as u64, BLOCK as u64, 0)).collect(),
    );
    let r = XferDList::with_descs(
        MemType::Dram,
        (0..n)
            .map(|i| Desc::new(raddr + ((if reversed { n - 1 - i } else { i }) * BLOCK) as u64, BLOCK as u64, 0))
            .collect(),
    );
    let req = a.create_xfer_req(XferOp::Read, &l, &r, "bench-target", &XferOpts::default()).expect("request");
    let go = |count: usize| {
        for _ in 0..count {
            let mut s = a.post_xfer_req(&req, NotifUpdate::Keep).expect("post");
            while s == Status::InProg {
                std::thread::sleep(std::time::Duration::from_micros(50));
                s = a.xfer_status(&req).expect("status");
            }
            assert_eq!(s, Status::Success);
        }
    };
    go(5);
    assert!(dst.iter().all(|&b| b == 7), "wrong bytes");
    let (w0, c0, t0) = (gixl::backend::engine::rdma_posting_stats(), process_cpu_ns(), Instant::now());
    go(requests);
    let wall = t0.elapsed().as_nanos() as f64;
    let (cpu, w1) = ((process_cpu_ns() - c0) as f64, gixl::backend::engine::rdma_posting_stats());
    drop(child.stdin.take());
    let _ = child.wait();
    let per = |x: f64| x / requests as f64;
    (
        per(wall) / 1e3,
        per(cpu) / 1e3,
        per((w1.0 - w0.0) as f64),
        per((w1.1 - w0.1) as f64),
        per((w1.2 - w0.2) as f64) / 1e3,
    )
}

fn main() {
    if std::env::var("GIXL_BENCH_ROLE").as_deref() == Ok("target") {
        return target();
    }
    let requests: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200);
    let dir = std::env::temp_dir().join(format!("gixl-rdma-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("fake fabric directory");
    std::env::set_var("GIXL_FAKE_VERBS", "1");
    std::env::set_var("GIXL_FAKE_VERBS_DIR", &dir);
    println!("KV READ, 1024 x 16 KiB per request, {requests} requests, two processes of this host");
    println!(
        "{:<22} {:>10} {:>12} {:>8} {:>8} {:>14}",
        "route", "wall us", "process CPU", "WRs", "chains", "route CPU us"
    );
    for (transport, reversed) in [("rdma", true), ("rdma", false), ("tcp", true)] {
        let (wall, cpu, wrs, chains, route_cpu) = run(transport, reversed, requests, &dir);
        let (wrs, chains, route) = if transport == "rdma" {
            (format!("{wrs:.0}"), format!("{chains:.1}"), format!("{route_cpu:.1}"))
        } else {
            ("-".into(), "-".into(), "-".into())
        };
        let name = match (transport, reversed) {
            ("rdma", true) => "rdma, blocks scattered",
            ("rdma", false) => "rdma, blocks in order",
            _ => "tcp, blocks scattered",
        };
        println!("{name:<22} {wall:>10.0} {cpu:>12.0} {wrs:>8} {chains:>8} {route:>14}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
