//! `emuhost bench sleep`: how short sleeps wait (yield loop, timer, hybrid with a fixed and with a
//! learned margin, and for comparison `std::thread::sleep` and the `spin_sleep` crate's default
//! sleeper) at 20 µs (a game's idle job loops) and at 1 ms (a frame limiter's wait):
//! lateness p50/p99 and the sleeping thread's CPU time per wall second. Then the reference's
//! experiment: a frame thread doing fixed work beside sleepers that sleep 20 µs in a loop, on 2
//! CPUs, with no sleepers, with the sleepers yielding and with the sleepers by the rule.
//! Arms alternate within each round; medians over rounds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use emuhost::sched::{
    HOST_EXACT_WAIT, HYBRID_MARGIN, LearnedMargin, OsHost, SchedHost, ShortSleepRule, TIMER_MAX_CPUS, Wait,
    restrict_thread_cpus, thread_cpu_time, wait_until, wait_until_learning,
};
use emuhost_lab::quantile::quantile;
use emuhost_lab::rng::Rng;
use serde_json::json;

use super::{Arm, Comparison, Report, median};
use crate::Outcome;

#[derive(clap::Args)]
pub struct Args {
    /// Rounds of each arm (alternated).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Sleeps of 20 µs per arm and round.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u32).range(100..))]
    short_sleeps: u32,
    /// Sleeps of 1 ms per arm and round.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(100..))]
    long_sleeps: u32,
    /// The fixed-margin hybrid's margin in µs (the library's starting margin is the default; the
    /// learned arm starts there and learns).
    #[arg(long, default_value_t = HYBRID_MARGIN.as_micros() as u64)]
    margin_us: u64,
    /// Processors for the frame experiment (the first ones of this process's affinity mask).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=1024))]
    frame_cpus: u64,
    /// Threads sleeping 20 µs in a loop beside the frame thread.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=256))]
    sleepers: u64,
    /// The frame thread's fixed work, as milliseconds of it alone on a CPU (calibrated once).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(10..=60000))]
    frame_ms: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// One way to sleep.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Method {
    /// `Wait::Hybrid` here is the hybrid with the fixed margin (`--margin-us`).
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
    fn name(self) -> &'static str {
        match self {
            Method::Wait(w) => w.name(),
            Method::Learned => "hybrid, learned",
            Method::Std => "std::thread::sleep",
            Method::SpinSleep => "spin_sleep",
        }
    }
}

