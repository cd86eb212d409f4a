//! The engine's routes to a peer, a file or a folder each, behind one trait (`Route`): an agent in this process
//! (`in_process`), another process on this host by cross-memory attach (`cma`), TCP (`tcp/`, split by
//! responsibility), RDMA (`rdma/`) and libfabric (`fabric/`), both of which ride a TCP link for what is not data. A peer holds one
//! (`peer::PeerKind`); everything the engine asks of a peer's route (why it is down, connect, close, notify,
//! prepare a request, copy a piece of it) goes through the trait. Whether the peer is down is not a route's
//! answer but its health's (`health::PeerHealth`), which every route of the peer feeds.
//!
//! A network route beside TCP is also a `Net`: its connection-info section, its target side (`Side`: what it
//! exports for each registration and the sections that puts in the region's ticket), what it reads of a peer
//! region's ticket, and whether it reaches a peer. `sides::NET` lists them, and the engine asks every one of them
//! through that list (the router tries them in its order before TCP). So a new route is its folder, a `mod` line
//! here and a line in `sides::NET`. This file names no route but TCP, whose link others ride.
//!
//! Requests that touch VRAM go through their `xfer::Mover` instead (`vram`, `tcp::vram`), which reads the
//! route's own fields.

pub(super) mod cma;
pub(super) mod fabric;
pub(super) mod in_process;
pub(super) mod rdma;
pub(super) mod tcp;

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::backend::{RegionKey, Seg, XferOp, XferPlan};
use crate::mem::MemType;
use crate::status::{Error, Result, Status};
pub(crate) use tcp::link::TcpLink;
pub(crate) use tcp::listen::TcpShared;

/// How a request touching VRAM reaches its peer (`Route::vram`, `router::vram_way`).
pub(super) enum VramWay {
    /// Through the device layer inside the target's gate (`vram`): a same-host route, or loopback.
    Local,
    /// Staged through page-locked host memory over the peer's TCP link (`tcp::vram`).
    Staged(Arc<TcpLink>),
    /// By the peer's route as DRAM is (GPU-direct over RDMA): every region of the request, here and there, has
    /// what the route needs.
    Direct,
}

/// What a route found once for a request (`Route::prepare`), handed back with each piece (`Job::prepared`).
pub(super) type Prepared = Box<dyn Any + Send + Sync>;

/// A way to reach one peer. Every method is required: a new route says what each means for it.
pub(super) trait Route: Send + Sync {
    /// What doctor, the log and telemetry call it.
    fn label(&self) -> &'static str;
    /// The peer's process, where it is one on this host.
    fn pid(&self) -> Option<i32>;
    /// Its copies are the CPU's, done in the calling thread (same host): a large request is cut in many small
    /// pieces that copy threads and polls take in turn. Otherwise (a NIC, a socket) each copy thread takes one
    /// large piece, which the route keeps in flight as it sees fit.
    fn cpu_copies(&self) -> bool;
    /// The route was closed (`close`) and keeps no way to the peer; whether the peer itself is down is its
    /// health's answer (`EnginePeer::health`).
    fn closed(&self) -> bool;
    /// Why it is down, as ` (reason)`, or empty.
    fn why_down(&self) -> String;
    /// Get ready to notify `from` this agent (connections the route keeps to the peer).
    fn connect(&self, from: &str) -> Result<()>;
    /// Drop what `connect` and requests opened.
    fn close(&self);
    /// Deliver a notification from agent `from`.
    fn notify(&self, from: &str, msg: &[u8]) -> Result<()>;
    /// The TCP link of a route that is TCP from the start: its heartbeats bound the requests in flight, and
    /// its data connections take their pieces.
    fn link(&self) -> Option<&Arc<TcpLink>>;
    /// How a request touching VRAM goes over it (`prepared`: what `prepare` found for it); the router decides
    /// instead while the peer is on its fallback.
    fn vram(&self, plan: &XferPlan, prepared: Option<&(dyn Any + Send + Sync)>) -> Result<VramWay>;
    /// What it needs of a request's regions, found once when the request is prepared; None: nothing.
    fn prepare(&self, regions: &Regions<'_>) -> Option<Prepared>;
    /// Copy `segs`, one piece of `job`.
    fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()>;
}

/// A request's regions as a route prepares it (`Route::prepare`), with the engine's readers of its keys (whose
/// types routes do not name).
pub(super) struct Regions<'a> {
    /// This engine's regions (by `Seg::lreg`).
    pub(super) local: &'a [Option<RegionKey>],
    /// The peer's (by `Seg::rreg`).
    pub(super) remote: &'a [Option<RegionKey>],
    /// A local region's exports (every started `Side`'s, see `exports`).
    pub(super) exports: fn(&RegionKey) -> Option<&Exports>,
    /// What the routes read of a remote region's ticket.
    pub(super) tickets: fn(&RegionKey) -> Option<&Tickets>,
}

impl Regions<'_> {
    /// A route's export (of its own type `T`) of each local region.
    pub(super) fn local_exports<T: 'static>(&self) -> impl Iterator<Item = Option<&T>> + '_ {
        self.local
            .iter()
            .map(|k| (self.exports)(k.as_ref()?)?.iter().flatten().find_map(|e| (&**e as &dyn Any).downcast_ref::<T>()))
    }

    /// What a route (of type `T`) read of each remote region's ticket.
    pub(super) fn remote_tickets<T: 'static>(&self) -> impl Iterator<Item = Option<&T>> + '_ {
        self.remote.iter().map(|k| (self.tickets)(k.as_ref()?)?.get::<T>())
    }
}

