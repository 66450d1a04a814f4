//! The allocations and views over a range as read under the space's lock, and the observers told
//! of every change.

use std::sync::Weak;

use super::ranges::RangeMap;
use super::sections::{SectionId, ViewEntry};
use super::{CommitPath, GuestRange, Prot, Space};

/// A private allocation: the extent of one commit, as later split by releases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// The guest pages it covers.
    pub range: GuestRange,
    /// Changes whenever the allocation's commit state changes (made, trimmed, split).
    pub generation: u64,
}

/// One shared view: `range` shows the section's bytes from `offset` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    /// The guest pages the view covers.
    pub range: GuestRange,
    /// The section it shows.
    pub section: SectionId,
    /// Byte offset into the section of the view's first page.
    pub offset: u64,
}

/// A change to the space's mappings, as told to observers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// `range` was committed with `prot`. With `CommitPath::RegionWalk` some of its mappings may be
    /// new (holes refilled).
    Committed {
        /// The pages committed.
        range: GuestRange,
        /// Their protection now.
        prot: Prot,
        /// How the commit went (one call, or region by region).
        path: CommitPath,
    },
    /// `range` was given `prot`.
    Protected {
        /// The pages protected.
        range: GuestRange,
        /// Their protection now.
        prot: Prot,
    },
    /// `range` is about to be released (told before the system call, while its pages are still
    /// there: a tracker keeps the writes to them).
    Releasing {
        /// The pages about to be released.
        range: GuestRange,
    },
    /// `range` was released: new reserved mappings replace it or, `in_place`, its private
    /// mappings stay, inaccessible and with their pages dropped (see
    /// [`Observer::keeps_mappings`]).
    Released {
        /// The pages released.
        range: GuestRange,
        /// Whether the private mappings were kept (inaccessible, pages dropped).
        in_place: bool,
    },
    /// A shared view was mapped over `range` with `prot` (a new mapping).
    Mapped {
        /// The pages the view covers.
        range: GuestRange,
        /// Their protection.
        prot: Prot,
    },
    /// `range` is about to be committed, protected or (`remaps`) mapped anew: told before the
    /// system call, once the change is marked in flight in the published layout. A tracker whose
    /// collects read the published layout waits here for a collect in progress where the change
    /// would race with it (see docs/watch.md, "The published layout").
    Changing {
        /// The pages about to change.
        range: GuestRange,
        /// Whether they are about to be mapped anew (a view, a release), not only re-protected.
        remaps: bool,
    },
}

/// Told of every change of the space's mappings, after the system call (a release before it too)
/// and with the space's lock held, so changes arrive in order and a layout read under the lock
/// sees them all. `watch` uses it to keep armed tracking across commits, protections and view
/// splits. An observer must not call back into the space.
pub trait Observer: Send + Sync {
    /// Called once per change, in order, with the space's lock held.
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
    /// The private allocations overlapping the range, unclipped, in address order.
    pub allocations: Vec<Allocation>,
    /// The shared views overlapping the range, unclipped, in address order.
    pub views: Vec<View>,
    /// The views outside the range that show section pages a view of the range shows too
    /// (aliases), each the part of a view outside the range, in address order.
    pub aliases: Vec<View>,
    /// Whether two views inside the range show the same section bytes.
    pub aliased_inside: bool,
}

impl Space {
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
}

pub(super) fn allocation(s: u64, e: u64, generation: u64) -> Allocation {
    Allocation { range: GuestRange::from_bounds(s, e).expect("extents are page-aligned"), generation }
}

/// Fills `layout.aliases`: the parts outside `a..b` of every view that shows section bytes a view
/// of `layout.views` shows inside `a..b`. One pass over every view, made only where the range
/// holds views.
pub(super) fn aliases(views: &RangeMap<ViewEntry>, a: u64, b: u64, layout: &mut Layout) {
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

pub(super) fn view(s: u64, e: u64, v: &ViewEntry) -> View {
    View { range: GuestRange::from_bounds(s, e).expect("views are page-aligned"), section: v.section, offset: v.offset }
}
