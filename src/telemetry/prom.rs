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

use super::{log, Counter, PeerRow, PeerSource, EVENTS};

/// One agent's series.
pub struct Series {
    agent: String,
    /// Per event type: the running sum (`_total`) and the last value (gauge).
    total: [Counter; 21],
    last: [Counter; 21],
    bounds: Vec<f64>,
    /// Histograms of `agent_xfer_time` and `agent_xfer_post_time`: per bound, then +Inf.
    hist: [Vec<AtomicU64>; 2],
    pub(super) stale: AtomicU64,
    pub(super) disconnects: Mutex<HashMap<String, (u64, u128)>>,
    pub(super) peers: OnceLock<PeerSource>,
}

impl Series {
    pub(super) fn record(&self, ev: u32, v: u64) {
        let i = ev as usize;
        self.total[i].add(v);
        self.last[i].set(v);
        let h = match ev {
            super::XFER_TIME => &self.hist[0],
            super::XFER_POST_TIME => &self.hist[1],
            _ => return,
        };
        let b = self.bounds.iter().position(|&ub| v as f64 <= ub).unwrap_or(self.bounds.len());
        h[b].fetch_add(1, Ordering::Relaxed);
    }
}

struct Exporter {
    agents: Mutex<Vec<Arc<Series>>>,
}

/// The process's exporter: None when its port could not be bound (then nothing is exported).
fn exporter() -> Option<&'static Exporter> {
    static E: OnceLock<Option<&'static Exporter>> = OnceLock::new();
    *E.get_or_init(|| {
        let port: u16 = match std::env::var("NIXL_TELEMETRY_PROMETHEUS_PORT") {
            Ok(p) => match p.trim().parse() {
                Ok(p) => p,
                Err(_) => {
                    log::warn(&format!("NIXL_TELEMETRY_PROMETHEUS_PORT={p:?} is not a port; using 9090"));
                    9090
                }
            },
            Err(_) => 9090,
        };
        let local = crate::agent::env_flag("NIXL_TELEMETRY_PROMETHEUS_LOCAL") == Some(true);
        let host = if local { "127.0.0.1" } else { "0.0.0.0" };
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
        let spawned = std::thread::Builder::new().name("gixl-prometheus".into()).spawn(move || serve(e, l));
        if let Err(err) = spawned {
            log::warn(&format!("Prometheus exporter thread did not start ({err}); no telemetry sink"));
            return None;
        }
        log::info(&format!("telemetry: Prometheus exporter on http://{host}:{port}/metrics"));
        Some(e)
    })
}

pub(super) fn attach(agent: &str, bounds: Vec<f64>) -> Option<Arc<Series>> {
    let e = exporter()?;
    let n = bounds.len() + 1;
    let s = Arc::new(Series {
        agent: agent.to_owned(),
        total: Default::default(),
        last: Default::default(),
        hist: [(0..n).map(|_| AtomicU64::new(0)).collect(), (0..n).map(|_| AtomicU64::new(0)).collect()],
        bounds,
        stale: AtomicU64::new(0),
        disconnects: Mutex::new(HashMap::new()),
        peers: OnceLock::new(),
    });
    e.agents.lock().push(s.clone());
    Some(s)
}

/// A destroyed agent's series leave the endpoint.
pub(super) fn detach(s: &Arc<Series>) {
    if let Some(e) = exporter() {
        e.agents.lock().retain(|x| !Arc::ptr_eq(x, s));
    }
}

fn serve(e: &'static Exporter, l: TcpListener) {
    for conn in l.incoming() {
        let Ok(mut c) = conn else { continue };
        let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = c.set_write_timeout(Some(Duration::from_secs(5)));
        let _ = answer(e, &mut c);
    }
}

