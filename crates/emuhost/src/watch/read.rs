//! The collect and query path: what a read of a range finds, the spans it reads, and the aliases
//! of shared sections.

use super::backend::Runs;
use super::bitmap::Bits;
use super::{Inner, PageBitmap, Tracker, WatchError, add, clip};
use crate::space::ranges::RangeMap;
use crate::space::{GuestAddr, GuestRange, Layout, SectionId, View, page_size};
use std::sync::atomic::Ordering::SeqCst;

/// A run of written pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRun {
    /// The first page's guest address.
    pub start: GuestAddr,
    /// The number of pages (at least 1).
    pub pages: u64,
}

impl PageRun {
    /// The guest address just past the run.
    pub fn end(&self) -> GuestAddr {
        GuestAddr(self.start.0 + self.pages * page_size())
    }
}

/// What a collect found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Collected {
    /// Pages written since the last collect, in address order, as runs.
    pub runs: Vec<PageRun>,
    /// Armed spans that are not tracked any more (released behind the space's back).
    pub untracked: Vec<GuestRange>,
    /// This collect's number: the tracker's collects are numbered 1, 2, ... in the order they
    /// ran (see [`Tracker::collects_started`]).
    pub seq: u64,
}

impl Collected {
    /// The number of pages written.
    pub fn pages(&self) -> u64 {
        self.runs.iter().map(|r| r.pages).sum()
    }

    /// Every written page's address, in order.
    pub fn page_addrs(&self) -> Vec<GuestAddr> {
        let p = page_size();
        self.runs.iter().flat_map(|r| (0..r.pages).map(move |i| GuestAddr(r.start.0 + i * p))).collect()
    }

    /// The written pages of `range` as a bitmap of `GRAIN` bytes per bit.
    pub fn bitmap<const GRAIN: u64>(&self, range: GuestRange) -> PageBitmap<GRAIN> {
        let mut b = PageBitmap::new(range);
        for r in &self.runs {
            b.set_range(r.start.0, r.end().0);
        }
        b
    }
}

/// A collect's (or a query's) buffers: taken out of [`Inner`] while it runs and put back, so a
/// collect allocates nothing once they have grown to its size.
#[derive(Default)]
pub(super) struct Scratch {
    /// Guest `(start, end)` armed in the range.
    pub(super) armed: Pairs,
    /// The spans to read.
    pub(super) spans: Vec<Span>,
    /// The result: written guest `(start, end)`, merged, in order (none when the read set them
    /// in the caller's bits).
    pub(super) runs: Pairs,
    /// The result: spans not tracked any more.
    pub(super) untracked: Vec<GuestRange>,
    /// Guest `(start, end)` of the range that changes of the mappings in flight cover (read from
    /// the published layout; none under the space's lock): reported written, not read.
    pub(super) changing: Pairs,
}

/// How a read of a range treats the pages: a collect takes them and arms them again, a query
/// only looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Read {
    Collect,
    Query,
}

/// Whose read it is: the tracker's own (its result is the tracker's own pending pages once it
/// has had a consumer), or a consumer's (which takes its pending pages itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reader {
    Own,
    Consumer,
}

/// A span to read: guest `start..end`, and the allocation it lies in, `(start, end, generation)`
/// (`None` for a shared view).
pub(super) type Span = (u64, u64, Option<(u64, u64, u64)>);

impl Tracker {
    /// Collects the pages of `range` written since the last collect and arms them again.
    ///
    /// # Errors
    /// As [`Tracker::arm`]; also [`WatchError::VerifyMismatch`] in verify mode. Memory released
    /// behind the space's back is no error: it is reported in [`Collected::untracked`].
    pub fn collect(&self, range: GuestRange) -> Result<Collected, WatchError> {
        let p = page_size();
        self.read(range, Read::Collect, Reader::Own, None, |sc, seq, _, _| Collected {
            runs: sc.runs.iter().map(|&(s, e)| PageRun { start: GuestAddr(s), pages: (e - s) / p }).collect(),
            untracked: sc.untracked.clone(),
            seq,
        })
    }

