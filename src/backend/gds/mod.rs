//! The "GDS" and "GDS_MT" backends: move data between this agent's GPU memory (VRAM) or DRAM and files it
//! has open, as NIXL's GPUDirect Storage plugins do, with or without GPUDirect Storage itself.
//!
//! Descriptors are NIXL's: a FILE descriptor carries the file descriptor in `devId` and the file offset in
//! `addr`; the memory list is VRAM or DRAM. Either list may be the FILE one (NIXL's plugins accept both
//! orders); both are prepped against this agent (`""` and its own name). READ moves file → memory, WRITE
//! memory → file.
//!
//! - DRAM ↔ FILE is the POSIX backend's request, run by a POSIX backend this one owns (io_uring, or the
//!   thread pool): same checks, same statuses, same messages.
//! - VRAM ↔ FILE is staged: the request is cut into pieces of one slot each (slots of page-locked host memory,
//!   cut from buffers of the engine's one staging pool, sized per request for about [`PIECES`] pieces, at most
//!   [`SLOT`] bytes), and the device copy of one piece overlaps the file I/O of the others (WRITE: device →
//!   slot, then the slot's writes are queued while the next piece is copied; READ: the reads of several slots
//!   are queued, each slot copied to the device once its reads are done, then refilled). The file I/O is the
//!   POSIX backend's queue, except a WRITE's writes to regular files without `O_DIRECT`: those are plain
//!   `pwrite`s on a writer thread per file (by fd, one of `thread_count`), see [`Core::write_queue`].
//!   `O_DIRECT` files are honoured: file offsets and lengths are checked for the kernel's alignment at prep
//!   (`NIXL_ERR_INVALID_PARAM`), and slot positions are aligned so the I/O from host memory is valid.
//! - VRAM ↔ FILE is direct (cuFile) only where cuFile proved itself in this process ([`cufile`]: loaded,
//!   driver open, self-test passed; asked at the first VRAM registration); otherwise staged, the reason logged
//!   once and shown by `gixl doctor`. Direct: VRAM regions are registered with cuFile at registration, files at
//!   the first VRAM request on them (a file cuFile refuses is staged); a post's descriptors become synchronous
//!   `cuFileRead`/`cuFileWrite` calls of at most [`DIRECT_CHUNK`] bytes, shared in order among the driver
//!   threads.
//!
//! Lifetime: a post first checks that every file is still open on the file registered (`NIXL_ERR_BACKEND`
//! otherwise) and that no region of the request was deregistered (`NIXL_ERR_NOT_FOUND`); both before any byte
//! moves. `deregister_memory` and agent destruction mark their regions retired, then wait (at most
//! [`RETIRE_WAIT`]) for the posts in flight on them: a staged post stops at its next piece and a direct one
//! before its next cuFile call, and fails `NIXL_ERR_NOT_FOUND`; a DRAM post finishes its I/O. Then the cuFile
//! registrations of the regions are released (or, after a wait that ran out, when the last request holding
//! them goes). Errors of the code shared with POSIX name this backend.
//!
//! Init parameters: NIXL's plugins report none by default. GDS reads `batch_pool_size`, `batch_limit` and
//! `max_request_size` (cuFile batch sizes), GDS_MT `thread_count`; all are checked to be unsigned integers and
//! otherwise have no effect on the staged path, except `thread_count`, the number of threads that drive staged
//! requests (default half the CPUs, at least 1; GDS uses the same default). The POSIX backend's queue
//! options (`use_uring`, `use_posix_aio`, `kernel_queue_size`, `ios_pool_size`) are also read, a gixl
//! addition, to choose the queue that runs the file I/O.
//!
//! FILE registration is the POSIX backend's, NIXL 1.5.1's path mode (`"rw,create:/path"` in metaInfo) included.
//!
//! Not done here: cuFile's batch and stream APIs (`batch_limit` etc. are read but unused); notifications and
//! transfers to other agents (NIXL's GDS plugins have neither).

mod cufile;

use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::engine::pool::Pool;
use super::engine::vram::Staging;
use super::posix::io::{Failure, IoFail, Op, Run, Work};
use super::posix::{FileReg, Posix, PosixXfer, Queue};
use super::{Backend, BackendInit, BackendXfer, Caps, LocalRegion, Params, RegionKey, Seg, Target, XferOp, XferPlan};
use crate::device::{self, Device};
use crate::mem::{Desc, MemType, RegDList, RegDesc};
use crate::status::{Error, Result, Status};

pub use cufile::{direct_path, staged_reason};
use cufile::{BufReg, CuFile, FileHandle};

/// Bytes of one staging slot at most: one piece of a staged request.
pub const SLOT: u64 = 2 << 20;

/// Bytes of one staging slot at least (unless the request is smaller).
pub const MIN_SLOT: u64 = 256 << 10;

/// A staged request is cut into about this many pieces (slots of [`MIN_SLOT`] to [`SLOT`] bytes). The pipeline
/// cannot hide the first piece's device copy (WRITE) or the last one's (READ), nor the first piece's file I/O
/// (READ): with 32 pieces that is about 3 % of the copy; larger slots cost fewer kernel entries per byte.
const PIECES: u64 = 32;

/// The slot size for a staged request of `total` bytes whose files need slot positions aligned to `align`.
fn slot_size(total: u64, align: u64) -> u64 {
    let want = (total / PIECES).clamp(MIN_SLOT, SLOT);
    // A power of two, so that slots cut from a page-aligned buffer stay aligned.
    let p = if want.is_power_of_two() { want } else { want.next_power_of_two() / 2 };
    p.max(align.next_power_of_two()).min(SLOT)
}

/// Staging buffers (of the engine's pool) one staged post uses at most; each gives several slots.
const BUFFERS: usize = 2;

/// A direct (cuFile) request's descriptors are cut into calls of at most this many bytes: the driver threads
/// share them, and a deregistration is seen between them.
pub const DIRECT_CHUNK: u64 = 16 << 20;

