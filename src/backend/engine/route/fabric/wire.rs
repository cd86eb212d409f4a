//! The libfabric route's bytes, as pure functions: its connection-info section (the provider and the
//! endpoint's address), its section of a region's ticket (the region's key, see `FabricKey`) and the greeting
//! on a `KIND` connection (after the TCP route's authenticated handshake).
//!
//! ```text
//! SECTION  = provider (u8 length | bytes) | address (u16 length | bytes)
//! TICKET   = key u64 | base u64      (the address a peer names for a byte is its virtual address - base)
//! GREETING = "GXFA" | address (u16 length | bytes)         initiator → target: its endpoint's address
//! ANSWER   = status u8 (0 ok, else refused)                 target → initiator
//! SCRATCH  = key u64 | address u64                          initiator → target, after an ok answer: where
//!                                                           the target READs a byte to fence a retired region
//! ```
//! All integers little-endian. The connection stays open while the initiator's route lives: the target keeps
//! driving its endpoint's progress while any is open.

use crate::fabric::RemoteKey;
use crate::md::{put_bytes, put_uvar};
use crate::status::{Error, Result};

/// Its connection-info section's id (layout 4, see `conn`).
pub(crate) const SECTION: u64 = 6;
/// Its connection kind on the TCP listener (one of `tcp::wire::KIND_ROUTES`).
pub(crate) const KIND: u8 = 4;
/// Its region-ticket section (ids shared by every route's ticket sections: RDMA's are 1 to 3).
const TICKET: u64 = 16;

pub(crate) const MAGIC: &[u8; 4] = b"GXFA";
/// The longest endpoint address taken (libfabric's are tens of bytes).
pub(crate) const MAX_ADDR: usize = 4096;
pub(crate) const ANSWER_OK: u8 = 0;
pub(crate) const ANSWER_REFUSED: u8 = 1;

/// What a peer advertises: its provider (libfabric's full name) and its endpoint's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Advert {
    pub(crate) provider: String,
    pub(crate) addr: Vec<u8>,
}

pub(crate) fn encode_section(a: &Advert) -> Vec<u8> {
    let p = &a.provider.as_bytes()[..a.provider.len().min(255)];
    let mut out = vec![p.len() as u8];
    out.extend_from_slice(p);
    out.extend_from_slice(&(a.addr.len().min(MAX_ADDR) as u16).to_le_bytes());
    out.extend_from_slice(&a.addr[..a.addr.len().min(MAX_ADDR)]);
    out
}

/// A section's advert; bytes after it (a later release's fields) are skipped.
pub(crate) fn decode_section(b: &[u8]) -> Option<Advert> {
    let n = *b.first()? as usize;
    let provider = std::str::from_utf8(b.get(1..1 + n)?).ok()?.to_owned();
    let len = u16::from_le_bytes(b.get(1 + n..3 + n)?.try_into().ok()?) as usize;
    if len == 0 || len > MAX_ADDR {
        return None;
    }
    Some(Advert { provider, addr: b.get(3 + n..3 + n + len)?.to_vec() })
}

/// What libfabric peers need of a region: its key, and what to subtract from a virtual address to get the
/// address its provider names (0 where the provider uses virtual addresses, else the region's start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FabricKey {
    pub(crate) key: u64,
    pub(crate) base: u64,
}

impl FabricKey {
    pub(crate) fn put_sections(&self, out: &mut Vec<u8>) {
        put_uvar(out, TICKET);
        let mut b = self.key.to_le_bytes().to_vec();
        b.extend_from_slice(&self.base.to_le_bytes());
        put_bytes(out, &b);
    }
}

/// The key among a region's ticket sections (others' are not its business); None where it has none.
pub(crate) fn read_ticket(sections: &[(u64, &[u8])]) -> Result<Option<FabricKey>> {
    let Some(&(_, sec)) = sections.iter().find(|(id, _)| *id == TICKET) else { return Ok(None) };
    let bad = || Error::mismatch("malformed libfabric key in a region ticket");
    if sec.len() != 16 {
        return Err(bad());
    }
    let word = |i: usize| sec[i..i + 8].try_into().map(u64::from_le_bytes).map_err(|_| bad());
    Ok(Some(FabricKey { key: word(0)?, base: word(8)? }))
}

