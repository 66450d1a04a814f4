//! One anonymous reservation and what is done to pages inside it.
//!
//! The reservation is `mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)`: address
//! space only, no memory and no commit charge (or the caller's own, adopted). A commit is an `mprotect` to a usable protection
//! (with `MAP_NORESERVE` the kernel charges nothing when the mapping becomes writable, and pages
//! are faulted in at first touch). A reset is a `MAP_FIXED` anonymous `PROT_NONE` mapping over the
//! range: it drops the pages (and any shared view there) in one call and leaves the range reserved.
//! A shared view is a `MAP_SHARED | MAP_FIXED` mapping of a memfd over the range.
//!
//! Every method takes offsets into the reservation and checks them against its length, so no call
//! here can touch memory the reservation does not own. The reservation never hands out references
//! into its memory: bytes are copied in and out with `process_vm_writev`/`process_vm_readv`, which
//! fail with `EFAULT` on a page the protection forbids instead of faulting.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::OnceLock;
use std::sync::atomic::Ordering::Relaxed;

use rustix::mm::{Advice, MapFlags, MprotectFlags, ProtFlags};

use crate::sys::RunsError;
use crate::sys::counters::{Call, count};

/// Whether the kernel knows `MADV_POPULATE_WRITE` (5.14+), asked once.
static POPULATE_WRITE: OnceLock<bool> = OnceLock::new();

/// Asks `MADV_POPULATE_WRITE` of one fresh read-write page of our own: `EINVAL` there can only
/// mean that the kernel does not know the advice (over guest pages it also means "not writable").
fn populate_write_known() -> bool {
    *POPULATE_WRITE.get_or_init(|| {
        let len = page_size();
        // SAFETY: a fresh anonymous mapping chosen by the kernel touches no existing memory.
        let Ok(p) = (unsafe {
            rustix::mm::mmap_anonymous(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::PRIVATE)
        }) else {
            return true;
        };
        // SAFETY: the page was just mapped read-write by this function and nothing refers to it.
        let known = unsafe { rustix::mm::madvise(p, len, Advice::LinuxPopulateWrite) } != Err(rustix::io::Errno::INVAL);
        // SAFETY: the page is this function's own and is not used after.
        let _ = unsafe { rustix::mm::munmap(p, len) };
        if !known {
            tracing::info!("MADV_POPULATE_WRITE: not in this kernel (before 5.14); populates touch each page");
        }
        known
    })
}

pub use crate::sys::RawProt;

trait Flags {
    fn prot_flags(self) -> ProtFlags;
    fn mprotect_flags(self) -> MprotectFlags;
}

impl Flags for RawProt {
    fn prot_flags(self) -> ProtFlags {
        let mut f = ProtFlags::empty();
        if self.read {
            f |= ProtFlags::READ;
        }
        if self.write {
            f |= ProtFlags::WRITE;
        }
        if self.exec {
            f |= ProtFlags::EXEC;
        }
        f
    }

    fn mprotect_flags(self) -> MprotectFlags {
        MprotectFlags::from_bits_truncate(self.prot_flags().bits())
    }
}

/// Whether a release or a view over part of a view maps the view's other pages anew: no on Linux,
/// where one `mmap` replaces only the pages it covers.
pub const CUTS_REMAP: bool = false;

/// The system's page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

/// An anonymous `PROT_NONE` reservation: the window `base..base + len`, with `guard` bytes of
/// reserved pages beyond each end where asked (part of the same mapping; no method reaches them).
/// One it made is unmapped on drop, guards too; an adopted one (the caller's) is left mapped.
#[derive(Debug)]
pub struct Reservation {
    base: usize,
    len: usize,
    guard: usize,
    adopted: bool,
    /// Its id in [`crate::sys::live`] (later reservations have larger ones).
    id: u64,
    /// Unmapped already, part by part ([`Reservation::unmap_parts`]): the drop unmaps nothing.
    unmapped: std::sync::atomic::AtomicBool,
}