/// How long `deregister_memory` and agent destruction wait for posts in flight on the regions they retire.
pub const RETIRE_WAIT: Duration = Duration::from_secs(10);

/// NIXL 1.5.1's `get_plugin_params` for GDS and GDS_MT: no default options.
pub fn default_params() -> Params {
    Params::new()
}

pub fn create_gds(init: BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(Gds::new("GDS", init)?))
}

pub fn create_gds_mt(init: BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(Gds::new("GDS_MT", init)?))
}

pub struct Gds {
    name: &'static str,
    params: Params,
    /// DRAM ↔ FILE requests, and the queue of the staged path's file I/O.
    posix: Posix,
    core: Arc<Core>,
}

/// What the backend and its requests share.
struct Core {
    name: &'static str,
    queue: Arc<Queue>,
    /// Threads that drive staged posts (copies, then I/O; I/O, then copies) and make direct posts' cuFile calls.
    drivers: Pool,
    threads: usize,
    /// Staged WRITEs to files without `O_DIRECT`: one thread each doing plain `pwrite`s, a slot's writes at a
    /// time; a file's writes always go to the same one (by its fd), so they never contend for the file.
    writers: Vec<Arc<Queue>>,
    /// Posts that may still be running, with the regions they touch. Pruned as they are seen finished.
    active: Mutex<Active>,
}

#[derive(Default)]
struct Active {
    closed: bool,
    posts: Vec<(Arc<Run>, Vec<Arc<Region>>)>,
}

/// A region registered with this backend.
struct Region {
    /// Set by deregistration and agent destruction: no post may start on it any more.
    retired: AtomicBool,
    kind: Kind,
    /// VRAM where the direct path is taken: the region registered with cuFile (None where cuFile refused it:
    /// then cuFile is given the plain device pointer).
    cubuf: Option<BufReg>,
    /// FILE where the direct path is taken: the fd registered with cuFile at the first VRAM request on it (None
    /// where cuFile refused it: such requests are staged).
    cufh: OnceLock<Option<Arc<FileHandle>>>,
}

impl Region {
    /// Release what cuFile holds for this region (once no I/O uses it).
    fn release_cufile(&self) {
        if let Some(b) = &self.cubuf {
            b.deregister();
        }
        if let Some(Some(h)) = self.cufh.get() {
            h.deregister();
        }
    }
}

enum Kind {
    Dram,
    Vram { dev: u32 },
    File(Arc<FileReg>),
}

impl Gds {
    fn new(name: &'static str, init: BackendInit) -> Result<Gds> {
        let threads = parse(name, &init.params)?;
        let posix = Posix::new(init.clone())?;
        let core = Arc::new(Core {
            name,
            queue: posix.queue().clone(),
            drivers: Pool::new(threads),
            threads,
            writers: (0..threads).map(|_| Arc::new(Queue::one_thread())).collect(),
            active: Mutex::new(Active::default()),
        });
        Ok(Gds { name, params: init.params, posix, core })
    }

    /// "staged" or "cufile": how VRAM ↔ FILE requests move their data here (asking runs cuFile's self-test
    /// if nothing did yet).
    pub fn vram_path(&self) -> &'static str {
        if staged_reason().is_some() {
            "staged"
        } else {
            "cufile"
        }
    }

    /// "io_uring" or "threads": the queue that runs the file I/O.
    pub fn queue_kind(&self) -> &'static str {
        self.posix.queue_kind()
    }
}

/// Check the parameters NIXL's plugins read; the number of driver threads.
fn parse(name: &str, p: &Params) -> Result<usize> {
    let keys: &[&str] =
        if name == "GDS" { &["batch_pool_size", "batch_limit", "max_request_size"] } else { &["thread_count"] };
    for k in keys {
        if let Some(v) = p.get(*k) {
            super::param_u64(name, k, v)?;
        }
    }
    let default = std::thread::available_parallelism().map(|n| n.get() / 2).unwrap_or(1).max(1);
    let threads = match p.get("thread_count").filter(|_| name == "GDS_MT") {
        Some(v) => match super::param_u64(name, "thread_count", v)? {
            0 => default,
            n => n.min(256) as usize,
        },
        None => default,
    };
    Ok(threads)
}

