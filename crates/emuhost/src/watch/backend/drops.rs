//! The mprotect backend's ear for the kernel (Linux). Pages of the window dropped behind the
//! space's back (`madvise(MADV_DONTNEED)` by the embedder) keep their protection and never fault,
//! so the fault handler cannot see them, and a page-table walk per collect to find them was
//! measured too costly (docs/watch.md, "Content the space changed"); a mapping put over armed
//! pages behind the space's back can look just like the space's own. Instead a userfaultfd that
//! only listens ([`UffdEvents`]: registered over the window in write-protect mode, nothing ever
//! write-protected, so no page faults to it) hands each drop and each unmap (`munmap`, a mapping
//! put over the pages) to a thread of its own (`emuhost-drops`):
//! - a drop marks the armed pages written: the next collect of every reader reports them (they
//!   read zero now);
//! - an unmap marks the pages foreign ([`crate::sys::guard::FOREIGN`]) and records the range. The
//!   space's own unmaps (a release mapped anew, a view) are followed by its notification of the
//!   same range, which makes them its own again ([`Drops::owned`]); what is left is foreign code's:
//!   neither protected nor unprotected by the backend or the fault handler, and reported untracked
//!   by collects, until the space commits, protects or maps the pages again.
//!
//! The thread that drops or unmaps pages waits in the kernel until its event is read. So:
//! - the reader takes no lock but `seen`, which nobody holds across a system call (the space's
//!   decommits and views unmap under the space's lock; collects, arms and the space's changes
//!   hold the tracker's and the space's locks across `mprotect`s and `mmap`s);
//! - a collect made after the `madvise` (or `mmap`, `munmap`) returned sees the marks: the event
//!   was read before that call returned, by the reader holding `seen` from before that read
//!   until the marks were set; the collect takes `seen` after the call returned, so after the
//!   reader let it go ([`Drops::settle`], once per collect). So the space's own unmap is marked
//!   before the space tells the tracker of it. An uncontended mutex per collect and an atomic load
//!   per allocation read are the whole cost to a collect.
//! - The kernel drops the pages after the event is read: a collect that runs beside the `madvise`
//!   may report them before their content changes, and a collect or a fault handled beside a
//!   foreign `mmap` may still act on the new mapping (docs/watch.md says to order them).
//!
//! Dropped, the listener unregisters the window (no event can come from there any more), stops
//! the reader through the eventfd, joins it, and closes the userfaultfd last, which also lets go
//! any thread still waiting on an event (the kernel wakes them when the descriptor is released).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::space::ranges::RangeMap;
use crate::sys::uffd::{UffdEvent, UffdEvents};

/// What a [`Drops`] listener does with what the kernel told. Called with `seen` held: atomics
/// only, no lock, no system call.
pub(super) trait Told: Send + Sync + 'static {
    /// The pages of host `start..end` are about to be dropped (they will read zero).
    fn removed(&self, start: usize, end: usize);
    /// The pages of host `start..end` were unmapped or mapped over: by the space (which says so
    /// next, [`Told::owned`]) or behind its back.
    fn unmapped(&self, start: usize, end: usize);
    /// The space committed, protected or mapped host `start..end` itself: its pages are its own.
    fn owned(&self, start: usize, end: usize);
}

/// What the reader records, under the mutex a collect takes before it reads (see the module's doc).
#[derive(Default)]
pub(super) struct Seen {
    /// The events of the last read, kept so a read allocates nothing once it has grown.
    events: Vec<UffdEvent>,
    /// Host ranges unmapped or mapped over and not since made the space's own again
    /// ([`Drops::owned`]): foreign. Their pages are marked foreign in the page-state table too
    /// (for the fault handler, arms and disarms); collects ask this map, not every page.
    foreign: RangeMap<()>,
}

/// `seen`, and whether its map of foreign ranges holds any (read without the lock).
#[derive(Default)]
struct Shared {
    seen: Mutex<Seen>,
    /// Set under `seen` after each change of [`Seen::foreign`]: whether it holds any range.
    any_foreign: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Seen {
    fn note_foreign(&self, any: &AtomicBool) {
        any.store(self.foreign.iter().next().is_some(), SeqCst);
    }

    /// The first foreign host address in `start..end`, if any.
    pub(super) fn foreign_in(&self, start: usize, end: usize) -> Option<usize> {
        self.foreign.overlapping(start as u64, end as u64).next().map(|(s, _, _)| s.max(start as u64) as usize)
    }
}

/// The listener over one window, and its reader thread.
pub(super) struct Drops {
    events: Arc<UffdEvents>,
    shared: Arc<Shared>,
    told: Arc<dyn Told>,
    thread: Option<JoinHandle<()>>,
    window: (usize, usize),
    /// The process that made it: a fork's child has no reader thread to stop.
    pid: u32,
}

/// Whether a read of the events failed (said once per process: the reader goes on).
static READ_FAILED: AtomicBool = AtomicBool::new(false);

/// Whether the debug line saying drops are not seen was written (once per process).
static SAID: AtomicBool = AtomicBool::new(false);

fn not_seen(why: &dyn std::fmt::Display) {
    if !SAID.swap(true, Relaxed) {
        tracing::debug!(
            "write tracking (mprotect): pages dropped or mapped over behind the space's back are not seen ({why}); \
             drop them through the space (decommit)"
        );
    }
}

/// Whether an mprotect tracker made now hears of pages dropped, unmapped or mapped over behind
/// the space's back: `Err(why not)` where this kernel (or this process) has no such listener.
pub(crate) fn available() -> Result<(), String> {
    UffdEvents::new(true).map(drop).map_err(|e| e.to_string())
}

impl Drops {
    /// Listens over host `base..base + len`, telling `told` of each drop and unmap there; `None`
    /// where the kernel has no such listener for this process (said once, at debug level).
    pub(super) fn start(base: usize, len: usize, told: Arc<dyn Told>) -> Option<Self> {
        let events = match UffdEvents::new(true) {
            Ok(e) => Arc::new(e),
            Err(e) => {
                not_seen(&e);
                return None;
            }
        };
        if let Err(e) = events.register(base, len) {
            not_seen(&format_args!("registering the window: {e}"));
            return None;
        }
        let shared = Arc::new(Shared::default());
        let (ev, sh, tl) = (events.clone(), shared.clone(), told.clone());
        let spawned = std::thread::Builder::new()
            .name("emuhost-drops".into())
            .spawn(move || listen(&ev, &sh, &*tl, (base, base + len)));
        match spawned {
            Ok(thread) => Some(Self {
                events,
                shared,
                told,
                thread: Some(thread),
                window: (base, base + len),
                pid: std::process::id(),
            }),
            Err(e) => {
                // Nobody would read the events: every drop in the window would wait forever.
                let _ = events.unregister(base, len);
                not_seen(&format_args!("starting its thread: {e}"));
                None
            }
        }
    }

