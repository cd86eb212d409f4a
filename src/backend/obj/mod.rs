//! The "OBJ" backend: moves data between this agent's DRAM and objects in an S3 bucket, many requests at once.
//!
//! As in NIXL, a request pairs a local DRAM list with an OBJ list prepped against the agent's own name. An OBJ
//! registration `(addr, len, devId, key)` names an object: the key is the registration's metaInfo, or the
//! decimal devId when that is empty; nothing is sent to the server at registration. In a transfer descriptor
//! `addr` is the byte offset in the object. READ is a ranged GET; WRITE is a PUT of the whole object, so it
//! must start at offset 0. Large pieces are split: a READ into ranged GETs of [`PART`] bytes, a WRITE of at
//! least the multipart threshold into a multipart upload of [`PART`]-byte parts, all sent in parallel.
//!
//! Requests run on a pool of worker threads (started on demand, asleep when idle), each using a kept-alive
//! connection; `status` reads what the workers published. Where gixl differs from NIXL 1.5.1 on purpose:
//! - A READ that reaches past the object's end fails (`NIXL_ERR_BACKEND`, "object shorter than the
//!   descriptor") where NIXL reports success and leaves the rest of the buffer as it was.
//! - A server that is down or silent fails the request within `connect_timeout_ms` / `io_timeout_ms`
//!   (2 s each by default) instead of after the AWS SDK's ten retries (25.6 s), and the first failing request
//!   of a transfer stops its others, so the next transfer does not queue behind them.
//! - Credentials come from the parameters, the `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` /
//!   `AWS_SESSION_TOKEN` variables, or the shared credentials file (`AWS_SHARED_CREDENTIALS_FILE`, else
//!   `~/.aws/credentials`, profile `AWS_PROFILE` or `default`), in that order; without any, requests go
//!   unsigned. There is no instance-metadata, SSO or process lookup, so nothing outside the configured
//!   endpoint is ever contacted.
//! - An endpoint that is not `http[s]://host[:port]` is refused when the backend is created.
//!
//! Init parameters (NIXL's names): `bucket` (else `AWS_DEFAULT_BUCKET`), `endpoint_override` (else
//! `AWS_ENDPOINT_OVERRIDE`), `scheme` (`https` by default, unless the endpoint names one), `region` (else
//! `AWS_REGION`, `AWS_DEFAULT_REGION`, `us-east-1`), `access_key`, `secret_key`, `session_token`,
//! `use_virtual_addressing`, `req_checksum` (`supported`, the default: PUT bodies carry a CRC32C the server
//! checks; `required`: only where S3 requires one), `resp_checksum` (accepted: ranged GETs carry no checksum
//! to check), `ca_bundle`, `crtMinLimit` (the multipart threshold, parts at least 5 MiB), `throughput_target_gbps`
//! (read when `crtMinLimit` is set, as NIXL does: 4 requests in flight per Gbps, at least 64), `num_threads`
//! (requests in flight, default 64, at most 1024; wins over the throughput target). gixl's own:
//! `connect_timeout_ms`, `io_timeout_ms`.
//!
//! `https` endpoints (NIXL's default scheme) use TLS, trusting `ca_bundle` (else `AWS_CA_BUNDLE`, else the
//! system's CA store).
//!
//! Not done here: transfers to other agents, notifications, NIXL's accelerated (`accelerated`, `type`)
//! engines, client certificates.

mod http;
mod s3;
mod sigv4;

use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{param_bool, param_u64, Backend, BackendInit, BackendXfer, Caps, LocalRegion, Params, XferOp, XferPlan};
use crate::mem::{MemType, RegDList, RegDesc};
use crate::status::{Error, Result, Status};
use s3::{Active, S3};
use sigv4::Creds;

/// GETs and multipart parts are this large (the last one smaller).
pub const PART: u64 = 8 << 20;
/// WRITEs of at least this many bytes go as multipart uploads unless `crtMinLimit` says otherwise.
pub const MULTIPART_MIN: u64 = 16 << 20;
/// S3's smallest part but the last.
const MIN_PART: u64 = 5 << 20;
/// S3's largest part count of one upload.
const MAX_PARTS: u64 = 10_000;
const DEFAULT_THREADS: usize = 64;
const MAX_THREADS: usize = 1024;
/// Requests in flight per Gbps of `throughput_target_gbps`.
const PER_GBPS: u64 = 4;
const DEFAULT_TIMEOUT_MS: u64 = 2000;

/// NIXL 1.5.1's `get_plugin_params("OBJ")`: no defaults are reported.
pub fn default_params() -> Params {
    Params::new()
}

pub fn create(init: BackendInit) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(new_obj(init)?))
}

