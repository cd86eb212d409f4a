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
//! ```
//! The parser never allocates: it returns borrowed payloads, or "need more bytes", or an error after which
//! the connection is closed.

pub const MAGIC: &[u8; 4] = b"GXMD";
pub const HEADER: usize = 9;
/// Largest payload accepted (metadata of about ten million regions).
pub const MAX_PAYLOAD: usize = 64 << 20;

const LOAD: u8 = 1;
const SEND: u8 = 2;
const INVL: u8 = 3;
const ERR: u8 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Msg<'a> {
    Load(&'a [u8]),
    Send(&'a str),
    Invl(&'a str),
    Err(&'a str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireError(pub &'static str);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

pub fn encode(m: &Msg<'_>) -> Vec<u8> {
    let (kind, body): (u8, &[u8]) = match m {
        Msg::Load(b) => (LOAD, b),
        Msg::Send(s) => (SEND, s.as_bytes()),
        Msg::Invl(s) => (INVL, s.as_bytes()),
        Msg::Err(s) => (ERR, s.as_bytes()),
    };
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(MAGIC);
    out.push(kind);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
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
    if !(LOAD..=ERR).contains(&kind) {
        return Err(WireError("unknown metadata frame kind"));
    }
    let len = u32::from_le_bytes([buf[5], buf[6], buf[7], buf[8]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(WireError("metadata frame too large"));
    }
    if buf.len() - HEADER < len {
        return Ok(None);
    }
    let body = &buf[HEADER..HEADER + len];
    let text = || std::str::from_utf8(body).map_err(|_| WireError("agent name is not UTF-8"));
    let msg = match kind {
        LOAD => Msg::Load(body),
        SEND => Msg::Send(text()?),
        INVL => {
            let name = text()?;
            if name.is_empty() {
                return Err(WireError("invalidation without an agent name"));
            }
            Msg::Invl(name)
        }
        _ => Msg::Err(text()?),
    };
    Ok(Some((msg, HEADER + len)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_prefixes_and_concatenation() {
        let msgs = [Msg::Load(b"\0\x01md"), Msg::Send(""), Msg::Send("prefill"), Msg::Invl("decode-3"), Msg::Err("no")];
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
}
