//! A peer as the engine knows it (`EnginePeer`): its name and incarnation, the route that reaches it
//! (`PeerKind`: an agent of this process, another process on this host, or a peer over the network, TCP or
//! RDMA, known only through its `route::Route`), the route the router falls back to, and its health. What the engine asks of it goes through the router
//! (`router`: copy, notify, connect, close, label), which picks between the two.

use std::any::Any;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::health::PeerHealth;
use super::route::cma::Cma;
use super::route::in_process::InProcess;
use super::route::Route;
use crate::backend::Peer;
use crate::status::{Error, Result};

/// The route to a peer, chosen once when its metadata is loaded (`load_peer`).
pub(super) enum PeerKind {
    /// Another agent in this process.
    InProcess(InProcess),
    /// Another process on this host (TCP carries the data instead once the kernel has denied cross-memory
    /// attach).
    Cma(Cma),
    /// Another host, or one reached as if it were (`GIXL_TRANSPORT`): a route that knows nothing of this host
    /// (TCP; RDMA where both have a port on one fabric), asked only through the trait.
    Net(Box<dyn Route>),
}

pub(super) struct EnginePeer {
    pub(super) name: String,
    pub(super) incarnation: u128,
    pub(super) kind: PeerKind,
    /// The next route (TCP, for a same-host peer), taken when the kernel denies `kind`'s.
    pub(super) fallback: Option<Box<dyn Route>>,
    /// The router moved the peer to `fallback` (at load, or when a copy or probe was denied).
    pub(super) on_fallback: AtomicBool,
    /// Its health, fed by its route: per name, so a forged copy of a peer's metadata can only break itself
    /// (the process's exit, `Proof::exited`, is one signal of it for every name).
    pub(super) health: Arc<PeerHealth>,
}

impl EnginePeer {
    /// Its route, as the engine asks it.
    pub(super) fn via(&self) -> &dyn Route {
        match &self.kind {
            PeerKind::InProcess(r) => r,
            PeerKind::Cma(r) => r,
            PeerKind::Net(r) => &**r,
        }
    }
}

impl Peer for EnginePeer {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn disconnected(&self) -> bool {
        self.health.down_now() || self.via().closed()
    }
    fn why_down(&self) -> String {
        self.why()
    }
    fn route(&self) -> &'static str {
        self.label()
    }
    fn pid(&self) -> Option<i32> {
        self.via().pid()
    }
}

pub(super) fn downcast(p: &Arc<dyn Peer>) -> Result<&EnginePeer> {
    p.as_any().downcast_ref::<EnginePeer>().ok_or_else(|| Error::invalid_param("peer belongs to another backend"))
}
