//! The backends behind one trait, the choice between them, and the start-up check each passes.
//!
//! An import hands host pages to a driver: Vulkan (`VK_EXT_external_memory_host`) and CUDA
//! (`cuMemHostRegister`) pin them and map them for the GPU; pin (`mlock`) only pins them. The
//! pages must stay mapped until the driver lets go of them, which safe code cannot break: a
//! [`HostSpan`] holds its pages ([`Space::hold`]: the space stays alive, and a decommit or remap
//! of a held page is refused), each import keeps its span, and an import keeps its backend's
//! device (or driver context) alive and lets go of the pages when it is dropped, so an import
//! may outlive the backend that made it.

use std::sync::{Arc, Mutex};

use super::ImportError;
use super::cuda::Cuda;
use super::pin::Pin;
use super::vulkan::Vulkan;
pub use crate::errors::error_chain;
use crate::space::{GuestAddr, Hold, Prot, Space, page_size};

/// Which backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// `VK_EXT_external_memory_host` on a Vulkan device (feature `vulkan`).
    Vulkan,
    /// `cuMemHostRegister` in a CUDA context (feature `cuda`).
    Cuda,
    /// No GPU: the pages are locked in memory (`mlock`; `VirtualLock` on Windows).
    Pin,
}

impl BackendKind {
    /// Its name (the one `EMUHOST_IMPORT_BACKEND` takes).
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Vulkan => "vulkan",
            BackendKind::Cuda => "cuda",
            BackendKind::Pin => "pin",
        }
    }
}

/// Host bytes `addr..addr + len` of a space's guest window, held mapped while the span lives
/// ([`Space::hold`]): the space is not dropped and the pages are not decommitted or remapped under
/// it. A backend keeps the span in its import, so the pages outlive the import made of them.
#[derive(Debug)]
pub struct HostSpan {
    addr: usize,
    len: usize,
    hold: Hold,
}

impl HostSpan {
    /// The host bytes of the guest range `lo..lo + len` of `space` (checked to lie in its
    /// window), held until the span is dropped.
    ///
    /// # Errors
    /// [`ImportError::Space`]: the range is unaligned, empty or outside the window
    /// ([`SpaceError::OutOfWindow`](crate::space::SpaceError::OutOfWindow), ...).
    pub fn of(space: &Arc<Space>, lo: u64, len: u64) -> Result<HostSpan, ImportError> {
        let r = space.range(lo, len)?;
        let hold = space.hold(r)?;
        Ok(HostSpan { addr: space.host_addr(r.start())?, len: r.len() as usize, hold })
    }

    /// The guest range held.
    pub fn guest(&self) -> crate::space::GuestRange {
        self.hold.range()
    }

    /// The host address of the first byte.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes (never, for a span made by [`HostSpan::of`]).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn check_aligned(&self, align: u64) -> Result<(), ImportError> {
        if !(self.addr as u64).is_multiple_of(align) || !(self.len as u64).is_multiple_of(align) || self.len == 0 {
            return Err(ImportError::Unaligned { addr: self.addr as u64, len: self.len as u64, align });
        }
        Ok(())
    }
}

/// A backend's limits and what is in use against them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Live imports at most (Vulkan: `maxMemoryAllocationCount`).
    pub max_count: u64,
    /// Live imported bytes at most (Vulkan: the memory heap's size).
    pub max_bytes: u64,
    /// One import's bytes at most (Vulkan: `maxMemoryAllocationSize`).
    pub max_single: u64,
    /// Live imports now.
    pub count: u64,
    /// Live imported bytes now.
    pub bytes: u64,
}

impl Default for Budget {
    fn default() -> Self {
        Self { max_count: u64::MAX, max_bytes: u64::MAX, max_single: u64::MAX, count: 0, bytes: 0 }
    }
}

