//! What this Windows machine offers: the system's version (and Wine's, under Wine), logical
//! processors in the affinity mask, and whether write watch (`MEM_WRITE_WATCH`) reports a write.

use std::ffi::{CStr, c_char, c_void};
use std::io;

use windows_sys::Win32::System::LibraryLoader::{GetModuleHandleW, GetProcAddress};
use windows_sys::Win32::System::Memory::{
    GetWriteWatch, MEM_COMMIT, MEM_RELEASE, MEM_RESERVE, PAGE_READWRITE, VirtualAlloc, VirtualFree,
};
use windows_sys::Win32::System::SystemInformation::{GetSystemInfo, OSVERSIONINFOW, SYSTEM_INFO};
use windows_sys::Win32::System::SystemServices::MEM_WRITE_WATCH;

use crate::sys::counters::{Call, count};

pub use super::sched::affinity_cpus;

/// `RtlGetVersion` (ntdll): the true version, which `GetVersionEx` hides from an executable without
/// a manifest naming the system.
type RtlGetVersion = unsafe extern "system" fn(*mut OSVERSIONINFOW) -> i32;
/// `wine_get_version` (Wine's ntdll only).
type WineGetVersion = unsafe extern "C" fn() -> *const c_char;

/// The address of `name` (NUL-terminated) in ntdll, if it exports it.
fn ntdll_export(name: &CStr) -> Option<unsafe extern "system" fn() -> isize> {
    let ntdll: Vec<u16> = "ntdll.dll\0".encode_utf16().collect();
    // SAFETY: a NUL-terminated wide name; ntdll is loaded in every process and never unloaded, so
    // the module handle (not counted) stays valid.
    let module = unsafe { GetModuleHandleW(ntdll.as_ptr()) };
    if module.is_null() {
        return None;
    }
    // SAFETY: a valid module handle and a NUL-terminated name.
    unsafe { GetProcAddress(module, name.as_ptr().cast()) }
}

/// The system's version, `Windows major.minor.build` (`RtlGetVersion`, e.g. `Windows
/// 10.0.19045`; Windows 11 is 10.0 with builds from 22000), with ` (Wine 8.0)` under Wine (ntdll's
/// `wine_get_version`). `Windows (version unknown)` where ntdll has no `RtlGetVersion`.
pub fn os_release() -> String {
    let mut out = match ntdll_export(c"RtlGetVersion") {
        Some(f) => {
            // SAFETY: ntdll's RtlGetVersion has this signature (wdm.h).
            let f: RtlGetVersion = unsafe { std::mem::transmute(f) };
            let mut v =
                OSVERSIONINFOW { dwOSVersionInfoSize: size_of::<OSVERSIONINFOW>() as u32, ..Default::default() };
            // SAFETY: `v` is a valid OSVERSIONINFOW with its size set, as the call requires.
            if unsafe { f(&mut v) } == 0 {
                format!("Windows {}.{}.{}", v.dwMajorVersion, v.dwMinorVersion, v.dwBuildNumber)
            } else {
                "Windows (version unknown)".to_string()
            }
        }
        None => "Windows (version unknown)".to_string(),
    };
    if let Some(v) = wine_version() {
        out.push_str(&format!(" (Wine {v})"));
    }
    out
}

