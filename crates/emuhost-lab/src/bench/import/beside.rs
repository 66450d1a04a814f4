//! The import bench, part (4): a binding's small import beside background imports. On the
//! H200 a binding's import of a few KiB took as long as the background import that was in
//! NVIDIA's driver when it came (the driver serializes host-pointer imports across threads), and
//! imports cost about 0.5 ms each inside the session against 0.03–0.05 ms in the importer's
//! start-up measure. This part measures both by themselves:
//!
//! - `beside N KiB`: a background thread imports and releases `N` KiB of populated pages back to
//!   back (so the driver is always busy with one), while a binding-like thread imports one
//!   alignment-sized page every 500 µs and releases it; `beside nothing` is the same thread
//!   alone. The binding's import and release times (p50, p99, worst), the background's import and
//!   release medians and the MiB it pins per second.
//! - `alone, L live`: the binding-like thread alone while `L` imports of one page each stay live
//!   (the session holds about a thousand), to see whether an import's fixed cost grows with them.
//!
//! Arms are alternated round by round; each figure is the median of its rounds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use emuhost::import::{AnyBackend, Backend, HostSpan};
use emuhost::space::{Prot, Space, page_size};

use crate::bench::{BenchError, median, ms, quantile};

const MIB: u64 = 1 << 20;
/// The pages the binding-like thread imports in turn.
const PAGES: u64 = 256;
/// How often the binding-like thread imports.
const EVERY: Duration = Duration::from_micros(500);

/// What runs beside the binding-like thread.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Beside {
    /// A background thread importing this many bytes at a time (0: none).
    Imports(u64),
    /// No background thread; this many one-page imports held live.
    Live(u64),
}

impl Beside {
    /// The arm's name in the report (`beside 1024 KiB`, `beside nothing`, `alone, 1000 live`).
    pub fn name(self) -> String {
        match self {
            Beside::Imports(0) => "beside nothing".into(),
            Beside::Imports(n) => format!("beside {} KiB", n >> 10),
            Beside::Live(n) => format!("alone, {n} live"),
        }
    }
}

/// One round of one arm, in ms (the background's pins per second aside).
#[derive(Clone, Debug, Default)]
pub struct Round {
    /// The binding-like thread's imports: median.
    pub import_p50: f64,
    /// The binding-like thread's imports: 99th percentile.
    pub import_p99: f64,
    /// The binding-like thread's imports: the longest.
    pub import_worst: f64,
    /// The binding-like thread's releases: median.
    pub release_p50: f64,
    /// The binding-like thread's releases: 99th percentile.
    pub release_p99: f64,
    /// The binding-like thread's releases: the longest.
    pub release_worst: f64,
    /// The background thread's imports: median (0 without one).
    pub bg_import: f64,
    /// The background thread's releases: median.
    pub bg_release: f64,
    /// The bytes the background thread imported per second of the round, in MiB/s.
    pub bg_mib_per_s: f64,
}

/// A figure's name and how to read it from a round.
pub type Figure = (&'static str, fn(&Round) -> f64);

/// The figures a report shows, by name.
pub const FIGURES: [Figure; 9] = [
    ("import_ms_p50", |r| r.import_p50),
    ("import_ms_p99", |r| r.import_p99),
    ("import_ms_worst", |r| r.import_worst),
    ("release_ms_p50", |r| r.release_p50),
    ("release_ms_p99", |r| r.release_p99),
    ("release_ms_worst", |r| r.release_worst),
    ("background_import_ms", |r| r.bg_import),
    ("background_release_ms", |r| r.bg_release),
    ("background_mib_per_s", |r| r.bg_mib_per_s),
];

/// What the arms measured.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct BesideResult {
    /// The arms, in the order `rounds` holds them.
    pub arms: Vec<Beside>,
    /// `rounds[r][a]`: round `r` of arm `a`.
    pub rounds: Vec<Vec<Round>>,
    /// The binding-like thread's import, in bytes.
    pub small: u64,
    /// The import backend's kind (`vulkan`, `cuda`, `pin`).
    pub backend: String,
}

/// Sorted times' p50, p99 and worst.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (quantile(&v, 0.5), quantile(&v, 0.99), quantile(&v, 1.0))
}

/// The background thread's loop: import and release `lo..lo + len` back to back until `stop`.
/// Its import and release times.
fn background(
    b: &AnyBackend,
    space: &Arc<Space>,
    (lo, len): (u64, u64),
    stop: &AtomicBool,
) -> Result<[Vec<f64>; 2], BenchError> {
    let (mut imports, mut releases) = (Vec::new(), Vec::new());
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let i = b.import(HostSpan::of(space, lo, len)?)?;
        imports.push(ms(t.elapsed()));
        let t = Instant::now();
        b.release(i);
        releases.push(ms(t.elapsed()));
    }
    Ok([imports, releases])
}

