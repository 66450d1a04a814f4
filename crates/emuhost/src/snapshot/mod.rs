//! Snapshots of a guest range: save states, rewind and run-ahead.
//!
//! A [`Snapshots`] keeps copies of a guest range's pages, taken with [`Snapshots::take`], and
//! puts a snapshot back with [`Snapshots::restore`]: the bytes of its committed pages, which
//! pages were committed, and the protection the space gave each (pages committed since are
//! decommitted). A restore that would have to decommit pages a hold keeps mapped (a GPU import:
//! [`Space::hold`]) is refused before anything changes, naming them; so is a range that holds a
//! shared view (sections' pages may show at several addresses: snapshots cover private memory
//! only).
//!
//! Copy at take: a `Snapshots` reads the tracker as one more consumer ([`Tracker::consumer`]),
//! so the other readers (caches, the tracker's own collects) keep seeing every write. The first
//! take copies every committed page of the range (the base); each later take copies only the
//! pages its collect reports written since the previous take (and pages committed since). A
//! page's bytes are kept once, as a version shared by every snapshot in which they are unchanged,
//! so [`SnapshotStats::bytes_kept`] follows what was written, not the range's size.
//! [`Snapshots::restore`] puts back exactly the pages whose content may differ from the snapshot
//! (those written since it, across later takes and since the newest take), so its cost follows
//! what was written since the snapshot too. Pages without read access are given it for the copy
//! and their protection back after it, through the space.
//!
//! The restore's own writes are host writes into tracked memory, made inside
//! [`Tracker::host_write`], and its commits, decommits and protections go through the space, so
//! every reader of the tracker sees the restored pages as written at its next collect (a cache
//! uploads them again). Later snapshots stay valid after a restore.
//!
//! A memory budget ([`SnapshotConfig::budget_bytes`], `EMUHOST_SNAPSHOT_BUDGET_MB`) makes a
//! rewind ring: past it, a take drops the oldest snapshots first, never the newest.
//!
//! The caller stops the guest's writes to the range while it takes or restores: a write beside a
//! take may be in the snapshot or not, byte by byte (it is in the next), and a write beside a
//! restore is reported ([`SnapshotError::ConcurrentWrites`]) where the restore can see it.
//! docs/snapshot.md has the design, the costs and the limits.
//!
//! ```
//! use std::sync::Arc;
//! use emuhost::snapshot::{SnapshotConfig, Snapshots};
//! use emuhost::space::{GuestAddr, Prot, Space, page_size};
//! use emuhost::watch::{Tracker, TrackerConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let space = Arc::new(Space::with_window(16 << 20)?);
//! let range = space.range(0, 8 * page_size())?;
//! space.commit(range, Prot::READ_WRITE)?;
//! let tracker = Tracker::new(&space, &TrackerConfig::default())?;
//! let snapshots = Snapshots::new(&tracker, range, &SnapshotConfig::default())?;
//!
//! space.store(GuestAddr(100), b"before")?;
//! let id = snapshots.take()?;
//! space.store(GuestAddr(100), b"after!")?;
//! snapshots.restore(id)?;
//! let mut buf = [0; 6];
//! space.read(GuestAddr(100), &mut buf)?;
//! assert_eq!(&buf, b"before");
//! # Ok(())
//! # }
//! ```

mod config;
mod cow;
mod error;
mod pages;
mod slab;
mod store;

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use config::{SnapshotConfig, SnapshotMode};
pub use error::SnapshotError;

use crate::space::{GuestAddr, GuestRange, Prot, Space};
use crate::watch::{Consumer, Tracker};
use pages::{PageSet, Runs, differing, page, prot_at, subtract, writable};
use store::{Store, Take};

/// A snapshot's id, unique for its [`Snapshots`] (never reused). Prints as its number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SnapshotId(u64);

