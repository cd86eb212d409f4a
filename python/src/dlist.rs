//! `nixlXferDList`, `nixlRegDList` and `nixlRemoteDList`: NIXL's descriptor lists as Python classes.
//!
//! Each wraps the core's `DList` behind a lock and an `Arc`, so the agent can take a snapshot in O(1) and
//! work on it with the interpreter released while Python keeps using (and even changing) the list: a change
//! after a snapshot copies the list first. Differences from NIXL's binding, all of which turn a crash or
//! garbage into an exception: `[]`/`[]=`/`remDesc` are bounds-checked (IndexError), `nixlXferDList(t, n)`
//! holds zeroed descriptors, and `__setstate__` rejects bytes that are not a serialized list.
//!
//! Pickles use NIXL's own serializer layout (`nixlSerDes`, a `nixlBDList` or `nixlSDList` record), so a
//! list pickled by NIXL loads here and the reverse.

use std::sync::Arc;

use gixl::{Desc, MemType, RegDesc, RemoteDesc};
use parking_lot::Mutex;
use pyo3::basic::CompareOp;
use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::enums::MemT;
use crate::errors;
use crate::ndarray::{is_ndarray, ArrayView};

type DList<T> = gixl::mem::DList<T>;

/// One descriptor type of a list: how it looks as a Python tuple and in NIXL's serializer.
pub(crate) trait Elem: Clone + Default + PartialEq + Send + Sync + 'static {
    /// Elements of the tuple form.
    const ARITY: usize;
    /// NIXL's serializer name of a list of this element type.
    const SERDES_KIND: &'static [u8];
    fn basic(&self) -> &Desc;
    /// From a tuple of at least `ARITY` items (extra items are ignored, as in NIXL's `addDesc`).
    fn from_tuple(t: &Bound<'_, PyTuple>) -> PyResult<Self>;
    fn to_tuple<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>>;
    /// The bytes after the 24-byte basic descriptor in the serialized record.
    fn extra(&self) -> &[u8];
    fn with_extra(desc: Desc, extra: &[u8]) -> PyResult<Self>;
    /// Whether a whole list of these can be written as one packed record (`nixlBDList`).
    const PACKED: bool;
}

fn tuple_u64(t: &Bound<'_, PyTuple>, i: usize) -> PyResult<u64> {
    t.get_item(i)?.extract::<u64>()
}

fn tuple_desc(t: &Bound<'_, PyTuple>, arity: usize) -> PyResult<Desc> {
    if t.len() < arity {
        return Err(PyIndexError::new_err("tuple index out of range"));
    }
    Ok(Desc::new(tuple_u64(t, 0)?, tuple_u64(t, 1)?, tuple_u64(t, 2)?))
}

/// `str` (UTF-8) or bytes-like as bytes, the way pybind11 converts to `std::string`.
pub(crate) fn bytes_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_str()?.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<pyo3::types::PyByteArray>() {
        return Ok(b.to_vec());
    }
    Err(PyTypeError::new_err(format!(
        "expected str or bytes, got '{}'",
        obj.get_type().name()?
    )))
}

impl Elem for Desc {
    const ARITY: usize = 3;
    const SERDES_KIND: &'static [u8] = b"nixlBDList";
    const PACKED: bool = true;
    fn basic(&self) -> &Desc {
        self
    }
    fn from_tuple(t: &Bound<'_, PyTuple>) -> PyResult<Self> {
        tuple_desc(t, 3)
    }
    fn to_tuple<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        (self.addr, self.len, self.dev).into_pyobject(py)
    }
    fn extra(&self) -> &[u8] {
        &[]
    }
    fn with_extra(desc: Desc, extra: &[u8]) -> PyResult<Self> {
        if !extra.is_empty() {
            return Err(PyValueError::new_err(
                "serialized transfer descriptor has trailing bytes",
            ));
        }
        Ok(desc)
    }
}

impl Elem for RegDesc {
    const ARITY: usize = 4;
    const SERDES_KIND: &'static [u8] = b"nixlSDList";
    const PACKED: bool = false;
    fn basic(&self) -> &Desc {
        &self.desc
    }
    fn from_tuple(t: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let desc = tuple_desc(t, 4)?;
        Ok(RegDesc {
            desc,
            meta: bytes_of(&t.get_item(3)?)?,
        })
    }
    fn to_tuple<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let d = &self.desc;
        (d.addr, d.len, d.dev, PyBytes::new(py, &self.meta)).into_pyobject(py)
    }
    fn extra(&self) -> &[u8] {
        &self.meta
    }
    fn with_extra(desc: Desc, extra: &[u8]) -> PyResult<Self> {
        Ok(RegDesc {
            desc,
            meta: extra.to_vec(),
        })
    }
}

