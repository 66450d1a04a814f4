//! Snapshots (`emuhost::snapshot`): round trips against full copies read with `Space::read`, on
//! every write-tracking backend of the platform; release, the budget's ring, bad ids.

use std::sync::Arc;

use emuhost::rng::Rng;
use emuhost::snapshot::{SnapshotConfig, SnapshotError, SnapshotId, SnapshotMode, Snapshots};
use emuhost::space::{GuestAddr, GuestRange, Prot, Space, page_size};
use emuhost::watch::{BackendKind, Tracker, TrackerConfig};

use crate::watch_gate::usable;

pub(crate) fn p() -> u64 {
    page_size()
}

/// Pages in the snapshots' range.
pub(crate) const PAGES: u64 = 64;

/// A space with `PAGES` pages committed read-write at page 16, a tracker of `kind`, and the
/// range.
pub(crate) fn setup(kind: BackendKind) -> Option<(Arc<Space>, Arc<Tracker>, GuestRange)> {
    if !usable(kind) {
        return None;
    }
    let s = Arc::new(Space::with_window(64 << 20).unwrap());
    let t = Tracker::new(&s, &TrackerConfig::default().backend(Some(kind)).skip_self_test(true)).unwrap();
    let r = s.range(16 * p(), PAGES * p()).unwrap();
    s.commit(r, Prot::READ_WRITE).unwrap();
    Some((s, t, r))
}

fn snapshots(t: &Arc<Tracker>, r: GuestRange) -> Snapshots {
    Snapshots::new(t, r, &SnapshotConfig::default()).unwrap()
}

/// What a full copy sees: each page's protection (`None`: not committed) and bytes (read where
/// readable).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Full(pub(crate) Vec<(Option<Prot>, Vec<u8>)>);

pub(crate) fn full(s: &Space, r: GuestRange) -> Full {
    let prots = s.protections(r);
    let mut pages = Vec::new();
    for i in 0..r.pages() {
        let at = r.start().0 + i * p();
        let prot = prots.iter().find(|(run, _)| run.contains(GuestAddr(at))).map(|&(_, prot)| prot);
        let mut bytes = vec![0; p() as usize];
        if prot.is_some_and(|p| p.read) {
            s.read(GuestAddr(at), &mut bytes).unwrap();
        }
        pages.push((prot, bytes));
    }
    Full(pages)
}

/// A store by the CPU (the fault handler's path), or through the kernel (`Space::store`).
pub(crate) fn store(s: &Space, at: u64, v: u64, cpu: bool) {
    if cpu {
        // SAFETY: the tests store only into committed writable (armed) pages, and no thread
        // decommits or protects them meanwhile.
        unsafe { s.store_unchecked(GuestAddr(at), &v.to_le_bytes()) }.unwrap();
    } else {
        s.store(GuestAddr(at), &v.to_le_bytes()).unwrap();
    }
}

/// `n` random stores of 8 bytes into the range's writable pages: through the kernel, or where
/// `cpu_too`, half of them (at random) by the CPU.
pub(crate) fn scribble(s: &Space, r: GuestRange, rng: &mut Rng, n: u64, cpu_too: bool) {
    let writable: Vec<u64> = s
        .protections(r)
        .iter()
        .filter(|(_, p)| p.write)
        .flat_map(|(run, _)| (0..run.pages()).map(move |i| run.start().0 + i * page_size()))
        .collect();
    for _ in 0..n {
        let at = rng.pick(&writable) + rng.below(p() / 8) * 8;
        let cpu = cpu_too && rng.below(2) == 0;
        store(s, at, rng.next_u64(), cpu);
    }
}

watch_conformance!(
    a_restore_puts_back_what_a_full_copy_saw,
    a_restore_goes_back_over_several_snapshots,
    a_restore_puts_back_commits_decommits_and_protections,
    release_and_the_budget_ring,
    bad_ids_are_refused_naming_them,
    pages_unchanged_between_snapshots_are_stored_once,
    other_readers_see_every_write_and_the_restored_pages,
    a_restore_that_would_decommit_held_pages_is_refused_before_any_change,
    a_range_with_a_view_is_refused,
    a_write_beside_a_restore_is_found,
    a_read_gives_a_snapshots_bytes_without_restoring,
    random_takes_restores_and_releases_match_full_copies,
    decommitted_pages_are_freed_with_the_last_snapshot_that_had_them,
);

