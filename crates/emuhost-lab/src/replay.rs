//! Replays a trace through the runtime: `space` (commits, decommits, guest stores), `import` (pools
//! and bindings), `watch` (collects) and `sched` (short sleeps), one OS thread per trace thread,
//! with frames kept in step: every thread finishes frame N before any starts frame N + 1.
//!
//! The reading thread dispatches records to the threads as it streams them (the session never
//! sits in memory as objects), and checks what a bad trace gets wrong: a guest write must fall
//! in memory the trace committed writable in an earlier frame (or earlier on the same thread). The
//! write itself goes through [`Space::store`], which checks again and copies through the kernel
//! (an armed page is marked written as the tracker's fault handler would; with uffd the kernel
//! records the write), so it never faults. Freed pages under a live GPU import are zeroed, not
//! decommitted. Guest writes are checked against the collects that cover them: each must be
//! reported by the first collect of its page that started after the store ended (or one before
//! it that ran beside the store); those that are not are lost writes.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use emuhost::import::{AnyBackend, Backend, ImportError, Importer, PoolId};
use emuhost::sched::{self, Caller, OsHost, Sleeper};
use emuhost::settings::Settings;
use emuhost::space::ranges::RangeMap;
use emuhost::space::{GuestAddr, LockWaits, Space, SpaceConfig, SpaceError, page_size};
use emuhost::watch::{Tracker, WatchError};

use crate::trace::{Event, FileReader, Header, Record, SleepKind, Thread, TraceError};

mod snapshots;

pub use snapshots::{MAX_REWIND, MAX_SNAPSHOT_EVERY, REWIND_INTERVAL, SnapshotFigures};
use snapshots::{MemLog, MemOp, SnapRun, page_bounds};