impl Elem for RemoteDesc {
    const ARITY: usize = 4;
    // NIXL cannot pickle remote lists; gixl uses the same layout under its own name.
    const SERDES_KIND: &'static [u8] = b"nixlRDList";
    const PACKED: bool = false;
    fn basic(&self) -> &Desc {
        &self.desc
    }
    fn from_tuple(t: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let desc = tuple_desc(t, 4)?;
        let agent = String::from_utf8(bytes_of(&t.get_item(3)?)?)
            .map_err(|_| PyValueError::new_err("remote agent name is not valid UTF-8"))?;
        Ok(RemoteDesc { desc, agent })
    }
    fn to_tuple<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let d = &self.desc;
        (d.addr, d.len, d.dev, self.agent.as_str()).into_pyobject(py)
    }
    fn extra(&self) -> &[u8] {
        self.agent.as_bytes()
    }
    fn with_extra(desc: Desc, extra: &[u8]) -> PyResult<Self> {
        let agent = String::from_utf8(extra.to_vec())
            .map_err(|_| PyValueError::new_err("serialized remote agent name is not valid UTF-8"))?;
        Ok(RemoteDesc { desc, agent })
    }
}

/// The state shared by the three classes.
pub(crate) struct Shared<T> {
    list: Mutex<Arc<DList<T>>>,
}

impl<T: Elem> Shared<T> {
    fn new(l: DList<T>) -> Self {
        Shared {
            list: Mutex::new(Arc::new(l)),
        }
    }

    /// The list as it is now; later changes from Python do not affect the snapshot.
    pub fn snapshot(&self) -> Arc<DList<T>> {
        self.list.lock().clone()
    }

    fn edit<R>(&self, f: impl FnOnce(&mut DList<T>) -> R) -> R {
        let mut g = self.list.lock();
        f(Arc::make_mut(&mut g))
    }

    fn check_index(&self, i: isize) -> PyResult<usize> {
        let n = self.list.lock().len();
        usize::try_from(i)
            .ok()
            .filter(|&i| i < n)
            .ok_or_else(|| PyIndexError::new_err("Index is out of range"))
    }

    fn get<'py>(&self, py: Python<'py>, i: isize) -> PyResult<Bound<'py, PyTuple>> {
        let i = self.check_index(i)?;
        let l = self.snapshot();
        l.get(i).expect("index checked").to_tuple(py)
    }

    fn set(&self, i: isize, t: &Bound<'_, PyTuple>) -> PyResult<()> {
        let v = T::from_tuple(t)?;
        let i = self.check_index(i)?;
        self.edit(|l| match l.get_mut(i) {
            Some(slot) => {
                *slot = v;
                Ok(())
            }
            None => Err(PyIndexError::new_err("Index is out of range")),
        })
    }

    fn add(&self, t: &Bound<'_, PyTuple>) -> PyResult<()> {
        let v = T::from_tuple(t)?;
        self.edit(|l| l.push(v));
        Ok(())
    }

    fn remove(&self, i: isize) -> PyResult<()> {
        let i = self.check_index(i)?;
        self.edit(|l| {
            l.remove(i)
                .map(|_| ())
                .map_err(|_| PyIndexError::new_err("Index is out of range"))
        })
    }

    fn position(&self, t: &Bound<'_, PyTuple>) -> PyResult<usize> {
        let q = T::from_tuple(t)?;
        // NIXL compares descriptors of a registration list by address, length and device only.
        let l = self.snapshot();
        l.iter()
            .position(|d| if T::PACKED { d == &q } else { d.basic() == q.basic() })
            .ok_or_else(|| errors::status_error(gixl::Status::NotFound as i32))
    }

    fn print(&self, py: Python<'_>) -> PyResult<()> {
        let l = self.snapshot();
        let mut out = format!("DescList of mem type {}\n", l.mem_type() as u32);
        for d in l.iter() {
            let b = d.basic();
            out.push_str(&format!("  addr: {:#x}, len: {}, devId: {}", b.addr, b.len, b.dev));
            let extra = d.extra();
            if !extra.is_empty() {
                out.push_str(&format!(", meta: {}", String::from_utf8_lossy(extra)));
            }
            out.push('\n');
        }
        let sys = py.import("sys")?;
        let stdout = sys.getattr("stdout")?;
        stdout.call_method1("write", (out,))?;
        Ok(())
    }

    fn eq(&self, other: &Shared<T>) -> bool {
        std::ptr::eq(self, other) || *self.snapshot() == *other.snapshot()
    }

    fn getstate<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &serialize(&self.snapshot()))
    }

    fn setstate(&self, state: &Bound<'_, PyAny>) -> PyResult<()> {
        let bytes = bytes_of(state)?;
        let l = deserialize::<T>(&bytes)?;
        *self.list.lock() = Arc::new(l);
        Ok(())
    }
}

