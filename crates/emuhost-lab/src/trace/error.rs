use std::io;
use std::path::PathBuf;

/// What was wrong with a line of a trace (or with an event handed to a writer). Addresses and
/// sizes are in hex.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("not an emuhost trace: the first line must be `emuhost-trace VERSION`, found {0:?}")]
    NotATrace(String),
    #[error("unsupported trace version {found:?} (this reader reads version {supported})")]
    Version { found: String, supported: u32 },
    #[error("header option {0:?} is not KEY=VALUE")]
    HeaderOption(String),
    #[error("header option window={0:?}: not a non-zero hex size (0x...) that is a multiple of 0x1000")]
    HeaderWindow(String),
    /// Which of two values would count is left to the reader's order: refused.
    #[error("header option {0:?} is given twice")]
    HeaderOptionTwice(String),
    #[error("unknown event {0:?}")]
    UnknownEvent(String),
    #[error("missing field {0}")]
    MissingField(&'static str),
    #[error("unexpected text after the last field: {0:?}")]
    TrailingText(String),
    #[error("{field} {text:?} is not a hex number (0x...)")]
    BadHex { field: &'static str, text: String },
    #[error("{field} {text:?} is not a decimal number")]
    BadNumber { field: &'static str, text: String },
    #[error("thread {0:?} is not `r`, `gN` or `hN`")]
    BadThread(String),
    #[error("protection {0:?} is not three of `r`/`-`, `w`/`-`, `x`/`-`")]
    BadProt(String),
    #[error("sleep kind {0:?} is not `guest` or `host`")]
    BadSleepKind(String),
    #[error("sleep count {0:?} is not `xN` with N > 0")]
    BadCount(String),
    #[error("{event} at {addr:#x} has zero size")]
    ZeroSize { event: &'static str, addr: u64 },
    #[error("{event} {addr:#x}+{size:#x} is not aligned to the 0x1000-byte guest page")]
    Unaligned { event: &'static str, addr: u64, size: u64 },
    #[error("{event} {addr:#x}+{size:#x} is outside the guest window 0x0..{window:#x}")]
    OutOfWindow { event: &'static str, addr: u64, size: u64, window: u64 },
    #[error("`{event}` happens on {allowed}, not on thread {thread}")]
    WrongThread { event: &'static str, thread: String, allowed: &'static str },
    #[error("time {t} us is before the previous event's {previous} us")]
    TimeBackwards { t: u64, previous: u64 },
    #[error("frame {found} follows frame {previous} (frames count up by one)")]
    FrameOrder { found: u64, previous: u64 },
    #[error("line is longer than {0} bytes")]
    LineTooLong(usize),
    #[error("line is not UTF-8")]
    NotUtf8,
    #[error("the last line has no newline (truncated trace?)")]
    NoNewline,
    #[error("the trace ends without its `end N` line (truncated trace?)")]
    MissingEnd,
    #[error("the end line says {said} events, the trace has {counted}")]
    EndCount { said: u64, counted: u64 },
    #[error("text after the end line")]
    AfterEnd,
}

/// What went wrong reading or writing a trace.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// A line of the input is malformed. `line` counts from 1.
    #[error("line {line}: {what}")]
    Malformed { line: u64, what: Malformed },
    /// Reading failed at `line` (an I/O error, or a truncated or corrupt zstd stream).
    #[error("line {line}: reading the trace failed")]
    Read {
        line: u64,
        #[source]
        source: io::Error,
    },
    /// A compressed trace's stream ends inside a zstd frame: the file was cut short. `lines`
    /// whole lines came out of it before the cut (no line is to blame).
    #[error("the compressed stream is truncated: it ends inside a zstd frame, after {lines} whole lines")]
    Truncated {
        lines: u64,
        #[source]
        source: io::Error,
    },
    #[error("opening {} failed", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("writing the trace failed")]
    Write {
        #[source]
        source: io::Error,
    },
    /// An event handed to a writer or recorder that no reader would accept.
    #[error("event {number} rejected: {what}")]
    Rejected { number: u64, what: Malformed },
    /// A header handed to a writer that no reader would accept.
    #[error("header rejected: {what}")]
    HeaderRejected { what: Malformed },
    #[error("synthetic session: {what}")]
    BadConfig { what: String },
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
