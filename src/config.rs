//! NIXL's configuration lookup, which gixl follows for NIXL's own options (`NIXL_TELEMETRY_*`,
//! `NIXL_ETCD_ENDPOINTS`, `NIXL_ETCD_NAMESPACE`, `NIXL_TCPSTORE_ENDPOINT`), as NIXL 1.5.1 does:
//!
//! - The environment first. A variable that is set wins, even when its value is then refused.
//! - Else a TOML config file: the one `NIXL_CONFIG_FILE` names (it must then exist and parse), else
//!   `$HOME/.nixl.cfg`, else `/etc/nixl.cfg`, whichever exists first. There is no fallback to the next file when
//!   the chosen one cannot be read or parsed. The file is read once per process.
//! - Only top-level keys count, under the option's exact name (`NIXL_TELEMETRY_ENABLE = true`). Each option has
//!   a TOML type: a string, an integer, or a boolean (a real TOML boolean: `"yes"` is a string). A value of
//!   another type, or a file that does not parse, fails agent creation with INVALID_PARAM, saying why, where
//!   NIXL fails it with a runtime error.
//!
//! gixl's own settings (`GIXL_*`) are read from the environment only.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::status::{Error, Result};

/// The TOML type an option takes in the config file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Str,
    Int,
    Bool,
}

/// The config file in use: its path and top-level table.
type Loaded = (PathBuf, toml::Table);

fn file() -> &'static std::result::Result<Option<Loaded>, String> {
    static FILE: OnceLock<std::result::Result<Option<Loaded>, String>> = OnceLock::new();
    FILE.get_or_init(|| {
        let named = std::env::var_os("NIXL_CONFIG_FILE").map(PathBuf::from);
        // Set but empty names no file, and NIXL does not look further: it fails to open "".
        if named.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err("the config file \"\" (NIXL_CONFIG_FILE is set and empty) cannot be read".to_owned());
        }
        let home = std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| Path::new(&h).join(".nixl.cfg"));
        match choose(named, home, |p| p.is_file()) {
            Some(path) => load(&path).map(|t| Some((path, t))),
            None => Ok(None),
        }
    })
}

/// Which file NIXL's order picks: the named one (whether or not it exists), else the first that exists.
fn choose(named: Option<PathBuf>, home: Option<PathBuf>, exists: impl Fn(&Path) -> bool) -> Option<PathBuf> {
    if named.is_some() {
        return named;
    }
    home.into_iter().chain([PathBuf::from("/etc/nixl.cfg")]).find(|p| exists(p))
}

/// Largest config file read (NIXL's are a few lines).
const MAX_FILE: u64 = 1 << 20;

/// Read and parse a config file: a regular file of at most `MAX_FILE` bytes. Opened without blocking, so a
/// FIFO or a device named by `NIXL_CONFIG_FILE` is refused at once instead of hanging agent creation (a FIFO)
/// or reading without end (`/dev/zero`).
fn load(path: &Path) -> std::result::Result<toml::Table, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let cannot = |e: std::io::Error| format!("the config file {} cannot be read: {e}", path.display());
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(cannot)?;
    let m = f.metadata().map_err(cannot)?;
    if !m.file_type().is_file() {
        return Err(format!("the config file {} is not a regular file", path.display()));
    }
    if m.len() > MAX_FILE {
        return Err(format!("the config file {} is {} bytes; at most {MAX_FILE} are read", path.display(), m.len()));
    }
    let mut text = String::new();
    f.take(MAX_FILE + 1).read_to_string(&mut text).map_err(cannot)?;
    if text.len() as u64 > MAX_FILE {
        return Err(format!("the config file {} grew past {MAX_FILE} bytes while read", path.display()));
    }
    text.parse::<toml::Table>().map_err(|e| format!("the config file {} is not valid TOML: {e}", path.display()))
}

/// Option `name` as text: the environment's value, else the config file's (a boolean as `true`/`false`, an
/// integer in decimal). None when neither has it.
pub(crate) fn get(name: &str, kind: Kind) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) => return Ok(Some(v)),
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(Error::invalid_param(format!("the environment variable {name} is not UTF-8")))
        }
        Err(std::env::VarError::NotPresent) => {}
    }
    match file() {
        Ok(Some((path, table))) => from_table(table, path, name, kind),
        Ok(None) => Ok(None),
        Err(why) => Err(Error::invalid_param(format!("{why} (looking up {name})"))),
    }
}

fn from_table(table: &toml::Table, path: &Path, name: &str, kind: Kind) -> Result<Option<String>> {
    let Some(v) = table.get(name) else { return Ok(None) };
    let want = match kind {
        Kind::Str => "string",
        Kind::Int => "integer",
        Kind::Bool => "boolean",
    };
    match (kind, v) {
        (Kind::Str, toml::Value::String(s)) => Ok(Some(s.clone())),
        (Kind::Int, toml::Value::Integer(i)) => Ok(Some(i.to_string())),
        (Kind::Bool, toml::Value::Boolean(b)) => Ok(Some(b.to_string())),
        _ => Err(Error::invalid_param(format!(
            "{name} in the config file {} is a TOML {}, where a {want} is expected",
            path.display(),
            v.type_str()
        ))),
    }
}