/// What went wrong in a replay. Errors from the trace or from an event name the trace line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The trace could not be read or parsed (the error names the line).
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A line the replay refuses: past one of its caps ([`MAX_WRITE`], [`MAX_SLEEP_NS`],
    /// [`MAX_THREADS`] ...), a store outside memory committed writable before it, or a race
    /// between threads within a frame; or a pool released that was never added.
    #[error("line {line}: {what}")]
    Bad {
        /// The trace line, from 1 (the header is line 1).
        line: u64,
        /// What is wrong with it.
        what: String,
    },
    /// The runtime refused an event (a commit outside the window, a failed collect ...).
    #[error("line {line}: {event} failed")]
    Event {
        /// The trace line, from 1.
        line: u64,
        /// The event, as the trace writes it.
        event: String,
        /// The runtime's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The OS refused a thread for a trace thread (the replay runs one each).
    #[error("line {line}: starting an OS thread for trace thread {thread} failed")]
    Spawn {
        /// The trace line of the thread's first event.
        line: u64,
        /// The trace thread (`r`, `g0`, ...).
        thread: String,
        /// The OS's error.
        #[source]
        source: std::io::Error,
    },
    /// The guest space could not be made (the header's window could not be reserved).
    #[error(transparent)]
    Space(#[from] SpaceError),
    /// The replay's config asks for what cannot be made ([`ReplayConfig::check`]): the error
    /// names the value.
    #[error("{what}")]
    Config {
        /// What is wrong, naming the value.
        what: String,
    },
    /// A snapshot, a restore or the rewind check's work at a frame's end failed
    /// ([`ReplayConfig::snapshot_every`], [`ReplayConfig::rewind`]).
    #[error("line {line}: {what} failed")]
    Snapshot {
        /// The trace line of the `frame` that begins after it.
        line: u64,
        /// What failed, naming the frame.
        what: String,
        /// The runtime's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The write tracker could not be made.
    #[error(transparent)]
    Watch(#[from] WatchError),
    /// No import backend could be picked, or the importer could not be made (an import chunk
    /// larger than the window ...).
    #[error(transparent)]
    Import(#[from] ImportError),
}

/// How a replay runs: the switches (the import backend and config, the write-tracking backend
/// and verify mode, the short-sleep rule) and the pacing. The replay reads no environment
/// variable: a caller that wants the `EMUHOST_*` switches passes [`Settings::from_env`].
/// [`replay`] has an example.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ReplayConfig {
    /// Keep the trace's frame times, with emuhost's host sleep as the frame limiter.
    pub paced: bool,
    /// The runtime's switches: import backend and config, write-tracking backend and verify
    /// mode, short-sleep rule. The default is every switch's default, not the environment's.
    pub settings: Settings,
    /// Counts the frames begun (every thread done with the frame before), for a progress display.
    pub frames_begun: Option<Arc<AtomicU64>>,
    /// A snapshot of the guest window at the end of every this many frames, taken on the render
    /// thread while the other threads wait at the frame boundary (1 to [`MAX_SNAPSHOT_EVERY`]).
    pub snapshot_every: Option<u64>,
    /// The rewind check: every [`REWIND_INTERVAL`]·K frames, the snapshot taken K frames back is
    /// restored, those frames' changes of guest memory are made again and the memory is compared
    /// with the first time's (1 to [`MAX_REWIND`], a multiple of `snapshot_every`, which it needs).
    pub rewind: Option<u64>,
    /// With `rewind` K: a rewind every this many frames instead of [`REWIND_INTERVAL`]·K (a
    /// multiple of K, at least 2·K): fewer rewinds, each checked the same (each check reads the
    /// whole guest memory twice), so short rewinds can be timed over a whole session.
    pub rewind_every: Option<u64>,
    /// Test hook: rewinds do not restore, to show that the check catches it.
    #[cfg(test)]
    pub(crate) skip_restore: bool,
}

impl ReplayConfig {
    /// Checks the snapshot settings: each error names the value.
    ///
    /// # Errors
    /// [`ReplayError::Config`]: `snapshot_every` or `rewind` 0 or past its cap, `rewind` without
    /// `snapshot_every` or not a multiple of it, `rewind_every` without `rewind`, not a multiple
    /// of it or under twice it.
    pub fn check(&self) -> Result<(), ReplayError> {
        let bad = |what: String| Err(ReplayError::Config { what });
        if let Some(n) = self.snapshot_every
            && !(1..=MAX_SNAPSHOT_EVERY).contains(&n)
        {
            return bad(format!("a snapshot every {n} frames: 1 to {MAX_SNAPSHOT_EVERY} frames"));
        }
        match (self.rewind_every, self.rewind) {
            (Some(m), None) => return bad(format!("a rewind every {m} frames needs a rewind (rewind)")),
            (Some(m), Some(k)) if !m.is_multiple_of(k) || m / 2 < k => {
                return bad(format!(
                    "a rewind of {k} frames every {m} frames: the interval must be a multiple of the rewind and at least twice it"
                ));
            }
            _ => {}
        }
        match (self.rewind, self.snapshot_every) {
            (Some(k), _) if !(1..=MAX_REWIND).contains(&k) => {
                bad(format!("a rewind of {k} frames: 1 to {MAX_REWIND} frames"))
            }
            (Some(k), None) => bad(format!("a rewind of {k} frames needs snapshots (snapshot_every)")),
            (Some(k), Some(n)) if !k.is_multiple_of(n) => bad(format!(
                "a rewind of {k} frames with a snapshot every {n}: the rewind must be a multiple of it (it restores the snapshot taken {k} frames back)"
            )),
            _ => Ok(()),
        }
    }
}

/// One frame's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FrameFigures {
    /// The frame's index, as the trace's `frame` line gives it.
    pub index: u64,
    /// Time the render thread spent in the runtime (bindings and collects) during the frame.
    pub runtime: Duration,
    /// Of `runtime`, the time in bindings that made an import.
    pub imports: Duration,
    /// Of `runtime`, the time in collects.
    pub collects: Duration,
    /// From this frame's present to the next one's.
    pub present_to_present: Duration,
    /// Imports made during the frame.
    pub imports_made: u32,
    /// The snapshot's take at the frame's end, on the render thread ([`ReplayConfig::snapshot_every`]).
    pub snapshot: Duration,
}

/// Short sleeps of one kind: how many, the time asked, and the CPU time and wall time spent in them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SleepFigures {
    /// Sleeps made.
    pub count: u64,
    /// Their asked durations, added up.
    pub asked: Duration,
    /// CPU time the sleeping threads used in them (busy-waiting shows here).
    pub cpu: Duration,
    /// Wall time spent in them (oversleep shows as `wall` over `asked`).
    pub wall: Duration,
}

/// A replay's report ([`replay`] has an example). Sizes are in bytes.
#[derive(Clone, Debug, Default)]
pub struct ReplayReport {
    /// The import backend picked, described (kind and device).
    pub import_backend: String,
    /// The write-tracking backend picked (`uffd`, `mprotect`, `writewatch` ...).
    pub watch_backend: String,
    /// The short-sleep rule used, and why.
    pub sleep_rule: String,
    /// [`ReplayConfig::paced`].
    pub paced: bool,
    /// Trace records dispatched.
    pub events: u64,
    /// Trace threads (each ran on an OS thread of its own).
    pub threads: usize,
    /// From the first record dispatched until every thread was done.
    pub wall: Duration,
    /// The frames (the trace's `frame` lines, the render thread's), by index.
    pub frames: Vec<FrameFigures>,
    /// Imports made ([`emuhost::import::Stats::imports`]), ahead ones included.
    pub imports: u64,
    /// Imports a binding made that took in pages already imported, e.g. a binding across two
    /// chunks imported apart ([`emuhost::import::Stats::reimports`]).
    pub reimports: u64,
    /// Time spent in imports, all together.
    pub import_time: Duration,
    /// The longest import.
    pub worst_import: Duration,
    /// The binding thread's waits for imports, whoever made them (its own, or one made ahead
    /// and still in flight): all together and the longest ([`emuhost::import::Stats::wait_time`]).
    pub import_wait_total: Duration,
    /// The longest of those waits.
    pub import_wait_worst: Duration,
    /// Imports made on the background thread (ahead of their bindings, or a pool whole behind a
    /// binding's part of it), in `imports` too.
    pub ahead_imports: u64,
    /// Pools policy: bindings that imported only their part of a pool, and the pools imported
    /// whole behind them ([`emuhost::import::Stats::pieces`], `widenings`).
    pub import_pieces: u64,
    /// See `import_pieces`.
    pub import_widenings: u64,
    /// Pools policy: bindings that waited for an import in flight that covered them
    /// ([`emuhost::import::Stats::in_flight_waits`]).
    pub import_in_flight_waits: u64,
    /// The most bytes imported ahead and not yet bound at once: memory made resident ahead of
    /// use ([`emuhost::import::Stats::ahead_peak_bytes`]).
    pub ahead_bytes_peak: u64,
    /// The most bytes the trace had committed at once (its commits less its decommits).
    pub committed_bytes_peak: u64,
    /// The import cost the pools policy measured, or was given (`None` under the chunks policy).
    pub import_cost: Option<emuhost::import::ImportCost>,
    /// Whether the import cost was given rather than measured.
    pub import_cost_given: bool,
    /// Imports the backend refused ([`emuhost::import::Stats::failures`]).
    pub import_failures: u64,
    /// Bytes imported and live at the trace's end, before the teardown released them.
    pub live_import_bytes_end: u64,
    /// The most bytes imported and live at once.
    pub live_import_bytes_peak: u64,
    /// The most live imports at once ([`emuhost::import::Stats::peak_live`]): what a backend's cap
    /// on live allocations (`maxMemoryAllocationCount`) bears on.
    pub live_imports_peak: u64,
    /// Pools merged into one import once whole, the imports those merges replaced, and imports
    /// made over the cap on live imports ([`emuhost::import::Stats::merges`],
    /// [`emuhost::import::Stats::merged_away`], [`emuhost::import::Stats::over_cap`]).
    pub import_merges: u64,
    /// See `import_merges`.
    pub import_merged_away: u64,
    /// See `import_merges`.
    pub imports_over_cap: u64,
    /// Imports and their bytes the import backend still counts live after the replay released
    /// every import (its own budget: taken at each import, given back at each release): 0 unless
    /// an import leaked.
    pub live_imports_after_teardown: u64,
    /// See `live_imports_after_teardown`.
    pub live_import_bytes_after_teardown: u64,
    /// Whether each collect was checked against a region query.
    pub verify_collect: bool,
    /// Collects made.
    pub collects: u64,
    /// Time in collects, all together (the frames' `collects` added up).
    pub collect_time: Duration,
    /// Pages the collects reported written, all together.
    pub pages_reported: u64,
    /// Guest writes, counted in pages (a write over three pages counts three).
    pub writes: u64,
    /// Written pages that no collect reported that should have (see the module's docs): 0
    /// unless write tracking lost a write.
    pub lost_writes: u64,
    /// Writes no later collect covered (nothing to check them against).
    pub unchecked_writes: u64,
    /// The trace's short sleeps on guest threads.
    pub guest_sleeps: SleepFigures,
    /// The trace's short sleeps on host threads (a paced replay's waits for a frame's time are
    /// not counted).
    pub host_sleeps: SleepFigures,
    /// Freed ranges zeroed in place because a live import covered them.
    pub zeroed_under_import: u64,
    /// Bindings the importer could not import (the driver refused, or the range was cooling after
    /// it did): the replay goes on, as a game does (it would copy instead).
    pub bind_failures: u64,
    /// Changes of the mappings (commits, arms ...) that waited for a background populate or pin
    /// to end before they took the space's lock ([`emuhost::space::Space::long_read_waits`]).
    pub long_read_waits: u64,
    /// The render thread's waits for the space's lock (its collects' and bindings'), each timed
    /// from asking for the lock until getting it ([`emuhost::space::lock_waits`]): behind a
    /// commit or an arm that holds it while it waits in the kernel.
    pub render_space_lock_waits: LockWaits,
    /// The snapshots and the rewind check, where [`ReplayConfig::snapshot_every`] asked for them.
    pub snapshots: Option<SnapshotFigures>,
}

impl ReplayReport {
    /// The share of guest writes (pages) that a later collect covered, so that they could be
    /// judged: 1 when there were none.
    pub fn checked_share(&self) -> f64 {
        if self.writes == 0 { 1.0 } else { (self.writes - self.unchecked_writes) as f64 / self.writes as f64 }
    }
}

enum Msg {
    Event(u64, Record),
    Sync(SyncSender<()>),
    /// For the render thread, every thread waiting at the boundary before the `frame` on this
    /// line: the end of the `b`th frame, a snapshot due.
    Boundary {
        line: u64,
        b: u64,
        ack: SyncSender<()>,
    },
}

/// A collect's first and last page (exclusive) and the pages it reported, sorted.
type CollectRecord = (u64, u64, Vec<u64>);

/// State shared by the replay's threads.
struct Shared<'a> {
    space: &'a Arc<Space>,
    importer: &'a Importer<AnyBackend>,
    tracker: &'a Tracker,
    /// Pools by (lo, size), as the trace names them when it releases one.
    pools: Mutex<HashMap<(u64, u64), Vec<PoolId>>>,
    /// Collects: number -> (range, reported pages, sorted).
    collects: Mutex<BTreeMap<u64, CollectRecord>>,
    paced_start: Instant,
    paced: bool,
    /// Short sleeps by the settings' rule.
    sleeper: Sleeper<OsHost>,
    /// Set by the first thread whose event fails: the others stop, the reader stops dispatching.
    failed: AtomicBool,
    /// Bytes committed by the trace now, and at most.
    committed: AtomicU64,
    committed_peak: AtomicU64,
    /// The stack size of the replay's threads (`None`: std's default); a test's way to make the
    /// OS refuse one.
    worker_stack: Option<usize>,
    /// [`ReplayConfig::frames_begun`].
    frames_begun: Option<Arc<AtomicU64>>,
    /// The snapshots and the rewind check's state ([`ReplayConfig::snapshot_every`]).
    snap: Option<Mutex<SnapRun>>,
    /// [`ReplayConfig::snapshot_every`].
    snap_every: Option<u64>,
    /// With [`ReplayConfig::rewind`], every change of guest memory is made and logged under this
    /// lock, so the log's order is memory's.
    log: Mutex<MemLog>,
    logging: bool,
}

impl<'a> Shared<'a> {
    /// The state the replay's threads share over this runtime.
    fn new(
        (space, importer, tracker): (&'a Arc<Space>, &'a Importer<AnyBackend>, &'a Tracker),
        cfg: &ReplayConfig,
        worker_stack: Option<usize>,
    ) -> Self {
        Shared {
            space,
            importer,
            tracker,
            pools: Mutex::new(HashMap::new()),
            collects: Mutex::new(BTreeMap::new()),
            paced_start: Instant::now(),
            paced: cfg.paced,
            sleeper: cfg.settings.sleeper_builder().build(OsHost),
            failed: AtomicBool::new(false),
            committed: AtomicU64::new(0),
            committed_peak: AtomicU64::new(0),
            worker_stack,
            frames_begun: cfg.frames_begun.clone(),
            snap: None,
            snap_every: cfg.snapshot_every,
            log: Mutex::new(MemLog::default()),
            logging: cfg.rewind.is_some(),
        }
    }

    /// The memory log's lock, where changes are logged (`--rewind`): held across a change and
    /// its entry.
    fn logged(&self) -> Option<std::sync::MutexGuard<'_, MemLog>> {
        self.logging.then(|| self.log.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

#[derive(Default)]
struct ThreadFigures {
    writes: Vec<(u64, u64, u64)>,
    frames: Vec<FrameFigures>,
    guest_sleeps: SleepFigures,
    host_sleeps: SleepFigures,
    zeroed: u64,
    bind_failures: u64,
    /// The thread's waits for the space's lock, and whether it is the render thread.
    lock_waits: LockWaits,
    render: bool,
    error: Option<ReplayError>,
}

fn failed(line: u64, r: &Record, e: impl std::error::Error + Send + Sync + 'static) -> ReplayError {
    ReplayError::Event { line, event: r.event.to_string(), source: Box::new(e) }
}

/// Runs trace thread `thread`'s events, until the reader hangs up.
fn worker(sh: &Shared<'_>, rx: Receiver<Msg>, thread: Thread) -> ThreadFigures {
    let f = ThreadFigures { render: thread == Thread::Render, ..Default::default() };
    let mut w = Worker { sh, f, frame: None, present: Instant::now(), pattern: 0 };
    // Counted per OS thread: this one's from here on.
    let _ = emuhost::space::take_lock_waits();
    for msg in rx {
        let (line, r) = match msg {
            Msg::Sync(ack) => {
                let _ = ack.send(());
                continue;
            }
            Msg::Boundary { line, b, ack } => {
                if !sh.failed.load(SeqCst)
                    && let Err(e) = w.boundary(line, b)
                {
                    sh.failed.store(true, SeqCst);
                    w.f.error = Some(e);
                }
                let _ = ack.send(());
                continue;
            }
            Msg::Event(line, r) => (line, r),
        };
        if sh.failed.load(SeqCst) {
            continue;
        }
        if let Err(e) = w.event(line, &r) {
            // Stop every thread: what follows may depend on what failed (a write into memory
            // this thread was to commit).
            sh.failed.store(true, SeqCst);
            w.f.error = Some(e);
        }
    }
    if let Some(mut done) = w.frame.take() {
        done.present_to_present = w.present.elapsed();
        w.f.frames.push(done);
    }
    w.f.lock_waits = emuhost::space::take_lock_waits();
    w.f
}

/// One trace thread's state: its figures, the frame it is in, its last present and its store
/// pattern.
struct Worker<'s, 'a> {
    sh: &'s Shared<'a>,
    f: ThreadFigures,
    frame: Option<FrameFigures>,
    present: Instant,
    pattern: u8,
}

impl Worker<'_, '_> {
    /// Runs one event (trace line `line`).
    fn event(&mut self, line: u64, r: &Record) -> Result<(), ReplayError> {
        let sh = self.sh;
        match r.event {
            Event::Frame { index } => {
                // The replay keeps no binding's handle past its binding: at each frame, every
                // handle given before is done with (imports merged over since are released).
                sh.importer.handles_done();
                self.next_frame(index, r.t_us)
            }
            Event::Pool { lo, size } => {
                let id = sh.importer.add_pool(lo.0, size).map_err(|e| failed(line, r, e))?;
                sh.pools.lock().unwrap_or_else(|p| p.into_inner()).entry((lo.0, size)).or_default().push(id);
            }
            Event::Unpool { lo, size } => {
                let id =
                    sh.pools.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&(lo.0, size)).and_then(|v| v.pop());
                match id {
                    Some(id) => {
                        sh.importer.remove_pool(id);
                    }
                    None => {
                        return Err(ReplayError::Bad {
                            line,
                            what: format!("no pool {:#x}+{size:#x} to release", lo.0),
                        });
                    }
                }
            }
            Event::Commit { lo, size, prot } => {
                let g = sh.space.range(lo.0, size).map_err(|e| failed(line, r, e))?;
                let mut log = sh.logged();
                sh.space.commit(g, prot).map_err(|e| failed(line, r, e))?;
                sh.tracker.arm(g).map_err(|e| failed(line, r, e))?;
                if let Some(log) = log.as_mut() {
                    let (lo, hi) = page_bounds(lo.0, size);
                    log.push(line, MemOp::Commit { lo, hi, prot });
                }
                drop(log);
                let now = sh.committed.fetch_add(size, SeqCst) + size;
                sh.committed_peak.fetch_max(now, SeqCst);
            }
            Event::Decommit { lo, size } => self.decommit(line, r, lo, size)?,
            Event::Bind { addr, size } => self.bind(line, r, addr, size)?,
            Event::Write { addr, size } => self.write(line, r, addr, size)?,
            Event::Collect { lo, size } => self.collect(line, r, lo, size)?,
            Event::Sleep { kind, ns, count } => self.sleep(kind, ns, count),
        }
        Ok(())
    }

    /// The end of the `b`th frame (the one this thread is in), every other thread waiting: the
    /// snapshot and the rewind check's work, timed on this thread.
    fn boundary(&mut self, line: u64, b: u64) -> Result<(), ReplayError> {
        let sh = self.sh;
        let (Some(snap), Some(fr)) = (sh.snap.as_ref(), self.frame.as_mut()) else { return Ok(()) };
        let rt = snapshots::Rt { space: sh.space, tracker: sh.tracker, importer: sh.importer, log: &sh.log };
        let mut snap = snap.lock().unwrap_or_else(|p| p.into_inner());
        let took = snap.boundary(&rt, b, fr.index, fr.runtime).map_err(|(what, source)| ReplayError::Snapshot {
            line,
            what,
            source,
        })?;
        fr.snapshot += took;
        Ok(())
    }

    /// A new frame (paced: at its time in the trace): the one before is done.
    fn next_frame(&mut self, index: u64, t_us: u64) {
        let sh = self.sh;
        if sh.paced {
            let due = sh.paced_start + Duration::from_micros(t_us);
            let now = Instant::now();
            if due > now {
                sh.sleeper.sleep(Caller::Host, due - now);
            }
        }
        let now = Instant::now();
        if let Some(mut done) = self.frame.take() {
            done.present_to_present = now - self.present;
            self.f.frames.push(done);
        }
        self.present = now;
        self.frame = Some(FrameFigures { index, ..Default::default() });
    }

    fn decommit(&mut self, line: u64, r: &Record, lo: GuestAddr, size: u64) -> Result<(), ReplayError> {
        let sh = self.sh;
        let g = sh.space.range(lo.0, size).map_err(|e| failed(line, r, e))?;
        let _ = sh.committed.fetch_update(SeqCst, SeqCst, |c| Some(c.saturating_sub(size)));
        let mut log = sh.logged();
        // The space refuses to decommit pages a live GPU import holds, in one step with the
        // check (no binding on the render thread gets in between).
        let zeroed = match sh.space.decommit(g) {
            Ok(()) => false,
            Err(SpaceError::Held { .. }) => {
                // They stay mapped: zero them instead (a write by the kernel, which armed pages
                // must be prepared for, with no collect on the render thread arming them again
                // in between).
                let zeroed = sh.tracker.host_write(g, || sh.space.zero(g));
                zeroed.map_err(|e| failed(line, r, e))?.map_err(|e| failed(line, r, e))?;
                self.f.zeroed += 1;
                true
            }
            Err(e) => return Err(failed(line, r, e)),
        };
        if let Some(log) = log.as_mut() {
            let (lo, hi) = page_bounds(lo.0, size);
            log.push(line, MemOp::Decommit { lo, hi, zeroed });
        }
        Ok(())
    }

    fn bind(&mut self, line: u64, r: &Record, addr: GuestAddr, size: u64) -> Result<(), ReplayError> {
        let t = Instant::now();
        let bound = match self.sh.importer.bind(addr.0, size) {
            Ok(b) => Some(b),
            // The importer logged it and holds the range cooling: the game goes on.
            Err(e) if e.is_refused() => {
                self.f.bind_failures += 1;
                None
            }
            Err(e) => return Err(failed(line, r, e)),
        };
        let took = t.elapsed();
        if let Some(fr) = self.frame.as_mut() {
            fr.runtime += took;
            // A binding makes at most one import (the spanned range or, failing that, the plain
            // one).
            if bound.is_some_and(|b| b.made) {
                fr.imports += took;
                fr.imports_made += 1;
            }
        }
        Ok(())
    }

    fn write(&mut self, line: u64, r: &Record, addr: GuestAddr, size: u64) -> Result<(), ReplayError> {
        let sh = self.sh;
        self.pattern = self.pattern.wrapping_add(1);
        let e1 = sh.tracker.collects_started();
        let mut log = sh.logged();
        store_pattern(sh.space, addr, size, self.pattern).map_err(|e| failed(line, r, e))?;
        if let Some(log) = log.as_mut() {
            log.push(line, MemOp::Write { addr: addr.0, size, pattern: self.pattern });
        }
        drop(log);
        let e2 = sh.tracker.collects_started();
        let p = page_size();
        for pg in addr.0 / p..(addr.0 + size).div_ceil(p) {
            self.f.writes.push((pg, e1, e2));
        }
        Ok(())
    }

    fn collect(&mut self, line: u64, r: &Record, lo: GuestAddr, size: u64) -> Result<(), ReplayError> {
        let sh = self.sh;
        let g = sh.space.range(lo.0, size).map_err(|e| failed(line, r, e))?;
        let t = Instant::now();
        // Numbered by the tracker as it runs: collects on several threads are checked in the
        // order they read the pages.
        let got = sh.tracker.collect(g).map_err(|e| failed(line, r, e))?;
        let n = got.seq;
        let took = t.elapsed();
        if let Some(fr) = self.frame.as_mut() {
            fr.runtime += took;
            fr.collects += took;
        }
        let p = page_size();
        let pages: Vec<u64> = got.page_addrs().iter().map(|a| a.0 / p).collect();
        sh.collects.lock().unwrap_or_else(|p| p.into_inner()).insert(n, (lo.0 / p, (lo.0 + size) / p, pages));
        Ok(())
    }

    fn sleep(&mut self, kind: SleepKind, ns: u64, count: u32) {
        let (caller, fig) = match kind {
            SleepKind::Guest => (Caller::Guest, &mut self.f.guest_sleeps),
            SleepKind::Host => (Caller::Host, &mut self.f.host_sleeps),
        };
        let cpu = sched::thread_cpu_time();
        let t = Instant::now();
        for _ in 0..count {
            // A replay that failed (a later line refused) stops within one sleep, not one line.
            if self.sh.failed.load(SeqCst) {
                break;
            }
            self.sh.sleeper.sleep(caller, Duration::from_nanos(ns));
        }
        fig.wall += t.elapsed();
        fig.cpu += sched::thread_cpu_time().saturating_sub(cpu);
        fig.count += u64::from(count);
        fig.asked += Duration::from_nanos(ns) * count;
    }
}

/// Stores `size` bytes of `pattern` at `addr`, a piece of at most [`STORE_PIECE`] bytes at a time
/// (a write's length comes from the trace: no buffer of its whole length).
fn store_pattern(space: &Space, addr: GuestAddr, size: u64, pattern: u8) -> Result<(), SpaceError> {
    let buf = vec![pattern; size.min(STORE_PIECE) as usize];
    let mut done = 0;
    while done < size {
        let n = (size - done).min(STORE_PIECE);
        space.store(GuestAddr(addr.0 + done), &buf[..n as usize])?;
        done += n;
    }
    Ok(())
}

/// Who touched a range in the current frame: the first thread (with its line) and the first
/// other thread after it, enough to name a line of a thread other than any given one.
#[derive(Clone, Copy, Debug)]
struct Touch {
    first: (Thread, u64),
    other: Option<(Thread, u64)>,
}

impl Touch {
    /// A touch by a thread other than `t`: its thread and line.
    fn by_other(&self, t: Thread) -> Option<(Thread, u64)> {
        if self.first.0 != t { Some(self.first) } else { self.other }
    }
}

/// Records a touch of `a..b` by `thread` at `line` in `map`.
fn touch(map: &mut RangeMap<Touch>, a: u64, b: u64, thread: Thread, line: u64) {
    let fresh = Touch { first: (thread, line), other: None };
    let mut parts = Vec::new();
    let mut at = a;
    for (s, e, v) in map.overlapping(a, b) {
        let (s, e) = (s.max(a), e.min(b));
        if s > at {
            parts.push((at, s, fresh));
        }
        let mut v = *v;
        if v.first.0 != thread && v.other.is_none() {
            v.other = Some((thread, line));
        }
        parts.push((s, e, v));
        at = e;
    }
    if at < b {
        parts.push((at, b, fresh));
    }
    map.remove(a, b, |_, _, v| *v);
    for (s, e, v) in parts {
        map.insert(s, e, v);
    }
}

/// The first touch in `a..b` by a thread other than `t`.
fn touched_by_other(map: &RangeMap<Touch>, a: u64, b: u64, t: Thread) -> Option<(Thread, u64)> {
    map.overlapping(a, b).find_map(|(_, _, v)| v.by_other(t))
}

/// The dispatcher's check that guest stores land in memory committed writable, and that no store
/// races a decommit or a read-only commit on another thread: threads run concurrently within a
/// frame, so a store and such a change of its pages on another thread in the same frame could
/// run in either order (a store after the change is a fault). Such a trace is refused, naming
/// both lines. All in pages; each event costs a few range-map operations.
#[derive(Default)]
struct WriteCheck {
    /// Writable memory as of the start of this frame.
    writable: RangeMap<()>,
    /// Changes made in this frame, in line order, applied at the next frame: (lo, hi, writable).
    pending: Vec<(u64, u64, bool)>,
    /// What each thread made writable (true) or not (false) in this frame: its own view.
    mine: HashMap<Thread, RangeMap<bool>>,
    /// Pages made not writable in this frame, and by whom.
    revoked: RangeMap<Touch>,
    /// Pages committed writable in this frame, and by whom.
    granted: RangeMap<Touch>,
    /// Pages stored to in this frame, and by whom.
    stored: RangeMap<Touch>,
}

/// Why a trace was refused by the write check: the message, naming the other line where there is one.
type Refusal = String;

fn pages(lo: u64, hi: u64) -> (u64, u64) {
    let p = page_size();
    (lo / p * p, hi.div_ceil(p) * p)
}

const RACE: &str = "threads run concurrently within a frame; a frame boundary must fall between them";

impl WriteCheck {
    fn apply(map: &mut RangeMap<()>, lo: u64, hi: u64, writable: bool) {
        map.remove(lo, hi, |_, _, _| ());
        if writable {
            map.insert(lo, hi, ());
        }
    }

    fn frame(&mut self) {
        for (lo, hi, w) in std::mem::take(&mut self.pending) {
            Self::apply(&mut self.writable, lo, hi, w);
        }
        self.mine.clear();
        self.revoked = RangeMap::default();
        self.granted = RangeMap::default();
        self.stored = RangeMap::default();
    }

    /// A commit (writable or not) or a decommit (`writable` false) of `lo..hi` by `thread`.
    fn change(
        &mut self,
        thread: Thread,
        line: u64,
        what: &dyn Fn() -> String,
        lo: u64,
        hi: u64,
        writable: bool,
    ) -> Result<(), Refusal> {
        let (a, b) = pages(lo, hi);
        // Opposite changes on two threads: which one the pages keep after the frame depends on
        // the order they ran in.
        let opposite = if writable { &self.revoked } else { &self.granted };
        if let Some((t, l)) = touched_by_other(opposite, a, b, thread) {
            return Err(format!(
                "{} on {thread} and line {l} (on {t}) change the same pages in the same frame, to be kept \
                 writable by one and not by the other: {RACE}",
                what()
            ));
        }
        if writable {
            touch(&mut self.granted, a, b, thread, line);
        } else {
            if let Some((t, l)) = touched_by_other(&self.stored, a, b, thread) {
                return Err(format!(
                    "{} on {thread} may run before the write on line {l} (on {t}) in the same frame: {RACE}",
                    what()
                ));
            }
            touch(&mut self.revoked, a, b, thread, line);
        }
        let own = self.mine.entry(thread).or_default();
        own.remove(a, b, |_, _, v| *v);
        own.insert(a, b, writable);
        self.pending.push((a, b, writable));
        Ok(())
    }

    /// A store to `lo..hi` by `thread`.
    fn store(&mut self, thread: Thread, line: u64, what: &dyn Fn() -> String, lo: u64, hi: u64) -> Result<(), Refusal> {
        let (a, b) = pages(lo, hi);
        if let Some((t, l)) = touched_by_other(&self.revoked, a, b, thread) {
            return Err(format!(
                "{} may run after line {l} (on {t}) took its pages away in the same frame: {RACE}",
                what()
            ));
        }
        // The thread's own changes in this frame, else the state at the frame's start.
        let mut view = RangeMap::default();
        for (s, e, _) in self.writable.overlapping(a, b) {
            view.insert(s.max(a), e.min(b), ());
        }
        if let Some(own) = self.mine.get(&thread) {
            for (s, e, &w) in own.overlapping(a, b) {
                Self::apply(&mut view, s.max(a), e.min(b), w);
            }
        }
        if !view.gaps(a, b).is_empty() {
            return Err(format!("{} falls outside memory committed writable before it", what()));
        }
        touch(&mut self.stored, a, b, thread, line);
        Ok(())
    }
}

/// The most one `write` line may store: a longer one is refused (the bytes are real stores).
pub const MAX_WRITE: u64 = 1 << 30;
/// Stores are made in pieces of this many bytes (one buffer of it per store, not the whole write).
const STORE_PIECE: u64 = 64 << 10;
/// The longest short sleep a `sleep` line may ask for (NS).
pub const MAX_SLEEP_NS: u64 = 1_000_000_000;
/// The most short sleeps one `sleep` line may ask for (COUNT).
pub const MAX_SLEEP_COUNT: u32 = 1_000_000;
/// The most time one `sleep` line may ask for in all (NS × COUNT).
pub const MAX_SLEEP_LINE_NS: u64 = 10_000_000_000;
/// The most time all the `sleep` lines of a trace may ask for together (NS × COUNT summed over
/// every line and thread): ten minutes, some 25 times the built-in session's 23 s. A trace past it
/// is refused at the line that passes it.
pub const MAX_SLEEP_TOTAL_NS: u64 = 600_000_000_000;
/// The most threads a trace may have (`r`, `gN` and `hN` together): the replay runs each on an OS
/// thread of its own (a 2 MiB stack, a queue of events) and stops them all at every frame, so a
/// thread past this is refused at its first line rather than asked of the OS. Recorded sessions
/// have tens; the built-in one six.
pub const MAX_THREADS: usize = 1024;
/// Paced: the longest a frame may start after the frame before it (or, for the first frame, after
/// the session's start), in microseconds.
pub const MAX_FRAME_GAP_US: u64 = 10_000_000;

/// What the caps keep count of across lines: the last frame's time and the sleep asked so far.
#[derive(Clone, Copy, Debug, Default)]
struct Limits {
    last_frame_us: u64,
    slept_ns: u64,
}

/// The caps that keep any one line, or the lines together, from running for ever or from asking
/// for all memory.
fn check_limits(line: u64, r: &Record, paced: bool, limits: &mut Limits) -> Result<(), ReplayError> {
    let what = match r.event {
        Event::Sleep { ns, count, .. } => {
            let total = limits.slept_ns.saturating_add(ns.saturating_mul(u64::from(count)));
            if ns > MAX_SLEEP_NS {
                format!("a sleep of {ns} ns is longer than the replay's cap of {MAX_SLEEP_NS} ns")
            } else if count > MAX_SLEEP_COUNT {
                format!("a sleep count of {count} is over the replay's cap of {MAX_SLEEP_COUNT}")
            } else if ns * u64::from(count) > MAX_SLEEP_LINE_NS {
                format!("{count} sleeps of {ns} ns are over the replay's cap of {MAX_SLEEP_LINE_NS} ns a line")
            } else if total > MAX_SLEEP_TOTAL_NS {
                format!(
                    "the trace's sleeps add up to {total} ns with this line's, over the replay's cap of \
                     {MAX_SLEEP_TOTAL_NS} ns in all"
                )
            } else {
                limits.slept_ns = total;
                return Ok(());
            }
        }
        Event::Write { size, .. } if size > MAX_WRITE => {
            format!("a write of {size:#x} bytes is over the replay's cap of {MAX_WRITE:#x} bytes a line")
        }
        Event::Frame { index } => {
            let gap = r.t_us.saturating_sub(limits.last_frame_us);
            limits.last_frame_us = r.t_us;
            if !paced || gap <= MAX_FRAME_GAP_US {
                return Ok(());
            }
            format!(
                "frame {index} starts {gap} us after the frame before it; paced, the replay's cap is {MAX_FRAME_GAP_US} us"
            )
        }
        _ => return Ok(()),
    };
    Err(ReplayError::Bad { line, what })
}

/// Checks a record before it is handed to its thread: the caps, and that stores land in memory
/// committed writable with no race against another thread (see [`WriteCheck`]).
fn check_record(check: &mut WriteCheck, line: u64, r: &Record) -> Result<(), ReplayError> {
    let result = match r.event {
        Event::Frame { .. } => {
            check.frame();
            Ok(())
        }
        Event::Commit { lo, size, prot } => {
            check.change(r.thread, line, &|| r.event.to_string(), lo.0, lo.0 + size, prot.write)
        }
        Event::Decommit { lo, size } => check.change(r.thread, line, &|| r.event.to_string(), lo.0, lo.0 + size, false),
        Event::Write { addr, size } => {
            let what = || format!("write {:#x}+{size:#x} on {}", addr.0, r.thread);
            check.store(r.thread, line, &what, addr.0, addr.0 + size)
        }
        _ => Ok(()),
    };
    result.map_err(|what| ReplayError::Bad { line, what })
}

/// What the dispatcher hands back: each thread's figures, the thread count, the first error of
/// the trace (reading it or checking a record) and the events dispatched.
type Dispatched = (Vec<ThreadFigures>, usize, Option<ReplayError>, u64);

/// Starts the OS thread for trace thread `thread`, first seen at `line`, when the trace has
/// `running` threads already: refused past [`MAX_THREADS`], and an error where the OS refuses.
fn spawn_worker<'scope, 'env>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    sh: &'env Shared<'env>,
    line: u64,
    thread: Thread,
    running: usize,
) -> Result<(SyncSender<Msg>, std::thread::ScopedJoinHandle<'scope, ThreadFigures>), ReplayError> {
    if running >= MAX_THREADS {
        let what = format!(
            "thread {thread} makes {} threads, over the replay's cap of {MAX_THREADS} threads (it runs one OS \
             thread per trace thread)",
            running + 1
        );
        return Err(ReplayError::Bad { line, what });
    }
    let (tx, rx) = sync_channel(1024);
    let mut builder = std::thread::Builder::new().name(format!("replay {thread}"));
    if let Some(size) = sh.worker_stack {
        builder = builder.stack_size(size);
    }
    let handle = builder.spawn_scoped(scope, move || worker(sh, rx, thread)).map_err(|source| ReplayError::Spawn {
        line,
        thread: thread.to_string(),
        source,
    })?;
    Ok((tx, handle))
}

/// Streams `records` to one worker thread per trace thread, frames kept in step.
fn dispatch(sh: &Shared<'_>, records: impl Iterator<Item = Result<(u64, Record), TraceError>>) -> Dispatched {
    std::thread::scope(|scope| {
        let mut senders: BTreeMap<Thread, SyncSender<Msg>> = BTreeMap::new();
        let mut handles = Vec::new();
        let mut check = WriteCheck::default();
        let mut limits = Limits::default();
        let mut read_error = None;
        let mut events = 0u64;
        let mut frames_ended = 0u64;
        let sync = |senders: &BTreeMap<Thread, SyncSender<Msg>>| {
            let (tx, rx) = sync_channel(senders.len());
            for s in senders.values() {
                let _ = s.send(Msg::Sync(tx.clone()));
            }
            drop(tx);
            for _ in 0..senders.len() {
                if rx.recv().is_err() {
                    break;
                }
            }
        };
        for item in records {
            let (line, r) = match item {
                Ok(x) => x,
                Err(e) => {
                    read_error = Some(ReplayError::Trace(e));
                    break;
                }
            };
            events += 1;
            if let Err(e) = check_limits(line, &r, sh.paced, &mut limits) {
                read_error = Some(e);
                break;
            }
            if let Event::Frame { .. } = r.event {
                // Every thread finishes the frame before the next starts.
                sync(&senders);
                // The frame before has ended: its snapshot is taken on the render thread while
                // the others wait.
                if let (Some(n), Some(render)) = (sh.snap_every, senders.get(&Thread::Render))
                    && SnapRun::due(n, frames_ended)
                {
                    let (ack, done) = sync_channel(1);
                    if render.send(Msg::Boundary { line, b: frames_ended, ack }).is_ok() {
                        let _ = done.recv();
                    }
                }
                frames_ended += 1;
                if sh.failed.load(SeqCst) {
                    break;
                }
                if let Some(n) = &sh.frames_begun {
                    n.fetch_add(1, SeqCst);
                }
            }
            if let Err(e) = check_record(&mut check, line, &r) {
                read_error = Some(e);
                break;
            }
            if !senders.contains_key(&r.thread) {
                match spawn_worker(scope, sh, line, r.thread, senders.len()) {
                    Ok((tx, handle)) => {
                        senders.insert(r.thread, tx);
                        handles.push(handle);
                    }
                    Err(e) => {
                        read_error = Some(e);
                        break;
                    }
                }
            }
            if senders[&r.thread].send(Msg::Event(line, r)).is_err() {
                break;
            }
        }
        if read_error.is_some() {
            // The threads drop what they were handed and have not begun.
            sh.failed.store(true, SeqCst);
        }
        let threads = senders.len();
        drop(senders);
        let figures: Vec<ThreadFigures> =
            handles.into_iter().map(|h| h.join().expect("a replay thread panicked")).collect();
        (figures, threads, read_error, events)
    })
}

/// The space, the importer, its backend's description and the tracker.
type Runtime = (Arc<Space>, Importer<AnyBackend>, String, Arc<Tracker>);

/// The runtime a replay drives: the space, the importer (and its backend's description) and
/// the write tracker, each picked by `cfg` or its settings.
fn runtime(header: &Header, cfg: &ReplayConfig) -> Result<Runtime, ReplayError> {
    let space = Arc::new(SpaceConfig::default().window(header.window).build()?);
    let picked = AnyBackend::pick(cfg.settings.import_backend)?;
    // Why a better backend was not taken (no GPU, no display for Wine's Vulkan): said once, so a
    // replay on the pin backend says why it is there.
    for (kind, why) in &picked.passed_over {
        tracing::info!("import: {} passed over: {why}", kind.name());
    }
    let import_backend = picked.backend.describe();
    // The run's one line on the device (the import cost, write tracking and sleeps say theirs).
    tracing::info!("import backend {}: {import_backend}", picked.backend.kind().name());
    let importer = Importer::new(space.clone(), picked.backend, cfg.settings.import_config())?;
    let tracker = Tracker::new(&space, &cfg.settings.tracker_config())?;
    Ok((space, importer, import_backend, tracker))
}

/// Whether the runtime refused the header's window: the space could not reserve it, or the
/// import chunk is larger than it.
fn refuses_window(e: &ReplayError) -> bool {
    matches!(
        e,
        ReplayError::Space(_) | ReplayError::Import(ImportError::ChunkTooLarge { what: "the guest window", .. })
    )
}

/// Replays `records` (with their trace line numbers) of a trace with `header`. Where the runtime
/// refuses the header's window, the first bad line of the trace, if it has one, is the error
/// (the rest of the trace is read to find it).
///
/// The runtime is made for the replay and dropped at its end: a space of the header's window, the
/// importer on the backend `cfg.settings` picks, the write tracker. Every import is released
/// before it returns.
///
/// # Errors
///
/// A [`ReplayError`] naming the trace line: the trace's own errors ([`ReplayError::Trace`]), a
/// line the replay refuses ([`ReplayError::Bad`]), an event the runtime refuses
/// ([`ReplayError::Event`]), a thread the OS refuses ([`ReplayError::Spawn`]); or the runtime
/// could not be made ([`ReplayError::Space`], [`ReplayError::Watch`], [`ReplayError::Import`]).
/// A binding the import backend refuses is not an error: it is counted in
/// [`ReplayReport::bind_failures`].
///
/// # Examples
///
/// A small trace: memory committed, written by two game threads, collected on the render
/// thread a frame later, with a binding; replayed on the `pin` import backend (no GPU needed).
///
/// ```
/// use emuhost::import::{BackendChoice, BackendKind};
/// use emuhost_lab::replay::{ReplayConfig, replay};
/// use emuhost_lab::trace::read_str;
///
/// let trace = "emuhost-trace 1 window=0x100000000
/// 0 g0 commit 0x10000000 0x400000 rw-
/// 0 g0 pool 0x10000000 0x400000
/// 1 r frame 0
/// 2 g0 write 0x10000000 0x10
/// 3 g1 write 0x10002000 0x2000
/// 4 r bind 0x10000000 0x1000
/// 10 r frame 1
/// 11 r collect 0x10000000 0x400000
/// 20 r frame 2
/// end 9
/// ";
/// let (header, records) = read_str(trace)?;
/// let mut cfg = ReplayConfig::default();
/// cfg.settings.import_backend = BackendChoice::Only(BackendKind::Pin);
/// // Each record with its line in the trace (the header is line 1).
/// let lines = records.into_iter().enumerate().map(|(i, r)| Ok((i as u64 + 2, r)));
/// let report = replay(&header, lines, &cfg)?;
/// assert_eq!(report.threads, 3);
/// assert_eq!(report.writes, 3, "one page, then two");
/// assert_eq!(report.lost_writes, 0);
/// assert_eq!(report.live_imports_after_teardown, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn replay(
    header: &Header,
    records: impl Iterator<Item = Result<(u64, Record), TraceError>>,
    cfg: &ReplayConfig,
) -> Result<ReplayReport, ReplayError> {
    replay_with(header, records, cfg, None)
}

/// [`replay`], its threads' stacks `worker_stack` bytes each (`None`: std's default). (Long: the
/// runtime, the run, then the report gathered field by field from the threads and the importer.)
fn replay_with(
    header: &Header,
    mut records: impl Iterator<Item = Result<(u64, Record), TraceError>>,
    cfg: &ReplayConfig,
    worker_stack: Option<usize>,
) -> Result<ReplayReport, ReplayError> {
    cfg.check()?;
    let (space, importer, import_backend, tracker) = match runtime(header, cfg) {
        Ok(r) => r,
        // The header's window refused (smaller than the import chunk, or too large to reserve):
        // a line of the trace outside its own window is the mistake to name first.
        Err(e) if refuses_window(&e) => return Err(records.find_map(Result::err).map_or(e, ReplayError::Trace)),
        Err(e) => return Err(e),
    };
    let mut sh = Shared::new((&space, &importer, &tracker), cfg, worker_stack);
    if let Some(every) = cfg.snapshot_every {
        let whole = space.range(0, space.window())?;
        let snaps =
            emuhost::snapshot::Snapshots::new(&tracker, whole, &cfg.settings.snapshot_config()).map_err(|e| {
                ReplayError::Snapshot {
                    line: 1,
                    what: "making the snapshots of the guest window".into(),
                    source: Box::new(e),
                }
            })?;
        let run = SnapRun::new(snaps, every, cfg.rewind.map(|k| (k, cfg.rewind_every.unwrap_or(REWIND_INTERVAL * k))));
        #[cfg(test)]
        let run = run.skipping_restores(cfg.skip_restore);
        sh.snap = Some(Mutex::new(run));
    }
    let start = Instant::now();
    let (figures, threads, read_error, events) = dispatch(&sh, records);
    let wall = start.elapsed();
    if let Some(e) = read_error {
        importer.release_all();
        return Err(e);
    }
    let mut report = ReplayReport {
        import_backend,
        watch_backend: tracker.kind().name().to_string(),
        sleep_rule: sh.sleeper.rule().why(),
        paced: cfg.paced,
        events,
        threads,
        wall,
        ..Default::default()
    };
    let mut writes = Vec::new();
    for mut f in figures {
        if let Some(e) = f.error.take() {
            importer.release_all();
            return Err(e);
        }
        report.frames.extend(f.frames);
        writes.extend(f.writes);
        add_sleeps(&mut report.guest_sleeps, f.guest_sleeps);
        add_sleeps(&mut report.host_sleeps, f.host_sleeps);
        report.zeroed_under_import += f.zeroed;
        report.bind_failures += f.bind_failures;
        if f.render {
            report.render_space_lock_waits = f.lock_waits;
        }
    }
    report.frames.sort_by_key(|f| f.index);
    // The trace is over: the background work asked for lands (merges included), and no handle
    // is held any more, so what merges replaced goes before the figures at the end are read.
    importer.settle();
    importer.handles_done();
    report.snapshots = sh.snap.map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()).finish());
    let collects = sh.collects.into_inner().unwrap_or_else(|p| p.into_inner());
    report.collects = collects.len() as u64;
    report.collect_time = report.frames.iter().map(|f| f.collects).sum();
    report.pages_reported = collects.values().map(|c| c.2.len() as u64).sum();
    report.writes = writes.len() as u64;
    (report.lost_writes, report.unchecked_writes) = check_writes(&writes, &collects);
    // The background imports the session asked for are part of its figures.
    importer.settle();
    let st = importer.stats();
    report.imports = st.imports;
    report.reimports = st.reimports;
    report.import_time = st.time;
    report.worst_import = st.worst();
    (report.import_wait_total, report.import_wait_worst) = (st.wait_time, st.wait_worst);
    report.ahead_imports = st.ahead_imports;
    (report.import_pieces, report.import_widenings) = (st.pieces, st.widenings);
    report.import_in_flight_waits = st.in_flight_waits;
    report.ahead_bytes_peak = st.ahead_peak_bytes;
    report.committed_bytes_peak = sh.committed_peak.load(SeqCst);
    if let emuhost::import::ImportPolicy::Pools(p) = importer.config().policy {
        report.import_cost = Some(importer.cost());
        report.import_cost_given = p.cost.is_some();
    }
    report.import_failures = st.failures;
    report.long_read_waits = importer.space().long_read_waits();
    report.live_import_bytes_end = st.live_bytes;
    report.live_import_bytes_peak = st.peak_live_bytes;
    report.live_imports_peak = st.peak_live;
    (report.import_merges, report.import_merged_away, report.imports_over_cap) =
        (st.merges, st.merged_away, st.over_cap);
    importer.release_all();
    let left = importer.backend().budget().get();
    (report.live_imports_after_teardown, report.live_import_bytes_after_teardown) = (left.count, left.bytes);
    report.verify_collect = tracker.verifying();
    Ok(report)
}

