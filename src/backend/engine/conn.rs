//! What the engine puts in metadata and reads back from a peer's: its connection info (layouts 3 and 4: fixed
//! parts, or tagged sections a reader skips when it does not know them) and the tickets of its registrations
//! (a region's place in the transfer gate).

use std::net::{IpAddr, SocketAddr};

use super::gate::RegionTicket;
use super::route::Tickets;
use super::sides;
use crate::backend::RegionKey;
use crate::md::{put_bytes, put_uvar, Reader};
use crate::status::{Error, Result};

/// Connection-info layouts. 3: the parts below in a fixed order, nothing after. 4: the same parts as tagged
/// sections (`id | length | bytes`), in any order: a reader skips sections it does not know, and bytes after the
/// fields it knows inside a section it does know, so a later release can add a route (a section) or a field
/// without breaking this one. This release reads both and writes 3, which the releases before it read: a
/// rolling update with both on the cluster keeps working. The next release may write 4.
pub(super) const CONN_V3: u8 = 3;
pub(super) const CONN_V4: u8 = 4;
/// Layout 4's sections: the process (host id, pid, start time), the same-host route (gate descriptor and
/// address, control socket name), the engine secret, the TCP route (port, addresses).
pub(super) const SEC_PROCESS: u64 = 1;
pub(super) const SEC_LOCAL: u64 = 2;
pub(super) const SEC_SECRET: u64 = 3;
pub(super) const SEC_TCP: u64 = 4;
/// Ids 5 and up: routes' own sections (`sides::NET`), read and written by each route, kept here as bytes.
const MAX_CONN_SECTIONS: usize = 64;
const MAX_SECTION: usize = 64 * 1024;
const MAX_ADDRS: usize = 64;

/// Layout 3 connection info rewritten as layout 4: its parts as sections, those in `drop` left out, `extra`
/// added first (sections a later release might write). For tests and the fuzz target.
pub(crate) fn conn_v3_to_v4(v3: &[u8], drop: &[u64], extra: &[(u64, &[u8])]) -> Result<Vec<u8>> {
    let mut r = Reader { buf: v3, pos: 0 };
    if r.byte()? != CONN_V3 {
        return Err(Error::mismatch("not layout 3 connection info"));
    }
    let mut c = ConnInfo::default();
    let mut sections: Vec<(u64, &[u8])> = extra.to_vec();
    for id in V3_PARTS {
        let at = r.pos;
        read_part(id, &mut r, &mut c)?;
        if !drop.contains(&id) {
            sections.push((id, &v3[at..r.pos]));
        }
    }
    if r.left() != 0 {
        return Err(Error::mismatch("malformed engine connection info"));
    }
    let mut out = vec![CONN_V4];
    put_uvar(&mut out, sections.len() as u64);
    for (id, b) in sections {
        put_uvar(&mut out, id);
        put_bytes(&mut out, b);
    }
    Ok(out)
}

#[derive(Debug, Default)]
pub(super) struct ConnInfo {
    pub(super) host: String,
    pub(super) pid: i32,
    pub(super) start_time: u64,
    /// The same-host route's part was there (layout 4 may leave it out: then only TCP reaches the peer).
    pub(super) has_local: bool,
    pub(super) gate_fd: i32,
    pub(super) gate_addr: u64,
    pub(super) sock: Vec<u8>,
    pub(super) secret: u128,
    /// Empty when the TCP part was left out.
    pub(super) addrs: Vec<SocketAddr>,
    /// The TCP listener's port (0 when the TCP part was left out).
    pub(super) port: u16,
    /// Routes' own sections (`sides::NET`: layout 4 only), unread: each route parses its own.
    pub(super) routes: Vec<(u64, Vec<u8>)>,
}

impl ConnInfo {
    /// Route section `id`, as the peer wrote it.
    pub(super) fn route(&self, id: u64) -> Option<&[u8]> {
        self.routes.iter().find(|r| r.0 == id).map(|r| r.1.as_slice())
    }

