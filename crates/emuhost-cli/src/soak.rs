//! `emuhost replay --soak DURATION`: the replay looped in one process until the duration has
//! passed, with the process's resident memory and the imports left live after each loop, and the
//! check that memory stayed flat after the first loop and nothing was left live (exit 1 if not).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use emuhost_lab::replay::{ReplayConfig, ReplayReport, replay_default, replay_file};
use emuhost_lab::soak::{DEFAULT_GROWTH_LIMIT, SoakLoop, SoakVerdict, cpu_time, judge, memory, trim_heap};

use crate::Outcome;

/// What a failed read of the process's memory or CPU time was reading.
#[cfg(target_os = "linux")]
const PROCESS_MEMORY: &str = "reading /proc/self/status";
#[cfg(windows)]
const PROCESS_MEMORY: &str = "reading the process's memory (GetProcessMemoryInfo)";
#[cfg(target_os = "linux")]
const PROCESS_CPU: &str = "reading the process's CPU time (getrusage)";
#[cfg(windows)]
const PROCESS_CPU: &str = "reading the process's CPU time (GetProcessTimes)";

/// How the allocator's free memory is given back after each loop, for the report.
const TRIM: &str = if cfg!(windows) { "HeapCompact of the process heap" } else { "malloc_trim" };

/// Rows of the table at most: past this, every Nth loop is shown (and each that failed a check).
const MAX_ROWS: usize = 40;

/// Parses a duration as humantime does (`10m`, `90s`, `1h 30m`, `2days`), or seconds alone
/// (`90`).
pub fn parse_duration(text: &str) -> anyhow::Result<Duration> {
    let t = text.trim();
    let parsed = if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        t.parse::<u64>().map(Duration::from_secs).map_err(|e| e.to_string())
    } else {
        humantime::parse_duration(t).map_err(|e| e.to_string())
    };
    match parsed {
        Ok(d) if d.is_zero() => bail!("--soak {text:?}: the duration must be more than 0"),
        Ok(d) => Ok(d),
        Err(e) => bail!("--soak {text:?}: {e} (a duration such as 10m, 90s, 1h 30m, or seconds alone)"),
    }
}

/// `d` for a person, to the tenth of a second (`10m 0s 100ms`), as humantime writes it.
fn human(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_millis(d.as_millis().div_ceil(100) as u64 * 100))
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// Loops the replay until `duration` has passed (at least once) and reports; with `trim`, what
/// the C allocator holds free is given back to the kernel after each loop's teardown, before the
/// memory is read (the resident memory before it is reported too).
pub fn run(
    duration: Duration,
    trace: Option<&Path>,
    cfg: &ReplayConfig,
    trim: bool,
    as_json: bool,
) -> anyhow::Result<Outcome> {
    let start = Instant::now();
    let mut loops: Vec<SoakLoop> = Vec::new();
    let mut first: Option<ReplayReport> = None;
    // The bar counts seconds of the duration asked (a loop can run past it).
    let secs = duration.as_secs();
    let bar = crate::progress::ticking("soak".into(), "s", Some(secs), move || start.elapsed().as_secs().min(secs));
    while loops.is_empty() || start.elapsed() < duration {
        let index = loops.len() as u64 + 1;
        let (t, cpu0) = (Instant::now(), cpu_time().context(PROCESS_CPU)?);
        let result = match trace {
            Some(p) => replay_file(p, cfg).with_context(|| format!("replaying {}", p.display())),
            None => replay_default(cfg).context("replaying the built-in session"),
        };
        let wall = t.elapsed();
        let cpu = cpu_time().context(PROCESS_CPU)?.saturating_sub(cpu0);
        let untrimmed = memory().context(PROCESS_MEMORY)?;
        let mem = if trim {
            trim_heap();
            memory().context(PROCESS_MEMORY)?
        } else {
            untrimmed
        };
        let mut l = SoakLoop { index, wall, cpu, memory: mem, rss_untrimmed: untrimmed.rss, ..Default::default() };
        match result {
            Ok(r) => {
                (l.live_imports, l.live_bytes) = (r.live_imports_after_teardown, r.live_import_bytes_after_teardown);
                (l.writes, l.lost_writes) = (r.writes, r.lost_writes);
                l.name_backends(&r.import_backend, &r.watch_backend, loops.last());
                first.get_or_insert(r);
            }
            // The first loop failing is bad input (a trace that cannot be replayed): an error.
            Err(e) if index == 1 => return Err(e),
            Err(e) => l.error = Some(format!("{e:#}")),
        }
        tracing::debug!("soak loop {index}: {:.1} s, RSS {:.1} MiB", wall.as_secs_f64(), mib(mem.rss));
        loops.push(l);
    }
    drop(bar);
    let elapsed = start.elapsed();
    let v = judge(&loops, DEFAULT_GROWTH_LIMIT);
    let r = first.expect("the first loop succeeded");
    if as_json {
        let report = report_json(&loops, &v, &r, duration, elapsed, trim);
        outln!("{}", serde_json::to_string(&report).context("writing the report as JSON")?);
    } else {
        print_report(&loops, &v, &r, trace, elapsed, trim);
    }
    Ok(if v.passed() { Outcome::Ok } else { Outcome::CheckFailed })
}

