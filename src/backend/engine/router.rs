//! The router: which routes reach a peer, decided in one place from its connection info and what this host
//! proves about it, and logged once per peer (`load`); every fallback between them: a same-host peer whose
//! cross-memory attach the kernel denies (at load, or at run time: said in the log once) or whose notification
//! socket refuses our uid goes over TCP (`EnginePeer::copy`, `notify`, ...); and, for requests touching VRAM,
//! the way of a peer on its fallback (by IPC handles, or staged over TCP: `vram_way`, `ipc_despite_denial`),
//! every other peer's route saying its own (`Route::vram`). Doctor and telemetry read the route it keeps a peer
//! on (`EnginePeer::label`).

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::conn::ConnInfo;
use super::copy;
use super::gate::{self, Attached};
use super::health::PeerHealth;
use super::peer::{downcast, EnginePeer, PeerKind};
use super::route::cma::Cma;
use super::route::in_process::InProcess;
use super::route::tcp::link::{LinkTarget, TcpLink};
use super::route::tcp::Tcp;
use super::route::{Job, Reach, Route, VramWay};
use super::shared::{registry, Shared, Transport};
use crate::backend::{Seg, Target, XferPlan};
use crate::mem::MemType;
use crate::os::sentinel;
use crate::status::{Error, Result, Status};
use crate::telemetry::log::Level;

