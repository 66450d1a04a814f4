use std::io;
use std::path::PathBuf;

/// What was wrong with a line of a trace (or with an event handed to a writer). Addresses and
/// sizes are in hex.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// The first line is not `emuhost-trace VERSION ...` (the line, clipped).
    #[error("not an emuhost trace: the first line must be `emuhost-trace VERSION`, found {0:?}")]
    NotATrace(String),
    /// A version this reader does not read.
    #[error("unsupported trace version {found:?} (this reader reads version {supported})")]
    Version {
        /// The version the header names.
        found: String,
        /// The one this reader reads ([`VERSION`](super::VERSION)).
        supported: u32,
    },
    /// A header option that is not `KEY=VALUE` with a non-empty key (or, handed to a writer,
    /// one that holds whitespace).
    #[error("header option {0:?} is not KEY=VALUE")]
    HeaderOption(String),
    /// The header's `window=` value is not a non-zero multiple of the guest page, in hex.
    #[error("header option window={0:?}: not a non-zero hex size (0x...) that is a multiple of 0x1000")]
    HeaderWindow(String),
    /// Which of two values would count is left to the reader's order: refused.
    #[error("header option {0:?} is given twice")]
    HeaderOptionTwice(String),
    /// An event word that is none of [`Event`](super::Event)'s.
    #[error("unknown event {0:?}")]
    UnknownEvent(String),
    /// The line ends before the named field.
    #[error("missing field {0}")]
    MissingField(&'static str),
    /// Words after the event's last field.
    #[error("unexpected text after the last field: {0:?}")]
    TrailingText(String),
    /// A field that must be `0x`-prefixed hex.
    #[error("{field} {text:?} is not a hex number (0x...)")]
    BadHex {
        /// The field's name (`addr`, `size`, ...).
        field: &'static str,
        /// Its text (clipped).
        text: String,
    },
    /// A field that must be a decimal number.
    #[error("{field} {text:?} is not a decimal number")]
    BadNumber {
        /// The field's name (`time`, `frame`, `ns`, ...).
        field: &'static str,
        /// Its text (clipped).
        text: String,
    },
    /// A thread that is not `r`, `gN` or `hN`.
    #[error("thread {0:?} is not `r`, `gN` or `hN`")]
    BadThread(String),
    /// A protection that is not `rwx` with `-` for each right not given.
    #[error("protection {0:?} is not three of `r`/`-`, `w`/`-`, `x`/`-`")]
    BadProt(String),
    /// A sleep kind that is not `guest` or `host`.
    #[error("sleep kind {0:?} is not `guest` or `host`")]
    BadSleepKind(String),
    /// A sleep's repeat count that is not `xN` with N > 0.
    #[error("sleep count {0:?} is not `xN` with N > 0")]
    BadCount(String),
    /// An event with a range of zero bytes.
    #[error("{event} at {addr:#x} has zero size")]
    ZeroSize {
        /// The event's word.
        event: &'static str,
        /// The range's start (guest address).
        addr: u64,
    },
    /// A pool, commit, decommit or collect not aligned to [`GUEST_PAGE`](super::GUEST_PAGE).
    #[error("{event} {addr:#x}+{size:#x} is not aligned to the 0x1000-byte guest page")]
    Unaligned {
        /// The event's word.
        event: &'static str,
        /// The range's start (guest address).
        addr: u64,
        /// The range's size in bytes.
        size: u64,
    },
    /// A range that does not lie inside the header's guest window.
    #[error("{event} {addr:#x}+{size:#x} is outside the guest window 0x0..{window:#x}")]
    OutOfWindow {
        /// The event's word.
        event: &'static str,
        /// The range's start (guest address).
        addr: u64,
        /// The range's size in bytes.
        size: u64,
        /// The window's size in bytes.
        window: u64,
    },
    /// An event on a thread that does not make it (a bind on a game thread, say).
    #[error("`{event}` happens on {allowed}, not on thread {thread}")]
    WrongThread {
        /// The event's word.
        event: &'static str,
        /// The thread named, as written.
        thread: String,
        /// The threads that make it, in words.
        allowed: &'static str,
    },
    /// A time before the previous event's.
    #[error("time {t} us is before the previous event's {previous} us")]
    TimeBackwards {
        /// This event's time, in µs from the session's start.
        t: u64,
        /// The previous event's.
        previous: u64,
    },
    /// A frame number that is not the previous one plus one.
    #[error("frame {found} follows frame {previous} (frames count up by one)")]
    FrameOrder {
        /// This frame's number.
        found: u64,
        /// The previous frame's.
        previous: u64,
    },
    /// A line longer than the reader reads ([`MAX_LINE`](super::MAX_LINE) bytes).
    #[error("line is longer than {0} bytes")]
    LineTooLong(usize),
    /// A line that is not UTF-8.
    #[error("line is not UTF-8")]
    NotUtf8,
    /// The last line has no newline (a trace cut short).
    #[error("the last line has no newline (truncated trace?)")]
    NoNewline,
    /// The trace ends without its `end N` line (a trace cut short).
    #[error("the trace ends without its `end N` line (truncated trace?)")]
    MissingEnd,
    /// The `end N` line's count is not the events'.
    #[error("the end line says {said} events, the trace has {counted}")]
    EndCount {
        /// The count the end line gives.
        said: u64,
        /// The events read.
        counted: u64,
    },
    /// Text after the `end N` line.
    #[error("text after the end line")]
    AfterEnd,
}

