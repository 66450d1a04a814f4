//! `replay --snapshot-every N` and `--rewind K`: snapshots of the replay's guest window
//! ([`emuhost::snapshot::Snapshots`], one more reader of the replay's tracker) taken on the render
//! thread at the end of every Nth frame, while every other thread waits at the frame boundary; and
//! the rewind check: every [`REWIND_INTERVAL`]·K frames, the snapshot taken K frames back is
//! restored and those frames' changes of guest memory are made again, and the guest's memory is
//! compared, page by page by hash, with what it was the first time: right after the restore, and
//! after the frames made again.
//!
//! What is made again: the commits, decommits (or zeroings, where an import held the pages) and
//! stores of the K frames, in the order they were made the first time. With `--rewind` each such
//! change is made and logged under one lock ([`MemLog`]), so the order of the log is the order in
//! memory, even where two threads store to the same bytes in one frame; each store's bytes are its
//! thread's pattern, logged with it. Bindings, pools, collects and sleeps change no guest byte and
//! are not made again (the imports stay as they are after frame K; see [`redo`] for a decommit an
//! import holds).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use emuhost::import::{AnyBackend, Importer};
use emuhost::snapshot::{SnapshotError, SnapshotId, Snapshots};
use emuhost::space::ranges::RangeMap;
use emuhost::space::{GuestAddr, GuestRange, Prot, Space, SpaceError, page_size};
use emuhost::watch::Tracker;

/// A rewind every this many times K frames (at the end of frames 4K, 8K, ...: with `--rewind 4`,
/// frames 16, 32, ...).
pub const REWIND_INTERVAL: u64 = 4;
/// The most frames `--snapshot-every` may ask for.
pub const MAX_SNAPSHOT_EVERY: u64 = 1 << 20;
/// The most frames `--rewind` may go back (the snapshots of that many frames are kept).
pub const MAX_REWIND: u64 = 1 << 16;

/// A change of guest memory as the replay made it, logged to be made again after a rewind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MemOp {
    /// A commit (page-rounded bounds), armed on the tracker after it.
    Commit { lo: u64, hi: u64, prot: Prot },
    /// A decommit; `zeroed`: an import held the pages, so they were zeroed in place instead.
    Decommit { lo: u64, hi: u64, zeroed: bool },
    /// A store of `size` bytes of `pattern`.
    Write { addr: u64, size: u64, pattern: u8 },
}

/// The changes of guest memory, in the order they were made: with `--rewind`, each is made and
/// logged under this log's lock. Also the pages the trace has committed, with their protection:
/// the guest memory the rewind check compares.
#[derive(Default)]
pub(super) struct MemLog {
    /// Change number `base + i` and its trace line.
    ops: VecDeque<(u64, MemOp)>,
    base: u64,
    committed: RangeMap<Prot>,
}

impl MemLog {
    /// Logs `op` (made on trace line `line`).
    pub(super) fn push(&mut self, line: u64, op: MemOp) {
        track(&mut self.committed, op);
        self.ops.push_back((line, op));
    }

    /// The number the next change will have.
    fn end(&self) -> u64 {
        self.base + self.ops.len() as u64
    }

    /// Forgets the changes numbered below `pos`.
    fn forget_before(&mut self, pos: u64) {
        while self.base < pos && self.ops.pop_front().is_some() {
            self.base += 1;
        }
    }

    fn runs(&self) -> Runs {
        self.committed.iter().map(|(a, b, p)| (a, b, *p)).collect()
    }
}

/// Page-rounded bounds of `lo..lo + size`.
pub(super) fn page_bounds(lo: u64, size: u64) -> (u64, u64) {
    let p = page_size();
    (lo / p * p, lo.saturating_add(size).div_ceil(p) * p)
}

/// `op`'s effect on the trace's committed pages.
fn track(map: &mut RangeMap<Prot>, op: MemOp) {
    match op {
        MemOp::Commit { lo, hi, prot } if lo < hi => {
            map.remove(lo, hi, |_, _, v| *v);
            map.insert(lo, hi, prot);
        }
        MemOp::Decommit { lo, hi, zeroed: false } if lo < hi => map.remove(lo, hi, |_, _, v| *v),
        _ => {}
    }
}

