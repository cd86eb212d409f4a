//! The backend trait: what a transport or storage engine must do for the agent, and the plugin table.
//!
//! The agent owns all bookkeeping (registrations, remote sections, descriptor coverage, the generation gate);
//! a backend only records what it needs per region, turns connection info into a peer object, and executes
//! transfer plans the agent has already validated. A backend never sees a descriptor that was not resolved
//! against a registration first.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use crate::mem::{Desc, MemType, RegDList, RegDesc};
use crate::status::{Error, Result, Status};

pub mod engine;
pub mod gds;
#[cfg(feature = "obj")]
pub mod obj;
pub mod posix;

/// Backend init parameters and reported options, ordered so output is stable.
pub type Params = BTreeMap<String, String>;

/// Opaque per-region state a backend keeps (a TCP region id, an RDMA rkey, an open file...).
pub type RegionKey = Arc<dyn Any + Send + Sync>;

/// What a backend can do (NIXL's four capability indicators).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caps {
    pub local: bool,
    pub remote: bool,
    pub notif: bool,
    pub mems: Vec<MemType>,
}

/// What a backend is told when it is created.
#[derive(Debug, Clone)]
pub struct BackendInit {
    pub agent_name: String,
    pub incarnation: u128,
    pub params: Params,
    pub num_workers: u32,
    /// Where a target that serves requests itself (TCP) counts the conflicts it sees between initiators, while
    /// the agent's overlap check is on (`crate::overlap`); None while it is off.
    pub overlap: Option<Arc<crate::overlap::Counts>>,
}

/// A registered local region as the backend returns it.
pub struct LocalRegion {
    /// Bytes a peer needs to reach this region, carried in metadata. Empty when nothing is needed.
    pub public: Vec<u8>,
    pub key: Option<RegionKey>,
}

/// A loaded remote agent, as one backend sees it. Created from the peer's connection info.
pub trait Peer: Send + Sync + 'static {
    fn as_any(&self) -> &dyn Any;
    /// Whether the backend has seen this peer fail. Cheap (an atomic load); called on every post.
    fn disconnected(&self) -> bool;
    /// Why it failed, where the backend knows (" (reason)", or empty), for the error that says so.
    fn why_down(&self) -> String {
        String::new()
    }
    /// The route this peer's data takes now (`in-process`, `cma`, `tcp`, `tcp-after-cma-denied`), for
    /// telemetry, logs and `gixl doctor`.
    fn route(&self) -> &'static str {
        ""
    }
    /// The peer's process id when it runs on this host (in this pid namespace), for `gixl doctor`.
    fn pid(&self) -> Option<i32> {
        None
    }
}

/// The error for a request to `name`, whose peer `p` has failed: REMOTE_DISCONNECT, with the reason where the
/// backend knows it.
pub fn disconnected(name: &str, p: &dyn Peer) -> Error {
    Error::disconnected(format!("agent '{name}' has disconnected{}", p.why_down()))
}

/// Where a transfer goes: this agent's own memory (loopback) or a loaded peer.
#[derive(Clone)]
pub enum Target {
    Local,
    Remote(Arc<dyn Peer>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XferOp {
    Read = 0,
    Write = 1,
}

impl XferOp {
    pub fn from_u32(v: u32) -> Result<XferOp> {
        match v {
            0 => Ok(XferOp::Read),
            1 => Ok(XferOp::Write),
            _ => Err(Error::invalid_param(format!("unknown transfer operation {v}"))),
        }
    }
}

/// One contiguous piece of a transfer: `len` bytes between a local and a remote address.
/// `lreg`/`rreg` index the region-key tables of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seg {
    pub local: u64,
    pub remote: u64,
    pub len: u64,
    pub ldev: u64,
    pub rdev: u64,
    pub lreg: u32,
    pub rreg: u32,
}

/// A validated transfer, ready to run any number of times.
pub struct XferPlan {
    pub op: XferOp,
    pub local_mem: MemType,
    pub remote_mem: MemType,
    pub segs: Vec<Seg>,
    pub local_keys: Vec<Option<RegionKey>>,
    pub remote_keys: Vec<Option<RegionKey>>,
    pub target: Target,
    pub total_bytes: u64,
}

/// A backend's handle for one transfer request. At most one post is active at a time (the agent enforces it).
pub trait BackendXfer: Send + Sync {
    /// Start the transfer; `notif` is sent to the target after all data has landed.
    /// Returns `Success` when it finished inline, `InProg` when it continues in the background.
    fn post(&self, notif: Option<&[u8]>) -> Result<Status>;
    /// `Success`, `InProg`, or the error that ended the last post.
    fn status(&self) -> Result<Status>;
    /// Stop an active transfer. Returns false if it cannot be stopped now (the caller keeps the handle).
    fn abort(&self) -> bool;
    /// When the last post completed, for telemetry.
    fn completed_at(&self) -> Option<Instant>;
}

pub trait Backend: Send + Sync + 'static {
    /// The plugin name this backend answers to ("UCX", "POSIX").
    fn name(&self) -> &'static str;
    fn caps(&self) -> Caps;
    /// Options in effect (after defaults and parsing). `get_backend_params` reports the init parameters as
    /// given, like NIXL; this is what the backend actually uses, for logs and gixl's own queries.
    fn params(&self) -> Params {
        Params::new()
    }

