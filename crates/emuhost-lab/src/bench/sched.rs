//! The sleeps' bench (the workers' is [`super::workers`]).
//!
//! `sleep`: how short sleeps wait (yield loop, timer, hybrid with a fixed and with a learned
//! margin, and for comparison `std::thread::sleep` and the `spin_sleep` crate's default sleeper)
//! at 20 µs (a game's idle job loops) and at 1 ms (a frame limiter's wait): lateness p50/p99 and
//! the sleeping thread's CPU time per wall second. Then the reference's experiment: a frame thread
//! doing fixed work beside sleepers that sleep 20 µs in a loop, on 2 CPUs, with no sleepers, with
//! the sleepers yielding and with the sleepers by the rule. Arms alternate within each round;
//! medians over rounds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use emuhost::sched::{
    HOST_EXACT_WAIT, LearnedMargin, OsHost, SchedHost, ShortSleepRule, TIMER_MAX_CPUS, Wait, restrict_thread_cpus,
    thread_cpu_time, wait_until, wait_until_learning,
};

use super::{Arm, BenchError, Comparison, median};

/// What `sleep` measures.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SleepBench {
    /// Rounds of each arm (alternated).
    pub rounds: u32,
    /// Sleeps of 20 µs per arm and round.
    pub short_sleeps: u32,
    /// Sleeps of 1 ms per arm and round.
    pub long_sleeps: u32,
    /// The fixed-margin hybrid's margin in µs (the learned arm starts at the library's margin).
    pub margin_us: u64,
    /// Processors for the frame experiment (the first ones of this process's affinity mask).
    pub frame_cpus: u64,
    /// Threads sleeping 20 µs in a loop beside the frame thread.
    pub sleepers: u64,
    /// The frame thread's fixed work, as milliseconds of it alone on a CPU (calibrated once).
    pub frame_ms: u64,
}

impl SleepBench {
    /// `rounds` rounds of `short_sleeps` 20 µs sleeps and `long_sleeps` 1 ms sleeps per arm, the
    /// fixed-margin hybrid at `margin_us`; the frame experiment on 2 CPUs, 4 sleepers, 300 ms of
    /// work (change it with [`frame`](Self::frame)).
    pub fn new(rounds: u32, short_sleeps: u32, long_sleeps: u32, margin_us: u64) -> Self {
        SleepBench { rounds, short_sleeps, long_sleeps, margin_us, frame_cpus: 2, sleepers: 4, frame_ms: 300 }
    }

    /// The frame experiment: `cpus` processors, `sleepers` threads, `frame_ms` of work.
    pub fn frame(mut self, cpus: u64, sleepers: u64, frame_ms: u64) -> Self {
        (self.frame_cpus, self.sleepers, self.frame_ms) = (cpus, sleepers, frame_ms);
        self
    }
}

/// One way to sleep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// `Wait::Hybrid` here is the hybrid with the fixed margin ([`SleepBench::margin_us`]).
    Wait(Wait),
    /// The hybrid with the margins it learns, in two stages ([`LearnedMargin`]): a sleeper's
    /// host wait.
    Learned,
    /// `std::thread::sleep`: a relative `clock_nanosleep` with the default timer slack.
    Std,
    /// `spin_sleep::SpinSleeper::default()` (1.x): sleeps natively, then spins the rest.
    SpinSleep,
}

impl Method {
    /// The method's name in the report (`yield`, `hybrid, learned`, `spin_sleep` ...).
    pub fn name(self) -> &'static str {
        match self {
            Method::Wait(w) => w.name(),
            Method::Learned => "hybrid, learned",
            Method::Std => "std::thread::sleep",
            Method::SpinSleep => "spin_sleep",
        }
    }
}

/// Every method `sleep` measures, in the report's order.
pub const METHODS: [Method; 6] = [
    Method::Wait(Wait::Yield),
    Method::Wait(Wait::Timer),
    Method::Wait(Wait::Hybrid),
    Method::Learned,
    Method::Std,
    Method::SpinSleep,
];

