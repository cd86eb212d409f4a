//! `nixlAgent`: NIXL's raw agent binding over `gixl::Agent`.
//!
//! Handles (backends, prepped lists, transfer requests) are Python ints as in NIXL, but they are keys of a
//! per-agent table, never addresses: a released, never-issued or other agent's handle raises
//! `nixlInvalidParamError` instead of crashing. Handle numbers come from one process-wide counter, so no
//! two live objects ever share one. Every call that does real work runs with the interpreter released (a
//! `makeXferReq` of at most `PLAN_WITH_GIL` indices, about 40 µs of planning, keeps it: releasing costs more).
//!
//! What this module does not do: decide anything about transfers. Validation, registration coverage and
//! the stale-peer checks are the core's; this layer converts arguments and results.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use gixl::{BackendId, Desc, MemType, NotifUpdate, Params, PreppedDList, Status, XferOp, XferOpts, XferReq};
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use pyo3::Borrowed;

use crate::config::{AgentConfig, XferTelemetry};
use crate::dlist::{bytes_of, mem_type, RegDList, RemoteDList, XferDList};
use crate::enums::{MemT, StatusT, XferOpT};
use crate::errors::{bad_handle, status_error, with_note, IntoPyResult};
use crate::ndarray::{is_ndarray, ArrayView, HeldIndices, Idx};

/// Start well away from small integers, so that an index or a count passed by mistake is never a handle.
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(0x6_1000_0000);

fn next_handle() -> u64 {
    NEXT_HANDLE.fetch_add(0x10, Ordering::Relaxed)
}

/// Most blocks one strided (Nx5) prep may expand to; each costs 24 bytes.
const MAX_STRIDED_BLOCKS: u64 = 1 << 27;

#[derive(Default)]
struct Handles {
    backends: Vec<(u64, BackendId)>,
    dlists: HashMap<u64, PreppedDList>,
    xfers: HashMap<u64, XferReq>,
}

/// `nixlAgent(name, cfg)`.
#[pyclass(frozen, module = "nixl._bindings", name = "nixlAgent")]
pub struct Agent {
    agent: gixl::Agent,
    handles: Mutex<Handles>,
}

/// A message argument: `str` (UTF-8) or bytes-like, like pybind11's `std::string`.
#[derive(Default)]
struct Msg(Vec<u8>);

impl<'a, 'py> FromPyObject<'a, 'py> for Msg {
    type Error = PyErr;
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        bytes_of(&obj).map(Msg)
    }
}

fn xfer_op(op: &Bound<'_, XferOpT>) -> PyResult<XferOp> {
    let v = op.get().get();
    u32::try_from(v)
        .ok()
        .and_then(|v| XferOp::from_u32(v).ok())
        .ok_or_else(|| PyValueError::new_err(format!("unknown transfer operation {v}")))
}

fn ok_status(py: Python<'_>, s: Status) -> PyResult<Bound<'_, StatusT>> {
    Bound::new(py, StatusT::of(s))
}

/// `nixl._api`'s name of a transfer state.
fn state_name(py: Python<'_>, s: Status) -> Bound<'_, PyString> {
    match s {
        Status::Success => pyo3::intern!(py, "DONE").clone(),
        Status::InProg => pyo3::intern!(py, "PROC").clone(),
        _ => pyo3::intern!(py, "ERR").clone(),
    }
}

fn status_of(r: gixl::Result<()>) -> StatusT {
    match r {
        Ok(()) => StatusT::of(Status::Success),
        Err(e) => StatusT::of(e.status()),
    }
}

fn params_dict<'py>(py: Python<'py>, p: &Params) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in p {
        d.set_item(k, v)?;
    }
    Ok(d)
}

fn mem_names(mems: &[MemType]) -> Vec<&'static str> {
    mems.iter().map(|m| m.seg_name()).collect()
}

fn params_of(obj: &Bound<'_, PyAny>) -> PyResult<Params> {
    let mut p = Params::new();
    let items = match obj.cast::<PyDict>() {
        Ok(d) => d.items().into_any(),
        Err(_) => obj.call_method0("items")?,
    };
    for item in items.try_iter()? {
        let (k, v): (String, String) = item?.extract()?;
        p.insert(k, v);
    }
    Ok(p)
}

