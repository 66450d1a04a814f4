//! The process heap (which Rust's allocator and the C runtime allocate from): which kind this
//! process has, read from the heap's own header at run time; and an executable's application
//! manifest (`RT_MANIFEST`), read and taken out of a copy, for `emuhost bench workers`, whose other arm is a
//! copy of `emuhost.exe` without the manifest that asks for the segment heap.
//!
//! The heap's kind: the first `u32` past 16 bytes at `GetProcessHeap()` is the header's signature,
//! `0xDDEEDDEE` for a segment heap (`SEGMENT_HEAP.SegmentSignature`) and `0xFFEEFFEE` for an NT heap
//! (`HEAP.SegmentSignature`) on x64. Windows chooses the kind at process start, from the
//! executable's manifest (`heapType`, Windows 10 2004 and later) or the system's settings; Wine
//! ignores `heapType` and always has its own heap, whose header carries the NT heap's signature
//! (seen under Wine 8): under Wine the kind is Wine's, whatever the header says.

use std::ffi::c_void;
use std::io;
use std::path::Path;

use windows_sys::Win32::Foundation::{FreeLibrary, HMODULE};
use windows_sys::Win32::System::Diagnostics::Debug::ReadProcessMemory;
use windows_sys::Win32::System::LibraryLoader::{
    BeginUpdateResourceW, EndUpdateResourceW, EnumResourceNamesW, EnumResourceTypesW, FindResourceW,
    LOAD_LIBRARY_AS_DATAFILE, LOAD_LIBRARY_AS_IMAGE_RESOURCE, LoadLibraryExW, LoadResource, LockResource,
    SizeofResource,
};
use windows_sys::Win32::System::Memory::GetProcessHeap;
use windows_sys::Win32::System::Threading::GetCurrentProcess;
use windows_sys::core::PCWSTR;

/// `RT_MANIFEST` (winuser.h), as `MAKEINTRESOURCE` makes it.
const RT_MANIFEST: PCWSTR = 24 as PCWSTR;
/// `CREATEPROCESS_MANIFEST_RESOURCE_ID`: the manifest the loader reads for an executable.
const PROCESS_MANIFEST: PCWSTR = 1 as PCWSTR;

/// A segment heap's signature (`SEGMENT_HEAP.SegmentSignature`, 16 bytes into the heap on x64).
pub const SEGMENT_SIGNATURE: u32 = 0xDDEE_DDEE;
/// An NT heap's signature (`HEAP.SegmentSignature`, 16 bytes into the heap on x64); Wine's heap
/// carries it too.
pub const NT_SIGNATURE: u32 = 0xFFEE_FFEE;

/// Which heap a process has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeapKind {
    /// Windows' segment heap (what the manifest's `heapType` asks for).
    Segment,
    /// Windows' NT heap (the default), with its low-fragmentation front end.
    Nt,
    /// Wine's own heap (Wine ignores `heapType`).
    Wine,
    /// A signature that is neither (or a header that could not be read).
    Unknown,
}

impl HeapKind {
    /// What it is, in words.
    pub fn name(self) -> &'static str {
        match self {
            HeapKind::Segment => "the segment heap",
            HeapKind::Nt => "the NT heap",
            HeapKind::Wine => "Wine's heap",
            HeapKind::Unknown => "unknown",
        }
    }

    /// A short name for JSON: `segment`, `nt`, `wine`, `unknown`.
    pub fn key(self) -> &'static str {
        match self {
            HeapKind::Segment => "segment",
            HeapKind::Nt => "nt",
            HeapKind::Wine => "wine",
            HeapKind::Unknown => "unknown",
        }
    }

    /// The kind a header's signature tells, under Wine (`wine`) or on Windows.
    pub fn from_signature(signature: Option<u32>, wine: bool) -> HeapKind {
        match signature {
            _ if wine => HeapKind::Wine,
            Some(SEGMENT_SIGNATURE) => HeapKind::Segment,
            Some(NT_SIGNATURE) => HeapKind::Nt,
            _ => HeapKind::Unknown,
        }
    }
}

/// This process's heap: its kind and the signature it was told by (`None` where the header could
/// not be read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessHeap {
    /// The heap's kind.
    pub kind: HeapKind,
    /// The signature read from the heap's header (`None`: unreadable).
    pub signature: Option<u32>,
}

