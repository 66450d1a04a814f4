//! Points where the layer above may make a system call of `sys/` fail, as the real call would
//! (fault injection, `crate::faults`, in a build with the `faults` feature). Declared here, where
//! `sys/` can see them, and installed from above, so `sys/` names nothing above it. Until they
//! are installed (and in every build without the feature) no call fails.

use std::sync::OnceLock;

/// The hooks, all installed at once.
#[derive(Clone, Copy, Debug)]
pub struct Hooks {
    /// Whether a pin (`mlock`) of this many bytes is to fail (`ENOMEM`).
    pub fail_import: fn(u64) -> bool,
    /// The error the `userfaultfd` system call is to fail with, if any.
    pub uffd_errno: fn() -> Option<i32>,
    /// Called just before the fault handler (`SIGSEGV`; Windows' vectored exception handler) is
    /// installed.
    pub before_segv_install: fn(),
}

static HOOKS: OnceLock<Hooks> = OnceLock::new();

/// Installs the hooks (the first installation holds; later ones are the same functions).
#[cfg_attr(not(feature = "faults"), allow(dead_code))] // only fault injection installs them
pub fn install(hooks: Hooks) {
    let _ = HOOKS.set(hooks);
}

pub(crate) fn fail_import(len: u64) -> bool {
    HOOKS.get().is_some_and(|h| (h.fail_import)(len))
}

#[cfg_attr(not(target_os = "linux"), allow(dead_code))] // userfaultfd is Linux's
pub(crate) fn uffd_errno() -> Option<i32> {
    HOOKS.get().and_then(|h| (h.uffd_errno)())
}

pub(crate) fn before_segv_install() {
    if let Some(h) = HOOKS.get() {
        (h.before_segv_install)()
    }
}
