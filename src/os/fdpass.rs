//! Unix sockets' extras: who is at the other end (`SO_PEERCRED`) and descriptors carried with the bytes
//! (`SCM_RIGHTS`).

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// The credentials (pid, uid, gid) of the process at the other end of the Unix socket `fd`, as the kernel
/// recorded them when it connected.
pub(crate) fn peer_cred(fd: RawFd) -> Option<libc::ucred> {
    let mut c = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `c` is a ucred of `len` bytes; `fd` is an open socket.
    let r = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut c as *mut libc::ucred).cast(), &mut len)
    };
    (r == 0).then_some(c)
}

/// Send `bytes` on the Unix socket `sock` with descriptor `fd` attached, without blocking (and without
/// SIGPIPE). Returns the bytes sent, as `sendmsg` does.
pub(crate) fn send_with_fd(sock: RawFd, bytes: &mut [u8], fd: RawFd) -> io::Result<usize> {
    let mut iov = libc::iovec { iov_base: bytes.as_mut_ptr().cast(), iov_len: bytes.len() };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: zeroed msghdr is valid; fields set below point at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds one cmsg of CMSG_SPACE(sizeof fd) bytes, aligned for cmsghdr.
    unsafe {
        let cm = libc::CMSG_FIRSTHDR(&msg);
        (*cm).cmsg_level = libc::SOL_SOCKET;
        (*cm).cmsg_type = libc::SCM_RIGHTS;
        (*cm).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cm) as *mut RawFd, fd);
    }
    // SAFETY: `msg` describes `bytes` and `cbuf`, both live for the call.
    unsafe { super::sock::sendmsg_dontwait(sock, &msg) }
}

/// Receive into `buf` from the Unix socket `sock` (blocking as the socket is set), taking ownership of every
/// descriptor that came with the bytes (close-on-exec): the first is kept in `got` if it holds none, the
/// others are closed. Returns the bytes received (0: end of stream); an interrupted call returns `Interrupted`.
pub(crate) fn recv_with_fds(sock: RawFd, buf: &mut [u8], got: &mut Option<OwnedFd>) -> io::Result<usize> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut cbuf = [0u64; 16];
    // SAFETY: zeroed msghdr is valid; fields set below point at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    // SAFETY: as above; received descriptors are close-on-exec.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: walking the control messages the kernel wrote into `cbuf`.
    unsafe {
        let mut cm = libc::CMSG_FIRSTHDR(&msg);
        while !cm.is_null() {
            if (*cm).cmsg_level == libc::SOL_SOCKET && (*cm).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cm);
                let count = ((*cm).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let f = OwnedFd::from_raw_fd(std::ptr::read_unaligned((data as *const RawFd).add(i)));
                    if got.is_none() {
                        *got = Some(f);
                    }
                }
            }
            cm = libc::CMSG_NXTHDR(&msg, cm);
        }
    }
    Ok(n as usize)
}
