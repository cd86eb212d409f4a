//! rdma-core's `libibverbs.so.1` (or the path in `GIXL_LIBIBVERBS`), opened at run time (`dlopen`), so that the library and the wheel have no
//! load-time dependency on it and load on machines without it: [`load`] fails with NOT_SUPPORTED saying why
//! (no library, or no device), and nothing else changes.
//!
//! Bindings are our own and thin: the exported functions this file calls, with the few struct fields it
//! reads at offsets checked against rdma-core's own header by `tests/verbs_abi.rs` (a C program compiled
//! against `<infiniband/verbs.h>` prints them). rdma-sys was the design card's choice; it links libibverbs at
//! build time (a load-time dependency on every machine) and has not moved since 2023, so it is not used.
//!
//! What runs here today: listing devices and ports (state, link layer, LID, GID, NUMA node), opening a port
//! with a protection domain, and memory regions. Completion queues and queue pairs (the data path: their
//! inline verbs go through the context's function table) are not built yet: `create_cq` and `create_qp` say
//! so with NOT_SUPPORTED. Nothing of this file has run on a NIC.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Cq, Fabric, LinkLayer, Mr, Nic, PortInfo, Qp, QpCaps};
use crate::status::{Error, Result};

/// Field offsets this file relies on, as the C test prints them: `struct ibv_port_attr`'s `state`, `lid` and
/// `link_layer`, its size, and `struct ibv_mr`'s `lkey` and `rkey`.
pub const PORT_STATE: usize = 0;
pub const PORT_LID: usize = 34;
pub const PORT_LINK_LAYER: usize = 46;
pub const PORT_ATTR_SIZE: usize = 52;
pub const MR_LKEY: usize = 36;
pub const MR_RKEY: usize = 40;
/// `IBV_PORT_ACTIVE`, `IBV_LINK_LAYER_ETHERNET`.
const PORT_ACTIVE: u32 = 4;
const LINK_ETHERNET: u8 = 2;
/// Ports probed per device (a device has one or two in practice).
const MAX_PORTS: u8 = 8;

type Ctx = c_void;

#[allow(non_snake_case)]
struct Lib {
    _handle: usize,
    get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void,
    free_device_list: unsafe extern "C" fn(*mut *mut c_void),
    get_device_name: unsafe extern "C" fn(*mut c_void) -> *const c_char,
    open_device: unsafe extern "C" fn(*mut c_void) -> *mut Ctx,
    close_device: unsafe extern "C" fn(*mut Ctx) -> c_int,
    query_port: unsafe extern "C" fn(*mut Ctx, u8, *mut u8) -> c_int,
    query_gid: unsafe extern "C" fn(*mut Ctx, u8, c_int, *mut [u8; 16]) -> c_int,
    alloc_pd: unsafe extern "C" fn(*mut Ctx) -> *mut c_void,
    dealloc_pd: unsafe extern "C" fn(*mut c_void) -> c_int,
    reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut u8,
    dereg_mr: unsafe extern "C" fn(*mut u8) -> c_int,
}

/// Open `libibverbs.so.1` (once per process) and list its devices; NOT_SUPPORTED when either fails.
pub fn load() -> Result<Arc<dyn Fabric>> {
    static LIB: std::sync::OnceLock<std::result::Result<Arc<Lib>, String>> = std::sync::OnceLock::new();
    let lib = LIB.get_or_init(|| open_lib().map(Arc::new)).clone().map_err(Error::not_supported)?;
    let f = SysFabric { lib };
    if f.ports()?.is_empty() {
        return Err(Error::not_supported("libibverbs found no RDMA device on this host"));
    }
    Ok(Arc::new(f))
}

/// `GIXL_LIBIBVERBS` (a path), else `libibverbs.so.1` from the system's library path.
fn open_lib() -> std::result::Result<Lib, String> {
    let name = std::env::var("GIXL_LIBIBVERBS").ok().filter(|p| !p.is_empty()).unwrap_or("libibverbs.so.1".into());
    let c = std::ffi::CString::new(name.clone()).map_err(|_| format!("GIXL_LIBIBVERBS={name:?} holds a NUL byte"))?;
    // SAFETY: a NUL-terminated name; RTLD_LOCAL keeps its symbols out of the global namespace.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a NUL-terminated string or NULL.
        let why = unsafe { libc::dlerror() };
        let why =
            if why.is_null() { String::new() } else { unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned() };
        return Err(format!("{name} is not installed (rdma-core), or does not load: {why}"));
    }
    let sym = |name: &CStr| {
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(h, name.as_ptr()) };
        if p.is_null() {
            Err(format!("libibverbs.so.1 has no {}", name.to_string_lossy()))
        } else {
            Ok(p)
        }
    };
    // SAFETY: each symbol is rdma-core's exported function of that name, whose C signature the field's type
    // spells (verbs.h).
    unsafe {
        Ok(Lib {
            _handle: h as usize,
            get_device_list: fn_ptr(sym(c"ibv_get_device_list")?),
            free_device_list: fn_ptr(sym(c"ibv_free_device_list")?),
            get_device_name: fn_ptr(sym(c"ibv_get_device_name")?),
            open_device: fn_ptr(sym(c"ibv_open_device")?),
            close_device: fn_ptr(sym(c"ibv_close_device")?),
            query_port: fn_ptr(sym(c"ibv_query_port")?),
            query_gid: fn_ptr(sym(c"ibv_query_gid")?),
            alloc_pd: fn_ptr(sym(c"ibv_alloc_pd")?),
            dealloc_pd: fn_ptr(sym(c"ibv_dealloc_pd")?),
            reg_mr: fn_ptr(sym(c"ibv_reg_mr")?),
            dereg_mr: fn_ptr(sym(c"ibv_dereg_mr")?),
        })
    }
}

