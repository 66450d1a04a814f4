//! The driver side: a Vulkan device with a compute queue (no surface, no window), one
//! `VkPipelineCache`, and compute pipelines created from SPIR-V through it.
//!
//! The loader (`libvulkan.so.1`) is opened at run time (`ash::Entry::load`), so the binary starts
//! on a machine without Vulkan and says so only when a preparation asks for it. Creating a compute
//! pipeline is where the driver compiles the SPIR-V to the device's code; with a pipeline cache it
//! first looks the shader up there, and a hit skips the compile. Drivers report the hit through
//! `VkPipelineCreationFeedback` (core in Vulkan 1.3, `VK_EXT_pipeline_creation_feedback` before)
//! where they know it; [`CreateOutcome::cache_hit`] is `None` where they do not say.
//! `vkCreateComputePipelines` is internally synchronized on the cache, so every worker creates
//! through the one cache at once; `vkGetPipelineCacheData` may run beside them and returns what
//! the cache held when it was called.
//!
//! # Safety
//! This module opts out of the crate's `deny(unsafe_code)`: every Vulkan call is FFI. Each
//! `unsafe` block carries a `// SAFETY:` line. What they share: every handle passed was made by
//! the process's instance (never destroyed: `gpu::vulkan`) or this `Driver`'s device and
//! is destroyed only in `Drop` (or, for the objects of one pipeline creation, at the end of
//! `create_compute`, after their last use); every create-info structure and the slices it points
//! to live on the stack until the call returns.
#![allow(unsafe_code)]

use std::ffi::CString;

use ash::vk;

use super::PrepareError;
use super::translate::{BindingKind, Spirv};

/// What the device says about itself, for the log and for checking a cache file's header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's name (`deviceName`).
    pub name: String,
    /// The PCI vendor id (`vendorID`).
    pub vendor_id: u32,
    /// The device id (`deviceID`).
    pub device_id: u32,
    /// The driver's version, encoded as the vendor encodes it (`driverVersion`).
    pub driver_version: u32,
    /// The driver's pipeline cache UUID: a cache made under another UUID is rejected.
    pub pipeline_cache_uuid: [u8; 16],
    /// The Vulkan version the device supports (`apiVersion`, as `VK_MAKE_API_VERSION` encodes it).
    pub api_version: u32,
    /// The most invocations in one workgroup (`maxComputeWorkGroupInvocations`).
    pub max_workgroup_invocations: u32,
    /// The largest workgroup in x, y and z (`maxComputeWorkGroupSize`).
    pub max_workgroup_size: [u32; 3],
    /// Whether pipeline creation reports cache hits (Vulkan 1.3 or the extension).
    pub creation_feedback: bool,
}

/// One pipeline creation's result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreateOutcome {
    /// The driver's word on whether the cache held the pipeline; `None` where it did not say.
    pub cache_hit: Option<bool>,
}

/// A device, its compute queue and the pipeline cache.
pub struct Driver {
    device: ash::Device,
    cache: vk::PipelineCache,
    _queue: vk::Queue,
    pub info: DeviceInfo,
}

fn vkerr(what: &'static str) -> impl Fn(vk::Result) -> PrepareError {
    move |result| PrepareError::Vulkan { what, result }
}

impl Driver {
    /// Opens a device with a compute queue: `index` into the loader's list, or the best one
    /// (discrete GPU, integrated, virtual, CPU) where `None`. Make the cache next
    /// ([`Driver::make_cache`]), once its file was checked against [`Driver::info`].
    pub fn open(index: Option<usize>) -> Result<Driver, PrepareError> {
        let shared = emuhost::gpu::vulkan::shared()?;
        Self::open_device(&shared.instance, index)
    }

