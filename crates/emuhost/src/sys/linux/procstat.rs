//! The process's own memory figures, from `/proc/self/status`: the kernel keeps the peak resident
//! set (`VmHWM`, the high-water mark of `VmRSS`) for the process's whole life.

use std::io;

/// `/proc/self/status` as text.
pub fn self_status() -> io::Result<String> {
    std::fs::read_to_string("/proc/self/status")
}

/// The field `key` of `/proc/<pid>/status` text (`VmRSS:   1234 kB`), in bytes; `None` where
/// the field is missing or not in kB.
pub fn status_bytes(status: &str, key: &str) -> Option<u64> {
    let rest = status.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?;
    let mut f = rest.split_whitespace();
    match (f.next(), f.next()) {
        (Some(n), Some("kB")) => n.parse::<u64>().ok()?.checked_mul(1024),
        _ => None,
    }
}

/// What the C allocator holds, in bytes (glibc's `mallinfo2`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Heap {
    /// Handed out and not yet freed: small chunks in the arenas plus the chunks mapped on their own.
    pub in_use: u64,
    /// Freed but kept by the allocator in its arenas (resident where it was touched).
    pub free_held: u64,
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

#[cfg(test)]
mod tests {
    use super::status_bytes;

    /// A line with the key and nothing after it is no field (and no panic).
    #[test]
    fn a_bare_key_is_no_field() {
        assert_eq!(status_bytes("VmHWM", "VmHWM"), None);
        assert_eq!(status_bytes("VmHWM:", "VmHWM"), None);
        assert_eq!(status_bytes("VmHWM:\t 8 kB", "VmHWM"), Some(8192));
    }
}
