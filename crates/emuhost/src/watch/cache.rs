//! Tracking shaped like an emulator's caches: collects into the caller's bitmap words, queries
//! that report without arming again, and consumers (a buffer cache, a texture cache) that each
//! have their own dirty pages on one tracker.
//!
//! Bitmap words: bit `i` (bit `i % 64` of word `i / 64`) stands for the `granularity` bytes of
//! the range from `range.start + i * granularity`; it is set where a page written lies in them.
//! Bits are OR-ed in; none is cleared.
//!
//! Consumers: every collect of the tracker (the tracker's own, or any consumer's) adds the pages
//! it found to every consumer's pending pages, under the tracker's lock, so a write is reported
//! once to each consumer whichever collects first. Once a tracker has had a consumer, its own
//! reads are one more consumer: a consumer's collect takes the kernel's marks, so the tracker's
//! own collect (and query) report its own pending pages, fed like every consumer's. Every reader
//! thus sees every write made after its own last collect, whatever order they read in. A
//! consumer's pending pages are one bit per page of the window, in a zeroed vector that the
//! allocator maps lazily (a 512 GiB window costs 16 MiB of address space and only the pages
//! touched), with a bit per word of it that may have a mark: a pass costs what is marked.

use std::sync::Arc;

use super::bitmap::{Bits, set_bits, word_mask};
use super::read::{Read, Reader, Scratch};
use super::{Inner, Tracker, WatchError};
use crate::space::{GuestRange, page_size};

/// What a [`Tracker::collect_into`] (or a query, or a consumer's) reported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Written {
    /// Pages reported written (each once).
    pub pages: u64,
    /// Of those, pages of spans not tracked any more (released behind the space's back): their
    /// content is unknown, so they are reported written.
    pub untracked_pages: u64,
    /// The collect's number ([`Tracker::collects_started`]); for a query, the number of the last
    /// collect to start.
    pub seq: u64,
}

/// One consumer's pending pages: a bit per page of the window, and a bit per word of those
/// that may have a mark, so a pass over a large window's pages costs what is marked (a 512 GiB
/// window has 2 Mi words; passes over them cost a take of the snapshots ~0.3 ms each).
pub(super) struct Pending {
    id: u64,
    bits: Vec<u64>,
    /// Bit `j` of word `g`: word `64 * g + j` of `bits` may have a mark (set with its marks,
    /// cleared by a take that leaves the word without).
    words: Vec<u64>,
}

impl Pending {
    /// No pages pending, over a window of `window` bytes.
    pub(super) fn new(id: u64, window: u64) -> Pending {
        let bits = (window / page_size()).div_ceil(64) as usize;
        Pending { id, bits: vec![0; bits], words: vec![0; bits.div_ceil(64)] }
    }

    /// Appends the marked pages of `a..b` to `runs` as guest `(start, end)` pairs, consecutive
    /// pages joined, clearing the marks if `take`.
    pub(super) fn runs(&mut self, a: u64, b: u64, take: bool, runs: &mut Vec<(u64, u64)>) {
        let p = page_size();
        let from = runs.len();
        self.each(a, b, take, |s| {
            let n = runs.len();
            match runs.last_mut() {
                Some(last) if n > from && last.1 == s => last.1 = s + p,
                _ => runs.push((s, s + p)),
            }
        });
    }

    /// Marks the pages of guest `(start, end)` pairs (page-aligned, inside the window).
    pub(super) fn add(&mut self, runs: impl Iterator<Item = (u64, u64)>) {
        let p = page_size();
        for (s, e) in runs.filter(|&(s, e)| s < e) {
            set_bits(&mut self.bits, s / p, e / p);
            set_bits(&mut self.words, s / p / 64, (e / p - 1) / 64 + 1);
        }
    }

