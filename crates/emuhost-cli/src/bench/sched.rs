//! `emuhost bench sleep`: the flags, then the lab's bench ([`emuhost_lab::bench::sched`]),
//! printed.

use emuhost::sched::{HYBRID_MARGIN, Wait};
use emuhost_lab::bench::sched::{Method, SleepBench, SleepReport};
use serde_json::json;

use super::Report;
use crate::Outcome;

#[derive(clap::Args)]
pub struct Args {
    /// Rounds of each arm (alternated).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Sleeps of 20 µs per arm and round.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u32).range(100..))]
    short_sleeps: u32,
    /// Sleeps of 1 ms per arm and round.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(100..))]
    long_sleeps: u32,
    /// The fixed-margin hybrid's margin in µs (the library's starting margin is the default; the
    /// learned arm starts there and learns).
    #[arg(long, default_value_t = HYBRID_MARGIN.as_micros() as u64)]
    margin_us: u64,
    /// Processors for the frame experiment (the first ones of this process's affinity mask).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=1024))]
    frame_cpus: u64,
    /// Threads sleeping 20 µs in a loop beside the frame thread.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=256))]
    sleepers: u64,
    /// The frame thread's fixed work, as milliseconds of it alone on a CPU (calibrated once).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(10..=60000))]
    frame_ms: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// The figures the targets judge: the guest's 20 µs timer CPU; p99 and CPU of the 1 ms host wait
/// (the learned hybrid), of the yield loop and of spin_sleep.
struct Headline {
    timer20_cpu: f64,
    h_p99: f64,
    h_cpu: f64,
    y_p99: f64,
    y_cpu: f64,
    s_p99: f64,
    s_cpu: f64,
}

/// The text table of the sleeps and the targets.
fn print_sleeps(a: &Args, r: &SleepReport, rows: &[serde_json::Value], h: Headline) {
    let Headline { timer20_cpu, h_p99, h_cpu, y_p99, y_cpu, s_p99, s_cpu } = h;
    let met = |b: bool| if b { "met" } else { "NOT met" };
    if let Some(note) = wine_note(r) {
        outln!("{note}");
    }
    outln!(
        "short sleeps ({} rounds, medians; hybrid margin {} µs fixed; learned at the end: {:.1} µs, then {:.1} µs spun)",
        a.rounds,
        a.margin_us,
        r.learned_margin.as_secs_f64() * 1e6,
        r.learned_spin.as_secs_f64() * 1e6
    );
    outln!("  {:>8}  {:<20} {:>12} {:>12} {:>12}", "sleep", "method", "late p50 µs", "late p99 µs", "CPU per s");
    for r in rows {
        outln!(
            "  {:>6}µs  {:<20} {:>12.1} {:>12.1} {:>12.3}",
            r["sleep_us"],
            r["method"].as_str().unwrap_or(""),
            r["late_p50_us"].as_f64().unwrap_or(f64::NAN),
            r["late_p99_us"].as_f64().unwrap_or(f64::NAN),
            r["cpu_per_s"].as_f64().unwrap_or(f64::NAN)
        );
    }
    outln!(
        "  1 ms hybrid (learned) against the yield loop: p99 late {h_p99:.1} vs {y_p99:.1} µs at {:.0} % of its CPU ({h_cpu:.3} vs {y_cpu:.3})",
        100.0 * h_cpu / y_cpu
    );
    outln!(
        "  1 ms hybrid (learned) against spin_sleep: p99 late {h_p99:.1} vs {s_p99:.1} µs ({:.2}x), CPU {h_cpu:.3} vs {s_cpu:.3} ({:.2}x)",
        h_p99 / s_p99,
        h_cpu / s_cpu
    );
    outln!("  target: guest 20 µs on the timer <= 0.25 CPU: {timer20_cpu:.3} ({})", met(timer20_cpu <= 0.25));
    outln!(
        "  target: host exact 1 ms wait p99 <= 10 µs at <= 0.05 CPU: {h_p99:.1} µs, {h_cpu:.3} ({})",
        met(h_p99 <= 10.0 && h_cpu <= 0.05)
    );
    outln!("  target: host 1 ms wait beats spin_sleep's p99 at no more CPU: {}", met(h_p99 <= s_p99 && h_cpu <= s_cpu));
}

pub fn run(a: Args) -> anyhow::Result<Outcome> {
    if cfg!(debug_assertions) {
        eprintln!("emuhost: warning: a debug build; measure with `cargo build --release`");
    }
    let bench = SleepBench::new(a.rounds, a.short_sleeps, a.long_sleeps, a.margin_us).frame(
        a.frame_cpus,
        a.sleepers,
        a.frame_ms,
    );
    let r = emuhost_lab::bench::sched::sleep(&bench)?;
    let rows: Vec<serde_json::Value> = r
        .sleeps
        .iter()
        .map(|s| json!({ "sleep_us": s.sleep_us, "sleeps": s.sleeps, "method": s.method.name(), "late_p50_us": s.late_p50_us, "late_p99_us": s.late_p99_us, "cpu_per_s": s.cpu_per_s }))
        .collect();
    let (_, _, timer20_cpu) = r.at(false, Method::Wait(Wait::Timer));
    let (_, h_p99, h_cpu) = r.at(true, Method::Learned);
    let (_, y_p99, y_cpu) = r.at(true, Method::Wait(Wait::Yield));
    let (_, s_p99, s_cpu) = r.at(true, Method::SpinSleep);
    let h = Headline { timer20_cpu, h_p99, h_cpu, y_p99, y_cpu, s_p99, s_cpu };
    if a.json {
        print_sleep_json(&a, &r, rows, &h);
    } else {
        print_sleeps(&a, &r, &rows, h);
        print_frame(&a, &r);
    }
    Ok(Outcome::Ok)
}

/// Under Wine, what its figures are: Wine's (Linux's timers and scheduler under Wine's), never
/// Windows'.
fn wine_note(r: &SleepReport) -> Option<String> {
    r.wine.as_ref().map(|v| {
        format!(
            "under Wine {v}: these figures are Wine's (Linux's timers and scheduler under Wine), not Windows' timings"
        )
    })
}

/// `bench sleep --json`.
#[derive(serde::Serialize)]
struct SleepJson<'a> {
    schema: u32,
    bench: &'static str,
    /// Wine's version where the run was under Wine, and what the figures are then.
    wine: Option<&'a str>,
    figures: Option<String>,
    rounds: u32,
    hybrid_margin_us: u64,
    learned_margin_us: f64,
    learned_spin_us: f64,
    sleeps: Vec<serde_json::Value>,
    frame: [serde_json::Value; 2],
    targets: serde_json::Value,
}