impl Budget {
    /// Takes one import of `len` bytes, or says which limit it would pass.
    ///
    /// # Errors
    /// [`ImportError::Budget`] naming the limit (one import's size, live imports, live imported
    /// bytes); nothing is taken then.
    pub fn take(&mut self, len: u64) -> Result<(), ImportError> {
        if len > self.max_single {
            return Err(ImportError::Budget { what: "one import's size", need: len, used: 0, limit: self.max_single });
        }
        if self.count >= self.max_count {
            return Err(ImportError::Budget { what: "live imports", need: 1, used: self.count, limit: self.max_count });
        }
        if self.bytes.saturating_add(len) > self.max_bytes {
            return Err(ImportError::Budget {
                what: "live imported bytes",
                need: len,
                used: self.bytes,
                limit: self.max_bytes,
            });
        }
        self.count += 1;
        self.bytes += len;
        Ok(())
    }

    /// Gives back one import of `len` bytes taken before.
    pub fn give(&mut self, len: u64) {
        self.count -= 1;
        self.bytes -= len;
    }
}

/// A budget behind a lock (backends are shared between threads).
#[derive(Debug, Default)]
pub struct BudgetCell(Mutex<Budget>);

impl BudgetCell {
    /// A cell holding `b`.
    pub fn new(b: Budget) -> Self {
        Self(Mutex::new(b))
    }

    /// The budget now (a copy).
    pub fn get(&self) -> Budget {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Budget::take`] under the lock.
    ///
    /// # Errors
    /// As [`Budget::take`].
    pub fn take(&self, len: u64) -> Result<(), ImportError> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take(len)
    }

    /// [`Budget::give`] under the lock.
    pub fn give(&self, len: u64) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).give(len)
    }

    /// Lowers the single-import limit (a device limit set lower, for a test or a cautious run).
    pub fn limit_single(&self, bytes: u64) {
        let mut b = self.0.lock().unwrap_or_else(|p| p.into_inner());
        b.max_single = b.max_single.min(bytes);
    }
}

/// The device objects of an import that a renderer uses, as raw handles: valid while the import
/// lives (the importer releases its imports in [`crate::import::Importer::release_all`], when it
/// is dropped, and, with a backend that refuses a page in two imports (CUDA), at a re-import that
/// takes the import in).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuHandle {
    /// No device object (pin).
    None,
    /// The import's `VkDeviceMemory` and the `VkBuffer` made over all of it (bound at offset 0),
    /// raw (`ash::vk::Handle::from_raw` gives them back).
    Vulkan {
        /// The `VkDeviceMemory`.
        memory: u64,
        /// The `VkBuffer` over all of it.
        buffer: u64,
    },
    /// The import's start as a device pointer (`cuMemHostGetDevicePointer`) in the backend's
    /// context.
    Cuda {
        /// The device pointer of the import's first byte.
        device_ptr: u64,
    },
}

/// What every backend does.
pub trait Backend: Send + Sync {
    /// One live import.
    type Import: Send + Sync + std::fmt::Debug;

    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// The device or method, in words.
    fn describe(&self) -> String;

    /// Host addresses and lengths must be multiples of this (Vulkan:
    /// `minImportedHostPointerAlignment`).
    fn alignment(&self) -> u64;

    /// The backend's limits and their use.
    fn budget(&self) -> &BudgetCell;

    /// Imports `span`. The import keeps the span (its pages stay held) until the driver has let
    /// go of them, and keeps what it needs of the backend (the device) to let go of them itself
    /// when it is dropped.
    fn import(&self, span: HostSpan) -> Result<Self::Import, ImportError>;

    /// Releases an import (never fails: a driver error is logged). Dropping it does the same.
    fn release(&self, import: Self::Import) {
        drop(import)
    }

    /// Copies `len` bytes from `from` at `from_off` to `to` at `to_off` through the GPU and waits.
    /// `Ok(false)` where the backend has no GPU path (pin; Vulkan on the caller's device, whose
    /// queues emuhost does not use). On a CPU driver (lavapipe) the copy is
    /// a CPU store: into a page the guest made not writable it faults as a guest store would.
    fn gpu_copy(
        &self,
        from: &Self::Import,
        from_off: u64,
        to: &Self::Import,
        to_off: u64,
        len: u64,
    ) -> Result<bool, ImportError>;

    /// A backend's own check that an import holds (pin: every page resident).
    fn check(&self, _import: &Self::Import) -> Result<(), ImportError> {
        Ok(())
    }

    /// The import's device objects, for the renderer.
    fn handle(&self, _import: &Self::Import) -> GpuHandle {
        GpuHandle::None
    }

    /// Whether a page may be in two live imports at once. `cuMemHostRegister` refuses pages
    /// registered already (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`), so with CUDA a re-import
    /// first releases the imports it overlaps and takes in their ranges.
    fn overlapping_imports(&self) -> bool {
        true
    }
}

