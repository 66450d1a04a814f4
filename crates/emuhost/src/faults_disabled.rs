//! Fault injection, compiled out (the cargo feature `faults` is off): nothing is ever injected,
//! and every hook is an empty inline function the optimiser removes.

use std::io;

#[path = "faults_common.rs"]
mod common;
pub use common::*;

/// Whether this build can inject faults.
pub const ENABLED: bool = false;

/// Refuses a set fault switch (naming it) so that a run meant to be under a fault does not pass
/// silently without one; `Ok` where none is set.
pub fn from_env() -> Result<(), FaultError> {
    match SWITCHES.iter().find(|name| std::env::var_os(name).is_some_and(|v| !v.is_empty())) {
        Some(&name) => Err(FaultError::NotBuilt { name }),
        None => Ok(()),
    }
}

#[inline(always)]
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
pub(crate) fn uffd_errno() -> Option<i32> {
    None
}

#[inline(always)]
pub(crate) fn unfaulted<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[inline(always)]
pub(crate) fn before_segv_install() {}

#[inline(always)]
pub(crate) fn at_collect() -> io::Result<()> {
    Ok(())
}
