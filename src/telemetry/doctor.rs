//! `gixl doctor`: which routes work on this host and, given a peer, to that peer; which one gixl picks and
//! why; versions; the agents of this process with their loaded peers. It opens with a summary (`summary`):
//! the route each kind of peer gets and each device (NIC ports, TCP, GPU, io_uring) with why it is or is
//! not used, the answer to "why is my transfer slow, why is it not using my NIC". The report is JSON (C:
//! `gixl_doctor`, Python: `gixl.doctor()`; `python -m gixl doctor` prints it for people).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::agent::{Agent, AgentConfig, XferOpts};
use crate::backend::{Params, XferOp};
use crate::mem::{Desc, MemType, RegDList, RegDesc, XferDList};
use crate::status::Status;

/// A tiny JSON value, enough for the report.
pub enum J {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(&'static str, J)>),
}

impl J {
    fn s(v: impl Into<String>) -> J {
        J::Str(v.into())
    }
    pub fn write(&self, o: &mut String) {
        match self {
            J::Null => o.push_str("null"),
            J::Bool(b) => o.push_str(if *b { "true" } else { "false" }),
            J::Num(x) if x.is_finite() => {
                if x.fract() == 0.0 && x.abs() < 1e15 {
                    let _ = write!(o, "{}", *x as i64);
                } else {
                    let t = format!("{x:.6}");
                    o.push_str(t.trim_end_matches('0'));
                }
            }
            J::Num(_) => o.push_str("null"),
            J::Str(s) => {
                o.push('"');
                for c in s.chars() {
                    match c {
                        '"' => o.push_str("\\\""),
                        '\\' => o.push_str("\\\\"),
                        '\n' => o.push_str("\\n"),
                        c if (c as u32) < 0x20 => {
                            let _ = write!(o, "\\u{:04x}", c as u32);
                        }
                        c => o.push(c),
                    }
                }
                o.push('"');
            }
            J::Arr(v) => {
                o.push('[');
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        o.push(',');
                    }
                    x.write(o);
                }
                o.push(']');
            }
            J::Obj(v) => {
                o.push('{');
                for (i, (k, x)) in v.iter().enumerate() {
                    if i > 0 {
                        o.push(',');
                    }
                    J::s(*k).write(o);
                    o.push(':');
                    x.write(o);
                }
                o.push('}');
            }
        }
    }
}

/// Who to check besides this host.
pub enum PeerTarget {
    /// A peer's metadata blob (`get_agent_metadata()` written to a file).
    Md(Vec<u8>),
    /// A peer's metadata listener: its agent name, address and port.
    Listener { name: String, ip: String, port: u16 },
}

fn read(p: &str) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned())
}

fn status_field(pid: &str, key: &str) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_owned()))
}

fn uid_of(pid: &str) -> Option<u32> {
    status_field(pid, "Uid:")?.split_whitespace().nth(1)?.parse().ok()
}

fn has_cap_sys_ptrace() -> bool {
    status_field("self", "CapEff:").and_then(|h| u64::from_str_radix(&h, 16).ok()).is_some_and(|c| c & (1 << 19) != 0)
}

