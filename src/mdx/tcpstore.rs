//! Metadata exchange through a torch.distributed TCPStore (`NIXL_TCPSTORE_ENDPOINT=host:port`), speaking
//! c10d's TCPStore wire protocol itself: no libtorch, no Python.
//!
//! Keys follow NIXL 1.5.1: `nixl/agents/<label>/<agent>/NULL_AGENT` (label `metadata` for the full metadata),
//! sent with the leading `/` every c10d client puts before its keys, so torch's own `TCPStore` objects see the
//! same keys. `send_local_md` sets the key, a partial send sets its label's key, and `invalidate_local_md`
//! deletes every key this agent set. A fetch reads the key; when it is not there yet, the fetch waits for it
//! (a c10d WAIT on a connection of its own, blocked in `read`: nothing polls) for up to
//! `NIXL_TCPSTORE_TIMEOUT_MS` (default 30 s), then loads it. A TCPStore has no watch, so, as in NIXL, a peer
//! that fetched an agent keeps it after that agent invalidates itself, until it removes it (the store's key
//! is gone, so fetching it again finds nothing).
//!
//! One worker thread per agent runs the requests in order on one connection (the caller only queues them),
//! each bounded by `NIXL_TCPSTORE_OP_TIMEOUT_MS` (default 5 s); a failed request drops the connection and the
//! next one opens a new one. Failures are logged, as NIXL does.
//!
//! The protocol (torch's `c10d::detail::QueryType`): a request is a query byte and its arguments; a string is
//! a u64 length and its bytes; integers are in the host's byte order, as torch writes them.
//!
//! | query | arguments | answer |
//! |---|---|---|
//! | VALIDATE 0 | u32 magic `0x3C85F7CE` | none (must come first; the server drops a peer without it) |
//! | SET 1 | key, value | none |
//! | GET 3 | key | value |
//! | CHECK 5 | u64 count, keys | u8: 0 all present, 1 not |
//! | WAIT 6 | u64 count, keys | u8 0 once all are present |
//! | DELETE_KEY 8 | key | i64 keys deleted |
//! | PING 13 | u32 nonce | the nonce |
//!
//! Everything the server sends is read against a deadline and checked: an answer byte that is not one of the
//! protocol's, a value longer than `MAX_VALUE` (refused before anything is allocated), a short answer or a
//! closed connection are errors, never a panic. Not supported: torch's other queries (ADD, COMPARE_SET,
//! APPEND, MULTI_GET...), which the metadata exchange does not need, and byte orders that differ between the
//! client and the server (torch does not support them either).

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{log, Host};
use crate::status::{Error, Result};

/// c10d's validation magic: the first thing a client sends.
pub const MAGIC: u32 = 0x3C85_F7CE;
/// The query bytes used here (torch's `QueryType` ordinals).
const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const DELETE_KEY: u8 = 8;
const PING: u8 = 13;
/// CHECK's answers, and WAIT's.
const READY: u8 = 0;
const NOT_READY: u8 = 1;
const STOP_WAITING: u8 = 0;

/// The longest value read from the store: the metadata codec's own cap, so a longer value could not be
/// loaded anyway. A longer length is refused before the value is read (the connection is then dropped).
pub const MAX_VALUE: u64 = super::wire::MAX_PAYLOAD as u64;

pub const NAMESPACE: &str = "nixl/agents";
/// NIXL's placeholder destination: metadata published for every agent.
pub const NULL_AGENT: &str = "NULL_AGENT";

/// NIXL's defaults: the bring-up budget (the first connection, and how long a fetch waits for a key), and
/// the bound on one request.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(30_000);
const DEFAULT_OP_TIMEOUT: Duration = Duration::from_millis(5_000);
/// How long a closing agent keeps working through requests it already accepted.
const DRAIN: Duration = Duration::from_secs(2);
/// Fetches waiting for a key at once (each holds a connection and a thread).
const MAX_WAITS: usize = 1024;

/// `nixl/agents/<label>/<agent>/NULL_AGENT`, NIXL's key (without the `/` the wire adds).
pub fn key(label: &str, agent: &str) -> String {
    format!("{NAMESPACE}/{label}/{agent}/{NULL_AGENT}")
}

// ----- requests -----

fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u64).to_ne_bytes());
    buf.extend_from_slice(b);
}

