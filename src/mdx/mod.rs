//! Metadata exchange between agents without the application carrying the bytes: NIXL's `send_local_md`,
//! `send_local_partial_md`, `fetch_remote_md` and `invalidate_local_md`.
//!
//! Routing follows NIXL: with a peer address the exchange is peer-to-peer (see `p2p`; gixl's own framed
//! protocol, see `wire`); without one it goes through etcd when `NIXL_ETCD_ENDPOINTS` is set (see `etcd`),
//! or through a torch.distributed TCPStore when `NIXL_TCPSTORE_ENDPOINT` is set (see `tcpstore`; the two are
//! mutually exclusive), and is INVALID_PARAM otherwise. Every operation returns at once; the I/O happens on
//! background threads and its failures are logged to stderr, as NIXL does.
//!
//! Differences from NIXL, on purpose: fetching needs no listener on the fetching side (the reply comes back
//! on the request's connection), and nothing polls: threads sleep until a socket or a request wakes them.
//!
//! This module never touches agent state directly; it goes through `Host`, which the agent implements.

mod etcd;
mod http;
pub(crate) mod json;
mod p2p;
mod tcpstore;
pub mod wire;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::status::{Error, Result};
use etcd::Etcd;
use p2p::P2p;
use tcpstore::TcpStore;

/// A warning from a background thread, where there is no caller to return an error to (through
/// `telemetry::log`: stderr for C users, Python's `logging` in the wheel).
macro_rules! log {
    ($($t:tt)*) => { $crate::telemetry::log::warn(&format!("metadata exchange: {}", format_args!($($t)*))) };
}
pub(crate) use log;

/// What the exchange needs from its agent. Calls fail once the agent is gone.
pub(crate) trait Host: Send + Sync + 'static {
    fn name(&self) -> String;
    fn load(&self, blob: &[u8]) -> Result<String>;
    /// A LOAD a peer pushed to the listener unasked (`send_local_md`): like `load`, within the host's cap
    /// on agents loaded that way.
    fn load_pushed(&self, blob: &[u8]) -> Result<String> {
        self.load(blob)
    }
    fn invalidate(&self, name: &str) -> Result<()>;
    fn full_md(&self) -> Result<Vec<u8>>;
    fn loaded_incarnation(&self, name: &str) -> Option<u128>;
    /// The agent is being destroyed (background threads stop quietly).
    fn closing(&self) -> bool;
}

/// Where one operation goes.
pub(crate) enum Route {
    Peer(SocketAddr),
    Store,
}

pub(crate) struct Mdx {
    host: Arc<dyn Host>,
    listener: Option<Arc<P2p>>,
    /// Started on first use when there is no listener.
    outbound: Mutex<Option<Arc<P2p>>>,
    etcd: Option<Etcd>,
    tcpstore: Option<TcpStore>,
}

/// NIXL's checks of its TCPStore settings, made when an agent is created: `host:port` with a port from 1 to
/// 65535, and the two timeouts (milliseconds) whole numbers.
fn check_tcpstore(endpoint: &str) -> Result<()> {
    let bad = |why: String| Err(Error::invalid_param(why));
    let Some((_, port)) = endpoint.rsplit_once(':').filter(|(h, p)| !h.is_empty() && !p.is_empty()) else {
        return bad(format!("NIXL_TCPSTORE_ENDPOINT must be host:port, got: {endpoint}"));
    };
    if !port.bytes().all(|b| b.is_ascii_digit()) || !port.parse::<u32>().is_ok_and(|p| (1..=65535).contains(&p)) {
        return bad(format!("NIXL_TCPSTORE_ENDPOINT has invalid port: {port}"));
    }
    for k in ["NIXL_TCPSTORE_TIMEOUT_MS", "NIXL_TCPSTORE_OP_TIMEOUT_MS"] {
        if let Some(v) = crate::config::get(k, crate::config::Kind::Int)? {
            if crate::config::parse_signed(&v).is_none() {
                return bad(format!("{k}={v:?} is not a whole number of milliseconds"));
            }
        }
    }
    Ok(())
}

