//! Small OS helpers: randomness, clocks, and process identity.

use std::io;

/// 128 random bits from the kernel (`getrandom`).
pub fn random_u128() -> u128 {
    let mut b = [0u8; 16];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `b`.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if n > 0 {
            got += n as usize;
        } else if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            // getrandom cannot fail on Linux ≥ 3.17 short of EINTR; fall back to clock and address entropy.
            let t = monotonic_ns() as u128;
            return t ^ ((&b as *const _ as usize as u128) << 64) ^ (std::process::id() as u128) << 32;
        }
    }
    u128::from_le_bytes(b)
}

pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid out-pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Steady-clock microseconds, like NIXL's telemetry `startTime`.
pub fn monotonic_us() -> u64 {
    monotonic_ns() / 1000
}

/// The state (field 3) and start time (field 22) of process `pid`, from `/proc/<pid>/stat`.
fn proc_stat(pid: i32) -> io::Result<(String, u64)> {
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "malformed /proc stat");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) is in parentheses and may contain anything, so parse after the last ')'.
    let rest = stat.rfind(')').map(|i| &stat[i + 1..]).ok_or_else(malformed)?;
    let mut f = rest.split_whitespace();
    let state = f.next().ok_or_else(malformed)?.to_owned();
    // The start time is the 20th field after the state.
    let start = f.nth(18).and_then(|v| v.parse().ok()).ok_or_else(malformed)?;
    Ok((state, start))
}

/// The start time of process `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`).
/// Together with the pid it names one process for the life of the machine.
pub fn process_start_time(pid: i32) -> io::Result<u64> {
    proc_stat(pid).map(|(_, start)| start)
}

/// Is `pid` the process that started at `start`, and not yet dead? A zombie (exited, not reaped by its
/// parent) keeps its `/proc` entry and start time, but will never run again.
pub fn process_alive_as(pid: i32, start: u64) -> bool {
    pid > 0 && proc_stat(pid).is_ok_and(|(state, s)| s == start && !matches!(state.as_str(), "Z" | "X" | "x"))
}

/// What two processes must share to reach each other by pid and abstract socket: the same boot of the
/// same kernel, the same pid namespace and the same network namespace.
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns =
        |n: &str| std::fs::read_link(format!("/proc/self/ns/{n}")).map(|p| p.display().to_string()).unwrap_or_default();
    format!("{}|{}|{}", boot.trim(), ns("pid"), ns("net"))
}

/// A test that cannot run here says so, never by returning quietly: `SKIPPED: <test> [<kind>]: <why>` on stderr,
/// and the same line appended to the file named by `GIXL_SKIP_LOG` when set. Unit tests call it directly, the
/// integration tests through `tests/common::skip` (the one rule for both; `scripts/test-all.sh` counts the lines).
#[doc(hidden)]
pub fn test_skip(kind: &str, why: &str) {
    use std::io::Write;
    let thread = std::thread::current();
    let line = format!("SKIPPED: {} [{kind}]: {why}", thread.name().unwrap_or("?"));
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("GIXL_SKIP_LOG") {
        // O_APPEND writes of one short line are atomic, so parallel tests and suites share the file.
        let r = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
        if let Err(e) = r {
            panic!("cannot record the skip in {}: {e}", std::path::Path::new(&path).display());
        }
    }
}

/// A shared mapping of the first `len` bytes of `fd`, read-write or read-only, where the kernel likes. The
/// caller unmaps it (`munmap(p, len)`) and decides what may be read or written through it.
pub(crate) fn map_shared(fd: i32, len: usize, writable: bool) -> io::Result<*mut u8> {
    let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
    // SAFETY: a new mapping without a fixed address replaces nothing; the result is checked.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

/// `epoll_ctl(op)` for `fd` in the set `epfd`, reporting `events` with `token`.
pub(crate) fn epoll_ctl(epfd: i32, op: i32, fd: i32, events: u32, token: u64) -> crate::status::Result<()> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: `ev` is a valid event; the kernel checks both descriptors.
    if unsafe { libc::epoll_ctl(epfd, op, fd, &mut ev) } < 0 {
        return Err(crate::status::Error::os(crate::status::Status::Backend, "epoll_ctl", io::Error::last_os_error()));
    }
    Ok(())
}

