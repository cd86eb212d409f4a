//! Sorted region tables: the registrations of one (backend, memory type), local or remote.
//!
//! Regions may overlap (NIXL does not forbid it). A lookup tries the last region starting at or before the
//! query; when that one does not cover it, `reach` (per region, the farthest end of any region of the same
//! device up to it) finds one that does by binary search, so a query costs O(log n) however regions nest (a
//! walk back over a million small regions inside one large one took 3 ms a query).

use crate::mem::{Desc, MemType};

pub(crate) struct Section<T> {
    mem: MemType,
    regions: Vec<(Desc, T)>,
    /// Per region `i`: 1 + the farthest end (`u64::MAX` for an unbounded one) of the regions of its device up
    /// to and including `i`; 0 when none of them can cover anything. Non-decreasing within a device.
    reach: Vec<u128>,
}

impl<T> Section<T> {
    pub fn new(mem: MemType) -> Self {
        Section { mem, regions: Vec::new(), reach: Vec::new() }
    }

    /// 1 + how far region `d` reaches (see `reach`), 0 if it covers nothing.
    fn reach_of(&self, d: &Desc) -> u128 {
        if d.len == 0 && self.mem.zero_len_is_unbounded() {
            return u64::MAX as u128 + 1;
        }
        d.end().map_or(0, |e| e as u128 + 1)
    }

