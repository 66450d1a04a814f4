//! Linux: `mmap`/`mprotect`/`madvise` over one reservation, memfd sections, `PROCMAP_QUERY`
//! region queries, and what the machine offers (`uname`, affinity, userfaultfd, `PAGEMAP_SCAN`).

pub mod mm;
pub mod pin;
pub mod probe;
pub mod query;
pub mod uapi;
