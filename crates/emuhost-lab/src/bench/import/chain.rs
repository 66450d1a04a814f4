//! The import bench, part (3): the render thread's collects beside a game thread's commits
//! and a background thread's pins, the chain that made the worst frames under the pools policy
//! on the H200. A pin holds the process's memory-map lock for reading for milliseconds; a commit
//! (or its arm) that comes meanwhile waits in the kernel for the lock in write mode, holding the
//! space's lock; a collect then waits for the space's lock, and its scan for the memory-map lock
//! behind the waiting writer. Three arms, alternated round by round:
//!
//! - `pin in the kernel's queue`: the pinning thread steps aside while a change is in flight, then
//!   pins (the importer before the space's long reads);
//! - `pin as a long read`: it pins under [`Space::try_long_read`], so a change that comes during
//!   the pin waits for it before it takes the space's lock, not in the kernel;
//! - `pieces as long reads`: it pins the range in pieces of `piece` bytes, each under a long
//!   read of its own (the importer's background threads since `EMUHOST_IMPORT_AHEAD_PIECE_KB`),
//!   so a change waits for one piece's pin at most.
//!
//! Each round runs the three threads for the round's duration (the pins of `pinned` bytes) and reports
//! the collects' latency (p50, p99, worst), the game thread's commit-and-arm latency, and the pins
//! made per second.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use emuhost::import::{AnyBackend, Backend, HostSpan};
use emuhost::space::{GuestAddr, Prot, Space, page_size};
use emuhost::watch::Tracker;

use crate::bench::{BenchError, median, ms, quantile};

const MIB: u64 = 1 << 20;
/// Collected by the render thread: armed, a few pages written between collects.
const COLLECTED: u64 = 16 * MIB;
/// Where the game thread commits 16 KiB pieces, then decommits them all and starts over.
const GAME: u64 = 256 * MIB;
const PIECE: u64 = 16 << 10;

/// The arms' names, in order.
pub const ARMS: [&str; 3] = ["pin in the kernel's queue", "pin as a long read", "pieces as long reads"];

/// How the pinning thread pins.
#[derive(Clone, Copy)]
enum Pins {
    Queue,
    LongRead,
    /// In pieces of this many bytes, each a long read.
    Pieces(u64),
}

/// One round of one arm: the collects' and the changes' latency in ms, the pins per second.
#[derive(Clone, Debug, Default)]
pub struct Round {
    /// The render thread's collects: median.
    pub collect_p50: f64,
    /// The render thread's collects: 99th percentile.
    pub collect_p99: f64,
    /// The render thread's collects: the longest.
    pub collect_worst: f64,
    /// The game thread's commit-and-arm of a 16 KiB piece: 99th percentile.
    pub change_p99: f64,
    /// The game thread's commit-and-arm: the longest.
    pub change_worst: f64,
    /// The pins the pinning thread made per second of the round.
    pub pins_per_s: f64,
    /// The write-tracking backend the round's tracker picked.
    pub tracker: &'static str,
}

/// A figure's name and how to read it from a round.
pub type Figure = (&'static str, fn(&Round) -> f64);

/// What the three arms measured.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ChainResult {
    /// `rounds[r][a]`: round `r` of arm `a` (in [`ARMS`]' order).
    pub rounds: Vec<[Round; 3]>,
    /// Bytes pinned at a time, and the piece of the third arm.
    pub pinned: u64,
    /// See `pinned`.
    pub piece: u64,
    /// The write-tracking backend (`""` without a round).
    pub tracker: &'static str,
    /// The import backend's kind (`vulkan`, `cuda`, `pin`).
    pub backend: String,
}

/// A long read of `space`, once one is given (`None` once `stop` is set).
fn long_read<'a>(space: &'a Space, stop: &AtomicBool) -> Option<emuhost::space::LongRead<'a>> {
    loop {
        if let Some(r) = space.try_long_read() {
            return Some(r);
        }
        if stop.load(Ordering::Relaxed) {
            return None;
        }
        std::thread::yield_now();
    }
}

