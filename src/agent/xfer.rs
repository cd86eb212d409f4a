//! Prepped descriptor lists, transfer requests, and the generation gate.
//!
//! A prepped list resolves every descriptor against registrations once, and keeps (by `Arc`) the remote
//! incarnation it was resolved against. A request built from two prepped lists is a finished plan: posting
//! it is one check of that remote's state (the gate) and a hand-off to the backend. Nothing here re-resolves
//! descriptors at post time, and nothing a handle points to is freed while the handle lives.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::overlap::{Checker, Req};
use super::section::Section;
use super::{Agent, BackendId, BackendSlot, RemoteAgent};
use crate::backend::{BackendXfer, RegionKey, Seg, Target, XferOp, XferPlan};
use crate::mem::{Desc, MemType, XferDList};
use crate::overlap::Footprint;
use crate::status::{Error, Result, Status};

#[derive(Clone)]
pub(crate) enum Side {
    /// `""`: the initiator's own buffers.
    Initiator,
    /// The agent's own name: its buffers as a transfer target.
    Loopback,
    Remote(Arc<RemoteAgent>),
}

/// One backend's view of a prepped list: the region key of every group.
struct Resolved {
    slot: Arc<BackendSlot>,
    /// Per group (see `Prepped::devs`), the key of the region that covers its descriptors.
    keys: Vec<Option<RegionKey>>,
}

/// One prepped descriptor in 16 bytes, so that a random index costs one cache line (and one prefetch):
/// the address, the length (`LONG` when it does not fit in 32 bits; then `Prepped::long` has it) and the
/// group, which stands for the device id and, in every backend, the region that covers the descriptor.
#[derive(Clone, Copy, Default)]
#[repr(C, align(16))]
struct Entry {
    addr: u64,
    len: u32,
    group: u32,
}

/// `per` consecutive descriptors (the last run may have fewer) at `addr + k * stride`, one length and group.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Run {
    addr: u64,
    stride: u64,
    len: u32,
    group: u32,
}

struct Runs {
    runs: Vec<Run>,
    per: usize,
}

/// Runs are used when they are at least this many times smaller than one entry per descriptor.
const RUN_GAIN: usize = 8;

impl Runs {
    /// Equal-length, same-group, evenly spaced runs of one common size, if the list `d` (whose groups are
    /// the spans `spans`, see [`Groups`]) is made of them. With the list's `Breaks` (found while the list
    /// was resolved) nothing but the first descriptor of each run is read again.
    fn find(d: &[crate::mem::Desc], spans: &[(usize, u32)], breaks: Option<&Breaks>) -> Option<Runs> {
        let n = d.len();
        if n < 2 || spans.is_empty() {
            return None;
        }
        match breaks {
            Some(b) if b.over => return None,
            Some(b) => return Runs::from_breaks(d, spans, b),
            None => {}
        }
        // Descriptors `from + 1 .. to` continue the run that `d[from]` starts with `stride`, one length.
        let follow = |from: usize, to: usize, stride: u64| {
            let (len, mut at) = (d[from].len, d[from].addr);
            d[from + 1..to].iter().all(|x| {
                at = at.wrapping_add(stride);
                x.len == len && x.addr == at
            })
        };
        // The first run's length fixes `per` (at most the first group's span); every other run must have it
        // (the last at most it).
        let stride0 = d[1].addr.wrapping_sub(d[0].addr);
        let first_span = spans[0].0.min(n);
        let (len0, mut at) = (d[0].len, d[0].addr);
        let per = 1 + d[1..first_span]
            .iter()
            .take_while(|x| {
                at = at.wrapping_add(stride0);
                x.len == len0 && x.addr == at
            })
            .count();
        Runs::build(d, spans, per, |from, take, stride| follow(from, from + take, stride))
    }

    /// `find` without a pass over the list: a run `[from, to)` continues unbroken when no length break lies
    /// in `from + 1 .. to` and no stride break in `from + 2 .. to` (see [`Breaks`]).
    fn from_breaks(d: &[crate::mem::Desc], spans: &[(usize, u32)], b: &Breaks) -> Option<Runs> {
        let n = d.len();
        let first_span = spans[0].0.min(n);
        let first_len = b.lens.first().copied().unwrap_or(usize::MAX);
        let first_stride = b.strides.first().copied().unwrap_or(usize::MAX);
        let per = first_span.min(first_len).min(first_stride);
        let (mut li, mut si) = (0, 0);
        Runs::build(d, spans, per, |from, take, _| {
            // Breaks at or before this run's first descriptor (+1 for strides) do not concern it.
            while li < b.lens.len() && b.lens[li] <= from {
                li += 1;
            }
            while si < b.strides.len() && b.strides[si] <= from + 1 {
                si += 1;
            }
            !(b.lens.get(li).is_some_and(|&i| i < from + take) || b.strides.get(si).is_some_and(|&i| i < from + take))
        })
    }

    /// Runs of `per` descriptors (the last may have fewer), each inside one group span, each checked by
    /// `continues(from, take, stride)`; None as soon as one is not a run.
    fn build(
        d: &[crate::mem::Desc],
        spans: &[(usize, u32)],
        per: usize,
        mut continues: impl FnMut(usize, usize, u64) -> bool,
    ) -> Option<Runs> {
        let n = d.len();
        if per < RUN_GAIN * 2
            || n.div_ceil(per) * std::mem::size_of::<Run>() * RUN_GAIN > n * std::mem::size_of::<Entry>()
        {
            return None;
        }
        let len32 = |x: &crate::mem::Desc| u32::try_from(x.len).ok().filter(|&l| l != LONG);
        let mut runs = Vec::with_capacity(n.div_ceil(per));
        let (mut from, mut span) = (0, 0);
        while from < n {
            let take = per.min(n - from);
            while spans[span].0 <= from {
                span += 1;
            }
            // One group for the whole run.
            let (end, group) = spans[span];
            let e = &d[from];
            let len = len32(e)?;
            let stride = if take > 1 { d[from + 1].addr.wrapping_sub(e.addr) } else { 0 };
            if end < from + take || !continues(from, take, stride) {
                return None;
            }
            runs.push(Run { addr: e.addr, stride, len, group });
            from += take;
        }
        Some(Runs { runs, per })
    }
}

/// Where a descriptor list stops being one arithmetic progression, found in the same pass that resolves it:
/// `lens` holds every `i` whose length differs from descriptor `i - 1`'s, `strides` every `i ≥ 2` whose
/// distance from `i - 1` differs from that of `i - 1` from `i - 2` (wrapping), both increasing. At most
/// `limit` of each are kept: a list with more cannot be runs of `RUN_GAIN * 2` or more (each run adds at most
/// one length and two stride breaks), and then there are none.
struct Breaks {
    lens: Vec<usize>,
    strides: Vec<usize>,
    limit: usize,
    /// The list ended up with too many: no runs.
    over: bool,
    prev: Option<(u64, u64, u64)>,
}

impl Breaks {
    fn new(n: usize) -> Breaks {
        Breaks { lens: Vec::new(), strides: Vec::new(), limit: n / RUN_GAIN + 4, over: false, prev: None }
    }

    /// Descriptor `i` (the descriptors come in order, each once).
    #[inline(always)]
    fn see(&mut self, i: usize, d: &crate::mem::Desc) {
        if let Some((addr, len, stride)) = self.prev {
            let s = d.addr.wrapping_sub(addr);
            if d.len != len {
                self.lens.push(i);
            }
            if i >= 2 && s != stride {
                self.strides.push(i);
            }
            self.prev = Some((d.addr, d.len, s));
        } else {
            self.prev = Some((d.addr, d.len, 0));
        }
    }

