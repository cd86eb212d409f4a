//! libfabric (`libfabric.so.1`, or the path in `GIXL_LIBFABRIC`), opened at run time (`dlopen`): nothing links
//! it, so the library and the wheel load where it is absent and [`lib`] says NOT_SUPPORTED with the reason.
//!
//! The bindings are our own and thin: the five exported functions called ([`Lib`]), and `#[repr(C)]` mirrors of
//! the structs and operation tables that libfabric's `static inline` calls (`fi_domain`, `fi_endpoint`,
//! `fi_cq_read`, `fi_write`, …) go through, as `<rdma/fabric.h>`, `fi_domain.h`, `fi_endpoint.h`, `fi_cm.h`,
//! `fi_eq.h` and `fi_rma.h` of libfabric 1.17 define them. Every offset, size and constant here is checked
//! against those headers by tests/fabric.rs (a C program compiled against them prints them; [`ABI`] lists
//! ours). An entry of an operation table is an `Option`: a provider that leaves it NULL gets `-FI_ENOSYS`, as
//! the header's `FI_CHECK_OP` gives, never a call through NULL.
//!
//! libfabric only appends to its structs and tables (the library allocates every struct it returns), so the
//! 1.17 layout holds for the newer libraries EFA installs (≥ 1.21). The two structs gixl fills or has filled
//! and that grew since (`fi_mr_attr`, `fi_cq_err_entry`) are mirrored up to their 1.20 fields, and the API
//! asked for is 1.20 where the library is at least that ([`Lib::api`], for dma-buf registration), else 1.17:
//! a library copies no more of those two than the API asked for has (`ofi_mr_update_attr`,
//! `ofi_cq_err_memcpy`). Debian's 1.17 and libfabric 2.1 (built from Debian's source by scripts/setup.sh)
//! run here; [`abi_check`] says how each entry of [`ABI`] is held against either's headers.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::mem::{offset_of, size_of};
use std::sync::{Arc, OnceLock};

use crate::os::dl::fn_ptr;
use crate::status::{Error, Result};

/// `FI_VERSION(1, 17)`: the API gixl asks of a library older than 1.20.
pub const API_1_17: u32 = (1 << 16) | 17;
/// `FI_VERSION(1, 20)`: the API gixl asks of a library of 1.20 or newer (the first with `FI_MR_DMABUF`).
pub const API_1_20: u32 = (1 << 16) | 20;

pub const FI_RMA: u64 = 1 << 2;
pub const FI_READ: u64 = 1 << 8;
pub const FI_WRITE: u64 = 1 << 9;
pub const FI_RECV: u64 = 1 << 10;
pub const FI_SEND: u64 = 1 << 11;
pub const FI_TRANSMIT: u64 = FI_SEND;
pub const FI_REMOTE_READ: u64 = 1 << 12;
pub const FI_REMOTE_WRITE: u64 = 1 << 13;
pub const FI_COMPLETION: u64 = 1 << 24;
pub const FI_DELIVERY_COMPLETE: u64 = 1 << 28;
pub const FI_HMEM: u64 = 1 << 47;
/// `fi_mr_regattr` flag (API ≥ 1.20): the region is a dma-buf, `fi_mr_attr`'s first field points at a
/// [`FiMrDmabuf`].
pub const FI_MR_DMABUF: u64 = 1 << 40;

pub const FI_MR_LOCAL: c_int = 1 << 2;
pub const FI_MR_VIRT_ADDR: c_int = 1 << 4;
pub const FI_MR_ALLOCATED: c_int = 1 << 5;
pub const FI_MR_PROV_KEY: c_int = 1 << 6;
pub const FI_MR_ENDPOINT: c_int = 1 << 9;
pub const FI_MR_HMEM: c_int = 1 << 10;

/// `enum fi_hmem_iface`: what kind of memory a region registered with `fi_mr_regattr` is (host memory, or a
/// GPU's through its runtime).
pub const FI_HMEM_SYSTEM: u32 = 0;
pub const FI_HMEM_CUDA: u32 = 1;

