//! Sleeping, yielding and what the machine gives a process to run on, on Windows.
//!
//! The clock is the performance counter (`QueryPerformanceCounter`, scaled by its frequency). A
//! timer wait is a waitable timer made once per thread with `CREATE_WAITABLE_TIMER_HIGH_RESOLUTION`
//! (Windows 10 1803 and later; it does not depend on `timeBeginPeriod`), set relative to now
//! (`SetWaitableTimer` with a negative due time in 100 ns units, which a change of the wall clock
//! does not move) and waited on (`WaitForSingleObject`). Where the system refuses the flag (before
//! 1803) there is no timer here: no plain timer is made in its place (it wakes on the system's
//! tick, 15.6 ms, far past any short sleep's deadline). [`timer_missing`] says so once per process
//! and why, the sleeps' rule then yields (`SwitchToThread` until the deadline, the reference's
//! fallback), and a timer wait fails with the refusal. A wait returns only at or after its
//! deadline on [`monotonic_ns`]: the timer runs on the interrupt clock, and a wake a little early
//! is waited again.
//!
//! A yield is `SwitchToThread`: it gives the rest of the time slice to a thread ready on the same
//! processor, and returns at once where there is none, so a loop of them is exact and keeps a
//! processor busy.
//!
//! The processors a process may use ([`affinity_cpus`]): with one processor group, its affinity
//! mask (`GetProcessAffinityMask`); with several, what its groups (`GetProcessGroupAffinity`) and
//! its default CPU sets (`GetProcessDefaultCpuSets`, over `GetSystemCpuSetInformation`'s list)
//! allow, since the mask is then one group's; the count is a pure function of those values
//! ([`count_cpus`]). The CPU rate cap of the job it runs in (`QueryInformationJobObject`) limits
//! the workers. Free memory is `GlobalMemoryStatusEx`'s available physical memory. Linux's timer
//! slack, `/proc/meminfo` and cgroup files have no twin here.

use std::cell::OnceCell;
use std::ffi::c_void;
use std::io;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use windows_sys::Win32::Foundation::{
    CloseHandle, ERROR_INSUFFICIENT_BUFFER, ERROR_INVALID_PARAMETER, FILETIME, GetLastError, HANDLE, WAIT_OBJECT_0,
};
use windows_sys::Win32::System::JobObjects::{
    IsProcessInJob, JOB_OBJECT_CPU_RATE_CONTROL_ENABLE, JOB_OBJECT_CPU_RATE_CONTROL_HARD_CAP,
    JOB_OBJECT_CPU_RATE_CONTROL_MIN_MAX_RATE, JOBOBJECT_CPU_RATE_CONTROL_INFORMATION,
    JobObjectCpuRateControlInformation, QueryInformationJobObject,
};
use windows_sys::Win32::System::LibraryLoader::{GetModuleHandleW, GetProcAddress};
use windows_sys::Win32::System::Performance::{QueryPerformanceCounter, QueryPerformanceFrequency};
use windows_sys::Win32::System::SystemInformation::{
    CpuSetInformation, GetSystemCpuSetInformation, GlobalMemoryStatusEx, MEMORYSTATUSEX, SYSTEM_CPU_SET_INFORMATION,
};
use windows_sys::Win32::System::Threading::{
    ALL_PROCESSOR_GROUPS, CREATE_WAITABLE_TIMER_HIGH_RESOLUTION, CreateWaitableTimerExW, GetActiveProcessorCount,
    GetActiveProcessorGroupCount, GetCurrentProcess, GetCurrentThread, GetProcessAffinityMask, GetProcessGroupAffinity,
    GetThreadTimes, INFINITE, SetThreadAffinityMask, SetWaitableTimer, SwitchToThread, TIMER_ALL_ACCESS,
    WaitForSingleObject,
};

/// The performance counter's ticks a second, read once (fixed at boot); 0 until read.
static QPC_FREQ: AtomicU64 = AtomicU64::new(0);

fn qpc_freq() -> u64 {
    let f = QPC_FREQ.load(Ordering::Relaxed);
    if f != 0 {
        return f;
    }
    let mut f = 0i64;
    // SAFETY: `f` is a valid out pointer. The call cannot fail on Windows XP and later.
    unsafe { QueryPerformanceFrequency(&mut f) };
    // 1 keeps the division below defined should the call ever report nothing.
    let f = (f as u64).max(1);
    QPC_FREQ.store(f, Ordering::Relaxed);
    f
}

/// Nanoseconds on the monotonic clock (`QueryPerformanceCounter`, scaled exactly by its frequency
/// in 128-bit arithmetic, so no tick count overflows the product).
pub fn monotonic_ns() -> u64 {
    let mut t = 0i64;
    // SAFETY: `t` is a valid out pointer. The call cannot fail on Windows XP and later.
    unsafe { QueryPerformanceCounter(&mut t) };
    ticks_ns(t, qpc_freq())
}

