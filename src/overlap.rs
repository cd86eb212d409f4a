//! The overlap check (`GIXL_CHECK_OVERLAP=warn|refuse`, `AgentConfig::check_overlap`): a table of the byte ranges
//! that in-flight requests touch, and the rule for when two of them collide.
//!
//! NIXL orders nothing across requests and locks no memory: two requests in flight on the same bytes, one of
//! them writing, corrupt them silently. This module finds such pairs; the agent decides what to do (log or
//! refuse, see `agent::xfer`), and the TCP target uses it for the pieces it serves (`route::tcp::regions`).
//!
//! A request's *footprint* is, per memory space (whose memory: an agent incarnation; its memory type; its
//! device id) and per access (read or write), the sorted union of the ranges it touches, built once with the
//! request (O(n log n), nothing when the list is already sorted). Two footprints conflict where one writes a byte
//! the other reads or writes. A request is never checked against itself: its own descriptors may overlap, as
//! NIXL allows (a WRITE that sends one local block to several places reads it twice; a request whose own
//! descriptors write one byte twice is a request, not a race between two, and is left alone).
//!
//! The table keeps, per (space, access), *runs*: sorted arrays of ranges. A posted request's footprint goes in
//! as runs of its own (shared, not copied: O(1)); runs are merged as in the logarithmic method (two runs of
//! the same size class, 2^k to 2^(k+1) - 1 ranges, are merged into one), so a space holds at most 1 + log2 K
//! runs for K ranges in flight and every range is copied O(log K) times in all. A check walks each run once with a
//! galloping search from where the previous range stopped: O(n log K) compares per run in the worst case, and
//! nothing at all for a run whose bounds the footprint does not meet. A request that leaves the table is
//! dropped at once from a run of its own; in a merged run its ranges are skipped until they are half of it,
//! then the run is rewritten without them.
//!
//! What it does not do: read clocks, log, or know what a request is. The caller gives every claim an id and a
//! payload, and decides what a conflict means.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::status::{Error, Result};

/// What the check does with a conflict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// No table, no check: one branch per post.
    #[default]
    Off,
    /// The post goes ahead; one WARN line and a counter.
    Warn,
    /// The post fails with `NIXL_ERR_NOT_ALLOWED` and moves nothing.
    Refuse,
}

impl Mode {
    /// `off`, `warn` or `refuse` (any case; `0`/`no`/`false`/`none` and empty are off).
    pub fn parse(v: &str) -> Option<Mode> {
        match v.trim().to_ascii_lowercase().as_str() {
            "" | "off" | "0" | "no" | "false" | "none" => Some(Mode::Off),
            "warn" => Some(Mode::Warn),
            "refuse" => Some(Mode::Refuse),
            _ => None,
        }
    }

    /// `GIXL_CHECK_OVERLAP`, when set; a value that is not a mode is an error (agent creation fails).
    pub fn from_env() -> Result<Option<Mode>> {
        match std::env::var("GIXL_CHECK_OVERLAP") {
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(Error::invalid_param("GIXL_CHECK_OVERLAP is not UTF-8 (expected off, warn or refuse)"))
            }
            Ok(v) => Mode::parse(&v).map(Some).ok_or_else(|| {
                Error::invalid_param(format!("GIXL_CHECK_OVERLAP={v:?} is not one of off, warn, refuse"))
            }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Warn => "warn",
            Mode::Refuse => "refuse",
        }
    }
}

/// Conflicts seen, for telemetry and tests: by this agent's own posts, and by its TCP target among the pieces
/// of different initiators it serves.
#[derive(Debug, Default)]
pub struct Counts {
    pub initiator: AtomicU64,
    pub target: AtomicU64,
}

impl Counts {
    pub fn get(&self) -> (u64, u64) {
        (self.initiator.load(Ordering::Relaxed), self.target.load(Ordering::Relaxed))
    }
}

/// One memory space: whose memory (an agent incarnation; 0 for a TCP target's own), its memory type (the
/// NIXL segment number) and device id (a file descriptor for FILE, the device for VRAM).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Space {
    pub owner: u128,
    pub mem: u8,
    pub dev: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    Write,
}

impl Access {
    pub fn verb(self) -> &'static str {
        match self {
            Access::Read => "reads",
            Access::Write => "writes",
        }
    }
}

