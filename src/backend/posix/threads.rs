//! The fallback queue: a few worker threads doing plain `pread`/`pwrite`, for kernels or sandboxes without
//! io_uring and for `use_posix_aio=true` (glibc's POSIX AIO is itself a thread pool doing the same).
//!
//! A post hands the run to up to `size` workers; each claims the run's next I/O until none are left, so
//! one large request spreads over all workers and many small ones do not wait behind it. Threads start on
//! first use and sleep on a condition variable when idle: nothing polls.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use super::io::{blocking_io, Run};

pub(crate) struct Pool {
    size: usize,
    q: Arc<(Mutex<Tasks>, Condvar)>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Default)]
struct Tasks {
    /// One entry per worker helping with a run.
    runs: VecDeque<Arc<Run>>,
    stop: bool,
}

impl Pool {
    pub fn new(size: usize) -> Pool {
        Pool { size: size.max(1), q: Arc::default(), threads: Mutex::new(Vec::new()) }
    }

    /// Start `run`; the caller made it with `self.helpers(n_ops)` units.
    pub fn start(&self, run: Arc<Run>) {
        let helpers = self.helpers(run.work.ops.len());
        if helpers == 0 {
            return;
        }
        {
            let mut threads = self.threads.lock();
            while threads.len() < self.size {
                let q = self.q.clone();
                match std::thread::Builder::new().name("gixl-posix-io".into()).spawn(move || worker(q)) {
                    Ok(h) => threads.push(h),
                    Err(_) => break,
                }
            }
            if threads.is_empty() {
                // No thread could be started: do the I/O here rather than never.
                drop(threads);
                for _ in 0..helpers {
                    help(&run);
                }
                return;
            }
        }
        let (m, cv) = &*self.q;
        let mut q = m.lock();
        for _ in 0..helpers {
            q.runs.push_back(run.clone());
        }
        drop(q);
        if helpers == 1 {
            cv.notify_one();
        } else {
            cv.notify_all();
        }
    }

    /// How many workers share a run of `n_ops` I/Os (the run's unit count).
    pub fn helpers(&self, n_ops: usize) -> usize {
        n_ops.min(self.size)
    }
}

impl Drop for Pool {
    /// Workers finish what is queued, then exit.
    fn drop(&mut self) {
        let (m, cv) = &*self.q;
        m.lock().stop = true;
        cv.notify_all();
        for h in self.threads.lock().drain(..) {
            let _ = h.join();
        }
    }
}

fn worker(q: Arc<(Mutex<Tasks>, Condvar)>) {
    let (m, cv) = &*q;
    loop {
        let run = {
            let mut g = m.lock();
            loop {
                if let Some(r) = g.runs.pop_front() {
                    break r;
                }
                if g.stop {
                    return;
                }
                cv.wait(&mut g);
            }
        };
        help(&run);
    }
}

/// Claim and do the run's I/Os until none are left or the run stops; then count this helper as done.
fn help(run: &Run) {
    let ops = &run.work.ops;
    let read = run.work.read;
    loop {
        if run.stopping() {
            break;
        }
        let i = run.next.fetch_add(1, Ordering::Relaxed);
        let Some(op) = ops.get(i) else { break };
        // SAFETY: every I/O was built from a DRAM segment the agent resolved against this agent's
        // registrations, and registered memory stays valid while a transfer using it is in flight
        // (NIXL's contract; `abort` and `Drop` of the request wait for this run to finish).
        if let Err(f) = unsafe { blocking_io(read, op, || run.stopping()) } {
            run.fail(f);
        }
    }
    run.done(1);
}
