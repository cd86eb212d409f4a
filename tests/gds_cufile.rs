//! The GDS backends' direct path (GPUDirect Storage through cuFile), over a fake libcufile and the fake device.
//!
//! `tests/fake_cufile.c` is compiled by this test into a shared library that implements the cuFile entry points
//! gixl calls over pread/pwrite, the "device pointer" being host memory as on gixl's fake device; it counts
//! every call, so the tests show the bytes went through cuFile (and no device copy staged them). This process
//! points `GIXL_CUFILE_LIB` at it before anything asks, so its self-test passes and the direct path is taken;
//! child processes run the library misbehaving (driver open fails, buffer registration fails, data corrupted)
//! or `GIXL_CUFILE=off`, and must fall back to staged with the reason in one WARN line and in `gixl doctor`.
//! The tests of this file run one at a time (they share the library's counters).
//!
//! Not covered here: NVIDIA's libcufile and a GPU (`scripts/gpu-check.sh` runs the direct cases where a
//! device is lent).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use gixl::device::fake;
use gixl::*;

mod common;
use common::dev::slice;
use common::loopdev::Ext4;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Counters of the fake library, in its order.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    open: u64,
    close: u64,
    hreg: u64,
    hdereg: u64,
    breg: u64,
    bdereg: u64,
    reads: u64,
    writes: u64,
    rbytes: u64,
    wbytes: u64,
    unreg_io: u64,
    bad: u64,
}

/// The fake library, compiled once per test binary run.
fn lib_path() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        use std::hash::{Hash, Hasher};
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cufile.c");
        // Named by the source's hash: built once, whichever test binary runs first; a rebuild is renamed into
        // place, so a process that has the library open keeps its copy.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::fs::read(&src).unwrap().hash(&mut h);
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let out = dir.join(format!("libfake-cufile-{:016x}.so", h.finish()));
        if out.exists() {
            return out;
        }
        let tmp = dir.join(format!("libfake-cufile-{}.so.tmp", std::process::id()));
        let cc = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o"])
            .arg(&tmp)
            .arg(&src)
            .arg("-lpthread")
            .output()
            .expect("cc");
        assert!(cc.status.success(), "cc: {}", String::from_utf8_lossy(&cc.stderr));
        std::fs::rename(&tmp, &out).unwrap();
        out
    })
}

/// This process: the fake device and the fake libcufile, set before anything asks; one test at a time.
fn setup() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    static ENV: OnceLock<()> = OnceLock::new();
    let g = ONE.lock().unwrap_or_else(|e| e.into_inner());
    ENV.get_or_init(|| {
        assert!(gixl::device::select_fake(), "this test process must use the fake device");
        std::env::set_var("GIXL_CUFILE_LIB", lib_path());
        std::env::remove_var("GIXL_CUFILE");
        std::env::remove_var("GIXL_FAKE_CUFILE");
    });
    g
}

