//! What gixl asks of the Linux kernel beyond `std`, in one place for the engine, the metadata exchange and the
//! storage backends: process identity through pidfds (`proc`) and the exit/exec sentinel (`sentinel`), the
//! event loops' reactor (`reactor`: an epoll set, its wake-up line, tokens handed out by tag), sockets beyond
//! `std::net` (`sock`: vectored I/O on raw memory, non-blocking single calls, timeouts, interface addresses)
//! and descriptors passed over Unix sockets with the peer's credentials (`fdpass`: SCM_RIGHTS, SO_PEERCRED).
//! No policy lives here.

pub(crate) mod fdpass;
mod proc;
mod reactor;
pub(crate) mod sentinel;
pub(crate) mod sock;

pub(crate) use proc::{pidfd_alive, pidfd_getfd, pidfd_open};
pub(crate) use reactor::{epoll, eventfd, wake, Reactor, Tokens};
