//! The process's own figures on Windows, as typed values: `GetProcessMemoryInfo`'s working set
//! (resident) and its peak (the system keeps it for the process's whole life), `GetProcessTimes`'
//! user and kernel time. Locked memory is what emuhost itself locked (`pin::lock`): Windows
//! reports no locked total for a process. Windows has no limit on the number of regions a
//! process maps (Linux's `vm.max_map_count`): [`map_count`] says so with `None`.

use std::io;
use std::time::Duration;

use windows_sys::Win32::Foundation::FILETIME;
use windows_sys::Win32::System::ProcessStatus::{K32GetProcessMemoryInfo, PROCESS_MEMORY_COUNTERS};
use windows_sys::Win32::System::Threading::{GetCurrentProcess, GetProcessTimes};

pub use crate::sys::status::{Heap, MapCount, Memory, Times, status_bytes};

/// The process's memory: working set, peak working set (`GetProcessMemoryInfo`), and what
/// emuhost locked.
pub fn memory() -> io::Result<Memory> {
    let mut c = PROCESS_MEMORY_COUNTERS { cb: size_of::<PROCESS_MEMORY_COUNTERS>() as u32, ..Default::default() };
    // SAFETY: GetCurrentProcess's pseudo handle has every access right; `c` is a valid buffer of
    // the size passed.
    if unsafe { K32GetProcessMemoryInfo(GetCurrentProcess(), &mut c, c.cb) } == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Memory {
        resident: c.WorkingSetSize as u64,
        resident_peak: c.PeakWorkingSetSize as u64,
        locked: super::pin::locked_bytes(),
    })
}

/// A `FILETIME` span (100 ns units) as a duration.
fn span(t: FILETIME) -> Duration {
    let ticks = (u64::from(t.dwHighDateTime) << 32) | u64::from(t.dwLowDateTime);
    Duration::from_nanos(ticks.saturating_mul(100))
}

/// The process's CPU times, all threads (`GetProcessTimes`: user and kernel time).
pub fn times() -> io::Result<Times> {
    let z = FILETIME { dwLowDateTime: 0, dwHighDateTime: 0 };
    let (mut created, mut exited, mut kernel, mut user) = (z, z, z, z);
    // SAFETY: the pseudo handle has every access right; the four out pointers are valid FILETIMEs.
    if unsafe { GetProcessTimes(GetCurrentProcess(), &mut created, &mut exited, &mut kernel, &mut user) } == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Times { user: span(user), system: span(kernel) })
}

/// Always `None`: Windows has no limit on the number of regions a process maps (Linux's
/// `vm.max_map_count`), so there is nothing to count against.
pub fn map_count() -> io::Result<Option<MapCount>> {
    Ok(None)
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
    fn memory_and_times_are_typed_values() {
        // Touch 4 MiB so the working set has something in it.
        let v = std::hint::black_box(vec![1u8; 4 << 20]);
        let m = memory().unwrap();
        assert!(m.resident >= 4 << 20, "{m:?}");
        assert!(m.resident_peak >= m.resident, "{m:?}");
        assert_eq!(m.locked, super::super::pin::locked_bytes());
        drop(v);
        assert_eq!(heap(), None);
        let t0 = times().unwrap();
        let mut x = 0u64;
        for i in 0..50_000_000u64 {
            x = std::hint::black_box(x.wrapping_add(i));
        }
        let t1 = times().unwrap();
        assert!(t1.total() >= t0.total() && t1.total() > Duration::ZERO, "{t0:?} {t1:?}");
        assert_eq!(map_count().unwrap(), None, "Windows has no map limit");
        assert_eq!(
            span(FILETIME { dwLowDateTime: 10, dwHighDateTime: 1 }),
            Duration::from_nanos(((1u64 << 32) + 10) * 100)
        );
    }

    #[cfg(feature = "bench")]
    #[test]
    fn trim_heap_succeeds() {
        let v: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 64 << 10]).collect();
        drop(std::hint::black_box(v));
        assert!(trim_heap());
    }
}
