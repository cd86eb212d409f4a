//! What gixl asks of the Linux kernel beyond `std`, in one place for the engine, the metadata exchange and the
//! storage backends: process identity through pidfds (open one for a pid, ask whether its process still runs,
//! take a descriptor from it), and the epoll sets and eventfds their event loops wait on.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::status::{Error, Result, Status};

/// `pidfd_open(2)`: a descriptor that stays bound to the process `pid` names now.
pub(crate) fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `pidfd_getfd(2)`: a duplicate of descriptor `fd` of the process behind `pidfd`.
pub(crate) fn pidfd_getfd(pidfd: BorrowedFd<'_>, fd: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall; the result is checked.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
}

/// Is the process behind `pidfd` still running? (A pidfd polls readable once it has exited.) Only measured now.
pub(crate) fn pidfd_alive(pidfd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    unsafe { libc::poll(&mut p, 1, 0) == 0 }
}

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
