//! Linux: `mmap`/`mprotect`/`madvise` over one reservation, memfd sections, `PROCMAP_QUERY`
//! region queries, write tracking (userfaultfd + `PAGEMAP_SCAN`, `mprotect` + `SIGSEGV`), and
//! what the machine offers (`uname`, affinity, userfaultfd, `PAGEMAP_SCAN`).

#[cfg(feature = "faults")]
pub mod faults;
pub mod mm;
pub mod pin;
pub mod probe;
pub mod procstat;
pub mod query;
pub mod sched;
pub mod segv;
pub mod uapi;
pub mod uffd;
