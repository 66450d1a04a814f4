//! What an import costs on the backend at hand, measured once at start-up, and what the pools
//! policy takes from it: how large a range a binding may import itself within its wait target,
//! and what it learns from the bindings' own imports ([`Learned`]).
//!
//! On Linux most of an import is the pin: the kernel faults in every page never touched before
//! (about 0.37 ms/MiB on an H200 machine) and then takes a reference on each (about 0.05 ms/MiB
//! for pages already there); the driver adds a fixed part per import. These differ by driver
//! (lavapipe pins nothing), so they are measured rather than assumed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ImportError;
use super::backend::{Backend, HostSpan};
use crate::space::{Prot, Space, page_size};

/// An import's cost: a fixed part, and a part per MiB of untouched or already populated pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ImportCost {
    /// What every import costs, whatever its size.
    pub fixed: Duration,
    /// Per MiB of pages never touched (the kernel faults them in during the import).
    pub untouched_per_mib: Duration,
    /// Per MiB of pages already populated.
    pub populated_per_mib: Duration,
}

/// The bytes imported to measure the part per MiB (then rounded up to the backend's alignment).
const PROBE: u64 = 2 << 20;

impl ImportCost {
    /// The cost of importing `len` bytes none of which were touched before (the worst case: a
    /// binding cannot tell cheaply which pages the guest touched).
    pub fn estimate(&self, len: u64) -> Duration {
        self.at(self.untouched_per_mib, len)
    }

    /// The cost of importing `len` bytes of which `resident` are populated already (the rest
    /// untouched), as a binding that read its pages' residency estimates it.
    pub fn estimate_with(&self, len: u64, resident: u64) -> Duration {
        let resident = resident.min(len);
        self.estimate(len - resident).saturating_add(self.pin(resident).saturating_sub(self.fixed))
    }

    /// The cost of pinning `len` bytes whose pages are all populated (what is left of a
    /// background import once it is in the driver: it populated its pages first).
    pub fn pin(&self, len: u64) -> Duration {
        self.at(self.populated_per_mib, len)
    }

    /// The fixed part and `len` bytes at `per_mib`, saturating (a cost given may be anything).
    fn at(&self, per_mib: Duration, len: u64) -> Duration {
        let per_byte = per_mib.as_nanos() as f64 / (1u64 << 20) as f64;
        self.fixed.saturating_add(Duration::from_nanos((per_byte * len as f64) as u64))
    }

    /// The largest power of two of bytes, at least `align` (a power of two) and at most 1 GiB,
    /// whose import is estimated to take at most `target`.
    pub fn granule(&self, target: Duration, align: u64) -> u64 {
        largest(align, |g| self.estimate(g) <= target)
    }

    /// [`ImportCost::granule`] were every page populated: the most a binding's part could be
    /// within `target` ([`ImportCost::pin`]).
    pub fn pin_granule(&self, target: Duration, align: u64) -> u64 {
        largest(align, |g| self.pin(g) <= target)
    }

    /// Measures `backend`: the fastest of three imports of one aligned unit of populated pages
    /// (the fixed part), and of two imports of `PROBE` bytes untouched and populated, each on
    /// scratch memory of its own (never the guest's). A few milliseconds on a GPU that pins.
    pub fn measure<B: Backend>(backend: &B) -> Result<ImportCost, ImportError> {
        let align = backend.alignment().max(page_size());
        let len = PROBE.next_multiple_of(align);
        let space = Arc::new(Space::with_window(len + align)?);
        let skew = (align - space.host_base() as u64 % align) % align;
        let range = space.range(skew, len)?;
        let time = |len: u64| -> Result<Duration, ImportError> {
            let span = HostSpan::of(&space, skew, len)?;
            let t = Instant::now();
            let import = backend.import(span)?;
            let took = t.elapsed();
            backend.release(import);
            Ok(took)
        };
        let mut untouched = Duration::MAX;
        for _ in 0..2 {
            // Fresh pages each time: a decommit drops them.
            space.decommit(range)?;
            space.commit(range, Prot::READ_WRITE)?;
            untouched = untouched.min(time(len)?);
        }
        space.populate(range)?;
        let mut populated = Duration::MAX;
        for _ in 0..2 {
            populated = populated.min(time(len)?);
        }
        let mut fixed = Duration::MAX;
        for _ in 0..3 {
            fixed = fixed.min(time(align)?);
        }
        let mib = len as f64 / (1u64 << 20) as f64;
        let per_mib = |t: Duration| Duration::from_secs_f64(t.saturating_sub(fixed).as_secs_f64() / mib);
        Ok(ImportCost { fixed, untouched_per_mib: per_mib(untouched), populated_per_mib: per_mib(populated) })
    }
}