/// The process heap's kind, read from its header in this process (`ReadProcessMemory` of our own
/// process: a header that is not there fails the read instead of faulting).
pub fn process_heap() -> ProcessHeap {
    // SAFETY: no arguments; the process heap exists for the process's whole life.
    let heap = unsafe { GetProcessHeap() };
    let mut signature = 0u32;
    let mut read = 0usize;
    let ok = !heap.is_null() && {
        // SAFETY: GetCurrentProcess's pseudo handle may read our own memory; the destination is a
        // local u32 of the size passed; an unreadable source makes the call fail, not fault.
        unsafe {
            ReadProcessMemory(
                GetCurrentProcess(),
                (heap as usize + 16) as *const c_void,
                (&raw mut signature).cast(),
                size_of::<u32>(),
                &mut read,
            ) != 0
        }
    };
    let signature = (ok && read == size_of::<u32>()).then_some(signature);
    ProcessHeap { kind: HeapKind::from_signature(signature, super::probe::wine_version().is_some()), signature }
}

/// `path` as a NUL-terminated wide string.
fn wide(path: &Path) -> Vec<u16> {
    use std::os::windows::ffi::OsStrExt;
    path.as_os_str().encode_wide().chain(Some(0)).collect()
}

/// An executable loaded as data (its resources only, no code run), freed on drop.
struct DataFile(HMODULE);

impl DataFile {
    fn open(path: &Path) -> io::Result<DataFile> {
        let name = wide(path);
        // SAFETY: a NUL-terminated wide path; as a data file nothing in it runs.
        let m = unsafe {
            LoadLibraryExW(
                name.as_ptr(),
                std::ptr::null_mut(),
                LOAD_LIBRARY_AS_DATAFILE | LOAD_LIBRARY_AS_IMAGE_RESOURCE,
            )
        };
        if m.is_null() {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("loading {} as a data file: {e}", path.display())));
        }
        Ok(DataFile(m))
    }
}

impl Drop for DataFile {
    fn drop(&mut self) {
        // SAFETY: the module LoadLibraryExW gave us; nothing refers to its resources any more.
        unsafe { FreeLibrary(self.0) };
    }
}

/// The process manifest (`RT_MANIFEST` 1) of the executable at `path`, or `None` where it has
/// none.
pub fn exe_manifest(path: &Path) -> io::Result<Option<Vec<u8>>> {
    let file = DataFile::open(path)?;
    // SAFETY: a module loaded as a data file; integer resource names made as MAKEINTRESOURCE does.
    let res = unsafe { FindResourceW(file.0, PROCESS_MANIFEST, RT_MANIFEST) };
    if res.is_null() {
        return Ok(None);
    }
    // SAFETY: `res` was found in `file`, which stays loaded while we copy.
    let (size, data) = unsafe { (SizeofResource(file.0, res), LockResource(LoadResource(file.0, res))) };
    if data.is_null() {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("reading the manifest of {}: {e}", path.display())));
    }
    // SAFETY: LockResource's pointer addresses the resource's `size` bytes inside the loaded file.
    Ok(Some(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), size as usize) }.to_vec()))
}

/// A resource's type or name as `EnumResource*W` passes it: an integer id (`MAKEINTRESOURCE`,
/// below 0x10000), or `None` for a name given as a string.
fn id(p: PCWSTR) -> Option<u16> {
    u16::try_from(p as usize).ok()
}

/// Collects each resource type into the `Vec<Option<u16>>` that `lparam` points to.
unsafe extern "system" fn push_type(_module: HMODULE, kind: PCWSTR, lparam: isize) -> windows_sys::core::BOOL {
    // SAFETY: `lparam` is the `&mut Vec<Option<u16>>` that `only_the_manifest` passed, alive for
    // the call.
    unsafe { (*(lparam as *mut Vec<Option<u16>>)).push(id(kind)) };
    1
}

/// Collects each name of a resource type into the `Vec<Option<u16>>` that `lparam` points to.
unsafe extern "system" fn push_name(
    _module: HMODULE,
    _kind: PCWSTR,
    name: PCWSTR,
    lparam: isize,
) -> windows_sys::core::BOOL {
    // SAFETY: as in `push_type`.
    unsafe { (*(lparam as *mut Vec<Option<u16>>)).push(id(name)) };
    1
}

