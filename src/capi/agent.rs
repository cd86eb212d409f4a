//! `nixl_capi_agent_t`: agent lifecycle, metadata, plugins, registration, connections, notifications and
//! memory queries. Transfers are in `xfer_req` and `dlist_handle`; backends in `backend`.

use libc::size_t;
use std::ffi::{c_char, c_void};

use super::boundary::{bytes_arg, ffi, malloc_copy, put, str_arg, Fail, OK};
use super::cpp_support;
use super::mem_list::{nixl_capi_mem_list_t, MemListObj, MEM_LISTS};
use super::notif_map::{nixl_capi_notif_map_t, NOTIF_MAPS};
use super::opt_args::{self, nixl_capi_opt_args_t};
use super::params::{nixl_capi_params_t, ParamsObj, PARAMS};
use super::query_resp::{nixl_capi_query_resp_list_t, QUERY_RESPS};
use super::reg_dlist::{self, nixl_capi_reg_dlist_t, REG_DLISTS};
use super::registry::Registry;
use super::string_list::{nixl_capi_string_list_t, StringListObj, STRING_LISTS};
use super::xfer_dlist::{nixl_capi_xfer_dlist_t, XFER_DLISTS};
use super::{mem_for_agent, mem_from_raw, nixl_capi_agent_config_t, nixl_capi_status_t, CapiStatus};
use crate::agent::{Agent, AgentConfig, SyncMode};
use crate::mem::{MemType, XferDList};

/// Opaque agent (`struct nixl_capi_agent_s`).
pub struct nixl_capi_agent_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_agent_t = *mut nixl_capi_agent_s;

pub(crate) struct AgentObj {
    pub agent: Agent,
}

impl AgentObj {
    /// The id handles made by this agent record as their owner.
    pub fn owner(&self) -> u128 {
        self.agent.incarnation()
    }
}

pub(crate) static AGENTS: Registry<AgentObj> = Registry::new("agent");

/// Creates an agent with NIXL's default configuration, except that the progress thread is on (as
/// NIXL's C API does). No backends are created. An empty name is ERROR_BACKEND (NIXL throws).
#[no_mangle]
pub extern "C" fn nixl_capi_create_agent(name: *const c_char, agent: *mut nixl_capi_agent_t) -> CapiStatus {
    ffi! {
        nonnull(agent);
        let name = str_arg(name, "name")?;
        let cfg = AgentConfig { prog_thread: true, ..AgentConfig::default() };
        new_agent(name, cfg, agent)
    }
}

/// Creates an agent from `cfg`. `num_workers` is ignored, as by NIXL's C API.
#[no_mangle]
pub extern "C" fn nixl_capi_create_configured_agent(
    name: *const c_char,
    cfg: *const nixl_capi_agent_config_t,
    agent: *mut nixl_capi_agent_t,
) -> CapiStatus {
    ffi! {
        nonnull(cfg, agent);
        let name = str_arg(name, "name")?;
        // SAFETY: `cfg` is not NULL and points to a caller-owned config struct; read by value.
        let c = unsafe { cfg.read_unaligned() };
        new_agent(name, core_config(&c)?, agent)
    }
}

/// gixl only: `nixl_capi_create_configured_agent` with gixl's overlap check switched on: `check_overlap` is
/// `"off"`, `"warn"` or `"refuse"` (NULL is off; anything else is INVALID_PARAM). `GIXL_CHECK_OVERLAP`, when
/// set, overrides it. See docs/overlap-check.md.
#[no_mangle]
pub extern "C" fn gixl_create_configured_agent_checked(
    name: *const c_char,
    cfg: *const nixl_capi_agent_config_t,
    check_overlap: *const c_char,
    agent: *mut nixl_capi_agent_t,
) -> CapiStatus {
    ffi! {
        nonnull(cfg, agent);
        let name = str_arg(name, "name")?;
        let mode = if check_overlap.is_null() {
            crate::overlap::Mode::Off
        } else {
            let m = str_arg(check_overlap, "check_overlap")?;
            crate::overlap::Mode::parse(m)
                .ok_or_else(|| Fail::invalid(format!("check_overlap {m:?} is not one of off, warn, refuse")))?
        };
        // SAFETY: `cfg` is not NULL and points to a caller-owned config struct; read by value.
        let c = unsafe { cfg.read_unaligned() };
        let cfg = AgentConfig { check_overlap: mode, ..core_config(&c)? };
        new_agent(name, cfg, agent)
    }
}