    /// Calls `f` with each marked page of `a..b` (guest, page-aligned), in order, clearing the
    /// marks if `take`.
    fn each(&mut self, a: u64, b: u64, take: bool, mut f: impl FnMut(u64)) {
        let p = page_size();
        let (first, end) = (a / p, b / p);
        if first >= end {
            return;
        }
        // The words of bits the range touches, `w0..w1`, found through their summary bits.
        let (w0, w1) = (first / 64, (end - 1) / 64 + 1);
        for g in w0 / 64..(w1 - 1) / 64 + 1 {
            let (lo, hi) = (w0.max(g * 64) - g * 64, w1.min(g * 64 + 64) - g * 64);
            let mut may = self.words[g as usize] & word_mask(lo, hi);
            while may != 0 {
                let w = g * 64 + u64::from(may.trailing_zeros());
                may &= may - 1;
                // The range's bits of word `w`.
                let (blo, bhi) = (first.max(w * 64) - w * 64, end.min(w * 64 + 64) - w * 64);
                let mask = word_mask(blo, bhi);
                let word = &mut self.bits[w as usize];
                let mut set = *word & mask;
                if take {
                    *word &= !mask;
                    if *word == 0 {
                        self.words[g as usize] &= !(1 << (w % 64));
                    }
                }
                while set != 0 {
                    let bit = u64::from(set.trailing_zeros());
                    set &= set - 1;
                    f((w * 64 + bit) * p);
                }
            }
        }
    }
}

/// Checks a bitmap's granularity and length for `range` before anything is read (so a refused
/// call consumes nothing).
fn check(range: GuestRange, granularity: u64, have: usize) -> Result<(), WatchError> {
    let page = page_size();
    if !granularity.is_power_of_two() || granularity < page {
        return Err(WatchError::BadGranularity { granularity, page });
    }
    let need = range.len().div_ceil(granularity).div_ceil(64);
    let need = usize::try_from(need).unwrap_or(usize::MAX);
    if have < need {
        return Err(WatchError::WordsTooShort { range, granularity, need, have });
    }
    Ok(())
}

/// ORs the result of a read (`sc`) into `bits` (which holds the runs the read set straight
/// from the kernel's output already, if any: then `sc.runs` is empty).
fn or_read(sc: &Scratch, bits: &mut Bits, seq: u64) -> Written {
    let p = page_size();
    let mut out = Written { seq, ..Written::default() };
    for &(s, e) in &sc.runs {
        bits.set(s, e);
    }
    // Bytes summed, divided once: a division per run costs as much as the rest of the loop.
    out.pages = bits.bytes / p;
    // Untracked spans are reported written too; pages of theirs a run covered are counted once.
    // (A read sets bits straight only when no run comes from outside the spans read, so there
    // is then no run to cover one.)
    for u in &sc.untracked {
        let (s, e) = (u.start().0, u.end().0);
        bits.set(s, e);
        let covered: u64 = sc.runs.iter().filter_map(|&(x, y)| super::clip(s, e, x, y)).map(|(x, y)| (y - x) / p).sum();
        out.pages += (e - s) / p - covered;
        out.untracked_pages += (e - s) / p;
    }
    out
}

impl Tracker {
    /// Collects the pages of `range` written since the last collect and arms them again, as
    /// [`Tracker::collect`] does, and ORs one bit per `granularity` bytes into `words` (see the
    /// module's doc for the layout: bit `i` is `range.start + i * granularity`). `granularity`
    /// must be a power of two of at least the page size ([`WatchError::BadGranularity`]), and
    /// `words` must hold `ceil(ceil(range.len / granularity) / 64)` words
    /// ([`WatchError::WordsTooShort`]); either error is given before anything is collected.
    /// Spans not tracked any more are reported written.
    ///
    /// Allocates nothing once the tracker's buffers have grown to the size of the range's
    /// layout (the first collects of a range may grow them); verify mode, a failed read and
    /// pages the space changed under the tracker (mapped anew, released) take the slow path.
    pub fn collect_into(&self, range: GuestRange, granularity: u64, words: &mut [u64]) -> Result<Written, WatchError> {
        check(range, granularity, words.len())?;
        let mut bits = Bits::new(words, range, granularity);
        self.read(range, Read::Collect, Reader::Own, Some(&mut bits), |sc, seq, _, bits| {
            or_read(sc, bits.expect("given"), seq)
        })
    }

