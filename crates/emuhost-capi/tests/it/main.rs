//! The C ABI's tests, in one binary: the calls from Rust (misuse included), the header's check,
//! and the C and C++ programs built against the shared and the static library.

mod abi;
mod header;
mod log;
// Linux by nature for now: C and C++ programs built with `cc` against `libemuhost_capi.so` (the
// DLL comes with the next Windows issue).
#[cfg(target_os = "linux")]
mod programs;