fn put_key(buf: &mut Vec<u8>, key: &str) {
    put_bytes(buf, format!("/{key}").as_bytes());
}

/// VALIDATE, then a PING whose answer proves the server speaks the protocol.
fn hello(nonce: u32) -> Vec<u8> {
    let mut b = vec![VALIDATE];
    b.extend_from_slice(&MAGIC.to_ne_bytes());
    b.push(PING);
    b.extend_from_slice(&nonce.to_ne_bytes());
    b
}

fn set_req(key: &str, value: &[u8]) -> Vec<u8> {
    let mut b = vec![SET];
    put_key(&mut b, key);
    put_bytes(&mut b, value);
    b
}

fn one_key(query: u8, key: &str) -> Vec<u8> {
    let mut b = vec![query];
    put_key(&mut b, key);
    b
}

fn keys_req(query: u8, key: &str) -> Vec<u8> {
    let mut b = vec![query];
    b.extend_from_slice(&1u64.to_ne_bytes());
    put_key(&mut b, key);
    b
}

// ----- one connection -----

/// A validated connection to the store.
struct Conn {
    s: TcpStream,
}

fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

impl Conn {
    /// Connect to the first address of `host:port` that answers, within `timeout` for everything (every
    /// address, then the handshake).
    fn open(host: &str, port: u16, timeout: Duration) -> std::result::Result<Conn, String> {
        let deadline = Instant::now() + timeout;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addrs = (host, port).to_socket_addrs().map_err(|e| format!("cannot resolve {host}:{port}: {e}"))?;
        let mut last = format!("{host}:{port} has no address");
        let mut s = None;
        for a in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(&a, left) {
                Ok(c) => {
                    s = Some(c);
                    break;
                }
                Err(e) => last = format!("connecting to {a}: {e}"),
            }
        }
        let s = s.ok_or(last)?;
        let _ = s.set_nodelay(true);
        let mut c = Conn { s };
        // Any value serves; one that changes per connection catches a stale answer.
        let nonce = std::process::id() ^ rand_u32();
        c.send(&hello(nonce), deadline)?;
        let got = u32::from_ne_bytes(c.recv_array(deadline)?);
        if got != nonce {
            return Err(format!("not a TCPStore: PING answered {got:#x}, not the nonce {nonce:#x}"));
        }
        Ok(c)
    }

    fn send(&mut self, mut b: &[u8], deadline: Instant) -> std::result::Result<(), String> {
        while !b.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("send timed out".into());
            }
            self.s.set_write_timeout(Some(left)).map_err(|e| format!("send: {e}"))?;
            match self.s.write(b) {
                Ok(0) => return Err("send: the connection is closed".into()),
                Ok(n) => b = &b[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if timed_out(&e) => return Err("send timed out".into()),
                Err(e) => return Err(format!("send: {e}")),
            }
        }
        Ok(())
    }

    fn recv(&mut self, mut buf: &mut [u8], deadline: Instant) -> std::result::Result<(), String> {
        while !buf.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("no answer in time".into());
            }
            self.s.set_read_timeout(Some(left)).map_err(|e| format!("receive: {e}"))?;
            match self.s.read(buf) {
                Ok(0) => return Err("the store closed the connection mid-answer".into()),
                Ok(n) => buf = &mut buf[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if timed_out(&e) => return Err("no answer in time".into()),
                Err(e) => return Err(format!("receive: {e}")),
            }
        }
        Ok(())
    }

    fn recv_array<const N: usize>(&mut self, deadline: Instant) -> std::result::Result<[u8; N], String> {
        let mut a = [0u8; N];
        self.recv(&mut a, deadline)?;
        Ok(a)
    }
}

/// A few bits that differ between calls (no RNG crate needed for a nonce).
fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish() as u32
}

// ----- the client -----

/// A TCPStore client: one connection, opened on first use and again after any failed request.
pub(crate) struct Client {
    host: String,
    port: u16,
    /// For the first connection (NIXL's bring-up budget); later ones get `op_timeout`.
    connect_timeout: Duration,
    op_timeout: Duration,
    conn: Option<Conn>,
    brought_up: bool,
}

impl Client {
    pub fn new(host: &str, port: u16, connect_timeout: Duration, op_timeout: Duration) -> Client {
        Client { host: host.to_owned(), port, connect_timeout, op_timeout, conn: None, brought_up: false }
    }

