//! The fake RDMA fabric (`gixl::verbs::fake`) between two processes: a target process registers memory and
//! connects a queue pair; this process reads and writes it with chained, selectively signalled requests,
//! sends a message after the data (the target checks the data was there when the message arrived), sees a
//! stale key refused after the target deregisters, and sees RetryExceeded within a bound once the target is
//! killed. What the RDMA route will be built on, run where no NIC exists.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gixl::verbs::{self, Completion, Cq, Mr, Op, QpAddr, QpCaps, Sge, WcKind, WcStatus, Wr};
use gixl::verbs::{LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE};

const SIZE: usize = 16 << 20;
const BLOCK: usize = 16 << 10;
const CAPS: QpCaps = QpCaps { send_wr: 2048, recv_wr: 16, sge: 4 };
const ALL: u32 = LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex16(s: &str) -> [u8; 16] {
    let mut g = [0u8; 16];
    for (i, b) in g.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    g
}

fn addr_line(a: &QpAddr) -> String {
    format!("{} {} {} {}", hex(&a.gid), a.lid, a.qpn, a.psn)
}

fn parse_addr(f: &[&str]) -> QpAddr {
    QpAddr { gid: unhex16(f[0]), lid: f[1].parse().unwrap(), qpn: f[2].parse().unwrap(), psn: f[3].parse().unwrap() }
}

/// Wait on the queue's event descriptor (as the engine's reactor will) for `n` completions.
fn wait(cq: &Arc<dyn Cq>, n: usize, within: Duration) -> Vec<Completion> {
    let mut out = Vec::new();
    let deadline = Instant::now() + within;
    loop {
        cq.arm().unwrap();
        let want = n - out.len();
        cq.poll(&mut out, want).unwrap();
        if out.len() >= n {
            return out;
        }
        assert!(Instant::now() < deadline, "{} of {n} completions within {within:?}: {out:?}", out.len());
        let mut p = libc::pollfd { fd: cq.event_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 100) };
        cq.take_event().unwrap();
    }
}

/// A line for the parent: on a line of its own (the test harness may have begun one) and flushed.
fn tell(s: String) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "\n{s}").unwrap();
    out.flush().unwrap();
}

/// The target process: `@addr <qp> <buffer address> <rkey>` out, the initiator's queue pair in, then commands.
#[test]
fn child_entry() {
    if std::env::var("GIXL_CHILD").as_deref() != Ok("verbs-target") {
        return;
    }
    let fabric = verbs::fabric().unwrap();
    assert_eq!(fabric.name(), "fake");
    let nic = fabric.open("fake1", 1).unwrap();
    let buf: Vec<u8> = (0..SIZE).map(|i| (i % 253) as u8).collect();
    let mr = nic.reg_mr(buf.as_ptr() as u64, SIZE as u64, ALL).unwrap();
    let msg = vec![0u8; 256];
    let mmr = nic.reg_mr(msg.as_ptr() as u64, 256, ALL).unwrap();
    let cq = nic.create_cq(64).unwrap();
    let qp = nic.create_qp(&cq, &cq, CAPS).unwrap();
    qp.post_recv(1, Sge { addr: msg.as_ptr() as u64, len: 256, lkey: mmr.lkey }).unwrap();
    tell(format!("@addr {} {} {}", addr_line(&qp.addr()), mr.addr, mr.rkey));
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let peer: Vec<String> = lines.next().unwrap().unwrap().split(' ').map(str::to_owned).collect();
    let peer: Vec<&str> = peer.iter().map(String::as_str).collect();
    qp.connect(&parse_addr(&peer)).unwrap();
    tell("@connected".into());
    let mut second = None;
    for line in lines {
        let line = line.unwrap();
        if let Some(peer) = line.strip_prefix("second ") {
            // A second pair with no receive posted: a SEND to it waits until this process dies.
            let q = nic.create_qp(&cq, &cq, CAPS).unwrap();
            q.connect(&parse_addr(&peer.split(' ').collect::<Vec<_>>())).unwrap();
            tell(format!("@second {}", addr_line(&q.addr())));
            second = Some(q);
            continue;
        }
        match line.as_str() {
            "await-message" => {
                let c = wait(&cq, 1, Duration::from_secs(30));
                // The data written before the message is in place when the message arrives.
                let sum: u64 = buf.iter().map(|&b| u64::from(b)).sum();
                let text = String::from_utf8_lossy(&msg[..c[0].len as usize]).into_owned();
                tell(format!("@message {:?} {} {text} {sum}", c[0].status, c[0].len));
            }
            "dereg" => {
                nic.dereg_mr(&mr).unwrap();
                tell("@dereg".into());
            }
            _ => {
                drop(second);
                return;
            }
        }
    }
}

struct Target {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<std::process::ChildStdout>,
}

impl Target {
    fn line(&mut self, tag: &str) -> String {
        let mut l = String::new();
        loop {
            l.clear();
            assert!(self.out.read_line(&mut l).unwrap() > 0, "the target exited before {tag}");
            if let Some(rest) = l.trim().strip_prefix(tag) {
                return rest.trim().to_owned();
            }
        }
    }

