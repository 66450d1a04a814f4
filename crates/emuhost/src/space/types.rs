//! Guest addresses, page-aligned ranges and protections: types of their own, so an unchecked
//! host pointer or an odd length cannot reach the OS calls.

use std::fmt;

use super::SpaceError;
use crate::sys::mm::{RawProt, page_size as sys_page_size};

/// The host's page size in bytes.
pub fn page_size() -> u64 {
    sys_page_size() as u64
}

/// A guest address: an offset into the guest window.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GuestAddr(pub u64);

impl GuestAddr {
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
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct GuestRange {
    start: u64,
    len: u64,
}

impl GuestRange {
    /// Checks alignment (both ends on the host page), a non-zero length and no wrap-around.
    /// Whether it lies in a window is checked by the `Space` it is used with.
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
    pub fn from_bounds(start: u64, end: u64) -> Result<Self, SpaceError> {
        Self::new(GuestAddr(start), end.saturating_sub(start))
    }

    pub fn start(self) -> GuestAddr {
        GuestAddr(self.start)
    }

    pub fn end(self) -> GuestAddr {
        GuestAddr(self.start + self.len)
    }

    pub fn len(self) -> u64 {
        self.len
    }

    /// Never true: a `GuestRange` is never empty (for clippy's `len_without_is_empty`).
    pub fn is_empty(self) -> bool {
        false
    }

    pub fn pages(self) -> u64 {
        self.len / page_size()
    }

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

/// Page protection.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Prot {
    pub read: bool,
    pub write: bool,
    pub exec: bool,
}

impl Prot {
    pub const NONE: Prot = Prot { read: false, write: false, exec: false };
    pub const READ: Prot = Prot { read: true, write: false, exec: false };
    pub const READ_WRITE: Prot = Prot { read: true, write: true, exec: false };
    pub const READ_EXEC: Prot = Prot { read: true, write: false, exec: true };
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
