//! What an emulator does with emuhost, owning everything emuhost could own:
//!
//! 1. it reserves its 4 GiB guest window itself, at a fixed base (`mmap`, `PROT_NONE`), and
//!    hands it to emuhost ([`SpaceConfig::adopt`]);
//! 2. it installs its own `SIGSEGV` handler, which hands each fault to the tracker
//!    ([`watch::handle_fault`]) and treats those refused as its own (here: fatal); the
//!    tracker is made with [`TrackerConfig::embedder_handles_faults`] and installs none;
//! 3. a guest thread writes guest memory through raw pointers while the render thread collects
//!    into two caches' own bitmap words ([`Consumer::collect_into`]: a buffer cache one bit per
//!    page, a texture cache one bit per 64 KiB), on every write-tracking backend this kernel has;
//! 4. it creates its own `VkDevice` (on lavapipe in CI) and imports guest memory through emuhost
//!    on it ([`Vulkan::from_caller`]), then copies the imported bytes through its own queue and
//!    compares them.
//!
//! It prints what it saw and exits nonzero on any lost write or wrong byte. Without a Vulkan
//! device the import part is skipped (printed), unless `EMUHOST_REQUIRE_VULKAN=1`.
//!
//! ```sh
//! cargo run -p emuhost --example embed
//! ```
//!
//! The integration suite runs the same code ([`run`]) in a process of its own. Linux only for now
//! (`examples/embed.rs` says why).

use std::ffi::CStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};

use ash::vk;
use ash::vk::Handle as _;
use emuhost::import::{CallerDevice, GpuHandle, ImportConfig, Importer, Vulkan};
use emuhost::space::{GuestAddr, Prot, Space, SpaceConfig, page_size};
use emuhost::watch::{self, BackendKind, Tracker, TrackerConfig, WatchError};

// The one skip rule of every test that needs a device. The integration suite, which includes this
// file, has the same module at its root.
#[allow(clippy::duplicate_mod)]
#[path = "../../tests/support/vulkan.rs"]
mod vulkan_gate;

/// Where the emulator puts its guest window, and how big it is.
const BASE: usize = 0x3000_0000_0000;
const WINDOW: usize = 4 << 30;
/// The guest memory the guest thread writes, tracked.
const TRACKED: u64 = 16 << 20;
/// The texture cache's bytes per bit.
const TEXTURE_GRAIN: u64 = 64 << 10;

/// Faults `handle_fault` took.
static TAKEN: AtomicUsize = AtomicUsize::new(0);

/// The emulator's `SIGSEGV` handler: the trackers' faults first ([`watch::handle_fault`], for
/// whichever tracker has the page armed: the backends take turns on one space here; an emulator
/// with one tracker may keep its [`emuhost::watch::FaultHandle`] instead); any other would be the
/// emulator's own (fastmem, a JIT's), and here none is expected: the default action, so the fault
/// repeats and kills the process.
extern "C" fn on_segv(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo; for a fault si_addr is the faulting address.
    let addr = unsafe { (*info).si_addr() } as usize;
    if watch::handle_fault(addr, true) {
        TAKEN.fetch_add(1, SeqCst);
        return;
    }
    // SAFETY: a zeroed sigaction with SIG_DFL is the default action; sigaction is
    // async-signal-safe.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGSEGV, &dfl, std::ptr::null_mut());
    }
}

/// The `SIGSEGV` handler installed now.
fn segv_handler() -> usize {
    // SAFETY: reads the action into a zeroed struct.
    unsafe {
        let mut now: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut now);
        now.sa_sigaction
    }
}

/// What one backend's tracking round saw.
#[derive(Debug)]
pub struct Tracked {
    pub backend: BackendKind,
    pub writes: u64,
    pub faults_taken: usize,
    /// Pages written that the buffer cache never got, and 64 KiB grains the texture cache never got.
    pub lost_buffer_pages: u64,
    pub lost_texture_grains: u64,
}

/// What the run saw.
#[derive(Debug)]
pub struct Report {
    pub base: usize,
    pub tracked: Vec<Tracked>,
    /// Backends this kernel does not have, and why.
    pub skipped: Vec<String>,
    /// Whether emuhost left the emulator's handler in place.
    pub handler_kept: bool,
    /// Bytes imported and read back through the emulator's own device (`None`: no device).
    pub imported: Option<u64>,
    pub wrong_bytes: u64,
}

impl Report {
    /// Whether anything was lost or wrong.
    pub fn failed(&self) -> bool {
        !self.handler_kept
            || self.wrong_bytes != 0
            || self.tracked.iter().any(|t| t.lost_buffer_pages + t.lost_texture_grains != 0)
            || !self.tracked.iter().any(|t| t.backend == BackendKind::Mprotect)
    }
}

