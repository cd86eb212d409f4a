//! An RDMA port proves itself before the RDMA route trusts it: on the port, two reliable-connected queue pairs
//! of this process connected to each other, two registered regions of host memory, a one-sided WRITE from
//! the first pair into the second's region and a READ back out of it, the bytes checked each time, within a
//! time limit, its duration measured. The same test runs over rdma-core on a NIC and over the fake fabric in
//! CI (where `GIXL_FAKE_VERBS_NO_RMA` makes a device fail it).
//!
//! Each port is tested once per process ([`cached`]), lazily: the route asks when it first advertises the
//! port to peers or opens a path over it, never when an agent is created. A port that failed says so in one
//! WARN line (the device, the step, the error, and that its peers go over TCP) and is not used; `gixl doctor`
//! lists every result ([`records`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{Completion, Cq, Fabric, Nic, Op, PortInfo, QpCaps, Sge, WcStatus, Wr};
use super::{LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE};
use crate::status::{Error, Result};

/// The bytes moved each way.
pub const BYTES: usize = 64 << 10;
/// The longest a port's test may take.
pub const LIMIT: Duration = Duration::from_secs(2);

/// A port's self-test result, as this process keeps it for the route and for `gixl doctor`.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// `device:port`.
    pub device: String,
    /// "ibverbs" or "fake".
    pub fabric: &'static str,
    pub passed: bool,
    /// Where it failed: `open`, `queues`, `connect`, `register`, `write`, `read`.
    pub step: Option<&'static str>,
    pub error: Option<String>,
    pub ms: f64,
}

impl std::fmt::Display for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.step, &self.error) {
            (Some(step), Some(e)) => {
                write!(f, "{} ({}): failed at {step} after {:.1} ms: {e}", self.device, self.fabric, self.ms)
            }
            _ => write!(
                f,
                "{} ({}): passed (WRITE and READ of {} KiB checked) in {:.1} ms",
                self.device,
                self.fabric,
                BYTES >> 10,
                self.ms
            ),
        }
    }
}

