//! Write watch on Windows: the pages of a `MEM_WRITE_WATCH` private allocation written since the
//! last reset (`GetWriteWatch`, `ResetWriteWatch`). A range must lie inside ONE such allocation
//! (the space records them: `Reservation::private_allocations`); elsewhere (a view, memory not
//! write-watched, memory released) the call fails with `ERROR_INVALID_PARAMETER`.

use std::ffi::c_void;
use std::io;

use windows_sys::Win32::System::Memory::{GetWriteWatch, ResetWriteWatch};
use windows_sys::Win32::System::SystemServices::WRITE_WATCH_FLAG_RESET;

use crate::sys::counters::{Call, count};

/// Entries asked for per `GetWriteWatch` call; a range with more written pages takes more calls.
const BATCH: usize = 512;

/// Pushes the host address of every page of `start..start + len` written since the last reset
/// onto `out`, in address order; with `reset`, resets the pages it reports
/// (`WRITE_WATCH_FLAG_RESET`), so a write after the call is reported by the next one. One
/// `GetWriteWatch` per [`BATCH`] pages reported (at least one). On an error the pages reported
/// before it stay in `out`.
pub fn written(start: usize, len: usize, reset: bool, out: &mut Vec<usize>) -> io::Result<()> {
    let end = start.checked_add(len).ok_or_else(einval)?;
    let mut buf = [std::ptr::null_mut::<c_void>(); BATCH];
    let mut at = start;
    loop {
        let mut n = buf.len();
        let mut gran = 0u32;
        count(Call::Ioctl);
        // SAFETY: `buf` holds `n` entries; GetWriteWatch writes at most that many and reads no
        // memory of the range.
        let r = unsafe {
            GetWriteWatch(
                if reset { WRITE_WATCH_FLAG_RESET } else { 0 },
                at as *const c_void,
                end - at,
                buf.as_mut_ptr(),
                &mut n,
                &mut gran,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        let got = &buf[..n.min(BATCH)];
        out.extend(got.iter().map(|&p| p as usize));
        match got.last() {
            Some(&last) if n >= BATCH => {
                at = last as usize + (gran as usize).max(1);
                if at >= end {
                    return Ok(());
                }
            }
            _ => return Ok(()),
        }
    }
}

/// Resets the write watch of `start..start + len` (one `ResetWriteWatch`): no page of it counts
/// as written until written again.
pub fn reset(start: usize, len: usize) -> io::Result<()> {
    start.checked_add(len).ok_or_else(einval)?;
    count(Call::Ioctl);
    // SAFETY: ResetWriteWatch reads and writes no memory of the range, only its watch state.
    if unsafe { ResetWriteWatch(start as *const c_void, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn einval() -> io::Error {
    io::Error::from_raw_os_error(windows_sys::Win32::Foundation::ERROR_INVALID_PARAMETER as i32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::RawProt;
    use crate::sys::mm::{Reservation, page_size};

    const RW: RawProt = RawProt { read: true, write: true, exec: false };

    /// The one recorded allocation over `off..off + len` of `r`.
    fn allocation(r: &Reservation, off: usize, len: usize) -> (usize, usize) {
        let mut v = Vec::new();
        r.private_allocations(r.base() + off, r.base() + off + len, |s, e| v.push((s, e)));
        assert_eq!(v.len(), 1, "{v:x?}");
        v[0]
    }

    #[test]
    fn reports_exactly_the_written_pages_and_reset_clears_them() {
        let page = page_size();
        let r = Reservation::new(4 << 20, 0).unwrap();
        r.protect(0, 700 * page, RW).unwrap();
        let (s, e) = allocation(&r, 0, 700 * page);
        let mut out = Vec::new();
        written(s, e - s, true, &mut out).unwrap();
        out.clear();
        // More written pages than one call's batch, and a read that must not count.
        let pages: Vec<usize> = [0, 5, 6, 63].into_iter().chain(100..700).collect();
        for &p in &pages {
            r.write(p * page + 7, &[1]).unwrap();
        }
        r.read(64 * page, &mut [0]).unwrap();
        written(s, e - s, false, &mut out).unwrap();
        let want: Vec<usize> = pages.iter().map(|p| r.base() + p * page).collect();
        assert_eq!(out, want, "a peek reports exactly the written pages");
        out.clear();
        written(s, e - s, true, &mut out).unwrap();
        assert_eq!(out, want, "the peek did not reset");
        out.clear();
        written(s, e - s, false, &mut out).unwrap();
        assert_eq!(out, [], "WRITE_WATCH_FLAG_RESET cleared them");
        r.write(5 * page, &[2]).unwrap();
        reset(s, e - s).unwrap();
        written(s, e - s, false, &mut out).unwrap();
        assert_eq!(out, [], "ResetWriteWatch cleared it");
    }

    #[test]
    fn outside_a_write_watched_allocation_is_an_error() {
        let mut out = Vec::new();
        let local = [0u8; 64];
        assert!(written(local.as_ptr() as usize / page_size() * page_size(), page_size(), false, &mut out).is_err());
        assert!(written(usize::MAX - 10, 100, false, &mut out).is_err());
        assert!(reset(usize::MAX - 10, 100).is_err());
    }
}
