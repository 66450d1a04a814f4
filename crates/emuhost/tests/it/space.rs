#[cfg(target_os = "linux")]
use std::io::{Read, Seek, SeekFrom};

use emuhost::counters;
use emuhost::space::{CommitPath, GuestAddr, GuestRange, Prot, Space, SpaceConfig, SpaceError, page_size};
#[cfg(target_os = "linux")]
use emuhost::watch::BackendKind;
use emuhost::watch::{Tracker, TrackerConfig};

const MIB: u64 = 1 << 20;

fn page() -> u64 {
    page_size()
}

fn space() -> Space {
    Space::with_window(1 << 30).unwrap()
}

fn pages(space: &Space, first: u64, n: u64) -> GuestRange {
    space.range(first * page(), n * page()).unwrap()
}

fn calls() -> counters::Counts {
    counters::snapshot().expect("tests build with the counters feature")
}

/// The `/proc/self/pagemap` entry of a guest page: (present, page frame number).
#[cfg(target_os = "linux")]
fn pagemap(space: &Space, addr: GuestAddr) -> (bool, u64) {
    let host = space.host_addr(addr).unwrap() as u64;
    let mut f = std::fs::File::open("/proc/self/pagemap").unwrap();
    f.seek(SeekFrom::Start(host / page() * 8)).unwrap();
    let mut b = [0u8; 8];
    f.read_exact(&mut b).unwrap();
    let e = u64::from_le_bytes(b);
    (e >> 63 == 1, e & ((1 << 55) - 1))
}

fn fill(space: &Space, range: GuestRange, byte: impl Fn(u64) -> u8) {
    for p in 0..range.pages() {
        let a = range.start().0 + p * page();
        space.write(GuestAddr(a), &vec![byte(a / page()); page() as usize]).unwrap();
    }
}

fn first_byte(space: &Space, addr: u64) -> Result<u8, SpaceError> {
    let mut b = [0u8; 1];
    space.read(GuestAddr(addr), &mut b).map(|_| b[0])
}

/// Unmaps pages behind the space's back, as foreign code would.
#[cfg(target_os = "linux")]
fn unmap_behind(space: &Space, range: GuestRange) {
    let host = space.host_addr(range.start()).unwrap();
    // SAFETY: the pages lie inside the space's reservation, which the test owns; no reference into
    // them is live, and the hole is refilled or reported by the space, never read through.
    let r = unsafe { libc::munmap(host as *mut libc::c_void, range.len() as usize) };
    assert_eq!(r, 0);
}

#[test]
fn the_default_window_is_512_gib_and_reserved() {
    let s = SpaceConfig::default().build().unwrap();
    assert_eq!(s.window(), 512 << 30);
    let regions = s.kernel_regions(s.range(0, s.window()).unwrap()).unwrap();
    assert_eq!(regions.len(), 1, "one reservation: {regions:?}");
    assert!(!regions[0].read && !regions[0].write && !regions[0].shared);
}

#[test]
fn commit_is_one_system_call_after_one_region_query() {
    let s = space();
    let r = s.range(16 * MIB, 16 * MIB).unwrap();
    // The process's first region query asks which way queries go (one more call, once per
    // process): ask it before counting, or the test fails when it runs alone.
    s.kernel_regions(r).unwrap();
    let before = calls();
    assert_eq!(s.commit(r, Prot::READ_WRITE).unwrap(), CommitPath::OneCall);
    let used = calls().since(&before);
    // The query checks that the range still holds the space's own mappings only. The commit is
    // an `mprotect` on Linux, a `VirtualAlloc2` replacing the placeholder (or a `VirtualAlloc`
    // commit) on Windows.
    #[cfg(target_os = "linux")]
    assert_eq!((used.mprotect, used.query, used.total()), (1, 1, 2), "{used:?}");
    // With placeholders a commit also splits the placeholder (`VirtualFree` with
    // `MEM_PRESERVE_PLACEHOLDER`) and asks `VirtualQuery` where it ends; without them it is one
    // `VirtualAlloc(MEM_COMMIT)`. Either way one call commits, and nothing is protected.
    #[cfg(windows)]
    assert!((used.mmap, used.mprotect) == (1, 0) && used.total() <= 4, "{used:?}");
    s.write(GuestAddr(16 * MIB + 5), b"guest").unwrap();
    let mut b = [0u8; 5];
    s.read(GuestAddr(16 * MIB + 5), &mut b).unwrap();
    assert_eq!(&b, b"guest");
}

#[cfg(target_os = "linux")]
#[test]
fn commit_walks_regions_where_there_is_a_hole() {
    let s = space();
    let r = pages(&s, 0, 64);
    s.commit(pages(&s, 8, 4), Prot::READ).unwrap();
    // A hole in the window: one mprotect would fail with ENOMEM over it (and change the regions
    // below it before failing). The region query before it finds the hole, so the range is walked
    // at once: 0..8, 8..12, 12..20, the hole 20..22 (filled), and 22..64.
    unmap_behind(&s, pages(&s, 20, 2));
    let before = calls();
    let path = s.commit(r, Prot::READ_WRITE).unwrap();
    let used = calls().since(&before);
    assert_eq!(path, CommitPath::RegionWalk { regions: 4, holes: 1 });
    assert_eq!((used.mprotect, used.mmap), (4, 1), "one call per region and hole: {used:?}");
    fill(&s, r, |p| p as u8 + 1);
    for p in 0..64 {
        assert_eq!(first_byte(&s, p * page()).unwrap(), p as u8 + 1);
    }
    let regions = s.kernel_regions(r).unwrap();
    assert!(regions.iter().all(|g| g.read && g.write && !g.shared), "{regions:?}");
}

#[test]
fn the_old_way_is_kept_to_measure_against() {
    let s = SpaceConfig::default().window(1 << 30).one_call_commit(false).build().unwrap();
    s.commit(pages(&s, 4, 4), Prot::READ).unwrap();
    let path = s.commit(pages(&s, 0, 16), Prot::READ_WRITE).unwrap();
    assert_eq!(path, CommitPath::RegionWalk { regions: 3, holes: 0 });
}

#[test]
fn committing_again_keeps_the_bytes_and_sets_the_protection() {
    let s = space();
    let r = pages(&s, 0, 4);
    s.commit(r, Prot::READ_WRITE).unwrap();
    fill(&s, r, |p| p as u8 + 7);
    s.commit(r, Prot::READ).unwrap();
    assert_eq!(first_byte(&s, 3 * page()).unwrap(), 10);
    let err = s.write(GuestAddr(0), b"x").unwrap_err();
    assert!(err.to_string().contains("write 0x0+0x1"), "{err}");
    s.commit(r, Prot::READ_WRITE).unwrap();
    assert_eq!(first_byte(&s, 0).unwrap(), 7);
}

/// `resident_pages` says which pages were touched, page by page, without touching any: the
/// import's cost is read from it.
#[test]
fn resident_pages_are_the_touched_ones_and_reading_them_faults_nothing_in() {
    let s = space();
    let r = pages(&s, 64, 8);
    s.commit(r, Prot::READ_WRITE).unwrap();
    s.write(GuestAddr(66 * page() + 5), &[1]).unwrap();
    s.populate(pages(&s, 70, 2)).unwrap();
    let mut out = vec![true; 3];
    s.resident_pages(r, &mut out).unwrap();
    assert_eq!(out, [false, false, true, false, false, false, true, true]);
    s.resident_pages(r, &mut out).unwrap();
    assert_eq!(out.iter().filter(|&&p| p).count(), 3, "reading them touched none");
    // Reserved pages are not resident.
    s.resident_pages(pages(&s, 1024, 2), &mut out).unwrap();
    assert_eq!(out, [false, false]);
    let outside = s.range(s.window() - page(), page()).unwrap();
    s.resident_pages(outside, &mut out).unwrap();
    assert!(matches!(
        s.resident_pages(GuestRange::new(GuestAddr(s.window()), page()).unwrap(), &mut out),
        Err(SpaceError::OutOfWindow { .. })
    ));
}

#[cfg(target_os = "linux")]
#[test]
fn populate_faults_pages_in_ahead() {
    let s = space();
    let r = pages(&s, 256, 32);
    s.commit(r, Prot::READ_WRITE).unwrap();
    assert!((0..32).all(|p| !pagemap(&s, GuestAddr((256 + p) * page())).0), "fresh pages are not present");
    let before = calls();
    s.populate(r).unwrap();
    assert_eq!(calls().since(&before).madvise, 1);
    assert!((0..32).all(|p| pagemap(&s, GuestAddr((256 + p) * page())).0), "populated pages are present");
    // Populating reserved pages is an error naming the range, not a crash.
    let err = s.populate(pages(&s, 1024, 2)).unwrap_err();
    assert!(err.to_string().starts_with("populate 0x400000+0x2000"), "{err}");
    assert!(matches!(err, SpaceError::NotCommitted { .. }), "{err}");
}

