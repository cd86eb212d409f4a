#![no_main]
//! cargo +nightly fuzz run mdx_wire   (seeds: fuzz/corpus/mdx_wire; see fuzz/README.md)
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = gixl::fuzzing::mdx_wire(data);
});
