//! Two real processes on one host: the decode side (this test) reads from a prefill child over cross-memory
//! attach, with notifications; the child is killed mid-transfer and restarted under the same name.
//!
//! The child is this same test binary re-run with `GIXL_CHILD=prefill`; it speaks a line protocol on
//! stdin/stdout so the parent can drive it.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command};
use std::time::{Duration, Instant};

use gixl::*;

mod common;
use common::{hex, unhex};

const MIB: usize = 1 << 20;

/// The prefill child: registers `size` bytes filled with `fill`, prints its metadata and buffer address,
/// then answers commands: `notifs` (prints them), `sum` (prints a checksum of its buffer), `exit`.
fn prefill_child() {
    let size: usize = std::env::var("GIXL_SIZE").unwrap().parse().unwrap();
    let fill: u8 = std::env::var("GIXL_FILL").unwrap().parse().unwrap();
    let a = Agent::new("prefill", AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let buf = vec![fill; size];
    let d = Desc::new(buf.as_ptr() as u64, size as u64, 0);
    a.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }]), &[]).unwrap();
    let out = std::io::stdout();
    let mut out = out.lock();
    writeln!(out, "\n@md {} {}", hex(&a.local_md().unwrap()), buf.as_ptr() as u64).unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        match line.unwrap().as_str() {
            "notifs" => {
                for (from, msg) in a.notifs(&[]).unwrap() {
                    writeln!(out, "notif {from} {}", hex(&msg)).unwrap();
                }
                writeln!(out, "end").unwrap();
            }
            "sum" => writeln!(out, "sum {}", buf.iter().map(|&b| b as u64).sum::<u64>()).unwrap(),
            _ => break,
        }
        out.flush().unwrap();
    }
}

struct Prefill {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    md: Vec<u8>,
    addr: u64,
}

impl Prefill {
    // The child is kept in the returned `Prefill`; the test ends it through `kill` (or the harness reaps it).
    #[allow(clippy::zombie_processes)]
    fn start(size: usize, fill: u8) -> Prefill {
        Prefill::start_as(size, fill, None)
    }

    /// `start`, the child running as `user` (exe, uid) when given: a copy of this binary that user may run.
    fn start_as(size: usize, fill: u8, user: Option<(&std::path::Path, u32)>) -> Prefill {
        use std::os::unix::process::CommandExt;
        let mut c = Command::new(user.map_or_else(|| std::env::current_exe().unwrap(), |(exe, _)| exe.to_owned()));
        if let Some((_, uid)) = user {
            c.uid(uid).gid(uid);
        }
        c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env("GIXL_CHILD", "prefill")
            .env("GIXL_SIZE", size.to_string())
            .env("GIXL_FILL", fill.to_string());
        let (child, stdin, stdout, rest) = common::spawn_until_md(c);
        let mut it = rest.split(' ');
        let md = unhex(it.next().unwrap());
        let addr = it.next().unwrap().parse().unwrap();
        Prefill { child, stdin, stdout, md, addr }
    }

    fn ask(&mut self, cmd: &str, until: &str) -> Vec<String> {
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut lines = Vec::new();
        loop {
            let mut l = String::new();
            assert!(self.stdout.read_line(&mut l).unwrap() > 0);
            let l = l.trim().to_owned();
            let done = l.starts_with(until);
            lines.push(l);
            if done {
                return lines;
            }
        }
    }

    fn notifs(&mut self) -> Vec<String> {
        self.ask("notifs", "end").into_iter().filter(|l| l.starts_with("notif ")).collect()
    }

