//! Vulkan: guest pages imported as device memory with `VK_EXT_external_memory_host`.
//!
//! The loader (`libvulkan.so.1`) is found at run time (`ash::Entry::load`), so nothing Vulkan is
//! needed to build; the instance is the process's one ([`super::vk_instance`]), made once and
//! kept, and each backend makes and destroys only its device. The device is the best one
//! offering the extension (discrete GPU, then integrated, virtual, CPU: Mesa's lavapipe on a
//! machine without a GPU). An import asks `vkGetMemoryHostPointerPropertiesEXT` which memory
//! types can hold the pointer, makes a transfer buffer over the range
//! (`VkExternalMemoryBufferCreateInfo`), and allocates memory of a type both allow with
//! `VkImportMemoryHostPointerInfoEXT`: the driver pins the pages and maps them for the GPU.
//! Pointer and size must be multiples of `minImportedHostPointerAlignment`. The device's limits
//! are kept in a budget: `maxMemoryAllocationCount` live allocations, each heap's size, and
//! `maxMemoryAllocationSize` for one.
//!
//! # Safety
//! This module opts out of the crate's `deny(unsafe_code)`: every Vulkan call is FFI. The handles
//! it passes were made by the same instance and device, which outlive them (the device is kept
//! by the backend and by every import, each an `Arc`: an import frees its memory when dropped, and
//! the last of them to go waits for the device to go idle and destroys it; a copy refuses imports
//! of another device; the instance is the process's and is never destroyed); the command pool and the queue, which Vulkan requires to be externally
//! synchronized, are used only under one lock; and a host pointer given to the driver lies in a
//! mapping that stays mapped until the memory made of it is freed (the import keeps its
//! [`HostSpan`], which holds the pages).
//! Every `unsafe` block carries a `// SAFETY:` line.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use ash::vk;

use super::ImportError;
use super::backend::{Backend, BackendKind, Budget, BudgetCell, HostSpan};
use super::vk_instance::InstanceError;

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

/// The Vulkan backend: one device (of the process's instance) and one queue.
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
    queue: Mutex<Queue>,
    memory: vk::PhysicalDeviceMemoryProperties,
    heap_used: Mutex<Vec<u64>>,
    budget: BudgetCell,
}

impl std::fmt::Debug for Vulkan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vulkan").field("device", &self.name).field("align", &self.align).finish_non_exhaustive()
    }
}

/// Device memory made of a host range, and a transfer buffer over it: freed when dropped.
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
        self.dev.destroy_buffer(self.buffer);
        // SAFETY: the memory was made by this device, which `self.dev` keeps alive; its buffer is
        // gone and no command is pending (copies wait for their fence).
        unsafe { self.dev.device.free_memory(self.memory, None) };
        self.dev.give_heap(self.heap, self.len);
        self.dev.budget.give(self.len);
    }
}

/// The order devices are preferred in: discrete, integrated, virtual, CPU (lavapipe), other.
pub(crate) fn rank(t: vk::PhysicalDeviceType) -> u32 {
    match t {
        vk::PhysicalDeviceType::DISCRETE_GPU => 0,
        vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
        vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
        vk::PhysicalDeviceType::CPU => 3,
        _ => 4,
    }
}

struct Chosen {
    pd: vk::PhysicalDevice,
    family: u32,
    name: String,
}

impl Vulkan {
    /// Makes a device with `VK_EXT_external_memory_host` from the process's instance (made on
    /// the first call: `import::vk_instance`).
    pub fn open() -> Result<Vulkan, ImportError> {
        let shared = super::vk_instance::shared().map_err(|e| match e {
            InstanceError::Loader(e) => unavailable(format!("no Vulkan loader: {e}")),
            InstanceError::Vulkan { op, code } => ImportError::Vulkan { op, code },
        })?;
        let parts = Self::with_instance(&shared.instance)?;
        Ok(Self::assemble(parts))
    }

