//! A peer as the engine knows it (`EnginePeer`): its name and incarnation, and the route that reaches it
//! (`PeerKind`: an agent of this process, another process on this host, or a TCP peer), with what each route
//! needs to move data and notifications and to tell that the peer is gone.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::copy;
use super::ctrl::Sender;
use super::gate::Attached;
use super::shared::{Proof, Shared};
use super::tcp::TcpLink;
use crate::backend::Peer;
use crate::status::{Error, Result, Status};

pub(super) enum PeerKind {
    /// Another agent in this process, found in `registry()` by its incarnation; `gate` is None when no engine
    /// of that incarnation lives here (destroyed, or metadata that only claims to be from this process).
    InProcess { target: Weak<Shared>, gate: Option<Arc<Attached>> },
    /// Another process on this host. `tcp` carries the data instead once the kernel has denied
    /// cross-memory attach (`denied`).
    Cma {
        pid: i32,
        /// None when the peer did not prove it runs here (nothing listens on its socket as its pid).
        proof: Option<Arc<Proof>>,
        /// The peer's gate (None when the kernel denied taking it: then `denied` is set and TCP carries data).
        gate: Option<Arc<Attached>>,
        probe: copy::Probe,
        sock: Vec<u8>,
        /// The peer's engine secret and our incarnation: the notification handshake's inputs.
        secret: u128,
        from_inc: u128,
        /// The peer's notification socket refused our uid: notifications go over TCP (which proves the
        /// same secret).
        local_refused: AtomicBool,
        sender: Mutex<Option<Sender>>,
        tcp: Arc<TcpLink>,
        denied: AtomicBool,
    },
    /// Another host, or `GIXL_TRANSPORT=tcp`.
    Tcp { link: Arc<TcpLink> },
}

pub(super) struct EnginePeer {
    pub(super) name: String,
    pub(super) incarnation: u128,
    pub(super) kind: PeerKind,
    /// This name's route has failed for good (its metadata's gate address faulted, its link gave up): per
    /// name, so a forged copy of a peer's metadata can only break itself. The process's exit is `Proof::exited`.
    pub(super) dead: Arc<AtomicBool>,
}

impl Peer for EnginePeer {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn disconnected(&self) -> bool {
        match &self.kind {
            PeerKind::InProcess { gate, .. } => gate.as_ref().is_none_or(|g| !g.gate.live()),
            PeerKind::Cma { gate, .. } => self.gone() || gate.as_ref().is_some_and(|g| !g.gate.live()),
            PeerKind::Tcp { link } => link.down(),
        }
    }
    fn why_down(&self) -> String {
        let link = match &self.kind {
            PeerKind::Tcp { link } => link,
            PeerKind::Cma { tcp, denied, .. } if denied.load(Ordering::Acquire) => tcp,
            PeerKind::Cma { .. } | PeerKind::InProcess { .. } => return String::new(),
        };
        link.why().map(|w| format!(" ({w})")).unwrap_or_default()
    }
    fn route(&self) -> &'static str {
        match &self.kind {
            PeerKind::InProcess { .. } => "in-process",
            PeerKind::Cma { denied, .. } if denied.load(Ordering::Acquire) => "tcp-after-cma-denied",
            PeerKind::Cma { .. } => "cma",
            PeerKind::Tcp { .. } => "tcp",
        }
    }
    fn pid(&self) -> Option<i32> {
        match &self.kind {
            PeerKind::Cma { pid, .. } => Some(*pid),
            PeerKind::InProcess { .. } | PeerKind::Tcp { .. } => None,
        }
    }
}

impl EnginePeer {
    /// This name's route is dead, or the process behind it has exited.
    pub(super) fn gone(&self) -> bool {
        self.dead.load(Ordering::Acquire)
            || match &self.kind {
                PeerKind::Cma { proof, .. } => proof.as_ref().is_some_and(|p| p.exited.load(Ordering::Acquire)),
                PeerKind::InProcess { .. } | PeerKind::Tcp { .. } => false,
            }
    }

    pub(super) fn send_notif(&self, from: &str, msg: &[u8]) -> Result<()> {
        match &self.kind {
            PeerKind::InProcess { target, .. } => {
                let t = target.upgrade().filter(|_| !self.disconnected());
                let t = t.ok_or_else(|| Error::disconnected(format!("agent '{}' has been destroyed", self.name)))?;
                t.queue.lock().push((from.to_owned(), msg.to_vec()));
                Ok(())
            }
            PeerKind::Cma { sock, sender, secret, from_inc, local_refused, tcp, .. } => {
                if self.gone() {
                    return Err(Error::disconnected(format!("agent '{}' has exited", self.name)));
                }
                if local_refused.load(Ordering::Acquire) {
                    return tcp.notif(msg);
                }
                let mut s = sender.lock();
                if s.is_none() {
                    match Sender::connect(sock, self.incarnation, *secret, from, *from_inc) {
                        Ok(c) => *s = Some(c),
                        Err(e) if e.status() == Status::NotAllowed => {
                            local_refused.store(true, Ordering::Release);
                            drop(s);
                            return tcp.notif(msg);
                        }
                        Err(e) => return Err(e),
                    }
                }
                let r = s.as_mut().map(|s| s.notif(msg)).unwrap_or(Ok(()));
                if r.is_err() {
                    *s = None;
                }
                r
            }
            PeerKind::Tcp { link } => link.notif(msg),
        }
    }
}

pub(super) fn downcast(p: &Arc<dyn Peer>) -> Result<&EnginePeer> {
    p.as_any().downcast_ref::<EnginePeer>().ok_or_else(|| Error::invalid_param("peer belongs to another backend"))
}
