//! How many workers a compile job gets.
//!
//! A compiler allocates and frees from every worker at once. Where the process's allocator takes
//! one lock for that (Windows' NT heap was measured so in the reference: workers past half the
//! CPUs made the job slower), half the usable CPUs is the count. Where it scales, each worker past
//! half the CPUs costs memory at the peak (0.4–0.5 GB measured), so one is added for each 768 MiB
//! of available memory past a 4 GiB reserve, up to the usable CPUs. Either way, no more than 32.
//! Whether the allocator scales is the application's to say: the library cannot know its global
//! allocator.

use super::SchedError;
use crate::sys::sched as sys;

/// Memory kept back before any worker past half the CPUs is added.
pub const RESERVE_BYTES: u64 = 4 << 30;
/// Available memory past the reserve that buys one more worker.
pub const BYTES_PER_EXTRA_WORKER: u64 = 768 << 20;
/// No more workers than this, whether the allocator scales or not.
pub const MAX_WORKERS: usize = 32;

/// Whether the process's allocator scales with threads allocating at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocator {
    /// Threads allocate side by side (per-thread heaps: mimalloc, a segment heap).
    Scales,
    /// Threads queue on a lock to allocate.
    Locked,
}

impl Allocator {
    /// Its name in the worker count's reason: `scales` or `locked`.
    pub fn name(self) -> &'static str {
        match self {
            Allocator::Scales => "scales",
            Allocator::Locked => "locked",
        }
    }
}

/// A CPU quota: `quota_us` µs of CPU time every `period_us` µs (Linux: a cgroup v2 `cpu.max`;
/// Windows: the job object's hard CPU rate cap).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuQuota {
    /// CPU time allowed per period, in µs (over all processors: 150000 of 100000 is 1.5 CPUs).
    pub quota_us: u64,
    /// The period, in µs (never 0 from [`parse_cpu_max`]).
    pub period_us: u64,
}

impl CpuQuota {
    /// Processors' worth of time, rounded up (1.5 CPUs lets 2 workers make progress), at least 1.
    pub fn cpus(self) -> usize {
        self.quota_us.div_ceil(self.period_us).max(1) as usize
    }
}

/// Parses a cgroup v2 `cpu.max`: `max PERIOD` (no limit, `None`) or `QUOTA PERIOD`.
///
/// # Errors
/// [`SchedError::BadCpuMax`], naming the text, where it is neither, or the quota or the period
/// is 0.
///
/// ```
/// use emuhost::sched::{CpuQuota, parse_cpu_max};
///
/// assert_eq!(parse_cpu_max("max 100000\n").unwrap(), None);
/// let q = parse_cpu_max("150000 100000").unwrap().unwrap();
/// assert_eq!(q, CpuQuota { quota_us: 150000, period_us: 100000 });
/// assert_eq!(q.cpus(), 2);
/// assert!(parse_cpu_max("150000 0").is_err());
/// ```
pub fn parse_cpu_max(text: &str) -> Result<Option<CpuQuota>, SchedError> {
    let bad = || SchedError::BadCpuMax { text: text.to_string() };
    let mut fields = text.split_whitespace();
    let (Some(quota), Some(period), None) = (fields.next(), fields.next(), fields.next()) else { return Err(bad()) };
    let period_us: u64 = period.parse().map_err(|_| bad())?;
    if period_us == 0 {
        return Err(bad());
    }
    if quota == "max" {
        return Ok(None);
    }
    let quota_us: u64 = quota.parse().map_err(|_| bad())?;
    if quota_us == 0 {
        return Err(bad());
    }
    Ok(Some(CpuQuota { quota_us, period_us }))
}

/// Parses `/proc/meminfo`'s `MemAvailable:   N kB` into bytes.
///
/// # Errors
/// [`SchedError::NoMemAvailable`] where there is no such line; [`SchedError::BadMemAvailable`],
/// naming the line, where it is not `MemAvailable: N kB` or the bytes overflow a `u64`.
pub fn parse_mem_available(meminfo: &str) -> Result<u64, SchedError> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:")).ok_or(SchedError::NoMemAvailable)?;
    let bad = || SchedError::BadMemAvailable { line: line.to_string() };
    let mut fields = line["MemAvailable:".len()..].split_whitespace();
    let (Some(n), Some("kB"), None) = (fields.next(), fields.next(), fields.next()) else { return Err(bad()) };
    let kib: u64 = n.parse().map_err(|_| bad())?;
    kib.checked_mul(1024).ok_or_else(bad)
}

