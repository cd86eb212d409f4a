//! The TCP target's table of registrations and the leases its serving loops hold on them (`Regions`): what a
//! TCP peer can reach, whatever its metadata claims, and what `deregister_memory` waits for.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::wire::{self, RegionTable, WireSeg};
use crate::backend::XferOp;
use crate::overlap::{Access, Counts, Footprint, Space, Table};

/// The registrations a target serves, and the leases its serving threads hold on them.
///
/// A request is checked against the table and, if allowed, leases the registrations it names for as long
/// as it touches their memory; the table's lock is held only for the check, never across socket I/O.
/// Removing the last registration of a range refuses later requests at once and then waits for the
/// leases on that range only, for at most the disconnect timeout: a peer still holding one then is too
/// slow and its connection is shut down, which wakes its serving thread out of the socket call; the wait
/// then continues until the lease is given back (a woken thread returns from its one system call), so
/// nothing touches the range after `remove` returns.
#[derive(Default)]
pub struct Regions {
    st: Mutex<RegionState>,
    released: Condvar,
    /// Disconnect timeout in ns: how long `remove` waits before cutting the holders off (0: not set yet,
    /// use one second).
    bound_ns: AtomicU64,
    /// The overlap check's counts while it is on in this process's agent: then every request served is
    /// checked against the others being served for other initiators (see `lease`).
    overlap: std::sync::OnceLock<Arc<Counts>>,
}

#[derive(Default)]
struct RegionState {
    table: RegionTable,
    /// The ranges of `table` registered as device memory (VRAM): range → (device, registrations). Served
    /// staged through page-locked buffers (see `vram`), never by socket I/O on their addresses.
    vram: HashMap<(u64, u64), (u32, u32)>,
    /// Serving connection id → the ranges its current request holds, and its socket (to cut it off).
    leases: HashMap<u64, Held>,
    closed: bool,
    /// While the overlap check is on: the byte ranges each connection's request touches, with its initiator
    /// and operation.
    inflight: Table<(Arc<str>, XferOp)>,
}

/// The ranges one serving connection's request holds, and its socket.
type Held = (Vec<(u64, u64)>, Weak<TcpStream>);

impl Regions {
    /// Switch the overlap check on for the requests this target serves, counting conflicts in `counts`.
    pub fn set_overlap(&self, counts: Arc<Counts>) {
        let _ = self.overlap.set(counts);
    }

