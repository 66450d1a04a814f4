//! `emuhost bench snapshot`: a snapshot's take and the restore of the previous snapshot against a
//! full copy of the committed memory (read into a buffer, written back), per fraction of pages
//! written, both arms in each round; exit 1 when the memory after a restore differed from the
//! snapshot's bytes. The measurement is the lab's ([`emuhost_lab::bench::snapshot`]); here the
//! flags, the memory check and the printing.

use anyhow::Context;
use emuhost_lab::bench::snapshot::{DEFAULT_PERCENTS, SnapshotBench, SnapshotReport, TARGET_RATIO};
use emuhost_lab::bench::{Arm, median};
use serde_json::json;

use super::Report;
use crate::Outcome;

/// `--watch`'s help: the write-tracking backends of this platform.
#[cfg(target_os = "linux")]
const WATCH_HELP: &str = "Write-tracking backend (EMUHOST_WATCH): uffd, mprotect";
#[cfg(windows)]
const WATCH_HELP: &str = "Write-tracking backend (EMUHOST_WATCH): writewatch, guard";

#[derive(clap::Args)]
pub struct Args {
    /// Rounds (each measures both arms at every fraction).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=10000))]
    rounds: u32,
    /// Memory committed, in MiB (a run needs about four times as much: the memory, the full
    /// copy's buffer, the snapshots' copy and the buffer they read it through).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    committed_mib: u64,
    /// The shares of pages written, in percent, comma-separated (each more than 0, at most 100).
    #[arg(long, value_delimiter = ',', value_parser = parse_percent, default_values_t = DEFAULT_PERCENTS)]
    percents: Vec<f64>,
    // The help names this platform's backends (Windows: writewatch, guard).
    #[arg(long, help = WATCH_HELP)]
    watch: Option<String>,
    /// The seed of the pages written.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// A share of pages written, in percent: a number more than 0 and at most 100.
fn parse_percent(s: &str) -> Result<f64, String> {
    let p: f64 = s.trim().parse().map_err(|_| format!("{s:?} is not a number (a share of pages, in percent)"))?;
    if !(p > 0.0 && p <= 100.0) {
        return Err(format!("{s} % of pages: a share must be more than 0 and at most 100"));
    }
    Ok(p)
}

/// Refuses a run the memory available here cannot hold (rather than being killed for memory).
fn check_memory(b: &SnapshotBench) -> anyhow::Result<()> {
    let needed = b.memory_needed();
    let machine = emuhost::sched::Machine::read();
    let Some(available) = machine.available_bytes else {
        eprintln!("emuhost: warning: the memory available is unknown; this run needs about {} MiB", needed >> 20);
        return Ok(());
    };
    anyhow::ensure!(
        needed <= available,
        "--committed-mib {} needs about {} MiB of memory (four times the committed memory: the memory, the full \
         copy's buffer, the snapshots' copy of every page and the buffer they read it through; twice the pages \
         written), and {} MiB are available: use a smaller --committed-mib",
        b.committed_mib,
        needed >> 20,
        available >> 20
    );
    Ok(())
}

pub fn run(a: Args, settings: &emuhost::settings::Settings) -> anyhow::Result<Outcome> {
    if cfg!(debug_assertions) {
        eprintln!("emuhost: warning: a debug build; measure with `cargo build --release`");
    }
    let mut settings = settings.clone();
    if let Some(v) = &a.watch {
        crate::switches::set(&mut settings, emuhost::settings::WATCH_SWITCH, v).context("--watch")?;
    }
    let b = SnapshotBench::new(a.rounds, a.committed_mib, a.percents.clone(), settings.tracker_config(), a.seed)
        .mode(settings.snapshot_config().mode);
    check_memory(&b)?;
    let r = emuhost_lab::bench::snapshot::run(&b)?;
    if a.json {
        outln!("{}", serde_json::to_string(&json(&a, &r))?);
    } else {
        print(&a, &r);
    }
    Ok(if r.mismatched_rounds() == 0 { Outcome::Ok } else { Outcome::CheckFailed })
}

/// The median of `v`'s values.
fn med(v: &[u64]) -> f64 {
    let mut v: Vec<f64> = v.iter().map(|&n| n as f64).collect();
    median(&mut v)
}

/// `bench snapshot --json`: each fraction's comparison (see `Report for Comparison`) with its own
/// figures beside.
fn json(a: &Args, r: &SnapshotReport) -> serde_json::Value {
    let results: Vec<serde_json::Value> = r
        .fractions
        .iter()
        .map(|f| {
            let mut c = f.comparison.json();
            let extra = json!({
                "percent": f.percent,
                "pages_written": f.pages_written,
                "take_ms": f.take.median_ms(),
                "restore_ms": f.restore.median_ms(),
                "take_restore_ms": f.comparison.new.median_ms(),
                "full_read_ms": f.full_read.median_ms(),
                "full_write_ms": f.full_write.median_ms(),
                "full_copy_ms": f.comparison.old.median_ms(),
                "full_copy_over_take_restore": f.comparison.time_ratio(),
                "take_pages_copied": med(&f.take_pages),
                "restore_pages_put_back": med(&f.restore_pages),
                "mismatched_rounds": f.mismatched_rounds,
                "first_mismatch": f.first_mismatch,
            });
            if let (Some(c), serde_json::Value::Object(e)) = (c.as_object_mut(), extra) {
                c.extend(e);
            }
            c
        })
        .collect();
    json!({
        "schema": super::SCHEMA,
        "bench": "snapshot",
        "backend": r.backend.name(),
        "mode": r.mode.name(),
        "committed_mib": a.committed_mib,
        "pages": r.pages,
        "page_size": emuhost::space::page_size(),
        "rounds": a.rounds,
        "seed": a.seed,
        "target_ratio_at_1pct": TARGET_RATIO,
        "results": results,
        "mismatched_rounds": r.mismatched_rounds(),
        "wine": emuhost::probe::wine_version(),
        "figures": wine_note(),
    })
}

/// Under Wine, what its figures are: Wine's, never Windows'.
fn wine_note() -> Option<String> {
    emuhost::probe::wine_version().map(|v| format!("under Wine {v}: these figures are Wine's, not Windows' timings"))
}

fn print(a: &Args, r: &SnapshotReport) {
    let ms = |arm: &Arm| format!("{:.3} ms", arm.median_ms());
    if let Some(note) = wine_note() {
        outln!("{note}");
    }
    outln!(
        "snapshots over {} MiB committed ({} pages), {} backend, mode {}, {} rounds (medians)",
        a.committed_mib,
        r.pages,
        r.backend.name(),
        r.mode,
        a.rounds
    );
    for f in &r.fractions {
        f.comparison.print();
        outln!(
            "  take {} ({:.0} pages copied), restore {} ({:.0} pages put back); full copy: read {}, write back {}",
            ms(&f.take),
            med(&f.take_pages),
            ms(&f.restore),
            med(&f.restore_pages),
            ms(&f.full_read),
            ms(&f.full_write)
        );
        if let Some(why) = &f.first_mismatch {
            outln!("  MISMATCH in {} rounds: {why}", f.mismatched_rounds);
        }
    }
    let rounds = u64::from(a.rounds) * r.fractions.len() as u64;
    let bad = r.mismatched_rounds();
    outln!(
        "memory after each restore equals the snapshot's bytes: {} of {rounds} rounds{}",
        rounds - u64::from(bad),
        if bad == 0 { "" } else { " (exit 1)" }
    );
    outln!("the issue's goal: take + restore >= {TARGET_RATIO}x faster than a full copy at 1 % written, on 4096 MiB");
}