fn new_obj(init: BackendInit) -> Result<Obj> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let cfg = Config::parse(&init.params, &env)?;
    let client = Arc::new(S3::new(
        cfg.endpoint,
        cfg.tls,
        cfg.bucket,
        cfg.region,
        cfg.creds,
        cfg.virtual_host,
        cfg.connect_timeout,
        cfg.io_timeout,
        cfg.checksum,
    ));
    let workers = Arc::new(Workers::new(client.clone(), cfg.threads));
    Ok(Obj { params: init.params, client, workers, multipart_min: cfg.multipart_min, part: cfg.part })
}

pub struct Obj {
    params: Params,
    client: Arc<S3>,
    workers: Arc<Workers>,
    multipart_min: u64,
    part: u64,
}

/// An OBJ registration: the object it names.
#[derive(Debug)]
struct ObjReg {
    key: Arc<str>,
}

impl Obj {
    /// The S3 requests of a request: READs cut into ranged GETs, large WRITEs as multipart uploads.
    fn ops(&self, plan: &XferPlan) -> Result<Vec<Op>> {
        super::check_storage_plan("OBJ", "its object store", MemType::Obj, plan)?;
        let keys = plan
            .remote_keys
            .iter()
            .map(|k| {
                k.clone()
                    .and_then(|k| (k as Arc<dyn Any + Send + Sync>).downcast::<ObjReg>().ok())
                    .map(|r| r.key.clone())
            })
            .collect::<Option<Vec<Arc<str>>>>()
            .ok_or_else(|| {
                Error::invalid_param("OBJ: an OBJ region of this request was not registered with this backend")
            })?;
        let mut ops = Vec::with_capacity(plan.segs.len());
        for s in &plan.segs {
            let key = keys
                .get(s.rreg as usize)
                .ok_or_else(|| Error::invalid_param("OBJ: segment refers to an unknown region"))?;
            let key = key.clone();
            match plan.op {
                XferOp::Read => {
                    let mut done = 0;
                    while done < s.len {
                        let n = (s.len - done).min(self.part);
                        ops.push(Op::Get { key: key.clone(), off: s.remote + done, buf: s.local + done, len: n });
                        done += n;
                    }
                }
                XferOp::Write if s.remote != 0 => ops.push(Op::Refuse(format!(
                    "WRITE of {} bytes to '{}' at offset {}: an object is written whole, so a WRITE must start at \
                     offset 0",
                    s.len,
                    http::truncate(&key, 200),
                    s.remote
                ))),
                XferOp::Write if s.len >= self.multipart_min => {
                    // S3 takes at most 10,000 parts: a very large object gets larger ones.
                    let part = self.part.max(s.len.div_ceil(MAX_PARTS));
                    let parts = s.len.div_ceil(part) as u32;
                    ops.push(Op::Upload(Arc::new(Upload {
                        key,
                        buf: s.local,
                        len: s.len,
                        part,
                        parts,
                        id: OnceLock::new(),
                        etags: Mutex::new(vec![None; parts as usize]),
                        left: AtomicU32::new(parts),
                    })));
                }
                XferOp::Write => ops.push(Op::Put { key, buf: s.local, len: s.len }),
            }
        }
        Ok(ops)
    }
}

impl Backend for Obj {
    fn name(&self) -> &'static str {
        "OBJ"
    }

    fn caps(&self) -> Caps {
        Caps { local: true, remote: false, notif: false, mems: vec![MemType::Dram, MemType::Obj] }
    }

    fn params(&self) -> Params {
        self.params.clone()
    }

    fn register(&self, mem: MemType, desc: &RegDesc) -> Result<LocalRegion> {
        match mem {
            MemType::Dram => Ok(LocalRegion { public: Vec::new(), key: None }),
            MemType::Obj => {
                let key = object_key(&desc.meta, desc.desc.dev)?;
                Ok(LocalRegion { public: Vec::new(), key: Some(Arc::new(ObjReg { key: key.into() })) })
            }
            m => Err(Error::not_supported(format!("the OBJ backend does not handle {}", m.seg_name()))),
        }
    }

    fn prep_xfer(&self, plan: XferPlan) -> Result<Box<dyn BackendXfer>> {
        let ops = self.ops(&plan)?;
        Ok(Box::new(ObjXfer { workers: self.workers.clone(), ops: Arc::new(ops), run: Mutex::new(None) }))
    }

    /// For each descriptor, a HEAD of the object its metaInfo names (the decimal devId when empty): `{}` when it
    /// exists, `None` when the server says 404. Any other answer fails the whole query, as in NIXL.
    fn query_mem(&self, descs: &RegDList) -> Result<Vec<Option<Params>>> {
        let keys = descs.iter().map(|d| object_key(&d.meta, d.desc.dev)).collect::<Result<Vec<String>>>()?;
        let out: Vec<Mutex<Option<std::result::Result<bool, String>>>> =
            keys.iter().map(|_| Mutex::new(None)).collect();
        let next = AtomicUsize::new(0);
        let threads = keys.len().min(self.workers.pool.max);
        std::thread::scope(|sc| {
            for _ in 0..threads {
                sc.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(k) = keys.get(i) else { break };
                    *out[i].lock() = Some(self.client.head(k, &Active::default()));
                });
            }
        });
        let mut res = Vec::with_capacity(keys.len());
        for o in out {
            match o.into_inner() {
                Some(Ok(true)) => res.push(Some(Params::new())),
                Some(Ok(false)) => res.push(None),
                Some(Err(e)) => return Err(Error::backend(format!("OBJ: query_memory: {e}"))),
                None => return Err(Error::backend("OBJ: query_memory: a HEAD request was not made")),
            }
        }
        Ok(res)
    }

    fn estimate_xfer_cost(&self, _plan_bytes: u64) -> Result<(i64, i64)> {
        Err(Error::not_supported("the OBJ backend does not estimate transfer costs"))
    }

    fn shutdown(&self) {
        self.workers.stop();
    }
}

