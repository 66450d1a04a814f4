//! Merges once whole (pools policy): a pool whose pages are all in live imports, two or more of
//! them inside it (background pieces, bindings' parts, a widening's pieces), is imported again
//! in one on a background thread (in slices of at most [`PoolsConfig::merge`](super::PoolsConfig::merge),
//! [`MERGE_LIMIT`](super::MERGE_LIMIT) by default; 0: no merges), and the imports it replaces are released as soon as no
//! binding needs them. So a session's live imports come to about one a pool (one a
//! [`MERGE_LIMIT`](super::MERGE_LIMIT) slice of a larger one) plus the parts and pieces not merged yet, instead of
//! one a piece: a pool of 40 MiB imported ahead in 4 MiB pieces holds 10 live imports until its
//! merge, then one.
//!
//! **Which imports a binding needs.** A [`super::Bound`]'s handle is valid while its import
//! lives, and the importer cannot see when the renderer is done with it. So an import whose
//! handle was given to a binding ([`super::state::Live::handed`]: the binding's own import, or
//! one a binding reused) is needed until the embedder says the handles it was given are done
//! with ([`Importer::handles_done`]; the replay says so at each frame), its pool is released, or
//! [`Importer::release_all`]. A replaced import that no binding was given (a piece made ahead
//! and never used, say) is released when the merge lands; one a binding was given serves no
//! binding after the merge (a binding finds the merge's import: `State::covering`) and is
//! released at the next [`Importer::handles_done`]. An embedder that never calls it keeps them
//! until their pool goes: safe, but then merges add to the live count rather than lower it.
//!
//! **When.** Only while the live count is at half the cap or above ([`merge_from`]): a merge
//! holds the driver for its whole pin, and bindings that come meanwhile wait for it there. With
//! no cap (a backend without a limit on live allocations, none set) nothing is merged.
//!
//! The merge's import is made as every background import is ([`Core::make`]): populated in
//! slices, in the driver one thread at a time, and only while no binding imports and no change
//! of the space's mappings is under way. Its pages are resident already (its pieces pinned
//! them), so its pin is at the populated cost. It needs a free slot under the cap on live
//! imports ([`Core::has_room`]); where none is free it is left out (the cap's own steps make
//! room: module `cap`). Where the backend refuses a page in two imports (CUDA), nothing is
//! merged (pools are imported whole there).

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::super::backend::{Backend, HostSpan};
use super::super::plan::{Planned, cover};
use super::super::pools::PoolId;
use super::ahead::pieces;
use super::state::{Flight, Made, State};
use super::{Core, ImportPolicy, Importer, background_threads, chain};

impl<B: Backend + 'static> Importer<B> {
    /// Tells the importer that the handles of every [`super::Bound`] it gave out before this
    /// call are no longer in use (the GPU work that read them is complete): imports a merge
    /// replaced since are released now (module `merge`). Call it where the renderer knows that,
    /// once a frame's work has completed, say, where it binds again each frame. Without it a
    /// replaced import is kept until its pool is released or [`Importer::release_all`].
    pub fn handles_done(&self) {
        let mut st = self.state();
        let replaced: Vec<(u64, u64)> = st.imports.iter().filter(|(_, v)| v.replaced).map(|(k, _)| *k).collect();
        for v in st.imports.values_mut() {
            v.handed = false;
        }
        let dead: Vec<B::Import> = replaced.into_iter().filter_map(|k| self.core.take_out(&mut st, k)).collect();
        drop(st);
        for import in dead {
            self.core.release(import);
        }
    }
}

/// The live count from which pools whole in several imports are merged: half the cap (none
/// where the backend has no limit on live allocations and none was set).
pub(super) fn merge_from(cap: u64) -> u64 {
    cap.div_ceil(2)
}

