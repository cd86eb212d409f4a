//! The POSIX backend through the public Rust API, as NIXL users drive it: local DRAM list prepped with "",
//! FILE list (devId = fd, addr = file offset) prepped against the agent's own name.
//!
//! Every scenario runs on both I/O queues: io_uring (`use_uring=true`, skipped with a message where the
//! kernel refuses io_uring) and the thread pool (`use_posix_aio=true`).
//!
//! Throughput: `cargo test --release --test posix -- --ignored --nocapture`.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use gixl::*;

mod common;

/// Agents with a POSIX backend on each queue this machine has, labelled.
fn agents(tag: &str) -> Vec<(&'static str, Agent)> {
    let mut v = Vec::new();
    for (label, k, val) in [("io_uring", "use_uring", "true"), ("threads", "use_posix_aio", "true")] {
        let a = Agent::new(&format!("{tag}-{label}"), AgentConfig::default()).unwrap();
        let p: Params = [(k.to_string(), val.to_string())].into_iter().collect();
        match a.create_backend("POSIX", &p) {
            Ok(_) => v.push((label, a)),
            Err(e) => {
                assert_eq!(label, "io_uring", "{e}");
                common::skip("io_uring", &format!("io_uring unavailable here, testing the thread pool only: {e}"));
            }
        }
    }
    v
}

/// A fresh file under the target directory (a real disk file system; tmpfs may refuse O_DIRECT).
fn path(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "posix-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

fn create(p: &Path) -> File {
    File::options().read(true).write(true).create(true).truncate(true).open(p).unwrap()
}

fn reg_dram(a: &Agent, buf: &[u8]) {
    let l = RegDList::with_descs(
        MemType::Dram,
        vec![RegDesc { desc: Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0), meta: vec![] }],
    );
    a.register_mem(&l, &[]).unwrap();
}

/// The whole file, unbounded (len 0), with its path in metaInfo.
fn reg_file(a: &Agent, f: &File, p: &Path) -> Result<()> {
    let meta = p.to_str().unwrap().as_bytes().to_vec();
    a.register_mem(
        &RegDList::with_descs(MemType::File, vec![RegDesc { desc: Desc::new(0, 0, f.as_raw_fd() as u64), meta }]),
        &[],
    )
}

/// (memory address, file offset, length) triples on `fd` as the two lists of one request.
fn lists(fd: i32, pieces: &[(u64, u64, u64)]) -> (XferDList, XferDList) {
    let mem = pieces.iter().map(|&(a, _, l)| Desc::new(a, l, 0)).collect();
    let file = pieces.iter().map(|&(_, o, l)| Desc::new(o, l, fd as u64)).collect();
    (XferDList::with_descs(MemType::Dram, mem), XferDList::with_descs(MemType::File, file))
}

fn req(a: &Agent, op: XferOp, fd: i32, pieces: &[(u64, u64, u64)]) -> Result<XferReq> {
    let (m, f) = lists(fd, pieces);
    a.create_xfer_req(op, &m, &f, a.name(), &XferOpts::default())
}

fn wait(a: &Agent, r: &XferReq) -> Result<Status> {
    let t0 = Instant::now();
    loop {
        match a.xfer_status(r)? {
            Status::InProg => {
                assert!(t0.elapsed() < Duration::from_secs(60), "transfer never finished");
                std::thread::sleep(Duration::from_micros(20));
            }
            s => return Ok(s),
        }
    }
}

fn post_wait(a: &Agent, r: &XferReq) -> Result<Status> {
    assert_eq!(a.post_xfer_req(r, NotifUpdate::Keep)?, Status::InProg);
    wait(a, r)
}

fn pattern(n: usize, seed: u64) -> Vec<u8> {
    (0..n as u64).map(|i| ((i * 31 + seed) % 251) as u8).collect()
}

#[test]
fn plugin_and_backend_parameters_match_nixl() {
    let a = Agent::new("params", AgentConfig::default()).unwrap();
    let (defaults, mems) = a.plugin_params("POSIX").unwrap();
    let want = [
        ("ios_pool_size", "65536"),
        ("kernel_queue_size", "256"),
        ("use_aio", "false"),
        ("use_posix_aio", "false"),
        ("use_uring", "false"),
    ];
    assert_eq!(defaults, want.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Params>());
    assert_eq!(mems, vec![MemType::Dram, MemType::File]);
    // NIXL's defaults are valid init parameters, and get_backend_params echoes what was given.
    let b = a.create_backend("POSIX", &defaults).unwrap();
    let (params, mems) = a.backend_params(b).unwrap();
    assert_eq!(params, defaults);
    assert_eq!(mems, vec![MemType::File, MemType::Dram]);
    let bad: Params = [("use_uring".to_string(), "true".to_string()), ("use_aio".to_string(), "true".to_string())]
        .into_iter()
        .collect();
    let a2 = Agent::new("params2", AgentConfig::default()).unwrap();
    assert_eq!(a2.create_backend("POSIX", &bad).unwrap_err().status(), Status::Backend);
}

