//! The TCP route's wire format, as pure functions: every parser takes bytes and returns a value, "need more
//! bytes", or an error; none allocates more than the bytes it was given justify, none panics, so each can be
//! fed garbage directly (see the tests at the bottom).
//!
//! Every connection starts with a challenge from the target, a HELLO from the initiator that proves it knows
//! the target's secret without sending it, and one byte from the target: `ACK`, or `NAK` (wrong incarnation
//! or tag) and a close. A close without that byte (handshake deadline, slots full, malformed HELLO) says
//! nothing about the target's incarnation:
//! ```text
//! CHALLENGE = "GIXLTCP2" | nonce (16 random bytes, new per connection)
//! HELLO     = "GIXLTCP2" | kind u8 (1 control, 2 data, 3..=8 other routes' exchanges) | target incarnation u128
//!             | tag u64 | name length u16 | initiator agent name (UTF-8, 1..=4096 bytes)
//! tag       = SipHash-2-4, keyed by the 128-bit secret, of
//!             "gixl-hello" | kind | target incarnation | nonce | name
//! ```
//! The secret travels only inside the target's metadata: an address that turns out to reach someone else
//! learns nothing it could replay, since every connection gets a fresh nonce.
//! Control connections then carry frames both ways: `length u32 | kind u8 | body`, length = 1 + body length,
//! at most `1 + MAX_NOTIF`. Kinds: PING (initiator → target, empty), PONG (target → initiator, empty),
//! NOTIF (initiator → target, the message).
//!
//! Data connections carry requests from the initiator and replies from the target:
//! ```text
//! REQUEST = "GD" | op u8 (0 READ, 1 WRITE) | 0 u8 | nseg u32 | total u64        (16 bytes)
//!           | nseg × (region addr u64 | region len u64 | addr u64 | len u64)     (32 bytes each)
//!           | WRITE only: `total` payload bytes, the segments' bytes in order
//! REPLY   = status u8 (0 OK, 1 DENIED) | 7 zero bytes
//!           | READ + OK only: `total` payload bytes
//! ```
//! `region` names a registration of the target exactly (address and length as registered); the target
//! serves a segment only if that registration exists in its own table and the segment lies inside it.
//! All integers are little-endian.

/// The handshake's MAC and its comparison live with the other MACs (`crate::auth`); named here too, where the
/// wire format is.
pub use crate::auth::{secret_hello_tag as hello_tag, siphash24, tags_match};
use std::collections::BTreeMap;

use crate::backend::XferOp;

pub const HELLO_MAGIC: &[u8; 8] = b"GIXLTCP2";
pub const CHALLENGE_BYTES: usize = 24;
pub const KIND_CTRL: u8 = 1;
pub const KIND_DATA: u8 = 2;
/// Other routes' exchanges on this listener, a kind each, handed to the route that took it
/// (`TcpShared::set_side`; the RDMA route's queue-pair exchange is 3).
pub const KIND_ROUTES: std::ops::RangeInclusive<u8> = 3..=8;
/// The target's answer to a good HELLO.
pub const ACK: u8 = 0xA5;
/// The target's answer to a HELLO for another incarnation or with a wrong tag, before it closes: the
/// incarnation the initiator was built against is not at this address (a proven failure, unlike a close
/// without a word, which may be overload or a stranger's flood).
pub const NAK: u8 = 0x5A;
pub const MAX_NAME: usize = 4096;
const HELLO_FIXED: usize = 8 + 1 + 16 + 8 + 2;

pub const CTRL_PING: u8 = 1;
pub const CTRL_PONG: u8 = 2;
pub const CTRL_NOTIF: u8 = 3;

pub const REQ_MAGIC: &[u8; 2] = b"GD";
pub const REQ_HEADER: usize = 16;
pub const SEG_BYTES: usize = 32;
/// Segments per request (one `readv`/`sendmsg` worth of iovecs on the target).
pub const MAX_SEGS: usize = 1024;
/// Payload bytes per request; larger transfers are cut into several requests.
pub const MAX_REQ_BYTES: u64 = 32 << 20;
pub const REPLY_BYTES: usize = 8;
pub const REPLY_OK: u8 = 0;
pub const REPLY_DENIED: u8 = 1;

