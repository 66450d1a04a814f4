//! What this machine offers the runtime: the OS release, the page size, the logical processors in
//! the affinity mask and which way region queries go; on Linux userfaultfd's features,
//! `PAGEMAP_SCAN`, `PROCMAP_QUERY` and transparent huge pages; on Windows placeholders and write
//! watch. Each later part adds what it chose and why.
//!
//! Also the process's own memory figures ([`process_memory`], [`heap`], [`process_times`], ...),
//! for a caller that watches a long run.

use crate::sys::probe as sys;
#[cfg(target_os = "linux")]
use crate::sys::uapi;

/// One capability: present, or absent with the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Offer<T> {
    /// Present, with what was read (a count, feature bits, a name; `()` where only presence).
    Yes(T),
    /// Absent: why, in words (the OS error of the attempt, most often).
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

/// The machine, as the runtime sees it (what `emuhost probe` prints). The fields differ by
/// platform: userfaultfd, `PAGEMAP_SCAN`, `PROCMAP_QUERY` and transparent huge pages on Linux,
/// placeholders and write watch on Windows.
///
/// ```
/// use emuhost::probe::{Offer, Probe};
///
/// let p = Probe::run();
/// assert_eq!(p.page_size, emuhost::space::page_size());
/// match &p.cpus {
///     Offer::Yes(n) => assert!(*n >= 1),
///     Offer::No(why) => println!("no processor count: {why}"),
/// }
/// #[cfg(target_os = "linux")]
/// println!("userfaultfd async write-protect: {}", p.uffd_wp_async());
/// ```
#[derive(Clone, Debug)]
pub struct Probe {
    /// The kernel's release (Linux), or Windows' version (and Wine's, under Wine).
    pub kernel: String,
    /// The page size in bytes (4096 on x86-64 Linux and Windows).
    pub page_size: u64,
    /// Logical processors in this process's affinity mask.
    pub cpus: Offer<usize>,
    /// userfaultfd's feature bits (`UFFDIO_API`).
    #[cfg(target_os = "linux")]
    pub uffd_features: Offer<u64>,
    /// The `PAGEMAP_SCAN` ioctl (Linux 6.7+): the uffd backend reads and re-arms with it.
    #[cfg(target_os = "linux")]
    pub pagemap_scan: Offer<()>,
    /// The `PROCMAP_QUERY` ioctl (Linux 6.11+): region queries without `/proc/self/maps` text.
    #[cfg(target_os = "linux")]
    pub procmap_query: Offer<()>,
    /// How region queries are answered here: `PROCMAP_QUERY`, or the `/proc/self/maps` text
    /// (Linux); `VirtualQuery` (Windows).
    pub region_queries: Offer<&'static str>,
    /// Transparent huge pages: `always`, `madvise` or `never`.
    #[cfg(target_os = "linux")]
    pub thp: Option<String>,
    /// Placeholders (`VirtualAlloc2` with `MEM_RESERVE_PLACEHOLDER`, Windows 10 1803+): without
    /// them a space has no views.
    #[cfg(windows)]
    pub placeholders: Offer<()>,
    /// `MEM_WRITE_WATCH` with `GetWriteWatch`, reporting exactly a written page.
    #[cfg(windows)]
    pub write_watch: Offer<()>,
}

impl Probe {
    /// Probes this machine: a few system calls and `/proc` reads (Linux) or queries (Windows),
    /// no memory kept. Never fails: what is missing is an [`Offer::No`] with the reason.
    pub fn run() -> Probe {
        Probe {
            kernel: sys::os_release(),
            page_size: crate::space::page_size(),
            cpus: Offer::from(sys::affinity_cpus()),
            #[cfg(target_os = "linux")]
            uffd_features: Offer::from(sys::userfaultfd_features()),
            #[cfg(target_os = "linux")]
            pagemap_scan: Offer::from(sys::pagemap_scan()),
            #[cfg(target_os = "linux")]
            procmap_query: Offer::from(sys::procmap_query()),
            region_queries: Offer::from(
                crate::sys::query::Maps::open(crate::faults::no_procmap_query())
                    .and_then(|m| m.path())
                    .map(|p| p.name()),
            ),
            #[cfg(target_os = "linux")]
            thp: sys::thp_mode(),
            #[cfg(windows)]
            placeholders: Offer::from(crate::sys::mm::placeholders()),
            #[cfg(windows)]
            write_watch: Offer::from(sys::write_watch()),
        }
    }

    /// Whether userfaultfd offers asynchronous write-protect (`UFFD_FEATURE_WP_ASYNC`).
    #[cfg(target_os = "linux")]
    pub fn uffd_wp_async(&self) -> bool {
        matches!(self.uffd_features, Offer::Yes(f) if f & uapi::UFFD_FEATURE_WP_ASYNC != 0)
    }

    /// Whether write-protect works on pages never touched (`UFFD_FEATURE_WP_UNPOPULATED`).
    #[cfg(target_os = "linux")]
    pub fn uffd_wp_unpopulated(&self) -> bool {
        matches!(self.uffd_features, Offer::Yes(f) if f & uapi::UFFD_FEATURE_WP_UNPOPULATED != 0)
    }
}

/// Wine's version (`8.0`) where the process runs under Wine (a Windows build), `None` elsewhere:
/// whoever reports a timing says that it is Wine's, not Windows'.
pub use crate::sys::probe::wine_version;
/// `/proc/self/status` as text (Linux only: other platforms give [`process_memory`]'s values).
#[cfg(target_os = "linux")]
pub use crate::sys::procstat::self_status;
/// A field of that status text in bytes (`VmHWM`, `VmRSS`, ...).
pub use crate::sys::procstat::status_bytes;
/// Gives the C allocator's free memory back to the kernel: for the lab's soak, which tells a
/// leak from memory the allocator keeps. Feature `bench`.
#[cfg(feature = "bench")]
pub use crate::sys::procstat::trim_heap;
/// The process's own figures as typed values, as the OS and the C allocator keep them: for a
/// caller that watches its memory over a long run (the soak of `emuhost-lab`, the peak of a
/// preparation), its CPU time, or its mappings against the OS's limit (`None` on Windows,
/// which has no such limit).
pub use crate::sys::procstat::{
    Heap, MapCount, Memory, Times, heap, map_count as process_map_count, memory as process_memory,
    times as process_times,
};

/// Windows: this process's heap (the segment heap, the NT heap, or Wine's), read from the heap's
/// header at run time; an executable's application manifest, read and taken out (`emuhost bench
/// workers` measures the manifest's heap against a copy of the exe without it).
#[cfg(windows)]
pub use crate::sys::heap::{HeapKind, ProcessHeap, exe_manifest, process_heap, strip_manifest};
