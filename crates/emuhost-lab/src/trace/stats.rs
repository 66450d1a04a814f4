//! Figures of a trace, computed in one pass (memory grows with the distinct chunk runs touched,
//! not with the session's length).

use std::collections::{BTreeMap, BTreeSet};

use super::event::{Event, Record, SleepKind, Thread};

/// A set of `u64`s kept as disjoint, non-adjacent runs `start..end`.
#[derive(Clone, Debug, Default)]
struct RunSet {
    runs: BTreeMap<u64, u64>,
}

impl RunSet {
    fn insert(&mut self, mut start: u64, mut end: u64) {
        // Merge with a run that starts at or before `start` and reaches it.
        if let Some((&s, &e)) = self.runs.range(..=start).next_back()
            && e >= start
        {
            if e >= end {
                return;
            }
            start = s;
            self.runs.remove(&s);
        }
        // Swallow runs that start inside `start..=end`.
        while let Some((&s, &e)) = self.runs.range(start..=end).next() {
            end = end.max(e);
            self.runs.remove(&s);
        }
        self.runs.insert(start, end);
    }

    fn count(&self) -> u64 {
        self.runs.iter().map(|(s, e)| e - s).sum()
    }
}

/// The figures `emuhost trace stats` prints. Counts are of events; sizes in bytes; times in
/// µs (the trace's) or ns (sleeps).
///
/// ```
/// use emuhost_lab::trace::{Stats, read_str};
///
/// let text = "emuhost-trace 1\n0 g0 pool 0xfff000 0x2000\n10 r bind 0xfff800 0x1000\n\
///             20 r frame 0\n1000020 r frame 1\nend 4\n";
/// let (_, records) = read_str(text).unwrap();
/// let s = Stats::of(records.into_iter().map(Ok::<_, ()>), 16 << 20).unwrap();
/// assert_eq!((s.pools_crossing_chunk_end, s.binds_crossing_chunk_end, s.frames), (1, 1, 2));
/// assert_eq!(s.duration_us, 1_000_020);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    /// The chunk size the chunk figures are counted in (bytes).
    pub chunk: u64,
    /// Events (records).
    pub events: u64,
    /// `frame` events.
    pub frames: u64,
    /// From the first event's time to the last's.
    pub duration_us: u64,
    /// Pools made.
    pub pools: u64,
    /// Pools released (`unpool`).
    pub pools_released: u64,
    /// Pools that run across the end of a chunk (their first and last bytes are in different chunks).
    pub pools_crossing_chunk_end: u64,
    /// Chunks that any pool touches.
    pub chunks_touched: u64,
    /// Chunks with at least one binding in them.
    pub chunks_bound: u64,
    /// `commit` events.
    pub commits: u64,
    /// Byte sums are u128: a trace may commit (write, collect) its whole window many times over.
    pub committed_bytes: u128,
    /// `decommit` events.
    pub decommits: u64,
    /// `bind` events.
    pub binds: u64,
    /// Bindings that run across the end of a chunk.
    pub binds_crossing_chunk_end: u64,
    /// Distinct chunk ends that some binding runs across.
    pub chunk_ends_bound_across: u64,
    /// `write` events.
    pub writes: u64,
    /// Bytes written.
    pub write_bytes: u128,
    /// `collect` events.
    pub collects: u64,
    /// Bytes collected over.
    pub collect_bytes: u128,
    /// Guest short sleeps (each of a `sleep ... xN` counted).
    pub sleeps_guest: u64,
    /// Host short sleeps.
    pub sleeps_host: u64,
    /// The guest's sleeps' total, in ns.
    pub sleep_guest_ns: u128,
    /// The host's sleeps' total, in ns.
    pub sleep_host_ns: u128,
    /// Distinct game threads.
    pub game_threads: u64,
    /// Distinct host threads.
    pub host_threads: u64,
}

