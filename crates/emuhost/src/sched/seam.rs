//! The primitives a sleep is made of, behind one small trait: the clock, a yield, a timer wait,
//! whether there is a timer, and the processor count. [`OsHost`] is the real machine; a test gives its own
//! implementation to count yields and timer waits without sleeping.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::sys::sched as sys;

/// What a sleep needs from the machine.
///
/// A fake host makes a sleep's waits countable without sleeping:
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
/// use std::time::Duration;
/// use emuhost::sched::{Caller, SchedHost, Sleeper, Wait};
///
/// /// A clock that a yield moves by 10 µs and a timer wait moves to its deadline.
/// #[derive(Default)]
/// struct Fake { now: AtomicU64, yields: AtomicU64 }
/// impl SchedHost for Fake {
///     fn now_ns(&self) -> u64 { self.now.load(Relaxed) }
///     fn yield_now(&self) { self.yields.fetch_add(1, Relaxed); self.now.fetch_add(10_000, Relaxed); }
///     fn timer_wait_until(&self, deadline_ns: u64) { self.now.fetch_max(deadline_ns, Relaxed); }
///     fn affinity_cpus(&self) -> Option<usize> { Some(16) }
/// }
///
/// // 16 processors: the guest's short sleeps yield (the rule), 100 µs = 10 yields.
/// let sleeper = Sleeper::builder().build(Fake::default());
/// sleeper.sleep(Caller::Guest, Duration::from_micros(100));
/// assert_eq!(sleeper.rule().guest, Wait::Yield);
/// assert_eq!(sleeper.host().yields.load(Relaxed), 10);
/// ```
pub trait SchedHost: Send + Sync {
    /// Nanoseconds on a monotonic clock.
    fn now_ns(&self) -> u64;
    /// Gives the CPU to any other thread that wants it.
    fn yield_now(&self);
    /// Waits on the timer until `deadline_ns` on [`SchedHost::now_ns`]'s clock. May return early
    /// only where the timer failed; the caller yields out whatever is left.
    fn timer_wait_until(&self, deadline_ns: u64);
    /// Why the machine has no timer fit for short sleeps (`None`, the default: it has one). Where
    /// it has none, every wait the rule would put on the timer yields instead, and the rule's log
    /// line says why (Windows before 10 1803 refuses the high-resolution waitable timer).
    fn timer_missing(&self) -> Option<String> {
        None
    }
    /// Logical processors the process may use (its affinity mask; on Windows with several
    /// processor groups, what its groups and CPU sets allow); `None` where the count is unknown.
    fn affinity_cpus(&self) -> Option<usize>;
}

/// The real machine: on Linux `CLOCK_MONOTONIC`, `sched_yield`, `clock_nanosleep(TIMER_ABSTIME)`
/// with the timer slack lowered and `sched_getaffinity`; on Windows `QueryPerformanceCounter`,
/// `SwitchToThread`, a high-resolution waitable timer and the affinity mask (processor groups and
/// CPU sets where there are several groups).
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
            tracing::warn!("sched: a timer wait failed ({e}); sleeps yield out what the timer left");
        }
    }

    fn timer_missing(&self) -> Option<String> {
        sys::timer_missing()
    }

    fn affinity_cpus(&self) -> Option<usize> {
        sys::affinity_cpus().ok()
    }
}
