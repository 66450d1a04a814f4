//! Copies into and out of guest memory: writes, reads and stores, and the errors that name the
//! pages a copy was refused.

use super::record::{covers, first_gap};
use super::{GuestAddr, GuestRange, Prot, Space, SpaceError, page_size};

impl Space {
    /// Copies `data` into guest memory at `addr` (any alignment). An error, never a fault, where
    /// a page is not writable or outside the window: [`SpaceError::NotCommitted`] or
    /// [`SpaceError::Protection`] naming the first such pages where the space did not commit them
    /// writable (the bytes before them are written).
    pub fn write(&self, addr: GuestAddr, data: &[u8]) -> Result<(), SpaceError> {
        let len = data.len() as u64;
        self.check_bytes(addr, len)?;
        self.res.write(addr.0 as usize, data).map_err(|e| self.failed("write", addr.0, len, e, |p| p.write))
    }

    /// Stores `data` at `addr` as a guest store would land, without ever faulting: every page
    /// must be the space's own and committed writable (a write tracker may have taken write
    /// access away for now), else an error and nothing is stored. The check is a region query, and
    /// no decommit or protection runs until the store is done (it works inside
    /// [`crate::watch::Tracker::host_write`] too).
    ///
    /// The bytes are copied by the kernel (`process_vm_writev`, as [`Space::write`] does), which
    /// refuses a page without write access instead of faulting. A page an `mprotect` write
    /// tracker armed is made writable and marked written there, as its fault handler does for a
    /// store by the CPU, so the next collect reports it, whatever the thread's signal mask and
    /// whether or not a handler is installed yet; with uffd the kernel records the write itself.
    /// Any other page the kernel refuses (its access was taken away behind the space's back, by
    /// the embedder's own `mprotect`, say) is [`SpaceError::NotWritable`]: the bytes before that
    /// page are stored, none after. Hot paths that know their pages use
    /// [`Space::store_unchecked`] (a store by the CPU).
    pub fn store(&self, addr: GuestAddr, data: &[u8]) -> Result<(), SpaceError> {
        let len = data.len() as u64;
        self.check_bytes(addr, len)?;
        if data.is_empty() {
            return Ok(());
        }
        let page = page_size();
        let (a, b) = (addr.0 / page * page, (addr.0 + len).next_multiple_of(page));
        let pages = GuestRange::from_bounds(a, b)?;
        let rec = self.record();
        let regions = self.own_regions(&rec, "store", pages)?;
        let base = self.res.base();
        let writable = rec.prots.gaps(a, b).is_empty() && rec.prots.overlapping(a, b).all(|(_, _, p)| p.write);
        if !writable || !covers(&regions, base + a as usize, base + b as usize) {
            return Err(SpaceError::NotWritable { addr: addr.0, len });
        }
        // The record's lock, held until this returns, keeps every decommit and protection out. A
        // page the kernel refuses goes to the write trackers' fault handling, which makes it
        // writable only where a tracker armed it and the guest may write it.
        let stored = self.res.write_claiming(addr.0 as usize, data, crate::sys::guard::fault);
        drop(rec);
        stored.map_err(|e| {
            if crate::sys::codes::is_refused(&e) {
                SpaceError::NotWritable { addr: addr.0, len }
            } else {
                SpaceError::os("store", addr.0, len, e)
            }
        })
    }

    /// Stores `data` at `addr` with the CPU, as guest code would (one atomic byte store at a time),
    /// without [`Space::store`]'s check: a page the protection forbids faults (`SIGSEGV`), which
    /// a write tracker handles for its armed pages; any other is fatal, as it would be for the
    /// guest.
    ///
    /// # Safety
    /// Every page of `addr..addr + data.len()` must stay committed writable (or armed by a write
    /// tracker whose backend takes the fault: `mprotect`) for the whole call: no decommit or
    /// protection may take it away meanwhile, on any thread. Otherwise the process dies of the
    /// fault.
    #[allow(unsafe_code)] // guest memory through the CPU: see the SAFETY comment
    pub unsafe fn store_unchecked(&self, addr: GuestAddr, data: &[u8]) -> Result<(), SpaceError> {
        let len = data.len() as u64;
        self.check_bytes(addr, len)?;
        // SAFETY: the caller's contract is the one `Reservation::store` asks for.
        unsafe { self.res.store(addr.0 as usize, data) }.map_err(|e| SpaceError::os("store", addr.0, len, e))
    }

