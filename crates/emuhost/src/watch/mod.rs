//! What the guest wrote: a tracker arms guest ranges and collects the pages written since the last
//! collect, arming them again in the same step.
//!
//! Backends, chosen at run time by a self-test (arm, write one page, collect, expect exactly it),
//! best first, or forced with `EMUHOST_WATCH=uffd|mprotect`:
//! 1. `uffd`: userfaultfd write-protect in asynchronous mode, read and re-armed by one
//!    `PAGEMAP_SCAN` (`PM_SCAN_WP_MATCHING`) per allocation (`sys/linux/uffd.rs`);
//! 2. `mprotect`: armed pages are made read-only and a `SIGSEGV` handler records the first write
//!    (`sys/linux/segv.rs`).
//!
//! On Windows (`EMUHOST_WATCH=writewatch|guard`): `writewatch` reads each `MEM_WRITE_WATCH`
//! private allocation with one `GetWriteWatch` (and resets it); `guard` makes armed pages
//! read-only and claims the first write in a vectored exception handler, and is the one for views
//! and adopted memory, which write watch cannot see ([`BackendKind`]).
//!
//! There is no soft-dirty backend: its bits are read (`/proc/self/pagemap`) and cleared
//! (`/proc/self/clear_refs`, the whole process) in two steps, so a write landing between the two
//! is lost whatever the order of the reads; under qemu on Debian's 6.1 kernel, about half of the
//! writes one thread made while another read every page and then cleared once were never seen.
//!
//! A collect reads one allocation per read, from `space`'s extent map, with no region query. A
//! failed read asks the kernel about the region: memory released behind the space's back (mapped
//! anew, or unmapped) is reported as not tracked, anything else is an error; the failure is
//! remembered per allocation until the allocation's commit state (its generation) changes.
//! `EMUHOST_VERIFY_COLLECT=1` checks every read against a region query.
//!
//! A collect takes no lock of the space: it reads the layout the space publishes (a snapshot
//! swapped before every change is told, and the ranges of the changes in flight, whose armed pages
//! it reports written whole), after taking the tracker's inner lock, so it never waits behind a
//! change held up in the kernel; docs/watch.md, "The published layout", has why no write is lost.
//! `EMUHOST_WATCH_PUBLISHED_LAYOUT=0` ([`TrackerConfig::published_layout`]) reads it under the
//! space's lock instead.
//!
//! The tracker observes the space: a commit or protection over armed pages, a release, or a view
//! split keeps the tracking of every other page, and pages mapped anew inside an armed range are
//! armed again and reported written once (their content changed). A write before a decommit is
//! reported by the next collect (the tracker reads the pages just before the release), decommitted
//! pages committed again are reported once, and arming armed pages again keeps their writes. One
//! tracker per space (a second is refused); dropping it gives armed pages their protection back.
//! Transparent huge pages would make a write report its whole 2 MiB page, so arming asks the
//! kernel not to use them there (`MADV_NOHUGEPAGE`; Wine does the same for its write watches).
//!
//! The invariant above all: a write that happens after collect N is reported by collect N + 1.
//!
//! For an emulator's caches: [`Tracker::collect_into`] ORs the written pages into the caller's
//! bitmap words at a chosen granularity without allocating (once the tracker's buffers have
//! grown), [`Tracker::query_into`] reports without arming again, and [`Tracker::consumer`] gives
//! each cache its own dirty state on the one tracker. An embedder that owns `SIGSEGV` makes its
//! tracker with [`TrackerConfig::embedder_handles_faults`] and calls [`Tracker::handle_fault`]
//! (or a [`FaultHandle`], or [`handle_fault`]) from its own handler.

mod backend;
#[cfg(target_os = "linux")]
pub mod bare;
mod bitmap;
mod cache;
mod config;
mod error;
mod fault;
mod host_write;
mod observer;
mod read;

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};

