//! Copy before write ([`SnapshotMode::CopyBeforeWrite`]): a take keeps no bytes; the pages it
//! would have copied get a *pending* version (bytes to come), and the first write to each page
//! after the take copies it just before the write, in the protection backend's fault handler
//! (`sys::cow`). A background thread copies the pending pages ahead of the writes while they are
//! still protected, and moves the copies out of the arena; the next take (or a restore, a read)
//! puts them into their pending versions.
//!
//! The store holds exactly what copy at take would hold (the same versions at the same takes), so
//! releases, the budget and restores work unchanged: a version pending at take `e` is the page's
//! bytes at `e`, which are its bytes until its first write after `e`, whose copy (tagged with the
//! arena epoch of the take before it) fills the version. A page not written since keeps its bytes
//! in memory, where a restore or a read finds them. See docs/snapshot_cow.md.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;

use super::pages::{PageSet, Runs, prot_at};
use super::store::{PENDING, Store};
use super::{SnapshotError, SnapshotMode};
use crate::space::{Change, GuestRange, Observer, Space};
use crate::sys::cow::CowArena;
use crate::watch::{Tracker, WatchError};

/// Copies moved out of the arena: each page with its arena epoch, and their bytes one after the
/// other (one buffer, reused: no allocation per copy).
#[derive(Default)]
struct Copied {
    pages: Vec<(u64, u64)>,
    bytes: Vec<u8>,
}

/// What the background copier and the snapshots share.
struct Shared {
    arena: Arc<CowArena>,
    /// The pages to copy ahead (the latest take's pending pages), the stop flag.
    work: Mutex<(Vec<u64>, bool)>,
    wake: Condvar,
    /// Copies moved out of the arena, not yet in the store.
    out: Mutex<Copied>,
    /// One harvester at a time, with the buffer it moves copies into before handing them to
    /// `out` (taken before `out`; `out` is held only for the hand-over, so a take's fill does
    /// not wait for a harvest).
    harvest: Mutex<Copied>,
}

impl Shared {
    fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the arena's copies out, into `out`.
    fn harvest(&self) {
        let mut got = Self::lock(&self.harvest);
        let got = &mut *got;
        self.arena.harvest(|i, e, b| {
            got.pages.push((i as u64, e));
            got.bytes.extend_from_slice(b);
        });
        if got.pages.is_empty() {
            return;
        }
        let mut out = Self::lock(&self.out);
        if out.pages.is_empty() {
            // The buffers trade places: both keep their memory.
            std::mem::swap(&mut *out, got);
        } else {
            out.pages.append(&mut got.pages);
            out.bytes.extend_from_slice(&got.bytes);
            got.bytes.clear();
        }
    }

    /// The copier: copies the pages it is given ahead of their writes, and harvests.
    fn run(&self) {
        loop {
            let pages = {
                let mut w = Self::lock(&self.work);
                while w.0.is_empty() && !w.1 {
                    // Wakes now and then to move copies the handler made out of the arena.
                    let (g, _) = self
                        .wake
                        .wait_timeout(w, std::time::Duration::from_millis(4))
                        .unwrap_or_else(|p| p.into_inner());
                    w = g;
                    if w.0.is_empty() && !w.1 {
                        drop(w);
                        self.harvest();
                        w = Self::lock(&self.work);
                    }
                }
                if w.1 {
                    return;
                }
                std::mem::take(&mut w.0)
            };
            for (n, &i) in pages.iter().enumerate() {
                self.arena.copy_now(i as usize, false);
                if n % 256 == 255 {
                    self.harvest();
                }
            }
            self.harvest();
        }
    }
}

/// Copies the pending pages of a range the space is about to change (protect, commit, release):
/// their bytes may change without a write fault after it.
struct Watcher {
    arena: Arc<CowArena>,
}

impl Observer for Watcher {
    fn changed(&self, space: &Space, change: Change) {
        if let Change::Changing { range, .. } | Change::Releasing { range } = change {
            let host = |a: u64| space.host_base() + a as usize;
            self.arena.copy_pending(host(range.start().0), host(range.end().0));
        }
    }
}

/// The copy-before-write machinery of one [`Snapshots`](super::Snapshots).
pub(super) struct Cow {
    tracker: Arc<Tracker>,
    shared: Arc<Shared>,
    _watcher: Arc<Watcher>,
    copier: Option<JoinHandle<()>>,
    /// Takes begun (successful or not): take attempt `a` runs with arena epoch `2a - 1` until its
    /// collect has protected the pages it reports, then `2a` (see [`Cow::take_of`]).
    attempt: u64,
    /// Whether take attempt `attempt` has begun and not succeeded (yet).
    open: bool,
    /// The take attempts that failed, in order.
    failed: Vec<u64>,
}

