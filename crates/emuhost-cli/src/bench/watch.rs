//! `emuhost bench watch`: the cost of collecting written pages, per backend, in one run, and the
//! no-lost-writes stress (arms, disarms and releases racing the writers) of each. It measures the
//! backends this kernel offers (each passes its self-test), or only the one `EMUHOST_WATCH`
//! names, and says which it left out and why; exit 1 when a write was lost. Beside uffd it
//! measures the bare kernel ([`BareUffd`]: the same calls on the same memory with nothing of
//! emuhost around them) and prints emuhost's cost over it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use emuhost::space::{GuestAddr, GuestRange, Prot, Space, page_size};
use emuhost::watch::bare::BareUffd;
use emuhost::watch::{self, BackendKind, Tracker};
use emuhost_lab::stress::{self, StressReport};
use serde_json::json;

use super::median;
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

const DIRTY_PERCENT: [u64; 3] = [1, 50, 100];

type Samples = BTreeMap<String, Vec<f64>>;
/// Backends not measured, and why.
type LeftOut = Vec<(BackendKind, String)>;

fn ns_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e9
}

fn calls_total() -> Option<u64> {
    emuhost::counters::snapshot().map(|c| c.total())
}

/// One round of one backend: collect costs over `size` bytes, first-write cost, calls per
/// allocation; for uffd also the bare kernel's arm on the same memory, before emuhost's where
/// `bare_first` (rounds alternate the order, so neither arm always finds the machine as the
/// other left it).
fn round(kind: BackendKind, size: u64, out: &mut Samples, bare_first: bool) -> anyhow::Result<()> {
    let p = page_size();
    let pages = size / p;
    let s = Arc::new(Space::with_window(size * 2)?);
    let r = s.range(0, size)?;
    s.commit(r, Prot::READ_WRITE)?;
    s.populate(r)?;
    let bare = kind == BackendKind::Uffd;
    if bare && bare_first {
        bare_round(&s, size, out)?;
    }
    let t = Tracker::new(&s, &emuhost::watch::TrackerConfig::default().backend(Some(kind)).skip_self_test(true))?;
    t.arm(r)?;
    let mut put = |k: &str, v: f64| out.entry(k.to_string()).or_default().push(v);
    let start = Instant::now();
    let c = t.collect(r)?;
    let clean_ns = ns_since(start);
    put("clean_ns_per_page", clean_ns / pages as f64);
    anyhow::ensure!(c.pages() == 0, "a collect of clean memory reported {} pages", c.pages());
    for pct in DIRTY_PERCENT {
        let step = 100 / pct;
        let mut dirty = 0;
        for pg in (0..pages).step_by(step as usize) {
            // SAFETY: the pages are committed read-write and armed; nothing releases them meanwhile.
            unsafe { s.store_unchecked(GuestAddr(pg * p), &[1]) }?;
            dirty += 1;
        }
        let start = Instant::now();
        let c = t.collect(r)?;
        // What the written pages add to a clean collect, per written page.
        put(&format!("dirty_{pct}pct_ns_per_dirty_page"), (ns_since(start) - clean_ns).max(0.0) / dirty as f64);
        // More than written is allowed (the mprotect backend reports a 2 MiB block's pages when the
        // kernel runs out of mappings to split); fewer would be lost writes.
        anyhow::ensure!(c.pages() >= dirty, "{pct}% dirty: wrote {dirty} pages, collect reported {}", c.pages());
        put(&format!("dirty_{pct}pct_reported_per_written"), c.pages() as f64 / dirty as f64);
    }
    steady(&s, &t, r, out)?;
    let mut put = |k: &str, v: f64| out.entry(k.to_string()).or_default().push(v);
    // First write after arming: every page clean and armed now.
    let n = pages.min(16384);
    let start = Instant::now();
    for pg in 0..n {
        // SAFETY: as above.
        unsafe { s.store_unchecked(GuestAddr(pg * p), &[2]) }?;
    }
    put("first_write_ns", ns_since(start) / n as f64);
    t.collect(r)?;
    // System calls per allocation collected: 1,024 allocations of 16 pages, one page written in each.
    let s2 = Arc::new(Space::with_window(1 << 30)?);
    let t2 = Tracker::new(&s2, &emuhost::watch::TrackerConfig::default().backend(Some(kind)).skip_self_test(true))?;
    for i in 0..1024 {
        s2.commit(s2.range(i * 16 * p, 16 * p)?, Prot::READ_WRITE)?;
    }
    let whole = s2.range(0, 1024 * 16 * p)?;
    t2.arm(whole)?;
    for i in 0..1024 {
        // SAFETY: committed read-write and armed, as above.
        unsafe { s2.store_unchecked(GuestAddr((i * 16 + 3) * p), &[1]) }?;
    }
    let before = calls_total();
    let c = t2.collect(whole)?;
    if let (Some(b), Some(a)) = (before, calls_total()) {
        put("calls_per_allocation", (a - b) as f64 / 1024.0);
    }
    anyhow::ensure!(c.pages() == 1024, "1,024 allocations written, collect reported {}", c.pages());
    if bare && !bare_first {
        // The tracker gives the memory back (unregistered) when dropped.
        drop(t);
        bare_round(&s, size, out)?;
    }
    Ok(())
}

