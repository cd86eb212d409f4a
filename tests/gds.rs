//! The GDS and GDS_MT backends through the public Rust API, over the fake device layer: VRAM ↔ FILE staged
//! through page-locked slots (the path every machine without cuFile takes), DRAM ↔ FILE as POSIX, and the
//! failure and lifetime cases. Files live on tmpfs (/dev/shm) and on ext4 (a loop device each test makes,
//! mounts and removes again; it needs root: CI runs as root, and a skip there is a failure, kind `loopdev`).
//!
//! Benchmark (staged VRAM ↔ FILE against POSIX DRAM ↔ FILE on the same files, ratios printed):
//! `cargo test --release --test gds -- --ignored --nocapture bench`.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use gixl::device::fake;
use gixl::*;

mod common;
use common::dev::slice;
use common::loopdev::Ext4;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// An agent on the fake device with backend `plugin` made with `params`.
fn agent(name: &str, plugin: &str, params: &[(&str, &str)]) -> Agent {
    assert!(gixl::device::select_fake(), "this test process must use the fake device");
    let a = Agent::new(name, AgentConfig::default()).unwrap();
    let p: Params = params.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    a.create_backend(plugin, &p).unwrap();
    a
}

/// Fake VRAM of `len` bytes on device `dev`, filled by `fill`.
fn vram(dev: u32, len: u64, fill: impl Fn(u64) -> u8) -> u64 {
    let p = fake::alloc(dev, len as usize, false, None).unwrap();
    for (i, b) in slice(p, len as usize).iter_mut().enumerate() {
        *b = fill(i as u64);
    }
    p
}

fn reg(a: &Agent, mem: MemType, addr: u64, len: u64, dev: u64, meta: &[u8]) -> Result<()> {
    a.register_mem(
        &RegDList::with_descs(mem, vec![RegDesc { desc: Desc::new(addr, len, dev), meta: meta.to_vec() }]),
        &[],
    )
}

fn dereg(a: &Agent, mem: MemType, addr: u64, len: u64, dev: u64) -> Result<()> {
    a.deregister_mem(&RegDList::with_descs(mem, vec![RegDesc { desc: Desc::new(addr, len, dev), meta: vec![] }]), &[])
}

/// (memory address, file offset, length) triples as the two lists of one request, memory on device `dev`.
fn req(a: &Agent, op: XferOp, mem: MemType, dev: u64, fd: i32, pieces: &[(u64, u64, u64)]) -> Result<XferReq> {
    let m = XferDList::with_descs(mem, pieces.iter().map(|&(x, _, l)| Desc::new(x, l, dev)).collect());
    let f = XferDList::with_descs(MemType::File, pieces.iter().map(|&(_, o, l)| Desc::new(o, l, fd as u64)).collect());
    a.create_xfer_req(op, &m, &f, a.name(), &XferOpts::default())
}

fn wait(a: &Agent, r: &XferReq) -> Result<Status> {
    let t0 = Instant::now();
    loop {
        match a.xfer_status(r)? {
            Status::InProg => {
                assert!(t0.elapsed() < Duration::from_secs(120), "transfer never finished");
                std::thread::sleep(Duration::from_micros(50));
            }
            s => return Ok(s),
        }
    }
}

fn post_wait(a: &Agent, r: &XferReq) -> Result<Status> {
    match a.post_xfer_req(r, NotifUpdate::Keep)? {
        Status::InProg => wait(a, r),
        s => Ok(s),
    }
}