impl Cow {
    /// The machinery over `range`, or the error that says why the tracker cannot have it.
    pub(super) fn new(tracker: &Arc<Tracker>, range: GuestRange) -> Result<Cow, SnapshotError> {
        let space = tracker.space();
        let refuse = |why: String| SnapshotError::Mode {
            mode: SnapshotMode::CopyBeforeWrite,
            backend: tracker.kind().name(),
            why,
        };
        if tracker.kind() == crate::watch::BackendKind::Uffd {
            return Err(refuse(
                "it write-protects with UFFD_FEATURE_WP_ASYNC, where the kernel resolves each first write itself and \
                 tells nobody, so nothing can copy a page before its write (a range has one userfaultfd, and \
                 PAGEMAP_SCAN's write-protect needs the async mode); use the mprotect backend \
                 (EMUHOST_WATCH=mprotect) or copy at take (EMUHOST_SNAPSHOT_MODE=take)"
                    .into(),
            ));
        }
        let host = space.host_base() + range.start().0 as usize;
        let arena = Arc::new(CowArena::new(host, range.pages() as usize).map_err(|e| refuse(e.to_string()))?);
        tracker.copy_hook(Some(&arena)).map_err(|e| refuse(e.to_string()))?;
        let watcher = Arc::new(Watcher { arena: arena.clone() });
        let weak: Weak<dyn Observer> = Arc::downgrade(&(watcher.clone() as Arc<dyn Observer>));
        space.observe(weak);
        let shared = Arc::new(Shared {
            arena,
            work: Mutex::default(),
            wake: Condvar::new(),
            out: Mutex::default(),
            harvest: Mutex::default(),
        });
        let s = shared.clone();
        let copier = std::thread::Builder::new().name("emuhost-snapcopy".into()).spawn(move || s.run());
        let copier = match copier {
            Ok(c) => Some(c),
            Err(e) => {
                let _ = tracker.copy_hook(None);
                return Err(refuse(e.to_string()));
            }
        };
        Ok(Cow {
            tracker: tracker.clone(),
            shared,
            _watcher: watcher,
            copier,
            attempt: 0,
            open: false,
            failed: Vec::new(),
        })
    }

    /// A take begins: from now on first writes copy their page first.
    pub(super) fn begin_take(&mut self) {
        if self.open {
            self.failed.push(self.attempt);
        }
        self.open = true;
        self.attempt += 1;
        self.shared.arena.set_epoch(2 * self.attempt - 1);
    }

    /// The take whose bytes a copy tagged with arena epoch `t` holds. A copy made during take
    /// attempt `a`'s collect (`2a - 1`) is of a page not written since the take before (it had
    /// no copy since): that take's bytes; a write it let through races take `a`, whose collect
    /// reports the page, and whose version of it takes the page's next copy, made after the
    /// collect (`2a`), which holds the bytes at take `a` (or, where `a` failed, at the take
    /// before: such a copy only finds versions filled already, unless the page was not written
    /// since, and then its bytes are that take's).
    fn take_of(&self, t: u64) -> u64 {
        let a = t.div_ceil(2) - (t % 2);
        a - self.failed.partition_point(|&f| f <= a) as u64
    }

    /// After the take's collect: from now on first writes copy the bytes at this take; the pages
    /// still writable without a fault (a handler busy with them at the collect, a protection
    /// refused at the map limit) are copied now.
    pub(super) fn after_collect(&self, range: GuestRange) -> Result<(), WatchError> {
        self.shared.arena.set_epoch(2 * self.attempt);
        let base = range.start().0;
        let p = crate::space::page_size();
        let marked = self.tracker.marked(range).map_err(|source| WatchError::Os {
            op: "copy-before-write: read the pages still writable",
            range,
            backend: self.tracker.kind().name(),
            source,
        })?;
        for (s, e) in marked {
            for a in (s.max(base)..e.min(range.end().0)).step_by(p as usize) {
                self.shared.arena.copy_now(((a - base) / p) as usize, false);
            }
        }
        Ok(())
    }

    /// Take `id` succeeded with `pending` pages to come: marks them pending, fills the versions
    /// the copies made so far complete, and hands the pages to the copier.
    /// Those of them `written` since the previous take (likely to be written again) go to the
    /// copier, which copies them ahead of the writes.
    /// Returns the pages filled.
    pub(super) fn taken(&mut self, id: u64, pending: Vec<u64>, written: &PageSet, store: &mut Store) -> u64 {
        debug_assert_eq!(id, self.attempt - self.failed.len() as u64);
        self.open = false;
        for &i in &pending {
            self.shared.arena.set_pending(i as usize);
        }
        self.shared.arena.all_pending();
        let filled = self.fill(store);
        let ahead: Vec<u64> = pending.into_iter().filter(|&i| written.has(i)).collect();
        if !ahead.is_empty() {
            Shared::lock(&self.shared.work).0 = ahead;
            self.shared.wake.notify_one();
        }
        filled
    }

    /// Copies page `i` now if it has no copy since the newest take (see `Snapshots::resolve`).
    pub(super) fn copy_now(&self, i: u64) {
        self.shared.arena.copy_now(i as usize, false);
    }

