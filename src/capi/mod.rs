//! The C ABI (filled in by the C-layer work).
