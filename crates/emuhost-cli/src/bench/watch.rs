//! `emuhost bench watch`: the cost of collecting written pages, per backend, in one run.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use emuhost::space::{GuestAddr, Prot, Space, page_size};
use emuhost::watch::{self, BackendKind, Tracker};
use serde_json::json;

use super::median;
use crate::Outcome;

#[derive(clap::Args)]
pub struct Args {
    /// Rounds (each measures both backends).
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

const BACKENDS: [BackendKind; 2] = [BackendKind::Uffd, BackendKind::Mprotect];
const DIRTY_PERCENT: [u64; 3] = [1, 50, 100];

type Samples = BTreeMap<String, Vec<f64>>;

fn ns_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e9
}

fn calls_total() -> Option<u64> {
    emuhost::counters::snapshot().map(|c| c.total())
}

/// One round of one backend: collect costs over `size` bytes, first-write cost, calls per allocation.
fn round(kind: BackendKind, size: u64, out: &mut Samples) -> anyhow::Result<()> {
    let p = page_size();
    let pages = size / p;
    let s = Arc::new(Space::with_window(size * 2)?);
    let r = s.range(0, size)?;
    s.commit(r, Prot::READ_WRITE)?;
    s.populate(r)?;
    let t = Tracker::with_backend(&s, kind)?;
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
    let t2 = Tracker::with_backend(&s2, kind)?;
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
    Ok(())
}

pub fn run(a: Args) -> anyhow::Result<Outcome> {
    if cfg!(debug_assertions) {
        eprintln!("emuhost: warning: a debug build; measure with `cargo build --release`");
    }
    let size = a.size_mib << 20;
    let mut samples: BTreeMap<BackendKind, Samples> = BTreeMap::new();
    for _ in 0..a.rounds {
        for kind in BACKENDS {
            watch::self_test(kind)?;
            round(kind, size, samples.entry(kind).or_default())?;
        }
    }
    let mut stress = BTreeMap::new();
    for kind in BACKENDS {
        stress.insert(kind, watch::stress(kind, a.stress_writes)?);
    }
    let med = |kind: BackendKind, key: &str| -> Option<f64> {
        let mut v = samples.get(&kind)?.get(key)?.clone();
        Some(median(&mut v))
    };
    let (u, m) = (BackendKind::Uffd, BackendKind::Mprotect);
    let first_ratio = med(m, "first_write_ns").zip(med(u, "first_write_ns")).map(|(m, u)| m / u);
    let clean = med(u, "clean_ns_per_page");
    let dirty_max =
        DIRTY_PERCENT.iter().filter_map(|p| med(u, &format!("dirty_{p}pct_ns_per_dirty_page"))).fold(0.0, f64::max);
    let calls = med(u, "calls_per_allocation");
    let lost: u64 = stress.values().map(|r| r.lost).sum();
    let targets = json!({
        "uffd_clean_ns_per_page_max": 1.5, "uffd_clean_met": clean.map(|c| c <= 1.5),
        "uffd_dirty_ns_per_page_max": 40.0, "uffd_dirty_met": dirty_max <= 40.0,
        "uffd_calls_per_allocation": 1.0, "uffd_calls_met": calls.map(|c| c <= 1.0),
        "first_write_ratio_min": 5.0, "first_write_met": first_ratio.map(|r| r >= 5.0),
        "lost_writes_max": 0, "lost_writes_met": lost == 0,
    });
    let per_backend = |kind: BackendKind| {
        let r = stress[&kind];
        let mut o = serde_json::Map::new();
        for key in samples.get(&kind).map(|s| s.keys().cloned().collect::<Vec<_>>()).unwrap_or_default() {
            o.insert(key.clone(), json!(med(kind, &key)));
        }
        o.insert("stress_writes".into(), json!(r.writes));
        o.insert("stress_lost_writes".into(), json!(r.lost));
        o.insert("stress_collects".into(), json!(r.collects));
        o.insert("stress_space_ops".into(), json!(r.space_ops));
        serde_json::Value::Object(o)
    };
    if a.json {
        outln!(
            "{}",
            json!({
                "bench": "watch", "rounds": a.rounds, "size_mib": a.size_mib,
                "uffd": per_backend(u), "mprotect": per_backend(m),
                "first_write_ratio_mprotect_over_uffd": first_ratio,
                "targets": targets,
            })
        );
        return Ok(Outcome::Ok);
    }
    outln!("collect over {} MiB ({} rounds; medians)", a.size_mib, a.rounds);
    outln!("  {:<36} {:>12} {:>12} {:>8}", "", "uffd", "mprotect", "ratio");
    let keys: Vec<String> = samples.get(&u).map(|s| s.keys().cloned().collect()).unwrap_or_default();
    for key in keys {
        let (x, y) = (med(u, &key), med(m, &key));
        let f = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.2}"));
        let ratio = x.zip(y).map_or("".into(), |(x, y)| format!("{:.1}x", y / x));
        outln!("  {key:<36} {:>12} {:>12} {:>8}", f(x), f(y), ratio);
    }
    for kind in BACKENDS {
        let r = stress[&kind];
        outln!(
            "  stress {:<9} {} writes, {} lost writes ({} collects, {} space operations beside them)",
            kind.name(),
            r.writes,
            r.lost,
            r.collects,
            r.space_ops
        );
    }
    let met = |b: Option<bool>| match b {
        Some(true) => "met",
        Some(false) => "NOT met",
        None => "n/a",
    };
    outln!("targets:");
    outln!("  uffd clean page <= 1.5 ns: {}", met(clean.map(|c| c <= 1.5)));
    outln!("  uffd dirty page <= 40 ns (worst of 1/50/100 %: {dirty_max:.1} ns): {}", met(Some(dirty_max <= 40.0)));
    outln!("  uffd one system call per allocation: {}", met(calls.map(|c| c <= 1.0)));
    outln!("  first write >= 5x cheaper with uffd: {}", met(first_ratio.map(|r| r >= 5.0)));
    outln!("  0 lost writes: {}", met(Some(lost == 0)));
    Ok(Outcome::Ok)
}
