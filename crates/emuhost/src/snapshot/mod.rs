//! Snapshots of a guest range: save states, rewind and run-ahead.
//!
//! A [`Snapshots`] keeps copies of a guest range's pages, taken with [`Snapshots::take`], and
//! puts a snapshot back with [`Snapshots::restore`]: the bytes of its committed pages, which
//! pages were committed, and the protection the space gave each (pages committed since are
//! decommitted). A restore that would have to decommit pages a hold keeps mapped (a GPU import:
//! [`Space::hold`]) is refused before anything changes, naming them; so is a range that holds a
//! shared view (sections' pages may show at several addresses: snapshots cover private memory
//! only).
//!
//! The restore's own writes are host writes into tracked memory, made inside
//! [`Tracker::host_write`], and its commits, decommits and protections go through the space, so
//! every reader of the tracker (a buffer cache, a texture cache) sees the restored pages as
//! written at its next collect and uploads them again.
//!
//! The bytes are copied at each take: every committed page of the range (this first version; a
//! later one copies only the pages written since the previous take). Pages without read access
//! are given it for the copy and their protection back after it, through the space.
//!
//! The caller stops the guest's writes to the range while it takes or restores: a write that
//! runs beside a take may be in the snapshot or not, byte by byte.
//!
//! ```
//! use std::sync::Arc;
//! use emuhost::snapshot::{SnapshotConfig, Snapshots};
//! use emuhost::space::{GuestAddr, Prot, Space, page_size};
//! use emuhost::watch::{Tracker, TrackerConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let space = Arc::new(Space::with_window(16 << 20)?);
//! let range = space.range(0, 8 * page_size())?;
//! space.commit(range, Prot::READ_WRITE)?;
//! let tracker = Tracker::new(&space, &TrackerConfig::default())?;
//! let snapshots = Snapshots::new(&tracker, range, &SnapshotConfig::default())?;
//!
//! space.store(GuestAddr(100), b"before")?;
//! let id = snapshots.take()?;
//! space.store(GuestAddr(100), b"after!")?;
//! snapshots.restore(id)?;
//! let mut buf = [0; 6];
//! space.read(GuestAddr(100), &mut buf)?;
//! assert_eq!(&buf, b"before");
//! # Ok(())
//! # }
//! ```

mod config;
mod error;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use config::SnapshotConfig;
pub use error::SnapshotError;

use crate::space::{GuestRange, Prot, Space};
use crate::watch::Tracker;

/// A snapshot's id, unique for its [`Snapshots`] (never reused). Prints as its number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SnapshotId(u64);

impl SnapshotId {
    /// An id from its number ([`SnapshotId::get`]), as a caller that kept only the number has it
    /// (the C ABI). Any number makes an id; one that no live snapshot has is refused by the calls
    /// that take it ([`SnapshotError::UnknownSnapshot`]).
    pub fn new(n: u64) -> SnapshotId {
        SnapshotId(n)
    }

    /// Its number: the takes of its [`Snapshots`] up to and including it (1 for the first).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What a [`Snapshots::restore`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Restored {
    /// Pages whose bytes were put back.
    pub pages: u64,
    /// Pages decommitted (committed now, not at the snapshot).
    pub decommitted: u64,
}

/// The counters of a [`Snapshots`] ([`Snapshots::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SnapshotStats {
    /// Snapshots taken.
    pub taken: u64,
    /// Snapshots live now.
    pub live: u64,
    /// Snapshots released by [`Snapshots::release`].
    pub released: u64,
    /// Snapshots dropped to keep [`SnapshotStats::bytes_kept`] within the budget (oldest first).
    pub dropped_for_budget: u64,
    /// Pages copied by takes.
    pub pages_copied: u64,
    /// Bytes of page copies kept now.
    pub bytes_kept: u64,
    /// Pages whose bytes restores put back.
    pub pages_restored: u64,
    /// Time spent in takes, on the callers' threads.
    pub take_time: Duration,
    /// Time spent in restores, on the callers' threads.
    pub restore_time: Duration,
}

/// One snapshot: the committed runs of the range with their protection, and their bytes.
struct Snap {
    runs: Vec<(GuestRange, Prot)>,
    bytes: Vec<Box<[u8]>>,
}

