//! Short sleeps: how a sleep under a millisecond waits, for the guest and for the host.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::seam::{OsHost, SchedHost};

/// The name of the switch that sets [`SleeperBuilder::short_sleep_timer`] (the settings' table
/// names it so; the rule's log line does too): unset, the rule by processor count; set, its value
/// decides for every short sleep.
pub const SHORT_SLEEP_TIMER_VAR: &str = "EMUHOST_SHORT_SLEEP_TIMER";

/// Guest short sleeps wait on the timer where the affinity mask holds this many logical
/// processors or fewer (measured in the reference on 4 and 6; at 8 and 16 nothing was gained).
pub const TIMER_MAX_CPUS: usize = 6;

/// A sleep shorter than this is a short sleep, which the rule governs. Longer ones wait on the
/// timer (the host's: [`HOST_EXACT_WAIT`]).
pub const SHORT_SLEEP: Duration = Duration::from_millis(1);

/// How the host's sleeps wait when the switch is unset: the exact wait, the yield loop.
/// [`Wait::Hybrid`] was measured against it with `emuhost bench sleep` on the 2-vCPU VM
/// (docs/sched.md): at 1 ms its median lateness equals the loop's (0.3 µs) at 7–18 % of its CPU,
/// but its p99 is the timer's wake-up, and in the least loaded runs that was 50–120×
/// the loop's (246 µs against 4.6, 2.6 ms against 21 µs). It does not keep the loop's lateness, so it is not adopted;
/// [`SleeperBuilder::host_exact`] turns it on, and a quieter machine may show otherwise.
pub const HOST_EXACT_WAIT: Wait = Wait::Yield;

/// The hybrid's margin at the start: it waits on the timer until this long before the deadline
/// and yields the rest. It must cover the timer's lateness (p99 ~80 µs with a 1 ns slack on a
/// 2-vCPU VM), or the hybrid wakes late like the timer does. A [`Sleeper`] then learns the margin
/// from the lateness it sees ([`LearnedMargin`]) unless [`SleeperBuilder::hybrid_margin`] fixes it.
pub const HYBRID_MARGIN: Duration = Duration::from_micros(100);

/// The hybrid's margins, learned as it runs. Each is a running estimate of a high percentile
/// (about the 99.4th) of how late the timer wakes past the time it was asked for: a sample later
/// than the estimate raises it by an eighth, one within it lowers it by 1/1600, so in balance
/// about 0.6 % of the wake-ups pass it (an eighth up, ln 1.125 ≈ 0.118, weighs as much as 190
/// steps down). A noisy machine raises it within a few dozen late wake-ups.
///
/// Two stages, because a long sleep and a short one do not wake alike: after a long sleep the
/// processor may have gone to a deep idle state, whose exit costs tens to hundreds of
/// microseconds (the H200 machine's timer woke 23 µs late at the median and 122 µs at p99 after
/// 1 ms); after a short one the idle governor picks a shallow state. So the hybrid sleeps until
/// the long margin before the deadline, then on the timer again until the short margin, and
/// yields only that last part: the spin is the short margin, not the long one.
/// Lock-free: several threads may sleep at once.
#[derive(Debug)]
pub struct LearnedMargin {
    long: AtomicU64,
    short: AtomicU64,
}

impl LearnedMargin {
    /// The least margin: the yields' own granularity (a `sched_yield` and a clock read).
    pub const MIN: Duration = Duration::from_micros(2);
    /// The most: a short sleep's length; past it the hybrid is the yield loop.
    pub const MAX: Duration = SHORT_SLEEP;
    /// Where the short stage's margin starts.
    pub const SHORT_START: Duration = Duration::from_micros(20);

    /// Margins starting at `start` (the long stage) and at [`LearnedMargin::SHORT_START`] or
    /// `start`, whichever is less (the short stage).
    pub fn new(start: Duration) -> Self {
        let ns = clamp_ns(start.as_nanos() as u64);
        let short = ns.min(Self::SHORT_START.as_nanos() as u64);
        Self { long: AtomicU64::new(ns), short: AtomicU64::new(short) }
    }

