//! The overlap check (`GIXL_CHECK_OVERLAP`, `AgentConfig::check_overlap`) over real transfers: the TCP target's
//! view of two initiators writing one range, `refuse` leaving the first request's data intact, and the
//! environment variable switching it on (in a child process: it is read when an agent is created).
//!
//! All three agents live in this process; the initiators reach the target over TCP on loopback
//! (`transport=tcp`), so the target's serving loops see two initiators by name, as they would across hosts.

use std::time::{Duration, Instant};

use gixl::overlap::Mode;
use gixl::*;

const MIB: usize = 1 << 20;

fn tcp_agent(name: &str, mode: Mode) -> Agent {
    let a = Agent::new(name, AgentConfig { check_overlap: mode, ..AgentConfig::default() }).unwrap();
    let p: Params =
        [("transport", "tcp"), ("tcp_addr", "127.0.0.1")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    a.create_backend("UCX", &p).unwrap();
    a
}

fn register(a: &Agent, b: &[u8]) {
    let d = Desc::new(b.as_ptr() as u64, b.len() as u64, 0);
    a.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: d, meta: vec![] }]), &[]).unwrap();
}

fn one(addr: u64, len: usize) -> XferDList {
    XferDList::with_descs(MemType::Dram, vec![Desc::new(addr, len as u64, 0)])
}

fn wait(a: &Agent, r: &XferReq) -> Result<Status> {
    let t = Instant::now();
    loop {
        match a.xfer_status(r)? {
            Status::InProg if t.elapsed() < Duration::from_secs(30) => std::thread::sleep(Duration::from_micros(100)),
            s => return Ok(s),
        }
    }
}

