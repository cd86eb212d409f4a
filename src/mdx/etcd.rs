//! Metadata exchange through etcd (`NIXL_ETCD_ENDPOINTS`), over etcd's JSON gateway on plain HTTP.
//!
//! Keys follow NIXL: `namespace + "/" + agent + "/" + label`, the namespace from `NIXL_ETCD_NAMESPACE`
//! (default `/nixl/agents/`, hence `/nixl/agents//<agent>/metadata`). On start the agent announces itself
//! with the empty key `namespace/agent/`. Sends are puts, `invalidate_local_md` deletes every key under
//! the agent's prefix, and a fetch reads the key, waiting up to five seconds for it to appear if it is not
//! there yet, loads the metadata, then watches the peer's prefix: when its keys are deleted, the peer is
//! invalidated (only if the incarnation loaded is still the one that was fetched).
//!
//! One worker thread per agent runs the requests in order (the caller only queues them); each watch is a
//! streamed HTTP response read by its own thread, blocked in `read` while nothing happens.
//! Not supported: TLS endpoints, authentication.

use std::collections::{HashMap, VecDeque};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::http::{self, Endpoint, Lines};
use super::json::{self, b64_encode, Json};
use super::{log, Host};
use crate::status::{Error, Result};

/// How long a fetch waits for a key that is not there yet (NIXL's `etcdWatchTimeout`).
const FETCH_WAIT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a closing agent keeps working through requests it already accepted.
const DRAIN: Duration = Duration::from_secs(2);
const MAX_WATCHES: usize = 1024;

pub const DEFAULT_NAMESPACE: &str = "/nixl/agents/";
pub const DEFAULT_LABEL: &str = "metadata";

/// `namespace/agent/label`, NIXL's layout.
pub fn key(ns: &str, agent: &str, label: &str) -> String {
    format!("{ns}/{agent}/{label}")
}

/// `namespace/agent/`: every key of one agent starts with it.
pub fn prefix(ns: &str, agent: &str) -> String {
    format!("{ns}/{agent}/")
}

/// The smallest key greater than every key that starts with `p` (etcd's `range_end` for a prefix).
pub fn prefix_end(p: &[u8]) -> Vec<u8> {
    let mut e = p.to_vec();
    while let Some(last) = e.pop() {
        if last < 0xff {
            e.push(last + 1);
            return e;
        }
    }
    vec![0]
}

enum Job {
    Put { key: String, value: Vec<u8> },
    Fetch { name: String, label: String },
    DeletePrefix { prefix: String },
}

struct Queue {
    jobs: Mutex<VecDeque<Job>>,
    cv: Condvar,
    stop: AtomicBool,
}

/// The watch of one loaded peer's prefix: its stream (shut down to end it), its reader thread, the
/// incarnation it guards, and whether it was ended on purpose (then its end is not worth a warning).
struct Watch {
    stream: TcpStream,
    thread: JoinHandle<()>,
    inc: u128,
    retired: Arc<AtomicBool>,
}

impl Watch {
    /// End the watch on purpose: its thread sees the stream close and leaves without a word.
    fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// Every watch: at most one live per loaded peer, and those ended on purpose whose threads are still to be
/// joined (by the next `watch_peer` once they have finished, or by `shutdown`).
#[derive(Default)]
struct Watches {
    live: HashMap<String, Watch>,
    ended: Vec<Watch>,
}

impl Watches {
    fn retire(&mut self, name: &str) {
        if let Some(w) = self.live.remove(name) {
            w.retire();
            self.ended.push(w);
        }
    }
}

pub(crate) struct Etcd {
    ns: String,
    me: String,
    q: Arc<Queue>,
    worker: Mutex<Option<JoinHandle<()>>>,
    watches: Arc<Mutex<Watches>>,
}

impl Etcd {
    /// Start the worker; it announces this agent first.
    pub fn start(endpoints: &str, ns: Option<String>, host: Arc<dyn Host>) -> Result<Etcd> {
        let eps: Vec<Endpoint> = endpoints
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(Endpoint::parse)
            .collect::<std::result::Result<_, _>>()
            .map_err(Error::invalid_param)?;
        if eps.is_empty() {
            return Err(Error::invalid_param("NIXL_ETCD_ENDPOINTS names no endpoint"));
        }
        let ns = ns.filter(|n| !n.is_empty()).unwrap_or_else(|| DEFAULT_NAMESPACE.to_owned());
        let me = host.name();
        let q = Arc::new(Queue { jobs: Mutex::new(VecDeque::new()), cv: Condvar::new(), stop: AtomicBool::new(false) });
        q.jobs.lock().push_back(Job::Put { key: prefix(&ns, &me), value: Vec::new() });
        let watches: Arc<Mutex<Watches>> = Arc::default();
        let mut w = Worker { client: Client { eps }, ns: ns.clone(), host, q: q.clone(), watches: watches.clone() };
        let worker = std::thread::Builder::new()
            .name("gixl-md-etcd".into())
            .spawn(move || w.run())
            .map_err(|e| Error::os(crate::Status::Backend, "spawning the etcd thread", e))?;
        Ok(Etcd { ns, me, q, worker: Mutex::new(Some(worker)), watches })
    }