    /// The long stage's margin now: how long before the deadline the first timer wait ends.
    pub fn get(&self) -> Duration {
        Duration::from_nanos(self.long.load(Ordering::Relaxed))
    }

    /// The short stage's margin now: what the hybrid yields.
    pub fn spin(&self) -> Duration {
        Duration::from_nanos(self.short.load(Ordering::Relaxed))
    }

    /// One wake-up of the long stage `late_ns` after the time it was asked for.
    pub fn observe(&self, late_ns: u64) {
        learn(&self.long, late_ns);
    }

    /// One wake-up of the short stage.
    pub fn observe_short(&self, late_ns: u64) {
        learn(&self.short, late_ns);
    }
}

fn clamp_ns(ns: u64) -> u64 {
    ns.clamp(LearnedMargin::MIN.as_nanos() as u64, LearnedMargin::MAX.as_nanos() as u64)
}

/// One step of the percentile estimate in `m` (see [`LearnedMargin`]).
fn learn(m: &AtomicU64, late_ns: u64) {
    let _ = m.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
        Some(clamp_ns(if late_ns > m { m + m / 8 } else { m - m / 1600 }))
    });
}

/// Who sleeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Caller {
    /// The game's own sleep calls.
    Guest,
    /// The host's: frame limiter, audio, timer events.
    Host,
}

/// How a sleep waits out its time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Wait {
    /// One timer wait for the deadline: the thread really sleeps, and wakes somewhat late.
    Timer,
    /// Yields until the deadline: exact, and keeps a CPU busy.
    Yield,
    /// A timer wait until the margin before the deadline, then yields: nearly exact, busy only
    /// for the margin.
    Hybrid,
}

impl Wait {
    /// The wait's name as logs and `emuhost policy` print it: `timer`, `yield` or `hybrid`.
    pub fn name(self) -> &'static str {
        match self {
            Wait::Timer => "timer",
            Wait::Yield => "yield",
            Wait::Hybrid => "hybrid",
        }
    }
}

/// The rule for short sleeps, decided once.
///
/// ```
/// use emuhost::sched::{Caller, ShortSleepRule, TIMER_MAX_CPUS, Wait};
///
/// // Switch unset, 4 logical processors: the guest's short sleeps wait on the timer.
/// let rule = ShortSleepRule::decide(None, Some(4), TIMER_MAX_CPUS, Wait::Yield);
/// assert_eq!(rule.wait_for(Caller::Guest), Wait::Timer);
/// assert_eq!(rule.wait_for(Caller::Host), Wait::Yield);
/// // A machine without a timer (Windows before 10 1803) yields for both.
/// let rule = rule.without_timer(Some("no high-resolution timer".into()));
/// assert_eq!(rule.wait_for(Caller::Guest), Wait::Yield);
/// assert!(rule.why().contains("no timer here"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShortSleepRule {
    /// How the guest's short sleeps wait.
    pub guest: Wait,
    /// How the host's short sleeps wait.
    pub host: Wait,
    /// The processor count it was decided with (`None`: unknown).
    pub cpus: Option<usize>,
    /// The switch: `None` where it is unset, else whether it is on ([`crate::settings::switch_on`]).
    pub switch: Option<bool>,
    /// The threshold it was decided with: guest short sleeps wait on the timer with this many
    /// logical processors or fewer (by default [`TIMER_MAX_CPUS`]).
    pub timer_max_cpus: usize,
    /// Why the machine has no timer for short sleeps (`None`: it has one); where it has none,
    /// what would wait on it yields ([`ShortSleepRule::without_timer`]).
    pub no_timer: Option<String>,
    /// (guest, host) as the rule chose them before a missing timer made them yield.
    by_rule: (Wait, Wait),
}