pub const FI_EP_RDM: u32 = 3;
/// An address format: a NUL-terminated string (shm's `fi_shm://<pid>`).
pub const FI_ADDR_STR: u32 = 9;
pub const FI_THREAD_SAFE: u32 = 1;
pub const FI_AV_TABLE: u32 = 2;
pub const FI_CQ_FORMAT_DATA: u32 = 3;
pub const FI_WAIT_NONE: u32 = 0;
pub const FI_WAIT_UNSPEC: u32 = 1;
pub const FI_WAIT_FD: u32 = 3;
/// `fi_control` commands.
pub const FI_GETWAIT: c_int = 5;
pub const FI_ENABLE: c_int = 6;
pub const FI_ADDR_UNSPEC: u64 = u64::MAX;

/// libfabric's error numbers (returned negated) that the wrappers tell apart.
pub const FI_EAGAIN: c_int = libc::EAGAIN;
pub const FI_ENOSYS: c_int = libc::ENOSYS;
pub const FI_ENODATA: c_int = libc::ENODATA;
pub const FI_ETOOSMALL: c_int = 257;
pub const FI_EAVAIL: c_int = 259;

/// `struct fid`.
#[repr(C)]
pub struct Fid {
    pub fclass: usize,
    pub context: *mut c_void,
    pub ops: *const FiOps,
}

/// `struct fi_ops`, every object's table.
#[repr(C)]
pub struct FiOps {
    pub size: usize,
    pub close: Option<unsafe extern "C" fn(*mut Fid) -> c_int>,
    pub bind: Option<unsafe extern "C" fn(*mut Fid, *mut Fid, u64) -> c_int>,
    pub control: Option<unsafe extern "C" fn(*mut Fid, c_int, *mut c_void) -> c_int>,
    pub ops_open: *const c_void,
    pub tostr: *const c_void,
    pub ops_set: *const c_void,
}

#[repr(C)]
pub struct FiTxAttr {
    pub caps: u64,
    pub mode: u64,
    pub op_flags: u64,
    pub msg_order: u64,
    pub comp_order: u64,
    pub inject_size: usize,
    pub size: usize,
    pub iov_limit: usize,
    pub rma_iov_limit: usize,
    pub tclass: u32,
}

#[repr(C)]
pub struct FiEpAttr {
    pub type_: u32,
    pub protocol: u32,
    pub protocol_version: u32,
    pub max_msg_size: usize,
    pub msg_prefix_size: usize,
    pub max_order_raw_size: usize,
    pub max_order_war_size: usize,
    pub max_order_waw_size: usize,
    pub mem_tag_format: u64,
    pub tx_ctx_cnt: usize,
    pub rx_ctx_cnt: usize,
    pub auth_key_size: usize,
    pub auth_key: *mut u8,
}

#[repr(C)]
pub struct FiDomainAttr {
    pub domain: *mut FidDomain,
    pub name: *mut c_char,
    pub threading: u32,
    pub control_progress: u32,
    pub data_progress: u32,
    pub resource_mgmt: u32,
    pub av_type: u32,
    pub mr_mode: c_int,
    pub mr_key_size: usize,
    pub cq_data_size: usize,
    pub cq_cnt: usize,
    pub ep_cnt: usize,
    pub tx_ctx_cnt: usize,
    pub rx_ctx_cnt: usize,
    pub max_ep_tx_ctx: usize,
    pub max_ep_rx_ctx: usize,
    pub max_ep_stx_ctx: usize,
    pub max_ep_srx_ctx: usize,
    pub cntr_cnt: usize,
    pub mr_iov_limit: usize,
    pub caps: u64,
    pub mode: u64,
    pub auth_key: *mut u8,
    pub auth_key_size: usize,
    pub max_err_data: usize,
    pub mr_cnt: usize,
    pub tclass: u32,
}

#[repr(C)]
pub struct FiFabricAttr {
    pub fabric: *mut FidFabric,
    pub name: *mut c_char,
    pub prov_name: *mut c_char,
    pub prov_version: u32,
    pub api_version: u32,
}