/// The core's configuration for a C config struct (`num_workers` is ignored, as by NIXL's C API).
fn core_config(c: &nixl_capi_agent_config_t) -> Result<AgentConfig, Fail> {
    let listen_port = u16::try_from(c.listen_port)
        .map_err(|_| Fail::invalid(format!("listen_port {} is not a TCP port", c.listen_port)))?;
    let sync_mode = u32::try_from(c.thread_sync)
        .ok()
        .and_then(|v| SyncMode::from_u32(v).ok())
        .ok_or_else(|| Fail::invalid(format!("unknown thread_sync {}", c.thread_sync)))?;
    Ok(AgentConfig {
        prog_thread: c.enable_prog_thread,
        listen_thread: c.enable_listen_thread,
        listen_port,
        sync_mode,
        pthr_delay_us: c.pthr_delay_us,
        lthr_delay_us: c.lthr_delay_us,
        capture_telemetry: c.capture_telemetry,
        ..AgentConfig::default()
    })
}

fn new_agent(name: &str, cfg: AgentConfig, out: *mut nixl_capi_agent_t) -> Result<nixl_capi_status_t, Fail> {
    // NIXL's constructor reports every problem by throwing, which its C API turns into ERROR_BACKEND.
    let a = Agent::new(name, cfg).map_err(|e| Fail::from(e).any_as_backend())?;
    put(out, AGENTS.insert(AgentObj { agent: a }));
    OK
}

/// Destroys an agent. Handles it made stay valid handles but are refused by other agents; requests made
/// against its peers are refused from now on.
#[no_mangle]
pub extern "C" fn nixl_capi_destroy_agent(agent: nixl_capi_agent_t) -> CapiStatus {
    ffi! {
        AGENTS.remove(agent, "agent")?;
        OK
    }
}

/// Full metadata of this agent, in a `malloc`'d buffer the caller `free()`s.
#[no_mangle]
pub extern "C" fn nixl_capi_get_local_md(
    agent: nixl_capi_agent_t,
    data: *mut *mut c_void,
    len: *mut size_t,
) -> CapiStatus {
    ffi! {
        nonnull(data, len);
        let a = AGENTS.get(agent, "agent")?;
        let md = a.agent.local_md()?;
        put(data, malloc_copy(&md)?);
        put(len, md.len());
        OK
    }
}

/// Metadata for `descs` only, without connection info (the C API cannot ask for it, as in NIXL), except
/// for an empty `descs`: that blob is the connection info of every remote-capable backend, as in NIXL.
#[no_mangle]
pub extern "C" fn nixl_capi_get_local_partial_md(
    agent: nixl_capi_agent_t,
    descs: nixl_capi_reg_dlist_t,
    data: *mut *mut c_void,
    len: *mut size_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        nonnull(data, len);
        cpp_support::local_partial_md(agent, descs, false, data, len, opt_args)
    }
}

/// Loads a peer's metadata; on success `*agent_name` is a `malloc`'d copy of its name (caller `free()`s).
#[no_mangle]
pub extern "C" fn nixl_capi_load_remote_md(
    agent: nixl_capi_agent_t,
    data: *const c_void,
    len: size_t,
    agent_name: *mut *mut c_char,
) -> CapiStatus {
    ffi! {
        nonnull(data, agent_name);
        let a = AGENTS.get(agent, "agent")?;
        if len == 0 {
            return Err(Fail::invalid("metadata length is 0"));
        }
        let blob = bytes_arg(data, len, "data")?;
        let name = a.agent.load_remote_md(blob)?;
        put(agent_name, super::boundary::malloc_cstr(&name)?);
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_invalidate_remote_md(agent: nixl_capi_agent_t, remote_agent: *const c_char) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let name = str_arg(remote_agent, "remote_agent")?;
        a.agent.invalidate_remote_md(name)?;
        OK
    }
}

