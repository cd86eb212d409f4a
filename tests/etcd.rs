//! Metadata exchange through a real etcd on a loopback port: NIXL's key layout, send/fetch/partial with
//! labels, fetch waiting for a key, the prefix watch that invalidates a peer whose keys are deleted, and a
//! restarted peer. Skips when the etcd binary is not installed.
//!
//! The store is configured through the environment (`NIXL_ETCD_ENDPOINTS`), which is process-wide, so
//! everything runs in this one test.

mod common;

use std::time::{Duration, Instant};

use common::*;
use gixl::*;

fn agent(name: &str) -> Agent {
    let a = Agent::new(name, AgentConfig::default()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    a
}

fn one(buf: &[u8]) -> RegDList {
    RegDList::with_descs(
        MemType::Dram,
        vec![RegDesc { desc: Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0), meta: vec![] }],
    )
}

fn xl(buf: &[u8]) -> XferDList {
    XferDList::with_descs(MemType::Dram, vec![Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0)])
}

fn until(what: &str, limit: Duration, f: impl Fn() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
    t.elapsed()
}

fn loaded(a: &Agent, name: &str) -> bool {
    a.check_remote_md(name, &XferDList::new(MemType::Dram)).is_ok()
}

#[test]
fn etcd_send_fetch_watch_and_restart() {
    // gixl's log lines, kept so the test can wait for "gave up" instead of sleeping past the deadline.
    static LINES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    gixl::telemetry::log::set_sink(Box::new(|_, msg| {
        eprintln!("gixl log: {msg}");
        LINES.lock().unwrap().push(msg.to_owned());
    }));
    let Some(etcd) = Etcd::start(None) else { return };
    std::env::set_var("NIXL_ETCD_ENDPOINTS", &etcd.endpoint);
    std::env::remove_var("NIXL_ETCD_NAMESPACE");
    let long = Duration::from_secs(15);

    let p = agent("etcd-prefill");
    let d = agent("etcd-decode");
    let c = agent("etcd-other");
    let (b1, b2) = (vec![1u8; 8192], vec![2u8; 8192]);
    p.register_mem(&one(&b1), &[]).unwrap();
    p.register_mem(&one(&b2), &[]).unwrap();

    // Announce keys, then full metadata under "metadata"; the decode fetches it.
    until("announce", long, || etcd_keys(&etcd.endpoint).unwrap().contains(&"/nixl/agents//etcd-decode/".to_string()));
    p.send_local_md("", 0).unwrap();
    d.fetch_remote_md("etcd-prefill", "", 0, "").unwrap();
    let t = until("fetch", long, || d.check_remote_md("etcd-prefill", &xl(&b2)).is_ok());
    eprintln!("etcd fetch took {t:?}");
    let keys = etcd_keys(&etcd.endpoint).unwrap();
    assert!(keys.contains(&"/nixl/agents//etcd-prefill/metadata".to_string()), "{keys:?}");

    // Partial metadata needs a label through etcd; with one, another agent fetches exactly that.
    assert_eq!(p.send_local_partial_md(&one(&b1), true, &[], "", 0, "").unwrap_err().status(), Status::InvalidParam);
    p.send_local_partial_md(&one(&b1), true, &[], "", 0, "blocks-1").unwrap();
    c.fetch_remote_md("etcd-prefill", "", 0, "blocks-1").unwrap();
    until("partial fetch", long, || c.check_remote_md("etcd-prefill", &xl(&b1)).is_ok());
    assert_eq!(c.check_remote_md("etcd-prefill", &xl(&b2)).unwrap_err().status(), Status::NotFound);

    // A fetch issued before the key exists waits for it.
    let late = agent("etcd-late");
    p.fetch_remote_md("etcd-late", "", 0, "").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    late.send_local_md("", 0).unwrap();
    until("fetch of a key written later", long, || loaded(&p, "etcd-late"));

    // The prefill withdraws: every watcher invalidates it, and its keys are gone.
    p.invalidate_local_md("", 0).unwrap();
    let t = until("watch invalidation (decode)", long, || !loaded(&d, "etcd-prefill"));
    until("watch invalidation (other)", long, || !loaded(&c, "etcd-prefill"));
    eprintln!("watch invalidated the peer {t:?} after polling started");
    assert!(!etcd_keys(&etcd.endpoint).unwrap().iter().any(|k| k.starts_with("/nixl/agents//etcd-prefill/")));

    // A restarted prefill (new incarnation, same name) is fetched again and watched again.
    drop(p);
    let p2 = agent("etcd-prefill");
    let b3 = vec![3u8; 4096];
    p2.register_mem(&one(&b3), &[]).unwrap();
    p2.send_local_md("", 0).unwrap();
    d.fetch_remote_md("etcd-prefill", "", 0, "").unwrap();
    until("fetch of the restarted peer", long, || d.check_remote_md("etcd-prefill", &xl(&b3)).is_ok());
    let inc = d.remote_incarnation("etcd-prefill").unwrap();
    assert_eq!(inc, p2.incarnation());
    p2.invalidate_local_md("", 0).unwrap();
    until("watch invalidation of the restarted peer", long, || !loaded(&d, "etcd-prefill"));

    // A key that never appears: the fetch gives up after five seconds and loads nothing.
    let ghost_seeker = agent("etcd-seeker");
    ghost_seeker.fetch_remote_md("etcd-ghost", "", 0, "").unwrap();

    // A custom namespace, NIXL's layout under it.
    std::env::set_var("NIXL_ETCD_NAMESPACE", "/custom/ns");
    let n = agent("etcd-ns");
    n.send_local_md("", 0).unwrap();
    until("custom namespace", long, || {
        etcd_keys(&etcd.endpoint).unwrap().contains(&"/custom/ns/etcd-ns/metadata".to_string())
    });
    std::env::remove_var("NIXL_ETCD_NAMESPACE");

    // The positive signal: the fetch reports that it gave up (after 5 s); only then is "not loaded" final.
    until("the ghost fetch to give up", Duration::from_secs(20), || {
        LINES.lock().unwrap().iter().any(|l| l.contains("agent 'etcd-ghost'") && l.contains("did not appear"))
    });
    assert!(!loaded(&ghost_seeker, "etcd-ghost"));
    std::env::remove_var("NIXL_ETCD_ENDPOINTS");
}
