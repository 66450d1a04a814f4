//! The CUDA import backend in a build without the cargo feature `cuda`: none can be opened
//! ([`Cuda::open`] says why), so no value of these types exists.

super::absent::absent_backend!(Cuda, CudaImport, "cuda", "CUDA");

#[cfg(test)]
mod tests {
    use crate::import::{AnyBackend, Backend, BackendChoice, BackendKind, ImportError};

    /// Without the feature the backend says so when asked for, and the automatic choice passes
    /// it over (to pin, where no other GPU backend is built).
    #[test]
    fn absent_backend_is_unavailable_and_passed_over() {
        let e = super::Cuda::open().unwrap_err();
        assert!(matches!(e, ImportError::Unavailable { backend: "cuda", .. }), "{e:?}");
        assert!(e.to_string().contains("built without the cargo feature `cuda`"), "{e}");
        let e = AnyBackend::open(BackendKind::Cuda).unwrap_err();
        assert!(e.to_string().contains("`cuda`"), "{e}");
        // Vulkan, then CUDA, then pin: where pin was picked, CUDA was passed over, with the reason.
        let picked = AnyBackend::pick(BackendChoice::Auto).unwrap();
        assert_ne!(picked.backend.kind(), BackendKind::Cuda);
        if picked.backend.kind() == BackendKind::Pin {
            let why = picked.passed_over.iter().find(|(k, _)| *k == BackendKind::Cuda);
            assert!(why.is_some_and(|(_, why)| why.contains("`cuda`")), "{:?}", picked.passed_over);
        }
    }
}
