//! Who may steer an agent: the optional cluster key, and the keyed tags connections prove themselves with.
//!
//! Without a cluster key gixl follows NIXL's trust model (whoever can read an agent's metadata may transfer
//! into its registered memory; the listener answers whoever asks), tightened: local sockets take only the
//! same uid (or root, or `GIXL_ALLOW_UIDS`), and every control and data connection proves knowledge of the
//! target's per-engine secret with a tag over a fresh nonce (the secret never crosses a socket).
//!
//! With a cluster key (`GIXL_CLUSTER_KEY`, or `GIXL_CLUSTER_KEY_FILE` naming a file that holds it) every
//! metadata blob carries an HMAC-SHA256 over its bytes (so an etcd value or a listener LOAD is loaded only if
//! a key holder made it), every listener frame is signed over the listener's nonce and a sequence number, and
//! the connection secrets are replaced by `HMAC(key, secret)`, so a peer without the key cannot finish any
//! handshake. Several keys separated by commas rotate: the first signs, any is accepted.
//!
//! HMAC-SHA256 (the `hmac` and `sha2` crates) for everything the key covers: metadata blobs are up to 16 MiB
//! and stored outside the process (etcd), where a 64-bit SipHash tag would be the weak point of the whole
//! scheme. The per-connection tags stay SipHash-2-4 over short inputs (a PRF is all they need, the nonce is
//! fresh and a wrong guess closes the connection), keyed by the HMAC-derived secret when a key is set.

use std::sync::OnceLock;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::status::{Error, Result};

/// Length of an HMAC-SHA256 tag.
pub const TAG: usize = 32;
/// Shortest key accepted: 16 bytes (128 bits if random).
pub const MIN_KEY: usize = 16;

/// The cluster keys: `keys[0]` signs, every one is accepted.
#[derive(Clone)]
pub struct ClusterKey {
    keys: Vec<Vec<u8>>,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterKey({} keys)", self.keys.len())
    }
}

impl ClusterKey {
    /// `"new,old,..."`: keys separated by commas (surrounding blanks ignored), each at least `MIN_KEY` bytes.
    pub fn parse(s: &str) -> Result<ClusterKey> {
        let keys: Vec<Vec<u8>> = s.split(',').map(|k| k.trim().as_bytes().to_vec()).filter(|k| !k.is_empty()).collect();
        if keys.is_empty() {
            return Err(Error::invalid_param("the cluster key is empty"));
        }
        if let Some(k) = keys.iter().find(|k| k.len() < MIN_KEY) {
            return Err(Error::invalid_param(format!(
                "a cluster key of {} bytes is too short (at least {MIN_KEY})",
                k.len()
            )));
        }
        Ok(ClusterKey { keys })
    }

    fn mac(key: &[u8], domain: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
        // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
        m.update(domain);
        for p in parts {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }

    /// Tag `parts` (each length-prefixed) under `domain` with the signing key.
    pub fn sign(&self, domain: &[u8], parts: &[&[u8]]) -> [u8; TAG] {
        Self::mac(&self.keys[0], domain, parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is valid under any of the keys (each comparison in constant time).
    pub fn verify(&self, domain: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut ok = false;
        for k in &self.keys {
            ok |= Self::mac(k, domain, parts).verify_slice(tag).is_ok();
        }
        ok
    }

    /// The connection secret under key `i`: what both sides of a handshake key their tags with.
    fn derive(&self, i: usize, secret: u128) -> u128 {
        let t = Self::mac(&self.keys[i], b"gixl-conn-secret", &[&secret.to_le_bytes()]).finalize().into_bytes();
        let mut b = [0u8; 16];
        b.copy_from_slice(&t[..16]);
        u128::from_le_bytes(b)
    }
}

/// The process's cluster key, read once from `GIXL_CLUSTER_KEY` or the file `GIXL_CLUSTER_KEY_FILE`.
/// A key that is set but unusable (unreadable file, too short) is reported once and makes every keyed
/// operation fail rather than silently run without authentication.
pub fn cluster() -> Option<&'static ClusterKey> {
    cluster_state().as_ref().ok().and_then(|k| k.as_ref())
}

/// `Err` when a cluster key was configured but cannot be used.
pub fn cluster_error() -> Option<&'static Error> {
    cluster_state().as_ref().err()
}

fn cluster_state() -> &'static std::result::Result<Option<ClusterKey>, Error> {
    static KEY: OnceLock<std::result::Result<Option<ClusterKey>, Error>> = OnceLock::new();
    KEY.get_or_init(|| {
        let r = from_env(std::env::var("GIXL_CLUSTER_KEY").ok(), std::env::var("GIXL_CLUSTER_KEY_FILE").ok());
        if let Err(e) = &r {
            eprintln!("gixl ERROR: {e}");
        }
        r
    })
}

fn from_env(key: Option<String>, file: Option<String>) -> Result<Option<ClusterKey>> {
    if let Some(k) = key.filter(|k| !k.trim().is_empty()) {
        return ClusterKey::parse(&k).map(Some);
    }
    match file.filter(|f| !f.trim().is_empty()) {
        Some(f) => {
            let text = std::fs::read_to_string(f.trim())
                .map_err(|e| Error::invalid_param(format!("GIXL_CLUSTER_KEY_FILE '{f}' cannot be read: {e}")))?;
            ClusterKey::parse(text.trim()).map(Some)
        }
        None => Ok(None),
    }
}

/// Fail when a configured cluster key is unusable (called where agents are created).
pub fn check_configured() -> Result<()> {
    match cluster_error() {
        Some(e) => Err(Error::invalid_param(format!("{e}"))),
        None => Ok(()),
    }
}