    /// Reads `range` (`how`: a collect or a query, for `who`) under the space's lock and the
    /// tracker's, then gives `out` the result (in the scratch buffers), the collect's number, the
    /// tracker's state and `bits`. Given `bits`, the read may set the runs it finds there
    /// straight from the kernel's output (then the scratch holds none).
    pub(super) fn read<R>(
        &self,
        range: GuestRange,
        how: Read,
        who: Reader,
        mut bits: Option<&mut Bits>,
        out: impl FnOnce(&Scratch, u64, &mut Inner, Option<&mut Bits>) -> R,
    ) -> Result<R, WatchError> {
        self.same_process()?;
        let range = self.space.range(range.start().0, range.len())?;
        if how == Read::Collect {
            // Fault injection may make a foreign SIGSEGV here first (a no-op in the default build).
            crate::faults::at_collect().map_err(|e| self.os("collect (after a foreign SIGSEGV)", range, e))?;
        }
        let mut layout = self.layout.lock().unwrap_or_else(|p| p.into_inner());
        // Numbered with the inner lock held, so in the order they run.
        let seq = |_: &Inner| match how {
            Read::Collect => self.started.fetch_add(1, SeqCst) + 1,
            Read::Query => self.started.load(SeqCst),
        };
        if !self.core.published {
            // The old way: the layout read under the space's lock, held for the whole read.
            return self.space.with_layout_in(range, &mut layout, |layout| {
                let mut inner = self.inner();
                let seq = seq(&inner);
                let mut sc = std::mem::take(&mut inner.scratch);
                sc.changing.clear();
                let result = self
                    .read_locked(&mut inner, layout, range, (how, who), &mut sc, bits.as_deref_mut())
                    .map(|()| out(&sc, seq, &mut inner, bits));
                inner.scratch = sc;
                result
            });
        }
        // The published layout, read after the inner lock is taken and the collect is numbered:
        // every change whose observers were told before is in it, and every change in it whose
        // observers were not told yet is marked in flight (docs/watch.md, "The published
        // layout").
        let mut inner = self.inner();
        let seq = seq(&inner);
        let mut sc = std::mem::take(&mut inner.scratch);
        self.space.published_layout_in(range, &mut layout, &mut sc.changing);
        let result = self
            .read_locked(&mut inner, &layout, range, (how, who), &mut sc, bits.as_deref_mut())
            .map(|()| out(&sc, seq, &mut inner, bits));
        inner.scratch = sc;
        result
    }

