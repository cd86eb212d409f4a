//! NIXL's status numbers and gixl's one error type.
//!
//! `Status` carries NIXL's own values (`nixl_status_t`), so every layer above (C, Python) maps from
//! one place. `Error` is a status plus the context a person needs to act on it; it never carries a
//! success or in-progress value, which are states, not errors.

use std::fmt;

/// `nixl_status_t`, with NIXL's numbers.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    InProg = 1,
    Success = 0,
    NotPosted = -1,
    InvalidParam = -2,
    Backend = -3,
    NotFound = -4,
    Mismatch = -5,
    NotAllowed = -6,
    RepostActive = -7,
    Unknown = -8,
    NotSupported = -9,
    RemoteDisconnect = -10,
    Canceled = -11,
    NoTelemetry = -12,
}

impl Status {
    pub const ALL: [Status; 14] = [
        Status::InProg,
        Status::Success,
        Status::NotPosted,
        Status::InvalidParam,
        Status::Backend,
        Status::NotFound,
        Status::Mismatch,
        Status::NotAllowed,
        Status::RepostActive,
        Status::Unknown,
        Status::NotSupported,
        Status::RemoteDisconnect,
        Status::Canceled,
        Status::NoTelemetry,
    ];

    pub fn from_i32(v: i32) -> Option<Status> {
        Self::ALL.iter().copied().find(|s| *s as i32 == v)
    }

    pub fn is_err(self) -> bool {
        (self as i32) < 0
    }

    /// NIXL's spelling, which is also the message of the matching Python exception.
    pub fn name(self) -> &'static str {
        match self {
            Status::InProg => "NIXL_IN_PROG",
            Status::Success => "NIXL_SUCCESS",
            Status::NotPosted => "NIXL_ERR_NOT_POSTED",
            Status::InvalidParam => "NIXL_ERR_INVALID_PARAM",
            Status::Backend => "NIXL_ERR_BACKEND",
            Status::NotFound => "NIXL_ERR_NOT_FOUND",
            Status::Mismatch => "NIXL_ERR_MISMATCH",
            Status::NotAllowed => "NIXL_ERR_NOT_ALLOWED",
            Status::RepostActive => "NIXL_ERR_REPOST_ACTIVE",
            Status::Unknown => "NIXL_ERR_UNKNOWN",
            Status::NotSupported => "NIXL_ERR_NOT_SUPPORTED",
            Status::RemoteDisconnect => "NIXL_ERR_REMOTE_DISCONNECT",
            Status::Canceled => "NIXL_ERR_CANCELED",
            Status::NoTelemetry => "NIXL_ERR_NO_TELEMETRY",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed operation: NIXL's status for it, what went wrong, and the OS error behind it if any.
#[derive(Debug, thiserror::Error)]
#[error("{status}: {msg}")]
pub struct Error {
    status: Status,
    msg: String,
    #[source]
    source: Option<std::io::Error>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(status: Status, msg: impl Into<String>) -> Error {
        debug_assert!(status.is_err(), "{status} is not an error");
        Error { status, msg: msg.into(), source: None }
    }

    /// An error caused by an OS call; `err` is kept as the source.
    pub fn os(status: Status, msg: impl Into<String>, err: std::io::Error) -> Error {
        Error { status, msg: format!("{}: {err}", msg.into()), source: Some(err) }
    }

    pub fn status(&self) -> Status {
        self.status
    }

    /// The same error (status and source) with its message rewritten by `f`.
    pub(crate) fn reword(mut self, f: impl FnOnce(&str) -> String) -> Error {
        self.msg = f(&self.msg);
        self
    }

    pub fn message(&self) -> &str {
        &self.msg
    }

    pub fn invalid_param(msg: impl Into<String>) -> Error {
        Error::new(Status::InvalidParam, msg)
    }
    pub fn backend(msg: impl Into<String>) -> Error {
        Error::new(Status::Backend, msg)
    }
    pub fn not_found(msg: impl Into<String>) -> Error {
        Error::new(Status::NotFound, msg)
    }
    pub fn mismatch(msg: impl Into<String>) -> Error {
        Error::new(Status::Mismatch, msg)
    }
    pub fn not_allowed(msg: impl Into<String>) -> Error {
        Error::new(Status::NotAllowed, msg)
    }
    pub fn not_supported(msg: impl Into<String>) -> Error {
        Error::new(Status::NotSupported, msg)
    }
    pub fn disconnected(msg: impl Into<String>) -> Error {
        Error::new(Status::RemoteDisconnect, msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_match_nixl() {
        assert_eq!(Status::InProg as i32, 1);
        assert_eq!(Status::NotFound as i32, -4);
        assert_eq!(Status::NoTelemetry as i32, -12);
        for s in Status::ALL {
            assert_eq!(Status::from_i32(s as i32), Some(s));
        }
        assert_eq!(Status::from_i32(-13), None);
    }

    #[test]
    fn error_keeps_status_and_context() {
        let e = Error::not_found("agent 'x' is not loaded");
        assert_eq!(e.status(), Status::NotFound);
        assert_eq!(e.to_string(), "NIXL_ERR_NOT_FOUND: agent 'x' is not loaded");
    }
}
