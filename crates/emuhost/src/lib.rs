//! emuhost: the host layer a console emulator or static recompiler runs its game on.
//!
//! - [`space`]: the guest address space (one reservation, one-call commit, populate, shared views).
//! - [`watch`]: what the guest wrote (userfaultfd + PAGEMAP_SCAN, mprotect + SIGSEGV).
//! - [`sched`]: short sleeps (timer, yield or hybrid by rule) and compile-worker sizing.
//! - [`import`]: guest memory imported into the GPU (pools, chunks, spans, Vulkan/CUDA/pin; the
//!   Vulkan and CUDA backends behind the cargo features `vulkan` and `cuda`, on by default).
//! - `gpu`: the process's one Vulkan setup (instance, device choice, error mapping), feature `vulkan`.
//! - [`probe`]: what this machine offers the runtime, and the process's own memory figures.
//! - [`rng`]: the workspace's one deterministic generator (synthetic sessions, shader corpora,
//!   stress runs, benchmark layouts): the same draws from a seed on every platform.
//! - [`settings`]: every `EMUHOST_*` switch, typed ([`settings::Settings`]); the library reads the
//!   environment only in [`settings::Settings::from_env`].
//!
//! Only `sys/` (OS calls) and the GPU FFI opt out of `deny(unsafe_code)`.
//!
//! Traces, replay, soak and the write-tracking stress are the `emuhost-lab` crate; shader
//! preparation is `emuhost-prepare`.
#![deny(unsafe_code)]
// docs.rs marks the items of the `vulkan` and `cuda` features as such.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod errors;
#[cfg(feature = "faults")]
pub mod faults;
#[cfg(not(feature = "faults"))]
#[path = "faults_disabled.rs"]
pub mod faults;
#[cfg(feature = "vulkan")]
#[cfg_attr(docsrs, doc(cfg(feature = "vulkan")))]
pub mod gpu;
pub mod import;
pub mod rng;
pub mod sched;
pub mod settings;
pub mod space;
mod sys;
pub mod watch;

pub mod probe;

/// System-call counters (per thread). Filled only in a build with the `counters` feature;
/// [`counters::snapshot`] returns `None` otherwise.
pub mod counters {
    pub use crate::sys::counters::{Call, Counts, snapshot};
}