/// Asks the listener at the options' `ip_addr:port` to invalidate this agent, or (no `ip_addr`) deletes this
/// agent's keys from etcd (`NIXL_ETCD_ENDPOINTS`). Returns at once; the I/O runs in the background and its
/// failures are logged, as NIXL does. INVALID_PARAM without an address when no store is configured.
#[no_mangle]
pub extern "C" fn nixl_capi_invalidate_local_md(
    agent: nixl_capi_agent_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let (ip, port) = opt_args::md_peer(opt_args)?;
        a.agent.invalidate_local_md(&ip, port)?;
        OK
    }
}

/// SUCCESS if `remote_name` is loaded and (when `descs` is given and not empty) one backend covers every
/// descriptor; NOT_FOUND otherwise. `descs` may be NULL.
#[no_mangle]
pub extern "C" fn nixl_capi_check_remote_md(
    agent: nixl_capi_agent_t,
    remote_name: *const c_char,
    descs: nixl_capi_xfer_dlist_t,
) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let name = str_arg(remote_name, "remote_name")?;
        if descs.is_null() {
            a.agent.check_remote_md(name, &XferDList::new(MemType::Dram))?;
            return OK;
        }
        let d = XFER_DLISTS.get(descs, "descs")?;
        let d = d.read();
        if mem_from_raw(d.raw_mem).is_none() && !d.list.is_empty() {
            a.agent.check_remote_md(name, &XferDList::new(MemType::Dram))?;
            return Err(mem_for_agent(d.raw_mem).unwrap_err());
        }
        a.agent.check_remote_md(name, &d.list)?;
        OK
    }
}

/// Publishes this agent's full metadata to the listener at `ip_addr:port`, or to etcd. See
/// `nixl_capi_invalidate_local_md` for the routing and error rules.
#[no_mangle]
pub extern "C" fn nixl_capi_send_local_md(agent: nixl_capi_agent_t, opt_args: nixl_capi_opt_args_t) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let (ip, port) = opt_args::md_peer(opt_args)?;
        a.agent.send_local_md(&ip, port)?;
        OK
    }
}

/// Publishes metadata for `descs` (no connection info: the C options carry neither that flag nor a label,
/// as in NIXL). Through etcd, a label is required, so this is INVALID_PARAM there.
#[no_mangle]
pub extern "C" fn nixl_capi_send_local_partial_md(
    agent: nixl_capi_agent_t,
    descs: nixl_capi_reg_dlist_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! { cpp_support::send_local_partial_md(agent, descs, false, std::ptr::null(), opt_args) }
}

/// Asks the listener at `ip_addr:port` for its agent's metadata, or reads `remote_name`'s from etcd, and
/// loads it in the background; poll with `nixl_capi_check_remote_md`.
#[no_mangle]
pub extern "C" fn nixl_capi_fetch_remote_md(
    agent: nixl_capi_agent_t,
    remote_name: *const c_char,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! { cpp_support::fetch_remote_md(agent, remote_name, std::ptr::null(), opt_args) }
}

/// The backend plugins built into this library. ERROR_BACKEND for any failure, as NIXL.
#[no_mangle]
pub extern "C" fn nixl_capi_get_available_plugins(
    agent: nixl_capi_agent_t,
    plugins: *mut nixl_capi_string_list_t,
) -> CapiStatus {
    ffi! {
        nonnull(plugins);
        let a = AGENTS.get(agent, "agent")?;
        let list = StringListObj::new(a.agent.available_plugins());
        put(plugins, STRING_LISTS.insert(list));
        OK
    }
}

