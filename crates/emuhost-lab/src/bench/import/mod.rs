//! The import bench: (1) one import of untouched pages against one of pages populated first, per
//! size; (2) a session of pools and bindings shaped like the reference's game (thousands of
//! pools, ~2 % across a chunk's end, a few dozen chunks bound) through the importer with naive
//! chunks, with spans, and with spans + populate ahead; (3) collects beside commits and pins
//! ([`chain`]); (4) a binding's small import beside background imports of several sizes, and
//! beside many live imports ([`beside`]).

pub mod beside;
pub mod chain;

use std::sync::Arc;
use std::time::{Duration, Instant};

use emuhost::import::{AnyBackend, Backend, HostSpan, ImportConfig, ImportPolicy, Importer, PopulateAhead, Stats};
use emuhost::space::{Prot, Space, page_size};

use super::{Arm, BenchError, median, ms};
use crate::rng::Rng;

const MIB: u64 = 1 << 20;

/// One size's arms: imports of untouched and of populated pages, the populates and releases.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SizeResult {
    /// The import's size, in bytes.
    pub size: u64,
    /// Imports of untouched pages (the import faults them in).
    pub untouched: Arm,
    /// Imports of pages populated first (the populate not counted).
    pub populated: Arm,
    /// The populates before the `populated` imports.
    pub populate: Arm,
    /// The releases of both arms' imports.
    pub release: Arm,
}

impl SizeResult {
    fn new(size: u64) -> Self {
        Self {
            size,
            untouched: Arm::default(),
            populated: Arm::default(),
            populate: Arm::default(),
            release: Arm::default(),
        }
    }

    /// How many times faster the import of populated pages is.
    pub fn ratio(&self) -> f64 {
        self.untouched.median_ms() / self.populated.median_ms()
    }
}

fn timed<T>(arm: &mut Arm, f: impl FnOnce() -> Result<T, BenchError>) -> Result<T, BenchError> {
    let t = Instant::now();
    let out = f()?;
    arm.times.push(t.elapsed());
    Ok(out)
}

/// One import of `size` bytes of untouched pages against one of pages populated first, `rounds`
/// times, the two alternated.
///
/// # Errors
///
/// The first runtime call that failed (a space made, a commit, an import refused).
pub fn sizes_arms(b: &Arc<AnyBackend>, size: u64, rounds: u32) -> Result<SizeResult, BenchError> {
    let align = b.alignment().max(page_size());
    let space = Arc::new(Space::with_window((size + align).next_multiple_of(1 << 30))?);
    let lo = (align - space.host_base() as u64 % align) % align;
    let range = space.range(lo, size)?;
    // One round of each first, not kept: a VM backs memory it never backed before slowly.
    let mut scratch = SizeResult::new(size);
    let mut r = SizeResult::new(size);
    let one = |populate: bool, r: &mut SizeResult| -> Result<(), BenchError> {
        space.commit(range, Prot::READ_WRITE)?;
        if populate {
            timed(&mut r.populate, || Ok(space.populate(range)?))?;
        }
        let arm = if populate { &mut r.populated } else { &mut r.untouched };
        // The span holds the range until the import made of it is released.
        let span = HostSpan::of(&space, lo, size)?;
        let i = timed(arm, || Ok(b.import(span)?))?;
        timed(&mut r.release, || {
            b.release(i);
            Ok(())
        })?;
        // Back to reserved: the pages are dropped, so the next round starts untouched.
        space.decommit(range)?;
        Ok(())
    };
    one(true, &mut scratch)?;
    one(false, &mut scratch)?;
    for round in 0..rounds {
        for populate in if round % 2 == 0 { [false, true] } else { [true, false] } {
            one(populate, &mut r)?;
        }
    }
    Ok(r)
}

/// A synthetic session: pools (lo, size) and bindings (addr, size), deterministic from a seed.
struct Session {
    window: u64,
    pools: Vec<(u64, u64)>,
    binds: Vec<(u64, u64)>,
    crossing: usize,
    hot: usize,
}

