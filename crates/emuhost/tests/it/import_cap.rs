//! The importer's count of live imports and its cap on them (a backend's limit on live
//! allocations: Vulkan's `maxMemoryAllocationCount`, 4,096 on some Windows drivers; lowered by
//! `ImportConfig::max_live`, `EMUHOST_IMPORT_MAX_LIVE`): the count and its peak follow imports
//! and releases, and at the cap a binding's import releases what no binding needs, merges with a
//! neighbour, or (nothing making room) imports over the cap, counted: no binding goes without
//! because of the cap, nothing panics or loses a byte, and the backend's own limit is never passed.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use emuhost::import::{Backend, Budget, ImportConfig, ImportCost, Importer, MERGE_LIMIT, Pin, Planned};
use emuhost::settings::Settings;
use emuhost::space::{GuestAddr, Prot, Space};

use crate::import::{Faulty, chunks_config, faulty_with, pools_config_with};

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

fn r(lo_mib: u64, hi_mib: u64) -> Planned {
    Planned { lo: lo_mib * MIB, hi: hi_mib * MIB }
}

/// The chunks policy, 1 MiB chunks, no spans, at most `cap` live imports, around [`Faulty`].
fn chunks_capped(cap: u64) -> (Importer<Arc<Faulty>>, Arc<Faulty>) {
    faulty_with(chunks_config(MIB, 0).cooling(Duration::ZERO).max_live(Some(cap)))
}

/// The count of live imports and its peak: up with each import, down with each release (a
/// pool's, `release_all`), the peak kept.
#[test]
fn the_live_count_and_its_peak_follow_imports_and_releases() {
    let (imp, f) = faulty_with(chunks_config(MIB, 0).cooling(Duration::ZERO));
    assert_eq!(imp.max_live(), u64::MAX, "pin has no limit, none given");
    for c in 0..5 {
        imp.bind(c * MIB + 0x10, 0x10).unwrap();
    }
    let s = imp.stats();
    assert_eq!((s.live, s.peak_live, s.live_bytes), (5, 5, 5 * MIB));
    imp.release_all();
    let s = imp.stats();
    assert_eq!((s.live, s.peak_live), (0, 5), "the peak stays");
    imp.bind(9 * MIB, 0x10).unwrap();
    imp.bind(10 * MIB, 0x10).unwrap();
    assert_eq!((imp.stats().live, imp.stats().peak_live), (2, 5));
    assert_eq!(f.peak.load(Ordering::SeqCst), 5);
    // Pools policy: a released pool's import goes, and the count with it.
    let (imp, _) = faulty_with(pools_config_with(0, |p| p));
    let pools: Vec<_> = (0..3).map(|i| imp.add_pool((4 + i) * MIB, 64 * KIB).unwrap()).collect();
    for i in 0..3 {
        imp.bind((4 + i) * MIB + 0x100, 0x10).unwrap();
    }
    assert_eq!((imp.stats().live, imp.stats().peak_live), (3, 3));
    imp.remove_pool(pools[1]);
    assert_eq!((imp.stats().live, imp.stats().peak_live), (2, 3));
}

/// The cap is the config's within the backend's limit on live allocations, or unset three
/// quarters of that limit (the rest left to the embedder's own allocations), and the switch sets
/// it (0 is refused, naming it).
#[test]
fn the_cap_is_the_configs_within_the_backends_limit() {
    let space = Arc::new(Space::with_window(64 * MIB).unwrap());
    let limited = |n| Pin::with_budget(Budget { max_count: n, ..Budget::default() });
    let cfg = chunks_config(MIB, 0);
    assert_eq!(Importer::new(space.clone(), limited(4096), cfg).unwrap().max_live(), 3072, "three quarters");
    assert_eq!(Importer::new(space.clone(), limited(4096), cfg.max_live(Some(4096))).unwrap().max_live(), 4096);
    assert_eq!(Importer::new(space.clone(), limited(1), cfg).unwrap().max_live(), 1);
    assert_eq!(Importer::new(space.clone(), limited(4096), cfg.max_live(Some(8))).unwrap().max_live(), 8);
    assert_eq!(Importer::new(space.clone(), limited(6), cfg.max_live(Some(8))).unwrap().max_live(), 6);
    let mut s = Settings::default();
    s.set("EMUHOST_IMPORT_MAX_LIVE", "16").unwrap();
    assert_eq!(s.import_config().max_live, Some(16));
    s.set("EMUHOST_IMPORT_MAX_LIVE", "").unwrap();
    assert_eq!(s.import_config().max_live, None);
    let e = Settings::default().set("EMUHOST_IMPORT_MAX_LIVE", "0").unwrap_err().to_string();
    assert!(e.contains("EMUHOST_IMPORT_MAX_LIVE=\"0\""), "{e}");
}

