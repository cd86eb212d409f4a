//! rdma-core's `libibverbs.so.1` (or the path in `GIXL_LIBIBVERBS`), opened at run time (`dlopen`), so that
//! the library and the wheel have no load-time dependency on it and load on machines without it: [`load`]
//! fails with NOT_SUPPORTED saying why (no library, or no device), and nothing else changes.
//!
//! Bindings are our own and thin: the exported functions this file calls, the inline verbs (`ibv_poll_cq`,
//! `ibv_req_notify_cq`, `ibv_post_send`, `ibv_post_recv`) through the context's function table as rdma-core's
//! header defines them, and `#[repr(C)]` mirrors of the structs they take. Every offset, size and constant
//! here is checked against rdma-core's own header by `tests/verbs_abi.rs` (a C program compiled against
//! `<infiniband/verbs.h>` prints them; [`ABI`] lists ours). rdma-sys was the design card's choice; it links
//! libibverbs at build time (a load-time dependency on every machine) and has not moved since 2023, so it is
//! not used.
//!
//! What has run: loading, and listing on a host without a device (the library's no-device answer). Nothing of
//! the data path (domains, regions, queues, pairs, work requests) has run on a NIC yet.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::mem::offset_of;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{
    Completion, Cq, Fabric, LinkLayer, Mr, Nic, Op, PortEvent, PortInfo, Qp, QpAddr, QpCaps, Sge, WcKind, WcStatus, Wr,
};
use super::{LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE};
use crate::os::dl::fn_ptr;
use crate::status::{Error, Result, Status};

/// `struct ibv_port_attr` fields read (offsets), and its size.
pub const PORT_STATE: usize = 0;
pub const PORT_ACTIVE_MTU: usize = 8;
pub const PORT_LID: usize = 34;
pub const PORT_LINK_LAYER: usize = 46;
pub const PORT_ATTR_SIZE: usize = 52;
/// `struct ibv_mr`'s keys, `struct ibv_comp_channel`'s fd, `struct ibv_qp`'s number.
pub const MR_LKEY: usize = 36;
pub const MR_RKEY: usize = 40;
pub const CHANNEL_FD: usize = 8;
pub const CONTEXT_ASYNC_FD: usize = 268;
pub const ASYNC_EVENT_TYPE: usize = 8;
pub const ASYNC_EVENT_SIZE: usize = 16;
pub const QP_NUM: usize = 52;
/// `struct ibv_context`'s function table entries this file calls.
pub const OPS_POLL_CQ: usize = 8 + 11 * 8;
pub const OPS_REQ_NOTIFY_CQ: usize = 8 + 12 * 8;
pub const OPS_POST_SEND: usize = 8 + 25 * 8;
pub const OPS_POST_RECV: usize = 8 + 26 * 8;

const PORT_ACTIVE: u32 = 4;
const EVENT_DEVICE_FATAL: u32 = 8;
const EVENT_PORT_ACTIVE: u32 = 9;
const EVENT_PORT_ERR: u32 = 10;
const LINK_ETHERNET: u8 = 2;
const QPT_RC: u32 = 2;
const QPS_INIT: u32 = 1;
const QPS_RTR: u32 = 2;
const QPS_RTS: u32 = 3;
const QPS_ERR: u32 = 6;
const QP_STATE: c_int = 1;
const QP_ACCESS_FLAGS: c_int = 1 << 3;
const QP_PKEY_INDEX: c_int = 1 << 4;
const QP_PORT: c_int = 1 << 5;
const QP_AV: c_int = 1 << 7;
const QP_PATH_MTU: c_int = 1 << 8;
const QP_TIMEOUT: c_int = 1 << 9;
const QP_RETRY_CNT: c_int = 1 << 10;
const QP_RNR_RETRY: c_int = 1 << 11;
const QP_RQ_PSN: c_int = 1 << 12;
const QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
const QP_MIN_RNR_TIMER: c_int = 1 << 15;
const QP_SQ_PSN: c_int = 1 << 16;
const QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
const QP_DEST_QPN: c_int = 1 << 20;
const WR_RDMA_WRITE: u32 = 0;
const WR_RDMA_WRITE_WITH_IMM: u32 = 1;
const WR_SEND: u32 = 2;
const WR_SEND_WITH_IMM: u32 = 3;
const WR_RDMA_READ: u32 = 4;
const SEND_SIGNALED: u32 = 1 << 1;
const WC_SEND: u32 = 0;
const WC_RDMA_WRITE: u32 = 1;
const WC_RDMA_READ: u32 = 2;
const WC_RECV: u32 = 128;
const WC_RECV_RDMA_WITH_IMM: u32 = 129;
const WC_WITH_IMM: u32 = 1 << 1;
/// Ports probed per device (a device has one or two in practice).
const MAX_PORTS: u8 = 8;
/// Reads and atomics a pair keeps in flight each way (most NICs allow 16).
const RD_ATOMIC: u8 = 16;

#[repr(C)]
#[derive(Clone, Copy)]
struct IbvSge {
    addr: u64,
    length: u32,
    lkey: u32,
}

