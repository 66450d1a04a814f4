//! `emuhost bench`: two arms measured in one run, alternated round by round, reported as the
//! medians and their ratio (never a pass/fail on time: these machines are shared and noisy). The
//! measurements are the lab's (`emuhost_lab::bench`); here the flags and the printing.

mod beside;
mod chain;
mod import;
mod prepare;
mod sched;
mod snapshot;
mod space;
mod watch;
mod workers;

use clap::Subcommand;
pub use emuhost_lab::bench::{Arm, Comparison, median};

use crate::Outcome;

#[derive(Subcommand)]
pub enum Which {
    /// One-call commit against the region-by-region walk over a fragmented window; a run of
    /// shared pages mapped as one view against one view per page.
    Space(space::Args),
    /// Collect cost per clean and per dirty page, first-write cost, system calls per allocation,
    /// and the no-lost-writes stress, for this platform's backends (uffd and mprotect; on Windows
    /// writewatch and guard).
    Watch(watch::Args),
    /// Short sleeps: yield loop, timer and hybrid at 20 µs and 1 ms (lateness p50/p99, CPU per
    /// second), and a frame thread's work on 2 CPUs beside threads sleeping 20 µs.
    Sleep(sched::Args),
    /// A compile-like job (allocation-heavy tree passes) at 1, 2, 4 ... N workers: jobs per second
    /// and speed-up, with this build's allocator (build with `--features mimalloc` for the other);
    /// on Windows both heaps in one run: this exe's (its manifest asks for the segment heap) and a
    /// copy's without the manifest, each arm naming the heap its process had.
    Workers(workers::Args),
    /// GPU import: untouched against populated pages per size; a session through the importer
    /// with naive chunks, spans, and spans + populate ahead; collects beside commits and pins,
    /// the pins in the kernel's queue against as the space's long reads; a small import beside
    /// background imports of several sizes and beside many live imports.
    Import(import::Args),
    /// `emuhost prepare` at 1, 2, 4 ... N workers, cold and warm cache, each run its own process:
    /// time per phase, speed-up and peak memory, with this build's allocator.
    Prepare(prepare::Args),
    /// Snapshots: a take and the restore of the previous snapshot against a full copy of the
    /// committed memory (read into a buffer, written back), per fraction of pages written, with
    /// the tracker's backend; exit 1 when the memory after a restore differs from the snapshot.
    Snapshot(snapshot::Args),
}

pub fn run(which: Which, settings: &emuhost::settings::Settings) -> anyhow::Result<Outcome> {
    // The lab's benches report at their end: meanwhile a bar of the rounds they have begun of those
    // planned so far (each part plans its rounds as it begins), with the time elapsed and left
    // (`bench import` has a bar of its parts).
    let name = match &which {
        Which::Space(_) => "space",
        Which::Watch(_) => "watch",
        Which::Sleep(_) => "sleep",
        Which::Workers(_) => "workers",
        Which::Import(_) => "import",
        Which::Prepare(_) => "prepare",
        Which::Snapshot(_) => "snapshot",
    };
    let _bar = (name != "import").then(|| {
        let rounds = emuhost_lab::bench::progress::rounds;
        crate::progress::ticking_to(format!("bench {name}"), "rounds", Some(0), move || {
            let (begun, planned) = rounds();
            (begun, Some(planned))
        })
    });
    match which {
        Which::Space(a) => space::run(a),
        Which::Watch(a) => watch::run(a, settings),
        Which::Sleep(a) => sched::run(a),
        Which::Workers(a) => workers::run(a),
        Which::Import(a) => import::run(a, settings),
        Which::Prepare(a) => prepare::run(a),
        Which::Snapshot(a) => snapshot::run(a, settings),
    }
}

/// The version of every `bench ... --json` object's keys (raised when one changes name or meaning
/// or goes away).
pub const SCHEMA: u32 = 1;

/// One arm of a comparison's JSON.
#[derive(serde::Serialize)]
struct ArmJson<'a> {
    arm: &'a str,
    median_ms: f64,
    median_calls: Option<f64>,
}

/// A comparison's JSON: both arms' medians, the ratios (old over new) and the targets.
#[derive(serde::Serialize)]
struct ComparisonJson<'a> {
    name: &'a str,
    rounds: usize,
    old: ArmJson<'a>,
    new: ArmJson<'a>,
    time_ratio: f64,
    calls_ratio: Option<f64>,
    target_time_ratio: Option<f64>,
    target_calls_ratio: Option<f64>,
    time_target_met: Option<bool>,
    calls_target_met: Option<bool>,
}

/// A comparison printed as text or JSON.
pub trait Report {
    fn json(&self) -> serde_json::Value;
    fn print(&self);
}

impl Report for Comparison {
    fn json(&self) -> serde_json::Value {
        let met = |target: Option<f64>, got: Option<f64>| Some(got? >= target?);
        let arm = |arm, a: &Arm| ArmJson { arm, median_ms: a.median_ms(), median_calls: a.median_calls() };
        let c = ComparisonJson {
            name: &self.name,
            rounds: self.old.times.len(),
            old: arm(self.old_name, &self.old),
            new: arm(self.new_name, &self.new),
            time_ratio: self.time_ratio(),
            calls_ratio: self.calls_ratio(),
            target_time_ratio: self.target_time,
            target_calls_ratio: self.target_calls,
            time_target_met: met(self.target_time, Some(self.time_ratio())),
            calls_target_met: met(self.target_calls, self.calls_ratio()),
        };
        serde_json::to_value(c).unwrap_or_default()
    }

    fn print(&self) {
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
