//! `emuhost replay`: replays a trace (the built-in session by default) through the runtime and
//! reports like the reference PRs: hitches, worst frame, lows, imports and time in them.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, bail};
use emuhost::settings::{self, Settings};
pub(crate) use emuhost_lab::bench::{ms, quantile};
use emuhost_lab::replay::{
    MAX_REWIND, MAX_SNAPSHOT_EVERY, ReplayConfig, ReplayReport, SnapshotFigures, replay_default, replay_file,
};

use crate::Outcome;

/// `--watch`'s help: the write-tracking backends of this platform.
#[cfg(target_os = "linux")]
const WATCH_HELP: &str = "Write-tracking backend (EMUHOST_WATCH): uffd, mprotect";
#[cfg(windows)]
const WATCH_HELP: &str = "Write-tracking backend (EMUHOST_WATCH): writewatch, guard";

#[derive(clap::Args, Clone)]
pub struct Args {
    /// The trace to replay (plain or .zst); the built-in default session when left out.
    pub trace: Option<PathBuf>,
    /// Keep the trace's frame rate, with emuhost's host sleep as the frame limiter.
    #[arg(long)]
    pub paced: bool,
    /// One JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// One row per frame, in the column names frame-time tools use.
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
    /// Frame time with imports marked (SVG or PNG, by the extension).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Import backend (EMUHOST_IMPORT_BACKEND): auto, vulkan, cuda, pin.
    #[arg(long)]
    pub import_backend: Option<String>,
    // The help names this platform's backends (Windows: writewatch, guard).
    #[arg(long, help = WATCH_HELP)]
    pub watch: Option<String>,
    /// Span cap in MiB (EMUHOST_IMPORT_SPAN_MB); 0 turns spans off.
    #[arg(long, alias = "span-mb")]
    pub span_mib: Option<String>,
    /// Short-sleep switch (EMUHOST_SHORT_SLEEP_TIMER), an empty value included.
    #[arg(long)]
    pub short_sleep_timer: Option<String>,
    /// Any switch, as KEY=VALUE (repeatable): every EMUHOST_* switch of the README's table.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Loop the replay in this process for DURATION (10m, 90s, 1h; seconds alone) and check that
    /// resident memory stays flat after the first loop and no import is left live (exit 1 if not).
    #[arg(long, value_name = "DURATION")]
    pub soak: Option<String>,
    /// With --soak: leave what the C allocator holds free after each loop with it, rather than
    /// giving it back to the kernel (malloc_trim; on Windows HeapCompact), to see how much it keeps.
    #[arg(long, requires = "soak")]
    pub no_trim: bool,
    /// Take a snapshot of the guest window at the end of every N frames, on the render thread
    /// (timed there, against the frame's time in the runtime).
    #[arg(long, value_name = "N", conflicts_with = "soak",
          value_parser = clap::value_parser!(u64).range(1..=MAX_SNAPSHOT_EVERY))]
    pub snapshot_every: Option<u64>,
    /// Every 4·K frames restore the snapshot of K frames back, make those frames again and check
    /// that the guest's memory matches the first time's (exit 1 if not). K: a multiple of
    /// --snapshot-every, which it needs.
    #[arg(long, value_name = "K", requires = "snapshot_every",
          value_parser = clap::value_parser!(u64).range(1..=MAX_REWIND))]
    pub rewind: Option<u64>,
    /// With --rewind K: rewind every M frames instead of every 4·K (M a multiple of K, at least
    /// 2·K; each rewind reads the whole guest memory four times for its checks, so a large M
    /// times short rewinds over a whole session).
    #[arg(long, value_name = "M", requires = "rewind", value_parser = clap::value_parser!(u64).range(1..))]
    pub rewind_every: Option<u64>,
}

impl Args {
    /// Sets the switches the flags name in `s`, each checked (an error names the flag, the switch
    /// and the value).
    pub fn apply(&self, s: &mut Settings) -> anyhow::Result<()> {
        for (value, flag, name) in [
            (&self.import_backend, "--import-backend", "EMUHOST_IMPORT_BACKEND"),
            (&self.watch, "--watch", "EMUHOST_WATCH"),
            (&self.span_mib, "--span-mib", "EMUHOST_IMPORT_SPAN_MB"),
            (&self.short_sleep_timer, "--short-sleep-timer", "EMUHOST_SHORT_SLEEP_TIMER"),
        ] {
            if let Some(v) = value {
                crate::switches::set(s, name, v).context(flag)?;
            }
        }
        for kv in &self.set {
            let (k, v) = crate::switches::parse(kv).context("--set")?;
            crate::switches::set(s, &k, &v).context("--set")?;
        }
        Ok(())
    }
}

