//! The network routes beside TCP (`NET`, a line each: a new route is its folder, its `mod` line in `route` and a
//! line here), and what the engine keeps of each through that list: the sides it starts (`Sides`: what it
//! advertises in its connection info and exports for each registration, see `exports`) and what each reads of a
//! peer region's ticket (`read_tickets`). The router tries them in this order before TCP.

use std::sync::Arc;
use std::time::Duration;

use super::route::fabric::FABRIC;
use super::route::rdma::RDMA;
use super::route::tcp::listen::TcpShared;
use super::route::{Net, Setting, Side, Tickets, Transport};
use crate::md::Reader;
use crate::status::Result;

/// The network routes beside TCP, in the order the router tries them.
pub(super) const NET: &[&dyn Net] = &[&RDMA, &FABRIC];

/// This engine's target sides, by `NET`'s order, each where its route runs here.
pub(super) struct Sides(Vec<Option<Arc<dyn Side>>>);

impl Sides {
    /// Start every route's side `transport` allows; `tcp` hands them their connection kinds (served with
    /// `patience`, see `TcpOpts::patience`); `setting` reads their options.
    pub(super) fn start(
        transport: Transport,
        agent: &str,
        tcp: &TcpShared,
        patience: Duration,
        setting: Setting,
    ) -> Sides {
        Sides(NET.iter().map(|n| n.start(transport, agent, tcp, patience, setting)).collect())
    }

    /// Every route beside TCP that runs here, with its side.
    pub(super) fn routes(&self) -> impl Iterator<Item = (&'static dyn Net, &Arc<dyn Side>)> {
        NET.iter().copied().zip(&self.0).filter_map(|(n, s)| Some((n, s.as_ref()?)))
    }

    /// Every started side, in one order for the engine's life (`exports::Registered` keeps theirs in it).
    pub(super) fn all(&self) -> impl Iterator<Item = &dyn Side> {
        self.0.iter().flatten().map(|s| &**s)
    }
}

/// Whether `id` is a route's connection-info section (`conn::ConnInfo::route`).
pub(super) fn is_section(id: u64) -> bool {
    NET.iter().any(|n| n.section() == id)
}

/// Most bytes of one ticket section.
const MAX_TICKET_SECTION: usize = 64 * 1024;

/// The rest of `r` as a region's ticket sections (`id | length | bytes` each), as each route reads them; a
/// section no route reads is a part of a later release: skipped.
pub(super) fn read_tickets(r: &mut Reader<'_>) -> Result<Tickets> {
    let mut all: Vec<(u64, &[u8])> = Vec::new();
    while r.left() != 0 {
        all.push((r.uvar()?, r.bytes(MAX_TICKET_SECTION)?));
    }
    NET.iter().filter_map(|n| n.read_ticket(&all).transpose()).collect::<Result<_>>().map(Tickets)
}

/// For `crate::fuzzing`: every route's codecs of peers' bytes, on `b`.
pub(super) fn fuzz(b: &[u8]) {
    NET.iter().for_each(|n| n.fuzz(b));
}