/// The object key of a registration or query descriptor: its metaInfo, else the decimal devId.
fn object_key(meta: &[u8], dev: u64) -> Result<String> {
    if meta.is_empty() {
        return Ok(dev.to_string());
    }
    String::from_utf8(meta.to_vec())
        .map_err(|_| Error::invalid_param(format!("OBJ: the object key of devId {dev} (its metaInfo) is not UTF-8")))
}

// ----- init parameters -----

#[derive(Debug)]
struct Config {
    endpoint: http::Endpoint,
    tls: Option<http::Tls>,
    bucket: String,
    region: String,
    creds: Option<Creds>,
    virtual_host: bool,
    checksum: bool,
    multipart_min: u64,
    part: u64,
    threads: usize,
    connect_timeout: Duration,
    io_timeout: Duration,
}

impl Config {
    fn parse(p: &Params, env: &dyn Fn(&str) -> Option<String>) -> Result<Config> {
        let get = |k: &str| p.get(k).filter(|v| !v.is_empty()).cloned();
        let bucket = get("bucket").or_else(|| env("AWS_DEFAULT_BUCKET")).ok_or_else(|| {
            Error::backend("OBJ: no bucket: set the 'bucket' parameter or the AWS_DEFAULT_BUCKET environment variable")
        })?;
        let tls = match p.get("scheme").map(String::as_str) {
            None | Some("https") => true,
            Some("http") => false,
            Some(s) => return Err(Error::backend(format!("OBJ: invalid scheme '{s}' (http or https)"))),
        };
        let region = get("region")
            .or_else(|| env("AWS_REGION"))
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .unwrap_or_else(|| "us-east-1".to_owned());
        let url = get("endpoint_override")
            .or_else(|| env("AWS_ENDPOINT_OVERRIDE"))
            .unwrap_or_else(|| format!("s3.{region}.amazonaws.com"));
        let endpoint = http::Endpoint::parse(&url, tls).map_err(|e| Error::backend(format!("OBJ: {e}")))?;
        let tls = match endpoint.tls {
            true => {
                let bundle = get("ca_bundle").or_else(|| env("AWS_CA_BUNDLE"));
                Some(http::tls_config(bundle.as_deref()).map_err(|e| Error::backend(format!("OBJ: {e}")))?)
            }
            false => None,
        };
        let creds = match (get("access_key"), get("secret_key")) {
            (Some(a), Some(s)) => Some(Creds { access_key: a, secret_key: s, session_token: get("session_token") }),
            _ => match (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
                (Some(a), Some(s)) => {
                    Some(Creds { access_key: a, secret_key: s, session_token: env("AWS_SESSION_TOKEN") })
                }
                _ => {
                    let path = env("AWS_SHARED_CREDENTIALS_FILE")
                        .or_else(|| env("HOME").map(|h| format!("{h}/.aws/credentials")));
                    let profile = env("AWS_PROFILE").unwrap_or_else(|| "default".into());
                    path.and_then(|p| std::fs::read_to_string(p).ok()).and_then(|t| profile_creds(&t, &profile))
                }
            },
        };
        let flag = |k: &str| p.get(k).map(|v| param_bool("OBJ", k, v)).transpose().map(|b| b.unwrap_or(false));
        let virtual_host = flag("use_virtual_addressing")?;
        let checksum_mode = |k: &str| match p.get(k).map(String::as_str) {
            None | Some("supported") => Ok(true),
            Some("required") => Ok(false),
            Some(v) => Err(Error::backend(format!("OBJ: invalid value for {k}: '{v}' (required or supported)"))),
        };
        let checksum = checksum_mode("req_checksum")?;
        checksum_mode("resp_checksum")?;
        let int = |k: &str| p.get(k).map(|v| param_u64("OBJ", k, v)).transpose();
        let (multipart_min, part, gbps) = match int("crtMinLimit")? {
            Some(n) => (n, n.max(MIN_PART), int("throughput_target_gbps")?),
            None => (MULTIPART_MIN, PART, None),
        };
        // One S3 connection moves roughly 1 Gbps; a throughput target asks for a few per Gbps.
        let by_target = gbps.map_or(DEFAULT_THREADS, |g| (g.saturating_mul(PER_GBPS) as usize).max(DEFAULT_THREADS));
        let threads = match int("num_threads")? {
            None | Some(0) => by_target,
            Some(n) => n as usize,
        }
        .min(MAX_THREADS);
        let ms = |k: &str| -> Result<Duration> {
            Ok(Duration::from_millis(match int(k)? {
                None | Some(0) => DEFAULT_TIMEOUT_MS,
                Some(n) => n.min(3_600_000),
            }))
        };
        Ok(Config {
            endpoint,
            tls,
            bucket,
            region,
            creds,
            virtual_host,
            checksum,
            multipart_min,
            part,
            threads,
            connect_timeout: ms("connect_timeout_ms")?,
            io_timeout: ms("io_timeout_ms")?,
        })
    }
}

