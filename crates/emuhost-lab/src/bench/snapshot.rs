//! The snapshots' bench: [`Snapshots::take`] and a restore of the previous snapshot against a full
//! copy of the committed memory (read into a buffer, written back: what a save and a restore cost
//! without write tracking), per fraction of pages written, both arms in each round.
//!
//! Each round, for each fraction in turn:
//!
//! 1. Every page is written once (not timed), so the full copy's write-back below lands on pages
//!    already written since the tracker's last collect and pays no tracking fault.
//! 2. The full copy (timed): the committed memory read into the buffer, then written back.
//! 3. A base snapshot (not timed): the memory as the buffer holds it.
//! 4. The fraction's pages, drawn at random, written (not timed): eight bytes of each changed.
//! 5. Snapshots (timed): a take, then a restore of the base snapshot.
//! 6. The check: the memory equals the buffer, byte for byte (a page that differs is a mismatch,
//!    counted, never an error), and both snapshots are released.
//!
//! The full copy comes before the snapshots in every round (not alternated) because its buffer is
//! the check's reference: the base snapshot is taken right after it.

use std::sync::Arc;
use std::time::Duration;

use emuhost::rng::Rng;
use emuhost::snapshot::{SnapshotConfig, SnapshotMode, Snapshots};
use emuhost::space::{GuestAddr, Prot, Space, page_size};
use emuhost::watch::{BackendKind, Tracker, TrackerConfig};

use super::{Arm, BenchError, Comparison, check};

/// The shares of pages written, in percent, when none are chosen.
pub const DEFAULT_PERCENTS: [f64; 3] = [0.1, 1.0, 10.0];

/// The goal: take + restore this many times faster than the full copy with 1 % of the
/// pages written (on 4 GiB committed).
pub const TARGET_RATIO: f64 = 50.0;

/// The share of pages written the goal is set at, in percent.
pub const TARGET_PERCENT: f64 = 1.0;

/// What to measure.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SnapshotBench {
    /// Rounds (each measures both arms at every fraction).
    pub rounds: u32,
    /// Memory committed, in MiB.
    pub committed_mib: u64,
    /// The shares of pages written, in percent: each more than 0 and at most 100.
    pub percents: Vec<f64>,
    /// The write tracker's config (its backend: `None` picks as the runtime does).
    pub tracker: TrackerConfig,
    /// The seed of the pages drawn and the bytes written.
    pub seed: u64,
    /// How the snapshots keep the bytes ([`SnapshotMode`]; [`SnapshotBench::mode`]). Their
    /// budget is never applied: it would drop the round's base snapshot.
    pub mode: SnapshotMode,
}

impl SnapshotBench {
    /// The bench with these fields (see each field).
    pub fn new(rounds: u32, committed_mib: u64, percents: Vec<f64>, tracker: TrackerConfig, seed: u64) -> Self {
        SnapshotBench { rounds, committed_mib, percents, tracker, seed, mode: SnapshotMode::default() }
    }

    /// Sets [`SnapshotBench::mode`].
    pub fn mode(mut self, mode: SnapshotMode) -> Self {
        self.mode = mode;
        self
    }

    /// The memory a run needs, in bytes, about: four times the committed memory (the memory, the
    /// full copy's buffer, the base snapshot's copy of every page and the buffer the snapshots
    /// read it through), twice the pages the largest fraction writes (the take after them), and
    /// 64 MiB to spare. Measured: the peak resident memory of a run over 256 or 512 MiB is 4.1 to
    /// 4.2 times the committed memory.
    pub fn memory_needed(&self) -> u64 {
        let committed = self.committed_mib.saturating_mul(1 << 20);
        let most = self.percents.iter().copied().fold(0.0, f64::max).clamp(0.0, 100.0);
        let written = (committed as f64 * most / 100.0).ceil() as u64;
        committed.saturating_mul(4).saturating_add(written.saturating_mul(2)).saturating_add(64 << 20)
    }
}

