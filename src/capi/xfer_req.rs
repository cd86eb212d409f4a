//! `nixl_capi_xfer_req_t`: transfer requests. Lifecycle as NIXL: make or create, post (any number of
//! times), poll, release (with the agent), then destroy. Destroying before releasing is
//! INVALID_STATE; after release the handle is still live but every call except destroy is
//! INVALID_PARAM; after destroy it is gone. A request is accepted only by the agent that made it.

use std::ffi::{c_char, c_int};

use libc::size_t;
use parking_lot::Mutex;

use super::agent::{nixl_capi_agent_t, AgentObj, AGENTS};
use super::backend::{self, nixl_capi_backend_t};
use super::boundary::{ffi, ints_arg, put, status_of, str_arg, Fail, OK};
use super::dlist_handle::{nixl_capi_xfer_dlist_handle_t, DLIST_HANDLES};
use super::opt_args::{self, nixl_capi_opt_args_t};
use super::registry::Registry;
use super::xfer_dlist::{self, gixl_desc_t, nixl_capi_xfer_dlist_t};
use super::{mem_for_agent, nixl_capi_cost_t, nixl_capi_status_t, CapiStatus, CostRaw, MemTypeRaw, XferOpRaw};
use crate::agent::XferReq;
use crate::backend::XferOp;
use crate::status::Status;

/// Opaque transfer request (`struct nixl_capi_xfer_req_s`).
pub struct nixl_capi_xfer_req_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_xfer_req_t = *mut nixl_capi_xfer_req_s;

pub(crate) struct XferReqObj {
    owner: u128,
    /// `None` once released (NIXL nulls its inner pointer and keeps the wrapper until destroy).
    req: Mutex<Option<XferReq>>,
}

pub(crate) static XFER_REQS: Registry<XferReqObj> = Registry::new("xfer request");

/// The request behind `h`, if `a` made it and it was not released.
pub(crate) fn live(a: &AgentObj, h: nixl_capi_xfer_req_t) -> Result<XferReq, Fail> {
    let r = XFER_REQS.get(h, "req_hndl")?;
    if r.owner != a.owner() {
        return Err(Fail::invalid("transfer request belongs to another agent"));
    }
    let req = r.req.lock().clone();
    req.ok_or_else(|| Fail::invalid("transfer request was released"))
}

fn op_of(op: XferOpRaw) -> Result<XferOp, Fail> {
    Ok(XferOp::from_u32(u32::try_from(op).map_err(|_| Fail::invalid(format!("unknown transfer operation {op}")))?)?)
}

fn new_req(a: &AgentObj, req: XferReq, out: *mut nixl_capi_xfer_req_t) -> Result<nixl_capi_status_t, Fail> {
    put(out, XFER_REQS.insert(XferReqObj { owner: a.owner(), req: Mutex::new(Some(req)) }));
    OK
}

/// Makes a request from two prepped lists (local: prepped with "", remote: with a peer's or this agent's
/// own name) and index lists of equal length. Pure planning; nothing moves until it is posted.
#[no_mangle]
pub extern "C" fn nixl_capi_make_xfer_req(
    agent: nixl_capi_agent_t,
    operation: XferOpRaw,
    local_descs: nixl_capi_xfer_dlist_handle_t,
    local_indices: *const c_int,
    local_indices_count: size_t,
    remote_descs: nixl_capi_xfer_dlist_handle_t,
    remote_indices: *const c_int,
    remote_indices_count: size_t,
    req_hndl: *mut nixl_capi_xfer_req_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        nonnull(req_hndl);
        let a = AGENTS.get(agent, "agent")?;
        let op = op_of(operation)?;
        let l = DLIST_HANDLES.get(local_descs, "local_descs")?;
        let r = DLIST_HANDLES.get(remote_descs, "remote_descs")?;
        l.check_owner(&a)?;
        r.check_owner(&a)?;
        // Before reading either array: a count the other side does not match is refused without touching (or
        // allocating for) memory the caller may not have.
        if local_indices_count != remote_indices_count {
            Err(Fail::invalid(format!(
                "local_indices has {local_indices_count} entries, remote_indices {remote_indices_count}"
            )))?;
        }
        let li: Vec<i64> = ints_arg(local_indices, local_indices_count, "local_indices")?.iter().map(|&i| i as i64).collect();
        let ri: Vec<i64> = ints_arg(remote_indices, remote_indices_count, "remote_indices")?.iter().map(|&i| i as i64).collect();
        let opts = opt_args::xfer_opts(opt_args, &a)?;
        let req = a.agent.make_xfer_req(op, &l.h, &li, &r.h, &ri, &opts)?;
        new_req(&a, req, req_hndl)
    }
}