impl Reservation {
    /// Records a reservation of `base..base + len` with `guard` bytes beyond each end in
    /// [`crate::sys::live`].
    fn registered(base: usize, len: usize, guard: usize, adopted: bool) -> Self {
        let id = crate::sys::live::add(base - guard, base + len + guard);
        Self { base, len, guard, adopted, id, unmapped: std::sync::atomic::AtomicBool::new(false) }
    }

    /// The parts of host `start..end` that reservations made after this one hold (in holes of
    /// this window), in address order.
    pub fn later_within(&self, start: usize, end: usize) -> Vec<(usize, usize)> {
        crate::sys::live::later_within(self.id, start, end)
    }

    /// The whole mapping, guards included: host `(start, end)`.
    pub fn mapping(&self) -> (usize, usize) {
        (self.base - self.guard, self.base + self.len + self.guard)
    }

    /// Unmaps the host ranges `parts` (each inside the mapping, page-aligned), and nothing on
    /// drop: the space found what in its mapping is its own.
    pub fn unmap_parts(&self, parts: &[(usize, usize)]) {
        let (lo, hi) = self.mapping();
        self.unmapped.store(true, Relaxed);
        for &(s, e) in parts {
            if s < lo || e > hi || s >= e {
                continue;
            }
            count(Call::Munmap);
            // SAFETY: the part lies inside this reservation's mapping, and the caller found it the
            // reservation's own (not a mapping foreign code or another reservation put in a
            // hole); the reservation is being dropped, so nothing uses it afterwards.
            let _ = unsafe { rustix::mm::munmap(s as *mut libc::c_void, e - s) };
        }
    }
}

fn einval() -> io::Error {
    io::Error::from_raw_os_error(libc::EINVAL)
}

impl Reservation {
    /// Reserves `len` bytes of address space (no memory, no commit charge) where the kernel
    /// chooses, with `guard` bytes of reserved pages below and above it.
    pub fn new(len: usize, guard: usize) -> io::Result<Self> {
        Self::reserve(None, len, guard)
    }

    /// Reserves `base..base + len` with `guard` bytes of reserved pages below and above it, never
    /// replacing a mapping: `EEXIST` where anything is mapped in the range, guards included.
    pub fn at(base: usize, len: usize, guard: usize) -> io::Result<Self> {
        Self::reserve(Some(base), len, guard)
    }

    /// Reserves a window of `len` bytes with `guard` bytes of reserved pages below and above it,
    /// in one mapping: at `base` (the window's address; the mapping starts `guard` below it) or,
    /// with `None`, where the kernel chooses. At a base `MAP_FIXED_NOREPLACE` (Linux 4.17) never
    /// replaces a mapping.
    fn reserve(base: Option<usize>, len: usize, guard: usize) -> io::Result<Self> {
        let page = page_size();
        if len == 0 || !len.is_multiple_of(page) || !guard.is_multiple_of(page) {
            return Err(einval());
        }
        let total = guard.checked_mul(2).and_then(|g| g.checked_add(len)).ok_or_else(einval)?;
        let (hint, flags) = match base {
            None => (0, MapFlags::PRIVATE | MapFlags::NORESERVE),
            Some(b) => {
                let start = b.checked_sub(guard).filter(|s| *s != 0 && s.is_multiple_of(page)).ok_or_else(einval)?;
                start.checked_add(total).ok_or_else(einval)?;
                (start, MapFlags::PRIVATE | MapFlags::NORESERVE | MapFlags::FIXED_NOREPLACE)
            }
        };
        count(Call::Mmap);
        // SAFETY: without MAP_FIXED the kernel chooses free address space, and MAP_FIXED_NOREPLACE
        // maps only where nothing is mapped: no existing memory is affected either way.
        let p = unsafe { rustix::mm::mmap_anonymous(hint as *mut libc::c_void, total, ProtFlags::empty(), flags) }?;
        if hint != 0 && p as usize != hint {
            // A kernel before 4.17 takes MAP_FIXED_NOREPLACE for a hint and maps elsewhere.
            // SAFETY: the mapping was just made by this function and nothing refers to it.
            let _ = unsafe { rustix::mm::munmap(p, total) };
            return Err(io::Error::from_raw_os_error(libc::EEXIST));
        }
        Ok(Self::registered(p as usize + guard, len, guard, false))
    }