#[repr(C)]
struct IbvSendWr {
    wr_id: u64,
    next: *mut IbvSendWr,
    sg_list: *mut IbvSge,
    num_sge: c_int,
    opcode: u32,
    send_flags: u32,
    imm_data: u32,
    /// `wr.rdma`, the first member of the 32-byte `wr` union.
    remote_addr: u64,
    rkey: u32,
    _wr_rest: [u8; 20],
    /// `qp_type` and the `bind_mw`/`tso` union.
    _tail: [u8; 56],
}

#[repr(C)]
struct IbvRecvWr {
    wr_id: u64,
    next: *mut IbvRecvWr,
    sg_list: *mut IbvSge,
    num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct IbvWc {
    wr_id: u64,
    status: u32,
    opcode: u32,
    vendor_err: u32,
    byte_len: u32,
    imm_data: u32,
    qp_num: u32,
    src_qp: u32,
    wc_flags: u32,
    pkey_index: u16,
    slid: u16,
    sl: u8,
    dlid_path_bits: u8,
}

#[repr(C)]
struct IbvQpInitAttr {
    qp_context: *mut c_void,
    send_cq: *mut c_void,
    recv_cq: *mut c_void,
    srq: *mut c_void,
    max_send_wr: u32,
    max_recv_wr: u32,
    max_send_sge: u32,
    max_recv_sge: u32,
    max_inline_data: u32,
    qp_type: u32,
    sq_sig_all: c_int,
}

/// 8-aligned as rdma-core's (its GID is a union with two `__be64`).
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct IbvAhAttr {
    dgid: [u8; 16],
    flow_label: u32,
    sgid_index: u8,
    hop_limit: u8,
    traffic_class: u8,
    dlid: u16,
    sl: u8,
    src_path_bits: u8,
    static_rate: u8,
    is_global: u8,
    port_num: u8,
}

#[repr(C)]
struct IbvQpAttr {
    qp_state: u32,
    cur_qp_state: u32,
    path_mtu: u32,
    path_mig_state: u32,
    qkey: u32,
    rq_psn: u32,
    sq_psn: u32,
    dest_qp_num: u32,
    qp_access_flags: u32,
    cap: [u32; 5],
    ah_attr: IbvAhAttr,
    alt_ah_attr: IbvAhAttr,
    pkey_index: u16,
    alt_pkey_index: u16,
    en_sqd_async_notify: u8,
    sq_draining: u8,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    min_rnr_timer: u8,
    port_num: u8,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    alt_port_num: u8,
    alt_timeout: u8,
    rate_limit: u32,
}

/// Every layout fact and constant the bindings rely on, by the name the ABI test's C program prints.
pub const ABI: &[(&str, usize)] = &[
    ("port_attr.state", PORT_STATE),
    ("port_attr.active_mtu", PORT_ACTIVE_MTU),
    ("port_attr.lid", PORT_LID),
    ("port_attr.link_layer", PORT_LINK_LAYER),
    ("sizeof.port_attr", PORT_ATTR_SIZE),
    ("mr.lkey", MR_LKEY),
    ("mr.rkey", MR_RKEY),
    ("comp_channel.fd", CHANNEL_FD),
    ("qp.qp_num", QP_NUM),
    ("context.ops.poll_cq", OPS_POLL_CQ),
    ("context.ops.req_notify_cq", OPS_REQ_NOTIFY_CQ),
    ("context.ops.post_send", OPS_POST_SEND),
    ("context.ops.post_recv", OPS_POST_RECV),
    ("sizeof.sge", std::mem::size_of::<IbvSge>()),
    ("sizeof.send_wr", std::mem::size_of::<IbvSendWr>()),
    ("send_wr.num_sge", offset_of!(IbvSendWr, num_sge)),
    ("send_wr.opcode", offset_of!(IbvSendWr, opcode)),
    ("send_wr.send_flags", offset_of!(IbvSendWr, send_flags)),
    ("send_wr.imm_data", offset_of!(IbvSendWr, imm_data)),
    ("send_wr.wr.rdma.remote_addr", offset_of!(IbvSendWr, remote_addr)),
    ("send_wr.wr.rdma.rkey", offset_of!(IbvSendWr, rkey)),
    ("sizeof.recv_wr", std::mem::size_of::<IbvRecvWr>()),
    ("sizeof.wc", std::mem::size_of::<IbvWc>()),
    ("wc.status", offset_of!(IbvWc, status)),
    ("wc.opcode", offset_of!(IbvWc, opcode)),
    ("wc.byte_len", offset_of!(IbvWc, byte_len)),
    ("wc.imm_data", offset_of!(IbvWc, imm_data)),
    ("wc.wc_flags", offset_of!(IbvWc, wc_flags)),
    ("sizeof.qp_init_attr", std::mem::size_of::<IbvQpInitAttr>()),
    ("qp_init_attr.cap", offset_of!(IbvQpInitAttr, max_send_wr)),
    ("qp_init_attr.qp_type", offset_of!(IbvQpInitAttr, qp_type)),
    ("sizeof.qp_attr", std::mem::size_of::<IbvQpAttr>()),
    ("qp_attr.dest_qp_num", offset_of!(IbvQpAttr, dest_qp_num)),
    ("qp_attr.qp_access_flags", offset_of!(IbvQpAttr, qp_access_flags)),
    ("qp_attr.ah_attr", offset_of!(IbvQpAttr, ah_attr)),
    ("qp_attr.ah_attr.dlid", offset_of!(IbvQpAttr, ah_attr) + offset_of!(IbvAhAttr, dlid)),
    ("qp_attr.ah_attr.is_global", offset_of!(IbvQpAttr, ah_attr) + offset_of!(IbvAhAttr, is_global)),
    ("qp_attr.ah_attr.port_num", offset_of!(IbvQpAttr, ah_attr) + offset_of!(IbvAhAttr, port_num)),
    ("qp_attr.pkey_index", offset_of!(IbvQpAttr, pkey_index)),
    ("qp_attr.max_rd_atomic", offset_of!(IbvQpAttr, max_rd_atomic)),
    ("qp_attr.port_num", offset_of!(IbvQpAttr, port_num)),
    ("qp_attr.rnr_retry", offset_of!(IbvQpAttr, rnr_retry)),
    ("qp_attr.rate_limit", offset_of!(IbvQpAttr, rate_limit)),
    ("IBV_PORT_ACTIVE", PORT_ACTIVE as usize),
    ("context.async_fd", CONTEXT_ASYNC_FD),
    ("async_event.event_type", ASYNC_EVENT_TYPE),
    ("sizeof.async_event", ASYNC_EVENT_SIZE),
    ("IBV_EVENT_DEVICE_FATAL", EVENT_DEVICE_FATAL as usize),
    ("IBV_EVENT_PORT_ACTIVE", EVENT_PORT_ACTIVE as usize),
    ("IBV_EVENT_PORT_ERR", EVENT_PORT_ERR as usize),
    ("IBV_LINK_LAYER_ETHERNET", LINK_ETHERNET as usize),
    ("IBV_QPT_RC", QPT_RC as usize),
    ("IBV_QPS_INIT", QPS_INIT as usize),
    ("IBV_QPS_RTR", QPS_RTR as usize),
    ("IBV_QPS_RTS", QPS_RTS as usize),
    ("IBV_QPS_ERR", QPS_ERR as usize),
    ("IBV_QP_STATE", QP_STATE as usize),
    ("IBV_QP_ACCESS_FLAGS", QP_ACCESS_FLAGS as usize),
    ("IBV_QP_PKEY_INDEX", QP_PKEY_INDEX as usize),
    ("IBV_QP_PORT", QP_PORT as usize),
    ("IBV_QP_AV", QP_AV as usize),
    ("IBV_QP_PATH_MTU", QP_PATH_MTU as usize),
    ("IBV_QP_TIMEOUT", QP_TIMEOUT as usize),
    ("IBV_QP_RETRY_CNT", QP_RETRY_CNT as usize),
    ("IBV_QP_RNR_RETRY", QP_RNR_RETRY as usize),
    ("IBV_QP_RQ_PSN", QP_RQ_PSN as usize),
    ("IBV_QP_MAX_QP_RD_ATOMIC", QP_MAX_QP_RD_ATOMIC as usize),
    ("IBV_QP_MIN_RNR_TIMER", QP_MIN_RNR_TIMER as usize),
    ("IBV_QP_SQ_PSN", QP_SQ_PSN as usize),
    ("IBV_QP_MAX_DEST_RD_ATOMIC", QP_MAX_DEST_RD_ATOMIC as usize),
    ("IBV_QP_DEST_QPN", QP_DEST_QPN as usize),
    ("IBV_WR_RDMA_WRITE", WR_RDMA_WRITE as usize),
    ("IBV_WR_RDMA_WRITE_WITH_IMM", WR_RDMA_WRITE_WITH_IMM as usize),
    ("IBV_WR_SEND", WR_SEND as usize),
    ("IBV_WR_SEND_WITH_IMM", WR_SEND_WITH_IMM as usize),
    ("IBV_WR_RDMA_READ", WR_RDMA_READ as usize),
    ("IBV_SEND_SIGNALED", SEND_SIGNALED as usize),
    ("IBV_WC_SEND", WC_SEND as usize),
    ("IBV_WC_RDMA_WRITE", WC_RDMA_WRITE as usize),
    ("IBV_WC_RDMA_READ", WC_RDMA_READ as usize),
    ("IBV_WC_RECV", WC_RECV as usize),
    ("IBV_WC_RECV_RDMA_WITH_IMM", WC_RECV_RDMA_WITH_IMM as usize),
    ("IBV_WC_WITH_IMM", WC_WITH_IMM as usize),
    ("IBV_WC_LOC_PROT_ERR", 4),
    ("IBV_WC_WR_FLUSH_ERR", 5),
    ("IBV_WC_REM_ACCESS_ERR", 10),
    ("IBV_WC_RETRY_EXC_ERR", 12),
    ("IBV_ACCESS_LOCAL_WRITE", LOCAL_WRITE as usize),
    ("IBV_ACCESS_REMOTE_WRITE", REMOTE_WRITE as usize),
    ("IBV_ACCESS_REMOTE_READ", REMOTE_READ as usize),
];

type PollCq = unsafe extern "C" fn(*mut c_void, c_int, *mut IbvWc) -> c_int;
type ReqNotifyCq = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;
type PostSend = unsafe extern "C" fn(*mut c_void, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int;
type PostRecv = unsafe extern "C" fn(*mut c_void, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;

struct Lib {
    get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void,
    free_device_list: unsafe extern "C" fn(*mut *mut c_void),
    get_device_name: unsafe extern "C" fn(*mut c_void) -> *const c_char,
    open_device: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    close_device: unsafe extern "C" fn(*mut c_void) -> c_int,
    query_port: unsafe extern "C" fn(*mut c_void, u8, *mut u8) -> c_int,
    query_gid: unsafe extern "C" fn(*mut c_void, u8, c_int, *mut [u8; 16]) -> c_int,
    alloc_pd: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    dealloc_pd: unsafe extern "C" fn(*mut c_void) -> c_int,
    reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut u8,
    /// rdma-core 34 and later (`pd, offset, length, iova, fd, access`).
    reg_dmabuf_mr: Option<unsafe extern "C" fn(*mut c_void, u64, usize, u64, c_int, c_int) -> *mut u8>,
    dereg_mr: unsafe extern "C" fn(*mut u8) -> c_int,
    create_comp_channel: unsafe extern "C" fn(*mut c_void) -> *mut u8,
    destroy_comp_channel: unsafe extern "C" fn(*mut u8) -> c_int,
    create_cq: unsafe extern "C" fn(*mut c_void, c_int, *mut c_void, *mut u8, c_int) -> *mut c_void,
    destroy_cq: unsafe extern "C" fn(*mut c_void) -> c_int,
    get_cq_event: unsafe extern "C" fn(*mut u8, *mut *mut c_void, *mut *mut c_void) -> c_int,
    ack_cq_events: unsafe extern "C" fn(*mut c_void, u32),
    get_async_event: unsafe extern "C" fn(*mut c_void, *mut u8) -> c_int,
    ack_async_event: unsafe extern "C" fn(*mut u8),
    create_qp: unsafe extern "C" fn(*mut c_void, *mut IbvQpInitAttr) -> *mut u8,
    modify_qp: unsafe extern "C" fn(*mut u8, *mut IbvQpAttr, c_int) -> c_int,
    destroy_qp: unsafe extern "C" fn(*mut u8) -> c_int,
}

/// Open the library (once per process) and list its devices; NOT_SUPPORTED when either fails.
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
    let dl = crate::os::dl::open("GIXL_LIBIBVERBS", "libibverbs.so.1", "rdma-core")?;
    let sym = |s: &CStr| dl.sym(s);
    // SAFETY: each symbol is rdma-core's exported function of that name, whose C signature the field's type
    // spells (verbs.h).
    unsafe {
        Ok(Lib {
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
            reg_dmabuf_mr: sym(c"ibv_reg_dmabuf_mr").ok().map(|p| fn_ptr(p)),
            dereg_mr: fn_ptr(sym(c"ibv_dereg_mr")?),
            create_comp_channel: fn_ptr(sym(c"ibv_create_comp_channel")?),
            destroy_comp_channel: fn_ptr(sym(c"ibv_destroy_comp_channel")?),
            create_cq: fn_ptr(sym(c"ibv_create_cq")?),
            destroy_cq: fn_ptr(sym(c"ibv_destroy_cq")?),
            get_cq_event: fn_ptr(sym(c"ibv_get_cq_event")?),
            ack_cq_events: fn_ptr(sym(c"ibv_ack_cq_events")?),
            get_async_event: fn_ptr(sym(c"ibv_get_async_event")?),
            ack_async_event: fn_ptr(sym(c"ibv_ack_async_event")?),
            create_qp: fn_ptr(sym(c"ibv_create_qp")?),
            modify_qp: fn_ptr(sym(c"ibv_modify_qp")?),
            destroy_qp: fn_ptr(sym(c"ibv_destroy_qp")?),
        })
    }
}

fn os_err(what: &str) -> Error {
    Error::backend(format!("{what} failed: {}", std::io::Error::last_os_error()))
}

fn rc_err(what: &str, rc: c_int) -> Error {
    Error::backend(format!("{what} failed: {}", std::io::Error::from_raw_os_error(rc.abs())))
}

struct SysFabric {
    lib: Arc<Lib>,
}

/// An opened device context (closed when the last user goes).
struct Context {
    lib: Arc<Lib>,
    ctx: *mut c_void,
}

// SAFETY: rdma-core's verbs are thread-safe on one context.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by `open_device`, closed once, after every object made from it (they hold it).
        unsafe { (self.lib.close_device)(self.ctx) };
    }
}

