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
    Ok(())
}
