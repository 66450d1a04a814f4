//! `emuhost_importer_t`: guest memory imported into the GPU (`emuhost::import`), on a device
//! emuhost opens, on the caller's `VkDevice`, or in the caller's CUDA context.

use std::ffi::{CStr, c_char, c_void};
use std::sync::Arc;

use ash::vk::{self, Handle as _};
use emuhost::import::{AnyBackend, Backend, BackendKind, CallerDevice, Cuda, GpuHandle, Importer, PoolId, Vulkan};
use emuhost::settings::Settings;

use crate::entry;
use crate::error::{EMUHOST_ERROR_INVALID_ARGUMENT, Error, emuhost_error_t};
use crate::ffi::{put, put_str, slice, text};
use crate::handle::{self, Kind};
use crate::settings::emuhost_settings_t;
use crate::space::emuhost_space_t;

/// No device object (the pin backend: pages locked in memory, no GPU).
pub const EMUHOST_GPU_NONE: u32 = 0;
/// Vulkan (`VK_EXT_external_memory_host`).
pub const EMUHOST_GPU_VULKAN: u32 = 1;
/// CUDA (`cuMemHostRegister`).
pub const EMUHOST_GPU_CUDA: u32 = 2;

/// An importer (opaque): game pools, chunked and spanned imports, figures.
///
/// Thread safety: every call may be made from any thread, concurrently. The importer keeps its
/// space alive; deleting it releases every import (their `VkDeviceMemory`, `VkBuffer` or
/// registration go), so no GPU work may still use them then.
pub struct emuhost_importer_t {
    _private: [u8; 0],
}

pub(crate) struct Imp(Importer<AnyBackend>);

impl Kind for Imp {
    type C = emuhost_importer_t;
    const NAME: &'static str = "importer";
}

/// A generic function pointer (as `PFN_vkVoidFunction`).
pub type emuhost_fn_t = Option<unsafe extern "C" fn()>;

/// The caller's Vulkan objects (`emuhost_importer_new_vulkan`). Dispatchable handles are passed
/// as pointers (`VkInstance` etc. are pointers in `vulkan.h`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct emuhost_vulkan_device_t {
    /// The caller's `vkGetInstanceProcAddr`, cast to `emuhost_fn_t`.
    pub get_instance_proc_addr: emuhost_fn_t,
    /// `VkInstance`, created with `apiVersion` 1.1 or later.
    pub instance: *mut c_void,
    /// `VkPhysicalDevice` of that instance.
    pub physical_device: *mut c_void,
    /// `VkDevice` created from it, with `VK_EXT_external_memory_host` enabled.
    pub device: *mut c_void,
    /// The names of the extensions the device was created with.
    pub enabled_extensions: *const *const c_char,
    pub enabled_extension_count: u32,
    /// `VkBufferUsageFlags` of the `VkBuffer` made over each import; 0 for transfer source and
    /// destination.
    pub buffer_usage: u32,
}

/// What a binding gives the renderer (`emuhost_importer_bind`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct emuhost_binding_t {
    /// The guest range of the import that covers the binding.
    pub import_lo: u64,
    pub import_hi: u64,
    /// Where the binding's first byte lies in the import's memory (and buffer).
    pub offset: u64,
    /// The binding made a new import (false: an existing one covered it).
    pub made: bool,
    /// The import is a spanned one (grown over the pools across its ends).
    pub spanned: bool,
    /// `EMUHOST_GPU_*`: which of the fields below hold.
    pub gpu: u32,
    /// Vulkan: the import's `VkDeviceMemory` (valid while the import lives).
    pub vk_memory: u64,
    /// Vulkan: the `VkBuffer` over all of the import's memory, bound at offset 0.
    pub vk_buffer: u64,
    /// CUDA: the device pointer of the binding's first byte (offset included).
    pub cuda_ptr: u64,
}

