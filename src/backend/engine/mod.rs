//! gixl's default transfer engine, registered under the name "UCX" because that is the name NIXL users ask
//! for. It is gixl's own code, not the UCX library; UCX-specific init options (`engine_config`,
//! `device_list`, `ucx_devices`, `ucx_error_handling_mode`, ...) are accepted and ignored.
//!
//! Routes (`route/`, one file each behind `route::Route`), chosen per peer by `router` from its connection info:
//! - loopback and peers in this process (found in the process's registry of live engines by incarnation id,
//!   never by connection info): `memcpy`;
//! - peers in another process on this host: cross-memory attach (see `route::cma`), the peer identified by pid +
//!   start time and watched through a pidfd; where the kernel denies it, that peer's data moves over TCP;
//! - peers on another host (another boot, pid or network namespace): TCP (see `route::tcp`), or RDMA where both
//!   have a port on one fabric (see `route::rdma`: queue pairs exchanged over the TCP link, which keeps
//!   heartbeats and notifications), or libfabric where both have an endpoint of a provider that is not sockets
//!   (efa, verbs…) and its device passed its self-test (see `route::fabric`: one-sided reads and writes, the TCP
//!   link keeping the rest).
//!
//! Same-host routes copy batch by batch, each batch inside the target incarnation's gate (see `gate`): the
//! target's live flag and registrations decide, and deregistration and destruction wait for batches inside.
//!
//! VRAM (either side in GPU memory) goes the way its peer's route says (`route::Route::vram`): on this host
//! through `vram` (device copies, CUDA IPC handles, behind the same gate); over TCP staged (`route::tcp::vram`);
//! over RDMA as DRAM does where the NICs reach every region, and over libfabric where a path's rails carry every
//! region (`FI_HMEM`), else staged over the TCP link.
//!
//! Small requests complete inline in `post`; large ones are split across a few copy threads (or, over TCP,
//! across the peer's data connections).
//!
//! Configuration (backend parameter, else environment variable, else default):
//! - `transport` / `GIXL_TRANSPORT`: `auto` (above), `tcp` (every peer, even in this process, over TCP;
//!   loopback requests still use `memcpy`), `rdma` (every peer with a port on our fabric over RDMA) or `fabric`
//!   (every peer with an endpoint of our libfabric provider over libfabric, the tcp and shm providers included).
//! - `fabric_provider` / `GIXL_FABRIC_PROVIDER` (else `FI_PROVIDER`), `fabric_domain` / `GIXL_FABRIC_DOMAIN`:
//!   the libfabric provider and domain (docs/libfabric.md).
//! - `tcp_addr` / `GIXL_TCP_ADDR`: the listener's address, `IP` or `IP:PORT` (default all IPv4 interfaces,
//!   an ephemeral port). A specific IP is the only address advertised; otherwise every interface's is.
//! - `tcp_conns` / `GIXL_TCP_CONNS`: data connections per TCP peer (default 4).
//! - `disconnect_timeout_ms` / `GIXL_DISCONNECT_TIMEOUT_MS`: how long a TCP peer with requests in flight may
//!   stay silent before they fail with REMOTE_DISCONNECT (default 1000).
//! - `notif_queue_msgs` / `GIXL_NOTIF_QUEUE_MSGS`, `notif_queue_bytes` / `GIXL_NOTIF_QUEUE_BYTES`: how many
//!   notifications (and bytes) may wait for the application (default 65536, 256 MiB). Beyond, the local
//!   sockets and TCP control connections are not read, so senders wait and then fail with BACKEND.
//!
//! The engine keeps its own table of registered regions: a TCP peer can reach only those, whatever its
//! metadata claims, and only over connections that proved they know the per-engine secret from its metadata
//! (the secret itself never crosses the network). It does not encrypt: data crosses in the clear.

mod conn;
mod copy;
mod ctrl;
mod exports;
mod gate;
#[cfg(test)]
mod harness;
mod health;
mod keys;
mod near;
mod notif;
mod peer;
pub(crate) mod pool;
mod route;
mod router;
mod shared;
mod sides;
pub(crate) mod vram;
mod vram_regions;
mod xfer;

use std::sync::Arc;

use super::{Backend, BackendInit, BackendXfer, Caps, LocalRegion, Params, Peer, RegionKey, Target, XferPlan};
use crate::mem::{Desc, MemType, RegDesc};
use crate::status::{Error, Result};
use conn::{decode_ticket, parse_conn, RemoteRegion};
use peer::downcast;
use shared::Shared;
use xfer::{Core, EngineXfer, Mover};

pub use conn::tcp_endpoint;
pub(crate) use conn::{fuzz_conn_as_v4, fuzz_parse_conn};
pub(crate) use ctrl::{fuzz_hello, fuzz_parse_frames};
#[doc(hidden)]
pub use route::rdma::posting_stats as rdma_posting_stats;
pub use route::tcp::wire;

pub fn default_params() -> Params {
    [("num_threads", "0"), ("num_workers", "1"), ("ucx_devices", ""), ("ucx_error_handling_mode", "peer")]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

pub fn create(init: BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(Engine::new(init)?))
}

/// The same engine under NIXL's `LIBFABRIC` plugin name (what Ray asks for on EFA nodes): its peers on other
/// hosts go over the libfabric route (`route::fabric`) where this host has a provider that is not sockets or
/// shared memory (efa, verbs, psm…; tcp and shm only with `GIXL_TRANSPORT=fabric`) and its device passes its
/// self-test, else over the engine's other routes (docs/libfabric.md). NIXL's LIBFABRIC parameters are accepted
/// and, but for `num_threads`, ignored.
pub fn create_libfabric(init: BackendInit) -> Result<Arc<dyn Backend>> {
    let agent = init.agent_name.clone();
    let engine = Engine::named(init, "LIBFABRIC")?;
    let fabric = engine.shared.sides.routes().find(|(n, _)| n.name() == "libfabric").map(|(_, s)| s);
    route::fabric::say(&agent, fabric);
    Ok(Arc::new(engine))
}