/// The credentials of `[profile]` in an AWS shared credentials file (INI: `aws_access_key_id`,
/// `aws_secret_access_key`, `aws_session_token`), when it has both keys.
fn profile_creds(text: &str, profile: &str) -> Option<Creds> {
    let mut in_profile = false;
    let (mut a, mut s, mut t) = (None, None, None);
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') && line.ends_with(']') {
            in_profile = line[1..line.len() - 1].trim() == profile;
            continue;
        }
        let Some((k, v)) = line.split_once('=') else { continue };
        if !in_profile {
            continue;
        }
        let v = Some(v.trim().to_owned()).filter(|v| !v.is_empty());
        match k.trim() {
            "aws_access_key_id" => a = v,
            "aws_secret_access_key" => s = v,
            "aws_session_token" => t = v,
            _ => {}
        }
    }
    Some(Creds { access_key: a?, secret_key: s?, session_token: t })
}

// ----- requests -----

/// One S3 request of a transfer (a multipart upload is one op that becomes several requests).
enum Op {
    Get {
        key: Arc<str>,
        off: u64,
        buf: u64,
        len: u64,
    },
    Put {
        key: Arc<str>,
        buf: u64,
        len: u64,
    },
    Upload(Arc<Upload>),
    /// Known at prep to fail; fails when posted, as NIXL reports it.
    Refuse(String),
}

/// A multipart upload in progress: created by the worker that takes its op, then one task per part; the
/// worker finishing the last part completes (or, after a failure, aborts) it.
struct Upload {
    key: Arc<str>,
    buf: u64,
    len: u64,
    part: u64,
    parts: u32,
    id: OnceLock<String>,
    etags: Mutex<Vec<Option<String>>>,
    left: AtomicU32,
}

struct ObjXfer {
    workers: Arc<Workers>,
    ops: Arc<Vec<Op>>,
    run: Mutex<Option<Arc<Run>>>,
}

/// One post of a request.
struct Run {
    ops: Arc<Vec<Op>>,
    /// Tasks queued or running.
    pending: AtomicUsize,
    state: AtomicI32,
    failure: Mutex<Option<String>>,
    active: Active,
    done_at: Mutex<Option<Instant>>,
    idle: Condvar,
}

impl Run {
    fn state(&self) -> Status {
        Status::from_i32(self.state.load(Ordering::Acquire)).unwrap_or(Status::Unknown)
    }

    /// The first failure wins (true when this was it); the other requests of the post are stopped.
    fn fail(&self, msg: String) -> bool {
        let first = {
            let mut f = self.failure.lock();
            let first = f.is_none();
            if first {
                *f = Some(msg);
            }
            first
        };
        self.active.stop();
        first
    }

    /// A request failed: the transfer fails with its reason, said once in the log.
    fn request_failed(&self, msg: String) {
        let line = format!("OBJ: transfer failed: {msg}");
        if self.fail(msg) {
            crate::telemetry::log::warn(&line);
        }
    }