impl Backend for Gds {
    fn name(&self) -> &'static str {
        self.name
    }

    fn caps(&self) -> Caps {
        Caps { local: true, remote: false, notif: false, mems: vec![MemType::Dram, MemType::Vram, MemType::File] }
    }

    fn params(&self) -> Params {
        self.params.clone()
    }

    fn register(&self, mem: MemType, desc: &RegDesc) -> Result<LocalRegion> {
        let mut cubuf = None;
        let kind = match mem {
            MemType::Dram => Kind::Dram,
            MemType::Vram => {
                let d = desc.desc;
                let info = device::get()?.pointer_info(d.addr)?;
                if d.addr.checked_add(d.len).is_none_or(|end| end > info.base + info.size) {
                    return Err(Error::invalid_param(format!(
                        "{}: VRAM {:#x}+{} runs past the end of its allocation ({:#x}+{})",
                        self.name, d.addr, d.len, info.base, info.size
                    )));
                }
                // The first VRAM registration decides (once per process) whether cuFile is used.
                if let Some(lib) = cufile::api() {
                    cubuf = register_buf(self.name, lib, info.dev, d.addr, d.len);
                }
                Kind::Vram { dev: info.dev }
            }
            MemType::File => {
                let f = FileReg::register(desc, self.posix.path_ids()).map_err(|e| ours(self.name, e))?;
                Kind::File(Arc::new(f))
            }
            m => {
                return Err(Error::not_supported(format!("the {} backend does not handle {}", self.name, m.seg_name())))
            }
        };
        let key: RegionKey = Arc::new(Region { retired: AtomicBool::new(false), kind, cubuf, cufh: OnceLock::new() });
        Ok(LocalRegion { public: Vec::new(), key: Some(key) })
    }

    fn deregister_many(&self, _mem: MemType, regions: &[(Desc, Option<RegionKey>)]) {
        let gone: Vec<Arc<Region>> = regions.iter().filter_map(|(_, k)| region(k.as_ref())).collect();
        let idle = self.core.retire(Some(&gone));
        for r in &gone {
            // cuFile lets go of the memory and the fd now, unless I/O may still use them (then when the last
            // request holding the region is released).
            if idle {
                r.release_cufile();
            }
            if let Kind::File(f) = &r.kind {
                f.release(self.posix.path_ids());
            }
        }
    }

    fn prep_xfer(&self, plan: XferPlan) -> Result<Box<dyn BackendXfer>> {
        let name = self.name;
        if let Target::Remote(_) = plan.target {
            return Err(Error::not_supported(format!(
                "the {name} backend moves data between this agent's memory and its own files only"
            )));
        }
        // (memory type, whether the FILE list is the local one)
        let (mem, swapped) = match (plan.local_mem, plan.remote_mem) {
            (m @ (MemType::Dram | MemType::Vram), MemType::File) => (m, false),
            (MemType::File, m @ (MemType::Dram | MemType::Vram)) => (m, true),
            (l, r) => {
                return Err(Error::invalid_param(format!(
                    "{name}: only I/O between memory (DRAM_SEG or VRAM_SEG) and files (FILE_SEG) is supported, \
                     got {} and {}",
                    l.seg_name(),
                    r.seg_name()
                )))
            }
        };
        let (mem_keys, file_keys) =
            if swapped { (&plan.remote_keys, &plan.local_keys) } else { (&plan.local_keys, &plan.remote_keys) };
        let not_ours = || Error::invalid_param(format!("{name}: a region of this request was not registered with it"));
        let mem_regs: Vec<Arc<Region>> =
            mem_keys.iter().map(|k| region(k.as_ref())).collect::<Option<_>>().ok_or_else(not_ours)?;
        let file_regs: Vec<Arc<Region>> =
            file_keys.iter().map(|k| region(k.as_ref())).collect::<Option<_>>().ok_or_else(not_ours)?;
        let files: Vec<Arc<FileReg>> = file_regs
            .iter()
            .map(|r| match &r.kind {
                Kind::File(f) => Some(f.clone()),
                _ => None,
            })
            .collect::<Option<_>>()
            .ok_or_else(not_ours)?;
        // Segments as (memory address, file offset), whichever list was local.
        let segs: Vec<Seg> = plan
            .segs
            .iter()
            .map(|s| {
                if swapped {
                    Seg {
                        local: s.remote,
                        remote: s.local,
                        len: s.len,
                        ldev: s.rdev,
                        rdev: s.ldev,
                        lreg: s.rreg,
                        rreg: s.lreg,
                    }
                } else {
                    *s
                }
            })
            .collect();
        let regions: Vec<Arc<Region>> = mem_regs.iter().chain(&file_regs).cloned().collect();
        let files_of = |s: &Seg| {
            files.get(s.rreg as usize).ok_or_else(|| Error::invalid_param(format!("{name}: unknown FILE region")))
        };
        if mem == MemType::Dram {
            let p = XferPlan {
                op: plan.op,
                local_mem: MemType::Dram,
                remote_mem: MemType::File,
                segs,
                local_keys: vec![None; mem_regs.len()],
                remote_keys: files.iter().map(|f| Some(f.clone() as RegionKey)).collect(),
                target: Target::Local,
                total_bytes: plan.total_bytes,
            };
            let x = self.posix.prep(p).map_err(|e| ours(name, e))?;
            return Ok(Box::new(GdsXfer { core: self.core.clone(), regions, files, how: How::Posix(x) }));
        }
        let read = plan.op == XferOp::Read;
        if let Some(d) = self.direct(read, &segs, &mem_regs, &file_regs)? {
            return Ok(Box::new(GdsXfer {
                core: self.core.clone(),
                regions,
                files,
                how: How::Direct { direct: Arc::new(d), run: Mutex::new(None) },
            }));
        }
        // O_DIRECT files need slots of at least their alignment.
        let align = files.iter().filter_map(|f| f.direct).map(|a| a.mem.max(a.off).max(4096)).max().unwrap_or(0);
        let total: u64 = segs.iter().map(|s| s.len).sum();
        let mut pieces = Pieces::new(slot_size(total, align));
        for s in &segs {
            let f = files_of(s)?;
            // The VRAM address is never given to the kernel: only the file side must be aligned.
            f.check(read, &Seg { local: 0, ..*s }).map_err(|e| ours(self.name, e))?;
            let dev = match mem_regs.get(s.lreg as usize).map(|r| &r.kind) {
                Some(Kind::Vram { dev }) => *dev,
                _ => return Err(not_ours()),
            };
            pieces.add(s, dev, f)?;
        }
        let slot = pieces.slot;
        let staged = Arc::new(Staged { read, slot, pieces: pieces.done() });
        Ok(Box::new(GdsXfer {
            core: self.core.clone(),
            regions,
            files,
            how: How::Staged { staged, run: Mutex::new(None) },
        }))
    }

    /// As the POSIX backend: `stat` of the path in each descriptor's metaInfo.
    fn query_mem(&self, descs: &RegDList) -> Result<Vec<Option<Params>>> {
        self.posix.query_mem(descs)
    }

    fn estimate_xfer_cost(&self, _plan_bytes: u64) -> Result<(i64, i64)> {
        Err(Error::not_supported(format!("the {} backend does not estimate transfer costs", self.name)))
    }

    /// Every region retires: posts in flight stop (staged) or finish (DRAM), bounded; new posts are refused.
    fn shutdown(&self) {
        self.core.active.lock().closed = true;
        self.core.retire(None);
        self.core.drivers.shutdown();
    }
}

