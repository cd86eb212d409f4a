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
        // Signed with a cluster key, it opens with that key only.
        let key = crate::auth::ClusterKey::parse("gixl-fuzz-cluster-key").expect("test key");
        let sealed = md.seal(Some(&key));
        assert_eq!(AgentMd::open(&sealed, Some(&key)).expect("a sealed blob does not open"), md);
        assert!(AgentMd::open(&sealed, None).is_err());
    }
    // Whatever opens under the key is also well-formed metadata.
    if let Ok(key) = crate::auth::ClusterKey::parse("gixl-fuzz-cluster-key") {
        if let Ok(md) = AgentMd::open(data, Some(&key)) {
            assert_eq!(AgentMd::open(&md.seal(Some(&key)), Some(&key)).ok(), Some(md));
        }
    }
}

/// The engine's connection-info parser (inside a peer's metadata).
pub fn engine_conn_info(data: &[u8]) -> bool {
    crate::backend::engine::fuzz_parse_conn(data)
}

/// Connection info of layout 3 rewritten as layout 4 (tagged sections, one unknown to this release): a seed.
pub fn engine_conn_info_as_v4(v3: &[u8]) -> Option<Vec<u8>> {
    crate::backend::engine::fuzz_conn_as_v4(v3)
}

/// The engine's notification framing (what the local socket reads from a peer, after its challenge, which
/// here is the zero nonce, with `FRAMES_INCARNATION` as the secret too); the first byte picks where the stream
/// is split into two reads.
pub fn engine_notif_frames(data: &[u8]) -> usize {
    let Some((&split, rest)) = data.split_first() else { return 0 };
    crate::backend::engine::fuzz_parse_frames(rest, split as usize * rest.len() / 256, FRAMES_INCARNATION)
}

/// An authenticated hello frame from `from` for `engine_notif_frames`' connection, for the seed corpus.
pub fn engine_notif_hello(from: &str) -> Vec<u8> {
    crate::backend::engine::fuzz_hello(FRAMES_INCARNATION, from)
}

// -- TCP transport (`backend::engine::wire`) --------------------------------------------------------------

/// The secret the `tcp_wire` target computes HELLO tags with (exercises `hello_tag`/`tags_match`).
pub const TCP_SECRET: u128 = 0x5eed_0000_0000_0000_0000_0000_0000_0001;

/// The `tcp_wire` target's selectors: the first input byte modulo 5 picks the message.
pub const TCP_CHALLENGE: u8 = 0;
pub const TCP_HELLO: u8 = 1;
pub const TCP_CTRL: u8 = 2;
pub const TCP_REQUEST: u8 = 3;
pub const TCP_REPLY: u8 = 4;

/// The region table data requests are checked against: (address, length) → registration count, one of them
/// released (count 0).
pub fn tcp_region_table() -> crate::backend::engine::wire::RegionTable {
    [((0x1000, 0x1000), 1), ((0x10_0000, 0x100), 2), ((0x20_0000, 0x10), 0), ((u64::MAX - 0xff, 0x100), 1)]
        .into_iter()
        .collect()
}