/// The peer `agent` of incarnation `incarnation`, as its connection info `ci` and this host say it is reached.
pub(super) fn load(s: &Arc<Shared>, agent: &str, incarnation: u128, ci: &ConnInfo) -> Result<EnginePeer> {
    let same_host = ci.host == s.host;
    let mut addrs = ci.addrs.clone();
    if same_host {
        addrs.sort_by_key(|a| !a.ip().is_loopback());
    } else {
        // Another host's loopback is our own: connecting there would hand the secret to a local stranger.
        addrs.retain(|a| !a.ip().is_loopback());
    }
    let link = |health: &Arc<PeerHealth>| {
        let t = LinkTarget { peer: agent, incarnation, secret: ci.secret, addrs: addrs.clone() };
        TcpLink::new(&s.ctrl.tcp, &s.agent, t, health.clone())
    };
    // The peer's health: a TCP-only peer recovers from transient failures; a same-host peer's is its
    // process's (pidfd) and its gate's, and its TCP fall-back's first failure is final.
    let health = |recover, exited, gate| Arc::new(PeerHealth::new(s.tcp_opts.live(), recover, exited, gate));
    let said = |route: &str, why: &str| {
        format!("agent '{}': peer '{agent}' (incarnation {incarnation:032x}) route {route} ({why})", s.agent)
    };
    let say = |level, line: String| s.said.say(agent, incarnation, level, &line);
    let peer = |kind, fallback, on_fallback, health| EnginePeer {
        name: agent.to_owned(),
        incarnation,
        kind,
        fallback,
        on_fallback: AtomicBool::new(on_fallback),
        health,
    };
    // The first network route beside TCP that reaches the peer (`sides::NET`'s order); why not each, for the log.
    let mut not = String::new();
    for (net, side) in s.sides.routes().filter(|_| !addrs.is_empty()) {
        let health = health(true, None, None);
        let link = || link(&health);
        let to = Reach { agent, section: ci.route(net.section()), same_host, transport: s.transport, link: &link };
        match net.open(side, &to) {
            Ok((route, why)) => {
                say(Level::Info, said(net.name(), &why));
                return Ok(peer(PeerKind::Net(route), None, false, health));
            }
            Err(no) => not += &format!("; not {}: {no}", net.name()),
        }
    }
    if !same_host || s.transport != Transport::Auto || !ci.has_local {
        if addrs.is_empty() {
            return Err(Error::backend(format!(
                "agent '{agent}' runs on another host but advertises no address reachable from here"
            )));
        }
        let why = match (same_host, ci.has_local, s.transport) {
            (false, _, _) => "another host, or another pid or network namespace",
            (true, false, _) => "its connection info offers no same-host route",
            (true, true, Transport::Rdma) => "GIXL_TRANSPORT=rdma",
            (true, true, Transport::Fabric) => "GIXL_TRANSPORT=fabric",
            (true, true, _) => "GIXL_TRANSPORT=tcp",
        };
        // With why not each route beside TCP this side runs (never a silent fallback).
        say(Level::Info, said("tcp", &format!("{why}{not}")));
        let health = health(true, None, None);
        return Ok(peer(PeerKind::Net(Box::new(Tcp { link: link(&health) })), None, false, health));
    }
    // In process only to an engine that lives here under that incarnation, whatever the connection info
    // says; an incarnation of this process that is not in the registry was destroyed (or never existed).
    let local = registry().lock().get(&incarnation).and_then(Weak::upgrade);
    let in_process = |target, gate| PeerKind::InProcess(InProcess { name: agent.to_owned(), target, gate });
    // `denial`: why the kernel refused the peer's gate (so cross-memory attach): its data goes over TCP.
    let (kind, fallback, health, denial) = if let Some(t) = local {
        let gate = Some(gate::attach_shared((s.pid, s.start_time, incarnation), || Ok(t.gate.clone()))?);
        let health = health(false, None, gate.clone());
        (in_process(Arc::downgrade(&t), gate), None, health, None)
    } else if ci.pid == s.pid && ci.start_time == s.start_time {
        let health = health(false, None, None);
        health.kill(|| "no agent of that incarnation lives in this process".into());
        (in_process(Weak::new(), None), None, health, None)
    } else {
        let proof = s.prove(ci, incarnation)?;
        let health =
            health(false, proof.as_ref().map(|p| p.exited.clone()), proof.as_ref().and_then(|p| p.gate.clone()));
        if proof.is_none() {
            health.kill(|| "it did not prove it runs on this host".into());
        }
        let denial = proof.as_ref().and_then(|p| p.denied.clone());
        let tcp: Box<dyn Route> = Box::new(Tcp { link: link(&health) });
        let kind = PeerKind::Cma(Cma {
            name: agent.to_owned(),
            incarnation,
            pid: ci.pid,
            gate: proof.as_ref().and_then(|p| p.gate.clone()),
            proof,
            probe: copy::Probe { addr: ci.gate_addr, incarnation },
            sock: ci.sock.clone(),
            secret: ci.secret,
            from_inc: s.incarnation,
            local_refused: AtomicBool::new(false),
            sender: Mutex::new(None),
            health: health.clone(),
        });
        (kind, Some(tcp), health, denial)
    };
    let peer = peer(kind, fallback, denial.is_some(), health);
    match &denial {
        None => say(Level::Info, said(peer.label(), "same host")),
        Some(why) => say(
            Level::Warn,
            said(
                "tcp",
                &format!("fall-back: the kernel denied cross-memory attach: {why}; `python -m gixl doctor` says why"),
            ),
        ),
    }
    Ok(peer)
}

/// How `plan` (touching VRAM) reaches its peer; `prepared`: what its route found for it (`Route::prepare`).
pub(super) fn vram_way(plan: &XferPlan, prepared: Option<&(dyn Any + Send + Sync)>) -> Result<VramWay> {
    let Target::Remote(p) = &plan.target else { return Ok(VramWay::Local) };
    let p = downcast(p)?;
    match (&p.kind, p.fallen_back()) {
        // Cross-memory attach denied: over TCP, unless the peer's VRAM stays reachable by IPC handles.
        (PeerKind::Cma(Cma { gate, .. }), Some(f)) => match f.link() {
            _ if ipc_despite_denial(gate, plan.remote_mem == MemType::Vram) => Ok(VramWay::Local),
            Some(link) => Ok(VramWay::Staged(link.clone())),
            None => Err(Error::not_supported(format!("VRAM to agent '{}' over its {}", p.name, f.label()))),
        },
        (PeerKind::Cma(_) | PeerKind::InProcess(_) | PeerKind::Net(_), _) => p.via().vram(plan, prepared),
    }
}

