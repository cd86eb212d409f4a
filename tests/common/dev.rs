//! Helpers of the device-memory tests (`tests/vram.rs`, `tests/vram_tcp.rs`): (fake) device memory seen as a
//! slice, one-descriptor lists, and posting a request until it leaves IN_PROG.

use std::time::{Duration, Instant};

use gixl::*;

/// The `len` bytes at `p`: a test allocation (fake VRAM lives in host memory) that lives until the process
/// exits.
pub fn slice(p: u64, len: usize) -> &'static mut [u8] {
    // SAFETY: test allocations of at least `len` bytes that live until the process exits.
    unsafe { std::slice::from_raw_parts_mut(p as usize as *mut u8, len) }
}

/// Register the one region `addr..addr+len` of `mem` on device `dev` with `a`.
pub fn reg(a: &Agent, mem: MemType, addr: u64, len: usize, dev: u64) {
    let l = RegDList::with_descs(mem, vec![RegDesc { desc: Desc::new(addr, len as u64, dev), meta: vec![] }]);
    a.register_mem(&l, &[]).unwrap();
}

/// A transfer list of one descriptor.
pub fn one(mem: MemType, addr: u64, len: usize, dev: u64) -> XferDList {
    XferDList::with_descs(mem, vec![Desc::new(addr, len as u64, dev)])
}

/// Poll `r` until it leaves IN_PROG or `limit` has passed (then IN_PROG is returned).
pub fn wait(a: &Agent, r: &XferReq, limit: Duration) -> Result<Status> {
    let t = Instant::now();
    loop {
        match a.xfer_status(r) {
            Ok(Status::InProg) if t.elapsed() < limit => std::thread::sleep(Duration::from_micros(100)),
            other => return other,
        }
    }
}

/// Post `r` and wait for it, up to 60 s.
pub fn run(a: &Agent, r: &XferReq) -> Result<Status> {
    match a.post_xfer_req(r, NotifUpdate::Keep)? {
        Status::InProg => wait(a, r, Duration::from_secs(60)),
        s => Ok(s),
    }
}