/// At the cap a binding's import merges with its nearest live neighbour (the neighbour is taken
/// in and released first), so every binding is served and the count never passes the cap.
#[test]
fn at_the_cap_a_binding_merges_with_its_neighbour_and_the_count_stays_under_it() {
    let (imp, f) = chunks_capped(4);
    for c in 0..4 {
        imp.bind(c * MIB + 0x10, 0x10).unwrap();
    }
    assert_eq!(imp.stats().live, 4);
    // Its range is its chunk; the import it is served by starts at chunk 3.
    let b = imp.bind(4 * MIB + 0x10, 0x10).unwrap();
    assert_eq!((b.range, b.made, b.offset), (r(4, 5), true, MIB + 0x10), "merged with chunk 3");
    assert_eq!(imp.imports(), vec![r(0, 1), r(1, 2), r(2, 3), r(3, 5)]);
    // A binding in the taken-in chunk finds the merged import.
    assert_eq!(imp.bind(3 * MIB + 0x10, 0x10).unwrap().range, r(3, 5));
    for c in 5..12 {
        assert!(imp.bind(c * MIB + 0x10, 0x10).is_ok(), "chunk {c}");
    }
    let s = imp.stats();
    assert!(s.cap_merges >= 8 && s.capped == 0 && s.failures == 0, "{s:?}");
    assert!(s.peak_live <= 4 && f.peak.load(Ordering::SeqCst) <= 4, "{s:?}");
}

/// At the cap an import that another live one covers whole is released first (no binding needs
/// it: the larger one serves every binding it would), before any merge.
#[test]
fn at_the_cap_an_import_another_covers_is_released_first() {
    let (imp, f) = chunks_capped(3);
    imp.add_pool(3 * MIB - 0x8000, 0x10000).unwrap();
    imp.bind(3 * MIB - 0x4000, 0x100).unwrap();
    imp.bind(3 * MIB + 0x4000, 0x100).unwrap();
    // Across the chunks' end: both again as one import (no span).
    assert_eq!(imp.bind(3 * MIB - 0x80, 0x100).unwrap().range, r(2, 4));
    let b = imp.bind(8 * MIB, 0x10).unwrap();
    assert_eq!((b.range, b.made), (r(8, 9), true));
    let s = imp.stats();
    assert_eq!((s.cap_releases, s.cap_merges, s.live), (1, 0, 3), "{s:?}");
    assert_eq!(imp.imports(), vec![r(2, 4), r(3, 4), r(8, 9)]);
    assert_eq!(f.peak.load(Ordering::SeqCst), 3);
}

/// Where nothing can be released and no live import is near enough to merge with, the binding
/// imports over the cap (counted in `over_cap`, not refused, nothing cooling): the cap never
/// leaves a binding without its import. Only the backend's own limit refuses one, as a driver's
/// refusal.
#[test]
fn at_the_cap_with_nothing_to_release_or_merge_a_binding_imports_over_it() {
    let far = MERGE_LIMIT + 16 * MIB;
    let space = Arc::new(Space::with_window(4 * far).unwrap());
    for i in 0..3 {
        space.commit(space.range(i * far, MIB).unwrap(), Prot::READ_WRITE).unwrap();
    }
    let f = Arc::new(Faulty::default());
    let cfg = chunks_config(MIB, 0).cooling(Duration::from_secs(3600)).max_live(Some(2));
    let imp = Importer::new(space.clone(), f.clone(), cfg).unwrap();
    imp.bind(0x10, 0x10).unwrap();
    imp.bind(far + 0x10, 0x10).unwrap();
    let b = imp.bind(2 * far + 0x10, 0x10).unwrap();
    assert_eq!((b.range, b.made, b.offset), (Planned { lo: 2 * far, hi: 2 * far + MIB }, true, 0x10));
    let s = imp.stats();
    assert_eq!((s.over_cap, s.capped, s.failures, s.cooled, s.live), (1, 0, 0, 0, 3), "{s:?}");
    assert_eq!(f.peak.load(Ordering::SeqCst), 3);
    // Once a release makes room, the next import keeps the cap again.
    imp.release_all();
    imp.bind(0x10, 0x10).unwrap();
    imp.bind(far + 0x10, 0x10).unwrap();
    assert_eq!(imp.stats().over_cap, 1);
    // The backend's own limit (2 here, and so the cap) is never passed: that binding is refused by
    // the backend, as a driver's refusal.
    let limited = Pin::with_budget(Budget { max_count: 2, ..Budget::default() });
    let imp = Importer::new(space, limited, chunks_config(MIB, 0)).unwrap();
    imp.bind(0x10, 0x10).unwrap();
    imp.bind(far + 0x10, 0x10).unwrap();
    let e = imp.bind(2 * far + 0x10, 0x10).unwrap_err();
    assert!(e.is_refused() && !e.is_capped(), "{e:?}");
    let s = imp.stats();
    assert_eq!((s.over_cap, s.capped, s.failures, s.live), (1, 0, 1, 2), "{s:?}");
}

