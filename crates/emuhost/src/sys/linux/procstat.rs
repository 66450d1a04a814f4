//! The process's own figures: memory from `/proc/self/status` (the kernel keeps the peak resident
//! set, `VmHWM`, the high-water mark of `VmRSS`, for the process's whole life), CPU times from
//! `getrusage`, mappings from `/proc/self/maps` against `/proc/sys/vm/max_map_count`.

use std::io;
use std::time::Duration;

pub use crate::sys::status::{Heap, MapCount, Memory, Times, status_bytes};

/// `/proc/self/status` as text.
pub fn self_status() -> io::Result<String> {
    std::fs::read_to_string("/proc/self/status")
}

/// The process's memory: `VmRSS`, `VmHWM` and `VmLck` of `/proc/self/status`.
pub fn memory() -> io::Result<Memory> {
    memory_from(&self_status()?)
}

/// [`memory`] from a status text; an error names the field missing.
pub fn memory_from(status: &str) -> io::Result<Memory> {
    let field = |key: &str| {
        status_bytes(status, key)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("no {key} in /proc/self/status")))
    };
    Ok(Memory { resident: field("VmRSS")?, resident_peak: field("VmHWM")?, locked: field("VmLck")? })
}

/// The process's CPU times, all threads (`getrusage(RUSAGE_SELF)`).
pub fn times() -> io::Result<Times> {
    // SAFETY: plain data; zero is a valid bit pattern.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid out buffer; getrusage writes only it.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let d = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    Ok(Times { user: d(u.ru_utime), system: d(u.ru_stime) })
}

/// The process's mappings (lines of `/proc/self/maps`) and the kernel's limit on them
/// (`vm.max_map_count`); never `None` on Linux.
pub fn map_count() -> io::Result<Option<MapCount>> {
    let path = "/proc/sys/vm/max_map_count";
    let text = std::fs::read_to_string(path).map_err(|e| io::Error::new(e.kind(), format!("reading {path}: {e}")))?;
    let max = text.trim().parse::<u64>().map_err(|_| {
        io::Error::new(io::ErrorKind::InvalidData, format!("{path} holds {:?}, not a count", text.trim()))
    })?;
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| io::Error::new(e.kind(), format!("reading /proc/self/maps: {e}")))?;
    Ok(Some(MapCount { mappings: maps.lines().count() as u64, max }))
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
    use super::*;

    #[test]
    fn memory_reads_the_three_fields_and_names_a_missing_one() {
        let s = "Name:\temuhost\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\nVmLck:\t       4 kB\n";
        let m = memory_from(s).unwrap();
        assert_eq!(m, Memory { resident: 100 << 20, resident_peak: 200 << 20, locked: 4096 });
        let e = memory_from("VmRSS:\t 1 kB\nVmLck:\t 0 kB\n").unwrap_err();
        assert!(e.to_string().contains("VmHWM"), "{e}");
        let now = memory().unwrap();
        assert!(now.resident > 0 && now.resident_peak >= now.resident, "{now:?}");
    }

    #[test]
    fn times_and_map_count_are_read() {
        let t0 = times().unwrap();
        // Some CPU spent in this process.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = std::hint::black_box(x.wrapping_add(i));
        }
        let t1 = times().unwrap();
        assert!(t1.total() >= t0.total() && t1.total() > Duration::ZERO, "{t0:?} {t1:?}");
        let m = map_count().unwrap().expect("Linux has a map limit");
        assert!(m.mappings > 0 && m.max > m.mappings, "{m:?}");
    }
}
