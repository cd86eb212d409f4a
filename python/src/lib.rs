//! `gixl._gixl`: the native module behind gixl's Python packages.
//!
//! It exports what NIXL's pybind11 module `nixl_cu12._bindings` exports, with the same names, values and
//! call signatures, so `nixl._bindings` can simply re-export it. The classes report `nixl._bindings` as
//! their module, so pickles made here load wherever `nixl._bindings` exists (gixl or NIXL).
//!
//! This crate holds no transfer logic: it converts arguments, releases the interpreter around the core's
//! work, and maps the core's status to NIXL's exceptions (`errors`).

#![deny(unsafe_op_in_unsafe_fn)]

mod agent;
mod config;
mod dlist;
mod enums;
mod errors;
mod ndarray;

use pyo3::prelude::*;

#[pymodule]
#[pyo3(name = "_gixl")]
fn gixl_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", gixl::NIXL_API_VERSION)?;
    m.add("DEFAULT_COMM_PORT", gixl::DEFAULT_COMM_PORT)?;
    m.add("NIXL_INIT_AGENT", "")?;
    // gixl has no UCX GPU device API (memory views).
    m.add("HAVE_UCX_GPU_DEVICE_API", false)?;
    enums::register(m)?;
    errors::register(m)?;
    dlist::register(m)?;
    config::register(m)?;
    agent::register(m)?;
    m.add_function(wrap_pyfunction!(_doctor, m)?)?;
    m.add_function(wrap_pyfunction!(_set_log_sink, m)?)?;
    m.add_function(wrap_pyfunction!(_log_detach, m)?)?;
    m.add_function(wrap_pyfunction!(_fake_device_alloc, m)?)?;
    Ok(())
}

/// The `gixl doctor` report as JSON: this host, plus a peer given by its metadata (`peer_md`) or by its
/// listener (`peer_name`, `peer_ip`, `peer_port`).
#[pyfunction]
#[pyo3(signature = (peer_md=None, peer_name=None, peer_ip=None, peer_port=0))]
fn _doctor(
    py: Python<'_>,
    peer_md: Option<Vec<u8>>,
    peer_name: Option<String>,
    peer_ip: Option<String>,
    peer_port: u16,
) -> String {
    use gixl::telemetry::doctor::{report, PeerTarget};
    let peer = match (peer_md, peer_name, peer_ip) {
        (Some(md), _, _) => Some(PeerTarget::Md(md)),
        (None, Some(name), Some(ip)) => Some(PeerTarget::Listener {
            name,
            ip,
            port: peer_port,
        }),
        _ => None,
    };
    py.detach(|| report(peer))
}

/// Route gixl's log lines to `sink(level, message)` (level: 1 debug, 2 info, 3 warning, 4 error), called
/// with the interpreter attached. Once per process. Only lines logged on Python threads (inside a call from
/// Python, which never holds a gixl lock that a thread holding the interpreter could wait for) go there;
/// lines of gixl's own threads go to stderr as for C users, so they never wait for the interpreter (which
/// may be held by a thread that is joining them, e.g. while an agent is garbage-collected).
#[pyfunction]
fn _set_log_sink(sink: Py<PyAny>) -> bool {
    gixl::telemetry::log::set_sink(Box::new(move |level, msg| {
        // SAFETY: PyGILState_GetThisThreadState only reads this thread's state; it needs no interpreter lock.
        let python_thread = !unsafe { pyo3::ffi::PyGILState_GetThisThreadState() }.is_null();
        if !python_thread {
            gixl::telemetry::log::stderr(level, msg);
            return;
        }
        Python::attach(|py| {
            if let Err(e) = sink.call1(py, (level as u8, msg)) {
                e.print(py);
            }
        })
    }))
}

/// The interpreter is exiting: log lines go to stderr from now on.
#[pyfunction]
fn _log_detach() {
    gixl::telemetry::log::disable_sink();
}

/// Tests only: `size` bytes of emulated device memory on fake device `device` (shared host memory that the
/// fake device layer treats as VRAM; never freed), for processes started with `GIXL_FAKE_DEVICE=1`.
/// Anywhere else it raises NOT_SUPPORTED: with a real driver, a host address is not device memory.
#[pyfunction]
fn _fake_device_alloc(device: u32, size: usize) -> PyResult<u64> {
    if !gixl::device::is_fake() {
        return Err(errors::to_py(gixl::Error::new(
            gixl::Status::NotSupported,
            "the fake device layer is not in use (start the process with GIXL_FAKE_DEVICE=1)",
        )));
    }
    gixl::device::fake::alloc(device, size, false, None).map_err(errors::to_py)
}
