//! The importer: pools, live imports, the retry without the span, cooling, figures and the log.
//!
//! Split by what each part does: [`config`] (the typed config and policy), [`state`] (the
//! shared state and the index of live imports), [`bind`] (the binding path both policies take),
//! [`chunks_policy`] and [`pools_policy`] (each policy's binding), [`ahead`] (the background
//! queue and threads), [`cap`] (the cap on live imports). The cost model is [`super::cost`]. This file holds the [`Importer`] and
//! what its calls share.

mod ahead;
mod bind;
mod cap;
mod chunks_policy;
mod config;
mod merge;
mod pools_policy;
mod state;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::ImportError;
use super::backend::Backend;
use super::cost::ImportCost;
use super::plan::{PlanConfig, Planned, cover, pool_range};
use super::pools::PoolId;
use crate::space::{Space, page_size};
use ahead::{AheadJob, AheadQueue, PopulateCounts};
pub use cap::MERGE_LIMIT;
pub use config::{
    ChunksConfig, DEFAULT_AHEAD, DEFAULT_AHEAD_PIECE, DEFAULT_COOLING, DEFAULT_WAIT, ImportConfig, ImportPolicy,
    PoolsConfig, PopulateAhead,
};
use state::State;
pub use state::{Bound, Stats};

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
    /// Releases under way (any thread): a binding's slow import says whether it met one, and
    /// one at the cap waits for them ([`cap`]).
    releasing: AtomicU64,
    /// Signalled when a release ends.
    released: (Mutex<()>, Condvar),
    /// The backend imports this importer holds or is making: taken under the state's lock
    /// before the backend's call, given back when it fails or the import is released ([`cap`]).
    slots: AtomicU64,
    /// The most live imports: [`ImportConfig::max_live`], at most the backend's count limit.
    cap: u64,
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
/// ([`ImportPolicy::Chunks`]). The default policy is pools on Linux, chunks on Windows
/// ([`ImportPolicy`]'s default says why).
///
/// With the pin backend (no GPU: the pages are locked in memory) and the chunks policy:
///
/// ```
/// use std::sync::Arc;
/// use emuhost::import::{GpuHandle, ImportConfig, ImportError, ImportPolicy, Importer, Pin, Planned};
/// use emuhost::space::{Prot, Space};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// const MIB: u64 = 1 << 20;
/// let space = Arc::new(Space::with_window(16 * MIB)?);
/// space.commit(space.range(0, 8 * MIB)?, Prot::READ_WRITE)?;
///
/// // 1 MiB chunks, imported at the first binding inside each.
/// let cfg = ImportConfig::default().chunk(MIB).policy(ImportPolicy::chunks());
/// let importer = Importer::new(space.clone(), Pin::new(), cfg)?;
///
/// // The first binding in a chunk imports it; the bytes lie at `offset` in the import.
/// let bound = importer.bind(MIB + 0x1000, 0x100)?;
/// assert_eq!((bound.range, bound.made), (Planned { lo: MIB, hi: 2 * MIB }, true));
/// assert_eq!((bound.offset, bound.handle), (0x1000, GpuHandle::None));
/// // A second binding in the same chunk reuses the import.
/// assert!(!importer.bind(MIB + 0x8000, 0x10)?.made);
/// assert_eq!((importer.stats().imports, importer.imports()), (1, vec![bound.range]));
///
/// // Pages not committed are refused before anything is tried.
/// let err = importer.bind(12 * MIB, 0x10).unwrap_err();
/// assert!(matches!(err, ImportError::NotCommitted { .. }), "{err}");
///
/// importer.release_all();
/// assert!(importer.imports().is_empty());
/// # Ok(())
/// # }
/// ```
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
    ///
    /// # Errors
    /// [`ImportError::BadChunk`] for a chunk that is not a power of two of at least the
    /// backend's alignment, [`ImportError::ChunkTooLarge`] as above, the backend's error from
    /// measuring the import cost, or [`ImportError::Space`] (an OS error) where a background
    /// thread cannot be started.
    pub fn new(space: Arc<Space>, backend: B, cfg: ImportConfig) -> Result<Self, ImportError> {
        let align = backend.alignment().max(page_size());
        check_chunk(&space, &backend, &cfg, align)?;
        let (cost, granule) = match &cfg.policy {
            // No cost is read: a free import, whose granule is the largest.
            ImportPolicy::Chunks(_) => (ImportCost::default(), ImportCost::default().granule(Duration::ZERO, align)),
            ImportPolicy::Pools(p) => {
                let cost = match p.cost {
                    Some(c) => c,
                    None => crate::faults::unfaulted(|| ImportCost::measure(&backend))?,
                };
                let granule = cost.granule(p.wait, align);
                tracing::info!(
                    "import cost on {}: {cost}; a binding imports at most {} KiB itself",
                    backend.kind().name(),
                    granule >> 10
                );
                (cost, granule)
            }
        };
        let os = |op| move |source| ImportError::os(op, 0, 0, source);
        let state = State::new(cost, granule);
        let max_count = backend.budget().get().max_count;
        let cap = cfg.max_live.map_or(cap::default_cap(max_count), |m| m.min(max_count)).max(1);
        // Said where it is a limit a session can meet (lavapipe's and NVIDIA's 2^32 - 1 is none).
        if cap < u64::from(u32::MAX) {
            tracing::info!("at most {cap} live imports on {}", backend.kind().name());
        }
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
            released: (Mutex::new(()), Condvar::new()),
            slots: AtomicU64::new(0),
            cap,
            populate_counts: PopulateCounts::default(),
            queue: Mutex::new(AheadQueue::default()),
            queued: Condvar::new(),
            idle: Condvar::new(),
        });
        let mut ahead = Vec::new();
        for i in 0..background_threads(&cfg) {
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

    /// The backend it imports with.
    pub fn backend(&self) -> &B {
        &self.core.backend
    }

    /// The configuration it was made with.
    pub fn config(&self) -> ImportConfig {
        self.core.cfg
    }

    /// The most live imports this importer keeps to: [`ImportConfig::max_live`], at most the
    /// backend's limit on live allocations (Vulkan's `maxMemoryAllocationCount`) when it was
    /// made; unset, three quarters of that limit; `u64::MAX` where neither limits them. At the
    /// cap a binding's import frees or merges others, and where nothing can make room it
    /// imports over the cap, never past the backend's own limit (the module `importer::cap`
    /// says how).
    pub fn max_live(&self) -> u64 {
        self.core.cap
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

    /// The space whose guest memory it imports.
    pub fn space(&self) -> &Arc<Space> {
        &self.core.space
    }

    fn state(&self) -> MutexGuard<'_, State<B::Import>> {
        self.core.state()
    }

    /// Registers a game pool `lo..lo + size`. With populate ahead on, its pages (or its chunks) are
    /// faulted in on the background thread. Under the pools policy, a pool in a region where a
    /// binding was made is imported ahead on another.
    ///
    /// # Errors
    /// [`ImportError::OutOfWindow`] for a pool that runs past the window's end,
    /// [`ImportError::BadPool`] for an empty one.
    pub fn add_pool(&self, lo: u64, size: u64) -> Result<PoolId, ImportError> {
        let window = self.core.space.window();
        if size > 0 && lo.checked_add(size).is_some_and(|end| end > window) {
            return Err(ImportError::OutOfWindow { addr: lo, size, window });
        }
        let (id, epoch, hot) = {
            let mut st = self.state();
            let id = st.pools.add(lo, size).ok_or(ImportError::BadPool { lo, size })?;
            let chunk = self.core.cfg.chunk;
            let hot = regions(lo, lo + size, chunk).any(|c| st.hot.contains(&c));
            (id, st.epoch, hot)
        };
        if self.core.cfg.populate_ahead != PopulateAhead::Off {
            let cfg = self.core.cfg;
            let window = self.core.space.window();
            let grain = match cfg.populate_ahead {
                PopulateAhead::Chunks => cfg.chunk,
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
        if hot && self.core.cfg.policy.pools_config().is_some_and(|p| p.ahead > 0) {
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
        let dead = match self.core.cfg.policy {
            ImportPolicy::Chunks(_) => chunks_policy::released_with(&st, id),
            ImportPolicy::Pools(_) => pools_policy::released_with(&st, id, pool),
        };
        let dead: Vec<B::Import> = dead.into_iter().filter_map(|k| self.core.take_out(&mut st, k)).collect();
        drop(st);
        for import in dead {
            self.core.release(import);
        }
        true
    }

    /// Plans the import a binding would make now, without making it (under the pools policy, its
    /// pools whole, even where it would import only its part of them first).
    ///
    /// # Errors
    /// As [`plan`](super::plan) ([`ImportError::EmptyBinding`], [`ImportError::BindingWraps`],
    /// ...).
    pub fn plan(&self, addr: u64, size: u64) -> Result<Planned, ImportError> {
        let st = self.state();
        let r = match self.core.cfg.policy {
            ImportPolicy::Chunks(c) => self.core.chunk_plan(&c, &st, addr, size)?,
            ImportPolicy::Pools(_) => pool_range(&st.pools, addr, size, self.core.align)?,
        };
        Ok(self.core.in_window(r, addr, size))
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
        let s = self.stats();
        if s.waits > 0 {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            tracing::debug!(
                "waits for imports: {} in {:.2} ms; the lock {:.2} ms; in flight {} in {:.2} ms; own imports beside a \
                 background import in the driver {} in {:.2} ms; own imports alone {} in {:.2} ms",
                s.waits,
                ms(s.wait_time),
                ms(s.wait_lock),
                s.wait_flight.0,
                ms(s.wait_flight.1),
                s.wait_beside_driver.0,
                ms(s.wait_beside_driver.1),
                s.wait_own.0,
                ms(s.wait_own.1)
            );
        }
        self.release_all();
    }
}

impl<B: Backend> Core<B> {
    fn state(&self) -> MutexGuard<'_, State<B::Import>> {
        // The state stays consistent across a panic in a backend call (the maps are updated only
        // after a call returns). What this thread imported under the lock before is logged first.
        state::log_made();
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

    /// Releases `import` (counted while under way, for the debug log of slow imports and a
    /// binding at the cap), and gives its slot back.
    fn release(&self, import: B::Import) {
        self.releasing.fetch_add(1, Ordering::AcqRel);
        self.backend.release(import);
        self.slots.fetch_sub(1, Ordering::AcqRel);
        self.releasing.fetch_sub(1, Ordering::AcqRel);
        let _done = self.released.0.lock().unwrap_or_else(|p| p.into_inner());
        self.released.1.notify_all();
    }

    fn wrap(&self, r: Planned, source: ImportError) -> ImportError {
        ImportError::Import { lo: r.lo, hi: r.hi, backend: self.backend.kind().name(), source: Box::new(source) }
    }
}

/// The indices of the `chunk`-sized regions that `lo..hi` (not empty) touches.
fn regions(lo: u64, hi: u64, chunk: u64) -> std::ops::RangeInclusive<u64> {
    lo / chunk..=(hi - 1) / chunk
}

fn chain(e: &ImportError) -> String {
    super::backend::error_chain(e)
}

/// Refuses a chunk no binding could import with: one not a power of two or under `align`, one
/// past the space's window, or under the chunks policy one past the backend's largest import.
fn check_chunk<B: Backend>(space: &Space, backend: &B, cfg: &ImportConfig, align: u64) -> Result<(), ImportError> {
    let chunk = cfg.chunk;
    PlanConfig::new(chunk, 0).check(align)?;
    let max = backend.budget().get();
    for (what, limit) in [
        ("the guest window", space.window()),
        ("the backend's largest single import", max.max_single),
        ("the backend's live imported bytes", max.max_bytes),
    ] {
        // Under the pools policy the chunk is only a region's size: the backend's limits do
        // not bear on it, but one past the window is still a mistake.
        let applies = matches!(cfg.policy, ImportPolicy::Chunks(_)) || what == "the guest window";
        if chunk > limit && applies {
            return Err(ImportError::ChunkTooLarge { chunk, what, limit });
        }
    }
    Ok(())
}

/// The background threads `cfg` asks for. Under the pools policy, a quarter of the processors,
/// one to four, unless given: enough to keep ahead of a burst of pools where bindings start
/// (they are independent ranges), not so many that their populates crowd out the game's
/// threads. Under the chunks policy, one for populates ahead.
fn background_threads(cfg: &ImportConfig) -> usize {
    match &cfg.policy {
        ImportPolicy::Pools(p) if p.ahead_threads > 0 => p.ahead_threads as usize,
        ImportPolicy::Pools(_) => std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).clamp(1, 4)),
        ImportPolicy::Chunks(_) => usize::from(cfg.populate_ahead != PopulateAhead::Off),
    }
}