impl Gds {
    /// The request as cuFile calls, where cuFile proved itself here and took every file of it; else None
    /// (staged).
    fn direct(
        &self,
        read: bool,
        segs: &[Seg],
        mem_regs: &[Arc<Region>],
        file_regs: &[Arc<Region>],
    ) -> Result<Option<Direct>> {
        let Some(lib) = cufile::api() else { return Ok(None) };
        let mut ops = Vec::new();
        for s in segs {
            let (Some(m), Some(fr)) = (mem_regs.get(s.lreg as usize), file_regs.get(s.rreg as usize)) else {
                return Err(Error::invalid_param(format!("{}: unknown region in a request", self.name)));
            };
            let (Kind::Vram { dev }, Kind::File(f)) = (&m.kind, &fr.kind) else {
                return Err(Error::invalid_param(format!("{}: a region of this request is not ours", self.name)));
            };
            // NIXL's O_DIRECT rules hold on this path too: the file offsets and lengths are checked.
            f.check(read, &Seg { local: 0, ..*s }).map_err(|e| ours(self.name, e))?;
            let fh = fr.cufh.get_or_init(|| register_file(self.name, lib, f.fd));
            let Some(fh) = fh.clone() else { return Ok(None) };
            // Registered memory is named by its base and an offset; other memory by its own address.
            let (base, at) = match &m.cubuf {
                Some(b) => (b.base, s.local - b.base),
                None => (s.local, 0),
            };
            let mut done = 0;
            while done < s.len {
                let len = (s.len - done).min(DIRECT_CHUNK);
                ops.push(DirectOp {
                    dev: *dev,
                    fh: fh.clone(),
                    base,
                    buf_off: at + done,
                    off: s.remote + done,
                    len,
                    direct: f.direct.is_some(),
                });
                done += len;
            }
        }
        // Contiguous shares of about equal bytes, one per driver thread.
        let total: u64 = ops.iter().map(|o| o.len).sum();
        let n = self.core.threads.min(ops.len()).max(1) as u64;
        let mut groups: Vec<Vec<DirectOp>> = Vec::new();
        let mut cur = Vec::new();
        let mut bytes = 0u64;
        for o in ops {
            bytes += o.len;
            cur.push(o);
            if bytes * n >= total * (groups.len() as u64 + 1) {
                groups.push(std::mem::take(&mut cur));
            }
        }
        if !cur.is_empty() {
            groups.push(cur);
        }
        Ok(Some(Direct { lib, read, groups }))
    }
}

/// Register VRAM with cuFile; None (logged once) where cuFile refuses: it then gets the plain pointer.
fn register_buf(name: &str, lib: &'static CuFile, dev: u32, addr: u64, len: u64) -> Option<BufReg> {
    let _ctx = device::get().and_then(|d| d.enter(dev)).ok();
    match lib.buf(dev, addr, len) {
        Ok(b) => Some(b),
        Err(why) => {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                crate::telemetry::log::warn(&format!(
                    "{name}: {why}; cuFile is given such memory unregistered (it bounces it through its own buffers)"
                ))
            });
            None
        }
    }
}

/// Register a file with cuFile; None (logged once) where cuFile refuses: VRAM requests on it are staged.
fn register_file(name: &str, lib: &'static CuFile, fd: i32) -> Option<Arc<FileHandle>> {
    match lib.file(fd) {
        Ok(h) => Some(Arc::new(h)),
        Err(why) => {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                crate::telemetry::log::warn(&format!(
                    "{name}: {why}; VRAM requests on such files are staged through host buffers"
                ))
            });
            None
        }
    }
}

/// Errors of the code shared with the POSIX backend name this backend instead ("POSIX: …" → "GDS_MT: …").
fn ours(name: &str, e: Error) -> Error {
    e.reword(|m| match m.strip_prefix("POSIX") {
        Some(rest) if rest.starts_with([':', ' ']) => format!("{name}{rest}"),
        _ => m.to_owned(),
    })
}

fn region(k: Option<&RegionKey>) -> Option<Arc<Region>> {
    k.cloned().and_then(|k| (k as Arc<dyn Any + Send + Sync>).downcast::<Region>().ok())
}

impl Core {
    /// The queue for the writes of a staged WRITE's piece `p`: with any file open `O_DIRECT` (or not a
    /// regular file), the POSIX backend's (io_uring: the device works on several at once); otherwise the
    /// writer thread of its first file. Buffered writes cost CPU, not device time, and io_uring does not
    /// save it: on file systems without non-blocking buffered writes (ext4, tmpfs) it hands each one to a
    /// kernel worker, whose completion then wakes the ring's thread: hundreds of wake-ups per request of 16 KiB
    /// writes, CPU time the staged path needs for its copies (docs/gds.md).
    fn write_queue(&self, p: &Piece) -> &Queue {
        match p.parts.first() {
            Some(x) if p.parts.iter().all(|x| x.buffered) && !self.writers.is_empty() => {
                &self.writers[x.fd.unsigned_abs() as usize % self.writers.len()]
            }
            _ => &self.queue,
        }
    }

    /// Retire `gone` (every region, for None), then wait for the posts in flight on them.
    /// True when no post on them is running any more.
    fn retire(&self, gone: Option<&[Arc<Region>]>) -> bool {
        let hit = |r: &Arc<Region>| gone.is_none_or(|g| g.iter().any(|x| Arc::ptr_eq(x, r)));
        let waiting: Vec<Arc<Run>> = {
            let mut a = self.active.lock();
            for r in gone.unwrap_or_default() {
                r.retired.store(true, Ordering::Release);
            }
            a.posts.retain(|(run, _)| run.state() == Status::InProg);
            let mut w = Vec::new();
            for (run, regs) in &a.posts {
                if regs.iter().any(hit) {
                    // A staged post stops at its next piece once it sees one of its regions retired.
                    regs.iter().filter(|r| hit(r)).for_each(|r| r.retired.store(true, Ordering::Release));
                    w.push(run.clone());
                }
            }
            w
        };
        let until = Instant::now() + RETIRE_WAIT;
        let mut idle = true;
        for run in waiting {
            if !run.wait_for(until.saturating_duration_since(Instant::now())) {
                idle = false;
                crate::telemetry::log::warn(&format!(
                    "{}: a request was still moving data of a retired region after {:?}",
                    self.name, RETIRE_WAIT
                ));
            }
        }
        idle
    }