impl ShortSleepRule {
    /// Decides the rule. `switch`: `None` where it is unset, else whether it is on. `cpus`: the
    /// logical processors in the affinity mask, `None` where unknown. `host_exact`: how the
    /// host's sleeps wait where the switch is unset.
    pub fn decide(switch: Option<bool>, cpus: Option<usize>, timer_max_cpus: usize, host_exact: Wait) -> Self {
        let (guest, host) = match switch {
            Some(on) => {
                let w = if on { Wait::Timer } else { Wait::Yield };
                (w, w)
            }
            None => {
                let few = cpus.is_some_and(|n| n <= timer_max_cpus);
                (if few { Wait::Timer } else { Wait::Yield }, host_exact)
            }
        };
        ShortSleepRule { guest, host, cpus, switch, timer_max_cpus, no_timer: None, by_rule: (guest, host) }
    }

    /// The rule where the machine has no timer (`missing`: why; `None` leaves the rule as it
    /// is): what would wait on the timer, or on the hybrid (a timer wait, then yields), yields
    /// until its deadline instead: the reference's fallback where Windows refuses the
    /// high-resolution timer.
    pub fn without_timer(mut self, missing: Option<String>) -> Self {
        if missing.is_some() {
            (self.guest, self.host) = (Wait::Yield, Wait::Yield);
            self.no_timer = missing;
        }
        self
    }

    /// How a short sleep of `caller` waits.
    pub fn wait_for(&self, caller: Caller) -> Wait {
        match caller {
            Caller::Guest => self.guest,
            Caller::Host => self.host,
        }
    }

    /// Why, in words (for the log and `emuhost policy`).
    pub fn why(&self) -> String {
        let why = self.why_by_rule();
        match &self.no_timer {
            Some(missing) => format!(
                "no timer here ({missing}), so every sleep yields until its deadline; with a timer the rule would \
                 give: {why}"
            ),
            None => why,
        }
    }

    /// What the rule chose and why, before a missing timer made every sleep yield.
    fn why_by_rule(&self) -> String {
        let cpus = self.cpus.map_or("an unknown count of".to_string(), |n| n.to_string());
        match &self.switch {
            Some(on) => format!(
                "{SHORT_SLEEP_TIMER_VAR} is set and {}: every short sleep ({}), guest and host; {cpus} logical \
                 processors in the affinity mask",
                if *on { "on" } else { "off" },
                self.by_rule.0.name(),
            ),
            None => {
                let reason = match self.cpus {
                    Some(n) if n <= self.timer_max_cpus => format!("{n} <= {}", self.timer_max_cpus),
                    Some(n) => format!("{n} > {}", self.timer_max_cpus),
                    None => "the count is unknown".to_string(),
                };
                format!(
                    "{SHORT_SLEEP_TIMER_VAR} unset: guest short sleeps {} ({cpus} logical processors in the affinity \
                     mask: {reason}), host short sleeps {} (the exact wait)",
                    self.by_rule.0.name(),
                    self.by_rule.1.name()
                )
            }
        }
    }
}

/// Waits until `deadline_ns` on `host`'s clock by `wait` (nanoseconds, [`SchedHost::now_ns`]).
/// `margin_ns`: the hybrid's margin, in nanoseconds.
/// Whatever a timer wait leaves (it failed) is yielded out, so every wait ends at or after the
/// deadline.
pub fn wait_until<H: SchedHost + ?Sized>(host: &H, wait: Wait, deadline_ns: u64, margin_ns: u64) {
    let now = host.now_ns();
    if now >= deadline_ns {
        return;
    }
    match wait {
        Wait::Timer => host.timer_wait_until(deadline_ns),
        Wait::Hybrid if deadline_ns - now > margin_ns => host.timer_wait_until(deadline_ns - margin_ns),
        Wait::Hybrid | Wait::Yield => {}
    }
    while host.now_ns() < deadline_ns {
        host.yield_now();
    }
}

