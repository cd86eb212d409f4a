//! Moving bytes: `memcpy` inside one process and cross-memory attach (`process_vm_readv/writev`) between
//! processes on one host. Callers pass segments already checked against registrations, one batch at a time
//! (see [`for_batches`]), each batch inside the target's gate (`gate`).

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::backend::{Seg, XferOp};
use crate::os::sentinel;
use crate::status::{Error, Result, Status};

/// Most iovecs one `process_vm_*` call takes (the kernel's UIO_MAXIOV); one of them is the gate probe.
const IOV_MAX: usize = 1024;
/// Segments per batch.
pub const BATCH_SEGS: usize = IOV_MAX - 1;
/// Bytes per batch: bounds how long a deregistration waits for a batch already inside the gate.
pub const BATCH_BYTES: u64 = 16 << 20;

/// Call `f` on consecutive batches of `segs`, each at most `max_segs` segments and `max_bytes` bytes; longer
/// segments are cut. Batches are slices of `segs` where no cut is needed (no copying).
pub fn for_batches(
    segs: &[Seg],
    max_segs: usize,
    max_bytes: u64,
    f: &mut dyn FnMut(&[Seg]) -> Result<()>,
) -> Result<()> {
    let mut i = 0;
    while i < segs.len() {
        if segs[i].len > max_bytes {
            // One segment larger than a batch: in pieces (no allocation on this path).
            let mut s = segs[i];
            while s.len > 0 {
                let piece = Seg { len: s.len.min(max_bytes), ..s };
                f(std::slice::from_ref(&piece))?;
                s.local += piece.len;
                s.remote += piece.len;
                s.len -= piece.len;
            }
            i += 1;
            continue;
        }
        let (mut j, mut bytes) = (i, 0u64);
        while j < segs.len() && j - i < max_segs && segs[j].len <= max_bytes - bytes {
            bytes += segs[j].len;
            j += 1;
        }
        f(&segs[i..j])?;
        i = j;
    }
    Ok(())
}

/// Copy `segs` within this process.
///
/// # Safety
/// Every segment's local and remote ranges must be valid, registered memory of this process for the
/// duration of the call.
pub unsafe fn local_copy(op: XferOp, segs: &[Seg]) {
    for s in segs {
        let (src, dst) = match op {
            XferOp::Read => (s.remote, s.local),
            XferOp::Write => (s.local, s.remote),
        };
        // SAFETY: guaranteed by the caller; `copy` tolerates overlap (loopback may alias).
        unsafe { std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, s.len as usize) };
    }
}

/// Where the target's gate is mapped in its own address space, and the incarnation it holds.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    pub addr: u64,
    pub incarnation: u128,
}

