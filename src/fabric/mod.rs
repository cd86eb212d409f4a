//! libfabric, gixl's own bindings ([`sys`], opened at run time) and safe wrappers over them: the list of
//! devices a provider offers ([`Info`], [`devices`]), and for one device its [`Fabric`], [`Domain`], RDM
//! [`Endpoint`] with its address vector ([`Av`]) and completion queue ([`Cq`]) bound, memory registration that
//! honours the provider's MR mode ([`Mr`]), one-sided read and write, and completions waited for by sleeping on
//! the queues' wait descriptors ([`wait`]). [`selftest`] proves a device with them before anything trusts it.
//!
//! Every libfabric error becomes a gixl error carrying `fi_strerror`'s text (BACKEND_ERR, or NOT_SUPPORTED where
//! the library or the device is missing). Nothing here runs on agent creation's path.

pub mod selftest;
pub mod sys;

use std::ffi::{c_int, c_void, CStr, CString};
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::status::{Error, Result};
use sys::Lib;

pub use sys::{FI_MR_ALLOCATED, FI_MR_ENDPOINT, FI_MR_HMEM, FI_MR_LOCAL, FI_MR_PROV_KEY, FI_MR_VIRT_ADDR};

/// The MR modes gixl can honour (those EFA asks for), offered in the hints; the provider answers with the
/// subset it requires (`Device::mr_mode`). `FI_MR_HMEM` (GPU memory must be registered, with its interface):
/// gixl registers every region it moves, GPU memory with `fi_mr_regattr` naming its interface ([`Hmem`]).
pub const MR_MODES: c_int =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ALLOCATED | FI_MR_ENDPOINT | FI_MR_HMEM;

/// What memory a region registered with its interface is (`fi_mr_regattr`'s `iface` and `device`): a GPU's
/// through CUDA (its ordinal), or host memory named as such (`FI_HMEM_SYSTEM`: what a provider's `FI_HMEM`
/// path does with host memory; the tests register the fake device's memory, which is host memory, this way
/// to run that path where no GPU is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hmem {
    System,
    Cuda(i32),
}

/// How GPU memory is handed to a provider (`fi_mr_regattr`): its interface and device, and either as a dma-buf
/// of its range (`FI_MR_DMABUF`, API ≥ 1.20: the device layer exports it, as `ibv_reg_dmabuf_mr` takes it in
/// the RDMA route) or by its address, the provider reaching it through the interface's runtime itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vram {
    pub hmem: Hmem,
    pub dmabuf: bool,
}

impl Vram {
    /// How the self-test and `gixl doctor` name this way: `GPU memory` or `GPU memory, dma-buf`.
    pub fn name(self) -> &'static str {
        if self.dmabuf {
            "GPU memory, dma-buf"
        } else {
            "GPU memory"
        }
    }
}

impl Hmem {
    fn iface(self) -> (u32, u64) {
        match self {
            Hmem::System => (sys::FI_HMEM_SYSTEM, 0),
            // The union's `int cuda`: the low half of its `uint64_t` (little-endian).
            Hmem::Cuda(d) => (sys::FI_HMEM_CUDA, d as u32 as u64),
        }
    }
}
/// The capabilities asked of every device: one-sided RMA both ways.
pub const CAPS: u64 = sys::FI_RMA | sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE;

/// Whether libfabric's provider `name` (`tcp;ofi_rxm`, `efa`…) is itself a socket or shared-memory provider:
/// gixl's own TCP and same-host routes are faster than those, so its libfabric route takes them only when asked
/// for (`GIXL_TRANSPORT=fabric`).
pub fn is_sockets(name: &str) -> bool {
    matches!(name.split(';').next().unwrap_or(""), "tcp" | "udp" | "sockets" | "shm" | "net" | "xnet" | "sm2")
}

fn fi_err(lib: &Lib, what: &str, rc: isize) -> Error {
    let rc = c_int::try_from(rc).unwrap_or(c_int::MIN);
    Error::backend(format!("libfabric {what} failed: {} ({rc})", lib.strerror(rc)))
}

fn check(lib: &Lib, what: &str, rc: c_int) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(fi_err(lib, what, rc as isize))
    }
}

/// An operation a provider left out (NULL in its table): `-FI_ENOSYS`, as `FI_CHECK_OP` gives.
fn missing(lib: &Lib, what: &str) -> Error {
    fi_err(lib, what, -(sys::FI_ENOSYS as isize))
}

/// `fi_close` of an object (errors at close are not actionable: the object is gone either way).
///
/// # Safety
/// `fid` is a live libfabric object, closed once.
unsafe fn close(fid: *mut sys::Fid) {
    // SAFETY: a live object's fid points at its ops table (the caller's contract).
    if let Some(close) = unsafe { (*(*fid).ops).close } {
        // SAFETY: as above; it is not used again.
        unsafe { close(fid) };
    }
}

fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: libfabric's names are NUL-terminated strings it owns for the info's life.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// One entry of `fi_getinfo`'s answer, owned (duplicated with `fi_dupinfo`, freed with `fi_freeinfo`): a
/// provider on a domain (a NIC, or a host's interface for tcp/udp, or `shm`).
pub struct Device {
    lib: Arc<Lib>,
    info: *mut sys::FiInfo,
}

