//! What both I/O queues share: the I/O list of a request, the state of one post of it, and how a failed
//! I/O is described.
//!
//! A request's I/O list is built once at prep and never changes; each post gets a fresh `Run` that the queue
//! fills in. A run leaves `InProg` only when no I/O of it is still in the kernel or on a worker, so whoever
//! sees it finished (or aborted) may free or reuse the buffers.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use crate::status::{Error, Status};

/// One I/O: `len` bytes between memory at `buf` and file `fd` at offset `off`. `len` is at most
/// [`MAX_IO`] and never 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Op {
    pub fd: RawFd,
    pub buf: u64,
    pub off: u64,
    pub len: u32,
    /// The file is open with `O_DIRECT` (for error messages).
    pub direct: bool,
}

/// Segments are cut into I/Os of at most this many bytes: it fits io_uring's 32-bit length, keeps every
/// piece aligned for `O_DIRECT`, and gives the worker threads pieces to share.
pub(crate) const MAX_IO: u64 = 4 << 20;

/// A prepared request: its I/Os in order, and their direction.
#[derive(Debug)]
pub(crate) struct Work {
    /// File → memory (NIXL READ) when true, memory → file (WRITE) when false.
    pub read: bool,
    pub ops: Vec<Op>,
}

/// Why one I/O failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IoFail {
    /// The OS refused it (a positive errno).
    Os(i32),
    /// A read found the end of the file before the end of the requested range.
    Eof,
    /// A write moved no bytes and reported no error.
    NoProgress,
}

/// A failure kept for `status()`, which may be called any number of times.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub status: Status,
    pub msg: String,
    pub errno: Option<i32>,
}

impl Failure {
    /// Describe I/O `op` failing after `done` of its bytes moved.
    pub fn io(read: bool, op: &Op, done: u64, why: IoFail) -> Failure {
        let what = format!(
            "POSIX {} of {} bytes at file offset {} of fd {}",
            if read { "read" } else { "write" },
            op.len,
            op.off,
            op.fd
        );
        let detail = match why {
            IoFail::Eof => {
                format!("short read: the file ends at offset {} ({done} of the {} bytes exist)", op.off + done, op.len)
            }
            IoFail::NoProgress => format!("the write stopped after {done} bytes without an error"),
            IoFail::Os(e) => {
                let hint = match e {
                    libc::EBADF => " (was the file descriptor closed, or opened without the needed access?)",
                    libc::EINVAL if op.direct => {
                        " (the file is open with O_DIRECT, which needs aligned buffers, offsets and lengths)"
                    }
                    _ => "",
                };
                let after = if done > 0 { format!(" after {done} bytes") } else { String::new() };
                // The OS error text itself is appended by `Error::os`.
                return Failure { status: Status::Backend, msg: format!("{what} failed{after}{hint}"), errno: Some(e) };
            }
        };
        Failure { status: Status::Backend, msg: format!("{what}: {detail}"), errno: None }
    }

    pub fn to_error(&self) -> Error {
        match self.errno {
            Some(e) => Error::os(self.status, self.msg.clone(), std::io::Error::from_raw_os_error(e)),
            None => Error::new(self.status, self.msg.clone()),
        }
    }
}

/// One post of a request. The queue owns the I/O; `PosixXfer` reads the outcome.
pub(crate) struct Run {
    pub work: Arc<Work>,
    /// Units of work not finished yet (I/Os for io_uring, helper tasks for the thread pool).
    pending: AtomicUsize,
    /// Next I/O to claim (thread pool only).
    pub next: AtomicUsize,
    /// Set on abort or the first failure: start nothing new.
    stop: AtomicBool,
    aborted: AtomicBool,
    state: AtomicI32,
    failure: Mutex<Option<Failure>>,
    done_at: Mutex<Option<Instant>>,
    idle: Condvar,
    idle_lock: Mutex<()>,
}

impl Run {
    pub fn new(work: Arc<Work>, units: usize) -> Arc<Run> {
        let run = Arc::new(Run {
            work,
            pending: AtomicUsize::new(units),
            next: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            state: AtomicI32::new(Status::InProg as i32),
            failure: Mutex::new(None),
            done_at: Mutex::new(None),
            idle: Condvar::new(),
            idle_lock: Mutex::new(()),
        });
        if units == 0 {
            run.finish();
        }
        run
    }

    pub fn state(&self) -> Status {
        Status::from_i32(self.state.load(Ordering::Acquire)).unwrap_or(Status::Unknown)
    }

    /// The error that ended this run; only meaningful once `state()` is an error.
    pub fn error(&self) -> Error {
        match &*self.failure.lock() {
            Some(f) => f.to_error(),
            None if self.aborted.load(Ordering::Acquire) => Error::new(Status::Canceled, "the transfer was aborted"),
            None => Error::new(self.state(), "the transfer failed"),
        }
    }

    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    pub fn done_at(&self) -> Option<Instant> {
        *self.done_at.lock()
    }

