//! gixl: a Rust drop-in for NVIDIA NIXL, the point-to-point data mover inference servers use to ship
//! KV-cache blocks between workers.
//!
//! gixl keeps NIXL's API (this crate's [`Agent`], the C ABI in [`capi`], and the Python `nixl` package built
//! on top) and adds one guarantee NIXL lacks: every prepped list and transfer request knows which
//! incarnation of which peer it was built against. After that peer is invalidated or replaced, the handle
//! is refused with `NIXL_ERR_NOT_FOUND`; a peer found dead gives `NIXL_ERR_REMOTE_DISCONNECT`; and nothing
//! is freed while a handle can still reach it.
//!
//! Data moves by `memcpy` within a process, by cross-memory attach between processes on one host, and over
//! TCP between hosts (see `backend::engine`). Metadata can be exchanged in-band, through a peer's listener,
//! or through etcd (`Agent::send_local_md` and friends).
//!
//! What it is not (yet): it does not load NIXL's C++ plugins, and has no RDMA or CUDA memory.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod agent;
pub(crate) mod auth;
pub mod backend;
#[cfg(feature = "capi")]
pub mod capi;
pub(crate) mod config;
/// The GPU driver behind a trait: the real one (`cuda` feature) and a fake for tests.
#[doc(hidden)]
pub mod device;
/// libfabric, opened at run time: gixl's bindings, safe wrappers and the devices' self-test.
pub mod fabric;
#[doc(hidden)]
pub mod fuzzing;
pub mod md;
pub(crate) mod mdx;
pub mod mem;
pub(crate) mod os;
pub mod overlap;
pub mod status;
pub mod telemetry;
pub(crate) mod util;
/// The RDMA NIC behind a trait: rdma-core loaded at run time (`rdma` feature) and a fake fabric for tests.
#[doc(hidden)]
pub mod verbs;

pub use agent::{
    Agent, AgentConfig, BackendId, NotifUpdate, PlanIndex, PreppedDList, SyncMode, XferOpts, XferReq, XferTelemetry,
};
pub use backend::{Params, XferOp};
pub use mem::{Desc, MemType, RegDList, RegDesc, RemoteDList, RemoteDesc, XferDList};
pub use status::{Error, Result, Status};
#[doc(hidden)]
pub use util::test_skip;

/// NIXL's default listener port.
pub const DEFAULT_COMM_PORT: u16 = 8888;

/// The NIXL API level this library implements; also the Python distribution's version.
pub const NIXL_API_VERSION: &str = "1.5.2";

/// This library's own version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
