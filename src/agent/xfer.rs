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

use super::{Agent, BackendId, BackendSlot, RemoteAgent};
use crate::backend::{BackendXfer, RegionKey, Seg, Target, XferOp, XferPlan};
use crate::mem::{Desc, MemType, XferDList};
use crate::status::{Error, Result, Status};

#[derive(Clone)]
pub(crate) enum Side {
    /// `""`: the initiator's own buffers.
    Initiator,
    /// The agent's own name: its buffers as a transfer target.
    Loopback,
    Remote(Arc<RemoteAgent>),
}

struct Resolved {
    slot: Arc<BackendSlot>,
    /// Per descriptor, an index into `keys`.
    region: Vec<u32>,
    keys: Vec<Option<RegionKey>>,
}

/// `nixlDlistH`: descriptors resolved against registrations, for one side of future requests.
#[derive(Clone)]
pub struct PreppedDList(Arc<Prepped>);

struct Prepped {
    owner: u128,
    side: Side,
    mem: MemType,
    descs: Vec<Desc>,
    resolved: Vec<Resolved>,
}

impl std::fmt::Debug for PreppedDList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PreppedDList({} {} descriptors, remote {:?})",
            self.0.descs.len(),
            self.0.mem.seg_name(),
            self.remote_name()
        )
    }
}

