//! gixl's libfabric bindings (`gixl::fabric`) with the real library: the layout the bindings mirror against
//! libfabric's own headers, and the self-test through the real providers (tcp passes, shm passes, a provider
//! without RMA fails at the step that says so), and a missing library is a clean NOT_SUPPORTED.
//!
//! The library is Debian's libfabric 1.17 as scripts/setup.sh unpacks it into ~/.cache/gixl/libfabric (not
//! installed: installed, its libibverbs would break the NIXL oracle), or the one `GIXL_LIBFABRIC` names (with
//! `GIXL_LIBFABRIC_ROOT` its unpacked root, for the headers). The unpacked library's own dependencies
//! (libibverbs, librdmacm, libefa, libnl, libpsm2…) are loaded by path first, so that the dynamic loader finds
//! them by their names when libfabric asks, without LD_LIBRARY_PATH. Without it the tests say so through the
//! skip log (kind `libfabric`, in CI's must-run set).

use std::process::Command;
use std::time::Duration;

use gixl::fabric::selftest::{self, Outcome, Step};
use gixl::status::Status;

mod common;

use common::fabric::setup;
use gixl::fabric::sys::AbiCheck;

const LIMIT: Duration = Duration::from_secs(10);

#[test]
fn the_layout_the_bindings_mirror_is_libfabrics() {
    let Some(root) = setup("fabric abi") else { return };
    let include = root.join("usr/include");
    assert!(include.join("rdma/fabric.h").exists(), "no libfabric headers under {}", include.display());
    // The headers' version: entries they predate are left out, and sizes are held as `abi_check` says.
    let fabric_h = std::fs::read_to_string(include.join("rdma/fabric.h")).unwrap();
    let define = |name: &str| -> u32 {
        fabric_h
            .lines()
            .find_map(|l| l.strip_prefix("#define ")?.trim().strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in fabric.h"))
    };
    let header = (define("FI_MAJOR_VERSION"), define("FI_MINOR_VERSION"));
    let entries: Vec<(&str, usize, AbiCheck)> = gixl::fabric::sys::ABI
        .iter()
        .map(|&(n, v)| (n, v, gixl::fabric::sys::abi_check(n, header)))
        .filter(|e| e.2 != AbiCheck::Absent)
        .collect();
    let dir = std::env::temp_dir().join(format!("gixl-fabric-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut lines = Vec::new();
    for (name, _, _) in &entries {
        let expr = match name.split_once('.') {
            Some(("sizeof", ty)) => format!("sizeof(struct {ty})"),
            Some((ty, field)) => format!("offsetof(struct {ty}, {field})"),
            None => name.to_string(),
        };
        lines.push(format!("    printf(\"{name} %zu\\n\", (size_t)({expr}));"));
    }
    let c = format!(
        "#include <stddef.h>\n#include <stdio.h>\n#include <sys/uio.h>\n#include <rdma/fabric.h>\n\
         #include <rdma/fi_domain.h>\n#include <rdma/fi_endpoint.h>\n#include <rdma/fi_cm.h>\n\
         #include <rdma/fi_eq.h>\n#include <rdma/fi_rma.h>\n#include <rdma/fi_errno.h>\n\
         int main(void) {{\n{}\n    return 0;\n}}\n",
        lines.join("\n")
    );
    let src = dir.join("abi.c");
    std::fs::write(&src, c).unwrap();
    let bin = dir.join("abi");
    let cc = Command::new("cc").arg("-I").arg(&include).arg("-o").arg(&bin).arg(&src).output().unwrap();
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    let got = String::from_utf8(Command::new(&bin).output().unwrap().stdout).unwrap();
    assert_eq!(got.lines().count(), entries.len(), "{got}");
    let mut differ = Vec::new();
    let mut held = std::collections::BTreeMap::new();
    for (line, (name, ours, check)) in got.lines().zip(&entries) {
        let theirs: usize = line.strip_prefix(name).and_then(|v| v.trim().parse().ok()).unwrap_or(usize::MAX);
        let ok = match check {
            AbiCheck::Exact => theirs == *ours,
            AbiCheck::AtLeast => theirs >= *ours,
            AbiCheck::AtMost => theirs <= *ours,
            AbiCheck::Absent => unreachable!(),
        };
        *held.entry(format!("{check:?}")).or_insert(0) += 1;
        if !ok {
            differ.push(format!("{name}: headers {theirs}, bindings {ours} ({check:?})"));
        }
    }
    assert!(differ.is_empty(), "libfabric {header:?}'s headers against the bindings: {differ:?}");
    eprintln!("libfabric {header:?} headers: {held:?} of {} entries", gixl::fabric::sys::ABI.len());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_library_lists_its_devices() {
    if setup("fabric devices").is_none() {
        return;
    }
    let lib = gixl::fabric::sys::lib().unwrap();
    assert!(lib.version() >= (1, 17), "{:?}", lib.version());
    let all = gixl::fabric::devices(None, None).unwrap();
    eprintln!("libfabric {:?} at {}: {all:?}", lib.version(), lib.path);
    let provs: Vec<String> = all.iter().map(|d| d.provider()).collect();
    assert!(provs.iter().any(|p| p == "shm"), "{provs:?}");
    assert!(provs.iter().any(|p| p.starts_with("tcp")), "{provs:?}");
    for d in &all {
        assert_eq!(d.caps() & gixl::fabric::CAPS, gixl::fabric::CAPS, "{d:?}");
        assert_eq!(d.mr_mode() & !gixl::fabric::MR_MODES, 0, "{d:?} asks for a mode gixl did not offer");
    }
    // FI_HMEM: Debian's 1.17 offers it on shm (MR modes FI_MR_VIRT_ADDR and FI_MR_HMEM), not on tcp.
    let shm = all.iter().find(|d| d.provider() == "shm").unwrap();
    assert!(shm.hmem() && shm.mr_mode() & gixl::fabric::FI_MR_HMEM != 0, "{shm:?}");
    assert!(all.iter().filter(|d| d.provider() == "tcp;ofi_rxm").all(|d| !d.hmem()), "{all:?}");
    // A provider that does not exist is an empty list, not an error.
    assert!(gixl::fabric::devices(Some("no-such-provider"), None).unwrap().is_empty());
}

/// The tcp provider (RDM through `ofi_rxm`) on loopback.
#[test]
fn the_tcp_provider_passes_its_self_test() {
    if setup("fabric tcp").is_none() {
        return;
    }
    let t = selftest::run_provider("tcp;ofi_rxm", Some("lo"), LIMIT);
    eprintln!("{t}");
    assert!(t.passed(), "{t}");
    assert_eq!((t.provider.as_str(), t.domain.as_str()), ("tcp;ofi_rxm", "lo"), "{t}");
}

#[test]
fn the_shm_provider_passes_its_self_test() {
    if setup("fabric shm").is_none() {
        return;
    }
    let t = selftest::run_provider("shm", None, LIMIT);
    eprintln!("{t}");
    assert!(t.passed(), "{t}");
}

/// `udp` is a datagram provider: alone it has no RDM endpoint and no RMA, so no device is offered and the
/// self-test fails at the step that asks for one. (Under the rxd utility it has both, in software: the next
/// test.)
#[test]
fn a_provider_without_rma_fails_at_getinfo() {
    if setup("fabric udp").is_none() {
        return;
    }
    assert!(gixl::fabric::devices(Some("udp"), None).unwrap().is_empty());
    let t = selftest::run_provider("udp", Some("lo"), LIMIT);
    eprintln!("{t}");
    match &t.outcome {
        Outcome::Failed { step, error, .. } => {
            assert_eq!(*step, Step::Info, "{t}");
            assert_eq!(error.status(), Status::NotSupported, "{t}");
            assert!(error.message().contains("one-sided RMA"), "{t}");
        }
        Outcome::Passed { .. } => panic!("udp passed: {t}"),
    }
}

/// `gixl doctor` names the library, its devices, and the self-tests this process ran.
#[test]
fn the_doctor_shows_the_library_its_devices_and_the_self_tests() {
    if setup("fabric doctor").is_none() {
        return;
    }
    let t = selftest::run_provider("shm", None, LIMIT);
    assert!(t.passed(), "{t}");
    let r = gixl::telemetry::doctor::report(None);
    let at = r.find("\"libfabric\":{").expect(&r);
    let lf = &r[at..];
    let lf = &lf[..lf.find("\"cuda\":").unwrap_or(lf.len())];
    let lib = gixl::fabric::sys::lib().unwrap();
    let (major, minor) = lib.version();
    let api = if (major, minor) >= (1, 20) { "1.20" } else { "1.17" };
    let want = format!("\"version\":\"{major}.{minor}\",\"api\":\"{api}\"");
    assert!(lf.contains("\"found\":true") && lf.contains("libfabric.so.1") && lf.contains(&want), "{want} in {lf}");
    assert!(lf.contains("\"shm/shm\"") && lf.contains("\"tcp;ofi_rxm/lo\""), "{lf}");
    assert!(lf.contains("{\"device\":\"shm/shm\",\"passed\":true"), "{lf}");
}

/// `udp;ofi_rxd`: the rxd utility gives udp reliable RDM endpoints and one-sided RMA (emulated over
/// datagrams), and it passes.
#[test]
fn udp_under_rxd_passes_its_self_test() {
    if setup("fabric udp;ofi_rxd").is_none() {
        return;
    }
    let t = selftest::run_provider("udp;ofi_rxd", Some("lo"), LIMIT);
    eprintln!("{t}");
    assert!(t.passed(), "{t}");
}

/// The child half of the next test: run only in the process it starts.
#[test]
fn missing_library_child() {
    if std::env::var_os("GIXL_FABRIC_MISSING_CHILD").is_none() {
        return;
    }
    let e = gixl::fabric::devices(None, None).unwrap_err();
    assert_eq!(e.status(), Status::NotSupported, "{e}");
    assert!(e.message().contains("/nonexistent/libfabric.so.1"), "{e}");
    let t = selftest::run_provider("tcp", None, LIMIT);
    match &t.outcome {
        Outcome::Failed { step: Step::Library, error, .. } => assert_eq!(error.status(), Status::NotSupported),
        o => panic!("{o:?}"),
    }
    println!("missing library: {t}");
}

/// `GIXL_LIBFABRIC` naming no library: NOT_SUPPORTED saying what did not load, and the self-test fails at
/// its first step; no crash (in a process of its own: the library is opened once per process).
#[test]
fn a_missing_library_is_a_clean_error() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "missing_library_child", "--nocapture", "--test-threads=1"])
        .env("GIXL_FABRIC_MISSING_CHILD", "1")
        .env("GIXL_LIBFABRIC", "/nonexistent/libfabric.so.1")
        .env("GIXL_LIBFABRIC_ROOT", "/nonexistent")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("missing library: tcp/: failed at library"), "{text}");
    assert!(text.contains("1 passed"), "{text}");
}