    pub fn connect(&mut self) -> std::result::Result<(), String> {
        self.conn().map(|_| ())
    }

    fn conn(&mut self) -> std::result::Result<&mut Conn, String> {
        if self.conn.is_none() {
            let t = if std::mem::replace(&mut self.brought_up, true) { self.op_timeout } else { self.connect_timeout };
            self.conn = Some(Conn::open(&self.host, self.port, t)?);
        }
        self.conn.as_mut().ok_or_else(|| "no connection".to_owned())
    }

    /// One request within the op timeout; any failure drops the connection (it may be out of step).
    fn run<T>(
        &mut self,
        f: impl FnOnce(&mut Conn, Instant) -> std::result::Result<T, String>,
    ) -> std::result::Result<T, String> {
        let op = self.op_timeout;
        let r = self.conn().and_then(|c| f(c, Instant::now() + op));
        if r.is_err() {
            self.conn = None;
        }
        r
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> std::result::Result<(), String> {
        let req = set_req(key, value);
        self.run(|c, d| c.send(&req, d))
    }

    /// The value under `key`, None when there is none (CHECK, then GET: a GET of a missing key would
    /// make the server wait for it).
    pub fn get(&mut self, key: &str) -> std::result::Result<Option<Vec<u8>>, String> {
        let (check, get) = (keys_req(CHECK, key), one_key(GET, key));
        self.run(|c, d| {
            c.send(&check, d)?;
            match c.recv_array::<1>(d)?[0] {
                READY => {}
                NOT_READY => return Ok(None),
                b => return Err(format!("CHECK answered {b}, which is neither READY nor NOT_READY")),
            }
            c.send(&get, d)?;
            let len = u64::from_ne_bytes(c.recv_array(d)?);
            if len > MAX_VALUE {
                return Err(format!("GET answered a value of {len} bytes (at most {MAX_VALUE})"));
            }
            let mut v = vec![0u8; len as usize];
            c.recv(&mut v, d)?;
            // Deleted between the CHECK and the GET: the server's empty answer.
            Ok(Some(v).filter(|v| !v.is_empty()))
        })
    }

    /// Delete `key`; whether it was there.
    pub fn delete(&mut self, key: &str) -> std::result::Result<bool, String> {
        let req = one_key(DELETE_KEY, key);
        self.run(|c, d| {
            c.send(&req, d)?;
            match i64::from_ne_bytes(c.recv_array(d)?) {
                n @ (0 | 1) => Ok(n == 1),
                n => Err(format!("DELETE_KEY answered {n} keys deleted for one key")),
            }
        })
    }
}

/// Open a connection of its own and ask the store to answer once `key` exists (WAIT): the connection,
/// whose next byte is that answer.
fn start_wait(host: &str, port: u16, key: &str, op_timeout: Duration) -> std::result::Result<Conn, String> {
    let mut c = Conn::open(host, port, op_timeout)?;
    c.send(&keys_req(WAIT, key), Instant::now() + op_timeout)?;
    Ok(c)
}

// ----- the worker -----

enum Job {
    Connect,
    Set { key: String, value: Vec<u8> },
    Fetch { name: String, key: String, until: Instant },
    Invalidate,
}

struct Queue {
    jobs: Mutex<VecDeque<Job>>,
    cv: Condvar,
    stop: AtomicBool,
}

impl Queue {
    fn push(&self, j: Job) {
        self.jobs.lock().push_back(j);
        self.cv.notify_one();
    }
}

/// A fetch waiting for its key: the connection (shut down to end it) and the thread reading its answer.
struct Wait {
    stream: TcpStream,
    thread: JoinHandle<()>,
}

pub(crate) struct TcpStore {
    me: String,
    q: Arc<Queue>,
    worker: Mutex<Option<JoinHandle<()>>>,
    waits: Arc<Mutex<HashMap<String, Wait>>>,
    fetch_wait: Duration,
}

/// A timeout setting in milliseconds; unset, zero or negative: the default.
fn timeout(name: &str, default: Duration) -> Result<Duration> {
    let Some(v) = crate::config::get(name, crate::config::Kind::Int)? else { return Ok(default) };
    let ms = crate::config::parse_signed(&v)
        .ok_or_else(|| Error::invalid_param(format!("{name}={v:?} is not a whole number of milliseconds")))?;
    Ok(if ms > 0 { Duration::from_millis(ms as u64) } else { default })
}

impl TcpStore {
    /// Start the worker, which connects first (a failure is logged and the connection tried again by the
    /// first request, as NIXL does). `endpoint` has passed `check_tcpstore`.
    pub fn start(endpoint: &str, host: Arc<dyn Host>) -> Result<TcpStore> {
        let bad = || Error::invalid_param(format!("NIXL_TCPSTORE_ENDPOINT must be host:port, got: {endpoint}"));
        let (h, p) = endpoint.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = p.parse().ok().filter(|p| *p != 0).ok_or_else(bad)?;
        let fetch_wait = timeout("NIXL_TCPSTORE_TIMEOUT_MS", DEFAULT_TIMEOUT)?;
        let op_timeout = timeout("NIXL_TCPSTORE_OP_TIMEOUT_MS", DEFAULT_OP_TIMEOUT)?;
        let me = host.name();
        let q = Arc::new(Queue {
            jobs: Mutex::new(VecDeque::from([Job::Connect])),
            cv: Condvar::new(),
            stop: false.into(),
        });
        let waits: Arc<Mutex<HashMap<String, Wait>>> = Arc::default();
        let mut w = Worker {
            client: Client::new(h, port, fetch_wait, op_timeout),
            host,
            q: q.clone(),
            waits: waits.clone(),
            published: HashSet::new(),
        };
        let worker = std::thread::Builder::new()
            .name("gixl-md-tcpstore".into())
            .spawn(move || w.run())
            .map_err(|e| Error::os(crate::Status::Backend, "spawning the TCPStore thread", e))?;
        Ok(TcpStore { me, q, worker: Mutex::new(Some(worker)), waits, fetch_wait })
    }

