//! The file sink under `NIXL_TELEMETRY_DIR`: one file per agent, named after it, in the layout NIXL 1.5.1
//! writes (checked against its files, `tests/telemetry.rs`), so NIXL's telemetry readers read gixl's.
//!
//! Layout (little-endian, packed): a 40-byte header — write position (u64), read position (u64), format
//! version (u32, 4), expected version (u32, 4), capacity in events (u64, a power of two), mask (u64,
//! capacity - 1) — then `capacity` events of 16 bytes: event type (u32, NIXL's numbering, see
//! [`super::EVENTS`]), 4 bytes of padding, value (u64). The writer advances the write position after the
//! event is in place; a reader consumes from the read position and advances it. When the ring is full the
//! event is dropped, as NIXL drops it. The file is mapped shared, so readers see events as they land.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::status::{Error, Result, Status};

pub const VERSION: u32 = 4;
pub const HEADER: usize = 40;
pub const EVENT: usize = 16;

pub struct Ring {
    base: *mut u8,
    len: usize,
    cap: u64,
    pub dropped: u64,
}

// SAFETY: the mapping is owned by the Ring and only touched through &mut self (callers hold a mutex).
unsafe impl Send for Ring {}

impl Ring {
    /// Create (or truncate) `path` with room for `cap` events (rounded up to a power of two).
    pub fn create(path: &Path, cap: u64) -> Result<Ring> {
        let cap = cap.clamp(2, 1 << 24).next_power_of_two();
        let len = HEADER + cap as usize * EVENT;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| Error::os(Status::Backend, format!("telemetry file {}", path.display()), e))?;
        f.set_len(len as u64).map_err(|e| Error::os(Status::Backend, "telemetry file size", e))?;
        let p = crate::util::map_shared(f.as_raw_fd(), len, true)
            .map_err(|e| Error::os(Status::Backend, "mmap of the telemetry file", e))?;
        let r = Ring { base: p, len, cap, dropped: 0 };
        r.put_u32(16, VERSION);
        r.put_u32(20, VERSION);
        r.put_u64(24, cap);
        r.put_u64(32, cap - 1);
        Ok(r)
    }

    fn put_u64(&self, off: usize, v: u64) {
        debug_assert!(off + 8 <= self.len);
        // SAFETY: in bounds of our mapping (offsets are fixed header fields or computed below `len`).
        unsafe { std::ptr::write_unaligned(self.base.add(off).cast::<u64>(), v.to_le()) }
    }

    fn put_u32(&self, off: usize, v: u32) {
        debug_assert!(off + 4 <= self.len);
        // SAFETY: as in `put_u64`.
        unsafe { std::ptr::write_unaligned(self.base.add(off).cast::<u32>(), v.to_le()) }
    }

    fn pos(&self, off: usize) -> &AtomicU64 {
        // SAFETY: offsets 0 and 8 are 8-byte aligned in a page-aligned mapping; readers in other processes
        // update the read position concurrently, hence the atomic.
        unsafe { &*self.base.add(off).cast::<AtomicU64>() }
    }

    /// Append one event; dropped (and counted) when the ring is full.
    pub fn push(&mut self, ev: u32, value: u64) {
        let mask = self.cap - 1;
        let w = self.pos(0).load(Ordering::Acquire) & mask;
        let r = self.pos(8).load(Ordering::Acquire) & mask;
        if (w + 1) & mask == r {
            self.dropped += 1;
            return;
        }
        let off = HEADER + w as usize * EVENT;
        self.put_u32(off, ev);
        self.put_u32(off + 4, 0);
        self.put_u64(off + 8, value);
        self.pos(0).store((w + 1) & mask, Ordering::Release);
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Read every unread event of a file in this layout (for tests and `gixl doctor`): (type, value) pairs.
pub fn read_events(path: &Path) -> std::io::Result<(u32, Vec<(u32, u64)>)> {
    let b = std::fs::read(path)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not a NIXL telemetry file");
    let u64_at = |o: usize| b.get(o..o + 8).map(|s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])));
    let u32_at = |o: usize| b.get(o..o + 4).map(|s| u32::from_le_bytes(s.try_into().unwrap_or([0; 4])));
    let (w, mut r) = (u64_at(0).ok_or_else(bad)?, u64_at(8).ok_or_else(bad)?);
    let version = u32_at(16).ok_or_else(bad)?;
    let cap = u64_at(24).ok_or_else(bad)?;
    if cap == 0 || !cap.is_power_of_two() || b.len() < HEADER + cap as usize * EVENT {
        return Err(bad());
    }
    let mut out = Vec::new();
    while r != w {
        let off = HEADER + (r & (cap - 1)) as usize * EVENT;
        out.push((u32_at(off).ok_or_else(bad)?, u64_at(off + 8).ok_or_else(bad)?));
        r = (r + 1) & (cap - 1);
    }
    Ok((version, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_round_trip_and_full() {
        let dir = std::env::temp_dir().join(format!("gixl-ring-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("agent");
        let mut r = Ring::create(&p, 4).unwrap();
        r.push(4, 4096);
        r.push(7, 12);
        r.push(6, 34);
        r.push(0, 1); // the fourth does not fit: one slot stays free
        assert_eq!(r.dropped, 1);
        let (v, ev) = read_events(&p).unwrap();
        assert_eq!(v, 4);
        assert_eq!(ev, vec![(4, 4096), (7, 12), (6, 34)]);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 40 + 4 * 16);
        drop(r);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