/// Accumulates [`Stats`] one record at a time (as a reader streams them, say).
///
/// ```
/// use emuhost::space::GuestAddr;
/// use emuhost_lab::trace::{Event, Record, StatsBuilder, Thread};
///
/// let mut b = StatsBuilder::new(16 << 20);
/// let write = Event::Write { addr: GuestAddr(0x1000), size: 64 };
/// b.add(&Record { t_us: 0, thread: Thread::Game(1), event: write });
/// b.add(&Record { t_us: 9, thread: Thread::Game(2), event: write });
/// let s = b.finish();
/// assert_eq!((s.writes, s.write_bytes, s.game_threads, s.duration_us), (2, 128, 2, 9));
/// ```
#[derive(Clone, Debug)]
pub struct StatsBuilder {
    chunk: u64,
    first_t: Option<u64>,
    last_t: u64,
    touched: RunSet,
    bound: RunSet,
    ends_bound: BTreeSet<u64>,
    threads: BTreeSet<Thread>,
    s: Stats,
}

impl StatsBuilder {
    /// Counts chunks of `chunk` bytes (a power of two, at least a page; 16 MiB is the default).
    ///
    /// # Panics
    /// Where `chunk` is not a power of two.
    pub fn new(chunk: u64) -> Self {
        assert!(chunk.is_power_of_two(), "chunk size {chunk:#x} is not a power of two");
        let s = Stats {
            chunk,
            events: 0,
            frames: 0,
            duration_us: 0,
            pools: 0,
            pools_released: 0,
            pools_crossing_chunk_end: 0,
            chunks_touched: 0,
            chunks_bound: 0,
            commits: 0,
            committed_bytes: 0,
            decommits: 0,
            binds: 0,
            binds_crossing_chunk_end: 0,
            chunk_ends_bound_across: 0,
            writes: 0,
            write_bytes: 0,
            collects: 0,
            collect_bytes: 0,
            sleeps_guest: 0,
            sleeps_host: 0,
            sleep_guest_ns: 0,
            sleep_host_ns: 0,
            game_threads: 0,
            host_threads: 0,
        };
        Self {
            chunk,
            first_t: None,
            last_t: 0,
            touched: RunSet::default(),
            bound: RunSet::default(),
            ends_bound: BTreeSet::new(),
            threads: BTreeSet::new(),
            s,
        }
    }

    /// The chunks `addr..addr+size` touches, as `first..last + 1`.
    fn chunks(&self, addr: u64, size: u64) -> (u64, u64) {
        (addr / self.chunk, (addr + size - 1) / self.chunk + 1)
    }

    /// Counts one record (records come in the trace's order).
    pub fn add(&mut self, r: &Record) {
        let s = &mut self.s;
        s.events += 1;
        self.first_t.get_or_insert(r.t_us);
        self.last_t = r.t_us;
        if !matches!(r.thread, Thread::Render) {
            self.threads.insert(r.thread);
        }
        match r.event {
            Event::Frame { .. } => s.frames += 1,
            Event::Pool { lo, size } => {
                s.pools += 1;
                let (first, end) = self.chunks(lo.0, size);
                if end - first > 1 {
                    self.s.pools_crossing_chunk_end += 1;
                }
                self.touched.insert(first, end);
            }
            Event::Unpool { .. } => s.pools_released += 1,
            Event::Commit { size, .. } => {
                s.commits += 1;
                s.committed_bytes = s.committed_bytes.saturating_add(u128::from(size));
            }
            Event::Decommit { .. } => s.decommits += 1,
            Event::Bind { addr, size } => {
                s.binds += 1;
                let (first, end) = self.chunks(addr.0, size);
                if end - first > 1 {
                    self.s.binds_crossing_chunk_end += 1;
                    self.ends_bound.extend(first + 1..end);
                }
                self.bound.insert(first, end);
            }
            Event::Write { size, .. } => {
                s.writes += 1;
                s.write_bytes = s.write_bytes.saturating_add(u128::from(size));
            }
            Event::Collect { size, .. } => {
                s.collects += 1;
                s.collect_bytes = s.collect_bytes.saturating_add(u128::from(size));
            }
            Event::Sleep { kind: SleepKind::Guest, ns, count } => {
                s.sleeps_guest = s.sleeps_guest.saturating_add(u64::from(count));
                s.sleep_guest_ns = s.sleep_guest_ns.saturating_add(u128::from(ns) * u128::from(count));
            }
            Event::Sleep { kind: SleepKind::Host, ns, count } => {
                s.sleeps_host = s.sleeps_host.saturating_add(u64::from(count));
                s.sleep_host_ns = s.sleep_host_ns.saturating_add(u128::from(ns) * u128::from(count));
            }
        }
    }