/// Steady state, as an emulator collects every frame: into the caller's words (no result to
/// allocate) with the tracker's buffers warm: each pattern (clean, then 1/50/100 % written) is
/// collected twice and the second timed, the whole collect per page of the range (the bare arm
/// does the same, so the ratio needs no subtraction of a baseline).
fn steady(s: &Space, t: &Tracker, r: GuestRange, out: &mut Samples) -> anyhow::Result<()> {
    let p = page_size();
    let pages = r.len() / p;
    let mut words = vec![0u64; pages.div_ceil(64) as usize];
    for pct in [0].into_iter().chain(DIRTY_PERCENT) {
        for pass in 0..2 {
            let mut dirty = 0;
            if let Some(step) = 100u64.checked_div(pct) {
                for pg in (0..pages).step_by(step as usize) {
                    // SAFETY: the round's pages are committed read-write and armed; nothing
                    // releases them meanwhile.
                    unsafe { s.store_unchecked(GuestAddr(pg * p), &[3]) }?;
                    dirty += 1;
                }
            }
            words.fill(0);
            let start = Instant::now();
            let w = t.collect_into(r, p, &mut words)?;
            let ns = ns_since(start);
            anyhow::ensure!(w.pages >= dirty, "{pct}% dirty: wrote {dirty} pages, collect_into reported {}", w.pages);
            if pass == 1 {
                out.entry(format!("into_{pct}pct_ns_per_page")).or_default().push(ns / pages as f64);
            }
        }
    }
    Ok(())
}

/// The bare kernel's round on the uffd round's memory: armed and scanned with the kernel's calls
/// alone, written with plain stores; the same figures under `bare_` names.
fn bare_round(s: &Space, size: u64, out: &mut Samples) -> anyhow::Result<()> {
    let p = page_size();
    let pages = size / p;
    let host = s.host_addr(GuestAddr(0))?;
    let store = |pg: u64, v: u8| {
        // SAFETY: pages 0..size/p of the space are committed read-write (the uffd round committed
        // them and nothing released them), and no Rust reference points into guest memory.
        unsafe { std::ptr::write_volatile((host + (pg * p) as usize) as *mut u8, v) }
    };
    let mut put = |k: &str, v: f64| out.entry(k.to_string()).or_default().push(v);
    let mut b = BareUffd::new()?;
    b.arm(host, size as usize)?;
    let start = Instant::now();
    let n = b.scan(host, size as usize)?;
    let clean_ns = ns_since(start);
    put("bare_clean_ns_per_page", clean_ns / pages as f64);
    anyhow::ensure!(n == 0, "bare: a scan of clean memory found {n} bytes written");
    for pct in DIRTY_PERCENT {
        let mut dirty = 0;
        for pg in (0..pages).step_by((100 / pct) as usize) {
            store(pg, 1);
            dirty += 1;
        }
        let start = Instant::now();
        let n = b.scan(host, size as usize)?;
        put(&format!("bare_dirty_{pct}pct_ns_per_dirty_page"), (ns_since(start) - clean_ns).max(0.0) / dirty as f64);
        anyhow::ensure!(n >= dirty * p, "bare, {pct}% dirty: wrote {dirty} pages, the scan found {n} bytes");
    }
    // Steady state, as emuhost's arm above: each pattern scanned twice, the second timed.
    for pct in [0].into_iter().chain(DIRTY_PERCENT) {
        for pass in 0..2 {
            if let Some(step) = 100u64.checked_div(pct) {
                for pg in (0..pages).step_by(step as usize) {
                    store(pg, 3);
                }
            }
            let start = Instant::now();
            b.scan(host, size as usize)?;
            if pass == 1 {
                put(&format!("bare_{pct}pct_ns_per_page"), ns_since(start) / pages as f64);
            }
        }
    }
    let n = pages.min(16384);
    let start = Instant::now();
    for pg in 0..n {
        store(pg, 2);
    }
    put("bare_first_write_ns", ns_since(start) / n as f64);
    b.scan(host, size as usize)?;
    b.disarm(host, size as usize)?;
    Ok(())
}

