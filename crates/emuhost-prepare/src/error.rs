use std::io;
use std::path::PathBuf;

use emuhost::gpu::vulkan::InstanceError;

/// What stopped a preparation or a corpus from loading. A shader that fails to translate or
/// compile is not one of these: it is reported in the run's [`Report`](super::Report) and the run
/// goes on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// A file or folder could not be read, written, renamed or removed.
    #[error("{path}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The OS's error.
        #[source]
        source: io::Error,
    },
    /// A corpus manifest (`corpus.txt`) line that does not parse, or names a bad file.
    #[error("{path}, line {line}: {what}")]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// Its line, from 1.
        line: usize,
        /// What is wrong with it.
        what: String,
    },
    /// The Vulkan loader could not be loaded (the message names `libvulkan.so.1`; on Windows the
    /// loader is `vulkan-1.dll`).
    #[error("the Vulkan loader (libvulkan.so.1) could not be loaded")]
    Loader(#[source] ash::LoadingError),
    /// A Vulkan call that the preparation needs failed.
    #[error("Vulkan: {what} failed: {result}")]
    Vulkan {
        /// The call (`vkCreateDevice`, ...).
        what: &'static str,
        /// The driver's result code.
        result: ash::vk::Result,
    },
    /// The runtime's Vulkan instance could not be made, for a reason that is neither
    /// [`Loader`](Self::Loader) nor [`Vulkan`](Self::Vulkan).
    #[error("the Vulkan instance could not be made")]
    Instance(#[source] InstanceError),
    /// No Vulkan device has a queue family with compute.
    #[error("no Vulkan device with a compute queue")]
    NoComputeDevice,
    /// The device asked for ([`Options::device`](super::Options::device)) is not there.
    #[error("no Vulkan device {index:#x}: {count:#x} present")]
    NoSuchDevice {
        /// The index asked for, from 0.
        index: usize,
        /// The number of devices present.
        count: usize,
    },
    /// [`Options::workers`](super::Options::workers) was 0.
    #[error("the workers must be at least 1")]
    NoWorkers,
    /// A file a preparation would replace, truncate or remove is there and was not written by
    /// emuhost: it is left alone.
    #[error("{path}: {why}: not emuhost's {what}, so it is left alone (move it away or choose another path)")]
    NotOurs {
        /// The file.
        path: PathBuf,
        /// What it would have been (`pipeline cache file`, `preparation journal`, ...).
        what: &'static str,
        /// Why it is not emuhost's.
        why: String,
    },
    /// A corpus file is there already: written over only when asked (`force`).
    #[error("{path} exists: a corpus is not written over it unless forced")]
    Exists {
        /// The file that is there.
        path: PathBuf,
    },
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
    /// The file is shorter than emuhost's envelope.
    #[error("{len:#x} bytes: shorter than emuhost's {want:#x}-byte envelope")]
    Short {
        /// The file's length, in bytes.
        len: usize,
        /// The envelope's length, in bytes.
        want: usize,
    },
    /// The file does not start with emuhost's magic: not an emuhost pipeline cache.
    #[error("not an emuhost pipeline cache (bad magic)")]
    Magic,
    /// emuhost's, of another envelope version (1: checked by FNV-1a 64, before CRC32).
    #[error(
        "an emuhost pipeline cache of envelope version {found}, this build reads version {want} (version 1 was checked by FNV-1a 64, version 2 by CRC32)"
    )]
    Version {
        /// The file's envelope version.
        found: u8,
        /// The version this build reads.
        want: u8,
    },
    /// The envelope's length does not match the data that follows it (a truncated file).
    #[error("the envelope says {said:#x} bytes of data, the file holds {held:#x}")]
    Length {
        /// The length the envelope says, in bytes.
        said: u64,
        /// The bytes the file holds after the envelope.
        held: u64,
    },
    /// The data's checksum does not match the envelope's: the data is corrupt.
    #[error("CRC32 {found:#010x}, expected {want:#010x}: the data is corrupt")]
    Checksum {
        /// The CRC32 of the data.
        found: u64,
        /// The CRC32 the envelope holds.
        want: u64,
    },
    /// The Vulkan pipeline cache header inside the envelope is missing (both fields 0: the data is
    /// shorter than a header) or is not version 1 of at least 32 bytes.
    #[error(
        "the Vulkan header says {header_size:#x} bytes, version {version:#x} (expected >= 0x20 bytes, version 0x1)"
    )]
    Header {
        /// The header's `headerSize`, in bytes.
        header_size: u32,
        /// The header's `headerVersion`.
        version: u32,
    },
    /// The cache was made by another device (vendor or device id).
    #[error("made by vendor {vendor:#x} device {device:#x}, this is vendor {want_vendor:#x} device {want_device:#x}")]
    Device {
        /// The vendor id the cache's header names.
        vendor: u32,
        /// The device id the cache's header names.
        device: u32,
        /// This device's vendor id.
        want_vendor: u32,
        /// This device's device id.
        want_device: u32,
    },
    /// The cache was made by another driver (or driver version): its `pipelineCacheUUID` differs.
    #[error("pipelineCacheUUID {found}, this driver's is {want}")]
    Uuid {
        /// The UUID the cache's header holds, in hex.
        found: String,
        /// This driver's UUID, in hex.
        want: String,
    },
}
