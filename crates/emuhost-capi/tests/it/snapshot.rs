//! Snapshots through the C ABI (`emuhost_snapshots_*`): a take and restore round trip by bytes,
//! releases, ids that are not live, NULL and stale handles, a double delete, the budget from the
//! settings, what a restore refuses, and the handles deleted in every order.

use std::ptr::{null, null_mut};

use emuhost_capi::*;

use crate::abi::{fails, ok, page, space};

const RW: u32 = EMUHOST_PROT_READ | EMUHOST_PROT_WRITE;

/// The platform's protection backend (armed pages read-only, a write taken by the fault handler).
#[cfg(not(windows))]
const PROTECTION: u32 = EMUHOST_WATCH_MPROTECT;
#[cfg(windows)]
const PROTECTION: u32 = EMUHOST_WATCH_GUARD;

/// A space of `pages` pages, its first `committed` committed read-write, a tracker on it with
/// `backend`, and snapshots of its first `pages` pages made with `settings` (may be NULL).
struct Setup {
    space: *mut emuhost_space_t,
    tracker: *mut emuhost_tracker_t,
    snapshots: *mut emuhost_snapshots_t,
    base: *mut u8,
}

fn setup(pages: u64, committed: u64, backend: u32, settings: *const emuhost_settings_t) -> Setup {
    let p = page();
    let s = space(pages);
    let (mut t, mut snaps) = (null_mut(), null_mut());
    // SAFETY: out-pointers to locals.
    unsafe {
        ok(emuhost_space_commit(s, 0, committed * p, RW));
        ok(emuhost_tracker_new(s, null(), backend, 0, &mut t));
        ok(emuhost_snapshots_new(t, 0, pages * p, settings, &mut snaps));
        let mut info = std::mem::zeroed::<emuhost_space_info_t>();
        ok(emuhost_space_info(s, &mut info));
        Setup { space: s, tracker: t, snapshots: snaps, base: info.host_base.cast() }
    }
}

/// Writes `byte` into the first `len` bytes at guest `addr` with the CPU, as guest code does (an
/// armed page faults into emuhost's handler with the protection backend).
fn guest_fill(base: *mut u8, addr: u64, len: usize, byte: u8) {
    for i in 0..len {
        // SAFETY: the test's committed, writable guest pages (armed ones fault into the tracker's
        // handler, which makes them writable).
        unsafe { std::ptr::write_volatile(base.add(addr as usize + i), byte) };
    }
}

/// The guest bytes `addr..addr + len`, read with the CPU (no space handle needed).
fn host_bytes(base: *const u8, addr: u64, len: usize) -> Vec<u8> {
    // SAFETY: the test's committed, readable guest pages, mapped while the space lives (its
    // tracker or snapshots keep it).
    (0..len).map(|i| unsafe { base.add(addr as usize + i).read_volatile() }).collect()
}

/// The guest bytes `addr..addr + len`, read through the space.
fn read(s: *const emuhost_space_t, addr: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    // SAFETY: a local buffer and its length.
    ok(unsafe { emuhost_space_read(s, addr, buf.as_mut_ptr().cast(), len) });
    buf
}

fn stats(snaps: *const emuhost_snapshots_t) -> emuhost_snapshot_stats_t {
    let mut st = emuhost_snapshot_stats_t::default();
    // SAFETY: an out-pointer to a local.
    ok(unsafe { emuhost_snapshots_stats(snaps, &mut st) });
    st
}

fn take(snaps: *const emuhost_snapshots_t) -> u64 {
    let mut id = 0;
    // SAFETY: an out-pointer to a local.
    ok(unsafe { emuhost_snapshots_take(snaps, &mut id) });
    id
}

