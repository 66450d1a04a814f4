//! `emuhost_error_t`: what a failed call returns. The caller owns it: read it with
//! `emuhost_error_code` and `emuhost_error_message`, then `emuhost_error_delete` it.

use std::ffi::c_char;

use emuhost::import::ImportError;
use emuhost::settings::SettingError;
use emuhost::snapshot::SnapshotError;
use emuhost::space::SpaceError;
use emuhost::watch::WatchError;

use crate::handle::{self, Kind};

/// A NULL pointer where one was needed (a handle, an out-pointer, a buffer of non-zero length).
pub const EMUHOST_ERROR_NULL: u32 = 1;
/// A handle that is not a live one of the kind asked for (deleted already, or of another kind).
pub const EMUHOST_ERROR_BAD_HANDLE: u32 = 2;
/// An argument that is not valid: unaligned or empty ranges, unknown flag bits or constants,
/// text that is not UTF-8, a buffer too small, an id that is not live (a pool's, a snapshot's).
pub const EMUHOST_ERROR_INVALID_ARGUMENT: u32 = 3;
/// A range outside the guest window (or past a section's end, or bytes a snapshot does not hold).
pub const EMUHOST_ERROR_OUT_OF_RANGE: u32 = 4;
/// The runtime refused the operation as things stand: held pages, a mapping that is not the
/// space's own, a second tracker on a space, an import refused or cooling, a budget spent, a
/// snapshot's restore refused (held pages, a shared view, guest writes beside it).
pub const EMUHOST_ERROR_REFUSED: u32 = 5;
/// A backend or a platform feature that is not available here: no userfaultfd, no Vulkan device,
/// no CUDA driver (`libcuda.so.1`, `nvcuda.dll`), a watch backend of the other platform (uffd and
/// mprotect on Windows, writewatch and guard on Linux); on Windows, shared views (sections) in a
/// space without placeholders (before Windows 10 1803, Wine 8) or over an adopted window, and a
/// view that would cut a committed private allocation whose other pages hold data (Windows cannot
/// shrink an allocation). The message says which.
pub const EMUHOST_ERROR_UNAVAILABLE: u32 = 6;
/// A system call failed (the message names it and the OS error).
pub const EMUHOST_ERROR_OS: u32 = 7;
/// A Vulkan or CUDA call failed, or a backend's start-up check did.
pub const EMUHOST_ERROR_DEVICE: u32 = 8;
/// A setting's name or value was refused (the message names both).
pub const EMUHOST_ERROR_SETTING: u32 = 9;
/// A Rust panic inside emuhost, caught at the boundary (a bug: the message says where).
pub const EMUHOST_ERROR_PANIC: u32 = 10;
/// Anything else (the message says what).
pub const EMUHOST_ERROR_OTHER: u32 = 11;
/// Pages the space has not committed (reserved: never committed, or decommitted) where the call
/// needs committed ones: a zero, populate, read or write there, a binding over them (the message
/// names the first run of them).
pub const EMUHOST_ERROR_NOT_COMMITTED: u32 = 12;
/// Committed pages whose protection does not allow the call: a write to read-only pages, a read
/// of inaccessible ones (the message names the first run of them and their protection).
pub const EMUHOST_ERROR_PROTECTION: u32 = 13;
/// Something is mapped where the call would map: `emuhost_space_reserve_at` over a mapping
/// (the message names it).
pub const EMUHOST_ERROR_EXISTS: u32 = 14;

/// An error a call returned (opaque). Owned by the caller: delete it with `emuhost_error_delete`.
///
/// Thread safety: an error may be read from several threads at once and deleted from any thread.
pub struct emuhost_error_t {
    _private: [u8; 0],
}

/// A failed call's code and message.
#[derive(Debug)]
pub(crate) struct Error {
    code: u32,
    message: String,
}

impl Kind for Error {
    type C = emuhost_error_t;
    const NAME: &'static str = "error";
}

impl Error {
    pub(crate) fn new(code: u32, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(EMUHOST_ERROR_INVALID_ARGUMENT, message)
    }

    pub(crate) fn panic(payload: &(dyn std::any::Any + Send)) -> Self {
        let what = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(a panic payload that is not text)");
        Self::new(EMUHOST_ERROR_PANIC, format!("emuhost panicked (a bug; please report it): {what}"))
    }

    /// The error as an owned C handle.
    pub(crate) fn into_handle(self) -> *mut emuhost_error_t {
        handle::register(self)
    }

    /// `e` and its sources on one line, with `code`.
    fn chain(code: u32, e: &dyn std::error::Error) -> Self {
        Self::new(code, emuhost::import::error_chain(e))
    }
}