pub use bitmap::PageBitmap;
pub use cache::{Consumer, Written};
pub use config::{BackendKind, Choice, TrackerConfig, VERIFY_SWITCH, choose, self_test, self_test_with};
pub use error::WatchError;
pub use fault::{FaultHandle, handle_fault};
pub use host_write::OwnedHostWrite;
pub use read::{Collected, PageRun};

/// Whether an `mprotect` tracker made now hears of pages dropped (`madvise(MADV_DONTNEED)`),
/// unmapped or mapped over behind the space's back, and so reports them (docs/watch.md, "Content
/// the space changed" and "Limits of `mprotect`"): `Err(why not)` where the kernel has no
/// userfaultfd to listen with (before 5.11, or without the events), or one whose registered
/// mappings stay split after `mprotect` (Debian 12's 6.1). Opens and closes a userfaultfd.
#[cfg(target_os = "linux")]
pub fn mprotect_listens() -> Result<(), String> {
    backend::mprotect_listens()
}

use crate::space::ranges::RangeMap;
use crate::space::{GuestRange, Layout, Observer, Region, Space, page_size};
use observer::Core;
use read::{Scratch, split};

#[derive(Default)]
struct Inner {
    armed: RangeMap<()>,
    /// Guest ranges to report written at the next collect (pages mapped anew while armed).
    pending: RangeMap<()>,
    /// Pages the guest made inaccessible itself (not a release).
    noaccess: RangeMap<()>,
    /// Allocations whose read failed, by start: (end, generation).
    failed: HashMap<u64, (u64, u64)>,
    /// Armed pages released by the space: reported when committed or mapped again (new content).
    unmapped: RangeMap<()>,
    /// Host writes in flight ([`Tracker::host_write`]): a collect reports these pages and leaves
    /// them writable.
    hosting: Vec<(u64, u64)>,
    /// Pages an arm met under a host write in flight: armed when the last such write ends.
    deferred: RangeMap<()>,
    /// A collect's buffers, kept between collects.
    scratch: Scratch,
    /// Each consumer's pages written and not yet taken ([`Tracker::consumer`]).
    consumers: Vec<cache::Pending>,
    /// The tracker's own pages written and not yet taken, once it has had a consumer: a
    /// consumer's collect takes the kernel's marks, so from then on the tracker's own reads are
    /// one more consumer.
    own: Option<cache::Pending>,
    /// The last consumer id given out.
    consumer_ids: u64,
}

fn add(map: &mut RangeMap<()>, a: u64, b: u64) {
    map.remove(a, b, |_, _, _| ());
    map.insert(a, b, ());
}

fn clip(a: u64, b: u64, s: u64, e: u64) -> Option<(u64, u64)> {
    let (x, y) = (a.max(s), b.min(e));
    (x < y).then_some((x, y))
}
/// The spaces that have a tracker, by host base (a live tracker keeps its space, so its base is
/// unique among them).
static TRACKED: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// A space's claim to its one tracker, given back last when the tracker drops.
struct Claim(usize);

impl Claim {
    fn take(base: usize) -> Result<Claim, WatchError> {
        let mut t = TRACKED.lock().unwrap_or_else(|p| p.into_inner());
        if t.contains(&base) {
            return Err(WatchError::SecondTracker { base });
        }
        t.push(base);
        Ok(Claim(base))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        TRACKED.lock().unwrap_or_else(|p| p.into_inner()).retain(|b| *b != self.0);
    }
}