    /// Copies guest memory at `addr` into `buf`. An error, never a fault, where a page is not
    /// readable or outside the window: [`SpaceError::NotCommitted`] or [`SpaceError::Protection`]
    /// naming the first such pages where the space did not commit them readable.
    pub fn read(&self, addr: GuestAddr, buf: &mut [u8]) -> Result<(), SpaceError> {
        let len = buf.len() as u64;
        self.check_bytes(addr, len)?;
        self.res.read(addr.0 as usize, buf).map_err(|e| self.failed("read", addr.0, len, e, |p| p.read))
    }

    /// Copies the guest `runs`, one after the other, into `bufs`, filled in turn (their lengths
    /// add up to the runs'), with the CPU where `cpu` allows emuhost's fault handler (a copy that
    /// survives a refused page), else in as few kernel calls as the OS allows (a snapshot's
    /// take). The errors of [`Space::read`] over the first run that failed, from the byte where
    /// the copy stopped, naming its first pages not committed or not readable (the runs and
    /// bytes before it are copied).
    pub(crate) fn read_runs(&self, runs: &[GuestRange], bufs: &mut [&mut [u8]], cpu: bool) -> Result<(), SpaceError> {
        let offs = self.run_offsets(runs)?;
        self.res.read_runs(&offs, bufs, cpu).map_err(|e| self.runs_failed("read", runs, e, |p| p.read))
    }

    /// Copies `data`, taken in turn, into the guest `runs` one after the other (their lengths
    /// add up), as [`Space::read_runs`] copies (a snapshot's restore). The errors of
    /// [`Space::write`] over the first run that failed, from the byte where the copy
    /// stopped (the runs and bytes before it are written).
    pub(crate) fn write_runs(&self, runs: &[GuestRange], data: &[&[u8]], cpu: bool) -> Result<(), SpaceError> {
        let offs = self.run_offsets(runs)?;
        self.res.write_runs(&offs, data, cpu).map_err(|e| self.runs_failed("write", runs, e, |p| p.write))
    }

    /// The runs as offsets and lengths in the reservation, each checked inside the window.
    fn run_offsets(&self, runs: &[GuestRange]) -> Result<Vec<(usize, usize)>, SpaceError> {
        runs.iter()
            .map(|r| {
                self.check_bytes(r.start(), r.len())?;
                Ok((r.start().0 as usize, r.len() as usize))
            })
            .collect()
    }

    /// The error of a copy of `runs` that stopped as `e` says: [`Space::failed`] over the bytes
    /// of the run that refused from where the copy stopped (those before are copied).
    fn runs_failed(
        &self,
        op: &'static str,
        runs: &[GuestRange],
        e: crate::sys::RunsError,
        allows: fn(Prot) -> bool,
    ) -> SpaceError {
        match runs.get(e.run) {
            Some(r) => {
                let done = (e.done as u64).min(r.len());
                self.failed(op, r.start().0 + done, r.len() - done, e.error, allows)
            }
            None => SpaceError::os(op, 0, 0, e.error),
        }
    }

    /// The first run of pages of `range` the space has not committed (reserved: never committed,
    /// or decommitted), if any. Committed pages of any protection (`---` too) and shared views
    /// count as committed.
    pub fn uncommitted(&self, range: GuestRange) -> Option<GuestRange> {
        let gap = first_gap(&self.record().prots, range.start().0, range.end().0)?;
        Some(GuestRange::from_bounds(gap.0, gap.1).expect("the record is page-aligned"))
    }