    pub fn send(&self, label: &str, md: Vec<u8>) {
        self.q.push(Job::Set { key: key(label, &self.me), value: md });
    }

    pub fn fetch(&self, name: &str, label: &str) {
        let until = Instant::now() + self.fetch_wait;
        self.q.push(Job::Fetch { name: name.to_owned(), key: key(label, name), until });
    }

    pub fn invalidate_local(&self) {
        self.q.push(Job::Invalidate);
    }

    /// Finish queued requests (for up to two seconds), then stop the worker and every waiting fetch.
    pub fn shutdown(&self) {
        self.q.stop.store(true, Ordering::Release);
        self.q.cv.notify_all();
        if let Some(t) = self.worker.lock().take() {
            let _ = t.join();
        }
        let waits: Vec<Wait> = self.waits.lock().drain().map(|(_, w)| w).collect();
        for w in &waits {
            let _ = w.stream.shutdown(Shutdown::Both);
        }
        for w in waits {
            let _ = w.thread.join();
        }
    }
}

impl Drop for TcpStore {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Worker {
    client: Client,
    host: Arc<dyn Host>,
    q: Arc<Queue>,
    waits: Arc<Mutex<HashMap<String, Wait>>>,
    /// The keys this agent set and has not deleted since (what `invalidate_local_md` deletes).
    published: HashSet<String>,
}

impl Worker {
    fn run(&mut self) {
        let mut drain_until: Option<Instant> = None;
        loop {
            let job = {
                let mut jobs = self.q.jobs.lock();
                loop {
                    let stop = self.q.stop.load(Ordering::Acquire);
                    if stop && Instant::now() >= *drain_until.get_or_insert_with(|| Instant::now() + DRAIN) {
                        return;
                    }
                    if let Some(j) = jobs.pop_front() {
                        break j;
                    }
                    if stop {
                        return;
                    }
                    self.q.cv.wait(&mut jobs);
                }
            };
            match job {
                Job::Connect => {
                    if let Err(e) = self.client.connect() {
                        log!("TCPStore: connecting failed, trying again on the first request: {e}");
                    }
                }
                Job::Set { key, value } => match self.client.set(&key, &value) {
                    Ok(()) => {
                        self.published.insert(key);
                    }
                    Err(e) => log!("TCPStore: storing {key}: {e}"),
                },
                Job::Invalidate => {
                    // Keys not deleted stay listed, so a later invalidation tries them again.
                    let keys: Vec<String> = self.published.iter().cloned().collect();
                    for k in keys {
                        match self.client.delete(&k) {
                            Ok(_) => {
                                self.published.remove(&k);
                            }
                            Err(e) => {
                                log!("TCPStore: deleting {k}: {e}");
                                break;
                            }
                        }
                    }
                }
                Job::Fetch { name, key, until } => {
                    if let Err(e) = self.fetch(&name, &key, until) {
                        log!("TCPStore: fetching metadata of agent '{name}' ({key}): {e}");
                    }
                }
            }
        }
    }