/// `ticks` of a counter of `freq` ticks a second, in nanoseconds (saturating).
fn ticks_ns(ticks: i64, freq: u64) -> u64 {
    let ns = (ticks.max(0) as u128) * 1_000_000_000 / freq.max(1) as u128;
    ns.min(u64::MAX as u128) as u64
}

fn filetime_100ns(t: FILETIME) -> u64 {
    (u64::from(t.dwHighDateTime) << 32) | u64::from(t.dwLowDateTime)
}

/// CPU time this thread has used, kernel plus user (`GetThreadTimes`). Windows counts it by the
/// clock tick in which the thread ran, so it moves in steps (15.6 ms by default on Windows;
/// 10 ms steps under Wine); a short measurement reads 0.
pub fn thread_cpu_time() -> Duration {
    let zero = FILETIME { dwLowDateTime: 0, dwHighDateTime: 0 };
    let (mut created, mut exited, mut kernel, mut user) = (zero, zero, zero, zero);
    // SAFETY: GetCurrentThread's pseudo handle is always valid for its own thread; the four out
    // pointers are valid FILETIMEs.
    let ok = unsafe { GetThreadTimes(GetCurrentThread(), &mut created, &mut exited, &mut kernel, &mut user) };
    if ok == 0 {
        return Duration::ZERO;
    }
    let ticks = filetime_100ns(kernel).saturating_add(filetime_100ns(user));
    Duration::from_nanos(ticks.saturating_mul(100))
}

/// Gives up the processor to any thread ready on it (`SwitchToThread`).
pub fn yield_now() {
    // SAFETY: no preconditions; the result (whether another thread ran) is not needed.
    unsafe { SwitchToThread() };
}

/// This thread's waitable timer, closed when the thread ends.
struct Timer(HANDLE);

impl Drop for Timer {
    fn drop(&mut self) {
        // SAFETY: a handle this thread created and owns; nothing uses it after the thread ends.
        unsafe { CloseHandle(self.0) };
    }
}

thread_local! {
    /// Made by the first timer wait of the thread; the error code where the timer could not be
    /// made (every later wait of the thread then fails the same way).
    static TIMER: OnceCell<Result<Timer, i32>> = const { OnceCell::new() };
}

/// A high-resolution waitable timer.
fn make_timer() -> Result<Timer, i32> {
    timer_with(|flags| {
        // SAFETY: no name, no security attributes; the handle returned is ours.
        let h = unsafe { CreateWaitableTimerExW(std::ptr::null(), std::ptr::null(), flags, TIMER_ALL_ACCESS) };
        // SAFETY: reads this thread's last error.
        if h.is_null() { Err(unsafe { GetLastError() }) } else { Ok(Timer(h)) }
    })
}

/// `create(CREATE_WAITABLE_TIMER_HIGH_RESOLUTION)`, and nothing else: where the flag is refused
/// (`ERROR_INVALID_PARAMETER` before Windows 10 1803) the refusal is the answer, and the caller
/// yields (a plain timer would wake on the 15.6 ms tick).
fn timer_with(create: impl Fn(u32) -> Result<Timer, u32>) -> Result<Timer, i32> {
    create(CREATE_WAITABLE_TIMER_HIGH_RESOLUTION).map_err(|e| e as i32)
}

/// Why this process has no high-resolution timer, in words (`None`: it has one). Found once per
/// process by making one (and closing it): the flag's refusal is the system's, not a thread's.
pub fn timer_missing() -> Option<String> {
    static MISSING: OnceLock<Option<String>> = OnceLock::new();
    MISSING.get_or_init(|| make_timer().err().map(missing_why)).clone()
}

/// The refusal `code` of a high-resolution timer, in words.
fn missing_why(code: i32) -> String {
    let before = if code == ERROR_INVALID_PARAMETER as i32 { " (Windows before 10 1803 refuses the flag)" } else { "" };
    format!(
        "CreateWaitableTimerExW(CREATE_WAITABLE_TIMER_HIGH_RESOLUTION) failed: {}{before}",
        io::Error::from_raw_os_error(code)
    )
}

/// Sleeps until `deadline_ns` on [`monotonic_ns`]'s clock, on this thread's waitable timer;
/// returns at or after the deadline, at once where it is past. Fails only where no high-resolution
/// timer could be made or set (then it returns early, and the caller yields out the rest).
pub fn timer_wait_until(deadline_ns: u64) -> io::Result<()> {
    TIMER.with(|cell| {
        let mut timer = None;
        loop {
            let now = monotonic_ns();
            if now >= deadline_ns {
                return Ok(());
            }
            let h = match timer {
                Some(h) => h,
                None => match cell.get_or_init(make_timer) {
                    Ok(t) => *timer.insert(t.0),
                    Err(code) => return Err(io::Error::other(missing_why(*code))),
                },
            };
            // Relative due time in 100 ns units, rounded up; negative means relative.
            let due = -(((deadline_ns - now).div_ceil(100)).min(i64::MAX as u64) as i64);
            // SAFETY: `h` is this thread's timer, open for the thread's life; `due` is a valid
            // pointer; no completion routine.
            if unsafe { SetWaitableTimer(h, &due, 0, None, std::ptr::null::<c_void>(), 0) } == 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: as above: a valid handle of ours.
            if unsafe { WaitForSingleObject(h, INFINITE) } != WAIT_OBJECT_0 {
                return Err(io::Error::last_os_error());
            }
        }
    })
}

