//! The metadata listener's cap on agents added by LOADs pushed to it (`GIXL_MAX_PUSHED_PEERS`, set here for
//! this test binary alone). Without a cluster key anyone who reaches the listener can push metadata; the
//! pushes, as a raw-socket client sends them, add at most the cap, and the refusal changes nothing else.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use gixl::*;

const LOAD: u8 = 1;
const SEND: u8 = 2;

/// A listener frame: "GXMD" | kind | length u32 LE | payload.
fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = b"GXMD".to_vec();
    f.push(kind);
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

/// Push `blobs` as LOADs on one connection, then a SEND: the listener handles one connection's frames in
/// order, so its reply is the positive signal that every LOAD before it was acted on.
fn push(port: u16, blobs: &[Vec<u8>]) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for b in blobs {
        s.write_all(&frame(LOAD, b)).unwrap();
    }
    s.write_all(&frame(SEND, b"")).unwrap();
    let mut head = [0u8; 9];
    s.read_exact(&mut head).unwrap();
    assert_eq!(&head[..5], b"GXMD\x01", "the listener answers SEND with LOAD");
}

fn agent(name: &str, cfg: AgentConfig) -> Agent {
    let a = Agent::new(name, cfg).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    a
}

#[test]
fn pushed_loads_add_at_most_the_cap() {
    std::env::set_var("GIXL_MAX_PUSHED_PEERS", "3");
    let cfg = AgentConfig { listen_thread: true, listen_port: 0, ..Default::default() };
    let victim = agent("cap-victim", cfg);
    let port = victim.listen_port().unwrap();
    let peers: Vec<Agent> = (0..6).map(|i| agent(&format!("cap-peer-{i}"), AgentConfig::default())).collect();
    let md: Vec<Vec<u8>> = peers.iter().map(|p| p.local_md().unwrap()).collect();
    let loaded = |i: usize| victim.remote_incarnation(&format!("cap-peer-{i}")).is_ok();

    push(port, &md[..5]);
    assert_eq!((0..5).map(loaded).collect::<Vec<_>>(), [true, true, true, false, false]);
    // Pushing an agent already loaded again (a refresh) is not a new one; the application's own loads
    // do not count and are not capped.
    push(port, &md[..1]);
    assert!(loaded(0));
    victim.load_remote_md(&md[3]).unwrap();
    assert!(loaded(3));
    push(port, &md[4..5]);
    assert!(!loaded(4));
    // Invalidating a pushed agent frees its place.
    victim.invalidate_remote_md("cap-peer-0").unwrap();
    push(port, &md[4..6]);
    assert_eq!((0..6).map(loaded).collect::<Vec<_>>(), [false, true, true, true, true, false]);
}

/// Pushed LOADs of one agent that keep adding regions (partial metadata, same incarnation) merge only up to
/// the region cap (`GIXL_MAX_PUSHED_REGIONS`, 1000 here): the LOAD that would pass it is refused whole, and
/// the application's own load of the same blob is not capped.
#[test]
fn pushed_merges_add_at_most_the_region_cap() {
    std::env::set_var("GIXL_MAX_PUSHED_REGIONS", "1000");
    let cfg = AgentConfig { listen_thread: true, listen_port: 0, ..Default::default() };
    let victim = agent("regions-victim", cfg);
    let port = victim.listen_port().unwrap();
    let peer = agent("regions-peer", AgentConfig::default());
    let buf = vec![0u8; 4 * 600 * 64];
    let part = |k: usize| {
        let list = RegDList::with_descs(
            MemType::Dram,
            (0..600)
                .map(|i| RegDesc {
                    desc: Desc::new(buf.as_ptr() as u64 + ((k * 600 + i) * 64) as u64, 64, 0),
                    meta: vec![],
                })
                .collect(),
        );
        peer.register_mem(&list, &[]).unwrap();
        peer.local_partial_md(&list, true, &[]).unwrap()
    };
    let (p0, p1) = (part(0), part(1));
    let count = |k: usize| {
        let x =
            XferDList::with_descs(MemType::Dram, vec![Desc::new(buf.as_ptr() as u64 + (k * 600 * 64) as u64, 64, 0)]);
        victim.check_remote_md("regions-peer", &x).is_ok()
    };
    push(port, std::slice::from_ref(&p0));
    assert!(count(0), "600 regions: under the cap");
    push(port, std::slice::from_ref(&p1));
    assert!(!count(1), "600 more would make 1200: refused");
    push(port, &[p0]);
    assert!(count(0), "the same 600 again add nothing: still loaded");
    victim.load_remote_md(&p1).unwrap();
    assert!(count(1), "the application's own load is not capped");
}