    /// Record a post on `regions` and start it with `start`, unless the agent is gone or a region retired.
    fn admit(&self, regions: &[Arc<Region>], start: impl FnOnce() -> Result<Arc<Run>>) -> Result<Arc<Run>> {
        let mut a = self.active.lock();
        if a.closed {
            return Err(Error::backend(format!("the {} backend's agent has been destroyed", self.name)));
        }
        if regions.iter().any(|r| r.retired.load(Ordering::Acquire)) {
            return Err(Error::not_found(format!("{}: a region of this request has been deregistered", self.name)));
        }
        a.posts.retain(|(run, _)| run.state() == Status::InProg);
        let run = start()?;
        a.posts.push((run.clone(), regions.to_vec()));
        Ok(run)
    }
}

// ----- staged requests -----

/// One piece of a staged request: at most a slot's bytes, moved through one slot.
#[derive(Debug, Default, Clone)]
struct Piece {
    parts: Vec<Part>,
}

/// `len` bytes between VRAM at `vram` (device `dev`) and file `fd` at `off`, through the slot at `pos`.
#[derive(Debug, Clone, Copy)]
struct Part {
    dev: u32,
    vram: u64,
    pos: u64,
    fd: i32,
    off: u64,
    len: u64,
    direct: bool,
    /// A regular file without `O_DIRECT`: its writes may go to a writer thread ([`Core::write_queue`]).
    buffered: bool,
}

struct Pieces {
    /// Bytes of a slot.
    slot: u64,
    done: Vec<Piece>,
    cur: Piece,
    pos: u64,
}

impl Pieces {
    fn new(slot: u64) -> Pieces {
        Pieces { slot, done: Vec::new(), cur: Piece::default(), pos: 0 }
    }

    fn add(&mut self, s: &Seg, dev: u32, f: &FileReg) -> Result<()> {
        // O_DIRECT: slot positions aligned for the kernel (slots themselves are page-aligned), pieces of whole
        // file blocks; buffered: cache-line positions.
        let (pad, block) = match f.direct {
            Some(a) => (a.mem.max(a.off).max(4096), a.off.max(1)),
            None => (64, 1),
        };
        if pad > self.slot || block > self.slot {
            return Err(Error::not_supported(format!(
                "fd {} needs O_DIRECT alignment of {} bytes, more than a staging slot ({} bytes)",
                f.fd,
                pad.max(block),
                self.slot
            )));
        }
        let mut done = 0;
        while done < s.len {
            self.pos = self.pos.div_ceil(pad) * pad;
            let room = self.slot.saturating_sub(self.pos) / block * block;
            if room == 0 {
                self.flush();
                continue;
            }
            let n = (s.len - done).min(room);
            self.cur.parts.push(Part {
                dev,
                vram: s.local + done,
                pos: self.pos,
                fd: f.fd,
                off: s.remote + done,
                len: n,
                direct: f.direct.is_some(),
                buffered: f.direct.is_none() && f.regular,
            });
            self.pos += n;
            done += n;
        }
        Ok(())
    }

    fn flush(&mut self) {
        if !self.cur.parts.is_empty() {
            self.done.push(std::mem::take(&mut self.cur));
        }
        self.pos = 0;
    }

    fn done(mut self) -> Vec<Piece> {
        self.flush();
        self.done
    }
}

/// A prepared staged request.
struct Staged {
    read: bool,
    /// Bytes of a slot (a power of two, at most [`SLOT`]).
    slot: u64,
    pieces: Vec<Piece>,
}

enum How {
    Posix(PosixXfer),
    Staged { staged: Arc<Staged>, run: Mutex<Option<Arc<Run>>> },
    Direct { direct: Arc<Direct>, run: Mutex<Option<Arc<Run>>> },
}

/// A prepared direct request: its cuFile calls, in one group per driver thread.
struct Direct {
    lib: &'static CuFile,
    read: bool,
    groups: Vec<Vec<DirectOp>>,
}

/// One cuFile call: `len` bytes between VRAM at `base + buf_off` (device `dev`) and the file of `fh` at `off`.
#[derive(Clone)]
struct DirectOp {
    dev: u32,
    fh: Arc<FileHandle>,
    base: u64,
    buf_off: u64,
    off: u64,
    len: u64,
    direct: bool,
}

struct GdsXfer {
    core: Arc<Core>,
    /// Every region the request touches (checked and tracked on each post).
    regions: Vec<Arc<Region>>,
    files: Vec<Arc<FileReg>>,
    how: How,
}

impl GdsXfer {
    /// A staged or direct post may start: its previous post (`last`) is over and every file is still open.
    fn may_post(&self, last: Option<&Arc<Run>>) -> Result<()> {
        if last.is_some_and(|r| r.state() == Status::InProg) {
            return Err(Error::new(Status::RepostActive, "the previous post of this request is still in progress"));
        }
        self.files.iter().try_for_each(|f| f.check_open().map_err(|e| ours(self.core.name, e)))
    }
}

