//! The workers' bench: a compile-like job (allocation-heavy tree passes: build, fold twice, lower)
//! at 1, 2, 4 ... N workers, jobs per second and the speed-up against one worker. Round by round
//! ([`Workers::round`]), so that a caller can alternate this process's rounds with another
//! process's: on Windows, `emuhost bench workers` runs a copy of the exe without the manifest (the
//! NT heap) as the other arm of the same run.

use std::sync::atomic::Ordering;

use super::Arm;
use crate::rng::Rng;

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
    /// The bench with these fields (see each field).
    pub fn new(rounds: u32, jobs: u64, max_workers: Option<u64>) -> Self {
        WorkersBench { rounds, jobs, max_workers }
    }
}

/// One worker count's figures.
#[derive(Clone, Debug)]
pub struct WorkersRow {
    /// Worker threads.
    pub workers: u64,
    /// The rounds' median wall time for the round's jobs, in milliseconds.
    pub median_ms: f64,
    /// Jobs per second at that median.
    pub jobs_per_s: f64,
    /// Jobs per second against one worker's.
    pub speedup: f64,
}

/// What `workers` measured.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WorkersReport {
    /// The CPUs this process may run on.
    pub usable_cpus: u64,
    /// Each worker count's figures, fewest workers first.
    pub rows: Vec<WorkersRow>,
    /// `prepare_workers` on this machine where the allocator scales, and where it is locked.
    pub prepare_scales: usize,
    /// See `prepare_scales`.
    pub prepare_locked: usize,
}

/// The worker counts up to `max`: 1, 2, 4 ... and `max` itself.
pub fn worker_counts(max: u64) -> Vec<u64> {
    let max = max.max(1);
    let mut counts: Vec<u64> = std::iter::successors(Some(1u64), |n| Some(n * 2)).take_while(|n| *n < max).collect();
    counts.push(max);
    counts
}

/// The workers bench in this process, one round at a time: every worker count once a round, the
/// order rotated by the round's number.
pub struct Workers {
    jobs: u64,
    machine: emuhost::sched::Machine,
    counts: Vec<u64>,
    arms: Vec<Arm>,
}

impl Workers {
    /// Reads the machine, settles the worker counts and warms up (a few jobs on one worker).
    pub fn new(a: &WorkersBench) -> Workers {
        let machine = emuhost::sched::Machine::read();
        let counts = worker_counts(a.max_workers.unwrap_or(machine.usable_cpus() as u64));
        let arms = counts.iter().map(|_| Arm::default()).collect();
        run_jobs(1, a.jobs.min(4), 0); // warm up
        Workers { jobs: a.jobs, machine, counts, arms }
    }

    /// The worker counts, smallest first.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// Round `r`: each worker count runs the round's jobs once (the jobs' seeds are the round's,
    /// so another process's round `r` does the same work).
    pub fn round(&mut self, r: u32) {
        for k in 0..self.counts.len() {
            let i = (r as usize + k) % self.counts.len();
            let (workers, jobs) = (self.counts[i], self.jobs);
            let _ = self.arms[i].round(|| Ok::<_, std::convert::Infallible>(run_jobs(workers, jobs, u64::from(r))));
        }
    }

    /// Each worker count's rounds so far (wall times), in the order of [`Workers::counts`].
    pub fn arms(&self) -> &[Arm] {
        &self.arms
    }

    /// The medians so far.
    pub fn report(&self) -> WorkersReport {
        WorkersReport {
            usable_cpus: self.machine.usable_cpus() as u64,
            rows: rows(self.jobs, &self.counts, &self.arms),
            prepare_scales: self.machine.prepare_workers(emuhost::sched::Allocator::Scales).count,
            prepare_locked: self.machine.prepare_workers(emuhost::sched::Allocator::Locked).count,
        }
    }
}

/// Each count's median, jobs per second and speed-up against the first count's.
pub fn rows(jobs: u64, counts: &[u64], arms: &[Arm]) -> Vec<WorkersRow> {
    let per_s = |arm: &Arm| jobs as f64 / (arm.median_ms() / 1e3);
    let base = arms.first().map_or(f64::NAN, per_s);
    counts
        .iter()
        .zip(arms)
        .map(|(&workers, arm)| {
            let jobs_per_s = per_s(arm);
            WorkersRow { workers, median_ms: arm.median_ms(), jobs_per_s, speedup: jobs_per_s / base }
        })
        .collect()
}

/// The whole bench in this process: `a.rounds` rounds, then the medians.
pub fn workers(a: &WorkersBench) -> WorkersReport {
    let mut w = Workers::new(a);
    super::progress::plan(u64::from(a.rounds));
    for r in 0..a.rounds {
        super::progress::tick();
        w.round(r);
    }
    w.report()
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