/// Remove `fd` from the epoll set `epfd` (before it is closed). An fd that is not in the set is no error.
pub(crate) fn epoll_del(epfd: i32, fd: i32) {
    // SAFETY: a removal from an epoll set; the kernel checks both descriptors.
    unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
}

/// Whether an `accept` failed because this process (EMFILE) or the system (ENFILE) is out of descriptors
/// (or the kernel of memory for one): the connection stays in the backlog, so the listener stays readable
/// and a loop that just returns is woken again at once, spinning for as long as the limit lasts.
pub(crate) fn out_of_fds(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM))
}

/// After an `accept` on `listener` failed with `e`: whether to try again at once (interrupted, or a connection
/// shed at the descriptor limit, see `shed_one`). At the limit with nothing to shed it pauses 10 ms first, so
/// the caller's loop never spins on a listener it cannot serve.
pub(crate) fn accept_again(e: &io::Error, listener: std::os::fd::RawFd) -> bool {
    if e.kind() == io::ErrorKind::Interrupted {
        return true;
    }
    if out_of_fds(e) {
        if shed_one(listener) {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}

/// One descriptor kept open in reserve for `shed_one`.
static RESERVE: parking_lot::Mutex<Option<std::os::fd::OwnedFd>> = parking_lot::Mutex::new(None);

fn open_reserve() -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: plain syscall; the descriptor is owned below.
    let r = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    // SAFETY: a fresh descriptor that nothing else owns.
    (r >= 0).then(|| unsafe { OwnedFd::from_raw_fd(r) })
}

/// Keep a descriptor in reserve for `shed_one` (called when a listener starts, while descriptors are left).
pub(crate) fn reserve_fd_for_shedding() {
    let mut reserve = RESERVE.lock();
    if reserve.is_none() {
        *reserve = open_reserve();
    }
}

/// After `out_of_fds`: take the oldest pending connection off `listener`'s backlog and close it at once,
/// through the descriptor kept in reserve for this (closed first, reopened after), so that a listener at the
/// descriptor limit sheds what it cannot serve instead of spinning. `false` when nothing could be shed (no
/// reserve, and no descriptor free): the caller should pause before it tries again.
pub(crate) fn shed_one(listener: std::os::fd::RawFd) -> bool {
    let mut reserve = RESERVE.lock();
    drop(reserve.take());
    // SAFETY: plain syscall; the descriptor, if any, is closed at once.
    let fd = unsafe { libc::accept4(listener, std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC) };
    if fd >= 0 {
        // SAFETY: ours, just accepted.
        unsafe { libc::close(fd) };
    }
    *reserve = open_reserve();
    fd >= 0
}

/// Connect to the abstract Unix socket `name`, waiting at most `wait` for room in its backlog: a plain
/// `connect` blocks for as long as the listener (a stopped process, or a stranger who owns the name) leaves
/// its backlog full. A full backlog past `wait` is `TimedOut`. The stream returned is blocking.
pub(crate) fn connect_abstract(name: &[u8], wait: std::time::Duration) -> io::Result<std::os::unix::net::UnixStream> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: an all-zero sockaddr_un is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if name.len() + 1 > addr.sun_path.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "socket name too long"));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (i, b) in name.iter().enumerate() {
        addr.sun_path[i + 1] = *b as libc::c_char;
    }
    let len = (std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len()) as libc::socklen_t;
    // SAFETY: plain syscall.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let deadline = std::time::Instant::now() + wait;
    let mut pause = std::time::Duration::from_millis(1);
    loop {
        // SAFETY: `addr` is a sockaddr_un of which `len` bytes are used.
        let r = unsafe { libc::connect(sock.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) };
        if r == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            // A Unix stream socket answers a full backlog at once; it never connects in the background.
            Some(libc::EAGAIN) => {
                let now = std::time::Instant::now();
                if now >= deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the listener's backlog stayed full for {wait:?}"),
                    ));
                }
                std::thread::sleep(pause.min(deadline - now));
                pause = (pause * 2).min(std::time::Duration::from_millis(20));
            }
            _ => return Err(e),
        }
    }
    // SAFETY: plain fcntl on our descriptor.
    let flags = unsafe { libc::fcntl(sock.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(sock.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(std::os::unix::net::UnixStream::from(sock))
}

/// One non-blocking `recv`: Ok(0) is end of stream, WouldBlock when nothing is there.
pub fn recv_now(fd: std::os::fd::RawFd, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        // SAFETY: `buf` is writable for its length.
        let r = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// One non-blocking `send`: how many bytes went out (WouldBlock when none could).
pub fn send_now(fd: std::os::fd::RawFd, buf: &[u8]) -> std::io::Result<usize> {
    loop {
        // SAFETY: `buf` is readable for its length.
        let r = unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Entry `i` of the comma-separated list in environment variable `var`, trimmed, where it is set and not empty
/// (the fake layers' per-device test settings).
pub(crate) fn env_list_entry(var: &str, i: u32) -> Option<String> {
    let v = std::env::var(var).ok()?;
    v.split(',').nth(i as usize).map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child that has exited but is not reaped keeps its pid and start time: it is not alive.
    #[test]
    fn a_zombie_is_not_alive() {
        let mut c = std::process::Command::new("sleep").arg("0.3").spawn().unwrap();
        let pid = c.id() as i32;
        let start = process_start_time(pid).unwrap();
        assert!(process_alive_as(pid, start));
        assert!(!process_alive_as(pid, start + 1), "another start time is another process");
        let t = std::time::Instant::now();
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            if stat.rsplit(')').next().unwrap().trim_start().starts_with('Z') {
                break;
            }
            assert!(t.elapsed() < std::time::Duration::from_secs(10), "the child never exited");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(process_start_time(pid).unwrap(), start, "a zombie keeps its start time");
        assert!(!process_alive_as(pid, start), "but it is not alive");
        c.wait().unwrap();
        assert!(!process_alive_as(pid, start));
    }

    /// A listener that never accepts and has a full backlog: the connect gives up after its wait (a plain
    /// `connect` would block until the listener goes away), and connects at once once there is room.
    #[test]
    fn connect_abstract_waits_for_a_full_backlog_only_so_long() {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let name = format!("gixl-test-backlog-{}-{}", std::process::id(), random_u128());
        // SAFETY: plain syscalls on a descriptor this test owns; `addr` is a valid sockaddr_un.
        let listener = unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0);
            let l = OwnedFd::from_raw_fd(fd);
            let mut addr: libc::sockaddr_un = std::mem::zeroed();
            addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
            for (i, b) in name.bytes().enumerate() {
                addr.sun_path[i + 1] = b as libc::c_char;
            }
            let len = (std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len()) as libc::socklen_t;
            assert_eq!(libc::bind(fd, (&addr as *const libc::sockaddr_un).cast(), len), 0);
            assert_eq!(libc::listen(fd, 0), 0);
            l
        };
        let short = std::time::Duration::from_millis(200);
        let mut held = Vec::new();
        let full = loop {
            match connect_abstract(name.as_bytes(), short) {
                Ok(s) => held.push(s),
                Err(e) => break e,
            }
            assert!(held.len() < 64, "the backlog never filled");
        };
        assert_eq!(full.kind(), io::ErrorKind::TimedOut, "{full}");
        let t = std::time::Instant::now();
        let e = connect_abstract(name.as_bytes(), short).unwrap_err();
        let took = t.elapsed();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(took >= short && took < short * 10, "gave up after {took:?}");
        // SAFETY: accept on our listener; the accepted descriptor is closed at once.
        let fd = unsafe { libc::accept(listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut()) };
        assert!(fd >= 0);
        // SAFETY: the accepted descriptor is ours.
        unsafe { libc::close(fd) };
        let s = connect_abstract(name.as_bytes(), short).expect("room after one accept");
        assert!(!s.as_raw_fd().is_negative());
        assert_eq!(
            connect_abstract(b"gixl-test-nobody-listens-here", short).unwrap_err().kind(),
            io::ErrorKind::ConnectionRefused
        );
    }

    #[test]
    fn randomness_differs() {
        assert_ne!(random_u128(), random_u128());
    }

    #[test]
    fn own_start_time_is_stable() {
        let pid = std::process::id() as i32;
        assert_eq!(process_start_time(pid).unwrap(), process_start_time(pid).unwrap());
    }
}
