//! A device proves itself before it is trusted: one RDM endpoint of this process on the device, addressing
//! itself, two registered regions of host memory, a one-sided WRITE from the first region into the second and
//! a READ back out of it, the bytes checked each time, all within a time limit, its duration measured.
//!
//! The endpoint is either opened for the test alone ([`run`], [`run_provider`]: what `gixl doctor` and the
//! tests use) or one already open ([`run_on`]: the libfabric route tests the device on its own endpoint, so the
//! test adds no endpoint of its own; see [`Rig`]). One endpoint addressing itself, not two: with tcp through
//! `ofi_rxm`, opening an endpoint costs about 40 ms here (four pools of 1024 bounce buffers of 16 KiB, each
//! page touched), more than the rest of the test together.
//!
//! The test runs on a thread of its own and the caller waits for it at most the limit: a provider stuck inside
//! a call (opening a domain, an endpoint, a wait) cannot hang the caller; such a thread is left to finish on
//! its own and the result names the step it was stuck in. The result is handed over as soon as the bytes are
//! checked; closing what the test opened happens after, on its thread. Completions are waited for on the
//! queue's wait descriptor ([`super::wait`]), the queue read each round (the providers here progress data only
//! when their queues are read).

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
    /// The endpoint and its own address in its address vector.
    Endpoints,
    /// Registering the two regions.
    Register,
    /// The WRITE, its completion and the bytes at the target.
    Write,
    /// The READ, its completion and the bytes read.
    Read,
    /// GPU memory (see [`run_vram_on`]): allocating two buffers of the device layer and registering them with
    /// their interface (`FI_HMEM`).
    VramRegister,
    /// The WRITE between them, and the bytes at the target (copied back by the device layer).
    VramWrite,
    /// The READ, and the bytes read.
    VramRead,
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
            Step::VramRegister => "vram-register",
            Step::VramWrite => "vram-write",
            Step::VramRead => "vram-read",
        }
    }
    const ALL: [Step; 12] = [
        Step::Library,
        Step::Info,
        Step::Fabric,
        Step::Domain,
        Step::Queues,
        Step::Endpoints,
        Step::Register,
        Step::Write,
        Step::Read,
        Step::VramRegister,
        Step::VramWrite,
        Step::VramRead,
    ];
}

/// What the self-test found.
#[derive(Debug)]
pub enum Outcome {
    /// The data came back right; `cost` is the test's wall time until then (opening included, closing not).
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
    let d = dev.clone();
    let outcome = on_thread(limit, Step::Fabric, move |step, deadline| {
        let rig = Own::open(&d, step).map_err(|e| (e, None))?;
        let mut keep = Keep::new();
        // The regions are closed before the endpoint; where the test failed, both are left (see `run_on`).
        match exercise(&rig, &mut keep, step, deadline) {
            Ok(()) => Ok(Box::new((keep, rig)) as Box<dyn Send>),
            Err(e) => Err((e, Some(Box::new((keep, rig)) as Box<dyn Send>))),
        }
    });
    SelfTest { provider: dev.provider(), domain: dev.domain(), outcome }
}

/// Tests the device of an endpoint already open (`rig`; `provider` and `domain` name it), waiting at most
/// `limit` (and records the result for `gixl doctor`). Nothing is opened but the test's two regions; where
/// the test fails or runs out of time, they are left registered and allocated (an operation of the test may
/// still be in the provider's hands, and the endpoint lives on).
pub fn run_on(rig: Arc<dyn Rig>, provider: &str, domain: &str, limit: Duration) -> SelfTest {
    // For the tests of what a failed device does (there is no way to break one device of the tcp provider
    // alone): the domains `GIXL_TEST_FABRIC_FAIL` lists (comma-separated) fail their WRITE, untried.
    if std::env::var("GIXL_TEST_FABRIC_FAIL").is_ok_and(|v| v.split(',').any(|d| d.trim() == domain)) {
        let error = Error::backend(format!("{domain} failed on purpose (GIXL_TEST_FABRIC_FAIL)"));
        let outcome = Outcome::Failed { step: Step::Write, error, after: Duration::ZERO };
        let t = SelfTest { provider: provider.to_owned(), domain: domain.to_owned(), outcome };
        record(&t);
        return t;
    }
    let outcome = on_thread(limit, Step::Endpoints, move |step, deadline| {
        let mut keep = Keep::new();
        match exercise(&*rig, &mut keep, step, deadline) {
            Ok(()) => Ok(Box::new(keep) as Box<dyn Send>),
            Err(e) => Err((e, Some(Box::new(keep) as Box<dyn Send>))),
        }
    });
    let t = SelfTest { provider: provider.to_owned(), domain: domain.to_owned(), outcome };
    record(&t);
    t
}