    /// `see` every descriptor from `from` on (up to `limit`) that region `r` covers; the index of the first
    /// one it does not. `Desc::covers` and `see`, with the region's bounds and the last descriptor held in
    /// registers: this loop reads every descriptor of a list once, so it is the cost of a prep.
    #[inline(always)]
    fn scan(&mut self, d: &[crate::mem::Desc], from: usize, limit: usize, r: &crate::mem::Desc, mem: MemType) -> usize {
        let unbounded = r.len == 0 && mem.zero_len_is_unbounded();
        let Some(hi) = (if unbounded { Some(u64::MAX) } else { r.end() }) else { return from };
        let (lo, dev) = (r.addr, r.dev);
        let Some((mut pa, mut pl, mut ps)) = self.prev else { return from };
        let mut k = from;
        while k < limit {
            // A stretch that continues the progression (same length, same step, same device) needs no break
            // noted, and needs no bounds check of its own: it is cut where the progression leaves `r`.
            if k >= 2 {
                let next = pa.wrapping_add(ps);
                let step = ps as i64;
                let inside = next >= lo && next.checked_add(pl).is_some_and(|e| e <= hi);
                // How many terms next, next + step, ... stay inside [lo, hi - pl] (no wrapping among them).
                let room = match (inside, step.signum()) {
                    (false, _) => 0,
                    (true, 1) => (hi - pl - next) / step as u64 + 1,
                    (true, -1) => (next - lo) / step.unsigned_abs() + 1,
                    (true, _) => u64::MAX,
                };
                let cap = limit.min(k.saturating_add(usize::try_from(room).unwrap_or(usize::MAX)));
                let mut end = k;
                let mut want = next;
                while end < cap && d[end].addr == want && d[end].len == pl && d[end].dev == dev {
                    want = want.wrapping_add(ps);
                    end += 1;
                }
                if end > k {
                    pa = d[end - 1].addr;
                    k = end;
                    continue;
                }
            }
            let x = &d[k];
            let Some(end) = x.addr.checked_add(x.len) else { break };
            if x.dev != dev || x.addr < lo || end > hi {
                break;
            }
            let s = x.addr.wrapping_sub(pa);
            if x.len != pl {
                self.lens.push(k);
            }
            if s != ps && k >= 2 {
                self.strides.push(k);
            }
            (pa, pl, ps) = (x.addr, x.len, s);
            k += 1;
        }
        self.prev = Some((pa, pl, ps));
        k
    }

    /// Give up once either list is past its limit (checked between spans, so a list of many short spans
    /// stops early enough).
    fn check(&mut self) {
        if self.lens.len() > self.limit || self.strides.len() > self.limit {
            self.over = true;
            self.lens = Vec::new();
            self.strides = Vec::new();
        }
    }
}

/// `Entry::len` of a descriptor whose length is in `Prepped::long`.
const LONG: u32 = u32::MAX;

/// `nixlDlistH`: descriptors resolved against registrations, for one side of future requests.
#[derive(Clone)]
pub struct PreppedDList(Arc<Prepped>);

struct Prepped {
    owner: u128,
    side: Side,
    mem: MemType,
    /// Number of descriptors.
    n: usize,
    /// One per descriptor, unless `runs` describes them all (then empty).
    entries: Vec<Entry>,
    /// Per-block lists (vLLM's: every block of one layer, then the next layer) are arithmetic runs:
    /// stored as runs of `per` descriptors each, a million entries take kilobytes and stay in cache.
    runs: Option<Runs>,
    /// Lengths of `LONG` entries, by entry index (sorted).
    long: Vec<(u32, u64)>,
    /// Per group, the device id of its descriptors (a covering region is on the same device).
    devs: Vec<u64>,
    resolved: Vec<Resolved>,
}

impl Prepped {
    #[inline(always)]
    fn len_of(&self, i: usize, e: &Entry) -> u64 {
        if e.len != LONG {
            return e.len as u64;
        }
        match self.long.binary_search_by_key(&(i as u32), |x| x.0) {
            Ok(k) => self.long[k].1,
            Err(_) => LONG as u64,
        }
    }
}

impl std::fmt::Debug for PreppedDList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PreppedDList({} {} descriptors, remote {:?})", self.0.n, self.0.mem.seg_name(), self.remote_name())
    }
}

impl PreppedDList {
    pub fn len(&self) -> usize {
        self.0.n
    }
    pub fn is_empty(&self) -> bool {
        self.0.n == 0
    }
    pub fn mem_type(&self) -> MemType {
        self.0.mem
    }
    /// The remote agent this list was prepped against, if any.
    pub fn remote_name(&self) -> Option<&str> {
        match &self.0.side {
            Side::Remote(ra) => Some(&ra.name),
            _ => None,
        }
    }
}

/// Options for making a request (`nixl_opt_args_t` as far as it matters here).
#[derive(Debug, Clone, Default)]
pub struct XferOpts {
    pub backends: Vec<BackendId>,
    /// `Some(msg)` asks for a notification (possibly empty) once the data has landed.
    pub notif: Option<Vec<u8>>,
    pub skip_desc_merge: bool,
}

/// What a post does to the request's notification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotifUpdate {
    /// No option struct given (Python `b""`): keep the previous one.
    Keep,
    /// Options without a notification: send none.
    Clear,
    Set(Vec<u8>),
}

/// `nixlXferTelemetry`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XferTelemetry {
    pub start_time_us: u64,
    pub post_duration_us: u64,
    pub xfer_duration_us: u64,
    pub total_bytes: u64,
    pub desc_count: u64,
}

/// `nixlXferReqH`.
#[derive(Clone)]
pub struct XferReq(Arc<Xfer>);

struct Xfer {
    owner: u128,
    slot: Arc<BackendSlot>,
    remote: Option<Arc<RemoteAgent>>,
    target: Target,
    bx: Arc<dyn BackendXfer>,
    /// While the overlap check is on (see `overlap`): the checker, this request's id and footprint.
    check: Option<(Arc<Checker>, u64, Arc<Footprint>)>,
    op: XferOp,
    desc_count: u64,
    total_bytes: u64,
    /// READ (telemetry counts it as received bytes) or WRITE (sent).
    read: bool,
    st: Mutex<XferState>,
}

struct XferState {
    notif: Option<Vec<u8>>,
    /// None until the first post.
    last: Option<Status>,
    released: bool,
    post_start: Option<Instant>,
    start_time_us: u64,
    post_duration_us: u64,
}

impl Xfer {
    /// Out of the overlap check's table (terminal status, release, drop); nothing while the check is off.
    fn leave_check(&self) {
        if let Some((ck, id, _)) = &self.check {
            ck.leave(*id);
        }
    }
}

impl Drop for Xfer {
    fn drop(&mut self) {
        self.leave_check();
    }
}

impl std::fmt::Debug for XferReq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "XferReq({} pieces, {} bytes, backend {})", self.0.desc_count, self.0.total_bytes, self.0.slot.name)
    }
}

impl XferReq {
    pub fn backend(&self) -> BackendId {
        self.0.slot.id
    }
    pub fn backend_name(&self) -> &'static str {
        self.0.slot.name
    }
    pub fn desc_count(&self) -> u64 {
        self.0.desc_count
    }
    pub fn total_bytes(&self) -> u64 {
        self.0.total_bytes
    }
    pub fn is_released(&self) -> bool {
        self.0.st.lock().released
    }
    /// The remote incarnation this request was built against (None for loopback).
    pub fn remote_incarnation(&self) -> Option<u128> {
        self.0.remote.as_ref().map(|r| r.incarnation)
    }
}

impl Agent {
    /// Resolve `descs` for use as one side of later requests: `agent` is `""` for this agent's buffers as
    /// initiator, this agent's own name for loopback, or a loaded peer.
    pub fn prep_xfer_dlist(&self, agent: &str, descs: &XferDList, hints: &[BackendId]) -> Result<PreppedDList> {
        self.prep_xfer_descs(agent, descs.mem_type(), descs.descs(), hints)
    }

    /// `prep_xfer_dlist` of descriptors read in place (the C ABI's bulk path hands the caller's array).
    pub fn prep_xfer_descs(
        &self,
        agent: &str,
        mem: MemType,
        descs: &[Desc],
        hints: &[BackendId],
    ) -> Result<PreppedDList> {
        self.prep_searched(agent, mem, descs, hints).map_err(|f| f.err)
    }

