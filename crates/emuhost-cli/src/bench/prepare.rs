//! `emuhost bench prepare`: the preparation at 1, 2, 4 ... N workers, each with a cold cache (no
//! file, the driver's own disk cache off) and then a warm one (the file the cold run saved). Each
//! run is its own process (`emuhost prepare --json`), so its peak memory (VmHWM) and the driver's
//! state are its own. Rounds alternate the worker counts; the table gives medians, the speed-up
//! against 1 worker, and the rule's count (`prepare_workers`) for this build's allocator. Build
//! once as is and once with `--features mimalloc` to cover both allocators. The rounds and the
//! cells are the lab's ([`emuhost_lab::bench::prepare`]); here the child processes and the printing.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context as _, bail};
use emuhost_lab::bench::prepare::{Cell, PrepareRun, worker_counts};
use serde_json::{Value, json};

use crate::Outcome;
use crate::prepare::{GenArgs, own_allocator};

#[derive(clap::Args)]
pub struct Args {
    /// Rounds of each worker count (alternated).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// The worker counts, comma-separated (default: 1, 2, 4 ... up to the usable CPUs, and the
    /// rule's count).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=1024))]
    workers: Vec<u64>,
    /// A corpus folder instead of the generated corpus.
    #[arg(long, value_name = "DIR")]
    corpus: Option<PathBuf>,
    /// Programs in the generated corpus.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    programs: u64,
    /// Variants of each generated program.
    #[arg(long, value_name = "M", default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=4096))]
    variants: u64,
    /// Statements in each helper function of a generated program (its size).
    #[arg(long, value_name = "K", default_value_t = 24, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    statements: u64,
    /// The Vulkan device's index (default: the best).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(0..=1024))]
    device: Option<u64>,
    /// Leave the driver's own disk cache on (Mesa's, NVIDIA's): "cold" runs may then hit it.
    #[arg(long)]
    keep_driver_cache: bool,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// One run of `emuhost prepare` as a child process; its JSON.
fn child(a: &Args, workers: u64, cache: &std::path::Path) -> anyhow::Result<Value> {
    let exe = std::env::current_exe().context("finding this executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg("prepare").arg("--json").arg("--workers").arg(workers.to_string()).arg("--cache").arg(cache);
    match &a.corpus {
        Some(dir) => {
            cmd.arg(dir);
        }
        None => {
            let g = GenArgs {
                programs: a.programs,
                variants: a.variants,
                seed: 8,
                statements: a.statements,
                broken_translate: 0,
                broken_compile: 0,
            };
            cmd.args(g.to_args());
        }
    }
    if let Some(d) = a.device {
        cmd.arg("--device").arg(d.to_string());
    }
    cmd.env("EMUHOST_LOG", "warn");
    if !a.keep_driver_cache {
        // The drivers' own on-disk shader caches, so that a cold run compiles.
        cmd.env("MESA_SHADER_CACHE_DISABLE", "true").env("__GL_SHADER_DISK_CACHE", "0");
    }
    let out = cmd.output().context("running emuhost prepare")?;
    if !matches!(out.status.code(), Some(0 | 1)) {
        bail!("emuhost prepare --workers {workers} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "emuhost prepare's JSON: {}",
            String::from_utf8_lossy(&out.stdout).chars().take(400).collect::<String>()
        )
    })
}

/// What one `emuhost prepare --json` said, as the bench reads it.
fn prepare_run(v: &Value) -> PrepareRun {
    let f = |p: &str| v.pointer(p).and_then(Value::as_f64).unwrap_or(f64::NAN);
    PrepareRun {
        total_ms: f("/total_ms"),
        translate_ms: f("/translate/wall_ms"),
        compile_ms: f("/compile/wall_ms"),
        peak_rss_bytes: f("/peak_rss_bytes"),
        cache_hits: f("/compile/cache_hits"),
        pipelines: v.pointer("/compile/pipelines").and_then(Value::as_u64).unwrap_or(0),
    }
}

/// A cell's medians as JSON, its speed-up against `base_ms`.
/// `bench prepare --json`.
#[derive(serde::Serialize)]
struct PrepareJson<'a> {
    schema: u32,
    bench: &'static str,
    allocator: &'a str,
    usable_cpus: u64,
    rounds: u32,
    /// The device, as its runs' `prepare --json` named it.
    device: Value,
    /// The corpus: a folder, or the generated one's sizes.
    corpus: Value,
    driver_disk_cache: bool,
    prepare_workers: usize,
    prepare_workers_why: &'a str,
    /// Per worker count: cold and warm runs' medians.
    results: Vec<Value>,
}

fn cell_json(c: &Cell, base_ms: f64) -> Value {
    json!({
        "total_ms": c.total.median_ms(),
        "translate_ms": Cell::med(&c.translate),
        "compile_ms": Cell::med(&c.compile),
        "speedup": base_ms / c.total.median_ms(),
        "peak_mib": Cell::med(&c.peak_mib),
        "cache_hits": Cell::med(&c.hits),
        "pipelines": c.pipelines,
    })
}

