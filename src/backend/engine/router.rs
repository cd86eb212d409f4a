//! The router: which route reaches a peer, decided in one place from its connection info and what this host
//! proves about it, and logged once per peer (`load`); and, for requests touching VRAM, whether the peer's
//! route carries them over TCP (`vram_over_tcp`, `ipc_despite_denial`). A route that fails at run time in a
//! way that leaves another (cross-memory attach denied by the kernel: TCP) switches inside the route
//! (`route::cma`), and says so in the log once.

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
use super::sentinel;
use super::shared::{registry, Shared, Transport};
use crate::backend::{Target, XferPlan};
use crate::mem::MemType;
use crate::status::{Error, Result};

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
    if !same_host || s.transport == Transport::Tcp || !ci.has_local {
        if addrs.is_empty() {
            return Err(Error::backend(format!(
                "agent '{agent}' runs on another host but advertises no address reachable from here"
            )));
        }
        let health = health(true, None, None);
        let kind = PeerKind::Tcp(Tcp { link: link(&health) });
        let why = match (same_host, ci.has_local) {
            (false, _) => "another host, or another pid or network namespace",
            (true, false) => "its connection info offers no same-host route",
            (true, true) => "GIXL_TRANSPORT=tcp",
        };
        crate::telemetry::log::info(&format!(
            "agent '{}': peer '{agent}' (incarnation {incarnation:032x}) route tcp ({why})",
            s.agent
        ));
        return Ok(EnginePeer { name: agent.to_owned(), incarnation, kind, health });
    }
    // In process only to an engine that lives here under that incarnation, whatever the connection info
    // says; an incarnation of this process that is not in the registry was destroyed (or never existed).
    let local = registry().lock().get(&incarnation).and_then(Weak::upgrade);
    // Why the kernel refused the peer's gate (so cross-memory attach): its data goes over TCP.
    let mut fallback = None;
    let (kind, health) = if let Some(t) = local {
        let gate = Some(gate::attach_shared((s.pid, s.start_time, incarnation), || Ok(t.gate.clone()))?);
        let health = health(false, None, gate.clone());
        (PeerKind::InProcess(InProcess { name: agent.to_owned(), target: Arc::downgrade(&t), gate }), health)
    } else if ci.pid == s.pid && ci.start_time == s.start_time {
        let health = health(false, None, None);
        health.kill(|| "no agent of that incarnation lives in this process".into());
        (PeerKind::InProcess(InProcess { name: agent.to_owned(), target: Weak::new(), gate: None }), health)
    } else {
        let proof = s.prove(ci, incarnation)?;
        let health =
            health(false, proof.as_ref().map(|p| p.exited.clone()), proof.as_ref().and_then(|p| p.gate.clone()));
        if proof.is_none() {
            health.kill(|| "it did not prove it runs on this host".into());
        }
        let denied = proof.as_ref().and_then(|p| p.denied.clone());
        let tcp = link(&health);
        fallback.clone_from(&denied);
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
            tcp,
            denied: AtomicBool::new(denied.is_some()),
            health: health.clone(),
        });
        (kind, health)
    };
    let peer = EnginePeer { name: agent.to_owned(), incarnation, kind, health };
    match &fallback {
        None => crate::telemetry::log::info(&format!(
            "agent '{}': peer '{agent}' (incarnation {incarnation:032x}) route {} (same host)",
            s.agent,
            peer.via().label()
        )),
        Some(why) => crate::telemetry::log::warn(&format!(
            "agent '{}': peer '{agent}' (incarnation {incarnation:032x}) route tcp (fall-back: the kernel \
             denied cross-memory attach: {why}; `python -m gixl doctor` says why)",
            s.agent
        )),
    }
    Ok(peer)
}

/// The TCP link of a request touching VRAM, when its peer is reached over TCP (None: a same-host route).
pub(super) fn vram_over_tcp(plan: &XferPlan) -> Result<Option<Arc<TcpLink>>> {
    let Target::Remote(p) = &plan.target else { return Ok(None) };
    Ok(match &downcast(p)?.kind {
        PeerKind::Tcp(Tcp { link }) => Some(link.clone()),
        // Cross-memory attach denied: over TCP, unless the peer's VRAM stays reachable by IPC handles.
        PeerKind::Cma(Cma { tcp, denied, gate, .. }) if denied.load(Ordering::Acquire) => {
            (!ipc_despite_denial(gate, plan.remote_mem == MemType::Vram)).then(|| tcp.clone())
        }
        PeerKind::Cma(_) | PeerKind::InProcess(_) => None,
    })
}

/// Where the kernel denies cross-memory attach to a same-host peer, its VRAM is still reachable through its
/// IPC handles if its gate came over the control socket and it has a live sentinel (the identity check then
/// needs no ptrace permission); its DRAM (the staged route) is not. Otherwise the request goes over TCP
/// (`vram_over_tcp`).
pub(super) fn ipc_despite_denial(gate: &Option<Arc<Attached>>, remote_is_vram: bool) -> bool {
    remote_is_vram
        && gate.as_ref().is_some_and(|g| matches!(sentinel::read(g.gate.sentinel()), sentinel::Word::Alive(_)))
}