    /// Layout 3, what this release advertises: the parts in `V3_PARTS`' order, `host id | pid | start time`,
    /// `gate fd | gate address u64 | Unix socket name`, `secret u128`, `TCP port u16 | addresses` (an address
    /// `4 | 4 bytes` or `6 | 16 bytes`, at most `MAX_ADDRS`).
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = vec![CONN_V3];
        put_bytes(&mut out, self.host.as_bytes());
        put_uvar(&mut out, self.pid as u64);
        put_uvar(&mut out, self.start_time);
        put_uvar(&mut out, self.gate_fd as u64);
        out.extend_from_slice(&self.gate_addr.to_le_bytes());
        put_bytes(&mut out, &self.sock);
        out.extend_from_slice(&self.secret.to_le_bytes());
        out.extend_from_slice(&self.port.to_le_bytes());
        let ips: Vec<IpAddr> = self.addrs.iter().map(|a| a.ip()).take(MAX_ADDRS).collect();
        put_uvar(&mut out, ips.len() as u64);
        for ip in ips {
            let (family, octets) = match ip {
                IpAddr::V4(v4) => (4, v4.octets().to_vec()),
                IpAddr::V6(v6) => (6, v6.octets().to_vec()),
            };
            out.push(family);
            out.extend_from_slice(&octets);
        }
        out
    }
}

pub(super) fn parse_conn(b: &[u8]) -> Result<ConnInfo> {
    let mut r = Reader { buf: b, pos: 0 };
    let mut c = ConnInfo::default();
    let mut seen = Vec::new();
    match r.byte()? {
        CONN_V3 => {
            for id in V3_PARTS {
                read_part(id, &mut r, &mut c)?;
            }
            seen.extend(V3_PARTS);
        }
        CONN_V4 => {
            for _ in 0..r.count(MAX_CONN_SECTIONS)? {
                let id = r.uvar()?;
                let mut sec = Reader { buf: r.bytes(MAX_SECTION)?, pos: 0 };
                if seen.contains(&id) {
                    return Err(Error::mismatch(format!("connection-info section {id} appears twice")));
                }
                seen.push(id);
                // A section it does not know is a route or a part of a later release: skipped.
                read_part(id, &mut sec, &mut c)?;
            }
        }
        _ => return Err(Error::mismatch("unknown engine connection-info version")),
    }
    if r.left() != 0 || !seen.contains(&SEC_PROCESS) || !seen.contains(&SEC_SECRET) {
        return Err(Error::mismatch("malformed engine connection info"));
    }
    Ok(c)
}

/// Layout 3's parts, in its order.
const V3_PARTS: [u64; 4] = [SEC_PROCESS, SEC_LOCAL, SEC_SECRET, SEC_TCP];

/// Read part `id` into `c`; one this release does not know is left unread.
fn read_part(id: u64, r: &mut Reader, c: &mut ConnInfo) -> Result<()> {
    match id {
        SEC_PROCESS => read_process(r, c),
        SEC_LOCAL => read_local(r, c),
        SEC_SECRET => r.array().map(|a| c.secret = u128::from_le_bytes(a)),
        SEC_TCP => read_tcp(r, c),
        _ if sides::is_section(id) => {
            c.routes.push((id, r.buf[r.pos..].to_vec()));
            r.pos = r.buf.len();
            Ok(())
        }
        _ => Ok(()),
    }
}

fn read_process(r: &mut Reader, c: &mut ConnInfo) -> Result<()> {
    c.host = r.string(4096)?;
    c.pid = i32::try_from(r.uvar()?)
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| Error::mismatch("bad pid in connection info"))?;
    c.start_time = r.uvar()?;
    Ok(())
}