    /// Recompute `reach` from region `from` on.
    fn update_reach(&mut self, from: usize) {
        self.reach.truncate(from);
        for i in from..self.regions.len() {
            let d = &self.regions[i].0;
            let own = self.reach_of(d);
            let before = match i.checked_sub(1) {
                Some(p) if self.regions[p].0.dev == d.dev => self.reach[p],
                _ => 0,
            };
            self.reach.push(own.max(before));
        }
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    pub fn len(&self) -> usize {
        self.regions.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &(Desc, T)> {
        self.regions.iter()
    }

    /// Index of a region that covers `q`, if any: the last one starting at or before it when that one does,
    /// else the first of its device that reaches far enough.
    pub fn find_cover(&self, q: &Desc) -> Option<usize> {
        // First region ordered after (q.dev, q.addr, MAX): every candidate is before it.
        let end = self.regions.partition_point(|(d, _)| (d.dev, d.addr) <= (q.dev, q.addr));
        let last = end.checked_sub(1)?;
        let (d, _) = &self.regions[last];
        if d.dev != q.dev {
            return None;
        }
        if d.covers(q, self.mem) {
            return Some(last);
        }
        let need = q.end()? as u128 + 1;
        if self.reach[last] < need {
            return None;
        }
        // Every region of the device before `end` starts at or before `q`; the first whose reach is enough is
        // itself that far-reaching.
        let start = self.regions[..end].partition_point(|(d, _)| d.dev < q.dev);
        let i = start + self.reach[start..end].partition_point(|&r| r < need);
        debug_assert!(self.regions[i].0.covers(q, self.mem));
        Some(i)
    }

    pub fn find_exact(&self, q: &Desc) -> Option<usize> {
        self.regions.binary_search_by(|(d, _)| d.cmp(q)).ok()
    }

    pub fn get(&self, i: usize) -> &(Desc, T) {
        &self.regions[i]
    }

    /// Insert keeping the order; an identical descriptor goes after its equals. (Tests only: the agent adds
    /// regions with `extend`, one sorted merge per registration.)
    #[cfg(test)]
    pub fn insert(&mut self, d: Desc, v: T) {
        let at = self.regions.partition_point(|(x, _)| x <= &d);
        self.regions.insert(at, (d, v));
        self.update_reach(at);
    }

    /// Insert many at once in O((n + m) log(n + m)), whatever their order (one `insert` each would move the
    /// table's tail every time: quadratic for regions that arrive in descending order). Equal descriptors keep
    /// their order, new ones after the old, as with `insert`.
    pub fn extend(&mut self, new: impl IntoIterator<Item = (Desc, T)>) {
        let new = new.into_iter();
        self.regions.reserve_exact(new.size_hint().0);
        self.regions.extend(new);
        self.regions.sort_by_key(|r| r.0);
        self.update_reach(0);
    }

    /// Take out one region equal to each of `descs` that has one (those without are skipped), in
    /// O((n + m) log n): one `Vec::remove` each would move the table's tail every time, quadratic for a
    /// large deregistration (2^16 regions: 5.7 s). Returns what was taken, in table order.
    pub fn remove_exact_many<'a>(&mut self, descs: impl IntoIterator<Item = &'a Desc>) -> Vec<(Desc, T)> {
        let mut take = vec![false; self.regions.len()];
        let mut any = false;
        for q in descs {
            let lo = self.regions.partition_point(|(d, _)| d < q);
            let mut i = lo;
            while i < self.regions.len() && self.regions[i].0 == *q && take[i] {
                i += 1;
            }
            if i < self.regions.len() && self.regions[i].0 == *q {
                take[i] = true;
                any = true;
            }
        }
        if !any {
            return Vec::new();
        }
        let mut kept = Vec::with_capacity(self.regions.len());
        let mut taken = Vec::new();
        for (r, t) in std::mem::take(&mut self.regions).into_iter().zip(take) {
            if t {
                taken.push(r);
            } else {
                kept.push(r);
            }
        }
        self.regions = kept;
        self.update_reach(0);
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_covering_region_among_overlaps() {
        let mut s = Section::new(MemType::Dram);
        s.insert(Desc::new(0, 1000, 0), 'a');
        s.insert(Desc::new(100, 10, 0), 'b');
        s.insert(Desc::new(0, 1000, 1), 'c');
        let i = s.find_cover(&Desc::new(500, 100, 0)).unwrap();
        assert_eq!(s.get(i).1, 'a');
        let i = s.find_cover(&Desc::new(100, 10, 0)).unwrap();
        assert_eq!(s.get(i).1, 'b');
        assert!(s.find_cover(&Desc::new(990, 20, 0)).is_none());
        assert!(s.find_cover(&Desc::new(0, 10, 2)).is_none());
        assert_eq!(s.get(s.find_exact(&Desc::new(0, 1000, 1)).unwrap()).1, 'c');
        assert!(s.find_exact(&Desc::new(0, 999, 1)).is_none());
    }

    /// A million small regions inside one large one: a query the small ones do not cover finds the large one
    /// by binary search (it walked back over every small region before it).
    #[test]
    fn find_cover_is_logarithmic_among_nested_regions() {
        let mut s = Section::new(MemType::Dram);
        let n = 1u64 << 20;
        s.extend(
            std::iter::once((Desc::new(0, 64 * n, 0), 'L')).chain((0..n).map(|i| (Desc::new(i * 64, 16, 0), 's'))),
        );
        s.insert(Desc::new(0, 64, 1), 'o');
        let t = std::time::Instant::now();
        for k in 0..1000u64 {
            let q = Desc::new((n - 1 - k) * 64 + 20, 40, 0);
            assert_eq!(s.get(s.find_cover(&q).unwrap()).1, 'L');
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "{:?}", t.elapsed());
        assert_eq!(s.get(s.find_cover(&Desc::new(64 * 7, 16, 0)).unwrap()).1, 's', "the nearest one when it covers");
        assert!(s.find_cover(&Desc::new(64 * n - 8, 16, 0)).is_none(), "past the large one");
        assert!(s.find_cover(&Desc::new(10, 100, 1)).is_none(), "another device");
        assert_eq!(s.get(s.find_cover(&Desc::new(10, 20, 1)).unwrap()).1, 'o');
        // Taking the large one out leaves nothing that reaches.
        s.remove_exact_many(&[Desc::new(0, 64 * n, 0)]);
        assert!(s.find_cover(&Desc::new(64 * 5 + 20, 40, 0)).is_none());
        // An unbounded (zero-length) file region covers everything after it on its device.
        let mut f = Section::new(MemType::File);
        f.extend([(Desc::new(0, 0, 3), 'u'), (Desc::new(100, 10, 3), 'b')]);
        assert_eq!(f.get(f.find_cover(&Desc::new(105, 1 << 40, 3)).unwrap()).1, 'u');
    }

    #[test]
    fn remove_exact_many_takes_one_equal_region_per_descriptor() {
        let mut s = Section::new(MemType::Dram);
        s.extend([(Desc::new(0, 10, 0), 'a'), (Desc::new(0, 10, 0), 'b'), (Desc::new(50, 10, 0), 'c')]);
        s.insert(Desc::new(20, 10, 0), 'd');
        let taken = s.remove_exact_many(&[Desc::new(0, 10, 0), Desc::new(20, 10, 0), Desc::new(99, 1, 0)]);
        assert_eq!(taken, vec![(Desc::new(0, 10, 0), 'a'), (Desc::new(20, 10, 0), 'd')]);
        assert_eq!(s.iter().map(|r| r.1).collect::<String>(), "bc");
        assert_eq!(s.remove_exact_many(&[Desc::new(0, 10, 0), Desc::new(0, 10, 0)]), vec![(Desc::new(0, 10, 0), 'b')]);
        // 200,000 regions out of 200,000: one pass, not 200,000 moves of the tail.
        let all: Vec<Desc> = (0..200_000u64).map(|i| Desc::new(i * 8192, 4096, 0)).collect();
        let mut big = Section::new(MemType::Dram);
        big.extend(all.iter().map(|d| (*d, ())));
        let t = std::time::Instant::now();
        assert_eq!(big.remove_exact_many(all.iter().rev()).len(), 200_000);
        assert!(t.elapsed() < std::time::Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(big.is_empty());
    }

    #[test]
    fn extend_matches_one_insert_at_a_time_and_is_fast_in_any_order() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut descs = Vec::new();
        for i in 0..2000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            descs.push((Desc::new(x % 5000, 1 + x % 64, x % 3), i));
        }
        let (mut one, mut many) = (Section::new(MemType::Dram), Section::new(MemType::Dram));
        for (d, v) in &descs[..1000] {
            one.insert(*d, *v);
        }
        many.extend(descs[..1000].iter().copied());
        for (d, v) in &descs[1000..] {
            one.insert(*d, *v);
        }
        many.extend(descs[1000..].iter().copied());
        assert_eq!(one.iter().collect::<Vec<_>>(), many.iter().collect::<Vec<_>>());
        // 200,000 regions in descending order: one sort, not 200,000 moves of the tail.
        let mut big = Section::new(MemType::Dram);
        let t = std::time::Instant::now();
        big.extend((0..200_000u64).rev().map(|i| (Desc::new(i * 8192, 4096, 0), ())));
        assert!(t.elapsed() < std::time::Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(big.find_cover(&Desc::new(8192 * 7 + 10, 100, 0)).is_some());
    }
}