/// Replays with `settings` (the environment's switches and this command's flags), in this
/// process.
pub fn run(a: Args, settings: Settings) -> anyhow::Result<Outcome> {
    let soak = a.soak.as_deref().map(crate::soak::parse_duration).transpose()?;
    if soak.is_some() && (a.csv.is_some() || a.plot.is_some()) {
        bail!("--soak reports loops, not frames: leave out --csv and --plot");
    }
    // Outputs are checked before the replay, not after it.
    if let Some(p) = &a.csv {
        crate::switches::check_output("--csv", p)?;
    }
    if let Some(p) = &a.plot {
        plot_kind(p)?;
        crate::switches::check_output("--plot", p)?;
    }
    let mut cfg = ReplayConfig::default();
    (cfg.paced, cfg.settings) = (a.paced, settings);
    (cfg.snapshot_every, cfg.rewind, cfg.rewind_every) = (a.snapshot_every, a.rewind, a.rewind_every);
    // A rewind that is not a multiple of the snapshots' interval, before the replay.
    cfg.check().map_err(|e| match a.rewind_every {
        Some(m) => anyhow::anyhow!("--rewind {} --rewind-every {m}: {e}", a.rewind.unwrap_or(0)),
        None => anyhow::anyhow!("--rewind {}: {e}", a.rewind.unwrap_or(0)),
    })?;
    if let Some(d) = soak {
        return crate::soak::run(d, a.trace.as_deref(), &cfg, !a.no_trim, a.json);
    }
    let frames = Arc::new(AtomicU64::new(0));
    cfg.frames_begun = Some(frames.clone());
    let bar = progress(frames, a.trace.is_none());
    let result = match &a.trace {
        Some(p) => replay_file(p, &cfg).with_context(|| format!("replaying {}", p.display())),
        None => replay_default(&cfg).context("replaying the built-in session"),
    };
    drop(bar);
    let report = result?;
    let s = summary(&report);
    tracing::info!(
        "replay: {} frames in {:.1} s, {} imports ({:.0} ms), {} lost writes",
        report.frames.len(),
        report.wall.as_secs_f64(),
        report.imports,
        ms(report.import_time),
        report.lost_writes
    );
    if let Some(p) = &a.csv {
        std::fs::write(p, csv(&report)).with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.plot {
        crate::plot::frames(p, &report).with_context(|| format!("plotting to {}", p.display()))?;
    }
    if a.json {
        outln!("{}", serde_json::to_string(&s).context("writing the report as JSON")?);
    } else {
        print_table(&report, &s);
    }
    let failed = check_failures(&report);
    for f in &failed {
        eprintln!("emuhost: check failed: {f}");
    }
    Ok(if failed.is_empty() { Outcome::Ok } else { Outcome::CheckFailed })
}

/// The checks the replay failed, each a sentence naming what (exit 1): lost writes, and a rewind
/// that found the guest's memory other than the first time (naming the frame).
fn check_failures(r: &ReplayReport) -> Vec<String> {
    let mut out = Vec::new();
    if r.lost_writes > 0 {
        out.push(format!("{} guest writes were lost (no collect after them reported them)", r.lost_writes));
    }
    if let Some(sn) = &r.snapshots
        && sn.mismatched_snapshots > 0
    {
        let (frame, when) = sn.first_mismatch.unwrap_or((0, ""));
        out.push(format!(
            "the rewind check found the guest's memory at the end of frame {frame} other than the first time {when} \
             ({} of {} states compared differed, {} bytes in whole pages)",
            sn.mismatched_snapshots, sn.checks, sn.mismatched_bytes
        ));
    }
    out
}

fn plot_kind(p: &std::path::Path) -> anyhow::Result<()> {
    match p.extension().and_then(|e| e.to_str()).map(|e| e.to_ascii_lowercase()).as_deref() {
        Some("svg") | Some("png") => Ok(()),
        _ => bail!("--plot {}: the file must end in .svg or .png", p.display()),
    }
}

/// A bar of the frames on stderr while the replay runs (their count known for the built-in
/// session), only where stderr is a terminal.
fn progress(frames: Arc<AtomicU64>, built_in: bool) -> Option<crate::progress::Ticking> {
    let len = built_in.then(default_frames);
    let what = if built_in { "replaying the built-in session" } else { "replaying the trace" };
    crate::progress::ticking(what.into(), "frames", len, move || frames.load(Ordering::Relaxed))
}

/// The built-in session's frames.
pub fn default_frames() -> u64 {
    let s = emuhost_lab::synth::SynthConfig::default();
    u64::from(s.seconds) * u64::from(s.fps)
}

/// The 1 % / 0.1 % low: the frame rate of the slowest 1 % / 0.1 % of frames, averaged.
fn low(frame_ms: &[f64], frac: f64) -> f64 {
    let avg = emuhost_lab::quantile::top_mean(frame_ms, frac);
    if avg > 0.0 { 1000.0 / avg } else { 0.0 }
}

/// The version of `replay --json`'s keys: raised when a key changes name, unit or meaning or goes
/// away (a new key alone does not raise it).
pub const SCHEMA: u32 = 1;

/// `replay --json`: the report's figures, under the keys other tools read (`ab`, `.ci/windows`).
/// Every key is in docs/replay.md's table, with its unit and meaning (a test checks both ways).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Summary {
    pub schema: u32,
    pub frames: usize,
    pub events: u64,
    pub threads: usize,
    pub wall_s: f64,
    pub paced: bool,
    pub import_backend: String,
    pub watch_backend: String,
    pub sleep_rule: String,
    pub runtime_ms_p50: f64,
    pub runtime_ms_p99: f64,
    pub runtime_ms_p999: f64,
    pub runtime_ms_worst: f64,
    pub frames_over_16_7ms: usize,
    pub frames_over_50ms: usize,
    pub frames_over_100ms: usize,
    pub imports: u64,
    pub reimports: u64,
    pub import_ms: f64,
    pub worst_import_ms: f64,
    pub import_wait_ms_worst: f64,
    pub import_wait_ms_total: f64,
    pub ahead_imports: u64,
    pub import_failures: u64,
    pub bind_failures: u64,
    pub live_import_mib_end: f64,
    pub live_import_mib_peak: f64,
    pub collects: u64,
    pub collect_ms: f64,
    pub pages_reported: u64,
    pub writes: u64,
    pub lost_writes: u64,
    pub unchecked_writes: u64,
    pub checked_writes_pct: f64,
    pub guest_sleeps: u64,
    pub guest_sleep_cpu_ms: f64,
    pub guest_sleep_wall_ms: f64,
    pub host_sleeps: u64,
    pub host_sleep_cpu_ms: f64,
    pub host_sleep_wall_ms: f64,
    pub zeroed_under_import: u64,
    pub import_pieces: u64,
    pub import_widenings: u64,
    pub import_in_flight_waits: u64,
    pub ahead_mib_peak: f64,
    pub committed_mib_peak: f64,
    /// Empty under the chunks policy.
    pub import_cost: String,
    pub import_cost_us: String,
    pub long_read_waits: u64,
    pub live_imports_peak: u64,
    /// Pools whole in several imports merged into one, and the imports those merges replaced.
    pub import_merges: u64,
    pub import_merged_away: u64,
    /// Imports a binding made over the cap on live imports (nothing could make room).
    pub imports_over_cap: u64,
    pub render_space_lock_waits: u64,
    pub render_space_lock_wait_total_ms: f64,
    pub render_space_lock_wait_max_ms: f64,
    /// Paced replays alone: the four below are left out of an unpaced one's JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fps_avg: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub low_1pct_fps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub low_01pct_fps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worst_frame_ms: Option<f64>,
    /// `--snapshot-every` alone: its keys are left out of a replay without snapshots' JSON.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub snapshots: Option<SnapshotSummary>,
}

