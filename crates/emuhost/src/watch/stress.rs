//! The no-lost-writes check: every kind of operation at once over the same pages, checked against
//! a shadow record. Two writer threads store with the CPU; a host writer copies through the kernel
//! (`Space::write`); a populator faults runs of the written pages in (`Space::populate`); a
//! mutator commits, protects, releases, splits views and populates pages it has just remapped or
//! recommitted; the calling thread collects. Used by the tests and by `emuhost bench watch`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::thread::JoinHandle;

use super::{BackendKind, Tracker, WatchError};
use crate::space::{GuestAddr, Prot, Space, page_size};

/// How many operations of each kind a stress run made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StressOps {
    /// Stores by the CPU (the two writer threads).
    pub cpu_stores: u64,
    /// Copies into guest pages through the kernel (`process_vm_writev`).
    pub host_writes: u64,
    pub collects: u64,
    /// Commits over written pages, and recommits of pages just released.
    pub commits: u64,
    pub protects: u64,
    pub releases: u64,
    /// Section pages mapped inside a run of views (each splits the run).
    pub view_splits: u64,
    /// Populates of runs of pages the writers write.
    pub populates_written: u64,
    /// Populates of pages just remapped or recommitted.
    pub populates_fresh: u64,
}

impl StressOps {
    /// Each kind's name and count.
    pub fn kinds(&self) -> [(&'static str, u64); 9] {
        [
            ("cpu stores", self.cpu_stores),
            ("host writes", self.host_writes),
            ("collects", self.collects),
            ("commits", self.commits),
            ("protects", self.protects),
            ("releases", self.releases),
            ("view splits", self.view_splits),
            ("populates of written pages", self.populates_written),
            ("populates of fresh pages", self.populates_fresh),
        ]
    }
}

/// What a stress run found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StressReport {
    /// Writes checked: CPU stores and host writes.
    pub writes: u64,
    /// Writes that the first collect reading their page after them did not report.
    pub lost: u64,
    pub collects: u64,
    /// Commits, protections, releases, view splits and populates made while the writers ran.
    pub space_ops: u64,
    pub ops: StressOps,
}

/// A write's page and the collect epochs read before and after it.
type Logged = (u32, u32, u32);

/// The fewest steps of the host writer, the populator and the mutator, and the fewest collects,
/// a run makes: the CPU writers go on past their count until all are reached, so every kind of
/// operation runs beside the others however the threads are scheduled.
const MIN_STEPS: [u64; 3] = [1000, 500, 100];
const MIN_COLLECTS: u64 = 200;

/// What the threads of a run share to pace themselves.
struct Pace {
    /// The collect epoch: collect `n` raises it to `n` first.
    epoch: AtomicU64,
    /// Steps made by the host writer, the populator and the mutator.
    steps: [AtomicU64; 3],
    /// Every minimum reached (or a thread failed): the CPU writers may stop.
    enough: AtomicBool,
    /// The CPU writers are done: the background threads stop.
    stop: AtomicBool,
}

