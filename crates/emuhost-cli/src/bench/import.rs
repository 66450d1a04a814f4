//! `emuhost bench import`: (1) one import of untouched pages against one of pages populated first,
//! per size; (2) a session of pools and bindings shaped like the reference's game (thousands of
//! pools, ~2 % across a chunk's end, a few dozen chunks bound) through the importer with naive
//! chunks, with spans, and with spans + populate ahead; (3) collects beside commits and pins
//! ([`super::chain`]); (4) a binding's small import beside background imports of several sizes,
//! and beside many live imports ([`super::beside`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use emuhost::import::{AnyBackend, Backend, HostSpan, ImportConfig, ImportPolicy, Importer, PopulateAhead, Stats};
use emuhost::space::{Prot, Space, page_size};
use emuhost_lab::rng::Rng;
use serde_json::json;

use super::{Arm, median};
use crate::Outcome;
use crate::replay::ms;

const MIB: u64 = 1 << 20;

#[derive(clap::Args)]
pub struct Args {
    /// Rounds of each arm (alternated).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Import sizes in MiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [16u64, 64])]
    sizes_mib: Vec<u64>,
    /// Rounds of the session arms.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    session_rounds: u32,
    /// Leave the session out.
    #[arg(long)]
    no_session: bool,
    /// Rounds of the collects beside commits and pins (0 leaves them out).
    #[arg(long, default_value_t = 3)]
    chain_rounds: u32,
    /// How long each arm runs in a round of the collects beside commits and pins, in ms.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    chain_ms: u64,
    /// What the background thread pins in the collects beside commits and pins, in MiB.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    chain_pin_mib: u64,
    /// The piece the third arm of the collects beside commits and pins pins at a time, in KiB.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(4..=4_194_304))]
    chain_piece_kib: u64,
    /// Rounds of a binding's small import beside background imports (0 leaves them out).
    #[arg(long, default_value_t = 3)]
    beside_rounds: u32,
    /// How long each arm runs in a round of the small imports beside background imports, in ms.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    beside_ms: u64,
    /// The background imports' sizes beside the small imports, in KiB, comma-separated (0: none).
    #[arg(long, value_delimiter = ',', default_values_t = [0u64, 256, 1024, 4096, 16384],
          value_parser = clap::value_parser!(u64).range(0..=4_194_304))]
    beside_kib: Vec<u64>,
    /// One-page imports held live in the last arm of the small imports (0 leaves it out).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(0..=100_000))]
    beside_live: u64,
    /// Seed of the synthetic session.
    #[arg(long, default_value_t = 1267)]
    seed: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args, settings: &emuhost::settings::Settings) -> anyhow::Result<Outcome> {
    if cfg!(debug_assertions) {
        eprintln!("emuhost: warning: a debug build; measure with `cargo build --release`");
    }
    if let Some(bad) = a.sizes_mib.iter().find(|&&s| s == 0 || s > 64 << 10) {
        anyhow::bail!("--sizes-mib {bad}: sizes from 1 to 65536 MiB");
    }
    let picked = AnyBackend::pick(settings.import_backend).context("opening an import backend")?;
    let backend = Arc::new(picked.backend);
    let what = format!("{}: {}", backend.kind().name(), backend.describe());
    if !a.json {
        outln!("backend {what}");
    }
    let mut sizes = Vec::new();
    for &mib in &a.sizes_mib {
        let r = sizes_arms(&backend, mib * MIB, a.rounds)?;
        if !a.json {
            r.print();
        }
        sizes.push(r.json());
    }
    let session = if a.no_session {
        serde_json::Value::Null
    } else {
        let s = session_arms(&backend, a.seed, a.session_rounds, settings.import_config())?;
        if !a.json {
            s.print();
        }
        s.json()
    };
    let chain = if a.chain_rounds == 0 {
        serde_json::Value::Null
    } else {
        let dur = Duration::from_millis(a.chain_ms);
        let c = super::chain::arms(&backend, a.chain_rounds, dur, a.chain_pin_mib * MIB, a.chain_piece_kib << 10)?;
        if !a.json {
            c.print();
        }
        c.json()
    };
    let beside = if a.beside_rounds == 0 {
        serde_json::Value::Null
    } else {
        let dur = Duration::from_millis(a.beside_ms);
        let sizes: Vec<u64> = a.beside_kib.iter().map(|k| k << 10).collect();
        let r = super::beside::arms(&backend, a.beside_rounds, dur, &sizes, a.beside_live)?;
        if !a.json {
            r.print();
        }
        r.json()
    };
    if a.json {
        let all = json!({ "bench": "import", "backend": what, "sizes": sizes, "session": session, "chain": chain, "beside": beside });
        outln!("{all}");
    }
    Ok(Outcome::Ok)
}

struct SizeResult {
    size: u64,
    untouched: Arm,
    populated: Arm,
    populate: Arm,
    release: Arm,
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

    fn ratio(&self) -> f64 {
        self.untouched.median_ms() / self.populated.median_ms()
    }

    fn print(&self) {
        let mib = (self.size / MIB) as f64;
        outln!(
            "import of {} MiB: untouched against populated pages ({} rounds)",
            self.size / MIB,
            self.untouched.times.len()
        );
        for (name, arm) in [("untouched pages", &self.untouched), ("populated pages", &self.populated)] {
            let ms = arm.median_ms();
            outln!("  {name:<28} median {ms:>10.3} ms  {:>8.4} ms/MiB", ms / mib);
        }
        outln!("  populate (off the binding thread) median {:.3} ms", self.populate.median_ms());
        outln!("  release                            median {:.3} ms", self.release.median_ms());
        outln!("  time ratio  {:.1}x", self.ratio());
    }

