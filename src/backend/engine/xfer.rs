//! One request of the engine from post to completion: the prepared request (`Core`: plan, route, and for
//! VRAM its `Mover`), one post of it (`Run`: state, pending pieces, first error, abort), splitting into pieces
//! for the copy threads or a TCP peer's data connections, copies by the peer's route, and completion
//! (the notification strictly after the data, then the status).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::copy;
use super::peer::EnginePeer;
use super::route::tcp::link::TcpLink;
use super::route::{Job, Prepared};
use super::shared::Shared;
use crate::backend::{BackendXfer, Peer, Seg, Target, XferPlan};
use crate::status::{Error, Result, Status};

/// Requests up to this size run inline in `post`: splitting them costs more than it saves (at 4 MiB, split in two
/// on a 2-core host under nixlbench's polling loop, some runs halved; inline, none did).
const INLINE_BYTES: u64 = 4 << 20;
/// Pieces of a split request are at least this large.
const MIN_PIECE: u64 = 1 << 20;
/// A split DRAM request has at most this many pieces. They are many more than the copy threads: each copy
/// thread and each poll takes the next one still queued, so a copy thread that is descheduled (another
/// process on its core) holds up at most the one piece it took, while the others go on (split only in as many
/// pieces as threads, a descheduled thread held up half an 8 MiB WRITE under nixlbench, 0.2× NIXL's rate).
const MAX_PIECES: u64 = 256;
/// Over TCP, requests up to this size run inline in `post` (one round trip); larger ones go to workers.
const TCP_INLINE_BYTES: u64 = 256 << 10;

/// A prepared request (its peer, if any, is `plan.target`, checked to be this engine's), shared with the copy
/// threads.
pub(super) struct Core {
    pub(super) shared: Arc<Shared>,
    pub(super) plan: XferPlan,
    /// Set when the request touches VRAM: its pieces go through it (`vram`, inside the same gate; `route::tcp::vram`
    /// when its peer is reached over TCP) instead of the DRAM copies of `copy`.
    pub(super) mover: Option<Box<dyn Mover>>,
    /// What the peer's route found for the request (`Route::prepare`).
    pub(super) prepared: Option<Prepared>,
}

/// How a request that moves more than DRAM runs its pieces, prepared once for it (`prep_xfer`).
pub(super) trait Mover: Send + Sync {
    /// Move `segs` (one piece of `core`'s request), stopping early when `run` is aborted.
    fn copy(&self, core: &Core, segs: &[Seg], run: &Run) -> Result<()>;
}

pub(super) struct EngineXfer {
    core: Arc<Core>,
    run: Mutex<Option<Arc<Run>>>,
}

impl EngineXfer {
    pub(super) fn boxed(core: Core) -> Box<dyn BackendXfer> {
        Box::new(EngineXfer { core: Arc::new(core), run: Mutex::new(None) })
    }
}

/// One post of a request, shared with the copy threads working on it.
#[derive(Default)]
pub(super) struct Run {
    state: AtomicI32,
    pending: AtomicUsize,
    pub(super) abort: AtomicBool,
    err: Mutex<Option<(Status, String)>>,
    done_at: Mutex<Option<Instant>>,
    idle: Condvar,
    idle_lock: Mutex<()>,
    notif: Option<Vec<u8>>,
    /// Pieces for the copy threads that none has taken yet. A poll of the request takes one and copies it
    /// itself (`EngineXfer::status`): a caller spinning on the status (nixlbench, NIXL's examples) then moves
    /// data instead of taking a core from the copy threads, as NIXL's UCX progresses in the polling thread.
    queued: Mutex<VecDeque<Vec<Seg>>>,
}

impl Run {
    fn fail(&self, e: Error) {
        self.err.lock().get_or_insert_with(|| (e.status(), e.message().to_owned()));
    }

    /// Copy one piece of `core`'s request (skipped once aborted); the last piece finishes the request.
    fn piece(&self, core: &Core, segs: &[Seg]) {
        if !self.abort.load(Ordering::Relaxed) {
            core.guarded_copy(segs, self);
        }
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            core.finish(self);
        }
    }

    /// Copy the next piece no copy thread has taken; false when there is none.
    fn take_piece(&self, core: &Core) -> bool {
        let Some(segs) = self.queued.lock().pop_front() else { return false };
        self.piece(core, &segs);
        true
    }
}