/// emuhost's uffd figures (steady state, into words: a whole collect per page of the range) over
/// the bare kernel's: (name, emuhost's key, the bare key, target ratio).
const OVER_BARE: [(&str, &str, &str, f64); 5] = [
    ("clean", "into_0pct_ns_per_page", "bare_0pct_ns_per_page", 1.1),
    ("1 % of pages written", "into_1pct_ns_per_page", "bare_1pct_ns_per_page", 1.2),
    ("50 % written", "into_50pct_ns_per_page", "bare_50pct_ns_per_page", 1.2),
    ("100 % written", "into_100pct_ns_per_page", "bare_100pct_ns_per_page", 1.2),
    ("first write", "first_write_ns", "bare_first_write_ns", 1.1),
];

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
    let size = a.size_mib << 20;
    let mut samples: BTreeMap<BackendKind, Samples> = BTreeMap::new();
    for i in 0..a.rounds {
        for &kind in &kinds {
            round(kind, size, samples.entry(kind).or_default(), i % 2 == 1)?;
        }
    }
    let mut stress = BTreeMap::new();
    for &kind in &kinds {
        stress.insert(kind, stress::stress(kind, a.stress_writes)?);
    }
    let lost: u64 = stress.values().map(|r| r.lost).sum();
    let report = Report { a: &a, kinds: &kinds, left_out: &left_out, samples: &samples, stress: &stress };
    if a.json {
        outln!("{}", report.json());
    } else {
        report.print();
    }
    Ok(if lost == 0 { Outcome::Ok } else { Outcome::CheckFailed })
}

/// What a run measured, to print.
struct Report<'a> {
    a: &'a Args,
    kinds: &'a [BackendKind],
    left_out: &'a [(BackendKind, String)],
    samples: &'a BTreeMap<BackendKind, Samples>,
    stress: &'a BTreeMap<BackendKind, StressReport>,
}

