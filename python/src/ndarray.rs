//! Reading numpy arrays in place, without numpy's C API and without a Python object per element.
//!
//! The wheel is abi3 for Python 3.10, where the buffer protocol is not part of the limited API, so arrays
//! are read through numpy's `__array_interface__` (data pointer, shape, strides, type string). The values
//! are copied out while the caller holds a reference to the array and is attached to the interpreter, so
//! the memory cannot be freed underneath the copy. This module does not decide what the numbers mean.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

static NDARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Whether `obj` is a numpy array (numpy is imported on first use; without numpy nothing is an array).
pub(crate) fn is_ndarray(obj: &Bound<'_, PyAny>) -> bool {
    match NDARRAY.import(obj.py(), "numpy", "ndarray") {
        Ok(t) => obj.is_instance(t).unwrap_or(false),
        Err(_) => false,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Int,
    UInt,
    Float,
    Bool,
}

/// A view of an array's memory as numpy describes it.
pub(crate) struct ArrayView<'py> {
    /// Keeps the array (and so its memory) alive while the view is used.
    _owner: Bound<'py, PyAny>,
    data: usize,
    pub shape: Vec<usize>,
    /// Byte strides, always filled in (C order when numpy reports none).
    pub strides: Vec<isize>,
    pub kind: Kind,
    pub itemsize: usize,
    /// The array's memory is in C order with no gaps.
    pub c_contiguous: bool,
}

/// `Py_buffer` as CPython lays it out (unchanged since 3.3; part of the stable ABI from 3.11). Declared here
/// because pyo3 exposes it only from 3.11 in abi3 builds; `PyObject_GetBuffer` is exported by 3.10 too.
#[repr(C)]
struct RawBuffer {
    buf: *mut std::ffi::c_void,
    obj: *mut pyo3::ffi::PyObject,
    len: pyo3::ffi::Py_ssize_t,
    itemsize: pyo3::ffi::Py_ssize_t,
    readonly: std::ffi::c_int,
    ndim: std::ffi::c_int,
    format: *mut std::ffi::c_char,
    shape: *mut pyo3::ffi::Py_ssize_t,
    strides: *mut pyo3::ffi::Py_ssize_t,
    suboffsets: *mut pyo3::ffi::Py_ssize_t,
    internal: *mut std::ffi::c_void,
}

extern "C" {
    fn PyObject_GetBuffer(
        obj: *mut pyo3::ffi::PyObject,
        view: *mut RawBuffer,
        flags: std::ffi::c_int,
    ) -> std::ffi::c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// PyBUF_STRIDES | PyBUF_FORMAT, read-only.
const PYBUF_RECORDS_RO: std::ffi::c_int = 0x0010 | 0x0008 | 0x0004;

/// The element type of a native-order buffer format ("i", "<q", "=l", ...); `None` for anything else.
fn parse_format(f: &[u8], itemsize: usize) -> Option<Kind> {
    let f = match f {
        [b'@' | b'=', rest @ ..] => rest,
        [b'<', rest @ ..] if cfg!(target_endian = "little") => rest,
        [b'>' | b'!', rest @ ..] if cfg!(target_endian = "big") => rest,
        _ => f,
    };
    let kind = match f {
        [b'b' | b'h' | b'i' | b'l' | b'q' | b'n'] => Kind::Int,
        [b'B' | b'H' | b'I' | b'L' | b'Q' | b'N'] => Kind::UInt,
        [b'f' | b'd'] => Kind::Float,
        [b'?'] => Kind::Bool,
        _ => return None,
    };
    let ok = match kind {
        Kind::Int | Kind::UInt => matches!(itemsize, 1 | 2 | 4 | 8),
        Kind::Float => matches!(itemsize, 4 | 8),
        Kind::Bool => itemsize == 1,
    };
    ok.then_some(kind)
}

/// A one-dimensional, C-contiguous, aligned int32 or int64 buffer, held (exported) until dropped, so that
/// its values can be read in place with the interpreter released: while a buffer is exported numpy refuses to
/// resize or free the array's memory. Another thread may still write values meanwhile; readers must treat
/// every value as untrusted (the planner bounds-checks each index it reads).
pub(crate) struct HeldIndices {
    raw: Box<RawBuffer>,
    ints: Ints,
}

/// Index values by width.
#[derive(Clone, Copy)]
pub(crate) enum Idx<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

enum Ints {
    I32(*const i32, usize),
    I64(*const i64, usize),
}

impl Idx<'_> {
    pub fn len(&self) -> usize {
        match self {
            Idx::I32(x) => x.len(),
            Idx::I64(x) => x.len(),
        }
    }
}

