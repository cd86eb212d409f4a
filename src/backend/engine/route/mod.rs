//! The engine's routes to a peer, a file or a folder each, behind one trait (`Route`): an agent in this process
//! (`in_process`), another process on this host by cross-memory attach (`cma`), TCP (`tcp/`, split by
//! responsibility) and RDMA (`rdma/`, which rides a TCP link for what is not data). A peer holds one (`peer::PeerKind`); everything the engine asks of a peer's route (why it is
//! down, connect, close, notify, copy a piece of a request) goes through the trait, so a new route is a file or
//! folder here, a variant of `PeerKind` and its choice in `router`. Whether the peer is down is not a route's
//! answer but its health's (`health::PeerHealth`), which every route of the peer feeds.
//!
//! Requests that touch VRAM go through their `xfer::Mover` instead (`vram`, `tcp::vram`), which reads the
//! route's own fields.

pub(super) mod cma;
pub(super) mod in_process;
pub(super) mod rdma;
pub(super) mod tcp;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::conn::RemoteRegion;
use super::exports::LocalMrs;
use crate::backend::{RegionKey, Seg, XferOp};
use crate::status::{Error, Result, Status};
pub(crate) use tcp::link::TcpLink;
/// The connection kind on which the RDMA route's pairs are exchanged (after the TCP handshake).
pub(crate) use tcp::wire::KIND_RDMA;

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
    /// Copy `segs`, one piece of `job`.
    fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()>;
}

/// What a route needs of a request to copy a piece of it.
pub(super) struct Job<'a> {
    pub(super) op: XferOp,
    /// The request's remote regions (this engine's `RemoteRegion`s).
    pub(super) keys: &'a [Option<RegionKey>],
    /// The RDMA memory regions of each local region (by `Seg::lreg`); empty unless the peer is reached over
    /// RDMA.
    pub(super) lkeys: &'a [Option<LocalMrs>],
    /// Set when the request is aborted: stop between batches.
    pub(super) abort: &'a AtomicBool,
    /// This agent's name, for the log.
    pub(super) agent: &'a str,
}

impl Job<'_> {
    pub(super) fn stopped(&self) -> Option<Error> {
        self.abort.load(Ordering::Relaxed).then(|| Error::new(Status::Canceled, "transfer stopped"))
    }

    /// The remote regions the request may touch, as the target's gate checks them.
    pub(super) fn gate_regions(&self) -> impl Iterator<Item = (u32, u64, u64, u64)> + Clone + '_ {
        gate_regions(self.keys)
    }
}

/// Remote region keys as (gate slot, state, address, length).
pub(super) fn gate_regions(keys: &[Option<RegionKey>]) -> impl Iterator<Item = (u32, u64, u64, u64)> + Clone + '_ {
    keys.iter().map(|k| match k.as_ref().and_then(|k| k.downcast_ref::<RemoteRegion>()) {
        Some(r) => (r.ticket.slot, r.ticket.state, r.addr, r.len),
        // Never for this engine's plans; refused by the gate if it happens.
        None => (u32::MAX, 0, 0, 0),
    })
}
