//! The libfabric route's bytes, as pure functions: its connection-info section (the provider and each rail's
//! fabric and endpoint address), its sections of a region's ticket (the region's key on each rail and the rails
//! nearest its memory, see `FabricKeys`) and the greeting on a `KIND` connection (after the TCP route's
//! authenticated handshake), one per path (our rail to one of the peer's).
//!
//! ```text
//! SECTION  = provider (u8 length | bytes) | address (u16 length | bytes)      rail 0's address
//!            | rails u8 | rails × (fabric (u8 length | bytes) | address (u16 length | bytes))
//! TICKET   = key u64 | base u64      rail 0's key (the address a peer names for a byte is its virtual
//!                                    address - base)
//! RAILS    = near u32 | (key u64 | base u64) × (rails - 1)      the other rails' keys; near: the rails
//!                                    nearest the region's memory, a mask by rail index
//! CARRIED  = rails u32               the rails that carry the region, a mask by rail index (GPU memory:
//!                                    those whose device offers FI_HMEM and passed its GPU-memory self-test;
//!                                    the others' keys are placeholders); absent: every rail
//! GREETING = "GXFR" | rail u8 | address (u16 length | bytes)    initiator → target: its endpoint's address,
//!                                                           for the target's rail `rail` ("GXFA" | address:
//!                                                           rail 0, as the first release sent it)
//! ANSWER   = status u8 (0 ok, else refused)                 target → initiator
//! SCRATCH  = key u64 | address u64                          initiator → target, after an ok answer: where
//!                                                           the target READs a byte to fence a retired region
//! ```
//! All integers little-endian. The connection stays open while the initiator's route lives: the target keeps
//! driving its rail's progress while any is open. A section or ticket of the first release (one rail, nothing
//! after rail 0's fields) reads as one rail on an unnamed fabric.

use crate::fabric::RemoteKey;
use crate::md::{put_bytes, put_uvar};
use crate::status::{Error, Result};

/// Its connection-info section's id (layout 4, see `conn`).
pub(crate) const SECTION: u64 = 6;
/// Its connection kind on the TCP listener (one of `tcp::wire::KIND_ROUTES`).
pub(crate) const KIND: u8 = 4;
/// Its region-ticket sections (ids shared by every route's ticket sections: RDMA's are 1 to 3): rail 0's key,
/// and the other rails' with the nearest rails.
const TICKET: u64 = 16;
const TICKET_RAILS: u64 = 17;
/// The rails that carry the region, where not every one does (GPU memory).
const TICKET_CARRIED: u64 = 18;

/// A greeting for one rail, and the first release's (rail 0).
pub(crate) const MAGIC: &[u8; 4] = b"GXFR";
pub(crate) const MAGIC_RAIL0: &[u8; 4] = b"GXFA";
/// The most rails a side uses (masks by rail index are u32).
pub(crate) const MAX_RAILS: usize = 32;
/// The longest endpoint address taken (libfabric's are tens of bytes).
pub(crate) const MAX_ADDR: usize = 4096;
pub(crate) const ANSWER_OK: u8 = 0;
pub(crate) const ANSWER_REFUSED: u8 = 1;

/// What a peer advertises: its provider (libfabric's full name) and each of its rails (at least one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Advert {
    pub(crate) provider: String,
    pub(crate) rails: Vec<RailAdvert>,
}

/// One rail of a peer: its fabric (libfabric's name: a subnet for the socket providers; empty where the peer did
/// not say) and its endpoint's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RailAdvert {
    pub(crate) fabric: String,
    pub(crate) addr: Vec<u8>,
}

fn put_str8(out: &mut Vec<u8>, s: &str) {
    let b = &s.as_bytes()[..s.len().min(255)];
    out.push(b.len() as u8);
    out.extend_from_slice(b);
}

fn put_addr(out: &mut Vec<u8>, a: &[u8]) {
    let a = &a[..a.len().min(MAX_ADDR)];
    out.extend_from_slice(&(a.len() as u16).to_le_bytes());
    out.extend_from_slice(a);
}

pub(crate) fn encode_section(a: &Advert) -> Vec<u8> {
    let mut out = Vec::new();
    put_str8(&mut out, &a.provider);
    put_addr(&mut out, a.rails.first().map_or(&[][..], |r| &r.addr));
    let rails = &a.rails[..a.rails.len().min(MAX_RAILS)];
    out.push(rails.len() as u8);
    for r in rails {
        put_str8(&mut out, &r.fabric);
        put_addr(&mut out, &r.addr);
    }
    out
}