/// Reserves the window at [`BASE`] as the emulator would.
fn reserve() -> Result<usize, String> {
    // SAFETY: MAP_FIXED_NOREPLACE maps only where nothing is mapped (else EEXIST).
    let at = unsafe {
        libc::mmap(
            BASE as *mut libc::c_void,
            WINDOW,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return Err(format!("reserving {WINDOW:#x} bytes at {BASE:#x}: {}", std::io::Error::last_os_error()));
    }
    if at as usize != BASE {
        // A kernel without MAP_FIXED_NOREPLACE took it as a hint.
        // SAFETY: the mapping just made, unused.
        unsafe { libc::munmap(at, WINDOW) };
        return Err(format!("the kernel put the window at {:#x}, not {BASE:#x}", at as usize));
    }
    Ok(BASE)
}

/// Installs [`on_segv`].
fn install_handler() -> Result<(), String> {
    // SAFETY: a zeroed sigaction filled in with a SA_SIGINFO handler.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_segv as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
        libc::sigemptyset(&mut act.sa_mask);
        if libc::sigaction(libc::SIGSEGV, &act, std::ptr::null_mut()) != 0 {
            return Err(format!("sigaction: {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// One backend's round: a guest thread writes pages through raw pointers, round after round,
/// while the render thread collects into the two caches; every page written in a round must be
/// in the buffer cache's words (and its grain in the texture cache's) by the round's last collect.
fn track(space: &Arc<Space>, kind: BackendKind) -> Result<Tracked, WatchError> {
    let config = TrackerConfig::default().backend(Some(kind)).embedder_handles_faults(true);
    let tracker = Tracker::new(space, &config)?;
    let range = space.range(0, TRACKED)?;
    space.commit(range, Prot::READ_WRITE)?;
    tracker.arm(range)?;
    let (buffers, textures) = (tracker.consumer(), tracker.consumer());
    let pages = TRACKED / page_size();
    let base = space.host_addr(GuestAddr(0))?;
    let taken = TAKEN.load(SeqCst);
    let mut out = Tracked { backend: kind, writes: 0, faults_taken: 0, lost_buffer_pages: 0, lost_texture_grains: 0 };
    for round in 0..8u64 {
        let mut page_bits = vec![0u64; pages.div_ceil(64) as usize];
        let mut grain_bits = vec![0u64; (TRACKED / TEXTURE_GRAIN).div_ceil(64) as usize];
        let written: Vec<u64> = (0..pages).filter(|p| (p * 7 + round) % 5 == 0).collect();
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for &p in &written {
                    // SAFETY: the page is committed read-write inside the adopted window; the
                    // tracker may have made it read-only, and the handler above gives it back.
                    unsafe { ((base + (p * page_size()) as usize) as *mut u64).write_volatile(round) };
                }
                done.store(true, SeqCst);
            });
            while !done.load(SeqCst) {
                buffers.collect_into(range, page_size(), &mut page_bits)?;
                textures.collect_into(range, TEXTURE_GRAIN, &mut grain_bits)?;
            }
            Ok::<(), WatchError>(())
        })?;
        buffers.collect_into(range, page_size(), &mut page_bits)?;
        textures.collect_into(range, TEXTURE_GRAIN, &mut grain_bits)?;
        let has = |bits: &[u64], i: u64| bits[(i / 64) as usize] & (1 << (i % 64)) != 0;
        let per = TEXTURE_GRAIN / page_size();
        out.writes += written.len() as u64;
        out.lost_buffer_pages += written.iter().filter(|&&p| !has(&page_bits, p)).count() as u64;
        out.lost_texture_grains += written.iter().filter(|&&p| !has(&grain_bits, p / per)).count() as u64;
    }
    out.faults_taken = TAKEN.load(SeqCst) - taken;
    drop((buffers, textures));
    tracker.disarm(range)?;
    space.decommit(range)?;
    Ok(out)
}

/// The emulator's own Vulkan objects.
struct Own {
    entry: ash::Entry,
    instance: ash::Instance,
    pd: vk::PhysicalDevice,
    device: ash::Device,
    queue: vk::Queue,
    family: u32,
    exts: Vec<&'static CStr>,
}

/// Creates the emulator's own instance and device, with `VK_EXT_external_memory_host`.
fn own_device() -> Result<Own, std::io::Error> {
    let err = |what: &str, e: vk::Result| std::io::Error::other(format!("{what}: {e}"));
    // SAFETY: loads the system's Vulkan loader, as any Vulkan program does.
    let entry = unsafe { ash::Entry::load() }.map_err(|e| std::io::Error::other(format!("no loader: {e}")))?;
    let app = vk::ApplicationInfo::default().application_name(c"embed").api_version(vk::API_VERSION_1_1);
    // SAFETY: the create info lives across the call.
    let instance = unsafe { entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None) }
        .map_err(|e| err("vkCreateInstance", e))?;
    let ext = ash::ext::external_memory_host::NAME;
    // SAFETY: the instance is live; every `pd` came from it.
    let found = unsafe { instance.enumerate_physical_devices() }.unwrap_or_default().into_iter().find_map(|pd| {
        // SAFETY: as above.
        let (exts, families) = unsafe {
            (
                instance.enumerate_device_extension_properties(pd).unwrap_or_default(),
                instance.get_physical_device_queue_family_properties(pd),
            )
        };
        let family = families.iter().position(|f| f.queue_flags.intersects(vk::QueueFlags::TRANSFER))?;
        exts.iter().any(|e| e.extension_name_as_c_str() == Ok(ext)).then_some((pd, family as u32))
    });
    let Some((pd, family)) = found else {
        // SAFETY: nothing made from the instance lives.
        unsafe { instance.destroy_instance(None) };
        return Err(std::io::Error::other("no device with VK_EXT_external_memory_host"));
    };
    let prio = [1.0f32];
    let queues = [vk::DeviceQueueCreateInfo::default().queue_family_index(family).queue_priorities(&prio)];
    let exts = vec![ext];
    let names: Vec<_> = exts.iter().map(|e| e.as_ptr()).collect();
    let info = vk::DeviceCreateInfo::default().queue_create_infos(&queues).enabled_extension_names(&names);
    // SAFETY: the create info and what it points to live across the call; the device lists the
    // extension.
    let device = unsafe { instance.create_device(pd, &info, None) }.map_err(|e| err("vkCreateDevice", e))?;
    // SAFETY: queue 0 of `family` was asked for.
    let queue = unsafe { device.get_device_queue(family, 0) };
    Ok(Own { entry, instance, pd, device, queue, family, exts })
}

