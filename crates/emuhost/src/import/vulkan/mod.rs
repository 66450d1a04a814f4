//! Vulkan: guest pages imported as device memory with `VK_EXT_external_memory_host`.
//!
//! The loader (`libvulkan.so.1`) is found at run time (`ash::Entry::load`), so nothing Vulkan is
//! needed to build; the instance is the process's one ([`crate::gpu::vulkan`]), made once and
//! kept, and each backend makes and destroys only its device. The device is the best one
//! offering the extension (discrete GPU, then integrated, virtual, CPU: Mesa's lavapipe on a
//! machine without a GPU). Or the backend is built on the caller's instance and device
//! ([`Vulkan::from_caller`], raw handles and the caller's `vkGetInstanceProcAddr`): emuhost then
//! makes no instance or device, destroys neither, and submits nothing to the caller's queues; the
//! caller keeps the device alive past every import. An import asks
//! `vkGetMemoryHostPointerPropertiesEXT` which memory types can hold the pointer, makes a buffer
//! over the range (`VkExternalMemoryBufferCreateInfo`), and allocates memory of a type both allow
//! with `VkImportMemoryHostPointerInfoEXT`: the driver pins the pages and maps them for the GPU.
//! Pointer and size must be multiples of `minImportedHostPointerAlignment`. The device's limits
//! are kept in a budget: `maxMemoryAllocationCount` live allocations, each heap's size, and
//! `maxMemoryAllocationSize` for one.
//!
//! # Safety
//! This module opts out of the crate's `deny(unsafe_code)`: every Vulkan call is FFI. The handles
//! it passes were made by the same instance and device, which outlive them (the device is kept
//! by the backend and by every import, each an `Arc`: an import frees its memory when dropped, and
//! the last of them to go waits for the device to go idle and destroys it where emuhost made it;
//! the caller's device outlives them by `from_caller`'s contract; a copy refuses imports of
//! another device; the instance is the process's and is never destroyed); the command pool and
//! the queue, which Vulkan requires to be externally synchronized, are used only under one lock;
//! and a host pointer given to the driver lies in a mapping that stays mapped until the memory
//! made of it is freed (the import keeps its [`HostSpan`], which holds the pages).
//! Every `unsafe` block carries a `// SAFETY:` line.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_void};
use std::sync::{Arc, Mutex};

use ash::vk;

use super::ImportError;
use super::backend::{Backend, BackendKind, Budget, BudgetCell, GpuHandle, HostSpan};

mod device;

const HOST: vk::ExternalMemoryHandleTypeFlags = vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT;

fn vk_err(op: &'static str) -> impl Fn(vk::Result) -> ImportError {
    move |code| ImportError::Vulkan { op, code }
}

fn unavailable(why: impl Into<String>) -> ImportError {
    ImportError::Unavailable { backend: "vulkan", why: why.into() }
}

struct Queue {
    queue: vk::Queue,
    pool: vk::CommandPool,
}

/// The Vulkan backend: one device (its own, of the process's instance, with one queue; or the
/// caller's, [`Vulkan::from_caller`]).
pub struct Vulkan {
    dev: Arc<Device>,
    align: u64,
    name: String,
    driver: String,
}

/// The device and what its imports share with the backend. The backend and every import keep it
/// (an import frees its memory on it when dropped), so it goes after the last of them.
struct Device {
    device: ash::Device,
    host_ptr: ash::ext::external_memory_host::Device,
    /// The queue of a device emuhost made; none on the caller's (its queues are the caller's to
    /// synchronise: emuhost submits nothing there).
    queue: Option<Mutex<Queue>>,
    memory: vk::PhysicalDeviceMemoryProperties,
    heap_used: Mutex<Vec<u64>>,
    budget: BudgetCell,
    /// The usage of the buffer made over each import.
    usage: vk::BufferUsageFlags,
    /// Whether emuhost made the device, and so destroys it.
    owned: bool,
}