/// Cross-memory attach on this process itself: catches seccomp filters and kernels without it.
fn cma_self_probe() -> Result<(), std::io::Error> {
    let src = [7u8; 8];
    let mut dst = [0u8; 8];
    let l = libc::iovec { iov_base: dst.as_mut_ptr().cast(), iov_len: 8 };
    let r = libc::iovec { iov_base: src.as_ptr() as *mut libc::c_void, iov_len: 8 };
    // SAFETY: both iovecs describe live buffers of this process of the stated length.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &l, 1, &r, 1, 0) };
    if n == 8 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What this host allows cross-memory attach between two unrelated processes, with the reasons.
fn cma_host() -> (bool, Vec<String>, J) {
    let yama = read("/proc/sys/kernel/yama/ptrace_scope").and_then(|v| v.parse::<i32>().ok());
    let seccomp = status_field("self", "Seccomp:");
    let cap = has_cap_sys_ptrace();
    let probe = cma_self_probe();
    let mut why = Vec::new();
    let mut ok = true;
    if let Err(e) = &probe {
        ok = false;
        why.push(format!("process_vm_readv on this process fails ({e}): a seccomp filter or a kernel without it"));
    }
    match yama {
        Some(1) if !cap => {
            ok = false;
            why.push(
                "Yama ptrace_scope=1: only a parent may attach to its descendants (peers are not), unless \
                 CAP_SYS_PTRACE"
                    .into(),
            );
        }
        Some(2) if !cap => {
            ok = false;
            why.push("Yama ptrace_scope=2: only processes with CAP_SYS_PTRACE may attach".into());
        }
        Some(3) => {
            ok = false;
            why.push("Yama ptrace_scope=3: no process may attach".into());
        }
        _ => {}
    }
    if seccomp.as_deref().is_some_and(|s| s != "0") && probe.is_ok() {
        why.push(format!(
            "seccomp mode {} is active here, but it lets process_vm_readv through",
            seccomp.as_deref().unwrap_or("?")
        ));
    }
    if ok {
        why.push(if cap {
            "allowed: CAP_SYS_PTRACE, so also to processes of other users".into()
        } else {
            "allowed between processes of the same uid in the same pid namespace (other uids: denied)".into()
        });
    }
    let detail = J::Obj(vec![
        ("yama_ptrace_scope", yama.map_or(J::Null, |v| J::Num(v as f64))),
        ("seccomp_mode", seccomp.map_or(J::Null, J::s)),
        ("cap_sys_ptrace", J::Bool(cap)),
        (
            "self_probe",
            J::s(match &probe {
                Ok(()) => "ok".to_owned(),
                Err(e) => e.to_string(),
            }),
        ),
    ]);
    (ok, why, detail)
}

fn rdma_devices() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn libcuda() -> Result<(), String> {
    let name = c"libcuda.so.1";
    // SAFETY: dlopen with a NUL-terminated name; the handle is closed at once.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a thread-local message or NULL.
        let e = unsafe { libc::dlerror() };
        let msg = if e.is_null() {
            "not found".to_owned()
        } else {
            // SAFETY: non-NULL dlerror strings are NUL-terminated.
            unsafe { std::ffi::CStr::from_ptr(e) }.to_string_lossy().into_owned()
        };
        return Err(msg);
    }
    // SAFETY: a handle dlopen just returned.
    unsafe { libc::dlclose(h) };
    Ok(())
}

/// libfabric: found or not (where from, or why not), its devices (provider/domain) and the self-tests this
/// process ran. `works`: a device passed its self-test in this process (the route uses only those).
fn libfabric_j() -> J {
    let lib = crate::fabric::sys::lib();
    let (found, library, version, api) = match &lib {
        Ok(l) => {
            (true, l.path.clone(), format!("{}.{}", l.version().0, l.version().1), format!("1.{}", l.api & 0xffff))
        }
        Err(e) => (false, e.message().to_owned(), String::new(), String::new()),
    };
    let all = lib.and_then(|_| crate::fabric::devices(None, None)).unwrap_or_default();
    let devices = all.iter().map(|d| J::s(format!("{}/{}", d.provider(), d.domain()))).collect();
    let fabric: Vec<String> = all.iter().map(|d| d.provider()).filter(|p| !crate::fabric::is_sockets(p)).collect();
    let records = crate::fabric::selftest::records();
    let works = records.iter().any(|r| r.passed);
    let why = format!(
        "the libfabric route takes a peer that advertises an endpoint of this engine's provider once the device \
         passed its self-test (a one-sided WRITE and READ between two regions of this process through the device, on \
         the engine's endpoint, started in the background once it opens; a failure is one WARN line and the peer \
         goes over TCP); providers that are not sockets or \
         shared memory on their own (here: {}), tcp/udp/sockets/shm only with GIXL_TRANSPORT=fabric and \
         GIXL_FABRIC_PROVIDER (or FI_PROVIDER); GIXL_LIBFABRIC names the library. GPU memory goes through \
         FI_HMEM on rails whose provider offers it, as a dma-buf where the library takes one (API 1.20) and that \
         way's GPU-memory self-test passed, else by its interface where that way's passed (run at the first VRAM \
         registration; listed as '<device> (GPU memory, dma-buf)' and '<device> (GPU memory)'), else it is staged \
         over TCP",
        if fabric.is_empty() { "none".to_owned() } else { fabric.join(", ") }
    );
    let tests = records.into_iter().map(|r| self_test_j(r.device, r.passed, r.ms, r.step, r.error)).collect();
    J::Obj(vec![
        ("works", J::Bool(works)),
        ("found", J::Bool(found)),
        ("library", J::s(library)),
        ("version", J::s(version)),
        ("api", J::s(api)),
        ("devices", J::Arr(devices)),
        ("self_tests", J::Arr(tests)),
        ("why", J::s(why)),
    ])
}

/// One device's self-test for the report.
fn self_test_j(device: String, passed: bool, ms: f64, step: Option<&'static str>, error: Option<String>) -> J {
    J::Obj(vec![
        ("device", J::s(device)),
        ("passed", J::Bool(passed)),
        ("ms", J::Num((ms * 10.0).round() / 10.0)),
        ("step", step.map_or(J::Null, J::s)),
        ("error", error.map_or(J::Null, J::s)),
    ])
}

