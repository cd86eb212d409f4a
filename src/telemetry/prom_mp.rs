//! The multi-process Prometheus exporter (`NIXL_TELEMETRY_EXPORTER=prometheus_mp`): every process of a run
//! (one per GPU rank, say) writes its agents' values into store files in one shared directory
//! (`NIXL_TELEMETRY_MULTIPROC_DIR`, required), and one of them serves them all behind a single scrape
//! endpoint, as NIXL 1.5.1's exporter of that name does.
//!
//! - **Store files.** One per agent, `gixl.<pid>.<agent instance>.store`, created `0600` (`O_EXCL`,
//!   `O_NOFOLLOW`) and mapped shared: the agent's values are atomics in the file (the same word layout as
//!   the single-process exporter keeps in memory, [`super::prom::Layout`]), so an update is one atomic add,
//!   no lock and no system call. A destroyed agent removes its file.
//! - **Owner election.** The first agent of a process races for an exclusive `flock` on
//!   `nixl-owner.<bind address>:<port>.lock` in the directory (NIXL's name for it). The winner binds the
//!   endpoint and, at each scrape, reads every store file there; the others only write. A lock file that
//!   is not a regular file of this user, or a filesystem without `flock`, leaves the bind to decide (with a
//!   warning). An owner that cannot bind gives the lock back (warning). No failover: when the owner exits,
//!   the endpoint is down until a new process wins the lock.
//! - **Series.** NIXL's names and types, one set per agent, labelled `hostname`, `agent_name`, `pid`,
//!   `agent_instance` (the agent's number within its process, from 0) and, when the variable named by
//!   `NIXL_TELEMETRY_RANK_ENV` (default `LOCAL_RANK`) is set, `local_rank`; plus
//!   `gixl_stale_handle_refusals_total`. gixl's per-peer series are not in the store (their labels vary).
//! - **Stale files.** A file whose process is gone (pid and start time) and that has not been updated for
//!   `NIXL_TELEMETRY_MP_STALE_TTL` seconds (default 30) is dropped and removed at the next scrape; until then
//!   its last values are served. A file of another user, or one that does not parse, is skipped (logged once).
//! - `NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US` may hold at most 32 bounds here (the store's fixed header).
//!
//! The files are gixl's own format (a NIXL process in the same directory neither reads nor is read).

use std::collections::HashSet;
use std::ffi::CString;
use std::io::Write as _;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::log;
use super::prom::{esc, Layout, Row, Series};
use crate::config::{self, Kind};
use crate::status::{Error, Result};

/// Most histogram bounds a store holds.
pub const MAX_BOUNDS: usize = 32;
const MAGIC: u64 = u64::from_le_bytes(*b"gixlmp01");
/// Header words: magic, pid, process start time, agent instance, last update (CLOCK_MONOTONIC ns), number of
/// bounds, label bytes, then the bounds (f64 bits).
const H_PID: usize = 1;
const H_START: usize = 2;
const H_INSTANCE: usize = 3;
const H_UPDATED: usize = 4;
const H_BOUNDS: usize = 5;
const H_LABELS: usize = 6;
const HEADER: usize = 7 + MAX_BOUNDS;
/// Labels: hostname, agent name, local rank, separated by NUL, each at most this long.
const MAX_LABEL: usize = 4096;
/// Largest store file a reader maps.
const MAX_FILE: usize = 64 << 10;

/// One agent's store file, mapped.
pub struct Store {
    base: *mut u8,
    len: usize,
    words: usize,
    path: PathBuf,
}

// SAFETY: the mapping is only accessed through atomics, and lives as long as the `Store`.
unsafe impl Send for Store {}
// SAFETY: as above.
unsafe impl Sync for Store {}

fn word(base: *const u8, i: usize) -> &'static AtomicU64 {
    // SAFETY: callers index inside a live, page-aligned mapping they checked the length of; the reference
    // does not outlive it (it is used within the caller's borrow of the mapping).
    unsafe { &*(base.add(i * 8) as *const AtomicU64) }
}