impl BackendXfer for GdsXfer {
    fn post(&self, notif: Option<&[u8]>) -> Result<Status> {
        if notif.is_some() {
            return Err(Error::backend(format!("the {} backend cannot send notifications", self.core.name)));
        }
        match &self.how {
            How::Posix(x) => {
                if x.current_run().is_some_and(|r| r.state() == Status::InProg) {
                    return Err(Error::new(
                        Status::RepostActive,
                        "the previous post of this request is still in progress",
                    ));
                }
                let mut st = Status::Success;
                self.core.admit(&self.regions, || {
                    st = x.post(None).map_err(|e| ours(self.core.name, e))?;
                    x.current_run().ok_or_else(|| Error::backend("POSIX request without a run"))
                })?;
                Ok(st)
            }
            How::Direct { direct, run } => {
                let mut cur = run.lock();
                self.may_post(cur.as_ref())?;
                let r = self.core.admit(&self.regions, || {
                    Ok(Run::new(Arc::new(Work { read: direct.read, ops: Vec::new() }), direct.groups.len()))
                })?;
                *cur = Some(r.clone());
                if direct.groups.is_empty() {
                    return Ok(Status::Success);
                }
                for g in 0..direct.groups.len() {
                    let (core, d, regions, r) = (self.core.clone(), direct.clone(), self.regions.clone(), r.clone());
                    self.core.drivers.submit(Box::new(move || {
                        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            drive_direct(&core, &d, &d.groups[g], &regions, &r)
                        }));
                        match out {
                            Ok(Ok(())) => {}
                            Ok(Err(f)) => r.fail(f),
                            Err(_) => r.fail(Failure {
                                status: Status::Backend,
                                msg: "direct transfer panicked".into(),
                                errno: None,
                            }),
                        }
                        r.done(1);
                    }));
                }
                Ok(Status::InProg)
            }
            How::Staged { staged, run } => {
                let mut cur = run.lock();
                self.may_post(cur.as_ref())?;
                let r = self.core.admit(&self.regions, || {
                    let units = usize::from(!staged.pieces.is_empty());
                    Ok(Run::new(Arc::new(Work { read: staged.read, ops: Vec::new() }), units))
                })?;
                *cur = Some(r.clone());
                if staged.pieces.is_empty() {
                    return Ok(Status::Success);
                }
                let (core, staged2, regions) = (self.core.clone(), staged.clone(), self.regions.clone());
                self.core.drivers.submit(Box::new(move || {
                    let out =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drive(&core, &staged2, &regions, &r)));
                    let out = out.unwrap_or_else(|_| Err(Error::backend("staged transfer panicked")));
                    if let Err(e) = out {
                        r.fail(Failure { status: e.status(), msg: e.message().to_owned(), errno: None });
                    }
                    r.done(1);
                }));
                Ok(Status::InProg)
            }
        }
    }

    fn status(&self) -> Result<Status> {
        match &self.how {
            How::Posix(x) => x.status().map_err(|e| ours(self.core.name, e)),
            How::Staged { run, .. } | How::Direct { run, .. } => {
                let Some(r) = run.lock().clone() else { return Err(Error::new(Status::NotPosted, "not posted")) };
                match r.state() {
                    s @ (Status::InProg | Status::Success) => Ok(s),
                    _ => Err(ours(self.core.name, r.error())),
                }
            }
        }
    }

    /// Stops the post at its next piece and waits for its copies and I/O, so the buffers may be freed.
    fn abort(&self) -> bool {
        match &self.how {
            How::Posix(x) => x.abort(),
            How::Staged { run, .. } | How::Direct { run, .. } => {
                if let Some(r) = run.lock().clone() {
                    if r.state() == Status::InProg {
                        r.abort();
                        r.wait();
                    }
                }
                true
            }
        }
    }

    fn completed_at(&self) -> Option<Instant> {
        match &self.how {
            How::Posix(x) => x.completed_at(),
            How::Staged { run, .. } | How::Direct { run, .. } => run.lock().as_ref().and_then(|r| r.done_at()),
        }
    }
}

impl Drop for GdsXfer {
    /// A request dropped while in flight must not leave copies or I/O touching its buffers.
    fn drop(&mut self) {
        if let How::Staged { .. } | How::Direct { .. } = self.how {
            self.abort();
        }
    }
}

/// Make one group's cuFile calls of a direct post, in order, on a driver thread; stops before the next call
/// once a region retired or the post stopped (aborted, or another group failed).
fn drive_direct(core: &Core, d: &Direct, ops: &[DirectOp], regions: &[Arc<Region>], run: &Run) -> Result<(), Failure> {
    let backend = |msg: String| Failure { status: Status::Backend, msg, errno: None };
    let device = device::get().map_err(|e| backend(e.message().to_owned()))?;
    let mut ctx: Option<(u32, Box<dyn Any>)> = None;
    for o in ops {
        if regions.iter().any(|r| r.retired.load(Ordering::Acquire)) {
            return Err(Failure {
                status: Status::NotFound,
                msg: format!("{}: a region of this request was deregistered while it ran", core.name),
                errno: None,
            });
        }
        if run.stopping() {
            return Ok(());
        }
        if ctx.as_ref().is_none_or(|(dev, _)| *dev != o.dev) {
            // The previous guard first, so each puts back the context it found.
            drop(ctx.take());
            ctx = Some((o.dev, device.enter(o.dev).map_err(|e| backend(e.message().to_owned()))?));
        }
        let Some(fh) = o.fh.raw() else {
            return Err(Failure {
                status: Status::NotFound,
                msg: format!("{}: the file of this request has been deregistered", core.name),
                errno: None,
            });
        };
        let mut done = 0;
        while done < o.len {
            // SAFETY: the handle stays registered and the memory stays registered with gixl until this post
            // ends (deregistration and agent destruction wait for it); the device's context is current.
            let n = unsafe { d.lib.io(d.read, fh, o.base, o.buf_off + done, o.off + done, o.len - done) };
            let op = Op { fd: o.fh.fd, buf: o.base + o.buf_off, off: o.off, len: o.len as u32, direct: o.direct };
            let why = match n {
                n if n > 0 => {
                    done += n as u64;
                    continue;
                }
                0 if d.read => IoFail::Eof,
                0 => IoFail::NoProgress,
                n => match cufile::io_failure(n) {
                    Ok(errno) => IoFail::Os(errno),
                    Err(s) => {
                        let what = if d.read { "read" } else { "write" };
                        return Err(backend(format!(
                            "{} cuFile {what} of {} bytes at file offset {} of fd {} failed: {s}",
                            core.name, o.len, o.off, o.fh.fd
                        )));
                    }
                },
            };
            return Err(Failure::io(d.read, &op, done, why));
        }
    }
    Ok(())
}

