//! The "POSIX" backend: moves data between this agent's DRAM and files it has open, asynchronously.
//!
//! As in NIXL, a request pairs a local DRAM list (prepped with `""`) with a FILE list prepped against the
//! agent's own name; FILE descriptors carry the file descriptor in `devId` and the file offset in `addr`.
//! READ moves file → memory, WRITE memory → file. Every descriptor becomes one or more I/Os, all queued by
//! one `post`, run by io_uring (`uring`) or, where io_uring is unavailable or `use_posix_aio` is set, by a
//! few threads doing `pread`/`pwrite` (`threads`). Completion is tracked without polling: `status` reads a state
//! the queue published (no system call), and requests progress whether or not anyone asks.
//!
//! Errors are never silent: a read that reaches the end of the file inside the requested range, `ENOSPC`,
//! `EBADF` and every other failed I/O end the request with `NIXL_ERR_BACKEND` and a message naming the fd,
//! offset and length. Short transfers that are not at the end of the file are retried for the rest.
//! Problems visible earlier are reported earlier: an fd that is not open at registration, a DRAM/FILE
//! mismatch, a write to a read-only fd or a misaligned `O_DIRECT` request at prep (`INVALID_PARAM`), and
//! an fd closed (or closed and reused for another file) since registration at post (`BACKEND`).
//!
//! Init parameters (NIXL's names and defaults; booleans and integers parsed as strictly as NIXL does):
//! - `use_uring`: require io_uring; creating the backend fails if the kernel refuses it.
//! - `use_posix_aio`: use the thread pool (glibc's POSIX AIO is a thread pool too).
//! - `use_aio`: Linux kernel AIO in NIXL; gixl has no libaio, so this means the default: io_uring if the
//!   kernel allows it, else the thread pool.
//! - `kernel_queue_size` (256): io_uring submission queue entries; the completion queue gets 4× (≥ 1024).
//! - `ios_pool_size` (65536): the most I/Os in the kernel at once (also bounded by the completion queue);
//!   the rest wait in a user-space backlog.
//!
//! At most one of the three `use_*` may be true. The thread pool has the agent's `num_workers` threads, or
//! up to 4. `get_backend_params` echoes the init parameters, as NIXL does.
//!
//! NIXL 1.5.1's path mode is supported: a FILE registration whose metaInfo is `<modes>:<path>` (`ro` or `rw`, then
//! `,direct`, `,sync`, `,noatime`, `,create`) makes the backend open the file itself; its devId is then the
//! caller's name for that file, unique among the backend's path-mode registrations (else
//! `NIXL_ERR_INVALID_PARAM`), and the descriptor is closed once the region is deregistered and no request uses it.
//!
//! Not done here: transfers to other agents and notifications (NIXL's POSIX has neither), registered buffers
//! and fixed files. The backend never opens or closes the caller's own file descriptors.

pub(crate) mod io;
mod threads;
mod uring;

use std::any::Any;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::{Backend, BackendInit, BackendXfer, Caps, LocalRegion, Params, RegionKey, Seg, XferOp, XferPlan};
use crate::mem::{MemType, RegDList, RegDesc};
use crate::status::{Error, Result, Status};
use io::{Op, Run, Work, MAX_IO};

/// NIXL 1.5.1's `get_plugin_params("POSIX")`.
pub fn default_params() -> Params {
    [
        ("ios_pool_size", "65536"),
        ("kernel_queue_size", "256"),
        ("use_aio", "false"),
        ("use_posix_aio", "false"),
        ("use_uring", "false"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

pub fn create(init: BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(Posix::new(init)?))
}

pub struct Posix {
    params: Params,
    queue: Arc<Queue>,
    path_ids: PathIds,
}

/// Whether this kernel gives the POSIX backend an io_uring (what `gixl doctor` reports); `Err` says why not,
/// and the backend then runs its I/O on a thread pool.
pub fn io_uring_available() -> std::io::Result<()> {
    uring::Ring::new(8, 8).map(drop)
}

impl Posix {
    pub(crate) fn new(init: BackendInit) -> Result<Posix> {
        Self::with_ring(init, uring::Ring::new)
    }

    /// `new`, with the io_uring constructor as a parameter so tests can play a kernel without io_uring.
    fn with_ring(init: BackendInit, new_ring: impl Fn(u32, u32) -> std::io::Result<uring::Ring>) -> Result<Posix> {
        let cfg = Config::parse(&init.params, init.num_workers)?;
        let ring = || new_ring(cfg.kernel_queue_size, cfg.ios_pool_size);
        let queue = match cfg.choice {
            Choice::Threads => Queue::Threads(threads::Pool::new(cfg.threads)),
            Choice::Uring => Queue::Uring(
                ring().map_err(|e| Error::os(Status::Backend, "use_uring is set but io_uring is unavailable", e))?,
            ),
            Choice::Auto => match ring() {
                Ok(r) => Queue::Uring(r),
                Err(_) => Queue::Threads(threads::Pool::new(cfg.threads)),
            },
        };
        Ok(Posix { params: init.params, queue: Arc::new(queue), path_ids: PathIds::default() })
    }

    /// "io_uring" or "threads": which queue runs this backend's I/O.
    pub fn queue_kind(&self) -> &'static str {
        match &*self.queue {
            Queue::Uring(_) => "io_uring",
            Queue::Threads(_) => "threads",
        }
    }

    /// `prep_xfer`, with the request's own type (the GDS backends run DRAM ↔ FILE through it).
    pub(crate) fn prep(&self, plan: XferPlan) -> Result<PosixXfer> {
        super::check_storage_plan("POSIX", "its own files", MemType::File, &plan)?;
        let files = plan
            .remote_keys
            .iter()
            .map(|k| k.clone().and_then(|k| (k as Arc<dyn Any + Send + Sync>).downcast::<FileReg>().ok()))
            .collect::<Option<Vec<Arc<FileReg>>>>()
            .ok_or_else(|| {
                Error::invalid_param("POSIX: a FILE region of this request was not registered with this backend")
            })?;
        let read = plan.op == XferOp::Read;
        let mut ops = Vec::with_capacity(plan.segs.len());
        for seg in &plan.segs {
            let f = files
                .get(seg.rreg as usize)
                .ok_or_else(|| Error::invalid_param("POSIX: segment refers to an unknown FILE region"))?;
            f.check(read, seg)?;
            cut(seg, f, &mut ops);
        }
        let work = Arc::new(Work { read, ops });
        Ok(PosixXfer { queue: self.queue.clone(), work, files, run: Mutex::new(None) })
    }

    /// The queue that runs this backend's file I/O (the GDS backends' staged path shares it).
    pub(crate) fn queue(&self) -> &Arc<Queue> {
        &self.queue
    }

    /// The devIds of this backend's path-mode FILE registrations (the GDS backends register through it).
    pub(crate) fn path_ids(&self) -> &PathIds {
        &self.path_ids
    }
}

impl Backend for Posix {
    fn name(&self) -> &'static str {
        "POSIX"
    }

    fn caps(&self) -> Caps {
        // NIXL's backend reports FILE before DRAM (its plugin lists them the other way round).
        Caps { local: true, remote: false, notif: false, mems: vec![MemType::File, MemType::Dram] }
    }

    fn params(&self) -> Params {
        self.params.clone()
    }

    fn register(&self, mem: MemType, desc: &RegDesc) -> Result<LocalRegion> {
        match mem {
            MemType::Dram => Ok(LocalRegion { public: Vec::new(), key: None }),
            MemType::File => {
                let key: RegionKey = Arc::new(FileReg::register(desc, &self.path_ids)?);
                Ok(LocalRegion { public: Vec::new(), key: Some(key) })
            }
            m => Err(Error::not_supported(format!("the POSIX backend does not handle {}", m.seg_name()))),
        }
    }

    fn deregister(&self, _mem: MemType, _desc: &crate::mem::Desc, key: Option<&RegionKey>) {
        if let Some(f) = key.and_then(|k| k.downcast_ref::<FileReg>()) {
            f.release(&self.path_ids);
        }
    }

    fn prep_xfer(&self, plan: XferPlan) -> Result<Box<dyn BackendXfer>> {
        Ok(Box::new(self.prep(plan)?))
    }

    /// For each descriptor, `stat` of the path in its metaInfo: `size`, `mode` and `mtime` (seconds) as
    /// decimal strings, or `None` when there is no path or `stat` fails. Like NIXL, the path is taken up to
    /// its first NUL byte, symbolic links are followed, and any memory type is accepted.
    fn query_mem(&self, descs: &RegDList) -> Result<Vec<Option<Params>>> {
        Ok(descs.iter().map(|d| file_info(&d.meta)).collect())
    }

    /// Storage speed is not known in advance; NIXL's POSIX backend does not estimate either.
    fn estimate_xfer_cost(&self, _plan_bytes: u64) -> Result<(i64, i64)> {
        Err(Error::not_supported("the POSIX backend does not estimate transfer costs"))
    }
}