/// What a refusal names: its op, the first and end page of the run, the run's protection (none
/// where not committed).
type Refused = (&'static str, u64, u64, Option<Prot>);

/// The first run of pages a [`SpaceError::NotCommitted`] or [`SpaceError::Protection`] names, as
/// page numbers, with its op; panics on any other error.
fn refused_pages(e: &SpaceError) -> Refused {
    match *e {
        SpaceError::NotCommitted { op, lo, hi, .. } => (op, lo / page(), hi / page(), None),
        SpaceError::Protection { op, lo, hi, prot, .. } => (op, lo / page(), hi / page(), Some(prot)),
        ref e => panic!("not a refusal naming pages: {e:?}"),
    }
}

/// Issue 33, item 11: a zero, populate, read or write over pages the space has not committed, a
/// write to read-only pages and a read of inaccessible ones are caller mistakes: errors of their
/// own naming the first run of such pages (`NotCommitted`, `Protection`), not OS failures with
/// errno text. An OS failure over pages the space has committed as needed stays one.
#[test]
fn caller_mistakes_are_errors_of_their_own_naming_the_pages() {
    let s = space();
    let p = page();
    s.commit(pages(&s, 0, 2), Prot::READ_WRITE).unwrap();
    s.commit(pages(&s, 2, 1), Prot::READ).unwrap();
    s.commit(pages(&s, 3, 1), Prot::NONE).unwrap();
    // Pages 4 on are reserved.
    let mut buf = [0u8; 16];
    let cases: Vec<(Result<(), SpaceError>, Refused)> = vec![
        (s.zero(pages(&s, 4, 2)), ("zero", 4, 6, None)),
        (s.zero(pages(&s, 0, 3)), ("zero", 2, 3, Some(Prot::READ))),
        (s.populate(pages(&s, 5, 3)), ("populate", 5, 8, None)),
        (s.populate(pages(&s, 1, 2)), ("populate", 2, 3, Some(Prot::READ))),
        (s.read(GuestAddr(4 * p - 8), &mut buf), ("read", 3, 4, Some(Prot::NONE))),
        (s.read(GuestAddr(6 * p), &mut buf), ("read", 6, 7, None)),
        (s.write(GuestAddr(2 * p + 1), b"x"), ("write", 2, 3, Some(Prot::READ))),
        (s.write(GuestAddr(2 * p - 2), b"abcd"), ("write", 2, 3, Some(Prot::READ))),
        (s.write(GuestAddr(9 * p), b"x"), ("write", 9, 10, None)),
    ];
    for (got, want) in cases {
        let e = got.unwrap_err();
        assert_eq!(refused_pages(&e), want, "{e}");
        let (lo, hi) = (want.1 * p, want.2 * p);
        assert!(e.to_string().contains(&format!("refused: pages {lo:#x}..{hi:#x} are ")), "{e}");
        assert!(std::error::Error::source(&e).is_none(), "no errno text: {e}");
    }
    let e = s.write(GuestAddr(2 * p), b"x").unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("write {:#x}+0x1 refused: pages {:#x}..{:#x} are r--, which does not allow it", 2 * p, 2 * p, 3 * p)
    );
    // Over pages committed as needed, the calls work.
    s.zero(pages(&s, 0, 2)).unwrap();
    s.read(GuestAddr(2 * p), &mut buf).unwrap();
}

#[cfg(target_os = "linux")]
#[test]
fn zero_keeps_the_pages_mapped() {
    let s = space();
    let r = pages(&s, 0, 8);
    s.commit(r, Prot::READ_WRITE).unwrap();
    fill(&s, r, |_| 0xaa);
    let before: Vec<(bool, u64)> = (0..8).map(|p| pagemap(&s, GuestAddr(p * page()))).collect();
    assert!(before.iter().all(|(present, pfn)| *present && *pfn != 0), "running as root shows frames");
    s.zero(r).unwrap();
    let after: Vec<(bool, u64)> = (0..8).map(|p| pagemap(&s, GuestAddr(p * page()))).collect();
    assert_eq!(before, after, "the same physical pages, still mapped");
    let mut buf = vec![1u8; (8 * page()) as usize];
    s.read(GuestAddr(0), &mut buf).unwrap();
    assert!(buf.iter().all(|b| *b == 0));
    // A decommit, by contrast, drops the pages.
    s.decommit(r).unwrap();
    assert!(!pagemap(&s, GuestAddr(0)).0);
    assert!(first_byte(&s, 0).is_err());
}

#[test]
fn zero_of_a_large_range_zeroes_all_of_it() {
    let s = space();
    let r = s.range(0, 80 * MIB).unwrap();
    s.commit(r, Prot::READ_WRITE).unwrap();
    for at in [0, 64 * MIB - 1, 64 * MIB, 80 * MIB - 1] {
        s.write(GuestAddr(at), &[9]).unwrap();
    }
    s.zero(r).unwrap();
    for at in [0, 64 * MIB - 1, 64 * MIB, 80 * MIB - 1] {
        assert_eq!(first_byte(&s, at).unwrap(), 0, "at {at:#x}");
    }
}

fn extents(s: &Space) -> Vec<(u64, u64)> {
    s.allocations().iter().map(|a| (a.range.start().0 / page(), a.range.end().0 / page())).collect()
}

#[test]
fn the_extent_map_follows_commits_and_releases() {
    let s = space();
    s.commit(pages(&s, 0, 16), Prot::READ_WRITE).unwrap();
    s.commit(pages(&s, 32, 16), Prot::READ_WRITE).unwrap();
    assert_eq!(extents(&s), vec![(0, 16), (32, 48)]);
    // A commit over committed pages adds only what was not committed.
    s.commit(pages(&s, 8, 32), Prot::READ_WRITE).unwrap();
    assert_eq!(extents(&s), vec![(0, 16), (16, 32), (32, 48)]);
    let first = s.allocations()[0];
    let third = s.allocations()[2];
    // A commit over an allocation changes its commit state (its generation), not its extent; the
    // allocations it does not touch keep theirs.
    s.commit(pages(&s, 0, 4), Prot::READ_WRITE).unwrap();
    assert_eq!(extents(&s), vec![(0, 16), (16, 32), (32, 48)]);
    assert_ne!(s.allocations()[0].generation, first.generation);
    assert_eq!(s.allocations()[2].generation, third.generation);
    let first = s.allocations()[0];
    // A release in the middle splits an allocation; the pieces have new generations.
    s.decommit(pages(&s, 4, 2)).unwrap();
    assert_eq!(extents(&s), vec![(0, 4), (6, 16), (16, 32), (32, 48)]);
    let now = s.allocations();
    assert!(now[0].generation != first.generation && now[1].generation != first.generation);
    assert!(now[0].generation != now[1].generation);
    // A release across two allocations trims both.
    s.decommit(pages(&s, 30, 4)).unwrap();
    assert_eq!(extents(&s), vec![(0, 4), (6, 16), (16, 30), (34, 48)]);
    assert_eq!(s.allocations_in(pages(&s, 10, 10)).len(), 2);
    s.decommit(pages(&s, 0, 48)).unwrap();
    assert_eq!(extents(&s), vec![]);
}

fn shared_regions(s: &Space, r: GuestRange) -> Vec<(u64, u64)> {
    s.kernel_regions(r)
        .unwrap()
        .iter()
        .filter(|g| g.shared)
        .map(|g| (g.start as u64 / page(), g.end as u64 / page()))
        .collect()
}

#[test]
fn a_run_of_section_pages_is_one_view() {
    if !crate::watch_gate::views("a_run_of_section_pages_is_one_view") {
        return;
    }
    let s = space();
    let sec = s.create_section(64 * page()).unwrap();
    let before = calls();
    let n = s.map_pages(GuestAddr(128 * page()), sec, &(0..64).collect::<Vec<_>>(), Prot::READ_WRITE).unwrap();
    assert_eq!(n, 1);
    assert_eq!(calls().since(&before).mmap, 1, "one mmap for the run");
    assert_eq!(shared_regions(&s, pages(&s, 0, 512)), vec![(128, 192)]);
    assert_eq!(s.views().len(), 1);
    // Pages out of order make one view per run.
    let n = s.map_pages(GuestAddr(256 * page()), sec, &[0, 1, 2, 10, 11, 5], Prot::READ_WRITE).unwrap();
    assert_eq!(n, 3);
    assert_eq!(s.views().len(), 4);
}

#[test]
fn a_release_inside_a_run_splits_it_and_keeps_every_other_page() {
    if !crate::watch_gate::views("a_release_inside_a_run_splits_it_and_keeps_every_other_page") {
        return;
    }
    let s = space();
    let sec = s.create_section(64 * page()).unwrap();
    let run = pages(&s, 128, 64);
    s.map_pages(run.start(), sec, &(0..64).collect::<Vec<_>>(), Prot::READ_WRITE).unwrap();
    fill(&s, run, |p| p as u8);
    s.decommit(pages(&s, 160, 1)).unwrap();
    assert_eq!(shared_regions(&s, run), vec![(128, 160), (161, 192)], "two mappings left");
    let views = s.views();
    assert_eq!(views.len(), 2);
    assert_eq!(views[1].offset, 33 * page(), "the right piece still shows section page 33");
    for p in (128..192).filter(|p| *p != 160) {
        assert_eq!(first_byte(&s, p * page()).unwrap(), p as u8, "page {p}");
    }
    assert!(first_byte(&s, 160 * page()).is_err(), "the released page is reserved again");
}

#[test]
fn a_split_keeps_the_protection_of_every_other_page() {
    if !crate::watch_gate::views("a_split_keeps_the_protection_of_every_other_page") {
        return;
    }
    let s = space();
    let sec = s.create_section(64 * page()).unwrap();
    let run = pages(&s, 0, 64);
    s.map_pages(run.start(), sec, &(0..64).collect::<Vec<_>>(), Prot::READ_WRITE).unwrap();
    fill(&s, run, |p| p as u8 + 1);
    s.protect(pages(&s, 10, 2), Prot::READ).unwrap();
    s.protect(pages(&s, 40, 1), Prot::NONE).unwrap();
    // Remap page 20 to another section page, and release page 30.
    s.map_section(pages(&s, 20, 1), sec, 63 * page(), Prot::READ_WRITE).unwrap();
    s.decommit(pages(&s, 30, 1)).unwrap();
    assert_eq!(s.views().len(), 4, "{:?}", s.views());
    for p in 0..64u64 {
        let r = first_byte(&s, p * page());
        match p {
            20 => assert_eq!(r.unwrap(), 64, "page 20 shows section page 63"),
            30 | 40 => assert!(r.is_err(), "page {p} is not readable"),
            _ => assert_eq!(r.unwrap(), p as u8 + 1, "page {p}"),
        }
        let w = s.write(GuestAddr(p * page() + 1), &[0]);
        assert_eq!(w.is_ok(), !matches!(p, 10 | 11 | 30 | 40), "page {p} writable");
    }
}