impl Mdx {
    /// Reads `NIXL_ETCD_ENDPOINTS`, `NIXL_ETCD_NAMESPACE` and `NIXL_TCPSTORE_ENDPOINT`; with `listen`, binds
    /// the listener (port 0: any free port) and prints the port it got.
    pub fn new(host: Arc<dyn Host>, listen: Option<u16>) -> Result<Mdx> {
        let env = |k: &str| -> Result<Option<String>> {
            match crate::config::get(k, crate::config::Kind::Str)? {
                // As NIXL: set, it must say something.
                Some(v) if v.is_empty() => {
                    Err(Error::invalid_param(format!("Config parameter '{k}' needs non-empty value")))
                }
                v => Ok(v.filter(|v| !v.trim().is_empty())),
            }
        };
        let (etcd_eps, tcpstore) = (env("NIXL_ETCD_ENDPOINTS")?, env("NIXL_TCPSTORE_ENDPOINT")?);
        if let Some(ep) = crate::config::get("NIXL_TCPSTORE_ENDPOINT", crate::config::Kind::Str)? {
            check_tcpstore(&ep)?;
        }
        if etcd_eps.is_some() && tcpstore.is_some() {
            return Err(Error::invalid_param("NIXL_ETCD_ENDPOINTS and NIXL_TCPSTORE_ENDPOINT are mutually exclusive"));
        }
        let listener = match listen {
            Some(port) => {
                let l = Arc::new(P2p::start(host.clone(), Some(port))?);
                if let Some(p) = l.port() {
                    // Scripts parse this line to learn an ephemeral port (also: `Agent::listen_port`).
                    eprintln!("gixl INFO: MD listener is listening on port {p}");
                }
                Some(l)
            }
            None => None,
        };
        let etcd = match etcd_eps {
            Some(eps) => Some(Etcd::start(&eps, env("NIXL_ETCD_NAMESPACE")?, host.clone())?),
            None => None,
        };
        let tcpstore = match tcpstore {
            Some(ep) => Some(TcpStore::start(ep.trim(), host.clone())?),
            None => None,
        };
        Ok(Mdx { host, listener, outbound: Mutex::new(None), etcd, tcpstore })
    }

    pub fn listen_port(&self) -> Option<u16> {
        self.listener.as_ref().and_then(|l| l.port())
    }

