//! Criterion micro-benchmarks of the core's planning and posting fast paths, in one process (no Python, no
//! second process), so regressions show without the side-by-side harness:
//!
//! - `make_xfer_req/strided`: 1024 random indices over 16,384 prepped 16 KiB blocks (the issue #6 case);
//! - `make_xfer_req/<entries>x<indices>/<warm|cold>`: production-shaped per-block lists (vLLM's N x 3: one
//!   64-byte entry per block x layer x K/V, all blocks of one layer region, then the next, as vLLM's
//!   NixlConnector builds them; here 64 regions, laid out in reverse order) of 2^14, 2^17 and 2^20 entries each
//!   side, requests of 1024, 16,384 and 131,072 random int64 indices; "cold" writes 64 MiB (twice this box's
//!   L3) before each timed call;
//! - `make_xfer_req/shuffled <entries>x<indices>`: the same blocks in random order (nothing to compress);
//! - `prep_xfer_dlist/<entries>`: resolving a list against the registrations;
//! - `post_xfer_req`: a 4 KiB loopback READ (the generation gate plus an inline copy).
//!
//! The production-shaped cells are timed with the thread's CPU clock (`CLOCK_THREAD_CPUTIME_ID`), not the
//! wall clock: on a shared, busy machine preemption would otherwise dominate. Cache effects still count.
//!
//! `cargo bench --bench plan` runs everything briefly (about a minute); `-- make_xfer_req/1048576` picks cells.
//! `GIXL_BENCH_FULL=1` uses criterion's default sample counts and times.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use gixl::*;

const BLOCKS: usize = 16384;
const BLOCK: u64 = 16384;
const ENTRY: u64 = 64;
const SIZES: [usize; 3] = [1 << 14, 1 << 17, 1 << 20];
const COUNTS: [usize; 3] = [1024, 16384, 131072];
const COLD_BYTES: usize = 64 << 20;
const REGIONS: u64 = 64;

fn agent() -> Agent {
    let agent = Agent::new("bench", AgentConfig::default()).unwrap();
    agent.create_backend("UCX", &Params::new()).unwrap();
    agent
}

fn register(agent: &Agent, b: &[u8]) {
    let d = Desc::new(b.as_ptr() as u64, b.len() as u64, 0);
    agent.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }]), &[]).unwrap();
}

fn blocks(b: &[u8], n: usize, size: u64) -> XferDList {
    XferDList::with_descs(
        MemType::Dram,
        (0..n as u64).map(|i| Desc::new(b.as_ptr() as u64 + i * size, size, 0)).collect(),
    )
}

/// CPU time of this thread.
fn cpu_now() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// vLLM's per-block list over `b`: region-major, `n / REGIONS` blocks of `ENTRY` bytes per region; the regions
/// lie in reverse order in memory (so the list is not one arithmetic progression).
fn per_block(b: &[u8], n: usize) -> XferDList {
    let per = n as u64 / REGIONS;
    XferDList::with_descs(
        MemType::Dram,
        (0..n as u64)
            .map(|i| Desc::new(b.as_ptr() as u64 + (REGIONS - 1 - i / per) * per * ENTRY + (i % per) * ENTRY, ENTRY, 0))
            .collect(),
    )
}

fn shuffled(l: &XferDList, seed: u64) -> XferDList {
    let mut d = l.descs().to_vec();
    let r = random_indices(seed, d.len(), d.len());
    for i in (1..d.len()).rev() {
        d.swap(i, r[i] as usize % (i + 1));
    }
    XferDList::with_descs(l.mem_type(), d)
}

fn random_indices(seed: u64, n: usize, below: usize) -> Vec<i64> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % below as u64) as i64
        })
        .collect()
}

fn config() -> Criterion {
    let c = Criterion::default();
    if std::env::var_os("GIXL_BENCH_FULL").is_some() {
        return c;
    }
    c.sample_size(10).warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_millis(600))
}

