//! What the tracker does when the space changes: the observer it registers with the space.

use std::sync::{Mutex, MutexGuard};

use super::backend::{Backend, Runs};
use super::{BackendKind, Inner, add, clip};
use crate::space::{Change, CommitPath, GuestRange, Observer, Prot, Space};

/// What the space's observer and the tracker share. The space holds it weakly and may hold it
/// (while it tells a change) past the tracker's drop, so the tracker's `Drop`, which takes the
/// space's lock, never runs from inside the space.
pub(super) struct Core {
    pub(super) backend: Box<dyn Backend>,
    pub(super) inner: Mutex<Inner>,
    /// Whether collects read the space's published layout instead of taking its lock
    /// ([`crate::watch::TrackerConfig::published_layout`]).
    pub(super) published: bool,
}

impl Core {
    pub(super) fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Core {
    /// The space is about to release `range`: the writes to its armed pages are kept for the next
    /// collect (as Windows' write watch keeps them), since the release takes the record with it.
    fn releasing(&self, inner: &mut Inner, space: &Space, range: GuestRange) {
        let (a, b) = (range.start().0, range.end().0);
        let base = space.host_base();
        let pieces: Vec<(u64, u64)> = inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)).collect();
        for (s, e) in pieces {
            let mut runs = Vec::new();
            match self.backend.read(
                base + s as usize,
                base + e as usize,
                &mut Runs::new(&mut runs, base as u64, 0, None),
            ) {
                Ok(()) => {
                    for (x, y) in runs {
                        add(&mut inner.pending, x, y);
                    }
                }
                // Unreadable (released behind the space's back): report it all, so nothing is lost.
                Err(_) => add(&mut inner.pending, s, e),
            }
        }
    }
}

impl Observer for Core {
    // With uffd a release that keeps the mappings keeps their registration: the re-arm of the
    // released pages and a later arm of them register nothing. With write watch a decommit in
    // place keeps the allocation, and with it the pages' write watch.
    fn keeps_mappings(&self) -> bool {
        matches!(self.backend.kind(), BackendKind::Uffd | BackendKind::WriteWatch)
    }

    fn changed(&self, space: &Space, change: Change) {
        if let Change::Changing { remaps, .. } = change {
            // A change is about to make its system call, marked in flight. Where that call could
            // race with a collect that read the published layout before the mark (a mapping
            // replaced under its read; a protection the backend's own re-protect would undo),
            // wait for such a collect to end: collects hold the inner lock, and those that begin
            // after this one read the mark and leave the range alone (docs/watch.md, "The
            // published layout"). Under the space's lock, collects never run beside a change.
            if self.published && (remaps || self.backend.reprotects()) {
                drop(self.inner());
            }
            return;
        }
        let mut inner = self.inner();
        let (range, prot) = match change {
            Change::Releasing { range } => return self.releasing(&mut inner, space, range),
            Change::Committed { range, prot, .. }
            | Change::Protected { range, prot }
            | Change::Mapped { range, prot } => (range, prot),
            Change::Released { range, .. } => (range, Prot::NONE),
            Change::Changing { .. } => return,
        };
        let (a, b) = (range.start().0, range.end().0);
        // With mprotect, armed write-only pages look inaccessible (`---`): the guest's doing too.
        let hidden = if self.backend.kind().protects() { !prot.read && !prot.exec } else { prot == Prot::NONE };
        match change {
            Change::Released { .. } => inner.noaccess.remove(a, b, |_, _, _| ()),
            _ if hidden => add(&mut inner.noaccess, a, b),
            _ => inner.noaccess.remove(a, b, |_, _, _| ()),
        }
        if let Change::Released { .. } | Change::Mapped { .. } = change {
            inner.failed.retain(|s, (e, _)| *e <= a || *s >= b);
        }
        let host = |x: u64| space.host_base() + x as usize;
        let remapped = matches!(
            change,
            Change::Released { in_place: false, .. }
                | Change::Mapped { .. }
                | Change::Committed { path: CommitPath::RegionWalk { .. }, .. }
        );
        self.backend.owned(host(a), host(b), remapped);
        // Pages a disarm gave back and the space made unwritable since: their faults are the
        // guest's. A change that leaves them writable keeps them stale: a write that faulted
        // before the disarm may still be on its way to the handler, and its retry lands.
        if !prot.write {
            self.backend.unstale(host(a), host(b));
        }
        let pieces: Vec<(u64, u64)> = inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)).collect();
        for (s, e) in pieces {
            let (hs, he) = (host(s), host(e));
            let fresh =
                matches!(change, Change::Mapped { .. } | Change::Committed { path: CommitPath::RegionWalk { .. }, .. });
            let result = match change {
                Change::Released { in_place, .. } => self.backend.released(hs, he, in_place),
                _ if fresh => self.backend.remapped(hs, he, prot),
                _ => self.backend.protected(hs, he, prot),
            };
            match result {
                Ok(true) => add(&mut inner.pending, s, e),
                Ok(false) => {}
                // The tracking of these pages could not be kept: report them written, so nothing
                // is lost, and say so.
                Err(err) => {
                    tracing::warn!("write tracking: re-arming {s:#x}..{e:#x} after {change:?} failed: {err}");
                    add(&mut inner.pending, s, e);
                }
            }
            // Released pages are reported once when they are mapped again (their content is new),
            // whichever backend; the writes before the release stay pending (see `releasing`).
            if let Change::Released { .. } = change {
                add(&mut inner.unmapped, s, e);
            } else {
                let back: Vec<(u64, u64)> =
                    inner.unmapped.overlapping(s, e).filter_map(|(x, y, _)| clip(s, e, x, y)).collect();
                for (x, y) in back {
                    add(&mut inner.pending, x, y);
                }
                inner.unmapped.remove(s, e, |_, _, _| ());
            }
        }
    }
}
