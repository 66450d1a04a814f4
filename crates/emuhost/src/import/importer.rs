//! The importer: pools, live imports, the retry without the span, cooling, figures and the log.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::backend::{Backend, GpuHandle, HostSpan};
use super::plan::{PlanConfig, Planned, binding_cover, cover, plan};
use super::pools::{PoolId, Pools};
use super::{ImportError, switch_u64};
use crate::space::{Prot, Space, page_size};

/// The default time a range that failed to import is held before it is tried again.
pub const DEFAULT_COOLING: Duration = Duration::from_secs(1);

/// How the importer works.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
}

impl Default for ImportConfig {
    fn default() -> Self {
        Self { plan: PlanConfig::default(), cooling: DEFAULT_COOLING, populate_ahead: PopulateAhead::Off, commit: true }
    }
}

impl ImportConfig {
    /// The switches this config takes.
    pub const SWITCHES: [&str; 4] = [
        "EMUHOST_IMPORT_CHUNK_MB",
        "EMUHOST_IMPORT_SPAN_MB",
        "EMUHOST_IMPORT_COOLING_MS",
        "EMUHOST_IMPORT_POPULATE_AHEAD",
    ];

    /// The config [`Settings`](crate::settings::Settings) gives.
    pub fn from_settings(settings: &crate::settings::Settings) -> Self {
        settings.import
    }

    /// The defaults, changed by `EMUHOST_IMPORT_CHUNK_MB`, `EMUHOST_IMPORT_SPAN_MB`,
    /// `EMUHOST_IMPORT_COOLING_MS` and `EMUHOST_IMPORT_POPULATE_AHEAD` with their values from
    /// `get` (`None`: unset).
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
}

impl Stats {
    /// The slowest single import.
    pub fn worst(&self) -> Duration {
        self.times.iter().copied().max().unwrap_or_default()
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
}

struct State<I> {
    pools: Pools,
    /// Live imports by `(lo, sequence)`: they may overlap (a re-import keeps the old ones).
    imports: BTreeMap<(u64, u64), Live<I>>,
    longest: u64,
    seq: u64,
    cooling: HashMap<Planned, Instant>,
    stats: Stats,
}

impl<I> State<I> {
    /// The live imports that could overlap `lo..hi`: those starting below `hi`, no further back
    /// than the longest import.
    fn near(&self, lo: u64, hi: u64) -> impl Iterator<Item = (u64, &Live<I>)> {
        let from = lo.saturating_sub(self.longest);
        self.imports.range((from, 0)..(hi, 0)).map(|(&(l, _), v)| (l, v))
    }

    /// A live import covering `lo..hi`: its range and the import.
    fn covering(&self, lo: u64, hi: u64) -> Option<(Planned, &I)> {
        self.near(lo, hi).find(|(l, v)| *l <= lo && hi <= v.hi).map(|(l, v)| (Planned { lo: l, hi: v.hi }, &v.import))
    }

    fn overlaps(&self, lo: u64, hi: u64) -> bool {
        self.near(lo, hi).any(|(_, v)| v.hi > lo)
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

/// Guest memory imported into a backend, in chunks, at the first binding inside each.
pub struct Importer<B: Backend> {
    space: Arc<Space>,
    backend: B,
    cfg: ImportConfig,
    state: Mutex<State<B::Import>>,
    populator: Option<Populator>,
}

impl<B: Backend> std::fmt::Debug for Importer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Importer").field("backend", &self.backend.describe()).field("cfg", &self.cfg).finish()
    }
}

impl<B: Backend> Importer<B> {
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
        let populator = if cfg.populate_ahead != PopulateAhead::Off {
            Some(Populator::start(space.clone()).map_err(|source| ImportError::Os {
                op: "start the populate thread",
                addr: 0,
                len: 0,
                source,
            })?)
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
        };
        Ok(Self { space, backend, cfg, state: Mutex::new(state), populator })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn config(&self) -> ImportConfig {
        self.cfg
    }

    pub fn space(&self) -> &Arc<Space> {
        &self.space
    }

    fn state(&self) -> MutexGuard<'_, State<B::Import>> {
        // The state stays consistent across a panic in a backend call (the maps are updated only
        // after a call returns).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a game pool `lo..lo + size`. With populate ahead on, its pages (or its chunks) are
    /// faulted in on the background thread.
    pub fn add_pool(&self, lo: u64, size: u64) -> Result<PoolId, ImportError> {
        let id = self.state().pools.add(lo, size).ok_or(ImportError::BadPool { lo, size })?;
        if let Some(tx) = self.populator.as_ref().and_then(|p| p.tx.as_ref()) {
            let window = self.space.window();
            let grain = match self.cfg.populate_ahead {
                PopulateAhead::Chunks => self.cfg.plan.chunk,
                _ => page_size(),
            };
            let (a, b) = cover(lo, lo + size, grain).ok_or(ImportError::BadPool { lo, size })?;
            let b = b.min(window / grain * grain);
            if a < b {
                let job = if self.cfg.populate_ahead == PopulateAhead::Chunks {
                    Job::Chunks(a, b, grain)
                } else {
                    Job::Range(a, b)
                };
                let _ = tx.send(job);
            }
        }
        Ok(id)
    }