/// What [`run_vram_on`] records its result under: the device's name with this after its domain.
/// The GPU-memory part of a device's self-test, on an endpoint already open (`rig`, as [`run_on`]): two
/// buffers of GPU `dev` from the device layer (`device`), registered as `vram` says (`FI_HMEM`: by interface,
/// or as dma-buf), a WRITE from the first into the second and a READ back, the bytes put there and checked
/// through the device layer's copies, within `limit`. Recorded for `gixl doctor` under the device's name
/// followed by the way's name in parentheses (`shm/shm (GPU memory)`, `… (GPU memory, dma-buf)`). Where it
/// fails, its regions and buffers are left as [`run_on`] leaves its own.
pub fn run_vram_on(
    rig: Arc<dyn Rig>,
    provider: &str,
    domain: &str,
    device: &'static dyn crate::device::Device,
    dev: u32,
    vram: super::Vram,
    limit: Duration,
) -> SelfTest {
    let outcome = on_thread(limit, Step::VramRegister, move |step, deadline| {
        let mut keep = KeepVram { mrs: Vec::new(), bufs: Vec::new() };
        match exercise_vram(&*rig, &mut keep, device, dev, vram, step, deadline) {
            Ok(()) => Ok(Box::new(keep) as Box<dyn Send>),
            Err(e) => Err((e, Some(Box::new(keep) as Box<dyn Send>))),
        }
    });
    let t = SelfTest { provider: provider.to_owned(), domain: format!("{domain} ({})", vram.name()), outcome };
    record(&t);
    t
}

/// What the GPU-memory test keeps: its regions (closed first) and its two device buffers.
struct KeepVram {
    mrs: Vec<Mr>,
    bufs: Vec<Box<dyn crate::device::DevBuf>>,
}