    fn done_one(&self) {
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            let mut at = self.done_at.lock();
            *at = Some(Instant::now());
            let st = if self.failure.lock().is_some() { Status::Backend } else { Status::Success };
            self.state.store(st as i32, Ordering::Release);
            self.idle.notify_all();
        }
    }

    /// Until no task of this run is queued or running.
    fn wait(&self) {
        let mut at = self.done_at.lock();
        while self.pending.load(Ordering::Acquire) != 0 {
            self.idle.wait(&mut at);
        }
    }
}

impl BackendXfer for ObjXfer {
    fn post(&self, notif: Option<&[u8]>) -> Result<Status> {
        if notif.is_some() {
            return Err(Error::backend("the OBJ backend cannot send notifications"));
        }
        let mut cur = self.run.lock();
        if cur.as_ref().is_some_and(|r| r.state() == Status::InProg) {
            return Err(Error::new(Status::RepostActive, "the previous post of this request is still in progress"));
        }
        let n = self.ops.len();
        let run = Arc::new(Run {
            ops: self.ops.clone(),
            pending: AtomicUsize::new(n),
            state: AtomicI32::new(if n == 0 { Status::Success } else { Status::InProg } as i32),
            failure: Mutex::new(None),
            active: Active::default(),
            done_at: Mutex::new(if n == 0 { Some(Instant::now()) } else { None }),
            idle: Condvar::new(),
        });
        *cur = Some(run.clone());
        drop(cur);
        if n == 0 {
            return Ok(Status::Success);
        }
        // Like NIXL, a started request answers IN_PROG; its outcome is read with `status`.
        self.workers.submit((0..n).map(|i| Task::Op(run.clone(), i)));
        Ok(Status::InProg)
    }

    fn status(&self) -> Result<Status> {
        let Some(run) = self.run.lock().clone() else { return Err(Error::new(Status::NotPosted, "not posted")) };
        match run.state() {
            s @ (Status::InProg | Status::Success) => Ok(s),
            _ => Err(Error::backend(format!(
                "OBJ: {}",
                run.failure.lock().clone().unwrap_or_else(|| "the transfer failed".into())
            ))),
        }
    }

    /// Stops queued requests, cuts the connections of those on the wire and waits for them, so the caller may
    /// free the buffers as soon as this returns.
    fn abort(&self) -> bool {
        let Some(run) = self.run.lock().clone() else { return true };
        if run.state() == Status::InProg {
            run.fail("the transfer was released while in progress".into());
            run.wait();
        }
        true
    }

    fn completed_at(&self) -> Option<Instant> {
        self.run.lock().as_ref().and_then(|r| *r.done_at.lock())
    }
}

impl Drop for ObjXfer {
    fn drop(&mut self) {
        self.abort();
    }
}

// ----- workers -----

enum Task {
    Op(Arc<Run>, usize),
    Part(Arc<Run>, Arc<Upload>, u32),
}

/// Threads that run S3 requests. They start when work is queued (up to `max`) and sleep when idle. The owner
/// (the backend and its requests) holds `Workers`; threads hold the `Pool` inside it.
struct Workers {
    pool: Arc<Pool>,
}

struct Pool {
    client: Arc<S3>,
    max: usize,
    q: Mutex<Queue>,
    cv: Condvar,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Default)]
struct Queue {
    tasks: VecDeque<Task>,
    idle: usize,
    stop: bool,
}

impl Workers {
    fn new(client: Arc<S3>, max: usize) -> Workers {
        let max = max.max(1);
        let pool = Pool { client, max, q: Mutex::default(), cv: Condvar::new(), threads: Mutex::new(Vec::new()) };
        Workers { pool: Arc::new(pool) }
    }

    fn submit(&self, tasks: impl Iterator<Item = Task>) {
        self.pool.submit(tasks);
    }

