//! System-call counters, per thread (feature `counters`).
//!
//! Per thread so that a test or a benchmark counts its own calls while other threads (other tests)
//! run beside it. Reading them costs nothing in the default build: see `counters_disabled.rs`.

use std::cell::Cell;

pub use super::counts::{Call, Counts};

const CALLS: usize = 8;

thread_local! {
    static COUNTS: [Cell<u64>; CALLS] = const { [const { Cell::new(0) }; CALLS] };
}

/// Counts one call on this thread.
#[inline]
pub fn count(call: Call) {
    COUNTS.with(|c| c[call as usize].set(c[call as usize].get() + 1));
}

/// This thread's counts, or `None` in a build without the `counters` feature.
pub fn snapshot() -> Option<Counts> {
    COUNTS.with(|c| {
        Some(Counts {
            mmap: c[Call::Mmap as usize].get(),
            mprotect: c[Call::Mprotect as usize].get(),
            madvise: c[Call::Madvise as usize].get(),
            query: c[Call::Query as usize].get(),
            copy: c[Call::Copy as usize].get(),
            ioctl: c[Call::Ioctl as usize].get(),
            register: c[Call::Register as usize].get(),
            munmap: c[Call::Munmap as usize].get(),
        })
    })
}