fn kernel() -> String {
    read("/proc/sys/kernel/osrelease").unwrap_or_default()
}

/// The whole report, as JSON.
pub fn report(peer: Option<PeerTarget>) -> String {
    let (cma_ok, cma_why, cma_detail) = cma_host();
    let host_id = crate::util::host_id();
    let mut parts = host_id.split('|');
    let (boot, pidns, netns) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let rdma = rdma_devices();
    let cuda = libcuda();
    let device = crate::device::get();
    // SAFETY: getuid/geteuid have no preconditions.
    let (uid, euid) = unsafe { (libc::getuid(), libc::geteuid()) };
    let agents = super::live_agents()
        .into_iter()
        .map(|(name, inc, peers)| {
            J::Obj(vec![
                ("name", J::s(name)),
                ("incarnation", J::s(format!("{inc:032x}"))),
                (
                    "remotes",
                    J::Arr(
                        peers
                            .into_iter()
                            .map(|p| {
                                J::Obj(vec![
                                    ("name", J::s(p.name)),
                                    ("incarnation", J::s(format!("{:032x}", p.incarnation))),
                                    ("route", J::s(p.route)),
                                    ("connected", J::Bool(p.connected)),
                                ])
                            })
                            .collect(),
                    ),
                ),
            ])
        })
        .collect();
    let transport = std::env::var("GIXL_TRANSPORT").unwrap_or_else(|_| "auto".into());
    // The RDMA route runs where the fabric has an active port that passed its self-test.
    let verbs = crate::verbs::fabric();
    let fabric = match &verbs {
        Ok(f) => f.ports().map(|ports| (f.name(), ports)),
        Err(e) => Err(crate::status::Error::new(e.status(), e.message().to_owned())),
    };
    let rdma_ports: Vec<J> = fabric.as_ref().map_or(Vec::new(), |(_, ports)| {
        ports
            .iter()
            .map(|p| {
                let numa = p.numa.map_or(String::new(), |n| format!(" numa {n}"));
                let pci = p.pci.as_deref().map_or(String::new(), |c| format!(" pci {c}"));
                J::s(format!(
                    "{}:{} {:?} {}{numa}{pci}",
                    p.device,
                    p.port,
                    p.link,
                    if p.active { "active" } else { "down" }
                ))
            })
            .collect()
    });
    // Each active port's self-test (run now where this process has not run it yet): only a port that passed
    // is used.
    let rdma_tests: Vec<crate::verbs::selftest::Record> = match (&verbs, &fabric) {
        (Ok(f), Ok((_, ports))) => {
            ports.iter().filter(|p| p.active).map(|p| (*crate::verbs::selftest::cached(&**f, p)).clone()).collect()
        }
        _ => Vec::new(),
    };
    let passed = rdma_tests.iter().filter(|t| t.passed).count();
    let port_tests: Vec<(String, bool, String)> =
        rdma_tests.iter().map(|r| (r.device.clone(), r.passed, r.to_string())).collect();
    let (rdma_works, rdma_why) = match &fabric {
        Ok((name, ports)) if ports.iter().any(|p| p.active) => {
            let what = if *name == "fake" { "the fake RDMA fabric (GIXL_FAKE_VERBS, for tests)" } else { "rdma-core" };
            match passed {
                0 => (false, format!("{what}: no port passed its self-test: peers go over TCP")),
                n => (
                    true,
                    format!(
                        "{what}: {n} of {} active port(s) passed their self-tests: peers with a port on their fabric \
                         (another host; this one with GIXL_TRANSPORT=rdma) are reached over RDMA",
                        rdma_tests.len()
                    ),
                ),
            }
        }
        Ok(_) => (false, "no active RDMA port: peers go over TCP".to_owned()),
        Err(e) => (false, format!("{}: peers go over TCP", e.message())),
    };
    let rdma_tests: Vec<J> = rdma_tests
        .into_iter()
        .map(|r| self_test_j(format!("{} ({})", r.device, r.fabric), r.passed, r.ms, r.step, r.error))
        .collect();
    let libfabric = libfabric_j();
    // NVIDIA's peer-memory module (or its older out-of-tree name): what a plain registration of device memory
    // needs where dma-buf is not available.
    let peer_memory = ["/sys/module/nvidia_peermem", "/sys/module/nv_peer_mem"].iter().any(|p| Path::new(p).exists());
    let routes = J::Obj(vec![
        ("in_process", J::Obj(vec![("works", J::Bool(true)), ("why", J::s("agents of one process copy with memcpy"))])),
        ("cma", J::Obj(vec![("works", J::Bool(cma_ok)), ("why", J::s(cma_why.join("; "))), ("checks", cma_detail)])),
        (
            "tcp",
            J::Obj(vec![
                ("works", J::Bool(true)),
                ("why", J::s("peers in another host, pid or network namespace; and CMA fall-back")),
            ]),
        ),
        (
            "rdma",
            J::Obj(vec![
                ("works", J::Bool(rdma_works)),
                ("devices", J::Arr(rdma.iter().map(|d| J::s(d.clone())).collect())),
                ("ports", J::Arr(rdma_ports)),
                ("self_tests", J::Arr(rdma_tests)),
                ("why", J::s(rdma_why.clone())),
                (
                    "gpu_direct",
                    J::Obj(vec![
                        ("peer_memory_module", J::Bool(peer_memory)),
                        (
                            "how",
                            J::s(
                                "each VRAM region is registered with the NIC at registration through a dma-buf of \
                                 it (CUDA 11.7+ driver, dma-buf capable GPU and NIC driver), else as peer memory \
                                 (needs the peer-memory module), else RDMA peers' requests on it are staged through \
                                 host memory over TCP; the log says which, per region",
                            ),
                        ),
                    ]),
                ),
            ]),
        ),
        ("libfabric", libfabric),
        (
            "cuda",
            J::Obj(vec![
                ("works", J::Bool(device.is_ok())),
                ("layer", J::s(device.as_ref().map_or("none", |d| d.kind()))),
                (
                    "libcuda",
                    J::s(match &cuda {
                        Ok(()) => "loadable".to_owned(),
                        Err(e) => format!("not loadable: {e}"),
                    }),
                ),
                ("ipc", J::Bool(device.is_ok())),
                (
                    "why",
                    J::s(match &device {
                        Ok(d) if d.kind() == "fake" => {
                            "the fake device layer (GIXL_FAKE_DEVICE=1, for tests): VRAM emulated in shared host memory"
                                .to_owned()
                        }
                        Ok(_) => "VRAM through the CUDA driver: device copies within a process, CUDA IPC handles \
                                  (legacy, VMM POSIX fd, fabric) between processes of this host, staged through \
                                  pinned buffers over TCP between hosts"
                            .to_owned(),
                        Err(e) => format!("VRAM registration fails here: {}", e.message()),
                    }),
                ),
            ]),
        ),
    ]);
    let pick = if transport == "tcp" {
        "tcp for every peer (GIXL_TRANSPORT=tcp)".to_owned()
    } else if transport == "fabric" || transport == "libfabric" {
        "libfabric for every peer that advertises an endpoint of this engine's provider once its device passed its \
         self-test (GIXL_TRANSPORT=fabric), tcp for the others"
            .to_owned()
    } else if transport == "rdma" && rdma_works {
        "rdma for every peer with a port on this fabric (GIXL_TRANSPORT=rdma), tcp for the others".to_owned()
    } else if cma_ok {
        "in-process for agents of this process; cma for peers on this host in this pid namespace; tcp otherwise"
            .to_owned()
    } else {
        "in-process for agents of this process; tcp for all others (cma is denied here: the first transfer to a \
         peer on this host tries cma and falls back, with a warning)"
            .to_owned()
    };
    let pick = if rdma_works && transport != "tcp" && transport != "rdma" {
        format!("{pick} (rdma instead of tcp for peers on another host with a port on this fabric)")
    } else {
        pick
    };
    let summary = summary(&Facts {
        transport: &transport,
        cma_ok,
        cma_why: &cma_why,
        rdma_works,
        rdma_why: &rdma_why,
        rdma_devices: &rdma,
        ports: fabric.as_ref().map_or(Vec::new(), |(_, ports)| {
            ports
                .iter()
                .map(|p| {
                    let name = format!("{}:{}", p.device, p.port);
                    let test = port_tests.iter().find(|t| t.0 == name).map(|t| (t.1, t.2.clone()));
                    (format!("{name} {:?}", p.link), p.active, test)
                })
                .collect()
        }),
        vram: device.as_ref().map(|d| d.kind()).map_err(|e| e.message().to_owned()),
        libcuda: cuda.clone(),
        peer_memory,
        io_uring: crate::backend::posix::io_uring_available().map_err(|e| e.to_string()),
        gds_staged: crate::backend::gds::staged_reason(),
    });
    let peer_j = peer.map(|p| peer_report(p, cma_ok, uid));
    let mut top = vec![
        (
            "versions",
            J::Obj(vec![
                ("gixl", J::s(crate::VERSION)),
                ("nixl_api", J::s(crate::NIXL_API_VERSION)),
                (
                    "features",
                    J::Arr(
                        [
                            ("capi", cfg!(feature = "capi")),
                            ("rdma", cfg!(feature = "rdma")),
                            ("cuda", cfg!(feature = "cuda")),
                        ]
                        .iter()
                        .filter(|(_, on)| *on)
                        .map(|(n, _)| J::s(*n))
                        .collect(),
                    ),
                ),
            ]),
        ),
        (
            "host",
            J::Obj(vec![
                ("hostname", J::s(super::hostname())),
                ("kernel", J::s(kernel())),
                ("pid", J::Num(std::process::id() as f64)),
                ("uid", J::Num(uid as f64)),
                ("euid", J::Num(euid as f64)),
                ("boot_id", J::s(boot)),
                ("pid_ns", J::s(pidns)),
                ("net_ns", J::s(netns)),
            ]),
        ),
        ("summary", summary),
        ("transport", J::s(transport)),
        ("routes", routes),
        ("route_choice", J::s(pick)),
        ("agents", J::Arr(agents)),
    ];
    if let Some(p) = peer_j {
        top.push(("peer", p));
    }
    let mut o = String::new();
    J::Obj(top).write(&mut o);
    o
}