fn space_code(e: &SpaceError) -> u32 {
    match e {
        SpaceError::OutOfWindow { .. } | SpaceError::PastSection { .. } => EMUHOST_ERROR_OUT_OF_RANGE,
        SpaceError::ZeroLength { .. }
        | SpaceError::Unaligned { .. }
        | SpaceError::BadWindow { .. }
        | SpaceError::BadPlacement { .. }
        | SpaceError::NoSection(_) => EMUHOST_ERROR_INVALID_ARGUMENT,
        SpaceError::Adopt { .. }
        | SpaceError::Held { .. }
        | SpaceError::Foreign { .. }
        | SpaceError::NotWritable { .. }
        | SpaceError::OtherProcess { .. } => EMUHOST_ERROR_REFUSED,
        SpaceError::NotCommitted { .. } => EMUHOST_ERROR_NOT_COMMITTED,
        SpaceError::Protection { .. } => EMUHOST_ERROR_PROTECTION,
        SpaceError::Exists { .. } => EMUHOST_ERROR_EXISTS,
        // What the platform cannot do (Windows: views without placeholders), not a failed call.
        SpaceError::Os { source, .. } if source.kind() == std::io::ErrorKind::Unsupported => EMUHOST_ERROR_UNAVAILABLE,
        SpaceError::Reserve { .. } | SpaceError::ReserveAt { .. } | SpaceError::Os { .. } => EMUHOST_ERROR_OS,
        // What the space module may add (its errors are `#[non_exhaustive]`).
        _ => EMUHOST_ERROR_OTHER,
    }
}

impl From<SpaceError> for Error {
    fn from(e: SpaceError) -> Self {
        Self::chain(space_code(&e), &e)
    }
}

fn watch_code(e: &WatchError) -> u32 {
    match e {
        WatchError::Space(s) => space_code(s),
        WatchError::Unavailable { .. } | WatchError::SelfTest { .. } | WatchError::NoBackend { .. } => {
            EMUHOST_ERROR_UNAVAILABLE
        }
        WatchError::Os { .. } => EMUHOST_ERROR_OS,
        WatchError::SecondTracker { .. } | WatchError::OtherProcess { .. } => EMUHOST_ERROR_REFUSED,
        WatchError::BadGranularity { .. } | WatchError::WordsTooShort { .. } => EMUHOST_ERROR_INVALID_ARGUMENT,
        // Verify mode's mismatch, and what the watch module may add.
        _ => EMUHOST_ERROR_OTHER,
    }
}

impl From<WatchError> for Error {
    fn from(e: WatchError) -> Self {
        Self::chain(watch_code(&e), &e)
    }
}

fn snapshot_code(e: &SnapshotError) -> u32 {
    match e {
        SnapshotError::Space(s) => space_code(s),
        SnapshotError::Watch(w) => watch_code(w),
        // An id is a number, not a handle: an unknown one is a bad argument, as a pool's is.
        SnapshotError::UnknownSnapshot(_) => EMUHOST_ERROR_INVALID_ARGUMENT,
        // A read of a snapshot's bytes outside its range or its committed pages.
        SnapshotError::NoBytes { .. } => EMUHOST_ERROR_OUT_OF_RANGE,
        // Held pages and a shared view are refused before anything changes; writes beside a
        // restore make it refuse the snapshot's bytes for those pages (the message counts them).
        SnapshotError::Held { .. } | SnapshotError::Views { .. } | SnapshotError::ConcurrentWrites { .. } => {
            EMUHOST_ERROR_REFUSED
        }
        // What the snapshot module may add (its errors are `#[non_exhaustive]`).
        _ => EMUHOST_ERROR_OTHER,
    }
}

impl From<SnapshotError> for Error {
    fn from(e: SnapshotError) -> Self {
        Self::chain(snapshot_code(&e), &e)
    }
}

fn import_code(e: &ImportError) -> u32 {
    match e {
        ImportError::Space(s) => space_code(s),
        ImportError::OutOfWindow { .. } => EMUHOST_ERROR_OUT_OF_RANGE,
        ImportError::NotCommitted { .. } => EMUHOST_ERROR_NOT_COMMITTED,
        ImportError::BadChunk { .. }
        | ImportError::EmptyBinding { .. }
        | ImportError::BindingWraps { .. }
        | ImportError::CoverWraps { .. }
        | ImportError::ChunkTooLarge { .. }
        | ImportError::BadPool { .. }
        | ImportError::Unaligned { .. } => EMUHOST_ERROR_INVALID_ARGUMENT,
        ImportError::Cooling { .. } | ImportError::Import { .. } | ImportError::Budget { .. } => EMUHOST_ERROR_REFUSED,
        ImportError::Unavailable { .. } => EMUHOST_ERROR_UNAVAILABLE,
        ImportError::Vulkan { .. } | ImportError::Cuda { .. } | ImportError::Verify { .. } => EMUHOST_ERROR_DEVICE,
        // What the import module may add (its errors are `#[non_exhaustive]`).
        _ => EMUHOST_ERROR_OTHER,
    }
}