fn decommitted_pages_are_freed_with_the_last_snapshot_that_had_them(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let snaps = snapshots(&t, r);
    let first = snaps.take().unwrap();
    let want = full(&s, r);
    s.decommit(s.range(r.start().0, 8 * p()).unwrap()).unwrap();
    let second = snaps.take().unwrap();
    assert_eq!(snaps.stats().bytes_kept, PAGES * p());
    snaps.restore(first).unwrap();
    assert!(full(&s, r) == want);
    snaps.restore(second).unwrap();
    snaps.release(first).unwrap();
    assert_eq!(snaps.stats().bytes_kept, (PAGES - 8) * p(), "{:?}", snaps.stats());
    assert_eq!(snaps.restore(second).unwrap().pages, 0);
}

/// A random run of writes, commits, decommits, protections, takes, restores, reads and releases
/// under a budget: every restore and every read matches the full copy made at the take.
fn random_takes_restores_and_releases_match_full_copies(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    random_run(&s, &t, r, SnapshotConfig::default(), 6, 400, false);
}

/// [`random_takes_restores_and_releases_match_full_copies`] in `config`'s mode (its budget set
/// here), from `seed`, `steps` steps; `cpu_too`: half the stores by the CPU.
pub(crate) fn random_run(
    s: &Arc<Space>,
    t: &Arc<Tracker>,
    r: GuestRange,
    config: SnapshotConfig,
    seed: u64,
    steps: u32,
    cpu_too: bool,
) {
    let budget = (PAGES + 40) * p();
    let snaps = Snapshots::new(t, r, &config.budget_bytes(Some(budget))).unwrap();
    let mut rng = Rng::new(seed);
    let mut copies: std::collections::HashMap<SnapshotId, Full> = Default::default();
    let part = |first: u64, n: u64| s.range(r.start().0 + first * p(), n * p()).unwrap();
    for step in 0..steps {
        match rng.below(10) {
            0..=3 => {
                let n = rng.below(8) + 1;
                scribble(s, r, &mut rng, n, cpu_too);
            }
            4 => {
                let id = snaps.take().unwrap();
                copies.insert(id, full(s, r));
            }
            5 | 6 => {
                let live = snaps.live();
                if live.is_empty() {
                    continue;
                }
                let id = rng.pick(&live);
                snaps.restore(id).unwrap();
                assert!(full(s, r) == copies[&id], "step {step}: restore of {id}");
            }
            7 => {
                let live = snaps.live();
                if live.len() > 1 {
                    let id = rng.pick(&live);
                    snaps.release(id).unwrap();
                }
            }
            8 => {
                let (first, n) = (rng.below(PAGES - 4), rng.below(4) + 1);
                match rng.below(3) {
                    0 => s.decommit(part(first, n)).unwrap(),
                    1 => drop(s.commit(part(first, n), Prot::READ_WRITE).unwrap()),
                    _ => s
                        .commit(part(first, n), rng.pick(&[Prot::READ, Prot::NONE, Prot::READ_WRITE]))
                        .map(drop)
                        .unwrap(),
                }
            }
            _ => {
                let live = snaps.live();
                if live.is_empty() {
                    continue;
                }
                let id = rng.pick(&live);
                let i = rng.below(PAGES);
                let (prot, want) = &copies[&id].0[i as usize];
                let mut buf = vec![0; p() as usize];
                let got = snaps.read(id, GuestAddr(r.start().0 + i * p()), &mut buf);
                match prot {
                    Some(prot) => {
                        assert!(got.is_ok(), "step {step}: {got:?}");
                        // A full copy cannot read a page without read access.
                        assert!(!prot.read || buf == *want, "step {step}: read of page {i} of {id}");
                    }
                    None => assert!(matches!(got, Err(SnapshotError::NoBytes { .. })), "step {step}: {got:?}"),
                }
            }
        }
        // Copy at take keeps the budget at every step. Copy before write copies after the take,
        // so its bytes kept pass the budget until the next take drops the oldest.
        let cow = config.mode == SnapshotMode::CopyBeforeWrite;
        assert!(
            cow || snaps.stats().bytes_kept <= budget || snaps.live().len() == 1,
            "step {step}: {:?}",
            snaps.stats()
        );
    }
    let st = snaps.stats();
    assert!(st.taken > 20 && st.dropped_for_budget > 0 && st.released > 0, "{st:?}");
}

