//! `gixl doctor` against a real peer in three set-ups, each a separate process pair:
//! - same host: the peer is reached by cross-memory attach;
//! - two network namespaces (another "host"): TCP, with a measured READ;
//! - CMA denied (the doctor runs as `nobody`, the peer as root): the first READ is refused by the kernel,
//!   gixl falls back to TCP, and the doctor says so and why (the uids differ).
//!
//! Each report is kept in `target/tmp/doctor-<set-up>.json`. Needs root for the last two; skips otherwise.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};

use common::*;
use gixl::*;

fn child_target() {
    let a = Agent::new("doc-target", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let buf = vec![5u8; 4 << 20];
    let d = Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0);
    a.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }]), &[]).unwrap();
    let path = std::env::var("GIXL_MD_FILE").unwrap();
    std::fs::write(&path, a.local_md().unwrap()).unwrap();
    // Readable by the unprivileged doctor of the CMA-denied set-up.
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    println!("\n@ready");
    std::io::stdout().flush().unwrap();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}

fn child_doctor() {
    let md = std::fs::read(std::env::var("GIXL_MD_FILE").unwrap()).unwrap();
    let json = gixl::telemetry::doctor::report(Some(gixl::telemetry::doctor::PeerTarget::Md(md)));
    println!("\n@json {json}");
}

#[test]
fn child_entry() {
    match std::env::var("GIXL_CHILD").as_deref() {
        Ok("doc-target") => child_target(),
        Ok("doctor") => child_doctor(),
        Ok("doctor-alone") => println!("\n@json {}", gixl::telemetry::doctor::report(None)),
        _ => {}
    }
}

fn cmd(exe: &std::path::Path, ns: Option<&str>, kind: &str, md: &PathBuf) -> Command {
    let mut c = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", kind)
        .env("GIXL_MD_FILE", md)
        .stdout(Stdio::piped());
    c
}

fn line(out: &mut BufReader<ChildStdout>, key: &str) -> Option<String> {
    let mut l = String::new();
    loop {
        l.clear();
        if out.read_line(&mut l).ok()? == 0 {
            return None;
        }
        if let Some(v) = l.trim_end().strip_prefix(&format!("@{key}")) {
            return Some(v.trim().to_owned());
        }
    }
}

struct Target(Child);
impl Drop for Target {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

/// The target in `tns`, the doctor in `dns` (as `uid` when given); the doctor's JSON.
fn run(setup: &str, tns: Option<&str>, dns: Option<&str>, uid: Option<u32>) -> Option<String> {
    let md = PathBuf::from("/tmp").join(format!("gixl-doctor-{}-{setup}.md", std::process::id()));
    let mut t = cmd(&std::env::current_exe().unwrap(), tns, "doc-target", &md).stdin(Stdio::piped()).spawn().unwrap();
    let mut tout = BufReader::new(t.stdout.take().unwrap());
    let target = Target(t);
    assert!(line(&mut tout, "ready").is_some(), "the target did not start");
    // Another user runs a copy it can reach (the checkout may be private).
    let exe = uid.map(|_| common::ExeForOthers::new());
    let mut d = match &exe {
        Some(e) => cmd(&e.path, dns, "doctor", &md),
        None => cmd(&std::env::current_exe().unwrap(), dns, "doctor", &md),
    };
    if let Some(u) = uid {
        d.uid(u).gid(u);
    }
    let mut d = d.spawn().unwrap();
    let mut dout = BufReader::new(d.stdout.take().unwrap());
    let json = line(&mut dout, "json");
    let status = d.wait().unwrap();
    drop(target);
    let _ = std::fs::remove_file(&md);
    if json.is_none() && uid.is_some() {
        skip("cma", &format!("the doctor could not run as uid {} ({status})", uid.unwrap_or(0)));
        return None;
    }
    assert!(status.success(), "doctor failed: {status}");
    let json = json.unwrap();
    let keep = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("doctor-{setup}.json"));
    std::fs::write(&keep, &json).unwrap();
    eprintln!("doctor ({setup}): {json}");
    Some(json)
}

fn field<'a>(json: &'a str, key: &str) -> &'a str {
    let k = format!("\"{key}\":\"");
    let i = json.find(&k).unwrap_or_else(|| panic!("no {key} in {json}")) + k.len();
    &json[i..i + json[i..].find('"').unwrap()]
}

fn peer(json: &str) -> &str {
    &json[json.find("\"peer\":{").expect("no peer section")..]
}