pub(crate) fn mem_type(m: &Bound<'_, MemT>) -> PyResult<MemType> {
    let v = m.get().get();
    u32::try_from(v)
        .ok()
        .and_then(|v| MemType::from_u32(v).ok())
        .ok_or_else(|| PyValueError::new_err(format!("unknown memory type {v}")))
}

pub(crate) fn mem_obj(py: Python<'_>, m: MemType) -> PyResult<Bound<'_, MemT>> {
    Bound::new(py, MemT::new_value(m as i64))
}

/// Builds a list's descriptors from the rows of an `N x 3` array.
type FromRows<T> = fn(Vec<[u64; 3]>) -> Vec<T>;

/// Parse `(type, init_size=0)`, `(type, descs: ndarray)` or `(type, descs: list)`; no arguments at all
/// gives an empty DRAM list (what unpickling a NIXL pickle does before `__setstate__`).
fn construct<T: Elem>(
    class: &str,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
    from_rows: Option<FromRows<T>>,
) -> PyResult<DList<T>> {
    let mut ty: Option<Bound<'_, PyAny>> = None;
    let mut second: Option<Bound<'_, PyAny>> = None;
    if args.len() > 2 {
        return Err(ctor_error(class, from_rows.is_some()));
    }
    if !args.is_empty() {
        ty = Some(args.get_item(0)?);
    }
    if args.len() == 2 {
        second = Some(args.get_item(1)?);
    }
    if let Some(kw) = kwargs {
        for (k, v) in kw.iter() {
            let k: String = k.extract()?;
            let slot = match k.as_str() {
                "type" => &mut ty,
                "init_size" | "descs" => &mut second,
                _ => return Err(ctor_error(class, from_rows.is_some())),
            };
            if slot.is_some() {
                return Err(ctor_error(class, from_rows.is_some()));
            }
            *slot = Some(v);
        }
    }
    let Some(ty) = ty else {
        if second.is_some() {
            return Err(ctor_error(class, from_rows.is_some()));
        }
        return Ok(DList::new(MemType::Dram));
    };
    let Ok(ty) = ty.cast::<MemT>() else {
        return Err(ctor_error(class, from_rows.is_some()));
    };
    let mem = mem_type(ty)?;
    let Some(second) = second else {
        return Ok(DList::new(mem));
    };
    if second.is_instance_of::<PyInt>() {
        let n: usize = second.extract()?;
        let mut l = DList::new(mem);
        l.resize(n);
        return Ok(l);
    }
    if let Ok(list) = second.cast::<PyList>() {
        let mut descs = Vec::with_capacity(list.len());
        for item in list.iter() {
            let t = item
                .cast::<PyTuple>()
                .map_err(|_| PyTypeError::new_err("Each descriptor must be a tuple when provided as a list"))?;
            if t.len() != T::ARITY {
                return Err(PyValueError::new_err(format!(
                    "Each descriptor tuple must have exactly {} elements",
                    T::ARITY
                )));
            }
            descs.push(T::from_tuple(t)?);
        }
        return Ok(DList::with_descs(mem, descs));
    }
    if let Some(from_rows) = from_rows {
        if is_ndarray(&second) {
            let rows = ArrayView::new(&second)?.rows_u64::<3>()?;
            return Ok(DList::with_descs(mem, from_rows(rows)));
        }
    }
    Err(ctor_error(class, from_rows.is_some()))
}

fn ctor_error(class: &str, ndarray: bool) -> PyErr {
    let mut msg = format!(
        "__init__(): incompatible constructor arguments. The following argument types are supported:\n    \
         1. {class}(type: nixl_mem_t, init_size: int = 0)\n"
    );
    if ndarray {
        msg.push_str(&format!(
            "    2. {class}(type: nixl_mem_t, descs: numpy.ndarray)\n    3. {class}(type: nixl_mem_t, descs: list)\n"
        ));
    } else {
        msg.push_str(&format!("    2. {class}(type: nixl_mem_t, descs: list)\n"));
    }
    PyTypeError::new_err(msg)
}

// ----- NIXL's serializer layout -----
//
// "nixlSerDes|" then fields, each `tag` + u64 length + bytes + "|":
// ("nixlDList", kind) ("t", u32 memory type) ("n", u64 count), then either one ("", count × 24 bytes)
// record (packed kind, omitted when empty) or count × ("", 24 bytes + extra) records.

const SERDES_MAGIC: &[u8] = b"nixlSerDes|";

fn put_field(out: &mut Vec<u8>, tag: &[u8], data: &[u8]) {
    out.extend_from_slice(tag);
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    out.extend_from_slice(data);
    out.push(b'|');
}

fn put_desc(out: &mut Vec<u8>, d: &Desc) {
    out.extend_from_slice(&d.addr.to_le_bytes());
    out.extend_from_slice(&d.len.to_le_bytes());
    out.extend_from_slice(&d.dev.to_le_bytes());
}

pub(crate) fn serialize<T: Elem>(l: &DList<T>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + l.len() * 40);
    out.extend_from_slice(SERDES_MAGIC);
    put_field(&mut out, b"nixlDList", T::SERDES_KIND);
    put_field(&mut out, b"t", &(l.mem_type() as u32).to_le_bytes());
    put_field(&mut out, b"n", &(l.len() as u64).to_le_bytes());
    if T::PACKED {
        if !l.is_empty() {
            let mut rec = Vec::with_capacity(l.len() * 24);
            for d in l.iter() {
                put_desc(&mut rec, d.basic());
            }
            put_field(&mut out, b"", &rec);
        }
    } else {
        let mut rec = Vec::new();
        for d in l.iter() {
            rec.clear();
            put_desc(&mut rec, d.basic());
            rec.extend_from_slice(d.extra());
            put_field(&mut out, b"", &rec);
        }
    }
    out
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn field(&mut self, tag: &[u8]) -> Option<&'a [u8]> {
        let rest = self.buf.strip_prefix(tag)?;
        let len = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
        let len = usize::try_from(len).ok()?;
        let data = rest.get(8..8usize.checked_add(len)?)?;
        if rest.get(8 + len) != Some(&b'|') {
            return None;
        }
        self.buf = &rest[8 + len + 1..];
        Some(data)
    }
}

