//! Guest addresses, page-aligned ranges and protections: types of their own, so an unchecked
//! host pointer or an odd length cannot reach the OS calls.

use std::fmt;

use super::SpaceError;
use crate::sys::mm::{RawProt, page_size as sys_page_size};

/// The host's page size in bytes.
pub fn page_size() -> u64 {
    sys_page_size() as u64
}

/// A guest address: a byte offset into the guest window (guest address 0 is the window's first
/// byte, at [`Space::host_base`](super::Space::host_base)).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GuestAddr(
    /// The offset in bytes.
    pub u64,
);

impl GuestAddr {
    /// `self + by` bytes, or `None` where that overflows `u64`.
    pub fn offset(self, by: u64) -> Option<GuestAddr> {
        self.0.checked_add(by).map(GuestAddr)
    }
}

impl fmt::Debug for GuestAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GuestAddr({:#x})", self.0)
    }
}

impl fmt::Display for GuestAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A non-empty, page-aligned guest range `start..start + len` that does not wrap.
///
/// Made by [`GuestRange::new`] or [`GuestRange::from_bounds`] (alignment checked) or by
/// [`Space::range`](super::Space::range) (inside that space's window too). It prints as
/// `start..end` in hex.
///
/// ```
/// use emuhost::space::{GuestAddr, GuestRange, SpaceError, page_size};
///
/// let page = page_size();
/// let r = GuestRange::new(GuestAddr(2 * page), 3 * page)?;
/// assert_eq!((r.start(), r.end(), r.pages()), (GuestAddr(2 * page), GuestAddr(5 * page), 3));
/// assert!(r.contains(GuestAddr(4 * page)) && !r.contains(r.end()));
/// assert_eq!(r, GuestRange::from_bounds(2 * page, 5 * page)?);
/// // Unaligned or empty ranges are errors that name them.
/// assert!(matches!(GuestRange::new(GuestAddr(1), page), Err(SpaceError::Unaligned { .. })));
/// assert!(matches!(GuestRange::new(GuestAddr(page), 0), Err(SpaceError::ZeroLength { .. })));
/// # Ok::<(), SpaceError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct GuestRange {
    start: u64,
    len: u64,
}

impl GuestRange {
    /// Checks alignment (both ends on the host page), a non-zero length and no wrap-around.
    /// Whether it lies in a window is checked by the `Space` it is used with.
    ///
    /// # Errors
    /// [`SpaceError::ZeroLength`] for `len` 0, [`SpaceError::Unaligned`] where `addr` or `len`
    /// is not a multiple of [`page_size`], [`SpaceError::OutOfWindow`] (`window` = `u64::MAX`)
    /// where the range wraps past `u64::MAX`.
    pub fn new(addr: GuestAddr, len: u64) -> Result<Self, SpaceError> {
        let page = page_size();
        if len == 0 {
            return Err(SpaceError::ZeroLength { addr: addr.0 });
        }
        if !addr.0.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(SpaceError::Unaligned { addr: addr.0, len, page });
        }
        if addr.0.checked_add(len).is_none() {
            return Err(SpaceError::OutOfWindow { addr: addr.0, len, window: u64::MAX });
        }
        Ok(Self { start: addr.0, len })
    }

    /// The range `start..end` (page-aligned, `start < end`).
    ///
    /// # Errors
    /// As [`GuestRange::new`]; `end <= start` is [`SpaceError::ZeroLength`].
    pub fn from_bounds(start: u64, end: u64) -> Result<Self, SpaceError> {
        Self::new(GuestAddr(start), end.saturating_sub(start))
    }

    /// The first guest address.
    pub fn start(self) -> GuestAddr {
        GuestAddr(self.start)
    }

    /// The guest address just past the range.
    pub fn end(self) -> GuestAddr {
        GuestAddr(self.start + self.len)
    }

    /// The length in bytes (a non-zero multiple of the page size).
    pub fn len(self) -> u64 {
        self.len
    }

    /// Never true: a `GuestRange` is never empty (for clippy's `len_without_is_empty`).
    pub fn is_empty(self) -> bool {
        false
    }

    /// The number of host pages.
    pub fn pages(self) -> u64 {
        self.len / page_size()
    }

    /// Whether `addr` lies in `start..end`.
    pub fn contains(self, addr: GuestAddr) -> bool {
        addr.0 >= self.start && addr.0 - self.start < self.len
    }
}

impl fmt::Debug for GuestRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}..{:#x}", self.start, self.start + self.len)
    }
}

impl fmt::Display for GuestRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Page protection: which accesses the pages allow (prints as `rwx`, `r--`, ...). Windows has no
/// write-only or execute-only page: there `write` or `exec` without `read` reads too (as x86
/// Linux's `PROT_WRITE` or `PROT_EXEC` alone does).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Prot {
    /// Loads allowed.
    pub read: bool,
    /// Stores allowed.
    pub write: bool,
    /// Instruction fetches allowed.
    pub exec: bool,
}

impl Prot {
    /// No access (`---`).
    pub const NONE: Prot = Prot { read: false, write: false, exec: false };
    /// Read-only (`r--`).
    pub const READ: Prot = Prot { read: true, write: false, exec: false };
    /// Read and write (`rw-`).
    pub const READ_WRITE: Prot = Prot { read: true, write: true, exec: false };
    /// Read and execute (`r-x`).
    pub const READ_EXEC: Prot = Prot { read: true, write: false, exec: true };
    /// Read, write and execute (`rwx`).
    pub const ALL: Prot = Prot { read: true, write: true, exec: true };

    pub(crate) fn raw(self) -> RawProt {
        RawProt { read: self.read, write: self.write, exec: self.exec }
    }
}

impl fmt::Debug for Prot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = |on: bool, ch: char| if on { ch } else { '-' };
        write!(f, "{}{}{}", c(self.read, 'r'), c(self.write, 'w'), c(self.exec, 'x'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_check_alignment_length_and_wrap() {
        let p = page_size();
        assert!(matches!(GuestRange::new(GuestAddr(p), 0), Err(SpaceError::ZeroLength { .. })));
        assert!(matches!(GuestRange::new(GuestAddr(1), p), Err(SpaceError::Unaligned { .. })));
        assert!(matches!(GuestRange::new(GuestAddr(p), p + 1), Err(SpaceError::Unaligned { .. })));
        assert!(matches!(GuestRange::new(GuestAddr(u64::MAX - p + 1), 2 * p), Err(SpaceError::OutOfWindow { .. })));
        let r = GuestRange::new(GuestAddr(p), 3 * p).unwrap();
        assert_eq!((r.start().0, r.end().0, r.pages()), (p, 4 * p, 3));
        assert!(r.contains(GuestAddr(p)) && !r.contains(GuestAddr(4 * p)));
    }

    #[test]
    fn errors_name_the_range_in_hex() {
        let e = GuestRange::new(GuestAddr(0x1234), 0x1000).unwrap_err();
        assert!(e.to_string().contains("0x1234+0x1000"), "{e}");
    }
}