fn fresh(dir: &Path, tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    dir.join(format!("gds-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)))
}

/// Open `p` read-write (created, emptied), with `O_DIRECT` when `direct`; None where the file system refuses
/// `O_DIRECT` (said on stderr).
fn open(p: &Path, direct: bool) -> Option<File> {
    let mut o = File::options();
    o.read(true).write(true).create(true).truncate(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    match o.open(p) {
        Ok(f) => Some(f),
        Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
            eprintln!("{}: O_DIRECT refused here ({e}); that case is not run on this file system", p.display());
            None
        }
        Err(e) => panic!("{}: {e}", p.display()),
    }
}

/// (VRAM offset, file offset, length) of one descriptor pair.
type Piece = (u64, u64, u64);

/// The two request shapes of the issue: one 64 MiB descriptor, and 1024 blocks of 16 KiB scattered over a
/// 32 MiB VRAM buffer and a 64 MiB file (neither in order).
fn shapes() -> Vec<(&'static str, u64, Vec<Piece>)> {
    let n = 1024u64;
    let blk = 16 * KIB;
    // Block i at VRAM slot (i * 7) % 2048 and file slot (i * 13 + 5) % 4096, both permutations' images.
    let scattered = (0..n).map(|i| (((i * 7) % 2048) * blk, ((i * 13 + 5) % 4096) * blk, blk)).collect();
    vec![("64 MiB", 64 * MIB, vec![(0, 0, 64 * MIB)]), ("1024 x 16 KiB", 32 * MIB, scattered)]
}

/// VRAM → FILE → VRAM through backend `plugin` in `dir`, byte-exact, for both shapes.
fn round_trip(plugin: &str, dir: &Path, direct: bool, label: &str) {
    let a = agent(&format!("rt-{plugin}-{label}"), plugin, &[]);
    for (shape, vlen, pieces) in shapes() {
        let p = fresh(dir, "rt");
        let Some(f) = open(&p, direct) else { return };
        let fd = f.as_raw_fd();
        let src = vram(2, vlen, |i| (i.wrapping_mul(2654435761) >> 7) as u8);
        let dst = vram(3, vlen, |_| 0);
        reg(&a, MemType::Vram, src, vlen, 2, b"").unwrap();
        reg(&a, MemType::Vram, dst, vlen, 3, b"").unwrap();
        reg(&a, MemType::File, 0, 0, fd as u64, p.to_str().unwrap().as_bytes()).unwrap();
        let at = |base: u64| pieces.iter().map(|&(v, o, l)| (base + v, o, l)).collect::<Vec<_>>();
        let copied = fake::copied_bytes();
        let w = req(&a, XferOp::Write, MemType::Vram, 2, fd, &at(src)).unwrap();
        assert_eq!(post_wait(&a, &w).unwrap(), Status::Success, "{plugin} {label} {shape} WRITE");
        assert!(fake::copied_bytes() - copied >= pieces.iter().map(|p| p.2).sum::<u64>(), "staged through the device");
        let disk = std::fs::read(&p).unwrap();
        for &(v, o, l) in &pieces {
            assert!(disk[o as usize..][..l as usize] == slice(src + v, l as usize)[..], "{label} {shape}: file bytes");
        }
        let r = req(&a, XferOp::Read, MemType::Vram, 3, fd, &at(dst)).unwrap();
        assert_eq!(post_wait(&a, &r).unwrap(), Status::Success, "{plugin} {label} {shape} READ");
        for &(v, _, l) in &pieces {
            assert!(slice(dst + v, l as usize) == slice(src + v, l as usize), "{label} {shape}: VRAM bytes differ");
        }
        a.release_xfer_req(&w).unwrap();
        a.release_xfer_req(&r).unwrap();
        dereg(&a, MemType::Vram, src, vlen, 2).unwrap();
        dereg(&a, MemType::Vram, dst, vlen, 3).unwrap();
        dereg(&a, MemType::File, 0, 0, fd as u64).unwrap();
        fake::free(src).unwrap();
        fake::free(dst).unwrap();
        drop(f);
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn plugins_names_and_parameters_follow_nixl() {
    let a = Agent::new("names", AgentConfig::default()).unwrap();
    let list = a.available_plugins();
    assert!(list.iter().any(|p| p == "GDS") && list.iter().any(|p| p == "GDS_MT"), "{list:?}");
    for name in ["GDS", "GDS_MT"] {
        let (defaults, mems) = a.plugin_params(name).unwrap();
        assert!(defaults.is_empty(), "{name}: NIXL's GDS plugins report no default options");
        assert_eq!(mems, vec![MemType::Dram, MemType::Vram, MemType::File]);
    }
    let p = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Params>();
    let given = p(&[("batch_limit", "64"), ("batch_pool_size", "8"), ("max_request_size", "1048576")]);
    let b = a.create_backend("GDS", &given).unwrap();
    let (echo, mems) = a.backend_params(b).unwrap();
    assert_eq!(echo, given);
    assert_eq!(mems, vec![MemType::Dram, MemType::Vram, MemType::File]);
    let b = a.create_backend("GDS_MT", &p(&[("thread_count", "2")])).unwrap();
    assert_eq!(a.backend_params(b).unwrap().0, p(&[("thread_count", "2")]));
    let c = Agent::new("names2", AgentConfig::default()).unwrap();
    assert_eq!(c.create_backend("GDS_MT", &p(&[("thread_count", "two")])).unwrap_err().status(), Status::Backend);
    assert_eq!(c.create_backend("GDS", &p(&[("batch_limit", "-3")])).unwrap_err().status(), Status::Backend);
}

#[test]
fn vram_file_round_trip_on_tmpfs() {
    for plugin in ["GDS", "GDS_MT"] {
        round_trip(plugin, Path::new("/dev/shm"), false, "tmpfs");
    }
    round_trip("GDS_MT", Path::new("/dev/shm"), true, "tmpfs-odirect");
}

#[test]
fn vram_file_round_trip_on_ext4() {
    let Some(fs) = Ext4::new(512) else { return };
    round_trip("GDS_MT", &fs.dir, false, "ext4");
    round_trip("GDS", &fs.dir, true, "ext4-odirect");
}

#[test]
fn both_io_queues_and_the_file_list_on_the_local_side() {
    for (q, v) in [("use_posix_aio", "true"), ("use_uring", "true")] {
        assert!(gixl::device::select_fake());
        let a = Agent::new(&format!("q-{q}"), AgentConfig::default()).unwrap();
        if let Err(e) = a.create_backend("GDS_MT", &[(q.to_string(), v.to_string())].into_iter().collect()) {
            assert_eq!(q, "use_uring", "{e}");
            common::skip("io_uring", &format!("io_uring unavailable here: {e}"));
            continue;
        }
        let p = fresh(Path::new("/dev/shm"), "q");
        let f = open(&p, false).unwrap();
        let fd = f.as_raw_fd();
        let len = 5 * MIB + 123;
        let src = vram(0, len, |i| (i % 253) as u8);
        let dst = vram(0, len, |_| 9);
        reg(&a, MemType::Vram, src, len, 0, b"").unwrap();
        reg(&a, MemType::Vram, dst, len, 0, b"").unwrap();
        reg(&a, MemType::File, 0, 0, fd as u64, b"").unwrap();
        let w = req(&a, XferOp::Write, MemType::Vram, 0, fd, &[(src, 4096, len)]).unwrap();
        assert_eq!(post_wait(&a, &w).unwrap(), Status::Success, "{q}");
        // NIXL's GDS plugins also take the FILE list as the local one.
        let m = XferDList::with_descs(MemType::Vram, vec![Desc::new(dst, len, 0)]);
        let fl = XferDList::with_descs(MemType::File, vec![Desc::new(4096, len, fd as u64)]);
        let r = a.create_xfer_req(XferOp::Read, &fl, &m, a.name(), &XferOpts::default()).unwrap();
        assert_eq!(post_wait(&a, &r).unwrap(), Status::Success, "{q}");
        assert!(slice(dst, len as usize) == slice(src, len as usize), "{q}");
        std::fs::remove_file(p).unwrap();
    }
}

/// NIXL 1.5.1's path mode, as SGLang HiCache registers its files: the backend opens the file, devId names it.
#[test]
fn path_mode_files() {
    let a = agent("pathmode", "GDS", &[]);
    let dir = PathBuf::from("/dev/shm");
    let p = fresh(&dir, "pm");
    let len = 3 * MIB;
    let src = vram(6, len, |i| (i % 239) as u8);
    let dst = vram(6, len, |_| 0);
    reg(&a, MemType::Vram, src, len, 6, b"").unwrap();
    reg(&a, MemType::Vram, dst, len, 6, b"").unwrap();
    let id = 900_001u64; // a name, never a descriptor of this process
    reg(&a, MemType::File, 0, 0, id, format!("rw,create:{}", p.display()).as_bytes()).unwrap();
    let e = reg(&a, MemType::File, 0, 0, id, format!("rw:{}", p.display()).as_bytes()).unwrap_err();
    assert_eq!(e.status(), Status::Backend, "a devId taken by another path-mode file: {e}");
    let w = req(&a, XferOp::Write, MemType::Vram, 6, id as i32, &[(src, 0, len)]).unwrap();
    assert_eq!(post_wait(&a, &w).unwrap(), Status::Success);
    assert!(std::fs::read(&p).unwrap() == slice(src, len as usize)[..]);
    let r = req(&a, XferOp::Read, MemType::Vram, 6, id as i32, &[(dst, 0, len)]).unwrap();
    assert_eq!(post_wait(&a, &r).unwrap(), Status::Success);
    assert!(slice(dst, len as usize) == slice(src, len as usize));
    dereg(&a, MemType::File, 0, 0, id).unwrap();
    assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err().status(), Status::NotFound);
    // The devId is free again once deregistered.
    reg(&a, MemType::File, 0, 0, id, format!("ro:{}", p.display()).as_bytes()).unwrap();
    std::fs::remove_file(p).unwrap();
}

#[test]
fn dram_file_goes_as_posix() {
    let a = agent("dram", "GDS", &[]);
    let p = fresh(Path::new("/dev/shm"), "dram");
    let f = open(&p, false).unwrap();
    let fd = f.as_raw_fd();
    let src: Vec<u8> = (0..3 * MIB).map(|i| (i % 241) as u8).collect();
    let mut dst = vec![0u8; src.len()];
    reg(&a, MemType::Dram, src.as_ptr() as u64, src.len() as u64, 0, b"").unwrap();
    reg(&a, MemType::Dram, dst.as_mut_ptr() as u64, dst.len() as u64, 0, b"").unwrap();
    reg(&a, MemType::File, 0, 0, fd as u64, p.to_str().unwrap().as_bytes()).unwrap();
    let w = req(&a, XferOp::Write, MemType::Dram, 0, fd, &[(src.as_ptr() as u64, 0, src.len() as u64)]).unwrap();
    assert_eq!(post_wait(&a, &w).unwrap(), Status::Success);
    let r = req(&a, XferOp::Read, MemType::Dram, 0, fd, &[(dst.as_mut_ptr() as u64, 0, src.len() as u64)]).unwrap();
    assert_eq!(post_wait(&a, &r).unwrap(), Status::Success);
    assert!(dst == src);
    // A deregistered DRAM region or FILE region: the post fails NOT_FOUND and moves nothing.
    dereg(&a, MemType::Dram, dst.as_mut_ptr() as u64, dst.len() as u64, 0).unwrap();
    dst.fill(0x33);
    assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err().status(), Status::NotFound);
    dereg(&a, MemType::File, 0, 0, fd as u64).unwrap();
    assert_eq!(a.post_xfer_req(&w, NotifUpdate::Keep).unwrap_err().status(), Status::NotFound);
    std::thread::sleep(Duration::from_millis(10));
    assert!(dst.iter().all(|&b| b == 0x33));
    // query_memory as POSIX: stat of the path in metaInfo.
    let q = RegDList::with_descs(
        MemType::File,
        vec![RegDesc { desc: Desc::new(0, 0, 0), meta: p.to_str().unwrap().into() }, RegDesc::default()],
    );
    let info = a.query_mem(&q, BackendId(0)).unwrap();
    assert_eq!(info[0].as_ref().unwrap()["size"], (3 * MIB).to_string());
    assert_eq!(info[1], None);
    std::fs::remove_file(p).unwrap();
}

#[test]
fn short_file_misaligned_direct_and_closed_fd_fail_and_move_nothing() {
    let a = agent("fail", "GDS_MT", &[]);
    let p = fresh(Path::new("/dev/shm"), "short");
    let f = open(&p, false).unwrap();
    std::fs::write(&p, vec![7u8; 100 * KIB as usize]).unwrap();
    let fd = f.as_raw_fd();
    let len = 4 * MIB;
    let dst = vram(1, len, |_| 0);
    reg(&a, MemType::Vram, dst, len, 1, b"").unwrap();
    reg(&a, MemType::File, 0, 0, fd as u64, b"").unwrap();
    // The file ends at 100 KiB: a READ of 4 MiB is an error, not a short success.
    let r = req(&a, XferOp::Read, MemType::Vram, 1, fd, &[(dst, 0, len)]).unwrap();
    let e = post_wait(&a, &r).unwrap_err();
    assert_eq!(e.status(), Status::Backend);
    assert!(e.message().contains("short read"), "{e}");
    // The shared POSIX code's messages name this backend.
    assert!(e.message().contains("GDS_MT read of") && !e.message().contains("POSIX"), "{e}");

    // Closed after registration: refused at post, nothing moves.
    drop(f);
    slice(dst, len as usize).fill(0x55);
    let e = a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err();
    assert_eq!(e.status(), Status::Backend);
    assert!(e.message().contains("closed after it was registered"), "{e}");
    assert!(e.message().contains("GDS_MT: fd") && !e.message().contains("POSIX"), "{e}");
    std::thread::sleep(Duration::from_millis(10));
    assert!(slice(dst, len as usize).iter().all(|&b| b == 0x55));
    std::fs::remove_file(&p).unwrap();

    // O_DIRECT alignment is checked at prep.
    let Some(fs) = Ext4::new(64) else { return };
    let p = fresh(&fs.dir, "dio");
    let f = open(&p, true).unwrap();
    reg(&a, MemType::File, 0, 0, f.as_raw_fd() as u64, b"").unwrap();
    let e = req(&a, XferOp::Write, MemType::Vram, 1, f.as_raw_fd(), &[(dst, 100, 4096)]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidParam);
    assert!(e.message().contains("O_DIRECT") && !e.message().contains("POSIX"), "{e}");
    // The VRAM address itself need not be aligned (the kernel never sees it).
    let w = req(&a, XferOp::Write, MemType::Vram, 1, f.as_raw_fd(), &[(dst + 3, 8192, 4096)]).unwrap();
    assert_eq!(post_wait(&a, &w).unwrap(), Status::Success);
    drop(f);
}

#[test]
fn full_disk_is_an_error() {
    let Some(fs) = Ext4::new(16) else { return };
    let a = agent("full", "GDS", &[]);
    let p = fresh(&fs.dir, "full");
    let f = open(&p, false).unwrap();
    let fd = f.as_raw_fd();
    let len = 32 * MIB;
    let src = vram(0, len, |i| i as u8);
    reg(&a, MemType::Vram, src, len, 0, b"").unwrap();
    reg(&a, MemType::File, 0, 0, fd as u64, b"").unwrap();
    let w = req(&a, XferOp::Write, MemType::Vram, 0, fd, &[(src, 0, len)]).unwrap();
    let e = post_wait(&a, &w).unwrap_err();
    assert_eq!(e.status(), Status::Backend);
    assert!(e.message().contains("No space left on device"), "{e}");
    drop(f);
}

#[test]
fn deregistration_racing_a_request() {
    let a = agent("race", "GDS_MT", &[("thread_count", "2")]);
    let p = fresh(Path::new("/dev/shm"), "race");
    let f = open(&p, false).unwrap();
    let fd = f.as_raw_fd();
    let len = 64 * MIB;
    std::fs::write(&p, vec![0xA5u8; len as usize]).unwrap();
    let mut outcomes = Vec::new();
    for delay_us in [0u64, 1000, 5000, 20000, 300_000] {
        let dst = vram(4, len, |_| 0);
        reg(&a, MemType::Vram, dst, len, 4, b"").unwrap();
        reg(&a, MemType::File, 0, 0, fd as u64, b"").unwrap();
        let r = req(&a, XferOp::Read, MemType::Vram, 4, fd, &[(dst, 0, len)]).unwrap();
        assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::InProg);
        std::thread::sleep(Duration::from_micros(delay_us));
        dereg(&a, MemType::Vram, dst, len, 4).unwrap();
        // Deregistration has returned: nothing touches the region any more.
        let snapshot = slice(dst, len as usize).to_vec();
        let st = a.xfer_status(&r);
        assert!(!matches!(st, Ok(Status::InProg)), "deregistration returned while the request still ran");
        match &st {
            Ok(Status::Success) => assert!(snapshot.iter().all(|&b| b == 0xA5)),
            Err(e) => assert_eq!(e.status(), Status::NotFound, "{e}"),
            other => panic!("{other:?}"),
        }
        outcomes.push(st.map_err(|e| e.status()));
        std::thread::sleep(Duration::from_millis(20));
        assert!(slice(dst, len as usize) == &snapshot[..], "VRAM written after deregistration returned");
        // A post on the deregistered region fails NOT_FOUND and moves nothing.
        slice(dst, len as usize).fill(0x11);
        let e = a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err();
        assert_eq!(e.status(), Status::NotFound, "{e}");
        std::thread::sleep(Duration::from_millis(10));
        assert!(slice(dst, len as usize).iter().all(|&b| b == 0x11));
        a.release_xfer_req(&r).unwrap();
        dereg(&a, MemType::File, 0, 0, fd as u64).unwrap();
        fake::free(dst).unwrap();
    }
    eprintln!("outcomes by delay: {outcomes:?}");
    drop(f);
    std::fs::remove_file(p).unwrap();
}

/// The pipeline: while the file I/O of the first piece cannot finish (a pipe nobody reads yet), the device copies
/// of the following pieces go on. Device 7 is this test's own, so its copy count is not disturbed.
#[test]
fn device_copies_overlap_the_file_io_of_earlier_pieces() {
    assert!(gixl::device::select_fake());
    let a = Agent::new("overlap", AgentConfig::default()).unwrap();
    let q: Params = [("use_uring".to_string(), "true".to_string())].into_iter().collect();
    if let Err(e) = a.create_backend("GDS_MT", &q) {
        // Only io_uring writes to a pipe at an offset; the thread pool's pwrite cannot.
        common::skip("io_uring", &format!("io_uring unavailable here: {e}"));
        return;
    }
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let len = 3 * gixl::backend::gds::SLOT;
    let src = vram(7, len, |i| (i % 249) as u8);
    reg(&a, MemType::Vram, src, len, 7, b"").unwrap();
    reg(&a, MemType::File, 0, 0, fds[1] as u64, b"").unwrap();
    let w = req(&a, XferOp::Write, MemType::Vram, 7, fds[1], &[(src, 0, len)]).unwrap();
    let before = fake::copied_bytes_on(7);
    assert_eq!(a.post_xfer_req(&w, NotifUpdate::Keep).unwrap(), Status::InProg);
    let t0 = Instant::now();
    while fake::copied_bytes_on(7) - before < len && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(fake::copied_bytes_on(7) - before, len, "all three pieces copied while the first is not written");
    assert_eq!(a.xfer_status(&w).unwrap(), Status::InProg, "the pipe holds 64 KiB: the writes cannot be done");
    // Drain the pipe: every byte arrives (pieces may interleave in a pipe), and the request completes.
    let reader = std::thread::spawn(move || {
        let mut got = 0u64;
        let mut buf = vec![0u8; 1 << 16];
        while got < len {
            // SAFETY: reads into a live buffer of its length.
            let n = unsafe { libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len()) };
            assert!(n > 0, "pipe read: {n}");
            got += n as u64;
        }
        got
    });
    assert_eq!(wait(&a, &w).unwrap(), Status::Success);
    assert_eq!(reader.join().unwrap(), len);
    a.release_xfer_req(&w).unwrap();
    // SAFETY: closing the pipe ends we opened.
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
}