pub struct Engine {
    shared: Arc<Shared>,
    /// The plugin name it was created under ("UCX" or "LIBFABRIC"): its metadata section's name.
    name: &'static str,
}

impl Engine {
    fn new(init: BackendInit) -> Result<Engine> {
        Engine::named(init, "UCX")
    }

    fn named(init: BackendInit, name: &'static str) -> Result<Engine> {
        Ok(Engine { shared: Shared::start(init)?, name })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.shutdown();
    }
}

impl Backend for Engine {
    fn name(&self) -> &'static str {
        self.name
    }

    fn caps(&self) -> Caps {
        // VRAM is advertised as NIXL's UCX plugin does; registering it needs a device layer (`crate::device`).
        Caps { local: true, remote: true, notif: true, mems: vec![MemType::Dram, MemType::Vram] }
    }

    fn params(&self) -> Params {
        [("num_threads".to_owned(), self.shared.threads.to_string())].into_iter().collect()
    }

    fn register(&self, mem: MemType, desc: &RegDesc) -> Result<LocalRegion> {
        self.shared.register(mem, desc)
    }

    fn deregister(&self, _: MemType, _: &Desc, key: Option<&RegionKey>) {
        self.shared.deregister(&[key]);
    }

    fn deregister_many(&self, _: MemType, regions: &[(Desc, Option<RegionKey>)]) {
        self.shared.deregister(&regions.iter().map(|(_, k)| k.as_ref()).collect::<Vec<_>>());
    }

    fn load_remote_region(
        &self,
        peer: &Arc<dyn Peer>,
        mem: MemType,
        desc: &Desc,
        public: &[u8],
    ) -> Result<Option<RegionKey>> {
        if mem == MemType::Vram {
            return vram_regions::load_remote(downcast(peer)?.incarnation, desc, public).map(Some);
        }
        let (ticket, tickets) = decode_ticket(public)?;
        Ok(Some(Arc::new(RemoteRegion { addr: desc.addr, len: desc.len, ticket, tickets })))
    }

    fn conn_info(&self) -> Vec<u8> {
        self.shared.conn_info()
    }

    fn load_peer(&self, agent: &str, incarnation: u128, conn: &[u8]) -> Result<Arc<dyn Peer>> {
        Ok(Arc::new(router::load(&self.shared, agent, incarnation, &parse_conn(conn)?)?))
    }

    fn connect(&self, peer: &Arc<dyn Peer>) -> Result<()> {
        let p = downcast(peer)?;
        if p.disconnected() {
            return Err(crate::backend::disconnected(&p.name, p));
        }
        p.connect(&self.shared.agent)
    }

    fn disconnect(&self, peer: &Arc<dyn Peer>) {
        if let Ok(p) = downcast(peer) {
            p.close();
        }
    }

    fn prep_xfer(&self, plan: XferPlan) -> Result<Box<dyn BackendXfer>> {
        let wants = vram::wants(&plan);
        if !wants && (plan.local_mem != MemType::Dram || plan.remote_mem != MemType::Dram) {
            return Err(Error::not_supported("this engine moves DRAM and VRAM only"));
        }
        // What the peer's route needs of the regions (an RDMA peer: their memory regions and keys), found once.
        let prepared = match &plan.target {
            Target::Remote(p) => downcast(p)?.via().prepare(&route::Regions {
                local: &plan.local_keys,
                remote: &plan.remote_keys,
                exports: exports::Registered::exports,
                tickets: region_tickets,
            }),
            Target::Local => None,
        };
        let way = wants.then(|| router::vram_way(&plan, prepared.as_deref())).transpose()?;
        let mover: Option<Box<dyn Mover>> = match way {
            Some(route::VramWay::Staged(link)) => Some(Box::new(route::tcp::vram::prep(&plan, link)?)),
            Some(route::VramWay::Local) => Some(Box::new(vram::prep(&self.shared, &plan)?)),
            Some(route::VramWay::Direct) | None => None,
        };
        Ok(EngineXfer::boxed(Core { shared: self.shared.clone(), plan, mover, prepared }))
    }

    fn notifs(&self, out: &mut Vec<(String, Vec<u8>)>) -> Result<()> {
        // Read ready local sockets in this thread rather than wait for the progress thread to run.
        self.shared.ctrl.drain();
        out.append(&mut self.shared.queue.lock());
        // Control connections paused for a full queue may be read again.
        self.shared.ctrl.tcp.notifs_taken();
        Ok(())
    }

    fn shutdown(&self) {
        self.shared.shutdown();
    }

    fn gen_notif(&self, target: &Target, msg: &[u8]) -> Result<()> {
        notif::check(msg)?;
        match target {
            Target::Local => {
                self.shared.queue.lock().push((self.shared.agent.clone(), msg.to_vec()));
                Ok(())
            }
            Target::Remote(p) => downcast(p)?.notify(&self.shared.agent, msg),
        }
    }
}

/// What the routes read of a peer region's ticket, DRAM or VRAM (`route::Regions::tickets`).
fn region_tickets(key: &RegionKey) -> Option<&route::Tickets> {
    key.downcast_ref::<RemoteRegion>()
        .map(|r| &r.tickets)
        .or_else(|| key.downcast_ref::<vram_regions::RemoteVram>().map(|v| &v.tickets))
}

