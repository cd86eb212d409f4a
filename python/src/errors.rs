//! NIXL's exception classes and the one place a gixl status becomes a Python exception.
//!
//! Every class derives directly from `Exception` (NIXL registers them with `py::register_exception`, so
//! there is no common base) and carries the status name as its message. gixl adds the context of the failure
//! as an exception note (Python 3.11+), so `str(e)` stays exactly what NIXL gives.

#![allow(non_camel_case_types)]

use gixl::Status;
use pyo3::exceptions::{PyException, PyRuntimeError};
use pyo3::prelude::*;

pyo3::create_exception!(nixl._bindings, nixlNotPostedError, PyException, "NIXL_ERR_NOT_POSTED");
pyo3::create_exception!(
    nixl._bindings,
    nixlInvalidParamError,
    PyException,
    "NIXL_ERR_INVALID_PARAM"
);
pyo3::create_exception!(nixl._bindings, nixlBackendError, PyException, "NIXL_ERR_BACKEND");
pyo3::create_exception!(nixl._bindings, nixlNotFoundError, PyException, "NIXL_ERR_NOT_FOUND");
pyo3::create_exception!(nixl._bindings, nixlMismatchError, PyException, "NIXL_ERR_MISMATCH");
pyo3::create_exception!(nixl._bindings, nixlNotAllowedError, PyException, "NIXL_ERR_NOT_ALLOWED");
pyo3::create_exception!(
    nixl._bindings,
    nixlRepostActiveError,
    PyException,
    "NIXL_ERR_REPOST_ACTIVE"
);
pyo3::create_exception!(nixl._bindings, nixlUnknownError, PyException, "NIXL_ERR_UNKNOWN");
pyo3::create_exception!(
    nixl._bindings,
    nixlNotSupportedError,
    PyException,
    "NIXL_ERR_NOT_SUPPORTED"
);
pyo3::create_exception!(
    nixl._bindings,
    nixlRemoteDisconnectError,
    PyException,
    "NIXL_ERR_REMOTE_DISCONNECT"
);
pyo3::create_exception!(nixl._bindings, nixlCancelledError, PyException, "NIXL_ERR_CANCELED");
pyo3::create_exception!(
    nixl._bindings,
    nixlNoTelemetryError,
    PyException,
    "NIXL_ERR_NO_TELEMETRY"
);

/// The exception NIXL raises for status `code`; anything that is not a known error status is
/// `RuntimeError("BAD_STATUS")`, as in NIXL.
pub(crate) fn status_error(code: i32) -> PyErr {
    let Some(status) = Status::from_i32(code) else {
        return PyRuntimeError::new_err("BAD_STATUS");
    };
    let msg = status.name();
    match status {
        Status::NotPosted => nixlNotPostedError::new_err(msg),
        Status::InvalidParam => nixlInvalidParamError::new_err(msg),
        Status::Backend => nixlBackendError::new_err(msg),
        Status::NotFound => nixlNotFoundError::new_err(msg),
        Status::Mismatch => nixlMismatchError::new_err(msg),
        Status::NotAllowed => nixlNotAllowedError::new_err(msg),
        Status::RepostActive => nixlRepostActiveError::new_err(msg),
        Status::Unknown => nixlUnknownError::new_err(msg),
        Status::NotSupported => nixlNotSupportedError::new_err(msg),
        Status::RemoteDisconnect => nixlRemoteDisconnectError::new_err(msg),
        Status::Canceled => nixlCancelledError::new_err(msg),
        Status::NoTelemetry => nixlNoTelemetryError::new_err(msg),
        Status::InProg | Status::Success => PyRuntimeError::new_err("BAD_STATUS"),
    }
}

/// A gixl error as NIXL's exception, with gixl's explanation attached as a note.
pub(crate) fn to_py(e: gixl::Error) -> PyErr {
    with_note(status_error(e.status() as i32), e.message())
}

/// An error for a handle this agent does not know (never issued, released, or another agent's).
pub(crate) fn bad_handle(kind: &str, handle: u64) -> PyErr {
    with_note(
        status_error(Status::InvalidParam as i32),
        &format!("{handle:#x} is not a live {kind} handle of this agent (released, or from another agent)"),
    )
}

pub(crate) fn with_note(err: PyErr, note: &str) -> PyErr {
    Python::attach(|py| {
        // `add_note` exists from Python 3.11 on; the wheel is abi3 for 3.10+, so look it up at run time.
        // A note only helps a person reading the traceback: failing to add one must not hide the error.
        if let Ok(add) = err.value(py).getattr(pyo3::intern!(py, "add_note")) {
            let _ = add.call1((note,));
        }
    });
    err
}

/// `Result<T, gixl::Error>` → `PyResult<T>`.
pub(crate) trait IntoPyResult<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for gixl::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("nixlNotPostedError", py.get_type::<nixlNotPostedError>())?;
    m.add("nixlInvalidParamError", py.get_type::<nixlInvalidParamError>())?;
    m.add("nixlBackendError", py.get_type::<nixlBackendError>())?;
    m.add("nixlNotFoundError", py.get_type::<nixlNotFoundError>())?;
    m.add("nixlMismatchError", py.get_type::<nixlMismatchError>())?;
    m.add("nixlNotAllowedError", py.get_type::<nixlNotAllowedError>())?;
    m.add("nixlRepostActiveError", py.get_type::<nixlRepostActiveError>())?;
    m.add("nixlUnknownError", py.get_type::<nixlUnknownError>())?;
    m.add("nixlNotSupportedError", py.get_type::<nixlNotSupportedError>())?;
    m.add("nixlRemoteDisconnectError", py.get_type::<nixlRemoteDisconnectError>())?;
    m.add("nixlCancelledError", py.get_type::<nixlCancelledError>())?;
    m.add("nixlNoTelemetryError", py.get_type::<nixlNoTelemetryError>())?;
    Ok(())
}