    /// Decide the route as NIXL does. `Ok(None)`: an address that does not parse, which NIXL only logs.
    pub fn route(&self, ip: &str, port: u16) -> Result<Option<Route>> {
        let ip = ip.trim();
        if !ip.is_empty() {
            return match ip.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
                Ok(a) => Ok(Some(Route::Peer(SocketAddr::new(a, port)))),
                Err(_) => {
                    log!("'{ip}' is not an IP address; nothing sent");
                    Ok(None)
                }
            };
        }
        if self.etcd.is_some() || self.tcpstore.is_some() {
            return Ok(Some(Route::Store));
        }
        Err(Error::invalid_param(
            "no peer address provided and no centralized store configured (set NIXL_ETCD_ENDPOINTS or \
             NIXL_TCPSTORE_ENDPOINT)",
        ))
    }

    fn p2p(&self) -> Result<Arc<P2p>> {
        if let Some(l) = &self.listener {
            return Ok(l.clone());
        }
        let mut o = self.outbound.lock();
        if let Some(p) = &*o {
            return Ok(p.clone());
        }
        let p = Arc::new(P2p::start(self.host.clone(), None)?);
        *o = Some(p.clone());
        Ok(p)
    }

    fn store(&self) -> Result<Store<'_>> {
        match (&self.etcd, &self.tcpstore) {
            (Some(e), _) => Ok(Store::Etcd(e)),
            (None, Some(t)) => Ok(Store::TcpStore(t)),
            (None, None) => Err(Error::invalid_param("no metadata store configured")),
        }
    }

    /// The store's name as NIXL's messages give it ("etcd", "TCPStore"), if one is configured.
    pub fn store_name(&self) -> Option<&'static str> {
        self.store().ok().map(|s| match s {
            Store::Etcd(_) => "etcd",
            Store::TcpStore(_) => "TCPStore",
        })
    }

    /// Publish metadata: LOAD to a peer, or under `label` (default "metadata") in the store.
    pub fn send(&self, route: Route, label: &str, md: Vec<u8>) -> Result<()> {
        let label = if label.is_empty() { etcd::DEFAULT_LABEL } else { label };
        match route {
            Route::Peer(to) => self.p2p()?.send(to, wire::encode(&wire::Msg::Load(&md))),
            Route::Store => match self.store()? {
                Store::Etcd(e) => e.send(label, md),
                Store::TcpStore(t) => t.send(label, md),
            },
        }
        Ok(())
    }

    pub fn fetch(&self, route: Route, name: &str, label: &str) -> Result<()> {
        let label = if label.is_empty() { etcd::DEFAULT_LABEL } else { label };
        match route {
            Route::Peer(to) => self.p2p()?.send(to, wire::encode(&wire::Msg::Send(name))),
            Route::Store => match self.store()? {
                Store::Etcd(e) => e.fetch(name, label),
                Store::TcpStore(t) => t.fetch(name, label),
            },
        }
        Ok(())
    }

    pub fn invalidate_local(&self, route: Route) -> Result<()> {
        match route {
            Route::Peer(to) => self.p2p()?.send(to, wire::encode(&wire::Msg::Invl(&self.host.name()))),
            Route::Store => match self.store()? {
                Store::Etcd(e) => e.invalidate_local(),
                Store::TcpStore(t) => t.invalidate_local(),
            },
        }
        Ok(())
    }

    /// The peer `name` is no longer loaded: end what watches it (etcd's prefix watch).
    pub fn forget(&self, name: &str) {
        if let Some(e) = &self.etcd {
            e.forget(name);
        }
    }

    /// Deliver what is queued (bounded), then stop every thread.
    pub fn shutdown(&self) {
        if let Some(l) = &self.listener {
            l.shutdown();
        }
        if let Some(o) = self.outbound.lock().take() {
            o.shutdown();
        }
        if let Some(e) = &self.etcd {
            e.shutdown();
        }
        if let Some(t) = &self.tcpstore {
            t.shutdown();
        }
    }
}