/// Two initiators WRITE into the target's buffer at `offsets` (one each), `len` bytes, again and again from
/// two threads, until the target has counted a conflict or `rounds` are done; the target's count.
fn two_writers(target_mode: Mode, offsets: [usize; 2], len: usize, rounds: usize) -> (u64, u64) {
    let t = tcp_agent("target", target_mode);
    let dst = vec![0u8; 2 * len];
    register(&t, &dst);
    let md = t.local_md().unwrap();
    let dst_addr = dst.as_ptr() as u64;
    let threads: Vec<_> = ["writer-a", "writer-b"]
        .into_iter()
        .zip(offsets)
        .map(|(name, off)| {
            let md = md.clone();
            std::thread::spawn(move || {
                let a = tcp_agent(name, Mode::Off);
                let src = vec![name.len() as u8; len];
                register(&a, &src);
                let target = a.load_remote_md(&md).unwrap();
                let x = a
                    .create_xfer_req(
                        XferOp::Write,
                        &one(src.as_ptr() as u64, len),
                        &one(dst_addr + off as u64, len),
                        &target,
                        &XferOpts::default(),
                    )
                    .unwrap();
                for _ in 0..rounds {
                    a.post_xfer_req(&x, NotifUpdate::Keep).unwrap();
                    assert_eq!(wait(&a, &x).unwrap(), Status::Success);
                }
                assert_eq!(a.overlap_counts(), (0, 0), "the initiators' own checks are off");
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
    let counts = t.overlap_counts();
    drop(dst);
    counts
}

/// Two decode workers WRITE the same prefill block: each initiator's own check cannot see the other, the TCP
/// target does (it serves both) and counts it; writing disjoint halves it counts nothing, and with the check
/// off at the target nothing is counted either.
#[test]
fn the_tcp_target_reports_two_initiators_writing_one_range() {
    let len = 8 * MIB;
    let (initiator, target) = two_writers(Mode::Warn, [0, 0], len, 40);
    assert_eq!(initiator, 0);
    assert!(target > 0, "40 rounds of two 8 MiB WRITEs onto one range and the target saw no overlap");
    assert_eq!(two_writers(Mode::Warn, [0, len], len, 20), (0, 0), "disjoint halves");
    assert_eq!(two_writers(Mode::Off, [0, 0], len, 10), (0, 0), "the check is off at the target");
}

/// `refuse`: a WRITE onto the block an in-flight WRITE of the same agent is writing fails with NOT_ALLOWED and
/// moves nothing; the first completes and the target holds exactly its bytes.
#[test]
fn refuse_leaves_the_first_request_and_its_data_intact() {
    let len = 32 * MIB;
    let t = tcp_agent("target-r", Mode::Off);
    let dst = vec![0u8; len];
    register(&t, &dst);
    let a = tcp_agent("writer-r", Mode::Refuse);
    let (first, second) = (vec![1u8; len], vec![2u8; len]);
    register(&a, &first);
    register(&a, &second);
    let target = a.load_remote_md(&t.local_md().unwrap()).unwrap();
    let w = |src: &[u8], notif: &str| {
        let o = XferOpts { notif: Some(notif.as_bytes().to_vec()), ..Default::default() };
        a.create_xfer_req(XferOp::Write, &one(src.as_ptr() as u64, len), &one(dst.as_ptr() as u64, len), &target, &o)
            .unwrap()
    };
    let (x1, x2) = (w(&first, "first"), w(&second, "second"));
    let mut refused = 0;
    for _ in 0..20 {
        if a.post_xfer_req(&x1, NotifUpdate::Keep).unwrap() == Status::Success {
            continue;
        }
        match a.post_xfer_req(&x2, NotifUpdate::Keep) {
            Err(e) => {
                assert_eq!(e.status(), Status::NotAllowed, "{e}");
                assert!(e.message().contains("\"first\"") && e.message().contains("\"second\""), "{e}");
                refused += 1;
                assert_eq!(wait(&a, &x1).unwrap(), Status::Success);
                assert!(dst.iter().all(|&b| b == 1), "the refused WRITE changed the target's bytes");
                break;
            }
            Ok(_) => {
                // The first had already finished: no conflict; both done, try again.
                let _ = wait(&a, &x2);
                let _ = wait(&a, &x1);
            }
        }
    }
    assert_eq!(refused, 1, "a 32 MiB WRITE over TCP always finished before the next post");
    assert_eq!(a.overlap_counts(), (1, 0));
}

/// `GIXL_CHECK_OVERLAP=refuse` switches the check on for an agent created with the default config (a child
/// process: the variable is read at agent creation); an unknown value fails agent creation.
#[test]
fn the_environment_variable_switches_it_on() {
    if std::env::var("GIXL_OVERLAP_CHILD").is_ok() {
        return;
    }
    let run = |value: &str| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "env_child", "--nocapture", "--test-threads=1"])
            .env("GIXL_OVERLAP_CHILD", "1")
            .env("GIXL_CHECK_OVERLAP", value)
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (ok, out) = run("refuse");
    assert!(ok && out.contains("@refused NIXL_ERR_NOT_ALLOWED"), "{out}");
    let (ok, out) = run("sometimes");
    assert!(ok && out.contains("@create NIXL_ERR_INVALID_PARAM"), "{out}");
}

#[test]
fn env_child() {
    if std::env::var("GIXL_OVERLAP_CHILD").is_err() {
        return;
    }
    let a = match Agent::new("env", AgentConfig::default()) {
        Ok(a) => a,
        Err(e) => {
            println!("@create {}", e.status().name());
            return;
        }
    };
    a.create_backend("UCX", &Params::new()).unwrap();
    let len = 64 * MIB;
    let (src, dst) = (vec![1u8; len], vec![0u8; len]);
    register(&a, &src);
    register(&a, &dst);
    let x = |n: &str| {
        a.create_xfer_req(
            XferOp::Read,
            &one(dst.as_ptr() as u64, len),
            &one(src.as_ptr() as u64, len),
            "env",
            &XferOpts { notif: Some(n.into()), ..Default::default() },
        )
        .unwrap()
    };
    let (x1, x2) = (x("1"), x("2"));
    for _ in 0..50 {
        if a.post_xfer_req(&x1, NotifUpdate::Keep).unwrap() == Status::Success {
            continue;
        }
        let r = a.post_xfer_req(&x2, NotifUpdate::Keep);
        let _ = wait(&a, &x1);
        match r {
            Err(e) => {
                println!("@refused {}", e.status().name());
                return;
            }
            Ok(_) => {
                let _ = wait(&a, &x2);
            }
        }
    }
    println!("@never-in-flight");
}
