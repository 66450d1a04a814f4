//! Writes by the host through the kernel over armed pages: their preparation, begin and end.

use std::sync::Arc;

use super::read::split;
use super::{Inner, Tracker, WatchError, add, clip};
use crate::errors::error_chain as chain;
use crate::space::GuestRange;
#[cfg(doc)]
use crate::space::Space;

impl Tracker {
    /// Makes the armed pages of `range` writable by the host (a `read(2)` into guest memory, a
    /// copy by the kernel) and reports them written at the next collect. With the mprotect backend
    /// such a write would fail with `EFAULT` otherwise; the other backends need nothing.
    ///
    /// A collect on another thread between this and the write arms the pages again (and the
    /// write fails): use [`Tracker::host_write`] where collects run concurrently.
    pub fn prepare_host_write(&self, range: GuestRange) -> Result<(), WatchError> {
        self.same_process()?;
        let range = self.space.range(range.start().0, range.len())?;
        self.space.with_layout(range, |_| self.prepare_locked(&self.inner(), range))
    }

    fn prepare_locked(&self, inner: &Inner, range: GuestRange) -> Result<(), WatchError> {
        let (a, b) = (range.start().0, range.end().0);
        for (s, e, _) in inner.armed.overlapping(a, b) {
            let (s, e) = clip(a, b, s, e).expect("overlapping");
            self.core
                .backend
                .prepare_host_write(self.host(s), self.host(e))
                .map_err(|err| self.os("prepare", range, err))?;
        }
        Ok(())
    }

    /// Runs `write`, a write by the host through the kernel over `range` ([`Space::write`],
    /// [`Space::populate`], [`Space::zero`], a `read(2)` into guest memory), with the armed pages
    /// there prepared for it as [`Tracker::prepare_host_write`] does. No lock is held while `write`
    /// runs, so it may block (a `read(2)` from a pipe another thread feeds) and collect, commit or
    /// protect on any thread go on meanwhile. Where the backend needs the preparation (mprotect),
    /// until `write` returns a collect reports the pages of `range` as written and leaves them
    /// writable, and an arm there waits for its end (every collect meanwhile reports the pages it
    /// covers too, since they stay writable and untracked); the next collect after it reads them
    /// as usual.
    /// The other backends need nothing and record nothing.
    pub fn host_write<R>(&self, range: GuestRange, write: impl FnOnce() -> R) -> Result<R, WatchError> {
        let hosting = self.begin_host_write(range)?;
        let _end = hosting.map(|range| HostWriteEnd { tracker: self, range });
        Ok(write())
    }

    /// [`Tracker::host_write`] as a begin and an end, for a caller that cannot pass a closure
    /// (the C API's `emuhost_tracker_host_write_begin`): the host's write may be made while the
    /// guard lives, and its drop ends it. The guard keeps the tracker alive.
    pub fn host_write_owned(self: &Arc<Self>, range: GuestRange) -> Result<OwnedHostWrite, WatchError> {
        let range = self.begin_host_write(range)?;
        Ok(OwnedHostWrite { tracker: self.clone(), range })
    }

    /// Whether a host write over armed pages needs [`Tracker::host_write`]'s preparation with
    /// this backend (mprotect's and guard's write protection); with the others it only checks
    /// the range and the process.
    pub(crate) fn host_write_prepares(&self) -> bool {
        self.core.backend.needs_host_write_prepare()
    }

    /// Prepares `range` for a host write where the backend needs it: the range to end then.
    fn begin_host_write(&self, range: GuestRange) -> Result<Option<GuestRange>, WatchError> {
        self.same_process()?;
        let range = self.space.range(range.start().0, range.len())?;
        if !self.core.backend.needs_host_write_prepare() {
            return Ok(None);
        }
        self.space.with_layout(range, |_| {
            let mut inner = self.inner();
            self.prepare_locked(&inner, range)?;
            inner.hosting.push((range.start().0, range.end().0));
            Ok::<(), WatchError>(())
        })?;
        Ok(Some(range))
    }
}

/// Ends a host write in flight (also when its closure panics): arms what an arm deferred to it.
struct HostWriteEnd<'a> {
    tracker: &'a Tracker,
    range: GuestRange,
}

impl Drop for HostWriteEnd<'_> {
    fn drop(&mut self) {
        self.tracker.end_host_write(self.range);
    }
}

/// A host write in flight ([`Tracker::host_write_owned`]), ended when it drops. It keeps its
/// tracker alive.
pub struct OwnedHostWrite {
    tracker: Arc<Tracker>,
    /// `None` where the backend needed no preparation.
    range: Option<GuestRange>,
}

impl std::fmt::Debug for OwnedHostWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedHostWrite").field("range", &self.range).finish()
    }
}

impl Drop for OwnedHostWrite {
    fn drop(&mut self) {
        if let Some(range) = self.range {
            self.tracker.end_host_write(range);
        }
    }
}

impl Tracker {
    /// Ends the host write of `range` begun by [`Tracker::begin_host_write`].
    fn end_host_write(&self, range: GuestRange) {
        let t = self;
        let (a, b) = (range.start().0, range.end().0);
        t.space.with_layout(range, |_| {
            let mut inner = t.inner();
            if let Some(i) = inner.hosting.iter().position(|h| *h == (a, b)) {
                inner.hosting.swap_remove(i);
            }
            let due: Vec<(u64, u64)> = inner
                .deferred
                .overlapping(a, b)
                .filter_map(|(s, e, _)| clip(a, b, s, e))
                .flat_map(|(s, e)| split(s, e, &inner.hosting).0)
                .collect();
            if due.is_empty() {
                return;
            }
            let armed = t.space.kernel_regions(range).map_err(WatchError::from).and_then(|regions| {
                for &(s, e) in &due {
                    inner.deferred.remove(s, e, |_, _, _| ());
                    // The host may have written them: report them once.
                    add(&mut inner.pending, s, e);
                    let part = GuestRange::from_bounds(s, e)?;
                    t.arm_locked(&mut inner, part, &regions)?;
                }
                Ok(())
            });
            if let Err(e) = armed {
                tracing::warn!("write tracking: arming {range} after a host write failed: {}", chain(&e));
            }
        });
    }
}
