//! Sleeping, yielding and what the machine gives a process to run on, on Windows.
//!
//! The clock is the performance counter (`QueryPerformanceCounter`, scaled by its frequency). A
//! timer wait is a waitable timer made once per thread with `CREATE_WAITABLE_TIMER_HIGH_RESOLUTION`
//! (Windows 10 1803 and later; it does not depend on `timeBeginPeriod`), set relative to now
//! (`SetWaitableTimer` with a negative due time in 100 ns units, which a change of the wall clock
//! does not move) and waited on (`WaitForSingleObject`). Where the system refuses the flag
//! (`ERROR_INVALID_PARAMETER` before 1803) the thread's timer is a plain one, which wakes on the
//! system's timer tick (15.6 ms unless some process asked for a finer one). A wait returns only
//! at or after its deadline on [`monotonic_ns`]: the timer runs on the interrupt clock, and a wake
//! a little early is waited again.
//!
//! A yield is `SwitchToThread`: it gives the rest of the time slice to a thread ready on the same
//! processor, and returns at once where there is none, so a loop of them is exact and keeps a
//! processor busy.
//!
//! The processors a process may use: its affinity mask (`GetProcessAffinityMask`), and the CPU
//! rate cap of the job it runs in (`QueryInformationJobObject`). Free memory is
//! `GlobalMemoryStatusEx`'s available physical memory. Linux's timer slack, `/proc/meminfo` and
//! cgroup files have no twin here.

use std::cell::OnceCell;
use std::ffi::c_void;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use windows_sys::Win32::Foundation::{
    CloseHandle, ERROR_INVALID_PARAMETER, FILETIME, GetLastError, HANDLE, WAIT_OBJECT_0,
};
use windows_sys::Win32::System::JobObjects::{
    IsProcessInJob, JOB_OBJECT_CPU_RATE_CONTROL_ENABLE, JOB_OBJECT_CPU_RATE_CONTROL_HARD_CAP,
    JOB_OBJECT_CPU_RATE_CONTROL_MIN_MAX_RATE, JOBOBJECT_CPU_RATE_CONTROL_INFORMATION,
    JobObjectCpuRateControlInformation, QueryInformationJobObject,
};
use windows_sys::Win32::System::Performance::{QueryPerformanceCounter, QueryPerformanceFrequency};
use windows_sys::Win32::System::SystemInformation::{GlobalMemoryStatusEx, MEMORYSTATUSEX};
use windows_sys::Win32::System::Threading::{
    ALL_PROCESSOR_GROUPS, CREATE_WAITABLE_TIMER_HIGH_RESOLUTION, CreateWaitableTimerExW, GetActiveProcessorCount,
    GetCurrentProcess, GetCurrentThread, GetProcessAffinityMask, GetThreadTimes, INFINITE, SetThreadAffinityMask,
    SetWaitableTimer, SwitchToThread, TIMER_ALL_ACCESS, WaitForSingleObject,
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
    /// Made by the first timer wait of the thread; the error code where neither kind of timer
    /// could be made (every later wait of the thread then fails the same way).
    static TIMER: OnceCell<Result<Timer, i32>> = const { OnceCell::new() };
}

/// A waitable timer: high-resolution where the system has it, else a plain one.
fn make_timer() -> Result<Timer, i32> {
    timer_with(|flags| {
        // SAFETY: no name, no security attributes; the handle returned is ours.
        let h = unsafe { CreateWaitableTimerExW(std::ptr::null(), std::ptr::null(), flags, TIMER_ALL_ACCESS) };
        // SAFETY: reads this thread's last error.
        if h.is_null() { Err(unsafe { GetLastError() }) } else { Ok(Timer(h)) }
    })
}

/// `create(CREATE_WAITABLE_TIMER_HIGH_RESOLUTION)`, and `create(0)` where the flag is refused
/// with `ERROR_INVALID_PARAMETER` (Windows before 10 1803).
fn timer_with(create: impl Fn(u32) -> Result<Timer, u32>) -> Result<Timer, i32> {
    match create(CREATE_WAITABLE_TIMER_HIGH_RESOLUTION) {
        Err(ERROR_INVALID_PARAMETER) => create(0),
        r => r,
    }
    .map_err(|e| e as i32)
}

/// Sleeps until `deadline_ns` on [`monotonic_ns`]'s clock, on this thread's waitable timer;
/// returns at or after the deadline, at once where it is past. Fails only where no timer could be
/// made or set (then it returns early, and the caller yields out the rest).
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
                    Err(code) => return Err(io::Error::from_raw_os_error(*code)),
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
        return Err(io::Error::other("GetProcessAffinityMask: empty mask (threads in several processor groups)"));
    }
    Ok(process)
}

/// Logical processors in this process's affinity mask (`GetProcessAffinityMask`, counted).
///
/// Limit: the mask is one processor group's (at most 64 processors). On a machine with more than
/// one group (more than 64 logical processors, or groups an administrator made) this counts the
/// process's primary group only, a lower bound; where the process's threads run in several groups
/// the mask is empty and this fails.
pub fn affinity_cpus() -> io::Result<usize> {
    Ok(process_mask()?.count_ones() as usize)
}

/// Restricts the calling thread to the first `n` processors of the process's affinity mask
/// (`SetThreadAffinityMask`); returns how many it now has. `n` = 0 fails as the system refuses an
/// empty mask.
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
    fn a_refused_high_resolution_flag_falls_back_to_a_plain_timer() {
        use std::cell::RefCell;
        let asked = RefCell::new(Vec::new());
        let plain = timer_with(|flags| {
            asked.borrow_mut().push(flags);
            if flags == CREATE_WAITABLE_TIMER_HIGH_RESOLUTION {
                Err(ERROR_INVALID_PARAMETER)
            } else {
                Ok(make_timer().unwrap())
            }
        });
        assert!(plain.is_ok());
        assert_eq!(*asked.borrow(), [CREATE_WAITABLE_TIMER_HIGH_RESOLUTION, 0]);
        asked.borrow_mut().clear();
        // Any other refusal is the answer.
        let denied = timer_with(|flags| {
            asked.borrow_mut().push(flags);
            Err(5)
        });
        assert_eq!(denied.err(), Some(5));
        assert_eq!(*asked.borrow(), [CREATE_WAITABLE_TIMER_HIGH_RESOLUTION]);
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

    /// Set: the test binary was started by `the_job_cap_is_read_where_the_system_has_one`.
    const JOB_CHILD_VAR: &str = "EMUHOST_TEST_JOB_CHILD";

    /// Run in a child (a process cannot leave its job): puts itself in a new job with a 50 % hard
    /// cap where the system takes one (Windows; Wine refuses it with error 87) and reads it back.
    #[test]
    fn child_in_a_job() {
        use windows_sys::Win32::System::JobObjects::{
            AssignProcessToJobObject, CreateJobObjectW, JOBOBJECT_CPU_RATE_CONTROL_INFORMATION_0,
            SetInformationJobObject,
        };
        if std::env::var_os(JOB_CHILD_VAR).is_none() {
            return;
        }
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
        if std::env::var_os(JOB_CHILD_VAR).is_some() {
            return;
        }
        let name = module_path!().split_once("::").map_or("", |m| m.1).to_string() + "::child_in_a_job";
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name.as_str(), "--exact", "--test-threads=1"])
            .env(JOB_CHILD_VAR, "1")
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "{status:?}");
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