/// Append the I/Os for segment `s` on file `f`, none longer than `MAX_IO`.
fn cut(s: &Seg, f: &FileReg, ops: &mut Vec<Op>) {
    let mut done = 0;
    while done < s.len {
        let n = (s.len - done).min(MAX_IO);
        ops.push(Op { fd: f.fd, buf: s.local + done, off: s.remote + done, len: n as u32, direct: f.direct.is_some() });
        done += n;
    }
}

fn file_info(meta: &[u8]) -> Option<Params> {
    let path = meta.split(|&b| b == 0).next().unwrap_or_default();
    if path.is_empty() {
        return None;
    }
    let md = std::fs::metadata(std::ffi::OsStr::from_bytes(path)).ok()?;
    let out = [("size", md.size().to_string()), ("mode", md.mode().to_string()), ("mtime", md.mtime().to_string())];
    Some(out.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

// ----- init parameters -----

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Choice {
    /// io_uring if the kernel allows it, else threads.
    Auto,
    Uring,
    Threads,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Config {
    choice: Choice,
    kernel_queue_size: u32,
    ios_pool_size: u32,
    threads: usize,
}

impl Config {
    fn parse(p: &Params, num_workers: u32) -> Result<Config> {
        let flag = |k: &str| p.get(k).map(|v| parse_bool(k, v)).transpose().map(|b| b.unwrap_or(false));
        let (uring, aio, posix_aio) = (flag("use_uring")?, flag("use_aio")?, flag("use_posix_aio")?);
        if [uring, aio, posix_aio].iter().filter(|&&b| b).count() > 1 {
            return Err(Error::backend("POSIX: use_aio, use_uring and use_posix_aio are mutually exclusive"));
        }
        let choice = if uring {
            Choice::Uring
        } else if posix_aio {
            Choice::Threads
        } else {
            Choice::Auto
        };
        let int = |k: &str, default: u32| match p.get(k) {
            None => Ok(default),
            Some(v) => parse_u32(k, v).map(|n| if n == 0 { default } else { n }),
        };
        let threads = match num_workers {
            0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).min(4),
            n => (n as usize).min(64),
        };
        Ok(Config {
            choice,
            kernel_queue_size: int("kernel_queue_size", 256)?,
            ios_pool_size: int("ios_pool_size", 65536)?,
            threads,
        })
    }
}

fn parse_bool(key: &str, v: &str) -> Result<bool> {
    super::param_bool("POSIX", key, v)
}

fn parse_u32(key: &str, v: &str) -> Result<u32> {
    let n = super::param_u64("POSIX", key, v)?;
    u32::try_from(n).map_err(|_| Error::backend(format!("POSIX: {key}='{v}' is out of range")))
}

// ----- registered files -----

/// What registration learned about a FILE region's file descriptor.
#[derive(Debug)]
pub(crate) struct FileReg {
    pub(crate) fd: RawFd,
    /// Identity of the open file, to notice the fd being closed and reused for another file.
    dev: u64,
    ino: u64,
    readable: bool,
    writable: bool,
    /// Set when the fd is open with `O_DIRECT`.
    pub(crate) direct: Option<DioAlign>,
    /// A regular file (not a pipe, socket or device): `pwrite`/`pread` at any offset work on it.
    pub(crate) regular: bool,
    /// Path mode: the descriptor the backend opened (closed when the last request using it is gone) and the
    /// devId it is known by.
    owned: Option<(std::os::fd::OwnedFd, u64)>,
}

/// The devIds of a backend's path-mode FILE registrations.
#[derive(Debug, Default)]
pub(crate) struct PathIds(Mutex<std::collections::HashSet<u64>>);

/// NIXL's path-mode FILE metaInfo, `<modes>:<path>`: `modes` is `ro` or `rw`, then any of `,direct`
/// (O_DIRECT), `,sync` (O_SYNC), `,noatime` (O_NOATIME), `,create` (O_CREAT, mode 0644). Anything else (an
/// unknown mode, an empty path, no colon) is not path mode: devId is then the caller's descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PathSpec {
    path: Vec<u8>,
    flags: i32,
    mode: libc::c_uint,
}

impl PathSpec {
    fn parse(meta: &[u8]) -> Option<PathSpec> {
        let colon = meta.iter().position(|&b| b == b':')?;
        let (modes, path) = (&meta[..colon], &meta[colon + 1..]);
        let mut tokens = modes.split(|&b| b == b',');
        let mut flags = match tokens.next()? {
            b"ro" => libc::O_RDONLY,
            b"rw" => libc::O_RDWR,
            _ => return None,
        };
        if path.is_empty() {
            return None;
        }
        let mut mode = 0;
        for t in tokens {
            flags |= match t {
                b"direct" => libc::O_DIRECT,
                b"sync" => libc::O_SYNC,
                b"noatime" => libc::O_NOATIME,
                b"create" => {
                    mode = 0o644;
                    libc::O_CREAT
                }
                _ => return None,
            };
        }
        Some(PathSpec { path: path.to_vec(), flags, mode })
    }
}

/// `O_DIRECT` alignment: buffer addresses to `mem`, file offsets and lengths to `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DioAlign {
    pub(crate) mem: u64,
    pub(crate) off: u64,
}

