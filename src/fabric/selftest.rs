//! A device proves itself before it is trusted: two RDM endpoints of this process on the device, two
//! registered regions of host memory, a one-sided WRITE from the first endpoint into the second's region and a
//! READ back out of it, the bytes checked each time, all within a time limit, its duration measured.
//!
//! The test runs on a thread of its own and the caller waits for it at most the limit: a provider stuck inside
//! a call (opening a domain, an endpoint, a wait) cannot hang the caller; such a thread is left to finish on
//! its own and the result names the step it was stuck in. Completions are waited for on the queues' wait
//! descriptors ([`super::wait`]), both queues read each round (the providers here progress data only when
//! their queues are read).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::{drain, left, wait, Av, Cq, Device, Domain, Endpoint, Fabric, Mr};
use crate::status::{Error, Result};

/// The bytes moved each way.
pub const BYTES: usize = 64 << 10;

/// The steps, in order; a failure names the one it happened in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Step {
    /// Opening the library (`GIXL_LIBFABRIC`, else `libfabric.so.1`).
    Library,
    /// `fi_getinfo`: the provider offers an RDM endpoint with one-sided RMA on this device.
    Info,
    Fabric,
    Domain,
    /// The completion queues and address vectors.
    Queues,
    /// The two endpoints and each other's address.
    Endpoints,
    /// Registering the two regions.
    Register,
    /// The WRITE, its completion and the bytes at the target.
    Write,
    /// The READ, its completion and the bytes read.
    Read,
}

impl Step {
    pub fn name(self) -> &'static str {
        match self {
            Step::Library => "library",
            Step::Info => "getinfo",
            Step::Fabric => "fabric",
            Step::Domain => "domain",
            Step::Queues => "queues",
            Step::Endpoints => "endpoints",
            Step::Register => "register",
            Step::Write => "write",
            Step::Read => "read",
        }
    }
    const ALL: [Step; 9] = [
        Step::Library,
        Step::Info,
        Step::Fabric,
        Step::Domain,
        Step::Queues,
        Step::Endpoints,
        Step::Register,
        Step::Write,
        Step::Read,
    ];
}

/// What the self-test found.
#[derive(Debug)]
pub enum Outcome {
    /// The data came back right; `cost` is the whole test's wall time (opening included).
    Passed { cost: Duration },
    /// `step` failed with `error` after `after`.
    Failed { step: Step, error: Error, after: Duration },
}

/// One device's self-test.
#[derive(Debug)]
pub struct SelfTest {
    /// Provider and domain as libfabric names them (empty where the library or the device was not found).
    pub provider: String,
    pub domain: String,
    pub outcome: Outcome,
}

impl SelfTest {
    pub fn passed(&self) -> bool {
        matches!(self.outcome, Outcome::Passed { .. })
    }
}

/// A self-test's result as this process keeps it for `gixl doctor`: the device, passed or not, the step that
/// failed and why, and the milliseconds it took.
#[derive(Clone, Debug)]
pub struct Record {
    pub device: String,
    pub passed: bool,
    pub step: Option<&'static str>,
    pub error: Option<String>,
    pub ms: f64,
}

static RECORDS: parking_lot::Mutex<Vec<Record>> = parking_lot::Mutex::new(Vec::new());

/// The last self-test of each device this process ran, in the order first run.
pub fn records() -> Vec<Record> {
    RECORDS.lock().clone()
}

fn record(t: &SelfTest) {
    let (passed, step, error, d) = match &t.outcome {
        Outcome::Passed { cost } => (true, None, None, *cost),
        Outcome::Failed { step, error, after } => (false, Some(step.name()), Some(error.to_string()), *after),
    };
    let r = Record { device: format!("{}/{}", t.provider, t.domain), passed, step, error, ms: d.as_secs_f64() * 1e3 };
    let mut all = RECORDS.lock();
    match all.iter_mut().find(|o| o.device == r.device) {
        Some(o) => *o = r,
        None => all.push(r),
    }
}

