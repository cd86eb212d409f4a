//! Telemetry as NIXL exports it, plus gixl's own series, and the diagnostics built on them.
//!
//! Configuration (read when an agent is created, as NIXL does):
//! - `NIXL_TELEMETRY_ENABLE` (`y`/`yes`/`on`/`true`/`1` or `n`/`no`/`off`/`false`/`0`; unset: the agent
//!   config's `capture_telemetry`): collect events at all.
//! - `NIXL_TELEMETRY_EXPORTER`: `prometheus` (one scrape endpoint per process, see [`prom`]),
//!   `prometheus_mp` (the processes sharing `NIXL_TELEMETRY_MULTIPROC_DIR` behind one endpoint, see
//!   [`prom_mp`]), `NOP` (collect only), or unset/empty: the file sink when `NIXL_TELEMETRY_DIR` is set, else
//!   collect only. Any other name fails agent creation, as an exporter plugin NIXL cannot load does.
//! - `NIXL_TELEMETRY_DIR`: the file sink, one file per agent named after it, in NIXL's cyclic-buffer layout
//!   (see [`file`]); `NIXL_TELEMETRY_BUFFER_SIZE` events (default 4096, a power of two).
//! - `NIXL_TELEMETRY_PROMETHEUS_PORT` (default 9090), `NIXL_TELEMETRY_PROMETHEUS_LOCAL` (bind 127.0.0.1
//!   instead of 0.0.0.0), `NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US` (comma-separated, strictly increasing,
//!   positive microsecond bounds; invalid fails agent creation), `NIXL_TELEMETRY_ENABLED_METRICS`
//!   (comma-separated globs over the event names; unset: all).
//!
//! Events are NIXL's: per transfer (when its post completes) `agent_xfer_post_time`, `agent_xfer_time`,
//! `agent_tx_bytes`/`agent_rx_bytes` (WRITE/READ) and `agent_tx_requests_num`/`agent_rx_requests_num`; per
//! registration call `agent_memory_registered` / `agent_memory_deregistered` (bytes); per failed post or
//! status `agent_err_<status>`. gixl's own series (Prometheus only): every loaded peer with its incarnation
//! and the route its data takes (`gixl_peer_info`), whether it is connected (`gixl_peer_connected`),
//! disconnects seen (`gixl_peer_disconnects_total`) and requests refused because they were built against
//! an invalidated or replaced peer (`gixl_stale_handle_refusals_total`); while the overlap check is on, the
//! conflicts it found (`gixl_overlap_conflicts_total{side="initiator"|"target"}`, see `crate::overlap`).

pub mod doctor;
pub mod file;
pub mod log;
pub mod prom;
pub mod prom_mp;

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::config::{self, Kind};
use crate::status::{Error, Result, Status};

/// NIXL's event types, numbered as in its telemetry stream (file format version 4).
pub const EVENTS: [&str; 21] = [
    "agent_tx_bytes",
    "agent_rx_bytes",
    "agent_tx_requests_num",
    "agent_rx_requests_num",
    "agent_memory_registered",
    "agent_memory_deregistered",
    "agent_xfer_time",
    "agent_xfer_post_time",
    "agent_err_not_posted",
    "agent_err_invalid_param",
    "agent_err_backend",
    "agent_err_not_found",
    "agent_err_mismatch",
    "agent_err_not_allowed",
    "agent_err_repost_active",
    "agent_err_unknown",
    "agent_err_not_supported",
    "agent_err_remote_disconnect",
    "agent_err_canceled",
    "agent_err_no_telemetry",
    "agent_telemetry_events_dropped",
];
pub const TX_BYTES: u32 = 0;
pub const RX_BYTES: u32 = 1;
pub const TX_REQUESTS: u32 = 2;
pub const RX_REQUESTS: u32 = 3;
pub const MEM_REGISTERED: u32 = 4;
pub const MEM_DEREGISTERED: u32 = 5;
pub const XFER_TIME: u32 = 6;
pub const XFER_POST_TIME: u32 = 7;
const ERR_FIRST: u32 = 8;

