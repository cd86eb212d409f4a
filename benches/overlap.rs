//! What the overlap check (`GIXL_CHECK_OVERLAP`) costs, printed as a table (no criterion: the figures are
//! differences of medians taken in one run, interleaved, on and off side by side).
//!
//! 1. `post`: a loopback READ of 1024 scattered 8-byte descriptors (every 64 bytes: nothing merges), posted and
//!    polled to completion, by an agent with the check off and one with it on (`warn`), in alternating batches;
//!    the difference of the medians is what the check adds to a post (its check, its insertion, and leaving
//!    the table at completion). The footprint is built with the request, not per post; its cost is line 2.
//! 2. `footprint`: building a request's footprint from n scattered pieces in random order (a sort: O(n log n)),
//!    n = 1k, 100k, 1M.
//! 3. `check+insert+remove`: one n-piece request checked against a table holding another in-flight request of
//!    n pieces interleaved with it (every other block: no conflict, every range compared), put in and taken
//!    out; n = 1k, 100k, 1M. And a 1024-piece request against 16 in-flight 1024-piece requests.
//!
//! Run: `cargo bench --bench overlap` (about a minute).

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gixl::overlap::{Access, Footprint, Mode, Space, Table};
use gixl::*;

const N: usize = 1024;
const STRIDE: u64 = 64;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "overlap check cost ({} cores, load {})",
        num_cpus(),
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    post();
    footprint();
    table();
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn agent(name: &str, mode: Mode) -> Agent {
    let a = Agent::new(name, AgentConfig { check_overlap: mode, ..AgentConfig::default() }).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    a
}

/// One agent's loopback READ of `N` scattered descriptors, ready to post.
struct Loop {
    agent: Agent,
    req: XferReq,
    _bufs: [Vec<u8>; 2],
}