impl Context {
    /// The context's async event descriptor.
    fn async_fd(&self) -> RawFd {
        // SAFETY: `ctx` is a live `struct ibv_context`; the offset is checked against the header by the ABI test.
        unsafe { (self.ctx as *const u8).add(CONTEXT_ASYNC_FD).cast::<c_int>().read() }
    }

    /// The function-table entry at `offset` of the context (an inline verb's target).
    fn op<F: Copy>(&self, offset: usize) -> F {
        // SAFETY: `ctx` is a live `struct ibv_context`; the offset is one of the `OPS_*` the ABI test checks,
        // holding a function pointer of type `F`.
        unsafe { fn_ptr(self.ctx.cast::<u8>().add(offset).cast::<*mut c_void>().read()) }
    }
}

impl SysFabric {
    /// Open each device (by name) in turn.
    fn each_device(&self, mut f: impl FnMut(&str, Context)) -> Result<()> {
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
        for i in 0..n.max(0) as usize {
            // SAFETY: `list` holds `n` device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a device of the list; its name is a NUL-terminated string it owns.
            let name = unsafe { CStr::from_ptr((self.lib.get_device_name)(dev)) }.to_string_lossy().into_owned();
            // SAFETY: a device of the live list (an opened context outlives the list).
            let ctx = unsafe { (self.lib.open_device)(dev) };
            if !ctx.is_null() {
                f(&name, Context { lib: self.lib.clone(), ctx });
            }
        }
        // SAFETY: returned by get_device_list, freed once.
        unsafe { (self.lib.free_device_list)(list) };
        Ok(())
    }

