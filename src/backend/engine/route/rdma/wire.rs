//! The RDMA route's bytes, as pure functions: its connection-info section (the engine's ports), its sections
//! of a region's ticket (the region's keys, see `RdmaKeys`) and the queue-pair exchange on a `KIND`
//! connection (after the TCP route's authenticated handshake).
//!
//! ```text
//! SECTION  = nports u8 | nports × PORT
//! PORT     = gid (16 bytes) | lid u16 | link u8 (1 InfiniBand, 2 Ethernet)
//! OFFER    = "GXQP" | port u8 (the target's, by its index in SECTION) | n u8 (1..=MAX_QPS) | n × QPADDR
//!                                                               initiator → target
//! ANSWER   = status u8 (0 ok, else refused) | n × QPADDR         target → initiator (same n)
//! QPADDR   = gid (16 bytes) | lid u16 | qpn u32 | psn u32
//! ```
//! All integers little-endian. The connection stays open while the pairs live: when either side closes it,
//! the other destroys its pairs.

use crate::md::{put_bytes, put_uvar};
use crate::status::{Error, Result};
use crate::verbs::{LinkLayer, PortInfo, QpAddr};

/// Its connection-info section's id (layout 4, see `conn`).
pub(crate) const SECTION: u64 = 5;
/// Its connection kind on the TCP listener (one of `tcp::wire::KIND_ROUTES`): the queue-pair exchange.
pub(crate) const KIND: u8 = 3;

/// A region ticket's section: the region's RDMA remote keys (u32 each, one per port).
const TICKET_RKEY: u64 = 1;
/// A region ticket's section: the ports nearest the region's memory, as a mask by port index (u32).
const TICKET_NEAR: u64 = 2;
/// A region ticket's section: where the region's memory regions start, for a region registered as several
/// (GPU memory over several allocations: one dma-buf each), as u64 addresses, at least two, increasing.
const TICKET_BOUNDS: u64 = 3;

/// What RDMA peers need of a region: its key on each port of its engine (empty: no RDMA; for a region of several
/// memory regions, `bounds`, one key per port for each, region by region), and the ports nearest its memory (a
/// mask by port index; 0: not said, any).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct RdmaKeys {
    pub(crate) rkeys: Vec<u32>,
    pub(crate) near: u32,
    /// Where each of its memory regions starts; empty for one.
    pub(crate) bounds: Vec<u64>,
}

impl RdmaKeys {
    /// Its sections of a region's ticket (`id | length | bytes`; none without keys).
    pub(crate) fn put_sections(&self, out: &mut Vec<u8>) {
        if !self.rkeys.is_empty() {
            put_uvar(out, TICKET_RKEY);
            put_bytes(out, &self.rkeys.iter().flat_map(|k| k.to_le_bytes()).collect::<Vec<u8>>());
            put_uvar(out, TICKET_NEAR);
            put_bytes(out, &self.near.to_le_bytes());
            if self.bounds.len() > 1 {
                put_uvar(out, TICKET_BOUNDS);
                put_bytes(out, &self.bounds.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>());
            }
        }
    }

    /// Its sections alone.
    #[cfg(test)]
    pub(crate) fn sections(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.put_sections(&mut out);
        out
    }
}

/// The RDMA keys among a region's ticket sections: the keys' (a whole number of u32, at least one), the nearest
/// ports' (one u32), the bounds' (see `TICKET_BOUNDS`); other routes' sections are not its business.
pub(crate) fn read_ticket(sections: &[(u64, &[u8])]) -> Result<RdmaKeys> {
    let mut k = RdmaKeys::default();
    for &(id, sec) in sections {
        match id {
            TICKET_RKEY => {
                if sec.is_empty() || sec.len() % 4 != 0 {
                    return Err(Error::mismatch("malformed RDMA keys in a region ticket"));
                }
                k.rkeys = sec.chunks(4).map(|k| u32::from_le_bytes([k[0], k[1], k[2], k[3]])).collect();
            }
            TICKET_NEAR => {
                let b: [u8; 4] =
                    sec.try_into().map_err(|_| Error::mismatch("malformed nearest ports in a region ticket"))?;
                k.near = u32::from_le_bytes(b);
            }
            TICKET_BOUNDS => {
                let bad = || Error::mismatch("malformed memory-region bounds in a region ticket");
                if sec.len() < 16 || sec.len() % 8 != 0 {
                    return Err(bad());
                }
                k.bounds = sec.chunks(8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default())).collect();
                if k.bounds.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(bad());
                }
            }
            _ => {}
        }
    }
    // One key per port for each memory region.
    if !k.bounds.is_empty() && k.rkeys.len() % k.bounds.len() != 0 {
        return Err(Error::mismatch("RDMA keys do not match the region's memory regions in a region ticket"));
    }
    Ok(k)
}

