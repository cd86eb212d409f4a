//! gixl's metadata codec: what `get_local_md` produces and `load_remote_md` consumes.
//!
//! Layout (all integers little-endian or LEB128 varints):
//! `b"GIXLMD"`, version `u16` (2), flags `u8` (bit 0: partial, bit 1: signed), name, incarnation `u128`,
//! connection list (backend name, opaque bytes), then sections (backend name, memory type, regions), then,
//! when signed, an HMAC-SHA256 tag (32 bytes) over everything before it, made with the cluster key
//! (see `crate::auth`). Regions are delta-coded: each address is stored as the signed distance from the
//! previous region's end, so 1000 contiguous 16 KiB regions take about 6 KB.
//!
//! The decoder trusts nothing: every length is bounded by what is left of the input and by the caps
//! below, and it reserves memory only in proportion to bytes it has read, so a small blob cannot make it
//! allocate much more than its size. Every malformation is `NIXL_ERR_MISMATCH`; a missing or wrong
//! signature is `NIXL_ERR_NOT_ALLOWED`. It does not interpret connection info or region bytes; the backends
//! do. (Version 1 carried an unused agent secret; it is no longer read.)

use crate::mem::{Desc, MemType};
use crate::status::{Error, Result};

pub const MAGIC: &[u8; 6] = b"GIXLMD";
pub const VERSION: u16 = 2;
const FLAG_PARTIAL: u8 = 1;
const FLAG_SIGNED: u8 = 2;
const SIGN_DOMAIN: &[u8] = b"gixl-md-v2";
/// Regions reserved ahead of decoding them; beyond this the vector grows as regions are read.
const RESERVE: usize = 1024;

