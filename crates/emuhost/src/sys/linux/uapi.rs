//! Kernel uapi: the structs and flag values come from `linux-raw-sys` (the crate rustix is built
//! on, generated from Linux 6.17's headers, which have what Debian's and the `libc` crate lack:
//! Linux 6.7+ for `PAGEMAP_SCAN`, 6.11+ for `PROCMAP_QUERY`). Its `ioctl` module lists the
//! userfaultfd numbers but not `PAGEMAP_SCAN`'s and `PROCMAP_QUERY`'s, so those two are composed
//! here from their structs with `rustix::ioctl::opcode`, as the kernel's `_IOWR` does. One flag
//! its generator passes over is written here (`UFFDIO_WRITEPROTECT_MODE_WP`).
//!
//! Every ioctl goes through [`ioctl_rw`], an `unsafe fn`: the types that own each kind of
//! descriptor ([`super::uffd::Uffd`], [`super::uffd::Pagemap`], [`super::query::Maps`]) call it,
//! each with the one struct its opcode is defined with.

use std::io;
use std::os::fd::BorrowedFd;

use linux_raw_sys::general as k;
pub use linux_raw_sys::general::{
    page_region, pm_scan_arg, procmap_query, uffdio_api, uffdio_range, uffdio_register, uffdio_writeprotect,
};
use rustix::ioctl::{Ioctl, IoctlOutput, Opcode, opcode};

pub const PROCMAP_QUERY: Opcode = opcode::read_write::<procmap_query>(b'f', 17);
pub const PAGEMAP_SCAN: Opcode = opcode::read_write::<pm_scan_arg>(b'f', 16);
pub const UFFDIO_API: Opcode = linux_raw_sys::ioctl::UFFDIO_API as Opcode;
pub const UFFDIO_REGISTER: Opcode = linux_raw_sys::ioctl::UFFDIO_REGISTER as Opcode;
pub const UFFDIO_UNREGISTER: Opcode = linux_raw_sys::ioctl::UFFDIO_UNREGISTER as Opcode;
pub const UFFDIO_WRITEPROTECT: Opcode = linux_raw_sys::ioctl::UFFDIO_WRITEPROTECT as Opcode;

// The flags, as the `u64` fields they go in.
pub const PROCMAP_QUERY_VMA_READABLE: u64 = k::procmap_query_flags::PROCMAP_QUERY_VMA_READABLE as u64;
pub const PROCMAP_QUERY_VMA_WRITABLE: u64 = k::procmap_query_flags::PROCMAP_QUERY_VMA_WRITABLE as u64;
pub const PROCMAP_QUERY_VMA_EXECUTABLE: u64 = k::procmap_query_flags::PROCMAP_QUERY_VMA_EXECUTABLE as u64;
pub const PROCMAP_QUERY_VMA_SHARED: u64 = k::procmap_query_flags::PROCMAP_QUERY_VMA_SHARED as u64;
pub const PROCMAP_QUERY_COVERING_OR_NEXT_VMA: u64 = k::procmap_query_flags::PROCMAP_QUERY_COVERING_OR_NEXT_VMA as u64;
pub const PM_SCAN_WP_MATCHING: u64 = k::PM_SCAN_WP_MATCHING as u64;
pub const PM_SCAN_CHECK_WPASYNC: u64 = k::PM_SCAN_CHECK_WPASYNC as u64;
pub const PAGE_IS_WPALLOWED: u64 = k::PAGE_IS_WPALLOWED as u64;
pub const PAGE_IS_WRITTEN: u64 = k::PAGE_IS_WRITTEN as u64;
pub const PAGE_IS_PRESENT: u64 = k::PAGE_IS_PRESENT as u64;
pub const UFFD_API: u64 = k::UFFD_API as u64;
pub const UFFD_USER_MODE_ONLY: libc::c_int = k::UFFD_USER_MODE_ONLY as libc::c_int;
pub const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = k::UFFD_FEATURE_WP_HUGETLBFS_SHMEM as u64;
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = k::UFFD_FEATURE_WP_UNPOPULATED as u64;
pub const UFFD_FEATURE_WP_ASYNC: u64 = k::UFFD_FEATURE_WP_ASYNC as u64;
pub const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = k::UFFD_FEATURE_PAGEFAULT_FLAG_WP as u64;
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = k::UFFD_FEATURE_EVENT_REMOVE as u64;
pub const UFFD_FEATURE_EVENT_UNMAP: u64 = k::UFFD_FEATURE_EVENT_UNMAP as u64;
pub const UFFD_EVENT_REMOVE: u8 = k::UFFD_EVENT_REMOVE as u8;
pub const UFFD_EVENT_UNMAP: u8 = k::UFFD_EVENT_UNMAP as u8;
pub const UFFDIO_REGISTER_MODE_WP: u64 = k::UFFDIO_REGISTER_MODE_WP as u64;
/// `((__u64)1 << 0)` in linux/userfaultfd.h: a define with a cast, which `linux-raw-sys`'s
/// bindgen passes over, so written here.
pub const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;

