//! userfaultfd write-protect in asynchronous mode, read back with `PAGEMAP_SCAN`.
//!
//! Registered with `UFFDIO_REGISTER_MODE_WP` and armed with `UFFDIO_WRITEPROTECT`, a page's first
//! write after arming clears its write-protect bit in the kernel, without a signal and without
//! waking anyone (`UFFD_FEATURE_WP_ASYNC`); `UFFD_FEATURE_WP_UNPOPULATED` arms pages that were
//! never touched too. `PAGEMAP_SCAN` with `PM_SCAN_WP_MATCHING` then returns the written pages
//! and write-protects them again in the same call; `PM_SCAN_CHECK_WPASYNC` makes it fail
//! (`EPERM`) over memory not registered this way, which is how memory mapped anew behind the
//! tracker's back shows up. When the output vector fills, the kernel stops at `walk_end`, and the
//! scan resumes from there: a short scan must never drop pages.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use super::uapi::*;
use crate::sys::counters::{Call, count};

/// `struct uffdio_range`.
#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

/// `struct uffdio_register`.
#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

/// `struct uffdio_writeprotect`.
#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

const UFFDIO_REGISTER: libc::c_ulong = iowr(0xAA, 0x00, size_of::<UffdioRegister>());
const UFFDIO_WRITEPROTECT: libc::c_ulong = iowr(0xAA, 0x06, size_of::<UffdioWriteprotect>());
const UFFDIO_UNREGISTER: libc::c_ulong =
    (2 << 30) | ((size_of::<UffdioRange>() as libc::c_ulong) << 16) | (0xAA << 8) | 0x01;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;

/// A userfaultfd in asynchronous write-protect mode, and `/proc/self/pagemap` to scan with.
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
    pagemap: File,
}

fn ioctl<T>(fd: i32, req: libc::c_ulong, arg: &mut T) -> io::Result<libc::c_int> {
    count(if req == UFFDIO_REGISTER || req == UFFDIO_UNREGISTER { Call::Register } else { Call::Ioctl });
    // SAFETY: every caller passes the `struct` that `req` is defined with (see the constants
    // above and in uapi.rs), live and writable for the duration of the call.
    let r = unsafe { libc::ioctl(fd, req as _, arg as *mut T) };
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r) }
}