impl Core {
    pub(super) fn peer(&self) -> Option<&EnginePeer> {
        match &self.plan.target {
            Target::Local => None,
            Target::Remote(p) => p.as_any().downcast_ref::<EnginePeer>(),
        }
    }

    /// Copy `segs` by whichever route this request takes (see `route`).
    fn copy(&self, segs: &[Seg], run: &Run) -> Result<()> {
        if self.shared.panic_copies {
            panic!("injected copy-worker panic (GIXL_TEST_FAULT=copy_panic)");
        }
        if let Some(m) = &self.mover {
            return m.copy(self, segs, run);
        }
        let Some(p) = self.peer() else {
            // SAFETY: loopback: the agent resolved both sides against this agent's own registrations.
            unsafe { copy::local_copy(self.plan.op, segs) };
            return Ok(());
        };
        let job = Job {
            op: self.plan.op,
            keys: &self.plan.remote_keys,
            prepared: self.prepared.as_deref(),
            abort: &run.abort,
            agent: &self.shared.agent,
        };
        p.copy(&job, segs)
    }

    /// `copy`, with any failure, a panic included, recorded on the request (never unwinding further).
    fn guarded_copy(&self, segs: &[Seg], run: &Run) {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.copy(segs, run))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => run.fail(e),
            Err(_) => run.fail(Error::backend("a copy worker panicked; this request failed (the agent stays usable)")),
        }
    }

    /// The link of a request that goes over TCP from the start (heartbeats run while it is in flight).
    fn tcp_link(&self) -> Option<&Arc<TcpLink>> {
        self.peer().and_then(|p| p.via().link())
    }

    /// Data is complete: send the notification, then publish the outcome.
    fn finish(&self, run: &Run) {
        if let Some(msg) = run.notif.as_ref().filter(|_| run.err.lock().is_none()) {
            let r = match self.peer() {
                None => {
                    self.shared.queue.lock().push((self.shared.agent.clone(), msg.clone()));
                    Ok(())
                }
                Some(p) => p.notify(&self.shared.agent, msg),
            };
            r.unwrap_or_else(|e| run.fail(e));
        }
        *run.done_at.lock() = Some(Instant::now());
        let state = run.err.lock().as_ref().map_or(Status::Success, |e| e.0);
        if let Some(link) = self.tcp_link() {
            link.end();
        }
        run.state.store(state as i32, Ordering::Release);
        let _g = run.idle_lock.lock();
        run.idle.notify_all();
    }
}

impl BackendXfer for EngineXfer {
    fn post(&self, notif: Option<&[u8]>) -> Result<Status> {
        let core = &self.core;
        if core.shared.closed.load(Ordering::Acquire) {
            return Err(Error::backend("the agent that made this request has been destroyed"));
        }
        if let Some(p) = core.peer().filter(|p| p.disconnected()) {
            return Err(crate::backend::disconnected(&p.name, p));
        }
        let plan = &core.plan;
        let tcp = core.tcp_link();
        if let Some(link) = tcp {
            // The control connection carries the heartbeats that bound this request.
            link.connect()?;
        }
        let (pieces, inline) = match tcp {
            Some(_) if plan.total_bytes <= TCP_INLINE_BYTES => (1, true),
            Some(_) => ((plan.total_bytes / MIN_PIECE).clamp(1, core.shared.tcp_opts.conns as u64) as usize, false),
            None if plan.total_bytes <= INLINE_BYTES || core.shared.threads <= 1 => (1, true),
            // A VRAM request's pieces each set up device copies, a NIC's are kept in flight by its route: one
            // per copy thread.
            None if core.mover.is_some() || core.peer().is_some_and(|p| !p.via().cpu_copies()) => {
                ((plan.total_bytes / MIN_PIECE).clamp(1, core.shared.threads as u64) as usize, false)
            }
            None => ((plan.total_bytes / MIN_PIECE).clamp(1, MAX_PIECES) as usize, false),
        };
        let run = Arc::new(Run {
            state: AtomicI32::new(Status::InProg as i32),
            pending: AtomicUsize::new(pieces),
            notif: notif.map(<[u8]>::to_vec),
            ..Run::default()
        });
        *self.run.lock() = Some(run.clone());
        if let Some(link) = tcp {
            link.begin();
        }
        if inline {
            core.guarded_copy(&plan.segs, &run);
            core.finish(&run);
            return self.status();
        }
        // About equal bytes each, segments split where needed.
        let parts = copy::chunks(&plan.segs, plan.total_bytes.div_ceil(pieces as u64).max(1));
        run.pending.store(parts.len(), Ordering::Release);
        if tcp.is_some() {
            // Over TCP a piece waits on sockets: only the TCP workers take them, never a polling caller.
            for part in parts {
                let (c, run) = (core.clone(), run.clone());
                core.shared.tcp_pool.submit(Box::new(move || run.piece(&c, &part)));
            }
            return Ok(Status::InProg);
        }
        // Up to one task per copy thread, each taking the next piece still queued (polls take them too) until
        // none is left.
        let tasks = parts.len().min(core.shared.threads);
        *run.queued.lock() = parts.into();
        for _ in 0..tasks {
            let (c, run) = (core.clone(), run.clone());
            core.shared.pool.submit(Box::new(move || while run.take_piece(&c) {}));
        }
        Ok(Status::InProg)
    }