/// The metadata store configured (at most one).
enum Store<'a> {
    Etcd(&'a Etcd),
    TcpStore(&'a TcpStore),
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    use crate::mem::{Desc, MemType, RegDList, RegDesc, XferDList};
    use crate::status::Status;
    use crate::{Agent, AgentConfig, Params};

    fn agent(name: &str, listen: bool) -> Agent {
        let cfg = AgentConfig { listen_thread: listen, listen_port: 0, ..Default::default() };
        let a = Agent::new(name, cfg).unwrap();
        a.create_backend("UCX", &Params::new()).unwrap();
        a
    }

    fn one(buf: &[u8]) -> RegDList {
        RegDList::with_descs(
            MemType::Dram,
            vec![RegDesc { desc: Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0), meta: vec![] }],
        )
    }

    fn xl(buf: &[u8]) -> XferDList {
        XferDList::with_descs(MemType::Dram, vec![Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0)])
    }

    /// Poll until `f` holds; returns how long it took.
    fn until(what: &str, f: impl Fn() -> bool) -> Duration {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
        t.elapsed()
    }

    #[test]
    fn fetch_send_partial_and_invalidate_through_a_listener() {
        let b = agent("p2p-B", true);
        let port = b.listen_port().expect("listening");
        assert_ne!(port, 0);
        // The fetching side has no listener at all.
        let a = agent("p2p-A", false);
        assert_eq!(a.listen_port(), None);
        let (ba, bb) = (vec![1u8; 4096], vec![2u8; 4096]);
        b.register_mem(&one(&ba), &[]).unwrap();
        a.fetch_remote_md("p2p-B", "127.0.0.1", port, "").unwrap();
        let took = until("fetch", || a.check_remote_md("p2p-B", &xl(&ba)).is_ok());
        assert!(took < Duration::from_secs(2), "{took:?}");

        // send: B learns A.
        a.send_local_md("127.0.0.1", port).unwrap();
        until("send", || b.check_remote_md("p2p-A", &XferDList::new(MemType::Dram)).is_ok());

        // Partial metadata: connection info with one region, then a second region alone.
        let c = agent("p2p-C", false);
        let (c1, c2) = (vec![3u8; 4096], vec![4u8; 8192]);
        c.register_mem(&one(&c1), &[]).unwrap();
        c.register_mem(&one(&c2), &[]).unwrap();
        c.send_local_partial_md(&one(&c1), true, &[], "127.0.0.1", port, "ignored").unwrap();
        until("partial 1", || b.check_remote_md("p2p-C", &xl(&c1)).is_ok());
        assert_eq!(b.check_remote_md("p2p-C", &xl(&c2)).unwrap_err().status(), Status::NotFound);
        c.send_local_partial_md(&one(&c2), false, &[], "127.0.0.1", port, "").unwrap();
        until("partial 2", || b.check_remote_md("p2p-C", &xl(&c2)).is_ok());

        // invalidate: B forgets A, and only A.
        a.invalidate_local_md("127.0.0.1", port).unwrap();
        until("invalidate", || b.check_remote_md("p2p-A", &XferDList::new(MemType::Dram)).is_err());
        assert!(b.check_remote_md("p2p-C", &xl(&c2)).is_ok());
        drop(bb);
    }

    #[test]
    fn nixl_routing_and_argument_errors() {
        let a = agent("p2p-route", false);
        // No address and no store: INVALID_PARAM, synchronously.
        if crate::config::get("NIXL_ETCD_ENDPOINTS", crate::config::Kind::Str).ok().flatten().is_none() {
            assert_eq!(a.send_local_md("", 0).unwrap_err().status(), Status::InvalidParam);
            assert_eq!(a.fetch_remote_md("x", "", 0, "").unwrap_err().status(), Status::InvalidParam);
            assert_eq!(a.invalidate_local_md("", 0).unwrap_err().status(), Status::InvalidParam);
        }
        // A bad address or a dead port is only logged.
        a.send_local_md("not-an-ip", 1).unwrap();
        a.send_local_md("127.0.0.1", 1).unwrap();
        a.invalidate_local_md("127.0.0.1", 1).unwrap();
        assert_eq!(a.fetch_remote_md("", "127.0.0.1", 1, "").unwrap_err().status(), Status::InvalidParam);
        assert_eq!(a.fetch_remote_md("p2p-route", "127.0.0.1", 1, "").unwrap_err().status(), Status::InvalidParam);
        // Without a remote-capable backend there is no metadata: the error comes back at once.
        let bare = Agent::new("p2p-bare", AgentConfig::default()).unwrap();
        assert_eq!(bare.send_local_md("127.0.0.1", 1).unwrap_err().status(), Status::InvalidParam);
    }

    /// A listener that answers a fetch with another agent's metadata, answers twice, or does not answer: it
    /// loads nothing it was not asked for, once, and the connection is left within the reply deadline.
    #[test]
    fn a_fetch_loads_only_the_agent_asked_for_once_and_waits_so_long() {
        use super::wire::{self, Msg};
        let rogue = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = rogue.local_addr().unwrap().port();
        let wanted = agent("p2p-wanted", false);
        let other = agent("p2p-other", false);
        let (wmd, omd) = (wanted.local_md().unwrap(), other.local_md().unwrap());
        let a = agent("p2p-fetcher", false);
        // Read one frame (a request) off `s`.
        let request = |s: &mut TcpStream| -> Vec<u8> {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                if let Ok(Some((_, n))) = wire::parse(&buf) {
                    buf.truncate(n);
                    return buf;
                }
                let n = s.read(&mut chunk).unwrap();
                assert!(n > 0, "closed before a request came");
                buf.extend_from_slice(&chunk[..n]);
            }
        };
        // 1. Asked for p2p-wanted, answers with p2p-other: nothing loaded, the connection is closed.
        a.fetch_remote_md("p2p-wanted", "127.0.0.1", port, "").unwrap();
        let (mut s, _) = rogue.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        assert!(matches!(wire::parse(&request(&mut s)), Ok(Some((Msg::Send("p2p-wanted"), _)))));
        s.write_all(&wire::encode(&Msg::Load(&omd))).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(a.check_remote_md("p2p-other", &XferDList::new(MemType::Dram)).is_err(), "not asked for: not loaded");
        // 2. Answers with p2p-wanted twice and p2p-other after: the first loads, the rest close the connection.
        a.fetch_remote_md("p2p-wanted", "127.0.0.1", port, "").unwrap();
        let (mut s, _) = rogue.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        request(&mut s);
        s.write_all(&wire::encode(&Msg::Load(&wmd))).unwrap();
        until("the answer asked for", || a.check_remote_md("p2p-wanted", &XferDList::new(MemType::Dram)).is_ok());
        a.invalidate_remote_md("p2p-wanted").unwrap();
        let _ = s.write_all(&wire::encode(&Msg::Load(&wmd)));
        let _ = s.write_all(&wire::encode(&Msg::Load(&omd)));
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(
            a.check_remote_md("p2p-wanted", &XferDList::new(MemType::Dram)).is_err(),
            "a second answer loads nothing"
        );
        assert!(a.check_remote_md("p2p-other", &XferDList::new(MemType::Dram)).is_err());
        // 3. Never answers: the fetching side leaves within the reply deadline (10 s), not never.
        a.fetch_remote_md("p2p-wanted", "127.0.0.1", port, "").unwrap();
        let (mut s, _) = rogue.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        request(&mut s);
        let t = Instant::now();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        let took = t.elapsed();
        assert!(took >= Duration::from_secs(5) && took < Duration::from_secs(25), "left after {took:?}");
    }

    #[test]
    fn a_wrong_name_loads_nothing_and_garbage_closes_only_its_connection() {
        let b = agent("p2p-named", true);
        let port = b.listen_port().unwrap();
        // Garbage (NIXL's own protocol, say) is refused with an ERR frame and the connection closed.
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"\x0d\0\0\0\0\0\0\0NIXLCOMM:SEND").unwrap();
        let mut r = Vec::new();
        s.read_to_end(&mut r).unwrap();
        match super::wire::parse(&r) {
            Ok(Some((super::wire::Msg::Err(why), n))) => {
                assert!(why.contains("not a gixl metadata frame"), "{why}");
                assert_eq!(n, r.len(), "nothing after the ERR");
            }
            other => panic!("expected one ERR frame, got {other:?}"),
        }
        // A request for another agent's name gets an error frame, not metadata.
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&super::wire::encode(&super::wire::Msg::Send("someone-else"))).unwrap();
        let mut head = [0u8; super::wire::HEADER];
        s.read_exact(&mut head).unwrap();
        assert_eq!(head[4], 4, "ERR frame");
        // The listener still serves everyone else.
        let a = agent("p2p-asker", false);
        a.fetch_remote_md("someone-else", "127.0.0.1", port, "").unwrap();
        a.fetch_remote_md("p2p-named", "127.0.0.1", port, "").unwrap();
        until("fetch", || a.check_remote_md("p2p-named", &XferDList::new(MemType::Dram)).is_ok());
        assert!(a.check_remote_md("someone-else", &XferDList::new(MemType::Dram)).is_err());
    }

    #[test]
    fn a_taken_port_fails_agent_creation() {
        let l = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let cfg = AgentConfig { listen_thread: true, listen_port: port, ..Default::default() };
        assert!(Agent::new("p2p-taken", cfg).is_err());
    }

    #[test]
    fn queued_invalidation_goes_out_when_the_agent_is_dropped() {
        let b = agent("p2p-keeper", true);
        let port = b.listen_port().unwrap();
        let a = agent("p2p-leaver", false);
        a.send_local_md("127.0.0.1", port).unwrap();
        until("load", || b.check_remote_md("p2p-leaver", &XferDList::new(MemType::Dram)).is_ok());
        a.invalidate_local_md("127.0.0.1", port).unwrap();
        drop(a);
        until("invalidate", || b.check_remote_md("p2p-leaver", &XferDList::new(MemType::Dram)).is_err());
    }
}