/// The pinning thread's loop: pin `lo..lo + len` (whole, or piece by piece), release, 1 ms
/// apart, until `stop`. The pins of the whole range made.
fn pin_loop(
    b: &AnyBackend,
    space: &Arc<Space>,
    (lo, len): (u64, u64),
    how: Pins,
    stop: &AtomicBool,
) -> Result<u64, BenchError> {
    let mut pins = 0;
    while !stop.load(Ordering::Relaxed) {
        match how {
            Pins::Queue | Pins::LongRead => {
                let read = if let Pins::LongRead = how {
                    let Some(r) = long_read(space, stop) else { return Ok(pins) };
                    Some(r)
                } else {
                    while space.changes_in_flight() > 0 && !stop.load(Ordering::Relaxed) {
                        std::thread::yield_now();
                    }
                    None
                };
                // The release too: `munlock` holds the lock for writing as long as a pin holds it.
                let import = b.import(HostSpan::of(space, lo, len)?)?;
                b.release(import);
                drop(read);
            }
            Pins::Pieces(piece) => {
                let mut held = Vec::new();
                let mut at = lo;
                while at < lo + len {
                    let n = piece.min(lo + len - at);
                    let Some(_read) = long_read(space, stop) else { break };
                    held.push(b.import(HostSpan::of(space, at, n)?)?);
                    at += n;
                }
                for import in held {
                    let _read = long_read(space, stop);
                    b.release(import);
                }
                if at < lo + len {
                    return Ok(pins);
                }
            }
        }
        pins += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(pins)
}

/// The game thread's loop: commit and arm 16 KiB pieces one after another, a byte written in
/// each, 200 µs apart; the whole area decommitted when it is full. The commit-and-arm times.
fn game_loop(space: &Space, tracker: &Tracker, at: u64, stop: &AtomicBool) -> Result<Vec<f64>, BenchError> {
    let mut times = Vec::new();
    let mut off = 0;
    while !stop.load(Ordering::Relaxed) {
        if off == GAME {
            space.decommit(space.range(at, GAME)?)?;
            off = 0;
        }
        let piece = space.range(at + off, PIECE)?;
        let t = Instant::now();
        space.commit(piece, Prot::READ_WRITE)?;
        tracker.arm(piece)?;
        times.push(ms(t.elapsed()));
        space.write(GuestAddr(at + off), &[1])?;
        off += PIECE;
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(times)
}

/// One round of one arm: the three threads for `dur`, the background thread pinning `pinned`
/// bytes (populated: the pin of a pool imported ahead).
fn round(b: &AnyBackend, how: Pins, dur: Duration, pinned: u64) -> Result<Round, BenchError> {
    let align = b.alignment().max(page_size());
    // The pinned range (aligned for the device), then the collected one and the game's area.
    let space = Arc::new(Space::with_window((align + pinned + (1 << 30)).next_multiple_of(1 << 30))?);
    let pin_lo = (align - space.host_base() as u64 % align) % align;
    let (coll, game) = (pin_lo + pinned + (1 << 28), pin_lo + pinned + (1 << 29));
    let pin_range = space.range(pin_lo, pinned)?;
    space.commit(pin_range, Prot::READ_WRITE)?;
    space.populate(pin_range)?;
    let collected = space.range(coll, COLLECTED)?;
    space.commit(collected, Prot::READ_WRITE)?;
    space.populate(collected)?;
    let tracker = Tracker::new(&space, &emuhost::watch::TrackerConfig::default())?;
    tracker.arm(collected)?;
    let stop = AtomicBool::new(false);
    let p = page_size();
    let (pins, mut changes, mut collects) = std::thread::scope(|sc| -> Result<_, BenchError> {
        let pinner = sc.spawn(|| pin_loop(b, &space, (pin_lo, pinned), how, &stop));
        let gamer = sc.spawn(|| game_loop(&space, &tracker, game, &stop));
        let mut collects = Vec::new();
        let end = Instant::now() + dur;
        let mut i = 0u64;
        let rendered = (|| -> Result<(), BenchError> {
            while Instant::now() < end {
                for k in 0..8 {
                    space.write(GuestAddr(coll + ((i * 8 + k) * 97 % (COLLECTED / p)) * p), &[1])?;
                }
                i += 1;
                let t = Instant::now();
                tracker.collect(collected)?;
                collects.push(ms(t.elapsed()));
                std::thread::sleep(Duration::from_micros(250));
            }
            Ok(())
        })();
        stop.store(true, Ordering::Relaxed);
        let pins = pinner.join().expect("the pinning thread panicked")?;
        let changes = gamer.join().expect("the game thread panicked")?;
        rendered?;
        Ok((pins, changes, collects))
    })?;
    collects.sort_by(f64::total_cmp);
    changes.sort_by(f64::total_cmp);
    Ok(Round {
        collect_p50: quantile(&collects, 0.5),
        collect_p99: quantile(&collects, 0.99),
        collect_worst: quantile(&collects, 1.0),
        change_p99: quantile(&changes, 0.99),
        change_worst: quantile(&changes, 1.0),
        pins_per_s: pins as f64 / dur.as_secs_f64(),
        tracker: tracker.kind().name(),
    })
}

/// The three arms, `rounds` times, in an order that turns each round. `piece` is rounded up to
/// the backend's alignment. Each round runs each arm for `dur`, pinning `pinned` bytes at a time.
///
/// # Errors
///
/// The first runtime call that failed (a space made, a commit, an import refused).
pub fn arms(
    b: &Arc<AnyBackend>,
    rounds: u32,
    dur: Duration,
    pinned: u64,
    piece: u64,
) -> Result<ChainResult, BenchError> {
    let piece = piece.next_multiple_of(b.alignment().max(page_size()));
    let mut out = Vec::new();
    for r in 0..rounds {
        let mut all: [Round; 3] = Default::default();
        for k in 0..3 {
            let i = (r as usize + k) % 3;
            let how = [Pins::Queue, Pins::LongRead, Pins::Pieces(piece)][i];
            all[i] = round(b, how, dur, pinned)?;
        }
        out.push(all);
    }
    let tracker = out.first().map_or("", |r| r[0].tracker);
    Ok(ChainResult { rounds: out, pinned, piece, tracker, backend: b.kind().name().to_string() })
}

impl ChainResult {
    /// The median over rounds of one figure of arm `i`.
    pub fn med(&self, i: usize, f: fn(&Round) -> f64) -> f64 {
        let mut v: Vec<f64> = self.rounds.iter().map(|r| f(&r[i])).collect();
        median(&mut v)
    }

    /// The figures a report shows, by name.
    pub const FIGURES: [Figure; 6] = [
        ("collect_ms_p50", |r| r.collect_p50),
        ("collect_ms_p99", |r| r.collect_p99),
        ("collect_ms_worst", |r| r.collect_worst),
        ("change_ms_p99", |r| r.change_p99),
        ("change_ms_worst", |r| r.change_worst),
        ("pins_per_s", |r| r.pins_per_s),
    ];
}