#[test]
fn agent_destruction_waits_for_a_staged_request() {
    let p = fresh(Path::new("/dev/shm"), "destroy");
    let f = open(&p, false).unwrap();
    let fd = f.as_raw_fd();
    let len = 64 * MIB;
    std::fs::write(&p, vec![0xA5u8; len as usize]).unwrap();
    let dst = vram(5, len, |_| 0);
    let a = agent("destroy", "GDS", &[]);
    reg(&a, MemType::Vram, dst, len, 5, b"").unwrap();
    reg(&a, MemType::File, 0, 0, fd as u64, b"").unwrap();
    let r = req(&a, XferOp::Read, MemType::Vram, 5, fd, &[(dst, 0, len)]).unwrap();
    assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::InProg);
    drop(a);
    let snapshot = slice(dst, len as usize).to_vec();
    std::thread::sleep(Duration::from_millis(30));
    assert!(slice(dst, len as usize) == &snapshot[..], "VRAM written after the agent was destroyed");
    drop(r);
    drop(f);
    std::fs::remove_file(p).unwrap();
}

// ----- benchmark -----

/// CPU seconds (user + system) this process has used, all threads.
fn cpu() -> f64 {
    // SAFETY: an all-zero rusage is a valid value; getrusage fills it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    s(u.ru_utime) + s(u.ru_stime)
}

