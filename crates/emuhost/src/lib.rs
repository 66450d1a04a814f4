//! emuhost: the host layer a console emulator or static recompiler runs its game on.
//!
//! - [`space`]: the guest address space (one reservation, one-call commit, populate, shared views).
//! - [`watch`]: what the guest wrote (userfaultfd + PAGEMAP_SCAN, mprotect + SIGSEGV).
//! - [`snapshot`]: snapshots of a guest range (save states, rewind), copying what was written.
//! - [`sched`]: short sleeps (timer, yield or hybrid by rule) and compile-worker sizing.
//! - [`import`]: guest memory imported into the GPU (pools, chunks, spans, Vulkan/CUDA/pin; the
//!   Vulkan and CUDA backends behind the cargo features `vulkan` and `cuda`, on by default).
//! - `gpu`: the process's one Vulkan setup (instance, device choice, error mapping), feature `vulkan`.
//! - [`probe`]: what this machine offers the runtime, and the process's own memory figures.
//! - [`quantile`]: the workspace's one rule for percentiles and medians of measured samples.
//! - [`rng`]: the workspace's one deterministic generator (synthetic sessions, shader corpora,
//!   stress runs, benchmark layouts): the same draws from a seed on every platform.
//! - [`settings`]: every `EMUHOST_*` switch, typed ([`settings::Settings`]); the library reads the
//!   environment only in [`settings::Settings::from_env`].
//!
//! Only `sys/` (OS calls) and the GPU FFI opt out of `deny(unsafe_code)`.
//!
//! # Example
//!
//! Reserve a guest space, commit pages, arm a write tracker over them, let the guest store, and
//! collect the page it wrote; then import guest bytes into the GPU on the caller's own Vulkan
//! device. The same code runs on Linux and Windows (the tracker's backend differs: userfaultfd or
//! `mprotect` on Linux, write watch or guard pages on Windows).
//!
//! ```
//! use std::sync::Arc;
//! use emuhost::space::{GuestAddr, Prot, Space, page_size};
//! use emuhost::watch::{Tracker, TrackerConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A 64 MiB guest window: reserved, nothing committed yet.
//! let space = Arc::new(Space::with_window(64 << 20)?);
//! let page = page_size();
//! let range = space.range(16 * page, 4 * page)?;
//! space.commit(range, Prot::READ_WRITE)?;
//!
//! // Track writes to the four pages (the best backend this machine offers).
//! let tracker = Tracker::new(&space, &TrackerConfig::default())?;
//! tracker.arm(range)?;
//!
//! // The guest stores into the third page...
//! space.store(GuestAddr(18 * page + 5), b"hello")?;
//! // ...and the collect reports exactly that page, then arms it again.
//! let written = tracker.collect(range)?;
//! assert_eq!(written.page_addrs(), [GuestAddr(18 * page)]);
//! assert_eq!(tracker.collect(range)?.pages(), 0);
//! # #[cfg(feature = "vulkan")]
//! # import_on_callers_device(&space)?;
//! # Ok(())
//! # }
//! # #[cfg(feature = "vulkan")]
//! # fn import_on_callers_device(space: &Arc<Space>) -> Result<(), Box<dyn std::error::Error>> {
//! use emuhost::import::{CallerDevice, GpuHandle, ImportConfig, Importer, Vulkan};
//!
//! // The emulator's own instance and device, made with `VK_EXT_external_memory_host` (a
//! // hidden helper here; it returns `None`, and this part is skipped, where no Vulkan device
//! // with that extension is found).
//! let Some(own) = my_vulkan_device() else { return Ok(()) };
//! let caller = CallerDevice::new(
//!     own.entry.static_fn().get_instance_proc_addr,
//!     own.instance.handle(),
//!     own.physical_device,
//!     own.device.handle(),
//!     &own.extensions,
//! );
//! // SAFETY: the handles are live, made with the extensions named, and outlive the importer.
//! let backend = unsafe { Vulkan::from_caller(&caller) }?;
//! let importer = Importer::new(space.clone(), backend, ImportConfig::default())?;
//! let bound = importer.bind(18 * page_size(), 5)?;
//! // The GPU reads the five bytes at `offset` in the import's memory and buffer.
//! let GpuHandle::Vulkan { memory, buffer } = bound.handle else { panic!("{bound:?}") };
//! assert!(memory != 0 && buffer != 0);
//! assert_eq!(bound.range.lo + bound.offset, 18 * page_size());
//! drop(importer); // emuhost's side goes before the caller destroys its device
//! # Ok(())
//! # }
//! # #[cfg(feature = "vulkan")]
//! # struct Own {
//! #     entry: ash::Entry,
//! #     instance: ash::Instance,
//! #     physical_device: ash::vk::PhysicalDevice,
//! #     device: ash::Device,
//! #     extensions: Vec<&'static std::ffi::CStr>,
//! # }
//! # #[cfg(feature = "vulkan")]
//! # impl Drop for Own {
//! #     fn drop(&mut self) {
//! #         // SAFETY: nothing made from the device or instance lives any more.
//! #         unsafe {
//! #             self.device.destroy_device(None);
//! #             self.instance.destroy_instance(None);
//! #         }
//! #     }
//! # }
//! # /// The caller's device: the first with `VK_EXT_external_memory_host` and a transfer or
//! # /// compute queue; `None` (said on stderr) where there is none, a panic then if
//! # /// `EMUHOST_REQUIRE_VULKAN=1` (CI's runners with a device).
//! # #[cfg(feature = "vulkan")]
//! # fn my_vulkan_device() -> Option<Own> {
//! #     use ash::vk;
//! #     let none = |why: String| {
//! #         let required = std::env::var("EMUHOST_REQUIRE_VULKAN").is_ok_and(|v| v.trim() == "1");
//! #         assert!(!required, "EMUHOST_REQUIRE_VULKAN=1 and no Vulkan device: {why}");
//! #         eprintln!("skipped: the import on the caller's device: {why}");
//! #         None
//! #     };
//! #     // SAFETY: loads the system's Vulkan loader, as any Vulkan program does.
//! #     let entry = match unsafe { ash::Entry::load() } {
//! #         Ok(e) => e,
//! #         Err(e) => return none(format!("no Vulkan loader: {e}")),
//! #     };
//! #     let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_1);
//! #     let info = vk::InstanceCreateInfo::default().application_info(&app);
//! #     // SAFETY: the create info lives across the call.
//! #     let instance = match unsafe { entry.create_instance(&info, None) } {
//! #         Ok(i) => i,
//! #         Err(e) => return none(format!("vkCreateInstance: {e}")),
//! #     };
//! #     let host = ash::ext::external_memory_host::NAME;
//! #     // SAFETY: the instance is live; every physical device comes from it.
//! #     let found = unsafe { instance.enumerate_physical_devices() }.unwrap_or_default().into_iter().find_map(|pd| {
//! #         // SAFETY: as above.
//! #         let exts = unsafe { instance.enumerate_device_extension_properties(pd) }.unwrap_or_default();
//! #         let families = unsafe { instance.get_physical_device_queue_family_properties(pd) };
//! #         let family = families.iter().position(|f| {
//! #             f.queue_flags.intersects(vk::QueueFlags::TRANSFER | vk::QueueFlags::COMPUTE)
//! #         })?;
//! #         exts.iter().any(|e| e.extension_name_as_c_str() == Ok(host)).then_some((pd, family as u32))
//! #     });
//! #     let Some((physical_device, family)) = found else {
//! #         // SAFETY: nothing made from the instance lives.
//! #         unsafe { instance.destroy_instance(None) };
//! #         return none("no device with VK_EXT_external_memory_host".into());
//! #     };
//! #     let extensions = vec![host];
//! #     let names: Vec<_> = extensions.iter().map(|e| e.as_ptr()).collect();
//! #     let prio = [1.0f32];
//! #     let queues = [vk::DeviceQueueCreateInfo::default().queue_family_index(family).queue_priorities(&prio)];
//! #     let info = vk::DeviceCreateInfo::default().queue_create_infos(&queues).enabled_extension_names(&names);
//! #     // SAFETY: the create info and what it points to live across the call; the extension is
//! #     // one the device lists.
//! #     match unsafe { instance.create_device(physical_device, &info, None) } {
//! #         Ok(device) => Some(Own { entry, instance, physical_device, device, extensions }),
//! #         Err(e) => {
//! #             // SAFETY: nothing made from the instance lives.
//! #             unsafe { instance.destroy_instance(None) };
//! #             none(format!("vkCreateDevice: {e}"))
//! #         }
//! #     }
//! # }
//! ```
//!
//! Traces, replay, soak and the write-tracking stress are the `emuhost-lab` crate; shader
//! preparation is `emuhost-prepare`.
#![deny(unsafe_code)]
// Every public item is documented (issue 38).
#![deny(missing_docs)]
// docs.rs marks the items of the `vulkan` and `cuda` features as such.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod errors;
#[cfg(feature = "faults")]
pub mod faults;
#[cfg(not(feature = "faults"))]
#[path = "faults_disabled.rs"]
pub mod faults;
#[cfg(feature = "vulkan")]
#[cfg_attr(docsrs, doc(cfg(feature = "vulkan")))]
pub mod gpu;
pub mod import;
pub mod quantile;
pub mod rng;
pub mod sched;
pub mod settings;
pub mod snapshot;
pub mod space;
mod sys;
pub mod watch;

pub mod probe;

/// System-call counters (per thread). Filled only in a build with the `counters` feature;
/// [`counters::snapshot`] returns `None` otherwise.
///
/// ```
/// use emuhost::space::{Prot, Space};
///
/// let space = Space::with_window(16 << 20).unwrap();
/// let before = emuhost::counters::snapshot();
/// space.commit(space.range(0, 0x10000).unwrap(), Prot::READ_WRITE).unwrap();
/// if let (Some(before), Some(after)) = (before, emuhost::counters::snapshot()) {
///     // Feature `counters`: this thread's calls of the commit.
///     assert!(after.since(&before).total() >= 1);
/// }
/// ```
pub mod counters {
    pub use crate::sys::counters::{Call, Counts, snapshot};
}
