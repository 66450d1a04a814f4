//! `emuhost ab`: two settings replayed alternately (A B A B ...), each in a fresh process, and the
//! reference PRs' table: each figure per round for both arms, the medians and the ratio.

use std::path::PathBuf;
use std::process::Command;

use std::collections::BTreeMap;

use anyhow::{Context, bail};
use serde_json::Value;

use crate::Outcome;
use crate::bench::median;

#[derive(clap::Args)]
pub struct Args {
    /// Arm A's switches: 'KEY=VALUE KEY=VALUE ...' (EMUHOST_* switches of the README's table).
    #[arg(long, allow_hyphen_values = true)]
    a: String,
    /// Arm B's switches, as for --a.
    #[arg(long, allow_hyphen_values = true)]
    b: String,
    /// Rounds; each replays A, then B.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// Replay paced (the trace's frame rate), for fps and lows.
    #[arg(long)]
    paced: bool,
    /// One JSON object instead of the table: the arms under "a" and "b".
    #[arg(long)]
    json: bool,
    /// The trace (the built-in default session when left out).
    trace: Option<PathBuf>,
}

/// The version of `ab --json`'s keys (raised when one changes name or meaning or goes away).
pub const SCHEMA: u32 = 1;

/// `ab --json`: the rounds, both arms and the ratio of their medians, B over A.
#[derive(Debug, serde::Serialize)]
struct Report<'a> {
    schema: u32,
    rounds: u32,
    a: ArmReport<'a>,
    b: ArmReport<'a>,
    /// Per figure of [`ROWS`] whose medians both arms have, A's not 0.
    ratio_b_over_a: BTreeMap<&'static str, f64>,
}

/// One arm of `ab --json`.
#[derive(Debug, serde::Serialize)]
struct ArmReport<'a> {
    /// The arm's switches as given (`--a`, `--b`).
    switches: &'a str,
    /// Each round's `replay --json` object, as the replay wrote it.
    runs: &'a [Value],
    /// Per figure of [`ROWS`] the arm's runs have: their median.
    medians: BTreeMap<&'static str, f64>,
}

/// The figures compared, in the table's order: (key, label).
const ROWS: &[(&str, &str)] = &[
    ("frames_over_100ms", "frames over 100 ms (runtime)"),
    ("frames_over_50ms", "frames over 50 ms (runtime)"),
    ("runtime_ms_worst", "worst frame in the runtime, ms"),
    ("runtime_ms_p99", "p99 frame in the runtime, ms"),
    ("imports", "imports per session"),
    ("reimports", "re-imports"),
    ("import_ms", "time in imports, ms"),
    ("worst_import_ms", "worst import, ms"),
    ("import_wait_ms_worst", "worst wait for an import, ms"),
    ("import_wait_ms_total", "time waiting for imports, ms"),
    ("ahead_imports", "imports made ahead"),
    ("import_pieces", "bindings that imported part of a pool"),
    ("ahead_mib_peak", "MiB imported ahead of use, peak"),
    ("live_import_mib_peak", "live imported MiB, peak"),
    ("collect_ms", "time in collects, ms"),
    ("render_space_lock_wait_max_ms", "worst space-lock wait (render), ms"),
    ("render_space_lock_wait_total_ms", "space-lock waits (render), ms"),
    ("lost_writes", "lost writes"),
    ("guest_sleep_cpu_ms", "CPU in guest sleeps, ms"),
    ("fps_avg", "fps (paced)"),
    ("low_1pct_fps", "1% low fps (paced)"),
    ("low_01pct_fps", "0.1% low fps (paced)"),
    ("wall_s", "replay wall time, s"),
];

fn switches(s: &str) -> anyhow::Result<Vec<(String, String)>> {
    s.split_whitespace().map(crate::switches::parse).collect()
}

/// How a child process ended, in words: `exit status 2`, `killed by signal: 11 (SIGSEGV)` (std
/// names the signal, and says where it dumped core).
fn ended(status: std::process::ExitStatus) -> String {
    match status.code() {
        Some(code) => format!("exit status {code}"),
        None => format!("killed by {status}"),
    }
}

