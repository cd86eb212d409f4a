//! Minimal end-to-end consumer of the NIXL C API through `nixl-sys`.
//!
//! Two agents live in this process. Agent "consumer-src" WRITEs a buffer into
//! agent "consumer-dst" over the UCX backend with a notification attached;
//! the target polls for the notification and the data is compared.
//! Exit code 0 means every step succeeded.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, MemType, NixlRegistration, NotificationMap, OptArgs, SystemStorage, XferDescList, XferOp, XferStatus,
};

const LEN: usize = 64 * 1024;
const NOTIF: &[u8] = b"nixl-sys-consumer: write done";
const TIMEOUT: Duration = Duration::from_secs(20);

fn step<T, E: std::fmt::Debug>(what: &str, r: Result<T, E>) -> Result<T, String> {
    match r {
        Ok(v) => {
            println!("ok   {what}");
            Ok(v)
        }
        Err(e) => {
            println!("FAIL {what}: {e:?}");
            Err(format!("{what}: {e:?}"))
        }
    }
}

fn expect(what: &str, cond: bool) -> Result<(), String> {
    if cond {
        println!("ok   {what}");
        Ok(())
    } else {
        println!("FAIL {what}");
        Err(what.to_string())
    }
}

fn make_agent(name: &str) -> Result<Agent, String> {
    let agent = step(&format!("Agent::new({name})"), Agent::new(name))?;
    let plugins = step("get_available_plugins", agent.get_available_plugins())?;
    let names: Vec<String> = plugins.iter().filter_map(|p| p.ok().map(str::to_string)).collect();
    expect("UCX plugin is available", names.iter().any(|n| n == "UCX"))?;
    let (_mems, params) = step("get_plugin_params(UCX)", agent.get_plugin_params("UCX"))?;
    step("create_backend(UCX)", agent.create_backend("UCX", &params))?;
    Ok(agent)
}

fn run() -> Result<(), String> {
    // In stub-api mode is_stub() reports whether dlopen("libnixl_capi.so")
    // failed; it is false once a real library (NIXL or gixl) was found.
    expect("libnixl_capi.so was loaded (is_stub() is false)", !nixl_sys::is_stub())?;

    let src = make_agent("consumer-src")?;
    let dst = make_agent("consumer-dst")?;

    let mut src_buf = step("SystemStorage::new(src)", SystemStorage::new(LEN))?;
    let mut dst_buf = step("SystemStorage::new(dst)", SystemStorage::new(LEN))?;
    src_buf.memset(0xA5);
    dst_buf.memset(0x00);
    step("register src buffer", src_buf.register(&src, None))?;
    step("register dst buffer", dst_buf.register(&dst, None))?;

    // Out-of-band metadata exchange: the initiator loads the target's blob.
    let md = step("dst.get_local_md", dst.get_local_md())?;
    let remote = step("src.load_remote_md", src.load_remote_md(&md))?;
    expect("load_remote_md returns the target's name", remote == "consumer-dst")?;
    expect("check_remote_metadata(consumer-dst)", src.check_remote_metadata("consumer-dst", None))?;

    let mut local = step("XferDescList::new(local)", XferDescList::new(MemType::Dram))?;
    let mut remote_list = step("XferDescList::new(remote)", XferDescList::new(MemType::Dram))?;
    step("local.add_storage_desc", local.add_storage_desc(&src_buf))?;
    step("remote.add_storage_desc", remote_list.add_storage_desc(&dst_buf))?;

    let mut args = step("OptArgs::new", OptArgs::new())?;
    step("set_notification_message", args.set_notification_message(NOTIF))?;
    step("set_has_notification", args.set_has_notification(true))?;

    let req = step(
        "create_xfer_req(WRITE)",
        src.create_xfer_req(XferOp::Write, &local, &remote_list, "consumer-dst", Some(&args)),
    )?;
    let in_progress = step("post_xfer_req", src.post_xfer_req(&req, None))?;
    let deadline = Instant::now() + TIMEOUT;
    if in_progress {
        loop {
            match step("get_xfer_status", src.get_xfer_status(&req))? {
                XferStatus::Success => break,
                XferStatus::InProgress => {
                    if Instant::now() > deadline {
                        return Err("transfer timed out".into());
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
    println!("ok   transfer complete");

    // Poll the target for the notification.
    let mut notifs = step("NotificationMap::new", NotificationMap::new())?;
    let mut got: Option<Vec<String>> = None;
    while Instant::now() < deadline {
        dst.get_notifications(&mut notifs, None).map_err(|e| format!("get_notifications: {e:?}"))?;
        let map = notifs.take_notifs().map_err(|e| format!("take_notifs: {e:?}"))?;
        if let Some(list) = map.get("consumer-src") {
            if !list.is_empty() {
                got = Some(list.clone());
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let got = got.ok_or_else(|| "no notification from consumer-src".to_string())?;
    println!("ok   notification received: {got:?}");
    expect("notification payload matches", got.len() == 1 && got[0].as_bytes() == NOTIF)?;
    expect("destination buffer holds the written bytes", dst_buf.as_slice().iter().all(|&b| b == 0xA5))?;

    drop(req);
    step("invalidate_remote_md", src.invalidate_remote_md("consumer-dst"))?;
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => {
            println!("nixl-sys-consumer: PASS");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("nixl-sys-consumer: FAIL ({e})");
            ExitCode::FAILURE
        }
    }
}
