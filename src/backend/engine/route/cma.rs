//! Another process on this host, proven to be the one its metadata names (`shared::Proof`): cross-memory
//! attach (`process_vm_readv/writev`) batch by batch inside its gate, notifications over its abstract Unix
//! socket. Where the kernel denies cross-memory attach (EPERM/ENOSYS: containers, seccomp, Yama), the data
//! goes over TCP from then on (`denied`), and where the peer's socket refuses our uid, notifications do.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::tcp::link::TcpLink;
use super::{Job, Route};
use crate::backend::engine::copy::{self, cma_denied};
use crate::backend::engine::ctrl::Sender;
use crate::backend::engine::gate::Attached;
use crate::backend::engine::health::PeerHealth;
use crate::backend::engine::shared::Proof;
use crate::backend::Seg;
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
    pub(crate) tcp: Arc<TcpLink>,
    pub(crate) denied: AtomicBool,
    /// The peer's `EnginePeer::health` (its process's exit and its gate among its signals).
    pub(crate) health: Arc<PeerHealth>,
}

impl Cma {
    /// This name is gone for good (its incarnation proven gone), or its process exited.
    pub(crate) fn gone(&self) -> bool {
        self.health.gone()
    }

    /// Data goes over TCP: the kernel denied cross-memory attach.
    pub(crate) fn denied(&self) -> bool {
        self.denied.load(Ordering::Acquire)
    }

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
            if job.abort.load(Ordering::Relaxed) || self.gone() {
                return Err(Error::new(Status::Canceled, "transfer stopped"));
            }
            // Identity is checked inside the call itself: its first iovec is the incarnation's gate (see
            // `copy::cma_batch`), which an exec'd image or a process that took over the pid does not map. (A
            // pidfd poll here would cost a syscall per batch and still miss exec.)
            let inside = gate.enter(job.gate_regions());
            if let Err(e) = &inside {
                gone = e.status() == Status::RemoteDisconnect;
            }
            let _inside = inside?;
            // SAFETY: the caller keeps the local ranges valid.
            unsafe { copy::cma_batch(self.pid, job.op, b, &self.probe, gate.gate.sentinel(), &mut gone) }
        });
        if gone {
            self.health.kill(|| "its incarnation is gone (the identity probe or the gate said so)".into());
        }
        r
    }

    /// The notification sender to the peer's socket, connected now if it was not; None when the socket
    /// refused our uid (notifications go over TCP).
    fn sender(&self, from: &str) -> Result<Option<parking_lot::MutexGuard<'_, Option<Sender>>>> {
        if self.local_refused.load(Ordering::Acquire) {
            return Ok(None);
        }
        let mut s = self.sender.lock();
        if s.is_none() {
            match Sender::connect(&self.sock, self.incarnation, self.secret, from, self.from_inc) {
                Ok(c) => *s = Some(c),
                // Another uid: notifications go over TCP.
                Err(e) if e.status() == Status::NotAllowed => {
                    self.local_refused.store(true, Ordering::Release);
                    return Ok(None);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Some(s))
    }
}

impl Route for Cma {
    fn label(&self) -> &'static str {
        if self.denied() {
            "tcp-after-cma-denied"
        } else {
            "cma"
        }
    }
    fn pid(&self) -> Option<i32> {
        Some(self.pid)
    }
    fn closed(&self) -> bool {
        false
    }
    fn why_down(&self) -> String {
        if !self.denied() {
            return String::new();
        }
        self.tcp.why().map(|w| format!(" ({w})")).unwrap_or_default()
    }
    fn connect(&self, from: &str) -> Result<()> {
        self.sender(from).map(drop)
    }
    fn close(&self) {
        self.sender.lock().take();
        self.tcp.close();
    }
    fn notify(&self, from: &str, msg: &[u8]) -> Result<()> {
        if self.gone() {
            return Err(Error::disconnected(format!("agent '{}' has exited", self.name)));
        }
        let Some(mut s) = self.sender(from)? else { return self.tcp.notif(msg) };
        let r = s.as_mut().map(|s| s.notif(msg)).unwrap_or(Ok(()));
        if r.is_err() {
            *s = None;
        }
        r
    }
    fn link(&self) -> Option<&Arc<TcpLink>> {
        None
    }
    fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()> {
        if self.denied() {
            return job.over_tcp(&self.tcp, segs);
        }
        // SAFETY: local ranges were resolved against this agent's registrations.
        let r = unsafe { self.batches(job, segs) };
        if let Some(e) = r.as_ref().err().filter(|e| cma_denied(e)) {
            // The kernel checks permission before moving a byte, so nothing was copied: go by TCP.
            if !self.denied.swap(true, Ordering::AcqRel) {
                crate::telemetry::log::warn(&format!(
                    "agent '{}': peer '{}' route tcp (fall-back: the kernel denied cross-memory attach: {e}; \
                     `python -m gixl doctor` says why)",
                    job.agent, self.name
                ));
            }
            return job.over_tcp(&self.tcp, segs);
        }
        if r.is_err() && self.gone() {
            return Err(Error::disconnected(format!("agent '{}' exited during the transfer", self.name)));
        }
        r
    }
}
