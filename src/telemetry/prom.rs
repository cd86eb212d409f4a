//! The Prometheus exporter (`NIXL_TELEMETRY_EXPORTER=prometheus`): one HTTP endpoint per process serving
//! `/metrics` in the text exposition format, with NIXL's metric names, types, labels (`agent_name`,
//! `hostname`; `status` on `agent_errors_total`) and histogram buckets, plus gixl's own series.
//!
//! The endpoint is bound when the first agent asks for it, on `NIXL_TELEMETRY_PROMETHEUS_PORT` (default
//! 9090), `127.0.0.1` with `NIXL_TELEMETRY_PROMETHEUS_LOCAL`, else `0.0.0.0`. When the port is taken (two
//! processes on one host), the agent logs one warning and runs without a sink, as NIXL does. One thread
//! blocks in `accept`: nothing runs between scrapes.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

use super::{log, PeerRow, PeerSource, EVENTS};

/// Where one agent's values are, word by word (see [`Layout`]): in this process's memory, or in a
/// `prometheus_mp` store file that the directory's exporter maps too.
pub(super) enum Words {
    Heap(Box<[AtomicU64]>),
    Mapped(super::prom_mp::Store),
}

impl Words {
    fn get(&self) -> &[AtomicU64] {
        match self {
            Words::Heap(w) => w,
            Words::Mapped(m) => m.words(),
        }
    }
}

/// The word offsets of one agent's values with `bounds` histogram bounds: per event type the running sum
/// (`_total`) and the last value (gauge); the two histograms (`agent_xfer_time`, `agent_xfer_post_time`:
/// per bound, then +Inf); the stale-handle refusals.
#[derive(Clone, Copy)]
pub(super) struct Layout {
    bounds: usize,
}

impl Layout {
    pub(super) fn new(bounds: usize) -> Layout {
        Layout { bounds }
    }
    const fn total(ev: usize) -> usize {
        ev
    }
    const fn last(ev: usize) -> usize {
        21 + ev
    }
    fn hist(&self, h: usize, slot: usize) -> usize {
        42 + h * (self.bounds + 1) + slot
    }
    fn stale(&self) -> usize {
        42 + 2 * (self.bounds + 1)
    }
    pub(super) fn words(&self) -> usize {
        self.stale() + 1
    }
}

/// One agent's series.
pub struct Series {
    agent: String,
    words: Words,
    bounds: Vec<f64>,
    pub(super) disconnects: Mutex<HashMap<String, (u64, u128)>>,
    pub(super) peers: OnceLock<PeerSource>,
    /// The overlap check's counts, while it is on.
    pub(super) overlaps: OnceLock<Arc<crate::overlap::Counts>>,
}

impl Series {
    pub(super) fn new(agent: &str, bounds: Vec<f64>, words: Option<super::prom_mp::Store>) -> Series {
        let words = match words {
            Some(m) => Words::Mapped(m),
            None => Words::Heap((0..Layout::new(bounds.len()).words()).map(|_| AtomicU64::new(0)).collect()),
        };
        Series {
            agent: agent.to_owned(),
            words,
            bounds,
            disconnects: Mutex::new(HashMap::new()),
            peers: OnceLock::new(),
            overlaps: OnceLock::new(),
        }
    }

    pub(super) fn record(&self, ev: u32, v: u64) {
        let w = self.words.get();
        let i = ev as usize;
        w[Layout::total(i)].fetch_add(v, Ordering::Relaxed);
        w[Layout::last(i)].store(v, Ordering::Relaxed);
        let h = match ev {
            super::XFER_TIME => 0,
            super::XFER_POST_TIME => 1,
            _ => return self.touched(),
        };
        let b = self.bounds.iter().position(|&ub| v as f64 <= ub).unwrap_or(self.bounds.len());
        w[self.layout().hist(h, b)].fetch_add(1, Ordering::Relaxed);
        self.touched();
    }

    /// A request refused because its peer was invalidated or replaced.
    pub(super) fn stale_refusal(&self) {
        self.words.get()[self.layout().stale()].fetch_add(1, Ordering::Relaxed);
        self.touched();
    }

    fn layout(&self) -> Layout {
        Layout::new(self.bounds.len())
    }

    fn touched(&self) {
        if let Words::Mapped(m) = &self.words {
            m.touch();
        }
    }

    /// Its values now, under these labels (without gixl's peer series when `peers` is false).
    pub(super) fn row(&self, labels: String, peers: bool) -> Row {
        let mut r = Row::read(labels, &self.bounds, self.words.get());
        if peers {
            r.peers = self.peers.get().map(|f| f()).unwrap_or_default();
            r.disconnects = self.disconnects.lock().iter().map(|(p, (n, _))| (p.clone(), *n)).collect();
            r.overlaps = self.overlaps.get().map(|c| c.get());
        }
        r
    }
}