/// Run one post of a staged request, piece by piece through the slots, on a driver thread.
fn drive(core: &Core, s: &Staged, regions: &[Arc<Region>], run: &Run) -> Result<()> {
    let device = device::get()?;
    let first_dev = s.pieces.first().and_then(|p| p.parts.first()).map_or(0, |p| p.dev);
    let mut bufs = Vec::new();
    let mut slots = Vec::new();
    for _ in 0..BUFFERS {
        if slots.len() >= s.pieces.len() {
            break;
        }
        let b = Staging::take(device, first_dev)?;
        // Page-aligned slots whatever the buffer's own alignment.
        let base = b.ptr().div_ceil(4096) * 4096;
        let end = b.ptr() + b.size();
        let mut a = base;
        while a + s.slot <= end && slots.len() < s.pieces.len() {
            slots.push(a);
            a += s.slot;
        }
        bufs.push(b);
    }
    if slots.is_empty() {
        return Err(Error::backend("staging buffers are smaller than one slot"));
    }
    let stop = || -> Result<()> {
        if regions.iter().any(|r| r.retired.load(Ordering::Acquire)) {
            return Err(Error::not_found(format!(
                "{}: a region of this request was deregistered while it ran",
                core.name
            )));
        }
        if run.stopping() {
            return Err(Error::new(Status::Canceled, "the transfer was aborted"));
        }
        Ok(())
    };
    // (slot index, I/O run, its queue) in piece order.
    let mut inflight: VecDeque<(usize, Arc<Run>, &Queue)> = VecDeque::new();
    let out = pipeline(core, device, s, &slots, &mut inflight, stop);
    // Whatever happened, no I/O may still use a slot when the buffers go back.
    for (_, io, q) in inflight.drain(..) {
        if out.is_err() {
            q.abort(&io);
        }
        io.wait();
    }
    drop(bufs);
    out
}

fn pipeline<'c>(
    core: &'c Core,
    device: &dyn Device,
    s: &Staged,
    slots: &[u64],
    inflight: &mut VecDeque<(usize, Arc<Run>, &'c Queue)>,
    stop: impl Fn() -> Result<()>,
) -> Result<()> {
    let mut free: Vec<usize> = (0..slots.len()).rev().collect();
    let io_of = |p: &Piece, slot: u64| {
        let ops = p
            .parts
            .iter()
            .map(|x| Op { fd: x.fd, buf: slot + x.pos, off: x.off, len: x.len as u32, direct: x.direct })
            .collect();
        Arc::new(Work { read: s.read, ops })
    };
    let finished = |io: &Run| -> Result<()> {
        io.wait();
        match io.state() {
            Status::Success => Ok(()),
            _ => Err(io.error()),
        }
    };
    if !s.read {
        // VRAM → slot, then slot → file while the next piece is copied.
        for p in &s.pieces {
            stop()?;
            let i = match free.pop() {
                Some(i) => i,
                None => {
                    let (i, io, _) = inflight.pop_front().expect("a slot is in flight when none is free");
                    finished(&io)?;
                    i
                }
            };
            copy(device, p, slots[i], false)?;
            let q = core.write_queue(p);
            inflight.push_back((i, q.start(&io_of(p, slots[i])), q));
        }
        while let Some((_, io, _)) = inflight.pop_front() {
            finished(&io)?;
        }
        return Ok(());
    }
    // File → slot for as many slots as there are, then each slot → VRAM in order, and refilled.
    let mut next = 0;
    let mut order: VecDeque<usize> = VecDeque::new();
    while next < s.pieces.len() || !inflight.is_empty() {
        while next < s.pieces.len() {
            let Some(i) = free.pop() else { break };
            stop()?;
            inflight.push_back((i, core.queue.start(&io_of(&s.pieces[next], slots[i])), &core.queue));
            order.push_back(next);
            next += 1;
        }
        let (i, io, _) = inflight.pop_front().expect("a read is in flight");
        let p = order.pop_front().expect("each read has its piece");
        finished(&io)?;
        stop()?;
        copy(device, &s.pieces[p], slots[i], true)?;
        free.push(i);
    }
    Ok(())
}

