//! The notification queue and its bounds, shared by both ways notifications arrive: the local socket (`ctrl`)
//! and TCP control connections (`tcp`).

use parking_lot::Mutex;

/// Largest notification accepted (a frame's body); NIXL users send msgpack'd block lists of a few MiB.
pub const MAX_NOTIF: usize = 64 << 20;

/// Default bounds of the notification queue: when reached, the local sockets and the TCP control connections are
/// not read until the application takes notifications, so senders block and then fail (never a silent drop).
pub const QUEUE_MSGS: usize = 1 << 16;
pub const QUEUE_BYTES: usize = 256 << 20;

/// Notifications received and not yet handed out, in arrival order.
pub type NotifQueue = Mutex<Vec<(String, Vec<u8>)>>;