/// One fraction's rounds.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct FractionReport {
    /// The share of pages written, in percent.
    pub percent: f64,
    /// The pages written each round.
    pub pages_written: u64,
    /// The full copy (read + write back) against take + restore, each round's sum.
    pub comparison: Comparison,
    /// The take alone.
    pub take: Arm,
    /// The restore of the base snapshot alone.
    pub restore: Arm,
    /// The full copy's read into the buffer alone.
    pub full_read: Arm,
    /// The full copy's write-back alone.
    pub full_write: Arm,
    /// The pages each timed take copied (the snapshots' counters).
    pub take_pages: Vec<u64>,
    /// The pages each restore put back.
    pub restore_pages: Vec<u64>,
    /// The rounds whose memory after the restore differed from the snapshot's bytes.
    pub mismatched_rounds: u32,
    /// The first mismatch, in words (the round, the first page that differs, how many differ).
    pub first_mismatch: Option<String>,
}

/// What was measured.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SnapshotReport {
    /// The tracker's backend.
    pub backend: BackendKind,
    /// How the snapshots kept the bytes.
    pub mode: SnapshotMode,
    /// The pages committed.
    pub pages: u64,
    /// Each fraction's rounds, in the order asked.
    pub fractions: Vec<FractionReport>,
}

impl SnapshotReport {
    /// The rounds, over every fraction, whose memory after the restore differed from the
    /// snapshot's bytes.
    pub fn mismatched_rounds(&self) -> u32 {
        self.fractions.iter().map(|f| f.mismatched_rounds).sum()
    }
}

/// The pages of `pages` a share of `percent` % writes: at least one, at most all.
pub fn pages_written(pages: u64, percent: f64) -> u64 {
    ((pages as f64 * percent / 100.0).ceil() as u64).clamp(1, pages.max(1))
}

/// Everything a round works on.
struct Bench {
    space: Arc<Space>,
    snaps: Snapshots,
    /// The tracker's backend.
    backend: BackendKind,
    /// The full copy's buffer: the committed memory's bytes.
    buf: Vec<u8>,
    /// The page numbers, partly shuffled each round to draw the pages written.
    order: Vec<u64>,
    rng: Rng,
}

/// Runs the snapshots bench (see the module's docs).
///
/// # Errors
///
/// [`BenchError::Check`] for no rounds, no fraction, a fraction not in (0, 100], or memory past the
/// address space; the first runtime call that failed (the space, the tracker, a take, a restore,
/// a release). A round whose memory differs from the snapshot after the restore is not an error:
/// it is counted in [`FractionReport::mismatched_rounds`].
pub fn run(a: &SnapshotBench) -> Result<SnapshotReport, BenchError> {
    check!(a.rounds > 0, "no rounds to measure");
    check!(!a.percents.is_empty(), "no share of pages written to measure");
    for &p in &a.percents {
        check!(p > 0.0 && p <= 100.0, "{p} % of pages written: a share must be more than 0 and at most 100");
    }
    let size = a.committed_mib.checked_mul(1 << 20).filter(|s| *s > 0 && usize::try_from(*s).is_ok());
    let Some(size) = size else {
        return Err(BenchError::Check(format!(
            "{} MiB committed: not a size this machine can address",
            a.committed_mib
        )));
    };
    let mut b = Bench::new(a, size)?;
    let pages = size / page_size();
    let mut fractions: Vec<FractionReport> = a.percents.iter().map(|&p| FractionReport::new(p, pages)).collect();
    super::progress::plan(u64::from(a.rounds) * a.percents.len() as u64);
    for r in 0..a.rounds {
        for f in &mut fractions {
            super::progress::tick();
            b.round(r, f)?;
        }
    }
    Ok(SnapshotReport { backend: b.backend, mode: a.mode, pages, fractions })
}

impl FractionReport {
    fn new(percent: f64, pages: u64) -> Self {
        let written = pages_written(pages, percent);
        let name = format!("{percent} % of pages written ({written} of {pages}, at random)");
        let target = (percent == TARGET_PERCENT).then_some(TARGET_RATIO);
        FractionReport {
            percent,
            pages_written: written,
            comparison: Comparison {
                name,
                old_name: "full copy (read + write back)",
                new_name: "take + restore",
                old: Arm::default(),
                new: Arm::default(),
                target_time: target,
                target_calls: None,
            },
            take: Arm::default(),
            restore: Arm::default(),
            full_read: Arm::default(),
            full_write: Arm::default(),
            take_pages: Vec::new(),
            restore_pages: Vec::new(),
            mismatched_rounds: 0,
            first_mismatch: None,
        }
    }
}

