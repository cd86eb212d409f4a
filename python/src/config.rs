//! `nixlAgentConfig` and `nixlXferTelemetry`: plain data classes.
//!
//! The config keeps NIXL's C++ defaults (no progress thread, no listener, port 8888, sync NONE, no
//! telemetry, delays 0 µs and 100 ms, etcd watch timeout 5 s) and its legacy positional constructor
//! `(useProgThread, useListenThread, listenPort, syncMode, num_workers, pthrDelay, lthrDelay,
//! captureTelemetry)`, where `num_workers` is not readable back, as in NIXL.

use std::time::Duration;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyTuple};

use crate::enums::ThreadSyncT;

#[pyclass(module = "nixl._bindings", name = "nixlAgentConfig")]
#[derive(Clone, Debug)]
pub struct AgentConfig {
    #[pyo3(get, name = "useProgThread")]
    pub use_prog_thread: bool,
    #[pyo3(get, name = "useListenThread")]
    pub use_listen_thread: bool,
    pub listen_port: u16,
    pub sync_mode: i64,
    #[pyo3(get, name = "captureTelemetry")]
    pub capture_telemetry: bool,
    #[pyo3(get, set, name = "pthrDelay")]
    pub pthr_delay: u64,
    #[pyo3(get, set, name = "lthrDelay")]
    pub lthr_delay: u64,
    #[pyo3(get, set, name = "etcdWatchTimeout")]
    pub etcd_watch_timeout: Duration,
    /// Only settable through the legacy constructor; None lets gixl choose.
    pub num_workers: Option<u32>,
    /// gixl's overlap check (`gixlCheckOverlap`: "off", "warn" or "refuse"; `GIXL_CHECK_OVERLAP` overrides).
    pub check_overlap: gixl::overlap::Mode,
}

impl Default for AgentConfig {
    fn default() -> Self {
        let d = gixl::AgentConfig::default();
        AgentConfig {
            use_prog_thread: d.prog_thread,
            use_listen_thread: d.listen_thread,
            listen_port: d.listen_port,
            sync_mode: d.sync_mode as i64,
            capture_telemetry: d.capture_telemetry,
            pthr_delay: d.pthr_delay_us,
            lthr_delay: d.lthr_delay_us,
            etcd_watch_timeout: Duration::from_secs(5),
            num_workers: None,
            check_overlap: d.check_overlap,
        }
    }
}

impl AgentConfig {
    /// The core's configuration for an agent built from this one.
    pub fn to_core(&self) -> PyResult<gixl::AgentConfig> {
        let sync_mode = u32::try_from(self.sync_mode)
            .ok()
            .and_then(|v| gixl::SyncMode::from_u32(v).ok())
            .ok_or_else(|| PyTypeError::new_err(format!("unknown thread sync mode {}", self.sync_mode)))?;
        Ok(gixl::AgentConfig {
            prog_thread: self.use_prog_thread,
            listen_thread: self.use_listen_thread,
            listen_port: self.listen_port,
            sync_mode,
            // NIXL's binding sets num_workers only through the legacy constructor; 0 lets gixl choose.
            num_workers: self.num_workers.unwrap_or(0),
            pthr_delay_us: self.pthr_delay,
            lthr_delay_us: self.lthr_delay,
            capture_telemetry: self.capture_telemetry,
            check_overlap: self.check_overlap,
            ..gixl::AgentConfig::default()
        })
    }
}

#[allow(non_snake_case)]
#[pymethods]
impl AgentConfig {
    #[new]
    #[pyo3(signature = (*args, **kwargs))]
    fn py_new(args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let mut c = AgentConfig::default();
        if kwargs.is_some_and(|k| !k.is_empty()) || args.len() > 8 {
            return Err(ctor_error());
        }
        let arg = |i: usize| args.get_item(i);
        let bad = |_| ctor_error();
        if args.len() > 0 {
            c.use_prog_thread = loose_bool(&arg(0)?)?;
        }
        if args.len() > 1 {
            c.use_listen_thread = loose_bool(&arg(1)?)?;
        }
        if args.len() > 2 {
            c.listen_port = arg(2)?.extract().map_err(bad)?;
        }
        if args.len() > 3 {
            c.sync_mode = arg(3)?.cast::<ThreadSyncT>().map_err(|_| ctor_error())?.get().get();
        }
        if args.len() > 4 {
            c.num_workers = Some(arg(4)?.extract().map_err(bad)?);
        }
        if args.len() > 5 {
            c.pthr_delay = arg(5)?.extract().map_err(bad)?;
        }
        if args.len() > 6 {
            c.lthr_delay = arg(6)?.extract().map_err(bad)?;
        }
        if args.len() > 7 {
            c.capture_telemetry = loose_bool(&arg(7)?)?;
        }
        Ok(c)
    }

