//! Live-handle registries: what makes a released, destroyed or foreign handle an error code instead of
//! undefined behaviour.
//!
//! A C handle is a token, not an address: a number handed out once per object from a process-wide
//! counter and never reused, placed in a non-canonical address range so it can never alias real memory.
//! Each handle type has its own registry mapping live tokens to `Arc`s of their objects. A call looks its
//! handle up (cloning the `Arc`), so a handle destroyed by another thread mid-call stays alive until the
//! call ends, a destroyed handle is simply absent, and a handle of another type is absent from this
//! type's registry. Nothing here ever dereferences a pointer the caller gave us.
//!
//! What this does not do: it does not check that a handle is used with the right *agent* — the objects
//! record their owner and the calls compare it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};

use parking_lot::RwLock;

use super::boundary::Fail;

/// Tokens live above the canonical user address range ("gi" in the top 16 bits on 64-bit machines).
#[cfg(target_pointer_width = "64")]
const BASE: u64 = 0x6769 << 48;
#[cfg(not(target_pointer_width = "64"))]
const BASE: u64 = 0x8000_0000;

static NEXT: AtomicU64 = AtomicU64::new(1);

fn next_token() -> usize {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // 16-byte steps keep tokens looking like aligned pointers.
    (BASE | (n << 4)) as usize
}

pub(crate) struct Registry<T: 'static> {
    /// The handle type's C name, for messages ("agent", "xfer request", ...).
    what: &'static str,
    map: LazyLock<RwLock<HashMap<usize, Arc<T>>>>,
}

impl<T: 'static> Registry<T> {
    pub const fn new(what: &'static str) -> Self {
        Registry { what, map: LazyLock::new(|| RwLock::new(HashMap::new())) }
    }

    /// Register a new object and return its handle.
    pub fn insert<P>(&self, v: T) -> *mut P {
        let t = next_token();
        self.map.write().insert(t, Arc::new(v));
        t as *mut P
    }

    /// The live object behind `h`, or INVALID_PARAM naming the argument.
    pub fn get<P>(&self, h: *mut P, arg: &str) -> Result<Arc<T>, Fail> {
        if h.is_null() {
            return Err(Fail::invalid(format!("{arg} is NULL")));
        }
        self.map.read().get(&(h as usize)).cloned().ok_or_else(|| self.dead(h as usize, arg))
    }

    /// Remove `h` if `check` accepts its object; the check runs under the registry lock, so two threads
    /// destroying one handle cannot both succeed.
    pub fn remove_if<P>(
        &self,
        h: *mut P,
        arg: &str,
        check: impl FnOnce(&T) -> Result<(), Fail>,
    ) -> Result<Arc<T>, Fail> {
        if h.is_null() {
            return Err(Fail::invalid(format!("{arg} is NULL")));
        }
        let mut map = self.map.write();
        let v = map.get(&(h as usize)).ok_or_else(|| self.dead(h as usize, arg))?;
        check(v)?;
        Ok(map.remove(&(h as usize)).expect("present: checked under the same lock"))
    }

    pub fn remove<P>(&self, h: *mut P, arg: &str) -> Result<Arc<T>, Fail> {
        self.remove_if(h, arg, |_| Ok(()))
    }

    fn dead(&self, h: usize, arg: &str) -> Fail {
        Fail::invalid(format!(
            "{arg} ({h:#x}) is not a live {} handle: already destroyed or released, or not a {}",
            self.what, self.what
        ))
    }

    /// Whether some live object passes `f`.
    pub fn any(&self, f: impl Fn(&T) -> bool) -> bool {
        self.map.read().values().any(|v| f(v))
    }

    #[cfg(test)]
    pub fn contains<P>(&self, h: *mut P) -> bool {
        self.map.read().contains_key(&(h as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static NUMS: Registry<u32> = Registry::new("number");
    static WORDS: Registry<&'static str> = Registry::new("word");

    #[test]
    fn tokens_are_unique_aligned_and_typed() {
        let a: *mut u8 = NUMS.insert(1);
        let b: *mut u8 = NUMS.insert(2);
        let w: *mut u8 = WORDS.insert("x");
        assert_ne!(a, b);
        assert_eq!(a as usize % 16, 0);
        assert_eq!(*NUMS.get(a, "a").unwrap(), 1);
        // A handle of another type is not found, whatever its value.
        assert!(NUMS.get(w, "w").is_err());
        assert!(WORDS.get(a, "a").is_err());
        assert!(NUMS.get(std::ptr::null_mut::<u8>(), "n").is_err());
        assert_eq!(*NUMS.remove(a, "a").unwrap(), 1);
        assert!(NUMS.remove(a, "a").is_err());
        assert!(NUMS.get(a, "a").is_err());
        // A refused check leaves the handle live.
        assert!(NUMS.remove_if(b, "b", |_| Err(Fail::invalid("no"))).is_err());
        assert!(NUMS.contains(b));
        NUMS.remove(b, "b").unwrap();
        WORDS.remove(w, "w").unwrap();
    }
}
