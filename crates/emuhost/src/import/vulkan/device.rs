//! A device's work for the Vulkan backend: the memory type for a pointer, the heap budgets, an
//! import of a host span into a buffer, a copy between two imports, and the device's end.
#![allow(unsafe_code)] // Vulkan calls: each block says why it is sound

use std::sync::Arc;

use ash::vk;

use super::super::ImportError;
use super::super::backend::HostSpan;
use super::*;

impl Device {
    /// The memory type for a pointer allowed `host_bits` and a buffer allowed `buffer_bits`:
    /// host-visible and coherent where one is, else the lowest allowed.
    pub(super) fn memory_type(&self, bits: u32) -> Option<u32> {
        let types = &self.memory.memory_types[..self.memory.memory_type_count as usize];
        let want = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        let allowed = |i: usize| bits & (1 << i) != 0;
        (0..types.len())
            .find(|&i| allowed(i) && types[i].property_flags.contains(want))
            .or_else(|| (0..types.len()).find(|&i| allowed(i)))
            .map(|i| i as u32)
    }

    pub(super) fn take_heap(&self, heap: usize, len: u64) -> Result<(), ImportError> {
        let mut used = self.heap_used.lock().unwrap_or_else(|p| p.into_inner());
        let size = self.memory.memory_heaps[heap].size;
        if used[heap].saturating_add(len) > size {
            return Err(ImportError::Budget { what: "the memory heap", need: len, used: used[heap], limit: size });
        }
        used[heap] += len;
        Ok(())
    }

    pub(super) fn give_heap(&self, heap: usize, len: u64) {
        self.heap_used.lock().unwrap_or_else(|p| p.into_inner())[heap] -= len;
    }

    pub(super) fn destroy_buffer(&self, buffer: vk::Buffer) {
        // SAFETY: the buffer was made by this device and no command using it is pending (copies
        // wait for their fence).
        unsafe { self.device.destroy_buffer(buffer, None) };
    }

    pub(super) fn import_into(
        self: &Arc<Self>,
        span: HostSpan,
        buffer: vk::Buffer,
    ) -> Result<VulkanImport, ImportError> {
        let len = span.len() as u64;
        let ptr = span.addr() as *mut c_void;
        let t0 = std::time::Instant::now();
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
        let t1 = std::time::Instant::now();
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
        let t2 = std::time::Instant::now();
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
        let t3 = std::time::Instant::now();
        if t3 - t0 > std::time::Duration::from_micros(500) {
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            tracing::debug!(
                "vulkan import of {} KiB: {:.2} ms to allocate (the pin), {:.2} ms before it, {:.2} ms to bind",
                len >> 10,
                ms(t2 - t1),
                ms(t1 - t0),
                ms(t3 - t2)
            );
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

    /// Copies through the GPU and waits; `Ok(false)` on the caller's device (no queue of ours).
    pub(super) fn copy(&self, from: vk::Buffer, to: vk::Buffer, region: vk::BufferCopy) -> Result<bool, ImportError> {
        let Some(q) = &self.queue else { return Ok(false) };
        let q = q.lock().unwrap_or_else(|p| p.into_inner());
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
        out.map(|()| true)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // The caller's device is the caller's to destroy, and emuhost made nothing on it that
        // lives (each import freed its memory and buffer when dropped).
        if !self.owned {
            return;
        }
        let Some(q) = self.queue.as_mut().map(|q| q.get_mut().unwrap_or_else(|p| p.into_inner())) else { return };
        // SAFETY: `&mut self`: the backend and every import (each holding an `Arc` of the device)
        // are gone, so nothing made from the device lives and no other thread uses it; after the
        // wait no command is pending, so the pool and then the device can go, in that order. The
        // instance stays (the process's, [`crate::gpu::vulkan`]).
        unsafe {
            let _ = self.device.device_wait_idle();
            self.device.destroy_command_pool(q.pool, None);
            self.device.destroy_device(None);
        }
    }
}
