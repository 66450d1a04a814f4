//! `emuhost bench watch`: the cost of collecting written pages, per backend, in one run, and the
//! no-lost-writes stress (arms, disarms and releases racing the writers) of each. It measures the
//! backends this kernel offers (each passes its self-test), or only the one `EMUHOST_WATCH`
//! names, and says which it left out and why; exit 1 when a write was lost. Beside uffd it
//! measures the bare kernel (the same calls on the same memory with nothing of emuhost around
//! them) and prints emuhost's cost over it. The measurement is the lab's
//! ([`emuhost_lab::bench::watch`]); here the choice of backends and the printing.

use emuhost::watch::{self, BackendKind};
use emuhost_lab::bench::watch::{OVER_BARE, PAIR, WatchBench, WatchReport};
use serde_json::json;

use crate::Outcome;

#[derive(clap::Args)]
pub struct Args {
    /// Rounds (each measures every backend measured).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Memory collected over, in MiB.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=16384))]
    size_mib: u64,
    /// Writes per writer thread in the no-lost-writes stress (two writers).
    #[arg(long, default_value_t = 1_000_000)]
    stress_writes: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Backends not measured, and why.
type LeftOut = Vec<(BackendKind, String)>;

/// The backends to measure, and those left out with why: the one `EMUHOST_WATCH` names when it
/// is set (it must pass its self-test), else each of [`BackendKind::AUTO`] whose self-test passes
/// on this kernel (by what it offers, not by its version).
fn backends(switch: Option<&str>) -> anyhow::Result<(Vec<BackendKind>, LeftOut)> {
    let all = BackendKind::AUTO;
    let (mut keep, mut left) = (Vec::new(), Vec::new());
    if let Some(v) = switch.filter(|v| !v.trim().is_empty()) {
        let switch = emuhost::settings::WATCH_SWITCH;
        let kind = emuhost::settings::parse_watch(v)
            .map_err(anyhow::Error::msg)?
            .ok_or_else(|| anyhow::anyhow!("{switch}={v:?} names no backend"))?;
        watch::self_test(kind).map_err(|e| anyhow::Error::from(e).context(format!("{switch}={v}")))?;
        keep.push(kind);
        for other in all.into_iter().filter(|o| *o != kind) {
            left.push((other, format!("{switch}={v} measures {} only", kind.name())));
        }
        return Ok((keep, left));
    }
    for kind in BackendKind::AUTO {
        match watch::self_test(kind) {
            Ok(()) => keep.push(kind),
            Err(e) => left.push((kind, format!("{:#}", anyhow::Error::from(e)))),
        }
    }
    anyhow::ensure!(
        !keep.is_empty(),
        "no write-tracking backend passed its self-test ({})",
        left.iter().map(|(k, why)| format!("{}: {why}", k.name())).collect::<Vec<_>>().join("; ")
    );
    Ok((keep, left))
}

pub fn run(a: Args, settings: &emuhost::settings::Settings) -> anyhow::Result<Outcome> {
    if cfg!(debug_assertions) {
        eprintln!("emuhost: warning: a debug build; measure with `cargo build --release`");
    }
    let (kinds, left_out) = backends(settings.watch.map(BackendKind::name))?;
    let r = emuhost_lab::bench::watch::run(&WatchBench::new(a.rounds, a.size_mib, a.stress_writes, kinds.clone()))?;
    let report = Report { a: &a, kinds: &kinds, left_out: &left_out, r: &r };
    if a.json {
        outln!("{}", serde_json::to_string(&report.json())?);
    } else {
        report.print();
    }
    Ok(if r.lost() == 0 { Outcome::Ok } else { Outcome::CheckFailed })
}

/// `bench watch --json`.
#[derive(serde::Serialize)]
struct WatchJson<'a> {
    schema: u32,
    bench: &'static str,
    rounds: u32,
    size_mib: u64,
    backends: Vec<&'static str>,
    left_out: Vec<LeftOutJson<'a>>,
    /// Each backend's medians and stress figures, under the backend's name.
    #[serde(flatten)]
    per_backend: std::collections::BTreeMap<&'static str, serde_json::Value>,
    uffd_over_bare: serde_json::Map<String, serde_json::Value>,
    stress_left_out: Option<&'a str>,
    lost_writes: u64,
    first_write_ratio_mprotect_over_uffd: Option<f64>,
    targets: serde_json::Value,
}

/// A backend left out, and why.
#[derive(serde::Serialize)]
struct LeftOutJson<'a> {
    backend: &'static str,
    why: &'a str,
}

/// What a run measured, to print.
struct Report<'a> {
    a: &'a Args,
    kinds: &'a [BackendKind],
    left_out: &'a [(BackendKind, String)],
    r: &'a WatchReport,
}