impl<B: Backend> Core<B> {
    /// Asks the background threads for a merge of each pool (or [`PoolsConfig::merge`](super::PoolsConfig::merge) slice) that
    /// `r`, just imported, overlaps and that is now whole in several live imports
    /// ([`Core::mergeable`]). Pools policy with overlapping imports and background threads only.
    pub(super) fn want_merges(&self, st: &State<B::Import>, r: Planned) {
        let limit = self.cfg.policy.pools_config().map_or(0, |p| p.merge);
        // Only where the count nears the cap: a merge holds the driver for its whole pin, and
        // bindings that come meanwhile wait for it there (on the H100 merges of 8 or 64 MiB raised
        // the time bindings waited from 41-44 to 61-73 ms a session for 15-20 % fewer live imports).
        if limit == 0
            || st.stats.live < merge_from(self.cap)
            || !matches!(self.cfg.policy, ImportPolicy::Pools(_))
            || !self.backend.overlapping_imports()
            || background_threads(&self.cfg) == 0
        {
            return;
        }
        let window = self.space.window();
        let overlap = st.largest_binding.max(64 << 10).next_multiple_of(self.align).min(limit);
        let mut wanted = Vec::new();
        for p in st.pools.overlapping(r.lo, r.hi) {
            let Some((lo, hi)) = cover(p.lo, p.hi, self.align) else { continue };
            let whole = Planned { lo, hi: hi.min(window) };
            if whole.is_empty() {
                continue;
            }
            for slice in pieces(whole, limit, overlap) {
                if slice.lo < r.hi && r.lo < slice.hi && self.mergeable(st, slice) {
                    wanted.push((slice, p.id));
                }
            }
        }
        if wanted.is_empty() {
            return;
        }
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        for (slice, id) in wanted {
            if !q.closed && !q.merges.iter().any(|m| m.0 == slice) {
                q.merges.push_back((slice, id, st.epoch));
                self.queued.notify_one();
            }
        }
    }

    /// Whether `r` is worth a merge now: every page in live imports, none of which covers it
    /// alone, at least two of them inside it (those the merge replaces). (An import in flight
    /// over it is checked when the merge runs: the one whose landing asks for the merge is
    /// still in flight then.)
    pub(super) fn mergeable(&self, st: &State<B::Import>, r: Planned) -> bool {
        let inside = st.overlapping(r.lo, r.hi).filter(|(k, v)| !v.replaced && r.lo <= k.0 && v.hi <= r.hi).count();
        inside >= 2 && st.covering(r.lo, r.hi).is_none() && st.covered(r.lo, r.hi)
    }

    /// A merge job: imports `r` (pool `id` whole, or a slice of it) in one where it is still
    /// worth it and a slot is free, and marks the live imports inside it replaced, releasing
    /// those no binding was given (module `merge`).
    pub(super) fn merge_whole(&self, r: Planned, id: PoolId, epoch: u64) {
        {
            let mut st = self.state();
            // One over it in flight asks again when it lands.
            if st.epoch != epoch || st.pools.get(id).is_none() || !self.mergeable(&st, r) || st.in_flight_over(r) {
                return;
            }
            if !self.has_room() {
                st.stats.merges_left += 1;
                return;
            }
            let est = st.cost.estimate_with(r.len(), r.len());
            // Its slot under the cap, taken under the state's lock (given back if it fails).
            self.slots.fetch_add(1, Ordering::AcqRel);
            st.in_flight.push(Flight { r, since: Instant::now(), est });
        }
        let made = HostSpan::of(&self.space, r.lo, r.len())
            .map_err(|e| self.wrap(r, e))
            .and_then(|span| self.make(span, r, true));
        let mut later = Vec::new();
        let mut st = self.state();
        match made {
            Ok((import, took)) => {
                self.record(&mut st, r, import, took, Made::Merge);
                let seq = st.seq;
                if st.pools.get(id).is_none() {
                    // Its pool was released while it was in flight: nothing will use it.
                    later.extend(self.take_out(&mut st, (r.lo, seq)));
                } else {
                    later.extend(self.replace_inside(&mut st, r, seq));
                }
            }
            Err(e) => {
                self.slots.fetch_sub(1, Ordering::AcqRel);
                st.stats.merges_left += 1;
                tracing::debug!("merge of {r} failed: {}", chain(&e));
            }
        }
        drop(self.end_flight(st, r, later));
    }

    /// Marks every live import inside `r` but the merge's (`seq`) replaced, and takes out those
    /// no binding was given, for the caller to release.
    fn replace_inside(&self, st: &mut State<B::Import>, r: Planned, seq: u64) -> Vec<B::Import> {
        let inside: Vec<(u64, u64)> = st
            .overlapping(r.lo, r.hi)
            .filter(|(k, v)| k.1 != seq && !v.replaced && r.lo <= k.0 && v.hi <= r.hi)
            .map(|(k, _)| *k)
            .collect();
        let mut dead = Vec::new();
        for k in inside {
            st.stats.merged_away += 1;
            let Some(v) = st.imports.get_mut(&k) else { continue };
            v.replaced = true;
            if !v.handed {
                dead.extend(self.take_out(st, k));
            }
        }
        dead
    }
}
