//! The Vulkan import backend in a build without the cargo feature `vulkan`: none can be opened
//! ([`Vulkan::open`] says why), so no value of these types exists.

use super::ImportError;
use super::backend::{Backend, BackendKind, BudgetCell, HostSpan};

/// The Vulkan backend, absent from this build.
#[derive(Debug)]
pub enum Vulkan {}

/// An import of the Vulkan backend, absent from this build.
#[derive(Debug)]
pub enum VulkanImport {}

impl Vulkan {
    /// Always `Unavailable`: this build has no Vulkan.
    pub fn open() -> Result<Vulkan, ImportError> {
        Err(ImportError::Unavailable { backend: "vulkan", why: "built without the cargo feature `vulkan`".into() })
    }

    pub fn device_name(&self) -> &str {
        match *self {}
    }
}

impl Backend for Vulkan {
    type Import = VulkanImport;

    fn kind(&self) -> BackendKind {
        match *self {}
    }

    fn describe(&self) -> String {
        match *self {}
    }

    fn alignment(&self) -> u64 {
        match *self {}
    }

    fn budget(&self) -> &BudgetCell {
        match *self {}
    }

    fn import(&self, _span: HostSpan) -> Result<VulkanImport, ImportError> {
        match *self {}
    }

    fn gpu_copy(&self, _: &VulkanImport, _: u64, _: &VulkanImport, _: u64, _: u64) -> Result<bool, ImportError> {
        match *self {}
    }
}
