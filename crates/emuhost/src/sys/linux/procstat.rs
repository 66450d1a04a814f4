//! The process's own memory figures, from `/proc/self/status`: the kernel keeps the peak resident
//! set (`VmHWM`, the high-water mark of `VmRSS`) for the process's whole life.

use std::io;

pub use crate::sys::status::{Heap, status_bytes};

/// `/proc/self/status` as text.
pub fn self_status() -> io::Result<String> {
    std::fs::read_to_string("/proc/self/status")
}

/// What glibc's allocator holds now, over all its arenas; `None` where the C library is not glibc.
pub fn heap() -> Option<Heap> {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallinfo2 takes no arguments and only reads the allocator's own counters under
        // its arena locks; it returns a plain struct by value.
        let m = unsafe { libc::mallinfo2() };
        Some(Heap { in_use: (m.uordblks + m.hblkhd) as u64, free_held: m.fordblks as u64 })
    }
    #[cfg(not(target_env = "gnu"))]
    {
        None
    }
}

/// Gives the memory the C allocator holds free back to the kernel, in every arena (glibc's
/// `malloc_trim(0)`, which also releases whole free pages in the middle of an arena); returns
/// whether any was given back. A no-op where the C library is not glibc. Feature `bench` (the lab's soak).
#[cfg(feature = "bench")]
pub fn trim_heap() -> bool {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: malloc_trim(0) only walks the allocator's arenas under their locks and
        // madvise/sbrk-shrinks their free memory; no chunk handed out is touched.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(target_env = "gnu"))]
    {
        false
    }
}