/// The `agent_err_*` event of a status (None for SUCCESS / IN_PROG).
pub fn error_event(s: Status) -> Option<u32> {
    let off = match s {
        Status::NotPosted => 0,
        Status::InvalidParam => 1,
        Status::Backend => 2,
        Status::NotFound => 3,
        Status::Mismatch => 4,
        Status::NotAllowed => 5,
        Status::RepostActive => 6,
        Status::Unknown => 7,
        Status::NotSupported => 8,
        Status::RemoteDisconnect => 9,
        Status::Canceled => 10,
        Status::NoTelemetry => 11,
        _ => return None,
    };
    Some(ERR_FIRST + off)
}

/// NIXL's default histogram bounds in microseconds (as its 1.5.1 Prometheus exporter prints them).
pub const DEFAULT_BUCKETS_US: [f64; 18] =
    [10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1e3, 2.5e3, 5e3, 1e4, 2.5e4, 5e4, 1e5, 2.5e5, 5e5, 1e6, 5e6, 1e7];

/// One loaded peer as the exporter shows it, read live at scrape time.
#[derive(Clone, Debug)]
pub struct PeerRow {
    pub name: String,
    pub incarnation: u128,
    pub route: String,
    pub connected: bool,
}

pub type PeerSource = Arc<dyn Fn() -> Vec<PeerRow> + Send + Sync>;

/// The per-agent telemetry: where events go (nowhere when telemetry is off: then every call is a branch),
/// and the agent's entry in the process's list that `gixl doctor` reads.
pub struct Telemetry {
    agent: String,
    incarnation: u128,
    enabled: [bool; 21],
    file: Option<Mutex<file::Ring>>,
    series: Option<Arc<prom::Series>>,
    peers: OnceLock<PeerSource>,
}

fn agents() -> &'static Mutex<Vec<std::sync::Weak<Telemetry>>> {
    static A: OnceLock<Mutex<Vec<std::sync::Weak<Telemetry>>>> = OnceLock::new();
    A.get_or_init(|| Mutex::new(Vec::new()))
}

/// Every live agent of this process: name, incarnation, loaded peers.
pub fn live_agents() -> Vec<(String, u128, Vec<PeerRow>)> {
    let list: Vec<Arc<Telemetry>> = agents().lock().iter().filter_map(|w| w.upgrade()).collect();
    list.iter().map(|t| (t.agent.clone(), t.incarnation, t.peers.get().map(|f| f()).unwrap_or_default())).collect()
}