impl std::fmt::Display for SelfTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.outcome {
            Outcome::Passed { cost } => write!(
                f,
                "{}/{}: passed (WRITE and READ of {} KiB checked) in {:.1} ms",
                self.provider,
                self.domain,
                BYTES >> 10,
                cost.as_secs_f64() * 1e3
            ),
            Outcome::Failed { step, error, after } => write!(
                f,
                "{}/{}: failed at {} after {:.1} ms: {error}",
                self.provider,
                self.domain,
                step.name(),
                after.as_secs_f64() * 1e3
            ),
        }
    }
}

/// The first device of `provider` (libfabric's full name: `tcp;ofi_rxm`, `shm`, `efa`…), optionally on
/// `domain`, tested (and recorded for `gixl doctor`).
pub fn run_provider(provider: &str, domain: Option<&str>, limit: Duration) -> SelfTest {
    let t = provider_test(provider, domain, limit);
    // `run` recorded it where a device was found; before that, the failure is recorded here.
    if matches!(t.outcome, Outcome::Failed { step: Step::Library | Step::Info, .. }) {
        record(&t);
    }
    t
}

fn provider_test(provider: &str, domain: Option<&str>, limit: Duration) -> SelfTest {
    let t0 = Instant::now();
    let failed = |step, error| SelfTest {
        provider: provider.to_owned(),
        domain: domain.unwrap_or_default().to_owned(),
        outcome: Outcome::Failed { step, error, after: t0.elapsed() },
    };
    if let Err(e) = super::sys::lib() {
        return failed(Step::Library, e);
    }
    match super::devices(Some(provider), domain) {
        Err(e) => failed(Step::Info, e),
        Ok(v) => match v.into_iter().next() {
            Some(d) => run(&d, limit.saturating_sub(t0.elapsed())),
            None => failed(
                Step::Info,
                Error::not_supported(format!(
                    "libfabric offers no {provider} device with an RDM endpoint and one-sided RMA (FI_RMA, FI_READ, \
                     FI_WRITE, FI_REMOTE_READ, FI_REMOTE_WRITE){}",
                    domain.map(|d| format!(" on {d}")).unwrap_or_default()
                )),
            ),
        },
    }
}

/// Tests `dev`, waiting at most `limit` (and records the result for `gixl doctor`).
pub fn run(dev: &Device, limit: Duration) -> SelfTest {
    let t = run_device(dev, limit);
    record(&t);
    t
}

fn run_device(dev: &Device, limit: Duration) -> SelfTest {
    let t0 = Instant::now();
    let step = Arc::new(AtomicU8::new(Step::Fabric as u8));
    let (tx, rx) = mpsc::channel();
    let (d, s) = (dev.clone(), step.clone());
    let deadline = t0 + limit;
    let spawned = std::thread::Builder::new().name("gixl-fabric-selftest".into()).spawn(move || {
        let r = body(&d, &s, deadline);
        let _ = tx.send(r);
    });
    let current = |s: &AtomicU8| Step::ALL.get(s.load(Ordering::Acquire) as usize).copied().unwrap_or(Step::Fabric);
    let outcome = match spawned {
        Err(e) => Outcome::Failed {
            step: Step::Fabric,
            error: Error::backend(format!("cannot start the self-test's thread: {e}")),
            after: t0.elapsed(),
        },
        Ok(_) => match rx.recv_timeout(limit) {
            Ok(Ok(())) => Outcome::Passed { cost: t0.elapsed() },
            Ok(Err(error)) => Outcome::Failed { step: current(&step), error, after: t0.elapsed() },
            Err(_) => Outcome::Failed {
                step: current(&step),
                error: Error::backend(format!(
                    "timed out after {} ms (the provider did not return; its thread is left to finish)",
                    limit.as_millis()
                )),
                after: t0.elapsed(),
            },
        },
    };
    SelfTest { provider: dev.provider(), domain: dev.domain(), outcome }
}