/// A write tracker over one space (one at a time: a second is refused, see the README's table of
/// tracking semantics). Dropping it gives armed pages back the protection the space gave them.
///
/// Arm guest ranges, let the guest (or the host) write, and collect: each collect reports the
/// pages written since the last one and arms them again in the same step.
///
/// ```
/// use std::sync::Arc;
/// use emuhost::space::{GuestAddr, Prot, Space, page_size};
/// use emuhost::watch::{Tracker, TrackerConfig};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let space = Arc::new(Space::with_window(16 << 20)?);
/// let page = page_size();
/// let range = space.range(0, 8 * page)?;
/// space.commit(range, Prot::READ_WRITE)?;
///
/// // The best backend this machine offers (its self-test runs first).
/// let tracker = Tracker::new(&space, &TrackerConfig::default())?;
/// tracker.arm(range)?;
///
/// // Stores to pages 1 and 2, and two to page 6: three pages, in two runs.
/// space.store(GuestAddr(page + 100), &[1; 8])?;
/// space.store(GuestAddr(2 * page), &[2; 8])?;
/// space.store(GuestAddr(6 * page), &[3; 8])?;
/// space.store(GuestAddr(6 * page + 8), &[4; 8])?;
/// let written = tracker.collect(range)?;
/// assert_eq!(written.page_addrs(), [GuestAddr(page), GuestAddr(2 * page), GuestAddr(6 * page)]);
/// assert_eq!((written.runs.len(), written.runs[0].pages), (2, 2));
///
/// // The collect armed them again: nothing new until the next store.
/// assert_eq!(tracker.collect(range)?.pages(), 0);
/// space.store(GuestAddr(2 * page), &[5; 8])?;
/// assert_eq!(tracker.collect(range)?.page_addrs(), [GuestAddr(2 * page)]);
///
/// // One tracker per space.
/// assert!(Tracker::new(&space, &TrackerConfig::default()).is_err());
/// # Ok(())
/// # }
/// ```
pub struct Tracker {
    // Dropped in this order: the backend (its page-state table), the claim, then the space (so a
    // new space cannot take the address while the claim is held).
    core: Arc<Core>,
    _claim: Claim,
    space: Arc<Space>,
    verify: bool,
    /// Collects started, raised under the lock as each begins.
    started: AtomicU64,
    /// A collect's layout of the space, kept between collects (taken before the space's lock).
    layout: Mutex<Layout>,
    /// The process that made the tracker: its userfaultfd and pagemap act on that process's pages.
    pid: u32,
    /// Whether emuhost may install its fault handler for this tracker's work (not where the
    /// embedder owns `SIGSEGV`: [`TrackerConfig::embedder_handles_faults`]).
    own_handler: bool,
}

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker").field("backend", &self.core.backend.kind()).field("verify", &self.verify).finish()
    }
}

impl Tracker {
    /// A tracker as `config` says: its backend (or the one the self-tests choose; either way it
    /// must pass its self-test, run as `config` makes trackers, unless the config skips it),
    /// verify mode, and who handles faults. A second tracker on a space that has one is refused
    /// ([`WatchError::SecondTracker`]). `TrackerConfig::default()`: the best backend that passes
    /// its self-test, emuhost's own `SIGSEGV` handler (Windows: its vectored exception handler).
    ///
    /// # Errors
    /// [`WatchError::SecondTracker`] where the space has a live tracker;
    /// [`WatchError::SelfTest`] where a forced backend fails its self-test,
    /// [`WatchError::NoBackend`] where no backend passes; [`WatchError::Unavailable`] where the
    /// backend cannot be made for this space.
    pub fn new(space: &Arc<Space>, config: &TrackerConfig) -> Result<Arc<Tracker>, WatchError> {
        if let (Some(kind), true) = (config.backend, config.skip_self_test) {
            return Self::make(space, kind, config);
        }
        let choice = config::for_space(choose(config)?, space);
        tracing::info!(backend = choice.kind.name(), "write tracking: {} ({})", choice.kind.name(), choice.why);
        Self::make(space, choice.kind, config)
    }

    /// A tracker of `kind` as `config` says (its `backend` and `skip_self_test` are not used).
    fn make(space: &Arc<Space>, kind: BackendKind, config: &TrackerConfig) -> Result<Arc<Tracker>, WatchError> {
        let claim = Claim::take(space.host_base())?;
        let backend = backend::make(kind, space, !config.embedder_handles_faults)
            .map_err(|source| WatchError::Unavailable { backend: kind.name(), source })?;
        let published = config.published_layout;
        let core = Arc::new(Core { backend, inner: Mutex::new(Inner::default()), published });
        let weak: std::sync::Weak<dyn Observer> = Arc::downgrade(&(core.clone() as Arc<dyn Observer>));
        space.observe(weak);
        if published {
            space.publish_layout();
        }
        Ok(Arc::new(Tracker {
            space: space.clone(),
            core,
            verify: config.verify,
            started: AtomicU64::new(0),
            _claim: claim,
            layout: Mutex::default(),
            pid: std::process::id(),
            own_handler: !config.embedder_handles_faults,
        }))
    }