/// Reads `u8 length | bytes` (a UTF-8 string) at `*at`.
fn str8(b: &[u8], at: &mut usize) -> Option<String> {
    let n = *b.get(*at)? as usize;
    let s = std::str::from_utf8(b.get(*at + 1..*at + 1 + n)?).ok()?.to_owned();
    *at += 1 + n;
    Some(s)
}

/// Reads `u16 length | bytes` (an address: not empty, at most `MAX_ADDR`) at `*at`.
fn addr16(b: &[u8], at: &mut usize) -> Option<Vec<u8>> {
    let len = u16::from_le_bytes(b.get(*at..*at + 2)?.try_into().ok()?) as usize;
    if len == 0 || len > MAX_ADDR {
        return None;
    }
    let a = b.get(*at + 2..*at + 2 + len)?.to_vec();
    *at += 2 + len;
    Some(a)
}

/// A section's advert; bytes after it (a later release's fields) are skipped. A section of the first release
/// (no rail list) is one rail on an unnamed fabric; a rail list that does not parse is malformed.
pub(crate) fn decode_section(b: &[u8]) -> Option<Advert> {
    let mut at = 0;
    let provider = str8(b, &mut at)?;
    let first = addr16(b, &mut at)?;
    let Some(&n) = b.get(at) else {
        return Some(Advert { provider, rails: vec![RailAdvert { fabric: String::new(), addr: first }] });
    };
    at += 1;
    if n == 0 || n as usize > MAX_RAILS {
        return None;
    }
    let rails = (0..n)
        .map(|_| Some(RailAdvert { fabric: str8(b, &mut at)?, addr: addr16(b, &mut at)? }))
        .collect::<Option<Vec<_>>>()?;
    (rails[0].addr == first).then_some(Advert { provider, rails })
}

/// What libfabric peers need of a region on one rail: its key, and what to subtract from a virtual address to
/// get the address its provider names (0 where the provider uses virtual addresses, else the region's start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FabricKey {
    pub(crate) key: u64,
    pub(crate) base: u64,
}

/// A region's keys, one per rail of its engine (by rail index, at least one), the rails nearest its memory
/// (a mask by rail index; 0: not said, any) and the rails that carry it (a mask by rail index; 0: every one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FabricKeys {
    pub(crate) keys: Vec<FabricKey>,
    pub(crate) near: u32,
    pub(crate) rails: u32,
}

fn put_key(b: &mut Vec<u8>, k: &FabricKey) {
    b.extend_from_slice(&k.key.to_le_bytes());
    b.extend_from_slice(&k.base.to_le_bytes());
}

impl FabricKeys {
    pub(crate) fn put_sections(&self, out: &mut Vec<u8>) {
        let Some(first) = self.keys.first() else { return };
        put_uvar(out, TICKET);
        let mut b = Vec::with_capacity(16);
        put_key(&mut b, first);
        put_bytes(out, &b);
        put_uvar(out, TICKET_RAILS);
        put_bytes(out, &self.rails_section());
        if self.rails != 0 {
            put_uvar(out, TICKET_CARRIED);
            put_bytes(out, &self.rails.to_le_bytes());
        }
    }

    /// Whether the region is reachable on the engine's rail `rail`.
    pub(crate) fn on(&self, rail: usize) -> bool {
        rail < self.keys.len() && (self.rails == 0 || (rail < 32 && self.rails & (1 << rail) != 0))
    }

    /// The rails that carry it, as a mask by rail index (every one named: `u32::MAX` where all do).
    pub(crate) fn carried(&self) -> u32 {
        if self.rails == 0 {
            u32::MAX
        } else {
            self.rails
        }
    }

    /// Its `TICKET_RAILS` section's bytes.
    fn rails_section(&self) -> Vec<u8> {
        let mut b = self.near.to_le_bytes().to_vec();
        self.keys.iter().skip(1).for_each(|k| put_key(&mut b, k));
        b
    }
}

