//! Helpers shared by the multi-host tests: hex, a clock shared by all processes, network namespaces
//! joined by a bridge, a throw-away etcd, and the one way a test says it could not run (`skip`).
#![allow(dead_code)]

pub mod dev;
pub mod fabric;
pub mod loopdev;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// A test (or part of one) that cannot run on this machine says so here, never by returning quietly:
/// `SKIPPED: <test> [<kind>]: <why>` on stderr (libtest shows it for passing tests only with `--nocapture`),
/// and the same line appended to the file named by `GIXL_SKIP_LOG` when set.
/// `scripts/test-all.sh` sets it, counts the lines per suite, and fails on CI (`CI=true`) when a test of
/// the must-run kinds (`netns`, `etcd`, `cma`, `io_uring`, `prometheus`, `libfabric`, `loopdev`, `sched`)
/// skipped. `kind` names what was missing.
pub fn skip(kind: &str, why: &str) {
    gixl::test_skip(kind, why);
}

/// This test binary where another user (a test's `nobody` child) can run it: a copy in a fresh directory under
/// /tmp that everyone may read and enter. The checkout itself may be private (a clone under `mktemp -d` is
/// mode 0700), and then `nobody` cannot exec the binary in place. The copy goes when this is dropped.
pub struct ExeForOthers {
    dir: std::path::PathBuf,
    pub path: std::path::PathBuf,
}

impl ExeForOthers {
    pub fn new() -> ExeForOthers {
        use std::os::unix::fs::PermissionsExt;
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let exe = std::env::current_exe().unwrap();
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("gixl-exe-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.join(exe.file_name().unwrap());
        // Copied by `cp`, not here: a child another thread of this process forks while we hold the copy open
        // for writing inherits that descriptor until it execs, and exec of the copy then fails with ETXTBSY.
        let cp = Command::new("cp").arg(&exe).arg(&path).status().unwrap();
        assert!(cp.success(), "cp {} {}: {cp}", exe.display(), path.display());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        ExeForOthers { dir, path }
    }
}

impl Drop for ExeForOthers {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Starts `c` (this test binary re-run as a child) with its stdin and stdout piped and reads its output up to
/// the line `@md <rest>`; returns the child, its stdin, its stdout and `<rest>`. The caller ends the child.
#[allow(clippy::zombie_processes)]
pub fn spawn_until_md(mut c: Command) -> (Child, ChildStdin, BufReader<ChildStdout>, String) {
    let mut child = c.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "child exited before printing metadata");
        if let Some(rest) = line.trim().strip_prefix("@md ") {
            let rest = rest.to_string();
            return (child, stdin, stdout, rest);
        }
    }
}

/// CLOCK_MONOTONIC in ns: the same clock in every process (and namespace) of this machine.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).stdin(Stdio::null()).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// `n` hosts (network namespaces) with `eth0` = 192.0.2.(i+1)/24, all plugged into one bridge that lives in
/// a namespace of its own. Everything is deleted on drop.
pub struct Net {
    names: Vec<String>,
    switch: String,
}

impl Net {
    /// None (after printing why) where namespaces cannot be created here.
    pub fn new(tag: &str, n: usize) -> Option<Net> {
        Net::with_rails(tag, n, 1)
    }