/// Preps both lists and makes the request in one step. ERROR_BACKEND for any failure of the request
/// itself (an unknown agent too), as NIXL; bad arguments and handles are INVALID_PARAM.
#[no_mangle]
pub extern "C" fn nixl_capi_create_xfer_req(
    agent: nixl_capi_agent_t,
    operation: XferOpRaw,
    local_descs: nixl_capi_xfer_dlist_t,
    remote_descs: nixl_capi_xfer_dlist_t,
    remote_agent: *const c_char,
    req_hndl: *mut nixl_capi_xfer_req_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        nonnull(req_hndl);
        let a = AGENTS.get(agent, "agent")?;
        let op = op_of(operation)?;
        let l = xfer_dlist::get(local_descs)?;
        let r = xfer_dlist::get(remote_descs)?;
        let remote = str_arg(remote_agent, "remote_agent")?;
        let opts = opt_args::xfer_opts(opt_args, &a)?;
        let req = {
            let (l, r) = (l.read(), r.read());
            let (l, r) = (xfer_dlist::for_agent(&l), xfer_dlist::for_agent(&r));
            l.and_then(|l| r.and_then(|r| Ok(a.agent.create_xfer_req(op, l, r, remote, &opts)?)))
                .map_err(Fail::any_as_backend)?
        };
        new_req(&a, req, req_hndl)
    }
}

/// gixl: `nixl_capi_create_xfer_req` of descriptor arrays read in place (`local_count` descriptors of
/// `local_mem` at `local_descs`, `remote_count` of `remote_mem` at `remote_descs`; no list handles are made).
/// Unlike `nixl_capi_create_xfer_req`, a failure of the request keeps its own status (NOT_FOUND for an
/// unknown agent or uncovered descriptors, INVALID_PARAM for lists that do not pair up), as NIXL's C++
/// `createXferReq` reports it.
#[no_mangle]
pub extern "C" fn gixl_create_xfer_req_descs(
    agent: nixl_capi_agent_t,
    operation: XferOpRaw,
    local_mem: MemTypeRaw,
    local_descs: *const gixl_desc_t,
    local_count: size_t,
    remote_mem: MemTypeRaw,
    remote_descs: *const gixl_desc_t,
    remote_count: size_t,
    remote_agent: *const c_char,
    req_hndl: *mut nixl_capi_xfer_req_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        nonnull(req_hndl);
        let a = AGENTS.get(agent, "agent")?;
        let op = op_of(operation)?;
        let l = xfer_dlist::descs_arg(local_descs, local_count, "local_descs")?;
        let r = xfer_dlist::descs_arg(remote_descs, remote_count, "remote_descs")?;
        let remote = str_arg(remote_agent, "remote_agent")?;
        let opts = opt_args::xfer_opts(opt_args, &a)?;
        let (lm, rm) = (mem_for_agent(local_mem)?, mem_for_agent(remote_mem)?);
        let req = a.agent.create_xfer_req_descs(op, (lm, l), (rm, r), remote, &opts)?;
        new_req(&a, req, req_hndl)
    }
}

/// The backend's estimate. The three outputs are written even when the estimate fails (zeros then), as
/// NIXL does; not when the arguments or handles are bad.
#[no_mangle]
pub extern "C" fn nixl_capi_estimate_xfer_cost(
    agent: nixl_capi_agent_t,
    req_hndl: nixl_capi_xfer_req_t,
    opt_args: nixl_capi_opt_args_t,
    duration_us: *mut i64,
    err_margin_us: *mut i64,
    method: *mut CostRaw,
) -> CapiStatus {
    ffi! {
        nonnull(duration_us, err_margin_us, method);
        let a = AGENTS.get(agent, "agent")?;
        let req = live(&a, req_hndl)?;
        opt_args::hints(opt_args, &a)?;
        let res = a.agent.estimate_xfer_cost(&req);
        let (d, e) = res.as_ref().map_or((0, 0), |&(d, e)| (d, e));
        put(duration_us, d);
        put(err_margin_us, e);
        put(method, nixl_capi_cost_t::NIXL_CAPI_COST_ANALYTICAL_BACKEND as CostRaw);
        res?;
        OK
    }
}