/// [`wait_until`] by the hybrid in two stages with the margins `margin` learns (the bench's
/// learned arm and a [`Sleeper`]'s hybrid): a timer wait until the long margin before the
/// deadline, one until the short margin, then yields (see [`LearnedMargin`]). Each stage is
/// made only where more than its margin is left.
pub fn wait_until_learning<H: SchedHost + ?Sized>(host: &H, deadline_ns: u64, margin: &LearnedMargin) {
    let stage = |m: Duration| {
        let m = m.as_nanos() as u64;
        let now = host.now_ns();
        (deadline_ns.saturating_sub(now) > m).then(|| {
            let target = deadline_ns - m;
            host.timer_wait_until(target);
            host.now_ns().saturating_sub(target)
        })
    };
    if let Some(late) = stage(margin.get()) {
        margin.observe(late);
    }
    if let Some(late) = stage(margin.spin()) {
        margin.observe_short(late);
    }
    while host.now_ns() < deadline_ns {
        host.yield_now();
    }
}

/// How a [`Sleeper`] is made: the switch, the threshold, the host's exact wait and the hybrid's
/// margin.
#[derive(Clone, Copy, Debug)]
pub struct SleeperBuilder {
    switch: Option<bool>,
    timer_max_cpus: usize,
    host_exact: Wait,
    /// `None`: learned (from [`HYBRID_MARGIN`]).
    hybrid_margin: Option<Duration>,
}

impl Default for SleeperBuilder {
    fn default() -> Self {
        Self { switch: None, timer_max_cpus: TIMER_MAX_CPUS, host_exact: HOST_EXACT_WAIT, hybrid_margin: None }
    }
}

impl SleeperBuilder {
    /// The switch: `None` (unset) leaves short sleeps to the rule by processor count; `Some(on)`
    /// puts every one on the timer (on) or the yield (off).
    pub fn short_sleep_timer(mut self, switch: Option<bool>) -> Self {
        self.switch = switch;
        self
    }

    /// Guest short sleeps wait on the timer with this many logical processors or fewer.
    pub fn timer_max_cpus(mut self, n: usize) -> Self {
        self.timer_max_cpus = n;
        self
    }

    /// How the host's sleeps wait where the switch is unset.
    pub fn host_exact(mut self, wait: Wait) -> Self {
        self.host_exact = wait;
        self
    }

    /// Fixes the hybrid's margin (by default it is learned: [`LearnedMargin`]).
    pub fn hybrid_margin(mut self, margin: Duration) -> Self {
        self.hybrid_margin = Some(margin);
        self
    }

    /// The sleeper, on `host`'s clock and primitives ([`OsHost`] for the real machine, a fake
    /// [`SchedHost`] in tests). Nothing is read or logged until its first sleep.
    pub fn build<H: SchedHost>(self, host: H) -> Sleeper<H> {
        Sleeper { host, config: self, rule: OnceLock::new(), margin: LearnedMargin::new(HYBRID_MARGIN) }
    }
}

/// Sleeps for the guest and the host by the rule, which it decides at its first sleep (or at
/// [`Sleeper::rule`]) and logs once. Every sleep ends at or after its deadline (a failed timer
/// wait is yielded out); it never returns an error or panics. Shared by reference: several
/// threads may sleep on one sleeper at once.
///
/// ```
/// use std::time::{Duration, Instant};
/// use emuhost::sched::{Caller, OsHost, Sleeper, Wait};
///
/// // Every short sleep on the timer, as `EMUHOST_SHORT_SLEEP_TIMER=1` would say (yields where
/// // the machine has no timer: Windows before 10 1803).
/// let sleeper = Sleeper::builder().short_sleep_timer(Some(true)).build(OsHost);
/// let rule = sleeper.rule();
/// let want = if rule.no_timer.is_none() { Wait::Timer } else { Wait::Yield };
/// assert_eq!(rule.wait_for(Caller::Guest), want);
/// let start = Instant::now();
/// sleeper.sleep(Caller::Guest, Duration::from_micros(300));
/// assert!(start.elapsed() >= Duration::from_micros(300));
/// ```
pub struct Sleeper<H: SchedHost> {
    host: H,
    config: SleeperBuilder,
    rule: OnceLock<ShortSleepRule>,
    margin: LearnedMargin,
}

impl Sleeper<OsHost> {
    /// A builder; its `build` takes the seam (any [`SchedHost`]).
    pub fn builder() -> SleeperBuilder {
        SleeperBuilder::default()
    }
}

