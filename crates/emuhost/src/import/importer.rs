//! The importer: pools, live imports, the retry without the span, cooling, figures and the log.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::backend::{Backend, GpuHandle, HostSpan};
use super::cost::ImportCost;
use super::plan::{PlanConfig, Planned, binding_cover, cover, piece, plan, pool_range};
use super::pools::{PoolId, Pools};
use super::{ImportError, switch_bytes, switch_u64};
use crate::space::{LongRead, Prot, Space, page_size};

/// The default time a range that failed to import is held before it is tried again.
pub const DEFAULT_COOLING: Duration = Duration::from_secs(1);
/// The default longest time a binding should wait for an import under the pools policy.
pub const DEFAULT_WAIT: Duration = Duration::from_micros(400);
/// The background thread populates what it imports this much at a time.
const POPULATE_SLICE: u64 = 256 << 10;
/// The default budget of bytes imported ahead and not yet bound: 256 MiB.
pub const DEFAULT_AHEAD: u64 = 256 << 20;
/// The pools policy's default piece of a background import (`EMUHOST_IMPORT_AHEAD_PIECE_KB`):
/// 4 MiB. NVIDIA's driver serializes imports, so a binding that imports while a background
/// import is in the driver waits for it: about 0.17 ms/MiB of populated pages on the H200, 1.3
/// ms for a 7 MiB pool. On the H200 the worst wait of 7 replays in 4 MiB pieces was 0.53–0.73
/// ms, against 0.65–2.61 ms with pools whole; 1 MiB pieces doubled the time waiting for imports
/// (docs/import.md, "Background imports in pieces", "4 MiB pieces by default").
pub const DEFAULT_AHEAD_PIECE: u64 = 4 << 20;
/// A widening asked this long ago is taken before smaller ones ([`AheadQueue::pop`]); in the
/// H200's load burst the longest queued about 50 ms.
const WIDEN_OLDEST: Duration = Duration::from_millis(250);
/// The least overlap of two pieces of a background import, before any binding was seen.
const LEAST_OVERLAP: u64 = 64 << 10;

/// Which ranges bindings import.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ImportPolicy {
    /// The pools a binding lies in, exactly (at the backend's alignment), imported ahead of
    /// their first binding where bindings were seen nearby; a binding whose pool would take
    /// longer than the wait target imports only its part and the rest follows off its thread.
    #[default]
    Pools,
    /// The seed's: 16 MiB chunks at the first binding, grown over the pools across their ends
    /// ([`PlanConfig`]), all on the binding thread.
    Chunks,
}

/// How the importer works: [`ImportConfig::default`], then the chained setters (or assign the
/// fields of a value you hold; the struct is `#[non_exhaustive]`, so fields can be added).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportConfig {
    pub plan: PlanConfig,
    /// How long a range that failed is held before it is tried again (0: not held).
    pub cooling: Duration,
    /// Fault pages in (`Space::populate`) on a background thread when a pool is registered, so
    /// that the import at binding time pays for pinning only.
    pub populate_ahead: PopulateAhead,
    /// Commit the reserved (never committed, or decommitted) pages of the range read-write before
    /// importing it, so that gaps between pools inside a chunk are importable
    /// ([`Space::commit_reserved`]). Pages the guest committed keep their bytes and their
    /// protection (`r--` and `---` pages stay so; a driver that cannot pin them fails the import).
    pub commit: bool,
    /// Which ranges bindings import (`EMUHOST_IMPORT_POLICY`).
    pub policy: ImportPolicy,
    /// Pools policy: import ahead (`EMUHOST_IMPORT_AHEAD_MB`, in bytes here; 0: off). A pool
    /// made in a chunk-sized region where a binding was made, and the pools of a region when its
    /// first binding comes, are imported (populated first) on a background thread, so that their
    /// bindings find them ready. At most this many bytes are imported ahead and not yet used by
    /// a binding (in flight included); past it a pool is left to its bindings.
    pub ahead: u64,
    /// Pools policy: the longest a binding should wait (`EMUHOST_IMPORT_WAIT_US`). A binding
    /// whose pool's import is estimated to take longer (from which of its pages are resident)
    /// imports only its part (in the largest power-of-two granule within this time) and leaves
    /// the pool to the background thread; one whose import is in flight waits for it only if it
    /// should land sooner than that part.
    pub wait: Duration,
    /// Pools policy: what an import costs; `None` measures it when the importer is made
    /// ([`ImportCost::measure`]) and then learns from the bindings' imports (the 90th percentile
    /// of their recent times per MiB, untouched and resident pages apart); a cost given is used
    /// as it is.
    pub cost: Option<ImportCost>,
    /// Pools policy: background import threads (`EMUHOST_IMPORT_AHEAD_THREADS`); 0: a quarter
    /// of the processors, one to four.
    pub ahead_threads: u32,
    /// Pools policy: the longest range a background thread imports at once
    /// (`EMUHOST_IMPORT_AHEAD_PIECE_KB`, in bytes here; [`DEFAULT_AHEAD_PIECE`] by default; 0: a
    /// pool whole). A larger pool is imported in pieces of this size, each reaching on over the
    /// next by the largest binding seen (at least 64 KiB, at most a piece), so that a binding
    /// there fits in one of them: a binding's import, and a change of the space's mappings, then
    /// wait for one piece's pin at most, not a whole pool's. Where the backend refuses a page in
    /// two imports (CUDA), pools are imported whole.
    pub ahead_piece: u64,
}

impl Default for ImportConfig {
    fn default() -> Self {
        Self {
            plan: PlanConfig::default(),
            cooling: DEFAULT_COOLING,
            populate_ahead: PopulateAhead::Off,
            commit: true,
            policy: ImportPolicy::Pools,
            ahead: DEFAULT_AHEAD,
            wait: DEFAULT_WAIT,
            cost: None,
            ahead_threads: 0,
            ahead_piece: DEFAULT_AHEAD_PIECE,
        }
    }
}

impl ImportConfig {
    /// Sets [`ImportConfig::plan`].
    pub fn plan(mut self, plan: PlanConfig) -> Self {
        self.plan = plan;
        self
    }

    /// Sets [`ImportConfig::cooling`].
    pub fn cooling(mut self, cooling: Duration) -> Self {
        self.cooling = cooling;
        self
    }

    /// Sets [`ImportConfig::populate_ahead`].
    pub fn populate_ahead(mut self, populate_ahead: PopulateAhead) -> Self {
        self.populate_ahead = populate_ahead;
        self
    }

    /// Sets [`ImportConfig::commit`].
    pub fn commit(mut self, commit: bool) -> Self {
        self.commit = commit;
        self
    }

    /// Sets [`ImportConfig::ahead`].
    pub fn ahead(mut self, ahead: u64) -> Self {
        self.ahead = ahead;
        self
    }

    /// Sets [`ImportConfig::policy`].
    pub fn policy(mut self, policy: ImportPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets [`ImportConfig::wait`].
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets [`ImportConfig::ahead_threads`].
    pub fn ahead_threads(mut self, threads: u32) -> Self {
        self.ahead_threads = threads;
        self
    }

    /// Sets [`ImportConfig::ahead_piece`].
    pub fn ahead_piece(mut self, piece: u64) -> Self {
        self.ahead_piece = piece;
        self
    }

    /// Sets [`ImportConfig::cost`].
    pub fn cost(mut self, cost: Option<ImportCost>) -> Self {
        self.cost = cost;
        self
    }

    /// The switches this config takes.
    pub const SWITCHES: [&str; 10] = [
        "EMUHOST_IMPORT_POLICY",
        "EMUHOST_IMPORT_CHUNK_MB",
        "EMUHOST_IMPORT_SPAN_MB",
        "EMUHOST_IMPORT_COOLING_MS",
        "EMUHOST_IMPORT_POPULATE_AHEAD",
        "EMUHOST_IMPORT_AHEAD_MB",
        "EMUHOST_IMPORT_WAIT_US",
        "EMUHOST_IMPORT_AHEAD_THREADS",
        "EMUHOST_IMPORT_AHEAD_PIECE_KB",
        "EMUHOST_IMPORT_COST_US",
    ];

    /// The config [`Settings`](crate::settings::Settings) gives.
    pub fn from_settings(settings: &crate::settings::Settings) -> Self {
        settings.import
    }

    /// The defaults, changed by [`Self::SWITCHES`] with their values from `get` (`None`: unset).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ImportError> {
        let mut c = Self::default();
        for name in Self::SWITCHES {
            if let Some(v) = get(name) {
                c.set(name, &v)?;
            }
        }
        Ok(c)
    }

    /// Sets one of [`Self::SWITCHES`] to `value` (empty: its default); a bad value is an error
    /// naming both. (Long: one arm a switch, each that switch's whole parse.)
    pub fn set(&mut self, name: &'static str, value: &str) -> Result<(), ImportError> {
        let d = Self::default();
        let get = || Some(value.to_string());
        match name {
            "EMUHOST_IMPORT_CHUNK_MB" => {
                self.plan.chunk = d.plan.chunk;
                if let Some(mb) = switch_u64(name, get())? {
                    let bad = |why| ImportError::BadSwitch { name, value: mb.to_string(), why };
                    let bytes = mb.checked_mul(1 << 20).ok_or_else(|| bad("too large: past 2^64 bytes"))?;
                    self.plan.chunk = Some(bytes)
                        .filter(|b| b.is_power_of_two())
                        .ok_or_else(|| bad("a power of two of MiB is needed"))?;
                }
            }
            "EMUHOST_IMPORT_SPAN_MB" => {
                self.plan.span_cap = switch_bytes(name, get(), 1 << 20)?.unwrap_or(d.plan.span_cap);
            }
            "EMUHOST_IMPORT_COOLING_MS" => {
                self.cooling = switch_u64(name, get())?.map_or(d.cooling, Duration::from_millis);
            }
            "EMUHOST_IMPORT_AHEAD_THREADS" => {
                self.ahead_threads = match switch_u64(name, get())? {
                    None => d.ahead_threads,
                    Some(n) => u32::try_from(n).ok().filter(|&n| n <= 64).ok_or_else(|| ImportError::BadSwitch {
                        name,
                        value: n.to_string(),
                        why: "at most 64",
                    })?,
                };
            }
            "EMUHOST_IMPORT_AHEAD_PIECE_KB" => {
                self.ahead_piece = switch_bytes(name, get(), 1 << 10)?.unwrap_or(d.ahead_piece);
            }
            "EMUHOST_IMPORT_WAIT_US" => {
                self.wait = switch_u64(name, get())?.map_or(d.wait, Duration::from_micros);
            }
            "EMUHOST_IMPORT_COST_US" => {
                self.cost = if value.trim().is_empty() { d.cost } else { Some(ImportCost::from_switch(name, value)?) };
            }
            "EMUHOST_IMPORT_POLICY" => {
                self.policy = match value.trim().to_ascii_lowercase().as_str() {
                    "" => d.policy,
                    "pools" => ImportPolicy::Pools,
                    "chunks" | "seed" => ImportPolicy::Chunks,
                    _ => {
                        return Err(ImportError::BadSwitch {
                            name,
                            value: value.to_string(),
                            why: "expected pools or chunks",
                        });
                    }
                };
            }
            "EMUHOST_IMPORT_AHEAD_MB" => {
                self.ahead = switch_bytes(name, get(), 1 << 20)?.unwrap_or(d.ahead);
            }
            "EMUHOST_IMPORT_POPULATE_AHEAD" => {
                self.populate_ahead = match crate::settings::on_off(value) {
                    Some(false) => PopulateAhead::Off,
                    Some(true) => PopulateAhead::Pools,
                    None => match value.trim().to_ascii_lowercase().as_str() {
                        "pools" => PopulateAhead::Pools,
                        "chunks" => PopulateAhead::Chunks,
                        _ => {
                            return Err(ImportError::BadSwitch {
                                name,
                                value: value.to_string(),
                                why: "expected off, pools (or on) or chunks",
                            });
                        }
                    },
                };
            }
            _ => return Err(ImportError::BadSwitch { name, value: value.to_string(), why: "not an import switch" }),
        }
        Ok(())
    }
}

