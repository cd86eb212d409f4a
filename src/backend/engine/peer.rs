//! A peer as the engine knows it (`EnginePeer`): its name and incarnation, and the route that reaches it
//! (`PeerKind`: an agent of this process, another process on this host, or a TCP peer; each a `route::Route`).

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    /// This name's route has failed for good (its metadata's gate address faulted, its link gave up): per
    /// name, so a forged copy of a peer's metadata can only break itself. The process's exit is `Proof::exited`.
    pub(super) dead: Arc<AtomicBool>,
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

    /// This name's route is dead, or the process behind it has exited.
    pub(super) fn gone(&self) -> bool {
        self.dead.load(Ordering::Acquire) || self.via().exited()
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
        self.via().down()
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