fn a_read_gives_a_snapshots_bytes_without_restoring(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let snaps = snapshots(&t, r);
    let mut rng = Rng::new(5);
    let gap = s.range(r.start().0 + 20 * p(), p()).unwrap();
    s.decommit(gap).unwrap();
    scribble(&s, r, &mut rng, 100, false);
    let first = snaps.take().unwrap();
    let want = full(&s, r);
    scribble(&s, r, &mut rng, 100, false);
    let second = snaps.take().unwrap();
    let now = full(&s, r);
    // Across a page end, from both snapshots; the range is untouched.
    for (id, f) in [(first, &want), (second, &now)] {
        let mut buf = vec![0u8; p() as usize + 100];
        snaps.read(id, GuestAddr(r.start().0 + 3 * p() - 50), &mut buf).unwrap();
        assert_eq!(&buf[..50], &f.0[2].1[p() as usize - 50..]);
        assert_eq!(&buf[50..50 + p() as usize], &f.0[3].1[..]);
        assert_eq!(&buf[50 + p() as usize..], &f.0[4].1[..50]);
    }
    assert!(full(&s, r) == now);
    let at_gap = snaps.read(first, GuestAddr(gap.start().0 - 8), &mut [0; 16]).unwrap_err();
    assert!(matches!(at_gap, SnapshotError::NoBytes { addr, .. } if addr == gap.start()), "{at_gap:?}");
    let outside = snaps.read(first, GuestAddr(r.end().0), &mut [0; 1]).unwrap_err();
    assert!(matches!(outside, SnapshotError::NoBytes { addr, .. } if addr == r.end()), "{outside:?}");
    assert!(outside.to_string().contains(&r.to_string()), "{outside}");
    let e = snaps.read(SnapshotId::new(9), r.start(), &mut [0; 1]).unwrap_err();
    assert!(matches!(e, SnapshotError::UnknownSnapshot(_)));
}

fn pages_unchanged_between_snapshots_are_stored_once(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let snaps = snapshots(&t, r);
    let page = p();
    let first = snaps.take().unwrap();
    let base = full(&s, r);
    assert_eq!((snaps.stats().bytes_kept, snaps.stats().pages_copied), (PAGES * page, PAGES));
    write_pages(&s, r, 1, 7);
    let second = snaps.take().unwrap();
    let st = snaps.stats();
    assert_eq!((st.bytes_kept, st.pages_copied), ((PAGES + 1) * page, PAGES + 1), "{st:?}");
    // A take with nothing written copies nothing.
    let third = snaps.take().unwrap();
    assert_eq!(snaps.stats().bytes_kept, (PAGES + 1) * page);
    // A restore puts back only the pages written since: the one page, then the three written.
    let got = snaps.restore(first).unwrap();
    assert_eq!(got.pages, 1, "{got:?}");
    assert!(full(&s, r) == base);
    assert_eq!(snaps.restore(first).unwrap().pages, 0);
    write_pages(&s, r, 3, 8);
    assert_eq!(snaps.restore(third).unwrap().pages, 3);
    assert_eq!(snaps.restore(second).unwrap().pages, 0);
    assert_eq!(snaps.stats().pages_restored, 4);
}

/// Every page a consumer's collect of `r` reports, in range pages.
fn consumed(c: &emuhost::watch::Consumer, r: GuestRange) -> Vec<u64> {
    let mut words = vec![0u64; r.pages().div_ceil(64) as usize];
    c.collect_into(r, p(), &mut words).unwrap();
    (0..r.pages()).filter(|&i| words[(i / 64) as usize] & (1 << (i % 64)) != 0).collect()
}

fn other_readers_see_every_write_and_the_restored_pages(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let cache = t.consumer();
    let snaps = snapshots(&t, r);
    let own = |t: &Tracker| -> Vec<u64> {
        t.collect(r).unwrap().page_addrs().iter().map(|a| (a.0 - r.start().0) / p()).collect()
    };
    consumed(&cache, r);
    own(&t);
    let id = snaps.take().unwrap();
    write_pages(&s, r, 4, 1);
    // The take collects too, as one more consumer: the others still see the writes.
    snaps.take().unwrap();
    assert_eq!(consumed(&cache, r), [0, 1, 2, 3]);
    assert_eq!(own(&t), [0, 1, 2, 3]);
    // The restore's writes reach them: a cache uploads the restored pages again.
    snaps.restore(id).unwrap();
    assert_eq!(consumed(&cache, r), [0, 1, 2, 3]);
    assert_eq!(own(&t), [0, 1, 2, 3]);
    write_pages(&s, r, 1, 2);
    snaps.restore(id).unwrap();
    assert_eq!(consumed(&cache, r), [0]);
    assert_eq!(own(&t), [0]);
}

