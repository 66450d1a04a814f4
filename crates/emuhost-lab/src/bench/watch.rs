//! The write-tracking bench: the cost of collecting written pages, per backend, in one run, and
//! the no-lost-writes stress (arms, disarms and releases racing the writers) of each. Beside uffd
//! it measures the bare kernel (`emuhost::watch::bare::BareUffd`, Linux only: the same calls on
//! the same memory with nothing of emuhost around them), so a report can print emuhost's cost
//! over it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use emuhost::space::{GuestAddr, GuestRange, Prot, Space, page_size};
#[cfg(target_os = "linux")]
use emuhost::watch::bare::BareUffd;
use emuhost::watch::{BackendKind, Tracker};

use super::{BenchError, check, median};
use crate::stress::{self, StressReport};

/// What to measure.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WatchBench {
    /// Rounds (each measures every backend measured).
    pub rounds: u32,
    /// Memory collected over, in MiB.
    pub size_mib: u64,
    /// Writes per writer thread in the no-lost-writes stress (two writers).
    pub stress_writes: u64,
    /// The backends to measure (each passed its self-test).
    pub kinds: Vec<BackendKind>,
}

impl WatchBench {
    /// The bench with these fields (see each field).
    pub fn new(rounds: u32, size_mib: u64, stress_writes: u64, kinds: Vec<BackendKind>) -> Self {
        WatchBench { rounds, size_mib, stress_writes, kinds }
    }
}

/// What was measured: each backend's figures (every round's) and its stress.
#[derive(Debug)]
#[non_exhaustive]
pub struct WatchReport {
    /// Each backend's figures, every round's sample.
    pub samples: BTreeMap<BackendKind, Samples>,
    /// Each backend's no-lost-writes stress (empty where it was left out).
    pub stress: BTreeMap<BackendKind, StressReport>,
    /// Why the stress did not run (it maps shared views: none without placeholders on Windows).
    pub stress_left_out: Option<String>,
}

/// Runs the watch bench: `a.rounds` rounds of every backend's figures, alternated, then each
/// backend's stress (left out where shared views cannot be mapped).
///
/// # Errors
///
/// The first runtime call that failed (a space or tracker made, an arm, a collect), the
/// stress's included. A write the stress lost is not an error: it is in [`WatchReport::stress`].
pub fn run(a: &WatchBench) -> Result<WatchReport, BenchError> {
    let size = a.size_mib << 20;
    let mut samples: BTreeMap<BackendKind, Samples> = BTreeMap::new();
    super::progress::plan(u64::from(a.rounds));
    for i in 0..a.rounds {
        super::progress::tick();
        for &kind in &a.kinds {
            round(kind, size, samples.entry(kind).or_default(), i % 2 == 1)?;
        }
    }
    let mut stress = BTreeMap::new();
    let stress_left_out = super::views_here().err();
    if stress_left_out.is_none() {
        for &kind in &a.kinds {
            stress.insert(kind, stress::stress(kind, a.stress_writes)?);
        }
    }
    Ok(WatchReport { samples, stress, stress_left_out })
}

/// The shares of pages written, in percent.
pub const DIRTY_PERCENT: [u64; 3] = [1, 50, 100];

/// Each figure's samples, one a round, by name.
pub type Samples = BTreeMap<String, Vec<f64>>;

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
#[allow(unsafe_code)] // guest stores without the space's checks: see the SAFETY comments
fn round(kind: BackendKind, size: u64, out: &mut Samples, bare_first: bool) -> Result<(), BenchError> {
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
    check!(c.pages() == 0, "a collect of clean memory reported {} pages", c.pages());
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
        check!(c.pages() >= dirty, "{pct}% dirty: wrote {dirty} pages, collect reported {}", c.pages());
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
    check!(c.pages() == 1024, "1,024 allocations written, collect reported {}", c.pages());
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
#[allow(unsafe_code)] // guest stores without the space's checks: see the SAFETY comment
fn steady(s: &Space, t: &Tracker, r: GuestRange, out: &mut Samples) -> Result<(), BenchError> {
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
            check!(w.pages >= dirty, "{pct}% dirty: wrote {dirty} pages, collect_into reported {}", w.pages);
            if pass == 1 {
                out.entry(format!("into_{pct}pct_ns_per_page")).or_default().push(ns / pages as f64);
            }
        }
    }
    Ok(())
}