#[test]
fn aliases_see_each_others_writes() {
    if !crate::watch_gate::views("aliases_see_each_others_writes") {
        return;
    }
    let s = space();
    let sec = s.create_section(16 * page()).unwrap();
    assert_eq!(s.map_pages(GuestAddr(0), sec, &[5, 5, 5], Prot::READ_WRITE).unwrap(), 3);
    s.map_section(pages(&s, 100, 1), sec, 5 * page(), Prot::READ_WRITE).unwrap();
    s.write(GuestAddr(page() + 17), b"alias").unwrap();
    for at in [0, 2 * page(), 100 * page()] {
        let mut b = [0u8; 5];
        s.read(GuestAddr(at + 17), &mut b).unwrap();
        assert_eq!(&b, b"alias", "at {at:#x}");
    }
}

#[test]
fn mapping_a_view_over_private_pages_takes_them_out_of_the_extent_map() {
    if !crate::watch_gate::views("mapping_a_view_over_private_pages_takes_them_out_of_the_extent_map") {
        return;
    }
    let s = space();
    s.commit(pages(&s, 0, 16), Prot::READ_WRITE).unwrap();
    let sec = s.create_section(4 * page()).unwrap();
    // Windows cannot shrink an allocation: a view over part of a committed private allocation
    // whose other pages are committed is refused, and nothing changes (docs/windows.md).
    #[cfg(windows)]
    {
        let e = s.map_section(pages(&s, 4, 4), sec, 0, Prot::READ_WRITE).unwrap_err();
        assert!(format!("{e:?}").contains("cuts private allocation"), "{e:?}");
        assert_eq!(extents(&s), vec![(0, 16)]);
        s.write(GuestAddr(5 * page()), b"kept").unwrap();
        return;
    }
    #[allow(unreachable_code)]
    s.map_section(pages(&s, 4, 4), sec, 0, Prot::READ_WRITE).unwrap();
    assert_eq!(extents(&s), vec![(0, 4), (8, 16)]);
    // A commit over the view re-protects it but does not record it as private.
    s.commit(pages(&s, 0, 16), Prot::READ_WRITE).unwrap();
    assert_eq!(extents(&s), vec![(0, 4), (8, 16)]);
    assert_eq!(shared_regions(&s, pages(&s, 0, 16)), vec![(4, 8)]);
}

#[test]
fn bad_ranges_are_errors_not_crashes() {
    let s = space();
    let w = s.window();
    let e = s.range(w - page(), 2 * page()).unwrap_err();
    assert!(matches!(e, SpaceError::OutOfWindow { .. }));
    assert_eq!(
        e.to_string(),
        format!("guest range {:#x}+0x2000 is outside the guest window 0x0..0x40000000", w - page())
    );
    assert!(matches!(s.range(w, page()), Err(SpaceError::OutOfWindow { .. })));
    assert!(matches!(s.range(page(), 0), Err(SpaceError::ZeroLength { .. })));
    assert!(matches!(s.range(page() + 1, page()), Err(SpaceError::Unaligned { .. })));
    assert!(matches!(s.range(0, page() - 1), Err(SpaceError::Unaligned { .. })));
    // A range built without the window is checked by every operation.
    let outside = GuestRange::new(GuestAddr(w), page()).unwrap();
    assert!(matches!(s.commit(outside, Prot::READ_WRITE), Err(SpaceError::OutOfWindow { .. })));
    assert!(matches!(s.decommit(outside), Err(SpaceError::OutOfWindow { .. })));
    assert!(matches!(s.zero(outside), Err(SpaceError::OutOfWindow { .. })));
    assert!(matches!(s.protect(outside, Prot::READ), Err(SpaceError::OutOfWindow { .. })));
    assert!(matches!(s.populate(outside), Err(SpaceError::OutOfWindow { .. })));
    assert!(matches!(s.host_addr(GuestAddr(w)), Err(SpaceError::OutOfWindow { .. })));
    assert!(matches!(s.write(GuestAddr(w - 1), b"ab"), Err(SpaceError::OutOfWindow { .. })));
    assert!(matches!(s.read(GuestAddr(u64::MAX), &mut [0]), Err(SpaceError::OutOfWindow { .. })));
    // Reading reserved memory is an error naming the pages.
    let e = s.read(GuestAddr(0), &mut [0]).unwrap_err();
    assert!(matches!(e, SpaceError::NotCommitted { lo: 0, .. }), "{e}");
}

#[test]
fn bad_sections_and_windows_are_errors() {
    let s = space();
    let sec = s.create_section(4 * page()).unwrap();
    let e = s.map_section(pages(&s, 0, 4), sec, page(), Prot::READ_WRITE).unwrap_err();
    assert!(matches!(e, SpaceError::PastSection { .. }), "{e}");
    assert!(matches!(s.map_section(pages(&s, 0, 1), sec, 1, Prot::READ), Err(SpaceError::Unaligned { .. })));
    s.destroy_section(sec).unwrap();
    assert!(matches!(s.map_section(pages(&s, 0, 1), sec, 0, Prot::READ), Err(SpaceError::NoSection(_))));
    assert!(matches!(s.create_section(0), Err(SpaceError::ZeroLength { .. })));
    assert!(matches!(Space::with_window(page() + 1), Err(SpaceError::BadWindow { .. })));
    assert!(matches!(Space::with_window(0), Err(SpaceError::BadWindow { .. })));
}