fn a_restore_that_would_decommit_held_pages_is_refused_before_any_change(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let snaps = snapshots(&t, r);
    let tail = s.range(r.start().0 + (PAGES - 8) * p(), 8 * p()).unwrap();
    s.decommit(tail).unwrap();
    let id = snaps.take().unwrap();
    let taken = full(&s, r);
    s.commit(tail, Prot::READ_WRITE).unwrap();
    write_pages(&s, r, 2, 5);
    let hold = s.hold(s.range(tail.start().0 + 2 * p(), p()).unwrap()).unwrap();
    let before = full(&s, r);
    let e = snaps.restore(id).unwrap_err();
    assert!(matches!(e, SnapshotError::Held { range, .. } if range == tail), "{e:?}");
    assert!(e.to_string().contains(&tail.to_string()), "{e}");
    assert!(full(&s, r) == before, "nothing changed");
    drop(hold);
    snaps.restore(id).unwrap();
    assert!(full(&s, r) == taken);
}

fn a_range_with_a_view_is_refused(kind: BackendKind) {
    if !crate::watch_gate::views("a_range_with_a_view_is_refused") {
        return;
    }
    let Some((s, t, r)) = setup(kind) else { return };
    // The snapshots' range runs 8 reserved pages past `r`, where the view goes (one over part of
    // a private allocation that holds data is refused on Windows).
    let wide = s.range(r.start().0, r.len() + 8 * p()).unwrap();
    let snaps = snapshots(&t, wide);
    let id = snaps.take().unwrap();
    let view = s.range(r.end().0 + 2 * p(), 2 * p()).unwrap();
    let section = s.create_section(2 * p()).unwrap();
    s.map_section(view, section, 0, Prot::READ_WRITE).unwrap();
    // (The private pages: a fresh view's pages may not be readable by a copy under Windows' write
    // watch.)
    let before = full(&s, r);
    for e in [snaps.take().unwrap_err(), snaps.restore(id).unwrap_err()] {
        assert!(matches!(e, SnapshotError::Views { view: v, .. } if v == view), "{e:?}");
        assert!(e.to_string().contains(&view.to_string()), "{e}");
    }
    assert!(full(&s, r) == before);
    assert_eq!(snaps.live(), [id]);
}

/// An observer that stores into one page of the range when the space is next protected (a
/// guest thread's write that lands while a restore runs, at a known point of it).
struct WriteOnProtect {
    host: usize,
    armed: std::sync::atomic::AtomicBool,
}

impl emuhost::space::Observer for WriteOnProtect {
    fn changed(&self, _space: &Space, change: emuhost::space::Change) {
        use std::sync::atomic::Ordering::SeqCst;
        if matches!(change, emuhost::space::Change::Protected { .. }) && self.armed.swap(false, SeqCst) {
            // SAFETY: `host` is a byte of a page the test keeps committed writable (armed by a
            // tracker whose handler takes the fault where it protects).
            #[allow(unsafe_code)]
            unsafe {
                std::ptr::write_volatile(self.host as *mut u8, 0xee)
            };
        }
    }
}

fn a_write_beside_a_restore_is_found(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let snaps = snapshots(&t, r);
    let ro = s.range(r.start().0 + 30 * p(), p()).unwrap();
    s.protect(ro, Prot::READ).unwrap();
    let id = snaps.take().unwrap();
    let taken = full(&s, r);
    // After the take: one page made writable (the restore protects it back) and two written.
    s.protect(ro, Prot::READ_WRITE).unwrap();
    write_pages(&s, r, 2, 3);
    // Written while the restore runs: a page it does not put back (50), then one it does (1),
    // after it put it back.
    for (page, found) in [(50u64, 50u64), (1, 1)] {
        let host = s.host_addr(GuestAddr(r.start().0 + page * p() + 100)).unwrap();
        let hook = Arc::new(WriteOnProtect { host, armed: true.into() });
        let weak: std::sync::Weak<dyn emuhost::space::Observer> = Arc::downgrade(&(hook.clone() as _));
        s.observe(weak);
        s.protect(ro, Prot::READ_WRITE).unwrap_or(());
        hook.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        let e = snaps.restore(id).unwrap_err();
        assert!(
            matches!(e, SnapshotError::ConcurrentWrites { pages: 1, first, .. } if first.start().0 == r.start().0 + found * p()),
            "{e:?}"
        );
        assert!(e.to_string().contains("guest writes ran beside the restore"), "{e}");
        // The write is counted as a change: the next restore puts it back, exactly.
        snaps.restore(id).unwrap();
        assert!(full(&s, r) == taken);
        drop(hook);
        s.protect(ro, Prot::READ_WRITE).unwrap();
        write_pages(&s, r, 2, 4);
    }
}