/// At the cap with no live import near enough to the binding, the two neighbouring live imports
/// with the smallest union are merged into one, and the binding imports in the slot that frees.
#[test]
fn at_the_cap_with_nothing_near_two_neighbours_are_merged_to_make_room() {
    let far = MERGE_LIMIT + 16 * MIB;
    let space = Arc::new(Space::with_window(2 * far).unwrap());
    space.commit(space.range(0, 4 * MIB).unwrap(), Prot::READ_WRITE).unwrap();
    space.commit(space.range(far, MIB).unwrap(), Prot::READ_WRITE).unwrap();
    let f = Arc::new(Faulty::default());
    let imp = Importer::new(space, f.clone(), chunks_config(MIB, 0).max_live(Some(3))).unwrap();
    for at in [0, MIB, 3 * MIB] {
        imp.bind(at + 0x10, 0x10).unwrap();
    }
    let b = imp.bind(far + 0x10, 0x10).unwrap();
    assert_eq!((b.range, b.made, b.offset), (Planned { lo: far, hi: far + MIB }, true, 0x10));
    assert_eq!(imp.imports(), vec![r(0, 2), r(3, 4), Planned { lo: far, hi: far + MIB }]);
    let s = imp.stats();
    assert_eq!((s.cap_merges, s.capped, s.live), (1, 0, 3), "{s:?}");
    assert_eq!(f.peak.load(Ordering::SeqCst), 3);
}

/// Pools policy: imports ahead take at most three quarters of the cap, and at the cap a
/// binding's import releases the ones no binding has used (the oldest first), then merges.
#[test]
fn at_the_cap_imports_ahead_no_binding_used_are_released_first() {
    let free =
        ImportCost { fixed: Duration::ZERO, untouched_per_mib: Duration::ZERO, populated_per_mib: Duration::ZERO };
    let (imp, f) = faulty_with(pools_config_with(256 * MIB, |p| p.cost(Some(free))).max_live(Some(4)));
    let pools: Vec<u64> = (0..6).map(|i| 4 * MIB + i * 64 * KIB).collect();
    for &p in &pools {
        imp.add_pool(p, 16 * KIB).unwrap();
    }
    // The first binding makes its region hot: its other five pools are asked ahead; two fit
    // the share (3 of 4).
    imp.bind(pools[0] + 0x10, 0x10).unwrap();
    imp.settle();
    let s = imp.stats();
    assert_eq!((s.live, s.ahead_imports, s.ahead_over_budget), (3, 2, 3), "{s:?}");
    imp.bind(8 * MIB, 0x10).unwrap();
    imp.bind(12 * MIB, 0x10).unwrap();
    imp.bind(16 * MIB, 0x10).unwrap();
    let s = imp.stats();
    assert_eq!((s.cap_releases, s.ahead_released, s.cap_merges, s.live), (2, 2, 0, 4), "{s:?}");
    // Nothing unused is left: the next one merges with the nearest, at 16 MiB.
    let b = imp.bind(20 * MIB, 0x10).unwrap();
    assert_eq!(b.offset, 4 * MIB, "{b:?}");
    assert!(imp.imports().iter().any(|i| i.lo == 16 * MIB && i.hi > 20 * MIB), "{:?}", imp.imports());
    assert_eq!(imp.stats().cap_merges, 1);
    assert!(imp.stats().peak_live <= 4 && f.peak.load(Ordering::SeqCst) <= 4);
}

