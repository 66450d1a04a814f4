//! Snapshots (`emuhost::snapshot`): round trips against full copies read with `Space::read`, on
//! every write-tracking backend of the platform; release, the budget's ring, bad ids.

use std::sync::Arc;

use emuhost::rng::Rng;
use emuhost::snapshot::{SnapshotConfig, SnapshotError, SnapshotId, Snapshots};
use emuhost::space::{GuestAddr, GuestRange, Prot, Space, page_size};
use emuhost::watch::{BackendKind, Tracker, TrackerConfig};

use crate::watch_gate::usable;

fn p() -> u64 {
    page_size()
}

/// Pages in the snapshots' range.
const PAGES: u64 = 64;

/// A space with `PAGES` pages committed read-write at page 16, a tracker of `kind`, and the
/// range.
fn setup(kind: BackendKind) -> Option<(Arc<Space>, Arc<Tracker>, GuestRange)> {
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
struct Full(Vec<(Option<Prot>, Vec<u8>)>);

fn full(s: &Space, r: GuestRange) -> Full {
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

/// `n` random stores of 8 bytes into the range's writable pages.
fn scribble(s: &Space, r: GuestRange, rng: &mut Rng, n: u64) {
    let writable: Vec<u64> = s
        .protections(r)
        .iter()
        .filter(|(_, p)| p.write)
        .flat_map(|(run, _)| (0..run.pages()).map(move |i| run.start().0 + i * page_size()))
        .collect();
    for _ in 0..n {
        let at = rng.pick(&writable) + rng.below(p() / 8) * 8;
        s.store(GuestAddr(at), &rng.next_u64().to_le_bytes()).unwrap();
    }
}

watch_conformance!(
    a_restore_puts_back_what_a_full_copy_saw,
    a_restore_goes_back_over_several_snapshots,
    a_restore_puts_back_commits_decommits_and_protections,
    release_and_the_budget_ring,
    bad_ids_are_refused_naming_them,
);

fn a_restore_puts_back_what_a_full_copy_saw(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let snaps = snapshots(&t, r);
    let mut rng = Rng::new(1);
    scribble(&s, r, &mut rng, 200);
    let want = full(&s, r);
    let id = snaps.take().unwrap();
    scribble(&s, r, &mut rng, 50);
    assert_ne!(full(&s, r), want);
    let got = snaps.restore(id).unwrap();
    assert_eq!(full(&s, r), want);
    assert!(got.pages > 0 && got.pages <= PAGES, "{got:?}");
    // Again, from the restored state with more writes.
    scribble(&s, r, &mut rng, 10);
    snaps.restore(id).unwrap();
    assert_eq!(full(&s, r), want);
}

fn a_restore_goes_back_over_several_snapshots(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let snaps = snapshots(&t, r);
    let mut rng = Rng::new(2);
    let mut taken = Vec::new();
    for round in 0..6 {
        scribble(&s, r, &mut rng, 5 + round * 7);
        taken.push((snaps.take().unwrap(), full(&s, r)));
    }
    scribble(&s, r, &mut rng, 30);
    // Back and forth: every snapshot stays valid after restores of others.
    for k in [1usize, 4, 0, 5, 2, 2, 3] {
        let (id, want) = &taken[k];
        snaps.restore(*id).unwrap();
        assert!(full(&s, r) == *want, "snapshot {id} (round {k})");
        scribble(&s, r, &mut rng, 3);
    }
    // A take after restores is exact too.
    let id = snaps.take().unwrap();
    let want = full(&s, r);
    scribble(&s, r, &mut rng, 20);
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
    scribble(&s, r, &mut rng, 100);
    let want = full(&s, r);
    let id = snaps.take().unwrap();
    // Decommit, recommit, protect between the take and the restore.
    s.decommit(part(0, 6)).unwrap();
    s.commit(part(2, 2), Prot::READ_WRITE).unwrap();
    s.commit(part(40, 4), Prot::READ_WRITE).unwrap();
    s.protect(part(10, 1), Prot::READ_WRITE).unwrap();
    s.protect(part(20, 3), Prot::READ).unwrap();
    scribble(&s, r, &mut rng, 100);
    let got = snaps.restore(id).unwrap();
    assert_eq!(got.decommitted, 4, "{got:?}");
    assert!(full(&s, r) == want);
    assert_eq!(s.protections(r), want_prots(&want, r));
}

/// The protections a full copy saw, as the space's runs.
fn want_prots(f: &Full, r: GuestRange) -> Vec<(GuestRange, Prot)> {
    let mut runs: Vec<(GuestRange, Prot)> = Vec::new();
    for (i, (prot, _)) in f.0.iter().enumerate() {
        let Some(prot) = *prot else { continue };
        let at = r.start().0 + i as u64 * p();
        match runs.last_mut() {
            Some((run, q)) if run.end().0 == at && *q == prot => {
                *run = GuestRange::from_bounds(run.start().0, at + p()).unwrap()
            }
            _ => runs.push((GuestRange::from_bounds(at, at + p()).unwrap(), prot)),
        }
    }
    runs
}

fn release_and_the_budget_ring(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind) else { return };
    let mut rng = Rng::new(4);
    // Room for about two full copies of the range.
    let snaps = Snapshots::new(&t, r, &SnapshotConfig::default().budget_bytes(Some(2 * PAGES * p() + p()))).unwrap();
    let mut ids = Vec::new();
    for _ in 0..4 {
        scribble(&s, r, &mut rng, 40);
        ids.push(snaps.take().unwrap());
    }
    let st = snaps.stats();
    assert!(st.bytes_kept <= 2 * PAGES * p() + p(), "{st:?}");
    assert!(st.dropped_for_budget >= 1, "{st:?}");
    let live = snaps.live();
    assert_eq!(live.last(), ids.last(), "the newest is never dropped");
    assert!(!live.contains(&ids[0]), "the oldest goes first: {live:?}");
    assert!(matches!(snaps.restore(ids[0]), Err(SnapshotError::UnknownSnapshot(id)) if id == ids[0]));
    // A release frees what it kept.
    let before = snaps.stats().bytes_kept;
    let newest = *ids.last().unwrap();
    let older = live[live.len() - 2];
    snaps.release(older).unwrap();
    assert!(snaps.stats().bytes_kept < before, "{:?}", snaps.stats());
    assert_eq!(snaps.live(), [newest]);
    assert_eq!(snaps.stats().released, 1);
    assert!(matches!(snaps.release(older), Err(SnapshotError::UnknownSnapshot(id)) if id == older));
    snaps.release(newest).unwrap();
    assert_eq!((snaps.live(), snaps.stats().bytes_kept), (vec![], 0));
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
