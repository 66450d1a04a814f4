//! What the system-call counters count (shared by `counters.rs` and `counters_disabled.rs`).

/// The system calls emuhost counts. Named as Linux's; on Windows each counts the calls of the
/// same role: `VirtualAlloc`/`VirtualAlloc2`/`MapViewOfFile3` as `Mmap`, `VirtualProtect` as
/// `Mprotect`, `VirtualQuery` as `Query`, `GetWriteWatch`/`ResetWriteWatch` as `Ioctl`,
/// `VirtualFree`/`UnmapViewOfFile` as `Munmap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Call {
    /// `mmap` (a reservation, a reset to reserved, a shared view, a filled hole).
    Mmap,
    /// `mprotect` (a commit or a protection change).
    Mprotect,
    /// `madvise` (populate).
    Madvise,
    /// A region query (`PROCMAP_QUERY` on `/proc/self/maps`).
    Query,
    /// `process_vm_readv` / `process_vm_writev` (checked copies into and out of guest memory).
    Copy,
    /// An `ioctl` on a tracker (userfaultfd, `PAGEMAP_SCAN`) other than a registration.
    Ioctl,
    /// `UFFDIO_REGISTER` or `UFFDIO_UNREGISTER`: a tracker's calls that take the process's
    /// memory-map lock for writing.
    Register,
    /// `munmap`.
    Munmap,
}

/// Counts of system calls, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// [`Call::Mmap`] calls.
    pub mmap: u64,
    /// [`Call::Mprotect`] calls.
    pub mprotect: u64,
    /// [`Call::Madvise`] calls.
    pub madvise: u64,
    /// [`Call::Query`] calls.
    pub query: u64,
    /// [`Call::Copy`] calls.
    pub copy: u64,
    /// [`Call::Ioctl`] calls.
    pub ioctl: u64,
    /// [`Call::Register`] calls.
    pub register: u64,
    /// [`Call::Munmap`] calls.
    pub munmap: u64,
}

impl Counts {
    /// All calls together.
    pub fn total(&self) -> u64 {
        self.mmap + self.mprotect + self.madvise + self.query + self.copy + self.ioctl + self.register + self.munmap
    }

    /// The calls made between `earlier` and `self`.
    pub fn since(&self, earlier: &Counts) -> Counts {
        Counts {
            mmap: self.mmap - earlier.mmap,
            mprotect: self.mprotect - earlier.mprotect,
            madvise: self.madvise - earlier.madvise,
            query: self.query - earlier.query,
            copy: self.copy - earlier.copy,
            ioctl: self.ioctl - earlier.ioctl,
            register: self.register - earlier.register,
            munmap: self.munmap - earlier.munmap,
        }
    }
}
