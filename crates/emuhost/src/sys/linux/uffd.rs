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
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use super::uapi::*;
use crate::sys::counters::{Call, count};

/// Opens a userfaultfd that handles user-mode faults only (no privilege needed for that).
pub fn userfaultfd() -> io::Result<OwnedFd> {
    if let Some(errno) = crate::sys::hooks::uffd_errno() {
        return Err(io::Error::from_raw_os_error(errno));
    }
    // SAFETY: the userfaultfd system call takes flags only and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor the kernel just returned to us, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A descriptor that `userfaultfd(2)` returned ([`userfaultfd`]): the only kind the
/// `UFFDIO_*` ioctls are sent to.
#[derive(Debug)]
struct UffdFd(OwnedFd);

impl UffdFd {
    fn open() -> io::Result<Self> {
        userfaultfd().map(Self)
    }

    /// `UFFDIO_API`: enables `features` (none: only asks); returns the features the kernel offers.
    fn api(&self, features: u64) -> io::Result<u64> {
        let mut api = uffdio_api { api: UFFD_API, features, ioctls: 0 };
        // SAFETY: `self.0` is a userfaultfd and `uffdio_api` is UFFDIO_API's struct; it holds no
        // address.
        unsafe { ioctl_rw::<UFFDIO_API, _>(self.0.as_fd(), &mut api) }?;
        Ok(api.features)
    }

    /// `UFFDIO_REGISTER` of `addr..addr + len` in `mode`.
    fn register(&self, addr: usize, len: usize, mode: u64) -> io::Result<()> {
        let mut reg = uffdio_register { range: range(addr, len), mode, ioctls: 0 };
        // SAFETY: a userfaultfd and UFFDIO_REGISTER's struct; the range is not written through.
        unsafe { ioctl_rw::<UFFDIO_REGISTER, _>(self.0.as_fd(), &mut reg) }.map(drop)
    }

    /// `UFFDIO_UNREGISTER` of `addr..addr + len`.
    fn unregister(&self, addr: usize, len: usize) -> io::Result<()> {
        let mut r = range(addr, len);
        // SAFETY: a userfaultfd and UFFDIO_UNREGISTER's struct; the range is not written through.
        unsafe { ioctl_rw::<UFFDIO_UNREGISTER, _>(self.0.as_fd(), &mut r) }.map(drop)
    }

    /// `UFFDIO_WRITEPROTECT` of `addr..addr + len` in `mode` (0 lifts the protection).
    fn writeprotect(&self, addr: usize, len: usize, mode: u64) -> io::Result<()> {
        let mut wp = uffdio_writeprotect { range: range(addr, len), mode };
        // SAFETY: a userfaultfd and UFFDIO_WRITEPROTECT's struct; the range is not written through
        // (in asynchronous mode a write to a protected page resolves in the kernel).
        unsafe { ioctl_rw::<UFFDIO_WRITEPROTECT, _>(self.0.as_fd(), &mut wp) }.map(drop)
    }
}

fn range(addr: usize, len: usize) -> uffdio_range {
    uffdio_range { start: addr as u64, len: len as u64 }
}

/// The features userfaultfd offers here (`UFFDIO_API` with none asked for, on a fresh
/// descriptor: the kernel answers with every feature it has).
pub fn features() -> io::Result<u64> {
    UffdFd::open()?.api(0)
}

/// `/proc/self/pagemap`, open: the only file `PAGEMAP_SCAN` is sent to.
#[derive(Debug)]
pub struct Pagemap(File);

impl Pagemap {
    pub fn open() -> io::Result<Self> {
        File::open("/proc/self/pagemap").map(Self)
    }

    /// `PAGEMAP_SCAN` with `arg`, its output vector `vec` (set here, whatever `arg` had; an
    /// empty one as null, as the kernel expects of no vector); returns how many regions the
    /// kernel wrote to `vec`. `arg.walk_end` says where it stopped.
    pub fn scan(&self, arg: &mut pm_scan_arg, vec: &mut [PageRegion]) -> io::Result<usize> {
        arg.vec = if vec.is_empty() { 0 } else { vec.as_mut_ptr() as u64 };
        arg.vec_len = vec.len() as u64;
        // SAFETY: `self.0` is /proc/self/pagemap and `pm_scan_arg` is PAGEMAP_SCAN's struct; its
        // one output address is `vec` (a `PageRegion` is a `page_region`, `repr(transparent)`),
        // with its length, borrowed mutably for the call. Its flags change at most the
        // write-protect bits of the scanned pages, which no Rust reference relies on.
        let n = unsafe { ioctl_rw::<PAGEMAP_SCAN, _>(self.0.as_fd(), arg) }?;
        Ok((n as usize).min(vec.len()))
    }
}

/// A userfaultfd in asynchronous write-protect mode, and `/proc/self/pagemap` to scan with.
#[derive(Debug)]
pub struct Uffd {
    fd: UffdFd,
    pagemap: Pagemap,
}

impl Uffd {
    /// Opens a userfaultfd for user-mode faults and enables asynchronous write-protect, on
    /// unpopulated pages and on shared memory too where the kernel has those.
    pub fn new() -> io::Result<Self> {
        let available = features()?;
        if available & UFFD_FEATURE_WP_ASYNC == 0 {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "userfaultfd lacks UFFD_FEATURE_WP_ASYNC"));
        }
        let wanted = UFFD_FEATURE_WP_ASYNC
            | (available & UFFD_FEATURE_WP_UNPOPULATED)
            | (available & UFFD_FEATURE_WP_HUGETLBFS_SHMEM);
        let fd = UffdFd::open()?;
        count(Call::Ioctl);
        fd.api(wanted)?;
        Ok(Self { fd, pagemap: Pagemap::open()? })
    }

    /// Registers `addr..addr + len` for write-protect tracking (again, after a remap).
    pub fn register(&self, addr: usize, len: usize) -> io::Result<()> {
        count(Call::Register);
        self.fd.register(addr, len, UFFDIO_REGISTER_MODE_WP)
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
        let mut arg = pm_scan_arg(PM_SCAN_CHECK_WPASYNC, addr as u64, end);
        arg.category_inverted = PAGE_IS_WPALLOWED;
        arg.category_mask = PAGE_IS_WPALLOWED;
        count(Call::Ioctl);
        match self.pagemap.scan(&mut arg, &mut []) {
            Ok(_) if arg.walk_end >= end => Ok(true),
            Ok(_) => Err(io::Error::other("PAGEMAP_SCAN stopped short of the range's end")),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Write-protects (arms) `addr..addr + len`: the next write to each page is recorded.
    pub fn protect(&self, addr: usize, len: usize) -> io::Result<()> {
        count(Call::Ioctl);
        self.fd.writeprotect(addr, len, UFFDIO_WRITEPROTECT_MODE_WP)
    }

    /// Lifts the write protection of `addr..addr + len`: its writes are no longer recorded. The
    /// range stays registered (an arm of it again needs no registration, which takes the
    /// process's memory-map lock for writing); closing the userfaultfd unregisters it.
    pub fn unprotect(&self, addr: usize, len: usize) -> io::Result<()> {
        count(Call::Ioctl);
        self.fd.writeprotect(addr, len, 0)
    }

    /// Unregisters `addr..addr + len` ([`Uffd::unprotect`] it first: emuhost never relies on an
    /// unregistration lifting the write protection).
    pub fn unregister(&self, addr: usize, len: usize) -> io::Result<()> {
        count(Call::Register);
        self.fd.unregister(addr, len)
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
            regions.iter().for_each(|r| sink(r.0.start, r.0.end))
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
        self.scan(start, end, vec, PM_SCAN_CHECK_WPASYNC, |regions| {
            regions.iter().for_each(|r| sink(r.0.start, r.0.end))
        })
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
            let mut arg = pm_scan_arg(flags, at, end as u64);
            arg.category_mask = PAGE_IS_WRITTEN;
            arg.return_mask = PAGE_IS_WRITTEN;
            count(Call::Ioctl);
            let n = self.pagemap.scan(&mut arg, vec)?;
            sink(&vec[..n]);
            if arg.walk_end <= at {
                return Err(io::Error::other("PAGEMAP_SCAN made no progress"));
            }
            at = arg.walk_end;
        }
        Ok(())
    }
}