/// The WRITE and the READ on `rig` between two buffers of GPU `dev`, registered as `vram` says.
fn exercise_vram(
    rig: &dyn Rig,
    keep: &mut KeepVram,
    device: &'static dyn crate::device::Device,
    dev: u32,
    vram: super::Vram,
    step: &AtomicU8,
    deadline: Instant,
) -> Result<()> {
    use crate::device::Copy;
    let at = |s: Step| step.store(s as u8, Ordering::Release);
    at(Step::VramRegister);
    let me = rig.me()?;
    let (domain, ep) = (rig.domain(), rig.endpoint());
    for _ in 0..2 {
        keep.bufs.push(device.dev_buf(dev, 2 * BYTES)?);
    }
    let (a, b) = (keep.bufs[0].ptr(), keep.bufs[1].ptr());
    for p in [a, b] {
        // SAFETY: a device buffer of 2 × BYTES kept (in `keep`) after its region is closed, or leaked with it.
        keep.mrs.push(unsafe { Mr::register_vram(domain, p as *mut u8, 2 * BYTES, ep, vram, device)? });
    }
    let (mr0, mr1) = (&keep.mrs[0], &keep.mrs[1]);
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64);
    let mut host = vec![0u8; BYTES];
    let mut back = vec![0u8; BYTES];
    let put = |dst: u64, src: &[u8]| device.copy(dev, &[Copy { dst, src: src.as_ptr() as u64, len: BYTES as u64 }]);
    let get =
        |dst: &mut [u8], src: u64| device.copy(dev, &[Copy { dst: dst.as_mut_ptr() as u64, src, len: BYTES as u64 }]);

    at(Step::VramWrite);
    pattern(&mut host, seed ^ 0x6770);
    put(a, &host)?;
    let remote = mr1.remote(b as *const u8).ok_or_else(|| Error::backend("the target region's key"))?;
    // SAFETY: the first half of buffer a is in mr0, untouched until the completion; `remote` is mr1's.
    rig.complete(deadline, &mut |ctx| unsafe { ep.post(true, mr0, (a as *mut u8, BYTES), me, remote, ctx) })?;
    get(&mut back, b)?;
    if back != host {
        return Err(Error::backend("the WRITE completed but the target's GPU bytes differ from those written"));
    }

    at(Step::VramRead);
    pattern(&mut host, seed.rotate_left(29) ^ 0x7ead);
    put(b + BYTES as u64, &host)?;
    let remote = mr1.remote((b + BYTES as u64) as *const u8).ok_or_else(|| Error::backend("the key"))?;
    let dst = (a + BYTES as u64) as *mut u8;
    // SAFETY: the second half of buffer a is in mr0, untouched until the completion; `remote` is mr1's.
    rig.complete(deadline, &mut |ctx| unsafe { ep.post(false, mr0, (dst, BYTES), me, remote, ctx) })?;
    get(&mut back, a + BYTES as u64)?;
    if back != host {
        return Err(Error::backend("the READ completed but the GPU bytes read differ from the target's"));
    }
    Ok(())
}

/// What the test keeps until its result is handed over: its regions (closed first) and their memory.
struct Keep {
    mrs: Vec<Mr>,
    local: Box<[u8]>,
    target: Box<[u8]>,
}

impl Keep {
    /// Each 2 × BYTES: the WRITE in the first half, the READ in the second.
    fn new() -> Keep {
        Keep { mrs: Vec::new(), local: vec![0u8; 2 * BYTES].into(), target: vec![0u8; 2 * BYTES].into() }
    }
}