/// A session that needs many more imports than the cap allows (4 and 8, both policies, pools
/// and bindings scattered over 96 MiB, pools released and made again): the count never passes
/// the cap but by the imports counted over it, nothing panics, every binding is served and its
/// import covers it, and the guest's bytes are intact.
#[test]
fn a_session_that_needs_more_than_the_cap_never_passes_it_and_loses_nothing() {
    for cap in [4u64, 8] {
        for pools_policy in [false, true] {
            let free = ImportCost {
                fixed: Duration::ZERO,
                untouched_per_mib: Duration::ZERO,
                populated_per_mib: Duration::ZERO,
            };
            let cfg = if pools_policy {
                pools_config_with(8 * MIB, |p| p.cost(Some(free)))
            } else {
                chunks_config(MIB, 4 * MIB).cooling(Duration::ZERO)
            };
            let cfg = cfg.max_live(Some(cap));
            let space = Arc::new(Space::with_window(128 * MIB).unwrap());
            space.commit(space.range(0, 96 * MIB).unwrap(), Prot::READ_WRITE).unwrap();
            let f = Arc::new(Faulty::default());
            let imp = Importer::new(space.clone(), f.clone(), cfg).unwrap();
            let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ cap;
            let mut next = move || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            let mut live_pools = Vec::new();
            let mut served = 0u64;
            for i in 0..600u64 {
                let at = (next() % (95 * MIB)) & !0xfff;
                match next() % 8 {
                    0 => live_pools.push(imp.add_pool(at, (next() % 512 + 1) * 4 * KIB).unwrap()),
                    1 if !live_pools.is_empty() => {
                        let id = live_pools.swap_remove((next() % live_pools.len() as u64) as usize);
                        imp.remove_pool(id);
                    }
                    _ => {
                        let size = next() % (64 * KIB) + 1;
                        space.write(GuestAddr(at), &i.to_le_bytes()).unwrap();
                        match imp.bind(at, size) {
                            Ok(b) => {
                                assert!(b.range.lo <= at && at + size <= b.range.hi, "{b:?} for {at:#x}+{size:#x}");
                                // The import serving it (a merge's may start lower) covers it.
                                let lo = at - b.offset;
                                let import = imp.imports().into_iter().find(|i| i.lo == lo && at + size <= i.hi);
                                assert!(import.is_some(), "no live import at {lo:#x} covers {at:#x}+{size:#x}");
                                served += 1;
                            }
                            Err(e) => panic!("cap {cap}: a binding went without: {e:?}"),
                        }
                        let mut back = [0u8; 8];
                        space.read(GuestAddr(at), &mut back).unwrap();
                        assert_eq!(u64::from_le_bytes(back), i, "the guest's bytes at {at:#x}");
                    }
                }
                let s = imp.stats();
                assert!(s.live <= cap + s.over_cap, "cap {cap}: {s:?}");
            }
            imp.settle();
            let s = imp.stats();
            let what = format!("cap {cap}, pools policy {pools_policy}: {s:?}");
            let over = cap + s.over_cap;
            assert!(s.peak_live <= over && f.peak.load(Ordering::SeqCst) <= over, "{what}");
            assert!(s.peak_live >= cap, "the session needs more than the cap: {what}");
            assert_eq!(s.capped, 0, "{what}");
            assert!(served > 100 && s.failures == 0, "{served} served, {what}");
            drop(imp);
            assert_eq!(f.budget().get().count, 0, "everything released");
        }
    }
}

