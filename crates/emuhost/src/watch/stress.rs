//! The no-lost-writes check: two writer threads storing with the CPU, a collector, and a thread
//! committing, protecting and splitting views over the same pages, checked against a shadow
//! record. Used by the tests and by `emuhost bench watch`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use super::{BackendKind, Tracker, WatchError};
use crate::space::{GuestAddr, Prot, Space, page_size};

/// What a stress run found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StressReport {
    pub writes: u64,
    /// Writes that the first collect reading their page after them did not report.
    pub lost: u64,
    pub collects: u64,
    /// Commits, protections and view splits made while the writers ran.
    pub space_ops: u64,
}

/// Runs the stress with `writes_per_writer` writes on each of two writer threads.
///
/// Each writer reads the collect epoch before (`e1`) and after (`e2`) each store and logs both.
/// Collect `n` starts by raising the epoch to `n`, so collect `e2 + 1` started after the store
/// ended: the store must be reported by one of collects `e1 ..= e2 + 1`, or it is lost.
pub fn stress(kind: BackendKind, writes_per_writer: u64) -> Result<StressReport, WatchError> {
    let p = page_size();
    let s = Arc::new(Space::with_window(1 << 30)?);
    let t = Tracker::with_backend(&s, kind)?;
    for i in 0..4 {
        s.commit(s.range(i * 64 * p, 64 * p)?, Prot::READ_WRITE)?;
    }
    let sec = s.create_section(64 * p)?;
    s.map_pages(GuestAddr(512 * p), sec, &(0..64).collect::<Vec<_>>(), Prot::READ_WRITE)?;
    let whole = s.range(0, 576 * p)?;
    t.arm(whole)?;
    // Pages the mutator releases and remaps; the writers keep off them.
    let volatile = [512 + 16, 512 + 48];
    let targets: Arc<Vec<u64>> = Arc::new((0..256).chain(512..576).filter(|pg| !volatile.contains(pg)).collect());
    let epoch = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let (epoch, targets, s) = (epoch.clone(), targets.clone(), s.clone());
            std::thread::spawn(move || -> Result<Vec<(u32, u32, u32)>, WatchError> {
                let mut log = Vec::with_capacity(writes_per_writer as usize);
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (w + 1);
                for i in 0..writes_per_writer {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let pg = targets[(x % targets.len() as u64) as usize];
                    let e1 = epoch.load(SeqCst);
                    // The target pages stay committed (or mapped) read-write throughout: the mutator
                    // re-commits and re-protects them read-write and releases only volatile pages.
                    s.store(GuestAddr(pg * page_size() + w * 8), &i.to_le_bytes())?;
                    log.push((pg as u32, e1 as u32, epoch.load(SeqCst) as u32));
                }
                Ok(log)
            })
        })
        .collect();
    let mutator = {
        let (s, stop) = (s.clone(), stop.clone());
        std::thread::spawn(move || -> Result<u64, WatchError> {
            let p = page_size();
            let mut ops = 0;
            while !stop.load(SeqCst) {
                let a = ops % 4;
                s.commit(s.range(a * 64 * p, 64 * p)?, Prot::READ_WRITE)?;
                s.protect(s.range((a * 64 + 8) * p, 8 * p)?, Prot::READ_WRITE)?;
                let v = volatile[(ops % 2) as usize];
                s.decommit(s.range(v * p, p)?)?;
                s.map_section(s.range(v * p, p)?, sec, (v - 512) * p, Prot::READ_WRITE)?;
                ops += 1;
                std::thread::yield_now();
            }
            Ok(ops * 4)
        })
    };
    let mut reported: Vec<Vec<u32>> = vec![Vec::new(); 576];
    let mut collect = |n: u32| -> Result<(), WatchError> {
        for a in t.collect(whole)?.page_addrs() {
            reported[(a.0 / page_size()) as usize].push(n);
        }
        Ok(())
    };
    let mut n = 0u32;
    let mut result = Ok(());
    while !writers.iter().all(|w| w.is_finished()) {
        n = epoch.fetch_add(1, SeqCst) as u32 + 1;
        if let Err(e) = collect(n) {
            result = Err(e);
            break;
        }
    }
    stop.store(true, SeqCst);
    let logs: Vec<_> = writers.into_iter().map(|w| w.join().expect("writer panicked")).collect();
    let space_ops = mutator.join().expect("mutator panicked")?;
    result?;
    n += 1;
    epoch.store(n as u64, SeqCst);
    collect(n)?;
    let (mut writes, mut lost) = (0, 0);
    for log in logs {
        for (pg, e1, e2) in log? {
            writes += 1;
            if !reported[pg as usize].iter().any(|r| *r >= e1 && *r <= e2 + 1) {
                lost += 1;
            }
        }
    }
    Ok(StressReport { writes, lost, collects: n as u64, space_ops })
}
