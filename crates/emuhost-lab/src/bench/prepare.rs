//! The preparation's bench: the preparation at 1, 2, 4 ... N workers, each with a cold cache (no
//! file) and then a warm one (the file the cold run saved). Rounds alternate the worker counts;
//! each (count, cold or warm) cell keeps its rounds for medians. The caller runs each preparation
//! (the CLI runs each in a process of its own, so its peak memory and the driver's state are its
//! own) and hands back what it measured.

use std::path::Path;
use std::time::Duration;

use super::{Arm, median};

/// What one preparation measured (NaN where it did not say).
#[derive(Clone, Copy, Debug)]
pub struct PrepareRun {
    /// The whole preparation's wall time, in milliseconds.
    pub total_ms: f64,
    /// The translate phase's wall time, in milliseconds.
    pub translate_ms: f64,
    /// The compile phase's wall time, in milliseconds.
    pub compile_ms: f64,
    /// The preparing process's peak resident memory, in bytes.
    pub peak_rss_bytes: f64,
    /// Pipelines the driver said came from the cache (NaN where it does not say).
    pub cache_hits: f64,
    /// Pipelines created.
    pub pipelines: u64,
}

/// One (worker count, cold or warm) cell over the rounds.
#[derive(Clone, Debug, Default)]
pub struct Cell {
    /// Each round's whole preparation.
    pub total: Arm,
    /// Each round's translate phase, in milliseconds.
    pub translate: Vec<f64>,
    /// Each round's compile phase, in milliseconds.
    pub compile: Vec<f64>,
    /// Each round's peak resident memory, in MiB.
    pub peak_mib: Vec<f64>,
    /// Each round's cache hits (NaN where the driver does not say).
    pub hits: Vec<f64>,
    /// The last round's pipelines created.
    pub pipelines: u64,
}

impl Cell {
    fn add(&mut self, r: &PrepareRun) {
        self.total.times.push(Duration::from_secs_f64(r.total_ms / 1e3));
        self.translate.push(r.translate_ms);
        self.compile.push(r.compile_ms);
        self.peak_mib.push(r.peak_rss_bytes / (1u64 << 20) as f64);
        self.hits.push(r.cache_hits);
        self.pipelines = r.pipelines;
    }

    /// The median of one of the cell's figures.
    pub fn med(v: &[f64]) -> f64 {
        median(&mut v.to_vec())
    }
}

/// The worker counts to measure: `explicit` where given, else 1, 2, 4 ... up to `usable` and the
/// rule's count; sorted, each once.
pub fn worker_counts(explicit: &[u64], usable: u64, rule: u64) -> Vec<u64> {
    let mut counts = explicit.to_vec();
    if counts.is_empty() {
        counts = std::iter::successors(Some(1u64), |n| Some(n * 2)).take_while(|n| *n < usable).collect();
        counts.push(usable);
        counts.push(rule);
    }
    counts.sort_unstable();
    counts.dedup();
    counts
}

/// Each worker count's cold and warm runs, the counts alternated within each round:
/// `prepare(workers, cold)` runs one preparation with this many workers and the cache file
/// `cache` (before a cold run it is deleted, with its journal); `done(round, workers, cold, warm)`
/// after each pair. Returns the cold cells and the warm ones, in the order of `counts`.
///
/// # Errors
///
/// The first error `prepare` returned; the rounds stop there.
pub fn measure<E>(
    rounds: u32,
    counts: &[u64],
    (cache, journal): (&Path, &Path),
    mut prepare: impl FnMut(u64, bool) -> Result<PrepareRun, E>,
    mut done: impl FnMut(usize, u64, &PrepareRun, &PrepareRun),
) -> Result<(Vec<Cell>, Vec<Cell>), E> {
    let mut cold: Vec<Cell> = counts.iter().map(|_| Cell::default()).collect();
    let mut warm: Vec<Cell> = counts.iter().map(|_| Cell::default()).collect();
    super::progress::plan(u64::from(rounds));
    for r in 0..rounds as usize {
        super::progress::tick();
        for k in 0..counts.len() {
            let i = (r + k) % counts.len();
            let _ = std::fs::remove_file(cache);
            let _ = std::fs::remove_file(journal);
            let c = prepare(counts[i], true)?;
            cold[i].add(&c);
            let w = prepare(counts[i], false)?;
            warm[i].add(&w);
            done(r, counts[i], &c, &w);
        }
    }
    Ok((cold, warm))
}
