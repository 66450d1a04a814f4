//! `emuhost_snapshots_t`: snapshots of a guest range (`emuhost::snapshot`): save states, rewind
//! and run-ahead. A snapshot is a number (`uint64_t`, never reused by its snapshots object), not
//! a handle: an id that no live snapshot has (never taken, released, or dropped for the memory
//! budget) is `EMUHOST_ERROR_INVALID_ARGUMENT`, as an importer's unknown pool id is.

use std::sync::Arc;
use std::time::Duration;

use emuhost::snapshot::{Restored, SnapshotId, SnapshotStats, Snapshots};
use emuhost::space::{GuestAddr, GuestRange};

use crate::entry;
use crate::error::{Error, emuhost_error_t};
use crate::ffi::{put, put_opt, slice_mut};
use crate::handle::{self, Kind};
use crate::settings::emuhost_settings_t;
use crate::watch::emuhost_tracker_t;

/// Snapshots of one guest range of a tracker's space (opaque): `emuhost_snapshots_take` copies
/// the range's committed pages, `emuhost_snapshots_restore` puts a snapshot back (bytes, which
/// pages are committed, their protection), `emuhost_snapshots_release` frees one.
///
/// Thread safety: any thread; takes, restores and releases run one at a time. The guest's
/// threads must not write the range while a take or a restore runs (a write beside a take may be
/// in the snapshot or not; one beside a restore makes it fail, see `emuhost_snapshots_restore`).
/// It keeps its tracker (and so the space) alive: the tracker and space handles may be deleted
/// before it, and the range stays armed until it goes.
pub struct emuhost_snapshots_t {
    _private: [u8; 0],
}

impl Kind for Snapshots {
    type C = emuhost_snapshots_t;
    const NAME: &'static str = "snapshots";
}

/// What a restore did (`emuhost_snapshots_restore`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct emuhost_restored_t {
    /// Pages whose bytes were put back (those whose content may have differed from the
    /// snapshot's).
    pub pages: u64,
    /// Pages decommitted: committed now, not at the snapshot.
    pub decommitted: u64,
}

impl From<Restored> for emuhost_restored_t {
    fn from(r: Restored) -> Self {
        Self { pages: r.pages, decommitted: r.decommitted }
    }
}

/// A snapshots object's counters (`emuhost_snapshots_stats`). Times in nanoseconds.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct emuhost_snapshot_stats_t {
    /// Snapshots taken.
    pub taken: u64,
    /// Snapshots live now.
    pub live: u64,
    /// Snapshots released by `emuhost_snapshots_release`.
    pub released: u64,
    /// Snapshots dropped to keep `bytes_kept` within the budget (`EMUHOST_SNAPSHOT_BUDGET_MB`),
    /// oldest first, never the newest.
    pub dropped_for_budget: u64,
    /// Pages copied by takes.
    pub pages_copied: u64,
    /// Bytes of page copies kept now (each page's bytes once for all the snapshots that share
    /// them).
    pub bytes_kept: u64,
    /// Pages whose bytes restores put back.
    pub pages_restored: u64,
    /// Time spent in takes, on the callers' threads.
    pub take_time_ns: u64,
    /// Time spent in restores, on the callers' threads.
    pub restore_time_ns: u64,
}

impl From<SnapshotStats> for emuhost_snapshot_stats_t {
    fn from(s: SnapshotStats) -> Self {
        let ns = |d: Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        Self {
            taken: s.taken,
            live: s.live,
            released: s.released,
            dropped_for_budget: s.dropped_for_budget,
            pages_copied: s.pages_copied,
            bytes_kept: s.bytes_kept,
            pages_restored: s.pages_restored,
            take_time_ns: ns(s.take_time),
            restore_time_ns: ns(s.restore_time),
        }
    }
}

fn get(snapshots: *const emuhost_snapshots_t, what: &str) -> Result<Arc<Snapshots>, Error> {
    handle::get::<Snapshots>(snapshots, what)
}

/// Snapshots of guest `addr..addr + len` in `tracker`'s space. Arms the range on the tracker (an
/// arm of armed pages keeps their tracking). `settings` may be NULL (defaults);
/// `EMUHOST_SNAPSHOT_BUDGET_MB` in them is the most MiB of page copies kept (past it a take drops
/// the oldest snapshots first, never the newest; unset: no limit). A range outside the window is
/// `EMUHOST_ERROR_OUT_OF_RANGE`, an unaligned or empty one `EMUHOST_ERROR_INVALID_ARGUMENT`.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_snapshots_new(
    tracker: *const emuhost_tracker_t,
    addr: u64,
    len: u64,
    settings: *const emuhost_settings_t,
    out: *mut *mut emuhost_snapshots_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let t = crate::watch::get(tracker, "emuhost_snapshots_new")?;
        let settings = crate::settings::read(settings, "emuhost_snapshots_new")?;
        // Checked before the range is armed, so a NULL out-pointer changes nothing.
        crate::ffi::check_ptr(out, "the out-pointer")?;
        let range = GuestRange::new(GuestAddr(addr), len)?;
        let s = Snapshots::new(&t, range, &settings.snapshot_config())?;
        // SAFETY: as the caller vouches.
        unsafe { handle::give(out, Arc::new(s)) }
    })
}

