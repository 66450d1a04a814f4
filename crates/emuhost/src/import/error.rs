use std::io;

use crate::space::SpaceError;

/// What went wrong in an import. Guest addresses and sizes are in hex; a driver's or the OS's
/// error is kept as the source or named by its code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// A chunk size ([`ImportConfig::chunk`](super::ImportConfig#structfield.chunk),
    /// `EMUHOST_IMPORT_CHUNK_MB`, [`PlanConfig`](super::PlanConfig)) that is not a power of two of
    /// at least the backend's alignment.
    #[error("chunk {chunk:#x} is not a power of two of at least the backend's alignment {align:#x}")]
    BadChunk {
        /// The chunk size in bytes.
        chunk: u64,
        /// The backend's alignment in bytes (1 where only a power of two is asked for).
        align: u64,
    },
    /// A binding of zero bytes.
    #[error("binding at {addr:#x} has zero size")]
    EmptyBinding {
        /// Guest address of the binding's first byte.
        addr: u64,
    },
    /// A binding whose end passes `u64::MAX`.
    #[error("binding {addr:#x}+{size:#x} runs past the end of the address space")]
    BindingWraps {
        /// Guest address of the binding's first byte.
        addr: u64,
        /// The binding's size in bytes.
        size: u64,
    },
    /// A binding whose chunk-aligned cover (the chunks it lies in) would end past `u64::MAX`.
    #[error("the chunk cover of binding {addr:#x}+{size:#x} (chunk {chunk:#x}) runs past the end of the address space")]
    CoverWraps {
        /// Guest address of the binding's first byte.
        addr: u64,
        /// The binding's size in bytes.
        size: u64,
        /// The chunk size in bytes.
        chunk: u64,
    },
    /// [`Importer::new`](super::Importer::new): a chunk larger than the guest window or, under
    /// the chunks policy, than the backend's largest single import or live imported bytes: no
    /// binding could ever import.
    #[error(
        "import chunk {chunk:#x} (EMUHOST_IMPORT_CHUNK_MB={}) is larger than {what} {limit:#x}: no binding could import",
        chunk >> 20
    )]
    ChunkTooLarge {
        /// The chunk size in bytes.
        chunk: u64,
        /// What it is larger than: the guest window, or the backend's largest single import or live imported bytes.
        what: &'static str,
        /// That limit in bytes.
        limit: u64,
    },
    /// A pool ([`Importer::add_pool`](super::Importer::add_pool), [`plan`](super::plan)) of zero
    /// bytes or whose end (or chunk cover) passes `u64::MAX`.
    #[error("pool {lo:#x}+{size:#x} is empty or runs past the end of the address space")]
    BadPool {
        /// Guest address of the pool's first byte.
        lo: u64,
        /// The pool's size in bytes.
        size: u64,
    },
    /// Every range a binding could import failed a moment ago and is cooling
    /// (`EMUHOST_IMPORT_COOLING_MS`): `lo..hi` is the last one tried. The binding goes without an
    /// import ([`ImportError::is_refused`]).
    #[error("guest range {lo:#x}..{hi:#x} failed to import a moment ago and is cooling for {left_ms} ms more")]
    Cooling {
        /// Guest address of the range's first byte.
        lo: u64,
        /// End of the range (exclusive).
        hi: u64,
        /// Milliseconds of cooling left.
        left_ms: u64,
    },
    /// The backend failed to import guest range `lo..hi`; `source` is its error (a
    /// [`ImportError::Vulkan`], [`ImportError::Cuda`], [`ImportError::Budget`], ...). The range
    /// then cools before it is tried again ([`ImportError::is_refused`]).
    #[error("importing guest range {lo:#x}..{hi:#x} ({backend})")]
    Import {
        /// Guest address of the range's first byte.
        lo: u64,
        /// End of the range (exclusive).
        hi: u64,
        /// The backend's name (`vulkan`, `cuda`, `pin`).
        backend: &'static str,
        /// The backend's error.
        #[source]
        source: Box<ImportError>,
    },
    /// A pool or binding `addr+size` that runs past the end of the guest window.
    #[error("guest range {addr:#x}+{size:#x} is outside the guest window 0x0..{window:#x}")]
    #[non_exhaustive]
    OutOfWindow {
        /// Guest address of the range's first byte.
        addr: u64,
        /// The range's size in bytes.
        size: u64,
        /// The window's size in bytes.
        window: u64,
    },
    /// A binding `addr+size` over pages the space has not committed: `lo..hi` is the first run
    /// of them. Nothing is imported.
    #[error("binding {addr:#x}+{size:#x} refused: pages {lo:#x}..{hi:#x} are not committed")]
    #[non_exhaustive]
    NotCommitted {
        /// Guest address of the binding's first byte.
        addr: u64,
        /// The binding's size in bytes.
        size: u64,
        /// First guest byte of the pages not committed.
        lo: u64,
        /// End of those pages (exclusive).
        hi: u64,
    },
    /// A space call failed: committing reserved pages in the import's range, holding or
    /// populating them, or an OS call over guest memory (pinning: [`SpaceError::Os`]).
    #[error(transparent)]
    Space(#[from] SpaceError),
    /// A host range handed to a backend that is not aligned to its alignment (Vulkan's
    /// `minImportedHostPointerAlignment`, the page for CUDA and pin).
    #[error("host range {addr:#x}+{len:#x} is not aligned to the backend's {align:#x} bytes")]
    Unaligned {
        /// Host address of the range.
        addr: u64,
        /// The range's length in bytes.
        len: u64,
        /// The backend's alignment in bytes (1 where only a power of two is asked for).
        align: u64,
    },
    /// One more import would pass a backend's limit ([`Budget`](super::Budget)): its size, its
    /// live imports or bytes, or (Vulkan) the memory heap's size.
    #[error("{what}: {need:#x} more would pass the limit {limit:#x} (in use {used:#x})")]
    Budget {
        /// Which limit: `one import's size`, `live imports`, `live imported bytes` or `the memory heap`.
        what: &'static str,
        /// What the import needs (bytes, or 1 import).
        need: u64,
        /// What is in use now (bytes or imports).
        used: u64,
        /// The limit (bytes or imports).
        limit: u64,
    },
    /// The backend cannot be opened here: no driver or loader, no device with what it needs, or
    /// built without its cargo feature (`vulkan`, `cuda`).
    #[error("the {backend} backend is not available: {why}")]
    Unavailable {
        /// The backend's name (`vulkan`, `cuda`, `pin`).
        backend: &'static str,
        /// Why.
        why: String,
    },
    /// A Vulkan call failed: `code` is the API's own result code, as `ash` types it (feature
    /// `vulkan`).
    #[error("{op} failed: {code:?}")]
    #[cfg(feature = "vulkan")]
    #[cfg_attr(docsrs, doc(cfg(feature = "vulkan")))]
    Vulkan {
        /// The API call that failed.
        op: &'static str,
        /// The API's result code.
        code: ash::vk::Result,
    },
    /// A CUDA driver call failed: `code` is its `CUresult`.
    #[error("{op} failed: CUDA error {code} ({name})")]
    Cuda {
        /// The API call that failed.
        op: &'static str,
        /// The API's result code.
        code: u32,
        /// The code's name (`cuGetErrorName`).
        name: String,
    },
    /// A backend's start-up check ([`verify`](super::verify): import, write through the host, read
    /// back) failed, or a backend was handed imports of another.
    #[error("start-up check of the {backend} backend: {what}")]
    Verify {
        /// The backend's name (`vulkan`, `cuda`, `pin`).
        backend: &'static str,
        /// What the check saw.
        what: String,
    },
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
    LiveCap {
        /// Live imports now.
        live: u64,
        /// The cap on live imports.
        cap: u64,
    },
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