// SAFETY: the info is owned by this value alone and only read (libfabric's fi_info has no thread affinity).
unsafe impl Send for Device {}
// SAFETY: as above; `&Device` only reads it.
unsafe impl Sync for Device {}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: owned (from fi_dupinfo), freed once.
        unsafe { (self.lib.freeinfo)(self.info) };
    }
}

impl Clone for Device {
    fn clone(&self) -> Device {
        // SAFETY: a live info; fi_dupinfo copies one entry (its `next` is cleared by it).
        let info = unsafe { (self.lib.dupinfo)(self.info) };
        assert!(!info.is_null(), "fi_dupinfo: out of memory");
        Device { lib: self.lib.clone(), info }
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (fabric {}, mr_mode {:#x})", self.provider(), self.domain(), self.fabric(), self.mr_mode())
    }
}

impl Device {
    fn attrs(&self) -> (&sys::FiFabricAttr, &sys::FiDomainAttr) {
        // SAFETY: an info from fi_getinfo/fi_dupinfo has both attribute structs (libfabric allocates them).
        unsafe { (&*(*self.info).fabric_attr, &*(*self.info).domain_attr) }
    }
    /// The provider, as libfabric names it (`tcp;ofi_rxm`, `shm`, `efa`, `verbs;ofi_rxm`…).
    pub fn provider(&self) -> String {
        cstr(self.attrs().0.prov_name)
    }
    /// The domain (the NIC or interface: `eth0`, `rdmap0s6-rdm`, `shm`…).
    pub fn domain(&self) -> String {
        cstr(self.attrs().1.name)
    }
    /// The fabric (a subnet for the socket providers).
    pub fn fabric(&self) -> String {
        cstr(self.attrs().0.name)
    }
    /// The MR mode bits the provider requires of this device (a subset of [`MR_MODES`]).
    pub fn mr_mode(&self) -> c_int {
        self.attrs().1.mr_mode
    }
    /// Its addresses are NUL-terminated strings (`FI_ADDR_STR`: of any length), not structs of one size.
    pub fn string_addresses(&self) -> bool {
        // SAFETY: a live info.
        unsafe { (*self.info).addr_format == sys::FI_ADDR_STR }
    }
    /// The capabilities the provider grants.
    pub fn caps(&self) -> u64 {
        // SAFETY: a live info.
        unsafe { (*self.info).caps }
    }
    /// The provider offers `FI_HMEM` on this device (GPU memory registered with its interface, moved by the
    /// provider's one-sided operations): it was asked for, and granted, in [`devices`].
    pub fn hmem(&self) -> bool {
        self.caps() & sys::FI_HMEM != 0
    }
}

/// An owned `fi_getinfo` hints struct (allocated by the library with `fi_dupinfo(NULL)`, freed by it).
struct Hints<'a> {
    lib: &'a Lib,
    info: *mut sys::FiInfo,
}

impl Drop for Hints<'_> {
    fn drop(&mut self) {
        // SAFETY: allocated by fi_dupinfo; its strings were strdup'd (libfabric frees them with free()).
        unsafe { (self.lib.freeinfo)(self.info) };
    }
}

/// The devices the library offers for RDM endpoints with one-sided RMA, one per provider and domain; a
/// `provider` and a `domain` keep only those of exactly that name (libfabric's full name: `tcp;ofi_rxm` is
/// the tcp provider under the rxm utility, which gives it RDM endpoints; `tcp` alone offers none).
/// NOT_SUPPORTED where the library is absent; an empty list where none matches (`-FI_ENODATA`).
///
/// Each device is asked for with `FI_HMEM` too: where the provider offers it on the device (shm here; efa with
/// CUDA), the entry kept is that one (its [`Device::hmem`]); otherwise the plain one, in libfabric's order.
pub fn devices(provider: Option<&str>, domain: Option<&str>) -> Result<Vec<Device>> {
    let lib = sys::lib()?;
    let hmem = query(&lib, provider, domain, CAPS | sys::FI_HMEM)?;
    let plain = query(&lib, provider, domain, CAPS)?;
    let mut out: Vec<Device> = Vec::with_capacity(plain.len());
    for d in plain {
        let same = |h: &&Device| h.provider() == d.provider() && h.domain() == d.domain();
        out.push(match hmem.iter().find(same) {
            Some(h) => h.clone(),
            None => d,
        });
    }
    // A device offered only with FI_HMEM (not expected): kept too.
    for h in hmem {
        if !out.iter().any(|o| o.provider() == h.provider() && o.domain() == h.domain()) {
            out.push(h);
        }
    }
    Ok(out)
}