impl SnapshotId {
    /// An id from its number ([`SnapshotId::get`]), as a caller that kept only the number has it
    /// (the C ABI). Any number makes an id; one that no live snapshot has is refused by the calls
    /// that take it ([`SnapshotError::UnknownSnapshot`]).
    pub fn new(n: u64) -> SnapshotId {
        SnapshotId(n)
    }

    /// Its number: the takes of its [`Snapshots`] up to and including it (1 for the first).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What a [`Snapshots::restore`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Restored {
    /// Pages whose bytes were put back (those whose content may have differed from the
    /// snapshot's).
    pub pages: u64,
    /// Pages decommitted (committed now, not at the snapshot).
    pub decommitted: u64,
}

/// The counters of a [`Snapshots`] ([`Snapshots::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SnapshotStats {
    /// Snapshots taken.
    pub taken: u64,
    /// Snapshots live now.
    pub live: u64,
    /// Snapshots released by [`Snapshots::release`].
    pub released: u64,
    /// Snapshots dropped to keep [`SnapshotStats::bytes_kept`] within the budget (oldest first).
    pub dropped_for_budget: u64,
    /// Pages copied: by takes, and with copy before write by the fault handler and the thread
    /// copying ahead, counted as the snapshots keep the copies (at takes, restores, releases and
    /// reads); a page still to be copied (pending) is not counted.
    pub pages_copied: u64,
    /// Bytes of page copies kept now (each page's bytes once for all the snapshots that share
    /// them).
    pub bytes_kept: u64,
    /// Pages whose bytes restores put back.
    pub pages_restored: u64,
    /// Time spent in takes, on the callers' threads.
    pub take_time: Duration,
    /// Time spent in restores, on the callers' threads.
    pub restore_time: Duration,
}

struct State {
    /// The last id given.
    last: u64,
    store: Store,
    /// This reader of the tracker: the pages written since its last collect.
    consumer: Consumer,
    /// The snapshot the range's content is, but for `dirty` (and changes the consumer has not
    /// collected yet): the one restored last, or `None` for the newest take.
    base: Option<u64>,
    /// Pages known to have changed since `base` that the consumer will not report again.
    dirty: PageSet,
    /// A collect's runs, and a copy's bytes, kept between calls.
    runs: Vec<(u64, u64)>,
    scratch: Vec<u8>,
    stats: SnapshotStats,
    /// Copy before write's machinery ([`SnapshotMode::CopyBeforeWrite`]).
    cow: Option<cow::Cow>,
}

/// Snapshots of one guest range of a tracker's space (see the [module docs](self)). `Send +
/// Sync`: takes, restores and releases from any thread run one at a time.
pub struct Snapshots {
    tracker: Arc<Tracker>,
    space: Arc<Space>,
    range: GuestRange,
    config: SnapshotConfig,
    state: Mutex<State>,
}

impl fmt::Debug for Snapshots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Snapshots").field("range", &self.range).field("config", &self.config).finish()
    }
}

impl Snapshots {
    /// Snapshots of `range` in `tracker`'s space, as `config` says. Arms `range` on the tracker
    /// (an arm of armed pages keeps their tracking; the range stays armed after the snapshots go)
    /// and reads it as one more consumer ([`Tracker::consumer`]): the other readers keep seeing
    /// every write.
    ///
    /// # Errors
    /// [`SnapshotError::Space`] for a range outside the space's window, [`SnapshotError::Watch`]
    /// where the arm fails.
    pub fn new(tracker: &Arc<Tracker>, range: GuestRange, config: &SnapshotConfig) -> Result<Snapshots, SnapshotError> {
        let space = tracker.space().clone();
        let range = space.range(range.start().0, range.len())?;
        let consumer = tracker.consumer();
        tracker.arm(range)?;
        let cow = match config.mode {
            SnapshotMode::CopyBeforeWrite => Some(cow::Cow::new(tracker, range)?),
            _ => None,
        };
        let state = State {
            last: 0,
            store: Store::default(),
            consumer,
            base: None,
            dirty: PageSet::new(),
            runs: Vec::new(),
            scratch: Vec::new(),
            stats: SnapshotStats::default(),
            cow,
        };
        Ok(Snapshots { tracker: tracker.clone(), space, range, config: *config, state: Mutex::new(state) })
    }