    /// Takes the caller's reservation `base..base + len` as the window (page-aligned, non-empty,
    /// not wrapping; `EINVAL` otherwise). It is not unmapped on drop.
    ///
    /// # Safety
    /// The range must be a reservation the caller made, mapped for as long as the `Reservation`
    /// lives, in which nothing else maps or unmaps meanwhile: the methods map over it
    /// (`MAP_FIXED`) and change its protection as if they owned it.
    pub unsafe fn adopt(base: usize, len: usize) -> io::Result<Self> {
        let page = page_size();
        if base == 0 || len == 0 || !base.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(einval());
        }
        base.checked_add(len).ok_or_else(einval)?;
        Ok(Self::registered(base, len, 0, true))
    }

    /// Whether the window is the caller's ([`Reservation::adopt`]).
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// The bytes of guard pages reserved beyond each end of the window.
    pub fn guard(&self) -> usize {
        self.guard
    }

    /// The host address of offset 0.
    pub fn base(&self) -> usize {
        self.base
    }

    /// The reservation's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The host pointer of `off..off + len`, after checking that the range lies inside the
    /// reservation and is page-aligned.
    fn span(&self, off: usize, len: usize) -> io::Result<*mut libc::c_void> {
        let page = page_size();
        let end = off.checked_add(len).ok_or_else(einval)?;
        if len == 0 || end > self.len || !off.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(einval());
        }
        Ok((self.base + off) as *mut libc::c_void)
    }

    /// Sets the protection of `off..off + len` in one `mprotect`. Over reserved pages this is the
    /// commit; over committed pages it keeps their bytes.
    pub fn protect(&self, off: usize, len: usize, prot: RawProt) -> io::Result<()> {
        let p = self.span(off, len)?;
        count(Call::Mprotect);
        // SAFETY: `span` checked that the range lies inside this reservation, which owns it; no
        // Rust reference into the reservation exists (bytes are only copied in and out).
        unsafe { rustix::mm::mprotect(p, len, prot.mprotect_flags()) }.map_err(Into::into)
    }

    /// Returns `off..off + len` to reserved: fresh anonymous `PROT_NONE` `MAP_NORESERVE` pages
    /// replace whatever was there (private pages or a shared view) in one `mmap`.
    pub fn reset(&self, off: usize, len: usize) -> io::Result<()> {
        let p = self.span(off, len)?;
        count(Call::Mmap);
        // SAFETY: MAP_FIXED replaces only `span`-checked pages inside this reservation, which it
        // owns; no Rust reference into it exists.
        unsafe {
            rustix::mm::mmap_anonymous(
                p,
                len,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
            )
        }?;
        Ok(())
    }

    /// Returns `off..off + len` to reserved in place: `PROT_NONE` (`mprotect`), then its pages
    /// dropped (`MADV_DONTNEED`; private anonymous pages read as zeroes when committed again). The
    /// mappings stay, with what the kernel keeps per mapping (a userfaultfd registration), but
    /// only private anonymous mappings drop their bytes so: the caller checks that the range holds
    /// nothing else. Fails where a mapping cannot drop its pages (`EINVAL`: locked pages); what
    /// was done by then is left, and [`Reservation::reset`] still returns the range to reserved.
    pub fn drop_pages(&self, off: usize, len: usize) -> io::Result<()> {
        self.protect(off, len, RawProt { read: false, write: false, exec: false })?;
        let p = self.span(off, len)?;
        count(Call::Madvise);
        // SAFETY: MADV_DONTNEED drops the pages of the `span`-checked range, which this reservation
        // owns and which are now inaccessible; no Rust reference into the reservation exists.
        unsafe { rustix::mm::madvise(p, len, Advice::LinuxDontNeed) }.map_err(Into::into)
    }

    /// Maps fresh anonymous pages with `prot` where nothing is mapped (a hole left by memory
    /// released behind the reservation's back). `MAP_FIXED_NOREPLACE` (Linux 4.17, the oldest
    /// kernel emuhost runs on) refuses to touch any page that is mapped: `EEXIST` where something
    /// else was mapped there meanwhile.
    pub fn fill_hole(&self, off: usize, len: usize, prot: RawProt) -> io::Result<()> {
        let p = self.span(off, len)?;
        count(Call::Mmap);
        // SAFETY: MAP_FIXED_NOREPLACE maps only where nothing is mapped, inside the `span`-checked
        // range this reservation owns; it never replaces a mapping.
        unsafe {
            rustix::mm::mmap_anonymous(
                p,
                len,
                prot.prot_flags(),
                MapFlags::PRIVATE | MapFlags::FIXED_NOREPLACE | MapFlags::NORESERVE,
            )
        }?;
        Ok(())
    }

    /// Maps `len` bytes of `fd` from `file_off` at `off` as one shared view (`MAP_SHARED |
    /// MAP_FIXED`), replacing what was there.
    pub fn map_shared(
        &self,
        off: usize,
        len: usize,
        section: &Section,
        file_off: u64,
        prot: RawProt,
    ) -> io::Result<()> {
        let p = self.span(off, len)?;
        count(Call::Mmap);
        // SAFETY: MAP_FIXED replaces only `span`-checked pages inside this reservation, which it
        // owns; no Rust reference into it exists.
        unsafe {
            rustix::mm::mmap(p, len, prot.prot_flags(), MapFlags::SHARED | MapFlags::FIXED, section.0.as_fd(), file_off)
        }?;
        Ok(())
    }

    /// Faults every page of `off..off + len` in, writable, ahead of use (`MADV_POPULATE_WRITE`,
    /// Linux 5.14+). `Ok(false)` where the kernel does not know the advice (asked once, of a
    /// page of our own, and kept): the caller touches the pages instead.
    pub fn populate_write(&self, off: usize, len: usize) -> io::Result<bool> {
        let p = self.span(off, len)?;
        if !populate_write_known() {
            return Ok(false);
        }
        count(Call::Madvise);
        // SAFETY: POPULATE_WRITE only faults pages in (as a write of their own bytes would) inside
        // the `span`-checked range; it changes no byte and no mapping.
        unsafe { rustix::mm::madvise(p, len, Advice::LinuxPopulateWrite) }?;
        Ok(true)
    }

    /// Faults every page of `off..off + len` in, writable, by touching one byte of each: an
    /// atomic read, then an atomic compare-and-swap of the same value (a write access that
    /// changes no byte, whatever other threads store meanwhile).
    ///
    /// # Safety
    /// Every page of the range must be mapped writable for the whole call (or the process dies of
    /// `SIGSEGV`), and no Rust reference may point into it.
    pub unsafe fn touch_write(&self, off: usize, len: usize) -> io::Result<()> {
        let p = self.span(off, len)? as usize;
        // SAFETY: the range is `span`-checked inside this reservation; writable and referenced
        // by nothing by the caller's contract.
        unsafe { crate::sys::cpu::touch_write(p, p + len, page_size()) };
        Ok(())
    }

    /// Copies `data` into the reservation at `off` (any alignment). Fails with `EFAULT`, never
    /// faults, where a page is not writable.
    pub fn write(&self, off: usize, data: &[u8]) -> io::Result<()> {
        self.write_claiming(off, data, |_| false)
    }

    /// [`Reservation::write`] that, where a page refuses the write (`EFAULT`), asks `claim` with
    /// the host address it stopped at whether the page can be made writable now (a write
    /// tracker's armed page: what its fault handler does for a store by the CPU), and goes on
    /// from there if so. Fails with `EFAULT` where `claim` says no: the bytes before that page are
    /// written, none after. Never faults.
    pub fn write_claiming(&self, off: usize, data: &[u8], mut claim: impl FnMut(usize) -> bool) -> io::Result<()> {
        let end = off.checked_add(data.len()).ok_or_else(einval)?;
        if end > self.len {
            return Err(einval());
        }
        let mut done = 0;
        loop {
            // SAFETY: `data` is a live slice of its length (only read from); the remote range was
            // checked to lie inside this reservation, which no Rust reference points into.
            let r = unsafe { vm_copy(data.as_ptr() as *mut u8, self.base + off, data.len(), true, &mut done) };
            match r {
                Err(e) if e.raw_os_error() == Some(libc::EFAULT) && claim(self.base + off + done) => continue,
                r => return r,
            }
        }
    }

    /// Stores `data` at `off` with the CPU, as guest code would, one atomic byte store at a time
    /// (other threads may store to the same bytes: atomic stores make that no data race). A page
    /// the protection forbids raises `SIGSEGV`, unlike [`Reservation::write`].
    ///
    /// # Safety
    /// Every page of the bytes must be writable for the whole call, or armed by a write tracker
    /// whose `SIGSEGV` handler makes it writable; otherwise the process dies of the fault. No
    /// Rust reference may point into the bytes.
    pub unsafe fn store(&self, off: usize, data: &[u8]) -> io::Result<()> {
        let end = off.checked_add(data.len()).ok_or_else(einval)?;
        if end > self.len {
            return Err(einval());
        }
        // SAFETY: the bytes lie inside this reservation (checked above); no Rust reference points
        // into them, and they are writable (or their fault handled) by the caller's contract.
        unsafe { crate::sys::cpu::store(self.base + off, data) };
        Ok(())
    }

    /// Copies bytes out of the reservation at `off` into `buf`. Fails with `EFAULT` where a page
    /// is not readable.
    pub fn read(&self, off: usize, buf: &mut [u8]) -> io::Result<()> {
        self.copy(off, buf.as_mut_ptr(), buf.len())
    }

    /// Writes zeros over `off..off + len` in place: the pages stay mapped (and pinned pages stay
    /// the pages the GPU sees), unlike a reset.
    pub fn zero(&self, off: usize, len: usize) -> io::Result<()> {
        self.span(off, len)?;
        static ZEROS: [u8; 1 << 16] = [0; 1 << 16];
        let mut done = 0;
        while done < len {
            // One call writes up to 1024 iovecs of the same zero buffer.
            let n = (len - done).min(ZEROS.len() * 1024);
            let local: Vec<libc::iovec> = (0..n.div_ceil(ZEROS.len()))
                .map(|i| libc::iovec {
                    iov_base: ZEROS.as_ptr() as *mut libc::c_void,
                    iov_len: ZEROS.len().min(n - i * ZEROS.len()),
                })
                .collect();
            // SAFETY: the local iovecs point into a static buffer of at least their length; the
            // remote range lies inside the `span`-checked range, guest memory no Rust reference
            // points into.
            done += unsafe { vm_call(&local, self.base + off + done, n, true) }?;
        }
        Ok(())
    }

    fn copy(&self, off: usize, local: *mut u8, len: usize) -> io::Result<()> {
        let end = off.checked_add(len).ok_or_else(einval)?;
        if end > self.len {
            return Err(einval());
        }
        // SAFETY: `local` points to `len` bytes the caller borrowed mutably; the remote range was
        // checked to lie inside this reservation, and a read changes none of it.
        unsafe { vm_copy(local, self.base + off, len, false, &mut 0) }
    }
}