    /// The committed pages of `range` (private allocations and shared views alike), as runs
    /// clipped to the range, each with the protection the space gave it (not what a write
    /// tracker may have taken away for now), in address order; reserved pages are left out.
    pub fn protections(&self, range: GuestRange) -> Vec<(GuestRange, Prot)> {
        let (a, b) = (range.start().0, range.end().0);
        let rec = self.record();
        rec.prots
            .overlapping(a, b)
            .map(|(s, e, p)| (GuestRange::from_bounds(s.max(a), e.min(b)).expect("the record is page-aligned"), *p))
            .collect()
    }

    /// The error for `op` over the bytes `addr..addr + len`, which failed with `e`: where the
    /// space's record tells a caller's mistake, the first run of pages that were not committed
    /// ([`SpaceError::NotCommitted`]) or were committed with a protection `allows` refuses
    /// ([`SpaceError::Protection`]), whichever comes first; else the OS failure. Read after the
    /// failure, so the calls that work pay nothing for it.
    pub(super) fn failed(
        &self,
        op: &'static str,
        addr: u64,
        len: u64,
        e: std::io::Error,
        allows: fn(Prot) -> bool,
    ) -> SpaceError {
        let page = page_size();
        let (a, b) = (addr / page * page, addr.saturating_add(len).next_multiple_of(page));
        let rec = self.record();
        let gap = first_gap(&rec.prots, a, b);
        let mut refused: Option<(u64, u64, Prot)> = None;
        for (s, t, p) in rec.prots.overlapping(a, b) {
            let (s, t) = (s.max(a), t.min(b));
            match refused {
                None if !allows(*p) => refused = Some((s, t, *p)),
                None => {}
                Some((lo, hi, q)) if hi == s && q == *p => refused = Some((lo, t, q)),
                Some(_) => break,
            }
        }
        match (gap, refused) {
            (Some((lo, hi)), r) if r.is_none_or(|(s, _, _)| lo < s) => {
                SpaceError::NotCommitted { op, addr, len, lo, hi }
            }
            (_, Some((lo, hi, prot))) => SpaceError::Protection { op, addr, len, lo, hi, prot },
            _ => SpaceError::os(op, addr, len, e),
        }
    }