/// Copy one batch between this process and `pid` with cross-memory attach, resuming after partial
/// transfers. Each call is tied to the incarnation's address space:
/// - a write's first remote iovec is the gate's scratch bytes (`probe`), so the call moves nothing unless
///   `pid` still maps that incarnation's gate (an exec'd image or another process faults on it first);
/// - a read checks the target's sentinel word (`sentinel`, in our mapping of its gate) before and after each
///   call: unchanged after the call proves the address space it read was the original image (see
///   `os::sentinel`), for one atomic load instead of a second iovec (about 0.5 µs of a 4 KiB read). Where the
///   target publishes no sentinel, a read probes as well: its first iovec reads the incarnation id back.
///
/// Errors: REMOTE_DISCONNECT if the process is gone or no longer this incarnation (`gone` is set);
/// BACKEND for a descriptor that faults (the peer stays usable) and for other failures; EPERM/ENOSYS keep
/// their `io::Error` source (see `cma_denied`).
///
/// # Safety
/// The local range of every segment must be valid, registered memory of this process for the duration
/// of the call. (The remote side is checked by the kernel: a bad remote address fails with EFAULT.)
pub unsafe fn cma_batch(
    pid: i32,
    op: XferOp,
    segs: &[Seg],
    probe: &Probe,
    sentinel: &AtomicU32,
    gone: &mut bool,
) -> Result<()> {
    let watch = match (op, sentinel::read(sentinel)) {
        (_, sentinel::Word::Ended) => {
            *gone = true;
            return Err(Error::disconnected(format!(
                "process {pid} no longer runs the agent incarnation {:032x} (it exited or exec'd)",
                probe.incarnation
            )));
        }
        (XferOp::Read, sentinel::Word::Alive(v)) => Some((sentinel, v)),
        _ => None,
    };
    IOVS.with(|v| {
        let (local, remote) = &mut *v.borrow_mut();
        let want: usize = segs.iter().map(|s| s.len as usize).sum();
        // Checked after every call of a watched read: still the value seen before, or the image is not the same.
        let same_image = |gone: &mut bool| match watch {
            Some((w, v)) if w.load(Ordering::SeqCst) != v => {
                *gone = true;
                Err(Error::disconnected(format!(
                    "process {pid} exited or exec'd during the read; agent incarnation {:032x} is gone",
                    probe.incarnation
                )))
            }
            _ => Ok(()),
        };
        let probing = watch.is_none();
        let expect = probe.incarnation.to_le_bytes();
        let (probe_off, mut canary) = match op {
            XferOp::Read => (super::gate::OFF_INCARNATION, [0u8; super::gate::PROBE_BYTES]),
            XferOp::Write => (super::gate::OFF_PROBE, expect),
        };
        let mut done = 0usize;
        while done < want {
            local.clear();
            remote.clear();
            if probing {
                local.push(iov(canary.as_mut_ptr() as u64, canary.len() as u64));
                remote.push(iov(probe.addr + probe_off as u64, canary.len() as u64));
            }
            let mut skip = done as u64;
            for s in segs {
                if skip >= s.len {
                    skip -= s.len;
                    continue;
                }
                local.push(iov(s.local + skip, s.len - skip));
                remote.push(iov(s.remote + skip, s.len - skip));
                skip = 0;
            }
            // SAFETY: the local iovecs point at registered local memory (caller's contract) and at `canary`; the
            // kernel checks the remote ones.
            let n = unsafe {
                let (l, r) = (local.as_ptr(), remote.as_ptr());
                match op {
                    XferOp::Read => libc::process_vm_readv(pid, l, local.len() as _, r, remote.len() as _, 0),
                    XferOp::Write => libc::process_vm_writev(pid, l, local.len() as _, r, remote.len() as _, 0),
                }
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                same_image(gone)?;
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                if !probing && e.raw_os_error() == Some(libc::EFAULT) {
                    // Same image (checked above): the first descriptor faulted.
                    return Err(descriptor_fault(pid, op, local, remote, 0));
                }
                return Err(cma_error(pid, op, e, gone));
            }
            same_image(gone)?;
            let head = if probing { canary.len() } else { 0 };
            if (n as usize) < head || (probing && op == XferOp::Read && canary != expect) {
                return Err(incarnation_gone(pid, probe, gone));
            }
            let data = n as usize - head;
            if data == 0 {
                return Err(descriptor_fault(pid, op, local, remote, head.min(1)));
            }
            done += data;
        }
        Ok(())
    })
}