impl std::fmt::Debug for Vulkan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vulkan").field("device", &self.name).field("align", &self.align).finish_non_exhaustive()
    }
}

/// The caller's Vulkan objects an importer is built on ([`Vulkan::from_caller`]): emuhost makes
/// no instance or device then, and submits nothing to the device's queues.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub struct CallerDevice<'a> {
    /// The caller's `vkGetInstanceProcAddr` (an embedder may load Vulkan its own way).
    pub get_instance_proc_addr: vk::PFN_vkGetInstanceProcAddr,
    /// The caller's `VkInstance`.
    pub instance: vk::Instance,
    /// The physical device `device` was made on.
    pub physical_device: vk::PhysicalDevice,
    /// The caller's `VkDevice`, made with `VK_EXT_external_memory_host`.
    pub device: vk::Device,
    /// The extensions the device was created with: `VK_EXT_external_memory_host` must be one.
    pub enabled_extensions: &'a [&'a CStr],
    /// The usage of the `VkBuffer` made over each import (default: transfer source and
    /// destination). The buffer is made with `VkExternalMemoryBufferCreateInfo` (host allocation).
    pub buffer_usage: vk::BufferUsageFlags,
}

impl std::fmt::Debug for CallerDevice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use ash::vk::Handle as _;
        f.debug_struct("CallerDevice")
            .field("instance", &format_args!("{:#x}", self.instance.as_raw()))
            .field("physical_device", &format_args!("{:#x}", self.physical_device.as_raw()))
            .field("device", &format_args!("{:#x}", self.device.as_raw()))
            .field("enabled_extensions", &self.enabled_extensions)
            .field("buffer_usage", &format_args!("{:#x}", self.buffer_usage.as_raw()))
            .finish_non_exhaustive()
    }
}

impl<'a> CallerDevice<'a> {
    /// The caller's objects, with the default buffer usage (transfer source and destination).
    /// Nothing is checked or called here: [`Vulkan::from_caller`] does.
    pub fn new(
        get_instance_proc_addr: vk::PFN_vkGetInstanceProcAddr,
        instance: vk::Instance,
        physical_device: vk::PhysicalDevice,
        device: vk::Device,
        enabled_extensions: &'a [&'a CStr],
    ) -> Self {
        Self {
            get_instance_proc_addr,
            instance,
            physical_device,
            device,
            enabled_extensions,
            buffer_usage: vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::TRANSFER_DST,
        }
    }

    /// The usage of the buffer made over each import.
    pub fn buffer_usage(mut self, usage: vk::BufferUsageFlags) -> Self {
        self.buffer_usage = usage;
        self
    }
}

/// Device memory made of a host range, and a buffer over it: freed when dropped.
pub struct VulkanImport {
    dev: Arc<Device>,
    /// Holds the pages until the memory made of them is freed (dropped after `Drop::drop`).
    span: HostSpan,
    memory: vk::DeviceMemory,
    buffer: vk::Buffer,
    len: u64,
    heap: usize,
    /// The memory type chosen.
    pub memory_type: u32,
    /// `memoryTypeBits` from `vkGetMemoryHostPointerPropertiesEXT`.
    pub host_type_bits: u32,
}

impl VulkanImport {
    /// The `VkDeviceMemory` made of the range (valid while the import lives).
    pub fn memory(&self) -> vk::DeviceMemory {
        self.memory
    }

    /// The `VkBuffer` over the whole range, bound at offset 0 (valid while the import lives).
    pub fn buffer(&self) -> vk::Buffer {
        self.buffer
    }
}

impl std::fmt::Debug for VulkanImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VulkanImport")
            .field("span", &self.span)
            .field("memory_type", &self.memory_type)
            .finish_non_exhaustive()
    }
}