    fn port_info(&self, name: &str, c: &Context, port: u8) -> Option<(PortInfo, u32)> {
        let mut attr = [0u8; 128];
        // SAFETY: a live context; the buffer is larger than `struct ibv_port_attr` (PORT_ATTR_SIZE), zeroed.
        if unsafe { (self.lib.query_port)(c.ctx, port, attr.as_mut_ptr()) } != 0 {
            return None;
        }
        let u32_at = |o: usize| attr[o..o + 4].try_into().ok().map(u32::from_ne_bytes);
        let mut gid = [0u8; 16];
        // SAFETY: a live context, a port that answered, a 16-byte out-parameter.
        unsafe { (self.lib.query_gid)(c.ctx, port, 0, &mut gid) };
        let (numa, pci) = crate::os::nic_place(std::path::Path::new(&format!("/sys/class/infiniband/{name}/device")));
        let info = PortInfo {
            device: name.to_owned(),
            port,
            link: if attr[PORT_LINK_LAYER] == LINK_ETHERNET { LinkLayer::Ethernet } else { LinkLayer::InfiniBand },
            active: u32_at(PORT_STATE)? == PORT_ACTIVE,
            lid: u16::from_ne_bytes([attr[PORT_LID], attr[PORT_LID + 1]]),
            gid,
            numa,
            pci,
        };
        Some((info, u32_at(PORT_ACTIVE_MTU)?))
    }
}