impl Uffd {
    /// Opens a userfaultfd for user-mode faults and enables asynchronous write-protect, on
    /// unpopulated pages and on shared memory too where the kernel has those.
    pub fn new() -> io::Result<Self> {
        let available = super::probe::userfaultfd_features()?;
        if available & UFFD_FEATURE_WP_ASYNC == 0 {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "userfaultfd lacks UFFD_FEATURE_WP_ASYNC"));
        }
        let wanted = UFFD_FEATURE_WP_ASYNC
            | (available & UFFD_FEATURE_WP_UNPOPULATED)
            | (available & UFFD_FEATURE_WP_HUGETLBFS_SHMEM);
        let fd = super::probe::userfaultfd()?;
        let mut api = UffdioApi { api: UFFD_API, features: wanted, ioctls: 0 };
        ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api)?;
        Ok(Self { fd, pagemap: File::open("/proc/self/pagemap")? })
    }

    /// Registers `addr..addr + len` for write-protect tracking (again, after a remap).
    pub fn register(&self, addr: usize, len: usize) -> io::Result<()> {
        let mut reg = UffdioRegister {
            range: UffdioRange { start: addr as u64, len: len as u64 },
            mode: UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER, &mut reg).map(|_| ())
    }

    /// Whether every mapping over `addr..addr + len` is registered for asynchronous write-protect
    /// (by this userfaultfd or by another in that mode: the kernel's check does not tell them
    /// apart, and the scans that read the pages do not need to), asked without taking the
    /// process's memory-map lock for writing, as a registration would. One
    /// `PAGEMAP_SCAN` that fails (`EPERM`) at the first mapping not so registered and skips every
    /// other whole (`PAGE_IS_WPALLOWED` inverted is a category no registered mapping has), so it
    /// walks the mappings, not their pages. Pages with nothing mapped are not asked about.
    pub fn registered(&self, addr: usize, len: usize) -> io::Result<bool> {
        let end = (addr + len) as u64;
        let mut arg = PmScanArg {
            size: size_of::<PmScanArg>() as u64,
            flags: PM_SCAN_CHECK_WPASYNC,
            start: addr as u64,
            end,
            category_inverted: PAGE_IS_WPALLOWED,
            category_mask: PAGE_IS_WPALLOWED,
            ..Default::default()
        };
        match ioctl(self.pagemap.as_raw_fd(), PAGEMAP_SCAN, &mut arg) {
            Ok(_) if arg.walk_end >= end => Ok(true),
            Ok(_) => Err(io::Error::other("PAGEMAP_SCAN stopped short of the range's end")),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Write-protects (arms) `addr..addr + len`: the next write to each page is recorded.
    pub fn protect(&self, addr: usize, len: usize) -> io::Result<()> {
        let mut wp = UffdioWriteprotect {
            range: UffdioRange { start: addr as u64, len: len as u64 },
            mode: UFFDIO_WRITEPROTECT_MODE_WP,
        };
        ioctl(self.fd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp).map(|_| ())
    }

    /// Lifts the write protection of `addr..addr + len`: its writes are no longer recorded. The
    /// range stays registered (an arm of it again needs no registration, which takes the
    /// process's memory-map lock for writing); closing the userfaultfd unregisters it.
    pub fn unprotect(&self, addr: usize, len: usize) -> io::Result<()> {
        let mut wp = UffdioWriteprotect { range: UffdioRange { start: addr as u64, len: len as u64 }, mode: 0 };
        ioctl(self.fd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp).map(|_| ())
    }

    /// Unregisters `addr..addr + len` ([`Uffd::unprotect`] it first: emuhost never relies on an
    /// unregistration lifting the write protection).
    pub fn unregister(&self, addr: usize, len: usize) -> io::Result<()> {
        let mut r = UffdioRange { start: addr as u64, len: len as u64 };
        ioctl(self.fd.as_raw_fd(), UFFDIO_UNREGISTER, &mut r).map(|_| ())
    }

    /// Gives `sink` the runs of pages written in `start..end` since they were armed, as host
    /// `(start, end)` pairs in address order, and arms them again, in one `PAGEMAP_SCAN` (more
    /// only when `vec` fills: the scan resumes at `walk_end`).
    pub fn scan_written(
        &self,
        start: usize,
        end: usize,
        vec: &mut [PageRegion],
        mut sink: impl FnMut(u64, u64),
    ) -> io::Result<()> {
        self.scan(start, end, vec, PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC, |regions| {
            regions.iter().for_each(|r| sink(r.start, r.end))
        })
    }

    /// [`Uffd::scan_written`] without protecting anything: the written pages stay written (and
    /// are reported again by the next scan).
    pub fn peek_written(
        &self,
        start: usize,
        end: usize,
        vec: &mut [PageRegion],
        mut sink: impl FnMut(u64, u64),
    ) -> io::Result<()> {
        self.scan(start, end, vec, PM_SCAN_CHECK_WPASYNC, |regions| regions.iter().for_each(|r| sink(r.start, r.end)))
    }

    /// `PAGEMAP_SCAN` of `start..end` with `flags`, giving each batch of written regions to `sink`.
    fn scan(
        &self,
        start: usize,
        end: usize,
        vec: &mut [PageRegion],
        flags: u64,
        mut sink: impl FnMut(&[PageRegion]),
    ) -> io::Result<()> {
        let mut at = start as u64;
        while at < end as u64 {
            let mut arg = PmScanArg {
                size: size_of::<PmScanArg>() as u64,
                flags,
                start: at,
                end: end as u64,
                vec: vec.as_mut_ptr() as u64,
                vec_len: vec.len() as u64,
                category_mask: PAGE_IS_WRITTEN,
                return_mask: PAGE_IS_WRITTEN,
                ..Default::default()
            };
            let n = ioctl(self.pagemap.as_raw_fd(), PAGEMAP_SCAN, &mut arg)? as usize;
            sink(&vec[..n.min(vec.len())]);
            if arg.walk_end <= at {
                return Err(io::Error::other("PAGEMAP_SCAN made no progress"));
            }
            at = arg.walk_end;
        }
        Ok(())
    }
}

/// Asks the kernel not to back `addr..addr + len` with transparent huge pages, so that write
/// tracking stays per 4 KiB page (a written huge page would be reported whole).
pub fn no_huge_pages(addr: usize, len: usize) -> io::Result<()> {
    count(Call::Madvise);
    // SAFETY: MADV_NOHUGEPAGE changes only a flag of the mappings over the range (which the caller's
    // reservation owns); no byte and no mapping changes.
    unsafe { rustix::mm::madvise(addr as *mut libc::c_void, len, rustix::mm::Advice::LinuxNoHugepage) }
        .map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::mm::{RawProt, Reservation, page_size};

    /// `registered` answers for the whole range: a part not registered, at either end or between
    /// registered ones, makes it `false`.
    #[test]
    fn registered_is_true_only_where_every_mapping_is() {
        let Ok(uffd) = Uffd::new() else { return }; // a kernel without asynchronous write-protect
        let p = page_size();
        let res = Reservation::new(16 * p, 0).unwrap();
        res.protect(0, 16 * p, RawProt { read: true, write: true, exec: false }).unwrap();
        let at = |page: usize| res.base() + page * p;
        assert!(!uffd.registered(at(0), 16 * p).unwrap());
        uffd.register(at(4), 8 * p).unwrap();
        assert!(uffd.registered(at(4), 8 * p).unwrap());
        assert!(uffd.registered(at(6), 2 * p).unwrap());
        assert!(!uffd.registered(at(3), 2 * p).unwrap(), "an unregistered page before");
        assert!(!uffd.registered(at(11), 2 * p).unwrap(), "an unregistered page after");
        uffd.unprotect(at(7), p).unwrap();
        uffd.unregister(at(7), p).unwrap();
        assert!(!uffd.registered(at(4), 8 * p).unwrap(), "an unregistered page between");
        assert!(uffd.registered(at(8), 4 * p).unwrap());
    }
}