fn a_restore_puts_back_what_a_full_copy_saw(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let snaps = snapshots(&t, r);
    let mut rng = Rng::new(1);
    scribble(&s, r, &mut rng, 200, false);
    let want = full(&s, r);
    let id = snaps.take().unwrap();
    scribble(&s, r, &mut rng, 50, false);
    assert_ne!(full(&s, r), want);
    let got = snaps.restore(id).unwrap();
    assert_eq!(full(&s, r), want);
    assert!(got.pages > 0 && got.pages <= PAGES, "{got:?}");
    // Again, from the restored state with more writes.
    scribble(&s, r, &mut rng, 10, false);
    snaps.restore(id).unwrap();
    assert_eq!(full(&s, r), want);
}

fn a_restore_goes_back_over_several_snapshots(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let snaps = snapshots(&t, r);
    let mut rng = Rng::new(2);
    let mut taken = Vec::new();
    for round in 0..6 {
        scribble(&s, r, &mut rng, 5 + round * 7, false);
        taken.push((snaps.take().unwrap(), full(&s, r)));
    }
    scribble(&s, r, &mut rng, 30, false);
    // Back and forth: every snapshot stays valid after restores of others.
    for k in [1usize, 4, 0, 5, 2, 2, 3] {
        let (id, want) = &taken[k];
        snaps.restore(*id).unwrap();
        assert!(full(&s, r) == *want, "snapshot {id} (round {k})");
        scribble(&s, r, &mut rng, 3, false);
    }
    // A take after restores is exact too.
    let id = snaps.take().unwrap();
    let want = full(&s, r);
    scribble(&s, r, &mut rng, 20, false);
    snaps.restore(taken[0].0).unwrap();
    snaps.restore(id).unwrap();
    assert!(full(&s, r) == want);
}

fn a_restore_puts_back_commits_decommits_and_protections(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let snaps = snapshots(&t, r);
    let mut rng = Rng::new(3);
    let part = |first: u64, n: u64| s.range(r.start().0 + first * p(), n * p()).unwrap();
    s.decommit(part(40, 8)).unwrap();
    s.protect(part(4, 2), Prot::READ).unwrap();
    s.protect(part(10, 1), Prot::NONE).unwrap();
    scribble(&s, r, &mut rng, 100, false);
    let want = full(&s, r);
    let id = snaps.take().unwrap();
    // Decommit, recommit, protect between the take and the restore.
    s.decommit(part(0, 6)).unwrap();
    s.commit(part(2, 2), Prot::READ_WRITE).unwrap();
    s.commit(part(40, 4), Prot::READ_WRITE).unwrap();
    s.protect(part(10, 1), Prot::READ_WRITE).unwrap();
    s.protect(part(20, 3), Prot::READ).unwrap();
    scribble(&s, r, &mut rng, 100, false);
    let got = snaps.restore(id).unwrap();
    assert_eq!(got.decommitted, 4, "{got:?}");
    // Bytes and protections, page by page.
    assert!(full(&s, r) == want);
}

/// Stores into the range's pages `0..n` (a new value each call).
fn write_pages(s: &Space, r: GuestRange, n: u64, value: u8) {
    for i in 0..n {
        s.store(GuestAddr(r.start().0 + i * p() + 24), &[value; 8]).unwrap();
    }
}

