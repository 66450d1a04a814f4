//! `emuhost_tracker_t`: what the guest wrote (`emuhost::watch`).

use std::ffi::c_char;
use std::sync::Arc;

use emuhost::space::{GuestAddr, GuestRange, page_size};
use emuhost::watch::{BackendKind, Consumer, OwnedHostWrite, Tracker, Written};

use crate::entry;
use crate::error::{Error, emuhost_error_t};
use crate::ffi::{put, slice_mut};
use crate::handle::{self, Kind};
use crate::settings::emuhost_settings_t;
use crate::space::emuhost_space_t;

/// The backend the self-test picks (Linux: userfaultfd, then mprotect; Windows: write watch, then
/// guard), or the one `EMUHOST_WATCH` in the settings forces. The other platform's backends are
/// `EMUHOST_ERROR_UNAVAILABLE`.
pub const EMUHOST_WATCH_AUTO: u32 = 0;
/// userfaultfd write-protect (async) read by `PAGEMAP_SCAN` (Linux 6.7+).
pub const EMUHOST_WATCH_UFFD: u32 = 1;
/// `mprotect` and a `SIGSEGV` handler (Linux).
pub const EMUHOST_WATCH_MPROTECT: u32 = 2;
/// `MEM_WRITE_WATCH` allocations read by `GetWriteWatch` (Windows).
pub const EMUHOST_WATCH_WRITEWATCH: u32 = 3;
/// `VirtualProtect` and a vectored exception handler (Windows; views and adopted memory).
pub const EMUHOST_WATCH_GUARD: u32 = 4;

/// A write tracker on a space (opaque); one per space.
///
/// Thread safety: every call may be made from any thread, concurrently; collects run one at a
/// time. The guest may write armed pages from any thread meanwhile. The tracker keeps its space
/// alive. With the mprotect backend emuhost installs a `SIGSEGV` handler that chains to the one
/// installed before it. On Windows, with the guard backend (and with writewatch once it arms
/// pages write watch cannot see: views, an adopted window) emuhost adds a vectored exception
/// handler, first in the chain, that takes only writes to pages a tracker armed.
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
        EMUHOST_WATCH_WRITEWATCH => Ok(Some(BackendKind::WriteWatch)),
        EMUHOST_WATCH_GUARD => Ok(Some(BackendKind::Guard)),
        _ => Err(Error::invalid(format!(
            "backend {backend} is not one of EMUHOST_WATCH_AUTO, _UFFD, _MPROTECT, _WRITEWATCH, _GUARD"
        ))),
    }
}

fn code_of(kind: BackendKind) -> u32 {
    match kind {
        BackendKind::Uffd => EMUHOST_WATCH_UFFD,
        BackendKind::Mprotect => EMUHOST_WATCH_MPROTECT,
        BackendKind::WriteWatch => EMUHOST_WATCH_WRITEWATCH,
        BackendKind::Guard => EMUHOST_WATCH_GUARD,
    }
}

/// Flag of [`emuhost_tracker_new`]: the embedder owns `SIGSEGV` (on Windows: access violations,
/// through its own vectored exception handler). emuhost installs no handler (not even for its
/// self-test); the embedder's handler calls [`emuhost_handle_fault`] (or
/// [`emuhost_fault_handle_handle`]) first for every fault and returns when it says 1 (on Windows
/// with `EXCEPTION_CONTINUE_EXECUTION`).
pub const EMUHOST_TRACKER_EMBEDDER_HANDLES_FAULTS: u32 = 1;

/// A tracker on `space`. `backend`: `EMUHOST_WATCH_AUTO` (the settings' `EMUHOST_WATCH`, else the
/// first backend that passes its self-test), or one backend, which must pass its self-test.
/// `settings` may be NULL (defaults); `EMUHOST_VERIFY_COLLECT` in them turns verify mode on.
/// `flags`: 0 or [`EMUHOST_TRACKER_EMBEDDER_HANDLES_FAULTS`]. A second tracker on a space is
/// `EMUHOST_ERROR_REFUSED`.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_tracker_new(
    space: *const emuhost_space_t,
    settings: *const emuhost_settings_t,
    backend: u32,
    flags: u32,
    out: *mut *mut emuhost_tracker_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let s = crate::space::get(space, "emuhost_tracker_new")?;
        let settings = crate::settings::read(settings, "emuhost_tracker_new")?;
        crate::ffi::check_ptr(out, "the out-pointer")?;
        if flags & !EMUHOST_TRACKER_EMBEDDER_HANDLES_FAULTS != 0 {
            return Err(Error::invalid(format!(
                "flags {flags:#x}: only EMUHOST_TRACKER_EMBEDDER_HANDLES_FAULTS ({EMUHOST_TRACKER_EMBEDDER_HANDLES_FAULTS:#x}) is known"
            )));
        }
        let embedder = flags & EMUHOST_TRACKER_EMBEDDER_HANDLES_FAULTS != 0;
        let mut config = settings.tracker_config().embedder_handles_faults(embedder);
        if let Some(kind) = kind_of(backend)? {
            config = config.backend(Some(kind));
        }
        let tracker = Tracker::new(&s, &config)?;
        // SAFETY: as the caller vouches.
        unsafe { handle::give(out, tracker) }
    })
}

