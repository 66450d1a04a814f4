use std::io;
use std::path::PathBuf;

/// What went wrong reading what the machine gives a process: a file that could not be read or
/// that does not say what the kernel writes there. The OS error is kept as the source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchedError {
    /// A file of the kernel's could not be read (Linux: a cgroup's `cpu.max`, `/proc/meminfo`).
    #[error("reading {path} failed")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    #[error("cpu.max holds {text:?}, not \"max PERIOD\" or \"QUOTA PERIOD\" with a non-zero period")]
    /// A `cpu.max` that is not `max PERIOD` or `QUOTA PERIOD` with non-zero numbers.
    BadCpuMax {
        /// The file's text.
        text: String,
    },
    /// `/proc/meminfo` has no `MemAvailable` line (kernels before 3.14).
    #[error("/proc/meminfo has no MemAvailable line")]
    NoMemAvailable,
    #[error("/proc/meminfo's MemAvailable line {line:?} is not \"MemAvailable: N kB\"")]
    /// A `MemAvailable` line that is not `MemAvailable: N kB`.
    BadMemAvailable {
        /// The line.
        line: String,
    },
}
