//! Sleeping, yielding and what the machine gives a process to run on.
//!
//! A timer wait is `clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`: the kernel arms an hrtimer for
//! the deadline and wakes the thread when it fires, plus the thread's timer slack (50 µs by
//! default), which lets the kernel batch wake-ups. The wait lowers the slack to 1 ns
//! (`PR_SET_TIMERSLACK`; 0 would mean "the default") and puts the old value back after, so only
//! this wait is sharper. An absolute deadline means a signal that interrupts the wait (`EINTR`)
//! costs nothing: the wait is simply made again for the same deadline.
//!
//! A yield is `sched_yield`: the thread goes to the back of its run queue and runs again at once
//! if nothing else wants the CPU, so a loop of them is exact and keeps a CPU busy.
//!
//! The processors a process may use: its affinity mask (`sched_getaffinity`), limited by the
//! cgroup v2 CPU quota (`cpu.max` of its cgroup and the cgroups above it). Free memory is
//! `MemAvailable` in `/proc/meminfo`. The files are read here and parsed in `crate::sched`.

use std::io;
use std::num::NonZeroU64;
use std::path::PathBuf;
use std::time::Duration;

use rustix::thread::{ClockId, Timespec};

/// Nanoseconds on the monotonic clock (`CLOCK_MONOTONIC`).
pub fn monotonic_ns() -> u64 {
    ts_ns(rustix::time::clock_gettime(rustix::time::ClockId::Monotonic))
}

/// CPU time this thread has used (`CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu_time() -> Duration {
    Duration::from_nanos(ts_ns(rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime)))
}

fn ts_ns(t: Timespec) -> u64 {
    (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64)
}

/// Gives up the CPU to any thread waiting for it (`sched_yield`).
pub fn yield_now() {
    rustix::thread::sched_yield();
}

/// This thread's timer slack in nanoseconds (`PR_GET_TIMERSLACK`).
pub fn timer_slack() -> io::Result<u64> {
    Ok(rustix::thread::current_timer_slack()?)
}

/// Sets this thread's timer slack (`PR_SET_TIMERSLACK`); 0 puts back the thread's default.
pub fn set_timer_slack(ns: u64) -> io::Result<()> {
    Ok(rustix::thread::set_current_timer_slack(NonZeroU64::new(ns))?)
}

/// Sleeps until `deadline_ns` on the monotonic clock, with the timer slack at 1 ns while it waits
/// (the old slack is put back after, even when the wait fails).
pub fn timer_wait_until(deadline_ns: u64) -> io::Result<()> {
    let old = timer_slack().ok();
    if old.is_some_and(|s| s > 1) {
        set_timer_slack(1)?;
    }
    let request =
        Timespec { tv_sec: (deadline_ns / 1_000_000_000) as i64, tv_nsec: (deadline_ns % 1_000_000_000) as _ };
    let result = loop {
        match rustix::thread::clock_nanosleep_absolute(ClockId::Monotonic, &request) {
            Err(rustix::io::Errno::INTR) => continue,
            r => break r,
        }
    };
    if let Some(s) = old.filter(|s| *s > 1) {
        set_timer_slack(s)?;
    }
    Ok(result?)
}

/// Why this process has no timer for short sleeps: never here (`clock_nanosleep` is always there).
pub fn timer_missing() -> Option<String> {
    None
}

/// Logical processors in this process's affinity mask (`sched_getaffinity`).
pub fn affinity_cpus() -> io::Result<usize> {
    Ok(rustix::thread::sched_getaffinity(None)?.count() as usize)
}

/// Restricts the calling thread to the first `n` processors of its affinity mask; returns how
/// many it now has.
pub fn restrict_thread_cpus(n: usize) -> io::Result<usize> {
    let mask = rustix::thread::sched_getaffinity(None)?;
    let mut new = rustix::thread::CpuSet::new();
    let mut taken = 0;
    for cpu in 0..rustix::thread::CpuSet::MAX_CPU {
        if taken == n {
            break;
        }
        if mask.is_set(cpu) {
            new.set(cpu);
            taken += 1;
        }
    }
    rustix::thread::sched_setaffinity(None, &new)?;
    Ok(taken)
}

/// The text of `/proc/meminfo`.
pub fn meminfo() -> io::Result<String> {
    std::fs::read_to_string("/proc/meminfo")
}

/// The `cpu.max` files of this process's cgroup v2 and of every cgroup above it, nearest first:
/// each as its path and its text, or the error reading it. Empty where the process is not in a
/// cgroup v2 hierarchy (no `0::` line in `/proc/self/cgroup`); a cgroup without the cpu
/// controller has no `cpu.max` and is left out.
pub fn cgroup_cpu_max() -> io::Result<Vec<(PathBuf, io::Result<String>)>> {
    let own = std::fs::read_to_string("/proc/self/cgroup")?;
    let Some(rel) = own.lines().find_map(|l| l.strip_prefix("0::")) else { return Ok(Vec::new()) };
    let root = PathBuf::from("/sys/fs/cgroup");
    let mut dir = root.join(rel.trim().trim_start_matches('/'));
    let mut out = Vec::new();
    loop {
        let file = dir.join("cpu.max");
        match std::fs::read_to_string(&file) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            r => out.push((file, r)),
        }
        if dir == root || !dir.pop() || !dir.starts_with(&root) {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timer_wait_puts_the_slack_back() {
        let before = timer_slack().unwrap();
        set_timer_slack(70_000).unwrap();
        timer_wait_until(monotonic_ns() + 20_000).unwrap();
        assert_eq!(timer_slack().unwrap(), 70_000);
        set_timer_slack(before).unwrap();
        assert_eq!(timer_slack().unwrap(), before);
    }

    #[test]
    fn timer_wait_reaches_its_deadline() {
        let deadline = monotonic_ns() + 100_000;
        timer_wait_until(deadline).unwrap();
        assert!(monotonic_ns() >= deadline);
        // A deadline already past returns at once.
        timer_wait_until(0).unwrap();
    }

    #[test]
    fn thread_cpu_time_moves() {
        let a = thread_cpu_time();
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        assert!(thread_cpu_time() > a);
    }
}
