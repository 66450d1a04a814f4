//! How far the benches of this process have got, for a front end's progress bar: the rounds
//! planned so far and the rounds done. Each bench plans a part's rounds as the part begins (so
//! the total grows part by part) and ticks one as each round begins.

use std::sync::atomic::{AtomicU64, Ordering};

static PLANNED: AtomicU64 = AtomicU64::new(0);
static DONE: AtomicU64 = AtomicU64::new(0);

/// Adds `rounds` to the rounds planned (a part of a bench beginning).
pub fn plan(rounds: u64) {
    PLANNED.fetch_add(rounds, Ordering::Relaxed);
}

/// One round begun.
pub fn tick() {
    DONE.fetch_add(1, Ordering::Relaxed);
}

/// The rounds begun and the rounds planned so far, since the process began.
pub fn rounds() -> (u64, u64) {
    (DONE.load(Ordering::Relaxed), PLANNED.load(Ordering::Relaxed))
}
