//! The background (ahead) queue and threads: pools imported ahead of their bindings and pools
//! whole over a binding's part (pools policy), in pieces, within a budget of bytes; populates
//! ahead (either policy). They step aside for the bindings' imports.

use std::collections::{HashSet, VecDeque};
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::super::ImportError;
use super::super::backend::{Backend, HostSpan};
use super::super::plan::{Planned, cover};
use super::super::pools::PoolId;
use super::state::{Flight, Made, State};
use super::{Core, Importer, chain};
use crate::space::{LongRead, Prot};

/// A widening asked this long ago is taken before smaller ones ([`AheadQueue::pop`]); in the
/// H200's load burst the longest queued about 50 ms.
const WIDEN_OLDEST: Duration = Duration::from_millis(250);
/// The least overlap of two pieces of a background import, before any binding was seen.
const LEAST_OVERLAP: u64 = 64 << 10;
/// The background thread populates what it imports this much at a time.
pub(super) const POPULATE_SLICE: u64 = 256 << 10;

#[derive(Default)]
pub(super) struct PopulateCounts {
    pub(super) done: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) bytes: AtomicU64,
}

/// What the background import thread is asked, each in the epoch it was asked in.
pub(super) enum AheadJob {
    /// Import this pool whole, ahead of its bindings (if it is still registered).
    Pool(PoolId, u64),
    /// Import this range whole: a pool a binding imported only part of.
    Widen(Planned, u64),
    /// Import this range (pool `PoolId` whole, or a slice of it) in one, over the live imports
    /// that hold all its pages between them, and release those ([`Core::merge_whole`]).
    Merge(Planned, PoolId, u64),
    /// Populate `lo..hi` (`EMUHOST_IMPORT_POPULATE_AHEAD`), its reserved pages committed
    /// read-write first where `commit` (the chunks of a pool, gaps included).
    Populate { lo: u64, hi: u64, commit: bool },
}

/// The background import threads' work: asked for and not started, running, and whether the
/// threads are to stop.
#[derive(Default)]
pub(super) struct AheadQueue {
    /// Widenings, each with when it was asked.
    pub(super) widen: VecDeque<(Planned, u64, Instant)>,
    pub(super) pools: VecDeque<(PoolId, u64)>,
    /// Merges asked for, each once while queued.
    pub(super) merges: VecDeque<(Planned, PoolId, u64)>,
    /// Populates asked for, after every import; and the chunks asked for once already.
    pub(super) populate: VecDeque<(u64, u64, bool)>,
    pub(super) populate_chunks: HashSet<u64>,
    pub(super) running: usize,
    pub(super) closed: bool,
}

impl AheadQueue {
    /// The next job at `now`: widenings first (a binding's pool, certain to be used), the one
    /// asked for most (the pool where the most bindings imported parts: bindings stream through
    /// it, and each across a part's border imports pages again) and then the smallest first,
    /// each pool once, then pools ahead, then merges, then populates, each in the order asked. Smallest first:
    /// in the load burst widenings queue for tens of milliseconds, and every binding across a
    /// part's border before its pool's widening lands imports pages again; the small ones land
    /// soonest, so the most pools are whole soonest (a binding is as likely in a small pool as in
    /// a large one). A widening asked [`WIDEN_OLDEST`] ago or more goes first, so a stream of
    /// small ones cannot hold a large one back for good.
    pub(super) fn pop(&mut self, now: Instant) -> Option<AheadJob> {
        let overdue = self.widen.front().is_some_and(|w| now.saturating_duration_since(w.2) >= WIDEN_OLDEST);
        let asked = |r: Planned| self.widen.iter().filter(|w| w.0 == r).count();
        let next = if overdue {
            Some(0)
        } else {
            let key = |w: &(Planned, u64, Instant)| (std::cmp::Reverse(asked(w.0)), w.0.len());
            self.widen.iter().enumerate().min_by_key(|(_, w)| key(w)).map(|(i, _)| i)
        };
        // A pool asked again (a binding's part each time) is taken once, in the latest epoch.
        let taken = next.and_then(|i| self.widen.remove(i)).map(|(r, e, _)| {
            let latest = self.widen.iter().filter(|w| w.0 == r).map(|w| w.1).fold(e, u64::max);
            self.widen.retain(|w| w.0 != r);
            (r, latest)
        });
        (taken.map(|(r, e)| AheadJob::Widen(r, e)))
            .or_else(|| self.pools.pop_front().map(|(id, e)| AheadJob::Pool(id, e)))
            .or_else(|| self.merges.pop_front().map(|(r, id, e)| AheadJob::Merge(r, id, e)))
            .or_else(|| self.populate.pop_front().map(|(lo, hi, commit)| AheadJob::Populate { lo, hi, commit }))
    }