/// A peer region's ticket sections as each `Net` route read them (`sides::read_tickets`; none where the region
/// had no sections).
#[derive(Default)]
pub(super) struct Tickets(pub(super) Vec<Box<dyn Any + Send + Sync>>);

impl Tickets {
    /// What a route (of type `T`) read.
    pub(super) fn get<T: 'static>(&self) -> Option<&T> {
        self.0.iter().find_map(|t| t.downcast_ref::<T>())
    }
}

/// A network route beside TCP as the engine lists it (`sides::NET`): what it starts, advertises and reads, and
/// whether it reaches a peer.
pub(super) trait Net: Sync {
    /// What the log calls it.
    fn name(&self) -> &'static str;
    /// Its connection-info section's id (layout 4, see `conn`).
    fn section(&self) -> u64;
    /// Its target side, where `transport` allows it and it runs here; `tcp` hands it authenticated connections
    /// of its kind (served with `patience`, see `TcpOpts::patience`); `setting` reads its options (a backend
    /// parameter, else an environment variable: `setting(param, env)`).
    fn start(
        &self,
        transport: Transport,
        agent: &str,
        tcp: &TcpShared,
        patience: Duration,
        setting: Setting,
    ) -> Option<Arc<dyn Side>>;
    /// What it reads of a peer region's ticket sections (`id`, bytes; others' are not its business); None where
    /// none is its own (nothing kept: most regions have none).
    fn read_ticket(&self, sections: &[(u64, &[u8])]) -> Result<Option<Box<dyn Any + Send + Sync>>>;
    /// A route to the peer `to` describes, from our `side` (what `start` made), with what the log says of it;
    /// else why not.
    fn open(&self, side: &Arc<dyn Side>, to: &Reach<'_>)
        -> std::result::Result<(Box<dyn Route>, String), &'static str>;
    /// For `crate::fuzzing`: its codecs of peers' bytes, on `b`.
    fn fuzz(&self, b: &[u8]);
}

/// A backend parameter, else an environment variable (`setting(param, env)`), for `Net::start`.
pub(super) type Setting<'a> = &'a dyn Fn(&str, &str) -> Option<String>;

/// A peer as a `Net` route is asked whether it reaches it.
pub(super) struct Reach<'a> {
    pub(super) agent: &'a str,
    /// The route's section of the peer's connection info, where it has one.
    pub(super) section: Option<&'a [u8]>,
    pub(super) same_host: bool,
    pub(super) transport: Transport,
    /// The peer's TCP link (for what is not data), made on demand.
    pub(super) link: &'a dyn Fn() -> Arc<TcpLink>,
}

/// A route's part of this engine's target side, where it has state of its own (same-host routes and TCP serve
/// from the gate and the region table every registration gets, see `exports`).
pub(super) trait Side: Any + Send + Sync {
    /// Its connection-info section (layout 4): id and bytes.
    fn section(&self) -> (u64, Vec<u8>);
    /// What it exports for a new registration (its sections go into the region's ticket); None where it does
    /// not reach that memory (its peers' requests on it go another way).
    fn export(&self, r: &Registration) -> Result<Option<Box<dyn Export>>>;
    /// Retire one of its exports: no peer reaches the region through it once this returns.
    fn retire(&self, e: &dyn Export);
    /// Stop serving (the engine shuts down).
    fn close(&self);
}

/// A registration's exports, by the started sides' order (`None` where a side does not reach it).
pub(super) type Exports = [Option<Box<dyn Export>>];

/// What a `Side` exports for one registration.
pub(super) trait Export: Any + Send + Sync {
    /// Its sections of the region's ticket (`id | length | bytes` each, ids the route's own, see `Tickets`).
    fn put_sections(&self, out: &mut Vec<u8>);
}

/// A new registration, as a `Side` exports it.
pub(super) struct Registration<'a> {
    pub(super) mem: MemType,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) dev: u64,
    /// VRAM: the base of each allocation it spans.
    pub(super) bases: &'a [u64],
    /// This agent's name, for the log.
    pub(super) agent: &'a str,
}

/// Which routes an engine may take (`GIXL_TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Transport {
    Auto,
    Tcp,
    /// Every peer over RDMA where both sides have a port on one fabric, even on this host; else TCP.
    Rdma,
    /// Every peer over libfabric where both sides have an endpoint of one provider (tcp and shm included),
    /// even on this host; else TCP.
    Fabric,
}

/// What a route needs of a request to copy a piece of it.
pub(super) struct Job<'a> {
    pub(super) op: XferOp,
    /// The request's remote regions (this engine's `RemoteRegion`s).
    pub(super) keys: &'a [Option<RegionKey>],
    /// What the route found for the request when it was prepared (`Route::prepare`).
    pub(super) prepared: Option<&'a (dyn Any + Send + Sync)>,
    /// Set when the request is aborted: stop between batches.
    pub(super) abort: &'a AtomicBool,
    /// This agent's name, for the log.
    pub(super) agent: &'a str,
}

impl Job<'_> {
    pub(super) fn stopped(&self) -> Option<Error> {
        self.abort.load(Ordering::Relaxed).then(|| Error::new(Status::Canceled, "transfer stopped"))
    }
}