    fn fetch(&mut self, name: &str, key: &str, until: Instant) -> std::result::Result<(), String> {
        let Some(blob) = self.client.get(key)? else { return self.wait_for(name, key, until) };
        // Another agent's metadata under this name's key is refused before anything is loaded.
        let claimed = crate::md::AgentMd::peek_name(&blob).map_err(|e| e.to_string())?;
        if claimed != name {
            return Err(format!("the metadata under {key} is agent '{claimed}'s; not loaded"));
        }
        self.host.load(&blob).map(|_| ()).map_err(|e| e.to_string())
    }

    /// The key is not there yet: wait for it on a connection of its own until `until`, then fetch again.
    /// One wait per key; a fetch of a key already waited for joins that wait.
    fn wait_for(&mut self, name: &str, key: &str, until: Instant) -> std::result::Result<(), String> {
        let mut waits = self.waits.lock();
        let done: Vec<String> = waits.iter().filter(|(_, w)| w.thread.is_finished()).map(|(k, _)| k.clone()).collect();
        for k in done {
            if let Some(w) = waits.remove(&k) {
                let _ = w.thread.join();
            }
        }
        if waits.contains_key(key) {
            return Ok(());
        }
        if Instant::now() >= until {
            return Err(format!("gave up waiting for {key}"));
        }
        if waits.len() >= MAX_WAITS {
            return Err(format!("{MAX_WAITS} fetches are already waiting for their keys"));
        }
        let mut conn = start_wait(&self.client.host, self.client.port, key, self.client.op_timeout)?;
        let stream = conn.s.try_clone().map_err(|e| e.to_string())?;
        let (q, name, k) = (self.q.clone(), name.to_owned(), key.to_owned());
        let host = self.host.clone();
        let thread = std::thread::Builder::new()
            .name("gixl-md-tcpwait".into())
            .spawn(move || {
                let r = conn.recv_array::<1>(until);
                if q.stop.load(Ordering::Acquire) || host.closing() {
                    return;
                }
                match r {
                    Ok([STOP_WAITING]) => q.push(Job::Fetch { name, key: k, until }),
                    Ok([b]) => log!("TCPStore: WAIT for {k} answered {b}, not STOP_WAITING"),
                    Err(_) if Instant::now() >= until => {
                        log!("TCPStore: fetch of agent '{name}' gave up waiting for {k}")
                    }
                    Err(e) => log!("TCPStore: waiting for {k}: {e}"),
                }
            })
            .map_err(|e| e.to_string())?;
        waits.insert(key.to_owned(), Wait { stream, thread });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn nixl_key_layout_and_requests() {
        assert_eq!(key("metadata", "prefill"), "nixl/agents/metadata/prefill/NULL_AGENT");
        let mut want = vec![SET];
        want.extend_from_slice(&3u64.to_ne_bytes());
        want.extend_from_slice(b"/ab");
        want.extend_from_slice(&2u64.to_ne_bytes());
        want.extend_from_slice(b"xy");
        assert_eq!(set_req("ab", b"xy"), want);
        let mut want = vec![CHECK];
        want.extend_from_slice(&1u64.to_ne_bytes());
        want.extend_from_slice(&2u64.to_ne_bytes());
        want.extend_from_slice(b"/k");
        assert_eq!(keys_req(CHECK, "k"), want);
        let h = hello(7);
        assert_eq!(h.len(), 10);
        assert_eq!(
            (h[0], &h[1..5], h[5], &h[6..]),
            (VALIDATE, &MAGIC.to_ne_bytes()[..], PING, &7u32.to_ne_bytes()[..])
        );
    }

    /// A fake store: handshakes properly (echoes the PING nonce) unless `nonce_xor` is non-zero, then lets
    /// `script` answer requests on the connection.
    fn fake(nonce_xor: u32, script: impl FnOnce(&mut TcpStream) + Send + 'static) -> (u16, JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut h = [0u8; 10];
            s.read_exact(&mut h).unwrap();
            assert_eq!(&h[..5], &hello(0)[..5]);
            let nonce = u32::from_ne_bytes(h[6..10].try_into().unwrap());
            s.write_all(&(nonce ^ nonce_xor).to_ne_bytes()).unwrap();
            script(&mut s);
        });
        (port, t)
    }

