//! `emuhost bench workers`: a compile-like job (allocation-heavy tree passes) at 1, 2, 4 ... N
//! workers, jobs per second and the speed-up, with this build's allocator (the lab's
//! [`emuhost_lab::bench::workers`]; here the flags and the printing).
//!
//! On Windows the allocator is the process heap, and the bench runs both heaps in one run: this
//! process (its manifest asks for the segment heap) and, as the other arm, a copy of this exe in a
//! temporary folder with the manifest taken out (the heap Windows gives an exe without one),
//! deleted afterwards. The rounds alternate between the two processes (each child runs one round,
//! the same jobs); each arm says which heap its process really had, read from the heap's header in
//! that process. Under Wine both have Wine's heap (Wine ignores `heapType`) and the figures are
//! Wine's: the output says so.

use serde_json::json;

use crate::Outcome;

#[derive(clap::Args)]
pub struct Args {
    /// Rounds of each worker count (alternated; on Windows, alternated between the two heaps).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Jobs per round (each a small compile: build, fold, lower a tree of ~20,000 nodes).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    jobs: u64,
    /// The most workers to try (1, 2, 4, ... up to it); default: the usable CPUs.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    max_workers: Option<u64>,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// The other heap's process (Windows): run round N only and print it as JSON.
    #[arg(long, hide = true, value_name = "N")]
    arm_round: Option<u32>,
}

/// This build's allocator, in words.
fn allocator() -> &'static str {
    if cfg!(feature = "mimalloc") {
        "mimalloc"
    } else if cfg!(windows) {
        "the process heap (HeapAlloc)"
    } else {
        "system (glibc malloc)"
    }
}

pub fn run(a: Args) -> anyhow::Result<Outcome> {
    if let Some(r) = a.arm_round {
        return heaps::arm_round(&a, r);
    }
    if cfg!(debug_assertions) {
        eprintln!("emuhost: warning: a debug build; measure with `cargo build --release`");
    }
    // With mimalloc the process heap is not Rust's allocator: there is no heap to compare.
    if cfg!(windows) && !cfg!(feature = "mimalloc") {
        return heaps::run(&a);
    }
    one_arm(&a)
}

/// `bench workers --json`.
#[derive(serde::Serialize)]
struct WorkersJson<'a> {
    schema: u32,
    bench: &'static str,
    allocator: &'a str,
    usable_cpus: u64,
    jobs: u64,
    rounds: u32,
    results: Vec<serde_json::Value>,
    prepare_workers: PrepareWorkers,
    /// Windows, both heaps: the arms and their ratios.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    heaps: Option<serde_json::Value>,
}

/// The preparation's worker counts for an allocator that scales and one that does not.
#[derive(serde::Serialize)]
struct PrepareWorkers {
    scales: usize,
    locked: usize,
}

/// This process alone (Linux; Windows with mimalloc).
fn one_arm(a: &Args) -> anyhow::Result<Outcome> {
    let bench = emuhost_lab::bench::workers::WorkersBench::new(a.rounds, a.jobs, a.max_workers);
    let r = emuhost_lab::bench::workers::workers(&bench);
    let (usable, scales, locked) = (r.usable_cpus, r.prepare_scales, r.prepare_locked);
    let allocator = allocator();
    let rows = rows_json(&r.rows);
    if a.json {
        let json = WorkersJson {
            schema: super::SCHEMA,
            bench: "workers",
            allocator,
            usable_cpus: usable,
            jobs: a.jobs,
            rounds: a.rounds,
            results: rows,
            prepare_workers: PrepareWorkers { scales, locked },
            heaps: None,
        };
        outln!("{}", serde_json::to_string(&json)?);
        return Ok(Outcome::Ok);
    }
    outln!(
        "compile-like jobs ({} per round, {} rounds, medians), allocator {allocator}, {usable} usable CPUs",
        a.jobs,
        a.rounds
    );
    outln!("  {:>8} {:>12} {:>10} {:>8}", "workers", "median ms", "jobs/s", "speed-up");
    for r in &rows {
        outln!(
            "  {:>8} {:>12.1} {:>10.1} {:>7.2}x",
            r["workers"],
            r["median_ms"].as_f64().unwrap_or(f64::NAN),
            r["jobs_per_s"].as_f64().unwrap_or(f64::NAN),
            r["speedup"].as_f64().unwrap_or(f64::NAN)
        );
    }
    outln!("  prepare_workers on this machine: {scales} where the allocator scales, {locked} where it is locked");
    Ok(Outcome::Ok)
}

fn rows_json(rows: &[emuhost_lab::bench::workers::WorkersRow]) -> Vec<serde_json::Value> {
    rows.iter()
        .map(|w| json!({ "workers": w.workers, "median_ms": w.median_ms, "jobs_per_s": w.jobs_per_s, "speedup": w.speedup }))
        .collect()
}

#[cfg(not(windows))]
mod heaps {
    use super::Args;
    use crate::Outcome;

