//! Entry points for the fuzz targets (`fuzz/`) and their stable-Rust smoke driver (`tests/fuzz_smoke.rs`):
//! the parsers that read bytes another process wrote. Not an API; nothing here is stable.
//!
//! Each function panics only when it finds a bug (a parser that panics, or an encoding that does not decode
//! back to itself); malformed input is an ordinary `Err`.

use crate::md::AgentMd;

/// The incarnation the notification-frame target expects in a HELLO frame (the seed corpus uses it).
pub const FRAMES_INCARNATION: u128 = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210;

/// `AgentMd::decode`; whatever decodes must re-encode to bytes that decode to the same value.
pub fn md_decode(data: &[u8]) {
    if let Ok(md) = AgentMd::decode(data) {
        let bytes = md.encode();
        let again = AgentMd::decode(&bytes).expect("an encoding of decoded metadata does not decode");
        assert_eq!(again, md, "metadata changed across encode/decode");
    }
}

/// The engine's connection-info parser (inside a peer's metadata).
pub fn engine_conn_info(data: &[u8]) -> bool {
    crate::backend::engine::fuzz_parse_conn(data)
}

/// The engine's notification framing (what the control socket reads from a peer); the first byte picks
/// where the stream is split into two reads.
pub fn engine_notif_frames(data: &[u8]) -> usize {
    let Some((&split, rest)) = data.split_first() else { return 0 };
    crate::backend::engine::fuzz_parse_frames(rest, split as usize * rest.len() / 256, FRAMES_INCARNATION)
}
