//! Region queries on Windows: `VirtualQuery`, walked region by region. The counterpart of
//! `/proc/self/maps` and `PROCMAP_QUERY` on Linux.
//!
//! A region is a run of pages of one allocation with the same state and protection. A reserved
//! region (`MEM_RESERVE`, a placeholder included) and a committed one with `PAGE_NOACCESS` or
//! `PAGE_GUARD` are regions with no access, as `PROT_NONE` mappings are on Linux; `MEM_FREE` is a
//! gap (nothing mapped). Neighbouring regions with the same answer are merged.

use std::ffi::c_void;
use std::io;

use windows_sys::Win32::System::Memory::{
    MEM_COMMIT, MEM_FREE, MEM_MAPPED, MEMORY_BASIC_INFORMATION, PAGE_EXECUTE, PAGE_EXECUTE_READ,
    PAGE_EXECUTE_READWRITE, PAGE_EXECUTE_WRITECOPY, PAGE_GUARD, PAGE_READONLY, PAGE_READWRITE, PAGE_WRITECOPY,
    VirtualQuery,
};

use crate::sys::counters::{Call, count};

pub use crate::sys::Region;

/// How region queries are answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryPath {
    /// `VirtualQuery`, one call per region.
    VirtualQuery,
}

impl QueryPath {
    /// The path in words, as `emuhost probe` prints it.
    pub fn name(self) -> &'static str {
        match self {
            QueryPath::VirtualQuery => "VirtualQuery",
        }
    }
}

/// A handle to query regions with (nothing is opened on Windows).
#[derive(Debug)]
pub struct Maps {
    _private: (),
}

impl Maps {
    /// A query handle. `force_text` (on Linux: parse `/proc/self/maps` even where the ioctl
    /// works, for tests) means nothing on Windows, which has one way: it is ignored.
    pub fn open(force_text: bool) -> io::Result<Self> {
        let _ = force_text;
        Ok(Self { _private: () })
    }

    /// How this handle's queries are answered: always [`QueryPath::VirtualQuery`].
    pub fn path(&self) -> io::Result<QueryPath> {
        Ok(QueryPath::VirtualQuery)
    }

    /// Every region that overlaps `start..end`, clipped to it, in address order (nothing is
    /// mapped in the gaps between them). `ERROR_INVALID_PARAMETER` where `start > end`.
    pub fn regions(&self, start: usize, end: usize) -> io::Result<Vec<Region>> {
        if start > end {
            return Err(io::Error::from_raw_os_error(windows_sys::Win32::Foundation::ERROR_INVALID_PARAMETER as i32));
        }
        let mut out: Vec<Region> = Vec::new();
        let mut at = start;
        while at < end {
            // SAFETY: plain data; zero is a valid bit pattern.
            let mut m: MEMORY_BASIC_INFORMATION = unsafe { std::mem::zeroed() };
            count(Call::Query);
            // SAFETY: `m` is a valid out buffer of the size passed; VirtualQuery reads no memory
            // at `at`.
            let n = unsafe { VirtualQuery(at as *const c_void, &mut m, size_of::<MEMORY_BASIC_INFORMATION>()) };
            if n == 0 {
                break; // above the user address space: nothing mapped there
            }
            let next = (m.BaseAddress as usize).saturating_add(m.RegionSize).min(end);
            if next <= at {
                break;
            }
            if m.State != MEM_FREE {
                let r = region(&m, at, next);
                match out.last_mut() {
                    Some(l) if l.end == r.start && Region { start: l.start, end: l.end, ..r } == *l => l.end = r.end,
                    _ => out.push(r),
                }
            }
            at = next;
        }
        Ok(out)
    }
}

/// The region `start..end` as `m` describes it.
fn region(m: &MEMORY_BASIC_INFORMATION, start: usize, end: usize) -> Region {
    let p = if m.State == MEM_COMMIT && m.Protect & PAGE_GUARD == 0 { m.Protect & 0xff } else { 0 };
    let read = matches!(
        p,
        PAGE_READONLY
            | PAGE_READWRITE
            | PAGE_WRITECOPY
            | PAGE_EXECUTE_READ
            | PAGE_EXECUTE_READWRITE
            | PAGE_EXECUTE_WRITECOPY
    );
    let write = matches!(p, PAGE_READWRITE | PAGE_WRITECOPY | PAGE_EXECUTE_READWRITE | PAGE_EXECUTE_WRITECOPY);
    let exec = matches!(p, PAGE_EXECUTE | PAGE_EXECUTE_READ | PAGE_EXECUTE_READWRITE | PAGE_EXECUTE_WRITECOPY);
    let mapped = m.Type == MEM_MAPPED;
    Region { start, end, read, write, exec, shared: mapped, file: mapped }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::RawProt;
    use crate::sys::mm::{Reservation, page_size};

    #[test]
    fn regions_are_clipped_merged_and_in_order() {
        let page = page_size();
        let r = Reservation::new(1 << 20, 0).unwrap();
        let b = r.base();
        let rw = RawProt { read: true, write: true, exec: false };
        let rx = RawProt { read: true, write: false, exec: true };
        r.protect(4 * page, 2 * page, rw).unwrap();
        r.protect(6 * page, page, rw).unwrap();
        r.protect(8 * page, page, rx).unwrap();
        let m = Maps::open(true).unwrap();
        assert_eq!(m.path().unwrap().name(), "VirtualQuery");
        let got = m.regions(b + page, b + 9 * page).unwrap();
        let none = |s, e| Region {
            start: b + s * page,
            end: b + e * page,
            read: false,
            write: false,
            exec: false,
            shared: false,
            file: false,
        };
        let want = vec![
            none(1, 4),
            Region { write: true, read: true, ..none(4, 7) },
            none(7, 8),
            Region { read: true, exec: true, ..none(8, 9) },
        ];
        assert_eq!(got, want);
        assert!(m.regions(b + page, b).is_err());
        // Released memory is a gap.
        drop(r);
        assert_eq!(m.regions(b, b + 9 * page).unwrap(), []);
    }
}