    /// As `new`, with `rails` links per host: host `i`'s `eth{r}` on bridge `br{r}` of the switch, addressed
    /// `rail_ip(r, i)` (rail 0 as `new` makes it).
    pub fn with_rails(tag: &str, n: usize, rails: usize) -> Option<Net> {
        let base = format!("gixl-t{}{tag}", std::process::id());
        let switch = format!("{base}-sw");
        let names: Vec<String> = (0..n).map(|i| format!("{base}-h{i}")).collect();
        if let Err(e) = ip(&["netns", "add", &switch]) {
            skip("netns", &format!("cannot create network namespaces here (needs root and iproute2): {e}"));
            return None;
        }
        // From here on, dropping `net` deletes whatever was created.
        let mut net = Net { names: Vec::new(), switch: switch.clone() };
        let setup = || -> Result<(), String> {
            for r in 0..rails {
                let br = format!("br{r}");
                ip(&["-n", &switch, "link", "add", &br, "type", "bridge"])?;
                ip(&["-n", &switch, "link", "set", &br, "up"])?;
            }
            Ok(())
        };
        if let Err(e) = setup() {
            skip("netns", &format!("cannot create a bridge in a namespace: {e}"));
            return None;
        }
        for (i, ns) in names.iter().enumerate() {
            let r = (|| -> Result<(), String> {
                ip(&["netns", "add", ns])?;
                net.names.push(ns.clone());
                for r in 0..rails {
                    let (port, eth, br) = (
                        if r == 0 { format!("p{i}") } else { format!("p{i}r{r}") },
                        format!("eth{r}"),
                        format!("br{r}"),
                    );
                    let addr = format!("{}/24", Net::rail_ip(r, i));
                    ip(&["-n", ns, "link", "add", &eth, "type", "veth", "peer", "name", &port, "netns", &switch])?;
                    ip(&["-n", &switch, "link", "set", &port, "master", &br])?;
                    ip(&["-n", &switch, "link", "set", &port, "up"])?;
                    ip(&["-n", ns, "addr", "add", &addr, "dev", &eth])?;
                    ip(&["-n", ns, "link", "set", &eth, "up"])?;
                }
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
                Ok(())
            })();
            if let Err(e) = r {
                skip("netns", &format!("cannot build the test network: {e}"));
                return None;
            }
        }
        // Wait until every host can reach the bridge (the links come up asynchronously).
        std::thread::sleep(Duration::from_millis(100));
        Some(net)
    }

    pub fn ns(&self, i: usize) -> String {
        self.names[i].clone()
    }

    pub fn ip(&self, i: usize) -> String {
        Net::rail_ip(0, i)
    }

    /// Host `i`'s address on rail `r`: 192.0.2.0/24 for rail 0, 198.51.100.0/24 for rail 1, then 10.r.0.0/24.
    pub fn rail_ip(r: usize, i: usize) -> String {
        match r {
            0 => format!("192.0.2.{}", i + 1),
            1 => format!("198.51.100.{}", i + 1),
            _ => format!("10.{r}.0.{}", i + 1),
        }
    }