/// Why bytes from a peer were refused. The connection is closed after any of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireError(pub &'static str);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

pub fn encode_challenge(nonce: &[u8; 16]) -> [u8; CHALLENGE_BYTES] {
    let mut c = [0u8; CHALLENGE_BYTES];
    c[..8].copy_from_slice(HELLO_MAGIC);
    c[8..].copy_from_slice(nonce);
    c
}

pub fn parse_challenge(b: &[u8; CHALLENGE_BYTES]) -> Result<[u8; 16], WireError> {
    if &b[..8] != HELLO_MAGIC {
        return Err(WireError("not a gixl TCP endpoint"));
    }
    Ok(arr(&b[8..]))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub kind: u8,
    pub incarnation: u128,
    pub tag: u64,
    pub name: String,
}

pub fn encode_hello(h: &Hello) -> Vec<u8> {
    let mut out = Vec::with_capacity(HELLO_FIXED + h.name.len());
    out.extend_from_slice(HELLO_MAGIC);
    out.push(h.kind);
    out.extend_from_slice(&h.incarnation.to_le_bytes());
    out.extend_from_slice(&h.tag.to_le_bytes());
    out.extend_from_slice(&(h.name.len() as u16).to_le_bytes());
    out.extend_from_slice(h.name.as_bytes());
    out
}