thread_local! {
    /// iovec arrays reused across batches of this thread (no allocation per call).
    static IOVS: std::cell::RefCell<(Vec<libc::iovec>, Vec<libc::iovec>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// `pid` no longer holds `probe`'s incarnation (the probe's read-back says another, or nothing).
fn incarnation_gone(pid: i32, probe: &Probe, gone: &mut bool) -> Error {
    *gone = true;
    Error::disconnected(format!("process {pid} no longer holds the agent incarnation {:032x}", probe.incarnation))
}

/// A descriptor's memory is not mapped (local, or remote in the same image): the request fails, the peer
/// stays usable. `first` is the index of the first data iovec.
fn descriptor_fault(pid: i32, op: XferOp, local: &[libc::iovec], remote: &[libc::iovec], first: usize) -> Error {
    let at = |v: &[libc::iovec]| v.get(first).map_or(0, |v| v.iov_base as u64);
    Error::backend(format!(
        "{}: a descriptor faulted (local {:#x}, remote {:#x} in process {pid}): its memory is not mapped",
        call_name(op),
        at(local),
        at(remote)
    ))
}

fn iov(addr: u64, len: u64) -> libc::iovec {
    libc::iovec { iov_base: addr as usize as *mut libc::c_void, iov_len: len as usize }
}

/// Check, with one 16-byte `process_vm_readv` of the target's gate, that `pid` is still the process that
/// holds `probe`'s incarnation: for copies that do not go through cross-memory attach themselves (device
/// copies through an opened IPC handle, see `vram`). It faults in an exec'd image or a process that took over
/// the pid (the gate's random address is not mapped there) and a read-back of another incarnation id fails.
/// Errors as `cma_batch` (`gone` set for REMOTE_DISCONNECT; EPERM/ENOSYS keep their `io::Error` source).
pub fn probe(pid: i32, probe: &Probe, gone: &mut bool) -> Result<()> {
    let mut got = [0u8; super::gate::PROBE_BYTES];
    let local = iov(got.as_mut_ptr() as u64, got.len() as u64);
    let remote = iov(probe.addr + super::gate::OFF_INCARNATION as u64, got.len() as u64);
    let n = loop {
        // SAFETY: the local iovec is our own stack buffer; the kernel checks the remote one.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        match (n < 0).then(io::Error::last_os_error) {
            Some(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Some(e) => return Err(cma_error(pid, XferOp::Read, e, gone)),
            None => break n as usize,
        }
    };
    if n != got.len() || got != probe.incarnation.to_le_bytes() {
        return Err(incarnation_gone(pid, probe, gone));
    }
    Ok(())
}

fn call_name(op: XferOp) -> &'static str {
    match op {
        XferOp::Read => "process_vm_readv",
        XferOp::Write => "process_vm_writev",
    }
}

fn cma_error(pid: i32, op: XferOp, e: io::Error, gone: &mut bool) -> Error {
    let call = call_name(op);
    let (status, msg) = match e.raw_os_error() {
        Some(libc::ESRCH) => (Status::RemoteDisconnect, format!("peer process {pid} has exited ({call})")),
        Some(libc::EPERM) | Some(libc::ENOSYS) => (
            Status::Backend,
            format!(
                "the kernel denied cross-memory attach to pid {pid} ({call}); same-host transfers need ptrace \
                 permission between the processes (same user, and Yama ptrace_scope ≤ 1 or CAP_SYS_PTRACE; \
                 containers may block it with seccomp)"
            ),
        ),
        // Nothing moved and the first remote element (the gate) faulted: this address space does not hold
        // the incarnation (exec'd image, other process).
        Some(libc::EFAULT) => (
            Status::RemoteDisconnect,
            format!("{call}: process {pid} no longer maps the agent's transfer gate (it exec'd or is another process)"),
        ),
        _ => (Status::Backend, format!("{call} to pid {pid} failed")),
    };
    *gone |= status == Status::RemoteDisconnect;
    Error::os(status, msg, e)
}

/// Cut `segs` into chunks of at most `cap` bytes, splitting segments where needed.
pub(super) fn chunks(segs: &[Seg], cap: u64) -> Vec<Vec<Seg>> {
    let mut out: Vec<Vec<Seg>> = Vec::new();
    let mut room = 0u64;
    for s in segs {
        let mut s = *s;
        while s.len > 0 {
            if room == 0 {
                out.push(Vec::new());
                room = cap;
            }
            let take = s.len.min(room);
            if let Some(c) = out.last_mut() {
                c.push(Seg { len: take, ..s });
            }
            s.local += take;
            s.remote += take;
            s.len -= take;
            room -= take;
        }
    }
    out
}

/// Did cross-memory attach fail because the kernel forbids it here (not because the peer is gone)?
pub(super) fn cma_denied(e: &Error) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .and_then(|io| io.raw_os_error())
        .is_some_and(|c| c == libc::EPERM || c == libc::ENOSYS)
}

#[cfg(test)]
mod tests {
    use super::super::gate::Gate;
    use super::*;

    fn at(local: u64, remote: u64, len: u64) -> Seg {
        Seg { local, remote, len, ldev: 0, rdev: 0, lreg: 0, rreg: 0 }
    }