    /// Waits for the reader to finish the events it is reading: every drop and unmap whose system
    /// call returned before this call is marked when it returns (see the module's doc). Once per
    /// collect.
    pub(super) fn settle(&self) {
        drop(self.shared.lock());
    }

    /// The first foreign host address in `start..end`, if any: an atomic load, and a look into
    /// the map only where it holds a range (after a [`Drops::settle`], a range the reader
    /// recorded before it is in the map, and the flag says so).
    pub(super) fn foreign_in(&self, start: usize, end: usize) -> Option<usize> {
        if !self.shared.any_foreign.load(SeqCst) {
            return None;
        }
        self.shared.lock().foreign_in(start, end)
    }

    /// The space committed, protected, released or (`remapped`) mapped anew host `start..end`:
    /// its pages are its own again. Its own unmaps were read (and marked foreign) before the
    /// system call that made them returned, which was before this call: under `seen` they are
    /// marked, and here their pages are the space's again, so what stays foreign is what was
    /// mapped behind its back. Mappings made anew are registered too, so drops and unmaps there
    /// are seen (a registration takes the memory-map lock for writing, as the remap did).
    pub(super) fn owned(&self, start: usize, end: usize, remapped: bool) {
        let (s, e) = (start.max(self.window.0), end.min(self.window.1));
        if s >= e {
            return;
        }
        {
            let mut seen = self.shared.lock();
            let (a, b) = (s as u64, e as u64);
            let pieces: Vec<(u64, u64)> =
                seen.foreign.overlapping(a, b).map(|(x, y, _)| (x.max(a), y.min(b))).collect();
            for (x, y) in pieces {
                self.told.owned(x as usize, y as usize);
            }
            seen.foreign.remove(a, b, |_, _, _| ());
            seen.note_foreign(&self.shared.any_foreign);
        }
        if remapped && let Err(err) = self.events.register(s, e - s) {
            tracing::debug!("write tracking (mprotect): drops over {s:#x}..{e:#x} are not seen ({err})");
        }
    }
}

/// The reader: waits for events and handles each batch under `seen`, until stopped; then reads
/// what is left once more.
fn listen(events: &UffdEvents, shared: &Shared, told: &dyn Told, window: (usize, usize)) {
    let mut errors = 0u32;
    loop {
        let go_on = match events.wait() {
            Ok(go_on) => go_on,
            Err(e) => {
                // poll(2) on two descriptors of ours does not fail; if it does, keep reading (a
                // reader that left would let every drop in the window wait forever), and say so.
                if errors == 0 {
                    tracing::warn!("write tracking (mprotect): waiting for drops failed: {e}");
                }
                errors = errors.saturating_add(1);
                std::thread::yield_now();
                true
            }
        };
        read(events, shared, told, window);
        if !go_on {
            return;
        }
    }
}

/// Reads every queued event and handles it, all under `seen` (see the module's doc).
fn read(events: &UffdEvents, shared: &Shared, told: &dyn Told, (lo, hi): (usize, usize)) {
    let mut seen = shared.lock();
    let Seen { events: buf, foreign } = &mut *seen;
    buf.clear();
    if let Err(e) = events.read(buf)
        && !READ_FAILED.swap(true, Relaxed)
    {
        tracing::warn!("write tracking (mprotect): reading drops failed: {e}");
    }
    for ev in buf.iter() {
        match *ev {
            UffdEvent::Removed { start, end } => told.removed(start, end),
            UffdEvent::Unmapped { start, end } => {
                // An unmap's event names the whole call's range, which may run past the window.
                let (a, b) = (start.max(lo), end.min(hi));
                if a < b {
                    told.unmapped(a, b);
                    foreign.remove(a as u64, b as u64, |_, _, _| ());
                    foreign.insert(a as u64, b as u64, ());
                }
            }
        }
    }
    seen.note_foreign(&shared.any_foreign);
}

impl Drop for Drops {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A fork's child: the reader thread is the parent's (not here to join), and the
            // eventfd is shared with the parent, whose reader a stop would end.
            std::mem::forget(self.thread.take());
            return;
        }
        let (base, end) = self.window;
        if let Err(e) = self.events.unregister(base, end - base) {
            tracing::debug!("write tracking (mprotect): unregistering the window failed ({e})");
        }
        if let Err(e) = self.events.stop() {
            // Cannot happen (an eventfd of ours with room); the reader would never end: leave it.
            tracing::warn!("write tracking (mprotect): stopping the drops' reader failed: {e}");
            return;
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