/// The usable processors: the affinity count limited by the CPU quota, at least 1.
pub fn usable_cpus(affinity: usize, quota: Option<CpuQuota>) -> usize {
    quota.map_or(affinity, |q| affinity.min(q.cpus())).max(1)
}

/// A worker count and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workers {
    /// The workers to start: 1 to [`MAX_WORKERS`].
    pub count: usize,
    /// Why, in one line (for the log and `emuhost policy`).
    pub why: String,
}

/// The worker count for a compile job: `half = max(1, usable / 2)`; where the allocator is
/// locked, `half`; where it scales, `half` plus one for each 768 MiB of `available_bytes` past
/// 4 GiB (none below), limited by `usable`. Either way no more than 32.
///
/// ```
/// use emuhost::sched::{Allocator, prepare_workers};
///
/// // 16 usable CPUs and 8 GiB available.
/// assert_eq!(prepare_workers(16, 8 << 30, Allocator::Locked).count, 8);
/// // Scaling: 8 plus one per 768 MiB past the 4 GiB reserve (5), 13.
/// let w = prepare_workers(16, 8 << 30, Allocator::Scales);
/// assert_eq!(w.count, 13, "{}", w.why);
/// ```
pub fn prepare_workers(usable: usize, available_bytes: u64, allocator: Allocator) -> Workers {
    let half = (usable / 2).max(1);
    let mib = available_bytes >> 20;
    match allocator {
        Allocator::Locked => {
            // The cap holds for either allocator: 32 is the most the rule ever gives.
            let count = half.min(MAX_WORKERS);
            let limit = if count < half { format!(" ({half}), limited to {MAX_WORKERS}") } else { String::new() };
            Workers {
                count,
                why: format!("{count} workers: half of {usable} usable CPUs{limit} (the allocator is locked)"),
            }
        }
        Allocator::Scales => {
            let extra = available_bytes.saturating_sub(RESERVE_BYTES) / BYTES_PER_EXTRA_WORKER;
            let wanted = (half as u64).saturating_add(extra);
            let count = wanted.min(usable as u64).min(MAX_WORKERS as u64) as usize;
            let limit = if wanted <= count as u64 {
                String::new()
            } else if count == MAX_WORKERS && usable > MAX_WORKERS {
                format!(", limited to {MAX_WORKERS}")
            } else {
                format!(", limited to the {usable} usable CPUs")
            };
            Workers {
                count,
                why: format!(
                    "{count} workers: half of {usable} usable CPUs ({half}) plus {extra} for {mib} MiB available past \
                     the 4 GiB reserve (one per 768 MiB){limit} (the allocator scales)"
                ),
            }
        }
    }
}

/// Where [`Machine::read`] takes each value on this platform, as its reason names them.
#[cfg(target_os = "linux")]
mod source {
    pub const AFFINITY: &str = "sched_getaffinity";
    pub const QUOTA: &str = "cgroup quota";
    pub const MEMORY: &str = "MemAvailable";
}
#[cfg(windows)]
mod source {
    pub const AFFINITY: &str = "the processor count (affinity mask, processor groups, CPU sets)";
    pub const QUOTA: &str = "job CPU rate cap";
    pub const MEMORY: &str = "GlobalMemoryStatusEx";
}

/// What this machine gives the process, as `prepare_workers` needs it. Each part that could not
/// be read says why in `notes`. On Windows the quota is the job object's hard CPU rate cap and
/// the memory `GlobalMemoryStatusEx`'s available physical memory, read as numbers (no text).
///
/// ```
/// use emuhost::sched::{Allocator, Machine};
///
/// let machine = Machine::read();
/// let workers = machine.prepare_workers(Allocator::Locked);
/// assert!(workers.count >= 1 && workers.count <= machine.usable_cpus());
/// ```
#[derive(Clone, Debug, Default)]
pub struct Machine {
    /// Logical processors in the affinity mask (`None`: unknown).
    pub affinity_cpus: Option<usize>,
    /// The tightest cgroup v2 CPU quota over the process's cgroup and those above it.
    pub quota: Option<CpuQuota>,
    /// `MemAvailable` in bytes (`None`: unknown).
    pub available_bytes: Option<u64>,
    /// One line for each value that could not be read, saying why and what was assumed.
    pub notes: Vec<String>,
}

impl Machine {
    /// Reads the affinity mask, the cgroup quota and `MemAvailable` (Windows: the job's CPU rate
    /// cap and `GlobalMemoryStatusEx`). Never fails: what could not be read is `None` and a note.
    pub fn read() -> Machine {
        let mut m = Machine::default();
        match sys::affinity_cpus() {
            Ok(n) => m.affinity_cpus = Some(n),
            Err(e) => m.notes.push(format!("{} failed ({e}): 1 CPU assumed", source::AFFINITY)),
        }
        m.read_quota();
        m.read_memory();
        m
    }

