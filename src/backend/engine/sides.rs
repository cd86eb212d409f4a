//! Every route's target side and sections, a line per route: the sides an engine starts (`Sides`: what it
//! advertises in its connection info, what it exports for each registration, see `exports`), the
//! connection-info sections routes read (`SECTIONS`), and what each reads of a peer region's ticket (`Tickets`).
//! A new route with a target side of its own adds a line to each.

use std::sync::Arc;
use std::time::Duration;

use super::route::rdma::target::RdmaSide;
use super::route::rdma::wire;
use super::route::tcp::listen::TcpShared;
use super::route::{Side, Transport};
use crate::md::Reader;
use crate::status::Result;

/// This engine's target sides, each where its route runs here (a line per route).
#[derive(Default)]
pub(super) struct Sides {
    pub(super) rdma: Option<Arc<RdmaSide>>,
}

impl Sides {
    /// Start every route's side `transport` allows; `tcp` hands them their connection kinds (served with
    /// `patience`, see `TcpOpts::patience`).
    pub(super) fn start(transport: Transport, agent: &str, tcp: &TcpShared, patience: Duration) -> Sides {
        let rdma = RdmaSide::start_for(transport, agent);
        if let Some(s) = rdma.clone() {
            tcp.set_side(Box::new(move |c| s.serve(c, patience)));
        }
        Sides { rdma }
    }

    /// Every started side, in one order for the engine's life (`exports::Registered` keeps theirs in it).
    pub(super) fn all(&self) -> impl Iterator<Item = &dyn Side> {
        self.rdma.iter().map(|s| &**s as &dyn Side)
    }
}

/// The connection-info sections routes read (the router hands each its own, see `conn::ConnInfo::route`).
pub(super) const SECTIONS: &[u64] = &[wire::SECTION];

/// A peer region's ticket sections, as each route read them (a line per route).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Tickets {
    pub(super) rdma: wire::RdmaKeys,
}

/// Most bytes of one ticket section.
const MAX_TICKET_SECTION: usize = 64 * 1024;

impl Tickets {
    /// The rest of `r` as a region's sections (`id | length | bytes` each); a section no route reads is a part
    /// of a later release: skipped.
    pub(super) fn read(r: &mut Reader<'_>) -> Result<Tickets> {
        let mut all: Vec<(u64, &[u8])> = Vec::new();
        while r.left() != 0 {
            let id = r.uvar()?;
            all.push((id, r.bytes(MAX_TICKET_SECTION)?));
        }
        Ok(Tickets { rdma: wire::read_ticket(&all)? })
    }
}

/// For `crate::fuzzing`: every route's codecs of peers' bytes, on `b`.
pub(super) fn fuzz(b: &[u8]) {
    wire::fuzz(b);
}