/// `replay --json`'s keys of `--snapshot-every` and `--rewind` (docs/replay.md's table).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SnapshotSummary {
    pub snapshot_every: u64,
    pub snapshots_taken: u64,
    pub snapshot_pages_copied: u64,
    pub snapshot_mib_kept_end: f64,
    pub snapshot_mib_kept_peak: f64,
    pub snapshot_take_ms_p50: f64,
    pub snapshot_take_ms_p99: f64,
    pub snapshot_take_ms_max: f64,
    /// Per frame with a take: the take over the frame's time in the runtime, in %.
    pub snapshot_take_pct_of_runtime_p50: f64,
    pub snapshot_take_pct_of_runtime_p99: f64,
    /// Frames with a take and no time in the runtime (left out of the two above).
    pub snapshot_frames_without_runtime: u64,
    pub snapshot_restores: u64,
    pub snapshot_restore_ms_p50: f64,
    pub snapshot_restore_ms_max: f64,
    pub rewind: u64,
    pub rewind_every: u64,
    pub rewinds: u64,
    pub rewind_checks: u64,
    pub rewind_mismatched_snapshots: u64,
    pub rewind_mismatched_bytes: u64,
    /// `null` where none differed.
    pub rewind_first_mismatch_frame: Option<u64>,
    pub rewind_import_releases: u64,
}

