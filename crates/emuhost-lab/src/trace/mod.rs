//! Traces of game sessions: what the guest and the renderer did to memory, frame by frame, to
//! replay through the runtime. The format is line-oriented text (`docs/trace-format.md`),
//! versioned, zstd-compressed where the file name ends in `.zst`.
//!
//! - [`Recorder`]: what an emulator calls while it runs (any thread; buffered).
//! - [`TraceWriter`]: writes records with their own times (one thread).
//! - [`Reader`]: streams a trace back, one line in memory at a time; a malformed line is an error
//!   naming the line and what was wrong.
//! - [`Stats`]: the figures of a trace (pools, pools across a chunk's end, chunks touched, ...).
//!
//! A synthetic session is [`crate::synth`]; replaying a trace through the runtime is
//! [`crate::replay`].

mod error;
mod event;
mod reader;
mod stats;
mod writer;

pub use error::{Malformed, TraceError};
pub use event::{DEFAULT_WINDOW, Event, GUEST_PAGE, Header, MAGIC, Record, SleepKind, Thread, VERSION};
pub use reader::{FileReader, MAX_LINE, Reader, is_zstd, read_str};
pub use stats::{Stats, StatsBuilder};
pub use writer::{Recorder, TraceWriter, ZSTD_LEVEL};
