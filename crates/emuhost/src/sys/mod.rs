//! The only place with OS calls. The rest of the library calls `crate::sys::*` and never the OS
//! itself, and nothing here calls up.
//!
//! # The platform contract
//! Each platform (`linux/`, `windows/`) provides the same modules with the same names, and the
//! layers above use only those:
//! - `mm`: the reservation (the window: made at a chosen base, placed by the system, or
//!   adopted; given back on drop but for what later reservations hold), commit / decommit /
//!   protect / reset / fill a hole / populate / zero, checked copies in and out that fail instead
//!   of faulting, sections ([`mm::Section`]) and their views, the page size;
//! - `query`: the OS's own record of the regions of an address range (`Maps::regions`);
//! - `trap`: the fault handler behind write tracking by protection ([`guard`] holds the
//!   platform-neutral page-state protocol; the platform installs the handler, which calls
//!   [`guard::fault`], changes protections and gives the tables memory);
//! - `sched`: the monotonic clock, thread CPU time, yield, a deadline wait on the best timer,
//!   affinity, available memory and the CPU quota;
//! - `pin`: locking pages in memory and asking which are resident;
//! - `probe` and `procstat`: the machine's and the process's facts.
//!
//! Write tracking by the OS itself differs by nature and is platform-specific: userfaultfd with
//! `PAGEMAP_SCAN` on Linux (`uffd`), `MEM_WRITE_WATCH` with `GetWriteWatch` on Windows
//! (`writewatch`); the write tracker's backends name them under `cfg(target_os)`.
//!
//! # Safety
//! This module opts out of the crate's `deny(unsafe_code)`. Every `unsafe` block in it carries a
//! `// SAFETY:` line naming the invariant or check that makes it sound.
#![allow(unsafe_code)]

mod counts;
pub mod cow;
pub mod cpu;
pub mod guard;
pub mod hooks;
pub mod live;
pub mod status;

#[cfg(feature = "counters")]
pub mod counters;
#[cfg(not(feature = "counters"))]
#[path = "counters_disabled.rs"]
pub mod counters;

#[cfg(not(any(target_os = "linux", windows)))]
compile_error!("emuhost runs on Linux and Windows only: this target has no `sys` platform layer");

#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
use linux::segv as trap;
#[cfg(target_os = "linux")]
pub(crate) use linux::*;

#[cfg(windows)]
mod windows;
#[cfg(windows)]
use windows::fault as trap;
#[cfg(windows)]
pub(crate) use windows::*;

/// One region of the address space as the OS records it (`PROCMAP_QUERY` or `/proc/self/maps` on
/// Linux, `VirtualQuery` on Windows): a reserved page is a region with no access, nothing mapped
/// is a gap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// The first host address (page-aligned).
    pub start: usize,
    /// The host address past the last byte (page-aligned).
    pub end: usize,
    /// Readable.
    pub read: bool,
    /// Writable (copy-on-write counts).
    pub write: bool,
    /// Executable.
    pub exec: bool,
    /// A view of a section (`MAP_SHARED`; `MEM_MAPPED`).
    pub shared: bool,
    /// Backed by a file (a memfd section; on Windows every view, a pagefile-backed one too).
    pub file: bool,
}

/// Page protection, as the OS takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RawProt {
    pub read: bool,
    pub write: bool,
    pub exec: bool,
}

/// Where a copy of many runs of guest memory in one go (`Reservation::read_runs`/`write_runs`)
/// stopped: the index of the run whose pages refused it, the bytes of that run copied before
/// (every earlier run was copied whole, no later one touched), and the OS error.
#[derive(Debug)]
pub struct RunsError {
    pub run: usize,
    pub done: usize,
    pub error: std::io::Error,
}

impl RunsError {
    /// Pairs the `runs` (`(offset, len)`) with buffers of the lengths `lens`, taken in turn
    /// (their lengths add up, [`RunsError::check`]), a piece at a time: `copy(run, done, buf,
    /// at, n)` copies `n` bytes between run `run` from its byte `done` and buffer `buf` from its
    /// byte `at`, and says how many it copied. A piece copied short ends the walk with the run
    /// and its bytes copied, and `refused()` as the error.
    pub fn walk(
        runs: &[(usize, usize)],
        lens: &[usize],
        refused: fn() -> std::io::Error,
        mut copy: impl FnMut(usize, usize, usize, usize, usize) -> usize,
    ) -> Result<(), RunsError> {
        let (mut b, mut at) = (0, 0);
        for (run, &(_, len)) in runs.iter().enumerate() {
            let mut done = 0;
            while done < len {
                while lens[b] == at {
                    (b, at) = (b + 1, 0);
                }
                let n = (len - done).min(lens[b] - at);
                let copied = copy(run, done, b, at, n);
                if copied < n {
                    return Err(RunsError { run, done: done + copied, error: refused() });
                }
                (done, at) = (done + n, at + n);
            }
        }
        Ok(())
    }

    /// Checks that every run of `runs` lies inside `0..len` (a reservation's or a window's
    /// bytes) and that the buffers' `lens` add up to the runs' length; `invalid` makes the
    /// platform's error for a bad argument.
    pub fn check(
        len: usize,
        runs: &[(usize, usize)],
        lens: impl Iterator<Item = usize>,
        invalid: fn() -> std::io::Error,
    ) -> Result<(), RunsError> {
        let mut total = 0usize;
        for (run, &(off, n)) in runs.iter().enumerate() {
            match off.checked_add(n) {
                Some(end) if end <= len => total += n,
                _ => return Err(RunsError { run, done: 0, error: invalid() }),
            }
        }
        if lens.sum::<usize>() != total {
            return Err(RunsError { run: 0, done: 0, error: invalid() });
        }
        Ok(())
    }
}

/// The platform's error codes the layers above tell apart, and the errors they make.
pub mod codes {
    use std::io;

    #[cfg(target_os = "linux")]
    mod raw {
        pub const NO_MEMORY: i32 = libc::ENOMEM;
        pub const REFUSED: &[i32] = &[libc::EFAULT];
        pub const TAKEN: i32 = libc::EEXIST;
    }
    #[cfg(windows)]
    mod raw {
        /// `ERROR_NOT_ENOUGH_MEMORY`.
        pub const NO_MEMORY: i32 = 8;
        /// `ERROR_NOACCESS`, `ERROR_PARTIAL_COPY` (a copy a page refused part way).
        pub const REFUSED: &[i32] = &[998, 299];
        /// `ERROR_ALREADY_EXISTS`: a reservation at a base where something is (what `mm` answers).
        pub const TAKEN: i32 = 183;
    }

    /// The error of a call refused for want of memory (what fault injection makes a commit fail
    /// with).
    pub fn no_memory() -> io::Error {
        io::Error::from_raw_os_error(raw::NO_MEMORY)
    }

    /// The error of a checked copy (or a populate) that a page's protection refused.
    pub fn refused() -> io::Error {
        io::Error::from_raw_os_error(raw::REFUSED[0])
    }

    /// Whether `e` is a checked copy refused by a page's protection.
    pub fn is_refused(e: &io::Error) -> bool {
        e.raw_os_error().is_some_and(|c| raw::REFUSED.contains(&c))
    }

    /// Whether a reservation at a chosen base failed because something is there already.
    pub fn is_taken(e: &io::Error) -> bool {
        e.raw_os_error() == Some(raw::TAKEN)
    }
}