fn desc_at(b: &[u8]) -> Desc {
    let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    Desc::new(w(0), w(1), w(2))
}

pub(crate) fn deserialize<T: Elem>(buf: &[u8]) -> PyResult<DList<T>> {
    let bad = || {
        PyValueError::new_err(format!(
            "not a serialized descriptor list of kind {}",
            String::from_utf8_lossy(T::SERDES_KIND)
        ))
    };
    let mut r = Reader {
        buf: buf.strip_prefix(SERDES_MAGIC).ok_or_else(bad)?,
    };
    if r.field(b"nixlDList").ok_or_else(bad)? != T::SERDES_KIND {
        return Err(bad());
    }
    let t = r.field(b"t").ok_or_else(bad)?;
    let mem = u32::from_le_bytes(t.try_into().map_err(|_| bad())?);
    let mem = MemType::from_u32(mem).map_err(|_| bad())?;
    let n = r.field(b"n").ok_or_else(bad)?;
    let n = u64::from_le_bytes(n.try_into().map_err(|_| bad())?);
    let n = usize::try_from(n).map_err(|_| bad())?;
    let mut descs = Vec::with_capacity(n.min(buf.len() / 24));
    if T::PACKED {
        if n > 0 {
            let rec = r.field(b"").ok_or_else(bad)?;
            if Some(rec.len()) != n.checked_mul(24) {
                return Err(bad());
            }
            for chunk in rec.chunks_exact(24) {
                descs.push(T::with_extra(desc_at(chunk), &[])?);
            }
        }
    } else {
        for _ in 0..n {
            let rec = r.field(b"").ok_or_else(bad)?;
            if rec.len() < 24 {
                return Err(bad());
            }
            descs.push(T::with_extra(desc_at(&rec[..24]), &rec[24..])?);
        }
    }
    if !r.buf.is_empty() {
        return Err(bad());
    }
    Ok(DList::with_descs(mem, descs))
}

// ----- the classes -----

fn rows_to_descs(rows: Vec<[u64; 3]>) -> Vec<Desc> {
    rows.into_iter().map(|[a, l, d]| Desc::new(a, l, d)).collect()
}

fn rows_to_regs(rows: Vec<[u64; 3]>) -> Vec<RegDesc> {
    rows.into_iter()
        .map(|[a, l, d]| RegDesc {
            desc: Desc::new(a, l, d),
            meta: Vec::new(),
        })
        .collect()
}

