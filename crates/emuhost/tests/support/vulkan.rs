//! The one rule for every test that needs a Vulkan device: it runs where the device opens, and
//! otherwise skips with the reason printed (`skipped: no Vulkan device: WHY`), unless
//! `EMUHOST_REQUIRE_VULKAN=1` (CI, where lavapipe is installed) makes a missing device a failure.
//! Included by path from the library's unit tests, the integration tests and the command's tests,
//! so all of them decide the same way; std alone, so it compiles in each.

#![allow(dead_code)]

use std::io::Write as _;

/// `EMUHOST_REQUIRE_VULKAN`: unset, empty or `0` lets a test skip without a device; `1` makes a
/// missing device a failure. Any other value fails the test that asks, naming it: a CI that
/// misspelt it would otherwise skip silently.
pub fn vulkan_required() -> bool {
    let Some(v) = std::env::var_os("EMUHOST_REQUIRE_VULKAN") else { return false };
    match v.to_str().map(str::trim) {
        Some("" | "0") => false,
        Some("1") => true,
        _ => panic!("EMUHOST_REQUIRE_VULKAN={v:?}: expected 1, 0 or empty"),
    }
}

/// The device (or whatever `opened` holds) where it opened. Where it did not: with
/// `EMUHOST_REQUIRE_VULKAN=1` the test fails with the error; otherwise `None`, and a line
/// `skipped: no Vulkan device: WHY (TEST)` goes to stderr past the test harness's capture, so the
/// skip shows in a plain `cargo test`. The caller returns on `None`.
#[track_caller]
pub fn vulkan_or_skip<T, E: std::error::Error>(opened: Result<T, E>) -> Option<T> {
    // Read first, so a bad value shows on a machine with a device too.
    let required = vulkan_required();
    let e = match opened {
        Ok(device) => return Some(device),
        Err(e) => e,
    };
    let mut why = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        why.push_str(": ");
        why.push_str(&s.to_string());
        source = s.source();
    }
    if required {
        panic!("EMUHOST_REQUIRE_VULKAN=1 and no Vulkan device: {why}");
    }
    let test = std::thread::current().name().unwrap_or("a test").to_string();
    // `eprintln!` would be captured with a passing test's output and never shown.
    let _ = writeln!(std::io::stderr(), "skipped: no Vulkan device: {why} ({test})");
    None
}