impl Report<'_> {
    fn json(&self) -> WatchJson<'_> {
        let t = self.r.targets();
        let lost = self.r.lost();
        let targets = json!({
            "uffd_clean_ns_per_page_max": 1.5, "uffd_clean_met": t.clean.map(|c| c <= 1.5),
            "uffd_dirty_ns_per_page_max": 40.0, "uffd_dirty_met": t.dirty_max.map(|d| d <= 40.0),
            "uffd_calls_per_allocation": 1.0, "uffd_calls_met": t.calls.map(|c| c <= 1.0),
            "first_write_ratio_min": 5.0, "first_write_met": t.first_ratio.map(|r| r >= 5.0),
            "lost_writes_max": 0, "lost_writes_met": lost == 0,
        });
        let over = self
            .r
            .over_bare()
            .into_iter()
            .map(|(key, r, target)| {
                (key.to_string(), json!({"ratio": r, "target_max": target, "met": r.map(|r| r <= target)}))
            })
            .collect();
        WatchJson {
            schema: super::SCHEMA,
            bench: "watch",
            rounds: self.a.rounds,
            size_mib: self.a.size_mib,
            backends: self.kinds.iter().map(|k| k.name()).collect(),
            left_out: self.left_out.iter().map(|(k, why)| LeftOutJson { backend: k.name(), why }).collect(),
            per_backend: self.kinds.iter().map(|&k| (k.name(), self.per_backend(k))).collect(),
            uffd_over_bare: over,
            stress_left_out: self.r.stress_left_out.as_deref(),
            lost_writes: lost,
            first_write_ratio_mprotect_over_uffd: t.first_ratio,
            targets,
        }
    }

    fn per_backend(&self, kind: BackendKind) -> serde_json::Value {
        let mut o = serde_json::Map::new();
        for key in self.r.samples.get(&kind).map(|s| s.keys().cloned().collect::<Vec<_>>()).unwrap_or_default() {
            o.insert(key.clone(), json!(self.r.med(kind, &key)));
        }
        // No stress where it was left out (`stress_left_out` says why).
        let Some(r) = self.r.stress.get(&kind) else {
            return serde_json::Value::Object(o);
        };
        o.insert("stress_writes".into(), json!(r.writes));
        o.insert("stress_writes_checked".into(), json!(r.writes - r.unchecked));
        o.insert("stress_writes_between_collects".into(), json!(r.exact));
        o.insert("stress_lost_writes".into(), json!(r.lost));
        o.insert("stress_collects".into(), json!(r.collects));
        o.insert("stress_space_ops".into(), json!(r.space_ops));
        let ops: serde_json::Map<_, _> = r.ops.kinds().iter().map(|(k, n)| (k.replace(' ', "_"), json!(n))).collect();
        o.insert("stress_ops".into(), serde_json::Value::Object(ops));
        serde_json::Value::Object(o)
    }

    // Over 80 lines: the text report is one table, the stress lines and the targets, in order.
    fn print(&self) {
        let a = self.a;
        outln!("collect over {} MiB ({} rounds; medians)", a.size_mib, a.rounds);
        for (kind, why) in self.left_out {
            outln!("  left out: {} ({why})", kind.name());
        }
        // The ratio column: page protection over the OS's own tracking (mprotect over uffd on
        // Linux, guard over writewatch on Windows), where both were measured.
        let both = self.kinds.contains(&PAIR.0) && self.kinds.contains(&PAIR.1);
        let mut head = format!("  {:<36}", "");
        for k in self.kinds {
            head.push_str(&format!(" {:>12}", k.name()));
        }
        if both {
            head.push_str(&format!(" {:>8}", "ratio"));
        }
        outln!("{}", head.trim_end());
        let keys: Vec<String> = self.r.samples.values().next().map(|s| s.keys().cloned().collect()).unwrap_or_default();
        let f = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.2}"));
        for key in keys {
            let mut line = format!("  {key:<36}");
            for &k in self.kinds {
                line.push_str(&format!(" {:>12}", f(self.r.med(k, &key))));
            }
            if both {
                let (x, y) = (self.r.med(PAIR.0, &key), self.r.med(PAIR.1, &key));
                line.push_str(&format!(" {:>8}", x.zip(y).map_or("".into(), |(x, y)| format!("{:.1}x", y / x))));
            }
            outln!("{}", line.trim_end());
        }
        if let Some(why) = &self.r.stress_left_out {
            outln!("  stress left out: {why}");
        }
        for (&kind, r) in &self.r.stress {
            outln!(
                "  stress {:<9} {} writes ({} checked, {} of them between two collects), {} lost writes",
                kind.name(),
                r.writes,
                r.writes - r.unchecked,
                r.exact,
                r.lost
            );
            let ops: Vec<String> = r.ops.kinds()[2..].iter().map(|(k, n)| format!("{n} {k}")).collect();
            outln!("    beside the writers: {}", ops.join(", "));
        }
        if self.kinds.contains(&BackendKind::Uffd) {
            outln!("  uffd over the bare kernel (same memory, same run; target):");
            for ((name, ..), (_, r, target)) in OVER_BARE.iter().zip(self.r.over_bare()) {
                let r = r.map_or("n/a".into(), |r| format!("{r:.2}x"));
                outln!("    {name:<22} {r:>8}  (<= {target}x)");
            }
        }
        let t = self.r.targets();
        let met = |b: Option<bool>| match b {
            Some(true) => "met",
            Some(false) => "NOT met",
            None => "n/a",
        };
        let lost = self.r.lost();
        outln!("targets:");
        if !cfg!(target_os = "linux") {
            // The reference's time targets are uffd's, which is Linux's.
            outln!("  0 lost writes ({lost} lost): {}", met(self.r.stress_left_out.is_none().then_some(lost == 0)));
            return;
        }
        outln!("  uffd clean page <= 1.5 ns: {}", met(t.clean.map(|c| c <= 1.5)));
        let worst = t.dirty_max.map_or("n/a".into(), |d| format!("{d:.1} ns"));
        outln!("  uffd dirty page <= 40 ns (worst of 1/50/100 %: {worst}): {}", met(t.dirty_max.map(|d| d <= 40.0)));
        outln!("  uffd one system call per allocation: {}", met(t.calls.map(|c| c <= 1.0)));
        outln!("  first write >= 5x cheaper with uffd: {}", met(t.first_ratio.map(|r| r >= 5.0)));
        outln!("  0 lost writes ({lost} lost): {}", met(Some(lost == 0)));
    }
}