/// Maps anonymous read-write memory at `range` where nothing is mapped (`MAP_FIXED_NOREPLACE`), as
/// the process's allocator would after foreign code unmapped a hole there, and fills it with
/// `byte`. Returns its host address.
#[cfg(target_os = "linux")]
fn map_foreign(space: &Space, range: GuestRange, byte: u8) -> usize {
    let host = space.host_addr(range.start()).unwrap();
    let len = range.len() as usize;
    // SAFETY: MAP_FIXED_NOREPLACE maps only where nothing is mapped (the hole the test made); it
    // replaces nothing.
    let p = unsafe {
        libc::mmap(
            host as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    assert_eq!(p as usize, host, "the foreign mapping lands in the hole");
    // SAFETY: the test just mapped these `len` bytes read-write; nothing else refers to them.
    unsafe { std::ptr::write_bytes(p as *mut u8, byte, len) };
    host
}

/// Whether the foreign memory of `range` (at host `host`) is still mapped read-write and holds
/// `byte` everywhere.
#[cfg(target_os = "linux")]
fn foreign_intact(space: &Space, range: GuestRange, host: usize, byte: u8) -> bool {
    let regions = space.kernel_regions(range).unwrap();
    if !(regions.len() == 1 && regions[0].read && regions[0].write && !regions[0].shared) {
        return false;
    }
    // SAFETY: the test's own foreign mapping, still mapped readable (just checked); no one
    // writes to it meanwhile.
    let bytes = unsafe { std::slice::from_raw_parts(host as *const u8, range.len() as usize) };
    bytes.iter().all(|b| *b == byte)
}

#[cfg(target_os = "linux")]
#[test]
fn a_foreign_mapping_in_the_window_is_never_taken_over() {
    let s = space();
    s.commit(pages(&s, 0, 8), Prot::READ_WRITE).unwrap();
    fill(&s, pages(&s, 0, 8), |p| p as u8 + 1);
    let hole = pages(&s, 20, 4);
    unmap_behind(&s, hole);
    let foreign = map_foreign(&s, hole, 0xa5);
    let sec = s.create_section(64 * page()).unwrap();
    let named = |e: SpaceError, op: &str| {
        let t = e.to_string();
        assert!(matches!(e, SpaceError::Foreign { .. }), "{op}: {t}");
        assert!(t.starts_with(&format!("{op} refused: guest range 0x14000+0x4000 holds a rw- private")), "{t}");
    };
    named(s.commit(pages(&s, 0, 64), Prot::READ_WRITE).unwrap_err(), "commit");
    let e = s.commit(pages(&s, 22, 1), Prot::READ).unwrap_err();
    assert!(e.to_string().starts_with("commit refused: guest range 0x16000+0x1000"), "{e}");
    named(s.decommit(pages(&s, 16, 16)).unwrap_err(), "decommit");
    named(s.protect(pages(&s, 16, 16), Prot::READ).unwrap_err(), "protect");
    named(s.map_section(pages(&s, 16, 16), sec, 0, Prot::READ_WRITE).unwrap_err(), "map section");
    named(s.zero(pages(&s, 16, 16)).unwrap_err(), "zero");
    named(s.store(GuestAddr(20 * page()), &vec![1; 4 * page() as usize]).unwrap_err(), "store");
    assert!(foreign_intact(&s, hole, foreign, 0xa5), "the foreign mapping and its bytes are untouched");
    // Nothing of the space's own changed either.
    assert_eq!(extents(&s), vec![(0, 8)]);
    assert!(s.views().is_empty());
    for p in 0..8 {
        assert_eq!(first_byte(&s, p * page()).unwrap(), p as u8 + 1);
    }
    // Around the foreign mapping the space works as before.
    s.commit(pages(&s, 24, 8), Prot::READ_WRITE).unwrap();
    s.decommit(pages(&s, 0, 20)).unwrap();
    assert!(foreign_intact(&s, hole, foreign, 0xa5));
}

#[cfg(target_os = "linux")]
#[test]
fn a_hole_is_refilled_and_never_replaced_over() {
    let s = space();
    // A decommit or a view over a hole reserves it again, without MAP_FIXED over the hole.
    unmap_behind(&s, pages(&s, 4, 2));
    s.decommit(pages(&s, 0, 16)).unwrap();
    assert_eq!(s.kernel_regions(pages(&s, 0, 16)).unwrap().len(), 1, "one reserved region again");
    unmap_behind(&s, pages(&s, 4, 2));
    let sec = s.create_section(16 * page()).unwrap();
    s.map_section(pages(&s, 0, 16), sec, 0, Prot::READ_WRITE).unwrap();
    assert_eq!(shared_regions(&s, pages(&s, 0, 16)), vec![(0, 16)]);
    // A protection over a hole is an error, and changes nothing below the hole.
    unmap_behind(&s, pages(&s, 40, 1));
    let e = s.protect(pages(&s, 32, 16), Prot::READ_WRITE).unwrap_err();
    assert!(e.to_string().starts_with("protect 0x20000+0x10000"), "{e}");
    assert!(first_byte(&s, 32 * page()).is_err(), "the pages below the hole stay reserved");
}

#[test]
fn store_checks_that_it_cannot_fault() {
    let s = space();
    s.commit(pages(&s, 0, 2), Prot::READ_WRITE).unwrap();
    s.commit(pages(&s, 2, 1), Prot::READ).unwrap();
    s.store(GuestAddr(page() - 2), b"abcd").unwrap();
    let mut b = [0u8; 4];
    s.read(GuestAddr(page() - 2), &mut b).unwrap();
    assert_eq!(&b, b"abcd");
    // A read-only page, a reserved page, a store running into either: errors, not SIGSEGV.
    for (at, len) in [(2 * page(), 1), (2 * page() - 1, 2), (8 * page(), 1), (0, 3 * page())] {
        let e = s.store(GuestAddr(at), &vec![1; len as usize]).unwrap_err();
        assert!(matches!(e, SpaceError::NotWritable { .. }), "{e}");
        assert!(e.to_string().starts_with(&format!("store {at:#x}+{len:#x} refused")), "{e}");
    }
    assert_eq!(first_byte(&s, 2 * page()).unwrap(), 0, "nothing was stored");
    s.decommit(pages(&s, 0, 2)).unwrap();
    assert!(matches!(s.store(GuestAddr(0), &[1]), Err(SpaceError::NotWritable { .. })));
    assert!(s.store(GuestAddr(0), &[]).is_ok());
}

/// Runs the test `space::<name>` alone in a child process (a `SIGSEGV` there fails this test, not
/// the test binary); returns true in the child, where the caller runs the body.
fn in_child(name: &str) -> bool {
    if std::env::var_os(crate::watch_gate::ALONE).is_some() {
        return true;
    }
    crate::watch_gate::in_child_alone(&format!("space::{name}"));
    false
}

/// The host address of guest address `at`, as a pointer for a system call.
#[cfg(target_os = "linux")]
fn host_ptr(s: &Space, at: u64) -> *mut libc::c_void {
    s.host_addr(GuestAddr(at)).unwrap() as *mut libc::c_void
}

/// Issue 33, item 5: the embedder made a page read-only itself (inside [`Space::changing`]) where
/// the space committed it read-write: a store to it raised `SIGSEGV`. It is an error naming the
/// store, and the pages around it take stores as before.
#[cfg(target_os = "linux")]
#[test]
fn store_to_a_page_the_embedder_made_read_only_is_an_error() {
    if !in_child("store_to_a_page_the_embedder_made_read_only_is_an_error") {
        return;
    }
    let s = space();
    s.commit(pages(&s, 0, 4), Prot::READ_WRITE).unwrap();
    {
        let _change = s.changing();
        // SAFETY: page 1 is committed in this test's own space and no reference points into it.
        assert_eq!(unsafe { libc::mprotect(host_ptr(&s, page()), page() as usize, libc::PROT_READ) }, 0);
    }
    for (at, len) in [(page() + 8, 1), (page() - 2, 4), (0, 4 * page())] {
        let e = s.store(GuestAddr(at), &vec![1; len as usize]).unwrap_err();
        assert!(matches!(e, SpaceError::NotWritable { .. }), "{e}");
        assert!(e.to_string().starts_with(&format!("store {at:#x}+{len:#x} refused")), "{e}");
    }
    assert_eq!(first_byte(&s, page()).unwrap(), 0, "nothing was stored on the read-only page");
    s.store(GuestAddr(2 * page() + 3), b"still").unwrap();
    let mut b = [0u8; 5];
    s.read(GuestAddr(2 * page() + 3), &mut b).unwrap();
    assert_eq!(&b, b"still");
}

/// Issue 33, item 5: with the mprotect backend, a store to an armed page from a thread that blocks
/// `SIGSEGV` killed the process (the kernel forces a blocked fault signal to its default action).
/// It lands, and the next collect reports it.
#[cfg(target_os = "linux")]
#[test]
fn store_to_an_armed_page_from_a_thread_that_blocks_sigsegv_lands_and_is_reported() {
    if !in_child("store_to_an_armed_page_from_a_thread_that_blocks_sigsegv_lands_and_is_reported") {
        return;
    }
    let s = std::sync::Arc::new(space());
    let r = pages(&s, 0, 8);
    s.commit(r, Prot::READ_WRITE).unwrap();
    let t = Tracker::new(
        &s,
        &emuhost::watch::TrackerConfig::default().backend(Some(BackendKind::Mprotect)).skip_self_test(true),
    )
    .unwrap();
    t.arm(r).unwrap();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            // SAFETY: a mask built with sigemptyset/sigaddset, set for this thread only.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGSEGV);
                assert_eq!(libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()), 0);
            }
            s.store(GuestAddr(3 * page() + 5), &[7]).unwrap();
            s.store(GuestAddr(6 * page() - 1), &[8, 9]).unwrap();
        });
    });
    let runs: Vec<(u64, u64)> = t.collect(r).unwrap().runs.iter().map(|r| (r.start.0 / page(), r.pages)).collect();
    assert_eq!(runs, vec![(3, 1), (5, 2)]);
    assert_eq!(first_byte(&s, 3 * page() + 5).unwrap(), 7);
    assert_eq!(first_byte(&s, 6 * page()).unwrap(), 9);
    assert_eq!(t.collect(r).unwrap().pages(), 0, "armed again");
}

/// Issue 33, item 5: a tracker whose embedder handles the faults (no handler of emuhost's): a
/// store to an armed page before the embedder's handler is installed raised `SIGSEGV`. It lands,
/// and the next collect reports it.
#[test]
fn store_to_an_armed_page_before_the_embedders_handler_is_in_lands_and_is_reported() {
    if !in_child("store_to_an_armed_page_before_the_embedders_handler_is_in_lands_and_is_reported") {
        return;
    }
    let s = std::sync::Arc::new(space());
    let r = pages(&s, 0, 8);
    s.commit(r, Prot::READ_WRITE).unwrap();
    let config = TrackerConfig::default().backend(Some(crate::watch_gate::PROTECTION)).embedder_handles_faults(true);
    let t = Tracker::new(&s, &config).unwrap();
    t.arm(r).unwrap();
    s.store(GuestAddr(2 * page() + 1), b"no handler").unwrap();
    let runs: Vec<(u64, u64)> = t.collect(r).unwrap().runs.iter().map(|r| (r.start.0 / page(), r.pages)).collect();
    assert_eq!(runs, vec![(2, 1)]);
    let mut b = [0u8; 10];
    s.read(GuestAddr(2 * page() + 1), &mut b).unwrap();
    assert_eq!(&b, b"no handler");
    // Still armed: the next store is reported too, and a page the guest made read-only is refused.
    s.store(GuestAddr(2 * page()), &[1]).unwrap();
    assert_eq!(t.collect(r).unwrap().pages(), 1);
    s.protect(pages(&s, 4, 1), Prot::READ).unwrap();
    assert!(matches!(s.store(GuestAddr(4 * page()), &[1]), Err(SpaceError::NotWritable { .. })));
}

#[cfg(target_os = "linux")]
#[cfg(feature = "faults")]
#[test]
fn region_queries_read_proc_self_maps_where_procmap_query_is_missing() {
    use emuhost::faults::{self, Plan};
    use emuhost::space::QueryPath;
    use emuhost::watch::{BackendKind, PageRun, Tracker};
    // The way is chosen when the space is made: the scope need not outlive that.
    let scope = faults::scoped(Plan { no_procmap_query: true, ..Plan::default() });
    let s = std::sync::Arc::new(space());
    drop(scope);
    assert_eq!(s.region_queries().unwrap(), QueryPath::TextForced);

    // kernel_regions: one read of the text, however many regions.
    s.commit(pages(&s, 8, 4), Prot::READ).unwrap();
    let sec = s.create_section(4 * page()).unwrap();
    s.map_section(pages(&s, 16, 4), sec, 0, Prot::READ_WRITE).unwrap();
    let before = calls();
    let regions = s.kernel_regions(pages(&s, 0, 64)).unwrap();
    assert_eq!(calls().since(&before).query, 1, "one read of /proc/self/maps");
    let shape: Vec<_> =
        regions.iter().map(|g| (g.start as u64 / page(), g.end as u64 / page(), g.read, g.write, g.shared)).collect();
    assert_eq!(
        shape,
        vec![
            (0, 8, false, false, false),
            (8, 12, true, false, false),
            (12, 16, false, false, false),
            (16, 20, true, true, true),
            (20, 64, false, false, false)
        ]
    );

    // The commit walk over a hole, from one read of the text.
    unmap_behind(&s, pages(&s, 30, 2));
    let r = pages(&s, 24, 16);
    let before = calls();
    assert_eq!(s.commit(r, Prot::READ_WRITE).unwrap(), CommitPath::RegionWalk { regions: 2, holes: 1 });
    assert_eq!(calls().since(&before).query, 1, "{:?}", calls().since(&before));
    fill(&s, r, |p| p as u8);
    assert_eq!(first_byte(&s, 31 * page()).unwrap(), 31);

    // A foreign mapping is told apart from the text too.
    let hole = pages(&s, 50, 2);
    unmap_behind(&s, hole);
    let foreign = map_foreign(&s, hole, 0x3c);
    let e = s.commit(pages(&s, 48, 8), Prot::READ_WRITE).unwrap_err();
    assert!(e.to_string().starts_with("commit refused: guest range 0x32000+0x2000 holds a rw- private"), "{e}");
    assert!(foreign_intact(&s, hole, foreign, 0x3c));

    // The mprotect tracker arms by the regions the text gives.
    let t = Tracker::new(
        &s,
        &emuhost::watch::TrackerConfig::default().backend(Some(BackendKind::Mprotect)).skip_self_test(true),
    )
    .unwrap();
    t.arm(r).unwrap();
    assert!(s.kernel_regions(r).unwrap().iter().all(|g| g.read && !g.write), "armed pages are read-only");
    s.store(GuestAddr(27 * page() + 5), &[9]).unwrap();
    assert_eq!(t.collect(r).unwrap().runs, vec![PageRun { start: GuestAddr(27 * page()), pages: 1 }]);
    assert_eq!(first_byte(&s, 27 * page() + 5).unwrap(), 9);
}

