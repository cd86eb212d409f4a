//! `nixl_capi_notif_map_t`: notifications per sending agent, filled by `nixl_capi_get_notifs` (which
//! appends). Senders are kept in the order they first appeared (NIXL's order is unspecified), messages
//! per sender in arrival order. Strings and payloads handed out stay valid until the map is cleared or
//! destroyed.

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};

use libc::size_t;
use parking_lot::RwLock;

use super::boundary::{cstring_lossy, ffi, put, str_arg, Fail, OK};
use super::registry::Registry;
use super::CapiStatus;

/// Opaque notification map (`struct nixl_capi_notif_map_s`).
pub struct nixl_capi_notif_map_s {
    _opaque: [u8; 0],
}
pub type nixl_capi_notif_map_t = *mut nixl_capi_notif_map_s;

#[derive(Default)]
struct Map {
    senders: Vec<(CString, Vec<Vec<u8>>)>,
    index: HashMap<String, usize>,
}

pub(crate) struct NotifMapObj(RwLock<Map>);

impl NotifMapObj {
    pub fn append(&self, notifs: Vec<(String, Vec<u8>)>) {
        let mut m = self.0.write();
        for (from, msg) in notifs {
            let i = match m.index.get(&from) {
                Some(&i) => i,
                None => {
                    let i = m.senders.len();
                    m.senders.push((cstring_lossy(&from), Vec::new()));
                    m.index.insert(from, i);
                    i
                }
            };
            m.senders[i].1.push(msg);
        }
    }
}

pub(crate) static NOTIF_MAPS: Registry<NotifMapObj> = Registry::new("notification map");

fn get(m: nixl_capi_notif_map_t) -> Result<std::sync::Arc<NotifMapObj>, Fail> {
    NOTIF_MAPS.get(m, "map")
}

