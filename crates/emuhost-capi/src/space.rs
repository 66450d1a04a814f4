//! `emuhost_space_t`: the guest address space (`emuhost::space`). Guest addresses are offsets
//! in the window (0 is its first byte); ranges must be page-aligned, non-empty and inside it.

use std::ffi::c_void;
use std::sync::Arc;

use emuhost::space::{GuestAddr, OwnedChanging, OwnedLongRead, Space, SpaceConfig, page_size};

use crate::entry;
use crate::error::{Error, emuhost_error_t};
use crate::ffi::{prot, put, slice, slice_mut};
use crate::handle::{self, Kind};

/// A guest address space (opaque): one reserved window, committed, protected and mapped in
/// pages.
///
/// Thread safety: every call may be made from any thread, concurrently (the space serialises
/// changes of its mappings). Trackers and importers made on a space keep it alive: the space
/// handle may be deleted before them. An adopted window goes back to the caller (reserved) when
/// the last of them goes.
pub struct emuhost_space_t {
    _private: [u8; 0],
}

impl Kind for Space {
    type C = emuhost_space_t;
    const NAME: &'static str = "space";
}

/// What a space is (`emuhost_space_info`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct emuhost_space_info_t {
    /// The host address of guest address 0.
    pub host_base: *mut c_void,
    /// The window's size in bytes.
    pub window: u64,
    /// Bytes of guard pages reserved below and above the window (0 for an adopted one).
    pub guard: u64,
    /// The page size: guest ranges are multiples of it.
    pub page_size: u64,
    /// Whether the window is the caller's reservation (`emuhost_space_adopt`).
    pub adopted: bool,
}

/// A private allocation: the extent of one commit, as later split by decommits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct emuhost_allocation_t {
    pub addr: u64,
    pub len: u64,
    /// Changes whenever the allocation's commit state changes.
    pub generation: u64,
}

/// A shared view: guest `addr..addr + len` shows section `section`'s bytes from `offset` on.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct emuhost_view_t {
    pub addr: u64,
    pub len: u64,
    pub section: u64,
    pub offset: u64,
}

pub(crate) fn get(space: *const emuhost_space_t, what: &str) -> Result<Arc<Space>, Error> {
    handle::get::<Space>(space, what)
}

fn give(
    out: *mut *mut emuhost_space_t,
    build: impl FnOnce() -> Result<Space, emuhost::space::SpaceError>,
) -> Result<(), Error> {
    // Checked before the window is reserved, so a NULL out-pointer reserves nothing.
    crate::ffi::check_ptr(out, "the out-pointer")?;
    let space = Arc::new(build()?);
    // SAFETY: checked above; the caller vouches that it is writable.
    unsafe { handle::give(out, space) }
}

/// Reserves a window of `window` bytes (a multiple of the page size) where the kernel chooses,
/// with `guard` bytes of guard pages (0 for none) below and above it.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_reserve(
    window: u64,
    guard: u64,
    out: *mut *mut emuhost_space_t,
) -> *mut emuhost_error_t {
    entry(|| give(out, || SpaceConfig::default().window(window).guard(guard).build()))
}

/// Reserves a window of `window` bytes at host address `base` (page-aligned), with `guard`
/// bytes of guard pages below and above it. Never replaces a mapping: where anything is mapped
/// in the range (guards included) it fails naming it (`EMUHOST_ERROR_EXISTS`).
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_reserve_at(
    base: *mut c_void,
    window: u64,
    guard: u64,
    out: *mut *mut emuhost_space_t,
) -> *mut emuhost_error_t {
    entry(|| give(out, || SpaceConfig::default().window(window).guard(guard).at(base.addr()).build()))
}

