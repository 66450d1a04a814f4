//! The cap on live imports: [`super::ImportConfig::max_live`], by default three quarters of
//! the backend's limit on live allocations ([`default_cap`]; Vulkan's
//! `maxMemoryAllocationCount`, 4,096 on some Windows drivers: reference/000), leaving the rest to
//! the embedder's own allocations on the same device. The importer counts the backend imports it
//! holds or is making ([`Core::slots`]: a slot is taken under the state's lock before the backend
//! is called, and given back when the call fails or the import is released). It keeps the count
//! at the cap by releasing and merging, and where nothing makes room it passes the cap rather
//! than leave a binding without its import; the backend's own limit it never passes.
//!
//! A binding's import that would pass the cap is handled here, in this order:
//! 1. imports made ahead that no binding has used are released (no binding has their handles);
//! 2. releases under way (off the lock, on other threads) are waited for, a little (counted in
//!    [`super::Stats::cap_waits`]);
//! 3. imports that another live import covers whole are released: every binding they would
//!    serve, the larger one serves (the chunks policy without spans keeps such imports);
//! 4. the import is merged with its nearest live neighbour: the range grows over it (at most
//!    [`MERGE_LIMIT`] and the backend's largest import) and every live import inside the grown
//!    range is released before it is made, so the count does not grow;
//! 5. else the two neighbouring live imports whose union is the smallest (within the same
//!    limits) are merged into one, which frees a slot for the binding's own import;
//! 6. otherwise the binding imports over the cap (counted in [`super::Stats::over_cap`], a
//!    warning logged the first time): every live import is one a binding may still use and no
//!    two are near enough to merge, so nothing the importer holds can go, and a binding served
//!    is worth more than a count kept. Only the backend's own limit can refuse it (then as a
//!    driver's refusal: counted in `failures`, held cooling). Releases (pools released,
//!    [`super::Importer::handles_done`] after merges) bring the count back under the cap, and
//!    the next imports at the cap make room again.
//!
//! So [`super::ImportError::LiveCap`] is no longer returned and [`super::Stats::capped`] stays
//! 0. Steps 3 to 5 end imports that bindings may have been given (their
//! [`super::Bound::handle`] ends with them), as a re-import on a device that refuses overlaps
//! (CUDA) always does. Imports ahead (pools policy) use at most [`ahead_share`] of the cap, so
//! that bindings keep room of their own; a merge once a pool is whole (module `merge`) takes a
//! slot only where one is free.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::super::backend::Backend;
use super::super::plan::Planned;
use super::Core;
use super::state::State;

/// The largest range a merge at the cap grows an import to (or the chunk, if larger): the seed's
/// span cap (64 MB, reference/000), the size its imports were measured at.
pub const MERGE_LIMIT: u64 = 64 << 20;

/// How long a binding at the cap waits for releases under way on other threads.
const RELEASE_WAIT: Duration = Duration::from_millis(100);

/// The default cap on live imports where the backend limits them to `max_count`: three
/// quarters of it (a quarter left to the embedder's own allocations on the device: a renderer
/// sub-allocates, so a few hundred of 4,096 is ample); no cap where the backend has no limit.
pub(super) fn default_cap(max_count: u64) -> u64 {
    // 2^32 - 1 (what lavapipe and NVIDIA report) is no limit a session can meet.
    if max_count >= u64::from(u32::MAX) { u64::MAX } else { max_count - max_count / 4 }
}

/// The most live imports the background threads may bring the count to: three quarters of the
/// cap, leaving bindings at least one.
pub(super) fn ahead_share(cap: u64) -> u64 {
    cap - (cap / 4).max(1).min(cap)
}

impl<B: Backend> Core<B> {
    /// Whether one more backend import fits: under the importer's cap, and under the backend's
    /// own count limit (a backend shared with other importers counts theirs too).
    pub(super) fn has_room(&self) -> bool {
        let b = self.backend.budget().get();
        self.slots.load(Ordering::Acquire) < self.cap && b.count < b.max_count
    }