    /// The range the snapshots cover.
    pub fn range(&self) -> GuestRange {
        self.range
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Refuses a range with a shared view in it.
    fn no_views(&self) -> Result<(), SnapshotError> {
        match self.space.views_in(self.range).first() {
            Some(v) => Err(SnapshotError::Views { range: self.range, view: v.range }),
            None => Ok(()),
        }
    }

    /// Whether copies go through the CPU (emuhost's fault handler makes them survive a refused
    /// page; not where the embedder owns `SIGSEGV`) or the kernel.
    fn cpu(&self) -> bool {
        self.tracker.owns_fault_handler()
    }

    /// The guest address of the range's page `i`.
    fn addr(&self, i: u64) -> u64 {
        self.range.start().0 + i * page()
    }

    /// The range's pages `a..b` as a guest range.
    fn pages(&self, a: u64, b: u64) -> GuestRange {
        GuestRange::from_bounds(self.addr(a), self.addr(b)).expect("pages of the range")
    }

    /// The pages of the range this consumer's collect reports (written since its last).
    fn collect(&self, st: &mut State) -> Result<PageSet, SnapshotError> {
        st.runs.clear();
        st.consumer.collect_runs(self.range, &mut st.runs)?;
        let mut set = PageSet::new();
        let a = self.range.start().0;
        for &(s, e) in &st.runs {
            set.set_run((s - a) / page(), (e - a) / page());
        }
        Ok(set)
    }

    /// Takes a snapshot of the range: which pages are committed, with their protections, and
    /// the bytes of those written since the previous take (all committed pages at the first,
    /// or after every snapshot was released). Past the budget, the oldest snapshots are dropped
    /// (never this one).
    ///
    /// A guest write that runs beside a take may be in the snapshot or not, byte by byte: stop
    /// the guest's threads for a consistent snapshot. (Such a write is in the next take.)
    ///
    /// # Errors
    /// [`SnapshotError::Views`] where the range holds a shared view; [`SnapshotError::Watch`]
    /// where the collect fails; [`SnapshotError::Space`] where a copy or a protection fails.
    /// Nothing is kept then, and the next take copies what this one would have.
    pub fn take(&self) -> Result<SnapshotId, SnapshotError> {
        let started = Instant::now();
        let mut guard = self.state();
        let st = &mut *guard;
        self.no_views()?;
        if let Some(c) = &mut st.cow {
            c.begin_take();
        }
        let mut changed = self.collect(st)?;
        if let Some(Err(e)) = st.cow.as_ref().map(|c| c.after_collect(self.range)) {
            st.dirty.or(&changed);
            return Err(e.into());
        }
        changed.or(&st.dirty);
        // After a restore, the pages whose newest version is not the restored snapshot's.
        if let Some(k) = st.base {
            st.store.copied_after(k, None).for_each(|i| changed.set(i));
        }
        let epoch = st.last + 1;
        let take = match self.copy(st, &changed, epoch) {
            Ok(take) => take,
            Err(e) => {
                st.dirty.or(&changed);
                return Err(e);
            }
        };
        st.dirty.clear();
        st.base = None;
        st.last = epoch;
        let pending = self.pending_of(st, &take, epoch);
        st.store.takes.insert(epoch, take);
        st.store.live.insert(epoch);
        if let Some(c) = &mut st.cow {
            st.stats.pages_copied += c.taken(epoch, pending, &changed, &mut st.store);
        }
        if let Some(old) = st.store.head.replace(epoch).filter(|h| !st.store.live.contains(h)) {
            st.store.unpin(old);
        }
        self.keep_to_budget(st);
        st.stats.taken += 1;
        st.stats.live = st.store.live.len() as u64;
        st.stats.bytes_kept = st.store.bytes;
        st.stats.take_time += started.elapsed();
        Ok(SnapshotId(epoch))
    }

    /// Copies into the store, as versions at `epoch`, the pages a take keeps: committed now and
    /// `changed` or not committed at the newest take (all committed pages where nothing is kept),
    /// and tombstones for pages with bytes kept that are not committed now. Changes nothing
    /// where it fails.
    fn copy(&self, st: &mut State, changed: &PageSet, epoch: u64) -> Result<Take, SnapshotError> {
        let runs = self.space.protections(self.range);
        let base = self.range.start().0;
        let index = |a: u64| (a - base) / page();
        let mut copy = PageSet::new();
        let mut gone = Vec::new();
        // The runs the content derives from: the restored snapshot's, or the newest take's.
        let from = st.base.or(st.store.head);
        let head = from.and_then(|h| st.store.takes.get(&h)).and_then(|t| t.runs.as_ref());
        match head {
            None => runs.iter().for_each(|(r, _)| copy.set_run(index(r.start().0), index(r.end().0))),
            Some(head) => {
                for i in changed.iter() {
                    match prot_at(&runs, self.addr(i)) {
                        Some(_) => copy.set(i),
                        None if st.store.has_bytes(i) => gone.push(i),
                        None => {}
                    }
                }
                for r in subtract(&runs, head) {
                    copy.set_run(index(r.start().0), index(r.end().0));
                }
                for r in subtract(head, &runs) {
                    gone.extend((index(r.start().0)..index(r.end().0)).filter(|&i| st.store.has_bytes(i)));
                }
            }
        }
        let copies = self.copies(st, copy, &runs)?;
        gone.sort_unstable();
        gone.dedup();
        st.stats.pages_copied += copies.iter().filter(|c| c.1 != store::PENDING).count() as u64;
        let mut copied = Vec::with_capacity(copies.len() + gone.len());
        for (i, slot) in copies {
            st.store.push(i, epoch, Some(slot));
            copied.push(i);
        }
        for i in gone {
            st.store.push(i, epoch, None);
            copied.push(i);
        }
        copied.sort_unstable();
        Ok(Take { runs: Some(runs), copied })
    }

    /// Copies the pages of `set`, committed as `runs` say, into slots of the store's slab: each
    /// page with its slot, in order. The readable runs of pages of one protection are read
    /// together, in as few kernel calls as the OS allows ([`Space::read_runs`]); pages without
    /// read access are given it for the copy and their protection back after it, a run at a time.
    /// Where it fails, the slots go back and nothing is kept.
    fn read_pages(&self, set: &PageSet, runs: &Runs, st: &mut State) -> Result<Vec<(u64, usize)>, SnapshotError> {
        // The runs of pages of one protection, in order.
        let mut spans: Vec<(u64, u64, Prot)> = Vec::new();
        let mut pages = set.iter().peekable();
        while let Some(first) = pages.next() {
            let prot = prot_at(runs, self.addr(first)).unwrap_or(Prot::NONE);
            let mut end = first + 1;
            while pages.next_if(|&i| i == end && prot_at(runs, self.addr(i)) == Some(prot)).is_some() {
                end += 1;
            }
            spans.push((first, end, prot));
        }
        let n = spans.iter().map(|&(a, b, _)| b - a).sum::<u64>() as usize;
        let slots = st.store.slab.alloc(n);
        let read = self.read_spans(&spans, &slots, &mut st.store);
        if let Err(e) = read {
            slots.iter().for_each(|&s| st.store.slab.release(s));
            return Err(e);
        }
        Ok(spans.iter().flat_map(|&(a, b, _)| a..b).zip(slots).collect())
    }

    /// Reads the `spans` of pages (in order) into the slab's `slots` (ascending, one per page,
    /// in the same order): the readable spans together, the others a span at a time with read
    /// access given for the copy.
    fn read_spans(&self, spans: &[(u64, u64, Prot)], slots: &[usize], store: &mut Store) -> Result<(), SnapshotError> {
        let mut bufs = store.slab.slices_mut(slots).into_iter();
        for group in spans.chunk_by(|a, b| a.2.read && b.2.read) {
            let ranges: Vec<GuestRange> = group.iter().map(|&(a, b, _)| self.pages(a, b)).collect();
            let pages = group.iter().map(|&(a, b, _)| b - a).sum::<u64>() as usize;
            let mut into: Vec<&mut [u8]> = bufs.by_ref().take(pages).collect();
            match group {
                [(_, _, prot)] if !prot.read => {
                    let (run, prot) = (ranges[0], *prot);
                    self.space.protect(run, Prot { read: true, ..prot })?;
                    let read = self.space.read_runs(&ranges, &mut into, self.cpu());
                    self.space.protect(run, prot)?;
                    read?;
                }
                _ => self.space.read_runs(&ranges, &mut into, self.cpu())?,
            }
        }
        Ok(())
    }

    /// Drops the oldest snapshots while the bytes kept pass the budget, never the newest.
    fn keep_to_budget(&self, st: &mut State) {
        let Some(budget) = self.config.budget_bytes else { return };
        while st.store.bytes > budget && st.store.live.len() > 1 {
            let Some(oldest) = st.store.live.pop_first() else { break };
            self.forget(st, oldest);
            st.stats.dropped_for_budget += 1;
        }
    }

    /// Puts snapshot `id` back: exactly the pages whose content may differ from it (written
    /// since it, across later takes and since the newest take) get its bytes back; pages it had
    /// committed and are not now are committed again, pages committed since are decommitted, and
    /// every page gets the protection it had. The cost follows the pages written since the
    /// snapshot, plus one region of work per committed run.
    ///
    /// Later snapshots stay valid: the restore's own writes count as changes since the newest
    /// take (the next take copies them). They are host writes made inside
    /// [`Tracker::host_write`], and the commits, decommits and protections go through the space,
    /// so every other reader of the tracker (a cache) sees the restored pages as written at its
    /// next collect.
    ///
    /// The guest must not write the range while a restore runs (stop its threads). A write that
    /// does is found where the restore can see it: on a page the restore did not put back (its
    /// collect after the restore reports it), or on a readable page it put back whose bytes then
    /// differ from the snapshot's (it reads them back). The restore then returns
    /// [`SnapshotError::ConcurrentWrites`]: the range holds the snapshot but for the pages
    /// written meanwhile, which later takes and restores count as changed; restore again. A
    /// write that lands on a page before the restore puts the page back is undone, as a write
    /// before the restore is.
    ///
    /// # Errors
    /// [`SnapshotError::UnknownSnapshot`] for an id no live snapshot has;
    /// [`SnapshotError::Views`] where the range holds a shared view; [`SnapshotError::Held`]
    /// where pages to decommit are held (a GPU import): these are refused before anything
    /// changes. [`SnapshotError::ConcurrentWrites`] as above. [`SnapshotError::Space`] or
    /// [`SnapshotError::Watch`] where a call fails midway (the snapshots stay valid: every page
    /// the restore meant to change counts as changed).
    pub fn restore(&self, id: SnapshotId) -> Result<Restored, SnapshotError> {
        let started = Instant::now();
        let mut guard = self.state();
        let st = &mut *guard;
        let k = id.0;
        let k_runs = match st.store.takes.get(&k).and_then(|t| t.runs.clone()) {
            Some(runs) if st.store.live.contains(&k) => runs,
            _ => return Err(SnapshotError::UnknownSnapshot(id)),
        };
        self.no_views()?;
        self.settle(st);
        let collected = self.collect(st)?;
        st.dirty.or(&collected);
        let now = self.space.protections(self.range);
        // The pages whose content may differ from the snapshot's: changed since the base, and
        // those with a version between the base and the snapshot.
        let mut set = st.dirty.clone();
        let from = st.base.or(st.store.head).unwrap_or(k);
        st.store.copied_after(k.min(from), Some(k.max(from))).for_each(|i| set.set(i));
        let index = |a: u64| (a - self.range.start().0) / page();
        for r in subtract(&k_runs, &now) {
            set.set_run(index(r.start().0), index(r.end().0));
        }
        let decommit = subtract(&now, &k_runs);
        if let Some((range, held)) = decommit.iter().find_map(|&r| self.space.held(r).map(|h| (r, h))) {
            return Err(SnapshotError::Held { id, range, held });
        }
        self.resolve(st, k, set.iter().filter(|&i| prot_at(&k_runs, self.addr(i)).is_some()))?;
        // Everything the restore may change counts as changed from here on, whatever happens.
        let mut touched = set.clone();
        for r in &decommit {
            touched.set_run(index(r.start().0), index(r.end().0));
        }
        st.dirty.or(&touched);
        let mut out = Restored::default();
        for &r in &decommit {
            self.space.decommit(r)?;
            out.decommitted += r.pages();
        }
        let content: Vec<u64> = set.iter().filter(|&i| prot_at(&k_runs, self.addr(i)).is_some()).collect();
        let slots: Vec<usize> = content
            .iter()
            .map(|&i| st.store.slot_at(i, k).expect("a page committed at a take has a version by then"))
            .collect();
        // `resolve` filled every pending version of `content` (copy before write).
        debug_assert!(!slots.contains(&store::PENDING));
        self.write_back(st, &content, &slots, &now)?;
        out.pages = content.len() as u64;
        for (r, prot) in differing(&k_runs, &self.space.protections(self.range)) {
            self.space.protect(r, prot)?;
            touched.set_run(index(r.start().0), index(r.end().0));
        }
        st.stats.pages_restored += out.pages;
        let raced = self.raced(st, k, &k_runs, (&content, &slots), &touched);
        st.stats.restore_time += started.elapsed();
        match raced? {
            None => Ok(out),
            Some((pages, first)) => {
                Err(SnapshotError::ConcurrentWrites { id, pages, first: self.pages(first, first + 1) })
            }
        }
    }

    /// Writes the `content` pages (in order) back from their `slots` (the snapshot's bytes of
    /// each), runs of consecutive pages together ([`Space::write_runs`], straight from the
    /// slab), each run made committed and writable first where it is not (`now`) and written
    /// inside [`Tracker::host_write`].
    fn write_back(&self, st: &mut State, content: &[u64], slots: &[usize], now: &Runs) -> Result<(), SnapshotError> {
        /// Runs per batch: each is a host write in flight until the batch is written (with the
        /// mprotect backend a tracker keeps those in a list it searches).
        const BATCH: usize = 256;
        let runs: Vec<&[u64]> = content.chunk_by(|a, b| *b == a + 1).collect();
        let mut slots = slots.iter();
        for batch in runs.chunks(BATCH) {
            let ranges: Vec<GuestRange> = batch.iter().map(|r| self.pages(r[0], r[r.len() - 1] + 1)).collect();
            for &run in &ranges {
                if !writable(now, run.start().0, run.end().0) {
                    self.space.commit(run, Prot::READ_WRITE)?;
                }
            }
            let pages = batch.iter().map(|r| r.len()).sum();
            let data: Vec<&[u8]> = slots.by_ref().take(pages).map(|&s| st.store.slab.get(s)).collect();
            // One host write per run where the backend prepares the pages (it makes them
            // writable and reports them); else one over the batch's pages, which only checks.
            let hosted = match ranges.as_slice() {
                [first, .., last] if !self.tracker.host_write_prepares() => {
                    vec![GuestRange::from_bounds(first.start().0, last.end().0).expect("runs in order")]
                }
                _ => ranges.clone(),
            };
            let _writes: Vec<_> =
                hosted.iter().map(|&run| self.tracker.host_write_owned(run)).collect::<Result<_, _>>()?;
            self.space.write_runs(&ranges, &data, self.cpu())?;
        }
        Ok(())
    }

    /// The guest writes found beside a restore of `k` (see [`Snapshots::restore`]): how many
    /// pages and the first, if any. Collects, then reads back the readable `content` pages:
    /// pages reported that the restore did not `touch`, and pages read back unlike the
    /// snapshot's, were written meanwhile. The range is snapshot `k` from here on, but for those
    /// and for the pages reported that could not be read back (counted as changed).
    fn raced(
        &self,
        st: &mut State,
        k: u64,
        k_runs: &Runs,
        (content, slots): (&[u64], &[usize]),
        touched: &PageSet,
    ) -> Result<Option<(u64, u64)>, SnapshotError> {
        let collected = self.collect(st)?;
        let mut raced = PageSet::new();
        collected.iter().filter(|&i| !touched.has(i)).for_each(|i| raced.set(i));
        let mut checked = PageSet::new();
        // The readable pages, each with the slot of its bytes at `k`.
        let readable: Vec<(u64, usize)> = content
            .iter()
            .copied()
            .zip(slots.iter().copied())
            .filter(|&(i, _)| prot_at(k_runs, self.addr(i)).is_some_and(|p| p.read))
            .collect();
        let mut buf = std::mem::take(&mut st.scratch);
        let p = page() as usize;
        let runs: Vec<&[(u64, usize)]> = readable.chunk_by(|a, b| b.0 == a.0 + 1).collect();
        // Batches of runs of up to BATCH pages (a longer run alone), each read in as few calls
        // as the OS allows into a buffer that stays in the caches for the comparison; where a
        // batch fails (a page taken away meanwhile), one read per run, as a run that fails
        // counts as raced.
        const BATCH: usize = 64;
        let mut from = 0;
        while from < runs.len() {
            let (mut to, mut pages) = (from, 0);
            while to < runs.len() && (to == from || pages + runs[to].len() <= BATCH) {
                pages += runs[to].len();
                to += 1;
            }
            let batch = &runs[from..to];
            from = to;
            let ranges: Vec<GuestRange> = batch.iter().map(|r| self.pages(r[0].0, r[r.len() - 1].0 + 1)).collect();
            buf.resize(buf.len().max(pages * p), 0);
            let together = self.space.read_runs(&ranges, &mut [&mut buf[..pages * p]], self.cpu()).is_ok();
            let mut at = 0;
            for (run, range) in batch.iter().zip(&ranges) {
                let got = &mut buf[at..at + run.len() * p];
                at += got.len();
                let read = together || self.space.read(range.start(), got).is_ok();
                for (&(i, slot), got) in run.iter().zip(got.chunks_exact(p)) {
                    if !read || st.store.slab.get(slot) != got {
                        raced.set(i);
                    }
                    checked.set(i);
                }
            }
        }
        st.scratch = buf;
        // Exact from here on: the range is snapshot `k` but for these pages.
        st.base = Some(k);
        st.dirty.clear();
        collected.iter().filter(|&i| !checked.has(i)).for_each(|i| st.dirty.set(i));
        st.dirty.or(&raced);
        Ok(raced.iter().next().map(|first| (raced.count(), first)))
    }

    /// Forgets snapshot `s`, no longer live: frees what only it kept. Where it was the base,
    /// the pages that differ from the newest take count as changed.
    fn forget(&self, st: &mut State, s: u64) {
        if st.base == Some(s) {
            let pages: Vec<u64> = st.store.copied_after(s, None).collect();
            pages.into_iter().for_each(|i| st.dirty.set(i));
            st.base = None;
        }
        if st.store.live.is_empty() {
            st.store.clear();
            st.base = None;
            st.dirty.clear();
        } else if st.store.head != Some(s) {
            st.store.unpin(s);
        }
    }

    /// Releases snapshot `id`: what only it kept is freed (the newest take's pages stay as the
    /// base of the next take, which frees them; releasing every snapshot frees everything, and
    /// the next take copies every committed page again).
    ///
    /// # Errors
    /// [`SnapshotError::UnknownSnapshot`] for an id no live snapshot has.
    pub fn release(&self, id: SnapshotId) -> Result<(), SnapshotError> {
        let mut guard = self.state();
        let st = &mut *guard;
        if !st.store.live.remove(&id.0) {
            return Err(SnapshotError::UnknownSnapshot(id));
        }
        self.settle(st);
        self.forget(st, id.0);
        st.stats.released += 1;
        st.stats.live = st.store.live.len() as u64;
        st.stats.bytes_kept = st.store.bytes;
        Ok(())
    }

    /// Copies snapshot `id`'s bytes at `addr` into `buf`, without restoring it (a save state
    /// written to a file, a check).
    ///
    /// # Errors
    /// [`SnapshotError::UnknownSnapshot`] for an id no live snapshot has;
    /// [`SnapshotError::NoBytes`] naming the first byte outside the range or on a page not
    /// committed at the take (`buf` is then filled up to it).
    pub fn read(&self, id: SnapshotId, addr: GuestAddr, buf: &mut [u8]) -> Result<(), SnapshotError> {
        let mut st = self.state();
        let k = id.0;
        if st.store.live.contains(&k) {
            let (a, b) = (self.range.start().0, self.range.end().0);
            let (from, to) = (addr.0.clamp(a, b), addr.0.saturating_add(buf.len() as u64).clamp(a, b));
            self.resolve(&mut st, k, (from - a) / page()..(to - a).div_ceil(page()))?;
        }
        let runs = match st.store.takes.get(&k).and_then(|t| t.runs.as_ref()) {
            Some(runs) if st.store.live.contains(&k) => runs,
            _ => return Err(SnapshotError::UnknownSnapshot(id)),
        };
        let (p, (a, b)) = (page(), (self.range.start().0, self.range.end().0));
        let mut done = 0usize;
        while done < buf.len() {
            let at = addr.0.saturating_add(done as u64);
            let no = SnapshotError::NoBytes { id, addr: GuestAddr(at), range: self.range };
            if at < a || at >= b || prot_at(runs, at - at % p).is_none() {
                return Err(no);
            }
            let i = (at - a) / p;
            let bytes = st.store.bytes_at(i, k).ok_or(no)?;
            let off = (at % p) as usize;
            let n = (p as usize - off).min(buf.len() - done);
            if bytes.is_empty() {
                // Pending (copy before write): the page's bytes in memory are the snapshot's.
                self.space.read(GuestAddr(at), &mut buf[done..done + n])?;
                done += n;
                continue;
            }
            buf[done..done + n].copy_from_slice(&bytes[off..off + n]);
            done += n;
        }
        Ok(())
    }

    /// The live snapshots, oldest first.
    pub fn live(&self) -> Vec<SnapshotId> {
        self.state().store.live.iter().map(|&k| SnapshotId(k)).collect()
    }

    /// The counters.
    pub fn stats(&self) -> SnapshotStats {
        self.state().stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_are_send_and_sync_and_ids_print_their_number() {
        fn is<T: Send + Sync>() {}
        is::<Snapshots>();
        let id = SnapshotId::new(u64::MAX);
        assert_eq!((id.get(), id.to_string()), (u64::MAX, u64::MAX.to_string()));
        assert!(SnapshotId::new(1) < SnapshotId::new(2));
    }
}