/// Runs `test` on a thread of its own and waits for it at most `limit`, naming the step it failed or was stuck
/// in. `test` hands back what it opened, dropped on its thread after the outcome is sent (a failure's: leaked
/// where `Some`, see [`run_on`]).
#[allow(clippy::type_complexity)]
fn on_thread(
    limit: Duration,
    first: Step,
    test: impl FnOnce(&AtomicU8, Instant) -> std::result::Result<Box<dyn Send>, (Error, Option<Box<dyn Send>>)>
        + Send
        + 'static,
) -> Outcome {
    let t0 = Instant::now();
    let step = Arc::new(AtomicU8::new(first as u8));
    let (tx, rx) = mpsc::channel();
    let s = step.clone();
    let deadline = t0 + limit;
    let spawned =
        std::thread::Builder::new().name("gixl-fabric-selftest".into()).spawn(move || match test(&s, deadline) {
            Ok(opened) => {
                let _ = tx.send(Ok(()));
                drop(opened);
            }
            Err((e, leak)) => {
                let _ = tx.send(Err(e));
                std::mem::forget(leak);
            }
        });
    let current = |s: &AtomicU8| Step::ALL.get(s.load(Ordering::Acquire) as usize).copied().unwrap_or(first);
    match spawned {
        Err(e) => Outcome::Failed {
            step: first,
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
    }
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

/// What a self-test runs on: an open domain and RDM endpoint of the device, the endpoint's own address in its
/// address vector, and a way to run one operation to completion.
pub trait Rig: Send + Sync {
    fn domain(&self) -> &Domain;
    fn endpoint(&self) -> &Arc<Endpoint>;
    /// The endpoint's own address-vector entry (inserted the first time).
    fn me(&self) -> Result<u64>;
    /// Posts one operation with `post` (its context given; `Ok(false)`: the provider's queue is full, post
    /// again) and waits for its completion, until `deadline`.
    fn complete(&self, deadline: Instant, post: &mut dyn FnMut(*mut c_void) -> Result<bool>) -> Result<()>;
}

/// A rig of the test's own: the device's fabric, domain, queue, address vector and endpoint.
struct Own {
    fabric: Fabric,
    domain: Domain,
    ep: Arc<Endpoint>,
    me: u64,
}

impl Own {
    fn open(dev: &Device, step: &AtomicU8) -> Result<Own> {
        let at = |s: Step| step.store(s as u8, Ordering::Release);
        at(Step::Fabric);
        let fabric = Fabric::open(dev)?;
        at(Step::Domain);
        let domain = Domain::open(&fabric, dev)?;
        at(Step::Queues);
        let (cq, av) = (Cq::open(&domain, 64)?, Av::open(&domain, 4)?);
        at(Step::Endpoints);
        let ep = Arc::new(Endpoint::open(&domain, dev, &cq, &av)?);
        let me = av.insert(&ep.name()?)?;
        Ok(Own { fabric, domain, ep, me })
    }
}

impl Rig for Own {
    fn domain(&self) -> &Domain {
        &self.domain
    }
    fn endpoint(&self) -> &Arc<Endpoint> {
        &self.ep
    }
    fn me(&self) -> Result<u64> {
        Ok(self.me)
    }
    fn complete(&self, deadline: Instant, post: &mut dyn FnMut(*mut c_void) -> Result<bool>) -> Result<()> {
        transfer(&self.fabric, &self.ep, deadline, post)
    }
}

/// The WRITE and the READ on `rig`, between two regions registered here (kept in `keep`).
fn exercise(rig: &dyn Rig, keep: &mut Keep, step: &AtomicU8, deadline: Instant) -> Result<()> {
    let at = |s: Step| step.store(s as u8, Ordering::Release);
    at(Step::Endpoints);
    let me = rig.me()?;
    at(Step::Register);
    let (domain, ep) = (rig.domain(), rig.endpoint());
    // The initiator's region and the target's.
    // SAFETY: both buffers outlive their regions (`Keep` drops its regions first, and is leaked where the test
    // failed: see `run_on`).
    keep.mrs.push(unsafe { Mr::register(domain, keep.local.as_mut_ptr(), keep.local.len(), ep)? });
    // SAFETY: as above.
    keep.mrs.push(unsafe { Mr::register(domain, keep.target.as_mut_ptr(), keep.target.len(), ep)? });
    let Keep { mrs, local, target } = keep;
    let (mr0, mr1) = (&mrs[0], &mrs[1]);
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);

    at(Step::Write);
    pattern(&mut local[..BYTES], seed);
    let remote = mr1.remote(target.as_ptr()).ok_or_else(|| Error::backend("the target region's key"))?;
    let src = local.as_mut_ptr();
    // SAFETY: the first half of `local` is in mr0 and stays untouched until the completion is read (below);
    // `remote` is mr1's, registered for remote write.
    rig.complete(deadline, &mut |ctx| unsafe { ep.post(true, mr0, (src, BYTES), me, remote, ctx) })?;
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
    rig.complete(deadline, &mut |ctx| unsafe { ep.post(false, mr0, (dst, BYTES), me, remote, ctx) })?;
    if local[BYTES..] != target[BYTES..] {
        return Err(Error::backend("the READ completed but the bytes read differ from the target's"));
    }
    Ok(())
}

/// Posts one operation (again while the provider's queue is full) and waits for its completion on `ep`'s
/// queue (its reads also progress the target's side: the same endpoint), until `deadline`.
fn transfer(
    fabric: &Fabric,
    ep: &Endpoint,
    deadline: Instant,
    post: &mut dyn FnMut(*mut c_void) -> Result<bool>,
) -> Result<()> {
    let mut token = 0u8;
    let ctx: *mut c_void = (&mut token as *mut u8).cast();
    let cqs = [&**ep.cq()];
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
