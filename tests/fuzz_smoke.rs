//! Stable-Rust driver for the fuzz targets in `fuzz/` (which need nightly + cargo-fuzz): every seed in
//! `fuzz/corpus/<target>/` plus random mutations of them (bit flips, byte sets, truncations, splices,
//! insertions of "interesting" varints), through the same `gixl::fuzzing` entry points. A panic is a bug.
//!
//! `GIXL_FUZZ_ITERS` sets the mutations per target (default 100000, a few seconds);
//! `GIXL_FUZZ_SEED` the RNG seed (default: fixed). `GIXL_WRITE_FUZZ_SEEDS=1` (re)writes the seed corpus from
//! real agents and the real encoders (metadata, partial metadata, connection info version 2, notification
//! streams, every TCP message, every metadata-listener frame).

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
    ("tcp_wire", |d| gixl::fuzzing::tcp_wire(d)),
    ("mdx_wire", |d| {
        gixl::fuzzing::mdx_wire(d);
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
        // Seeds must be valid messages of the current formats, or the fuzzer starts from rejects only.
        for s in seeds(name).iter().skip(1) {
            match *name {
                "conn_info" => {
                    assert!(gixl::fuzzing::engine_conn_info(s), "{name}: a seed does not parse (regenerate the seeds)")
                }
                "mdx_wire" => assert!(gixl::fuzzing::mdx_wire(s) >= 1, "{name}: a seed holds no frame"),
                _ => {}
            }
        }
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
    let descs =
        (0..4).map(|i| RegDesc { desc: Desc::new(buf.as_ptr() as u64 + i * 4096, 4096, 0), meta: vec![] }).collect();
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
    let _ = std::fs::remove_dir_all(corpus_dir("conn_info")); // drop version-1 seeds
    for (i, (_, info)) in md.conns.iter().enumerate() {
        w("conn_info", &format!("engine_{i}"), info);
    }
    // Connection info version 2 with TCP addresses: a loopback v4 listener, a v6 one, and a wildcard bind
    // (which advertises every interface address).
    for (n, addr) in [("tcp_v4", "127.0.0.1"), ("tcp_v6", "::1"), ("tcp_any", "0.0.0.0")] {
        let t = Agent::new(&format!("fuzz-{n}"), AgentConfig::default()).unwrap();
        let p: Params =
            [("transport", "tcp"), ("tcp_addr", addr)].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        if t.create_backend("UCX", &p).is_err() {
            continue; // e.g. no IPv6 here
        }
        let tmd = gixl::md::AgentMd::decode(&t.local_md().unwrap()).unwrap();
        for (_, info) in &tmd.conns {
            w("conn_info", n, info);
            if n == "tcp_v4" {
                w("conn_info", "v4_sections", &gixl::fuzzing::engine_conn_info_as_v4(info).unwrap());
            }
        }
        if n == "tcp_v4" {
            w("md_decode", "tcp_v4", &t.local_md().unwrap());
        }
    }
    // Authenticated hellos (a tag over the zero nonce, keyed by the test secret) and notifications.
    let hello = gixl::fuzzing::engine_notif_hello("peer-a");
    let mut s = vec![0x80u8];
    s.extend(&hello);
    s.extend(frame(2, b"req-1:1"));
    s.extend(frame(2, b"HB:req-2,req-3"));
    assert_eq!(gixl::fuzzing::engine_notif_frames(&s), 2, "the seed hello must authenticate");
    w("notif_frames", "hello_two_notifs", &s);
    let mut s2 = vec![0x10u8];
    s2.extend(&hello);
    s2.extend(frame(2, b""));
    w("notif_frames", "hello_empty_notif", &s2);
    let mut s3 = vec![0x40u8];
    s3.extend(frame(2, b"before-hello"));
    w("notif_frames", "notif_before_hello", &s3);
    // The old, unauthenticated hello (incarnation + name): refused.
    let mut old = FRAMES_INC.to_le_bytes().to_vec();
    old.extend_from_slice(b"peer-a");
    let mut s4 = vec![0x20u8];
    s4.extend(frame(1, &old));
    s4.extend(frame(2, b"forged"));
    assert_eq!(gixl::fuzzing::engine_notif_frames(&s4), 0);
    w("notif_frames", "unauthenticated_hello", &s4);
    write_tcp_seeds(&w);
    write_mdx_seeds(&w, &full);
}

fn tagged(sel: u8, body: &[u8]) -> Vec<u8> {
    let mut v = vec![sel];
    v.extend_from_slice(body);
    v
}

fn write_tcp_seeds(w: &dyn Fn(&str, &str, &[u8])) {
    use gixl::backend::engine::wire::*;
    use gixl::backend::XferOp;
    use gixl::fuzzing::{TCP_CHALLENGE, TCP_CTRL, TCP_HELLO, TCP_REPLY, TCP_REQUEST, TCP_SECRET};
    let _ = std::fs::remove_dir_all(corpus_dir("tcp_wire"));
    let t = "tcp_wire";
    let nonce: [u8; 16] = std::array::from_fn(|i| (i * 17 + 3) as u8);
    w(t, "challenge", &tagged(TCP_CHALLENGE, &encode_challenge(&nonce)));
    for (n, kind, name) in [
        ("hello_ctrl", KIND_CTRL, "prefill-0"),
        ("hello_data", KIND_DATA, "décode-1"),
        ("hello_long_name", KIND_DATA, &"n".repeat(MAX_NAME)),
    ] {
        let inc = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210u128;
        // Tag computed as the target would check it (the target's nonce is [selector byte; 16]).
        let tag = hello_tag(TCP_SECRET, kind, inc, &[TCP_HELLO; 16], name);
        let mut b = encode_hello(&Hello { kind, incarnation: inc, tag, name: name.to_string() });
        if n == "hello_ctrl" {
            b.extend_from_slice(&encode_ctrl_head(CTRL_PING, 0)); // the first frame right behind it
        }
        w(t, n, &tagged(TCP_HELLO, &b));
    }
    let mut ctrl = vec![64u8]; // body limit 256
    ctrl.extend_from_slice(&encode_ctrl_head(CTRL_PING, 0));
    ctrl.extend_from_slice(&encode_ctrl_head(CTRL_PONG, 0));
    for m in [&b"req-1:done"[..], b"", &[0u8, 0xff, 7][..]] {
        ctrl.extend_from_slice(&encode_ctrl_head(CTRL_NOTIF, m.len()));
        ctrl.extend_from_slice(m);
    }
    w(t, "ctrl_stream", &tagged(TCP_CTRL, &ctrl));
    let mut big = vec![0xffu8]; // body limit 1 MiB
    big.extend_from_slice(&encode_ctrl_head(CTRL_NOTIF, 1000));
    big.extend(std::iter::repeat_n(b'x', 1000));
    w(t, "ctrl_notif_1000", &tagged(TCP_CTRL, &big));
    let seg = |region: u64, region_len: u64, addr: u64, len: u64| WireSeg { region, region_len, addr, len };
    let reqs: [(&str, XferOp, Vec<WireSeg>); 4] = [
        ("req_read_1", XferOp::Read, vec![seg(0x1000, 0x1000, 0x1000, 0x1000)]),
        ("req_write_2", XferOp::Write, vec![seg(0x1000, 0x1000, 0x1800, 0x10), seg(0x10_0000, 0x100, 0x10_00f0, 0x10)]),
        ("req_read_denied", XferOp::Read, vec![seg(0x20_0000, 0x10, 0x20_0000, 0x10), seg(0x1000, 0x2000, 0x1000, 1)]),
        ("req_write_wrap", XferOp::Write, vec![seg(u64::MAX - 0xff, 0x100, u64::MAX - 0xf, 0x10)]),
    ];
    for (n, op, segs) in reqs {
        let mut b = Vec::new();
        encode_req(op, &segs, &mut b);
        if op == XferOp::Write {
            b.extend(std::iter::repeat_n(0xabu8, segs.iter().map(|s| s.len as usize).sum::<usize>().min(64)));
        }
        w(t, n, &tagged(TCP_REQUEST, &b));
    }
    w(t, "reply_ok", &tagged(TCP_REPLY, &encode_reply(REPLY_OK)));
    w(t, "reply_denied", &tagged(TCP_REPLY, &encode_reply(REPLY_DENIED)));
}

fn write_mdx_seeds(w: &dyn Fn(&str, &str, &[u8]), md: &[u8]) {
    let _ = std::fs::remove_dir_all(corpus_dir("mdx_wire"));
    let frame = |kind: u8, body: &[u8]| gixl::fuzzing::mdx_encode(kind, body).unwrap();
    let t = "mdx_wire";
    w(t, "load_md", &frame(1, md));
    w(t, "send_named", &frame(2, b"prefill-0"));
    w(t, "send_any", &frame(2, b""));
    w(t, "invl", &frame(3, b"decode-3"));
    w(t, "err", &frame(4, "no agent named «x» here".as_bytes()));
    let mut all = frame(2, b"");
    all.extend(frame(1, md));
    all.extend(frame(3, b"decode-3"));
    all.extend(frame(4, b"bye"));
    all.extend(&frame(1, b"")[..6]); // a partial frame at the end
    w(t, "stream", &all);
    // The cluster-key framing: the listener's challenge, then signed requests.
    w(t, "chal", &frame(5, &[7; 16]));
    w(t, "signed_send", &frame(0x82, b"prefill-0"));
    w(t, "signed_invl", &frame(0x83, b"decode-3"));
    let mut keyed = frame(5, &[7; 16]);
    keyed.extend(frame(0x81, md));
    keyed.extend(frame(0x82, b""));
    w(t, "keyed_stream", &keyed);
}

const FRAMES_INC: u128 = gixl::fuzzing::FRAMES_INCARNATION;