    /// Queued requests fail without being sent, requests on the wire finish (bounded by the timeouts), then
    /// the threads exit.
    fn stop(&self) {
        self.pool.q.lock().stop = true;
        self.pool.cv.notify_all();
        loop {
            let hs: Vec<JoinHandle<()>> = self.pool.threads.lock().drain(..).collect();
            if hs.is_empty() {
                break;
            }
            for h in hs {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Pool {
    fn submit(self: &Arc<Self>, tasks: impl Iterator<Item = Task>) {
        let mut q = self.q.lock();
        if q.stop {
            drop(q);
            for t in tasks {
                let (Task::Op(run, _) | Task::Part(run, _, _)) = t;
                run.fail("the agent is being destroyed".into());
                run.done_one();
            }
            return;
        }
        q.tasks.extend(tasks);
        let wanted = q.tasks.len().saturating_sub(q.idle);
        let idle = q.idle;
        drop(q);
        let mut threads = self.threads.lock();
        let mut started = 0;
        while started < wanted && threads.len() < self.max {
            let pool = self.clone();
            match std::thread::Builder::new().name("gixl-obj".into()).spawn(move || pool.work()) {
                Ok(h) => threads.push(h),
                Err(_) => break,
            }
            started += 1;
        }
        if threads.is_empty() {
            // No thread could be started: run the work here rather than never.
            drop(threads);
            loop {
                let Some(t) = self.q.lock().tasks.pop_front() else { break };
                self.run_task(t);
            }
            return;
        }
        if idle > 1 {
            self.cv.notify_all();
        } else if idle == 1 {
            self.cv.notify_one();
        }
    }

    fn work(self: Arc<Self>) {
        loop {
            let task = {
                let mut g = self.q.lock();
                loop {
                    if let Some(t) = g.tasks.pop_front() {
                        break t;
                    }
                    if g.stop {
                        return;
                    }
                    g.idle += 1;
                    self.cv.wait(&mut g);
                    g.idle -= 1;
                }
            };
            self.run_task(task);
        }
    }

    fn run_task(self: &Arc<Self>, t: Task) {
        let client = &*self.client;
        if self.q.lock().stop {
            // The agent is being destroyed: what is still queued fails instead of running.
            let (Task::Op(run, _) | Task::Part(run, _, _)) = &t;
            run.fail("the agent is being destroyed".into());
        }
        match t {
            Task::Op(run, i) => {
                if !run.active.stopped() {
                    if let Err(e) = run_op(&run, i, self) {
                        run.request_failed(e);
                    }
                }
                run.done_one();
            }
            Task::Part(run, up, n) => {
                if !run.active.stopped() {
                    if let Err(e) = run_part(&run, &up, n, client) {
                        run.request_failed(e);
                    }
                }
                if up.left.fetch_sub(1, Ordering::AcqRel) == 1 {
                    finish_upload(&run, &up, client);
                }
                run.done_one();
            }
        }
    }
}

fn run_op(run: &Arc<Run>, i: usize, pool: &Arc<Pool>) -> std::result::Result<(), String> {
    let client = &*pool.client;
    let Some(op) = run.ops.get(i) else { return Ok(()) };
    match op {
        Op::Get { key, off, buf, len } => {
            // SAFETY: the agent resolved this DRAM range against a registration, and registered memory stays
            // valid while a transfer using it is in flight (NIXL's contract; `abort` and `Drop` of the request
            // wait for every task of the run). No other task of the run writes this range.
            let dst = unsafe { std::slice::from_raw_parts_mut(*buf as *mut u8, *len as usize) };
            client.get(key, *off, dst, &run.active)
        }
        Op::Put { key, buf, len } => {
            // SAFETY: as for `Get`; the range is only read.
            let src = unsafe { std::slice::from_raw_parts(*buf as *const u8, *len as usize) };
            client.put(key, src, &run.active)
        }
        Op::Upload(up) => {
            let id = client.create_upload(&up.key, &run.active)?;
            let _ = up.id.set(id);
            run.pending.fetch_add(up.parts as usize, Ordering::AcqRel);
            // Parts go to the back of the queue, for as many threads as the pool allows.
            pool.submit((0..up.parts).map(|n| Task::Part(run.clone(), up.clone(), n)));
            Ok(())
        }
        Op::Refuse(msg) => Err(msg.clone()),
    }
}

fn run_part(run: &Run, up: &Upload, n: u32, client: &S3) -> std::result::Result<(), String> {
    let id = up.id.get().ok_or("the upload has no id")?;
    let off = u64::from(n) * up.part;
    let len = up.part.min(up.len - off);
    // SAFETY: as for `Op::Put`: a registered DRAM range, only read, valid until every task of the run is done.
    let src = unsafe { std::slice::from_raw_parts((up.buf + off) as *const u8, len as usize) };
    let etag = client.upload_part(&up.key, id, n + 1, src, &run.active)?;
    up.etags.lock()[n as usize] = Some(etag);
    Ok(())
}

/// After the last part: complete the upload, or abort it when the run failed.
fn finish_upload(run: &Run, up: &Upload, client: &S3) {
    let Some(id) = up.id.get() else { return };
    if run.active.stopped() {
        client.abort_upload(&up.key, id);
        return;
    }
    let etags: Option<Vec<String>> = up.etags.lock().iter().cloned().collect();
    let r = match etags {
        Some(e) => client.complete_upload(&up.key, id, &e, &run.active),
        None => Err("a part has no ETag".into()),
    };
    if let Err(e) = r {
        client.abort_upload(&up.key, id);
        run.request_failed(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Seg, Target};
    use crate::mem::Desc;

    fn params(kv: &[(&str, &str)]) -> Params {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn parse(kv: &[(&str, &str)], env: &[(&str, &str)]) -> Result<Config> {
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::parse(&params(kv), &|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn config_like_nixl() {
        let e = parse(&[], &[]).unwrap_err();
        assert_eq!(e.status(), Status::Backend);
        assert!(e.message().contains("AWS_DEFAULT_BUCKET"));
        let c = parse(&[("scheme", "http")], &[("AWS_DEFAULT_BUCKET", "b"), ("AWS_ENDPOINT_OVERRIDE", "h:9")]).unwrap();
        assert_eq!((c.bucket.as_str(), c.endpoint.authority.as_str(), c.region.as_str()), ("b", "h:9", "us-east-1"));
        assert!(c.creds.is_none() && c.checksum && c.threads == DEFAULT_THREADS);
        let c = parse(
            &[
                ("bucket", "x"),
                ("endpoint_override", "http://127.0.0.1:3900"),
                ("access_key", "a"),
                ("secret_key", "s"),
            ],
            &[("AWS_REGION", "garage"), ("AWS_ACCESS_KEY_ID", "envkey"), ("AWS_SECRET_ACCESS_KEY", "envsecret")],
        )
        .unwrap();
        assert_eq!((c.region.as_str(), c.creds.as_ref().unwrap().access_key.as_str()), ("garage", "a"));
        let c = parse(
            &[("bucket", "x"), ("endpoint_override", "http://h")],
            &[("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_SESSION_TOKEN", "t")],
        )
        .unwrap();
        assert_eq!(c.creds.unwrap().session_token.as_deref(), Some("t"));
        for bad in [
            &[("bucket", "b"), ("scheme", "ftp")][..],
            &[("bucket", "b"), ("scheme", "http"), ("req_checksum", "x")],
            &[("bucket", "b"), ("scheme", "http"), ("num_threads", "x")],
            &[("bucket", "b"), ("scheme", "http"), ("use_virtual_addressing", "maybe")],
            &[("bucket", "b"), ("scheme", "http"), ("crtMinLimit", "abc")],
            &[("bucket", "b"), ("scheme", "http"), ("crtMinLimit", "1"), ("throughput_target_gbps", "1.5")],
            &[("bucket", "b"), ("endpoint_override", "not a url")],
        ] {
            let e = parse(bad, &[]).unwrap_err();
            assert_eq!(e.status(), Status::Backend, "{bad:?}: {e}");
        }
        // Like NIXL: throughput_target_gbps is read only with crtMinLimit; num_threads 0 is the default.
        let c =
            parse(&[("bucket", "b"), ("scheme", "http"), ("throughput_target_gbps", "1.5"), ("num_threads", "0")], &[])
                .unwrap();
        assert_eq!(c.threads, DEFAULT_THREADS);
        let c = parse(&[("bucket", "b"), ("scheme", "http"), ("crtMinLimit", "1048576")], &[]).unwrap();
        assert_eq!((c.multipart_min, c.part, c.threads), (1 << 20, MIN_PART, DEFAULT_THREADS));
        let c = parse(
            &[("bucket", "b"), ("scheme", "http"), ("crtMinLimit", "8388608"), ("throughput_target_gbps", "100")],
            &[],
        )
        .unwrap();
        assert_eq!((c.part, c.threads), (8 << 20, 400));
        let c = parse(
            &[
                ("bucket", "b"),
                ("scheme", "http"),
                ("crtMinLimit", "8388608"),
                ("throughput_target_gbps", "100"),
                ("num_threads", "8"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(c.threads, 8);
        // https: TLS settings from ca_bundle (a missing or empty file is an error) or the system store.
        let e = parse(&[("bucket", "b"), ("ca_bundle", "/nonexistent/ca.pem")], &[]).unwrap_err();
        assert_eq!(e.status(), Status::Backend);
        assert!(e.message().contains("ca_bundle '/nonexistent/ca.pem'"), "{e}");
        let e = parse(&[("bucket", "b")], &[("AWS_CA_BUNDLE", "/dev/null")]).unwrap_err();
        assert!(e.message().contains("holds no certificate"), "{e}");
        match parse(&[("bucket", "b")], &[]) {
            Ok(c) => assert!(c.tls.is_some() && c.endpoint.tls && c.endpoint.authority == "s3.us-east-1.amazonaws.com"),
            Err(e) => assert!(e.message().contains("no CA certificates"), "{e}"),
        }
    }

    #[test]
    fn shared_credentials_file() {
        let text = "[default]\naws_access_key_id = AK1\naws_secret_access_key=SK1\n\n[prod]\n# a comment\n\
                    aws_access_key_id=AK2\naws_secret_access_key = SK2\naws_session_token = T2\n[half]\n\
                    aws_access_key_id=AK3\n";
        let c = profile_creds(text, "default").unwrap();
        assert_eq!((c.access_key.as_str(), c.secret_key.as_str(), c.session_token), ("AK1", "SK1", None));
        let c = profile_creds(text, "prod").unwrap();
        assert_eq!((c.access_key.as_str(), c.session_token.as_deref()), ("AK2", Some("T2")));
        assert!(profile_creds(text, "half").is_none());
        assert!(profile_creds(text, "missing").is_none());
        // Through the configuration: parameters, then the environment, then the file of AWS_PROFILE.
        let dir = std::env::temp_dir().join(format!("gixl-obj-creds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("credentials");
        std::fs::write(&file, text).unwrap();
        let f = file.to_str().unwrap();
        let c = parse(
            &[("bucket", "b"), ("scheme", "http")],
            &[("AWS_SHARED_CREDENTIALS_FILE", f), ("AWS_PROFILE", "prod")],
        )
        .unwrap();
        assert_eq!(c.creds.unwrap().access_key, "AK2");
        let c = parse(
            &[("bucket", "b"), ("scheme", "http")],
            &[("AWS_SHARED_CREDENTIALS_FILE", f), ("AWS_ACCESS_KEY_ID", "E"), ("AWS_SECRET_ACCESS_KEY", "S")],
        )
        .unwrap();
        assert_eq!(c.creds.unwrap().access_key, "E");
        let c = parse(&[("bucket", "b"), ("scheme", "http")], &[("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")]).unwrap();
        assert!(c.creds.is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// What a request becomes: READs in ranged GETs of PART bytes, WRITEs whole, large ones in at most
    /// 10,000 parts, WRITEs not at offset 0 refused when posted.
    #[test]
    fn requests_are_cut_as_s3_needs() {
        let init = BackendInit {
            agent_name: "t".into(),
            incarnation: 1,
            params: params(&[("bucket", "b"), ("endpoint_override", "http://127.0.0.1:9")]),
            num_workers: 0,
            overlap: None,
        };
        let obj = new_obj(init).unwrap();
        let key = obj.register(MemType::Obj, &RegDesc { desc: Desc::new(0, 0, 7), meta: b"k".to_vec() }).unwrap().key;
        let plan = |op, segs: &[(u64, u64)]| XferPlan {
            op,
            local_mem: MemType::Dram,
            remote_mem: MemType::Obj,
            segs: segs
                .iter()
                .map(|&(remote, len)| Seg { local: 1 << 40, remote, len, ldev: 0, rdev: 7, lreg: 0, rreg: 0 })
                .collect(),
            local_keys: vec![None],
            remote_keys: vec![key.clone()],
            target: Target::Local,
            total_bytes: segs.iter().map(|s| s.1).sum(),
        };
        let ops = obj.ops(&plan(XferOp::Read, &[(100, 2 * PART + 5), (0, 1)])).unwrap();
        let gets: Vec<(u64, u64)> = ops
            .iter()
            .map(|o| match o {
                Op::Get { off, len, .. } => (*off, *len),
                _ => panic!("a READ is GETs"),
            })
            .collect();
        assert_eq!(gets, [(100, PART), (100 + PART, PART), (100 + 2 * PART, 5), (0, 1)]);
        let ops = obj
            .ops(&plan(XferOp::Write, &[(0, MULTIPART_MIN - 1), (0, MULTIPART_MIN), (0, 200 << 30), (4096, 1)]))
            .unwrap();
        assert!(matches!(&ops[0], Op::Put { len, .. } if *len == MULTIPART_MIN - 1));
        assert!(matches!(&ops[1], Op::Upload(u) if u.part == PART && u.parts == 2));
        // 200 GiB: 8 MiB parts would be 25,600; S3 allows 10,000.
        assert!(matches!(&ops[2], Op::Upload(u) if u.parts <= 10_000 && u.part * u64::from(u.parts) >= 200 << 30));
        assert!(matches!(&ops[3], Op::Refuse(m) if m.contains("offset 4096")));
        let mut p = plan(XferOp::Read, &[(0, 1)]);
        p.local_mem = MemType::File;
        assert_eq!(obj.ops(&p).err().map(|e| e.status()), Some(Status::InvalidParam));
    }

    #[test]
    fn keys() {
        assert_eq!(object_key(b"", 42).unwrap(), "42");
        assert_eq!(object_key(b"kv/0001", 42).unwrap(), "kv/0001");
        assert_eq!(object_key(&[0xff, 0xfe], 1).unwrap_err().status(), Status::InvalidParam);
    }
}