    /// `prep_xfer_descs`, telling on failure whether registrations were searched for the descriptors and
    /// none covered them all (`PrepFail::searched`): the one failure after which NIXL's C++
    /// `prepXferDlist` sets the caller's handle to null rather than leaving it as it was.
    pub fn prep_searched(
        &self,
        agent: &str,
        mem: MemType,
        descs: &[Desc],
        hints: &[BackendId],
    ) -> std::result::Result<PreppedDList, PrepFail> {
        let early = |err| PrepFail { err, searched: false };
        if descs.is_empty() {
            return Err(early(Error::not_found("cannot prep an empty descriptor list")));
        }
        if descs.len() > MAX_ENTRIES {
            return Err(early(Error::invalid_param(format!(
                "{} descriptors in one prepped list; gixl allows at most {MAX_ENTRIES}",
                descs.len()
            ))));
        }
        let side = if agent.is_empty() {
            Side::Initiator
        } else if agent == self.inner.name {
            Side::Loopback
        } else {
            Side::Remote(self.remote(agent).map_err(early)?)
        };
        // Hinted backends are searched as they are; otherwise only those with registrations of `mem`.
        let mut searched = !hints.is_empty();
        let mut groups = Groups::new(descs.len());
        let mut slots = Vec::new();
        match &side {
            Side::Initiator | Side::Loopback => {
                let local_only = matches!(side, Side::Loopback);
                let chosen = self
                    .chosen(hints, |b| b.caps.mems.contains(&mem) && (!local_only || b.caps.local))
                    .map_err(early)?;
                let regs = self.inner.regs.read();
                for slot in chosen {
                    let Some(sec) = regs.get(&(slot.id, mem)) else { continue };
                    searched = true;
                    if groups.refine(descs, mem, sec, |i| sec.get(i).1.key.clone()) {
                        slots.push(slot);
                    }
                }
            }
            Side::Remote(ra) => {
                let chosen = self.chosen(hints, |b| ra.peer(b.id).is_some()).map_err(early)?;
                let sections = ra.sections.read();
                for slot in chosen {
                    let Some(sec) = sections.get(&(slot.id, mem)) else { continue };
                    searched = true;
                    if groups.refine(descs, mem, sec, |i| sec.get(i).1.key.clone()) {
                        slots.push(slot);
                    }
                }
            }
        }
        if slots.is_empty() {
            let whose = if agent.is_empty() { "this agent" } else { agent };
            let err = Error::not_found(format!(
                "no backend has registrations of {whose} covering all {} {} descriptors",
                descs.len(),
                mem.seg_name()
            ));
            return Err(PrepFail { err, searched });
        }
        let Groups { of, keys, devs, breaks } = groups;
        let resolved = slots.into_iter().zip(keys).map(|(slot, keys)| Resolved { slot, keys }).collect();
        let d = descs;
        let n = d.len();
        // Straight from the descriptors: a per-block list never builds the entries it does not keep.
        let runs = Runs::find(d, &of, breaks.as_ref());
        let mut entries: Vec<Entry> = Vec::new();
        let mut long = Vec::new();
        if runs.is_none() {
            entries.reserve_exact(n);
            huge_pages_hint(&mut entries);
            let groups = of.iter().enumerate().flat_map(|(i, &(end, g))| {
                let start = if i == 0 { 0 } else { of[i - 1].0 };
                std::iter::repeat_n(g, end - start)
            });
            for (i, (d, group)) in d.iter().zip(groups).enumerate() {
                let len = u32::try_from(d.len).ok().filter(|&l| l != LONG).unwrap_or_else(|| {
                    long.push((i as u32, d.len));
                    LONG
                });
                entries.push(Entry { addr: d.addr, len, group });
            }
        }
        Ok(PreppedDList(Arc::new(Prepped {
            owner: self.inner.incarnation,
            side,
            mem,
            n,
            entries,
            runs,
            long,
            devs,
            resolved,
        })))
    }

    /// Build a request from two prepped lists and index lists (`makeXferReq`). Pure planning: no I/O.
    pub fn make_xfer_req(
        &self,
        op: XferOp,
        local: &PreppedDList,
        local_idx: &[i64],
        remote: &PreppedDList,
        remote_idx: &[i64],
        opts: &XferOpts,
    ) -> Result<XferReq> {
        self.plan(op, local, local_idx, remote, remote_idx, opts, None)
    }

    /// `make_xfer_req` with indices of any `PlanIndex` type (NIXL's `int`, numpy's int64), read in place.
    pub fn make_xfer_req_with<L: PlanIndex, R: PlanIndex>(
        &self,
        op: XferOp,
        local: &PreppedDList,
        local_idx: &[L],
        remote: &PreppedDList,
        remote_idx: &[R],
        opts: &XferOpts,
    ) -> Result<XferReq> {
        self.plan(op, local, local_idx, remote, remote_idx, opts, None)
    }

    /// `makeXferReq` with the telemetry's descriptor count given (`createXferReq` reports its descriptors
    /// before merging, as NIXL does) or, when `None`, the merged pieces.
    #[allow(clippy::too_many_arguments)]
    fn plan<L: PlanIndex, R: PlanIndex>(
        &self,
        op: XferOp,
        local: &PreppedDList,
        local_idx: &[L],
        remote: &PreppedDList,
        remote_idx: &[R],
        opts: &XferOpts,
        reported: Option<u64>,
    ) -> Result<XferReq> {
        let (l, r) = (&*local.0, &*remote.0);
        if l.owner != self.inner.incarnation || r.owner != self.inner.incarnation {
            return Err(Error::invalid_param("prepped list belongs to another agent"));
        }
        if !matches!(l.side, Side::Initiator) || matches!(r.side, Side::Initiator) {
            return Err(Error::invalid_param(
                "the local list must be prepped with \"\" and the remote one with an agent name",
            ));
        }
        if let Side::Remote(ra) = &r.side {
            if ra.invalidated.load(Ordering::Acquire) {
                return Err(Error::not_found(format!(
                    "remote list was prepped against agent '{}' incarnation {:032x}, which has been invalidated",
                    ra.name, ra.incarnation
                )));
            }
        }
        if local_idx.len() != remote_idx.len() {
            return Err(Error::invalid_param(format!(
                "{} local indices but {} remote",
                local_idx.len(),
                remote_idx.len()
            )));
        }
        if local_idx.is_empty() {
            return Err(Error::invalid_param("no descriptors to transfer"));
        }
        let (lres, rres) = l
            .resolved
            .iter()
            .filter(|x| opts.backends.is_empty() || opts.backends.contains(&x.slot.id))
            .find_map(|x| r.resolved.iter().find(|y| y.slot.id == x.slot.id).map(|y| (x, y)))
            .ok_or_else(|| Error::invalid_param("no backend is common to both prepped lists"))?;
        let slot = lres.slot.clone();
        if opts.notif.is_some() && !slot.caps.notif {
            return Err(Error::backend(format!("backend {} cannot send notifications", slot.name)));
        }

        let (segs, total) = plan_segs(l, local_idx, r, remote_idx, !opts.skip_desc_merge)?;

        let (target, remote_ra) = match &r.side {
            Side::Remote(ra) => {
                let peer = ra
                    .peer(slot.id)
                    .cloned()
                    .ok_or_else(|| Error::not_found("peer has no connection for this backend"))?;
                (Target::Remote(peer), Some(ra.clone()))
            }
            _ => (Target::Local, None),
        };
        let desc_count = reported.unwrap_or(segs.len() as u64);
        // The overlap check's footprint, only while it is on (O(n log n), once per request).
        let check = self.inner.overlap.as_ref().map(|ck| {
            let owner = remote_ra.as_ref().map_or(self.inner.incarnation, |ra| ra.incarnation);
            (ck.clone(), ck.id(), ck.footprint(op, (l.mem, r.mem), owner, &segs))
        });
        let plan = XferPlan {
            op,
            local_mem: l.mem,
            remote_mem: r.mem,
            segs,
            local_keys: lres.keys.clone(),
            remote_keys: rres.keys.clone(),
            target: target.clone(),
            total_bytes: total,
        };
        let bx = Arc::from(slot.be.prep_xfer(plan)?);
        Ok(XferReq(Arc::new(Xfer {
            owner: self.inner.incarnation,
            slot,
            remote: remote_ra,
            target,
            bx,
            check,
            op,
            desc_count,
            total_bytes: total,
            read: op == XferOp::Read,
            st: Mutex::new(XferState {
                notif: opts.notif.clone(),
                last: None,
                released: false,
                post_start: None,
                start_time_us: 0,
                post_duration_us: 0,
            }),
        })))
    }

