#![no_main]
//! cargo +nightly fuzz run conn_info   (seeds: fuzz/corpus/conn_info; see fuzz/README.md)
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = gixl::fuzzing::engine_conn_info(data);
});