/// `struct fi_info` (one entry of `fi_getinfo`'s list).
#[repr(C)]
pub struct FiInfo {
    pub next: *mut FiInfo,
    pub caps: u64,
    pub mode: u64,
    pub addr_format: u32,
    pub src_addrlen: usize,
    pub dest_addrlen: usize,
    pub src_addr: *mut c_void,
    pub dest_addr: *mut c_void,
    pub handle: *mut Fid,
    pub tx_attr: *mut FiTxAttr,
    pub rx_attr: *mut c_void,
    pub ep_attr: *mut FiEpAttr,
    pub domain_attr: *mut FiDomainAttr,
    pub fabric_attr: *mut FiFabricAttr,
    pub nic: *mut c_void,
}

#[repr(C)]
pub struct FidFabric {
    pub fid: Fid,
    pub ops: *const FiOpsFabric,
    pub api_version: u32,
}

#[repr(C)]
pub struct FiOpsFabric {
    pub size: usize,
    pub domain: Option<unsafe extern "C" fn(*mut FidFabric, *mut FiInfo, *mut *mut FidDomain, *mut c_void) -> c_int>,
    pub passive_ep: *const c_void,
    pub eq_open: *const c_void,
    pub wait_open: *const c_void,
    pub trywait: Option<unsafe extern "C" fn(*mut FidFabric, *mut *mut Fid, c_int) -> c_int>,
}

#[repr(C)]
pub struct FidDomain {
    pub fid: Fid,
    pub ops: *const FiOpsDomain,
    pub mr: *const FiOpsMr,
}

#[repr(C)]
pub struct FiOpsDomain {
    pub size: usize,
    pub av_open: Option<unsafe extern "C" fn(*mut FidDomain, *mut FiAvAttr, *mut *mut FidAv, *mut c_void) -> c_int>,
    pub cq_open: Option<unsafe extern "C" fn(*mut FidDomain, *mut FiCqAttr, *mut *mut FidCq, *mut c_void) -> c_int>,
    pub endpoint: Option<unsafe extern "C" fn(*mut FidDomain, *mut FiInfo, *mut *mut FidEp, *mut c_void) -> c_int>,
}

/// The `reg` entry's type (`fid, buf, len, access, offset, requested_key, flags, mr, context`).
pub type MrReg =
    unsafe extern "C" fn(*mut Fid, *const c_void, usize, u64, u64, u64, u64, *mut *mut FidMr, *mut c_void) -> c_int;

/// The `regattr` entry's type (`fid, attr, flags, mr`).
pub type MrRegAttr = unsafe extern "C" fn(*mut Fid, *const FiMrAttr, u64, *mut *mut FidMr) -> c_int;

#[repr(C)]
pub struct FiOpsMr {
    pub size: usize,
    pub reg: Option<MrReg>,
    pub regv: *const c_void,
    pub regattr: Option<MrRegAttr>,
}

/// `struct fi_mr_attr` up to its 1.20 fields: one region's memory, access and key, and its memory's interface
/// (`iface`, `FI_HMEM_*`) and device (the union `device`: a CUDA ordinal is its `int cuda`, the low half of the
/// `uint64_t reserved` it shares, little-endian). `mr_iov` is a union with `const struct fi_mr_dmabuf *dmabuf`
/// (read as that under [`FI_MR_DMABUF`]); `hmem_data` (1.19) is left NULL. A library asked for API 1.17 reads
/// the fields before `hmem_data` only; one asked for 1.20 up to `hmem_data` (`page_size` and after: ≥ 1.22).
#[repr(C)]
pub struct FiMrAttr {
    pub mr_iov: *const IoVec,
    pub iov_count: usize,
    pub access: u64,
    pub offset: u64,
    pub requested_key: u64,
    pub context: *mut c_void,
    pub auth_key_size: usize,
    pub auth_key: *mut u8,
    pub iface: u32,
    pub device: u64,
    pub hmem_data: *mut c_void,
}

/// `struct fi_mr_dmabuf` (1.20): a dma-buf's descriptor, the offset and length of the region in it, and the
/// virtual address its byte 0 stands for (the region's address is `base_addr + offset`).
#[repr(C)]
pub struct FiMrDmabuf {
    pub fd: c_int,
    pub offset: u64,
    pub len: usize,
    pub base_addr: *mut c_void,
}