/// `Ok(None)`: not enough bytes yet. `Ok(Some((hello, used)))` otherwise.
pub fn parse_hello(buf: &[u8]) -> Result<Option<(Hello, usize)>, WireError> {
    // Reject a wrong magic as soon as the bytes that differ arrive.
    let m = buf.len().min(HELLO_MAGIC.len());
    if buf[..m] != HELLO_MAGIC[..m] {
        return Err(WireError("not a gixl TCP connection"));
    }
    if buf.len() < HELLO_FIXED {
        return Ok(None);
    }
    let kind = buf[8];
    if kind != KIND_CTRL && kind != KIND_DATA && !KIND_ROUTES.contains(&kind) {
        return Err(WireError("unknown connection kind"));
    }
    let incarnation = u128::from_le_bytes(arr(&buf[9..25]));
    let tag = u64::from_le_bytes(arr(&buf[25..33]));
    let n = u16::from_le_bytes([buf[33], buf[34]]) as usize;
    if n == 0 || n > MAX_NAME {
        return Err(WireError("bad agent name length"));
    }
    if buf.len() < HELLO_FIXED + n {
        return Ok(None);
    }
    let name =
        std::str::from_utf8(&buf[HELLO_FIXED..HELLO_FIXED + n]).map_err(|_| WireError("agent name is not UTF-8"))?;
    Ok(Some((Hello { kind, incarnation, tag, name: name.to_owned() }, HELLO_FIXED + n)))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtrlMsg<'a> {
    Ping,
    Pong,
    Notif(&'a [u8]),
}

pub fn encode_ctrl_head(kind: u8, body_len: usize) -> [u8; 5] {
    let mut h = [0u8; 5];
    h[..4].copy_from_slice(&((body_len + 1) as u32).to_le_bytes());
    h[4] = kind;
    h
}

/// One control frame from the front of `buf`: `Ok(None)` when incomplete.
pub fn parse_ctrl(buf: &[u8], max_body: usize) -> Result<Option<(CtrlMsg<'_>, usize)>, WireError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_le_bytes(arr(&buf[..4])) as usize;
    if len == 0 || len > max_body.saturating_add(1) {
        return Err(WireError("control frame length out of range"));
    }
    if buf.len() - 4 < len {
        return Ok(None);
    }
    let body = &buf[5..4 + len];
    let msg = match buf[4] {
        CTRL_PING if body.is_empty() => CtrlMsg::Ping,
        CTRL_PONG if body.is_empty() => CtrlMsg::Pong,
        CTRL_NOTIF => CtrlMsg::Notif(body),
        _ => return Err(WireError("unknown control frame")),
    };
    Ok(Some((msg, 4 + len)))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReqHeader {
    pub op: XferOp,
    pub nseg: usize,
    pub total: u64,
}

/// One segment of a request as the initiator names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireSeg {
    pub region: u64,
    pub region_len: u64,
    pub addr: u64,
    pub len: u64,
}

pub fn encode_req(op: XferOp, segs: &[WireSeg], out: &mut Vec<u8>) {
    out.clear();
    let total: u64 = segs.iter().map(|s| s.len).sum();
    out.extend_from_slice(REQ_MAGIC);
    out.push(op as u8);
    out.push(0);
    out.extend_from_slice(&(segs.len() as u32).to_le_bytes());
    out.extend_from_slice(&total.to_le_bytes());
    for s in segs {
        for v in [s.region, s.region_len, s.addr, s.len] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

pub fn parse_req_header(b: &[u8; REQ_HEADER]) -> Result<ReqHeader, WireError> {
    if &b[..2] != REQ_MAGIC || b[3] != 0 {
        return Err(WireError("bad request header"));
    }
    let op = match b[2] {
        0 => XferOp::Read,
        1 => XferOp::Write,
        _ => return Err(WireError("unknown request op")),
    };
    let nseg = u32::from_le_bytes(arr(&b[4..8])) as usize;
    let total = u64::from_le_bytes(arr(&b[8..16]));
    if nseg == 0 || nseg > MAX_SEGS {
        return Err(WireError("segment count out of range"));
    }
    if total > MAX_REQ_BYTES {
        return Err(WireError("request too large"));
    }
    Ok(ReqHeader { op, nseg, total })
}

/// The segment table that follows a header; their lengths must add up to the header's total.
pub fn parse_segs(b: &[u8], h: &ReqHeader) -> Result<Vec<WireSeg>, WireError> {
    if b.len() != h.nseg * SEG_BYTES {
        return Err(WireError("segment table has the wrong size"));
    }
    let mut segs = Vec::with_capacity(h.nseg);
    let mut sum = 0u64;
    for c in b.chunks_exact(SEG_BYTES) {
        let v = |i: usize| u64::from_le_bytes(arr(&c[i * 8..i * 8 + 8]));
        let s = WireSeg { region: v(0), region_len: v(1), addr: v(2), len: v(3) };
        sum = sum.checked_add(s.len).ok_or(WireError("segment lengths overflow"))?;
        segs.push(s);
    }
    if sum != h.total {
        return Err(WireError("segment lengths do not add up to the total"));
    }
    Ok(segs)
}

/// Registered regions: (address, length) → how many registrations of exactly that range.
pub type RegionTable = BTreeMap<(u64, u64), u32>;

/// Is every segment inside a registration that exists in `table`? Lookups are O(log n).
pub fn segs_allowed(table: &RegionTable, segs: &[WireSeg]) -> bool {
    segs.iter().all(|s| {
        let Some(rend) = s.region.checked_add(s.region_len) else { return false };
        let Some(end) = s.addr.checked_add(s.len) else { return false };
        s.len > 0 && table.get(&(s.region, s.region_len)).is_some_and(|&n| n > 0) && s.addr >= s.region && end <= rend
    })
}

pub fn encode_reply(status: u8) -> [u8; REPLY_BYTES] {
    let mut r = [0u8; REPLY_BYTES];
    r[0] = status;
    r
}

/// `Ok(true)` for OK, `Ok(false)` for DENIED.
pub fn parse_reply(b: &[u8; REPLY_BYTES]) -> Result<bool, WireError> {
    if b[1..] != [0u8; 7] {
        return Err(WireError("bad reply"));
    }
    match b[0] {
        REPLY_OK => Ok(true),
        REPLY_DENIED => Ok(false),
        _ => Err(WireError("bad reply status")),
    }
}

fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[..N]);
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xorshift(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    #[test]
    fn tags_bind_every_parameter() {
        let n = [7u8; 16];
        let t = hello_tag(1, KIND_DATA, 2, &n, "a");
        assert!(tags_match(t, hello_tag(1, KIND_DATA, 2, &n, "a")));
        for other in [
            hello_tag(3, KIND_DATA, 2, &n, "a"),
            hello_tag(1, KIND_CTRL, 2, &n, "a"),
            hello_tag(1, KIND_DATA, 4, &n, "a"),
            hello_tag(1, KIND_DATA, 2, &[8u8; 16], "a"),
            hello_tag(1, KIND_DATA, 2, &n, "b"),
        ] {
            assert!(!tags_match(t, other));
        }
        let c = encode_challenge(&n);
        assert_eq!(parse_challenge(&c).unwrap(), n);
        let mut bad = c;
        bad[0] = b'X';
        assert!(parse_challenge(&bad).is_err());
    }

    #[test]
    fn hello_round_trip_prefixes_and_garbage() {
        let h = Hello { kind: KIND_DATA, incarnation: 7 << 100 | 3, tag: u64::MAX - 5, name: "decode-0".into() };
        let b = encode_hello(&h);
        assert_eq!(parse_hello(&b).unwrap(), Some((h.clone(), b.len())));
        for n in 0..b.len() {
            assert_eq!(parse_hello(&b[..n]).unwrap(), None, "prefix {n}");
        }
        assert!(parse_hello(b"GET / HTTP/1.1\r\n").is_err());
        assert!(parse_hello(b"GIXLTCP3").is_err());
        let mut bad = b.clone();
        bad[8] = 9;
        assert!(parse_hello(&bad).is_err());
        let mut bad = b.clone();
        bad[33] = 0;
        bad[34] = 0;
        assert!(parse_hello(&bad).is_err());
        let mut bad = b.clone();
        bad[33] = 0xff;
        bad[34] = 0xff;
        assert!(parse_hello(&bad).is_err());
        assert!(parse_hello(b"GIXLTCP1").is_err(), "the old version is refused");
    }

    #[test]
    fn tags_compare() {
        assert!(tags_match(5, 5));
        assert!(!tags_match(5, 4));
        assert!(!tags_match(1 << 63, 0));
    }

    #[test]
    fn ctrl_frames() {
        let mut b = encode_ctrl_head(CTRL_PING, 0).to_vec();
        b.extend_from_slice(&encode_ctrl_head(CTRL_NOTIF, 3));
        b.extend_from_slice(b"a\0b");
        let (m, n) = parse_ctrl(&b, 100).unwrap().unwrap();
        assert_eq!((m, n), (CtrlMsg::Ping, 5));
        assert_eq!(parse_ctrl(&b[5..], 100).unwrap().unwrap(), (CtrlMsg::Notif(b"a\0b"), 8));
        assert_eq!(parse_ctrl(&b[5..12], 100).unwrap(), None);
        assert!(parse_ctrl(&b[5..], 2).is_err(), "over the limit");
        assert!(parse_ctrl(&[0, 0, 0, 0, 1], 10).is_err());
        assert!(parse_ctrl(&[2, 0, 0, 0, CTRL_PING, 0], 10).is_err(), "ping with a body");
        assert!(parse_ctrl(&[1, 0, 0, 0, 77], 10).is_err());
    }

    fn table() -> RegionTable {
        [((0x1000, 0x1000), 1), ((0x10_0000, 0x100), 2)].into_iter().collect()
    }

    fn seg(region: u64, region_len: u64, addr: u64, len: u64) -> WireSeg {
        WireSeg { region, region_len, addr, len }
    }

    #[test]
    fn requests_round_trip_and_bounds_are_enforced() {
        let segs = vec![seg(0x1000, 0x1000, 0x1000, 0x10), seg(0x10_0000, 0x100, 0x10_00f0, 0x10)];
        let mut b = Vec::new();
        encode_req(XferOp::Write, &segs, &mut b);
        let h = parse_req_header(b[..16].try_into().unwrap()).unwrap();
        assert_eq!(h, ReqHeader { op: XferOp::Write, nseg: 2, total: 0x20 });
        let got = parse_segs(&b[16..], &h).unwrap();
        assert_eq!(got, segs);
        assert!(segs_allowed(&table(), &got));

        let t = table();
        // One byte past the end of a registration.
        assert!(!segs_allowed(&t, &[seg(0x1000, 0x1000, 0x1ff1, 0x10)]));
        // Before the start.
        assert!(!segs_allowed(&t, &[seg(0x1000, 0x1000, 0xfff, 0x10)]));
        // A registration that does not exist, even if it would contain the range.
        assert!(!segs_allowed(&t, &[seg(0x1000, 0x2000, 0x1800, 0x10)]));
        assert!(!segs_allowed(&t, &[seg(0, u64::MAX, 0x1000, 0x10)]));
        // Overflowing arithmetic.
        assert!(!segs_allowed(&t, &[seg(0x1000, 0x1000, u64::MAX - 4, 0x10)]));
        assert!(!segs_allowed(&t, &[seg(u64::MAX, 2, u64::MAX, 1)]));
        // Empty segments are refused.
        assert!(!segs_allowed(&t, &[seg(0x1000, 0x1000, 0x1000, 0)]));
        // A released registration.
        let mut t2 = t.clone();
        t2.insert((0x1000, 0x1000), 0);
        assert!(!segs_allowed(&t2, &[seg(0x1000, 0x1000, 0x1000, 1)]));

        // Header checks.
        let mut hb: [u8; 16] = b[..16].try_into().unwrap();
        hb[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert!(parse_req_header(&hb).is_err());
        hb[4..8].copy_from_slice(&(MAX_SEGS as u32 + 1).to_le_bytes());
        assert!(parse_req_header(&hb).is_err());
        hb[4..8].copy_from_slice(&1u32.to_le_bytes());
        hb[8..16].copy_from_slice(&(MAX_REQ_BYTES + 1).to_le_bytes());
        assert!(parse_req_header(&hb).is_err());
        // Lengths that do not add up.
        let h1 = ReqHeader { op: XferOp::Read, nseg: 2, total: 0x21 };
        assert!(parse_segs(&b[16..], &h1).is_err());
        let h2 = ReqHeader { op: XferOp::Read, nseg: 3, total: 0x20 };
        assert!(parse_segs(&b[16..], &h2).is_err());
    }

    #[test]
    fn replies() {
        assert!(parse_reply(&encode_reply(REPLY_OK)).unwrap());
        assert!(!parse_reply(&encode_reply(REPLY_DENIED)).unwrap());
        assert!(parse_reply(&[7, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(parse_reply(&[0, 0, 0, 1, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let t = table();
        for round in 0..20_000 {
            let n = (xorshift(&mut x) % 96) as usize;
            let mut b: Vec<u8> = (0..n).map(|_| xorshift(&mut x) as u8).collect();
            if round % 3 == 0 && b.len() >= 8 {
                b[..8].copy_from_slice(HELLO_MAGIC);
            }
            if round % 5 == 0 && b.len() >= 4 {
                b[..2].copy_from_slice(REQ_MAGIC);
                b[3] = 0;
            }
            let _ = parse_hello(&b);
            let _ = parse_ctrl(&b, 64);
            if b.len() >= REQ_HEADER {
                if let Ok(h) = parse_req_header(b[..REQ_HEADER].try_into().unwrap()) {
                    if let Ok(s) = parse_segs(&b[REQ_HEADER..], &h) {
                        let _ = segs_allowed(&t, &s);
                    }
                }
            }
            if b.len() >= REPLY_BYTES {
                let _ = parse_reply(b[..REPLY_BYTES].try_into().unwrap());
            }
        }
    }
}
