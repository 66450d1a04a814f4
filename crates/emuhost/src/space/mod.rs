//! The guest address space: one reservation for the whole guest window, and what is done to
//! pages inside it.
//!
//! Underneath, the window is one anonymous `PROT_NONE`, `MAP_NORESERVE` mapping: address space
//! without memory or commit charge. A commit is one `mprotect` over the range (the kernel faults
//! pages in at first touch); where that call fails, or a hole is found (foreign code unmapped part
//! of the window, say), the range is walked region by region, as the old way did, committing each
//! region and filling holes with fresh pages (`MAP_FIXED_NOREPLACE`, which never replaces
//! anything). A decommit maps fresh reserved pages over the range (one `mmap`), which drops the
//! pages and any shared view there.
//!
//! The window may hold mappings the space did not make: foreign code can unmap part of it, and the
//! process's next allocation can land in the hole. So before a commit, decommit, protection,
//! view or zero, the space asks the kernel what is mapped over the range (one region query) and
//! compares it with what it made there itself (its record of protections and views): a region
//! the space could not have made (accessible where the space reserved, private where it mapped a
//! view, a file, more access than it gave) is foreign, and the call fails naming it, untouched.
//! A foreign mapping that looks exactly like the space's own (the same protection over pages it
//! committed so) cannot be told apart on kernels without names for anonymous mappings.
//!
//! Shared memory is memfd sections; a run of consecutive section pages is one `MAP_SHARED` view,
//! and a release or remap of pages inside a run replaces only those pages, so the kernel keeps
//! every other page of the run as it was: bytes, protection and write-protect bits alike.
//!
//! Guest memory is never lent out as Rust references: use [`Space::host_addr`] for raw access
//! (as a JIT or recompiled code does) or [`Space::write`]/[`Space::read`], which copy through the
//! page tables and fail (`EFAULT`) instead of faulting on a page the protection forbids.

mod error;
pub mod ranges;
mod types;

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

pub use error::SpaceError;
pub use types::{GuestAddr, GuestRange, Prot, page_size};

pub use crate::sys::query::{QueryPath, Region};
use crate::sys::{mm::Reservation, query::Maps};
use ranges::RangeMap;

/// The default guest window: 512 GiB.
pub const DEFAULT_WINDOW: u64 = 512 << 30;

/// Where the guest window is reserved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Placement {
    /// Where the kernel chooses.
    #[default]
    Anywhere,
    /// At this host address (page-aligned), never replacing a mapping: where anything is mapped
    /// in the range (guard pages included) the build fails naming it ([`SpaceError::ReserveAt`]).
    At(usize),
}

/// How a space is made.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SpaceConfig {
    /// Bytes of guest address space to reserve (a multiple of the page size).
    pub window: u64,
    /// Where the window is reserved.
    pub placement: Placement,
    /// Bytes of guard pages (a multiple of the page size) reserved `PROT_NONE` below and above
    /// the window: nothing else can be mapped there, and a run off either end of the window
    /// faults. The space never commits them; they are unmapped with the window.
    pub guard: u64,
    /// Commit in one system call, walking region by region only where it fails. Set only by
    /// [`SpaceConfig::one_call_commit`] (feature `bench`).
    one_call_commit: bool,
    /// Answer region queries from the text of `/proc/self/maps`. Set only by
    /// [`SpaceConfig::maps_text`] (feature `bench`).
    maps_text: bool,
}

impl Default for SpaceConfig {
    fn default() -> Self {
        Self {
            window: DEFAULT_WINDOW,
            placement: Placement::Anywhere,
            guard: 0,
            one_call_commit: true,
            maps_text: false,
        }
    }
}

impl SpaceConfig {
    pub fn window(mut self, bytes: u64) -> Self {
        self.window = bytes;
        self
    }

    /// Reserves the window at host address `base` ([`Placement::At`]).
    pub fn at(mut self, base: usize) -> Self {
        self.placement = Placement::At(base);
        self
    }

    pub fn guard(mut self, bytes: u64) -> Self {
        self.guard = bytes;
        self
    }

    /// Commit in one system call, walking region by region only where it fails (the default).
    /// `false` always walks (the old way; kept to measure against). Feature `bench`.
    #[cfg(feature = "bench")]
    pub fn one_call_commit(mut self, on: bool) -> Self {
        self.one_call_commit = on;
        self
    }

    /// Answer region queries from the text of `/proc/self/maps` even where `PROCMAP_QUERY` works
    /// (to measure one against the other; the fault switch `EMUHOST_FAULT_NO_PROCMAP_QUERY` does
    /// the same for every space). Feature `bench`.
    #[cfg(feature = "bench")]
    pub fn maps_text(mut self, on: bool) -> Self {
        self.maps_text = on;
        self
    }

    pub fn build(self) -> Result<Space, SpaceError> {
        Space::new(self)
    }

    /// Makes a space whose window is the caller's reservation `base..base + len` (host address,
    /// page-aligned), instead of reserving one: `window`, `placement` and `guard` are not used
    /// (asking for a placement or guards is an error: the caller's reservation is where it is,
    /// and its guards are the caller's to make). The range must be mapped entirely, `PROT_NONE`,
    /// private and anonymous, as a reservation is (`MAP_NORESERVE` keeps commits free of commit
    /// charge); anything else is an error naming the part that is not ([`SpaceError::Adopt`]).
    ///
    /// On drop the window is not unmapped: every page the space committed, protected or mapped a
    /// view over is decommitted (fresh `PROT_NONE`, private, `MAP_NORESERVE` pages, the bytes
    /// dropped), so the caller gets its range back as a reservation, to unmap or reuse.
    ///
    /// # Safety
    /// `base..base + len` must be a reservation the caller made; it must stay mapped for as long
    /// as the space lives (trackers and holds keep it alive), and nothing else may map, unmap or
    /// change protection in it meanwhile: the space maps over its pages (`MAP_FIXED`) as its own.
    /// The checks above cannot tell a reservation the caller owns from someone else's.
    #[allow(unsafe_code)] // adopting a reservation: see the Safety section
    pub unsafe fn adopt(self, base: usize, len: u64) -> Result<Space, SpaceError> {
        // SAFETY: the caller's contract is this fn's.
        unsafe { Space::adopt(self, base, len) }
    }
}

/// How a commit was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitPath {
    /// One `mprotect` over the whole range.
    OneCall,
    /// Region by region: `regions` kernel regions committed, `holes` unmapped gaps refilled.
    RegionWalk { regions: u64, holes: u64 },
}

/// A private allocation: the extent of one commit, as later split by releases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub range: GuestRange,
    /// Changes whenever the allocation's commit state changes (made, trimmed, split).
    pub generation: u64,
}

/// A shared section's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SectionId(pub u64);

/// One shared view: `range` shows the section's bytes from `offset` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    pub range: GuestRange,
    pub section: SectionId,
    pub offset: u64,
}

#[derive(Clone, Copy, Debug)]
struct ViewEntry {
    section: SectionId,
    offset: u64,
}

#[derive(Debug)]
struct Section {
    fd: Arc<OwnedFd>,
    size: u64,
}

/// A change to the space's mappings, as told to observers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// `range` was committed with `prot`. With `CommitPath::RegionWalk` some of its mappings may be
    /// new (holes refilled).
    Committed { range: GuestRange, prot: Prot, path: CommitPath },
    /// `range` was given `prot`.
    Protected { range: GuestRange, prot: Prot },
    /// `range` is about to be released (told before the system call, while its pages are still
    /// there: a tracker keeps the writes to them).
    Releasing { range: GuestRange },
    /// `range` was released: new reserved mappings replace it or, `in_place`, its private
    /// mappings stay, inaccessible and with their pages dropped (see
    /// [`Observer::keeps_mappings`]).
    Released { range: GuestRange, in_place: bool },
    /// A shared view was mapped over `range` with `prot` (a new mapping).
    Mapped { range: GuestRange, prot: Prot },
}

/// Told of every change of the space's mappings, after the system call (a release before it too)
/// and with the space's lock held, so changes arrive in order and a layout read under the lock
/// sees them all. `watch` uses it to keep armed tracking across commits, protections and view
/// splits. An observer must not call back into the space.
pub trait Observer: Send + Sync {
    fn changed(&self, space: &Space, change: Change);