    fn say(&mut self, s: &str) {
        writeln!(self.stdin, "{s}").unwrap();
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn two_processes_read_write_and_notify_over_the_fake_fabric_and_a_killed_target_fails_within_a_bound() {
    let dir = std::env::temp_dir().join(format!("gixl-fv-mp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // This process's own fabric, over the same directory (not from the environment: other tests share it).
    let fabric = gixl::verbs::fake::FakeFabric::new(2, dir.clone(), false);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("GIXL_CHILD", "verbs-target")
        .env("GIXL_FAKE_VERBS", "2")
        .env("GIXL_FAKE_VERBS_DIR", &dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut t = Target { stdin: child.stdin.take().unwrap(), out: BufReader::new(child.stdout.take().unwrap()), child };
    let line = t.line("@addr");
    let f: Vec<&str> = line.split(' ').collect();
    let remote = parse_addr(&f[..4]);
    let (raddr, rkey): (u64, u32) = (f[4].parse().unwrap(), f[5].parse().unwrap());

    use gixl::verbs::Fabric;
    let nic = fabric.open("fake0", 1).unwrap();
    let cq = nic.create_cq(4096).unwrap();
    let qp = nic.create_qp(&cq, &cq, CAPS).unwrap();
    qp.connect(&remote).unwrap();
    t.say(&addr_line(&qp.addr()));
    t.line("@connected");

    // 16 MiB READ as 1024 × 16 KiB, the remote blocks reversed, chained in one post, only the last signalled.
    let local = vec![0u8; SIZE];
    let lmr: Mr = nic.reg_mr(local.as_ptr() as u64, SIZE as u64, ALL).unwrap();
    let n = SIZE / BLOCK;
    let sges: Vec<[Sge; 1]> =
        (0..n).map(|i| [Sge { addr: lmr.addr + (i * BLOCK) as u64, len: BLOCK as u32, lkey: lmr.lkey }]).collect();
    let wrs: Vec<Wr> = (0..n)
        .map(|i| Wr {
            id: i as u64,
            op: Op::Read { raddr: raddr + ((n - 1 - i) * BLOCK) as u64, rkey },
            sges: &sges[i],
            signaled: i == n - 1,
        })
        .collect();
    qp.post_send(&wrs).unwrap();
    let c = wait(&cq, 1, Duration::from_secs(30));
    assert_eq!((c[0].id, c[0].status, c[0].kind), ((n - 1) as u64, WcStatus::Success, WcKind::Read));
    for i in 0..n {
        let want = (0..BLOCK).map(|j| (((n - 1 - i) * BLOCK + j) % 253) as u8);
        assert!(local[i * BLOCK..(i + 1) * BLOCK].iter().copied().eq(want), "block {i}");
    }

    // WRITE 16 MiB of ones, then a SEND: the target sums its buffer when the message arrives.
    let ones = vec![1u8; SIZE];
    let omr = nic.reg_mr(ones.as_ptr() as u64, SIZE as u64, ALL).unwrap();
    let msg = b"kv blocks ready".to_vec();
    let mmr = nic.reg_mr(msg.as_ptr() as u64, msg.len() as u64, ALL).unwrap();
    let w = [Sge { addr: omr.addr, len: SIZE as u32, lkey: omr.lkey }];
    let m = [Sge { addr: mmr.addr, len: msg.len() as u32, lkey: mmr.lkey }];
    t.say("await-message");
    qp.post_send(&[
        Wr { id: 100, op: Op::Write { raddr, rkey }, sges: &w, signaled: false },
        Wr { id: 101, op: Op::Send { imm: None }, sges: &m, signaled: true },
    ])
    .unwrap();
    assert_eq!(wait(&cq, 1, Duration::from_secs(30))[0].id, 101);
    assert_eq!(t.line("@message"), format!("Success 15 kv blocks ready {SIZE}"));

    // Deregistered on the target: the key is refused, the pair goes to error.
    t.say("dereg");
    t.line("@dereg");
    let one = [Sge { addr: lmr.addr, len: 4096, lkey: lmr.lkey }];
    qp.post_send(&[Wr { id: 200, op: Op::Read { raddr, rkey }, sges: &one, signaled: true }]).unwrap();
    assert_eq!(wait(&cq, 1, Duration::from_secs(10))[0].status, WcStatus::RemoteAccess);

    // A second pair whose SEND waits for a receive the target never posts; the target is killed: the request
    // fails RetryExceeded, promptly.
    let cq2 = nic.create_cq(16).unwrap();
    let qp2 = nic.create_qp(&cq2, &cq2, CAPS).unwrap();
    t.say(&format!("second {}", addr_line(&qp2.addr())));
    let line = t.line("@second");
    qp2.connect(&parse_addr(&line.split(' ').collect::<Vec<_>>())).unwrap();
    qp2.post_send(&[Wr { id: 300, op: Op::Send { imm: None }, sges: &m, signaled: true }]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let mut out = Vec::new();
    assert_eq!(cq2.poll(&mut out, 1).unwrap(), 0, "the SEND completed with no receive posted: {out:?}");
    let started = Instant::now();
    drop(t);
    let c = wait(&cq2, 1, Duration::from_secs(10));
    assert_eq!((c[0].id, c[0].status), (300, WcStatus::RetryExceeded));
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    // And a pair to an endpoint that is gone cannot connect.
    let qp3 = nic.create_qp(&cq2, &cq2, CAPS).unwrap();
    assert!(qp3.connect(&remote).unwrap_err().message().contains("no endpoint"));
    let _ = std::fs::remove_dir_all(&dir);
}
