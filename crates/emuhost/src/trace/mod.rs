//! Traces of game sessions: what the guest and the renderer did to memory, frame by frame, to
//! replay through the runtime. The format is line-oriented text (`docs/trace-format.md`),
//! versioned, zstd-compressed where the file name ends in `.zst`.
//!
//! - [`Recorder`]: what an emulator calls while it runs (any thread; buffered).
//! - [`TraceWriter`]: writes records with their own times (one thread).
//! - [`Reader`]: streams a trace back, one line in memory at a time; a malformed line is an error
//!   naming the line and what was wrong.
//! - [`Synth`], [`default_session`]: a synthetic session shaped on the measured one.
//! - [`Stats`]: the figures of a trace (pools, pools across a chunk's end, chunks touched, ...).
//! - [`judge`]: the check of a soak (replays looped in one process): memory flat, nothing left live.

mod error;
mod event;
mod reader;
mod replay;
mod soak;
mod stats;
mod synth;
mod writer;

pub use error::{Malformed, TraceError};
pub use event::{DEFAULT_WINDOW, Event, GUEST_PAGE, Header, MAGIC, Record, SleepKind, Thread, VERSION};
pub use reader::{FileReader, MAX_LINE, Reader, is_zstd, read_str};
pub use replay::{
    FrameFigures, ReplayConfig, ReplayError, ReplayReport, SleepFigures, replay, replay_default, replay_file,
};
pub use soak::{
    DEFAULT_GROWTH_LIMIT, GrowthLimit, Memory, SoakLoop, SoakVerdict, judge, memory, status_bytes, trim_heap,
};
pub use stats::{Stats, StatsBuilder};
pub use synth::{
    CHUNK, DEFAULT_SEED, KOKIRI_BIND, KOKIRI_END, KOKIRI_POOL, LONE_POOL, REGION, REGION_CHUNKS, Synth, SynthConfig,
    default_session,
};
pub use writer::{Recorder, TraceWriter, ZSTD_LEVEL};