impl HeldIndices {
    /// `None` unless `obj` exports a 1-D, C-contiguous, aligned buffer of native int32 or int64.
    pub fn new(obj: &Bound<'_, PyAny>) -> Option<HeldIndices> {
        // PyBUF_C_CONTIGUOUS (0x20 | PyBUF_STRIDES) | PyBUF_FORMAT, read-only: the exporter refuses strided data.
        const FLAGS: std::ffi::c_int = 0x0020 | 0x0010 | 0x0008 | 0x0004;
        let mut raw = Box::new(std::mem::MaybeUninit::<RawBuffer>::zeroed());
        // SAFETY: `obj` is live and we are attached; a buffer obtained here is released exactly once, in
        // `Drop` (or right below when it does not qualify).
        unsafe {
            if PyObject_GetBuffer(obj.as_ptr(), raw.as_mut_ptr(), FLAGS) != 0 {
                pyo3::ffi::PyErr_Clear();
                return None;
            }
            let mut raw: Box<RawBuffer> = Box::from_raw(Box::into_raw(raw).cast());
            let itemsize = raw.itemsize.max(0) as usize;
            let kind = if raw.format.is_null() {
                None
            } else {
                parse_format(std::ffi::CStr::from_ptr(raw.format).to_bytes(), itemsize)
            };
            let n = raw.len.max(0) as usize / itemsize.max(1);
            let p = raw.buf as usize;
            let ints = match (raw.ndim, kind, itemsize) {
                (1, Some(Kind::Int), 4) if p % 4 == 0 && (p != 0 || n == 0) => Some(Ints::I32(p as *const i32, n)),
                (1, Some(Kind::Int), 8) if p % 8 == 0 && (p != 0 || n == 0) => Some(Ints::I64(p as *const i64, n)),
                _ => None,
            };
            match ints {
                Some(ints) => Some(HeldIndices { raw, ints }),
                None => {
                    PyBuffer_Release(&mut *raw);
                    None
                }
            }
        }
    }

    /// The values, valid while `self` is held.
    pub fn idx(&self) -> Idx<'_> {
        // SAFETY: `n` aligned values at `p`, exported by the buffer `self` holds until dropped.
        unsafe {
            match self.ints {
                Ints::I32(_, 0) => Idx::I32(&[]),
                Ints::I64(_, 0) => Idx::I64(&[]),
                Ints::I32(p, n) => Idx::I32(std::slice::from_raw_parts(p, n)),
                Ints::I64(p, n) => Idx::I64(std::slice::from_raw_parts(p, n)),
            }
        }
    }
}

impl Drop for HeldIndices {
    fn drop(&mut self) {
        // SAFETY: obtained by `PyObject_GetBuffer` in `new` and not released yet. Dropped by the thread
        // that made it, attached to the interpreter (the type is not `Send`).
        unsafe { PyBuffer_Release(&mut *self.raw) }
    }
}