#[cfg(test)]
mod tests {
    use super::conn::{conn_v3_to_v4, SEC_LOCAL};
    use super::gate::{Attached, Gate};
    use super::peer::PeerKind;
    use super::*;
    use crate::backend::Seg;
    use crate::status::Status;
    use std::net::SocketAddr;
    use std::time::{Duration, Instant};

    /// What the gate adds per batch of a same-host transfer, measured in this process (run by hand:
    /// `cargo test --release --lib measure_gate_cost -- --ignored --nocapture`).
    #[test]
    #[ignore = "a measurement, not a check"]
    fn measure_gate_cost() {
        let g = Arc::new(Gate::create(3).unwrap());
        let t = g.register(0x10000, 0x10000).unwrap();
        let a = Attached::new(g.clone()).unwrap();
        let pidfd = crate::os::pidfd_open(std::process::id() as i32).unwrap();
        let n = 200_000;
        let per = |t0: Instant| t0.elapsed().as_nanos() as f64 / n as f64;
        let t0 = Instant::now();
        for _ in 0..n {
            let _i = std::hint::black_box(a.enter([(t.slot, t.state, 0x10000, 0x1000)]).unwrap());
        }
        let enter = per(t0);
        let t0 = Instant::now();
        for _ in 0..n {
            assert!(crate::os::pidfd_alive(std::hint::black_box(std::os::fd::AsFd::as_fd(&pidfd))));
        }
        let poll = per(t0);
        let src = vec![1u8; 4096];
        let mut dst = vec![0u8; 4096];
        let s = Seg {
            local: dst.as_mut_ptr() as u64,
            remote: src.as_ptr() as u64,
            len: 4096,
            ldev: 0,
            rdev: 0,
            lreg: 0,
            rreg: 0,
        };
        let me = std::process::id() as i32;
        let probe = copy::Probe { addr: g.addr(), incarnation: 3 };
        let absent = std::sync::atomic::AtomicU32::new(0);
        let t0 = Instant::now();
        for _ in 0..n {
            let mut gone = false;
            unsafe { copy::cma_batch(me, XferOp::Read, &[s], &probe, &absent, &mut gone) }.unwrap();
        }
        let with_probe = per(t0);
        let t0 = Instant::now();
        for _ in 0..n {
            let mut gone = false;
            unsafe { copy::cma_batch(me, XferOp::Read, &[s], &probe, g.sentinel(), &mut gone) }.unwrap();
        }
        let with_sentinel = per(t0);
        let (l, r) = (
            libc::iovec { iov_base: s.local as *mut _, iov_len: 4096 },
            libc::iovec { iov_base: s.remote as *mut _, iov_len: 4096 },
        );
        let t0 = Instant::now();
        for _ in 0..n {
            assert_eq!(unsafe { libc::process_vm_readv(me, &l, 1, &r, 1, 0) }, 4096);
        }
        let bare = per(t0);
        // The VRAM route's bracket: its copies are not cross-memory attach, so the probe is a call of its own.
        let t0 = Instant::now();
        for _ in 0..n {
            copy::probe(me, std::hint::black_box(&probe), &mut false).unwrap();
        }
        let alone = per(t0);
        eprintln!(
            "gate per batch: enter+leave {enter:.0} ns; 4 KiB process_vm_readv {bare:.0} ns bare vs {with_probe:.0} ns \
             with the probe iovec (+{:.0} ns), {with_sentinel:.0} ns watched by the sentinel (reads); added per \
             write batch ≈ {:.2} µs (a pidfd poll, not done, would add {poll:.0} ns more); the probe as a call \
             of its own {alone:.0} ns",
            with_probe - bare,
            (enter + with_probe - bare) / 1000.0
        );
    }

    /// An agent loads a peer's metadata whose connection info is layout 4 with a section for a route it does not
    /// know, and transfers over the routes both share; without the same-host section it goes by TCP.
    #[test]
    fn metadata_of_a_later_release_loads_and_transfers() {
        let b = Agent::new("v4-target", AgentConfig::default()).unwrap();
        b.create_backend("UCX", &Params::new()).unwrap();
        let a = Agent::new("v4-initiator", AgentConfig::default()).unwrap();
        a.create_backend("UCX", &Params::new()).unwrap();
        let src: Vec<u8> = (0..1 << 16).map(|i| (i % 253) as u8).collect();
        let dst = vec![0u8; 1 << 16];
        reg(&b, &src);
        reg(&a, &dst);
        for (drop, route) in [(&[][..], "in-process"), (&[SEC_LOCAL][..], "tcp")] {
            let mut md = AgentMd::decode(&b.local_md().unwrap()).unwrap();
            md.conns[0].1 = conn_v3_to_v4(&md.conns[0].1, drop, &[(42, &[7; 40])]).unwrap();
            a.load_remote_md(&md.encode()).unwrap();
            let got = a.inner.remotes.read().get("v4-target").unwrap().telemetry_row().route;
            assert_eq!(got, route);
            let r = a.create_xfer_req(
                XferOp::Read,
                &xl(&dst, 0, 1 << 16),
                &xl(&src, 0, 1 << 16),
                "v4-target",
                &XferOpts::default(),
            );
            let r = r.unwrap();
            a.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
            assert_eq!(wait(&a, &r, Duration::from_secs(10)).unwrap(), Status::Success, "{route}");
            assert!(dst == src);
            a.invalidate_remote_md("v4-target").unwrap();
        }
    }