/// Makes a space of the caller's reservation `base..base + len` (host address, page-aligned; all
/// of it mapped `PROT_NONE`, private and anonymous, as `mmap(PROT_NONE, MAP_PRIVATE |
/// MAP_ANONYMOUS | MAP_NORESERVE)` gives; on Windows one reservation, as
/// `VirtualAlloc(MEM_RESERVE, PAGE_NOACCESS)` gives). When the space goes, its pages are given
/// back reserved (decommitted), not unmapped (released). On Windows a tracker over an adopted
/// window is the guard backend (write watch cannot see memory emuhost did not allocate), and
/// sections cannot be mapped in it (`EMUHOST_ERROR_UNAVAILABLE`).
///
/// # Safety
/// The range is a reservation the caller made; it stays mapped while the space lives (trackers
/// and importers keep the space alive), and nothing else maps, unmaps or changes protection in it
/// meanwhile. `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_adopt(
    base: *mut c_void,
    len: u64,
    out: *mut *mut emuhost_space_t,
) -> *mut emuhost_error_t {
    entry(|| {
        // SAFETY: the caller vouches for the range, as `SpaceConfig::adopt` asks.
        give(out, || unsafe { SpaceConfig::default().adopt(base.addr(), len) })
    })
}

/// Deletes the space handle. The space itself goes when the last tracker and importer made on it
/// go too. NULL does nothing; a handle deleted already is `EMUHOST_ERROR_BAD_HANDLE`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_space_delete(space: *mut emuhost_space_t) -> *mut emuhost_error_t {
    entry(|| handle::delete::<Space>(space))
}

/// The space's base, window, guards and page size.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_info(
    space: *const emuhost_space_t,
    out: *mut emuhost_space_info_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(space, "emuhost_space_info")?;
        let info = emuhost_space_info_t {
            host_base: std::ptr::with_exposed_provenance_mut(s.host_base()),
            window: s.window(),
            guard: s.guard(),
            page_size: page_size(),
            adopted: s.adopted(),
        };
        // SAFETY: as the caller vouches.
        unsafe { put(out, "the out-pointer", info) }
    })
}

/// Runs `op` on the space and the checked range `addr..addr + len`.
fn on_range(
    space: *const emuhost_space_t,
    what: &str,
    addr: u64,
    len: u64,
    op: impl FnOnce(&Arc<Space>, emuhost::space::GuestRange) -> Result<(), Error>,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(space, what)?;
        let range = s.range(addr, len)?;
        op(&s, range)
    })
}

/// Commits `addr..addr + len` with `prot` (`EMUHOST_PROT_*`), in one system call where it can.
/// Pages committed already keep their bytes; their protection is set again.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_space_commit(
    space: *const emuhost_space_t,
    addr: u64,
    len: u64,
    prot_bits: u32,
) -> *mut emuhost_error_t {
    on_range(space, "emuhost_space_commit", addr, len, |s, r| {
        s.commit(r, prot(prot_bits)?)?;
        Ok(())
    })
}

/// Commits with `prot` only the pages of the range that are not committed (committed pages keep
/// bytes and protection); `committed` (may be NULL) receives the bytes committed.
///
/// # Safety
/// `committed` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_commit_reserved(
    space: *const emuhost_space_t,
    addr: u64,
    len: u64,
    prot_bits: u32,
    committed: *mut u64,
) -> *mut emuhost_error_t {
    on_range(space, "emuhost_space_commit_reserved", addr, len, |s, r| {
        let n = s.commit_reserved(r, prot(prot_bits)?)?;
        // SAFETY: as the caller vouches.
        unsafe { crate::ffi::put_opt(committed, "committed", n) }
    })
}

/// Decommits the range: its pages are dropped and it is reserved again. Refused
/// (`EMUHOST_ERROR_REFUSED`) where a live GPU import holds a page of it: zero it instead.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_space_decommit(space: *const emuhost_space_t, addr: u64, len: u64) -> *mut emuhost_error_t {
    on_range(space, "emuhost_space_decommit", addr, len, |s, r| Ok(s.decommit(r)?))
}

