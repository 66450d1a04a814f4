//! CUDA: guest pages registered with `cuMemHostRegister` (page-locked and mapped for the device),
//! released with `cuMemHostUnregister`.
//!
//! The driver library (`libcuda.so.1` on Linux, `nvcuda.dll` on Windows, which NVIDIA's display
//! driver installs in `System32`) is loaded at run time with `libloading`: no CUDA SDK is needed
//! to build, and a machine without the driver gets `Unavailable` naming what is missing, never a
//! panic. The entry points are looked up by the names `cuda.h` binds its calls to (the `_v2` ones
//! where its macros select them), the same in both libraries; they are `CUDAAPI` functions,
//! `__stdcall` on Windows, hence `extern "system"` (the C convention on x86-64 either way). The
//! types are `cuda.h`'s for 64-bit builds: `CUdeviceptr` is 64 bits and sizes are `size_t` on
//! both (no `long` is passed, whose size differs on Windows). The calls run in device 0's primary context, pushed on the calling thread around each
//! call (a context is current per thread). An embedder gives its own context instead
//! ([`Cuda::from_context`]): registrations are made there, and a binding gives the device pointer
//! of its bytes ([`crate::import::Bound::cuda_ptr`]). A GPU copy between two registrations goes
//! through their device pointers (`cuMemHostGetDevicePointer`, `cuMemcpyDtoD`), then
//! `cuCtxSynchronize`.
//!
//! # Safety
//! This module opts out of the crate's `deny(unsafe_code)`: every driver call is FFI through
//! function pointers whose C signatures are written out below from the CUDA driver API
//! (`cuda.h`, the `_v2` entry points its macros select). The library stays loaded while the
//! pointers are used and the primary context stays retained while the backend or any import lives
//! (both sit in the driver state that each keeps an `Arc` of), or, with the caller's context
//! ([`Cuda::from_context`]), the caller keeps it alive that long (the constructor's contract); a
//! registration is undone when its import is dropped, and the import keeps its [`HostSpan`],
//! which holds the pages mapped until then. Every `unsafe` block carries a `// SAFETY:` line.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::Arc;

use libloading::Library;

use super::ImportError;
use super::backend::{Backend, BackendKind, Budget, BudgetCell, GpuHandle, HostSpan};
use crate::space::page_size;

type CuResult = c_uint;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuDevicePtr = u64;

const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 0x1;
const CU_MEMHOSTREGISTER_DEVICEMAP: c_uint = 0x2;
/// The driver library's names, tried in order: `libcuda.so.1` (or the development link) on Linux,
/// `nvcuda.dll` on Windows (the loader's search path: `System32`, where the display driver puts it).
const DRIVER: &[&str] = if cfg!(windows) { &["nvcuda.dll"] } else { &["libcuda.so.1", "libcuda.so"] };
/// What `cuMemHostRegister` says when it cannot pin (what an injected import failure says).
const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;

struct Api {
    init: unsafe extern "system" fn(c_uint) -> CuResult,
    device_get: unsafe extern "system" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_name: unsafe extern "system" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    primary_retain: unsafe extern "system" fn(*mut CuContext, CuDevice) -> CuResult,
    primary_release: unsafe extern "system" fn(CuDevice) -> CuResult,
    push: unsafe extern "system" fn(CuContext) -> CuResult,
    ctx_get_device: unsafe extern "system" fn(*mut CuDevice) -> CuResult,
    pop: unsafe extern "system" fn(*mut CuContext) -> CuResult,
    register: unsafe extern "system" fn(*mut c_void, usize, c_uint) -> CuResult,
    unregister: unsafe extern "system" fn(*mut c_void) -> CuResult,
    device_pointer: unsafe extern "system" fn(*mut CuDevicePtr, *mut c_void, c_uint) -> CuResult,
    memcpy_dtod: unsafe extern "system" fn(CuDevicePtr, CuDevicePtr, usize) -> CuResult,
    synchronize: unsafe extern "system" fn() -> CuResult,
    error_name: unsafe extern "system" fn(CuResult, *mut *const c_char) -> CuResult,
}

/// The CUDA backend: device 0's primary context.
pub struct Cuda {
    drv: Arc<Driver>,
    name: String,
}