impl Snap {
    fn bytes(&self) -> u64 {
        self.bytes.iter().map(|b| b.len() as u64).sum()
    }
}

#[derive(Default)]
struct State {
    /// The last id given.
    last: u64,
    snaps: BTreeMap<u64, Snap>,
    stats: SnapshotStats,
}

/// Snapshots of one guest range of a tracker's space (see the [module docs](self)). `Send +
/// Sync`: takes, restores and releases from any thread run one at a time.
pub struct Snapshots {
    tracker: Arc<Tracker>,
    space: Arc<Space>,
    range: GuestRange,
    config: SnapshotConfig,
    state: Mutex<State>,
}

impl fmt::Debug for Snapshots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Snapshots").field("range", &self.range).field("config", &self.config).finish()
    }
}

impl Snapshots {
    /// Snapshots of `range` in `tracker`'s space, as `config` says. Arms `range` on the tracker
    /// (an arm of armed pages keeps their tracking; the range stays armed after the snapshots go).
    ///
    /// # Errors
    /// [`SnapshotError::Space`] for a range outside the space's window, [`SnapshotError::Watch`]
    /// where the arm fails.
    pub fn new(tracker: &Arc<Tracker>, range: GuestRange, config: &SnapshotConfig) -> Result<Snapshots, SnapshotError> {
        let space = tracker.space().clone();
        let range = space.range(range.start().0, range.len())?;
        tracker.arm(range)?;
        Ok(Snapshots { tracker: tracker.clone(), space, range, config: *config, state: Mutex::default() })
    }