pub fn run(a: Args) -> anyhow::Result<Outcome> {
    if cfg!(debug_assertions) {
        eprintln!("emuhost: warning: a debug build; measure with `cargo build --release`");
    }
    let machine = emuhost::sched::Machine::read();
    let usable = machine.usable_cpus() as u64;
    let (allocator, allocator_name) = own_allocator();
    let rule = machine.prepare_workers(allocator);
    let counts = worker_counts(&a.workers, usable, rule.count as u64);
    let (cold, warm, device) = measure(&a, &counts)?;

    let (cold_base, warm_base) = (cold[0].total.median_ms(), warm[0].total.median_ms());
    let rows: Vec<Value> = counts
        .iter()
        .enumerate()
        .map(|(i, w)| json!({ "workers": w, "rule": *w == rule.count as u64, "cold": cell_json(&cold[i], cold_base), "warm": cell_json(&warm[i], warm_base) }))
        .collect();
    let corpus = match &a.corpus {
        Some(d) => json!({ "folder": d.display().to_string() }),
        None => json!({ "programs": a.programs, "variants": a.variants, "statements": a.statements }),
    };
    if a.json {
        let json = PrepareJson {
            schema: super::SCHEMA,
            bench: "prepare",
            allocator: allocator_name,
            usable_cpus: usable,
            rounds: a.rounds,
            device,
            corpus,
            driver_disk_cache: a.keep_driver_cache,
            prepare_workers: rule.count,
            prepare_workers_why: &rule.why,
            results: rows,
        };
        outln!("{}", serde_json::to_string(&json)?);
        return Ok(Outcome::Ok);
    }
    print_table(&a, allocator_name, usable, &device, cold[0].pipelines, &rows, &rule.why);
    Ok(Outcome::Ok)
}

/// Each worker count's cold and warm runs (each a child process, the counts alternated within
/// each round: [`emuhost_lab::bench::prepare::measure`]) in a scratch folder, and the device they
/// ran on.
fn measure(a: &Args, counts: &[u64]) -> anyhow::Result<(Vec<Cell>, Vec<Cell>, Value)> {
    let dir = std::env::temp_dir().join(format!("emuhost-bench-prepare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("making {}", dir.display()))?;
    let cache = dir.join("pipelines.vkpc");
    let journal = dir.join("pipelines.vkpc.journal");
    let mut device = Value::Null;
    let run = |workers, cold| {
        let v = child(a, workers, &cache)?;
        if cold {
            device = v["device"].clone();
        }
        anyhow::Ok(prepare_run(&v))
    };
    let done = |r: usize, workers: u64, c: &PrepareRun, w: &PrepareRun| {
        if !a.json {
            eprintln!(
                "round {} workers {:>3}: cold {:>9.1} ms, warm {:>9.1} ms",
                r + 1,
                workers,
                c.total_ms,
                w.total_ms
            );
        }
    };
    let result = emuhost_lab::bench::prepare::measure(a.rounds, counts, (&cache, &journal), run, done);
    let _ = std::fs::remove_dir_all(&dir);
    let (cold, warm) = result?;
    Ok((cold, warm, device))
}

/// The text report of `bench prepare`.
fn print_table(a: &Args, allocator_name: &str, usable: u64, device: &Value, pipelines: u64, rows: &[Value], why: &str) {
    outln!(
        "emuhost prepare: {} pipelines, allocator {allocator_name}, {usable} usable CPUs, {} rounds (medians), device {}",
        pipelines,
        a.rounds,
        device["name"].as_str().unwrap_or("?")
    );
    outln!(
        "  {:>8} | {:>10} {:>10} {:>10} {:>8} {:>9} | {:>10} {:>10} {:>8} {:>9} {:>6}",
        "workers",
        "cold ms",
        "translate",
        "compile",
        "speed-up",
        "peak MiB",
        "warm ms",
        "compile",
        "speed-up",
        "peak MiB",
        "hits"
    );
    for r in rows {
        let f = |p: &str| r.pointer(p).and_then(Value::as_f64).unwrap_or(f64::NAN);
        let mark = if r["rule"].as_bool() == Some(true) { "*" } else { " " };
        outln!(
            "  {:>7}{mark} | {:>10.1} {:>10.1} {:>10.1} {:>7.2}x {:>9.1} | {:>10.1} {:>10.1} {:>7.2}x {:>9.1} {:>6.0}",
            r["workers"].as_u64().unwrap_or(0),
            f("/cold/total_ms"),
            f("/cold/translate_ms"),
            f("/cold/compile_ms"),
            f("/cold/speedup"),
            f("/cold/peak_mib"),
            f("/warm/total_ms"),
            f("/warm/compile_ms"),
            f("/warm/speedup"),
            f("/warm/peak_mib"),
            f("/warm/cache_hits"),
        );
    }
    outln!("  * the rule's count here: {}", why);
    if !a.keep_driver_cache {
        outln!("  (the drivers' own disk caches were off: MESA_SHADER_CACHE_DISABLE=true, __GL_SHADER_DISK_CACHE=0)");
    }
}