fn answer(e: &Exporter, c: &mut TcpStream) -> std::io::Result<()> {
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
        let agents: Vec<Arc<Series>> = e.agents.lock().clone();
        ("200 OK", render(&agents, &super::hostname()))
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
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn fmt_bound(b: f64) -> String {
    if b.fract() == 0.0 && b.abs() < 1e15 {
        format!("{}", b as i64)
    } else {
        format!("{b}")
    }
}

/// The exposition text for these agents.
pub fn render(agents: &[Arc<Series>], host: &str) -> String {
    let mut o = String::new();
    let lbl = |s: &Series| format!("agent_name=\"{}\",hostname=\"{}\"", esc(&s.agent), esc(host));
    // Counters (`_total`) of the non-error events, then the error counter, then the last-value gauges.
    let counters: [(u32, &str, &str); 9] = [
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
        for s in agents {
            let _ = writeln!(o, "{name}{{{}}} {}", lbl(s), s.total[ev as usize].get());
        }
    }
    let _ = writeln!(o, "# HELP agent_errors_total Errors by status, cumulative\n# TYPE agent_errors_total counter");
    for s in agents {
        for (i, ev) in EVENTS.iter().enumerate().take(20).skip(8) {
            let status = &ev["agent_err_".len()..];
            let _ = writeln!(o, "agent_errors_total{{{},status=\"{status}\"}} {}", lbl(s), s.total[i].get());
        }
    }
    let gauges: [(u32, &str, &str); 6] = [
        (0, "agent_tx_last_bytes", "Bytes of the last WRITE request"),
        (1, "agent_rx_last_bytes", "Bytes of the last READ request"),
        (4, "agent_memory_registered_last_bytes", "Bytes of the last registration"),
        (5, "agent_memory_deregistered_last_bytes", "Bytes of the last deregistration"),
        (6, "agent_xfer_time", "Transfer time of the last request, microseconds"),
        (7, "agent_xfer_post_time", "Post time of the last request, microseconds"),
    ];
    for (ev, name, help) in gauges {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge");
        for s in agents {
            let _ = writeln!(o, "{name}{{{}}} {}", lbl(s), s.last[ev as usize].get());
        }
    }
    let hists: [(usize, u32, &str, &str); 2] = [
        (0, 6, "agent_xfer_time_us", "Transfer times (post to completion), microseconds"),
        (1, 7, "agent_xfer_post_time_us", "Post times (start to handed to the backend), microseconds"),
    ];
    for (h, ev, name, help) in hists {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
        for s in agents {
            let l = lbl(s);
            let mut cum = 0;
            for (i, b) in s.bounds.iter().enumerate() {
                cum += s.hist[h][i].load(Ordering::Relaxed);
                let _ = writeln!(o, "{name}_bucket{{{l},le=\"{}\"}} {cum}", fmt_bound(*b));
            }
            cum += s.hist[h][s.bounds.len()].load(Ordering::Relaxed);
            let _ = writeln!(o, "{name}_bucket{{{l},le=\"+Inf\"}} {cum}");
            let _ = writeln!(o, "{name}_sum{{{l}}} {}", s.total[ev as usize].get());
            let _ = writeln!(o, "{name}_count{{{l}}} {cum}");
        }
    }
    // gixl's own series.
    let _ = writeln!(
        o,
        "# HELP gixl_peer_info Loaded peers: incarnation and the route their data takes (in-process, cma, tcp, \
         tcp-after-cma-denied)\n# TYPE gixl_peer_info gauge"
    );
    let rows: Vec<(String, Vec<PeerRow>)> =
        agents.iter().map(|s| (lbl(s), s.peers.get().map(|f| f()).unwrap_or_default())).collect();
    for (l, peers) in &rows {
        for p in peers {
            let _ = writeln!(
                o,
                "gixl_peer_info{{{l},peer=\"{}\",incarnation=\"{:032x}\",route=\"{}\"}} 1",
                esc(&p.name),
                p.incarnation,
                esc(&p.route)
            );
        }
    }
    let _ = writeln!(o, "# HELP gixl_peer_connected 1 while a loaded peer is reachable, 0 once it has disconnected");
    let _ = writeln!(o, "# TYPE gixl_peer_connected gauge");
    for (l, peers) in &rows {
        for p in peers {
            let _ = writeln!(o, "gixl_peer_connected{{{l},peer=\"{}\"}} {}", esc(&p.name), p.connected as u8);
        }
    }
    let _ = writeln!(o, "# HELP gixl_peer_disconnects_total Peer incarnations seen disconnecting, per peer name");
    let _ = writeln!(o, "# TYPE gixl_peer_disconnects_total counter");
    for s in agents {
        for (peer, (n, _)) in s.disconnects.lock().iter() {
            let _ = writeln!(o, "gixl_peer_disconnects_total{{{},peer=\"{}\"}} {n}", lbl(s), esc(peer));
        }
    }
    let _ = writeln!(
        o,
        "# HELP gixl_stale_handle_refusals_total Requests refused (NOT_FOUND) because their peer was invalidated \
         or replaced\n# TYPE gixl_stale_handle_refusals_total counter"
    );
    for s in agents {
        let _ = writeln!(o, "gixl_stale_handle_refusals_total{{{}}} {}", lbl(s), s.stale.load(Ordering::Relaxed));
    }
    o
}
