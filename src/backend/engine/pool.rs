//! The engine's pools: copy threads (`Pool`: they start on first use and sleep on a condition variable when
//! idle) and page-locked staging buffers (`Pinned`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::device::{Device, HostBuf};
use crate::status::Result;

type Task = Box<dyn FnOnce() + Send>;

pub struct Pool {
    size: usize,
    q: Arc<(Mutex<Queue>, Condvar)>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Default)]
struct Queue {
    tasks: VecDeque<Task>,
    stop: bool,
}

impl Pool {
    pub fn new(size: usize) -> Pool {
        Pool { size: size.max(1), q: Arc::default(), threads: Mutex::new(Vec::new()) }
    }

    /// Run `t` on a pool thread (inline once the pool has been shut down, so it still runs, or when no thread
    /// could be started).
    pub fn submit(&self, t: Task) {
        let stopped = self.q.0.lock().stop;
        if stopped || !self.started() {
            return t();
        }
        let (m, cv) = &*self.q;
        m.lock().tasks.push_back(t);
        cv.notify_one();
    }

    /// Start the threads not running yet; false when none runs.
    fn started(&self) -> bool {
        let mut threads = self.threads.lock();
        while threads.len() < self.size {
            let q = self.q.clone();
            let Ok(h) = std::thread::Builder::new().name("gixl-copy".into()).spawn(move || worker(q)) else { break };
            threads.push(h);
        }
        !threads.is_empty()
    }

    /// Finish queued tasks, then stop the threads.
    pub fn shutdown(&self) {
        let (m, cv) = &*self.q;
        m.lock().stop = true;
        cv.notify_all();
        let me = std::thread::current().id();
        for h in self.threads.lock().drain(..) {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
    }
}

fn worker(q: Arc<(Mutex<Queue>, Condvar)>) {
    let (m, cv) = &*q;
    loop {
        let mut g = m.lock();
        while g.tasks.is_empty() && !g.stop {
            cv.wait(&mut g);
        }
        let Some(task) = g.tasks.pop_front() else { return };
        drop(g);
        // A task that panics must not take the thread (and the tasks queued behind it) down with it; the
        // engine's tasks record their own panics on their request.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task));
    }
}

/// Page-locked staging buffers of one size, kept for reuse (making one costs milliseconds): at most `lend` out
/// at once (a taker finding none gets None and waits its turn), at most `keep` kept; a request for a device
/// none of the kept ones belong to drops one of them first when `keep` exist. The engine has two: one shared
/// by the requests that stage VRAM (`vram`, `route::tcp::vram`) and one per TCP serving loop (`route::tcp::serve`).
pub(crate) struct Pinned {
    size: usize,
    keep: usize,
    lend: usize,
    free: Vec<PinnedBuf>,
    /// Buffers out with a request.
    out: usize,
}

/// A staging buffer and the device it was made for.
pub(crate) struct PinnedBuf {
    pub(crate) dev: u32,
    pub(crate) buf: Box<dyn HostBuf>,
}

impl Pinned {
    pub(crate) const fn new(size: usize, keep: usize, lend: usize) -> Pinned {
        Pinned { size, keep, lend, free: Vec::new(), out: 0 }
    }

    /// Would `take` give a buffer now?
    pub(crate) fn can_take(&self) -> bool {
        !self.free.is_empty() || self.out < self.lend
    }

    /// A buffer for device `dev` (kept, or made by `device`), or None when `lend` are out.
    pub(crate) fn take(&mut self, device: &dyn Device, dev: u32) -> Result<Option<PinnedBuf>> {
        if let Some(i) = self.free.iter().position(|b| b.dev == dev) {
            self.out += 1;
            return Ok(Some(self.free.swap_remove(i)));
        }
        if self.out >= self.lend {
            return Ok(None);
        }
        if self.out + self.free.len() >= self.keep {
            self.free.pop();
        }
        let buf = device.host_buf(dev, self.size)?;
        self.out += 1;
        Ok(Some(PinnedBuf { dev, buf }))
    }

    /// Give a buffer back: kept while fewer than `keep` are.
    pub(crate) fn put(&mut self, b: PinnedBuf) {
        self.out = self.out.saturating_sub(1);
        if self.free.len() < self.keep {
            self.free.push(b);
        }
    }
}