/// The process's affinity mask and the system's (`GetProcessAffinityMask`).
fn process_mask() -> io::Result<usize> {
    let (mut process, mut system) = (0usize, 0usize);
    // SAFETY: GetCurrentProcess's pseudo handle is always valid; two valid out pointers.
    if unsafe { GetProcessAffinityMask(GetCurrentProcess(), &mut process, &mut system) } == 0 {
        return Err(io::Error::last_os_error());
    }
    if process == 0 {
        // Documented: a process whose threads run in several processor groups gets empty masks.
        return Err(io::Error::other("GetProcessAffinityMask: an empty mask (threads in several processor groups)"));
    }
    Ok(process)
}

/// One logical processor as `GetSystemCpuSetInformation` lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CpuSet {
    pub id: u32,
    pub group: u16,
    /// Its bit in its group's affinity masks.
    pub index: u8,
}

/// What the system says about the processors this process may use, as read ([`cpu_facts`]);
/// [`count_cpus`] counts them. Each `Err` holds why that value is not known.
#[derive(Clone, Debug)]
pub(crate) struct CpuFacts {
    /// Active processor groups (`GetActiveProcessorGroupCount`; 0 where it failed).
    pub active_groups: u16,
    /// The process's affinity mask (`GetProcessAffinityMask`): one group's, the primary one.
    pub mask: Result<usize, String>,
    /// The groups the process's threads may run in (`GetProcessGroupAffinity`).
    pub groups: Result<Vec<u16>, String>,
    /// The process's default CPU sets' ids (`GetProcessDefaultCpuSets`); empty: none set.
    pub default_sets: Result<Vec<u32>, String>,
    /// Every logical processor's CPU set (`GetSystemCpuSetInformation`).
    pub system_sets: Result<Vec<CpuSet>, String>,
}

/// The logical processors this process may use, or why that is not known.
///
/// One active group: the affinity mask's processors (it is the whole process's). More than one:
/// the mask is one group's (and a process whose threads run in several groups, the default from
/// Windows 11, may use them all), so the count is the system's CPU sets that lie in the process's
/// groups (and in its mask where it has exactly one group), limited to its default CPU sets where
/// it has any. Unknown where a value it needs could not be read or nothing is left.
pub(crate) fn count_cpus(f: &CpuFacts) -> Result<usize, String> {
    match f.active_groups {
        0 => return Err("GetActiveProcessorGroupCount failed".to_string()),
        1 => return f.mask.as_ref().map(|m| m.count_ones() as usize).map_err(Clone::clone),
        _ => {}
    }
    let unknown = |what: &str| format!("{} processor groups, and {what}", f.active_groups);
    let groups = f.groups.as_ref().map_err(|e| unknown(e))?;
    let sets = f.system_sets.as_ref().map_err(|e| unknown(e))?;
    let defaults = f.default_sets.as_ref().map_err(|e| unknown(e))?;
    let mask = match groups.as_slice() {
        [_] => Some(*f.mask.as_ref().map_err(|e| unknown(e))?),
        _ => None,
    };
    let n = sets
        .iter()
        .filter(|s| groups.contains(&s.group))
        .filter(|s| mask.is_none_or(|m| u32::from(s.index) < usize::BITS && m & (1 << s.index) != 0))
        .filter(|s| defaults.is_empty() || defaults.contains(&s.id))
        .count();
    if n == 0 {
        return Err(unknown("no CPU set lies in the process's groups, mask and default CPU sets"));
    }
    Ok(n)
}