/// Half-open byte range `[start, end)`.
pub type Range = (u64, u64);

/// The ranges one request touches in one space with one access: sorted, disjoint, not adjacent.
#[derive(Debug, Clone)]
struct Part {
    space: Space,
    access: Access,
    ranges: Arc<[Range]>,
}

/// What one request touches (see the module's comment).
#[derive(Debug, Clone, Default)]
pub struct Footprint {
    parts: Vec<Part>,
}

impl Footprint {
    /// From every piece `(space, access, start, len)`, in any order; empty pieces touch nothing.
    pub fn build(pieces: impl IntoIterator<Item = (Space, Access, u64, u64)>) -> Footprint {
        let mut keys: Vec<(Space, Access)> = Vec::new();
        let mut lists: Vec<Vec<Range>> = Vec::new();
        let mut index: HashMap<(Space, Access), usize> = HashMap::new();
        let mut last = usize::MAX;
        for (space, access, start, len) in pieces {
            if len == 0 {
                continue;
            }
            let k = (space, access);
            if last == usize::MAX || keys[last] != k {
                // A few spaces (the usual: one or two devices) by a scan; many (a request over many devices or
                // files) by a map, from the ninth on.
                let found = if index.is_empty() { keys.iter().position(|x| *x == k) } else { index.get(&k).copied() };
                last = found.unwrap_or_else(|| {
                    keys.push(k);
                    lists.push(Vec::new());
                    if !index.is_empty() {
                        index.insert(k, keys.len() - 1);
                    } else if keys.len() > 8 {
                        index.extend(keys.iter().enumerate().map(|(i, k)| (*k, i)));
                    }
                    keys.len() - 1
                });
            }
            lists[last].push((start, start.saturating_add(len)));
        }
        let parts = keys
            .into_iter()
            .zip(lists)
            .map(|((space, access), mut v)| {
                if !v.windows(2).all(|w| w[0].0 <= w[1].0) {
                    v.sort_unstable_by_key(|r| r.0);
                }
                Part { space, access, ranges: merge_sorted(v).into() }
            })
            .collect();
        Footprint { parts }
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Its ranges in `space` with `access` (sorted, disjoint), for messages and tests.
    pub fn ranges(&self, space: Space, access: Access) -> &[Range] {
        self.parts.iter().find(|p| p.space == space && p.access == access).map_or(&[], |p| &p.ranges)
    }
}

/// Sorted ranges → their union as sorted, disjoint, non-adjacent ranges (in place).
fn merge_sorted(mut v: Vec<Range>) -> Vec<Range> {
    let mut w = 0;
    for i in 0..v.len() {
        let r = v[i];
        if w > 0 && r.0 <= v[w - 1].1 {
            v[w - 1].1 = v[w - 1].1.max(r.1);
        } else {
            v[w] = r;
            w += 1;
        }
    }
    v.truncate(w);
    v
}

/// Where a footprint meets a claim in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conflict {
    /// The claim's id.
    pub other: u64,
    pub space: Space,
    /// What the checked footprint does there, and what the claim does.
    pub mine: Access,
    pub theirs: Access,
    /// The first bytes both touch (part of the overlap: at least one byte).
    pub range: Range,
}

/// One range of a merged run, with its claim.
#[derive(Debug, Clone, Copy)]
struct Iv {
    start: u64,
    end: u64,
    id: u64,
}

#[derive(Debug)]
enum Run {
    /// One claim's ranges (sorted, disjoint), shared with its footprint.
    One { id: u64, ranges: Arc<[Range]> },
    /// Several claims' ranges sorted by start (they may overlap each other); `maxend[i]` is the largest end of
    /// `iv[..=i]`; `ids` the claims still in the table with how many ranges each has here; `dead` the ranges
    /// of claims gone.
    Many { iv: Vec<Iv>, maxend: Vec<u64>, ids: Vec<(u64, usize)>, dead: usize },
}

impl Run {
    fn len(&self) -> usize {
        match self {
            Run::One { ranges, .. } => ranges.len(),
            Run::Many { iv, .. } => iv.len(),
        }
    }

