//! The one Vulkan setup of the process, used by the import backend (`import::Vulkan`) and
//! the shader preparation (the `emuhost-prepare` crate): the process's loader and instance, the
//! choice of a physical device ([`best`], by [`rank`]) and the mapping of an instance's failure
//! into each one's error type. An importer built on the caller's device ([`crate::import::Vulkan::from_caller`])
//! uses none of the instance: it loads the caller's functions from the caller's handles.
//!
//! One Vulkan loader and one instance for the whole process, made on first use and kept until
//! the process exits; the import backend and the shader preparation make their devices from it.
//!
//! Why not an instance per backend: destroying an instance makes the loader unload every driver
//! (ICD) it loaded, and the next instance loads them all again. On a machine with Mesa that is
//! some 70 libraries loaded and run per replay (`LD_DEBUG=files`), and on the H200 (NVIDIA
//! 580.159.04) the 31st instance made in one process failed with `VK_ERROR_INCOMPATIBLE_DRIVER`:
//! a soak's replays 31 and on found no Vulkan, and the automatic choice of import backend fell
//! back to CUDA without a word in the figures. A Vulkan program keeps one instance for its life;
//! so does emuhost. It is never destroyed: the OS takes it back at exit, after the last device
//! made from it is gone (a destructor at exit could run while another thread still uses it).
//!
//! # Safety
//! This module opts out of the crate's `deny(unsafe_code)` for the loader's FFI; each `unsafe`
//! block carries a `// SAFETY:` line.
#![allow(unsafe_code)]

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use ash::vk;

/// The process's loader and instance.
pub struct Shared {
    /// Kept for the process's life: the instance's function pointers live in the loader.
    _entry: ash::Entry,
    /// The instance (Vulkan 1.1 to 1.3, as the loader offers; no layer or extension). Never
    /// destroyed: do not call `destroy_instance` on it.
    pub instance: ash::Instance,
}

/// Why the instance could not be made (nothing is kept then: the next call tries again).
///
/// Its fields are `ash`'s: this is the raw layer under the import backend and the shader
/// preparation, each of which maps it into its own error type.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InstanceError {
    /// The Vulkan loader (`libvulkan.so.1`, `vulkan-1.dll`) could not be loaded.
    #[error("no Vulkan loader: {0}")]
    Loader(#[source] ash::LoadingError),
    /// A Vulkan call failed.
    #[error("Vulkan: {op} failed: {code}")]
    Vulkan {
        /// The call (`vkCreateInstance`, `vkEnumerateInstanceVersion`).
        op: &'static str,
        /// What it returned.
        code: vk::Result,
    },
}

static SHARED: Mutex<Option<&'static Shared>> = Mutex::new(None);
static MADE: AtomicU64 = AtomicU64::new(0);

/// The order devices are preferred in: discrete, integrated, virtual, CPU (lavapipe), other.
pub fn rank(t: vk::PhysicalDeviceType) -> u32 {
    match t {
        vk::PhysicalDeviceType::DISCRETE_GPU => 0,
        vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
        vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
        vk::PhysicalDeviceType::CPU => 3,
        _ => 4,
    }
}

/// The best-ranked physical device of `instance` that `fits` accepts (it returns what the caller
/// needs of the device, e.g. its queue family), the first of equals in the loader's order.
/// `fits` sees every device, so a caller can also note why one was passed over. `Ok(None)`
/// where it accepts none.
///
/// # Errors
/// What `vkEnumeratePhysicalDevices` returned where it failed.
pub fn best<T>(
    instance: &ash::Instance,
    mut fits: impl FnMut(vk::PhysicalDevice, &vk::PhysicalDeviceProperties) -> Option<T>,
) -> Result<Option<(vk::PhysicalDevice, T)>, vk::Result> {
    // SAFETY: the instance is live.
    let pds = unsafe { instance.enumerate_physical_devices() }?;
    let mut best: Option<(u32, vk::PhysicalDevice, T)> = None;
    for pd in pds {
        // SAFETY: `pd` came from this instance.
        let props = unsafe { instance.get_physical_device_properties(pd) };
        if let Some(t) = fits(pd, &props) {
            let r = rank(props.device_type);
            if best.as_ref().is_none_or(|(b, _, _)| r < *b) {
                best = Some((r, pd, t));
            }
        }
    }
    Ok(best.map(|(_, pd, t)| (pd, t)))
}

/// The process's instance, made on the first call (later calls return the same one).
///
/// # Errors
/// [`InstanceError`] where there is no loader or the instance cannot be made (no driver, most
/// often); nothing is kept then, and the next call tries again.
///
/// ```
/// use emuhost::gpu::vulkan::{best, rank, shared};
///
/// match shared() {
///     Ok(s) => {
///         assert!(std::ptr::eq(s, shared().unwrap()), "one instance per process");
///         // The best-ranked device, whatever it offers.
///         if let Some((_, ty)) = best(&s.instance, |_, props| Some(props.device_type)).unwrap() {
///             assert!(rank(ty) <= 4);
///         }
///     }
///     Err(e) => println!("no Vulkan here: {e}"),
/// }
/// ```
pub fn shared() -> Result<&'static Shared, InstanceError> {
    let mut slot = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = *slot {
        return Ok(s);
    }
    // SAFETY: loading the system's Vulkan loader runs its initialisers, which is what a Vulkan
    // program does; the library stays loaded for the process's life (the entry is never dropped).
    let entry = unsafe { ash::Entry::load() }.map_err(InstanceError::Loader)?;
    // SAFETY: a global command with no handles.
    let loader = unsafe { entry.try_enumerate_instance_version() }
        .map_err(|code| InstanceError::Vulkan { op: "vkEnumerateInstanceVersion", code })?
        .unwrap_or(vk::API_VERSION_1_0);
    // The loader's version, at least 1.1 (what the import needs), at most 1.3 (what preparation
    // can use).
    let api_version = loader.clamp(vk::API_VERSION_1_1, vk::API_VERSION_1_3);
    let app =
        vk::ApplicationInfo::default().application_name(c"emuhost").engine_name(c"emuhost").api_version(api_version);
    let info = vk::InstanceCreateInfo::default().application_info(&app);
    // SAFETY: `info` and what it points to live across the call; no layer or extension is asked for.
    let instance = unsafe { entry.create_instance(&info, None) }
        .map_err(|code| InstanceError::Vulkan { op: "vkCreateInstance", code })?;
    MADE.fetch_add(1, Relaxed);
    let s: &'static Shared = Box::leak(Box::new(Shared { _entry: entry, instance }));
    *slot = Some(s);
    Ok(s)
}

/// How many instances this process has made: 1 once Vulkan was used, whatever the number of
/// backends and preparations since.
#[cfg(test)]
pub(crate) fn instances_made() -> u64 {
    MADE.load(Relaxed)
}