/// A tested port: its fabric, `device:port` and GID (a fake device gets a new GID per process).
type Key = (&'static str, String, [u8; 16]);

/// Tested ports and their results, in the order first tested.
static TESTED: Mutex<Vec<(Key, Arc<Record>)>> = Mutex::new(Vec::new());
/// One test at a time per port (by GID); others asking wait for its result.
type Running = HashMap<[u8; 16], Arc<Mutex<()>>>;
static RUNNING: Mutex<Option<Running>> = Mutex::new(None);

/// Every self-test this process ran, in the order run.
pub fn records() -> Vec<Record> {
    TESTED.lock().iter().map(|(_, r)| (**r).clone()).collect()
}

/// `port`'s self-test on `fabric`: run once per process (the first caller runs it, later ones get its result),
/// logged once (INFO when it passed, WARN when it failed).
pub fn cached(fabric: &dyn Fabric, port: &PortInfo) -> Arc<Record> {
    let key = (fabric.name(), format!("{}:{}", port.device, port.port), port.gid);
    let find =
        |k: &(&'static str, String, [u8; 16])| TESTED.lock().iter().find(|(t, _)| t == k).map(|(_, r)| r.clone());
    if let Some(r) = find(&key) {
        return r;
    }
    let one = RUNNING.lock().get_or_insert_with(HashMap::new).entry(port.gid).or_default().clone();
    let _running = one.lock();
    if let Some(r) = find(&key) {
        return r;
    }
    let r = Arc::new(run(fabric, port, LIMIT));
    if r.passed {
        crate::telemetry::log::info(&format!("RDMA port self-test: {r}"));
    } else {
        crate::telemetry::log::warn(&format!(
            "RDMA port self-test: {r}: gixl does not use this port; peers it would reach go over TCP"
        ));
    }
    TESTED.lock().push((key, r.clone()));
    r
}

/// Tests `port` now, within `limit` (not recorded: see [`cached`]).
pub fn run(fabric: &dyn Fabric, port: &PortInfo, limit: Duration) -> Record {
    let t0 = Instant::now();
    let mut step = "open";
    let out = body(fabric, port, t0 + limit, &mut step);
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let device = format!("{}:{}", port.device, port.port);
    match out {
        Ok(()) => Record { device, fabric: fabric.name(), passed: true, step: None, error: None, ms },
        Err(e) => Record {
            device,
            fabric: fabric.name(),
            passed: false,
            step: Some(step),
            error: Some(e.message().to_owned()),
            ms,
        },
    }
}

/// Host memory registered on the test's port, deregistered when dropped.
struct Region<'a> {
    nic: &'a dyn Nic,
    mr: super::Mr,
    buf: Box<[u8]>,
}

impl<'a> Region<'a> {
    fn new(nic: &'a dyn Nic) -> Result<Region<'a>> {
        let buf = vec![0u8; BYTES].into_boxed_slice();
        let mr = nic.reg_mr(buf.as_ptr() as u64, BYTES as u64, LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE)?;
        Ok(Region { nic, mr, buf })
    }
    fn sge(&self) -> Sge {
        Sge { addr: self.mr.addr, len: BYTES as u32, lkey: self.mr.lkey }
    }
}

impl Drop for Region<'_> {
    fn drop(&mut self) {
        let _ = self.nic.dereg_mr(&self.mr);
    }
}

/// A pattern no other test writes: a seed from the clock, then each byte from the one before.
fn fill(buf: &mut [u8], seed: u8) {
    let mut x = seed | 1;
    for b in buf {
        x = x.wrapping_mul(29).wrapping_add(7);
        *b = x;
    }
}

fn body(fabric: &dyn Fabric, port: &PortInfo, deadline: Instant, step: &mut &'static str) -> Result<()> {
    let nic = fabric.open(&port.device, port.port)?;
    *step = "queues";
    let caps = QpCaps { send_wr: 4, recv_wr: 1, sge: 1 };
    let cq = nic.create_cq(16)?;
    let peer_cq = nic.create_cq(16)?;
    let qp = nic.create_qp(&cq, &cq, caps)?;
    let peer = nic.create_qp(&peer_cq, &peer_cq, caps)?;
    *step = "connect";
    qp.connect(&peer.addr())?;
    peer.connect(&qp.addr())?;
    *step = "register";
    let mut src = Region::new(&*nic)?;
    let mut dst = Region::new(&*nic)?;
    let seed = Instant::now().elapsed().subsec_nanos() as u8 ^ (std::process::id() as u8);
    fill(&mut src.buf, seed);

    *step = "write";
    let write =
        Wr { id: 1, op: Op::Write { raddr: dst.mr.addr, rkey: dst.mr.rkey }, sges: &[src.sge()], signaled: true };
    qp.post_send(&[write])?;
    complete(&*cq, 1, deadline)?;
    if dst.buf != src.buf {
        return Err(Error::backend("the WRITE completed but the bytes at the target differ"));
    }

    *step = "read";
    fill(&mut dst.buf, seed.wrapping_add(101));
    src.buf.fill(0);
    let read = Wr { id: 2, op: Op::Read { raddr: dst.mr.addr, rkey: dst.mr.rkey }, sges: &[src.sge()], signaled: true };
    qp.post_send(&[read])?;
    complete(&*cq, 2, deadline)?;
    if dst.buf != src.buf {
        return Err(Error::backend("the READ completed but the bytes read differ"));
    }
    qp.set_error();
    peer.set_error();
    Ok(())
}

/// Waits for the completion of request `id` on `cq` (sleeping on its event descriptor), until `deadline`.
fn complete(cq: &dyn Cq, id: u64, deadline: Instant) -> Result<()> {
    let mut got: Vec<Completion> = Vec::with_capacity(4);
    loop {
        cq.arm()?;
        got.clear();
        cq.poll(&mut got, 4)?;
        if let Some(c) = got.iter().find(|c| c.id == id || c.status != WcStatus::Success) {
            return match c.status {
                WcStatus::Success => Ok(()),
                s => Err(Error::backend(format!("the request completed with {s:?}"))),
            };
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::backend(format!("no completion within {} ms", LIMIT.as_millis())));
        }
        let mut p = libc::pollfd { fd: cq.event_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut p, 1, left.as_millis().clamp(1, 100) as i32) };
        cq.take_event()?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::fake::FakeFabric;

    #[test]
    fn a_fake_port_passes_and_a_port_without_rma_fails_at_write() {
        let fabric = FakeFabric::new(2, tempfile_dir(), false).without_rma(vec![1]);
        let ports = fabric.ports().unwrap();
        let ok = run(&fabric, &ports[0], LIMIT);
        assert!(ok.passed, "{ok}");
        assert!(ok.to_string().contains("passed (WRITE and READ of 64 KiB checked)"), "{ok}");
        let bad = run(&fabric, &ports[1], LIMIT);
        assert!(!bad.passed, "{bad}");
        assert_eq!(bad.step, Some("write"), "{bad}");
        assert!(bad.error.as_deref().unwrap_or_default().contains("RemoteOp"), "{bad}");
        assert!(bad.ms < LIMIT.as_secs_f64() * 1e3, "{bad}");
    }

    #[test]
    fn cached_runs_once_per_port() {
        let fabric = FakeFabric::new(1, tempfile_dir(), false);
        let port = &fabric.ports().unwrap()[0];
        let a = cached(&fabric, port);
        let b = cached(&fabric, port);
        assert!(Arc::ptr_eq(&a, &b));
        assert!(a.passed, "{a}");
        assert_eq!(records().iter().filter(|r| r.device == a.device && r.ms == a.ms).count(), 1);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        // Short: the fake's socket paths live under it (a Unix socket path has at most 107 bytes).
        let d =
            std::env::temp_dir().join(format!("gxst-{}-{:x}", std::process::id(), crate::util::random_u128() as u32));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