impl Drop for VulkanImport {
    fn drop(&mut self) {
        let t = std::time::Instant::now();
        self.dev.destroy_buffer(self.buffer);
        // SAFETY: the memory was made by this device, which `self.dev` keeps alive; its buffer is
        // gone and no command of emuhost's is pending (copies wait for their fence; on the
        // caller's device, the caller's commands are the caller's to have finished).
        unsafe { self.dev.device.free_memory(self.memory, None) };
        let took = t.elapsed();
        if took > std::time::Duration::from_micros(300) {
            tracing::debug!("vulkan release of {} KiB: {:.2} ms", self.len >> 10, took.as_secs_f64() * 1e3);
        }
        self.dev.give_heap(self.heap, self.len);
        self.dev.budget.give(self.len);
    }
}

struct Chosen {
    pd: vk::PhysicalDevice,
    family: u32,
}

/// What the import needs to know of a physical device.
struct Limits {
    align: u64,
    memory: vk::PhysicalDeviceMemoryProperties,
    budget: Budget,
    name: String,
    driver: String,
}

impl Vulkan {
    /// Makes a device with `VK_EXT_external_memory_host` from the process's instance (made on
    /// the first call: `gpu::vulkan`).
    pub fn open() -> Result<Vulkan, ImportError> {
        let instance = &crate::gpu::vulkan::shared()?.instance;
        let c = Self::choose(instance)?;
        let limits = Self::limits(instance, c.pd)?;
        let prio = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default().queue_family_index(c.family).queue_priorities(&prio)];
        let exts = [ash::ext::external_memory_host::NAME.as_ptr()];
        let info = vk::DeviceCreateInfo::default().queue_create_infos(&queues).enabled_extension_names(&exts);
        // SAFETY: `info` and what it points to live across the call; `c.pd` came from this instance.
        let device = unsafe { instance.create_device(c.pd, &info, None) }.map_err(vk_err("vkCreateDevice"))?;
        let destroy = |device: &ash::Device| {
            // SAFETY: nothing made from the device lives any more.
            unsafe { device.destroy_device(None) }
        };
        let host_ptr = match Self::host_ptr_fns(instance, &device) {
            Ok(h) => h,
            Err(e) => {
                destroy(&device);
                return Err(e);
            }
        };
        // SAFETY: the family was created with one queue.
        let queue = unsafe { device.get_device_queue(c.family, 0) };
        let pool_info = vk::CommandPoolCreateInfo::default()
            .queue_family_index(c.family)
            .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER | vk::CommandPoolCreateFlags::TRANSIENT);
        // SAFETY: the device is live.
        let pool = match unsafe { device.create_command_pool(&pool_info, None) } {
            Ok(p) => p,
            Err(code) => {
                destroy(&device);
                return Err(ImportError::Vulkan { op: "vkCreateCommandPool", code });
            }
        };
        let usage = vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::TRANSFER_DST;
        Ok(Self::assemble(device, host_ptr, Some(Queue { queue, pool }), limits, usage, true))
    }

    /// An importer's backend on the caller's device: imports are made on `caller.device` and
    /// freed there, each with a buffer of `caller.buffer_usage`; emuhost makes no instance or
    /// device and submits no command ([`Backend::gpu_copy`] says `Ok(false)`). A binding gives the
    /// memory, the buffer and the offset ([`crate::import::Bound`]).
    ///
    /// Refused (`Unavailable`) where `VK_EXT_external_memory_host` is not among
    /// `caller.enabled_extensions`, the physical device is below Vulkan 1.1, or its functions are
    /// missing.
    ///
    /// # Safety
    /// - `get_instance_proc_addr` is the loader's (or a layer's) `vkGetInstanceProcAddr`, and
    ///   `instance`, `physical_device` and `device` are valid handles that belong together: the
    ///   physical device is the instance's and the device was created from it.
    /// - The instance was created with `apiVersion` 1.1 or later, and the device with every
    ///   extension in `enabled_extensions` (the list is what emuhost checks; it cannot ask the
    ///   device what was enabled), among them `VK_EXT_external_memory_host` (it needs
    ///   `VK_KHR_external_memory`, core in Vulkan 1.1).
    /// - The device and instance live until the backend and every import made by it are dropped
    ///   (an import may outlive the importer and the backend: it frees its memory on drop). Drop
    ///   them before `vkDestroyDevice`.
    /// - Vulkan's external synchronisation: the caller destroys no memory or buffer an import
    ///   made (they are freed by the import), has no command using them pending when the import
    ///   is dropped (releases happen in [`crate::import::Importer::release_all`], when the
    ///   importer is dropped, and with a backend that refuses overlapping imports at a re-import),
    ///   and does not call `vkDestroyDevice` while any emuhost call runs.
    pub unsafe fn from_caller(caller: &CallerDevice<'_>) -> Result<Vulkan, ImportError> {
        let host = ash::ext::external_memory_host::NAME;
        if !caller.enabled_extensions.contains(&host) {
            return Err(unavailable(format!(
                "the caller's device was not created with {} (enabled: {:?})",
                host.to_string_lossy(),
                caller.enabled_extensions
            )));
        }
        let static_fn = ash::StaticFn { get_instance_proc_addr: caller.get_instance_proc_addr };
        // SAFETY: the caller vouches for the function and the instance handle.
        let instance = unsafe { ash::Instance::load(&static_fn, caller.instance) };
        // SAFETY: as above; the name is NUL-terminated.
        let p2 =
            unsafe { (caller.get_instance_proc_addr)(caller.instance, c"vkGetPhysicalDeviceProperties2".as_ptr()) };
        if p2.is_none() {
            return Err(unavailable("the caller's instance has no vkGetPhysicalDeviceProperties2 (Vulkan 1.1)"));
        }
        // SAFETY: the physical device is the instance's (the caller vouches for it).
        let version = unsafe { instance.get_physical_device_properties(caller.physical_device) }.api_version;
        if version < vk::API_VERSION_1_1 {
            return Err(unavailable(format!("the caller's physical device is Vulkan {version:#x}, below 1.1")));
        }
        let limits = Self::limits(&instance, caller.physical_device)?;
        // SAFETY: the device was created from this instance (the caller vouches for it).
        let device = unsafe { ash::Device::load(instance.fp_v1_0(), caller.device) };
        let host_ptr = Self::host_ptr_fns(&instance, &device)?;
        Ok(Self::assemble(device, host_ptr, None, limits, caller.buffer_usage, false))
    }

    /// The best device with the extension, Vulkan 1.1 and a queue (`gpu::vulkan::best`),
    /// or why there is none, naming each device passed over.
    fn choose(instance: &ash::Instance) -> Result<Chosen, ImportError> {
        let mut seen = Vec::new();
        let best = crate::gpu::vulkan::best(instance, |pd, props| {
            let name = props.device_name_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
            // SAFETY: `pd` came from this instance.
            let exts = unsafe { instance.enumerate_device_extension_properties(pd) }.unwrap_or_default();
            let has = exts.iter().any(|e| e.extension_name_as_c_str() == Ok(ash::ext::external_memory_host::NAME));
            // SAFETY: as above.
            let families = unsafe { instance.get_physical_device_queue_family_properties(pd) };
            let any = vk::QueueFlags::GRAPHICS | vk::QueueFlags::COMPUTE | vk::QueueFlags::TRANSFER;
            let family = families.iter().position(|f| f.queue_count > 0 && f.queue_flags.intersects(any));
            let version = props.api_version;
            let ok = has && version >= vk::API_VERSION_1_1 && family.is_some();
            seen.push(format!(
                "{name} (Vulkan {}.{}{}{})",
                vk::api_version_major(version),
                vk::api_version_minor(version),
                if has { "" } else { ", no VK_EXT_external_memory_host" },
                if family.is_some() { "" } else { ", no queue" }
            ));
            family.filter(|_| ok).map(|f| f as u32)
        })
        .map_err(vk_err("vkEnumeratePhysicalDevices"))?;
        match best {
            Some((pd, family)) => Ok(Chosen { pd, family }),
            None if seen.is_empty() => Err(unavailable("no Vulkan device")),
            None => Err(unavailable(format!("no device with VK_EXT_external_memory_host: {}", seen.join("; ")))),
        }
    }

    /// The physical device's name, driver, import alignment, memory and limits (Vulkan 1.1).
    fn limits(instance: &ash::Instance, pd: vk::PhysicalDevice) -> Result<Limits, ImportError> {
        let mut host = vk::PhysicalDeviceExternalMemoryHostPropertiesEXT::default();
        let mut m3 = vk::PhysicalDeviceMaintenance3Properties::default();
        let mut driver = vk::PhysicalDeviceDriverProperties::default();
        let (limits, version, name) = {
            let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut host).push_next(&mut m3);
            // SAFETY: `pd` came from this instance.
            let v = unsafe { instance.get_physical_device_properties(pd) }.api_version;
            if v >= vk::API_VERSION_1_2 {
                p2 = p2.push_next(&mut driver);
            }
            // SAFETY: `pd` came from this instance (Vulkan 1.1, checked by the callers); the chain
            // lives across the call.
            unsafe { instance.get_physical_device_properties2(pd, &mut p2) };
            let name =
                p2.properties.device_name_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
            (p2.properties.limits, v, name)
        };
        let driver = if version >= vk::API_VERSION_1_2 {
            let n = driver.driver_name_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
            let i = driver.driver_info_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
            format!("{n} {i}").trim().to_string()
        } else {
            String::new()
        };
        let align = host.min_imported_host_pointer_alignment;
        if !align.is_power_of_two() {
            return Err(unavailable(format!("minImportedHostPointerAlignment {align:#x} is not a power of two")));
        }
        // SAFETY: `pd` came from this instance.
        let memory = unsafe { instance.get_physical_device_memory_properties(pd) };
        let heaps = &memory.memory_heaps[..memory.memory_heap_count as usize];
        let largest = heaps.iter().map(|h| h.size).max().unwrap_or(0);
        let budget = Budget {
            max_count: u64::from(limits.max_memory_allocation_count),
            max_bytes: largest,
            max_single: if m3.max_memory_allocation_size > 0 { m3.max_memory_allocation_size } else { u64::MAX },
            count: 0,
            bytes: 0,
        };
        Ok(Limits { align, memory, budget, name, driver })
    }

    /// The extension's device function, checked to be there (calling a missing one would abort).
    fn host_ptr_fns(
        instance: &ash::Instance,
        device: &ash::Device,
    ) -> Result<ash::ext::external_memory_host::Device, ImportError> {
        // SAFETY: the device is live and the name is NUL-terminated.
        let f =
            unsafe { instance.get_device_proc_addr(device.handle(), c"vkGetMemoryHostPointerPropertiesEXT".as_ptr()) };
        if f.is_none() {
            return Err(unavailable("vkGetMemoryHostPointerPropertiesEXT is missing"));
        }
        Ok(ash::ext::external_memory_host::Device::new(instance, device))
    }

    fn assemble(
        device: ash::Device,
        host_ptr: ash::ext::external_memory_host::Device,
        queue: Option<Queue>,
        l: Limits,
        usage: vk::BufferUsageFlags,
        owned: bool,
    ) -> Vulkan {
        let heaps = l.memory.memory_heap_count as usize;
        let dev = Device {
            device,
            host_ptr,
            queue: queue.map(Mutex::new),
            memory: l.memory,
            heap_used: Mutex::new(vec![0; heaps]),
            budget: BudgetCell::new(l.budget),
            usage,
            owned,
        };
        Vulkan { dev: Arc::new(dev), align: l.align, name: l.name, driver: l.driver }
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.name
    }
}