    /// Whether emuhost may install its own fault handler for work on this tracker's memory: false
    /// where the embedder owns `SIGSEGV` ([`TrackerConfig::embedder_handles_faults`]), so a
    /// snapshot's copies go through the kernel instead of the CPU.
    pub(crate) fn owns_fault_handler(&self) -> bool {
        self.own_handler
    }

    /// The space it tracks.
    pub(crate) fn space(&self) -> &Arc<Space> {
        &self.space
    }

    /// Sets (or, `None`, takes away) the copy-before-write hook of `snapshot`'s copy-before-write
    /// mode (the protection backends only: `Unsupported` for the others; `AlreadyExists` where a
    /// hook is set).
    pub(crate) fn copy_hook(&self, hook: Option<&Arc<crate::sys::cow::CowArena>>) -> io::Result<()> {
        self.core.backend.copy_hook(hook)
    }

    /// The guest runs of `range` the backend holds marked written now (a protection backend:
    /// writable until a collect protects them again), without taking the marks.
    pub(crate) fn marked(&self, range: GuestRange) -> io::Result<Vec<(u64, u64)>> {
        let mut out = Vec::new();
        let base = self.space.host_base();
        let (s, e) = (self.host(range.start().0), self.host(range.end().0));
        self.core.backend.peek(s, e, &mut backend::Runs::new(&mut out, base as u64, 0, None))?;
        Ok(out)
    }

    /// The backend in use.
    pub fn kind(&self) -> BackendKind {
        self.core.backend.kind()
    }

    /// Whether each collect is checked against a region query
    /// ([`TrackerConfig::verify`](TrackerConfig#structfield.verify), `EMUHOST_VERIFY_COLLECT=1`).
    pub fn verifying(&self) -> bool {
        self.verify
    }

    /// The number of the latest collect to start (0 before any). Collects run one at a time, so
    /// a write that reads `e1` before it and `e2` after it must be reported by a collect of its
    /// page numbered from `e1` up to the first one numbered above `e2` (which started after the
    /// write ended), whichever threads collect.
    pub fn collects_started(&self) -> u64 {
        self.started.load(SeqCst)
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.core.inner()
    }

    /// An error unless this is the process that made the tracker: after `fork`, the child's copy
    /// holds the parent's userfaultfd and pagemap, and would read and re-arm the parent's pages.
    fn same_process(&self) -> Result<(), WatchError> {
        let now = std::process::id();
        if now == self.pid { Ok(()) } else { Err(WatchError::OtherProcess { made_in: self.pid, now }) }
    }

    fn host(&self, a: u64) -> usize {
        self.space.host_base() + a as usize
    }

    fn os(&self, op: &'static str, range: GuestRange, source: io::Error) -> WatchError {
        WatchError::Os { op, range, backend: self.kind().name(), source }
    }

    /// Arms `range`: from now on, writes to its pages are reported by the next collect. Pages
    /// armed already keep their tracking: a write to them before this arm is still reported (an
    /// emulator arms after every commit, and a commit over armed pages must not forget writes).
    ///
    /// # Errors
    /// [`WatchError::Space`] for a range outside the window or a call from another process than
    /// the space's maker, [`WatchError::OtherProcess`] from another process than the tracker's,
    /// [`WatchError::Os`] where the backend's call fails.
    pub fn arm(&self, range: GuestRange) -> Result<(), WatchError> {
        self.same_process()?;
        let range = self.space.range(range.start().0, range.len())?;
        let _changing = self.space.maybe_changing();
        // Pages armed already (an arm after every commit, most often) need no system call, so
        // nothing to wait for; with uffd not even a region query (which, under the space's
        // lock, would queue behind any writer waiting for the memory-map lock).
        let todo = self.space.with_layout(range, |_| !self.to_arm(&self.inner(), range).is_empty());
        match (todo, self.kind()) {
            (true, _) => self.space.wait_for_long_reads(),
            // The region query keeps verify mode's record of write-only pages.
            (false, kind) if kind.protects() => {}
            (false, _) => return Ok(()),
        }
        self.space.with_layout(range, |_| {
            let regions = self.space.kernel_regions(range)?;
            self.arm_locked(&mut self.inner(), range, &regions)
        })
    }