/// One `fi_getinfo` for RDM endpoints with `caps` (see [`devices`]).
fn query(lib: &Arc<Lib>, provider: Option<&str>, domain: Option<&str>, caps: u64) -> Result<Vec<Device>> {
    let lib = lib.clone();
    // SAFETY: fi_dupinfo(NULL) allocates a zeroed info with every attribute struct (fi_allocinfo).
    let hints = Hints { lib: &lib, info: unsafe { (lib.dupinfo)(std::ptr::null()) } };
    if hints.info.is_null() {
        return Err(Error::backend("libfabric fi_allocinfo failed (out of memory)"));
    }
    let dup = |s: &str| -> Result<*mut std::ffi::c_char> {
        let c = CString::new(s).map_err(|_| Error::invalid_param(format!("{s:?} holds a NUL byte")))?;
        // SAFETY: a NUL-terminated string; strdup's copy is freed by fi_freeinfo (free()).
        Ok(unsafe { libc::strdup(c.as_ptr()) })
    };
    // SAFETY: the hints and their attribute structs are ours until freed; plain field writes.
    unsafe {
        let h = &mut *hints.info;
        h.caps = caps;
        (*h.ep_attr).type_ = sys::FI_EP_RDM;
        let d = &mut *h.domain_attr;
        d.mr_mode = MR_MODES;
        d.threading = sys::FI_THREAD_SAFE;
        if let Some(p) = provider {
            (*h.fabric_attr).prov_name = dup(p)?;
        }
        if let Some(n) = domain {
            d.name = dup(n)?;
        }
    }
    let mut list = null_mut();
    // SAFETY: valid hints; `list` receives a list that is freed below.
    let rc = unsafe { (lib.getinfo)(lib.api, std::ptr::null(), std::ptr::null(), 0, hints.info, &mut list) };
    if rc == -sys::FI_ENODATA {
        return Ok(Vec::new());
    }
    check(&lib, "fi_getinfo", rc)?;
    let mut out: Vec<Device> = Vec::new();
    let mut p = list;
    while !p.is_null() {
        // SAFETY: an entry of the list; fi_dupinfo copies that one entry.
        let info = unsafe { (lib.dupinfo)(p) };
        // SAFETY: as above.
        p = unsafe { (*p).next };
        if info.is_null() {
            continue;
        }
        let d = Device { lib: lib.clone(), info };
        // The list repeats a domain once per address format and protocol; the first is the provider's pick.
        let wanted = provider.is_none_or(|p| d.provider() == p) && domain.is_none_or(|n| d.domain() == n);
        if wanted && !out.iter().any(|o| o.provider() == d.provider() && o.domain() == d.domain()) {
            out.push(d);
        }
    }
    // SAFETY: the list from fi_getinfo, freed once (the entries kept were duplicated).
    unsafe { (lib.freeinfo)(list) };
    Ok(out)
}

struct FabricInner {
    lib: Arc<Lib>,
    fabric: *mut sys::FidFabric,
}

impl Drop for FabricInner {
    fn drop(&mut self) {
        // SAFETY: opened by fi_fabric, closed once, after every domain (each holds an Arc of this).
        unsafe { close(self.fabric.cast()) };
    }
}

/// An open fabric.
#[derive(Clone)]
pub struct Fabric(Arc<FabricInner>);

// SAFETY: the domains are opened FI_THREAD_SAFE (the hints ask for it) and fabric-level calls are thread-safe.
unsafe impl Send for FabricInner {}
// SAFETY: as above.
unsafe impl Sync for FabricInner {}

impl Fabric {
    pub fn open(dev: &Device) -> Result<Fabric> {
        let lib = dev.lib.clone();
        let mut f = null_mut();
        // SAFETY: the device's fabric attributes; `f` receives the new fabric.
        let rc = unsafe { (lib.fabric)((*dev.info).fabric_attr, &mut f, null_mut()) };
        check(&lib, "fi_fabric", rc)?;
        Ok(Fabric(Arc::new(FabricInner { lib, fabric: f })))
    }

    /// `fi_trywait` over these queues: true where every one may be slept on (nothing pending).
    fn trywait(&self, cqs: &[&Cq]) -> Result<bool> {
        let f = self.0.fabric;
        // SAFETY: a live fabric's table.
        let Some(trywait) = (unsafe { (*(*f).ops).trywait }) else { return Err(missing(&self.0.lib, "fi_trywait")) };
        let mut fids: Vec<*mut sys::Fid> = cqs.iter().map(|c| c.cq.cast::<sys::Fid>()).collect();
        // SAFETY: live queues of this fabric's domains.
        let rc = unsafe { trywait(f, fids.as_mut_ptr(), fids.len() as c_int) };
        match rc {
            0 => Ok(true),
            rc if rc == -sys::FI_EAGAIN => Ok(false),
            rc => Err(fi_err(&self.0.lib, "fi_trywait", rc as isize)),
        }
    }
}

struct DomainInner {
    fabric: Fabric,
    domain: *mut sys::FidDomain,
    mr_mode: c_int,
    /// The next key gixl requests where the provider does not choose them (no `FI_MR_PROV_KEY`).
    next_key: AtomicU64,
}

impl Drop for DomainInner {
    fn drop(&mut self) {
        // SAFETY: opened by fi_domain, closed once, after everything opened on it (each holds an Arc of this).
        unsafe { close(self.domain.cast()) };
    }
}

// SAFETY: opened FI_THREAD_SAFE.
unsafe impl Send for DomainInner {}
// SAFETY: as above.
unsafe impl Sync for DomainInner {}

/// An open domain (one NIC or interface of a provider).
#[derive(Clone)]
pub struct Domain(Arc<DomainInner>);