/// What the snapshots and the rewind check did ([`super::ReplayReport::snapshots`]).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct SnapshotFigures {
    /// `--snapshot-every`: a snapshot at the end of every this many frames.
    pub every: u64,
    /// `--rewind`: frames gone back at each rewind (0: no rewind check).
    pub rewind: u64,
    /// `--rewind-every`: a rewind at the end of every this many frames (0: no rewind check).
    pub every_rewind: u64,
    /// Snapshots taken.
    pub taken: u64,
    /// Pages the takes copied ([`emuhost::snapshot::SnapshotStats::pages_copied`]).
    pub pages_copied: u64,
    /// Bytes of page copies kept at the end, before the replay released its snapshots.
    pub bytes_kept_end: u64,
    /// The most bytes of page copies kept after any take.
    pub bytes_kept_peak: u64,
    /// Each take: the frame it ended (the trace's index), the take's time on the render thread,
    /// and that frame's time in the runtime ([`super::FrameFigures::runtime`]).
    pub takes: Vec<(u64, Duration, Duration)>,
    /// Each restore's time on the render thread.
    pub restores: Vec<Duration>,
    /// Rewinds made (a restore, then the frames made again).
    pub rewinds: u64,
    /// States of the guest's memory compared: after each restore (the snapshot's), and after the
    /// frames made again (the rewind's frame's).
    pub checks: u64,
    /// Of those, the states whose memory differed from the first time.
    pub mismatched_snapshots: u64,
    /// Bytes that differed, in whole pages (the check keeps a hash per page, not a copy).
    pub mismatched_bytes: u64,
    /// The first state that differed: the frame at whose end it was taken, and when it was
    /// compared (after the restore, or after making the frames again).
    pub first_mismatch: Option<(u64, &'static str)>,
    /// Times the importer's imports were released so that a restore, or a decommit made again,
    /// could decommit pages an import held (the bindings import them again as they come).
    pub import_releases: u64,
}

/// A live snapshot: the boundary it was taken at (frames ended), the frame that ended, its id,
/// and the memory log's position then.
struct Kept {
    b: u64,
    frame: u64,
    id: SnapshotId,
    pos: u64,
}

/// Committed runs: first page, end, protection.
type Runs = Vec<(u64, u64, Prot)>;

/// The guest's memory at a boundary the first time, for the rewind check: the trace's committed
/// runs and a hash per page of them.
struct Point {
    b: u64,
    frame: u64,
    runs: Runs,
    pages: Vec<u64>,
}

/// The snapshots of a replay and the rewind check's state (the render thread's, at boundaries).
pub(super) struct SnapRun {
    snaps: Snapshots,
    /// The rewind check: frames gone back, and a rewind every this many frames.
    rewind: Option<(u64, u64)>,
    ring: VecDeque<Kept>,
    points: VecDeque<Point>,
    pub(super) fig: SnapshotFigures,
    /// Test hook: a rewind that does not restore (as a restore that put nothing back would), to
    /// show that the check catches it.
    #[cfg(test)]
    pub(super) skip_restore: bool,
}

/// What the rewind check needs of the replay's runtime.
pub(super) struct Rt<'a> {
    pub(super) space: &'a Space,
    pub(super) tracker: &'a Tracker,
    pub(super) importer: &'a Importer<AnyBackend>,
    pub(super) log: &'a std::sync::Mutex<MemLog>,
}

/// Why a boundary's work failed: what, and the error.
pub(super) type Failure = (String, Box<dyn std::error::Error + Send + Sync>);

fn fail(what: impl Into<String>, e: impl std::error::Error + Send + Sync + 'static) -> Failure {
    (what.into(), Box::new(e))
}

impl SnapRun {
    pub(super) fn new(snaps: Snapshots, every: u64, rewind: Option<(u64, u64)>) -> Self {
        let (k, m) = rewind.unwrap_or((0, 0));
        let fig = SnapshotFigures { every, rewind: k, every_rewind: m, ..Default::default() };
        SnapRun {
            snaps,
            rewind,
            ring: VecDeque::new(),
            points: VecDeque::new(),
            fig,
            #[cfg(test)]
            skip_restore: false,
        }
    }

    /// The test hook [`SnapRun::skip_restore`] set.
    #[cfg(test)]
    pub(super) fn skipping_restores(mut self, on: bool) -> Self {
        self.skip_restore = on;
        self
    }

    /// Whether boundary `b` (frames ended) takes a snapshot.
    pub(super) fn due(every: u64, b: u64) -> bool {
        b > 0 && b.is_multiple_of(every)
    }