/// Deletes the tracker: armed pages get their protection back. NULL does nothing; a handle
/// deleted already is `EMUHOST_ERROR_BAD_HANDLE`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_tracker_delete(tracker: *mut emuhost_tracker_t) -> *mut emuhost_error_t {
    entry(|| handle::delete::<Tracker>(tracker))
}

pub(crate) fn get(tracker: *const emuhost_tracker_t, what: &str) -> Result<Arc<Tracker>, Error> {
    handle::get::<Tracker>(tracker, what)
}

/// The tracker's backend (Linux: `EMUHOST_WATCH_UFFD` or `EMUHOST_WATCH_MPROTECT`; Windows:
/// `EMUHOST_WATCH_WRITEWATCH` or `EMUHOST_WATCH_GUARD`).
///
/// # Safety
/// `backend` is NULL or writable.
#[must_use]
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

/// The name of a backend constant (`"auto"`, `"uffd"`, `"mprotect"`, `"writewatch"`, `"guard"`;
/// static storage), or NULL for a value that is none.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_watch_backend_name(backend: u32) -> *const c_char {
    match backend {
        EMUHOST_WATCH_AUTO => c"auto".as_ptr(),
        EMUHOST_WATCH_UFFD => c"uffd".as_ptr(),
        EMUHOST_WATCH_MPROTECT => c"mprotect".as_ptr(),
        EMUHOST_WATCH_WRITEWATCH => c"writewatch".as_ptr(),
        EMUHOST_WATCH_GUARD => c"guard".as_ptr(),
        _ => std::ptr::null(),
    }
}

/// Arms `addr..addr + len`: writes to its pages from now on are reported by the next collect.
/// Pages armed already keep their writes.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_tracker_arm(tracker: *const emuhost_tracker_t, addr: u64, len: u64) -> *mut emuhost_error_t {
    entry(|| {
        let t = get(tracker, "emuhost_tracker_arm")?;
        Ok(t.arm(emuhost::space::GuestRange::new(emuhost::space::GuestAddr(addr), len)?)?)
    })
}

/// Stops tracking `addr..addr + len` (its pages get their protection back).
#[must_use]
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
#[must_use]
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

/// Hands the fault at host address `addr` (the signal's `si_addr`) to whichever tracker of the
/// process has the page armed; call it first in the embedder's `SIGSEGV` handler. `is_write`:
/// nonzero for a write fault (pass 1 where the handler cannot tell). Returns 1 in exactly two
/// cases: the page is armed by a tracker (it is writable now and marked written), or a disarm
/// (or a tracker's delete) gave this page its writable protection back and this is the first
/// fault on it since (a write that faulted before). Return from the handler then: the CPU
/// retries the write. 0 for everything else (a page never armed, one the guest or the space
/// changed after its disarm, a repeat, a page of a deleted space): handle it, or chain to the
/// previous handler.
///
/// Windows: call it first in the embedder's vectored exception handler for an
/// `EXCEPTION_ACCESS_VIOLATION`, with `addr` = `ExceptionInformation[1]` and `is_write` =
/// `ExceptionInformation[0] == 1`; on 1 return `EXCEPTION_CONTINUE_EXECUTION`, else go on
/// (`EXCEPTION_CONTINUE_SEARCH`, or the handler's own work).
///
/// Async-signal-safe: no allocation, no lock, no panic. With the uffd and writewatch backends
/// writes never fault, and it returns 0.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_handle_fault(addr: usize, is_write: i32) -> i32 {
    emuhost::watch::handle_fault(addr, is_write != 0) as i32
}

/// One tracker's fault entry, for a handler that routes faults to trackers itself (opaque). Like
/// every handle it is a number, not an address: an encoded slot and generation in a fixed table
/// that [`emuhost_fault_handle_handle`] reads with atomics only (no lock), so a handle deleted
/// already (twice), of another kind, or made up takes no fault and is never read through. It
/// stays valid after its tracker is deleted, when it takes no fault.
pub struct emuhost_fault_handle_t {
    _private: [u8; 0],
}