/// A change the kernel told a [`UffdEvents`] listener of, over host `start..end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UffdEvent {
    /// The pages were dropped (`madvise` `MADV_DONTNEED` or `MADV_REMOVE`): told before the
    /// kernel drops them, by a thread that waits until the event is read.
    Removed { start: usize, end: usize },
    /// The pages were unmapped (`munmap`, or a mapping put over them): told after the unmap, by
    /// a thread that waits until the event is read.
    Unmapped { start: usize, end: usize },
}

/// Bytes of a `struct uffd_msg` (the kernel's reads hand out whole ones).
const MSG: usize = 32;
const _: () = assert!(size_of::<linux_raw_sys::general::uffd_msg>() == MSG);

/// A userfaultfd that only listens: registered in write-protect mode but never write-protecting
/// anything, so no page ever faults to it, with `UFFD_FEATURE_EVENT_REMOVE` (and, if asked,
/// `UFFD_FEATURE_EVENT_UNMAP`). The kernel queues an event for each drop (and unmap) of
/// registered pages, and the thread that made the change waits in the kernel until someone
/// reads it ([`UffdEvents::read`]) or the descriptor is closed: a listener must read without
/// taking any lock such a thread may hold. An eventfd beside it wakes the reader's
/// [`UffdEvents::wait`] to stop.
#[derive(Debug)]
pub struct UffdEvents {
    fd: UffdFd,
    stop: OwnedFd,
}

