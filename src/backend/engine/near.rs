//! The NIC nearest a region's memory, for the routes that drive several NICs (RDMA's ports, libfabric's rails):
//! where a registration's memory is (`Place`: its NUMA node, or its GPU's PCI place), which NICs are nearest it
//! (`near`, a mask by NIC index that region tickets carry for the peer's side too), the NICs a request's regions
//! agree on (`common`), and the one a piece takes among those still alive (`choose`: the nearest to both sides
//! first, spread over them in turn). Where the topology sets no NIC apart (no NUMA, no PCI: veths, one socket),
//! every NIC is nearest and pieces spread over all of them.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Where a registration's memory is, for choosing the NIC nearest it.
pub(crate) enum Place {
    /// Host memory on this NUMA node.
    Numa(i32),
    /// Device memory of the GPU at this PCI path (sysfs).
    Pci(String),
    Unknown,
}

impl Place {
    /// Host memory at `addr`: its first page's NUMA node.
    pub(crate) fn host(addr: u64) -> Place {
        crate::os::numa_node_of(addr).map_or(Place::Unknown, Place::Numa)
    }
}

/// The NICs nearest `place` among `nics` (each its NUMA node and PCI path, where known), as a mask by index:
/// those on its NUMA node, or sharing the most of a GPU's PCI path; every NIC where the topology sets none apart.
pub(crate) fn near<'a>(nics: impl IntoIterator<Item = (Option<i32>, Option<&'a str>)>, place: &Place) -> u32 {
    let scores: Vec<usize> = nics
        .into_iter()
        .map(|(numa, pci)| match place {
            Place::Numa(n) => usize::from(numa == Some(*n)),
            Place::Pci(gpu) => {
                pci.map_or(0, |nic| gpu.split('/').zip(nic.split('/')).take_while(|(a, b)| a == b).count())
            }
            Place::Unknown => 0,
        })
        .collect();
    let best = scores.iter().copied().max().unwrap_or(0);
    let all = u32::MAX >> (32 - scores.len().clamp(1, 32));
    if scores.iter().all(|&s| s == best) {
        return all;
    }
    scores.iter().enumerate().filter(|(_, &s)| s == best).fold(0, |m, (i, _)| m | 1 << i)
}

/// The NICs every one of `masks` names (0 in a mask: not said, any); every NIC where they say nothing or
/// disagree.
pub(crate) fn common(masks: impl IntoIterator<Item = u32>) -> u32 {
    let m = masks.into_iter().filter(|&m| m != 0).fold(u32::MAX, |a, m| a & m);
    if m == 0 {
        u32::MAX
    } else {
        m
    }
}

/// The path a piece takes among `paths` (each `(ours, theirs)`: our NIC's index and the peer's): of those
/// `alive`, the ones from a NIC nearest the local memory first (`here`, a mask by our index), then also to one
/// nearest the remote memory (`there`, by the peer's); in turn (`turn`) among the equally near. None: none alive.
pub(crate) fn choose<'a, P>(
    paths: &'a [P],
    ends: impl Fn(&P) -> (usize, usize),
    alive: impl Fn(&P) -> bool,
    (here, there): (u32, u32),
    turn: &AtomicUsize,
) -> Option<&'a P> {
    let bit = |m: u32, i: usize| u32::from(i < 32 && m >> i & 1 != 0);
    let rank = |p: &P| {
        let (l, r) = ends(p);
        2 * bit(here, l) + bit(there, r)
    };
    let best = paths.iter().filter(|p| alive(p)).map(rank).max()?;
    let near = || paths.iter().filter(|p| alive(p) && rank(p) == best);
    let n = near().count().max(1);
    near().nth(turn.fetch_add(1, Ordering::Relaxed) % n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nearest_nics_by_numa_and_pci_and_all_where_nothing_sets_them_apart() {
        let nics = [
            (Some(0), Some("/sys/devices/pci0000:00/0000:00:02.0")),
            (Some(1), Some("/sys/devices/pci0000:80/0000:80:02.0")),
        ];
        assert_eq!(near(nics, &Place::Numa(1)), 0b10);
        assert_eq!(near(nics, &Place::Numa(0)), 0b01);
        assert_eq!(near(nics, &Place::Pci("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0".into())), 0b10);
        assert_eq!(near(nics, &Place::Unknown), 0b11);
        assert_eq!(near([(None, None), (None, None), (None, None)], &Place::Numa(0)), 0b111, "veths: all");
        assert_eq!(common([0b01, 0, 0b11]), 0b01);
        assert_eq!(common([0b01, 0b10]), u32::MAX, "disagreeing regions: any");
        assert_eq!(common([]), u32::MAX);
    }

    #[test]
    fn pieces_take_the_nearest_live_paths_in_turn() {
        let paths = [(0usize, 0usize), (1, 1), (2, 0)];
        let turn = AtomicUsize::new(0);
        let pick = |alive: &dyn Fn(&(usize, usize)) -> bool, near| {
            (0..6).map(|_| *choose(&paths, |p| *p, |p| alive(p), near, &turn).unwrap()).collect::<Vec<_>>()
        };
        // Nothing nearer: all three in turn.
        let all = pick(&|_| true, (u32::MAX, u32::MAX));
        assert!(paths.iter().all(|p| all.iter().filter(|q| *q == p).count() == 2), "{all:?}");
        // Our NICs 1 and 2 near the local memory, the peer's 0 near the remote: (2, 0) only.
        assert!(pick(&|_| true, (0b110, 0b01)).iter().all(|p| *p == (2, 0)));
        // It dead: the next nearest, (1, 1).
        assert!(pick(&|p| *p != (2, 0), (0b110, 0b01)).iter().all(|p| *p == (1, 1)));
        assert!(choose(&paths, |p| *p, |_| false, (u32::MAX, u32::MAX), &turn).is_none());
    }
}
