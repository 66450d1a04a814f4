//! The kernel's write-tracking calls with nothing of emuhost around them: no extent map, no
//! locks, no conversion into page runs. `emuhost bench watch` measures the uffd backend against
//! this on the same memory, in the same run; the ratio is what emuhost adds to the kernel.

use std::io;

use crate::sys::uapi::PageRegion;
use crate::sys::uffd::{Uffd, no_huge_pages};

/// A userfaultfd in asynchronous write-protect mode and a `PAGEMAP_SCAN` output vector.
#[derive(Debug)]
pub struct BareUffd {
    uffd: Uffd,
    vec: Vec<PageRegion>,
}

impl BareUffd {
    /// Opens one (the kernel must offer `UFFD_FEATURE_WP_ASYNC`); the output vector has as
    /// many entries as the uffd backend's.
    pub fn new() -> io::Result<Self> {
        Ok(Self { uffd: Uffd::new()?, vec: vec![PageRegion::default(); super::backend::SCAN_VEC] })
    }

    /// Registers and write-protects host `addr..addr + len` (`MADV_NOHUGEPAGE`, `UFFDIO_REGISTER`,
    /// `UFFDIO_WRITEPROTECT`: the calls the uffd backend's arm makes). Writes keep working: the
    /// kernel resolves them itself.
    pub fn arm(&self, addr: usize, len: usize) -> io::Result<()> {
        no_huge_pages(addr, len)?;
        self.uffd.register(addr, len)?;
        self.uffd.protect(addr, len)
    }

    /// Bytes written in `addr..addr + len` since the last scan, write-protected again in the same
    /// `PAGEMAP_SCAN` (resumed where the output vector filled).
    pub fn scan(&mut self, addr: usize, len: usize) -> io::Result<u64> {
        let mut bytes = 0;
        self.uffd.scan_written(addr, addr + len, &mut self.vec, |s, e| bytes += e - s)?;
        Ok(bytes)
    }

    /// Lifts the protection and unregisters.
    pub fn disarm(&self, addr: usize, len: usize) -> io::Result<()> {
        self.uffd.unprotect(addr, len)?;
        self.uffd.unregister(addr, len)
    }
}