/// One agent's values as an exposition shows them.
pub(super) struct Row {
    /// The label pairs every series of the agent carries, formatted.
    labels: String,
    total: [u64; 21],
    last: [u64; 21],
    bounds: Vec<f64>,
    hist: [Vec<u64>; 2],
    stale: u64,
    peers: Vec<PeerRow>,
    disconnects: Vec<(String, u64)>,
    /// The overlap check's (initiator, target) conflicts, while it is on.
    overlaps: Option<(u64, u64)>,
}

impl Row {
    /// From `words` laid out for `bounds` (at least `Layout::words` of them).
    pub(super) fn read(labels: String, bounds: &[f64], words: &[AtomicU64]) -> Row {
        let l = Layout::new(bounds.len());
        let get = |i: usize| words[i].load(Ordering::Relaxed);
        Row {
            labels,
            total: std::array::from_fn(|ev| get(Layout::total(ev))),
            last: std::array::from_fn(|ev| get(Layout::last(ev))),
            bounds: bounds.to_vec(),
            hist: [0, 1].map(|h| (0..=bounds.len()).map(|b| get(l.hist(h, b))).collect()),
            stale: get(l.stale()),
            peers: Vec::new(),
            disconnects: Vec::new(),
            overlaps: None,
        }
    }
}

struct Exporter {
    agents: Mutex<Vec<Arc<Series>>>,
}

/// Where the scrape endpoint binds: `NIXL_TELEMETRY_PROMETHEUS_PORT` (default 9090), `127.0.0.1` with
/// `NIXL_TELEMETRY_PROMETHEUS_LOCAL`, else `0.0.0.0` (shared by both Prometheus exporters; environment or
/// config file, see `crate::config`).
pub(super) fn endpoint() -> crate::status::Result<(&'static str, u16)> {
    use crate::config::{self, Kind};
    // A value that is not a port fails the exporter, and so agent creation, as in NIXL (it used 9090).
    let port = match config::get("NIXL_TELEMETRY_PROMETHEUS_PORT", Kind::Int)? {
        Some(p) => config::parse_unsigned(&p, u16::MAX as u64).ok_or_else(|| {
            crate::status::Error::invalid_param(format!("NIXL_TELEMETRY_PROMETHEUS_PORT={p:?} is not a port (0-65535)"))
        })? as u16,
        None => 9090,
    };
    let local = config::flag("NIXL_TELEMETRY_PROMETHEUS_LOCAL")? == Some(true);
    Ok((if local { "127.0.0.1" } else { "0.0.0.0" }, port))
}

/// Serve `/metrics` on `l` from a thread of its own, the body made by `body` at each scrape; the thread
/// blocks in `accept` between scrapes. False if the thread did not start.
pub(super) fn serve(l: TcpListener, body: Box<dyn Fn() -> String + Send>) -> bool {
    let spawned = std::thread::Builder::new().name("gixl-prometheus".into()).spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = c.set_write_timeout(Some(Duration::from_secs(5)));
            let _ = answer(&mut c, &*body);
        }
    });
    if let Err(err) = spawned {
        log::warn(&format!("Prometheus exporter thread did not start ({err}); no telemetry sink"));
        return false;
    }
    true
}

/// The process's exporter, made when the first agent asks for it.
static EXPORTER: OnceLock<Option<&'static Exporter>> = OnceLock::new();

