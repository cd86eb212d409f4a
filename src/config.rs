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
        let named = std::env::var_os("NIXL_CONFIG_FILE").filter(|v| !v.is_empty()).map(PathBuf::from);
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

fn load(path: &Path) -> std::result::Result<toml::Table, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("the config file {} cannot be read: {e}", path.display()))?;
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
/// `false`, `disable`, any case); anything else is refused, as NIXL refuses it.
pub(crate) fn flag(name: &str) -> Result<Option<bool>> {
    let Some(v) = get(name, Kind::Bool)? else { return Ok(None) };
    match v.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" | "1" | "true" | "on" | "enable" => Ok(Some(true)),
        "n" | "no" | "0" | "false" | "off" | "disable" => Ok(Some(false)),
        _ => Err(Error::invalid_param(format!(
            "{name}={v:?} is not a yes/no value (y, yes, on, 1, true, enable; n, no, off, 0, false, disable)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
