//! The real libfabric for the tests that need it (tests/fabric.rs, tests/fabric_route.rs, tests/fabric_vram.rs):
//! Debian's libfabric 1.17 as scripts/setup.sh unpacks it into ~/.cache/gixl/libfabric, or the root
//! `GIXL_LIBFABRIC_ROOT` names (scripts/test-all.sh runs these tests again over libfabric 2.1, which setup.sh
//! builds into ~/.cache/gixl/libfabric-2.1.0 with the same layout), or the library `GIXL_LIBFABRIC` names.
//! Debian's unpacked library's own dependencies are loaded by path first, so that the dynamic loader finds
//! them by their names when libfabric asks, without LD_LIBRARY_PATH (the 2.1 build, with the tcp, udp, shm and
//! utility providers only, has none). Without it a test says so through the skip log (kind `libfabric`, in CI's must-run set). And
//! an agent forced onto the libfabric route (`agent`).

use std::sync::OnceLock;

/// The unpacked root (headers under usr/include), once the library is set up for this process; None (and a
/// skip) where there is none.
pub fn setup(test: &str) -> Option<std::path::PathBuf> {
    static ROOT: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    let root = ROOT.get_or_init(|| {
        let root = std::env::var_os("GIXL_LIBFABRIC_ROOT")
            .map(Into::into)
            .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache/gixl/libfabric")))?;
        let lib = root.join("usr/lib/x86_64-linux-gnu");
        if !lib.join("libfabric.so.1").exists() {
            return None;
        }
        let libnl = root.join("lib/x86_64-linux-gnu");
        // In the order they need each other; those present (Debian's 1.17 needs them all, the 2.1 build none: a
        // missing one of Debian's shows as libfabric's own load error).
        for dep in [
            libnl.join("libnl-3.so.200"),
            lib.join("libnl-route-3.so.200"),
            lib.join("libibverbs.so.1"),
            lib.join("librdmacm.so.1"),
            lib.join("libefa.so.1"),
            lib.join("libpsm2.so.2"),
            lib.join("libinfinipath.so.4"),
            lib.join("libpsm_infinipath.so.1"),
        ]
        .into_iter()
        .filter(|d| d.exists())
        {
            let c = std::ffi::CString::new(dep.to_str().unwrap()).unwrap();
            // SAFETY: a NUL-terminated path; the handle is kept for the process's life.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            assert!(!h.is_null(), "{} does not load", dep.display());
        }
        if std::env::var_os("GIXL_LIBFABRIC").is_none() {
            std::env::set_var("GIXL_LIBFABRIC", lib.join("libfabric.so.1"));
        }
        Some(root)
    });
    if root.is_none() {
        gixl::test_skip(
            "libfabric",
            &format!("{test}: no libfabric under ~/.cache/gixl/libfabric (scripts/setup.sh unpacks it)"),
        );
    }
    root.clone()
}

/// An agent whose `LIBFABRIC` backend is forced onto the libfabric route over `provider` (`tcp;ofi_rxm`, `shm`,
/// `udp`…).
pub fn agent(name: &str, provider: &str) -> gixl::Agent {
    let a = gixl::Agent::new(name, gixl::AgentConfig::default()).unwrap();
    let p: gixl::Params = [("transport", "fabric"), ("fabric_provider", provider)]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
    a.create_backend("LIBFABRIC", &p).unwrap();
    a
}