/// Whether the executable's resources are its process manifest and nothing else: `Ok(false)`
/// where it has no resources at all, an error naming the others where it has more.
fn only_the_manifest(path: &Path) -> io::Result<bool> {
    let file = DataFile::open(path)?;
    let mut types: Vec<Option<u16>> = Vec::new();
    let mut names: Vec<Option<u16>> = Vec::new();
    // SAFETY: a module loaded as a data file; the callbacks only push into the vectors, which
    // outlive the calls. A file without resources fails the call: no types.
    unsafe {
        EnumResourceTypesW(file.0, Some(push_type), (&raw mut types) as isize);
        EnumResourceNamesW(file.0, RT_MANIFEST, Some(push_name), (&raw mut names) as isize);
    }
    match (types.as_slice(), names.as_slice()) {
        ([], _) => Ok(false),
        ([Some(24)], [Some(1)]) => Ok(true),
        _ => Err(io::Error::other(format!(
            "{} has resources besides its manifest (types {types:?}, manifests {names:?}): taking the manifest \
             out would delete them too",
            path.display()
        ))),
    }
}

/// Takes the process manifest (`RT_MANIFEST` 1) out of the executable at `path`: a process started
/// from it has the heap the system gives an executable without one. The file must be a copy nothing
/// runs from, whose only resource is that manifest (what `emuhost.exe` has; anything else is an
/// error, not deleted). Every resource is deleted (`BeginUpdateResourceW` with
/// `bDeleteExistingResources`, then `EndUpdateResourceW`): Wine 8 keeps a resource that
/// `UpdateResourceW` with no data should delete, and this way is the same on Windows and Wine.
/// An executable with no resources is left as it is.
pub fn strip_manifest(path: &Path) -> io::Result<()> {
    if !only_the_manifest(path)? {
        return Ok(());
    }
    let failed = |what: &str| {
        let e = io::Error::last_os_error();
        io::Error::new(e.kind(), format!("{what} of {}: {e}", path.display()))
    };
    let name = wide(path);
    // SAFETY: a NUL-terminated wide path; TRUE: the update starts with no resources.
    let update = unsafe { BeginUpdateResourceW(name.as_ptr(), 1) };
    if update.is_null() {
        return Err(failed("opening the resources"));
    }
    // SAFETY: the update handle above, written (FALSE); the call closes the handle.
    if unsafe { EndUpdateResourceW(update, 0) } == 0 {
        return Err(failed("writing the resources"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heap_kind_comes_from_the_signature_and_wine() {
        assert_eq!(HeapKind::from_signature(Some(SEGMENT_SIGNATURE), false), HeapKind::Segment);
        assert_eq!(HeapKind::from_signature(Some(NT_SIGNATURE), false), HeapKind::Nt);
        assert_eq!(HeapKind::from_signature(Some(0x1234), false), HeapKind::Unknown);
        assert_eq!(HeapKind::from_signature(None, false), HeapKind::Unknown);
        assert_eq!(HeapKind::from_signature(Some(NT_SIGNATURE), true), HeapKind::Wine);
        assert_eq!((id(24 as PCWSTR), id(0x1_0000 as PCWSTR)), (Some(24), None));
        // This process: a test binary has no manifest, so Windows gives it the NT heap (unless the
        // system forces the segment heap for it); Wine always its own.
        let h = process_heap();
        let wine = super::super::probe::wine_version().is_some();
        assert!(h.signature.is_some(), "{h:?}");
        if wine {
            assert_eq!(h.kind, HeapKind::Wine, "{h:?}");
        } else {
            assert!(matches!(h.kind, HeapKind::Nt | HeapKind::Segment), "{h:?}");
        }
    }

    #[test]
    fn a_test_binary_has_no_manifest_to_strip() {
        let exe = std::env::current_exe().unwrap();
        assert_eq!(exe_manifest(&exe).unwrap(), None);
        assert!(!only_the_manifest(&exe).unwrap());
        strip_manifest(&exe).unwrap(); // no resources: left as it is (no write to a running exe)
        let e = exe_manifest(Path::new("C:\\no\\such\\file.exe")).unwrap_err();
        assert!(e.to_string().contains("file.exe"), "{e}");
    }
}
