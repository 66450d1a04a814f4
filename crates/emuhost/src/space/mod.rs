//! The guest address space: one reservation for the whole guest window, and what is done to
//! pages inside it.
//!
//! Underneath, the window is one anonymous `PROT_NONE`, `MAP_NORESERVE` mapping: address space
//! without memory or commit charge. A commit is one `mprotect` over the range (the kernel faults
//! pages in at first touch); where that call fails (a hole that foreign code unmapped inside the
//! window, say) the range is walked region by region, as the old way did, asking the kernel what
//! is mapped (`PROCMAP_QUERY`) and committing each region, filling holes with fresh pages. A
//! decommit maps fresh reserved pages over the range (one `mmap`), which drops the pages and any
//! shared view there. Shared memory is memfd sections; a run of consecutive section pages is one
//! `MAP_SHARED` view, and a release or remap of pages inside a run replaces only those pages, so
//! the kernel keeps every other page of the run as it was: bytes, protection and write-protect
//! bits alike.
//!
//! Guest memory is never lent out as Rust references: use [`Space::host_addr`] for raw access
//! (as a JIT or recompiled code does) or [`Space::write`]/[`Space::read`], which copy through the
//! page tables and fail (`EFAULT`) instead of faulting on a page the protection forbids.

mod error;
pub(crate) mod ranges;
mod types;

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

pub use error::SpaceError;
pub use types::{GuestAddr, GuestRange, Prot, page_size};

pub use crate::sys::query::Region;
use crate::sys::{mm::Reservation, query::Maps};
use ranges::RangeMap;

/// The default guest window: 512 GiB.
pub const DEFAULT_WINDOW: u64 = 512 << 30;

/// How a space is made.
#[derive(Clone, Debug)]
pub struct SpaceConfig {
    /// Bytes of guest address space to reserve (a multiple of the page size).
    pub window: u64,
    /// Commit in one system call, walking region by region only where it fails. `false` always
    /// walks (the old way; kept to measure against).
    pub one_call_commit: bool,
}

impl Default for SpaceConfig {
    fn default() -> Self {
        Self { window: DEFAULT_WINDOW, one_call_commit: true }
    }
}

impl SpaceConfig {
    pub fn window(mut self, bytes: u64) -> Self {
        self.window = bytes;
        self
    }

    pub fn one_call_commit(mut self, on: bool) -> Self {
        self.one_call_commit = on;
        self
    }