    /// Whether a release had better keep the space's private mappings (made inaccessible, their
    /// pages dropped) than map the range anew: what the kernel keeps per mapping (a
    /// userfaultfd's registration) then stays. The space does so where any live observer asks
    /// it, the range holds private anonymous mappings only, and the kernel does not account
    /// commits strictly ([`Change::Released`] says which it did).
    fn keeps_mappings(&self) -> bool {
        false
    }
}

/// The private allocations and shared views over a range, read under the space's lock.
#[derive(Debug, Default)]
pub struct Layout {
    pub allocations: Vec<Allocation>,
    pub views: Vec<View>,
    /// The views outside the range that show section pages a view of the range shows too
    /// (aliases), each the part of a view outside the range, in address order.
    pub aliases: Vec<View>,
    /// Whether two views inside the range show the same section bytes.
    pub aliased_inside: bool,
}

#[derive(Default)]
struct State {
    extents: RangeMap<u64>,
    views: RangeMap<ViewEntry>,
    sections: HashMap<SectionId, Section>,
    next_section: u64,
    generation: u64,
    observers: Vec<Weak<dyn Observer>>,
    /// Live holds by id: `(lo, hi)` guest bytes ([`Space::hold`]).
    holds: HashMap<u64, (u64, u64)>,
    next_hold: u64,
}

/// What the space made of its window, to tell its own mappings from foreign ones. Behind a lock of
/// its own, taken after the state's: a change that takes access away holds it for writing across
/// its system call, so a checked store (which holds it for reading) never faults, and works inside
/// a tracker's `host_write` (which holds the state's lock).
#[derive(Default, Debug)]
struct Record {
    /// The protection the space gave each page it did not leave reserved (committed, protected or
    /// a view).
    prots: RangeMap<Prot>,
    /// Where the shared views are.
    shared: RangeMap<()>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("allocations", &self.extents.iter().count())
            .field("views", &self.views.iter().count())
            .finish()
    }
}

impl Record {
    /// Records that the space gave `a..b` the protection `prot`.
    fn set_prot(&mut self, a: u64, b: u64, prot: Prot) {
        self.prots.remove(a, b, |_, _, p| *p);
        self.prots.insert(a, b, prot);
    }

    /// Forgets `a..b`: reserved again.
    fn forget(&mut self, a: u64, b: u64) {
        self.prots.remove(a, b, |_, _, p| *p);
        self.shared.remove(a, b, |_, _, _| ());
    }

    /// Why the kernel's region `r` (guest addresses `a..b`) cannot be one the space made, if so.
    fn foreign(&self, a: u64, b: u64, r: &Region) -> Option<String> {
        let kernel = Prot { read: r.read, write: r.write, exec: r.exec };
        // A write tracker may take access away (mprotect), never give more than the space did.
        let within = |p: Prot| (!kernel.read || p.read) && (!kernel.write || p.write) && (!kernel.exec || p.exec);
        let found = || {
            let kind = if r.file { "file" } else { "anonymous" };
            format!("a {kernel:?} {} {kind} mapping", if r.shared { "shared" } else { "private" })
        };
        let reserved = !self.prots.gaps(a, b).is_empty();
        if reserved && (r.shared || r.file || kernel != Prot::NONE) {
            return Some(format!("{} where the space reserved the pages", found()));
        }
        if let Some((_, _, p)) = self.prots.overlapping(a, b).find(|(_, _, p)| !within(**p)) {
            return Some(format!("{} where the space gave {p:?}", found()));
        }
        let view = self.shared.gaps(a, b).is_empty();
        let private = self.shared.overlapping(a, b).next().is_none();
        match (r.shared && r.file, view, private) {
            (true, true, _) | (false, _, true) => None,
            (true, _, _) => Some(format!("{} where the space has private pages", found())),
            (false, _, _) => Some(format!("{} where the space mapped a shared view", found())),
        }
    }
}

impl State {
    fn next_generation(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }

    fn tell(&mut self, space: &Space, change: Change) {
        self.observers.retain(|o| match o.upgrade() {
            Some(o) => {
                o.changed(space, change);
                true
            }
            None => false,
        });
    }

    /// Whether a live observer asks releases to keep the mappings ([`Observer::keeps_mappings`]).
    fn keep_mappings(&self) -> bool {
        self.observers.iter().any(|o| o.upgrade().is_some_and(|o| o.keeps_mappings()))
    }

    /// The first live hold overlapping `a..b`, as `(lo, hi)`.
    fn held(&self, a: u64, b: u64) -> Option<(u64, u64)> {
        self.holds.values().copied().filter(|&(lo, hi)| lo < b && a < hi).min()
    }

    /// Refuses `op` over `range` where a live hold overlaps it.
    fn refuse_held(&self, op: &'static str, range: GuestRange) -> Result<(), SpaceError> {
        match self.held(range.start().0, range.end().0) {
            Some((lo, hi)) => Err(SpaceError::Held { op, addr: range.start().0, len: range.len(), lo, hi }),
            None => Ok(()),
        }
    }

    /// Forgets private extents and shared views over `a..b`, splitting those that run across it.
    fn forget(&mut self, a: u64, b: u64) {
        let mut next = self.generation;
        self.extents.remove(a, b, |_, _, _| {
            next += 1;
            next
        });
        self.generation = next;
        self.views.remove(a, b, |old, new, v| ViewEntry { section: v.section, offset: v.offset + (new - old) });
    }
}

/// The guest address space.
#[derive(Debug)]
pub struct Space {
    res: Reservation,
    maps: Maps,
    one_call_commit: bool,
    state: Mutex<State>,
    record: RwLock<Record>,
    /// Changes of the mappings under way (waiting for the space's lock or in the kernel): see
    /// [`Space::changes_in_flight`].
    changing: AtomicU32,
    /// Long reads of the memory map under way ([`Space::try_long_read`]), and where a change
    /// waits for them to end.
    long_reads: AtomicU32,
    reads_done: (Mutex<()>, Condvar),
    /// Changes that found long reads in flight and waited for them.
    long_read_waits: AtomicU64,
    /// The process that made the space: its region queries read that process's memory map.
    pid: u32,
}

/// Counts a change of the mappings in flight while it lives ([`Space::changing`]).
#[must_use = "the change is counted only while the guard lives"]
#[derive(Debug)]
pub struct Changing<'a>(&'a AtomicU32);

impl Drop for Changing<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// Counts a change of the mappings in flight while it lives, and keeps the space alive
/// ([`Space::changing_owned`]).
#[must_use = "the change is counted only while the guard lives"]
#[derive(Debug)]
pub struct OwnedChanging(Arc<Space>);

impl Drop for OwnedChanging {
    fn drop(&mut self) {
        self.0.changing.fetch_sub(1, Ordering::Release);
    }
}

/// A long read of the memory map in flight while it lives ([`Space::try_long_read`]).
#[must_use = "the read is counted only while the guard lives"]
#[derive(Debug)]
pub struct LongRead<'a>(&'a Space);

impl Drop for LongRead<'_> {
    fn drop(&mut self) {
        self.0.end_long_read();
    }
}

/// A long read of the memory map in flight while it lives, keeping the space alive
/// ([`Space::try_long_read_owned`]).
#[must_use = "the read is counted only while the guard lives"]
#[derive(Debug)]
pub struct OwnedLongRead(Arc<Space>);

impl Drop for OwnedLongRead {
    fn drop(&mut self) {
        self.0.end_long_read();
    }
}

/// The longest a change waits for long reads to end before it goes on (into the kernel, where
/// it waits for them anyway): a guard kept by mistake slows changes down, it never stops them.
const LONG_READ_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