    /// Boundary `b`, at the end of frame `frame` (whose time in the runtime was `runtime`), every
    /// other thread waiting: a snapshot, its state hashed where a rewind will compare it, and a
    /// rewind where one is due. Returns the take's time (the render thread's).
    pub(super) fn boundary(&mut self, rt: &Rt<'_>, b: u64, frame: u64, runtime: Duration) -> Result<Duration, Failure> {
        let t = Instant::now();
        let id = self.snaps.take().map_err(|e| fail(format!("the snapshot at the end of frame {frame}"), e))?;
        let took = t.elapsed();
        self.fig.takes.push((frame, took, runtime));
        let kept = self.snaps.stats().bytes_kept;
        self.fig.bytes_kept_peak = self.fig.bytes_kept_peak.max(kept);
        let pos = rt.log.lock().unwrap_or_else(|p| p.into_inner()).end();
        self.ring.push_back(Kept { b, frame, id, pos });
        let keep_from = b.saturating_sub(self.rewind.map_or(0, |(k, _)| k));
        while self.ring.front().is_some_and(|k| k.b < keep_from) {
            let old = self.ring.pop_front().expect("checked");
            self.snaps
                .release(old.id)
                .map_err(|e| fail(format!("releasing the snapshot of frame {}", old.frame), e))?;
        }
        let Some((k, interval)) = self.rewind else { return Ok(took) };
        // The states a rewind at the next multiple of the interval compares: K frames before it,
        // and its own. (Not each snapshot's between: each state is a full read of the guest's
        // memory, some 1.3 GB on the built-in session.)
        if b.is_multiple_of(interval) || b % interval == interval - k {
            // As at each comparison: the background imports and populates land first.
            rt.importer.settle();
            let (runs, pages) =
                state(rt).map_err(|e| fail(format!("reading the guest's memory at the end of frame {frame}"), e))?;
            self.points.push_back(Point { b, frame, runs, pages });
        }
        if b.is_multiple_of(interval) {
            self.rewind(rt, b, k)?;
            self.points.clear();
            let oldest = self.ring.front().map_or(pos, |k| k.pos);
            rt.log.lock().unwrap_or_else(|p| p.into_inner()).forget_before(oldest);
        }
        Ok(took)
    }

    /// The rewind at boundary `b`: the snapshot of boundary `b - k` restored, compared, and the
    /// changes since made again, compared at `b` (the loop compares at each state kept).
    fn rewind(&mut self, rt: &Rt<'_>, b: u64, k: u64) -> Result<(), Failure> {
        let kept = self.ring.iter().find(|x| x.b == b - k).map(|x| (x.id, x.frame, x.pos));
        let points = std::mem::take(&mut self.points);
        let mut points = points.into_iter().filter(|p| p.b >= b - k).peekable();
        let (Some((id, frame, from)), Some(first)) = (kept, points.next_if(|p| p.b == b - k)) else {
            // Never: the snapshot and the state of boundary b - k are kept until this rewind.
            return Err(fail(
                "the rewind",
                std::io::Error::other(format!("no snapshot kept of the boundary {}", b - k)),
            ));
        };
        let took =
            self.restore(rt, id).map_err(|e| fail(format!("restoring the snapshot of the end of frame {frame}"), e))?;
        self.fig.restores.push(took);
        self.fig.rewinds += 1;
        let ops = {
            let mut log = rt.log.lock().unwrap_or_else(|p| p.into_inner());
            log.committed = RangeMap::default();
            for &(lo, hi, prot) in &first.runs {
                log.committed.insert(lo, hi, prot);
            }
            let skip = (from - log.base) as usize;
            log.ops.iter().skip(skip).copied().collect::<Vec<_>>()
        };
        self.compare(rt, &first, "after the restore")?;
        let positions: Vec<(u64, u64)> = self.ring.iter().map(|x| (x.b, x.pos)).collect();
        let mut at = from;
        let mut ops = ops.into_iter();
        for p in points {
            let Some(&(_, until)) = positions.iter().find(|(pb, _)| *pb == p.b) else { continue };
            for (line, op) in ops.by_ref().take((until - at) as usize) {
                redo(rt, op, &mut self.fig)
                    .map_err(|e| (format!("making line {line} again after the rewind to frame {frame}"), e))?;
                track(&mut rt.log.lock().unwrap_or_else(|p| p.into_inner()).committed, op);
            }
            at = until;
            self.compare(rt, &p, "after its frames were made again")?;
        }
        Ok(())
    }

    /// Restores `id`: its time on this thread. Where an import holds pages the restore must
    /// decommit (a pool made since, imported), the imports are released and it restores again (an
    /// emulator drops its GPU's copies of the memory it rewinds); the refused try is not timed.
    fn restore(&mut self, rt: &Rt<'_>, id: SnapshotId) -> Result<Duration, SnapshotError> {
        #[cfg(test)]
        if self.skip_restore {
            return Ok(Duration::ZERO);
        }
        // Background imports and populates land first: nothing maps pages beside the restore.
        rt.importer.settle();
        let t = Instant::now();
        match self.snaps.restore(id) {
            Err(SnapshotError::Held { .. }) => {
                self.fig.import_releases += 1;
                rt.importer.release_all();
                let t = Instant::now();
                self.snaps.restore(id)?;
                Ok(t.elapsed())
            }
            r => r.map(|_| t.elapsed()),
        }
    }