/// Write, take, write over, restore, read back the first bytes: with both backends of the
/// platform (the first the self-test picks, and the protection one).
#[test]
fn a_restore_puts_the_taken_bytes_back() {
    let p = page();
    for backend in [EMUHOST_WATCH_AUTO, PROTECTION] {
        let x = setup(16, 16, backend, null());
        let len = (3 * p) as usize;
        guest_fill(x.base, p, len, 0x11);
        let before = read(x.space, 0, (16 * p) as usize);
        let id = take(x.snapshots);
        assert_eq!(id, 1);
        guest_fill(x.base, p, len, 0x22);
        guest_fill(x.base, 10 * p, 8, 0x33);
        assert_ne!(read(x.space, 0, (16 * p) as usize), before);
        let mut r = emuhost_restored_t { pages: 99, decommitted: 99 };
        // SAFETY: an out-pointer to a local.
        ok(unsafe { emuhost_snapshots_restore(x.snapshots, id, &mut r) });
        assert_eq!(read(x.space, 0, (16 * p) as usize), before, "backend {backend}");
        assert!(r.pages >= 4 && r.decommitted == 0, "{r:?}");
        // Again, without the result (NULL): the snapshot stays live after a restore.
        guest_fill(x.base, 0, 8, 0x44);
        // SAFETY: NULL asks for no result.
        ok(unsafe { emuhost_snapshots_restore(x.snapshots, id, null_mut()) });
        assert_eq!(read(x.space, 0, (16 * p) as usize), before);
        let st = stats(x.snapshots);
        assert_eq!((st.taken, st.live, st.released, st.dropped_for_budget), (1, 1, 0, 0), "{st:?}");
        assert!(st.pages_copied >= 4 && st.bytes_kept >= 4 * p && st.pages_restored > r.pages, "{st:?}");
        ok(emuhost_snapshots_delete(x.snapshots));
        ok(emuhost_tracker_delete(x.tracker));
        ok(emuhost_space_delete(x.space));
    }
}

/// A released id, one never taken, and one released twice are `INVALID_ARGUMENT` naming the
/// id, and change nothing; the counters follow.
#[test]
fn released_and_unknown_ids_are_invalid_arguments() {
    let p = page();
    let x = setup(8, 8, EMUHOST_WATCH_AUTO, null());
    let (a, b) = (take(x.snapshots), take(x.snapshots));
    assert_eq!((a, b), (1, 2));
    ok(emuhost_snapshots_release(x.snapshots, a));
    let gone = "snapshot 1 is not live";
    fails(emuhost_snapshots_release(x.snapshots, a), EMUHOST_ERROR_INVALID_ARGUMENT, gone);
    // SAFETY: NULL asks for no result.
    unsafe {
        fails(emuhost_snapshots_restore(x.snapshots, a, null_mut()), EMUHOST_ERROR_INVALID_ARGUMENT, gone);
        fails(
            emuhost_snapshots_restore(x.snapshots, 999, null_mut()),
            EMUHOST_ERROR_INVALID_ARGUMENT,
            "snapshot 999 is not live",
        );
        fails(emuhost_snapshots_restore(x.snapshots, 0, null_mut()), EMUHOST_ERROR_INVALID_ARGUMENT, "snapshot 0");
    }
    fails(emuhost_snapshots_release(x.snapshots, u64::MAX), EMUHOST_ERROR_INVALID_ARGUMENT, "is not live");
    let st = stats(x.snapshots);
    assert_eq!((st.taken, st.live, st.released), (2, 1, 1), "{st:?}");
    assert!(st.bytes_kept >= 8 * p, "the second snapshot's pages are kept: {st:?}");
    // The other snapshot is untouched.
    // SAFETY: NULL asks for no result.
    ok(unsafe { emuhost_snapshots_restore(x.snapshots, b, null_mut()) });
    ok(emuhost_snapshots_release(x.snapshots, b));
    assert_eq!((stats(x.snapshots).live, stats(x.snapshots).bytes_kept), (0, 0));
    ok(emuhost_snapshots_delete(x.snapshots));
    ok(emuhost_tracker_delete(x.tracker));
    ok(emuhost_space_delete(x.space));
}