    fn sum(&mut self) -> u64 {
        self.ask("sum", "sum")[0][4..].parse().unwrap()
    }

    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

#[test]
fn child_entry() {
    match std::env::var("GIXL_CHILD").as_deref() {
        Ok("prefill") => prefill_child(),
        Ok("fdlimit") => fd_limit_child(),
        Ok("reader") => reader_child(),
        Ok("read_once") => read_once_child(),
        _ => {}
    }
}

/// An initiator child's agent `name` with a registered buffer of GIXL_LEN bytes, and what the target's
/// metadata (GIXL_MD, hex) and region address (GIXL_ADDR) say.
fn initiator_from_env(name: &str) -> (Agent, Vec<u8>, Vec<u8>, u64) {
    let md = unhex(&std::env::var("GIXL_MD").unwrap());
    let addr: u64 = std::env::var("GIXL_ADDR").unwrap().parse().unwrap();
    let len: usize = std::env::var("GIXL_LEN").unwrap().parse().unwrap();
    let a = Agent::new(name, AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let buf = vec![0u8; len];
    let d = Desc::new(buf.as_ptr() as u64, len as u64, 0);
    a.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }]), &[]).unwrap();
    (a, buf, md, addr)
}

/// An initiator that READs the whole of a target's region again and again: the target's metadata and the
/// region come in GIXL_MD (hex), GIXL_ADDR and GIXL_LEN; prints `reading` once the first READ is posted.
fn reader_child() {
    let (a, buf, md, addr) = initiator_from_env("reader");
    let (len, d) = (buf.len(), Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0));
    let target = a.load_remote_md(&md).unwrap();
    let x = a.create_xfer_req(XferOp::Read, &one(d.addr, len), &one(addr, len), &target, &XferOpts::default()).unwrap();
    let mut told = false;
    loop {
        a.post_xfer_req(&x, NotifUpdate::Keep).unwrap();
        if !told {
            println!("\n@md reading");
            told = true;
        }
        let _ = wait(&a, &x, Duration::from_secs(60));
    }
}

/// One READ of a target's region (GIXL_MD, GIXL_ADDR, GIXL_LEN as for `reader_child`): prints `@md <status
/// or error> <sum of the bytes read>`.
fn read_once_child() {
    let (a, buf, md, addr) = initiator_from_env("read-once");
    let (len, d) = (buf.len(), Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0));
    let outcome = a.load_remote_md(&md).and_then(|target| {
        let x = a.create_xfer_req(XferOp::Read, &one(d.addr, len), &one(addr, len), &target, &XferOpts::default())?;
        a.post_xfer_req(&x, NotifUpdate::Keep)?;
        wait(&a, &x, Duration::from_secs(10))
    });
    let sum: u64 = buf.iter().map(|&b| b as u64).sum();
    match outcome {
        Ok(s) => println!("\n@md {s} {sum}"),
        Err(e) => println!("\n@md {} {sum}", e.status()),
    }
}