impl Reservation {
    /// Copies the runs `runs` (`(offset, len)` in the reservation, in any order) one after the
    /// other into `bufs`, filled in turn (their lengths add up to the runs'): with the CPU where
    /// `cpu` lets this install emuhost's `SIGSEGV` handler ([`cpu_runs`]; the caller's embedder
    /// does not own the signal) and the build can, else with as few `process_vm_readv` as
    /// [`IOV_MAX`] iovecs a side allow. Fails, never faults, where a page is not readable: the
    /// error names the run that refused and the bytes of it copied before (every earlier run was
    /// copied whole). `EINVAL` (nothing copied) for a run outside the reservation or lengths that
    /// do not add up.
    pub fn read_runs(&self, runs: &[(usize, usize)], bufs: &mut [&mut [u8]], cpu: bool) -> Result<(), RunsError> {
        RunsError::check(self.len, runs, bufs.iter().map(|b| b.len()), einval)?;
        let pieces: Vec<(usize, usize)> = bufs.iter_mut().map(|b| (b.as_mut_ptr() as usize, b.len())).collect();
        // SAFETY: every piece is a live slice borrowed mutably for the call; the runs were checked
        // to lie inside this reservation, which no Rust reference points into.
        if let Some(done) = cpu.then(|| unsafe { cpu_runs(&pieces, self.base, runs, false) }).flatten() {
            return done;
        }
        let local: Vec<libc::iovec> =
            bufs.iter_mut().map(|b| libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: b.len() }).collect();
        // SAFETY: every local iovec is a live slice borrowed mutably for the call; the runs were
        // checked to lie inside this reservation, and a read changes none of them.
        unsafe { vm_runs(&local, self.base, runs, false) }
    }

    /// [`Reservation::read_runs`] the other way: copies `data`, taken in turn, into the runs one
    /// after the other, with the CPU or as few `process_vm_writev` as possible. Fails with `EFAULT`, never
    /// faults, where a page is not writable: the error names the run and the bytes of it
    /// written before (every earlier run was written whole, no later one touched).
    pub fn write_runs(&self, runs: &[(usize, usize)], data: &[&[u8]], cpu: bool) -> Result<(), RunsError> {
        RunsError::check(self.len, runs, data.iter().map(|b| b.len()), einval)?;
        let pieces: Vec<(usize, usize)> = data.iter().map(|b| (b.as_ptr() as usize, b.len())).collect();
        // SAFETY: every piece is a live slice (only read from); the runs were checked to lie
        // inside this reservation, guest memory no Rust reference points into.
        if let Some(done) = cpu.then(|| unsafe { cpu_runs(&pieces, self.base, runs, true) }).flatten() {
            return done;
        }
        let local: Vec<libc::iovec> =
            data.iter().map(|b| libc::iovec { iov_base: b.as_ptr().cast_mut().cast(), iov_len: b.len() }).collect();
        // SAFETY: every local iovec is a live slice (only read from); the runs were checked to
        // lie inside this reservation, guest memory no Rust reference points into.
        unsafe { vm_runs(&local, self.base, runs, true) }
    }
}

