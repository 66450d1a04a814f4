//! emuhost's C ABI: the runtime (`emuhost`) for emulators written in C, C++ or C# (P/Invoke).
//!
//! Built as `libemuhost_capi.so` and `libemuhost_capi.a` (`cargo build -p emuhost-capi
//! --release`; for Windows `emuhost_capi.dll` with its import library, `libemuhost_capi.dll.a`
//! with mingw, `emuhost_capi.dll.lib` with MSVC); the header `include/emuhost.h` is generated from this crate by cbindgen (a test
//! checks it is current) and `include/emuhost.hpp` wraps it for C++17.
//!
//! The shape is wasmtime's C API: opaque handles with a `*_delete` each, and every call that can
//! fail returns an `emuhost_error_t *` (NULL on success) that the caller reads
//! (`emuhost_error_code`, `emuhost_error_message`) and deletes. No panic crosses the boundary:
//! every entry runs its body through `entry`, which catches a panic and returns it as an error
//! (`EMUHOST_ERROR_PANIC`).
//!
//! Handles are not addresses: each is a number (never reused in the process) that a registry maps
//! to the runtime object (`handle`). So a NULL, deleted (twice deleted), or mistyped handle is
//! an error (`EMUHOST_ERROR_BAD_HANDLE`), never a use of freed memory, and a handle deleted on one
//! thread while another thread's call is using it stays alive until that call returns.
//!
//! # Safety
//! The entry points take raw pointers from C. Each
//! `unsafe extern "C" fn` states what the caller vouches for (a pointer and length name memory
//! the caller owns); everything that can be checked (NULL, alignment, lengths, enum values,
//! UTF-8, handles) is checked by the helpers in `ffi` and `handle` before use.

#![allow(non_camel_case_types)]

mod error;
mod fault;
mod ffi;
mod handle;
mod import;
mod log;
mod sched;
mod settings;
mod snapshot;
mod space;
mod watch;

pub use error::*;
pub use ffi::{EMUHOST_PROT_EXEC, EMUHOST_PROT_READ, EMUHOST_PROT_WRITE};
pub use import::*;
pub use log::*;
pub use sched::*;
pub use settings::*;
pub use snapshot::*;
pub use space::*;
pub use watch::*;

use std::ffi::c_char;

/// The version of emuhost this library was built from, NUL-terminated (static storage), e.g.
/// `"0.1.0"`. The header's `EMUHOST_VERSION_MAJOR`, `_MINOR` and `_PATCH` are the version it was
/// generated from; `emuhost_version_compatible` compares the two.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// A decimal version field (`CARGO_PKG_VERSION_*`) as a number, at compile time.
const fn version_field(text: &str) -> u32 {
    let bytes = text.as_bytes();
    let (mut n, mut i) = (0u32, 0);
    while i < bytes.len() {
        assert!(bytes[i].is_ascii_digit(), "a version field that is not a decimal number");
        n = n * 10 + (bytes[i] - b'0') as u32;
        i += 1;
    }
    n
}

/// This library's version, as the header's `EMUHOST_VERSION_MAJOR`, `_MINOR`, `_PATCH` are.
pub(crate) const VERSION: [u32; 3] = [
    version_field(env!("CARGO_PKG_VERSION_MAJOR")),
    version_field(env!("CARGO_PKG_VERSION_MINOR")),
    version_field(env!("CARGO_PKG_VERSION_PATCH")),
];

/// The major version of this library (`EMUHOST_VERSION_MAJOR` of the header it was built with).
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_version_major() -> u32 {
    VERSION[0]
}

/// The minor version of this library (`EMUHOST_VERSION_MINOR` of the header it was built with).
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_version_minor() -> u32 {
    VERSION[1]
}

/// The patch version of this library (`EMUHOST_VERSION_PATCH` of the header it was built with).
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_version_patch() -> u32 {
    VERSION[2]
}

/// Whether a program compiled against the header of version `major`.`minor` may use this library
/// (call it as `EMUHOST_VERSION_CHECK()`, which passes the header's own numbers). Semver's rule:
/// from 1.0 the same major and a minor at least the header's (a minor adds, never changes); before
/// 1.0 (`0.MINOR`) the same minor, since every 0.x minor may change the ABI. The shared library's
/// SONAME follows the same rule (`libemuhost_capi.so.MAJOR`, `libemuhost_capi.so.0.MINOR` before
/// 1.0), so the dynamic loader refuses the worst mismatches already; this check is for a library
/// linked statically, loaded with `dlopen`, or copied under another name.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_version_compatible(major: u32, minor: u32) -> bool {
    let [have_major, have_minor, _] = VERSION;
    match have_major {
        0 => major == 0 && minor == have_minor,
        _ => major == have_major && minor <= have_minor,
    }
}

/// Runs an entry point's body: `Ok` becomes NULL, an error or a panic becomes an owned
/// `emuhost_error_t *`. Every fallible entry point is `entry(|| { ... })`.
pub(crate) fn entry(body: impl FnOnce() -> Result<(), Error>) -> *mut emuhost_error_t {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(e)) => e.into_handle(),
        Err(payload) => Error::panic(payload.as_ref()).into_handle(),
    }
}

/// [`entry`] for the few entry points that return a value instead of an error (the error's own
/// accessors, deletes): a panic gives `fallback`.
pub(crate) fn entry_or<T>(fallback: T, body: impl FnOnce() -> T) -> T {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or(fallback)
}
