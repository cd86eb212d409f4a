//! A peer as the engine knows it (`EnginePeer`): its name and incarnation, and the route that reaches it
//! (`PeerKind`: an agent of this process, another process on this host, or a TCP peer; each a `route::Route`).

use std::any::Any;
use std::sync::Arc;

use super::health::PeerHealth;
use super::route::cma::Cma;
use super::route::in_process::InProcess;
use super::route::tcp::Tcp;
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
    /// Another host, or `GIXL_TRANSPORT=tcp`.
    Tcp(Tcp),
}

pub(super) struct EnginePeer {
    pub(super) name: String,
    pub(super) incarnation: u128,
    pub(super) kind: PeerKind,
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
            PeerKind::Tcp(r) => r,
        }
    }

    pub(super) fn send_notif(&self, from: &str, msg: &[u8]) -> Result<()> {
        self.via().notify(from, msg)
    }
}

impl Peer for EnginePeer {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn disconnected(&self) -> bool {
        self.health.down_at(crate::util::monotonic_ns()) || self.via().closed()
    }
    fn why_down(&self) -> String {
        self.via().why_down()
    }
    fn route(&self) -> &'static str {
        self.via().label()
    }
    fn pid(&self) -> Option<i32> {
        self.via().pid()
    }
}

pub(super) fn downcast(p: &Arc<dyn Peer>) -> Result<&EnginePeer> {
    p.as_any().downcast_ref::<EnginePeer>().ok_or_else(|| Error::invalid_param("peer belongs to another backend"))
}