/// Copies between the local `pieces` (`(address, len)`, taken in turn) and the `runs` of the
/// reservation at `base` one after the other, with the CPU ([`super::segv::copy`]): `None` where
/// that copy is not available (the caller copies through the kernel), else the outcome as
/// [`vm_runs`] gives it, `EFAULT` naming the run and the bytes of it copied where a page refused.
/// A piece at a time: a copy of 4 KiB pages runs at memory speed, several times
/// `process_vm_readv`'s (which walks and pins each page).
///
/// # Safety
/// As [`vm_runs`]: the pieces are memory the caller borrowed for the copy's direction, and the
/// runs lie inside the reservation, which no Rust reference points into.
unsafe fn cpu_runs(
    pieces: &[(usize, usize)],
    base: usize,
    runs: &[(usize, usize)],
    write: bool,
) -> Option<Result<(), RunsError>> {
    // SAFETY: an empty copy touches no memory; it says whether the copy is available.
    unsafe { super::segv::copy(std::ptr::null_mut(), std::ptr::null(), 0) }?;
    let lens: Vec<usize> = pieces.iter().map(|p| p.1).collect();
    let efault = || io::Error::from_raw_os_error(libc::EFAULT);
    Some(RunsError::walk(runs, &lens, efault, |run, done, b, at, n| {
        let (local, remote) = (pieces[b].0 + at, base + runs[run].0 + done);
        let (dst, src) = if write { (remote, local) } else { (local, remote) };
        // SAFETY: the caller's contract covers both sides; a refused page ends the copy early.
        unsafe { super::segv::copy(dst as *mut u8, src as *const u8, n) }.unwrap_or(0)
    }))
}

