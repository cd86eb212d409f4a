//! The metadata listener's wire format (gixl's own; not NIXL's `NIXLCOMM:` stream), as pure functions.
//!
//! A connection carries frames in both directions:
//! ```text
//! FRAME = "GXMD" | kind u8 | length u32 (little-endian) | payload (length bytes, at most MAX_PAYLOAD)
//! kind 1 LOAD  payload = an agent's metadata: the receiver loads it (`load_remote_md`)
//! kind 2 SEND  payload = the agent name asked for (may be empty): the receiver answers LOAD with its full
//!              metadata on the same connection, or ERR if it is another agent
//! kind 3 INVL  payload = an agent name: the receiver invalidates that agent (`invalidate_remote_md`)
//! kind 4 ERR   payload = a UTF-8 message for the other side's log
//! kind 5 CHAL  payload = 16-byte nonce: a listener with a cluster key sends it first on every connection
//! kind | 0x80  (1–3 only) the same request signed with the cluster key: payload = body | HMAC-SHA256 (32
//!              bytes) over the listener's nonce, the request's sequence number on the connection (from 0),
//!              the kind and the body; a listener with a key accepts only these, one without refuses them
//! ```
//! Replies (LOAD, ERR) are not signed: a LOAD carries metadata, which is itself signed under a cluster key.
//!
//! Sizes are checked from the header, before the payload is read: LOAD up to `MAX_PAYLOAD` (metadata of
//! about 2.5 million regions at ~6.3 bytes each; 1000 regions take 6.2 KB), names up to `MAX_NAME`, ERR
//! texts up to `MAX_TEXT`. The parser never allocates: it returns borrowed payloads, or "need more bytes",
//! or an error after which the connection is closed.

use crate::auth::{ClusterKey, TAG};

pub const MAGIC: &[u8; 4] = b"GXMD";
pub const HEADER: usize = 9;
/// Largest LOAD payload accepted.
pub const MAX_PAYLOAD: usize = 16 << 20;
/// Largest agent name in SEND / INVL (the metadata codec's limit).
pub const MAX_NAME: usize = 4096;
/// Largest ERR text.
pub const MAX_TEXT: usize = 16 << 10;
pub const NONCE: usize = 16;
pub const SIGNED: u8 = 0x80;