impl Loop {
    fn new(name: &str, mode: Mode) -> Loop {
        let agent = agent(name, mode);
        let bufs = [vec![1u8; N * STRIDE as usize], vec![0u8; N * STRIDE as usize]];
        for b in &bufs {
            let d = Desc::new(b.as_ptr() as u64, b.len() as u64, 0);
            agent
                .register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }]), &[])
                .unwrap();
        }
        let list = |b: &[u8]| {
            XferDList::with_descs(
                MemType::Dram,
                (0..N as u64).map(|i| Desc::new(b.as_ptr() as u64 + i * STRIDE, 8, 0)).collect(),
            )
        };
        let req =
            agent.create_xfer_req(XferOp::Read, &list(&bufs[1]), &list(&bufs[0]), name, &XferOpts::default()).unwrap();
        Loop { agent, req, _bufs: bufs }
    }

    /// Median ns of one post polled to completion, over a batch of `n`.
    fn batch(&self, n: usize) -> f64 {
        let mut t = Vec::with_capacity(n);
        for _ in 0..n {
            let t0 = Instant::now();
            let mut s = self.agent.post_xfer_req(&self.req, NotifUpdate::Keep).unwrap();
            while s == Status::InProg {
                s = self.agent.xfer_status(&self.req).unwrap();
            }
            t.push(t0.elapsed().as_nanos() as f64);
        }
        median(&mut t)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn post() {
    let off = Loop::new("off", Mode::Off);
    let on = Loop::new("on", Mode::Warn);
    for l in [&off, &on] {
        l.batch(2000);
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..15 {
        a.push(off.batch(2000));
        b.push(on.batch(2000));
    }
    let (ma, mb) = (median(&mut a), median(&mut b));
    println!(
        "post+complete, loopback READ of {N} scattered descriptors: off {:.2} µs, on {:.2} µs, on - off {:+.3} µs \
         (medians of 15 alternating batches of 2000)",
        ma / 1e3,
        mb / 1e3,
        (mb - ma) / 1e3
    );
    // The same with 16 other requests of 1024 scattered pieces in flight in the same spaces (the check then
    // compares), through the table alone (an agent's requests in flight would need a slow backend).
}

fn space(owner: u128) -> Space {
    Space { owner, mem: 0, dev: 0 }
}

/// n pieces of 64 bytes at every other 128-byte block, `phase` 0 or 1 (the two phases interleave and never
/// meet), in a random order.
fn pieces(n: usize, phase: u64, seed: u64) -> Vec<(Space, Access, u64, u64)> {
    let mut v: Vec<(Space, Access, u64, u64)> = (0..n as u64)
        .flat_map(|i| {
            let at = (2 * i + phase) * 128;
            [(space(1), Access::Write, at, 64), (space(2), Access::Read, at, 64)]
        })
        .collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn timed<R>(reps: usize, mut f: impl FnMut() -> R) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..reps {
        let t0 = Instant::now();
        black_box(f());
        best = best.min(t0.elapsed());
    }
    best
}

fn footprint() {
    for n in [1_000usize, 100_000, 1_000_000] {
        let p = pieces(n, 0, 7);
        let reps = if n >= 1_000_000 { 3 } else { 20 };
        let t = timed(reps, || Footprint::build(p.iter().copied()));
        println!(
            "footprint of a request of {n} pieces (local and remote, random order): {:.3} ms, {:.1} ns per piece",
            t.as_secs_f64() * 1e3,
            t.as_nanos() as f64 / n as f64
        );
    }
}

fn table() {
    for n in [1_000usize, 100_000, 1_000_000] {
        let mine = Arc::new(Footprint::build(pieces(n, 0, 7)));
        let theirs = Arc::new(Footprint::build(pieces(n, 1, 9)));
        let mut t: Table<()> = Table::default();
        t.insert(1, theirs.clone(), ());
        let reps = if n >= 1_000_000 { 3 } else { 20 };
        let d = timed(reps, || {
            let c = t.first_conflict(&mine, |_, _| true);
            assert!(c.is_none());
            t.insert(2, mine.clone(), ());
            t.remove(2);
        });
        println!(
            "check+insert+remove of {n} pieces against another in-flight request of {n} interleaved: {:.3} ms, \
             {:.1} ns per piece",
            d.as_secs_f64() * 1e3,
            d.as_nanos() as f64 / n as f64
        );
    }
    // Empty table: what a post pays when nothing else is in flight in its spaces.
    let mine = Arc::new(Footprint::build(pieces(N, 0, 7)));
    let mut t: Table<()> = Table::default();
    let d = per_op(|| {
        black_box(t.first_conflict(&mine, |_, _| true));
        t.insert(2, mine.clone(), ());
        t.remove(2);
    });
    println!("check+insert+remove of {N} pieces, table empty: {:.3} µs", d / 1e3);
    // 16 others in flight, every one spread over the same span as this one (their bounds all meet it), none
    // touching its bytes: every range is compared.
    let at = |i: u64, k: u64| (32 * i + 1 + k) * 128;
    let mine = Arc::new(Footprint::build((0..N as u64).map(|i| (space(1), Access::Write, 32 * i * 128, 64))));
    let mut t: Table<()> = Table::default();
    for k in 0..16u64 {
        t.insert(
            10 + k,
            Arc::new(Footprint::build((0..N as u64).map(|i| (space(1), Access::Write, at(i, k), 64)))),
            (),
        );
    }
    let d = per_op(|| {
        assert!(t.first_conflict(&mine, |_, _| true).is_none());
        t.insert(2, mine.clone(), ());
        t.remove(2);
    });
    println!(
        "check+insert+remove of {N} pieces, 16 requests of {N} pieces in flight across the same span: {:.3} µs",
        d / 1e3
    );
    let check = per_op(|| assert!(t.first_conflict(&mine, |_, _| true).is_none()));
    let put = per_op(|| {
        t.insert(2, mine.clone(), ());
        t.remove(2);
    });
    println!("  of which the check {:.3} µs, insert+remove {:.3} µs", check / 1e3, put / 1e3);
}

/// Median ns per call of `f` over batches.
fn per_op(mut f: impl FnMut()) -> f64 {
    let mut v = Vec::new();
    for _ in 0..31 {
        let t0 = Instant::now();
        for _ in 0..200 {
            f();
        }
        v.push(t0.elapsed().as_nanos() as f64 / 200.0);
    }
    median(&mut v)
}