/// Sets the protection (`EMUHOST_PROT_*`) of the committed pages of the range.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_space_protect(
    space: *const emuhost_space_t,
    addr: u64,
    len: u64,
    prot_bits: u32,
) -> *mut emuhost_error_t {
    on_range(space, "emuhost_space_protect", addr, len, |s, r| Ok(s.protect(r, prot(prot_bits)?)?))
}

/// Zeroes the range in place (pages stay committed and mapped, so GPU imports of them stay valid).
/// Pages not committed are `EMUHOST_ERROR_NOT_COMMITTED`, read-only ones `EMUHOST_ERROR_PROTECTION`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_space_zero(space: *const emuhost_space_t, addr: u64, len: u64) -> *mut emuhost_error_t {
    on_range(space, "emuhost_space_zero", addr, len, |s, r| Ok(s.zero(r)?))
}

/// A change of the mappings in the space's window that the caller makes itself, in flight
/// (opaque): from `emuhost_space_change_begin` to `emuhost_change_end`.
pub struct emuhost_change_t {
    _private: [u8; 0],
}

impl Kind for OwnedChanging {
    type C = emuhost_change_t;
    const NAME: &'static str = "change";
}

/// Marks a change of the mappings of the space's window that the caller makes itself (its own
/// `mprotect`, `mmap` or `munmap` there; on Windows `VirtualProtect`, `VirtualAlloc`,
/// `VirtualFree`) as in flight, until `emuhost_change_end`. Each takes the
/// process's memory-map lock for writing: while one is marked, an importer's background threads
/// start no populate and no pin, and before this returns it waits (100 ms at most) for those
/// under way to end, so that the caller's call does not wait for them in the kernel, where
/// every other thread's read of the memory map (a collect) would queue behind it. Mark only the
/// call itself; take no lock before this that a collect or a binding takes too.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_change_begin(
    space: *const emuhost_space_t,
    out: *mut *mut emuhost_change_t,
) -> *mut emuhost_error_t {
    entry(|| {
        // Before the change is marked (which may wait), as `give` checks it again after.
        crate::ffi::check_ptr(out, "the out-pointer")?;
        let s = get(space, "emuhost_space_change_begin")?;
        // SAFETY: checked above; the caller vouches that it is writable.
        unsafe { handle::give(out, Arc::new(s.changing_owned())) }
    })
}

/// Ends a change marked by `emuhost_space_change_begin` (NULL does nothing; an ended one is
/// `EMUHOST_ERROR_BAD_HANDLE`).
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_change_end(change: *mut emuhost_change_t) -> *mut emuhost_error_t {
    entry(|| handle::delete::<OwnedChanging>(change))
}

/// A long read of the memory map that the caller makes itself, in flight (opaque): from
/// `emuhost_space_long_read_begin` to `emuhost_long_read_end`.
pub struct emuhost_long_read_t {
    _private: [u8; 0],
}

impl Kind for OwnedLongRead {
    type C = emuhost_long_read_t;
    const NAME: &'static str = "long read";
}

/// Marks work of the caller's that can wait and holds the process's memory-map lock for reading
/// for long (its own driver's pin of guest memory, an import on its own device, a populate) as
/// a long read, until `emuhost_long_read_end`. `*out` is NULL when a change of the window's
/// mappings is in flight: step aside and try again later. While one is marked, a change that
/// comes (a commit, a decommit, a tracker's arm) waits for it (100 ms at most) before it takes
/// the space's lock, rather than in the kernel, where every later reader of the memory map (the
/// render thread's collects) would queue behind it. Mark only the read, on a thread that can
/// wait; make no change of the space's mappings while it is marked (the change would wait 100 ms).
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_long_read_begin(
    space: *const emuhost_space_t,
    out: *mut *mut emuhost_long_read_t,
) -> *mut emuhost_error_t {
    entry(|| {
        crate::ffi::check_ptr(out, "the out-pointer")?;
        let s = get(space, "emuhost_space_long_read_begin")?;
        match s.try_long_read_owned() {
            // SAFETY: checked above; the caller vouches that it is writable.
            Some(read) => unsafe { handle::give(out, Arc::new(read)) },
            None => {
                // SAFETY: checked above; the caller vouches that it is writable.
                unsafe { out.write(std::ptr::null_mut()) };
                Ok(())
            }
        }
    })
}