/// Whole pages between `from` and `to` bytes (at least one).
fn pages(g: &mut Rng, from: u64, to: u64) -> u64 {
    let p = page_size();
    (from + g.below(to - from)).next_multiple_of(p).max(p)
}

/// Modelled on the reference's figures: 4,547 pools over 419 chunks of 16 MiB, 2 % of them across
/// a chunk's end, two pools longer than the span cap; a few dozen chunks bound in play, a binding
/// across the chunk end in a third of the bindings into pools that run across one.
fn session(seed: u64, chunk: u64) -> Session {
    let mut g = Rng::new(seed);
    let chunks = 419u64;
    let n = 4547usize;
    let mut pools = Vec::with_capacity(n + 2);
    let mut crossing = 0;
    for i in 0..n {
        let c = g.below(chunks - 1);
        if i % 50 == 0 {
            let size = pages(&mut g, 64 << 10, chunk);
            let off = pages(&mut g, page_size(), size - page_size());
            pools.push(((c + 1) * chunk - off, size));
            crossing += 1;
        } else {
            let size = match g.below(100) {
                0..75 => pages(&mut g, 4 << 10, 64 << 10),
                75..97 => pages(&mut g, 64 << 10, MIB),
                _ => pages(&mut g, MIB, 8 * MIB),
            }
            .min(chunk / 2);
            let lo = c * chunk + g.below(chunk - size) / page_size() * page_size();
            pools.push((lo, size));
        }
    }
    for _ in 0..2 {
        let c = g.below(chunks - 10);
        pools.push((c * chunk + 0x5000, 128 * MIB));
    }
    // Hot chunks: the ones play binds into.
    let hot_chunks: Vec<u64> = (0..48).map(|_| g.below(chunks)).collect();
    let hot: Vec<(u64, u64)> = pools
        .iter()
        .copied()
        .filter(|&(lo, size)| {
            size < 64 * MIB && hot_chunks.iter().any(|&c| lo / chunk == c || (lo + size - 1) / chunk == c)
        })
        .collect();
    let mut binds = Vec::with_capacity(3000);
    for _ in 0..3000 {
        let (lo, size) = hot[g.below(hot.len() as u64) as usize];
        let end = lo + size;
        let crosses = lo / chunk != (end - 1) / chunk;
        if crosses && g.below(3) == 0 {
            let e = (lo / chunk + 1) * chunk;
            let before = 0x10 + g.below(0x1000).min(e - lo - 1);
            let len = (before + 0x10 + g.below(0x1000)).min(end - (e - before));
            binds.push((e - before, len));
        } else {
            let at = lo + g.below(size);
            let len = (0x100 + g.below(64 << 10)).min(end - at).max(1);
            binds.push((at, len));
        }
    }
    let window = (chunks + 16) * chunk;
    Session { window, pools, binds, crossing, hot: hot.len() }
}

/// One session arm's run: the importer's figures and the time populating ahead took.
#[derive(Clone, Debug)]
pub struct ArmRun {
    /// The importer's figures at the session's end.
    pub stats: Stats,
    /// The time from the first pool added until the importer settled, where it populates ahead
    /// (0 where it does not).
    pub populate: Duration,
}

fn run_session(b: &Arc<AnyBackend>, s: &Session, cfg: ImportConfig) -> Result<ArmRun, BenchError> {
    let space = Arc::new(Space::with_window(s.window)?);
    for &(lo, size) in &s.pools {
        let p = page_size();
        let a = lo / p * p;
        let e = (lo + size).next_multiple_of(p).min(s.window);
        space.commit(space.range(a, e - a)?, Prot::READ_WRITE)?;
    }
    let imp = Importer::new(space.clone(), b.clone(), cfg)?;
    let t = Instant::now();
    for &(lo, size) in &s.pools {
        imp.add_pool(lo, size)?;
    }
    // The load: pools are made, then play starts (the populate thread has finished by then).
    imp.settle();
    let populate = if cfg.populate_ahead != PopulateAhead::Off { t.elapsed() } else { Duration::ZERO };
    for &(addr, size) in &s.binds {
        imp.bind(addr, size).map_err(|e| BenchError::doing(format!("binding {addr:#x}+{size:#x}"), e))?;
    }
    Ok(ArmRun { stats: imp.stats(), populate })
}

