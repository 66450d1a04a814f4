//! The benches' measurements: two arms measured in one run, alternated round by round, and the
//! medians and their ratio (never a pass/fail on time: these machines are shared and noisy). The
//! CLI's `emuhost bench WHAT` parses its flags into each bench's config, runs it here and prints.
//!
//! - [`space`]: one-call commit against the region-by-region walk, a run of shared pages as one
//!   view against one view per page, `PROCMAP_QUERY` against the `/proc/self/maps` text.
//! - [`watch`]: collect costs per backend and over the bare kernel, and the no-lost-writes stress.
//! - [`import`]: untouched against populated imports, a session through the importer, collects
//!   beside commits and pins, a small import beside background ones.
//! - [`prepare`]: the preparation at 1, 2, 4 ... N workers, cold and warm cache.
//! - [`sched`]: short sleeps by every way to wait, and a frame thread beside sleepers.
//! - [`snapshot`]: a snapshot's take and restore against a full copy of the committed memory, per
//!   fraction of pages written.
//! - [`progress`]: the rounds planned and done, for a progress bar.
//! - [`workers`]: a compile-like job at 1, 2, 4 ... N workers, round by round (on Windows the CLI
//!   alternates it with a process on the other heap).

pub mod import;
pub mod prepare;
pub mod progress;
pub mod sched;
pub mod snapshot;
pub mod space;
pub mod watch;
pub mod workers;

use std::time::{Duration, Instant};

/// What stopped a bench: a runtime call that failed (with what the bench was doing), or a check of
/// the bench's own figures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A space call failed (reserve, commit, map ...).
    #[error(transparent)]
    Space(#[from] emuhost::space::SpaceError),
    /// A write-tracking call failed (the tracker made, an arm, a collect).
    #[error(transparent)]
    Watch(#[from] emuhost::watch::WatchError),
    /// An import call failed (no backend, an import refused).
    #[error(transparent)]
    Import(#[from] emuhost::import::ImportError),
    /// A system call the bench makes itself (the bare kernel's arm) failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A runtime call failed while the bench was doing `what`.
    #[error("{what}")]
    Runtime {
        /// What the bench was doing, in words.
        what: String,
        /// The runtime's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A thread of the bench panicked.
    #[error("{0} panicked")]
    Panicked(&'static str),
    /// The bench's own check of what it measured failed (the message names the values).
    #[error("{0}")]
    Check(String),
}

impl BenchError {
    /// A runtime call's error, with what the bench was doing.
    pub fn doing(what: impl Into<String>, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        BenchError::Runtime { what: what.into(), source: Box::new(source) }
    }
}

/// Whether a space can map shared views here: always on Linux; on Windows where placeholders
/// work (Windows 10 1803+, Wine 10; not Wine 8). The reason where not, for a bench's "left out".
pub fn views_here() -> Result<(), String> {
    #[cfg(windows)]
    if let emuhost::probe::Offer::No(why) = emuhost::probe::Probe::run().placeholders {
        return Err(format!("shared views need placeholders, which this Windows lacks ({why})"));
    }
    Ok(())
}

/// `Err(BenchError::Check(..))` unless `cond`: the bench's `ensure!`.
macro_rules! check {
    ($cond:expr, $($t:tt)*) => {
        if !$cond {
            return Err($crate::bench::BenchError::Check(format!($($t)*)));
        }
    };
}
pub(crate) use check;

/// One arm's rounds: wall time and system calls of each.
///
/// # Examples
///
/// Two arms timed round by round, alternated, and compared by their medians:
///
/// ```
/// use emuhost_lab::bench::{Arm, Comparison};
///
/// let (mut old, mut new) = (Arm::default(), Arm::default());
/// for _ in 0..5 {
///     old.round(|| Ok::<_, std::convert::Infallible>((0..20_000u64).map(|i| i * i).sum::<u64>()))?;
///     new.round(|| Ok::<_, std::convert::Infallible>((0..20_000u64).sum::<u64>()))?;
/// }
/// assert_eq!(old.times.len(), 5);
/// let c = Comparison {
///     name: "sum".into(),
///     old_name: "squares",
///     new_name: "plain",
///     old,
///     new,
///     target_time: None,
///     target_calls: None,
/// };
/// // Reported, never a pass or fail: the machines are shared and noisy.
/// println!("{}: {} {:.2}x faster than {}", c.name, c.new_name, c.time_ratio(), c.old_name);
/// # Ok::<(), std::convert::Infallible>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Arm {
    /// Each round's wall time.
    pub times: Vec<Duration>,
    /// Each round's system calls; empty where the build does not count them (the runtime's
    /// `counters` feature).
    pub calls: Vec<u64>,
}

impl Arm {
    /// Times `f` once and counts its system calls (when the build counts them).
    pub fn round<T, E>(&mut self, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let before = emuhost::counters::snapshot();
        let t = Instant::now();
        let out = f()?;
        self.times.push(t.elapsed());
        if let (Some(b), Some(a)) = (before, emuhost::counters::snapshot()) {
            self.calls.push(a.since(&b).total());
        }
        Ok(out)
    }

    /// The rounds' median wall time, in milliseconds (0 without a round).
    pub fn median_ms(&self) -> f64 {
        let mut t: Vec<f64> = self.times.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        median(&mut t)
    }

    /// The rounds' median count of system calls; `None` where none were counted.
    pub fn median_calls(&self) -> Option<f64> {
        let mut c: Vec<f64> = self.calls.iter().map(|c| *c as f64).collect();
        (!c.is_empty()).then(|| median(&mut c))
    }
}

/// A duration in milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub use crate::quantile::{median, quantile};

/// A comparison of two arms, `old` against `new`.
#[derive(Clone, Debug)]
pub struct Comparison {
    /// What is compared, for the report.
    pub name: String,
    /// The old arm's name.
    pub old_name: &'static str,
    /// The new arm's name.
    pub new_name: &'static str,
    /// The old arm's rounds.
    pub old: Arm,
    /// The new arm's rounds.
    pub new: Arm,
    /// What the issue asks for: `new` faster by this factor (time). Reported, never checked.
    pub target_time: Option<f64>,
    /// What the issue asks for: fewer system calls by this factor.
    pub target_calls: Option<f64>,
}

impl Comparison {
    /// How many times faster `new` is (median against median).
    pub fn time_ratio(&self) -> f64 {
        self.old.median_ms() / self.new.median_ms()
    }

    /// How many times fewer system calls `new` makes; `None` where the build counts none.
    pub fn calls_ratio(&self) -> Option<f64> {
        Some(self.old.median_calls()? / self.new.median_calls()?)
    }
}