/// A snapshot's bytes read without a restore (a save state), and the live ids listed oldest
/// first: bytes outside the range or on a page not committed at the take are `OUT_OF_RANGE`
/// naming the first, an id not live `INVALID_ARGUMENT`, a NULL buffer of non-zero length or
/// misaligned ids `NULL`/`INVALID_ARGUMENT`, and a short `cap` gets the first ids and the count.
#[test]
fn a_snapshots_bytes_are_read_without_a_restore_and_the_live_ids_listed() {
    let p = page();
    let x = setup(8, 6, EMUHOST_WATCH_AUTO, null());
    guest_fill(x.base, p, 16, 0x11);
    let a = take(x.snapshots);
    guest_fill(x.base, p, 16, 0x22);
    let b = take(x.snapshots);
    let c = take(x.snapshots);
    ok(emuhost_snapshots_release(x.snapshots, b));
    let snap_read = |id: u64, addr: u64, len: usize| {
        let mut buf = vec![0u8; len];
        // SAFETY: a local buffer and its length.
        let e = unsafe { emuhost_snapshots_read(x.snapshots, id, addr, buf.as_mut_ptr(), len) };
        (e, buf)
    };
    let (e, buf) = snap_read(a, p - 4, 24);
    ok(e);
    assert_eq!(buf, [&[0u8; 4][..], &[0x11; 16], &[0; 4]].concat());
    let (e, buf) = snap_read(c, p, 16);
    ok(e);
    assert_eq!(buf, [0x22; 16]);
    // The memory is not restored by a read.
    assert_eq!(host_bytes(x.base, p, 16), [0x22; 16]);
    // Pages 6 and 7 were never committed; past the range is out too.
    let (e, buf) = snap_read(a, 6 * p - 2, 8);
    fails(e, EMUHOST_ERROR_OUT_OF_RANGE, &format!("{:#x}", 6 * p));
    assert_eq!(&buf[..2], &[0, 0]);
    fails(snap_read(a, 8 * p, 1).0, EMUHOST_ERROR_OUT_OF_RANGE, "");
    fails(snap_read(a, u64::MAX, 1).0, EMUHOST_ERROR_OUT_OF_RANGE, "");
    fails(snap_read(b, 0, 1).0, EMUHOST_ERROR_INVALID_ARGUMENT, "snapshot 2 is not live");
    // SAFETY: NULL with a length is checked; NULL with none reads nothing.
    unsafe {
        fails(emuhost_snapshots_read(x.snapshots, a, 0, null_mut(), 1), EMUHOST_ERROR_NULL, "buf is NULL");
        ok(emuhost_snapshots_read(x.snapshots, a, 0, null_mut(), 0));
        fails(emuhost_snapshots_read(null(), a, 0, null_mut(), 0), EMUHOST_ERROR_NULL, "snapshots handle is NULL");
    }

    // SAFETY: local out-pointers and their lengths (or NULL where none is wanted).
    unsafe {
        let mut n = 0usize;
        ok(emuhost_snapshots_live(x.snapshots, null_mut(), 0, &mut n));
        assert_eq!(n, 2);
        let mut ids = [0u64; 4];
        ok(emuhost_snapshots_live(x.snapshots, ids.as_mut_ptr(), ids.len(), &mut n));
        assert_eq!((n, ids), (2, [a, c, 0, 0]));
        let mut one = [0u64; 1];
        ok(emuhost_snapshots_live(x.snapshots, one.as_mut_ptr(), 1, null_mut()));
        assert_eq!(one, [a]);
        fails(emuhost_snapshots_live(x.snapshots, null_mut(), 2, &mut n), EMUHOST_ERROR_NULL, "ids is NULL");
        let odd = std::ptr::without_provenance_mut::<usize>(1);
        let mut keep = [7u64; 2];
        fails(emuhost_snapshots_live(x.snapshots, keep.as_mut_ptr(), 2, odd), EMUHOST_ERROR_INVALID_ARGUMENT, "count");
        assert_eq!(keep, [7, 7], "nothing written before the check");
    }
    ok(emuhost_snapshots_delete(x.snapshots));
    ok(emuhost_tracker_delete(x.tracker));
    ok(emuhost_space_delete(x.space));
}

