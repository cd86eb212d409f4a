//! Generates the C header from src/capi with cbindgen.
//!
//! The header is always written to `$OUT_DIR/gixl.h`; `tests/header.rs` fails if it differs from the
//! committed `include/gixl.h`. To update the committed copy: `GIXL_WRITE_HEADER=1 cargo build`.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/capi");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=GIXL_WRITE_HEADER");

    let crate_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml is valid");

    // Only the C layer is parsed (src/capi/mod.rs and the modules it declares), so nothing of the core
    // (its enums, its constants) leaks into the header.
    let builder =
        cbindgen::Builder::new().with_config(config).with_src(crate_dir.join("src").join("capi").join("mod.rs"));

    let bindings = match builder.generate() {
        Ok(b) => b,
        Err(e) => {
            // A parse error here is also a compile error rustc will report better; don't hide it behind ours.
            println!("cargo:warning=cbindgen could not generate gixl.h: {e}");
            return;
        }
    };
    bindings.write_to_file(out_dir.join("gixl.h"));
    if std::env::var_os("GIXL_WRITE_HEADER").is_some_and(|v| v == "1") {
        let dest = crate_dir.join("include").join("gixl.h");
        std::fs::create_dir_all(dest.parent().expect("has a parent")).expect("create include/");
        bindings.write_to_file(&dest);
        println!("cargo:warning=wrote {}", dest.display());
    }
}