/// The bare kernel's round on the uffd round's memory: armed and scanned with the kernel's calls
/// alone, written with plain stores; the same figures under `bare_` names.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)] // plain stores into the committed guest pages: see the SAFETY comment
fn bare_round(s: &Space, size: u64, out: &mut Samples) -> Result<(), BenchError> {
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
    check!(n == 0, "bare: a scan of clean memory found {n} bytes written");
    for pct in DIRTY_PERCENT {
        let mut dirty = 0;
        for pg in (0..pages).step_by((100 / pct) as usize) {
            store(pg, 1);
            dirty += 1;
        }
        let start = Instant::now();
        let n = b.scan(host, size as usize)?;
        put(&format!("bare_dirty_{pct}pct_ns_per_dirty_page"), (ns_since(start) - clean_ns).max(0.0) / dirty as f64);
        check!(n >= dirty * p, "bare, {pct}% dirty: wrote {dirty} pages, the scan found {n} bytes");
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

/// The bare kernel's calls are userfaultfd's, Linux's: never called elsewhere (no uffd round).
#[cfg(not(target_os = "linux"))]
fn bare_round(_: &Space, _: u64, _: &mut Samples) -> Result<(), BenchError> {
    Ok(())
}

/// emuhost's uffd figures (steady state, into words: a whole collect per page of the range) over
/// the bare kernel's: (name, emuhost's key, the bare key, target ratio).
pub const OVER_BARE: [(&str, &str, &str, f64); 5] = [
    ("clean", "into_0pct_ns_per_page", "bare_0pct_ns_per_page", 1.1),
    ("1 % of pages written", "into_1pct_ns_per_page", "bare_1pct_ns_per_page", 1.2),
    ("50 % written", "into_50pct_ns_per_page", "bare_50pct_ns_per_page", 1.2),
    ("100 % written", "into_100pct_ns_per_page", "bare_100pct_ns_per_page", 1.2),
    ("first write", "first_write_ns", "bare_first_write_ns", 1.1),
];

/// This platform's two backends as the bench compares them: (the OS's own tracking, page
/// protection): uffd and mprotect on Linux, writewatch and guard on Windows. The ratio column is
/// the second over the first.
pub const PAIR: (BackendKind, BackendKind) = (BackendKind::AUTO[0], BackendKind::AUTO[1]);

impl WatchReport {
    /// The median of `kind`'s figure `key`; `None` where not measured.
    pub fn med(&self, kind: BackendKind, key: &str) -> Option<f64> {
        let mut v = self.samples.get(&kind)?.get(key)?.clone();
        Some(median(&mut v))
    }

    /// emuhost's uffd figures over the bare kernel's, by [`OVER_BARE`]: (key, ratio, target).
    pub fn over_bare(&self) -> Vec<(&'static str, Option<f64>, f64)> {
        let u = BackendKind::Uffd;
        OVER_BARE
            .iter()
            .map(|&(_, key, bare, target)| {
                let r = self.med(u, key).zip(self.med(u, bare)).map(|(e, b)| e / b);
                (key, r, target)
            })
            .collect()
    }

    /// Writes the stresses lost, over every backend.
    pub fn lost(&self) -> u64 {
        self.stress.values().map(|r| r.lost).sum()
    }

    /// The targets: those of uffd are `None` (n/a) where uffd was left out.
    pub fn targets(&self) -> Targets {
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
}

/// The figures the targets judge (`None`: not measured, as where uffd was left out).
#[derive(Clone, Copy, Debug)]
pub struct Targets {
    /// uffd's clean page, ns.
    pub clean: Option<f64>,
    /// uffd's worst written page of 1/50/100 %, ns.
    pub dirty_max: Option<f64>,
    /// uffd's system calls per allocation.
    pub calls: Option<f64>,
    /// mprotect's first write over uffd's.
    pub first_ratio: Option<f64>,
}