/// The keys among a region's ticket sections (others' are not its business); None where it has none.
pub(crate) fn read_ticket(sections: &[(u64, &[u8])]) -> Result<Option<FabricKeys>> {
    let Some(&(_, sec)) = sections.iter().find(|(id, _)| *id == TICKET) else { return Ok(None) };
    let bad = || Error::mismatch("malformed libfabric key in a region ticket");
    let key = |b: &[u8]| -> Result<FabricKey> {
        let word = |i: usize| b.get(i..i + 8).and_then(|w| w.try_into().ok()).map(u64::from_le_bytes).ok_or_else(bad);
        Ok(FabricKey { key: word(0)?, base: word(8)? })
    };
    if sec.len() != 16 {
        return Err(bad());
    }
    let mut k = FabricKeys { keys: vec![key(sec)?], near: 0, rails: 0 };
    if let Some(&(_, rails)) = sections.iter().find(|(id, _)| *id == TICKET_RAILS) {
        if rails.len() < 4 || (rails.len() - 4) % 16 != 0 || (rails.len() - 4) / 16 >= MAX_RAILS {
            return Err(bad());
        }
        k.near = u32::from_le_bytes([rails[0], rails[1], rails[2], rails[3]]);
        for c in rails[4..].chunks(16) {
            k.keys.push(key(c)?);
        }
    }
    if let Some(&(_, c)) = sections.iter().find(|(id, _)| *id == TICKET_CARRIED) {
        let c: [u8; 4] = c.try_into().map_err(|_| bad())?;
        k.rails = u32::from_le_bytes(c);
        if k.rails == 0 {
            return Err(bad());
        }
    }
    Ok(Some(k))
}

/// The greeting for the target's rail `rail`.
pub(crate) fn encode_greeting(rail: u8, addr: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.push(rail);
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

/// After its scratch, an initiator that reads closed-key notices says so with this byte (an older target reads
/// and drops it; an older initiator sends none and gets no notices).
pub(crate) const READS_CLOSED: u8 = 1;

/// A closed-key notice, target to initiator on the greeting connection, once a region deregistered at the
/// target was closed on the connection's rail and fenced: its tag, a count (u32, little-endian, 1 to
/// `CLOSED_MAX`) and that many keys of the rail (u64 each). The initiator refuses its own pieces on those keys
/// from then on (see `Fabric::closed`).
const CLOSED_TAG: u8 = b'K';
/// The most keys one notice carries (a region's keys are one per rail; several regions retired at once are
/// sent as several notices where they exceed it).
pub(crate) const CLOSED_MAX: usize = 4096;

pub(crate) fn encode_closed(keys: &[u64]) -> Vec<u8> {
    debug_assert!(!keys.is_empty() && keys.len() <= CLOSED_MAX);
    let mut out = Vec::with_capacity(5 + 8 * keys.len());
    out.push(CLOSED_TAG);
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    keys.iter().for_each(|k| out.extend_from_slice(&k.to_le_bytes()));
    out
}

/// The notice at the head of `b`: its keys and its length in bytes; Ok(None) until all of it arrived; Err where
/// the bytes are no notice (the stream is then of no use).
#[allow(clippy::result_unit_err)]
pub(crate) fn decode_closed(b: &[u8]) -> std::result::Result<Option<(Vec<u64>, usize)>, ()> {
    let Some(&tag) = b.first() else { return Ok(None) };
    if tag != CLOSED_TAG {
        return Err(());
    }
    let Some(n) = b.get(1..5) else { return Ok(None) };
    let n = u32::from_le_bytes([n[0], n[1], n[2], n[3]]) as usize;
    if n == 0 || n > CLOSED_MAX {
        return Err(());
    }
    let len = 5 + 8 * n;
    let Some(body) = b.get(5..len) else { return Ok(None) };
    let keys = body.chunks_exact(8).map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]));
    Ok(Some((keys.collect(), len)))
}

/// What a greeting whose first bytes are `head` announces: the rail and the address's length, or that one more
/// byte is needed (`Err(())`: read `GREETING_HEAD + 1` and ask again); None where they are no greeting.
pub(crate) fn greeting_len(head: &[u8]) -> Option<std::result::Result<(u8, usize), ()>> {
    let len =
        |b: &[u8]| Some(u16::from_le_bytes([*b.first()?, *b.get(1)?]) as usize).filter(|n| (1..=MAX_ADDR).contains(n));
    match head.get(..4)? {
        m if m == MAGIC_RAIL0 => Some(Ok((0, len(head.get(4..6)?)?))),
        m if m == MAGIC => match head.get(4..7) {
            Some(h) => Some(Ok((h[0], len(&h[1..])?))),
            None => Some(Err(())),
        },
        _ => None,
    }
}

