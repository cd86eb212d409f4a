//! The rdma-core bindings (`gixl::verbs::sys`, feature `rdma`) against rdma-core's own header: a C program
//! compiled against `<infiniband/verbs.h>` prints the offsets the bindings read, and they must agree (and
//! `ibv_reg_dmabuf_mr` must have the signature the bindings call it by); and the
//! real library's answer on a host without a NIC (this one, and CI's): NOT_SUPPORTED saying why, nothing
//! else. The header comes from `$GIXL_RDMA_CORE/usr/include` (scripts/setup.sh unpacks Debian's rdma-core into
//! ~/.cache/gixl/rdma-core without installing it, and the test command points there), else /usr/include;
//! without it the first test says so, and fails on CI. With `GIXL_LIBIBVERBS` set (the test command sets it to
//! the unpacked library) the second requires that library to load and find no device.
#![cfg(feature = "rdma")]

use std::process::Command;

use gixl::verbs::sys;

#[test]
fn the_offsets_the_bindings_read_are_rdma_cores() {
    let root = std::env::var("GIXL_RDMA_CORE").unwrap_or_else(|_| "/".into());
    let include = std::path::Path::new(&root).join("usr/include");
    if !include.join("infiniband/verbs.h").exists() {
        assert!(std::env::var("CI").is_err(), "no rdma-core header under {} (scripts/setup.sh unpacks one)", root);
        gixl::test_skip("verbs_abi", "no <infiniband/verbs.h> (GIXL_RDMA_CORE, or apt install libibverbs-dev)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("gixl-verbs-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("abi.c");
    let off = |ty: &str, f: &str| format!("offsetof(struct ibv_{ty}, {f})");
    let mut lines = Vec::new();
    for (name, _) in sys::ABI {
        let expr = match name.split_once('.') {
            Some(("sizeof", ty)) => format!("sizeof(struct ibv_{ty})"),
            Some((ty, field)) => off(ty, field),
            None => format!("(size_t){name}"),
        };
        lines.push(format!("    printf(\"{name} %zu\\n\", (size_t)({expr}));"));
    }
    // The optional symbol the bindings call through a pointer of this type (`reg_dmabuf_mr`): a compile-time
    // check, no linking needed.
    let dmabuf = "_Static_assert(__builtin_types_compatible_p(__typeof__(&ibv_reg_dmabuf_mr), \
                  struct ibv_mr *(*)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int)), \
                  \"ibv_reg_dmabuf_mr's signature\");";
    let c = format!(
        "#include <stddef.h>\n#include <stdint.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\n{dmabuf}\n\
         int main(void) {{\n{}\n    return 0;\n}}\n",
        lines.join("\n")
    );
    std::fs::write(&src, c).unwrap();
    let bin = dir.join("abi");
    let cc = Command::new("cc").arg("-I").arg(&include).arg("-o").arg(&bin).arg(&src).output().unwrap();
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    let out = Command::new(&bin).output().unwrap();
    let got = String::from_utf8(out.stdout).unwrap();
    let want: String = sys::ABI.iter().map(|(n, v)| format!("{n} {v}\n")).collect();
    let differ: Vec<(&str, &str)> = got.lines().zip(want.lines()).filter(|(g, w)| g != w).collect();
    assert!(
        differ.is_empty() && got.lines().count() == sys::ABI.len(),
        "rdma-core (left) against the bindings (right): {differ:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where the library is installed and no device exists, or where it is not installed, `load` says
/// NOT_SUPPORTED with the reason; where a device exists, its ports list.
#[test]
fn the_real_library_without_a_device_is_not_supported_and_says_why() {
    let has_dev = std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some());
    match sys::load() {
        Ok(f) => {
            assert!(has_dev, "a fabric without a device");
            let ports = f.ports().unwrap();
            assert!(!ports.is_empty());
            eprintln!("RDMA ports: {ports:?}");
        }
        Err(e) => {
            assert!(!has_dev || e.message().contains("not installed"), "{e}");
            if std::env::var_os("GIXL_LIBIBVERBS").is_some() {
                assert!(
                    e.message().contains("no RDMA device"),
                    "the library named by GIXL_LIBIBVERBS did not load: {e}"
                );
            }
            assert_eq!(e.status(), gixl::status::Status::NotSupported, "{e}");
            assert!(e.message().contains("no RDMA device") || e.message().contains("not installed"), "{e}");
        }
    }
}