    /// Compares the guest's memory now with `p`'s, counting what differs.
    fn compare(&mut self, rt: &Rt<'_>, p: &Point, when: &'static str) -> Result<(), Failure> {
        rt.importer.settle();
        let (runs, pages) =
            state(rt).map_err(|e| fail(format!("reading the guest's memory again at frame {}", p.frame), e))?;
        self.fig.checks += 1;
        let differ = if runs == p.runs {
            pages.iter().zip(&p.pages).filter(|(a, b)| a != b).count() as u64
        } else {
            pages.len().max(p.pages.len()) as u64
        };
        if differ > 0 {
            self.fig.mismatched_snapshots += 1;
            self.fig.mismatched_bytes += differ * page_size();
            self.fig.first_mismatch.get_or_insert((p.frame, when));
        }
        Ok(())
    }

    /// The figures, the snapshots released.
    pub(super) fn finish(mut self) -> SnapshotFigures {
        let st = self.snaps.stats();
        (self.fig.taken, self.fig.pages_copied, self.fig.bytes_kept_end) = (st.taken, st.pages_copied, st.bytes_kept);
        for k in self.ring.drain(..) {
            let _ = self.snaps.release(k.id);
        }
        self.fig
    }
}

/// Makes `op` again after a rewind. A decommit that an import now holds (the imports are those
/// after the frames, not before them) is made after the imports are released, as a restore's.
fn redo(rt: &Rt<'_>, op: MemOp, fig: &mut SnapshotFigures) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match op {
        MemOp::Commit { lo, hi, prot } => {
            let g = GuestRange::from_bounds(lo, hi)?;
            rt.space.commit(g, prot)?;
            rt.tracker.arm(g)?;
        }
        MemOp::Decommit { lo, hi, zeroed: true } => {
            let g = GuestRange::from_bounds(lo, hi)?;
            rt.tracker.host_write(g, || rt.space.zero(g))??;
        }
        MemOp::Decommit { lo, hi, zeroed: false } => {
            let g = GuestRange::from_bounds(lo, hi)?;
            match rt.space.decommit(g) {
                Err(SpaceError::Held { .. }) => {
                    fig.import_releases += 1;
                    rt.importer.settle();
                    rt.importer.release_all();
                    rt.space.decommit(g)?;
                }
                r => r?,
            }
        }
        MemOp::Write { addr, size, pattern } => super::store_pattern(rt.space, GuestAddr(addr), size, pattern)?,
    }
    Ok(())
}

/// How much guest memory one read of the check copies at a time.
const READ_PIECE: u64 = 1 << 20;
/// A page's hash when the space has it uncommitted.
const NOT_COMMITTED: u64 = u64::MAX;

/// The trace's committed runs now, and a hash of each page of them as the space holds it: its
/// protection, and a CRC-32 of its bytes where it is readable (a full read through the space).
fn state(rt: &Rt<'_>) -> Result<(Runs, Vec<u64>), SpaceError> {
    let runs = rt.log.lock().unwrap_or_else(|p| p.into_inner()).runs();
    let pages = hash_pages(rt.space, &runs)?;
    Ok((runs, pages))
}

/// A hash of each page of `runs` (page-aligned) as `space` holds it.
pub(super) fn hash_pages(space: &Space, runs: &[(u64, u64, Prot)]) -> Result<Vec<u64>, SpaceError> {
    let p = page_size();
    let mut out = Vec::with_capacity(runs.iter().map(|r| ((r.1 - r.0) / p) as usize).sum());
    let mut buf = vec![0u8; READ_PIECE as usize];
    for &(a, b, _) in runs {
        let mut at = a;
        for (run, prot) in space.protections(GuestRange::from_bounds(a, b)?) {
            let (s, e) = (run.start().0, run.end().0);
            out.extend(std::iter::repeat_n(NOT_COMMITTED, ((s - at) / p) as usize));
            let tag = (1u64 << 40)
                | (u64::from(prot.read) << 32)
                | (u64::from(prot.write) << 33)
                | (u64::from(prot.exec) << 34);
            if prot.read {
                let mut x = s;
                while x < e {
                    let n = (e - x).min(READ_PIECE);
                    space.read(GuestAddr(x), &mut buf[..n as usize])?;
                    out.extend(buf[..n as usize].chunks(p as usize).map(|pg| tag | u64::from(crc32fast::hash(pg))));
                    x += n;
                }
            } else {
                out.extend(std::iter::repeat_n(tag, ((e - s) / p) as usize));
            }
            at = e;
        }
        out.extend(std::iter::repeat_n(NOT_COMMITTED, ((b - at) / p) as usize));
    }
    Ok(out)
}