/// This process's peak resident memory (VmHWM), in bytes.
fn peak_rss() -> u64 {
    let st = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 =
        st.lines().find(|l| l.starts_with("VmHWM:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

/// The child of `a_pushed_load_costs_at_most_four_times_its_size`: a victim with a listener, and a stranger's
/// LOAD of a new name carrying a real peer's connection info and region bytes, `GIXL_REGIONS` regions of 64
/// bytes each. Prints `@hwm <blob bytes> <peak RSS growth in bytes> <loaded: 0|1>`.
fn hwm_child() {
    let n: usize = std::env::var("GIXL_REGIONS").unwrap().parse().unwrap();
    let cfg = AgentConfig { listen_thread: true, listen_port: 0, ..Default::default() };
    let victim = agent("hwm-victim", cfg);
    let port = victim.listen_port().unwrap();
    let peer = agent("hwm-peer", AgentConfig::default());
    let buf = vec![0u8; 4096];
    let one = RegDList::with_descs(
        MemType::Dram,
        vec![RegDesc { desc: Desc::new(buf.as_ptr() as u64, 64, 0), meta: vec![] }],
    );
    peer.register_mem(&one, &[]).unwrap();
    let mut md = gixl::md::AgentMd::decode(&peer.local_md().unwrap()).unwrap();
    let (d, public) = md.sections[0].regions[0].clone();
    md.name = "hwm-big".into();
    md.sections[0].regions = (0..n as u64).map(|i| (Desc::new(d.addr + 64 * i, 64, 0), public.clone())).collect();
    let blob = md.encode();
    drop(md);
    // Building the blob raised the peak: start it again from what is resident now.
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let before = peak_rss();
    push(port, std::slice::from_ref(&blob));
    let grew = peak_rss().saturating_sub(before);
    let loaded = victim.remote_incarnation("hwm-big").is_ok() as u8;
    println!("\n@hwm {} {grew} {loaded}", blob.len());
}

#[test]
fn child_entry() {
    if std::env::var("GIXL_CHILD").as_deref() == Ok("hwm") {
        hwm_child();
    }
}

/// What a stranger's LOAD costs the listener's process at its peak. One of 2.5 million regions (15 MB, past
/// `GIXL_MAX_PUSHED_REGIONS`) is refused from its section headers, before a region is decoded: about its own size
/// (it cost 42 times its size, 620 MiB, decoded and resolved in full before the cap was checked). One of 60,000
/// regions is loaded: what it costs is bounded per region (the decoded blob, moved into the peer's table), so the
/// cap bounds it. Run in a child each, so that nothing else moves the peak.
#[test]
fn a_pushed_load_costs_its_size_when_refused_and_a_bounded_amount_per_region_when_loaded() {
    for (n, want_loaded) in [(2_500_000u64, false), (60_000, true)] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env("GIXL_CHILD", "hwm")
            .env("GIXL_REGIONS", n.to_string())
            .env_remove("GIXL_MAX_PUSHED_REGIONS")
            .env_remove("GIXL_MAX_PUSHED_REGIONS_TOTAL")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().find_map(|l| l.strip_prefix("@hwm ")).unwrap_or_else(|| panic!("child said: {text}"));
        let v: Vec<u64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
        let (blob, grew, loaded) = (v[0], v[1], v[2] == 1);
        eprintln!(
            "pushed LOAD of {n} regions, {blob} bytes: peak RSS +{} KiB ({:.1}x its size, {} bytes a region), loaded: {loaded}",
            grew >> 10,
            grew as f64 / blob as f64,
            grew / n
        );
        assert_eq!(loaded, want_loaded);
        if loaded {
            assert!(grew <= 320 * n, "{n} regions loaded: {grew} bytes at peak");
        } else {
            assert!(grew <= 2 * blob, "{n} regions refused: {grew} bytes at peak for a {blob}-byte LOAD");
        }
    }
}

/// Pushed LOADs of several agents together add at most `GIXL_MAX_PUSHED_REGIONS_TOTAL` regions (1500 here, each
/// agent 600): without it, 1024 agents of 65536 regions each could be pushed (about 15 GiB). Invalidating one
/// makes room again; the application's own loads do not count.
#[test]
fn pushed_loads_of_many_agents_add_at_most_the_total_region_cap() {
    std::env::set_var("GIXL_MAX_PUSHED_REGIONS_TOTAL", "1500");
    let cfg = AgentConfig { listen_thread: true, listen_port: 0, ..Default::default() };
    let victim = agent("total-victim", cfg);
    let port = victim.listen_port().unwrap();
    let bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 600 * 64]).collect();
    let peers: Vec<Agent> = (0..4).map(|i| agent(&format!("total-peer-{i}"), AgentConfig::default())).collect();
    let md: Vec<Vec<u8>> = peers
        .iter()
        .zip(&bufs)
        .map(|(p, b)| {
            let list = RegDList::with_descs(
                MemType::Dram,
                (0..600)
                    .map(|i| RegDesc { desc: Desc::new(b.as_ptr() as u64 + i * 64, 64, 0), meta: vec![] })
                    .collect(),
            );
            p.register_mem(&list, &[]).unwrap();
            p.local_md().unwrap()
        })
        .collect();
    let loaded = |i: usize| victim.remote_incarnation(&format!("total-peer-{i}")).is_ok();
    push(port, &md[..3]);
    assert_eq!((0..3).map(loaded).collect::<Vec<_>>(), [true, true, false], "1200 fit, 1800 do not");
    victim.invalidate_remote_md("total-peer-0").unwrap();
    push(port, &md[2..3]);
    assert!(loaded(2), "room again after an invalidation");
    victim.load_remote_md(&md[3]).unwrap();
    assert!(loaded(3), "the application's own load is not capped");
}
