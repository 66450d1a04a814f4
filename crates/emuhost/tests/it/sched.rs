//! Short sleeps over a counting seam (a clock that only moves when the sleeper yields or waits on
//! the timer, so nothing really sleeps), and the process's real sleeper on this machine.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use emuhost::sched::{
    Caller, HOST_EXACT_WAIT, HYBRID_MARGIN, OsHost, SchedHost, Sleeper, SleeperBuilder, TIMER_MAX_CPUS, Wait,
    wait_until,
};
use emuhost::settings::Settings;

/// Each yield moves the clock by this much.
const YIELD_STEP: u64 = 1_000;

/// The seam: counts yields, timer waits and reads of the count.
struct Counting {
    now: AtomicU64,
    yields: AtomicU64,
    timers: AtomicU64,
    cpu_reads: AtomicU64,
    cpus: Option<usize>,
    /// What `timer_missing` answers (`None`: the machine has a timer).
    no_timer: Option<String>,
}

/// A sleeper's builder with the switch set to `switch` as the CLI sets it: through `Settings`.
fn builder(switch: Option<&str>) -> SleeperBuilder {
    let mut settings = Settings::default();
    if let Some(v) = switch {
        settings.set("EMUHOST_SHORT_SLEEP_TIMER", v).unwrap();
    }
    settings.sleeper_builder()
}

impl Counting {
    fn new(cpus: Option<usize>) -> Self {
        Counting {
            now: AtomicU64::new(1_000_000_000),
            yields: AtomicU64::new(0),
            timers: AtomicU64::new(0),
            cpu_reads: AtomicU64::new(0),
            cpus,
            no_timer: None,
        }
    }

    /// A machine without a timer, for the reason `why`.
    fn without_timer(cpus: Option<usize>, why: &str) -> Self {
        Counting { no_timer: Some(why.to_string()), ..Counting::new(cpus) }
    }

    /// (yields, timer waits) since the last call.
    fn take(&self) -> (u64, u64) {
        (self.yields.swap(0, Ordering::SeqCst), self.timers.swap(0, Ordering::SeqCst))
    }
}