/// The snapshots' figures under their JSON keys.
pub fn snapshot_summary(f: &SnapshotFigures) -> SnapshotSummary {
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v
    };
    let take = sorted(f.takes.iter().map(|t| ms(t.1)).collect());
    let with_runtime: Vec<_> = f.takes.iter().filter(|t| !t.2.is_zero()).collect();
    let pct = sorted(with_runtime.iter().map(|t| 100.0 * t.1.as_secs_f64() / t.2.as_secs_f64()).collect());
    let restore = sorted(f.restores.iter().map(|d| ms(*d)).collect());
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    SnapshotSummary {
        snapshot_every: f.every,
        snapshots_taken: f.taken,
        snapshot_pages_copied: f.pages_copied,
        snapshot_mib_kept_end: mib(f.bytes_kept_end),
        snapshot_mib_kept_peak: mib(f.bytes_kept_peak),
        snapshot_take_ms_p50: quantile(&take, 0.5),
        snapshot_take_ms_p99: quantile(&take, 0.99),
        snapshot_take_ms_max: take.last().copied().unwrap_or(0.0),
        snapshot_take_pct_of_runtime_p50: quantile(&pct, 0.5),
        snapshot_take_pct_of_runtime_p99: quantile(&pct, 0.99),
        snapshot_frames_without_runtime: (f.takes.len() - with_runtime.len()) as u64,
        snapshot_restores: f.restores.len() as u64,
        snapshot_restore_ms_p50: quantile(&restore, 0.5),
        snapshot_restore_ms_max: restore.last().copied().unwrap_or(0.0),
        rewind: f.rewind,
        rewind_every: f.every_rewind,
        rewinds: f.rewinds,
        rewind_checks: f.checks,
        rewind_mismatched_snapshots: f.mismatched_snapshots,
        rewind_mismatched_bytes: f.mismatched_bytes,
        rewind_first_mismatch_frame: f.first_mismatch.map(|m| m.0),
        rewind_import_releases: f.import_releases,
    }
}