/// The version of `replay --soak --json`'s keys (raised when one changes name or meaning or goes
/// away).
pub const SCHEMA: u32 = 1;

/// `replay --soak --json`: every loop, the verdict's figures and the check.
#[derive(Debug, serde::Serialize)]
struct Report<'a> {
    schema: u32,
    soak_s: f64,
    elapsed_s: f64,
    trim: bool,
    rust_allocator: &'static str,
    loops: Vec<LoopRow<'a>>,
    import_backend: &'a str,
    watch_backend: &'a str,
    rss_first_mib: f64,
    rss_max_after_mib: f64,
    rss_max_loop: u64,
    rss_growth_mib: f64,
    rss_growth_pct: f64,
    rss_growth_allowed_mib: f64,
    heap_in_use_first_mib: f64,
    heap_in_use_max_after_mib: f64,
    heap_in_use_growth_mib: f64,
    live_imports_end: u64,
    live_import_bytes_end: u64,
    errors: u64,
    lost_writes: u64,
    passed: bool,
    failures: &'a [String],
}

/// One loop of the soak's JSON.
#[derive(Debug, serde::Serialize)]
struct LoopRow<'a> {
    #[serde(rename = "loop")]
    index: u64,
    wall_s: f64,
    cpu_s: f64,
    rss_mib: f64,
    rss_untrimmed_mib: f64,
    heap_in_use_mib: f64,
    heap_free_mib: f64,
    locked_mib: f64,
    live_imports: u64,
    live_import_bytes: u64,
    writes: u64,
    lost_writes: u64,
    import_backend: &'a str,
    watch_backend: &'a str,
    error: Option<&'a str>,
}

fn report_json<'a>(
    loops: &'a [SoakLoop],
    v: &'a SoakVerdict,
    r: &'a ReplayReport,
    asked: Duration,
    elapsed: Duration,
    trim: bool,
) -> Report<'a> {
    let rows = loops
        .iter()
        .map(|l| LoopRow {
            index: l.index,
            wall_s: l.wall.as_secs_f64(),
            cpu_s: l.cpu.as_secs_f64(),
            rss_mib: mib(l.memory.rss),
            rss_untrimmed_mib: mib(l.rss_untrimmed),
            heap_in_use_mib: mib(l.memory.heap_in_use),
            heap_free_mib: mib(l.memory.heap_free),
            locked_mib: mib(l.memory.locked),
            live_imports: l.live_imports,
            live_import_bytes: l.live_bytes,
            writes: l.writes,
            lost_writes: l.lost_writes,
            import_backend: &l.import_backend,
            watch_backend: &l.watch_backend,
            error: l.error.as_deref(),
        })
        .collect();
    Report {
        schema: SCHEMA,
        soak_s: asked.as_secs_f64(),
        elapsed_s: elapsed.as_secs_f64(),
        trim,
        rust_allocator: if cfg!(feature = "mimalloc") { "mimalloc" } else { "system" },
        loops: rows,
        import_backend: &r.import_backend,
        watch_backend: &r.watch_backend,
        rss_first_mib: mib(v.rss_first),
        rss_max_after_mib: mib(v.rss_max_after),
        rss_max_loop: v.rss_max_loop,
        rss_growth_mib: mib(v.growth),
        rss_growth_pct: v.growth_percent,
        rss_growth_allowed_mib: mib(v.allowed_growth),
        heap_in_use_first_mib: mib(v.heap_first),
        heap_in_use_max_after_mib: mib(v.heap_max_after),
        heap_in_use_growth_mib: mib(v.heap_growth),
        live_imports_end: v.live_imports_end,
        live_import_bytes_end: v.live_bytes_end,
        errors: v.errors,
        lost_writes: v.lost_writes,
        passed: v.passed(),
        failures: &v.failures,
    }
}

/// The loops the table shows: all of them, or every Nth past [`MAX_ROWS`], with the first, the
/// last and each one that failed a check.
fn shown(loops: &[SoakLoop]) -> (Vec<&SoakLoop>, usize) {
    let every = loops.len().div_ceil(MAX_ROWS).max(1);
    let rows = loops
        .iter()
        .enumerate()
        .filter(|(i, l)| {
            i % every == 0 || *i + 1 == loops.len() || l.error.is_some() || l.live_imports > 0 || l.lost_writes > 0
        })
        .map(|(_, l)| l)
        .collect();
    (rows, every)
}

