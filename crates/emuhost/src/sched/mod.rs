//! Short sleeps and compile-worker sizing.
//!
//! **Short sleeps.** A sleep under a millisecond either waits on the timer or yields until its
//! deadline. On Linux the timer is `clock_nanosleep(TIMER_ABSTIME)` with the thread's timer slack
//! lowered to 1 ns while it waits: the thread really sleeps, costs little CPU, and wakes tens of
//! microseconds late. On Windows it is a high-resolution waitable timer
//! (`CREATE_WAITABLE_TIMER_HIGH_RESOLUTION`); where the system refuses it (before Windows 10 1803)
//! there is no timer, and every wait the rule puts on the timer (the hybrid's too) yields instead,
//! as the reference falls back, said once in the rule's log line with the reason
//! ([`SchedHost::timer_missing`]). The yield loop (`sched_yield`, `SwitchToThread`, until the
//! deadline) is exact and keeps a CPU busy; where the process has few processors those loops take
//! the CPU the frame's threads need.
//! So, unless `EMUHOST_SHORT_SLEEP_TIMER` is set, the guest's short sleeps wait on the timer where
//! the affinity mask holds [`TIMER_MAX_CPUS`] logical processors or fewer and yield otherwise (or
//! where the count is unknown; on Windows with several processor groups the count is what the
//! process's groups and CPU sets allow, not one group's mask); the host's keep their exact wait ([`HOST_EXACT_WAIT`]). Set, the
//! switch's value decides for every short sleep ([`crate::settings::switch_on`]). The rule is decided once per
//! [`Sleeper`] (once per process for [`sleeper`]) and logged once with the processor count.
//! The primitives sit behind [`SchedHost`], so tests count yields and timer waits without sleeping.
//!
//! **Workers.** [`prepare_workers`] sizes a compile job's pool from the usable CPUs (affinity mask
//! limited by the cgroup v2 CPU quota; on Windows by the job object's hard CPU rate cap), the
//! available memory (`MemAvailable`; `GlobalMemoryStatusEx`) and whether the allocator scales.

mod error;
mod seam;
mod sleep;
mod workers;

pub use error::SchedError;
pub use seam::{OsHost, SchedHost};
pub use sleep::{
    Caller, HOST_EXACT_WAIT, HYBRID_MARGIN, LearnedMargin, SHORT_SLEEP, SHORT_SLEEP_TIMER_VAR, ShortSleepRule, Sleeper,
    SleeperBuilder, TIMER_MAX_CPUS, Wait, sleep_guest, sleep_host, sleeper, wait_until, wait_until_learning,
};
pub use workers::{
    Allocator, BYTES_PER_EXTRA_WORKER, CpuQuota, MAX_WORKERS, Machine, RESERVE_BYTES, Workers, parse_cpu_max,
    parse_mem_available, prepare_workers, usable_cpus,
};

/// CPU time the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`), for measuring sleeps.
pub fn thread_cpu_time() -> std::time::Duration {
    crate::sys::sched::thread_cpu_time()
}

/// Restricts the calling thread to the first `n` processors of its affinity mask (to measure as
/// on a smaller machine); returns how many it now has.
pub fn restrict_thread_cpus(n: usize) -> std::io::Result<usize> {
    crate::sys::sched::restrict_thread_cpus(n)
}