    #[setter]
    fn set_useProgThread(&mut self, v: &Bound<'_, PyAny>) -> PyResult<()> {
        self.use_prog_thread = loose_bool(v)?;
        Ok(())
    }

    #[setter]
    fn set_useListenThread(&mut self, v: &Bound<'_, PyAny>) -> PyResult<()> {
        self.use_listen_thread = loose_bool(v)?;
        Ok(())
    }

    #[setter]
    fn set_captureTelemetry(&mut self, v: &Bound<'_, PyAny>) -> PyResult<()> {
        self.capture_telemetry = loose_bool(v)?;
        Ok(())
    }

    #[getter]
    fn get_listenPort(&self) -> u16 {
        self.listen_port
    }

    /// A TCP port (0..=65535); anything else is a TypeError, as pybind11 reports it.
    #[setter]
    fn set_listenPort(&mut self, v: &Bound<'_, PyAny>) -> PyResult<()> {
        self.listen_port = v
            .extract()
            .map_err(|_| PyTypeError::new_err("listenPort must be an int in 0..=65535"))?;
        Ok(())
    }

    #[getter]
    fn get_syncMode(&self) -> ThreadSyncT {
        ThreadSyncT::new_value(self.sync_mode)
    }

    /// gixl only: the overlap check, "off" (default), "warn" or "refuse" (see docs/overlap-check.md).
    #[getter]
    fn get_gixlCheckOverlap(&self) -> &'static str {
        self.check_overlap.name()
    }

    #[setter]
    fn set_gixlCheckOverlap(&mut self, v: &str) -> PyResult<()> {
        self.check_overlap = gixl::overlap::Mode::parse(v).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "gixlCheckOverlap must be 'off', 'warn' or 'refuse' (got {v:?})"
            ))
        })?;
        Ok(())
    }

    #[setter]
    fn set_syncMode(&mut self, v: &Bound<'_, PyAny>) -> PyResult<()> {
        let v = v
            .cast::<ThreadSyncT>()
            .map_err(|_| PyTypeError::new_err("syncMode must be a nixl_thread_sync_t"))?;
        self.sync_mode = v.get().get();
        Ok(())
    }
}

/// A bool the way pybind11 converts one: `True`/`False`, `None` (False), or anything whose type defines
/// `__bool__` (ints, numpy bools); anything else (a str, a list) is a TypeError.
fn loose_bool(v: &Bound<'_, PyAny>) -> PyResult<bool> {
    if let Ok(b) = v.cast::<PyBool>() {
        return Ok(b.is_true());
    }
    if v.is_none() {
        return Ok(false);
    }
    if v.get_type().hasattr("__bool__")? {
        return v.is_truthy();
    }
    Err(PyTypeError::new_err(format!(
        "expected a bool, got '{}'",
        v.get_type().name()?
    )))
}

fn ctor_error() -> PyErr {
    PyTypeError::new_err(
        "__init__(): incompatible constructor arguments. The following argument types are supported:\n    \
         nixlAgentConfig(useProgThread: bool = False, useListenThread: bool = False, listenPort: int = 8888, \
         syncMode: nixl_thread_sync_t = NIXL_THREAD_SYNC_NONE, num_workers: int = 1, pthrDelay: int = 0, \
         lthrDelay: int = 100000, captureTelemetry: bool = False), all positional",
    )
}

/// `nixlXferTelemetry`: what the last post of a transfer request took. Times are microseconds;
/// `startTime` is on the monotonic clock.
#[pyclass(frozen, module = "nixl._bindings", name = "nixlXferTelemetry")]
#[derive(Clone, Debug, Default)]
pub struct XferTelemetry {
    #[pyo3(get, name = "startTime")]
    pub start_time: u64,
    #[pyo3(get, name = "postDuration")]
    pub post_duration: u64,
    #[pyo3(get, name = "xferDuration")]
    pub xfer_duration: u64,
    #[pyo3(get, name = "totalBytes")]
    pub total_bytes: u64,
    #[pyo3(get, name = "descCount")]
    pub desc_count: u64,
}

#[pymethods]
impl XferTelemetry {
    #[new]
    fn py_new() -> Self {
        XferTelemetry::default()
    }

    fn __repr__(&self) -> String {
        format!(
            "nixlXferTelemetry(startTime={}, postDuration={}, xferDuration={}, totalBytes={}, descCount={})",
            self.start_time, self.post_duration, self.xfer_duration, self.total_bytes, self.desc_count
        )
    }
}

impl From<gixl::XferTelemetry> for XferTelemetry {
    fn from(t: gixl::XferTelemetry) -> Self {
        XferTelemetry {
            start_time: t.start_time_us,
            post_duration: t.post_duration_us,
            xfer_duration: t.xfer_duration_us,
            total_bytes: t.total_bytes,
            desc_count: t.desc_count,
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<AgentConfig>()?;
    m.add_class::<XferTelemetry>()?;
    Ok(())
}