/// Deletes the snapshots object: every snapshot it keeps is freed, and its tracker is let go
/// (the range stays armed while the tracker lives). NULL does nothing; a handle deleted already
/// is `EMUHOST_ERROR_BAD_HANDLE`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_snapshots_delete(snapshots: *mut emuhost_snapshots_t) -> *mut emuhost_error_t {
    entry(|| handle::delete::<Snapshots>(snapshots))
}

/// Takes a snapshot of the range (its committed pages' bytes and protections, and which pages
/// are committed); `id` receives its number (1, 2, ... in the order of the takes). Past the
/// budget, the oldest snapshots are dropped first (never this one). A range holding a shared
/// view (a section's pages) is `EMUHOST_ERROR_REFUSED`: snapshots cover private memory only.
///
/// # Safety
/// `id` is NULL or writable (checked before anything is taken).
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_snapshots_take(
    snapshots: *const emuhost_snapshots_t,
    id: *mut u64,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(snapshots, "emuhost_snapshots_take")?;
        crate::ffi::check_ptr(id, "id")?;
        let taken = s.take()?;
        // SAFETY: as the caller vouches.
        unsafe { put(id, "id", taken.get()) }
    })
}

/// Puts snapshot `id` back: the bytes of the pages it had committed, their protection, and which
/// pages are committed (pages committed since are decommitted). Later snapshots stay valid; every
/// reader of the tracker sees the restored pages as written at its next collect. `restored` (may
/// be NULL) receives what was done.
///
/// Errors: an id no live snapshot has is `EMUHOST_ERROR_INVALID_ARGUMENT`; pages to decommit
/// that a GPU import holds, or a shared view in the range, are `EMUHOST_ERROR_REFUSED` before
/// anything changes. Guest writes that ran beside the restore are `EMUHOST_ERROR_REFUSED` too
/// (the message counts them): the range then holds the snapshot's bytes but for those pages;
/// stop the guest's threads and restore again.
///
/// # Safety
/// `restored` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_snapshots_restore(
    snapshots: *const emuhost_snapshots_t,
    id: u64,
    restored: *mut emuhost_restored_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(snapshots, "emuhost_snapshots_restore")?;
        // Checked before anything changes: a misaligned pointer is an error, not a restore
        // whose result is lost.
        if !restored.is_null() {
            crate::ffi::check_ptr(restored, "restored")?;
        }
        let r = s.restore(SnapshotId::new(id))?;
        // SAFETY: as the caller vouches.
        unsafe { put_opt(restored, "restored", r.into()) }
    })
}

/// Releases snapshot `id`: what only it kept is freed. An id no live snapshot has (released
/// already, dropped for the budget, never taken) is `EMUHOST_ERROR_INVALID_ARGUMENT`, and
/// nothing changes.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_snapshots_release(snapshots: *const emuhost_snapshots_t, id: u64) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(snapshots, "emuhost_snapshots_release")?;
        Ok(s.release(SnapshotId::new(id))?)
    })
}

/// Copies snapshot `id`'s bytes at guest `addr` into `buf` (`len` bytes), without restoring it:
/// a save state written to a file, a check. Bytes outside the snapshots' range, or on a page the
/// snapshot did not have committed, are `EMUHOST_ERROR_OUT_OF_RANGE` naming the first such byte
/// (`buf` is filled up to it); an id no live snapshot has is `EMUHOST_ERROR_INVALID_ARGUMENT`.
///
/// # Safety
/// `buf` points to `len` writable bytes (may be NULL where `len` is 0).
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_snapshots_read(
    snapshots: *const emuhost_snapshots_t,
    id: u64,
    addr: u64,
    buf: *mut u8,
    len: usize,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(snapshots, "emuhost_snapshots_read")?;
        // SAFETY: as the caller vouches.
        let buf = unsafe { slice_mut(buf, len, "buf") }?;
        Ok(s.read(SnapshotId::new(id), GuestAddr(addr), buf)?)
    })
}

/// The live snapshots' ids, oldest first: the first `cap` of them into `ids` (may be NULL where
/// `cap` is 0), and how many are live into `count` (may be NULL): ask with `cap` 0 for the
/// count, then again with room for it.
///
/// # Safety
/// `ids` points to `cap` writable `uint64_t`s; `count` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_snapshots_live(
    snapshots: *const emuhost_snapshots_t,
    ids: *mut u64,
    cap: usize,
    count: *mut usize,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(snapshots, "emuhost_snapshots_live")?;
        // Both checked before anything is written.
        // SAFETY: as the caller vouches.
        let ids = unsafe { slice_mut(ids, cap, "ids") }?;
        if !count.is_null() {
            crate::ffi::check_ptr(count, "count")?;
        }
        let live = s.live();
        for (out, id) in ids.iter_mut().zip(&live) {
            *out = id.get();
        }
        // SAFETY: as the caller vouches.
        unsafe { put_opt(count, "count", live.len()) }
    })
}

/// The snapshots object's counters.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_snapshots_stats(
    snapshots: *const emuhost_snapshots_t,
    out: *mut emuhost_snapshot_stats_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(snapshots, "emuhost_snapshots_stats")?;
        // SAFETY: as the caller vouches.
        unsafe { put(out, "the out-pointer", s.stats().into()) }
    })
}
