//! Faults handed over by an embedder's own fault handler (`SIGSEGV` on Linux, a vectored exception
//! handler on Windows).

use super::Tracker;
use crate::sys::guard::{self, TableKey};

/// What an embedder's `SIGSEGV` handler keeps to hand faults to one tracker: plain integers
/// (`Copy`, `Send`, `Sync`, `'static`), so a handler may read it from a static without holding
/// the tracker. It stays harmless after the tracker is gone: it then takes no fault (but the
/// first one on a page the drop gave back, see [`FaultHandle::handle_fault`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultHandle {
    key: Option<TableKey>,
}

impl FaultHandle {
    /// Hands the fault at host address `addr` (the signal's `si_addr`) to the tracker; call it
    /// from a `SIGSEGV` handler. `is_write`: the fault was a write (pass `true` where the handler
    /// cannot tell; a read never faults on an armed page, so `false` returns false at once).
    ///
    /// True (the fault was the tracker's) in exactly two cases: the page is armed (it is now
    /// writable and marked written: the next collect reports it), or a disarm (or the tracker's
    /// drop) gave this page its writable protection back and this is the first fault on it since
    /// (a write that faulted while the page was still read-only and reached the handler after).
    /// Return from the handler: the CPU retries the write. False for everything else: a page of
    /// the window never armed, one the guest or the space changed after its disarm, a second
    /// fault on the same disarmed page, a page of a tracker whose space is gone. Handle it or pass
    /// it on to the previous handler.
    ///
    /// Async-signal-safe: no allocation, no lock, no panic; atomics and one `mprotect` (more where
    /// the kernel is at its map limit). With the uffd backend it returns false always: writes to
    /// armed pages never fault there.
    pub fn handle_fault(&self, addr: usize, is_write: bool) -> bool {
        match &self.key {
            Some(key) if is_write => guard::fault_in(key, addr),
            _ => false,
        }
    }
}

/// Hands the fault at host address `addr` to whichever tracker of this process has the page
/// armed (what emuhost's own handler does): [`FaultHandle::handle_fault`] for every tracker
/// at once, for an embedder's handler that holds no tracker. Async-signal-safe.
pub fn handle_fault(addr: usize, is_write: bool) -> bool {
    is_write && guard::fault(addr)
}

impl Tracker {
    /// The handle an embedder's `SIGSEGV` handler keeps for this tracker (see
    /// [`FaultHandle::handle_fault`]).
    pub fn fault_handle(&self) -> FaultHandle {
        FaultHandle { key: self.core.backend.fault_key() }
    }

    /// [`FaultHandle::handle_fault`] for this tracker: call it from the embedder's `SIGSEGV`
    /// handler with the fault's host address. Async-signal-safe. A handler that reads the tracker
    /// from a static must keep it alive while handlers run; [`Tracker::fault_handle`] needs no
    /// such care.
    pub fn handle_fault(&self, addr: usize, is_write: bool) -> bool {
        self.fault_handle().handle_fault(addr, is_write)
    }
}
