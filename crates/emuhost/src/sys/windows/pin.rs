//! Pinning host pages on Windows: `VirtualLock` faults every page of the range in and keeps it in
//! the process's working set until `VirtualUnlock`; `QueryWorkingSetEx` says which pages are in
//! the working set. Neither changes a byte or a mapping.
//!
//! Differences from Linux's `mlock`: a process may lock only as much as its minimum working set
//! allows (a few hundred KiB by default), so where a lock fails with `ERROR_WORKING_SET_QUOTA` the
//! working set is grown by the range's length (`SetProcessWorkingSetSize`, minimum and maximum)
//! and the lock tried once more; the working set is not shrunk at unlock, so it grows to the most
//! ever locked at once. Every page must be committed (Linux locks a `PROT_NONE` page too). A lock
//! does not nest (one unlock unlocks), as on Linux. An unlock of pages that are not locked fails
//! in Windows (`ERROR_NOT_LOCKED`, after taking them out of the working set) and succeeds here, as
//! `munlock` does. "Resident" means in the working set: a page trimmed to the standby list is in
//! memory but not resident here, and a page of no allocation is not resident (Linux's `mincore`
//! fails on it).
//!
//! Both calls refuse a range over two allocations, so a range is locked and unlocked allocation by
//! allocation where the one call for it fails (as `fault::protect`).

use std::ffi::c_void;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use windows_sys::Win32::Foundation::{ERROR_NOT_LOCKED, ERROR_WORKING_SET_QUOTA};
use windows_sys::Win32::System::Memory::{VirtualLock, VirtualUnlock};
use windows_sys::Win32::System::ProcessStatus::{K32QueryWorkingSetEx, PSAPI_WORKING_SET_EX_INFORMATION};
use windows_sys::Win32::System::SystemInformation::{GetSystemInfo, SYSTEM_INFO};
use windows_sys::Win32::System::Threading::{GetCurrentProcess, GetProcessWorkingSetSize, SetProcessWorkingSetSize};

use super::fault::per_allocation;

/// The calls behind [`lock`], [`unlock`] and [`resident_pages`], as errors name them.
pub const LOCK: &str = "VirtualLock";
pub const UNLOCK: &str = "VirtualUnlock";
pub const RESIDENT: &str = "QueryWorkingSetEx";

/// Bytes locked by [`lock`] and not yet unlocked (an overlap of two locks counts twice):
/// `procstat`'s `VmLck`, which Windows does not report for a process.
static LOCKED: AtomicU64 = AtomicU64::new(0);

/// Bytes locked through [`lock`] now.
pub fn locked_bytes() -> u64 {
    LOCKED.load(Ordering::Relaxed)
}

/// Locks `addr..addr + len` in memory (faulting its pages in).
///
/// # Safety
/// `addr..addr + len` is memory this process mapped for the caller and keeps mapped until the
/// matching [`unlock`] (a held span of a space's window): faulting in and pinning pages that
/// another owner maps (a userfaultfd-registered range, a device's mapping, a page the allocator
/// gives back) would act on memory whose contract is that owner's.
pub unsafe fn lock(addr: usize, len: usize) -> io::Result<()> {
    // Over the working-set quota Windows says ERROR_WORKING_SET_QUOTA: an injected failure says
    // the same.
    if crate::sys::hooks::fail_import(len as u64) {
        return Err(io::Error::from_raw_os_error(ERROR_WORKING_SET_QUOTA as i32));
    }
    per_allocation(addr, len, |a, l| {
        // SAFETY: a piece of the caller's range (above).
        unsafe { lock_piece(a, l) }
    })?;
    LOCKED.fetch_add(len as u64, Ordering::Relaxed);
    Ok(())
}

