//! The C ABI's tests, in one binary: the calls from Rust (misuse included), the header's check,
//! and the C and C++ programs built against the shared and the static library.

mod abi;
mod header;
mod log;
mod programs;