/// The child half of the next test: run only in the process it starts.
#[test]
fn creation_child() {
    if std::env::var_os("GIXL_FABRIC_CREATION_CHILD").is_none() {
        return;
    }
    let loaded = || std::fs::read_to_string("/proc/self/maps").unwrap().contains("libfabric.so");
    let t = std::time::Instant::now();
    let a = gixl::Agent::new("creation", gixl::AgentConfig::default()).unwrap();
    a.create_backend("UCX", &gixl::Params::default()).unwrap();
    let b = gixl::Agent::new("creation-lf", gixl::AgentConfig::default()).unwrap();
    b.create_backend("LIBFABRIC", &gixl::Params::default()).unwrap();
    let took = t.elapsed();
    println!("created: {:.1} ms, libfabric loaded: {}", took.as_secs_f64() * 1e3, loaded());
    let buf = vec![0u8; 4096];
    let d = gixl::Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0);
    let regs = gixl::RegDList::with_descs(gixl::MemType::Dram, vec![gixl::RegDesc { desc: d, meta: vec![] }]);
    a.register_mem(&regs, &[]).unwrap();
    a.local_md().unwrap();
    b.register_mem(&regs, &[]).unwrap();
    b.local_md().unwrap();
    println!("registered and described: libfabric loaded: {}", loaded());
}