/// The fake library's symbol `name` (it is already open in this process under the same path; a child opens
/// what its parent gave it).
fn sym(name: &std::ffi::CStr) -> *mut libc::c_void {
    let path = match std::env::var_os("GIXL_CHILD") {
        Some(_) => PathBuf::from(std::env::var_os("GIXL_CUFILE_LIB").unwrap()),
        None => lib_path().to_owned(),
    };
    let p = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; the library stays open.
    let h = unsafe { libc::dlopen(p.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null());
    // SAFETY: as above.
    let s = unsafe { libc::dlsym(h, name.as_ptr()) };
    assert!(!s.is_null(), "{name:?}");
    s
}

fn counts() -> Counts {
    let f: unsafe extern "C" fn(*mut u64, usize) =
        // SAFETY: gixl_fake_cufile_counts(uint64_t *out, size_t n) in tests/fake_cufile.c.
        unsafe { std::mem::transmute(sym(c"gixl_fake_cufile_counts")) };
    let mut v = [0u64; 12];
    // SAFETY: 12 slots.
    unsafe { f(v.as_mut_ptr(), v.len()) };
    Counts {
        open: v[0],
        close: v[1],
        hreg: v[2],
        hdereg: v[3],
        breg: v[4],
        bdereg: v[5],
        reads: v[6],
        writes: v[7],
        rbytes: v[8],
        wbytes: v[9],
        unreg_io: v[10],
        bad: v[11],
    }
}

fn live_bufs() -> usize {
    // SAFETY: size_t gixl_fake_cufile_live_bufs(void).
    let f: unsafe extern "C" fn() -> usize = unsafe { std::mem::transmute(sym(c"gixl_fake_cufile_live_bufs")) };
    // SAFETY: no arguments.
    unsafe { f() }
}

/// Make each cuFileRead/Write on `fd` sleep `us` microseconds (0: none).
fn delay(fd: i32, us: i64) {
    // SAFETY: void gixl_fake_cufile_delay(int fd, long us).
    let f: unsafe extern "C" fn(i32, i64) = unsafe { std::mem::transmute(sym(c"gixl_fake_cufile_delay")) };
    // SAFETY: plain values.
    unsafe { f(fd, us) }
}

fn agent(name: &str, plugin: &str, params: &[(&str, &str)]) -> Agent {
    let a = Agent::new(name, AgentConfig::default()).unwrap();
    let p: Params = params.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    a.create_backend(plugin, &p).unwrap();
    a
}

fn vram(dev: u32, len: u64, fill: impl Fn(u64) -> u8) -> u64 {
    let p = fake::alloc(dev, len as usize, false, None).unwrap();
    for (i, b) in slice(p, len as usize).iter_mut().enumerate() {
        *b = fill(i as u64);
    }
    p
}

fn reg(a: &Agent, mem: MemType, addr: u64, len: u64, dev: u64) -> Result<()> {
    a.register_mem(&RegDList::with_descs(mem, vec![RegDesc { desc: Desc::new(addr, len, dev), meta: vec![] }]), &[])
}

fn dereg(a: &Agent, mem: MemType, addr: u64, len: u64, dev: u64) -> Result<()> {
    a.deregister_mem(&RegDList::with_descs(mem, vec![RegDesc { desc: Desc::new(addr, len, dev), meta: vec![] }]), &[])
}

fn req(a: &Agent, op: XferOp, dev: u64, fd: i32, pieces: &[(u64, u64, u64)]) -> Result<XferReq> {
    let m = XferDList::with_descs(MemType::Vram, pieces.iter().map(|&(x, _, l)| Desc::new(x, l, dev)).collect());
    let f = XferDList::with_descs(MemType::File, pieces.iter().map(|&(_, o, l)| Desc::new(o, l, fd as u64)).collect());
    a.create_xfer_req(op, &m, &f, a.name(), &XferOpts::default())
}

fn post_wait(a: &Agent, r: &XferReq) -> Result<Status> {
    let t0 = Instant::now();
    let mut s = a.post_xfer_req(r, NotifUpdate::Keep)?;
    while s == Status::InProg {
        assert!(t0.elapsed() < Duration::from_secs(120), "transfer never finished");
        std::thread::sleep(Duration::from_micros(50));
        s = a.xfer_status(r)?;
    }
    Ok(s)
}

fn fresh(tag: &str) -> PathBuf {
    fresh_in(Path::new("/dev/shm"), tag)
}

fn fresh_in(dir: &Path, tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    dir.join(format!("gds-cufile-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)))
}

/// `p` read-write, created and emptied; None (a skip) where the file system refuses O_DIRECT.
fn open(p: &Path, direct: bool) -> Option<File> {
    let mut o = File::options();
    o.read(true).write(true).create(true).truncate(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    match o.open(p) {
        Ok(f) => Some(f),
        Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
            common::skip("o_direct", &format!("{}: O_DIRECT refused here ({e})", p.display()));
            None
        }
        Err(e) => panic!("{}: {e}", p.display()),
    }
}

type Piece = (u64, u64, u64);

/// One 64 MiB descriptor, and 1024 blocks of 16 KiB scattered over 32 MiB of VRAM and a 64 MiB file.
fn shapes() -> Vec<(&'static str, u64, Vec<Piece>)> {
    let blk = 16 * KIB;
    let scattered = (0..1024u64).map(|i| (((i * 7) % 2048) * blk, ((i * 13 + 5) % 4096) * blk, blk)).collect();
    vec![("64 MiB", 64 * MIB, vec![(0, 0, 64 * MIB)]), ("1024 x 16 KiB", 32 * MIB, scattered)]
}

#[test]
fn the_self_test_passes_over_the_fake_library_and_the_direct_path_is_taken() {
    let _g = setup();
    assert_eq!(gixl::backend::gds::direct_path(), &Ok(()), "the self-test over the fake libcufile must pass");
    assert_eq!(gixl::backend::gds::staged_reason(), None);
    let c = counts();
    assert_eq!(c.open, 1, "the driver is opened once per process: {c:?}");
    assert!(c.writes >= 1 && c.reads >= 1 && c.wbytes >= MIB && c.rbytes >= MIB, "the self-test moved data: {c:?}");
    assert_eq!(c.bad, 0, "no call with a malformed argument (descriptor layout, handle, offsets): {c:?}");
}

#[test]
fn direct_round_trip_is_byte_exact_through_cufile() {
    let _g = setup();
    for (plugin, direct) in [("GDS", false), ("GDS_MT", false), ("GDS_MT", true), ("GDS", true)] {
        round_trip(plugin, Path::new("/dev/shm"), direct);
    }
}

#[test]
fn direct_round_trip_on_ext4() {
    let _g = setup();
    let Some(fs) = Ext4::new(512) else { return };
    round_trip("GDS_MT", &fs.dir, false);
    round_trip("GDS", &fs.dir, true);
}

/// VRAM → FILE → VRAM through `plugin` in `dir`, both shapes: byte-exact, every byte through cuFile.
fn round_trip(plugin: &str, dir: &Path, direct: bool) {
    let a = agent(&format!("rt-{plugin}-{direct}"), plugin, &[]);
    for (shape, vlen, pieces) in shapes() {
        let label = format!("{plugin} {} O_DIRECT={direct} {shape}", dir.display());
        let p = fresh_in(dir, "rt");
        let Some(f) = open(&p, direct) else { return };
        let fd = f.as_raw_fd();
        let src = vram(2, vlen, |i| (i.wrapping_mul(2654435761) >> 7) as u8);
        let dst = vram(3, vlen, |_| 0);
        let (bufs, cb) = (live_bufs(), counts());
        reg(&a, MemType::Vram, src, vlen, 2).unwrap();
        reg(&a, MemType::Vram, dst, vlen, 3).unwrap();
        assert_eq!(live_bufs(), bufs + 2, "{label}: both VRAM regions registered with cuFile");
        reg(&a, MemType::File, 0, 0, fd as u64).unwrap();
        let at = |base: u64| pieces.iter().map(|&(v, o, l)| (base + v, o, l)).collect::<Vec<_>>();
        let total: u64 = pieces.iter().map(|p| p.2).sum();
        let (c0, copied2, copied3) = (counts(), fake::copied_bytes_on(2), fake::copied_bytes_on(3));
        let w = req(&a, XferOp::Write, 2, fd, &at(src)).unwrap();
        assert_eq!(post_wait(&a, &w).unwrap(), Status::Success, "{label} WRITE");
        let disk = std::fs::read(&p).unwrap();
        for &(v, o, l) in &pieces {
            assert!(disk[o as usize..][..l as usize] == slice(src + v, l as usize)[..], "{label}: file bytes");
        }
        let r = req(&a, XferOp::Read, 3, fd, &at(dst)).unwrap();
        assert_eq!(post_wait(&a, &r).unwrap(), Status::Success, "{label} READ");
        for &(v, _, l) in &pieces {
            assert!(slice(dst + v, l as usize) == slice(src + v, l as usize), "{label}: VRAM bytes differ");
        }
        let c = counts();
        assert_eq!(c.wbytes - c0.wbytes, total, "{label}: every byte written through cuFileWrite");
        assert_eq!(c.rbytes - c0.rbytes, total, "{label}: every byte read through cuFileRead");
        assert_eq!(c.hreg - c0.hreg, 1, "{label}: the file registered with cuFile once");
        assert_eq!(c.unreg_io, c0.unreg_io, "{label}: every call named registered memory");
        assert_eq!(c.bad, 0, "{label}: {c:?}");
        assert_eq!(fake::copied_bytes_on(2), copied2, "{label}: no device copy staged the WRITE");
        assert_eq!(fake::copied_bytes_on(3), copied3, "{label}: no device copy staged the READ");
        a.release_xfer_req(&w).unwrap();
        a.release_xfer_req(&r).unwrap();
        dereg(&a, MemType::Vram, src, vlen, 2).unwrap();
        dereg(&a, MemType::Vram, dst, vlen, 3).unwrap();
        dereg(&a, MemType::File, 0, 0, fd as u64).unwrap();
        assert_eq!(live_bufs(), bufs, "{label}: deregistration released the cuFile buffers");
        let c = counts();
        assert_eq!((c.breg - cb.breg, c.bdereg - cb.bdereg), (2, 2), "{label}: cuFile buffer (de)registrations");
        assert_eq!(c.hdereg - c0.hdereg, 1, "{label}: and the cuFile file handle");
        fake::free(src).unwrap();
        fake::free(dst).unwrap();
        drop(f);
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn deregistration_racing_a_direct_request() {
    let _g = setup();
    let a = agent("race", "GDS_MT", &[("thread_count", "2")]);
    let p = fresh("race");
    let f = open(&p, false).unwrap();
    let fd = f.as_raw_fd();
    let len = 64 * MIB;
    std::fs::write(&p, vec![0xA5u8; len as usize]).unwrap();
    // 64 MiB are four 16 MiB cuFile calls, two per driver thread; each call takes at least 30 ms here.
    delay(fd, 30_000);
    let mut outcomes = Vec::new();
    for delay_us in [0u64, 10_000, 45_000, 300_000] {
        let dst = vram(4, len, |_| 0);
        let bufs = live_bufs();
        reg(&a, MemType::Vram, dst, len, 4).unwrap();
        reg(&a, MemType::File, 0, 0, fd as u64).unwrap();
        let r = req(&a, XferOp::Read, 4, fd, &[(dst, 0, len)]).unwrap();
        assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::InProg);
        std::thread::sleep(Duration::from_micros(delay_us));
        let t = Instant::now();
        dereg(&a, MemType::Vram, dst, len, 4).unwrap();
        assert!(t.elapsed() < Duration::from_secs(5), "deregistration waited {:?}", t.elapsed());
        assert_eq!(live_bufs(), bufs, "deregistration released the cuFile buffer");
        let snapshot = slice(dst, len as usize).to_vec();
        let st = a.xfer_status(&r);
        assert!(!matches!(st, Ok(Status::InProg)), "deregistration returned while the request still ran");
        match &st {
            Ok(Status::Success) => assert!(snapshot.iter().all(|&b| b == 0xA5)),
            Err(e) => assert_eq!(e.status(), Status::NotFound, "{e}"),
            other => panic!("{other:?}"),
        }
        outcomes.push(st.map_err(|e| e.status()));
        std::thread::sleep(Duration::from_millis(50));
        assert!(slice(dst, len as usize) == &snapshot[..], "VRAM written after deregistration returned");
        // A post on the deregistered region fails NOT_FOUND and moves nothing.
        let c = counts();
        slice(dst, len as usize).fill(0x11);
        let e = a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err();
        assert_eq!(e.status(), Status::NotFound, "{e}");
        std::thread::sleep(Duration::from_millis(50));
        assert!(slice(dst, len as usize).iter().all(|&b| b == 0x11));
        assert_eq!(counts().reads, c.reads, "no cuFile call after the refusal");
        a.release_xfer_req(&r).unwrap();
        dereg(&a, MemType::File, 0, 0, fd as u64).unwrap();
        fake::free(dst).unwrap();
    }
    delay(fd, 0);
    eprintln!("outcomes by delay: {outcomes:?}");
    assert!(outcomes.contains(&Err(Status::NotFound)), "no deregistration caught the request in flight: {outcomes:?}");
    drop(f);
    std::fs::remove_file(p).unwrap();
}

#[test]
fn closed_fd_and_short_file_fail_with_nixl_statuses_and_move_nothing() {
    let _g = setup();
    let a = agent("fail", "GDS", &[]);
    let p = fresh("short");
    let f = open(&p, false).unwrap();
    let fd = f.as_raw_fd();
    std::fs::write(&p, vec![7u8; (100 * KIB) as usize]).unwrap();
    let dst = vram(5, MIB, |_| 0);
    reg(&a, MemType::Vram, dst, MIB, 5).unwrap();
    reg(&a, MemType::File, 0, 0, fd as u64).unwrap();
    // A READ past the end of the file: NIXL_ERR_BACKEND, "short read".
    let r = req(&a, XferOp::Read, 5, fd, &[(dst, 0, 256 * KIB)]).unwrap();
    let e = post_wait(&a, &r).unwrap_err();
    assert_eq!(e.status(), Status::Backend, "{e}");
    assert!(e.message().contains("short read") && e.message().contains(&format!("fd {fd}")), "{e}");
    assert!(e.message().starts_with("GDS read of"), "the message names the backend: {e}");
    // The fd closed since registration: refused at post, no cuFile call.
    let w = req(&a, XferOp::Write, 5, fd, &[(dst, 0, 64 * KIB)]).unwrap();
    drop(f);
    let c = counts();
    let e = a.post_xfer_req(&w, NotifUpdate::Keep).unwrap_err();
    assert_eq!(e.status(), Status::Backend, "{e}");
    assert!(e.message().contains("GDS: fd") && e.message().contains("closed"), "{e}");
    let after = counts();
    assert_eq!((after.reads, after.writes), (c.reads, c.writes), "nothing moved");
    a.release_xfer_req(&r).unwrap();
    a.release_xfer_req(&w).unwrap();
    dereg(&a, MemType::Vram, dst, MIB, 5).unwrap();
    dereg(&a, MemType::File, 0, 0, fd as u64).unwrap();
    fake::free(dst).unwrap();
    std::fs::remove_file(p).unwrap();
}

/// A child of this test binary (`GIXL_CHILD` set): a GDS_MT round trip of 1 MiB on the fake device, then which
/// path was taken, the fake library's counters and the doctor's report, as `@key value` lines.
#[test]
fn child_entry() {
    if std::env::var("GIXL_CHILD").as_deref() != Ok("gds-cufile") {
        return;
    }
    assert!(gixl::device::select_fake());
    let a = agent("child", "GDS_MT", &[]);
    let p = fresh("child");
    let f = open(&p, false).unwrap();
    let fd = f.as_raw_fd();
    let src = vram(2, MIB, |i| (i * 31 % 251) as u8);
    let dst = vram(3, MIB, |_| 0);
    reg(&a, MemType::Vram, src, MIB, 2).unwrap();
    reg(&a, MemType::Vram, dst, MIB, 3).unwrap();
    reg(&a, MemType::File, 0, 0, fd as u64).unwrap();
    let c0 = fake::copied_bytes_on(2) + fake::copied_bytes_on(3);
    let w = req(&a, XferOp::Write, 2, fd, &[(src, 0, MIB)]).unwrap();
    assert_eq!(post_wait(&a, &w).unwrap(), Status::Success);
    let r = req(&a, XferOp::Read, 3, fd, &[(dst, 0, MIB)]).unwrap();
    assert_eq!(post_wait(&a, &r).unwrap(), Status::Success);
    assert!(slice(dst, MIB as usize) == slice(src, MIB as usize), "round trip");
    let staged = fake::copied_bytes_on(2) + fake::copied_bytes_on(3) - c0;
    println!("\n@staged_bytes {staged}");
    println!("@reason {}", gixl::backend::gds::staged_reason().unwrap_or("none"));
    let ours = std::env::var_os("GIXL_CUFILE_LIB").is_some_and(|p| Path::new(&p).exists());
    let c = if ours { counts() } else { Counts::default() };
    println!("@counts open={} reads={} writes={} close={}", c.open, c.reads, c.writes, c.close);
    println!("@json {}", gixl::telemetry::doctor::report(None));
    drop(f);
    std::fs::remove_file(p).unwrap();
}

/// Run the child with `env`; its `@key` lines and its stderr.
fn child(env: &[(&str, &str)]) -> (std::collections::HashMap<String, String>, String) {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", "gds-cufile")
        .env("GIXL_CUFILE_LIB", lib_path())
        .env_remove("GIXL_CUFILE")
        .env_remove("GIXL_FAKE_CUFILE")
        .env_remove("GIXL_LOG")
        .env_remove("NIXL_LOG_LEVEL");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "child {env:?} failed:\n{stdout}\n{stderr}");
    let keys = stdout
        .lines()
        .filter_map(|l| l.strip_prefix('@'))
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    (keys, stderr)
}

/// Environment variables of a child.
type Env<'a> = &'a [(&'a str, &'a str)];

#[test]
fn a_failing_self_test_falls_back_to_staged_with_the_reason() {
    let _g = setup();
    // (the child's environment, the reason it must give, the fake library's calls it must show)
    let cases: &[(Env, &str, &str)] = &[
        (
            &[("GIXL_FAKE_CUFILE", "open-fails")],
            "cuFileDriverOpen failed (cuFile error 5001",
            "open=1 reads=0 writes=0",
        ),
        (
            &[("GIXL_FAKE_CUFILE", "bufreg-fails")],
            "the self-test failed: cuFileBufRegister: cuFileBufRegister of",
            "open=1 reads=0 writes=0 close=1",
        ),
        (
            &[("GIXL_FAKE_CUFILE", "corrupt")],
            "the self-test failed: checking the data read back: the data read back differs",
            "open=1 reads=1 writes=1 close=1",
        ),
        (&[("GIXL_CUFILE", "off")], "GIXL_CUFILE=off", "open=0 reads=0 writes=0"),
        (&[("GIXL_CUFILE_LIB", "/nonexistent/libcufile.so.0")], "/nonexistent/libcufile.so.0 is not installed", ""),
    ];
    for (env, why, calls) in cases {
        let (k, stderr) = child(env);
        let reason = &k["reason"];
        assert!(reason.contains(why), "{env:?}: reason {reason:?}, wanted {why:?}");
        assert!(k["counts"].starts_with(calls), "{env:?}: cuFile calls {:?}, wanted {calls:?}", k["counts"]);
        assert_eq!(k["staged_bytes"], (2 * MIB).to_string(), "{env:?}: the round trip was staged");
        let warns: Vec<&str> = stderr.lines().filter(|l| l.contains("GPUDirect Storage")).collect();
        assert_eq!(warns.len(), 1, "{env:?}: one log line says why: {stderr}");
        assert!(warns[0].contains("WARN") && warns[0].contains(why), "{env:?}: {}", warns[0]);
        let j = &k["json"];
        assert!(j.contains("\"device\":\"GPUDirect Storage\",\"used\":false") && j.contains(why), "{env:?}: {j}");
    }
    // The fake library behaving: the child's round trip goes through cuFile, and the doctor says it is used.
    let (k, stderr) = child(&[]);
    assert_eq!(k["reason"], "none", "{stderr}");
    assert_eq!(k["staged_bytes"], "0");
    assert!(k["counts"].starts_with("open=1 reads=2 writes=2"), "self-test and round trip: {}", k["counts"]);
    assert!(k["json"].contains("\"device\":\"GPUDirect Storage\",\"used\":true"), "{}", k["json"]);
    assert!(!stderr.contains("GPUDirect Storage"), "no warning when the direct path is taken: {stderr}");
}

/// Deregistration waits (bounded) for a cuFile call in flight on its region; meanwhile this agent goes on
/// preparing other requests and registering memory: the wait is not made under the agent's registration table.
#[test]
fn a_deregistration_waiting_for_io_does_not_hold_up_other_requests() {
    let _g = setup();
    let a = agent("slow-dereg", "GDS_MT", &[("thread_count", "2")]);
    let p = fresh("slow");
    let f = open(&p, false).unwrap();
    let fd = f.as_raw_fd();
    std::fs::write(&p, vec![3u8; (16 * MIB) as usize]).unwrap();
    let (dst, other) = (vram(6, 16 * MIB, |_| 0), vram(6, MIB, |_| 0));
    reg(&a, MemType::Vram, dst, 16 * MIB, 6).unwrap();
    reg(&a, MemType::Vram, other, MIB, 6).unwrap();
    reg(&a, MemType::File, 0, 0, fd as u64).unwrap();
    // One 16 MiB cuFile call that takes 3 s.
    delay(fd, 3_000_000);
    let r = req(&a, XferOp::Read, 6, fd, &[(dst, 0, 16 * MIB)]).unwrap();
    assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::InProg);
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let more = vram(6, MIB, |_| 0);
    let (x, took) = std::thread::scope(|sc| {
        let d = sc.spawn(|| dereg(&a, MemType::Vram, dst, 16 * MIB, 6));
        std::thread::sleep(Duration::from_millis(200));
        // While the deregistration waits for the call, another request is prepared and memory registered.
        let x = req(&a, XferOp::Write, 6, fd, &[(other, 32 * MIB, MIB)]).unwrap();
        reg(&a, MemType::Vram, more, MIB, 6).unwrap();
        assert!(!d.is_finished(), "the deregistration should still be waiting for the cuFile call");
        let took = t.elapsed();
        d.join().unwrap().unwrap();
        (x, took)
    });
    assert!(t.elapsed() >= Duration::from_millis(1500), "the deregistration waited for the call in flight");
    assert!(took < Duration::from_millis(2000), "other work waited for the deregistration: {took:?}");
    delay(fd, 0);
    assert_eq!(a.xfer_status(&r).unwrap(), Status::Success, "the call in flight finished the request");
    assert_eq!(post_wait(&a, &x).unwrap(), Status::Success);
    a.release_xfer_req(&r).unwrap();
    a.release_xfer_req(&x).unwrap();
    dereg(&a, MemType::Vram, other, MIB, 6).unwrap();
    dereg(&a, MemType::Vram, more, MIB, 6).unwrap();
    dereg(&a, MemType::File, 0, 0, fd as u64).unwrap();
    for b in [dst, other, more] {
        fake::free(b).unwrap();
    }
    drop(f);
    std::fs::remove_file(p).unwrap();
}