    /// A request's pieces (`xfer`: 40 bytes in 3 pieces of at most 14) and staging chunks alike.
    #[test]
    fn chunks_balance_and_preserve_bytes() {
        let segs = vec![at(0, 1000, 10), at(100, 2000, 25), at(500, 3000, 5)];
        let parts = chunks(&segs, 40u64.div_ceil(3));
        assert_eq!(parts.len(), 3);
        let lens: Vec<u64> = parts.iter().map(|p| p.iter().map(|s| s.len).sum()).collect();
        assert_eq!(lens, vec![14, 14, 12]);
        assert_eq!(parts[0][1], at(100, 2000, 4));
        assert_eq!(parts[1][0], at(104, 2004, 14));
        assert!(chunks(&[], 8).is_empty());
    }

    fn seg(local: &mut [u8], remote: &[u8]) -> Seg {
        Seg {
            local: local.as_mut_ptr() as u64,
            remote: remote.as_ptr() as u64,
            len: local.len() as u64,
            ldev: 0,
            rdev: 0,
            lreg: 0,
            rreg: 0,
        }
    }

    fn me() -> i32 {
        std::process::id() as i32
    }

    #[test]
    fn cma_reads_own_process_in_batches() {
        let g = Gate::create(5).unwrap();
        let probe = Probe { addr: g.addr(), incarnation: 5 };
        let src: Vec<Vec<u8>> = (0..2500).map(|i| vec![(i % 251) as u8; 64]).collect();
        let mut dst: Vec<Vec<u8>> = (0..2500).map(|_| vec![0u8; 64]).collect();
        let segs: Vec<Seg> = dst.iter_mut().zip(&src).map(|(d, s)| seg(d, s)).collect();
        let mut calls = 0;
        for_batches(&segs, BATCH_SEGS, BATCH_BYTES, &mut |b| {
            calls += 1;
            let mut gone = false;
            // SAFETY: all local ranges are live Vecs.
            unsafe { cma_batch(me(), XferOp::Read, b, &probe, g.sentinel(), &mut gone) }
        })
        .unwrap();
        assert_eq!(calls, 3);
        assert_eq!(dst, src);
    }

    /// Reads watched by a live sentinel go without the probe (a wrong probe address does not matter); an
    /// ended sentinel refuses before anything moves, for reads and writes.
    #[test]
    fn the_sentinel_replaces_the_probe_on_reads_and_refuses_when_ended() {
        let g = Gate::create(11).unwrap();
        assert!(matches!(crate::os::sentinel::read(g.sentinel()), crate::os::sentinel::Word::Alive(_)));
        let src = vec![5u8; 4096];
        let mut dst = vec![0u8; 4096];
        let segs = [seg(&mut dst, &src)];
        let nowhere = Probe { addr: 8192, incarnation: 11 };
        let mut gone = false;
        // SAFETY: live Vecs.
        unsafe { cma_batch(me(), XferOp::Read, &segs, &nowhere, g.sentinel(), &mut gone) }.unwrap();
        assert!(dst.iter().all(|&b| b == 5) && !gone);
        // A write still probes: the probe address is checked.
        let e = unsafe { cma_batch(me(), XferOp::Write, &segs, &nowhere, g.sentinel(), &mut gone) }.unwrap_err();
        assert_eq!(e.status(), Status::RemoteDisconnect);
        let ended = AtomicU32::new(crate::os::sentinel::OWNER_DIED);
        let good = Probe { addr: g.addr(), incarnation: 11 };
        let mut out = vec![0u8; 4096];
        let segs = [seg(&mut out, &src)];
        for op in [XferOp::Read, XferOp::Write] {
            let mut gone = false;
            let e = unsafe { cma_batch(me(), op, &segs, &good, &ended, &mut gone) }.unwrap_err();
            assert_eq!(e.status(), Status::RemoteDisconnect);
            assert!(gone);
        }
        assert!(out.iter().all(|&b| b == 0), "nothing moved");
        // A faulting descriptor under a live sentinel is local (BACKEND), not a disconnect.
        let mut bad = seg(&mut dst, &src);
        bad.remote = 4096;
        let mut gone = false;
        let e = unsafe { cma_batch(me(), XferOp::Read, &[bad], &good, g.sentinel(), &mut gone) }.unwrap_err();
        assert_eq!(e.status(), Status::Backend, "{e}");
        assert!(!gone);
    }

