//! The importer's shared state: the index of live imports (by start, overlapping), the ranges
//! in flight, cooling, the cost bindings see, and the figures ([`Stats`]); and what a binding
//! gets ([`Bound`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use super::super::backend::{Backend, GpuHandle};
use super::super::cost::{ImportCost, Learned};
use super::super::plan::Planned;
use super::super::pools::{PoolId, Pools};
use super::Core;

/// The importer's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Imports made.
    pub imports: u64,
    /// Imports a binding made that took in pages already imported (a binding across two
    /// separately imported chunks imports both again as one: the hitch the span exists to
    /// avoid). The background thread's imports of a pool over a binding's part of it are
    /// `widenings`, not counted here.
    pub reimports: u64,
    /// Pools policy: bindings that imported only their part of a pool (its import would have
    /// passed the wait target), and the background thread's imports of those pools whole, over
    /// the parts (their pages are then in two imports).
    pub pieces: u64,
    /// Pools policy: the background thread's imports of a pool whole over a binding's part.
    pub widenings: u64,
    /// Bindings served by an import made before.
    pub reuses: u64,
    /// Imports that failed.
    pub failures: u64,
    /// Imports that failed and were made again smaller: without the span (chunks policy), or the
    /// binding's part of its pool (pools policy).
    pub unspanned_retries: u64,
    /// Attempts skipped because the range was cooling.
    pub cooled: u64,
    /// Time in imports, all together, and each import's time.
    pub time: Duration,
    /// Each import's time.
    pub times: Vec<Duration>,
    /// Live imports and their bytes now, and the most of each live at once (`peak_live` is what a
    /// backend's cap on live allocations bears on: [`Importer::max_live`](super::Importer::max_live)).
    pub live: u64,
    /// Live imported bytes now.
    pub live_bytes: u64,
    /// The most live imports at once.
    pub peak_live: u64,
    /// The most live imported bytes at once.
    pub peak_live_bytes: u64,
    /// At the cap on live imports: bindings refused (none: the cap never refuses a binding;
    /// kept for the figures' shape), imports released to make room, imports merged with a
    /// neighbour's range, bindings that waited for releases under way, and imports made over
    /// the cap because nothing could make room (module `cap`).
    pub capped: u64,
    /// At the cap: imports released to make room.
    pub cap_releases: u64,
    /// At the cap: imports merged with a neighbour's range.
    pub cap_merges: u64,
    /// At the cap: bindings that waited for releases under way.
    pub cap_waits: u64,
    /// At the cap: imports made over it because nothing could make room.
    pub over_cap: u64,
    /// Pools policy: imports of a pool whole (or of a [`MERGE_LIMIT`](super::MERGE_LIMIT) slice
    /// of a larger one) made once its pages were all in several live imports (background
    /// pieces, parts), and the imports those merges replaced: each is released once no binding
    /// needs it ([`Importer::handles_done`](super::Importer::handles_done), module `ahead`).
    pub merges: u64,
    /// Imports the merges replaced.
    pub merged_away: u64,
    /// Merges asked for and not made: no slot free under the cap, or the import failed.
    pub merges_left: u64,
    /// Pools populated ahead, populates that failed, and their bytes.
    pub populated: u64,
    /// Populates ahead that failed.
    pub populate_failures: u64,
    /// Bytes populated ahead.
    pub populated_bytes: u64,
    /// Bindings that did not find their import ready (they imported, or waited for an import
    /// in flight, or both), and of those the ones that waited for an import made ahead.
    pub waits: u64,
    /// Of `waits`, the bindings that waited for an import made ahead.
    pub in_flight_waits: u64,
    /// The binding thread's time waiting for imports, whoever made them: from the call to
    /// [`Importer::bind`](super::Importer::bind) to its return, for each binding counted in `waits`. All together and
    /// the longest.
    pub wait_time: Duration,
    /// The binding thread's longest wait for an import.
    pub wait_worst: Duration,
    /// `wait_time` by cause (pools and chunks policies alike): the importer's lock; the waits
    /// for an import in flight (served by it or given up); the binding's own imports that met a
    /// background import in the driver (drivers serialize imports: that one's rest is in it);
    /// and its own imports that met none. Each a count of bindings and their time (a binding
    /// that waited for one in flight and then imported counts in both, its time split).
    pub wait_lock: Duration,
    /// Waits for an import in flight: bindings and their time.
    pub wait_flight: (u64, Duration),
    /// The binding's own imports that met a background import in the driver: bindings and time.
    pub wait_beside_driver: (u64, Duration),
    /// The binding's own imports that met nothing in the driver: bindings and time.
    pub wait_own: (u64, Duration),
    /// Imports made ahead (also in `imports`, `time` and `times`) and their time.
    pub ahead_imports: u64,
    /// Time in imports made ahead.
    pub ahead_time: Duration,
    /// Imports ahead that failed (a spanned one is then tried without the span); they hold
    /// nothing cooling: a binding makes its own attempt.
    pub ahead_failures: u64,
    /// Pools left to their bindings because the budget of bytes ahead was full, or imports
    /// ahead had their share of the cap on live imports (module `cap`).
    pub ahead_over_budget: u64,
    /// Bindings served by an import made ahead (its first use).
    pub ahead_hits: u64,
    /// Imports made ahead and released unused: their pool was released, or a larger import took
    /// them in.
    pub ahead_released: u64,
    /// Bytes imported ahead (or in flight) and not used by a binding yet, now and at most.
    pub ahead_bytes: u64,
    /// The most bytes imported ahead and not used at once.
    pub ahead_peak_bytes: u64,
}

