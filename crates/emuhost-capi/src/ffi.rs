//! Checked readings of what C passes: out-pointers, buffers, strings, flags. Each returns an error
//! naming the argument where the check fails; what cannot be checked (that a non-NULL pointer
//! points to memory the caller owns) is the caller's `# Safety` contract.

use std::ffi::{CStr, c_char};

use emuhost::space::Prot;

use crate::error::{EMUHOST_ERROR_NULL, Error};

/// Readable by the guest.
pub const EMUHOST_PROT_READ: u32 = 1;
/// Writable by the guest.
pub const EMUHOST_PROT_WRITE: u32 = 2;
/// Executable by the guest.
pub const EMUHOST_PROT_EXEC: u32 = 4;

fn null(what: &str) -> Error {
    Error::new(EMUHOST_ERROR_NULL, format!("{what} is NULL"))
}

pub(crate) fn check_ptr<T>(p: *const T, what: &str) -> Result<(), Error> {
    if p.is_null() {
        return Err(null(what));
    }
    if !p.is_aligned() {
        return Err(Error::invalid(format!("{what} ({p:p}) is not aligned to {} bytes", align_of::<T>())));
    }
    Ok(())
}

/// Writes `value` to the out-pointer `p`.
///
/// # Safety
/// `p` is NULL or points to writable memory for a `T`.
pub(crate) unsafe fn put<T>(p: *mut T, what: &str, value: T) -> Result<(), Error> {
    check_ptr(p, what)?;
    // SAFETY: checked non-NULL and aligned; the caller vouches that it is writable.
    unsafe { p.write(value) };
    Ok(())
}

/// Writes `value` to `p` where `p` is not NULL (an optional out-pointer).
///
/// # Safety
/// As [`put`].
pub(crate) unsafe fn put_opt<T>(p: *mut T, what: &str, value: T) -> Result<(), Error> {
    if p.is_null() {
        return Ok(());
    }
    // SAFETY: as the caller vouches.
    unsafe { put(p, what, value) }
}

fn check_slice<T>(p: *const T, len: usize, what: &str) -> Result<bool, Error> {
    if len == 0 {
        return Ok(false);
    }
    check_ptr(p, what)?;
    if len.checked_mul(size_of::<T>()).is_none_or(|b| b > isize::MAX as usize) {
        return Err(Error::invalid(format!("{what}: {len} elements is more than memory holds")));
    }
    Ok(true)
}

/// The `len` elements at `p` (`p` may be NULL where `len` is 0).
///
/// # Safety
/// Where `len` > 0, `p` points to `len` readable, initialised elements that nothing writes while
/// the returned slice lives.
pub(crate) unsafe fn slice<'a, T>(p: *const T, len: usize, what: &str) -> Result<&'a [T], Error> {
    if !check_slice(p, len, what)? {
        return Ok(&[]);
    }
    // SAFETY: checked non-NULL, aligned and not too long; the caller vouches for the rest.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// The `len` elements at `p`, to write (`p` may be NULL where `len` is 0).
///
/// # Safety
/// Where `len` > 0, `p` points to `len` writable elements that nothing else reads or writes while
/// the returned slice lives.
pub(crate) unsafe fn slice_mut<'a, T>(p: *mut T, len: usize, what: &str) -> Result<&'a mut [T], Error> {
    if !check_slice(p, len, what)? {
        return Ok(&mut []);
    }
    // SAFETY: as in `slice`.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
}

/// The NUL-terminated UTF-8 text at `p`.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string.
pub(crate) unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Error> {
    if p.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-NULL; the caller vouches for the terminator.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|e| Error::invalid(format!("{what} is not UTF-8: {e}")))
}

/// Copies `s` into `buf` as `snprintf` does (at most `cap - 1` bytes, cut at a character boundary,
/// and a NUL) and returns `s`'s length. Nothing is written where `buf` is NULL or `cap` is 0.
///
/// # Safety
/// `buf` is NULL or points to `cap` writable bytes.
pub(crate) unsafe fn copy_str(s: &str, buf: *mut c_char, cap: usize) -> usize {
    if buf.is_null() || cap == 0 {
        return s.len();
    }
    let mut n = s.len().min(cap - 1);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    // SAFETY: `buf` holds `cap` > `n` bytes (the caller vouches); `s` does not overlap it (it is
    // Rust-owned).
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), n);
        buf.add(n).write(0);
    }
    s.len()
}

/// [`copy_str`] for a fallible call: `buf` must not be NULL unless `cap` is 0, and the full length
/// goes to `len` (may be NULL).
///
/// # Safety
/// `buf` as in [`copy_str`]; `len` is NULL or writable.
pub(crate) unsafe fn put_str(s: &str, buf: *mut c_char, cap: usize, len: *mut usize, what: &str) -> Result<(), Error> {
    if buf.is_null() && cap > 0 {
        return Err(null(what));
    }
    // SAFETY: as the caller vouches.
    let n = unsafe { copy_str(s, buf, cap) };
    // SAFETY: as the caller vouches.
    unsafe { put_opt(len, "the length out-pointer", n) }
}

/// Protection flags (`EMUHOST_PROT_*`); other bits are an error.
pub(crate) fn prot(bits: u32) -> Result<Prot, Error> {
    let all = EMUHOST_PROT_READ | EMUHOST_PROT_WRITE | EMUHOST_PROT_EXEC;
    if bits & !all != 0 {
        return Err(Error::invalid(format!("protection {bits:#x} has bits other than EMUHOST_PROT_* ({all:#x})")));
    }
    Ok(Prot {
        read: bits & EMUHOST_PROT_READ != 0,
        write: bits & EMUHOST_PROT_WRITE != 0,
        exec: bits & EMUHOST_PROT_EXEC != 0,
    })
}