/// What is populated ahead when a pool is registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PopulateAhead {
    /// Nothing: an import faults in what was never touched.
    #[default]
    Off,
    /// The pool's own pages (they must be committed writable; a failure is counted).
    Pools,
    /// The chunks the pool touches, committed read-write first: everything an import of them
    /// would pin, gaps between pools included. Costs resident memory for every chunk any pool
    /// touches, bound or not.
    Chunks,
}

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
    pub times: Vec<Duration>,
    /// Live imports and their bytes now, and the most bytes live at once.
    pub live: u64,
    pub live_bytes: u64,
    pub peak_live_bytes: u64,
    /// Pools populated ahead, populates that failed, and their bytes.
    pub populated: u64,
    pub populate_failures: u64,
    pub populated_bytes: u64,
    /// Bindings that did not find their import ready (they imported, or waited for an import
    /// in flight, or both), and of those the ones that waited for an import made ahead.
    pub waits: u64,
    pub in_flight_waits: u64,
    /// The binding thread's time waiting for imports, whoever made them: from the call to
    /// [`Importer::bind`] to its return, for each binding counted in `waits`. All together and
    /// the longest.
    pub wait_time: Duration,
    pub wait_worst: Duration,
    /// Imports made ahead (also in `imports`, `time` and `times`) and their time.
    pub ahead_imports: u64,
    pub ahead_time: Duration,
    /// Imports ahead that failed (a spanned one is then tried without the span); they hold
    /// nothing cooling: a binding makes its own attempt.
    pub ahead_failures: u64,
    /// Pools left to their bindings because the budget of bytes ahead was full.
    pub ahead_over_budget: u64,
    /// Bindings served by an import made ahead (its first use).
    pub ahead_hits: u64,
    /// Imports made ahead and released unused: their pool was released, or a larger import took
    /// them in.
    pub ahead_released: u64,
    /// Bytes imported ahead (or in flight) and not used by a binding yet, now and at most.
    pub ahead_bytes: u64,
    pub ahead_peak_bytes: u64,
}

impl Stats {
    /// The slowest single import.
    pub fn worst(&self) -> Duration {
        self.times.iter().copied().max().unwrap_or_default()
    }

    fn waited(&mut self, took: Duration) {
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
    pub range: Planned,
    pub made: bool,
    /// The range was the spanned one.
    pub spanned: bool,
    /// The import's device memory (and buffer) or device pointer, raw: valid while the import
    /// lives ([`GpuHandle`]).
    pub handle: GpuHandle,
    /// Where the binding's first byte lies in the import's memory (and buffer): the binding's
    /// address less the import's start. (The import may start below `range.lo` where a backend
    /// that refuses overlaps took other imports in.)
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

struct Live<I> {
    hi: u64,
    import: I,
    /// Made ahead for this pool and not used by a binding yet.
    ahead: Option<PoolId>,
    /// Made ahead for this pool (used or not): a piece of it.
    made_for: Option<PoolId>,
}

/// The least of a binding's import's untouched (or resident) bytes that [`Core::learn`] learns
/// a time per MiB from: below it the fixed part's noise outweighs the pages.
const LEAST_SAMPLE: u64 = 32 << 10;

/// The last [`Recent::N`] values of a measure, for their 90th percentile.
#[derive(Default)]
struct Recent {
    v: [f64; Recent::N],
    n: usize,
    next: usize,
}

impl Recent {
    const N: usize = 32;

    fn push(&mut self, x: f64) {
        self.v[self.next] = x;
        self.next = (self.next + 1) % Self::N;
        self.n = (self.n + 1).min(Self::N);
    }

    /// The 90th percentile (nearest rank) of the values kept; 0 where there are none.
    fn p90(&self) -> f64 {
        let mut v = self.v;
        let v = &mut v[..self.n];
        v.sort_unstable_by(f64::total_cmp);
        let rank = (self.n * 9).div_ceil(10);
        v.get(rank.saturating_sub(1)).copied().unwrap_or(0.0)
    }
}

/// A binding's own part of its pools (pools policy), sized by [`Core::size_part`].
struct Part {
    r: Planned,
    /// What its import is estimated to take.
    est: Duration,
    /// The range whose pages' residency was read, and one entry per page (none: not read).
    seen: Planned,
    pages: Vec<bool>,
}

impl Part {
    /// `r`, with every page taken as untouched.
    fn untouched(cost: &ImportCost, r: Planned) -> Part {
        Part { r, est: cost.estimate(r.len()), seen: r, pages: Vec::new() }
    }

    /// The resident bytes of `r`, where it lies inside the range read.
    fn resident_in(&self, r: Planned) -> Option<u64> {
        if self.pages.is_empty() || r.lo < self.seen.lo || r.hi > self.seen.hi {
            return None;
        }
        let page = page_size();
        let (a, b) = ((r.lo - self.seen.lo) / page, (r.hi - self.seen.lo).div_ceil(page));
        let pages = self.pages.get(a as usize..b as usize)?;
        Some((pages.iter().filter(|&&p| p).count() as u64 * page).min(r.len()))
    }
}

/// A binding at work on its import (sizing its part, holding its span, in the backend): while
/// one lives, the background threads begin no populate slice, commit or driver import
/// ([`Core::step_aside`]). Counted in and out by its life, so a panic in a backend call does not
/// leave the background threads waiting for good.
struct AtWork<'a>(&'a AtomicU64);

impl<'a> AtWork<'a> {
    fn new(count: &'a AtomicU64) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        AtWork(count)
    }
}

impl Drop for AtWork<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How long a binding waited for an import in flight, and whether it gave up (debug log).
#[derive(Default)]
struct FlightWait {
    /// The binding's own part, its estimate and resident bytes (pools policy).
    part: Option<(Planned, Duration, Option<u64>)>,
    /// The time to size the part (its `mincore`, under the importer's lock).
    sized: Duration,
    phase: String,
    waited: Option<Duration>,
    timed_out: bool,
}

/// An import being made off the lock by the background thread.
#[derive(Clone, Copy)]
struct Flight {
    r: Planned,
    since: Instant,
    /// What it was estimated to take.
    est: Duration,
}

struct State<I> {
    pools: Pools,
    /// Live imports by `(lo, sequence)`: they may overlap (a re-import keeps the old ones).
    imports: BTreeMap<(u64, u64), Live<I>>,
    longest: u64,
    seq: u64,
    cooling: HashMap<Planned, Instant>,
    stats: Stats,
    /// Ranges being imported by the background thread, off the lock.
    in_flight: Vec<Flight>,
    /// Ranges whose import ahead failed: not tried ahead again (a binding still tries them).
    ahead_failed: HashSet<Planned>,
    /// Pools policy: the regions (chunk-sized, by index) where a binding was made.
    hot: HashSet<u64>,
    /// Pools policy: the cost bindings see (the start-up one, its part per MiB raised to what
    /// the bindings' own imports took), and the most a binding imports itself within the wait.
    cost: ImportCost,
    granule: u64,
    /// The bindings' imports' recent times per MiB of untouched and of resident pages past the
    /// fixed part, in ms.
    learned: (Recent, Recent),
    /// Counts [`Importer::release_all`] calls: a job asked for before one is not run.
    epoch: u64,
    /// The largest binding so far: pieces of a background import overlap by as much.
    largest_binding: u64,
}

impl<I> State<I> {
    fn new(cost: ImportCost, granule: u64) -> Self {
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
            learned: (Recent::default(), Recent::default()),
            epoch: 0,
            largest_binding: 0,
        }
    }

    /// The live imports that overlap `lo..hi`, by key: those starting below `hi` (no further back
    /// than the longest import) and ending above `lo`.
    fn overlapping(&self, lo: u64, hi: u64) -> impl Iterator<Item = (&(u64, u64), &Live<I>)> {
        let from = lo.saturating_sub(self.longest);
        self.imports.range((from, 0)..(hi, 0)).filter(move |(_, v)| v.hi > lo)
    }

    /// The key of a live import covering `lo..hi`.
    fn covering(&self, lo: u64, hi: u64) -> Option<(u64, u64)> {
        let from = lo.saturating_sub(self.longest);
        self.imports.range((from, 0)..(hi, 0)).find(|(k, v)| k.0 <= lo && hi <= v.hi).map(|(k, _)| *k)
    }