impl FileReg {
    pub(crate) fn probe(dev: u64) -> Result<FileReg> {
        let fd = RawFd::try_from(dev)
            .map_err(|_| Error::invalid_param(format!("FILE devId {dev} is not a file descriptor")))?;
        // SAFETY: F_GETFL only reads descriptor flags; an fd that is not open gives EBADF.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if fl < 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::os(Status::InvalidParam, format!("FILE devId {fd} is not an open file descriptor"), e));
        }
        if fl & libc::O_PATH != 0 {
            return Err(Error::invalid_param(format!(
                "fd {fd} was opened with O_PATH, which allows no reads or writes"
            )));
        }
        let st = fstat(fd).map_err(|e| Error::os(Status::InvalidParam, format!("fstat of fd {fd}"), e))?;
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            return Err(Error::invalid_param(format!("fd {fd} is a directory")));
        }
        let acc = fl & libc::O_ACCMODE;
        Ok(FileReg {
            fd,
            dev: st.st_dev,
            ino: st.st_ino,
            readable: acc == libc::O_RDONLY || acc == libc::O_RDWR,
            writable: acc == libc::O_WRONLY || acc == libc::O_RDWR,
            direct: (fl & libc::O_DIRECT != 0).then(|| dio_align(fd)),
            regular: st.st_mode & libc::S_IFMT == libc::S_IFREG,
            owned: None,
        })
    }

    /// A FILE registration: NIXL's path mode when the metaInfo asks for it (the file opened here, known by its
    /// devId, which must be unique among this backend's path-mode registrations: `ids`), else the caller's
    /// descriptor in devId.
    pub(crate) fn register(desc: &RegDesc, ids: &PathIds) -> Result<FileReg> {
        let Some(spec) = PathSpec::parse(&desc.meta) else { return FileReg::probe(desc.desc.dev) };
        let id = desc.desc.dev;
        let mut taken = ids.0.lock();
        if taken.contains(&id) {
            return Err(Error::invalid_param(format!(
                "path-mode FILE registration needs a unique devId per file; devId {id} is already registered"
            )));
        }
        let path = std::ffi::CString::new(spec.path.clone())
            .map_err(|_| Error::invalid_param("path-mode FILE registration: the path holds a NUL byte"))?;
        // SAFETY: a NUL-terminated path; the result is checked and owned below.
        let fd = unsafe { libc::open(path.as_ptr(), spec.flags | libc::O_CLOEXEC, spec.mode) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            let shown = String::from_utf8_lossy(&spec.path);
            return Err(Error::os(Status::Backend, format!("path-mode FILE registration: open of {shown}"), e));
        }
        // SAFETY: a descriptor just opened, owned by nobody else.
        let owned = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let mut reg = FileReg::probe(fd as u64)?;
        reg.owned = Some((owned, id));
        taken.insert(id);
        Ok(reg)
    }

    /// Deregistration: a path-mode devId may be registered again (the descriptor closes with the last user).
    pub(crate) fn release(&self, ids: &PathIds) {
        if let Some((_, id)) = &self.owned {
            ids.0.lock().remove(id);
        }
    }

    /// Can segment `s` be done on this file as prepped?
    pub(crate) fn check(&self, read: bool, s: &Seg) -> Result<()> {
        let fd = self.fd;
        if read && !self.readable {
            return Err(Error::invalid_param(format!("POSIX: fd {fd} is open write-only; a READ needs to read it")));
        }
        if !read && !self.writable {
            return Err(Error::invalid_param(format!("POSIX: fd {fd} is open read-only; a WRITE needs to write it")));
        }
        if !matches!(s.remote.checked_add(s.len), Some(end) if end <= i64::MAX as u64) {
            return Err(Error::invalid_param(format!(
                "POSIX: file range {:#x}+{} of fd {fd} is past the largest file offset",
                s.remote, s.len
            )));
        }
        if let Some(a) = self.direct {
            let aligned = |x: u64, to: u64| x.checked_rem(to) == Some(0);
            if !aligned(s.local, a.mem) || !aligned(s.remote, a.off) || !aligned(s.len, a.off) {
                return Err(Error::invalid_param(format!(
                    "POSIX: fd {fd} is open with O_DIRECT, which needs the buffer address aligned to {} bytes and the \
                     file offset and length to {} bytes; got buffer {:#x}, offset {}, length {}",
                    a.mem, a.off, s.local, s.remote, s.len
                )));
            }
        }
        Ok(())
    }

    /// A registration record for tests of other modules: fd `fd`, readable and writable, `O_DIRECT` with
    /// (memory, offset) alignment `direct`.
    #[cfg(test)]
    pub(crate) fn fake(fd: RawFd, direct: Option<(u64, u64)>) -> FileReg {
        let direct = direct.map(|(mem, off)| DioAlign { mem, off });
        FileReg { fd, dev: 0, ino: 0, readable: true, writable: true, direct, regular: true, owned: None }
    }

    /// Is the fd still open on the file that was registered?
    pub(crate) fn check_open(&self) -> Result<()> {
        let fd = self.fd;
        let st = fstat(fd).map_err(|e| match e.raw_os_error() {
            Some(libc::EBADF) => {
                Error::os(Status::Backend, format!("POSIX: fd {fd} was closed after it was registered"), e)
            }
            _ => Error::os(Status::Backend, format!("POSIX: fstat of fd {fd}"), e),
        })?;
        if (st.st_dev, st.st_ino) != (self.dev, self.ino) {
            return Err(Error::backend(format!(
                "POSIX: fd {fd} now refers to another file than the one registered (closed and reused?)"
            )));
        }
        Ok(())
    }
}

