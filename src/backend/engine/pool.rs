//! A small pool of copy threads. Threads start on first use and sleep on a condition variable when idle.

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

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

    /// Run `t` on a pool thread (inline once the pool has been shut down, so it still runs).
    pub fn submit(&self, t: Task) {
        if self.q.0.lock().stop {
            t();
            return;
        }
        {
            let mut threads = self.threads.lock();
            while threads.len() < self.size {
                let q = self.q.clone();
                match std::thread::Builder::new().name("gixl-copy".into()).spawn(move || worker(q)) {
                    Ok(h) => threads.push(h),
                    Err(_) => break,
                }
            }
            if threads.is_empty() {
                drop(threads);
                t();
                return;
            }
        }
        let (m, cv) = &*self.q;
        m.lock().tasks.push_back(t);
        cv.notify_one();
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
        let task = {
            let mut g = m.lock();
            loop {
                if let Some(t) = g.tasks.pop_front() {
                    break t;
                }
                if g.stop {
                    return;
                }
                cv.wait(&mut g);
            }
        };
        // A task that panics must not take the thread (and the tasks queued behind it) down with it; the
        // engine's tasks record their own panics on their request.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task));
    }
}