/// `struct page_region`, the output of `PAGEMAP_SCAN`: a newtype only so that the buffers the
/// trackers allocate start zeroed through `Default` (`linux-raw-sys` derives no `Default`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub struct PageRegion(pub page_region);

impl Default for PageRegion {
    fn default() -> Self {
        Self(page_region { start: 0, end: 0, categories: 0 })
    }
}

/// A `struct pm_scan_arg` over `start..end` with `flags` and nothing else set (no categories, no
/// output vector).
pub fn pm_scan_arg(flags: u64, start: u64, end: u64) -> pm_scan_arg {
    pm_scan_arg {
        size: size_of::<pm_scan_arg>() as u64,
        flags,
        start,
        end,
        walk_end: 0,
        vec: 0,
        vec_len: 0,
        max_pages: 0,
        category_inverted: 0,
        category_mask: 0,
        category_anyof_mask: 0,
        return_mask: 0,
    }
}

/// An ioctl that reads and writes one `T` and answers with a count (rustix's `Updater` drops
/// the count, which `PAGEMAP_SCAN` returns).
struct ReadWrite<'a, const OPCODE: Opcode, T>(&'a mut T);

// SAFETY: the pointer is the `&mut T` the caller of `ioctl_rw` vouches for (its `# Safety`), live
// for the call; the output is the call's return value only.
unsafe impl<const OPCODE: Opcode, T> Ioctl for ReadWrite<'_, OPCODE, T> {
    type Output = IoctlOutput;
    const IS_MUTATING: bool = true;

    fn opcode(&self) -> Opcode {
        OPCODE
    }

    fn as_ptr(&mut self) -> *mut libc::c_void {
        (self.0 as *mut T).cast()
    }

    unsafe fn output_from_ptr(out: IoctlOutput, _: *mut libc::c_void) -> rustix::io::Result<IoctlOutput> {
        Ok(out)
    }
}

/// The ioctl `OPCODE` on `fd` with `arg`, which the kernel reads and writes back; returns the
/// kernel's non-negative answer.
///
/// # Safety
/// `fd` is a descriptor on which `OPCODE` is the ioctl defined with a `T` (a userfaultfd for
/// `UFFDIO_*`, `/proc/self/pagemap` for `PAGEMAP_SCAN`, `/proc/self/maps` for `PROCMAP_QUERY`:
/// another driver may give the same number another meaning), and every address inside `arg` that
/// the kernel writes through (`pm_scan_arg::vec`, `procmap_query`'s name and build-id buffers) is
/// null with a zero length or points at that much memory of ours that nothing else reads or
/// writes during the call.
pub unsafe fn ioctl_rw<const OPCODE: Opcode, T>(fd: BorrowedFd<'_>, arg: &mut T) -> io::Result<IoctlOutput> {
    // SAFETY: the opcode, the struct and the descriptor agree, and the memory the kernel writes is
    // `arg` and what it names, all as the caller vouches for (above).
    unsafe { rustix::ioctl::ioctl(fd, ReadWrite::<OPCODE, T>(arg)) }.map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel() {
        // The values the kernel's headers give (seen in strace and in other projects' copies);
        // .ci/noprocmap.c filters on PROCMAP_QUERY's.
        assert_eq!(PROCMAP_QUERY, 0xC068_6611);
        assert_eq!(PAGEMAP_SCAN, 0xC060_6610);
        assert_eq!(UFFDIO_API, 0xC018_AA3F);
        assert_eq!(UFFDIO_REGISTER, 0xC020_AA00);
        assert_eq!(UFFDIO_UNREGISTER, 0x8010_AA01);
        assert_eq!(UFFDIO_WRITEPROTECT, 0xC018_AA06);
    }
}
