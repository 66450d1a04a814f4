//! Every live reservation of the process, made or adopted, on every platform: `(id, start, end)`,
//! host addresses, guards included. A reservation made later inside another's window lies in a
//! hole foreign code freed there: it is that other's to leave alone.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

static LIVE: Mutex<Vec<(u64, usize, usize)>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn live() -> MutexGuard<'static, Vec<(u64, usize, usize)>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records a reservation of host `start..end`; returns its id (later ones get larger ids).
pub fn add(start: usize, end: usize) -> u64 {
    let id = NEXT_ID.fetch_add(1, Relaxed);
    live().push((id, start, end));
    id
}

/// Forgets reservation `id`.
pub fn remove(id: u64) {
    live().retain(|&(i, _, _)| i != id);
}

/// The parts of host `start..end` that reservations made after reservation `id` hold, in
/// address order.
pub fn later_within(id: u64, start: usize, end: usize) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = live()
        .iter()
        .filter(|&&(i, s, e)| i > id && s < end && start < e)
        .map(|&(_, s, e)| (s.max(start), e.min(end)))
        .collect();
    v.sort_unstable();
    v
}