pub(crate) const OFFER_MAGIC: &[u8; 4] = b"GXQP";
pub(crate) const MAX_QPS: usize = 16;
pub(crate) const MAX_PORTS: usize = 16;
pub(crate) const QPADDR_BYTES: usize = 26;
pub(crate) const ANSWER_OK: u8 = 0;
pub(crate) const ANSWER_REFUSED: u8 = 1;

/// A port as a peer advertises it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Port {
    pub(crate) gid: [u8; 16],
    pub(crate) lid: u16,
    pub(crate) link: LinkLayer,
}

impl Port {
    /// Whether `self` and `other` sit on one fabric: the same link layer and, on InfiniBand, the same subnet
    /// (GID prefix); a fake port reaches only fake ports.
    pub(crate) fn reaches(&self, other: &Port) -> bool {
        let fake = |p: &Port| &p.gid[..4] == b"gxfv";
        self.link == other.link
            && fake(self) == fake(other)
            && (self.link == LinkLayer::Ethernet || self.gid[..8] == other.gid[..8])
    }
}

impl From<&PortInfo> for Port {
    fn from(p: &PortInfo) -> Port {
        Port { gid: p.gid, lid: p.lid, link: p.link }
    }
}

pub(crate) fn encode_ports(ports: &[Port]) -> Vec<u8> {
    let ports = &ports[..ports.len().min(MAX_PORTS)];
    let mut out = vec![ports.len() as u8];
    for p in ports {
        out.extend_from_slice(&p.gid);
        out.extend_from_slice(&p.lid.to_le_bytes());
        out.push(if p.link == LinkLayer::InfiniBand { 1 } else { 2 });
    }
    out
}

/// `encode_ports`, then which of them passed their self-tests (`trusted`, a mask by index, 4 bytes LE): a
/// release that reads only the ports skips it.
pub(crate) fn encode_ports_trusted(ports: &[Port], trusted: u32) -> Vec<u8> {
    let mut out = encode_ports(ports);
    out.extend_from_slice(&trusted.to_le_bytes());
    out
}

/// Which ports of a section passed their self-tests (a mask by index): every one where the section does not
/// say (a release before the self-tests, which advertised a real port only when forced).
pub(crate) fn decode_trusted(b: &[u8]) -> u32 {
    let n = b.first().map_or(0, |&n| n as usize);
    b.get(1 + n * 19..1 + n * 19 + 4).and_then(|m| m.try_into().ok()).map_or(u32::MAX, u32::from_le_bytes)
}

/// The ports of a section; bytes after them (a later release's fields) are skipped.
pub(crate) fn decode_ports(b: &[u8]) -> Option<Vec<Port>> {
    let n = *b.first()? as usize;
    if n > MAX_PORTS || b.len() < 1 + n * 19 {
        return None;
    }
    (0..n)
        .map(|i| {
            let p = &b[1 + i * 19..1 + (i + 1) * 19];
            let link = match p[18] {
                1 => LinkLayer::InfiniBand,
                2 => LinkLayer::Ethernet,
                _ => return None,
            };
            Some(Port { gid: p[..16].try_into().ok()?, lid: u16::from_le_bytes([p[16], p[17]]), link })
        })
        .collect()
}

fn put_addr(out: &mut Vec<u8>, a: &QpAddr) {
    out.extend_from_slice(&a.gid);
    out.extend_from_slice(&a.lid.to_le_bytes());
    out.extend_from_slice(&a.qpn.to_le_bytes());
    out.extend_from_slice(&a.psn.to_le_bytes());
}

fn get_addr(b: &[u8]) -> Option<QpAddr> {
    let b = b.get(..QPADDR_BYTES)?;
    Some(QpAddr {
        gid: b[..16].try_into().ok()?,
        lid: u16::from_le_bytes([b[16], b[17]]),
        qpn: u32::from_le_bytes(b[18..22].try_into().ok()?),
        psn: u32::from_le_bytes(b[22..26].try_into().ok()?),
    })
}

pub(crate) fn encode_offer(port: u8, qps: &[QpAddr]) -> Vec<u8> {
    let mut out = OFFER_MAGIC.to_vec();
    out.push(port);
    out.push(qps.len() as u8);
    qps.iter().for_each(|a| put_addr(&mut out, a));
    out
}

pub(crate) const OFFER_HEAD: usize = 6;