impl Backend for Vulkan {
    type Import = VulkanImport;

    fn kind(&self) -> BackendKind {
        BackendKind::Vulkan
    }

    fn describe(&self) -> String {
        let b = self.dev.budget.get();
        format!(
            "{}{} (minImportedHostPointerAlignment {:#x}, maxMemoryAllocationCount {}, largest heap {} MiB)",
            self.name,
            if self.driver.is_empty() { String::new() } else { format!(", {}", self.driver) },
            self.align,
            b.max_count,
            b.max_bytes >> 20
        )
    }

    fn alignment(&self) -> u64 {
        self.align
    }

    fn budget(&self) -> &BudgetCell {
        &self.dev.budget
    }

    fn import(&self, span: HostSpan) -> Result<VulkanImport, ImportError> {
        span.check_aligned(self.align)?;
        let len = span.len() as u64;
        let mut ext = vk::ExternalMemoryBufferCreateInfo::default().handle_types(HOST);
        let info = vk::BufferCreateInfo::default()
            .size(len)
            .usage(self.dev.usage)
            .sharing_mode(vk::SharingMode::EXCLUSIVE)
            .push_next(&mut ext);
        // SAFETY: `info`'s chain lives across the call; the device is live.
        let buffer = unsafe { self.dev.device.create_buffer(&info, None) }.map_err(vk_err("vkCreateBuffer"))?;
        self.dev.import_into(span, buffer).inspect_err(|_| self.dev.destroy_buffer(buffer))
    }