/// Ends a long read marked by `emuhost_space_long_read_begin` (NULL does nothing; an ended one
/// is `EMUHOST_ERROR_BAD_HANDLE`).
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_long_read_end(read: *mut emuhost_long_read_t) -> *mut emuhost_error_t {
    entry(|| handle::delete::<OwnedLongRead>(read))
}

/// Faults the range's pages in ahead of use (they must be committed writable, else
/// `EMUHOST_ERROR_NOT_COMMITTED` or `EMUHOST_ERROR_PROTECTION`), so a later GPU import pays for
/// pinning only.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_space_populate(space: *const emuhost_space_t, addr: u64, len: u64) -> *mut emuhost_error_t {
    on_range(space, "emuhost_space_populate", addr, len, |s, r| Ok(s.populate(r)?))
}

/// Copies `len` bytes from `data` into guest memory at `addr` (any alignment), through the kernel:
/// an error, never a fault, where a page is not writable or outside the window (pages not
/// committed: `EMUHOST_ERROR_NOT_COMMITTED`; committed without write access:
/// `EMUHOST_ERROR_PROTECTION`; the bytes before such a page are written).
///
/// # Safety
/// `data` points to `len` readable bytes (may be NULL when `len` is 0).
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_write(
    space: *const emuhost_space_t,
    addr: u64,
    data: *const c_void,
    len: usize,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(space, "emuhost_space_write")?;
        // SAFETY: as the caller vouches.
        let data = unsafe { slice(data.cast::<u8>(), len, "data") }?;
        Ok(s.write(GuestAddr(addr), data)?)
    })
}

/// Copies `len` bytes of guest memory at `addr` into `buf`: an error, never a fault, where a page
/// is not readable or outside the window (pages not committed: `EMUHOST_ERROR_NOT_COMMITTED`;
/// committed without read access: `EMUHOST_ERROR_PROTECTION`).
///
/// # Safety
/// `buf` points to `len` writable bytes (may be NULL when `len` is 0).
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_read(
    space: *const emuhost_space_t,
    addr: u64,
    buf: *mut c_void,
    len: usize,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(space, "emuhost_space_read")?;
        // SAFETY: as the caller vouches.
        let buf = unsafe { slice_mut(buf.cast::<u8>(), len, "buf") }?;
        Ok(s.read(GuestAddr(addr), buf)?)
    })
}

/// Creates a shared section of `len` bytes (a memfd; on Windows a pagefile-backed file mapping;
/// zero-filled); `id` receives its id.
///
/// # Safety
/// `id` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_create_section(
    space: *const emuhost_space_t,
    len: u64,
    id: *mut u64,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(space, "emuhost_space_create_section")?;
        crate::ffi::check_ptr(id, "id")?;
        let made = s.create_section(len)?;
        // SAFETY: as the caller vouches.
        unsafe { put(id, "id", made.0) }
    })
}

/// Drops the space's hold on a section; its views stay mapped.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_space_destroy_section(space: *const emuhost_space_t, id: u64) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(space, "emuhost_space_destroy_section")?;
        Ok(s.destroy_section(emuhost::space::SectionId(id))?)
    })
}