    fn push(&self, j: Job) {
        self.q.jobs.lock().push_back(j);
        self.q.cv.notify_one();
    }

    pub fn send(&self, label: &str, md: Vec<u8>) {
        self.push(Job::Put { key: key(&self.ns, &self.me, label), value: md });
    }

    pub fn fetch(&self, name: &str, label: &str) {
        self.push(Job::Fetch { name: name.to_owned(), label: label.to_owned() });
    }

    pub fn invalidate_local(&self) {
        self.push(Job::DeletePrefix { prefix: prefix(&self.ns, &self.me) });
    }

    /// The peer `name` is no longer loaded here: end its watch quietly.
    pub fn forget(&self, name: &str) {
        self.watches.lock().retire(name);
    }

    /// Finish queued requests (for up to two seconds), then stop the worker and every watch.
    pub fn shutdown(&self) {
        self.q.stop.store(true, Ordering::Release);
        self.q.cv.notify_all();
        if let Some(t) = self.worker.lock().take() {
            let _ = t.join();
        }
        let ws: Vec<Watch> = {
            let mut g = self.watches.lock();
            let mut ws: Vec<Watch> = g.live.drain().map(|(_, w)| w).collect();
            ws.append(&mut g.ended);
            ws
        };
        for w in &ws {
            w.retire();
        }
        for w in ws {
            let _ = w.thread.join();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Client {
    eps: Vec<Endpoint>,
}

impl Client {
    /// POST to the first endpoint that answers; the response must be 200 with a JSON body.
    fn call(&self, path: &str, body: &str) -> std::result::Result<Json, String> {
        let mut last = String::new();
        for ep in &self.eps {
            match http::post(ep, path, body.as_bytes(), REQUEST_TIMEOUT) {
                Ok((200, b)) => return json::parse(&b).map_err(|e| format!("{ep}{path}: {e}")),
                Ok((st, b)) => {
                    return Err(format!("{ep}{path}: HTTP {st}: {}", String::from_utf8_lossy(&b[..b.len().min(300)])))
                }
                Err(e) => last = format!("{ep}{path}: {e}"),
            }
        }
        Err(last)
    }

    fn put(&self, key: &str, value: &[u8]) -> std::result::Result<(), String> {
        self.call(
            "/v3/kv/put",
            &format!(r#"{{"key":"{}","value":"{}"}}"#, b64_encode(key.as_bytes()), b64_encode(value)),
        )
        .map(|_| ())
    }

    /// (value if present, the store's revision at the time of the read)
    fn get(&self, key: &str) -> std::result::Result<(Option<Vec<u8>>, i64), String> {
        let j = self.call("/v3/kv/range", &format!(r#"{{"key":"{}"}}"#, b64_encode(key.as_bytes())))?;
        let rev = j.get("header").and_then(|h| h.get("revision")).and_then(Json::int).unwrap_or(0);
        let value = match j.get("kvs").map(Json::arr).and_then(|a| a.first()) {
            None => None,
            Some(kv) => Some(
                json::b64_decode(kv.get("value").and_then(Json::str).unwrap_or(""))
                    .map_err(|e| format!("etcd value: {e}"))?,
            ),
        };
        Ok((value, rev))
    }

    fn delete_prefix(&self, p: &str) -> std::result::Result<(), String> {
        let body = format!(
            r#"{{"key":"{}","range_end":"{}"}}"#,
            b64_encode(p.as_bytes()),
            b64_encode(&prefix_end(p.as_bytes()))
        );
        self.call("/v3/kv/deleterange", &body).map(|_| ())
    }

    /// Open a watch on `[key, end)` from `rev`; the stream is left for the caller to read.
    fn watch(&self, key: &[u8], end: Option<&[u8]>, rev: i64) -> std::result::Result<WatchStream, String> {
        let mut req = format!(r#"{{"create_request":{{"key":"{}""#, b64_encode(key));
        if let Some(e) = end {
            req.push_str(&format!(r#","range_end":"{}""#, b64_encode(e)));
        }
        req.push_str(&format!(r#","start_revision":"{rev}"}}}}"#));
        let mut last = String::new();
        for ep in &self.eps {
            match http::open_stream(ep, "/v3/watch", req.as_bytes(), REQUEST_TIMEOUT) {
                Ok((reader, head)) => return Ok(WatchStream { reader, head, lines: Lines::default() }),
                Err(e) => last = format!("{ep}/v3/watch: {e}"),
            }
        }
        Err(last)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Put { value: Vec<u8>, rev: i64 },
    Delete,
}

struct WatchStream {
    reader: http::Reader,
    head: http::Head,
    lines: Lines,
}

impl WatchStream {
    /// The next batch of events (blocking; `deadline` None waits forever). Err at the end of the stream.
    fn next(&mut self, deadline: Option<Instant>) -> std::result::Result<Vec<Event>, String> {
        loop {
            let chunk = match self.reader.body_chunk_until(&self.head, deadline) {
                Ok(Some(c)) => c,
                Ok(None) => return Err("watch stream ended".into()),
                Err(e) => return Err(format!("watch stream: {e}")),
            };
            let mut out = Vec::new();
            for line in self.lines.push(&chunk)? {
                out.extend(parse_watch_line(&line)?);
            }
            if !out.is_empty() {
                return Ok(out);
            }
        }
    }
}

/// One streamed watch response: `{"result":{"events":[...]}}`; PUT events omit `type` (proto3 default).
fn parse_watch_line(line: &[u8]) -> std::result::Result<Vec<Event>, String> {
    let j = json::parse(line).map_err(|e| format!("watch response: {e}"))?;
    if let Some(err) = j.get("error") {
        return Err(format!("watch error: {err:?}"));
    }
    let Some(r) = j.get("result") else { return Ok(Vec::new()) };
    if r.get("canceled").is_some_and(Json::truthy) {
        return Err("watch canceled by etcd".into());
    }
    let mut out = Vec::new();
    for ev in r.get("events").map(Json::arr).unwrap_or(&[]) {
        let kv = ev.get("kv");
        match ev.get("type").and_then(Json::str) {
            Some("DELETE") => out.push(Event::Delete),
            None | Some("PUT") => {
                let value = kv.and_then(|k| k.get("value")).and_then(Json::str).unwrap_or("");
                let value = json::b64_decode(value).map_err(|e| format!("watch value: {e}"))?;
                let rev = kv.and_then(|k| k.get("mod_revision")).and_then(Json::int).unwrap_or(0);
                out.push(Event::Put { value, rev });
            }
            Some(other) => return Err(format!("unknown watch event type {other}")),
        }
    }
    Ok(out)
}

struct Worker {
    client: Client,
    ns: String,
    host: Arc<dyn Host>,
    q: Arc<Queue>,
    watches: Arc<Mutex<Watches>>,
}

impl Worker {
    fn run(&mut self) {
        let mut drain_until: Option<Instant> = None;
        loop {
            let job = {
                let mut jobs = self.q.jobs.lock();
                loop {
                    if self.q.stop.load(Ordering::Acquire) {
                        let until = *drain_until.get_or_insert_with(|| Instant::now() + DRAIN);
                        if Instant::now() >= until {
                            return;
                        }
                    }
                    if let Some(j) = jobs.pop_front() {
                        break j;
                    }
                    if self.q.stop.load(Ordering::Acquire) {
                        return;
                    }
                    self.q.cv.wait(&mut jobs);
                }
            };
            match job {
                Job::Put { key, value } => {
                    if let Err(e) = self.client.put(&key, &value) {
                        log!("etcd: storing {key}: {e}");
                    }
                }
                Job::DeletePrefix { prefix } => {
                    if let Err(e) = self.client.delete_prefix(&prefix) {
                        log!("etcd: removing the keys under {prefix}: {e}");
                    }
                }
                Job::Fetch { name, label } => {
                    if let Err(e) = self.fetch(&name, &label) {
                        log!("etcd: fetching metadata of agent '{name}' (label '{label}'): {e}");
                    }
                }
            }
        }
    }

    fn fetch(&mut self, name: &str, label: &str) -> std::result::Result<(), String> {
        let k = key(&self.ns, name, label);
        let (value, rev) = self.client.get(&k)?;
        let (blob, rev) = match value.filter(|v| !v.is_empty()) {
            Some(v) => (v, rev),
            None => self.wait_for(&k, rev + 1)?,
        };
        let loaded = self.host.load(&blob).map_err(|e| e.to_string())?;
        if loaded != name {
            return Err(format!("the metadata under {k} is agent '{loaded}'s"));
        }
        let Some(inc) = self.host.loaded_incarnation(name) else { return Ok(()) };
        self.watch_peer(name, inc, rev + 1)
    }

    /// Wait (up to FETCH_WAIT) for `key` to be written with a non-empty value.
    fn wait_for(&mut self, key: &str, rev: i64) -> std::result::Result<(Vec<u8>, i64), String> {
        let deadline = Instant::now() + FETCH_WAIT;
        let mut w = self.client.watch(key.as_bytes(), None, rev)?;
        loop {
            if Instant::now() >= deadline {
                return Err(format!("{key} did not appear within {FETCH_WAIT:?}"));
            }
            let evs = match w.next(Some(deadline)) {
                Ok(evs) => evs,
                Err(_) if Instant::now() >= deadline => {
                    return Err(format!("{key} did not appear within {FETCH_WAIT:?}"))
                }
                Err(e) => return Err(e),
            };
            for ev in evs {
                if let Event::Put { value, rev } = ev {
                    if !value.is_empty() {
                        return Ok((value, rev));
                    }
                }
            }
        }
    }

    /// Invalidate `name` when its keys are deleted, if incarnation `inc` is still the one loaded then. A
    /// fetch of the incarnation already watched keeps that watch (one per loaded peer); another incarnation
    /// replaces it. Watches of peers no longer loaded (invalidated by a peer's message, say) end here.
    fn watch_peer(&mut self, name: &str, inc: u128, rev: i64) -> std::result::Result<(), String> {
        let p = prefix(&self.ns, name);
        let mut ws = self.watches.lock();
        let stale: Vec<String> = ws
            .live
            .iter()
            .filter(|(n, w)| w.thread.is_finished() || self.host.loaded_incarnation(n) != Some(w.inc))
            .map(|(n, _)| n.clone())
            .collect();
        for n in stale {
            ws.retire(&n);
        }
        let (done, running): (Vec<Watch>, Vec<Watch>) = ws.ended.drain(..).partition(|w| w.thread.is_finished());
        ws.ended = running;
        for w in done {
            let _ = w.thread.join();
        }
        if ws.live.get(name).is_some_and(|w| w.inc == inc) {
            return Ok(());
        }
        ws.retire(name);
        if ws.live.len() >= MAX_WATCHES {
            return Err(format!("too many etcd watches ({MAX_WATCHES}); agent '{name}' is not watched"));
        }
        let mut stream = self.client.watch(p.as_bytes(), Some(&prefix_end(p.as_bytes())), rev)?;
        let sock = stream.reader.stream.try_clone().map_err(|e| e.to_string())?;
        let host = self.host.clone();
        let who = name.to_owned();
        let retired = Arc::new(AtomicBool::new(false));
        let ended_on_purpose = retired.clone();
        let thread = std::thread::Builder::new()
            .name("gixl-md-watch".into())
            .spawn(move || loop {
                match stream.next(None) {
                    Ok(evs) if evs.contains(&Event::Delete) => {
                        if host.loaded_incarnation(&who) == Some(inc) {
                            if let Err(e) = host.invalidate(&who) {
                                log!("etcd: invalidating agent '{who}' after its keys were deleted: {e}");
                            }
                        }
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        // Worth a warning only when nobody ended it and the peer it guards is still loaded:
                        // a deletion of its keys would then go unseen.
                        let quiet = ended_on_purpose.load(Ordering::Acquire) || host.closing();
                        if !quiet && host.loaded_incarnation(&who) == Some(inc) {
                            log!(
                                "etcd: watch of agent '{who}' ended while it is loaded ({e}); a deletion of its keys \
                                 will go unseen until it is fetched again"
                            );
                        }
                        return;
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        ws.live.insert(name.to_owned(), Watch { stream: sock, thread, inc, retired });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nixl_key_layout() {
        assert_eq!(key(DEFAULT_NAMESPACE, "prefill", DEFAULT_LABEL), "/nixl/agents//prefill/metadata");
        assert_eq!(prefix(DEFAULT_NAMESPACE, "prefill"), "/nixl/agents//prefill/");
        assert_eq!(prefix_end(b"/a/"), b"/a0");
        assert_eq!(prefix_end(b"a\xff\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
    }

    #[test]
    fn watch_lines() {
        let created = br#"{"result":{"header":{"revision":"2"},"created":true}}"#;
        assert_eq!(parse_watch_line(created).unwrap(), vec![]);
        let put = br#"{"result":{"header":{"revision":"4"},"events":[{"kv":{"key":"YQ==","mod_revision":"4","value":"aGk="}}]}}"#;
        assert_eq!(parse_watch_line(put).unwrap(), vec![Event::Put { value: b"hi".to_vec(), rev: 4 }]);
        let del = br#"{"result":{"events":[{"type":"DELETE","kv":{"key":"YQ==","mod_revision":"5"}}]}}"#;
        assert_eq!(parse_watch_line(del).unwrap(), vec![Event::Delete]);
        assert!(parse_watch_line(br#"{"result":{"canceled":true}}"#).is_err());
        assert!(parse_watch_line(br#"{"error":{"grpc_code":1}}"#).is_err());
        assert!(parse_watch_line(b"{").is_err());
    }
}