    /// The range the snapshots cover.
    pub fn range(&self) -> GuestRange {
        self.range
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Refuses a range with a shared view in it.
    fn no_views(&self) -> Result<(), SnapshotError> {
        match self.space.views_in(self.range).first() {
            Some(v) => Err(SnapshotError::Views { range: self.range, view: v.range }),
            None => Ok(()),
        }
    }

    /// Takes a snapshot of the range: its committed pages' bytes and protections, and which
    /// pages are committed. Past the budget, the oldest snapshots are dropped (never this one).
    ///
    /// # Errors
    /// [`SnapshotError::Views`] where the range holds a shared view; [`SnapshotError::Space`]
    /// where a copy or a protection fails (nothing is kept then).
    pub fn take(&self) -> Result<SnapshotId, SnapshotError> {
        let started = Instant::now();
        let mut st = self.state();
        self.no_views()?;
        let runs = self.space.protections(self.range);
        let mut bytes = Vec::with_capacity(runs.len());
        for &(run, prot) in &runs {
            bytes.push(self.copy(run, prot)?);
        }
        let snap = Snap { runs, bytes };
        st.last += 1;
        let id = st.last;
        st.stats.taken += 1;
        st.stats.pages_copied += snap.runs.iter().map(|(r, _)| r.pages()).sum::<u64>();
        st.stats.bytes_kept += snap.bytes();
        st.snaps.insert(id, snap);
        self.keep_to_budget(&mut st);
        st.stats.live = st.snaps.len() as u64;
        st.stats.take_time += started.elapsed();
        Ok(SnapshotId(id))
    }

    /// The bytes of `run`, committed with `prot`: given read access for the copy where it has
    /// none, and its protection back after it.
    fn copy(&self, run: GuestRange, prot: Prot) -> Result<Box<[u8]>, SnapshotError> {
        let mut buf = vec![0u8; run.len() as usize].into_boxed_slice();
        if prot.read {
            self.space.read(run.start(), &mut buf)?;
            return Ok(buf);
        }
        self.space.protect(run, Prot { read: true, ..prot })?;
        let read = self.space.read(run.start(), &mut buf);
        self.space.protect(run, prot)?;
        read?;
        Ok(buf)
    }

    /// Drops the oldest snapshots while the bytes kept pass the budget, never the newest.
    fn keep_to_budget(&self, st: &mut State) {
        let Some(budget) = self.config.budget_bytes else { return };
        while st.stats.bytes_kept > budget && st.snaps.len() > 1 {
            let Some((_, snap)) = st.snaps.pop_first() else { break };
            st.stats.bytes_kept -= snap.bytes();
            st.stats.dropped_for_budget += 1;
        }
    }

    /// Puts snapshot `id` back: the bytes of the pages it had committed, their protection, and
    /// which pages are committed (pages committed since are decommitted). Later snapshots stay
    /// valid. Every reader of the tracker sees the restored pages as written at its next collect.
    ///
    /// # Errors
    /// [`SnapshotError::UnknownSnapshot`] for an id no live snapshot has;
    /// [`SnapshotError::Views`] where the range holds a shared view; [`SnapshotError::Held`]
    /// where pages to decommit are held (a GPU import): these are refused before anything
    /// changes. [`SnapshotError::Space`] or [`SnapshotError::Watch`] where a call fails midway.
    pub fn restore(&self, id: SnapshotId) -> Result<Restored, SnapshotError> {
        let started = Instant::now();
        let mut st = self.state();
        let snap = st.snaps.get(&id.0).ok_or(SnapshotError::UnknownSnapshot(id))?;
        self.no_views()?;
        let now = self.space.protections(self.range);
        let drop = subtract(&now, &snap.runs);
        for &r in &drop {
            if let Some(held) = self.space.held(r) {
                return Err(SnapshotError::Held { id, range: r, held });
            }
        }
        let mut out = Restored::default();
        for &r in &drop {
            self.space.decommit(r)?;
            out.decommitted += r.pages();
        }
        for (&(run, prot), bytes) in snap.runs.iter().zip(&snap.bytes) {
            self.space.commit(run, Prot::READ_WRITE)?;
            self.tracker.host_write(run, || self.space.write(run.start(), bytes))??;
            if prot != Prot::READ_WRITE {
                self.space.protect(run, prot)?;
            }
            out.pages += run.pages();
        }
        st.stats.pages_restored += out.pages;
        st.stats.restore_time += started.elapsed();
        Ok(out)
    }

    /// Releases snapshot `id`: what only it kept is freed.
    ///
    /// # Errors
    /// [`SnapshotError::UnknownSnapshot`] for an id no live snapshot has.
    pub fn release(&self, id: SnapshotId) -> Result<(), SnapshotError> {
        let mut st = self.state();
        let snap = st.snaps.remove(&id.0).ok_or(SnapshotError::UnknownSnapshot(id))?;
        st.stats.bytes_kept -= snap.bytes();
        st.stats.released += 1;
        st.stats.live = st.snaps.len() as u64;
        Ok(())
    }

    /// The live snapshots, oldest first.
    pub fn live(&self) -> Vec<SnapshotId> {
        self.state().snaps.keys().map(|&k| SnapshotId(k)).collect()
    }

    /// The counters.
    pub fn stats(&self) -> SnapshotStats {
        self.state().stats
    }
}

/// The parts of the runs `a` that no run of `b` covers (both in address order, apart).
fn subtract(a: &[(GuestRange, Prot)], b: &[(GuestRange, Prot)]) -> Vec<GuestRange> {
    let mut out = Vec::new();
    for &(r, _) in a {
        let mut at = r.start().0;
        let end = r.end().0;
        for &(c, _) in b.iter().filter(|(c, _)| c.start().0 < end && r.start().0 < c.end().0) {
            if c.start().0 > at {
                out.push(GuestRange::from_bounds(at, c.start().0).expect("page-aligned"));
            }
            at = at.max(c.end().0);
        }
        if at < end {
            out.push(GuestRange::from_bounds(at, end).expect("page-aligned"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::space::page_size;

    #[test]
    fn snapshots_are_send_and_sync_and_ids_print_their_number() {
        fn is<T: Send + Sync>() {}
        is::<Snapshots>();
        let id = SnapshotId::new(u64::MAX);
        assert_eq!((id.get(), id.to_string()), (u64::MAX, u64::MAX.to_string()));
        assert!(SnapshotId::new(1) < SnapshotId::new(2));
    }

    #[test]
    fn subtract_leaves_the_parts_no_run_covers() {
        let p = page_size();
        let r = |a: u64, b: u64| (GuestRange::from_bounds(a * p, b * p).unwrap(), Prot::READ);
        let got = subtract(&[r(0, 10), r(12, 14)], &[r(2, 3), r(5, 11)]);
        let want: Vec<GuestRange> = [r(0, 2), r(3, 5), r(12, 14)].iter().map(|x| x.0).collect();
        assert_eq!(got, want);
        assert!(subtract(&[r(0, 4)], &[r(0, 4)]).is_empty());
    }
}