/// The importer's figures (`emuhost_importer_stats`). Times in nanoseconds.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct emuhost_import_stats_t {
    pub imports: u64,
    /// Imports made again over a range a live import covered part of.
    pub reimports: u64,
    /// Bindings an existing import covered.
    pub reuses: u64,
    pub failures: u64,
    /// Spanned imports that failed and were made again without the span.
    pub unspanned_retries: u64,
    /// Bindings refused while their range was cooling.
    pub cooled: u64,
    pub time_ns: u64,
    /// The longest single import.
    pub worst_ns: u64,
    pub live: u64,
    pub live_bytes: u64,
    pub peak_live_bytes: u64,
    pub populated: u64,
    pub populate_failures: u64,
    pub populated_bytes: u64,
    /// Pools policy: bindings that imported only their part of a pool, and the background
    /// thread's imports of those pools whole (`widenings`).
    pub pieces: u64,
    /// Pools policy: the background thread's imports of a pool whole over a binding's part.
    pub widenings: u64,
    /// The most live imports at once (what a driver's cap on live allocations bears on).
    pub peak_live: u64,
    /// The cap on live imports in force (`EMUHOST_IMPORT_MAX_LIVE`; `UINT64_MAX`: none).
    pub max_live: u64,
    /// Bindings that met the cap on live imports.
    pub capped: u64,
    /// At the cap: imports released to make room.
    pub cap_releases: u64,
    /// At the cap: imports merged with a neighbour's range.
    pub cap_merges: u64,
    /// At the cap: bindings that waited for releases under way.
    pub cap_waits: u64,
    /// At the cap: imports made over it because nothing could make room.
    pub over_cap: u64,
    /// Pools policy: imports of a whole pool that replaced its several live imports.
    pub merges: u64,
    /// Imports the merges replaced (released at `emuhost_importer_handles_done`).
    pub merged_away: u64,
    /// Merges asked for and not made.
    pub merges_left: u64,
}

fn make(
    space: *const emuhost_space_t,
    settings: *const emuhost_settings_t,
    out: *mut *mut emuhost_importer_t,
    what: &str,
    backend: impl FnOnce(&Settings) -> Result<AnyBackend, Error>,
) -> Result<(), Error> {
    let s = crate::space::get(space, what)?;
    let settings = crate::settings::read(settings, what)?;
    crate::ffi::check_ptr(out, "the out-pointer")?;
    let backend = backend(&settings)?;
    let imp = Importer::new(s, backend, settings.import_config())?;
    // SAFETY: checked above; the caller vouches that it is writable.
    unsafe { handle::give(out, Arc::new(Imp(imp))) }
}

/// An importer on a device emuhost opens itself, as the settings' `EMUHOST_IMPORT_BACKEND` says
/// (`auto`: Vulkan, then CUDA, then pin). `settings` may be NULL (defaults).
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_importer_new(
    space: *const emuhost_space_t,
    settings: *const emuhost_settings_t,
    out: *mut *mut emuhost_importer_t,
) -> *mut emuhost_error_t {
    entry(|| make(space, settings, out, "emuhost_importer_new", |s| Ok(AnyBackend::pick(s.import_backend)?.backend)))
}

/// An importer on the caller's `VkDevice`: emuhost makes no instance or device, submits nothing
/// to the caller's queues, and frees each import's memory and buffer on that device when the
/// import goes. `settings` may be NULL.
///
/// # Safety
/// - `device` points to a readable `emuhost_vulkan_device_t` whose function and handles are
///   valid and belong together (the physical device is the instance's, the device was created
///   from it with the extensions listed, `VK_EXT_external_memory_host` among them; Vulkan 1.1).
/// - The device and instance outlive the importer (delete it before `vkDestroyDevice`), and no
///   command using an import's memory or buffer is pending when the import is released.
/// - `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_importer_new_vulkan(
    space: *const emuhost_space_t,
    settings: *const emuhost_settings_t,
    device: *const emuhost_vulkan_device_t,
    out: *mut *mut emuhost_importer_t,
) -> *mut emuhost_error_t {
    entry(|| {
        make(space, settings, out, "emuhost_importer_new_vulkan", |_| {
            crate::ffi::check_ptr(device, "device")?;
            // SAFETY: checked non-NULL and aligned; the caller vouches that it is readable.
            let d = unsafe { device.read() };
            let gipa = d.get_instance_proc_addr.ok_or_else(|| {
                Error::new(crate::error::EMUHOST_ERROR_NULL, "device->get_instance_proc_addr is NULL")
            })?;
            for (p, name) in [(d.instance, "instance"), (d.physical_device, "physical_device"), (d.device, "device")] {
                if p.is_null() {
                    return Err(Error::new(crate::error::EMUHOST_ERROR_NULL, format!("device->{name} is NULL")));
                }
            }
            // SAFETY: the caller vouches for the array and each name in it.
            let names = unsafe {
                slice(d.enabled_extensions, d.enabled_extension_count as usize, "device->enabled_extensions")
            }?;
            let mut exts: Vec<&CStr> = Vec::with_capacity(names.len());
            for &n in names {
                // SAFETY: as above; `text` checks NULL.
                unsafe { text(n, "an enabled extension's name") }?;
                // SAFETY: checked non-NULL just above; NUL-terminated as the caller vouches.
                exts.push(unsafe { CStr::from_ptr(n) });
            }
            // SAFETY: `vkGetInstanceProcAddr`'s true signature is `PFN_vkGetInstanceProcAddr`
            // (the caller vouches that this is it); both are function pointers of one size, and the
            // "system" ABI is the C ABI on the targets emuhost builds for.
            let gipa: vk::PFN_vkGetInstanceProcAddr = unsafe { std::mem::transmute::<unsafe extern "C" fn(), _>(gipa) };
            let mut caller = CallerDevice::new(
                gipa,
                vk::Instance::from_raw(d.instance as usize as u64),
                vk::PhysicalDevice::from_raw(d.physical_device as usize as u64),
                vk::Device::from_raw(d.device as usize as u64),
                &exts,
            );
            if d.buffer_usage != 0 {
                caller = caller.buffer_usage(vk::BufferUsageFlags::from_raw(d.buffer_usage));
            }
            // SAFETY: the caller vouches for what `Vulkan::from_caller` asks (this function's
            // contract is the same).
            Ok(AnyBackend::Vulkan(Box::new(unsafe { Vulkan::from_caller(&caller) }?)))
        })
    })
}

