//! What an import costs on the backend at hand, measured once at start-up, and what the pools
//! policy takes from it: how large a range a binding may import itself within its wait target.
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
    pub fixed: Duration,
    pub untouched_per_mib: Duration,
    pub populated_per_mib: Duration,
}

/// The bytes imported to measure the part per MiB (then rounded up to the backend's alignment).
const PROBE: u64 = 2 << 20;

/// The most a part of [`ImportCost`] may be given as, in µs (a minute): an estimate for the
/// whole of a 128 TiB window stays within a `Duration` of nanoseconds in 64 bits.
const MOST_US: u64 = 60_000_000;

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

    /// The cost `EMUHOST_IMPORT_COST_US` gives: three whole numbers of µs, `FIXED,UNTOUCHED,
    /// POPULATED` (an import; a MiB of untouched pages; a MiB of populated ones), as
    /// [`ImportCost::switch_value`] writes them. A bad value is an error naming the switch.
    pub fn from_switch(name: &'static str, value: &str) -> Result<ImportCost, ImportError> {
        let bad = |why| ImportError::BadSwitch { name, value: value.to_string(), why };
        let parts: Vec<&str> = value.split(',').map(str::trim).collect();
        let [fixed, untouched, populated] = parts[..] else {
            return Err(bad("three numbers of µs are needed: FIXED,UNTOUCHED_PER_MIB,POPULATED_PER_MIB"));
        };
        let us = |v: &str| match v.parse::<u64>() {
            Ok(n) if n <= MOST_US => Ok(Duration::from_micros(n)),
            Ok(_) => Err(bad("each part at most 60000000 µs (a minute)")),
            Err(_) => Err(bad("each part an unsigned integer of µs")),
        };
        Ok(ImportCost { fixed: us(fixed)?, untouched_per_mib: us(untouched)?, populated_per_mib: us(populated)? })
    }

    /// This cost as `EMUHOST_IMPORT_COST_US` takes it (whole µs, rounded to the nearest).
    pub fn switch_value(&self) -> String {
        let us = |d: Duration| (d.as_nanos() + 500) / 1000;
        format!("{},{},{}", us(self.fixed), us(self.untouched_per_mib), us(self.populated_per_mib))
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
    fn the_switch_form_round_trips_and_refuses_what_it_cannot_hold() {
        let c = ImportCost::from_switch("S", " 30,370 , 50").unwrap();
        assert_eq!(c.switch_value(), "30,370,50");
        assert_eq!(ImportCost::from_switch("S", &c.switch_value()).unwrap(), c);
        for bad in ["", "1,2", "1,2,3,4", "1,-2,3", "1,2,60000001", "a,b,c"] {
            assert!(ImportCost::from_switch("S", bad).is_err(), "{bad:?}");
        }
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
