//! The conformance suite every write-tracking backend passes, and the no-lost-writes stress.

use std::sync::Arc;

use emuhost::counters;
use emuhost::probe::{Offer, Probe};
use emuhost::space::{GuestAddr, GuestRange, Prot, Space, page_size};
use emuhost::watch::{self, BackendKind, Collected, PageRun, Tracker, WatchError};

fn p() -> u64 {
    page_size()
}

/// Whether this machine should have `kind`, by its probed capabilities (not by the backend's own
/// self-test): `Err(why not)` where the kernel lacks what it needs.
fn expected(kind: BackendKind) -> Result<(), String> {
    match kind {
        BackendKind::Uffd => {
            let p = Probe::run();
            if !p.uffd_wp_async() {
                return Err(format!("userfaultfd has no WP_ASYNC (features: {:?})", p.uffd_features));
            }
            match p.pagemap_scan {
                Offer::Yes(()) => Ok(()),
                Offer::No(why) => Err(format!("PAGEMAP_SCAN: {why}")),
            }
        }
        BackendKind::Mprotect => Ok(()),
    }
}

/// Whether a test of `kind` can run here: `false` (a test that then returns) after printing
/// `skipped: <backend>: <reason>` where the kernel lacks what the backend needs. A backend the
/// probed capabilities say this machine has must pass its self-test: a failing one fails the test.
fn usable(kind: BackendKind) -> bool {
    match (watch::self_test(kind), expected(kind)) {
        (Ok(()), _) => true,
        (Err(e), Err(why)) => {
            eprintln!("skipped: {}: {why} (its self-test: {e})", kind.name());
            false
        }
        (Err(e), Ok(())) => panic!("{}: this kernel offers what it needs, but its self-test failed: {e}", kind.name()),
    }
}

fn setup(kind: BackendKind) -> Option<(Arc<Space>, Arc<Tracker>)> {
    if !usable(kind) {
        return None;
    }
    let s = Arc::new(Space::with_window(1 << 30).unwrap());
    let t = Tracker::with_backend(&s, kind).unwrap();
    Some((s, t))
}

fn pages(s: &Space, first: u64, n: u64) -> GuestRange {
    s.range(first * p(), n * p()).unwrap()
}

/// The written page numbers a collect reported.
fn written(c: &Collected) -> Vec<u64> {
    c.page_addrs().iter().map(|a| a.0 / p()).collect()
}

fn poke(s: &Space, page: u64) {
    s.store(GuestAddr(page * p() + 8), &[0x5a]).unwrap();
}

fn calls() -> counters::Counts {
    counters::snapshot().unwrap()
}