/// The most iovecs one `process_vm_readv`/`process_vm_writev` takes on either side (Linux's
/// `UIO_MAXIOV`).
pub const IOV_MAX: usize = 1024;

/// A cursor over a list of spans (`(start, len)`): the span it is in and the bytes of it passed.
#[derive(Clone, Copy, Default)]
struct Cursor {
    at: usize,
    off: usize,
}

impl Cursor {
    /// Moves past spans it has finished (and empty ones).
    fn settle(&mut self, lens: impl Fn(usize) -> Option<usize>) {
        while lens(self.at).is_some_and(|len| self.off >= len) {
            self.at += 1;
            self.off = 0;
        }
    }

    /// Moves `n` bytes on.
    fn advance(&mut self, mut n: usize, lens: impl Fn(usize) -> Option<usize>) {
        while n > 0 {
            let Some(len) = lens(self.at) else { return };
            let room = len - self.off;
            if n < room {
                self.off += n;
                return;
            }
            n -= room;
            self.at += 1;
            self.off = 0;
        }
    }

    /// Up to [`IOV_MAX`] iovecs from here, of `len`s at `start`s, into `out`, adding up to at
    /// most `limit` bytes: their total.
    fn iovecs(
        &self,
        count: usize,
        span: impl Fn(usize) -> (usize, usize),
        limit: usize,
        out: &mut Vec<libc::iovec>,
    ) -> usize {
        out.clear();
        let mut total = 0;
        for i in self.at..count {
            if out.len() == IOV_MAX || total == limit {
                break;
            }
            let (start, len) = span(i);
            let skip = if i == self.at { self.off } else { 0 };
            let n = (len - skip).min(limit - total);
            if n > 0 {
                out.push(libc::iovec { iov_base: (start + skip) as *mut libc::c_void, iov_len: n });
                total += n;
            }
        }
        total
    }
}