    /// Reports the pages of `range` written since the tracker's own last collect into `words` (as
    /// [`Tracker::collect_into`] does), without taking them or arming anything: the next collect
    /// reports them still, as it does pages a consumer's collect read meanwhile.
    pub fn query_into(&self, range: GuestRange, granularity: u64, words: &mut [u64]) -> Result<Written, WatchError> {
        check(range, granularity, words.len())?;
        let mut bits = Bits::new(words, range, granularity);
        self.read(range, Read::Query, Reader::Own, Some(&mut bits), |sc, seq, _, bits| {
            or_read(sc, bits.expect("given"), seq)
        })
    }

    /// A new consumer of this tracker's writes, with its own dirty pages: every collect of the
    /// tracker from now on (its own, or any consumer's) adds the pages it finds to each
    /// consumer's, and a consumer's collect takes only its own. So two caches on one tracker
    /// each see every write made after the consumer was made (and possibly some earlier ones).
    pub fn consumer(self: &Arc<Self>) -> Consumer {
        let mut inner = self.inner();
        inner.consumer_ids += 1;
        let id = inner.consumer_ids;
        let window = self.space.window();
        // From now on the tracker's own reads are a consumer too (and stay one).
        inner.own.get_or_insert_with(|| Pending::new(0, window));
        inner.consumers.push(Pending::new(id, window));
        Consumer { tracker: self.clone(), id }
    }
}

/// One consumer of a tracker's writes (made by [`Tracker::consumer`]): its own dirty pages, fed
/// by every collect of the tracker. Dropping it drops its pending pages.
pub struct Consumer {
    tracker: Arc<Tracker>,
    id: u64,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer").field("id", &self.id).finish()
    }
}

impl Consumer {
    /// The tracker it consumes.
    pub fn tracker(&self) -> &Arc<Tracker> {
        &self.tracker
    }

