//! NIXL's five enums with pybind11's enum semantics.
//!
//! pybind11 enums are not Python `enum.Enum`s: members are instances of the class, `name`/`value` are
//! attributes, `__members__` maps names to members, `int()`/`hash()`/`__index__` give the value, and any
//! integer can be wrapped (`nixl_mem_t(7)` is a member named `"???"`). NIXL declares `nixl_mem_t`,
//! `nixl_xfer_op_t` and `nixl_status_t` as plain C enums, whose members compare equal to ints
//! (`DRAM_SEG == 0`), and `nixl_thread_sync_t` and `nixl_cost_t` as `enum class`, whose members do not
//! (`NIXL_COST_ANALYTICAL_BACKEND == 0` is False). Neither kind supports `<`.
//!
//! This module does not decide what the values mean; `gixl::MemType` etc. do.

use std::sync::atomic::{AtomicI64, Ordering};

use pyo3::basic::CompareOp;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyTuple, PyType};

macro_rules! nixl_enum {
    (
        $(#[$doc:meta])*
        $rust:ident, $pyname:literal, plain = $plain:literal,
        members { $($member:ident = $value:literal),+ $(,)? }
        $(aliases { $($alias:ident = $target:ident),+ $(,)? })?
    ) => {
        $(#[$doc])*
        #[pyclass(frozen, module = "nixl._bindings", name = $pyname)]
        #[derive(Debug)]
        pub struct $rust {
            // Atomic only so that unpickling a NIXL pickle (`__new__()` then `__setstate__(value)`)
            // can set it; nothing else changes a member's value.
            value: AtomicI64,
        }

        #[allow(non_snake_case)]
        #[pymethods]
        impl $rust {
            /// `value` defaults to 0 only so that NIXL's pickles, which call `__new__()` and then
            /// `__setstate__(value)`, load.
            #[new]
            #[pyo3(signature = (value = 0))]
            fn new(value: i64) -> Self {
                Self::new_value(value)
            }

            fn __getstate__(&self) -> i64 {
                self.get()
            }

            fn __setstate__(&self, state: i64) {
                self.value.store(state, Ordering::Relaxed)
            }

            $(
                #[classattr]
                fn $member() -> Self {
                    Self::new_value($value)
                }
            )+
            $($(
                #[classattr]
                fn $alias() -> Self {
                    Self::new_value(Self::value_of(stringify!($target)))
                }
            )+)?

            #[classattr]
            fn __members__(py: Python<'_>) -> PyResult<Py<PyDict>> {
                let d = PyDict::new(py);
                $( d.set_item(stringify!($member), Self::new_value($value))?; )+
                $($( d.set_item(stringify!($alias), Self::new_value(Self::value_of(stringify!($target))))?; )+)?
                Ok(d.unbind())
            }

            /// The member's name, or `"???"` for a value that is not a member (pybind11's spelling).
            #[getter]
            fn name(&self) -> &'static str {
                Self::name_of(self.get())
            }

            #[getter]
            fn value(&self) -> i64 {
                self.get()
            }

            fn __int__(&self) -> i64 {
                self.get()
            }

            fn __index__(&self) -> i64 {
                self.get()
            }

            fn __hash__(&self) -> isize {
                self.get() as isize
            }

            fn __repr__(&self) -> String {
                format!("<{}.{}: {}>", $pyname, self.name(), self.get())
            }

            fn __str__(&self) -> String {
                format!("{}.{}", $pyname, self.name())
            }

            fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> PyResult<Py<PyAny>> {
                let py = other.py();
                let theirs = if let Ok(o) = other.cast::<$rust>() {
                    Some(o.get().get())
                } else if $plain && other.is_instance_of::<PyInt>() {
                    other.extract::<i64>().ok()
                } else {
                    None
                };
                match (op, theirs) {
                    (CompareOp::Eq, Some(v)) => Ok((self.get() == v).into_pyobject(py)?.to_owned().into_any().unbind()),
                    (CompareOp::Ne, Some(v)) => Ok((self.get() != v).into_pyobject(py)?.to_owned().into_any().unbind()),
                    _ => Ok(py.NotImplemented()),
                }
            }

            fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
                let py = slf.py();
                let cls: Bound<'py, PyType> = slf.get_type();
                PyTuple::new(py, [cls.into_any(), (slf.get().get(),).into_pyobject(py)?.into_any()])
            }
        }

        impl $rust {
            pub fn new_value(value: i64) -> Self {
                $rust { value: AtomicI64::new(value) }
            }

            pub fn get(&self) -> i64 {
                self.value.load(Ordering::Relaxed)
            }

            fn name_of(value: i64) -> &'static str {
                match value {
                    $( $value => stringify!($member), )+
                    _ => "???",
                }
            }

            #[allow(dead_code)]
            fn value_of(name: &str) -> i64 {
                match name {
                    $( stringify!($member) => $value, )+
                    _ => unreachable!("alias of an unknown member"),
                }
            }

            /// Module-level names, as pybind11's `export_values()` adds them.
            pub fn export(m: &Bound<'_, PyModule>) -> PyResult<()> {
                $( m.add(stringify!($member), Self::new_value($value))?; )+
                $($( m.add(stringify!($alias), Self::new_value(Self::value_of(stringify!($target))))?; )+)?
                m.add_class::<$rust>()
            }
        }
    };
}

