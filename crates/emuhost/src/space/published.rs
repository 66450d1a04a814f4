//! The layout the space publishes: its allocations and views as an immutable snapshot, swapped in
//! under the space's lock before every change is told, and the ranges of the changes in flight.
//! A write tracker's collect reads them without the space's lock, so it never waits behind a
//! change that waits in the kernel (see docs/watch.md, "The published layout", for why a collect
//! that reads them loses no write).
//!
//! Off until a tracker asks for it ([`Space::publish_layout`]): a space nobody collects copies
//! nothing.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use super::layout::{aliases, allocation, view};
use super::ranges::RangeMap;
use super::sections::ViewEntry;
use super::{Change, GuestRange, Layout, Space, State};

/// The space's allocations (extents with generations) and views, as of one moment under its lock.
#[derive(Debug, Default)]
pub(super) struct Snapshot {
    extents: RangeMap<u64>,
    views: RangeMap<ViewEntry>,
}

/// What the space publishes: the latest snapshot, and the changes of the mappings in flight, each
/// `(id, start, end)`: marked under the space's lock before the change's first system call (and
/// before it tells its observers of anything), unmarked after its last observer was told.
#[derive(Debug, Default)]
pub(super) struct Published {
    layout: Arc<Snapshot>,
    changing: Vec<(u64, u64, u64)>,
    next_id: u64,
}

/// A change of `start..end` in flight, marked in the published layout until it drops
/// ([`Space::begin_change`]).
#[must_use = "the change is marked only while the guard lives"]
pub(super) struct InFlight<'a> {
    space: &'a Space,
    id: Option<u64>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.space.published().changing.retain(|c| c.0 != id);
        }
    }
}

impl Space {
    fn published(&self) -> MutexGuard<'_, Published> {
        // A leaf lock: held for a pointer copy or a push, never across a system call or another
        // lock.
        self.published.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publishing(&self) -> bool {
        self.publishing.load(Ordering::Acquire)
    }

    /// Publishes the layout from now on ([`Space::published_layout_in`]); once on, it stays on.
    pub(crate) fn publish_layout(&self) {
        let st = self.state();
        self.publishing.store(true, Ordering::Release);
        self.publish(&st);
    }

    /// Publishes `st`'s layout (under the space's lock, before observers are told of the change
    /// that made it). The old snapshot is dropped outside the leaf lock.
    pub(super) fn publish(&self, st: &State) {
        if !self.publishing() {
            return;
        }
        let snap = Arc::new(Snapshot { extents: st.extents.clone(), views: st.views.clone() });
        let old = std::mem::replace(&mut self.published().layout, snap);
        drop(old);
    }

    /// Marks a change of `a..b` in flight (with the space's lock held, before its first system
    /// call), until the guard drops (after its last observer was told).
    pub(super) fn begin_change(&self, a: u64, b: u64) -> InFlight<'_> {
        if !self.publishing() {
            return InFlight { space: self, id: None };
        }
        let mut p = self.published();
        let id = p.next_id;
        p.next_id += 1;
        p.changing.push((id, a, b));
        InFlight { space: self, id: Some(id) }
    }

    /// Marks a change of `range` in flight ([`Space::begin_change`]) over `range` and the views it
    /// cuts where the OS maps their kept parts anew ([`State::cut_views`]), then, unless the
    /// change is a release (whose `Releasing` comes next), tells the observers it is coming
    /// ([`Change::Changing`]; `remaps`: the range is mapped anew).
    pub(super) fn begin<'a>(&'a self, st: &mut State, range: GuestRange, remaps: Option<bool>) -> InFlight<'a> {
        let (mut a, mut b) = (range.start().0, range.end().0);
        for (x, y) in st.cut_views(a, b) {
            (a, b) = (a.min(x), b.max(y));
        }
        let guard = self.begin_change(a, b);
        if let Some(remaps) = remaps {
            st.tell(self, Change::Changing { range, remaps });
        }
        guard
    }

    /// The published layout over `range` into `layout` (cleared first), as
    /// [`Space::with_layout_in`] reads it under the lock, and into `changing` (cleared first) the
    /// ranges of the changes in flight that overlap `range`, clipped to it. Takes no lock but the
    /// leaf one the publisher holds for a pointer copy, so it never waits for a change.
    pub(crate) fn published_layout_in(&self, range: GuestRange, layout: &mut Layout, changing: &mut Vec<(u64, u64)>) {
        let (a, b) = (range.start().0, range.end().0);
        let snap = {
            let p = self.published();
            changing.clear();
            changing.extend(p.changing.iter().filter_map(|&(_, s, e)| {
                let (x, y) = (s.max(a), e.min(b));
                (x < y).then_some((x, y))
            }));
            p.layout.clone()
        };
        layout.allocations.clear();
        layout.views.clear();
        layout.allocations.extend(snap.extents.overlapping(a, b).map(|(s, e, g)| allocation(s, e, *g)));
        layout.views.extend(snap.views.overlapping(a, b).map(|(s, e, v)| view(s, e, v)));
        layout.aliases.clear();
        layout.aliased_inside = false;
        if !layout.views.is_empty() {
            aliases(&snap.views, a, b, layout);
        }
    }

    /// Whether a change in flight overlaps `a..b` now.
    pub(crate) fn changing_over(&self, a: u64, b: u64) -> bool {
        self.published().changing.iter().any(|&(_, s, e)| s < b && a < e)
    }

    /// Whether the space publishes its layout (a write tracker asked for it: see
    /// [`crate::watch::TrackerConfig::published_layout`]).
    pub fn publishes_layout(&self) -> bool {
        self.publishing()
    }
}