/// One round of one arm for `dur`.
fn round(b: &AnyBackend, beside: Beside, dur: Duration) -> Result<Round, BenchError> {
    let small = b.alignment().max(page_size());
    let (bg, live) = match beside {
        Beside::Imports(n) => (n, 0),
        Beside::Live(n) => (0, n),
    };
    // The background's range, then the binding-like thread's pages, then the live ones, each
    // aligned for the device and populated (as a pool imported ahead is).
    let bg = bg.next_multiple_of(small);
    let (fg, held) = (bg, bg + PAGES * small);
    let total = held + live * small;
    let space = Arc::new(Space::with_window((small + total).next_multiple_of(1 << 30))?);
    let lo = (small - space.host_base() as u64 % small) % small;
    let all = space.range(lo, total)?;
    space.commit(all, Prot::READ_WRITE)?;
    space.populate(all)?;
    let mut kept = Vec::new();
    for k in 0..live {
        kept.push(b.import(HostSpan::of(&space, lo + held + k * small, small)?)?);
    }
    let stop = AtomicBool::new(false);
    let outcome = std::thread::scope(|sc| -> Result<_, BenchError> {
        let bg_thread = (bg > 0).then(|| sc.spawn(|| background(b, &space, (lo, bg), &stop)));
        let (mut imports, mut releases) = (Vec::new(), Vec::new());
        let end = Instant::now() + dur;
        let fore = (|| -> Result<(), BenchError> {
            let mut i = 0;
            while Instant::now() < end {
                let span = HostSpan::of(&space, lo + fg + (i % PAGES) * small, small)?;
                let t = Instant::now();
                let import = b.import(span)?;
                imports.push(ms(t.elapsed()));
                let t = Instant::now();
                b.release(import);
                releases.push(ms(t.elapsed()));
                i += 1;
                std::thread::sleep(EVERY);
            }
            Ok(())
        })();
        stop.store(true, Ordering::Relaxed);
        let bg_times = match bg_thread {
            Some(t) => t.join().expect("the background thread panicked")?,
            None => [Vec::new(), Vec::new()],
        };
        fore?;
        Ok((imports, releases, bg_times))
    });
    for i in kept {
        b.release(i);
    }
    let (imports, releases, [mut bg_imports, mut bg_releases]) = outcome?;
    let (import_p50, import_p99, import_worst) = spread(imports);
    let (release_p50, release_p99, release_worst) = spread(releases);
    let pins = bg_imports.len() as f64;
    Ok(Round {
        import_p50,
        import_p99,
        import_worst,
        release_p50,
        release_p99,
        release_worst,
        bg_import: median(&mut bg_imports),
        bg_release: median(&mut bg_releases),
        bg_mib_per_s: pins * bg as f64 / MIB as f64 / dur.as_secs_f64(),
    })
}

/// The arms (`sizes` background imports, in bytes, 0 for none; then `live` held imports alone
/// if not 0), `rounds` times, in an order that turns each round; each arm runs for `dur` a
/// round.
///
/// # Errors
///
/// The first runtime call that failed (a space made, an import refused).
pub fn arms(
    b: &Arc<AnyBackend>,
    rounds: u32,
    dur: Duration,
    sizes: &[u64],
    live: u64,
) -> Result<BesideResult, BenchError> {
    let mut arms: Vec<Beside> = sizes.iter().map(|&s| Beside::Imports(s)).collect();
    if live > 0 {
        arms.push(Beside::Live(live));
    }
    let mut out = Vec::new();
    for r in 0..rounds as usize {
        let mut all = vec![Round::default(); arms.len()];
        for k in 0..arms.len() {
            let i = (r + k) % arms.len();
            all[i] = round(b, arms[i], dur)?;
        }
        out.push(all);
    }
    let small = b.alignment().max(page_size());
    Ok(BesideResult { arms, rounds: out, small, backend: b.kind().name().to_string() })
}

impl BesideResult {
    /// The median over rounds of one figure of arm `i`.
    pub fn med(&self, i: usize, f: fn(&Round) -> f64) -> f64 {
        let mut v: Vec<f64> = self.rounds.iter().map(|r| f(&r[i])).collect();
        median(&mut v)
    }

    /// The arm with nothing beside it, the base of the ratios.
    pub fn alone(&self) -> Option<usize> {
        self.arms.iter().position(|&a| a == Beside::Imports(0))
    }
}