/// Copies between the `local` iovecs, taken in turn, and the `runs` (`(offset, len)` from host
/// address `base`) of this process, one after the other, through the page tables, up to
/// [`IOV_MAX`] iovecs a side per call. The kernel stops a call at the first remote byte it
/// cannot copy and returns the bytes copied: both cursors move on by exactly that, and a call
/// that copies nothing is the failure of the run the remote cursor is in (`EFAULT` where the
/// kernel returned 0).
///
/// # Safety
/// Every local iovec must point to that many bytes valid for the copy's direction, adding up to
/// the runs' length. For a write, the runs must be memory no Rust reference points into (guest
/// memory of a reservation).
unsafe fn vm_runs(local: &[libc::iovec], base: usize, runs: &[(usize, usize)], write: bool) -> Result<(), RunsError> {
    let (mut r, mut l) = (Cursor::default(), Cursor::default());
    let run_len = |i: usize| runs.get(i).map(|&(_, len)| len);
    let local_len = |i: usize| local.get(i).map(|v| v.iov_len);
    let (mut r_iov, mut l_iov) = (Vec::new(), Vec::new());
    let pid = std::process::id() as libc::pid_t;
    loop {
        r.settle(run_len);
        l.settle(local_len);
        if r.at == runs.len() {
            return Ok(());
        }
        let want = r.iovecs(runs.len(), |i| (base + runs[i].0, runs[i].1), usize::MAX, &mut r_iov);
        let got = l.iovecs(local.len(), |i| (local[i].iov_base as usize, local[i].iov_len), want, &mut l_iov);
        let want = r.iovecs(runs.len(), |i| (base + runs[i].0, runs[i].1), got, &mut r_iov);
        let fail = |error| RunsError { run: r.at, done: r.off, error };
        if want == 0 {
            // The local side ran out before the runs: lengths that do not add up.
            return Err(fail(einval()));
        }
        count(Call::Copy);
        let (lp, ln, rp, rn) =
            (l_iov.as_ptr(), l_iov.len() as libc::c_ulong, r_iov.as_ptr(), r_iov.len() as libc::c_ulong);
        // SAFETY: the caller's contract covers both sides (the iovecs are pieces of its spans);
        // the kernel copies through the page tables, not through a Rust reference, and fails on
        // a page the protection forbids instead of faulting.
        let n = unsafe {
            if write {
                libc::process_vm_writev(pid, lp, ln, rp, rn, 0)
            } else {
                libc::process_vm_readv(pid, lp, ln, rp, rn, 0)
            }
        };
        match n {
            n if n < 0 => return Err(fail(io::Error::last_os_error())),
            0 => return Err(fail(io::Error::from_raw_os_error(libc::EFAULT))),
            n => {
                r.advance(n as usize, run_len);
                l.advance(n as usize, local_len);
            }
        }
    }
}