    pub fn build(self) -> Result<Space, SpaceError> {
        Space::new(self)
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
    /// `range` was released: new reserved mappings replace it.
    Released { range: GuestRange },
    /// A shared view was mapped over `range` with `prot` (a new mapping).
    Mapped { range: GuestRange, prot: Prot },
}

/// Told of every change of the space's mappings, after the system call (a release before it too)
/// and with the space's lock held, so changes arrive in order and a layout read under the lock
/// sees them all. `watch` uses it to keep armed tracking across commits, protections and view
/// splits. An observer must not call back into the space.
pub trait Observer: Send + Sync {
    fn changed(&self, space: &Space, change: Change);
}

/// The private allocations and shared views over a range, read under the space's lock.
#[derive(Debug)]
pub struct Layout {
    pub allocations: Vec<Allocation>,
    pub views: Vec<View>,
}

#[derive(Default)]
struct State {
    extents: RangeMap<u64>,
    views: RangeMap<ViewEntry>,
    sections: HashMap<SectionId, Section>,
    next_section: u64,
    generation: u64,
    observers: Vec<Weak<dyn Observer>>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("allocations", &self.extents.iter().count())
            .field("views", &self.views.iter().count())
            .finish()
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
}

impl Space {
    /// Reserves the window.
    pub fn new(config: SpaceConfig) -> Result<Self, SpaceError> {
        let page = page_size();
        if config.window == 0 || !config.window.is_multiple_of(page) || usize::try_from(config.window).is_err() {
            return Err(SpaceError::BadWindow { size: config.window, page });
        }
        let res = Reservation::new(config.window as usize)
            .map_err(|source| SpaceError::Reserve { size: config.window, source })?;
        let maps = Maps::open().map_err(|source| SpaceError::os("open /proc/self/maps", 0, 0, source))?;
        Ok(Self { res, maps, one_call_commit: config.one_call_commit, state: Mutex::new(State::default()) })
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
        Ok((r.start().0 as usize, r.len() as usize))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held cannot leave the maps half-updated in a way that makes
        // them unsafe to read: keep going with what is there.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Commits `range` with `prot`. Pages already committed keep their bytes; their protection is
    /// set to `prot` again. Shared views in the range are re-protected too, but stay views (the
    /// private allocation map records only the private parts).
    ///
    /// A commit that fails leaves the pages as they were: the regions the walk committed before
    /// the one that failed get their protection back. Where even that fails, the pages left
    /// committed are recorded and told to observers as a commit (so a tracker reports them
    /// written rather than lose their writes).
    pub fn commit(&self, range: GuestRange, prot: Prot) -> Result<CommitPath, SpaceError> {
        let (off, len) = self.check(range)?;
        let mut st = self.state();
        let path = match self.one_call_commit.then(|| self.res.commit(off, len, prot.raw())) {
            Some(Ok(())) => CommitPath::OneCall,
            first => {
                if let Some(Err(e)) = first {
                    tracing::debug!("commit of {range}: one call failed ({e}); walking it region by region");
                }
                match self.commit_by_regions(off, len, prot) {
                    Ok(path) => path,
                    Err((source, left)) => {
                        let base = self.res.base();
                        for (s, e) in left {
                            let part = GuestRange::from_bounds((s - base) as u64, (e - base) as u64)
                                .expect("regions are page-aligned");
                            tracing::warn!("commit of {range} failed and {part} stays committed: recorded as such");
                            let path = CommitPath::RegionWalk { regions: 1, holes: 0 };
                            self.record_commit(&mut st, part, prot, path);
                        }
                        return Err(SpaceError::os("commit", range.start().0, range.len(), source));
                    }
                }
            }
        };
        self.record_commit(&mut st, range, prot, path);
        Ok(path)
    }

    /// Records a commit that was made: extents and observers.
    fn record_commit(&self, st: &mut State, range: GuestRange, prot: Prot, path: CommitPath) {
        let gen_ = st.next_generation();
        let (a, b) = (range.start().0, range.end().0);
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

    /// The old way: ask the kernel region by region and commit each region on its own; a gap
    /// with nothing mapped (released behind the space's back) gets fresh pages. Where a region
    /// fails, those done before it are put back as they were (their protection; a filled hole
    /// reserved again); the error comes with the host ranges that could not be put back.
    fn commit_by_regions(
        &self,
        off: usize,
        len: usize,
        prot: Prot,
    ) -> Result<CommitPath, (std::io::Error, Vec<(usize, usize)>)> {
        let base = self.res.base();
        let (start, end) = (base + off, base + off + len);
        let (mut regions, mut holes) = (0, 0);
        // What was done: host range and its protection before (`None`: a hole filled).
        let mut done: Vec<(usize, usize, Option<crate::sys::mm::RawProt>)> = Vec::new();
        let mut at = start;
        let walked = (|| {
            while at < end {
                match self.maps.query(at)? {
                    Some(r) if r.start <= at => {
                        let to = r.end.min(end);
                        self.res.commit(at - base, to - at, prot.raw())?;
                        let before = crate::sys::mm::RawProt { read: r.read, write: r.write, exec: r.exec };
                        done.push((at, to, Some(before)));
                        regions += 1;
                        at = to;
                    }
                    next => {
                        let to = next.map_or(end, |r| r.start.min(end));
                        self.res.fill_hole(at - base, to - at, prot.raw())?;
                        done.push((at, to, None));
                        holes += 1;
                        at = to;
                    }
                }
            }
            Ok(())
        })();
        match walked {
            Ok(()) => Ok(CommitPath::RegionWalk { regions, holes }),
            Err(e) => {
                let mut left = Vec::new();
                for (s, t, before) in done.into_iter().rev() {
                    let undone = match before {
                        Some(p) => self.res.commit(s - base, t - s, p),
                        None => self.res.reset(s - base, t - s),
                    };
                    if let Err(u) = undone {
                        tracing::warn!("commit walk: putting {:#x}..{:#x} back failed: {u}", s - base, t - base);
                        left.push((s, t));
                    }
                }
                left.reverse();
                Err((e, left))
            }
        }
    }

    /// Decommits (releases) `range`: its pages are dropped and it is reserved again. Private
    /// allocations and shared views that run across its ends are split; the rest of them keep
    /// their pages. Pages under a live GPU import must not be released: [`Space::zero`] them.
    pub fn decommit(&self, range: GuestRange) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        let mut st = self.state();
        st.tell(self, Change::Releasing { range });
        self.res.reset(off, len).map_err(|e| SpaceError::os("decommit", range.start().0, range.len(), e))?;
        st.forget(range.start().0, range.end().0);
        st.tell(self, Change::Released { range });
        Ok(())
    }

    /// Zeroes `range` in place: the pages stay mapped and committed (so a GPU import of them keeps
    /// seeing the same pages), unlike [`Space::decommit`].
    pub fn zero(&self, range: GuestRange) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        self.res.zero(off, len).map_err(|e| SpaceError::os("zero", range.start().0, range.len(), e))
    }

