//! The no-lost-writes check: every kind of operation at once over the same pages, checked against
//! a shadow record. Two writer threads store with the CPU; a host writer copies through the kernel
//! (`Space::write`); a populator faults runs of the written pages in (`Space::populate`); a
//! mutator commits, protects, releases, splits views and populates pages it has just remapped or
//! recommitted; an armer arms, disarms and re-arms a zone the writers write; the calling thread
//! collects through the tracker, and a consumer (a texture cache, say) collects beside it on a
//! thread of its own, each owed every write; a forker forks the process now and then, and its
//! child tries to collect through the parent's tracker and consumer (refused: the parent must
//! lose nothing), and a snapshot taker takes snapshots of pages 32..256 (`emuhost::snapshot`, one
//! more consumer) and reads each back: every write must be in the first snapshot taken after it
//! (where its writer's next write to the page began after that snapshot ended: a take copies a
//! page being written as it finds it, byte by byte).
//! Used by the tests and by `emuhost bench watch`.
//!
//! Each write has its own identity (writer, sequence, page) and its own window of collects, one
//! of which must report its page: from the first collect that had not ended when the write began
//! to the first that began after it ended. A write made between two collects has a window of
//! exactly one collect, so an earlier write to the same page cannot hide it; the collector leaves
//! a gap after each collect until every writer has made such a write.
//!
//! Linux and Windows alike, with the platform's backends ([`BackendKind::AUTO`]), but for the
//! forker (Windows has no fork: no fork is made or counted there) and
//! [`StressConfig::map_pressure`] (refused on Windows, which has no limit on mappings).
//!
//! ```no_run
//! // no_run: a run starts a dozen threads and forks; tests and `emuhost bench watch` run it.
//! use emuhost::watch::BackendKind;
//! use emuhost_lab::stress::{StressConfig, stress_with};
//!
//! let report = stress_with(BackendKind::AUTO[0], StressConfig::new(10_000)).unwrap();
//! assert_eq!(report.lost, 0, "{report:?}");
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::rng::Rng;
use emuhost::snapshot::{SnapshotConfig, SnapshotError, SnapshotId, Snapshots};
use emuhost::space::{GuestAddr, GuestRange, Prot, SectionId, Space, page_size};
use emuhost::watch::{BackendKind, Consumer, Tracker, WatchError};

/// How many operations of each kind a stress run made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StressOps {
    /// Stores by the CPU (the two writer threads).
    pub cpu_stores: u64,
    /// Copies into guest pages through the kernel (`process_vm_writev`).
    pub host_writes: u64,
    /// Collects by the tracker (the calling thread).
    pub collects: u64,
    /// Commits over written pages, and recommits of pages just released.
    pub commits: u64,
    /// Protection changes of written pages.
    pub protects: u64,
    /// Releases: of a page inside an allocation the writers write, of a section view beside
    /// written views, and of a page of an allocation of its own.
    pub releases: u64,
    /// Section pages mapped inside a run of views (each splits the run).
    pub view_splits: u64,
    /// Populates of runs of pages the writers write.
    pub populates_written: u64,
    /// Populates of pages just remapped or recommitted.
    pub populates_fresh: u64,
    /// Arms of the zone the writers write (while it is armed, or after a disarm).
    pub arms: u64,
    /// Disarms of that zone.
    pub disarms: u64,
    /// Collects by a consumer of the tracker, beside the tracker's own.
    pub consumer_collects: u64,
    /// Forks whose child tried to collect through the parent's tracker and consumer (and was
    /// refused).
    pub forks: u64,
}

impl StressOps {
    /// Each kind's name and count.
    pub fn kinds(&self) -> [(&'static str, u64); 13] {
        [
            ("cpu stores", self.cpu_stores),
            ("host writes", self.host_writes),
            ("collects", self.collects),
            ("commits", self.commits),
            ("protects", self.protects),
            ("releases", self.releases),
            ("view splits", self.view_splits),
            ("populates of written pages", self.populates_written),
            ("populates of fresh pages", self.populates_fresh),
            ("arms", self.arms),
            ("disarms", self.disarms),
            ("consumer collects", self.consumer_collects),
            ("forks", self.forks),
        ]
    }
}

/// What a stress run found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StressReport {
    /// Writes made: CPU stores and host writes.
    pub writes: u64,
    /// Writes no collect owed a report: made to the arm zone while it was disarmed, or while an
    /// arm or disarm of it ran (an arm forgets what was written before it).
    pub unchecked: u64,
    /// Checked writes whose window is one collect (made between two collects).
    pub exact: u64,
    /// Checked writes whose page no collect of their window reported.
    pub lost: u64,
    /// Writes outside the arm zone whose page no collect of the consumer's reported within the
    /// write's window of the consumer's collects (the consumer's reads must not take writes
    /// from the tracker's own collects, nor theirs from it).
    pub consumer_lost: u64,
    /// Lost writes by the weaker rule this check used before (a report of the page by any collect
    /// from the one running when the write began): an earlier write to the page can hide a lost
    /// one from it. Kept to show what the identity of each write catches.
    pub lost_by_start_epochs: u64,
    /// The report the test hook dropped ([`StressConfig::drop_one_report`]): page, collect.
    pub dropped: Option<(u64, u64)>,
    /// At the map limit ([`StressConfig::map_pressure`]): reports of pages of the 2 MiB blocks
    /// that no write of their window explains, which only a fault that unprotected its whole
    /// block (the kernel refused to split a mapping) makes; 0 otherwise.
    pub block_reports_unwritten: u64,
    /// Collects by the tracker.
    pub collects: u64,
    /// Snapshots taken beside the collects (none under map pressure: their copies would need
    /// mappings).
    pub snapshot_takes: u64,
    /// Writes to the snapshots' pages checked against the first snapshot taken after them:
    /// those whose writer did not write the page again before that snapshot ended.
    pub snapshot_checked: u64,
    /// Of those, writes whose value that snapshot did not hold: the snapshots' reads lost them.
    pub snapshot_lost: u64,
    /// Commits, protections, releases, view splits, populates, arms and disarms made while the
    /// writers ran.
    pub space_ops: u64,
    /// Each kind of operation's count.
    pub ops: StressOps,
}

