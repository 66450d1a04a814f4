//! The mprotect backend's ear for the kernel (Linux): pages of the window dropped behind the
//! space's back (`madvise(MADV_DONTNEED)` by the embedder) keep their protection and never fault,
//! so the fault handler cannot see them; a page-table walk per collect to find them was measured
//! too costly (docs/watch.md, "Content the space changed"). Instead a userfaultfd that only
//! listens ([`UffdEvents`]: registered over the window in write-protect mode, nothing ever
//! write-protected, so no page faults to it) hands each drop to a thread of its own
//! (`emuhost-drops`), which marks the armed pages written: the next collect of every reader
//! reports them (they read zero now).
//!
//! The thread that drops pages waits in the kernel until its event is read. So:
//! - the reader takes no lock but `seen`, which nobody holds across a system call (the space's
//!   own decommit drops pages under the space's lock; collects, arms and the space's changes
//!   hold the tracker's and the space's locks across `mprotect`s and `mmap`s);
//! - a collect made after the `madvise` returned sees the marks: the event was read before the
//!   `madvise` returned, by the reader holding `seen` from before that read until the marks were
//!   set; the collect takes `seen` after the `madvise` returned, so after the reader let it go
//!   ([`Drops::settle`]). Taking an uncontended mutex is the whole cost per collect.
//! - The kernel drops the pages after the event is read: a collect that runs beside the `madvise`
//!   may report them before their content changes (docs/watch.md says to order such drops before
//!   the collect that must see them).
//!
//! Dropped, the listener unregisters the window (no event can come from there any more), stops
//! the reader through the eventfd, joins it, and closes the userfaultfd last, which also lets go
//! any thread still waiting on an event (the kernel wakes them when the descriptor is released).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::sys::uffd::{UffdEvent, UffdEvents};

/// What a [`Drops`] listener does with the pages of host `start..end` dropped behind the
/// space's back. Called with `seen` held: atomics only, no lock, no system call.
pub(super) type OnRemoved = Box<dyn Fn(usize, usize) + Send + Sync>;

/// What the reader records, under the mutex a collect takes before it reads (see the module's doc).
#[derive(Default)]
pub(super) struct Seen {
    /// The events of the last read, kept so a read allocates nothing once it has grown.
    events: Vec<UffdEvent>,
}

/// The listener over one window, and its reader thread.
pub(super) struct Drops {
    events: Arc<UffdEvents>,
    seen: Arc<Mutex<Seen>>,
    thread: Option<JoinHandle<()>>,
    window: (usize, usize),
    /// The process that made it: a fork's child has no reader thread to stop.
    pid: u32,
}

/// Whether the debug line saying drops are not seen was written (once per process).
static SAID: AtomicBool = AtomicBool::new(false);

fn not_seen(why: &dyn std::fmt::Display) {
    if !SAID.swap(true, Relaxed) {
        tracing::debug!(
            "write tracking (mprotect): pages dropped behind the space's back (madvise) are not seen ({why}); \
             drop them through the space (decommit)"
        );
    }
}

impl Drops {
    /// Listens over host `base..base + len`, calling `on_removed` for each drop there; `None`
    /// where the kernel has no such listener for this process (said once, at debug level).
    pub(super) fn start(base: usize, len: usize, on_removed: OnRemoved) -> Option<Self> {
        let events = match UffdEvents::new(false) {
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
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (ev, sn) = (events.clone(), seen.clone());
        let spawned =
            std::thread::Builder::new().name("emuhost-drops".into()).spawn(move || listen(&ev, &sn, &on_removed));
        match spawned {
            Ok(thread) => {
                Some(Self { events, seen, thread: Some(thread), window: (base, base + len), pid: std::process::id() })
            }
            Err(e) => {
                // Nobody would read the events: every drop in the window would wait forever.
                let _ = events.unregister(base, len);
                not_seen(&format_args!("starting its thread: {e}"));
                None
            }
        }
    }

    /// Waits for the reader to finish the events it is reading: every drop whose `madvise`
    /// returned before this call is marked when it returns (see the module's doc).
    pub(super) fn settle(&self) -> MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The space mapped host `start..end` anew: the new mappings are registered too, so drops
    /// there are seen (a registration takes the memory-map lock for writing, as the remap did).
    pub(super) fn mapped_anew(&self, start: usize, end: usize) {
        let (s, e) = (start.max(self.window.0), end.min(self.window.1));
        if s < e
            && let Err(err) = self.events.register(s, e - s)
        {
            tracing::debug!("write tracking (mprotect): drops over {s:#x}..{e:#x} are not seen ({err})");
        }
    }
}

/// The reader: waits for events and handles each batch under `seen`, until stopped; then reads
/// what is left once more.
fn listen(events: &UffdEvents, seen: &Mutex<Seen>, on_removed: &OnRemoved) {
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
        read(events, seen, on_removed);
        if !go_on {
            return;
        }
    }
}

/// Reads every queued event and handles it, all under `seen` (see the module's doc).
fn read(events: &UffdEvents, seen: &Mutex<Seen>, on_removed: &OnRemoved) {
    let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
    let Seen { events: buf } = &mut *seen;
    buf.clear();
    if let Err(e) = events.read(buf) {
        tracing::warn!("write tracking (mprotect): reading drops failed: {e}");
    }
    for ev in buf.iter() {
        if let UffdEvent::Removed { start, end } = *ev {
            on_removed(start, end);
        }
    }
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
