//! Times the planning and post fast paths in-process (no Python): make_xfer_req with 1024 random indices,
//! and post of a 4 KiB loopback request. `cargo run --release --example plan_bench`
use gixl::*;
use std::time::Instant;

fn main() {
    let a = Agent::new("bench", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let n = 16384usize;
    let bs = 16384u64;
    let buf = vec![0u8; n * bs as usize];
    let dst = vec![0u8; n * bs as usize];
    for b in [&buf, &dst] {
        let d = Desc::new(b.as_ptr() as u64, b.len() as u64, 0);
        a.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }]), &[]).unwrap();
    }
    let mk = |b: &Vec<u8>| XferDList::with_descs(MemType::Dram, (0..n as u64).map(|i| Desc::new(b.as_ptr() as u64 + i * bs, bs, 0)).collect());
    let l = a.prep_xfer_dlist("", &mk(&dst), &[]).unwrap();
    let r = a.prep_xfer_dlist("bench", &mk(&buf), &[]).unwrap();
    let mut x = 0x9e3779b97f4a7c15u64;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as i64
    };
    let mut times = Vec::new();
    for _ in 0..2000 {
        let li: Vec<i64> = (0..1024).map(|_| rnd()).collect();
        let ri: Vec<i64> = (0..1024).map(|_| rnd()).collect();
        let t = Instant::now();
        let req = a.make_xfer_req(XferOp::Read, &l, &li, &r, &ri, &XferOpts::default()).unwrap();
        times.push(t.elapsed().as_nanos() as f64 / 1000.0);
        drop(req);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!("make_xfer_req 1024 random indices: median {:.2} us, p99 {:.2} us", times[times.len() / 2], times[times.len() * 99 / 100]);

    let one = |b: &Vec<u8>| XferDList::with_descs(MemType::Dram, vec![Desc::new(b.as_ptr() as u64, 4096, 0)]);
    let req = a.create_xfer_req(XferOp::Read, &one(&dst), &one(&buf), "bench", &XferOpts::default()).unwrap();
    let mut times = Vec::new();
    for _ in 0..100000 {
        let t = Instant::now();
        let s = a.post_xfer_req(&req, NotifUpdate::Keep).unwrap();
        assert_eq!(s, Status::Success);
        times.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!("post 4 KiB loopback: median {:.2} us, p99 {:.2} us", times[times.len() / 2], times[times.len() * 99 / 100]);
}