    fn register(&self, mem: MemType, desc: &RegDesc) -> Result<LocalRegion>;
    fn deregister(&self, _mem: MemType, _desc: &Desc, _key: Option<&RegionKey>) {}
    /// `deregister` of every region of one `deregister_memory` call: a backend that waits for peers (bounded)
    /// waits once for all of them, not once per region.
    fn deregister_many(&self, mem: MemType, regions: &[(Desc, Option<RegionKey>)]) {
        for (d, k) in regions {
            self.deregister(mem, d, k.as_ref());
        }
    }

    /// Connection info for metadata; only remote-capable backends are asked.
    fn conn_info(&self) -> Vec<u8> {
        Vec::new()
    }
    /// Turn a peer's connection info into a peer object. No connection is opened yet.
    fn load_peer(&self, _agent: &str, _incarnation: u128, _conn: &[u8]) -> Result<Arc<dyn Peer>> {
        Err(Error::not_supported(format!("backend {} has no remote support", self.name())))
    }
    /// A peer's region, from the public bytes in its metadata.
    fn load_remote_region(
        &self,
        _peer: &Arc<dyn Peer>,
        _mem: MemType,
        _desc: &Desc,
        _public: &[u8],
    ) -> Result<Option<RegionKey>> {
        Ok(None)
    }
    /// Open the connection to a peer now rather than on first use.
    fn connect(&self, _peer: &Arc<dyn Peer>) -> Result<()> {
        Ok(())
    }
    /// The peer's metadata was invalidated: drop connections, stop watching it.
    fn disconnect(&self, _peer: &Arc<dyn Peer>) {}

    fn prep_xfer(&self, plan: XferPlan) -> Result<Box<dyn BackendXfer>>;

    /// Move newly arrived notifications into `out` as (sender name, message).
    fn notifs(&self, _out: &mut Vec<(String, Vec<u8>)>) -> Result<()> {
        Err(Error::backend(format!("backend {} has no notification support", self.name())))
    }
    fn gen_notif(&self, _target: &Target, _msg: &[u8]) -> Result<()> {
        Err(Error::backend(format!("backend {} has no notification support", self.name())))
    }

    /// The owning agent is being destroyed: stop serving peers and stop threads. Requests that outlive the
    /// agent must fail cleanly afterwards (they may still hold the backend).
    fn shutdown(&self) {}

    fn query_mem(&self, _descs: &RegDList) -> Result<Vec<Option<Params>>> {
        Err(Error::not_supported(format!("backend {} cannot query memory", self.name())))
    }
    /// (duration µs, error margin µs)
    fn estimate_xfer_cost(&self, _plan_bytes: u64) -> Result<(i64, i64)> {
        Ok((0, 0))
    }
}

/// A backend plugin gixl knows: its name, memory types, default options and constructor.
pub struct Plugin {
    pub name: &'static str,
    pub mems: &'static [MemType],
    pub defaults: fn() -> Params,
    pub create: fn(BackendInit) -> Result<Arc<dyn Backend>>,
}

