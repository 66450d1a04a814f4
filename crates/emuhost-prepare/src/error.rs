use std::io;
use std::path::PathBuf;

use emuhost::gpu::vulkan::InstanceError;

/// What stopped a preparation or a corpus from loading. A shader that fails to translate or
/// compile is not one of these: it is reported in the run's [`Report`](super::Report) and the run
/// goes on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}, line {line}: {what}")]
    Manifest { path: PathBuf, line: usize, what: String },
    #[error("the Vulkan loader (libvulkan.so.1) could not be loaded")]
    Loader(#[source] ash::LoadingError),
    #[error("Vulkan: {what} failed: {result}")]
    Vulkan { what: &'static str, result: ash::vk::Result },
    #[error("the Vulkan instance could not be made")]
    Instance(#[source] InstanceError),
    #[error("no Vulkan device with a compute queue")]
    NoComputeDevice,
    #[error("no Vulkan device {index:#x}: {count:#x} present")]
    NoSuchDevice { index: usize, count: usize },
    #[error("the workers must be at least 1")]
    NoWorkers,
    /// A file a preparation would replace, truncate or remove is there and was not written by
    /// emuhost: it is left alone.
    #[error("{path}: {why}: not emuhost's {what}, so it is left alone (move it away or choose another path)")]
    NotOurs { path: PathBuf, what: &'static str, why: String },
    /// A corpus file is there already: written over only when asked (`force`).
    #[error("{path} exists: a corpus is not written over it unless forced")]
    Exists { path: PathBuf },
}

impl From<InstanceError> for PrepareError {
    fn from(e: InstanceError) -> Self {
        match e {
            InstanceError::Loader(e) => PrepareError::Loader(e),
            InstanceError::Vulkan { op, code } => PrepareError::Vulkan { what: op, result: code },
            // `InstanceError` may grow: a new kind is kept whole.
            other => PrepareError::Instance(other),
        }
    }
}

/// Why a pipeline cache file was not used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CacheRejected {
    #[error("{len:#x} bytes: shorter than emuhost's {want:#x}-byte envelope")]
    Short { len: usize, want: usize },
    #[error("not an emuhost pipeline cache (bad magic)")]
    Magic,
    /// emuhost's, of another envelope version (1: checked by FNV-1a 64, before CRC32).
    #[error(
        "an emuhost pipeline cache of envelope version {found}, this build reads version {want} (version 1 was checked by FNV-1a 64, version 2 by CRC32)"
    )]
    Version { found: u8, want: u8 },
    #[error("the envelope says {said:#x} bytes of data, the file holds {held:#x}")]
    Length { said: u64, held: u64 },
    #[error("CRC32 {found:#010x}, expected {want:#010x}: the data is corrupt")]
    Checksum { found: u64, want: u64 },
    #[error(
        "the Vulkan header says {header_size:#x} bytes, version {version:#x} (expected >= 0x20 bytes, version 0x1)"
    )]
    Header { header_size: u32, version: u32 },
    #[error("made by vendor {vendor:#x} device {device:#x}, this is vendor {want_vendor:#x} device {want_device:#x}")]
    Device { vendor: u32, device: u32, want_vendor: u32, want_device: u32 },
    #[error("pipelineCacheUUID {found}, this driver's is {want}")]
    Uuid { found: String, want: String },
}