/// The report's figures, with the JSON keys other tools read.
// Over 80 lines: one line per key of the report, in the order of docs/replay.md's table.
pub fn summary(r: &ReplayReport) -> Summary {
    let mut rt: Vec<f64> = r.frames.iter().map(|f| ms(f.runtime)).collect();
    rt.sort_by(|a, b| a.total_cmp(b));
    let over = |t: f64| rt.iter().filter(|x| **x > t).count();
    let present: Vec<f64> = r.frames.iter().map(|f| ms(f.present_to_present)).collect();
    let total_s: f64 = present.iter().sum::<f64>() / 1e3;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let lw = r.render_space_lock_waits;
    let paced = |v: f64| r.paced.then_some(v);
    Summary {
        schema: SCHEMA,
        frames: r.frames.len(),
        events: r.events,
        threads: r.threads,
        wall_s: r.wall.as_secs_f64(),
        paced: r.paced,
        import_backend: r.import_backend.clone(),
        watch_backend: r.watch_backend.clone(),
        sleep_rule: r.sleep_rule.clone(),
        runtime_ms_p50: quantile(&rt, 0.5),
        runtime_ms_p99: quantile(&rt, 0.99),
        runtime_ms_p999: quantile(&rt, 0.999),
        runtime_ms_worst: rt.last().copied().unwrap_or(0.0),
        frames_over_16_7ms: over(16.7),
        frames_over_50ms: over(50.0),
        frames_over_100ms: over(100.0),
        imports: r.imports,
        reimports: r.reimports,
        import_ms: ms(r.import_time),
        worst_import_ms: ms(r.worst_import),
        import_wait_ms_worst: ms(r.import_wait_worst),
        import_wait_ms_total: ms(r.import_wait_total),
        ahead_imports: r.ahead_imports,
        import_failures: r.import_failures,
        bind_failures: r.bind_failures,
        live_import_mib_end: mib(r.live_import_bytes_end),
        live_import_mib_peak: mib(r.live_import_bytes_peak),
        collects: r.collects,
        collect_ms: ms(r.collect_time),
        pages_reported: r.pages_reported,
        writes: r.writes,
        lost_writes: r.lost_writes,
        unchecked_writes: r.unchecked_writes,
        checked_writes_pct: r.checked_share() * 100.0,
        guest_sleeps: r.guest_sleeps.count,
        guest_sleep_cpu_ms: ms(r.guest_sleeps.cpu),
        guest_sleep_wall_ms: ms(r.guest_sleeps.wall),
        host_sleeps: r.host_sleeps.count,
        host_sleep_cpu_ms: ms(r.host_sleeps.cpu),
        host_sleep_wall_ms: ms(r.host_sleeps.wall),
        zeroed_under_import: r.zeroed_under_import,
        import_pieces: r.import_pieces,
        import_widenings: r.import_widenings,
        import_in_flight_waits: r.import_in_flight_waits,
        ahead_mib_peak: mib(r.ahead_bytes_peak),
        committed_mib_peak: mib(r.committed_bytes_peak),
        import_cost: r.import_cost.map(|c| c.to_string()).unwrap_or_default(),
        import_cost_us: r.import_cost.map(|c| settings::import_cost_value(&c)).unwrap_or_default(),
        long_read_waits: r.long_read_waits,
        live_imports_peak: r.live_imports_peak,
        import_merges: r.import_merges,
        import_merged_away: r.import_merged_away,
        imports_over_cap: r.imports_over_cap,
        render_space_lock_waits: lw.count,
        render_space_lock_wait_total_ms: ms(lw.total),
        render_space_lock_wait_max_ms: ms(lw.longest),
        fps_avg: paced(if total_s > 0.0 { present.len() as f64 / total_s } else { 0.0 }),
        low_1pct_fps: paced(low(&present, 0.01)),
        low_01pct_fps: paced(low(&present, 0.001)),
        worst_frame_ms: paced(present.iter().copied().fold(0.0, f64::max)),
        snapshots: r.snapshots.as_ref().map(snapshot_summary),
    }
}

fn csv(r: &ReplayReport) -> String {
    let mut s =
        String::from("Frame,TimeInSeconds,MsBetweenPresents,MsInRuntime,MsInImports,MsInCollects,ImportsMade\n");
    let mut t = 0.0;
    for f in &r.frames {
        s.push_str(&format!(
            "{},{:.6},{:.4},{:.4},{:.4},{:.4},{}\n",
            f.index,
            t,
            ms(f.present_to_present),
            ms(f.runtime),
            ms(f.imports),
            ms(f.collects),
            f.imports_made
        ));
        t += f.present_to_present.as_secs_f64();
    }
    s
}

/// The text report: the run, the render thread's frames, imports, write tracking, sleeps.
fn print_table(r: &ReplayReport, s: &Summary) {
    print_frames(r, s);
    print_imports(r, s);
    print_tracking(r, s);
}

