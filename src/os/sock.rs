//! Socket helpers beyond `std::net` (for the engine's TCP route and control socket): vectored I/O straight
//! between a socket and raw memory (so no staging copy), `MSG_NOSIGNAL` everywhere (a library must not die of
//! SIGPIPE inside a host process that left the default handler), non-blocking single calls, keepalive, and
//! the host's interface addresses; and adding to / removing from an epoll set. No policy lives here.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

/// Add `fd` to the epoll set `epfd`, for input and peer hang-up, reported with `token`.
pub fn epoll_add(epfd: RawFd, fd: RawFd, token: u64) -> crate::status::Result<()> {
    crate::util::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, (libc::EPOLLIN | libc::EPOLLRDHUP) as u32, token)
}

pub(crate) use crate::util::{epoll_del, recv_now, send_now};

/// Most iovecs one `sendmsg`/`readv` takes (the kernel's UIO_MAXIOV).
const IOV_MAX: usize = 1024;

/// What a blocking transfer on a socket tells its owner, and asks it when the socket's timeout passes.
pub trait Watch {
    /// Bytes moved.
    fn progress(&self) {}
    /// The socket's timeout passed with nothing moved: true to wait again (the owner knows the peer is alive
    /// and only slow), false to fail with the timeout.
    fn patient(&self) -> bool {
        false
    }
}

/// A watch that counts nothing and never waits past the socket's timeout.
pub struct Impatient;

impl Watch for Impatient {}

/// The socket's own timeout (`SO_RCVTIMEO`/`SO_SNDTIMEO`) passed with nothing moved.
fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

pub fn iovec(addr: u64, len: u64) -> libc::iovec {
    libc::iovec { iov_base: addr as usize as *mut libc::c_void, iov_len: len as usize }
}

/// Send every byte `iov` describes, resuming after partial sends. `w.progress()` runs after each call that
/// moved bytes, `w.patient()` when the socket's timeout passes. `iov` is consumed (advanced) in place.
///
/// # Safety
/// Every iovec must describe memory readable for the duration of the call.
pub unsafe fn send_iovecs(fd: RawFd, iov: &mut [libc::iovec], w: &dyn Watch) -> io::Result<()> {
    let mut i = skip_empty(iov, 0);
    while i < iov.len() {
        let n = (iov.len() - i).min(IOV_MAX);
        // SAFETY: an all-zero msghdr is a valid "no name, no control data" header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov[i..].as_mut_ptr();
        msg.msg_iovlen = n as _;
        // SAFETY: `msg` points at `n` valid iovecs; the caller guarantees the memory they describe.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted || (timed_out(&e) && w.patient()) {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        w.progress();
        i = advance(iov, i, r as usize);
    }
    Ok(())
}

/// Fill every byte `iov` describes from the socket; end of stream before that is `UnexpectedEof`. `w` as
/// for `send_iovecs`.
///
/// # Safety
/// Every iovec must describe memory writable for the duration of the call and not otherwise in use.
pub unsafe fn recv_iovecs(fd: RawFd, iov: &mut [libc::iovec], w: &dyn Watch) -> io::Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { recv_each(fd, iov, w, |_| {}) }
}