    /// Prep both sides and make the request in one step (`createXferReq`). Contiguous descriptors are still
    /// moved as one piece, but the telemetry counts the descriptors given, as NIXL (which does not merge here).
    pub fn create_xfer_req(
        &self,
        op: XferOp,
        local: &XferDList,
        remote: &XferDList,
        remote_agent: &str,
        opts: &XferOpts,
    ) -> Result<XferReq> {
        self.create_xfer_req_descs(
            op,
            (local.mem_type(), local.descs()),
            (remote.mem_type(), remote.descs()),
            remote_agent,
            opts,
        )
    }

    /// `create_xfer_req` of descriptors read in place, each side as (memory type, descriptors).
    pub fn create_xfer_req_descs(
        &self,
        op: XferOp,
        (local_mem, local): (MemType, &[Desc]),
        (remote_mem, remote): (MemType, &[Desc]),
        remote_agent: &str,
        opts: &XferOpts,
    ) -> Result<XferReq> {
        if local.len() != remote.len() {
            return Err(Error::invalid_param(format!("{} local descriptors but {} remote", local.len(), remote.len())));
        }
        if let Some((a, b)) = local.iter().zip(remote.iter()).find(|(a, b)| a.len != b.len) {
            return Err(Error::invalid_param(format!("length mismatch: local {a:?}, remote {b:?}")));
        }
        if remote_agent.is_empty() {
            // As in NIXL: "" names no loaded agent (it is not the initiator side here).
            return Err(Error::not_found("remote agent name is empty"));
        }
        let l = self.prep_xfer_descs("", local_mem, local, &opts.backends)?;
        let r = self.prep_xfer_descs(remote_agent, remote_mem, remote, &opts.backends)?;
        let idx: Vec<u32> = (0..local.len() as u32).collect();
        self.plan(op, &l, &idx, &r, &idx, opts, Some(local.len() as u64))
    }

    /// The generation gate: is the peer this request was built against still the loaded, live one?
    fn gate(&self, x: &Xfer) -> Result<()> {
        let Some(ra) = &x.remote else { return Ok(()) };
        if ra.invalidated.load(Ordering::Acquire) {
            self.inner.tele.stale_refusal();
            return Err(Error::not_found(format!(
                "request was built against agent '{}' incarnation {:032x}, which has been invalidated or replaced",
                ra.name, ra.incarnation
            )));
        }
        if let Target::Remote(p) = &x.target {
            if p.disconnected() {
                self.on_disconnect(ra);
                return Err(crate::backend::disconnected(&ra.name, &**p));
            }
        }
        Ok(())
    }

    fn own(&self, x: &Xfer) -> Result<()> {
        if x.owner != self.inner.incarnation {
            return Err(Error::invalid_param("transfer request belongs to another agent"));
        }
        Ok(())
    }

    /// Post a request: `Success` if it completed inline, `InProg` if it runs on.
    pub fn post_xfer_req(&self, req: &XferReq, notif: NotifUpdate) -> Result<Status> {
        let x = &*req.0;
        self.own(x)?;
        let gate = self.gate(x);
        let mut st = x.st.lock();
        if st.released {
            return Err(Error::invalid_param("transfer request was released"));
        }
        if let Err(e) = gate {
            self.inner.tele.error(e.status());
            // As NIXL: a post that failed on the peer's disconnect leaves that failure as the request's status
            // (NIXL's engine records it; the stale incarnation's NOT_FOUND is refused before and records nothing).
            if e.status() == Status::RemoteDisconnect {
                if st.last == Some(Status::InProg) {
                    x.bx.abort();
                }
                st.last = Some(Status::RemoteDisconnect);
            }
            return Err(e);
        }
        if st.last == Some(Status::InProg) {
            let now = x.bx.status();
            if matches!(now, Ok(Status::InProg)) {
                return Err(Error::new(Status::RepostActive, "the previous post of this request is still in progress"));
            }
        }
        match notif {
            NotifUpdate::Keep => {}
            NotifUpdate::Clear => st.notif = None,
            NotifUpdate::Set(m) => st.notif = Some(m),
        }
        if st.notif.is_some() && !x.slot.caps.notif {
            return Err(Error::backend(format!("backend {} cannot send notifications", x.slot.name)));
        }
        // The overlap check: one branch while it is off.
        if let Some((ck, id, foot)) = &x.check {
            let peer = x.remote.as_ref().map_or("", |ra| ra.name.as_str());
            let r = Req { id: *id, op: x.op, peer, foot, bx: &x.bx };
            if let Err(e) = ck.admit(&r, st.notif.as_deref()) {
                drop(st);
                self.inner.tele.error(e.status());
                return Err(e);
            }
        }
        let t0 = Instant::now();
        st.post_start = Some(t0);
        st.start_time_us = crate::util::monotonic_us();
        let res = x.bx.post(st.notif.as_deref());
        if !matches!(res, Ok(Status::InProg)) {
            x.leave_check();
        }
        st.post_duration_us = ceil_us(t0.elapsed());
        st.last = Some(match &res {
            Ok(s) => *s,
            Err(e) => e.status(),
        });
        drop(st);
        self.telemetry_after(x, &res, false);
        if let (Err(e), Some(ra)) = (&res, &x.remote) {
            if e.status() == Status::RemoteDisconnect {
                self.on_disconnect(ra);
            }
        }
        res
    }

    /// NIXL's telemetry events for the outcome of a post (`polled`: seen by a status check).
    fn telemetry_after(&self, x: &Xfer, res: &Result<Status>, polled: bool) {
        let t = &self.inner.tele;
        match res {
            Ok(Status::Success) => {
                let st = x.st.lock();
                let post_us = st.post_duration_us;
                let xfer_us = match (st.post_start, x.bx.completed_at()) {
                    (Some(s), Some(c)) if c >= s => ceil_us(c - s),
                    _ => post_us,
                }
                .max(post_us);
                drop(st);
                t.xfer_done(x.read, x.total_bytes, post_us, xfer_us);
            }
            Ok(_) => {}
            Err(e) if polled || e.status() != Status::InProg => t.error(e.status()),
            Err(_) => {}
        }
    }

    /// `Success`, `InProg`, or the error that ended the last post. Never-posted requests are NOT_POSTED.
    pub fn xfer_status(&self, req: &XferReq) -> Result<Status> {
        let x = &*req.0;
        self.own(x)?;
        let mut st = x.st.lock();
        match st.last {
            None => Err(Error::new(Status::NotPosted, "transfer request was never posted")),
            Some(Status::InProg) => {
                if let Err(e) = self.gate(x) {
                    // The peer is gone or replaced: stop touching its memory and report why.
                    x.bx.abort();
                    x.leave_check();
                    st.last = Some(e.status());
                    self.inner.tele.error(e.status());
                    return Err(e);
                }
                let res = x.bx.status();
                st.last = Some(match &res {
                    Ok(s) => *s,
                    Err(e) => e.status(),
                });
                if !matches!(res, Ok(Status::InProg)) {
                    x.leave_check();
                }
                drop(st);
                if !matches!(res, Ok(Status::InProg)) {
                    self.telemetry_after(x, &res, true);
                }
                if let (Err(e), Some(ra)) = (&res, &x.remote) {
                    if e.status() == Status::RemoteDisconnect {
                        self.on_disconnect(ra);
                    }
                }
                res
            }
            Some(Status::Success) => Ok(Status::Success),
            Some(s) => Err(Error::new(s, "the last post of this transfer request failed")),
        }
    }