fn print_frames(r: &ReplayReport, s: &Summary) {
    outln!(
        "replay: {} frames, {} events, {} threads in {:.1} s ({})",
        r.frames.len(),
        r.events,
        r.threads,
        r.wall.as_secs_f64(),
        if r.paced { "paced" } else { "unpaced" }
    );
    outln!("  import backend   {}", r.import_backend);
    outln!("  write tracking   {}", r.watch_backend);
    outln!("  short sleeps     {}", r.sleep_rule);
    outln!("render thread in the runtime, per frame");
    outln!(
        "  p50 {:.3} ms   p99 {:.3} ms   p99.9 {:.3} ms   worst {:.3} ms",
        s.runtime_ms_p50,
        s.runtime_ms_p99,
        s.runtime_ms_p999,
        s.runtime_ms_worst
    );
    outln!(
        "  frames over 16.7 ms: {}   over 50 ms: {}   over 100 ms: {}",
        s.frames_over_16_7ms,
        s.frames_over_50ms,
        s.frames_over_100ms
    );
    if r.paced {
        outln!(
            "  fps {:.1}   1% low {:.1}   0.1% low {:.1}   worst frame {:.1} ms",
            s.fps_avg.unwrap_or(0.0),
            s.low_1pct_fps.unwrap_or(0.0),
            s.low_01pct_fps.unwrap_or(0.0),
            s.worst_frame_ms.unwrap_or(0.0)
        );
    }
}

fn print_imports(r: &ReplayReport, s: &Summary) {
    outln!("imports");
    outln!(
        "  {} imports ({} re-imports), {:.1} ms in all, worst {:.2} ms, {} failed; {} bindings went without",
        r.imports,
        r.reimports,
        s.import_ms,
        s.worst_import_ms,
        r.import_failures,
        r.bind_failures
    );
    outln!(
        "  the binding thread waited {:.1} ms for imports, worst {:.2} ms; {} imports made ahead",
        s.import_wait_ms_total,
        s.import_wait_ms_worst,
        r.ahead_imports
    );
    outln!(
        "  {} bindings imported part of a pool, {} pools imported whole behind them; {} waited for an import in flight",
        r.import_pieces,
        r.import_widenings,
        r.import_in_flight_waits
    );
    outln!(
        "  live imported {:.0} MiB at the end, {:.0} MiB at peak; {:.0} MiB ahead of use at peak; {:.0} MiB committed at peak",
        s.live_import_mib_end,
        s.live_import_mib_peak,
        s.ahead_mib_peak,
        s.committed_mib_peak
    );
    outln!(
        "  live imports at most {} at once; {} merges of a pool whole (replacing {}); {} imports over the cap",
        r.live_imports_peak,
        r.import_merges,
        r.import_merged_away,
        r.imports_over_cap
    );
    if let Some(c) = r.import_cost {
        let how = if r.import_cost_given { "given" } else { "measured" };
        outln!("  import cost {how}: {c} (EMUHOST_IMPORT_COST_US={})", settings::import_cost_value(&c));
    }
}

fn print_tracking(r: &ReplayReport, s: &Summary) {
    outln!("write tracking");
    outln!(
        "  {} collects, {:.1} ms in all, {} pages reported; {} guest writes, {} lost, {} unchecked ({:.1} % checked)",
        r.collects,
        s.collect_ms,
        r.pages_reported,
        r.writes,
        r.lost_writes,
        r.unchecked_writes,
        s.checked_writes_pct
    );
    outln!(
        "  the render thread waited {} times for the space's lock, {:.3} ms in all, longest {:.3} ms",
        r.render_space_lock_waits.count,
        s.render_space_lock_wait_total_ms,
        s.render_space_lock_wait_max_ms
    );
    outln!("short sleeps");
    for (name, sl) in [("guest", r.guest_sleeps), ("host", r.host_sleeps)] {
        outln!(
            "  {name:<5} {:>8} sleeps, {:.0} ms asked, {:.0} ms waited, {:.0} ms of CPU",
            sl.count,
            ms(sl.asked),
            ms(sl.wall),
            ms(sl.cpu)
        );
    }
    if let Some(sn) = &s.snapshots {
        print_snapshots(sn);
    }
}