impl Domain {
    pub fn open(fabric: &Fabric, dev: &Device) -> Result<Domain> {
        let lib = &fabric.0.lib;
        let f = fabric.0.fabric;
        // SAFETY: a live fabric's table.
        let Some(open) = (unsafe { (*(*f).ops).domain }) else { return Err(missing(lib, "fi_domain")) };
        let mut d = null_mut();
        // SAFETY: a live fabric and the device's info (libfabric copies what it keeps).
        let rc = unsafe { open(f, dev.info, &mut d, null_mut()) };
        check(lib, "fi_domain", rc)?;
        Ok(Domain(Arc::new(DomainInner {
            fabric: fabric.clone(),
            domain: d,
            mr_mode: dev.mr_mode(),
            next_key: AtomicU64::new(1),
        })))
    }

    pub(crate) fn lib(&self) -> &Lib {
        &self.0.fabric.0.lib
    }

    /// The MR mode bits in force.
    pub fn mr_mode(&self) -> c_int {
        self.0.mr_mode
    }
}

/// A completion queue (`FI_CQ_FORMAT_DATA`), with a wait descriptor where the provider gives one.
pub struct Cq {
    domain: Domain,
    cq: *mut sys::FidCq,
    fd: Option<RawFd>,
}

// SAFETY: the domain is FI_THREAD_SAFE.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: opened by fi_cq_open, closed once, after the endpoints bound to it (they hold an Arc).
        unsafe { close(self.cq.cast()) };
    }
}

/// What [`Cq::read`] found.
pub enum CqRead {
    /// Completions (their operation contexts).
    Done(Vec<*mut c_void>),
    /// A failed operation: its context, the error (`fi_cq_strerror` text), libfabric's error number (positive,
    /// `FI_E*`) and the provider's own.
    Failed(*mut c_void, Error, i32, i32),
}

impl Cq {
    /// Opens a queue of `size` entries waited on with `FI_WAIT_FD`; where the provider has none (shm:
    /// `-FI_ENOSYS`), `FI_WAIT_NONE`, and [`wait`] sleeps [`SLICE`] between reads. (`FI_WAIT_UNSPEC` with
    /// `fi_cq_sread` is not used: on shm here, `fi_cq_sread` did not return within its timeout.)
    pub fn open(domain: &Domain, size: usize) -> Result<Arc<Cq>> {
        let lib = domain.lib();
        let d = domain.0.domain;
        // SAFETY: a live domain's table.
        let Some(open) = (unsafe { (*(*d).ops).cq_open }) else { return Err(missing(lib, "fi_cq_open")) };
        let mut first = None;
        for wait_obj in [sys::FI_WAIT_FD, sys::FI_WAIT_NONE] {
            let mut attr = sys::FiCqAttr {
                size,
                flags: 0,
                format: sys::FI_CQ_FORMAT_DATA,
                wait_obj,
                signaling_vector: 0,
                wait_cond: 0,
                wait_set: null_mut(),
            };
            let mut cq = null_mut();
            // SAFETY: a live domain and a filled attribute struct.
            let rc = unsafe { open(d, &mut attr, &mut cq, null_mut()) };
            if rc != 0 {
                first.get_or_insert(fi_err(lib, "fi_cq_open", rc as isize));
                continue;
            }
            let mut cq = Cq { domain: domain.clone(), cq, fd: None };
            if wait_obj == sys::FI_WAIT_FD {
                let mut fd: c_int = -1;
                // SAFETY: a live queue; FI_GETWAIT with FI_WAIT_FD writes an int.
                let rc = unsafe { cq.control(sys::FI_GETWAIT, (&mut fd as *mut c_int).cast()) };
                if rc != 0 || fd < 0 {
                    first.get_or_insert(fi_err(lib, "fi_control(FI_GETWAIT)", rc as isize));
                    continue;
                }
                cq.fd = Some(fd);
            }
            return Ok(Arc::new(cq));
        }
        Err(first.unwrap_or_else(|| missing(lib, "fi_cq_open")))
    }

    /// # Safety
    /// `arg` is what `cmd` takes.
    unsafe fn control(&self, cmd: c_int, arg: *mut c_void) -> c_int {
        let fid = self.cq.cast::<sys::Fid>();
        // SAFETY: a live queue's table; the caller vouches for `arg`.
        match unsafe { (*(*fid).ops).control } {
            Some(control) => unsafe { control(fid, cmd, arg) },
            None => -sys::FI_ENOSYS,
        }
    }

    /// The wait descriptor (`FI_WAIT_FD`), if the provider gave one.
    pub fn fd(&self) -> Option<RawFd> {
        self.fd
    }

    fn err_entry(&self) -> Result<CqRead> {
        let lib = self.domain.lib();
        // SAFETY: a live queue's table.
        let ops = unsafe { &*(*self.cq).ops };
        let Some(readerr) = ops.readerr else { return Err(missing(lib, "fi_cq_readerr")) };
        // SAFETY: plain data; zeroed is its "no error data buffer" state.
        let mut e: sys::FiCqErrEntry = unsafe { std::mem::zeroed() };
        // SAFETY: a live queue; one entry.
        let rc = unsafe { readerr(self.cq, &mut e, 0) };
        if rc < 0 {
            return Err(fi_err(lib, "fi_cq_readerr", rc));
        }
        let prov = match ops.strerror {
            Some(strerror) => {
                let mut buf = [0 as std::ffi::c_char; 256];
                // SAFETY: a live queue; the entry's error data is valid until the next read of this queue.
                let p = unsafe { strerror(self.cq, e.prov_errno, e.err_data, buf.as_mut_ptr(), buf.len()) };
                cstr(p)
            }
            None => String::new(),
        };
        let msg = format!(
            "libfabric completion failed: {} ({}); provider: {prov} ({})",
            lib.strerror(e.err),
            -e.err,
            e.prov_errno
        );
        Ok(CqRead::Failed(e.op_context, Error::backend(msg), e.err, e.prov_errno))
    }