impl Report<'_> {
    fn med(&self, kind: BackendKind, key: &str) -> Option<f64> {
        let mut v = self.samples.get(&kind)?.get(key)?.clone();
        Some(median(&mut v))
    }

    /// emuhost's uffd figures over the bare kernel's, by [`OVER_BARE`]: (key, ratio, target).
    fn over_bare(&self) -> Vec<(&'static str, Option<f64>, f64)> {
        let u = BackendKind::Uffd;
        OVER_BARE
            .iter()
            .map(|&(_, key, bare, target)| {
                let r = self.med(u, key).zip(self.med(u, bare)).map(|(e, b)| e / b);
                (key, r, target)
            })
            .collect()
    }

    fn lost(&self) -> u64 {
        self.stress.values().map(|r| r.lost).sum()
    }

    /// The targets: those of uffd are `None` (n/a) where uffd was left out.
    fn targets(&self) -> Targets {
        let (u, m) = (BackendKind::Uffd, BackendKind::Mprotect);
        let dirty: Vec<f64> =
            DIRTY_PERCENT.iter().filter_map(|p| self.med(u, &format!("dirty_{p}pct_ns_per_dirty_page"))).collect();
        Targets {
            clean: self.med(u, "clean_ns_per_page"),
            dirty_max: (!dirty.is_empty()).then(|| dirty.iter().copied().fold(0.0, f64::max)),
            calls: self.med(u, "calls_per_allocation"),
            first_ratio: self.med(m, "first_write_ns").zip(self.med(u, "first_write_ns")).map(|(m, u)| m / u),
        }
    }

    fn json(&self) -> serde_json::Value {
        let t = self.targets();
        let lost = self.lost();
        let targets = json!({
            "uffd_clean_ns_per_page_max": 1.5, "uffd_clean_met": t.clean.map(|c| c <= 1.5),
            "uffd_dirty_ns_per_page_max": 40.0, "uffd_dirty_met": t.dirty_max.map(|d| d <= 40.0),
            "uffd_calls_per_allocation": 1.0, "uffd_calls_met": t.calls.map(|c| c <= 1.0),
            "first_write_ratio_min": 5.0, "first_write_met": t.first_ratio.map(|r| r >= 5.0),
            "lost_writes_max": 0, "lost_writes_met": lost == 0,
        });
        let mut o = serde_json::Map::new();
        o.insert("bench".into(), json!("watch"));
        o.insert("rounds".into(), json!(self.a.rounds));
        o.insert("size_mib".into(), json!(self.a.size_mib));
        o.insert("backends".into(), json!(self.kinds.iter().map(|k| k.name()).collect::<Vec<_>>()));
        let left: Vec<_> = self.left_out.iter().map(|(k, why)| json!({"backend": k.name(), "why": why})).collect();
        o.insert("left_out".into(), json!(left));
        for &kind in self.kinds {
            o.insert(kind.name().into(), self.per_backend(kind));
        }
        let over: serde_json::Map<_, _> = self
            .over_bare()
            .into_iter()
            .map(|(key, r, target)| {
                (key.to_string(), json!({"ratio": r, "target_max": target, "met": r.map(|r| r <= target)}))
            })
            .collect();
        o.insert("uffd_over_bare".into(), serde_json::Value::Object(over));
        o.insert("lost_writes".into(), json!(lost));
        o.insert("first_write_ratio_mprotect_over_uffd".into(), json!(t.first_ratio));
        o.insert("targets".into(), targets);
        serde_json::Value::Object(o)
    }

    fn per_backend(&self, kind: BackendKind) -> serde_json::Value {
        let r = &self.stress[&kind];
        let mut o = serde_json::Map::new();
        for key in self.samples.get(&kind).map(|s| s.keys().cloned().collect::<Vec<_>>()).unwrap_or_default() {
            o.insert(key.clone(), json!(self.med(kind, &key)));
        }
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
        let both = self.kinds.contains(&BackendKind::Uffd) && self.kinds.contains(&BackendKind::Mprotect);
        let mut head = format!("  {:<36}", "");
        for k in self.kinds {
            head.push_str(&format!(" {:>12}", k.name()));
        }
        if both {
            head.push_str(&format!(" {:>8}", "ratio"));
        }
        outln!("{}", head.trim_end());
        let keys: Vec<String> = self.samples.values().next().map(|s| s.keys().cloned().collect()).unwrap_or_default();
        let f = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.2}"));
        for key in keys {
            let mut line = format!("  {key:<36}");
            for &k in self.kinds {
                line.push_str(&format!(" {:>12}", f(self.med(k, &key))));
            }
            if both {
                let (x, y) = (self.med(BackendKind::Uffd, &key), self.med(BackendKind::Mprotect, &key));
                line.push_str(&format!(" {:>8}", x.zip(y).map_or("".into(), |(x, y)| format!("{:.1}x", y / x))));
            }
            outln!("{}", line.trim_end());
        }
        for &kind in self.kinds {
            let r = &self.stress[&kind];
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
            for ((name, ..), (_, r, target)) in OVER_BARE.iter().zip(self.over_bare()) {
                let r = r.map_or("n/a".into(), |r| format!("{r:.2}x"));
                outln!("    {name:<22} {r:>8}  (<= {target}x)");
            }
        }
        let t = self.targets();
        let met = |b: Option<bool>| match b {
            Some(true) => "met",
            Some(false) => "NOT met",
            None => "n/a",
        };
        let lost = self.lost();
        outln!("targets:");
        outln!("  uffd clean page <= 1.5 ns: {}", met(t.clean.map(|c| c <= 1.5)));
        let worst = t.dirty_max.map_or("n/a".into(), |d| format!("{d:.1} ns"));
        outln!("  uffd dirty page <= 40 ns (worst of 1/50/100 %: {worst}): {}", met(t.dirty_max.map(|d| d <= 40.0)));
        outln!("  uffd one system call per allocation: {}", met(t.calls.map(|c| c <= 1.0)));
        outln!("  first write >= 5x cheaper with uffd: {}", met(t.first_ratio.map(|r| r >= 5.0)));
        outln!("  0 lost writes ({lost} lost): {}", met(Some(lost == 0)));
    }
}

/// The figures the targets judge (`None`: not measured, as where uffd was left out).
struct Targets {
    clean: Option<f64>,
    dirty_max: Option<f64>,
    calls: Option<f64>,
    first_ratio: Option<f64>,
}