    /// Sets the protection of committed pages in `range` (one `mprotect`).
    pub fn protect(&self, range: GuestRange, prot: Prot) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        let mut st = self.state();
        self.res
            .protect(off, len, prot.raw())
            .map_err(|e| SpaceError::os("protect", range.start().0, range.len(), e))?;
        st.tell(self, Change::Protected { range, prot });
        Ok(())
    }

    /// Faults the pages of `range` in, writable, ahead of use (`MADV_POPULATE_WRITE`), so that a
    /// later GPU import pays for pinning only, not for first-touch faults. The pages must be
    /// committed writable.
    pub fn populate(&self, range: GuestRange) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        self.res.populate_write(off, len).map_err(|e| SpaceError::os("populate", range.start().0, range.len(), e))
    }

    /// Copies `data` into guest memory at `addr` (any alignment). An error, never a fault, where
    /// a page is not writable or outside the window.
    pub fn write(&self, addr: GuestAddr, data: &[u8]) -> Result<(), SpaceError> {
        let len = data.len() as u64;
        self.check_bytes(addr, len)?;
        self.res.write(addr.0 as usize, data).map_err(|e| SpaceError::os("write", addr.0, len, e))
    }

    /// Stores `data` at `addr` with the CPU, as guest code would. A page the protection forbids
    /// faults (`SIGSEGV`): a write tracker handles the faults of its armed pages; any other is
    /// fatal, as it would be for the guest. Use [`Space::write`] for a write that must not fault.
    pub fn store(&self, addr: GuestAddr, data: &[u8]) -> Result<(), SpaceError> {
        let len = data.len() as u64;
        self.check_bytes(addr, len)?;
        self.res.store(addr.0 as usize, data).map_err(|e| SpaceError::os("store", addr.0, len, e))
    }

    /// Copies guest memory at `addr` into `buf`. An error, never a fault, where a page is not
    /// readable or outside the window.
    pub fn read(&self, addr: GuestAddr, buf: &mut [u8]) -> Result<(), SpaceError> {
        let len = buf.len() as u64;
        self.check_bytes(addr, len)?;
        self.res.read(addr.0 as usize, buf).map_err(|e| SpaceError::os("read", addr.0, len, e))
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
        let mut st = self.state();
        let sec = st.sections.get(&section).ok_or(SpaceError::NoSection(section.0))?;
        GuestRange::new(GuestAddr(offset), range.len())?;
        if offset.checked_add(range.len()).is_none_or(|end| end > sec.size) {
            return Err(SpaceError::PastSection { section: section.0, offset, len: range.len(), size: sec.size });
        }
        let fd = sec.fd.clone();
        self.res
            .map_shared(off, len, &fd, offset, prot.raw())
            .map_err(|e| SpaceError::os("map section", range.start().0, range.len(), e))?;
        st.forget(range.start().0, range.end().0);
        st.views.insert(range.start().0, range.end().0, ViewEntry { section, offset });
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

    /// Adds an observer of the space's changes (held weakly: it goes when it is dropped).
    pub fn observe(&self, observer: Weak<dyn Observer>) {
        self.state().observers.push(observer);
    }

    /// Runs `f` on the allocations and views over `range` with the space's lock held, so no
    /// commit, release or remap happens until it returns. `f` must not call back into the space.
    pub fn with_layout<R>(&self, range: GuestRange, f: impl FnOnce(&Layout) -> R) -> R {
        let st = self.state();
        let (a, b) = (range.start().0, range.end().0);
        let layout = Layout {
            allocations: st.extents.overlapping(a, b).map(|(s, e, g)| allocation(s, e, *g)).collect(),
            views: st.views.overlapping(a, b).map(|(s, e, v)| view(s, e, v)).collect(),
        };
        f(&layout)
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

    /// What the kernel has mapped over `range` (clipped to it), region by region, as guest
    /// addresses: one region query per region.
    pub fn kernel_regions(&self, range: GuestRange) -> Result<Vec<Region>, SpaceError> {
        let (off, len) = self.check(range)?;
        let base = self.res.base();
        let regions = self
            .maps
            .regions(base + off, base + off + len)
            .map_err(|e| SpaceError::os("query regions", range.start().0, range.len(), e))?;
        Ok(regions.into_iter().map(|r| Region { start: r.start - base, end: r.end - base, ..r }).collect())
    }
}

fn allocation(s: u64, e: u64, generation: u64) -> Allocation {
    Allocation { range: GuestRange::from_bounds(s, e).expect("extents are page-aligned"), generation }
}

fn view(s: u64, e: u64, v: &ViewEntry) -> View {
    View { range: GuestRange::from_bounds(s, e).expect("views are page-aligned"), section: v.section, offset: v.offset }
}
