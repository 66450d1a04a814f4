use std::io;
use std::path::PathBuf;

/// What went wrong reading what the machine gives a process: a file that could not be read or
/// that does not say what the kernel writes there. The OS error is kept as the source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchedError {
    #[error("reading {path} failed")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cpu.max holds {text:?}, not \"max PERIOD\" or \"QUOTA PERIOD\" with a non-zero period")]
    BadCpuMax { text: String },
    #[error("/proc/meminfo has no MemAvailable line")]
    NoMemAvailable,
    #[error("/proc/meminfo's MemAvailable line {line:?} is not \"MemAvailable: N kB\"")]
    BadMemAvailable { line: String },
}
