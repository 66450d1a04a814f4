//! Guest memory imported into the GPU.
//!
//! The game registers its memory pools ([`Importer::add_pool`]); they may overlap. Two policies
//! ([`ImportPolicy`], `EMUHOST_IMPORT_POLICY`):
//!
//! - `Pools` (the default): a binding imports the pools it lies in, exactly ([`pool_range`]). Once a
//!   binding comes in a region, that region's pools (and pools made there later) are populated and
//!   imported on background threads, within a budget of bytes not yet bound. A binding whose pools
//!   are not ready imports them itself when the cost model ([`ImportCost`], measured at start and
//!   learned from the bindings' own imports) says that fits the wait target; otherwise it imports
//!   its part and the pools follow whole behind it.
//! - `Chunks` (the seed's): imports are made in chunks (default 16 MiB, chunk-aligned) at the first
//!   binding inside a chunk; a binding across a chunk's end needs both chunks in one import. With
//!   spans on (the default, capped at 64 MiB, `EMUHOST_IMPORT_SPAN_MB`, 0 for off), the import's
//!   range grows over the pools that run across its ends ([`plan`]).
//!
//! A range that fails is made again smaller (without the span, or the binding's part) and is held
//! for a while (cooling, `EMUHOST_IMPORT_COOLING_MS`) before it is tried again.
//!
//! An import holds its pages ([`HostSpan`], [`crate::space::Space::hold`]): while it lives the
//! space stays alive and refuses to decommit or remap them (a caller zeroes them instead), and
//! it keeps its backend's device alive, so it may outlive the backend. It never changes the
//! protection of pages the guest committed: only reserved pages in its range are committed.
//!
//! Underneath, an import pins the pages and maps them for the device: Vulkan
//! (`VK_EXT_external_memory_host`), CUDA (`cuMemHostRegister`) or, with no GPU, `mlock`. Most of an
//! import of fresh memory is the kernel faulting the pages in (6.5 ms of a 16 MiB import on an
//! H200, against 1.0 ms for pages touched before): [`ImportConfig::populate_ahead`] faults a
//! pool's pages in on a background thread when the pool is made.
//!
//! The binding thread's waits for imports, whoever made them, are in [`Stats`].
//!
//! The Vulkan and CUDA backends are behind the cargo features `vulkan` and `cuda` (both on by
//! default); without one, its backend's `open` says so and the automatic choice passes it over.
//! Pin is always there.

#[cfg(not(all(feature = "cuda", feature = "vulkan")))]
mod absent;
mod backend;
mod cost;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_disabled.rs"]
mod cuda;
mod error;
mod importer;
mod pin;
mod plan;
mod pools;
pub mod pools_file;
#[cfg(feature = "vulkan")]
pub(crate) mod vulkan;
#[cfg(not(feature = "vulkan"))]
#[path = "vulkan_disabled.rs"]
pub(crate) mod vulkan;

pub use backend::{
    AnyBackend, AnyImport, Backend, BackendChoice, BackendKind, Budget, BudgetCell, GpuHandle, HostSpan, Picked,
    error_chain, verify,
};
pub use cost::ImportCost;
pub use cuda::{Cuda, CudaImport};
pub use error::ImportError;
pub use importer::{
    Bound, ChunksConfig, DEFAULT_AHEAD, DEFAULT_AHEAD_PIECE, DEFAULT_COOLING, DEFAULT_WAIT, ImportConfig, ImportPolicy,
    Importer, MERGE_LIMIT, PoolsConfig, PopulateAhead, Stats,
};
pub use pin::{Pin, Pinned};
pub use plan::{
    DEFAULT_CHUNK, DEFAULT_SPAN_CAP, PlanConfig, Planned, binding_cover, grow, piece, plan, pool_range, reference,
};
pub use pools::{Pool, PoolId, Pools};
#[cfg(feature = "vulkan")]
#[cfg_attr(docsrs, doc(cfg(feature = "vulkan")))]
pub use vulkan::CallerDevice;
pub use vulkan::{Vulkan, VulkanImport};