/// The driver: what the backend and its imports share (an import unregisters itself when
/// dropped, so the context and the library go after the last of them).
struct Driver {
    api: Api,
    ctx: CuContext,
    device: CuDevice,
    /// Whether the context is device 0's primary one, retained here (and released on drop);
    /// not when it is the caller's.
    retained: bool,
    budget: BudgetCell,
    // Last: the function pointers above point into it.
    _lib: Library,
}

// SAFETY: the context handle is an opaque driver pointer that the CUDA driver API allows to be
// made current on any thread (it is pushed and popped around every call); the function pointers
// are plain C functions of a thread-safe driver.
unsafe impl Send for Driver {}
// SAFETY: as above; no method mutates the struct.
unsafe impl Sync for Driver {}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda").field("device", &self.name).finish_non_exhaustive()
    }
}

/// A registered host range: unregistered when dropped.
pub struct CudaImport {
    drv: Arc<Driver>,
    /// Holds the pages until they are unregistered (dropped after `Drop::drop`).
    span: HostSpan,
    device_ptr: CuDevicePtr,
}

impl std::fmt::Debug for CudaImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaImport").field("span", &self.span).field("device_ptr", &self.device_ptr).finish()
    }
}

impl Drop for CudaImport {
    fn drop(&mut self) {
        let p = self.span.addr() as *mut c_void;
        let drv = &self.drv;
        let r = drv.in_context(|| {
            // SAFETY: `p` is the start of a live registration (CudaImport is made only by import)
            // in the context `drv` keeps retained.
            drv.check("cuMemHostUnregister", unsafe { (drv.api.unregister)(p) })
        });
        if let Err(e) = r {
            tracing::warn!("{e}");
        }
        drv.budget.give(self.span.len() as u64);
    }
}

fn unavailable(why: impl Into<String>) -> ImportError {
    ImportError::Unavailable { backend: "cuda", why: why.into() }
}