/// Background thread `k` of the stress: runs `step` until told to stop, at least once, and at most
/// `per_collect` times between two collects (so that no kind of operation starves the others of
/// the locks they share).
fn background(
    pace: &Arc<Pace>,
    k: usize,
    per_collect: u64,
    mut step: impl FnMut(u64) -> Result<(), WatchError> + Send + 'static,
) -> JoinHandle<Result<u64, WatchError>> {
    let pace = pace.clone();
    std::thread::spawn(move || {
        let (mut i, mut seen, mut now) = (0, u64::MAX, 0);
        loop {
            let e = pace.epoch.load(SeqCst);
            if e != seen {
                (seen, now) = (e, 0);
            }
            if now < per_collect {
                if let Err(err) = step(i) {
                    pace.enough.store(true, SeqCst);
                    return Err(err);
                }
                (i, now) = (i + 1, now + 1);
                pace.steps[k].store(i, SeqCst);
            }
            if pace.stop.load(SeqCst) && i > 0 {
                return Ok(i);
            }
            if now >= per_collect {
                // A sleep, not a yield: the kernel's scheduler (EEVDF) pushes a yielding thread's
                // deadline back at each yield, so a thread spinning on yields starves itself.
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        }
    })
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Runs the stress with at least `writes_per_writer` CPU stores on each of two writer threads (more
/// until every kind of operation has run its minimum, `MIN_STEPS` and `MIN_COLLECTS` in this
/// module); the host writer, the populator and the mutator run until the writers are done.
///
/// Each writer reads the collect epoch before (`e1`) and after (`e2`) each write and logs both.
/// Collect `n` starts by raising the epoch to `n`, so collect `e2 + 1` started after the write
/// ended: the write must be reported by one of collects `e1 ..= e2 + 1`, or it is lost.
///
/// Pages: 0..256 are four private allocations that the writers write, 256..320 one whose pages
/// the mutator releases and recommits, 512..576 a run of section views whose pages 528 and 560
/// the mutator releases and maps again. Host writes and populates go through
/// [`Tracker::host_write`] (the mprotect backend must make armed pages writable for them).
pub fn stress(kind: BackendKind, writes_per_writer: u64) -> Result<StressReport, WatchError> {
    let p = page_size();
    let s = Arc::new(Space::with_window(1 << 30)?);
    let t = Tracker::with_backend(&s, kind)?;
    for i in 0..5 {
        s.commit(s.range(i * 64 * p, 64 * p)?, Prot::READ_WRITE)?;
    }
    let sec = s.create_section(64 * p)?;
    s.map_pages(GuestAddr(512 * p), sec, &(0..64).collect::<Vec<_>>(), Prot::READ_WRITE)?;
    let whole = s.range(0, 576 * p)?;
    t.arm(whole)?;
    // Pages the mutator releases and remaps; the writers keep off them.
    let volatile = [512 + 16, 512 + 48];
    let targets: Arc<Vec<u64>> = Arc::new((0..256).chain(512..576).filter(|pg| !volatile.contains(pg)).collect());
    let pace = Arc::new(Pace {
        epoch: AtomicU64::new(0),
        steps: Default::default(),
        enough: AtomicBool::new(false),
        stop: AtomicBool::new(false),
    });
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let (pace, targets, s) = (pace.clone(), targets.clone(), s.clone());
            std::thread::spawn(move || -> Result<Vec<Logged>, WatchError> {
                let epoch = &pace.epoch;
                let mut log = Vec::with_capacity(writes_per_writer as usize);
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (w + 1);
                let mut i = 0u64;
                while i < writes_per_writer || !pace.enough.load(SeqCst) {
                    i += 1;
                    let pg = targets[(xorshift(&mut x) % targets.len() as u64) as usize];
                    let e1 = epoch.load(SeqCst);
                    // The target pages stay committed (or mapped) read-write throughout: the mutator
                    // re-commits and re-protects them read-write and releases only other pages.
                    // SAFETY: as said above; the tracker handles faults of the pages it armed.
                    #[allow(unsafe_code)]
                    let stored = unsafe { s.store_unchecked(GuestAddr(pg * page_size() + w * 8), &i.to_le_bytes()) };
                    if let Err(e) = stored {
                        pace.enough.store(true, SeqCst);
                        return Err(e.into());
                    }
                    log.push((pg as u32, e1 as u32, epoch.load(SeqCst) as u32));
                }
                Ok(log)
            })
        })
        .collect();
    let host_log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let host_writer = {
        let (e, targets, s, t, host_log) = (pace.clone(), targets.clone(), s.clone(), t.clone(), host_log.clone());
        let e = move || e.epoch.load(SeqCst);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        background(&pace, 0, 8, move |i| {
            let pg = targets[(xorshift(&mut x) % targets.len() as u64) as usize];
            let e1 = e();
            t.host_write(s.range(pg * page_size(), page_size())?, || {
                s.write(GuestAddr(pg * page_size() + 16), &i.to_le_bytes())
            })??;
            let e2 = e();
            host_log.lock().unwrap_or_else(|p| p.into_inner()).push((pg as u32, e1 as u32, e2 as u32));
            Ok(())
        })
    };
    let populator = {
        let (s, t) = (s.clone(), t.clone());
        let mut x = 0x1234_5678_9abc_def1u64;
        background(&pace, 1, 4, move |_| {
            // Eight pages the writers write, across an allocation's end now and then.
            let first = xorshift(&mut x) % (256 - 8);
            let r = s.range(first * page_size(), 8 * page_size())?;
            t.host_write(r, || s.populate(r))??;
            Ok(())
        })
    };
    let mutator = {
        let (s, t) = (s.clone(), t.clone());
        background(&pace, 2, 1, move |i| {
            let p = page_size();
            let a = i % 4;
            s.commit(s.range(a * 64 * p, 64 * p)?, Prot::READ_WRITE)?;
            s.protect(s.range((a * 64 + 8) * p, 8 * p)?, Prot::READ_WRITE)?;
            // A view split, and a populate of the page just mapped.
            let v = s.range(volatile[(i % 2) as usize] * p, p)?;
            s.decommit(v)?;
            s.map_section(v, sec, v.start().0 - 512 * p, Prot::READ_WRITE)?;
            t.host_write(v, || s.populate(v))??;
            // A private page released, recommitted and populated.
            let q = s.range((256 + i % 64) * p, p)?;
            s.decommit(q)?;
            s.commit(q, Prot::READ_WRITE)?;
            t.host_write(q, || s.populate(q))??;
            Ok(())
        })
    };
    let mut reported: Vec<Vec<u32>> = vec![Vec::new(); 576];
    let mut collect = |n: u32| -> Result<(), WatchError> {
        for a in t.collect(whole)?.page_addrs() {
            reported[(a.0 / page_size()) as usize].push(n);
        }
        Ok(())
    };
    let mut result = Ok(());
    while !writers.iter().all(|w| w.is_finished()) {
        let n = pace.epoch.fetch_add(1, SeqCst) as u32 + 1;
        if let Err(e) = collect(n) {
            pace.enough.store(true, SeqCst);
            result = Err(e);
            break;
        }
        if n as u64 >= MIN_COLLECTS && pace.steps.iter().zip(MIN_STEPS).all(|(s, min)| s.load(SeqCst) >= min) {
            pace.enough.store(true, SeqCst);
        }
    }
    pace.stop.store(true, SeqCst);
    let logs: Vec<_> = writers.into_iter().map(|w| w.join().expect("writer panicked")).collect();
    let host_writes = host_writer.join().expect("host writer panicked");
    let populates = populator.join().expect("populator panicked");
    let rounds = mutator.join().expect("mutator panicked");
    result?;
    let (host_writes, populates_written, rounds) = (host_writes?, populates?, rounds?);
    // A collect after every thread is done: it checks the last writes.
    let n = pace.epoch.fetch_add(1, SeqCst) as u32 + 1;
    collect(n)?;
    let host_log = std::mem::take(&mut *host_log.lock().unwrap_or_else(|p| p.into_inner()));
    let mut all = vec![host_log];
    for log in logs {
        all.push(log?);
    }
    let cpu_stores = all[1..].iter().map(|l| l.len() as u64).sum();
    let (mut writes, mut lost) = (0, 0);
    for (pg, e1, e2) in all.into_iter().flatten() {
        writes += 1;
        if !reported[pg as usize].iter().any(|r| *r >= e1 && *r <= e2 + 1) {
            lost += 1;
        }
    }
    let ops = StressOps {
        cpu_stores,
        host_writes,
        collects: n as u64,
        commits: rounds * 2,
        protects: rounds,
        releases: rounds * 2,
        view_splits: rounds,
        populates_written,
        populates_fresh: rounds * 2,
    };
    let space_ops =
        ops.commits + ops.protects + ops.releases + ops.view_splits + populates_written + ops.populates_fresh;
    Ok(StressReport { writes, lost, collects: n as u64, space_ops, ops })
}