impl From<ImportError> for Error {
    fn from(e: ImportError) -> Self {
        Self::chain(import_code(&e), &e)
    }
}

impl From<SettingError> for Error {
    fn from(e: SettingError) -> Self {
        Self::chain(EMUHOST_ERROR_SETTING, &e)
    }
}

/// The error's code (`EMUHOST_ERROR_*`); `EMUHOST_ERROR_NULL` for NULL, `EMUHOST_ERROR_BAD_HANDLE`
/// where `error` is not a live error.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_error_code(error: *const emuhost_error_t) -> u32 {
    crate::entry_or(EMUHOST_ERROR_PANIC, || {
        handle::get::<Error>(error, "emuhost_error_code").map_or_else(|e| e.code, |e| e.code)
    })
}

/// Copies the error's message into `buf` (at most `cap - 1` bytes and a NUL, cut at a character
/// boundary), as `snprintf` does, and returns the message's full length in bytes (without the
/// NUL): a return value of `cap` or more means it was cut. `buf` may be NULL when `cap` is 0 (to
/// ask for the length). Where `error` is not a live error, the message says so.
///
/// # Safety
/// `buf` is NULL or points to `cap` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_error_message(error: *const emuhost_error_t, buf: *mut c_char, cap: usize) -> usize {
    crate::entry_or(0, || {
        let message = match handle::get::<Error>(error, "emuhost_error_message") {
            Ok(e) => e.message.clone(),
            Err(e) => e.message,
        };
        // SAFETY: the caller vouches for `buf` and `cap`.
        unsafe { crate::ffi::copy_str(&message, buf, cap) }
    })
}

/// Deletes an error. NULL does nothing. Returns false (and deletes nothing) where `error` is not
/// a live error: deleted already, or not an error handle.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_error_delete(error: *mut emuhost_error_t) -> bool {
    crate::entry_or(false, || handle::delete::<Error>(error).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the platform cannot do (an OS layer's `Unsupported`: on Windows, shared views without
    /// placeholders) is `UNAVAILABLE`; a call that failed is still `OS`.
    #[test]
    fn an_unsupported_platform_feature_is_unavailable_and_a_failed_call_os() {
        let io = |kind| std::io::Error::new(kind, "why");
        let os = |source| SpaceError::Os { op: "map section", addr: 0, len: 0x1000, source };
        assert_eq!(space_code(&os(io(std::io::ErrorKind::Unsupported))), EMUHOST_ERROR_UNAVAILABLE);
        assert_eq!(space_code(&os(io(std::io::ErrorKind::PermissionDenied))), EMUHOST_ERROR_OS);
        let e = Error::from(os(io(std::io::ErrorKind::Unsupported)));
        assert_eq!((e.code, e.message.as_str()), (EMUHOST_ERROR_UNAVAILABLE, "map section 0x0+0x1000 failed: why"));
    }

    /// Each snapshot error has its code: an unknown id is a bad argument (as a pool's), what a
    /// restore refuses is `REFUSED`, and a space's or a tracker's error keeps its own code.
    #[test]
    fn each_snapshot_error_has_its_code() {
        use emuhost::snapshot::SnapshotId;
        use emuhost::space::{GuestAddr, GuestRange, page_size};
        let range = GuestRange::new(GuestAddr(0), 4 * page_size()).unwrap();
        let id = SnapshotId::new(7);
        let cases = [
            (SnapshotError::UnknownSnapshot(id), EMUHOST_ERROR_INVALID_ARGUMENT, "snapshot 7 is not live"),
            (SnapshotError::Held { id, range, held: range }, EMUHOST_ERROR_REFUSED, "a hold keeps mapped"),
            (SnapshotError::Views { range, view: range }, EMUHOST_ERROR_REFUSED, "shared view"),
            (SnapshotError::ConcurrentWrites { id, pages: 3, first: range }, EMUHOST_ERROR_REFUSED, "3 pages written"),
            (SnapshotError::NoBytes { id, addr: GuestAddr(0), range }, EMUHOST_ERROR_OUT_OF_RANGE, "holds no bytes"),
            (
                SnapshotError::Space(SpaceError::OutOfWindow { addr: 0, len: 1, window: 0 }),
                EMUHOST_ERROR_OUT_OF_RANGE,
                "",
            ),
            (SnapshotError::Watch(WatchError::SecondTracker { base: 0 }), EMUHOST_ERROR_REFUSED, ""),
        ];
        for (e, code, says) in cases {
            let what = format!("{e:?}");
            let e = Error::from(e);
            assert_eq!(e.code, code, "{what}: {}", e.message);
            assert!(e.message.contains(says), "{what}: {}", e.message);
        }
    }
}