    fn bounds(&self) -> Range {
        match self {
            Run::One { ranges, .. } => (ranges[0].0, ranges[ranges.len() - 1].1),
            Run::Many { iv, maxend, .. } => (iv[0].start, maxend[maxend.len() - 1]),
        }
    }

    /// The ranges of live claims, sorted by start, and those claims with their counts (sorted by id).
    fn live_ivs(self, out: &mut Vec<Iv>) -> Vec<(u64, usize)> {
        match self {
            Run::One { id, ranges } => {
                out.extend(ranges.iter().map(|&(start, end)| Iv { start, end, id }));
                vec![(id, ranges.len())]
            }
            Run::Many { iv, ids, dead, .. } => {
                if dead == 0 {
                    out.extend(iv);
                } else {
                    out.extend(iv.into_iter().filter(|x| ids.binary_search_by_key(&x.id, |e| e.0).is_ok()));
                }
                ids
            }
        }
    }

    /// The first range of `q` (sorted, disjoint) that meets a range of this run held by a claim `ok` accepts:
    /// the overlap and the claim.
    fn first_hit(&self, q: &[Range], ok: &mut impl FnMut(u64) -> bool) -> Option<(Range, u64)> {
        let (lo, hi) = self.bounds();
        if q.is_empty() || q[q.len() - 1].1 <= lo || q[0].0 >= hi {
            return None;
        }
        match self {
            Run::One { id, ranges } => {
                if !ok(*id) {
                    return None;
                }
                // Ends are sorted too: the first range ending after `a` is the only candidate.
                let mut j = 0;
                let from = gallop(q, 0, |r| r.1 <= lo);
                for &(a, b) in &q[from..] {
                    if a >= hi {
                        break;
                    }
                    j = gallop(ranges, j, |r| r.1 <= a);
                    if j == ranges.len() {
                        break;
                    }
                    let (s, e) = ranges[j];
                    if s < b {
                        return Some(((a.max(s), b.min(e)), *id));
                    }
                }
                None
            }
            Run::Many { iv, maxend, ids, dead } => {
                let live = |id: u64| *dead == 0 || ids.binary_search_by_key(&id, |e| e.0).is_ok();
                let mut idx = 0;
                let from = gallop(q, 0, |r| r.1 <= lo);
                for &(a, b) in &q[from..] {
                    if a >= hi {
                        break;
                    }
                    // Ranges starting before `b` are a prefix; those of them that end after `a` meet [a, b).
                    idx = gallop(iv, idx, |x| x.start < b);
                    let mut k = idx;
                    while k > 0 && maxend[k - 1] > a {
                        k -= 1;
                        let x = iv[k];
                        if x.end > a && live(x.id) && ok(x.id) {
                            return Some(((a.max(x.start), b.min(x.end)), x.id));
                        }
                    }
                }
                None
            }
        }
    }
}

/// The first index at or after `from` where `before` is false (`before` is true on a prefix of `s`), found by
/// doubling steps from `from` and then a binary search: O(log d) for a distance d.
fn gallop<T>(s: &[T], from: usize, before: impl Fn(&T) -> bool) -> usize {
    let n = s.len();
    if from >= n || !before(&s[from]) {
        return from.min(n);
    }
    let (mut lo, mut step) = (from, 1usize);
    // `s[lo]` is before; find a `hi` that is not (or the end).
    let hi = loop {
        let at = lo.saturating_add(step);
        if at >= n {
            break n;
        }
        if !before(&s[at]) {
            break at;
        }
        lo = at;
        step *= 2;
    };
    lo + 1 + s[lo + 1..hi].partition_point(before)
}

/// Merge two runs into one (dropping the ranges of claims gone).
fn merge_runs(a: Run, b: Run) -> Run {
    let mut x = Vec::with_capacity(a.len());
    let mut ids = a.live_ivs(&mut x);
    let mut y = Vec::with_capacity(b.len());
    ids.extend(b.live_ivs(&mut y));
    ids.sort_unstable();
    let mut iv = Vec::with_capacity(x.len() + y.len());
    let (mut i, mut j) = (0, 0);
    while i < x.len() && j < y.len() {
        if x[i].start <= y[j].start {
            iv.push(x[i]);
            i += 1;
        } else {
            iv.push(y[j]);
            j += 1;
        }
    }
    iv.extend_from_slice(&x[i..]);
    iv.extend_from_slice(&y[j..]);
    many(iv, ids)
}