/// `VirtualLock` of one piece, growing the working set once where the quota refuses it.
///
/// # Safety
/// As [`lock`].
unsafe fn lock_piece(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the range is the caller's (above); VirtualLock only faults in and pins its pages,
    // reads or writes no byte through a Rust reference and changes no mapping.
    if unsafe { VirtualLock(addr as *const c_void, len) } != 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(ERROR_WORKING_SET_QUOTA as i32) {
        return Err(e);
    }
    grow_working_set(len)?;
    // SAFETY: as above.
    if unsafe { VirtualLock(addr as *const c_void, len) } == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Raises the process's minimum and maximum working set by `len` bytes.
fn grow_working_set(len: usize) -> io::Result<()> {
    let (mut min, mut max) = (0usize, 0usize);
    // SAFETY: GetCurrentProcess's pseudo handle has every access right; valid out pointers.
    if unsafe { GetProcessWorkingSetSize(GetCurrentProcess(), &mut min, &mut max) } == 0 {
        return Err(io::Error::last_os_error());
    }
    let (min, max) = (min.saturating_add(len), max.saturating_add(len));
    // SAFETY: as above; the sizes only change how much of our memory the system keeps resident.
    if unsafe { SetProcessWorkingSetSize(GetCurrentProcess(), min, max) } == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Unlocks `addr..addr + len`.
///
/// # Safety
/// `addr..addr + len` is a range the caller [`lock`]ed (or tried to), still mapped for it: an
/// unlock of another owner's pages would drop that owner's pin.
pub unsafe fn unlock(addr: usize, len: usize) -> io::Result<()> {
    let mut unlocked = 0u64;
    let r = per_allocation(addr, len, |a, l| {
        // SAFETY: the range is the caller's own pinned range (above); VirtualUnlock only drops the
        // pin of its pages and touches no byte and no mapping.
        if unsafe { VirtualUnlock(a as *const c_void, l) } != 0 {
            unlocked += l as u64;
            return Ok(());
        }
        not_locked_is_ok(io::Error::last_os_error())
    });
    // What the whole-range call unlocked before it failed is not known: the pieces unlocked after
    // are counted, and the count never goes below zero.
    let _ = LOCKED.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n.saturating_sub(unlocked)));
    r
}

/// A failed `VirtualUnlock`'s error, but `ERROR_NOT_LOCKED`: nothing to drop there (`munlock`
/// succeeds too). Wine's `VirtualUnlock` never says it (it is `munlock`).
fn not_locked_is_ok(e: io::Error) -> io::Result<()> {
    if e.raw_os_error() == Some(ERROR_NOT_LOCKED as i32) { Ok(()) } else { Err(e) }
}

/// The system's page size (`GetSystemInfo`), read once.
fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        let mut si = SYSTEM_INFO::default();
        // SAFETY: `si` is a valid out pointer.
        unsafe { GetSystemInfo(&mut si) };
        (si.dwPageSize as usize).max(4096)
    })
}

/// Whether every page of `addr..addr + len` (page-aligned) is resident.
pub fn resident(addr: usize, len: usize) -> io::Result<bool> {
    let mut vec = Vec::new();
    resident_pages(addr, len, &mut vec)?;
    Ok(vec.iter().all(|&b| b))
}

/// Pages one `QueryWorkingSetEx` asks about (16 bytes each).
const BATCH: usize = 512;