impl Stats {
    /// The slowest single import.
    pub fn worst(&self) -> Duration {
        self.times.iter().copied().max().unwrap_or_default()
    }

    pub(super) fn waited(&mut self, took: Duration) {
        self.waits += 1;
        self.wait_time += took;
        self.wait_worst = self.wait_worst.max(took);
    }
}

/// What served a binding: the import `range`, whether it was made for this binding, and what a
/// renderer needs to use the bound bytes: the import's device objects and where in them the
/// binding starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    /// The guest range of the import that serves the binding.
    pub range: Planned,
    /// Whether the import was made for this binding.
    pub made: bool,
    /// The range was the spanned one.
    pub spanned: bool,
    /// The import's device memory (and buffer) or device pointer, raw: valid while the import
    /// lives ([`GpuHandle`]): until its pool is released, [`Importer::release_all`](super::Importer::release_all),
    /// or, where a merge once its pool was whole replaced it, the next
    /// [`Importer::handles_done`](super::Importer::handles_done) (module `merge`). At the cap on
    /// live imports an import a later binding's import merges with, or one another live import
    /// covers whole, is released at once (module `cap`).
    pub handle: GpuHandle,
    /// Where the binding's first byte lies in the import's memory (and buffer): the binding's
    /// address less the import's start. (The import may start below `range.lo` where a backend
    /// that refuses overlaps took other imports in, or where at the cap on live imports it was
    /// merged with a neighbour's.)
    pub offset: u64,
}

impl Bound {
    /// The device pointer of the binding's first byte (CUDA).
    pub fn cuda_ptr(&self) -> Option<u64> {
        match self.handle {
            GpuHandle::Cuda { device_ptr } => Some(device_ptr + self.offset),
            _ => None,
        }
    }
}

pub(super) struct Live<I> {
    pub(super) hi: u64,
    pub(super) import: I,
    /// Made ahead for this pool and not used by a binding yet.
    pub(super) ahead: Option<PoolId>,
    /// Made ahead for this pool (used or not): a piece of it.
    pub(super) made_for: Option<PoolId>,
    /// Its handle was given to a binding since the embedder last said the handles given out
    /// were done with ([`Importer::handles_done`](super::Importer::handles_done)): a binding may
    /// still need it.
    pub(super) handed: bool,
    /// A merge's import covers it: no binding is served by it any more, and it is released once
    /// no binding needs it (at once where none was given its handle).
    pub(super) replaced: bool,
    /// What made it (debug log of re-imports).
    pub(super) made: Made,
}

/// An import being made off the lock by the background thread.
#[derive(Clone, Copy)]
pub(super) struct Flight {
    pub(super) r: Planned,
    pub(super) since: Instant,
    /// What it was estimated to take.
    pub(super) est: Duration,
}