    fn choose(instance: &ash::Instance) -> Result<Chosen, ImportError> {
        // SAFETY: the instance is live.
        let pds = unsafe { instance.enumerate_physical_devices() }.map_err(vk_err("vkEnumeratePhysicalDevices"))?;
        let mut best: Option<(u32, Chosen)> = None;
        let mut seen = Vec::new();
        for pd in pds {
            // SAFETY: `pd` came from this instance.
            let props = unsafe { instance.get_physical_device_properties(pd) };
            let name = props.device_name_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
            // SAFETY: as above.
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
            if let (true, Some(family)) = (ok, family) {
                let r = rank(props.device_type);
                if best.as_ref().is_none_or(|(b, _)| r < *b) {
                    best = Some((r, Chosen { pd, family: family as u32, name }));
                }
            }
        }
        match best {
            Some((_, c)) => Ok(c),
            None if seen.is_empty() => Err(unavailable("no Vulkan device")),
            None => Err(unavailable(format!("no device with VK_EXT_external_memory_host: {}", seen.join("; ")))),
        }
    }

    fn with_instance(instance: &ash::Instance) -> Result<Parts, ImportError> {
        let c = Self::choose(instance)?;
        let mut host = vk::PhysicalDeviceExternalMemoryHostPropertiesEXT::default();
        let mut m3 = vk::PhysicalDeviceMaintenance3Properties::default();
        let mut driver = vk::PhysicalDeviceDriverProperties::default();
        let (limits, version) = {
            let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut host).push_next(&mut m3);
            // The driver properties are core in 1.2; ask only there.
            // SAFETY: `c.pd` came from this instance.
            let v = unsafe { instance.get_physical_device_properties(c.pd) }.api_version;
            if v >= vk::API_VERSION_1_2 {
                p2 = p2.push_next(&mut driver);
            }
            // SAFETY: `p2`'s chain points to structures that live across the call.
            unsafe { instance.get_physical_device_properties2(c.pd, &mut p2) };
            (p2.properties.limits, v)
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
        // SAFETY: `c.pd` came from this instance.
        let memory = unsafe { instance.get_physical_device_memory_properties(c.pd) };
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
        // SAFETY: the device is live and the name is NUL-terminated.
        let f =
            unsafe { instance.get_device_proc_addr(device.handle(), c"vkGetMemoryHostPointerPropertiesEXT".as_ptr()) };
        if f.is_none() {
            destroy(&device);
            return Err(unavailable("vkGetMemoryHostPointerPropertiesEXT is missing"));
        }
        let host_ptr = ash::ext::external_memory_host::Device::new(instance, &device);
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
        let heaps = &memory.memory_heaps[..memory.memory_heap_count as usize];
        let largest = heaps.iter().map(|h| h.size).max().unwrap_or(0);
        let budget = Budget {
            max_count: u64::from(limits.max_memory_allocation_count),
            max_bytes: largest,
            max_single: if m3.max_memory_allocation_size > 0 { m3.max_memory_allocation_size } else { u64::MAX },
            count: 0,
            bytes: 0,
        };
        Ok(Parts { device, host_ptr, queue: Queue { queue, pool }, align, memory, budget, name: c.name, driver })
    }

    fn assemble(p: Parts) -> Vulkan {
        let heaps = p.memory.memory_heap_count as usize;
        let dev = Device {
            device: p.device,
            host_ptr: p.host_ptr,
            queue: Mutex::new(p.queue),
            memory: p.memory,
            heap_used: Mutex::new(vec![0; heaps]),
            budget: BudgetCell::new(p.budget),
        };
        Vulkan { dev: Arc::new(dev), align: p.align, name: p.name, driver: p.driver }
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.name
    }
}

impl Device {
    /// The memory type for a pointer allowed `host_bits` and a buffer allowed `buffer_bits`:
    /// host-visible and coherent where one is, else the lowest allowed.
    fn memory_type(&self, bits: u32) -> Option<u32> {
        let types = &self.memory.memory_types[..self.memory.memory_type_count as usize];
        let want = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        let allowed = |i: usize| bits & (1 << i) != 0;
        (0..types.len())
            .find(|&i| allowed(i) && types[i].property_flags.contains(want))
            .or_else(|| (0..types.len()).find(|&i| allowed(i)))
            .map(|i| i as u32)
    }