/// The start-up check: import a test range, write it through the CPU, copy it through the GPU
/// into a second import where the backend allows, read the copy back through the CPU, release.
///
/// # Errors
/// [`ImportError::Verify`] saying what did not hold, or the backend's error from an import or
/// copy.
pub fn verify<B: Backend>(b: &B) -> Result<(), ImportError> {
    let name = b.kind().name();
    let fail = |what: String| ImportError::Verify { backend: name, what };
    let align = b.alignment().max(page_size());
    let half = align.max(64 << 10);
    // Room to place two aligned halves whatever the reservation's own alignment.
    let space = Arc::new(Space::with_window(2 * half + align)?);
    let skew = (align - space.host_base() as u64 % align) % align;
    let whole = space.range(skew, 2 * half)?;
    space.commit(whole, Prot::READ_WRITE)?;
    let pattern: Vec<u8> = (0..half).map(|i| (i * 7 + i / 4096) as u8 ^ 0x5a).collect();
    space.write(GuestAddr(skew), &pattern)?;
    // The copy's destination holds other bytes first, written by the CPU: a copy that did not
    // happen cannot pass, and a page the OS tracks by protection (Windows' write watch as Wine
    // implements it) is writable before a CPU driver's own thread (lavapipe's) stores into it.
    let other: Vec<u8> = pattern.iter().map(|b| !b).collect();
    space.write(GuestAddr(skew + half), &other)?;
    let a = b.import(HostSpan::of(&space, skew, half)?)?;
    let dst = HostSpan::of(&space, skew + half, half);
    let outcome = (|| {
        b.check(&a)?;
        let dst = b.import(dst?)?;
        let copied = b.gpu_copy(&a, 0, &dst, 0, half);
        let checked = b.check(&dst);
        b.release(dst);
        checked?;
        let mut back = vec![0u8; half as usize];
        if copied? {
            space.read(GuestAddr(skew + half), &mut back)?;
            if back != pattern {
                let at = back.iter().zip(&pattern).position(|(x, y)| x != y).unwrap_or(0);
                return Err(fail(format!("the GPU's copy differs from the CPU's bytes at offset {at:#x}")));
            }
        } else {
            space.read(GuestAddr(skew), &mut back)?;
            if back != pattern {
                return Err(fail("the bytes changed under the import".into()));
            }
        }
        Ok(())
    })();
    b.release(a);
    outcome
}

/// The choice of `EMUHOST_IMPORT_BACKEND`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// Vulkan, then CUDA, then pin: the first that opens and passes its start-up check.
    Auto,
    /// This backend only: an error where it does not open or fails its check.
    Only(BackendKind),
}

/// Any of the backends, chosen at run time.
#[derive(Debug)]
pub enum AnyBackend {
    /// Vulkan.
    Vulkan(Box<Vulkan>),
    /// CUDA.
    Cuda(Cuda),
    /// Pin (no GPU).
    Pin(Pin),
}