#[repr(C)]
pub struct FidMr {
    pub fid: Fid,
    pub mem_desc: *mut c_void,
    pub key: u64,
}

#[repr(C)]
pub struct FiAvAttr {
    pub type_: u32,
    pub rx_ctx_bits: c_int,
    pub count: usize,
    pub ep_per_node: usize,
    pub name: *const c_char,
    pub map_addr: *mut c_void,
    pub flags: u64,
}

#[repr(C)]
pub struct FidAv {
    pub fid: Fid,
    pub ops: *const FiOpsAv,
}

#[repr(C)]
pub struct FiOpsAv {
    pub size: usize,
    pub insert: Option<unsafe extern "C" fn(*mut FidAv, *const c_void, usize, *mut u64, u64, *mut c_void) -> c_int>,
}

#[repr(C)]
pub struct FiCqAttr {
    pub size: usize,
    pub flags: u64,
    pub format: u32,
    pub wait_obj: u32,
    pub signaling_vector: c_int,
    pub wait_cond: u32,
    pub wait_set: *mut c_void,
}

#[repr(C)]
pub struct FidCq {
    pub fid: Fid,
    pub ops: *const FiOpsCq,
}

#[repr(C)]
pub struct FiOpsCq {
    pub size: usize,
    pub read: Option<unsafe extern "C" fn(*mut FidCq, *mut c_void, usize) -> isize>,
    pub readfrom: *const c_void,
    pub readerr: Option<unsafe extern "C" fn(*mut FidCq, *mut FiCqErrEntry, u64) -> isize>,
    pub sread: Option<unsafe extern "C" fn(*mut FidCq, *mut c_void, usize, *const c_void, c_int) -> isize>,
    pub sreadfrom: *const c_void,
    pub signal: *const c_void,
    pub strerror: Option<unsafe extern "C" fn(*mut FidCq, c_int, *const c_void, *mut c_char, usize) -> *const c_char>,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct FiCqDataEntry {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: usize,
    pub buf: *mut c_void,
    pub data: u64,
}

#[repr(C)]
pub struct FiCqErrEntry {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: usize,
    pub buf: *mut c_void,
    pub data: u64,
    pub tag: u64,
    pub olen: usize,
    pub err: c_int,
    pub prov_errno: c_int,
    pub err_data: *mut c_void,
    pub err_data_size: usize,
    /// 1.20: written only where the API asked for is at least that.
    pub src_addr: u64,
}

#[repr(C)]
pub struct FidEp {
    pub fid: Fid,
    pub ops: *const c_void,
    pub cm: *const FiOpsCm,
    pub msg: *const c_void,
    pub rma: *const FiOpsRma,
    pub tagged: *const c_void,
    pub atomic: *const c_void,
    pub collective: *const c_void,
}

#[repr(C)]
pub struct FiOpsCm {
    pub size: usize,
    pub setname: *const c_void,
    pub getname: Option<unsafe extern "C" fn(*mut Fid, *mut c_void, *mut usize) -> c_int>,
}

/// `struct iovec` as `fi_msg_rma` points at it.
#[repr(C)]
pub struct IoVec {
    pub base: *mut c_void,
    pub len: usize,
}

#[repr(C)]
pub struct FiRmaIov {
    pub addr: u64,
    pub len: usize,
    pub key: u64,
}

#[repr(C)]
pub struct FiMsgRma {
    pub msg_iov: *const IoVec,
    pub desc: *mut *mut c_void,
    pub iov_count: usize,
    pub addr: u64,
    pub rma_iov: *const FiRmaIov,
    pub rma_iov_count: usize,
    pub context: *mut c_void,
    pub data: u64,
}

/// The `read`/`write` entries' type (`ep, buf, len, desc, peer, addr, key, context`).
pub type Rma = unsafe extern "C" fn(*mut FidEp, *mut c_void, usize, *mut c_void, u64, u64, u64, *mut c_void) -> isize;
/// The `readmsg`/`writemsg` entries' type.
pub type RmaMsg = unsafe extern "C" fn(*mut FidEp, *const FiMsgRma, u64) -> isize;

#[repr(C)]
pub struct FiOpsRma {
    pub size: usize,
    pub read: Option<Rma>,
    pub readv: *const c_void,
    pub readmsg: Option<RmaMsg>,
    pub write: Option<Rma>,
    pub writev: *const c_void,
    pub writemsg: Option<RmaMsg>,
}

/// Every layout fact and constant the bindings rely on, by the name tests/fabric.rs's C program prints:
/// `sizeof.S` is `sizeof(struct S)`, `S.f` is `offsetof(struct S, f)`, anything else a constant.
pub const ABI: &[(&str, usize)] = &[
    ("sizeof.fid", size_of::<Fid>()),
    ("fid.ops", offset_of!(Fid, ops)),
    ("fi_ops.close", offset_of!(FiOps, close)),
    ("fi_ops.bind", offset_of!(FiOps, bind)),
    ("fi_ops.control", offset_of!(FiOps, control)),
    ("sizeof.fi_tx_attr", size_of::<FiTxAttr>()),
    ("fi_tx_attr.op_flags", offset_of!(FiTxAttr, op_flags)),
    ("sizeof.fi_ep_attr", size_of::<FiEpAttr>()),
    ("fi_ep_attr.type", offset_of!(FiEpAttr, type_)),
    ("sizeof.fi_domain_attr", size_of::<FiDomainAttr>()),
    ("fi_domain_attr.name", offset_of!(FiDomainAttr, name)),
    ("fi_domain_attr.threading", offset_of!(FiDomainAttr, threading)),
    ("fi_domain_attr.data_progress", offset_of!(FiDomainAttr, data_progress)),
    ("fi_domain_attr.av_type", offset_of!(FiDomainAttr, av_type)),
    ("fi_domain_attr.mr_mode", offset_of!(FiDomainAttr, mr_mode)),
    ("fi_domain_attr.mr_key_size", offset_of!(FiDomainAttr, mr_key_size)),
    ("fi_domain_attr.tclass", offset_of!(FiDomainAttr, tclass)),
    ("sizeof.fi_fabric_attr", size_of::<FiFabricAttr>()),
    ("fi_fabric_attr.name", offset_of!(FiFabricAttr, name)),
    ("fi_fabric_attr.prov_name", offset_of!(FiFabricAttr, prov_name)),
    ("fi_fabric_attr.prov_version", offset_of!(FiFabricAttr, prov_version)),
    ("sizeof.fi_info", size_of::<FiInfo>()),
    ("fi_info.caps", offset_of!(FiInfo, caps)),
    ("fi_info.mode", offset_of!(FiInfo, mode)),
    ("fi_info.tx_attr", offset_of!(FiInfo, tx_attr)),
    ("fi_info.ep_attr", offset_of!(FiInfo, ep_attr)),
    ("fi_info.domain_attr", offset_of!(FiInfo, domain_attr)),
    ("fi_info.fabric_attr", offset_of!(FiInfo, fabric_attr)),
    ("fi_info.nic", offset_of!(FiInfo, nic)),
    ("fid_fabric.ops", offset_of!(FidFabric, ops)),
    ("fi_ops_fabric.domain", offset_of!(FiOpsFabric, domain)),
    ("fi_ops_fabric.trywait", offset_of!(FiOpsFabric, trywait)),
    ("fid_domain.ops", offset_of!(FidDomain, ops)),
    ("fid_domain.mr", offset_of!(FidDomain, mr)),
    ("fi_ops_domain.av_open", offset_of!(FiOpsDomain, av_open)),
    ("fi_ops_domain.cq_open", offset_of!(FiOpsDomain, cq_open)),
    ("fi_ops_domain.endpoint", offset_of!(FiOpsDomain, endpoint)),
    ("fi_ops_mr.reg", offset_of!(FiOpsMr, reg)),
    ("fi_ops_mr.regattr", offset_of!(FiOpsMr, regattr)),
    ("sizeof.fi_mr_attr", size_of::<FiMrAttr>()),
    ("fi_mr_attr.mr_iov", offset_of!(FiMrAttr, mr_iov)),
    ("fi_mr_attr.access", offset_of!(FiMrAttr, access)),
    ("fi_mr_attr.requested_key", offset_of!(FiMrAttr, requested_key)),
    ("fi_mr_attr.iface", offset_of!(FiMrAttr, iface)),
    ("fi_mr_attr.device", offset_of!(FiMrAttr, device)),
    ("fi_mr_attr.hmem_data", offset_of!(FiMrAttr, hmem_data)),
    ("sizeof.fi_mr_dmabuf", size_of::<FiMrDmabuf>()),
    ("fi_mr_dmabuf.offset", offset_of!(FiMrDmabuf, offset)),
    ("fi_mr_dmabuf.len", offset_of!(FiMrDmabuf, len)),
    ("fi_mr_dmabuf.base_addr", offset_of!(FiMrDmabuf, base_addr)),
    ("fid_mr.mem_desc", offset_of!(FidMr, mem_desc)),
    ("fid_mr.key", offset_of!(FidMr, key)),
    ("sizeof.fi_av_attr", size_of::<FiAvAttr>()),
    ("fi_av_attr.count", offset_of!(FiAvAttr, count)),
    ("fi_av_attr.flags", offset_of!(FiAvAttr, flags)),
    ("fid_av.ops", offset_of!(FidAv, ops)),
    ("fi_ops_av.insert", offset_of!(FiOpsAv, insert)),
    ("sizeof.fi_cq_attr", size_of::<FiCqAttr>()),
    ("fi_cq_attr.format", offset_of!(FiCqAttr, format)),
    ("fi_cq_attr.wait_obj", offset_of!(FiCqAttr, wait_obj)),
    ("fi_cq_attr.wait_cond", offset_of!(FiCqAttr, wait_cond)),
    ("fi_cq_attr.wait_set", offset_of!(FiCqAttr, wait_set)),
    ("fid_cq.ops", offset_of!(FidCq, ops)),
    ("fi_ops_cq.read", offset_of!(FiOpsCq, read)),
    ("fi_ops_cq.readerr", offset_of!(FiOpsCq, readerr)),
    ("fi_ops_cq.sread", offset_of!(FiOpsCq, sread)),
    ("fi_ops_cq.strerror", offset_of!(FiOpsCq, strerror)),
    ("sizeof.fi_cq_data_entry", size_of::<FiCqDataEntry>()),
    ("fi_cq_data_entry.flags", offset_of!(FiCqDataEntry, flags)),
    ("fi_cq_data_entry.data", offset_of!(FiCqDataEntry, data)),
    ("sizeof.fi_cq_err_entry", size_of::<FiCqErrEntry>()),
    ("fi_cq_err_entry.err", offset_of!(FiCqErrEntry, err)),
    ("fi_cq_err_entry.prov_errno", offset_of!(FiCqErrEntry, prov_errno)),
    ("fi_cq_err_entry.err_data", offset_of!(FiCqErrEntry, err_data)),
    ("fi_cq_err_entry.err_data_size", offset_of!(FiCqErrEntry, err_data_size)),
    ("fi_cq_err_entry.src_addr", offset_of!(FiCqErrEntry, src_addr)),
    ("fid_ep.cm", offset_of!(FidEp, cm)),
    ("fid_ep.rma", offset_of!(FidEp, rma)),
    ("fi_ops_cm.getname", offset_of!(FiOpsCm, getname)),
    ("fi_ops_rma.read", offset_of!(FiOpsRma, read)),
    ("fi_ops_rma.readmsg", offset_of!(FiOpsRma, readmsg)),
    ("fi_ops_rma.write", offset_of!(FiOpsRma, write)),
    ("fi_ops_rma.writemsg", offset_of!(FiOpsRma, writemsg)),
    ("sizeof.fi_rma_iov", size_of::<FiRmaIov>()),
    ("sizeof.fi_msg_rma", size_of::<FiMsgRma>()),
    ("fi_msg_rma.addr", offset_of!(FiMsgRma, addr)),
    ("fi_msg_rma.rma_iov", offset_of!(FiMsgRma, rma_iov)),
    ("fi_msg_rma.context", offset_of!(FiMsgRma, context)),
    ("sizeof.iovec", size_of::<IoVec>()),
    ("FI_RMA", FI_RMA as usize),
    ("FI_READ", FI_READ as usize),
    ("FI_WRITE", FI_WRITE as usize),
    ("FI_RECV", FI_RECV as usize),
    ("FI_SEND", FI_SEND as usize),
    ("FI_TRANSMIT", FI_TRANSMIT as usize),
    ("FI_REMOTE_READ", FI_REMOTE_READ as usize),
    ("FI_REMOTE_WRITE", FI_REMOTE_WRITE as usize),
    ("FI_COMPLETION", FI_COMPLETION as usize),
    ("FI_DELIVERY_COMPLETE", FI_DELIVERY_COMPLETE as usize),
    ("FI_HMEM", FI_HMEM as usize),
    ("FI_MR_DMABUF", FI_MR_DMABUF as usize),
    ("FI_MR_LOCAL", FI_MR_LOCAL as usize),
    ("FI_MR_VIRT_ADDR", FI_MR_VIRT_ADDR as usize),
    ("FI_MR_ALLOCATED", FI_MR_ALLOCATED as usize),
    ("FI_MR_PROV_KEY", FI_MR_PROV_KEY as usize),
    ("FI_MR_ENDPOINT", FI_MR_ENDPOINT as usize),
    ("FI_MR_HMEM", FI_MR_HMEM as usize),
    ("FI_HMEM_SYSTEM", FI_HMEM_SYSTEM as usize),
    ("FI_HMEM_CUDA", FI_HMEM_CUDA as usize),
    ("FI_EP_RDM", FI_EP_RDM as usize),
    ("FI_ADDR_STR", FI_ADDR_STR as usize),
    ("FI_THREAD_SAFE", FI_THREAD_SAFE as usize),
    ("FI_AV_TABLE", FI_AV_TABLE as usize),
    ("FI_CQ_FORMAT_DATA", FI_CQ_FORMAT_DATA as usize),
    ("FI_WAIT_NONE", FI_WAIT_NONE as usize),
    ("FI_WAIT_UNSPEC", FI_WAIT_UNSPEC as usize),
    ("FI_WAIT_FD", FI_WAIT_FD as usize),
    ("FI_GETWAIT", FI_GETWAIT as usize),
    ("FI_ENABLE", FI_ENABLE as usize),
    ("FI_ADDR_UNSPEC", FI_ADDR_UNSPEC as usize),
    ("FI_EAGAIN", FI_EAGAIN as usize),
    ("FI_ENOSYS", FI_ENOSYS as usize),
    ("FI_ENODATA", FI_ENODATA as usize),
    ("FI_ETOOSMALL", FI_ETOOSMALL as usize),
    ("FI_EAVAIL", FI_EAVAIL as usize),
    ("FI_VERSION(1, 17)", API_1_17 as usize),
    ("FI_VERSION(1, 20)", API_1_20 as usize),
];

/// How an entry of [`ABI`] is held against the headers of libfabric `major.minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbiCheck {
    /// The headers' value is ours.
    Exact,
    /// The headers' struct is ours or longer: one the library allocates and appends to, or one gixl fills
    /// whose newer fields are read only at an API above the one gixl asks of such a library.
    AtLeast,
    /// The headers' struct is ours or shorter: one gixl fills or has filled, mirrored up to its 1.20 fields,
    /// which a library older than 1.20 (asked for 1.17) reads or writes no further than its own.
    AtMost,
    /// Not in headers this old.
    Absent,
}