/// (wall seconds, CPU seconds) of one post of `r`, to completion. The benchmark polls the request every 50 µs,
/// or every `GIXL_BENCH_POLL_US`; with a poll other than 50 µs the time is the request's own, from its post
/// to its completion (the agents' telemetry), so the poll's coarseness does not count.
fn once(a: &Agent, r: &XferReq) -> (f64, f64) {
    let poll: u64 = std::env::var("GIXL_BENCH_POLL_US").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
    let (t, c) = (Instant::now(), cpu());
    if poll == 50 {
        assert_eq!(post_wait(a, r).unwrap(), Status::Success);
        return (t.elapsed().as_secs_f64(), cpu() - c);
    }
    let mut st = a.post_xfer_req(r, NotifUpdate::Keep).unwrap();
    while st == Status::InProg {
        std::thread::sleep(Duration::from_micros(poll));
        st = a.xfer_status(r).unwrap();
    }
    assert_eq!(st, Status::Success);
    let c = cpu() - c;
    let tel = a.xfer_telemetry(r).unwrap().expect("telemetry of a finished post");
    (tel.xfer_duration_us as f64 / 1e6, c)
}

/// CPU seconds the whole machine has spent busy (user, nice, system, irq, softirq), from /proc/stat.
fn machine_busy() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<f64> =
        stat.lines().next().unwrap_or("").split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    // SAFETY: plain sysconf query.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    [0, 1, 2, 5, 6].iter().filter_map(|&i| f.get(i)).sum::<f64>() / hz
}