/// CPU time this process has used (user + system).
fn cpu_time() -> Duration {
    // SAFETY: a zeroed rusage to fill.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: plain syscall into `u`.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// An agent with a metadata listener, then at its descriptor limit: prints its listener port and its control
/// socket's name, waits for `measure`, then prints the CPU time it used over the next two seconds.
fn fd_limit_child() {
    let cfg = AgentConfig { listen_thread: true, listen_port: 0, ..AgentConfig::default() };
    let a = Agent::new("fdlimit", cfg).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let lim = libc::rlimit { rlim_cur: open + 4, rlim_max: open + 64 };
    // SAFETY: plain syscall.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    let out = std::io::stdout();
    let mut out = out.lock();
    let sock = format!("gixl.{}.{:032x}", std::process::id(), a.incarnation());
    writeln!(out, "\n@md {} {sock}", a.listen_port().unwrap()).unwrap();
    out.flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let t0 = cpu_time();
    std::thread::sleep(Duration::from_secs(2));
    writeln!(out, "cpu {}", (cpu_time() - t0).as_micros()).unwrap();
    out.flush().unwrap();
    drop(a);
}

fn wait(a: &Agent, r: &XferReq, limit: Duration) -> Result<Status> {
    let t = Instant::now();
    loop {
        match a.xfer_status(r)? {
            Status::InProg if t.elapsed() < limit => std::thread::sleep(Duration::from_micros(50)),
            s => return Ok(s),
        }
    }
}

fn one(addr: u64, len: usize) -> XferDList {
    XferDList::with_descs(MemType::Dram, vec![Desc::new(addr, len as u64, 0)])
}

#[test]
fn cross_process_read_notify_kill_and_restart() {
    let size = 64 * MIB;
    let mut p = Prefill::start(size, 7);
    let d = Agent::new("decode", AgentConfig::default()).unwrap();
    d.create_backend("UCX", &Params::new()).unwrap();
    let dst = vec![0u8; size];
    let dd = Desc::new(dst.as_ptr() as u64, size as u64, 0);
    d.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: dd, meta: vec![] }]), &[]).unwrap();
    assert_eq!(d.load_remote_md(&p.md).unwrap(), "prefill");

    // 64 MiB READ with a notification, split across copy threads.
    let opts = XferOpts { notif: Some(b"kv-ready\0bin".to_vec()), ..Default::default() };
    let r = d.create_xfer_req(XferOp::Read, &one(dd.addr, size), &one(p.addr, size), "prefill", &opts).unwrap();
    d.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
    assert_eq!(wait(&d, &r, Duration::from_secs(10)).unwrap(), Status::Success);
    assert!(dst.iter().all(|&b| b == 7));
    let t = Instant::now();
    let mut n = p.notifs();
    while n.is_empty() && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
        n = p.notifs();
    }
    assert_eq!(n, vec![format!("notif decode {}", hex(b"kv-ready\0bin"))]);

    // Kill the prefill while a large transfer runs: REMOTE_DISCONNECT within a second of the kill.
    let big = d
        .create_xfer_req(XferOp::Read, &one(dd.addr, size), &one(p.addr, size), "prefill", &XferOpts::default())
        .unwrap();
    let st = d.post_xfer_req(&big, NotifUpdate::Keep);
    p.kill();
    let killed = Instant::now();
    let outcome = match st {
        Ok(Status::InProg) => wait(&d, &big, Duration::from_secs(5)),
        other => other,
    };
    // The copy may have finished before the kill landed; otherwise it must be a prompt disconnect.
    if let Err(e) = &outcome {
        assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
    }
    assert!(killed.elapsed() < Duration::from_secs(1), "took {:?}", killed.elapsed());
    let t = Instant::now();
    let e = loop {
        match d.post_xfer_req(&r, NotifUpdate::Keep).and_then(|_| wait(&d, &r, Duration::from_secs(2))) {
            Err(e) => break e,
            Ok(_) if t.elapsed() < Duration::from_secs(1) => std::thread::sleep(Duration::from_millis(10)),
            Ok(s) => panic!("post to a killed peer still gave {s}"),
        }
    };
    assert_eq!(e.status(), Status::RemoteDisconnect);
    // It says why (the pidfd saw the exit, or a batch found the incarnation gone), never a bare "disconnected".
    assert!(!e.message().ends_with("has disconnected"), "{e}");

    // Restart under the same name with a different buffer.
    let mut p2 = Prefill::start(size, 9);
    assert_eq!(d.load_remote_md(&p2.md).unwrap_err().status(), Status::NotAllowed);
    d.invalidate_remote_md("prefill").unwrap();
    d.load_remote_md(&p2.md).unwrap();
    // The old handle is stale: refused, and not one byte reaches the new incarnation through it.
    let w = d
        .create_xfer_req(XferOp::Write, &one(dd.addr, 4096), &one(p2.addr, 4096), "prefill", &XferOpts::default())
        .unwrap();
    assert_eq!(d.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err().status(), Status::NotFound);
    assert_eq!(p2.sum(), 9 * size as u64);
    // A new handle works.
    assert_eq!(wait(&d, &w, Duration::ZERO).unwrap_err().status(), Status::NotPosted);
    let r2 = d
        .create_xfer_req(XferOp::Read, &one(dd.addr, size), &one(p2.addr, size), "prefill", &XferOpts::default())
        .unwrap();
    d.post_xfer_req(&r2, NotifUpdate::Keep).unwrap();
    assert_eq!(wait(&d, &r2, Duration::from_secs(10)).unwrap(), Status::Success);
    assert!(dst.iter().all(|&b| b == 9));
    p2.kill();
}