/// The defaults NIXL's UCX plugin reports. gixl's engine reads `num_workers` / `num_threads` (copy threads) and
/// accepts the others without effect.
fn ucx_defaults() -> Params {
    [("num_workers", "1"), ("ucx_devices", ""), ("ucx_error_handling_mode", "peer")]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// NIXL's LIBFABRIC plugin options (its source's names and defaults; nixl-cu12 1.5.1's plugin does not load
/// without CUDA and libfabric, so they were not read from it).
fn libfabric_defaults() -> Params {
    [("num_threads", "0"), ("split_batch_size", "1024")]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Every plugin built into this library, sorted by name like NIXL's plugin directory listing.
pub fn plugins() -> &'static [Plugin] {
    PLUGINS
}

pub fn plugin(name: &str) -> Result<&'static Plugin> {
    PLUGINS.iter().find(|p| p.name == name).ok_or_else(|| Error::not_found(format!("no backend plugin named '{name}'")))
}

static PLUGINS: &[Plugin] = &[
    Plugin {
        name: "GDS",
        // As NIXL's GDS plugin declares them.
        mems: &[MemType::Dram, MemType::Vram, MemType::File],
        defaults: gds::default_params,
        create: gds::create_gds,
    },
    Plugin {
        name: "GDS_MT",
        mems: &[MemType::Dram, MemType::Vram, MemType::File],
        defaults: gds::default_params,
        create: gds::create_gds_mt,
    },
    Plugin {
        name: "LIBFABRIC",
        // As NIXL's LIBFABRIC plugin reports. The engine under another name (engine::create_libfabric).
        mems: &[MemType::Dram, MemType::Vram],
        defaults: libfabric_defaults,
        create: engine::create_libfabric,
    },
    #[cfg(feature = "obj")]
    Plugin { name: "OBJ", mems: &[MemType::Dram, MemType::Obj], defaults: obj::default_params, create: obj::create },
    Plugin {
        name: "POSIX",
        mems: &[MemType::Dram, MemType::File],
        defaults: posix::default_params,
        create: posix::create,
    },
    Plugin {
        name: "UCX",
        // As NIXL's UCX plugin reports; VRAM registration needs the `cuda` feature and fails without it.
        mems: &[MemType::Dram, MemType::Vram],
        defaults: ucx_defaults,
        create: engine::create,
    },
];

/// A boolean backend parameter, in NIXL's spellings, case-insensitive.
pub(crate) fn param_bool(backend: &str, key: &str, v: &str) -> Result<bool> {
    match v.to_ascii_lowercase().as_str() {
        "y" | "yes" | "on" | "1" | "true" | "enable" => Ok(true),
        "n" | "no" | "off" | "0" | "false" | "disable" => Ok(false),
        _ => Err(Error::backend(format!(
            "{backend}: {key}='{v}' is not a boolean (y, yes, on, 1, true, enable / n, no, off, 0, false, disable)"
        ))),
    }
}

/// An unsigned integer backend parameter: digits only, like NIXL (no sign, spaces or suffix).
pub(crate) fn param_u64(backend: &str, key: &str, v: &str) -> Result<u64> {
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::backend(format!("{backend}: {key}='{v}' is not an unsigned integer")));
    }
    v.parse().map_err(|_| Error::backend(format!("{backend}: {key}='{v}' is out of range")))
}

/// The one shape a storage backend (POSIX, OBJ) transfers: this agent's DRAM on the local side and its own
/// `storage` regions (prepped against its own name) on the remote side. `store` says what the backend moves
/// data to, for the message.
pub(crate) fn check_storage_plan(backend: &str, store: &str, storage: MemType, plan: &XferPlan) -> Result<()> {
    if let Target::Remote(_) = plan.target {
        return Err(Error::not_supported(format!(
            "the {backend} backend moves data between this agent's memory and {store} only"
        )));
    }
    if plan.local_mem != MemType::Dram {
        return Err(Error::invalid_param(format!(
            "{backend}: the local list must be DRAM_SEG (got {}); put the {} list on the remote side, prepped \
             against this agent's own name",
            plan.local_mem.seg_name(),
            storage.seg_name()
        )));
    }
    if plan.remote_mem != storage {
        return Err(Error::invalid_param(format!(
            "{backend}: the remote list must be {} (got {})",
            storage.seg_name(),
            plan.remote_mem.seg_name()
        )));
    }
    Ok(())
}
