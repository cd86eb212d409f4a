//! Telemetry the way operators consume NIXL's:
//! - a real Prometheus server (Debian's `prometheus`), started here on a loopback port, scrapes the
//!   `NIXL_TELEMETRY_EXPORTER=prometheus` endpoints of two gixl processes that transfer to each other, and
//!   its query API must return NIXL's metric names with the right values (and gixl's own series);
//! - the file sink under `NIXL_TELEMETRY_DIR` has NIXL 1.5.1's layout: the same header, size and event
//!   sequence as the file NIXL itself writes for the same program (NIXL run from `.venv/nixl` when present),
//!   also with `NIXL_TELEMETRY_ENABLED_METRICS` selecting events;
//! - `NIXL_TELEMETRY_EXPORTER=prometheus_mp`: four agents in three processes sharing one directory are served
//!   by one endpoint, a clean end and a crash leave as NIXL's exporter lets them, a dead owner's lock goes
//!   to the next process, a file of another user is not served.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use gixl::*;

fn one(base: u64, len: usize) -> XferDList {
    XferDList::with_descs(MemType::Dram, vec![Desc::new(base, len as u64, 0)])
}

fn reg(a: &Agent, buf: &[u8]) {
    let d = Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0);
    a.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }]), &[]).unwrap();
}

fn wait(a: &Agent, r: &XferReq) {
    let t = Instant::now();
    let mut s = a.post_xfer_req(r, NotifUpdate::Keep).unwrap();
    while s == Status::InProg {
        assert!(t.elapsed() < Duration::from_secs(30), "transfer did not finish");
        std::thread::sleep(Duration::from_micros(100));
        s = a.xfer_status(r).unwrap();
    }
    assert_eq!(s, Status::Success);
}

/// Block until the parent closes our stdin (the exporter keeps serving meanwhile).
fn hold() {
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}

