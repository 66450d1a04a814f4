//! `emuhost prepare [CORPUS]`: translate and compile a corpus of compute shaders through the
//! Vulkan driver with a pipeline cache on disk (see `emuhost_prepare`). Without CORPUS, the
//! generated corpus of `--programs`/`--variants` is used. A progress bar on stderr when it is a
//! terminal; a summary on stdout (`--json`: one object). Exit 0 all prepared, 1 a shader failed
//! (each named with its error; the run went on), 2 an error (bad input, no Vulkan device, I/O).

use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::Context as _;
use emuhost::sched::{Allocator, Machine};
use emuhost_prepare::{CacheStart, Corpus, GenConfig, JournalStart, Options, Report, generate, prepare};

use crate::Outcome;
use crate::replay::ms;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// A corpus folder (with `corpus.txt`); without it, the generated corpus below.
    corpus: Option<PathBuf>,
    /// Workers for each phase, instead of the `prepare_workers` rule's count.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
    workers: Option<u64>,
    /// The pipeline cache file (made if missing; its journal is FILE.journal). Without it the
    /// cache lives in memory only and nothing is resumed.
    #[arg(long, value_name = "FILE")]
    cache: Option<PathBuf>,
    /// One JSON object on stdout instead of text.
    #[arg(long)]
    json: bool,
    /// The Vulkan device's index in the loader's list (default: the best: discrete GPU,
    /// integrated, virtual, CPU).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(0..=1024))]
    device: Option<u64>,
    /// Pipelines created between two saves of the cache file and its journal.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    checkpoint_every: u64,
    /// Stop after N pipelines, as an interruption would (the next run resumes).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1 << 40))]
    stop_after: Option<u64>,
    /// Write the generated corpus to DIR (sources and corpus.txt) and stop. Files there already
    /// are not written over without --force.
    #[arg(long, value_name = "DIR", conflicts_with = "corpus")]
    generate: Option<PathBuf>,
    /// With --generate: write over the corpus's files where they exist.
    #[arg(long, requires = "generate")]
    force: bool,
    #[command(flatten)]
    gen_args: GenArgs,
}

/// The generated corpus's shape.
#[derive(clap::Args, Clone)]
pub struct GenArgs {
    /// Programs in the generated corpus.
    #[arg(long, value_name = "N", default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub programs: u64,
    /// Variants of each generated program.
    #[arg(long, value_name = "M", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub variants: u64,
    /// The generator's seed.
    #[arg(long, default_value_t = 8)]
    pub seed: u64,
    /// Statements in each helper function of a generated program (its size).
    #[arg(long, value_name = "K", default_value_t = 12, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub statements: u64,
    /// Generated programs with a type error (translation fails).
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    pub broken_translate: u64,
    /// Generated programs with an extra variant whose workgroup is past the device's limits.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    pub broken_compile: u64,
}

impl GenArgs {
    pub fn config(&self) -> GenConfig {
        let mut c = GenConfig::default();
        c.programs = self.programs as usize;
        c.variants = self.variants as usize;
        c.seed = self.seed;
        c.statements = self.statements as usize;
        c.broken_translate = self.broken_translate as usize;
        c.broken_compile = self.broken_compile as usize;
        c
    }

    /// The same shape as command-line arguments (for the benchmark's child runs).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        for (flag, n) in [
            ("--programs", self.programs),
            ("--variants", self.variants),
            ("--seed", self.seed),
            ("--statements", self.statements),
            ("--broken-translate", self.broken_translate),
            ("--broken-compile", self.broken_compile),
        ] {
            v.push(flag.to_string());
            v.push(n.to_string());
        }
        v
    }
}

/// The allocator this binary's Rust code uses, whether threads allocate on it side by side (the
/// compile workers' count depends on it), and its name. mimalloc (feature `mimalloc`) scales. The
/// system allocator is glibc's malloc on Linux, counted as locked, and the process heap on
/// Windows, which scales only where it really is the segment heap: emuhost.exe's manifest asks
/// for it, and the heap's header says whether Windows gave it (an older Windows, or Wine, keeps
/// the NT heap's count: reference/001).
pub fn own_allocator() -> (Allocator, &'static str) {
    allocator_for(cfg!(feature = "mimalloc"), system_heap())
}

