//! The process's own figures as every platform's `procstat` gives them, as typed values: its
//! memory (resident, peak resident, locked), its CPU times, its mappings against the OS's limit on
//! them (Linux's `vm.max_map_count`; Windows has none), and what the C allocator holds. Linux
//! reads them from `/proc` text (parsed by [`status_bytes`]); Windows asks for them.

use std::time::Duration;

/// The field `key` of a status text (`VmRSS:   1234 kB`), in bytes; `None` where the field is
/// missing or not in kB.
pub fn status_bytes(status: &str, key: &str) -> Option<u64> {
    let rest = status.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?;
    let mut f = rest.split_whitespace();
    match (f.next(), f.next()) {
        (Some(n), Some("kB")) => n.parse::<u64>().ok()?.checked_mul(1024),
        _ => None,
    }
}

/// The process's memory now, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    /// Resident: Linux's `VmRSS`, Windows' working set (`GetProcessMemoryInfo`).
    pub resident: u64,
    /// The most ever resident, over the process's whole life: Linux's `VmHWM`, Windows' peak
    /// working set.
    pub resident_peak: u64,
    /// Locked in memory: Linux's `VmLck` (`mlock`); on Windows what emuhost itself locked
    /// (`VirtualLock` through the pin backend: Windows reports no locked total for a process).
    pub locked: u64,
}

/// The CPU time the process has used, all its threads (Linux's `getrusage(RUSAGE_SELF)`,
/// Windows' `GetProcessTimes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Times {
    /// In user mode.
    pub user: Duration,
    /// In the kernel on the process's behalf.
    pub system: Duration,
}

impl Times {
    /// User and system time together.
    pub fn total(&self) -> Duration {
        self.user + self.system
    }
}

/// The process's mappings against the OS's limit on their number (Linux's `vm.max_map_count`,
/// counted from `/proc/self/maps`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapCount {
    /// Mappings the process has now.
    pub mappings: u64,
    /// The most it may have.
    pub max: u64,
}

/// What the C allocator holds, in bytes (glibc's `mallinfo2` on Linux).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Heap {
    /// Handed out and not yet freed: small chunks in the arenas plus the chunks mapped on their own.
    pub in_use: u64,
    /// Freed but kept by the allocator in its arenas (resident where it was touched).
    pub free_held: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line with the key and nothing after it is no field (and no panic).
    #[test]
    fn a_bare_key_is_no_field() {
        assert_eq!(status_bytes("VmHWM", "VmHWM"), None);
        assert_eq!(status_bytes("VmHWM:", "VmHWM"), None);
        assert_eq!(status_bytes("VmHWM:\t 8 kB", "VmHWM"), Some(8192));
    }

    #[test]
    fn times_add_up() {
        let t = Times { user: Duration::from_millis(30), system: Duration::from_millis(12) };
        assert_eq!(t.total(), Duration::from_millis(42));
    }
}
