//! What this machine offers the runtime: the kernel, the page size, userfaultfd's features,
//! `PAGEMAP_SCAN`, `PROCMAP_QUERY` (and which way region queries go), transparent huge pages and the logical processors in the
//! affinity mask. Each later part adds what it chose and why.

use crate::sys::{probe as sys, uapi};

/// One capability: present, or absent with the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Offer<T> {
    Yes(T),
    No(String),
}

impl<T> Offer<T> {
    fn from(r: std::io::Result<T>) -> Self {
        match r {
            Ok(v) => Offer::Yes(v),
            Err(e) => Offer::No(e.to_string()),
        }
    }
}

/// The machine, as the runtime sees it.
#[derive(Clone, Debug)]
pub struct Probe {
    pub kernel: String,
    pub page_size: u64,
    /// Logical processors in this process's affinity mask.
    pub cpus: Offer<usize>,
    /// userfaultfd's feature bits (`UFFDIO_API`).
    pub uffd_features: Offer<u64>,
    pub pagemap_scan: Offer<()>,
    pub procmap_query: Offer<()>,
    /// How region queries are answered here: `PROCMAP_QUERY`, or the `/proc/self/maps` text.
    pub region_queries: Offer<&'static str>,
    /// Transparent huge pages: `always`, `madvise` or `never`.
    pub thp: Option<String>,
}

impl Probe {
    pub fn run() -> Probe {
        Probe {
            kernel: sys::kernel_release(),
            page_size: crate::space::page_size(),
            cpus: Offer::from(sys::affinity_cpus()),
            uffd_features: Offer::from(sys::userfaultfd_features()),
            pagemap_scan: Offer::from(sys::pagemap_scan()),
            procmap_query: Offer::from(sys::procmap_query()),
            region_queries: Offer::from(
                crate::sys::query::Maps::open(crate::faults::no_procmap_query())
                    .and_then(|m| m.path())
                    .map(|p| p.name()),
            ),
            thp: sys::thp_mode(),
        }
    }

    /// Whether userfaultfd offers asynchronous write-protect (`UFFD_FEATURE_WP_ASYNC`).
    pub fn uffd_wp_async(&self) -> bool {
        matches!(self.uffd_features, Offer::Yes(f) if f & uapi::UFFD_FEATURE_WP_ASYNC != 0)
    }

    /// Whether write-protect works on pages never touched (`UFFD_FEATURE_WP_UNPOPULATED`).
    pub fn uffd_wp_unpopulated(&self) -> bool {
        matches!(self.uffd_features, Offer::Yes(f) if f & uapi::UFFD_FEATURE_WP_UNPOPULATED != 0)
    }
}

/// A field of that status text in bytes (`VmHWM`, `VmRSS`, ...).
pub use crate::sys::procstat::status_bytes;
/// Gives the C allocator's free memory back to the kernel: for the lab's soak, which tells a
/// leak from memory the allocator keeps. Feature `bench`.
#[cfg(feature = "bench")]
pub use crate::sys::procstat::trim_heap;
/// The process's own memory figures, as the kernel and the C allocator keep them: for a caller
/// that watches its memory over a long run (the soak of `emuhost-lab`, the peak of a preparation).
pub use crate::sys::procstat::{Heap, heap, self_status};
