//! The C ABI's tests, in one binary: the calls from Rust (misuse included), the header's check,
//! the shared library's exports against the header's functions, and the C and C++ programs built
//! against the shared and the static library.

mod abi;
mod exports;
mod header;
mod log;
mod snapshot;
pub(crate) mod version;
// Linux: C and C++ programs built with `cc` against `libemuhost_capi.so` and `.a`. A test binary
// under Wine has no compiler to call: `.ci/windows capi` cross-builds the same programs with mingw
// against `emuhost_capi.dll` and runs them under Wine.
#[cfg(target_os = "linux")]
mod programs;