/// The device copies of piece `p` between VRAM and the slot at `slot` (`to_vram`: slot → VRAM), one call
/// per device.
fn copy(device: &dyn Device, p: &Piece, slot: u64, to_vram: bool) -> Result<()> {
    let mut devs: Vec<u32> = p.parts.iter().map(|x| x.dev).collect();
    devs.sort_unstable();
    devs.dedup();
    for d in devs {
        let copies: Vec<device::Copy> = p
            .parts
            .iter()
            .filter(|x| x.dev == d)
            .map(|x| {
                let host = slot + x.pos;
                if to_vram {
                    device::Copy { dst: x.vram, src: host, len: x.len }
                } else {
                    device::Copy { dst: host, src: x.vram, len: x.len }
                }
            })
            .collect();
        device.copy(d, &copies)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(local: u64, remote: u64, len: u64) -> Seg {
        Seg { local, remote, len, ldev: 0, rdev: 3, lreg: 0, rreg: 0 }
    }

    fn file(direct: bool) -> FileReg {
        FileReg::fake(3, direct.then_some((512, 4096)))
    }

    #[test]
    fn pieces_fill_slots_and_keep_direct_alignment() {
        let mut p = Pieces::new(SLOT);
        let f = file(false);
        // 1024 blocks of 16 KiB: 128 per 2 MiB slot, packed back to back.
        for i in 0..1024u64 {
            p.add(&seg(0x1000_0000 + i * 16384, i * 65536, 16384), 0, &f).unwrap();
        }
        let v = p.done();
        assert_eq!(v.len(), 8);
        assert!(v.iter().all(|x| x.parts.len() == 128));
        assert_eq!(v[1].parts[0].off, 128 * 65536);
        // One segment larger than a slot is cut at slot size.
        let mut p = Pieces::new(SLOT);
        p.add(&seg(0x1000_0000, 0, 5 * SLOT + 100), 1, &f).unwrap();
        let v = p.done();
        assert_eq!(v.len(), 6);
        assert_eq!(v.iter().map(|x| x.parts.iter().map(|p| p.len).sum::<u64>()).sum::<u64>(), 5 * SLOT + 100);
        // O_DIRECT: positions on 4 KiB, pieces of whole 4 KiB blocks.
        let d = file(true);
        let mut p = Pieces::new(SLOT);
        p.add(&seg(0x1000_0000, 0, 100), 0, &f).unwrap();
        p.add(&seg(0x2000_0000, 8192, 3 * 4096), 0, &d).unwrap();
        p.add(&seg(0x3000_0000, 1 << 30, SLOT), 0, &d).unwrap();
        let v = p.done();
        for x in v.iter().flat_map(|x| &x.parts).filter(|x| x.direct) {
            assert_eq!(x.pos % 4096, 0);
            assert_eq!(x.len % 4096, 0);
            assert!(x.pos + x.len <= SLOT);
        }
        assert_eq!(v.iter().flat_map(|x| &x.parts).map(|x| x.len).sum::<u64>(), 100 + 3 * 4096 + SLOT);
        // An alignment larger than a slot cannot be staged: refused, not looped on.
        let huge = FileReg::fake(3, Some((512, 2 * SLOT)));
        let e = Pieces::new(SLOT).add(&seg(0x1000_0000, 0, 4 * SLOT), 0, &huge).unwrap_err();
        assert_eq!(e.status(), Status::NotSupported);
    }

    #[test]
    fn buffered_writes_go_to_the_writer_of_their_file() {
        let core = Core {
            name: "GDS",
            queue: Arc::new(Queue::one_thread()),
            drivers: Pool::new(1),
            threads: 2,
            writers: (0..2).map(|_| Arc::new(Queue::one_thread())).collect(),
            active: Mutex::new(Active::default()),
        };
        let part = |fd: i32, direct: bool, buffered: bool| Part {
            dev: 0,
            vram: 0x1000,
            pos: 0,
            fd,
            off: 0,
            len: 16384,
            direct,
            buffered,
        };
        let piece = |parts: Vec<Part>| Piece { parts };
        let is = |a: &Queue, b: &Queue| std::ptr::eq(a, b);
        // A piece of buffered regular-file writes: the writer of its first file, the same one every time.
        let w3 = core.write_queue(&piece(vec![part(3, false, true), part(4, false, true)]));
        assert!(is(w3, &core.writers[1]));
        assert!(is(core.write_queue(&piece(vec![part(3, false, true)])), w3));
        assert!(is(core.write_queue(&piece(vec![part(4, false, true)])), &core.writers[0]));
        // Any O_DIRECT file, or a file that is not a regular one (a pipe): the POSIX backend's queue.
        assert!(is(core.write_queue(&piece(vec![part(3, false, true), part(5, true, false)])), &core.queue));
        assert!(is(core.write_queue(&piece(vec![part(6, false, false)])), &core.queue));
        // FileReg says which: a regular file without O_DIRECT is buffered.
        let mut p = Pieces::new(SLOT);
        p.add(&seg(0x1000_0000, 0, 100), 0, &file(false)).unwrap();
        p.add(&seg(0x2000_0000, 4096, 4096), 0, &file(true)).unwrap();
        let v = p.done();
        assert_eq!(v[0].parts.iter().map(|x| x.buffered).collect::<Vec<_>>(), [true, false]);
    }

    #[test]
    fn slots_give_about_32_pieces_within_bounds() {
        // 1024 x 16 KiB: 32 slots of 512 KiB; 64 MiB: 2 MiB slots; small requests: the smallest slot.
        assert_eq!(slot_size(16 << 20, 0), 512 << 10);
        assert_eq!(slot_size(64 << 20, 0), SLOT);
        assert_eq!(slot_size(1 << 30, 0), SLOT);
        assert_eq!(slot_size(4096, 0), MIN_SLOT);
        // Not a power of two: rounded down; an O_DIRECT alignment above it: raised to it, never above SLOT.
        assert_eq!(slot_size(48 << 20, 0), 1 << 20);
        assert_eq!(slot_size(4096, 1 << 20), 1 << 20);
        assert_eq!(slot_size(4096, 3 * SLOT), SLOT);
        let mut p = Pieces::new(slot_size(16 << 20, 4096));
        let f = file(true);
        for i in 0..1024u64 {
            p.add(&seg(0x1000_0000 + i * 16384, i * 65536, 16384), 0, &f).unwrap();
        }
        let v = p.done();
        assert_eq!(v.len(), 32);
        assert!(v.iter().all(|x| x.parts.len() == 32 && x.parts.iter().all(|p| p.pos % 4096 == 0)));
    }

    #[test]
    fn parameters_are_checked() {
        let p = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Params>();
        assert!(parse("GDS", &p(&[("batch_limit", "64"), ("batch_pool_size", "4")])).is_ok());
        assert_eq!(parse("GDS", &p(&[("batch_limit", "x")])).unwrap_err().status(), Status::Backend);
        assert_eq!(parse("GDS_MT", &p(&[("thread_count", "3")])).unwrap(), 3);
        assert!(parse("GDS_MT", &p(&[("thread_count", "0")])).unwrap() >= 1);
        assert_eq!(parse("GDS_MT", &p(&[("thread_count", "-1")])).unwrap_err().status(), Status::Backend);
        assert!(default_params().is_empty());
    }
}