const MAX_NAME: usize = 4096;
const MAX_CONNS: usize = 64;
const MAX_SECTIONS: usize = 4096;
const MAX_BLOB: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentMd {
    pub name: String,
    pub incarnation: u128,
    pub partial: bool,
    /// (backend name, connection info); empty in partial metadata sent without connection info.
    pub conns: Vec<(String, Vec<u8>)>,
    pub sections: Vec<SectionMd>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionMd {
    pub backend: String,
    pub mem: MemType,
    /// (region, public bytes the backend needs to reach it)
    pub regions: Vec<(Desc, Vec<u8>)>,
}

impl AgentMd {
    pub fn encode(&self) -> Vec<u8> {
        let regions: usize = self.sections.iter().map(|s| s.regions.len()).sum();
        let mut out = Vec::with_capacity(64 + self.name.len() + regions * 8);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.push(self.partial as u8);
        put_bytes(&mut out, self.name.as_bytes());
        out.extend_from_slice(&self.incarnation.to_le_bytes());
        put_uvar(&mut out, self.conns.len() as u64);
        for (backend, info) in &self.conns {
            put_bytes(&mut out, backend.as_bytes());
            put_bytes(&mut out, info);
        }
        put_uvar(&mut out, self.sections.len() as u64);
        for s in &self.sections {
            put_bytes(&mut out, s.backend.as_bytes());
            put_uvar(&mut out, s.mem as u64);
            put_uvar(&mut out, s.regions.len() as u64);
            let mut prev_end = 0u64;
            for (d, public) in &s.regions {
                put_uvar(&mut out, zigzag(d.addr.wrapping_sub(prev_end) as i64));
                put_uvar(&mut out, d.len);
                put_uvar(&mut out, d.dev);
                put_bytes(&mut out, public);
                prev_end = d.addr.wrapping_add(d.len);
            }
        }
        out
    }

    /// `encode`, signed with the cluster key when one is given.
    pub fn seal(&self, key: Option<&crate::auth::ClusterKey>) -> Vec<u8> {
        let mut out = self.encode();
        if let Some(k) = key {
            out[MAGIC.len() + 2] |= FLAG_SIGNED;
            let tag = k.sign(SIGN_DOMAIN, &[&out]);
            out.extend_from_slice(&tag);
        }
        out
    }

    /// `decode` a blob that must be signed with the cluster key when one is given, and may not be signed
    /// when none is (the error then says which side lacks the key).
    pub fn open(buf: &[u8], key: Option<&crate::auth::ClusterKey>) -> Result<AgentMd> {
        Self::open_within(buf, key, usize::MAX)
    }

    /// `open`, refused with NOT_ALLOWED as soon as the section headers announce more than `max_regions`
    /// regions in all, before any of them is decoded: what a stranger's LOAD may cost is bounded by the cap,
    /// not by the size of the LOAD.
    pub fn open_within(buf: &[u8], key: Option<&crate::auth::ClusterKey>, max_regions: usize) -> Result<AgentMd> {
        let at = MAGIC.len() + 2;
        let signed = buf.len() > at && buf[..MAGIC.len()] == MAGIC[..] && buf[at] & FLAG_SIGNED != 0;
        match (key, signed) {
            (None, false) => Self::decode_within(buf, max_regions),
            (None, true) => Err(Error::not_allowed(
                "metadata is signed with a cluster key, and this agent has none (set GIXL_CLUSTER_KEY)",
            )),
            (Some(_), false) => Err(Error::not_allowed(
                "metadata is not signed, and this agent requires the cluster key (GIXL_CLUSTER_KEY)",
            )),
            (Some(k), true) => {
                if buf.len() < at + 1 + crate::auth::TAG {
                    return Err(Error::mismatch("signed metadata is truncated"));
                }
                let (body, tag) = buf.split_at(buf.len() - crate::auth::TAG);
                if !k.verify(SIGN_DOMAIN, &[body], tag) {
                    return Err(Error::not_allowed("metadata signature does not match the cluster key"));
                }
                let mut plain = body.to_vec();
                plain[at] &= !FLAG_SIGNED;
                Self::decode_within(&plain, max_regions)
            }
        }
    }

    pub fn decode(buf: &[u8]) -> Result<AgentMd> {
        Self::decode_within(buf, usize::MAX)
    }

    /// The agent name a blob claims, read from its header alone (nothing verified: `open` does that).
    pub fn peek_name(buf: &[u8]) -> Result<String> {
        let mut r = Reader { buf, pos: 0 };
        if r.take(MAGIC.len())? != MAGIC {
            return Err(Error::mismatch("not gixl metadata (bad magic)"));
        }
        r.take(3)?;
        r.string(MAX_NAME)
    }

    /// `decode`, refused with NOT_ALLOWED once the sections announce more than `max_regions` regions.
    pub fn decode_within(buf: &[u8], max_regions: usize) -> Result<AgentMd> {
        let mut r = Reader { buf, pos: 0 };
        if r.take(MAGIC.len())? != MAGIC {
            return Err(Error::mismatch("not gixl metadata (bad magic)"));
        }
        let version = u16::from_le_bytes(r.array()?);
        if version != VERSION {
            return Err(Error::mismatch(format!("metadata version {version} is not supported (expected {VERSION})")));
        }
        let flags = r.byte()?;
        if flags & !FLAG_PARTIAL != 0 {
            return Err(Error::mismatch(format!("unknown metadata flags {flags:#x}")));
        }
        let name = r.string(MAX_NAME)?;
        if name.is_empty() {
            return Err(Error::mismatch("metadata has an empty agent name"));
        }
        let incarnation = u128::from_le_bytes(r.array()?);
        let nconns = r.count(MAX_CONNS)?;
        let mut conns = Vec::with_capacity(nconns);
        for _ in 0..nconns {
            let backend = r.string(MAX_NAME)?;
            let info = r.bytes(MAX_BLOB)?.to_vec();
            conns.push((backend, info));
        }
        let nsections = r.count(MAX_SECTIONS)?;
        let mut announced = 0usize;
        let mut sections = Vec::with_capacity(nsections.min(r.left()).min(RESERVE));
        for _ in 0..nsections {
            let backend = r.string(MAX_NAME)?;
            let mem = u32::try_from(r.uvar()?)
                .ok()
                .and_then(|m| MemType::from_u32(m).ok())
                .ok_or_else(|| Error::mismatch("metadata names an unknown memory type"))?;
            // Each region takes at least 4 bytes, which bounds the count by the input left.
            let n = r.count((r.left() / 4).max(1))?;
            announced = announced.saturating_add(n);
            if announced > max_regions {
                return Err(Error::not_allowed(format!(
                    "metadata of agent '{name}' brings more than the {max_regions} regions allowed here"
                )));
            }
            let mut regions = Vec::with_capacity(n.min(RESERVE));
            let mut prev_end = 0u64;
            for _ in 0..n {
                let addr = prev_end.wrapping_add(unzigzag(r.uvar()?) as u64);
                let len = r.uvar()?;
                let dev = r.uvar()?;
                let public = r.bytes(MAX_BLOB)?.to_vec();
                let d = Desc::new(addr, len, dev);
                if d.end().is_none() {
                    return Err(Error::mismatch("metadata region overflows the address space"));
                }
                prev_end = addr.wrapping_add(len);
                regions.push((d, public));
            }
            sections.push(SectionMd { backend, mem, regions });
        }
        if r.left() != 0 {
            return Err(Error::mismatch(format!("{} trailing bytes after metadata", r.left())));
        }
        Ok(AgentMd { name, incarnation, partial: flags & FLAG_PARTIAL != 0, conns, sections })
    }
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}
fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

pub(crate) fn put_uvar(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(crate) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_uvar(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// A bounds-checked cursor; every method fails with MISMATCH instead of reading past the end.
pub(crate) struct Reader<'a> {
    pub buf: &'a [u8],
    pub pos: usize,
}

impl<'a> Reader<'a> {
    pub fn left(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(Error::mismatch("metadata is truncated"));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub fn byte(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn uvar(&mut self) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            let part = u64::from(b & 0x7f);
            if shift == 63 && part > 1 {
                return Err(Error::mismatch("varint overflows 64 bits"));
            }
            v |= part << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Error::mismatch("varint is too long"))
    }
    pub fn count(&mut self, max: usize) -> Result<usize> {
        let n = self.uvar()?;
        if n > max as u64 {
            return Err(Error::mismatch(format!("count {n} exceeds the limit {max}")));
        }
        Ok(n as usize)
    }
    pub fn bytes(&mut self, max: usize) -> Result<&'a [u8]> {
        let n = self.count(max)?;
        self.take(n)
    }
    pub fn string(&mut self, max: usize) -> Result<String> {
        let b = self.bytes(max)?;
        String::from_utf8(b.to_vec()).map_err(|_| Error::mismatch("metadata string is not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Status;

    fn sample() -> AgentMd {
        AgentMd {
            name: "prefill-0".into(),
            incarnation: 0x1234_5678_9abc_def0_1122_3344_5566_7788,
            partial: false,
            conns: vec![("UCX".into(), vec![1, 2, 3])],
            sections: vec![SectionMd {
                backend: "UCX".into(),
                mem: MemType::Dram,
                regions: (0..1000u64).map(|i| (Desc::new(0x7f00_0000_0000 + i * 16384, 16384, 0), vec![])).collect(),
            }],
        }
    }

    #[test]
    fn round_trip_and_size() {
        let md = sample();
        let bytes = md.encode();
        assert!(bytes.len() < 8 * 1024, "1000 regions took {} bytes", bytes.len());
        assert_eq!(AgentMd::decode(&bytes).unwrap(), md);
    }

    #[test]
    fn every_truncation_is_a_mismatch() {
        let bytes = sample().encode();
        for n in 0..bytes.len() {
            let e = AgentMd::decode(&bytes[..n]).unwrap_err();
            assert_eq!(e.status(), Status::Mismatch, "prefix {n}");
        }
    }

    #[test]
    fn garbage_is_a_mismatch() {
        for g in [&b""[..], b"hello", b"nixlSerDes|Agent", &[0xff; 64]] {
            assert_eq!(AgentMd::decode(g).unwrap_err().status(), Status::Mismatch);
        }
        let mut bytes = sample().encode();
        bytes.push(0);
        assert_eq!(AgentMd::decode(&bytes).unwrap_err().status(), Status::Mismatch);
    }

    #[test]
    fn flipped_bytes_never_panic() {
        let bytes = sample().encode();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut b = bytes.clone();
            let i = (x as usize) % b.len();
            b[i] ^= (x >> 32) as u8 | 1;
            let _ = AgentMd::decode(&b);
        }
    }

    #[test]
    fn signed_metadata_needs_the_key_and_keys_rotate() {
        use crate::auth::ClusterKey;
        let md = sample();
        let (k1, k2) =
            (ClusterKey::parse("cluster-key-one-0123").unwrap(), ClusterKey::parse("cluster-key-two-0123").unwrap());
        let rotating = ClusterKey::parse("cluster-key-two-0123,cluster-key-one-0123").unwrap();
        let signed = md.seal(Some(&k1));
        assert_eq!(AgentMd::open(&signed, Some(&k1)).unwrap(), md);
        assert_eq!(AgentMd::open(&signed, Some(&rotating)).unwrap(), md, "old key accepted while rotating");
        assert_eq!(AgentMd::open(&signed, Some(&k2)).unwrap_err().status(), Status::NotAllowed);
        assert_eq!(AgentMd::open(&signed, None).unwrap_err().status(), Status::NotAllowed);
        assert_eq!(AgentMd::open(&md.encode(), Some(&k1)).unwrap_err().status(), Status::NotAllowed);
        assert_eq!(AgentMd::open(&md.encode(), None).unwrap(), md);
        // Any change to a signed blob is refused.
        for i in (0..signed.len()).step_by(97) {
            let mut b = signed.clone();
            b[i] ^= 0x20;
            assert!(AgentMd::open(&b, Some(&k1)).is_err(), "flip at {i}");
        }
        for n in 0..signed.len() {
            assert!(AgentMd::open(&signed[..n], Some(&k1)).is_err(), "prefix {n}");
        }
    }

    #[test]
    fn reservations_follow_the_bytes_read() {
        // A section that claims a million regions in a blob of a few bytes reserves little and fails.
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.push(0);
        put_bytes(&mut b, b"x");
        b.extend_from_slice(&[0; 16]);
        put_uvar(&mut b, 0);
        put_uvar(&mut b, 1);
        put_bytes(&mut b, b"UCX");
        put_uvar(&mut b, 0);
        put_uvar(&mut b, 1_000_000);
        let head = b.len();
        // Exactly enough bytes for a million empty regions decodes; one byte less is a mismatch.
        b.extend_from_slice(&vec![0u8; 4_000_000]);
        assert_eq!(AgentMd::decode(&b).unwrap().sections[0].regions.len(), 1_000_000);
        b.truncate(head + 3_999_999);
        assert_eq!(AgentMd::decode(&b).unwrap_err().status(), Status::Mismatch);
    }
}