/// Indices for `makeXferReq`: a sequence of ints or a 1-D numpy array of any numeric dtype (floats are
/// truncated, as NIXL's force-cast does), read without creating a Python object per element.
fn indices(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if is_ndarray(obj) {
        let v = ArrayView::new(obj)?;
        if v.shape.len() != 1 {
            return Err(PyValueError::new_err("indices numpy array must be 1D"));
        }
        if let Some(s) = v.as_i64_slice() {
            return Ok(s.to_vec());
        }
        // Values outside i64 cannot be valid indices; saturate so the core reports them as out of range.
        return Ok(v.to_i64_vec());
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(
            "indices must be a sequence of ints or a 1-D numpy array",
        ));
    }
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for item in obj.try_iter()? {
        out.push(item?.extract::<i64>()?);
    }
    Ok(out)
}

/// Requests of at most this many indices are planned without releasing the interpreter (about 40 µs).
const PLAN_WITH_GIL: usize = 4096;

/// A 1-D int32 / int64 numpy array's memory, held for reading in place.
fn held(obj: &Bound<'_, PyAny>) -> Option<HeldIndices> {
    if is_ndarray(obj) {
        HeldIndices::new(obj)
    } else {
        None
    }
}

/// Expand NIXL 1.5.1's strided rows `(addr, len, dev, stride, count)` into `count` blocks each.
fn expand_strided(mem: MemType, rows: &[[u64; 5]]) -> PyResult<gixl::XferDList> {
    let reject = |why: String| with_note(status_error(Status::NotFound as i32), &why);
    let mut total = 0u64;
    for (i, &[addr, len, _dev, stride, count]) in rows.iter().enumerate() {
        if count == 0 || stride < len {
            return Err(reject(format!("strided row {i}: count must be at least 1 and stride at least len (len {len}, stride {stride}, count {count})")));
        }
        let last = (count - 1)
            .checked_mul(stride)
            .and_then(|o| o.checked_add(addr))
            .and_then(|a| a.checked_add(len));
        if last.is_none() {
            return Err(reject(format!(
                "strided row {i} runs past the end of the address space"
            )));
        }
        total = total.saturating_add(count);
    }
    if total > MAX_STRIDED_BLOCKS {
        return Err(with_note(
            status_error(Status::InvalidParam as i32),
            &format!("strided list expands to {total} blocks; gixl allows at most {MAX_STRIDED_BLOCKS} per prep"),
        ));
    }
    let mut descs = Vec::with_capacity(total as usize);
    for &[addr, len, dev, stride, count] in rows {
        for k in 0..count {
            descs.push(Desc::new(addr + k * stride, len, dev));
        }
    }
    Ok(gixl::XferDList::with_descs(mem, descs))
}

impl Agent {
    fn hints(&self, backends: &[u64]) -> PyResult<Vec<BackendId>> {
        let h = self.handles.lock();
        backends
            .iter()
            .map(|b| {
                h.backends
                    .iter()
                    .find(|(k, _)| k == b)
                    .map(|(_, id)| *id)
                    .ok_or_else(|| bad_handle("backend", *b))
            })
            .collect()
    }

    fn backend_id(&self, handle: u64) -> PyResult<BackendId> {
        Ok(self.hints(&[handle])?[0])
    }

    fn backend_handle(&self, id: BackendId) -> u64 {
        let mut h = self.handles.lock();
        if let Some((k, _)) = h.backends.iter().find(|(_, b)| *b == id) {
            return *k;
        }
        // A backend created through another path; give it a handle now.
        let k = next_handle();
        h.backends.push((k, id));
        k
    }

    fn dlist(&self, handle: u64) -> PyResult<PreppedDList> {
        self.handles
            .lock()
            .dlists
            .get(&handle)
            .cloned()
            .ok_or_else(|| bad_handle("prepped descriptor list", handle))
    }