impl Own {
    /// Copies `len` bytes of `src` from `off` through the emulator's queue into a host-visible
    /// buffer of its own, and returns them.
    fn read(&self, src: vk::Buffer, off: u64, len: u64) -> Result<Vec<u8>, vk::Result> {
        let d = &self.device;
        // SAFETY: every handle is made from `d` here and destroyed before the return; the copy is
        // waited for before the host reads; `src` covers `off + len` (the binding does).
        unsafe {
            let dst = d.create_buffer(
                &vk::BufferCreateInfo::default().size(len).usage(vk::BufferUsageFlags::TRANSFER_DST),
                None,
            )?;
            let req = d.get_buffer_memory_requirements(dst);
            let props = self.instance.get_physical_device_memory_properties(self.pd);
            let want = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
            let kind = (0..props.memory_type_count)
                .find(|&i| {
                    req.memory_type_bits & (1 << i) != 0 && props.memory_types[i as usize].property_flags.contains(want)
                })
                .ok_or(vk::Result::ERROR_FEATURE_NOT_PRESENT)?;
            let mem = d.allocate_memory(
                &vk::MemoryAllocateInfo::default().allocation_size(req.size).memory_type_index(kind),
                None,
            )?;
            d.bind_buffer_memory(dst, mem, 0)?;
            let pool =
                d.create_command_pool(&vk::CommandPoolCreateInfo::default().queue_family_index(self.family), None)?;
            let cmd = d.allocate_command_buffers(
                &vk::CommandBufferAllocateInfo::default().command_pool(pool).command_buffer_count(1),
            )?[0];
            d.begin_command_buffer(cmd, &vk::CommandBufferBeginInfo::default())?;
            d.cmd_copy_buffer(cmd, src, dst, &[vk::BufferCopy { src_offset: off, dst_offset: 0, size: len }]);
            d.end_command_buffer(cmd)?;
            let fence = d.create_fence(&vk::FenceCreateInfo::default(), None)?;
            d.queue_submit(self.queue, &[vk::SubmitInfo::default().command_buffers(&[cmd])], fence)?;
            d.wait_for_fences(&[fence], true, u64::MAX)?;
            let p = d.map_memory(mem, 0, len, vk::MemoryMapFlags::empty())?;
            let out = std::slice::from_raw_parts(p as *const u8, len as usize).to_vec();
            d.unmap_memory(mem);
            d.destroy_fence(fence, None);
            d.destroy_command_pool(pool, None);
            d.destroy_buffer(dst, None);
            d.free_memory(mem, None);
            Ok(out)
        }
    }
}