    fn take_heap(&self, heap: usize, len: u64) -> Result<(), ImportError> {
        let mut used = self.heap_used.lock().unwrap_or_else(|p| p.into_inner());
        let size = self.memory.memory_heaps[heap].size;
        if used[heap].saturating_add(len) > size {
            return Err(ImportError::Budget { what: "the memory heap", need: len, used: used[heap], limit: size });
        }
        used[heap] += len;
        Ok(())
    }

    fn give_heap(&self, heap: usize, len: u64) {
        self.heap_used.lock().unwrap_or_else(|p| p.into_inner())[heap] -= len;
    }

    fn destroy_buffer(&self, buffer: vk::Buffer) {
        // SAFETY: the buffer was made by this device and no command using it is pending (copies
        // wait for their fence).
        unsafe { self.device.destroy_buffer(buffer, None) };
    }

    fn import_into(self: &Arc<Self>, span: HostSpan, buffer: vk::Buffer) -> Result<VulkanImport, ImportError> {
        let len = span.len() as u64;
        let ptr = span.addr() as *mut c_void;
        let mut props = vk::MemoryHostPointerPropertiesEXT::default();
        // SAFETY: the function was found on this device (checked at open); `ptr` is aligned to
        // minImportedHostPointerAlignment (checked by the caller); `props` lives across the call.
        let r = unsafe {
            (self.host_ptr.fp().get_memory_host_pointer_properties_ext)(self.device.handle(), HOST, ptr, &mut props)
        };
        if r != vk::Result::SUCCESS {
            return Err(ImportError::Vulkan { op: "vkGetMemoryHostPointerPropertiesEXT", code: r });
        }
        // SAFETY: the buffer was made by this device.
        let req = unsafe { self.device.get_buffer_memory_requirements(buffer) };
        let bits = props.memory_type_bits & req.memory_type_bits;
        let t = self.memory_type(bits).ok_or_else(|| {
            unavailable(format!(
                "no memory type both for the pointer ({:#x}) and the buffer ({:#x})",
                props.memory_type_bits, req.memory_type_bits
            ))
        })?;
        let heap = self.memory.memory_types[t as usize].heap_index as usize;
        self.budget.take(len)?;
        if let Err(e) = self.take_heap(heap, len) {
            self.budget.give(len);
            return Err(e);
        }
        let give = || {
            self.give_heap(heap, len);
            self.budget.give(len);
        };
        let mut import = vk::ImportMemoryHostPointerInfoEXT::default().handle_type(HOST).host_pointer(ptr);
        let alloc = vk::MemoryAllocateInfo::default().allocation_size(len).memory_type_index(t).push_next(&mut import);
        let allocated = if crate::faults::fail_import(len) {
            Err(vk::Result::ERROR_OUT_OF_DEVICE_MEMORY)
        } else {
            // SAFETY: `alloc`'s chain lives across the call; the pointer and size are aligned and
            // lie in a mapping that stays mapped until the memory is freed (the import made of it
            // keeps the span, which holds the pages).
            unsafe { self.device.allocate_memory(&alloc, None) }
        };
        let memory = match allocated {
            Ok(m) => m,
            Err(code) => {
                give();
                return Err(ImportError::Vulkan { op: "vkAllocateMemory (host pointer import)", code });
            }
        };
        // SAFETY: buffer and memory were made by this device; the memory's size is the buffer's.
        if let Err(code) = unsafe { self.device.bind_buffer_memory(buffer, memory, 0) } {
            // SAFETY: the memory is bound to nothing and used by no command.
            unsafe { self.device.free_memory(memory, None) };
            give();
            return Err(ImportError::Vulkan { op: "vkBindBufferMemory", code });
        }
        Ok(VulkanImport {
            dev: self.clone(),
            span,
            memory,
            buffer,
            len,
            heap,
            memory_type: t,
            host_type_bits: props.memory_type_bits,
        })
    }