/// Windows: whether the process heap is the segment heap, and its name; `None` elsewhere.
fn system_heap() -> Option<(bool, &'static str)> {
    #[cfg(windows)]
    {
        use emuhost::probe::HeapKind;
        Some(match emuhost::probe::process_heap().kind {
            HeapKind::Segment => (true, "system: the segment heap"),
            HeapKind::Nt => (false, "system: the NT heap"),
            HeapKind::Wine => (false, "system: Wine's heap"),
            _ => (false, "system: a heap of unknown kind"),
        })
    }
    #[cfg(not(windows))]
    None
}

/// [`own_allocator`] given what was found: mimalloc, and the system heap's kind where there is one.
fn allocator_for(mimalloc: bool, heap: Option<(bool, &'static str)>) -> (Allocator, &'static str) {
    match (mimalloc, heap) {
        (true, _) => (Allocator::Scales, "mimalloc"),
        (false, None) => (Allocator::Locked, "system"),
        (false, Some((true, name))) => (Allocator::Scales, name),
        (false, Some((false, name))) => (Allocator::Locked, name),
    }
}

pub fn run(a: Args) -> anyhow::Result<Outcome> {
    let corpus = match &a.corpus {
        Some(dir) => Corpus::load(dir).with_context(|| format!("reading the corpus {}", dir.display()))?,
        None => generate(&a.gen_args.config()),
    };
    if let Some(dir) = &a.generate {
        corpus.write(dir, a.force).with_context(|| format!("writing the corpus to {}", dir.display()))?;
        outln!("wrote {} programs, {} variants to {}", corpus.programs.len(), corpus.variant_count(), dir.display());
        return Ok(Outcome::Ok);
    }
    let (allocator, allocator_name) = own_allocator();
    let (workers, why) = match a.workers {
        Some(n) => (n as usize, format!("{n} workers: --workers")),
        None => {
            let w = Machine::read().prepare_workers(allocator);
            (w.count, w.why)
        }
    };
    let opts = Options {
        workers,
        cache: a.cache.clone(),
        device: a.device.map(|d| d as usize),
        checkpoint_every: a.checkpoint_every as usize,
        stop_after: a.stop_after.map(|n| n as usize),
        ..Options::default()
    };
    // A bar per phase, of its variants (where stderr is a terminal).
    let bar = crate::progress::shown().then(|| crate::progress::Bar::new("", "variants", Some(0)));
    let phase_seen = Mutex::new(None);
    let report = prepare(&corpus, &opts, &|phase, done, total| {
        let Some(bar) = &bar else { return };
        let mut seen = phase_seen.lock().unwrap_or_else(|e| e.into_inner());
        if *seen != Some(phase) {
            *seen = Some(phase);
            bar.restart(phase.name(), total as u64);
        }
        bar.set(done as u64);
    })
    .context("shader preparation")?;
    drop(bar);
    let peak = emuhost_prepare::peak_memory_bytes();
    if a.json {
        let json = to_json(&report, &why, allocator_name, peak, a.cache.as_deref());
        outln!("{}", serde_json::to_string(&json).context("writing the report as JSON")?);
    } else {
        print_summary(&report, &why, allocator_name, peak, a.cache.as_deref());
    }
    Ok(if report.failures.is_empty() { Outcome::Ok } else { Outcome::CheckFailed })
}

/// What the warm cache did, in words ("says so").
fn cache_verdict(r: &Report) -> String {
    let handed = match &r.cache {
        CacheStart::Warm { bytes } => *bytes,
        _ => return String::new(),
    };
    match r.cache_hits {
        Some(h) if h == r.created && h > 0 => {
            format!("warm cache: all {h} pipelines came from the cache ({handed} bytes handed to the driver)")
        }
        Some(h) if handed <= 32 => format!(
            "warm cache: {h} of {} pipelines from the cache: the driver keeps nothing in it ({handed} bytes, its header alone)",
            r.created
        ),
        Some(h) => format!("warm cache: {h} of {} pipelines came from the cache ({handed} bytes)", r.created),
        None => format!("warm cache: {handed} bytes handed to the driver (it does not report cache hits)"),
    }
}

/// The version of `prepare --json`'s keys (raised when one changes name or meaning or goes away).
pub const SCHEMA: u32 = 1;

/// `prepare --json`: the run's figures (`bench prepare` reads them from its runs).
#[derive(Debug, serde::Serialize)]
struct JsonReport<'a> {
    schema: u32,
    programs: usize,
    variants: usize,
    device: JsonDevice<'a>,
    workers: usize,
    workers_why: &'a str,
    allocator: &'a str,
    cache: JsonCache,
    journal: JsonJournal<'a>,
    translate: JsonTranslate,
    compile: JsonCompile,
    total_ms: f64,
    peak_rss_bytes: Option<u64>,
    failures: Vec<JsonFailure<'a>>,
    interrupted: bool,
    remaining: usize,
}

