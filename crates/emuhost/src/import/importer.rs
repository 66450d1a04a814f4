//! The importer: pools, live imports, the retry without the span, cooling, figures and the log.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::backend::{Backend, GpuHandle, HostSpan};
use super::plan::{PlanConfig, Planned, binding_cover, cover, plan};
use super::pools::{PoolId, Pools};
use super::{ImportError, switch_u64};
use crate::space::{Prot, Space, page_size};

/// The default time a range that failed to import is held before it is tried again.
pub const DEFAULT_COOLING: Duration = Duration::from_secs(1);

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
    /// Import ahead (`EMUHOST_IMPORT_AHEAD_MB`, in bytes here; 0: off): when a pool is
    /// registered, a background thread imports the ranges a first binding in each of its chunks
    /// would import (populating them first), so that the binding finds its import ready. At most
    /// this many bytes are imported ahead and not yet used by a binding (in flight included);
    /// past it the worker leaves a pool's chunks to their bindings.
    pub ahead: u64,
}

impl Default for ImportConfig {
    fn default() -> Self {
        Self {
            plan: PlanConfig::default(),
            cooling: DEFAULT_COOLING,
            populate_ahead: PopulateAhead::Off,
            commit: true,
            ahead: 0,
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

    /// The switches this config takes.
    pub const SWITCHES: [&str; 5] = [
        "EMUHOST_IMPORT_CHUNK_MB",
        "EMUHOST_IMPORT_SPAN_MB",
        "EMUHOST_IMPORT_COOLING_MS",
        "EMUHOST_IMPORT_POPULATE_AHEAD",
        "EMUHOST_IMPORT_AHEAD_MB",
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
    /// naming both.
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
                self.plan.span_cap = d.plan.span_cap;
                if let Some(mb) = switch_u64(name, get())? {
                    self.plan.span_cap = mb.checked_mul(1 << 20).ok_or_else(|| ImportError::BadSwitch {
                        name,
                        value: mb.to_string(),
                        why: "too large",
                    })?;
                }
            }
            "EMUHOST_IMPORT_COOLING_MS" => {
                self.cooling = switch_u64(name, get())?.map_or(d.cooling, Duration::from_millis);
            }
            "EMUHOST_IMPORT_AHEAD_MB" => {
                self.ahead = match switch_u64(name, get())? {
                    None => d.ahead,
                    Some(mb) => mb.checked_mul(1 << 20).ok_or_else(|| ImportError::BadSwitch {
                        name,
                        value: mb.to_string(),
                        why: "too large",
                    })?,
                };
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
    /// Imports that took in pages already imported (a binding across two separately imported
    /// chunks imports both again as one: the hitch the span exists to avoid).
    pub reimports: u64,
    /// Bindings served by an import made before.
    pub reuses: u64,
    /// Imports that failed.
    pub failures: u64,
    /// Spanned imports that failed and were made again without the span.
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
    /// Chunks left to their bindings because the budget of bytes ahead was full.
    pub ahead_over_budget: u64,
    /// Bindings served by an import made ahead (its first use).
    pub ahead_hits: u64,
    /// Imports made ahead and released unused: their pool was released, or a larger import
    /// ahead took them in.
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
}

struct State<I> {
    pools: Pools,
    /// Live imports by `(lo, sequence)`: they may overlap (a re-import keeps the old ones).
    imports: BTreeMap<(u64, u64), Live<I>>,
    longest: u64,
    seq: u64,
    cooling: HashMap<Planned, Instant>,
    stats: Stats,
    /// Ranges being imported ahead, off the lock.
    in_flight: Vec<Planned>,
    /// Ranges whose import ahead failed: not tried ahead again (a binding still tries them).
    ahead_failed: HashSet<Planned>,
    /// Counts [`Importer::release_all`] calls: a pool's job asked for before one is not run.
    epoch: u64,
}

impl<I> State<I> {
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

    /// Whether `r` overlaps a range being imported ahead.
    fn in_flight_over(&self, r: Planned) -> bool {
        self.in_flight.iter().any(|f| f.lo < r.hi && r.lo < f.hi)
    }

    fn overlaps(&self, lo: u64, hi: u64) -> bool {
        self.overlapping(lo, hi).next().is_some()
    }

    /// Whether `lo..hi` overlaps a live import that a binding made or used (not one made ahead
    /// and unused: importing over that is not a re-import).
    fn overlaps_used(&self, lo: u64, hi: u64) -> bool {
        self.overlapping(lo, hi).any(|(_, v)| v.ahead.is_none())
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

enum Job {
    /// Populate `lo..hi` (committed).
    Range(u64, u64),
    /// Commit and populate the chunks of `lo..hi` (chunk-aligned) not done before.
    Chunks(u64, u64, u64),
    Flush(mpsc::Sender<()>),
}

struct Populator {
    tx: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    counts: Arc<PopulateCounts>,
}

impl Populator {
    fn start(space: Arc<Space>) -> std::io::Result<Populator> {
        let (tx, rx) = mpsc::channel::<Job>();
        let counts = Arc::new(PopulateCounts::default());
        let c = counts.clone();
        let populate = move |space: &Space, lo: u64, hi: u64, commit: bool| {
            let r = space.range(lo, hi - lo).and_then(|r| {
                if commit {
                    // Only what is reserved: the guest's pages keep their protection.
                    space.commit_reserved(r, Prot::READ_WRITE)?;
                }
                space.populate(r)
            });
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
        };
        let thread = std::thread::Builder::new().name("emuhost-populate".into()).spawn(move || {
            let mut done_chunks = std::collections::HashSet::new();
            for job in rx {
                match job {
                    Job::Range(lo, hi) => populate(&space, lo, hi, false),
                    Job::Chunks(lo, hi, chunk) => {
                        let mut at = lo;
                        while at < hi {
                            if done_chunks.insert(at) {
                                populate(&space, at, at + chunk, true);
                            }
                            at += chunk;
                        }
                    }
                    Job::Flush(done) => {
                        let _ = done.send(());
                    }
                }
            }
        })?;
        Ok(Populator { tx: Some(tx), thread: Some(thread), counts })
    }
}

impl Drop for Populator {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the import-ahead thread is asked.
enum AheadJob {
    /// Import the chunks of this pool (if it is still registered), asked for in this epoch.
    Pool(PoolId, u64),
    Flush(mpsc::Sender<()>),
}

/// The import-ahead thread.
struct AheadWorker {
    tx: Option<mpsc::Sender<AheadJob>>,
    thread: Option<JoinHandle<()>>,
}

/// What the importer and its import-ahead thread share.
struct Core<B: Backend> {
    space: Arc<Space>,
    backend: B,
    cfg: ImportConfig,
    state: Mutex<State<B::Import>>,
    /// Signalled each time an import ahead leaves flight (made or failed).
    landed: Condvar,
    /// Set when the importer is dropped: the thread stops at the next chunk.
    stopping: AtomicBool,
}

/// Guest memory imported into a backend, in chunks, at the first binding inside each (or ahead
/// of it, on a background thread, with [`ImportConfig::ahead`]).
pub struct Importer<B: Backend + 'static> {
    core: Arc<Core<B>>,
    populator: Option<Populator>,
    ahead: Option<AheadWorker>,
}

impl<B: Backend + 'static> std::fmt::Debug for Importer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Importer").field("backend", &self.core.backend.describe()).field("cfg", &self.core.cfg).finish()
    }
}

impl<B: Backend + 'static> Importer<B> {
    /// An importer of `space`'s memory into `backend`.
    ///
    /// A chunk larger than the space's window or than the backend's largest import is refused
    /// ([`ImportError::ChunkTooLarge`]): no binding could import.
    pub fn new(space: Arc<Space>, backend: B, cfg: ImportConfig) -> Result<Self, ImportError> {
        cfg.plan.check(backend.alignment().max(page_size()))?;
        let chunk = cfg.plan.chunk;
        let max = backend.budget().get();
        for (what, limit) in [
            ("the guest window", space.window()),
            ("the backend's largest single import", max.max_single),
            ("the backend's live imported bytes", max.max_bytes),
        ] {
            if chunk > limit {
                return Err(ImportError::ChunkTooLarge { chunk, what, limit });
            }
        }
        let os = |op| move |source| ImportError::Os { op, addr: 0, len: 0, source };
        let populator = if cfg.populate_ahead != PopulateAhead::Off {
            Some(Populator::start(space.clone()).map_err(os("start the populate thread"))?)
        } else {
            None
        };
        let state = State {
            pools: Pools::new(),
            imports: BTreeMap::new(),
            longest: 0,
            seq: 0,
            cooling: HashMap::new(),
            stats: Stats::default(),
            in_flight: Vec::new(),
            ahead_failed: HashSet::new(),
            epoch: 0,
        };
        let core = Arc::new(Core {
            space,
            backend,
            cfg,
            state: Mutex::new(state),
            landed: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        let ahead = if cfg.ahead > 0 {
            let (tx, rx) = mpsc::channel::<AheadJob>();
            let c = core.clone();
            let thread = std::thread::Builder::new()
                .name("emuhost-import-ahead".into())
                .spawn(move || {
                    for job in rx {
                        match job {
                            AheadJob::Pool(id, epoch) => c.ahead_pool(id, epoch),
                            AheadJob::Flush(done) => {
                                let _ = done.send(());
                            }
                        }
                    }
                })
                .map_err(os("start the import-ahead thread"))?;
            Some(AheadWorker { tx: Some(tx), thread: Some(thread) })
        } else {
            None
        };
        Ok(Self { core, populator, ahead })
    }

    pub fn backend(&self) -> &B {
        &self.core.backend
    }

    pub fn config(&self) -> ImportConfig {
        self.core.cfg
    }

    pub fn space(&self) -> &Arc<Space> {
        &self.core.space
    }

    fn state(&self) -> MutexGuard<'_, State<B::Import>> {
        self.core.state()
    }

    /// Registers a game pool `lo..lo + size`. With populate ahead on, its pages (or its chunks) are
    /// faulted in on the background thread; with import ahead on, its chunks are imported on
    /// another.
    pub fn add_pool(&self, lo: u64, size: u64) -> Result<PoolId, ImportError> {
        let (id, epoch) = {
            let mut st = self.state();
            (st.pools.add(lo, size).ok_or(ImportError::BadPool { lo, size })?, st.epoch)
        };
        if let Some(tx) = self.populator.as_ref().and_then(|p| p.tx.as_ref()) {
            let cfg = self.core.cfg;
            let window = self.core.space.window();
            let grain = match cfg.populate_ahead {
                PopulateAhead::Chunks => cfg.plan.chunk,
                _ => page_size(),
            };
            let (a, b) = cover(lo, lo + size, grain).ok_or(ImportError::BadPool { lo, size })?;
            let b = b.min(window / grain * grain);
            if a < b {
                let job = if cfg.populate_ahead == PopulateAhead::Chunks {
                    Job::Chunks(a, b, grain)
                } else {
                    Job::Range(a, b)
                };
                let _ = tx.send(job);
            }
        }
        if let Some(tx) = self.ahead.as_ref().and_then(|w| w.tx.as_ref()) {
            let _ = tx.send(AheadJob::Pool(id, epoch));
        }
        Ok(id)
    }

    /// Releases a pool. Its imports stay (other pools and bindings may use their chunks), except
    /// those made ahead for it that no binding has used: they are released. An import ahead of it
    /// in flight is released when it lands; one not started is not made.
    pub fn remove_pool(&self, id: PoolId) -> bool {
        let mut st = self.state();
        if st.pools.remove(id).is_none() {
            return false;
        }
        let unused: Vec<(u64, u64)> = st.imports.iter().filter(|(_, v)| v.ahead == Some(id)).map(|(k, _)| *k).collect();
        for k in unused {
            self.core.release_unused(&mut st, k);
        }
        true
    }

    /// Waits until every populate and every import ahead asked for so far has run.
    pub fn settle(&self) {
        if let Some(tx) = self.populator.as_ref().and_then(|p| p.tx.as_ref()) {
            let (done, wait) = mpsc::channel();
            if tx.send(Job::Flush(done)).is_ok() {
                let _ = wait.recv();
            }
        }
        if let Some(tx) = self.ahead.as_ref().and_then(|w| w.tx.as_ref()) {
            let (done, wait) = mpsc::channel();
            if tx.send(AheadJob::Flush(done)).is_ok() {
                let _ = wait.recv();
            }
        }
    }

    /// Plans the import a binding would make now, without making it.
    pub fn plan(&self, addr: u64, size: u64) -> Result<Planned, ImportError> {
        let r = plan(&self.state().pools, self.core.cfg.plan, addr, size, true)?;
        Ok(self.core.in_window(r, addr, size))
    }

    /// Binds guest bytes `addr..addr + size`: reuses an import that covers them, or imports.
    pub fn bind(&self, addr: u64, size: u64) -> Result<Bound, ImportError> {
        self.bind_at(addr, size, Instant::now())
    }

    /// [`Importer::bind`] with the time given (cooling is measured against it): for a replay
    /// with a clock of its own, and for tests.
    ///
    /// A binding that finds its import ready returns at once. One whose range an import ahead
    /// is making waits for it to land, then uses it (or imports, if it failed); one with nothing
    /// ready imports. Either way, the time from the call to the return is the binding thread's
    /// wait ([`Stats::waits`], [`Stats::wait_time`], [`Stats::wait_worst`]).
    pub fn bind_at(&self, addr: u64, size: u64, now: Instant) -> Result<Bound, ImportError> {
        let t0 = Instant::now();
        let core = &*self.core;
        let plain = core.in_window(binding_cover(addr, size, core.cfg.plan.chunk)?, addr, size);
        let mut st = self.state();
        let mut waited = false;
        let spanned = loop {
            if let Some(k) = st.covering(addr, addr + size) {
                let live = st.imports.get_mut(&k).expect("the key was just found");
                let range = Planned { lo: k.0, hi: live.hi };
                let first_use = live.ahead.take().is_some();
                let handle = core.backend.handle(&live.import);
                let s = &mut st.stats;
                s.reuses += 1;
                if first_use {
                    s.ahead_hits += 1;
                    s.ahead_bytes -= range.len();
                }
                if waited {
                    s.waited(t0.elapsed());
                }
                return Ok(Bound { range, made: false, spanned: false, handle, offset: addr - range.lo });
            }
            let spanned = core.in_window(plan(&st.pools, core.cfg.plan, addr, size, true)?, addr, size);
            if !st.in_flight_over(plain) && !st.in_flight_over(spanned) {
                break spanned;
            }
            if !waited {
                waited = true;
                st.stats.in_flight_waits += 1;
            }
            st = core.landed.wait(st).unwrap_or_else(|p| p.into_inner());
        };
        let bound = core.bind_importing(&mut st, addr, plain, spanned, now);
        st.stats.waited(t0.elapsed());
        bound
    }

    /// The figures so far.
    pub fn stats(&self) -> Stats {
        let mut s = self.state().stats.clone();
        if let Some(p) = &self.populator {
            s.populated = p.counts.done.load(Ordering::Relaxed);
            s.populate_failures = p.counts.failed.load(Ordering::Relaxed);
            s.populated_bytes = p.counts.bytes.load(Ordering::Relaxed);
        }
        s
    }

    /// The live imports' ranges, by address.
    pub fn imports(&self) -> Vec<Planned> {
        self.state().imports.iter().map(|(&(lo, _), v)| Planned { lo, hi: v.hi }).collect()
    }

    /// Releases every import. Imports ahead asked for before are not made; one in flight is
    /// waited for and released.
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
            self.core.backend.release(live.import);
        }
        st.longest = 0;
        st.stats.live = 0;
        st.stats.live_bytes = 0;
    }
}

impl<B: Backend + 'static> Drop for Importer<B> {
    fn drop(&mut self) {
        self.core.stopping.store(true, Ordering::Relaxed);
        if let Some(mut w) = self.ahead.take() {
            w.tx.take();
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
        self.populator.take();
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

    /// A binding's own import: the spanned range, then (failing or cooling) the plain one.
    fn bind_importing(
        &self,
        st: &mut State<B::Import>,
        addr: u64,
        plain: Planned,
        spanned: Planned,
        now: Instant,
    ) -> Result<Bound, ImportError> {
        let tries: &[(Planned, bool)] =
            if spanned == plain { &[(plain, false)] } else { &[(spanned, true), (plain, false)] };
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
            match self.import(st, range) {
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
                        tracing::warn!("spanned import of {range} failed ({}); made again without the span", chain(&e));
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
        let span = HostSpan::of(&self.space, r.lo, r.len()).map_err(|e| self.wrap(r, e))?;
        // Pages an unused import ahead holds were never imported for a binding: not a re-import
        // (the import ahead was slower than its binding, or a later pool grew the span over it).
        let reimport = st.overlaps_used(r.lo, r.hi);
        for k in superseded {
            if let Some(old) = st.imports.remove(&k) {
                st.stats.live -= 1;
                st.stats.live_bytes -= old.hi - k.0;
                if old.ahead.is_some() {
                    st.stats.ahead_bytes -= old.hi - k.0;
                }
                self.backend.release(old.import);
            }
        }
        let (import, took) = self.make(span, r, false)?;
        let handle = self.backend.handle(&import);
        // Unused imports ahead that the new one covers are taken in (released), once it is made.
        for k in st.unused_inside(r.lo, r.hi) {
            self.release_unused(st, k);
        }
        self.record(st, r, import, took, reimport, None);
        Ok((r.lo, handle))
    }

    fn wrap(&self, r: Planned, source: ImportError) -> ImportError {
        ImportError::Import { lo: r.lo, hi: r.hi, backend: self.backend.kind().name(), source: Box::new(source) }
    }

    /// Commits the reserved pages of `span` (its range `r`), populates them where `populate`
    /// says, and imports it: the import and its time.
    fn make(&self, span: HostSpan, r: Planned, populate: bool) -> Result<(B::Import, Duration), ImportError> {
        let t = Instant::now();
        if self.cfg.commit {
            // Only the reserved pages, under the space's lock: the guest's keep their protection.
            // The span holds the range already, so nothing is decommitted between this and the
            // import.
            self.space.commit_reserved(span.guest(), Prot::READ_WRITE).map_err(|e| self.wrap(r, e.into()))?;
        }
        if populate && let Err(e) = self.space.populate(span.guest()) {
            // The pin faults in what this left (pages the guest made read-only, for one).
            tracing::debug!("populate ahead of the import of {r}: {e}");
        }
        let import = self.backend.import(span).map_err(|e| self.wrap(r, e))?;
        Ok((import, t.elapsed()))
    }

    /// Records a new live import of `r`, its figures and its log line.
    fn record(
        &self,
        st: &mut State<B::Import>,
        r: Planned,
        import: B::Import,
        took: Duration,
        reimport: bool,
        ahead: Option<PoolId>,
    ) {
        st.seq += 1;
        let seq = st.seq;
        st.imports.insert((r.lo, seq), Live { hi: r.hi, import, ahead });
        st.longest = st.longest.max(r.len());
        let s = &mut st.stats;
        s.imports += 1;
        s.reimports += u64::from(reimport);
        s.time += took;
        s.times.push(took);
        s.live += 1;
        s.live_bytes += r.len();
        s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
        if ahead.is_some() {
            s.ahead_imports += 1;
            s.ahead_time += took;
        }
        tracing::info!(
            "import {r} ({} MiB) in {:.2} ms{}{} ({} imports, {:.0} ms in all)",
            r.len() >> 20,
            took.as_secs_f64() * 1e3,
            if ahead.is_some() { " ahead" } else { "" },
            if reimport { ", again over pages imported before" } else { "" },
            s.imports,
            s.time.as_secs_f64() * 1e3
        );
    }

    /// Releases the live import `k`, made ahead and never used.
    fn release_unused(&self, st: &mut State<B::Import>, k: (u64, u64)) {
        if let Some(old) = st.imports.remove(&k) {
            let len = old.hi - k.0;
            let s = &mut st.stats;
            s.live -= 1;
            s.live_bytes -= len;
            s.ahead_bytes -= len;
            s.ahead_released += 1;
            self.backend.release(old.import);
        }
    }

    /// The import-ahead thread's work for one pool: each chunk it touches, in address order,
    /// until the pool is released or the importer dropped.
    fn ahead_pool(&self, id: PoolId, epoch: u64) {
        let Some(pool) = self.state().pools.get(id) else { return };
        let chunk = self.cfg.plan.chunk;
        let Some((mut at, end)) = cover(pool.lo, pool.hi, chunk) else { return };
        let end = end.min(self.space.window());
        while at < end && !self.stopping.load(Ordering::Relaxed) {
            if !self.ahead_chunk(id, epoch, pool.lo.max(at)) {
                return;
            }
            at += chunk;
        }
    }

    /// Imports ahead what a first binding at `addr` (in pool `id`) would import: the spanned
    /// range, or failing that the plain chunk. No import ahead is a re-import: a range is left
    /// out where it overlaps an import a binding made or used, or one in flight, and where it is
    /// cooling or failed ahead before. An unused import ahead inside it is taken in (released
    /// first): a pool registered after it was made can grow the span. `false` once the pool is
    /// gone or every import was released since the job was asked for. (Long: the tries, the
    /// budget and the flight off the lock read best in one place.)
    fn ahead_chunk(&self, id: PoolId, epoch: u64, addr: u64) -> bool {
        let mut st = self.state();
        if st.pools.get(id).is_none() || st.epoch != epoch {
            return false;
        }
        let Ok(plain) = binding_cover(addr, 1, self.cfg.plan.chunk) else { return false };
        let plain = self.in_window(plain, addr, 1);
        let Ok(spanned) = plan(&st.pools, self.cfg.plan, addr, 1, true) else { return false };
        let spanned = self.in_window(spanned, addr, 1);
        let tries: &[(Planned, bool)] = if st.covering(spanned.lo, spanned.hi).is_some() {
            &[]
        } else if st.covering(plain.lo, plain.hi).is_some() {
            &[(spanned, true)]
        } else if spanned == plain {
            &[(plain, false)]
        } else {
            &[(spanned, true), (plain, false)]
        };
        let mut over_budget = false;
        for &(r, is_span) in tries {
            let cooling = st.cooling.get(&r).is_some_and(|&until| Instant::now() < until);
            let over: Vec<((u64, u64), u64, bool)> =
                st.overlapping(r.lo, r.hi).map(|(k, v)| (*k, v.hi, v.ahead.is_some())).collect();
            let replaceable = over.iter().all(|&(k, hi, unused)| unused && r.lo <= k.0 && hi <= r.hi);
            if cooling || st.ahead_failed.contains(&r) || st.in_flight_over(r) || !replaceable {
                continue;
            }
            let freed: u64 = over.iter().map(|(k, hi, _)| hi - k.0).sum();
            if st.stats.ahead_bytes - freed + r.len() > self.cfg.ahead {
                over_budget = true;
                continue;
            }
            for (k, _, _) in over {
                self.release_unused(&mut st, k);
            }
            // In flight: off the lock, so that bindings elsewhere go on; one over this range
            // waits for it.
            st.in_flight.push(r);
            st.stats.ahead_bytes += r.len();
            st.stats.ahead_peak_bytes = st.stats.ahead_peak_bytes.max(st.stats.ahead_bytes);
            drop(st);
            let made = HostSpan::of(&self.space, r.lo, r.len())
                .map_err(|e| self.wrap(r, e))
                .and_then(|span| self.make(span, r, true));
            st = self.state();
            st.in_flight.retain(|f| *f != r);
            match made {
                Ok((import, took)) => {
                    self.record(&mut st, r, import, took, false, Some(id));
                    if st.pools.get(id).is_none() {
                        // Released while in flight: nothing will bind it for this pool.
                        let key = (r.lo, st.seq);
                        self.release_unused(&mut st, key);
                    }
                    self.landed.notify_all();
                    return true;
                }
                Err(e) => {
                    st.stats.ahead_bytes -= r.len();
                    st.stats.ahead_failures += 1;
                    st.ahead_failed.insert(r);
                    let retry = if is_span { "; trying without the span" } else { "" };
                    tracing::warn!("import ahead of {r} failed ({}){retry}", chain(&e));
                    self.landed.notify_all();
                }
            }
        }
        if over_budget {
            st.stats.ahead_over_budget += 1;
        }
        true
    }
}

fn chain(e: &ImportError) -> String {
    super::backend::error_chain(e)
}
