//! With a cluster key (`GIXL_CLUSTER_KEY`, read once per process, hence a test binary of its own):
//! metadata is signed, agents that share the key transfer and notify over TCP, and a stranger holding a copy
//! of the metadata (and so the engine secret) but not the key cannot finish the TCP handshake.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

mod common;

use gixl::backend::engine::wire;
use gixl::*;
use hmac::{Hmac, Mac};
use sha2::Sha256;

const KEY: &str = "cluster-key-test-0123456789";

fn tcp_agent(name: &str) -> Agent {
    let a = Agent::new(name, AgentConfig::default()).unwrap();
    let p: Params =
        [("transport", "tcp"), ("tcp_addr", "127.0.0.1")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    a.create_backend("UCX", &p).unwrap();
    a
}

fn uvar(b: &[u8], at: &mut usize) -> u64 {
    let (mut v, mut shift) = (0u64, 0);
    loop {
        let x = b[*at];
        *at += 1;
        v |= u64::from(x & 0x7f) << shift;
        shift += 7;
        if x & 0x80 == 0 {
            return v;
        }
    }
}

/// What an attacker with a copy of the (signed) metadata reads from it: the incarnation, the engine secret
/// and the TCP address. Parsed by hand (format: `md.rs`, the engine's connection info).
fn endpoint(blob: &[u8]) -> (u128, u128, SocketAddr) {
    assert_eq!(blob[8] & 2, 2, "metadata is signed under a cluster key");
    let body = &blob[..blob.len() - 32];
    let mut b = body.to_vec();
    b[8] &= !2;
    let md = gixl::md::AgentMd::decode(&b).unwrap();
    let ci = &md.conns[0].1;
    let mut at = 1;
    let n = uvar(ci, &mut at) as usize;
    at += n;
    uvar(ci, &mut at); // pid
    uvar(ci, &mut at); // start time
    uvar(ci, &mut at); // gate fd
    at += 8; // gate address
    let n = uvar(ci, &mut at) as usize;
    at += n;
    let secret = u128::from_le_bytes(ci[at..at + 16].try_into().unwrap());
    at += 16;
    let port = u16::from_le_bytes(ci[at..at + 2].try_into().unwrap());
    (md.incarnation, secret, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// Open a data connection with a hello tagged with `secret`; true when the target accepts it.
fn handshake(addr: SocketAddr, inc: u128, secret: u128) -> bool {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut c = [0u8; wire::CHALLENGE_BYTES];
    s.read_exact(&mut c).unwrap();
    let nonce = wire::parse_challenge(&c).unwrap();
    let tag = wire::hello_tag(secret, wire::KIND_DATA, inc, &nonce, "mallory");
    let h = wire::encode_hello(&wire::Hello { kind: wire::KIND_DATA, incarnation: inc, tag, name: "mallory".into() });
    s.write_all(&h).unwrap();
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(1) if b[0] == wire::ACK)
}

/// The connection secret under the key, as `auth` derives it: HMAC-SHA256(key, domain | len | secret)[..16].
fn derived(secret: u128) -> u128 {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(KEY.as_bytes()).unwrap();
    m.update(b"gixl-conn-secret");
    m.update(&16u64.to_le_bytes());
    m.update(&secret.to_le_bytes());
    u128::from_le_bytes(m.finalize().into_bytes()[..16].try_into().unwrap())
}

#[test]
fn a_cluster_key_signs_metadata_and_keys_every_handshake() {
    // Before any agent exists: the key is read once per process.
    std::env::set_var("GIXL_CLUSTER_KEY", KEY);
    let a = tcp_agent("ck-initiator");
    let b = tcp_agent("ck-target");
    let src = vec![0x5au8; 1 << 20];
    let dst = vec![0u8; 1 << 20];
    let one = |buf: &[u8]| Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0);
    a.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: one(&dst), meta: vec![] }]), &[]).unwrap();
    b.register_mem(&RegDList::with_descs(MemType::Dram, vec![RegDesc { desc: one(&src), meta: vec![] }]), &[]).unwrap();
    let md = b.local_md().unwrap();
    // A tampered blob is refused; the genuine one loads.
    let mut bad = md.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 1;
    assert!(a.load_remote_md(&bad).is_err());
    assert_eq!(a.load_remote_md(&md).unwrap(), "ck-target");

    // Key holders: a READ with a notification over TCP (both handshakes keyed by the derived secret).
    let opts = XferOpts { notif: Some(b"done".to_vec()), ..Default::default() };
    let l = XferDList::with_descs(MemType::Dram, vec![one(&dst)]);
    let r = XferDList::with_descs(MemType::Dram, vec![one(&src)]);
    let req = a.create_xfer_req(XferOp::Read, &l, &r, "ck-target", &opts).unwrap();
    a.post_xfer_req(&req, NotifUpdate::Keep).unwrap();
    let t = Instant::now();
    loop {
        match a.xfer_status(&req).unwrap() {
            Status::InProg if t.elapsed() < Duration::from_secs(20) => std::thread::sleep(Duration::from_millis(1)),
            s => {
                assert_eq!(s, Status::Success);
                break;
            }
        }
    }
    assert!(dst.iter().all(|&x| x == 0x5a));
    let mut got = Vec::new();
    while got.is_empty() && t.elapsed() < Duration::from_secs(20) {
        got = b.notifs(&[]).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(got, vec![("ck-initiator".to_string(), b"done".to_vec())]);

    // A stranger with the metadata (the engine secret) but not the key: refused. With the key: accepted.
    let (inc, secret, addr) = endpoint(&md);
    assert!(!handshake(addr, inc, secret), "the bare secret must not open a connection under a cluster key");
    assert!(handshake(addr, inc, derived(secret)), "the key-derived secret opens it");

    // etcd: write access to the store is not enough. An unsigned copy of a real agent's metadata, put
    // straight into etcd, is not loaded; a key holder's own value is.
    let Some(etcd) = common::Etcd::start(None) else { return };
    std::env::set_var("NIXL_ETCD_ENDPOINTS", &etcd.endpoint);
    let c = tcp_agent("ck-etcd-reader");
    let d = tcp_agent("ck-etcd-writer");
    let mut unsigned = md[..md.len() - 32].to_vec();
    unsigned[8] &= !2;
    etcd_put(&etcd.endpoint, "/nixl/agents//ck-forged/metadata", &unsigned);
    c.fetch_remote_md("ck-forged", "", 0, "").unwrap();
    d.send_local_md("", 0).unwrap();
    c.fetch_remote_md("ck-etcd-writer", "", 0, "").unwrap();
    let t = Instant::now();
    // The worker runs requests in order: once the genuine value is loaded, the forged one was refused.
    while c.remote_incarnation("ck-etcd-writer").is_err() {
        assert!(t.elapsed() < Duration::from_secs(20), "the signed etcd value was not loaded");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(c.remote_incarnation("ck-target").is_err(), "an unsigned etcd value was loaded");
    std::env::remove_var("NIXL_ETCD_ENDPOINTS");
}

fn etcd_put(endpoint: &str, key: &str, value: &[u8]) {
    let hostport = endpoint.trim_start_matches("http://");
    let mut s = TcpStream::connect(hostport).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let body = format!(r#"{{"key":"{}","value":"{}"}}"#, b64(key.as_bytes()), b64(value));
    write!(
        s,
        "POST /v3/kv/put HTTP/1.1\r\nHost: {hostport}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
}

fn b64(b: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in b.chunks(3) {
        let n =
            (u32::from(c[0]) << 16) | (u32::from(*c.get(1).unwrap_or(&0)) << 8) | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