fn strided(c: &mut Criterion) {
    let agent = agent();
    let bufs = [vec![1u8; BLOCKS * BLOCK as usize], vec![0u8; BLOCKS * BLOCK as usize]];
    bufs.iter().for_each(|b| register(&agent, b));
    let local = agent.prep_xfer_dlist("", &blocks(&bufs[1], BLOCKS, BLOCK), &[]).unwrap();
    let remote = agent.prep_xfer_dlist("bench", &blocks(&bufs[0], BLOCKS, BLOCK), &[]).unwrap();
    let sets: Vec<(Vec<i64>, Vec<i64>)> =
        (0..64).map(|i| (random_indices(2 * i + 1, 1024, BLOCKS), random_indices(2 * i + 2, 1024, BLOCKS))).collect();
    let mut k = 0;
    c.bench_function("make_xfer_req/strided 16384 x 16 KiB, 1024 random indices", |b| {
        b.iter(|| {
            let (li, ri) = &sets[k % sets.len()];
            k += 1;
            agent.make_xfer_req(XferOp::Read, &local, li, &remote, ri, &XferOpts::default()).unwrap()
        })
    });
    let small = {
        let l = XferDList::with_descs(MemType::Dram, vec![Desc::new(bufs[1].as_ptr() as u64, 4096, 0)]);
        let r = XferDList::with_descs(MemType::Dram, vec![Desc::new(bufs[0].as_ptr() as u64, 4096, 0)]);
        agent.create_xfer_req(XferOp::Read, &l, &r, "bench", &XferOpts::default()).unwrap()
    };
    c.bench_function("post_xfer_req/4 KiB loopback READ (inline)", |b| {
        b.iter(|| agent.post_xfer_req(&small, NotifUpdate::Keep).unwrap())
    });
}

fn production(c: &mut Criterion) {
    let agent = agent();
    let max = *SIZES.iter().max().unwrap();
    let bufs = [vec![1u8; max * ENTRY as usize], vec![0u8; max * ENTRY as usize]];
    bufs.iter().for_each(|b| register(&agent, b));
    let mut scratch = vec![0u8; COLD_BYTES];
    let cases: Vec<(String, usize, XferDList, XferDList, &[usize])> = SIZES
        .iter()
        .map(|&n| (n.to_string(), n, per_block(&bufs[1], n), per_block(&bufs[0], n), &COUNTS[..]))
        .chain(std::iter::once((
            format!("shuffled {max}"),
            max,
            shuffled(&per_block(&bufs[1], max), 7),
            shuffled(&per_block(&bufs[0], max), 8),
            &COUNTS[..2],
        )))
        .collect();
    for (name, n, ld, rd, counts) in cases {
        c.bench_function(&format!("prep_xfer_dlist/{name}"), |b| {
            b.iter(|| agent.prep_xfer_dlist("", &ld, &[]).unwrap())
        });
        let local = agent.prep_xfer_dlist("", &ld, &[]).unwrap();
        let remote = agent.prep_xfer_dlist("bench", &rd, &[]).unwrap();
        for &k in counts {
            let sets: Vec<(Vec<i64>, Vec<i64>)> =
                (0..4).map(|i| (random_indices(2 * i + 1, k, n), random_indices(2 * i + 2, k, n))).collect();
            for cold in [false, true] {
                let label = format!("make_xfer_req/{name}x{k}/{}", if cold { "cold" } else { "warm" });
                c.bench_function(&label, |b| {
                    // iter_custom: the 64 MiB write before each cold call and every drop are not timed.
                    b.iter_custom(|iters| {
                        let mut total = Duration::ZERO;
                        for i in 0..iters {
                            if cold {
                                scratch.fill(i as u8);
                                black_box(&scratch);
                            }
                            let (li, ri) = &sets[i as usize % sets.len()];
                            let t0 = cpu_now();
                            let x = agent.make_xfer_req(XferOp::Write, &local, li, &remote, ri, &XferOpts::default());
                            total += cpu_now() - t0;
                            drop(x.unwrap());
                        }
                        total
                    })
                });
            }
        }
    }
}

criterion_group! {
    name = benches;
    config = config();
    targets = strided, production
}
criterion_main!(benches);
