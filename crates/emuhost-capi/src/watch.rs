//! `emuhost_tracker_t`: what the guest wrote (`emuhost::watch`).

use std::ffi::c_char;
use std::sync::Arc;

use emuhost::space::page_size;
use emuhost::watch::{BackendKind, Tracker};

use crate::entry;
use crate::error::{Error, emuhost_error_t};
use crate::ffi::{put, slice_mut};
use crate::handle::{self, Kind};
use crate::settings::emuhost_settings_t;
use crate::space::emuhost_space_t;

/// The backend the self-test picks (userfaultfd, then mprotect), or the one `EMUHOST_WATCH` in
/// the settings forces.
pub const EMUHOST_WATCH_AUTO: u32 = 0;
/// userfaultfd write-protect (async) read by `PAGEMAP_SCAN` (Linux 6.7+).
pub const EMUHOST_WATCH_UFFD: u32 = 1;
/// `mprotect` and a `SIGSEGV` handler (portable).
pub const EMUHOST_WATCH_MPROTECT: u32 = 2;

/// A write tracker on a space (opaque); one per space.
///
/// Thread safety: every call may be made from any thread, concurrently; collects run one at a
/// time. The guest may write armed pages from any thread meanwhile. The tracker keeps its space
/// alive. With the mprotect backend emuhost installs a `SIGSEGV` handler that chains to the one
/// installed before it.
pub struct emuhost_tracker_t {
    _private: [u8; 0],
}

impl Kind for Tracker {
    type C = emuhost_tracker_t;
    const NAME: &'static str = "tracker";
}

/// What a collect found besides the pages.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct emuhost_collect_t {
    /// The number of written pages, written to the caller's array.
    pub pages: usize,
    /// Armed spans found not tracked any more (released behind the space's back).
    pub untracked: usize,
    /// The collect's number (1, 2, ... in the order the tracker's collects ran).
    pub seq: u64,
}

fn kind_of(backend: u32) -> Result<Option<BackendKind>, Error> {
    match backend {
        EMUHOST_WATCH_AUTO => Ok(None),
        EMUHOST_WATCH_UFFD => Ok(Some(BackendKind::Uffd)),
        EMUHOST_WATCH_MPROTECT => Ok(Some(BackendKind::Mprotect)),
        _ => Err(Error::invalid(format!("backend {backend} is not one of EMUHOST_WATCH_AUTO, _UFFD, _MPROTECT"))),
    }
}

fn code_of(kind: BackendKind) -> u32 {
    match kind {
        BackendKind::Uffd => EMUHOST_WATCH_UFFD,
        BackendKind::Mprotect => EMUHOST_WATCH_MPROTECT,
    }
}

/// A tracker on `space`. `backend`: `EMUHOST_WATCH_AUTO` (the settings' `EMUHOST_WATCH`, else the
/// first backend that passes its self-test), or one backend, which must pass its self-test.
/// `settings` may be NULL (defaults); `EMUHOST_VERIFY_COLLECT` in them turns verify mode on. A
/// second tracker on a space is `EMUHOST_ERROR_REFUSED`.
///
/// # Safety
/// `out` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_tracker_new(
    space: *const emuhost_space_t,
    settings: *const emuhost_settings_t,
    backend: u32,
    out: *mut *mut emuhost_tracker_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = crate::space::get(space, "emuhost_tracker_new")?;
        let settings = crate::settings::read(settings, "emuhost_tracker_new")?;
        crate::ffi::check_ptr(out, "the out-pointer")?;
        let tracker = match kind_of(backend)? {
            None => Tracker::new_with(&s, &settings)?,
            Some(kind) => {
                emuhost::watch::self_test(kind)?;
                Tracker::build(&s, kind, settings.verify_collect)?
            }
        };
        // SAFETY: as the caller vouches.
        unsafe { handle::give(out, tracker) }
    })
}