impl Space {
    /// Reserves the window (and its guard pages) where the configuration places it.
    pub fn new(config: SpaceConfig) -> Result<Self, SpaceError> {
        let page = page_size();
        if config.window == 0 || !config.window.is_multiple_of(page) || usize::try_from(config.window).is_err() {
            return Err(SpaceError::BadWindow { size: config.window, page });
        }
        let (window, guard) = (config.window, config.guard);
        let base = match config.placement {
            Placement::Anywhere => None,
            Placement::At(b) => Some(b as u64),
        };
        let bad = |why| SpaceError::BadPlacement { base: base.unwrap_or(0), window, guard, why };
        if !guard.is_multiple_of(page) {
            return Err(bad("the guard is not a multiple of the page size"));
        }
        // The whole mapping, guards included, must fit the address space.
        let total = guard.checked_mul(2).and_then(|g| g.checked_add(window)).filter(|t| usize::try_from(*t).is_ok());
        let total = total.ok_or_else(|| bad("the window and its guards run past the address space"))?;
        let res = match base {
            None => Reservation::new(window as usize, guard as usize)
                .map_err(|source| SpaceError::Reserve { size: window, source })?,
            Some(b) => {
                if !b.is_multiple_of(page) {
                    return Err(bad("the base is not page-aligned"));
                }
                let start = b.checked_sub(guard).filter(|s| *s > 0);
                let end = start.and_then(|s| s.checked_add(total)).filter(|e| usize::try_from(*e).is_ok());
                let (Some(start), Some(end)) = (start, end) else {
                    return Err(bad("the window and its guards run past either end of the address space"));
                };
                Reservation::at(b as usize, window as usize, guard as usize)
                    .map_err(|source| reserve_at_failed(start, end, source, &config))?
            }
        };
        Self::with_reservation(res, &config)
    }

