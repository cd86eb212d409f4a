//! The RDMA route's side of this engine (`RdmaSide`): one opened port and one protection domain per engine
//! incarnation (so a handle built against an earlier incarnation names keys of a domain that no longer
//! exists), the memory regions of its registrations, its connection-info section, and the target's half of
//! the queue-pair exchange.
//!
//! Exactness on a one-sided route: after `deregister` returns, the NIC refuses the region's key (deregistering
//! waits for accesses under way). A NIC may hand the same key value to a later region (the lowest free index
//! comes back; mlx5 varies only 8 bits of it), and a peer holding the old handle would then reach the new
//! region wherever the ranges overlap, as when an application registers the same buffer again. So a domain never
//! hands one key value out twice: a registration that gets a value used before moves it onto a 64-byte
//! local-only buffer kept for the engine's life (a tombstone: the value stays taken, reaching nothing), and
//! registers again.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::wire::{self, Port};
use crate::status::{Error, Result};
use crate::verbs::{self, Cq, Mr, Nic, QpAddr, QpCaps, LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE};

/// Target pairs only answer: they post nothing.
const TARGET_CAPS: QpCaps = QpCaps { send_wr: 1, recv_wr: 1, sge: 1 };
/// Registrations that may meet a used key value in a row before giving up.
const MAX_KEY_TRIES: usize = 64;

pub(crate) struct RdmaSide {
    pub(crate) nic: Arc<dyn Nic>,
    /// Completion queue of the target's pairs (they post nothing: it stays empty).
    cq: Arc<dyn Cq>,
    pub(crate) port: Port,
    /// Every key value this domain handed out.
    used: Mutex<HashSet<u32>>,
    tombstones: Mutex<Vec<(Mr, Box<[u8]>)>>,
    /// Exchange connections being served (each holds its pairs): shut down when the engine goes.
    conns: Mutex<Vec<TcpStream>>,
}

impl RdmaSide {
    /// This engine's port: the first active one of the fabric (`verbs::fabric`). None, with the reason, where
    /// there is none (no library, no device, no active port): peers are then reached over TCP. rdma-core's
    /// data path has not run on a NIC yet, so a real fabric is taken only when asked for (`asked`:
    /// `GIXL_TRANSPORT=rdma`); the fake one whenever it is configured.
    pub(crate) fn start(asked: bool) -> std::result::Result<Arc<RdmaSide>, String> {
        let fabric = verbs::fabric().map_err(|e| e.message().to_owned())?;
        if fabric.name() != "fake" && !asked {
            return Err(
                "gixl's rdma-core data path has not run on a NIC yet: used only with GIXL_TRANSPORT=rdma".into()
            );
        }
        let ports = fabric.ports().map_err(|e| e.message().to_owned())?;
        let p = ports
            .iter()
            .find(|p| p.active)
            .ok_or_else(|| format!("no active port among {} RDMA ports", ports.len()))?;
        let nic = fabric.open(&p.device, p.port).map_err(|e| e.message().to_owned())?;
        let cq = nic.create_cq(64).map_err(|e| e.message().to_owned())?;
        Ok(Arc::new(RdmaSide {
            port: Port::from(p),
            nic,
            cq,
            used: Mutex::default(),
            tombstones: Mutex::default(),
            conns: Mutex::default(),
        }))
    }

    /// The connection-info section: this engine's port.
    pub(crate) fn section(&self) -> Vec<u8> {
        wire::encode_ports(&[self.port])
    }

    /// What doctor and the log call the port.
    pub(crate) fn label(&self) -> String {
        format!("{} ({:?})", self.nic.port().device, self.port.link)
    }

    /// A memory region for `[addr, addr + len)`, readable and writable by peers, under a key value this domain
    /// never handed out before.
    pub(crate) fn register(&self, addr: u64, len: u64) -> Result<Mr> {
        for _ in 0..MAX_KEY_TRIES {
            let mr = self.nic.reg_mr(addr, len, LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE)?;
            if self.used.lock().insert(mr.rkey) {
                return Ok(mr);
            }
            // A value an old handle may still hold: off the region, onto a tombstone that keeps it taken.
            self.nic.dereg_mr(&mr)?;
            let dummy = vec![0u8; 64].into_boxed_slice();
            let t = self.nic.reg_mr(dummy.as_ptr() as u64, dummy.len() as u64, LOCAL_WRITE)?;
            self.used.lock().insert(t.rkey);
            self.tombstones.lock().push((t, dummy));
        }
        Err(Error::backend(format!("the NIC kept handing out used memory keys ({MAX_KEY_TRIES} tries)")))
    }

    /// After it returns, no peer's access through `mr` succeeds.
    pub(crate) fn deregister(&self, mr: &Mr) {
        if let Err(e) = self.nic.dereg_mr(mr) {
            crate::telemetry::log::warn(&format!("RDMA: deregistering {:#x}+{}: {e}", mr.addr, mr.len));
        }
    }

    /// Serve one exchange connection (authenticated by the TCP listener): read the initiator's pairs, make
    /// and connect ours, answer, and keep them until the connection closes.
    pub(crate) fn serve(self: &Arc<Self>, s: TcpStream, patience: Duration) {
        let me = self.clone();
        let spawned = std::thread::Builder::new().name("gixl-rdma-qp".into()).spawn(move || me.exchange(s, patience));
        if let Err(e) = spawned {
            crate::telemetry::log::warn(&format!("RDMA: cannot serve a queue-pair exchange: {e}"));
        }
    }

    fn exchange(&self, mut s: TcpStream, patience: Duration) {
        let _ = s.set_read_timeout(Some(patience));
        let _ = s.set_write_timeout(Some(patience));
        let mut head = [0u8; 5];
        if s.read_exact(&mut head).is_err() {
            return;
        }
        let Some(n) = wire::offer_len(&head) else { return };
        let mut offer = head.to_vec();
        offer.resize(n, 0);
        if s.read_exact(&mut offer[5..]).is_err() {
            return;
        }
        let Some(theirs) = wire::decode_offer(&offer) else { return };
        let ours: Result<Vec<_>> = theirs
            .iter()
            .map(|t: &QpAddr| {
                let qp = self.nic.create_qp(&self.cq, &self.cq, TARGET_CAPS)?;
                qp.connect(t)?;
                Ok(qp)
            })
            .collect();
        let Ok(qps) = ours else {
            let _ = s.write_all(&[wire::ANSWER_REFUSED]);
            return;
        };
        let addrs: Vec<QpAddr> = qps.iter().map(|q| q.addr()).collect();
        if s.write_all(&wire::encode_answer(wire::ANSWER_OK, &addrs)).is_err() {
            return;
        }
        if let Ok(c) = s.try_clone() {
            self.conns.lock().push(c);
        }
        // The pairs live as long as the connection: the initiator closes it when it drops them (or dies).
        let _ = s.set_read_timeout(None);
        let mut b = [0u8; 64];
        while matches!(s.read(&mut b), Ok(n) if n > 0) {}
        let me = s.local_addr().ok().zip(s.peer_addr().ok());
        self.conns.lock().retain(|c| c.local_addr().ok().zip(c.peer_addr().ok()) != me);
        drop(qps);
    }

    /// The engine goes: every exchange connection is shut down (their pairs with them).
    pub(crate) fn close(&self) {
        for c in self.conns.lock().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}