/// How a stress run is made: [`StressConfig::new`], then the setters (`#[non_exhaustive]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StressConfig {
    /// The fewest CPU stores of each of the two writers.
    pub writes_per_writer: u64,
    /// An armer thread arms, disarms and re-arms pages 0..32, which the writers write.
    pub arm_races: bool,
    /// Test hook: drop one report of a page from one collect (one whose write between two
    /// collects only that collect may report, and which the collects before and after reported
    /// too), as a tracker that lost the write would, to show that the check catches it.
    #[doc(hidden)]
    pub drop_one_report: bool,
    /// The process is brought to a few mappings below `vm.max_map_count` first, and the writers
    /// also write two 2 MiB blocks of their own: their faults split mappings until the kernel
    /// refuses (`ENOMEM`), and the mprotect backend's handler then unprotects the page's whole
    /// block. The mutator and the armer rest (the kernel would refuse their commits too). The
    /// limit is the process's: run it in a process of its own.
    pub map_pressure: bool,
}

impl StressConfig {
    /// Every race on: `writes_per_writer` CPU stores (at least) on each writer.
    pub fn new(writes_per_writer: u64) -> Self {
        Self { writes_per_writer, arm_races: true, drop_one_report: false, map_pressure: false }
    }

    /// Sets [`StressConfig::arm_races`].
    pub fn arm_races(mut self, on: bool) -> Self {
        self.arm_races = on;
        self
    }

    /// Sets [`StressConfig::map_pressure`].
    pub fn map_pressure(mut self, on: bool) -> Self {
        self.map_pressure = on;
        self
    }

    /// Sets [`StressConfig::drop_one_report`] (a test hook).
    #[doc(hidden)]
    pub fn drop_one_report(mut self, on: bool) -> Self {
        self.drop_one_report = on;
        self
    }
}

/// One write: its page, and the collects that bound it.
#[derive(Clone, Copy, Debug)]
struct Write {
    page: u32,
    /// The collect epoch read before the write (the weaker rule's first collect).
    e1: u32,
    /// The first collect that had not ended when the write began.
    lo: u32,
    /// The first collect that began after the write ended.
    hi: u32,
    /// In the arm zone: arms and disarms begun before the write, if none was running and the zone
    /// was armed (else `NOT_OWED`).
    arms: u32,
    /// The consumer's window: its first collect that had not ended when the write began, and its
    /// first that began after the write ended.
    clo: u32,
    chi: u32,
    /// The first snapshot taken after the write ended.
    sno: u32,
    /// The snapshots ended before the write began.
    sdone: u32,
}

const NOT_OWED: u32 = u32::MAX;

/// Pages the stress uses: 0..256 four allocations the writers write, 256..320 one the mutator
/// releases page by page, 512..576 a run of section views.
const PAGES: u64 = 576;
/// The zone the armer arms, disarms and re-arms.
const ZONE: std::ops::Range<u64> = 0..32;
/// The page a writer writes when it finds itself between two collects.
const HOT: u64 = 100;
/// Pages inside the writers' allocations the mutator releases, one per allocation.
const RELEASED: [u64; 4] = [40, 104, 168, 232];
/// View pages the mutator releases and maps again.
const VOLATILE: [u64; 2] = [512 + 16, 512 + 48];

/// The fewest steps of the host writer, the populator, the mutator and the armer, and the fewest
/// collects, a run makes: the CPU writers go on past their count until all are reached, so every
/// kind of operation runs beside the others however the threads are scheduled.
const MIN_STEPS: [u64; 6] = [1000, 500, 100, 60, 100, 10];
const MIN_COLLECTS: u64 = 200;
/// Mappings left free below `vm.max_map_count` under map pressure: for the threads the stress
/// starts (stacks, allocator arenas) and a few splits (Linux's limit).
const MAP_HEADROOM: u64 = 96;
/// Under map pressure, a writer waits for the next collect after this many writes (at most
/// `PACE_WAIT`).
const PACED_WRITES: u64 = 2000;
const PACE_WAIT: Duration = Duration::from_millis(200);
/// The longest a collector waits after a collect for every writer to write before the next.
const GAP_WAIT: Duration = Duration::from_millis(2);

/// What the threads of a run share to pace themselves.
#[derive(Default)]
struct Pace {
    /// Everything is set up: the threads start.
    go: AtomicBool,
    /// The collect epoch: collect `n` raises it to `n` first.
    epoch: AtomicU64,
    /// Collects ended: collect `n` sets it to `n` after its report is in.
    done: AtomicU64,
    /// Per writer: the latest collect after which it wrote before the next began.
    gap: [AtomicU64; 2],
    /// Steps made by the host writer, the populator, the mutator, the armer, the consumer and the
    /// forker.
    steps: [AtomicU64; 6],
    /// The consumer's collects begun and ended (as `epoch` and `done` are the tracker's).
    c_epoch: AtomicU64,
    c_done: AtomicU64,
    /// Snapshots begun, and ended.
    s_epoch: AtomicU64,
    s_done: AtomicU64,
    /// Arms and disarms of the zone begun, and ended; whether the zone is armed.
    arms_started: AtomicU64,
    arms_done: AtomicU64,
    zone_armed: AtomicBool,
    /// Every minimum reached (or a thread failed): the CPU writers may stop.
    enough: AtomicBool,
    /// The CPU writers are done: the background threads stop.
    stop: AtomicBool,
}

/// What a writer reads before a write.
struct Before {
    e1: u64,
    done: u64,
    arms: u32,
    c_done: u64,
    s_done: u64,
}