pub(super) struct State<I> {
    pub(super) pools: Pools,
    /// Live imports by `(lo, sequence)`: they may overlap (a re-import keeps the old ones).
    pub(super) imports: BTreeMap<(u64, u64), Live<I>>,
    pub(super) longest: u64,
    pub(super) seq: u64,
    pub(super) cooling: HashMap<Planned, Instant>,
    pub(super) stats: Stats,
    /// Ranges being imported by the background thread, off the lock.
    pub(super) in_flight: Vec<Flight>,
    /// Ranges whose import ahead failed: not tried ahead again (a binding still tries them).
    pub(super) ahead_failed: HashSet<Planned>,
    /// Pools policy: the regions (chunk-sized, by index) where a binding was made.
    pub(super) hot: HashSet<u64>,
    /// Pools policy: the cost bindings see (the start-up one, its part per MiB raised to what
    /// the bindings' own imports took), and the most a binding imports itself within the wait.
    pub(super) cost: ImportCost,
    pub(super) granule: u64,
    /// What the bindings' imports taught the cost.
    pub(super) learned: Learned,
    /// Counts [`Importer::release_all`] calls: a job asked for before one is not run.
    pub(super) epoch: u64,
    /// The largest binding so far: pieces of a background import overlap by as much.
    pub(super) largest_binding: u64,
    /// Whether the last binding's import met a background import in the driver (its time then
    /// holds the wait for that one: not learned from).
    pub(super) met_in_driver: bool,
}

impl<I> State<I> {
    pub(super) fn new(cost: ImportCost, granule: u64) -> Self {
        State {
            pools: Pools::new(),
            imports: BTreeMap::new(),
            longest: 0,
            seq: 0,
            cooling: HashMap::new(),
            stats: Stats::default(),
            in_flight: Vec::new(),
            ahead_failed: HashSet::new(),
            hot: HashSet::new(),
            cost,
            granule,
            learned: Learned::default(),
            epoch: 0,
            largest_binding: 0,
            met_in_driver: false,
        }
    }

    /// The live imports that overlap `lo..hi`, by key: those starting below `hi` (no further back
    /// than the longest import) and ending above `lo`.
    pub(super) fn overlapping(&self, lo: u64, hi: u64) -> impl Iterator<Item = (&(u64, u64), &Live<I>)> {
        let from = lo.saturating_sub(self.longest);
        self.imports.range((from, 0)..(hi, 0)).filter(move |(_, v)| v.hi > lo)
    }

    /// The key of the largest live import covering `lo..hi`, other than one a merge replaced (a
    /// binding's import that took others in serves the bindings they would have; the merge's
    /// covers whatever a replaced one covers).
    pub(super) fn covering(&self, lo: u64, hi: u64) -> Option<(u64, u64)> {
        let from = lo.saturating_sub(self.longest);
        let covers = self.imports.range((from, 0)..(hi, 0)).filter(|(k, v)| k.0 <= lo && hi <= v.hi && !v.replaced);
        covers.max_by_key(|(k, v)| (v.hi - k.0, k.1)).map(|(k, _)| *k)
    }

    /// Whether every page of `lo..hi` is in a live import (one or several).
    pub(super) fn covered(&self, lo: u64, hi: u64) -> bool {
        let mut at = lo;
        for (k, v) in self.overlapping(lo, hi) {
            if k.0 > at {
                return false;
            }
            at = at.max(v.hi);
        }
        at >= hi
    }

    /// Whether `r` overlaps a range in flight.
    pub(super) fn in_flight_over(&self, r: Planned) -> bool {
        self.in_flight.iter().any(|f| f.r.lo < r.hi && r.lo < f.r.hi)
    }

    /// How long the import in flight that covers `lo..hi` and should land first is still
    /// expected to take; `None` when none covers it, or when none has an estimate left to go
    /// by. One in the driver now (`in_driver`: since when, and its range) has its pages
    /// populated, so what is left of it is its pin at the populated cost; one overdue in the
    /// driver is taken to land at once. One not in the driver yet (populating, or waiting for
    /// its turn) is expected by the estimate it was started with; once overdue it has no
    /// estimate left (a populate slowed by the bindings it steps aside for, say), and a binding
    /// is better off importing its own part than waiting for it.
    pub(super) fn in_flight_left(&self, lo: u64, hi: u64, in_driver: Option<(Instant, Planned)>) -> Option<Duration> {
        let covering = self.in_flight.iter().filter(|f| f.r.covers(lo, hi));
        covering
            .filter_map(|f| match in_driver {
                Some((since, r)) if r == f.r => Some(self.cost.pin(f.r.len()).saturating_sub(since.elapsed())),
                _ => Some(f.est.saturating_sub(f.since.elapsed())).filter(|left| !left.is_zero()),
            })
            .min()
    }