impl SchedHost for Counting {
    fn now_ns(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
    fn yield_now(&self) {
        self.yields.fetch_add(1, Ordering::SeqCst);
        self.now.fetch_add(YIELD_STEP, Ordering::SeqCst);
    }
    fn timer_wait_until(&self, deadline_ns: u64) {
        self.timers.fetch_add(1, Ordering::SeqCst);
        self.now.fetch_max(deadline_ns, Ordering::SeqCst);
    }
    fn affinity_cpus(&self) -> Option<usize> {
        self.cpu_reads.fetch_add(1, Ordering::SeqCst);
        self.cpus
    }
    fn timer_missing(&self) -> Option<String> {
        self.no_timer.clone()
    }
}

/// Sleeps `d` and returns (yields, timer waits); checks the sleep ended at its deadline.
fn sleep_counted(s: &Sleeper<Counting>, caller: Caller, d: Duration) -> (u64, u64) {
    let start = s.host().now_ns();
    s.sleep(caller, d);
    let end = s.host().now_ns();
    assert!(end >= start + d.as_nanos() as u64, "woke early: {start} + {d:?} > {end}");
    s.host().take()
}

/// What a sleep of `d` costs in (yields, timer waits) when it waits by `w` on the seam.
fn cost(w: Wait, d: Duration) -> (u64, u64) {
    let ns = d.as_nanos() as u64;
    let margin = HYBRID_MARGIN.as_nanos() as u64;
    match w {
        Wait::Timer => (0, 1),
        Wait::Yield => (ns.div_ceil(YIELD_STEP), 0),
        Wait::Hybrid if ns > margin => (margin.div_ceil(YIELD_STEP), 1),
        Wait::Hybrid => (ns.div_ceil(YIELD_STEP), 0),
    }
}

/// The rule, written out from the contract (not from the library).
fn expected(cpus: Option<usize>, switch: Option<&str>, caller: Caller) -> Wait {
    match switch {
        Some(v) => {
            let off = ["", "0", "false", "off", "no"].contains(&v.trim().to_ascii_lowercase().as_str());
            if off { Wait::Yield } else { Wait::Timer }
        }
        None => match caller {
            Caller::Host => HOST_EXACT_WAIT,
            Caller::Guest if cpus.is_some_and(|n| n <= 6) => Wait::Timer,
            Caller::Guest => Wait::Yield,
        },
    }
}

const SWITCHES: &[Option<&str>] = &[
    None,
    Some(""),
    Some("   "),
    Some("0"),
    Some(" 0 "),
    Some("false"),
    Some("FALSE"),
    Some("off"),
    Some("OFF"),
    Some("Off"),
    Some("no"),
    Some(" No\t"),
    Some("1"),
    Some("on"),
    Some("ON"),
    Some("true"),
    Some("yes"),
    Some("timer"),
    Some(" 1 "),
    Some("2"),
];

fn counts() -> impl Iterator<Item = Option<usize>> {
    (1..=16).map(Some).chain([None])
}

#[test]
fn every_count_switch_and_caller() {
    assert_eq!(TIMER_MAX_CPUS, 6);
    let short = [Duration::from_micros(20), Duration::from_micros(500), Duration::from_nanos(999_999)];
    for cpus in counts() {
        for &switch in SWITCHES {
            let s = builder(switch).build(Counting::new(cpus));
            for caller in [Caller::Guest, Caller::Host] {
                let want = expected(cpus, switch, caller);
                assert_eq!(s.rule().wait_for(caller), want, "cpus {cpus:?}, switch {switch:?}, {caller:?}");
                for d in short {
                    let got = sleep_counted(&s, caller, d);
                    assert_eq!(
                        got,
                        cost(want, d),
                        "cpus {cpus:?}, switch {switch:?}, {caller:?}, {d:?}: (yields, timers)"
                    );
                }
            }
            assert_eq!(s.host().cpu_reads.load(Ordering::SeqCst), 1, "the count is read once");
        }
    }
}

/// The edge as the reference measured it on Windows (and as it holds here on every platform): 6
/// logical processors wait on the timer, 7 yield; the switch, read by the settings' one parser,
/// overrides both ways.
#[test]
fn the_edge_is_between_6_and_7_and_the_switch_overrides_it() {
    let guest = |cpus: usize, switch: Option<&str>| builder(switch).build(Counting::new(Some(cpus))).rule().guest;
    assert_eq!((guest(6, None), guest(7, None)), (Wait::Timer, Wait::Yield));
    assert_eq!((guest(6, Some("0")), guest(7, Some("0"))), (Wait::Yield, Wait::Yield));
    assert_eq!((guest(6, Some("off")), guest(7, Some("on"))), (Wait::Yield, Wait::Timer));
    assert_eq!((guest(6, Some("")), guest(7, Some("1"))), (Wait::Yield, Wait::Timer));
    // From the environment's form, as the CLI and the C ABI read it.
    let from = |v: Option<&str>| {
        let s = Settings::from_lookup(|name| {
            (name == "EMUHOST_SHORT_SLEEP_TIMER").then_some(v).flatten().map(String::from)
        });
        s.unwrap().sleeper_builder().build(Counting::new(Some(7))).rule().guest
    };
    assert_eq!((from(None), from(Some("yes")), from(Some("no"))), (Wait::Yield, Wait::Timer, Wait::Yield));
}

#[test]
fn long_sleeps_wait_on_the_timer() {
    for cpus in counts() {
        for &switch in SWITCHES {
            let s = builder(switch).build(Counting::new(cpus));
            for d in [Duration::from_millis(1), Duration::from_millis(16)] {
                assert_eq!(sleep_counted(&s, Caller::Guest, d), (0, 1), "guest {d:?}");
                assert_eq!(sleep_counted(&s, Caller::Host, d), cost(host_long(), d), "host {d:?}");
            }
        }
    }
}

/// The host's long sleeps: the hybrid where that is the exact wait, the timer otherwise.
fn host_long() -> Wait {
    if HOST_EXACT_WAIT == Wait::Hybrid { Wait::Hybrid } else { Wait::Timer }
}

#[test]
fn host_sleeps_yield_where_the_exact_wait_is_the_yield_loop() {
    for cpus in counts() {
        let s = builder(None).host_exact(Wait::Yield).build(Counting::new(cpus));
        let d = Duration::from_micros(500);
        assert_eq!(sleep_counted(&s, Caller::Host, d), (500, 0), "cpus {cpus:?}");
        assert_eq!(sleep_counted(&s, Caller::Host, Duration::from_millis(2)), (0, 1), "cpus {cpus:?}");
    }
}

#[test]
fn threshold_override() {
    for max in [0, 1, 2, 8, 12] {
        for cpus in counts() {
            let s = builder(None).timer_max_cpus(max).build(Counting::new(cpus));
            let timer = cpus.is_some_and(|n| n <= max);
            let got = sleep_counted(&s, Caller::Guest, Duration::from_micros(20));
            assert_eq!(got, if timer { (0, 1) } else { (20, 0) }, "max {max}, cpus {cpus:?}");
        }
    }
}

/// The counting seam with a clock per thread, so threads sleeping side by side do not move each
/// other's clock past a deadline.
struct ThreadClock(Counting);

thread_local! {
    static NOW: std::cell::Cell<u64> = const { std::cell::Cell::new(1_000_000_000) };
}

impl SchedHost for ThreadClock {
    fn now_ns(&self) -> u64 {
        NOW.get()
    }
    fn yield_now(&self) {
        self.0.yields.fetch_add(1, Ordering::SeqCst);
        NOW.set(NOW.get() + YIELD_STEP);
    }
    fn timer_wait_until(&self, deadline_ns: u64) {
        self.0.timers.fetch_add(1, Ordering::SeqCst);
        NOW.set(NOW.get().max(deadline_ns));
    }
    fn affinity_cpus(&self) -> Option<usize> {
        self.0.affinity_cpus()
    }
}

#[test]
fn decided_once_across_threads() {
    let s = Arc::new(builder(None).build(ThreadClock(Counting::new(Some(4)))));
    let barrier = Arc::new(std::sync::Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let (s, barrier) = (s.clone(), barrier.clone());
            std::thread::spawn(move || {
                let caller = if i % 2 == 0 { Caller::Guest } else { Caller::Host };
                barrier.wait();
                for _ in 0..50 {
                    s.sleep(caller, Duration::from_micros(20));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let c = &s.host().0;
    assert_eq!(c.cpu_reads.load(Ordering::SeqCst), 1);
    // 4 guest threads × 50 sleeps on the timer; 4 host threads × 50 sleeps by the exact wait.
    let host = cost(HOST_EXACT_WAIT, Duration::from_micros(20));
    assert_eq!(c.timers.load(Ordering::SeqCst), 200 + 200 * host.1);
    assert_eq!(c.yields.load(Ordering::SeqCst), 200 * host.0);
}

#[test]
fn a_timer_that_fails_is_yielded_out() {
    struct Broken(Counting);
    impl SchedHost for Broken {
        fn now_ns(&self) -> u64 {
            self.0.now_ns()
        }
        fn yield_now(&self) {
            self.0.yield_now()
        }
        fn timer_wait_until(&self, _deadline_ns: u64) {
            self.0.timers.fetch_add(1, Ordering::SeqCst);
        }
        fn affinity_cpus(&self) -> Option<usize> {
            self.0.affinity_cpus()
        }
    }
    let h = Broken(Counting::new(Some(2)));
    let start = h.now_ns();
    wait_until(&h, Wait::Timer, start + 30_000, 0);
    assert_eq!(h.0.take(), (30, 1));
    assert!(h.now_ns() >= start + 30_000);
}

/// Captures the log lines (`tracing` events at `info` or above, what the CLI shows) of one thread.
#[derive(Default, Clone)]
pub(crate) struct Lines(pub(crate) Arc<Mutex<Vec<String>>>);

struct Visit<'a>(&'a mut String);
impl tracing::field::Visit for Visit<'_> {
    fn record_debug(&mut self, _f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{v:?}"));
    }
}

impl tracing::Subscriber for Lines {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        static NEXT: AtomicUsize = AtomicUsize::new(1);
        tracing::span::Id::from_u64(NEXT.fetch_add(1, Ordering::Relaxed) as u64)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        if *e.metadata().level() > tracing::Level::INFO {
            return;
        }
        let mut s = String::new();
        e.record(&mut Visit(&mut s));
        self.0.lock().unwrap().push(s);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn logged_once_with_the_count() {
    for (cpus, switch) in
        [(Some(4), None), (Some(12), None), (None, None), (Some(12), Some("on")), (Some(3), Some(" off "))]
    {
        let lines = Lines::default();
        let s = builder(switch).build(Counting::new(cpus));
        crate::logs::scoped(lines.clone(), || {
            // The host's clock is the test's (it moves only on yields and timer waits).
            for _ in 0..5 {
                s.sleep(Caller::Guest, Duration::from_micros(20));
                s.sleep(Caller::Host, Duration::from_micros(20));
            }
        });
        let got = lines.0.lock().unwrap().clone();
        assert_eq!(got.len(), 1, "{got:?}");
        let count = cpus.map_or("unknown count".to_string(), |n| format!("{n} logical processors"));
        assert!(got[0].contains(&count), "{got:?} must name {count:?}");
        let says = format!(
            "guest {}, host {}",
            expected(cpus, switch, Caller::Guest).name(),
            expected(cpus, switch, Caller::Host).name()
        );
        assert!(got[0].contains(&says), "{got:?} must say {says:?}");
    }
}

/// The reference's fallback: where the machine has no timer (Windows before 10 1803 refuses the
/// high-resolution one), every sleep the rule would put on the timer or on the hybrid yields until
/// its deadline, short or long, guest or host, whatever the switch; the log line says so once with
/// the reason, and claims no timer.
#[test]
fn without_a_timer_every_sleep_yields_and_the_log_says_why() {
    let why = "CreateWaitableTimerExW(CREATE_WAITABLE_TIMER_HIGH_RESOLUTION) failed: refused";
    for cpus in counts() {
        for &switch in SWITCHES {
            for host_exact in [Wait::Yield, Wait::Timer, Wait::Hybrid] {
                let s = builder(switch).host_exact(host_exact).build(Counting::without_timer(cpus, why));
                let rule = s.rule();
                assert_eq!((rule.guest, rule.host), (Wait::Yield, Wait::Yield), "cpus {cpus:?}, switch {switch:?}");
                assert_eq!(rule.no_timer.as_deref(), Some(why));
                for caller in [Caller::Guest, Caller::Host] {
                    for d in [Duration::from_micros(20), Duration::from_micros(500), Duration::from_millis(2)] {
                        let got = sleep_counted(&s, caller, d);
                        assert_eq!(got, cost(Wait::Yield, d), "cpus {cpus:?}, switch {switch:?}, {caller:?}, {d:?}");
                    }
                }
            }
        }
    }
    for switch in [None, Some("on")] {
        let lines = Lines::default();
        let s = builder(switch).host_exact(Wait::Hybrid).build(Counting::without_timer(Some(4), why));
        crate::logs::scoped(lines.clone(), || {
            for _ in 0..3 {
                s.sleep(Caller::Guest, Duration::from_micros(20));
                s.sleep(Caller::Host, Duration::from_millis(1));
            }
        });
        let got = lines.0.lock().unwrap().clone();
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].contains("guest yield, host yield"), "{got:?}");
        assert!(got[0].contains(&format!("no timer here ({why})")), "{got:?} must give the reason");
        assert!(got[0].contains("4 logical processors"), "{got:?}");
        assert!(!got[0].contains("guest timer") && !got[0].contains("host timer"), "{got:?} claims the timer");
    }
}

#[test]
fn real_sleeps_end_at_or_after_their_deadline() {
    let s = Sleeper::builder().build(OsHost);
    for caller in [Caller::Guest, Caller::Host] {
        for d in [Duration::from_micros(20), Duration::from_micros(300), Duration::from_millis(1)] {
            let start = s.host().now_ns();
            s.sleep(caller, d);
            assert!(s.host().now_ns() >= start + d.as_nanos() as u64, "{caller:?} {d:?} woke early");
        }
    }
    for w in [Wait::Timer, Wait::Yield, Wait::Hybrid] {
        let deadline = OsHost.now_ns() + 200_000;
        wait_until(&OsHost, w, deadline, 50_000);
        assert!(OsHost.now_ns() >= deadline, "{w:?} woke early");
    }
}

#[test]
fn hybrid_waits_on_the_timer_until_the_margin() {
    for cpus in counts() {
        let s = builder(None).host_exact(Wait::Hybrid).build(Counting::new(cpus));
        // Margins 100 µs (long stage) and 20 µs (short), 1 µs a yield: a timer wait to 100 µs
        // before the deadline, one to 20 µs before it, then 20 yields (the spin is the short margin).
        assert_eq!(sleep_counted(&s, Caller::Host, Duration::from_micros(500)), (20, 2), "cpus {cpus:?}");
        assert_eq!(sleep_counted(&s, Caller::Host, Duration::from_millis(2)), (20, 2), "cpus {cpus:?}");
        // Shorter than the long margin: the short stage only.
        assert_eq!(sleep_counted(&s, Caller::Host, Duration::from_micros(60)), (20, 1), "cpus {cpus:?}");
        // Shorter than the short margin: all yields.
        assert_eq!(sleep_counted(&s, Caller::Host, Duration::from_micros(10)), (10, 0), "cpus {cpus:?}");
        assert_eq!(s.rule().host, Wait::Hybrid);
    }
    let s =
        builder(None).host_exact(Wait::Hybrid).hybrid_margin(Duration::from_micros(30)).build(Counting::new(Some(2)));
    assert_eq!(sleep_counted(&s, Caller::Host, Duration::from_micros(500)), (30, 1));
    // The switch set decides for the host too, hybrid or not.
    let s = builder(Some("on")).host_exact(Wait::Hybrid).build(Counting::new(Some(2)));
    assert_eq!(sleep_counted(&s, Caller::Host, Duration::from_micros(500)), (0, 1));
}

/// A clock whose timer wakes late by the next of a repeating list of lateness values, and whose
/// yields move it by [`YIELD_STEP`].
struct LateTimer {
    now: AtomicU64,
    late: Mutex<Vec<u64>>,
    wakes: AtomicU64,
}

impl LateTimer {
    fn new(late: Vec<u64>) -> Self {
        LateTimer { now: AtomicU64::new(1_000_000_000), late: Mutex::new(late), wakes: AtomicU64::new(0) }
    }
}

impl SchedHost for LateTimer {
    fn now_ns(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
    fn yield_now(&self) {
        self.now.fetch_add(YIELD_STEP, Ordering::SeqCst);
    }
    fn timer_wait_until(&self, deadline_ns: u64) {
        let k = self.wakes.fetch_add(1, Ordering::SeqCst) as usize;
        let late = self.late.lock().unwrap();
        self.now.fetch_max(deadline_ns + late[k % late.len()], Ordering::SeqCst);
    }
    fn affinity_cpus(&self) -> Option<usize> {
        Some(2)
    }
}

/// Sleeps 1 ms `n` times on the host's hybrid; returns the worst lateness past the deadline.
fn hybrid_sleeps(s: &Sleeper<LateTimer>, n: usize) -> u64 {
    let mut worst = 0;
    for _ in 0..n {
        let deadline = s.host().now_ns() + 1_000_000;
        s.sleep_until(Caller::Host, deadline);
        worst = worst.max(s.host().now_ns() - deadline);
    }
    worst
}

/// The hybrid learns its margin from the timer's lateness: on a quiet timer (20 µs late) it comes
/// down from 100 µs to just above 20 µs (it spins less) and no sleep ends late; when the timer gets
/// noisy (300 µs late) it grows past 300 µs within a few dozen wake-ups, and the sleeps are exact
/// again.
#[test]
fn the_hybrid_learns_its_margin_from_the_timers_lateness() {
    let s = builder(None).host_exact(Wait::Hybrid).build(LateTimer::new(vec![20_000]));
    assert_eq!(s.hybrid_margin(), HYBRID_MARGIN);
    hybrid_sleeps(&s, 6000);
    let m = s.hybrid_margin();
    assert!(m >= Duration::from_micros(20) && m <= Duration::from_micros(26), "{m:?}");
    assert!(hybrid_sleeps(&s, 1000) < YIELD_STEP, "a sleep ended late with the margin learned");
    *s.host().late.lock().unwrap() = vec![300_000];
    hybrid_sleeps(&s, 40);
    assert!(s.hybrid_margin() >= Duration::from_micros(300), "{:?}", s.hybrid_margin());
    assert!(hybrid_sleeps(&s, 100) < YIELD_STEP, "a sleep ended late with the margin relearned");
    // A fixed margin is not learned.
    let fixed = builder(None)
        .host_exact(Wait::Hybrid)
        .hybrid_margin(Duration::from_micros(50))
        .build(LateTimer::new(vec![20_000]));
    hybrid_sleeps(&fixed, 100);
    assert_eq!(fixed.hybrid_margin(), Duration::from_micros(50));
}

/// The margin follows a high percentile, not the mean or the worst: with 2 % of the wake-ups
/// 200 µs late it covers them; with 0.2 % it stays near the common 10 µs.
#[test]
fn the_learned_margin_is_a_high_percentile() {
    let mut late = vec![10_000; 100];
    late[37] = 200_000;
    late[71] = 200_000;
    let s = builder(None).host_exact(Wait::Hybrid).build(LateTimer::new(late));
    hybrid_sleeps(&s, 10_000);
    assert!(s.hybrid_margin() >= Duration::from_micros(150), "2 %: {:?}", s.hybrid_margin());
    let mut late = vec![10_000; 1000];
    late[500] = 200_000;
    late[900] = 200_000;
    let s = builder(None).host_exact(Wait::Hybrid).build(LateTimer::new(late));
    hybrid_sleeps(&s, 10_000);
    assert!(s.hybrid_margin() <= Duration::from_micros(30), "0.2 %: {:?}", s.hybrid_margin());
}