/// The last round of `arm`: its time and its system calls (0 where not counted).
fn last(arm: &Arm) -> (Duration, u64) {
    (arm.times.last().copied().unwrap_or_default(), arm.calls.last().copied().unwrap_or(0))
}

/// Adds to `sum` a round whose time and calls are those of the last rounds of `parts`.
fn push_sum(sum: &mut Arm, parts: [&Arm; 2]) {
    let (t0, c0) = last(parts[0]);
    let (t1, c1) = last(parts[1]);
    sum.times.push(t0 + t1);
    if !parts[0].calls.is_empty() && !parts[1].calls.is_empty() {
        sum.calls.push(c0 + c1);
    }
}

impl Bench {
    /// The space with `size` bytes committed and populated, its tracker and the snapshots over
    /// them, and the full copy's buffer (allocated and touched before any round).
    fn new(a: &SnapshotBench, size: u64) -> Result<Bench, BenchError> {
        let space = Arc::new(Space::with_window(size.saturating_mul(2))?);
        let range = space.range(0, size)?;
        space.commit(range, Prot::READ_WRITE)?;
        space.populate(range)?;
        let tracker = Tracker::new(&space, &a.tracker)?;
        let snaps = Snapshots::new(&tracker, range, &SnapshotConfig::default().mode(a.mode))
            .map_err(|e| BenchError::doing(format!("making the snapshots of {range}"), e))?;
        let len = size as usize;
        let mut buf = Vec::new();
        buf.try_reserve_exact(len)
            .map_err(|e| BenchError::doing(format!("allocating the full copy's buffer of {} MiB", size >> 20), e))?;
        buf.resize(len, 0);
        let order = (0..size / page_size()).collect();
        Ok(Bench { space, snaps, backend: tracker.kind(), buf, order, rng: Rng::new(a.seed) })
    }