/// Looks a symbol up as a plain function pointer of type `T`.
///
/// # Safety
/// `T` must be the symbol's true C signature.
unsafe fn sym<T: Copy>(lib: &Library, name: &'static str) -> Result<T, ImportError> {
    let cname = format!("{name}\0");
    // SAFETY: the caller vouches for `T`; the pointer is copied out and used only while `lib`
    // lives (both sit in `Cuda`, the library dropped last).
    unsafe { lib.get::<T>(cname.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| unavailable(format!("the CUDA driver library has no {name}: {e}")))
}

impl Cuda {
    /// Loads the driver (`libcuda.so.1`; `nvcuda.dll` on Windows), initialises it and retains
    /// device 0's primary context.
    pub fn open() -> Result<Cuda, ImportError> {
        let (lib, api) = Self::load()?;
        let check = |op: &'static str, r: CuResult| if r == 0 { Ok(()) } else { Err(Driver::error(&api, op, r)) };
        // SAFETY: plain driver calls with out-pointers to locals that live across them.
        let (device, ctx) = unsafe {
            check("cuInit", (api.init)(0))?;
            let mut device: CuDevice = 0;
            check("cuDeviceGet", (api.device_get)(&mut device, 0))?;
            let mut ctx: CuContext = std::ptr::null_mut();
            check("cuDevicePrimaryCtxRetain", (api.primary_retain)(&mut ctx, device))?;
            (device, ctx)
        };
        let name = Self::name(&api, device);
        let drv = Driver { api, ctx, device, retained: true, budget: BudgetCell::new(Budget::default()), _lib: lib };
        Ok(Cuda { drv: Arc::new(drv), name })
    }

    /// A backend registering in the caller's context `ctx` (a `CUcontext`): emuhost retains and
    /// releases nothing, and pushes `ctx` on the calling thread around each of its driver calls.
    /// A binding gives the device pointer of its bytes in that context
    /// ([`crate::import::Bound::cuda_ptr`]).
    ///
    /// # Safety
    /// `ctx` is a valid CUDA context of the driver library this process has loaded (`libcuda.so.1`,
    /// `nvcuda.dll`), and stays valid
    /// (not destroyed, its primary context not reset or released by its last holder) until the
    /// backend and every import it made are dropped (an import unregisters its pages in `ctx` when
    /// dropped, and may outlive the importer). The caller unregisters no range emuhost registered.
    pub unsafe fn from_context(ctx: *mut c_void) -> Result<Cuda, ImportError> {
        if ctx.is_null() {
            return Err(unavailable("the caller's CUcontext is null"));
        }
        let (lib, api) = Self::load()?;
        let check = |op: &'static str, r: CuResult| if r == 0 { Ok(()) } else { Err(Driver::error(&api, op, r)) };
        // SAFETY: plain driver calls; `ctx` is valid (the caller vouches for it) and is popped
        // again after the device is read.
        let device = unsafe {
            check("cuInit", (api.init)(0))?;
            check("cuCtxPushCurrent", (api.push)(ctx))?;
            let mut device: CuDevice = 0;
            let r = (api.ctx_get_device)(&mut device);
            let mut popped: CuContext = std::ptr::null_mut();
            (api.pop)(&mut popped);
            check("cuCtxGetDevice", r)?;
            device
        };
        let name = Self::name(&api, device);
        let drv = Driver { api, ctx, device, retained: false, budget: BudgetCell::new(Budget::default()), _lib: lib };
        Ok(Cuda { drv: Arc::new(drv), name })
    }

    /// The device's name.
    fn name(api: &Api, device: CuDevice) -> String {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the buffer outlives the call and its length is passed; the driver writes a
        // NUL-terminated name into it on success.
        unsafe {
            if (api.device_get_name)(buf.as_mut_ptr(), buf.len() as c_int, device) == 0 {
                CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
            } else {
                format!("CUDA device {device}")
            }
        }
    }

    /// Loads the driver library and its entry points.
    fn load() -> Result<(Library, Api), ImportError> {
        // SAFETY: loading the CUDA driver library runs its initialisers, as any CUDA program does.
        let lib = unsafe { Library::new(DRIVER[0]) }
            .or_else(|e| {
                let next = DRIVER[1..].iter().find_map(|n| {
                    // SAFETY: as above.
                    unsafe { Library::new(n) }.ok()
                });
                next.ok_or(e)
            })
            .map_err(|e| unavailable(format!("no CUDA driver library ({}): {e}", DRIVER.join(", "))))?;
        // SAFETY: each signature below is the driver API's, from cuda.h.
        let api = unsafe {
            Api {
                init: sym(&lib, "cuInit")?,
                device_get: sym(&lib, "cuDeviceGet")?,
                device_get_name: sym(&lib, "cuDeviceGetName")?,
                primary_retain: sym(&lib, "cuDevicePrimaryCtxRetain")?,
                primary_release: sym(&lib, "cuDevicePrimaryCtxRelease_v2")?,
                push: sym(&lib, "cuCtxPushCurrent_v2")?,
                ctx_get_device: sym(&lib, "cuCtxGetDevice")?,
                pop: sym(&lib, "cuCtxPopCurrent_v2")?,
                register: sym(&lib, "cuMemHostRegister_v2")?,
                unregister: sym(&lib, "cuMemHostUnregister")?,
                device_pointer: sym(&lib, "cuMemHostGetDevicePointer_v2")?,
                memcpy_dtod: sym(&lib, "cuMemcpyDtoD_v2")?,
                synchronize: sym(&lib, "cuCtxSynchronize")?,
                error_name: sym(&lib, "cuGetErrorName")?,
            }
        };
        Ok((lib, api))
    }
}

impl Driver {
    fn error(api: &Api, op: &'static str, code: CuResult) -> ImportError {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string, or fails and leaves it null.
        let name = unsafe {
            if (api.error_name)(code, &mut p) == 0 && !p.is_null() {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            } else {
                "unknown".into()
            }
        };
        ImportError::Cuda { op, code, name }
    }

    fn check(&self, op: &'static str, r: CuResult) -> Result<(), ImportError> {
        if r == 0 { Ok(()) } else { Err(Self::error(&self.api, op, r)) }
    }

    /// Runs `f` with the primary context current on this thread.
    fn in_context<T>(&self, f: impl FnOnce() -> Result<T, ImportError>) -> Result<T, ImportError> {
        // SAFETY: the context is retained for the backend's lifetime.
        self.check("cuCtxPushCurrent", unsafe { (self.api.push)(self.ctx) })?;
        let out = f();
        let mut popped: CuContext = std::ptr::null_mut();
        // SAFETY: pops the context pushed above.
        let r = unsafe { (self.api.pop)(&mut popped) };
        if r != 0 {
            tracing::warn!("cuCtxPopCurrent: {}", Self::error(&self.api, "cuCtxPopCurrent", r));
        }
        out
    }
}

impl Backend for Cuda {
    fn overlapping_imports(&self) -> bool {
        false
    }

    type Import = CudaImport;

    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn describe(&self) -> String {
        format!("{} (cuMemHostRegister)", self.name)
    }

    fn alignment(&self) -> u64 {
        page_size()
    }

    fn budget(&self) -> &BudgetCell {
        &self.drv.budget
    }

    fn import(&self, span: HostSpan) -> Result<CudaImport, ImportError> {
        span.check_aligned(self.alignment())?;
        let len = span.len() as u64;
        let drv = &self.drv;
        drv.budget.take(len)?;
        let p = span.addr() as *mut c_void;
        let out = drv.in_context(|| {
            let flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP;
            let code = if crate::faults::fail_import(len) {
                CUDA_ERROR_OUT_OF_MEMORY
            } else {
                // SAFETY: the range lies in a mapping that stays mapped until it is unregistered
                // (the import made of it keeps the span, which holds the pages); the driver pins
                // it and touches no byte.
                unsafe { (drv.api.register)(p, span.len(), flags) }
            };
            drv.check("cuMemHostRegister", code)?;
            let mut device_ptr: CuDevicePtr = 0;
            // SAFETY: `p` was just registered with DEVICEMAP; the out-pointer is a local.
            let r = unsafe { (drv.api.device_pointer)(&mut device_ptr, p, 0) };
            if r != 0 {
                // SAFETY: unregisters the registration made above.
                unsafe { (drv.api.unregister)(p) };
                return Err(Driver::error(&drv.api, "cuMemHostGetDevicePointer", r));
            }
            Ok(device_ptr)
        });
        match out {
            Ok(device_ptr) => Ok(CudaImport { drv: drv.clone(), span, device_ptr }),
            Err(e) => {
                drv.budget.give(len);
                Err(e)
            }
        }
    }

    fn handle(&self, import: &CudaImport) -> GpuHandle {
        GpuHandle::Cuda { device_ptr: import.device_ptr }
    }

    fn gpu_copy(
        &self,
        from: &CudaImport,
        fo: u64,
        to: &CudaImport,
        to_off: u64,
        len: u64,
    ) -> Result<bool, ImportError> {
        // Another context's device pointers are not this context's to use.
        if !Arc::ptr_eq(&from.drv, &self.drv) || !Arc::ptr_eq(&to.drv, &self.drv) {
            return Err(ImportError::Verify { backend: "cuda", what: "a copy of an import of another context".into() });
        }
        let inside = |off: u64, i: &CudaImport| off.checked_add(len).is_some_and(|e| e <= i.span.len() as u64);
        if len == 0 || !inside(fo, from) || !inside(to_off, to) {
            return Err(ImportError::Verify { backend: "cuda", what: format!("copy of {len:#x} bytes out of range") });
        }
        let drv = &self.drv;
        drv.in_context(|| {
            // SAFETY: both device pointers map live registrations (each import keeps its own) of
            // this backend's context (checked above), where the pointers are valid, and the
            // region lies inside both (checked above); synchronize waits for the copy before the
            // host reads.
            unsafe {
                drv.check(
                    "cuMemcpyDtoD",
                    (drv.api.memcpy_dtod)(to.device_ptr + to_off, from.device_ptr + fo, len as usize),
                )?;
                drv.check("cuCtxSynchronize", (drv.api.synchronize)())
            }
        })?;
        Ok(true)
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // The caller's context is the caller's.
        if !self.retained {
            return;
        }
        // SAFETY: releases the primary context retained at open, after the backend and every
        // import are gone; the library is still loaded.
        unsafe { (self.api.primary_release)(self.device) };
    }
}