/// An import of [`AnyBackend`].
#[derive(Debug)]
pub enum AnyImport {
    /// A Vulkan import.
    Vulkan(<Vulkan as Backend>::Import),
    /// A CUDA import.
    Cuda(<Cuda as Backend>::Import),
    /// A pinned range.
    Pin(<Pin as Backend>::Import),
}

/// The backend picked, and why the ones before it were passed over.
#[derive(Debug)]
pub struct Picked {
    /// The backend opened.
    pub backend: AnyBackend,
    /// Each backend tried before and not taken, with the reason.
    pub passed_over: Vec<(BackendKind, String)>,
}

impl AnyBackend {
    /// Opens one backend and runs its start-up check.
    ///
    /// # Errors
    /// [`ImportError::Unavailable`] where the backend cannot open here (no driver, no device,
    /// built without its feature), a driver's error ([`ImportError::Vulkan`],
    /// [`ImportError::Cuda`]) from opening, or the start-up check's ([`verify`]).
    pub fn open(kind: BackendKind) -> Result<AnyBackend, ImportError> {
        let b = match kind {
            BackendKind::Vulkan => AnyBackend::Vulkan(Box::new(Vulkan::open()?)),
            BackendKind::Cuda => AnyBackend::Cuda(Cuda::open()?),
            BackendKind::Pin => AnyBackend::Pin(Pin::new()),
        };
        // Injected faults are for what comes after start-up: one here would only pass the
        // backend over.
        crate::faults::unfaulted(|| verify(&b))?;
        Ok(b)
    }

    /// Opens what `choice` says: one backend, or for `Auto` Vulkan, then CUDA, then pin.
    ///
    /// # Errors
    /// As [`AnyBackend::open`] for [`BackendChoice::Only`]; with `Auto` only where even pin
    /// fails (the others are [`Picked::passed_over`]).
    pub fn pick(choice: BackendChoice) -> Result<Picked, ImportError> {
        match choice {
            BackendChoice::Only(kind) => Ok(Picked { backend: AnyBackend::open(kind)?, passed_over: Vec::new() }),
            BackendChoice::Auto => {
                let mut passed_over = Vec::new();
                for kind in [BackendKind::Vulkan, BackendKind::Cuda] {
                    match AnyBackend::open(kind) {
                        Ok(backend) => return Ok(Picked { backend, passed_over }),
                        Err(e) => passed_over.push((kind, error_chain(&e))),
                    }
                }
                Ok(Picked { backend: AnyBackend::open(BackendKind::Pin)?, passed_over })
            }
        }
    }
}

macro_rules! each {
    ($self:expr, $b:ident => $e:expr) => {
        match $self {
            AnyBackend::Vulkan($b) => $e,
            AnyBackend::Cuda($b) => $e,
            AnyBackend::Pin($b) => $e,
        }
    };
}

impl Backend for AnyBackend {
    type Import = AnyImport;

    fn kind(&self) -> BackendKind {
        each!(self, b => b.kind())
    }

    fn describe(&self) -> String {
        each!(self, b => b.describe())
    }

    fn alignment(&self) -> u64 {
        each!(self, b => b.alignment())
    }

    fn budget(&self) -> &BudgetCell {
        each!(self, b => b.budget())
    }

    fn overlapping_imports(&self) -> bool {
        each!(self, b => b.overlapping_imports())
    }

    fn import(&self, span: HostSpan) -> Result<AnyImport, ImportError> {
        Ok(match self {
            AnyBackend::Vulkan(b) => AnyImport::Vulkan(b.import(span)?),
            AnyBackend::Cuda(b) => AnyImport::Cuda(b.import(span)?),
            AnyBackend::Pin(b) => AnyImport::Pin(b.import(span)?),
        })
    }