    /// A space over the caller's reservation `base..base + len`: see [`SpaceConfig::adopt`].
    ///
    /// # Safety
    /// As [`SpaceConfig::adopt`].
    #[allow(unsafe_code)] // adopting a reservation: see the Safety section
    unsafe fn adopt(config: SpaceConfig, base: usize, len: u64) -> Result<Self, SpaceError> {
        let page = page_size();
        let refuse = |why: String| SpaceError::Adopt { base: base as u64, len, why };
        if config.placement != Placement::Anywhere || config.guard != 0 {
            return Err(refuse(
                "a placement or guard pages were asked for; the caller's reservation is where it is, \
                 its guards are the caller's to make"
                    .into(),
            ));
        }
        if base == 0 || len == 0 {
            return Err(refuse("the range is null or empty".into()));
        }
        if !(base as u64).is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(refuse(format!("the range is not aligned to the {page:#x}-byte page")));
        }
        let Some(end) = usize::try_from(len).ok().and_then(|l| base.checked_add(l)) else {
            return Err(refuse("the range runs past the end of the address space".into()));
        };
        let maps = Maps::open(config.maps_text || crate::faults::no_procmap_query())
            .map_err(|source| SpaceError::os("open /proc/self/maps", 0, 0, source))?;
        let regions = maps.regions(base, end).map_err(|e| SpaceError::os("query regions", 0, len, e))?;
        if let Some(why) = not_a_reservation(&regions, base, end) {
            return Err(refuse(why));
        }
        // SAFETY: the caller's contract is the one `Reservation::adopt` asks for; alignment and
        // length were checked above (it checks them again).
        let res = unsafe { Reservation::adopt(base, len as usize) }.map_err(|e| refuse(e.to_string()))?;
        Ok(Self::from_parts(res, maps, &config))
    }

    /// A space over `res`, its region queries answered as `config` asks.
    fn with_reservation(res: Reservation, config: &SpaceConfig) -> Result<Self, SpaceError> {
        let maps = Maps::open(config.maps_text || crate::faults::no_procmap_query())
            .map_err(|source| SpaceError::os("open /proc/self/maps", 0, 0, source))?;
        Ok(Self::from_parts(res, maps, config))
    }

    fn from_parts(res: Reservation, maps: Maps, config: &SpaceConfig) -> Self {
        // Every page starts reserved in the record: an adopted window was checked to be so.
        Self {
            res,
            maps,
            one_call_commit: config.one_call_commit,
            state: Mutex::new(State::default()),
            record: RwLock::new(Record::default()),
            changing: AtomicU32::new(0),
            long_reads: AtomicU32::new(0),
            reads_done: (Mutex::new(()), Condvar::new()),
            long_read_waits: AtomicU64::new(0),
            pid: std::process::id(),
        }
    }

    /// An error unless this is the process that made the space: after `fork`, the child's copy
    /// would query the parent's memory map (the region queries' file was opened by the parent).
    pub(crate) fn same_process(&self) -> Result<(), SpaceError> {
        let now = std::process::id();
        if now == self.pid { Ok(()) } else { Err(SpaceError::OtherProcess { made_in: self.pid, now }) }
    }

    /// Commits, decommits, protections, views and arms under way now: each takes the process's
    /// memory-map lock for writing, and waits for every reader of it (a driver's pin, a
    /// populate, a collect's scan) while holding the space's lock. Work that can wait (an
    /// importer's background populates and pins) starts none while this is not zero.
    pub fn changes_in_flight(&self) -> u32 {
        self.changing.load(Ordering::Acquire)
    }

    /// Marks a change of the mappings in flight until the guard is dropped. The space's own
    /// changes and a tracker's arms do this; an embedder that takes the memory-map lock for
    /// writing itself (an `mprotect` or `mmap` of its own, say) may too, so that background
    /// populates and pins do not start meanwhile. Keep it only for the change: while it lives,
    /// an importer's `settle` waits for it.
    ///
    /// Before it returns, it waits for the long reads in flight ([`Space::try_long_read`]) to
    /// end, for 100 ms at most: the change would wait for them in the kernel anyway, and there
    /// other threads' reads of the memory map (a collect's scan) queue behind it. Call it before
    /// taking any lock that such a reader may need.
    pub fn changing(&self) -> Changing<'_> {
        self.enter_change();
        Changing(&self.changing)
    }

    /// [`Space::changing`] without the wait: for an operation that may find nothing to change
    /// and so would wait for nothing. Before its first system call that changes the mappings it
    /// calls [`Space::wait_for_long_reads`], with no lock held.
    pub(crate) fn maybe_changing(&self) -> Changing<'_> {
        self.changing.fetch_add(1, Ordering::SeqCst);
        Changing(&self.changing)
    }

    /// [`Space::changing`] with a guard that keeps the space alive, for a caller that cannot
    /// borrow it (the C API's `emuhost_space_change_begin`).
    pub fn changing_owned(self: &Arc<Self>) -> OwnedChanging {
        self.enter_change();
        OwnedChanging(self.clone())
    }

    fn enter_change(&self) {
        self.changing.fetch_add(1, Ordering::SeqCst);
        self.wait_for_long_reads();
    }

    /// Waits for the long reads in flight to end (100 ms at most). No lock may be held that a
    /// long read's thread or a collect takes.
    pub(crate) fn wait_for_long_reads(&self) {
        if self.long_reads.load(Ordering::SeqCst) == 0 {
            return;
        }
        self.long_read_waits.fetch_add(1, Ordering::Relaxed);
        let deadline = std::time::Instant::now() + LONG_READ_WAIT;
        let (lock, done) = &self.reads_done;
        let mut g = lock.lock().unwrap_or_else(|p| p.into_inner());
        while self.long_reads.load(Ordering::SeqCst) > 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                tracing::debug!("a change of the mappings waited {LONG_READ_WAIT:?} for long reads: going on");
                return;
            }
            g = done.wait_timeout(g, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// For work that can wait (a background thread's populate or driver pin) and holds the
    /// process's memory-map lock for reading for long: `None` while a change of the mappings is
    /// in flight (step aside and try again). While the guard lives, a change that comes waits
    /// for it before it takes the space's lock, rather than in the kernel: a writer waiting
    /// there for the memory-map lock makes every later reader queue behind it (the render
    /// thread's collects, whose scans read the memory map), and it would hold the space's lock
    /// that those collects need meanwhile. Keep it only for the read, and make no change of the
    /// space's mappings while it lives (the change would wait for it: 100 ms).
    pub fn try_long_read(&self) -> Option<LongRead<'_>> {
        self.begin_long_read().then(|| LongRead(self))
    }

    /// [`Space::try_long_read`] with a guard that keeps the space alive rather than borrow it
    /// (the C API's `emuhost_space_long_read_begin`).
    pub fn try_long_read_owned(self: &Arc<Self>) -> Option<OwnedLongRead> {
        self.begin_long_read().then(|| OwnedLongRead(self.clone()))
    }

    /// Counts a long read, then refuses it (and ends it) while a change is in flight: counted
    /// first, so a change that comes meanwhile either is seen here or sees the read and waits.
    fn begin_long_read(&self) -> bool {
        self.long_reads.fetch_add(1, Ordering::SeqCst);
        if self.changing.load(Ordering::SeqCst) == 0 {
            return true;
        }
        self.end_long_read();
        false
    }

    /// Ends a long read: the last one wakes the changes waiting for them.
    fn end_long_read(&self) {
        if self.long_reads.fetch_sub(1, Ordering::SeqCst) == 1 {
            // Under the lock a waiting change checks the count under, so it never misses this.
            let _g = self.reads_done.0.lock().unwrap_or_else(|p| p.into_inner());
            self.reads_done.1.notify_all();
        }
    }

    /// The changes so far that found a long read in flight and waited for it.
    pub fn long_read_waits(&self) -> u64 {
        self.long_read_waits.load(Ordering::Relaxed)
    }

    /// Long reads of the memory map under way ([`Space::try_long_read`]).
    pub fn long_reads_in_flight(&self) -> u32 {
        self.long_reads.load(Ordering::SeqCst)
    }

    /// A space with the default configuration (512 GiB, one-call commit).
    pub fn with_window(window: u64) -> Result<Self, SpaceError> {
        SpaceConfig::default().window(window).build()
    }

    /// The window's size in bytes.
    pub fn window(&self) -> u64 {
        self.res.len() as u64
    }

    /// The host address of guest address 0.
    pub fn host_base(&self) -> usize {
        self.res.base()
    }

    /// The bytes of guard pages reserved beyond each end of the window (0 for none, and for an
    /// adopted window).
    pub fn guard(&self) -> u64 {
        self.res.guard() as u64
    }

    /// Whether the window is the caller's reservation ([`SpaceConfig::adopt`]).
    pub fn adopted(&self) -> bool {
        self.res.adopted()
    }

    /// The host address of a guest address inside the window.
    pub fn host_addr(&self, addr: GuestAddr) -> Result<usize, SpaceError> {
        if addr.0 >= self.window() {
            return Err(SpaceError::OutOfWindow { addr: addr.0, len: 1, window: self.window() });
        }
        Ok(self.res.base() + addr.0 as usize)
    }

    /// A checked range: aligned, non-empty and inside the window.
    pub fn range(&self, addr: u64, len: u64) -> Result<GuestRange, SpaceError> {
        let r = GuestRange::new(GuestAddr(addr), len)?;
        self.check(r)?;
        Ok(r)
    }

    fn check(&self, r: GuestRange) -> Result<(usize, usize), SpaceError> {
        if r.end().0 > self.window() {
            return Err(SpaceError::OutOfWindow { addr: r.start().0, len: r.len(), window: self.window() });
        }
        self.same_process()?;
        Ok((r.start().0 as usize, r.len() as usize))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held cannot leave the maps half-updated in a way that makes
        // them unsafe to read: keep going with what is there.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The record, to change (after the state's lock).
    fn record_mut(&self) -> RwLockWriteGuard<'_, Record> {
        self.record.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The record, to read (no state lock needed).
    fn record(&self) -> RwLockReadGuard<'_, Record> {
        self.record.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Commits `range` with `prot`. Pages already committed keep their bytes; their protection is
    /// set to `prot` again. Shared views in the range are re-protected too, but stay views (the
    /// private allocation map records only the private parts).
    ///
    /// A mapping in the range that the space did not make is an error naming it
    /// ([`SpaceError::Foreign`]), and nothing is changed; a hole (nothing mapped) is filled.
    ///
    /// A commit that fails leaves the pages as they were: the regions the walk committed before
    /// the one that failed get their protection back. Where even that fails, the pages left
    /// committed are recorded and told to observers as a commit (so a tracker reports them
    /// written rather than lose their writes).
    pub fn commit(&self, range: GuestRange, prot: Prot) -> Result<CommitPath, SpaceError> {
        // Fault injection may panic here, before any lock is taken (a no-op in the default build).
        crate::faults::panic_at_commit();
        let _changing = self.changing();
        self.commit_locked(&mut self.state(), range, prot)
    }

    /// Commits with `prot` only the pages of `range` that are not committed (neither a private
    /// allocation nor a shared view): committed pages keep their bytes and their protection. One
    /// look and the commits under the space's lock, so a commit on another thread in between is
    /// never overridden. Returns the bytes committed.
    pub fn commit_reserved(&self, range: GuestRange, prot: Prot) -> Result<u64, SpaceError> {
        self.check(range)?;
        let _changing = self.maybe_changing();
        let (a, b) = (range.start().0, range.end().0);
        let gaps_in = |st: &State| {
            let mut gaps = Vec::new();
            for (x, y) in st.views.gaps(a, b) {
                gaps.extend(st.extents.gaps(x, y));
            }
            gaps
        };
        // All committed (a binding's import over the guest's memory, most often): nothing to
        // change, so nothing to wait for.
        if gaps_in(&self.state()).is_empty() {
            return Ok(0);
        }
        self.wait_for_long_reads();
        let mut st = self.state();
        let gaps = gaps_in(&st);
        let mut done = 0;
        for (x, y) in gaps {
            let gap = GuestRange::from_bounds(x, y).expect("extents and views are page-aligned");
            self.commit_locked(&mut st, gap, prot)?;
            done += y - x;
        }
        Ok(done)
    }

    /// [`Space::commit`] with the lock held.
    fn commit_locked(&self, st: &mut State, range: GuestRange, prot: Prot) -> Result<CommitPath, SpaceError> {
        let (off, len) = self.check(range)?;
        let mut rec = self.record_mut();
        let regions = self.own_regions(&rec, "commit", range)?;
        let holes = !covers(&regions, self.res.base() + off, self.res.base() + off + len);
        let one_call = (self.one_call_commit && !holes).then(|| self.commit_call(off, len, prot));
        let path = match one_call {
            Some(Ok(())) => CommitPath::OneCall,
            first => {
                let after_failed_call = matches!(first, Some(Err(_)));
                match first {
                    Some(Err(e)) => {
                        tracing::debug!("commit of {range}: one call failed ({e}); walking it region by region")
                    }
                    _ if holes => tracing::debug!("commit of {range}: holes in it; walking it region by region"),
                    _ => {}
                }
                match self.commit_by_regions(off, len, prot, &regions, after_failed_call) {
                    Ok(path) => path,
                    Err((source, left)) => {
                        let base = self.res.base();
                        for (s, e) in left {
                            let part = GuestRange::from_bounds((s - base) as u64, (e - base) as u64)
                                .expect("regions are page-aligned");
                            tracing::warn!("commit of {range} failed and {part} stays committed: recorded as such");
                            let path = CommitPath::RegionWalk { regions: 1, holes: 0 };
                            self.record_commit(st, &mut rec, part, prot, path);
                        }
                        return Err(SpaceError::os("commit", range.start().0, range.len(), source));
                    }
                }
            }
        };
        self.record_commit(st, &mut rec, range, prot, path);
        Ok(path)
    }

    /// The kernel's regions over `range` (host addresses, one region query), after checking that
    /// the space made each of them; a foreign one is an error naming it, for `op`.
    fn own_regions(&self, rec: &Record, op: &'static str, range: GuestRange) -> Result<Vec<Region>, SpaceError> {
        let base = self.res.base();
        let (ha, hb) = (base + range.start().0 as usize, base + range.end().0 as usize);
        // Another space reserved in a hole of this window: its pages look like this one's own.
        if let Some(&(s, e)) = self.res.later_within(ha, hb).first() {
            let found = format!("another space's reservation (host {s:#x}..{e:#x})");
            return Err(SpaceError::Foreign { op, addr: (s - base) as u64, len: (e - s) as u64, found });
        }
        let regions = self.host_regions(range)?;
        for r in &regions {
            let (a, b) = ((r.start - base) as u64, (r.end - base) as u64);
            if let Some(found) = rec.foreign(a, b, r) {
                return Err(SpaceError::Foreign { op, addr: a, len: b - a, found });
            }
        }
        Ok(regions)
    }

    /// A commit's `mprotect` (a call fault injection may fail with `ENOMEM`).
    fn commit_call(&self, off: usize, len: usize, prot: Prot) -> std::io::Result<()> {
        if crate::faults::fail_commit_call() {
            return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
        }
        self.res.protect(off, len, prot.raw())
    }

    /// A commit's `mmap` of a hole, which never replaces a mapping (a call fault injection may
    /// fail with `ENOMEM`).
    fn fill_call(&self, off: usize, len: usize, prot: Prot) -> std::io::Result<()> {
        if crate::faults::fail_commit_call() {
            return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
        }
        self.res.fill_hole(off, len, prot.raw())
    }

    /// Records a commit that was made: extents and observers.
    fn record_commit(&self, st: &mut State, rec: &mut Record, range: GuestRange, prot: Prot, path: CommitPath) {
        let gen_ = st.next_generation();
        let (a, b) = (range.start().0, range.end().0);
        rec.set_prot(a, b, prot);
        // Allocations the commit runs over keep their extent but change generation: their commit
        // state changed (a failed read of one is tried again).
        let touched: Vec<(u64, u64)> = st.extents.overlapping(a, b).map(|(s, e, _)| (s, e)).collect();
        for (s, e) in touched {
            st.extents.remove(s, e, |_, _, g| *g);
            st.extents.insert(s, e, gen_);
        }
        let mut private = Vec::new();
        for (x, y) in st.views.gaps(a, b) {
            private.extend(st.extents.gaps(x, y));
        }
        for (x, y) in private {
            st.extents.insert(x, y, gen_);
        }
        st.tell(self, Change::Committed { range, prot, path });
    }

    /// The old way: commit the kernel's regions (`regions`, read before anything was changed, all
    /// the space's own) one by one; a gap with nothing mapped (released behind the space's back)
    /// gets fresh pages, which never replace anything. Where a region fails, those done before it
    /// are put back as they were (their protection; a filled hole reserved again); the error
    /// comes with the host ranges that could not be put back.
    fn commit_by_regions(
        &self,
        off: usize,
        len: usize,
        prot: Prot,
        regions: &[Region],
        after_failed_call: bool,
    ) -> Result<CommitPath, (std::io::Error, Vec<(usize, usize)>)> {
        let base = self.res.base();
        let end = base + off + len;
        let (mut n_regions, mut holes) = (0, 0);
        // What was done: host range and its protection before (`None`: a hole filled).
        let mut done: Vec<(usize, usize, Option<crate::sys::mm::RawProt>)> = Vec::new();
        let mut at = base + off;
        let mut next = regions.iter().peekable();
        let walked = (|| {
            while at < end {
                match next.peek() {
                    Some(r) if r.start <= at => {
                        self.commit_call(at - base, r.end - at, prot)?;
                        let before = crate::sys::mm::RawProt { read: r.read, write: r.write, exec: r.exec };
                        done.push((at, r.end, Some(before)));
                        n_regions += 1;
                        at = r.end;
                        next.next();
                    }
                    r => {
                        let to = r.map_or(end, |r| r.start);
                        self.fill_call(at - base, to - at, prot)?;
                        done.push((at, to, None));
                        holes += 1;
                        at = to;
                    }
                }
            }
            Ok(())
        })();
        match walked {
            Ok(()) => Ok(CommitPath::RegionWalk { regions: n_regions, holes }),
            Err(e) => {
                let mut left = Vec::new();
                for (s, t, before) in done.into_iter().rev() {
                    let undone = match before {
                        Some(p) => {
                            self.commit_call(s - base, t - s, Prot { read: p.read, write: p.write, exec: p.exec })
                        }
                        None => self.res.reset(s - base, t - s),
                    };
                    if let Err(u) = undone {
                        tracing::warn!("commit walk: putting {:#x}..{:#x} back failed: {u}", s - base, t - base);
                        left.push((s, t));
                    }
                }
                left.reverse();
                // A failed one call may have changed regions the walk did not reach (it is not
                // all-or-nothing): they get their protection back too.
                for r in regions.iter().filter(|r| after_failed_call && r.end > at) {
                    let before = crate::sys::mm::RawProt { read: r.read, write: r.write, exec: r.exec };
                    if self.res.protect(r.start - base, r.end - r.start, before).is_err() {
                        left.push((r.start, r.end));
                    }
                }
                Err((e, left))
            }
        }
    }

    /// Fills the holes in `range` (nothing mapped; `regions` is what the kernel has there) with
    /// reserved pages that never replace anything, so that a `MAP_FIXED` over the range then
    /// replaces only the space's own mappings.
    fn reserve_holes(&self, range: GuestRange, regions: &[Region]) -> std::io::Result<()> {
        let base = self.res.base();
        let mut at = base + range.start().0 as usize;
        let end = base + range.end().0 as usize;
        for to in regions.iter().map(|r| (r.start, r.end)).chain([(end, end)]) {
            if to.0 > at {
                self.res.fill_hole(at - base, to.0 - at, Prot::NONE.raw())?;
            }
            at = at.max(to.1);
        }
        Ok(())
    }

    /// Decommits (releases) `range`: its pages are dropped and it is reserved again. Private
    /// allocations and shared views that run across its ends are split; the rest of them keep
    /// their pages. A range with a held page ([`Space::hold`]: a live GPU import) is refused
    /// ([`SpaceError::Held`], nothing done): [`Space::zero`] it instead. The check and the release
    /// are one step under the space's lock, which a hold takes too. A mapping in the range that
    /// the space did not make is an error naming it, and nothing is changed. The range is mapped
    /// anew as reserved, or made inaccessible with its pages dropped where an observer asks
    /// ([`Observer::keeps_mappings`]: a uffd tracker, whose registration then stays); either way
    /// a later commit finds zeroes.
    pub fn decommit(&self, range: GuestRange) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        let _changing = self.changing();
        let mut st = self.state();
        st.refuse_held("decommit", range)?;
        let mut rec = self.record_mut();
        let regions = self.own_regions(&rec, "decommit", range)?;
        let (a, b) = (self.res.base() + off, self.res.base() + off + len);
        let in_place = st.keep_mappings()
            && covers(&regions, a, b)
            && regions.iter().all(|r| !r.shared && !r.file)
            && !crate::sys::probe::strict_overcommit();
        st.tell(self, Change::Releasing { range });
        let in_place = in_place
            && match self.res.drop_pages(off, len) {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!("decommit of {range} in place failed ({e}); mapping it anew");
                    false
                }
            };
        if !in_place {
            self.reserve_holes(range, &regions)
                .and_then(|()| self.res.reset(off, len))
                .map_err(|e| SpaceError::os("decommit", range.start().0, range.len(), e))?;
        }
        st.forget(range.start().0, range.end().0);
        rec.forget(range.start().0, range.end().0);
        st.tell(self, Change::Released { range, in_place });
        Ok(())
    }

    /// Zeroes `range` in place: the pages stay mapped and committed (so a GPU import of them keeps
    /// seeing the same pages), unlike [`Space::decommit`]. A mapping in the range that the space
    /// did not make is an error naming it; so are pages not committed
    /// ([`SpaceError::NotCommitted`]) and read-only ones ([`SpaceError::Protection`]).
    pub fn zero(&self, range: GuestRange) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        self.own_regions(&self.record(), "zero", range)?;
        self.res.zero(off, len).map_err(|e| self.failed("zero", range.start().0, range.len(), e, |p| p.write))
    }

    /// Sets the protection of committed pages in `range` (one `mprotect`). A mapping in the range
    /// that the space did not make is an error naming it; so is a hole, and nothing is changed.
    pub fn protect(&self, range: GuestRange, prot: Prot) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        let _changing = self.changing();
        let mut st = self.state();
        let mut rec = self.record_mut();
        let err = |e| SpaceError::os("protect", range.start().0, range.len(), e);
        let regions = self.own_regions(&rec, "protect", range)?;
        let base = self.res.base();
        if !covers(&regions, base + off, base + off + len) {
            return Err(err(std::io::Error::from_raw_os_error(libc::ENOMEM)));
        }
        if let Err(e) = self.res.protect(off, len, prot.raw()) {
            // The call may have changed some regions before it failed: give them theirs back.
            for r in &regions {
                let before = Prot { read: r.read, write: r.write, exec: r.exec };
                let _ = self.res.protect(r.start - base, r.end - r.start, before.raw());
            }
            return Err(err(e));
        }
        rec.set_prot(range.start().0, range.end().0, prot);
        st.tell(self, Change::Protected { range, prot });
        Ok(())
    }

    /// Faults the pages of `range` in, writable, ahead of use (`MADV_POPULATE_WRITE`), so that a
    /// later GPU import pays for pinning only, not for first-touch faults. The pages must be
    /// committed writable ([`SpaceError::NotCommitted`], [`SpaceError::Protection`]). On a kernel without `MADV_POPULATE_WRITE` (before 5.14) each page is
    /// touched instead (a write of the byte it holds), after checking that all are writable.
    #[allow(unsafe_code)] // guest memory through the CPU: see the SAFETY comment
    pub fn populate(&self, range: GuestRange) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        let err = |e| self.failed("populate", range.start().0, range.len(), e, |p| p.write);
        if !crate::faults::no_populate_write() && self.res.populate_write(off, len).map_err(err)? {
            return Ok(());
        }
        // The record's lock keeps every decommit and protection out until the pages are touched.
        let rec = self.record();
        let regions = self.own_regions(&rec, "populate", range)?;
        let base = self.res.base();
        if !covers(&regions, base + off, base + off + len) || regions.iter().any(|r| !r.write) {
            drop(rec);
            return Err(err(std::io::Error::from_raw_os_error(libc::EFAULT))); // as the advice answers
        }
        // SAFETY: every page of the range is mapped writable (checked just above, by a region
        // query), and the space's lock, held until this returns, keeps every decommit and
        // protection of the space out; no Rust reference points into guest memory.
        let touched = unsafe { self.res.touch_write(off, len) };
        drop(rec);
        touched.map_err(err)
    }

    /// Which pages of `range` are resident (the guest or a populate touched them), one entry per
    /// page, into `out` (cleared first): what importing them would cost depends on it. Reads
    /// page tables only (`mincore`): nothing is faulted in and no byte or mapping changes.
    pub fn resident_pages(&self, range: GuestRange, out: &mut Vec<bool>) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        crate::sys::pin::resident_pages(self.res.base() + off, len, out)
            .map_err(|e| SpaceError::os("mincore", range.start().0, range.len(), e))
    }

    /// Copies `data` into guest memory at `addr` (any alignment). An error, never a fault, where
    /// a page is not writable or outside the window: [`SpaceError::NotCommitted`] or
    /// [`SpaceError::Protection`] naming the first such pages where the space did not commit them
    /// writable (the bytes before them are written).
    pub fn write(&self, addr: GuestAddr, data: &[u8]) -> Result<(), SpaceError> {
        let len = data.len() as u64;
        self.check_bytes(addr, len)?;
        self.res.write(addr.0 as usize, data).map_err(|e| self.failed("write", addr.0, len, e, |p| p.write))
    }

    /// Stores `data` at `addr` as a guest store would land, without ever faulting: every page
    /// must be the space's own and committed writable (a write tracker may have taken write
    /// access away for now), else an error and nothing is stored. The check is a region query, and
    /// no decommit or protection runs until the store is done (it works inside
    /// [`crate::watch::Tracker::host_write`] too).
    ///
    /// The bytes are copied by the kernel (`process_vm_writev`, as [`Space::write`] does), which
    /// refuses a page without write access instead of faulting. A page an `mprotect` write
    /// tracker armed is made writable and marked written there, as its fault handler does for a
    /// store by the CPU, so the next collect reports it, whatever the thread's signal mask and
    /// whether or not a handler is installed yet; with uffd the kernel records the write itself.
    /// Any other page the kernel refuses (its access was taken away behind the space's back, by
    /// the embedder's own `mprotect`, say) is [`SpaceError::NotWritable`]: the bytes before that
    /// page are stored, none after. Hot paths that know their pages use
    /// [`Space::store_unchecked`] (a store by the CPU).
    pub fn store(&self, addr: GuestAddr, data: &[u8]) -> Result<(), SpaceError> {
        let len = data.len() as u64;
        self.check_bytes(addr, len)?;
        if data.is_empty() {
            return Ok(());
        }
        let page = page_size();
        let (a, b) = (addr.0 / page * page, (addr.0 + len).next_multiple_of(page));
        let pages = GuestRange::from_bounds(a, b)?;
        let rec = self.record();
        let regions = self.own_regions(&rec, "store", pages)?;
        let base = self.res.base();
        let writable = rec.prots.gaps(a, b).is_empty() && rec.prots.overlapping(a, b).all(|(_, _, p)| p.write);
        if !writable || !covers(&regions, base + a as usize, base + b as usize) {
            return Err(SpaceError::NotWritable { addr: addr.0, len });
        }
        // The record's lock, held until this returns, keeps every decommit and protection out. A
        // page the kernel refuses goes to the write trackers' fault handling, which makes it
        // writable only where a tracker armed it and the guest may write it.
        let stored = self.res.write_claiming(addr.0 as usize, data, crate::sys::segv::fault);
        drop(rec);
        stored.map_err(|e| match e.raw_os_error() {
            Some(libc::EFAULT) => SpaceError::NotWritable { addr: addr.0, len },
            _ => SpaceError::os("store", addr.0, len, e),
        })
    }

    /// Stores `data` at `addr` with the CPU, as guest code would (one atomic byte store at a time),
    /// without [`Space::store`]'s check: a page the protection forbids faults (`SIGSEGV`), which
    /// a write tracker handles for its armed pages; any other is fatal, as it would be for the
    /// guest.
    ///
    /// # Safety
    /// Every page of `addr..addr + data.len()` must stay committed writable (or armed by a write
    /// tracker whose backend takes the fault: `mprotect`) for the whole call: no decommit or
    /// protection may take it away meanwhile, on any thread. Otherwise the process dies of the
    /// fault.
    #[allow(unsafe_code)] // guest memory through the CPU: see the SAFETY comment
    pub unsafe fn store_unchecked(&self, addr: GuestAddr, data: &[u8]) -> Result<(), SpaceError> {
        let len = data.len() as u64;
        self.check_bytes(addr, len)?;
        // SAFETY: the caller's contract is the one `Reservation::store` asks for.
        unsafe { self.res.store(addr.0 as usize, data) }.map_err(|e| SpaceError::os("store", addr.0, len, e))
    }

    /// Copies guest memory at `addr` into `buf`. An error, never a fault, where a page is not
    /// readable or outside the window: [`SpaceError::NotCommitted`] or [`SpaceError::Protection`]
    /// naming the first such pages where the space did not commit them readable.
    pub fn read(&self, addr: GuestAddr, buf: &mut [u8]) -> Result<(), SpaceError> {
        let len = buf.len() as u64;
        self.check_bytes(addr, len)?;
        self.res.read(addr.0 as usize, buf).map_err(|e| self.failed("read", addr.0, len, e, |p| p.read))
    }

    /// The first run of pages of `range` the space has not committed (reserved: never committed,
    /// or decommitted), if any. Committed pages of any protection (`---` too) and shared views
    /// count as committed.
    pub fn uncommitted(&self, range: GuestRange) -> Option<GuestRange> {
        let gap = first_gap(&self.record().prots, range.start().0, range.end().0)?;
        Some(GuestRange::from_bounds(gap.0, gap.1).expect("the record is page-aligned"))
    }

    /// The error for `op` over the bytes `addr..addr + len`, which failed with `e`: where the
    /// space's record tells a caller's mistake, the first run of pages that were not committed
    /// ([`SpaceError::NotCommitted`]) or were committed with a protection `allows` refuses
    /// ([`SpaceError::Protection`]), whichever comes first; else the OS failure. Read after the
    /// failure, so the calls that work pay nothing for it.
    fn failed(&self, op: &'static str, addr: u64, len: u64, e: std::io::Error, allows: fn(Prot) -> bool) -> SpaceError {
        let page = page_size();
        let (a, b) = (addr / page * page, addr.saturating_add(len).next_multiple_of(page));
        let rec = self.record();
        let gap = first_gap(&rec.prots, a, b);
        let mut refused: Option<(u64, u64, Prot)> = None;
        for (s, t, p) in rec.prots.overlapping(a, b) {
            let (s, t) = (s.max(a), t.min(b));
            match refused {
                None if !allows(*p) => refused = Some((s, t, *p)),
                None => {}
                Some((lo, hi, q)) if hi == s && q == *p => refused = Some((lo, t, q)),
                Some(_) => break,
            }
        }
        match (gap, refused) {
            (Some((lo, hi)), r) if r.is_none_or(|(s, _, _)| lo < s) => {
                SpaceError::NotCommitted { op, addr, len, lo, hi }
            }
            (_, Some((lo, hi, prot))) => SpaceError::Protection { op, addr, len, lo, hi, prot },
            _ => SpaceError::os(op, addr, len, e),
        }
    }

    fn check_bytes(&self, addr: GuestAddr, len: u64) -> Result<(), SpaceError> {
        match addr.0.checked_add(len) {
            Some(end) if end <= self.window() => Ok(()),
            _ => Err(SpaceError::OutOfWindow { addr: addr.0, len, window: self.window() }),
        }
    }

    /// The private allocations, in address order.
    pub fn allocations(&self) -> Vec<Allocation> {
        let st = self.state();
        st.extents.iter().map(|(s, e, g)| allocation(s, e, *g)).collect()
    }

    /// The private allocations that overlap `range`, unclipped, in address order.
    pub fn allocations_in(&self, range: GuestRange) -> Vec<Allocation> {
        let st = self.state();
        st.extents.overlapping(range.start().0, range.end().0).map(|(s, e, g)| allocation(s, e, *g)).collect()
    }

    /// Creates a shared section of `len` bytes (a memfd), zero-filled.
    pub fn create_section(&self, len: u64) -> Result<SectionId, SpaceError> {
        GuestRange::new(GuestAddr(0), len)?;
        let mut st = self.state();
        let id = SectionId(st.next_section);
        let fd = crate::sys::mm::memfd(&format!("emuhost-section-{}", id.0), len)
            .map_err(|e| SpaceError::os("create section", 0, len, e))?;
        st.next_section += 1;
        st.sections.insert(id, Section { fd: Arc::new(fd), size: len });
        Ok(id)
    }

    /// Drops the space's handle on a section. Views of it stay mapped (the kernel keeps the
    /// memory until the last view goes).
    pub fn destroy_section(&self, id: SectionId) -> Result<(), SpaceError> {
        self.state().sections.remove(&id).map(|_| ()).ok_or(SpaceError::NoSection(id.0))
    }

    /// Maps the section's bytes from `offset` (page-aligned) at `range` as ONE view, replacing
    /// whatever was there. Mapping a single page at several addresses makes aliases: each sees
    /// the others' writes.
    pub fn map_section(
        &self,
        range: GuestRange,
        section: SectionId,
        offset: u64,
        prot: Prot,
    ) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        let _changing = self.changing();
        let mut st = self.state();
        st.refuse_held("map section", range)?;
        let sec = st.sections.get(&section).ok_or(SpaceError::NoSection(section.0))?;
        GuestRange::new(GuestAddr(offset), range.len())?;
        if offset.checked_add(range.len()).is_none_or(|end| end > sec.size) {
            return Err(SpaceError::PastSection { section: section.0, offset, len: range.len(), size: sec.size });
        }
        let fd = sec.fd.clone();
        let mut rec = self.record_mut();
        let regions = self.own_regions(&rec, "map section", range)?;
        self.reserve_holes(range, &regions)
            .and_then(|()| self.res.map_shared(off, len, &fd, offset, prot.raw()))
            .map_err(|e| SpaceError::os("map section", range.start().0, range.len(), e))?;
        st.forget(range.start().0, range.end().0);
        st.views.insert(range.start().0, range.end().0, ViewEntry { section, offset });
        rec.forget(range.start().0, range.end().0);
        rec.set_prot(range.start().0, range.end().0, prot);
        rec.shared.insert(range.start().0, range.end().0, ());
        st.tell(self, Change::Mapped { range, prot });
        Ok(())
    }

    /// Maps section pages at consecutive guest pages from `start`: guest page `i` shows section
    /// page `pages[i]`. Each run of consecutive section pages becomes one view (one `mmap`).
    /// Returns the number of views made.
    pub fn map_pages(
        &self,
        start: GuestAddr,
        section: SectionId,
        pages: &[u64],
        prot: Prot,
    ) -> Result<usize, SpaceError> {
        let page = page_size();
        let mut views = 0;
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j] == pages[j - 1].wrapping_add(1) {
                j += 1;
            }
            let at = start.0.checked_add(i as u64 * page).ok_or(SpaceError::OutOfWindow {
                addr: start.0,
                len: pages.len() as u64 * page,
                window: self.window(),
            })?;
            let range = GuestRange::new(GuestAddr(at), (j - i) as u64 * page)?;
            let offset = pages[i].checked_mul(page).ok_or(SpaceError::PastSection {
                section: section.0,
                offset: u64::MAX,
                len: range.len(),
                size: 0,
            })?;
            self.map_section(range, section, offset, prot)?;
            views += 1;
            i = j;
        }
        Ok(views)
    }

    /// Holds `range`: until the [`Hold`] is dropped, the space stays alive (the hold keeps an
    /// `Arc` of it) and a decommit or a section mapping over any held page is refused with
    /// [`SpaceError::Held`] naming the range, so the pages stay mapped. Protection may still
    /// change (it is the guest's), and bytes may be zeroed in place. Holds may overlap. For
    /// whoever hands the pages to a device (a GPU import) that reads and writes them through
    /// their host address.
    pub fn hold(self: &Arc<Self>, range: GuestRange) -> Result<Hold, SpaceError> {
        self.check(range)?;
        let mut st = self.state();
        let id = st.next_hold;
        st.next_hold += 1;
        st.holds.insert(id, (range.start().0, range.end().0));
        Ok(Hold { space: self.clone(), id, range })
    }

    /// Adds an observer of the space's changes (held weakly: it goes when it is dropped).
    pub fn observe(&self, observer: Weak<dyn Observer>) {
        self.state().observers.push(observer);
    }

    /// Runs `f` on the allocations and views over `range` with the space's lock held, so no
    /// commit, release or remap happens until it returns. `f` must not call back into the space.
    pub fn with_layout<R>(&self, range: GuestRange, f: impl FnOnce(&Layout) -> R) -> R {
        self.with_layout_in(range, &mut Layout::default(), f)
    }

    /// [`Space::with_layout`] filling the caller's `layout` (cleared first), so that a caller
    /// that keeps one allocates nothing once its vectors have grown.
    pub fn with_layout_in<R>(&self, range: GuestRange, layout: &mut Layout, f: impl FnOnce(&Layout) -> R) -> R {
        let st = self.state();
        let (a, b) = (range.start().0, range.end().0);
        layout.allocations.clear();
        layout.views.clear();
        layout.allocations.extend(st.extents.overlapping(a, b).map(|(s, e, g)| allocation(s, e, *g)));
        layout.views.extend(st.views.overlapping(a, b).map(|(s, e, v)| view(s, e, v)));
        layout.aliases.clear();
        layout.aliased_inside = false;
        if !layout.views.is_empty() {
            aliases(&st.views, a, b, layout);
        }
        f(layout)
    }

    /// The shared views, in address order.
    pub fn views(&self) -> Vec<View> {
        let st = self.state();
        st.views.iter().map(|(s, e, v)| view(s, e, v)).collect()
    }

    /// The shared views that overlap `range`, unclipped.
    pub fn views_in(&self, range: GuestRange) -> Vec<View> {
        let st = self.state();
        st.views.overlapping(range.start().0, range.end().0).map(|(s, e, v)| view(s, e, v)).collect()
    }

    /// How this space's region queries are answered: `PROCMAP_QUERY`, or the text of
    /// `/proc/self/maps` where the kernel has no such ioctl (or fault injection asked for it).
    pub fn region_queries(&self) -> Result<QueryPath, SpaceError> {
        self.maps.path().map_err(|e| SpaceError::os("query regions", 0, self.window(), e))
    }

    /// What the kernel has mapped over `range` (clipped to it), region by region, as guest
    /// addresses: one region query (per region with `PROCMAP_QUERY`).
    pub fn kernel_regions(&self, range: GuestRange) -> Result<Vec<Region>, SpaceError> {
        let base = self.res.base();
        let regions = self.host_regions(range)?;
        Ok(regions.into_iter().map(|r| Region { start: r.start - base, end: r.end - base, ..r }).collect())
    }

    /// The kernel's regions over `range` (clipped to it), in host addresses: one region query.
    fn host_regions(&self, range: GuestRange) -> Result<Vec<Region>, SpaceError> {
        let (off, len) = self.check(range)?;
        let base = self.res.base();
        self.maps
            .regions(base + off, base + off + len)
            .map_err(|e| SpaceError::os("query regions", range.start().0, range.len(), e))
    }
}

