//! Moving bytes: `memcpy` inside one process and cross-memory attach (`process_vm_readv/writev`) between
//! processes on one host. Callers pass segments already checked against registrations.

use std::io;

use crate::backend::{Seg, XferOp};
use crate::status::{Error, Result};

/// Most iovecs one `process_vm_*` call takes (the kernel's UIO_MAXIOV).
const IOV_MAX: usize = 1024;

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

/// Copy `segs` between this process and `pid` with cross-memory attach, batching up to IOV_MAX
/// segments per call and resuming after partial transfers. `stop` is polled between calls.
///
/// # Safety
/// The local range of every segment must be valid, registered memory of this process for the duration
/// of the call. (The remote side is checked by the kernel: a bad remote address fails with EFAULT.)
pub unsafe fn cma_copy(pid: i32, op: XferOp, segs: &[Seg], stop: &dyn Fn() -> bool) -> Result<()> {
    let mut local: Vec<libc::iovec> = Vec::with_capacity(segs.len().min(IOV_MAX));
    let mut remote: Vec<libc::iovec> = Vec::with_capacity(segs.len().min(IOV_MAX));
    for batch in segs.chunks(IOV_MAX) {
        if stop() {
            return Err(Error::new(crate::Status::Canceled, "transfer stopped"));
        }
        local.clear();
        remote.clear();
        for s in batch {
            local.push(libc::iovec { iov_base: s.local as usize as *mut libc::c_void, iov_len: s.len as usize });
            remote.push(libc::iovec { iov_base: s.remote as usize as *mut libc::c_void, iov_len: s.len as usize });
        }
        let want: usize = batch.iter().map(|s| s.len as usize).sum();
        let mut done = 0usize;
        while done < want {
            let (l, r) = (skip(&local, done), skip(&remote, done));
            // SAFETY: the local iovecs point at registered local memory (caller's contract); the kernel
            // checks the remote ones.
            let n = unsafe {
                match op {
                    XferOp::Read => libc::process_vm_readv(pid, l.as_ptr(), l.len() as _, r.as_ptr(), r.len() as _, 0),
                    XferOp::Write => {
                        libc::process_vm_writev(pid, l.as_ptr(), l.len() as _, r.as_ptr(), r.len() as _, 0)
                    }
                }
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(cma_error(pid, op, e));
            }
            if n == 0 {
                return Err(Error::backend(format!("cross-memory attach to pid {pid} made no progress")));
            }
            done += n as usize;
        }
    }
    Ok(())
}

/// The iovec list with the first `n` bytes dropped (the first entry trimmed).
fn skip(v: &[libc::iovec], mut n: usize) -> Vec<libc::iovec> {
    let mut i = 0;
    while i < v.len() && n >= v[i].iov_len {
        n -= v[i].iov_len;
        i += 1;
    }
    let mut out: Vec<libc::iovec> = v[i..].to_vec();
    if let Some(first) = out.first_mut() {
        first.iov_base = (first.iov_base as usize + n) as *mut libc::c_void;
        first.iov_len -= n;
    }
    out
}

fn cma_error(pid: i32, op: XferOp, e: io::Error) -> Error {
    let call = if op == XferOp::Read { "process_vm_readv" } else { "process_vm_writev" };
    match e.raw_os_error() {
        Some(libc::ESRCH) => {
            Error::os(crate::Status::RemoteDisconnect, format!("peer process {pid} has exited ({call})"), e)
        }
        Some(libc::EPERM) | Some(libc::ENOSYS) => Error::os(
            crate::Status::Backend,
            format!(
                "the kernel denied cross-memory attach to pid {pid} ({call}); same-host transfers need ptrace \
                 permission between the processes (same user, and Yama ptrace_scope ≤ 1 or CAP_SYS_PTRACE; \
                 containers may block it with seccomp)"
            ),
            e,
        ),
        Some(libc::EFAULT) => Error::os(
            crate::Status::RemoteDisconnect,
            format!("{call}: peer {pid} no longer maps the registered range (it freed or unmapped it)"),
            e,
        ),
        _ => Error::os(crate::Status::Backend, format!("{call} to pid {pid} failed"), e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn cma_reads_own_process_in_batches() {
        let src: Vec<Vec<u8>> = (0..2500).map(|i| vec![(i % 251) as u8; 64]).collect();
        let mut dst: Vec<Vec<u8>> = (0..2500).map(|_| vec![0u8; 64]).collect();
        let segs: Vec<Seg> = dst.iter_mut().zip(&src).map(|(d, s)| seg(d, s)).collect();
        // SAFETY: all local ranges are live Vecs.
        unsafe { cma_copy(std::process::id() as i32, XferOp::Read, &segs, &|| false).unwrap() };
        assert_eq!(dst, src);
    }

    #[test]
    fn skip_trims_across_entries() {
        let a = [0u8; 10];
        let v = vec![
            libc::iovec { iov_base: a.as_ptr() as *mut _, iov_len: 4 },
            libc::iovec { iov_base: a.as_ptr() as *mut _, iov_len: 6 },
        ];
        let s = skip(&v, 5);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].iov_len, 5);
        assert_eq!(s[0].iov_base as usize, a.as_ptr() as usize + 1);
    }

    #[test]
    fn cma_to_a_missing_process_is_a_disconnect() {
        let mut d = [0u8; 8];
        let s = [0u8; 8];
        let segs = [seg(&mut d, &s)];
        // pid_max is at most 2^22, so this pid cannot exist.
        let e = unsafe { cma_copy(i32::MAX - 1, XferOp::Read, &segs, &|| false) }.unwrap_err();
        assert_eq!(e.status(), crate::Status::RemoteDisconnect);
    }
}