impl Telemetry {
    /// For a new agent. Sinks come from the environment when its telemetry is requested
    /// (`NIXL_TELEMETRY_ENABLE` or `capture_telemetry`); errors are the ones NIXL fails agent creation with.
    pub fn new(agent: &str, incarnation: u128, requested: bool) -> Result<Arc<Telemetry>> {
        let mut t = Telemetry {
            agent: agent.to_owned(),
            incarnation,
            enabled: [false; 21],
            file: None,
            series: None,
            peers: OnceLock::new(),
        };
        if requested {
            t.sinks_from_env()?;
        }
        let t = Arc::new(t);
        let mut list = agents().lock();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&t));
        Ok(t)
    }

    fn sinks_from_env(&mut self) -> Result<()> {
        let agent = self.agent.clone();
        let t = self;
        t.enabled = enabled_metrics(config::get("NIXL_TELEMETRY_ENABLED_METRICS", Kind::Str)?.as_deref());
        let exporter = config::get("NIXL_TELEMETRY_EXPORTER", Kind::Str)?.unwrap_or_default();
        let buckets = || buckets(config::get("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", Kind::Str)?.as_deref());
        // As NIXL, whatever the exporter: the event buffer's size (a power of two, not 0) and the interval at which
        // it is flushed (milliseconds; any TOML integer in the config file) are checked.
        let cap = match config::unsigned("NIXL_TELEMETRY_BUFFER_SIZE", u64::MAX)? {
            Some(0) => return Err(Error::invalid_param("NIXL_TELEMETRY_BUFFER_SIZE cannot be 0")),
            Some(n) if !n.is_power_of_two() => {
                return Err(Error::invalid_param(format!("NIXL_TELEMETRY_BUFFER_SIZE={n} is not a power of 2")))
            }
            Some(n) => n,
            None => 4096,
        };
        if std::env::var_os("NIXL_TELEMETRY_RUN_INTERVAL").is_some() {
            config::unsigned("NIXL_TELEMETRY_RUN_INTERVAL", u64::MAX)?;
        } else {
            config::get("NIXL_TELEMETRY_RUN_INTERVAL", Kind::Int)?;
        }
        // Exporter names are matched exactly, as NIXL loads its plugins by name.
        match exporter.as_str() {
            "" | "BUFFER" => {
                if let Some(dir) = config::get("NIXL_TELEMETRY_DIR", Kind::Str)?.filter(|d| !d.is_empty()) {
                    let path = std::path::Path::new(&dir).join(&agent);
                    t.file = Some(Mutex::new(file::Ring::create(&path, cap)?));
                }
            }
            "NOP" => {}
            "prometheus" => {
                let (buckets, at) = (buckets()?, prom::endpoint()?);
                t.series = prom::attach(&agent, buckets, at);
            }
            "prometheus_mp" => {
                let (buckets, at) = (buckets()?, prom::endpoint()?);
                t.series = Some(prom_mp::attach(&agent, buckets, at)?);
            }
            other => {
                return Err(Error::backend(format!(
                    "Failed to load telemetry plugin: {other} (gixl has the exporters prometheus, prometheus_mp and \
                     NOP, and the file sink BUFFER, the default, under NIXL_TELEMETRY_DIR)"
                )))
            }
        }
        Ok(())
    }

    pub fn agent(&self) -> &str {
        &self.agent
    }

    /// How to list this agent's peers (for the exporter and `gixl doctor`).
    /// Where the overlap check counts its conflicts (`gixl_overlap_conflicts_total`), once it is on.
    pub fn set_overlap_source(&self, c: Arc<crate::overlap::Counts>) {
        if let Some(s) = &self.series {
            let _ = s.overlaps.set(c);
        }
    }

    pub fn set_peer_source(&self, f: PeerSource) {
        if let Some(s) = &self.series {
            let _ = s.peers.set(f.clone());
        }
        let _ = self.peers.set(f);
    }

    fn event(&self, ev: u32, value: u64) {
        if !self.enabled[ev as usize] {
            return;
        }
        if let Some(f) = &self.file {
            f.lock().push(ev, value);
        }
        if let Some(s) = &self.series {
            s.record(ev, value);
        }
    }

    /// A completed transfer, in NIXL's event order.
    pub fn xfer_done(&self, read: bool, bytes: u64, post_us: u64, xfer_us: u64) {
        self.event(XFER_POST_TIME, post_us);
        self.event(XFER_TIME, xfer_us);
        if read {
            self.event(RX_BYTES, bytes);
            self.event(RX_REQUESTS, 1);
        } else {
            self.event(TX_BYTES, bytes);
            self.event(TX_REQUESTS, 1);
        }
    }

    pub fn registered(&self, bytes: u64) {
        self.event(MEM_REGISTERED, bytes);
    }

    pub fn deregistered(&self, bytes: u64) {
        self.event(MEM_DEREGISTERED, bytes);
    }

    pub fn error(&self, s: Status) {
        if let Some(ev) = error_event(s) {
            self.event(ev, 1);
        }
    }

    /// A request refused because its peer was invalidated or replaced (gixl series).
    pub fn stale_refusal(&self) {
        if let Some(s) = &self.series {
            s.stale_refusal();
        }
    }

    /// Peer `name` (this incarnation) was seen disconnected; counted once per incarnation (gixl series).
    pub fn disconnect(&self, name: &str, incarnation: u128) {
        if let Some(s) = &self.series {
            let mut d = s.disconnects.lock();
            let e = d.entry(name.to_owned()).or_insert((0, 0));
            if e.1 != incarnation || e.0 == 0 {
                e.0 += 1;
                e.1 = incarnation;
            }
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(s) = &self.series {
            prom::detach(s);
        }
    }
}