/// What other processes did to the machine while `f` ran: the CPU cores they kept busy on average.
fn others_load<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let (t0, b0, c0) = (Instant::now(), machine_busy(), cpu());
    let out = f();
    let (b, c, t) = (machine_busy() - b0, cpu() - c0, t0.elapsed().as_secs_f64());
    (out, ((b - c) / t).max(0.0))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|x, y| x.total_cmp(y));
    v[v.len() / 2]
}

/// Staged VRAM ↔ FILE (GDS_MT over the fake device) against POSIX DRAM ↔ FILE, same files, same shapes, in
/// one run: page cache (tmpfs and ext4) and O_DIRECT (ext4).
#[test]
#[ignore]
fn bench() {
    let fs = Ext4::new(1024).expect("the benchmark needs an ext4 loop device (root)");
    assert!(gixl::device::select_fake(), "this test process must use the fake device");
    // Telemetry (the post-to-completion time) only where the poll is not the default one.
    let poll_set = std::env::var("GIXL_BENCH_POLL_US").is_ok_and(|v| v.trim() != "50");
    let telemetry = AgentConfig { capture_telemetry: poll_set, ..AgentConfig::default() };
    let gds = Agent::new("bench-gds", telemetry.clone()).unwrap();
    gds.create_backend("GDS_MT", &Params::new()).unwrap();
    let posix = Agent::new("bench-posix", telemetry).unwrap();
    posix.create_backend("POSIX", &Params::new()).unwrap();
    let reps: usize = std::env::var("GIXL_BENCH_REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(15);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average (1, 5, 15 min) before: {}", load.split(' ').take(3).collect::<Vec<_>>().join(" "));
    println!("GDS_MT staged over the fake device vs POSIX DRAM; median of {reps} alternating posts each; default queue (io_uring if the kernel allows)");
    println!("'best': the ratio of the fastest posts; 'others': CPU cores kept busy by other processes and kernel threads (the loop device's included) meanwhile");
    println!(
        "{:<22} {:<14} {:>5} {:>10} {:>10} {:>7} {:>9} {:>7} {:>7}",
        "file", "shape", "op", "GDS GB/s", "POSIX GB/s", "ratio", "CPU ratio", "best", "others"
    );
    for (where_, dir, direct) in [
        ("tmpfs page cache", PathBuf::from("/dev/shm"), false),
        ("ext4 page cache", fs.dir.clone(), false),
        ("ext4 O_DIRECT", fs.dir.clone(), true),
    ] {
        for (shape, vlen, pieces) in shapes() {
            let p = fresh(&dir, "bench");
            let f = open(&p, direct).expect("O_DIRECT");
            let fd = f.as_raw_fd();
            let src = vram(0, vlen, |i| (i * 7) as u8);
            let host: Vec<u8> = slice(src, vlen as usize).to_vec();
            let dst = vram(0, vlen, |_| 0);
            // DRAM buffers page-aligned for O_DIRECT.
            let (mut hsrc, mut hdst) = (vec![0u8; (vlen + 4096) as usize], vec![0u8; (vlen + 4096) as usize]);
            let al = |v: &mut Vec<u8>| {
                let p = v.as_mut_ptr() as u64;
                p.div_ceil(4096) * 4096
            };
            let (hs, hd) = (al(&mut hsrc), al(&mut hdst));
            slice(hs, vlen as usize).copy_from_slice(&host);
            for (ag, m, a1, a2) in [(&gds, MemType::Vram, src, dst), (&posix, MemType::Dram, hs, hd)] {
                reg(ag, m, a1, vlen, 0, b"").unwrap();
                reg(ag, m, a2, vlen, 0, b"").unwrap();
                reg(ag, MemType::File, 0, 0, fd as u64, b"").unwrap();
            }
            let at = |base: u64| pieces.iter().map(|&(v, o, l)| (base + v, o, l)).collect::<Vec<_>>();
            let bytes: u64 = pieces.iter().map(|p| p.2).sum();
            let gw = req(&gds, XferOp::Write, MemType::Vram, 0, fd, &at(src)).unwrap();
            let pw = req(&posix, XferOp::Write, MemType::Dram, 0, fd, &at(hs)).unwrap();
            let gr = req(&gds, XferOp::Read, MemType::Vram, 0, fd, &at(dst)).unwrap();
            let pr = req(&posix, XferOp::Read, MemType::Dram, 0, fd, &at(hd)).unwrap();
            for (op, g, x) in [("WRITE", &gw, &pw), ("READ", &gr, &pr)] {
                // One warm-up each, then strictly alternating posts, so both see the same machine load.
                once(&gds, g);
                once(&posix, x);
                let ((tg, tp, cg, cp), others) = others_load(|| {
                    let (mut tg, mut tp, mut cg, mut cp) = (Vec::new(), Vec::new(), 0.0, 0.0);
                    for _ in 0..reps {
                        let (t, c) = once(&gds, g);
                        tg.push(t);
                        cg += c;
                        let (t, c) = once(&posix, x);
                        tp.push(t);
                        cp += c;
                    }
                    (tg, tp, cg, cp)
                });
                let best = |v: &[f64]| v.iter().copied().fold(f64::MAX, f64::min);
                let best_ratio = best(&tp) / best(&tg);
                let (g, x) = (bytes as f64 / median(tg) / 1e9, bytes as f64 / median(tp) / 1e9);
                println!(
                    "{where_:<22} {shape:<14} {op:>5} {g:>10.2} {x:>10.2} {:>6.0}% {:>9.2} {:>6.0}% {others:>7.2}",
                    100.0 * g / x,
                    cg / cp,
                    100.0 * best_ratio
                );
            }
            for &(v, _, l) in &pieces {
                assert!(slice(dst + v, l as usize) == slice(src + v, l as usize), "benchmark data differs");
            }
            drop(f);
            std::fs::remove_file(p).unwrap();
        }
    }
}