    /// One round of fraction `f` (see the module's docs).
    #[allow(unsafe_code)] // the full copy and the guest's stores: see the SAFETY comments
    fn round(&mut self, round: u32, f: &mut FractionReport) -> Result<(), BenchError> {
        let p = page_size();
        let pages = self.order.len() as u64;
        let host = self.space.host_addr(GuestAddr(0))?;
        let len = self.buf.len();
        // 1. Every page written since the tracker's last collect: the write-back below pays no
        //    tracking fault, as a copy without tracking would not.
        for pg in 0..pages {
            let v = [self.rng.next_u64() as u8];
            // SAFETY: the range is committed read-write and armed by the snapshots' tracker (a
            // write-protected page faults into its handler); nothing decommits or protects it
            // meanwhile: this thread alone uses the space, and takes and restores run on it.
            unsafe { self.space.store_unchecked(GuestAddr(pg * p), &v) }?;
        }
        // 2. The full copy: the committed memory read into the buffer, then written back.
        let buf = &mut self.buf;
        f.full_read.round(|| {
            // SAFETY: `len` bytes from `host` are the committed range, readable, and stay so for
            // the call (as above); the buffer has `len` bytes and is not guest memory.
            unsafe { std::ptr::copy_nonoverlapping(host as *const u8, buf.as_mut_ptr(), len) };
            Ok::<_, BenchError>(())
        })?;
        f.full_write.round(|| {
            // SAFETY: as above; the pages are writable (each was written since the last collect,
            // and an armed page that is not faults into the tracker's handler).
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), host as *mut u8, len) };
            Ok::<_, BenchError>(())
        })?;
        push_sum(&mut f.comparison.old, [&f.full_read, &f.full_write]);
        // 3. The base snapshot: the memory as the buffer holds it.
        let base = self.snaps.take().map_err(|e| BenchError::doing("taking the base snapshot", e))?;
        // 4. The fraction's pages, drawn at random (a partial shuffle), eight bytes of each
        //    changed (the complement of the buffer's).
        for i in 0..f.pages_written as usize {
            let j = self.rng.range(i as u64, pages) as usize;
            self.order.swap(i, j);
            let at = self.order[i] * p + self.rng.below(p / 8) * 8;
            let mut v = [0u8; 8];
            for (k, b) in v.iter_mut().enumerate() {
                *b = !self.buf[at as usize + k];
            }
            // SAFETY: as in 1.
            unsafe { self.space.store_unchecked(GuestAddr(at), &v) }?;
        }
        // 5. The snapshots: a take, then the base snapshot restored.
        let copied = self.snaps.stats().pages_copied;
        let id = f.take.round(|| self.snaps.take()).map_err(|e| BenchError::doing("taking a snapshot", e))?;
        f.take_pages.push(self.snaps.stats().pages_copied - copied);
        let back = f
            .restore
            .round(|| self.snaps.restore(base))
            .map_err(|e| BenchError::doing(format!("restoring snapshot {base}"), e))?;
        f.restore_pages.push(back.pages);
        push_sum(&mut f.comparison.new, [&f.take, &f.restore]);
        // 6. The check, then both snapshots released.
        if let Some(why) = self.differs()? {
            f.mismatched_rounds += 1;
            f.first_mismatch.get_or_insert(format!("round {}: {why}", round + 1));
        }
        for s in [id, base] {
            self.snaps.release(s).map_err(|e| BenchError::doing(format!("releasing snapshot {s}"), e))?;
        }
        Ok(())
    }

    /// Where the memory differs from the buffer: the first page that differs and how many do;
    /// `None` where every byte is the same.
    fn differs(&self) -> Result<Option<String>, BenchError> {
        let p = page_size() as usize;
        let chunk = (4 << 20) / p * p;
        let mut mem = vec![0u8; chunk.min(self.buf.len())];
        let (mut first, mut pages) = (None, 0u64);
        for (i, want) in self.buf.chunks(chunk).enumerate() {
            let at = (i * chunk) as u64;
            let got = &mut mem[..want.len()];
            self.space.read(GuestAddr(at), got)?;
            for (j, (g, w)) in got.chunks(p).zip(want.chunks(p)).enumerate() {
                if g != w {
                    first.get_or_insert(at + (j * p) as u64);
                    pages += 1;
                }
            }
        }
        Ok(first
            .map(|a| format!("{pages} pages differ from the snapshot's bytes after the restore, the first at {a:#x}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_writes_at_least_one_page_and_at_most_all() {
        assert_eq!(pages_written(1024, 1.0), 11);
        assert_eq!(pages_written(1024, 0.001), 1);
        assert_eq!(pages_written(1024, 100.0), 1024);
        assert_eq!(pages_written(1 << 20, 0.1), 1049);
    }

    #[test]
    fn the_memory_needed_is_four_copies_and_twice_the_largest_share_written() {
        let b = SnapshotBench::new(1, 4096, vec![0.1, 10.0, 1.0], TrackerConfig::default(), 1);
        assert_eq!(b.memory_needed() >> 20, 4 * 4096 + 819 + 64); // 2 x 409.6 MiB written, in whole MiB
        let huge = SnapshotBench::new(1, u64::MAX, vec![100.0], TrackerConfig::default(), 1);
        assert_eq!(huge.memory_needed(), u64::MAX);
    }

    #[test]
    fn bad_shares_and_sizes_are_refused_naming_the_value() {
        let t = TrackerConfig::default();
        for (mib, pct, named) in
            [(4, 0.0, "0 % of pages"), (4, 100.5, "100.5 % of pages"), (1 << 60, 1.0, "1152921504606846976 MiB")]
        {
            let e = run(&SnapshotBench::new(1, mib, vec![pct], t.clone(), 1)).unwrap_err();
            assert!(e.to_string().contains(named), "{e}");
        }
        let e = run(&SnapshotBench::new(0, 4, vec![1.0], t, 1)).unwrap_err();
        assert!(e.to_string().contains("no rounds"), "{e}");
    }
}