#[cfg(target_os = "linux")]
#[cfg(feature = "faults")]
#[test]
fn populate_touches_the_pages_where_madv_populate_write_is_missing() {
    use emuhost::faults::{self, Plan};
    let s = space();
    let r = pages(&s, 256, 32);
    s.commit(r, Prot::READ_WRITE).unwrap();
    s.write(GuestAddr(260 * page()), b"kept").unwrap();
    let _scope = faults::scoped(Plan { no_populate_write: true, ..Plan::default() });
    assert!(!pagemap(&s, GuestAddr(256 * page())).0, "a fresh page is not present");
    let before = calls();
    s.populate(r).unwrap();
    let used = calls().since(&before);
    assert_eq!(used.madvise, 0, "no MADV_POPULATE_WRITE: {used:?}");
    assert!((0..32).all(|p| pagemap(&s, GuestAddr((256 + p) * page())).0), "populated pages are present");
    let mut b = [0u8; 4];
    s.read(GuestAddr(260 * page()), &mut b).unwrap();
    assert_eq!(&b, b"kept", "touching changes no byte");
    assert_eq!(first_byte(&s, 256 * page()).unwrap(), 0);
    // Reserved or read-only pages: an error naming the range, never a fault.
    s.commit(pages(&s, 300, 1), Prot::READ).unwrap();
    for (at, n) in [(299, 2), (1024, 2)] {
        let e = s.populate(pages(&s, at, n)).unwrap_err();
        assert!(e.to_string().starts_with(&format!("populate {:#x}+{:#x}", at * page(), n * page())), "{e}");
    }
}

/// Host address space low in the user half, far below where the kernel places mappings (top
/// down from below the stack), so nothing else in the process lands there while a test runs.
#[cfg(target_os = "linux")]
const LOW: usize = 0x2000_0000_0000;

/// The `i`th of 16 bases 4 GiB apart that test `slot` tries (slots lie 64 GiB apart).
#[cfg(target_os = "linux")]
fn low_base(slot: usize, i: usize) -> usize {
    LOW + (slot * 16 + i) * (4 << 30)
}

/// Builds `config` (at most a 2 GiB window) at the first free base of `slot` (a parallel test may
/// hold one).
#[cfg(target_os = "linux")]
fn at_free_base(config: SpaceConfig, slot: usize) -> Space {
    for i in 0..16 {
        let base = low_base(slot, i);
        match config.clone().at(base).build() {
            Ok(s) => return s,
            Err(SpaceError::Exists { .. }) => continue,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("no free base from {:#x}", low_base(slot, 0));
}

/// Maps `len` bytes at host `at` with `prot` where nothing is mapped (`MAP_FIXED_NOREPLACE`), as a
/// caller reserving its own window would; `None` where something is mapped there.
#[cfg(target_os = "linux")]
fn map_at(at: usize, len: usize, prot: libc::c_int, shared: bool) -> Option<usize> {
    let kind = if shared { libc::MAP_SHARED } else { libc::MAP_PRIVATE };
    // SAFETY: MAP_FIXED_NOREPLACE maps only where nothing is mapped; it replaces nothing.
    let p = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            len,
            prot,
            kind | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED && p as usize == at).then_some(at)
}

/// A caller's own reservation of `len` bytes at a free low address (`slot` keeps tests apart).
#[cfg(target_os = "linux")]
fn caller_reservation(len: usize, prot: libc::c_int, shared: bool, slot: usize) -> usize {
    (0..16)
        .find_map(|i| map_at(low_base(slot, i), len, prot, shared))
        .expect("a free low address for the caller's reservation")
}

#[cfg(target_os = "linux")]
fn unmap(at: usize, len: usize) {
    // SAFETY: the test's own mapping; nothing refers to it.
    assert_eq!(unsafe { libc::munmap(at as *mut libc::c_void, len) }, 0);
}

/// The lines of `/proc/self/maps` over host `a..b` as (start, end, perms), clipped to it.
#[cfg(target_os = "linux")]
fn maps(a: usize, b: usize) -> Vec<(usize, usize, String)> {
    let text = std::fs::read_to_string("/proc/self/maps").unwrap();
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_ascii_whitespace();
            let (s, e) = f.next()?.split_once('-')?;
            let (s, e) = (usize::from_str_radix(s, 16).ok()?, usize::from_str_radix(e, 16).ok()?);
            let perms = f.next()?.to_string();
            (s < b && e > a).then_some((s.max(a), e.min(b), perms))
        })
        .collect()
}

/// Whether host `a..b` is mapped entirely as `PROT_NONE` private memory (a reservation).
#[cfg(target_os = "linux")]
fn reserved(a: usize, b: usize) -> bool {
    let m = maps(a, b);
    let covered = m.first().is_some_and(|r| r.0 == a)
        && m.last().is_some_and(|r| r.1 == b)
        && m.windows(2).all(|w| w[0].1 == w[1].0);
    covered && m.iter().all(|r| r.2 == "---p")
}

#[cfg(target_os = "linux")]
#[test]
fn a_window_at_a_chosen_base_is_used_there() {
    let s = at_free_base(SpaceConfig::default().window(1 << 30), 0);
    let base = s.host_base();
    assert!((0..16).any(|i| base == low_base(0, i)), "the window is at the base asked for: {base:#x}");
    assert!(reserved(base, base + (1 << 30)), "{:x?}", maps(base, base + (1 << 30)));
    let r = pages(&s, 16, 4);
    s.commit(r, Prot::READ_WRITE).unwrap();
    s.store(GuestAddr(16 * page() + 3), b"at base").unwrap();
    let mut b = [0u8; 7];
    s.read(GuestAddr(16 * page() + 3), &mut b).unwrap();
    assert_eq!(&b, b"at base");
    // SAFETY: the committed page holds the bytes just stored; a read through its host address.
    assert_eq!(unsafe { *((base + 16 * page() as usize + 3) as *const u8) }, b'a');
    assert_eq!(maps(base + 16 * page() as usize, base + 20 * page() as usize)[0].2, "rw-p");
    drop(s);
    // Dropped: the range is free again (nothing else maps down here).
    let again = map_at(base, 1 << 30, libc::PROT_NONE, false).expect("the window was unmapped");
    unmap(again, 1 << 30);
}

#[cfg(target_os = "linux")]
#[test]
fn an_occupied_base_is_refused_naming_it_and_left_intact() {
    let len = 8 * page() as usize;
    let mine = caller_reservation(len, libc::PROT_READ | libc::PROT_WRITE, false, 1);
    // SAFETY: the test's own read-write mapping of `len` bytes.
    unsafe { std::ptr::write_bytes(mine as *mut u8, 0x6b, len) };
    let window = 16 * page();
    let cases = [
        // Over the start of the mapping, over its end, and the guard pages alone over it.
        (mine - 4 * page() as usize, 0, mine - 4 * page() as usize, mine + 12 * page() as usize),
        (mine + 4 * page() as usize, 0, mine + 4 * page() as usize, mine + 20 * page() as usize),
        (
            mine + len + 2 * page() as usize,
            4 * page(),
            mine + len - 2 * page() as usize,
            mine + len + 22 * page() as usize,
        ),
    ];
    for (base, guard, start, end) in cases {
        let e = SpaceConfig::default().window(window).guard(guard).at(base).build().unwrap_err();
        // Issue 33, item 11: its own error (it was an OS failure, `EEXIST`), naming the mapping.
        assert!(matches!(&e, SpaceError::Exists { .. }), "{e:?}");
        assert!(e.to_string().starts_with(&format!("reserving host range {start:#x}..{end:#x}")), "{e}");
        let first = start.max(mine);
        let found =
            format!("{first:#x}..{:#x} is mapped there (a rw- private anonymous mapping)", (mine + len).min(end));
        assert!(e.to_string().ends_with(&found), "{e}");
    }
    assert_eq!(maps(mine, mine + len), vec![(mine, mine + len, "rw-p".to_string())], "still mapped as it was");
    // SAFETY: the test's own mapping, still mapped read-write (checked just above).
    let bytes = unsafe { std::slice::from_raw_parts(mine as *const u8, len) };
    assert!(bytes.iter().all(|b| *b == 0x6b), "its bytes are untouched");
    unmap(mine, len);
    // A base that is not page-aligned, or guards that run below address 0, are refused too.
    let e = SpaceConfig::default().window(window).at(LOW + 1).build().unwrap_err();
    assert!(e.to_string().contains(&format!("at host {:#x}+{window:#x}", LOW + 1)), "{e}");
    assert!(e.to_string().ends_with("not page-aligned"), "{e}");
    let e = SpaceConfig::default().window(window).guard(2 * page()).at(page() as usize).build().unwrap_err();
    assert!(matches!(e, SpaceError::BadPlacement { .. }), "{e}");
    let e = SpaceConfig::default().window(window).guard(page() + 1).build().unwrap_err();
    assert!(matches!(e, SpaceError::BadPlacement { .. }), "{e}");
}