/// A plugin's memory types and default init options. ERROR_BACKEND for any failure (an unknown plugin
/// too), as NIXL.
#[no_mangle]
pub extern "C" fn nixl_capi_get_plugin_params(
    agent: nixl_capi_agent_t,
    plugin_name: *const c_char,
    mems: *mut nixl_capi_mem_list_t,
    params: *mut nixl_capi_params_t,
) -> CapiStatus {
    ffi! {
        nonnull(mems, params);
        let a = AGENTS.get(agent, "agent")?;
        let plugin = str_arg(plugin_name, "plugin_name")?;
        let (p, m) = a.agent.plugin_params(plugin).map_err(|e| Fail::from(e).any_as_backend())?;
        put(mems, MEM_LISTS.insert(MemListObj(m)));
        put(params, PARAMS.insert(ParamsObj::new(p)));
        OK
    }
}

/// Registers `dlist` with every backend that supports its memory type, or with the backends in
/// `opt_args` (may be NULL).
#[no_mangle]
pub extern "C" fn nixl_capi_register_mem(
    agent: nixl_capi_agent_t,
    dlist: nixl_capi_reg_dlist_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let d = REG_DLISTS.get(dlist, "dlist")?;
        let hints = opt_args::hints(opt_args, &a)?;
        a.agent.register_mem(reg_dlist::for_agent(&d.read())?, &hints)?;
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_deregister_mem(
    agent: nixl_capi_agent_t,
    dlist: nixl_capi_reg_dlist_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let d = REG_DLISTS.get(dlist, "dlist")?;
        let hints = opt_args::hints(opt_args, &a)?;
        a.agent.deregister_mem(reg_dlist::for_agent(&d.read())?, &hints)?;
        OK
    }
}

/// Opens the connection to a loaded peer now rather than on first use.
#[no_mangle]
pub extern "C" fn nixl_capi_agent_make_connection(
    agent: nixl_capi_agent_t,
    remote_agent: *const c_char,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let name = str_arg(remote_agent, "remote_agent")?;
        let hints = opt_args::hints(opt_args, &a)?;
        a.agent.make_connection(name, &hints)?;
        OK
    }
}

/// Appends the notifications that arrived since the last call to `notif_map`.
#[no_mangle]
pub extern "C" fn nixl_capi_get_notifs(
    agent: nixl_capi_agent_t,
    notif_map: nixl_capi_notif_map_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let m = NOTIF_MAPS.get(notif_map, "notif_map")?;
        let hints = opt_args::hints(opt_args, &a)?;
        let got = a.agent.notifs(&hints)?;
        m.append(got);
        OK
    }
}

/// Sends a notification on its own (`data` may be NULL when `len` is 0; gixl refuses NULL with `len > 0`,
/// which NIXL reads through).
#[no_mangle]
pub extern "C" fn nixl_capi_gen_notif(
    agent: nixl_capi_agent_t,
    remote_agent: *const c_char,
    data: *const c_void,
    len: size_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let name = str_arg(remote_agent, "remote_agent")?;
        let msg = bytes_arg(data, len, "data")?;
        let hints = opt_args::hints(opt_args, &a)?;
        a.agent.gen_notif(name, msg, &hints)?;
        OK
    }
}