    /// Makes room for one more import under the cap (steps 1 to 3 of the module's), under the
    /// state's lock; whether there is room now.
    pub(super) fn make_room(&self, st: &mut State<B::Import>) -> bool {
        if self.has_room() {
            return true;
        }
        // 1. Imports made ahead and never used, the oldest first.
        let mut unused: Vec<(u64, u64)> =
            st.imports.iter().filter(|(_, v)| v.ahead.is_some()).map(|(k, _)| *k).collect();
        unused.sort_by_key(|k| k.1);
        for k in unused {
            if self.has_room() {
                break;
            }
            self.release_unused(st, k);
            st.stats.cap_releases += 1;
        }
        // 2. Releases under way on other threads (they take no lock of the importer's).
        let until = Instant::now() + RELEASE_WAIT;
        let mut done = self.released.0.lock().unwrap_or_else(|p| p.into_inner());
        if !self.has_room() && self.releasing.load(Ordering::Acquire) > 0 {
            st.stats.cap_waits += 1;
        }
        while !self.has_room() && self.releasing.load(Ordering::Acquire) > 0 {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            done = self.released.1.wait_timeout(done, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        drop(done);
        // 3. Imports another live import covers whole.
        while !self.has_room() {
            let Some(k) = self.covered_import(st) else { break };
            if let Some(import) = self.take_out(st, k) {
                self.release(import);
                st.stats.cap_releases += 1;
            }
        }
        self.has_room()
    }

    /// Step 6: `r` is imported over the cap (its slot taken all the same): counted, and logged
    /// the first time.
    pub(super) fn over_cap(&self, st: &mut State<B::Import>, r: Planned) {
        st.stats.over_cap += 1;
        if st.stats.over_cap == 1 {
            let live = self.slots.load(Ordering::Acquire);
            tracing::warn!(
                "{r} imported over the cap of {} live imports ({live} live, every one a binding may use, none near \
                 enough to merge)",
                self.cap
            );
        }
    }

    /// A live import that another live import covers whole (the first by address).
    fn covered_import(&self, st: &State<B::Import>) -> Option<(u64, u64)> {
        st.imports
            .iter()
            .find(|(k, v)| st.overlapping(k.0, v.hi).any(|(o, w)| o != *k && o.0 <= k.0 && v.hi <= w.hi))
            .map(|(k, _)| *k)
    }

    /// Step 4: `r` grown over its nearest live import (the smallest union), within
    /// [`MERGE_LIMIT`] (or the chunk), the backend's largest import and the window, and the keys
    /// of every live import inside the grown range (at least one). Where the device refuses
    /// overlaps, not over an import in flight. `None` where no live import is near enough.
    pub(super) fn merge(&self, st: &State<B::Import>, r: Planned) -> Option<(Planned, Vec<(u64, u64)>)> {
        let limit = self.merge_limit();
        let union =
            |(k, v): (&(u64, u64), &super::state::Live<B::Import>)| Planned { lo: r.lo.min(k.0), hi: r.hi.max(v.hi) };
        let grown = st
            .imports
            .iter()
            .map(union)
            .filter(|u| u.len() <= limit)
            .filter(|u| self.backend.overlapping_imports() || !st.in_flight_over(*u))
            .min_by_key(|u| (u.len(), u.lo))?;
        // Where the device refuses overlaps, every import the range overlaps is taken in (its
        // union may grow past the limit: then no merge).
        let (grown, keys) = if self.backend.overlapping_imports() {
            let inside = st.overlapping(grown.lo, grown.hi).filter(|(k, v)| grown.lo <= k.0 && v.hi <= grown.hi);
            (grown, inside.map(|(k, _)| *k).collect::<Vec<_>>())
        } else {
            let (lo, hi, keys) = st.union(grown.lo, grown.hi);
            (Planned { lo, hi }, keys)
        };
        (grown.len() <= limit && !keys.is_empty()).then_some((grown, keys))
    }

    /// The largest range a merge at the cap makes: [`MERGE_LIMIT`] or the chunk, within the
    /// backend's largest import and the window.
    fn merge_limit(&self) -> u64 {
        let max_single = self.backend.budget().get().max_single;
        MERGE_LIMIT.max(self.cfg.chunk).min(max_single).min(self.space.window())
    }

    /// Step 5: merges the two neighbouring live imports (by start) whose union is the smallest,
    /// within the merge limit, into one import of their union (through [`Core::import_with`],
    /// whose merge takes both in); whether that made room.
    pub(super) fn compact(&self, st: &mut State<B::Import>) -> bool {
        let limit = self.merge_limit();
        let ends: Vec<(u64, u64)> = st.imports.iter().map(|(k, v)| (k.0, v.hi)).collect();
        let best = ends
            .windows(2)
            .map(|w| Planned { lo: w[0].0, hi: w[0].1.max(w[1].1) })
            .filter(|u| u.len() <= limit)
            .filter(|u| self.backend.overlapping_imports() || !st.in_flight_over(*u))
            .min_by_key(|u| (u.len(), u.lo));
        let Some(u) = best else { return false };
        if let Err(e) = self.import_with(st, u, false) {
            tracing::debug!("at the cap: merging two live imports into {u} failed: {}", super::chain(&e));
        }
        self.has_room()
    }
}