    pub(super) fn is_empty(&self) -> bool {
        self.widen.is_empty() && self.pools.is_empty() && self.merges.is_empty() && self.populate.is_empty()
    }

    /// A job has run: tells [`Importer::settle`] when none is left.
    pub(super) fn done_one(&mut self, idle: &Condvar) {
        self.running -= 1;
        if self.running == 0 && self.is_empty() {
            idle.notify_all();
        }
    }
}

impl<B: Backend + 'static> Importer<B> {
    pub(super) fn send(&self, job: AheadJob) {
        if self.ahead.is_empty() {
            return;
        }
        let mut q = self.core.queue.lock().unwrap_or_else(|p| p.into_inner());
        match job {
            AheadJob::Pool(id, epoch) => q.pools.push_back((id, epoch)),
            AheadJob::Widen(r, epoch) => q.widen.push_back((r, epoch, Instant::now())),
            AheadJob::Merge(r, id, epoch) => q.merges.push_back((r, id, epoch)),
            AheadJob::Populate { lo, hi, commit } => {
                if commit && !q.populate_chunks.insert(lo) {
                    return;
                }
                q.populate.push_back((lo, hi, commit));
            }
        }
        self.core.queued.notify_one();
    }

    /// Waits until every populate and every import ahead asked for so far has run.
    pub fn settle(&self) {
        let mut q = self.core.queue.lock().unwrap_or_else(|p| p.into_inner());
        while !self.ahead.is_empty() && !q.closed && (q.running > 0 || !q.is_empty()) {
            q = self.core.idle.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl<B: Backend> Core<B> {
    /// A background thread waits here until no binding is importing and no change of the
    /// space's mappings is under way, and returns the space's long read for its populate or pin
    /// (`None` once the importer is being dropped). A change waits for the memory-map lock
    /// behind every populate and pin that holds it, and there every collect's scan queues behind
    /// the change, which meanwhile holds the space's lock that collects need too (on the H200,
    /// commits of a few KiB waited 1-4 ms so): with the long read, a change that comes during
    /// the populate or the pin waits for it before it takes the space's lock instead.
    /// It yields at first, then sleeps 50 µs at a time (a change can wait milliseconds for the
    /// lock), and stops waiting once the importer is being dropped (a guard an embedder keeps
    /// must not hang the drop).
    pub(super) fn step_aside(&self) -> Option<LongRead<'_>> {
        self.aside(|| self.space.try_long_read())
    }

    /// Waits until no binding is at its import and `take` gives something (see
    /// [`Core::step_aside`]); `None` once the importer is being dropped.
    pub(super) fn aside<T>(&self, mut take: impl FnMut() -> Option<T>) -> Option<T> {
        let mut spins = 0u32;
        loop {
            if self.stopping.load(Ordering::Relaxed) {
                return None;
            }
            if self.binding_imports.load(Ordering::Acquire) == 0
                && let Some(taken) = take()
            {
                return Some(taken);
            }
            spins += 1;
            if spins < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// A background thread: the queue's jobs ([`AheadQueue::pop`]) until it is closed.
    pub(super) fn run_ahead(&self) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if q.closed {
                return;
            }
            let Some(job) = q.pop(Instant::now()) else {
                q = self.queued.wait(q).unwrap_or_else(|p| p.into_inner());
                continue;
            };
            q.running += 1;
            drop(q);
            let (pool, range, epoch) = match job {
                AheadJob::Populate { lo, hi, commit } => {
                    self.populate_ahead(lo, hi, commit);
                    (None, None, 0)
                }
                AheadJob::Widen(r, epoch) => (None, Some(r), epoch),
                AheadJob::Merge(r, id, epoch) => {
                    if !self.stopping.load(Ordering::Relaxed) {
                        self.merge_whole(r, id, epoch);
                    }
                    (None, None, 0)
                }
                AheadJob::Pool(id, epoch) => {
                    let range = self.state().pools.get(id).and_then(|p| {
                        let (lo, hi) = cover(p.lo, p.hi, self.align)?;
                        Some(self.in_window(Planned { lo, hi }, p.lo, p.hi - p.lo))
                    });
                    (Some(id), range, epoch)
                }
            };
            if let Some(r) = range
                && !self.stopping.load(Ordering::Relaxed)
            {
                // A pool ahead is left out over pages a binding imported (that is for bindings
                // to do, counted as a re-import); once its first piece is made, the rest follow.
                let used = pool.is_some() && self.state().overlaps_used(r.lo, r.hi, pool);
                for piece in if used { Vec::new() } else { self.pieces(r) } {
                    if !self.ahead(pool, piece, epoch) || self.stopping.load(Ordering::Relaxed) {
                        break;
                    }
                }
            }
            q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.done_one(&self.idle);
        }
    }

    /// A populate ahead (`EMUHOST_IMPORT_POPULATE_AHEAD`): `lo..hi`'s pages faulted in, its
    /// reserved pages committed read-write first where `commit` (the guest's keep their
    /// protection); counted, a failure too.
    pub(super) fn populate_ahead(&self, lo: u64, hi: u64, commit: bool) {
        let space = &self.space;
        let r = space.range(lo, hi - lo).and_then(|r| {
            if commit {
                space.commit_reserved(r, Prot::READ_WRITE)?;
            }
            space.populate(r)
        });
        let c = &self.populate_counts;
        match r {
            Ok(()) => {
                c.done.fetch_add(1, Ordering::Relaxed);
                c.bytes.fetch_add(hi - lo, Ordering::Relaxed);
            }
            Err(e) => {
                c.failed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("populate ahead {lo:#x}..{hi:#x}: {e}");
            }
        }
    }

    /// `r` in the pieces a background thread imports it in ([`super::PoolsConfig::ahead_piece`]):
    /// each overlaps the next by the largest binding seen so far (at least [`LEAST_OVERLAP`]),
    /// in the backend's alignment. Whole where the backend refuses overlaps.
    pub(super) fn pieces(&self, r: Planned) -> Vec<Planned> {
        // Only the pools policy asks for imports ahead.
        let piece = self.cfg.policy.pools_config().map_or(0, |p| p.ahead_piece);
        let piece = piece.checked_next_multiple_of(self.align).unwrap_or(0);
        if piece == 0 || !self.backend.overlapping_imports() {
            return vec![r];
        }
        let largest = self.state().largest_binding.max(LEAST_OVERLAP);
        let overlap = largest.checked_next_multiple_of(self.align).unwrap_or(piece).min(piece);
        pieces(r, piece, overlap)
    }

    /// Closes the background threads' queue and joins `threads`.
    pub(super) fn close_queue(&self, threads: &mut Vec<JoinHandle<()>>) {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
        self.queued.notify_all();
        self.idle.notify_all();
        for t in threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Imports `r` (a pool or a piece of one) on the background thread, populating it first:
    /// ahead of pool `pool`'s bindings, or (`None`) a pool a binding imported only part of. Left
    /// out where live imports cover it (the latter: where one does), where it overlaps one in
    /// flight (the latter waits for that to land first), where it is cooling or failed ahead before, where the device refuses overlaps
    /// and it overlaps an import it cannot take in, and past the budget of bytes ahead (a pool
    /// over pages a binding imported is left out before its first piece: [`Core::run_ahead`]).
    /// Unused imports ahead inside `r` are taken in. Returns whether the pool's next piece is
    /// still wanted: not past the budget, after a failure, once the pool is released or after
    /// [`Importer::release_all`].
    pub(super) fn ahead(&self, pool: Option<PoolId>, r: Planned, epoch: u64) -> bool {
        let later = match self.take_off(pool, r, epoch) {
            ControlFlow::Continue(later) => later,
            ControlFlow::Break(wanted) => return wanted,
        };
        // Off the lock, so that bindings go on; one that this range covers may wait for it.
        for import in later {
            self.release(import);
        }
        let made = HostSpan::of(&self.space, r.lo, r.len())
            .map_err(|e| self.wrap(r, e))
            .and_then(|span| self.make(span, r, true));
        let more = self.land(pool, r, epoch, made);
        super::state::log_made();
        more
    }

    /// [`Core::ahead`]'s checks and budget, under the lock: `r` put in flight, and the imports
    /// it takes in for the caller to release off the lock; or whether the pool's next piece is
    /// still wanted, where `r` is left out.
    fn take_off(&self, pool: Option<PoolId>, r: Planned, epoch: u64) -> ControlFlow<bool, Vec<B::Import>> {
        let mut st = self.state();
        if st.epoch != epoch || pool.is_some_and(|id| st.pools.get(id).is_none()) {
            return ControlFlow::Break(false);
        }
        // A pool whole over a binding's part waits for another thread's import in flight over it
        // rather than being left out: nothing would ask for it again, and bindings across the
        // part's border would import their pages again all session.
        while pool.is_none() && st.in_flight_over(r) && st.epoch == epoch {
            st = self.landed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        if st.epoch != epoch {
            return ControlFlow::Break(false);
        }
        let cooling = st.cooling.get(&r).is_some_and(|&until| Instant::now() < until);
        // A pool whole over its bindings' parts is wanted until one import holds it: parts that
        // hold all its pages between them still leave a binding across their border in neither.
        let covered = match pool {
            Some(_) => st.covered(r.lo, r.hi),
            None => st.covering(r.lo, r.hi).is_some(),
        };
        if r.is_empty() || covered || st.in_flight_over(r) || cooling || st.ahead_failed.contains(&r) {
            return ControlFlow::Break(true);
        }
        // (key, end, unused and inside `r`)
        let over: Vec<((u64, u64), u64, bool)> = st
            .overlapping(r.lo, r.hi)
            .map(|(k, v)| (*k, v.hi, v.ahead.is_some() && r.lo <= k.0 && v.hi <= r.hi))
            .collect();
        let overlaps_ok = self.backend.overlapping_imports();
        if !overlaps_ok && !over.iter().all(|o| o.2) {
            return ControlFlow::Break(true);
        }
        // Imports ahead take at most their share of the cap on live imports: bindings keep room.
        if self.slots.load(Ordering::Acquire) >= super::cap::ahead_share(self.cap) || !self.has_room() {
            st.stats.ahead_over_budget += 1;
            return ControlFlow::Break(false);
        }
        if pool.is_some() {
            let freed: u64 = over.iter().filter(|o| o.2).map(|o| o.1 - o.0.0).sum();
            // Only the pools policy asks for imports ahead.
            let budget = self.cfg.policy.pools_config().map_or(0, |p| p.ahead);
            if st.stats.ahead_bytes - freed + r.len() > budget {
                st.stats.ahead_over_budget += 1;
                return ControlFlow::Break(false);
            }
            st.stats.ahead_bytes += r.len();
            st.stats.ahead_peak_bytes = st.stats.ahead_peak_bytes.max(st.stats.ahead_bytes);
        }
        let mut later = Vec::new();
        if !overlaps_ok {
            later.extend(over.iter().filter_map(|(k, _, _)| self.take_out(&mut st, *k)));
        }
        let est = st.cost.estimate(r.len());
        // Its slot under the cap, taken under the state's lock (given back if it fails).
        self.slots.fetch_add(1, Ordering::AcqRel);
        st.in_flight.push(Flight { r, since: Instant::now(), est });
        ControlFlow::Continue(later)
    }

    /// [`Core::ahead`]'s landing: the import `made` of `r` recorded (and released again where
    /// nothing will use it), or its failure counted; the flight ended once what it took in is
    /// released. Whether the pool's next piece is still wanted.
    fn land(
        &self,
        pool: Option<PoolId>,
        r: Planned,
        epoch: u64,
        made: Result<(B::Import, Duration), ImportError>,
    ) -> bool {
        let mut later = Vec::new();
        let mut st = self.state();
        let ok = made.is_ok();
        match made {
            Ok((import, took)) => {
                for k in st.unused_inside(r.lo, r.hi) {
                    later.extend(self.take_out(&mut st, k));
                }
                // A binding may have imported the pool while this was in flight.
                let redundant = st.covering(r.lo, r.hi).is_some();
                self.record(&mut st, r, import, took, pool.map_or(Made::Widen, Made::Ahead));
                if let Some(id) = pool
                    && (redundant || st.pools.get(id).is_none())
                {
                    // Released while in flight, or imported by its binding: nothing will use it.
                    let key = (r.lo, st.seq);
                    later.extend(self.take_out(&mut st, key));
                }
            }
            Err(e) => {
                self.slots.fetch_sub(1, Ordering::AcqRel);
                if pool.is_some() {
                    st.stats.ahead_bytes -= r.len();
                }
                st.stats.ahead_failures += 1;
                st.ahead_failed.insert(r);
                tracing::warn!("import ahead of {r} failed: {}", chain(&e));
            }
        }
        let st = self.end_flight(st, r, later);
        ok && st.epoch == epoch && pool.is_none_or(|id| st.pools.get(id).is_some())
    }

    /// Ends the background flight of `r`: releases `later` (what its import took in or replaced)
    /// off the lock first, so the flight ends once they are released (`release_all` waits for
    /// it), then takes the flight out and wakes the waiters. Returns the state's lock again.
    pub(super) fn end_flight<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<B::Import>>,
        r: Planned,
        later: Vec<B::Import>,
    ) -> MutexGuard<'a, State<B::Import>> {
        if !later.is_empty() {
            self.landed.notify_all();
            drop(st);
            for import in later {
                self.release(import);
            }
            st = self.state();
        }
        st.in_flight.retain(|f| f.r != r);
        self.landed.notify_all();
        st
    }
}

/// `r` cut into pieces that start `piece` apart and reach `overlap` past the next one's start
/// (the last ends at `r`'s end): a range of at most `overlap` bytes inside `r` lies whole in one
/// of them.
pub(super) fn pieces(r: Planned, piece: u64, overlap: u64) -> Vec<Planned> {
    let mut out = Vec::new();
    let mut lo = r.lo;
    loop {
        match piece.checked_add(overlap).and_then(|n| lo.checked_add(n)).filter(|&hi| hi < r.hi) {
            Some(hi) => out.push(Planned { lo, hi }),
            None => {
                out.push(Planned { lo, hi: r.hi });
                return out;
            }
        }
        lo += piece;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::super::cost::ImportCost;
    use super::super::bind::AtWork;
    use super::super::{ImportConfig, ImportPolicy, PoolsConfig};
    use super::*;
    use crate::space::Space;

    /// `len` bytes from `lo`.
    fn sized(lo: u64, len: u64) -> Planned {
        Planned { lo, hi: lo + len }
    }

    #[test]
    fn the_queue_gives_widenings_smallest_first_then_pools_then_populates() {
        let t = Instant::now();
        let mut q = AheadQueue::default();
        q.populate.push_back((0, 4096, false));
        q.pools.push_back((PoolId(7), 1));
        let asked = [(0x10000, 8 << 20), (0x900000, 64 << 10), (0xa00000, 1 << 20), (0xb00000, 64 << 10)];
        for (e, (lo, len)) in (1..).zip(asked) {
            q.widen.push_back((sized(lo, len), e, t));
        }
        let mut order = Vec::new();
        while let Some(job) = q.pop(t + WIDEN_OLDEST / 2) {
            order.push(match job {
                AheadJob::Widen(w, e) => format!("widen {}K/{e}", w.len() >> 10),
                AheadJob::Pool(id, e) => format!("pool {}/{e}", id.0),
                AheadJob::Merge(r, _, e) => format!("merge {}K/{e}", r.len() >> 10),
                AheadJob::Populate { lo, hi, .. } => format!("populate {}", hi - lo),
            });
        }
        // Equal sizes keep the order asked.
        let want = ["widen 64K/2", "widen 64K/4", "widen 1024K/3", "widen 8192K/1", "pool 7/1", "populate 4096"];
        assert_eq!(order, want);
        assert!(q.is_empty());
    }

    /// A pool whose widening was asked for by several bindings' parts goes before smaller ones
    /// asked once, and is given once (in the latest epoch asked).
    #[test]
    fn the_queue_gives_the_widening_asked_most_first_and_once() {
        let t = Instant::now();
        let mut q = AheadQueue::default();
        let (big, small) = (sized(0x100000, 8 << 20), sized(0x900000, 64 << 10));
        q.widen.push_back((big, 1, t));
        q.widen.push_back((small, 1, t));
        q.widen.push_back((big, 2, t));
        let mut order = Vec::new();
        while let Some(AheadJob::Widen(w, e)) = q.pop(t) {
            order.push((w.len() >> 10, e));
        }
        assert_eq!(order, [(8 << 10, 2), (64, 1)]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_widening_asked_long_enough_ago_goes_before_smaller_ones() {
        let t = Instant::now();
        let mut q = AheadQueue::default();
        q.widen.push_back((sized(0x10000, 8 << 20), 1, t));
        q.widen.push_back((sized(0x900000, 64 << 10), 2, t + WIDEN_OLDEST));
        q.widen.push_back((sized(0xa00000, 128 << 10), 3, t + WIDEN_OLDEST));
        let epochs = |q: &mut AheadQueue, now: Instant| {
            std::iter::from_fn(|| match q.pop(now)? {
                AheadJob::Widen(_, e) => Some(e),
                _ => None,
            })
            .collect::<Vec<u64>>()
        };
        // At the age the large one goes first; the others keep smallest first.
        assert_eq!(epochs(&mut q, t + WIDEN_OLDEST), [1, 2, 3]);
        q.widen.push_back((sized(0x10000, 8 << 20), 1, t));
        q.widen.push_back((sized(0x900000, 64 << 10), 2, t));
        // Just before it, smallest first.
        assert_eq!(epochs(&mut q, t + WIDEN_OLDEST - Duration::from_millis(1)), [2, 1]);
    }

    #[test]
    fn pieces_overlap_by_the_overlap_and_end_at_the_range_end() {
        let r = |lo, hi| Planned { lo, hi };
        assert_eq!(pieces(r(0, 100), 40, 10), vec![r(0, 50), r(40, 90), r(80, 100)]);
        assert_eq!(pieces(r(0, 90), 40, 10), vec![r(0, 50), r(40, 90)]);
        assert_eq!(pieces(r(0, 30), 40, 10), vec![r(0, 30)]);
        // Past the top of the address space: one piece, no overflow.
        assert_eq!(pieces(r(u64::MAX - 100, u64::MAX), u64::MAX - 10, 40), vec![r(u64::MAX - 100, u64::MAX)]);
        let top = pieces(r(u64::MAX - 100, u64::MAX), 40, 40);
        assert_eq!(top, vec![r(u64::MAX - 100, u64::MAX - 20), r(u64::MAX - 60, u64::MAX)]);
    }

    /// A background thread commits a pool's reserved pages only once no binding is at its
    /// import: the commit holds the space's lock across an mprotect that queues for the
    /// memory-map lock, which the binding's hold, `mincore` and pin need.
    #[test]
    fn a_background_commit_waits_for_a_binding_at_its_import() {
        let space = Arc::new(Space::with_window(64 << 20).unwrap());
        let free =
            ImportCost { fixed: Duration::ZERO, untouched_per_mib: Duration::ZERO, populated_per_mib: Duration::ZERO };
        let pools = PoolsConfig::default().cost(Some(free)).ahead_threads(1);
        let cfg = ImportConfig::default().chunk(1 << 20).policy(ImportPolicy::Pools(pools));
        let imp = Importer::new(space.clone(), crate::import::Pin::new(), cfg).unwrap();
        let (lo, len) = (4u64 << 20, 256u64 << 10);
        let pool = imp.add_pool(lo, len).unwrap();
        let range = space.range(lo, len).unwrap();
        let at_work = AtWork::new(&imp.core.binding_imports);
        imp.send(AheadJob::Pool(pool, imp.core.state().epoch));
        let until = Instant::now() + Duration::from_millis(100);
        while imp.in_flight().is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(imp.in_flight().len(), 1, "the pool is in flight");
        std::thread::sleep(Duration::from_millis(50));
        assert!(space.allocations_in(range).is_empty(), "committed beside a binding at its import");
        drop(at_work);
        imp.settle();
        assert_eq!(space.allocations_in(range).iter().map(|a| a.range.len()).sum::<u64>(), len);
        assert_eq!(imp.stats().ahead_imports, 1);
    }
}