    /// Release a request. An active transfer is aborted first; if it cannot be, REPOST_ACTIVE and the handle
    /// stays usable.
    pub fn release_xfer_req(&self, req: &XferReq) -> Result<()> {
        let x = &*req.0;
        self.own(x)?;
        let mut st = x.st.lock();
        if st.released {
            return Ok(());
        }
        if st.last == Some(Status::InProg) && matches!(x.bx.status(), Ok(Status::InProg)) && !x.bx.abort() {
            return Err(Error::new(Status::RepostActive, "transfer is in progress and cannot be aborted"));
        }
        st.released = true;
        x.leave_check();
        Ok(())
    }

    pub fn estimate_xfer_cost(&self, req: &XferReq) -> Result<(i64, i64)> {
        let x = &*req.0;
        self.own(x)?;
        self.gate(x)?;
        x.slot.be.estimate_xfer_cost(x.total_bytes)
    }

    /// Telemetry of the last post; `Ok(None)` while it is still in progress (NIXL returns IN_PROG).
    pub fn xfer_telemetry(&self, req: &XferReq) -> Result<Option<XferTelemetry>> {
        let x = &*req.0;
        self.own(x)?;
        if !self.inner.telemetry {
            return Err(Error::new(
                Status::NoTelemetry,
                "telemetry is off (NIXL_TELEMETRY_ENABLE or capture_telemetry)",
            ));
        }
        let st = x.st.lock();
        match st.last {
            None => Err(Error::new(Status::NotPosted, "transfer request was never posted")),
            Some(Status::InProg) => Ok(None),
            Some(Status::Success) => {
                let xfer_duration_us = match (st.post_start, x.bx.completed_at()) {
                    (Some(s), Some(c)) if c >= s => ceil_us(c - s),
                    _ => st.post_duration_us,
                }
                .max(st.post_duration_us);
                Ok(Some(XferTelemetry {
                    start_time_us: st.start_time_us,
                    post_duration_us: st.post_duration_us,
                    xfer_duration_us,
                    total_bytes: x.total_bytes,
                    desc_count: x.desc_count,
                }))
            }
            Some(s) => Err(Error::new(s, "the last post of this transfer request failed")),
        }
    }
}

/// Most descriptors in one prepped list (entry indices are 32-bit; NIXL's indices are `int`).
const MAX_ENTRIES: usize = i32::MAX as usize;

/// An index type `make_xfer_req` reads in place: NIXL's `int`, Python's int64 arrays, internal `u32`.
pub trait PlanIndex: Copy + Send + Sync + 'static {
    /// The value, with anything negative or too large for a list mapped to `u64::MAX` (out of range).
    fn to_u64(self) -> u64;
    /// For error messages.
    fn to_i128(self) -> i128;
}

/// The signed index types: a negative index is out of range.
macro_rules! signed_plan_index {
    ($($t:ty),+) => {$(
        impl PlanIndex for $t {
            #[inline(always)]
            fn to_u64(self) -> u64 {
                u64::try_from(self).unwrap_or(u64::MAX)
            }
            fn to_i128(self) -> i128 {
                self as i128
            }
        }
    )+};
}
signed_plan_index!(i32, i64);

impl PlanIndex for u32 {
    #[inline(always)]
    fn to_u64(self) -> u64 {
        self as u64
    }
    fn to_i128(self) -> i128 {
        self as i128
    }
}

/// Why `Agent::prep_searched` failed: the error, and whether registrations were searched for the
/// descriptors (rather than the agent, the backends or the list itself being refused first).
#[derive(Debug)]
pub struct PrepFail {
    pub err: Error,
    pub searched: bool,
}

/// Groups of descriptors that resolve to the same region in every backend tried so far.
struct Groups {
    /// The group of every descriptor, as spans of consecutive descriptors: (end, exclusive; group), ends
    /// increasing, the last one the list's length. (Block lists resolve in long spans: a million-entry list
    /// inside 64 registrations is 64 spans, not 4 MB written and read back.)
    of: Vec<(usize, u32)>,
    /// Per backend that covers every descriptor, per group, the region's key.
    keys: Vec<Vec<Option<RegionKey>>>,
    /// Per group, the device id.
    devs: Vec<u64>,
    /// Filled by the first `refine`, which reads every descriptor in order.
    breaks: Option<Breaks>,
}

impl Groups {
    fn new(n: usize) -> Groups {
        Groups { of: vec![(n, 0)], keys: Vec::new(), devs: Vec::new(), breaks: None }
    }

    /// Resolve every descriptor in `sec` and split the groups by the region found. `false` (and nothing
    /// changed) unless every descriptor is covered. A descriptor covered by the region of the one before it
    /// takes that region without a search.
    fn refine<T>(
        &mut self,
        d: &[Desc],
        mem: MemType,
        sec: &Section<T>,
        key: impl Fn(usize) -> Option<RegionKey>,
    ) -> bool {
        let mut of: Vec<(usize, u32)> = Vec::new();
        // Per new group: the group it splits and the region it has in `sec`.
        let mut parent: Vec<u32> = Vec::new();
        let mut region_of: Vec<usize> = Vec::new();
        let mut devs = Vec::new();
        let mut index: HashMap<(u32, usize), u32> = HashMap::new();
        // The first call (one span over the whole list) also notes where the list breaks its progression.
        let mut breaks = (self.keys.is_empty() && self.breaks.is_none()).then(|| Breaks::new(d.len()));
        let (mut j, mut span) = (0, 0);
        while j < d.len() {
            while self.of[span].0 <= j {
                span += 1;
            }
            let (old_end, old) = self.of[span];
            let Some(region) = sec.find_cover(&d[j]) else { return false };
            let g = *index.entry((old, region)).or_insert_with(|| {
                parent.push(old);
                region_of.push(region);
                devs.push(d[j].dev);
                (parent.len() - 1) as u32
            });
            // The descriptors after it that the same region covers (and, after the first backend, that were in
            // the same group) join it without a search: a list of blocks inside a few registrations is a few
            // tight scans.
            let (r, _) = sec.get(region);
            let limit = old_end.min(d.len());
            let k = match breaks.as_mut().filter(|b| !b.over) {
                Some(b) => {
                    b.see(j, &d[j]);
                    let k = b.scan(d, j + 1, limit, r, mem);
                    b.check();
                    k
                }
                None => j + 1 + d[j + 1..limit].iter().take_while(|x| r.covers(x, mem)).count(),
            };
            match of.last_mut() {
                Some((end, last)) if *last == g => *end = k,
                _ => of.push((k, g)),
            }
            j = k;
        }
        let mut keys: Vec<Vec<Option<RegionKey>>> =
            self.keys.iter().map(|old| parent.iter().map(|&p| old[p as usize].clone()).collect()).collect();
        keys.push(region_of.iter().map(|&r| key(r)).collect());
        let breaks = breaks.or(self.breaks.take());
        *self = Groups { of, keys, devs, breaks };
        true
    }
}

/// Ask for huge pages for a large, not yet written buffer: a random index into a list of a million entries
/// then misses the TLB far less often. Only a hint.
fn huge_pages_hint<T>(v: &mut Vec<T>) {
    const HUGE: usize = 2 << 20;
    let bytes = v.capacity() * std::mem::size_of::<T>();
    if bytes < 2 * HUGE {
        return;
    }
    let start = v.as_mut_ptr() as usize;
    let (from, to) = ((start + HUGE - 1) & !(HUGE - 1), (start + bytes) & !(HUGE - 1));
    if to > from {
        // SAFETY: the range lies inside the vector's own allocation; MADV_HUGEPAGE changes no contents.
        unsafe {
            libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE);
        }
    }
}

/// Entries fetched ahead of the one being planned, so that the cache misses of random indices overlap.
const AHEAD: usize = 16;