    pub(super) fn overlaps(&self, lo: u64, hi: u64) -> bool {
        self.overlapping(lo, hi).next().is_some()
    }

    /// Whether `lo..hi` overlaps a live import that a binding made or used (not one made ahead
    /// and unused: importing over that is not a re-import), other than a piece made ahead for
    /// `pool`.
    pub(super) fn overlaps_used(&self, lo: u64, hi: u64, pool: Option<PoolId>) -> bool {
        self.overlapping(lo, hi).any(|(_, v)| v.ahead.is_none() && (pool.is_none() || v.made_for != pool))
    }

    /// The keys of the live imports made ahead, unused, and inside `lo..hi`.
    pub(super) fn unused_inside(&self, lo: u64, hi: u64) -> Vec<(u64, u64)> {
        let inside = self.overlapping(lo, hi).filter(|(k, v)| lo <= k.0 && v.hi <= hi);
        inside.filter(|(_, v)| v.ahead.is_some()).map(|(k, _)| *k).collect()
    }

    /// `lo..hi` grown over every live import it overlaps, again until nothing more overlaps, and
    /// the keys of those imports.
    pub(super) fn union(&self, mut lo: u64, mut hi: u64) -> (u64, u64, Vec<(u64, u64)>) {
        loop {
            let keys: Vec<(u64, u64)> =
                self.imports.iter().filter(|(k, v)| k.0 < hi && v.hi > lo).map(|(k, _)| *k).collect();
            let (nlo, nhi) = keys.iter().fold((lo, hi), |(a, b), k| (a.min(k.0), b.max(self.imports[k].hi)));
            if (nlo, nhi) == (lo, hi) {
                return (lo, hi, keys);
            }
            (lo, hi) = (nlo, nhi);
        }
    }
}

/// What made an import.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Made {
    /// A binding, on its thread (over pages a binding imported before: a re-import).
    Binding { reimport: bool },
    /// The background thread, ahead of this pool's bindings.
    Ahead(PoolId),
    /// The background thread, a pool whole over a binding's part of it.
    Widen,
    /// The background thread, a pool whole (or a slice of it) over the live imports that held
    /// all its pages between them (module `ahead`).
    Merge,
}

/// An import's log line, kept until the importer's lock is released: writing it can take a while
/// (a terminal, a full pipe), and bindings wait for the lock.
struct MadeLine {
    r: Planned,
    took: Duration,
    what: &'static str,
    /// The running totals after it.
    imports: u64,
    time: Duration,
}

