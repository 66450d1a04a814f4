//! The handle registry: a C handle is a number, never reused in the process, that maps to the
//! runtime object (an `Arc`). A call looks the handle up and clones the `Arc`, so:
//! - NULL, a handle deleted already (a double delete), a made-up value, or a handle of another
//!   kind (a tracker passed as a space) is an error, not a use of freed or foreign memory;
//! - a delete on one thread while a call on another uses the object only drops the registry's
//!   reference: the object goes when that call returns.
//!
//! The cost is one read lock and one reference count per call.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, RwLock};

use crate::error::{EMUHOST_ERROR_BAD_HANDLE, EMUHOST_ERROR_NULL, Error};

type Entry = Arc<dyn Any + Send + Sync>;

static LIVE: LazyLock<RwLock<HashMap<usize, Entry>>> = LazyLock::new(|| RwLock::new(HashMap::new()));
/// The next handle; steps of 16 keep handles looking like aligned pointers to a debugger.
static NEXT: AtomicUsize = AtomicUsize::new(0x1000);

/// A runtime object behind a C handle type `C` (an opaque struct).
pub(crate) trait Kind: Any + Send + Sync {
    type C;
    /// The handle's name in errors ("space", "tracker").
    const NAME: &'static str;
}

fn live() -> std::sync::RwLockReadGuard<'static, HashMap<usize, Entry>> {
    // No code runs under the lock that could panic with it held; a poisoned map is still whole.
    LIVE.read().unwrap_or_else(|p| p.into_inner())
}

fn live_mut() -> std::sync::RwLockWriteGuard<'static, HashMap<usize, Entry>> {
    LIVE.write().unwrap_or_else(|p| p.into_inner())
}

/// Registers `value` and returns its new handle.
pub(crate) fn register<T: Kind>(value: T) -> *mut T::C {
    register_arc(Arc::new(value))
}

/// Registers `value` and writes its handle to `out` (checked first: a NULL `out` registers nothing).
///
/// # Safety
/// `out` is NULL or writable.
pub(crate) unsafe fn give<T: Kind>(out: *mut *mut T::C, value: Arc<T>) -> Result<(), Error> {
    crate::ffi::check_ptr(out, "the out-pointer")?;
    let h = register_arc(value);
    // SAFETY: checked non-NULL and aligned; the caller vouches that it is writable.
    unsafe { out.write(h) };
    Ok(())
}

pub(crate) fn register_arc<T: Kind>(value: Arc<T>) -> *mut T::C {
    let id = NEXT.fetch_add(16, Ordering::Relaxed);
    live_mut().insert(id, value);
    std::ptr::without_provenance_mut(id)
}

/// The object behind `handle`: an error naming `what` where it is NULL, not live, or of
/// another kind.
pub(crate) fn get<T: Kind>(handle: *const T::C, what: &str) -> Result<Arc<T>, Error> {
    if handle.is_null() {
        return Err(Error::new(EMUHOST_ERROR_NULL, format!("{what}: the {} handle is NULL", T::NAME)));
    }
    let id = handle.addr();
    let entry = live().get(&id).cloned();
    entry.and_then(|e| e.downcast::<T>().ok()).ok_or_else(|| stale::<T>(id, what))
}

/// Deletes `handle` (drops the registry's reference). NULL is nothing to do; a handle that is not
/// a live one of this kind is an error, and nothing is deleted.
pub(crate) fn delete<T: Kind>(handle: *mut T::C) -> Result<(), Error> {
    if handle.is_null() {
        return Ok(());
    }
    let id = handle.addr();
    let mut map = live_mut();
    match map.get(&id) {
        Some(e) if e.is::<T>() => {
            let gone = map.remove(&id);
            drop(map);
            // Dropped outside the lock: dropping a runtime object may log or join a thread.
            drop(gone);
            Ok(())
        }
        _ => Err(stale::<T>(id, "delete")),
    }
}

fn stale<T: Kind>(id: usize, what: &str) -> Error {
    Error::new(
        EMUHOST_ERROR_BAD_HANDLE,
        format!("{what}: {id:#x} is not a live {} handle (deleted already, or not one)", T::NAME),
    )
}