/// Releases pages behind the space's back, as foreign code would: a new reserved mapping.
fn release_behind(s: &Space, r: GuestRange) {
    let host = s.host_addr(r.start()).unwrap();
    // SAFETY: the pages lie inside the space's reservation; no reference into them is live.
    let m = unsafe {
        libc::mmap(
            host as *mut libc::c_void,
            r.len() as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_eq!(m as usize, host);
}

/// Decommits one page in place behind the space's back: inaccessible and its bytes dropped, but
/// still inside the same mappings.
fn decommit_in_place(s: &Space, page: u64) {
    let host = s.host_addr(GuestAddr(page * p())).unwrap() as *mut libc::c_void;
    // SAFETY: the page lies inside the space's reservation; no reference into it is live.
    unsafe {
        assert_eq!(libc::mprotect(host, p() as usize, libc::PROT_NONE), 0);
        assert_eq!(libc::madvise(host, p() as usize, libc::MADV_DONTNEED), 0);
    }
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod uffd {
            $( #[test] fn $name() { super::$name(emuhost::watch::BackendKind::Uffd) } )*
        }
        mod mprotect {
            $( #[test] fn $name() { super::$name(emuhost::watch::BackendKind::Mprotect) } )*
        }
    };
}

conformance!(
    one_page,
    first_and_last_page,
    page_runs,
    a_full_output_vector_resumes,
    writes_across_an_allocations_end,
    rearm,
    many_allocations,
    released_behind_the_mappings,
    verify_catches_a_page_decommitted_in_place,
    commit_and_protect_over_watched_pages,
    view_split_keeps_tracking,
    host_writes_after_prepare,
    no_lost_writes,
);

fn one_page(kind: BackendKind) {
    let Some((s, t)) = setup(kind) else { return };
    let r = pages(&s, 0, 64);
    s.commit(r, Prot::READ_WRITE).unwrap();
    t.arm(r).unwrap();
    assert_eq!(written(&t.collect(r).unwrap()), Vec::<u64>::new());
    poke(&s, 7);
    let c = t.collect(r).unwrap();
    assert_eq!(c.runs, vec![PageRun { start: GuestAddr(7 * p()), pages: 1 }]);
    assert!(c.untracked.is_empty());
    assert_eq!(written(&t.collect(r).unwrap()), Vec::<u64>::new(), "collected pages are armed again");
    let b = c.bitmap::<4096>(r);
    assert!(b.get(7 * p()) && !b.get(6 * p()) && b.count() == 1);
}

fn first_and_last_page(kind: BackendKind) {
    let Some((s, t)) = setup(kind) else { return };
    let r = pages(&s, 100, 50);
    s.commit(r, Prot::READ_WRITE).unwrap();
    t.arm(r).unwrap();
    poke(&s, 100);
    s.store(GuestAddr(150 * p() - 1), &[1]).unwrap();
    assert_eq!(written(&t.collect(r).unwrap()), vec![100, 149]);
    // A collect of part of the armed range reports that part only, and leaves the rest.
    poke(&s, 101);
    poke(&s, 140);
    assert_eq!(written(&t.collect(pages(&s, 100, 10)).unwrap()), vec![101]);
    assert_eq!(written(&t.collect(r).unwrap()), vec![140]);
}

fn page_runs(kind: BackendKind) {
    let Some((s, t)) = setup(kind) else { return };
    let r = pages(&s, 0, 32);
    s.commit(r, Prot::READ_WRITE).unwrap();
    t.arm(r).unwrap();
    for pg in [3, 4, 5, 9, 31] {
        poke(&s, pg);
    }
    let c = t.collect(r).unwrap();
    let runs: Vec<(u64, u64)> = c.runs.iter().map(|r| (r.start.0 / p(), r.pages)).collect();
    assert_eq!(runs, vec![(3, 3), (9, 1), (31, 1)]);
}

fn a_full_output_vector_resumes(kind: BackendKind) {
    let Some((s, t)) = setup(kind) else { return };
    // 1,500 separate runs in one allocation: more than one scan's output vector holds.
    let r = pages(&s, 0, 3000);
    s.commit(r, Prot::READ_WRITE).unwrap();
    t.arm(r).unwrap();
    let want: Vec<u64> = (0..3000).step_by(2).collect();
    for &pg in &want {
        poke(&s, pg);
    }
    let c = t.collect(r).unwrap();
    assert_eq!(c.runs.len(), 1500);
    assert_eq!(written(&c), want);
}

fn writes_across_an_allocations_end(kind: BackendKind) {
    let Some((s, t)) = setup(kind) else { return };
    s.commit(pages(&s, 0, 16), Prot::READ_WRITE).unwrap();
    s.commit(pages(&s, 16, 16), Prot::READ_WRITE).unwrap();
    assert_eq!(s.allocations().len(), 2);
    let r = pages(&s, 0, 32);
    t.arm(r).unwrap();
    s.store(GuestAddr(16 * p() - 4), &[7; 8]).unwrap();
    let before = calls();
    assert_eq!(written(&t.collect(r).unwrap()), vec![15, 16]);
    let used = calls().since(&before);
    assert_eq!(used.query, 0, "no region query: {used:?}");
    if kind == BackendKind::Uffd {
        assert_eq!(used.ioctl, 2, "one read per allocation: {used:?}");
    }
}

fn rearm(kind: BackendKind) {
    let Some((s, t)) = setup(kind) else { return };
    let r = pages(&s, 0, 8);
    s.commit(r, Prot::READ_WRITE).unwrap();
    t.arm(r).unwrap();
    poke(&s, 2);
    assert_eq!(written(&t.collect(r).unwrap()), vec![2]);
    poke(&s, 2);
    assert_eq!(written(&t.collect(r).unwrap()), vec![2], "written again after the re-arm");
    // Arming again forgets what was written before.
    poke(&s, 3);
    t.arm(r).unwrap();
    assert_eq!(written(&t.collect(r).unwrap()), Vec::<u64>::new());
    // Disarmed pages are not reported, and stay writable.
    t.disarm(r).unwrap();
    poke(&s, 4);
    assert_eq!(written(&t.collect(r).unwrap()), Vec::<u64>::new());
}

fn many_allocations(kind: BackendKind) {
    let Some((s, t)) = setup(kind) else { return };
    let n = 200;
    for i in 0..n {
        s.commit(pages(&s, i * 4, 4), Prot::READ_WRITE).unwrap();
    }
    let r = pages(&s, 0, n * 4);
    t.arm(r).unwrap();
    let want: Vec<u64> = (0..n).filter(|i| i % 2 == 0).map(|i| i * 4 + (i % 4)).collect();
    for &pg in &want {
        poke(&s, pg);
    }
    let before = calls();
    assert_eq!(written(&t.collect(r).unwrap()), want);
    let used = calls().since(&before);
    assert_eq!(used.query, 0, "{used:?}");
    if kind == BackendKind::Uffd {
        assert_eq!(used.ioctl, n, "one read per allocation: {used:?}");
    }
}

fn released_behind_the_mappings(kind: BackendKind) {
    let Some((s, t)) = setup(kind) else { return };
    let (a, b) = (pages(&s, 0, 8), pages(&s, 8, 8));
    s.commit(a, Prot::READ_WRITE).unwrap();
    s.commit(b, Prot::READ_WRITE).unwrap();
    let r = pages(&s, 0, 16);
    t.arm(r).unwrap();
    poke(&s, 9);
    release_behind(&s, b);
    poke(&s, 1);
    let c = t.collect(r).unwrap();
    assert_eq!(c.untracked, vec![b], "released memory is not tracked, and no error");
    assert_eq!(written(&c), vec![1]);
    // The failure is remembered: the next collect does not read the allocation again.
    let before = calls();
    let c = t.collect(r).unwrap();
    let used = calls().since(&before);
    assert_eq!(c.untracked, vec![b]);
    assert_eq!(used.query, 0, "the failure costs once: {used:?}");
    assert_eq!(used.ioctl + used.copy, 1, "{used:?}");
    // Until the allocation's commit state changes: then it is read again, and tracked.
    s.commit(b, Prot::READ_WRITE).unwrap();
    let c = t.collect(r).unwrap();
    assert!(c.untracked.is_empty(), "{c:?}");
    poke(&s, 10);
    assert!(written(&t.collect(r).unwrap()).contains(&10));
}

fn verify_catches_a_page_decommitted_in_place(kind: BackendKind) {
    let Some((s, _)) = setup(kind) else { return };
    let verifying = Tracker::build(&s, kind, true).unwrap();
    let r = pages(&s, 0, 16);
    s.commit(r, Prot::READ_WRITE).unwrap();
    verifying.arm(r).unwrap();
    poke(&s, 3);
    assert_eq!(written(&verifying.collect(r).unwrap()), vec![3], "verify passes over sound memory");
    // Guest protections are not mismatches.
    s.protect(pages(&s, 12, 1), Prot::NONE).unwrap();
    verifying.collect(r).unwrap();
    decommit_in_place(&s, 5);
    let e = verifying.collect(r).unwrap_err();
    assert!(matches!(e, WatchError::VerifyMismatch { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("0x0..0x10000") && msg.contains("EMUHOST_VERIFY_COLLECT"), "{msg}");
}

fn commit_and_protect_over_watched_pages(kind: BackendKind) {
    let Some((s, t)) = setup(kind) else { return };
    let r = pages(&s, 0, 16);
    s.commit(r, Prot::READ_WRITE).unwrap();
    t.arm(r).unwrap();
    poke(&s, 3);
    s.commit(r, Prot::READ_WRITE).unwrap();
    poke(&s, 4);
    let got = written(&t.collect(r).unwrap());
    assert!(got.contains(&3) && got.contains(&4), "{got:?}");
    // After the commit, tracking goes on.
    t.collect(r).unwrap();
    poke(&s, 6);
    assert_eq!(written(&t.collect(r).unwrap()), vec![6]);
    s.protect(r, Prot::READ).unwrap();
    s.protect(r, Prot::READ_WRITE).unwrap();
    t.collect(r).unwrap();
    poke(&s, 8);
    assert_eq!(written(&t.collect(r).unwrap()), vec![8]);
}

fn view_split_keeps_tracking(kind: BackendKind) {
    let Some((s, t)) = setup(kind) else { return };
    let sec = s.create_section(64 * p()).unwrap();
    let run = pages(&s, 64, 64);
    s.map_pages(run.start(), sec, &(0..64).collect::<Vec<_>>(), Prot::READ_WRITE).unwrap();
    t.arm(run).unwrap();
    poke(&s, 64 + 10);
    poke(&s, 64 + 40);
    s.decommit(pages(&s, 64 + 30, 1)).unwrap();
    let got = written(&t.collect(run).unwrap());
    assert!(got.contains(&74) && got.contains(&104) && !got.contains(&94), "{got:?}");
    t.collect(run).unwrap();
    poke(&s, 64 + 50);
    assert_eq!(written(&t.collect(run).unwrap()), vec![114], "the other pages keep their tracking");
    // A remapped page is reported once (new content), then tracked.
    s.map_section(pages(&s, 64 + 20, 1), sec, 63 * p(), Prot::READ_WRITE).unwrap();
    assert_eq!(written(&t.collect(run).unwrap()), vec![84]);
    poke(&s, 64 + 20);
    assert_eq!(written(&t.collect(run).unwrap()), vec![84]);
    assert_eq!(written(&t.collect(run).unwrap()), Vec::<u64>::new());
}

fn host_writes_after_prepare(kind: BackendKind) {
    let Some((s, t)) = setup(kind) else { return };
    let r = pages(&s, 0, 8);
    s.commit(r, Prot::READ_WRITE).unwrap();
    t.arm(r).unwrap();
    let target = pages(&s, 5, 1);
    t.prepare_host_write(target).unwrap();
    let mut fds = [0i32; 2];
    // SAFETY: pipe fills two descriptors; read(2) writes 5 bytes into a committed, read-write
    // guest page, which the tracker made writable for the host above.
    unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        assert_eq!(libc::write(fds[1], b"hello".as_ptr() as *const libc::c_void, 5), 5);
        let dst = s.host_addr(target.start()).unwrap() as *mut libc::c_void;
        assert_eq!(libc::read(fds[0], dst, 5), 5, "the kernel's write into a watched page must not fail");
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    assert_eq!(written(&t.collect(r).unwrap()), vec![5]);
    let mut b = [0u8; 5];
    s.read(target.start(), &mut b).unwrap();
    assert_eq!(&b, b"hello");
}

fn stress(kind: BackendKind, writes_per_writer: u64) -> Option<(u64, u64)> {
    if !usable(kind) {
        return None;
    }
    let r = watch::stress(kind, writes_per_writer).unwrap();
    eprintln!("{}: {r:?}", kind.name());
    // Every kind of operation ran beside the others: one dropped from the stress fails here.
    for (name, count) in r.ops.kinds() {
        assert!(count > 0, "{}: no {name} in the stress: {:?}", kind.name(), r.ops);
    }
    assert_eq!(r.writes, r.ops.cpu_stores + r.ops.host_writes);
    assert!(r.ops.cpu_stores >= 2 * writes_per_writer);
    Some((r.writes, r.lost))
}

/// CPU stores, host writes, populates (of written pages and of pages just remapped or recommitted),
/// commits, protections, releases and view splits at once, with a collector: no write lost.
fn no_lost_writes(kind: BackendKind) {
    let Some((writes, lost)) = stress(kind, 200_000) else { return };
    eprintln!("{}: {writes} writes, {lost} lost", kind.name());
    assert_eq!(lost, 0, "{} of {writes} writes lost", lost);
}

#[test]
#[ignore = "long: 10^7 writes per backend (cargo test -- --ignored)"]
fn no_lost_writes_long() {
    for kind in [BackendKind::Uffd, BackendKind::Mprotect] {
        let Some((writes, lost)) = stress(kind, 5_000_000) else { continue };
        eprintln!("{}: {writes} writes, {lost} lost", kind.name());
        assert!(writes >= 10_000_000 && lost == 0, "{}: {lost} of {writes} lost", kind.name());
    }
}

#[test]
fn the_self_test_chooses_uffd_where_the_kernel_offers_it_else_mprotect() {
    let choice = watch::choose_from(None).unwrap();
    match expected(BackendKind::Uffd) {
        Ok(()) => assert_eq!(choice.kind, BackendKind::Uffd, "{choice:?}"),
        Err(why) => {
            assert_eq!(choice.kind, BackendKind::Mprotect, "{choice:?}");
            assert!(choice.why.contains("not uffd"), "{choice:?} ({why})");
        }
    }
    watch::self_test(BackendKind::Mprotect).unwrap();
    let e = watch::choose_from(Some("softdirty")).unwrap_err();
    assert!(e.to_string().contains("is no longer offered"), "{e}");
    let forced = watch::choose_from(Some(" MPROTECT ")).unwrap();
    assert_eq!(forced.kind, BackendKind::Mprotect);
    assert!(forced.why.contains("EMUHOST_WATCH"));
}

#[test]
fn bad_input_is_an_error_naming_it() {
    let e = watch::choose_from(Some("fast")).unwrap_err();
    assert_eq!(e.to_string(), "EMUHOST_WATCH=\"fast\" is not one of uffd, mprotect");
    let s = Arc::new(Space::with_window(1 << 20).unwrap());
    let t = Tracker::with_backend(&s, BackendKind::Mprotect).unwrap();
    let outside = GuestRange::new(GuestAddr(1 << 20), p()).unwrap();
    assert!(t.arm(outside).unwrap_err().to_string().contains("outside the guest window"));
    assert!(t.collect(outside).is_err());
    assert!(GuestRange::new(GuestAddr(0), 0).is_err());
    assert!(GuestRange::new(GuestAddr(3), p()).is_err());
}
