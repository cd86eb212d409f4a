//! One side of the cross-host TCP measurement in `scripts/bench_tcp.py` (which runs it inside network
//! namespaces): `target`, `initiator` or `hammer`. Metadata travels through a file.
//!
//! ```text
//! tcp_peer target MDFILE                  register 64 MiB + 1024 × 16 KiB, write metadata, wait for stdin EOF
//! tcp_peer initiator MDFILE ITERS         READ both and WRITE 64 MiB ITERS times, time 1000 4 KiB READs;
//!                                         print one JSON line of figures
//! tcp_peer fanin MDFILE SECONDS           one of N initiators: print "@ready", wait for a line on stdin,
//!                                         then for SECONDS alternate a 1024 × 16 KiB READ and a 4 KiB READ,
//!                                         polling each for 100 µs, then with naps growing from 50 µs (N of
//!                                         them share the cores with the target); print one JSON line
//!                                         (bytes, seconds, 4 KiB latencies, failed requests counted by
//!                                         status, the first error)
//! tcp_peer hammer MDFILE                  READ 32 MiB in a loop, polling only, until it fails; print
//!                                         "@started" once, then "@failed STATUS MONOTONIC_NS"
//! ```

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use gixl::*;

const MIB: u64 = 1 << 20;
const BULK: u64 = 64 * MIB;
const BLOCK: u64 = 16 << 10;
const BLOCKS: u64 = 1024;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (role, mdfile) = (args[1].as_str(), args[2].as_str());
    let a = Agent::new(role, AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let bulk = vec![if role == "target" { 0x5au8 } else { 0 }; BULK as usize];
    let kv: Vec<u8> = (0..BLOCKS * BLOCK).map(|i| (i / BLOCK) as u8).collect();
    for b in [&bulk, &kv] {
        let d = Desc::new(b.as_ptr() as u64, b.len() as u64, 0);
        a.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }]), &[]).unwrap();
    }
    match role {
        "target" => {
            let md: String = a.local_md().unwrap().iter().map(|b| format!("{b:02x}")).collect();
            let tmp = format!("{mdfile}.tmp");
            std::fs::write(&tmp, format!("{md}\n{} {}\n", bulk.as_ptr() as u64, kv.as_ptr() as u64)).unwrap();
            std::fs::rename(&tmp, mdfile).unwrap();
            // Serve until told to stop; the target never calls into gixl meanwhile.
            for _ in std::io::stdin().lock().lines() {}
        }
        _ => {
            let text = std::fs::read_to_string(mdfile).unwrap();
            let mut lines = text.lines();
            let md: Vec<u8> = {
                let h = lines.next().unwrap();
                (0..h.len()).step_by(2).map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap()).collect()
            };
            let mut addrs = lines.next().unwrap().split(' ').map(|x| x.parse::<u64>().unwrap());
            let (rbulk, rkv) = (addrs.next().unwrap(), addrs.next().unwrap());
            let peer = a.load_remote_md(&md).unwrap();
            let dl = |base: u64, n: u64, len: u64, rev: bool| {
                let idx: Vec<u64> = if rev { (0..n).rev().collect() } else { (0..n).collect() };
                XferDList::with_descs(
                    MemType::Dram,
                    idx.into_iter().map(|i| Desc::new(base + i * len, len, 0)).collect(),
                )
            };
            let bulk_req = a
                .create_xfer_req(
                    XferOp::Read,
                    &dl(bulk.as_ptr() as u64, 1, BULK, false),
                    &dl(rbulk, 1, BULK, false),
                    &peer,
                    &XferOpts::default(),
                )
                .unwrap();
            // Remote blocks in reversed order, so nothing merges: 1024 separate pieces, as a KV cache read.
            let kv_req = a
                .create_xfer_req(
                    XferOp::Read,
                    &dl(kv.as_ptr() as u64, BLOCKS, BLOCK, false),
                    &dl(rkv, BLOCKS, BLOCK, true),
                    &peer,
                    &XferOpts::default(),
                )
                .unwrap();
            // Post `r` and poll it to the end. `polite` (bandwidth and fan-in): the initiator shares the machine's
            // cores with the target (and at fan-in with N others), so it polls as a consumer with other work
            // would, not in a tight loop that takes a core from the transfer: for 100 µs, then after naps from
            // 50 µs doubling up to a fiftieth of the time spent so far (at most 2 % added to a request's time).
            // The raw TCP program it is compared with blocks in recv(2). The 4 KiB latency probe and the hammer
            // poll in a tight loop.
            let poll = |r: &XferReq, polite: bool| -> Result<Duration> {
                let t = Instant::now();
                let mut s = a.post_xfer_req(r, NotifUpdate::Keep)?;
                let mut nap = Duration::from_micros(50);
                while s == Status::InProg {
                    if polite && t.elapsed() > Duration::from_micros(100) {
                        std::thread::sleep(nap);
                        nap = (nap * 2).min(t.elapsed() / 50).max(Duration::from_micros(50));
                    }
                    s = a.xfer_status(r)?;
                }
                Ok(t.elapsed())
            };
            let run = |r: &XferReq| poll(r, false);
            let run_polite = |r: &XferReq| poll(r, true);
            // One 4 KiB READ: the latency probe of the initiator and fan-in roles.
            let small = a
                .create_xfer_req(
                    XferOp::Read,
                    &dl(bulk.as_ptr() as u64, 1, 4096, false),
                    &dl(rbulk, 1, 4096, false),
                    &peer,
                    &XferOpts::default(),
                )
                .unwrap();
            if role == "hammer" {
                let chunk = a
                    .create_xfer_req(
                        XferOp::Read,
                        &dl(bulk.as_ptr() as u64, 1, 32 * MIB, false),
                        &dl(rbulk, 1, 32 * MIB, false),
                        &peer,
                        &XferOpts::default(),
                    )
                    .unwrap();
                let mut started = false;
                loop {
                    if let Err(e) = run(&chunk) {
                        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
                        // SAFETY: `ts` is a valid out-pointer.
                        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
                        println!(
                            "@failed {} {}",
                            e.status().name(),
                            ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
                        );
                        return;
                    }
                    if !std::mem::replace(&mut started, true) {
                        println!("@started");
                        std::io::stdout().flush().unwrap();
                    }
                }
            }
            if role == "fanin" {
                let secs: f64 = args[3].parse().unwrap();
                run(&small).unwrap();
                println!("@ready");
                std::io::stdout().flush().unwrap();
                let mut go = String::new();
                std::io::stdin().read_line(&mut go).unwrap();
                let (mut bytes, mut lat) = (0u64, Vec::new());
                let mut failures = std::collections::BTreeMap::<&'static str, u64>::new();
                let mut first: Option<String> = None;
                let mut failed = |e: Error| {
                    *failures.entry(e.status().name()).or_default() += 1;
                    first.get_or_insert_with(|| e.to_string());
                };
                let t0 = Instant::now();
                while t0.elapsed().as_secs_f64() < secs {
                    match run_polite(&kv_req) {
                        Ok(_) => bytes += BLOCKS * BLOCK,
                        Err(e) => failed(e),
                    }
                    match run_polite(&small) {
                        Ok(d) => lat.push(format!("{:.1}", d.as_secs_f64() * 1e6)),
                        Err(e) => failed(e),
                    }
                }
                let secs = t0.elapsed().as_secs_f64();
                let failures: Vec<String> = failures.iter().map(|(k, n)| format!("\"{k}\":{n}")).collect();
                let first = first.map(|m| format!("{m:?}")).unwrap_or_else(|| "null".into());
                println!(
                    "{{\"bytes\":{bytes},\"secs\":{secs:.4},\"lat_us\":[{}],\"failures\":{{{}}},\"first_error\":{first}}}",
                    lat.join(","),
                    failures.join(",")
                );
                return;
            }
            let iters: usize = args[3].parse().unwrap();
            let measure = |r: &XferReq, bytes: u64| -> (f64, f64) {
                for _ in 0..2 {
                    run_polite(r).unwrap();
                }
                let mut gbps: Vec<f64> =
                    (0..iters).map(|_| bytes as f64 / run_polite(r).unwrap().as_secs_f64() / 1e9).collect();
                gbps.sort_by(|x, y| x.partial_cmp(y).unwrap());
                let total: f64 = iters as f64 / gbps.iter().map(|g| 1.0 / g).sum::<f64>();
                (gbps[gbps.len() / 2], total)
            };
            let (bulk_med, bulk_all) = measure(&bulk_req, BULK);
            let (kv_med, kv_all) = measure(&kv_req, BLOCKS * BLOCK);
            assert!(bulk.iter().all(|&b| b == 0x5a));
            assert!((0..BLOCKS).all(|i| kv[(i * BLOCK) as usize] == (BLOCKS - 1 - i) as u8));
            // WRITE back what was read (the target's bytes stay 0x5a).
            let write_req = a
                .create_xfer_req(
                    XferOp::Write,
                    &dl(bulk.as_ptr() as u64, 1, BULK, false),
                    &dl(rbulk, 1, BULK, false),
                    &peer,
                    &XferOpts::default(),
                )
                .unwrap();
            let (write_med, write_all) = measure(&write_req, BULK);
            for _ in 0..50 {
                run(&small).unwrap();
            }
            let mut us: Vec<f64> = (0..1000).map(|_| run(&small).unwrap().as_secs_f64() * 1e6).collect();
            us.sort_by(|x, y| x.partial_cmp(y).unwrap());
            let (lat_med, lat_p99) = (us[us.len() / 2], us[us.len() * 99 / 100]);
            println!(
                "{{\"bulk_median_gbps\":{bulk_med:.3},\"bulk_gbps\":{bulk_all:.3},\"kv_median_gbps\":{kv_med:.3},\"kv_gbps\":{kv_all:.3},\
                 \"write_median_gbps\":{write_med:.3},\"write_gbps\":{write_all:.3},\"lat_median_us\":{lat_med:.1},\"lat_p99_us\":{lat_p99:.1}}}"
            );
        }
    }
}