impl Store {
    fn create(dir: &Path, instance: u64, labels: &[&str; 3], bounds: &[f64]) -> Result<Store> {
        let pid = std::process::id();
        let start = crate::util::process_start_time(pid as i32)
            .map_err(|e| Error::os(crate::status::Status::Backend, "prometheus_mp: this process's start time", e))?;
        let words = Layout::new(bounds.len()).words();
        let text: Vec<u8> = labels.iter().map(|l| l.as_bytes()).collect::<Vec<_>>().join(&0u8);
        let len = ((HEADER + words) * 8 + text.len()).div_ceil(4096) * 4096;
        let path = dir.join(format!("gixl.{pid}.{instance}.store"));
        let fd = create_file(&path, len)?;
        let base = crate::util::map_shared(fd.as_raw_fd(), len, true).map_err(|e| {
            let _ = std::fs::remove_file(&path);
            Error::os(crate::status::Status::Backend, format!("prometheus_mp: mapping {}", path.display()), e)
        })?;
        let s = Store { base, len, words, path };
        for (i, v) in [(H_PID, pid as u64), (H_START, start), (H_INSTANCE, instance), (H_BOUNDS, bounds.len() as u64)] {
            word(base, i).store(v, Ordering::Relaxed);
        }
        word(base, H_LABELS).store(text.len() as u64, Ordering::Relaxed);
        for (i, b) in bounds.iter().enumerate() {
            word(base, 7 + i).store(b.to_bits(), Ordering::Relaxed);
        }
        // SAFETY: the label bytes fit: `len` was sized for them after the header and the values.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), base.add((HEADER + words) * 8), text.len()) };
        s.touch();
        // Last: a reader that sees the magic sees the header.
        word(base, 0).store(MAGIC, Ordering::Release);
        Ok(s)
    }

    pub(super) fn words(&self) -> &[AtomicU64] {
        // SAFETY: `words` atomics after the header, inside the mapping, which lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.base.add(HEADER * 8) as *const AtomicU64, self.words) }
    }

    /// The agent's values changed now.
    pub(super) fn touch(&self) {
        word(self.base, H_UPDATED).store(crate::util::monotonic_ns(), Ordering::Relaxed);
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // A clean end: the file goes (a crash leaves it to the owner's stale check).
        let _ = std::fs::remove_file(&self.path);
        // SAFETY: unmapping our own mapping; nothing refers into it past `self`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn cpath(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| Error::invalid_param(format!("path {} has a NUL", p.display())))
}

/// A new file of `len` zero bytes at `path` (an old one of a recycled pid is replaced), `0600`, never
/// through a symbolic link.
fn create_file(path: &Path, len: usize) -> Result<OwnedFd> {
    let c = cpath(path)?;
    let os = |what: &str, e| {
        Error::os(crate::status::Status::Backend, format!("prometheus_mp: {what} {}", path.display()), e)
    };
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(os("removing", e)),
        _ => {}
    }
    let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { libc::open(c.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return Err(os("creating", std::io::Error::last_os_error()));
    }
    // SAFETY: a descriptor we just opened.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sizing our own file.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } < 0 {
        let e = std::io::Error::last_os_error();
        let _ = std::fs::remove_file(path);
        return Err(os("sizing", e));
    }
    Ok(fd)
}

/// The process's side of the directory: where its agents' files go, their numbering.
struct Mp {
    dir: PathBuf,
    next_instance: AtomicU64,
}

static MP: OnceLock<Mp> = OnceLock::new();