    /// `postXferReq`'s work: an empty `notif_msg` keeps the request's notification.
    fn post(&self, py: Python<'_>, reqh: u64, notif_msg: Msg) -> PyResult<Status> {
        let x = self.xfer(reqh)?;
        let update = if notif_msg.0.is_empty() {
            NotifUpdate::Keep
        } else {
            NotifUpdate::Set(notif_msg.0)
        };
        py.detach(|| self.agent.post_xfer_req(&x, update)).py_err()
    }

    fn xfer(&self, handle: u64) -> PyResult<XferReq> {
        self.handles
            .lock()
            .xfers
            .get(&handle)
            .cloned()
            .ok_or_else(|| bad_handle("transfer request", handle))
    }

    fn add_dlist(&self, d: PreppedDList) -> u64 {
        let k = next_handle();
        self.handles.lock().dlists.insert(k, d);
        k
    }

    fn add_xfer(&self, x: XferReq) -> u64 {
        let k = next_handle();
        self.handles.lock().xfers.insert(k, x);
        k
    }

    fn prep(&self, py: Python<'_>, agent_name: &str, descs: &gixl::XferDList, backends: &[u64]) -> PyResult<u64> {
        let hints = self.hints(backends)?;
        let d = py
            .detach(|| self.agent.prep_xfer_dlist(agent_name, descs, &hints))
            .py_err()?;
        Ok(self.add_dlist(d))
    }
}

#[allow(non_snake_case)]
#[pymethods]
impl Agent {
    #[new]
    #[pyo3(signature = (name, cfg, /))]
    fn py_new(name: &str, cfg: PyRef<'_, AgentConfig>) -> PyResult<Self> {
        if name.is_empty() {
            return Err(PyValueError::new_err("Agent needs a non-empty name"));
        }
        // NIXL's agent constructor has no status to return: its failures (a listener port that is taken, a
        // telemetry exporter that cannot be made, a bad config file) raise RuntimeError, and so do these.
        let agent = gixl::Agent::new(name, cfg.to_core()?).map_err(|e| {
            crate::errors::with_note(
                PyRuntimeError::new_err(e.message().to_owned()),
                &format!("gixl status: {}", e.status().name()),
            )
        })?;
        Ok(Agent {
            agent,
            handles: Mutex::new(Handles::default()),
        })
    }

    // ----- plugins and backends -----

    fn getAvailPlugins(&self) -> Vec<String> {
        self.agent.available_plugins()
    }