    fn status(&self) -> Result<Status> {
        let Some(run) = self.run.lock().clone() else { return Err(Error::new(Status::NotPosted, "not posted")) };
        match Status::from_i32(run.state.load(Ordering::Acquire)).unwrap_or(Status::Unknown) {
            Status::Success => Ok(Status::Success),
            Status::InProg => {
                // A dead peer is reported without waiting for the copy threads to notice it by themselves,
                // but only once they have stopped: a terminal status means nothing touches the buffers.
                if let Some(p) = self.core.peer().filter(|p| p.disconnected()) {
                    self.abort();
                    return Err(crate::backend::disconnected(&p.name, p));
                }
                // The caller polls: it copies one piece no copy thread has taken yet, then answers for it.
                if run.take_piece(&self.core) && run.state.load(Ordering::Acquire) != Status::InProg as i32 {
                    return self.status();
                }
                // Nothing left to take: give this core to the copy threads before the caller polls again (a
                // tight polling loop on a 2-core host otherwise halves some 4 MiB transfers, nixlbench showed).
                std::thread::yield_now();
                Ok(Status::InProg)
            }
            s => Err(Error::new(s, run.err.lock().as_ref().map(|(_, m)| m.clone()).unwrap_or_default())),
        }
    }

    fn abort(&self) -> bool {
        let Some(run) = self.run.lock().clone() else { return true };
        run.abort.store(true, Ordering::Release);
        // Wait for pieces already copying: the caller may free its buffers as soon as we return.
        let mut g = run.idle_lock.lock();
        while run.state.load(Ordering::Acquire) == Status::InProg as i32 {
            run.idle.wait(&mut g);
        }
        true
    }

    fn completed_at(&self) -> Option<Instant> {
        self.run.lock().as_ref().and_then(|r| *r.done_at.lock())
    }
}