/// A store for a new agent of this process, in `NIXL_TELEMETRY_MULTIPROC_DIR`; the first one also runs the
/// owner election. Errors fail agent creation, as NIXL's do.
pub(super) fn attach(agent: &str, bounds: Vec<f64>, at: (&'static str, u16)) -> Result<Arc<Series>> {
    if bounds.len() > MAX_BOUNDS {
        return Err(Error::invalid_param(format!(
            "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US: prometheus_mp keeps at most {MAX_BOUNDS} bounds, {} given",
            bounds.len()
        )));
    }
    let dir = match config::get("NIXL_TELEMETRY_MULTIPROC_DIR", Kind::Str)?.filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => return Err(Error::backend(
            "Failed to create telemetry exporter: prometheus_mp (it requires NIXL_TELEMETRY_MULTIPROC_DIR to be set)",
        )),
    };
    let mp = match MP.get() {
        Some(mp) => mp,
        None => {
            std::fs::create_dir_all(&dir).map_err(|e| {
                Error::os(crate::status::Status::Backend, format!("prometheus_mp: creating {}", dir.display()), e)
            })?;
            // Read before the process's state is made: an error here must leave the election to the next agent.
            let ttl_ns = stale_ttl_ns()?;
            let mut first = false;
            let mp = MP.get_or_init(|| {
                first = true;
                Mp { dir: dir.clone(), next_instance: AtomicU64::new(0) }
            });
            if first {
                elect(&mp.dir, at, ttl_ns);
            }
            mp
        }
    };
    if mp.dir != dir {
        log::warn(&format!(
            "prometheus_mp: this process writes into {} (its first agent's NIXL_TELEMETRY_MULTIPROC_DIR), not {}",
            mp.dir.display(),
            dir.display()
        ));
    }
    let rank_var = config::get("NIXL_TELEMETRY_RANK_ENV", Kind::Str)?.unwrap_or_else(|| "LOCAL_RANK".into());
    let rank = std::env::var(rank_var.trim()).unwrap_or_default();
    let host = super::hostname();
    let labels = [label(&host), label(agent), label(rank.trim())];
    let instance = mp.next_instance.fetch_add(1, Ordering::Relaxed);
    let store = Store::create(&mp.dir, instance, &[&labels[0], &labels[1], &labels[2]], &bounds)?;
    Ok(Arc::new(Series::new(agent, bounds, Some(store))))
}

/// A label value as a store keeps it: at most `MAX_LABEL` bytes (what a reader accepts), cut at a character
/// boundary, without NUL (the separator).
fn label(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars().filter(|&c| c != '\0') {
        if out.len() + c.len_utf8() > MAX_LABEL {
            break;
        }
        out.push(c);
    }
    out
}

/// Race for the directory's lock; the winner binds the endpoint and serves every store file there.
fn elect(dir: &Path, (host, port): (&'static str, u16), ttl_ns: u64) {
    let lock_path = dir.join(format!("nixl-owner.{host}:{port}.lock"));
    let lock = match open_lock(&lock_path) {
        Ok(f) => match flock(&f) {
            Ok(true) => Some(f),
            Ok(false) => {
                log::info(&format!(
                    "telemetry: prometheus_mp: another process serves {} on {host}:{port}; this one writes its store only",
                    dir.display()
                ));
                return;
            }
            Err(e) => {
                log::warn(&format!(
                    "prometheus_mp: cannot lock {} ({e}); binding {host}:{port} decides which process serves",
                    lock_path.display()
                ));
                None
            }
        },
        Err(why) => {
            log::warn(&format!("prometheus_mp: {why}; binding {host}:{port} decides which process serves"));
            None
        }
    };
    let l = match std::net::TcpListener::bind((host, port)) {
        Ok(l) => l,
        Err(e) => {
            // The lock goes back with the file: a later process may take the endpoint over.
            log::warn(&format!(
                "prometheus_mp: cannot listen on {host}:{port} ({e}); nothing serves the telemetry in {}",
                dir.display()
            ));
            return;
        }
    };
    if let Some(mut f) = lock.as_ref() {
        let _ = f.set_len(0);
        let _ = writeln!(f, "{host}:{port} pid {}", std::process::id());
    }
    let served = dir.to_path_buf();
    let warned = Mutex::new(HashSet::new());
    if super::prom::serve(l, Box::new(move || super::prom::render(&collect(&served, ttl_ns, &warned), false))) {
        // The lock is held for the life of the process.
        std::mem::forget(lock);
        log::info(&format!(
            "telemetry: prometheus_mp exporter on http://{host}:{port}/metrics for the processes writing into {}",
            dir.display()
        ));
    }
}

fn open_lock(path: &Path) -> std::result::Result<std::fs::File, String> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("cannot open {} ({e})", path.display()))?;
    let m = f.metadata().map_err(|e| format!("cannot stat {} ({e})", path.display()))?;
    // SAFETY: plain syscall.
    let me = unsafe { libc::geteuid() };
    if !m.file_type().is_file() || m.uid() != me {
        return Err(format!("{} is not a regular file of uid {me}; it is ignored", path.display()));
    }
    Ok(f)
}