impl Fabric for SysFabric {
    fn name(&self) -> &'static str {
        "ibverbs"
    }

    fn ports(&self) -> Result<Vec<PortInfo>> {
        let mut out = Vec::new();
        self.each_device(|name, c| {
            out.extend((1..=MAX_PORTS).map_while(|p| self.port_info(name, &c, p).map(|i| i.0)))
        })?;
        Ok(out)
    }

    fn open(&self, device: &str, port: u8) -> Result<Arc<dyn Nic>> {
        let mut found = None;
        self.each_device(|name, c| {
            if name == device && found.is_none() {
                found = Some(c);
            }
        })?;
        let ctx = Arc::new(found.ok_or_else(|| Error::not_found(format!("no RDMA device {device}")))?);
        let (info, mtu) = self
            .port_info(device, &ctx, port)
            .ok_or_else(|| Error::not_found(format!("no RDMA port {device}:{port}")))?;
        // SAFETY: a live context.
        let pd = unsafe { (self.lib.alloc_pd)(ctx.ctx) };
        if pd.is_null() {
            return Err(os_err(&format!("ibv_alloc_pd on {device}")));
        }
        // Async events are read without blocking (`port_event`, when `event_fd` is readable).
        let async_fd = ctx.async_fd();
        // SAFETY: fcntl on the context's own descriptor.
        unsafe {
            let fl = libc::fcntl(async_fd, libc::F_GETFL);
            libc::fcntl(async_fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        let pd = Arc::new(Pd { ctx, pd });
        Ok(Arc::new(SysNic { pd, port: info, mtu, mrs: Mutex::new(HashMap::new()) }))
    }
}

/// A protection domain (deallocated when the last pair and the `Nic` are gone).
struct Pd {
    ctx: Arc<Context>,
    pd: *mut c_void,
}

// SAFETY: rdma-core's verbs are thread-safe.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated by `alloc_pd`; its regions and pairs are gone (they hold it).
        unsafe { (self.ctx.lib.dealloc_pd)(self.pd) };
    }
}

struct SysNic {
    pd: Arc<Pd>,
    port: PortInfo,
    /// The port's active MTU (`enum ibv_mtu`), for connecting pairs.
    mtu: u32,
    mrs: Mutex<HashMap<u64, usize>>,
}

impl Drop for SysNic {
    fn drop(&mut self) {
        for (_, mr) in self.mrs.get_mut().drain() {
            // SAFETY: registered by `reg_mr`, deregistered once.
            unsafe { (self.pd.ctx.lib.dereg_mr)(mr as *mut u8) };
        }
    }
}

impl Nic for SysNic {
    fn port(&self) -> &PortInfo {
        &self.port
    }

    fn event_fd(&self) -> RawFd {
        self.pd.ctx.async_fd()
    }