fn child_target() {
    let a = Agent::new("tele-target", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let buf = vec![7u8; 1 << 20];
    reg(&a, &buf);
    println!("\n@md {}", hex(&a.local_md().unwrap()));
    println!("@addr {}", buf.as_ptr() as u64);
    std::io::stdout().flush().unwrap();
    hold();
}

fn child_initiator() {
    let md = unhex(&std::env::var("GIXL_MD").unwrap());
    let addr: u64 = std::env::var("GIXL_ADDR").unwrap().parse().unwrap();
    let a = Agent::new("tele-initiator", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let buf = vec![1u8; 1 << 20];
    reg(&a, &buf);
    a.load_remote_md(&md).unwrap();
    let b = buf.as_ptr() as u64;
    let o = XferOpts::default();
    for i in 0..3 {
        let r =
            a.create_xfer_req(XferOp::Write, &one(b, 4096), &one(addr + i * 4096, 4096), "tele-target", &o).unwrap();
        wait(&a, &r);
    }
    for _ in 0..2 {
        let r = a.create_xfer_req(XferOp::Read, &one(b, 8192), &one(addr, 8192), "tele-target", &o).unwrap();
        wait(&a, &r);
    }
    // A request built against the loaded incarnation, then the peer is invalidated: refused as stale.
    let stale = a.create_xfer_req(XferOp::Write, &one(b, 64), &one(addr, 64), "tele-target", &o).unwrap();
    a.invalidate_remote_md("tele-target").unwrap();
    assert_eq!(a.post_xfer_req(&stale, NotifUpdate::Keep).unwrap_err().status(), Status::NotFound);
    a.load_remote_md(&md).unwrap();
    println!("\n@done");
    std::io::stdout().flush().unwrap();
    // The parent kills the target, then asks for one more post: a disconnect.
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let r = a.create_xfer_req(XferOp::Read, &one(b, 4096), &one(addr, 4096), "tele-target", &o).unwrap();
    let t = Instant::now();
    let e = loop {
        let res = a.post_xfer_req(&r, NotifUpdate::Keep).and_then(|s| match s {
            Status::InProg => a.xfer_status(&r),
            s => Ok(s),
        });
        match res {
            Err(e) => break e,
            Ok(_) => {
                assert!(t.elapsed() < Duration::from_secs(10), "the killed peer still answers");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    };
    assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
    println!("\n@disconnected");
    std::io::stdout().flush().unwrap();
    hold();
}

/// The program `tele.py` runs on NIXL: two agents, 4 KiB registered each, three 4 KiB WRITEs A -> B.
fn child_file_sink() {
    let a = Agent::new("A", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let bagent = Agent::new("B", AgentConfig::default()).unwrap();
    bagent.create_backend("UCX", &Params::new()).unwrap();
    let src = vec![3u8; 4096];
    let dst = vec![0u8; 4096];
    reg(&a, &src);
    reg(&bagent, &dst);
    a.load_remote_md(&bagent.local_md().unwrap()).unwrap();
    for _ in 0..3 {
        let r = a
            .create_xfer_req(
                XferOp::Write,
                &one(src.as_ptr() as u64, 4096),
                &one(dst.as_ptr() as u64, 4096),
                "B",
                &XferOpts::default(),
            )
            .unwrap();
        wait(&a, &r);
        a.release_xfer_req(&r).unwrap();
    }
    println!("\n@written");
}

/// A rank of a `prometheus_mp` run: `GIXL_AGENTS` agents `mp-r<rank>-<k>`, each registering
/// `(rank + 1) × 4 KiB`; `@up <pid>`, then commands on stdin: `touch` (one more registration event),
/// `drop` (the agents end cleanly), end of input (exit).
fn child_mp_rank() {
    let rank: usize = std::env::var("LOCAL_RANK").unwrap().parse().unwrap();
    let n: usize = std::env::var("GIXL_AGENTS").unwrap().parse().unwrap();
    let buf = vec![0u8; (rank + 1) * 4096];
    let mut agents: Vec<Agent> = (0..n)
        .map(|k| {
            let a = Agent::new(&format!("mp-r{rank}-{k}"), AgentConfig::default()).unwrap();
            a.create_backend("UCX", &Params::new()).unwrap();
            reg(&a, &buf);
            a
        })
        .collect();
    println!("\n@up {}", std::process::id());
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lines() {
        match line.unwrap().trim() {
            "touch" => {
                let extra = vec![0u8; 4096];
                reg(&agents[0], &extra);
                println!("\n@touched");
            }
            "drop" => {
                agents.clear();
                println!("\n@dropped");
            }
            _ => {}
        }
        std::io::stdout().flush().unwrap();
    }
}

/// Agent creation under `prometheus_mp` as configured by the environment: `@created` or `@refused <status>`.
fn child_mp_refused() {
    match Agent::new("mp-refused", AgentConfig::default()) {
        Ok(_) => println!("\n@created"),
        Err(e) => println!("\n@refused {:?} {}", e.status(), e.message()),
    }
}

#[test]
fn child_entry() {
    match std::env::var("GIXL_CHILD").as_deref() {
        Ok("mp-rank") => child_mp_rank(),
        Ok("mp-refused") => child_mp_refused(),
        Ok("tele-target") => child_target(),
        Ok("tele-initiator") => child_initiator(),
        Ok("file-sink") => child_file_sink(),
        _ => {}
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn spawn(kind: &str, env: &[(&str, String)]) -> (Child, BufReader<ChildStdout>) {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", kind)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c.spawn().unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    (child, out)
}

/// The value after `@key ` on the child's stdout.
fn expect(out: &mut BufReader<ChildStdout>, key: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "child exited before printing @{key}");
        if let Some(v) = line.trim_end().strip_prefix(&format!("@{key}")) {
            return v.trim().to_owned();
        }
    }
}

/// GET `path` from 127.0.0.1:`port`; the body.
fn http_get(port: u16, path: &str) -> Result<String, String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").map_err(|e| e.to_string())?;
    let mut r = String::new();
    s.read_to_string(&mut r).map_err(|e| e.to_string())?;
    let (head, body) = r.split_once("\r\n\r\n").ok_or("no HTTP header")?;
    if !head.starts_with("HTTP/1.") || head.split(' ').nth(1) != Some("200") {
        return Err(head.lines().next().unwrap_or("").to_owned());
    }
    Ok(body.to_owned())
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Ask Prometheus until `query` returns `want` (a positive signal: the scrape happened and says so).
fn until_prom(port: u16, query: &str, want: &str) {
    let t = Instant::now();
    let mut last = String::new();
    while t.elapsed() < Duration::from_secs(60) {
        if let Ok(body) = http_get(port, &format!("/api/v1/query?query={}", urlencode(query))) {
            if body.contains(&format!(",\"{want}\"]")) {
                eprintln!("prometheus: {query} = {want} after {:?}", t.elapsed());
                return;
            }
            last = body;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("Prometheus never answered {query} = {want}; last answer: {last}");
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("telemetry-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn prometheus_scrapes_nixl_metrics_from_two_processes() {
    let Some(bin) = ["/usr/bin/prometheus", "/usr/local/bin/prometheus"].into_iter().find(|p| Path::new(p).exists())
    else {
        skip("prometheus", "the Prometheus server is not installed (apt-get install prometheus)");
        return;
    };
    let (pt, pi, pp) = (free_port(), free_port(), free_port());
    let env = |port: u16| {
        vec![
            ("NIXL_TELEMETRY_ENABLE", "y".to_string()),
            ("NIXL_TELEMETRY_EXPORTER", "prometheus".to_string()),
            ("NIXL_TELEMETRY_PROMETHEUS_PORT", port.to_string()),
            ("NIXL_TELEMETRY_PROMETHEUS_LOCAL", "yes".to_string()),
        ]
    };
    let (target, mut tout) = spawn("tele-target", &env(pt));
    let target = Killed(target);
    let md = expect(&mut tout, "md");
    let addr = expect(&mut tout, "addr");
    let mut ienv = env(pi);
    ienv.push(("GIXL_MD", md));
    ienv.push(("GIXL_ADDR", addr));
    let (ini, mut iout) = spawn("tele-initiator", &ienv);
    let ini = Killed(ini);
    expect(&mut iout, "done");

    // The endpoint itself: NIXL's names, NIXL's default buckets.
    let text = http_get(pi, "/metrics").unwrap();
    for name in [
        "agent_tx_bytes_total",
        "agent_rx_bytes_total",
        "agent_tx_requests_num_total",
        "agent_rx_requests_num_total",
        "agent_memory_registered_total",
        "agent_memory_deregistered_total",
        "agent_xfer_time_total",
        "agent_xfer_post_time_total",
        "agent_telemetry_events_dropped_total",
        "agent_errors_total",
        "agent_tx_last_bytes",
        "agent_rx_last_bytes",
        "agent_memory_registered_last_bytes",
        "agent_memory_deregistered_last_bytes",
        "agent_xfer_time",
        "agent_xfer_post_time",
        "agent_xfer_time_us",
        "agent_xfer_post_time_us",
    ] {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing:\n{text}");
    }
    let les: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("agent_xfer_time_us_bucket{"))
        .filter_map(|l| l.split("le=\"").nth(1)?.split('"').next())
        .collect();
    assert_eq!(
        les,
        [
            "10", "25", "50", "100", "250", "500", "1000", "2500", "5000", "10000", "25000", "50000", "100000",
            "250000", "500000", "1000000", "5000000", "10000000", "+Inf"
        ]
    );

    // A real Prometheus scrapes both processes.
    let dir = tmpdir("prom");
    let cfg = dir.join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: gixl\n    \
             static_configs:\n      - targets: ['127.0.0.1:{pt}', '127.0.0.1:{pi}']\n"
        ),
    )
    .unwrap();
    let prom = Command::new(bin)
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{pp}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
        .spawn()
        .unwrap();
    let _prom = Killed(prom);
    let i = "agent_name=\"tele-initiator\"";
    until_prom(pp, "count(up{job=\"gixl\"} == 1)", "2");
    until_prom(pp, &format!("agent_tx_bytes_total{{{i}}}"), "12288");
    until_prom(pp, &format!("agent_rx_bytes_total{{{i}}}"), "16384");
    until_prom(pp, &format!("agent_tx_requests_num_total{{{i}}}"), "3");
    until_prom(pp, &format!("agent_rx_requests_num_total{{{i}}}"), "2");
    until_prom(pp, &format!("agent_rx_last_bytes{{{i}}}"), "8192");
    until_prom(pp, &format!("agent_xfer_time_us_count{{{i}}}"), "5");
    until_prom(pp, &format!("agent_xfer_post_time_us_bucket{{{i},le=\"+Inf\"}}"), "5");
    until_prom(pp, "agent_memory_registered_total{agent_name=\"tele-target\"}", "1048576");
    until_prom(pp, &format!("agent_errors_total{{{i},status=\"remote_disconnect\"}}"), "0");
    // gixl's own series: the stale request, the peer with its incarnation and route.
    until_prom(pp, &format!("gixl_stale_handle_refusals_total{{{i}}}"), "1");
    until_prom(pp, &format!("gixl_peer_connected{{{i},peer=\"tele-target\"}}"), "1");
    until_prom(
        pp,
        &format!("count(gixl_peer_info{{{i},peer=\"tele-target\",route=~\"cma|tcp-after-cma-denied\"}})"),
        "1",
    );

    // The target dies; the initiator's next post is a REMOTE_DISCONNECT, and Prometheus sees it.
    drop(target);
    let mut ini = ini;
    writeln!(ini.0.stdin.as_mut().unwrap(), "post").unwrap();
    ini.0.stdin.as_mut().unwrap().flush().unwrap();
    expect(&mut iout, "disconnected");
    until_prom(pp, &format!("gixl_peer_connected{{{i},peer=\"tele-target\"}}"), "0");
    until_prom(pp, &format!("gixl_peer_disconnects_total{{{i},peer=\"tele-target\"}}"), "1");
    until_prom(pp, &format!("agent_errors_total{{{i},status=\"remote_disconnect\"}}"), "1");
    until_prom(pp, &format!("agent_errors_total{{{i},status=\"not_found\"}}"), "1");
    drop(ini);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `tele.py N`: what `child_file_sink` does, on NIXL; waits until NIXL has flushed N events.
const NIXL_PROGRAM: &str = r#"
import os, struct, sys, time
import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config
cfg = lambda: nixl_agent_config(backends=["UCX"])
a, b = nixl_agent("A", cfg()), nixl_agent("B", cfg())
src = np.full(4096, 3, dtype=np.uint8); dst = np.zeros(4096, dtype=np.uint8)
a.register_memory([(src.ctypes.data, 4096, 0, "")], "DRAM")
b.register_memory([(dst.ctypes.data, 4096, 0, "")], "DRAM")
a.add_remote_agent(b.get_agent_metadata())
for _ in range(3):
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data, 4096, 0)], "DRAM"),
                          b.get_xfer_descs([(dst.ctypes.data, 4096, 0)], "DRAM"), "B")
    a.transfer(h)
    while a.check_xfer_state(h) != "DONE":
        time.sleep(0.001)
    a.release_xfer_handle(h)
path = os.path.join(os.environ["NIXL_TELEMETRY_DIR"], "A")
t = time.monotonic()
while time.monotonic() - t < 20:
    if os.path.exists(path) and struct.unpack_from("<Q", open(path, "rb").read(8))[0] >= int(sys.argv[1]):
        print("@written"); sys.exit(0)
    time.sleep(0.05)
sys.exit("NIXL did not flush its telemetry")
"#;

#[test]
fn file_sink_has_nixls_layout() {
    let dir = tmpdir("file");
    let gdir = dir.join("gixl");
    std::fs::create_dir_all(&gdir).unwrap();
    gixl_run(&gdir, "");
    let gfile = std::fs::read(gdir.join("A")).unwrap();
    let (version, events) = gixl::telemetry::file::read_events(&gdir.join("A")).unwrap();
    assert_eq!(version, 4);
    assert_eq!(gfile.len(), 40 + 4096 * 16, "NIXL's file for 4096 events is 65576 bytes");
    let types: Vec<u32> = events.iter().map(|e| e.0).collect();
    assert_eq!(types, [4, 7, 6, 0, 2, 7, 6, 0, 2, 7, 6, 0, 2], "registration, then per WRITE post/xfer/bytes/count");
    assert_eq!(events[0].1, 4096);
    assert!(events.iter().filter(|e| e.0 == 0).all(|e| e.1 == 4096));
    assert!(events.iter().filter(|e| e.0 == 2).all(|e| e.1 == 1));
    let (_, bevents) = gixl::telemetry::file::read_events(&gdir.join("B")).unwrap();
    assert_eq!(bevents, [(4, 4096)], "B registered 4 KiB and moved nothing");

    // The same program on NIXL 1.5.1: same header (after the positions), size, and event sequence.
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/nixl/bin/python");
    if !py.exists() {
        skip("nixl-oracle", "NIXL 1.5.1 is not installed in .venv/nixl (scripts/setup.sh installs it)");
        return;
    }
    let ndir = dir.join("nixl");
    std::fs::create_dir_all(&ndir).unwrap();
    let script = dir.join("tele.py");
    std::fs::write(&script, NIXL_PROGRAM).unwrap();
    let nixl = |dir: &Path, expect: usize, metrics: &str| {
        let out = Command::new(&py)
            .arg(&script)
            .arg(expect.to_string())
            .env("NIXL_TELEMETRY_ENABLE", "y")
            .env("NIXL_TELEMETRY_DIR", dir)
            .env("NIXL_TELEMETRY_ENABLED_METRICS", metrics)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("@written"),
            "NIXL run failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    nixl(&ndir, 13, "");
    let nfile = std::fs::read(ndir.join("A")).unwrap();
    assert_eq!(nfile.len(), gfile.len());
    assert_eq!(nfile[16..40], gfile[16..40], "header after the positions: version, expected version, capacity, mask");
    let (nversion, nevents) = gixl::telemetry::file::read_events(&ndir.join("A")).unwrap();
    assert_eq!(nversion, version);
    let ntypes: Vec<u32> = nevents.iter().map(|e| e.0).collect();
    assert_eq!(ntypes, types);
    let sizes = |ev: &[(u32, u64)]| ev.iter().filter(|e| [0, 2, 4].contains(&e.0)).copied().collect::<Vec<_>>();
    assert_eq!(sizes(&nevents), sizes(&events), "bytes and counts agree (times differ)");

    // NIXL_TELEMETRY_ENABLED_METRICS keeps the events its globs name, in both.
    let metrics = "agent_tx_*,agent_memory_registered";
    let (gsel, nsel) = (dir.join("gixl-selected"), dir.join("nixl-selected"));
    std::fs::create_dir_all(&gsel).unwrap();
    std::fs::create_dir_all(&nsel).unwrap();
    gixl_run(&gsel, metrics);
    nixl(&nsel, 7, metrics);
    let (_, g) = gixl::telemetry::file::read_events(&gsel.join("A")).unwrap();
    let (_, n) = gixl::telemetry::file::read_events(&nsel.join("A")).unwrap();
    assert_eq!(g, [(4, 4096), (0, 4096), (2, 1), (0, 4096), (2, 1), (0, 4096), (2, 1)]);
    assert_eq!(n, g);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `child_file_sink` with its telemetry file in `dir`.
fn gixl_run(dir: &Path, metrics: &str) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", "file-sink")
        .env("NIXL_TELEMETRY_ENABLE", "y")
        .env("NIXL_TELEMETRY_DIR", dir)
        .env("NIXL_TELEMETRY_ENABLED_METRICS", metrics)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The `agent_memory_registered_total` samples of an exposition: labels → value.
fn registered(text: &str) -> std::collections::BTreeMap<String, u64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("agent_memory_registered_total{"))
        .filter_map(|l| l.split_once("} "))
        .map(|(labels, v)| (labels.to_owned(), v.trim().parse().unwrap()))
        .collect()
}

/// Scrape until `ok(registered samples)` holds, up to 20 s; the last scrape.
fn scrape_until(port: u16, what: &str, ok: impl Fn(&std::collections::BTreeMap<String, u64>) -> bool) -> String {
    let t = Instant::now();
    let mut last = String::new();
    while t.elapsed() < Duration::from_secs(20) {
        match http_get(port, "/metrics") {
            Ok(text) if ok(&registered(&text)) => return text,
            Ok(text) => last = text,
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what}: not seen in 20 s; last scrape:\n{last}");
}

#[test]
fn prometheus_mp_serves_every_process_of_a_directory() {
    let dir = tmpdir("mp");
    let port = free_port();
    let env = |rank: usize, agents: usize| {
        vec![
            ("NIXL_TELEMETRY_ENABLE", "y".to_string()),
            ("NIXL_TELEMETRY_EXPORTER", "prometheus_mp".to_string()),
            ("NIXL_TELEMETRY_MULTIPROC_DIR", dir.display().to_string()),
            ("NIXL_TELEMETRY_PROMETHEUS_PORT", port.to_string()),
            ("NIXL_TELEMETRY_PROMETHEUS_LOCAL", "y".to_string()),
            ("NIXL_TELEMETRY_MP_STALE_TTL", "3".to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("GIXL_AGENTS", agents.to_string()),
        ]
    };
    let host = gixl::telemetry::hostname();
    let key = |rank: usize, k: usize, pid: &str| {
        format!("hostname=\"{host}\",agent_name=\"mp-r{rank}-{k}\",pid=\"{pid}\",agent_instance=\"{k}\",local_rank=\"{rank}\"")
    };
    // Rank 0 starts first and wins the lock; ranks 1 and 2 (two agents) only write.
    let (c0, mut o0) = spawn("mp-rank", &env(0, 1));
    let mut c0 = Killed(c0);
    let p0 = expect(&mut o0, "up");
    let (c1, mut o1) = spawn("mp-rank", &env(1, 1));
    let mut c1 = Killed(c1);
    let p1 = expect(&mut o1, "up");
    let (c2, mut o2) = spawn("mp-rank", &env(2, 2));
    let mut c2 = Killed(c2);
    let p2 = expect(&mut o2, "up");
    let want = [(key(0, 0, &p0), 4096), (key(1, 0, &p1), 8192), (key(2, 0, &p2), 12288), (key(2, 1, &p2), 12288)];
    let text = scrape_until(port, "all four agents", |r| r.len() == 4);
    let got = registered(&text);
    for (k, v) in &want {
        assert_eq!(got.get(k), Some(v), "{k}:\n{text}");
    }
    assert!(text.contains("# TYPE agent_xfer_time_us histogram") && !text.contains("gixl_peer_info"), "{text}");
    let lock = std::fs::read_to_string(dir.join(format!("nixl-owner.127.0.0.1:{port}.lock"))).unwrap();
    assert_eq!(lock.trim(), format!("127.0.0.1:{port} pid {p0}"), "rank 0 owns the endpoint");

    // A file of another user in the directory is not served (a co-tenant cannot inject series).
    let store2 = dir.join(format!("gixl.{p2}.0.store"));
    let planted = dir.join("gixl.999999.0.store");
    std::fs::copy(&store2, &planted).unwrap();
    let mut bytes = std::fs::read(&planted).unwrap();
    bytes[8..16].copy_from_slice(&999999u64.to_le_bytes());
    std::fs::write(&planted, &bytes).unwrap();
    if unsafe { libc::geteuid() } == 0 {
        std::os::unix::fs::chown(&planted, Some(65534), Some(65534)).unwrap();
        let text = http_get(port, "/metrics").unwrap();
        assert!(!text.contains("pid=\"999999\""), "a file of uid 65534 was served:\n{text}");
        assert_eq!(registered(&text).len(), 4);
    } else {
        skip("root", "chown to another uid needs root; the planted file was not tried");
    }
    std::fs::remove_file(&planted).unwrap();

    // A clean end: rank 2's agents go, their files and series with them.
    writeln!(c2.0.stdin.as_mut().unwrap(), "drop").unwrap();
    expect(&mut o2, "dropped");
    assert!(!store2.exists() && !dir.join(format!("gixl.{p2}.1.store")).exists());
    scrape_until(port, "rank 2 gone after a clean end", |r| r.len() == 2);

    // A crash: rank 1 is killed right after an event; its last values stay served while its store is
    // younger than the TTL (3 s), then the series and the file go.
    // (Its last update is after `touched_at`: both clocks are CLOCK_MONOTONIC.)
    let touched_at = Instant::now();
    writeln!(c1.0.stdin.as_mut().unwrap(), "touch").unwrap();
    expect(&mut o1, "touched");
    c1.0.kill().unwrap();
    c1.0.wait().unwrap();
    let text = http_get(port, "/metrics").unwrap();
    if touched_at.elapsed() < Duration::from_millis(2500) {
        assert_eq!(registered(&text).get(&key(1, 0, &p1)), Some(&12288), "a dead rank within the TTL:\n{text}");
    }
    scrape_until(port, "rank 1 reaped after the TTL", |r| r.len() == 1);
    assert!(touched_at.elapsed() >= Duration::from_secs(3), "reaped before the TTL ({:?})", touched_at.elapsed());
    assert!(!dir.join(format!("gixl.{p1}.0.store")).exists(), "the dead rank's file is removed");

    // The owner dies: no failover (the endpoint is down), until a new process takes the lock.
    c0.0.kill().unwrap();
    c0.0.wait().unwrap();
    assert!(http_get(port, "/metrics").is_err(), "the endpoint outlived its owner");
    let (c3, mut o3) = spawn("mp-rank", &env(3, 1));
    let _c3 = Killed(c3);
    let p3 = expect(&mut o3, "up");
    let text = scrape_until(port, "the new owner", |r| r.contains_key(&key(3, 0, &p3)));
    let lock = std::fs::read_to_string(dir.join(format!("nixl-owner.127.0.0.1:{port}.lock"))).unwrap();
    assert_eq!(lock.trim(), format!("127.0.0.1:{port} pid {p3}"), "{text}");

    // Refusals, as NIXL's: no directory; more than 32 histogram bounds.
    let mut no_dir = env(9, 1);
    no_dir.retain(|(k, _)| *k != "NIXL_TELEMETRY_MULTIPROC_DIR");
    let (c, mut o) = spawn("mp-refused", &no_dir);
    let _c = Killed(c);
    let r = expect(&mut o, "refused");
    assert!(r.starts_with("Backend") && r.contains("NIXL_TELEMETRY_MULTIPROC_DIR"), "{r}");
    let mut many = env(9, 1);
    let bounds: Vec<String> = (1..=33).map(|i| (i * 10).to_string()).collect();
    many.push(("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", bounds.join(",")));
    let (c, mut o) = spawn("mp-refused", &many);
    let _c = Killed(c);
    let r = expect(&mut o, "refused");
    assert!(r.starts_with("InvalidParam") && r.contains("32"), "{r}");
    let _ = std::fs::remove_dir_all(&dir);
}
