//! Pinning host pages: `mlock` faults every page of the range in and keeps it resident until
//! `munlock`; `mincore` says which pages are resident. Neither changes a byte or a mapping.

use std::io;

/// The calls behind [`lock`], [`unlock`] and [`resident_pages`], as errors name them.
pub const LOCK: &str = "mlock";
pub const UNLOCK: &str = "munlock";
pub const RESIDENT: &str = "mincore";

/// Locks `addr..addr + len` in memory (faulting its pages in).
///
/// # Safety
/// `addr..addr + len` is memory this process mapped for the caller and keeps mapped until the
/// matching [`unlock`] (a held span of a space's window): faulting in and pinning pages that
/// another owner maps (a userfaultfd-registered range, a device's mapping, a page the allocator
/// gives back) would act on memory whose contract is that owner's.
pub unsafe fn lock(addr: usize, len: usize) -> io::Result<()> {
    // Over RLIMIT_MEMLOCK the kernel says ENOMEM: an injected failure says the same.
    if crate::sys::hooks::fail_import(len as u64) {
        return Err(io::Error::from_raw_os_error(libc::ENOMEM));
    }
    // SAFETY: the range is the caller's (above); mlock only faults in and pins its pages, reads or
    // writes no byte through a Rust reference and changes no mapping. An unmapped range fails
    // with ENOMEM.
    unsafe { rustix::mm::mlock(addr as *mut libc::c_void, len) }.map_err(Into::into)
}

/// Unlocks `addr..addr + len`.
///
/// # Safety
/// `addr..addr + len` is a range the caller [`lock`]ed (or tried to), still mapped for it: an
/// unlock of another owner's pages would drop that owner's pin.
pub unsafe fn unlock(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the range is the caller's own pinned range (above); munlock only drops the pin of
    // its pages and touches no byte and no mapping.
    unsafe { rustix::mm::munlock(addr as *mut libc::c_void, len) }.map_err(Into::into)
}

/// Whether every page of `addr..addr + len` (page-aligned) is resident.
pub fn resident(addr: usize, len: usize) -> io::Result<bool> {
    let mut vec = Vec::new();
    resident_pages(addr, len, &mut vec)?;
    Ok(vec.iter().all(|&b| b))
}

/// Which pages of `addr..addr + len` (page-aligned) are resident, one entry per page, into
/// `out` (cleared first). An anonymous page never touched is not; nothing is faulted in.
pub fn resident_pages(addr: usize, len: usize, out: &mut Vec<bool>) -> io::Result<()> {
    let page = rustix::param::page_size();
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: `vec` has one byte per page of the range, which is what mincore writes; mincore
    // reads only the page tables of the range.
    let r = unsafe { libc::mincore(addr as *mut libc::c_void, len, vec.as_mut_ptr()) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    out.clear();
    out.extend(vec.iter().map(|b| b & 1 == 1));
    Ok(())
}
