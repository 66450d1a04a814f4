//! Soak figures: replays looped in one process for a long time, with the figures after each
//! loop's teardown, and the check that the process's resident memory stayed flat after the first
//! loop and that no import was left live.
//!
//! Resident memory is the OS's count for the process ([`emuhost::probe::process_memory`]: Linux's
//! `VmRSS`, Windows' working set), locked memory Linux's `VmLck` (what the pin import backend
//! holds with `mlock`; on Windows what it holds with `VirtualLock`). Each replay builds its own space,
//! importer and tracker and drops them at its end, so after a loop's teardown only what the
//! process keeps for good (code, the allocator's caches, drivers' state) should stay resident.

use std::io;
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// The process's memory, as the kernel counts it now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    /// Resident (Linux's `VmRSS`, Windows' working set), in bytes.
    pub rss: u64,
    /// Locked (Linux's `VmLck`; on Windows what the pin backend locked), in bytes.
    pub locked: u64,
    /// Held by the C allocator and handed out (not freed), in bytes; 0 where unknown (not glibc).
    pub heap_in_use: u64,
    /// Freed but kept by the C allocator, in bytes; 0 where unknown.
    pub heap_free: u64,
}

/// Reads the process's memory ([`emuhost::probe::process_memory`]: `/proc/self/status` on Linux,
/// `GetProcessMemoryInfo` on Windows) and what the C allocator holds.
///
/// # Errors
///
/// The OS's error where the process's memory cannot be read (the allocator's figures are 0
/// where they cannot).
pub fn memory() -> io::Result<Memory> {
    let m = emuhost::probe::process_memory()?;
    let heap = emuhost::probe::heap().unwrap_or_default();
    Ok(Memory { rss: m.resident, locked: m.locked, heap_in_use: heap.in_use, heap_free: heap.free_held })
}

/// The CPU time the process has used so far, all threads, user and system
/// ([`emuhost::probe::process_times`]: `getrusage` on Linux, `GetProcessTimes` on Windows).
///
/// # Errors
///
/// The OS's error where the call fails.
pub fn cpu_time() -> io::Result<Duration> {
    Ok(emuhost::probe::process_times()?.total())
}

/// Gives what the C allocator holds free back to the kernel, in every arena (glibc's
/// `malloc_trim(0)`; on Windows `HeapCompact` of the process heap); returns whether any memory
/// was given back (always `false` off glibc but on Windows, where it says the call succeeded).
///
/// Why a soak does it after each loop's teardown: glibc keeps freed memory in its arenas (one per
/// thread that ran at once, up to eight per CPU), and each loop's threads are new, so which arena
/// holds what drifts from loop to loop and the memory kept free creeps up for many loops although
/// nothing is leaked (on this VM: 15 MiB free after loop 1, 31 MiB after loop 7, 1.5 MiB in use
/// throughout). A runtime gives it back the same way when a session ends.
pub fn trim_heap() -> bool {
    emuhost::probe::trim_heap()
}

/// The field `key` of `/proc/<pid>/status` text (`VmRSS:   1234 kB`), in bytes.
pub use emuhost::probe::status_bytes;

/// One loop of a soak: what the replay did and what was left after its teardown ([`judge`] has
/// an example).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SoakLoop {
    /// 1, 2, ...
    pub index: u64,
    /// The loop's wall time (the replay and its teardown).
    pub wall: Duration,
    /// CPU time the process used during the loop (all threads, user and system).
    pub cpu: Duration,
    /// The process's memory after the loop's teardown (and the trim, where the soak trims).
    pub memory: Memory,
    /// Resident memory after the teardown, before the trim (the same as `memory.rss` where the
    /// soak does not trim).
    pub rss_untrimmed: u64,
    /// Imports the import backend still counted live after the teardown, and their bytes.
    pub live_imports: u64,
    /// See `live_imports`.
    pub live_bytes: u64,
    /// The replay's guest writes, in pages ([`ReplayReport::writes`](crate::replay::ReplayReport::writes)).
    pub writes: u64,
    /// The replay's lost writes ([`ReplayReport::lost_writes`](crate::replay::ReplayReport::lost_writes)).
    pub lost_writes: u64,
    /// The import and write-tracking backends the loop's replay picked (empty where it failed).
    /// Shared text: a soak keeps one copy while they stay the same (see [`SoakLoop::name_backends`]).
    pub import_backend: Arc<str>,
    /// See `import_backend`.
    pub watch_backend: Arc<str>,
    /// The replay's error, if it failed.
    pub error: Option<String>,
}

