//! The event loops' reactor (`Reactor`: an epoll set, its wake-up line, tokens handed out by tag) and the
//! epoll sets and eventfds it is made of, for loops that need only those.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::status::{Error, Result, Status};

/// A new epoll set (close-on-exec).
pub(crate) fn epoll() -> Result<OwnedFd> {
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if fd < 0 {
        return Err(Error::os(Status::Backend, "epoll_create1", io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A new eventfd (close-on-exec; non-blocking unless `blocking`): one loop's wake-up line.
pub(crate) fn eventfd(blocking: bool) -> Result<OwnedFd> {
    let flags = if blocking { libc::EFD_CLOEXEC } else { libc::EFD_CLOEXEC | libc::EFD_NONBLOCK };
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::eventfd(0, flags) };
    if fd < 0 {
        return Err(Error::os(Status::Backend, "eventfd", io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Wake whoever waits on the eventfd `fd`. It cannot block short of 2^64 - 1 pending wakes; a failure (the
/// descriptor gone) leaves nothing to do.
pub(crate) fn wake(fd: &impl AsFd) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a live u64 to the eventfd.
    unsafe { libc::write(fd.as_fd().as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Reset the eventfd `fd` (non-blocking) after a wake-up.
pub(crate) fn woken(fd: &impl AsFd) {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes from the eventfd into a live u64.
    unsafe { libc::read(fd.as_fd().as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
}

/// One event loop's epoll set and its wake-up line (an eventfd). Handlers take their tokens from it by tag
/// (`tokens`), register their descriptors under them, and the loop asks each handler whether a token that
/// fired is its own (`Tokens::owns`): no module hard-codes another's tokens.
pub(crate) struct Reactor {
    epfd: OwnedFd,
    wake: OwnedFd,
    tags: AtomicU64,
}

/// A handler's tokens: its tag in the high 16 bits, its own numbering in the low 48.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tokens(u64);

const TAG_SHIFT: u32 = 48;

impl Tokens {
    pub(crate) fn token(self, n: u64) -> u64 {
        (self.0 << TAG_SHIFT) | (n & ((1 << TAG_SHIFT) - 1))
    }
    pub(crate) fn owns(self, token: u64) -> bool {
        token >> TAG_SHIFT == self.0
    }
    /// The handler's own number of `token`.
    pub(crate) fn index(token: u64) -> u64 {
        token & ((1 << TAG_SHIFT) - 1)
    }
}

impl Reactor {
    /// The wake-up line's token, as `wait` reports it (after resetting the line).
    pub(crate) const WAKE: u64 = u64::MAX;

    pub(crate) fn new() -> Result<Reactor> {
        let (epfd, wake) = (epoll()?, eventfd(false)?);
        crate::util::epoll_ctl(
            epfd.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            wake.as_raw_fd(),
            libc::EPOLLIN as u32,
            Self::WAKE,
        )?;
        Ok(Reactor { epfd, wake, tags: AtomicU64::new(0) })
    }

    /// A tag of its own for one handler.
    pub(crate) fn tokens(&self) -> Tokens {
        Tokens(self.tags.fetch_add(1, Ordering::Relaxed))
    }

    /// Watch `fd` for `events`, reported as `token`.
    pub(crate) fn add(&self, fd: RawFd, token: u64, events: u32) -> Result<()> {
        crate::util::epoll_ctl(self.epfd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, events, token)
    }

    /// `add` for readable input and hang-ups, the loops' usual interest.
    pub(crate) fn add_input(&self, fd: RawFd, token: u64) -> Result<()> {
        self.add(fd, token, (libc::EPOLLIN | libc::EPOLLRDHUP) as u32)
    }

    pub(crate) fn modify(&self, fd: RawFd, token: u64, events: u32) -> Result<()> {
        crate::util::epoll_ctl(self.epfd.as_raw_fd(), libc::EPOLL_CTL_MOD, fd, events, token)
    }

    /// Stop watching `fd` (before it is closed); one not watched is no error.
    pub(crate) fn remove(&self, fd: RawFd) {
        crate::util::epoll_del(self.epfd.as_raw_fd(), fd);
    }

    /// Wake the loop out of `wait`.
    pub(crate) fn wake(&self) {
        wake(&self.wake);
    }

    /// Wait up to `timeout_ms` (-1: until something happens, 0: only look) and put what fired in `ready` as
    /// (token, epoll flags); the wake-up line comes as `WAKE`, already reset. An interrupted wait returns with
    /// nothing; false when the set itself failed (the loop should end).
    pub(crate) fn wait(&self, timeout_ms: i32, ready: &mut Vec<(u64, u32)>) -> bool {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        ready.clear();
        // SAFETY: `events` has room for its length.
        let n =
            unsafe { libc::epoll_wait(self.epfd.as_raw_fd(), events.as_mut_ptr(), events.len() as i32, timeout_ms) };
        if n < 0 {
            return io::Error::last_os_error().kind() == io::ErrorKind::Interrupted;
        }
        for e in &events[..n as usize] {
            if e.u64 == Self::WAKE {
                woken(&self.wake);
            }
            ready.push((e.u64, e.events));
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_by_tag_and_wake_ups() {
        let r = Reactor::new().unwrap();
        let (a, b) = (r.tokens(), r.tokens());
        assert!(a.owns(a.token(7)) && !b.owns(a.token(7)) && !a.owns(Reactor::WAKE) && !b.owns(Reactor::WAKE));
        assert_eq!(Tokens::index(b.token(1 << 40)), 1 << 40);
        let (x, y) = std::os::unix::net::UnixStream::pair().unwrap();
        r.add_input(x.as_raw_fd(), b.token(3)).unwrap();
        let mut ready = Vec::new();
        assert!(r.wait(0, &mut ready) && ready.is_empty());
        r.wake();
        std::io::Write::write_all(&mut &y, b"x").unwrap();
        assert!(r.wait(1000, &mut ready));
        let mut got: Vec<u64> = ready.iter().map(|e| e.0).collect();
        got.sort_unstable();
        assert_eq!(got, [b.token(3), Reactor::WAKE]);
        // The wake-up line was reset; the socket stays readable (level-triggered) until removed.
        r.remove(x.as_raw_fd());
        assert!(r.wait(0, &mut ready) && ready.is_empty());
    }
}
