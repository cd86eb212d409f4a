//! The io_uring queue: one ring per backend, owned by one driver thread.
//!
//! `post` appends the run to a backlog and wakes the driver through an eventfd. The driver moves backlog
//! I/Os into the submission queue, whole runs at a time until an entry carries 256 KiB or 64 I/Os (it
//! submits whenever the queue fills), enters the kernel to submit them (and waits there for a completion
//! when nothing else is queued), and handles what completed: short transfers are resubmitted for the rest,
//! errors end the run. Page-cache I/O completes inside the kernel entry that submits it, so cutting the
//! backlog into entries lets a run's completion be seen once its own I/O is done, not once the whole
//! backlog's is. It sleeps in the kernel while I/O is in flight and on the eventfd read otherwise, so
//! nothing spins, and requests progress whether or not anyone polls them.
//!
//! At most `cap` I/Os are in flight (never more than the completion queue holds), so completions cannot
//! overflow; the rest waits in the backlog. This module does not use registered buffers, fixed files or
//! SQPOLL.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring, Probe};
use parking_lot::Mutex;

use super::io::{Failure, IoFail, Run};
use crate::status::Status;

/// user_data of the eventfd read; I/Os use their slot index.
const WAKE: u64 = u64::MAX;
/// A kernel entry takes further queued runs only while it carries fewer bytes and I/Os than these.
const ENTRY_BYTES: u64 = 256 << 10;
const ENTRY_IOS: usize = 64;
/// Consecutive EINTR/EAGAIN completions of one I/O before it counts as failed.
const MAX_RETRIES: u8 = 16;

pub(crate) struct Ring {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    backlog: Mutex<Backlog>,
    wake: OwnedFd,
}

#[derive(Default)]
struct Backlog {
    /// Runs with I/Os not yet handed to the kernel, and the index of the next such I/O.
    runs: VecDeque<(Arc<Run>, usize)>,
    stop: bool,
}

impl Ring {
    /// Set up a ring with `entries` submission slots and at most `max_inflight` I/Os in the kernel. Fails if
    /// io_uring is missing, disabled (`kernel.io_uring_disabled`, seccomp) or lacks plain read/write.
    pub fn new(entries: u32, max_inflight: u32) -> io::Result<Ring> {
        let entries = entries.clamp(1, 32768);
        let cq = entries.saturating_mul(4).clamp(1024, 65536);
        let ring: IoUring = IoUring::builder().dontfork().setup_clamp().setup_cqsize(cq).build(entries)?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        if !probe.is_supported(opcode::Read::CODE) || !probe.is_supported(opcode::Write::CODE) {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "the kernel's io_uring lacks READ/WRITE"));
        }
        // One completion slot stays free for the eventfd read.
        let cap = (ring.params().cq_entries() as usize - 1).min(max_inflight.max(1) as usize);
        // SAFETY: plain syscall; the result is checked before use.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        let wake = unsafe { OwnedFd::from_raw_fd(efd) };
        let shared = Arc::new(Shared { backlog: Mutex::default(), wake });
        let sh = shared.clone();
        let thread = std::thread::Builder::new().name("gixl-posix-uring".into()).spawn(move || drive(ring, sh, cap))?;
        Ok(Ring { shared, thread: Some(thread) })
    }

    /// Queue every I/O of `run` (made with `ops.len()` units).
    pub fn start(&self, run: Arc<Run>) {
        if run.work.ops.is_empty() {
            return;
        }
        self.shared.backlog.lock().runs.push_back((run, 0));
        self.wake();
    }

    /// Make the driver look at the backlog again (new work, or a run that should be dropped from it).
    pub fn wake(&self) {
        self.shared.wake();
    }
}

impl Shared {
    fn wake(&self) {
        crate::os::wake(&self.wake);
    }
}