    /// Reads what completed (drives the provider's progress); never blocks.
    pub fn read(&self) -> Result<CqRead> {
        let lib = self.domain.lib();
        // SAFETY: a live queue's table.
        let Some(read) = (unsafe { (*(*self.cq).ops).read }) else { return Err(missing(lib, "fi_cq_read")) };
        let mut entries =
            [sys::FiCqDataEntry { op_context: null_mut(), flags: 0, len: 0, buf: null_mut(), data: 0 }; 16];
        // SAFETY: a live queue of FI_CQ_FORMAT_DATA entries; room for 16.
        let rc = unsafe { read(self.cq, entries.as_mut_ptr().cast(), entries.len()) };
        match rc {
            n if n >= 0 => Ok(CqRead::Done(entries[..n as usize].iter().map(|e| e.op_context).collect())),
            n if n == -(sys::FI_EAGAIN as isize) => Ok(CqRead::Done(Vec::new())),
            n if n == -(sys::FI_EAVAIL as isize) => self.err_entry(),
            n => Err(fi_err(lib, "fi_cq_read", n)),
        }
    }
}

/// Sleeps until one of `cqs` may have something, at most [`SLICE`] (or `timeout`, if shorter): on their wait
/// descriptors after `fi_trywait` says that is safe (it returns at once where it is not: the caller reads the
/// queues again), or, where a queue has no descriptor, in `nanosleep`. Never spins; the caller reads the
/// queues after it. The slice bounds the sleep because the providers run here (tcp through `ofi_rxm`) make
/// data progress only when a queue is read and their descriptors did not wake for it: with the descriptors
/// alone, a 64 KiB WRITE over tcp never completed. A caller waits only while an operation is pending, so an
/// idle endpoint costs no wake-ups.
pub fn wait(fabric: &Fabric, cqs: &[&Cq], timeout: Duration) -> Result<()> {
    wait_up_to(fabric, cqs, timeout.min(SLICE))
}

/// As [`wait`], but sleeping on the descriptors up to `timeout` (a queue without one: [`SLICE`]): for a target
/// whose provider wakes its descriptor when a peer's operation arrives (tcp through ofi_rxm did here).
pub fn wait_up_to(fabric: &Fabric, cqs: &[&Cq], timeout: Duration) -> Result<()> {
    if !cqs.is_empty() && cqs.iter().all(|c| c.fd.is_some()) {
        if !fabric.trywait(cqs)? {
            return Ok(());
        }
        let mut fds: Vec<libc::pollfd> =
            cqs.iter().map(|c| libc::pollfd { fd: c.fd.unwrap_or(-1), events: libc::POLLIN, revents: 0 }).collect();
        let ms = timeout.as_millis().max(1) as c_int;
        // SAFETY: a live array of pollfds of the queues' descriptors (owned by the queues, open while they are).
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::backend(format!(
                "poll on libfabric's wait descriptors: {}",
                std::io::Error::last_os_error()
            )));
        }
        return Ok(());
    }
    std::thread::sleep(timeout.min(SLICE));
    Ok(())
}

/// The longest sleep between two reads of the queues while something is pending.
pub const SLICE: Duration = Duration::from_millis(1);

/// An address vector (`FI_AV_TABLE`).
pub struct Av {
    domain: Domain,
    av: *mut sys::FidAv,
}

// SAFETY: the domain is FI_THREAD_SAFE.
unsafe impl Send for Av {}
// SAFETY: as above.
unsafe impl Sync for Av {}

impl Drop for Av {
    fn drop(&mut self) {
        // SAFETY: opened by fi_av_open, closed once, after the endpoints bound to it.
        unsafe { close(self.av.cast()) };
    }
}

impl Av {
    pub fn open(domain: &Domain, count: usize) -> Result<Arc<Av>> {
        let lib = domain.lib();
        let d = domain.0.domain;
        // SAFETY: a live domain's table.
        let Some(open) = (unsafe { (*(*d).ops).av_open }) else { return Err(missing(lib, "fi_av_open")) };
        let mut attr = sys::FiAvAttr {
            type_: sys::FI_AV_TABLE,
            rx_ctx_bits: 0,
            count,
            ep_per_node: 0,
            name: std::ptr::null(),
            map_addr: null_mut(),
            flags: 0,
        };
        let mut av = null_mut();
        // SAFETY: a live domain and a filled attribute struct.
        let rc = unsafe { open(d, &mut attr, &mut av, null_mut()) };
        check(lib, "fi_av_open", rc)?;
        Ok(Arc::new(Av { domain: domain.clone(), av }))
    }