/// The most fault handles live at once: [`emuhost_tracker_fault_handle`] past it is
/// `EMUHOST_ERROR_REFUSED`.
pub const EMUHOST_FAULT_HANDLES_MAX: u32 = 1024;

/// A new fault handle of the tracker, for [`emuhost_fault_handle_handle`]; delete it with
/// [`emuhost_fault_handle_delete`]. Each call gives a handle of its own; at most
/// [`EMUHOST_FAULT_HANDLES_MAX`] are live at once.
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_tracker_fault_handle(
    tracker: *const emuhost_tracker_t,
    out: *mut *mut emuhost_fault_handle_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let t = get(tracker, "emuhost_tracker_fault_handle")?;
        crate::ffi::check_ptr(out, "the out-pointer")?;
        let h = crate::fault::insert(t.fault_handle()).ok_or_else(|| {
            Error::new(
                crate::error::EMUHOST_ERROR_REFUSED,
                format!(
                    "emuhost_tracker_fault_handle: {EMUHOST_FAULT_HANDLES_MAX} fault handles are live \
                     (EMUHOST_FAULT_HANDLES_MAX): delete one first"
                ),
            )
        })?;
        // SAFETY: checked non-NULL and aligned; the caller vouches that it is writable.
        unsafe { out.write(std::ptr::without_provenance_mut(h)) };
        Ok(())
    })
}

/// [`emuhost_handle_fault`] for this handle's tracker only. Returns 0 for NULL, a deleted
/// handle, or anything that is not a live fault handle (another kind of handle, a made-up value):
/// it is checked, never read through. Async-signal-safe (atomics only: no lock, no allocation,
/// no panic).
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_fault_handle_handle(
    handle: *const emuhost_fault_handle_t,
    addr: usize,
    is_write: i32,
) -> i32 {
    match crate::fault::get(handle.addr()) {
        Some(h) => h.handle_fault(addr, is_write != 0) as i32,
        None => 0,
    }
}

/// Deletes a fault handle: true where it did, or where `handle` is NULL (nothing to do); false
/// where `handle` is not a live fault handle (deleted already, another kind of handle, a made-up
/// value), and then nothing changes, so a second delete is harmless. A handler that runs with
/// the handle meanwhile takes no fault through it. Async-signal-safe.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_fault_handle_delete(handle: *mut emuhost_fault_handle_t) -> bool {
    handle.is_null() || crate::fault::remove(handle.addr())
}

/// A write of the embedder's own through the kernel into the tracker's memory, in flight (opaque):
/// from [`emuhost_tracker_host_write_begin`] to [`emuhost_host_write_end`]. It keeps its tracker
/// alive.
pub struct emuhost_host_write_t {
    _private: [u8; 0],
}

impl Kind for OwnedHostWrite {
    type C = emuhost_host_write_t;
    const NAME: &'static str = "host write";
}

/// Begins a write of the embedder's own into guest `addr..addr + len` that the kernel makes (a
/// `read(2)` or `recv(2)` into guest memory, an `io_uring` or driver write; on Windows a
/// `ReadFile` or `recv`): with the mprotect backend (on Windows the guard backend) such a write
/// into armed pages fails with `EFAULT` (`ERROR_NOACCESS`), since the kernel does not fault as
/// the CPU does. Until [`emuhost_host_write_end`], the armed pages of the range are writable
/// and every collect reports them written (and leaves them writable); after it, they are armed
/// again, and the next collect reports them once more (the write may have ended just before).
/// No lock is held in between: the write may block (a pipe another thread feeds), and collects,
/// commits and arms go on meanwhile (an arm of the range waits for the end). The other backends
/// (uffd, writewatch) need nothing of this and record nothing (their tracking sees the kernel's
/// writes as it sees the guest's; the begin and end are cheap there).
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_tracker_host_write_begin(
    tracker: *const emuhost_tracker_t,
    addr: u64,
    len: u64,
    out: *mut *mut emuhost_host_write_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let t = get(tracker, "emuhost_tracker_host_write_begin")?;
        crate::ffi::check_ptr(out, "the out-pointer")?;
        let w = t.host_write_owned(GuestRange::new(GuestAddr(addr), len)?)?;
        // SAFETY: as the caller vouches.
        unsafe { handle::give(out, Arc::new(w)) }
    })
}

/// Ends a host write begun by [`emuhost_tracker_host_write_begin`]: its pages are armed again.
/// NULL does nothing; one ended already is `EMUHOST_ERROR_BAD_HANDLE`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_host_write_end(write: *mut emuhost_host_write_t) -> *mut emuhost_error_t {
    entry(|| handle::delete::<OwnedHostWrite>(write))
}

