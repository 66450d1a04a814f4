//! Commits, decommits, protections, populates and zeroes, and the region-by-region walk where a
//! commit in one call fails.

use super::record::{Record, covers};
use super::{Change, GuestRange, Prot, Region, Space, SpaceError, State};

/// How a commit was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitPath {
    /// One `mprotect` over the whole range.
    OneCall,
    /// Region by region: `regions` kernel regions committed, `holes` unmapped gaps refilled.
    RegionWalk {
        /// Kernel regions committed (one system call each).
        regions: u64,
        /// Unmapped gaps refilled with fresh pages.
        holes: u64,
    },
}

impl Space {
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
        let _in_flight = self.begin(st, range, Some(false));
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

    /// A commit's `mprotect` (a call fault injection may fail with `ENOMEM`).
    fn commit_call(&self, off: usize, len: usize, prot: Prot) -> std::io::Result<()> {
        if crate::faults::fail_commit_call() {
            return Err(crate::sys::codes::no_memory());
        }
        self.res.protect(off, len, prot.raw())
    }

    /// A commit's `mmap` of a hole, which never replaces a mapping (a call fault injection may
    /// fail with `ENOMEM`).
    fn fill_call(&self, off: usize, len: usize, prot: Prot) -> std::io::Result<()> {
        if crate::faults::fail_commit_call() {
            return Err(crate::sys::codes::no_memory());
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
    pub(super) fn reserve_holes(&self, range: GuestRange, regions: &[Region]) -> std::io::Result<()> {
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
    /// ([`Observer::keeps_mappings`](super::Observer::keeps_mappings): a uffd tracker, whose
    /// registration then stays); either way a later commit finds zeroes.
    pub fn decommit(&self, range: GuestRange) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        let _changing = self.changing();
        let mut st = self.state();
        st.refuse_held("decommit", range)?;
        let _in_flight = self.begin(&mut st, range, None);
        let mut rec = self.record_mut();
        let regions = self.own_regions(&rec, "decommit", range)?;
        let (a, b) = (self.res.base() + off, self.res.base() + off + len);
        let in_place = st.keep_mappings()
            && covers(&regions, a, b)
            && regions.iter().all(|r| !r.shared && !r.file)
            && !crate::sys::probe::strict_overcommit();
        st.tell(self, Change::Releasing { range });
        let kept = st.cut_views(range.start().0, range.end().0);
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
        st.tell_remapped(self, &rec.prots, &kept);
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
        let _in_flight = self.begin(&mut st, range, Some(false));
        let mut rec = self.record_mut();
        let err = |e| SpaceError::os("protect", range.start().0, range.len(), e);
        let regions = self.own_regions(&rec, "protect", range)?;
        let base = self.res.base();
        if !covers(&regions, base + off, base + off + len) {
            return Err(err(crate::sys::codes::no_memory()));
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
            return Err(err(crate::sys::codes::refused())); // as the advice answers
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
    /// page tables only (`mincore`; `QueryWorkingSetEx` on Windows): nothing is faulted in and no
    /// byte or mapping changes.
    pub fn resident_pages(&self, range: GuestRange, out: &mut Vec<bool>) -> Result<(), SpaceError> {
        let (off, len) = self.check(range)?;
        crate::sys::pin::resident_pages(self.res.base() + off, len, out)
            .map_err(|e| SpaceError::os(crate::sys::pin::RESIDENT, range.start().0, range.len(), e))
    }
}
