//! The process's own memory figures on Windows, as the text Linux's `/proc/self/status` has, so
//! what reads them (`status_bytes(text, "VmRSS")`) is the same on both: `GetProcessMemoryInfo`'s
//! working set (`VmRSS`) and its peak (`VmHWM`; the system keeps it for the process's whole life),
//! and its commit charge (`VmCommit`, `PagefileUsage`: private memory committed, whether resident
//! or not, and its peak `VmPeakCommit`). `VmLck` is what emuhost itself locked (`pin::lock`):
//! Windows reports no locked total for a process.

use std::fmt::Write as _;
use std::io;

use windows_sys::Win32::System::ProcessStatus::{K32GetProcessMemoryInfo, PROCESS_MEMORY_COUNTERS};
use windows_sys::Win32::System::Threading::GetCurrentProcess;

pub use crate::sys::status::{Heap, status_bytes};

/// The process's memory figures as `/proc/self/status`-style text: one `Key:\t N kB` line each
/// for `VmRSS`, `VmHWM`, `VmCommit`, `VmPeakCommit` and `VmLck`.
pub fn self_status() -> io::Result<String> {
    let mut c = PROCESS_MEMORY_COUNTERS { cb: size_of::<PROCESS_MEMORY_COUNTERS>() as u32, ..Default::default() };
    // SAFETY: GetCurrentProcess's pseudo handle has every access right; `c` is a valid buffer of
    // the size passed.
    if unsafe { K32GetProcessMemoryInfo(GetCurrentProcess(), &mut c, c.cb) } == 0 {
        return Err(io::Error::last_os_error());
    }
    let mut text = String::new();
    for (key, bytes) in [
        ("VmHWM", c.PeakWorkingSetSize as u64),
        ("VmRSS", c.WorkingSetSize as u64),
        ("VmCommit", c.PagefileUsage as u64),
        ("VmPeakCommit", c.PeakPagefileUsage as u64),
        ("VmLck", super::pin::locked_bytes()),
    ] {
        let _ = writeln!(text, "{key}:\t{:>8} kB", bytes / 1024);
    }
    Ok(text)
}

/// Always `None` on Windows: the process heap (which Rust's allocator and the C runtime use) has
/// no `mallinfo`; its totals would take a `HeapWalk` of every block, under the heap's lock.
pub fn heap() -> Option<Heap> {
    None
}

/// Gives the free memory of the process heap back to the system (`HeapCompact(GetProcessHeap(),
/// 0)`: free blocks coalesced, large free ones decommitted); returns whether the call succeeded
/// (Linux: whether glibc gave any back). Rust's allocator on Windows allocates from this heap.
/// Feature `bench` (the lab's soak).
#[cfg(feature = "bench")]
pub fn trim_heap() -> bool {
    use windows_sys::Win32::Foundation::{GetLastError, SetLastError};
    use windows_sys::Win32::System::Memory::{GetProcessHeap, HeapCompact};
    // SAFETY: GetProcessHeap returns the process's default heap, which lives as long as the
    // process; HeapCompact works under the heap's own lock and touches no block handed out.
    // SetLastError/GetLastError only touch this thread's TEB.
    unsafe {
        // HeapCompact returns 0 both on failure and where the heap has no free block left (then
        // with the last error NO_ERROR).
        SetLastError(0);
        HeapCompact(GetProcessHeap(), 0) != 0 || GetLastError() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_text_has_the_keys() {
        // Touch 4 MiB so the working set has something in it.
        let v = std::hint::black_box(vec![1u8; 4 << 20]);
        let text = self_status().unwrap();
        let rss = status_bytes(&text, "VmRSS").expect("VmRSS");
        let hwm = status_bytes(&text, "VmHWM").expect("VmHWM");
        let commit = status_bytes(&text, "VmCommit").expect("VmCommit");
        assert!(status_bytes(&text, "VmPeakCommit").expect("VmPeakCommit") >= commit);
        assert!(status_bytes(&text, "VmLck").is_some());
        assert!(rss >= 4 << 20, "{text}");
        assert!(hwm >= rss, "{text}");
        assert!(commit >= 4 << 20, "{text}");
        assert_eq!(status_bytes(&text, "VmRS"), None, "a field's whole name only");
        drop(v);
        assert_eq!(heap(), None);
    }

    #[cfg(feature = "bench")]
    #[test]
    fn trim_heap_succeeds() {
        let v: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 64 << 10]).collect();
        drop(std::hint::black_box(v));
        assert!(trim_heap());
    }
}
