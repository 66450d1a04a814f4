//! `emuhost bench import`: (1) one import of untouched pages against one of pages populated first,
//! per size; (2) a session of pools and bindings shaped like the reference's game (thousands of
//! pools, ~2 % across a chunk's end, a few dozen chunks bound) through the importer with naive
//! chunks, with spans, and with spans + populate ahead; (3) collects beside commits and pins
//! ([`super::chain`]); (4) a binding's small import beside background imports of several sizes,
//! and beside many live imports ([`super::beside`]). The measurements are the lab's
//! ([`emuhost_lab::bench::import`]); here the flags, the backend and the printing.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use emuhost::import::{AnyBackend, Backend};
use emuhost_lab::bench::import::{SessionResult, SizeResult, beside, chain, session_arms, sizes_arms};
use serde_json::json;

use super::Report;
use crate::Outcome;

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

/// `bench import --json`: each part's figures (`null` where it was left out).
#[derive(serde::Serialize)]
struct ImportJson<'a> {
    schema: u32,
    bench: &'static str,
    /// The import backend and device.
    backend: &'a str,
    sizes: Vec<serde_json::Value>,
    session: serde_json::Value,
    chain: serde_json::Value,
    beside: serde_json::Value,
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
    let parts = a.sizes_mib.len() as u64
        + u64::from(!a.no_session)
        + u64::from(a.chain_rounds > 0)
        + u64::from(a.beside_rounds > 0);
    let bar = crate::progress::shown().then(|| crate::progress::Bar::new("bench import", "parts", Some(parts)));
    let part = |what: &str| {
        if let Some(b) = &bar {
            b.message(&format!("bench import: {what}"));
        }
    };
    let mut sizes = Vec::new();
    for &mib in &a.sizes_mib {
        part(&format!("{mib} MiB imports"));
        let r = sizes_arms(&backend, mib * MIB, a.rounds)?;
        if !a.json {
            r.print();
        }
        sizes.push(r.json());
        bar.as_ref().map(crate::progress::Bar::inc);
    }
    let session = if a.no_session {
        serde_json::Value::Null
    } else {
        part("the session");
        let s = session_arms(&backend, a.seed, a.session_rounds, settings.import_config())?;
        if !a.json {
            s.print();
        }
        bar.as_ref().map(crate::progress::Bar::inc);
        s.json()
    };
    let chain = if a.chain_rounds == 0 {
        serde_json::Value::Null
    } else {
        part("collects beside commits and pins");
        let dur = Duration::from_millis(a.chain_ms);
        let c = chain::arms(&backend, a.chain_rounds, dur, a.chain_pin_mib * MIB, a.chain_piece_kib << 10)?;
        if !a.json {
            c.print();
        }
        bar.as_ref().map(crate::progress::Bar::inc);
        c.json()
    };
    let beside = if a.beside_rounds == 0 {
        serde_json::Value::Null
    } else {
        part("small imports beside background imports");
        let dur = Duration::from_millis(a.beside_ms);
        let sizes: Vec<u64> = a.beside_kib.iter().map(|k| k << 10).collect();
        let r = beside::arms(&backend, a.beside_rounds, dur, &sizes, a.beside_live)?;
        if !a.json {
            r.print();
        }
        r.json()
    };
    drop(bar);
    if a.json {
        let all = ImportJson { schema: super::SCHEMA, bench: "import", backend: &what, sizes, session, chain, beside };
        outln!("{}", serde_json::to_string(&all)?);
    }
    Ok(Outcome::Ok)
}

impl Report for SizeResult {
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

impl Report for SessionResult {
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