fn read_local(r: &mut Reader, c: &mut ConnInfo) -> Result<()> {
    c.gate_fd = i32::try_from(r.uvar()?).map_err(|_| Error::mismatch("bad gate in connection info"))?;
    c.gate_addr = u64::from_le_bytes(r.array()?);
    c.sock = r.bytes(108)?.to_vec();
    c.has_local = true;
    Ok(())
}

fn read_tcp(r: &mut Reader, c: &mut ConnInfo) -> Result<()> {
    let port = u16::from_le_bytes(r.array()?);
    if port == 0 {
        return Err(Error::mismatch("TCP port 0 in connection info"));
    }
    let n = r.count(MAX_ADDRS)?;
    c.port = port;
    c.addrs = Vec::with_capacity(n);
    for _ in 0..n {
        let ip = match r.byte()? {
            4 => IpAddr::from(r.array::<4>()?),
            6 => IpAddr::from(r.array::<16>()?),
            _ => return Err(Error::mismatch("bad address family in connection info")),
        };
        c.addrs.push(SocketAddr::new(ip, port));
    }
    Ok(())
}

/// For `crate::fuzzing` only: the connection-info parser and the notification-frame parser.
/// Whatever parses as layout 3 parses to the same as its layout 4 rewriting.
pub(crate) fn fuzz_parse_conn(b: &[u8]) -> bool {
    // Routes' codecs read bytes from peers too: on the raw input, and on a section that parsed; and a region
    // ticket's sections.
    sides::fuzz(b);
    let _ = sides::read_tickets(&mut Reader { buf: b, pos: 0 });
    let Ok(c) = parse_conn(b) else { return false };
    c.routes.iter().for_each(|(_, r)| sides::fuzz(r));
    if c.has_local && c.port != 0 {
        // Layout 3 has no route sections: compare the rest.
        let again = parse_conn(&c.encode()).expect("connection info written again does not parse");
        let without = ConnInfo { routes: Vec::new(), ..parse_conn(b).expect("parsed once") };
        assert_eq!(format!("{again:?}"), format!("{without:?}"), "connection info changed when written again");
    }
    if let Ok(v4) = conn_v3_to_v4(b, &[], &[(99, b"later")]) {
        let again = parse_conn(&v4).expect("layout 4 rewriting of connection info does not parse");
        assert_eq!(format!("{again:?}"), format!("{c:?}"), "connection info changed across layouts");
    }
    true
}

/// For the fuzz seed corpus: layout 3 connection info as layout 4.
pub(crate) fn fuzz_conn_as_v4(v3: &[u8]) -> Option<Vec<u8>> {
    conn_v3_to_v4(v3, &[], &[(9, b"a section of a later release")]).ok()
}

/// The TCP endpoint a peer's connection info advertises: its addresses and the secret a connection must
/// present. For tools and tests that speak the wire protocol themselves (see `wire`).
#[doc(hidden)]
pub fn tcp_endpoint(conn: &[u8]) -> Result<(Vec<SocketAddr>, u128)> {
    parse_conn(conn).map(|c| (c.addrs, c.secret))
}

/// A peer's registration as its metadata names it; sent with each TCP request so the target can find it, and
/// checked against the target's gate (slot and state from the region's public bytes) on same-host routes.
pub(super) struct RemoteRegion {
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) ticket: RegionTicket,
    /// What its routes' sections of the ticket say (its RDMA keys, ...).
    pub(super) tickets: Tickets,
}

/// Remote region keys as (gate slot, state, address, length), as the target's gate checks them.
pub(super) fn gate_regions(keys: &[Option<RegionKey>]) -> impl Iterator<Item = (u32, u64, u64, u64)> + Clone + '_ {
    keys.iter().map(|k| match k.as_ref().and_then(|k| k.downcast_ref::<RemoteRegion>()) {
        Some(r) => (r.ticket.slot, r.ticket.state, r.addr, r.len),
        // Never for this engine's plans; refused by the gate if it happens.
        None => (u32::MAX, 0, 0, 0),
    })
}