/// The entries added after 1.17, with the version that added them.
const SINCE: &[(&str, (u32, u32))] = &[
    ("fi_mr_attr.hmem_data", (1, 19)),
    ("sizeof.fi_mr_dmabuf", (1, 20)),
    ("fi_mr_dmabuf.offset", (1, 20)),
    ("fi_mr_dmabuf.len", (1, 20)),
    ("fi_mr_dmabuf.base_addr", (1, 20)),
    ("fi_cq_err_entry.src_addr", (1, 20)),
    ("FI_MR_DMABUF", (1, 20)),
];

/// How `name` (an entry of [`ABI`]) is held against the headers of libfabric `header` (`major.minor`).
pub fn abi_check(name: &str, header: (u32, u32)) -> AbiCheck {
    if SINCE.iter().any(|&(n, v)| n == name && header < v) {
        return AbiCheck::Absent;
    }
    match name {
        "sizeof.fi_mr_attr" | "sizeof.fi_cq_err_entry" if header < (1, 20) => AbiCheck::AtMost,
        "sizeof.fi_mr_attr" | "sizeof.fi_cq_err_entry" => AbiCheck::AtLeast,
        "sizeof.fid"
        | "sizeof.fi_tx_attr"
        | "sizeof.fi_ep_attr"
        | "sizeof.fi_domain_attr"
        | "sizeof.fi_fabric_attr"
        | "sizeof.fi_info"
            if header > (1, 17) =>
        {
            AbiCheck::AtLeast
        }
        _ => AbiCheck::Exact,
    }
}

