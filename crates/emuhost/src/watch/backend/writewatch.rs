//! The write-watch backend (Windows): every private allocation the space commits is
//! `MEM_WRITE_WATCH`, and a read is one `GetWriteWatch` (with `WRITE_WATCH_FLAG_RESET` for a
//! collect) per allocation the range overlaps, asked of the space's own record of its allocations:
//! no region query on the collect path (reference/004).
//!
//! Write watch cannot see shared views or memory the space did not commit (a caller's
//! reservation): those pages are armed by a guard backend kept beside ([`super::guard`]:
//! `VirtualProtect` and the vectored exception handler), so a view mapped over armed pages later
//! loses no write. A tracker made over a space that has views already, or over an adopted window,
//! is a guard tracker from the start (see `watch::config::for_space`).
//!
//! A read that fails for one allocation (released behind the space's back) is an error for that
//! range; the tracker remembers the failure for that allocation until its commit state changes,
//! so the failing call happens once, not once per collect.

use std::io;
use std::sync::{Arc, Mutex, OnceLock};

use super::guard::GuardBackend;
use super::{Backend, Runs};
use crate::space::{Prot, Region, Space};
use crate::sys::guard::TableKey;
use crate::sys::mm::page_size;
use crate::sys::writewatch;
use crate::watch::BackendKind;

/// The write-watch backend over `space`'s window; the guard beside it installs the fault handler
/// only if `install_handler`.
pub(super) fn make(space: &Arc<Space>, install_handler: bool) -> io::Result<Box<dyn Backend>> {
    Ok(Box::new(WriteWatchBackend {
        space: Arc::downgrade(space),
        install_handler,
        guard: OnceLock::new(),
        pages: Mutex::default(),
    }))
}

/// Written page addresses, and host `(start, end)` allocation pieces.
type Scratch = (Vec<usize>, Vec<(usize, usize)>);

struct WriteWatchBackend {
    /// The space (its reservation records the allocations); weak, as the space's observers are.
    space: std::sync::Weak<Space>,
    install_handler: bool,
    /// Tracks the armed pages no write-watched allocation covers; made at the first such arm
    /// (its page-state table is committed memory, two bytes per page of the window).
    guard: OnceLock<GuardBackend>,
    /// Scratch: the written pages one `GetWriteWatch` returns, and a read's allocations (a warm
    /// collect allocates nothing).
    pages: Mutex<Scratch>,
}

impl WriteWatchBackend {
    /// The write-watched allocations' parts inside host `start..end`, in address order.
    fn pieces(&self, start: usize, end: usize) -> io::Result<Vec<(usize, usize)>> {
        let mut out = Vec::new();
        self.pieces_into(start, end, &mut out)?;
        Ok(out)
    }

    /// [`Self::pieces`] into `out` (cleared first).
    fn pieces_into(&self, start: usize, end: usize, out: &mut Vec<(usize, usize)>) -> io::Result<()> {
        let space = self.space.upgrade().ok_or_else(|| io::Error::other("the space is gone"))?;
        out.clear();
        space.reservation().private_allocations(start, end, |s, e| {
            let (s, e) = (s.max(start), e.min(end));
            if s < e {
                out.push((s, e));
            }
        });
        Ok(())
    }

    /// The parts of host `start..end` outside `pieces` (sorted, apart).
    fn outside(pieces: &[(usize, usize)], start: usize, end: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut at = start;
        for &(s, e) in pieces {
            if s > at {
                out.push((at, s));
            }
            at = at.max(e);
        }
        if at < end {
            out.push((at, end));
        }
        out
    }

    /// Gives `out` the written runs of host `start..end`, resetting them if `reset`: write watch
    /// for the allocations, the guard for the rest, in address order.
    fn written(&self, start: usize, end: usize, reset: bool, out: &mut Runs) -> io::Result<()> {
        let p = page_size();
        let mut scratch = self.pages.lock().unwrap_or_else(|p| p.into_inner());
        let (pages, pieces) = &mut *scratch;
        self.pieces_into(start, end, pieces)?;
        let mut at = start;
        for &(s, e) in pieces.iter() {
            if s > at {
                self.guard_read(at, s, reset, out)?;
            }
            pages.clear();
            writewatch::written(s, e - s, reset, pages)?;
            for &a in pages.iter() {
                out.push(a as u64, (a + p) as u64);
            }
            at = e;
        }
        if at < end {
            self.guard_read(at, end, reset, out)?;
        }
        Ok(())
    }