    #[test]
    fn batches_cut_long_segments_and_respect_limits() {
        let s = |len| Seg { local: 0, remote: 1000, len, ldev: 0, rdev: 0, lreg: 0, rreg: 0 };
        let segs = [s(3), s(3), s(10), s(1), s(1), s(1)];
        let mut got = Vec::new();
        for_batches(&segs, 2, 4, &mut |b| {
            got.push(b.iter().map(|x| (x.remote, x.len)).collect::<Vec<_>>());
            Ok(())
        })
        .unwrap();
        assert_eq!(
            got,
            vec![
                vec![(1000, 3)],
                vec![(1000, 3)],
                vec![(1000, 4)],
                vec![(1004, 4)],
                vec![(1008, 2)],
                vec![(1000, 1), (1000, 1)],
                vec![(1000, 1)]
            ]
        );
    }

    #[test]
    fn a_wrong_gate_moves_nothing_and_a_faulting_descriptor_is_local() {
        let g = Gate::create(9).unwrap();
        // No sentinel (an older peer): reads probe too.
        let absent = AtomicU32::new(0);
        let src = vec![7u8; 4096];
        let mut dst = vec![0u8; 4096];
        let segs = [seg(&mut dst, &src)];
        for op in [XferOp::Read, XferOp::Write] {
            // The gate's incarnation differs from the one expected: a read sees the canary.
            let mut gone = false;
            let wrong = Probe { addr: g.addr(), incarnation: 10 };
            let r = unsafe { cma_batch(me(), op, &segs, &wrong, &absent, &mut gone) };
            if op == XferOp::Read {
                assert_eq!(r.unwrap_err().status(), Status::RemoteDisconnect);
                assert!(gone);
            }
            // No gate at that address: nothing moves at all.
            let mut gone = false;
            let unmapped = Probe { addr: 8192, incarnation: 9 };
            let e = unsafe { cma_batch(me(), op, &segs, &unmapped, &absent, &mut gone) }.unwrap_err();
            assert_eq!(e.status(), Status::RemoteDisconnect);
            assert!(gone);
        }
        assert!(src.iter().all(|&b| b == 7));
        // A descriptor pointing nowhere fails the batch with BACKEND; the peer is not declared gone.
        let mut gone = false;
        let probe = Probe { addr: g.addr(), incarnation: 9 };
        let mut bad = seg(&mut dst, &src);
        bad.remote = 4096;
        let e = unsafe { cma_batch(me(), XferOp::Read, &[bad], &probe, &absent, &mut gone) }.unwrap_err();
        assert_eq!(e.status(), Status::Backend, "{e}");
        assert!(!gone);
    }

    #[test]
    fn probe_checks_the_incarnation_at_the_gate() {
        let g = Gate::create(0x77).unwrap();
        let mut gone = false;
        probe(me(), &Probe { addr: g.addr(), incarnation: 0x77 }, &mut gone).unwrap();
        assert!(!gone);
        let e = probe(me(), &Probe { addr: g.addr(), incarnation: 0x78 }, &mut gone).unwrap_err();
        assert!(gone && e.status() == Status::RemoteDisconnect, "{e}");
        // Nothing mapped there (an exec'd image, another process): EFAULT, a disconnect.
        let mut gone = false;
        let e = probe(me(), &Probe { addr: 8192, incarnation: 0x77 }, &mut gone).unwrap_err();
        assert!(gone && e.status() == Status::RemoteDisconnect, "{e}");
        let mut gone = false;
        let e = probe(i32::MAX - 1, &Probe { addr: g.addr(), incarnation: 0x77 }, &mut gone).unwrap_err();
        assert!(gone && e.status() == Status::RemoteDisconnect, "{e}");
    }

    #[test]
    fn cma_to_a_missing_process_is_a_disconnect() {
        let mut d = [0u8; 8];
        let s = [0u8; 8];
        let segs = [seg(&mut d, &s)];
        let mut gone = false;
        // pid_max is at most 2^22, so this pid cannot exist.
        let p = Probe { addr: 4096, incarnation: 1 };
        let e = unsafe { cma_batch(i32::MAX - 1, XferOp::Read, &segs, &p, &AtomicU32::new(0), &mut gone) }.unwrap_err();
        assert_eq!(e.status(), Status::RemoteDisconnect);
    }
}