/// Which pages of `addr..addr + len` (page-aligned) are in the working set, one entry per page,
/// into `out` (cleared first): `QueryWorkingSetEx`'s `Valid` bit, asked in batches of 512 pages.
/// A committed page never touched is not; nothing is faulted in.
pub fn resident_pages(addr: usize, len: usize, out: &mut Vec<bool>) -> io::Result<()> {
    let page = page_size();
    if !addr.is_multiple_of(page) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("address {addr:#x} is not page-aligned")));
    }
    let pages = len.div_ceil(page);
    if addr.checked_add(pages * page).is_none() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("range {addr:#x}+{len:#x} wraps")));
    }
    out.clear();
    out.reserve(pages);
    let mut batch = [PSAPI_WORKING_SET_EX_INFORMATION::default(); BATCH];
    let mut i = 0;
    while i < pages {
        let n = (pages - i).min(BATCH);
        for (j, e) in batch[..n].iter_mut().enumerate() {
            *e = PSAPI_WORKING_SET_EX_INFORMATION::default();
            e.VirtualAddress = (addr + (i + j) * page) as *mut c_void;
        }
        // SAFETY: `batch` holds `n` entries with their addresses set, and the size passed is
        // theirs; the call only reads the process's page tables and writes the entries.
        let ok = unsafe {
            K32QueryWorkingSetEx(
                GetCurrentProcess(),
                batch.as_mut_ptr().cast(),
                (n * size_of::<PSAPI_WORKING_SET_EX_INFORMATION>()) as u32,
            )
        };
        if ok == 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `Flags` covers the whole union; bit 0 is `Valid` in both of its layouts.
        out.extend(batch[..n].iter().map(|e| unsafe { e.VirtualAttributes.Flags } & 1 == 1));
        i += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use windows_sys::Win32::System::Memory::{
        MEM_COMMIT, MEM_RELEASE, MEM_RESERVE, PAGE_READWRITE, VirtualAlloc, VirtualFree,
    };

    use super::*;

    /// `pages` fresh committed pages, released on drop.
    struct Alloc(usize, usize);
    impl Alloc {
        fn new(pages: usize) -> Alloc {
            let len = pages * page_size();
            // SAFETY: a fresh allocation placed by the system.
            let p = unsafe { VirtualAlloc(std::ptr::null(), len, MEM_RESERVE | MEM_COMMIT, PAGE_READWRITE) };
            assert!(!p.is_null());
            Alloc(p as usize, len)
        }
    }
    impl Drop for Alloc {
        fn drop(&mut self) {
            // SAFETY: our own allocation, unused now.
            unsafe { VirtualFree(self.0 as *mut c_void, 0, MEM_RELEASE) };
        }
    }

    #[test]
    fn lock_makes_resident_and_unlock_unpins() {
        // 8 MiB: past a process's default minimum working set on Windows (about 200 KiB), so the
        // lock takes the quota path there (Wine has no such quota).
        let pages = 2048;
        let a = Alloc::new(pages);
        let page = page_size();
        let mut v = Vec::new();
        resident_pages(a.0, a.1, &mut v).unwrap();
        assert_eq!(v.len(), pages);
        assert!(!v[0] && !v[pages - 1], "untouched pages are not resident");
        assert!(!resident(a.0, a.1).unwrap());
        // SAFETY: our own allocation, kept until after the unlock.
        unsafe { (a.0 as *mut u8).add(3 * page).write_volatile(1) };
        resident_pages(a.0, a.1, &mut v).unwrap();
        assert!(v[3] && !v[4], "a touched page is resident, its neighbour not");
        let before = locked_bytes();
        // SAFETY: as above.
        unsafe { lock(a.0, a.1) }.unwrap();
        assert!(locked_bytes() >= before + a.1 as u64);
        assert!(resident(a.0, a.1).unwrap(), "every locked page is resident");
        // SAFETY: as above.
        unsafe { unlock(a.0, a.1) }.unwrap();
        // Unlocking again (a lock that failed) succeeds, as munlock does (Windows says
        // ERROR_NOT_LOCKED, Wine nothing).
        // SAFETY: as above.
        unsafe { unlock(a.0, a.1) }.unwrap();
        assert!(not_locked_is_ok(io::Error::from_raw_os_error(ERROR_NOT_LOCKED as i32)).is_ok());
        assert!(not_locked_is_ok(io::Error::from_raw_os_error(487)).is_err());
        // An unaligned address is refused, naming it.
        let e = resident(a.0 + 1, page).unwrap_err();
        assert!(e.to_string().contains(&format!("{:#x}", a.0 + 1)), "{e}");
        // A partial last page counts as a page.
        resident_pages(a.0, page + 1, &mut v).unwrap();
        assert_eq!(v.len(), 2);
    }

    /// A lock over two allocations. Wine locks it in one call (`mlock`), so there this shows only
    /// that it works; the walk it needs where Windows refuses such a range is `per_allocation`,
    /// tested through `fault::protect`.
    #[test]
    fn lock_spans_allocations() {
        // Two adjacent allocations of 64 KiB: reserve 128 KiB, release, allocate each half.
        const GRAN: usize = 64 * 1024;
        let base = (0..16)
            .find_map(|_| {
                let hole = Alloc::new(2 * GRAN / page_size());
                let base = hole.0;
                drop(hole);
                // SAFETY: fresh allocations at an address just released (they fail where someone
                // took it).
                let parts = [0, 1].map(|i| unsafe {
                    VirtualAlloc((base + i * GRAN) as *const c_void, GRAN, MEM_RESERVE | MEM_COMMIT, PAGE_READWRITE)
                        as usize
                });
                if parts == [base, base + GRAN] {
                    return Some(base);
                }
                for p in parts.into_iter().filter(|&p| p != 0) {
                    // SAFETY: an allocation just made here, unused.
                    unsafe { VirtualFree(p as *mut c_void, 0, MEM_RELEASE) };
                }
                None
            })
            .expect("two adjacent allocations");
        // SAFETY: our own allocations, released below after the unlock.
        unsafe { lock(base, 2 * GRAN) }.unwrap();
        assert!(resident(base, 2 * GRAN).unwrap());
        // SAFETY: as above.
        unsafe { unlock(base, 2 * GRAN) }.unwrap();
        for i in 0..2 {
            // SAFETY: as above.
            unsafe { VirtualFree((base + i * GRAN) as *mut c_void, 0, MEM_RELEASE) };
        }
    }
}
