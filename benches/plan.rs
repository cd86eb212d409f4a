//! Criterion micro-benchmarks of the core's fast paths, in one process (no Python, no second process):
//! `make_xfer_req` with 1024 random indices over prepped 16 KiB blocks (what `make_prepped_xfer` costs
//! below the bindings) and `post_xfer_req` of a 4 KiB loopback READ (the generation gate plus an inline copy).
//!
//! `cargo bench --bench plan`

use criterion::{criterion_group, criterion_main, Criterion};
use gixl::*;

const BLOCKS: usize = 16384;
const BLOCK: u64 = 16384;

struct Setup {
    agent: Agent,
    local: PreppedDList,
    remote: PreppedDList,
    _bufs: [Vec<u8>; 2],
}

fn setup() -> Setup {
    let agent = Agent::new("bench", AgentConfig::default()).unwrap();
    agent.create_backend("UCX", &Params::new()).unwrap();
    let bufs = [vec![1u8; BLOCKS * BLOCK as usize], vec![0u8; BLOCKS * BLOCK as usize]];
    for b in &bufs {
        let d = Desc::new(b.as_ptr() as u64, b.len() as u64, 0);
        agent.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }]), &[]).unwrap();
    }
    let blocks = |b: &Vec<u8>| {
        XferDList::with_descs(
            MemType::Dram,
            (0..BLOCKS as u64).map(|i| Desc::new(b.as_ptr() as u64 + i * BLOCK, BLOCK, 0)).collect(),
        )
    };
    let local = agent.prep_xfer_dlist("", &blocks(&bufs[1]), &[]).unwrap();
    let remote = agent.prep_xfer_dlist("bench", &blocks(&bufs[0]), &[]).unwrap();
    Setup { agent, local, remote, _bufs: bufs }
}

fn random_indices(seed: u64, n: usize) -> Vec<i64> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % BLOCKS as u64) as i64
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let s = setup();
    let sets: Vec<(Vec<i64>, Vec<i64>)> =
        (0..64).map(|i| (random_indices(2 * i + 1, 1024), random_indices(2 * i + 2, 1024))).collect();
    let mut k = 0;
    c.bench_function("make_xfer_req, 1024 random indices", |b| {
        b.iter(|| {
            let (li, ri) = &sets[k % sets.len()];
            k += 1;
            s.agent.make_xfer_req(XferOp::Read, &s.local, li, &s.remote, ri, &XferOpts::default()).unwrap()
        })
    });
    let small = {
        // A 4 KiB request: the first quarter of block 0.
        let l = XferDList::with_descs(MemType::Dram, vec![Desc::new(s._bufs[1].as_ptr() as u64, 4096, 0)]);
        let r = XferDList::with_descs(MemType::Dram, vec![Desc::new(s._bufs[0].as_ptr() as u64, 4096, 0)]);
        s.agent.create_xfer_req(XferOp::Read, &l, &r, "bench", &XferOpts::default()).unwrap()
    };
    c.bench_function("post_xfer_req, 4 KiB loopback READ (inline)", |b| {
        b.iter(|| s.agent.post_xfer_req(&small, NotifUpdate::Keep).unwrap())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
