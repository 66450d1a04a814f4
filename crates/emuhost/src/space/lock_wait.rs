//! How long threads waited for the space's lock, per thread.
//!
//! A change of the mappings holds the space's lock while it waits in the kernel for the
//! memory-map lock (behind a driver's pin, say), and a collect on the render thread waits for the
//! space's lock meanwhile (see docs/import.md, "The worst frame"). So each thread keeps its own
//! waits for it: how many, how long in all and the longest. Only a wait is timed: the lock is
//! tried first, and the clock is read (twice) only where the try failed, so taking a free lock
//! costs what it did.

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::{MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use super::{Space, State};

/// A thread's waits for the space's lock: those that found it held by another thread, timed from
/// asking for it until getting it (not the time it was held). Read with [`lock_waits`] and
/// [`take_lock_waits`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LockWaits {
    /// Times the lock was held by another thread when this one asked for it.
    pub count: u64,
    /// The time those waits took, in all.
    pub total: Duration,
    /// The longest of them.
    pub longest: Duration,
}

thread_local! {
    static WAITS: Cell<LockWaits> =
        const { Cell::new(LockWaits { count: 0, total: Duration::ZERO, longest: Duration::ZERO }) };
}

/// This thread's waits for the lock of any space, since the thread began or the last
/// [`take_lock_waits`]. A thread that never found a space's lock held has none (all zero).
pub fn lock_waits() -> LockWaits {
    WAITS.with(Cell::get)
}

/// [`lock_waits`], and starts this thread's count again from zero: for a caller that measures one
/// part of a thread's work (a replay's render thread, a frame).
pub fn take_lock_waits() -> LockWaits {
    WAITS.with(Cell::take)
}

fn add(waited: Duration) {
    WAITS.with(|w| {
        let mut v = w.get();
        v.count += 1;
        v.total += waited;
        v.longest = v.longest.max(waited);
        w.set(v);
    });
}

impl Space {
    /// The space's lock. Tried first; where another thread holds it, the wait is counted in this
    /// thread's [`lock_waits`].
    pub(super) fn lock_state(&self) -> MutexGuard<'_, State> {
        match self.state.try_lock() {
            Ok(g) => g,
            // A panic while the lock was held cannot leave the maps half-updated in a way that
            // makes them unsafe to read: keep going with what is there.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                // The clock before the count: a thread that sees the count (a test) knows this
                // wait began.
                let asked = Instant::now();
                self.lock_waiters.fetch_add(1, Ordering::SeqCst);
                let g = self.state.lock().unwrap_or_else(|p| p.into_inner());
                self.lock_waiters.fetch_sub(1, Ordering::SeqCst);
                add(asked.elapsed());
                g
            }
        }
    }

    /// Threads waiting for the space's lock now (each wait is counted in its thread's
    /// [`lock_waits`] once it has the lock).
    pub fn lock_waiters(&self) -> u32 {
        self.lock_waiters.load(Ordering::SeqCst)
    }
}
