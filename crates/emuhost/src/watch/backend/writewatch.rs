//! The write-watch backend (Windows): every private allocation the space commits is
//! `MEM_WRITE_WATCH`, and a read is one `GetWriteWatch` (with `WRITE_WATCH_FLAG_RESET` for a
//! collect) per allocation the range overlaps, asked of the space's own record of its allocations:
//! no region query on the collect path (reference/004). Shared views and a caller's reservation
//! are not write-watched: a tracker over them uses the guard backend ([`super::guard`]), and an
//! arm of such pages here is an error naming them.
//!
//! A read that fails for one allocation (released behind the space's back) is an error for that
//! range; the tracker remembers the failure for that allocation until its commit state changes,
//! so the failing call happens once, not once per collect.

use std::io;
use std::sync::{Arc, Mutex};

use super::{Backend, Runs};
use crate::space::{Prot, Region, Space};
use crate::sys::mm::page_size;
use crate::sys::writewatch;
use crate::watch::BackendKind;

/// The write-watch backend over `space`'s window.
pub(super) fn make(space: &Arc<Space>) -> io::Result<Box<dyn Backend>> {
    if space.adopted() {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "write watch cannot see a caller's reservation (its allocations are not MEM_WRITE_WATCH): use guard",
        ));
    }
    Ok(Box::new(WriteWatchBackend { space: Arc::downgrade(space), pages: Mutex::default() }))
}

struct WriteWatchBackend {
    /// The space (its reservation records the allocations); weak, as the space's observers are.
    space: std::sync::Weak<Space>,
    /// Scratch for the written pages one `GetWriteWatch` returns.
    pages: Mutex<Vec<usize>>,
}

impl WriteWatchBackend {
    fn space(&self) -> io::Result<Arc<Space>> {
        self.space.upgrade().ok_or_else(|| io::Error::other("the space is gone"))
    }

    /// The write-watched allocations' parts inside host `start..end`, in address order.
    fn pieces(&self, start: usize, end: usize) -> io::Result<Vec<(usize, usize)>> {
        let space = self.space()?;
        let mut out = Vec::new();
        space.reservation().private_allocations(start, end, |s, e| {
            let (s, e) = (s.max(start), e.min(end));
            if s < e {
                out.push((s, e));
            }
        });
        Ok(out)
    }

    /// Gives `out` the written runs of host `start..end`, resetting them if `reset`.
    fn written(&self, start: usize, end: usize, reset: bool, out: &mut Runs) -> io::Result<()> {
        let p = page_size();
        let mut pages = self.pages.lock().unwrap_or_else(|p| p.into_inner());
        for (s, e) in self.pieces(start, end)? {
            pages.clear();
            writewatch::written(s, e - s, reset, &mut pages)?;
            for &a in pages.iter() {
                out.push(a as u64, (a + p) as u64);
            }
        }
        Ok(())
    }
}

impl Backend for WriteWatchBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::WriteWatch
    }

    /// Forgets what was written before: the pages' write-watch state is reset. Pages no
    /// write-watched allocation covers (a view, a foreign mapping) cannot be tracked here.
    fn arm(&self, start: usize, end: usize, regions: &[Region], base: usize) -> io::Result<()> {
        let pieces = self.pieces(start, end)?;
        // Every committed page of the range must lie in a recorded allocation.
        for r in regions.iter().filter(|r| r.read || r.write || r.exec) {
            let (rs, re) = ((base + r.start).max(start), (base + r.end).min(end));
            let mut at = rs;
            for &(s, e) in &pieces {
                if s <= at && at < e {
                    at = e;
                }
            }
            if at < re {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "host {at:#x}..{re:#x} is not a write-watched allocation ({}): track it with guard",
                        if r.shared { "a shared view" } else { "memory the space did not commit" }
                    ),
                ));
            }
        }
        for (s, e) in pieces {
            writewatch::reset(s, e - s)?;
        }
        Ok(())
    }

    // Nothing to undo: the tracker reads only armed ranges.
    fn disarm(&self, _start: usize, _end: usize) -> io::Result<()> {
        Ok(())
    }

    fn read(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()> {
        self.written(start, end, true, out)
    }

    fn peek(&self, start: usize, end: usize, out: &mut Runs) -> io::Result<()> {
        self.written(start, end, false, out)
    }

    // Write watch is not protection: a change of protection keeps the pages' state.
    fn protected(&self, _start: usize, _end: usize, _prot: Prot) -> io::Result<bool> {
        Ok(false)
    }

    // Pages mapped anew (a refilled hole): their allocation is new, its write-watch state says
    // nothing of what happened before; report them written at the next collect.
    fn remapped(&self, _start: usize, _end: usize, _prot: Prot) -> io::Result<bool> {
        Ok(true)
    }

    // A release in place decommits inside the allocation, which keeps its write watch: a page
    // written after the recommit is reported. Else the allocation went back to a placeholder and
    // a commit makes a fresh one.
    fn released(&self, _start: usize, _end: usize, _in_place: bool) -> io::Result<bool> {
        Ok(false)
    }

    // The OS records its own writes into write-watched pages.
    fn prepare_host_write(&self, _start: usize, _end: usize) -> io::Result<()> {
        Ok(())
    }
}