fn fstat(fd: RawFd) -> std::io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid out-pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// The kernel's direct-I/O alignment for `fd` (statx `STATX_DIOALIGN`, Linux 6.1+), else the classic 512.
fn dio_align(fd: RawFd) -> DioAlign {
    // SAFETY: an all-zero `statx` is a valid value of this plain C struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: an empty path with AT_EMPTY_PATH stats `fd` itself; `stx` is a valid out-pointer.
    let r = unsafe { libc::statx(fd, c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    if r == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 && stx.stx_dio_offset_align != 0 {
        DioAlign { mem: stx.stx_dio_mem_align.max(1) as u64, off: stx.stx_dio_offset_align as u64 }
    } else {
        DioAlign { mem: 512, off: 512 }
    }
}

// ----- requests -----

pub(crate) enum Queue {
    Uring(uring::Ring),
    Threads(threads::Pool),
}

impl Queue {
    /// A queue of one thread doing plain `pwrite`/`pread`, one run after another (started on first use).
    pub(crate) fn one_thread() -> Queue {
        Queue::Threads(threads::Pool::new(1))
    }

    pub(crate) fn start(&self, work: &Arc<Work>) -> Arc<Run> {
        match self {
            Queue::Uring(r) => {
                let run = Run::new(work.clone(), work.ops.len());
                r.start(run.clone());
                run
            }
            Queue::Threads(p) => {
                let run = Run::new(work.clone(), p.helpers(work.ops.len()));
                p.start(run.clone());
                run
            }
        }
    }

    pub(crate) fn abort(&self, run: &Run) {
        run.abort();
        if let Queue::Uring(r) = self {
            // The driver drops the run's queued I/Os when it next looks at the backlog.
            r.wake();
        }
    }
}

pub(crate) struct PosixXfer {
    queue: Arc<Queue>,
    work: Arc<Work>,
    /// The FILE regions this request touches, checked on every post.
    files: Vec<Arc<FileReg>>,
    run: Mutex<Option<Arc<Run>>>,
}

impl PosixXfer {
    /// The run of the last post, while one exists (what a deregistration waits for).
    pub(crate) fn current_run(&self) -> Option<Arc<Run>> {
        self.run.lock().clone()
    }
}

impl BackendXfer for PosixXfer {
    fn post(&self, notif: Option<&[u8]>) -> Result<Status> {
        if notif.is_some() {
            return Err(Error::backend("the POSIX backend cannot send notifications"));
        }
        let mut cur = self.run.lock();
        if cur.as_ref().is_some_and(|r| r.state() == Status::InProg) {
            return Err(Error::new(Status::RepostActive, "the previous post of this request is still in progress"));
        }
        for f in &self.files {
            f.check_open()?;
        }
        // Like NIXL, a started request answers IN_PROG even if it finishes at once: its outcome (success
        // or an I/O error) is always read with `status`. Only a request with no bytes is done here.
        let st = if self.work.ops.is_empty() { Status::Success } else { Status::InProg };
        *cur = Some(self.queue.start(&self.work));
        Ok(st)
    }

    fn status(&self) -> Result<Status> {
        let Some(run) = self.run.lock().clone() else { return Err(Error::new(Status::NotPosted, "not posted")) };
        match run.state() {
            s @ (Status::InProg | Status::Success) => Ok(s),
            _ => Err(run.error()),
        }
    }

    /// Stops queued I/O and waits for I/O already in the kernel or on a worker, so the caller may free
    /// the buffers as soon as this returns.
    fn abort(&self) -> bool {
        let Some(run) = self.run.lock().clone() else { return true };
        if run.state() == Status::InProg {
            self.queue.abort(&run);
            run.wait();
        }
        true
    }

    fn completed_at(&self) -> Option<Instant> {
        self.run.lock().as_ref().and_then(|r| r.done_at())
    }
}

impl Drop for PosixXfer {
    /// A request dropped while in flight (without `release`) still must not leave I/O touching its buffers.
    fn drop(&mut self) {
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::Write as _;
    use std::os::fd::AsRawFd;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::backend::Target;
    use crate::mem::Desc;

    fn params(kv: &[(&str, &str)]) -> Params {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn posix(kv: &[(&str, &str)]) -> Result<Posix> {
        Posix::new(BackendInit {
            agent_name: "t".into(),
            incarnation: 1,
            params: params(kv),
            num_workers: 0,
            overlap: None,
        })
    }

    /// The thread pool always; io_uring when this kernel allows it.
    fn both() -> Vec<Posix> {
        let mut v = vec![posix(&[("use_posix_aio", "true")]).unwrap()];
        match posix(&[("use_uring", "true")]) {
            Ok(p) => v.push(p),
            Err(e) => eprintln!("io_uring unavailable here, testing the thread pool only: {e}"),
        }
        v
    }

    fn tmp(tag: &str) -> PathBuf {
        static N: AtomicUsize = AtomicUsize::new(0);
        std::env::temp_dir().join(format!(
            "gixl-posix-{}-{tag}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ))
    }

    fn rw(path: &PathBuf) -> File {
        File::options().read(true).write(true).create(true).truncate(true).open(path).unwrap()
    }

    fn file_key(b: &Posix, fd: impl TryInto<u64>) -> Result<RegionKey> {
        let dev = fd.try_into().unwrap_or(u64::MAX);
        let r = b.register(MemType::File, &RegDesc { desc: Desc::new(0, 0, dev), meta: vec![] })?;
        Ok(r.key.expect("FILE regions have a key"))
    }

    /// One request: (memory address, file offset, length) per segment, all on `fd`.
    fn plan(op: XferOp, fd: RawFd, key: &RegionKey, segs: &[(u64, u64, u64)]) -> XferPlan {
        let segs: Vec<Seg> = segs
            .iter()
            .map(|&(local, remote, len)| Seg { local, remote, len, ldev: 0, rdev: fd as u64, lreg: 0, rreg: 0 })
            .collect();
        XferPlan {
            op,
            local_mem: MemType::Dram,
            remote_mem: MemType::File,
            total_bytes: segs.iter().map(|s| s.len).sum(),
            segs,
            local_keys: vec![None],
            remote_keys: vec![Some(key.clone())],
            target: Target::Local,
        }
    }

    fn wait(x: &dyn BackendXfer) -> Result<Status> {
        loop {
            match x.status()? {
                Status::InProg => std::thread::sleep(std::time::Duration::from_micros(50)),
                s => return Ok(s),
            }
        }
    }

    fn run(b: &Posix, p: XferPlan) -> Result<Status> {
        let x = b.prep_xfer(p)?;
        x.post(None)?;
        wait(&*x)
    }

    #[test]
    fn defaults_and_parameters_follow_nixl() {
        let d = default_params();
        assert_eq!(d.get("kernel_queue_size").map(String::as_str), Some("256"));
        assert_eq!(d.get("ios_pool_size").map(String::as_str), Some("65536"));
        assert_eq!(
            d.keys().collect::<Vec<_>>(),
            ["ios_pool_size", "kernel_queue_size", "use_aio", "use_posix_aio", "use_uring"]
        );

        let c = Config::parse(&default_params(), 3).unwrap();
        assert_eq!(c, Config { choice: Choice::Auto, kernel_queue_size: 256, ios_pool_size: 65536, threads: 3 });
        let c = Config::parse(
            &params(&[("use_uring", "YES"), ("use_aio", "off"), ("kernel_queue_size", "0"), ("bogus", "x")]),
            0,
        )
        .unwrap();
        assert_eq!((c.choice, c.kernel_queue_size), (Choice::Uring, 256));
        assert_eq!(Config::parse(&params(&[("use_posix_aio", "Enable")]), 0).unwrap().choice, Choice::Threads);
        assert_eq!(Config::parse(&params(&[("use_aio", "1")]), 0).unwrap().choice, Choice::Auto);
        assert_eq!(Config::parse(&params(&[("ios_pool_size", "4")]), 0).unwrap().ios_pool_size, 4);

        for bad in [
            &[("use_uring", "true"), ("use_aio", "y")][..],
            &[("use_uring", "maybe")],
            &[("use_uring", "")],
            &[("kernel_queue_size", " 12")],
            &[("kernel_queue_size", "12x")],
            &[("ios_pool_size", "-5")],
            &[("ios_pool_size", "99999999999")],
        ] {
            let e = Config::parse(&params(bad), 0).unwrap_err();
            assert_eq!(e.status(), Status::Backend, "{bad:?}: {e}");
            assert!(posix(bad).is_err());
        }

        let b = posix(&[("use_posix_aio", "true"), ("kernel_queue_size", "8")]).unwrap();
        assert_eq!(b.queue_kind(), "threads");
        assert_eq!(b.params(), params(&[("use_posix_aio", "true"), ("kernel_queue_size", "8")]), "params are echoed");
        assert_eq!(
            b.caps(),
            Caps { local: true, remote: false, notif: false, mems: vec![MemType::File, MemType::Dram] }
        );
        assert_eq!(b.estimate_xfer_cost(1).unwrap_err().status(), Status::NotSupported);
        assert_eq!(b.gen_notif(&Target::Local, b"x").unwrap_err().status(), Status::Backend);
    }

    #[test]
    fn without_io_uring_the_default_falls_back_and_use_uring_fails() {
        let init = |kv: &[(&str, &str)]| BackendInit {
            agent_name: "t".into(),
            incarnation: 1,
            params: params(kv),
            num_workers: 2,
            overlap: None,
        };
        let refuse = |_, _| Err(std::io::Error::from_raw_os_error(libc::EPERM));
        let b = Posix::with_ring(init(&[]), refuse).unwrap();
        assert_eq!(b.queue_kind(), "threads");
        assert_eq!(Posix::with_ring(init(&[("use_aio", "true")]), refuse).unwrap().queue_kind(), "threads");
        let e = Posix::with_ring(init(&[("use_uring", "true")]), refuse).err().unwrap();
        assert_eq!(e.status(), Status::Backend);
        assert!(e.message().contains("io_uring is unavailable"), "{e}");
        if let Ok(b) = posix(&[]) {
            eprintln!("default queue here: {}", b.queue_kind());
        }
    }

    #[test]
    fn registration_checks_the_file_descriptor() {
        let b = posix(&[("use_posix_aio", "true")]).unwrap();
        assert!(b
            .register(MemType::Dram, &RegDesc { desc: Desc::new(0x1000, 10, 0), meta: vec![] })
            .unwrap()
            .key
            .is_none());
        assert_eq!(b.register(MemType::Vram, &RegDesc::default()).err().unwrap().status(), Status::NotSupported);

        let path = tmp("reg");
        let f = rw(&path);
        let k = file_key(&b, f.as_raw_fd()).unwrap();
        let r = k.downcast_ref::<FileReg>().unwrap();
        assert!(r.readable && r.writable && r.direct.is_none());

        let e = file_key(&b, 1u64 << 40).unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam);
        let closed = File::open(&path).unwrap().as_raw_fd(); // dropped at once: the number is free
        let e = file_key(&b, closed).unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam);
        assert!(e.message().contains("not an open file descriptor"), "{e}");
        let dir = File::open(std::env::temp_dir()).unwrap();
        assert!(file_key(&b, dir.as_raw_fd()).unwrap_err().message().contains("directory"));
        let opath = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(&path).unwrap();
        assert!(file_key(&b, opath.as_raw_fd()).unwrap_err().message().contains("O_PATH"));
        let ro = File::open(&path).unwrap();
        let r = file_key(&b, ro.as_raw_fd()).unwrap();
        let r = r.downcast_ref::<FileReg>().unwrap();
        assert!(r.readable && !r.writable);
        std::fs::remove_file(path).unwrap();
    }

    use std::os::unix::fs::OpenOptionsExt;

    #[test]
    fn prep_refuses_what_cannot_work() {
        let b = posix(&[("use_posix_aio", "true")]).unwrap();
        let path = tmp("prep");
        let f = rw(&path);
        let fd = f.as_raw_fd();
        let k = file_key(&b, fd).unwrap();
        let buf = [0u8; 64];
        let a = buf.as_ptr() as u64;

        let mut p = plan(XferOp::Write, fd, &k, &[(a, 0, 64)]);
        p.remote_mem = MemType::Dram;
        assert_eq!(b.prep_xfer(p).err().unwrap().status(), Status::InvalidParam, "DRAM to DRAM");
        let mut p = plan(XferOp::Write, fd, &k, &[(a, 0, 64)]);
        (p.local_mem, p.remote_mem) = (MemType::File, MemType::Dram);
        assert!(b.prep_xfer(p).err().unwrap().message().contains("local list must be DRAM_SEG"));
        let mut p = plan(XferOp::Write, fd, &k, &[(a, 0, 64)]);
        p.remote_keys = vec![None];
        assert_eq!(b.prep_xfer(p).err().unwrap().status(), Status::InvalidParam, "no FILE key");
        let p = plan(XferOp::Read, fd, &k, &[(a, i64::MAX as u64 - 10, 64)]);
        assert!(b.prep_xfer(p).err().unwrap().message().contains("largest file offset"));

        let ro = File::open(&path).unwrap();
        let rk = file_key(&b, ro.as_raw_fd()).unwrap();
        assert!(b.prep_xfer(plan(XferOp::Read, ro.as_raw_fd(), &rk, &[(a, 0, 64)])).is_ok());
        let e = b.prep_xfer(plan(XferOp::Write, ro.as_raw_fd(), &rk, &[(a, 0, 64)])).err().unwrap();
        assert!(e.message().contains("read-only"), "{e}");

        // O_DIRECT alignment, checked against what registration recorded.
        let dk: RegionKey = Arc::new(FileReg {
            fd,
            dev: 0,
            ino: 0,
            readable: true,
            writable: true,
            direct: Some(DioAlign { mem: 512, off: 4096 }),
            regular: true,
            owned: None,
        });
        let al = 1 << 20;
        assert!(b.prep_xfer(plan(XferOp::Write, fd, &dk, &[(al + 512, 8192, 4096)])).is_ok());
        for bad in [(al + 8, 8192, 4096), (al, 8192 + 512, 4096), (al, 8192, 4000)] {
            let e = b.prep_xfer(plan(XferOp::Write, fd, &dk, &[bad])).err().unwrap();
            assert_eq!(e.status(), Status::InvalidParam);
            assert!(e.message().contains("O_DIRECT"), "{e}");
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn large_segments_are_cut_into_bounded_ios() {
        let f = FileReg::fake(9, None);
        let seg = |local, remote, len| Seg { local, remote, len, ldev: 0, rdev: 9, lreg: 0, rreg: 0 };
        let mut ops = Vec::new();
        cut(&seg(0x10000, 100, MAX_IO * 2 + 5), &f, &mut ops);
        cut(&seg(0x90000000, 7, 3), &f, &mut ops);
        cut(&seg(0x90000000, 7, 0), &f, &mut ops);
        assert_eq!(ops.iter().map(|o| o.len as u64).sum::<u64>(), MAX_IO * 2 + 8);
        assert_eq!(ops.len(), 4);
        assert_eq!((ops[1].buf, ops[1].off, ops[1].len as u64), (0x10000 + MAX_IO, 100 + MAX_IO, MAX_IO));
        assert_eq!((ops[2].off, ops[2].len, ops[2].fd), (100 + 2 * MAX_IO, 5, 9));
        assert_eq!(MAX_IO % 4096, 0, "cutting keeps O_DIRECT alignment");
        assert!(MAX_IO <= u32::MAX as u64);
    }

    #[test]
    fn round_trip_on_both_queues() {
        for b in both() {
            let path = tmp("rt");
            let f = rw(&path);
            let fd = f.as_raw_fd();
            let k = file_key(&b, fd).unwrap();
            // 300 pieces of 4000 bytes, written to the file in reverse order with gaps.
            let n = 300u64;
            let src: Vec<u8> = (0..n * 4000).map(|i| (i * 7 % 251) as u8).collect();
            let segs: Vec<_> = (0..n).map(|i| (src.as_ptr() as u64 + i * 4000, (n - 1 - i) * 5000, 4000)).collect();
            assert_eq!(run(&b, plan(XferOp::Write, fd, &k, &segs)).unwrap(), Status::Success, "{}", b.queue_kind());
            let on_disk = std::fs::read(&path).unwrap();
            assert_eq!(on_disk.len() as u64, (n - 1) * 5000 + 4000);
            assert_eq!(&on_disk[(n as usize - 1) * 5000..][..4000], &src[..4000]);

            let mut dst = vec![0u8; src.len()];
            let segs: Vec<_> = (0..n).map(|i| (dst.as_mut_ptr() as u64 + i * 4000, (n - 1 - i) * 5000, 4000)).collect();
            let x = b.prep_xfer(plan(XferOp::Read, fd, &k, &segs)).unwrap();
            assert_eq!(x.status().unwrap_err().status(), Status::NotPosted);
            for _ in 0..2 {
                dst.iter_mut().for_each(|b| *b = 0);
                assert_eq!(x.post(None).unwrap(), Status::InProg);
                assert_eq!(wait(&*x).unwrap(), Status::Success);
                assert!(dst == src, "{}", b.queue_kind());
                assert!(x.completed_at().is_some());
            }
            assert!(x.post(Some(b"n")).is_err(), "no notifications");
            drop(f);
            std::fs::remove_file(path).unwrap();
        }
    }

    #[test]
    fn read_past_end_of_file_is_an_error_not_a_short_success() {
        for b in both() {
            let path = tmp("eof");
            let mut f = rw(&path);
            f.write_all(&[5u8; 6000]).unwrap();
            let k = file_key(&b, f.as_raw_fd()).unwrap();
            let mut dst = vec![0u8; 8192];
            let a = dst.as_mut_ptr() as u64;
            let e =
                run(&b, plan(XferOp::Read, f.as_raw_fd(), &k, &[(a, 0, 4096), (a + 4096, 4096, 4096)])).unwrap_err();
            assert_eq!(e.status(), Status::Backend);
            assert!(
                e.message().contains("short read") && e.message().contains("ends at offset 6000"),
                "{}: {e}",
                b.queue_kind()
            );
            let e = run(&b, plan(XferOp::Read, f.as_raw_fd(), &k, &[(a, 1 << 20, 10)])).unwrap_err();
            assert!(e.message().contains("short read"), "{e}");
            assert_eq!(&dst[..6000 - 4096 + 4096], &[5u8; 6000][..]);
            std::fs::remove_file(path).unwrap();
        }
    }

    #[test]
    fn no_space_and_closed_files_fail_the_request() {
        for b in both() {
            let full = File::options().write(true).open("/dev/full").unwrap();
            let k = file_key(&b, full.as_raw_fd()).unwrap();
            let src = vec![1u8; 4096];
            let e = run(&b, plan(XferOp::Write, full.as_raw_fd(), &k, &[(src.as_ptr() as u64, 0, 4096)])).unwrap_err();
            assert_eq!(e.status(), Status::Backend);
            assert!(e.message().contains("No space left on device"), "{}: {e}", b.queue_kind());

            // Closed after registration: refused at post, before any I/O.
            let path = tmp("closed");
            let f = rw(&path);
            let fd = f.as_raw_fd();
            let k = file_key(&b, fd).unwrap();
            let x = b.prep_xfer(plan(XferOp::Write, fd, &k, &[(src.as_ptr() as u64, 0, 4096)])).unwrap();
            drop(f);
            let e = x.post(None).unwrap_err();
            assert_eq!(e.status(), Status::Backend);
            assert!(e.message().contains("closed after it was registered"), "{e}");
            // ... and reused for another file.
            let other_path = tmp("other");
            let other = rw(&other_path);
            if other.as_raw_fd() == fd {
                assert!(x.post(None).unwrap_err().message().contains("another file"));
            }
            std::fs::remove_file(other_path).unwrap();
            std::fs::remove_file(path).unwrap();

            // A descriptor that goes bad under the queue itself: EBADF from the I/O.
            let w = Arc::new(Work {
                read: false,
                ops: vec![Op { fd: -1, buf: src.as_ptr() as u64, off: 0, len: 10, direct: false }],
            });
            let r = b.queue.start(&w);
            r.wait();
            let e = r.error();
            assert_eq!(e.status(), Status::Backend);
            assert!(e.message().contains("Bad file descriptor") && e.message().contains("closed"), "{e}");
        }
    }

    #[test]
    fn abort_waits_for_io_in_the_kernel() {
        // A read from an empty pipe stays in flight until someone writes: only io_uring can do that at an offset.
        let Ok(b) = posix(&[("use_uring", "true")]) else {
            crate::util::test_skip("io_uring", "io_uring unavailable here");
            return;
        };
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let k = file_key(&b, fds[0]).unwrap();
        let mut dst = vec![0u8; 4];
        let x = Arc::new(b.prep_xfer(plan(XferOp::Read, fds[0], &k, &[(dst.as_mut_ptr() as u64, 0, 4)])).unwrap());
        assert_eq!(x.post(None).unwrap(), Status::InProg);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(x.status().unwrap(), Status::InProg);
        assert_eq!(x.post(None).unwrap_err().status(), Status::RepostActive);
        let aborted = Arc::new(AtomicUsize::new(0));
        let t = {
            let (x, aborted) = (x.clone(), aborted.clone());
            std::thread::spawn(move || {
                assert!(x.abort());
                aborted.store(1, Ordering::SeqCst);
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(aborted.load(Ordering::SeqCst), 0, "abort returned while the read was still in the kernel");
        // SAFETY: writes 4 bytes from a live array to the pipe we created.
        assert_eq!(unsafe { libc::write(fds[1], b"gixl".as_ptr().cast(), 4) }, 4);
        t.join().unwrap();
        assert_eq!(&dst, b"gixl");
        assert_ne!(x.status().ok(), Some(Status::InProg));
        drop(x);
        // SAFETY: closing the pipe ends we opened.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
    }

    #[test]
    fn abort_of_a_queued_request_does_not_wait_behind_others() {
        // One I/O in flight at most: a read from an empty pipe holds it, so the next request stays queued.
        let Ok(b) = posix(&[("use_uring", "true"), ("ios_pool_size", "1")]) else { return };
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let pk = file_key(&b, fds[0]).unwrap();
        let mut dst = [0u8; 4];
        let blocked = b.prep_xfer(plan(XferOp::Read, fds[0], &pk, &[(dst.as_mut_ptr() as u64, 0, 4)])).unwrap();
        blocked.post(None).unwrap();
        let path = tmp("queued");
        let f = rw(&path);
        let k = file_key(&b, f.as_raw_fd()).unwrap();
        let src = [7u8; 512];
        let queued = b.prep_xfer(plan(XferOp::Write, f.as_raw_fd(), &k, &[(src.as_ptr() as u64, 0, 512)])).unwrap();
        queued.post(None).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(queued.status().unwrap(), Status::InProg, "waits for the in-flight slot");
        assert!(queued.abort());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0, "the aborted write never started");
        assert_eq!(blocked.status().unwrap(), Status::InProg);
        // SAFETY: writes 4 bytes from a live array to the pipe we created.
        assert_eq!(unsafe { libc::write(fds[1], b"done".as_ptr().cast(), 4) }, 4);
        assert_eq!(wait(&*blocked).unwrap(), Status::Success);
        assert_eq!(&dst, b"done");
        // The slot is free again: the aborted request can be posted anew.
        queued.post(None).unwrap();
        assert_eq!(wait(&*queued).unwrap(), Status::Success);
        assert_eq!(std::fs::read(&path).unwrap(), src);
        // SAFETY: closing the pipe ends we opened.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn many_requests_share_a_small_ring() {
        // More I/Os than the in-flight limit, from several requests at once.
        let Ok(b) = posix(&[("use_uring", "true"), ("kernel_queue_size", "4"), ("ios_pool_size", "3")]) else { return };
        let path = tmp("small");
        let f = rw(&path);
        let k = file_key(&b, f.as_raw_fd()).unwrap();
        let src: Vec<u8> = (0..64 * 512).map(|i| (i % 241) as u8).collect();
        let xs: Vec<_> = (0..4u64)
            .map(|r| {
                let segs: Vec<_> =
                    (0..16u64).map(|i| (src.as_ptr() as u64 + (r * 16 + i) * 512, (r * 16 + i) * 512, 512)).collect();
                b.prep_xfer(plan(XferOp::Write, f.as_raw_fd(), &k, &segs)).unwrap()
            })
            .collect();
        for x in &xs {
            x.post(None).unwrap();
        }
        for x in &xs {
            assert_eq!(wait(&**x).unwrap(), Status::Success);
        }
        assert!(std::fs::read(&path).unwrap() == src);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn path_mode_metainfo_is_parsed_as_nixl_does() {
        let p = |m: &str| PathSpec::parse(m.as_bytes()).map(|s| (String::from_utf8(s.path).unwrap(), s.flags, s.mode));
        assert_eq!(p("ro:/a/b"), Some(("/a/b".into(), libc::O_RDONLY, 0)));
        assert_eq!(p("rw,direct,sync:/x:y"), Some(("/x:y".into(), libc::O_RDWR | libc::O_DIRECT | libc::O_SYNC, 0)));
        assert_eq!(
            p("rw,create,noatime:rel"),
            Some(("rel".into(), libc::O_RDWR | libc::O_CREAT | libc::O_NOATIME, 0o644))
        );
        for not_path_mode in ["", "/plain/path", "wr:/x", "rw:", "rw,fast:/x", "RW:/x", "rw ,direct:/x"] {
            assert_eq!(p(not_path_mode), None, "{not_path_mode}");
        }
    }

    #[test]
    fn path_mode_registration_opens_the_file_and_needs_a_unique_devid() {
        let b = posix(&[("use_posix_aio", "true")]).unwrap();
        let path = tmp("pathmode");
        let reg = |dev: u64, meta: String| {
            b.register(MemType::File, &RegDesc { desc: Desc::new(0, 0, dev), meta: meta.into_bytes() })
        };
        let r = reg(7000, format!("rw,create:{}", path.display())).unwrap().key.unwrap();
        assert!(path.exists(), "create opened and made the file");
        let e = reg(7000, format!("rw:{}", path.display())).err().unwrap();
        assert_eq!(e.status(), Status::InvalidParam, "{e}");
        let e = reg(7001, "ro:/nonexistent/gixl".into()).err().unwrap();
        assert_eq!(e.status(), Status::Backend, "{e}");
        // A WRITE through the devId the caller chose (never an fd of this process).
        let src = [9u8; 4096];
        let x = b.prep_xfer(plan(XferOp::Write, 7000, &r, &[(src.as_ptr() as u64, 0, 4096)])).unwrap();
        assert_eq!(x.post(None).unwrap(), Status::InProg);
        assert_eq!(wait(&*x).unwrap(), Status::Success);
        assert_eq!(std::fs::read(&path).unwrap(), src);
        // Deregistered: the devId is free again; the descriptor closes with the last request using it.
        let fd = r.downcast_ref::<FileReg>().unwrap().fd;
        b.deregister(MemType::File, &Desc::new(0, 0, 7000), Some(&r));
        assert!(reg(7000, format!("ro:{}", path.display())).is_ok());
        drop(x);
        drop(r);
        let md = std::fs::metadata(&path).unwrap();
        let still_ours = fstat(fd).is_ok_and(|st| (st.st_dev, st.st_ino) == (md.dev(), md.ino()));
        assert!(!still_ours, "the backend's descriptor outlived its registration and requests");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn query_mem_stats_paths() {
        let b = posix(&[("use_posix_aio", "true")]).unwrap();
        let path = tmp("q");
        std::fs::write(&path, [0u8; 1234]).unwrap();
        let md = std::fs::metadata(&path).unwrap();
        let mut with_nul = path.as_os_str().as_bytes().to_vec();
        with_nul.extend_from_slice(b"\0ignored");
        let descs = RegDList::with_descs(
            MemType::File,
            [
                path.as_os_str().as_bytes().to_vec(),
                b"/nonexistent/x".to_vec(),
                vec![],
                with_nul,
                format!("rw:{}", path.display()).into_bytes(),
            ]
            .into_iter()
            .map(|meta| RegDesc { desc: Desc::default(), meta })
            .collect(),
        );
        let r = b.query_mem(&descs).unwrap();
        let want = params(&[("size", "1234"), ("mode", &md.mode().to_string()), ("mtime", &md.mtime().to_string())]);
        assert_eq!(r, vec![Some(want.clone()), None, None, Some(want), None]);
        assert_eq!(md.mode() & libc::S_IFMT, libc::S_IFREG, "mode carries the file type bits, like st_mode");
        std::fs::remove_file(path).unwrap();
    }
}