/// What went wrong reading or writing a trace.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// A line of the input is malformed. `line` counts from 1.
    #[error("line {line}: {what}")]
    Malformed {
        /// The line, from 1.
        line: u64,
        /// What was wrong.
        what: Malformed,
    },
    /// Reading failed at `line` (an I/O error, or a truncated or corrupt zstd stream).
    #[error("line {line}: reading the trace failed")]
    Read {
        /// The line being read, from 1.
        line: u64,
        /// The I/O or zstd error.
        #[source]
        source: io::Error,
    },
    /// A compressed trace's stream ends inside a zstd frame: the file was cut short. `lines`
    /// whole lines came out of it before the cut (no line is to blame).
    #[error("the compressed stream is truncated: it ends inside a zstd frame, after {lines} whole lines")]
    Truncated {
        /// Whole lines read before the cut.
        lines: u64,
        /// The decoder's error.
        #[source]
        source: io::Error,
    },
    /// The trace file could not be opened (or created).
    #[error("opening {} failed", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Writing (or compressing, or flushing) the trace failed.
    #[error("writing the trace failed")]
    Write {
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// An event handed to a writer or recorder that no reader would accept.
    #[error("event {number} rejected: {what}")]
    Rejected {
        /// The event's number, from 1, as handed to the writer.
        number: u64,
        /// What is wrong with it.
        what: Malformed,
    },
    /// A header handed to a writer that no reader would accept.
    #[error("header rejected: {what}")]
    HeaderRejected {
        /// What is wrong with it.
        what: Malformed,
    },
    /// A synthetic session's configuration that cannot make a session ([`crate::synth`]).
    #[error("synthetic session: {what}")]
    BadConfig {
        /// What is wrong, naming the setting.
        what: String,
    },
    /// An event or a finish after the trace was finished.
    #[error("the trace was already finished")]
    Finished,
}

impl TraceError {
    /// The line of the input the error is about, where it is about one.
    pub fn line(&self) -> Option<u64> {
        match self {
            TraceError::Malformed { line, .. } | TraceError::Read { line, .. } => Some(*line),
            _ => None,
        }
    }

    /// What was wrong, for a malformed line or a rejected event or header.
    pub fn malformed(&self) -> Option<&Malformed> {
        match self {
            TraceError::Malformed { what, .. }
            | TraceError::Rejected { what, .. }
            | TraceError::HeaderRejected { what } => Some(what),
            _ => None,
        }
    }
}