    /// Inserts one endpoint's address (as [`Endpoint::name`] gave it); its handle for read and write.
    pub fn insert(&self, addr: &[u8]) -> Result<u64> {
        let lib = self.domain.lib();
        // SAFETY: a live AV's table.
        let Some(insert) = (unsafe { (*(*self.av).ops).insert }) else { return Err(missing(lib, "fi_av_insert")) };
        let mut out = sys::FI_ADDR_UNSPEC;
        // SAFETY: a live AV; one address of the provider's format (its length is the provider's own).
        let rc = unsafe { insert(self.av, addr.as_ptr().cast(), 1, &mut out, 0, null_mut()) };
        if rc != 1 {
            return Err(if rc < 0 {
                fi_err(lib, "fi_av_insert", rc as isize)
            } else {
                Error::backend("libfabric fi_av_insert inserted no address")
            });
        }
        Ok(out)
    }
}

/// An RDM endpoint with its CQ (transmit and receive) and AV bound, enabled.
pub struct Endpoint {
    domain: Domain,
    ep: *mut sys::FidEp,
    cq: Arc<Cq>,
    _av: Arc<Av>,
}

// SAFETY: the domain is FI_THREAD_SAFE.
unsafe impl Send for Endpoint {}
// SAFETY: as above.
unsafe impl Sync for Endpoint {}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: opened by fi_endpoint, closed once, before its CQ and AV (fields dropped after this).
        unsafe { close(self.ep.cast()) };
    }
}

/// `fi_ep_bind`/`fi_mr_bind` and `fi_enable`/`fi_mr_enable` through a fid's table.
///
/// # Safety
/// `fid` and `to` are live objects of one domain.
unsafe fn bind(lib: &Lib, what: &str, fid: *mut sys::Fid, to: *mut sys::Fid, flags: u64) -> Result<()> {
    // SAFETY: the caller's contract.
    let Some(bind) = (unsafe { (*(*fid).ops).bind }) else { return Err(missing(lib, what)) };
    // SAFETY: as above.
    check(lib, what, unsafe { bind(fid, to, flags) })
}

/// # Safety
/// `fid` is a live endpoint or region.
unsafe fn enable(lib: &Lib, what: &str, fid: *mut sys::Fid) -> Result<()> {
    // SAFETY: the caller's contract.
    let Some(control) = (unsafe { (*(*fid).ops).control }) else { return Err(missing(lib, what)) };
    // SAFETY: as above; FI_ENABLE takes no argument.
    check(lib, what, unsafe { control(fid, sys::FI_ENABLE, null_mut()) })
}

/// Removes, once per process and before its first shm endpoint, the shm provider's regions that carry this
/// process's id. The shm provider names its region after the process (`/dev/shm/<pid>:<n>:<n>` with Debian's
/// 1.17) and removes it when the endpoint closes; a process that died without closing (killed) leaves it behind,
/// and a later process given the same id then fails `fi_enable` with `EBUSY` (seen: a test's shm peer went over
/// TCP). No live process of this pid namespace has this process's id, so such a region is a dead one's.
fn clear_stale_shm() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| clear_shm_regions(std::process::id()));
}

/// Removes the shm provider's regions named after process `pid` (`/dev/shm/<pid>:<n>:<n>`). Only for a pid
/// that no live process of this pid namespace but the caller has (see `clear_stale_shm`), or a process known
/// dead (the tests' killed children).
pub fn clear_shm_regions(pid: u32) {
    let me = format!("{pid}:");
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&me)) else { continue };
        if !rest.is_empty() && rest.split(':').all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

impl Endpoint {
    pub fn open(domain: &Domain, dev: &Device, cq: &Arc<Cq>, av: &Arc<Av>) -> Result<Endpoint> {
        if dev.provider() == "shm" {
            clear_stale_shm();
        }
        let lib = domain.lib();
        let d = domain.0.domain;
        // SAFETY: a live domain's table.
        let Some(open) = (unsafe { (*(*d).ops).endpoint }) else { return Err(missing(lib, "fi_endpoint")) };
        let mut ep = null_mut();
        // SAFETY: a live domain and the device's info (copied by libfabric).
        check(lib, "fi_endpoint", unsafe { open(d, dev.info, &mut ep, null_mut()) })?;
        let e = Endpoint { domain: domain.clone(), ep, cq: cq.clone(), _av: av.clone() };
        let fid = ep.cast::<sys::Fid>();
        // SAFETY: the endpoint, its queue and its AV are live objects of one domain.
        unsafe {
            bind(lib, "fi_ep_bind(cq)", fid, cq.cq.cast(), sys::FI_TRANSMIT | sys::FI_RECV)?;
            bind(lib, "fi_ep_bind(av)", fid, av.av.cast(), 0)?;
            enable(lib, "fi_enable", fid)?;
        }
        Ok(e)
    }

    /// The endpoint's address (`fi_getname`), to insert into a peer's AV.
    pub fn name(&self) -> Result<Vec<u8>> {
        let lib = self.domain.lib();
        // SAFETY: a live endpoint's table.
        let Some(getname) = (unsafe { (*(*self.ep).cm).getname }) else { return Err(missing(lib, "fi_getname")) };
        let mut buf = vec![0u8; 256];
        loop {
            let mut len = buf.len();
            // SAFETY: a live endpoint; `len` bytes of room.
            let rc = unsafe { getname(self.ep.cast(), buf.as_mut_ptr().cast(), &mut len) };
            if rc == -sys::FI_ETOOSMALL && len > buf.len() && len <= 1 << 16 {
                buf.resize(len, 0);
                continue;
            }
            check(lib, "fi_getname", rc)?;
            buf.truncate(len);
            return Ok(buf);
        }
    }

