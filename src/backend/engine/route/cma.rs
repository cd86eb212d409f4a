//! Another process on this host, proven to be the one its metadata names (`shared::Proof`): cross-memory
//! attach (`process_vm_readv/writev`) batch by batch inside its gate, notifications over its abstract Unix
//! socket. Where the kernel denies cross-memory attach (EPERM/ENOSYS: containers, seccomp, Yama) or the peer's
//! socket refuses our uid, this route says so (`copy::cma_denied`, NOT_ALLOWED) and the router moves the peer to
//! its next route (TCP).

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Job, Prepared, Regions, Route, TcpLink, VramWay};
use crate::backend::engine::conn;
use crate::backend::engine::copy::{self, cma_denied};
use crate::backend::engine::ctrl::Sender;
use crate::backend::engine::gate::Attached;
use crate::backend::engine::health::PeerHealth;
use crate::backend::engine::shared::Proof;
use crate::backend::{Seg, XferPlan};
use crate::status::{Error, Result, Status};

pub(crate) struct Cma {
    /// The peer's name and incarnation (errors; the notification handshake).
    pub(crate) name: String,
    pub(crate) incarnation: u128,
    pub(crate) pid: i32,
    /// None when the peer did not prove it runs here (nothing listens on its socket as its pid).
    pub(crate) proof: Option<Arc<Proof>>,
    /// The peer's gate (None when the kernel denied taking it: then `denied` is set and TCP carries data).
    pub(crate) gate: Option<Arc<Attached>>,
    pub(crate) probe: copy::Probe,
    pub(crate) sock: Vec<u8>,
    /// The peer's engine secret and our incarnation: the notification handshake's inputs.
    pub(crate) secret: u128,
    pub(crate) from_inc: u128,
    /// The peer's notification socket refused our uid: notifications go over TCP (which proves the same
    /// secret).
    pub(crate) local_refused: AtomicBool,
    pub(crate) sender: Mutex<Option<Sender>>,
    /// The peer's `EnginePeer::health` (its process's exit and its gate among its signals).
    pub(crate) health: Arc<PeerHealth>,
}

impl Cma {
    /// Cross-memory attach of `segs`, batch by batch, each inside the peer's gate; a batch that finds the
    /// incarnation gone marks this name dead.
    ///
    /// # Safety
    /// The local ranges of `segs` stay valid (mapped, and writable for a READ) for the whole call.
    pub(crate) unsafe fn batches(&self, job: &Job, segs: &[Seg]) -> Result<()> {
        let gate =
            self.gate.as_ref().ok_or_else(|| Error::disconnected(format!("agent '{}' is not reachable", self.name)))?;
        let mut gone = false;
        let r = copy::for_batches(segs, copy::BATCH_SEGS, copy::BATCH_BYTES, &mut |b| {
            if job.abort.load(Ordering::Relaxed) || self.health.gone() {
                return Err(Error::new(Status::Canceled, "transfer stopped"));
            }
            // Identity is checked inside the call itself: its first iovec is the incarnation's gate (see
            // `copy::cma_batch`), which an exec'd image or a process that took over the pid does not map. (A
            // pidfd poll here would cost a syscall per batch and still miss exec.)
            let _inside = gate
                .enter(conn::gate_regions(job.keys))
                .inspect_err(|e| gone = e.status() == Status::RemoteDisconnect)?;
            // SAFETY: the caller keeps the local ranges valid.
            unsafe { copy::cma_batch(self.pid, job.op, b, &self.probe, gate.gate.sentinel(), &mut gone) }
        });
        if gone {
            self.health.kill(|| "its incarnation is gone (the identity probe or the gate said so)".into());
        }
        r
    }

    /// The notification sender to the peer's socket, connected now if it was not; NOT_ALLOWED when the socket
    /// refused our uid (the router sends them over TCP then).
    fn sender(&self, from: &str) -> Result<parking_lot::MutexGuard<'_, Option<Sender>>> {
        let refused = || Error::new(Status::NotAllowed, "the peer's notification socket refused our uid");
        if self.local_refused.load(Ordering::Acquire) {
            return Err(refused());
        }
        let mut s = self.sender.lock();
        if s.is_none() {
            let c = Sender::connect(&self.sock, self.incarnation, self.secret, from, self.from_inc);
            if c.as_ref().is_err_and(|e| e.status() == Status::NotAllowed) {
                self.local_refused.store(true, Ordering::Release);
                return Err(refused());
            }
            *s = Some(c?);
        }
        Ok(s)
    }
}

impl Route for Cma {
    fn label(&self) -> &'static str {
        "cma"
    }
    fn pid(&self) -> Option<i32> {
        Some(self.pid)
    }
    fn cpu_copies(&self) -> bool {
        true
    }
    fn closed(&self) -> bool {
        false
    }
    fn why_down(&self) -> String {
        String::new()
    }
    fn connect(&self, from: &str) -> Result<()> {
        self.sender(from).map(drop)
    }
    fn close(&self) {
        self.sender.lock().take();
    }
    fn notify(&self, from: &str, msg: &[u8]) -> Result<()> {
        if self.health.gone() {
            return Err(Error::disconnected(format!("agent '{}' has exited", self.name)));
        }
        let mut s = self.sender(from)?;
        s.as_mut().map_or(Ok(()), |c| c.notif(msg)).inspect_err(|_| *s = None)
    }
    fn link(&self) -> Option<&Arc<TcpLink>> {
        None
    }
    /// Through the device layer inside the peer's gate (`vram`).
    fn vram(&self, _plan: &XferPlan, _prepared: Option<&(dyn Any + Send + Sync)>) -> Result<VramWay> {
        Ok(VramWay::Local)
    }
    fn prepare(&self, _regions: &Regions<'_>) -> Option<Prepared> {
        None
    }
    fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()> {
        // SAFETY: local ranges were resolved against this agent's registrations.
        let r = unsafe { self.batches(job, segs) };
        // Denied by the kernel (nothing was copied: it checks permission first): the router's to handle.
        if r.as_ref().is_err_and(|e| !cma_denied(e)) && self.health.gone() {
            return Err(Error::disconnected(format!("agent '{}' exited during the transfer", self.name)));
        }
        r
    }
}