    /// The tightest cgroup v2 `cpu.max` over the process's cgroup and those above it.
    #[cfg(target_os = "linux")]
    fn read_quota(&mut self) {
        match sys::cgroup_cpu_max() {
            Ok(files) => {
                for (path, text) in files {
                    let parsed = text
                        .map_err(|source| SchedError::Read { path: path.clone(), source })
                        .and_then(|t| parse_cpu_max(&t));
                    match parsed {
                        Ok(Some(q)) if self.quota.is_none_or(|old| q.cpus() < old.cpus()) => self.quota = Some(q),
                        Ok(_) => {}
                        Err(e) => self.notes.push(format!("{} ignored: {e}", path.display())),
                    }
                }
            }
            Err(e) => self.notes.push(format!("/proc/self/cgroup unreadable ({e}): no CPU quota applied")),
        }
    }

    /// `MemAvailable` of `/proc/meminfo`.
    #[cfg(target_os = "linux")]
    fn read_memory(&mut self) {
        let meminfo = sys::meminfo().map_err(|source| SchedError::Read { path: "/proc/meminfo".into(), source });
        match meminfo.and_then(|t| parse_mem_available(&t)) {
            Ok(b) => self.available_bytes = Some(b),
            Err(e) => self.notes.push(format!("{e}: no memory counted past the reserve")),
        }
    }

    /// The job object's hard CPU rate cap, as a quota.
    #[cfg(windows)]
    fn read_quota(&mut self) {
        match sys::cpu_quota() {
            Ok(q) => self.quota = q.map(|(quota_us, period_us)| CpuQuota { quota_us, period_us }),
            Err(e) => self.notes.push(format!("job CPU rate unreadable ({e}): no CPU quota applied")),
        }
    }

    /// The available physical memory (`GlobalMemoryStatusEx`).
    #[cfg(windows)]
    fn read_memory(&mut self) {
        match sys::mem_available() {
            Ok(b) => self.available_bytes = Some(b),
            Err(e) => self.notes.push(format!("available memory unreadable ({e}): no memory counted past the reserve")),
        }
    }

    /// The usable processors (1 where the affinity count is unknown).
    pub fn usable_cpus(&self) -> usize {
        usable_cpus(self.affinity_cpus.unwrap_or(1), self.quota)
    }

    /// The worker count on this machine, logged in one line with why.
    pub fn prepare_workers(&self, allocator: Allocator) -> Workers {
        let mut w = prepare_workers(self.usable_cpus(), self.available_bytes.unwrap_or(0), allocator);
        let affinity = self.affinity_cpus.map_or("unknown".to_string(), |n| n.to_string());
        let quota = self.quota.map_or("none".to_string(), |q| format!("{}/{} µs", q.quota_us, q.period_us));
        w.why = format!("{} [affinity {affinity} CPUs, {} {quota}{}]", w.why, source::QUOTA, memory_source());
        for n in &self.notes {
            w.why.push_str("; ");
            w.why.push_str(n);
        }
        tracing::info!("sched: prepare_workers: {}", w.why);
        w
    }
}