/// The process's exporter, bound at `at` by the first agent that asks: None when that port could not be
/// bound (then nothing is exported).
fn exporter(at: (&'static str, u16)) -> Option<&'static Exporter> {
    *EXPORTER.get_or_init(|| {
        let (host, port) = at;
        let l = match TcpListener::bind((host, port)) {
            Ok(l) => l,
            Err(e) => {
                log::warn(&format!(
                    "Prometheus exporter cannot listen on {host}:{port} ({e}); this process will run without a \
                     telemetry sink"
                ));
                return None;
            }
        };
        let e: &'static Exporter = Box::leak(Box::new(Exporter { agents: Mutex::new(Vec::new()) }));
        let host_label = super::hostname();
        let body = move || {
            let agents: Vec<Arc<Series>> = e.agents.lock().clone();
            let rows: Vec<Row> = agents
                .iter()
                .map(|s| s.row(format!("agent_name=\"{}\",hostname=\"{}\"", esc(&s.agent), esc(&host_label)), true))
                .collect();
            render(&rows, true)
        };
        if !serve(l, Box::new(body)) {
            return None;
        }
        log::info(&format!("telemetry: Prometheus exporter on http://{host}:{port}/metrics"));
        Some(e)
    })
}

pub(super) fn attach(agent: &str, bounds: Vec<f64>, at: (&'static str, u16)) -> Option<Arc<Series>> {
    let e = exporter(at)?;
    let s = Arc::new(Series::new(agent, bounds, None));
    e.agents.lock().push(s.clone());
    Some(s)
}

/// A destroyed agent's series leave the endpoint.
pub(super) fn detach(s: &Arc<Series>) {
    if let Some(Some(e)) = EXPORTER.get() {
        e.agents.lock().retain(|x| !Arc::ptr_eq(x, s));
    }
}

fn answer(c: &mut TcpStream, body: &dyn Fn() -> String) -> std::io::Result<()> {
    let mut req = Vec::new();
    let mut buf = [0u8; 2048];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 16384 {
        let n = c.read(&mut buf)?;
        if n == 0 {
            break;
        }
        req.extend_from_slice(&buf[..n]);
    }
    let line = req.split(|&b| b == b'\r').next().unwrap_or(&[]);
    let path = line.split(|&b| b == b' ').nth(1).unwrap_or(b"");
    let (status, body) = if line.starts_with(b"GET ") && (path == b"/metrics" || path.starts_with(b"/metrics?")) {
        ("200 OK", body())
    } else {
        ("404 Not Found", String::from("only /metrics is served here\n"))
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    c.write_all(head.as_bytes())?;
    c.write_all(body.as_bytes())
}

/// Label values escaped as the text format wants.
pub(super) fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn fmt_bound(b: f64) -> String {
    if b.fract() == 0.0 && b.abs() < 1e15 {
        format!("{}", b as i64)
    } else {
        format!("{b}")
    }
}

/// The exposition text for these agents (gixl's peer series too when `peers`).
pub(super) fn render(rows: &[Row], peers: bool) -> String {
    let mut o = String::new();
    // Counters (`_total`) of the non-error events, then the error counter, then the last-value gauges.
    let counters: [(usize, &str, &str); 9] = [
        (0, "agent_tx_bytes_total", "Bytes sent by the agent (WRITE requests), cumulative"),
        (1, "agent_rx_bytes_total", "Bytes received by the agent (READ requests), cumulative"),
        (2, "agent_tx_requests_num_total", "Completed WRITE requests, cumulative"),
        (3, "agent_rx_requests_num_total", "Completed READ requests, cumulative"),
        (4, "agent_memory_registered_total", "Bytes registered, cumulative"),
        (5, "agent_memory_deregistered_total", "Bytes deregistered, cumulative"),
        (6, "agent_xfer_time_total", "Sum of the transfer times (post to completion), microseconds"),
        (7, "agent_xfer_post_time_total", "Sum of the post times (start to handed to the backend), microseconds"),
        (20, "agent_telemetry_events_dropped_total", "Telemetry events dropped before export, cumulative"),
    ];
    for (ev, name, help) in counters {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
        for r in rows {
            let _ = writeln!(o, "{name}{{{}}} {}", r.labels, r.total[ev]);
        }
    }
    let _ = writeln!(o, "# HELP agent_errors_total Errors by status, cumulative\n# TYPE agent_errors_total counter");
    for r in rows {
        for (i, ev) in EVENTS.iter().enumerate().take(20).skip(8) {
            let status = &ev["agent_err_".len()..];
            let _ = writeln!(o, "agent_errors_total{{{},status=\"{status}\"}} {}", r.labels, r.total[i]);
        }
    }
    let gauges: [(usize, &str, &str); 6] = [
        (0, "agent_tx_last_bytes", "Bytes of the last WRITE request"),
        (1, "agent_rx_last_bytes", "Bytes of the last READ request"),
        (4, "agent_memory_registered_last_bytes", "Bytes of the last registration"),
        (5, "agent_memory_deregistered_last_bytes", "Bytes of the last deregistration"),
        (6, "agent_xfer_time", "Transfer time of the last request, microseconds"),
        (7, "agent_xfer_post_time", "Post time of the last request, microseconds"),
    ];
    for (ev, name, help) in gauges {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge");
        for r in rows {
            let _ = writeln!(o, "{name}{{{}}} {}", r.labels, r.last[ev]);
        }
    }
    let hists: [(usize, usize, &str, &str); 2] = [
        (0, 6, "agent_xfer_time_us", "Transfer times (post to completion), microseconds"),
        (1, 7, "agent_xfer_post_time_us", "Post times (start to handed to the backend), microseconds"),
    ];
    for (h, ev, name, help) in hists {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
        for r in rows {
            let l = &r.labels;
            let mut cum = 0;
            for (i, b) in r.bounds.iter().enumerate() {
                cum += r.hist[h][i];
                let _ = writeln!(o, "{name}_bucket{{{l},le=\"{}\"}} {cum}", fmt_bound(*b));
            }
            cum += r.hist[h][r.bounds.len()];
            let _ = writeln!(o, "{name}_bucket{{{l},le=\"+Inf\"}} {cum}");
            let _ = writeln!(o, "{name}_sum{{{l}}} {}", r.total[ev]);
            let _ = writeln!(o, "{name}_count{{{l}}} {cum}");
        }
    }
    // gixl's own series.
    if peers {
        let _ = writeln!(
            o,
            "# HELP gixl_peer_info Loaded peers: incarnation and the route their data takes (in-process, cma, tcp, \
             tcp-after-cma-denied)\n# TYPE gixl_peer_info gauge"
        );
        for r in rows {
            for p in &r.peers {
                let _ = writeln!(
                    o,
                    "gixl_peer_info{{{},peer=\"{}\",incarnation=\"{:032x}\",route=\"{}\"}} 1",
                    r.labels,
                    esc(&p.name),
                    p.incarnation,
                    esc(&p.route)
                );
            }
        }
        let _ =
            writeln!(o, "# HELP gixl_peer_connected 1 while a loaded peer is reachable, 0 once it has disconnected");
        let _ = writeln!(o, "# TYPE gixl_peer_connected gauge");
        for r in rows {
            for p in &r.peers {
                let _ =
                    writeln!(o, "gixl_peer_connected{{{},peer=\"{}\"}} {}", r.labels, esc(&p.name), p.connected as u8);
            }
        }
        let _ = writeln!(o, "# HELP gixl_peer_disconnects_total Peer incarnations seen disconnecting, per peer name");
        let _ = writeln!(o, "# TYPE gixl_peer_disconnects_total counter");
        for r in rows {
            for (peer, n) in &r.disconnects {
                let _ = writeln!(o, "gixl_peer_disconnects_total{{{},peer=\"{}\"}} {n}", r.labels, esc(peer));
            }
        }
        if rows.iter().any(|r| r.overlaps.is_some()) {
            let _ = writeln!(
                o,
                "# HELP gixl_overlap_conflicts_total Transfers found touching bytes another in-flight transfer \
                 writes (or writing bytes it reads), by this agent's posts (initiator) or among the pieces its TCP \
                 target serves for different initiators (target); counted while GIXL_CHECK_OVERLAP is on\n\
                 # TYPE gixl_overlap_conflicts_total counter"
            );
            for r in rows {
                if let Some((i, t)) = r.overlaps {
                    let _ = writeln!(o, "gixl_overlap_conflicts_total{{{},side=\"initiator\"}} {i}", r.labels);
                    let _ = writeln!(o, "gixl_overlap_conflicts_total{{{},side=\"target\"}} {t}", r.labels);
                }
            }
        }
    }
    let _ = writeln!(
        o,
        "# HELP gixl_stale_handle_refusals_total Requests refused (NOT_FOUND) because their peer was invalidated \
         or replaced\n# TYPE gixl_stale_handle_refusals_total counter"
    );
    for r in rows {
        let _ = writeln!(o, "gixl_stale_handle_refusals_total{{{}}} {}", r.labels, r.stale);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The overlap check's counter is exported once the check is on for the agent, by side; not before.
    #[test]
    fn overlap_conflicts_are_exported_by_side_once_the_check_is_on() {
        let s = Series::new("a", Vec::new(), None);
        let text = render(&[s.row("agent=\"a\"".into(), true)], true);
        assert!(!text.contains("gixl_overlap_conflicts_total"), "{text}");
        let c = Arc::new(crate::overlap::Counts::default());
        c.initiator.store(3, Ordering::Relaxed);
        c.target.store(2, Ordering::Relaxed);
        let _ = s.overlaps.set(c);
        let text = render(&[s.row("agent=\"a\"".into(), true)], true);
        assert!(text.contains("# TYPE gixl_overlap_conflicts_total counter"), "{text}");
        assert!(text.contains("gixl_overlap_conflicts_total{agent=\"a\",side=\"initiator\"} 3\n"), "{text}");
        assert!(text.contains("gixl_overlap_conflicts_total{agent=\"a\",side=\"target\"} 2\n"), "{text}");
    }
}