// Just over 80 lines: one line per figure of the soak's report, in the order printed.
fn print_report(
    loops: &[SoakLoop],
    v: &SoakVerdict,
    r: &ReplayReport,
    trace: Option<&Path>,
    elapsed: Duration,
    trim: bool,
) {
    let what = trace.map_or("the built-in session".to_string(), |p| p.display().to_string());
    outln!(
        "soak: {} loops of {what} in {} (write tracking {}, imports {})",
        loops.len(),
        human(elapsed),
        r.watch_backend,
        r.import_backend
    );
    let (rows, every) = shown(loops);
    if every > 1 {
        outln!("one loop in {every} shown, with the last and each that failed a check");
    }
    if trim {
        outln!(
            "after each loop's teardown the allocator's free memory is given back ({TRIM}): RSS after it, untrimmed before it"
        );
        if cfg!(windows) {
            outln!("RSS is the working set (GetProcessMemoryInfo); the allocator's figures are glibc's, none here");
        }
    } else {
        outln!("--no-trim: the allocator keeps the memory it holds free");
    }
    outln!(
        "{:>6} {:>9} {:>8} {:>9} {:>10} {:>9} {:>9} {:>11} {:>13} {:>9} {:>9} {:>6}  error",
        "loop",
        "wall s",
        "CPU s",
        "RSS MiB",
        "untrimmed",
        "heap MiB",
        "free MiB",
        "locked MiB",
        "live imports",
        "live MiB",
        "writes",
        "lost"
    );
    for l in rows {
        outln!(
            "{:>6} {:>9.2} {:>8.2} {:>9.1} {:>10.1} {:>9.1} {:>9.1} {:>11.1} {:>13} {:>9.1} {:>9} {:>6}  {}",
            l.index,
            l.wall.as_secs_f64(),
            l.cpu.as_secs_f64(),
            mib(l.memory.rss),
            mib(l.rss_untrimmed),
            mib(l.memory.heap_in_use),
            mib(l.memory.heap_free),
            mib(l.memory.locked),
            l.live_imports,
            mib(l.live_bytes),
            l.writes,
            l.lost_writes,
            l.error.as_deref().unwrap_or("-")
        );
    }
    outln!("summary");
    outln!("  RSS after loop 1        {:.1} MiB", mib(v.rss_first));
    outln!("  max RSS after it        {:.1} MiB (after loop {})", mib(v.rss_max_after), v.rss_max_loop);
    outln!(
        "  growth                  {:.1} MiB ({:.1} %); allowed {:.1} MiB (32 MiB or 10 % of loop 1, the larger)",
        mib(v.growth),
        v.growth_percent,
        mib(v.allowed_growth)
    );
    outln!(
        "  allocator in use        {:.1} MiB after loop 1, at most {:.1} MiB after it (growth {:.1} MiB)",
        mib(v.heap_first),
        mib(v.heap_max_after),
        mib(v.heap_growth)
    );
    outln!("  live imported at the end {} bytes in {} imports", v.live_bytes_end, v.live_imports_end);
    outln!("  errors {}, lost writes {}", v.errors, v.lost_writes);
    if v.passed() {
        outln!("check: passed");
    } else {
        outln!("check: FAILED");
        for f in &v.failures {
            outln!("  {f}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_and_bad_ones_name_the_value() {
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration(" 45 ").unwrap(), Duration::from_secs(45));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(parse_duration("1h 30m").unwrap(), Duration::from_secs(5400), "humantime's");
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1.5m").unwrap(), Duration::from_secs(90));
        for bad in ["", "m", "10x", "-3s", "0", "0m", "99999999999999999999h", "99999999999999999999"] {
            let e = parse_duration(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")), "{bad:?}: {e}");
        }
    }

    #[test]
    fn many_loops_show_every_nth_and_each_failure() {
        let mut loops: Vec<SoakLoop> = (1..=100).map(|i| SoakLoop { index: i, ..Default::default() }).collect();
        loops[56].live_imports = 1;
        let (rows, every) = shown(&loops);
        assert_eq!(every, 3);
        let idx: Vec<u64> = rows.iter().map(|l| l.index).collect();
        assert_eq!(&idx[..3], &[1, 4, 7]);
        assert!(idx.contains(&57) && idx.last() == Some(&100));
        assert_eq!(shown(&loops[..10]).0.len(), 10);
    }

    #[test]
    fn durations_print_as_humantime_does() {
        assert_eq!(human(Duration::from_millis(600_040)).to_string(), "10m 100ms");
        assert_eq!(human(Duration::from_secs(90)).to_string(), "1m 30s");
    }
}