/// One method's rounds at one duration: lateness p50, p99 (µs) and CPU per wall second of each.
#[derive(Default)]
struct SleepArm {
    p50_us: Vec<f64>,
    p99_us: Vec<f64>,
    cpu: Vec<f64>,
}

impl SleepArm {
    fn medians(&self) -> (f64, f64, f64) {
        (median(&mut self.p50_us.clone()), median(&mut self.p99_us.clone()), median(&mut self.cpu.clone()))
    }
}

/// `n` sleeps of `d` by `m`; pushes the round's lateness percentiles and CPU per wall second.
/// `learned`: the learned arm's margin, kept from round to round (as a sleeper keeps it).
fn sleep_round(m: Method, d: Duration, n: u32, margin_ns: u64, learned: &LearnedMargin, arm: &mut SleepArm) {
    let host = OsHost;
    let spin = spin_sleep::SpinSleeper::default();
    let mut late = Vec::with_capacity(n as usize);
    let (cpu0, wall0) = (thread_cpu_time(), Instant::now());
    for _ in 0..n {
        let deadline = host.now_ns() + d.as_nanos() as u64;
        match m {
            Method::Wait(w) => wait_until(&host, w, deadline, margin_ns),
            Method::Learned => wait_until_learning(&host, deadline, learned),
            Method::Std => std::thread::sleep(d),
            Method::SpinSleep => spin.sleep(d),
        }
        late.push(host.now_ns().saturating_sub(deadline) as f64 / 1e3);
    }
    let cpu = (thread_cpu_time() - cpu0).as_secs_f64() / wall0.elapsed().as_secs_f64();
    late.sort_by(|a, b| a.total_cmp(b));
    arm.p50_us.push(crate::quantile::quantile(&late, 0.50));
    arm.p99_us.push(crate::quantile::quantile(&late, 0.99));
    arm.cpu.push(cpu);
}

/// Fixed work for the frame thread: `units` rounds of mixing a 16 KiB buffer.
fn frame_work(units: u64) -> u64 {
    let mut buf = [0u64; 2048];
    let mut acc = 0x9e37_79b9_7f4a_7c15u64;
    for u in 0..units {
        for (i, x) in buf.iter_mut().enumerate() {
            acc = acc.rotate_left(7) ^ (*x).wrapping_add(i as u64 ^ u);
            *x = acc.wrapping_mul(0xff51_afd7_ed55_8ccd);
        }
    }
    std::hint::black_box(acc ^ buf[17])
}

/// Sleepers sleeping 20 µs in a loop by `wait` until dropped.
struct Sleepers {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Sleepers {
    /// `n` sleepers, each restricted to the first `cpus` processors of the process's affinity
    /// mask: a thread inherits its creator's mask on Linux but not on Windows, so each restricts
    /// itself, and one that cannot fails the bench.
    fn start(n: u64, cpus: usize, wait: Wait, margin_ns: u64) -> Result<Sleepers, BenchError> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..n {
            let (stop, tx) = (stop.clone(), tx.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("sleeper{i}"))
                    .spawn(move || {
                        let got = restrict_thread_cpus(cpus);
                        let ok = matches!(got, Ok(n) if n == cpus);
                        let _ = tx.send(got);
                        drop(tx);
                        while ok && !stop.load(Ordering::Relaxed) {
                            wait_until(&OsHost, wait, OsHost.now_ns() + 20_000, margin_ns);
                        }
                    })
                    .map_err(|e| BenchError::doing("starting a sleeper thread", e))?,
            );
        }
        drop(tx);
        let sleepers = Sleepers { stop, threads };
        for got in rx.iter().take(n as usize) {
            match got {
                Ok(k) if k == cpus => {}
                Ok(k) => {
                    let e = std::io::Error::other(format!("a sleeper got {k} processors, not {cpus}"));
                    return Err(BenchError::doing("restricting a sleeper's affinity mask", e));
                }
                Err(e) => return Err(BenchError::doing("restricting a sleeper's affinity mask", e)),
            }
        }
        // Let them settle into their loop.
        std::thread::sleep(Duration::from_millis(20));
        Ok(sleepers)
    }
}