/// How a planner reads one side's descriptors.
trait Lookup: Copy {
    fn get(self, i: usize) -> Entry;
    fn prefetch(self, i: usize);
}

#[derive(Clone, Copy)]
struct Dense<'a>(&'a [Entry]);

impl Lookup for Dense<'_> {
    #[inline(always)]
    fn get(self, i: usize) -> Entry {
        self.0[i]
    }
    #[inline(always)]
    fn prefetch(self, i: usize) {
        prefetch_read(&self.0[i.min(self.0.len() - 1)]);
    }
}

/// Runs, their common size and its reciprocal: `i / per` for 32-bit `i` and `per` is one multiplication
/// (Lemire, Kaser, Kurz: "Faster remainder by direct computation", 2019), not a division's latency.
#[derive(Clone, Copy)]
struct Strided<'a> {
    runs: &'a [Run],
    per: u64,
    magic: u64,
}

impl<'a> Strided<'a> {
    /// `r.per` is at least 2 (`Runs::find` makes runs of at least 16).
    fn new(r: &'a Runs) -> Self {
        let per = r.per as u64;
        Strided { runs: &r.runs, per, magic: (u64::MAX / per).wrapping_add(1) }
    }
}

impl Lookup for Strided<'_> {
    #[inline(always)]
    fn get(self, i: usize) -> Entry {
        // Exact for i, per < 2^32: entries are at most i32::MAX (`MAX_ENTRIES`) and i < n here.
        let q = ((self.magic as u128 * i as u128) >> 64) as u64;
        let r = self.runs[q as usize];
        let k = i as u64 - q * self.per;
        Entry { addr: r.addr.wrapping_add(r.stride.wrapping_mul(k)), len: r.len, group: r.group }
    }
    #[inline(always)]
    fn prefetch(self, _i: usize) {}
}