#[test]
fn many_small_blocks_cross_process() {
    let blocks = 1024;
    let bs = 16 * 1024;
    let mut p = Prefill::start(blocks * bs, 3);
    let d = Agent::new("decode-kv", AgentConfig::default()).unwrap();
    d.create_backend("UCX", &Params::new()).unwrap();
    let dst = vec![0u8; blocks * bs];
    let dd = Desc::new(dst.as_ptr() as u64, dst.len() as u64, 0);
    d.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: dd, meta: vec![] }]), &[]).unwrap();
    d.load_remote_md(&p.md).unwrap();
    let l = XferDList::with_descs(
        MemType::Dram,
        (0..blocks).map(|i| Desc::new(dd.addr + (i * bs) as u64, bs as u64, 0)).collect(),
    );
    let r = XferDList::with_descs(
        MemType::Dram,
        (0..blocks).map(|i| Desc::new(p.addr + (i * bs) as u64, bs as u64, 0)).collect(),
    );
    let lp = d.prep_xfer_dlist("", &l, &[]).unwrap();
    let rp = d.prep_xfer_dlist("prefill", &r, &[]).unwrap();
    // Reversed remote order so nothing merges: 1024 separate pieces.
    let li: Vec<i64> = (0..blocks as i64).collect();
    let ri: Vec<i64> = (0..blocks as i64).rev().collect();
    let x = d.make_xfer_req(XferOp::Read, &lp, &li, &rp, &ri, &XferOpts::default()).unwrap();
    assert_eq!(x.desc_count(), blocks as u64);
    d.post_xfer_req(&x, NotifUpdate::Set(b"blocks".to_vec())).unwrap();
    assert_eq!(wait(&d, &x, Duration::from_secs(10)).unwrap(), Status::Success);
    assert!(dst.iter().all(|&b| b == 3));
    d.gen_notif("prefill", b"heartbeat", &[]).unwrap();
    let t = Instant::now();
    let mut got = Vec::new();
    while got.len() < 2 && t.elapsed() < Duration::from_secs(5) {
        got.extend(p.notifs());
    }
    assert_eq!(
        got,
        vec![format!("notif decode-kv {}", hex(b"blocks")), format!("notif decode-kv {}", hex(b"heartbeat"))]
    );
    p.kill();
}

/// Metadata of another process, rewritten: the prefill's real region ticket stretched past its registration.
/// Over cross-memory attach the target's gate refuses it whole; not one byte of the prefill changes.
#[test]
fn forged_metadata_over_cma_writes_nothing() {
    let size = MIB;
    let mut p = Prefill::start(size, 4);
    let d = Agent::new("decode-forge", AgentConfig::default()).unwrap();
    d.create_backend("UCX", &Params::new()).unwrap();
    let src = vec![0xEEu8; 2 * size];
    let sd = Desc::new(src.as_ptr() as u64, src.len() as u64, 0);
    d.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: sd, meta: vec![] }]), &[]).unwrap();
    let mut md = gixl::md::AgentMd::decode(&p.md).unwrap();
    md.name = "mallory".into();
    let (desc, ticket) = md.sections[0].regions[0].clone();
    md.sections[0].regions = vec![(Desc::new(desc.addr, desc.len + 4096, 0), ticket)];
    d.load_remote_md(&md.encode()).unwrap();
    // Straddles the end of the registration: half inside, half outside.
    let at = p.addr + size as u64 - 4096;
    for op in [XferOp::Write, XferOp::Read] {
        let r = d.create_xfer_req(op, &one(sd.addr, 8192), &one(at, 8192), "mallory", &XferOpts::default()).unwrap();
        let e = d.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err();
        assert_eq!(e.status(), Status::Backend, "{op:?}: {e}");
    }
    assert_eq!(p.sum(), 4 * size as u64, "the prefill's buffer changed");
    assert!(src.iter().all(|&b| b == 0xEE), "a refused READ delivered data");
    // The genuine metadata still works on the same connection.
    d.load_remote_md(&p.md).unwrap();
    let r = d.create_xfer_req(XferOp::Read, &one(sd.addr, 4096), &one(at, 4096), "prefill", &XferOpts::default());
    assert_eq!(d.post_xfer_req(&r.unwrap(), NotifUpdate::Keep).unwrap(), Status::Success);
    assert!(src[..4096].iter().all(|&b| b == 4));
    p.kill();
}