/// What the summary is made from: the host's findings, already gathered by `report`.
struct Facts<'a> {
    transport: &'a str,
    cma_ok: bool,
    cma_why: &'a [String],
    rdma_works: bool,
    rdma_why: &'a str,
    rdma_devices: &'a [String],
    /// The RDMA ports the verbs layer sees ("dev:port link"), whether each is active, and its self-test (passed,
    /// what it said) where it ran.
    ports: Vec<(String, bool, Option<PortTest>)>,
    /// The device layer ("cuda", "fake"), or why VRAM registration fails.
    vram: Result<&'static str, String>,
    libcuda: Result<(), String>,
    peer_memory: bool,
    io_uring: Result<(), String>,
    /// Why the GDS backends stage VRAM <-> FILE through host memory; None when they use cuFile.
    gds_staged: Option<&'static str>,
}

/// A port's self-test for the summary: passed, and what it said.
type PortTest = (bool, String);

/// The answer to "why is my transfer slow, why is it not using my NIC", first in the report: the route each
/// kind of peer gets (`routes`: peer, route, why) and each device with whether gixl uses it (`devices`:
/// device, used, why). Everything in it is also in the details (`routes`, `route_choice`).
fn summary(f: &Facts) -> J {
    let route = |peer: &str, route: &str, why: String| {
        J::Obj(vec![("peer", J::s(peer)), ("route", J::s(route)), ("why", J::s(why))])
    };
    let forced_tcp = f.transport == "tcp";
    let rdma_here = f.rdma_works && !forced_tcp;
    let conns = std::env::var("GIXL_TCP_CONNS").unwrap_or_else(|_| "4".into());
    let tcp_why = format!("{conns} data connections per peer (GIXL_TCP_CONNS)");
    let mut routes = vec![route("same process", "in-process", "memcpy between agents of this process".to_owned())];
    let forced_fabric = f.transport == "fabric" || f.transport == "libfabric";
    let fabric_why = "GIXL_TRANSPORT=fabric: peers that advertise an endpoint of this engine's libfabric provider \
                      (GIXL_FABRIC_PROVIDER), once its device passed its self-test (tcp for the others)";
    routes.push(if forced_tcp {
        route("same host", "tcp", format!("GIXL_TRANSPORT=tcp asks for TCP to every peer; {tcp_why}"))
    } else if forced_fabric {
        route("same host", "libfabric", fabric_why.into())
    } else if f.transport == "rdma" && f.rdma_works {
        route("same host", "rdma", "GIXL_TRANSPORT=rdma: peers with a port on this fabric (tcp for the others)".into())
    } else if f.cma_ok {
        route(
            "same host",
            "cma",
            format!(
                "cross-memory attach, one copy by the kernel, no socket; {} (tcp for a peer in another pid \
                 namespace or one the kernel refuses, said in the log)",
                f.cma_why.last().map_or("", String::as_str)
            ),
        )
    } else {
        route("same host", "tcp", format!("cross-memory attach is denied here: {}", f.cma_why.join("; ")))
    });
    routes.push(if forced_tcp {
        route("other host", "tcp", format!("GIXL_TRANSPORT=tcp; {tcp_why}"))
    } else if forced_fabric {
        route("other host", "libfabric", fabric_why.into())
    } else if rdma_here {
        route("other host", "rdma", format!("{} (tcp for peers without a port on this fabric)", f.rdma_why))
    } else {
        route("other host", "tcp", format!("{}; {tcp_why}", f.rdma_why))
    });
    routes.push(match &f.vram {
        Ok(kind) => route(
            "VRAM",
            "device copies / IPC handles / staged",
            format!(
                "{} device layer: device copies in a process, CUDA IPC handles on this host, {} to other hosts",
                kind,
                if rdma_here {
                    "the NIC straight to GPU memory over RDMA where it reaches it (dma-buf or peer memory), else staged"
                } else if forced_fabric {
                    "libfabric straight to GPU memory through FI_HMEM on rails that passed their GPU-memory \
                     self-test, else staged through pinned host buffers over TCP"
                } else {
                    "staged through pinned host buffers over TCP"
                }
            ),
        ),
        Err(e) => route("VRAM", "none", format!("VRAM registration fails here: {e}")),
    });
    let dev = |device: String, used: bool, why: String| {
        J::Obj(vec![("device", J::s(device)), ("used", J::Bool(used)), ("why", J::s(why))])
    };
    let mut devices = Vec::new();
    for (port, active, test) in &f.ports {
        let forced = f.transport == "rdma";
        let used = rdma_here && *active && (forced || test.as_ref().is_some_and(|t| t.0));
        let why = if !*active {
            "the port is down".to_owned()
        } else if forced_tcp {
            "GIXL_TRANSPORT=tcp".to_owned()
        } else {
            match test {
                Some((true, said)) => format!("self-test {said}"),
                Some((false, said)) if forced => format!("GIXL_TRANSPORT=rdma uses it although its self-test {said}"),
                Some((false, said)) => format!("self-test {said}: peers it would reach go over TCP"),
                None => f.rdma_why.to_owned(),
            }
        };
        devices.push(dev(format!("RDMA port {port}"), used, why));
    }
    if f.ports.is_empty() {
        let listed = if f.rdma_devices.is_empty() {
            "none in /sys/class/infiniband".to_owned()
        } else {
            format!("{} in /sys/class/infiniband", f.rdma_devices.join(", "))
        };
        devices.push(dev("RDMA NIC".to_owned(), false, format!("{listed}; {}", f.rdma_why)));
    }
    let bind = std::env::var("GIXL_TCP_ADDR").unwrap_or_default();
    // As the TCP listener advertises them when it is not given an address: IPv4, loopback last.
    let mut v4: Vec<_> = crate::os::sock::interface_addrs().into_iter().filter(|ip| ip.is_ipv4()).collect();
    v4.sort_by_key(|ip| ip.is_loopback());
    let addrs: Vec<String> = v4.iter().map(|a| a.to_string()).collect();
    devices.push(dev(
        "TCP".to_owned(),
        true,
        if bind.is_empty() {
            format!(
                "listens on every IPv4 interface and advertises each: {} (GIXL_TCP_ADDR picks one)",
                if addrs.is_empty() { "none found".to_owned() } else { addrs.join(", ") }
            )
        } else {
            format!("GIXL_TCP_ADDR={bind}: only that address is advertised")
        },
    ));
    devices.push(match (&f.vram, &f.libcuda) {
        (Ok("fake"), _) => dev("GPU".into(), true, "the fake device layer (GIXL_FAKE_DEVICE=1, for tests)".into()),
        (Ok(kind), _) => dev("GPU".into(), true, format!("through the {kind} driver (libcuda loadable)")),
        (Err(e), Ok(())) => dev("GPU".into(), false, format!("libcuda loads, but: {e}")),
        (Err(e), Err(_)) => dev("GPU".into(), false, format!("no GPU driver here: {e}")),
    });
    if f.vram.is_ok() && !f.ports.is_empty() {
        devices.push(dev(
            "GPUDirect RDMA".into(),
            rdma_here,
            format!(
                "per region: dma-buf, else peer memory (module {}), else staged; the log says which",
                if f.peer_memory { "loaded" } else { "not loaded" }
            ),
        ));
    }
    devices.push(match &f.io_uring {
        Ok(()) => dev("io_uring".into(), true, "the POSIX (file) backend's I/O goes through it".into()),
        Err(e) => dev(
            "io_uring".into(),
            false,
            format!("unavailable ({e}): the POSIX backend uses a thread pool of pread/pwrite"),
        ),
    });
    devices.push(match f.gds_staged {
        None => dev("GPUDirect Storage".into(), true, "the GDS backends move VRAM <-> FILE through cuFile".into()),
        Some(why) => dev(
            "GPUDirect Storage".into(),
            false,
            format!("the GDS backends stage VRAM <-> FILE through page-locked host buffers: {why}"),
        ),
    });
    J::Obj(vec![("routes", J::Arr(routes)), ("devices", J::Arr(devices))])
}