/// The groups the process may run in (`GetProcessGroupAffinity`).
fn process_groups(active: u16) -> Result<Vec<u16>, String> {
    let mut groups = vec![0u16; usize::from(active.max(1))];
    for _ in 0..2 {
        let mut n = groups.len() as u16;
        // SAFETY: the current process's pseudo handle; `groups` has room for `n` entries.
        if unsafe { GetProcessGroupAffinity(GetCurrentProcess(), &mut n, groups.as_mut_ptr()) } != 0 {
            groups.truncate(usize::from(n));
            return Ok(groups);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(ERROR_INSUFFICIENT_BUFFER as i32) {
            return Err(format!("GetProcessGroupAffinity failed: {e}"));
        }
        groups = vec![0; usize::from(n.max(1))];
    }
    Err("GetProcessGroupAffinity: the group count kept growing".to_string())
}

/// `GetProcessDefaultCpuSets` (kernel32, Windows 10 and later).
type GetProcessDefaultCpuSetsFn = unsafe extern "system" fn(HANDLE, *mut u32, u32, *mut u32) -> i32;

/// kernel32's `GetProcessDefaultCpuSets`, looked up at run time: Wine 8 does not have it (a
/// static import would end the process at the first call).
fn get_process_default_cpu_sets() -> Option<GetProcessDefaultCpuSetsFn> {
    let kernel32: Vec<u16> = "kernel32.dll\0".encode_utf16().collect();
    // SAFETY: a NUL-terminated wide name; kernel32 is loaded in every process and never unloaded,
    // so the module handle (not counted) stays valid.
    let module = unsafe { GetModuleHandleW(kernel32.as_ptr()) };
    if module.is_null() {
        return None;
    }
    // SAFETY: a valid module handle and a NUL-terminated name.
    let f = unsafe { GetProcAddress(module, c"GetProcessDefaultCpuSets".as_ptr().cast()) }?;
    // SAFETY: kernel32's GetProcessDefaultCpuSets has this signature (processthreadsapi.h).
    Some(unsafe { std::mem::transmute::<unsafe extern "system" fn() -> isize, GetProcessDefaultCpuSetsFn>(f) })
}

/// The process's default CPU sets' ids (`GetProcessDefaultCpuSets`); empty where none are set,
/// and where the system has no such call (it has no CPU sets then).
fn default_cpu_sets() -> Result<Vec<u32>, String> {
    let Some(get) = get_process_default_cpu_sets() else { return Ok(Vec::new()) };
    let mut ids: Vec<u32> = Vec::new();
    for _ in 0..2 {
        let mut required = 0u32;
        // SAFETY: the current process's pseudo handle; `ids` has room for the count passed (none
        // where it is empty: the call then only reports how many there are).
        let ok = unsafe { get(GetCurrentProcess(), ids.as_mut_ptr(), ids.len() as u32, &mut required) };
        if ok != 0 {
            ids.truncate(required as usize);
            return Ok(ids);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(ERROR_INSUFFICIENT_BUFFER as i32) {
            return Err(format!("GetProcessDefaultCpuSets failed: {e}"));
        }
        ids = vec![0; required as usize];
    }
    Err("GetProcessDefaultCpuSets: the count kept growing".to_string())
}

/// Every logical processor's CPU set (`GetSystemCpuSetInformation`, the whole system's list).
fn system_cpu_sets() -> Result<Vec<CpuSet>, String> {
    let mut buf: Vec<u64> = Vec::new();
    for _ in 0..2 {
        let mut len = 0u32;
        // SAFETY: `buf` is 8-byte aligned (the records' alignment) with room for the bytes passed;
        // no process filter (a null handle).
        let ok = unsafe {
            GetSystemCpuSetInformation(
                buf.as_mut_ptr().cast(),
                (buf.len() * 8) as u32,
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        if ok != 0 {
            return Ok(cpu_set_records(&buf, len as usize));
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(ERROR_INSUFFICIENT_BUFFER as i32) {
            return Err(format!("GetSystemCpuSetInformation failed: {e}"));
        }
        buf = vec![0; (len as usize).div_ceil(8)];
    }
    Err("GetSystemCpuSetInformation: the list kept growing".to_string())
}

/// The CPU-set records in the first `len` bytes of `buf`, each `Size` bytes long.
fn cpu_set_records(buf: &[u64], len: usize) -> Vec<CpuSet> {
    let base = buf.as_ptr().cast::<u8>();
    let len = len.min(buf.len() * 8);
    let head = size_of::<SYSTEM_CPU_SET_INFORMATION>();
    let mut out = Vec::new();
    let mut at = 0;
    while at + head <= len {
        // SAFETY: `at + head` bytes lie in `buf`; the record may sit at any offset the previous
        // sizes made, so it is read unaligned.
        let r = unsafe { base.add(at).cast::<SYSTEM_CPU_SET_INFORMATION>().read_unaligned() };
        if r.Type == CpuSetInformation {
            // SAFETY: the member `Type` names.
            let c = unsafe { r.Anonymous.CpuSet };
            out.push(CpuSet { id: c.Id, group: c.Group, index: c.LogicalProcessorIndex });
        }
        if r.Size == 0 {
            break;
        }
        at += r.Size as usize;
    }
    out
}

/// Reads everything [`count_cpus`] looks at (every value, whatever the group count, so each call
/// runs on every machine).
pub(crate) fn cpu_facts() -> CpuFacts {
    // SAFETY: no preconditions.
    let active_groups = unsafe { GetActiveProcessorGroupCount() };
    CpuFacts {
        active_groups,
        mask: process_mask().map_err(|e| e.to_string()),
        groups: process_groups(active_groups),
        default_sets: default_cpu_sets(),
        system_sets: system_cpu_sets(),
    }
}

/// Logical processors this process may use ([`count_cpus`] over [`cpu_facts`]); an error saying
/// why where the count is unknown.
pub fn affinity_cpus() -> io::Result<usize> {
    count_cpus(&cpu_facts()).map_err(io::Error::other)
}

/// Restricts the calling thread to the first `n` processors of the process's affinity mask
/// (`SetThreadAffinityMask`); returns how many it now has. `n` = 0 fails as the system refuses an
/// empty mask. Unlike Linux, a thread this one starts afterwards does not inherit the mask (a new
/// thread gets the process's): each thread restricts itself.
pub fn restrict_thread_cpus(n: usize) -> io::Result<usize> {
    let mask = process_mask()?;
    let mut new = 0usize;
    let mut taken = 0;
    for cpu in 0..usize::BITS {
        if taken == n {
            break;
        }
        if mask & (1 << cpu) != 0 {
            new |= 1 << cpu;
            taken += 1;
        }
    }
    // SAFETY: GetCurrentThread's pseudo handle is always valid; the mask is a subset of the
    // process's (or empty, which the call refuses).
    if unsafe { SetThreadAffinityMask(GetCurrentThread(), new) } == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(taken)
}

/// Physical memory available now, in bytes (`GlobalMemoryStatusEx`'s `ullAvailPhys`: free, zeroed
/// and standby pages, Linux's `MemAvailable` in spirit).
pub fn mem_available() -> io::Result<u64> {
    let mut m = MEMORYSTATUSEX { dwLength: size_of::<MEMORYSTATUSEX>() as u32, ..Default::default() };
    // SAFETY: `m` is a valid MEMORYSTATUSEX with its length set, as the call requires.
    if unsafe { GlobalMemoryStatusEx(&mut m) } == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(m.ullAvailPhys)
}

/// The period a job's CPU rate is expressed over here (as a cgroup's default `cpu.max` period).
const QUOTA_PERIOD_US: u64 = 100_000;

/// The CPU cap of the job this process runs in, as `(quota_us, period_us)` over all the
/// machine's processors (a cgroup's `cpu.max`: `quota_us / period_us` processors' worth). A job's
/// rate is in 1/100 % of the whole machine's processor cycles (`CpuRate`, or `MaxRate` with
/// `MIN_MAX_RATE`); only a hard cap limits: a weight-based rate (or none) is `None`, and so is no
/// job. The job is the innermost one (`QueryInformationJobObject(NULL, ..)`); the caps of jobs
/// around it are not read.
pub fn cpu_quota() -> io::Result<Option<(u64, u64)>> {
    let mut in_job = 0;
    // SAFETY: GetCurrentProcess's pseudo handle is valid; a null job asks about any job; a valid
    // out pointer.
    if unsafe { IsProcessInJob(GetCurrentProcess(), std::ptr::null_mut(), &mut in_job) } == 0 {
        return Err(io::Error::last_os_error());
    }
    if in_job == 0 {
        return Ok(None);
    }
    let mut info = JOBOBJECT_CPU_RATE_CONTROL_INFORMATION::default();
    let mut returned = 0u32;
    // SAFETY: a null job handle means this process's job; `info` is a valid buffer of the size
    // passed; `returned` a valid out pointer.
    let ok = unsafe {
        QueryInformationJobObject(
            std::ptr::null_mut(),
            JobObjectCpuRateControlInformation,
            (&raw mut info).cast(),
            size_of::<JOBOBJECT_CPU_RATE_CONTROL_INFORMATION>() as u32,
            &mut returned,
        )
    };
    if ok == 0 {
        let e = io::Error::last_os_error();
        // Wine (8.0 and 10.0) implements no CPU rate control: the query fails with
        // ERROR_INVALID_PARAMETER, and there is no cap to honour.
        if e.raw_os_error() == Some(ERROR_INVALID_PARAMETER as i32) {
            return Ok(None);
        }
        return Err(e);
    }
    let flags = info.ControlFlags;
    if flags & JOB_OBJECT_CPU_RATE_CONTROL_ENABLE == 0 {
        return Ok(None);
    }
    // SAFETY: the union member the flags name is the one the system filled in.
    let rate = unsafe {
        if flags & JOB_OBJECT_CPU_RATE_CONTROL_MIN_MAX_RATE != 0 {
            u64::from(info.Anonymous.Anonymous.MaxRate)
        } else if flags & JOB_OBJECT_CPU_RATE_CONTROL_HARD_CAP != 0 {
            u64::from(info.Anonymous.CpuRate)
        } else {
            return Ok(None);
        }
    };
    // SAFETY: no preconditions.
    let cpus = u64::from(unsafe { GetActiveProcessorCount(ALL_PROCESSOR_GROUPS) }).max(1);
    Ok(Some(rate_quota(rate, cpus)))
}

/// A job rate (1/100 % of `cpus` processors) as `(quota_us, period_us)`; at least 1 µs.
fn rate_quota(rate: u64, cpus: u64) -> (u64, u64) {
    let quota = (rate.min(10_000) * cpus * QUOTA_PERIOD_US / 10_000).max(1);
    (quota, QUOTA_PERIOD_US)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timer_wait_reaches_its_deadline() {
        let deadline = monotonic_ns() + 2_000_000;
        timer_wait_until(deadline).unwrap();
        assert!(monotonic_ns() >= deadline);
        let deadline = monotonic_ns() + 100_000;
        timer_wait_until(deadline).unwrap();
        assert!(monotonic_ns() >= deadline);
    }

    #[test]
    fn the_thread_timer_is_made_once() {
        std::thread::spawn(|| {
            timer_wait_until(monotonic_ns() + 50_000).unwrap();
            let first = TIMER.with(|c| c.get().and_then(|t| t.as_ref().ok()).map(|t| t.0 as usize));
            timer_wait_until(monotonic_ns() + 50_000).unwrap();
            let second = TIMER.with(|c| c.get().and_then(|t| t.as_ref().ok()).map(|t| t.0 as usize));
            assert!(first.is_some());
            assert_eq!(first, second);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_monotonic_clock_moves_forward_in_nanoseconds() {
        let a = monotonic_ns();
        std::thread::sleep(Duration::from_millis(20));
        // Slept at least 20 ms (no upper bound: the machine may be loaded).
        assert!(monotonic_ns() - a >= 19_000_000);
        // Exact, and no overflow where ticks * 10^9 passes 2^64 (a 10 MHz counter after 31 min).
        assert_eq!(ticks_ns(10_000_000, 10_000_000), 1_000_000_000);
        assert_eq!(ticks_ns(3, 3_000_000_000), 1);
        assert_eq!(ticks_ns(10_000_000_000_000, 10_000_000), 1_000_000_000_000_000);
        assert_eq!(ticks_ns(i64::MAX, 3_000_000_000), 3_074_457_345_618_258_602);
        assert_eq!(ticks_ns(i64::MAX, 1), u64::MAX, "saturates");
        assert_eq!(ticks_ns(-5, 1), 0);
    }

    #[test]
    fn a_refused_high_resolution_flag_is_the_answer_and_no_plain_timer_is_made() {
        use std::cell::RefCell;
        let asked = RefCell::new(Vec::new());
        let refused = timer_with(|flags| {
            asked.borrow_mut().push(flags);
            if flags == CREATE_WAITABLE_TIMER_HIGH_RESOLUTION {
                Err(ERROR_INVALID_PARAMETER)
            } else {
                Ok(make_timer().unwrap())
            }
        });
        assert_eq!(refused.err(), Some(ERROR_INVALID_PARAMETER as i32));
        assert_eq!(
            *asked.borrow(),
            [CREATE_WAITABLE_TIMER_HIGH_RESOLUTION],
            "only the high-resolution timer is asked for"
        );
        let why = missing_why(ERROR_INVALID_PARAMETER as i32);
        assert!(why.contains("CREATE_WAITABLE_TIMER_HIGH_RESOLUTION") && why.contains("before 10 1803"), "{why}");
        assert!(!missing_why(5).contains("1803"), "another refusal is not blamed on the version");
        // This system (Windows 10 1803+, or Wine) has the timer.
        assert_eq!(timer_missing(), None);
    }

    #[test]
    fn a_past_deadline_makes_no_timer() {
        std::thread::spawn(|| {
            timer_wait_until(0).unwrap();
            timer_wait_until(monotonic_ns()).unwrap();
            assert!(TIMER.with(|c| c.get().is_none()), "no wait, no timer");
            timer_wait_until(monotonic_ns() + 50_000).unwrap();
            assert!(TIMER.with(|c| c.get().is_some_and(|t| t.is_ok())));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn thread_cpu_time_moves() {
        std::thread::spawn(|| {
            let a = thread_cpu_time();
            let mut x = 0u64;
            // Until it moves (by a 10 or 15.6 ms step), for at most a minute of wall time (a bound
            // only for a clock that never moves; no timing is asserted).
            let give_up = monotonic_ns() + 60_000_000_000;
            while thread_cpu_time() == a && monotonic_ns() < give_up {
                for i in 0..100_000u64 {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
                }
            }
            assert!(thread_cpu_time() > a);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn restrict_keeps_the_first_processors() {
        let all = affinity_cpus().unwrap();
        assert!(all >= 1);
        std::thread::spawn(move || {
            assert_eq!(restrict_thread_cpus(1).unwrap(), 1);
            // SetThreadAffinityMask returns the mask it replaces: the one set above.
            // SAFETY: the current thread's pseudo handle; the process mask is valid.
            let was = unsafe { SetThreadAffinityMask(GetCurrentThread(), process_mask().unwrap()) };
            assert_eq!(was.count_ones(), 1);
            assert_eq!(was, 1 << process_mask().unwrap().trailing_zeros(), "the first processor of the mask");
            assert_eq!(restrict_thread_cpus(usize::MAX).unwrap(), all);
            assert!(restrict_thread_cpus(0).is_err(), "an empty mask is refused");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn memory_and_quota_answer() {
        assert!(mem_available().unwrap() > 0);
        // Not in a job, or under Wine (no rate control): no cap.
        let q = cpu_quota().unwrap();
        if let Some((quota, period)) = q {
            assert!(quota >= 1 && period == QUOTA_PERIOD_US);
        }
    }

    /// Run in a child (a process cannot leave its job): puts itself in a new job with a 50 % hard
    /// cap where the system takes one (Windows; Wine refuses it with error 87) and reads it back.
    #[test]
    #[ignore = "run by the_job_cap_is_read_where_the_system_has_one in a child process"]
    fn child_in_a_job() {
        use windows_sys::Win32::System::JobObjects::{
            AssignProcessToJobObject, CreateJobObjectW, JOBOBJECT_CPU_RATE_CONTROL_INFORMATION_0,
            SetInformationJobObject,
        };
        // SAFETY: a job of our own (no name, no attributes); `info` is a valid struct of the size
        // passed; the current process's pseudo handle is valid.
        let capped = unsafe {
            let job = CreateJobObjectW(std::ptr::null(), std::ptr::null());
            assert!(!job.is_null());
            let info = JOBOBJECT_CPU_RATE_CONTROL_INFORMATION {
                ControlFlags: JOB_OBJECT_CPU_RATE_CONTROL_ENABLE | JOB_OBJECT_CPU_RATE_CONTROL_HARD_CAP,
                Anonymous: JOBOBJECT_CPU_RATE_CONTROL_INFORMATION_0 { CpuRate: 5_000 },
            };
            let capped = SetInformationJobObject(
                job,
                JobObjectCpuRateControlInformation,
                (&raw const info).cast(),
                size_of::<JOBOBJECT_CPU_RATE_CONTROL_INFORMATION>() as u32,
            ) != 0;
            assert_ne!(AssignProcessToJobObject(job, GetCurrentProcess()), 0);
            capped
        };
        // SAFETY: no preconditions.
        let cpus = u64::from(unsafe { GetActiveProcessorCount(ALL_PROCESSOR_GROUPS) });
        let want = capped.then(|| rate_quota(5_000, cpus));
        assert_eq!(cpu_quota().unwrap(), want);
    }

    #[test]
    fn the_job_cap_is_read_where_the_system_has_one() {
        let name = module_path!().split_once("::").map_or("", |m| m.1).to_string() + "::child_in_a_job";
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name.as_str(), "--exact", "--ignored", "--test-threads=1"])
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "{status:?}");
    }

    /// `n` CPU sets in each of `groups` groups, ids 256 up in order, as Windows numbers them.
    fn sets(groups: u16, n: u8) -> Vec<CpuSet> {
        (0..groups)
            .flat_map(|g| {
                (0..n).map(move |i| CpuSet { id: 256 + u32::from(g) * u32::from(n) + u32::from(i), group: g, index: i })
            })
            .collect()
    }

    fn facts(active_groups: u16, mask: usize, groups: &[u16], defaults: &[u32], system: Vec<CpuSet>) -> CpuFacts {
        CpuFacts {
            active_groups,
            mask: Ok(mask),
            groups: Ok(groups.to_vec()),
            default_sets: Ok(defaults.to_vec()),
            system_sets: Ok(system),
        }
    }

    #[test]
    fn one_group_counts_the_affinity_mask() {
        assert_eq!(count_cpus(&facts(1, 0x55, &[0], &[], sets(1, 8))), Ok(4));
        assert_eq!(count_cpus(&facts(1, 0x555, &[0], &[], sets(1, 16))), Ok(6));
        assert_eq!(count_cpus(&facts(1, usize::MAX, &[0], &[], sets(1, 64))), Ok(64));
        // Nothing else is needed with one group, so nothing else can make it unknown.
        let mut f = facts(1, 0x7f, &[0], &[], vec![]);
        (f.groups, f.default_sets, f.system_sets) = (Err("x".into()), Err("y".into()), Err("z".into()));
        assert_eq!(count_cpus(&f), Ok(7));
        f.mask = Err("GetProcessAffinityMask failed".into());
        assert_eq!(count_cpus(&f), Err("GetProcessAffinityMask failed".into()));
        f.active_groups = 0;
        assert!(count_cpus(&f).is_err());
    }

    /// The reference's trap: with several groups the mask is one group's; a process that runs in
    /// two groups of 4 may use 8 (more than 6: its short sleeps yield), not the mask's 4.
    #[test]
    fn several_groups_count_what_the_groups_and_cpu_sets_allow() {
        assert_eq!(
            count_cpus(&facts(2, 0xf, &[0, 1], &[], sets(2, 4))),
            Ok(8),
            "one group's mask taken for the process's"
        );
        assert_eq!(count_cpus(&facts(2, usize::MAX, &[0, 1], &[], sets(2, 64))), Ok(128));
        // Threads in several groups: the mask reads empty, which is not an error here.
        let mut f = facts(2, 0, &[0, 1], &[], sets(2, 4));
        f.mask = Err("GetProcessAffinityMask: an empty mask".into());
        assert_eq!(count_cpus(&f), Ok(8));
        // A process kept in one group of two: its mask there.
        assert_eq!(count_cpus(&facts(2, 0x5, &[1], &[], sets(2, 4))), Ok(2));
        assert_eq!(count_cpus(&facts(3, 0xff, &[2], &[], sets(3, 64))), Ok(8));
        // Default CPU sets limit it: 3 of group 0 and 2 of group 1 (ids 256.. and 260..).
        assert_eq!(count_cpus(&facts(2, 0xf, &[0, 1], &[256, 257, 258, 260, 263], sets(2, 4))), Ok(5));
        // A default CPU set outside the process's groups does not count.
        assert_eq!(count_cpus(&facts(3, 0xf, &[0, 1], &[257, 265], sets(3, 4))), Ok(1));
        // A group of 64 with an inactive bit past the list is not counted.
        assert_eq!(count_cpus(&facts(2, 0, &[0, 1], &[], sets(2, 64))), Ok(128));
    }

    #[test]
    fn several_groups_are_unknown_where_a_value_is() {
        let base = facts(2, 0xf, &[0, 1], &[], sets(2, 4));
        let mut f = base.clone();
        f.groups = Err("GetProcessGroupAffinity failed".into());
        let e = count_cpus(&f).unwrap_err();
        assert!(e.contains("2 processor groups") && e.contains("GetProcessGroupAffinity failed"), "{e}");
        let mut f = base.clone();
        f.system_sets = Err("GetSystemCpuSetInformation failed".into());
        assert!(count_cpus(&f).unwrap_err().contains("GetSystemCpuSetInformation"));
        let mut f = base.clone();
        f.default_sets = Err("GetProcessDefaultCpuSets failed".into());
        assert!(count_cpus(&f).unwrap_err().contains("GetProcessDefaultCpuSets"));
        // One group of two but its mask unknown: the whole group is not assumed.
        let mut f = facts(2, 0, &[1], &[], sets(2, 4));
        f.mask = Err("GetProcessAffinityMask failed".into());
        assert!(count_cpus(&f).is_err());
        // Nothing left.
        assert!(count_cpus(&facts(2, 0xf, &[0, 1], &[999], sets(2, 4))).is_err());
        assert!(count_cpus(&facts(2, 0xf, &[0, 1], &[], vec![])).is_err());
    }

    #[test]
    fn cpu_set_records_are_walked_by_their_size() {
        // Two records, the second one 8 bytes longer than the struct (a later system's), and one
        // of another type.
        let head = size_of::<SYSTEM_CPU_SET_INFORMATION>();
        let mut bytes = vec![0u8; 3 * head + 8 + 8];
        let mut put = |at: usize, size: usize, ty: i32, id: u32, group: u16, index: u8| {
            let mut r = SYSTEM_CPU_SET_INFORMATION { Size: size as u32, Type: ty, ..Default::default() };
            r.Anonymous.CpuSet.Id = id;
            r.Anonymous.CpuSet.Group = group;
            r.Anonymous.CpuSet.LogicalProcessorIndex = index;
            // SAFETY: `at + head` bytes lie in `bytes`.
            unsafe { bytes.as_mut_ptr().add(at).cast::<SYSTEM_CPU_SET_INFORMATION>().write_unaligned(r) };
        };
        put(0, head, CpuSetInformation, 256, 0, 0);
        put(head, head + 8, CpuSetInformation, 300, 1, 44);
        put(2 * head + 8, head, 7, 1, 1, 1);
        let mut buf = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: both buffers have at least `bytes.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.as_mut_ptr().cast::<u8>(), bytes.len()) };
        let got = cpu_set_records(&buf, 3 * head + 8);
        assert_eq!(got, [CpuSet { id: 256, group: 0, index: 0 }, CpuSet { id: 300, group: 1, index: 44 }]);
        assert_eq!(cpu_set_records(&buf, head - 1), []);
        assert_eq!(cpu_set_records(&buf, usize::MAX).len(), 2, "a length past the buffer is cut");
    }

    /// The real calls on this machine (one group under Wine): each value is read (or fails with an
    /// error, not a crash), and the count is the mask's.
    #[test]
    fn this_machines_processors() {
        let f = cpu_facts();
        eprintln!("{f:?}");
        assert!(f.active_groups >= 1, "{f:?}");
        // Wine 8 implements no GetProcessGroupAffinity (error 120): with one group it is not needed.
        if let Ok(groups) = &f.groups {
            assert!(!groups.is_empty(), "{f:?}");
        }
        if f.active_groups == 1 {
            assert!(f.groups.as_ref().is_err_and(|e| e.contains("failed")) || f.groups == Ok(vec![0]), "{f:?}");
            assert_eq!(affinity_cpus().unwrap(), f.mask.clone().unwrap().count_ones() as usize);
        }
        assert!(affinity_cpus().unwrap() >= 1);
        if let Ok(sets) = &f.system_sets {
            // SAFETY: no preconditions.
            let active = unsafe { GetActiveProcessorCount(ALL_PROCESSOR_GROUPS) } as usize;
            assert_eq!(sets.len(), active, "one CPU set a logical processor: {f:?}");
        }
    }

    #[test]
    fn job_rates_become_quotas() {
        // 50 % of 4 processors: 2 processors' worth.
        assert_eq!(rate_quota(5_000, 4), (200_000, 100_000));
        assert_eq!(rate_quota(10_000, 1), (100_000, 100_000));
        assert_eq!(rate_quota(1, 1), (10, 100_000));
        assert_eq!(rate_quota(0, 1), (1, 100_000), "never a zero quota");
        assert_eq!(rate_quota(20_000, 2), (200_000, 100_000), "a rate past 100 % is the whole machine");
    }
}
