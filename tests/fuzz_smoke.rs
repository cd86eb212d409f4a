//! Stable-Rust driver for the fuzz targets in `fuzz/` (which need nightly + cargo-fuzz): every seed in
//! `fuzz/corpus/<target>/` plus random mutations of them (bit flips, byte sets, truncations, splices,
//! insertions of "interesting" varints), through the same `gixl::fuzzing` entry points. A panic is a bug.
//!
//! `GIXL_FUZZ_ITERS` sets the mutations per target (default 100000, a few seconds);
//! `GIXL_FUZZ_SEED` the RNG seed (default: fixed). `GIXL_WRITE_FUZZ_SEEDS=1` (re)writes the seed corpus from
//! real agents (metadata, partial metadata, connection info, notification streams).

use std::path::{Path, PathBuf};

use gixl::*;

type Target = (&'static str, fn(&[u8]));

const TARGETS: &[Target] = &[
    ("md_decode", |d| gixl::fuzzing::md_decode(d)),
    ("conn_info", |d| {
        gixl::fuzzing::engine_conn_info(d);
    }),
    ("notif_frames", |d| {
        gixl::fuzzing::engine_notif_frames(d);
    }),
];

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz").join("corpus").join(target)
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let mut out = vec![Vec::new()];
    if let Ok(rd) = std::fs::read_dir(corpus_dir(target)) {
        let mut paths: Vec<_> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for p in paths {
            out.push(std::fs::read(p).unwrap());
        }
    }
    out
}

/// xorshift64*: reproducible without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const INTERESTING: &[&[u8]] = &[
    &[0x00],
    &[0x7f],
    &[0x80, 0x01],
    &[0xff, 0xff, 0xff, 0xff, 0x0f],
    &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
    &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
    &[0xff, 0xff, 0xff, 0x7f],
    &[0x00, 0x00, 0x00, 0x04],
];

fn mutate(rng: &mut Rng, pool: &[Vec<u8>]) -> Vec<u8> {
    let mut d = pool[rng.below(pool.len())].clone();
    for _ in 0..1 + rng.below(4) {
        match rng.below(7) {
            0 if !d.is_empty() => {
                let i = rng.below(d.len());
                d[i] ^= 1 << rng.below(8);
            }
            1 if !d.is_empty() => {
                let i = rng.below(d.len());
                d[i] = rng.next() as u8;
            }
            2 => {
                let n = rng.below(d.len() + 1);
                d.truncate(n);
            }
            3 => {
                let other = &pool[rng.below(pool.len())];
                let at = rng.below(d.len() + 1);
                let from = rng.below(other.len() + 1);
                d.truncate(at);
                d.extend_from_slice(&other[from..]);
            }
            4 => {
                let at = rng.below(d.len() + 1);
                let ins = INTERESTING[rng.below(INTERESTING.len())];
                d.splice(at..at, ins.iter().copied());
            }
            5 if !d.is_empty() => {
                let at = rng.below(d.len());
                let n = rng.below(d.len() - at + 1);
                d.drain(at..at + n);
            }
            _ => {
                let n = rng.below(16);
                for _ in 0..n {
                    d.push(rng.next() as u8);
                }
            }
        }
    }
    d
}

fn run_target(name: &str, f: fn(&[u8]), iters: usize, seed: u64) -> usize {
    let pool = seeds(name);
    let mut execs = 0;
    for s in &pool {
        f(s);
        execs += 1;
    }
    let mut rng = Rng(seed ^ (name.len() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    for i in 0..iters {
        let d = mutate(&mut rng, &pool);
        let r = std::panic::catch_unwind(|| f(&d));
        if r.is_err() {
            let dir = std::env::temp_dir().join(format!("gixl-fuzz-crash-{name}-{i}"));
            std::fs::write(&dir, &d).ok();
            panic!("{name}: input #{i} ({} bytes) panicked; saved to {}", d.len(), dir.display());
        }
        execs += 1;
    }
    execs
}

#[test]
fn fuzz_targets_over_seeds_and_mutations() {
    if std::env::var("GIXL_WRITE_FUZZ_SEEDS").as_deref() == Ok("1") {
        write_seeds();
    }
    let iters: usize = std::env::var("GIXL_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let seed: u64 = std::env::var("GIXL_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0x5eed);
    for (name, f) in TARGETS {
        let t0 = std::time::Instant::now();
        let n = run_target(name, *f, iters, seed);
        assert!(seeds(name).len() > 1, "{name}: no seed corpus in {}", corpus_dir(name).display());
        eprintln!("fuzz smoke {name}: {n} executions, 0 crashes, {:.2} s", t0.elapsed().as_secs_f64());
    }
}

// -- seed corpus ------------------------------------------------------------------------------------------

fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut f = ((body.len() + 1) as u32).to_le_bytes().to_vec();
    f.push(kind);
    f.extend_from_slice(body);
    f
}

fn write_seeds() {
    let buf = vec![0u8; 1 << 16];
    let a = Agent::new("fuzz-seed-agent", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let descs = (0..4)
        .map(|i| RegDesc { desc: Desc::new(buf.as_ptr() as u64 + i * 4096, 4096, 0), meta: vec![] })
        .collect();
    let l = RegDList::with_descs(MemType::Dram, descs);
    a.register_mem(&l, &[]).unwrap();
    let full = a.local_md().unwrap();
    let e = Agent::new("e", AgentConfig::default()).unwrap();
    e.create_backend("UCX", &Params::new()).unwrap();
    let empty = e.local_md().unwrap(); // a backend, no registrations
    let md = gixl::md::AgentMd::decode(&full).unwrap();
    let w = |t: &str, n: &str, d: &[u8]| {
        std::fs::create_dir_all(corpus_dir(t)).unwrap();
        std::fs::write(corpus_dir(t).join(n), d).unwrap();
    };
    w("md_decode", "full", &full);
    w("md_decode", "no_backend", &empty);
    let mut partial = md.clone();
    partial.partial = true;
    partial.conns.clear();
    w("md_decode", "partial_no_conn", &partial.encode());
    for (i, (_, info)) in md.conns.iter().enumerate() {
        w("conn_info", &format!("engine_{i}"), info);
    }
    let mut hello = FRAMES_INC.to_le_bytes().to_vec();
    hello.extend_from_slice(b"peer-a");
    let mut s = vec![0x80u8];
    s.extend(frame(1, &hello));
    s.extend(frame(2, b"req-1:1"));
    s.extend(frame(2, b"HB:req-2,req-3"));
    w("notif_frames", "hello_two_notifs", &s);
    let mut s2 = vec![0x10u8];
    s2.extend(frame(1, &hello));
    s2.extend(frame(2, b""));
    w("notif_frames", "hello_empty_notif", &s2);
    let mut s3 = vec![0x40u8];
    s3.extend(frame(2, b"before-hello"));
    w("notif_frames", "notif_before_hello", &s3);
}

const FRAMES_INC: u128 = gixl::fuzzing::FRAMES_INCARNATION;