    fn open_device(instance: &ash::Instance, index: Option<usize>) -> Result<Driver, PrepareError> {
        let compute_family = |pd: vk::PhysicalDevice| {
            // SAFETY: `pd` came from this instance.
            let families = unsafe { instance.get_physical_device_queue_family_properties(pd) };
            families.iter().position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE)).map(|i| i as u32)
        };
        // SAFETY: `pd` came from this instance.
        let props = |pd: vk::PhysicalDevice| unsafe { instance.get_physical_device_properties(pd) };
        let (pd, family) = match index {
            Some(i) => {
                // SAFETY: `instance` is live.
                let pdevs =
                    unsafe { instance.enumerate_physical_devices() }.map_err(vkerr("vkEnumeratePhysicalDevices"))?;
                let pd = *pdevs.get(i).ok_or(PrepareError::NoSuchDevice { index: i, count: pdevs.len() })?;
                (pd, compute_family(pd).ok_or(PrepareError::NoComputeDevice)?)
            }
            None => emuhost::gpu::vulkan::best(instance, |pd, _| compute_family(pd))
                .map_err(vkerr("vkEnumeratePhysicalDevices"))?
                .ok_or(PrepareError::NoComputeDevice)?,
        };
        let p = props(pd);
        let api_version = p.api_version;
        // SAFETY: `pd` came from this instance.
        let extensions = unsafe { instance.enumerate_device_extension_properties(pd) }
            .map_err(vkerr("vkEnumerateDeviceExtensionProperties"))?;
        let has_ext =
            extensions.iter().any(|e| e.extension_name_as_c_str() == Ok(vk::EXT_PIPELINE_CREATION_FEEDBACK_NAME));
        let core_feedback = vk::api_version_major(api_version) > 1 || vk::api_version_minor(api_version) >= 3;
        let mut enabled = Vec::new();
        if !core_feedback && has_ext {
            enabled.push(vk::EXT_PIPELINE_CREATION_FEEDBACK_NAME.as_ptr());
        }
        let priorities = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default().queue_family_index(family).queue_priorities(&priorities)];
        let dci = vk::DeviceCreateInfo::default().queue_create_infos(&queues).enabled_extension_names(&enabled);
        // SAFETY: `dci` and what it points to live across the call; the extension, if named, is
        // one the device listed.
        let device = unsafe { instance.create_device(pd, &dci, None) }.map_err(vkerr("vkCreateDevice"))?;
        // SAFETY: queue 0 of `family` was asked for at creation.
        let queue = unsafe { device.get_device_queue(family, 0) };
        let info = DeviceInfo {
            name: p.device_name_as_c_str().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
            vendor_id: p.vendor_id,
            device_id: p.device_id,
            driver_version: p.driver_version,
            pipeline_cache_uuid: p.pipeline_cache_uuid,
            api_version,
            max_workgroup_invocations: p.limits.max_compute_work_group_invocations,
            max_workgroup_size: p.limits.max_compute_work_group_size,
            creation_feedback: core_feedback || has_ext,
        };
        Ok(Driver { device, cache: vk::PipelineCache::null(), _queue: queue, info })
    }

    /// Makes the pipeline cache from `initial` (empty: a cold cache). The caller has checked
    /// `initial`'s header against [`Driver::info`]; the driver checks it again. Returns the
    /// bytes handed to the driver.
    pub fn make_cache(&mut self, initial: &[u8]) -> Result<usize, PrepareError> {
        let ci = vk::PipelineCacheCreateInfo::default().initial_data(initial);
        // SAFETY: `ci` and `initial` live across the call.
        let cache = unsafe { self.device.create_pipeline_cache(&ci, None) }.map_err(vkerr("vkCreatePipelineCache"))?;
        if self.cache != vk::PipelineCache::null() {
            // SAFETY: the old cache is ours and no creation runs (we hold `&mut self`).
            unsafe { self.device.destroy_pipeline_cache(self.cache, None) };
        }
        self.cache = cache;
        Ok(initial.len())
    }

    /// What the cache holds now, in the driver's format (header first).
    pub fn cache_data(&self) -> Result<Vec<u8>, PrepareError> {
        // SAFETY: the cache is this device's; the call is synchronized with creations by the driver.
        unsafe { self.device.get_pipeline_cache_data(self.cache) }.map_err(vkerr("vkGetPipelineCacheData"))
    }

    /// Creates (and destroys again) the compute pipeline of one variant through the cache. An
    /// error is the message to report: a workgroup past the device's limits (checked here:
    /// asking the driver would be invalid usage) or the driver's refusal.
    pub fn create_compute(&self, s: &Spirv) -> Result<CreateOutcome, String> {
        let wg = s.workgroup_size;
        let lim = self.info.max_workgroup_size;
        let invocations = u64::from(wg[0]) * u64::from(wg[1]) * u64::from(wg[2]);
        if wg.iter().zip(lim).any(|(w, l)| *w > l) || invocations > u64::from(self.info.max_workgroup_invocations) {
            return Err(format!(
                "workgroup {}x{}x{} is past the device's limits (maxComputeWorkGroupSize {}x{}x{}, \
                 maxComputeWorkGroupInvocations {})",
                wg[0], wg[1], wg[2], lim[0], lim[1], lim[2], self.info.max_workgroup_invocations
            ));
        }
        let entry = CString::new(s.entry_point.as_str()).map_err(|_| "the entry point's name holds a NUL")?;
        let mut objects = Objects {
            device: Some(&self.device),
            module: vk::ShaderModule::null(),
            set_layouts: Vec::new(),
            layout: vk::PipelineLayout::null(),
            pipelines: Vec::new(),
        };
        let smci = vk::ShaderModuleCreateInfo::default().code(&s.words);
        // SAFETY: the words are SPIR-V from naga's writer for this one entry point; `smci` lives
        // across the call.
        objects.module = unsafe { self.device.create_shader_module(&smci, None) }
            .map_err(|e| format!("vkCreateShaderModule: {e}"))?;
        let sets = s.bindings.iter().map(|b| b.set + 1).max().unwrap_or(0);
        for set in 0..sets {
            let bindings: Vec<vk::DescriptorSetLayoutBinding> = s
                .bindings
                .iter()
                .filter(|b| b.set == set)
                .map(|b| {
                    vk::DescriptorSetLayoutBinding::default()
                        .binding(b.binding)
                        .descriptor_type(match b.kind {
                            BindingKind::StorageBuffer => vk::DescriptorType::STORAGE_BUFFER,
                            BindingKind::UniformBuffer => vk::DescriptorType::UNIFORM_BUFFER,
                        })
                        .descriptor_count(1)
                        .stage_flags(vk::ShaderStageFlags::COMPUTE)
                })
                .collect();
            let ci = vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings);
            // SAFETY: `ci` and `bindings` live across the call.
            let l = unsafe { self.device.create_descriptor_set_layout(&ci, None) }
                .map_err(|e| format!("vkCreateDescriptorSetLayout: {e}"))?;
            objects.set_layouts.push(l);
        }
        let plci = vk::PipelineLayoutCreateInfo::default().set_layouts(&objects.set_layouts);
        // SAFETY: the set layouts are live; `plci` lives across the call.
        objects.layout = unsafe { self.device.create_pipeline_layout(&plci, None) }
            .map_err(|e| format!("vkCreatePipelineLayout: {e}"))?;
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(objects.module)
            .name(&entry);
        let mut feedback = vk::PipelineCreationFeedback::default();
        let mut stage_feedback = [vk::PipelineCreationFeedback::default()];
        let mut fci = vk::PipelineCreationFeedbackCreateInfo::default()
            .pipeline_creation_feedback(&mut feedback)
            .pipeline_stage_creation_feedbacks(&mut stage_feedback);
        let mut ci = vk::ComputePipelineCreateInfo::default().stage(stage).layout(objects.layout);
        if self.info.creation_feedback {
            ci = ci.push_next(&mut fci);
        }
        // SAFETY: `ci`, the stage, the entry name, the feedback structures and the layout live
        // across the call; the cache is this device's and internally synchronized.
        let created = unsafe { self.device.create_compute_pipelines(self.cache, &[ci], None) };
        let pipelines = match created {
            Ok(p) => p,
            Err((p, e)) => {
                objects.pipelines = p;
                return Err(format!("vkCreateComputePipelines: {e}"));
            }
        };
        objects.pipelines = pipelines;
        let cache_hit = (self.info.creation_feedback
            && feedback.flags.contains(vk::PipelineCreationFeedbackFlags::VALID))
        .then(|| feedback.flags.contains(vk::PipelineCreationFeedbackFlags::APPLICATION_PIPELINE_CACHE_HIT));
        Ok(CreateOutcome { cache_hit })
    }
}

/// The objects of one pipeline creation, destroyed when it ends however it ends.
struct Objects<'a> {
    device: Option<&'a ash::Device>,
    module: vk::ShaderModule,
    set_layouts: Vec<vk::DescriptorSetLayout>,
    layout: vk::PipelineLayout,
    pipelines: Vec<vk::Pipeline>,
}

impl Drop for Objects<'_> {
    fn drop(&mut self) {
        let Some(d) = self.device else { return };
        // SAFETY: each handle was made by `d` for this creation only, is used by no other thread,
        // and null handles are ignored by the destroy calls.
        unsafe {
            for p in self.pipelines.drain(..) {
                d.destroy_pipeline(p, None);
            }
            d.destroy_pipeline_layout(self.layout, None);
            for l in self.set_layouts.drain(..) {
                d.destroy_descriptor_set_layout(l, None);
            }
            d.destroy_shader_module(self.module, None);
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // SAFETY: no creation runs (we are dropped, so no `&self` is out); the cache and device
        // were made here and are destroyed once, children first.
        unsafe {
            self.device.destroy_pipeline_cache(self.cache, None);
            self.device.destroy_device(None);
        }
    }
}
