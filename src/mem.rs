//! Memory types, descriptors and descriptor lists.
//!
//! A descriptor names a byte range `[addr, addr + len)` on a device (`dev`): for DRAM a region id (usually 0),
//! for FILE a file descriptor with `addr` the file offset. Lists are plain, ordered vectors; this module does
//! not check registrations or talk to backends.

use crate::status::{Error, Result};

/// `nixl_mem_t`.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemType {
    Dram = 0,
    Vram = 1,
    Blk = 2,
    Obj = 3,
    File = 4,
}

impl MemType {
    pub const ALL: [MemType; 5] = [MemType::Dram, MemType::Vram, MemType::Blk, MemType::Obj, MemType::File];

    pub fn from_u32(v: u32) -> Result<MemType> {
        Self::ALL.get(v as usize).copied().ok_or_else(|| Error::invalid_param(format!("unknown memory type {v}")))
    }

    /// NIXL's C++ spelling (`memTypeStr`), e.g. "DRAM_SEG".
    pub fn seg_name(self) -> &'static str {
        match self {
            MemType::Dram => "DRAM_SEG",
            MemType::Vram => "VRAM_SEG",
            MemType::Blk => "BLK_SEG",
            MemType::Obj => "OBJ_SEG",
            MemType::File => "FILE_SEG",
        }
    }

    /// Storage types treat a registered length of 0 as "unbounded".
    pub fn zero_len_is_unbounded(self) -> bool {
        matches!(self, MemType::Blk | MemType::Obj | MemType::File)
    }
}

/// `nixlBasicDesc`: ordered by (dev, addr, len) like NIXL's. `repr(C)`: the C ABI's bulk calls read the
/// caller's `gixl_desc_t` array (the layout of NIXL's `nixlBasicDesc` on 64-bit targets) as `[Desc]` in place.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Desc {
    pub addr: u64,
    pub len: u64,
    pub dev: u64,
}

impl PartialOrd for Desc {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Desc {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.dev, self.addr, self.len).cmp(&(o.dev, o.addr, o.len))
    }
}

impl Desc {
    pub const fn new(addr: u64, len: u64, dev: u64) -> Desc {
        Desc { addr, len, dev }
    }

    /// One past the last byte, or `None` if `addr + len` overflows.
    pub fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }

    /// Whether `q` lies inside `self` (same device). A registered region of an unbounded storage type
    /// (`len == 0`) covers everything from `addr` on.
    pub fn covers(&self, q: &Desc, mem: MemType) -> bool {
        if self.dev != q.dev || self.addr > q.addr {
            return false;
        }
        let Some(q_end) = q.end() else { return false };
        if self.len == 0 && mem.zero_len_is_unbounded() {
            return true;
        }
        match self.end() {
            Some(end) => end >= q_end,
            None => false,
        }
    }
}

/// `nixlBlobDesc`: a registration descriptor with opaque per-descriptor metadata (a path for FILE, ...).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct RegDesc {
    pub desc: Desc,
    pub meta: Vec<u8>,
}

/// `nixlRemoteDesc`: a descriptor on a named agent.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct RemoteDesc {
    pub desc: Desc,
    pub agent: String,
}

/// An ordered list of descriptors of one memory type (`nixlDescList<T>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DList<T> {
    mem: MemType,
    descs: Vec<T>,
}

pub type XferDList = DList<Desc>;
pub type RegDList = DList<RegDesc>;
pub type RemoteDList = DList<RemoteDesc>;

impl<T> DList<T> {
    pub fn new(mem: MemType) -> Self {
        DList { mem, descs: Vec::new() }
    }
    pub fn with_descs(mem: MemType, descs: Vec<T>) -> Self {
        DList { mem, descs }
    }
    pub fn mem_type(&self) -> MemType {
        self.mem
    }
    pub fn len(&self) -> usize {
        self.descs.len()
    }
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }
    pub fn push(&mut self, d: T) {
        self.descs.push(d)
    }
    /// Room for `n` more descriptors, or an error instead of an abort when it cannot be had.
    pub fn try_reserve(&mut self, n: usize) -> std::result::Result<(), std::collections::TryReserveError> {
        self.descs.try_reserve(n)
    }
    pub fn extend_from_slice(&mut self, d: &[T])
    where
        T: Clone,
    {
        self.descs.extend_from_slice(d)
    }
    pub fn get(&self, i: usize) -> Option<&T> {
        self.descs.get(i)
    }
    pub fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.descs.get_mut(i)
    }
    pub fn remove(&mut self, i: usize) -> Result<T> {
        if i >= self.descs.len() {
            return Err(Error::invalid_param(format!("index {i} out of range for {} descriptors", self.descs.len())));
        }
        Ok(self.descs.remove(i))
    }
    pub fn clear(&mut self) {
        self.descs.clear()
    }
    pub fn descs(&self) -> &[T] {
        &self.descs
    }
    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.descs.iter()
    }
    pub fn into_descs(self) -> Vec<T> {
        self.descs
    }
}

impl<T: Default + Clone> DList<T> {
    pub fn resize(&mut self, n: usize) {
        self.descs.resize(n, T::default())
    }
}

impl RegDList {
    /// The descriptors without their metadata (`trim`).
    pub fn trim(&self) -> XferDList {
        DList { mem: self.mem, descs: self.descs.iter().map(|d| d.desc).collect() }
    }
}

impl<T: PartialEq> DList<T> {
    pub fn position(&self, d: &T) -> Option<usize> {
        self.descs.iter().position(|x| x == d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covers_checks_device_bounds_and_overflow() {
        let r = Desc::new(100, 50, 0);
        assert!(r.covers(&Desc::new(100, 50, 0), MemType::Dram));
        assert!(r.covers(&Desc::new(120, 30, 0), MemType::Dram));
        assert!(!r.covers(&Desc::new(120, 31, 0), MemType::Dram));
        assert!(!r.covers(&Desc::new(99, 1, 0), MemType::Dram));
        assert!(!r.covers(&Desc::new(100, 1, 1), MemType::Dram));
        assert!(!r.covers(&Desc::new(120, u64::MAX, 0), MemType::Dram));
        let file = Desc::new(0, 0, 7);
        assert!(file.covers(&Desc::new(1 << 40, 4096, 7), MemType::File));
        assert!(!file.covers(&Desc::new(0, 1, 7), MemType::Dram));
    }

    #[test]
    fn ordering_is_dev_addr_len() {
        let mut v = vec![Desc::new(5, 1, 1), Desc::new(9, 1, 0), Desc::new(5, 0, 1)];
        v.sort();
        assert_eq!(v, vec![Desc::new(9, 1, 0), Desc::new(5, 0, 1), Desc::new(5, 1, 1)]);
    }

    #[test]
    fn remove_out_of_range_is_an_error() {
        let mut l = XferDList::new(MemType::Dram);
        l.push(Desc::new(1, 2, 0));
        assert!(l.remove(1).is_err());
        assert_eq!(l.remove(0).unwrap(), Desc::new(1, 2, 0));
    }
}
