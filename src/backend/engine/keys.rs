//! Key values a one-sided route never hands out twice (`KeyLedger`), shared by the routes whose device may pick
//! the keys (RDMA: the NIC; libfabric: a provider with `FI_MR_PROV_KEY`). A device may hand the value of a
//! deregistered region's key to a later region, and a peer holding the old handle would then reach the new
//! region. So every value handed out is kept; a registration that gets one used before is moved off the region
//! onto a small local-only buffer kept for the engine's life (a tombstone: the value stays taken, reaching
//! nothing), and the region is registered again.

use std::collections::HashSet;

use parking_lot::Mutex;

use crate::status::{Error, Result};

/// Registrations that may meet a used key value in a row before giving up.
const MAX_KEY_TRIES: usize = 64;

/// The key values one domain handed out, and the tombstones (`T`: a registration and its buffer) that keep
/// reused values taken.
pub(crate) struct KeyLedger<T> {
    used: Mutex<HashSet<u64>>,
    tombstones: Mutex<Vec<T>>,
}

impl<T> KeyLedger<T> {
    /// A ledger where `taken` are in use already (the domain's own scratch regions).
    pub(crate) fn new(taken: impl IntoIterator<Item = u64>) -> KeyLedger<T> {
        KeyLedger { used: Mutex::new(taken.into_iter().collect()), tombstones: Mutex::default() }
    }

    /// A registration made by `reg` whose key (`key`) this domain never handed out before; where the device
    /// gave a used one, the registration is undone (`undo`) and a tombstone made (`tomb`, with its key) before
    /// trying again. `what`: the device, for the error.
    pub(crate) fn register<M>(
        &self,
        what: &str,
        reg: impl Fn() -> Result<M>,
        key: impl Fn(&M) -> u64,
        undo: impl Fn(M) -> Result<()>,
        tomb: impl Fn() -> Result<(T, u64)>,
    ) -> Result<M> {
        for _ in 0..MAX_KEY_TRIES {
            let m = reg()?;
            if self.used.lock().insert(key(&m)) {
                return Ok(m);
            }
            // A value an old handle may still hold: off the region, onto a tombstone that keeps it taken.
            undo(m)?;
            let (t, k) = tomb()?;
            self.used.lock().insert(k);
            self.tombstones.lock().push(t);
        }
        Err(Error::backend(format!("{what} kept handing out used memory keys ({MAX_KEY_TRIES} tries)")))
    }

    /// How many tombstones it keeps (for tests).
    #[cfg(test)]
    pub(crate) fn tombstones(&self) -> usize {
        self.tombstones.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A device that hands out 7 three times, then 8: two tombstones (7 taken by the first registration, then
    /// each reuse moved off), the third registration gets 8; one that only repeats gives up.
    #[test]
    fn a_reused_key_goes_to_a_tombstone_and_the_region_gets_a_fresh_one() {
        let l: KeyLedger<u64> = KeyLedger::new([1]);
        let next = Cell::new(0);
        let keys = [7u64, 7, 1, 8];
        let reg = || {
            let k = keys[next.get().min(keys.len() - 1)];
            next.set(next.get() + 1);
            Ok(k)
        };
        let undone = Cell::new(0);
        let undo = |_| {
            undone.set(undone.get() + 1);
            Ok(())
        };
        assert_eq!(l.register("dev", reg, |k| *k, undo, || Ok((0, 100))).unwrap(), 7);
        assert_eq!(l.register("dev", reg, |k| *k, undo, || Ok((0, 100))).unwrap(), 8);
        assert_eq!((undone.get(), l.tombstones()), (2, 2));
        let stuck = l.register("dev", || Ok(7u64), |k| *k, |_| Ok(()), || Ok((0, 7)));
        assert!(stuck.unwrap_err().to_string().contains("used memory keys"));
    }
}