    fn copy(&self, from: vk::Buffer, to: vk::Buffer, region: vk::BufferCopy) -> Result<(), ImportError> {
        let q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let info = vk::CommandBufferAllocateInfo::default()
            .command_pool(q.pool)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(1);
        // SAFETY: the pool is this device's and is used only under the queue lock, held here.
        let cmd =
            unsafe { self.device.allocate_command_buffers(&info) }.map_err(vk_err("vkAllocateCommandBuffers"))?[0];
        // SAFETY: as above; the fence is this device's.
        let fence = match unsafe { self.device.create_fence(&vk::FenceCreateInfo::default(), None) } {
            Ok(f) => f,
            Err(code) => {
                // SAFETY: the command buffer was never submitted.
                unsafe { self.device.free_command_buffers(q.pool, &[cmd]) };
                return Err(ImportError::Vulkan { op: "vkCreateFence", code });
            }
        };
        let run = || -> Result<(), ImportError> {
            let begin = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            // SAFETY: `cmd` is in the initial state, recorded only here, under the queue lock;
            // both buffers are bound to live memory and the region lies inside both (checked by
            // the caller).
            unsafe {
                self.device.begin_command_buffer(cmd, &begin).map_err(vk_err("vkBeginCommandBuffer"))?;
                self.device.cmd_copy_buffer(cmd, from, to, &[region]);
                self.device.end_command_buffer(cmd).map_err(vk_err("vkEndCommandBuffer"))?;
            }
            let cmds = [cmd];
            let submit = vk::SubmitInfo::default().command_buffers(&cmds);
            // SAFETY: the queue is used only under its lock; the fence is unsignalled. Waiting on
            // the fence makes the copy's writes available to the host (a queue submission's
            // completion, observed through a fence, is a host-visible domain operation for
            // coherent memory).
            unsafe {
                self.device.queue_submit(q.queue, &[submit], fence).map_err(vk_err("vkQueueSubmit"))?;
                self.device.wait_for_fences(&[fence], true, u64::MAX).map_err(vk_err("vkWaitForFences"))?;
            }
            Ok(())
        };
        let out = run();
        if out.is_err() {
            // SAFETY: the device is live; waiting makes sure no command still uses the buffer.
            let _ = unsafe { self.device.queue_wait_idle(q.queue) };
        }
        // SAFETY: the command buffer has finished (fence waited or queue idle) and the fence is
        // waited on by nobody else.
        unsafe {
            self.device.free_command_buffers(q.pool, &[cmd]);
            self.device.destroy_fence(fence, None);
        }
        out
    }
}

struct Parts {
    device: ash::Device,
    host_ptr: ash::ext::external_memory_host::Device,
    queue: Queue,
    align: u64,
    memory: vk::PhysicalDeviceMemoryProperties,
    budget: Budget,
    name: String,
    driver: String,
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
            .usage(vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::TRANSFER_DST)
            .sharing_mode(vk::SharingMode::EXCLUSIVE)
            .push_next(&mut ext);
        // SAFETY: `info`'s chain lives across the call; the device is live.
        let buffer = unsafe { self.dev.device.create_buffer(&info, None) }.map_err(vk_err("vkCreateBuffer"))?;
        self.dev.import_into(span, buffer).inspect_err(|_| self.dev.destroy_buffer(buffer))
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
        self.dev.copy(
            from.buffer,
            to.buffer,
            vk::BufferCopy { src_offset: from_off, dst_offset: to_off, size: len },
        )?;
        Ok(true)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let q = self.queue.get_mut().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `&mut self`: the backend and every import (each holding an `Arc` of the device)
        // are gone, so nothing made from the device lives and no other thread uses it; after the
        // wait no command is pending, so the pool and then the device can go, in that order. The
        // instance stays (the process's, [`super::vk_instance`]).
        unsafe {
            let _ = self.device.device_wait_idle();
            self.device.destroy_command_pool(q.pool, None);
            self.device.destroy_device(None);
        }
    }
}