    fn release(&self, import: AnyImport) {
        match (self, import) {
            (AnyBackend::Vulkan(b), AnyImport::Vulkan(i)) => b.release(i),
            (AnyBackend::Cuda(b), AnyImport::Cuda(i)) => b.release(i),
            (AnyBackend::Pin(b), AnyImport::Pin(i)) => b.release(i),
            (b, i) => tracing::error!("import {i:?} released on the {} backend, not its own", b.kind().name()),
        }
    }

    fn gpu_copy(&self, from: &AnyImport, fo: u64, to: &AnyImport, to_off: u64, len: u64) -> Result<bool, ImportError> {
        match (self, from, to) {
            (AnyBackend::Vulkan(b), AnyImport::Vulkan(f), AnyImport::Vulkan(t)) => b.gpu_copy(f, fo, t, to_off, len),
            (AnyBackend::Cuda(b), AnyImport::Cuda(f), AnyImport::Cuda(t)) => b.gpu_copy(f, fo, t, to_off, len),
            (AnyBackend::Pin(b), AnyImport::Pin(f), AnyImport::Pin(t)) => b.gpu_copy(f, fo, t, to_off, len),
            _ => Err(ImportError::Verify { backend: self.kind().name(), what: "imports of another backend".into() }),
        }
    }

    fn handle(&self, import: &AnyImport) -> GpuHandle {
        match (self, import) {
            (AnyBackend::Vulkan(b), AnyImport::Vulkan(i)) => b.handle(i),
            (AnyBackend::Cuda(b), AnyImport::Cuda(i)) => b.handle(i),
            (AnyBackend::Pin(b), AnyImport::Pin(i)) => b.handle(i),
            _ => GpuHandle::None,
        }
    }

    fn check(&self, import: &AnyImport) -> Result<(), ImportError> {
        match (self, import) {
            (AnyBackend::Vulkan(b), AnyImport::Vulkan(i)) => b.check(i),
            (AnyBackend::Cuda(b), AnyImport::Cuda(i)) => b.check(i),
            (AnyBackend::Pin(b), AnyImport::Pin(i)) => b.check(i),
            _ => Err(ImportError::Verify { backend: self.kind().name(), what: "an import of another backend".into() }),
        }
    }
}

/// A shared backend is a backend (several importers, or a test that looks at the budget after
/// the importer is gone).
impl<B: Backend> Backend for std::sync::Arc<B> {
    type Import = B::Import;

    fn kind(&self) -> BackendKind {
        (**self).kind()
    }

    fn describe(&self) -> String {
        (**self).describe()
    }

    fn alignment(&self) -> u64 {
        (**self).alignment()
    }

    fn budget(&self) -> &BudgetCell {
        (**self).budget()
    }

    fn import(&self, span: HostSpan) -> Result<B::Import, ImportError> {
        (**self).import(span)
    }

    fn release(&self, import: B::Import) {
        (**self).release(import)
    }

    fn gpu_copy(&self, f: &B::Import, fo: u64, t: &B::Import, to: u64, len: u64) -> Result<bool, ImportError> {
        (**self).gpu_copy(f, fo, t, to, len)
    }

    fn check(&self, import: &B::Import) -> Result<(), ImportError> {
        (**self).check(import)
    }

    fn handle(&self, import: &B::Import) -> GpuHandle {
        (**self).handle(import)
    }

    fn overlapping_imports(&self) -> bool {
        (**self).overlapping_imports()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_refuses_past_each_limit_and_gives_back() {
        let mut b = Budget { max_count: 2, max_bytes: 100, max_single: 60, count: 0, bytes: 0 };
        assert!(matches!(b.take(61), Err(ImportError::Budget { what: "one import's size", .. })));
        b.take(60).unwrap();
        assert!(matches!(b.take(50), Err(ImportError::Budget { what: "live imported bytes", .. })));
        b.take(40).unwrap();
        assert!(matches!(b.take(0), Err(ImportError::Budget { what: "live imports", .. })));
        b.give(60);
        b.take(50).unwrap();
        assert_eq!((b.count, b.bytes), (2, 90));
    }
}