    /// The queue bound to it.
    pub fn cq(&self) -> &Arc<Cq> {
        &self.cq
    }

    /// Posts a one-sided READ (`remote` → `local`) or WRITE (`local` → `remote`) of the `len` bytes at `ptr`
    /// in `local`, delivery-complete for a WRITE (the data is at the target when its completion comes), its
    /// completion carrying `ctx`. `Ok(false)`: the provider's queue is full (`-FI_EAGAIN`): read the queues
    /// and post again.
    ///
    /// # Safety
    /// `ptr..ptr + len` lies in `local`'s region and stays valid (and, for a READ, unaliased) until the
    /// completion; `remote` describes a region registered at `peer` for the access asked.
    pub unsafe fn post(
        &self,
        write: bool,
        local: &Mr,
        (ptr, len): (*mut u8, usize),
        peer: u64,
        remote: RemoteKey,
        ctx: *mut c_void,
    ) -> Result<bool> {
        let lib = self.domain.lib();
        // SAFETY: a live endpoint's table.
        let rma = unsafe { &*(*self.ep).rma };
        let iov = sys::IoVec { base: ptr.cast(), len };
        let mut desc = local.desc();
        let rma_iov = sys::FiRmaIov { addr: remote.addr, len, key: remote.key };
        let msg = sys::FiMsgRma {
            msg_iov: &iov,
            desc: &mut desc,
            iov_count: 1,
            addr: peer,
            rma_iov: &rma_iov,
            rma_iov_count: 1,
            context: ctx,
            data: 0,
        };
        let (op, what, flags) = if write {
            (rma.writemsg, "fi_writemsg", sys::FI_COMPLETION | sys::FI_DELIVERY_COMPLETE)
        } else {
            (rma.readmsg, "fi_readmsg", sys::FI_COMPLETION)
        };
        let Some(op) = op else { return Err(missing(lib, what)) };
        // SAFETY: a live endpoint; the message points at locals that outlive the call (libfabric copies the
        // message); the buffers' validity is the caller's contract.
        let rc = unsafe { op(self.ep, &msg, flags) };
        match rc {
            0 => Ok(true),
            n if n == -(sys::FI_EAGAIN as isize) => Ok(false),
            n => Err(fi_err(lib, what, n)),
        }
    }
}

/// What a peer needs to reach a registered region: the address to name in a read or write (the virtual
/// address under `FI_MR_VIRT_ADDR`, else the offset from the region's start) and its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteKey {
    pub addr: u64,
    pub key: u64,
}

/// A registered region of memory (`fi_mr_reg`), honouring the domain's MR mode: a key the provider chose
/// (`FI_MR_PROV_KEY`) or one gixl requested (unique in the domain), bound to and enabled on the endpoint
/// under `FI_MR_ENDPOINT`, its descriptor passed with every local use (needed under `FI_MR_LOCAL`).
pub struct Mr {
    domain: Domain,
    mr: *mut sys::FidMr,
    base: *mut u8,
    len: usize,
    _ep: Option<Arc<Endpoint>>,
}

// SAFETY: the domain is FI_THREAD_SAFE; the region's memory is the caller's (see `register`).
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by fi_mr_reg, closed once, before the endpoint it is bound to (held here).
        unsafe { close(self.mr.cast()) };
    }
}

impl Mr {
    /// Registers `len` bytes at `base` for local and remote read and write; `ep` is the endpoint the region is
    /// used on (bound to it where the provider asks for `FI_MR_ENDPOINT`).
    ///
    /// # Safety
    /// `base..base + len` is allocated memory that outlives the region.
    pub unsafe fn register(domain: &Domain, base: *mut u8, len: usize, ep: &Arc<Endpoint>) -> Result<Mr> {
        // SAFETY: the caller's contract.
        unsafe { Mr::register_for(domain, base, len, ep, true) }
    }

    /// As [`Mr::register`], for local access only where `remote` is false (a key kept taken, reaching
    /// nothing: a tombstone).
    ///
    /// # Safety
    /// As [`Mr::register`].
    pub unsafe fn register_for(
        domain: &Domain,
        base: *mut u8,
        len: usize,
        ep: &Arc<Endpoint>,
        remote: bool,
    ) -> Result<Mr> {
        // SAFETY: the caller's contract.
        unsafe { Mr::register_as(domain, base, len, ep, remote, None) }
    }

    /// As [`Mr::register`], for GPU memory handed over as `vram` says (the domain's device must offer
    /// `FI_HMEM`, see [`Device::hmem`]); a dma-buf is asked of `device` (the device layer that owns it).
    ///
    /// # Safety
    /// `base..base + len` is memory of that interface and device that outlives the region.
    pub unsafe fn register_vram(
        domain: &Domain,
        base: *mut u8,
        len: usize,
        ep: &Arc<Endpoint>,
        vram: Vram,
        device: &dyn crate::device::Device,
    ) -> Result<Mr> {
        if !vram.dmabuf {
            // SAFETY: the caller's contract.
            return unsafe { Mr::register_as(domain, base, len, ep, true, Some((vram.hmem, None))) };
        }
        let lib = domain.lib();
        if lib.api < sys::API_1_20 {
            let (major, minor) = lib.version();
            return Err(Error::not_supported(format!(
                "libfabric {major}.{minor} takes no dma-buf (FI_MR_DMABUF is 1.20's)"
            )));
        }
        let (fd, offset) = device.dmabuf(base as u64, len as u64)?;
        // SAFETY: the caller's contract; the dma-buf is the device layer's export of that memory, open for the
        // call (a provider that keeps it takes its own reference).
        unsafe { Mr::register_as(domain, base, len, ep, true, Some((vram.hmem, Some((fd.as_raw_fd(), offset))))) }
    }