    fn port_event(&self) -> Result<Option<PortEvent>> {
        let lib = &self.pd.ctx.lib;
        loop {
            let mut ev = [0u8; ASYNC_EVENT_SIZE];
            // SAFETY: a live context; `ev` is a `struct ibv_async_event` (size checked by the ABI test); the
            // descriptor is non-blocking (set at open).
            if unsafe { (lib.get_async_event)(self.pd.ctx.ctx, ev.as_mut_ptr()) } != 0 {
                let e = std::io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EAGAIN) => Ok(None),
                    _ => Err(Error::backend(format!("ibv_get_async_event failed: {e}"))),
                };
            }
            let kind = u32::from_ne_bytes([
                ev[ASYNC_EVENT_TYPE],
                ev[ASYNC_EVENT_TYPE + 1],
                ev[ASYNC_EVENT_TYPE + 2],
                ev[ASYNC_EVENT_TYPE + 3],
            ]);
            let port = i32::from_ne_bytes([ev[0], ev[1], ev[2], ev[3]]);
            // SAFETY: an event `get_async_event` returned, acknowledged once (destroying a pair waits for that).
            unsafe { (lib.ack_async_event)(ev.as_mut_ptr()) };
            let mine = port == i32::from(self.port.port);
            match kind {
                EVENT_DEVICE_FATAL => return Ok(Some(PortEvent::Down)),
                EVENT_PORT_ERR if mine => return Ok(Some(PortEvent::Down)),
                EVENT_PORT_ACTIVE if mine => return Ok(Some(PortEvent::Up)),
                _ => {}
            }
        }
    }

    fn reg_mr(&self, addr: u64, len: u64, access: u32) -> Result<Mr> {
        let lib = &self.pd.ctx.lib;
        // SAFETY: the caller keeps `[addr, addr + len)` mapped while it is registered (the engine's contract
        // with its user, as for every other route).
        let mr = unsafe { (lib.reg_mr)(self.pd.pd, addr as *mut c_void, len as usize, access as c_int) };
        if mr.is_null() {
            return Err(os_err(&format!("ibv_reg_mr of {len} bytes at {addr:#x}")));
        }
        // SAFETY: `mr` is a live `struct ibv_mr`; the offsets are checked against the header by the ABI test.
        let (lkey, rkey) = unsafe { (mr.add(MR_LKEY).cast::<u32>().read(), mr.add(MR_RKEY).cast::<u32>().read()) };
        self.mrs.lock().insert(mr as u64, mr as usize);
        Ok(Mr { addr, len, lkey, rkey, id: mr as u64 })
    }

    fn reg_dmabuf_mr(&self, fd: BorrowedFd<'_>, offset: u64, len: u64, iova: u64, access: u32) -> Result<Mr> {
        let lib = &self.pd.ctx.lib;
        let Some(reg) = lib.reg_dmabuf_mr else {
            return Err(Error::not_supported("libibverbs has no ibv_reg_dmabuf_mr (rdma-core older than 34)"));
        };
        // SAFETY: `fd` is a live dma-buf the caller holds for the call; the NIC's driver takes its own reference.
        let mr = unsafe { reg(self.pd.pd, offset, len as usize, iova, fd.as_raw_fd(), access as c_int) };
        if mr.is_null() {
            let e = std::io::Error::last_os_error();
            let what = format!("ibv_reg_dmabuf_mr of {len} bytes at iova {iova:#x}");
            return Err(match e.raw_os_error() {
                // The NIC's kernel driver (or the kernel) does not take dma-bufs.
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EPROTONOSUPPORT) => {
                    Error::os(Status::NotSupported, what, e)
                }
                _ => Error::backend(format!("{what} failed: {e}")),
            });
        }
        // SAFETY: as in `reg_mr`.
        let (lkey, rkey) = unsafe { (mr.add(MR_LKEY).cast::<u32>().read(), mr.add(MR_RKEY).cast::<u32>().read()) };
        self.mrs.lock().insert(mr as u64, mr as usize);
        Ok(Mr { addr: iova, len, lkey, rkey, id: mr as u64 })
    }

    fn dereg_mr(&self, mr: &Mr) -> Result<()> {
        let Some(p) = self.mrs.lock().remove(&mr.id) else {
            return Err(Error::not_found(format!("no memory region with key {:#x}", mr.rkey)));
        };
        // SAFETY: registered by `reg_mr`, taken out of the map, deregistered once.
        match unsafe { (self.pd.ctx.lib.dereg_mr)(p as *mut u8) } {
            0 => Ok(()),
            rc => Err(rc_err("ibv_dereg_mr", rc)),
        }
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn Cq>> {
        let ctx = self.pd.ctx.clone();
        // SAFETY: a live context.
        let channel = unsafe { (ctx.lib.create_comp_channel)(ctx.ctx) };
        if channel.is_null() {
            return Err(os_err("ibv_create_comp_channel"));
        }
        // SAFETY: a live channel; the fd field's offset is checked by the ABI test.
        let fd = unsafe { channel.add(CHANNEL_FD).cast::<c_int>().read() };
        // The engine waits on it with poll(2); reading it (get_cq_event) must never block.
        // SAFETY: the channel's own descriptor.
        unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
        // SAFETY: a live context and channel.
        let cq = unsafe { (ctx.lib.create_cq)(ctx.ctx, depth.max(1) as c_int, std::ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let e = os_err("ibv_create_cq");
            // SAFETY: created above, unused.
            unsafe { (ctx.lib.destroy_comp_channel)(channel) };
            return Err(e);
        }
        Ok(Arc::new(SysCq { ctx, channel, cq, fd }))
    }

    fn create_qp(&self, send_cq: &Arc<dyn Cq>, recv_cq: &Arc<dyn Cq>, caps: QpCaps) -> Result<Arc<dyn Qp>> {
        let own = |c: &Arc<dyn Cq>| c.clone().as_any().downcast::<SysCq>().ok();
        let (Some(scq), Some(rcq)) = (own(send_cq), own(recv_cq)) else {
            return Err(Error::invalid_param("a completion queue of another fabric"));
        };
        let mut init = IbvQpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: scq.cq,
            recv_cq: rcq.cq,
            srq: std::ptr::null_mut(),
            max_send_wr: caps.send_wr,
            max_recv_wr: caps.recv_wr,
            max_send_sge: caps.sge,
            max_recv_sge: caps.sge,
            max_inline_data: 0,
            qp_type: QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: a live domain and queues; `init` is a valid `struct ibv_qp_init_attr`.
        let qp = unsafe { (self.pd.ctx.lib.create_qp)(self.pd.pd, &mut init) };
        if qp.is_null() {
            return Err(os_err("ibv_create_qp"));
        }
        // SAFETY: a live `struct ibv_qp`; the offset is checked by the ABI test.
        let qpn = unsafe { qp.add(QP_NUM).cast::<u32>().read() };
        let psn = (crate::util::random_u128() as u32) & 0xff_ffff;
        let me = QpAddr { gid: self.port.gid, lid: self.port.lid, qpn, psn };
        let q = SysQp { pd: self.pd.clone(), qp, me, port: self.port.port, mtu: self.mtu, _cqs: (scq, rcq) };
        q.modify(QPS_INIT, |a| {
            a.pkey_index = 0;
            a.port_num = q.port;
            a.qp_access_flags = LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE;
            QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS
        })?;
        Ok(Arc::new(q))
    }
}

struct SysCq {
    ctx: Arc<Context>,
    channel: *mut u8,
    cq: *mut c_void,
    fd: RawFd,
}

// SAFETY: rdma-core's verbs are thread-safe.
unsafe impl Send for SysCq {}
// SAFETY: as above.
unsafe impl Sync for SysCq {}

impl Drop for SysCq {
    fn drop(&mut self) {
        // SAFETY: every event taken was acknowledged (`take_event`), so destroying does not wait; pairs using
        // the queue hold it, so none is left.
        unsafe {
            (self.ctx.lib.destroy_cq)(self.cq);
            (self.ctx.lib.destroy_comp_channel)(self.channel);
        }
    }
}

impl Cq for SysCq {
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }

    fn event_fd(&self) -> RawFd {
        self.fd
    }

    fn arm(&self) -> Result<()> {
        let f: ReqNotifyCq = self.ctx.op(OPS_REQ_NOTIFY_CQ);
        // SAFETY: a live queue of this context.
        match unsafe { f(self.cq, 0) } {
            0 => Ok(()),
            rc => Err(rc_err("ibv_req_notify_cq", rc)),
        }
    }

    fn take_event(&self) -> Result<bool> {
        let mut p = libc::pollfd { fd: self.fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, no wait.
        if unsafe { libc::poll(&mut p, 1, 0) } != 1 {
            return Ok(false);
        }
        let (mut cq, mut cq_ctx) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a live channel (non-blocking: it was readable); out-parameters valid.
        if unsafe { (self.ctx.lib.get_cq_event)(self.channel, &mut cq, &mut cq_ctx) } != 0 {
            return Ok(false);
        }
        // SAFETY: the event just taken, for this queue.
        unsafe { (self.ctx.lib.ack_cq_events)(cq, 1) };
        Ok(true)
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let f: PollCq = self.ctx.op(OPS_POLL_CQ);
        let mut wc = [std::mem::MaybeUninit::<IbvWc>::uninit(); 16];
        let mut total = 0;
        while total < max {
            let want = (max - total).min(wc.len());
            // SAFETY: a live queue; room for `want` entries.
            let n = unsafe { f(self.cq, want as c_int, wc.as_mut_ptr().cast()) };
            if n < 0 {
                return Err(Error::backend("ibv_poll_cq failed (completion queue overrun?)"));
            }
            for w in &wc[..n as usize] {
                // SAFETY: the first `n` entries were written by the driver.
                let w = unsafe { w.assume_init() };
                let kind = match w.opcode {
                    WC_RDMA_READ => WcKind::Read,
                    WC_RDMA_WRITE => WcKind::Write,
                    WC_RECV_RDMA_WITH_IMM => WcKind::RecvImm,
                    WC_RECV => WcKind::Recv,
                    _ => WcKind::Send,
                };
                let imm = (w.wc_flags & WC_WITH_IMM != 0).then(|| u32::from_be(w.imm_data));
                out.push(Completion { id: w.wr_id, status: WcStatus::from_ibv(w.status), kind, len: w.byte_len, imm });
            }
            total += n as usize;
            if (n as usize) < want {
                break;
            }
        }
        Ok(total)
    }
}

struct SysQp {
    pd: Arc<Pd>,
    qp: *mut u8,
    me: QpAddr,
    port: u8,
    mtu: u32,
    _cqs: (Arc<SysCq>, Arc<SysCq>),
}

// SAFETY: rdma-core's verbs are thread-safe.
unsafe impl Send for SysQp {}
// SAFETY: as above.
unsafe impl Sync for SysQp {}

impl Drop for SysQp {
    fn drop(&mut self) {
        // SAFETY: created by `create_qp`, destroyed once.
        unsafe { (self.pd.ctx.lib.destroy_qp)(self.qp) };
    }
}

impl SysQp {
    /// Move to `state`, the other fields as `set` fills them; `set` returns the attribute mask.
    fn modify(&self, state: u32, set: impl FnOnce(&mut IbvQpAttr) -> c_int) -> Result<()> {
        // SAFETY: all-zero is a valid `struct ibv_qp_attr` (integers and arrays).
        let mut a: IbvQpAttr = unsafe { std::mem::zeroed() };
        a.qp_state = state;
        let mask = set(&mut a);
        // SAFETY: a live pair and a valid attribute struct.
        match unsafe { (self.pd.ctx.lib.modify_qp)(self.qp, &mut a, mask) } {
            0 => Ok(()),
            rc => Err(rc_err(&format!("ibv_modify_qp to state {state}"), rc)),
        }
    }
}

impl Qp for SysQp {
    fn addr(&self) -> QpAddr {
        self.me
    }

    fn connect(&self, r: &QpAddr) -> Result<()> {
        self.modify(QPS_RTR, |a| {
            a.path_mtu = self.mtu;
            a.dest_qp_num = r.qpn;
            a.rq_psn = r.psn;
            a.max_dest_rd_atomic = RD_ATOMIC;
            a.min_rnr_timer = 12;
            a.ah_attr.dlid = r.lid;
            a.ah_attr.port_num = self.port;
            // RoCE (and routed InfiniBand) address by GID: a global route header.
            if r.gid != [0; 16] {
                a.ah_attr.is_global = 1;
                a.ah_attr.dgid = r.gid;
                a.ah_attr.hop_limit = 64;
                a.ah_attr.sgid_index = 0;
            }
            QP_STATE | QP_AV | QP_PATH_MTU | QP_DEST_QPN | QP_RQ_PSN | QP_MAX_DEST_RD_ATOMIC | QP_MIN_RNR_TIMER
        })?;
        self.modify(QPS_RTS, |a| {
            a.timeout = 14;
            a.retry_cnt = 7;
            a.rnr_retry = 7;
            a.sq_psn = self.me.psn;
            a.max_rd_atomic = RD_ATOMIC;
            QP_STATE | QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_SQ_PSN | QP_MAX_QP_RD_ATOMIC
        })
    }

    fn post_send(&self, wrs: &[Wr]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<IbvSge> = Vec::with_capacity(wrs.iter().map(|w| w.sges.len()).sum());
        for w in wrs {
            sges.extend(w.sges.iter().map(|s: &Sge| IbvSge { addr: s.addr, length: s.len, lkey: s.lkey }));
        }
        let mut at = 0;
        let mut list: Vec<IbvSendWr> = wrs
            .iter()
            .map(|w| {
                let (opcode, remote_addr, rkey, imm) = match w.op {
                    Op::Read { raddr, rkey } => (WR_RDMA_READ, raddr, rkey, 0),
                    Op::Write { raddr, rkey } => (WR_RDMA_WRITE, raddr, rkey, 0),
                    Op::WriteImm { raddr, rkey, imm } => (WR_RDMA_WRITE_WITH_IMM, raddr, rkey, imm.to_be()),
                    Op::Send { imm: None } => (WR_SEND, 0, 0, 0),
                    Op::Send { imm: Some(i) } => (WR_SEND_WITH_IMM, 0, 0, i.to_be()),
                };
                // `sges` does not move again: it was sized above.
                let sg_list = sges[at..].as_mut_ptr();
                at += w.sges.len();
                IbvSendWr {
                    wr_id: w.id,
                    next: std::ptr::null_mut(),
                    sg_list,
                    num_sge: w.sges.len() as c_int,
                    opcode,
                    send_flags: if w.signaled { SEND_SIGNALED } else { 0 },
                    imm_data: imm,
                    remote_addr,
                    rkey,
                    _wr_rest: [0; 20],
                    _tail: [0; 56],
                }
            })
            .collect();
        for i in 1..list.len() {
            let next: *mut IbvSendWr = &mut list[i];
            list[i - 1].next = next;
        }
        let f: PostSend = self.pd.ctx.op(OPS_POST_SEND);
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live pair; the chain and its lists live until the call returns (the driver copies them).
        match unsafe { f(self.qp.cast(), list.as_mut_ptr(), &mut bad) } {
            0 => Ok(()),
            rc => Err(rc_err("ibv_post_send", rc)),
        }
    }

    fn post_recv(&self, id: u64, sge: Sge) -> Result<()> {
        let mut s = IbvSge { addr: sge.addr, length: sge.len, lkey: sge.lkey };
        let mut wr = IbvRecvWr { wr_id: id, next: std::ptr::null_mut(), sg_list: &mut s, num_sge: 1 };
        let f: PostRecv = self.pd.ctx.op(OPS_POST_RECV);
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live pair; the request and its list live until the call returns.
        match unsafe { f(self.qp.cast(), &mut wr, &mut bad) } {
            0 => Ok(()),
            rc => Err(rc_err("ibv_post_recv", rc)),
        }
    }

    fn set_error(&self) {
        let _ = self.modify(QPS_ERR, |_| QP_STATE);
    }
}