/// The loop of `recv_iovecs`, calling `read(n)` after each read of `n` bytes.
///
/// # Safety
/// As `recv_iovecs`.
unsafe fn recv_each(fd: RawFd, iov: &mut [libc::iovec], w: &dyn Watch, mut read: impl FnMut(usize)) -> io::Result<()> {
    let mut i = skip_empty(iov, 0);
    while i < iov.len() {
        let n = (iov.len() - i).min(IOV_MAX);
        // SAFETY: `n` valid iovecs; the caller guarantees the memory is writable.
        let r = unsafe { libc::readv(fd, iov[i..].as_ptr(), n as i32) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted || (timed_out(&e) && w.patient()) {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        w.progress();
        i = advance(iov, i, r as usize);
        read(r as usize);
    }
    Ok(())
}

/// Bytes a large read waits for before its thread is woken (`recv_iovecs_marked`). Measured over a veth link on
/// 2 cores, 64 MiB READ in 20 alternating rounds: 256 and 512 KiB each 6 points of the raw program's rate above
/// a mark of 1 byte (89 % against 83 %), 1 MiB no better than 1 byte.
pub const RECV_MARK: usize = 256 << 10;

/// `recv_iovecs` for a large payload: the socket's receive low-water mark (`SO_RCVLOWAT`) is raised to `RECV_MARK`
/// while at least two marks are still to come, so the thread is woken once per `RECV_MARK` that arrived, not for
/// every packet (a wake-up costs a core as much as copying tens of KiB); the mark is back at 1 for the last two,
/// and when this returns.
///
/// Why two: the kernel wakes a sleeping reader when a mark's worth has arrived since it last read, whatever its
/// call still lacks. A read that copied `x < RECV_MARK` bytes already there and sleeps for the rest wakes only
/// once `RECV_MARK` more have come, so at least that much must still be on its way: `left - x > RECV_MARK` when
/// `left >= 2 * RECV_MARK`. (With the mark kept down to the last one, a 64 MiB READ waited out the socket's
/// 5 s timeout three times in about 3,500 pieces.) And the mark is raised only while the receive buffer holds
/// four marks or more: the kernel then leaves the window alone (it clamps the window to the mark when the buffer
/// must grow for it), so the sender can always send the mark the reader waits for.
///
/// # Safety
/// As `recv_iovecs`.
pub unsafe fn recv_iovecs_marked(fd: RawFd, iov: &mut [libc::iovec], w: &dyn Watch) -> io::Result<()> {
    let left: usize = iov.iter().map(|v| v.iov_len).sum();
    if left <= 2 * RECV_MARK || rcvbuf(fd) < 4 * RECV_MARK || !set_rcvlowat(fd, RECV_MARK) {
        // SAFETY: the caller's guarantee.
        return unsafe { recv_iovecs(fd, iov, w) };
    }
    let (mut left, mut marked) = (left, true);
    // SAFETY: the caller's guarantee.
    let r = unsafe {
        recv_each(fd, iov, w, |n| {
            left -= n;
            // Fewer than two marks to come: the mark goes (see above). And a read returns at least the mark
            // unless it timed out (or was given fewer bytes by `IOV_MAX`): the mark goes too, so a wake-up the
            // kernel did not give costs one timeout, never one per read.
            if marked && (left < 2 * RECV_MARK || n < RECV_MARK) {
                marked = !set_rcvlowat(fd, 1);
            }
        })
    };
    if marked {
        set_rcvlowat(fd, 1);
    }
    r
}

/// The socket's receive buffer in bytes (0 if it cannot be read).
fn rcvbuf(fd: RawFd) -> usize {
    get_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUF).map_or(0, |v| v.max(0) as usize)
}

/// Set the socket's receive low-water mark; false if it could not be.
fn set_rcvlowat(fd: RawFd, bytes: usize) -> bool {
    set_int(fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, bytes.min(i32::MAX as usize) as i32)
}

/// Set an int socket option; false if the kernel refused it.
pub(crate) fn set_int(fd: RawFd, level: i32, opt: i32, v: i32) -> bool {
    // SAFETY: an int option, passed with its size, on a descriptor the caller owns (an invalid one is EBADF).
    unsafe { libc::setsockopt(fd, level, opt, (&v as *const i32).cast(), std::mem::size_of::<i32>() as u32) == 0 }
}

/// Read an int socket option; None if it cannot be read.
fn get_int(fd: RawFd, level: i32, opt: i32) -> Option<i32> {
    let mut v: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: the option is written into a local int whose size is passed.
    let r = unsafe { libc::getsockopt(fd, level, opt, (&mut v as *mut i32).cast(), &mut len) };
    (r == 0).then_some(v)
}

/// Drop `n` bytes from the front of `iov[i..]`; returns the new first non-empty index.
pub fn advance(iov: &mut [libc::iovec], mut i: usize, mut n: usize) -> usize {
    while n > 0 && i < iov.len() {
        let l = iov[i].iov_len;
        if n >= l {
            n -= l;
            i += 1;
        } else {
            iov[i].iov_base = (iov[i].iov_base as usize + n) as *mut libc::c_void;
            iov[i].iov_len -= n;
            n = 0;
        }
    }
    skip_empty(iov, i)
}

pub fn skip_empty(iov: &[libc::iovec], mut i: usize) -> usize {
    while i < iov.len() && iov[i].iov_len == 0 {
        i += 1;
    }
    i
}

/// `f` on the iovecs from `at` cut to at most `max` bytes (the last one shortened for the call, then restored).
/// `max` must not be 0 (a call on no bytes would read as an end of stream).
pub fn capped<R>(iov: &mut [libc::iovec], at: usize, max: usize, f: impl FnOnce(&[libc::iovec]) -> R) -> R {
    let (mut end, mut left) = (at, max);
    while end < iov.len() && left > iov[end].iov_len {
        left -= iov[end].iov_len;
        end += 1;
    }
    if end == iov.len() {
        return f(&iov[at..]);
    }
    let full = std::mem::replace(&mut iov[end].iov_len, left);
    let r = f(&iov[at..=end]);
    iov[end].iov_len = full;
    r
}

/// One non-blocking `readv` into `iov` (at most `IOV_MAX` of them): Ok(0) is end of stream, WouldBlock
/// when nothing is there.
///
/// # Safety
/// Every iovec must describe memory writable for the duration of the call and not otherwise in use.
pub unsafe fn readv_now(fd: RawFd, iov: &[libc::iovec]) -> io::Result<usize> {
    let n = iov.len().min(IOV_MAX);
    // SAFETY: an all-zero msghdr is a valid "no name, no control data" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = n as _;
    loop {
        // SAFETY: `n` valid iovecs; the caller guarantees the memory is writable.
        let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// One non-blocking `sendmsg` of `iov` (at most `IOV_MAX` of them): bytes sent, WouldBlock when none
/// could be.
///
/// # Safety
/// Every iovec must describe memory readable for the duration of the call.
pub unsafe fn sendmsg_now(fd: RawFd, iov: &[libc::iovec]) -> io::Result<usize> {
    let n = iov.len().min(IOV_MAX);
    // SAFETY: an all-zero msghdr is a valid "no name, no control data" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = n as _;
    // SAFETY: `n` valid iovecs; the caller guarantees the memory is readable.
    unsafe { sendmsg_dontwait(fd, &msg) }
}

/// One `sendmsg` of `msg`, without blocking or SIGPIPE, again if a signal interrupted it: bytes sent.
///
/// # Safety
/// `msg` must describe live buffers (iovecs readable, control data valid) for the duration of the call.
pub(crate) unsafe fn sendmsg_dontwait(fd: RawFd, msg: &libc::msghdr) -> io::Result<usize> {
    loop {
        // SAFETY: the caller guarantees `msg`.
        let r = unsafe { libc::sendmsg(fd, msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Send all of `buf` (blocking, with the socket's timeout), without SIGPIPE.
pub fn send_all(s: &TcpStream, buf: &[u8], w: &dyn Watch) -> io::Result<()> {
    let mut v = [iovec(buf.as_ptr() as u64, buf.len() as u64)];
    // SAFETY: `buf` is a live slice for the whole call.
    unsafe { send_iovecs(s.as_raw_fd(), &mut v, w) }
}

/// Fill `buf` from the socket (blocking, with the socket's timeout).
pub fn recv_exact(s: &TcpStream, buf: &mut [u8], w: &dyn Watch) -> io::Result<()> {
    let mut v = [iovec(buf.as_mut_ptr() as u64, buf.len() as u64)];
    // SAFETY: `buf` is a live, exclusively borrowed slice for the whole call.
    unsafe { recv_iovecs(s.as_raw_fd(), &mut v, w) }
}

/// Are bytes waiting to be read (or an end of stream)? Only looks, never waits.
pub fn readable(fd: RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & libc::POLLIN != 0
}

/// How long a thread that expects bytes within a round trip looks for them before it sleeps: the wake-up of a
/// sleeping thread is most of a round trip on a VM whose cores halt when idle.
pub const LOOK_NS: u64 = 50_000;

/// Look for bytes to read (or an end of stream) for up to `LOOK_NS`, without sleeping; the caller's read then
/// blocks as usual if none came.
///
/// Each look yields the core (`sched_yield`, about a microsecond when nothing else is runnable). The thread that
/// will answer may be queued on this very core: the kernel wakes a socket's reader on its writer's core, expecting
/// the writer to sleep, and a look that only spun held it off for the whole `LOOK_NS`, on both sides of a round
/// trip (a 4 KiB READ over the TCP route between two network namespaces took 110 µs in every such run instead
/// of 16).
pub fn look_readable(fd: RawFd) {
    let t = crate::util::monotonic_ns();
    while !readable(fd) && crate::util::monotonic_ns() - t < LOOK_NS {
        std::thread::yield_now();
    }
}

/// Has the connection been shut down (by either side) or failed? Only looks, never waits.
pub fn hung_up(fd: RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLRDHUP | libc::POLLNVAL) != 0
}

/// TCP_NODELAY, kernel keepalive (so half-open connections are reaped eventually without any thread of
/// ours waking), and TCP_USER_TIMEOUT (unacknowledged data for longer than `user_timeout` kills the
/// connection, which bounds blocked sends when the link is cut).
pub fn tune(s: &TcpStream, user_timeout: Duration) {
    let _ = s.set_nodelay(true);
    let fd = s.as_raw_fd();
    // Failures are ignored (best effort).
    let set = |level: i32, opt: i32, v: i32| _ = set_int(fd, level, opt, v);
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 60);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, user_timeout.as_millis().clamp(1, i32::MAX as u128) as i32);
}

/// Set TCP_USER_TIMEOUT (zero: the kernel's default, no limit beyond retransmissions).
pub fn set_user_timeout(s: &TcpStream, t: Duration) {
    // Failure is harmless (best effort).
    set_int(s.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, t.as_millis().min(i32::MAX as u128) as i32);
}

/// Wait up to `ns` for room in `fd`'s send buffer (or an error on it). False on timeout.
pub fn wait_writable(fd: RawFd, ns: u64) -> bool {
    let deadline = crate::util::monotonic_ns() + ns;
    loop {
        let left = deadline.saturating_sub(crate::util::monotonic_ns());
        if left == 0 {
            return false;
        }
        let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
        let ms = left.div_ceil(1_000_000).min(i32::MAX as u64) as i32;
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r > 0 {
            return true;
        }
        if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return true;
        }
    }
}

/// Addresses of this host's interfaces that are up (IPv4, and IPv6 other than link-local).
pub fn interface_addrs() -> Vec<IpAddr> {
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `ifap` is a valid out-pointer; the list is freed below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut p = ifap;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as u32 == 0 {
            continue;
        }
        // SAFETY: `ifa_addr` is non-null and points at a sockaddr whose family says its real type.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: AF_INET addresses are sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: AF_INET6 addresses are sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                if ip.segments()[0] & 0xffc0 == 0xfe80 {
                    continue;
                }
                IpAddr::V6(ip)
            }
            _ => continue,
        };
        if !out.contains(&ip) {
            out.push(ip);
        }
    }
    // SAFETY: freeing the list getifaddrs allocated, once.
    unsafe { libc::freeifaddrs(ifap) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn advance_trims_and_skips() {
        let a = [0u8; 16];
        let base = a.as_ptr() as u64;
        let mut v = [iovec(base, 4), iovec(base, 0), iovec(base + 4, 6)];
        let i = advance(&mut v, 0, 5);
        assert_eq!(i, 2);
        assert_eq!(v[2].iov_len, 5);
        assert_eq!(v[2].iov_base as u64, base + 5);
        assert_eq!(advance(&mut v, i, 5), 3);
    }

    #[test]
    fn vectored_round_trip_over_a_socket_pair() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let src: Vec<Vec<u8>> = (0..3000).map(|i| vec![(i % 251) as u8; 100 + i % 7]).collect();
        let mut dst: Vec<Vec<u8>> = src.iter().map(|s| vec![0u8; s.len()]).collect();
        let mut diov: Vec<libc::iovec> = dst.iter_mut().map(|d| iovec(d.as_mut_ptr() as u64, d.len() as u64)).collect();
        let t = std::thread::spawn(move || {
            let mut siov: Vec<libc::iovec> = src.iter().map(|s| iovec(s.as_ptr() as u64, s.len() as u64)).collect();
            // SAFETY: `src` is moved into this thread and outlives the call.
            unsafe { send_iovecs(a.as_raw_fd(), &mut siov, &Impatient) }.unwrap();
            src
        });
        // SAFETY: `dst` is exclusively ours for the call.
        unsafe { recv_iovecs(b.as_raw_fd(), &mut diov, &Impatient) }.unwrap();
        assert_eq!(dst, t.join().unwrap());
    }

    /// A connected pair whose reading end has a receive buffer of four marks or more, so `recv_iovecs_marked`
    /// raises the mark (a fresh loopback socket's buffer starts smaller and grows only with traffic). The buffer is
    /// forced (root) or asked for within `net.core.rmem_max`; None, the test skipped and said so, where neither
    /// gives four marks.
    fn marked_pair() -> Option<(TcpStream, TcpStream)> {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
            set_int(b.as_raw_fd(), libc::SOL_SOCKET, opt, (4 * RECV_MARK) as i32);
            if rcvbuf(b.as_raw_fd()) >= 4 * RECV_MARK {
                return Some((a, b));
            }
        }
        crate::util::test_skip(
            "rcvbuf",
            "a receive buffer of four marks needs root (SO_RCVBUFFORCE) or net.core.rmem_max of 512 KiB or more",
        );
        None
    }

    /// Payloads around the boundaries of the mark (one, two and three marks, and odd sizes about them), sent in
    /// uneven bursts with pauses, arrive whole and without waiting out the read timeout: every wake-up the reader
    /// waits for comes. With the mark kept until the last `RECV_MARK` (not the last two), some of these wait out
    /// the 3 s timeout.
    #[test]
    fn a_marked_read_arrives_whole_and_never_waits_out_its_timeout() {
        let Some((a, b)) = marked_pair() else { return };
        b.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let m = RECV_MARK;
        let sizes = [2 * m + 1, 2 * m + m / 2, 3 * m - 7, 3 * m, 3 * m + 4096, 4 * m + 1000, 5 * m + m / 3, 9 * m + 13];
        let total: usize = sizes.iter().sum::<usize>() * 3;
        let t = std::thread::spawn(move || {
            let mut seed = 0x9e37_79b9_u64;
            let mut next = move |n: u64| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed % n
            };
            let data: Vec<u8> = (0..total).map(|i| (i % 253) as u8).collect();
            let mut at = 0;
            while at < total {
                let n = (1 + next(3 * m as u64) as usize).min(total - at);
                (&a).write_all(&data[at..at + n]).unwrap();
                at += n;
                std::thread::sleep(Duration::from_micros(next(3000)));
            }
            a
        });
        let mut got = 0usize;
        for _ in 0..3 {
            for &n in &sizes {
                let mut buf = vec![0u8; n];
                // Two iovecs, the second larger, as a request's segments.
                let (x, y) = buf.split_at_mut(n / 3);
                let mut iov =
                    [iovec(x.as_mut_ptr() as u64, x.len() as u64), iovec(y.as_mut_ptr() as u64, y.len() as u64)];
                let t0 = std::time::Instant::now();
                // SAFETY: `buf` is exclusively ours for the call.
                unsafe { recv_iovecs_marked(b.as_raw_fd(), &mut iov, &Impatient) }.unwrap();
                assert!(t0.elapsed() < Duration::from_secs(2), "a read of {n} bytes waited {:?}", t0.elapsed());
                assert!(buf.iter().enumerate().all(|(i, &c)| c == ((got + i) % 253) as u8), "bytes of {n} misplaced");
                got += n;
            }
        }
        drop(t.join().unwrap());
        // The mark is down again: a single byte wakes the reader.
        assert_eq!(get_int(b.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVLOWAT), Some(1));
    }

    /// The case the rule of two marks is for: a read that finds part of its mark already there and sleeps for
    /// the rest while less than a mark is still to come. Segments of `RECV_MARK / IOV_MAX` bytes make each call
    /// ask for exactly one mark; 25/16 marks are there before the first call, 15/16 come 50 ms later. The first
    /// call takes one mark and leaves 9/16 waiting; were the mark still up for the second call, it would sleep for
    /// 7/16 more and be woken only after a whole mark (which never comes): it would wait out the 3 s timeout.
    #[test]
    fn a_marked_read_is_woken_when_less_than_a_mark_is_still_to_come() {
        let Some((a, b)) = marked_pair() else { return };
        b.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let (m, seg) = (RECV_MARK, RECV_MARK / IOV_MAX);
        let (n, first) = (m * 5 / 2, m * 25 / 16);
        let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        (&a).write_all(&data[..first]).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            (&a).write_all(&data[first..]).unwrap();
            a
        });
        let mut buf = vec![0u8; n];
        let mut iov: Vec<libc::iovec> =
            buf.chunks_mut(seg).map(|c| iovec(c.as_mut_ptr() as u64, c.len() as u64)).collect();
        let t0 = std::time::Instant::now();
        // SAFETY: `buf` is exclusively ours for the call.
        unsafe { recv_iovecs_marked(b.as_raw_fd(), &mut iov, &Impatient) }.unwrap();
        assert!(t0.elapsed() < Duration::from_secs(1), "the read waited {:?}", t0.elapsed());
        assert!(buf.iter().enumerate().all(|(i, &c)| c == (i % 251) as u8));
        drop(t.join().unwrap());
    }

    #[test]
    fn interfaces_include_something() {
        // Every Linux network namespace has lo; it may be down in a fresh one, so only check the call works.
        let _ = interface_addrs();
    }
}