/// A target that is stopped (SIGSTOP) and whose control socket's backlog someone has filled: loading its
/// metadata gives up on the socket within its bound instead of blocking until the target runs again (it
/// blocked for as long as the target stayed stopped), and once the target runs again a READ works.
#[test]
fn loading_a_stopped_target_with_a_full_backlog_is_bounded() {
    stopped_target_with_a_full_backlog(None);
}

/// The same with the target a process of another uid (65534): a socket a stranger owns holds up the load no
/// longer than one of the same uid (it blocked as long as its owner liked: 20 s, 40 s in the runs).
/// Needs root to start the child as another user; skipped otherwise.
#[test]
fn loading_a_stopped_target_of_another_uid_with_a_full_backlog_is_bounded() {
    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } != 0 {
        common::skip("cma", "needs root to start a child as another user");
        return;
    }
    let exe = common::ExeForOthers::new();
    stopped_target_with_a_full_backlog(Some((&exe.path, 65534)));
}

fn stopped_target_with_a_full_backlog(user: Option<(&std::path::Path, u32)>) {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let size = MIB;
    let p = Prefill::start_as(size, 9, user);
    let pid = p.child.id() as i32;
    // The socket name: learnt the way any peer learns it, from the metadata.
    let scout = Agent::new("scout", AgentConfig::default()).unwrap();
    scout.create_backend("UCX", &Params::new()).unwrap();
    scout.load_remote_md(&p.md).unwrap();
    let inc = scout.remote_incarnation("prefill").unwrap();
    drop(scout);
    let name = format!("gixl.{pid}.{inc:032x}");
    // Filling a backlog of up to net.core.somaxconn connections needs as many descriptors.
    // SAFETY: plain syscalls on a struct of ours.
    unsafe {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
    // SAFETY: signals to our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    // Fill the backlog: non-blocking connects until the kernel says it is full.
    let mut fillers: Vec<OwnedFd> = Vec::new();
    loop {
        // SAFETY: plain syscalls on descriptors this test owns; `addr` is a valid sockaddr_un.
        let full = unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0);
            if fd < 0 {
                // SAFETY: signals to our own child.
                libc::kill(pid, libc::SIGCONT);
                let e = std::io::Error::last_os_error();
                common::skip("fds", &format!("out of descriptors after {} connections: {e}", fillers.len()));
                return;
            }
            let s = OwnedFd::from_raw_fd(fd);
            let mut addr: libc::sockaddr_un = std::mem::zeroed();
            addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
            for (i, b) in name.bytes().enumerate() {
                addr.sun_path[i + 1] = b as libc::c_char;
            }
            let len = (std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len()) as libc::socklen_t;
            let r = libc::connect(s.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len);
            let err = std::io::Error::last_os_error().raw_os_error();
            if r == 0 {
                fillers.push(s);
                false
            } else {
                assert_eq!(err, Some(libc::EAGAIN), "connect to {name}");
                true
            }
        };
        if full {
            break;
        }
        assert!(fillers.len() < 100_000, "the backlog never filled");
    }
    let d = std::sync::Arc::new(Agent::new("decode-stopped", AgentConfig::default()).unwrap());
    d.create_backend("UCX", &Params::new()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let (d2, md) = (d.clone(), p.md.clone());
    let t = Instant::now();
    std::thread::spawn(move || tx.send(d2.load_remote_md(&md).map(|_| ())).unwrap());
    let got = rx.recv_timeout(Duration::from_secs(20));
    let took = t.elapsed();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    drop(fillers);
    let loaded = got.unwrap_or_else(|_| panic!("load_remote_md still blocked after {took:?}"));
    eprintln!(
        "load_remote_md of a stopped target (uid {:?}) with a full backlog: {loaded:?} after {took:?}",
        user.map(|u| u.1)
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    // Running again: reachable once loaded afresh (a peer whose socket could not be reached is taken for
    // gone, as one whose pid does not listen on it).
    if loaded.is_ok() {
        d.invalidate_remote_md("prefill").unwrap();
    }
    d.load_remote_md(&p.md).unwrap();
    let dst = vec![0u8; size];
    let dd = Desc::new(dst.as_ptr() as u64, size as u64, 0);
    d.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: dd, meta: vec![] }]), &[]).unwrap();
    let x = d
        .create_xfer_req(XferOp::Read, &one(dd.addr, size), &one(p.addr, size), "prefill", &XferOpts::default())
        .unwrap();
    d.post_xfer_req(&x, NotifUpdate::Keep).unwrap();
    assert_eq!(wait(&d, &x, Duration::from_secs(10)).unwrap(), Status::Success);
    assert!(dst.iter().all(|&b| b == 9));
    p.kill();
}