/// A peer as the engine uses it: through the route the router keeps it on.
impl EnginePeer {
    /// The fallback, once the router moved the peer there.
    pub(super) fn fallen_back(&self) -> Option<&dyn Route> {
        self.fallback.as_deref().filter(|_| self.on_fallback.load(Ordering::Acquire))
    }

    /// Move the peer to its fallback for good (its first route was denied). True when this is news.
    pub(super) fn fall_back(&self) -> bool {
        self.fallback.is_some() && !self.on_fallback.swap(true, Ordering::AcqRel)
    }

    /// The route requests take now: its first, or the fallback once the router moved it there.
    fn active(&self) -> &dyn Route {
        self.fallen_back().unwrap_or_else(|| self.via())
    }

    /// Copy `segs`, one piece of `job`. Where the kernel denies the first route (it checks before moving a
    /// byte, so nothing was copied), the peer moves to its fallback for good, said once in the log.
    pub(super) fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()> {
        let (Some(f), None) = (&self.fallback, self.fallen_back()) else {
            return self.active().copy(job, segs);
        };
        let e = match self.via().copy(job, segs) {
            Err(e) if copy::cma_denied(&e) => e,
            r => return r,
        };
        if self.fall_back() {
            crate::telemetry::log::warn(&format!(
                "agent '{}': peer '{}' route tcp (fall-back: the kernel denied cross-memory attach: {e}; \
                 `python -m gixl doctor` says why)",
                job.agent, self.name
            ));
        }
        f.copy(job, segs)
    }

    /// Deliver a notification from agent `from`: over the first route, or the fallback where the peer's
    /// socket refuses our uid (the fallback proves the same secret).
    pub(super) fn notify(&self, from: &str, msg: &[u8]) -> Result<()> {
        match (self.via().notify(from, msg), &self.fallback) {
            (Err(e), Some(f)) if e.status() == Status::NotAllowed => f.notify(from, msg),
            (r, _) => r,
        }
    }

    /// Get ready to notify: a socket that refuses our uid leaves notifications to the fallback.
    pub(super) fn connect(&self, from: &str) -> Result<()> {
        match self.via().connect(from) {
            Err(e) if e.status() == Status::NotAllowed && self.fallback.is_some() => Ok(()),
            r => r,
        }
    }

    pub(super) fn close(&self) {
        self.via().close();
        if let Some(f) = &self.fallback {
            f.close();
        }
    }

    /// The route its data takes now, as doctor, the log and telemetry name it.
    pub(super) fn label(&self) -> &'static str {
        self.fallen_back().map_or_else(|| self.via().label(), |_| "tcp-after-cma-denied")
    }

    /// Why it is down, as ` (reason)`, or empty: its route's reason, else its health's (a route that keeps none
    /// of its own).
    pub(super) fn why(&self) -> String {
        match self.active().why_down() {
            w if w.is_empty() => self.health.why().map(|w| format!(" ({w})")).unwrap_or_default(),
            w => w,
        }
    }
}

/// Where the kernel denies cross-memory attach to a same-host peer, its VRAM is still reachable through its
/// IPC handles if its gate came over the control socket and it has a live sentinel (the identity check then
/// needs no ptrace permission); its DRAM (the staged route) is not. Otherwise the request goes over TCP
/// (`vram_way`).
pub(super) fn ipc_despite_denial(gate: &Option<Arc<Attached>>, remote_is_vram: bool) -> bool {
    remote_is_vram
        && gate.as_ref().is_some_and(|g| matches!(sentinel::read(g.gate.sentinel()), sentinel::Word::Alive(_)))
}