#[cfg(target_os = "linux")]
#[test]
fn guard_pages_are_reserved_around_the_window() {
    let guard = 4 * page();
    let window = 64 * page();
    for (slot, anywhere) in [(2, false), (0, true)] {
        let config = SpaceConfig::default().window(window).guard(guard);
        let s = if anywhere { config.build().unwrap() } else { at_free_base(config, slot) };
        assert_eq!(s.guard(), guard);
        let (base, g, w) = (s.host_base(), guard as usize, window as usize);
        // Committed, the window's pages are told apart from the guards around it.
        s.commit(s.range(0, window).unwrap(), Prot::READ_WRITE).unwrap();
        let m = maps(base - g, base + w + g);
        assert_eq!(
            m,
            vec![
                (base - g, base, "---p".into()),
                (base, base + w, "rw-p".into()),
                (base + w, base + w + g, "---p".into())
            ],
            "anywhere: {anywhere}"
        );
        // Nothing else can be mapped there, and the space does not reach past its window.
        assert!(map_at(base - g, page() as usize, libc::PROT_READ, false).is_none(), "the low guard is taken");
        assert!(map_at(base + w + g - page() as usize, page() as usize, libc::PROT_READ, false).is_none());
        let e = s.store(GuestAddr(window - 2), b"over").unwrap_err();
        assert!(matches!(e, SpaceError::OutOfWindow { .. }), "{e}");
        let mut b = [0u8; 1];
        let local = libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: 1 };
        let remote = libc::iovec { iov_base: (base + w) as *mut libc::c_void, iov_len: 1 };
        // SAFETY: reads one byte of this process into `b`; the kernel fails rather than fault.
        let r = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        assert_eq!(r, -1, "a guard page is not readable");
        assert_eq!(first_byte(&s, window - 1).unwrap(), 0);
        drop(s);
        if !anywhere {
            // Unmapped with the window (nothing else maps down here).
            let again = map_at(base - g, w + 2 * g, libc::PROT_NONE, false).expect("the guards were unmapped");
            unmap(again, w + 2 * g);
        }
    }
}

#[cfg(target_os = "linux")]
#[test]
fn an_adopted_reservation_is_used_and_given_back_reserved() {
    use emuhost::watch::{self, PageRun, Tracker};
    let len = 256 * page() as usize;
    let base = caller_reservation(len, libc::PROT_NONE, false, 3);
    // SAFETY: the test made the reservation, keeps it mapped until after the space is dropped,
    // and maps nothing else in it meanwhile.
    let s = std::sync::Arc::new(unsafe { SpaceConfig::default().adopt(base, len as u64) }.unwrap());
    assert!(s.adopted() && s.guard() == 0);
    assert_eq!((s.host_base(), s.window()), (base, len as u64));
    let r = pages(&s, 8, 32);
    s.commit(r, Prot::READ_WRITE).unwrap();
    s.store(GuestAddr(8 * page() + 1), b"adopted").unwrap();
    let mut b = [0u8; 7];
    s.read(GuestAddr(8 * page() + 1), &mut b).unwrap();
    assert_eq!(&b, b"adopted");
    s.decommit(pages(&s, 30, 2)).unwrap();
    assert!(first_byte(&s, 30 * page()).is_err(), "decommitted");
    s.protect(pages(&s, 12, 1), Prot::READ).unwrap();
    let sec = s.create_section(4 * page()).unwrap();
    s.map_section(pages(&s, 100, 4), sec, 0, Prot::READ_WRITE).unwrap();
    s.write(GuestAddr(100 * page()), b"view").unwrap();
    // A tracker with the backend the machine chooses works on it.
    let t = Tracker::new(&s, &emuhost::watch::TrackerConfig::default()).unwrap();
    let armed = pages(&s, 16, 8);
    t.arm(armed).unwrap();
    s.store(GuestAddr(20 * page() + 9), &[1]).unwrap();
    let runs = t.collect(armed).unwrap().runs;
    assert_eq!(
        runs,
        vec![PageRun { start: GuestAddr(20 * page()), pages: 1 }],
        "{:?}",
        watch::choose(&emuhost::settings::Settings::default().tracker_config()).ok()
    );
    assert!(!reserved(base, base + len), "in use, the pages are committed");
    drop(t);
    drop(s);
    // Given back: still mapped, all of it PROT_NONE and private (the view is gone too).
    assert!(reserved(base, base + len), "{:x?}", maps(base, base + len));
    // Decommitted, not just protected: made accessible again, the pages hold zeros.
    // SAFETY: the test's own reservation, which no one else uses now.
    assert_eq!(unsafe { libc::mprotect(base as *mut libc::c_void, len, libc::PROT_READ) }, 0);
    for at in [8 * page() as usize + 1, 12 * page() as usize, 20 * page() as usize + 9, 100 * page() as usize] {
        // SAFETY: readable (just made so) and the test's own.
        assert_eq!(unsafe { *((base + at) as *const u8) }, 0, "at {at:#x}");
    }
    unmap(base, len);
}

#[cfg(target_os = "linux")]
#[test]
fn adopt_refuses_what_is_not_a_reservation_naming_it() {
    let p = page() as usize;
    let adopt = |base: usize, len: usize| {
        // SAFETY: the test's own mappings, kept mapped until the test unmaps them; each call is
        // refused (asserted), so no space ever uses them.
        unsafe { SpaceConfig::default().adopt(base, len as u64) }.unwrap_err()
    };
    let refused = |e: SpaceError, base: usize, len: usize, why: &str| {
        let t = e.to_string();
        assert!(matches!(e, SpaceError::Adopt { .. }), "{t}");
        assert!(t.starts_with(&format!("adopting host range {base:#x}+{len:#x} as the guest window refused: ")), "{t}");
        assert!(t.contains(why), "{t}");
    };
    // A hole in the middle.
    let base = caller_reservation(16 * p, libc::PROT_NONE, false, 4);
    unmap(base + 4 * p, 2 * p);
    let gap = format!("nothing is mapped at {:#x}..{:#x}", base + 4 * p, base + 6 * p);
    refused(adopt(base, 16 * p), base, 16 * p, &gap);
    unmap(base, 16 * p);
    // Nothing at all.
    refused(adopt(base, 16 * p), base, 16 * p, &format!("nothing is mapped at {base:#x}..{:#x}", base + 16 * p));
    // Accessible memory, and shared memory, are not reservations.
    let rw = caller_reservation(8 * p, libc::PROT_READ | libc::PROT_WRITE, false, 4);
    refused(adopt(rw, 8 * p), rw, 8 * p, &format!("{rw:#x}..{:#x} is a rw- private anonymous mapping", rw + 8 * p));
    let shared = caller_reservation(8 * p, libc::PROT_NONE, true, 5);
    refused(adopt(shared, 8 * p), shared, 8 * p, "is a --- shared");
    // A reservation with one committed page in it.
    let part = caller_reservation(8 * p, libc::PROT_NONE, false, 6);
    // SAFETY: the test's own reservation.
    assert_eq!(unsafe { libc::mprotect((part + 3 * p) as *mut libc::c_void, p, libc::PROT_READ) }, 0);
    refused(adopt(part, 8 * p), part, 8 * p, &format!("{:#x}..{:#x} is a r-- private", part + 3 * p, part + 4 * p));
    // Bad ranges, and guards or a placement asked of an adopted window.
    refused(adopt(part + 1, 8 * p), part + 1, 8 * p, "not aligned");
    refused(adopt(part, 0), part, 0, "null or empty");
    refused(adopt(usize::MAX - p + 1, 2 * p), usize::MAX - p + 1, 2 * p, "runs past the end");
    // SAFETY: as above; refused.
    let e = unsafe { SpaceConfig::default().guard(page()).adopt(part, 8 * p as u64) }.unwrap_err();
    refused(e, part, 8 * p, "guard pages");
    // Nothing was changed.
    assert_eq!(maps(rw, rw + 8 * p), vec![(rw, rw + 8 * p, "rw-p".to_string())]);
    assert_eq!(maps(shared, shared + 8 * p), vec![(shared, shared + 8 * p, "---s".to_string())]);
    assert_eq!(maps(part + 3 * p, part + 4 * p), vec![(part + 3 * p, part + 4 * p, "r--p".to_string())]);
    for (at, n) in [(rw, 8), (shared, 8), (part, 8)] {
        unmap(at, n * p);
    }
}

/// A commit, a decommit and a protection count as changes in flight from before they wait for
/// the space's lock until they return; guards nest.
#[test]
fn changes_in_flight_count_each_change_while_it_waits_and_runs() {
    let s = space();
    let r = pages(&s, 0, 4);
    s.commit(r, Prot::READ_WRITE).unwrap();
    assert_eq!(s.changes_in_flight(), 0);
    type Op<'a> = &'a (dyn Fn(&Space) + Sync);
    let ops: [(&str, Op); 3] = [
        ("commit", &|s| {
            s.commit(pages(s, 8, 2), Prot::READ_WRITE).unwrap();
        }),
        ("protect", &|s| s.protect(pages(s, 0, 1), Prot::READ).unwrap()),
        ("decommit", &|s| s.decommit(pages(s, 8, 2)).unwrap()),
    ];
    for (name, op) in ops {
        std::thread::scope(|sc| {
            // Holds the space's lock until told, or until `tx` is dropped (a failed assertion
            // below unwinds through it, so the scope's join does not hang).
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            let (held_tx, held_rx) = std::sync::mpsc::channel();
            let s = &s;
            sc.spawn(move || {
                s.with_layout(r, |_| {
                    held_tx.send(()).unwrap();
                    let _ = rx.recv();
                })
            });
            held_rx.recv().unwrap();
            let t = sc.spawn(move || op(s));
            let start = std::time::Instant::now();
            while s.changes_in_flight() != 1 {
                assert!(start.elapsed() < std::time::Duration::from_secs(10), "{name}: not counted");
                std::thread::yield_now();
            }
            tx.send(()).unwrap();
            t.join().unwrap();
        });
        assert_eq!(s.changes_in_flight(), 0, "{name}");
    }
    let (a, b) = (s.changing(), s.changing());
    assert_eq!(s.changes_in_flight(), 2);
    drop((a, b));
    assert_eq!(s.changes_in_flight(), 0);
}