/// An agent at its descriptor limit while strangers keep connecting to its metadata listener and its control
/// socket: the connections it cannot take are shed, and it stays idle (it spun on the level-triggered
/// listeners, a core's worth of CPU for as long as the limit lasted).
#[test]
fn an_agent_at_its_descriptor_limit_does_not_spin() {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"]).env("GIXL_CHILD", "fdlimit");
    let (mut child, mut stdin, mut stdout, rest) = common::spawn_until_md(c);
    let mut it = rest.split(' ');
    let port: u16 = it.next().unwrap().parse().unwrap();
    let sock = it.next().unwrap().to_owned();
    let mut held = Vec::new();
    for _ in 0..40 {
        if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            held.push(s);
        }
    }
    let mut unix = Vec::new();
    for _ in 0..40 {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(sock.as_bytes()).unwrap();
        if let Ok(s) = std::os::unix::net::UnixStream::connect_addr(&addr) {
            unix.push(s);
        }
    }
    assert!(held.len() >= 20 && unix.len() >= 20, "{} TCP, {} local connections", held.len(), unix.len());
    writeln!(stdin, "measure").unwrap();
    let mut line = String::new();
    while !line.starts_with("cpu ") {
        line.clear();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "the child exited");
    }
    let us: u64 = line.trim()[4..].parse().unwrap();
    eprintln!("CPU of an agent at its descriptor limit over 2 s: {us} us");
    assert!(us < 500_000, "{us} us of CPU in 2 s: the listeners spin");
    drop(stdin);
    let _ = child.wait();
}