#[test]
fn doctor_same_host() {
    let j = run("same-host", None, None, None).unwrap();
    let p = peer(&j);
    assert!(p.contains("\"ok\":true"), "{p}");
    assert_eq!(field(p, "name"), "doc-target");
    let cma_works = j.contains("\"cma\":{\"works\":true");
    assert_eq!(field(p, "route"), if cma_works { "cma" } else { "tcp-after-cma-denied" }, "{p}");
    assert!(p.contains("\"gb_per_s\":"), "the READ probe ran: {p}");
    // The summary leads: the route per kind of peer agrees with the details.
    let s = &j[j.find("\"summary\":").expect("a summary")..j.find("\"routes\":{").expect("details")];
    let same_host = &s[s.find("\"peer\":\"same host\"").expect("same host")..];
    assert_eq!(field(same_host, "route"), if cma_works { "cma" } else { "tcp" }, "{s}");
}

#[test]
fn doctor_across_network_namespaces() {
    let Some(net) = Net::new("d", 2) else { return };
    let j = run("netns", Some(&net.ns(0)), Some(&net.ns(1)), None).unwrap();
    let p = peer(&j);
    assert_eq!(field(p, "route"), "tcp", "{p}");
    assert!(field(p, "why").contains("another host"), "{p}");
    assert!(p.contains("\"gb_per_s\":"), "the READ probe ran over TCP: {p}");
}

#[test]
fn doctor_with_cma_denied() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip("cma", "needs root to run the doctor as another user");
        return;
    }
    let Some(j) = run("cma-denied", None, None, Some(65534)) else { return };
    let p = peer(&j);
    // The CMA gate is fetched from the peer with pidfd_getfd when it is loaded, which the kernel refuses
    // across users just as it refuses process_vm_*: the fall-back is known at load, before any transfer.
    assert_eq!(field(p, "route_at_load"), "tcp-after-cma-denied", "{p}");
    assert_eq!(field(p, "route"), "tcp-after-cma-denied", "{p}");
    let why = field(p, "why");
    assert!(why.contains("uid is 0, ours 65534") && why.contains("fell back to TCP"), "{why}");
    assert!(p.contains("\"gb_per_s\":"), "the READ succeeded over TCP: {p}");
}

/// Over the fake RDMA fabric with one device that answers no one-sided request: the doctor runs each port's
/// self-test, shows both results (the failed step and why), and uses only the port that passed.
#[test]
fn doctor_shows_each_rdma_ports_self_test_and_uses_only_those_that_passed() {
    let exe = std::env::current_exe().unwrap();
    let dir = std::env::temp_dir().join(format!("gixl-doctor-fv-{}", std::process::id()));
    let out = cmd(&exe, None, "doctor-alone", &dir.join("unused"))
        .env("GIXL_FAKE_VERBS", "2")
        .env("GIXL_FAKE_VERBS_DIR", &dir)
        .env("GIXL_FAKE_VERBS_NO_RMA", "fake1")
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = stdout.lines().find_map(|l| l.find("@json ").map(|i| &l[i + 6..])).expect("no report");
    let rdma = &json[json.find("\"rdma\":").unwrap()..];
    let tests = &rdma[rdma.find("\"self_tests\":").unwrap()..];
    let tests = &tests[..tests.find(']').unwrap()];
    assert!(tests.contains("\"device\":\"fake0:1 (fake)\",\"passed\":true"), "{tests}");
    assert!(tests.contains("\"device\":\"fake1:1 (fake)\",\"passed\":false"), "{tests}");
    assert!(tests.contains("\"step\":\"write\"") && tests.contains("RemoteOp"), "{tests}");
    let summary = &json[json.find("\"summary\":").unwrap()..];
    assert!(summary.contains("\"device\":\"RDMA port fake0:1 Ethernet\",\"used\":true"), "{summary}");
    assert!(summary.contains("\"device\":\"RDMA port fake1:1 Ethernet\",\"used\":false"), "{summary}");
    // The failure was also one WARN line naming the port, the step and the fallback.
    let stderr = String::from_utf8_lossy(&out.stderr);
    let warned = stderr.lines().filter(|l| l.contains("RDMA port self-test: fake1:1 (fake): failed at write")).count();
    assert_eq!(warned, 1, "{stderr}");
    assert!(stderr.contains("peers it would reach go over TCP"), "{stderr}");
}