    pub fn set_bound(&self, d: Duration) {
        self.bound_ns.store(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// One more registration of exactly `addr..addr+len` (in the memory of device `dev`, for VRAM).
    pub fn add(&self, addr: u64, len: u64, dev: Option<u32>) {
        let mut st = self.st.lock();
        *st.table.entry((addr, len)).or_insert(0) += 1;
        if let Some(dev) = dev {
            st.vram.entry((addr, len)).or_insert((dev, 0)).1 += 1;
        }
    }

    /// One registration fewer of each range (and device, as given to `add`). Ranges whose last registration
    /// this was refuse requests at once; then one wait (bounded in all, see the type's comment) for the
    /// requests holding a lease on any of them.
    pub fn remove(&self, ranges: &[(u64, u64, Option<u32>)]) {
        let mut st = self.st.lock();
        let mut gone = Vec::new();
        for &(addr, len, dev) in ranges {
            let k = (addr, len);
            if let Some(v) = st.vram.get_mut(&k).filter(|_| dev.is_some()) {
                v.1 -= 1;
                if v.1 == 0 {
                    st.vram.remove(&k);
                }
            }
            let Some(n) = st.table.get_mut(&k) else { continue };
            *n -= 1;
            if *n == 0 {
                st.table.remove(&k);
                gone.push(k);
            }
        }
        if gone.is_empty() {
            return;
        }
        gone.sort_unstable();
        let ns = self.bound_ns.load(Ordering::Relaxed);
        let bound = if ns == 0 { Duration::from_secs(1) } else { Duration::from_nanos(ns) };
        self.wait_leases(st, bound, |held| held.iter().any(|k| gone.binary_search(k).is_ok()));
    }

    /// The engine is going away: refuse everything from now on, cut every serving connection off at once
    /// and wait until no request touches memory.
    pub fn close(&self) {
        let mut st = self.st.lock();
        st.closed = true;
        st.table.clear();
        st.vram.clear();
        self.wait_leases(st, Duration::ZERO, |_| true);
    }

    fn wait_leases(
        &self,
        mut st: parking_lot::MutexGuard<'_, RegionState>,
        bound: Duration,
        holds: impl Fn(&[(u64, u64)]) -> bool,
    ) {
        let deadline = std::time::Instant::now() + bound;
        let mut cut = false;
        loop {
            let holders: Vec<Weak<TcpStream>> =
                st.leases.values().filter(|(r, _)| holds(r)).map(|(_, s)| s.clone()).collect();
            if holders.is_empty() {
                return;
            }
            if !cut && std::time::Instant::now() >= deadline {
                // Too slow: shut the holders' connections down, which ends their socket calls.
                for s in holders.iter().filter_map(Weak::upgrade) {
                    let _ = s.shutdown(Shutdown::Both);
                }
                cut = true;
            }
            if cut {
                self.released.wait(&mut st);
            } else {
                let _ = self.released.wait_until(&mut st, deadline);
            }
        }
    }

    /// Check `segs` and lease the ranges they name for connection `conn` until `release(conn)`. Refused
    /// when some segment lies outside every registration, when the request mixes host and device
    /// registrations, or when the engine is closing. `by`: the operation and the initiator's agent name.
    ///
    /// While the overlap check is on, the request's bytes are also checked against those of the requests being
    /// served for *other* initiators (an initiator's own requests are its own check's business): a WRITE
    /// onto bytes another initiator's request reads or writes, or a READ of bytes another's WRITE is writing,
    /// is logged and counted. The request is served all the same: the target cannot tell which of the two the
    /// application meant, and refusing would fail a request the initiator believes is correct.
    pub fn lease(&self, conn: u64, stream: &Arc<TcpStream>, segs: &[WireSeg], by: (XferOp, &Arc<str>)) -> Leased {
        let mut st = self.st.lock();
        if st.closed || !wire::segs_allowed(&st.table, segs) {
            return Leased::Refused;
        }
        let devs: Vec<Option<u32>> = segs.iter().map(|s| st.vram.get(&(s.region, s.region_len)).map(|v| v.0)).collect();
        let leased = if devs.iter().all(Option::is_none) {
            Leased::Host
        } else if let Some(devs) = devs.into_iter().collect::<Option<Vec<u32>>>() {
            Leased::Device(devs)
        } else {
            return Leased::Refused;
        };
        if let Some(counts) = self.overlap.get() {
            check_overlap(&mut st.inflight, counts, conn, segs, &leased, by);
        }
        let mut ranges: Vec<(u64, u64)> = segs.iter().map(|s| (s.region, s.region_len)).collect();
        ranges.sort_unstable();
        ranges.dedup();
        st.leases.insert(conn, (ranges, Arc::downgrade(stream)));
        leased
    }

    /// Connection `conn` no longer touches the memory it leased.
    pub fn release(&self, conn: u64) {
        let mut st = self.st.lock();
        st.leases.remove(&conn);
        st.inflight.remove(conn);
        drop(st);
        self.released.notify_all();
    }
}

/// The target's overlap check of one request being leased (see `Regions::lease`): logged and counted, then
/// the request joins the table until its lease is released.
fn check_overlap(
    table: &mut Table<(Arc<str>, XferOp)>,
    counts: &Counts,
    conn: u64,
    segs: &[WireSeg],
    leased: &Leased,
    (op, who): (XferOp, &Arc<str>),
) {
    let access = if op == XferOp::Write { Access::Write } else { Access::Read };
    let space = |i: usize| match leased {
        Leased::Device(devs) => Space { owner: 0, mem: crate::mem::MemType::Vram as u8, dev: devs[i] as u64 },
        _ => Space { owner: 0, mem: crate::mem::MemType::Dram as u8, dev: 0 },
    };
    let fp = Footprint::build(segs.iter().enumerate().map(|(i, s)| (space(i), access, s.addr, s.len)));
    if let Some(c) = table.first_conflict(&fp, |_, (peer, _)| peer != who) {
        counts.target.fetch_add(1, Ordering::Relaxed);
        let (peer, their_op) = table.payload(c.other).cloned().unwrap_or_else(|| (Arc::from("?"), op));
        let name = |o: XferOp| if o == XferOp::Write { "WRITE" } else { "READ" };
        crate::telemetry::log::warn(&format!(
            "overlap check (TCP target): a {} from '{who}' {} bytes [{:#x}, {:#x}) that a {} from '{peer}' being served \
             {}; NIXL orders neither, so the result is whichever lands last (GIXL_CHECK_OVERLAP is on here)",
            name(op),
            if op == XferOp::Write { "writes" } else { "reads" },
            c.range.0,
            c.range.1,
            name(their_op),
            c.theirs.verb()
        ));
    }
    table.insert(conn, Arc::new(fp), (who.clone(), op));
}

impl Regions {}

/// What `Regions::lease` decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Leased {
    Refused,
    /// Every segment lies in host memory: served by socket I/O straight on it.
    Host,
    /// Every segment lies in device memory (the device of each): staged (see `vram`).
    Device(Vec<u32>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn vram_registrations_lease_as_device_and_never_mixed_with_host() {
        let r = Regions::default();
        r.add(0x1000, 0x1000, None);
        r.add(0x10_0000, 0x1000, Some(3));
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = Arc::new(TcpStream::connect(l.local_addr().unwrap()).unwrap());
        let seg = |region, addr| WireSeg { region, region_len: 0x1000, addr, len: 16 };
        let me: Arc<str> = Arc::from("me");
        let by = (XferOp::Write, &me);
        assert_eq!(r.lease(1, &s, &[seg(0x1000, 0x1000)], by), Leased::Host);
        r.release(1);
        let two = [seg(0x10_0000, 0x10_0010), seg(0x10_0000, 0x10_0100)];
        assert_eq!(r.lease(1, &s, &two, by), Leased::Device(vec![3, 3]));
        r.release(1);
        assert_eq!(r.lease(1, &s, &[seg(0x1000, 0x1000), seg(0x10_0000, 0x10_0000)], by), Leased::Refused);
        // Deregistered: refused; the same range registered again as host memory is host memory.
        r.remove(&[(0x10_0000, 0x1000, Some(0))]);
        assert_eq!(r.lease(1, &s, &[seg(0x10_0000, 0x10_0000)], by), Leased::Refused);
        r.add(0x10_0000, 0x1000, None);
        assert_eq!(r.lease(1, &s, &[seg(0x10_0000, 0x10_0000)], by), Leased::Host);
        r.release(1);
        // Two VRAM registrations of one range: the first removal leaves it device memory.
        r.remove(&[(0x10_0000, 0x1000, None)]);
        r.add(0x10_0000, 0x1000, Some(2));
        r.add(0x10_0000, 0x1000, Some(2));
        r.remove(&[(0x10_0000, 0x1000, Some(0))]);
        assert_eq!(r.lease(1, &s, &[seg(0x10_0000, 0x10_0000)], by), Leased::Device(vec![2]));
    }

    /// With the overlap check on, a request that writes bytes another initiator's request being served reads or
    /// writes is counted; the same initiator's, adjacent bytes, two readers, and a released lease are not.
    #[test]
    fn the_target_counts_overlaps_between_initiators() {
        let r = Regions::default();
        let counts = Arc::new(Counts::default());
        r.set_overlap(counts.clone());
        r.add(0x1000, 0x1000, None);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = Arc::new(TcpStream::connect(l.local_addr().unwrap()).unwrap());
        let seg = |addr, len| WireSeg { region: 0x1000, region_len: 0x1000, addr, len };
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let (w, rd) = (XferOp::Write, XferOp::Read);
        assert_eq!(r.lease(1, &s, &[seg(0x1000, 0x100)], (w, &a)), Leased::Host);
        assert_eq!(r.lease(2, &s, &[seg(0x1080, 0x100)], (w, &a)), Leased::Host);
        assert_eq!(counts.get(), (0, 0), "the same initiator: its own check's business");
        assert_eq!(r.lease(3, &s, &[seg(0x1200, 0x100)], (w, &b)), Leased::Host);
        assert_eq!(counts.get(), (0, 0), "other bytes");
        assert_eq!(r.lease(4, &s, &[seg(0x10ff, 0x1)], (rd, &b)), Leased::Host);
        assert_eq!(counts.get(), (0, 1), "reading what another initiator writes");
        r.release(1);
        r.release(2);
        r.release(4);
        assert_eq!(r.lease(5, &s, &[seg(0x1000, 0x100)], (rd, &b)), Leased::Host);
        assert_eq!(r.lease(6, &s, &[seg(0x1000, 0x100)], (rd, &a)), Leased::Host);
        assert_eq!(counts.get(), (0, 1), "released leases and two readers");
        assert_eq!(r.lease(7, &s, &[seg(0x1100, 0x100), seg(0x10f0, 0x20)], (w, &a)), Leased::Host);
        assert_eq!(counts.get(), (0, 2), "a WRITE onto what another initiator reads");
    }
}