/// A target deregisters regions while an initiator is stopped (SIGSTOP) inside the transfer gate, in the middle
/// of a READ of one large region. Sixteen regions it does not touch: no wait at all (each waited for it: 16
/// disconnect timeouts, then one in all, whichever region the READ was on). Those sixteen with one it may touch:
/// one bounded wait in all. And once that initiator is killed but not yet reaped (a zombie), its count is
/// reclaimed at once instead of waited out.
///
/// The target is fresh, so its registrations take gate slots 0, 1, 2, … in order: the large region slot 0, 39
/// fillers slots 1–39, and the probe slot 40, which shares the large region's bit in an initiator's mask (slot
/// modulo 40): deregistering the probe waits exactly when the READ is inside the gate, which is how the test
/// knows the stop landed there.
#[test]
fn deregistering_regions_waits_only_for_a_stopped_initiator_touching_them_and_not_for_a_zombie() {
    let timeout = Duration::from_millis(1500);
    let t = Agent::new("dereg-target", AgentConfig::default()).unwrap();
    let mut params = Params::new();
    params.insert("disconnect_timeout_ms".into(), timeout.as_millis().to_string());
    t.create_backend("UCX", &params).unwrap();
    let len = 64 * MIB;
    let big = vec![5u8; len];
    let bd = Desc::new(big.as_ptr() as u64, len as u64, 0);
    t.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: bd, meta: vec![] }]), &[]).unwrap();
    let list = |bufs: &[Vec<u8>]| {
        RegDList::with_descs(
            MemType::Dram,
            bufs.iter().map(|b| RegDesc { desc: Desc::new(b.as_ptr() as u64, 4096, 0), meta: vec![] }).collect(),
        )
    };
    let fillers: Vec<Vec<u8>> = (0..39).map(|_| vec![1u8; 4096]).collect();
    let fill_list = list(&fillers);
    t.register_mem(&fill_list, &[]).unwrap();
    let probe = vec![vec![2u8; 4096]];
    let probe_list = list(&probe);
    t.register_mem(&probe_list, &[]).unwrap();
    let small_list = list(&fillers[..16]);
    let with_probe = RegDList::with_descs(
        MemType::Dram,
        fillers[..16]
            .iter()
            .chain(&probe)
            .map(|b| RegDesc { desc: Desc::new(b.as_ptr() as u64, 4096, 0), meta: vec![] })
            .collect(),
    );
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", "reader")
        .env("GIXL_MD", hex(&t.local_md().unwrap()))
        .env("GIXL_ADDR", bd.addr.to_string())
        .env("GIXL_LEN", len.to_string());
    let (mut child, _stdin, _stdout, _) = common::spawn_until_md(c);
    let pid = child.id() as i32;
    // Stop the reader until deregistering the probe shows it stopped inside the gate (a READ is mostly copies).
    let mut inside = false;
    for _ in 0..40 {
        // SAFETY: signals to our own child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        std::thread::sleep(Duration::from_millis(20));
        let t0 = Instant::now();
        t.deregister_mem(&probe_list, &[]).unwrap();
        t.register_mem(&probe_list, &[]).unwrap();
        if t0.elapsed() >= timeout / 2 {
            inside = true;
            break;
        }
        // SAFETY: as above.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
        std::thread::sleep(Duration::from_millis(37));
    }
    assert!(inside, "the reader was never caught inside the gate");
    let t0 = Instant::now();
    t.deregister_mem(&small_list, &[]).unwrap();
    let untouched = t0.elapsed();
    eprintln!("16 regions the stopped initiator does not touch deregistered: {untouched:?} (timeout {timeout:?})");
    assert!(untouched < timeout / 2, "{untouched:?}: waited for an initiator that does not touch them");
    t.register_mem(&small_list, &[]).unwrap();
    let t0 = Instant::now();
    t.deregister_mem(&with_probe, &[]).unwrap();
    let touched = t0.elapsed();
    eprintln!("those 16 and one it may touch: {touched:?}");
    assert!(touched >= timeout / 2 && touched < timeout * 3, "{touched:?}: not one bounded wait");
    t.register_mem(&probe_list, &[]).unwrap();
    // Killed, not reaped: a zombie, whose count can never drop.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap()
        .rsplit(')')
        .next()
        .unwrap()
        .trim_start()
        .starts_with('Z')
    {
        assert!(Instant::now() < deadline, "the reader did not die");
        std::thread::sleep(Duration::from_millis(5));
    }
    t.register_mem(&small_list, &[]).unwrap();
    let t0 = Instant::now();
    t.deregister_mem(&with_probe, &[]).unwrap();
    let zombie = t0.elapsed();
    eprintln!("16 regions deregistered with a zombie initiator's count in the gate: {zombie:?}");
    assert!(zombie < timeout / 2, "{zombie:?}: the zombie's count was waited out");
    child.wait().unwrap();
}