/// The exported functions called (the rest of the API is inline, through the tables above).
pub struct Lib {
    /// Where it was opened from (the name given to `dlopen`).
    pub path: String,
    /// The API asked of it: [`API_1_20`] where the library is 1.20 or newer, else [`API_1_17`].
    pub api: u32,
    pub getinfo: unsafe extern "C" fn(u32, *const c_char, *const c_char, u64, *const FiInfo, *mut *mut FiInfo) -> c_int,
    pub freeinfo: unsafe extern "C" fn(*mut FiInfo),
    pub dupinfo: unsafe extern "C" fn(*const FiInfo) -> *mut FiInfo,
    pub fabric: unsafe extern "C" fn(*mut FiFabricAttr, *mut *mut FidFabric, *mut c_void) -> c_int,
    pub strerror: unsafe extern "C" fn(c_int) -> *const c_char,
    pub version: unsafe extern "C" fn() -> u32,
}

impl Lib {
    /// `fi_strerror` of a (negated or not) libfabric error number.
    pub fn strerror(&self, rc: c_int) -> String {
        // SAFETY: fi_strerror takes any int and returns a static NUL-terminated string (or NULL: checked).
        let p = unsafe { (self.strerror)(rc.saturating_abs()) };
        if p.is_null() {
            return format!("libfabric error {rc}");
        }
        // SAFETY: not NULL, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// The library's own version, `major.minor`.
    pub fn version(&self) -> (u32, u32) {
        // SAFETY: fi_version takes nothing and returns FI_VERSION(major, minor).
        let v = unsafe { (self.version)() };
        (v >> 16, v & 0xffff)
    }
}

/// The library, opened once per process; NOT_SUPPORTED (with `dlerror`'s reason) where it is absent.
pub fn lib() -> Result<Arc<Lib>> {
    static LIB: OnceLock<std::result::Result<Arc<Lib>, String>> = OnceLock::new();
    LIB.get_or_init(|| open().map(Arc::new)).clone().map_err(Error::not_supported)
}

/// `GIXL_LIBFABRIC` (a path), else `libfabric.so.1` from the system's library path.
fn open() -> std::result::Result<Lib, String> {
    let dl = crate::os::dl::open("GIXL_LIBFABRIC", "libfabric.so.1", "libfabric")?;
    let sym = |s: &CStr| dl.sym(s);
    // SAFETY: each symbol is libfabric's exported function of that name (its default version), whose C
    // signature the field's type spells (fabric.h, fi_errno.h).
    let version: unsafe extern "C" fn() -> u32 = unsafe { fn_ptr(sym(c"fi_version")?) };
    // SAFETY: fi_version takes nothing and returns FI_VERSION(major, minor).
    let api = if unsafe { version() } >= API_1_20 { API_1_20 } else { API_1_17 };
    // SAFETY: as above.
    unsafe {
        Ok(Lib {
            getinfo: fn_ptr(sym(c"fi_getinfo")?),
            freeinfo: fn_ptr(sym(c"fi_freeinfo")?),
            dupinfo: fn_ptr(sym(c"fi_dupinfo")?),
            fabric: fn_ptr(sym(c"fi_fabric")?),
            strerror: fn_ptr(sym(c"fi_strerror")?),
            version,
            api,
            path: dl.name.clone(),
        })
    }
}
