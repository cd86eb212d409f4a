#![no_main]
//! cargo +nightly fuzz run tcp_wire   (seeds: fuzz/corpus/tcp_wire; see fuzz/README.md)
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    gixl::fuzzing::tcp_wire(data);
});