/// Deletes the tracker: armed pages get their protection back. NULL does nothing; a handle
/// deleted already is `EMUHOST_ERROR_BAD_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_tracker_delete(tracker: *mut emuhost_tracker_t) -> *mut emuhost_error_t {
    entry(|| handle::delete::<Tracker>(tracker))
}

fn get(tracker: *const emuhost_tracker_t, what: &str) -> Result<Arc<Tracker>, Error> {
    handle::get::<Tracker>(tracker, what)
}

/// The tracker's backend (`EMUHOST_WATCH_UFFD` or `EMUHOST_WATCH_MPROTECT`).
///
/// # Safety
/// `backend` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_tracker_backend(
    tracker: *const emuhost_tracker_t,
    backend: *mut u32,
) -> *mut emuhost_error_t {
    entry(|| {
        let t = get(tracker, "emuhost_tracker_backend")?;
        // SAFETY: as the caller vouches.
        unsafe { put(backend, "backend", code_of(t.kind())) }
    })
}

/// The name of a backend constant (`"auto"`, `"uffd"`, `"mprotect"`; static storage), or NULL for
/// a value that is none.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_watch_backend_name(backend: u32) -> *const c_char {
    match backend {
        EMUHOST_WATCH_AUTO => c"auto".as_ptr(),
        EMUHOST_WATCH_UFFD => c"uffd".as_ptr(),
        EMUHOST_WATCH_MPROTECT => c"mprotect".as_ptr(),
        _ => std::ptr::null(),
    }
}

/// Arms `addr..addr + len`: writes to its pages from now on are reported by the next collect.
/// Pages armed already keep their writes.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_tracker_arm(tracker: *const emuhost_tracker_t, addr: u64, len: u64) -> *mut emuhost_error_t {
    entry(|| {
        let t = get(tracker, "emuhost_tracker_arm")?;
        Ok(t.arm(emuhost::space::GuestRange::new(emuhost::space::GuestAddr(addr), len)?)?)
    })
}

/// Stops tracking `addr..addr + len` (its pages get their protection back).
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_tracker_disarm(
    tracker: *const emuhost_tracker_t,
    addr: u64,
    len: u64,
) -> *mut emuhost_error_t {
    entry(|| {
        let t = get(tracker, "emuhost_tracker_disarm")?;
        Ok(t.disarm(emuhost::space::GuestRange::new(emuhost::space::GuestAddr(addr), len)?)?)
    })
}

/// Collects the pages of `addr..addr + len` written since the last collect, and arms them again
/// in the same step. Their guest addresses go to `pages`, in order; `result` receives their
/// number, the untracked spans' number and the collect's number.
///
/// `cap` must be at least the range's page count (`len / page_size`): checked before anything is
/// collected, so no write is ever consumed without being handed over.
///
/// # Safety
/// `pages` points to `cap` writable values; `result` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_tracker_collect(
    tracker: *const emuhost_tracker_t,
    addr: u64,
    len: u64,
    pages: *mut u64,
    cap: usize,
    result: *mut emuhost_collect_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let t = get(tracker, "emuhost_tracker_collect")?;
        let range = emuhost::space::GuestRange::new(emuhost::space::GuestAddr(addr), len)?;
        if (cap as u64) < range.pages() {
            return Err(Error::invalid(format!(
                "collect of {range}: room for {cap} pages, the range has {} (len / page size {:#x})",
                range.pages(),
                page_size()
            )));
        }
        crate::ffi::check_ptr(result, "result")?;
        // SAFETY: as the caller vouches.
        let pages = unsafe { slice_mut(pages, cap, "pages") }?;
        let got = t.collect(range)?;
        let mut n = 0;
        for a in got.page_addrs() {
            pages[n] = a.0;
            n += 1;
        }
        let r = emuhost_collect_t { pages: n, untracked: got.untracked.len(), seq: got.seq };
        // SAFETY: as the caller vouches.
        unsafe { put(result, "result", r) }
    })
}