    /// Whether every page of `lo..hi` is in a live import (one or several).
    fn covered(&self, lo: u64, hi: u64) -> bool {
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
    fn in_flight_over(&self, r: Planned) -> bool {
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
    fn in_flight_left(&self, lo: u64, hi: u64, in_driver: Option<(Instant, Planned)>) -> Option<Duration> {
        let covering = self.in_flight.iter().filter(|f| f.r.covers(lo, hi));
        covering
            .filter_map(|f| match in_driver {
                Some((since, r)) if r == f.r => Some(self.cost.pin(f.r.len()).saturating_sub(since.elapsed())),
                _ => Some(f.est.saturating_sub(f.since.elapsed())).filter(|left| !left.is_zero()),
            })
            .min()
    }

    fn overlaps(&self, lo: u64, hi: u64) -> bool {
        self.overlapping(lo, hi).next().is_some()
    }

    /// Whether `lo..hi` overlaps a live import that a binding made or used (not one made ahead
    /// and unused: importing over that is not a re-import), other than a piece made ahead for
    /// `pool`.
    fn overlaps_used(&self, lo: u64, hi: u64, pool: Option<PoolId>) -> bool {
        self.overlapping(lo, hi).any(|(_, v)| v.ahead.is_none() && (pool.is_none() || v.made_for != pool))
    }

    /// The keys of the live imports made ahead, unused, and inside `lo..hi`.
    fn unused_inside(&self, lo: u64, hi: u64) -> Vec<(u64, u64)> {
        let inside = self.overlapping(lo, hi).filter(|(k, v)| lo <= k.0 && v.hi <= hi);
        inside.filter(|(_, v)| v.ahead.is_some()).map(|(k, _)| *k).collect()
    }

    /// `lo..hi` grown over every live import it overlaps, again until nothing more overlaps, and
    /// the keys of those imports.
    fn union(&self, mut lo: u64, mut hi: u64) -> (u64, u64, Vec<(u64, u64)>) {
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

#[derive(Default)]
struct PopulateCounts {
    done: AtomicU64,
    failed: AtomicU64,
    bytes: AtomicU64,
}

/// What the background import thread is asked, each in the epoch it was asked in.
enum AheadJob {
    /// Import this pool whole, ahead of its bindings (if it is still registered).
    Pool(PoolId, u64),
    /// Import this range whole: a pool a binding imported only part of.
    Widen(Planned, u64),
    /// Populate `lo..hi` (`EMUHOST_IMPORT_POPULATE_AHEAD`), its reserved pages committed
    /// read-write first where `commit` (the chunks of a pool, gaps included).
    Populate { lo: u64, hi: u64, commit: bool },
}

/// The background import threads' work: asked for and not started, running, and whether the
/// threads are to stop.
#[derive(Default)]
struct AheadQueue {
    /// Widenings, each with when it was asked.
    widen: VecDeque<(Planned, u64, Instant)>,
    pools: VecDeque<(PoolId, u64)>,
    /// Populates asked for, after every import; and the chunks asked for once already.
    populate: VecDeque<(u64, u64, bool)>,
    populate_chunks: HashSet<u64>,
    running: usize,
    closed: bool,
}

impl AheadQueue {
    /// The next job at `now`: widenings first (a binding's pool, certain to be used), the
    /// smallest first, then pools ahead, then populates, each in the order asked. Smallest first:
    /// in the load burst widenings queue for tens of milliseconds, and every binding across a
    /// part's border before its pool's widening lands imports pages again; the small ones land
    /// soonest, so the most pools are whole soonest (a binding is as likely in a small pool as in
    /// a large one). A widening asked [`WIDEN_OLDEST`] ago or more goes first, so a stream of
    /// small ones cannot hold a large one back for good.
    fn pop(&mut self, now: Instant) -> Option<AheadJob> {
        let overdue = self.widen.front().is_some_and(|w| now.saturating_duration_since(w.2) >= WIDEN_OLDEST);
        let next = if overdue {
            Some(0)
        } else {
            self.widen.iter().enumerate().min_by_key(|(_, w)| w.0.len()).map(|(i, _)| i)
        };
        (next.and_then(|i| self.widen.remove(i)).map(|(r, e, _)| AheadJob::Widen(r, e)))
            .or_else(|| self.pools.pop_front().map(|(id, e)| AheadJob::Pool(id, e)))
            .or_else(|| self.populate.pop_front().map(|(lo, hi, commit)| AheadJob::Populate { lo, hi, commit }))
    }

    fn is_empty(&self) -> bool {
        self.widen.is_empty() && self.pools.is_empty() && self.populate.is_empty()
    }

    /// A job has run: tells [`Importer::settle`] when none is left.
    fn done_one(&mut self, idle: &Condvar) {
        self.running -= 1;
        if self.running == 0 && self.is_empty() {
            idle.notify_all();
        }
    }
}

/// What the importer and its background import thread share.
struct Core<B: Backend> {
    space: Arc<Space>,
    backend: B,
    cfg: ImportConfig,
    /// The backend's alignment (at least a host page).
    align: u64,
    /// Pools policy: the import cost measured at start or given.
    cost: ImportCost,
    state: Mutex<State<B::Import>>,
    /// Signalled each time an import in flight lands (made or failed).
    landed: Condvar,
    /// Set when the importer is dropped: the thread stops before its next import.
    stopping: AtomicBool,
    /// Bindings at their import now ([`AtWork`]): the background threads' populates, commits and
    /// imports step aside for them.
    binding_imports: AtomicU64,
    /// Held by a background thread while it is in the driver.
    driver_turn: Mutex<()>,
    /// When the background import in the driver now entered it, and its range: a binding it
    /// covers waits for it by what is left of its pin, and a binding's slow import says whether
    /// it met one (debug log).
    in_driver: Mutex<Option<(Instant, Planned)>>,
    /// Releases under way (any thread): a binding's slow import says whether it met one.
    releasing: AtomicU64,
    /// Populates ahead made (`EMUHOST_IMPORT_POPULATE_AHEAD`), failed, and their bytes.
    populate_counts: PopulateCounts,
    /// The background threads' work; `queued` wakes a thread for it, `idle` tells
    /// [`Importer::settle`] that none is left.
    queue: Mutex<AheadQueue>,
    queued: Condvar,
    idle: Condvar,
}

/// Guest memory imported into a backend: by pools ([`ImportPolicy::Pools`], imported ahead on a
/// background thread where bindings are expected) or by chunks at the first binding inside each
/// ([`ImportPolicy::Chunks`]).
pub struct Importer<B: Backend + 'static> {
    core: Arc<Core<B>>,
    /// The background threads: imports ahead (pools policy) and populates ahead (either).
    ahead: Vec<JoinHandle<()>>,
}

impl<B: Backend + 'static> std::fmt::Debug for Importer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Importer").field("backend", &self.core.backend.describe()).field("cfg", &self.core.cfg).finish()
    }
}

impl<B: Backend + 'static> Importer<B> {
    /// An importer of `space`'s memory into `backend`. Under the pools policy without a cost
    /// given, the backend's import cost is measured first ([`ImportCost::measure`]).
    ///
    /// A chunk larger than the space's window, or under the chunks policy than the backend's
    /// largest import, is refused ([`ImportError::ChunkTooLarge`]): no binding could import.
    /// (Long: the checks, the cost, the state and the threads, in the order each needs the one
    /// before.)
    pub fn new(space: Arc<Space>, backend: B, cfg: ImportConfig) -> Result<Self, ImportError> {
        let align = backend.alignment().max(page_size());
        cfg.plan.check(align)?;
        let chunk = cfg.plan.chunk;
        let max = backend.budget().get();
        for (what, limit) in [
            ("the guest window", space.window()),
            ("the backend's largest single import", max.max_single),
            ("the backend's live imported bytes", max.max_bytes),
        ] {
            // Under the pools policy the chunk is only a region's size: the backend's limits do
            // not bear on it, but one past the window is still a mistake.
            let applies = cfg.policy == ImportPolicy::Chunks || what == "the guest window";
            if chunk > limit && applies {
                return Err(ImportError::ChunkTooLarge { chunk, what, limit });
            }
        }
        let cost = match (cfg.policy, cfg.cost) {
            (ImportPolicy::Chunks, _) => ImportCost::default(),
            (ImportPolicy::Pools, Some(c)) => c,
            (ImportPolicy::Pools, None) => crate::faults::unfaulted(|| ImportCost::measure(&backend))?,
        };
        let granule = cost.granule(cfg.wait, align);
        if cfg.policy == ImportPolicy::Pools {
            tracing::info!(
                "import cost on {}: {cost}; a binding imports at most {} KiB itself",
                backend.kind().name(),
                granule >> 10
            );
        }
        let os = |op| move |source| ImportError::Os { op, addr: 0, len: 0, source };
        let state = State::new(cost, granule);
        let core = Arc::new(Core {
            space,
            backend,
            cfg,
            align,
            cost,
            state: Mutex::new(state),
            landed: Condvar::new(),
            stopping: AtomicBool::new(false),
            binding_imports: AtomicU64::new(0),
            driver_turn: Mutex::new(()),
            in_driver: Mutex::new(None),
            releasing: AtomicU64::new(0),
            populate_counts: PopulateCounts::default(),
            queue: Mutex::new(AheadQueue::default()),
            queued: Condvar::new(),
            idle: Condvar::new(),
        });
        // A quarter of the processors, one to four: enough to keep ahead of a burst of pools
        // where bindings start (they are independent ranges), not so many that their populates
        // crowd out the game's threads. Under the chunks policy, one for populates ahead.
        let threads = match cfg.policy {
            ImportPolicy::Pools if cfg.ahead_threads > 0 => cfg.ahead_threads as usize,
            ImportPolicy::Pools => std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).clamp(1, 4)),
            ImportPolicy::Chunks => usize::from(cfg.populate_ahead != PopulateAhead::Off),
        };
        let mut ahead = Vec::new();
        for i in 0..threads {
            let c = core.clone();
            let spawned =
                std::thread::Builder::new().name(format!("emuhost-import-ahead-{i}")).spawn(move || c.run_ahead());
            match spawned {
                Ok(t) => ahead.push(t),
                Err(e) => {
                    core.close_queue(&mut ahead);
                    return Err(os("start an import-ahead thread")(e));
                }
            }
        }
        Ok(Self { core, ahead })
    }

    pub fn backend(&self) -> &B {
        &self.core.backend
    }

    pub fn config(&self) -> ImportConfig {
        self.core.cfg
    }

    /// The import cost the pools policy works with now (zero under the chunks policy): the one
    /// given, or the one measured at start with each part per MiB raised to what the bindings'
    /// slow imports took (the 90th percentile of their recent times).
    pub fn cost(&self) -> ImportCost {
        self.state().cost
    }

    /// Pools policy: the most bytes (a power of two) a binding imports itself, now.
    pub fn granule(&self) -> u64 {
        self.state().granule
    }

    pub fn space(&self) -> &Arc<Space> {
        &self.core.space
    }

    fn state(&self) -> MutexGuard<'_, State<B::Import>> {
        self.core.state()
    }

    fn send(&self, job: AheadJob) {
        if self.ahead.is_empty() {
            return;
        }
        let mut q = self.core.queue.lock().unwrap_or_else(|p| p.into_inner());
        match job {
            AheadJob::Pool(id, epoch) => q.pools.push_back((id, epoch)),
            AheadJob::Widen(r, epoch) => q.widen.push_back((r, epoch, Instant::now())),
            AheadJob::Populate { lo, hi, commit } => {
                if commit && !q.populate_chunks.insert(lo) {
                    return;
                }
                q.populate.push_back((lo, hi, commit));
            }
        }
        self.core.queued.notify_one();
    }

    /// Registers a game pool `lo..lo + size`. With populate ahead on, its pages (or its chunks) are
    /// faulted in on the background thread. Under the pools policy, a pool in a region where a
    /// binding was made is imported ahead on another.
    ///
    /// A pool that runs past the window's end is refused ([`ImportError::OutOfWindow`]).
    pub fn add_pool(&self, lo: u64, size: u64) -> Result<PoolId, ImportError> {
        let window = self.core.space.window();
        if size > 0 && lo.checked_add(size).is_some_and(|end| end > window) {
            return Err(ImportError::OutOfWindow { addr: lo, size, window });
        }
        let (id, epoch, hot) = {
            let mut st = self.state();
            let id = st.pools.add(lo, size).ok_or(ImportError::BadPool { lo, size })?;
            let chunk = self.core.cfg.plan.chunk;
            let hot = regions(lo, lo + size, chunk).any(|c| st.hot.contains(&c));
            (id, st.epoch, hot)
        };
        if self.core.cfg.populate_ahead != PopulateAhead::Off {
            let cfg = self.core.cfg;
            let window = self.core.space.window();
            let grain = match cfg.populate_ahead {
                PopulateAhead::Chunks => cfg.plan.chunk,
                _ => page_size(),
            };
            let (a, b) = cover(lo, lo + size, grain).ok_or(ImportError::BadPool { lo, size })?;
            let b = b.min(window / grain * grain);
            if cfg.populate_ahead == PopulateAhead::Chunks {
                for c in (a..b).step_by(grain as usize) {
                    self.send(AheadJob::Populate { lo: c, hi: c + grain, commit: true });
                }
            } else if a < b {
                self.send(AheadJob::Populate { lo: a, hi: b, commit: false });
            }
        }
        if hot && self.core.cfg.ahead > 0 {
            self.send(AheadJob::Pool(id, epoch));
        }
        Ok(id)
    }

    /// Releases a pool. Under the chunks policy its imports stay (other pools and bindings may
    /// use their chunks), except those made ahead for it that no binding has used. Under the
    /// pools policy every import it overlaps that overlaps no other live pool is released (the
    /// game released the memory: its bindings there must be done with, and a pool made there
    /// later gets an import of its own, not one over a dead pool's). An import ahead of it in
    /// flight is released when it lands; one not started is not made.
    pub fn remove_pool(&self, id: PoolId) -> bool {
        let mut st = self.state();
        let Some(pool) = st.pools.remove(id) else { return false };
        let dead: Vec<(u64, u64)> = match self.core.cfg.policy {
            ImportPolicy::Chunks => st.imports.iter().filter(|(_, v)| v.ahead == Some(id)).map(|(k, _)| *k).collect(),
            ImportPolicy::Pools => st
                .overlapping(pool.lo, pool.hi)
                .filter(|(k, v)| v.ahead == Some(id) || st.pools.overlapping(k.0, v.hi).is_empty())
                .map(|(k, _)| *k)
                .collect(),
        };
        let dead: Vec<B::Import> = dead.into_iter().filter_map(|k| self.core.take_out(&mut st, k)).collect();
        drop(st);
        for import in dead {
            self.core.release(import);
        }
        true
    }

    /// Waits until every populate and every import ahead asked for so far has run.
    pub fn settle(&self) {
        let mut q = self.core.queue.lock().unwrap_or_else(|p| p.into_inner());
        while !self.ahead.is_empty() && !q.closed && (q.running > 0 || !q.is_empty()) {
            q = self.core.idle.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Plans the import a binding would make now, without making it (under the pools policy, its
    /// pools whole, even where it would import only its part of them first).
    pub fn plan(&self, addr: u64, size: u64) -> Result<Planned, ImportError> {
        let st = self.state();
        let r = match self.core.cfg.policy {
            ImportPolicy::Chunks => plan(&st.pools, self.core.cfg.plan, addr, size, true)?,
            ImportPolicy::Pools => pool_range(&st.pools, addr, size, self.core.align)?,
        };
        Ok(self.core.in_window(r, addr, size))
    }

    /// Binds guest bytes `addr..addr + size`: reuses an import that covers them, or imports.
    /// The bytes must lie in the window ([`ImportError::OutOfWindow`]) and their pages be
    /// committed ([`ImportError::NotCommitted`]): either is refused before anything is tried,
    /// and holds nothing cooling. (The reserved pages of the rest of an import's range are
    /// committed for it: [`ImportConfig::commit`].)
    pub fn bind(&self, addr: u64, size: u64) -> Result<Bound, ImportError> {
        self.bind_at(addr, size, Instant::now())
    }

    /// [`Importer::bind`] with the time given (cooling is measured against it): for a replay
    /// with a clock of its own, and for tests.
    ///
    /// A binding that finds its import ready returns at once. Otherwise the time from the call
    /// to the return is the binding thread's wait ([`Stats::waits`], [`Stats::wait_time`],
    /// [`Stats::wait_worst`]): under the chunks policy, its own import; under the pools policy,
    /// the import in flight it waited for, or its own import of its pools, or of its part of them.
    pub fn bind_at(&self, addr: u64, size: u64, now: Instant) -> Result<Bound, ImportError> {
        self.check_binding(addr, size)?;
        let t0 = Instant::now();
        let core = &*self.core;
        let mut st = self.state();
        let locked = t0.elapsed();
        let mut flight = FlightWait::default();
        st.largest_binding = st.largest_binding.max(size);
        if let Some(bound) = core.reuse(&mut st, addr, size) {
            return Ok(bound);
        }
        let bound = match core.cfg.policy {
            ImportPolicy::Chunks => {
                let plain = core.in_window(binding_cover(addr, size, core.cfg.plan.chunk)?, addr, size);
                let spanned = core.in_window(plan(&st.pools, core.cfg.plan, addr, size, true)?, addr, size);
                let tries: &[(Planned, bool)] =
                    if spanned == plain { &[(plain, false)] } else { &[(spanned, true), (plain, false)] };
                core.bind_importing(&mut st, addr, tries, now)
            }
            ImportPolicy::Pools => {
                let (g, bound) = self.bind_pools(st, addr, size, now, &mut flight)?;
                st = g;
                bound
            }
        };
        let waited = t0.elapsed();
        st.stats.waited(waited);
        if waited > Duration::from_micros(500) {
            let how = match &bound {
                Ok(b) if b.made => format!("imported {} ({} KiB) itself", b.range, b.range.len() >> 10),
                Ok(b) => format!("was served by {}, in flight when it came", b.range),
                Err(_) => "failed".to_owned(),
            };
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            let flew = match flight.waited {
                Some(d) => format!(
                    ", {:.2} ms for an import in flight{}{}",
                    ms(d),
                    flight.phase,
                    if flight.timed_out { " (gave up)" } else { "" }
                ),
                None => String::new(),
            };
            let part = match flight.part {
                Some((r, est, resident)) => {
                    let resident = resident.map_or(String::new(), |b| format!(", {} KiB resident", b >> 10));
                    format!("; its part {r} estimated {:.2} ms{resident}, sized in {:.2} ms", ms(est), ms(flight.sized))
                }
                None => String::new(),
            };
            tracing::debug!(
                "binding {addr:#x}+{size:#x} waited {:.2} ms: {how} ({:.2} ms for the lock{flew}{part})",
                ms(waited),
                ms(locked)
            );
        }
        bound
    }

    /// Refuses a binding that is the caller's mistake, before any lock of the importer's: one
    /// that is empty or wraps (its own errors), runs past the window's end, or lies over pages
    /// the space has not committed (the first run of them named; one record read).
    fn check_binding(&self, addr: u64, size: u64) -> Result<(), ImportError> {
        binding_cover(addr, size, self.core.cfg.plan.chunk)?;
        let space = &self.core.space;
        let window = space.window();
        let end = addr + size; // no wrap: checked just above
        if end > window {
            return Err(ImportError::OutOfWindow { addr, size, window });
        }
        let page = page_size();
        let lo = addr / page * page;
        let pages = space.range(lo, end.next_multiple_of(page) - lo)?;
        match space.uncommitted(pages) {
            Some(r) => Err(ImportError::NotCommitted { addr, size, lo: r.start().0, hi: r.end().0 }),
            None => Ok(()),
        }
    }

    /// The pools policy's binding with nothing ready: waits for an import in flight that should
    /// land sooner than the binding's own part would take, or imports its pools whole where that
    /// fits the wait target, or else its part of them and leaves the rest to the background
    /// thread; then marks the binding's regions as ones where bindings come (their pools are
    /// imported ahead). The lock is given back.
    #[allow(clippy::type_complexity)]
    fn bind_pools<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<B::Import>>,
        addr: u64,
        size: u64,
        now: Instant,
        flight: &mut FlightWait,
    ) -> Result<(MutexGuard<'a, State<B::Import>>, Result<Bound, ImportError>), ImportError> {
        let core = &*self.core;
        let end = addr.checked_add(size).ok_or(ImportError::BindingWraps { addr, size })?;
        let whole = core.in_window(pool_range(&st.pools, addr, size, core.align)?, addr, size);
        // The part at the granule: every page taken as untouched.
        let fallback = piece(whole, addr, size, st.granule);
        let overlaps_ok = core.backend.overlapping_imports();
        let t = Instant::now();
        let part = if overlaps_ok {
            // The background threads start nothing that takes the memory-map lock while the
            // part's pages are read: a populate or a commit queued there would hold the read.
            let _at_work = AtWork::new(&core.binding_imports);
            core.size_part(&st, whole, addr, size)
        } else {
            Part::untouched(&st.cost, fallback)
        };
        flight.sized = t.elapsed();
        let own = if overlaps_ok { part.r } else { whole };
        flight.part = Some((part.r, part.est, part.resident_in(part.r)));
        let (g, served) = core.wait_in_flight(st, (addr, size), part.est, own, flight);
        st = g;
        if let Some(bound) = served {
            return Ok((st, Ok(bound)));
        }
        let split = overlaps_ok && part.r != whole;
        let tries: &[(Planned, bool)] = if split || fallback == whole {
            &[(if split { part.r } else { whole }, false)]
        } else {
            &[(whole, true), (fallback, false)]
        };
        let bound = core.bind_importing(&mut st, addr, tries, now);
        if let Ok(b) = &bound {
            core.learn(&mut st, b.range.len(), part.resident_in(b.range));
        }
        let epoch = st.epoch;
        if split && bound.is_ok() {
            st.stats.pieces += 1;
            self.send(AheadJob::Widen(whole, epoch));
        }
        let chunk = core.cfg.plan.chunk;
        let mut new_pools = Vec::new();
        for c in regions(addr, end, chunk) {
            if st.hot.insert(c) {
                let (lo, hi) = (c * chunk, (c * chunk).saturating_add(chunk));
                new_pools.extend(st.pools.overlapping(lo, hi).into_iter().map(|p| p.id));
            }
        }
        if core.cfg.ahead > 0 {
            for id in new_pools {
                self.send(AheadJob::Pool(id, epoch));
            }
        }
        Ok((st, bound))
    }

    /// The figures so far.
    pub fn stats(&self) -> Stats {
        let mut s = self.state().stats.clone();
        let c = &self.core.populate_counts;
        s.populated = c.done.load(Ordering::Relaxed);
        s.populate_failures = c.failed.load(Ordering::Relaxed);
        s.populated_bytes = c.bytes.load(Ordering::Relaxed);
        s
    }

    /// The live imports' ranges, by address.
    pub fn imports(&self) -> Vec<Planned> {
        self.state().imports.iter().map(|(&(lo, _), v)| Planned { lo, hi: v.hi }).collect()
    }

    /// The ranges the background threads are importing now (populating, waiting for their turn
    /// in the driver, or in it), in the order they began.
    pub fn in_flight(&self) -> Vec<Planned> {
        self.state().in_flight.iter().map(|f| f.r).collect()
    }

    /// Releases every import and forgets where bindings were made. Imports ahead asked for
    /// before are not made; one in flight is waited for and released.
    pub fn release_all(&self) {
        let mut st = self.state();
        st.epoch += 1;
        while !st.in_flight.is_empty() {
            st = self.core.landed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        let imports = std::mem::take(&mut st.imports);
        for ((lo, _), live) in imports {
            if live.ahead.is_some() {
                st.stats.ahead_bytes -= live.hi - lo;
            }
            self.core.release(live.import);
        }
        st.hot.clear();
        st.longest = 0;
        st.stats.live = 0;
        st.stats.live_bytes = 0;
    }
}

impl<B: Backend + 'static> Drop for Importer<B> {
    fn drop(&mut self) {
        self.core.stopping.store(true, Ordering::Relaxed);
        self.core.close_queue(&mut self.ahead);
        self.release_all();
    }
}

impl<B: Backend> Core<B> {
    fn state(&self) -> MutexGuard<'_, State<B::Import>> {
        // The state stays consistent across a panic in a backend call (the maps are updated only
        // after a call returns).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `r` cut at the window's end where the binding `addr..addr + size` lies inside the window
    /// and `r` does not: a binding near the end imports the part of its chunks that exists. (A
    /// binding past the end keeps its cover and fails as outside the window.)
    fn in_window(&self, r: Planned, addr: u64, size: u64) -> Planned {
        let window = self.space.window();
        let inside = addr.checked_add(size).is_some_and(|end| end <= window);
        if inside && r.hi > window { Planned { lo: r.lo, hi: window } } else { r }
    }

    /// Learns from a binding's import of `len` bytes just made (its time is the last of
    /// [`Stats::times`]), `resident` of them populated before it (`None`: not read, all taken as
    /// untouched), where the cost was measured. An import whose untouched pages are 32 KiB or
    /// more and at least half of it gives a time per untouched MiB (past the fixed part and the
    /// resident pages' estimate); else one with 32 KiB or more resident gives a time per
    /// resident MiB likewise. Each part of the cost becomes the larger of the start-up one and
    /// the 90th percentile of its last [`Recent::N`] times (the resident one no more than the
    /// untouched one): the wait target bounds the slow imports, not the average one. Under a
    /// write tracker, with other threads faulting and importing, untouched pages cost several
    /// times what the start-up measure saw on scratch memory, and unevenly: on a 2-CPU VM,
    /// 0.5 ms/MiB alone and 3–6 ms/MiB behind a background import, a tenth of the time.
    fn learn(&self, st: &mut State<B::Import>, len: u64, resident: Option<u64>) {
        let Some(&took) = st.stats.times.last() else { return };
        // A cost given is used as it is.
        if self.cfg.cost.is_some() {
            return;
        }
        let resident = resident.unwrap_or(0).min(len);
        let untouched = len - resident;
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let over = ms(took.saturating_sub(st.cost.fixed));
        let (u, p) = (ms(st.cost.untouched_per_mib), ms(st.cost.populated_per_mib));
        if untouched >= LEAST_SAMPLE && untouched >= resident {
            st.learned.0.push((over - p * mib(resident)).max(0.0) / mib(untouched));
        } else if resident >= LEAST_SAMPLE {
            st.learned.1.push((over - u * mib(untouched)).max(0.0) / mib(resident));
        } else {
            return;
        }
        let at_least =
            |start: Duration, learned: &Recent| start.max(Duration::from_secs_f64(learned.p90().min(60e3) / 1e3));
        st.cost.untouched_per_mib = at_least(self.cost.untouched_per_mib, &st.learned.0);
        // A resident page costs no more than an untouched one (its fault is done): without this
        // bound, a few resident imports held up on a busy machine (a 64 KiB one for 6 ms)
        // made it 100 ms/MiB on the VM.
        let populated = at_least(self.cost.populated_per_mib, &st.learned.1).min(st.cost.untouched_per_mib);
        st.cost.populated_per_mib = populated.max(self.cost.populated_per_mib);
        st.granule = st.cost.granule(self.cfg.wait, self.align);
    }

    /// The pools policy's part of `whole` that a binding at `addr, size` imports itself:
    /// `whole` where its import is estimated to fit the wait target, given which of its pages
    /// are resident, else the piece around the binding at the largest power-of-two granule that
    /// fits, else the piece at the backend's alignment; a range larger than that only where it
    /// overlaps no import in flight, and no import a binding made or used unless the least
    /// part does too. One `mincore` reads the pages of the largest of these that could fit were
    /// all its pages resident (a few MiB at most); where none could, or the read fails, every
    /// page is taken as untouched.
    fn size_part(&self, st: &State<B::Import>, whole: Planned, addr: u64, size: u64) -> Part {
        let (cost, wait) = (st.cost, self.cfg.wait);
        let least = piece(whole, addr, size, self.align);
        if cost.pin(least.len()) > wait {
            return Part::untouched(&cost, least);
        }
        let reach = cost.pin_granule(wait, self.align);
        let seen = if cost.pin(whole.len()) <= wait { whole } else { piece(whole, addr, size, reach) };
        let mut part = Part { r: least, est: Duration::MAX, seen, pages: Vec::new() };
        let read = self.space.range(seen.lo, seen.len()).map_err(ImportError::from);
        if read.and_then(|r| Ok(self.space.resident_pages(r, &mut part.pages)?)).is_err() {
            return Part::untouched(&cost, least);
        }
        let granules = (0..).map(|i| reach >> i).take_while(|&g| g > self.align);
        let candidates = std::iter::once(seen).chain(granules.map(|g| piece(whole, addr, size, g)));
        let estimate = |r: Planned| cost.estimate_with(r.len(), part.resident_in(r).unwrap_or(0));
        // More than the least part only over pages no binding imported and none in flight: a
        // larger part there would import them again. Where the least part imports pages again
        // already (a binding across the border of two parts), the larger one imports no more
        // again than it does, and holds the next binding across that border.
        let again = st.overlaps_used(least.lo, least.hi, None);
        let free = |r: &Planned| !((!again && st.overlaps_used(r.lo, r.hi, None)) || st.in_flight_over(*r));
        let fits = candidates.filter(free).map(|r| (r, estimate(r))).find(|&(_, est)| est <= wait);
        (part.r, part.est) = fits.unwrap_or((least, estimate(least)));
        part
    }

    /// A binding served by a live import that covers it, if there is one.
    fn reuse(&self, st: &mut State<B::Import>, addr: u64, size: u64) -> Option<Bound> {
        let k = st.covering(addr, addr.checked_add(size)?)?;
        let live = st.imports.get_mut(&k).expect("the key was just found");
        let range = Planned { lo: k.0, hi: live.hi };
        let first_use = live.ahead.take().is_some();
        let handle = self.backend.handle(&live.import);
        let s = &mut st.stats;
        s.reuses += 1;
        if first_use {
            s.ahead_hits += 1;
            s.ahead_bytes -= range.len();
        }
        Some(Bound { range, made: false, spanned: false, handle, offset: addr - range.lo })
    }

    /// A binding's own import: each range of `tries` (`true`: one a smaller one follows if it
    /// fails) until one is made; one cooling is skipped.
    fn bind_importing(
        &self,
        st: &mut State<B::Import>,
        addr: u64,
        tries: &[(Planned, bool)],
        now: Instant,
    ) -> Result<Bound, ImportError> {
        let mut last = None;
        for &(range, is_span) in tries {
            if let Some(&until) = st.cooling.get(&range) {
                if now < until {
                    st.stats.cooled += 1;
                    let left_ms = (until - now).as_millis() as u64;
                    last = Some(ImportError::Cooling { lo: range.lo, hi: range.hi, left_ms });
                    continue;
                }
                st.cooling.remove(&range);
            }
            let made = {
                let _at_work = AtWork::new(&self.binding_imports);
                self.import(st, range)
            };
            match made {
                Ok((lo, handle)) => {
                    return Ok(Bound { range, made: true, spanned: is_span, handle, offset: addr - lo });
                }
                Err(e) => {
                    st.stats.failures += 1;
                    if !self.cfg.cooling.is_zero() {
                        st.cooling.insert(range, now + self.cfg.cooling);
                    }
                    if is_span {
                        st.stats.unspanned_retries += 1;
                        let again = match self.cfg.policy {
                            ImportPolicy::Chunks => "made again without the span",
                            ImportPolicy::Pools => "made again as the binding's part of it",
                        };
                        tracing::warn!("import of {range} failed ({}); {again}", chain(&e));
                    } else {
                        tracing::warn!("import of {range} failed: {}", chain(&e));
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.expect("at least one range was tried or cooling"))
    }

    /// Imports `r` (or, where overlaps are refused, the union of `r` and the imports it overlaps):
    /// the import's start and device objects.
    fn import(&self, st: &mut State<B::Import>, r: Planned) -> Result<(u64, GpuHandle), ImportError> {
        // Where the device refuses a page in two imports (CUDA), the re-import takes in the
        // imports it overlaps: they are released first, and the new import covers them all.
        let mut r = r;
        let mut superseded = Vec::new();
        if !self.backend.overlapping_imports() && st.overlaps(r.lo, r.hi) {
            let (lo, hi, keys) = st.union(r.lo, r.hi);
            r = Planned { lo, hi };
            superseded = keys;
        }
        let t = Instant::now();
        let span = HostSpan::of(&self.space, r.lo, r.len()).map_err(|e| self.wrap(r, e))?;
        let held = t.elapsed();
        if held > Duration::from_micros(200) {
            // The hold takes the space's lock, which a change keeps across its system call.
            tracing::debug!("binding's hold of {r} waited {:.2} ms for the space's lock", held.as_secs_f64() * 1e3);
        }
        // Pages an unused import ahead holds were never imported for a binding: not a re-import.
        let reimport = st.overlaps_used(r.lo, r.hi, None);
        for k in superseded {
            if let Some(old) = st.imports.remove(&k) {
                st.stats.live -= 1;
                st.stats.live_bytes -= old.hi - k.0;
                if old.ahead.is_some() {
                    st.stats.ahead_bytes -= old.hi - k.0;
                }
                self.release(old.import);
            }
        }
        let (import, took) = self.make(span, r, false)?;
        let handle = self.backend.handle(&import);
        // Unused imports ahead that the new one covers are taken in (released), once it is made.
        for k in st.unused_inside(r.lo, r.hi) {
            self.release_unused(st, k);
        }
        self.record(st, r, import, took, Made::Binding { reimport });
        Ok((r.lo, handle))
    }

    /// A binding's wait for an import in flight that covers it (`addr, size`), where that
    /// should land sooner than its own part would take (`part_cost`), or where the device
    /// refuses overlaps and an import in flight overlaps `own`: the binding served by it, or
    /// `None` to import.
    fn wait_in_flight<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<B::Import>>,
        (addr, size): (u64, u64),
        part_cost: Duration,
        own: Planned,
        flight: &mut FlightWait,
    ) -> (MutexGuard<'a, State<B::Import>>, Option<Bound>) {
        // The caller checked that the binding does not wrap.
        let end = addr.saturating_add(size);
        let overlaps_ok = self.backend.overlapping_imports();
        // The wait for an import in flight is bounded once, when it begins: by what is left of
        // that import and the binding's own part's time. Each landing wakes the binding to look
        // again, and must not push the bound further.
        let mut deadline: Option<(Instant, Instant)> = None;
        loop {
            let in_driver = *self.in_driver.lock().unwrap_or_else(|p| p.into_inner());
            let left = st.in_flight_left(addr, end, in_driver);
            // A device that refuses overlaps cannot import beside an import in flight: it waits.
            let must = !overlaps_ok && st.in_flight_over(own);
            let worth = left.is_some_and(|l| l <= part_cost);
            if !must && !worth {
                break;
            }
            let (began, until) = *deadline.get_or_insert_with(|| {
                st.stats.in_flight_waits += 1;
                flight.phase = match in_driver {
                    Some((since, r)) if r.covers(addr, end) => {
                        format!(", in the driver {:.2} ms", since.elapsed().as_secs_f64() * 1e3)
                    }
                    _ => String::new(),
                };
                let now = Instant::now();
                // At most an hour: a cost given may be anything, and an `Instant` past it
                // would not be.
                let bound = left.unwrap_or_default().saturating_add(part_cost).min(Duration::from_secs(3600));
                (now, now + bound)
            });
            let mut timed_out = false;
            st = if must {
                self.landed.wait(st).unwrap_or_else(|p| p.into_inner())
            } else {
                let rest = until.saturating_duration_since(Instant::now());
                let (g, t) = self.landed.wait_timeout(st, rest).unwrap_or_else(|p| p.into_inner());
                timed_out = t.timed_out();
                g
            };
            flight.waited = Some(began.elapsed());
            flight.timed_out = timed_out;
            if let Some(bound) = self.reuse(&mut st, addr, size) {
                return (st, Some(bound));
            }
            if timed_out {
                break;
            }
        }
        (st, None)
    }

    /// Releases `import` (counted while under way, for the debug log of slow imports).
    fn release(&self, import: B::Import) {
        self.releasing.fetch_add(1, Ordering::Relaxed);
        self.backend.release(import);
        self.releasing.fetch_sub(1, Ordering::Relaxed);
    }

    fn wrap(&self, r: Planned, source: ImportError) -> ImportError {
        ImportError::Import { lo: r.lo, hi: r.hi, backend: self.backend.kind().name(), source: Box::new(source) }
    }

    /// Commits the reserved pages of `span` (its range `r`) and imports it: the import and its
    /// time. On a background thread (`background`) it populates the pages first and stays out
    /// of the way of bindings' imports.
    fn make(&self, span: HostSpan, r: Planned, background: bool) -> Result<(B::Import, Duration), ImportError> {
        let t = Instant::now();
        if self.cfg.commit {
            // Only the reserved pages, under the space's lock: the guest's keep their protection.
            // The span holds the range already, so nothing is decommitted between this and the
            // import. A background commit waits for the bindings at their import: it takes the
            // space's lock (which a binding's hold needs) across an mprotect that queues for the
            // memory-map lock (which a binding's `mincore` and pin need).
            if background {
                self.aside(|| Some(()));
            }
            self.space.commit_reserved(span.guest(), Prot::READ_WRITE).map_err(|e| self.wrap(r, e.into()))?;
        }
        if background {
            // In slices, each after every binding's import under way: a long populate holds the
            // process's memory-map lock, and a binding's pin (or a commit queued for the lock in
            // write mode, which the pin then queues behind) would wait for all of it.
            let g = span.guest();
            let mut at = g.start().0;
            while at < g.end().0 {
                let n = POPULATE_SLICE.min(g.end().0 - at);
                let _read = self.step_aside();
                let slice = self.space.range(at, n).and_then(|s| self.space.populate(s));
                if let Err(e) = slice {
                    // The pin faults in what this left (pages the guest made read-only, for one).
                    tracing::debug!("populate ahead of the import of {r}: {e}");
                }
                at += n;
            }
        }
        // The background threads enter the driver one at a time, and only while no binding
        // imports: a driver serializes imports (on an H200 a 4 KiB import took 1.4 ms beside
        // another thread's), and a binding should wait for one of theirs at most.
        let _turn = background.then(|| {
            let turn = self.driver_turn.lock().unwrap_or_else(|p| p.into_inner());
            (turn, self.step_aside())
        });
        let before = t.elapsed();
        let releasing = self.releasing.load(Ordering::Relaxed);
        let met = if background {
            *self.in_driver.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), r));
            None
        } else {
            self.in_driver.lock().unwrap_or_else(|p| p.into_inner()).map(|(since, r)| (since.elapsed(), r.len()))
        };
        let import = self.backend.import(span);
        if background {
            *self.in_driver.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        let import = import.map_err(|e| self.wrap(r, e))?;
        let took = t.elapsed();
        if took > Duration::from_micros(500) {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            let who = if background { "ahead" } else { "binding's" };
            let beside = met.map_or(String::new(), |(been, len)| {
                format!("; a background import of {} KiB had been in the driver {:.2} ms", len >> 10, ms(been))
            });
            tracing::debug!(
                "{who} import of {r}: {:.2} ms to commit and populate, {:.2} ms in the backend{beside}; \
                 {releasing} releases under way at its start",
                ms(before),
                ms(took - before)
            );
        }
        Ok((import, took))
    }

    /// A background thread waits here until no binding is importing and no change of the
    /// space's mappings is under way, and returns the space's long read for its populate or pin
    /// (`None` once the importer is being dropped). A change waits for the memory-map lock
    /// behind every populate and pin that holds it, and there every collect's scan queues behind
    /// the change, which meanwhile holds the space's lock that collects need too (on the H200,
    /// commits of a few KiB waited 1-4 ms so): with the long read, a change that comes during
    /// the populate or the pin waits for it before it takes the space's lock instead.
    /// It yields at first, then sleeps 50 µs at a time (a change can wait milliseconds for the
    /// lock), and stops waiting once the importer is being dropped (a guard an embedder keeps
    /// must not hang the drop).
    fn step_aside(&self) -> Option<LongRead<'_>> {
        self.aside(|| self.space.try_long_read())
    }

    /// Waits until no binding is at its import and `take` gives something (see
    /// [`Core::step_aside`]); `None` once the importer is being dropped.
    fn aside<T>(&self, mut take: impl FnMut() -> Option<T>) -> Option<T> {
        let mut spins = 0u32;
        loop {
            if self.stopping.load(Ordering::Relaxed) {
                return None;
            }
            if self.binding_imports.load(Ordering::Acquire) == 0
                && let Some(taken) = take()
            {
                return Some(taken);
            }
            spins += 1;
            if spins < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Records a new live import of `r`, its figures and its log line.
    fn record(&self, st: &mut State<B::Import>, r: Planned, import: B::Import, took: Duration, made: Made) {
        st.seq += 1;
        let seq = st.seq;
        let ahead = match made {
            Made::Ahead(id) => Some(id),
            _ => None,
        };
        st.imports.insert((r.lo, seq), Live { hi: r.hi, import, ahead, made_for: ahead });
        st.longest = st.longest.max(r.len());
        let s = &mut st.stats;
        s.imports += 1;
        s.time += took;
        s.times.push(took);
        s.live += 1;
        s.live_bytes += r.len();
        s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
        let what = match made {
            Made::Binding { reimport: false } => "",
            Made::Binding { reimport: true } => ", again over pages imported before",
            Made::Ahead(_) => " ahead",
            Made::Widen => " whole, over a binding's part of it",
        };
        match made {
            Made::Binding { reimport } => s.reimports += u64::from(reimport),
            Made::Ahead(_) | Made::Widen => {
                s.ahead_imports += 1;
                s.ahead_time += took;
                s.widenings += u64::from(made == Made::Widen);
            }
        }
        tracing::info!(
            "import {r} ({} MiB) in {:.2} ms{what} ({} imports, {:.0} ms in all)",
            r.len() >> 20,
            took.as_secs_f64() * 1e3,
            s.imports,
            s.time.as_secs_f64() * 1e3
        );
    }

    /// Takes the live import `k` out of the state, used or not, for the caller to release
    /// (off the lock where it can: a driver's release of a large import takes a while, and
    /// bindings wait for the lock).
    fn take_out(&self, st: &mut State<B::Import>, k: (u64, u64)) -> Option<B::Import> {
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
    fn release_unused(&self, st: &mut State<B::Import>, k: (u64, u64)) {
        if let Some(import) = self.take_out(st, k) {
            self.release(import);
        }
    }

    /// A background thread: the queue's jobs ([`AheadQueue::pop`]) until it is closed.
    fn run_ahead(&self) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if q.closed {
                return;
            }
            let Some(job) = q.pop(Instant::now()) else {
                q = self.queued.wait(q).unwrap_or_else(|p| p.into_inner());
                continue;
            };
            q.running += 1;
            drop(q);
            let (pool, range, epoch) = match job {
                AheadJob::Populate { lo, hi, commit } => {
                    self.populate_ahead(lo, hi, commit);
                    (None, None, 0)
                }
                AheadJob::Widen(r, epoch) => (None, Some(r), epoch),
                AheadJob::Pool(id, epoch) => {
                    let range = self.state().pools.get(id).and_then(|p| {
                        let (lo, hi) = cover(p.lo, p.hi, self.align)?;
                        Some(self.in_window(Planned { lo, hi }, p.lo, p.hi - p.lo))
                    });
                    (Some(id), range, epoch)
                }
            };
            if let Some(r) = range
                && !self.stopping.load(Ordering::Relaxed)
            {
                // A pool ahead is left out over pages a binding imported (that is for bindings
                // to do, counted as a re-import); once its first piece is made, the rest follow.
                let used = pool.is_some() && self.state().overlaps_used(r.lo, r.hi, pool);
                for piece in if used { Vec::new() } else { self.pieces(r) } {
                    if !self.ahead(pool, piece, epoch) || self.stopping.load(Ordering::Relaxed) {
                        break;
                    }
                }
            }
            q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.done_one(&self.idle);
        }
    }

    /// A populate ahead (`EMUHOST_IMPORT_POPULATE_AHEAD`): `lo..hi`'s pages faulted in, its
    /// reserved pages committed read-write first where `commit` (the guest's keep their
    /// protection); counted, a failure too.
    fn populate_ahead(&self, lo: u64, hi: u64, commit: bool) {
        let space = &self.space;
        let r = space.range(lo, hi - lo).and_then(|r| {
            if commit {
                space.commit_reserved(r, Prot::READ_WRITE)?;
            }
            space.populate(r)
        });
        let c = &self.populate_counts;
        match r {
            Ok(()) => {
                c.done.fetch_add(1, Ordering::Relaxed);
                c.bytes.fetch_add(hi - lo, Ordering::Relaxed);
            }
            Err(e) => {
                c.failed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("populate ahead {lo:#x}..{hi:#x}: {e}");
            }
        }
    }

    /// `r` in the pieces a background thread imports it in ([`ImportConfig::ahead_piece`]):
    /// each overlaps the next by the largest binding seen so far (at least [`LEAST_OVERLAP`]),
    /// in the backend's alignment. Whole where the backend refuses overlaps.
    fn pieces(&self, r: Planned) -> Vec<Planned> {
        let piece = self.cfg.ahead_piece.checked_next_multiple_of(self.align).unwrap_or(0);
        if piece == 0 || !self.backend.overlapping_imports() {
            return vec![r];
        }
        let largest = self.state().largest_binding.max(LEAST_OVERLAP);
        let overlap = largest.checked_next_multiple_of(self.align).unwrap_or(piece).min(piece);
        pieces(r, piece, overlap)
    }

    /// Closes the background threads' queue and joins `threads`.
    fn close_queue(&self, threads: &mut Vec<JoinHandle<()>>) {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
        self.queued.notify_all();
        self.idle.notify_all();
        for t in threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Imports `r` (a pool or a piece of one) on the background thread, populating it first:
    /// ahead of pool `pool`'s bindings, or (`None`) a pool a binding imported only part of. Left
    /// out where live imports cover it (the latter: where one does), where it overlaps one in
    /// flight (the latter waits for that to land first), where it is cooling or failed ahead before, where the device refuses overlaps
    /// and it overlaps an import it cannot take in, and past the budget of bytes ahead (a pool
    /// over pages a binding imported is left out before its first piece: [`Core::run_ahead`]).
    /// Unused imports ahead inside `r` are taken in. Returns whether the pool's next piece is
    /// still wanted: not past the budget, after a failure, once the pool is released or after
    /// [`Importer::release_all`].
    /// (Long: the checks, the budget and the flight off the lock read best in one place.)
    fn ahead(&self, pool: Option<PoolId>, r: Planned, epoch: u64) -> bool {
        let mut st = self.state();
        if st.epoch != epoch || pool.is_some_and(|id| st.pools.get(id).is_none()) {
            return false;
        }
        // A pool whole over a binding's part waits for another thread's import in flight over it
        // rather than being left out: nothing would ask for it again, and bindings across the
        // part's border would import their pages again all session.
        while pool.is_none() && st.in_flight_over(r) && st.epoch == epoch {
            st = self.landed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        if st.epoch != epoch {
            return false;
        }
        let cooling = st.cooling.get(&r).is_some_and(|&until| Instant::now() < until);
        // A pool whole over its bindings' parts is wanted until one import holds it: parts that
        // hold all its pages between them still leave a binding across their border in neither.
        let covered = match pool {
            Some(_) => st.covered(r.lo, r.hi),
            None => st.covering(r.lo, r.hi).is_some(),
        };
        if r.is_empty() || covered || st.in_flight_over(r) || cooling || st.ahead_failed.contains(&r) {
            return true;
        }
        // (key, end, unused and inside `r`)
        let over: Vec<((u64, u64), u64, bool)> = st
            .overlapping(r.lo, r.hi)
            .map(|(k, v)| (*k, v.hi, v.ahead.is_some() && r.lo <= k.0 && v.hi <= r.hi))
            .collect();
        let overlaps_ok = self.backend.overlapping_imports();
        if !overlaps_ok && !over.iter().all(|o| o.2) {
            return true;
        }
        if pool.is_some() {
            let freed: u64 = over.iter().filter(|o| o.2).map(|o| o.1 - o.0.0).sum();
            if st.stats.ahead_bytes - freed + r.len() > self.cfg.ahead {
                st.stats.ahead_over_budget += 1;
                return false;
            }
            st.stats.ahead_bytes += r.len();
            st.stats.ahead_peak_bytes = st.stats.ahead_peak_bytes.max(st.stats.ahead_bytes);
        }
        let mut later = Vec::new();
        if !overlaps_ok {
            later.extend(over.iter().filter_map(|(k, _, _)| self.take_out(&mut st, *k)));
        }
        let est = st.cost.estimate(r.len());
        st.in_flight.push(Flight { r, since: Instant::now(), est });
        // Off the lock, so that bindings go on; one that this range covers may wait for it.
        drop(st);
        for import in later.drain(..) {
            self.release(import);
        }
        let made = HostSpan::of(&self.space, r.lo, r.len())
            .map_err(|e| self.wrap(r, e))
            .and_then(|span| self.make(span, r, true));
        let mut st = self.state();
        let ok = made.is_ok();
        match made {
            Ok((import, took)) => {
                for k in st.unused_inside(r.lo, r.hi) {
                    later.extend(self.take_out(&mut st, k));
                }
                // A binding may have imported the pool while this was in flight.
                let redundant = st.covering(r.lo, r.hi).is_some();
                self.record(&mut st, r, import, took, pool.map_or(Made::Widen, Made::Ahead));
                if let Some(id) = pool
                    && (redundant || st.pools.get(id).is_none())
                {
                    // Released while in flight, or imported by its binding: nothing will use it.
                    let key = (r.lo, st.seq);
                    later.extend(self.take_out(&mut st, key));
                }
            }
            Err(e) => {
                if pool.is_some() {
                    st.stats.ahead_bytes -= r.len();
                }
                st.stats.ahead_failures += 1;
                st.ahead_failed.insert(r);
                tracing::warn!("import ahead of {r} failed: {}", chain(&e));
            }
        }
        // The flight ends once what it took in is released (off the lock): `release_all` waits
        // for it.
        if !later.is_empty() {
            self.landed.notify_all();
            drop(st);
            for import in later {
                self.release(import);
            }
            st = self.state();
        }
        st.in_flight.retain(|f| f.r != r);
        self.landed.notify_all();
        ok && st.epoch == epoch && pool.is_none_or(|id| st.pools.get(id).is_some())
    }
}

/// What made an import.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Made {
    /// A binding, on its thread (over pages a binding imported before: a re-import).
    Binding { reimport: bool },
    /// The background thread, ahead of this pool's bindings.
    Ahead(PoolId),
    /// The background thread, a pool whole over a binding's part of it.
    Widen,
}

/// `r` cut into pieces that start `piece` apart and reach `overlap` past the next one's start
/// (the last ends at `r`'s end): a range of at most `overlap` bytes inside `r` lies whole in one
/// of them.
fn pieces(r: Planned, piece: u64, overlap: u64) -> Vec<Planned> {
    let mut out = Vec::new();
    let mut lo = r.lo;
    loop {
        match piece.checked_add(overlap).and_then(|n| lo.checked_add(n)).filter(|&hi| hi < r.hi) {
            Some(hi) => out.push(Planned { lo, hi }),
            None => {
                out.push(Planned { lo, hi: r.hi });
                return out;
            }
        }
        lo += piece;
    }
}

/// The indices of the `chunk`-sized regions that `lo..hi` (not empty) touches.
fn regions(lo: u64, hi: u64, chunk: u64) -> std::ops::RangeInclusive<u64> {
    lo / chunk..=(hi - 1) / chunk
}

fn chain(e: &ImportError) -> String {
    super::backend::error_chain(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `len` bytes from `lo`.
    fn sized(lo: u64, len: u64) -> Planned {
        Planned { lo, hi: lo + len }
    }

    #[test]
    fn the_queue_gives_widenings_smallest_first_then_pools_then_populates() {
        let t = Instant::now();
        let mut q = AheadQueue::default();
        q.populate.push_back((0, 4096, false));
        q.pools.push_back((PoolId(7), 1));
        let asked = [(0x10000, 8 << 20), (0x900000, 64 << 10), (0xa00000, 1 << 20), (0xb00000, 64 << 10)];
        for (e, (lo, len)) in (1..).zip(asked) {
            q.widen.push_back((sized(lo, len), e, t));
        }
        let mut order = Vec::new();
        while let Some(job) = q.pop(t + WIDEN_OLDEST / 2) {
            order.push(match job {
                AheadJob::Widen(w, e) => format!("widen {}K/{e}", w.len() >> 10),
                AheadJob::Pool(id, e) => format!("pool {}/{e}", id.0),
                AheadJob::Populate { lo, hi, .. } => format!("populate {}", hi - lo),
            });
        }
        // Equal sizes keep the order asked.
        let want = ["widen 64K/2", "widen 64K/4", "widen 1024K/3", "widen 8192K/1", "pool 7/1", "populate 4096"];
        assert_eq!(order, want);
        assert!(q.is_empty());
    }

    #[test]
    fn a_widening_asked_long_enough_ago_goes_before_smaller_ones() {
        let t = Instant::now();
        let mut q = AheadQueue::default();
        q.widen.push_back((sized(0x10000, 8 << 20), 1, t));
        q.widen.push_back((sized(0x900000, 64 << 10), 2, t + WIDEN_OLDEST));
        q.widen.push_back((sized(0xa00000, 128 << 10), 3, t + WIDEN_OLDEST));
        let epochs = |q: &mut AheadQueue, now: Instant| {
            std::iter::from_fn(|| match q.pop(now)? {
                AheadJob::Widen(_, e) => Some(e),
                _ => None,
            })
            .collect::<Vec<u64>>()
        };
        // At the age the large one goes first; the others keep smallest first.
        assert_eq!(epochs(&mut q, t + WIDEN_OLDEST), [1, 2, 3]);
        q.widen.push_back((sized(0x10000, 8 << 20), 1, t));
        q.widen.push_back((sized(0x900000, 64 << 10), 2, t));
        // Just before it, smallest first.
        assert_eq!(epochs(&mut q, t + WIDEN_OLDEST - Duration::from_millis(1)), [2, 1]);
    }

    #[test]
    fn the_90th_percentile_of_the_recent_values_is_their_nearest_rank() {
        let mut r = Recent::default();
        assert_eq!(r.p90(), 0.0, "none yet");
        r.push(3.0);
        assert_eq!(r.p90(), 3.0);
        for x in [1.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0] {
            r.push(x);
        }
        // Ten values: the 9th smallest, so one slow value in ten is not yet the estimate.
        assert_eq!(r.p90(), 3.0);
        // Only the last N are kept: N ones push both out.
        for _ in 0..Recent::N {
            r.push(1.0);
        }
        assert_eq!(r.p90(), 1.0);
    }

    /// What bindings' imports teach the cost (measured at start, so learned): the 90th
    /// percentile of their recent times per MiB, not the average (the wait target bounds the
    /// slow imports), untouched and resident pages apart, and nothing from small imports.
    #[test]
    fn the_cost_learned_is_the_slow_imports_per_kind_of_page() {
        let space = Arc::new(Space::with_window(64 << 20).unwrap());
        let cfg = ImportConfig::default().ahead(0).ahead_threads(1);
        let imp = Importer::new(space, crate::import::Pin::new(), cfg).unwrap();
        let core = &*imp.core;
        let start = imp.cost();
        let ms = Duration::from_millis;
        let mut st = core.state();
        let mut learn = |took: Duration, len: u64, resident: Option<u64>| {
            st.stats.times.push(start.fixed + took);
            core.learn(&mut st, len, resident);
            (st.cost.untouched_per_mib, st.cost.populated_per_mib, st.granule)
        };
        // Untouched MiBs: eight at 1 ms past the fixed part, two at 20 ms.
        let mut last = (start.untouched_per_mib, start.populated_per_mib, 0);
        for t in [1, 1, 1, 1, 20, 1, 1, 1, 20, 1] {
            last = learn(ms(t), 1 << 20, Some(0));
        }
        assert_eq!((last.0, last.1), (ms(20), start.populated_per_mib), "the average would be 4.8 ms");
        // A 400 us wait fits 16 KiB of them at 20 ms/MiB.
        assert!(last.2 <= 16 << 10, "{:#x}", last.2);
        // Resident pages are learned apart: 2 MiB, half resident, at 20 ms for the untouched half
        // and 6 ms for the resident one.
        let (u, p, _) = learn(ms(20 + 6), 2 << 20, Some(1 << 20));
        assert_eq!((u, p), (ms(20), start.populated_per_mib), "half untouched: a time per untouched MiB");
        let (u, p, _) = learn(ms(12), 2 << 20, Some(2 << 20));
        assert_eq!((u, p), (ms(20), ms(6)));
        // Residency not read: every page taken as untouched (two at 40 ms/MiB make the 90th
        // percentile of 13). Under 32 KiB: nothing learned.
        learn(ms(40 * 4), 4 << 20, None);
        let (u, p, _) = learn(ms(40 * 4), 4 << 20, None);
        assert_eq!((u, p), (ms(40), ms(6)));
        assert_eq!(learn(ms(1000), 16 << 10, Some(0)).0, ms(40));
        // A resident MiB costs no more than an untouched one, whatever its imports took.
        learn(ms(100), 1 << 20, Some(1 << 20));
        assert_eq!(learn(ms(100), 1 << 20, Some(1 << 20)).1, ms(40));
    }

    #[test]
    fn pieces_overlap_by_the_overlap_and_end_at_the_range_end() {
        let r = |lo, hi| Planned { lo, hi };
        assert_eq!(pieces(r(0, 100), 40, 10), vec![r(0, 50), r(40, 90), r(80, 100)]);
        assert_eq!(pieces(r(0, 90), 40, 10), vec![r(0, 50), r(40, 90)]);
        assert_eq!(pieces(r(0, 30), 40, 10), vec![r(0, 30)]);
        // Past the top of the address space: one piece, no overflow.
        assert_eq!(pieces(r(u64::MAX - 100, u64::MAX), u64::MAX - 10, 40), vec![r(u64::MAX - 100, u64::MAX)]);
        let top = pieces(r(u64::MAX - 100, u64::MAX), 40, 40);
        assert_eq!(top, vec![r(u64::MAX - 100, u64::MAX - 20), r(u64::MAX - 60, u64::MAX)]);
    }

    /// A background thread commits a pool's reserved pages only once no binding is at its
    /// import: the commit holds the space's lock across an mprotect that queues for the
    /// memory-map lock, which the binding's hold, `mincore` and pin need.
    #[test]
    fn a_background_commit_waits_for_a_binding_at_its_import() {
        let space = Arc::new(Space::with_window(64 << 20).unwrap());
        let free =
            ImportCost { fixed: Duration::ZERO, untouched_per_mib: Duration::ZERO, populated_per_mib: Duration::ZERO };
        let cfg = ImportConfig::default().plan(PlanConfig::new(1 << 20, 0)).cost(Some(free)).ahead_threads(1);
        let imp = Importer::new(space.clone(), crate::import::Pin::new(), cfg).unwrap();
        let (lo, len) = (4u64 << 20, 256u64 << 10);
        let pool = imp.add_pool(lo, len).unwrap();
        let range = space.range(lo, len).unwrap();
        let at_work = AtWork::new(&imp.core.binding_imports);
        imp.send(AheadJob::Pool(pool, imp.core.state().epoch));
        let until = Instant::now() + Duration::from_millis(100);
        while imp.in_flight().is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(imp.in_flight().len(), 1, "the pool is in flight");
        std::thread::sleep(Duration::from_millis(50));
        assert!(space.allocations_in(range).is_empty(), "committed beside a binding at its import");
        drop(at_work);
        imp.settle();
        assert_eq!(space.allocations_in(range).iter().map(|a| a.range.len()).sum::<u64>(), len);
        assert_eq!(imp.stats().ahead_imports, 1);
    }

    /// A binding's wait for an import in flight is bounded from when it begins: each landing of
    /// another import wakes it to look again, and must not start the bound over. Here an import
    /// that covers the binding sits in the driver (put there by hand: under the pools policy the
    /// background threads enter the driver one at a time, so no real import could land beside
    /// it), and another thread signals a landing every millisecond for two seconds. The
    /// binding's bound is about 40 ms (20 ms left of the pin, 20 ms its own part): it gives up
    /// and imports itself while the signals still come, not after they stop.
    #[test]
    fn a_landing_does_not_start_a_bindings_wait_for_an_import_in_flight_over() {
        let space = Arc::new(Space::with_window(64 << 20).unwrap());
        // Bindings are over committed pages.
        space.commit(space.range(0, 64 << 20).unwrap(), Prot::READ_WRITE).unwrap();
        let ms20 = Duration::from_millis(20);
        let cost = ImportCost { fixed: ms20, untouched_per_mib: Duration::ZERO, populated_per_mib: Duration::ZERO };
        let cfg = ImportConfig::default().plan(PlanConfig::new(1 << 20, 0)).ahead(0).cost(Some(cost)).ahead_threads(1);
        let imp = Importer::new(space, crate::import::Pin::new(), cfg).unwrap();
        imp.add_pool(4 << 20, 64 << 10).unwrap();
        let r = Planned { lo: 4 << 20, hi: (4 << 20) + (64 << 10) };
        imp.core.state().in_flight.push(Flight { r, since: Instant::now(), est: ms20 });
        *imp.core.in_driver.lock().unwrap() = Some((Instant::now(), r));
        let (stop, expired) = (AtomicBool::new(false), AtomicBool::new(false));
        let (bound, signalling) = std::thread::scope(|sc| {
            sc.spawn(|| {
                let end = Instant::now() + Duration::from_secs(2);
                while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                    imp.core.landed.notify_all();
                    std::thread::sleep(Duration::from_millis(1));
                }
                expired.store(Instant::now() >= end, Ordering::Relaxed);
            });
            let bound = imp.bind((4 << 20) + 0x10, 0x10);
            let signalling = !expired.load(Ordering::Relaxed);
            stop.store(true, Ordering::Relaxed);
            (bound, signalling)
        });
        // The flight put in by hand leaves before the importer's drop waits for it, and lands as
        // a real one does: the pool whole over the binding's part may be waiting for it.
        imp.core.state().in_flight.clear();
        *imp.core.in_driver.lock().unwrap() = None;
        imp.core.landed.notify_all();
        assert!(signalling, "the binding waited for as long as other imports landed");
        assert!(bound.unwrap().made);
        assert_eq!(imp.stats().in_flight_waits, 1);
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
            st.imports.insert((lo, st.seq), Live { hi, import: (), ahead: None, made_for });
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