impl Drop for Own {
    fn drop(&mut self) {
        // SAFETY: emuhost's side (backend, importer, imports) is dropped first, so nothing made
        // from the device lives.
        unsafe {
            let _ = self.device.device_wait_idle();
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// Imports a pool of guest memory on the emulator's own device and reads a binding back through
/// it: the bytes that differ from the guest's.
fn import(space: &Arc<Space>, own: &Own) -> Result<(u64, u64), String> {
    let usage = vk::BufferUsageFlags::TRANSFER_SRC;
    let caller = CallerDevice::new(
        own.entry.static_fn().get_instance_proc_addr,
        own.instance.handle(),
        own.pd,
        own.device.handle(),
        &own.exts,
    )
    .buffer_usage(usage);
    // SAFETY: the handles are the emulator's, made with the extension; `own` outlives the
    // backend and its imports (the importer is dropped before this returns).
    let backend = unsafe { Vulkan::from_caller(&caller) }.map_err(ctx("Vulkan::from_caller"))?;
    let importer = Importer::new(space.clone(), backend, ImportConfig::default()).map_err(ctx("importer"))?;
    let (lo, len) = (64 << 20, 1 << 20);
    importer.add_pool(lo, len).map_err(ctx("add_pool"))?;
    space.commit(space.range(lo, len).map_err(ctx("range"))?, Prot::READ_WRITE).map_err(ctx("commit"))?;
    let bytes: Vec<u8> = (0..len).map(|i| (i * 31 + (i >> 12)) as u8).collect();
    space.write(GuestAddr(lo), &bytes).map_err(ctx("write"))?;
    let (at, size) = (lo + 0x1_2345, 0x4000);
    let b = importer.bind(at, size).map_err(ctx("bind"))?;
    let GpuHandle::Vulkan { buffer, .. } = b.handle else { return Err(format!("not a Vulkan binding: {b:?}")) };
    let got = own.read(vk::Buffer::from_raw(buffer), b.offset, size).map_err(ctx("copy"))?;
    let want = &bytes[(at - lo) as usize..][..size as usize];
    Ok((size, got.iter().zip(want).filter(|(a, b)| a != b).count() as u64))
}

/// An error's text after `what`.
fn ctx<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

/// The whole embedding, as `main` runs it.
pub fn run() -> Result<Report, String> {
    let base = reserve()?;
    install_handler()?;
    let ours = segv_handler();
    // SAFETY: `base..base + WINDOW` is the reservation made above, private, anonymous and
    // PROT_NONE; it stays mapped until after the space is dropped (at the end of this function),
    // and nothing else maps in it meanwhile.
    let space = Arc::new(unsafe { SpaceConfig::default().adopt(base, WINDOW as u64) }.map_err(|e| e.to_string())?);
    let mut report =
        Report { base, tracked: Vec::new(), skipped: Vec::new(), handler_kept: true, imported: None, wrong_bytes: 0 };
    for kind in BackendKind::AUTO {
        match track(&space, kind) {
            Ok(t) => report.tracked.push(t),
            Err(e @ (WatchError::SelfTest { .. } | WatchError::Unavailable { .. }))
                if kind != BackendKind::Mprotect =>
            {
                report.skipped.push(format!("{}: {e}", kind.name()))
            }
            Err(e) => return Err(format!("{}: {e}", kind.name())),
        }
        report.handler_kept &= segv_handler() == ours;
    }
    if let Some(own) = vulkan_gate::vulkan_or_skip(own_device()) {
        let (len, wrong) = import(&space, &own)?;
        report.imported = Some(len);
        report.wrong_bytes = wrong;
    }
    drop(space);
    // SAFETY: the space is gone and gave the range back as a reservation; nothing uses it.
    unsafe { libc::munmap(base as *mut libc::c_void, WINDOW) };
    Ok(report)
}

#[allow(dead_code)] // the integration suite includes this file for `run`
pub fn main() {
    match run() {
        Ok(r) => {
            println!("guest window: {:#x}+{WINDOW:#x} (adopted)", r.base);
            println!("emuhost left the emulator's SIGSEGV handler in place: {}", r.handler_kept);
            for t in &r.tracked {
                println!(
                    "{}: {} writes, {} faults taken by handle_fault, lost: {} buffer-cache pages, {} texture-cache grains",
                    t.backend.name(),
                    t.writes,
                    t.faults_taken,
                    t.lost_buffer_pages,
                    t.lost_texture_grains
                );
            }
            for s in &r.skipped {
                println!("skipped: {s}");
            }
            match r.imported {
                Some(n) => {
                    println!("imported on the emulator's VkDevice: {n} bytes read back, {} wrong", r.wrong_bytes)
                }
                None => println!("import: skipped (no Vulkan device)"),
            }
            if r.failed() {
                eprintln!("FAILED");
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