impl Drop for Space {
    /// An adopted window goes back to the caller reserved: each run of pages the space committed,
    /// protected or mapped a view over is decommitted, as [`Space::decommit`] does (a run that
    /// holds a foreign mapping is left as it is, with a warning). A window the space reserved is
    /// unmapped with its guards, but for what it finds is not its own: a mapping foreign code put
    /// in a hole, or another space's reservation there.
    fn drop(&mut self) {
        if !self.res.adopted() {
            // Dead write-tracking tables over the window go first: a fault there from now on is on
            // memory mapped anew, never a tracker's.
            crate::sys::segv::unmapped(self.res.base(), self.res.base() + self.window() as usize);
            return self.unmap_own();
        }
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (a, b, _) in self.record().prots.iter() {
            match runs.last_mut() {
                Some(last) if last.1 == a => last.1 = b,
                _ => runs.push((a, b)),
            }
        }
        for (a, b) in runs {
            let run = GuestRange::from_bounds(a, b).expect("the record is page-aligned");
            if let Err(e) = self.decommit(run) {
                tracing::warn!("dropping an adopted window: {run} is left as it is: {e}");
            }
        }
    }
}

impl Space {
    /// Unmaps what of its mapping (window and guards) the space made: one region query over the
    /// whole mapping; a region it cannot have made stays mapped (with a debug line), and so does
    /// another space's reservation. Where the query fails the reservation's drop unmaps all but
    /// other spaces' reservations.
    fn unmap_own(&self) {
        // A fork's child: its region queries would read the parent's map (the reservation's drop
        // unmaps the child's copy).
        if self.same_process().is_err() {
            return;
        }
        let (lo, hi) = self.res.mapping();
        let Ok(regions) = self.maps.regions(lo, hi) else { return };
        let (base, end) = (self.res.base(), self.res.base() + self.window() as usize);
        let rec = self.record();
        let mut own: Vec<(usize, usize)> = Vec::new();
        for r in &regions {
            // The guards' parts must be reserved pages; the window's what the record says.
            let (ws, we) = (r.start.max(base), r.end.min(end));
            let reserved = !r.read && !r.write && !r.exec && !r.shared && !r.file;
            let guard_ok = reserved || (r.start >= ws && r.end <= we);
            let window_ok = ws >= we || rec.foreign((ws - base) as u64, (we - base) as u64, r).is_none();
            if guard_ok && window_ok {
                match own.last_mut() {
                    Some(last) if last.1 == r.start => last.1 = r.end,
                    _ => own.push((r.start, r.end)),
                }
            } else {
                tracing::debug!("dropping the space: {:#x}..{:#x} is not its own; left mapped", r.start, r.end);
            }
        }
        let mut parts = Vec::new();
        for (mut at, e) in own {
            for (x, y) in self.res.later_within(at, e) {
                parts.push((at, x));
                at = y;
            }
            parts.push((at, e));
        }
        parts.retain(|(s, e)| s < e);
        self.res.unmap_parts(&parts);
    }
}