/// An importer registering guest memory in the caller's CUDA context (`CUcontext`): emuhost
/// retains and releases nothing. `settings` may be NULL.
///
/// # Safety
/// `context` is a valid `CUcontext` of the `libcuda.so.1` (Windows: `nvcuda.dll`) this process
/// has loaded, and stays valid until the importer is deleted. `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_importer_new_cuda(
    space: *const emuhost_space_t,
    settings: *const emuhost_settings_t,
    context: *mut c_void,
    out: *mut *mut emuhost_importer_t,
) -> *mut emuhost_error_t {
    entry(|| {
        make(space, settings, out, "emuhost_importer_new_cuda", |_| {
            // SAFETY: the caller vouches for the context (NULL is refused by `from_context`).
            Ok(AnyBackend::Cuda(unsafe { Cuda::from_context(context) }?))
        })
    })
}

/// Deletes the importer and releases its imports. NULL does nothing; a handle deleted already is
/// `EMUHOST_ERROR_BAD_HANDLE`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_importer_delete(importer: *mut emuhost_importer_t) -> *mut emuhost_error_t {
    entry(|| handle::delete::<Imp>(importer))
}

fn get(importer: *const emuhost_importer_t, what: &str) -> Result<Arc<Imp>, Error> {
    handle::get::<Imp>(importer, what)
}

/// The importer's backend (`EMUHOST_GPU_*`) and, in `buf` (as `snprintf`; `len` receives the full
/// length, may be NULL), the device or method in words. `buf` may be NULL when `cap` is 0.
///
/// # Safety
/// `gpu` is NULL or writable; `buf` points to `cap` writable bytes; `len` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_importer_backend(
    importer: *const emuhost_importer_t,
    gpu: *mut u32,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> *mut emuhost_error_t {
    entry(|| {
        let imp = get(importer, "emuhost_importer_backend")?;
        let b = imp.0.backend();
        let code = match b.kind() {
            BackendKind::Vulkan => EMUHOST_GPU_VULKAN,
            BackendKind::Cuda => EMUHOST_GPU_CUDA,
            BackendKind::Pin => EMUHOST_GPU_NONE,
        };
        // SAFETY: as the caller vouches.
        unsafe {
            crate::ffi::put_opt(gpu, "gpu", code)?;
            put_str(&format!("{}: {}", b.kind().name(), b.describe()), buf, cap, len, "buf")
        }
    })
}

/// Registers a game pool `lo..lo + size` (pools may overlap); `id` receives its id. A pool that
/// runs past the window's end is `EMUHOST_ERROR_OUT_OF_RANGE`.
///
/// # Safety
/// `id` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_importer_add_pool(
    importer: *const emuhost_importer_t,
    lo: u64,
    size: u64,
    id: *mut u64,
) -> *mut emuhost_error_t {
    entry(|| {
        let imp = get(importer, "emuhost_importer_add_pool")?;
        crate::ffi::check_ptr(id, "id")?;
        let pool = imp.0.add_pool(lo, size)?;
        // SAFETY: as the caller vouches.
        unsafe { put(id, "id", pool.0) }
    })
}