/// A change that comes while a long read is in flight waits for it before it takes the space's
/// lock: meanwhile the lock is free (a collect goes on) and the change is not made; it is made
/// once the read ends. A long read is refused while a change is in flight.
#[test]
fn a_change_waits_for_a_long_read_in_flight_before_it_takes_the_space_lock() {
    let s = space();
    let r = pages(&s, 8, 2);
    let read = s.try_long_read().expect("no change in flight");
    assert_eq!(s.long_reads_in_flight(), 1);
    std::thread::scope(|sc| {
        let t = sc.spawn(|| s.commit(r, Prot::READ_WRITE).map(|_| ()));
        while s.changes_in_flight() != 1 && !t.is_finished() {
            std::thread::yield_now();
        }
        std::thread::sleep(std::time::Duration::from_millis(30));
        // The space's lock is free, and the commit not made.
        assert!(s.allocations_in(r).is_empty(), "the commit went ahead of the long read");
        assert!(!t.is_finished());
        assert!(s.try_long_read().is_none(), "a long read while a change is in flight");
        assert_eq!(s.long_reads_in_flight(), 1, "the refused one is not counted");
        drop(read);
        t.join().unwrap().unwrap();
    });
    assert_eq!(s.allocations_in(r).len(), 1);
    assert_eq!((s.changes_in_flight(), s.long_reads_in_flight(), s.long_read_waits()), (0, 0, 1));
    // What finds nothing to change waits for nothing: committed pages committed again where
    // reserved (a binding's import over the guest's memory).
    let _read = s.try_long_read().expect("no change in flight");
    assert_eq!(s.commit_reserved(r, Prot::READ_WRITE).unwrap(), 0);
    assert_eq!(s.long_read_waits(), 1);
}

/// A long read kept (by mistake) for ever slows a change down, it does not stop it.
#[test]
fn a_long_read_kept_for_ever_delays_a_change_for_a_bounded_time() {
    let s = space();
    let kept = s.try_long_read().expect("no change in flight");
    let (tx, rx) = std::sync::mpsc::channel();
    let done = std::thread::scope(|sc| {
        sc.spawn(|| tx.send(s.commit(pages(&s, 8, 2), Prot::READ_WRITE).map(|_| ())).unwrap());
        let done = rx.recv_timeout(std::time::Duration::from_secs(20));
        // Before the scope joins the thread, so a commit that waits for ever fails the test.
        drop(kept);
        done
    });
    assert!(matches!(done, Ok(Ok(()))), "{done:?}");
}

/// An observer that asks releases to keep the mappings, and records what each release did.
#[cfg(target_os = "linux")]
#[derive(Default)]
struct KeepMappings {
    in_place: std::sync::Mutex<Vec<bool>>,
}

#[cfg(target_os = "linux")]
impl emuhost::space::Observer for KeepMappings {
    fn changed(&self, _space: &Space, change: emuhost::space::Change) {
        if let emuhost::space::Change::Released { in_place, .. } = change {
            self.in_place.lock().unwrap().push(in_place);
        }
    }

    fn keeps_mappings(&self) -> bool {
        true
    }
}

#[cfg(target_os = "linux")]
fn keeping(space: &Space) -> std::sync::Arc<KeepMappings> {
    let obs = std::sync::Arc::new(KeepMappings::default());
    let weak: std::sync::Weak<dyn emuhost::space::Observer> = std::sync::Arc::downgrade(&obs) as _;
    space.observe(weak);
    obs
}

/// Where the kernel accounts commits strictly, releases map the range anew (only a new mapping
/// gives the charge back).
#[cfg(target_os = "linux")]
fn strict_overcommit() -> bool {
    std::fs::read_to_string("/proc/sys/vm/overcommit_memory").map_or(true, |m| m.trim() == "2")
}

/// A release that keeps the mappings (a uffd tracker asks for it: its registration stays) drops
/// the pages as one that maps the range anew does: none resident, inaccessible, zeroes when
/// committed again, and the kernel's regions reserved. Without an observer that asks, the range
/// is mapped anew.
#[cfg(target_os = "linux")]
#[test]
fn a_release_that_keeps_the_mappings_drops_the_pages() {
    let s = space();
    let obs = keeping(&s);
    let r = pages(&s, 0, 16);
    s.commit(r, Prot::READ_WRITE).unwrap();
    fill(&s, r, |_| 0xa5);
    assert!(pagemap(&s, GuestAddr(3 * page())).0);
    let before = calls();
    s.decommit(pages(&s, 2, 8)).unwrap();
    let used = calls().since(&before);
    let in_place = !strict_overcommit();
    assert_eq!(*obs.in_place.lock().unwrap(), [in_place]);
    if in_place {
        assert_eq!((used.mprotect, used.madvise, used.mmap), (1, 1, 0), "{used:?}");
    }
    for pg in 2..10 {
        assert!(!pagemap(&s, GuestAddr(pg * page())).0, "page {pg} dropped");
        assert!(first_byte(&s, pg * page()).is_err(), "page {pg} inaccessible");
    }
    assert_eq!(first_byte(&s, page()).unwrap(), 0xa5, "the rest keeps its bytes");
    assert_eq!(first_byte(&s, 10 * page()).unwrap(), 0xa5);
    let regions = s.kernel_regions(pages(&s, 2, 8)).unwrap();
    assert!(regions.iter().all(|g| !g.read && !g.write), "{regions:?}");
    assert_eq!(s.allocations().len(), 2, "split in two");
    s.commit(r, Prot::READ_WRITE).unwrap();
    assert_eq!(first_byte(&s, 5 * page()).unwrap(), 0, "zeroes when committed again");
    assert_eq!(first_byte(&s, 11 * page()).unwrap(), 0xa5);
    // Once the observer is gone, a release maps the range anew.
    drop(obs);
    let before = calls();
    s.decommit(r).unwrap();
    assert_eq!(calls().since(&before).mmap, 1);
}

/// A release that cannot keep the mappings maps the range anew: a shared view in it, or pages
/// the kernel will not drop (locked behind the space's back).
#[cfg(target_os = "linux")]
#[test]
fn a_release_maps_anew_where_it_cannot_keep_the_mappings() {
    if strict_overcommit() {
        return;
    }
    let s = space();
    let obs = keeping(&s);
    let sec = s.create_section(4 * page()).unwrap();
    s.commit(pages(&s, 0, 8), Prot::READ_WRITE).unwrap();
    s.map_pages(GuestAddr(8 * page()), sec, &[0, 1, 2, 3], Prot::READ_WRITE).unwrap();
    s.decommit(pages(&s, 4, 8)).unwrap();
    assert_eq!(*obs.in_place.lock().unwrap(), [false], "a view in the range");
    assert!(s.views().is_empty(), "{:?}", s.views());
    let r = pages(&s, 16, 8);
    s.commit(r, Prot::READ_WRITE).unwrap();
    fill(&s, r, |_| 7);
    let host = s.host_addr(GuestAddr(18 * page())).unwrap();
    // SAFETY: one committed page of the space's reservation, locked in place; nothing else.
    assert_eq!(unsafe { libc::mlock(host as *const libc::c_void, page() as usize) }, 0);
    s.decommit(r).unwrap();
    assert_eq!(*obs.in_place.lock().unwrap(), [false, false], "a locked page in the range");
    assert!(!pagemap(&s, GuestAddr(18 * page())).0);
    s.commit(r, Prot::READ_WRITE).unwrap();
    assert_eq!(first_byte(&s, 18 * page()).unwrap(), 0);
}

/// Issue 33, item 8: after foreign code unmapped a hole in the window, what lands there is not
/// the space's: a foreign mapping survives the space's drop with its bytes, and a second space
/// reserved in the hole is neither committed by the first space's calls nor unmapped by its drop.
#[cfg(target_os = "linux")]
#[test]
fn what_lands_in_a_hole_outlives_the_space_and_is_never_committed_by_it() {
    let s = space();
    let hole = pages(&s, 256, 512);
    unmap_behind(&s, hole);
    let foreign = map_foreign(&s, pages(&s, 256, 4), 0x5a);
    // A second space reserved in the hole, with its own pages committed and written.
    let inner_base = s.host_addr(GuestAddr(512 * page())).unwrap();
    let inner = SpaceConfig::default().window(64 * page()).at(inner_base).build().unwrap();
    inner.commit(pages(&inner, 0, 4), Prot::READ_WRITE).unwrap();
    inner.write(GuestAddr(8), b"inner").unwrap();
    // The first space's calls over the second's window (its reserved pages: they look exactly
    // like the first space's own) are refused, and change nothing there.
    let over = pages(&s, 520, 40);
    for (op, e) in [
        ("commit", s.commit(over, Prot::READ_WRITE).err()),
        ("decommit", s.decommit(over).err()),
        ("protect", s.protect(over, Prot::READ_WRITE).err()),
        ("zero", s.zero(over).err()),
    ] {
        assert!(matches!(e, Some(SpaceError::Foreign { .. })), "{op} over another space's window: {e:?}");
    }
    assert!(first_byte(&inner, 64 * page() - 1).is_err(), "the second space's reserved pages stay reserved");
    // Dropped, the first space leaves both where they are.
    drop(s);
    // SAFETY: the foreign mapping is the test's own; it is still mapped if the drop left it.
    let still = std::fs::read_to_string("/proc/self/maps").unwrap().lines().any(|l| {
        let (range, _) = l.split_once(' ').unwrap();
        let (a, b) = range.split_once('-').unwrap();
        usize::from_str_radix(a, 16).unwrap() <= foreign && foreign < usize::from_str_radix(b, 16).unwrap()
    });
    assert!(still, "the space's drop unmapped the foreign mapping");
    // SAFETY: mapped (checked just above) read-write by the test, filled with 0x5a.
    assert_eq!(unsafe { *(foreign as *const u8) }, 0x5a);
    let mut b = [0u8; 5];
    inner.read(GuestAddr(8), &mut b).unwrap();
    assert_eq!(&b, b"inner", "the second space outlives the first");
    inner.commit(pages(&inner, 8, 4), Prot::READ_WRITE).unwrap();
    // SAFETY: unmaps the test's own foreign mapping.
    unsafe { libc::munmap(foreign as *mut libc::c_void, 4 * page() as usize) };
}