    #[pyo3(signature = (plugin, /))]
    fn getPluginParams<'py>(&self, py: Python<'py>, plugin: &str) -> PyResult<(Bound<'py, PyDict>, Vec<&'static str>)> {
        let (p, mems) = self.agent.plugin_params(plugin).py_err()?;
        Ok((params_dict(py, &p)?, mem_names(&mems)))
    }

    #[pyo3(signature = (backend, /))]
    fn getBackendParams<'py>(
        &self,
        py: Python<'py>,
        backend: u64,
    ) -> PyResult<(Bound<'py, PyDict>, Vec<&'static str>)> {
        let id = self.backend_id(backend)?;
        let (p, mems) = self.agent.backend_params(id).py_err()?;
        Ok((params_dict(py, &p)?, mem_names(&mems)))
    }

    #[pyo3(signature = (plugin, params, /))]
    fn createBackend(&self, py: Python<'_>, plugin: &str, params: &Bound<'_, PyAny>) -> PyResult<u64> {
        let params = params_of(params)?;
        let id = py.detach(|| self.agent.create_backend(plugin, &params)).py_err()?;
        Ok(self.backend_handle(id))
    }

    // ----- memory -----

    #[pyo3(signature = (descs, backends = Vec::new()))]
    fn registerMem<'py>(
        &self,
        py: Python<'py>,
        descs: &Bound<'_, RegDList>,
        backends: Vec<u64>,
    ) -> PyResult<Bound<'py, StatusT>> {
        let hints = self.hints(&backends)?;
        let l = descs.get().snapshot();
        py.detach(|| self.agent.register_mem(&l, &hints)).py_err()?;
        ok_status(py, Status::Success)
    }

    #[pyo3(signature = (descs, backends = Vec::new()))]
    fn deregisterMem<'py>(
        &self,
        py: Python<'py>,
        descs: &Bound<'_, RegDList>,
        backends: Vec<u64>,
    ) -> PyResult<Bound<'py, StatusT>> {
        let hints = self.hints(&backends)?;
        let l = descs.get().snapshot();
        py.detach(|| self.agent.deregister_mem(&l, &hints)).py_err()?;
        ok_status(py, Status::Success)
    }

    #[pyo3(signature = (descs, backend))]
    fn queryMem<'py>(
        &self,
        py: Python<'py>,
        descs: &Bound<'_, RegDList>,
        backend: u64,
    ) -> PyResult<Bound<'py, PyList>> {
        let id = self.backend_id(backend)?;
        let l = descs.get().snapshot();
        let resp = py.detach(|| self.agent.query_mem(&l, id)).py_err()?;
        let out = PyList::empty(py);
        for r in resp {
            match r {
                Some(p) => out.append(params_dict(py, &p)?)?,
                None => out.append(py.None())?,
            }
        }
        Ok(out)
    }

    #[pyo3(signature = (remote_agent, backends, /))]
    fn makeConnection<'py>(
        &self,
        py: Python<'py>,
        remote_agent: &str,
        backends: Vec<u64>,
    ) -> PyResult<Bound<'py, StatusT>> {
        let hints = self.hints(&backends)?;
        py.detach(|| self.agent.make_connection(remote_agent, &hints))
            .py_err()?;
        ok_status(py, Status::Success)
    }

    // ----- transfers -----

    /// `prepXferDlist(agent_name, descs, backend=[])`, `prepXferDlist(descs, backend=[])` (this agent as
    /// initiator) or `prepXferDlist(agent_name, mem_type, descs: ndarray Nx5, backend=[])` (strided rows
    /// `(addr, len, dev, stride, count)`, each expanding to `count` blocks; indices then count blocks).
    #[pyo3(signature = (*args, **kwargs))]
    fn prepXferDlist(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<u64> {
        let mut agent_name: Option<Bound<'_, PyAny>> = None;
        let mut mem: Option<Bound<'_, PyAny>> = None;
        let mut descs: Option<Bound<'_, PyAny>> = None;
        let mut backend: Option<Bound<'_, PyAny>> = None;
        let pos: Vec<Bound<'_, PyAny>> = args.iter().collect();
        // Which overload the positional arguments select: the first is a name or a list, the second (after
        // a name) a list or a memory type.
        let first_is_name = pos.first().is_some_and(|a| a.is_instance_of::<PyString>());
        let strided = pos.get(1).is_some_and(|a| a.cast::<MemT>().is_ok())
            || kwargs.is_some_and(|k| k.contains("mem_type").unwrap_or(false));
        let mut slots: Vec<&mut Option<Bound<'_, PyAny>>> = if strided {
            vec![&mut agent_name, &mut mem, &mut descs, &mut backend]
        } else if first_is_name || kwargs.is_some_and(|k| k.contains("agent_name").unwrap_or(false)) {
            vec![&mut agent_name, &mut descs, &mut backend]
        } else {
            vec![&mut descs, &mut backend]
        };
        if pos.len() > slots.len() {
            return Err(prep_signature_error());
        }
        for (slot, v) in slots.iter_mut().zip(pos) {
            **slot = Some(v);
        }
        drop(slots);
        if let Some(kw) = kwargs {
            for (k, v) in kw.iter() {
                let k: String = k.extract()?;
                let slot = match k.as_str() {
                    "agent_name" => &mut agent_name,
                    "mem_type" => &mut mem,
                    "descs" => &mut descs,
                    "backend" | "backends" => &mut backend,
                    _ => return Err(prep_signature_error()),
                };
                if slot.is_some() {
                    return Err(prep_signature_error());
                }
                *slot = Some(v);
            }
        }
        let name: String = match &agent_name {
            Some(a) => a.extract().map_err(|_| prep_signature_error())?,
            None => String::new(),
        };
        let backends: Vec<u64> = match &backend {
            Some(b) => b.extract()?,
            None => Vec::new(),
        };
        let descs = descs.ok_or_else(prep_signature_error)?;
        if let Some(mem) = mem {
            let mem = mem.cast::<MemT>().map_err(|_| prep_signature_error())?;
            let mem = mem_type(mem)?;
            if !is_ndarray(&descs) {
                return Err(prep_signature_error());
            }
            let rows = ArrayView::new(&descs)?.rows_u64::<5>()?;
            let list = expand_strided(mem, &rows)?;
            return self.prep(py, &name, &list, &backends);
        }
        let list = descs
            .cast::<XferDList>()
            .map_err(|_| prep_signature_error())?
            .get()
            .snapshot();
        self.prep(py, &name, &list, &backends)
    }

    #[pyo3(signature = (operation, local_side, local_indices, remote_side, remote_indices, notif_msg = Msg::default(), backend = Vec::new(), skip_desc_merg = false))]
    #[allow(clippy::too_many_arguments)]
    fn makeXferReq(
        &self,
        py: Python<'_>,
        operation: &Bound<'_, XferOpT>,
        local_side: u64,
        local_indices: &Bound<'_, PyAny>,
        remote_side: u64,
        remote_indices: &Bound<'_, PyAny>,
        notif_msg: Msg,
        backend: Vec<u64>,
        skip_desc_merg: bool,
    ) -> PyResult<u64> {
        let op = xfer_op(operation)?;
        let local = self.dlist(local_side)?;
        let remote = self.dlist(remote_side)?;
        let opts = XferOpts {
            backends: self.hints(&backend)?,
            // Python's b"" means "no notification" (NIXL's binding does not set one for an empty string).
            notif: (!notif_msg.0.is_empty()).then_some(notif_msg.0),
            skip_desc_merge: skip_desc_merg,
        };
        // int32 / int64 arrays are planned from in place (held, so numpy cannot free or resize them); anything
        // else is converted first.
        let (lh, rh) = (held(local_indices), held(remote_indices));
        let (lc, rc) = (
            if lh.is_none() {
                Some(indices(local_indices)?)
            } else {
                None
            },
            if rh.is_none() {
                Some(indices(remote_indices)?)
            } else {
                None
            },
        );
        let li = lh
            .as_ref()
            .map_or_else(|| Idx::I64(lc.as_deref().unwrap_or(&[])), |h| h.idx());
        let ri = rh
            .as_ref()
            .map_or_else(|| Idx::I64(rc.as_deref().unwrap_or(&[])), |h| h.idx());
        let a = &self.agent;
        let plan = || match (li, ri) {
            (Idx::I32(l), Idx::I32(r)) => a.make_xfer_req_with(op, &local, l, &remote, r, &opts),
            (Idx::I64(l), Idx::I64(r)) => a.make_xfer_req_with(op, &local, l, &remote, r, &opts),
            (Idx::I32(l), Idx::I64(r)) => a.make_xfer_req_with(op, &local, l, &remote, r, &opts),
            (Idx::I64(l), Idx::I32(r)) => a.make_xfer_req_with(op, &local, l, &remote, r, &opts),
        };
        // Planning takes about 10 ns an index: small requests keep the interpreter (releasing and taking it
        // back costs more than they do), large ones let other threads run meanwhile.
        let x = if li.len() <= PLAN_WITH_GIL {
            plan()
        } else {
            py.detach(plan)
        }
        .py_err()?;
        Ok(self.add_xfer(x))
    }

    #[pyo3(signature = (operation, local_descs, remote_descs, remote_agent, notif_msg = Msg::default(), backend = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn createXferReq(
        &self,
        py: Python<'_>,
        operation: &Bound<'_, XferOpT>,
        local_descs: &Bound<'_, XferDList>,
        remote_descs: &Bound<'_, XferDList>,
        remote_agent: &str,
        notif_msg: Msg,
        backend: Vec<u64>,
    ) -> PyResult<u64> {
        let op = xfer_op(operation)?;
        let l = local_descs.get().snapshot();
        let r = remote_descs.get().snapshot();
        let opts = XferOpts {
            backends: self.hints(&backend)?,
            notif: (!notif_msg.0.is_empty()).then_some(notif_msg.0),
            skip_desc_merge: false,
        };
        let x = py
            .detach(|| self.agent.create_xfer_req(op, &l, &r, remote_agent, &opts))
            .py_err()?;
        Ok(self.add_xfer(x))
    }

    /// `(duration µs, error margin µs, method)`; the method is a plain int, as NIXL's binding returns it.
    #[pyo3(signature = (req_handle))]
    fn estimateXferCost(&self, py: Python<'_>, req_handle: u64) -> PyResult<(i64, i64, i64)> {
        let x = self.xfer(req_handle)?;
        let (d, m) = py.detach(|| self.agent.estimate_xfer_cost(&x)).py_err()?;
        Ok((d, m, 0))
    }

    /// Post a request: NIXL_SUCCESS (done) or NIXL_IN_PROG. An empty `notif_msg` keeps the request's
    /// notification; a non-empty one replaces it.
    #[pyo3(signature = (reqh, notif_msg = Msg::default()))]
    fn postXferReq<'py>(&self, py: Python<'py>, reqh: u64, notif_msg: Msg) -> PyResult<Bound<'py, StatusT>> {
        let s = self.post(py, reqh, notif_msg)?;
        ok_status(py, s)
    }

    /// `postXferReq` as `nixl._api`'s `transfer` wants it: the state's name (`"DONE"`, `"PROC"`), saving the
    /// wrapper a status object and its comparisons on every post (gixl's own; not in NIXL's bindings).
    #[pyo3(signature = (reqh, notif_msg = Msg::default()))]
    fn _postState<'py>(&self, py: Python<'py>, reqh: u64, notif_msg: Msg) -> PyResult<Bound<'py, PyString>> {
        let s = self.post(py, reqh, notif_msg)?;
        Ok(state_name(py, s))
    }

    /// `getXferStatus` as `nixl._api`'s `check_xfer_state` wants it (see `_postState`).
    #[pyo3(signature = (reqh, /))]
    fn _xferState<'py>(&self, py: Python<'py>, reqh: u64) -> PyResult<Bound<'py, PyString>> {
        let x = self.xfer(reqh)?;
        let s = py.detach(|| self.agent.xfer_status(&x)).py_err()?;
        Ok(state_name(py, s))
    }

    #[pyo3(signature = (reqh, /))]
    fn getXferStatus<'py>(&self, py: Python<'py>, reqh: u64) -> PyResult<Bound<'py, StatusT>> {
        let x = self.xfer(reqh)?;
        let s = py.detach(|| self.agent.xfer_status(&x)).py_err()?;
        ok_status(py, s)
    }

    /// Telemetry of the last post; while it is still in progress, an all-zero record (as NIXL returns).
    #[pyo3(signature = (reqh))]
    fn getXferTelemetry(&self, py: Python<'_>, reqh: u64) -> PyResult<XferTelemetry> {
        let x = self.xfer(reqh)?;
        let t = py.detach(|| self.agent.xfer_telemetry(&x)).py_err()?;
        Ok(t.map(XferTelemetry::from).unwrap_or_default())
    }

    /// The handle of the backend a request runs on (as `createBackend` returned it).
    #[pyo3(signature = (reqh, /))]
    fn queryXferBackend(&self, reqh: u64) -> PyResult<u64> {
        let x = self.xfer(reqh)?;
        Ok(self.backend_handle(x.backend()))
    }

    /// Release a request; an active transfer is aborted first. If it cannot be, nixlRepostActiveError
    /// and the handle stays valid.
    #[pyo3(signature = (reqh, /))]
    fn releaseXferReq<'py>(&self, py: Python<'py>, reqh: u64) -> PyResult<Bound<'py, StatusT>> {
        let x = self.xfer(reqh)?;
        py.detach(|| self.agent.release_xfer_req(&x)).py_err()?;
        self.handles.lock().xfers.remove(&reqh);
        ok_status(py, Status::Success)
    }

    #[pyo3(signature = (dlist_hndl, /))]
    fn releasedDlistH<'py>(&self, py: Python<'py>, dlist_hndl: u64) -> PyResult<Bound<'py, StatusT>> {
        let d = self.handles.lock().dlists.remove(&dlist_hndl);
        match d {
            Some(d) => {
                // The last reference may hold a peer's state; drop it without the interpreter.
                py.detach(move || drop(d));
                ok_status(py, Status::Success)
            }
            None => Err(bad_handle("prepped descriptor list", dlist_hndl)),
        }
    }

    // ----- notifications -----

    /// A copy of `notif_map` with the notifications that arrived since the last call appended.
    #[pyo3(signature = (notif_map, backends = Vec::new()))]
    fn getNotifs<'py>(
        &self,
        py: Python<'py>,
        notif_map: &Bound<'py, PyAny>,
        backends: Vec<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let hints = self.hints(&backends)?;
        let out = PyDict::new(py);
        let items = match notif_map.cast::<PyDict>() {
            Ok(d) => d.items().into_any(),
            Err(_) => notif_map.call_method0("items")?,
        };
        for item in items.try_iter()? {
            let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item?.extract()?;
            let k: String = k.extract()?;
            let list = PyList::empty(py);
            for m in v.try_iter()? {
                list.append(PyBytes::new(py, &bytes_of(&m?)?))?;
            }
            out.set_item(k, list)?;
        }
        let new = py.detach(|| self.agent.notifs(&hints)).py_err()?;
        for (sender, msg) in new {
            let msg = PyBytes::new(py, &msg);
            match out.get_item(&sender)? {
                Some(l) => l.cast::<PyList>()?.append(msg)?,
                None => out.set_item(&sender, PyList::new(py, [msg])?)?,
            }
        }
        Ok(out)
    }

    #[pyo3(signature = (remote_agent, msg, backends = Vec::new()))]
    fn genNotif<'py>(
        &self,
        py: Python<'py>,
        remote_agent: &str,
        msg: Msg,
        backends: Vec<u64>,
    ) -> PyResult<Bound<'py, StatusT>> {
        let hints = self.hints(&backends)?;
        py.detach(|| self.agent.gen_notif(remote_agent, &msg.0, &hints))
            .py_err()?;
        ok_status(py, Status::Success)
    }

    // ----- metadata -----

    fn getLocalMD<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let md = py.detach(|| self.agent.local_md()).py_err()?;
        Ok(PyBytes::new(py, &md))
    }

    #[pyo3(signature = (descs, inc_conn_info = false, backends = Vec::new()))]
    fn getLocalPartialMD<'py>(
        &self,
        py: Python<'py>,
        descs: &Bound<'_, RegDList>,
        inc_conn_info: bool,
        backends: Vec<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let hints = self.hints(&backends)?;
        let l = descs.get().snapshot();
        let md = py
            .detach(|| self.agent.local_partial_md(&l, inc_conn_info, &hints))
            .py_err()?;
        Ok(PyBytes::new(py, &md))
    }

    /// Load a peer's metadata; returns its name as bytes (NIXL returns bytes here).
    #[pyo3(signature = (metadata, /))]
    fn loadRemoteMD<'py>(&self, py: Python<'py>, metadata: Msg) -> PyResult<Bound<'py, PyBytes>> {
        let name = py.detach(|| self.agent.load_remote_md(&metadata.0)).py_err()?;
        Ok(PyBytes::new(py, name.as_bytes()))
    }

    /// Forget a peer. Returns the status and never raises, as in NIXL.
    #[pyo3(signature = (remote_agent, /))]
    fn invalidateRemoteMD(&self, py: Python<'_>, remote_agent: &str) -> StatusT {
        status_of(py.detach(|| self.agent.invalidate_remote_md(remote_agent)))
    }

    /// NIXL_SUCCESS if the peer is loaded and (for a non-empty list) one backend covers every
    /// descriptor; the failure status otherwise. Never raises.
    #[pyo3(signature = (remote_agent, descs, /))]
    fn checkRemoteMD(&self, py: Python<'_>, remote_agent: &str, descs: &Bound<'_, XferDList>) -> StatusT {
        let l = descs.get().snapshot();
        status_of(py.detach(|| self.agent.check_remote_md(remote_agent, &l)))
    }

    /// Publish this agent's metadata to the listener at `ip_addr:port`, or to etcd with no address. Returns
    /// at once; the I/O runs in the background and its failures are logged, as NIXL does.
    #[pyo3(signature = (ip_addr = "", port = 0))]
    fn sendLocalMD(&self, py: Python<'_>, ip_addr: &str, port: u16) -> PyResult<()> {
        py.detach(|| self.agent.send_local_md(ip_addr, port)).py_err()
    }

    #[pyo3(signature = (descs, inc_conn_info = false, backends = Vec::new(), ip_addr = "", port = 0, label = ""))]
    #[allow(clippy::too_many_arguments)]
    fn sendLocalPartialMD(
        &self,
        py: Python<'_>,
        descs: &Bound<'_, RegDList>,
        inc_conn_info: bool,
        backends: Vec<u64>,
        ip_addr: &str,
        port: u16,
        label: &str,
    ) -> PyResult<()> {
        let hints = self.hints(&backends)?;
        let l = descs.get().snapshot();
        py.detach(|| {
            self.agent
                .send_local_partial_md(&l, inc_conn_info, &hints, ip_addr, port, label)
        })
        .py_err()
    }

    /// Ask the listener at `ip_addr:port` (or etcd) for `remote_agent`'s metadata and load it in the
    /// background; poll with checkRemoteMD.
    #[pyo3(signature = (remote_agent, ip_addr = "", port = 0, label = ""))]
    fn fetchRemoteMD(&self, py: Python<'_>, remote_agent: &str, ip_addr: &str, port: u16, label: &str) -> PyResult<()> {
        py.detach(|| self.agent.fetch_remote_md(remote_agent, ip_addr, port, label))
            .py_err()
    }

    #[pyo3(signature = (ip_addr = "", port = 0))]
    fn invalidateLocalMD(&self, py: Python<'_>, ip_addr: &str, port: u16) -> PyResult<()> {
        py.detach(|| self.agent.invalidate_local_md(ip_addr, port)).py_err()
    }

    // ----- GPU device API (not in this build) -----

    #[pyo3(signature = (dlist, backends = Vec::new()))]
    fn prepMemView(&self, dlist: &Bound<'_, PyAny>, backends: Vec<u64>) -> PyResult<u64> {
        if dlist.cast::<XferDList>().is_err() && dlist.cast::<RemoteDList>().is_err() {
            return Err(PyTypeError::new_err(
                "prepMemView(): dlist must be a nixlXferDList or a nixlRemoteDList",
            ));
        }
        self.hints(&backends)?;
        Err(with_note(
            status_error(Status::NotSupported as i32),
            "memory views need the UCX GPU device API, which this gixl build does not have",
        ))
    }

    #[pyo3(signature = (mvh))]
    fn releaseMemView(&self, mvh: u64) -> PyResult<()> {
        Err(with_note(
            status_error(Status::NotSupported as i32),
            &format!("{mvh:#x}: this gixl build has no memory views"),
        ))
    }
}

fn prep_signature_error() -> PyErr {
    PyTypeError::new_err(
        "prepXferDlist(): incompatible function arguments. The following argument types are supported:\n    \
         1. (self, agent_name: str, descs: nixlXferDList, backend: Sequence[int] = [])\n    \
         2. (self, descs: nixlXferDList, backend: Sequence[int] = [])\n    \
         3. (self, agent_name: str, mem_type: nixl_mem_t, descs: numpy.ndarray, backend: Sequence[int] = [])",
    )
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Agent>()?;
    Ok(())
}