/// A merged run of `iv` (sorted by start) held by the claims `ids` (sorted, with their counts in `iv`).
fn many(iv: Vec<Iv>, ids: Vec<(u64, usize)>) -> Run {
    let mut m = 0;
    let maxend = iv
        .iter()
        .map(|x| {
            m = m.max(x.end);
            m
        })
        .collect();
    Run::Many { iv, maxend, ids, dead: 0 }
}

/// The size class of a run of `len` ranges: 1 + floor(log2(len)).
fn class(len: usize) -> u32 {
    usize::BITS - len.leading_zeros()
}

/// The logarithmic method as a binary counter: while two runs share a size class, merge them (the smallest
/// such pair first). Then the runs of a space have distinct classes (at most 1 + log2 K runs for K ranges), and
/// a range is copied once per class it climbs. A run of its own that leaves again costs nothing: a request
/// posted and completed while the others stay is never merged unless its class is taken.
fn settle(runs: &mut Vec<Run>) {
    loop {
        runs.sort_unstable_by_key(|r| std::cmp::Reverse(r.len()));
        let Some(i) = (1..runs.len()).rev().find(|&i| class(runs[i].len()) == class(runs[i - 1].len())) else {
            return;
        };
        let b = runs.remove(i);
        let a = runs.remove(i - 1);
        let m = merge_runs(a, b);
        if m.len() > 0 {
            runs.push(m);
        }
    }
}

/// A claim: its footprint (where its ranges are), and the caller's payload.
struct Claim<T> {
    fp: Arc<Footprint>,
    payload: T,
}

/// The ranges of the claims in flight (see the module's comment). `T` is the caller's payload per claim.
pub struct Table<T> {
    runs: HashMap<(Space, Access), Vec<Run>>,
    claims: HashMap<u64, Claim<T>>,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table { runs: HashMap::new(), claims: HashMap::new() }
    }
}

impl<T> Table<T> {
    /// Claims in the table.
    pub fn len(&self) -> usize {
        self.claims.len()
    }

    pub fn is_empty(&self) -> bool {
        self.claims.is_empty()
    }

    pub fn payload(&self, id: u64) -> Option<&T> {
        self.claims.get(&id).map(|c| &c.payload)
    }

    pub fn footprint(&self, id: u64) -> Option<&Footprint> {
        self.claims.get(&id).map(|c| &*c.fp)
    }

    /// The first place where `fp` collides with a claim that `ok(id, payload)` accepts (the caller skips, say,
    /// claims it knows to be finished, or those of the same initiator): writing what a claim reads or writes,
    /// or reading what a claim writes.
    pub fn first_conflict(&self, fp: &Footprint, mut ok: impl FnMut(u64, &T) -> bool) -> Option<Conflict> {
        if self.claims.is_empty() {
            return None;
        }
        let mut accept = |id: u64| self.claims.get(&id).is_some_and(|c| ok(id, &c.payload));
        for p in &fp.parts {
            let against: &[Access] = match p.access {
                Access::Write => &[Access::Write, Access::Read],
                Access::Read => &[Access::Write],
            };
            for &theirs in against {
                let Some(runs) = self.runs.get(&(p.space, theirs)) else { continue };
                for r in runs {
                    if let Some((range, other)) = r.first_hit(&p.ranges, &mut accept) {
                        return Some(Conflict { other, space: p.space, mine: p.access, theirs, range });
                    }
                }
            }
        }
        None
    }

    /// Put `fp` in the table as claim `id` (an id already there is replaced). O(1) while no run of its spaces
    /// is of the size class of its ranges; merges otherwise (see `settle`).
    pub fn insert(&mut self, id: u64, fp: Arc<Footprint>, payload: T) {
        self.remove(id);
        for p in &fp.parts {
            let runs = self.runs.entry((p.space, p.access)).or_default();
            runs.push(Run::One { id, ranges: p.ranges.clone() });
            settle(runs);
        }
        self.claims.insert(id, Claim { fp, payload });
    }