impl Pace {
    fn wait_to_go(&self) {
        while !self.go.load(SeqCst) {
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn before(&self, page: u64) -> Before {
        let done = self.done.load(SeqCst);
        let c_done = self.c_done.load(SeqCst);
        let s_done = self.s_done.load(SeqCst);
        let e1 = self.epoch.load(SeqCst);
        let arms = if ZONE.contains(&page) {
            zone_owed(|f| match f {
                ZoneField::Done => self.arms_done.load(SeqCst),
                ZoneField::Armed => self.zone_armed.load(SeqCst) as u64,
                ZoneField::Started => self.arms_started.load(SeqCst),
            })
        } else {
            0
        };
        Before { e1, done, arms, c_done, s_done }
    }

    fn after(&self, b: Before, page: u64) -> Write {
        let e2 = self.epoch.load(SeqCst);
        let c2 = self.c_epoch.load(SeqCst);
        let s2 = self.s_epoch.load(SeqCst);
        Write {
            page: page as u32,
            e1: b.e1 as u32,
            lo: b.done as u32 + 1,
            hi: e2 as u32 + 1,
            arms: b.arms,
            clo: b.c_done as u32 + 1,
            chi: c2 as u32 + 1,
            sno: s2 as u32 + 1,
            sdone: b.s_done as u32,
        }
    }
}

/// What [`zone_owed`] reads of the armer's progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ZoneField {
    /// Arms and disarms ended.
    Done,
    /// Whether the zone is armed (1) or not (0).
    Armed,
    /// Arms and disarms begun.
    Started,
}

/// The arms and disarms begun before a write to the zone, if the zone was armed and none was
/// running while its state was read (else [`NOT_OWED`]). A seqlock's read: ended first, the state,
/// begun last; equal counts mean no arm or disarm began after the first read, and none was
/// running at it, so the state read between them is the one the last arm or disarm left. (Begun
/// first and ended last would let a disarm end between the state's read and the count's, and
/// owe a report to a write made to the disarmed zone.)
fn zone_owed(mut load: impl FnMut(ZoneField) -> u64) -> u32 {
    let done = load(ZoneField::Done);
    let armed = load(ZoneField::Armed) != 0;
    let started = load(ZoneField::Started);
    if armed && started == done { started as u32 } else { NOT_OWED }
}

/// Background thread `k` of the stress: runs `step` until told to stop, at least once, and at most
/// `per_collect` times between two collects (so that no kind of operation starves the others of
/// the locks they share).
fn background(
    pace: &Arc<Pace>,
    k: usize,
    per_collect: u64,
    mut step: impl FnMut(u64) -> Result<(), WatchError> + Send + 'static,
) -> JoinHandle<Result<u64, WatchError>> {
    let pace = pace.clone();
    std::thread::spawn(move || {
        pace.wait_to_go();
        let (mut i, mut seen, mut now) = (0, u64::MAX, 0);
        loop {
            let e = pace.epoch.load(SeqCst);
            if e != seen {
                (seen, now) = (e, 0);
            }
            if now < per_collect {
                if let Err(err) = step(i) {
                    pace.enough.store(true, SeqCst);
                    return Err(err);
                }
                (i, now) = (i + 1, now + 1);
                pace.steps[k].store(i, SeqCst);
            }
            if pace.stop.load(SeqCst) && i > 0 {
                return Ok(i);
            }
            if now >= per_collect {
                // A sleep, not a yield: the kernel's scheduler (EEVDF) pushes a yielding thread's
                // deadline back at each yield, so a thread spinning on yields starves itself.
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    })
}

/// The host writer of the stress (background thread 0): writes a target page through
/// [`Tracker::host_write`] and logs the write, until the log is full.
fn host_writer(
    pace: &Arc<Pace>,
    targets: Arc<Vec<u64>>,
    s: Arc<Space>,
    t: Arc<Tracker>,
    host_log: Arc<std::sync::Mutex<Vec<Write>>>,
) -> JoinHandle<Result<u64, WatchError>> {
    let pc = pace.clone();
    let mut rng = Rng::new(4);
    background(pace, 0, 8, move |i| {
        let pg = rng.pick(&targets);
        if host_log.lock().unwrap_or_else(|p| p.into_inner()).len() == 1 << 16 {
            // The log is full (and must not grow at the map limit).
            return Ok(());
        }
        let b = pc.before(pg);
        t.host_write(s.range(pg * page_size(), page_size())?, || {
            s.write(GuestAddr(pg * page_size() + 16), &i.to_le_bytes())
        })??;
        let w = pc.after(b, pg);
        host_log.lock().unwrap_or_else(|p| p.into_inner()).push(w);
        Ok(())
    })
}

/// [`stress_with`] with every race on.
///
/// # Errors
/// As [`stress_with`].
pub fn stress(kind: BackendKind, writes_per_writer: u64) -> Result<StressReport, WatchError> {
    stress_with(kind, StressConfig::new(writes_per_writer))
}

/// The space of a run: pages as [`PAGES`] says, all armed.
fn layout(kind: BackendKind) -> Result<(Arc<Space>, Arc<Tracker>, SectionId), WatchError> {
    let p = page_size();
    let s = Arc::new(Space::with_window(1 << 30)?);
    let t = Tracker::new(&s, &emuhost::watch::TrackerConfig::default().backend(Some(kind)).skip_self_test(true))?;
    for i in 0..5 {
        s.commit(s.range(i * 64 * p, 64 * p)?, Prot::READ_WRITE)?;
    }
    let sec = s.create_section(64 * p)?;
    s.map_pages(GuestAddr(512 * p), sec, &(0..64).collect::<Vec<_>>(), Prot::READ_WRITE)?;
    t.arm(s.range(0, PAGES * p)?)?;
    Ok((s, t, sec))
}

/// A CPU writer: stores its sequence number into random target pages, and into [`HOT`] when it
/// finds itself between two collects without a write there yet.
fn writer(
    w: u64,
    cfg: StressConfig,
    pace: Arc<Pace>,
    targets: Arc<Vec<u64>>,
    s: Arc<Space>,
) -> JoinHandle<Result<Vec<Write>, WatchError>> {
    std::thread::spawn(move || {
        // At the map limit the log must not grow (a larger allocation needs a new mapping): twice
        // the count, and no more.
        let cap = if cfg.map_pressure { 2 * cfg.writes_per_writer } else { cfg.writes_per_writer };
        let mut log = Vec::with_capacity(cap as usize);
        let mut rng = Rng::new(w + 1);
        let (mut i, mut last_gap) = (0u64, 0u64);
        pace.wait_to_go();
        while i < cfg.writes_per_writer
            || (!pace.enough.load(SeqCst) && (!cfg.map_pressure || log.len() < log.capacity()))
        {
            i += 1;
            if cfg.map_pressure && i % PACED_WRITES == 0 {
                // At the map limit the log cannot grow past its capacity, so the writers must not
                // outrun the collects: a block's unwritten pages show only between frequent ones.
                let (e, since) = (pace.epoch.load(SeqCst), Instant::now());
                while pace.epoch.load(SeqCst) == e && !pace.stop.load(SeqCst) && since.elapsed() < PACE_WAIT {
                    std::thread::sleep(Duration::from_micros(10));
                }
            }
            let random = rng.pick(&targets);
            let (d, e) = (pace.done.load(SeqCst), pace.epoch.load(SeqCst));
            let pg = if d == e && last_gap < d { HOT } else { random };
            let b = pace.before(pg);
            // The target pages stay committed (or mapped) read-write throughout: the mutator
            // re-commits and re-protects them read-write and releases only other pages.
            // SAFETY: as said above; the tracker handles the faults of the pages it armed.
            #[allow(unsafe_code)]
            let stored = unsafe { s.store_unchecked(GuestAddr(pg * page_size() + w * 8), &i.to_le_bytes()) };
            if let Err(e) = stored {
                pace.enough.store(true, SeqCst);
                return Err(e.into());
            }
            let done = pace.after(b, pg);
            if done.lo == done.hi {
                last_gap = done.lo as u64 - 1;
                pace.gap[w as usize].store(last_gap, SeqCst);
            }
            log.push(done);
        }
        Ok(log)
    })
}

/// The populator: faults runs of eight pages the writers write in, across an allocation's end
/// now and then (never over a page the mutator may have released).
fn populator(pace: &Arc<Pace>, s: Arc<Space>, t: Arc<Tracker>) -> JoinHandle<Result<u64, WatchError>> {
    let mut rng = Rng::new(3);
    background(pace, 1, 4, move |_| {
        let first = loop {
            let f = rng.below(256 - 8);
            if !RELEASED.iter().any(|r| (f..f + 8).contains(r)) {
                break f;
            }
        };
        let r = s.range(first * page_size(), 8 * page_size())?;
        t.host_write(r, || s.populate(r))??;
        Ok(())
    })
}

/// The mutator's step `i`: a commit over written pages, a protection, a view split, releases
/// beside written pages and of a page of its own, and populates of the pages just mapped.
fn mutate(s: &Space, t: &Tracker, sec: SectionId, i: u64) -> Result<(), WatchError> {
    let p = page_size();
    let a = i % 4;
    // The commit also brings back the page of this allocation released four steps ago.
    s.commit(s.range(a * 64 * p, 64 * p)?, Prot::READ_WRITE)?;
    s.protect(s.range((a * 64 + 8) * p, 8 * p)?, Prot::READ_WRITE)?;
    // A view split, and a populate of the page just mapped.
    let v = s.range(VOLATILE[(i % 2) as usize] * p, p)?;
    s.decommit(v)?;
    s.map_section(v, sec, v.start().0 - 512 * p, Prot::READ_WRITE)?;
    t.host_write(v, || s.populate(v))??;
    // A private page released, recommitted and populated.
    let q = s.range((256 + i % 64) * p, p)?;
    s.decommit(q)?;
    s.commit(q, Prot::READ_WRITE)?;
    t.host_write(q, || s.populate(q))??;
    // A page inside an allocation the writers write, released until its next commit.
    s.decommit(s.range(RELEASED[a as usize] * p, p)?)?;
    Ok(())
}

/// The armer's step `i`: every other step, an arm of the armed zone, a disarm, or an arm again.
fn arm_step(t: &Tracker, pace: &Pace, zone: GuestRange, i: u64) -> Result<(), WatchError> {
    if i % 2 == 1 {
        return Ok(());
    }
    let arm = (i / 2) % 3 != 1;
    pace.arms_started.fetch_add(1, SeqCst);
    let r = if arm { t.arm(zone) } else { t.disarm(zone) };
    pace.zone_armed.store(arm, SeqCst);
    pace.arms_done.fetch_add(1, SeqCst);
    r
}

/// Whether the page list `reported` (collect numbers, ascending) has one in `lo..=hi`.
fn reported_in(reported: &[u32], lo: u32, hi: u32) -> bool {
    let i = reported.partition_point(|&r| r < lo);
    reported.get(i).is_some_and(|&r| r <= hi)
}

/// The test hook: drops the report by collect `k` of [`HOT`], where a write made between
/// collects `k - 1` and `k` is owed it and collects `k - 1` and `k + 1` reported the page too.
fn drop_one(reported: &mut [Vec<u32>], writes: &[Write]) -> Option<(u64, u64)> {
    let hot = &mut reported[HOT as usize];
    let k = writes.iter().find_map(|w| {
        let k = w.lo;
        (w.page as u64 == HOT && w.lo == w.hi && k > 1 && [k - 1, k, k + 1].iter().all(|c| hot.contains(c)))
            .then_some(k)
    })?;
    hot.retain(|&c| c != k);
    Some((HOT, k as u64))
}

/// The two 2 MiB blocks the writers write under map pressure, committed and armed: their first
/// and end page.
fn blocks(s: &Space, t: &Tracker) -> Result<(u64, u64), WatchError> {
    let (p, block) = (page_size(), 2 << 20);
    let start = (PAGES * p).next_multiple_of(block);
    let r = s.range(start, 2 * block)?;
    s.commit(r, Prot::READ_WRITE)?;
    t.arm(r)?;
    Ok((start / p, (start + 2 * block) / p))
}

/// A space of its own whose pages alternate in protection (each change splits a mapping), as many
/// as bring the process to [`MAP_HEADROOM`] mappings below the OS's limit on them
/// ([`emuhost::probe::process_map_count`]: Linux's `vm.max_map_count`). Dropped, it gives them
/// back. Where the OS has no such limit (Windows) it is refused, naming why.
fn fill_maps(whole: GuestRange, kind: BackendKind) -> Result<Space, WatchError> {
    let os = |op, source| WatchError::Os { op, range: whole, backend: kind.name(), source };
    let Some(count) = emuhost::probe::process_map_count().map_err(|e| os("count the mappings", e))? else {
        return Err(os(
            "map pressure",
            std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "this OS has no limit on the number of mappings (Linux's vm.max_map_count) to run into",
            ),
        ));
    };
    let splits = count.max.saturating_sub(count.mappings + MAP_HEADROOM) / 2;
    let p = page_size();
    let filler = Space::with_window((2 * splits + 2) * p)?;
    filler.commit(filler.range(0, (2 * splits + 2) * p)?, Prot::READ_WRITE)?;
    for j in 0..splits {
        filler.protect(filler.range((2 * j + 1) * p, p)?, Prot::READ)?;
    }
    Ok(filler)
}

/// Reports of block pages (`b0..b1`) that no write of their window explains.
fn unwritten_reports(reported: &[Vec<u32>], writes: &[Write], (b0, b1): (u64, u64), collects: usize) -> u64 {
    let mut explained = vec![vec![false; collects + 2]; (b1 - b0) as usize];
    for w in writes.iter().filter(|w| (b0..b1).contains(&(w.page as u64))) {
        for n in w.lo..=w.hi {
            explained[(w.page as u64 - b0) as usize][n as usize] = true;
        }
    }
    let mut count = 0;
    for pg in b0..b1 {
        count += reported[pg as usize].iter().filter(|&&n| !explained[(pg - b0) as usize][n as usize]).count() as u64;
    }
    count
}

/// Forks the process; the child (this thread alone, copied mid-run) collects through the
/// parent's tracker and consumer, which must refuse (`OtherProcess`) before touching anything, and
/// exits at once. An error where the child's collects were not refused. Linux only: Windows has
/// no fork (the forker's steps do nothing there, and no fork is counted).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)] // fork(2) and the child's _exit(2): see the SAFETY comments
fn fork_and_collect(t: &Tracker, c: &Consumer, range: GuestRange) -> Result<(), WatchError> {
    let os = |source| WatchError::Os { op: "fork", range, backend: t.kind().name(), source };
    // SAFETY: the child runs only code that takes no lock and allocates nothing (the refusal is
    // checked first in every collect, and its error is plain integers), then `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(os(std::io::Error::last_os_error()));
    }
    if pid == 0 {
        let refused = |e: &WatchError| matches!(e, WatchError::OtherProcess { .. });
        let own = t.collect(range).as_ref().is_err_and(refused);
        // Words enough for the range at 64 pages a bit, on the stack (the child allocates nothing).
        let mut words = [0u64; 16];
        let consumer = c.collect_into(range, 64 * page_size(), &mut words).as_ref().is_err_and(refused);
        // SAFETY: ends the child at once, running nothing of the parent's (no atexit, no destructor).
        unsafe { libc::_exit(if own && consumer { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked; `status` is written by the kernel.
    if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        return Err(os(std::io::Error::last_os_error()));
    }
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        return Err(os(std::io::Error::other(format!(
            "a fork's child collected through the parent's tracker (status {status:#x})"
        ))));
    }
    Ok(())
}

/// Windows has no fork: never called there (the forker's steps do nothing).
#[cfg(not(target_os = "linux"))]
fn fork_and_collect(_: &Tracker, _: &Consumer, _: GuestRange) -> Result<(), WatchError> {
    Ok(())
}

/// The consumer beside the tracker's own collects: its collects and each page's reports.
#[derive(Clone)]
struct Consumed {
    consumer: Arc<Consumer>,
    ranges: Arc<Vec<GuestRange>>,
    /// Each page's collects by the consumer (ascending).
    reported: Arc<Mutex<Vec<Vec<u32>>>>,
}

impl Consumed {
    fn new(consumer: Consumer, ranges: Vec<GuestRange>, pages: u64) -> Self {
        let reported = Arc::new(Mutex::new(vec![Vec::new(); pages as usize]));
        Consumed { consumer: Arc::new(consumer), ranges: Arc::new(ranges), reported }
    }

    /// One collect of the consumer's, numbered as `pace` counts them.
    fn collect(&self, pace: &Pace) -> Result<(), WatchError> {
        let n = pace.c_epoch.fetch_add(1, SeqCst) as u32 + 1;
        let mut reported = self.reported.lock().unwrap_or_else(|p| p.into_inner());
        for r in self.ranges.iter() {
            let mut words = vec![0u64; (r.len() / page_size()).div_ceil(64) as usize];
            self.consumer.collect_into(*r, page_size(), &mut words)?;
            for (w, &word) in words.iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let page = r.start().0 / page_size() + w as u64 * 64 + bits.trailing_zeros() as u64;
                    bits &= bits - 1;
                    reported[page as usize].push(n);
                }
            }
        }
        pace.c_done.store(n as u64, SeqCst);
        Ok(())
    }

    /// Its collects, and each page's.
    fn into_reports(self, pace: &Pace) -> (u64, Vec<Vec<u32>>) {
        let reported = std::mem::take(&mut *self.reported.lock().unwrap_or_else(|p| p.into_inner()));
        (pace.c_done.load(SeqCst), reported)
    }
}

/// The pages the snapshot taker covers (the writers' allocations but the arm zone, whose disarms
/// stop tracking).
const SNAPPED: std::ops::Range<u64> = 32..256;
/// The most snapshots whose values are kept for the check.
const SNAPS_SEEN: usize = 2048;

/// What each snapshot held of each page of [`SNAPPED`]: the three writers' slots (CPU writers 0
/// and 1 at bytes 0 and 8, the host writer at 16); `None` for a take that failed (a decommit by
/// the mutator ran beside it: the snapshots refuse that, and the next take copies its pages).
type Seen = Vec<Option<Vec<[u64; 3]>>>;

/// The snapshot taker: snapshots of [`SNAPPED`] taken one after another, each read back.
struct Taker {
    snaps: Snapshots,
    seen: Seen,
    last: Option<SnapshotId>,
    /// Takes that failed (a decommit beside them).
    failed: u64,
}

/// The most takes that may fail beside the mutator's decommits before the run fails.
const MOST_FAILED_TAKES: u64 = 1000;

impl Taker {
    /// One snapshot, numbered as `pace` counts them; the one before it is released (or was
    /// dropped for the budget). A take the mutator's decommit made fail is recorded as such.
    fn take(&mut self, pace: &Pace) -> Result<(), SnapshotError> {
        let n = pace.s_epoch.fetch_add(1, SeqCst) + 1;
        let taken = self.snaps.take();
        pace.s_done.store(n, SeqCst);
        let id = match taken {
            Ok(id) => id,
            Err(SnapshotError::Space(e)) => {
                if self.seen.len() < SNAPS_SEEN {
                    self.seen.push(None);
                }
                self.failed += 1;
                return if self.failed > MOST_FAILED_TAKES { Err(SnapshotError::Space(e)) } else { Ok(()) };
            }
            Err(e) => return Err(e),
        };
        if self.seen.len() < SNAPS_SEEN {
            let mut values = Vec::with_capacity((SNAPPED.end - SNAPPED.start) as usize);
            for pg in SNAPPED {
                let mut b = [0u8; 24];
                // The mutator's released pages (no writer writes them) may be out of it.
                if !RELEASED.contains(&pg) {
                    self.snaps.read(id, GuestAddr(pg * page_size()), &mut b)?;
                }
                let slot = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
                values.push([slot(0), slot(1), slot(2)]);
            }
            self.seen.push(Some(values));
        }
        if let Some(prev) = self.last.replace(id) {
            match self.snaps.release(prev) {
                Ok(()) | Err(SnapshotError::UnknownSnapshot(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// The snapshot taker's thread: takes until the others stop (at least once).
fn taker(pace: &Arc<Pace>, mut t: Taker) -> JoinHandle<Result<Taker, SnapshotError>> {
    let pace = pace.clone();
    std::thread::spawn(move || {
        pace.wait_to_go();
        loop {
            if let Err(e) = t.take(&pace) {
                pace.enough.store(true, SeqCst);
                return Err(e);
            }
            if pace.stop.load(SeqCst) {
                return Ok(t);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    })
}

/// A snapshot failure as the stress reports failures.
fn snapshot_error(e: SnapshotError, range: GuestRange, kind: BackendKind) -> WatchError {
    match e {
        SnapshotError::Watch(e) => e,
        SnapshotError::Space(e) => e.into(),
        e => {
            WatchError::Os { op: "snapshot", range, backend: kind.name(), source: std::io::Error::other(e.to_string()) }
        }
    }
}

/// Checks each write to [`SNAPPED`] against the first snapshot taken after it that did not
/// fail: it must hold the write's value, unless the same writer's next write to the page began
/// before that snapshot ended (a take copies a page being written byte by byte as it finds it:
/// the later write then covers the page). `logs` are the host writer's (values `0, 1, ...`) then
/// the CPU writers' (values `1, 2, ...`). Returns the writes checked and those lost.
fn judge_snapshots(logs: &[Vec<Write>], seen: &Seen) -> (u64, u64) {
    let (mut checked, mut lost) = (0, 0);
    for (l, log) in logs.iter().enumerate() {
        let (slot, first) = if l == 0 { (2, 0) } else { (l - 1, 1) };
        // Each write's next write to the same page by the same writer: the snapshots ended
        // before it began.
        let mut next: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        let mut next_sdone = vec![u32::MAX; log.len()];
        for (j, w) in log.iter().enumerate().rev() {
            next_sdone[j] = next.get(&w.page).copied().unwrap_or(u32::MAX);
            next.insert(w.page, w.sdone);
        }
        for (j, w) in log.iter().enumerate() {
            let page = w.page as u64;
            if !SNAPPED.contains(&page) {
                continue;
            }
            let from = (w.sno as usize).saturating_sub(1);
            let Some((n, values)) = seen.iter().enumerate().skip(from).find_map(|(n, v)| v.as_ref().map(|v| (n, v)))
            else {
                continue;
            };
            // Take `n + 1` must have ended before the next write began.
            if (next_sdone[j] as usize) < n + 1 {
                continue;
            }
            checked += 1;
            lost += (values[(page - SNAPPED.start) as usize][slot] != j as u64 + first) as u64;
        }
    }
    (checked, lost)
}

/// Checks each write against the reports: `reported` holds each page's collects (ascending),
/// `arms_at` the arms and disarms begun by the end of each collect, `consumed` each page's
/// collects by the consumer.
fn judge<'a>(
    writes: impl Iterator<Item = &'a Write>,
    reported: &[Vec<u32>],
    arms_at: &[u32],
    consumed: &[Vec<u32>],
) -> StressReport {
    let mut r = StressReport {
        writes: 0,
        unchecked: 0,
        exact: 0,
        lost: 0,
        consumer_lost: 0,
        lost_by_start_epochs: 0,
        dropped: None,
        block_reports_unwritten: 0,
        collects: 0,
        snapshot_takes: 0,
        snapshot_checked: 0,
        snapshot_lost: 0,
        space_ops: 0,
        ops: StressOps::default(),
    };
    for w in writes {
        r.writes += 1;
        let pages = &reported[w.page as usize];
        // The consumer's windows do not follow the armer: it is judged outside the zone.
        if !ZONE.contains(&(w.page as u64)) {
            r.consumer_lost += !reported_in(&consumed[w.page as usize], w.clo, w.chi) as u64;
        }
        // An arm forgets what was written before it, a disarm stops tracking: a write in the
        // zone is owed a report only if no arm or disarm ran from before it to its last collect.
        if ZONE.contains(&(w.page as u64)) && (w.arms == NOT_OWED || arms_at[w.hi as usize] != w.arms) {
            r.unchecked += 1;
            continue;
        }
        r.exact += (w.lo == w.hi) as u64;
        r.lost += !reported_in(pages, w.lo, w.hi) as u64;
        r.lost_by_start_epochs += !reported_in(pages, w.e1, w.hi) as u64;
    }
    r
}

/// Runs the stress with at least `cfg.writes_per_writer` CPU stores on each of two writer
/// threads (more until every kind of operation has run its minimum, `MIN_STEPS` and
/// `MIN_COLLECTS` in this module); the other threads run until the writers are done.
///
/// Pages: 0..256 are four private allocations that the writers write (but for one page of each,
/// which the mutator releases), 256..320 one whose pages the mutator releases and recommits,
/// 512..576 a run of section views whose pages 528 and 560 the mutator releases and maps again.
/// Host writes and populates go through [`Tracker::host_write`] (the mprotect backend must make
/// armed pages writable for them).
///
/// # Errors
/// [`WatchError`] where the backend is not usable here, or a space or tracker operation the
/// run needs fails (a lost write is not an error: it is counted in the report).
// Over 80 lines: the threads are set up and joined in one place, so their sharing is visible.
pub fn stress_with(kind: BackendKind, cfg: StressConfig) -> Result<StressReport, WatchError> {
    let p = page_size();
    let (s, t, sec) = layout(kind)?;
    let whole = s.range(0, PAGES * p)?;
    let zone = s.range(ZONE.start * p, (ZONE.end - ZONE.start) * p)?;
    // Refused up front where the platform has no map limit (before any thread starts).
    #[cfg(not(target_os = "linux"))]
    if cfg.map_pressure {
        fill_maps(whole, kind)?;
    }
    let skip = |pg: &u64| !VOLATILE.contains(pg) && !RELEASED.contains(pg);
    let block = if cfg.map_pressure { Some(blocks(&s, &t)?) } else { None };
    let (b0, b1) = block.unwrap_or((PAGES, PAGES));
    let targets: Arc<Vec<u64>> = Arc::new((0..256).chain(512..PAGES).filter(skip).chain(b0..b1).collect());
    let pace = Arc::new(Pace::default());
    pace.zone_armed.store(true, SeqCst);
    let writers: Vec<_> = (0..2u64).map(|w| writer(w, cfg, pace.clone(), targets.clone(), s.clone())).collect();
    let host_log = Arc::new(std::sync::Mutex::new(Vec::with_capacity(1 << 16)));
    let host_writer = host_writer(&pace, targets.clone(), s.clone(), t.clone(), host_log.clone());
    let populator = populator(&pace, s.clone(), t.clone());
    let mutator = {
        let (s, t) = (s.clone(), t.clone());
        background(&pace, 2, 1, move |i| if cfg.map_pressure { Ok(()) } else { mutate(&s, &t, sec, i) })
    };
    let armer = {
        let (t, pc) = (t.clone(), pace.clone());
        let races = cfg.arm_races && !cfg.map_pressure;
        background(&pace, 3, 1, move |i| if races { arm_step(&t, &pc, zone, i) } else { Ok(()) })
    };
    let ranges: Vec<GuestRange> =
        std::iter::once(Ok(whole)).chain(block.map(|_| s.range(b0 * p, (b1 - b0) * p))).collect::<Result<_, _>>()?;
    let consumer = Consumed::new(t.consumer(), ranges.clone(), b1.max(PAGES));
    let consuming = {
        let (consumer, pc) = (consumer.clone(), pace.clone());
        background(&pace, 4, 2, move |_| consumer.collect(&pc))
    };
    // Forks on Linux only (Windows has no fork), and not under map pressure.
    let forking = cfg!(target_os = "linux") && !cfg.map_pressure;
    let forker = {
        let (t, c, forks) = (t.clone(), consumer.consumer.clone(), forking);
        background(&pace, 5, 1, move |_| if forks { fork_and_collect(&t, &c, whole) } else { Ok(()) })
    };
    // Snapshots beside the collects (not under map pressure: their copies need mappings).
    let snapped = s.range(SNAPPED.start * p, (SNAPPED.end - SNAPPED.start) * p)?;
    let snapshot_taker = if cfg.map_pressure {
        None
    } else {
        let config = SnapshotConfig::default().budget_bytes(Some(2 * snapped.len()));
        let snaps = Snapshots::new(&t, snapped, &config).map_err(|e| snapshot_error(e, snapped, kind))?;
        Some(taker(&pace, Taker { snaps, seen: Vec::new(), last: None, failed: 0 }))
    };
    let mut reported: Vec<Vec<u32>> = vec![Vec::with_capacity(1024); b1.max(PAGES) as usize];
    // Per collect: arms and disarms begun by the time it ended.
    let mut arms_at: Vec<u32> = Vec::with_capacity(1 << 16);
    arms_at.push(0);
    let filler = if cfg.map_pressure { Some(fill_maps(whole, kind)?) } else { None };
    pace.go.store(true, SeqCst);
    let mut collect = |n: u32| -> Result<(), WatchError> {
        for r in &ranges {
            for a in t.collect(*r)?.page_addrs() {
                reported[(a.0 / page_size()) as usize].push(n);
            }
        }
        pace.done.store(n as u64, SeqCst);
        arms_at.push(pace.arms_started.load(SeqCst) as u32);
        Ok(())
    };
    let writing = || !writers.iter().all(|w| w.is_finished());
    let mut result = Ok(());
    while writing() {
        let n = pace.epoch.fetch_add(1, SeqCst) as u32 + 1;
        if let Err(e) = collect(n) {
            pace.enough.store(true, SeqCst);
            result = Err(e);
            break;
        }
        let mins = if cfg.map_pressure { [MIN_STEPS[0], MIN_STEPS[1], 0, 0, MIN_STEPS[4], 0] } else { MIN_STEPS };
        if n as u64 >= MIN_COLLECTS && pace.steps.iter().zip(mins).all(|(s, min)| s.load(SeqCst) >= min) {
            pace.enough.store(true, SeqCst);
        }
        // A gap before the next collect, until each writer has written in it.
        let since = Instant::now();
        while pace.gap.iter().any(|g| g.load(SeqCst) < n as u64) && since.elapsed() < GAP_WAIT && writing() {
            std::thread::sleep(Duration::from_micros(10));
        }
    }
    pace.stop.store(true, SeqCst);
    let logs: Vec<_> = writers.into_iter().map(|w| w.join().expect("writer panicked")).collect();
    let host_writes = host_writer.join().expect("host writer panicked");
    let populates = populator.join().expect("populator panicked");
    let rounds = mutator.join().expect("mutator panicked");
    let arm_steps = armer.join().expect("armer panicked");
    let consumer_collects = consuming.join().expect("consumer panicked");
    let forks = forker.join().expect("forker panicked");
    let snapshot_taker = snapshot_taker.map(|h| h.join().expect("snapshot taker panicked"));
    drop(filler);
    result?;
    let (host_writes, populates_written, rounds, arm_steps) = (host_writes?, populates?, rounds?, arm_steps?);
    consumer_collects?;
    let forks = if forking { forks? } else { 0 };
    let rounds = if cfg.map_pressure { 0 } else { rounds };
    // A collect after every thread is done: it checks the last writes.
    let n = pace.epoch.fetch_add(1, SeqCst) as u32 + 1;
    collect(n)?;
    consumer.collect(&pace)?;
    let (consumer_collects, consumed) = consumer.into_reports(&pace);
    // And a snapshot after every thread is done.
    let seen = match snapshot_taker {
        Some(taken) => {
            let mut taker = taken.map_err(|e| snapshot_error(e, snapped, kind))?;
            taker.take(&pace).map_err(|e| snapshot_error(e, snapped, kind))?;
            taker.seen
        }
        None => Vec::new(),
    };
    let host_log = std::mem::take(&mut *host_log.lock().unwrap_or_else(|p| p.into_inner()));
    let mut all = vec![host_log];
    for log in logs {
        all.push(log?);
    }
    let cpu_stores = all[1..].iter().map(|l| l.len() as u64).sum();
    let dropped = if cfg.drop_one_report { drop_one(&mut reported, &all[1..].concat()) } else { None };
    let block_reports_unwritten = match block {
        Some(b) => unwritten_reports(&reported, &all.concat(), b, n as usize),
        None => 0,
    };
    let mut r = judge(all.iter().flatten(), &reported, &arms_at, &consumed);
    (r.snapshot_takes, (r.snapshot_checked, r.snapshot_lost)) =
        (pace.s_epoch.load(SeqCst), judge_snapshots(&all, &seen));
    (r.dropped, r.block_reports_unwritten, r.collects) = (dropped, block_reports_unwritten, n as u64);
    let (arms, disarms) = if cfg.arm_races && !cfg.map_pressure {
        let ops = arm_steps.div_ceil(2);
        (ops - (ops + 1) / 3, (ops + 1) / 3)
    } else {
        (0, 0)
    };
    r.ops = StressOps {
        cpu_stores,
        host_writes,
        collects: n as u64,
        commits: rounds * 2,
        protects: rounds,
        releases: rounds * 3,
        view_splits: rounds,
        populates_written,
        populates_fresh: rounds * 2,
        arms,
        disarms,
        consumer_collects,
        forks,
    };
    r.space_ops = r.ops.kinds().iter().skip(3).take(8).map(|(_, c)| c).sum();
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The armer's progress as the writer sees it: begun, armed, ended.
    #[derive(Clone, Copy, Debug)]
    struct Zone {
        started: u64,
        armed: bool,
        done: u64,
    }

    /// Every interleaving of one arm or disarm (begun, state set, ended) with the three reads of
    /// [`zone_owed`]: a write it owes a report to must find the zone armed by the arm or disarm
    /// the count names, or a count moved on (which the judge sees, and does not check the write).
    #[test]
    fn a_write_is_owed_only_if_the_zone_is_armed_after_the_reads() {
        for (from, arm) in [(true, false), (false, true), (true, true)] {
            // The armer's three steps land before read number at[0], at[1], at[2] (3: after all).
            for a in 0..=3 {
                for b in a..=3 {
                    for c in b..=3 {
                        let at = [a, b, c];
                        let mut z = Zone { started: 5, armed: from, done: 5 };
                        let mut read = 0;
                        let step = |z: &mut Zone, k: usize| match k {
                            0 => z.started += 1,
                            1 => z.armed = arm,
                            _ => z.done += 1,
                        };
                        let owed = zone_owed(|f| {
                            for (k, &pos) in at.iter().enumerate() {
                                if pos == read {
                                    step(&mut z, k);
                                }
                            }
                            read += 1;
                            match f {
                                ZoneField::Done => z.done,
                                ZoneField::Armed => z.armed as u64,
                                ZoneField::Started => z.started,
                            }
                        });
                        for (k, &pos) in at.iter().enumerate() {
                            if pos == 3 {
                                step(&mut z, k);
                            }
                        }
                        if owed != NOT_OWED {
                            let moved_on = z.started > owed as u64;
                            assert!(
                                moved_on || (z.armed && z.done == owed as u64),
                                "{from}->{arm} steps before reads {at:?}: owed {owed}, zone after {z:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