fn print_sleep_json(a: &Args, r: &SleepReport, rows: Vec<serde_json::Value>, h: &Headline) {
    let targets = json!({
        "guest_20us_timer_cpu_le_0_25": h.timer20_cpu <= 0.25,
        "host_1ms_hybrid_p99_le_10us": h.h_p99 <= 10.0,
        "host_1ms_hybrid_cpu_le_0_05": h.h_cpu <= 0.05,
        "host_1ms_hybrid_beats_spin_sleep": h.h_p99 <= h.s_p99 && h.h_cpu <= h.s_cpu,
        "frame_within_3pct_of_no_sleepers": r.none_vs_rule.old.median_ms() / r.none_vs_rule.new.median_ms() >= 0.97,
    });
    let json = SleepJson {
        schema: super::SCHEMA,
        bench: "sleep",
        wine: r.wine.as_deref(),
        figures: wine_note(r),
        rounds: a.rounds,
        hybrid_margin_us: a.margin_us,
        learned_margin_us: r.learned_margin.as_secs_f64() * 1e6,
        learned_spin_us: r.learned_spin.as_secs_f64() * 1e6,
        sleeps: rows,
        frame: [r.none_vs_rule.json(), r.yield_vs_rule.json()],
        targets,
    };
    match serde_json::to_string(&json) {
        Ok(text) => outln!("{text}"),
        Err(e) => tracing::error!("bench sleep: writing the report as JSON: {e}"),
    }
}

/// The frame experiment's text.
fn print_frame(a: &Args, r: &SleepReport) {
    let (none_vs_rule, yield_vs_rule) = (&r.none_vs_rule, &r.yield_vs_rule);
    let met = |b: bool| if b { "met" } else { "NOT met" };
    // Comparison::print would show a calls ratio of 0/0: these arms make no counted calls.
    outln!("{} ({} rounds)", none_vs_rule.name, a.rounds);
    for (name, arm) in [
        ("no sleepers", &none_vs_rule.old),
        ("sleepers yielding", &yield_vs_rule.old),
        ("sleepers by the rule", &none_vs_rule.new),
    ] {
        outln!("  {name:<28} median {:>10.3} ms", arm.median_ms());
    }
    let within = none_vs_rule.old.median_ms() / none_vs_rule.new.median_ms();
    outln!("  no sleepers / the rule   {within:.3}x (target >= 0.97x: {})", met(within >= 0.97));
    outln!(
        "  yielding / the rule      {:.3}x (above 1: the rule leaves the frame thread more)",
        yield_vs_rule.old.median_ms() / yield_vs_rule.new.median_ms()
    );
}
