//! Region queries: the kernel's own record of what is mapped where (`PROCMAP_QUERY`, an ioctl on
//! `/proc/self/maps`, Linux 6.11+). The Linux counterpart of Windows' `VirtualQuery`: one call
//! returns the mapping (VMA) that covers an address, or the next one above it.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use super::uapi::*;
use crate::sys::counters::{Call, count};

/// One kernel mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub start: usize,
    pub end: usize,
    pub read: bool,
    pub write: bool,
    pub exec: bool,
    /// `MAP_SHARED` (a view of a section).
    pub shared: bool,
    /// Backed by a file (a memfd section included).
    pub file: bool,
}

/// An open `/proc/self/maps`, to query regions one at a time.
#[derive(Debug)]
pub struct Maps {
    file: File,
}

impl Maps {
    pub fn open() -> io::Result<Self> {
        Ok(Self { file: File::open("/proc/self/maps")? })
    }

    /// The region covering `addr`, or else the first one above it; `None` past the last one.
    pub fn query(&self, addr: usize) -> io::Result<Option<Region>> {
        let mut q = ProcmapQuery {
            size: size_of::<ProcmapQuery>() as u64,
            query_flags: PROCMAP_QUERY_COVERING_OR_NEXT_VMA,
            query_addr: addr as u64,
            ..Default::default()
        };
        count(Call::Query);
        // SAFETY: `q` is a live, properly sized `struct procmap_query` with its `size` field set;
        // name and build-id buffers are null with zero sizes, so the kernel writes only into `q`.
        let r = unsafe { libc::ioctl(self.file.as_raw_fd(), PROCMAP_QUERY as _, &mut q as *mut ProcmapQuery) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return if e.raw_os_error() == Some(libc::ENOENT) { Ok(None) } else { Err(e) };
        }
        Ok(Some(Region {
            start: q.vma_start as usize,
            end: q.vma_end as usize,
            read: q.vma_flags & PROCMAP_QUERY_VMA_READABLE != 0,
            write: q.vma_flags & PROCMAP_QUERY_VMA_WRITABLE != 0,
            exec: q.vma_flags & PROCMAP_QUERY_VMA_EXECUTABLE != 0,
            shared: q.vma_flags & PROCMAP_QUERY_VMA_SHARED != 0,
            file: q.inode != 0,
        }))
    }

    /// Every region that overlaps `start..end`, clipped to it.
    pub fn regions(&self, start: usize, end: usize) -> io::Result<Vec<Region>> {
        let mut out = Vec::new();
        let mut at = start;
        while at < end {
            match self.query(at)? {
                Some(r) if r.start < end => {
                    out.push(Region { start: r.start.max(start), end: r.end.min(end), ..r });
                    at = r.end;
                }
                _ => break,
            }
        }
        Ok(out)
    }
}