    fn client(port: u16) -> Client {
        Client::new("127.0.0.1", port, Duration::from_secs(5), Duration::from_millis(500))
    }

    /// Read one request of `n` bytes (what the client sent), to answer after it.
    fn request(s: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        s.read_exact(&mut b).unwrap();
        b
    }

    #[test]
    fn a_peer_that_is_not_a_store_fails_the_handshake() {
        let (port, t) = fake(1, |_| {});
        let e = client(port).connect().unwrap_err();
        assert!(e.contains("not a TCPStore"), "{e}");
        t.join().unwrap();
    }

    #[test]
    fn get_reads_a_value_and_none_for_a_missing_key() {
        let (port, t) = fake(0, |s| {
            assert_eq!(request(s, keys_req(CHECK, "k").len()), keys_req(CHECK, "k"));
            s.write_all(&[READY]).unwrap();
            assert_eq!(request(s, one_key(GET, "k").len()), one_key(GET, "k"));
            s.write_all(&3u64.to_ne_bytes()).unwrap();
            s.write_all(b"abc").unwrap();
            request(s, keys_req(CHECK, "k").len());
            s.write_all(&[NOT_READY]).unwrap();
            request(s, one_key(DELETE_KEY, "k").len());
            s.write_all(&1i64.to_ne_bytes()).unwrap();
        });
        let mut c = client(port);
        assert_eq!(c.get("k").unwrap(), Some(b"abc".to_vec()));
        assert_eq!(c.get("k").unwrap(), None);
        assert!(c.delete("k").unwrap());
        t.join().unwrap();
    }

    #[test]
    fn an_oversized_value_is_refused_before_it_is_read() {
        let (port, t) = fake(0, |s| {
            request(s, keys_req(CHECK, "k").len());
            s.write_all(&[READY]).unwrap();
            request(s, one_key(GET, "k").len());
            s.write_all(&u64::MAX.to_ne_bytes()).unwrap();
            // The client must hang up rather than read on.
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        let mut c = client(port);
        let e = c.get("k").unwrap_err();
        assert!(e.contains("at most"), "{e}");
        assert!(c.conn.is_none(), "the connection is out of step: dropped");
        t.join().unwrap();
    }

    #[test]
    fn short_unknown_and_silent_answers_fail_cleanly() {
        // A value shorter than its length, then the connection closed.
        let (port, t) = fake(0, |s| {
            request(s, keys_req(CHECK, "k").len());
            s.write_all(&[READY]).unwrap();
            request(s, one_key(GET, "k").len());
            s.write_all(&100u64.to_ne_bytes()).unwrap();
            s.write_all(b"short").unwrap();
        });
        let e = client(port).get("k").unwrap_err();
        assert!(e.contains("closed"), "{e}");
        t.join().unwrap();
        // A CHECK answer that is not in the protocol; a DELETE_KEY count that cannot be.
        let (port, t) = fake(0, |s| {
            request(s, keys_req(CHECK, "k").len());
            s.write_all(&[7]).unwrap();
        });
        assert!(client(port).get("k").unwrap_err().contains("neither"));
        t.join().unwrap();
        let (port, t) = fake(0, |s| {
            request(s, one_key(DELETE_KEY, "k").len());
            s.write_all(&(-5i64).to_ne_bytes()).unwrap();
        });
        assert!(client(port).delete("k").unwrap_err().contains("-5"));
        t.join().unwrap();
        // Silence: the request ends within the op timeout (500 ms here).
        let (port, t) = fake(0, |s| {
            request(s, keys_req(CHECK, "k").len());
            std::thread::sleep(Duration::from_secs(2));
        });
        let mut c = client(port);
        c.connect().unwrap();
        let t0 = Instant::now();
        assert!(c.get("k").unwrap_err().contains("no answer in time"));
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(400) && took < Duration::from_millis(1500), "{took:?}");
        t.join().unwrap();
        // Nothing listening.
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        assert!(client(port).set("k", b"v").is_err());
    }
}