/// NULL handles and out-pointers are `NULL` errors (a NULL id pointer is refused before anything
/// is taken); deleted, mistyped and made-up handles are `BAD_HANDLE`; a double delete changes
/// nothing; deleting NULL does nothing; bad ranges have the space's codes.
#[test]
fn null_stale_and_mistyped_snapshot_handles_are_errors() {
    let p = page();
    let x = setup(8, 8, EMUHOST_WATCH_AUTO, null());
    // SAFETY: NULL and local out-pointers, which the calls check.
    unsafe {
        let mut out = null_mut();
        fails(emuhost_snapshots_new(null(), 0, p, null(), &mut out), EMUHOST_ERROR_NULL, "tracker handle is NULL");
        fails(emuhost_snapshots_new(x.tracker, 0, p, null(), null_mut()), EMUHOST_ERROR_NULL, "out-pointer is NULL");
        fails(emuhost_snapshots_new(x.tracker, 0, 9 * p, null(), &mut out), EMUHOST_ERROR_OUT_OF_RANGE, "outside");
        fails(emuhost_snapshots_new(x.tracker, 1, p, null(), &mut out), EMUHOST_ERROR_INVALID_ARGUMENT, "aligned");
        fails(emuhost_snapshots_new(x.tracker, 0, 0, null(), &mut out), EMUHOST_ERROR_INVALID_ARGUMENT, "zero length");
        // A space passed as a tracker, a tracker as settings.
        fails(
            emuhost_snapshots_new(x.space.cast(), 0, p, null(), &mut out),
            EMUHOST_ERROR_BAD_HANDLE,
            "not a live tracker handle",
        );
        fails(
            emuhost_snapshots_new(x.tracker, 0, p, x.tracker.cast(), &mut out),
            EMUHOST_ERROR_BAD_HANDLE,
            "not a live settings handle",
        );
        assert!(out.is_null());

        let mut id = 0;
        fails(emuhost_snapshots_take(null(), &mut id), EMUHOST_ERROR_NULL, "snapshots handle is NULL");
        fails(emuhost_snapshots_take(x.snapshots, null_mut()), EMUHOST_ERROR_NULL, "id is NULL");
        assert_eq!(stats(x.snapshots).taken, 0, "a take with a NULL id pointer took a snapshot");
        fails(emuhost_snapshots_restore(null(), 1, null_mut()), EMUHOST_ERROR_NULL, "snapshots handle is NULL");
        fails(emuhost_snapshots_release(null(), 1), EMUHOST_ERROR_NULL, "snapshots handle is NULL");
        fails(emuhost_snapshots_stats(null(), &mut emuhost_snapshot_stats_t::default()), EMUHOST_ERROR_NULL, "NULL");
        fails(emuhost_snapshots_stats(x.snapshots, null_mut()), EMUHOST_ERROR_NULL, "out-pointer is NULL");
        ok(emuhost_snapshots_delete(null_mut()));

        // A tracker passed as snapshots, and a made-up value.
        let as_snaps = x.tracker.cast::<emuhost_snapshots_t>();
        fails(emuhost_snapshots_take(as_snaps, &mut id), EMUHOST_ERROR_BAD_HANDLE, "not a live snapshots handle");
        fails(emuhost_snapshots_delete(as_snaps), EMUHOST_ERROR_BAD_HANDLE, "not a live snapshots handle");
        let bogus = std::ptr::without_provenance_mut::<emuhost_snapshots_t>(0xdead_0000);
        fails(emuhost_snapshots_release(bogus, 1), EMUHOST_ERROR_BAD_HANDLE, "not a live snapshots handle");

        let id = take(x.snapshots);
        ok(emuhost_snapshots_delete(x.snapshots));
        let stale = "not a live snapshots handle (deleted already";
        fails(emuhost_snapshots_delete(x.snapshots), EMUHOST_ERROR_BAD_HANDLE, stale);
        fails(emuhost_snapshots_take(x.snapshots, &mut 0), EMUHOST_ERROR_BAD_HANDLE, stale);
        fails(emuhost_snapshots_restore(x.snapshots, id, null_mut()), EMUHOST_ERROR_BAD_HANDLE, stale);
        fails(emuhost_snapshots_release(x.snapshots, id), EMUHOST_ERROR_BAD_HANDLE, stale);
        fails(
            emuhost_snapshots_stats(x.snapshots, &mut emuhost_snapshot_stats_t::default()),
            EMUHOST_ERROR_BAD_HANDLE,
            stale,
        );
        // The tracker the deletes were refused for is still whole.
        ok(emuhost_tracker_arm(x.tracker, 0, p));
    }
    ok(emuhost_tracker_delete(x.tracker));
    ok(emuhost_space_delete(x.space));
}

/// `EMUHOST_SNAPSHOT_BUDGET_MB` in the settings reaches the snapshots: takes past it drop the
/// oldest snapshots (whose ids are then not live), never the newest; without it none is dropped.
#[test]
fn the_settings_budget_drops_the_oldest_snapshots() {
    let p = page();
    // 2 MiB of pages, all written before each take: every snapshot keeps more than the budget.
    let pages = (2 << 20) / p;
    let mut st = null_mut();
    // SAFETY: an out-pointer to a local; NUL-terminated literals.
    unsafe {
        ok(emuhost_settings_new(&mut st));
        ok(emuhost_settings_set(st, c"EMUHOST_SNAPSHOT_BUDGET_MB".as_ptr(), c"3".as_ptr()));
    }
    for (settings, budget) in [(null(), false), (st.cast_const(), true)] {
        let x = setup(pages, pages, EMUHOST_WATCH_AUTO, settings);
        let mut ids = Vec::new();
        for round in 0..3u8 {
            guest_fill(x.base, 0, 1, round);
            for i in 0..pages {
                guest_fill(x.base, i * p + 8, 1, round);
            }
            ids.push(take(x.snapshots));
        }
        let s = stats(x.snapshots);
        if budget {
            assert!(s.dropped_for_budget >= 1 && s.live < 3 && s.bytes_kept <= 3 << 20, "{s:?}");
            // SAFETY: NULL asks for no result.
            unsafe {
                fails(
                    emuhost_snapshots_restore(x.snapshots, ids[0], null_mut()),
                    EMUHOST_ERROR_INVALID_ARGUMENT,
                    "budget",
                );
                ok(emuhost_snapshots_restore(x.snapshots, ids[2], null_mut()));
            }
        } else {
            assert_eq!((s.dropped_for_budget, s.live), (0, 3), "{s:?}");
        }
        ok(emuhost_snapshots_delete(x.snapshots));
        ok(emuhost_tracker_delete(x.tracker));
        ok(emuhost_space_delete(x.space));
    }
    ok(emuhost_settings_delete(st));
}

