//! The RDMA NIC as gixl's RDMA route sees it: the few verbs it uses, behind traits, so the route runs the same
//! code over the real rdma-core (`sys`, behind the `rdma` feature, `libibverbs.so.1` opened at run time so the
//! library and the wheel load on machines without it) and over a fake fabric that moves real bytes between
//! processes (`fake`, always compiled, chosen with `GIXL_FAKE_VERBS`), which lets connection set-up, key
//! lifetime, ordering and failure mapping run in CI without a NIC.
//!
//! The shape follows the verbs a reliable-connected (RC) transfer needs and nothing else:
//! - [`Fabric`]: the ports this host has (device, port, link layer, state, GID/LID, NUMA node), and opening
//!   one: a [`Nic`], which is one opened port with one protection domain (every key and queue pair of one
//!   `Nic` belongs to that domain, and dropping it destroys them all);
//! - memory regions ([`Mr`]): `reg_mr` gives the local key for this side's scatter/gather lists and the
//!   remote key a peer names in READ/WRITE; after `dereg_mr` returns, no access through that key succeeds;
//! - completion queues ([`Cq`]): polled, and armed to make their event descriptor readable on the next
//!   completion (the engine's reactor waits on it: an idle route uses no CPU);
//! - queue pairs ([`Qp`]): connected to the peer's [`QpAddr`] (which travels over the engine's authenticated
//!   control connection), then READ / WRITE / WRITE with immediate / SEND work requests, chained in one post,
//!   signalled selectively, completing in order; a failed request moves the pair to the error state and
//!   every later one completes as flushed, as RC hardware does.

pub mod fake;
pub mod selftest;
#[cfg(feature = "rdma")]
pub mod sys;

use std::os::fd::{BorrowedFd, RawFd};
use std::sync::Arc;

#[cfg(not(feature = "rdma"))]
use crate::status::Error;
use crate::status::Result;

/// Memory-region access rights, as `IBV_ACCESS_*`.
pub const LOCAL_WRITE: u32 = 1;
pub const REMOTE_WRITE: u32 = 2;
pub const REMOTE_READ: u32 = 4;

/// The link a port runs: InfiniBand (addressed by LID) or Ethernet (RoCE, addressed by GID).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    InfiniBand,
    Ethernet,
}

/// One port of one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    pub device: String,
    pub port: u8,
    pub link: LinkLayer,
    /// `IBV_PORT_ACTIVE`: the port can carry traffic.
    pub active: bool,
    pub lid: u16,
    /// GID index 0.
    pub gid: [u8; 16],
    /// The device's NUMA node (sysfs), where known.
    pub numa: Option<i32>,
    /// The device's place in the PCI tree: its sysfs path (`/sys/devices/pci0000:00/0000:00:02.0/...`), where
    /// known; a GPU under the same switch shares more of it.
    pub pci: Option<String>,
}

/// What the other side of a reliable connection needs to reach one queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAddr {
    pub gid: [u8; 16],
    pub lid: u16,
    pub qpn: u32,
    /// The first packet sequence number the pair sends.
    pub psn: u32,
}

/// A registered memory region. The implementation's own handle is `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mr {
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
    pub id: u64,
}

/// One scatter/gather element: `len` bytes at `addr`, inside a region of this side registered with `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// What a work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Read from the peer's `raddr` (under `rkey`) into the local list.
    Read { raddr: u64, rkey: u32 },
    /// Write the local list to the peer's `raddr`.
    Write { raddr: u64, rkey: u32 },
    /// Write, then consume one of the peer's posted receives with `imm` (its receive completes after the data).
    WriteImm { raddr: u64, rkey: u32, imm: u32 },
    /// Deliver the local list into the peer's next posted receive.
    Send { imm: Option<u32> },
}

/// A send-queue work request.
#[derive(Debug, Clone, Copy)]
pub struct Wr<'a> {
    pub id: u64,
    pub op: Op,
    pub sges: &'a [Sge],
    /// Completes with an entry on success (failures always do).
    pub signaled: bool,
}

/// How a work request ended (`ibv_wc_status`; the numbers are rdma-core's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    Success,
    /// A local list named memory outside the regions of its key (`IBV_WC_LOC_PROT_ERR`).
    LocalProtection,
    /// The peer refused the access: a key it does not have (any more), a range outside the region, or
    /// rights it lacks (`IBV_WC_REM_ACCESS_ERR`).
    RemoteAccess,
    /// The peer could not complete it (`IBV_WC_REM_OP_ERR`, `IBV_WC_REM_INV_REQ_ERR`).
    RemoteOp,
    /// The peer did not answer (`IBV_WC_RETRY_EXC_ERR`): gone, or the link is.
    RetryExceeded,
    /// Not run: the pair was in the error state (`IBV_WC_WR_FLUSH_ERR`).
    Flushed,
    /// Anything else, by its number.
    Other(u32),
}