/// Posts a request: SUCCESS if it completed inline, IN_PROG if it runs on. With NULL `opt_args` the
/// request keeps its notification; with options, `has_notif` sets it and its absence clears it.
/// NOT_FOUND if the peer it was made against has been invalidated (even if reloaded since).
#[no_mangle]
pub extern "C" fn nixl_capi_post_xfer_req(
    agent: nixl_capi_agent_t,
    req_hndl: nixl_capi_xfer_req_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let req = live(&a, req_hndl)?;
        let notif = opt_args::notif_update(opt_args)?;
        status_of(a.agent.post_xfer_req(&req, notif))
    }
}

/// SUCCESS, IN_PROG, or the error that ended the last post (never posted: ERROR_BACKEND).
#[no_mangle]
pub extern "C" fn nixl_capi_get_xfer_status(agent: nixl_capi_agent_t, req_hndl: nixl_capi_xfer_req_t) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let req = live(&a, req_hndl)?;
        status_of(a.agent.xfer_status(&req))
    }
}

/// A new backend handle (caller destroys it) for the backend the request runs on.
#[no_mangle]
pub extern "C" fn nixl_capi_query_xfer_backend(
    agent: nixl_capi_agent_t,
    req_hndl: nixl_capi_xfer_req_t,
    backend: *mut nixl_capi_backend_t,
) -> CapiStatus {
    ffi! {
        nonnull(backend);
        let a = AGENTS.get(agent, "agent")?;
        let req = live(&a, req_hndl)?;
        put(backend, backend::new_handle(&a, req.backend()));
        OK
    }
}

/// Releases a request (aborting an active transfer). If the transfer cannot be stopped, ERROR_BACKEND
/// (NIXL's REPOST_ACTIVE) and the request stays usable. The handle must still be destroyed.
#[no_mangle]
pub extern "C" fn nixl_capi_release_xfer_req(agent: nixl_capi_agent_t, req: nixl_capi_xfer_req_t) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let r = XFER_REQS.get(req, "req")?;
        if r.owner != a.owner() {
            return Err(Fail::invalid("transfer request belongs to another agent"));
        }
        let mut inner = r.req.lock();
        let x = inner.as_ref().ok_or_else(|| Fail::invalid("transfer request was already released"))?;
        a.agent.release_xfer_req(x)?;
        *inner = None;
        OK
    }
}