/// The secret a connection's tag is keyed with when it is signed: `secret` itself without a cluster key,
/// else the signing key's derivation.
pub fn signing_secret(secret: u128) -> u128 {
    match cluster() {
        Some(k) => k.derive(0, secret),
        None => secret,
    }
}

/// Every secret a tag may be keyed with on the accepting side (one per key while keys rotate).
pub fn accepted_secrets(secret: u128) -> Vec<u128> {
    match cluster() {
        Some(k) => (0..k.keys.len()).map(|i| k.derive(i, secret)).collect(),
        None => vec![secret],
    }
}

/// A connection hello's tag (`secret_hello_tag`), keyed as above.
pub fn hello_tag(secret: u128, kind: u8, incarnation: u128, nonce: &[u8; 16], name: &str) -> u64 {
    secret_hello_tag(signing_secret(secret), kind, incarnation, nonce, name)
}

/// Whether `tag` is a valid hello tag under any accepted key.
pub fn hello_ok(secret: u128, kind: u8, incarnation: u128, nonce: &[u8; 16], name: &str, tag: u64) -> bool {
    let mut ok = false;
    for s in accepted_secrets(secret) {
        ok |= tags_match(tag, secret_hello_tag(s, kind, incarnation, nonce, name));
    }
    ok
}

/// The proof an initiator sends in a connection's hello (`engine::wire`): a MAC of the connection's parameters
/// under the target's engine secret itself (see `hello_tag` for the one keyed by the cluster key too).
pub fn secret_hello_tag(secret: u128, kind: u8, incarnation: u128, nonce: &[u8; 16], name: &str) -> u64 {
    let mut m = Vec::with_capacity(10 + 1 + 16 + 16 + name.len());
    m.extend_from_slice(b"gixl-hello");
    m.push(kind);
    m.extend_from_slice(&incarnation.to_le_bytes());
    m.extend_from_slice(nonce);
    m.extend_from_slice(name.as_bytes());
    siphash24(secret, &m)
}

/// Compare two tags in time independent of where they differ.
pub fn tags_match(a: u64, b: u64) -> bool {
    let (a, b) = (std::hint::black_box(a.to_le_bytes()), std::hint::black_box(b.to_le_bytes()));
    let mut diff = 0u8;
    for i in 0..8 {
        diff |= a[i] ^ b[i];
    }
    std::hint::black_box(diff) == 0
}

/// SipHash-2-4 (Aumasson and Bernstein) with a 128-bit key: a PRF for short messages.
pub fn siphash24(key: u128, m: &[u8]) -> u64 {
    let k = key.to_le_bytes();
    let (k0, k1) = (u64::from_le_bytes(arr(&k[..8])), u64::from_le_bytes(arr(&k[8..])));
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    fn round(v: &mut [u64; 4]) {
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    }
    fn compress(w: u64, v: &mut [u64; 4]) {
        v[3] ^= w;
        round(v);
        round(v);
        v[0] ^= w;
    }
    let chunks = m.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        compress(u64::from_le_bytes(arr(c)), &mut v);
    }
    let mut last = [0u8; 8];
    last[..rest.len()].copy_from_slice(rest);
    last[7] = m.len() as u8;
    compress(u64::from_le_bytes(last), &mut v);
    v[2] ^= 0xff;
    for _ in 0..4 {
        round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

/// The first N bytes of `b` (which has at least N).
fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[..N]);
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siphash_reference_vector() {
        // The SipHash paper's test vector: key 00..0f, message 00..0e.
        let key = u128::from_le_bytes(std::array::from_fn(|i| i as u8));
        let m: Vec<u8> = (0..15).collect();
        assert_eq!(siphash24(key, &m), 0xa129_ca61_49be_45e5);
        assert_eq!(siphash24(key, &[]), 0x726f_db47_dd0e_0e31);
    }

    #[test]
    fn keys_parse_rotate_and_verify() {
        assert!(ClusterKey::parse("").is_err());
        assert!(ClusterKey::parse("short").is_err());
        let new = ClusterKey::parse("0123456789abcdef-new").unwrap();
        let both = ClusterKey::parse(" 0123456789abcdef-new , 0123456789abcdef-old ").unwrap();
        let old = ClusterKey::parse("0123456789abcdef-old").unwrap();
        let t = old.sign(b"d", &[b"x", b"y"]);
        assert!(both.verify(b"d", &[b"x", b"y"], &t), "an old signature is accepted during rotation");
        assert!(!new.verify(b"d", &[b"x", b"y"], &t));
        assert!(!both.verify(b"e", &[b"x", b"y"], &t), "domains separate");
        assert!(!both.verify(b"d", &[b"xy"], &t), "parts are length-prefixed");
        assert!(!both.verify(b"d", &[b"x", b"y"], &t[..31]));
        let s = both.sign(b"d", &[b"z"]);
        assert!(new.verify(b"d", &[b"z"], &s) && !old.verify(b"d", &[b"z"], &s), "the first key signs");
        assert_ne!(new.derive(0, 5), old.derive(0, 5));
        assert_eq!(both.derive(1, 5), old.derive(0, 5));
    }

    #[test]
    fn key_from_env_and_file() {
        assert!(from_env(None, None).unwrap().is_none());
        assert!(from_env(Some("  ".into()), None).unwrap().is_none());
        assert!(from_env(Some("0123456789abcdef".into()), None).unwrap().is_some());
        assert!(from_env(None, Some("/nonexistent/gixl-key".into())).is_err());
        let p = std::env::temp_dir().join(format!("gixl-key-{}", std::process::id()));
        std::fs::write(&p, "0123456789abcdef,fedcba9876543210\n").unwrap();
        let k = from_env(None, Some(p.display().to_string())).unwrap().unwrap();
        assert_eq!(k.keys.len(), 2);
        std::fs::remove_file(&p).unwrap();
    }
}