/// `slot | state`, then the routes' sections (`sections`, from each route's `Export`), as a DRAM region's
/// public bytes.
pub(super) fn encode_ticket(t: RegionTicket, sections: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(24 + sections.len());
    put_uvar(&mut out, t.slot as u64);
    put_uvar(&mut out, t.state);
    out.extend_from_slice(sections);
    out
}

/// `slot | state`, then sections (see `sides::read_tickets`).
pub(super) fn decode_ticket(b: &[u8]) -> Result<(RegionTicket, Tickets)> {
    let mut r = Reader { buf: b, pos: 0 };
    let slot = u32::try_from(r.uvar()?).map_err(|_| Error::mismatch("bad region slot in metadata"))?;
    let state = r.uvar()?;
    Ok((RegionTicket { slot, state }, sides::read_tickets(&mut r)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::engine::route::rdma::wire::RdmaKeys;

    fn conn_bytes(addrs: &[(u8, &[u8])]) -> Vec<u8> {
        let mut b = vec![CONN_V3];
        put_bytes(&mut b, b"h");
        put_uvar(&mut b, 42);
        put_uvar(&mut b, 7);
        put_uvar(&mut b, 3);
        b.extend_from_slice(&(1u64 << 41).to_le_bytes());
        put_bytes(&mut b, b"sock");
        b.extend_from_slice(&99u128.to_le_bytes());
        b.extend_from_slice(&4242u16.to_le_bytes());
        put_uvar(&mut b, addrs.len() as u64);
        for (fam, ip) in addrs {
            b.push(*fam);
            b.extend_from_slice(ip);
        }
        b
    }

    #[test]
    fn conn_info_round_trip_and_garbage() {
        assert!(parse_conn(b"").is_err());
        assert!(parse_conn(&[2, 0]).is_err());
        assert!(parse_conn(&[3, 0]).is_err());
        let b = conn_bytes(&[(4, &[192, 0, 2, 1]), (6, &[0; 16])]);
        let c = parse_conn(&b).unwrap();
        assert_eq!((c.host.as_str(), c.pid, c.start_time, c.sock.as_slice(), c.secret), ("h", 42, 7, &b"sock"[..], 99));
        assert_eq!((c.gate_fd, c.gate_addr), (3, 1 << 41));
        assert_eq!(c.addrs, vec!["192.0.2.1:4242".parse().unwrap(), "[::]:4242".parse().unwrap()]);
        for n in 0..b.len() {
            assert!(parse_conn(&b[..n]).is_err(), "prefix {n}");
        }
        let mut t = b.clone();
        t.push(0);
        assert!(parse_conn(&t).is_err());
        assert!(parse_conn(&conn_bytes(&[(5, &[1, 2, 3, 4])])).is_err());
    }

    /// Layout 4: the same fields as layout 3 in sections; unknown sections (and bytes after the known fields of a
    /// known one) skipped; a section twice, or without the process or the secret, refused; every prefix refused.
    #[test]
    fn conn_info_v4_skips_what_it_does_not_know() {
        let v3 = conn_bytes(&[(4, &[192, 0, 2, 1])]);
        let want = parse_conn(&v3).unwrap();
        let v4 = conn_v3_to_v4(&v3, &[], &[(77, b"a route of a later release"), (31, b"")]).unwrap();
        let c = parse_conn(&v4).unwrap();
        assert_eq!(format!("{c:?}"), format!("{want:?}"));
        // A route's section is kept as bytes, for that route to read.
        let with = parse_conn(&conn_v3_to_v4(&v3, &[], &[(sides::NET[0].section(), b"ports")]).unwrap()).unwrap();
        assert_eq!(with.route(sides::NET[0].section()), Some(&b"ports"[..]));
        for n in 0..v4.len() {
            assert!(parse_conn(&v4[..n]).is_err(), "prefix {n}");
        }
        let mut t = v4.clone();
        t.push(0);
        assert!(parse_conn(&t).is_err(), "trailing byte after the sections");
        // A field added at the end of a known section.
        let mut longer = vec![CONN_V4, 2];
        put_uvar(&mut longer, SEC_PROCESS);
        put_bytes(&mut longer, &[1, b'h', 42, 7, 0xEE, 0xEE]);
        put_uvar(&mut longer, SEC_SECRET);
        put_bytes(&mut longer, &99u128.to_le_bytes());
        let c = parse_conn(&longer).unwrap();
        assert_eq!((c.host.as_str(), c.pid, c.start_time, c.secret, c.has_local), ("h", 42, 7, 99, false));
        assert!(c.addrs.is_empty());
        assert!(parse_conn(&conn_v3_to_v4(&v3, &[SEC_PROCESS], &[]).unwrap()).is_err(), "no process section");
        assert!(parse_conn(&conn_v3_to_v4(&v3, &[SEC_SECRET], &[]).unwrap()).is_err(), "no secret");
        assert!(parse_conn(&conn_v3_to_v4(&v3, &[], &[(SEC_TCP, &[1, 1, 0])]).unwrap()).is_err(), "a section twice");
        // Region tickets: sections after slot and state are skipped.
        let t = RegionTicket { slot: 5, state: 9 };
        // As the RDMA route reads them.
        let decode = |b: &[u8]| decode_ticket(b).map(|(t, k)| (t, k.get::<RdmaKeys>().cloned()));
        let none = None;
        let mut ticket = encode_ticket(t, &[]);
        assert_eq!(decode(&ticket).unwrap(), (t, none.clone()));
        put_uvar(&mut ticket, 31);
        put_bytes(&mut ticket, b"later");
        assert_eq!(decode(&ticket).unwrap(), (t, none.clone()));
        ticket.push(3);
        assert!(decode_ticket(&ticket).is_err());
        // The RDMA keys' and nearest ports' sections, and a later one after them.
        let keys = RdmaKeys { rkeys: vec![0xABCD01, 7], near: 0b10, bounds: vec![] };
        let with = |k: &RdmaKeys| encode_ticket(t, &k.sections());
        let read = |k: &RdmaKeys| Some(k.clone());
        let mut ticket = with(&keys);
        assert_eq!(decode(&ticket).unwrap(), (t, read(&keys)));
        put_uvar(&mut ticket, 32);
        put_bytes(&mut ticket, b"");
        assert_eq!(decode(&ticket).unwrap(), (t, read(&keys)));
        let mut short = encode_ticket(t, &[]);
        put_uvar(&mut short, 1);
        put_bytes(&mut short, &[1, 2, 3]);
        assert!(decode_ticket(&short).is_err());
        let mut short = encode_ticket(t, &[]);
        put_uvar(&mut short, 2);
        put_bytes(&mut short, &[1, 2, 3]);
        assert!(decode_ticket(&short).is_err());
        // Several memory regions: their bounds, one key per port each.
        let chunked = RdmaKeys { rkeys: vec![1, 2, 3, 4, 5, 6], near: 1, bounds: vec![0x1000, 0x5000, 0x9000] };
        assert_eq!(decode(&with(&chunked)).unwrap(), (t, read(&chunked)));
        let odd = RdmaKeys { rkeys: vec![1, 2, 3, 4], ..chunked.clone() };
        assert!(decode_ticket(&with(&odd)).is_err(), "4 keys for 3 regions");
        let unordered = RdmaKeys { bounds: vec![0x5000, 0x1000, 0x9000], ..chunked };
        assert!(decode_ticket(&with(&unordered)).is_err(), "bounds out of order");
        let mut short = encode_ticket(t, &[]);
        put_uvar(&mut short, 3);
        put_bytes(&mut short, &[0; 8]);
        assert!(decode_ticket(&short).is_err());
    }
}