/// Ok(true): ours; Ok(false): another process holds it.
fn flock(f: &std::fs::File) -> std::io::Result<bool> {
    // SAFETY: plain syscall on an open descriptor.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

fn stale_ttl_ns() -> Result<u64> {
    // Whole seconds, as NIXL reads them: anything else fails the exporter, and so agent creation.
    Ok(config::unsigned("NIXL_TELEMETRY_MP_STALE_TTL", u64::MAX)?
        .map_or(30_000_000_000, |s| s.saturating_mul(1_000_000_000)))
}

/// One row per store file in `dir` worth serving, in (pid, instance) order; stale ones are removed.
fn collect(dir: &Path, ttl_ns: u64, warned: &Mutex<HashSet<PathBuf>>) -> Vec<Row> {
    let mut rows: Vec<(u64, u64, Row)> = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with("gixl.") && name.ends_with(".store")) {
            continue;
        }
        let path = e.path();
        match read_store(&path, ttl_ns) {
            Ok(Some(r)) => rows.push(r),
            Ok(None) => {}
            Err(why) => {
                if warned.lock().insert(path.clone()) {
                    log::warn(&format!("prometheus_mp: {} skipped: {why}", path.display()));
                }
            }
        }
    }
    rows.sort_by_key(|r| (r.0, r.1));
    rows.into_iter().map(|r| r.2).collect()
}

