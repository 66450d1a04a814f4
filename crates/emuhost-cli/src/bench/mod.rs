//! `emuhost bench`: two arms measured in one run, alternated round by round, reported as the
//! medians and their ratio (never a pass/fail on time: these machines are shared and noisy).

mod beside;
mod chain;
mod import;
mod prepare;
mod sched;
mod space;
mod watch;

use std::time::{Duration, Instant};

use clap::Subcommand;
use serde_json::json;

use crate::Outcome;

#[derive(Subcommand)]
pub enum Which {
    /// One-call commit against the region-by-region walk over a fragmented window; a run of
    /// shared pages mapped as one view against one view per page.
    Space(space::Args),
    /// Collect cost per clean and per dirty page, first-write cost, system calls per allocation,
    /// and the no-lost-writes stress, for the uffd and mprotect backends.
    Watch(watch::Args),
    /// Short sleeps: yield loop, timer and hybrid at 20 µs and 1 ms (lateness p50/p99, CPU per
    /// second), and a frame thread's work on 2 CPUs beside threads sleeping 20 µs.
    Sleep(sched::Args),
    /// A compile-like job (allocation-heavy tree passes) at 1, 2, 4 ... N workers: jobs per second
    /// and speed-up, with this build's allocator (build with `--features mimalloc` for the other).
    Workers(sched::WorkersArgs),
    /// GPU import: untouched against populated pages per size; a session through the importer
    /// with naive chunks, spans, and spans + populate ahead; collects beside commits and pins,
    /// the pins in the kernel's queue against as the space's long reads; a small import beside
    /// background imports of several sizes and beside many live imports.
    Import(import::Args),
    /// `emuhost prepare` at 1, 2, 4 ... N workers, cold and warm cache, each run its own process:
    /// time per phase, speed-up and peak memory, with this build's allocator.
    Prepare(prepare::Args),
}

pub fn run(which: Which, settings: &emuhost::settings::Settings) -> anyhow::Result<Outcome> {
    match which {
        Which::Space(a) => space::run(a),
        Which::Watch(a) => watch::run(a, settings),
        Which::Sleep(a) => sched::run(a),
        Which::Workers(a) => sched::run_workers(a),
        Which::Import(a) => import::run(a, settings),
        Which::Prepare(a) => prepare::run(a),
    }
}

/// One arm's rounds: wall time and system calls of each.
#[derive(Default)]
pub struct Arm {
    pub times: Vec<Duration>,
    pub calls: Vec<u64>,
}

impl Arm {
    /// Times `f` once and counts its system calls (when the build counts them).
    pub fn round<T>(&mut self, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
        let before = emuhost::counters::snapshot();
        let t = Instant::now();
        let out = f()?;
        self.times.push(t.elapsed());
        if let (Some(b), Some(a)) = (before, emuhost::counters::snapshot()) {
            self.calls.push(a.since(&b).total());
        }
        Ok(out)
    }

    pub fn median_ms(&self) -> f64 {
        let mut t: Vec<f64> = self.times.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        median(&mut t)
    }

    pub fn median_calls(&self) -> Option<f64> {
        let mut c: Vec<f64> = self.calls.iter().map(|c| *c as f64).collect();
        (!c.is_empty()).then(|| median(&mut c))
    }
}

pub use emuhost_lab::quantile::median;

/// A comparison of two arms, `old` against `new`.
pub struct Comparison {
    pub name: String,
    pub old_name: &'static str,
    pub new_name: &'static str,
    pub old: Arm,
    pub new: Arm,
    /// What the issue asks for: `new` faster by this factor (time), and fewer calls by this one.
    pub target_time: Option<f64>,
    pub target_calls: Option<f64>,
}

impl Comparison {
    fn time_ratio(&self) -> f64 {
        self.old.median_ms() / self.new.median_ms()
    }

    fn calls_ratio(&self) -> Option<f64> {
        Some(self.old.median_calls()? / self.new.median_calls()?)
    }

    pub fn json(&self) -> serde_json::Value {
        let met = |target: Option<f64>, got: Option<f64>| match (target, got) {
            (Some(t), Some(g)) => json!(g >= t),
            _ => serde_json::Value::Null,
        };
        json!({
            "name": self.name,
            "rounds": self.old.times.len(),
            "old": { "arm": self.old_name, "median_ms": self.old.median_ms(), "median_calls": self.old.median_calls() },
            "new": { "arm": self.new_name, "median_ms": self.new.median_ms(), "median_calls": self.new.median_calls() },
            "time_ratio": self.time_ratio(),
            "calls_ratio": self.calls_ratio(),
            "target_time_ratio": self.target_time,
            "target_calls_ratio": self.target_calls,
            "time_target_met": met(self.target_time, Some(self.time_ratio())),
            "calls_target_met": met(self.target_calls, self.calls_ratio()),
        })
    }

    pub fn print(&self) {
        let calls = |a: &Arm| a.median_calls().map_or("n/a".to_string(), |c| format!("{c:.0}"));
        outln!("{} ({} rounds)", self.name, self.old.times.len());
        outln!(
            "  {:<28} median {:>10.3} ms  {:>8} system calls",
            self.old_name,
            self.old.median_ms(),
            calls(&self.old)
        );
        outln!(
            "  {:<28} median {:>10.3} ms  {:>8} system calls",
            self.new_name,
            self.new.median_ms(),
            calls(&self.new)
        );
        let target = |t: Option<f64>, got: f64| {
            t.map_or(String::new(), |t| format!(" (target >= {t}x: {})", if got >= t { "met" } else { "NOT met" }))
        };
        outln!("  time ratio  {:.1}x{}", self.time_ratio(), target(self.target_time, self.time_ratio()));
        match self.calls_ratio() {
            Some(r) => outln!("  calls ratio {:.1}x{}", r, target(self.target_calls, r)),
            None => outln!("  calls ratio n/a (build with the `counters` feature to count system calls)"),
        }
    }
}