    fn guard_read(&self, start: usize, end: usize, reset: bool, out: &mut Runs) -> io::Result<()> {
        match self.guard.get() {
            None => Ok(()),
            Some(g) if reset => g.read(start, end, out),
            Some(g) => g.peek(start, end, out),
        }
    }

    /// The guard, made now if it is not yet.
    fn guard(&self) -> io::Result<&GuardBackend> {
        if let Some(g) = self.guard.get() {
            return Ok(g);
        }
        let space = self.space.upgrade().ok_or_else(|| io::Error::other("the space is gone"))?;
        let made = super::guard::new(BackendKind::Guard, &space, self.install_handler)?;
        // Another thread may have made one meanwhile: the first stays, this one is dropped.
        Ok(self.guard.get_or_init(|| made))
    }

    /// Arms with the guard the committed pages of host `start..end` outside write-watched
    /// allocations; `regions` are the OS's regions there (host addresses less `base`).
    fn arm_rest(
        &self,
        pieces: &[(usize, usize)],
        start: usize,
        end: usize,
        regions: &[Region],
        base: usize,
    ) -> io::Result<()> {
        for (s, e) in Self::outside(pieces, start, end) {
            let seen: Vec<Region> = regions
                .iter()
                .filter(|r| base + r.start < e && s < base + r.end)
                .map(|r| Region { start: (base + r.start).max(s), end: (base + r.end).min(e), ..*r })
                .collect();
            if !seen.is_empty() {
                self.guard()?.arm(s, e, &seen, 0)?;
            }
        }
        Ok(())
    }
}

impl Backend for WriteWatchBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::WriteWatch
    }

    /// Forgets what was written before in the write-watched allocations (their state is reset);
    /// the guard arms the rest.
    fn arm(&self, start: usize, end: usize, regions: &[Region], base: usize) -> io::Result<()> {
        let pieces = self.pieces(start, end)?;
        for &(s, e) in &pieces {
            writewatch::reset(s, e - s)?;
        }
        self.arm_rest(&pieces, start, end, regions, base)
    }

    // Write watch needs no undoing: the tracker reads only armed ranges.
    fn disarm(&self, start: usize, end: usize) -> io::Result<()> {
        self.guard.get().map_or(Ok(()), |g| g.disarm(start, end))
    }

    fn read(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()> {
        self.written(start, end, true, out)
    }

    // The guard (views) re-protects what it reads; write watch itself does not.
    fn reprotects(&self) -> bool {
        self.guard.get().is_some()
    }

    fn peek(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()> {
        self.written(start, end, false, out)
    }

    // The guard's table, once it exists: an embedder's handler fetches the key when it needs it.
    fn fault_key(&self) -> Option<TableKey> {
        self.guard.get().and_then(|g| g.fault_key())
    }

    // Write watch is not protection: a change of protection keeps the pages' state.
    fn protected(&self, start: usize, end: usize, prot: Prot) -> io::Result<bool> {
        self.guard.get().map_or(Ok(false), |g| g.protected(start, end, prot))
    }

    // Pages mapped anew: a refilled hole is a new allocation whose write watch says nothing of
    // what happened before, a view is the guard's to arm. Either way report them written at the
    // next collect.
    fn remapped(&self, start: usize, end: usize, prot: Prot) -> io::Result<bool> {
        let pieces = self.pieces(start, end)?;
        let raw = prot.raw();
        let region = Region { start, end, read: raw.read, write: raw.write, exec: raw.exec, shared: true, file: true };
        self.arm_rest(&pieces, start, end, &[region], 0)?;
        // The guard's pages take the new protection, written (as the guard's own remap does).
        for (s, e) in Self::outside(&pieces, start, end) {
            if let Some(g) = self.guard.get() {
                g.remapped(s, e, prot)?;
            }
        }
        Ok(true)
    }

    // A release in place decommits inside the allocation, which keeps its write watch: a page
    // written after the recommit is reported. Else the allocation went back to a placeholder and
    // a commit makes a fresh one.
    fn released(&self, start: usize, end: usize, in_place: bool) -> io::Result<bool> {
        self.guard.get().map_or(Ok(false), |g| g.released(start, end, in_place))
    }

    fn unstale(&self, start: usize, end: usize) {
        if let Some(g) = self.guard.get() {
            g.unstale(start, end);
        }
    }

    // The OS records its own writes into write-watched pages; the guard's pages need unprotecting.
    fn prepare_host_write(&self, start: usize, end: usize) -> io::Result<()> {
        self.guard.get().map_or(Ok(()), |g| g.prepare_host_write(start, end))
    }

    // Only once the guard tracks pages: write watch needs nothing.
    fn needs_host_write_prepare(&self) -> bool {
        self.guard.get().is_some()
    }
}