    /// Two agents that both ask for LIBFABRIC (as Ray does on both ends) talk over the engine's routes, the section in
    /// their metadata named LIBFABRIC; an agent with only UCX has no backend in common with them (loading their
    /// metadata fails).
    #[test]
    fn the_libfabric_name_is_the_engine() {
        let b = Agent::new("lf-target", AgentConfig::default()).unwrap();
        b.create_backend("LIBFABRIC", &Params::new()).unwrap();
        let a = Agent::new("lf-initiator", AgentConfig::default()).unwrap();
        let p: Params = [("num_threads", "2"), ("split_batch_size", "512")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        a.create_backend("LIBFABRIC", &p).unwrap();
        let src: Vec<u8> = (0..1 << 16).map(|i| (i % 251) as u8).collect();
        let dst = vec![0u8; 1 << 16];
        reg(&b, &src);
        reg(&a, &dst);
        let md = b.local_md().unwrap();
        assert_eq!(AgentMd::decode(&md).unwrap().conns[0].0, "LIBFABRIC");
        a.load_remote_md(&md).unwrap();
        let r = a
            .create_xfer_req(
                XferOp::Read,
                &xl(&dst, 0, 1 << 16),
                &xl(&src, 0, 1 << 16),
                "lf-target",
                &XferOpts::default(),
            )
            .unwrap();
        a.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
        assert_eq!(wait(&a, &r, Duration::from_secs(10)).unwrap(), Status::Success);
        assert!(dst == src);
        let u = Agent::new("lf-ucx-only", AgentConfig::default()).unwrap();
        u.create_backend("UCX", &Params::new()).unwrap();
        let e = u.load_remote_md(&md).unwrap_err();
        assert!(e.message().contains("no backend in common"), "{e}");
    }

    // ----- the TCP route between two agents of this process (`transport=tcp`) -----

    use crate::agent::{Agent, AgentConfig, NotifUpdate, XferOpts};
    use crate::backend::XferOp;
    use crate::md::AgentMd;
    use crate::mem::{RegDList, XferDList};
    use std::io::{Read, Write};
    use std::net::TcpStream;

    /// The TCP link `a` holds to the loaded peer `name`.
    fn tcp_link_of(a: &Agent, name: &str) -> Arc<route::tcp::link::TcpLink> {
        let remotes = a.inner.remotes.read();
        let (_, p) = remotes.get(name).unwrap().peers[0].clone();
        match &downcast(&p).unwrap().kind {
            PeerKind::Net(r) => r.link().expect("a TCP peer").clone(),
            PeerKind::InProcess(_) | PeerKind::Cma(_) => {
                panic!("not a TCP peer")
            }
        }
    }

    /// Put a data connection to a stand-in target, which `serve` answers on a thread, in `link`'s pool of idle
    /// connections: the next request takes it.
    fn plant(
        link: &route::tcp::link::TcpLink,
        serve: impl FnOnce(TcpStream) + Send + 'static,
    ) -> std::thread::JoinHandle<()> {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let planted = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let h = std::thread::spawn(move || serve(l.accept().unwrap().0));
        link.plant_idle(planted);
        h
    }

    fn tcp_agent(name: &str, extra: &[(&str, &str)]) -> Agent {
        let a = Agent::new(name, AgentConfig::default()).unwrap();
        let mut p: Params = [("transport", "tcp"), ("tcp_addr", "127.0.0.1")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        for (k, v) in extra {
            p.insert(k.to_string(), v.to_string());
        }
        a.create_backend("UCX", &p).unwrap();
        a
    }

    fn reg(a: &Agent, buf: &[u8]) -> RegDList {
        let l = RegDList::with_descs(
            MemType::Dram,
            vec![RegDesc { desc: Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0), meta: vec![] }],
        );
        a.register_mem(&l, &[]).unwrap();
        l
    }

    fn xl(buf: &[u8], off: usize, len: usize) -> XferDList {
        XferDList::with_descs(MemType::Dram, vec![Desc::new(buf.as_ptr() as u64 + off as u64, len as u64, 0)])
    }

    fn wait(a: &Agent, r: &crate::agent::XferReq, limit: Duration) -> Result<Status> {
        let t = Instant::now();
        loop {
            match a.xfer_status(r)? {
                Status::InProg if t.elapsed() < limit => std::thread::sleep(Duration::from_micros(200)),
                s => return Ok(s),
            }
        }
    }

    fn notifs_until(a: &Agent, n: usize) -> Vec<(String, Vec<u8>)> {
        let t = Instant::now();
        let mut got = Vec::new();
        while got.len() < n && t.elapsed() < Duration::from_secs(10) {
            got.extend(a.notifs(&[]).unwrap());
            std::thread::sleep(Duration::from_millis(2));
        }
        got
    }

    /// A pooled data connection that the target closes after the initiator checked it for a hang-up (the target
    /// replaced it, its serving slots being full, or it had idled past `IDLE_DATA`): the request goes once more
    /// over another connection and succeeds. The link went down, and the READ failed with REMOTE_DISCONNECT.
    #[test]
    fn a_pooled_connection_closed_under_the_first_request_is_tried_once_more() {
        let a = tcp_agent("pool-A", &[]);
        let b = tcp_agent("pool-B", &[]);
        let src: Vec<u8> = (0..65536).map(|i| (i % 239) as u8).collect();
        let dst = vec![0u8; 65536];
        reg(&a, &dst);
        reg(&b, &src);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let read = || {
            let r = a.create_xfer_req(
                XferOp::Read,
                &xl(&dst, 0, 65536),
                &xl(&src, 0, 65536),
                "pool-B",
                &XferOpts::default(),
            );
            let r = r.unwrap();
            a.post_xfer_req(&r, NotifUpdate::Keep).and_then(|_| wait(&a, &r, Duration::from_secs(10)))
        };
        assert_eq!(read().unwrap(), Status::Success);
        // A connection that looks healthy until a request arrives, then is closed unanswered.
        let closer = plant(&tcp_link_of(&a, "pool-B"), |mut s| {
            let mut b = [0u8; 1];
            let _ = s.read(&mut b);
        });
        assert_eq!(read().map_err(|e| e.status()), Ok(Status::Success));
        assert!(dst == src);
        closer.join().unwrap();
        assert_eq!(read().unwrap(), Status::Success, "the link stayed up");
    }

    /// A request whose first data connection cannot be had in time (the target's handshakes queued behind 63
    /// other peers', as in `tests/netns.rs`'s fan-in) while the peer answers heartbeats: dialled again, not
    /// declared dead (before: REMOTE_DISCONNECT and the link down for a back-off).
    #[test]
    fn a_first_data_connection_that_cannot_be_had_in_time_is_dialled_again_while_the_peer_answers() {
        let a = tcp_agent("dial-A", &[("disconnect_timeout_ms", "1000")]);
        let b = tcp_agent("dial-B", &[]);
        let len = 65536;
        let src = vec![5u8; len];
        let dst = vec![0u8; len];
        reg(&a, &dst);
        reg(&b, &src);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        tcp_link_of(&a, "dial-B").fail_data_dials.store(3, std::sync::atomic::Ordering::Release);
        let r = a.create_xfer_req(XferOp::Read, &xl(&dst, 0, len), &xl(&src, 0, len), "dial-B", &XferOpts::default());
        let r = r.unwrap();
        let s = a.post_xfer_req(&r, NotifUpdate::Keep).and_then(|_| wait(&a, &r, Duration::from_secs(30)));
        assert_eq!(s.map_err(|e| e.to_string()), Ok(Status::Success), "a slow peer is not a dead one");
        assert_eq!(tcp_link_of(&a, "dial-B").fail_data_dials.load(std::sync::atomic::Ordering::Acquire), 0);
        assert!(dst == src);
    }

    /// A target that answers heartbeats but takes longer than the data connections' socket timeout (the stall
    /// bound, 5 s) to serve a request, as one serving many peers on few cores does: the request is waited for
    /// and succeeds, and the link stays up. Before, the socket timeout took the link down and the READ failed
    /// with REMOTE_DISCONNECT although the peer was alive.
    #[test]
    fn a_slow_target_that_answers_heartbeats_is_waited_for() {
        let a = tcp_agent("slow-A", &[("disconnect_timeout_ms", "1000")]);
        let b = tcp_agent("slow-B", &[]);
        let len = 65536;
        let src = vec![7u8; len];
        let dst = vec![0u8; len];
        reg(&a, &dst);
        reg(&b, &src);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let read = || {
            let r =
                a.create_xfer_req(XferOp::Read, &xl(&dst, 0, len), &xl(&src, 0, len), "slow-B", &XferOpts::default());
            let r = r.unwrap();
            a.post_xfer_req(&r, NotifUpdate::Keep).and_then(|_| wait(&a, &r, Duration::from_secs(30)))
        };
        assert_eq!(read().unwrap(), Status::Success);
        // A data connection whose far end takes the request and answers 6 s later with other bytes (B itself
        // keeps answering the heartbeats on the control connection meanwhile).
        let server = plant(&tcp_link_of(&a, "slow-B"), move |mut s| {
            let mut req = [0u8; 256];
            let _ = s.read(&mut req).unwrap();
            std::thread::sleep(Duration::from_secs(6));
            s.write_all(&wire::encode_reply(wire::REPLY_OK)).unwrap();
            s.write_all(&vec![9u8; len]).unwrap();
        });
        let t0 = Instant::now();
        assert_eq!(read().map_err(|e| e.status()), Ok(Status::Success), "a slow peer is not a dead one");
        assert!(t0.elapsed() >= Duration::from_secs(6));
        assert!(dst.iter().all(|&x| x == 9), "the slow connection's bytes landed");
        server.join().unwrap();
        assert_eq!(read().unwrap(), Status::Success, "the link stayed up");
        assert!(dst == src);
    }

    #[test]
    fn tcp_read_write_many_blocks_and_notifications() {
        let a = tcp_agent("tcp-A", &[]);
        let b = tcp_agent("tcp-B", &[("tcp_conns", "3")]);
        let size = 12 << 20;
        let src: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let dst = vec![0u8; size];
        reg(&a, &dst);
        reg(&b, &src);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();

        // One large READ, split across data connections, with a notification after the data.
        let opts = XferOpts { notif: Some(b"big\0done".to_vec()), ..Default::default() };
        let r = a.create_xfer_req(XferOp::Read, &xl(&dst, 0, size), &xl(&src, 0, size), "tcp-B", &opts).unwrap();
        a.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
        assert_eq!(wait(&a, &r, Duration::from_secs(20)).unwrap(), Status::Success);
        assert!(dst == src);
        assert_eq!(notifs_until(&b, 1), vec![("tcp-A".to_string(), b"big\0done".to_vec())]);

        // 1000 separate small WRITEs in reversed order (nothing merges), then a small inline one.
        let bs = 4096;
        let n = 1000;
        let wsrc: Vec<u8> = (0..n * bs).map(|i| (i / bs) as u8 ^ 0x5a).collect();
        reg(&a, &wsrc);
        let wdst = vec![0u8; n * bs];
        reg(&b, &wdst);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let l = XferDList::with_descs(
            MemType::Dram,
            (0..n).map(|i| Desc::new(wsrc.as_ptr() as u64 + (i * bs) as u64, bs as u64, 0)).collect(),
        );
        let rl = XferDList::with_descs(
            MemType::Dram,
            (0..n).rev().map(|i| Desc::new(wdst.as_ptr() as u64 + (i * bs) as u64, bs as u64, 0)).collect(),
        );
        let w = a.create_xfer_req(XferOp::Write, &l, &rl, "tcp-B", &XferOpts::default()).unwrap();
        assert_eq!(w.desc_count(), n as u64);
        a.post_xfer_req(&w, NotifUpdate::Set(b"blocks".to_vec())).unwrap();
        assert_eq!(wait(&a, &w, Duration::from_secs(20)).unwrap(), Status::Success);
        for i in 0..n {
            assert_eq!(wdst[(n - 1 - i) * bs], (i as u8) ^ 0x5a, "block {i}");
        }
        let small = a
            .create_xfer_req(XferOp::Write, &xl(&wsrc, 0, 100), &xl(&wdst, 5, 100), "tcp-B", &XferOpts::default())
            .unwrap();
        assert_eq!(
            a.post_xfer_req(&small, NotifUpdate::Keep).unwrap(),
            Status::Success,
            "small requests finish inline"
        );
        assert_eq!(&wdst[5..105], &wsrc[..100]);
        a.gen_notif("tcp-B", b"", &[]).unwrap();
        assert_eq!(notifs_until(&b, 2), vec![("tcp-A".to_string(), b"blocks".to_vec()), ("tcp-A".to_string(), vec![])]);
    }

    fn rss_mib() -> u64 {
        let s = std::fs::read_to_string("/proc/self/status").unwrap();
        let l = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
    }

    /// A notification poll that finds nothing gives its core away (nixlbench's target spins on `getNotifs` for a
    /// whole run; spinning on beside the copy threads, it held them back). Made exact with the real-time
    /// scheduler: two `SCHED_FIFO` threads of one priority on one CPU, where the second runs only once the first
    /// blocks or yields. Spinning alone for 20 ms, the first never lets the second run (the control); polling
    /// notifications, it does at the first empty poll.
    #[test]
    fn an_empty_notification_poll_yields_its_core() {
        let a = Arc::new(tcp_agent("yield-A", &[]));
        let poller = a.clone();
        let outcome = std::thread::spawn(move || -> std::result::Result<(bool, usize), String> {
            // SAFETY: plain calls on this thread's own scheduling; `set` and `param` outlive them.
            unsafe {
                let cpu = libc::sched_getcpu().max(0) as usize;
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu, &mut set);
                if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                    return Err(format!("sched_setaffinity: {}", std::io::Error::last_os_error()));
                }
                let param = libc::sched_param { sched_priority: 1 };
                if libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) != 0 {
                    return Err(format!("SCHED_FIFO: {}", std::io::Error::last_os_error()));
                }
            }
            // The other thread inherits the CPU and the policy; of equal priority, it waits until this one yields.
            use std::sync::atomic::{AtomicBool, Ordering};
            let ran = Arc::new(AtomicBool::new(false));
            let flag = ran.clone();
            let other = std::thread::spawn(move || flag.store(true, Ordering::Release));
            let t = Instant::now();
            while !ran.load(Ordering::Acquire) && t.elapsed() < Duration::from_millis(20) {
                std::hint::spin_loop();
            }
            let ran_while_spinning = ran.load(Ordering::Acquire);
            let mut polls = 0;
            while !ran.load(Ordering::Acquire) && polls < 1000 {
                assert!(poller.notifs(&[]).unwrap().is_empty());
                polls += 1;
            }
            // SAFETY: as above; back to the ordinary policy before waiting on the other thread.
            unsafe {
                let param = libc::sched_param { sched_priority: 0 };
                libc::sched_setscheduler(0, libc::SCHED_OTHER, &param);
            }
            other.join().unwrap();
            Ok((ran_while_spinning, polls))
        })
        .join()
        .unwrap();
        match outcome {
            Err(why) => crate::util::test_skip("sched", &format!("no real-time scheduling here ({why})")),
            Ok((ran_while_spinning, polls)) => {
                assert!(!ran_while_spinning, "the control: a thread of equal priority ran while the first spun");
                assert_eq!(polls, 1, "the other thread ran only after {polls} empty notification polls");
            }
        }
    }

    /// A peer floods notifications over TCP at an agent that does not poll: the target's queue stops
    /// at its bound (the control connection is not read), the sender gets BACKEND after a bound, every
    /// notification that returned Ok is delivered, in order, once the target polls, and the peer stays
    /// usable throughout (a transfer while the queue is full, notifications after).
    #[test]
    fn tcp_notification_flood_is_bounded_and_lossless() {
        let a = tcp_agent("tcp-flood-A", &[("disconnect_timeout_ms", "1000")]);
        let b = tcp_agent(
            "tcp-flood-B",
            &[("disconnect_timeout_ms", "1000"), ("notif_queue_msgs", "64"), ("notif_queue_bytes", "4194304")],
        );
        let buf = vec![7u8; 1 << 20];
        let dst = vec![0u8; 1 << 20];
        reg(&a, &buf);
        reg(&b, &dst);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let size = 128 << 10;
        let (max, rss0) = (4000usize, rss_mib());
        let mut ok = 0;
        let mut refused = None;
        while ok < max {
            let mut m = vec![0u8; size];
            m[..8].copy_from_slice(&(ok as u64).to_le_bytes());
            match a.gen_notif("tcp-flood-B", &m, &[]) {
                Ok(()) => ok += 1,
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        let grew = rss_mib().saturating_sub(rss0);
        eprintln!("flood: {ok} notifications of {size} B taken before the sender was refused; RSS +{grew} MiB");
        let e = refused.expect("the sender must be refused once the target's queue is full");
        assert_eq!(e.status(), Status::Backend, "{e}");
        assert!(e.to_string().contains("queue is full"), "{e}");
        assert!(grew < 128, "RSS grew by {grew} MiB");
        // Still usable while the queue is full: a transfer, and another refused notification (not a death).
        let w = a
            .create_xfer_req(
                XferOp::Write,
                &xl(&buf, 0, 1 << 20),
                &xl(&dst, 0, 1 << 20),
                "tcp-flood-B",
                &XferOpts::default(),
            )
            .unwrap();
        a.post_xfer_req(&w, NotifUpdate::Keep).unwrap();
        assert_eq!(wait(&a, &w, Duration::from_secs(10)).unwrap(), Status::Success);
        assert!(dst == buf);
        // A later notification goes on a new control connection (the old one was left with a partial
        // frame) or waits on the old one: it is taken into a socket (and queued after the others) or
        // refused the same way; never a disconnect.
        let x = match a.gen_notif("tcp-flood-B", &[0xff; 8], &[]) {
            Ok(()) => 1,
            Err(e) => {
                assert_eq!(e.status(), Status::Backend, "{e}");
                0
            }
        };
        // The target polls: everything that was accepted arrives, once, in order; nothing else.
        let t = Instant::now();
        let mut got = Vec::new();
        while got.len() < ok + x && t.elapsed() < Duration::from_secs(30) {
            let n = b.notifs(&[]).unwrap();
            if n.is_empty() {
                std::thread::sleep(Duration::from_millis(2));
            }
            got.extend(n);
        }
        let ids: Vec<u64> = got.iter().map(|(_, m)| u64::from_le_bytes(m[..8].try_into().unwrap())).collect();
        let want: Vec<u64> = (0..ok as u64).chain((x == 1).then_some(u64::MAX)).collect();
        assert_eq!(ids, want);
        assert!(got.iter().all(|(n, m)| n == "tcp-flood-A" && (m.len() == size || m.len() == 8)));
        a.gen_notif("tcp-flood-B", b"after", &[]).unwrap();
        assert_eq!(notifs_until(&b, 1), vec![("tcp-flood-A".to_string(), b"after".to_vec())]);
    }

    #[test]
    fn tcp_target_refuses_deregistered_memory() {
        let a = tcp_agent("tcp-dereg-A", &[]);
        let b = tcp_agent("tcp-dereg-B", &[]);
        let dst = vec![0u8; 1 << 20];
        let src = vec![3u8; 1 << 20];
        reg(&a, &dst);
        let bl = reg(&b, &src);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let r = a
            .create_xfer_req(XferOp::Read, &xl(&dst, 0, 4096), &xl(&src, 0, 4096), "tcp-dereg-B", &XferOpts::default())
            .unwrap();
        assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::Success);
        // The target drops the registration; the initiator's metadata still lists it, the target does not.
        b.deregister_mem(&bl, &[]).unwrap();
        let e = a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err();
        assert_eq!(e.status(), Status::Backend, "{e}");
        // The connection is still usable once the memory is back.
        reg(&b, &src);
        assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::Success);
    }

    #[test]
    fn tcp_peer_destroyed_is_a_prompt_disconnect() {
        let a = tcp_agent("tcp-kill-A", &[]);
        let b = tcp_agent("tcp-kill-B", &[]);
        let dst = vec![0u8; 4096];
        let src = vec![3u8; 4096];
        reg(&a, &dst);
        reg(&b, &src);
        a.load_remote_md(&b.local_md().unwrap()).unwrap();
        let r = a
            .create_xfer_req(XferOp::Read, &xl(&dst, 0, 4096), &xl(&src, 0, 4096), "tcp-kill-B", &XferOpts::default())
            .unwrap();
        assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::Success);
        drop(b);
        let t = Instant::now();
        let e = loop {
            match a.post_xfer_req(&r, NotifUpdate::Keep) {
                Err(e) => break e,
                Ok(_) => {
                    assert!(t.elapsed() < Duration::from_secs(2), "still succeeding");
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
        let n = a.gen_notif("tcp-kill-B", b"x", &[]).unwrap_err();
        assert_eq!(n.status(), Status::RemoteDisconnect);
        // Later errors say why the peer went down, not only that it did.
        let again = a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err();
        for e in [&n, &again] {
            assert!(e.message().contains("has disconnected (") || e.message().contains("over TCP:"), "{e}");
        }
    }

    /// The target's TCP endpoint and credentials, read from its metadata as an attacker with a copy would.
    fn endpoint(b: &Agent) -> (SocketAddr, u128, u128) {
        let md = AgentMd::decode(&b.local_md().unwrap()).unwrap();
        let ci = parse_conn(&md.conns[0].1).unwrap();
        let a = *ci.addrs.iter().find(|a| a.ip().is_loopback()).unwrap();
        (a, md.incarnation, ci.secret)
    }

    /// Connect and read the target's challenge.
    fn challenged(addr: SocketAddr) -> (TcpStream, [u8; 16]) {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut c = [0u8; wire::CHALLENGE_BYTES];
        s.read_exact(&mut c).unwrap();
        (s, wire::parse_challenge(&c).unwrap())
    }

    /// Send `hello` and read the answer: Some(ACK) or None (closed).
    fn answer(s: &mut TcpStream, hello: &[u8]) -> Option<u8> {
        s.write_all(hello).unwrap();
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            Ok(1) => Some(b[0]),
            _ => None,
        }
    }

    fn hello(addr: SocketAddr, kind: u8, inc: u128, secret: u128) -> (TcpStream, Option<u8>) {
        let (mut s, nonce) = challenged(addr);
        let tag = wire::hello_tag(secret, kind, inc, &nonce, "mallory");
        let got =
            answer(&mut s, &wire::encode_hello(&wire::Hello { kind, incarnation: inc, tag, name: "mallory".into() }));
        (s, got)
    }

    fn request(s: &mut TcpStream, op: XferOp, segs: &[wire::WireSeg], payload: &[u8]) -> Option<(u8, Vec<u8>)> {
        let mut b = Vec::new();
        wire::encode_req(op, segs, &mut b);
        b.extend_from_slice(payload);
        s.write_all(&b).ok()?;
        let mut r = [0u8; wire::REPLY_BYTES];
        s.read_exact(&mut r).ok()?;
        let mut data = Vec::new();
        if op == XferOp::Read && r[0] == wire::REPLY_OK {
            data.resize(segs.iter().map(|s| s.len as usize).sum(), 0);
            s.read_exact(&mut data).ok()?;
        }
        Some((r[0], data))
    }

    #[test]
    fn tcp_strangers_and_out_of_bounds_requests_are_refused() {
        let b = tcp_agent("tcp-victim", &[]);
        let secret_buf = vec![0x77u8; 8192];
        let region = secret_buf.as_ptr() as u64;
        reg(&b, &secret_buf[1024..5120]);
        let (addr, inc, secret) = endpoint(&b);
        let inside = region + 1024;

        // Wrong secret, wrong incarnation: NAK and closed; garbage: closed without an answer.
        assert_eq!(hello(addr, wire::KIND_DATA, inc, secret ^ 1).1, Some(wire::NAK));
        assert_eq!(hello(addr, wire::KIND_CTRL, inc, secret ^ (1 << 127)).1, Some(wire::NAK));
        assert_eq!(hello(addr, wire::KIND_DATA, inc + 1, secret).1, Some(wire::NAK));
        {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut r = Vec::new();
            let _ = s.read_to_end(&mut r);
            assert_eq!(r.len(), wire::CHALLENGE_BYTES, "nothing but the challenge");
        }
        // A request without a HELLO is garbage too.
        {
            let (mut s, _) = challenged(addr);
            let seg = wire::WireSeg { region: inside, region_len: 4096, addr: inside, len: 16 };
            assert_eq!(request(&mut s, XferOp::Read, &[seg], &[]), None);
        }
        // A HELLO recorded on one connection is worthless on another (fresh nonce).
        {
            let (mut s1, n1) = challenged(addr);
            let tag = wire::hello_tag(secret, wire::KIND_DATA, inc, &n1, "mallory");
            let recorded = wire::encode_hello(&wire::Hello {
                kind: wire::KIND_DATA,
                incarnation: inc,
                tag,
                name: "mallory".into(),
            });
            let (mut s2, n2) = challenged(addr);
            assert_ne!(n1, n2);
            assert_eq!(answer(&mut s2, &recorded), Some(wire::NAK), "replayed");
            assert_eq!(answer(&mut s1, &recorded), Some(wire::ACK), "the original is fine");
        }

        // With the right credentials, only registered memory is served.
        let (mut s, ack) = hello(addr, wire::KIND_DATA, inc, secret);
        assert_eq!(ack, Some(wire::ACK));
        let ok = wire::WireSeg { region: inside, region_len: 4096, addr: inside + 4000, len: 96 };
        assert_eq!(request(&mut s, XferOp::Read, &[ok], &[]), Some((wire::REPLY_OK, vec![0x77; 96])));
        let denied = |seg: wire::WireSeg| (seg, Some((wire::REPLY_DENIED, Vec::new())));
        for (seg, want) in [
            // One byte past the registration, claiming the right region.
            denied(wire::WireSeg { region: inside, region_len: 4096, addr: inside + 4000, len: 97 }),
            // Before it.
            denied(wire::WireSeg { region: inside, region_len: 4096, addr: inside - 1, len: 2 }),
            // Claiming a bigger region than was registered.
            denied(wire::WireSeg { region, region_len: 8192, addr: region, len: 16 }),
            // Wrapping around the address space.
            denied(wire::WireSeg { region: inside, region_len: 4096, addr: u64::MAX - 3, len: 16 }),
        ] {
            assert_eq!(request(&mut s, XferOp::Read, &[seg], &[]), want, "{seg:?}");
            assert_eq!(request(&mut s, XferOp::Write, &[seg], &vec![0xEE; seg.len as usize]), want, "{seg:?}");
        }
        // A mixed request is refused whole.
        let bad = wire::WireSeg { region: inside, region_len: 4096, addr: inside + 4095, len: 2 };
        let ok2 = wire::WireSeg { region: inside, region_len: 4096, addr: inside, len: 8 };
        assert_eq!(request(&mut s, XferOp::Write, &[ok2, bad], &[0xEE; 10]), Some((wire::REPLY_DENIED, vec![])));
        assert!(secret_buf.iter().all(|&x| x == 0x77), "target memory changed");
        // A request larger than the limit or with lengths that do not add up closes the connection.
        let mut h = Vec::new();
        wire::encode_req(XferOp::Read, &[ok], &mut h);
        h[8..16].copy_from_slice(&95u64.to_le_bytes());
        s.write_all(&h).unwrap();
        let mut r = [0u8; 8];
        assert!(s.read_exact(&mut r).is_err());
        // A legitimate write still works on a fresh connection.
        let (mut s, _) = hello(addr, wire::KIND_DATA, inc, secret);
        assert_eq!(request(&mut s, XferOp::Write, &[ok2], &[1; 8]), Some((wire::REPLY_OK, vec![])));
        assert_eq!(&secret_buf[1024..1032], &[1; 8]);
    }
}