    /// Releases a pool (its imports stay: other pools and bindings may use their chunks).
    pub fn remove_pool(&self, id: PoolId) -> bool {
        self.state().pools.remove(id).is_some()
    }

    /// Waits until every populate asked for so far has run.
    pub fn settle(&self) {
        if let Some(tx) = self.populator.as_ref().and_then(|p| p.tx.as_ref()) {
            let (done, wait) = mpsc::channel();
            if tx.send(Job::Flush(done)).is_ok() {
                let _ = wait.recv();
            }
        }
    }

    /// Plans the import a binding would make now, without making it.
    pub fn plan(&self, addr: u64, size: u64) -> Result<Planned, ImportError> {
        let r = plan(&self.state().pools, self.cfg.plan, addr, size, true)?;
        Ok(self.in_window(r, addr, size))
    }

    /// `r` cut at the window's end where the binding `addr..addr + size` lies inside the window
    /// and `r` does not: a binding near the end imports the part of its chunks that exists. (A
    /// binding past the end keeps its cover and fails as outside the window.)
    fn in_window(&self, r: Planned, addr: u64, size: u64) -> Planned {
        let window = self.space.window();
        let inside = addr.checked_add(size).is_some_and(|end| end <= window);
        if inside && r.hi > window { Planned { lo: r.lo, hi: window } } else { r }
    }

    /// Binds guest bytes `addr..addr + size`: reuses an import that covers them, or imports.
    pub fn bind(&self, addr: u64, size: u64) -> Result<Bound, ImportError> {
        self.bind_at(addr, size, Instant::now())
    }

    /// [`Importer::bind`] with the time given (cooling is measured against it): for a replay
    /// with a clock of its own, and for tests.
    pub fn bind_at(&self, addr: u64, size: u64, now: Instant) -> Result<Bound, ImportError> {
        let plain = self.in_window(binding_cover(addr, size, self.cfg.plan.chunk)?, addr, size);
        let mut st = self.state();
        if let Some((range, import)) = st.covering(addr, addr + size) {
            let handle = self.backend.handle(import);
            st.stats.reuses += 1;
            return Ok(Bound { range, made: false, spanned: false, handle, offset: addr - range.lo });
        }
        let spanned = self.in_window(plan(&st.pools, self.cfg.plan, addr, size, true)?, addr, size);
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
            match self.import(&mut st, range) {
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
        let wrap = |source: ImportError| ImportError::Import {
            lo: r.lo,
            hi: r.hi,
            backend: self.backend.kind().name(),
            source: Box::new(source),
        };
        let span = HostSpan::of(&self.space, r.lo, r.len()).map_err(wrap)?;
        let reimport = st.overlaps(r.lo, r.hi);
        for k in superseded {
            if let Some(old) = st.imports.remove(&k) {
                st.stats.live -= 1;
                st.stats.live_bytes -= old.hi - k.0;
                self.backend.release(old.import);
            }
        }
        let t = Instant::now();
        if self.cfg.commit {
            // Only the reserved pages, under the space's lock: the guest's keep their protection.
            // The span holds the range already, so nothing is decommitted between this and the
            // import.
            self.space.commit_reserved(span.guest(), Prot::READ_WRITE).map_err(|e| wrap(e.into()))?;
        }
        let import = self.backend.import(span).map_err(wrap)?;
        let took = t.elapsed();
        let handle = self.backend.handle(&import);
        st.seq += 1;
        let seq = st.seq;
        st.imports.insert((r.lo, seq), Live { hi: r.hi, import });
        st.longest = st.longest.max(r.len());
        let s = &mut st.stats;
        s.imports += 1;
        s.reimports += u64::from(reimport);
        s.time += took;
        s.times.push(took);
        s.live += 1;
        s.live_bytes += r.len();
        s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
        tracing::info!(
            "import {r} ({} MiB) in {:.2} ms{} ({} imports, {:.0} ms in all)",
            r.len() >> 20,
            took.as_secs_f64() * 1e3,
            if reimport { ", again over pages imported before" } else { "" },
            s.imports,
            s.time.as_secs_f64() * 1e3
        );
        Ok((r.lo, handle))
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

    /// Releases every import.
    pub fn release_all(&self) {
        let mut st = self.state();
        let imports = std::mem::take(&mut st.imports);
        for (_, live) in imports {
            self.backend.release(live.import);
        }
        st.longest = 0;
        st.stats.live = 0;
        st.stats.live_bytes = 0;
    }
}

impl<B: Backend> Drop for Importer<B> {
    fn drop(&mut self) {
        self.populator.take();
        self.release_all();
    }
}

fn chain(e: &ImportError) -> String {
    super::backend::error_chain(e)
}