    pub fn arm_round(_a: &Args, _r: u32) -> anyhow::Result<Outcome> {
        anyhow::bail!("--arm-round is the Windows bench's other heap's process; there is one heap here")
    }

    pub fn run(a: &Args) -> anyhow::Result<Outcome> {
        super::one_arm(a)
    }
}

#[cfg(windows)]
mod heaps {
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::time::Duration;

    use anyhow::{Context as _, bail};
    use emuhost::probe::{HeapKind, ProcessHeap, exe_manifest, process_heap, strip_manifest, wine_version};
    use emuhost_lab::bench::Arm;
    use emuhost_lab::bench::workers::{Workers, WorkersBench, rows};
    use serde_json::{Value, json};

    use super::{Args, rows_json};
    use crate::Outcome;

    /// What a manifest asks for: the segment heap.
    const SEGMENT_HEAP: &[u8] = b">SegmentHeap</";

    /// A heap as JSON.
    fn heap_json(h: ProcessHeap) -> Value {
        json!({ "kind": h.kind.key(), "name": h.kind.name(), "signature": h.signature.map(|s| format!("{s:#010x}")) })
    }

    /// A heap in words: `Wine's heap (header signature 0xffeeffee)`.
    fn heap_words(h: &Value) -> String {
        format!(
            "{} (header signature {})",
            h["name"].as_str().unwrap_or("unknown"),
            h["signature"].as_str().unwrap_or("unreadable")
        )
    }

    /// The other arm's process: round `r` of the same jobs, and the heap it had, as JSON.
    pub fn arm_round(a: &Args, r: u32) -> anyhow::Result<Outcome> {
        let mut w = Workers::new(&WorkersBench::new(1, a.jobs, a.max_workers));
        w.round(r);
        let ms: Vec<f64> = w.arms().iter().map(Arm::median_ms).collect();
        outln!(
            "{}",
            json!({ "bench": "workers-arm", "round": r, "heap": heap_json(process_heap()), "workers": w.counts(), "ms": ms })
        );
        Ok(Outcome::Ok)
    }

    /// A copy of this exe without its manifest in a folder of its own, deleted on drop.
    struct Copy {
        dir: PathBuf,
        exe: PathBuf,
    }

    impl Copy {
        fn make(exe: &Path) -> anyhow::Result<Copy> {
            let dir = std::env::temp_dir().join(format!("emuhost-bench-workers-{}", std::process::id()));
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let copy = Copy { exe: dir.join("emuhost.exe"), dir };
            std::fs::copy(exe, &copy.exe)
                .with_context(|| format!("copying {} to {}", exe.display(), copy.exe.display()))?;
            strip_manifest(&copy.exe)?;
            if exe_manifest(&copy.exe)?.is_some() {
                bail!("{} still has a manifest after it was taken out", copy.exe.display());
            }
            Ok(copy)
        }
    }

    impl Drop for Copy {
        fn drop(&mut self) {
            // Windows may hold an exe that just exited for a moment: try a few times.
            for _ in 0..20 {
                if std::fs::remove_dir_all(&self.dir).is_ok() || !self.dir.exists() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            eprintln!("emuhost: warning: could not delete {}", self.dir.display());
        }
    }