#[derive(Debug, serde::Serialize)]
struct JsonDevice<'a> {
    name: &'a str,
    vendor_id: u32,
    device_id: u32,
    driver_version: u32,
}

/// The cache file: how the run found it (`none`, `cold`, `warm`, `rejected` and why) and what it
/// saved.
#[derive(Debug, serde::Serialize)]
struct JsonCache {
    file: Option<String>,
    state: &'static str,
    bytes_in: usize,
    rejected: Option<String>,
    bytes_saved: usize,
    saves: usize,
}

/// The journal: how the run found it (`none`, `resumed`, `discarded` and why) and whether it is
/// kept.
#[derive(Debug, serde::Serialize)]
struct JsonJournal<'a> {
    state: &'static str,
    skipped: usize,
    discarded: Option<&'a str>,
    kept: bool,
}

#[derive(Debug, serde::Serialize)]
struct JsonTranslate {
    programs: usize,
    variants: usize,
    wall_ms: f64,
    busy_ms: f64,
}

#[derive(Debug, serde::Serialize)]
struct JsonCompile {
    pipelines: usize,
    cache_hits: Option<usize>,
    wall_ms: f64,
    busy_ms: f64,
}

#[derive(Debug, serde::Serialize)]
struct JsonFailure<'a> {
    program: &'a str,
    variant: Option<usize>,
    constants: Option<&'a str>,
    phase: &'static str,
    error: &'a str,
}

fn to_json<'a>(
    r: &'a Report,
    why: &'a str,
    allocator: &'a str,
    peak: Option<u64>,
    cache: Option<&std::path::Path>,
) -> JsonReport<'a> {
    let (state, bytes_in, rejected) = match &r.cache {
        CacheStart::Rejected(why) => ("rejected", 0, Some(why.to_string())),
        CacheStart::Warm { bytes } => ("warm", *bytes, None),
        CacheStart::Cold => ("cold", 0, None),
        CacheStart::None => ("none", 0, None),
    };
    let (journal_state, skipped, discarded) = match &r.journal {
        JournalStart::Resumed { skipped } => ("resumed", *skipped, None),
        JournalStart::Discarded(why) => ("discarded", 0, Some(why.as_str())),
        JournalStart::None => ("none", 0, None),
    };
    let failures = r
        .failures
        .iter()
        .map(|f| JsonFailure {
            program: &f.program,
            variant: f.variant.as_ref().map(|v| v.0),
            constants: f.variant.as_ref().map(|v| v.1.as_str()),
            phase: f.phase.name(),
            error: &f.error,
        })
        .collect();
    let d = &r.device;
    JsonReport {
        schema: SCHEMA,
        programs: r.programs,
        variants: r.variants,
        device: JsonDevice {
            name: &d.name,
            vendor_id: d.vendor_id,
            device_id: d.device_id,
            driver_version: d.driver_version,
        },
        workers: r.workers,
        workers_why: why,
        allocator,
        cache: JsonCache {
            file: cache.map(|p| p.display().to_string()),
            state,
            bytes_in,
            rejected,
            bytes_saved: r.cache_bytes,
            saves: r.saves,
        },
        journal: JsonJournal { state: journal_state, skipped, discarded, kept: r.journal_kept },
        translate: JsonTranslate {
            programs: r.translated_programs,
            variants: r.translated_variants,
            wall_ms: ms(r.translate.wall),
            busy_ms: ms(r.translate.busy),
        },
        compile: JsonCompile {
            pipelines: r.created,
            cache_hits: r.cache_hits,
            wall_ms: ms(r.compile.wall),
            busy_ms: ms(r.compile.busy),
        },
        total_ms: ms(r.translate.wall + r.compile.wall),
        peak_rss_bytes: peak,
        failures,
        interrupted: r.interrupted,
        remaining: r.remaining(),
    }
}