    fn check_bytes(&self, addr: GuestAddr, len: u64) -> Result<(), SpaceError> {
        match addr.0.checked_add(len) {
            Some(end) if end <= self.window() => Ok(()),
            _ => Err(SpaceError::OutOfWindow { addr: addr.0, len, window: self.window() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pages(space: &Space, a: u64, b: u64) -> GuestRange {
        let p = page_size();
        space.range(a * p, (b - a) * p).unwrap()
    }

    /// More runs than one kernel call takes (on either side), and buffers that split across runs
    /// and pages anywhere: every byte lands where it belongs, both ways, with the CPU and through
    /// the kernel.
    #[test]
    fn runs_are_copied_across_calls_and_any_split_of_the_buffers() {
        let p = page_size();
        let space = Space::with_window(24 << 20).unwrap();
        let n = (24 << 20) / p;
        space.commit(pages(&space, 0, n), Prot::READ_WRITE).unwrap();
        // Every other page, with a run of three pages now and then: well over 2 * 1024 runs.
        let runs: Vec<GuestRange> =
            (0..n / 2 - 2).map(|i| pages(&space, 2 * i, 2 * i + if i % 100 == 7 { 2 } else { 1 })).collect();
        assert!(runs.len() > 2 * 1024 + 2);
        let total: usize = runs.iter().map(|r| r.len() as usize).sum();
        for (round, cpu) in [(0usize, true), (1, false)] {
            let data: Vec<u8> = (0..total).map(|i| (i * 7 + i / 4093 + round) as u8).collect();
            // Written from pieces of 3000 bytes (across pages and runs), read back into pages.
            let pieces: Vec<&[u8]> = data.chunks(3000).collect();
            space.write_runs(&runs, &pieces, cpu).unwrap();
            let mut at = 0;
            for r in &runs {
                let mut got = vec![0; r.len() as usize];
                space.read(r.start(), &mut got).unwrap();
                assert_eq!(got, data[at..at + got.len()], "run at {:#x}, cpu {cpu}", r.start().0);
                at += got.len();
            }
            let mut back = vec![0u8; total];
            let mut bufs: Vec<&mut [u8]> = back.chunks_mut(p as usize + 5).collect();
            space.read_runs(&runs, &mut bufs, cpu).unwrap();
            assert!(back == data, "cpu {cpu}");
            // The pages between the runs were not touched.
            let mut gap = vec![1u8; p as usize];
            space.read(GuestAddr(p), &mut gap).unwrap();
            assert!(gap.iter().all(|&b| b == 0));
        }
    }

    /// A run with a page the copy cannot use: the error names its pages as `Space::read` and
    /// `Space::write` do, every run before it is copied and none after, with the CPU (which
    /// faults there, and goes on) and through the kernel.
    #[test]
    fn a_copy_of_runs_stops_at_the_first_run_that_fails_naming_its_pages() {
        for cpu in [true, false] {
            copy_of_runs_stops_at_the_first_run_that_fails(cpu);
        }
    }

    fn copy_of_runs_stops_at_the_first_run_that_fails(cpu: bool) {
        let p = page_size();
        let space = Space::with_window(1 << 20).unwrap();
        space.commit(pages(&space, 0, 16), Prot::READ_WRITE).unwrap();
        space.decommit(pages(&space, 5, 6)).unwrap();
        space.protect(pages(&space, 9, 10), Prot::READ).unwrap();
        for i in [0, 2, 4, 7] {
            space.write(GuestAddr(i * p), &vec![i as u8 + 1; p as usize]).unwrap();
        }
        let runs = [pages(&space, 0, 1), pages(&space, 2, 3), pages(&space, 4, 6), pages(&space, 7, 8)];
        let mut buf = vec![0xee; 5 * p as usize];
        let err = space.read_runs(&runs, &mut [&mut buf[..]], cpu).unwrap_err();
        match err {
            SpaceError::NotCommitted { op: "read", addr, lo, hi, .. } => {
                assert_eq!((lo, hi), (5 * p, 6 * p));
                assert!((4 * p..=5 * p).contains(&addr), "{addr:#x}");
            }
            e => panic!("{e}"),
        }
        let up = p as usize;
        assert!(buf[..up].iter().all(|&b| b == 1) && buf[up..2 * up].iter().all(|&b| b == 3));
        assert!(buf[2 * up..3 * up].iter().all(|&b| b == 5), "the run's pages before the one that failed");
        assert!(buf[4 * up..].iter().all(|&b| b == 0xee), "nothing after the run that failed");

        // Writes: a page committed read-only is a protection error; the runs before are written.
        let runs = [pages(&space, 0, 1), pages(&space, 9, 10), pages(&space, 7, 8)];
        let data = vec![0x42u8; 3 * up];
        match space.write_runs(&runs, &[&data], cpu).unwrap_err() {
            SpaceError::Protection { op: "write", lo, hi, prot, .. } => {
                assert_eq!((lo, hi, prot), (9 * p, 10 * p, Prot::READ));
            }
            e => panic!("{e}"),
        }
        let mut got = vec![0; up];
        space.read(GuestAddr(0), &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 0x42));
        space.read(GuestAddr(7 * p), &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 8), "nothing after the run that failed");

        // Out of the window, or lengths that do not add up: refused before any copy.
        let outside = [pages(&space, 0, 1), GuestRange::from_bounds(1 << 20, (1 << 20) + p).unwrap()];
        assert!(matches!(
            space.read_runs(&outside, &mut [&mut buf[..2 * up]], cpu),
            Err(SpaceError::OutOfWindow { .. })
        ));
        assert!(space.write_runs(&runs[..1], &[&data[..up - 1]], cpu).is_err());
        space.read(GuestAddr(0), &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 0x42));
    }
}