    /// # Safety
    /// As [`Mr::register_vram`] (host memory where `hmem` is None; with a dma-buf's descriptor and the offset of
    /// `base` in it, where given).
    unsafe fn register_as(
        domain: &Domain,
        base: *mut u8,
        len: usize,
        ep: &Arc<Endpoint>,
        remote: bool,
        hmem: Option<(Hmem, Option<(c_int, u64)>)>,
    ) -> Result<Mr> {
        let lib = domain.lib();
        let d = domain.0.domain;
        let mode = domain.0.mr_mode;
        let requested = if mode & FI_MR_PROV_KEY != 0 { 0 } else { domain.0.next_key.fetch_add(1, Ordering::Relaxed) };
        let access = sys::FI_READ | sys::FI_WRITE | if remote { sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE } else { 0 };
        let mut mr = null_mut();
        let (rc, what) = match hmem {
            None => {
                // SAFETY: a live domain's MR table.
                let Some(reg) = (unsafe { (*(*d).mr).reg }) else { return Err(missing(lib, "fi_mr_reg")) };
                // SAFETY: a live domain; the memory is the caller's contract; offset 0 (the region's first
                // byte is address 0 where addresses are offsets).
                (unsafe { reg(d.cast(), base.cast(), len, access, 0, requested, 0, &mut mr, null_mut()) }, "fi_mr_reg")
            }
            Some((h, dmabuf)) => {
                // SAFETY: a live domain's MR table.
                let Some(regattr) = (unsafe { (*(*d).mr).regattr }) else {
                    return Err(missing(lib, "fi_mr_regattr"));
                };
                let iov = sys::IoVec { base: base.cast(), len };
                let buf = dmabuf.map(|(fd, offset)| sys::FiMrDmabuf {
                    fd,
                    offset,
                    len,
                    base_addr: (base as usize).wrapping_sub(offset as usize) as *mut c_void,
                });
                let (iface, device) = h.iface();
                let attr = sys::FiMrAttr {
                    // The union: the dma-buf's descriptor under FI_MR_DMABUF, else the iovec.
                    mr_iov: buf.as_ref().map_or(&iov as *const sys::IoVec, |b| (b as *const sys::FiMrDmabuf).cast()),
                    iov_count: 1,
                    access,
                    offset: 0,
                    requested_key: requested,
                    context: null_mut(),
                    auth_key_size: 0,
                    auth_key: null_mut(),
                    iface,
                    device,
                    hmem_data: null_mut(),
                };
                let flags = if buf.is_some() { sys::FI_MR_DMABUF } else { 0 };
                // SAFETY: a live domain; the attributes point at locals that outlive the call (libfabric copies
                // what it keeps); the memory is the caller's contract.
                (unsafe { regattr(d.cast(), &attr, flags, &mut mr) }, "fi_mr_regattr")
            }
        };
        check(lib, what, rc)?;
        let mut m = Mr { domain: domain.clone(), mr, base, len, _ep: None };
        if mode & FI_MR_ENDPOINT != 0 {
            // SAFETY: a live region and endpoint of one domain.
            unsafe {
                bind(lib, "fi_mr_bind(ep)", mr.cast(), ep.ep.cast(), 0)?;
                enable(lib, "fi_mr_enable", mr.cast())?;
            }
            m._ep = Some(ep.clone());
        }
        Ok(m)
    }

    /// The key peers name (`fi_mr_key`).
    pub fn key(&self) -> u64 {
        // SAFETY: a live region.
        unsafe { (*self.mr).key }
    }

    /// The descriptor to pass with local uses (`fi_mr_desc`).
    pub fn desc(&self) -> *mut c_void {
        // SAFETY: a live region.
        unsafe { (*self.mr).mem_desc }
    }

    /// The key and address a peer names for `ptr` in this region (`fi_mr_key`; the virtual address or the
    /// offset, per the MR mode). None where `ptr` is outside it.
    pub fn remote(&self, ptr: *const u8) -> Option<RemoteKey> {
        let off = (ptr as usize).checked_sub(self.base as usize).filter(|o| *o <= self.len)?;
        let addr = if self.domain.0.mr_mode & FI_MR_VIRT_ADDR != 0 { ptr as u64 } else { off as u64 };
        // SAFETY: a live region (its key is set once registered, and enabled where FI_MR_ENDPOINT).
        Some(RemoteKey { addr, key: unsafe { (*self.mr).key } })
    }
}

/// Reads every queue once, handing each completion's context to `done`; an error entry ends it.
pub fn drain(cqs: &[&Cq], mut done: impl FnMut(*mut c_void)) -> Result<()> {
    for cq in cqs {
        match cq.read()? {
            CqRead::Done(v) => v.into_iter().for_each(&mut done),
            CqRead::Failed(_, e, _, _) => return Err(e),
        }
    }
    Ok(())
}

/// Time left before `deadline` (zero once past).
pub fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}