impl PreppedDList {
    pub fn len(&self) -> usize {
        self.0.descs.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.descs.is_empty()
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
    bx: Box<dyn BackendXfer>,
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
        let mem = descs.mem_type();
        if descs.is_empty() {
            return Err(Error::not_found("cannot prep an empty descriptor list"));
        }
        let side = if agent.is_empty() {
            Side::Initiator
        } else if agent == self.inner.name {
            Side::Loopback
        } else {
            Side::Remote(self.remote(agent)?)
        };
        let mut resolved = Vec::new();
        match &side {
            Side::Initiator | Side::Loopback => {
                let local_only = matches!(side, Side::Loopback);
                let chosen = self.chosen(hints, |b| b.caps.mems.contains(&mem) && (!local_only || b.caps.local))?;
                let regs = self.inner.regs.read();
                for slot in chosen {
                    let Some(sec) = regs.get(&(slot.id, mem)) else { continue };
                    if let Some((region, keys)) = resolve(descs, |d| sec.find_cover(d), |i| sec.get(i).1.key.clone()) {
                        resolved.push(Resolved { slot, region, keys });
                    }
                }
            }
            Side::Remote(ra) => {
                let chosen = self.chosen(hints, |b| ra.peer(b.id).is_some())?;
                let sections = ra.sections.read();
                for slot in chosen {
                    let Some(sec) = sections.get(&(slot.id, mem)) else { continue };
                    if let Some((region, keys)) = resolve(descs, |d| sec.find_cover(d), |i| sec.get(i).1.key.clone()) {
                        resolved.push(Resolved { slot, region, keys });
                    }
                }
            }
        }
        if resolved.is_empty() {
            let whose = if agent.is_empty() { "this agent" } else { agent };
            return Err(Error::not_found(format!(
                "no backend has registrations of {whose} covering all {} {} descriptors",
                descs.len(),
                mem.seg_name()
            )));
        }
        Ok(PreppedDList(Arc::new(Prepped {
            owner: self.inner.incarnation,
            side,
            mem,
            descs: descs.descs().to_vec(),
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

        let mut segs: Vec<Seg> = Vec::with_capacity(local_idx.len());
        let mut total = 0u64;
        // Random indices into large lists miss the cache four times each (two descriptors, two region
        // entries); fetch a few iterations ahead so the misses overlap.
        const AHEAD: usize = 8;
        let prefetch = |k: usize| {
            if let (Some(&li), Some(&ri)) = (local_idx.get(k), remote_idx.get(k)) {
                let (li, ri) = (li as usize, ri as usize);
                if li < l.descs.len() && ri < r.descs.len() {
                    prefetch_read(&l.descs[li]);
                    prefetch_read(&r.descs[ri]);
                    prefetch_read(&lres.region[li]);
                    prefetch_read(&rres.region[ri]);
                }
            }
        };
        for k in 0..AHEAD {
            prefetch(k);
        }
        for (k, (&li, &ri)) in local_idx.iter().zip(remote_idx).enumerate() {
            prefetch(k + AHEAD);
            let li = index(li, l.descs.len(), "local")?;
            let ri = index(ri, r.descs.len(), "remote")?;
            let (ld, rd) = (&l.descs[li], &r.descs[ri]);
            if ld.len != rd.len {
                return Err(Error::invalid_param(format!(
                    "length mismatch: local {} bytes, remote {} bytes",
                    ld.len, rd.len
                )));
            }
            total += ld.len;
            let (lreg, rreg) = (lres.region[li], rres.region[ri]);
            // Compared field by field and written straight into the vector: a `Seg` built on the stack and
            // then copied stalls on store forwarding, which cost about half of this loop.
            if !opts.skip_desc_merge {
                if let Some(last) = segs.last_mut() {
                    if mergeable(last, ld.addr, rd.addr, ld.dev, rd.dev, lreg, rreg) {
                        last.len += ld.len;
                        continue;
                    }
                }
            }
            segs.push(Seg { local: ld.addr, remote: rd.addr, len: ld.len, ldev: ld.dev, rdev: rd.dev, lreg, rreg });
        }

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
        let desc_count = segs.len() as u64;
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
        let bx = slot.be.prep_xfer(plan)?;
        Ok(XferReq(Arc::new(Xfer {
            owner: self.inner.incarnation,
            slot,
            remote: remote_ra,
            target,
            bx,
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

    /// Prep both sides and make the request in one step (`createXferReq`).
    pub fn create_xfer_req(
        &self,
        op: XferOp,
        local: &XferDList,
        remote: &XferDList,
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
        let l = self.prep_xfer_dlist("", local, &opts.backends)?;
        let r = self.prep_xfer_dlist(remote_agent, remote, &opts.backends)?;
        let idx: Vec<i64> = (0..local.len() as i64).collect();
        self.make_xfer_req(op, &l, &idx, &r, &idx, opts)
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
                return Err(Error::disconnected(format!("agent '{}' has disconnected", ra.name)));
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
        if let Err(e) = self.gate(x) {
            self.inner.tele.error(e.status());
            return Err(e);
        }
        let mut st = x.st.lock();
        if st.released {
            return Err(Error::invalid_param("transfer request was released"));
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
        let t0 = Instant::now();
        st.post_start = Some(t0);
        st.start_time_us = crate::util::monotonic_us();
        let res = x.bx.post(st.notif.as_deref());
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
                    st.last = Some(e.status());
                    self.inner.tele.error(e.status());
                    return Err(e);
                }
                let res = x.bx.status();
                st.last = Some(match &res {
                    Ok(s) => *s,
                    Err(e) => e.status(),
                });
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

/// Resolve every descriptor with `find`; None unless all are covered. Region keys are deduplicated.
fn resolve(
    descs: &XferDList,
    find: impl Fn(&Desc) -> Option<usize>,
    key: impl Fn(usize) -> Option<RegionKey>,
) -> Option<(Vec<u32>, Vec<Option<RegionKey>>)> {
    let mut region = Vec::with_capacity(descs.len());
    let mut keys = Vec::new();
    let mut seen: HashMap<usize, u32> = HashMap::new();
    for d in descs.iter() {
        let i = find(d)?;
        let k = *seen.entry(i).or_insert_with(|| {
            keys.push(key(i));
            (keys.len() - 1) as u32
        });
        region.push(k);
    }
    Some((region, keys))
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

fn index(i: i64, n: usize, side: &str) -> Result<usize> {
    usize::try_from(i)
        .ok()
        .filter(|&i| i < n)
        .ok_or_else(|| Error::invalid_param(format!("{side} index {i} out of range for {n} descriptors")))
}

/// Two pieces merge when both sides continue exactly where the previous one ended, in the same regions.
#[inline(always)]
fn mergeable(a: &Seg, local: u64, remote: u64, ldev: u64, rdev: u64, lreg: u32, rreg: u32) -> bool {
    a.ldev == ldev
        && a.rdev == rdev
        && a.lreg == lreg
        && a.rreg == rreg
        && a.local.checked_add(a.len) == Some(local)
        && a.remote.checked_add(a.len) == Some(remote)
}

fn ceil_us(d: std::time::Duration) -> u64 {
    d.as_nanos().div_ceil(1000) as u64
}