/// Asks one backend (`opt_args` must carry exactly one) about each descriptor of `descs`; `resp` is
/// replaced with one entry per descriptor.
#[no_mangle]
pub extern "C" fn nixl_capi_query_mem(
    agent: nixl_capi_agent_t,
    descs: nixl_capi_reg_dlist_t,
    resp: nixl_capi_query_resp_list_t,
    opt_args: nixl_capi_opt_args_t,
) -> CapiStatus {
    ffi! {
        let a = AGENTS.get(agent, "agent")?;
        let d = REG_DLISTS.get(descs, "descs")?;
        let r = QUERY_RESPS.get(resp, "resp")?;
        if opt_args.is_null() {
            return Err(Fail::invalid("query_mem needs opt_args with exactly one backend"));
        }
        let hints = opt_args::hints(opt_args, &a)?;
        let [backend] = hints[..] else {
            return Err(Fail::invalid(format!("query_mem needs exactly one backend in opt_args, got {}", hints.len())));
        };
        let answers = a.agent.query_mem(reg_dlist::for_agent(&d.read())?, backend)?;
        *r.0.write() = answers;
        OK
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::ffi::CStr;

    use super::super::nixl_capi_status_t::*;
    use super::super::*;
    use super::*;
    use crate::status::Status;

    /// gixl's C switch for the overlap check: a mode the agent then has, NULL for off, a bad word refused.
    #[test]
    fn overlap_check_through_the_c_api() {
        let cfg = nixl_capi_agent_config_t {
            enable_prog_thread: true,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: 0,
            num_workers: 1,
            pthr_delay_us: 0,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        if std::env::var_os("GIXL_CHECK_OVERLAP").is_some() {
            return;
        }
        for (mode, want) in [(Some(c"refuse"), crate::overlap::Mode::Refuse), (None, crate::overlap::Mode::Off)] {
            let mut a = std::ptr::null_mut();
            let m = mode.map_or(std::ptr::null(), |m| m.as_ptr());
            assert_eq!(gixl_create_configured_agent_checked(c"c-ov".as_ptr(), &cfg, m, &mut a), NIXL_CAPI_SUCCESS);
            assert_eq!(AGENTS.get(a, "agent").unwrap().agent.config().check_overlap, want);
            assert_eq!(nixl_capi_destroy_agent(a), NIXL_CAPI_SUCCESS);
        }
        let mut a = std::ptr::null_mut();
        let st = gixl_create_configured_agent_checked(c"c-ov".as_ptr(), &cfg, c"often".as_ptr(), &mut a);
        assert_eq!(st, NIXL_CAPI_ERROR_INVALID_PARAM);
        assert!(a.is_null());
    }

    pub fn agent(name: &CStr) -> nixl_capi_agent_t {
        let mut a = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_agent(name.as_ptr(), &mut a), NIXL_CAPI_SUCCESS);
        a
    }

    /// An agent with a UCX backend.
    pub fn ucx_agent(name: &CStr) -> (nixl_capi_agent_t, backend::nixl_capi_backend_t) {
        let a = agent(name);
        let (mut m, mut p) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(nixl_capi_get_plugin_params(a, c"UCX".as_ptr(), &mut m, &mut p), NIXL_CAPI_SUCCESS);
        let mut b = std::ptr::null_mut();
        assert_eq!(backend::nixl_capi_create_backend(a, c"UCX".as_ptr(), p, &mut b), NIXL_CAPI_SUCCESS);
        assert_eq!(mem_list::nixl_capi_destroy_mem_list(m), NIXL_CAPI_SUCCESS);
        assert_eq!(params::nixl_capi_destroy_params(p), NIXL_CAPI_SUCCESS);
        (a, b)
    }

    pub fn reg(a: nixl_capi_agent_t, buf: &[u8]) -> CapiStatus {
        let mut d = std::ptr::null_mut();
        assert_eq!(reg_dlist::nixl_capi_create_reg_dlist(0, &mut d), NIXL_CAPI_SUCCESS);
        assert_eq!(
            reg_dlist::nixl_capi_reg_dlist_add_desc(d, buf.as_ptr() as usize, buf.len(), 0, std::ptr::null(), 0),
            NIXL_CAPI_SUCCESS
        );
        let s = nixl_capi_register_mem(a, d, std::ptr::null_mut());
        assert_eq!(reg_dlist::nixl_capi_destroy_reg_dlist(d), NIXL_CAPI_SUCCESS);
        s
    }

    /// Load `from`'s metadata into `into`; returns the name it reported.
    pub fn exchange(from: nixl_capi_agent_t, into: nixl_capi_agent_t) -> String {
        let (mut md, mut len) = (std::ptr::null_mut(), 0usize);
        assert_eq!(nixl_capi_get_local_md(from, &mut md, &mut len), NIXL_CAPI_SUCCESS);
        let mut name = std::ptr::null_mut();
        assert_eq!(nixl_capi_load_remote_md(into, md, len, &mut name), NIXL_CAPI_SUCCESS);
        // SAFETY: `name` was malloc'd by the library as a C string; `md` by malloc too.
        let s = unsafe { CStr::from_ptr(name) }.to_str().unwrap().to_owned();
        // SAFETY: both were allocated with malloc for the caller to free.
        unsafe {
            libc::free(name.cast());
            libc::free(md);
        }
        s
    }

    #[test]
    fn lifecycle_nulls_and_double_destroy() {
        let mut a = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_agent(std::ptr::null(), &mut a), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_create_agent(c"x".as_ptr(), std::ptr::null_mut()), NIXL_CAPI_ERROR_INVALID_PARAM);
        // An empty name throws in NIXL: ERROR_BACKEND.
        assert_eq!(nixl_capi_create_agent(c"".as_ptr(), &mut a), NIXL_CAPI_ERROR_BACKEND);
        assert!(a.is_null(), "failed create leaves the output alone");
        let a = agent(c"capi-life");
        assert_eq!(nixl_capi_destroy_agent(a), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_agent(a), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_destroy_agent(std::ptr::null_mut()), NIXL_CAPI_ERROR_INVALID_PARAM);
        let (mut md, mut len) = (std::ptr::null_mut(), 0);
        assert_eq!(nixl_capi_get_local_md(a, &mut md, &mut len), NIXL_CAPI_ERROR_INVALID_PARAM);
        // A handle of another type is refused, not misread.
        let mut p = std::ptr::null_mut();
        assert_eq!(params::nixl_capi_create_params(&mut p), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_agent(p.cast()), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(params::nixl_capi_destroy_params(p), NIXL_CAPI_SUCCESS);
        // Garbage is refused without being read.
        assert_eq!(nixl_capi_destroy_agent(0x1234 as nixl_capi_agent_t), NIXL_CAPI_ERROR_INVALID_PARAM);
    }

    #[test]
    fn configured_agent_checks_its_config() {
        let mut cfg = nixl_capi_agent_config_t {
            enable_prog_thread: false,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: 2,
            num_workers: 4,
            pthr_delay_us: 0,
            lthr_delay_us: 100_000,
            capture_telemetry: true,
        };
        let mut a = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_configured_agent(c"capi-cfg".as_ptr(), &cfg, &mut a), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_agent(a), NIXL_CAPI_SUCCESS);
        cfg.thread_sync = 7;
        assert_eq!(
            nixl_capi_create_configured_agent(c"capi-cfg".as_ptr(), &cfg, &mut a),
            NIXL_CAPI_ERROR_INVALID_PARAM
        );
        cfg.thread_sync = 0;
        cfg.listen_port = 70000;
        assert_eq!(
            nixl_capi_create_configured_agent(c"capi-cfg".as_ptr(), &cfg, &mut a),
            NIXL_CAPI_ERROR_INVALID_PARAM
        );
        cfg.listen_port = 0;
        assert_eq!(nixl_capi_create_configured_agent(c"".as_ptr(), &cfg, &mut a), NIXL_CAPI_ERROR_BACKEND);
        assert_eq!(
            nixl_capi_create_configured_agent(c"x".as_ptr(), std::ptr::null(), &mut a),
            NIXL_CAPI_ERROR_INVALID_PARAM
        );
    }

    #[test]
    fn metadata_load_check_invalidate() {
        let (a, ba) = ucx_agent(c"capi-md-A");
        let (b, bb) = ucx_agent(c"capi-md-B");
        let buf = vec![0u8; 4096];
        assert_eq!(reg(a, &buf), NIXL_CAPI_SUCCESS);
        assert_eq!(
            nixl_capi_check_remote_md(b, c"capi-md-A".as_ptr(), std::ptr::null_mut()),
            NIXL_CAPI_ERROR_NOT_FOUND
        );
        let mut name = std::ptr::null_mut();
        assert_eq!(nixl_capi_load_remote_md(b, buf.as_ptr().cast(), 0, &mut name), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_load_remote_md(b, b"garbage".as_ptr().cast(), 7, &mut name), NIXL_CAPI_ERROR_BACKEND);
        assert!(name.is_null());
        assert_eq!(exchange(a, b), "capi-md-A");
        assert_eq!(nixl_capi_check_remote_md(b, c"capi-md-A".as_ptr(), std::ptr::null_mut()), NIXL_CAPI_SUCCESS);

        let mut inc = [0u8; 16];
        assert_eq!(gixl_remote_incarnation(b, c"capi-md-A".as_ptr(), inc.as_mut_ptr()), NIXL_CAPI_SUCCESS);
        let mut own = [0u8; 16];
        assert_eq!(gixl_agent_incarnation(a, own.as_mut_ptr()), NIXL_CAPI_SUCCESS);
        assert_eq!(inc, own);

        assert_eq!(nixl_capi_invalidate_remote_md(b, c"capi-md-B".as_ptr()), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_invalidate_remote_md(b, c"capi-md-A".as_ptr()), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_invalidate_remote_md(b, c"capi-md-A".as_ptr()), NIXL_CAPI_ERROR_NOT_FOUND);
        assert_eq!(gixl_remote_incarnation(b, c"capi-md-A".as_ptr(), inc.as_mut_ptr()), NIXL_CAPI_ERROR_NOT_FOUND);

        // Metadata exchange without an address needs a store (none configured here): INVALID_PARAM, as
        // NIXL. With an address the call succeeds at once; a peer that is not there is only logged.
        if crate::config::get("NIXL_ETCD_ENDPOINTS", crate::config::Kind::Str).ok().flatten().is_none() {
            assert_eq!(nixl_capi_send_local_md(a, std::ptr::null_mut()), NIXL_CAPI_ERROR_INVALID_PARAM);
            assert_eq!(gixl_last_nixl_status(), Status::InvalidParam as i32);
        }
        let mut o = std::ptr::null_mut();
        assert_eq!(opt_args::nixl_capi_create_opt_args(&mut o), NIXL_CAPI_SUCCESS);
        assert_eq!(opt_args::nixl_capi_opt_args_set_ip_addr(o, c"127.0.0.1".as_ptr()), NIXL_CAPI_SUCCESS);
        assert_eq!(opt_args::nixl_capi_opt_args_set_port(o, 1), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_fetch_remote_md(a, c"capi-md-B".as_ptr(), o), NIXL_CAPI_SUCCESS);
        assert_eq!(opt_args::nixl_capi_destroy_opt_args(o), NIXL_CAPI_SUCCESS);

        for h in [ba, bb] {
            assert_eq!(backend::nixl_capi_destroy_backend(h), NIXL_CAPI_SUCCESS);
        }
        assert_eq!(nixl_capi_destroy_agent(a), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_agent(b), NIXL_CAPI_SUCCESS);
    }

    #[test]
    fn metadata_exchange_through_a_listener() {
        let cfg = nixl_capi_agent_config_t {
            enable_prog_thread: true,
            enable_listen_thread: true,
            listen_port: 0,
            thread_sync: 0,
            num_workers: 0,
            pthr_delay_us: 0,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        let mut t = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_configured_agent(c"capi-listen-T".as_ptr(), &cfg, &mut t), NIXL_CAPI_SUCCESS);
        let (mut m, mut p, mut tb) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(nixl_capi_get_plugin_params(t, c"UCX".as_ptr(), &mut m, &mut p), NIXL_CAPI_SUCCESS);
        assert_eq!(backend::nixl_capi_create_backend(t, c"UCX".as_ptr(), p, &mut tb), NIXL_CAPI_SUCCESS);
        let buf = vec![0u8; 4096];
        assert_eq!(reg(t, &buf), NIXL_CAPI_SUCCESS);
        let port = AGENTS.get(t, "agent").unwrap().agent.listen_port().unwrap();
        let (i, ib) = ucx_agent(c"capi-listen-I");
        let mut o = std::ptr::null_mut();
        assert_eq!(opt_args::nixl_capi_create_opt_args(&mut o), NIXL_CAPI_SUCCESS);
        assert_eq!(opt_args::nixl_capi_opt_args_set_ip_addr(o, c"127.0.0.1".as_ptr()), NIXL_CAPI_SUCCESS);
        assert_eq!(opt_args::nixl_capi_opt_args_set_port(o, port), NIXL_CAPI_SUCCESS);
        // The initiator has no listener; the answer to its fetch comes back on the same connection.
        assert_eq!(nixl_capi_fetch_remote_md(i, c"capi-listen-T".as_ptr(), o), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_send_local_md(i, o), NIXL_CAPI_SUCCESS);
        let t0 = std::time::Instant::now();
        while nixl_capi_check_remote_md(i, c"capi-listen-T".as_ptr(), std::ptr::null_mut()) != NIXL_CAPI_SUCCESS
            || nixl_capi_check_remote_md(t, c"capi-listen-I".as_ptr(), std::ptr::null_mut()) != NIXL_CAPI_SUCCESS
        {
            assert!(t0.elapsed() < std::time::Duration::from_secs(10), "metadata did not arrive");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert_eq!(nixl_capi_invalidate_local_md(i, o), NIXL_CAPI_SUCCESS);
        while nixl_capi_check_remote_md(t, c"capi-listen-I".as_ptr(), std::ptr::null_mut()) == NIXL_CAPI_SUCCESS {
            assert!(t0.elapsed() < std::time::Duration::from_secs(10), "invalidation did not arrive");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert_eq!(opt_args::nixl_capi_destroy_opt_args(o), NIXL_CAPI_SUCCESS);
        assert_eq!(mem_list::nixl_capi_destroy_mem_list(m), NIXL_CAPI_SUCCESS);
        assert_eq!(params::nixl_capi_destroy_params(p), NIXL_CAPI_SUCCESS);
        for (a, b) in [(t, tb), (i, ib)] {
            assert_eq!(backend::nixl_capi_destroy_backend(b), NIXL_CAPI_SUCCESS);
            assert_eq!(nixl_capi_destroy_agent(a), NIXL_CAPI_SUCCESS);
        }
    }

    #[test]
    fn backend_of_another_agent_is_refused_as_a_hint() {
        let (a, ba) = ucx_agent(c"capi-hint-A");
        let (b, bb) = ucx_agent(c"capi-hint-B");
        let mut o = std::ptr::null_mut();
        assert_eq!(opt_args::nixl_capi_create_opt_args(&mut o), NIXL_CAPI_SUCCESS);
        assert_eq!(opt_args::nixl_capi_opt_args_add_backend(o, bb), NIXL_CAPI_SUCCESS);
        let buf = [0u8; 64];
        let mut d = std::ptr::null_mut();
        assert_eq!(reg_dlist::nixl_capi_create_reg_dlist(0, &mut d), NIXL_CAPI_SUCCESS);
        assert_eq!(
            reg_dlist::nixl_capi_reg_dlist_add_desc(d, buf.as_ptr() as usize, 64, 0, std::ptr::null(), 0),
            NIXL_CAPI_SUCCESS
        );
        assert_eq!(nixl_capi_register_mem(a, d, o), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_register_mem(b, d, o), NIXL_CAPI_SUCCESS);
        // query_mem wants exactly one backend.
        let mut r = std::ptr::null_mut();
        assert_eq!(query_resp::nixl_capi_create_query_resp_list(&mut r), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_query_mem(b, d, r, std::ptr::null_mut()), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_query_mem(b, d, r, o), NIXL_CAPI_ERROR_BACKEND);
        assert_eq!(opt_args::nixl_capi_opt_args_add_backend(o, bb), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_query_mem(b, d, r, o), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(query_resp::nixl_capi_destroy_query_resp_list(r), NIXL_CAPI_SUCCESS);
        assert_eq!(reg_dlist::nixl_capi_destroy_reg_dlist(d), NIXL_CAPI_SUCCESS);
        assert_eq!(opt_args::nixl_capi_destroy_opt_args(o), NIXL_CAPI_SUCCESS);
        for h in [ba, bb] {
            assert_eq!(backend::nixl_capi_destroy_backend(h), NIXL_CAPI_SUCCESS);
        }
        assert_eq!(nixl_capi_destroy_agent(a), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_agent(b), NIXL_CAPI_SUCCESS);
    }
}