fn add_sleeps(to: &mut SleepFigures, from: SleepFigures) {
    to.count += from.count;
    to.asked += from.asked;
    to.cpu += from.cpu;
    to.wall += from.wall;
}

/// Each write (page, e1, e2) must be reported by a collect of its page numbered in `e1 ..= m`,
/// where `m` is the first collect of its page numbered above `e2` (it started after the store
/// ended). Returns (lost, unchecked: no such `m`).
fn check_writes(writes: &[(u64, u64, u64)], collects: &BTreeMap<u64, CollectRecord>) -> (u64, u64) {
    let (mut lost, mut unchecked) = (0, 0);
    for &(pg, e1, e2) in writes {
        let covers = |c: &CollectRecord| c.0 <= pg && pg < c.1;
        let Some((&m, _)) = collects.range(e2 + 1..).find(|(_, c)| covers(c)) else {
            unchecked += 1;
            continue;
        };
        let reported = collects.range(e1.max(1)..=m).any(|(_, c)| covers(c) && c.2.binary_search(&pg).is_ok());
        if !reported {
            lost += 1;
        }
    }
    (lost, unchecked)
}

/// Replays the built-in default session ([`crate::synth::default_session`]): some 23 s of
/// a game's session, unpaced unless `cfg.paced`.
///
/// # Errors
///
/// As [`replay`].
pub fn replay_default(cfg: &ReplayConfig) -> Result<ReplayReport, ReplayError> {
    let synth = crate::synth::default_session();
    let header = synth.header();
    replay(&header, synth.enumerate().map(|(i, r)| Ok((i as u64 + 2, r))), cfg)
}