/// A test pattern that no earlier run left behind (a seed from the clock, a different one per step).
fn pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for b in buf {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

fn body(dev: &Device, step: &AtomicU8, deadline: Instant) -> Result<()> {
    let at = |s: Step| step.store(s as u8, Ordering::Release);
    at(Step::Fabric);
    let fabric = Fabric::open(dev)?;
    at(Step::Domain);
    let domain = Domain::open(&fabric, dev)?;
    at(Step::Queues);
    let (cq0, cq1) = (Cq::open(&domain, 64)?, Cq::open(&domain, 64)?);
    let (av0, av1) = (Av::open(&domain, 4)?, Av::open(&domain, 4)?);
    at(Step::Endpoints);
    let ep0 = Arc::new(Endpoint::open(&domain, dev, &cq0, &av0)?);
    let ep1 = Arc::new(Endpoint::open(&domain, dev, &cq1, &av1)?);
    let peer = av0.insert(&ep1.name()?)?;
    av1.insert(&ep0.name()?)?;
    at(Step::Register);
    // The initiator's region (ep0) and the target's (ep1): each 2 × BYTES, the WRITE in the first half, the
    // READ in the second.
    let mut local = vec![0u8; 2 * BYTES];
    let mut target = vec![0u8; 2 * BYTES];
    // SAFETY: both buffers outlive their regions (the regions are dropped at the end of this function, before
    // the buffers, which are declared earlier).
    let mr0 = unsafe { Mr::register(&domain, local.as_mut_ptr(), local.len(), &ep0)? };
    // SAFETY: as above.
    let mr1 = unsafe { Mr::register(&domain, target.as_mut_ptr(), target.len(), &ep1)? };
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);

    at(Step::Write);
    pattern(&mut local[..BYTES], seed);
    let remote = mr1.remote(target.as_ptr()).ok_or_else(|| Error::backend("the target region's key"))?;
    // SAFETY: the first half of `local` is in mr0 and stays untouched until the completion is read (below);
    // `remote` is mr1's, registered for remote write.
    transfer(&fabric, &ep0, &cq1, deadline, |ctx| unsafe {
        ep0.post(true, &mr0, (local.as_mut_ptr(), BYTES), peer, remote, ctx)
    })?;
    if target[..BYTES] != local[..BYTES] {
        return Err(Error::backend("the WRITE completed but the target's bytes differ from those written"));
    }

    at(Step::Read);
    pattern(&mut target[BYTES..], seed.rotate_left(17) ^ 0x5eed);
    // SAFETY: pointer arithmetic inside `target` (BYTES < its length).
    let remote = mr1.remote(unsafe { target.as_ptr().add(BYTES) }).ok_or_else(|| Error::backend("the key"))?;
    // SAFETY: the second half of `local` is in mr0, not read or written here until the completion.
    let dst = unsafe { local.as_mut_ptr().add(BYTES) };
    // SAFETY: as above; `remote` is mr1's, registered for remote read.
    transfer(&fabric, &ep0, &cq1, deadline, |ctx| unsafe { ep0.post(false, &mr0, (dst, BYTES), peer, remote, ctx) })?;
    if local[BYTES..] != target[BYTES..] {
        return Err(Error::backend("the READ completed but the bytes read differ from the target's"));
    }
    drop((mr0, mr1));
    Ok(())
}

/// Posts one operation (again while the provider's queue is full) and waits for its completion on `ep`'s
/// queue, reading `other` too (the target's side progresses only when its queue is read), until `deadline`.
fn transfer(
    fabric: &Fabric,
    ep: &Endpoint,
    other: &Cq,
    deadline: Instant,
    mut post: impl FnMut(*mut c_void) -> Result<bool>,
) -> Result<()> {
    let mut token = 0u8;
    let ctx: *mut c_void = (&mut token as *mut u8).cast();
    let cqs = [&**ep.cq(), other];
    let mut posted = false;
    let mut done = false;
    loop {
        if !posted {
            posted = post(ctx)?;
        }
        drain(&cqs, |c| done |= c == ctx)?;
        if done {
            return Ok(());
        }
        let t = left(deadline);
        if t.is_zero() {
            return Err(Error::backend(format!(
                "no completion before the time limit ({})",
                if posted { "posted" } else { "the provider's queue stayed full" }
            )));
        }
        wait(fabric, &cqs, t)?;
    }
}