thread_local! {
    /// The imports this thread recorded under the lock and has not logged yet.
    static UNLOGGED: std::cell::RefCell<Vec<MadeLine>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Logs (at debug) the imports this thread recorded since it last called this: called where the
/// thread does not hold the importer's lock.
pub(super) fn log_made() {
    for l in UNLOGGED.with_borrow_mut(std::mem::take) {
        tracing::debug!(
            "import {} ({}) in {:.2} ms{} ({} imports, {:.0} ms in all)",
            l.r,
            size(l.r.len()),
            l.took.as_secs_f64() * 1e3,
            l.what,
            l.imports,
            l.time.as_secs_f64() * 1e3
        );
    }
}

/// A size for a log line: KiB under 1 MiB, else MiB (one decimal where it is not whole).
fn size(bytes: u64) -> String {
    const MIB: u64 = 1 << 20;
    match bytes {
        b if b < MIB => format!("{} KiB", b >> 10),
        b if b % MIB == 0 => format!("{} MiB", b / MIB),
        b => format!("{:.1} MiB", b as f64 / MIB as f64),
    }
}

impl<B: Backend> Core<B> {
    /// Records a new live import of `r`, its figures and its log line (written by [`log_made`]).
    pub(super) fn record(&self, st: &mut State<B::Import>, r: Planned, import: B::Import, took: Duration, made: Made) {
        st.seq += 1;
        let seq = st.seq;
        let ahead = match made {
            Made::Ahead(id) => Some(id),
            _ => None,
        };
        // A binding's own import is given to it at once.
        let handed = matches!(made, Made::Binding { .. });
        let live = Live { hi: r.hi, import, ahead, made_for: ahead, handed, replaced: false, made };
        st.imports.insert((r.lo, seq), live);
        st.longest = st.longest.max(r.len());
        let s = &mut st.stats;
        s.imports += 1;
        s.time += took;
        s.times.push(took);
        s.live += 1;
        s.live_bytes += r.len();
        s.peak_live = s.peak_live.max(s.live);
        s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
        let what = match made {
            Made::Binding { reimport: false } => "",
            Made::Binding { reimport: true } => ", again over pages imported before",
            Made::Ahead(_) => " ahead",
            Made::Widen => " whole, over a binding's part of it",
            Made::Merge => " whole, merging the live imports that held it",
        };
        match made {
            Made::Binding { reimport } => s.reimports += u64::from(reimport),
            Made::Ahead(_) | Made::Widen => {
                s.ahead_imports += 1;
                s.ahead_time += took;
                s.widenings += u64::from(made == Made::Widen);
            }
            Made::Merge => s.merges += 1,
        }
        // Logged once the lock is released ([`log_made`]): a slow stderr must not hold bindings.
        if tracing::enabled!(tracing::Level::DEBUG) {
            let line = MadeLine { r, took, what, imports: s.imports, time: s.time };
            UNLOGGED.with_borrow_mut(|v| v.push(line));
        }
        if made != Made::Merge {
            self.want_merges(st, r);
        }
    }

    /// Takes the live import `k` out of the state, used or not, for the caller to release
    /// (off the lock where it can: a driver's release of a large import takes a while, and
    /// bindings wait for the lock).
    pub(super) fn take_out(&self, st: &mut State<B::Import>, k: (u64, u64)) -> Option<B::Import> {
        let old = st.imports.remove(&k)?;
        let len = old.hi - k.0;
        let s = &mut st.stats;
        s.live -= 1;
        s.live_bytes -= len;
        if old.ahead.is_some() {
            s.ahead_bytes -= len;
            s.ahead_released += 1;
        }
        Some(old.import)
    }

    /// Releases the live import `k`, made ahead and never used, under the lock.
    pub(super) fn release_unused(&self, st: &mut State<B::Import>, k: (u64, u64)) {
        if let Some(import) = self.take_out(st, k) {
            self.release(import);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_sizes_under_a_mib_are_in_kib() {
        assert_eq!(size(4096), "4 KiB");
        assert_eq!(size(768 << 10), "768 KiB");
        assert_eq!(size(1 << 20), "1 MiB");
        assert_eq!(size(3 << 19), "1.5 MiB");
    }

    /// A binding may use a pool's piece before the next piece (which overlaps it) is checked:
    /// that piece is still made, while an import a binding made, or one made ahead for another
    /// pool and used, keeps a pool's import ahead off those pages.
    #[test]
    fn a_used_piece_of_the_same_pool_does_not_stop_its_next_piece() {
        let mut st: State<()> = State::new(ImportCost::default(), 4096);
        let (p, q) = (Some(PoolId(1)), Some(PoolId(2)));
        let mut live = |lo: u64, hi: u64, made_for| {
            st.seq += 1;
            let v = Live { hi, import: (), ahead: None, made_for, handed: true, replaced: false, made: Made::Widen };
            st.imports.insert((lo, st.seq), v);
            st.longest = st.longest.max(hi - lo);
        };
        live(0, 100, p);
        live(200, 300, q);
        live(400, 500, None);
        assert!(!st.overlaps_used(50, 150, p), "a used piece of the same pool");
        assert!(st.overlaps_used(50, 150, q) && st.overlaps_used(50, 150, None));
        assert!(st.overlaps_used(250, 350, p), "a used import ahead of another pool");
        assert!(st.overlaps_used(450, 550, p), "a binding's own import");
        assert!(!st.overlaps_used(150, 200, p) && st.covered(0, 100) && !st.covered(50, 250));
    }
}