fn release_and_the_budget_ring(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let page = p();
    // The base (every page) and two takes of 10 pages each.
    let budget = (PAGES + 20) * page;
    let snaps = Snapshots::new(&t, r, &SnapshotConfig::default().budget_bytes(Some(budget))).unwrap();
    let mut ids = Vec::new();
    let mut states = Vec::new();
    for round in 0..4 {
        write_pages(&s, r, 10, round + 1);
        ids.push(snaps.take().unwrap());
        states.push(full(&s, r));
    }
    // The fourth take passed the budget: the oldest went, and the 10 pages only it kept.
    let st = snaps.stats();
    assert_eq!((st.bytes_kept, st.dropped_for_budget, st.live), (budget, 1, 3), "{st:?}");
    assert_eq!(snaps.live(), ids[1..]);
    assert!(matches!(snaps.restore(ids[0]), Err(SnapshotError::UnknownSnapshot(id)) if id == ids[0]));
    // A release in the middle frees the pages only it kept.
    snaps.release(ids[2]).unwrap();
    assert_eq!(snaps.stats().bytes_kept, (PAGES + 10) * page, "{:?}", snaps.stats());
    assert!(matches!(snaps.release(ids[2]), Err(SnapshotError::UnknownSnapshot(id)) if id == ids[2]));
    // The newest's pages stay as the next take's base until it is taken.
    snaps.release(ids[3]).unwrap();
    assert!(matches!(snaps.restore(ids[3]), Err(SnapshotError::UnknownSnapshot(id)) if id == ids[3]));
    assert!(matches!(snaps.read(ids[3], r.start(), &mut [0; 1]), Err(SnapshotError::UnknownSnapshot(_))));
    assert_eq!(snaps.stats().bytes_kept, (PAGES + 10) * page);
    write_pages(&s, r, 10, 9);
    let next = snaps.take().unwrap();
    assert_eq!(snaps.stats().bytes_kept, (PAGES + 10) * page);
    assert_eq!(snaps.live(), [ids[1], next]);
    // What is left restores exactly.
    snaps.restore(ids[1]).unwrap();
    assert!(full(&s, r) == states[1]);
    assert_eq!(snaps.stats().released, 2);
    snaps.release(ids[1]).unwrap();
    snaps.release(next).unwrap();
    assert_eq!((snaps.live(), snaps.stats().bytes_kept), (vec![], 0));
    // After everything went, a take copies the whole range again.
    let copied = snaps.stats().pages_copied;
    let last = snaps.take().unwrap();
    assert_eq!(snaps.stats().pages_copied - copied, PAGES);
    let want = full(&s, r);
    write_pages(&s, r, 3, 11);
    snaps.restore(last).unwrap();
    assert!(full(&s, r) == want);
}

fn bad_ids_are_refused_naming_them(kind: BackendKind) {
    let Some((_s, t, r)) = setup(kind) else { return };
    let snaps = snapshots(&t, r);
    for n in [0, 1, 7, u64::MAX] {
        let id = SnapshotId::new(n);
        let e = snaps.restore(id).unwrap_err();
        assert!(matches!(e, SnapshotError::UnknownSnapshot(i) if i == id), "{e:?}");
        assert!(e.to_string().contains(&format!("snapshot {n} is not live")), "{e}");
        assert!(matches!(snaps.release(id), Err(SnapshotError::UnknownSnapshot(_))));
    }
    let id = snaps.take().unwrap();
    assert_eq!(id.get(), 1);
    assert!(matches!(snaps.restore(SnapshotId::new(u64::MAX)), Err(SnapshotError::UnknownSnapshot(_))));
    assert_eq!(snaps.stats().pages_restored, 0);
}

/// Not a check: the cost of a take over a large, sparsely committed window (the default 512 GiB
/// reserved, as the built-in trace's; 256 MiB committed in 64 scattered allocations), ~150 random pages written between takes, as
/// `emuhost replay --snapshot-every 1` takes them. Prints the median and p99 of the takes.
/// `cargo test --release -p emuhost --test it take_cost_over_a_large_window -- --ignored --nocapture`
#[test]
#[ignore = "a measurement, not a check"]
fn take_cost_over_a_large_window() {
    let s = Arc::new(Space::with_window(512 << 30).unwrap());
    let t = Tracker::new(&s, &TrackerConfig::default().skip_self_test(true)).unwrap();
    let mut rng = Rng::new(39);
    let mut pages = Vec::new();
    for k in 0..64u64 {
        let at = k * (8 << 30) + rng.below(256) * p();
        let r = s.range(at, 4 << 20).unwrap();
        s.commit(r, Prot::READ_WRITE).unwrap();
        pages.extend((0..r.pages()).map(|i| at + i * p()));
    }
    let snaps = Snapshots::new(&t, s.range(0, s.window()).unwrap(), &SnapshotConfig::default()).unwrap();
    snaps.take().unwrap();
    let mut times = Vec::new();
    for _ in 0..200 {
        for _ in 0..150 {
            s.store(GuestAddr(rng.pick(&pages)), &rng.next_u64().to_le_bytes()).unwrap();
        }
        let started = std::time::Instant::now();
        let id = snaps.take().unwrap();
        times.push(started.elapsed());
        snaps.release(id).unwrap();
    }
    times.sort_unstable();
    println!(
        "take over a 512 GiB window: median {:?}, p99 {:?}",
        times[times.len() / 2],
        times[times.len() * 99 / 100]
    );
}

