#![no_main]
//! cargo +nightly fuzz run md_decode   (seeds: fuzz/corpus/md_decode; see fuzz/README.md)
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = gixl::fuzzing::md_decode(data);
});