    fn pending<'a>(&self, inner: &'a mut Inner) -> &'a mut Pending {
        inner.consumers.iter_mut().find(|c| c.id == self.id).expect("a live consumer has its pending pages")
    }

    /// Collects `range` on the tracker (adding what it finds to every consumer's pending pages),
    /// then takes this consumer's pending pages of `range` into `words` as
    /// [`Tracker::collect_into`] lays them out. The errors are its.
    pub fn collect_into(&self, range: GuestRange, granularity: u64, words: &mut [u64]) -> Result<Written, WatchError> {
        check(range, granularity, words.len())?;
        self.tracker.read(range, Read::Collect, Reader::Consumer, None, |_, seq, inner, _| {
            let p = page_size();
            let mut out = Written { seq, ..Written::default() };
            let mut bits = Bits::new(words, range, granularity);
            self.pending(inner).each(range.start().0, range.end().0, true, |s| {
                bits.set(s, s + p);
                out.pages += 1;
            });
            out
        })
    }

    /// Collects `range` on the tracker as [`Consumer::collect_into`] does, then takes this
    /// consumer's pending pages of `range` as runs of guest addresses (`(start, end)`,
    /// page-aligned, consecutive pages joined, in order), appended to `runs`: no bitmap the size
    /// of the range (a snapshot's take over a large window). The errors are the tracker's
    /// collect's.
    pub fn collect_runs(&self, range: GuestRange, runs: &mut Vec<(u64, u64)>) -> Result<Written, WatchError> {
        self.tracker.read(range, Read::Collect, Reader::Consumer, None, |_, seq, inner, _| {
            let from = runs.len();
            self.pending(inner).runs(range.start().0, range.end().0, true, runs);
            let pages = runs[from..].iter().map(|&(s, e)| (e - s) / page_size()).sum();
            Written { seq, pages, ..Written::default() }
        })
    }

    /// Reports this consumer's pending pages of `range` and the tracker's pages written since
    /// its last collect into `words`, taking nothing: this consumer's next collect reports them.
    pub fn query_into(&self, range: GuestRange, granularity: u64, words: &mut [u64]) -> Result<Written, WatchError> {
        check(range, granularity, words.len())?;
        // No bits set straight by the read: the pending pages are checked against its runs.
        self.tracker.read(range, Read::Query, Reader::Consumer, None, |sc, seq, inner, _| {
            let p = page_size();
            let mut bits = Bits::new(words, range, granularity);
            let mut out = or_read(sc, &mut bits, seq);
            // Pending pages the read reported already are counted once.
            self.pending(inner).each(range.start().0, range.end().0, false, |s| {
                bits.set(s, s + p);
                // The runs are sorted and apart: the first that ends past `s` is the only candidate.
                let i = sc.runs.partition_point(|&(_, y)| y <= s);
                let seen = sc.runs.get(i).is_some_and(|&(x, _)| x <= s)
                    || sc.untracked.iter().any(|u| u.start().0 <= s && s < u.end().0);
                if !seen {
                    out.pages += 1;
                }
            });
            out
        })
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        let id = self.id;
        self.tracker.inner().consumers.retain(|c| c.id != id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Pending::runs` (its skip over unmarked words) against the marks, for ranges that start
    /// and end inside words and across long unmarked stretches; a take clears only the range's.
    #[test]
    fn pending_runs_find_every_mark_across_unmarked_words() {
        let p = page_size();
        let marks: [u64; 6] = [0, 63, 64 * 9, 64 * 9 + 1, 64 * 30 + 7, 64 * 40 - 1];
        for (a, b) in [(0, 64 * 40), (1, 64 * 40), (63, 64 * 30 + 8), (64, 64 * 30 + 7), (65, 64 * 39 + 5)] {
            let mut pend = Pending::new(0, 64 * 40 * p);
            pend.add(marks.iter().map(|&m| (m * p, (m + 1) * p)));
            let mut got = Vec::new();
            pend.runs(a * p, b * p, true, &mut got);
            let pages: Vec<u64> = got.iter().flat_map(|&(s, e)| s / p..e / p).collect();
            let want: Vec<u64> = marks.iter().copied().filter(|&m| a <= m && m < b).collect();
            assert_eq!(pages, want, "{a}..{b}");
            let mut left = Vec::new();
            pend.runs(0, 64 * 40 * p, false, &mut left);
            let left: Vec<u64> = left.iter().flat_map(|&(s, e)| s / p..e / p).collect();
            assert_eq!(left, marks.iter().copied().filter(|&m| m < a || m >= b).collect::<Vec<_>>(), "{a}..{b}");
        }
    }

    /// `Bits::set` against a bit at a time, for runs of every length at every offset across word ends,
    /// at the page's granularity and at coarser ones (a run that covers part of a grain sets it).
    #[test]
    fn set_sets_the_bits_of_every_grain_a_run_touches() {
        let p = page_size();
        let range = GuestRange::from_bounds(16 * p, 16 * p + 300 * p).unwrap();
        let a = range.start().0;
        for granularity in [p, 2 * p, 64 * p] {
            for first in 0..140 {
                for pages in 1..140 {
                    let (s, e) = (a + first * p, a + (first + pages).min(300) * p);
                    if s >= e {
                        continue;
                    }
                    let mut want = [0u64; 5];
                    for i in (s - a) / granularity..(e - a).div_ceil(granularity) {
                        want[(i / 64) as usize] |= 1 << (i % 64);
                    }
                    let mut got = [0u64; 5];
                    Bits::new(&mut got, range, granularity).set(s, e);
                    assert_eq!(got, want, "pages {first}..+{pages}, granularity {granularity:#x}");
                }
            }
        }
    }
}
