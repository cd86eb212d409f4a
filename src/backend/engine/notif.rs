//! The notification queue and its bounds, shared by both ways notifications arrive: the local socket (`ctrl`)
//! and TCP control connections (`route::tcp::listen`).

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Mutex, MutexGuard};

/// Largest notification accepted (a frame's body); NIXL users send msgpack'd block lists of a few MiB.
pub const MAX_NOTIF: usize = 64 << 20;

/// Refuse a notification over `MAX_NOTIF`.
pub fn check(msg: &[u8]) -> crate::status::Result<()> {
    match msg.len() {
        n if n > MAX_NOTIF => Err(crate::status::Error::invalid_param(format!(
            "notification of {n} bytes exceeds the {MAX_NOTIF}-byte limit"
        ))),
        _ => Ok(()),
    }
}

/// Default bounds of the notification queue: when reached, the local sockets and the TCP control connections are
/// not read until the application takes notifications, so senders block and then fail (never a silent drop).
pub const QUEUE_MSGS: usize = 1 << 16;
pub const QUEUE_BYTES: usize = 256 << 20;

/// Notifications received and not yet handed out, in arrival order, and the bounds both readers (the local
/// socket's and the TCP control connections') stop at.
pub struct NotifQueue {
    items: Mutex<Vec<(String, Vec<u8>)>>,
    msgs: AtomicUsize,
    bytes: AtomicUsize,
}

impl Default for NotifQueue {
    fn default() -> NotifQueue {
        NotifQueue { items: Mutex::default(), msgs: AtomicUsize::new(QUEUE_MSGS), bytes: AtomicUsize::new(QUEUE_BYTES) }
    }
}

impl NotifQueue {
    pub fn lock(&self) -> MutexGuard<'_, Vec<(String, Vec<u8>)>> {
        self.items.lock()
    }

    /// Bound the queue: at `msgs` notifications or `bytes` bytes (names included) it is full.
    pub fn set_bounds(&self, msgs: usize, bytes: usize) {
        self.msgs.store(msgs, Ordering::Relaxed);
        self.bytes.store(bytes, Ordering::Relaxed);
    }

    /// What the queue holds now, (notifications, bytes).
    pub fn held(&self) -> (usize, usize) {
        let q = self.items.lock();
        (q.len(), q.iter().map(|(n, m)| n.len() + m.len()).sum())
    }

    /// Is a queue holding `held` (as `held` counts) full?
    pub fn full(&self, held: (usize, usize)) -> bool {
        held.0 >= self.msgs.load(Ordering::Relaxed) || held.1 >= self.bytes.load(Ordering::Relaxed)
    }
}