/// Releases a pool. Under the `pools` policy (the default) the imports it overlaps that overlap no
/// other live pool are released with it: be done with their bindings first. Under `chunks` imports
/// stay. An id that is not a live pool is `EMUHOST_ERROR_INVALID_ARGUMENT`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_importer_remove_pool(importer: *const emuhost_importer_t, id: u64) -> *mut emuhost_error_t {
    entry(|| {
        let imp = get(importer, "emuhost_importer_remove_pool")?;
        if imp.0.remove_pool(PoolId(id)) {
            Ok(())
        } else {
            Err(Error::new(EMUHOST_ERROR_INVALID_ARGUMENT, format!("pool {id} is not a live pool of this importer")))
        }
    })
}

/// Binds guest bytes `addr..addr + size`: reuses an import that covers them, or imports their
/// pools (`pools` policy; a part first where the pools would take too long) or their chunks
/// (`chunks`: spanned over the pools across the ends). `out` receives the device objects and the
/// offset. A refused import (the driver failed, or the range is cooling) is
/// `EMUHOST_ERROR_REFUSED`: go on without it. Bytes outside the window are
/// `EMUHOST_ERROR_OUT_OF_RANGE`, and bytes over pages not committed `EMUHOST_ERROR_NOT_COMMITTED`:
/// nothing is tried, and nothing is held cooling.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_importer_bind(
    importer: *const emuhost_importer_t,
    addr: u64,
    size: u64,
    out: *mut emuhost_binding_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let imp = get(importer, "emuhost_importer_bind")?;
        crate::ffi::check_ptr(out, "out")?;
        let b = imp.0.bind(addr, size)?;
        let mut r = emuhost_binding_t {
            import_lo: b.range.lo,
            import_hi: b.range.hi,
            offset: b.offset,
            made: b.made,
            spanned: b.spanned,
            ..Default::default()
        };
        match b.handle {
            GpuHandle::Vulkan { memory, buffer } => {
                (r.gpu, r.vk_memory, r.vk_buffer) = (EMUHOST_GPU_VULKAN, memory, buffer)
            }
            GpuHandle::Cuda { .. } => (r.gpu, r.cuda_ptr) = (EMUHOST_GPU_CUDA, b.cuda_ptr().unwrap_or(0)),
            _ => r.gpu = EMUHOST_GPU_NONE,
        }
        // SAFETY: as the caller vouches.
        unsafe { put(out, "out", r) }
    })
}

/// The importer's figures so far.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_importer_stats(
    importer: *const emuhost_importer_t,
    out: *mut emuhost_import_stats_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let imp = get(importer, "emuhost_importer_stats")?;
        let s = imp.0.stats();
        let ns = |d: std::time::Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        let r = emuhost_import_stats_t {
            imports: s.imports,
            reimports: s.reimports,
            reuses: s.reuses,
            failures: s.failures,
            unspanned_retries: s.unspanned_retries,
            cooled: s.cooled,
            time_ns: ns(s.time),
            worst_ns: ns(s.worst()),
            live: s.live,
            live_bytes: s.live_bytes,
            peak_live_bytes: s.peak_live_bytes,
            populated: s.populated,
            populate_failures: s.populate_failures,
            populated_bytes: s.populated_bytes,
            pieces: s.pieces,
            widenings: s.widenings,
            peak_live: s.peak_live,
            max_live: imp.0.max_live(),
            capped: s.capped,
            cap_releases: s.cap_releases,
            cap_merges: s.cap_merges,
            cap_waits: s.cap_waits,
            over_cap: s.over_cap,
            merges: s.merges,
            merged_away: s.merged_away,
            merges_left: s.merges_left,
        };
        // SAFETY: as the caller vouches.
        unsafe { put(out, "out", r) }
    })
}

/// Tells the importer that the device objects of every binding it gave out before this call are
/// no longer in use (the GPU work that read them has completed): imports that a merge replaced
/// since are released now. Call it where the renderer knows that, e.g. once a frame's work has
/// completed, where it binds again each frame. Without it a replaced import is kept until its
/// pool is removed or `emuhost_importer_release_all`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_importer_handles_done(importer: *const emuhost_importer_t) -> *mut emuhost_error_t {
    entry(|| {
        get(importer, "emuhost_importer_handles_done")?.0.handles_done();
        Ok(())
    })
}

/// Releases every import (their device objects go: no GPU work may still use them).
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_importer_release_all(importer: *const emuhost_importer_t) -> *mut emuhost_error_t {
    entry(|| {
        get(importer, "emuhost_importer_release_all")?.0.release_all();
        Ok(())
    })
}
