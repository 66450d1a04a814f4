//! Pin: `mlock`/`munlock` (Windows: `VirtualLock`/`VirtualUnlock`, the working set grown to fit
//! where its quota refuses), for machines with no GPU. The OS faults the range's pages in and
//! keeps them resident: the part of a GPU import that is the pinning, without a device. A pinned
//! range is unlocked when it is dropped (or released), whether or not the backend is still there.
//! The start-up check reads residency with `mincore` (Windows: `QueryWorkingSetEx`). Every OS
//! call is the platform layer's (`sys::pin`), and errors name the platform's call.
//!
//! # Safety
//! This module opts out of the crate's `deny(unsafe_code)` for the calls of `sys::pin::lock` and
//! `unlock`, whose ranges must be memory of ours: each is a [`HostSpan`], which holds the space's
//! pages mapped while it lives, and the import keeps it until its range is unlocked. Every
//! `unsafe` block carries a `// SAFETY:` line.
#![allow(unsafe_code)]

use std::sync::Arc;

use super::ImportError;
use super::backend::{Backend, BackendKind, Budget, BudgetCell, HostSpan};
use crate::space::page_size;
use crate::sys::pin as sys;

/// The pin backend.
#[derive(Debug, Default)]
pub struct Pin {
    budget: Arc<BudgetCell>,
}

/// A pinned range: unlocked when dropped.
#[derive(Debug)]
pub struct Pinned {
    span: HostSpan,
    budget: Arc<BudgetCell>,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let s = &self.span;
        // SAFETY: the span's pages are held mapped while it lives (`HostSpan`), and `import`
        // locked exactly this range.
        if let Err(e) = unsafe { sys::unlock(s.addr(), s.len()) } {
            tracing::warn!("{} {:#x}+{:#x}: {e}", sys::UNLOCK, s.addr(), s.len());
        }
        self.budget.give(s.len() as u64);
    }
}

impl Pin {
    /// A pin backend with no limits of its own (the OS's apply).
    pub fn new() -> Self {
        Self::with_budget(Budget::default())
    }

    /// With limits of its own (the OS's still apply underneath: `RLIMIT_MEMLOCK`; on Windows the
    /// working set, which a lock grows where its quota refuses).
    pub fn with_budget(b: Budget) -> Self {
        Self { budget: Arc::new(BudgetCell::new(b)) }
    }
}

impl Backend for Pin {
    type Import = Pinned;

    fn kind(&self) -> BackendKind {
        BackendKind::Pin
    }

    fn describe(&self) -> String {
        if cfg!(windows) { "VirtualLock (no GPU)" } else { "mlock (no GPU)" }.into()
    }

    fn alignment(&self) -> u64 {
        page_size()
    }

    fn budget(&self) -> &BudgetCell {
        &self.budget
    }

    fn import(&self, span: HostSpan) -> Result<Pinned, ImportError> {
        span.check_aligned(self.alignment())?;
        self.budget.take(span.len() as u64)?;
        // SAFETY: a `HostSpan` is the host bytes of the space's guest window, held mapped while it
        // lives; the span moves into the `Pinned`, whose drop unlocks the range.
        if let Err(source) = unsafe { sys::lock(span.addr(), span.len()) } {
            // The lock may have locked part of the range before failing.
            // SAFETY: the same held range, which the failed lock may have partly pinned.
            let _ = unsafe { sys::unlock(span.addr(), span.len()) };
            self.budget.give(span.len() as u64);
            return Err(ImportError::os(sys::LOCK, span.addr() as u64, span.len() as u64, source));
        }
        Ok(Pinned { span, budget: self.budget.clone() })
    }

    fn gpu_copy(&self, _: &Pinned, _: u64, _: &Pinned, _: u64, _: u64) -> Result<bool, ImportError> {
        Ok(false)
    }

    fn check(&self, import: &Pinned) -> Result<(), ImportError> {
        let s = &import.span;
        match sys::resident(s.addr(), s.len()) {
            Ok(true) => Ok(()),
            Ok(false) => Err(ImportError::Verify { backend: "pin", what: "a pinned page is not resident".into() }),
            Err(source) => Err(ImportError::os(sys::RESIDENT, s.addr() as u64, s.len() as u64, source)),
        }
    }
}