/// The error of a reservation at host `start..end` that failed with `source`: where something is
/// mapped there (`EEXIST`), [`SpaceError::Exists`] naming the first mapping (one region query).
fn reserve_at_failed(start: u64, end: u64, source: std::io::Error, config: &SpaceConfig) -> SpaceError {
    if source.raw_os_error() != Some(libc::EEXIST) {
        return SpaceError::ReserveAt { start, end, source };
    }
    let first = Maps::open(config.maps_text || crate::faults::no_procmap_query())
        .and_then(|maps| maps.regions(start as usize, end as usize))
        .ok()
        .and_then(|regions| regions.into_iter().next());
    let found = match first {
        Some(r) => {
            let prot = Prot { read: r.read, write: r.write, exec: r.exec };
            let kind = if r.file { "file" } else { "anonymous" };
            let shared = if r.shared { "shared" } else { "private" };
            format!("{:#x}..{:#x} is mapped there (a {prot:?} {shared} {kind} mapping)", r.start, r.end)
        }
        None => "something is mapped there".to_string(),
    };
    SpaceError::Exists { start, end, found }
}

/// Why the kernel's `regions` over host `a..b` (clipped, in address order) are not one
/// reservation (mapped entirely, `PROT_NONE`, private, anonymous), if they are not.
fn not_a_reservation(regions: &[Region], a: usize, b: usize) -> Option<String> {
    let mut at = a;
    for r in regions {
        if r.start > at {
            return Some(format!("nothing is mapped at {at:#x}..{:#x}", r.start));
        }
        if r.read || r.write || r.exec || r.shared || r.file {
            let prot = Prot { read: r.read, write: r.write, exec: r.exec };
            let kind = if r.file { "file" } else { "anonymous" };
            let shared = if r.shared { "shared" } else { "private" };
            return Some(format!(
                "{:#x}..{:#x} is a {prot:?} {shared} {kind} mapping, not a PROT_NONE private anonymous reservation",
                r.start, r.end
            ));
        }
        at = at.max(r.end);
    }
    (at < b).then(|| format!("nothing is mapped at {at:#x}..{b:#x}"))
}