impl Drop for Sleepers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The frame experiment's arms.
struct Frame {
    cpus: usize,
    rule: ShortSleepRule,
    none: Arm,
    yielding: Arm,
    by_rule: Arm,
}

/// The frame experiment, on a thread restricted to `frame_cpus` processors (the sleepers it
/// starts restrict themselves to the same ones).
fn frame_experiment(a: &SleepBench, margin_ns: u64) -> Result<Frame, BenchError> {
    let (rounds, sleepers, frame_ms, want) = (a.rounds, a.sleepers, a.frame_ms, a.frame_cpus as usize);
    std::thread::scope(|s| {
        s.spawn(move || -> Result<Frame, BenchError> {
            let cpus = restrict_thread_cpus(want)
                .map_err(|e| BenchError::doing("restricting the frame thread's affinity mask", e))?;
            let rule = ShortSleepRule::decide(None, Some(cpus), TIMER_MAX_CPUS, HOST_EXACT_WAIT)
                .without_timer(OsHost.timer_missing());
            // Calibrate: how many units make `frame_ms` alone.
            let t = Instant::now();
            let mut units = 0;
            while t.elapsed() < Duration::from_millis(frame_ms) {
                frame_work(8);
                units += 8;
            }
            let mut f = Frame { cpus, rule, none: Arm::default(), yielding: Arm::default(), by_rule: Arm::default() };
            super::progress::plan(u64::from(rounds));
            for r in 0..rounds {
                super::progress::tick();
                // Rotate the order so no arm always runs first.
                for k in 0..3 {
                    match (r as usize + k) % 3 {
                        0 => f.none.round(|| Ok::<_, BenchError>(frame_work(units)))?,
                        1 => {
                            let _s = Sleepers::start(sleepers, cpus, Wait::Yield, margin_ns)?;
                            f.yielding.round(|| Ok::<_, BenchError>(frame_work(units)))?
                        }
                        _ => {
                            let _s = Sleepers::start(sleepers, cpus, f.rule.guest, margin_ns)?;
                            f.by_rule.round(|| Ok::<_, BenchError>(frame_work(units)))?
                        }
                    };
                }
            }
            Ok(f)
        })
        .join()
        .map_err(|_| BenchError::Panicked("the frame thread"))?
    })
}

/// Every method at every duration, `a.rounds` rounds, the methods' order rotated each round.
fn sleep_arms(
    a: &SleepBench,
    durations: &[(Duration, u32)],
    margin_ns: u64,
    learned: &LearnedMargin,
) -> Vec<Vec<SleepArm>> {
    let mut arms: Vec<Vec<SleepArm>> =
        durations.iter().map(|_| METHODS.iter().map(|_| SleepArm::default()).collect()).collect();
    super::progress::plan(u64::from(a.rounds));
    for r in 0..a.rounds as usize {
        super::progress::tick();
        for (di, &(d, n)) in durations.iter().enumerate() {
            for k in 0..METHODS.len() {
                let mi = (r + k) % METHODS.len();
                sleep_round(METHODS[mi], d, n, margin_ns, learned, &mut arms[di][mi]);
            }
        }
    }
    arms
}

/// One method's medians at one duration.
#[derive(Clone, Debug)]
pub struct SleepRow {
    /// The sleep asked for, in µs (20 or 1,000).
    pub sleep_us: u64,
    /// Sleeps per round.
    pub sleeps: u32,
    /// The method.
    pub method: Method,
    /// Lateness (woken after the time asked), median over the rounds of each round's median, in µs.
    pub late_p50_us: f64,
    /// Lateness, median over the rounds of each round's 99th percentile, in µs.
    pub late_p99_us: f64,
    /// The sleeping thread's CPU time per second of wall time while it slept (1.0: a CPU busy).
    pub cpu_per_s: f64,
}