    /// The spans of `range` to read into `sc.spans`: allocations and views, clipped to the range
    /// and to what is armed. Pages under a host write in flight go to `sc.runs` instead (they
    /// are reported, and not read: the read would arm them under the write, which would fail).
    /// So do pages whose arm waits for such a write to end: armed for the caller, but writable
    /// and untracked until then.
    fn spans(inner: &Inner, layout: &Layout, a: u64, b: u64, sc: &mut Scratch) {
        sc.runs.extend(inner.deferred.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)));
        sc.armed.extend(inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)));
        for al in &layout.allocations {
            let (s, e) = (al.range.start().0, al.range.end().0);
            for &(x, y) in &sc.armed {
                if let Some((p, q)) = clip(s, e, x, y) {
                    sc.spans.push((p, q, Some((s, e, al.generation))));
                }
            }
        }
        for v in &layout.views {
            for &(x, y) in &sc.armed {
                if let Some((p, q)) = clip(v.range.start().0, v.range.end().0, x, y) {
                    sc.spans.push((p, q, None));
                }
            }
        }
        // Spans do not overlap: an unstable sort gives the order and allocates nothing.
        sc.spans.sort_unstable_by_key(|s| s.0);
        // Pages a change in flight covers are reported whole and not read: the change's system
        // call may run beside the read, and its observers are told after it (a write there that
        // ended before this collect began is reported by it, and a span mapped anew under the
        // read is not taken for memory released behind the space's back).
        if !inner.hosting.is_empty() || !sc.changing.is_empty() {
            let mut skip = inner.hosting.clone();
            skip.extend_from_slice(&sc.changing);
            let mut rest = Vec::new();
            for &(s, e, alloc) in &sc.spans {
                let (outside, inside) = split(s, e, &skip);
                sc.runs.extend(inside);
                rest.extend(outside.into_iter().map(|(x, y)| (x, y, alloc)));
            }
            sc.spans = rest;
        }
    }

    /// Reads `range` into `sc.runs` (written pages, merged) and `sc.untracked`. A collect takes
    /// the marks, arms the pages again, takes the pending pages and adds what it found to every
    /// consumer's pending pages; a query changes nothing. With `bits`, when the backend's runs
    /// are the whole result and no consumer needs them, they go into `bits` instead of
    /// `sc.runs`: one pass over the kernel's output, no buffer of runs (2 MiB per GiB at 50 %
    /// written; with it, such a collect took 1.38x the bare kernel's scan on the H200). Once the
    /// tracker has had a consumer, its own read reports its own pending pages instead (see
    /// [`Inner::own`]).
    fn read_locked(
        &self,
        inner: &mut Inner,
        layout: &Layout,
        range: GuestRange,
        (how, who): (Read, Reader),
        sc: &mut Scratch,
        mut bits: Option<&mut Bits>,
    ) -> Result<(), WatchError> {
        let (a, b) = (range.start().0, range.end().0);
        self.core.backend.begin_read();
        sc.armed.clear();
        sc.spans.clear();
        sc.runs.clear();
        sc.untracked.clear();
        Self::spans(inner, layout, a, b, sc);
        // Runs from here on are the backend's, made guest runs and joined as they are read
        // (`Runs`). Spans are in order and apart, so with nothing else in the result (the common
        // case) the runs are merged already; else a sort and a merge pass make them so.
        let from = sc.runs.len();
        let base = self.space.host_base() as u64;
        let pending = inner.pending.overlapping(a, b).next().is_some();
        let aliased = layout.aliased_inside || !layout.aliases.is_empty();
        let direct = from == 0 && !pending && inner.own.is_none() && !aliased;
        if !direct {
            bits = None;
        }
        // Set where a span is reported whole out of order with the backend's joined runs.
        let mut patched = false;
        for i in 0..sc.spans.len() {
            let (s, e, alloc) = sc.spans[i];
            let span = GuestRange::from_bounds(s, e)?;
            if let Some((start, end, generation)) = alloc
                && inner.failed.get(&start) == Some(&(end, generation))
            {
                sc.untracked.push(span);
                continue;
            }
            let mark = bits.as_ref().map(|b| b.bytes);
            let len = sc.runs.len();
            let mut runs = Runs::new(&mut sc.runs, base, from, bits.as_deref_mut());
            let got = match how {
                Read::Collect => {
                    if self.verify {
                        self.verify_span(inner, span)?;
                    }
                    self.core.backend.read(self.host(s), self.host(e), &mut runs)
                }
                Read::Query => self.core.backend.peek(self.host(s), self.host(e), &mut runs),
            };
            if got.is_err() && self.read_may_race(s, e) {
                // A change of the span began after the layout was read, and its system call came
                // before the read failed: the span is reported written whole (the change's
                // observers, told once this read ends, keep its tracking), neither untracked nor
                // an error. A change that failed the read is still marked: its observers, which
                // end it, wait for the inner lock this read holds. (A backend that re-protects
                // what it reads never gets here: such changes wait for the read, see
                // `read_may_race`.)
                match (bits.as_deref_mut(), mark) {
                    (Some(b), Some(m)) => {
                        b.bytes = m;
                        b.set(s, e);
                    }
                    _ => {
                        sc.runs.truncate(len);
                        sc.runs.push((s, e));
                        patched = true;
                    }
                }
                continue;
            }
            if let Err(err) = got {
                // Pages the backend knows were mapped or unmapped behind the space's back are
                // untracked without asking the kernel (a foreign mapping may look like the space's).
                if !super::backend::is_not_ours(&err) && self.unexpected(inner, span)?.is_none() {
                    return Err(self.os(if how == Read::Collect { "collect" } else { "query" }, span, err));
                }
                // The span is reported whole: runs of it set before the read failed are not
                // counted twice.
                if let (Some(b), Some(m)) = (bits.as_deref_mut(), mark) {
                    b.bytes = m;
                }
                sc.untracked.push(span);
                if let (Read::Collect, Some((start, end, generation))) = (how, alloc) {
                    inner.failed.insert(start, (end, generation));
                }
            }
        }
        if aliased {
            self.read_aliases(inner, layout, (a, b), how, sc);
        }
        if from > 0 || pending || aliased || patched {
            sc.runs.extend(inner.pending.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)));
            merge(&mut sc.runs, a, b);
        }
        Self::hand_out(inner, (a, b), (how, who), sc);
        Ok(())
    }

    /// Hands out what a read of `a..b` found: a collect takes the pending pages and adds its
    /// result to every consumer's pending pages; once the tracker has had a consumer, its own
    /// read's result is its own pending pages.
    fn hand_out(inner: &mut Inner, (a, b): (u64, u64), (how, who): (Read, Reader), sc: &mut Scratch) {
        if how == Read::Collect {
            inner.pending.remove(a, b, |_, _, _| ());
            for c in inner.consumers.iter_mut().chain(inner.own.as_mut()) {
                c.add(sc.runs.iter().copied());
                c.add(sc.untracked.iter().map(|u| (u.start().0, u.end().0)));
            }
        }
        if let (Reader::Own, Some(own)) = (who, inner.own.as_mut()) {
            // The tracker's own result is its own pending pages: a collect takes them (they hold
            // what it just read), a query adds them to what it peeked.
            match how {
                Read::Collect => {
                    sc.runs.clear();
                    own.runs(a, b, true, &mut sc.runs);
                }
                Read::Query => {
                    own.runs(a, b, false, &mut sc.runs);
                    merge(&mut sc.runs, a, b);
                }
            }
        }
    }

    /// Section pages shown at several armed addresses (aliases): a write through one is reported
    /// at every one. The views of `a..b` report the section pages written through any of their
    /// aliases now; the aliases outside the range are read too (marks taken with a collect, only
    /// looked at with a query), and every alias outside the range gets the section pages written
    /// through any of them as pending pages, for its own next collect. An alias that cannot be
    /// read counts as written whole.
    fn read_aliases(&self, inner: &mut Inner, layout: &Layout, (a, b): (u64, u64), how: Read, sc: &mut Scratch) {
        let base = self.space.host_base() as u64;
        let bytes = |v: &View, x: u64, y: u64| (v.section, v.offset + (x - v.range.start().0), y - x);
        // The section bytes written: (section, offset, length).
        let mut shown: Vec<(SectionId, u64, u64)> = Vec::new();
        for v in &layout.views {
            let (vs, ve) = (v.range.start().0.max(a), v.range.end().0.min(b));
            shown.extend(sc.runs.iter().filter_map(|&(x, y)| clip(vs, ve, x, y)).map(|(x, y)| bytes(v, x, y)));
        }
        let mut runs = Vec::new();
        for av in &layout.aliases {
            let (s, e) = (av.range.start().0, av.range.end().0);
            let armed: Pairs = inner.armed.overlapping(s, e).filter_map(|(x, y, _)| clip(s, e, x, y)).collect();
            for (x, y) in armed.into_iter().flat_map(|(x, y)| split(x, y, &inner.hosting).0) {
                runs.clear();
                let mut out = Runs::new(&mut runs, base, 0, None);
                let got = match how {
                    Read::Collect => self.core.backend.read(self.host(x), self.host(y), &mut out),
                    Read::Query => self.core.backend.peek(self.host(x), self.host(y), &mut out),
                };
                if got.is_err() {
                    runs.clear();
                    runs.push((x, y));
                }
                shown.extend(runs.iter().map(|&(p, q)| bytes(av, p, q)));
            }
        }
        // Every armed page showing a written section byte: reported now inside the range, kept
        // pending outside it (a collect only).
        let at = |v: &View, lo: u64, hi: u64, out: &mut dyn FnMut(u64, u64)| {
            for &(_, off, len) in shown.iter().filter(|w| w.0 == v.section) {
                let start = v.range.start().0;
                let (o1, o2) = (off.max(v.offset), (off + len).min(v.offset + v.range.len()));
                if let Some((x, y)) =
                    (o1 < o2).then(|| clip(lo, hi, start + (o1 - v.offset), start + (o2 - v.offset))).flatten()
                {
                    for (p, q, _) in inner.armed.overlapping(x, y) {
                        if let Some((p, q)) = clip(x, y, p, q) {
                            out(p, q);
                        }
                    }
                }
            }
        };
        let mut now = Vec::new();
        for v in &layout.views {
            at(v, a, b, &mut |p, q| now.push((p, q)));
        }
        let mut later = Vec::new();
        if how == Read::Collect {
            for av in &layout.aliases {
                at(av, 0, u64::MAX, &mut |p, q| later.push((p, q)));
            }
        }
        sc.runs.extend(now);
        for (p, q) in later {
            add(&mut inner.pending, p, q);
        }
    }

    /// What the kernel has in `span` that a committed, armed span should not have, if anything:
    /// no mapping, or an inaccessible one the guest did not ask for (memory released behind the
    /// space's back).
    fn unexpected(&self, inner: &Inner, span: GuestRange) -> Result<Option<String>, WatchError> {
        let regions = self.space.kernel_regions(span)?;
        let mut at = span.start().0 as usize;
        for r in &regions {
            if r.start > at {
                return Ok(Some(format!("nothing mapped at {at:#x}..{:#x}", r.start)));
            }
            if !r.read && !r.write && !r.exec && !inner.noaccess.gaps(r.start as u64, r.end as u64).is_empty() {
                return Ok(Some(format!("reserved (PROT_NONE) memory at {:#x}..{:#x}", r.start, r.end)));
            }
            at = r.end;
        }
        if at < span.end().0 as usize {
            return Ok(Some(format!("nothing mapped at {at:#x}..{:#x}", span.end().0)));
        }
        Ok(None)
    }

    /// Whether a change of guest `s..e` marked in flight now may have made its system call beside
    /// this read: the read uses the published layout, and the backend does not re-protect what it
    /// reads (where it does, every change of the mappings waits for a read in progress first:
    /// the observer's `Changing`, and a release's `Releasing`). A failed read of such a backend
    /// may have taken marks it could not protect again, so it must take the old way (untracked
    /// and re-armed by the next arm, or an error).
    fn read_may_race(&self, s: u64, e: u64) -> bool {
        self.core.published && !self.core.backend.reprotects() && self.space.changing_over(s, e)
    }

    fn verify_span(&self, inner: &Inner, span: GuestRange) -> Result<(), WatchError> {
        match self.unexpected(inner, span)? {
            // A change of the span in flight (begun after the published layout was read) may
            // have changed its mapping; its observers, told after this read, keep the tracking.
            Some(_) if self.read_may_race(span.start().0, span.end().0) => Ok(()),
            Some(found) => Err(WatchError::VerifyMismatch { span, found }),
            None => Ok(()),
        }
    }
}

/// Guest `(start, end)` pairs.
pub(super) type Pairs = Vec<(u64, u64)>;

/// The parts of `s..e` outside and inside the ranges `over`.
pub(super) fn split(s: u64, e: u64, over: &[(u64, u64)]) -> (Pairs, Pairs) {
    let mut inside = RangeMap::default();
    for &(x, y) in over {
        if let Some((x, y)) = clip(s, e, x, y) {
            add(&mut inside, x, y);
        }
    }
    let outside = inside.gaps(s, e);
    (outside, inside.overlapping(s, e).map(|(x, y, _)| (x, y)).collect())
}

/// Sorts guest `(start, end)` pairs, clips them to `a..b` and merges those that touch or
/// overlap, in place (allocating nothing).
fn merge(v: &mut Pairs, a: u64, b: u64) {
    v.sort_unstable();
    let mut n = 0;
    for i in 0..v.len() {
        let Some((s, e)) = clip(a, b, v[i].0, v[i].1) else { continue };
        if n > 0 && s <= v[n - 1].1 {
            v[n - 1].1 = v[n - 1].1.max(e);
        } else {
            v[n] = (s, e);
            n += 1;
        }
    }
    v.truncate(n);
}