/// Windows: what foreign code can do to the window is free a placeholder piece (split off with
/// `MEM_PRESERVE_PLACEHOLDER`, then released) and allocate there itself, at the 64 KiB
/// granularity. The space refuses every call over that allocation, naming it, and leaves it and
/// its bytes alone; around it the space works as before.
#[cfg(windows)]
#[test]
fn a_foreign_allocation_in_the_window_is_never_taken_over() {
    use windows_sys::Win32::System::Memory::{
        MEM_COMMIT, MEM_PRESERVE_PLACEHOLDER, MEM_RELEASE, MEM_RESERVE, PAGE_READWRITE, VirtualAlloc, VirtualFree,
    };
    if !crate::watch_gate::views("a_foreign_allocation_in_the_window_is_never_taken_over") {
        return;
    }
    let s = space();
    s.commit(pages(&s, 0, 8), Prot::READ_WRITE).unwrap();
    fill(&s, pages(&s, 0, 8), |p| p as u8 + 1);
    // 64 KiB at guest 128 KiB: the base is 64 KiB-aligned, so this is on the granularity.
    let hole = pages(&s, 32, 16);
    let host = s.host_addr(hole.start()).unwrap();
    assert_eq!(host % (64 << 10), 0);
    let len = hole.len() as usize;
    // SAFETY: the test frees a piece of the space's own placeholder behind its back and puts its
    // own allocation there, as foreign code would; nothing refers to those pages.
    let foreign = unsafe {
        assert_ne!(VirtualFree(host as *mut _, len, MEM_RELEASE | MEM_PRESERVE_PLACEHOLDER), 0);
        assert_ne!(VirtualFree(host as *mut _, 0, MEM_RELEASE), 0);
        let p = VirtualAlloc(host as *const _, len, MEM_RESERVE | MEM_COMMIT, PAGE_READWRITE);
        assert_eq!(p as usize, host);
        std::ptr::write_bytes(p as *mut u8, 0xa5, len);
        p as usize
    };
    let intact = || {
        // SAFETY: the test's own allocation, still committed read-write (the space never touches
        // it); nobody writes to it meanwhile.
        let bytes = unsafe { std::slice::from_raw_parts(foreign as *const u8, len) };
        bytes.iter().all(|b| *b == 0xa5)
    };
    let sec = s.create_section(64 * page()).unwrap();
    let foreign_err = |e: SpaceError, op: &str| {
        let t = e.to_string();
        assert!(matches!(e, SpaceError::Foreign { .. }), "{op}: {t}");
        assert!(t.starts_with(&format!("{op} refused: guest range 0x20000+0x10000")), "{t}");
    };
    foreign_err(s.commit(pages(&s, 0, 64), Prot::READ_WRITE).unwrap_err(), "commit");
    foreign_err(s.decommit(pages(&s, 16, 48)).unwrap_err(), "decommit");
    foreign_err(s.protect(pages(&s, 16, 48), Prot::READ).unwrap_err(), "protect");
    foreign_err(s.map_section(pages(&s, 32, 16), sec, 0, Prot::READ_WRITE).unwrap_err(), "map section");
    foreign_err(s.zero(pages(&s, 32, 16)).unwrap_err(), "zero");
    assert!(intact(), "the foreign allocation and its bytes are untouched");
    assert_eq!(extents(&s), vec![(0, 8)]);
    for p in 0..8 {
        assert_eq!(first_byte(&s, p * page()).unwrap(), p as u8 + 1);
    }
    // Around it the space works as before.
    s.commit(pages(&s, 48, 16), Prot::READ_WRITE).unwrap();
    s.decommit(pages(&s, 0, 32)).unwrap();
    assert!(intact());
}

/// Windows: a caller's reservation (`VirtualAlloc` `MEM_RESERVE`) adopted as the window is
/// committed, written, protected and released by the space; write watch cannot see it (its
/// allocation is not the space's, nor `MEM_WRITE_WATCH`), so the tracker the machine chooses is a
/// guard tracker, and it reports exactly the written page. Views need placeholders, which an
/// adopted window has not: map_section is refused, naming them. The drop leaves the reservation
/// the caller's.
#[cfg(windows)]
#[test]
fn an_adopted_reservation_is_tracked_by_the_guard() {
    use emuhost::watch::{BackendKind, PageRun, Tracker, TrackerConfig};
    use windows_sys::Win32::System::Memory::{
        MEM_FREE, MEM_RELEASE, MEM_RESERVE, MEMORY_BASIC_INFORMATION, PAGE_NOACCESS, VirtualAlloc, VirtualFree,
        VirtualQuery,
    };
    let len = 256 * page() as usize;
    // SAFETY: a fresh reservation the system places; the test owns it until it frees it below.
    let base = unsafe { VirtualAlloc(std::ptr::null(), len, MEM_RESERVE, PAGE_NOACCESS) } as usize;
    assert_ne!(base, 0);
    {
        // SAFETY: the test made the reservation, keeps it until after the space is dropped, and
        // puts nothing else in it.
        let s = std::sync::Arc::new(unsafe { SpaceConfig::default().adopt(base, len as u64) }.unwrap());
        assert!(s.adopted());
        let r = pages(&s, 8, 32);
        s.commit(r, Prot::READ_WRITE).unwrap();
        s.write(GuestAddr(8 * page() + 1), b"adopted").unwrap();
        assert_eq!(first_byte(&s, 8 * page() + 1).unwrap(), b'a');
        s.protect(pages(&s, 12, 1), Prot::READ).unwrap();
        let sec = s.create_section(4 * page()).unwrap();
        let e = s.map_section(pages(&s, 100, 4), sec, 0, Prot::READ_WRITE).unwrap_err();
        assert!(format!("{e:?}").contains("placeholders"), "{e:?}");
        let t = Tracker::new(&s, &TrackerConfig::default()).unwrap();
        assert_eq!(t.kind(), BackendKind::Guard);
        let armed = pages(&s, 16, 8);
        t.arm(armed).unwrap();
        s.store(GuestAddr(20 * page() + 9), &[1]).unwrap();
        assert_eq!(t.collect(armed).unwrap().runs, vec![PageRun { start: GuestAddr(20 * page()), pages: 1 }]);
        s.decommit(pages(&s, 30, 2)).unwrap();
        assert!(first_byte(&s, 30 * page()).is_err(), "decommitted");
    }
    // The caller's reservation is still there, and the caller gives it back.
    // SAFETY: an all-zero MEMORY_BASIC_INFORMATION is valid; VirtualQuery only reads the
    // address space's description.
    let mut m: MEMORY_BASIC_INFORMATION = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `m` is a valid out buffer of its size.
    assert_ne!(unsafe { VirtualQuery(base as *const _, &mut m, size_of::<MEMORY_BASIC_INFORMATION>()) }, 0);
    assert_ne!(m.State, MEM_FREE, "the adopted reservation stays the caller's");
    // SAFETY: the test's own reservation, unused from here on.
    assert_ne!(unsafe { VirtualFree(base as *mut _, 0, MEM_RELEASE) }, 0);
}

/// Windows: a window at a chosen base (on the 64 KiB granularity) is made there and given back
/// on drop; a base where the caller holds memory is refused with its own error, naming what is
/// there, and that memory is left as it was.
#[cfg(windows)]
#[test]
fn a_window_at_a_chosen_base_and_an_occupied_one_on_windows() {
    use windows_sys::Win32::System::Memory::{
        MEM_COMMIT, MEM_FREE, MEM_RELEASE, MEM_RESERVE, MEMORY_BASIC_INFORMATION, PAGE_NOACCESS, PAGE_READWRITE,
        VirtualAlloc, VirtualFree, VirtualQuery,
    };
    let state = |a: usize| {
        // SAFETY: an all-zero MEMORY_BASIC_INFORMATION is valid; VirtualQuery only reads.
        let mut m: MEMORY_BASIC_INFORMATION = unsafe { std::mem::zeroed() };
        // SAFETY: `m` is a valid out buffer of its size.
        assert_ne!(unsafe { VirtualQuery(a as *const _, &mut m, size_of::<MEMORY_BASIC_INFORMATION>()) }, 0);
        m.State
    };
    let len = 1usize << 24;
    // A free base: reserve a range the system places, then give it back.
    // SAFETY: a fresh reservation, released at once; nothing refers to it.
    let base = unsafe {
        let p = VirtualAlloc(std::ptr::null(), len, MEM_RESERVE, PAGE_NOACCESS) as usize;
        assert_ne!(p, 0);
        assert_ne!(VirtualFree(p as *mut _, 0, MEM_RELEASE), 0);
        p
    };
    let s = SpaceConfig::default().window(len as u64).at(base).build().unwrap();
    assert_eq!(s.host_base(), base);
    s.commit(pages(&s, 16, 4), Prot::READ_WRITE).unwrap();
    s.write(GuestAddr(16 * page() + 3), b"at base").unwrap();
    assert_eq!(first_byte(&s, 16 * page() + 3).unwrap(), b'a');
    drop(s);
    assert_eq!(state(base), MEM_FREE, "the window was given back");
    // The caller's memory at that base now.
    // SAFETY: the test's own allocation at a free address; freed below.
    let mine =
        unsafe { VirtualAlloc(base as *const _, 16 * page() as usize, MEM_RESERVE | MEM_COMMIT, PAGE_READWRITE) };
    assert_eq!(mine as usize, base);
    // SAFETY: the test's own read-write allocation.
    unsafe { std::ptr::write_bytes(mine as *mut u8, 0x6b, 16 * page() as usize) };
    let e = SpaceConfig::default().window(len as u64).at(base).build().unwrap_err();
    assert!(matches!(&e, SpaceError::Exists { .. }), "{e:?}");
    assert!(e.to_string().contains("is mapped there (a rw- private"), "{e}");
    // SAFETY: the test's own allocation, untouched by the refused space.
    let bytes = unsafe { std::slice::from_raw_parts(mine as *const u8, 16 * page() as usize) };
    assert!(bytes.iter().all(|b| *b == 0x6b));
    // SAFETY: the test's own allocation, unused from here on.
    assert_ne!(unsafe { VirtualFree(mine, 0, MEM_RELEASE) }, 0);
}
