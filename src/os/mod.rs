//! What gixl asks of the Linux kernel beyond `std`, in one place for the engine, the metadata exchange and the
//! storage backends: process identity through pidfds (`proc`) and the exit/exec sentinel (`sentinel`), the
//! event loops' reactor (`reactor`: an epoll set, its wake-up line, tokens handed out by tag), sockets beyond
//! `std::net` (`sock`: vectored I/O on raw memory, non-blocking single calls, timeouts, interface addresses)
//! and descriptors passed over Unix sockets with the peer's credentials (`fdpass`: SCM_RIGHTS, SO_PEERCRED),
//! the NUMA node of a page (`numa_node_of`) and a NIC's place (`nic_place`), and shared libraries opened at run
//! time (`dl`). No policy lives here.

pub(crate) mod dl;
pub(crate) mod fdpass;
mod proc;
mod reactor;
pub(crate) mod sentinel;
pub(crate) mod sock;

pub(crate) use proc::{pidfd_alive, pidfd_getfd, pidfd_open};
pub(crate) use reactor::{epoll, eventfd, wake, woken, Reactor, Tokens};

/// The NUMA node of the page holding `addr` (`get_mempolicy` with `MPOL_F_NODE | MPOL_F_ADDR`; a page not yet
/// allocated is, as a read would). None where the kernel does not say (no NUMA support, an address not mapped).
pub(crate) fn numa_node_of(addr: u64) -> Option<i32> {
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut node: libc::c_int = -1;
    // SAFETY: `node` is a valid out-pointer; no node mask is asked for (NULL, 0); the kernel only reads the
    // caller's page tables for `addr`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr as usize as *mut libc::c_void,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    (r == 0 && node >= 0).then_some(node)
}

/// A NIC's NUMA node and PCI path from its sysfs device folder (`/sys/class/infiniband/mlx5_0/device`,
/// `/sys/class/net/eth0/device`), each where sysfs says (a virtual interface has neither).
pub(crate) fn nic_place(device: &std::path::Path) -> (Option<i32>, Option<String>) {
    let numa = std::fs::read_to_string(device.join("numa_node"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .filter(|&n| n >= 0);
    let pci = std::fs::canonicalize(device).ok().map(|p| p.to_string_lossy().into_owned());
    (numa, pci)
}