impl SoakLoop {
    /// Records the backends the loop's replay picked, sharing the previous loop's text where it is
    /// the same: a soak of a short trace runs thousands of loops, and a copy of the backends'
    /// descriptions per loop (a few hundred bytes for a Vulkan device) would be growth of the
    /// soak's own that the allocator check then sees.
    pub fn name_backends(&mut self, import: &str, watch: &str, prev: Option<&SoakLoop>) {
        let share = |name: &str, prev: Option<&Arc<str>>| match prev {
            Some(p) if **p == *name => Arc::clone(p),
            _ => Arc::from(name),
        };
        self.import_backend = share(import, prev.map(|p| &p.import_backend));
        self.watch_backend = share(watch, prev.map(|p| &p.watch_backend));
    }
}

/// How much resident memory may grow after the first loop: the larger of `bytes` and `percent`
/// of the resident memory after the first loop.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GrowthLimit {
    /// Growth allowed whatever the first loop's memory, in bytes.
    pub bytes: u64,
    /// Growth allowed as a percentage of the first loop's memory (10.0: 10 %).
    pub percent: f64,
}

/// The default limit: 32 MiB or 10 %, whichever is larger.
///
/// Why: a replay's own working set (its space's pages, its imports) is released at its teardown,
/// but the process keeps some memory without leaking it: each loop's threads are new and glibc's
/// malloc gives threads arenas of their own (up to eight per CPU), whose freed chunks need not go
/// back to the kernel, and a GPU driver keeps caches. That noise is a few MiB and does not grow
/// with the number of loops. A real leak does: one 16 MiB import chunk or one populated pool left
/// behind per loop passes 32 MiB within three loops. The 10 % keeps a process that starts large
/// (a driver's hundreds of MiB) from failing on noise proportional to its size.
pub const DEFAULT_GROWTH_LIMIT: GrowthLimit = GrowthLimit { bytes: 32 * MIB, percent: 10.0 };

impl GrowthLimit {
    /// The growth allowed over `first` bytes.
    pub fn allowed(&self, first: u64) -> u64 {
        self.bytes.max((first as f64 * self.percent / 100.0) as u64)
    }
}

/// What a soak's figures say ([`judge`], with an example). Memory figures are in bytes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SoakVerdict {
    /// Loops judged.
    pub loops: u64,
    /// Resident memory after the first loop.
    pub rss_first: u64,
    /// The most resident memory after any later loop (the first's where there is none), and
    /// the loop it was after.
    pub rss_max_after: u64,
    /// See `rss_max_after`.
    pub rss_max_loop: u64,
    /// `rss_max_after - rss_first` (0 where it shrank), and that as a percentage of `rss_first`.
    pub growth: u64,
    /// See `growth`.
    pub growth_percent: f64,
    /// The growth the limit allowed over `rss_first` ([`GrowthLimit::allowed`]).
    pub allowed_growth: u64,
    /// The C allocator's memory in use after the first loop, the most after any later loop, and
    /// the growth between them: what grows here is leaked, whatever the allocator keeps free.
    pub heap_first: u64,
    /// See `heap_first`.
    pub heap_max_after: u64,
    /// See `heap_first`.
    pub heap_growth: u64,
    /// What the import backend counted live after the last loop's teardown.
    pub live_imports_end: u64,
    /// See `live_imports_end`.
    pub live_bytes_end: u64,
    /// Loops whose replay failed.
    pub errors: u64,
    /// Lost writes over all loops.
    pub lost_writes: u64,
    /// Each check that failed, in words; empty when all passed.
    pub failures: Vec<String>,
}

