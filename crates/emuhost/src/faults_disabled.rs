//! Fault injection, compiled out (the cargo feature `faults` is off): nothing is ever injected,
//! and every hook is an empty inline function the optimiser removes.

use std::io;

#[path = "faults_common.rs"]
mod common;
pub use common::*;

/// Whether this build can inject faults.
pub const ENABLED: bool = false;

/// The `EMUHOST_FAULT_*` switches as [`Settings`](crate::settings::Settings) carries them: in
/// this build, none can be set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FaultSettings {}

/// Nothing to install in this build: always true.
pub fn install(_settings: &FaultSettings) -> bool {
    true
}

#[inline(always)]
#[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))] // the GPU backends' calls
pub(crate) fn fail_import(_len: u64) -> bool {
    false
}

#[inline(always)]
pub(crate) fn fail_commit_call() -> bool {
    false
}

#[inline(always)]
pub(crate) fn no_procmap_query() -> bool {
    false
}

#[inline(always)]
pub(crate) fn no_populate_write() -> bool {
    false
}

#[inline(always)]
pub(crate) fn panic_at_commit() {}

#[inline(always)]
pub(crate) fn unfaulted<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[inline(always)]
pub(crate) fn at_collect() -> io::Result<()> {
    Ok(())
}
