//! The engine's routes to a peer, a file or a folder each, behind one trait (`Route`): an agent in this process
//! (`in_process`), another process on this host by cross-memory attach (`cma`), TCP (`tcp/`, split by
//! responsibility) and RDMA (`rdma/`, which rides a TCP link for what is not data). A peer holds one
//! (`peer::PeerKind`); everything the engine asks of a peer's route (why it is down, connect, close, notify,
//! prepare a request, copy a piece of it) goes through the trait. Whether the peer is down is not a route's
//! answer but its health's (`health::PeerHealth`), which every route of the peer feeds.
//!
//! A route with state of its own on the target side (its connection-info section, what it exports for each
//! registration and the sections that puts in the region's ticket) implements `Side` too, and is listed in
//! `sides` (what the engine starts and advertises, and what it reads of a peer's region). So a new route is its
//! folder here and its lines in `sides` and `router` (where it is chosen, and made a `PeerKind::Net` peer: the
//! engine asks it everything through the trait, VRAM's way included). This file names no route but TCP, whose
//! link others ride.
//!
//! Requests that touch VRAM go through their `xfer::Mover` instead (`vram`, `tcp::vram`), which reads the
//! route's own fields.

pub(super) mod cma;
pub(super) mod in_process;
pub(super) mod rdma;
pub(super) mod tcp;

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::backend::{RegionKey, Seg, XferOp, XferPlan};
use crate::mem::MemType;
use crate::status::{Error, Result, Status};
pub(crate) use tcp::link::TcpLink;
/// The connection kind on which the RDMA route's pairs are exchanged (after the TCP handshake).
pub(crate) use tcp::wire::KIND_RDMA;

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
    /// What it needs of a request's local regions (`local`, this engine's keys), found once when the request is
    /// prepared; None: nothing.
    fn prepare(&self, local: &[Option<RegionKey>]) -> Option<Prepared>;
    /// Copy `segs`, one piece of `job`.
    fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()>;
}

/// A route's part of this engine's target side, where it has state of its own (same-host routes and TCP serve
/// from the gate and the region table every registration gets, see `exports`).
pub(super) trait Side: Send + Sync {
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

/// What a `Side` exports for one registration.
pub(super) trait Export: Send + Sync {
    /// Its sections of the region's ticket (`id | length | bytes` each, ids the route's own, see `Tickets`).
    fn put_sections(&self, out: &mut Vec<u8>);
    fn as_any(&self) -> &dyn Any;
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