impl WcStatus {
    pub fn from_ibv(n: u32) -> WcStatus {
        match n {
            0 => WcStatus::Success,
            4 => WcStatus::LocalProtection,
            5 => WcStatus::Flushed,
            9 | 11 => WcStatus::RemoteOp,
            10 => WcStatus::RemoteAccess,
            12 => WcStatus::RetryExceeded,
            n => WcStatus::Other(n),
        }
    }
}

/// Which side of which request a completion is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcKind {
    Send,
    Write,
    Read,
    /// A posted receive took a SEND.
    Recv,
    /// A posted receive took a WRITE with immediate (the data is in place).
    RecvImm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub id: u64,
    pub status: WcStatus,
    pub kind: WcKind,
    /// Bytes received (receives only).
    pub len: u32,
    pub imm: Option<u32>,
}

/// Queue sizes of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    pub send_wr: u32,
    pub recv_wr: u32,
    pub sge: u32,
}

/// The RDMA ports of this host and a way to open them.
pub trait Fabric: Send + Sync {
    /// "ibverbs" or "fake".
    fn name(&self) -> &'static str;
    /// Every port of every device (active or not); empty when the host has none.
    fn ports(&self) -> Result<Vec<PortInfo>>;
    /// Open `device`'s `port` with a protection domain of its own.
    fn open(&self, device: &str, port: u8) -> Result<Arc<dyn Nic>>;
}

/// One opened port and one protection domain.
pub trait Nic: Send + Sync {
    fn port(&self) -> &PortInfo;
    fn reg_mr(&self, addr: u64, len: u64, access: u32) -> Result<Mr>;
    /// A memory region over `len` bytes of the dma-buf `fd` from `offset` (device memory a GPU driver
    /// exported), addressed by peers as `[iova, iova + len)`: GPU-direct RDMA without a kernel module of the
    /// GPU vendor. NOT_SUPPORTED where the library or the NIC's kernel driver cannot.
    fn reg_dmabuf_mr(&self, fd: BorrowedFd<'_>, offset: u64, len: u64, iova: u64, access: u32) -> Result<Mr>;
    /// After it returns, no access through `mr`'s keys succeeds (accesses already under way finish first).
    fn dereg_mr(&self, mr: &Mr) -> Result<()>;
    fn create_cq(&self, depth: u32) -> Result<Arc<dyn Cq>>;
    fn create_qp(&self, send_cq: &Arc<dyn Cq>, recv_cq: &Arc<dyn Cq>, caps: QpCaps) -> Result<Arc<dyn Qp>>;
    /// Readable when the NIC has something to report on its own (rdma-core's async events: a port going down or
    /// coming back, a fatal device error); `port_event` takes it.
    fn event_fd(&self) -> RawFd;
    /// The next change of this port's state the NIC reported, without blocking (other events are taken and
    /// dropped); None when none is pending.
    fn port_event(&self) -> Result<Option<PortEvent>>;
}

/// A change of a port's state, as the NIC reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortEvent {
    /// The port (or the whole device) stopped carrying traffic.
    Down,
    /// It carries traffic again.
    Up,
}

/// A completion queue.
pub trait Cq: Send + Sync {
    /// For an implementation to find its own queues among those it is given.
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;
    /// Readable after the queue, once armed, receives a completion.
    fn event_fd(&self) -> RawFd;
    /// Ask for one event on the next completion (completions already queued do not raise it: poll after
    /// arming).
    fn arm(&self) -> Result<()>;
    /// Consume a raised event; false when none was.
    fn take_event(&self) -> Result<bool>;
    /// Move up to `max` completions into `out`; how many. An overrun queue fails.
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize>;
}

/// A reliable-connected queue pair.
pub trait Qp: Send + Sync {
    fn addr(&self) -> QpAddr;
    /// Connect to the peer's pair (INIT, RTR, RTS).
    fn connect(&self, remote: &QpAddr) -> Result<()>;
    /// Post a chain of work requests, in order; a full send queue refuses the whole chain.
    fn post_send(&self, wrs: &[Wr]) -> Result<()>;
    fn post_recv(&self, id: u64, sge: Sge) -> Result<()>;
    /// Move the pair to the error state: every request not yet completed completes as flushed.
    fn set_error(&self);
}

/// The fabric this process uses: the fake where `GIXL_FAKE_VERBS` asks for it, else rdma-core where the
/// `rdma` feature is built and `libibverbs.so.1` loads; an error says why there is none.
pub fn fabric() -> Result<Arc<dyn Fabric>> {
    if let Some(f) = fake::from_env()? {
        return Ok(f);
    }
    #[cfg(feature = "rdma")]
    {
        sys::load()
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(Error::not_supported("gixl was built without the `rdma` feature"))
    }
}