/// How many bytes an offer whose first bytes are `head` has in all; None if they are not an offer.
pub(crate) fn offer_len(head: &[u8; OFFER_HEAD]) -> Option<usize> {
    let n = head[5] as usize;
    (&head[..4] == OFFER_MAGIC && (1..=MAX_QPS).contains(&n)).then_some(OFFER_HEAD + n * QPADDR_BYTES)
}

/// The target port's index and the initiator's pairs.
pub(crate) fn decode_offer(b: &[u8]) -> Option<(u8, Vec<QpAddr>)> {
    let head: &[u8; OFFER_HEAD] = b.get(..OFFER_HEAD)?.try_into().ok()?;
    if offer_len(head)? != b.len() {
        return None;
    }
    Some((head[4], b[OFFER_HEAD..].chunks(QPADDR_BYTES).map(get_addr).collect::<Option<_>>()?))
}

pub(crate) fn encode_answer(status: u8, qps: &[QpAddr]) -> Vec<u8> {
    let mut out = vec![status];
    qps.iter().for_each(|a| put_addr(&mut out, a));
    out
}

/// An answer of `n` pairs: `Ok(pairs)`, or `Err(())` when the target refused.
pub(crate) fn decode_answer(b: &[u8], n: usize) -> Option<Result<Vec<QpAddr>, ()>> {
    match *b.first()? {
        ANSWER_OK if b.len() == 1 + n * QPADDR_BYTES => {
            Some(Ok(b[1..].chunks(QPADDR_BYTES).map(get_addr).collect::<Option<_>>()?))
        }
        ANSWER_OK => None,
        _ => Some(Err(())),
    }
}

/// For the fuzz targets: every decoder on `b`; what decodes encodes back to bytes that decode the same.
pub(crate) fn fuzz(b: &[u8]) {
    if let Some(p) = decode_ports(b) {
        assert_eq!(decode_ports(&encode_ports(&p)), Some(p), "RDMA ports changed across encode/decode");
    }
    if let Some((port, o)) = decode_offer(b) {
        assert_eq!(decode_offer(&encode_offer(port, &o)), Some((port, o)), "RDMA offer changed across encode/decode");
    }
    let n = b.len().saturating_sub(1) / QPADDR_BYTES;
    if let Some(Ok(a)) = decode_answer(b, n) {
        assert_eq!(decode_answer(&encode_answer(ANSWER_OK, &a), n), Some(Ok(a)), "RDMA answer changed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_and_exchanges_round_trip_and_garbage_is_refused() {
        let ports = [
            Port { gid: *b"gxfv0000abcdefgh", lid: 0, link: LinkLayer::Ethernet },
            Port { gid: [0xfe; 16], lid: 7, link: LinkLayer::InfiniBand },
        ];
        let mut b = encode_ports(&ports);
        assert_eq!(decode_ports(&b).unwrap(), ports);
        b.extend_from_slice(b"a later field");
        assert_eq!(decode_ports(&b).unwrap(), ports, "trailing bytes skipped");
        for n in 0..1 + 2 * 19 {
            assert!(decode_ports(&b[..n]).is_none(), "prefix {n}");
        }
        assert!(decode_ports(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9]).is_none(), "bad link");
        assert!(ports[0].reaches(&ports[0]) && !ports[0].reaches(&ports[1]));
        let other_subnet = Port { gid: [0xfd; 16], ..ports[1] };
        assert!(!ports[1].reaches(&other_subnet));
        let roce = Port { gid: [1; 16], lid: 0, link: LinkLayer::Ethernet };
        assert!(!roce.reaches(&ports[0]), "a fake port reaches only fake ports");

        let qps =
            [QpAddr { gid: [3; 16], lid: 1, qpn: 0x123, psn: 0x456 }, QpAddr { gid: [4; 16], lid: 2, qpn: 9, psn: 8 }];
        let o = encode_offer(1, &qps);
        assert_eq!(offer_len(o[..OFFER_HEAD].try_into().unwrap()), Some(o.len()));
        assert_eq!(decode_offer(&o).unwrap(), (1, qps.to_vec()));
        assert!(decode_offer(&o[..o.len() - 1]).is_none());
        assert!(offer_len(b"GXQP\0\0").is_none() && offer_len(b"GXQP\0\x11").is_none());
        assert!(offer_len(b"XXQP\0\x01").is_none());
        let a = encode_answer(ANSWER_OK, &qps);
        assert_eq!(decode_answer(&a, 2).unwrap().unwrap(), qps);
        assert!(decode_answer(&a, 1).is_none());
        assert_eq!(decode_answer(&[ANSWER_REFUSED], 2), Some(Err(())));
        assert!(decode_answer(&[], 2).is_none());
    }
}
