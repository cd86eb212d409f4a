//! The agent's side of the overlap check (`crate::overlap`): which requests are in flight, what a conflict
//! says, and what `warn` and `refuse` do with it.
//!
//! A request's footprint is built with the request (only while the check is on). A post checks it against the
//! table and puts it in; the request leaves at its terminal status (however it is seen: a post that completes
//! inline, a status poll, or, lazily, a conflict with a request whose engine has finished it though nobody has
//! polled it yet), when it is released, and when its handle is dropped. A re-post of a finished handle is
//! checked again. The table has its own lock, taken after the request's own, never across I/O.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::{BackendXfer, XferOp};
use crate::mem::MemType;
use crate::overlap::{Access, Conflict, Counts, Footprint, Mode, Space, Table};
use crate::status::{Error, Result, Status};

/// What a message says about one request in the table.
pub(crate) struct Claim {
    op: XferOp,
    /// The peer it moves to or from ("" for loopback).
    peer: Arc<str>,
    notif: Option<Vec<u8>>,
    /// To see whether the engine has finished it when nobody has asked.
    bx: Arc<dyn BackendXfer>,
}

pub(crate) struct Checker {
    pub mode: Mode,
    /// This agent's incarnation: the owner of its own memory spaces.
    me: u128,
    table: Mutex<Table<Claim>>,
    pub counts: Arc<Counts>,
    next: AtomicU64,
}

/// One request as the checker sees it (the fields of `xfer::Xfer` it needs).
pub(crate) struct Req<'a> {
    pub id: u64,
    pub op: XferOp,
    /// The peer's name ("" for loopback).
    pub peer: &'a str,
    pub foot: &'a Arc<Footprint>,
    pub bx: &'a Arc<dyn BackendXfer>,
}

impl Checker {
    pub fn new(mode: Mode, me: u128, counts: Arc<Counts>) -> Checker {
        Checker { mode, me, table: Mutex::new(Table::default()), counts, next: AtomicU64::new(1) }
    }

    /// A request id (for messages: "request #7").
    pub fn id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// The footprint of a request's pieces `(local, remote, len, ldev, rdev)`: READ writes local memory and reads
    /// the remote's, WRITE the other way round. `remote_owner` is the incarnation whose memory the remote side is
    /// (this agent's own for loopback).
    pub fn footprint(
        &self,
        op: XferOp,
        (local_mem, remote_mem): (MemType, MemType),
        remote_owner: u128,
        segs: &[crate::backend::Seg],
    ) -> Arc<Footprint> {
        let (la, ra) = match op {
            XferOp::Read => (Access::Write, Access::Read),
            XferOp::Write => (Access::Read, Access::Write),
        };
        let local = |dev| Space { owner: self.me, mem: local_mem as u8, dev };
        let remote = |dev| Space { owner: remote_owner, mem: remote_mem as u8, dev };
        Arc::new(Footprint::build(
            segs.iter()
                .map(|s| (local(s.ldev), la, s.local, s.len))
                .chain(segs.iter().map(|s| (remote(s.rdev), ra, s.remote, s.len))),
        ))
    }

    /// Check `r` before it is posted with `notif`, and put it in the table. Err (NOT_ALLOWED, nothing in the
    /// table) when it collides and the mode is `refuse`.
    pub fn admit(&self, r: &Req<'_>, notif: Option<&[u8]>) -> Result<()> {
        let mut t = self.table.lock();
        // A re-post: its last post is over (the agent checked), whether or not anyone saw it end.
        t.remove(r.id);
        let found = loop {
            let Some(c) = t.first_conflict(r.foot, |_, _| true) else { break None };
            // A request the engine has finished leaves now, not at the caller's next poll.
            let done = t.payload(c.other).is_some_and(|o| !matches!(o.bx.status(), Ok(Status::InProg)));
            if done {
                t.remove(c.other);
                continue;
            }
            break Some(c);
        };
        if let Some(c) = found {
            self.counts.initiator.fetch_add(1, Ordering::Relaxed);
            let other = t
                .payload(c.other)
                .zip(t.footprint(c.other))
                .map(|(o, fp)| self.describe(c.other, o.op, &o.peer, o.notif.as_deref(), fp, &c));
            let mine = self.describe(r.id, r.op, r.peer, notif, r.foot, &c);
            let space = self.space_name(c.space, r.peer);
            let msg = format!(
                "overlap check: {mine} would {} bytes [{:#x}, {:#x}) of {space} that in-flight {} {}; NIXL orders \
                 neither (GIXL_CHECK_OVERLAP={})",
                if c.mine == Access::Write { "write" } else { "read" },
                c.range.0,
                c.range.1,
                other.unwrap_or_else(|| format!("request #{}", c.other)),
                c.theirs.verb(),
                self.mode.name()
            );
            if self.mode == Mode::Refuse {
                return Err(Error::not_allowed(format!("{msg}: this post is refused and moved nothing")));
            }
            crate::telemetry::log::warn(&msg);
        }
        let claim = Claim { op: r.op, peer: Arc::from(r.peer), notif: notif.map(<[u8]>::to_vec), bx: r.bx.clone() };
        t.insert(r.id, r.foot.clone(), claim);
        Ok(())
    }

    /// Request `id` has reached a terminal status, was released or is gone.
    pub fn leave(&self, id: u64) {
        self.table.lock().remove(id);
    }

    fn space_name(&self, s: Space, peer: &str) -> String {
        let mem = MemType::from_u32(s.mem as u32).map_or("?", MemType::seg_name);
        if s.owner == self.me {
            format!("this agent's {mem} (device {})", s.dev)
        } else {
            format!("agent '{peer}' {mem} (device {}, incarnation {:032x})", s.dev, s.owner)
        }
    }

    fn describe(
        &self,
        id: u64,
        op: XferOp,
        peer: &str,
        notif: Option<&[u8]>,
        foot: &Footprint,
        c: &Conflict,
    ) -> String {
        let dir = match op {
            XferOp::Read => "READ from",
            XferOp::Write => "WRITE to",
        };
        let who = if peer.is_empty() { "this agent (loopback)".to_owned() } else { format!("'{peer}'") };
        let notif = match notif {
            None => "no notification".to_owned(),
            Some(m) => {
                let s = String::from_utf8_lossy(&m[..m.len().min(64)]);
                format!("notification {s:?}{}", if m.len() > 64 { "…" } else { "" })
            }
        };
        // Its ranges in the space of the conflict (the access it has there).
        let access = if id == c.other { c.theirs } else { c.mine };
        let rs = foot.ranges(c.space, access);
        let span = match (rs.first(), rs.last()) {
            (Some(a), Some(b)) => format!("{} range(s) in [{:#x}, {:#x})", rs.len(), a.0, b.1),
            _ => "no ranges".to_owned(),
        };
        format!("request #{id} ({dir} {who}, {notif}, {span})")
    }
}
