use std::io;

use crate::space::SpaceError;

/// What went wrong in an import. Guest addresses and sizes are in hex; a driver's or the OS's
/// error is kept as the source or named by its code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    #[error("chunk {chunk:#x} is not a power of two of at least the backend's alignment {align:#x}")]
    BadChunk { chunk: u64, align: u64 },
    #[error("binding at {addr:#x} has zero size")]
    EmptyBinding { addr: u64 },
    #[error("binding {addr:#x}+{size:#x} runs past the end of the address space")]
    BindingWraps { addr: u64, size: u64 },
    #[error("the chunk cover of binding {addr:#x}+{size:#x} (chunk {chunk:#x}) runs past the end of the address space")]
    CoverWraps { addr: u64, size: u64, chunk: u64 },
    #[error(
        "import chunk {chunk:#x} (EMUHOST_IMPORT_CHUNK_MB={}) is larger than {what} {limit:#x}: no binding could import",
        chunk >> 20
    )]
    ChunkTooLarge { chunk: u64, what: &'static str, limit: u64 },
    #[error("pool {lo:#x}+{size:#x} is empty or runs past the end of the address space")]
    BadPool { lo: u64, size: u64 },
    #[error("guest range {lo:#x}..{hi:#x} failed to import a moment ago and is cooling for {left_ms} ms more")]
    Cooling { lo: u64, hi: u64, left_ms: u64 },
    #[error("importing guest range {lo:#x}..{hi:#x} ({backend})")]
    Import {
        lo: u64,
        hi: u64,
        backend: &'static str,
        #[source]
        source: Box<ImportError>,
    },
    /// A pool or binding `addr+size` that runs past the end of the guest window.
    #[error("guest range {addr:#x}+{size:#x} is outside the guest window 0x0..{window:#x}")]
    #[non_exhaustive]
    OutOfWindow { addr: u64, size: u64, window: u64 },
    /// A binding `addr+size` over pages the space has not committed: `lo..hi` is the first run
    /// of them. Nothing is imported.
    #[error("binding {addr:#x}+{size:#x} refused: pages {lo:#x}..{hi:#x} are not committed")]
    #[non_exhaustive]
    NotCommitted { addr: u64, size: u64, lo: u64, hi: u64 },
    #[error(transparent)]
    Space(#[from] SpaceError),
    #[error("host range {addr:#x}+{len:#x} is not aligned to the backend's {align:#x} bytes")]
    Unaligned { addr: u64, len: u64, align: u64 },
    #[error("{what}: {need:#x} more would pass the limit {limit:#x} (in use {used:#x})")]
    Budget { what: &'static str, need: u64, used: u64, limit: u64 },
    #[error("the {backend} backend is not available: {why}")]
    Unavailable { backend: &'static str, why: String },
    /// A Vulkan call failed: `code` is the API's own result code, as `ash` types it (feature
    /// `vulkan`).
    #[error("{op} failed: {code:?}")]
    #[cfg(feature = "vulkan")]
    #[cfg_attr(docsrs, doc(cfg(feature = "vulkan")))]
    Vulkan { op: &'static str, code: ash::vk::Result },
    #[error("{op} failed: CUDA error {code} ({name})")]
    Cuda { op: &'static str, code: u32, name: String },
    #[error("start-up check of the {backend} backend: {what}")]
    Verify { backend: &'static str, what: String },
    /// One more import would pass the cap on live imports (`EMUHOST_IMPORT_MAX_LIVE`, or the
    /// backend's limit on live allocations), and the importer could make no room: nothing to
    /// release, no neighbour near enough to merge with. The importer no longer returns it (at
    /// the cap a binding imports over it rather than go without; only the backend's own limit
    /// refuses, as [`ImportError::Budget`]); kept so that code matching it still builds.
    #[error(
        "{live} live imports at the cap of {cap} (EMUHOST_IMPORT_MAX_LIVE, or the backend's limit on live \
         allocations): none could be released or merged with"
    )]
    #[non_exhaustive]
    LiveCap { live: u64, cap: u64 },
}

impl ImportError {
    /// An OS call of an import (`op` over guest `addr+len`) failed: the space's error of that
    /// kind ([`SpaceError::Os`]), one home for an OS failure over guest memory.
    pub(crate) fn os(op: &'static str, addr: u64, len: u64, source: io::Error) -> Self {
        ImportError::Space(SpaceError::os(op, addr, len, source))
    }

    /// Whether this is the importer refusing one binding at run time (the driver failed the
    /// import, or the range is cooling after it did) rather than a bad binding or setting: a
    /// caller goes on without the import.
    pub fn is_refused(&self) -> bool {
        matches!(self, ImportError::Import { .. } | ImportError::Cooling { .. } | ImportError::LiveCap { .. })
    }

    /// Whether this is a binding refused at the cap on live imports ([`ImportError::LiveCap`],
    /// alone or as the source of [`ImportError::Import`]).
    pub fn is_capped(&self) -> bool {
        match self {
            ImportError::LiveCap { .. } => true,
            ImportError::Import { source, .. } => source.is_capped(),
            _ => false,
        }
    }
}