/// Every message the TCP route reads from a peer (`backend::engine::wire`), picked by the first byte
/// (`TCP_CHALLENGE`..`TCP_REPLY`, modulo 5). Whatever parses must re-encode to the bytes it was parsed from;
/// an incomplete message must stay incomplete for every shorter prefix; `segs_allowed` must agree with a
/// naive check in 128-bit arithmetic.
pub fn tcp_wire(data: &[u8]) {
    use crate::backend::engine::wire::*;
    let Some((&sel, rest)) = data.split_first() else { return };
    match sel % 5 {
        TCP_CHALLENGE => {
            if rest.len() >= CHALLENGE_BYTES {
                let c: &[u8; CHALLENGE_BYTES] = rest[..CHALLENGE_BYTES].try_into().unwrap();
                if let Ok(nonce) = parse_challenge(c) {
                    assert_eq!(&encode_challenge(&nonce), c, "challenge changed across parse/encode");
                }
            }
        }
        TCP_HELLO => match parse_hello(rest) {
            Ok(Some((h, used))) => {
                assert!(used <= rest.len());
                assert_eq!(encode_hello(&h), &rest[..used], "HELLO changed across parse/encode");
                assert!(h.kind == KIND_CTRL || h.kind == KIND_DATA || KIND_ROUTES.contains(&h.kind));
                assert!(!h.name.is_empty() && h.name.len() <= MAX_NAME);
                assert_eq!(parse_hello(&rest[..used - 1]), Ok(None), "a HELLO's prefix is not incomplete");
                let nonce = [sel; 16];
                let t = hello_tag(TCP_SECRET, h.kind, h.incarnation, &nonce, &h.name);
                assert_eq!(tags_match(t, h.tag), t == h.tag);
            }
            Ok(None) => {
                for n in [0, rest.len() / 2, rest.len().saturating_sub(1)] {
                    assert_eq!(parse_hello(&rest[..n.min(rest.len())]), Ok(None), "a prefix of an incomplete HELLO");
                }
            }
            Err(_) => {}
        },
        TCP_CTRL => {
            // The next byte sets the body limit; then frames are read as a stream, as the control link does.
            let Some((&lim, mut buf)) = rest.split_first() else { return };
            let max_body = if lim == 0xff { 1 << 20 } else { lim as usize * 4 };
            while let Ok(Some((m, used))) = parse_ctrl(buf, max_body) {
                assert!(used >= 5 && used <= buf.len());
                let mut again = Vec::new();
                match m {
                    CtrlMsg::Ping => again.extend_from_slice(&encode_ctrl_head(CTRL_PING, 0)),
                    CtrlMsg::Pong => again.extend_from_slice(&encode_ctrl_head(CTRL_PONG, 0)),
                    CtrlMsg::Notif(b) => {
                        assert!(b.len() <= max_body);
                        again.extend_from_slice(&encode_ctrl_head(CTRL_NOTIF, b.len()));
                        again.extend_from_slice(b);
                    }
                }
                assert_eq!(again, &buf[..used], "control frame changed across parse/encode");
                assert_eq!(
                    parse_ctrl(&buf[..used - 1], max_body),
                    Ok(None),
                    "a control frame's prefix is not incomplete"
                );
                buf = &buf[used..];
            }
        }
        TCP_REQUEST => {
            if rest.len() < REQ_HEADER {
                return;
            }
            let hb: &[u8; REQ_HEADER] = rest[..REQ_HEADER].try_into().unwrap();
            let Ok(h) = parse_req_header(hb) else { return };
            assert!(h.nseg >= 1 && h.nseg <= MAX_SEGS && h.total <= MAX_REQ_BYTES);
            let body = &rest[REQ_HEADER..];
            // The target reads exactly the table the header announces; also try the whole rest.
            let table_len = h.nseg * SEG_BYTES;
            if body.len() != table_len {
                assert!(parse_segs(body, &h).is_err(), "a segment table of the wrong size parsed");
            }
            if body.len() < table_len {
                return;
            }
            let Ok(segs) = parse_segs(&body[..table_len], &h) else { return };
            assert_eq!(segs.len(), h.nseg);
            let mut again = Vec::new();
            encode_req(h.op, &segs, &mut again);
            assert_eq!(again, &rest[..REQ_HEADER + table_len], "request changed across parse/encode");
            let t = tcp_region_table();
            // Each range in 128 bits; a region or segment ending at or past 2^64 is refused (it cannot be
            // registered memory), so the table's last region is never usable.
            let max = u64::MAX as u128;
            let naive = segs.iter().all(|s| {
                let (r, rl, a, l) = (s.region as u128, s.region_len as u128, s.addr as u128, s.len as u128);
                l > 0
                    && t.get(&(s.region, s.region_len)).is_some_and(|&n| n > 0)
                    && a >= r
                    && a + l <= r + rl
                    && r + rl <= max
                    && a + l <= max
            });
            assert_eq!(segs_allowed(&t, &segs), naive, "segs_allowed disagrees with the naive check");
        }
        _ => {
            if rest.len() >= REPLY_BYTES {
                let r: &[u8; REPLY_BYTES] = rest[..REPLY_BYTES].try_into().unwrap();
                if let Ok(ok) = parse_reply(r) {
                    assert_eq!(
                        &encode_reply(if ok { REPLY_OK } else { REPLY_DENIED }),
                        r,
                        "reply changed across parse/encode"
                    );
                }
            }
        }
    }
}

// -- metadata listener (`mdx::wire`) -------------------------------------------------------------------------

/// The metadata listener's frames (`mdx::wire::parse`), read as a stream: each frame must re-encode to the
/// bytes it was parsed from, parse back to itself, and every shorter prefix must be incomplete. A LOAD's
/// payload goes on to `md_decode`, as the listener hands it to `load_remote_md`.
pub fn mdx_wire(data: &[u8]) -> usize {
    use crate::mdx::wire::*;
    let mut buf = data;
    let mut n = 0;
    loop {
        match parse(buf) {
            Ok(Some((m, used))) => {
                assert!(used >= HEADER && used <= buf.len());
                let again = encode(&m);
                assert_eq!(again, &buf[..used], "metadata frame changed across parse/encode");
                assert_eq!(parse(&again), Ok(Some((m, used))));
                assert_eq!(parse(&buf[..used - 1]), Ok(None), "a metadata frame's prefix is not incomplete");
                if let Msg::Load(md) = m {
                    md_decode(md);
                }
                buf = &buf[used..];
                n += 1;
            }
            Ok(None) => {
                assert!(
                    buf.len() < HEADER
                        || buf.len() - HEADER < u32::from_le_bytes(buf[5..9].try_into().unwrap()) as usize
                );
                return n;
            }
            Err(_) => return n,
        }
    }
}

/// A metadata-listener frame from the real encoder (`mdx::wire::encode`), for the seed corpus: kind 1 LOAD,
/// 2 SEND, 3 INVL, 4 ERR, 5 CHAL (16-byte body); kinds 1–3 with bit 0x80 are signed with a test cluster key
/// over the zero nonce as request 0. `None` for another kind or a name that is not UTF-8.
pub fn mdx_encode(kind: u8, body: &[u8]) -> Option<Vec<u8>> {
    use crate::mdx::wire::{encode, sign, Msg};
    let text = || std::str::from_utf8(body).ok();
    let m = match kind & 0x7f {
        1 => Msg::Load(body),
        2 => Msg::Send(text()?),
        3 => Msg::Invl(text()?),
        4 if kind == 4 => Msg::Err(text()?),
        5 if kind == 5 => Msg::Chal(body.try_into().ok()?),
        _ => return None,
    };
    let f = encode(&m);
    if kind & 0x80 == 0 {
        return Some(f);
    }
    let key = crate::auth::ClusterKey::parse("gixl-fuzz-cluster-key").ok()?;
    Some(sign(&f, &key, &[0; 16], 0))
}