/// A symbol's address as the function pointer type `F`.
///
/// # Safety
/// `p` is a function whose C signature `F` spells.
unsafe fn fn_ptr<F: Copy>(p: *mut c_void) -> F {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
    // SAFETY: same size (checked above); the caller vouches for the signature.
    unsafe { std::mem::transmute_copy(&p) }
}

struct SysFabric {
    lib: Arc<Lib>,
}

/// An opened device context (closed on drop).
struct Context {
    lib: Arc<Lib>,
    ctx: *mut Ctx,
}

// SAFETY: rdma-core's verbs are thread-safe on one context.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by `open_device`, closed once.
        unsafe { (self.lib.close_device)(self.ctx) };
    }
}

impl SysFabric {
    /// Every device by name, opened one at a time.
    fn each_device(&self, mut f: impl FnMut(&str, &Context) -> Result<()>) -> Result<()> {
        let mut n: c_int = 0;
        // SAFETY: the out-parameter is a valid int.
        let list = unsafe { (self.lib.get_device_list)(&mut n) };
        if list.is_null() {
            // ENOSYS: the kernel has no RDMA support (no device either way).
            return Err(Error::not_supported(format!(
                "libibverbs found no RDMA device on this host (ibv_get_device_list: {})",
                std::io::Error::last_os_error()
            )));
        }
        let mut r = Ok(());
        for i in 0..n.max(0) as usize {
            // SAFETY: `list` holds `n` device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a device of the list; the name is a NUL-terminated string it owns.
            let name = unsafe { CStr::from_ptr((self.lib.get_device_name)(dev)) }.to_string_lossy().into_owned();
            // SAFETY: a device of the list, still live (the list is freed below).
            let ctx = unsafe { (self.lib.open_device)(dev) };
            if ctx.is_null() {
                continue;
            }
            r = f(&name, &Context { lib: self.lib.clone(), ctx });
            if r.is_err() {
                break;
            }
        }
        // SAFETY: returned by get_device_list, freed once.
        unsafe { (self.lib.free_device_list)(list) };
        r
    }

    fn port_info(&self, name: &str, c: &Context, port: u8) -> Option<PortInfo> {
        let mut attr = [0u8; 128];
        // SAFETY: a live context; the buffer is larger than `struct ibv_port_attr` (PORT_ATTR_SIZE), zeroed.
        if unsafe { (self.lib.query_port)(c.ctx, port, attr.as_mut_ptr()) } != 0 {
            return None;
        }
        let state = u32::from_ne_bytes(attr[PORT_STATE..PORT_STATE + 4].try_into().ok()?);
        let lid = u16::from_ne_bytes(attr[PORT_LID..PORT_LID + 2].try_into().ok()?);
        let mut gid = [0u8; 16];
        // SAFETY: a live context, a port that answered, a 16-byte out-parameter.
        unsafe { (self.lib.query_gid)(c.ctx, port, 0, &mut gid) };
        let numa = std::fs::read_to_string(format!("/sys/class/infiniband/{name}/device/numa_node"))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .filter(|&n| n >= 0);
        Some(PortInfo {
            device: name.to_owned(),
            port,
            link: if attr[PORT_LINK_LAYER] == LINK_ETHERNET { LinkLayer::Ethernet } else { LinkLayer::InfiniBand },
            active: state == PORT_ACTIVE,
            lid,
            gid,
            numa,
        })
    }
}