impl<H: SchedHost> Sleeper<H> {
    /// The seam it sleeps through (a test's fake host reads its counts here).
    pub fn host(&self) -> &H {
        &self.host
    }

    /// The rule, decided at the first call: the processor count is read then, and one log line
    /// says what was chosen.
    pub fn rule(&self) -> &ShortSleepRule {
        self.rule.get_or_init(|| {
            let switch = self.config.switch;
            // The count is looked at only where the switch leaves it to the rule, but the log gives it always.
            let cpus = self.host.affinity_cpus();
            let rule = ShortSleepRule::decide(switch, cpus, self.config.timer_max_cpus, self.config.host_exact)
                .without_timer(self.host.timer_missing());
            tracing::info!(
                "sched: short sleeps: guest {}, host {}: {}",
                rule.guest.name(),
                rule.host.name(),
                rule.why()
            );
            rule
        })
    }

    /// Sleeps `d` for `caller` (a short sleep by the rule, a longer one on the timer).
    pub fn sleep(&self, caller: Caller, d: Duration) {
        let deadline = self.host.now_ns().saturating_add(d.as_nanos().min(u64::MAX as u128) as u64);
        self.sleep_until(caller, deadline);
    }

    /// Sleeps until `deadline_ns` on the host's clock for `caller` ([`SchedHost::now_ns`]:
    /// nanoseconds of a monotonic clock, whose origin only differences mean). A deadline passed
    /// already returns at once.
    pub fn sleep_until(&self, caller: Caller, deadline_ns: u64) {
        let left = deadline_ns.saturating_sub(self.host.now_ns());
        if left == 0 {
            return;
        }
        let wait = if u128::from(left) < SHORT_SLEEP.as_nanos() {
            self.rule().wait_for(caller)
        } else {
            self.long_wait(caller)
        };
        match (wait, self.config.hybrid_margin) {
            (Wait::Hybrid, None) => wait_until_learning(&self.host, deadline_ns, &self.margin),
            (_, fixed) => wait_until(&self.host, wait, deadline_ns, fixed.unwrap_or(HYBRID_MARGIN).as_nanos() as u64),
        }
    }

    /// The hybrid's margin now: the fixed one, or what it learned so far.
    pub fn hybrid_margin(&self) -> Duration {
        self.config.hybrid_margin.unwrap_or_else(|| self.margin.get())
    }

    /// How a sleep of a millisecond or more waits: on the timer, but the host's by the hybrid
    /// where that is its exact wait (it costs the margin's yields and keeps pacing exact); yields
    /// where the machine has no timer.
    fn long_wait(&self, caller: Caller) -> Wait {
        if self.rule().no_timer.is_some() {
            return Wait::Yield;
        }
        match (caller, self.config.host_exact) {
            (Caller::Host, Wait::Hybrid) => Wait::Hybrid,
            _ => Wait::Timer,
        }
    }
}

/// The process's sleeper on the real machine, with the switch unset (the rule by processor
/// count, decided once per process). A sleeper with settings:
/// [`Settings::sleeper_builder`](crate::settings::Settings::sleeper_builder).
pub fn sleeper() -> &'static Sleeper<OsHost> {
    static SLEEPER: OnceLock<Sleeper<OsHost>> = OnceLock::new();
    SLEEPER.get_or_init(|| SleeperBuilder::default().build(OsHost))
}

/// A guest sleep on the process's sleeper.
pub fn sleep_guest(d: Duration) {
    sleeper().sleep(Caller::Guest, d);
}

/// A host sleep on the process's sleeper.
pub fn sleep_host(d: Duration) {
    sleeper().sleep(Caller::Host, d);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_is_inclusive() {
        let at = ShortSleepRule::decide(None, Some(TIMER_MAX_CPUS), TIMER_MAX_CPUS, Wait::Yield);
        let past = ShortSleepRule::decide(None, Some(TIMER_MAX_CPUS + 1), TIMER_MAX_CPUS, Wait::Yield);
        assert_eq!((at.guest, past.guest), (Wait::Timer, Wait::Yield));
        assert!(at.why().contains("6 <= 6"), "{}", at.why());
    }
}