/// The row of one store file: None when it is stale (then removed), Err when it is not to be trusted.
///
/// The file is read into a buffer (`pread`), never mapped: a store that another process truncates or regrows
/// while it is read gives a short or inconsistent snapshot (skipped with a log line), where a mapping read past
/// the new end would kill this process with SIGBUS.
fn read_store(path: &Path, ttl_ns: u64) -> std::result::Result<Option<(u64, u64, Row)>, String> {
    use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| e.to_string())?;
    let m = f.metadata().map_err(|e| e.to_string())?;
    // SAFETY: plain syscall.
    let me = unsafe { libc::geteuid() };
    if !m.file_type().is_file() || m.uid() != me {
        return Err(format!("not a regular file of uid {me}"));
    }
    let len = m.len() as usize;
    if len == 0 {
        // Being created (not sized yet).
        return Ok(None);
    }
    if !(HEADER * 8..=MAX_FILE).contains(&len) {
        return Err(format!("{len} bytes is no store file"));
    }
    let mut buf = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match f.read_at(&mut buf[got..], got as u64) {
            Ok(0) => return Err(format!("truncated while read ({got} of {len} bytes)")),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    let w = |i: usize| u64::from_ne_bytes(buf[i * 8..i * 8 + 8].try_into().unwrap_or_default());
    if w(0) != MAGIC {
        // Not written yet (a process creating it) or not ours: nothing to serve.
        return Ok(None);
    }
    let nb = w(H_BOUNDS) as usize;
    let text_len = w(H_LABELS) as usize;
    if nb > MAX_BOUNDS || text_len > 3 * MAX_LABEL + 2 {
        return Err("header out of range".into());
    }
    let words = Layout::new(nb).words();
    let text_at = (HEADER + words) * 8;
    if text_at + text_len > len {
        return Err("shorter than its header says".into());
    }
    let (pid, start, instance, updated) = (w(H_PID), w(H_START), w(H_INSTANCE), w(H_UPDATED));
    let alive = i32::try_from(pid).ok().and_then(|p| crate::util::process_start_time(p).ok()) == Some(start);
    if !alive && crate::util::monotonic_ns().saturating_sub(updated) > ttl_ns {
        let _ = std::fs::remove_file(path);
        return Ok(None);
    }
    let bounds: Vec<f64> = (0..nb).map(|i| f64::from_bits(w(7 + i))).collect();
    if bounds.iter().any(|b| !b.is_finite()) || bounds.windows(2).any(|p| p[0] >= p[1]) {
        return Err("bad histogram bounds".into());
    }
    let text =
        std::str::from_utf8(&buf[text_at..text_at + text_len]).map_err(|_| "labels are not UTF-8".to_string())?;
    let mut it = text.split('\0');
    let (host, agent, rank) = (it.next().unwrap_or(""), it.next().unwrap_or(""), it.next().unwrap_or(""));
    let mut labels =
        format!("hostname=\"{}\",agent_name=\"{}\",pid=\"{pid}\",agent_instance=\"{instance}\"", esc(host), esc(agent));
    if !rank.is_empty() {
        labels.push_str(&format!(",local_rank=\"{}\"", esc(rank)));
    }
    let values: Vec<AtomicU64> = (0..words).map(|i| AtomicU64::new(w(HEADER + i))).collect();
    Ok(Some((pid, instance, Row::read(labels, &bounds, &values))))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another process's store truncated and regrown again and again while it is scraped: every read gives its
    /// row or a skip, never SIGBUS (a mapping read past the truncated end killed the exporting process).
    #[test]
    fn a_store_truncated_during_scrapes_is_skipped_not_fatal() {
        let dir = std::env::temp_dir().join(format!("gixl-mp-trunc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = Store::create(&dir, 7, &["h", "a", ""], &[10.0]).unwrap();
        let series = Series::new("a", vec![10.0], Some(s));
        series.record(super::super::MEM_REGISTERED, 512);
        let pid = std::process::id();
        let bytes = std::fs::read(dir.join(format!("gixl.{pid}.7.store"))).unwrap();
        drop(series);
        let _ = std::fs::remove_file(dir.join(format!("gixl.{pid}.7.store"))); // a clean end removes it already
                                                                               // A copy stands for another process's file: this process never maps it.
        let other = dir.join(format!("gixl.{pid}.8.store"));
        std::fs::write(&other, &bytes).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let churn = {
            let (stop, other, bytes) = (stop.clone(), other.clone(), bytes.clone());
            std::thread::spawn(move || {
                use std::os::unix::fs::FileExt;
                let f = std::fs::OpenOptions::new().write(true).open(&other).unwrap();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    f.set_len([0, 8, 100, HEADER as u64 * 8 + 16][n as usize % 4]).unwrap();
                    f.write_all_at(&bytes, 0).unwrap();
                    n += 1;
                }
                n
            })
        };
        let warned = Mutex::new(HashSet::new());
        let (mut rows, mut skips) = (0, 0);
        let until = std::time::Instant::now() + std::time::Duration::from_millis(500);
        while std::time::Instant::now() < until {
            match collect(&dir, u64::MAX, &warned).len() {
                1 => rows += 1,
                _ => skips += 1,
            }
        }
        stop.store(true, Ordering::Relaxed);
        let cycles = churn.join().unwrap();
        assert!(cycles > 10, "the file was truncated and regrown {cycles} times");
        assert!(rows + skips > 10, "{rows} rows, {skips} skips");
        // Whole again: served.
        assert_eq!(collect(&dir, u64::MAX, &warned).len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_store_is_read_back_and_a_dead_stale_one_is_reaped() {
        let dir = std::env::temp_dir().join(format!("gixl-mp-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = Store::create(&dir, 7, &["host\"x", "agent\nA", "3"], &[10.0, 100.0]).unwrap();
        let series = Series::new("agent\nA", vec![10.0, 100.0], Some(s));
        series.record(super::super::MEM_REGISTERED, 4096);
        series.record(super::super::XFER_TIME, 50);
        series.stale_refusal();
        let rows = collect(&dir, u64::MAX, &Mutex::new(HashSet::new()));
        assert_eq!(rows.len(), 1);
        let text = super::super::prom::render(&rows, false);
        let pid = std::process::id();
        let l = format!(
            "hostname=\"host\\\"x\",agent_name=\"agent\\nA\",pid=\"{pid}\",agent_instance=\"7\",local_rank=\"3\""
        );
        assert!(text.contains(&format!("agent_memory_registered_total{{{l}}} 4096\n")), "{text}");
        assert!(text.contains(&format!("agent_xfer_time_us_bucket{{{l},le=\"100\"}} 1\n")), "{text}");
        assert!(text.contains(&format!("agent_xfer_time_us_bucket{{{l},le=\"10\"}} 0\n")), "{text}");
        assert!(text.contains(&format!("gixl_stale_handle_refusals_total{{{l}}} 1\n")), "{text}");
        assert!(!text.contains("gixl_peer_info"), "{text}");
        // A file of a process that is not running (pid 0 never is), updated just now: kept within the TTL,
        // reaped past it.
        let path = dir.join(format!("gixl.{pid}.7.store"));
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(&0u64.to_le_bytes(), (H_PID * 8) as u64).unwrap();
        f.write_all_at(&crate::util::monotonic_ns().to_le_bytes(), (H_UPDATED * 8) as u64).unwrap();
        assert_eq!(collect(&dir, 60_000_000_000, &Mutex::new(HashSet::new())).len(), 1, "kept within the TTL");
        assert_eq!(collect(&dir, 0, &Mutex::new(HashSet::new())).len(), 0);
        assert!(!path.exists(), "the stale file is removed");
        drop(series);
        // A file that is not a store, and one with a bad header, are skipped.
        std::fs::write(dir.join("gixl.1.0.store"), b"short").unwrap();
        let warned = Mutex::new(HashSet::new());
        assert!(collect(&dir, u64::MAX, &warned).is_empty());
        assert_eq!(warned.lock().len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn labels_fit_what_a_reader_accepts() {
        let long = "é".repeat(MAX_LABEL);
        let l = label(&long);
        assert_eq!(l.len(), MAX_LABEL);
        assert!(l.chars().all(|c| c == 'é'));
        assert_eq!(label("a\0b"), "ab");
        let dir = std::env::temp_dir().join(format!("gixl-mp-unit3-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = Store::create(&dir, 0, &[&l, &l, &l], &[]).unwrap();
        assert_eq!(collect(&dir, u64::MAX, &Mutex::new(HashSet::new())).len(), 1, "served, not refused");
        drop(s);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_clean_end_removes_the_store() {
        let dir = std::env::temp_dir().join(format!("gixl-mp-unit2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = Store::create(&dir, 0, &["h", "a", ""], &[]).unwrap();
        let path = s.path.clone();
        assert!(path.exists());
        let rows = collect(&dir, u64::MAX, &Mutex::new(HashSet::new()));
        assert_eq!(rows.len(), 1);
        let text = super::super::prom::render(&rows, false);
        assert!(!text.contains("local_rank"), "no rank, no label: {text}");
        drop(s);
        assert!(!path.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