impl Drop for EngineXfer {
    /// Whoever drops the request may free its buffers next: no copy of it may still run.
    fn drop(&mut self) {
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::super::harness::write_plan;
    use super::super::Engine;
    use super::*;
    use crate::backend::{Backend, BackendInit};
    use crate::mem::{Desc, MemType, RegDesc};
    use std::time::Duration;

    /// Engines `{prefix}-A` and `{prefix}-B` (two copy threads each) and a WRITE of `src` from A into `dst`,
    /// registered at B, not posted yet.
    fn write_between_engines(prefix: &str, src: &[u8], dst: &[u8]) -> (Engine, Engine, EngineXfer) {
        let init = |name: String| BackendInit {
            agent_name: name,
            incarnation: crate::util::random_u128(),
            params: [("num_threads".to_owned(), "2".to_owned())].into_iter().collect(),
            num_workers: 0,
            overlap: None,
        };
        let a = Engine::new(init(format!("{prefix}-A"))).unwrap();
        let bi = init(format!("{prefix}-B"));
        let binc = bi.incarnation;
        let b = Engine::new(bi).unwrap();
        let len = dst.len() as u64;
        let rd = RegDesc { desc: Desc::new(dst.as_ptr() as u64, len, 0), meta: vec![] };
        let lr = b.register(MemType::Dram, &rd).unwrap();
        let peer = a.load_peer(&format!("{prefix}-B"), binc, &b.conn_info()).unwrap();
        let key = a.load_remote_region(&peer, MemType::Dram, &rd.desc, &lr.public).unwrap();
        let plan = write_plan(src.as_ptr() as u64, dst.as_ptr() as u64, len, &peer, key);
        let x = EngineXfer {
            core: Arc::new(Core { shared: a.shared.clone(), plan, mover: None, prepared: None }),
            run: Mutex::new(None),
        };
        (a, b, x)
    }

    /// A disconnect reported by `status` is terminal only once no copy thread works on the request any more,
    /// and a request whose target is destroyed mid-copy leaves nothing running.
    #[test]
    fn terminal_status_only_after_workers_stop() {
        const SIZE: usize = 256 << 20;
        let src = vec![1u8; SIZE];
        let dst = vec![0u8; SIZE];
        let (_a, b, x) = write_between_engines("ct", &src, &dst);
        assert_eq!(x.post(None).unwrap(), Status::InProg);
        let probe = (dst.as_ptr() as usize + SIZE / 2 + (8 << 20)) as *const u8;
        // SAFETY: `dst` lives to the end of the test; volatile because a copy thread writes it.
        while unsafe { std::ptr::read_volatile(probe) } == 0 {
            std::hint::spin_loop();
        }
        drop(b);
        let t = Instant::now();
        let st = loop {
            match x.status() {
                Ok(Status::InProg) if t.elapsed() < Duration::from_secs(20) => std::thread::yield_now(),
                other => break other,
            }
        };
        let run = x.run.lock().clone().unwrap();
        assert_eq!(st.as_ref().err().map(|e| e.status()), Some(Status::RemoteDisconnect), "{st:?}");
        assert_eq!(run.pending.load(Ordering::Acquire), 0, "a copy thread still works on a terminal request");
        assert_ne!(run.state.load(Ordering::Acquire), Status::InProg as i32);
    }

    /// A caller polling the status moves the pieces no copy thread has taken: with every copy thread held
    /// busy, polls alone complete a split request, byte-exact, and the copy threads find nothing left after.
    #[test]
    fn polls_copy_the_pieces_no_copy_thread_took() {
        const SIZE: usize = 16 << 20;
        let src: Vec<u8> = (0..SIZE).map(|i| (i * 7 + i / 4096) as u8).collect();
        let dst = vec![0u8; SIZE];
        let (a, _b, x) = write_between_engines("poll", &src, &dst);
        // Both copy threads wait behind a gate until the request is complete.
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let started = Arc::new(AtomicUsize::new(0));
        for _ in 0..2 {
            let (gate, started) = (gate.clone(), started.clone());
            a.shared.pool.submit(Box::new(move || {
                started.fetch_add(1, Ordering::AcqRel);
                let mut open = gate.0.lock();
                while !*open {
                    gate.1.wait(&mut open);
                }
            }));
        }
        while started.load(Ordering::Acquire) < 2 {
            std::thread::yield_now();
        }
        assert_eq!(x.post(None).unwrap(), Status::InProg);
        let queued = x.run.lock().clone().unwrap().queued.lock().len();
        assert_eq!(queued, 16, "the request was split in 1 MiB pieces");
        let mut polls = 0;
        while x.status().unwrap() == Status::InProg {
            polls += 1;
            assert!(polls <= queued, "each poll copies a piece: {polls} polls and still in progress");
        }
        assert_eq!(dst, src, "the polls moved every byte");
        *gate.0.lock() = true;
        gate.1.notify_all();
        // The copy threads' tasks for this request find its queue empty and leave it as it is.
        a.shared.pool.shutdown();
        assert_eq!(x.status().unwrap(), Status::Success);
        assert_eq!(dst, src);
    }
}