fn err_j(stage: &str, e: impl std::fmt::Display) -> J {
    J::Obj(vec![("ok", J::Bool(false)), ("stage", J::s(stage)), ("error", J::s(e.to_string()))])
}

/// Load the peer into a throw-away agent, see which route it gets, READ from its first region a few times.
fn peer_report(target: PeerTarget, cma_ok: bool, uid: u32) -> J {
    let me = format!("gixl-doctor-{}-{:x}", std::process::id(), crate::util::random_u128() as u32);
    let a = match Agent::new(&me, AgentConfig { listen_thread: false, ..AgentConfig::default() }) {
        Ok(a) => a,
        Err(e) => return err_j("create agent", e),
    };
    if let Err(e) = a.create_backend("UCX", &Params::new()) {
        return err_j("create backend", e);
    }
    let mut out: Vec<(&'static str, J)> = Vec::new();
    let name = match target {
        PeerTarget::Md(md) => match a.load_remote_md(&md) {
            Ok(n) => n,
            Err(e) => return err_j("load metadata", e),
        },
        PeerTarget::Listener { name, ip, port } => {
            let t = Instant::now();
            let addr = format!("{ip}:{port}");
            let reach = std::net::ToSocketAddrs::to_socket_addrs(&addr)
                .map_err(|e| e.to_string())
                .and_then(|mut it| it.next().ok_or_else(|| "no address".to_owned()))
                .and_then(|sa| {
                    std::net::TcpStream::connect_timeout(&sa, Duration::from_secs(3)).map_err(|e| e.to_string())
                });
            let failed = reach.as_ref().err().cloned();
            out.push((
                "listener",
                J::Obj(vec![
                    ("address", J::s(addr.clone())),
                    ("reachable", J::Bool(reach.is_ok())),
                    ("connect_ms", J::Num(t.elapsed().as_secs_f64() * 1e3)),
                    ("error", reach.err().map_or(J::Null, J::s)),
                ]),
            ));
            if let Some(e) = failed {
                out.push(("ok", J::Bool(false)));
                out.push(("stage", J::s("listener")));
                out.push(("error", J::s(format!("cannot connect to {addr}: {e}"))));
                return J::Obj(out);
            }
            if let Err(e) = a.fetch_remote_md(&name, &ip, port, "") {
                return err_j("fetch metadata", e);
            }
            let t = Instant::now();
            while a.remote_incarnation(&name).is_err() {
                if t.elapsed() > Duration::from_secs(10) {
                    out.push(("ok", J::Bool(false)));
                    out.push(("stage", J::s("fetch metadata")));
                    out.push(("error", J::s(format!("no metadata from {name} at {ip}:{port} within 10 s"))));
                    return J::Obj(out);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            name
        }
    };
    let ra = a.inner.remotes.read().get(&name).cloned();
    let Some(ra) = ra else { return err_j("load metadata", "the peer is not loaded") };
    let Some((bid, peer)) = ra.peers.first().cloned() else { return err_j("load metadata", "no backend in common") };
    let route_before = peer.route();
    out.push(("ok", J::Bool(true)));
    out.push(("name", J::s(name.clone())));
    out.push(("incarnation", J::s(format!("{:032x}", ra.incarnation))));
    let mut why = Vec::new();
    match route_before {
        "in-process" => why.push("the peer is an agent of this process".to_owned()),
        "tcp" => why.push("the peer is on another host, or in another pid or network namespace".to_owned()),
        "cma" => why.push("the peer is a process on this host in this pid namespace".to_owned()),
        _ => {}
    }
    if let Some(pid) = peer.pid() {
        out.push(("pid", J::Num(pid as f64)));
        match uid_of(&pid.to_string()) {
            Some(pu) if pu != uid && !has_cap_sys_ptrace() => why.push(format!(
                "its uid is {pu}, ours {uid}: the kernel denies CMA across users without CAP_SYS_PTRACE"
            )),
            Some(pu) => out.push(("peer_uid", J::Num(pu as f64))),
            None => why.push("its /proc entry is not readable here".to_owned()),
        }
        if !cma_ok {
            why.push("this host denies CMA (see routes.cma)".to_owned());
        }
    }
    // A READ from the peer's first DRAM region, 3 times (at most 16 MiB): the route's real behaviour.
    let region = ra
        .sections
        .read()
        .get(&(bid, MemType::Dram))
        .and_then(|s| s.iter().next().map(|(d, _)| *d))
        .filter(|d| d.len > 0);
    let mut probe: Vec<(&'static str, J)> = Vec::new();
    match region {
        None => probe.push(("skipped", J::s("the peer's metadata has no DRAM region to read from"))),
        Some(d) => {
            let len = d.len.min(16 << 20) as usize;
            let buf = vec![0u8; len];
            let l = RegDList::with_descs(
                MemType::Dram,
                vec![RegDesc { desc: Desc::new(buf.as_ptr() as u64, len as u64, 0), meta: vec![] }],
            );
            let r = (|| -> crate::Result<(f64, usize)> {
                a.register_mem(&l, &[])?;
                let local = XferDList::with_descs(MemType::Dram, vec![Desc::new(buf.as_ptr() as u64, len as u64, 0)]);
                let remote = XferDList::with_descs(MemType::Dram, vec![Desc::new(d.addr, len as u64, d.dev)]);
                let req = a.create_xfer_req(XferOp::Read, &local, &remote, &name, &XferOpts::default())?;
                let mut best = f64::MAX;
                for _ in 0..3 {
                    let t = Instant::now();
                    let mut s = a.post_xfer_req(&req, crate::agent::NotifUpdate::Keep)?;
                    while s == Status::InProg {
                        if t.elapsed() > Duration::from_secs(20) {
                            return Err(crate::Error::backend("the probe READ did not finish within 20 s"));
                        }
                        std::thread::sleep(Duration::from_micros(200));
                        s = a.xfer_status(&req)?;
                    }
                    best = best.min(t.elapsed().as_secs_f64());
                }
                a.release_xfer_req(&req)?;
                Ok((best, len))
            })();
            match r {
                Ok((secs, n)) => {
                    probe.push(("bytes", J::Num(n as f64)));
                    probe.push(("best_seconds", J::Num(secs)));
                    probe.push(("gb_per_s", J::Num(n as f64 / secs / 1e9)));
                }
                Err(e) => probe.push(("error", J::s(e.to_string()))),
            }
            let _ = a.deregister_mem(&l, &[]);
        }
    }
    let route_after = peer.route();
    if route_after == "tcp-after-cma-denied" {
        let when = if route_before == route_after { "when the peer was loaded" } else { "on the first transfer" };
        why.push(format!("the kernel refused cross-memory attach {when}: gixl fell back to TCP"));
    }
    out.push(("route_at_load", J::s(route_before)));
    out.push(("route", J::s(route_after)));
    out.push(("why", J::s(why.join("; "))));
    out.push(("read_probe", J::Obj(probe)));
    let _ = a.invalidate_remote_md(&name);
    J::Obj(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_escapes_and_nests() {
        let mut o = String::new();
        J::Obj(vec![("a", J::Arr(vec![J::Num(1.0), J::Num(0.5), J::Null])), ("b", J::s("q\"\\\n\u{1}"))]).write(&mut o);
        assert_eq!(o, r#"{"a":[1,0.5,null],"b":"q\"\\\n\u0001"}"#);
    }

    #[test]
    fn host_report_names_every_route() {
        let r = report(None);
        for k in [
            "\"in_process\"",
            "\"cma\"",
            "\"tcp\"",
            "\"rdma\"",
            "\"gpu_direct\"",
            "\"libfabric\"",
            "\"cuda\"",
            "\"nixl_api\":\"1.5.2\"",
        ] {
            assert!(r.contains(k), "{k} missing from {r}");
        }
    }

    #[test]
    fn summary_comes_first_with_each_peer_kind_and_device() {
        let r = report(None);
        let s = r.find("\"summary\":{\"routes\":[").expect("a summary");
        assert!(s < r.find("\"routes\":{\"in_process\"").expect("the details"), "summary before details: {r}");
        for k in
            ["same process", "same host", "other host", "VRAM", "\"device\":\"TCP\"", "\"device\":\"GPU\"", "io_uring"]
        {
            assert!(r.contains(k), "{k} missing from the summary: {r}");
        }
        assert!(r.contains("RDMA"), "the NICs (or their absence) are in the summary: {r}");
        // GPUDirect Storage: used, or why the GDS backends stage (never silent).
        let why = crate::backend::gds::staged_reason().expect("no cuFile in the unit tests");
        assert!(r.contains("\"device\":\"GPUDirect Storage\",\"used\":false"), "{r}");
        assert!(r.contains("stage VRAM <-> FILE through page-locked host buffers") && r.contains(why), "{r}");
    }
}