nixl_enum! {
    /// `nixl_mem_t`: the memory a descriptor refers to.
    MemT, "nixl_mem_t", plain = true,
    members { DRAM_SEG = 0, VRAM_SEG = 1, BLK_SEG = 2, OBJ_SEG = 3, FILE_SEG = 4 }
}

nixl_enum! {
    /// `nixl_xfer_op_t`: read from or write to the remote side.
    XferOpT, "nixl_xfer_op_t", plain = true,
    members { NIXL_READ = 0, NIXL_WRITE = 1 }
}

nixl_enum! {
    /// `nixl_status_t`. Like NIXL's binding, it names only IN_PROG through NOT_SUPPORTED; the three newer
    /// errors exist as exceptions only.
    StatusT, "nixl_status_t", plain = true,
    members {
        NIXL_IN_PROG = 1,
        NIXL_SUCCESS = 0,
        NIXL_ERR_NOT_POSTED = -1,
        NIXL_ERR_INVALID_PARAM = -2,
        NIXL_ERR_BACKEND = -3,
        NIXL_ERR_NOT_FOUND = -4,
        NIXL_ERR_MISMATCH = -5,
        NIXL_ERR_NOT_ALLOWED = -6,
        NIXL_ERR_REPOST_ACTIVE = -7,
        NIXL_ERR_UNKNOWN = -8,
        NIXL_ERR_NOT_SUPPORTED = -9,
    }
}

nixl_enum! {
    /// `nixl_thread_sync_t` (an `enum class`: members are not equal to ints).
    ThreadSyncT, "nixl_thread_sync_t", plain = false,
    members { NIXL_THREAD_SYNC_NONE = 0, NIXL_THREAD_SYNC_STRICT = 1, NIXL_THREAD_SYNC_RW = 2 }
    aliases { NIXL_THREAD_SYNC_DEFAULT = NIXL_THREAD_SYNC_NONE }
}

nixl_enum! {
    /// `nixl_cost_t` (an `enum class`: members are not equal to ints).
    CostT, "nixl_cost_t", plain = false,
    members { NIXL_COST_ANALYTICAL_BACKEND = 0 }
}

impl StatusT {
    pub fn of(s: gixl::Status) -> Self {
        StatusT::new_value(s as i64)
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    MemT::export(m)?;
    XferOpT::export(m)?;
    StatusT::export(m)?;
    ThreadSyncT::export(m)?;
    CostT::export(m)?;
    Ok(())
}