/// Frees a released request's handle; INVALID_STATE if it was not released first. (gixl: a request whose
/// agent has been destroyed, and so can no longer be released, may be destroyed directly.)
#[no_mangle]
pub extern "C" fn nixl_capi_destroy_xfer_req(req: nixl_capi_xfer_req_t) -> CapiStatus {
    ffi! {
        XFER_REQS.remove_if(req, "req", |r| {
            if r.req.lock().is_some() && AGENTS.any(|a| a.owner() == r.owner) {
                return Err(Fail::with_code(
                    nixl_capi_status_t::NIXL_CAPI_ERROR_INVALID_STATE,
                    Status::NotAllowed,
                    "transfer request must be released (nixl_capi_release_xfer_req) before it is destroyed",
                ));
            }
            Ok(())
        })?;
        OK
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::agent::tests::{exchange, reg, ucx_agent};
    use super::super::agent::{nixl_capi_destroy_agent, nixl_capi_invalidate_remote_md};
    use super::super::backend::nixl_capi_destroy_backend;
    use super::super::dlist_handle::{nixl_capi_prep_xfer_dlist, nixl_capi_release_xfer_dlist_handle};
    use super::super::nixl_capi_status_t::*;
    use super::super::xfer_dlist::{
        nixl_capi_create_xfer_dlist, nixl_capi_destroy_xfer_dlist, nixl_capi_xfer_dlist_add_desc,
    };
    use super::*;

    pub fn xlist(buf: &[u8]) -> nixl_capi_xfer_dlist_t {
        let mut d = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_xfer_dlist(0, &mut d), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_xfer_dlist_add_desc(d, buf.as_ptr() as usize, buf.len(), 0), NIXL_CAPI_SUCCESS);
        d
    }

    pub fn wait(a: nixl_capi_agent_t, r: nixl_capi_xfer_req_t, mut s: nixl_capi_status_t) -> CapiStatus {
        while s == NIXL_CAPI_IN_PROG {
            std::thread::yield_now();
            s = nixl_capi_get_xfer_status(a, r);
        }
        s
    }

    /// The bulk calls: arrays appended in one call (NULL only with a count of 0, misaligned refused, nothing
    /// appended on failure), prep and create read in place (an unknown memory type is NOT_FOUND, lists that do
    /// not pair up INVALID_PARAM, an unknown peer NOT_FOUND), and a READ made that way moves the bytes.
    #[test]
    fn bulk_descriptor_calls() {
        use super::super::dlist_handle::gixl_prep_xfer_dlist_descs;
        use super::super::reg_dlist::{
            gixl_reg_desc_t, gixl_reg_dlist_add_descs, nixl_capi_create_reg_dlist, nixl_capi_destroy_reg_dlist,
            nixl_capi_reg_dlist_desc_count,
        };
        use super::super::xfer_dlist::{gixl_xfer_dlist_add_descs, nixl_capi_xfer_dlist_desc_count};
        let (a, ba) = ucx_agent(c"capi-bulk-A");
        let (b, bb) = ucx_agent(c"capi-bulk-B");
        let src: Vec<u8> = (0..16384u32).map(|i| (i % 253) as u8).collect();
        let dst = vec![0u8; 16384];
        let blocks = |buf: &[u8]| -> Vec<gixl_desc_t> {
            (0..16).map(|i| gixl_desc_t { addr: buf.as_ptr() as usize + i * 1024, len: 1024, dev_id: 0 }).collect()
        };
        let (sd, dd) = (blocks(&src), blocks(&dst));
        // Appending: all or nothing.
        let mut x = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_xfer_dlist(0, &mut x), NIXL_CAPI_SUCCESS);
        assert_eq!(gixl_xfer_dlist_add_descs(x, std::ptr::null(), 0), NIXL_CAPI_SUCCESS);
        assert_eq!(gixl_xfer_dlist_add_descs(x, std::ptr::null(), 3), NIXL_CAPI_ERROR_INVALID_PARAM);
        let misaligned = (sd.as_ptr() as usize + 4) as *const gixl_desc_t;
        assert_eq!(gixl_xfer_dlist_add_descs(x, misaligned, 1), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(gixl_xfer_dlist_add_descs(x, sd.as_ptr(), sd.len()), NIXL_CAPI_SUCCESS);
        let mut n = 0;
        assert_eq!(nixl_capi_xfer_dlist_desc_count(x, &mut n), NIXL_CAPI_SUCCESS);
        assert_eq!(n, 16);
        assert_eq!(nixl_capi_destroy_xfer_dlist(x), NIXL_CAPI_SUCCESS);
        let mut r = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_reg_dlist(0, &mut r), NIXL_CAPI_SUCCESS);
        let meta = *b"path";
        let regs = [
            gixl_reg_desc_t {
                addr: src.as_ptr() as usize,
                len: src.len(),
                dev_id: 0,
                metadata: std::ptr::null(),
                metadata_len: 9,
            },
            gixl_reg_desc_t { addr: 1, len: 1, dev_id: 0, metadata: meta.as_ptr().cast(), metadata_len: 4 },
        ];
        assert_eq!(gixl_reg_dlist_add_descs(r, regs.as_ptr(), 2), NIXL_CAPI_SUCCESS);
        assert_eq!(gixl_reg_dlist_add_descs(r, std::ptr::null(), 1), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_reg_dlist_desc_count(r, &mut n), NIXL_CAPI_SUCCESS);
        assert_eq!(n, 2, "the failed call appended nothing");
        assert_eq!(nixl_capi_destroy_reg_dlist(r), NIXL_CAPI_SUCCESS);
        // Prep and create in place.
        assert_eq!(reg(a, &src), NIXL_CAPI_SUCCESS);
        assert_eq!(reg(b, &dst), NIXL_CAPI_SUCCESS);
        assert_eq!(exchange(a, b), "capi-bulk-A");
        let none = std::ptr::null_mut();
        let mut h = std::ptr::null_mut();
        assert_eq!(gixl_prep_xfer_dlist_descs(b, c"".as_ptr(), 0, dd.as_ptr(), 16, &mut h, none), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_release_xfer_dlist_handle(b, h), NIXL_CAPI_SUCCESS);
        let mut h2 = std::ptr::null_mut();
        assert_eq!(
            gixl_prep_xfer_dlist_descs(b, c"capi-bulk-A".as_ptr(), 99, sd.as_ptr(), 16, &mut h2, none),
            NIXL_CAPI_ERROR_NOT_FOUND,
            "unknown memory type"
        );
        assert!(h2.is_null());
        let mut q = std::ptr::null_mut();
        let create = |l: &[gixl_desc_t], r: &[gixl_desc_t], peer: &std::ffi::CStr, q: &mut nixl_capi_xfer_req_t| {
            gixl_create_xfer_req_descs(b, 0, 0, l.as_ptr(), l.len(), 0, r.as_ptr(), r.len(), peer.as_ptr(), q, none)
        };
        assert_eq!(create(&dd, &sd[..15], c"capi-bulk-A", &mut q), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(create(&dd, &sd, c"capi-bulk-nobody", &mut q), NIXL_CAPI_ERROR_NOT_FOUND);
        assert!(q.is_null());
        assert_eq!(create(&dd, &sd, c"capi-bulk-A", &mut q), NIXL_CAPI_SUCCESS);
        let s = nixl_capi_post_xfer_req(b, q, none);
        assert_eq!(wait(b, q, s), NIXL_CAPI_SUCCESS);
        assert!(dst == src, "READ in 16 blocks");
        assert_eq!(nixl_capi_release_xfer_req(b, q), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_xfer_req(q), NIXL_CAPI_SUCCESS);
        nixl_capi_destroy_backend(ba);
        nixl_capi_destroy_backend(bb);
        assert_eq!(nixl_capi_destroy_agent(b), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_agent(a), NIXL_CAPI_SUCCESS);
    }

    #[test]
    fn write_lifecycle_stale_and_foreign() {
        let (a, ba) = ucx_agent(c"capi-x-A");
        let (b, bb) = ucx_agent(c"capi-x-B");
        let (c, bc) = ucx_agent(c"capi-x-C");
        let src: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        let dst = vec![0u8; 4096];
        assert_eq!(reg(a, &src), NIXL_CAPI_SUCCESS);
        assert_eq!(reg(b, &dst), NIXL_CAPI_SUCCESS);
        assert_eq!(exchange(b, a), "capi-x-B");
        let (l, r) = (xlist(&src), xlist(&dst));

        let mut q = std::ptr::null_mut();
        assert_eq!(
            nixl_capi_create_xfer_req(a, 1, l, r, c"capi-x-nobody".as_ptr(), &mut q, std::ptr::null_mut()),
            NIXL_CAPI_ERROR_BACKEND
        );
        assert_eq!(
            nixl_capi_create_xfer_req(a, 9, l, r, c"capi-x-B".as_ptr(), &mut q, std::ptr::null_mut()),
            NIXL_CAPI_ERROR_INVALID_PARAM
        );
        assert!(q.is_null());
        assert_eq!(
            nixl_capi_create_xfer_req(a, 1, l, r, c"capi-x-B".as_ptr(), &mut q, std::ptr::null_mut()),
            NIXL_CAPI_SUCCESS
        );
        assert_eq!(nixl_capi_get_xfer_status(a, q), NIXL_CAPI_ERROR_BACKEND, "never posted");
        // Another agent cannot touch it.
        assert_eq!(nixl_capi_post_xfer_req(c, q, std::ptr::null_mut()), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_release_xfer_req(c, q), NIXL_CAPI_ERROR_INVALID_PARAM);
        let s = nixl_capi_post_xfer_req(a, q, std::ptr::null_mut());
        assert_eq!(wait(a, q, s), NIXL_CAPI_SUCCESS);
        assert!(src == dst);
        let (mut d, mut e, mut m) = (-1i64, -1i64, 7);
        assert_eq!(nixl_capi_estimate_xfer_cost(a, q, std::ptr::null_mut(), &mut d, &mut e, &mut m), NIXL_CAPI_SUCCESS);
        assert_eq!(m, 0);
        let mut qb = std::ptr::null_mut();
        assert_eq!(nixl_capi_query_xfer_backend(a, q, &mut qb), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_backend(qb), NIXL_CAPI_SUCCESS);

        // Prepped handles: foreign agent refused, stale after invalidation.
        let (mut hl, mut hr) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(nixl_capi_prep_xfer_dlist(a, c"".as_ptr(), l, &mut hl, std::ptr::null_mut()), NIXL_CAPI_SUCCESS);
        assert_eq!(
            nixl_capi_prep_xfer_dlist(a, c"capi-x-B".as_ptr(), r, &mut hr, std::ptr::null_mut()),
            NIXL_CAPI_SUCCESS
        );
        assert_eq!(
            nixl_capi_prep_xfer_dlist(a, c"".as_ptr(), l, std::ptr::null_mut(), std::ptr::null_mut()),
            NIXL_CAPI_ERROR_INVALID_PARAM
        );
        let i0 = [0 as c_int];
        let mut q2 = std::ptr::null_mut();
        assert_eq!(
            nixl_capi_make_xfer_req(c, 1, hl, i0.as_ptr(), 1, hr, i0.as_ptr(), 1, &mut q2, std::ptr::null_mut()),
            NIXL_CAPI_ERROR_INVALID_PARAM
        );
        assert_eq!(nixl_capi_release_xfer_dlist_handle(c, hl), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_invalidate_remote_md(a, c"capi-x-B".as_ptr()), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_post_xfer_req(a, q, std::ptr::null_mut()), NIXL_CAPI_ERROR_NOT_FOUND);
        assert_eq!(
            nixl_capi_estimate_xfer_cost(a, q, std::ptr::null_mut(), &mut d, &mut e, &mut m),
            NIXL_CAPI_ERROR_NOT_FOUND
        );
        assert_eq!((d, e), (0, 0));
        assert_eq!(
            nixl_capi_make_xfer_req(a, 1, hl, i0.as_ptr(), 1, hr, i0.as_ptr(), 1, &mut q2, std::ptr::null_mut()),
            NIXL_CAPI_ERROR_NOT_FOUND
        );
        assert_eq!(nixl_capi_release_xfer_dlist_handle(a, hl), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_release_xfer_dlist_handle(a, hl), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_release_xfer_dlist_handle(a, hr), NIXL_CAPI_SUCCESS);

        // Release, then destroy.
        assert_eq!(nixl_capi_destroy_xfer_req(q), NIXL_CAPI_ERROR_INVALID_STATE);
        assert_eq!(nixl_capi_release_xfer_req(a, q), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_release_xfer_req(a, q), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_get_xfer_status(a, q), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_destroy_xfer_req(q), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_xfer_req(q), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_post_xfer_req(a, q, std::ptr::null_mut()), NIXL_CAPI_ERROR_INVALID_PARAM);

        // A request whose agent is gone can be destroyed without a release.
        let mut q3 = std::ptr::null_mut();
        assert_eq!(exchange(b, c), "capi-x-B");
        assert_eq!(
            nixl_capi_create_xfer_req(c, 1, l, r, c"capi-x-B".as_ptr(), &mut q3, std::ptr::null_mut()),
            NIXL_CAPI_ERROR_BACKEND,
            "C has not registered src"
        );
        assert_eq!(reg(c, &src), NIXL_CAPI_SUCCESS);
        assert_eq!(
            nixl_capi_create_xfer_req(c, 1, l, r, c"capi-x-B".as_ptr(), &mut q3, std::ptr::null_mut()),
            NIXL_CAPI_SUCCESS
        );
        assert_eq!(nixl_capi_destroy_xfer_req(q3), NIXL_CAPI_ERROR_INVALID_STATE);
        assert_eq!(nixl_capi_destroy_backend(bc), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_agent(c), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_xfer_req(q3), NIXL_CAPI_SUCCESS);

        for d in [l, r] {
            assert_eq!(nixl_capi_destroy_xfer_dlist(d), NIXL_CAPI_SUCCESS);
        }
        for h in [ba, bb] {
            assert_eq!(nixl_capi_destroy_backend(h), NIXL_CAPI_SUCCESS);
        }
        for x in [a, b] {
            assert_eq!(nixl_capi_destroy_agent(x), NIXL_CAPI_SUCCESS);
        }
    }
}