pub(crate) fn encode_greeting(addr: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&(addr.len() as u16).to_le_bytes());
    out.extend_from_slice(addr);
    out
}

pub(crate) const GREETING_HEAD: usize = 6;

/// The scratch's length on the greeting connection.
pub(crate) const SCRATCH: usize = 16;

pub(crate) fn encode_scratch(k: RemoteKey) -> [u8; SCRATCH] {
    let mut out = [0u8; SCRATCH];
    out[..8].copy_from_slice(&k.key.to_le_bytes());
    out[8..].copy_from_slice(&k.addr.to_le_bytes());
    out
}

/// The scratch the first `SCRATCH` bytes after the answer say; None until that many arrived.
pub(crate) fn decode_scratch(b: &[u8]) -> Option<RemoteKey> {
    let w = |i: usize| b.get(i..i + 8).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes);
    Some(RemoteKey { key: w(0)?, addr: w(8)? })
}

/// The address length a greeting whose first bytes are `head` announces; None where they are no greeting.
pub(crate) fn greeting_len(head: &[u8; GREETING_HEAD]) -> Option<usize> {
    let n = u16::from_le_bytes([head[4], head[5]]) as usize;
    (&head[..4] == MAGIC && (1..=MAX_ADDR).contains(&n)).then_some(n)
}

/// For the fuzz targets: every decoder on `b`; what decodes encodes back to bytes that decode the same.
pub(crate) fn fuzz(b: &[u8]) {
    if let Some(a) = decode_section(b) {
        assert_eq!(decode_section(&encode_section(&a)).as_ref(), Some(&a), "libfabric section changed");
    }
    if let Ok(Some(k)) = read_ticket(&[(TICKET, b)]) {
        let mut out = Vec::new();
        k.put_sections(&mut out);
        assert_eq!(&out[2..], b, "libfabric ticket changed");
    }
    if let Some(k) = decode_scratch(b) {
        assert_eq!(encode_scratch(k)[..], b[..SCRATCH], "libfabric scratch changed");
    }
    if let Some(head) = b.get(..GREETING_HEAD).and_then(|h| <&[u8; GREETING_HEAD]>::try_from(h).ok()) {
        if let Some(n) = greeting_len(head) {
            assert_eq!(encode_greeting(&vec![0; n])[..GREETING_HEAD], head[..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_tickets_and_greetings_round_trip_and_garbage_is_refused() {
        let a = Advert { provider: "tcp;ofi_rxm".into(), addr: vec![2, 0, 0x1f, 0x90, 127, 0, 0, 1] };
        let mut b = encode_section(&a);
        assert_eq!(decode_section(&b), Some(a.clone()));
        b.extend_from_slice(b"a later field");
        assert_eq!(decode_section(&b), Some(a), "trailing bytes skipped");
        for n in 0..20 {
            assert!(decode_section(&b[..n]).is_none(), "prefix {n}");
        }
        assert!(decode_section(&[0, 0, 0]).is_none(), "an empty address");
        assert!(decode_section(&[1, 0xff, 1, 0, 9]).is_none(), "a provider name that is not UTF-8");

        let k = FabricKey { key: 0x1234_5678_9abc, base: 0x7f00_0000_1000 };
        let mut t = Vec::new();
        k.put_sections(&mut t);
        assert_eq!(t[0] as u64, TICKET);
        assert_eq!(read_ticket(&[(1, b"rdma's"), (TICKET, &t[2..])]).unwrap(), Some(k));
        assert_eq!(read_ticket(&[(1, b"rdma's")]).unwrap(), None);
        assert!(read_ticket(&[(TICKET, &t[2..17])]).is_err());

        let g = encode_greeting(b"addr");
        assert_eq!(greeting_len(g[..GREETING_HEAD].try_into().unwrap()), Some(4));
        assert!(greeting_len(b"GXFA\0\0").is_none() && greeting_len(b"XXFA\x04\0").is_none());
        assert!(greeting_len(&[b'G', b'X', b'F', b'A', 0x01, 0x10]).is_none(), "longer than MAX_ADDR");

        let k = RemoteKey { key: 0x0102_0304_0506_0708, addr: 0x7f00_dead_beef };
        let b = encode_scratch(k);
        assert_eq!(decode_scratch(&b), Some(k));
        assert_eq!(decode_scratch(&b[..15]), None, "not all there yet");
    }
}