    /// Record a failure (the first one wins) and stop starting new I/O.
    pub fn fail(&self, f: Failure) {
        let mut cur = self.failure.lock();
        if cur.is_none() {
            *cur = Some(f);
        }
        self.stop.store(true, Ordering::Release);
    }

    /// `n` units are finished; the last one publishes the outcome.
    pub fn done(&self, n: usize) {
        if n > 0 && self.pending.fetch_sub(n, Ordering::AcqRel) == n {
            self.finish();
        }
    }

    fn finish(&self) {
        *self.done_at.lock() = Some(Instant::now());
        let st = match &*self.failure.lock() {
            Some(f) => f.status,
            None if self.aborted.load(Ordering::Acquire) => Status::Canceled,
            None => Status::Success,
        };
        let _g = self.idle_lock.lock();
        self.state.store(st as i32, Ordering::Release);
        self.idle.notify_all();
    }

    /// Ask the queue to start nothing more of this run.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        self.stop.store(true, Ordering::Release);
    }

    /// Block until no I/O of this run is in flight.
    pub fn wait(&self) {
        let mut g = self.idle_lock.lock();
        while self.state.load(Ordering::Acquire) == Status::InProg as i32 {
            self.idle.wait(&mut g);
        }
    }

    /// `wait`, for at most `limit`; false when I/O of this run was still in flight then.
    pub fn wait_for(&self, limit: std::time::Duration) -> bool {
        let until = Instant::now() + limit;
        let mut g = self.idle_lock.lock();
        while self.state.load(Ordering::Acquire) == Status::InProg as i32 {
            if self.idle.wait_until(&mut g, until).timed_out() {
                return self.state.load(Ordering::Acquire) != Status::InProg as i32;
            }
        }
        true
    }
}

/// Move all of `op` with plain `pread`/`pwrite`, retrying short transfers and `EINTR`. Gives up between
/// pieces once `stop` is set (the run has failed or was aborted).
///
/// # Safety
/// `op.buf .. op.buf + op.len` must be memory this process may write (read) and that nobody else uses
/// while the call runs.
pub(crate) unsafe fn blocking_io(read: bool, op: &Op, stop: impl Fn() -> bool) -> Result<(), Failure> {
    let len = op.len as u64;
    let mut done = 0u64;
    while done < len {
        if stop() {
            return Ok(());
        }
        let buf = (op.buf + done) as *mut libc::c_void;
        let n = (len - done) as usize;
        let off = (op.off + done) as libc::off_t;
        // SAFETY: the caller vouches for the buffer; `n` stays inside it.
        let r = unsafe {
            if read {
                libc::pread(op.fd, buf, n, off)
            } else {
                libc::pwrite(op.fd, buf as *const libc::c_void, n, off)
            }
        };
        if r < 0 {
            let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
            if e == libc::EINTR {
                continue;
            }
            return Err(Failure::io(read, op, done, IoFail::Os(e)));
        }
        if r == 0 {
            return Err(Failure::io(read, op, done, if read { IoFail::Eof } else { IoFail::NoProgress }));
        }
        done += r as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op() -> Op {
        Op { fd: 7, buf: 0x1000, off: 4096, len: 8192, direct: true }
    }

    #[test]
    fn failures_say_what_and_where() {
        let f = Failure::io(true, &op(), 100, IoFail::Eof);
        assert_eq!(f.status, Status::Backend);
        assert!(f.msg.contains("read of 8192 bytes at file offset 4096 of fd 7"), "{}", f.msg);
        assert!(f.msg.contains("short read") && f.msg.contains("4196"), "{}", f.msg);
        let e = Failure::io(false, &op(), 0, IoFail::Os(libc::EINVAL)).to_error();
        assert!(e.message().contains("O_DIRECT") && e.message().ends_with("Invalid argument (os error 22)"), "{e}");
        assert_eq!(e.status(), Status::Backend);
        assert!(std::error::Error::source(&e).is_some());
        let e = Failure::io(false, &op(), 512, IoFail::Os(libc::ENOSPC)).to_error();
        assert!(e.message().contains("after 512 bytes") && e.message().contains("No space left"), "{e}");
    }

    #[test]
    fn run_finishes_once_all_units_are_done() {
        let w = Arc::new(Work { read: true, ops: vec![] });
        let r = Run::new(w.clone(), 0);
        assert_eq!(r.state(), Status::Success);
        let r = Run::new(w.clone(), 3);
        r.done(2);
        assert_eq!(r.state(), Status::InProg);
        r.fail(Failure::io(true, &op(), 0, IoFail::Eof));
        assert!(r.stopping());
        assert_eq!(r.state(), Status::InProg, "a failure is published only when no I/O is left");
        r.done(1);
        assert_eq!(r.state(), Status::Backend);
        assert!(r.error().message().contains("short read"));
        r.wait();
        let r = Run::new(w, 1);
        r.abort();
        r.done(1);
        assert_eq!(r.state(), Status::Canceled);
        assert!(r.done_at().is_some());
    }
}