const LOAD: u8 = 1;
const SEND: u8 = 2;
const INVL: u8 = 3;
const ERR: u8 = 4;
const CHAL: u8 = 5;
const SIGN_DOMAIN: &[u8] = b"gixl-mdx-v1";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Msg<'a> {
    Load(&'a [u8]),
    Send(&'a str),
    Invl(&'a str),
    Err(&'a str),
    Chal(&'a [u8; NONCE]),
    /// A signed request, not yet verified: kind (1–3), body, tag. See `verify`.
    Signed(u8, &'a [u8], &'a [u8; TAG]),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireError(pub &'static str);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

fn parts<'a>(m: &Msg<'a>) -> (u8, &'a [u8], Option<&'a [u8; TAG]>) {
    match *m {
        Msg::Load(b) => (LOAD, b, None),
        Msg::Send(s) => (SEND, s.as_bytes(), None),
        Msg::Invl(s) => (INVL, s.as_bytes(), None),
        Msg::Err(s) => (ERR, s.as_bytes(), None),
        Msg::Chal(n) => (CHAL, &n[..], None),
        Msg::Signed(k, b, t) => (k | SIGNED, b, Some(t)),
    }
}

pub fn encode(m: &Msg<'_>) -> Vec<u8> {
    let (kind, body, tag) = parts(m);
    let len = body.len() + tag.map_or(0, |t| t.len());
    let mut out = Vec::with_capacity(HEADER + len);
    out.extend_from_slice(MAGIC);
    out.push(kind);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(body);
    if let Some(t) = tag {
        out.extend_from_slice(t);
    }
    out
}

fn tag(key: &ClusterKey, nonce: &[u8; NONCE], seq: u64, kind: u8, body: &[u8]) -> [u8; TAG] {
    key.sign(SIGN_DOMAIN, &[nonce, &seq.to_le_bytes(), &[kind], body])
}

/// Sign an unsigned request frame (LOAD, SEND, INVL, as made by `encode`) for the listener that sent
/// `nonce`, as the connection's request number `seq`. Other frames come back unchanged.
pub fn sign(frame: &[u8], key: &ClusterKey, nonce: &[u8; NONCE], seq: u64) -> Vec<u8> {
    match parse(frame) {
        Ok(Some((m @ (Msg::Load(_) | Msg::Send(_) | Msg::Invl(_)), _))) => {
            let (kind, body, _) = parts(&m);
            encode(&Msg::Signed(kind, body, &tag(key, nonce, seq, kind, body)))
        }
        _ => frame.to_vec(),
    }
}

/// Check a signed request against the nonce this side sent and the sequence number expected, and return
/// the request it carries.
pub fn verify<'a>(
    kind: u8,
    body: &'a [u8],
    t: &[u8; TAG],
    key: &ClusterKey,
    nonce: &[u8; NONCE],
    seq: u64,
) -> Result<Msg<'a>, WireError> {
    if !key.verify(SIGN_DOMAIN, &[nonce, &seq.to_le_bytes(), &[kind], body], t) {
        return Err(WireError("request signature does not match the cluster key"));
    }
    inner(kind, body)
}

fn inner(kind: u8, body: &[u8]) -> Result<Msg<'_>, WireError> {
    let text = || std::str::from_utf8(body).map_err(|_| WireError("agent name is not UTF-8"));
    Ok(match kind {
        LOAD => Msg::Load(body),
        SEND => Msg::Send(text()?),
        INVL => {
            let name = text()?;
            if name.is_empty() {
                return Err(WireError("invalidation without an agent name"));
            }
            Msg::Invl(name)
        }
        ERR => Msg::Err(text()?),
        _ => return Err(WireError("unknown metadata frame kind")),
    })
}

/// Largest payload of a frame kind (signed kinds: body limit plus the tag).
fn max_len(kind: u8) -> Option<usize> {
    let signed = kind & SIGNED != 0;
    let base = match kind & !SIGNED {
        LOAD => MAX_PAYLOAD,
        SEND | INVL => MAX_NAME,
        ERR if !signed => MAX_TEXT,
        CHAL if !signed => NONCE,
        _ => return None,
    };
    Some(base + if signed { TAG } else { 0 })
}

/// One frame from the front of `buf`: `Ok(None)` when more bytes are needed.
pub fn parse(buf: &[u8]) -> Result<Option<(Msg<'_>, usize)>, WireError> {
    let m = buf.len().min(MAGIC.len());
    if buf[..m] != MAGIC[..m] {
        return Err(WireError("not a gixl metadata frame"));
    }
    if buf.len() < HEADER {
        return Ok(None);
    }
    let kind = buf[4];
    let max = max_len(kind).ok_or(WireError("unknown metadata frame kind"))?;
    let len = u32::from_le_bytes([buf[5], buf[6], buf[7], buf[8]]) as usize;
    if len > max {
        return Err(WireError("metadata frame too large for its kind"));
    }
    if kind == CHAL && len != NONCE {
        return Err(WireError("challenge of the wrong length"));
    }
    if buf.len() - HEADER < len {
        return Ok(None);
    }
    let body = &buf[HEADER..HEADER + len];
    let msg = if kind & SIGNED != 0 {
        if len < TAG {
            return Err(WireError("signed frame shorter than its tag"));
        }
        let (b, t) = body.split_at(len - TAG);
        Msg::Signed(kind & !SIGNED, b, t.try_into().map_err(|_| WireError("bad tag"))?)
    } else if kind == CHAL {
        Msg::Chal(body.try_into().map_err(|_| WireError("bad nonce"))?)
    } else {
        inner(kind, body)?
    };
    Ok(Some((msg, HEADER + len)))
}

/// The length a frame's header announces, once the header is complete.
pub fn announced(buf: &[u8]) -> Option<usize> {
    (buf.len() >= HEADER).then(|| u32::from_le_bytes([buf[5], buf[6], buf[7], buf[8]]) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_prefixes_and_concatenation() {
        let t = [9u8; TAG];
        let msgs = [
            Msg::Load(b"\0\x01md"),
            Msg::Send(""),
            Msg::Send("prefill"),
            Msg::Invl("decode-3"),
            Msg::Err("no"),
            Msg::Chal(&[3; NONCE]),
            Msg::Signed(SEND, b"x", &t),
            Msg::Signed(LOAD, b"", &t),
        ];
        let mut all = Vec::new();
        for m in &msgs {
            let b = encode(m);
            assert_eq!(parse(&b).unwrap(), Some((*m, b.len())));
            for n in 0..b.len() {
                assert_eq!(parse(&b[..n]).unwrap(), None, "{m:?} prefix {n}");
            }
            all.extend_from_slice(&b);
        }
        let mut at = 0;
        let mut got = Vec::new();
        while let Some((m, n)) = parse(&all[at..]).unwrap() {
            got.push(m);
            at += n;
        }
        assert_eq!(got, msgs);
    }

    #[test]
    fn garbage_is_refused() {
        assert!(parse(b"NIXLCOMM:SEND").is_err());
        assert!(parse(b"G").unwrap().is_none());
        assert!(parse(b"GXMX").is_err());
        assert!(parse(&[b'G', b'X', b'M', b'D', 9, 0, 0, 0, 0]).is_err());
        assert!(parse(&[b'G', b'X', b'M', b'D', 1, 0xff, 0xff, 0xff, 0xff]).is_err(), "over the size limit");
        assert!(parse(&[b'G', b'X', b'M', b'D', 2, 0, 0x20, 0, 0]).is_err(), "a name over 4 KiB, from the header");
        assert!(parse(&[b'G', b'X', b'M', b'D', 5, 15, 0, 0, 0]).is_err(), "short challenge");
        assert!(parse(&[b'G', b'X', b'M', b'D', 0x84, 40, 0, 0, 0]).is_err(), "signed ERR");
        assert!(parse(&[b'G', b'X', b'M', b'D', 0x82, 31, 0, 0, 0]).map(|_| ()).is_ok(), "incomplete");
        let mut short = vec![b'G', b'X', b'M', b'D', 0x82, 31, 0, 0, 0];
        short.extend_from_slice(&[0; 31]);
        assert!(parse(&short).is_err(), "signed frame shorter than its tag");
        assert!(parse(&[b'G', b'X', b'M', b'D', 3, 0, 0, 0, 0]).is_err(), "empty invalidation");
        assert!(parse(&[b'G', b'X', b'M', b'D', 2, 1, 0, 0, 0, 0xff]).is_err(), "non-UTF-8 name");
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x % 40) as usize;
            let mut b: Vec<u8> = (0..n).map(|k| (x >> (k % 56)) as u8).collect();
            if i % 2 == 0 && b.len() >= 4 {
                b[..4].copy_from_slice(MAGIC);
            }
            let _ = parse(&b);
        }
    }

    #[test]
    fn signed_requests_verify_once_in_sequence_under_the_nonce() {
        let k = ClusterKey::parse("mdx-test-key-0123456789").unwrap();
        let other = ClusterKey::parse("mdx-other-key-012345678").unwrap();
        let n = [5u8; NONCE];
        let f = sign(&encode(&Msg::Invl("decode-0")), &k, &n, 3);
        let Ok(Some((Msg::Signed(kind, body, t), _))) = parse(&f) else { panic!("not signed") };
        assert_eq!(verify(kind, body, t, &k, &n, 3), Ok(Msg::Invl("decode-0")));
        assert!(verify(kind, body, t, &k, &n, 4).is_err(), "replayed at another position");
        assert!(verify(kind, body, t, &k, &[6; NONCE], 3).is_err(), "replayed on another connection");
        assert!(verify(kind, body, t, &other, &n, 3).is_err(), "another key");
        assert!(verify(SEND, body, t, &k, &n, 3).is_err(), "another kind");
        assert_eq!(sign(&encode(&Msg::Err("x")), &k, &n, 0), encode(&Msg::Err("x")), "replies stay unsigned");
    }
}