/// Maps section `id`'s bytes from `offset` (page-aligned) at guest `addr..addr + len` as ONE
/// view with `prot`, replacing what was there. One section page at several addresses makes
/// aliases. Windows: views need placeholders (Windows 10 1803 and later; not Wine 8) in a window
/// emuhost reserved, and may not cut a committed private allocation whose other pages hold data;
/// otherwise `EMUHOST_ERROR_UNAVAILABLE`, saying which, and nothing changes.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_space_map_section(
    space: *const emuhost_space_t,
    addr: u64,
    len: u64,
    id: u64,
    offset: u64,
    prot_bits: u32,
) -> *mut emuhost_error_t {
    on_range(space, "emuhost_space_map_section", addr, len, |s, r| {
        Ok(s.map_section(r, emuhost::space::SectionId(id), offset, prot(prot_bits)?)?)
    })
}

/// Maps section pages at consecutive guest pages from `addr`: guest page `i` shows section page
/// `pages[i]`; each run of consecutive section pages is one view (on Windows, as
/// [`emuhost_space_map_section`] says). `views` (may be NULL) receives
/// the number of views made.
///
/// # Safety
/// `pages` points to `count` readable values (may be NULL when `count` is 0); `views` is NULL or
/// writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_map_pages(
    space: *const emuhost_space_t,
    addr: u64,
    id: u64,
    pages: *const u64,
    count: usize,
    prot_bits: u32,
    views: *mut usize,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = get(space, "emuhost_space_map_pages")?;
        // SAFETY: as the caller vouches.
        let pages = unsafe { slice(pages, count, "pages") }?;
        let n = s.map_pages(GuestAddr(addr), emuhost::space::SectionId(id), pages, prot(prot_bits)?)?;
        // SAFETY: as the caller vouches.
        unsafe { crate::ffi::put_opt(views, "views", n) }
    })
}

/// Copies up to `cap` of `items` into `out` and their number into `count`.
///
/// # Safety
/// `out` points to `cap` writable items (may be NULL when `cap` is 0); `count` is writable.
unsafe fn fill<T: Copy>(items: &[T], out: *mut T, cap: usize, count: *mut usize) -> Result<(), Error> {
    crate::ffi::check_ptr(count, "count")?;
    // SAFETY: as the caller vouches.
    let out = unsafe { slice_mut(out, cap, "out") }?;
    let n = items.len().min(out.len());
    out[..n].copy_from_slice(&items[..n]);
    // SAFETY: as the caller vouches.
    unsafe { put(count, "count", items.len()) }
}

/// The private allocations overlapping the range (unclipped, in address order): up to `cap` go to
/// `out`, and `count` receives how many there are (more than `cap`: call again with more room).
///
/// # Safety
/// `out` points to `cap` writable entries (may be NULL when `cap` is 0); `count` is writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_allocations(
    space: *const emuhost_space_t,
    addr: u64,
    len: u64,
    out: *mut emuhost_allocation_t,
    cap: usize,
    count: *mut usize,
) -> *mut emuhost_error_t {
    on_range(space, "emuhost_space_allocations", addr, len, |s, r| {
        let items: Vec<_> = s
            .allocations_in(r)
            .iter()
            .map(|a| emuhost_allocation_t { addr: a.range.start().0, len: a.range.len(), generation: a.generation })
            .collect();
        // SAFETY: as the caller vouches.
        unsafe { fill(&items, out, cap, count) }
    })
}

/// The shared views overlapping the range (unclipped, in address order), as
/// `emuhost_space_allocations` gives allocations.
///
/// # Safety
/// As `emuhost_space_allocations`.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_space_views(
    space: *const emuhost_space_t,
    addr: u64,
    len: u64,
    out: *mut emuhost_view_t,
    cap: usize,
    count: *mut usize,
) -> *mut emuhost_error_t {
    on_range(space, "emuhost_space_views", addr, len, |s, r| {
        let items: Vec<_> = s
            .views_in(r)
            .iter()
            .map(|v| emuhost_view_t {
                addr: v.range.start().0,
                len: v.range.len(),
                section: v.section.0,
                offset: v.offset,
            })
            .collect();
        // SAFETY: as the caller vouches.
        unsafe { fill(&items, out, cap, count) }
    })
}