    /// Puts every copy made so far into its pending version (a restore, a read: all of them);
    /// returns the pages filled.
    pub(super) fn settle(&self, store: &mut Store) -> u64 {
        self.shared.harvest();
        self.fill(store)
    }

    /// Puts the copies moved out of the arena into the versions they complete: a copy holds the
    /// page's bytes at a take ([`Cow::take_of`]), and fills the page's newest version at or before
    /// that take where it is pending (else the store has the bytes already, and the copy goes).
    /// Returns the versions filled.
    fn fill(&self, store: &mut Store) -> u64 {
        let mut out = Shared::lock(&self.shared.out);
        let out = &mut *out;
        let p = crate::space::page_size() as usize;
        let mut filled = 0;
        for (&(i, a), bytes) in out.pages.iter().zip(out.bytes.chunks_exact(p)) {
            filled += u64::from(fill(store, i, self.take_of(a), bytes));
        }
        out.pages.clear();
        out.bytes.clear();
        filled
    }
}

/// Fills page `i`'s version covering take `k` with `bytes` (a page) where it is pending: the
/// bytes go into a slot of the store's slab. Returns whether it filled one.
pub(super) fn fill(store: &mut Store, i: u64, k: u64, bytes: &[u8]) -> bool {
    let Some(chain) = store.versions.get_mut(&i) else { return false };
    let n = chain.partition_point(|v| v.epoch <= k);
    let Some(v) = n.checked_sub(1).and_then(|at| chain.get_mut(at)) else { return false };
    if v.bytes != Some(PENDING) {
        return false;
    }
    v.bytes = Some(store.slab.put(bytes));
    store.bytes += bytes.len() as u64;
    true
}

impl Drop for Cow {
    fn drop(&mut self) {
        Shared::lock(&self.shared.work).1 = true;
        self.shared.wake.notify_one();
        if let Some(c) = self.copier.take() {
            let _ = c.join();
        }
        let _ = self.tracker.copy_hook(None);
    }
}

impl super::Snapshots {
    /// A take's copies of the pages of `set`, each page with its slab slot: read now (copy at
    /// take), or, with copy before write, pending for the readable pages ([`PENDING`]: their
    /// first write copies them) and read now for the others (no fault handler may read them).
    pub(super) fn copies(
        &self,
        st: &mut super::State,
        set: PageSet,
        runs: &Runs,
    ) -> Result<Vec<(u64, usize)>, SnapshotError> {
        if st.cow.is_none() {
            return self.read_pages(&set, runs, st);
        }
        let mut now = PageSet::new();
        let mut out = Vec::new();
        for i in set.iter() {
            if prot_at(runs, self.addr(i)).is_some_and(|p| p.read) {
                out.push((i, PENDING));
            } else {
                now.set(i);
            }
        }
        out.extend(self.read_pages(&now, runs, st)?);
        out.sort_unstable_by_key(|c| c.0);
        Ok(out)
    }

    /// The pages take `epoch` left pending.
    pub(super) fn pending_of(&self, st: &super::State, take: &super::Take, epoch: u64) -> Vec<u64> {
        if st.cow.is_none() {
            return Vec::new();
        }
        take.copied.iter().copied().filter(|&i| st.store.slot_at(i, epoch) == Some(PENDING)).collect()
    }

    /// Puts every copy made so far into its pending version.
    pub(super) fn settle(&self, st: &mut super::State) {
        if let Some(c) = &st.cow {
            st.stats.pages_copied += c.settle(&mut st.store);
            st.stats.bytes_kept = st.store.bytes;
        }
    }

    /// Fills the versions of snapshot `k` of `pages` still pending. Every copy made is put into
    /// its version first; a version still pending then is of a page not written since its take
    /// (nor protected, released or restored: each copies it first), so memory holds its bytes:
    /// the page is copied through the arena (a guest write beside it waits for the copy, or its
    /// own copy comes first), and put in. Where that copy cannot be made (no read access), the
    /// bytes are read from memory.
    pub(super) fn resolve(
        &self,
        st: &mut super::State,
        k: u64,
        pages: impl Iterator<Item = u64>,
    ) -> Result<(), SnapshotError> {
        let Some(cow) = &st.cow else { return Ok(()) };
        st.stats.pages_copied += cow.settle(&mut st.store);
        let pending = |st: &super::State, i: u64| st.store.slot_at(i, k) == Some(PENDING);
        let wanted: Vec<u64> = pages.filter(|&i| pending(st, i)).collect();
        if wanted.is_empty() {
            return Ok(());
        }
        wanted.iter().for_each(|&i| cow.copy_now(i));
        self.settle(st);
        let p = crate::space::page_size() as usize;
        let left: Vec<u64> = wanted.into_iter().filter(|&i| pending(st, i)).collect();
        let mut b = vec![0u8; p];
        for i in left {
            self.space.read(crate::space::GuestAddr(self.addr(i)), &mut b)?;
            st.stats.pages_copied += u64::from(fill(&mut st.store, i, k, &b));
        }
        Ok(())
    }
}
