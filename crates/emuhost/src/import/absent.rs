//! A GPU backend in a build without its cargo feature: one macro for each such backend
//! (`cuda_disabled.rs`, `vulkan_disabled.rs`), so the two stand-ins cannot drift apart. None can
//! be opened (`open` says why), so no value of the types it makes exists.

/// `absent_backend!(Backend, Import, "name", "Name")`: the uninhabited backend type `Backend`
/// and its import type `Import`, whose `open` fails with `Unavailable` naming the cargo feature
/// `name`, and whose `Backend` impl is never called.
macro_rules! absent_backend {
    ($backend:ident, $import:ident, $name:literal, $what:literal) => {
        use $crate::import::ImportError;
        use $crate::import::backend::{Backend, BackendKind, BudgetCell, HostSpan};

        #[doc = concat!("The ", $what, " backend, absent from this build.")]
        #[derive(Debug)]
        pub enum $backend {}

        #[doc = concat!("An import of the ", $what, " backend, absent from this build.")]
        #[derive(Debug)]
        pub enum $import {}

        impl $backend {
            #[doc = concat!("Always `Unavailable`: this build has no ", $what, ".")]
            pub fn open() -> Result<$backend, ImportError> {
                Err(ImportError::Unavailable {
                    backend: $name,
                    why: concat!("built without the cargo feature `", $name, "`").into(),
                })
            }
        }

        impl Backend for $backend {
            type Import = $import;

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

            fn import(&self, _span: HostSpan) -> Result<$import, ImportError> {
                match *self {}
            }

            fn gpu_copy(&self, _: &$import, _: u64, _: &$import, _: u64, _: u64) -> Result<bool, ImportError> {
                match *self {}
            }
        }
    };
}

pub(crate) use absent_backend;