/// The largest power of two, at least `align` (a power of two) and at most 1 GiB, that `fits`
/// (`align` where none larger does).
fn largest(align: u64, fits: impl Fn(u64) -> bool) -> u64 {
    let mut g = align;
    while g < 1 << 30 && fits(2 * g) {
        g *= 2;
    }
    g
}

/// The least of a binding's import's untouched (or resident) bytes that [`Learned::learn`]
/// learns a time per MiB from: below it the fixed part's noise outweighs the pages.
const LEAST_SAMPLE: u64 = 32 << 10;

/// What the bindings' own imports taught the pools policy: their recent times per MiB of
/// untouched and of resident pages past the fixed part, in ms.
#[derive(Default)]
pub(super) struct Learned {
    untouched: Recent,
    resident: Recent,
}

impl Learned {
    /// Learns from a binding's import of `len` bytes that took `took`, `resident` of them
    /// populated before it (`None`: not read, all taken as untouched), and raises `cost` (the
    /// cost bindings see) from `start` (the one measured at start) by what it learned; returns
    /// whether it learned. An import whose untouched pages are 32 KiB or more and at least half
    /// of it gives a time per untouched MiB (past the fixed part and the resident pages'
    /// estimate); else one with 32 KiB or more resident gives a time per resident MiB likewise.
    /// Each part of the cost becomes the larger of the start-up one and the 90th percentile of
    /// its last [`Recent::N`] times (the resident one no more than the untouched one): the wait
    /// target bounds the slow imports, not the average one. Under a write tracker, with other
    /// threads faulting and importing, untouched pages cost several times what the start-up
    /// measure saw on scratch memory, and unevenly: on a 2-CPU VM, 0.5 ms/MiB alone and 3–6
    /// ms/MiB behind a background import, a tenth of the time.
    pub(super) fn learn(
        &mut self,
        start: &ImportCost,
        cost: &mut ImportCost,
        took: Duration,
        len: u64,
        resident: Option<u64>,
    ) -> bool {
        let resident = resident.unwrap_or(0).min(len);
        let untouched = len - resident;
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let over = ms(took.saturating_sub(cost.fixed));
        let (u, p) = (ms(cost.untouched_per_mib), ms(cost.populated_per_mib));
        if untouched >= LEAST_SAMPLE && untouched >= resident {
            self.untouched.push((over - p * mib(resident)).max(0.0) / mib(untouched));
        } else if resident >= LEAST_SAMPLE {
            self.resident.push((over - u * mib(untouched)).max(0.0) / mib(resident));
        } else {
            return false;
        }
        let at_least =
            |start: Duration, learned: &Recent| start.max(Duration::from_secs_f64(learned.p90().min(60e3) / 1e3));
        cost.untouched_per_mib = at_least(start.untouched_per_mib, &self.untouched);
        // A resident page costs no more than an untouched one (its fault is done): without this
        // bound, a few resident imports held up on a busy machine (a 64 KiB one for 6 ms)
        // made it 100 ms/MiB on the VM.
        let populated = at_least(start.populated_per_mib, &self.resident).min(cost.untouched_per_mib);
        cost.populated_per_mib = populated.max(start.populated_per_mib);
        true
    }
}

