//! Imports on the caller's device, as an emulator embeds emuhost: the test makes its own Vulkan
//! instance and device (with `VK_EXT_external_memory_host`), builds the importer from their raw
//! handles, binds guest ranges and reads the bound bytes through the GPU on its own queue, from
//! the `VkDeviceMemory` and offset (and the `VkBuffer`) the binding gives; then it drops emuhost's
//! side and destroys its device itself. CUDA's caller-context path is checked where libcuda is.
//!
//! Vulkan's skip rule is the one of every test that needs a device (`tests/support/vulkan.rs`).

use std::ffi::{CStr, c_void};
use std::io::Write as _;
use std::sync::Arc;

use ash::vk;
use ash::vk::Handle as _;
use emuhost::import::{
    Backend, Bound, CallerDevice, Cuda, GpuHandle, ImportConfig, ImportError, Importer, Vulkan, error_chain, verify,
};
use emuhost::space::{GuestAddr, Prot, Space};

const MIB: u64 = 1 << 20;

/// The embedder's own Vulkan objects: what an emulator has made before it meets emuhost.
struct Own {
    entry: ash::Entry,
    instance: ash::Instance,
    pd: vk::PhysicalDevice,
    device: ash::Device,
    queue: vk::Queue,
    family: u32,
    exts: Vec<&'static CStr>,
}

fn own_device() -> Result<Own, std::io::Error> {
    let err = |what: &str, e: vk::Result| std::io::Error::other(format!("{what}: {e}"));
    // SAFETY: loads the system's Vulkan loader, as any Vulkan program does.
    let entry = unsafe { ash::Entry::load() }.map_err(|e| std::io::Error::other(format!("no loader: {e}")))?;
    let app = vk::ApplicationInfo::default().application_name(c"embedder").api_version(vk::API_VERSION_1_1);
    // SAFETY: the create info lives across the call.
    let instance = unsafe { entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None) }
        .map_err(|e| err("vkCreateInstance", e))?;
    let found = (|| {
        // SAFETY: the instance is live; every `pd` below came from it.
        for pd in unsafe { instance.enumerate_physical_devices() }.map_err(|e| err("enumerate", e))? {
            // SAFETY: `pd` came from the live instance.
            let exts = unsafe { instance.enumerate_device_extension_properties(pd) }.unwrap_or_default();
            let has = |n: &CStr| exts.iter().any(|e| e.extension_name_as_c_str() == Ok(n));
            // SAFETY: as above.
            let families = unsafe { instance.get_physical_device_queue_family_properties(pd) };
            let family = families
                .iter()
                .position(|f| f.queue_flags.intersects(vk::QueueFlags::TRANSFER | vk::QueueFlags::COMPUTE));
            if let (true, Some(family)) = (has(ash::ext::external_memory_host::NAME), family) {
                let mut want = vec![ash::ext::external_memory_host::NAME];
                if has(ash::khr::external_memory::NAME) {
                    want.push(ash::khr::external_memory::NAME);
                }
                return Ok((pd, family as u32, want));
            }
        }
        Err(std::io::Error::other("no device with VK_EXT_external_memory_host"))
    })();
    let (pd, family, exts) = match found {
        Ok(f) => f,
        Err(e) => {
            // SAFETY: nothing made from the instance lives.
            unsafe { instance.destroy_instance(None) };
            return Err(e);
        }
    };
    let prio = [1.0f32];
    let queues = [vk::DeviceQueueCreateInfo::default().queue_family_index(family).queue_priorities(&prio)];
    let names: Vec<_> = exts.iter().map(|e| e.as_ptr()).collect();
    let info = vk::DeviceCreateInfo::default().queue_create_infos(&queues).enabled_extension_names(&names);
    // SAFETY: the create info and what it points to live across the call; the extensions are
    // ones the device lists.
    let device = unsafe { instance.create_device(pd, &info, None) }.map_err(|e| err("vkCreateDevice", e))?;
    // SAFETY: queue 0 of `family` was asked for.
    let queue = unsafe { device.get_device_queue(family, 0) };
    Ok(Own { entry, instance, pd, device, queue, family, exts })
}