/// Copies `len` bytes between `local` and host address `remote` of this process through the page
/// tables (`process_vm_readv`/`process_vm_writev`): a page the protection forbids or that is not
/// mapped fails with `EFAULT` instead of faulting. Starts at byte `*done` and keeps it at the
/// bytes copied so far, so that after a failure it names where the copy stopped (in the page
/// that refused it) and a call again goes on from there.
///
/// # Safety
/// `local` must point to `len` bytes valid for the copy's direction. For a write, `remote..+len`
/// must be memory no Rust reference points into (guest memory of a reservation).
unsafe fn vm_copy(local: *mut u8, remote: usize, len: usize, write: bool, done: &mut usize) -> io::Result<()> {
    while *done < len {
        let done_now = *done;
        let l = libc::iovec { iov_base: local.wrapping_add(done_now) as *mut libc::c_void, iov_len: len - done_now };
        // SAFETY: the caller's contract covers both ranges.
        *done += unsafe { vm_call(std::slice::from_ref(&l), remote + done_now, len - done_now, write) }?;
    }
    Ok(())
}

/// One `process_vm_writev` (`write`) or `process_vm_readv` between the `local` iovecs and host
/// address `remote..remote + len` of this process; returns the bytes copied, at least one (a
/// call that copies none is `EFAULT`: the first page refused it).
///
/// # Safety
/// Every iovec of `local` must point to that many bytes valid for the copy's direction. For a
/// write, `remote..+len` must be memory no Rust reference points into (guest memory of a
/// reservation).
unsafe fn vm_call(local: &[libc::iovec], remote: usize, len: usize, write: bool) -> io::Result<usize> {
    let r_iov = libc::iovec { iov_base: remote as *mut libc::c_void, iov_len: len };
    let (pid, n) = (std::process::id() as libc::pid_t, local.len() as libc::c_ulong);
    count(Call::Copy);
    // SAFETY: the caller's contract covers both sides; the kernel copies through the page tables
    // (not through a Rust reference) and fails with EFAULT on a page the protection forbids.
    let r = unsafe {
        if write {
            libc::process_vm_writev(pid, local.as_ptr(), n, &r_iov, 1, 0)
        } else {
            libc::process_vm_readv(pid, local.as_ptr(), n, &r_iov, 1, 0)
        }
    };
    match r {
        r if r < 0 => Err(io::Error::last_os_error()),
        0 => Err(io::Error::from_raw_os_error(libc::EFAULT)),
        r => Ok(r as usize),
    }
}

/// Reads bytes at any host address of this process into `buf`: an error (`EFAULT`), never a
/// fault, where a page is not readable or not mapped.
pub fn read_host(remote: usize, buf: &mut [u8]) -> io::Result<()> {
    // SAFETY: `buf` is a live, writable slice of its length, and a read changes no remote memory.
    unsafe { vm_copy(buf.as_mut_ptr(), remote, buf.len(), false, &mut 0) }
}

impl Drop for Reservation {
    /// A reservation it made is unmapped, guards too, but for what reservations made later hold
    /// (in holes foreign code unmapped in it), and but for what the space found not its own
    /// ([`Reservation::unmap_parts`]); an adopted one is the caller's.
    fn drop(&mut self) {
        if !self.adopted && !self.unmapped.load(Relaxed) {
            let (mut at, end) = self.mapping();
            let mut parts = Vec::new();
            for (s, e) in self.later_within(at, end) {
                parts.push((at, s.max(at)));
                at = at.max(e);
            }
            parts.push((at, end));
            parts.retain(|(s, e)| s < e);
            self.unmap_parts(&parts);
        }
        crate::sys::live::remove(self.id);
    }
}

/// A shared section: a memfd, mapped as views by [`Reservation::map_shared`].
#[derive(Debug)]
pub struct Section(OwnedFd);

impl Section {
    /// Creates a zero-filled section of `len` bytes named `name` (a memfd).
    pub fn new(name: &str, len: u64) -> io::Result<Self> {
        let fd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, len)?;
        Ok(Self(fd))
    }
}