    fn handle(&self, import: &VulkanImport) -> GpuHandle {
        use ash::vk::Handle as _;
        GpuHandle::Vulkan { memory: import.memory.as_raw(), buffer: import.buffer.as_raw() }
    }

    fn gpu_copy(
        &self,
        from: &VulkanImport,
        from_off: u64,
        to: &VulkanImport,
        to_off: u64,
        len: u64,
    ) -> Result<bool, ImportError> {
        // Another device's buffers are not this device's to use.
        if !Arc::ptr_eq(&from.dev, &self.dev) || !Arc::ptr_eq(&to.dev, &self.dev) {
            return Err(ImportError::Verify {
                backend: "vulkan",
                what: "a copy of an import of another device".into(),
            });
        }
        let inside = |off: u64, i: &VulkanImport| off.checked_add(len).is_some_and(|e| e <= i.len);
        if len == 0 || !inside(from_off, from) || !inside(to_off, to) {
            return Err(ImportError::Verify {
                backend: "vulkan",
                what: format!("copy of {len:#x} bytes out of range"),
            });
        }
        self.dev.copy(from.buffer, to.buffer, vk::BufferCopy { src_offset: from_off, dst_offset: to_off, size: len })
    }
}

impl From<crate::gpu::vulkan::InstanceError> for ImportError {
    fn from(e: crate::gpu::vulkan::InstanceError) -> Self {
        use crate::gpu::vulkan::InstanceError;
        match e {
            InstanceError::Loader(e) => {
                ImportError::Unavailable { backend: "vulkan", why: format!("no Vulkan loader: {e}") }
            }
            InstanceError::Vulkan { op, code } => ImportError::Vulkan { op, code },
        }
    }
}

/// The rule of every test that needs a Vulkan device, shared with the integration tests.
#[cfg(test)]
#[path = "../../../tests/support/vulkan.rs"]
mod vulkan_gate;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::vulkan::{Shared, instances_made, shared};

    /// Backends made and dropped one after another (and beside the other tests' ones) share one
    /// instance (the process's, `gpu::vulkan`): with an instance each, the loader unloads and
    /// reloads every driver per backend, and NVIDIA's refused the 31st. Forty in a row pass that
    /// count.
    #[test]
    fn backends_share_one_instance_for_the_process() {
        let Some(first) = vulkan_gate::vulkan_or_skip(Vulkan::open()) else { return };
        drop(first);
        for i in 1..40 {
            if let Err(e) = Vulkan::open() {
                panic!("backend {} of 40 failed: {e}", i + 1);
            }
        }
        assert_eq!(instances_made(), 1);
        let a: *const Shared = shared().unwrap();
        let b: *const Shared = shared().unwrap();
        assert_eq!(a, b);
    }
}