/// The memory's source in the reason where it is not `MemAvailable` (Linux keeps its text).
fn memory_source() -> String {
    if cfg!(target_os = "linux") { String::new() } else { format!(", memory from {}", source::MEMORY) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn locked_is_half_at_least_one() {
        for (usable, want) in [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (16, 8), (64, 32)] {
            assert_eq!(prepare_workers(usable, 64 * GIB, Allocator::Locked).count, want, "usable {usable}");
        }
    }

    #[test]
    fn locked_is_limited_to_32_too() {
        for (usable, want) in [(64, 32), (65, 32), (66, 32), (1 << 20, 32), (usize::MAX, 32), (63, 31)] {
            let w = prepare_workers(usable, 64 * GIB, Allocator::Locked);
            assert_eq!(w.count, want, "usable {usable}");
            assert_eq!(w.why.contains("limited to 32"), usable / 2 > 32, "{}", w.why);
        }
    }

    #[test]
    fn nothing_added_below_the_reserve() {
        for avail in [0, GIB, 4 * GIB - 1, 4 * GIB, 4 * GIB + 768 * MIB - 1] {
            assert_eq!(prepare_workers(16, avail, Allocator::Scales).count, 8, "available {avail:#x}");
        }
    }

    #[test]
    fn one_per_768_mib_past_the_reserve() {
        assert_eq!(prepare_workers(16, 4 * GIB + 768 * MIB, Allocator::Scales).count, 9);
        assert_eq!(prepare_workers(16, 4 * GIB + 2 * 768 * MIB - 1, Allocator::Scales).count, 9);
        assert_eq!(prepare_workers(16, 4 * GIB + 2 * 768 * MIB, Allocator::Scales).count, 10);
        assert_eq!(prepare_workers(16, 4 * GIB + 7 * 768 * MIB, Allocator::Scales).count, 15);
    }

    #[test]
    fn limited_by_usable_and_32() {
        let w = prepare_workers(16, 4 * GIB + 8 * 768 * MIB, Allocator::Scales);
        assert_eq!(w.count, 16);
        assert_eq!(prepare_workers(16, 1 << 40, Allocator::Scales).count, 16);
        let w = prepare_workers(12, 1 << 40, Allocator::Scales);
        assert_eq!(w.count, 12);
        assert!(w.why.contains("limited to the 12 usable CPUs"), "{}", w.why);
        let w = prepare_workers(48, 1 << 40, Allocator::Scales);
        assert_eq!(w.count, 32);
        assert!(w.why.contains("limited to 32"), "{}", w.why);
        assert_eq!(prepare_workers(1, 1 << 40, Allocator::Scales).count, 1);
        // Exactly at 32: not limited.
        assert_eq!(prepare_workers(64, 4 * GIB, Allocator::Scales).count, 32);
        assert_eq!(prepare_workers(40, 4 * GIB + 12 * 768 * MIB, Allocator::Scales).count, 32);
        assert_eq!(prepare_workers(40, 4 * GIB + 11 * 768 * MIB, Allocator::Scales).count, 31);
    }

    #[test]
    fn cpu_max_parsing() {
        assert_eq!(parse_cpu_max("max 100000\n").unwrap(), None);
        let q = parse_cpu_max("150000 100000\n").unwrap().unwrap();
        assert_eq!(q, CpuQuota { quota_us: 150000, period_us: 100000 });
        assert_eq!(q.cpus(), 2);
        assert_eq!(parse_cpu_max("200000 100000").unwrap().unwrap().cpus(), 2);
        assert_eq!(parse_cpu_max("50000 100000").unwrap().unwrap().cpus(), 1);
        for bad in [
            "",
            "\n",
            "max",
            "100000",
            "abc 100000",
            "100000 abc",
            "-1 100000",
            "100000 0",
            "max 0",
            "0 100000",
            "1 2 3",
        ] {
            assert!(matches!(parse_cpu_max(bad), Err(SchedError::BadCpuMax { .. })), "{bad:?} must be refused");
        }
    }

    #[test]
    fn usable_is_affinity_limited_by_quota() {
        let q = |quota_us| Some(CpuQuota { quota_us, period_us: 100000 });
        assert_eq!(usable_cpus(16, None), 16);
        assert_eq!(usable_cpus(16, q(150000)), 2);
        assert_eq!(usable_cpus(2, q(800000)), 2);
        assert_eq!(usable_cpus(16, q(1000)), 1);
        assert_eq!(usable_cpus(0, None), 1);
    }

    #[test]
    fn mem_available_parsing() {
        let text = "MemTotal:       16384000 kB\nMemFree:  100 kB\nMemAvailable:   12345678 kB\nBuffers: 1 kB\n";
        assert_eq!(parse_mem_available(text).unwrap(), 12345678 * 1024);
        assert!(matches!(parse_mem_available("MemTotal: 1 kB\n"), Err(SchedError::NoMemAvailable)));
        assert!(matches!(parse_mem_available(""), Err(SchedError::NoMemAvailable)));
        for bad in ["MemAvailable: x kB", "MemAvailable: 12", "MemAvailable: 12 MB", "MemAvailable: -3 kB"] {
            assert!(matches!(parse_mem_available(bad), Err(SchedError::BadMemAvailable { .. })), "{bad:?}");
        }
    }

    #[test]
    fn this_machine_reads() {
        let m = Machine::read();
        assert!(m.affinity_cpus.is_some_and(|n| n >= 1), "{m:?}");
        assert!(m.available_bytes.is_some(), "{m:?}");
        let w = m.prepare_workers(Allocator::Locked);
        assert_eq!(w.count, (m.usable_cpus() / 2).max(1));
        // The reason names this platform's sources.
        #[cfg(windows)]
        {
            assert!(
                w.why.contains("job CPU rate cap") && w.why.contains("memory from GlobalMemoryStatusEx"),
                "{}",
                w.why
            );
            assert!(!w.why.contains("cgroup"), "{}", w.why);
        }
        #[cfg(target_os = "linux")]
        assert!(w.why.contains("cgroup quota"), "{}", w.why);
    }
}