    /// The figures of the records added.
    pub fn finish(mut self) -> Stats {
        let s = &mut self.s;
        s.duration_us = self.first_t.map_or(0, |f| self.last_t - f);
        s.chunks_touched = self.touched.count();
        s.chunks_bound = self.bound.count();
        s.chunk_ends_bound_across = self.ends_bound.len() as u64;
        s.game_threads = self.threads.iter().filter(|t| matches!(t, Thread::Game(_))).count() as u64;
        s.host_threads = self.threads.iter().filter(|t| matches!(t, Thread::Host(_))).count() as u64;
        self.s
    }
}

impl Stats {
    /// The figures of a stream of records, in chunks of `chunk` bytes.
    ///
    /// # Errors
    /// The stream's first error (a [`Reader`](super::Reader)'s [`TraceError`](super::TraceError)).
    ///
    /// # Panics
    /// As [`StatsBuilder::new`].
    pub fn of<E>(records: impl IntoIterator<Item = Result<Record, E>>, chunk: u64) -> Result<Stats, E> {
        let mut b = StatsBuilder::new(chunk);
        for r in records {
            b.add(&r?);
        }
        Ok(b.finish())
    }

    /// Frames per second over the duration.
    pub fn fps(&self) -> f64 {
        if self.duration_us == 0 { 0.0 } else { self.frames as f64 / (self.duration_us as f64 / 1e6) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::read_str;

    #[test]
    fn run_sets_merge_overlapping_and_adjacent_runs() {
        let mut s = RunSet::default();
        s.insert(10, 12);
        s.insert(14, 15);
        assert_eq!(s.count(), 3);
        s.insert(11, 14); // joins both
        assert_eq!((s.count(), s.runs.len()), (5, 1));
        s.insert(0, 2);
        s.insert(2, 3); // adjacent
        assert_eq!((s.count(), s.runs.len()), (8, 2));
        s.insert(12, 13); // inside
        s.insert(0, 30); // over all
        assert_eq!((s.count(), s.runs.len()), (30, 1));
    }

    #[test]
    fn figures_of_a_small_trace() {
        let text = "emuhost-trace 1\n\
            100 r frame 0\n\
            101 g0 commit 0x1021745000 0x1000000 rw-\n\
            102 g0 pool 0x1021745000 0x1000000\n\
            103 g0 pool 0x1034ef6000 0x1000\n\
            104 g0 pool 0x1000000000 0x1000000\n\
            105 g0 pool 0x1000ff0000 0x10000\n\
            106 g1 write 0x1021745000 0x10\n\
            107 g1 sleep guest 20000 x10\n\
            108 h0 sleep host 500000\n\
            25100 r frame 1\n\
            25101 r bind 0x1021ffff00 0x160\n\
            25102 r bind 0x1021ffff00 0x100\n\
            25103 r bind 0x1034ef6000 0x100\n\
            25104 r collect 0x1021745000 0x2000\n\
            25105 g0 unpool 0x1034ef6000 0x1000\n\
            end 15\n";
        let (_, records) = read_str(text).unwrap();
        let s = Stats::of(records.into_iter().map(Ok::<_, ()>), 16 << 20).unwrap();
        assert_eq!((s.pools, s.pools_crossing_chunk_end, s.chunks_touched), (4, 1, 4));
        assert_eq!((s.chunks_bound, s.binds, s.binds_crossing_chunk_end, s.chunk_ends_bound_across), (3, 3, 1, 1));
        assert_eq!((s.frames, s.duration_us, s.writes, s.write_bytes, s.collects), (2, 25005, 1, 0x10, 1));
        assert_eq!((s.sleeps_guest, s.sleep_guest_ns, s.sleeps_host, s.sleep_host_ns), (10, 200_000, 1, 500_000));
        assert_eq!((s.game_threads, s.host_threads, s.pools_released, s.commits), (2, 1, 1, 1));
        // A pool that ends exactly at a chunk's end does not cross it; with 4 KiB chunks everything crosses.
        let s = Stats::of(read_str(text).unwrap().1.into_iter().map(Ok::<_, ()>), 0x1000).unwrap();
        assert_eq!(s.pools_crossing_chunk_end, 3);
    }
}
