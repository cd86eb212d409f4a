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

/// The start time of process `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`).
/// Together with the pid it names one process for the life of the machine.
pub fn process_start_time(pid: i32) -> io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) is in parentheses and may contain anything, so parse after the last ')'.
    let rest = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed /proc stat"))?;
    rest.split_whitespace()
        .nth(19)
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed /proc stat"))
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

#[cfg(test)]
mod tests {
    use super::*;

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
