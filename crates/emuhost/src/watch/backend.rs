//! The two backends behind one trait. They work on host addresses inside the space's window;
//! the tracker turns guest ranges into host ones and back.
use std::io;

use super::BackendKind;
use super::bitmap::Bits;
use crate::space::{Prot, Region, Space};
use crate::sys::guard::TableKey;

#[cfg(target_os = "linux")]
mod drops;
#[cfg(target_os = "linux")]
pub(super) use drops::available as mprotect_listens;
mod guard;
#[cfg(target_os = "linux")]
mod uffd;
#[cfg(target_os = "linux")]
pub(super) use uffd::SCAN_VEC;
#[cfg(windows)]
mod writewatch;

pub(super) trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// Arms host `start..end`; `regions` are the kernel's regions there (guest addresses, `base`
    /// added gives host ones).
    fn arm(&self, start: usize, end: usize, regions: &[Region], base: usize) -> io::Result<()>;
    fn disarm(&self, start: usize, end: usize) -> io::Result<()>;
    /// Gives `out` the written runs of host `start..end`, in address order, and arms them again.
    fn read(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()>;
    /// Gives `out` the written runs of `start..end` as [`Backend::read`] does, leaving them
    /// written (the next read reports them again).
    fn peek(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()>;
    /// The key of the page-state table a fault handler hands faults to (`None`: this backend's
    /// writes never fault).
    fn fault_key(&self) -> Option<TableKey> {
        None
    }
    /// The space set `prot` on armed pages. `Ok(true)`: report them written at the next collect.
    fn protected(&self, start: usize, end: usize, prot: Prot) -> io::Result<bool>;
    /// The space mapped armed pages anew (a view, a refilled hole) with `prot`.
    fn remapped(&self, start: usize, end: usize, prot: Prot) -> io::Result<bool>;
    /// The space released armed pages (`in_place`: their mappings stay, see
    /// [`crate::space::Observer::keeps_mappings`]).
    fn released(&self, start: usize, end: usize, in_place: bool) -> io::Result<bool>;
    /// The space changed host `start..end` (armed or not): pages a disarm gave back there are no
    /// longer the tracker's to claim a fault of.
    fn unstale(&self, _start: usize, _end: usize) {}
    /// A collect or query is about to read: what the kernel told the backend of before this call
    /// is in what it reads.
    fn begin_read(&self) {}
    /// The space committed, protected, released or (`remapped`) mapped anew host `start..end`
    /// (armed or not: a release mapped anew, a view, a refilled hole are `remapped`): its pages
    /// are the space's again, whoever mapped them before. Told before the tracking notifications
    /// of its armed pages.
    fn owned(&self, _start: usize, _end: usize, _remapped: bool) {}
    /// The host is about to write to armed pages through the kernel.
    fn prepare_host_write(&self, start: usize, end: usize) -> io::Result<()>;
    /// Whether a read changes the pages' protection (it re-protects written pages): then a read
    /// must not run beside the space's own change of protection over the same pages.
    fn reprotects(&self) -> bool {
        false
    }
    /// Whether [`Backend::prepare_host_write`] does anything (the kernel's writes would fail
    /// without it).
    fn needs_host_write_prepare(&self) -> bool {
        false
    }
    /// Sets (or, `None`, takes away) the copy-before-write hook of `snapshot`'s copy-before-write
    /// mode: its arena copies each armed page before the fault handler makes it writable.
    /// `Unsupported` where this backend's writes never reach a handler of ours.
    fn copy_hook(&self, _hook: Option<&std::sync::Arc<crate::sys::cow::CowArena>>) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "no fault handler of ours sees this backend's writes"))
    }
}

/// A backend's read of pages that are not the tracker's: mapped or unmapped behind the space's
/// back (the uffd backend's scan fails on memory its userfaultfd never registered; the mprotect
/// backend was told by the kernel). The collect reports the span untracked, no error.
#[derive(Debug)]
struct NotOurs(usize);

impl std::fmt::Display for NotOurs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the page at {:#x} was mapped or unmapped behind the space's back", self.0)
    }
}

impl std::error::Error for NotOurs {}

/// The error of a read that met the page at host `addr` mapped or unmapped behind the space's
/// back ([`is_not_ours`]).
#[cfg_attr(windows, allow(dead_code))]
pub(super) fn not_ours(addr: usize) -> io::Error {
    io::Error::other(NotOurs(addr))
}

/// Whether a backend's read failed on pages mapped or unmapped behind the space's back.
pub(super) fn is_not_ours(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|e| e.is::<NotOurs>())
}

/// Where a backend's read puts the written runs it finds, as host addresses less `base` (guest
/// addresses): into `bits` if given, else into `out`, a run joined to the one before it when
/// they touch and that one is at index `join` or later (what `out` held before may need a sort,
/// and is not joined). Made as the kernel's output is read, this is the whole conversion: at
/// 50 % written a second pass over the runs cost as much as a fifth of the kernel's scan.
pub(super) struct Runs<'a, 'b> {
    out: &'a mut Vec<(u64, u64)>,
    base: u64,
    join: usize,
    bits: Option<&'a mut Bits<'b>>,
}

impl<'a, 'b> Runs<'a, 'b> {
    pub(super) fn new(out: &'a mut Vec<(u64, u64)>, base: u64, join: usize, bits: Option<&'a mut Bits<'b>>) -> Self {
        Self { out, base, join, bits }
    }

    /// Adds host `s..e`.
    #[inline]
    pub(super) fn push(&mut self, s: u64, e: u64) {
        let (s, e) = (s - self.base, e - self.base);
        if let Some(bits) = &mut self.bits {
            bits.set(s, e);
            return;
        }
        debug_assert!(self.out.len() <= self.join || self.out[self.out.len() - 1].1 <= s, "runs out of order");
        if self.out.len() > self.join
            && let Some(last) = self.out.last_mut()
            && last.1 == s
        {
            last.1 = e;
            return;
        }
        self.out.push((s, e));
    }
}

/// The backend `kind` over `space`'s window; with a protection backend, emuhost's fault handler
/// is installed only if `install_handler` (else the embedder's own handler forwards faults). A
/// kind of another platform is `Unsupported`.
pub(super) fn make(
    kind: BackendKind,
    space: &std::sync::Arc<Space>,
    install_handler: bool,
) -> io::Result<Box<dyn Backend>> {
    match kind {
        #[cfg(target_os = "linux")]
        BackendKind::Uffd => uffd::make(space),
        #[cfg(target_os = "linux")]
        BackendKind::Mprotect => guard::make(kind, space, install_handler),
        #[cfg(windows)]
        BackendKind::WriteWatch => writewatch::make(space, install_handler),
        #[cfg(windows)]
        BackendKind::Guard => guard::make(kind, space, install_handler),
        #[allow(unreachable_patterns)]
        _ => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "the {} backend is not on this platform (here: {})",
                kind.name(),
                BackendKind::AUTO.map(BackendKind::name).join(", ")
            ),
        )),
    }
}