/// One replay of arm `name` (`A` or `B`, whose switches are `text`).
fn one(name: &str, text: &str, arm: &[(String, String)], a: &Args) -> anyhow::Result<Value> {
    let which = format!("arm {name} ({})", text.trim());
    let exe = std::env::current_exe().context("finding this program")?;
    let mut cmd = Command::new(exe);
    cmd.arg("replay").arg("--json");
    if a.paced {
        cmd.arg("--paced");
    }
    if let Some(t) = &a.trace {
        cmd.arg(t);
    }
    cmd.env("EMUHOST_LOG", std::env::var("EMUHOST_LOG").unwrap_or_else(|_| "warn".into()));
    cmd.envs(arm.iter().cloned());
    let out = cmd.output().with_context(|| format!("{which}: running a replay"))?;
    if !out.status.success() && out.status.code() != Some(1) {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let said = if stderr.trim().is_empty() { String::new() } else { format!(": {}", stderr.trim()) };
        bail!("{which}: the replay failed, {}{said}", ended(out.status));
    }
    serde_json::from_slice(&out.stdout).with_context(|| format!("{which}: reading the replay's JSON"))
}

pub fn run(a: Args) -> anyhow::Result<Outcome> {
    let (sa, sb) = (switches(&a.a).context("--a")?, switches(&a.b).context("--b")?);
    let mut runs: [Vec<Value>; 2] = [Vec::new(), Vec::new()];
    // A bar of the replays where stderr is a terminal; a line per replay where it is not.
    let bar = crate::progress::shown().then(|| crate::progress::Bar::new("", "replays", Some(2 * u64::from(a.rounds))));
    for round in 0..a.rounds {
        for (i, (name, text, arm)) in [("A", &a.a, &sa), ("B", &a.b, &sb)].into_iter().enumerate() {
            let what = format!("round {}/{}: {text}", round + 1, a.rounds);
            match &bar {
                Some(b) => b.message(&what),
                None => eprintln!("{what}"),
            }
            runs[i].push(one(name, text, arm, &a)?);
            if let Some(b) = &bar {
                b.inc();
            }
        }
    }
    drop(bar);
    let figure = |run: &Value, k: &str| run.get(k).and_then(Value::as_f64);
    let med = |i: usize, k: &str| -> Option<f64> {
        let mut v: Vec<f64> = runs[i].iter().filter_map(|r| figure(r, k)).collect();
        (!v.is_empty()).then(|| median(&mut v))
    };
    let lost: f64 = runs.iter().flatten().filter_map(|r| figure(r, "lost_writes")).sum();
    if a.json {
        let arm = |i: usize, switches| ArmReport {
            switches,
            runs: &runs[i],
            medians: ROWS.iter().filter_map(|(k, _)| Some((*k, med(i, k)?))).collect(),
        };
        let ratio_b_over_a = ROWS
            .iter()
            .filter_map(|(k, _)| match (med(0, k), med(1, k)) {
                (Some(x), Some(y)) if x != 0.0 => Some((*k, y / x)),
                _ => None,
            })
            .collect();
        let r = Report { schema: SCHEMA, rounds: a.rounds, a: arm(0, &a.a), b: arm(1, &a.b), ratio_b_over_a };
        outln!("{}", serde_json::to_string(&r).context("writing the report as JSON")?);
    } else {
        outln!("A: {}\nB: {}\n{} rounds, alternated A B, each a fresh process\n", a.a, a.b, a.rounds);
        let cell = |v: Option<f64>| {
            v.map_or("-".to_string(), |x| if x.fract() == 0.0 { format!("{x:.0}") } else { format!("{x:.1}") })
        };
        outln!(
            "{:<34} {:>26} {:>26} {:>9} {:>9} {:>7}",
            "",
            "A per round",
            "B per round",
            "A median",
            "B median",
            "B/A"
        );
        for (k, label) in ROWS {
            if runs[0].iter().all(|r| figure(r, k).is_none()) {
                continue;
            }
            let per = |i: usize| runs[i].iter().map(|r| cell(figure(r, k))).collect::<Vec<_>>().join(" / ");
            let (x, y) = (med(0, k), med(1, k));
            let ratio = match (x, y) {
                (Some(x), Some(y)) if x != 0.0 => format!("{:.2}", y / x),
                _ => "-".into(),
            };
            outln!("{label:<34} {:>26} {:>26} {:>9} {:>9} {:>7}", per(0), per(1), cell(x), cell(y), ratio);
        }
    }
    Ok(if lost > 0.0 { Outcome::CheckFailed } else { Outcome::Ok })
}