impl UffdEvents {
    /// Opens the listener, for unmaps too if `unmaps`. `Unsupported` where the kernel cannot
    /// register anonymous memory in write-protect mode (before 5.7) or lacks the events; the
    /// errors of [`userfaultfd`] where none can be opened (before 5.11, whose userfaultfd
    /// refuses `UFFD_USER_MODE_ONLY`; from 5.11 a user-mode-only one is allowed whatever
    /// `vm.unprivileged_userfaultfd` says).
    pub fn new(unmaps: bool) -> io::Result<Self> {
        let available = features()?;
        let mut wanted = UFFD_FEATURE_EVENT_REMOVE | if unmaps { UFFD_FEATURE_EVENT_UNMAP } else { 0 };
        if available & UFFD_FEATURE_PAGEFAULT_FLAG_WP == 0 || available & wanted != wanted {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("userfaultfd offers features {available:#x}, not write-protect and the events {wanted:#x}"),
            ));
        }
        if !registered_mappings_merge() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "this kernel does not merge mappings registered with a userfaultfd once mprotect split them \
                 (each page the mprotect backend unprotects would stay a mapping of its own)",
            ));
        }
        // Shared memory (views) can be registered too where the kernel has it (5.19+).
        wanted |= available & UFFD_FEATURE_WP_HUGETLBFS_SHMEM;
        let fd = UffdFd::open()?;
        count(Call::Ioctl);
        fd.api(wanted)?;
        // SAFETY: eventfd takes an initial count and flags and returns a new descriptor or -1.
        let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if stop < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor the kernel just returned to us, owned by nobody else.
        Ok(Self { fd, stop: unsafe { OwnedFd::from_raw_fd(stop) } })
    }

    /// Registers `addr..addr + len` (write-protect mode, nothing write-protected: no fault ever
    /// comes here, only the events). Takes the process's memory-map lock for writing.
    pub fn register(&self, addr: usize, len: usize) -> io::Result<()> {
        count(Call::Register);
        self.fd.register(addr, len, UFFDIO_REGISTER_MODE_WP)
    }

    /// Unregisters `addr..addr + len`: no event comes from there any more.
    pub fn unregister(&self, addr: usize, len: usize) -> io::Result<()> {
        count(Call::Register);
        self.fd.unregister(addr, len)
    }

    /// Waits until events are queued (`true`; also on a signal, which reads nothing) or
    /// [`UffdEvents::stop`] was called (`false`).
    pub fn wait(&self) -> io::Result<bool> {
        let mut fds = [
            libc::pollfd { fd: self.fd.0.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: `fds` is two pollfds of ours, for the call; both descriptors are open (owned by
        // `self`).
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted { Ok(true) } else { Err(e) };
        }
        Ok(fds[1].revents == 0)
    }

    /// Reads every event queued now into `out`, without waiting (each read also lets the thread
    /// that caused the event go on).
    pub fn read(&self, out: &mut Vec<UffdEvent>) -> io::Result<()> {
        let mut buf = [0u8; 32 * MSG];
        loop {
            // SAFETY: `buf` is ours and has room for `buf.len()` bytes; the descriptor is open and
            // non-blocking (opened `O_NONBLOCK`).
            let n = unsafe { libc::read(self.fd.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(()),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(e),
                };
            }
            let n = n as usize;
            for m in buf[..n - n % MSG].chunks_exact(MSG) {
                let word = |at: usize| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&m[at..at + 8]);
                    u64::from_ne_bytes(w) as usize
                };
                // `struct uffd_msg`: the event in byte 0; `arg.remove` (REMOVE and UNMAP alike)
                // is `start` and `end` from byte 8.
                let (start, end) = (word(8), word(16));
                match m[0] {
                    UFFD_EVENT_REMOVE => out.push(UffdEvent::Removed { start, end }),
                    UFFD_EVENT_UNMAP => out.push(UffdEvent::Unmapped { start, end }),
                    _ => {}
                }
            }
            if n < buf.len() {
                return Ok(());
            }
        }
    }

    /// Makes [`UffdEvents::wait`] return `false`, now and from then on.
    pub fn stop(&self) -> io::Result<()> {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes the 8 bytes of `one` to our eventfd.
        let n = unsafe { libc::write(self.stop.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    }
}

/// Whether this kernel merges a mapping registered with a userfaultfd again once `mprotect` split
/// it and gave the split part its protection back, as it does an unregistered one. The mprotect
/// backend unprotects a page at each first write and protects it again at the next collect: where
/// the pieces stay apart (Debian 12's 6.1 does so; 6.18 merges them), every page ever written
/// would stay a mapping of its own, up to `vm.max_map_count`. Tried once per process, the
/// backend's way, on three pages of a scratch mapping: the answer is `false` where the try fails.
pub fn registered_mappings_merge() -> bool {
    static MERGES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MERGES.get_or_init(|| match try_merging() {
        Ok(merged) => merged,
        Err(e) => {
            tracing::debug!("userfaultfd: whether registered mappings merge again is unknown ({e})");
            false
        }
    })
}

fn try_merging() -> io::Result<bool> {
    use crate::sys::mm::{RawProt, Reservation, page_size};
    let p = page_size();
    let (rw, r) = (RawProt { read: true, write: true, exec: false }, RawProt { read: true, write: false, exec: false });
    let res = Reservation::new(3 * p, 0)?;
    res.protect(0, 3 * p, rw)?;
    let touch = |page: usize| {
        // SAFETY: a page of this function's own scratch mapping, read-write when touched; nothing
        // else refers to it.
        unsafe { std::ptr::write_volatile((res.base() + page * p) as *mut u8, 1) }
    };
    touch(0);
    let fd = UffdFd::open()?;
    fd.api(0)?;
    fd.register(res.base(), 3 * p, UFFDIO_REGISTER_MODE_WP)?;
    // An arm, a first write to the middle page, a collect.
    res.protect(0, 3 * p, r)?;
    res.protect(p, p, rw)?;
    touch(1);
    res.protect(p, p, r)?;
    let regions = crate::sys::query::Maps::open(false)?.regions(res.base(), res.base() + 3 * p)?;
    Ok(regions.len() == 1)
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
