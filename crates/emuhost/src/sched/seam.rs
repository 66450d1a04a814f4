//! The primitives a sleep is made of, behind one small trait: the clock, a yield, a timer wait
//! and the processor count. [`OsHost`] is the real machine; a test gives its own
//! implementation to count yields and timer waits without sleeping.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::sys::sched as sys;

/// What a sleep needs from the machine.
pub trait SchedHost: Send + Sync {
    /// Nanoseconds on a monotonic clock.
    fn now_ns(&self) -> u64;
    /// Gives the CPU to any other thread that wants it.
    fn yield_now(&self);
    /// Waits on the timer until `deadline_ns` on [`SchedHost::now_ns`]'s clock. May return early
    /// only where the timer failed; the caller yields out whatever is left.
    fn timer_wait_until(&self, deadline_ns: u64);
    /// Logical processors in the process's affinity mask; `None` where the count is unknown
    /// (the call failed).
    fn affinity_cpus(&self) -> Option<usize>;
}

/// The real machine: `CLOCK_MONOTONIC`, `sched_yield`, `clock_nanosleep(TIMER_ABSTIME)` with the
/// timer slack lowered and `sched_getaffinity`.
#[derive(Clone, Copy, Debug, Default)]
pub struct OsHost;

static TIMER_FAILED: AtomicBool = AtomicBool::new(false);

impl SchedHost for OsHost {
    fn now_ns(&self) -> u64 {
        sys::monotonic_ns()
    }

    fn yield_now(&self) {
        sys::yield_now();
    }

    fn timer_wait_until(&self, deadline_ns: u64) {
        if let Err(e) = sys::timer_wait_until(deadline_ns)
            && !TIMER_FAILED.swap(true, Ordering::Relaxed)
        {
            tracing::warn!("sched: a timer wait failed ({e}); short sleeps yield out what the timer left");
        }
    }

    fn affinity_cpus(&self) -> Option<usize> {
        sys::affinity_cpus().ok()
    }
}