/// Which events `NIXL_TELEMETRY_ENABLED_METRICS` keeps (globs over the names; unset or empty: all).
pub fn enabled_metrics(spec: Option<&str>) -> [bool; 21] {
    let toks: Vec<&str> = spec.unwrap_or("").split(',').map(str::trim).filter(|t| !t.is_empty()).collect();
    if toks.is_empty() {
        return [true; 21];
    }
    let mut on = [false; 21];
    for t in &toks {
        let mut hit = false;
        for (i, name) in EVENTS.iter().enumerate() {
            if glob(t.as_bytes(), name.as_bytes()) {
                on[i] = true;
                hit = true;
            }
        }
        if !hit {
            log::warn(&format!("NIXL_TELEMETRY_ENABLED_METRICS: '{t}': no telemetry metric matches"));
        }
    }
    on
}

/// POSIX-glob match with `*` and `?`.
fn glob(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si, mut star, mut mark) = (0, 0, None, 0);
    while si < s.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some(pi);
            mark = si;
            pi += 1;
        } else if let Some(st) = star {
            pi = st + 1;
            mark += 1;
            si = mark;
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == b'*' {
        pi += 1;
    }
    pi == p.len()
}

/// `NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US`: unset or empty gives the defaults; anything invalid is an error.
pub fn buckets(spec: Option<&str>) -> Result<Vec<f64>> {
    let Some(spec) = spec.filter(|s| !s.trim().is_empty()) else { return Ok(DEFAULT_BUCKETS_US.to_vec()) };
    let mut v = Vec::new();
    for t in spec.split(',') {
        let x: f64 = t
            .trim()
            .parse()
            .map_err(|_| Error::invalid_param(format!("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US: {t:?} is not a number")))?;
        if !(x.is_finite() && x > 0.0) || v.last().is_some_and(|&l| x <= l) {
            return Err(Error::invalid_param(format!(
                "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US: bounds must be positive and strictly increasing ({spec:?})"
            )));
        }
        v.push(x);
    }
    Ok(v)
}

/// This machine's name, the `hostname` label.
pub fn hostname() -> String {
    static H: OnceLock<String> = OnceLock::new();
    H.get_or_init(|| {
        let mut b = [0u8; 256];
        // SAFETY: `b` is writable for its length; gethostname NUL-terminates within it on success.
        let r = unsafe { libc::gethostname(b.as_mut_ptr().cast(), b.len() - 1) };
        if r != 0 {
            return String::from("unknown");
        }
        let n = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..n]).into_owned()
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_select_events() {
        let on = enabled_metrics(Some("agent_tx_*, agent_xfer_time"));
        let names: Vec<&str> = EVENTS.iter().zip(on).filter(|(_, o)| *o).map(|(n, _)| *n).collect();
        assert_eq!(names, ["agent_tx_bytes", "agent_tx_requests_num", "agent_xfer_time"]);
        assert!(enabled_metrics(None).iter().all(|&o| o));
        assert!(enabled_metrics(Some("")).iter().all(|&o| o));
        assert!(enabled_metrics(Some("nothing_like_this")).iter().all(|&o| !o));
        assert!(glob(b"agent_err_*", b"agent_err_backend"));
        assert!(glob(b"agent_?x_bytes", b"agent_rx_bytes"));
        assert!(!glob(b"agent_?x_bytes", b"agent_rx_bytes_total"));
    }

    #[test]
    fn bucket_overrides_are_checked() {
        assert_eq!(buckets(None).unwrap(), DEFAULT_BUCKETS_US.to_vec());
        assert_eq!(buckets(Some("")).unwrap(), DEFAULT_BUCKETS_US.to_vec());
        assert_eq!(buckets(Some("5, 50,500")).unwrap(), vec![5.0, 50.0, 500.0]);
        assert!(buckets(Some("5,5")).is_err());
        assert!(buckets(Some("-1,5")).is_err());
        assert!(buckets(Some("1,x")).is_err());
    }

    #[test]
    fn every_error_status_has_its_event() {
        for s in [Status::NotPosted, Status::RemoteDisconnect, Status::NoTelemetry] {
            let ev = error_event(s).unwrap();
            assert!(EVENTS[ev as usize].starts_with("agent_err_"));
        }
        assert_eq!(EVENTS[error_event(Status::RemoteDisconnect).unwrap() as usize], "agent_err_remote_disconnect");
        assert_eq!(error_event(Status::Success), None);
        assert_eq!(error_event(Status::InProg), None);
    }
}