/// Guest pages held mapped ([`Space::hold`]); dropping it lets them go.
#[derive(Debug)]
pub struct Hold {
    space: Arc<Space>,
    id: u64,
    range: GuestRange,
}

impl Hold {
    /// The pages held.
    pub fn range(&self) -> GuestRange {
        self.range
    }

    /// The space they are in.
    pub fn space(&self) -> &Arc<Space> {
        &self.space
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.space.state().holds.remove(&self.id);
    }
}

/// The first part of `a..b` that `map` has no entry over, if any.
fn first_gap<V: Clone>(map: &RangeMap<V>, a: u64, b: u64) -> Option<(u64, u64)> {
    let mut at = a;
    for (s, e, _) in map.overlapping(a, b) {
        if s > at {
            return Some((at, s));
        }
        at = at.max(e);
    }
    (at < b).then_some((at, b))
}

/// Whether `regions` (in address order, clipped to `a..b`) leave no hole in host `a..b`.
fn covers(regions: &[Region], a: usize, b: usize) -> bool {
    let mut at = a;
    for r in regions {
        if r.start > at {
            return false;
        }
        at = at.max(r.end);
    }
    at >= b
}

fn allocation(s: u64, e: u64, generation: u64) -> Allocation {
    Allocation { range: GuestRange::from_bounds(s, e).expect("extents are page-aligned"), generation }
}