fn print_snapshots(s: &SnapshotSummary) {
    outln!("snapshots (one at the end of every {} frames, on the render thread)", s.snapshot_every);
    outln!(
        "  {} taken, {} pages copied, {:.1} MiB kept at the end ({:.1} MiB at most)",
        s.snapshots_taken,
        s.snapshot_pages_copied,
        s.snapshot_mib_kept_end,
        s.snapshot_mib_kept_peak
    );
    outln!(
        "  take p50 {:.3} ms   p99 {:.3} ms   max {:.3} ms; of the frame's time in the runtime: p50 {:.1} %   p99 {:.1} %",
        s.snapshot_take_ms_p50,
        s.snapshot_take_ms_p99,
        s.snapshot_take_ms_max,
        s.snapshot_take_pct_of_runtime_p50,
        s.snapshot_take_pct_of_runtime_p99
    );
    if s.rewind > 0 {
        outln!(
            "  rewind {} frames every {} frames: {} rewinds, restore p50 {:.3} ms   max {:.3} ms; imports released {} times",
            s.rewind,
            s.rewind_every,
            s.rewinds,
            s.snapshot_restore_ms_p50,
            s.snapshot_restore_ms_max,
            s.rewind_import_releases
        );
        outln!(
            "  {} states compared, {} differed ({} bytes)",
            s.rewind_checks,
            s.rewind_mismatched_snapshots,
            s.rewind_mismatched_bytes
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys of docs/replay.md's table of `replay --json` (its first column, in backticks).
    fn documented_keys(doc: &str) -> Vec<String> {
        let section = doc.split("## `replay --json` keys").nth(1).expect("docs/replay.md has the keys' section");
        section
            .lines()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .filter_map(|l| l.split('`').nth(1).filter(|_| l.starts_with("| `")))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn every_json_key_is_in_the_docs_table() {
        // The docs are beside the workspace, not in the CLI's package: a packaged build skips.
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/replay.md");
        let Ok(doc) = std::fs::read_to_string(path) else {
            eprintln!("{path} not found (a packaged build): skipped");
            return;
        };
        // Paced, with snapshots: the keys of such a replay are a superset of any other's.
        let report = ReplayReport { paced: true, snapshots: Some(SnapshotFigures::default()), ..Default::default() };
        let v = serde_json::to_value(summary(&report)).unwrap();
        let keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        let documented = documented_keys(&doc);
        let missing: Vec<_> = keys.iter().filter(|k| !documented.contains(k)).collect();
        let stale: Vec<_> = documented.iter().filter(|k| !keys.contains(k)).collect();
        assert!(missing.is_empty(), "keys of `replay --json` missing from docs/replay.md's table: {missing:?}");
        assert!(stale.is_empty(), "docs/replay.md's table has keys `replay --json` does not write: {stale:?}");
        let mut dup = documented.clone();
        dup.sort();
        dup.dedup();
        assert_eq!(dup.len(), documented.len(), "a key twice in the table");
    }

    #[test]
    fn a_rewind_that_found_other_memory_fails_the_check_naming_the_frame() {
        let mut sn = SnapshotFigures::default();
        assert!(check_failures(&ReplayReport { snapshots: Some(sn.clone()), ..Default::default() }).is_empty());
        (sn.checks, sn.mismatched_snapshots, sn.mismatched_bytes) = (6, 1, 4096);
        sn.first_mismatch = Some((41, "after the restore"));
        let failed = check_failures(&ReplayReport { snapshots: Some(sn), lost_writes: 2, ..Default::default() });
        assert_eq!(failed.len(), 2, "{failed:?}");
        assert!(failed[0].starts_with("2 guest writes were lost"), "{failed:?}");
        assert!(
            failed[1].starts_with("the rewind check found the guest's memory at the end of frame 41 other than the first time after the restore (1 of 6 states compared differed, 4096 bytes"),
            "{failed:?}"
        );
    }

    #[test]
    fn the_schema_comes_first_and_paced_keys_only_when_paced() {
        let unpaced = serde_json::to_string(&summary(&ReplayReport::default())).unwrap();
        assert!(unpaced.starts_with(&format!("{{\"schema\":{SCHEMA},")), "{unpaced}");
        assert!(!unpaced.contains("fps_avg") && !unpaced.contains("low_1pct_fps"), "{unpaced}");
        let paced = serde_json::to_value(summary(&ReplayReport { paced: true, ..Default::default() })).unwrap();
        assert_eq!(paced["fps_avg"], 0.0);
        assert_eq!(paced["worst_frame_ms"], 0.0);
    }
}