/// A restore that would decommit pages an import holds is `REFUSED`, naming them, and changes
/// nothing; once the import goes it decommits them.
#[test]
fn a_restore_over_held_pages_is_refused() {
    let p = page();
    // A window the default import chunk (16 MiB) fits in.
    let x = setup((16 << 20) / p, 8, EMUHOST_WATCH_AUTO, null());
    guest_fill(x.base, 0, 8, 0x5a);
    let id = take(x.snapshots);
    let imp = crate::abi::pin_importer(x.space, &[]);
    // SAFETY: out-pointers to locals.
    unsafe {
        ok(emuhost_space_commit(x.space, 8 * p, 56 * p, RW));
        let mut pool = 0;
        ok(emuhost_importer_add_pool(imp, 0, 64 * p, &mut pool));
        let mut b = emuhost_binding_t::default();
        ok(emuhost_importer_bind(imp, 16 * p, p, &mut b));
        guest_fill(x.base, 0, 8, 0x77);
        fails(emuhost_snapshots_restore(x.snapshots, id, null_mut()), EMUHOST_ERROR_REFUSED, "a hold keeps mapped");
        assert_eq!(read(x.space, 0, 8), [0x77; 8], "a refused restore changed the bytes");
        ok(emuhost_importer_remove_pool(imp, pool));
        ok(emuhost_importer_release_all(imp));
        let mut r = emuhost_restored_t::default();
        ok(emuhost_snapshots_restore(x.snapshots, id, &mut r));
        // The 56 pages committed since, and any the import committed for its span (on Windows
        // it commits the reserved pages of the window it spans).
        assert!(r.decommitted >= 56, "{r:?}");
        assert_eq!(read(x.space, 0, 8), [0x5a; 8]);
        fails(emuhost_space_read(x.space, 8 * p, [0u8; 1].as_mut_ptr().cast(), 1), EMUHOST_ERROR_NOT_COMMITTED, "");
    }
    ok(emuhost_importer_delete(imp));
    ok(emuhost_snapshots_delete(x.snapshots));
    ok(emuhost_tracker_delete(x.tracker));
    ok(emuhost_space_delete(x.space));
}

/// The snapshots handle keeps its tracker and space: the three handles are deleted in every
/// order, the snapshots still taking and restoring by bytes while they live, and a second delete
/// of each is `BAD_HANDLE`.
#[test]
fn the_handles_may_be_deleted_in_any_order() {
    let p = page();
    const ORDERS: [[usize; 3]; 6] = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
    for order in ORDERS {
        let x = setup(4, 4, EMUHOST_WATCH_AUTO, null());
        let mut alive = [true; 3];
        for &which in &order {
            let e = match which {
                0 => emuhost_space_delete(x.space),
                1 => emuhost_tracker_delete(x.tracker),
                _ => emuhost_snapshots_delete(x.snapshots),
            };
            ok(e);
            alive[which] = false;
            if alive[2] {
                // The window is mapped while the snapshots live, whichever handles went.
                guest_fill(x.base, p, 16, 0x10 + which as u8);
                let want = host_bytes(x.base, p, 16);
                let id = take(x.snapshots);
                guest_fill(x.base, p, 16, 0xee);
                // SAFETY: NULL asks for no result.
                ok(unsafe { emuhost_snapshots_restore(x.snapshots, id, null_mut()) });
                assert_eq!(host_bytes(x.base, p, 16), want, "order {order:?}, after deleting {which}");
            }
        }
        fails(emuhost_space_delete(x.space), EMUHOST_ERROR_BAD_HANDLE, "not a live space handle");
        fails(emuhost_tracker_delete(x.tracker), EMUHOST_ERROR_BAD_HANDLE, "not a live tracker handle");
        fails(emuhost_snapshots_delete(x.snapshots), EMUHOST_ERROR_BAD_HANDLE, "not a live snapshots handle");
    }
}