/// A listener frame: "GXMD" | kind | length u32 LE | payload.
fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = b"GXMD".to_vec();
    f.push(kind);
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

/// Push `blobs` to a metadata listener as LOADs, as a raw-socket stranger would, then a SEND whose answer
/// says every LOAD before it was acted on.
fn push(port: u16, blobs: impl IntoIterator<Item = Vec<u8>>) {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    for b in blobs {
        s.write_all(&frame(1, &b)).unwrap();
    }
    s.write_all(&frame(2, b"")).unwrap();
    let mut head = [0u8; 9];
    s.read_exact(&mut head).unwrap();
    assert_eq!(&head[..5], b"GXMD\x01");
}

/// Descriptors of this process that are pidfds or transfer gates (others tests of this binary open a few).
fn peer_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| {
            let l = l.to_string_lossy();
            l.contains("pidfd") || l.contains("gixl-gate")
        })
        .count()
}

/// Renamed copies of real peers' metadata pushed to an agent's listener (anyone who reaches it may push
/// without a cluster key): 300 names of another process and 300 of the agent itself. Each name held a pidfd,
/// a gate descriptor and an initiator slot in that process's gate, so 256 names of the agent itself left no
/// slot for any other process ("no free initiator slot"). Now what a process proved is shared by every name
/// claiming it: a handful of descriptors in all, a new process still reads from the agent, and the agent
/// reads from the other process under any of the names.
#[test]
fn renamed_copies_of_real_peers_cost_no_slots_or_descriptors() {
    let mut p = Prefill::start(MIB, 3);
    let cfg = AgentConfig { listen_thread: true, listen_port: 0, ..AgentConfig::default() };
    let t = Agent::new("renamed-victim", cfg).unwrap();
    t.create_backend("UCX", &Params::new()).unwrap();
    let port = t.listen_port().unwrap();
    let buf = vec![5u8; MIB];
    let bd = Desc::new(buf.as_ptr() as u64, MIB as u64, 0);
    t.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: bd, meta: vec![] }]), &[]).unwrap();
    let own = t.local_md().unwrap();
    let renamed = |blob: &[u8], i: usize| {
        let mut m = gixl::md::AgentMd::decode(blob).unwrap();
        m.name = format!("ghost-{i}");
        m.encode()
    };
    let before = peer_fds();
    push(port, (0..300).map(|i| renamed(&p.md, i)));
    push(port, (300..600).map(|i| renamed(&own, i)));
    assert!(t.remote_incarnation("ghost-299").is_ok() && t.remote_incarnation("ghost-599").is_ok());
    let grew = peer_fds().saturating_sub(before);
    eprintln!("600 renamed names loaded: {grew} more pidfds and gate descriptors");
    assert!(grew < 50, "{grew} descriptors for 600 names of two processes");

    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", "read_once")
        .env("GIXL_MD", hex(&own))
        .env("GIXL_ADDR", bd.addr.to_string())
        .env("GIXL_LEN", MIB.to_string());
    let (mut child, _stdin, _stdout, rest) = common::spawn_until_md(c);
    child.wait().unwrap();
    assert_eq!(rest, format!("NIXL_SUCCESS {}", 5 * MIB), "a new process reading from the agent");

    let dst = vec![0u8; MIB];
    let dd = Desc::new(dst.as_ptr() as u64, MIB as u64, 0);
    t.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: dd, meta: vec![] }]), &[]).unwrap();
    for name in ["ghost-7", "ghost-250"] {
        let r = t.create_xfer_req(XferOp::Read, &one(dd.addr, MIB), &one(p.addr, MIB), name, &XferOpts::default());
        let r = r.unwrap();
        t.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
        assert_eq!(wait(&t, &r, Duration::from_secs(10)).unwrap(), Status::Success);
        assert!(dst.iter().all(|&b| b == 3));
    }
    assert_eq!(p.sum(), 3 * MIB as u64);
    p.kill();
}