impl SoakVerdict {
    /// Whether every check passed (no failure).
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// A figure after the first loop, the most of it after any later loop (the first's where there
/// is none), and the loop that was. `loops` is not empty.
fn most_after_first(loops: &[SoakLoop], figure: impl Fn(&SoakLoop) -> u64) -> (u64, u64, u64) {
    let first = &loops[0];
    let top = loops[1..].iter().max_by_key(|l| figure(l)).unwrap_or(first);
    (figure(first), figure(top), top.index)
}

/// Judges a soak's loops: it fails where resident memory or the C allocator's memory in use
/// after a later loop grew past `limit` over the first loop's, where imports were left live after
/// a loop's teardown, where a loop picked other backends than the first, where a loop failed, or
/// where a write was lost. No loop at all is a failure too.
///
/// # Examples
///
/// Loops as a soak records them (here made up: a real soak replays a trace in each, see
/// [`crate::replay`], and reads [`memory`] after its teardown), judged:
///
/// ```
/// use emuhost_lab::soak::{DEFAULT_GROWTH_LIMIT, Memory, SoakLoop, judge};
///
/// const MIB: u64 = 1 << 20;
/// let after = |index: u64, rss_mib: u64| {
///     let memory = Memory { rss: rss_mib * MIB, ..Default::default() };
///     let mut l = SoakLoop { index, memory, ..Default::default() };
///     l.name_backends("pin", "uffd", None);
///     l
/// };
/// // Noise after the first loop, within 32 MiB: a pass.
/// let flat: Vec<SoakLoop> = [100, 120, 96, 131].into_iter().zip(1..).map(|(m, i)| after(i, m)).collect();
/// assert!(judge(&flat, DEFAULT_GROWTH_LIMIT).passed());
///
/// // 8 MiB more after each loop: a leak, found once past 32 MiB.
/// let leak: Vec<SoakLoop> = (1..=6).map(|i| after(i, 100 + 8 * (i - 1))).collect();
/// let verdict = judge(&leak, DEFAULT_GROWTH_LIMIT);
/// assert!(!verdict.passed());
/// assert_eq!((verdict.growth, verdict.rss_max_loop), (40 * MIB, 6));
/// ```
pub fn judge(loops: &[SoakLoop], limit: GrowthLimit) -> SoakVerdict {
    let mut v = SoakVerdict { loops: loops.len() as u64, ..Default::default() };
    let mut failures = Vec::new();
    let Some(first) = loops.first() else {
        v.failures.push("no loop ran".into());
        return v;
    };
    (v.rss_first, v.rss_max_after, v.rss_max_loop) = most_after_first(loops, |l| l.memory.rss);
    v.growth = v.rss_max_after.saturating_sub(v.rss_first);
    v.growth_percent = if v.rss_first > 0 { v.growth as f64 * 100.0 / v.rss_first as f64 } else { 0.0 };
    v.allowed_growth = limit.allowed(v.rss_first);
    if v.growth > v.allowed_growth {
        failures.push(format!(
            "resident memory grew {:.1} MiB ({:.1} %) after the first loop (to {:.1} MiB after loop {}), more than the {:.1} MiB allowed",
            v.growth as f64 / MIB as f64,
            v.growth_percent,
            v.rss_max_after as f64 / MIB as f64,
            v.rss_max_loop,
            v.allowed_growth as f64 / MIB as f64
        ));
    }
    (v.heap_first, v.heap_max_after, _) = most_after_first(loops, |l| l.memory.heap_in_use);
    v.heap_growth = v.heap_max_after.saturating_sub(v.heap_first);
    let heap_allowed = limit.allowed(v.heap_first);
    if v.heap_growth > heap_allowed {
        failures.push(format!(
            "the C allocator's memory in use grew {:.1} MiB after the first loop (from {:.1} MiB), more than the {:.1} MiB allowed",
            v.heap_growth as f64 / MIB as f64,
            v.heap_first as f64 / MIB as f64,
            heap_allowed as f64 / MIB as f64
        ));
    }
    let last = loops.last().expect("not empty");
    (v.live_imports_end, v.live_bytes_end) = (last.live_imports, last.live_bytes);
    let leaky: Vec<u64> = loops.iter().filter(|l| l.live_imports > 0 || l.live_bytes > 0).map(|l| l.index).collect();
    if !leaky.is_empty() {
        failures.push(format!(
            "imports left live after the teardown of {} loop(s), first loop {} ({} bytes live at the end)",
            leaky.len(),
            leaky[0],
            v.live_bytes_end
        ));
    }
    // A backend that changes between loops is a failure of its own: the first found no Vulkan
    // after 30 instances on the H200 and the automatic choice moved to CUDA without an error.
    let changed = loops
        .iter()
        .filter(|l| l.error.is_none())
        .find(|l| (&*l.import_backend, &*l.watch_backend) != (&*first.import_backend, &*first.watch_backend));
    if let Some(l) = changed {
        failures.push(format!(
            "the backends changed at loop {}: imports {:?}, write tracking {:?} (loop 1: {:?}, {:?})",
            l.index, l.import_backend, l.watch_backend, first.import_backend, first.watch_backend
        ));
    }
    let failed: Vec<&SoakLoop> = loops.iter().filter(|l| l.error.is_some()).collect();
    v.errors = failed.len() as u64;
    if let Some(l) = failed.first() {
        failures.push(format!(
            "{} loop(s) failed; loop {}: {}",
            failed.len(),
            l.index,
            l.error.as_deref().unwrap_or_default()
        ));
    }
    v.lost_writes = loops.iter().map(|l| l.lost_writes).sum();
    if v.lost_writes > 0 {
        failures.push(format!("{} writes lost", v.lost_writes));
    }
    v.failures = failures;
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(index: u64, rss_mib: u64) -> SoakLoop {
        SoakLoop { index, memory: Memory { rss: rss_mib * MIB, locked: 0, ..Default::default() }, ..Default::default() }
    }

    #[test]
    fn status_fields_in_bytes() {
        let s = "Name:\temuhost\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\nVmLck:\t       0 kB\nThreads:\t1\n";
        assert_eq!(status_bytes(s, "VmRSS"), Some(100 * MIB));
        assert_eq!(status_bytes(s, "VmLck"), Some(0));
        assert_eq!(status_bytes(s, "VmRS"), None, "a field's whole name only");
        assert_eq!(status_bytes(s, "Threads"), None, "not in kB");
        let m = memory().unwrap();
        assert!(m.rss > 0, "{m:?}");
    }

    #[test]
    fn flat_memory_passes() {
        // Noise up and down after the first loop, within 32 MiB of 100 MiB.
        let loops: Vec<SoakLoop> = [100, 120, 96, 131, 110].iter().zip(1..).map(|(&m, i)| at(i, m)).collect();
        let v = judge(&loops, DEFAULT_GROWTH_LIMIT);
        assert!(v.passed(), "{:?}", v.failures);
        assert_eq!((v.rss_first, v.rss_max_after, v.rss_max_loop), (100 * MIB, 131 * MIB, 4));
        assert_eq!(v.growth, 31 * MIB);
        assert!((v.growth_percent - 31.0).abs() < 1e-9);
    }

    #[test]
    fn memory_that_grows_fails() {
        // 6 MiB a loop: 36 MiB over the first after seven loops.
        let loops: Vec<SoakLoop> = (1..=7).map(|i| at(i, 100 + 6 * (i - 1))).collect();
        let v = judge(&loops, DEFAULT_GROWTH_LIMIT);
        assert!(!v.passed());
        assert_eq!((v.growth, v.rss_max_loop), (36 * MIB, 7));
        assert!(v.failures[0].contains("grew 36.0 MiB (36.0 %)"), "{:?}", v.failures);
        // Under 10 % of a large process is noise; past it is not.
        let big = |i: u64, mib: u64| at(i, mib);
        assert!(judge(&[big(1, 1000), big(2, 1090)], DEFAULT_GROWTH_LIMIT).passed());
        assert!(!judge(&[big(1, 1000), big(2, 1110)], DEFAULT_GROWTH_LIMIT).passed());
        // The first loop's own growth (warming up) is not counted: only what comes after it.
        assert!(judge(&[big(1, 500), big(2, 500)], DEFAULT_GROWTH_LIMIT).passed());
    }

    #[test]
    fn heap_growth_and_a_backend_change_fail() {
        // RSS flat, but the allocator's memory in use grows past 32 MiB: a leak the allocator hid.
        let mut loops: Vec<SoakLoop> = (1..=3).map(|i| at(i, 100)).collect();
        loops[0].memory.heap_in_use = 2 * MIB;
        loops[1].memory.heap_in_use = 20 * MIB;
        assert!(judge(&loops, DEFAULT_GROWTH_LIMIT).passed());
        loops[2].memory.heap_in_use = 40 * MIB;
        let v = judge(&loops, DEFAULT_GROWTH_LIMIT);
        assert_eq!((v.heap_first, v.heap_max_after, v.heap_growth), (2 * MIB, 40 * MIB, 38 * MIB));
        assert!(v.failures[0].contains("in use grew 38.0 MiB"), "{:?}", v.failures);

        let mut loops: Vec<SoakLoop> = (1..=4).map(|i| at(i, 100)).collect();
        for l in &mut loops {
            (l.import_backend, l.watch_backend) = ("vulkan".into(), "uffd".into());
        }
        assert!(judge(&loops, DEFAULT_GROWTH_LIMIT).passed());
        // A failed loop has no backend: its error is the failure, not a change.
        loops[1].import_backend = "".into();
        loops[1].error = Some("vkCreateInstance failed".into());
        let v = judge(&loops, DEFAULT_GROWTH_LIMIT);
        assert_eq!(v.failures.len(), 1, "{:?}", v.failures);
        loops[3].import_backend = "cuda".into();
        let v = judge(&loops, DEFAULT_GROWTH_LIMIT);
        assert!(v.failures[0].contains("changed at loop 4"), "{:?}", v.failures);
    }

    #[test]
    fn loops_share_the_backend_names_while_they_stay_the_same() {
        let mut first = at(1, 100);
        first.name_backends("NVIDIA H200", "uffd", None);
        let mut second = at(2, 100);
        second.name_backends("NVIDIA H200", "uffd", Some(&first));
        assert!(Arc::ptr_eq(&first.import_backend, &second.import_backend));
        assert!(Arc::ptr_eq(&first.watch_backend, &second.watch_backend));
        let mut third = at(3, 100);
        third.name_backends("cuda", "uffd", Some(&second));
        assert_eq!((&*third.import_backend, &*third.watch_backend), ("cuda", "uffd"));
        assert!(!Arc::ptr_eq(&first.import_backend, &third.import_backend));
        assert!(Arc::ptr_eq(&first.watch_backend, &third.watch_backend));
    }

    #[test]
    fn live_imports_errors_and_lost_writes_fail() {
        let mut loops: Vec<SoakLoop> = (1..=3).map(|i| at(i, 100)).collect();
        assert!(judge(&loops, DEFAULT_GROWTH_LIMIT).passed());
        loops[2].live_imports = 1;
        loops[2].live_bytes = 16 * MIB;
        let v = judge(&loops, DEFAULT_GROWTH_LIMIT);
        assert_eq!((v.live_imports_end, v.live_bytes_end), (1, 16 * MIB));
        assert!(v.failures[0].contains("first loop 3"), "{:?}", v.failures);
        let mut loops: Vec<SoakLoop> = (1..=3).map(|i| at(i, 100)).collect();
        loops[1].error = Some("line 9: collect failed".into());
        loops[2].lost_writes = 2;
        let v = judge(&loops, DEFAULT_GROWTH_LIMIT);
        assert_eq!((v.errors, v.lost_writes), (1, 2));
        assert_eq!(v.failures.len(), 2, "{:?}", v.failures);
        assert!(!judge(&[], DEFAULT_GROWTH_LIMIT).passed(), "no loop is no pass");
    }
}