/// The last [`Recent::N`] values of a measure, for their 90th percentile.
#[derive(Default)]
struct Recent {
    v: [f64; Recent::N],
    n: usize,
    next: usize,
}

impl Recent {
    const N: usize = 32;

    fn push(&mut self, x: f64) {
        self.v[self.next] = x;
        self.next = (self.next + 1) % Self::N;
        self.n = (self.n + 1).min(Self::N);
    }

    /// The 90th percentile (nearest rank) of the values kept; 0 where there are none.
    fn p90(&self) -> f64 {
        let mut v = self.v;
        let v = &mut v[..self.n];
        v.sort_unstable_by(f64::total_cmp);
        crate::quantile::quantile(v, 0.9)
    }
}

impl std::fmt::Display for ImportCost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.3} ms an import, {:.3} ms/MiB untouched, {:.3} ms/MiB populated",
            self.fixed.as_secs_f64() * 1e3,
            self.untouched_per_mib.as_secs_f64() * 1e3,
            self.populated_per_mib.as_secs_f64() * 1e3
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_granule_is_the_largest_power_of_two_within_the_target() {
        let c = ImportCost {
            fixed: Duration::from_micros(100),
            untouched_per_mib: Duration::from_micros(400),
            populated_per_mib: Duration::from_micros(50),
        };
        assert_eq!(c.estimate(1 << 20), Duration::from_micros(500));
        // Half of 1 MiB resident: 100 + 400 / 2 + 50 / 2.
        assert_eq!(c.estimate_with(1 << 20, 512 << 10), Duration::from_micros(325));
        assert_eq!(c.estimate_with(1 << 20, 1 << 20), c.pin(1 << 20));
        assert_eq!(c.estimate_with(1 << 20, u64::MAX), c.pin(1 << 20), "more resident than the range: all of it");
        // 100 + 400 * 0.5 = 300 us <= 400; 1 MiB would be 500.
        assert_eq!(c.granule(Duration::from_micros(400), 4096), 512 << 10);
        // Nothing fits: the alignment still.
        assert_eq!(c.granule(Duration::from_micros(50), 4096), 4096);
        // Free imports: capped at 1 GiB.
        assert_eq!(ImportCost::default().granule(Duration::from_micros(1), 4096), 1 << 30);
    }

    /// A cost given may be anything: its estimates saturate rather than overflow (they were a
    /// panic for a given cost of `Duration::MAX`).
    #[test]
    fn estimates_of_a_huge_cost_saturate() {
        let c = ImportCost { fixed: Duration::MAX, untouched_per_mib: Duration::MAX, populated_per_mib: Duration::MAX };
        assert_eq!(
            (c.estimate(u64::MAX), c.pin(1 << 20), c.granule(Duration::from_secs(1), 4096)),
            (Duration::MAX, Duration::MAX, 4096)
        );
        let c = ImportCost { fixed: Duration::ZERO, ..c };
        assert_eq!(c.estimate(0), Duration::ZERO);
    }

    #[test]
    fn the_90th_percentile_of_the_recent_values_is_their_nearest_rank() {
        let mut r = Recent::default();
        assert_eq!(r.p90(), 0.0, "none yet");
        r.push(3.0);
        assert_eq!(r.p90(), 3.0);
        for x in [1.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0] {
            r.push(x);
        }
        // Ten values: the 9th smallest, so one slow value in ten is not yet the estimate.
        assert_eq!(r.p90(), 3.0);
        // Only the last N are kept: N ones push both out.
        for _ in 0..Recent::N {
            r.push(1.0);
        }
        assert_eq!(r.p90(), 1.0);
    }

    #[test]
    fn measuring_the_pin_backend_imports_and_releases_its_scratch_memory() {
        let pin = super::super::Pin::new();
        let c = ImportCost::measure(&pin).unwrap();
        assert!(c.fixed > Duration::ZERO, "{c}");
        let b = pin.budget().get();
        assert_eq!((b.count, b.bytes), (0, 0), "every import of the measure was released");
    }
}