    /// Round `r` in the copy's process; its times go into `arms` (in `counts`' order) and its heap
    /// is returned.
    fn child_round(a: &Args, copy: &Copy, counts: &[u64], r: u32, arms: &mut [Arm]) -> anyhow::Result<Value> {
        let max = counts.last().copied().unwrap_or(1);
        let out = Command::new(&copy.exe)
            .args(["bench", "workers", "--jobs", &a.jobs.to_string(), "--max-workers", &max.to_string()])
            .args(["--arm-round", &r.to_string()])
            .output()
            .with_context(|| format!("running {}", copy.exe.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!("the other heap's process failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
        }
        let v: Value = serde_json::from_str(stdout.trim())
            .with_context(|| format!("reading the other heap's process's output: {stdout}"))?;
        let (workers, ms) = (v["workers"].as_array(), v["ms"].as_array());
        let workers: Vec<u64> = workers.into_iter().flatten().filter_map(Value::as_u64).collect();
        let ms: Vec<f64> = ms.into_iter().flatten().filter_map(Value::as_f64).collect();
        if workers != counts || ms.len() != counts.len() {
            bail!("the other heap's process ran other worker counts ({workers:?}, {} times) than {counts:?}", ms.len());
        }
        for (arm, t) in arms.iter_mut().zip(ms) {
            arm.times.push(Duration::from_secs_f64(t / 1e3));
        }
        Ok(v["heap"].clone())
    }

    /// Both heaps, rounds alternated between this process and the copy's.
    pub fn run(a: &Args) -> anyhow::Result<Outcome> {
        let exe = std::env::current_exe().context("finding this executable")?;
        let manifest = exe_manifest(&exe)?;
        let asks = manifest.as_deref().is_some_and(|m| m.windows(SEGMENT_HEAP.len()).any(|w| w == SEGMENT_HEAP));
        let copy = Copy::make(&exe)?;
        let mut w = Workers::new(&WorkersBench::new(a.rounds, a.jobs, a.max_workers));
        let counts = w.counts().to_vec();
        let mut other: Vec<Arm> = counts.iter().map(|_| Arm::default()).collect();
        let mut other_heap = Value::Null;
        emuhost_lab::bench::progress::plan(u64::from(a.rounds));
        for r in 0..a.rounds {
            emuhost_lab::bench::progress::tick();
            // Alternate which process goes first.
            if r % 2 == 1 {
                other_heap = child_round(a, &copy, &counts, r, &mut other)?;
                w.round(r);
            } else {
                w.round(r);
                other_heap = child_round(a, &copy, &counts, r, &mut other)?;
            }
        }
        drop(copy);
        let report = w.report();
        let this_heap = heap_json(process_heap());
        let (this_rows, other_rows) = (rows_json(&report.rows), rows_json(&rows(a.jobs, &counts, &other)));
        let ratios: Vec<Value> = report
            .rows
            .iter()
            .zip(&other)
            .map(|(row, o)| json!({ "workers": row.workers, "no_manifest_over_manifest": o.median_ms() / row.median_ms }))
            .collect();
        let wine = wine_version();
        if a.json {
            let heaps = json!({
                        "wine": wine, "figures": if wine.is_some() { "Wine's" } else { "Windows'" },
                        "arms": [
                            { "arm": "manifest", "exe_asks_segment_heap": asks, "heap": this_heap, "results": this_rows },
                            { "arm": "no manifest", "exe_asks_segment_heap": false, "heap": other_heap, "results": other_rows },
                        ],
                        "time_ratios": ratios });
            let json = super::WorkersJson {
                schema: crate::bench::SCHEMA,
                bench: "workers",
                allocator: super::allocator(),
                usable_cpus: report.usable_cpus,
                jobs: a.jobs,
                rounds: a.rounds,
                results: this_rows,
                prepare_workers: super::PrepareWorkers { scales: report.prepare_scales, locked: report.prepare_locked },
                heaps: Some(heaps),
            };
            outln!("{}", serde_json::to_string(&json)?);
            return Ok(Outcome::Ok);
        }
        let p = Printed { this_heap: &this_heap, other_heap: &other_heap, asks, wine: wine.as_deref() };
        print(a, &report, &p, &this_rows, &other_rows);
        Ok(Outcome::Ok)
    }

    /// What the text says about the heaps.
    struct Printed<'a> {
        this_heap: &'a Value,
        other_heap: &'a Value,
        asks: bool,
        wine: Option<&'a str>,
    }

    fn print(
        a: &Args,
        report: &emuhost_lab::bench::workers::WorkersReport,
        p: &Printed,
        this_rows: &[Value],
        other_rows: &[Value],
    ) {
        outln!(
            "compile-like jobs ({} per round, {} rounds alternated between two processes, medians), allocator {}, {} usable CPUs",
            a.jobs,
            a.rounds,
            super::allocator(),
            report.usable_cpus
        );
        let asks = if p.asks {
            "its manifest asks for the segment heap"
        } else {
            "its manifest does NOT ask for the segment heap"
        };
        outln!("  this process ({asks}): {}", heap_words(p.this_heap));
        outln!("  the other arm (a copy of the exe without the manifest): {}", heap_words(p.other_heap));
        let kind = |h: &Value| h["kind"].as_str().unwrap_or("unknown").to_string();
        match p.wine {
            Some(v) => outln!(
                "  under Wine {v}: Wine ignores heapType, so both arms have Wine's heap and the two columns compare the same heap; every figure here is Wine's, not Windows'"
            ),
            None if kind(p.this_heap) != HeapKind::Segment.key() => outln!(
                "  this Windows did not give this process the segment heap (Windows 10 2004 or later honours the manifest)"
            ),
            None => {}
        }
        outln!(
            "  {:>8} | {:>11} {:>9} {:>8} | {:>14} {:>9} {:>8} | {:>10}",
            "workers",
            "manifest ms",
            "jobs/s",
            "speed-up",
            "no manifest ms",
            "jobs/s",
            "speed-up",
            "no/with"
        );
        for (t, o) in this_rows.iter().zip(other_rows) {
            let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
            outln!(
                "  {:>8} | {:>11.1} {:>9.1} {:>7.2}x | {:>14.1} {:>9.1} {:>7.2}x | {:>9.2}x",
                t["workers"].as_u64().unwrap_or(0),
                f(t, "median_ms"),
                f(t, "jobs_per_s"),
                f(t, "speedup"),
                f(o, "median_ms"),
                f(o, "jobs_per_s"),
                f(o, "speedup"),
                f(o, "median_ms") / f(t, "median_ms")
            );
        }
        outln!(
            "  no/with: the copy without the manifest's median time over this process's (above 1: the manifest's heap is faster)"
        );
        outln!(
            "  prepare_workers on this machine: {} where the allocator scales, {} where it is locked",
            report.prepare_scales,
            report.prepare_locked
        );
    }
}