impl<'py> ArrayView<'py> {
    /// Through the buffer protocol (no dict per call); `None` when the object does not offer a plain buffer
    /// of a supported element type (then `__array_interface__` decides, with its error messages).
    fn from_buffer(arr: &Bound<'py, PyAny>) -> Option<ArrayView<'py>> {
        let mut b = std::mem::MaybeUninit::<RawBuffer>::zeroed();
        // SAFETY: `arr` is a live object and we are attached to the interpreter; on success the buffer is
        // released below, after its fields are copied out. On failure the error is cleared.
        unsafe {
            if PyObject_GetBuffer(arr.as_ptr(), b.as_mut_ptr(), PYBUF_RECORDS_RO) != 0 {
                pyo3::ffi::PyErr_Clear();
                return None;
            }
            let b = b.assume_init_mut();
            let itemsize = b.itemsize.max(0) as usize;
            let ndim = b.ndim.max(0) as usize;
            let kind = if b.format.is_null() || !b.suboffsets.is_null() {
                None
            } else {
                parse_format(std::ffi::CStr::from_ptr(b.format).to_bytes(), itemsize)
            };
            let out = kind.and_then(|kind| {
                if ndim > 0 && b.shape.is_null() {
                    return None;
                }
                let shape: Vec<usize> = (0..ndim).map(|i| *b.shape.add(i) as usize).collect();
                let c_strides = c_order_strides(&shape, itemsize);
                let strides: Vec<isize> = if b.strides.is_null() {
                    c_strides.clone()
                } else {
                    (0..ndim).map(|i| *b.strides.add(i)).collect()
                };
                let c_contiguous = shape
                    .iter()
                    .zip(strides.iter().zip(&c_strides))
                    .all(|(&n, (a, c))| n <= 1 || a == c);
                Some(ArrayView {
                    _owner: arr.clone(),
                    data: b.buf as usize,
                    shape,
                    strides,
                    kind,
                    itemsize,
                    c_contiguous,
                })
            });
            PyBuffer_Release(b);
            out
        }
    }

    pub fn new(arr: &Bound<'py, PyAny>) -> PyResult<ArrayView<'py>> {
        if let Some(v) = Self::from_buffer(arr) {
            return Ok(v);
        }
        let py = arr.py();
        let iface = arr.getattr(pyo3::intern!(py, "__array_interface__"))?;
        let iface = iface.cast::<PyDict>()?;
        let get = |k: &str| -> PyResult<Bound<'py, PyAny>> {
            iface
                .get_item(k)?
                .ok_or_else(|| PyTypeError::new_err(format!("__array_interface__ lacks '{k}'")))
        };
        let typestr: String = get("typestr")?.extract()?;
        let shape: Vec<usize> = get("shape")?.extract()?;
        let data = get("data")?;
        let data: usize = if data.is_none() {
            return Err(PyTypeError::new_err("array does not expose a data pointer"));
        } else {
            data.cast::<PyTuple>()?.get_item(0)?.extract()?
        };
        let (kind, itemsize) = parse_typestr(&typestr)?;
        let c_strides = c_order_strides(&shape, itemsize);
        let strides_obj = iface.get_item("strides")?;
        let (strides, c_contiguous) = match strides_obj {
            Some(s) if !s.is_none() => {
                let s: Vec<isize> = s.extract()?;
                if s.len() != shape.len() {
                    return Err(PyValueError::new_err(
                        "__array_interface__ strides do not match its shape",
                    ));
                }
                let contiguous = shape
                    .iter()
                    .zip(s.iter().zip(&c_strides))
                    .all(|(&n, (a, b))| n <= 1 || a == b);
                (s, contiguous)
            }
            _ => (c_strides, true),
        };
        Ok(ArrayView {
            _owner: arr.clone(),
            data,
            shape,
            strides,
            kind,
            itemsize,
            c_contiguous,
        })
    }

    /// The whole array as `&[i64]`, when it is a C-contiguous, aligned int64 array (the common index case).
    pub fn as_i64_slice(&self) -> Option<&[i64]> {
        let n: usize = self.shape.iter().product();
        let aligned = self.data % std::mem::align_of::<i64>() == 0;
        if self.kind != Kind::Int || self.itemsize != 8 || !self.c_contiguous || !aligned || (n > 0 && self.data == 0) {
            return None;
        }
        if n == 0 {
            return Some(&[]);
        }
        // SAFETY: numpy describes `n` contiguous, aligned int64 elements at `data`; `_owner` keeps the array
        // alive for the view's lifetime and the caller is attached to the interpreter.
        Some(unsafe { std::slice::from_raw_parts(self.data as *const i64, n) })
    }

    /// A one-dimensional array as `i64` values (saturating; floats truncated toward zero), element type
    /// resolved once rather than per element.
    pub fn to_i64_vec(&self) -> Vec<i64> {
        debug_assert_eq!(self.shape.len(), 1);
        let (n, st) = (self.shape[0], self.strides[0]);
        fn read<T: Copy>(base: usize, n: usize, st: isize, f: impl Fn(T) -> i64) -> Vec<i64> {
            // SAFETY: `n` elements of type `T` at `base + i * st`, inside the array numpy describes, kept alive
            // by the view's owner; unaligned reads are allowed.
            (0..n)
                .map(|i| f(unsafe { ((base as isize + i as isize * st) as *const T).read_unaligned() }))
                .collect()
        }
        let sat = |v: i128| v.clamp(i64::MIN as i128, i64::MAX as i128) as i64;
        match (self.kind, self.itemsize) {
            (Kind::Int, 4) => read::<i32>(self.data, n, st, i64::from),
            (Kind::Int, 8) => read::<i64>(self.data, n, st, |v| v),
            (Kind::UInt, 4) => read::<u32>(self.data, n, st, i64::from),
            (Kind::UInt, 8) => read::<u64>(self.data, n, st, |v| sat(v as i128)),
            _ => (0..n).map(|i| sat(self.get(&[i]))).collect(),
        }
    }

    /// Element `idx` (one index per dimension, each in bounds) converted to `i128`; floats are truncated
    /// toward zero like a C cast.
    pub fn get(&self, idx: &[usize]) -> i128 {
        debug_assert_eq!(idx.len(), self.shape.len());
        let off: isize = idx.iter().zip(&self.strides).map(|(&i, &s)| i as isize * s).sum();
        let p = (self.data as isize + off) as *const u8;
        // SAFETY: every index is within `shape`, so `p` points at one element inside the array's memory,
        // which numpy keeps valid while `_owner` holds the array and the caller is attached to the
        // interpreter. Elements may be unaligned (numpy allows it), hence `read_unaligned`.
        unsafe {
            match (self.kind, self.itemsize) {
                (Kind::Int, 1) => p.cast::<i8>().read_unaligned() as i128,
                (Kind::Int, 2) => p.cast::<i16>().read_unaligned() as i128,
                (Kind::Int, 4) => p.cast::<i32>().read_unaligned() as i128,
                (Kind::Int, 8) => p.cast::<i64>().read_unaligned() as i128,
                (Kind::UInt, 1) | (Kind::Bool, 1) => p.read_unaligned() as i128,
                (Kind::UInt, 2) => p.cast::<u16>().read_unaligned() as i128,
                (Kind::UInt, 4) => p.cast::<u32>().read_unaligned() as i128,
                (Kind::UInt, 8) => p.cast::<u64>().read_unaligned() as i128,
                (Kind::Float, 4) => p.cast::<f32>().read_unaligned() as i128,
                (Kind::Float, 8) => p.cast::<f64>().read_unaligned() as i128,
                _ => unreachable!("parse_typestr admits no other element type"),
            }
        }
    }

    /// A C-contiguous `N x cols` array of 64-bit integers as rows of `u64` (int64 values are
    /// reinterpreted, as NIXL does). Errors use NIXL's messages.
    pub fn rows_u64<const COLS: usize>(&self) -> PyResult<Vec<[u64; COLS]>> {
        if self.shape.len() != 2 || self.shape[1] != COLS {
            return Err(PyValueError::new_err(format!("descs must be a Nx{COLS} numpy array")));
        }
        if !matches!(self.kind, Kind::Int | Kind::UInt) || self.itemsize != 8 {
            return Err(PyValueError::new_err(format!(
                "descs must be a Nx{COLS} numpy array of uint64 or int64"
            )));
        }
        if !self.c_contiguous {
            return Err(PyValueError::new_err("descs must be a C-contiguous numpy array"));
        }
        let n = self.shape[0];
        let mut out = Vec::with_capacity(n);
        let base = self.data as *const u8;
        for r in 0..n {
            let mut row = [0u64; COLS];
            for (c, v) in row.iter_mut().enumerate() {
                // SAFETY: the array is C-contiguous with `n * COLS` 8-byte elements starting at `base`, kept
                // alive by `_owner`; `(r * COLS + c) < n * COLS`.
                *v = unsafe { base.add((r * COLS + c) * 8).cast::<u64>().read_unaligned() };
            }
            out.push(row);
        }
        Ok(out)
    }
}

fn parse_typestr(t: &str) -> PyResult<(Kind, usize)> {
    let b = t.as_bytes();
    let bad = || PyValueError::new_err(format!("unsupported numpy element type '{t}'"));
    if b.len() < 3 {
        return Err(bad());
    }
    let native_le = cfg!(target_endian = "little");
    match b[0] {
        b'|' | b'=' => {}
        b'<' if native_le => {}
        b'>' if !native_le => {}
        _ => return Err(bad()),
    }
    let size: usize = t[2..].parse().map_err(|_| bad())?;
    let kind = match b[1] {
        b'i' => Kind::Int,
        b'u' => Kind::UInt,
        b'f' => Kind::Float,
        b'b' => Kind::Bool,
        _ => return Err(bad()),
    };
    let ok = match kind {
        Kind::Int | Kind::UInt => matches!(size, 1 | 2 | 4 | 8),
        Kind::Float => matches!(size, 4 | 8),
        Kind::Bool => size == 1,
    };
    if ok {
        Ok((kind, size))
    } else {
        Err(bad())
    }
}

fn c_order_strides(shape: &[usize], itemsize: usize) -> Vec<isize> {
    let mut strides = vec![0isize; shape.len()];
    let mut acc = itemsize as isize;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i].max(1) as isize;
    }
    strides
}