/// The SIGSEGV action's handler now (Rust's own, for stack overflows, where emuhost's is not in).
#[cfg(target_os = "linux")]
fn segv_handler() -> libc::sighandler_t {
    // SAFETY: a query of the action only (null new action) into a zeroed local.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut old), 0);
        old.sa_sigaction
    }
}

/// A take, a write and a restore with a uffd tracker (whose writes never fault), the embedder
/// owning `SIGSEGV` or not: the round trip is exact either way; emuhost's handler goes in for the
/// copies with the CPU only where the embedder does not own the signal (alone in a child: no
/// other test's handler is in yet).
#[cfg(target_os = "linux")]
#[test]
fn copies_with_the_cpu_install_no_handler_where_the_embedder_owns_sigsegv() {
    if std::env::var_os(crate::watch_gate::ALONE).is_none() {
        crate::watch_gate::in_child_alone(
            "snapshot::copies_with_the_cpu_install_no_handler_where_the_embedder_owns_sigsegv",
        );
        return;
    }
    if !usable(BackendKind::Uffd) {
        return;
    }
    let first = segv_handler();
    for embedder in [true, false] {
        assert_eq!(segv_handler(), first, "emuhost's handler in before the round trip (embedder {embedder})");
        let s = Arc::new(Space::with_window(64 << 20).unwrap());
        let config = TrackerConfig::default().backend(Some(BackendKind::Uffd)).skip_self_test(true);
        let t = Tracker::new(&s, &config.embedder_handles_faults(embedder)).unwrap();
        let r = s.range(16 * p(), PAGES * p()).unwrap();
        s.commit(r, Prot::READ_WRITE).unwrap();
        s.write(GuestAddr(r.start().0 + 5), b"first").unwrap();
        let before = full(&s, r);
        let snaps = snapshots(&t, r);
        let id = snaps.take().unwrap();
        s.write(GuestAddr(r.start().0 + 5), b"later").unwrap();
        snaps.restore(id).unwrap();
        assert_eq!(full(&s, r), before, "embedder {embedder}");
        let installed = segv_handler() != first;
        assert_eq!(
            installed, !embedder,
            "emuhost's handler installed: {installed}, the embedder owning SIGSEGV: {embedder}"
        );
    }
}

/// A take whose copy with the CPU meets an armed page without access (a decommit beside it that
/// has made the page inaccessible before the tracker's state table heard of it; here the
/// embedder's own `mprotect`): the take fails, as the kernel's copy does, and the page stays
/// without access. (The fault was once claimed as an armed page's write, which made the page
/// writable again: a reserved page then showed as foreign memory to the space's next commit.)
#[cfg(target_os = "linux")]
#[test]
fn a_take_that_meets_an_armed_page_without_access_fails_and_leaves_it_so() {
    let Some((s, t, r)) = setup(BackendKind::Mprotect) else { return };
    let snaps = snapshots(&t, r);
    let at = r.start().0 + 3 * p();
    {
        let _change = s.changing();
        let host = s.host_addr(GuestAddr(at)).unwrap() as *mut libc::c_void;
        // SAFETY: a committed page of this test's own space; no reference points into it.
        assert_eq!(unsafe { libc::mprotect(host, p() as usize, libc::PROT_NONE) }, 0);
    }
    assert!(snaps.take().is_err(), "a take read a page without access");
    let mut b = [0u8; 1];
    assert!(s.read(GuestAddr(at), &mut b).is_err(), "the page was given access back by the take's fault");
}
