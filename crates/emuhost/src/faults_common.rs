//! What both builds of fault injection share: the switches' names and the error of a bad one.

/// Which imports fail (a schedule, see [`crate::faults`]), counted over every import the
/// backends make after start-up (the start-up check's own imports are not counted).
pub const IMPORT_SWITCH: &str = "EMUHOST_FAULT_IMPORT";
/// Imports of more than this many MiB fail.
pub const IMPORT_ABOVE_SWITCH: &str = "EMUHOST_FAULT_IMPORT_ABOVE_MB";
/// Which of the system calls a commit makes fail with `ENOMEM` (a schedule).
pub const COMMIT_SWITCH: &str = "EMUHOST_FAULT_COMMIT_ENOMEM";
/// `eperm` or `enosys`: opening a userfaultfd fails so.
pub const UFFD_SWITCH: &str = "EMUHOST_FAULT_UFFD";
/// `1`: a `SIGSEGV` handler is installed before emuhost's, and every collect first faults on a
/// page of its own that only that handler resolves.
pub const FOREIGN_SEGV_SWITCH: &str = "EMUHOST_FAULT_FOREIGN_SEGV";

/// `1`: region queries read `/proc/self/maps` as on a kernel without `PROCMAP_QUERY` (for spaces
/// made, and probes run, while it is set).
pub const NO_PROCMAP_QUERY_SWITCH: &str = "EMUHOST_FAULT_NO_PROCMAP_QUERY";
/// `1`: populates touch the pages as on a kernel without `MADV_POPULATE_WRITE`.
pub const NO_POPULATE_WRITE_SWITCH: &str = "EMUHOST_FAULT_NO_POPULATE_WRITE";

/// `FIXED,PER_MIB` µs: a model of a driver that serializes imports (NVIDIA's host-pointer imports):
/// every backend import holds one process-wide lock and sleeps `FIXED + PER_MIB × MiB` before its
/// driver call.
pub const IMPORT_COST_SWITCH: &str = "EMUHOST_FAULT_IMPORT_COST_US";

/// Every fault switch.
pub const SWITCHES: [&str; 8] = [
    IMPORT_SWITCH,
    IMPORT_ABOVE_SWITCH,
    COMMIT_SWITCH,
    UFFD_SWITCH,
    FOREIGN_SEGV_SWITCH,
    NO_PROCMAP_QUERY_SWITCH,
    NO_POPULATE_WRITE_SWITCH,
    IMPORT_COST_SWITCH,
];

/// A fault switch that cannot be honoured.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FaultError {
    /// A switch's value that does not parse.
    #[error("{name}={value:?}: {why}")]
    BadSwitch {
        /// The switch (`EMUHOST_FAULT_...`).
        name: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        why: String,
    },
    /// A switch set in a build without the `faults` feature.
    #[error("{name} is set, but this build has no fault injection (build with the cargo feature `faults`)")]
    NotBuilt {
        /// The switch.
        name: &'static str,
    },
}