/// The session's arms (name, each round's run) and the session's shape.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SessionResult {
    /// Each arm's name and its rounds' runs.
    pub arms: Vec<(&'static str, Vec<ArmRun>)>,
    /// Pools in the session.
    pub pools: usize,
    /// Of them, pools across a chunk's end.
    pub crossing: usize,
    /// Bindings in the session.
    pub binds: usize,
    /// Pools in the chunks play binds into.
    pub hot: usize,
}

fn med(runs: &[ArmRun], f: impl Fn(&ArmRun) -> f64) -> f64 {
    let mut v: Vec<f64> = runs.iter().map(f).collect();
    median(&mut v)
}

impl SessionResult {
    /// Per arm, the medians of: imports, time in imports (ms), the worst import (ms),
    /// re-imports, live imported MiB at the peak, populate time (ms), populated MiB.
    pub fn figures(&self) -> Vec<(&'static str, [f64; 7])> {
        self.arms
            .iter()
            .map(|(name, runs)| {
                (
                    *name,
                    [
                        med(runs, |r| r.stats.imports as f64),
                        med(runs, |r| ms(r.stats.time)),
                        med(runs, |r| ms(r.stats.worst())),
                        med(runs, |r| r.stats.reimports as f64),
                        med(runs, |r| (r.stats.peak_live_bytes / MIB) as f64),
                        med(runs, |r| ms(r.populate)),
                        med(runs, |r| (r.stats.populated_bytes / MIB) as f64),
                    ],
                )
            })
            .collect()
    }

    /// Per arm after the first (naive chunks): the worst import, the time ratio against naive
    /// and the extra imported memory.
    pub fn targets(&self) -> Vec<(&'static str, f64, f64, f64)> {
        let f = self.figures();
        let naive = f[0].1;
        f[1..].iter().map(|(name, v)| (*name, v[2], naive[1] / v[1], v[4] / naive[4] - 1.0)).collect()
    }
}

/// The session of `seed` through the importer with naive chunks, with spans, and with spans and
/// populate ahead (pools, chunks), `rounds` times; `base` is the importer's config the arms vary.
///
/// # Errors
///
/// The first runtime call that failed (a space made, a commit, a pool added, a binding refused).
pub fn session_arms(
    b: &Arc<AnyBackend>,
    seed: u64,
    rounds: u32,
    base: ImportConfig,
) -> Result<SessionResult, BenchError> {
    let s = session(seed, base.chunk);
    // The configs are `#[non_exhaustive]`: each arm is the base with fields set.
    let with = |span_off: bool, ahead: PopulateAhead| {
        let mut c = base;
        if span_off && let ImportPolicy::Chunks(chunks) = &mut c.policy {
            chunks.span_cap = 0;
        }
        c.populate_ahead = ahead;
        c
    };
    let cfgs = [
        ("naive chunks", with(true, PopulateAhead::Off)),
        ("span", with(false, PopulateAhead::Off)),
        ("span + populate pools ahead", with(false, PopulateAhead::Pools)),
        ("span + populate chunks ahead", with(false, PopulateAhead::Chunks)),
    ];
    let mut arms: Vec<(&'static str, Vec<ArmRun>)> = cfgs.iter().map(|(n, _)| (*n, Vec::new())).collect();
    for round in 0..rounds as usize {
        for k in 0..cfgs.len() {
            let i = (k + round) % cfgs.len();
            let run = run_session(b, &s, cfgs[i].1)
                .map_err(|e| BenchError::doing(format!("session arm {:?}", cfgs[i].0), e))?;
            arms[i].1.push(run);
        }
    }
    Ok(SessionResult { arms, pools: s.pools.len(), crossing: s.crossing, binds: s.binds.len(), hot: s.hot })
}