/// Fills `layout.aliases`: the parts outside `a..b` of every view that shows section bytes a view
/// of `layout.views` shows inside `a..b`. One pass over every view, made only where the range
/// holds views.
fn aliases(views: &RangeMap<ViewEntry>, a: u64, b: u64, layout: &mut Layout) {
    // The section bytes shown inside the range: (section, first offset, end offset).
    let mut inside: Vec<(SectionId, u64, u64)> = layout
        .views
        .iter()
        .map(|v| {
            let (s, e) = (v.range.start().0.max(a), v.range.end().0.min(b));
            let off = v.offset + (s - v.range.start().0);
            (v.section, off, off + (e - s))
        })
        .collect();
    inside.sort_unstable();
    layout.aliased_inside = inside.windows(2).any(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2);
    for (s, e, v) in views.iter() {
        for (x, y) in [(s, e.min(a)), (s.max(b), e)] {
            if x >= y {
                continue;
            }
            let off = v.offset + (x - s);
            let shown = (off, off + (y - x));
            if inside.iter().any(|&(sec, o, p)| sec == v.section && o < shown.1 && shown.0 < p) {
                layout.aliases.push(view(x, y, &ViewEntry { section: v.section, offset: off }));
            }
        }
    }
}

fn view(s: u64, e: u64, v: &ViewEntry) -> View {
    View { range: GuestRange::from_bounds(s, e).expect("views are page-aligned"), section: v.section, offset: v.offset }
}
