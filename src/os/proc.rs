//! Process identity: a pidfd for a pid (bound to the process it names now), whether that process still runs,
//! and a descriptor taken from it.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

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