impl Own {
    fn caller(&self) -> CallerDevice<'_> {
        CallerDevice::new(
            self.entry.static_fn().get_instance_proc_addr,
            self.instance.handle(),
            self.pd,
            self.device.handle(),
            &self.exts,
        )
    }

    fn memory_type(&self, bits: u32, want: vk::MemoryPropertyFlags) -> u32 {
        // SAFETY: the physical device is the instance's.
        let m = unsafe { self.instance.get_physical_device_memory_properties(self.pd) };
        (0..m.memory_type_count)
            .find(|&i| bits & (1 << i) != 0 && m.memory_types[i as usize].property_flags.contains(want))
            .expect("a memory type for the buffer")
    }

    /// Copies `len` bytes from `src` at `src_off`, through the GPU on the embedder's own queue, and
    /// returns them (read from a host-visible buffer of the embedder's).
    fn read_through_gpu(&self, src: vk::Buffer, src_off: u64, len: u64) -> Vec<u8> {
        let d = &self.device;
        // SAFETY: every handle below is made from `d` here and destroyed before the return; the
        // copy is waited for (fence) before the host reads, and the region lies in both buffers
        // (the caller's `src` covers `src_off + len`).
        unsafe {
            let info = vk::BufferCreateInfo::default().size(len).usage(vk::BufferUsageFlags::TRANSFER_DST);
            let dst = d.create_buffer(&info, None).unwrap();
            let req = d.get_buffer_memory_requirements(dst);
            let want = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
            let alloc = vk::MemoryAllocateInfo::default()
                .allocation_size(req.size)
                .memory_type_index(self.memory_type(req.memory_type_bits, want));
            let mem = d.allocate_memory(&alloc, None).unwrap();
            d.bind_buffer_memory(dst, mem, 0).unwrap();
            let pool = d
                .create_command_pool(&vk::CommandPoolCreateInfo::default().queue_family_index(self.family), None)
                .unwrap();
            let cmd = d
                .allocate_command_buffers(
                    &vk::CommandBufferAllocateInfo::default().command_pool(pool).command_buffer_count(1),
                )
                .unwrap()[0];
            d.begin_command_buffer(cmd, &vk::CommandBufferBeginInfo::default()).unwrap();
            d.cmd_copy_buffer(cmd, src, dst, &[vk::BufferCopy { src_offset: src_off, dst_offset: 0, size: len }]);
            d.end_command_buffer(cmd).unwrap();
            let fence = d.create_fence(&vk::FenceCreateInfo::default(), None).unwrap();
            let cmds = [cmd];
            d.queue_submit(self.queue, &[vk::SubmitInfo::default().command_buffers(&cmds)], fence).unwrap();
            d.wait_for_fences(&[fence], true, u64::MAX).unwrap();
            let p = d.map_memory(mem, 0, len, vk::MemoryMapFlags::empty()).unwrap();
            let out = std::slice::from_raw_parts(p as *const u8, len as usize).to_vec();
            d.unmap_memory(mem);
            d.destroy_fence(fence, None);
            d.destroy_command_pool(pool, None);
            d.destroy_buffer(dst, None);
            d.free_memory(mem, None);
            out
        }
    }

    /// The bound bytes read through the GPU twice: from the importer's buffer at the binding's
    /// offset, and from a buffer of the embedder's own bound to the binding's `VkDeviceMemory`
    /// (at the offset rounded down to the buffer's alignment, the rest as the copy's offset).
    fn read_bound(&self, b: &Bound, len: u64) -> (Vec<u8>, Vec<u8>) {
        let GpuHandle::Vulkan { memory, buffer } = b.handle else { panic!("not a Vulkan binding: {b:?}") };
        assert_ne!(memory, 0);
        assert_ne!(buffer, 0);
        let through_buffer = self.read_through_gpu(vk::Buffer::from_raw(buffer), b.offset, len);
        let d = &self.device;
        let host = vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT;
        let make = |size: u64| {
            let mut ext = vk::ExternalMemoryBufferCreateInfo::default().handle_types(host);
            let info = vk::BufferCreateInfo::default()
                .size(size)
                .usage(vk::BufferUsageFlags::TRANSFER_SRC)
                .push_next(&mut ext);
            // SAFETY: the create info lives across the call.
            unsafe { d.create_buffer(&info, None) }.unwrap()
        };
        // SAFETY: the buffers are made on the embedder's device; the one bound to the import's
        // memory (live: the importer holds the import) lies inside it (the binding does:
        // `at + size` is the binding's end) and is destroyed after the copy waited.
        unsafe {
            let probe = make(len);
            let align = d.get_buffer_memory_requirements(probe).alignment;
            d.destroy_buffer(probe, None);
            let at = b.offset / align * align;
            let own = make(len + (b.offset - at));
            d.bind_buffer_memory(own, vk::DeviceMemory::from_raw(memory), at).unwrap();
            let through_memory = self.read_through_gpu(own, b.offset - at, len);
            d.destroy_buffer(own, None);
            (through_buffer, through_memory)
        }
    }
}

