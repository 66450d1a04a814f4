//! The Vulkan import backend in a build without the cargo feature `vulkan`: none can be opened
//! ([`Vulkan::open`] says why), so no value of these types exists.

super::absent::absent_backend!(Vulkan, VulkanImport, "vulkan", "Vulkan");

impl Vulkan {
    /// The device's name (never called: no value exists).
    pub fn device_name(&self) -> &str {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use crate::import::{AnyBackend, Backend, BackendChoice, BackendKind, ImportError};

    /// Without the feature the backend says so when asked for, and the automatic choice passes
    /// it over (to pin, where no other GPU backend is built).
    #[test]
    fn absent_backend_is_unavailable_and_passed_over() {
        let e = super::Vulkan::open().unwrap_err();
        assert!(matches!(e, ImportError::Unavailable { backend: "vulkan", .. }), "{e:?}");
        assert!(e.to_string().contains("built without the cargo feature `vulkan`"), "{e}");
        let e = AnyBackend::open(BackendKind::Vulkan).unwrap_err();
        assert!(e.to_string().contains("`vulkan`"), "{e}");
        // Vulkan comes first in the automatic choice: it is always passed over here.
        let picked = AnyBackend::pick(BackendChoice::Auto).unwrap();
        assert_ne!(picked.backend.kind(), BackendKind::Vulkan);
        let why = picked.passed_over.iter().find(|(k, _)| *k == BackendKind::Vulkan);
        assert!(why.is_some_and(|(_, why)| why.contains("`vulkan`")), "{:?}", picked.passed_over);
    }
}
