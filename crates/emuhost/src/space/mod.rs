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
//!
//! The calls named above are Linux's. On Windows the window is one placeholder
//! (`VirtualAlloc2`, `MEM_RESERVE_PLACEHOLDER`) where the system has them, else a
//! `MEM_WRITE_WATCH` reservation; commits are private allocations carved out of it, sections are
//! pagefile-backed file mappings and views `MapViewOfFile3` views: docs/windows.md lists every
//! call and what differs (a view over part of a committed allocation holding data is refused).

mod access;
mod changing;
mod commit;
mod config;
mod drop;
mod error;
mod layout;
mod lock_wait;
mod published;
pub mod ranges;
mod record;
mod sections;
mod types;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

pub use changing::{Changing, LongRead, OwnedChanging, OwnedLongRead};
pub use commit::CommitPath;
pub use config::{DEFAULT_WINDOW, Placement, SpaceConfig};
pub use error::SpaceError;
pub use layout::{Allocation, Change, Layout, Observer, View};
pub use lock_wait::{LockWaits, lock_waits, take_lock_waits};
pub use sections::SectionId;
pub use types::{GuestAddr, GuestRange, Prot, page_size};

pub use crate::sys::query::{QueryPath, Region};
use crate::sys::{mm::Reservation, query::Maps};
use ranges::RangeMap;
use record::Record;
use sections::{Section, ViewEntry};

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

    /// Tells the observers of `change`. A change that made the layout what it is now publishes it
    /// first ([`Space::publish`]), so a collect that sees an observer's work sees the layout too.
    fn tell(&mut self, space: &Space, change: Change) {
        if let Change::Committed { .. } | Change::Released { .. } | Change::Mapped { .. } = change {
            space.publish(self);
        }
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

    /// The parts outside `a..b` of the views `a..b` cuts, where the OS maps them anew
    /// (`sys::mm::CUTS_REMAP`: Windows unmaps a view whole): an operation over `a..b` tells its
    /// observers they were mapped ([`Space::tell_remapped`]). Empty on Linux.
    fn cut_views(&self, a: u64, b: u64) -> Vec<(u64, u64)> {
        if !crate::sys::mm::CUTS_REMAP {
            return Vec::new();
        }
        let mut kept = Vec::new();
        for (s, e, _) in self.views.overlapping(a, b) {
            kept.extend([(s, a.min(e)), (b.max(s), e)].into_iter().filter(|(x, y)| x < y));
        }
        kept
    }

    /// Tells the observers that the `kept` parts of cut views ([`State::cut_views`]) were mapped
    /// anew, each run with its protection in `prots`.
    fn tell_remapped(&mut self, space: &Space, prots: &RangeMap<Prot>, kept: &[(u64, u64)]) {
        for &(x, y) in kept {
            let runs: Vec<(u64, u64, Prot)> =
                prots.overlapping(x, y).map(|(s, e, p)| (s.max(x), e.min(y), *p)).collect();
            for (s, e, prot) in runs {
                if let Ok(range) = GuestRange::from_bounds(s, e) {
                    self.tell(space, Change::Mapped { range, prot });
                }
            }
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

/// The guest address space: one reservation for the whole guest window, and the pages committed,
/// protected and shared inside it (see the [module docs](self)).
///
/// Guest memory is reached through [`Space::write`], [`Space::read`] and [`Space::store`], which
/// fail instead of faulting, or raw through [`Space::host_addr`]. A `Space` is `Send + Sync`;
/// write trackers and GPU imports keep it in an `Arc`.
///
/// ```
/// use emuhost::space::{GuestAddr, Prot, Space, SpaceError, page_size};
///
/// // Reserve a 16 MiB window: address space only, nothing committed.
/// let space = Space::with_window(16 << 20)?;
/// let page = page_size();
/// let range = space.range(4 * page, 2 * page)?;
/// assert_eq!(space.uncommitted(range), Some(range));
///
/// // Commit two pages read-write, then copy bytes in and out.
/// space.commit(range, Prot::READ_WRITE)?;
/// space.write(GuestAddr(4 * page + 10), b"guest")?;
/// let mut buf = [0u8; 5];
/// space.read(GuestAddr(4 * page + 10), &mut buf)?;
/// assert_eq!(&buf, b"guest");
///
/// // A page the space did not commit is an error naming it, never a fault.
/// let err = space.write(GuestAddr(6 * page), b"x").unwrap_err();
/// assert!(matches!(err, SpaceError::NotCommitted { .. }), "{err}");
///
/// // A decommit drops the bytes; the pages are reserved again.
/// space.decommit(range)?;
/// assert_eq!(space.uncommitted(range), Some(range));
/// # Ok::<(), SpaceError>(())
/// ```
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
    /// Threads waiting for `state` now ([`Space::lock_waiters`]).
    lock_waiters: AtomicU32,
    /// The layout published for collects, and the changes in flight ([`published`]); a leaf lock.
    published: Mutex<published::Published>,
    /// Whether the layout is published ([`Space::publish_layout`]).
    publishing: AtomicBool,
    /// The process that made the space: its region queries read that process's memory map.
    pid: u32,
}

impl Space {
    /// An error unless this is the process that made the space: after `fork`, the child's copy
    /// would query the parent's memory map (the region queries' file was opened by the parent).
    pub(crate) fn same_process(&self) -> Result<(), SpaceError> {
        let now = std::process::id();
        if now == self.pid { Ok(()) } else { Err(SpaceError::OtherProcess { made_in: self.pid, now }) }
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

    /// Whether a shared view is mapped anywhere in the window now.
    pub fn has_views(&self) -> bool {
        self.state().views.iter().next().is_some()
    }

    /// The reservation, for a write tracker's backend that asks it for its allocations.
    #[cfg(windows)]
    pub(crate) fn reservation(&self) -> &Reservation {
        &self.res
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

    /// The space's lock (a wait for it is counted: [`lock_waits`]).
    fn state(&self) -> MutexGuard<'_, State> {
        self.lock_state()
    }

    /// The record, to change (after the state's lock).
    fn record_mut(&self) -> RwLockWriteGuard<'_, Record> {
        self.record.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The record, to read (no state lock needed).
    fn record(&self) -> RwLockReadGuard<'_, Record> {
        self.record.read().unwrap_or_else(|p| p.into_inner())
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

    /// The first live hold ([`Space::hold`]) that overlaps `range`, as the guest range it holds.
    pub(crate) fn held(&self, range: GuestRange) -> Option<GuestRange> {
        let (lo, hi) = self.state().held(range.start().0, range.end().0)?;
        GuestRange::from_bounds(lo, hi).ok()
    }
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