/// A yes/no option: NIXL's words (`y`, `yes`, `on`, `1`, `true`, `enable` and `n`, `no`, `off`, `0`,
/// `false`, `disable`, any case, nothing around them); anything else is refused, as NIXL refuses it.
pub(crate) fn flag(name: &str) -> Result<Option<bool>> {
    let Some(v) = get(name, Kind::Bool)? else { return Ok(None) };
    match v.to_ascii_lowercase().as_str() {
        "y" | "yes" | "1" | "true" | "on" | "enable" => Ok(Some(true)),
        "n" | "no" | "0" | "false" | "off" | "disable" => Ok(Some(false)),
        _ => Err(Error::invalid_param(format!(
            "{name}={v:?} is not a yes/no value (y, yes, on, 1, true, enable; n, no, off, 0, false, disable)"
        ))),
    }
}

/// An unsigned integer as NIXL reads one (`std::from_chars`): decimal digits, or `0x`/`0X` and hex digits; no
/// sign, no spaces, nothing after; at most `max`.
pub(crate) fn parse_unsigned(v: &str, max: u64) -> Option<u64> {
    let n = match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(hex) if !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()) => u64::from_str_radix(hex, 16).ok(),
        Some(_) => None,
        None if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => v.parse().ok(),
        None => None,
    };
    n.filter(|&n| n <= max)
}

/// A signed integer as NIXL reads one (`long`): an optional `-`, then decimal digits, nothing around them.
pub(crate) fn parse_signed(v: &str) -> Option<i64> {
    let digits = v.strip_prefix('-').unwrap_or(v);
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then(|| v.parse().ok()).flatten()
}

/// Option `name` as an unsigned integer of at most `max` (environment or config file), refused as NIXL refuses
/// it when it is not one.
pub(crate) fn unsigned(name: &str, max: u64) -> Result<Option<u64>> {
    let Some(v) = get(name, Kind::Int)? else { return Ok(None) };
    parse_unsigned(&v, max)
        .map(Some)
        .ok_or_else(|| Error::invalid_param(format!("{name}={v:?} is not a whole number from 0 to {max}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a regular file of a sane size is read: a FIFO is refused at once (it hung agent creation until a
    /// writer came), `/dev/zero` too (it was read for 4 GiB), and so is a file of 2 MiB.
    #[test]
    fn only_a_small_regular_file_is_read() {
        let dir = std::env::temp_dir().join(format!("gixl-cfg-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo.cfg");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = load(&fifo).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
        let e = load(Path::new("/dev/zero")).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
        let big = dir.join("big.cfg");
        std::fs::write(&big, vec![b'#'; 2 << 20]).unwrap();
        let e = load(&big).unwrap_err();
        assert!(e.contains("at most"), "{e}");
        let good = dir.join("good.cfg");
        std::fs::write(&good, "NIXL_TELEMETRY_ENABLE = true\n").unwrap();
        assert_eq!(load(&good).unwrap().get("NIXL_TELEMETRY_ENABLE").and_then(|v| v.as_bool()), Some(true));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Numbers as NIXL's `std::from_chars` reads them.
    #[test]
    fn numbers_are_read_as_nixl_reads_them() {
        for (v, want) in [("64", Some(64)), ("0x40", Some(64)), ("0X40", Some(64)), ("064", Some(64)), ("0", Some(0))] {
            assert_eq!(parse_unsigned(v, u64::MAX), want, "{v:?}");
        }
        for v in ["", " 64", "64 ", "+64", "-1", "0x", "abc", "1.5", "18446744073709551616", "0x1g"] {
            assert_eq!(parse_unsigned(v, u64::MAX), None, "{v:?}");
        }
        assert_eq!(parse_unsigned("65536", 65535), None);
        assert_eq!(parse_signed("-1"), Some(-1));
        assert_eq!(parse_signed("0"), Some(0));
        for v in ["", "-", "abc", " 1", "+1", "1 "] {
            assert_eq!(parse_signed(v), None, "{v:?}");
        }
    }

    #[test]
    fn the_file_is_chosen_in_nixls_order() {
        let named = Some(PathBuf::from("/x/named.cfg"));
        let home = Some(PathBuf::from("/h/.nixl.cfg"));
        assert_eq!(choose(named.clone(), home.clone(), |_| false), named, "the named file, even if missing");
        assert_eq!(choose(None, home.clone(), |_| true), home);
        assert_eq!(choose(None, home.clone(), |p| p == Path::new("/etc/nixl.cfg")), Some("/etc/nixl.cfg".into()));
        assert_eq!(choose(None, None, |_| false), None);
    }

    #[test]
    fn values_are_typed_and_only_top_level_keys_count() {
        let t: toml::Table = "A = \"s\"\nN = 64\nB = true\nS = \"yes\"\n[t]\nT = 1\n".parse().unwrap();
        let p = Path::new("/c.cfg");
        assert_eq!(from_table(&t, p, "A", Kind::Str).unwrap(), Some("s".into()));
        assert_eq!(from_table(&t, p, "N", Kind::Int).unwrap(), Some("64".into()));
        assert_eq!(from_table(&t, p, "B", Kind::Bool).unwrap(), Some("true".into()));
        assert_eq!(from_table(&t, p, "T", Kind::Int).unwrap(), None, "a key inside a table is not an option");
        assert_eq!(from_table(&t, p, "missing", Kind::Str).unwrap(), None);
        for (k, kind) in [("S", Kind::Bool), ("N", Kind::Str), ("A", Kind::Int), ("B", Kind::Int)] {
            let e = from_table(&t, p, k, kind).unwrap_err();
            assert_eq!(e.status(), crate::Status::InvalidParam, "{k}");
            assert!(e.message().contains(k) && e.message().contains("/c.cfg"), "{e}");
        }
        assert!("A = tru e".parse::<toml::Table>().is_err());
    }
}