#[test]
fn round_trip_dram_file_dram() {
    for (label, a) in agents("rt") {
        let p = path("rt");
        let f = create(&p);
        let fd = f.as_raw_fd();
        let src = pattern(3 << 20, 1);
        let mut dst = vec![0u8; src.len()];
        reg_dram(&a, &src);
        reg_dram(&a, &dst);
        reg_file(&a, &f, &p).unwrap();

        // Two pieces of the buffer to two places in the file, the second past a hole.
        let s = src.as_ptr() as u64;
        let w = req(&a, XferOp::Write, fd, &[(s, 0, 1 << 20), (s + (1 << 20), 5 << 20, 2 << 20)]).unwrap();
        assert_eq!(post_wait(&a, &w).unwrap(), Status::Success, "{label}");
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 7 << 20);

        let d = dst.as_mut_ptr() as u64;
        let r = req(&a, XferOp::Read, fd, &[(d, 0, 1 << 20), (d + (1 << 20), 5 << 20, 2 << 20)]).unwrap();
        assert_eq!(post_wait(&a, &r).unwrap(), Status::Success, "{label}");
        assert!(dst == src, "{label}: data differs after the round trip");
        // Reposting reads again.
        dst.iter_mut().for_each(|b| *b = 0);
        assert_eq!(post_wait(&a, &r).unwrap(), Status::Success);
        assert!(dst == src);

        // query_memory by path.
        let q = RegDList::with_descs(
            MemType::File,
            vec![RegDesc { desc: Desc::new(0, 0, 0), meta: p.to_str().unwrap().into() }, RegDesc::default()],
        );
        let info = a.query_mem(&q, BackendId(0)).unwrap();
        assert_eq!(info[0].as_ref().unwrap()["size"], (7u64 << 20).to_string());
        assert_eq!(info[1], None);

        a.release_xfer_req(&w).unwrap();
        a.release_xfer_req(&r).unwrap();
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn one_request_of_1024_descriptors() {
    for (label, a) in agents("many") {
        let p = path("many");
        let f = create(&p);
        let fd = f.as_raw_fd();
        const N: u64 = 1024;
        const LEN: u64 = 16 << 10;
        let src = pattern((N * LEN) as usize, 2);
        let mut dst = vec![0u8; src.len()];
        reg_dram(&a, &src);
        reg_dram(&a, &dst);
        reg_file(&a, &f, &p).unwrap();
        // Descriptor i goes to file slot (N - 1 - i): nothing merges, every descriptor is its own I/O.
        let at = |base: u64| (0..N).map(|i| (base + i * LEN, (N - 1 - i) * LEN, LEN)).collect::<Vec<_>>();
        let w = req(&a, XferOp::Write, fd, &at(src.as_ptr() as u64)).unwrap();
        assert_eq!(w.desc_count(), N);
        assert_eq!(post_wait(&a, &w).unwrap(), Status::Success, "{label}");
        let disk = std::fs::read(&p).unwrap();
        assert_eq!(&disk[..LEN as usize], &src[((N - 1) * LEN) as usize..], "{label}");
        let r = req(&a, XferOp::Read, fd, &at(dst.as_mut_ptr() as u64)).unwrap();
        assert_eq!(post_wait(&a, &r).unwrap(), Status::Success, "{label}");
        assert!(dst == src, "{label}");
        std::fs::remove_file(p).unwrap();
    }
}

/// A page-aligned window of `len` bytes inside a fresh allocation.
fn aligned(len: usize) -> (Vec<u8>, usize) {
    let v = vec![0u8; len + 4096];
    let off = (4096 - (v.as_ptr() as usize % 4096)) % 4096;
    (v, off)
}

#[test]
fn o_direct_needs_alignment_and_says_so() {
    for (label, a) in agents("direct") {
        let p = path("direct");
        let f = match File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&p)
        {
            Ok(f) => f,
            Err(e) => {
                common::skip("o_direct", &format!("{}: O_DIRECT refused by this file system ({e})", p.display()));
                return;
            }
        };
        let fd = f.as_raw_fd();
        let (mut buf, o) = aligned(1 << 20);
        buf[o..o + 8192].copy_from_slice(&pattern(8192, 3));
        reg_dram(&a, &buf);
        reg_file(&a, &f, &p).unwrap();
        let base = buf.as_ptr() as u64 + o as u64;

        let w = req(&a, XferOp::Write, fd, &[(base, 4096, 8192)]).unwrap();
        match post_wait(&a, &w) {
            Ok(s) => assert_eq!(s, Status::Success, "{label}"),
            Err(e) if e.message().contains("Invalid argument") => {
                common::skip(
                    "o_direct",
                    &format!("{label}: this file system takes O_DIRECT opens but not O_DIRECT I/O ({e})"),
                );
                return;
            }
            Err(e) => panic!("{label}: {e}"),
        }
        let r = req(&a, XferOp::Read, fd, &[(base + 65536, 4096, 8192)]).unwrap();
        assert_eq!(post_wait(&a, &r).unwrap(), Status::Success);
        assert_eq!(buf[o + 65536..o + 65536 + 8192], pattern(8192, 3)[..]);

        // Misaligned buffer, offset or length: refused when the request is made, before any I/O.
        for (what, piece) in
            [("buffer", (base + 8, 4096, 4096)), ("offset", (base, 4096 + 100, 4096)), ("length", (base, 4096, 4000))]
        {
            let e = req(&a, XferOp::Write, fd, &[piece]).unwrap_err();
            assert_eq!(e.status(), Status::InvalidParam, "{label}: {what}");
            assert!(e.message().contains("O_DIRECT"), "{label}: {what}: {e}");
        }
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn file_truncated_under_a_prepared_read_fails_the_read() {
    for (label, a) in agents("trunc") {
        let p = path("trunc");
        let f = create(&p);
        std::fs::write(&p, pattern(1 << 20, 4)).unwrap();
        let mut dst = vec![0u8; 1 << 20];
        reg_dram(&a, &dst);
        reg_file(&a, &f, &p).unwrap();
        let r = req(&a, XferOp::Read, f.as_raw_fd(), &[(dst.as_mut_ptr() as u64, 0, 1 << 20)]).unwrap();
        assert_eq!(post_wait(&a, &r).unwrap(), Status::Success);
        f.set_len(300_000).unwrap();
        let e = post_wait(&a, &r).unwrap_err();
        assert_eq!(e.status(), Status::Backend, "{label}");
        assert!(e.message().contains("short read") && e.message().contains("300000"), "{label}: {e}");
        // The status stays failed until the next post.
        assert_eq!(a.xfer_status(&r).unwrap_err().status(), Status::Backend);
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn closed_and_full_files_are_errors() {
    for (label, a) in agents("bad") {
        let src = pattern(8192, 5);
        reg_dram(&a, &src);
        let s = src.as_ptr() as u64;

        // Registering an fd that is not open.
        let p = path("closed");
        let closed = create(&p).as_raw_fd(); // the File is dropped at once
        let e = a
            .register_mem(
                &RegDList::with_descs(
                    MemType::File,
                    vec![RegDesc { desc: Desc::new(0, 0, closed as u64), meta: vec![] }],
                ),
                &[],
            )
            .unwrap_err();
        assert_eq!(e.status(), Status::Backend, "{label}");
        assert!(e.message().contains("not an open file descriptor"), "{label}: {e}");

        // Closing a registered fd before posting.
        let f = create(&p);
        let fd = f.as_raw_fd();
        reg_file(&a, &f, &p).unwrap();
        let w = req(&a, XferOp::Write, fd, &[(s, 0, 8192)]).unwrap();
        drop(f);
        let e = a.post_xfer_req(&w, NotifUpdate::Keep).unwrap_err();
        assert_eq!(e.status(), Status::Backend, "{label}");
        assert!(e.message().contains("closed"), "{label}: {e}");

        // ENOSPC.
        let full = File::options().write(true).open("/dev/full").unwrap();
        a.register_mem(
            &RegDList::with_descs(
                MemType::File,
                vec![RegDesc { desc: Desc::new(0, 0, full.as_raw_fd() as u64), meta: vec![] }],
            ),
            &[],
        )
        .unwrap();
        let w = req(&a, XferOp::Write, full.as_raw_fd(), &[(s, 0, 8192)]).unwrap();
        let e = post_wait(&a, &w).unwrap_err();
        assert_eq!(e.status(), Status::Backend, "{label}");
        assert!(e.message().contains("No space left on device"), "{label}: {e}");
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn lists_must_be_local_dram_and_remote_file() {
    for (label, a) in agents("sides") {
        let p = path("sides");
        let f = create(&p);
        let fd = f.as_raw_fd();
        let buf = vec![0u8; 8192];
        reg_dram(&a, &buf);
        reg_file(&a, &f, &p).unwrap();
        let b = buf.as_ptr() as u64;
        let (m, fl) = lists(fd, &[(b, 0, 4096)]);
        let o = XferOpts::default();
        let e = a.create_xfer_req(XferOp::Write, &fl, &m, a.name(), &o).unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam, "{label}: FILE as the local list");
        let m2 = XferDList::with_descs(MemType::Dram, vec![Desc::new(b + 4096, 4096, 0)]);
        let e = a.create_xfer_req(XferOp::Write, &m, &m2, a.name(), &o).unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam, "{label}: DRAM to DRAM");
        let n = XferOpts { notif: Some(b"x".to_vec()), ..Default::default() };
        assert_eq!(a.create_xfer_req(XferOp::Write, &m, &fl, a.name(), &n).unwrap_err().status(), Status::Backend);
        let w = a.create_xfer_req(XferOp::Write, &m, &fl, a.name(), &o).unwrap();
        assert_eq!(a.estimate_xfer_cost(&w).unwrap_err().status(), Status::NotSupported);
        assert_eq!(a.xfer_status(&w).unwrap_err().status(), Status::NotPosted);
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn release_while_in_flight_leaves_no_io_behind() {
    for (label, a) in agents("rel") {
        let p = path("rel");
        let f = create(&p);
        let src = pattern(32 << 20, 6);
        reg_dram(&a, &src);
        reg_file(&a, &f, &p).unwrap();
        for _ in 0..5 {
            let w = req(&a, XferOp::Write, f.as_raw_fd(), &[(src.as_ptr() as u64, 0, src.len() as u64)]).unwrap();
            assert_eq!(a.post_xfer_req(&w, NotifUpdate::Keep).unwrap(), Status::InProg);
            // Released at once: whatever was in flight has finished when release returns.
            a.release_xfer_req(&w).unwrap();
            assert!(w.is_released(), "{label}");
        }
        std::fs::remove_file(p).unwrap();
    }
}

/// 64 MiB in one descriptor and 1024 × 16 KiB, each way, page cache warm.
#[test]
#[ignore = "throughput; run with --release --ignored --nocapture"]
fn throughput() {
    for (label, a) in agents("bw") {
        let p = path("bw");
        let f = create(&p);
        let fd = f.as_raw_fd();
        let src = pattern(64 << 20, 7);
        let mut dst = vec![0u8; 64 << 20];
        reg_dram(&a, &src);
        reg_dram(&a, &dst);
        reg_file(&a, &f, &p).unwrap();
        let big = |base: u64| vec![(base, 0, 64u64 << 20)];
        let small = |base: u64| {
            (0..1024u64).map(|i| (base + i * (16 << 10), (1023 - i) * (16 << 10), 16u64 << 10)).collect::<Vec<_>>()
        };
        for (shape, pieces_w, pieces_r, bytes) in [
            ("64 MiB x1", big(src.as_ptr() as u64), big(dst.as_mut_ptr() as u64), 64u64 << 20),
            ("16 KiB x1024", small(src.as_ptr() as u64), small(dst.as_mut_ptr() as u64), 16u64 << 20),
        ] {
            for (dir, op, pieces) in [("WRITE", XferOp::Write, &pieces_w), ("READ", XferOp::Read, &pieces_r)] {
                let r = req(&a, op, fd, pieces).unwrap();
                post_wait(&a, &r).unwrap(); // warm-up: allocates the file's pages
                let iters = 20;
                let t0 = Instant::now();
                for _ in 0..iters {
                    post_wait(&a, &r).unwrap();
                }
                let dt = t0.elapsed().as_secs_f64() / iters as f64;
                println!(
                    "{label:8} {shape:13} {dir:5}: {:7.2} GB/s ({:.0} µs per request)",
                    bytes as f64 / dt / 1e9,
                    dt * 1e6
                );
                a.release_xfer_req(&r).unwrap();
            }
        }
        std::fs::remove_file(p).unwrap();
    }
}