impl Drop for Own {
    fn drop(&mut self) {
        // SAFETY: emuhost's side (backend, importer, imports) is dropped before (it holds none of
        // this), so nothing made from the device lives.
        unsafe {
            self.device.device_wait_idle().unwrap();
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// The whole embedding round: bind two ranges of a pool (one import made, one reused), read each
/// back through the GPU from what the binding gave, drop emuhost's side, and use the device again.
#[test]
fn a_binding_on_the_callers_device_gives_memory_and_offset_that_the_gpu_reads_the_guest_bytes_at() {
    let Some(own) = crate::vulkan_gate::vulkan_or_skip(own_device()) else { return };
    let usage = vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::STORAGE_BUFFER;
    // SAFETY: the handles are the embedder's, made above with the extension; `own` outlives the
    // backend and its imports (dropped at the end of the block below).
    let backend = unsafe { Vulkan::from_caller(&own.caller().buffer_usage(usage)) }.expect("backend on our device");
    // The start-up check passes on the caller's device (CPU path: emuhost submits nothing there).
    verify(&backend).expect("start-up check");
    assert!(backend.describe().contains("minImportedHostPointerAlignment"), "{}", backend.describe());
    {
        let space = Arc::new(Space::with_window(64 * MIB).unwrap());
        let importer = Importer::new(space.clone(), backend, ImportConfig::default()).unwrap();
        let (pool_lo, pool_len) = (16 * MIB + 0x3000, 0x40000);
        importer.add_pool(pool_lo, pool_len).unwrap();
        space.commit(space.range(pool_lo, pool_len).unwrap(), Prot::READ_WRITE).unwrap();
        let bytes: Vec<u8> = (0..pool_len).map(|i| (i * 13 + (i >> 9)) as u8 ^ 0xa5).collect();
        space.write(GuestAddr(pool_lo), &bytes).unwrap();
        for (addr, len, made) in [(pool_lo + 0x1234, 0x2000, true), (pool_lo + 0x2_0567, 0x1800, false)] {
            let b = importer.bind(addr, len).unwrap();
            assert_eq!(b.made, made, "{b:?}");
            assert_eq!(b.range.lo + b.offset, addr, "{b:?}");
            let want = &bytes[(addr - pool_lo) as usize..][..len as usize];
            let (through_buffer, through_memory) = own.read_bound(&b, len);
            assert!(through_buffer == want, "the importer's buffer at offset {:#x} holds other bytes", b.offset);
            assert!(through_memory == want, "the memory at offset {:#x} holds other bytes", b.offset);
        }
        assert_eq!(importer.stats().imports, 1);
    }
    // emuhost destroyed nothing of ours: the device still copies.
    let (through_buffer, through_memory) = {
        let space = Arc::new(Space::with_window(16 * MIB).unwrap());
        // SAFETY: as above.
        let backend = unsafe { Vulkan::from_caller(&own.caller()) }.unwrap();
        let importer = Importer::new(space.clone(), backend, ImportConfig::default()).unwrap();
        space.commit(space.range(0, 0x1000).unwrap(), Prot::READ_WRITE).unwrap();
        space.write(GuestAddr(0x10), b"still here").unwrap();
        let b = importer.bind(0x10, 10).unwrap();
        own.read_bound(&b, 10)
    };
    assert_eq!(through_buffer, b"still here");
    assert_eq!(through_memory, b"still here");
    drop(own);
}

/// A device made without the extension (by the caller's list) is refused, naming it.
#[test]
fn the_callers_device_without_external_memory_host_is_refused_naming_it() {
    let Some(own) = crate::vulkan_gate::vulkan_or_skip(own_device()) else { return };
    let none: [&CStr; 0] = [];
    let mut caller = own.caller();
    caller.enabled_extensions = &none;
    // SAFETY: valid handles; the backend is refused before it uses them for anything.
    let e = unsafe { Vulkan::from_caller(&caller) }.unwrap_err();
    assert!(matches!(e, ImportError::Unavailable { .. }), "{e:?}");
    assert!(e.to_string().contains("VK_EXT_external_memory_host"), "{e}");
}

/// The caller's CUDA context: a binding gives the device pointer of its bytes. Runs where the CUDA
/// driver is (`libcuda.so.1`, `nvcuda.dll`; with device 0's primary context as "the caller's");
/// prints `skipped:` elsewhere.
#[test]
fn a_binding_in_the_callers_cuda_context_gives_the_device_pointer_of_its_bytes() {
    // CUDAAPI: `__stdcall` on Windows (the C convention on x86-64), C elsewhere.
    type Retain = unsafe extern "system" fn(*mut *mut c_void, i32) -> u32;
    type Release = unsafe extern "system" fn(i32) -> u32;
    type Init = unsafe extern "system" fn(u32) -> u32;
    let name = if cfg!(windows) { "nvcuda.dll" } else { "libcuda.so.1" };
    // SAFETY: loading the CUDA driver library runs its initialisers, as any CUDA program does.
    let lib = match unsafe { libloading::Library::new(name) } {
        Ok(l) => l,
        Err(e) => {
            if std::env::var("EMUHOST_REQUIRE_CUDA").is_ok_and(|v| v.trim() == "1") {
                panic!("EMUHOST_REQUIRE_CUDA=1 but no {name}: {e}");
            }
            let _ = writeln!(std::io::stderr(), "skipped: CUDA: no {name}: {e}");
            return;
        }
    };
    // SAFETY: the signatures are cuda.h's; the library outlives every use (dropped last).
    let (init, retain, release) = unsafe {
        (
            *lib.get::<Init>(b"cuInit\0").unwrap(),
            *lib.get::<Retain>(b"cuDevicePrimaryCtxRetain\0").unwrap(),
            *lib.get::<Release>(b"cuDevicePrimaryCtxRelease_v2\0").unwrap(),
        )
    };
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: plain driver calls with an out-pointer to a local.
    let r = unsafe { init(0).max(retain(&mut ctx, 0)) };
    assert_eq!(r, 0, "the CUDA driver loads but gives no context");
    {
        // SAFETY: `ctx` is retained until after the backend and its imports are dropped (below).
        let backend = unsafe { Cuda::from_context(ctx) }.unwrap_or_else(|e| panic!("{}", error_chain(&e)));
        let space = Arc::new(Space::with_window(32 * MIB).unwrap());
        let importer = Importer::new(space, backend, ImportConfig::default()).unwrap();
        importer.add_pool(0x5000, 0x10000).unwrap();
        let b = importer.bind(0x6010, 0x100).unwrap();
        let GpuHandle::Cuda { device_ptr } = b.handle else { panic!("not a CUDA binding: {b:?}") };
        assert_ne!(device_ptr, 0);
        assert_eq!(b.cuda_ptr(), Some(device_ptr + b.offset));
        assert_eq!(b.range.lo + b.offset, 0x6010);
    }
    // SAFETY: releases the retain above; nothing of emuhost's holds the context any more.
    unsafe { release(0) };
}