/// The pieces of a request, merging as it goes: `(pieces, total bytes)`.
fn plan_segs<L: PlanIndex, R: PlanIndex>(
    l: &Prepped,
    li: &[L],
    r: &Prepped,
    ri: &[R],
    merge: bool,
) -> Result<(Vec<Seg>, u64)> {
    match (&l.runs, &r.runs) {
        (None, None) => plan_with(l, Dense(&l.entries), li, r, Dense(&r.entries), ri, merge),
        (Some(a), None) => plan_with(l, Strided::new(a), li, r, Dense(&r.entries), ri, merge),
        (None, Some(b)) => plan_with(l, Dense(&l.entries), li, r, Strided::new(b), ri, merge),
        (Some(a), Some(b)) => plan_with(l, Strided::new(a), li, r, Strided::new(b), ri, merge),
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn plan_with<L: PlanIndex, R: PlanIndex, A: Lookup, B: Lookup>(
    l: &Prepped,
    le: A,
    li: &[L],
    r: &Prepped,
    re: B,
    ri: &[R],
    merge: bool,
) -> Result<(Vec<Seg>, u64)> {
    let (ln, rn) = (l.n, r.n);
    let n = li.len();
    let mut segs: Vec<Seg> = Vec::with_capacity(n);
    let mut total = 0u64;
    let mut cur = Seg { local: 0, remote: 0, len: 0, ldev: 0, rdev: 0, lreg: 0, rreg: 0 };
    // Index values can change under us (a caller's buffer read in place); a prefetch is only a hint, so
    // one of an out-of-range index is clamped and nothing else depends on it.
    let fetch = |k: usize| {
        le.prefetch(li[k].to_u64() as usize);
        re.prefetch(ri[k].to_u64() as usize);
    };
    for k in 0..AHEAD.min(n) {
        fetch(k);
    }
    for k in 0..n {
        if k + AHEAD < n {
            fetch(k + AHEAD);
        }
        let (a, b) = (li[k], ri[k]);
        let ia = a.to_u64();
        if ia >= ln as u64 {
            return Err(out_of_range("local", a.to_i128(), ln));
        }
        let ib = b.to_u64();
        if ib >= rn as u64 {
            return Err(out_of_range("remote", b.to_i128(), rn));
        }
        let (x, y) = (le.get(ia as usize), re.get(ib as usize));
        let len = if x.len == y.len && x.len != LONG {
            x.len as u64
        } else {
            let (lx, ly) = (l.len_of(ia as usize, &x), r.len_of(ib as usize, &y));
            if lx != ly {
                return Err(Error::invalid_param(format!("length mismatch: local {lx} bytes, remote {ly} bytes")));
            }
            lx
        };
        total = total.saturating_add(len);
        // The piece being built stays in registers; it is written out once, when the next one cannot
        // continue it (merging costs no second pass and no re-read of the output).
        if merge
            && k != 0
            && cur.lreg == x.group
            && cur.rreg == y.group
            && cur.local.checked_add(cur.len) == Some(x.addr)
            && cur.remote.checked_add(cur.len) == Some(y.addr)
        {
            cur.len += len;
            continue;
        }
        if k != 0 {
            segs.push(Seg { ldev: l.devs[cur.lreg as usize], rdev: r.devs[cur.rreg as usize], ..cur });
        }
        cur = Seg { local: x.addr, remote: y.addr, len, ldev: 0, rdev: 0, lreg: x.group, rreg: y.group };
    }
    segs.push(Seg { ldev: l.devs[cur.lreg as usize], rdev: r.devs[cur.rreg as usize], ..cur });
    Ok((segs, total))
}

/// A hint to bring `x` into the cache; no effect on the program's meaning.
#[inline(always)]
fn prefetch_read<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching is only a hint and `x` is a valid reference.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((x as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

fn out_of_range(side: &str, i: i128, n: usize) -> Error {
    Error::invalid_param(format!("{side} index {i} out of range for {n} descriptors"))
}

fn ceil_us(d: std::time::Duration) -> u64 {
    d.as_nanos().div_ceil(1000) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Runs::find` from the breaks seen in one pass gives what the two scans give, on lists that are runs,
    /// almost runs (one descriptor off anywhere), and not runs at all, with several group spans.
    #[test]
    fn runs_from_breaks_match_the_scans() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let key = |r: &Option<Runs>| {
            r.as_ref().map(|r| (r.per, r.runs.iter().map(|u| (u.addr, u.stride, u.len, u.group)).collect::<Vec<_>>()))
        };
        let (mut some, mut none) = (0, 0);
        for case in 0..400 {
            let regions = 1 + rnd(8);
            let per = 16 + rnd(48);
            let n = (regions * per) as usize - rnd(per) as usize;
            let len = if case % 7 == 0 { 1 + rnd(3) } else { 64 };
            let mut d: Vec<Desc> = (0..n as u64)
                .map(|i| {
                    let region = regions - 1 - i / per;
                    Desc::new(
                        0x10_0000 + region * per * 4096 + (i % per) * if case % 5 == 0 { 64 } else { 128 },
                        len,
                        0,
                    )
                })
                .collect();
            match case % 4 {
                1 => {
                    let i = rnd(n as u64) as usize;
                    d[i].addr += 8;
                }
                2 => {
                    let i = rnd(n as u64) as usize;
                    d[i].len += 1;
                }
                3 if case % 8 == 3 => d.iter_mut().for_each(|e| e.addr = rnd(1 << 30)),
                _ => {}
            }
            let mut spans = Vec::new();
            let mut end = 0;
            while end < n {
                end = (end + 1 + rnd(3 * per) as usize).min(n);
                spans.push((end, spans.len() as u32));
            }
            if case % 3 == 0 {
                spans = vec![(n, 0)];
            }
            let mut b = Breaks::new(n);
            for (i, e) in d.iter().enumerate() {
                b.see(i, e);
            }
            b.check();
            let scanned = Runs::find(&d, &spans, None);
            let from_breaks = Runs::find(&d, &spans, Some(&b));
            assert_eq!(key(&scanned), key(&from_breaks), "case {case}: n {n}, per {per}, {} spans", spans.len());
            if scanned.is_some() {
                some += 1;
            } else {
                none += 1;
            }
        }
        assert!(some > 50 && none > 50, "{some} lists of runs, {none} not: the cases must cover both");
    }
    use crate::backend::Params;
    use crate::mem::{Desc, RegDList, RegDesc};
    use crate::AgentConfig;

    const B: u64 = 512;

    fn setup(name: &str, src: &[u8], dst: &[u8]) -> Agent {
        let a = Agent::new(name, AgentConfig { capture_telemetry: true, ..AgentConfig::default() }).unwrap();
        a.create_backend("UCX", &Params::new()).unwrap();
        for b in [src, dst] {
            let d = RegDesc { desc: Desc::new(b.as_ptr() as u64, b.len() as u64, 0), meta: vec![] };
            a.register_mem(&RegDList::with_descs(MemType::Dram, vec![d]), &[]).unwrap();
        }
        a
    }

    fn blocks(b: &[u8], idx: &[u64]) -> XferDList {
        XferDList::with_descs(MemType::Dram, idx.iter().map(|i| Desc::new(b.as_ptr() as u64 + i * B, B, 0)).collect())
    }

    fn posted_count(a: &Agent, x: &XferReq) -> u64 {
        let mut s = a.post_xfer_req(x, NotifUpdate::Keep).unwrap();
        while s == Status::InProg {
            s = a.xfer_status(x).unwrap();
        }
        a.xfer_telemetry(x).unwrap().unwrap().desc_count
    }

    /// NIXL 1.5.1 (run): makeXferReq reports merged pieces (4 adjacent prepped blocks -> 1, none with
    /// skip_desc_merge), createXferReq the descriptors it was given (4 adjacent -> 4).
    #[test]
    fn desc_count_per_call_path_as_nixl() {
        let (src, dst) = (vec![7u8; 16 * B as usize], vec![0u8; 16 * B as usize]);
        let a = setup("dc", &src, &dst);
        let all: Vec<u64> = (0..16).collect();
        let (lp, rp) = (
            a.prep_xfer_dlist("", &blocks(&src, &all), &[]).unwrap(),
            a.prep_xfer_dlist("dc", &blocks(&dst, &all), &[]).unwrap(),
        );
        let o = XferOpts::default();
        let skip = XferOpts { skip_desc_merge: true, ..XferOpts::default() };
        for (li, ri, merged) in
            [([0i32, 1, 2, 3], [4i32, 5, 6, 7], 1u64), ([0, 1, 2, 5], [0, 1, 2, 5], 2), ([0, 1, 2, 3], [3, 2, 1, 0], 4)]
        {
            let x = a.make_xfer_req_with(XferOp::Write, &lp, &li, &rp, &ri, &o).unwrap();
            assert_eq!(posted_count(&a, &x), merged, "make {li:?} -> {ri:?}");
            assert_eq!(x.desc_count(), merged);
            let x = a.make_xfer_req_with(XferOp::Write, &lp, &li, &rp, &ri, &skip).unwrap();
            assert_eq!(posted_count(&a, &x), 4, "make, skip_desc_merge");
            let lu: Vec<u64> = li.iter().map(|&i| i as u64).collect();
            let ru: Vec<u64> = ri.iter().map(|&i| i as u64).collect();
            let x = a.create_xfer_req(XferOp::Write, &blocks(&src, &lu), &blocks(&dst, &ru), "dc", &o).unwrap();
            assert_eq!(posted_count(&a, &x), 4, "create {li:?} -> {ri:?}");
        }
    }

    /// Merging, out-of-range indices of every kind, index types, lengths above 32 bits.
    #[test]
    fn plan_covers_edge_cases() {
        let (src, dst) = (vec![1u8; 8 * B as usize], vec![0u8; 8 * B as usize]);
        let a = setup("pe", &src, &dst);
        let lp = a.prep_xfer_dlist("", &blocks(&src, &[0, 1, 2, 3, 4, 5, 6, 7]), &[]).unwrap();
        let rp = a.prep_xfer_dlist("pe", &blocks(&dst, &[0, 1, 2, 3, 4, 5, 6, 7]), &[]).unwrap();
        let o = XferOpts::default();
        let x = a.make_xfer_req_with(
            XferOp::Write,
            &lp,
            &[0u32, 1, 2, 3, 4, 5, 6, 7],
            &rp,
            &[0i64, 1, 2, 3, 4, 5, 6, 7],
            &o,
        );
        let x = x.unwrap();
        assert_eq!((x.desc_count(), x.total_bytes()), (1, 8 * B));
        posted_count(&a, &x);
        assert_eq!(dst, src);
        for bad in [-1i64, 8, i64::MAX, i64::MIN] {
            let e = a.make_xfer_req(XferOp::Write, &lp, &[0, bad], &rp, &[0, 0], &o).unwrap_err();
            assert_eq!(e.status(), Status::InvalidParam);
            assert!(e.to_string().contains(&format!("local index {bad} out of range")), "{e}");
            let e = a.make_xfer_req(XferOp::Write, &lp, &[0, 0], &rp, &[0, bad], &o).unwrap_err();
            assert!(e.to_string().contains(&format!("remote index {bad} out of range")), "{e}");
        }
        // Lengths above 32 bits live beside the entries; a mismatch is still caught.
        let f = Agent::new("long", AgentConfig::default()).unwrap();
        f.create_backend("POSIX", &Params::new()).unwrap();
        let file = std::fs::File::open("/dev/zero").unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file) as u64;
        let reg = RegDesc { desc: Desc::new(0, 0, fd), meta: vec![] };
        f.register_mem(&RegDList::with_descs(MemType::File, vec![reg]), &[]).unwrap();
        let big = XferDList::with_descs(
            MemType::File,
            vec![Desc::new(0, 5 << 32, fd), Desc::new(0, u32::MAX as u64, fd), Desc::new(0, 7, fd)],
        );
        let p = f.prep_xfer_dlist("", &big, &[]).unwrap();
        let q = f.prep_xfer_dlist("long", &big, &[]).unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p.0.len_of(0, &p.0.entries[0]), 5 << 32);
        assert_eq!(p.0.len_of(1, &p.0.entries[1]), u32::MAX as u64);
        assert_eq!(p.0.len_of(2, &p.0.entries[2]), 7);
        let (segs, total) = plan_segs(&p.0, &[0i32, 1, 2], &q.0, &[0i32, 1, 2], false).unwrap();
        assert_eq!((segs.len(), total), (3, (5 << 32) + u32::MAX as u64 + 7));
        let e = plan_segs(&p.0, &[0i32], &q.0, &[1i32], true).unwrap_err();
        assert!(e.to_string().contains("length mismatch"), "{e}");
    }

    /// Groups follow registrations exactly, wherever their boundaries fall (inside a run of a per-block list,
    /// or between runs), with a second backend refining them, and a per-block list becomes runs only when each
    /// run lies inside one registration.
    #[test]
    fn groups_follow_registrations_with_runs_and_two_backends() {
        const LAYERS: u64 = 4;
        const BLOCKS: u64 = 64;
        let size = (LAYERS * BLOCKS * B) as usize;
        let src = vec![1u8; size];
        let base = src.as_ptr() as u64;
        let per_block: Vec<u64> =
            (0..LAYERS * BLOCKS).map(|i| base + (LAYERS - 1 - i / BLOCKS) * BLOCKS * B + (i % BLOCKS) * B).collect();
        let list = XferDList::with_descs(MemType::Dram, per_block.iter().map(|&x| Desc::new(x, B, 0)).collect());
        // (registration boundaries in blocks, whether runs are expected)
        let cases: [(&[u64], bool); 3] = [(&[64, 128, 192], true), (&[100, 130], false), (&[], true)];
        for (cuts, runs_expected) in cases {
            let a = Agent::new("g", AgentConfig::default()).unwrap();
            a.create_backend("UCX", &Params::new()).unwrap();
            a.create_backend("POSIX", &Params::new()).unwrap();
            let mut edges = vec![0u64];
            edges.extend_from_slice(cuts);
            edges.push(LAYERS * BLOCKS);
            let regs: Vec<RegDesc> = edges
                .windows(2)
                .map(|w| RegDesc { desc: Desc::new(base + w[0] * B, (w[1] - w[0]) * B, 0), meta: vec![] })
                .collect();
            a.register_mem(&RegDList::with_descs(MemType::Dram, regs), &[]).unwrap();
            let p = a.prep_xfer_dlist("", &list, &[]).unwrap();
            assert_eq!(p.0.runs.is_some(), runs_expected, "cuts {cuts:?}");
            let idx: Vec<i64> = (0..(LAYERS * BLOCKS) as i64).collect();
            let (segs, _) = plan_segs(&p.0, &idx, &p.0, &idx, true).unwrap();
            let region = |addr: u64| edges.iter().rposition(|&e| base + e * B <= addr).unwrap();
            let mut group_region = HashMap::new();
            for s in &segs {
                let r = region(s.local);
                assert_eq!(*group_region.entry(s.lreg).or_insert(r), r, "group {} spans two registrations", s.lreg);
            }
            assert_eq!(group_region.len(), edges.len() - 1, "one group per registration (cuts {cuts:?})");
        }
    }

    /// Progressions that cross registration boundaries, run backwards, or overhang a registration: every
    /// descriptor gets the registration that holds it, and one that lies across two is refused.
    #[test]
    fn progressions_are_cut_at_registration_edges() {
        let buf = vec![5u8; 64 * B as usize];
        let base = buf.as_ptr() as u64;
        let a = Agent::new("pc", AgentConfig::default()).unwrap();
        a.create_backend("UCX", &Params::new()).unwrap();
        // Eight adjacent registrations of 8 blocks each.
        let regs: Vec<RegDesc> =
            (0..8).map(|r| RegDesc { desc: Desc::new(base + r * 8 * B, 8 * B, 0), meta: vec![] }).collect();
        a.register_mem(&RegDList::with_descs(MemType::Dram, regs), &[]).unwrap();
        let region = |addr: u64| (addr - base) / (8 * B);
        let check = |addrs: Vec<u64>, len: u64| {
            let list = XferDList::with_descs(MemType::Dram, addrs.iter().map(|&x| Desc::new(x, len, 0)).collect());
            let p = a.prep_xfer_dlist("", &list, &[]).unwrap();
            let idx: Vec<i64> = (0..addrs.len() as i64).collect();
            let (segs, _) = plan_segs(&p.0, &idx, &p.0, &idx, false).unwrap();
            let mut group_region = HashMap::new();
            for (s, &x) in segs.iter().zip(&addrs) {
                assert_eq!(s.local, x);
                let r = region(x);
                assert_eq!(*group_region.entry(s.lreg).or_insert(r), r, "group {} spans two registrations", s.lreg);
            }
        };
        // Forwards over all eight, in blocks and in half blocks; backwards; with a step of three blocks.
        check((0..64).map(|i| base + i * B).collect(), B);
        check((0..128).map(|i| base + i * B / 2).collect(), B / 2);
        check((0..64).rev().map(|i| base + i * B).collect(), B);
        check((0..21).map(|i| base + i * 3 * B).collect(), B);
        // A block-sized step from half a block in: the 8th descriptor lies across the first edge.
        let across =
            XferDList::with_descs(MemType::Dram, (0..16).map(|i| Desc::new(base + B / 2 + i * B, B, 0)).collect());
        let e = a.prep_xfer_dlist("", &across, &[]).unwrap_err();
        assert_eq!(e.status(), Status::NotFound, "{e}");
        // The same backwards, and one that runs past the end of the buffer.
        let back = XferDList::with_descs(
            MemType::Dram,
            (0..16).rev().map(|i| Desc::new(base + B / 2 + i * B, B, 0)).collect(),
        );
        assert_eq!(a.prep_xfer_dlist("", &back, &[]).unwrap_err().status(), Status::NotFound);
        let past = XferDList::with_descs(MemType::Dram, (60..65).map(|i| Desc::new(base + i * B, B, 0)).collect());
        assert_eq!(a.prep_xfer_dlist("", &past, &[]).unwrap_err().status(), Status::NotFound);
    }

    #[test]
    fn strided_division_is_exact() {
        let runs = |per: usize| Runs { runs: vec![Run { addr: 0, stride: 1, len: 1, group: 0 }; 1], per };
        for per in [2usize, 3, 7, 64, 100, 1000, 16384, 65537, 1 << 20, (1 << 31) - 1] {
            let r = runs(per);
            let s = Strided::new(&r);
            for i in [0usize, 1, per - 1, per, per + 1, 2 * per - 1, (1 << 31) - 2, (1 << 31) - 1, 12345678] {
                let q = ((s.magic as u128 * i as u128) >> 64) as usize;
                assert_eq!(q, i / per, "{i} / {per}");
            }
        }
    }

    /// A per-block list (layers in reverse order, so not one progression) is stored as runs and planned to the
    /// same addresses as one entry per descriptor; a list that breaks the pattern stays dense.
    #[test]
    fn strided_runs_plan_like_entries() {
        const LAYERS: u64 = 8;
        const BLOCKS: u64 = 64;
        let (src, dst) = (vec![3u8; (LAYERS * BLOCKS * B) as usize], vec![0u8; (LAYERS * BLOCKS * B) as usize]);
        let a = setup("sr", &src, &dst);
        let per_block = |b: &[u8]| -> Vec<u64> {
            (0..LAYERS * BLOCKS)
                .map(|i| b.as_ptr() as u64 + (LAYERS - 1 - i / BLOCKS) * BLOCKS * B + (i % BLOCKS) * B)
                .collect()
        };
        let list =
            |addrs: &[u64]| XferDList::with_descs(MemType::Dram, addrs.iter().map(|&x| Desc::new(x, B, 0)).collect());
        let (la, ra) = (per_block(&src), per_block(&dst));
        let lp = a.prep_xfer_dlist("", &list(&la), &[]).unwrap();
        let rp = a.prep_xfer_dlist("sr", &list(&ra), &[]).unwrap();
        let runs = lp.0.runs.as_ref().expect("runs");
        assert_eq!(
            (runs.runs.len(), runs.per, lp.0.entries.len(), lp.len()),
            (LAYERS as usize, BLOCKS as usize, 0, 512)
        );
        let mut broken = ra.clone();
        broken[100] += 8;
        let dense = a.prep_xfer_dlist("sr", &list(&broken), &[]).unwrap();
        assert!(dense.0.runs.is_none() && dense.0.entries.len() == 512);
        let idx: Vec<i64> = (0..512).map(|k| (k * 37 + 11) % 512).collect();
        let (segs, total) = plan_segs(&lp.0, &idx, &rp.0, &idx, false).unwrap();
        assert_eq!(total, 512 * B);
        for (s, &i) in segs.iter().zip(&idx) {
            assert_eq!((s.local, s.remote, s.len), (la[i as usize], ra[i as usize], B));
        }
        let (segs, _) = plan_segs(&lp.0, &idx, &dense.0, &idx, false).unwrap();
        for (s, &i) in segs.iter().zip(&idx) {
            assert_eq!((s.local, s.remote), (la[i as usize], broken[i as usize]));
        }
        // Merging across a run works as with entries: blocks 0..64 of one layer are one piece.
        let seq: Vec<i64> = (0..BLOCKS as i64).collect();
        let x = a.make_xfer_req(XferOp::Write, &lp, &seq, &rp, &seq, &XferOpts::default()).unwrap();
        assert_eq!(x.desc_count(), 1);
        posted_count(&a, &x);
        let at = ((LAYERS - 1) * BLOCKS * B) as usize;
        assert_eq!(&dst[at..at + (BLOCKS * B) as usize], &src[at..at + (BLOCKS * B) as usize]);
        let e = a.make_xfer_req(XferOp::Write, &lp, &[512], &rp, &[0], &XferOpts::default()).unwrap_err();
        assert!(e.to_string().contains("local index 512 out of range for 512"), "{e}");
    }
}