/// Wine's version (`8.0`) where this process runs under Wine (ntdll's `wine_get_version`, which
/// only Wine's ntdll exports); `None` on Windows.
pub fn wine_version() -> Option<String> {
    let f = ntdll_export(c"wine_get_version")?;
    // SAFETY: Wine's ntdll exports `const char *wine_get_version(void)` (cdecl, which is the
    // system ABI on x86-64); it returns a static NUL-terminated string.
    let f: WineGetVersion = unsafe { std::mem::transmute(f) };
    // SAFETY: as above: a static string, or null (checked).
    let p = unsafe { f() };
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null, NUL-terminated and static (above).
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Whether write watch works: two pages allocated with `MEM_WRITE_WATCH`, the second written,
/// and `GetWriteWatch` (without reset) reports exactly that page.
pub fn write_watch() -> io::Result<()> {
    let mut si = SYSTEM_INFO::default();
    // SAFETY: `si` is a valid out pointer.
    unsafe { GetSystemInfo(&mut si) };
    let page = (si.dwPageSize as usize).max(4096);
    count(Call::Mmap);
    // SAFETY: a fresh allocation placed by the system touches no existing memory.
    let p =
        unsafe { VirtualAlloc(std::ptr::null(), 2 * page, MEM_RESERVE | MEM_COMMIT | MEM_WRITE_WATCH, PAGE_READWRITE) };
    if p.is_null() {
        return Err(io::Error::last_os_error());
    }
    let written = p as usize + page;
    // SAFETY: the second of the two pages just committed read-write, ours alone.
    unsafe { (written as *mut u8).write_volatile(1) };
    let mut addrs = [std::ptr::null_mut::<c_void>(); 2];
    let (mut n, mut granularity) = (addrs.len(), 0u32);
    count(Call::Ioctl);
    // SAFETY: `p` is a watched allocation of `2 * page` bytes; `addrs` has room for `n` entries.
    let r = unsafe { GetWriteWatch(0, p, 2 * page, addrs.as_mut_ptr(), &mut n, &mut granularity) };
    let result = if r != 0 {
        Err(io::Error::last_os_error())
    } else {
        exactly(&addrs[..n.min(addrs.len())], granularity as usize, written, page)
    };
    count(Call::Munmap);
    // SAFETY: the allocation made above; nothing refers to it any more.
    unsafe { VirtualFree(p, 0, MEM_RELEASE) };
    result
}

/// Whether `GetWriteWatch` reported exactly the page `written`, at page granularity.
fn exactly(reported: &[*mut c_void], granularity: usize, written: usize, page: usize) -> io::Result<()> {
    if reported.len() == 1 && reported[0] as usize == written && granularity == page {
        return Ok(());
    }
    let got: Vec<String> = reported.iter().map(|a| format!("{:#x}", *a as usize)).collect();
    Err(io::Error::other(format!(
        "GetWriteWatch reported [{}] (granularity {granularity}) for one write to {written:#x}",
        got.join(", ")
    )))
}

/// Always false on Windows: the system charges commit when memory is committed (`VirtualAlloc`
/// `MEM_COMMIT`), whatever its protection, and `VirtualProtect` changes no charge. Linux's strict
/// overcommit (where `mprotect` charges a page made writable and keeps the charge) has no twin.
pub fn strict_overcommit() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probes_answer() {
        let os = os_release();
        assert!(os.starts_with("Windows "), "{os}");
        assert!(os.split(' ').nth(1).is_some_and(|v| v.split('.').count() == 3 && !v.contains("unknown")), "{os}");
        if ntdll_export(c"wine_get_version").is_some() {
            let v = wine_version().unwrap();
            assert!(os.ends_with(&format!(" (Wine {v})")), "{os}");
        } else {
            assert_eq!(wine_version(), None);
        }
        write_watch().unwrap();
        // What the probe refuses: another page, one more, none, another granularity.
        let at = |a: usize| a as *mut c_void;
        assert!(exactly(&[at(0x2000)], 4096, 0x2000, 4096).is_ok());
        assert!(exactly(&[at(0x1000)], 4096, 0x2000, 4096).is_err());
        assert!(exactly(&[at(0x1000), at(0x2000)], 4096, 0x2000, 4096).is_err());
        assert!(exactly(&[], 4096, 0x2000, 4096).is_err());
        let e = exactly(&[at(0x2000)], 65536, 0x2000, 4096).unwrap_err();
        assert!(e.to_string().contains("[0x2000] (granularity 65536) for one write to 0x2000"), "{e}");
        assert!(affinity_cpus().unwrap() >= 1);
        assert!(!strict_overcommit());
    }
}