impl Fabric for SysFabric {
    fn name(&self) -> &'static str {
        "ibverbs"
    }

    fn ports(&self) -> Result<Vec<PortInfo>> {
        let mut out = Vec::new();
        self.each_device(|name, c| {
            out.extend((1..=MAX_PORTS).map_while(|p| self.port_info(name, c, p)));
            Ok(())
        })?;
        Ok(out)
    }

    fn open(&self, device: &str, port: u8) -> Result<Arc<dyn Nic>> {
        let ctx = self.reopen(device)?;
        let info = self
            .port_info(device, &ctx, port)
            .ok_or_else(|| Error::not_found(format!("no RDMA port {device}:{port}")))?;
        // SAFETY: a live context.
        let pd = unsafe { (self.lib.alloc_pd)(ctx.ctx) };
        if pd.is_null() {
            return Err(Error::backend(format!(
                "ibv_alloc_pd on {device} failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(Arc::new(SysNic { ctx, pd, port: info, mrs: Mutex::new(HashMap::new()) }))
    }
}

impl SysFabric {
    fn reopen(&self, device: &str) -> Result<Context> {
        let mut n: c_int = 0;
        // SAFETY: as in `each_device`.
        let list = unsafe { (self.lib.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(Error::backend("ibv_get_device_list failed"));
        }
        let mut ctx = std::ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: as in `each_device`.
            let dev = unsafe { *list.add(i) };
            // SAFETY: as in `each_device`.
            let name = unsafe { CStr::from_ptr((self.lib.get_device_name)(dev)) };
            if name.to_bytes() == device.as_bytes() {
                // SAFETY: a live device of the list.
                ctx = unsafe { (self.lib.open_device)(dev) };
                break;
            }
        }
        // SAFETY: freed once; an opened context outlives the list.
        unsafe { (self.lib.free_device_list)(list) };
        if ctx.is_null() {
            return Err(Error::not_found(format!("cannot open RDMA device {device}")));
        }
        Ok(Context { lib: self.lib.clone(), ctx })
    }
}

struct SysNic {
    ctx: Context,
    pd: *mut c_void,
    port: PortInfo,
    mrs: Mutex<HashMap<u64, usize>>,
}

// SAFETY: rdma-core's verbs are thread-safe; the maps are behind a lock.
unsafe impl Send for SysNic {}
// SAFETY: as above.
unsafe impl Sync for SysNic {}

impl Drop for SysNic {
    fn drop(&mut self) {
        for (_, mr) in self.mrs.get_mut().drain() {
            // SAFETY: registered by `reg_mr`, deregistered once.
            unsafe { (self.ctx.lib.dereg_mr)(mr as *mut u8) };
        }
        // SAFETY: allocated by `alloc_pd`, its regions deregistered above.
        unsafe { (self.ctx.lib.dealloc_pd)(self.pd) };
    }
}

impl Nic for SysNic {
    fn port(&self) -> &PortInfo {
        &self.port
    }

    fn reg_mr(&self, addr: u64, len: u64, access: u32) -> Result<Mr> {
        // SAFETY: the caller keeps `[addr, addr + len)` mapped while it is registered (the engine's contract
        // with its user, as for every other route).
        let mr = unsafe { (self.ctx.lib.reg_mr)(self.pd, addr as *mut c_void, len as usize, access as c_int) };
        if mr.is_null() {
            return Err(Error::backend(format!(
                "ibv_reg_mr of {len} bytes at {addr:#x} failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `mr` is a live `struct ibv_mr`; the offsets are checked against the header by the ABI test.
        let (lkey, rkey) = unsafe { (mr.add(MR_LKEY).cast::<u32>().read(), mr.add(MR_RKEY).cast::<u32>().read()) };
        self.mrs.lock().insert(mr as u64, mr as usize);
        Ok(Mr { addr, len, lkey, rkey, id: mr as u64 })
    }

    fn dereg_mr(&self, mr: &Mr) -> Result<()> {
        let Some(p) = self.mrs.lock().remove(&mr.id) else {
            return Err(Error::not_found(format!("no memory region with key {:#x}", mr.rkey)));
        };
        // SAFETY: registered by `reg_mr`, taken out of the map, deregistered once.
        match unsafe { (self.ctx.lib.dereg_mr)(p as *mut u8) } {
            0 => Ok(()),
            e => Err(Error::backend(format!("ibv_dereg_mr failed: {}", std::io::Error::from_raw_os_error(e)))),
        }
    }

    fn create_cq(&self, _depth: u32) -> Result<Arc<dyn Cq>> {
        Err(not_yet())
    }

    fn create_qp(&self, _: &Arc<dyn Cq>, _: &Arc<dyn Cq>, _: QpCaps) -> Result<Arc<dyn Qp>> {
        Err(not_yet())
    }
}

fn not_yet() -> Error {
    Error::not_supported(
        "gixl's rdma-core data path (completion queues, queue pairs) is not built yet; the fake fabric \
         (GIXL_FAKE_VERBS) has it",
    )
}