    /// Take claim `id` out of the table; its payload, if it was there.
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let c = self.claims.remove(&id)?;
        for p in &c.fp.parts {
            let Some(runs) = self.runs.get_mut(&(p.space, p.access)) else { continue };
            let mut i = 0;
            while i < runs.len() {
                let gone = match &mut runs[i] {
                    Run::One { id: owner, .. } => *owner == id,
                    Run::Many { iv, ids, dead, .. } => {
                        if let Ok(at) = ids.binary_search_by_key(&id, |e| e.0) {
                            *dead += ids.remove(at).1;
                        }
                        ids.is_empty() || 2 * *dead > iv.len()
                    }
                };
                if gone {
                    let r = runs.remove(i);
                    let mut live = Vec::new();
                    let ids = if matches!(r, Run::Many { .. }) { r.live_ivs(&mut live) } else { Vec::new() };
                    if !live.is_empty() {
                        // Rewritten without the claims gone; it may now share a size class with another.
                        runs.push(many(live, ids));
                        settle(runs);
                        i = 0;
                    }
                    continue;
                }
                i += 1;
            }
            // An empty list stays, so a space's next request allocates nothing.
        }
        Some(c.payload)
    }

    /// Runs held for (space, access): O(log K) for K ranges (tests).
    #[cfg(test)]
    fn runs_of(&self, space: Space, access: Access) -> usize {
        self.runs.get(&(space, access)).map_or(0, Vec::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Access::{Read, Write};

    const S: Space = Space { owner: 1, mem: 0, dev: 0 };
    const T: Space = Space { owner: 2, mem: 0, dev: 0 };

    fn fp(parts: &[(Space, Access, u64, u64)]) -> Footprint {
        Footprint::build(parts.iter().copied())
    }

    #[test]
    fn modes_parse() {
        assert_eq!(Mode::parse("WARN"), Some(Mode::Warn));
        assert_eq!(Mode::parse(" refuse "), Some(Mode::Refuse));
        assert_eq!(Mode::parse(""), Some(Mode::Off));
        assert_eq!(Mode::parse("off"), Some(Mode::Off));
        assert_eq!(Mode::parse("yes"), None);
    }

    #[test]
    fn footprints_are_sorted_unions_per_space_and_access() {
        let f = fp(&[(S, Write, 100, 10), (S, Write, 0, 10), (S, Write, 10, 5), (S, Write, 105, 20), (T, Read, 7, 0)]);
        assert_eq!(f.ranges(S, Write), &[(0, 15), (100, 125)]);
        assert!(f.ranges(T, Read).is_empty(), "an empty piece touches nothing");
        assert_eq!(f.parts.len(), 1);
        // Many spaces (20 devices, pieces interleaved): each keeps its own ranges.
        let dev = |d: u64| Space { dev: d, ..S };
        let f = Footprint::build((0..200u64).map(|i| (dev(i % 20), Write, (i / 20) * 100, 10)));
        assert_eq!(f.parts.len(), 20);
        for d in 0..20 {
            let want: Vec<Range> = (0..10u64).map(|k| (k * 100, k * 100 + 10)).collect();
            assert_eq!(f.ranges(dev(d), Write), &want[..], "device {d}");
        }
    }

    /// The rule: write against read or write, read against write; adjacent ranges never; other spaces never.
    #[test]
    fn the_conflict_rule() {
        let mut t: Table<()> = Table::default();
        t.insert(1, Arc::new(fp(&[(S, Write, 0, 100), (T, Read, 1000, 100)])), ());
        let hit = |t: &Table<()>, f: &Footprint| t.first_conflict(f, |_, _| true);
        // Same local range twice, both writing.
        let c = hit(&t, &fp(&[(S, Write, 50, 100)])).unwrap();
        assert_eq!((c.other, c.mine, c.theirs, c.range), (1, Write, Write, (50, 100)));
        // Reading what is being written.
        assert_eq!(hit(&t, &fp(&[(S, Read, 99, 1)])).unwrap().range, (99, 100));
        // Adjacent: none.
        assert_eq!(hit(&t, &fp(&[(S, Write, 100, 100), (T, Write, 1100, 10)])), None);
        // Two readers: none; a writer where one reads: yes.
        assert_eq!(hit(&t, &fp(&[(T, Read, 1000, 100)])), None);
        let c = hit(&t, &fp(&[(T, Write, 1099, 10)])).unwrap();
        assert_eq!((c.space, c.mine, c.theirs, c.range), (T, Write, Read, (1099, 1100)));
        // Same addresses in another space: none.
        assert_eq!(hit(&t, &fp(&[(Space { dev: 1, ..S }, Write, 0, 100)])), None);
        // The caller's filter is obeyed.
        assert_eq!(t.first_conflict(&fp(&[(S, Write, 0, 1)]), |id, _| id != 1), None);
        // Gone from the table: none.
        assert!(t.remove(1).is_some());
        assert_eq!(hit(&t, &fp(&[(S, Write, 0, 100)])), None);
        assert!(t.is_empty() && t.runs.values().all(Vec::is_empty));
    }

    /// A READ and a WRITE from one local buffer: READ writes local memory, WRITE reads it; they conflict only
    /// where they meet, and two WRITEs (both reading it) never.
    #[test]
    fn read_and_write_from_one_buffer() {
        let mut t: Table<&str> = Table::default();
        t.insert(1, Arc::new(fp(&[(S, Read, 0, 4096), (T, Write, 0, 4096)])), "WRITE");
        let any = |f: &Footprint| t.first_conflict(f, |_, _| true).map(|c| c.other);
        assert_eq!(any(&fp(&[(S, Read, 0, 4096), (T, Write, 8192, 4096)])), None, "a second WRITE of it");
        assert_eq!(any(&fp(&[(S, Write, 4096, 4096), (T, Read, 8192, 4096)])), None, "a READ into the next block");
        assert_eq!(any(&fp(&[(S, Write, 2048, 4096), (T, Read, 8192, 4096)])), Some(1), "a READ into the same one");
    }

    /// Merged runs against a brute-force check over random claims, with removals: same answer (whether there is
    /// a conflict), O(log K) runs.
    #[test]
    fn runs_agree_with_brute_force() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut t: Table<()> = Table::default();
        let mut live: HashMap<u64, Vec<(Access, u64, u64)>> = HashMap::new();
        let (mut hits, mut misses) = (0, 0);
        for id in 0..600u64 {
            let n = 1 + rnd(40);
            let pieces: Vec<(Space, Access, u64, u64)> =
                (0..n).map(|_| (S, if rnd(3) == 0 { Write } else { Read }, rnd(1 << 20), 1 + rnd(64))).collect();
            let f = Footprint::build(pieces.iter().copied());
            let brute = live.iter().any(|(_, theirs)| {
                pieces.iter().any(|&(_, a, s, l)| {
                    theirs.iter().any(|&(b, ts, te)| (a == Write || b == Write) && s < te && ts < s + l && l > 0)
                })
            });
            let got = t.first_conflict(&f, |_, _| true);
            assert_eq!(got.is_some(), brute, "claim {id}");
            if let Some(c) = got {
                let theirs = &live[&c.other];
                assert!(theirs.iter().any(|&(b, s, e)| b == c.theirs && s <= c.range.0 && c.range.1 <= e));
                hits += 1;
            } else {
                misses += 1;
            }
            t.insert(id, Arc::new(f), ());
            live.insert(id, pieces.iter().map(|&(_, a, s, l)| (a, s, s + l)).collect());
            if rnd(3) != 0 {
                let gone = *live.keys().nth(rnd(live.len() as u64) as usize).unwrap();
                live.remove(&gone);
                t.remove(gone);
            }
            let k: usize = live.values().map(Vec::len).sum::<usize>().max(2);
            let bound = class(k) as usize + 1;
            assert!(t.runs_of(S, Read) <= bound && t.runs_of(S, Write) <= bound, "too many runs for {k} ranges");
        }
        assert!(hits > 50 && misses > 50, "{hits} conflicts, {misses} none: the cases must cover both");
    }

    #[test]
    fn gallop_finds_the_boundary() {
        let v: Vec<u64> = (0..1000).collect();
        for from in [0usize, 1, 5, 500, 999, 1000] {
            for cut in [0u64, 1, 7, 500, 999, 1000] {
                assert_eq!(gallop(&v, from, |&x| x < cut), (cut as usize).max(from).min(1000), "{from} {cut}");
            }
        }
    }
}