    /// The pages an arm of `range` arms: those not armed yet, and those of allocations whose read
    /// failed (to track them again).
    fn to_arm(&self, inner: &Inner, range: GuestRange) -> Vec<(u64, u64)> {
        let (a, b) = (range.start().0, range.end().0);
        let mut todo = inner.armed.gaps(a, b);
        todo.extend(inner.failed.iter().filter_map(|(s, (e, _))| clip(a, b, *s, *e)));
        todo
    }

    /// Arms the pages [`Tracker::to_arm`] names, but not under a host write in flight: those wait
    /// for its end.
    fn arm_locked(&self, inner: &mut Inner, range: GuestRange, regions: &[Region]) -> Result<(), WatchError> {
        let (a, b) = (range.start().0, range.end().0);
        let base = self.space.host_base();
        for (s, e) in self.to_arm(inner, range) {
            let (outside, inside) = split(s, e, &inner.hosting);
            for (x, y) in inside {
                add(&mut inner.deferred, x, y);
            }
            for (x, y) in outside {
                self.core
                    .backend
                    .arm(self.host(x), self.host(y), regions, base)
                    .map_err(|e| self.os("arm", range, e))?;
                add(&mut inner.armed, x, y);
            }
        }
        if self.kind().protects() {
            // Write-only pages lose their write to arming and look inaccessible (`---`): the guest's
            // doing, for verify mode.
            for r in regions.iter().filter(|r| r.write && !r.read && !r.exec) {
                if let Some((x, y)) = clip(a, b, r.start as u64, r.end as u64) {
                    add(&mut inner.noaccess, x, y);
                }
            }
        }
        inner.failed.retain(|s, (e, _)| *e <= a || *s >= b);
        Ok(())
    }

    /// Stops tracking `range` (its pages get their protection back).
    pub fn disarm(&self, range: GuestRange) -> Result<(), WatchError> {
        self.same_process()?;
        let range = self.space.range(range.start().0, range.len())?;
        let _changing = self.space.changing();
        self.space.with_layout(range, |_| {
            let mut guard = self.inner();
            let inner = &mut *guard;
            let (a, b) = (range.start().0, range.end().0);
            let pieces: Vec<(u64, u64)> =
                inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)).collect();
            for (s, e) in pieces {
                self.core.backend.disarm(self.host(s), self.host(e)).map_err(|err| self.os("disarm", range, err))?;
            }
            for map in [&mut inner.armed, &mut inner.pending, &mut inner.unmapped, &mut inner.deferred] {
                map.remove(a, b, |_, _, _| ());
            }
            Ok(())
        })
    }
}

impl Drop for Tracker {
    /// Gives armed pages back the protection the space gave them (with mprotect they would stay
    /// read-only, and the next store would die), under the space's lock so no change of the space
    /// runs in between.
    fn drop(&mut self) {
        // In a fork's child the backend's files act on the parent's pages: leave them be.
        if self.same_process().is_err() {
            return;
        }
        let Ok(first) = self.space.range(0, page_size()) else { return };
        self.space.with_layout(first, |_| {
            let mut inner = self.inner();
            let pieces: Vec<(u64, u64)> = inner.armed.iter().map(|(s, e, _)| (s, e)).collect();
            for (s, e) in pieces {
                if let Err(err) = self.core.backend.disarm(self.host(s), self.host(e)) {
                    tracing::warn!("write tracking: giving {s:#x}..{e:#x} its protection back failed: {err}");
                }
            }
            *inner = Inner::default();
        });
    }
}