/// What `sleep` measured.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SleepReport {
    /// The learned hybrid's margin at the end ([`LearnedMargin::get`]).
    pub learned_margin: Duration,
    /// The learned hybrid's short stage's margin at the end ([`LearnedMargin::spin`]).
    pub learned_spin: Duration,
    /// Every method at 20 µs, then at 1 ms.
    pub sleeps: Vec<SleepRow>,
    /// The frame experiment's processors.
    pub frame_cpus: usize,
    /// The short-sleep rule the runtime picks for that many processors (the sleepers' "by the rule").
    pub rule: ShortSleepRule,
    /// The frame thread with no sleepers against sleepers by the rule.
    pub none_vs_rule: Comparison,
    /// The frame thread with sleepers yielding against sleepers by the rule.
    pub yield_vs_rule: Comparison,
    /// Wine's version where this ran under Wine (its figures are Wine's, not Windows').
    pub wine: Option<String>,
}

impl SleepReport {
    /// The medians (p50, p99, CPU per second) of `method` at the 20 µs sleeps (`long` false) or
    /// the 1 ms ones.
    pub fn at(&self, long: bool, method: Method) -> (f64, f64, f64) {
        let us = if long { 1000 } else { 20 };
        self.sleeps
            .iter()
            .find(|r| r.sleep_us == us && r.method == method)
            .map_or((f64::NAN, f64::NAN, f64::NAN), |r| (r.late_p50_us, r.late_p99_us, r.cpu_per_s))
    }
}

/// Runs the `sleep` bench (see the module's docs). It takes a while: the sleeps and
/// `rounds` × 3 frames of `frame_ms` work.
///
/// # Errors
///
/// [`BenchError::Runtime`] where the frame thread's affinity mask could not be restricted or a
/// sleeper could not be started; [`BenchError::Panicked`] where a thread of the bench panicked.
pub fn sleep(a: &SleepBench) -> Result<SleepReport, BenchError> {
    let margin_ns = a.margin_us * 1000;
    let durations = [(Duration::from_micros(20), a.short_sleeps), (Duration::from_millis(1), a.long_sleeps)];
    let learned = LearnedMargin::new(emuhost::sched::HYBRID_MARGIN);
    let arms = sleep_arms(a, &durations, margin_ns, &learned);
    let frame = frame_experiment(a, margin_ns)?;
    let none_vs_rule = Comparison {
        name: format!(
            "frame thread's fixed work on {} CPUs beside {} threads sleeping 20 µs: no sleepers vs the rule ({})",
            frame.cpus,
            a.sleepers,
            frame.rule.guest.name()
        ),
        old_name: "no sleepers",
        new_name: "sleepers by the rule",
        old: frame.none,
        new: frame.by_rule,
        target_time: Some(0.97),
        target_calls: None,
    };
    let yield_vs_rule = Comparison {
        name: format!("the frame thread: sleepers yielding vs sleepers by the rule ({})", frame.rule.guest.name()),
        old_name: "sleepers yielding",
        new_name: "sleepers by the rule",
        old: frame.yielding,
        new: none_vs_rule.new.clone(),
        target_time: None,
        target_calls: None,
    };
    let sleeps = durations
        .iter()
        .zip(&arms)
        .flat_map(|(&(d, n), arms)| {
            METHODS.iter().zip(arms).map(move |(&method, arm)| {
                let (late_p50_us, late_p99_us, cpu_per_s) = arm.medians();
                SleepRow { sleep_us: d.as_micros() as u64, sleeps: n, method, late_p50_us, late_p99_us, cpu_per_s }
            })
        })
        .collect();
    Ok(SleepReport {
        learned_margin: learned.get(),
        learned_spin: learned.spin(),
        sleeps,
        frame_cpus: frame.cpus,
        rule: frame.rule,
        none_vs_rule,
        yield_vs_rule,
        wine: emuhost::probe::wine_version(),
    })
}
