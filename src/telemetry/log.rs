//! gixl's log lines: which route a peer's data takes, fall-backs, exporter trouble.
//!
//! C users: lines at or above the threshold go to stderr as `gixl WARN  <message>`. The threshold is
//! `GIXL_LOG`, else `NIXL_LOG_LEVEL` (TRACE, DEBUG, INFO, WARN/WARNING, ERROR, FATAL, case-insensitive;
//! also `off`), else WARN. Python users: the wheel installs a sink that hands the lines of Python threads
//! (the calls made from Python) to Python's `logging` (logger `nixl.gixl`, under NIXL's `nixl` logger and
//! its level); lines of gixl's own threads (copy threads, the metadata listener) stay on the stderr path, so
//! that no gixl thread ever waits for the interpreter.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Debug => "DEBUG",
            Level::Info => "INFO",
            Level::Warn => "WARN",
            Level::Error => "ERROR",
        }
    }
}

type Sink = Box<dyn Fn(Level, &str) + Send + Sync>;

static SINK: OnceLock<Sink> = OnceLock::new();
/// 0: the sink is not in use (process exiting), 1: in use.
static SINK_ON: AtomicU8 = AtomicU8::new(1);

/// Send every line to `f` instead of stderr (once per process; the Python extension does this).
pub fn set_sink(f: Sink) -> bool {
    SINK.set(f).is_ok()
}

/// Stop using the sink (the interpreter is shutting down); lines go to stderr again.
pub fn disable_sink() {
    SINK_ON.store(0, Ordering::Release);
}

/// The stderr threshold: `GIXL_LOG`, else `NIXL_LOG_LEVEL`, else WARN. None: nothing at all.
pub fn threshold() -> Option<Level> {
    static T: OnceLock<Option<Level>> = OnceLock::new();
    *T.get_or_init(|| {
        let v = std::env::var("GIXL_LOG").or_else(|_| std::env::var("NIXL_LOG_LEVEL")).unwrap_or_default();
        parse(&v).unwrap_or(Some(Level::Warn))
    })
}

/// A level name; Some(None) for "off", None when unknown.
pub fn parse(v: &str) -> Option<Option<Level>> {
    Some(Some(match v.trim().to_ascii_uppercase().as_str() {
        "TRACE" | "DEBUG" => Level::Debug,
        "INFO" => Level::Info,
        "WARN" | "WARNING" => Level::Warn,
        "ERROR" | "FATAL" => Level::Error,
        "OFF" | "NONE" => return Some(None),
        _ => return None,
    }))
}

pub fn log(level: Level, msg: &str) {
    if SINK_ON.load(Ordering::Acquire) == 1 {
        if let Some(f) = SINK.get() {
            f(level, msg);
            return;
        }
    }
    stderr(level, msg);
}

/// The C users' path: stderr, above the threshold. Also what a sink falls back to for lines it cannot take.
pub fn stderr(level: Level, msg: &str) {
    if threshold().is_some_and(|t| level >= t) {
        eprintln!("gixl {:<5} {msg}", level.name());
    }
}

pub fn info(msg: &str) {
    log(Level::Info, msg);
}

pub fn warn(msg: &str) {
    log(Level::Warn, msg);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_names() {
        assert_eq!(parse("info"), Some(Some(Level::Info)));
        assert_eq!(parse("WARNING"), Some(Some(Level::Warn)));
        assert_eq!(parse("trace"), Some(Some(Level::Debug)));
        assert_eq!(parse("off"), Some(None));
        assert_eq!(parse("loud"), None);
    }
}
