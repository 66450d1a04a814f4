//! The importer's count of live imports and its cap on them (a backend's limit on live
//! allocations: Vulkan's `maxMemoryAllocationCount`, 4,096 on some Windows drivers; lowered by
//! `ImportConfig::max_live`, `EMUHOST_IMPORT_MAX_LIVE`): the count and its peak follow imports
//! and releases, and at the cap a binding's import releases what no binding needs, merges with a
//! neighbour, or goes without (counted), never passing the cap, panicking or losing a byte.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use emuhost::import::{Backend, Budget, ImportCost, ImportError, Importer, MERGE_LIMIT, Pin, Planned};
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

/// The cap is the smaller of the config's and the backend's limit on live allocations, and the
/// switch sets it (0 is refused, naming it).
#[test]
fn the_cap_is_the_configs_within_the_backends_limit() {
    let space = Arc::new(Space::with_window(64 * MIB).unwrap());
    let limited = |n| Pin::with_budget(Budget { max_count: n, ..Budget::default() });
    let cfg = chunks_config(MIB, 0);
    assert_eq!(Importer::new(space.clone(), limited(4096), cfg).unwrap().max_live(), 4096);
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
/// is refused: an error the caller goes on without (`is_refused`), counted apart from the
/// driver's failures and held nothing cooling; once a release makes room, it imports.
#[test]
fn at_the_cap_with_nothing_near_a_binding_goes_without_counted_and_not_cooling() {
    let far = MERGE_LIMIT + 16 * MIB;
    let space = Arc::new(Space::with_window(4 * far).unwrap());
    for i in 0..3 {
        space.commit(space.range(i * far, MIB).unwrap(), Prot::READ_WRITE).unwrap();
    }
    let f = Arc::new(Faulty::default());
    let cfg = chunks_config(MIB, 0).cooling(Duration::from_secs(3600)).max_live(Some(2));
    let imp = Importer::new(space, f.clone(), cfg).unwrap();
    imp.bind(0x10, 0x10).unwrap();
    imp.bind(far + 0x10, 0x10).unwrap();
    let e = imp.bind(2 * far + 0x10, 0x10).unwrap_err();
    assert!(e.is_refused() && e.is_capped(), "{e:?}");
    assert!(
        matches!(&e, ImportError::Import { source, .. } if matches!(**source, ImportError::LiveCap { live: 2, cap: 2, .. }))
    );
    assert!(e.to_string().contains(&format!("{:#x}", 2 * far)), "names the range: {e}");
    let s = imp.stats();
    assert_eq!((s.capped, s.failures, s.cooled, s.live), (1, 0, 0, 2), "{s:?}");
    assert_eq!(f.peak.load(Ordering::SeqCst), 2);
    // Not cooling: once a release makes room, it imports.
    imp.release_all();
    assert!(imp.bind(2 * far + 0x10, 0x10).unwrap().made);
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
/// the cap, nothing panics, every binding is served or refused as capped (counted), a served
/// one's import covers it, and the guest's bytes are intact.
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
            let (mut served, mut refused) = (0u64, 0u64);
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
                            Err(e) => {
                                assert!(e.is_capped(), "cap {cap}: {e:?}");
                                refused += 1;
                            }
                        }
                        let mut back = [0u8; 8];
                        space.read(GuestAddr(at), &mut back).unwrap();
                        assert_eq!(u64::from_le_bytes(back), i, "the guest's bytes at {at:#x}");
                    }
                }
                assert!(imp.stats().live <= cap, "cap {cap}: {:?}", imp.stats());
            }
            imp.settle();
            let s = imp.stats();
            let what = format!("cap {cap}, pools policy {pools_policy}: {s:?}");
            assert!(s.peak_live <= cap && f.peak.load(Ordering::SeqCst) <= cap, "{what}");
            assert!(s.peak_live == cap, "the session needs more than the cap: {what}");
            assert_eq!(s.capped, refused, "{what}");
            assert!(served > 100 && s.failures == 0, "{served} served, {what}");
            drop(imp);
            assert_eq!(f.budget().get().count, 0, "everything released");
        }
    }
}