/// For the fuzz targets: every decoder on `b`; what decodes encodes back to bytes that decode the same.
pub(crate) fn fuzz(b: &[u8]) {
    if let Some(a) = decode_section(b) {
        assert_eq!(decode_section(&encode_section(&a)).as_ref(), Some(&a), "libfabric section changed");
    }
    if let Ok(Some(k)) = read_ticket(&[(TICKET, b)]) {
        let mut out = Vec::new();
        FabricKeys { keys: k.keys[..1].to_vec(), near: 0, rails: 0 }.put_sections(&mut out);
        assert_eq!(&out[2..18], b, "libfabric ticket changed");
    }
    if let Some(rails) = b.get(16..) {
        if let Ok(Some(k)) = read_ticket(&[(TICKET, &b[..16]), (TICKET_RAILS, rails)]) {
            assert_eq!(k.rails_section(), rails, "libfabric rail keys changed");
        }
    }
    if let Some(carried) = b.get(16..) {
        if let Ok(Some(k)) = read_ticket(&[(TICKET, &b[..16]), (TICKET_CARRIED, carried)]) {
            assert!(k.rails != 0 && k.rails.to_le_bytes()[..] == carried[..], "libfabric carried rails changed");
        }
    }
    if let Ok(Some((keys, len))) = decode_closed(b) {
        assert_eq!(encode_closed(&keys)[..], b[..len], "libfabric closed-key notice changed");
    }
    if let Some(k) = decode_scratch(b) {
        assert_eq!(encode_scratch(k)[..], b[..SCRATCH], "libfabric scratch changed");
    }
    if let Some(Ok((rail, n))) = greeting_len(b) {
        let g = encode_greeting(rail, &vec![0; n]);
        if b.starts_with(MAGIC) {
            assert_eq!(g[..GREETING_HEAD + 1], b[..GREETING_HEAD + 1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sections(out: &[u8]) -> Vec<(u64, &[u8])> {
        let mut v = Vec::new();
        let mut at = 0;
        while at < out.len() {
            let (id, n) = (out[at] as u64, out[at + 1] as usize);
            assert!(n < 128, "one-byte lengths in these tests");
            v.push((id, &out[at + 2..at + 2 + n]));
            at += 2 + n;
        }
        v
    }

    #[test]
    fn sections_tickets_and_greetings_round_trip_and_garbage_is_refused() {
        let rail = |f: &str, a: &[u8]| RailAdvert { fabric: f.into(), addr: a.to_vec() };
        let a = Advert {
            provider: "tcp;ofi_rxm".into(),
            rails: vec![
                rail("192.0.2.0/24", &[2, 0, 0x1f, 0x90, 192, 0, 2, 1]),
                rail("198.51.100.0/24", &[2, 0, 0x1f, 0x91, 198, 51, 100, 1]),
            ],
        };
        let mut b = encode_section(&a);
        assert_eq!(decode_section(&b), Some(a.clone()));
        b.extend_from_slice(b"a later field");
        assert_eq!(decode_section(&b), Some(a.clone()), "trailing bytes skipped");
        for n in 0..20 {
            assert!(decode_section(&b[..n]).is_none(), "prefix {n}");
        }
        // The first release's section: provider and one address, nothing after.
        let mut old = vec![11];
        old.extend_from_slice(b"tcp;ofi_rxm");
        old.extend_from_slice(&[8, 0]);
        old.extend_from_slice(&a.rails[0].addr);
        let one = decode_section(&old).unwrap();
        assert_eq!(one.rails, vec![rail("", &a.rails[0].addr)]);
        assert!(decode_section(&[0, 0, 0]).is_none(), "an empty address");
        assert!(decode_section(&[1, 0xff, 1, 0, 9]).is_none(), "a provider name that is not UTF-8");
        let mut zero = old.clone();
        zero.push(0);
        assert!(decode_section(&zero).is_none(), "a rail list without rails");

        let k = FabricKeys {
            keys: vec![FabricKey { key: 0x1234_5678_9abc, base: 0x7f00_0000_1000 }, FabricKey { key: 7, base: 0 }],
            near: 0b10,
            rails: 0,
        };
        let mut t = Vec::new();
        k.put_sections(&mut t);
        let secs = sections(&t);
        assert_eq!(secs[0].0, TICKET);
        let mut with_rdma = vec![(1, &b"rdma's"[..])];
        with_rdma.extend(secs.iter().copied());
        assert_eq!(read_ticket(&with_rdma).unwrap(), Some(k.clone()));
        // The first release's ticket: rail 0's key alone.
        assert_eq!(
            read_ticket(&secs[..1]).unwrap(),
            Some(FabricKeys { keys: k.keys[..1].to_vec(), near: 0, rails: 0 })
        );
        assert!(k.on(0) && k.on(1) && !k.on(2));
        // GPU memory carried by rail 1 alone: the mask travels, rail 0's key is a placeholder not to use.
        let g = FabricKeys {
            keys: vec![FabricKey { key: 0, base: 0 }, FabricKey { key: 9, base: 0 }],
            near: 0,
            rails: 0b10,
        };
        let mut t = Vec::new();
        g.put_sections(&mut t);
        let got = read_ticket(&sections(&t)).unwrap().unwrap();
        assert_eq!(got, g);
        assert!(!got.on(0) && got.on(1) && got.carried() == 0b10);
        assert!(read_ticket(&[secs[0], (TICKET_CARRIED, &[0, 0, 0, 0])]).is_err(), "a region no rail carries");
        assert!(read_ticket(&[secs[0], (TICKET_CARRIED, &[1, 0, 0])]).is_err(), "a mask cut short");
        assert_eq!(read_ticket(&[(1, b"rdma's")]).unwrap(), None);
        assert!(read_ticket(&[(TICKET, &secs[0].1[..15])]).is_err());
        assert!(read_ticket(&[secs[0], (TICKET_RAILS, &secs[1].1[..7])]).is_err(), "a rail key cut short");

        let g = encode_greeting(1, b"addr");
        assert_eq!(greeting_len(&g[..GREETING_HEAD]), Some(Err(())), "one more byte");
        assert_eq!(greeting_len(&g[..GREETING_HEAD + 1]), Some(Ok((1, 4))));
        assert_eq!(greeting_len(b"GXFA\x04\0"), Some(Ok((0, 4))), "the first release's greeting: rail 0");
        assert!(greeting_len(b"GXFA\0\0").is_none() && greeting_len(b"XXFA\x04\0").is_none());
        assert!(greeting_len(&[b'G', b'X', b'F', b'A', 0x01, 0x10]).is_none(), "longer than MAX_ADDR");

        let k = RemoteKey { key: 0x0102_0304_0506_0708, addr: 0x7f00_dead_beef };
        let b = encode_scratch(k);
        assert_eq!(decode_scratch(&b), Some(k));
        assert_eq!(decode_scratch(&b[..15]), None, "not all there yet");
    }

    #[test]
    fn a_closed_key_notice_decodes_once_all_of_it_arrived_and_garbage_is_refused() {
        let b = encode_closed(&[3, u64::MAX]);
        assert_eq!(b.len(), 5 + 16);
        for cut in 0..b.len() {
            assert_eq!(decode_closed(&b[..cut]), Ok(None), "{cut} bytes");
        }
        let mut two = b.clone();
        two.extend_from_slice(&encode_closed(&[9]));
        assert_eq!(decode_closed(&two), Ok(Some((vec![3, u64::MAX], b.len()))));
        assert_eq!(decode_closed(&two[b.len()..]), Ok(Some((vec![9], 13))));
        assert_eq!(decode_closed(b"X"), Err(()));
        assert_eq!(decode_closed(&[b'K', 0, 0, 0, 0]), Err(()), "no keys");
        assert_eq!(decode_closed(&[b'K', 0xff, 0xff, 0xff, 0xff]), Err(()), "more than CLOSED_MAX");
    }

    /// Random bytes, and random bytes behind each valid prefix, through every decoder (`fuzz` asserts what
    /// decodes encodes back the same).
    #[test]
    fn random_bytes_never_panic_and_what_decodes_round_trips() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let a =
            Advert { provider: "efa".into(), rails: vec![RailAdvert { fabric: "efa".into(), addr: vec![1; 32] }; 3] };
        let k = FabricKeys { keys: vec![FabricKey { key: 1, base: 2 }; 3], near: 5, rails: 0b101 };
        let mut t = Vec::new();
        k.put_sections(&mut t);
        let prefixes = [
            encode_section(&a),
            t,
            encode_greeting(2, &[9; 16]),
            b"GXFA\x10\0".to_vec(),
            encode_closed(&[7, 1 << 40]),
            Vec::new(),
        ];
        for round in 0..20_000 {
            let p = &prefixes[round % prefixes.len()];
            let keep = (next() as usize) % (p.len() + 1);
            let mut b = p[..keep].to_vec();
            let extra = (next() % 48) as usize;
            b.extend((0..extra).map(|_| next() as u8));
            fuzz(&b);
        }
    }
}