    /// The bytes host `i`'s `eth{r}` sent and received so far.
    pub fn rail_bytes(&self, i: usize, r: usize) -> u64 {
        let read = |what: &str| -> u64 {
            let f = format!("/sys/class/net/eth{r}/statistics/{what}_bytes");
            let out = std::process::Command::new("ip").args(["netns", "exec", &self.names[i], "cat", &f]).output();
            out.ok().and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok()).unwrap_or(0)
        };
        read("rx") + read("tx")
    }

    /// Cut (or restore) host `i`'s cable: its end of the link goes down.
    pub fn link(&self, i: usize, up: bool) {
        ip(&["-n", &self.names[i], "link", "set", "eth0", if up { "up" } else { "down" }]).unwrap();
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.names.iter().chain(std::iter::once(&self.switch)) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// A throw-away etcd: in host `host` of `net` (listening on its address), or on a free loopback port.
pub struct Etcd {
    child: std::process::Child,
    dir: std::path::PathBuf,
    pub endpoint: String,
}

impl Etcd {
    /// None (after printing why) when the etcd binary is missing or does not start.
    pub fn start(at: Option<(&Net, usize)>) -> Option<Etcd> {
        let bin = ["/usr/bin/etcd", "/usr/local/bin/etcd"].into_iter().find(|p| std::path::Path::new(p).exists());
        let Some(bin) = bin else {
            skip("etcd", "etcd is not installed (apt-get install etcd-server)");
            return None;
        };
        let dir = std::env::temp_dir().join(format!("gixl-etcd-{}-{}", std::process::id(), now_ns()));
        let (host, client, peer) = match at {
            Some((net, h)) => (net.ip(h), 2379, 2380),
            None => {
                let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
                ("127.0.0.1".to_string(), free(), free())
            }
        };
        let endpoint = format!("http://{host}:{client}");
        let mut cmd = match at {
            Some((net, h)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &net.ns(h), bin]);
                c
            }
            None => Command::new(bin),
        };
        cmd.arg("--data-dir")
            .arg(&dir)
            .args(["--name", "gixl-test"])
            .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &format!("http://{host}:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://{host}:{peer}")])
            .args(["--initial-cluster", &format!("gixl-test=http://{host}:{peer}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                skip("etcd", &format!("cannot start etcd: {e}"));
                return None;
            }
        };
        let e = Etcd { child, dir, endpoint };
        // Ready when it answers a range request (through the namespace when it is in one).
        let t = Instant::now();
        loop {
            let ok = match at {
                None => etcd_keys(&e.endpoint).is_ok(),
                Some((net, _)) => e.keys_in(net, 0).is_ok(),
            };
            if ok {
                return Some(e);
            }
            if t.elapsed() > Duration::from_secs(20) {
                skip("etcd", "etcd did not become ready within 20 s");
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Every key in the store, read from host `from` of `net` (the test process is outside the network).
    pub fn keys_in(&self, net: &Net, from: usize) -> Result<Vec<String>, String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &net.ns(from)])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env("GIXL_CHILD", "etcd-keys")
            .env("GIXL_ETCD", &self.endpoint)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find_map(|l| l.find("@keys ").map(|i| &l[i + 6..]))
            .ok_or_else(|| format!("no answer: {text}"))?;
        if line == "ERR" {
            return Err("etcd not reachable".into());
        }
        Ok(line.split(' ').filter(|k| !k.is_empty()).map(|k| String::from_utf8(unhex(k)).unwrap()).collect())
    }

    pub fn keys(&self, net: &Net) -> Vec<String> {
        self.keys_in(net, 0).unwrap()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The child side of `Etcd::keys_in`.
pub fn etcd_keys_child() {
    let ep = std::env::var("GIXL_ETCD").unwrap();
    match etcd_keys(&ep) {
        Ok(keys) => println!("@keys {}", keys.iter().map(|k| hex(k.as_bytes())).collect::<Vec<_>>().join(" ")),
        Err(_) => println!("@keys ERR"),
    }
}

/// All keys, straight over etcd's JSON gateway.
pub fn etcd_keys(endpoint: &str) -> Result<Vec<String>, String> {
    let hostport = endpoint.trim_start_matches("http://");
    let mut s = TcpStream::connect(hostport).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // key "\0" with range_end "\0" means every key.
    let body = r#"{"key":"AA==","range_end":"AA==","keys_only":true}"#;
    write!(
        s,
        "POST /v3/kv/range HTTP/1.1\r\nHost: {hostport}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).map_err(|e| e.to_string())?;
    if !resp.starts_with("HTTP/1.1 200") {
        return Err(resp);
    }
    let mut keys = Vec::new();
    let mut rest = resp.as_str();
    while let Some(i) = rest.find("\"key\":\"") {
        rest = &rest[i + 7..];
        let end = rest.find('"').unwrap();
        keys.push(String::from_utf8(b64(&rest[..end])).unwrap());
        rest = &rest[end..];
    }
    Ok(keys)
}

fn b64(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes().filter(|&c| c != b'=') {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            _ => 63,
        } as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}

/// The route agent `me` reports for its peer `peer` (its telemetry row), empty where it has none.
pub fn route_of(me: &str, peer: &str) -> String {
    gixl::telemetry::live_agents()
        .into_iter()
        .filter(|(n, _, _)| n == me)
        .flat_map(|(_, _, rows)| rows)
        .find(|r| r.name == peer)
        .map(|r| r.route)
        .unwrap_or_default()
}
