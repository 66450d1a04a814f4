//! The sleeps' and the workers' benches.
//!
//! `sleep`: how short sleeps wait (yield loop, timer, hybrid with a fixed and with a learned
//! margin, and for comparison `std::thread::sleep` and the `spin_sleep` crate's default sleeper)
//! at 20 µs (a game's idle job loops) and at 1 ms (a frame limiter's wait): lateness p50/p99 and
//! the sleeping thread's CPU time per wall second. Then the reference's experiment: a frame thread
//! doing fixed work beside sleepers that sleep 20 µs in a loop, on 2 CPUs, with no sleepers, with
//! the sleepers yielding and with the sleepers by the rule. Arms alternate within each round;
//! medians over rounds.
//!
//! `workers`: a compile-like job (allocation-heavy tree passes) at 1, 2, 4 ... N workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use emuhost::sched::{
    HOST_EXACT_WAIT, LearnedMargin, OsHost, SchedHost, ShortSleepRule, TIMER_MAX_CPUS, Wait, restrict_thread_cpus,
    thread_cpu_time, wait_until, wait_until_learning,
};

use super::{Arm, BenchError, Comparison, median};
use crate::rng::Rng;

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
    pub fn name(self) -> &'static str {
        match self {
            Method::Wait(w) => w.name(),
            Method::Learned => "hybrid, learned",
            Method::Std => "std::thread::sleep",
            Method::SpinSleep => "spin_sleep",
        }
    }
}

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
    fn start(n: u64, wait: Wait, margin_ns: u64) -> Result<Sleepers, BenchError> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for i in 0..n {
            let stop = stop.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("sleeper{i}"))
                    .spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            wait_until(&OsHost, wait, OsHost.now_ns() + 20_000, margin_ns);
                        }
                    })
                    .map_err(|e| BenchError::doing("starting a sleeper thread", e))?,
            );
        }
        // Let them settle into their loop.
        std::thread::sleep(Duration::from_millis(20));
        Ok(Sleepers { stop, threads })
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
/// starts inherit the mask).
fn frame_experiment(a: &SleepBench, margin_ns: u64) -> Result<Frame, BenchError> {
    let (rounds, sleepers, frame_ms, want) = (a.rounds, a.sleepers, a.frame_ms, a.frame_cpus as usize);
    std::thread::scope(|s| {
        s.spawn(move || -> Result<Frame, BenchError> {
            let cpus = restrict_thread_cpus(want)
                .map_err(|e| BenchError::doing("restricting the frame thread's affinity mask", e))?;
            let rule = ShortSleepRule::decide(None, Some(cpus), TIMER_MAX_CPUS, HOST_EXACT_WAIT);
            // Calibrate: how many units make `frame_ms` alone.
            let t = Instant::now();
            let mut units = 0;
            while t.elapsed() < Duration::from_millis(frame_ms) {
                frame_work(8);
                units += 8;
            }
            let mut f = Frame { cpus, rule, none: Arm::default(), yielding: Arm::default(), by_rule: Arm::default() };
            for r in 0..rounds {
                // Rotate the order so no arm always runs first.
                for k in 0..3 {
                    match (r as usize + k) % 3 {
                        0 => f.none.round(|| Ok::<_, BenchError>(frame_work(units)))?,
                        1 => {
                            let _s = Sleepers::start(sleepers, Wait::Yield, margin_ns)?;
                            f.yielding.round(|| Ok::<_, BenchError>(frame_work(units)))?
                        }
                        _ => {
                            let _s = Sleepers::start(sleepers, f.rule.guest, margin_ns)?;
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
    for r in 0..a.rounds as usize {
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
    pub sleep_us: u64,
    pub sleeps: u32,
    pub method: Method,
    pub late_p50_us: f64,
    pub late_p99_us: f64,
    pub cpu_per_s: f64,
}

/// What `sleep` measured.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SleepReport {
    /// The learned hybrid's margin at the end, and what it spun after it.
    pub learned_margin: Duration,
    pub learned_spin: Duration,
    /// Every method at 20 µs, then at 1 ms.
    pub sleeps: Vec<SleepRow>,
    /// The frame experiment's processors and rule.
    pub frame_cpus: usize,
    pub rule: ShortSleepRule,
    /// The frame thread with no sleepers against sleepers by the rule.
    pub none_vs_rule: Comparison,
    /// The frame thread with sleepers yielding against sleepers by the rule.
    pub yield_vs_rule: Comparison,
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
    })
}

/// What `workers` measures.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WorkersBench {
    /// Rounds of each worker count (alternated).
    pub rounds: u32,
    /// Jobs per round (each a small compile: build, fold, lower a tree of ~20,000 nodes).
    pub jobs: u64,
    /// The most workers to try (1, 2, 4, ... up to it); `None`: the usable CPUs.
    pub max_workers: Option<u64>,
}

impl WorkersBench {
    pub fn new(rounds: u32, jobs: u64, max_workers: Option<u64>) -> Self {
        WorkersBench { rounds, jobs, max_workers }
    }
}

/// One worker count's figures.
#[derive(Clone, Debug)]
pub struct WorkersRow {
    pub workers: u64,
    pub median_ms: f64,
    pub jobs_per_s: f64,
    /// Jobs per second against one worker's.
    pub speedup: f64,
}

/// What `workers` measured.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WorkersReport {
    pub usable_cpus: u64,
    pub rows: Vec<WorkersRow>,
    /// `prepare_workers` on this machine where the allocator scales, and where it is locked.
    pub prepare_scales: usize,
    pub prepare_locked: usize,
}

pub fn workers(a: &WorkersBench) -> WorkersReport {
    let machine = emuhost::sched::Machine::read();
    let usable = machine.usable_cpus() as u64;
    let max = a.max_workers.unwrap_or(usable);
    let mut counts: Vec<u64> = std::iter::successors(Some(1u64), |n| Some(n * 2)).take_while(|n| *n < max).collect();
    counts.push(max);
    let mut arms: Vec<Arm> = counts.iter().map(|_| Arm::default()).collect();
    run_jobs(1, a.jobs.min(4), 0); // warm up
    for r in 0..a.rounds as usize {
        for k in 0..counts.len() {
            let i = (r + k) % counts.len();
            let _ = arms[i].round(|| Ok::<_, std::convert::Infallible>(run_jobs(counts[i], a.jobs, r as u64)));
        }
    }
    let base = a.jobs as f64 / (arms[0].median_ms() / 1e3);
    let rows = counts
        .iter()
        .zip(&arms)
        .map(|(&workers, arm)| {
            let jobs_per_s = a.jobs as f64 / (arm.median_ms() / 1e3);
            WorkersRow { workers, median_ms: arm.median_ms(), jobs_per_s, speedup: jobs_per_s / base }
        })
        .collect();
    WorkersReport {
        usable_cpus: usable,
        rows,
        prepare_scales: machine.prepare_workers(emuhost::sched::Allocator::Scales).count,
        prepare_locked: machine.prepare_workers(emuhost::sched::Allocator::Locked).count,
    }
}

/// A compiler's tree: boxed nodes, named symbols.
enum Node {
    Num(i64),
    Var(String),
    Bin(char, Box<Node>, Box<Node>),
    Let(String, Box<Node>, Box<Node>),
}

/// A deterministic pseudo-random tree of about `budget` nodes.
fn grow(rng: &mut Rng, budget: usize, depth: u32) -> Node {
    let r = rng.next_u64();
    if budget <= 1 || depth > 40 {
        return if r.is_multiple_of(3) { Node::Var(format!("v{}", r % 64)) } else { Node::Num((r % 1000) as i64) };
    }
    let left = budget / 2;
    let (a, b) = (Box::new(grow(rng, left, depth + 1)), Box::new(grow(rng, budget - 1 - left, depth + 1)));
    match r % 5 {
        0 => Node::Let(format!("v{}", r % 64), a, b),
        1 => Node::Bin('*', a, b),
        2 => Node::Bin('-', a, b),
        _ => Node::Bin('+', a, b),
    }
}

/// Constant folding and renaming: a new tree, as an optimizing pass makes.
fn fold(n: &Node, env: &mut std::collections::HashMap<String, i64>) -> Node {
    match n {
        Node::Num(v) => Node::Num(*v),
        Node::Var(s) => env.get(s).map_or_else(|| Node::Var(format!("{s}'")), |v| Node::Num(*v)),
        Node::Bin(op, a, b) => match (fold(a, env), fold(b, env)) {
            (Node::Num(x), Node::Num(y)) => Node::Num(match op {
                '*' => x.wrapping_mul(y) % 1_000_003,
                '-' => x.wrapping_sub(y),
                _ => x.wrapping_add(y),
            }),
            (x, y) => Node::Bin(*op, Box::new(x), Box::new(y)),
        },
        Node::Let(s, a, b) => {
            let a = fold(a, env);
            let old = if let Node::Num(v) = a { env.insert(s.clone(), v) } else { None };
            let b = fold(b, env);
            match old {
                Some(v) => env.insert(s.clone(), v),
                None => env.remove(s),
            };
            Node::Let(s.clone(), Box::new(a), Box::new(b))
        }
    }
}

/// Lowering to a flat instruction list with a symbol table; returns the value's index.
fn lower(n: &Node, out: &mut Vec<(u8, u32, u32)>, syms: &mut std::collections::HashMap<String, u32>) -> u32 {
    let ins = match n {
        Node::Num(v) => (0, *v as u32, 0),
        Node::Var(s) => {
            let k = syms.len() as u32;
            (1, *syms.entry(s.clone()).or_insert(k), 0)
        }
        Node::Bin(op, a, b) => (*op as u8, lower(a, out, syms), lower(b, out, syms)),
        Node::Let(s, a, b) => {
            let k = syms.len() as u32;
            let k = *syms.entry(s.clone()).or_insert(k);
            let x = lower(a, out, syms);
            out.push((2, k, x));
            (3, lower(b, out, syms), 0)
        }
    };
    out.push(ins);
    out.len() as u32 - 1
}

/// One compile-like job: generate, fold twice, lower; everything allocated is freed at the end.
fn compile_job(seed: u64) -> u64 {
    let tree = grow(&mut Rng::new(seed), 20_000, 0);
    let mut env = std::collections::HashMap::new();
    let once = fold(&tree, &mut env);
    drop(tree);
    let twice = fold(&once, &mut env);
    drop(once);
    let (mut out, mut syms) = (Vec::new(), std::collections::HashMap::new());
    let last = lower(&twice, &mut out, &mut syms);
    out.iter().fold(u64::from(last), |h, &(a, b, c)| h.rotate_left(5) ^ u64::from(a) ^ u64::from(b) << 8 ^ u64::from(c))
}

/// Runs `jobs` jobs on `workers` threads pulling from one counter.
fn run_jobs(workers: u64, jobs: u64, round: u64) -> u64 {
    let next = std::sync::atomic::AtomicU64::new(0);
    let sum = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    if j >= jobs {
                        break;
                    }
                    sum.fetch_xor(compile_job(j + round * jobs), Ordering::Relaxed);
                }
            });
        }
    });
    sum.into_inner()
}
