//! Changes of the mappings in flight and long reads of the memory map: the guards that count
//! them, and the wait of a change for the reads.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use super::Space;

/// Counts a change of the mappings in flight while it lives ([`Space::changing`]).
#[must_use = "the change is counted only while the guard lives"]
#[derive(Debug)]
pub struct Changing<'a>(&'a AtomicU32);

impl Drop for Changing<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// Counts a change of the mappings in flight while it lives, and keeps the space alive
/// ([`Space::changing_owned`]).
#[must_use = "the change is counted only while the guard lives"]
#[derive(Debug)]
pub struct OwnedChanging(Arc<Space>);

impl Drop for OwnedChanging {
    fn drop(&mut self) {
        self.0.changing.fetch_sub(1, Ordering::Release);
    }
}

/// A long read of the memory map in flight while it lives ([`Space::try_long_read`]).
#[must_use = "the read is counted only while the guard lives"]
#[derive(Debug)]
pub struct LongRead<'a>(&'a Space);

impl Drop for LongRead<'_> {
    fn drop(&mut self) {
        self.0.end_long_read();
    }
}

/// A long read of the memory map in flight while it lives, keeping the space alive
/// ([`Space::try_long_read_owned`]).
#[must_use = "the read is counted only while the guard lives"]
#[derive(Debug)]
pub struct OwnedLongRead(Arc<Space>);

impl Drop for OwnedLongRead {
    fn drop(&mut self) {
        self.0.end_long_read();
    }
}

/// The longest a change waits for long reads to end before it goes on (into the kernel, where
/// it waits for them anyway): a guard kept by mistake slows changes down, it never stops them.
const LONG_READ_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

impl Space {
    /// Commits, decommits, protections, views and arms under way now: each takes the process's
    /// memory-map lock for writing, and waits for every reader of it (a driver's pin, a
    /// populate, a collect's scan) while holding the space's lock. Work that can wait (an
    /// importer's background populates and pins) starts none while this is not zero.
    pub fn changes_in_flight(&self) -> u32 {
        self.changing.load(Ordering::Acquire)
    }

    /// Marks a change of the mappings in flight until the guard is dropped. The space's own
    /// changes and a tracker's arms do this; an embedder that takes the memory-map lock for
    /// writing itself (an `mprotect` or `mmap` of its own, say) may too, so that background
    /// populates and pins do not start meanwhile. Keep it only for the change: while it lives,
    /// an importer's `settle` waits for it.
    ///
    /// Before it returns, it waits for the long reads in flight ([`Space::try_long_read`]) to
    /// end, for 100 ms at most: the change would wait for them in the kernel anyway, and there
    /// other threads' reads of the memory map (a collect's scan) queue behind it. Call it before
    /// taking any lock that such a reader may need.
    pub fn changing(&self) -> Changing<'_> {
        self.enter_change();
        Changing(&self.changing)
    }

    /// [`Space::changing`] without the wait: for an operation that may find nothing to change
    /// and so would wait for nothing. Before its first system call that changes the mappings it
    /// calls [`Space::wait_for_long_reads`], with no lock held.
    pub(crate) fn maybe_changing(&self) -> Changing<'_> {
        self.changing.fetch_add(1, Ordering::SeqCst);
        Changing(&self.changing)
    }

    /// [`Space::changing`] with a guard that keeps the space alive, for a caller that cannot
    /// borrow it (the C API's `emuhost_space_change_begin`).
    pub fn changing_owned(self: &Arc<Self>) -> OwnedChanging {
        self.enter_change();
        OwnedChanging(self.clone())
    }

    fn enter_change(&self) {
        self.changing.fetch_add(1, Ordering::SeqCst);
        self.wait_for_long_reads();
    }

    /// Waits for the long reads in flight to end (100 ms at most). No lock may be held that a
    /// long read's thread or a collect takes.
    pub(crate) fn wait_for_long_reads(&self) {
        if self.long_reads.load(Ordering::SeqCst) == 0 {
            return;
        }
        self.long_read_waits.fetch_add(1, Ordering::Relaxed);
        let deadline = std::time::Instant::now() + LONG_READ_WAIT;
        let (lock, done) = &self.reads_done;
        let mut g = lock.lock().unwrap_or_else(|p| p.into_inner());
        while self.long_reads.load(Ordering::SeqCst) > 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                tracing::debug!("a change of the mappings waited {LONG_READ_WAIT:?} for long reads: going on");
                return;
            }
            g = done.wait_timeout(g, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// For work that can wait (a background thread's populate or driver pin) and holds the
    /// process's memory-map lock for reading for long: `None` while a change of the mappings is
    /// in flight (step aside and try again). While the guard lives, a change that comes waits
    /// for it before it takes the space's lock, rather than in the kernel: a writer waiting
    /// there for the memory-map lock makes every later reader queue behind it (the render
    /// thread's collects, whose scans read the memory map), and it would hold the space's lock
    /// that those collects need meanwhile. Keep it only for the read, and make no change of the
    /// space's mappings while it lives (the change would wait for it: 100 ms).
    pub fn try_long_read(&self) -> Option<LongRead<'_>> {
        self.begin_long_read().then(|| LongRead(self))
    }

    /// [`Space::try_long_read`] with a guard that keeps the space alive rather than borrow it
    /// (the C API's `emuhost_space_long_read_begin`).
    pub fn try_long_read_owned(self: &Arc<Self>) -> Option<OwnedLongRead> {
        self.begin_long_read().then(|| OwnedLongRead(self.clone()))
    }

    /// Counts a long read, then refuses it (and ends it) while a change is in flight: counted
    /// first, so a change that comes meanwhile either is seen here or sees the read and waits.
    fn begin_long_read(&self) -> bool {
        self.long_reads.fetch_add(1, Ordering::SeqCst);
        if self.changing.load(Ordering::SeqCst) == 0 {
            return true;
        }
        self.end_long_read();
        false
    }

    /// Ends a long read: the last one wakes the changes waiting for them.
    fn end_long_read(&self) {
        if self.long_reads.fetch_sub(1, Ordering::SeqCst) == 1 {
            // Under the lock a waiting change checks the count under, so it never misses this.
            let _g = self.reads_done.0.lock().unwrap_or_else(|p| p.into_inner());
            self.reads_done.1.notify_all();
        }
    }

    /// The changes so far that found a long read in flight and waited for it.
    pub fn long_read_waits(&self) -> u64 {
        self.long_read_waits.load(Ordering::Relaxed)
    }

    /// Long reads of the memory map under way ([`Space::try_long_read`]).
    pub fn long_reads_in_flight(&self) -> u32 {
        self.long_reads.load(Ordering::SeqCst)
    }
}