impl Drop for Ring {
    /// Queued runs are dropped (they end as failed); I/O already in the kernel is waited for.
    fn drop(&mut self) {
        self.shared.backlog.lock().stop = true;
        self.shared.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One I/O in the kernel.
struct Slot {
    run: Arc<Run>,
    idx: usize,
    /// Bytes already moved by earlier completions of this I/O.
    done: u64,
    retries: u8,
}

struct Driver {
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    inflight: usize,
    /// Slots whose I/O must be submitted again for its remaining bytes.
    again: VecDeque<usize>,
}

fn drive(ring: IoUring, sh: Arc<Shared>, cap: usize) {
    // Declared before the ring, so it is freed after the ring (which may still hold a read into it).
    let mut wake_buf = Box::new(0u64);
    let mut ring = ring;
    let mut d = Driver { slots: Vec::new(), free: Vec::new(), inflight: 0, again: VecDeque::new() };
    let mut armed = false;
    let mut batch: Vec<(Arc<Run>, usize)> = Vec::new();
    let mut cqes: Vec<(u64, i32)> = Vec::new();
    let mut more;
    loop {
        if !armed {
            let e = opcode::Read::new(types::Fd(sh.wake.as_raw_fd()), (&mut *wake_buf as *mut u64).cast(), 8)
                .build()
                .user_data(WAKE);
            push(&mut ring, &e);
            armed = true;
        }
        while let Some(s) = d.again.pop_front() {
            let e = d.sqe(s);
            push(&mut ring, &e);
        }
        let stop = {
            let mut q = sh.backlog.lock();
            let stop = q.stop;
            // Drop the queued I/Os of runs that were aborted or failed (or all, when shutting down), wherever
            // they are in the backlog: an abort must not wait behind other requests.
            q.runs.retain(|(run, next)| {
                if !stop && !run.stopping() {
                    return true;
                }
                if stop {
                    run.fail(Failure {
                        status: Status::Backend,
                        msg: "the POSIX backend was destroyed before this transfer was started".into(),
                        errno: None,
                    });
                }
                run.done(run.work.ops.len() - next);
                false
            });
            // Whole runs per kernel entry, up to ENTRY_BYTES or ENTRY_IOS: I/O the kernel does inline (the page
            // cache) completes inside the entry, so a run's completion is seen once its own I/O is done, not
            // once every queued run's is (a staged GDS post copies each slot as soon as its reads are done).
            let mut bytes = 0u64;
            while let Some((run, next)) = q.runs.front_mut() {
                if d.inflight + batch.len() >= cap {
                    break;
                }
                batch.push((run.clone(), *next));
                bytes += u64::from(run.work.ops[*next].len);
                *next += 1;
                if *next == run.work.ops.len() {
                    q.runs.pop_front();
                    if bytes >= ENTRY_BYTES || batch.len() >= ENTRY_IOS {
                        break;
                    }
                }
            }
            more = !q.runs.is_empty() && d.inflight + batch.len() < cap;
            stop
        };
        for (run, idx) in batch.drain(..) {
            let s = d.alloc(Slot { run, idx, done: 0, retries: 0 });
            let e = d.sqe(s);
            push(&mut ring, &e);
        }
        if stop && d.inflight == 0 {
            break;
        }
        // More runs queued and room for them: submit without waiting, reap, and come back for the next run.
        let r = if more { ring.submit().map(drop) } else { ring.submit_and_wait(1).map(drop) };
        if let Err(e) = r {
            // EINTR: a signal; EBUSY/EAGAIN: the kernel is short of resources. Reap, back off, try again.
            if e.raw_os_error() != Some(libc::EINTR) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        cqes.clear();
        cqes.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        for &(ud, res) in &cqes {
            if ud == WAKE {
                armed = false;
            } else {
                d.complete(ud as usize, res);
            }
        }
    }
    drop(ring);
    drop(wake_buf);
}

/// Put `e` in the submission queue, submitting first if it is full.
fn push(ring: &mut IoUring, e: &squeue::Entry) {
    loop {
        // SAFETY: every entry we build points at memory that outlives its completion: the eventfd buffer
        // lives until the ring is gone, and I/O buffers are registered memory kept valid while the run
        // that owns them is in flight (its slot holds the run until the completion is handled).
        if unsafe { ring.submission().push(e) }.is_ok() {
            return;
        }
        if let Err(err) = ring.submit() {
            if err.raw_os_error() != Some(libc::EINTR) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

impl Driver {
    fn alloc(&mut self, s: Slot) -> usize {
        self.inflight += 1;
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(s);
                i
            }
            None => {
                self.slots.push(Some(s));
                self.slots.len() - 1
            }
        }
    }

    /// The submission entry for what is left of slot `i`'s I/O.
    fn sqe(&self, i: usize) -> squeue::Entry {
        let s = self.slots[i].as_ref().expect("live slot");
        let op = &s.run.work.ops[s.idx];
        let buf = (op.buf + s.done) as *mut u8;
        let len = op.len - s.done as u32;
        let off = op.off + s.done;
        let fd = types::Fd(op.fd);
        let e = if s.run.work.read {
            opcode::Read::new(fd, buf, len).offset(off).build()
        } else {
            opcode::Write::new(fd, buf as *const u8, len).offset(off).build()
        };
        e.user_data(i as u64)
    }

    fn complete(&mut self, i: usize, res: i32) {
        let Some(s) = self.slots.get_mut(i).and_then(Option::as_mut) else { return };
        let op = s.run.work.ops[s.idx];
        let read = s.run.work.read;
        let outcome = if res < 0 {
            let e = -res;
            if (e == libc::EINTR || e == libc::EAGAIN) && s.retries < MAX_RETRIES && !s.run.stopping() {
                s.retries += 1;
                None
            } else {
                Some(Err(Failure::io(read, &op, s.done, IoFail::Os(e))))
            }
        } else if res == 0 {
            Some(Err(Failure::io(read, &op, s.done, if read { IoFail::Eof } else { IoFail::NoProgress })))
        } else {
            s.done += res as u64;
            s.retries = 0;
            if s.done >= op.len as u64 || s.run.stopping() {
                Some(Ok(()))
            } else {
                // A short transfer not at the end of the file: ask again for the rest.
                None
            }
        };
        match outcome {
            None => self.again.push_back(i),
            Some(r) => {
                let s = self.slots[i].take().expect("live slot");
                self.free.push(i);
                self.inflight -= 1;
                if let Err(f) = r {
                    s.run.fail(f);
                }
                s.run.done(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::super::io::{Op, Work};
    use super::*;

    /// A run queued before a large one is published finished before the large one's page-cache reads are
    /// done: the backlog is not submitted in one kernel entry that completes both together.
    #[test]
    fn a_run_completes_before_later_queued_runs_do_their_io() {
        let ring = match Ring::new(64, 64) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("io_uring unavailable here, nothing to test: {e}");
                return;
            }
        };
        let path = std::env::temp_dir().join(format!("gixl-uring-entries-{}", std::process::id()));
        const BIG: u64 = 64 << 20;
        // In the page cache, so the kernel reads it inline, in the entry that submits the reads.
        std::fs::write(&path, vec![0x5Au8; BIG as usize]).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let fd = f.as_raw_fd();
        let mut buf = vec![0u8; BIG as usize];
        let base = buf.as_mut_ptr() as u64;
        let op = |off: u64, len: u64| Op { fd, buf: base + off, off, len: len as u32, direct: false };
        // As large as one kernel entry carries (ENTRY_BYTES), so the entry ends with it.
        let small = Arc::new(Work { read: true, ops: vec![op(0, ENTRY_BYTES)] });
        // 64 MiB in 4 MiB reads: milliseconds of copying from the page cache, and few completions to reap.
        let big = Arc::new(Work { read: true, ops: (0..16).map(|i| op(i * (4 << 20), 4 << 20)).collect() });
        let mut gaps = Vec::new();
        for _ in 0..3 {
            let a = Run::new(small.clone(), 1);
            let b = Run::new(big.clone(), big.ops.len());
            {
                // Both queued before the driver looks at the backlog.
                let mut q = ring.shared.backlog.lock();
                q.runs.push_back((a.clone(), 0));
                q.runs.push_back((b.clone(), 0));
            }
            ring.wake();
            a.wait();
            b.wait();
            assert_eq!((a.state(), b.state()), (Status::Success, Status::Success));
            let (Some(ta), Some(tb)) = (a.done_at(), b.done_at()) else { panic!("finished runs without a time") };
            gaps.push(tb.saturating_duration_since(ta));
        }
        // Submitted in one entry, both completions are published microseconds apart; in two, the large run's
        // 64 MiB are read after the small run was published.
        assert!(
            gaps.iter().any(|g| *g >= Duration::from_millis(1)),
            "the small run was published only with the large one: {gaps:?}"
        );
        assert!(buf.iter().all(|&x| x == 0x5A));
    }
}