macro_rules! dlist_common {
    ($cls:ident, $elem:ty) => {
        #[allow(dead_code)]
        impl $cls {
            pub(crate) fn snapshot(&self) -> Arc<DList<$elem>> {
                self.0.snapshot()
            }
            pub(crate) fn from_list(l: DList<$elem>) -> Self {
                $cls(Shared::new(l))
            }
        }
    };
}

/// `nixlXferDList`: descriptors of one memory type to transfer from or to.
#[pyclass(frozen, module = "nixl._bindings", name = "nixlXferDList")]
pub struct XferDList(Shared<Desc>);
dlist_common!(XferDList, Desc);

/// `nixlRegDList`: descriptors to register, each with opaque metadata bytes.
#[pyclass(frozen, module = "nixl._bindings", name = "nixlRegDList")]
pub struct RegDList(Shared<RegDesc>);
dlist_common!(RegDList, RegDesc);

/// `nixlRemoteDList`: descriptors on named agents.
#[pyclass(frozen, module = "nixl._bindings", name = "nixlRemoteDList")]
pub struct RemoteDList(Shared<RemoteDesc>);
dlist_common!(RemoteDList, RemoteDesc);

/// The methods every list class has; `$ctor_rows` is the numpy constructor path, if the class has one.
macro_rules! dlist_methods {
    ($cls:ident, $pyname:literal, $ctor_rows:expr, { $($extra:tt)* }) => {
        #[allow(non_snake_case)]
        #[pymethods]
        impl $cls {
            $($extra)*

            #[new]
            #[pyo3(signature = (*args, **kwargs))]
            fn py_new(args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
                Ok($cls(Shared::new(construct($pyname, args, kwargs, $ctor_rows)?)))
            }

            fn getType<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, MemT>> {
                mem_obj(py, self.0.list.lock().mem_type())
            }

            fn descCount(&self) -> usize {
                self.0.list.lock().len()
            }

            fn isEmpty(&self) -> bool {
                self.0.list.lock().is_empty()
            }

            fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> PyResult<Py<PyAny>> {
                let py = other.py();
                let Ok(other) = other.cast::<$cls>() else {
                    return Ok(py.NotImplemented());
                };
                match op {
                    CompareOp::Eq => self.0.eq(&other.get().0).into_py_any(py),
                    CompareOp::Ne => (!self.0.eq(&other.get().0)).into_py_any(py),
                    _ => Ok(py.NotImplemented()),
                }
            }

            fn __getitem__<'py>(&self, py: Python<'py>, index: isize) -> PyResult<Bound<'py, PyTuple>> {
                self.0.get(py, index)
            }

            fn __setitem__(&self, index: isize, desc: &Bound<'_, PyTuple>) -> PyResult<()> {
                self.0.set(index, desc)
            }

            fn addDesc(&self, desc: &Bound<'_, PyTuple>) -> PyResult<()> {
                self.0.add(desc)
            }

            fn append(&self, desc: &Bound<'_, PyTuple>) -> PyResult<()> {
                self.0.add(desc)
            }

            fn remDesc(&self, index: isize) -> PyResult<()> {
                self.0.remove(index)
            }

            fn clear(&self) {
                self.0.edit(|l| l.clear())
            }

            fn print(&self, py: Python<'_>) -> PyResult<()> {
                self.0.print(py)
            }

            fn __getstate__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
                self.0.getstate(py)
            }

            fn __setstate__(&self, state: &Bound<'_, PyAny>) -> PyResult<()> {
                self.0.setstate(state)
            }
        }
    };
}

dlist_methods!(XferDList, "nixlXferDList", Some(rows_to_descs as FromRows<Desc>), {
    /// Position of the first descriptor equal to `desc`; nixlNotFoundError if there is none.
    fn index(&self, desc: &Bound<'_, PyTuple>) -> PyResult<usize> {
        self.0.position(desc)
    }
});

dlist_methods!(RegDList, "nixlRegDList", Some(rows_to_regs as FromRows<RegDesc>), {
    /// Position of the first descriptor with the same address, length and device (metadata is not
    /// compared, as in NIXL); nixlNotFoundError if there is none.
    fn index(&self, desc: &Bound<'_, PyTuple>) -> PyResult<usize> {
        self.0.position(desc)
    }

    /// The descriptors without their metadata.
    fn trim(&self) -> XferDList {
        XferDList::from_list(self.0.snapshot().trim())
    }
});

dlist_methods!(RemoteDList, "nixlRemoteDList", None::<FromRows<RemoteDesc>>, {});

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<XferDList>()?;
    m.add_class::<RegDList>()?;
    m.add_class::<RemoteDList>()?;
    Ok(())
}