const METHODS: [Method; 6] = [
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
    arm.p50_us.push(quantile(&late, 0.50));
    arm.p99_us.push(quantile(&late, 0.99));
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
    fn start(n: u64, wait: Wait, margin_ns: u64) -> anyhow::Result<Sleepers> {
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
                    .context("starting a sleeper thread")?,
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

struct Frame {
    cpus: usize,
    rule: ShortSleepRule,
    none: Arm,
    yielding: Arm,
    by_rule: Arm,
}

/// The frame experiment, on a thread restricted to `--frame-cpus` processors (the sleepers it
/// starts inherit the mask).
fn frame_experiment(a: &Args, margin_ns: u64) -> anyhow::Result<Frame> {
    let (rounds, sleepers, frame_ms, want) = (a.rounds, a.sleepers, a.frame_ms, a.frame_cpus as usize);
    std::thread::scope(|s| {
        s.spawn(move || -> anyhow::Result<Frame> {
            let cpus = restrict_thread_cpus(want).context("restricting the frame thread's affinity mask")?;
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
                        0 => f.none.round(|| anyhow::Ok(frame_work(units)))?,
                        1 => {
                            let _s = Sleepers::start(sleepers, Wait::Yield, margin_ns)?;
                            f.yielding.round(|| anyhow::Ok(frame_work(units)))?
                        }
                        _ => {
                            let _s = Sleepers::start(sleepers, f.rule.guest, margin_ns)?;
                            f.by_rule.round(|| anyhow::Ok(frame_work(units)))?
                        }
                    };
                }
            }
            Ok(f)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the frame thread panicked"))?
    })
}

/// Every method at every duration, `a.rounds` rounds, the methods' order rotated each round.
fn sleep_arms(a: &Args, durations: &[(Duration, u32)], margin_ns: u64, learned: &LearnedMargin) -> Vec<Vec<SleepArm>> {
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

/// The figures the targets judge: the guest's 20 µs timer CPU; p99 and CPU of the 1 ms host wait
/// (the learned hybrid), of the yield loop and of spin_sleep.
struct Headline {
    timer20_cpu: f64,
    h_p99: f64,
    h_cpu: f64,
    y_p99: f64,
    y_cpu: f64,
    s_p99: f64,
    s_cpu: f64,
}

/// The text table of the sleeps and the targets.
fn print_sleeps(a: &Args, learned: &LearnedMargin, rows: &[serde_json::Value], h: Headline) {
    let Headline { timer20_cpu, h_p99, h_cpu, y_p99, y_cpu, s_p99, s_cpu } = h;
    let met = |b: bool| if b { "met" } else { "NOT met" };
    outln!(
        "short sleeps ({} rounds, medians; hybrid margin {} µs fixed; learned at the end: {:.1} µs, then {:.1} µs spun)",
        a.rounds,
        a.margin_us,
        learned.get().as_secs_f64() * 1e6,
        learned.spin().as_secs_f64() * 1e6
    );
    outln!("  {:>8}  {:<20} {:>12} {:>12} {:>12}", "sleep", "method", "late p50 µs", "late p99 µs", "CPU per s");
    for r in rows {
        outln!(
            "  {:>6}µs  {:<20} {:>12.1} {:>12.1} {:>12.3}",
            r["sleep_us"],
            r["method"].as_str().unwrap_or(""),
            r["late_p50_us"].as_f64().unwrap_or(f64::NAN),
            r["late_p99_us"].as_f64().unwrap_or(f64::NAN),
            r["cpu_per_s"].as_f64().unwrap_or(f64::NAN)
        );
    }
    outln!(
        "  1 ms hybrid (learned) against the yield loop: p99 late {h_p99:.1} vs {y_p99:.1} µs at {:.0} % of its CPU ({h_cpu:.3} vs {y_cpu:.3})",
        100.0 * h_cpu / y_cpu
    );
    outln!(
        "  1 ms hybrid (learned) against spin_sleep: p99 late {h_p99:.1} vs {s_p99:.1} µs ({:.2}x), CPU {h_cpu:.3} vs {s_cpu:.3} ({:.2}x)",
        h_p99 / s_p99,
        h_cpu / s_cpu
    );
    outln!("  target: guest 20 µs on the timer <= 0.25 CPU: {timer20_cpu:.3} ({})", met(timer20_cpu <= 0.25));
    outln!(
        "  target: host exact 1 ms wait p99 <= 10 µs at <= 0.05 CPU: {h_p99:.1} µs, {h_cpu:.3} ({})",
        met(h_p99 <= 10.0 && h_cpu <= 0.05)
    );
    outln!("  target: host 1 ms wait beats spin_sleep's p99 at no more CPU: {}", met(h_p99 <= s_p99 && h_cpu <= s_cpu));
}

// Over 80 lines: the two frame comparisons and the JSON report are built in one place, in the
// order the text report prints them.
pub fn run(a: Args) -> anyhow::Result<Outcome> {
    if cfg!(debug_assertions) {
        eprintln!("emuhost: warning: a debug build; measure with `cargo build --release`");
    }
    let margin_ns = a.margin_us * 1000;
    let durations = [(Duration::from_micros(20), a.short_sleeps), (Duration::from_millis(1), a.long_sleeps)];
    let learned = LearnedMargin::new(HYBRID_MARGIN);
    let arms = sleep_arms(&a, &durations, margin_ns, &learned);
    let frame = frame_experiment(&a, margin_ns)?;
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
        new: Arm { times: none_vs_rule.new.times.clone(), calls: none_vs_rule.new.calls.clone() },
        target_time: None,
        target_calls: None,
    };

    let rows: Vec<serde_json::Value> = durations
        .iter()
        .enumerate()
        .flat_map(|(di, &(d, n))| {
            let arms = &arms[di];
            METHODS.iter().enumerate().map(move |(mi, m)| {
                let (p50, p99, cpu) = arms[mi].medians();
                json!({ "sleep_us": d.as_micros() as u64, "sleeps": n, "method": m.name(), "late_p50_us": p50, "late_p99_us": p99, "cpu_per_s": cpu })
            })
        })
        .collect();
    let at = |di: usize, m: Method| arms[di][METHODS.iter().position(|x| *x == m).unwrap()].medians();
    let (_, _, timer20_cpu) = at(0, Method::Wait(Wait::Timer));
    let (_, h_p99, h_cpu) = at(1, Method::Learned);
    let (_, y_p99, y_cpu) = at(1, Method::Wait(Wait::Yield));
    let (_, s_p99, s_cpu) = at(1, Method::SpinSleep);
    let beats_spin = h_p99 <= s_p99 && h_cpu <= s_cpu;
    let targets = json!({
        "guest_20us_timer_cpu_le_0_25": timer20_cpu <= 0.25,
        "host_1ms_hybrid_p99_le_10us": h_p99 <= 10.0,
        "host_1ms_hybrid_cpu_le_0_05": h_cpu <= 0.05,
        "host_1ms_hybrid_beats_spin_sleep": beats_spin,
        "frame_within_3pct_of_no_sleepers": none_vs_rule.old.median_ms() / none_vs_rule.new.median_ms() >= 0.97,
    });
    if a.json {
        outln!(
            "{}",
            json!({
                "bench": "sleep",
                "rounds": a.rounds,
                "hybrid_margin_us": a.margin_us,
                "learned_margin_us": learned.get().as_secs_f64() * 1e6,
                "learned_spin_us": learned.spin().as_secs_f64() * 1e6,
                "sleeps": rows,
                "frame": [none_vs_rule.json(), yield_vs_rule.json()],
                "targets": targets,
            })
        );
        return Ok(Outcome::Ok);
    }
    let met = |b: bool| if b { "met" } else { "NOT met" };
    print_sleeps(&a, &learned, &rows, Headline { timer20_cpu, h_p99, h_cpu, y_p99, y_cpu, s_p99, s_cpu });
    // Comparison::print would show a calls ratio of 0/0: these arms make no counted calls.
    outln!("{} ({} rounds)", none_vs_rule.name, a.rounds);
    for (name, arm) in [
        ("no sleepers", &none_vs_rule.old),
        ("sleepers yielding", &yield_vs_rule.old),
        ("sleepers by the rule", &none_vs_rule.new),
    ] {
        outln!("  {name:<28} median {:>10.3} ms", arm.median_ms());
    }
    let within = none_vs_rule.old.median_ms() / none_vs_rule.new.median_ms();
    outln!("  no sleepers / the rule   {within:.3}x (target >= 0.97x: {})", met(within >= 0.97));
    outln!(
        "  yielding / the rule      {:.3}x (above 1: the rule leaves the frame thread more)",
        yield_vs_rule.old.median_ms() / yield_vs_rule.new.median_ms()
    );
    Ok(Outcome::Ok)
}

/// `emuhost bench workers`.
#[derive(clap::Args)]
pub struct WorkersArgs {
    /// Rounds of each worker count (alternated).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Jobs per round (each a small compile: build, fold, lower a tree of ~20,000 nodes).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    jobs: u64,
    /// The most workers to try (1, 2, 4, ... up to it); default: the usable CPUs.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    max_workers: Option<u64>,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
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

pub fn run_workers(a: WorkersArgs) -> anyhow::Result<Outcome> {
    if cfg!(debug_assertions) {
        eprintln!("emuhost: warning: a debug build; measure with `cargo build --release`");
    }
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
            arms[i].round(|| anyhow::Ok(run_jobs(counts[i], a.jobs, r as u64)))?;
        }
    }
    let allocator = if cfg!(feature = "mimalloc") { "mimalloc" } else { "system (glibc malloc)" };
    let base = a.jobs as f64 / (arms[0].median_ms() / 1e3);
    let rows: Vec<serde_json::Value> = counts
        .iter()
        .zip(&arms)
        .map(|(w, arm)| {
            let jps = a.jobs as f64 / (arm.median_ms() / 1e3);
            json!({ "workers": w, "median_ms": arm.median_ms(), "jobs_per_s": jps, "speedup": jps / base })
        })
        .collect();
    let scales = machine.prepare_workers(emuhost::sched::Allocator::Scales).count;
    let locked = machine.prepare_workers(emuhost::sched::Allocator::Locked).count;
    if a.json {
        outln!(
            "{}",
            json!({ "bench": "workers", "allocator": allocator, "usable_cpus": usable, "jobs": a.jobs, "rounds": a.rounds,
                    "results": rows, "prepare_workers": { "scales": scales, "locked": locked } })
        );
        return Ok(Outcome::Ok);
    }
    outln!(
        "compile-like jobs ({} per round, {} rounds, medians), allocator {allocator}, {usable} usable CPUs",
        a.jobs,
        a.rounds
    );
    outln!("  {:>8} {:>12} {:>10} {:>8}", "workers", "median ms", "jobs/s", "speed-up");
    for r in &rows {
        outln!(
            "  {:>8} {:>12.1} {:>10.1} {:>7.2}x",
            r["workers"],
            r["median_ms"].as_f64().unwrap_or(f64::NAN),
            r["jobs_per_s"].as_f64().unwrap_or(f64::NAN),
            r["speedup"].as_f64().unwrap_or(f64::NAN)
        );
    }
    outln!("  prepare_workers on this machine: {scales} where the allocator scales, {locked} where it is locked");
    Ok(Outcome::Ok)
}