#[no_mangle]
pub extern "C" fn nixl_capi_create_notif_map(notif_map: *mut nixl_capi_notif_map_t) -> CapiStatus {
    ffi! {
        nonnull(notif_map);
        put(notif_map, NOTIF_MAPS.insert(NotifMapObj(RwLock::new(Map::default()))));
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_destroy_notif_map(notif_map: nixl_capi_notif_map_t) -> CapiStatus {
    ffi! {
        NOTIF_MAPS.remove(notif_map, "notif_map")?;
        OK
    }
}

/// The number of senders.
#[no_mangle]
pub extern "C" fn nixl_capi_notif_map_size(map: nixl_capi_notif_map_t, size: *mut size_t) -> CapiStatus {
    ffi! {
        nonnull(size);
        put(size, get(map)?.0.read().senders.len());
        OK
    }
}

/// The name of sender `index`; out of range is INVALID_PARAM (NIXL reads past the end for
/// `index > size`).
#[no_mangle]
pub extern "C" fn nixl_capi_notif_map_get_agent_at(
    map: nixl_capi_notif_map_t,
    index: size_t,
    agent_name: *mut *const c_char,
) -> CapiStatus {
    ffi! {
        nonnull(agent_name);
        let m = get(map)?;
        let m = m.0.read();
        let (name, _) = m.senders.get(index).ok_or_else(|| Fail::invalid(format!("index {index} out of range for {} senders", m.senders.len())))?;
        put(agent_name, name.as_ptr());
        OK
    }
}

/// The number of notifications from `agent_name`; an unknown sender is INVALID_PARAM.
#[no_mangle]
pub extern "C" fn nixl_capi_notif_map_get_notifs_size(
    map: nixl_capi_notif_map_t,
    agent_name: *const c_char,
    size: *mut size_t,
) -> CapiStatus {
    ffi! {
        nonnull(size);
        let m = get(map)?;
        let name = str_arg(agent_name, "agent_name")?;
        let m = m.0.read();
        let &i = m.index.get(name).ok_or_else(|| Fail::invalid(format!("no notifications from '{name}'")))?;
        put(size, m.senders[i].1.len());
        OK
    }
}

/// Notification `index` from `agent_name` (binary; an empty one gives a valid pointer and 0).
#[no_mangle]
pub extern "C" fn nixl_capi_notif_map_get_notif(
    map: nixl_capi_notif_map_t,
    agent_name: *const c_char,
    index: size_t,
    data: *mut *const c_void,
    len: *mut size_t,
) -> CapiStatus {
    ffi! {
        nonnull(data, len);
        let m = get(map)?;
        let name = str_arg(agent_name, "agent_name")?;
        let m = m.0.read();
        let &i = m.index.get(name).ok_or_else(|| Fail::invalid(format!("no notifications from '{name}'")))?;
        let msgs = &m.senders[i].1;
        let msg = msgs.get(index).ok_or_else(|| Fail::invalid(format!("index {index} out of range for {} notifications from '{name}'", msgs.len())))?;
        // An empty Vec's pointer is dangling; hand out a real (static) address instead.
        static EMPTY: u8 = 0;
        let p = if msg.is_empty() { &EMPTY as *const u8 } else { msg.as_ptr() };
        put(data, p.cast::<c_void>());
        put(len, msg.len());
        OK
    }
}

#[no_mangle]
pub extern "C" fn nixl_capi_notif_map_clear(map: nixl_capi_notif_map_t) -> CapiStatus {
    ffi! {
        *get(map)?.0.write() = Map::default();
        OK
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;

    use super::super::nixl_capi_status_t::*;
    use super::*;

    #[test]
    fn append_order_and_ranges() {
        let mut m = std::ptr::null_mut();
        assert_eq!(nixl_capi_create_notif_map(&mut m), NIXL_CAPI_SUCCESS);
        let mut who = std::ptr::dangling::<c_char>();
        assert_eq!(nixl_capi_notif_map_get_agent_at(m, 0, &mut who), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_notif_map_get_agent_at(m, 1000, &mut who), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(who, std::ptr::dangling::<c_char>());
        let obj = get(m).unwrap();
        obj.append(vec![("B".into(), b"1".to_vec()), ("A".into(), vec![]), ("B".into(), b"2".to_vec())]);
        obj.append(vec![("B".into(), b"3".to_vec())]);
        let mut n = 0;
        assert_eq!(nixl_capi_notif_map_size(m, &mut n), NIXL_CAPI_SUCCESS);
        assert_eq!(n, 2);
        assert_eq!(nixl_capi_notif_map_get_agent_at(m, 0, &mut who), NIXL_CAPI_SUCCESS);
        // SAFETY: live C string owned by the map.
        assert_eq!(unsafe { CStr::from_ptr(who) }.to_bytes(), b"B");
        assert_eq!(nixl_capi_notif_map_get_notifs_size(m, c"B".as_ptr(), &mut n), NIXL_CAPI_SUCCESS);
        assert_eq!(n, 3);
        let (mut d, mut l) = (std::ptr::null(), 9);
        assert_eq!(nixl_capi_notif_map_get_notif(m, c"A".as_ptr(), 0, &mut d, &mut l), NIXL_CAPI_SUCCESS);
        assert!(!d.is_null() && l == 0);
        assert_eq!(nixl_capi_notif_map_get_notif(m, c"B".as_ptr(), 2, &mut d, &mut l), NIXL_CAPI_SUCCESS);
        // SAFETY: `l` bytes at `d`, owned by the map.
        assert_eq!(unsafe { std::slice::from_raw_parts(d.cast::<u8>(), l) }, b"3");
        assert_eq!(nixl_capi_notif_map_get_notif(m, c"B".as_ptr(), 3, &mut d, &mut l), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_notif_map_get_notifs_size(m, c"C".as_ptr(), &mut n), NIXL_CAPI_ERROR_INVALID_PARAM);
        assert_eq!(nixl_capi_notif_map_clear(m), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_notif_map_size(m, &mut n), NIXL_CAPI_SUCCESS);
        assert_eq!(n, 0);
        assert_eq!(nixl_capi_destroy_notif_map(m), NIXL_CAPI_SUCCESS);
        assert_eq!(nixl_capi_destroy_notif_map(m), NIXL_CAPI_ERROR_INVALID_PARAM);
    }
}