/// What the peak memory figure is on this platform.
const PEAK: &str = if cfg!(windows) { "peak working set" } else { "VmHWM" };

fn print_summary(r: &Report, why: &str, allocator: &str, peak: Option<u64>, cache: Option<&std::path::Path>) {
    let d = &r.device;
    outln!(
        "prepared {} programs, {} variants on {} (vendor {:#x}, device {:#x})",
        r.programs,
        r.variants,
        d.name,
        d.vendor_id,
        d.device_id
    );
    outln!("  workers     {} ({allocator} allocator): {why}", r.workers);
    let file = cache.map_or(String::new(), |p| format!("{}: ", p.display()));
    match &r.cache {
        CacheStart::None => outln!("  cache       in memory only (no --cache): nothing saved, nothing resumed"),
        CacheStart::Cold => outln!("  cache       {file}cold (no file yet)"),
        CacheStart::Warm { bytes } => outln!("  cache       {file}warm: {bytes} bytes handed to the driver"),
        CacheStart::Rejected(why) => outln!("  cache       {file}REJECTED ({why}): started empty"),
    }
    match &r.journal {
        JournalStart::None => {}
        JournalStart::Resumed { skipped } => {
            outln!("  resumed     {skipped} variants were prepared by an interrupted run: skipped")
        }
        JournalStart::Discarded(why) => outln!("  journal     discarded: {why}"),
    }
    let par = |t: emuhost_prepare::PhaseTime| ms(t.busy) / ms(t.wall).max(1e-9);
    outln!(
        "  translate   {} programs, {} variants in {:.1} ms (busy {:.1} ms: {:.1} workers' worth)",
        r.translated_programs,
        r.translated_variants,
        ms(r.translate.wall),
        ms(r.translate.busy),
        par(r.translate)
    );
    let hits = r.cache_hits.map_or("cache hits not reported by the driver".to_string(), |h| format!("{h} cache hits"));
    outln!(
        "  compile     {} pipelines in {:.1} ms (busy {:.1} ms: {:.1} workers' worth), {hits}",
        r.created,
        ms(r.compile.wall),
        ms(r.compile.busy),
        par(r.compile)
    );
    let verdict = cache_verdict(r);
    if !verdict.is_empty() {
        outln!("  {verdict}");
    }
    if cache.is_some() {
        outln!("  saved       {} bytes of cache data, {} saves", r.cache_bytes, r.saves);
    }
    match peak {
        Some(b) => outln!("  peak memory {:.1} MiB ({PEAK})", b as f64 / (1 << 20) as f64),
        None => outln!("  peak memory unknown (no {PEAK} could be read)"),
    }
    if r.interrupted {
        outln!("  INTERRUPTED: {} variants left; run again to resume", r.remaining());
    }
    outln!("  failures    {}", r.failures.len());
    for f in &r.failures {
        let which = f.variant.as_ref().map_or(String::new(), |(i, c)| format!(" variant {i} ({c})"));
        outln!("FAILED {}{which} [{}]:", f.program, f.phase.name());
        for line in f.error.trim_end().lines() {
            outln!("    {line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_system_heap_scales_only_where_it_is_the_segment_heap() {
        assert_eq!(allocator_for(true, None), (Allocator::Scales, "mimalloc"));
        assert_eq!(allocator_for(true, Some((false, "nt"))), (Allocator::Scales, "mimalloc"));
        assert_eq!(allocator_for(false, None), (Allocator::Locked, "system"));
        assert_eq!(allocator_for(false, Some((true, "segment"))), (Allocator::Scales, "segment"));
        assert_eq!(allocator_for(false, Some((false, "nt"))), (Allocator::Locked, "nt"));
    }

    /// Under Wine the process heap is Wine's (it ignores the manifest's heapType): the NT heap's
    /// count, as on a Windows that did not give the segment heap.
    #[cfg(windows)]
    #[test]
    fn this_process_heap_decides_on_windows() {
        let (allocator, name) = own_allocator();
        let segment = emuhost::probe::process_heap().kind == emuhost::probe::HeapKind::Segment;
        assert_eq!(allocator == Allocator::Scales, segment || cfg!(feature = "mimalloc"), "{name}");
    }
}