/// Replays a trace file (plain or `.zst`), streamed: the records are read as they are replayed.
///
/// # Errors
///
/// As [`replay`]; a file that cannot be opened or read is a [`ReplayError::Trace`].
pub fn replay_file(path: &std::path::Path, cfg: &ReplayConfig) -> Result<ReplayReport, ReplayError> {
    let mut reader = FileReader::open(path)?;
    let header = reader.header().clone();
    let records = std::iter::from_fn(move || {
        let r = reader.next()?;
        Some(r.map(|rec| (reader.line(), rec)))
    });
    replay(&header, records, cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use emuhost::import::BackendChoice;
    use emuhost::watch;

    fn collects(list: &[(u64, u64, u64, &[u64])]) -> BTreeMap<u64, CollectRecord> {
        list.iter().map(|&(n, a, b, p)| (n, (a, b, p.to_vec()))).collect()
    }

    fn rec(thread: Thread, event: Event) -> Record {
        Record { t_us: 0, thread, event }
    }

    /// Runs the write check over `(line, record)`s: the first refusal.
    fn first_refusal(records: &[(u64, Record)]) -> Option<String> {
        let mut check = WriteCheck::default();
        records.iter().find_map(|(line, r)| check_record(&mut check, *line, r).err()).map(|e| e.to_string())
    }

    #[test]
    fn a_store_racing_a_change_of_its_pages_on_another_thread_is_refused_naming_both_lines() {
        use emuhost::space::Prot;
        let (g0, g1) = (Thread::Game(0), Thread::Game(1));
        let frame = |i| rec(Thread::Render, Event::Frame { index: i });
        let commit = |t, lo, size, prot| rec(t, Event::Commit { lo: GuestAddr(lo), size, prot });
        let write = |t, addr, size| rec(t, Event::Write { addr: GuestAddr(addr), size });
        let decommit = |t, lo, size| rec(t, Event::Decommit { lo: GuestAddr(lo), size });
        let setup = [(2, commit(g0, 0x10000, 0x10000, Prot::READ_WRITE)), (3, frame(0)), (4, frame(1))];
        let with = |more: &[(u64, Record)]| first_refusal(&[&setup[..], more].concat());
        // A store, then another thread's decommit or read-only commit of its page in the frame.
        let e = with(&[(5, write(g1, 0x10ff8, 0x10)), (6, decommit(g0, 0x11000, 0x1000))]).unwrap();
        assert!(
            e.starts_with("line 6: decommit 0x11000 0x1000 on g0 may run before the write on line 5 (on g1)"),
            "{e}"
        );
        let e = with(&[(5, write(g1, 0x10ff8, 0x10)), (6, commit(g0, 0x10000, 0x1000, Prot::READ))]).unwrap();
        assert!(e.starts_with("line 6: commit 0x10000 0x1000 r-- on g0") && e.contains("line 5"), "{e}");
        // A decommit, then another thread's store to its pages.
        let e = with(&[(5, decommit(g0, 0x18000, 0x1000)), (6, write(g1, 0x18000, 1))]).unwrap();
        assert!(e.starts_with("line 6: write 0x18000+0x1 on g1 may run after line 5 (on g0)"), "{e}");
        // Fine: other pages; the same thread; a frame boundary between them; a writable recommit.
        assert_eq!(with(&[(5, write(g1, 0x10000, 0x1000)), (6, decommit(g0, 0x11000, 0x1000))]), None);
        assert_eq!(with(&[(5, write(g0, 0x11000, 0x10)), (6, decommit(g0, 0x11000, 0x1000))]), None);
        assert_eq!(with(&[(5, write(g1, 0x11000, 0x10)), (6, frame(2)), (7, decommit(g0, 0x11000, 0x1000))]), None);
        assert_eq!(with(&[(5, write(g1, 0x11000, 0x10)), (6, commit(g0, 0x11000, 0x1000, Prot::READ_WRITE))]), None);
        // Opposite changes of the same pages on two threads: the state after the frame is either.
        let e = with(&[(5, decommit(g1, 0x11000, 0x1000)), (6, commit(g0, 0x10000, 0x2000, Prot::READ_WRITE))]);
        assert!(
            e.unwrap().starts_with("line 6: commit 0x10000 0x2000 rw- on g0 and line 5 (on g1) change the same pages")
        );
        let e = with(&[(5, commit(g1, 0x30000, 0x1000, Prot::READ_WRITE)), (6, decommit(g0, 0x30000, 0x1000))]);
        assert!(e.unwrap().contains("line 5 (on g1)"));
        // The same thread's own decommit makes its later store fall outside.
        let e = with(&[(5, decommit(g0, 0x11000, 0x1000)), (6, write(g0, 0x11000, 0x10))]).unwrap();
        assert!(e.starts_with("line 6: write 0x11000+0x10 on g0 falls outside"), "{e}");
        // Another thread's writer seen by two threads: the first other thread's line is named.
        let e = with(&[(5, write(g0, 0x12000, 8)), (6, write(g1, 0x12000, 8)), (7, decommit(g0, 0x12000, 0x1000))]);
        assert!(e.unwrap().contains("the write on line 6 (on g1)"));
    }

    #[test]
    fn lines_over_the_replay_caps_are_refused_naming_the_line() {
        let sleep = |ns, count| rec(Thread::Game(0), Event::Sleep { kind: SleepKind::Guest, ns, count });
        let check = |r: Record, paced| check_limits(7, &r, paced, &mut Limits::default()).err().map(|e| e.to_string());
        assert!(check(sleep(u64::MAX, 1), false).unwrap().starts_with("line 7: a sleep of 18446744073709551615 ns"));
        assert!(check(sleep(20_000, u32::MAX), false).unwrap().starts_with("line 7: a sleep count of 4294967295"));
        assert!(check(sleep(MAX_SLEEP_NS, 11), false).unwrap().contains("cap of 10000000000 ns a line"));
        assert_eq!(check(sleep(20_000, 63), false), None);
        let write = rec(Thread::Game(0), Event::Write { addr: GuestAddr(0), size: 64 << 30 });
        assert!(check(write, false).unwrap().starts_with("line 7: a write of 0x1000000000 bytes is over"));
        let frame = Record { t_us: u64::MAX, thread: Thread::Render, event: Event::Frame { index: 1 } };
        assert_eq!(check(frame, false), None, "unpaced, frame times are not waited for");
        assert!(check(frame, true).unwrap().starts_with("line 7: frame 1 starts 18446744073709551615 us after"));
    }

    #[test]
    fn sleeps_past_the_replays_cap_in_all_are_refused_at_the_line_that_passes_it() {
        let sleep = |ns, count| rec(Thread::Game(0), Event::Sleep { kind: SleepKind::Guest, ns, count });
        let host = |ns, count| rec(Thread::Host(3), Event::Sleep { kind: SleepKind::Host, ns, count });
        let mut limits = Limits::default();
        // 59 lines of 10 s and one of 9 s on two threads: 599 s, under the cap.
        for line in 0..59 {
            let r = if line % 2 == 0 { sleep(MAX_SLEEP_NS, 10) } else { host(MAX_SLEEP_NS / 2, 20) };
            check_limits(line + 2, &r, false, &mut limits).unwrap();
        }
        check_limits(61, &sleep(MAX_SLEEP_NS, 9), false, &mut limits).unwrap();
        // Exactly at the cap is not past it; one nanosecond more is, on the line that asks it.
        check_limits(62, &host(500_000_000, 2), false, &mut limits).unwrap();
        let e = check_limits(63, &sleep(1, 1), false, &mut limits).unwrap_err().to_string();
        assert!(e.starts_with("line 63: the trace's sleeps add up to 600000000001 ns"), "{e}");
        assert!(e.contains(&format!("cap of {MAX_SLEEP_TOTAL_NS} ns in all")), "{e}");
        // A refused line does not count: a shorter one after it still fits.
        assert_eq!(limits.slept_ns, MAX_SLEEP_TOTAL_NS);
        let mut limits = Limits { slept_ns: MAX_SLEEP_TOTAL_NS, ..Limits::default() };
        assert!(check_limits(2, &sleep(u64::MAX, u32::MAX), false, &mut limits).is_err(), "no overflow");
    }

    /// A replay of `games` game threads beside the render thread, each sleeping once; threads'
    /// stacks of `stack` bytes.
    fn many_threads(games: u16, stack: Option<usize>) -> Result<ReplayReport, ReplayError> {
        let mut records = vec![(2, rec(Thread::Render, Event::Frame { index: 0 }))];
        for n in 0..games {
            let sleep = Event::Sleep { kind: SleepKind::Guest, ns: 1, count: 1 };
            records.push((u64::from(n) + 3, rec(Thread::Game(n), sleep)));
        }
        replay_with(&Header::default(), records.into_iter().map(Ok), &plain_cfg(), stack)
    }

    /// The settings of a replay on the pin import backend, the seed's policy and the platform's
    /// protection backend.
    fn plain_cfg() -> ReplayConfig {
        let mut cfg = ReplayConfig::default();
        cfg.settings.import_backend = BackendChoice::Only(emuhost::import::BackendKind::Pin);
        cfg.settings.import.policy = emuhost::settings::ImportPolicyName::Chunks;
        cfg.settings.watch = Some(if cfg!(windows) { watch::BackendKind::Guard } else { watch::BackendKind::Mprotect });
        cfg
    }

    /// A collect on the render thread that finds the space's lock held (here by a layout read
    /// held open on another thread, as by a commit waiting in the kernel) is counted in the render
    /// thread's figures, from its own OS thread; a game thread's figures count none of it. (With
    /// the published layout, the default, a collect takes no space lock: this is the old read.)
    #[test]
    fn the_render_threads_wait_for_the_space_lock_is_in_its_figures() {
        let mut cfg = plain_cfg();
        cfg.settings.watch_published_layout = false;
        let (space, importer, _, tracker) = runtime(&Header::default(), &cfg).unwrap();
        let sh = Shared::new((&space, &importer, &tracker), &cfg, None);
        let g = space.range(0, 0x10000).unwrap();
        let held = Duration::from_millis(2);
        let (render, game) = std::thread::scope(|sc| {
            let (tx, rx) = sync_channel(1);
            let (gtx, grx) = sync_channel(1);
            let sh = &sh;
            let render = sc.spawn(move || worker(sh, rx, Thread::Render));
            let game = sc.spawn(move || worker(sh, grx, Thread::Game(0)));
            let (held_tx, held_rx) = sync_channel(1);
            let space = &space;
            sc.spawn(move || {
                space.with_layout(g, |_| {
                    held_tx.send(()).unwrap();
                    let start = Instant::now();
                    while space.lock_waiters() == 0 {
                        assert!(start.elapsed() < Duration::from_secs(10), "the collect never waited");
                        std::thread::yield_now();
                    }
                    std::thread::sleep(held);
                })
            });
            held_rx.recv().unwrap();
            let collect = rec(Thread::Render, Event::Collect { lo: GuestAddr(0), size: 0x10000 });
            tx.send(Msg::Event(1, collect)).unwrap();
            let sleep = rec(Thread::Game(0), Event::Sleep { kind: SleepKind::Guest, ns: 1, count: 1 });
            gtx.send(Msg::Event(2, sleep)).unwrap();
            drop((tx, gtx));
            (render.join().unwrap(), game.join().unwrap())
        });
        assert!(render.error.is_none() && render.render && !game.render);
        let w = render.lock_waits;
        assert!(w.count == 1 && w.longest >= held && w.total == w.longest, "{w:?}");
        assert_eq!(game.lock_waits, LockWaits::default());
    }

    /// `frames` frames: each, two game threads store over the same bytes (which thread's pattern
    /// is left depends on how they interleave), a range is committed every third frame and the
    /// one before it decommitted, and the render thread collects.
    fn rewinding_trace(frames: u64) -> Vec<(u64, Record)> {
        use emuhost::space::Prot;
        let (g0, g1) = (Thread::Game(0), Thread::Game(1));
        let base = 0x1000_0000u64;
        let mut out = vec![rec(g0, Event::Commit { lo: GuestAddr(base), size: 0x40_0000, prot: Prot::READ_WRITE })];
        for f in 0..frames {
            out.push(rec(Thread::Render, Event::Frame { index: f }));
            let at = base + (f % 7) * 0x3000 + 0x123;
            out.push(rec(g0, Event::Write { addr: GuestAddr(at), size: 0x2100 }));
            out.push(rec(g1, Event::Write { addr: GuestAddr(at + 0x800), size: 0x2000 }));
            let extra = base + 0x80_0000 + (f / 3) * 0x10_0000;
            if f % 3 == 0 {
                if f > 0 {
                    out.push(rec(g0, Event::Decommit { lo: GuestAddr(extra - 0x10_0000), size: 0x10_0000 }));
                }
                out.push(rec(g0, Event::Commit { lo: GuestAddr(extra), size: 0x10_0000, prot: Prot::READ_WRITE }));
            } else {
                out.push(rec(g1, Event::Write { addr: GuestAddr(extra + f * 0x1111), size: 0x1800 }));
            }
            out.push(rec(Thread::Render, Event::Collect { lo: GuestAddr(base), size: 0x40_0000 }));
        }
        out.into_iter().enumerate().map(|(i, r)| (i as u64 + 2, r)).collect()
    }

    fn snapshot_replay(frames: u64, every: u64, rewind: Option<u64>, skip_restore: bool) -> ReplayReport {
        let mut cfg = plain_cfg();
        (cfg.snapshot_every, cfg.rewind, cfg.skip_restore) = (Some(every), rewind, skip_restore);
        let header = Header { window: 1 << 32, ..Header::default() };
        replay_with(&header, rewinding_trace(frames).into_iter().map(Ok), &cfg, None).unwrap()
    }

    #[test]
    fn snapshots_are_taken_on_the_render_thread_at_the_end_of_every_nth_frame() {
        let r = snapshot_replay(10, 3, None, false);
        let s = r.snapshots.unwrap();
        // Boundaries 3, 6 and 9 (the last frame has none after it).
        assert_eq!(s.taken, 3);
        assert_eq!(s.takes.iter().map(|t| t.0).collect::<Vec<_>>(), [2, 5, 8]);
        assert!(s.takes.iter().all(|t| r.frames[t.0 as usize].snapshot == t.1));
        assert!(s.pages_copied > 0 && s.bytes_kept_peak > 0);
        assert_eq!((s.rewinds, s.checks, s.restores.len()), (0, 0, 0));
        assert_eq!(r.lost_writes, 0);
    }

    #[test]
    fn a_rewind_makes_the_frames_again_and_finds_the_memory_the_same() {
        let r = snapshot_replay(20, 1, Some(2), false);
        let s = r.snapshots.unwrap();
        // Rewinds at the end of frames 8 and 16 (boundaries 8 and 16), each comparing the
        // state restored and the state after the frames made again.
        assert_eq!((s.taken, s.rewinds, s.restores.len(), s.checks), (19, 2, 2, 4), "{s:?}");
        assert_eq!((s.mismatched_snapshots, s.mismatched_bytes, s.first_mismatch), (0, 0, None), "{s:?}");
        assert_eq!(r.lost_writes, 0);
    }

    #[test]
    fn a_rewind_that_does_not_restore_is_caught() {
        // One rewind, at the end of frame 8 (a second one would find its stores outside memory
        // the first left uncommitted: an error, not a mismatch).
        let s = snapshot_replay(10, 1, Some(2), true).snapshots.unwrap();
        assert_eq!((s.rewinds, s.checks), (1, 2), "{s:?}");
        assert!(s.mismatched_snapshots > 0 && s.mismatched_bytes > 0, "{s:?}");
        let (frame, when) = s.first_mismatch.unwrap();
        // The state restored is frame 6's (boundary 6): memory is still frame 8's.
        assert_eq!((frame, when), (5, "after the restore"), "{s:?}");
    }

    #[test]
    fn snapshot_settings_are_checked_naming_the_value() {
        let check = |every, rewind| {
            let cfg = ReplayConfig { snapshot_every: every, rewind, ..Default::default() };
            cfg.check().err().map(|e| e.to_string())
        };
        assert_eq!(check(Some(1), Some(4)), None);
        assert_eq!(check(Some(2), Some(4)), None);
        assert!(check(Some(0), None).unwrap().starts_with("a snapshot every 0 frames"));
        assert!(check(Some(u64::MAX), None).unwrap().contains("18446744073709551615"));
        assert!(check(None, Some(2)).unwrap().contains("needs snapshots"));
        assert!(check(Some(1), Some(0)).unwrap().starts_with("a rewind of 0 frames"));
        assert!(check(Some(1), Some(u64::MAX)).unwrap().starts_with("a rewind of 18446744073709551615 frames"));
        assert!(check(Some(3), Some(4)).unwrap().contains("must be a multiple"));
        let every = |rewind, m| {
            let cfg = ReplayConfig { snapshot_every: Some(1), rewind, rewind_every: m, ..Default::default() };
            cfg.check().err().map(|e| e.to_string())
        };
        assert_eq!(every(Some(2), Some(4)), None);
        assert_eq!(every(Some(1), Some(u64::MAX)), None);
        assert!(every(None, Some(8)).unwrap().contains("needs a rewind"));
        for m in [0, 2, 3, 5] {
            let e = every(Some(2), Some(m)).unwrap();
            assert!(e.starts_with(&format!("a rewind of 2 frames every {m} frames")), "{e}");
        }
        let e = every(Some(4), Some(u64::MAX)).unwrap();
        assert!(e.contains("18446744073709551615"), "{e}");
    }

    #[test]
    fn a_rewind_interval_of_its_own_spaces_the_rewinds() {
        let mut cfg = plain_cfg();
        (cfg.snapshot_every, cfg.rewind, cfg.rewind_every) = (Some(1), Some(1), Some(6));
        let header = Header { window: 1 << 32, ..Header::default() };
        let r = replay_with(&header, rewinding_trace(20).into_iter().map(Ok), &cfg, None).unwrap();
        let s = r.snapshots.unwrap();
        // Rewinds at boundaries 6, 12 and 18 (not every 4 frames), each restoring the previous
        // frame's snapshot and checking twice.
        assert_eq!((s.rewinds, s.checks, s.every_rewind), (3, 6, 6), "{s:?}");
        assert_eq!((s.mismatched_snapshots, s.mismatched_bytes), (0, 0), "{s:?}");
    }

    #[test]
    fn a_trace_on_more_threads_than_the_cap_is_refused_at_the_first_line_past_it() {
        let at_cap = (MAX_THREADS - 1) as u16;
        assert_eq!(many_threads(at_cap, None).unwrap().threads, MAX_THREADS);
        let e = many_threads(at_cap + 1, None).unwrap_err().to_string();
        assert!(
            e.starts_with("line 1026: thread g1023 makes 1025 threads, over the replay's cap of 1024 threads"),
            "{e}"
        );
    }

    #[test]
    fn the_frames_begun_are_counted_for_a_progress_display() {
        let records = (0..5u64).map(|i| Ok((i + 2, rec(Thread::Render, Event::Frame { index: i }))));
        let mut cfg = plain_cfg();
        let begun = Arc::new(AtomicU64::new(0));
        cfg.frames_begun = Some(begun.clone());
        let r = replay_with(&Header::default(), records, &cfg, None).unwrap();
        assert_eq!((r.frames.len(), begun.load(SeqCst)), (5, 5));
    }

    #[test]
    fn a_thread_the_os_refuses_is_an_error_naming_its_line() {
        // A stack larger than the address space: no OS gives it.
        let e = many_threads(2, Some(1 << 60)).unwrap_err();
        assert!(matches!(&e, ReplayError::Spawn { line: 2, thread, .. } if thread == "r"), "{e:?}");
        assert_eq!(e.to_string(), "line 2: starting an OS thread for trace thread r failed");
        assert!(many_threads(2, None).unwrap().threads == 3);
    }

    #[test]
    fn a_write_is_stored_in_bounded_pieces_and_whole() {
        let space = SpaceConfig::default().window(1 << 30).build().unwrap();
        let g = space.range(0x10000, 0x40000).unwrap();
        space.commit(g, emuhost::space::Prot::READ_WRITE).unwrap();
        let size = 2 * STORE_PIECE + 0x123;
        store_pattern(&space, GuestAddr(0x10001), size, 0x5a).unwrap();
        let mut back = vec![0u8; size as usize + 2];
        space.read(GuestAddr(0x10000), &mut back).unwrap();
        assert_eq!((back[0], back[back.len() - 1]), (0, 0), "nothing stored outside");
        assert!(back[1..back.len() - 1].iter().all(|&b| b == 0x5a));
    }

    #[test]
    fn a_write_must_be_reported_by_the_first_collect_after_it() {
        // Collect 1 over pages 0..10 reported page 3; collect 2 over the same reported nothing.
        let c = collects(&[(1, 0, 10, &[3]), (2, 0, 10, &[]), (3, 20, 30, &[])]);
        // Stored before collect 1 began (epochs 0..0): collect 1 reported it.
        assert_eq!(check_writes(&[(3, 0, 0)], &c), (0, 0));
        // Stored while collect 1 ran (1..1): collect 1 or 2 may report it; 1 did.
        assert_eq!(check_writes(&[(3, 1, 1)], &c), (0, 0));
        // Stored after collect 1 ended and before 2 (1..1 for page 4): 2 must report it; it did not.
        assert_eq!(check_writes(&[(4, 1, 1)], &c), (1, 0));
        // Stored between collects 1 and 2 on page 3 (epoch 1 both sides): collect 1 might have seen it.
        assert_eq!(check_writes(&[(3, 1, 1)], &c), (0, 0));
        // Stored after collect 2 (2..2): no later collect covers page 5.
        assert_eq!(check_writes(&[(5, 2, 2)], &c), (0, 1));
        // Only collects covering the page count: collect 3 covers page 25 and missed it.
        assert_eq!(check_writes(&[(25, 0, 0)], &c), (1, 0));
        assert_eq!(check_writes(&[(26, 3, 3)], &c), (0, 1));
    }
}
