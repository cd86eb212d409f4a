#![no_main]
//! cargo +nightly fuzz run notif_frames   (seeds: fuzz/corpus/notif_frames; see fuzz/README.md)
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = gixl::fuzzing::engine_notif_frames(data);
});