/// Agent and backend creation (UCX and LIBFABRIC) never open libfabric: on a host without a device that a
/// provider other than sockets drives (no /sys/class/infiniband, /sys/class/cxi, /dev/hfi1*…: this one), the
/// library is not opened at all, not even by registrations and metadata, although `GIXL_LIBFABRIC` names one
/// that loads (opening Debian's costs about 300 ms here: its psm libraries calibrate the clock when loaded).
/// Where such a device is, it is opened in the background and this test only prints.
#[test]
fn creating_agents_does_not_open_libfabric() {
    let Some(root) = setup("fabric creation") else { return };
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "creation_child", "--nocapture", "--test-threads=1"])
        .env("GIXL_FABRIC_CREATION_CHILD", "1")
        .env("GIXL_LIBFABRIC", lib.join("libfabric.so.1"))
        .env("LD_LIBRARY_PATH", format!("{}:{}", lib.display(), root.join("lib/x86_64-linux-gnu").display()))
        .env_remove("GIXL_TRANSPORT")
        .env_remove("GIXL_FABRIC_PROVIDER")
        .env_remove("FI_PROVIDER")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    let line = text.lines().find_map(|l| l.find("created: ").map(|i| &l[i..])).unwrap_or_else(|| panic!("{text}"));
    eprintln!("{line}");
    let any = |dir: &str, pre: &[&str]| {
        std::fs::read_dir(dir)
            .is_ok_and(|d| d.flatten().any(|e| pre.iter().any(|p| e.file_name().to_string_lossy().starts_with(p))))
    };
    let hardware =
        any("/sys/class/infiniband", &[""]) || any("/sys/class/cxi", &[""]) || any("/dev", &["hfi1", "ipath", "kgni"]);
    if hardware {
        eprintln!("this host has a fabric device: libfabric is looked up in the background here");
        return;
    }
    assert!(line.ends_with("libfabric loaded: false"), "{text}");
    assert!(text.contains("registered and described: libfabric loaded: false"), "{text}");
    assert!(text.contains("backend LIBFABRIC has no libfabric provider to use here"), "the WARN line: {text}");
}
