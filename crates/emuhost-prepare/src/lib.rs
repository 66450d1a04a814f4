//! Shader preparation: what a game's first start does before play. Every program of a corpus of
//! compute shaders is translated with naga (WGSL or GLSL in, validated, SPIR-V out, one module per
//! variant), then every variant's compute pipeline is created through the Vulkan driver, which
//! compiles it to the device's code, with one `VkPipelineCache` that is saved to a file and handed
//! to the driver again on the next run. A second run with the saved cache finds its pipelines in
//! the cache (the driver says so where it reports creation feedback).
//!
//! - [`corpus`](Corpus): the programs and their variants (overridable constants), on disk as a
//!   folder with a manifest; [`generate`] makes one from a seed.
//! - [`prepare`]: the run. The worker count is the caller's (`sched::Machine::prepare_workers`
//!   gives the rule's). Resumable: the cache file is saved every `checkpoint_every` pipelines and
//!   a journal beside it (`FILE.journal`) lists the variants whose pipelines that save holds, so
//!   an interrupted run (killed, `stop_after`, `cancel`) continues where it stopped.
//! - Bad input does not stop a run: a program that fails to translate, or a variant whose pipeline
//!   the driver refuses, is a [`Failure`] in the [`Report`], named, with the error. A cache file
//!   that is corrupt or made by another device or driver is discarded with a warning
//!   ([`CacheStart::Rejected`]), and so is a journal that does not go with it.
//!
//! The Vulkan instance and the choice of device are the runtime's ([`emuhost::gpu::vulkan`]): one
//! Vulkan setup per process. Only the driver FFI (`vk`) opts out of `deny(unsafe_code)`.
#![deny(unsafe_code)]
#![deny(missing_docs)]

mod cache;
mod corpus;
mod error;
mod run;
mod translate;
mod vk;

pub use cache::{unwrap as check_cache_file, wrap as wrap_cache_data};
pub use corpus::{Corpus, GenConfig, Language, MANIFEST, Program, Variant, generate};
pub use error::{CacheRejected, PrepareError};
pub use run::{
    CacheStart, Failure, JournalStart, Options, Phase, PhaseTime, Report, parse_vm_hwm, peak_memory_bytes, prepare,
    variant_key,
};
pub use vk::DeviceInfo;

/// The device a preparation would use (`index` as in [`Options::device`]), opened and closed
/// again: whether this machine can prepare at all, and on what.
///
/// # Errors
///
/// The device's errors, as [`prepare`] has them: [`PrepareError::Loader`],
/// [`PrepareError::Instance`], [`PrepareError::NoComputeDevice`], [`PrepareError::NoSuchDevice`],
/// [`PrepareError::Vulkan`].
pub fn probe_device(index: Option<usize>) -> Result<DeviceInfo, PrepareError> {
    vk::Driver::open(index).map(|d| d.info.clone())
}

/// FNV-1a, 64 bits: a stable hash (the same in every build) for the journal's variant keys (an
/// identity, not a checksum: the cache file's checksum is CRC32).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    #[test]
    fn fnv1a_known_values() {
        assert_eq!(super::fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(super::fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn vm_hwm_parses() {
        assert_eq!(super::parse_vm_hwm("Name: x\nVmHWM:\t  1234 kB\nVmRSS: 1 kB\n"), Some(1234 * 1024));
        assert_eq!(super::parse_vm_hwm("VmRSS: 1 kB\n"), None);
        assert!(super::peak_memory_bytes().is_some_and(|b| b > 0));
    }
}
