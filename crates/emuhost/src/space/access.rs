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