/// Pools policy: a pool imported ahead in pieces is imported again in one once every piece has
/// landed (a merge), and the pieces, which no binding was given, are released at once: one live
/// import for the pool instead of one a piece.
#[test]
fn pieces_of_a_whole_pool_merge_into_one_import_and_the_live_count_drops() {
    let piece = 64 * KIB;
    // Merges begin at half the cap: 8 live imports here (the small pool's and 8 pieces).
    let (imp, f) = faulty_with(pools_config_with(256 * MIB, |p| p.ahead_piece(piece)).max_live(Some(16)));
    let (q, p) = (4 * MIB, 4 * MIB + 64 * KIB);
    imp.add_pool(q, 16 * KIB).unwrap();
    imp.add_pool(p, 512 * KIB).unwrap();
    // The binding in the small pool makes the region hot: the large one is imported ahead in
    // pieces, then merged.
    imp.bind(q + 0x10, 0x10).unwrap();
    imp.settle();
    let s = imp.stats();
    let whole = Planned { lo: p, hi: p + 512 * KIB };
    assert_eq!(imp.imports(), vec![Planned { lo: q, hi: q + 16 * KIB }, whole], "{s:?}");
    assert_eq!((s.merges, s.live), (1, 2), "{s:?}");
    assert!(s.merged_away >= 4 && s.peak_live >= 5, "one import a piece before the merge: {s:?}");
    assert_eq!(f.budget().get().count, 2, "the pieces were released");
    // A binding anywhere in the pool finds the merged import.
    assert_eq!(imp.bind(p + 300 * KIB, 0x100).unwrap().range, whole);
}

/// Pools policy: the pieces of a whole pool stay as they are, one live import each, where the
/// merge size is 0 (`EMUHOST_IMPORT_MERGE_MB=0`), where the live count is under half the cap, and
/// where there is no cap (a merge holds the driver: merges are for keeping a count bounded).
#[test]
fn no_merges_at_merge_size_zero_under_half_the_cap_or_without_a_cap() {
    let piece = 64 * KIB;
    let cases: [(&str, ImportConfig); 3] = [
        ("merge 0", pools_config_with(256 * MIB, |p| p.ahead_piece(piece).merge(0)).max_live(Some(16))),
        ("under half the cap", pools_config_with(256 * MIB, |p| p.ahead_piece(piece)).max_live(Some(64))),
        ("no cap", pools_config_with(256 * MIB, |p| p.ahead_piece(piece))),
    ];
    for (case, cfg) in cases {
        let (imp, _f) = faulty_with(cfg);
        let (q, p) = (4 * MIB, 4 * MIB + 64 * KIB);
        imp.add_pool(q, 16 * KIB).unwrap();
        imp.add_pool(p, 512 * KIB).unwrap();
        imp.bind(q + 0x10, 0x10).unwrap();
        imp.settle();
        let s = imp.stats();
        assert_eq!(s.merges, 0, "{case}: {s:?}");
        assert!(s.live >= 5, "{case}: the small pool and one import a piece: {s:?}");
        assert!(!imp.imports().contains(&Planned { lo: p, hi: p + 512 * KIB }), "{case}: {:?}", imp.imports());
    }
}

/// Pools policy: a binding's part and the widening's pieces that hold a pool between them are
/// merged into one import. The part was given to the binding, so it is kept (a renderer may still
/// read its handle) until the embedder says the handles given out are done with; bindings after
/// the merge are served by the merged import, the part's pages included.
#[test]
fn a_part_a_binding_was_given_is_kept_past_its_merge_until_the_handles_are_done() {
    // A 2 MiB pool does not fit the 400 us wait at 1 ms/MiB: the binding imports its part.
    // A cap above the pieces' count, merges from half of it.
    let (imp, f) = faulty_with(pools_config_with(0, |p| p.ahead_piece(64 * KIB)).max_live(Some(48)));
    let p = 4 * MIB;
    imp.add_pool(p, 2 * MIB).unwrap();
    let part = imp.bind(p + MIB, 0x100).unwrap();
    assert!(part.made && part.range.len() < 2 * MIB, "{part:?}");
    imp.settle();
    let s = imp.stats();
    let whole = Planned { lo: p, hi: p + 2 * MIB };
    assert_eq!((s.merges, s.live), (1, 2), "the merge and the part: {s:?}");
    assert!(s.peak_live >= 4, "{s:?}");
    assert!(imp.imports().contains(&whole) && imp.imports().contains(&part.range), "{:?}", imp.imports());
    // The part's pages are served by the merged import now.
    let b = imp.bind(p + MIB + 0x10, 0x10).unwrap();
    assert_eq!((b.range, b.made, b.offset), (whole, false, MIB + 0x10));
    imp.handles_done();
    assert_eq!(imp.imports(), vec![whole]);
    assert_eq!((imp.stats().live, f.budget().get().count), (1, 1));
    // Nothing more goes at the next call: the merged import was given since, and replaces nothing.
    imp.handles_done();
    assert_eq!(imp.imports(), vec![whole]);
}
