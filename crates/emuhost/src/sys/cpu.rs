//! Guest memory through the CPU, as guest code touches it, on every platform: one atomic byte
//! access at a time (other threads may access the same bytes: atomics make that no data race).
//! A page the protection forbids faults (the platform's handler may claim it).

use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// Stores `data` at host address `at`.
///
/// # Safety
/// Every byte of `at..at + data.len()` must be memory no Rust reference points into (guest
/// memory), writable for the whole call or armed by a write tracker whose fault handler makes it
/// writable; otherwise the process dies of the fault.
pub unsafe fn store(at: usize, data: &[u8]) {
    for (i, b) in data.iter().enumerate() {
        // SAFETY: the caller's contract covers every byte of the range.
        let byte = unsafe { AtomicU8::from_ptr((at + i) as *mut u8) };
        byte.store(*b, Relaxed);
    }
}

/// Faults every page of host `start..end` in, writable, by touching one byte of each every
/// `page` bytes: an atomic read, then an atomic compare-and-swap of the same value (a write
/// access that changes no byte, whatever other threads store meanwhile).
///
/// # Safety
/// As [`store`] for every page of the range.
pub unsafe fn touch_write(start: usize, end: usize, page: usize) {
    for at in (start..end).step_by(page) {
        // SAFETY: the caller's contract covers the byte.
        let byte = unsafe { AtomicU8::from_ptr(at as *mut u8) };
        let v = byte.load(Relaxed);
        let _ = byte.compare_exchange(v, v, Relaxed, Relaxed);
    }
}