    fn json(&self) -> serde_json::Value {
        let mib = (self.size / MIB) as f64;
        json!({
            "size_mib": self.size / MIB,
            "rounds": self.untouched.times.len(),
            "untouched_ms": self.untouched.median_ms(),
            "populated_ms": self.populated.median_ms(),
            "untouched_ms_per_mib": self.untouched.median_ms() / mib,
            "populated_ms_per_mib": self.populated.median_ms() / mib,
            "populate_ms": self.populate.median_ms(),
            "release_ms": self.release.median_ms(),
            "time_ratio": self.ratio(),
        })
    }
}

fn timed<T>(arm: &mut Arm, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    let t = Instant::now();
    let out = f()?;
    arm.times.push(t.elapsed());
    Ok(out)
}

fn sizes_arms(b: &Arc<AnyBackend>, size: u64, rounds: u32) -> anyhow::Result<SizeResult> {
    let align = b.alignment().max(page_size());
    let space = Arc::new(Space::with_window((size + align).next_multiple_of(1 << 30))?);
    let lo = (align - space.host_base() as u64 % align) % align;
    let range = space.range(lo, size)?;
    // One round of each first, not kept: a VM backs memory it never backed before slowly.
    let mut scratch = SizeResult::new(size);
    let mut r = SizeResult::new(size);
    let one = |populate: bool, r: &mut SizeResult| -> anyhow::Result<()> {
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

struct ArmRun {
    stats: Stats,
    populate: Duration,
}

fn run_session(b: &Arc<AnyBackend>, s: &Session, cfg: ImportConfig) -> anyhow::Result<ArmRun> {
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
        imp.bind(addr, size).with_context(|| format!("binding {addr:#x}+{size:#x}"))?;
    }
    Ok(ArmRun { stats: imp.stats(), populate })
}

struct SessionResult {
    arms: Vec<(&'static str, Vec<ArmRun>)>,
    pools: usize,
    crossing: usize,
    binds: usize,
    hot: usize,
}

fn med(runs: &[ArmRun], f: impl Fn(&ArmRun) -> f64) -> f64 {
    let mut v: Vec<f64> = runs.iter().map(f).collect();
    median(&mut v)
}

impl SessionResult {
    fn figures(&self) -> Vec<(&'static str, [f64; 7])> {
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
    fn targets(&self) -> Vec<(&'static str, f64, f64, f64)> {
        let f = self.figures();
        let naive = f[0].1;
        f[1..].iter().map(|(name, v)| (*name, v[2], naive[1] / v[1], v[4] / naive[4] - 1.0)).collect()
    }

    fn print(&self) {
        outln!(
            "session: {} pools ({} across a chunk's end), {} bindings into {} pools of the bound chunks ({} rounds, medians)",
            self.pools,
            self.crossing,
            self.binds,
            self.hot,
            self.arms[0].1.len()
        );
        outln!(
            "  {:<30} {:>8} {:>14} {:>9} {:>11} {:>9} {:>12} {:>14}",
            "arm",
            "imports",
            "in imports ms",
            "worst ms",
            "re-imports",
            "live MiB",
            "populate ms",
            "populated MiB"
        );
        for (name, v) in self.figures() {
            outln!(
                "  {name:<30} {:>8.0} {:>14.1} {:>9.2} {:>11.0} {:>9.0} {:>12.1} {:>14.0}",
                v[0],
                v[1],
                v[2],
                v[3],
                v[4],
                v[5],
                v[6]
            );
        }
        let met = |ok: bool| if ok { "met" } else { "NOT met" };
        outln!("  targets: worst import <= 2 ms, time in imports >= 10x below naive, imported memory <= +10 %");
        for (name, worst, ratio, extra) in self.targets() {
            outln!(
                "  {name:<30} worst {worst:.2} ms ({}), {ratio:.1}x ({}), {:+.1} % ({})",
                met(worst <= 2.0),
                met(ratio >= 10.0),
                extra * 100.0,
                met(extra <= 0.10)
            );
        }
    }

    fn json(&self) -> serde_json::Value {
        let arms: Vec<_> = self
            .figures()
            .into_iter()
            .map(|(name, v)| {
                json!({ "arm": name, "imports": v[0], "time_in_imports_ms": v[1], "worst_import_ms": v[2],
                        "reimports": v[3], "live_imported_mib": v[4], "populate_ms": v[5], "populated_mib": v[6] })
            })
            .collect();
        let targets: Vec<_> = self
            .targets()
            .into_iter()
            .map(|(name, worst, ratio, extra)| {
                json!({ "arm": name, "worst_import_ms": worst, "time_ratio_vs_naive": ratio, "extra_memory": extra,
                        "worst_target_met": worst <= 2.0, "time_target_met": ratio >= 10.0, "memory_target_met": extra <= 0.10 })
            })
            .collect();
        json!({
            "pools": self.pools, "crossing": self.crossing, "bindings": self.binds, "rounds": self.arms[0].1.len(),
            "arms": arms, "targets": targets,
        })
    }
}

fn session_arms(b: &Arc<AnyBackend>, seed: u64, rounds: u32, base: ImportConfig) -> anyhow::Result<SessionResult> {
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
            let run = run_session(b, &s, cfgs[i].1).with_context(|| format!("session arm {:?}", cfgs[i].0))?;
            arms[i].1.push(run);
        }
    }
    Ok(SessionResult { arms, pools: s.pools.len(), crossing: s.crossing, binds: s.binds.len(), hot: s.hot })
}
