//! What the space made of its window (its record of protections and views), and the region
//! queries that tell its own mappings from foreign ones.

use super::ranges::RangeMap;
use super::{GuestRange, Prot, QueryPath, Region, Space, SpaceError};

/// What the space made of its window, to tell its own mappings from foreign ones. Behind a lock of
/// its own, taken after the state's: a change that takes access away holds it for writing across
/// its system call, so a checked store (which holds it for reading) never faults, and works inside
/// a tracker's `host_write` (which holds the state's lock).
#[derive(Default, Debug)]
pub(super) struct Record {
    /// The protection the space gave each page it did not leave reserved (committed, protected or
    /// a view).
    pub(super) prots: RangeMap<Prot>,
    /// Where the shared views are.
    pub(super) shared: RangeMap<()>,
}

impl Record {
    /// Records that the space gave `a..b` the protection `prot`.
    pub(super) fn set_prot(&mut self, a: u64, b: u64, prot: Prot) {
        self.prots.remove(a, b, |_, _, p| *p);
        self.prots.insert(a, b, prot);
    }

    /// Forgets `a..b`: reserved again.
    pub(super) fn forget(&mut self, a: u64, b: u64) {
        self.prots.remove(a, b, |_, _, p| *p);
        self.shared.remove(a, b, |_, _, _| ());
    }

    /// Why the kernel's region `r` (guest addresses `a..b`) cannot be one the space made, if so.
    pub(super) fn foreign(&self, a: u64, b: u64, r: &Region) -> Option<String> {
        let kernel = Prot { read: r.read, write: r.write, exec: r.exec };
        // A write tracker may take access away (mprotect), never give more than the space did.
        let within = |p: Prot| (!kernel.read || p.read) && (!kernel.write || p.write) && (!kernel.exec || p.exec);
        let found = || {
            let kind = if r.file { "file" } else { "anonymous" };
            format!("a {kernel:?} {} {kind} mapping", if r.shared { "shared" } else { "private" })
        };
        let reserved = !self.prots.gaps(a, b).is_empty();
        if reserved && (r.shared || r.file || kernel != Prot::NONE) {
            return Some(format!("{} where the space reserved the pages", found()));
        }
        if let Some((_, _, p)) = self.prots.overlapping(a, b).find(|(_, _, p)| !within(**p)) {
            return Some(format!("{} where the space gave {p:?}", found()));
        }
        let view = self.shared.gaps(a, b).is_empty();
        let private = self.shared.overlapping(a, b).next().is_none();
        match (r.shared && r.file, view, private) {
            (true, true, _) | (false, _, true) => None,
            (true, _, _) => Some(format!("{} where the space has private pages", found())),
            (false, _, _) => Some(format!("{} where the space mapped a shared view", found())),
        }
    }
}

impl Space {
    /// The kernel's regions over `range` (host addresses, one region query), after checking that
    /// the space made each of them; a foreign one is an error naming it, for `op`.
    pub(super) fn own_regions(
        &self,
        rec: &Record,
        op: &'static str,
        range: GuestRange,
    ) -> Result<Vec<Region>, SpaceError> {
        let base = self.res.base();
        let (ha, hb) = (base + range.start().0 as usize, base + range.end().0 as usize);
        // Another space reserved in a hole of this window: its pages look like this one's own.
        if let Some(&(s, e)) = self.res.later_within(ha, hb).first() {
            let found = format!("another space's reservation (host {s:#x}..{e:#x})");
            return Err(SpaceError::Foreign { op, addr: (s - base) as u64, len: (e - s) as u64, found });
        }
        let regions = self.host_regions(range)?;
        for r in &regions {
            let (a, b) = ((r.start - base) as u64, (r.end - base) as u64);
            if let Some(found) = rec.foreign(a, b, r) {
                return Err(SpaceError::Foreign { op, addr: a, len: b - a, found });
            }
        }
        Ok(regions)
    }

    /// How this space's region queries are answered: `PROCMAP_QUERY`, or the text of
    /// `/proc/self/maps` where the kernel has no such ioctl (or fault injection asked for it).
    pub fn region_queries(&self) -> Result<QueryPath, SpaceError> {
        self.maps.path().map_err(|e| SpaceError::os("query regions", 0, self.window(), e))
    }

    /// What the kernel has mapped over `range` (clipped to it), region by region, as guest
    /// addresses: one region query (per region with `PROCMAP_QUERY`).
    pub fn kernel_regions(&self, range: GuestRange) -> Result<Vec<Region>, SpaceError> {
        let base = self.res.base();
        let regions = self.host_regions(range)?;
        Ok(regions.into_iter().map(|r| Region { start: r.start - base, end: r.end - base, ..r }).collect())
    }

    /// The kernel's regions over `range` (clipped to it), in host addresses: one region query.
    fn host_regions(&self, range: GuestRange) -> Result<Vec<Region>, SpaceError> {
        let (off, len) = self.check(range)?;
        let base = self.res.base();
        self.maps
            .regions(base + off, base + off + len)
            .map_err(|e| SpaceError::os("query regions", range.start().0, range.len(), e))
    }
}

/// Why the kernel's `regions` over host `a..b` (clipped, in address order) are not one
/// reservation (mapped entirely, `PROT_NONE`, private, anonymous), if they are not.
pub(super) fn not_a_reservation(regions: &[Region], a: usize, b: usize) -> Option<String> {
    let mut at = a;
    for r in regions {
        if r.start > at {
            return Some(format!("nothing is mapped at {at:#x}..{:#x}", r.start));
        }
        if r.read || r.write || r.exec || r.shared || r.file {
            let prot = Prot { read: r.read, write: r.write, exec: r.exec };
            let kind = if r.file { "file" } else { "anonymous" };
            let shared = if r.shared { "shared" } else { "private" };
            return Some(format!(
                "{:#x}..{:#x} is a {prot:?} {shared} {kind} mapping, not a PROT_NONE private anonymous reservation",
                r.start, r.end
            ));
        }
        at = at.max(r.end);
    }
    (at < b).then(|| format!("nothing is mapped at {at:#x}..{b:#x}"))
}

/// The first part of `a..b` that `map` has no entry over, if any.
pub(super) fn first_gap<V: Clone>(map: &RangeMap<V>, a: u64, b: u64) -> Option<(u64, u64)> {
    let mut at = a;
    for (s, e, _) in map.overlapping(a, b) {
        if s > at {
            return Some((at, s));
        }
        at = at.max(e);
    }
    (at < b).then_some((at, b))
}

/// Whether `regions` (in address order, clipped to `a..b`) leave no hole in host `a..b`.
pub(super) fn covers(regions: &[Region], a: usize, b: usize) -> bool {
    let mut at = a;
    for r in regions {
        if r.start > at {
            return false;
        }
        at = at.max(r.end);
    }
    at >= b
}
