//! The CUDA import backend in a build without the cargo feature `cuda`: none can be opened
//! ([`Cuda::open`] says why), so no value of these types exists.

use super::ImportError;
use super::backend::{Backend, BackendKind, BudgetCell, HostSpan};

/// The CUDA backend, absent from this build.
#[derive(Debug)]
pub enum Cuda {}

/// An import of the CUDA backend, absent from this build.
#[derive(Debug)]
pub enum CudaImport {}

impl Cuda {
    /// Always `Unavailable`: this build has no CUDA.
    pub fn open() -> Result<Cuda, ImportError> {
        Err(ImportError::Unavailable { backend: "cuda", why: "built without the cargo feature `cuda`".into() })
    }
}

impl Backend for Cuda {
    type Import = CudaImport;

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

    fn import(&self, _span: HostSpan) -> Result<CudaImport, ImportError> {
        match *self {}
    }

    fn gpu_copy(&self, _: &CudaImport, _: u64, _: &CudaImport, _: u64, _: u64) -> Result<bool, ImportError> {
        match *self {}
    }
}