/// What a collect or query into words found.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct emuhost_written_t {
    /// Pages reported written (each counted once).
    pub pages: u64,
    /// Of them, pages of spans found not tracked any more (reported written, to lose nothing).
    pub untracked_pages: u64,
    /// The tracker's collect number it belongs to.
    pub seq: u64,
}

impl From<Written> for emuhost_written_t {
    fn from(w: Written) -> Self {
        Self { pages: w.pages, untracked_pages: w.untracked_pages, seq: w.seq }
    }
}

/// The common part of the `*_collect_into` calls: the range, the words, the result.
///
/// # Safety
/// `words` points to `nwords` writable values; `result` is NULL or writable.
unsafe fn into_words(
    addr: u64,
    len: u64,
    words: *mut u64,
    nwords: usize,
    result: *mut emuhost_written_t,
    read: impl FnOnce(GuestRange, &mut [u64]) -> Result<Written, emuhost::watch::WatchError>,
) -> Result<(), Error> {
    let range = GuestRange::new(GuestAddr(addr), len)?;
    // SAFETY: as the caller vouches.
    let words = unsafe { slice_mut(words, nwords, "words") }?;
    let w = read(range, words)?;
    // SAFETY: as the caller vouches.
    unsafe { crate::ffi::put_opt(result, "result", w.into()) }
}

/// Collects (`query` 0) or queries (`query` nonzero: takes nothing, the next collect reports the
/// pages still) the written pages of `addr..addr + len` into the caller's words: bit `i` (bit
/// `i % 64` of `words[i / 64]`) is ORed in where any page of the `granularity` bytes from
/// `addr + i * granularity` was written; no bit is cleared. `granularity`: a power of two, at least the
/// page size. `nwords` must be at least `ceil(ceil(len / granularity) / 64)`; a bad granularity or
/// too few words is an error before anything is collected. Allocates nothing once warm.
///
/// # Safety
/// `words` points to `nwords` writable values; `result` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_tracker_collect_into(
    tracker: *const emuhost_tracker_t,
    addr: u64,
    len: u64,
    granularity: u64,
    words: *mut u64,
    nwords: usize,
    query: i32,
    result: *mut emuhost_written_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let t = get(tracker, "emuhost_tracker_collect_into")?;
        // SAFETY: as the caller vouches.
        unsafe {
            into_words(addr, len, words, nwords, result, |r, w| match query {
                0 => t.collect_into(r, granularity, w),
                _ => t.query_into(r, granularity, w),
            })
        }
    })
}

/// One consumer of a tracker's writes (opaque): its own dirty pages, fed by every collect of the
/// tracker, so two caches on one tracker each see every write.
///
/// Thread safety: any thread; calls on one consumer may run concurrently (they take the
/// tracker's lock). It keeps its tracker alive.
pub struct emuhost_consumer_t {
    _private: [u8; 0],
}

impl Kind for Consumer {
    type C = emuhost_consumer_t;
    const NAME: &'static str = "consumer";
}

/// A new consumer of `tracker`'s writes (see [`emuhost_consumer_t`]).
///
/// # Safety
/// `out` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_consumer_new(
    tracker: *const emuhost_tracker_t,
    out: *mut *mut emuhost_consumer_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let t = get(tracker, "emuhost_consumer_new")?;
        crate::ffi::check_ptr(out, "the out-pointer")?;
        // SAFETY: as the caller vouches.
        unsafe { handle::give(out, Arc::new(t.consumer())) }
    })
}

/// Deletes a consumer (its pending pages go with it). NULL does nothing; a handle deleted
/// already is `EMUHOST_ERROR_BAD_HANDLE`.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_consumer_delete(consumer: *mut emuhost_consumer_t) -> *mut emuhost_error_t {
    entry(|| handle::delete::<Consumer>(consumer))
}

/// [`emuhost_tracker_collect_into`] for this consumer: a collect of the tracker (feeding every
/// consumer), then this consumer's pending pages of the range into `words`; a query takes nothing.
///
/// # Safety
/// `words` points to `nwords` writable values; `result` is NULL or writable.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_consumer_collect_into(
    consumer: *const emuhost_consumer_t,
    addr: u64,
    len: u64,
    granularity: u64,
    words: *mut u64,
    nwords: usize,
    query: i32,
    result: *mut emuhost_written_t,
) -> *mut emuhost_error_t {
    entry(|| {
        let c = handle::get::<Consumer>(consumer, "emuhost_consumer_collect_into")?;
        // SAFETY: as the caller vouches.
        unsafe {
            into_words(addr, len, words, nwords, result, |r, w| match query {
                0 => c.collect_into(r, granularity, w),
                _ => c.query_into(r, granularity, w),
            })
        }
    })
}
