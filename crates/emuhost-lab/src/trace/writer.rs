//! Writing traces: [`TraceWriter`] (one thread, explicit times) and [`Recorder`] (any thread,
//! stamped with the time since it was made).

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::error::TraceError;
use super::event::{Event, Header, Record, Sequence, SleepKind, Thread};
use super::reader::is_zstd;
use emuhost::space::{GuestAddr, Prot};

/// zstd level for traces: fast, and still ~5x smaller than the text.
pub const ZSTD_LEVEL: i32 = 3;

enum Sink<W: Write> {
    Plain(BufWriter<W>),
    Zstd(BufWriter<zstd::Encoder<'static, W>>),
}

impl<W: Write> Sink<W> {
    fn out(&mut self) -> &mut dyn Write {
        match self {
            Sink::Plain(w) => w,
            Sink::Zstd(w) => w,
        }
    }

    fn finish(self) -> io::Result<W> {
        match self {
            Sink::Plain(w) => w.into_inner().map_err(|e| e.into_error()),
            Sink::Zstd(w) => w.into_inner().map_err(|e| e.into_error())?.finish(),
        }
    }
}

/// Writes a trace from one thread: the header first, then each record (checked as a reader would
/// check it, so a trace written here always reads back), then `end N` on [`TraceWriter::finish`].
///
/// ```
/// use emuhost::space::{GuestAddr, Prot};
/// use emuhost_lab::trace::{Event, Header, Record, Thread, TraceWriter, read_str};
///
/// let mut w = TraceWriter::new(Vec::new(), Header::default().option("source", "doc")).unwrap();
/// let commit = Event::Commit { lo: GuestAddr(0x10000), size: 0x4000, prot: Prot::READ_WRITE };
/// w.write(&Record { t_us: 5, thread: Thread::Game(0), event: commit }).unwrap();
/// // A write on the render thread is refused, and not written.
/// let bad = Event::Write { addr: GuestAddr(0x10000), size: 8 };
/// assert!(w.write(&Record { t_us: 6, thread: Thread::Render, event: bad }).is_err());
/// let text = String::from_utf8(w.finish().unwrap()).unwrap();
/// let (header, records) = read_str(&text).unwrap();
/// assert_eq!((header.get("source"), records.len()), (Some("doc"), 1));
/// ```
pub struct TraceWriter<W: Write> {
    sink: Option<Sink<W>>,
    header: Header,
    seq: Sequence,
    line: String,
}

impl TraceWriter<File> {
    /// Creates the file (truncating one that exists); a name ending in `.zst` is written through
    /// zstd.
    ///
    /// # Errors
    /// [`TraceError::Open`] naming the file, else as [`TraceWriter::new`].
    pub fn create(path: impl AsRef<Path>, header: Header) -> Result<Self, TraceError> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|source| TraceError::Open { path: path.to_owned(), source })?;
        if is_zstd(path) { TraceWriter::zstd(file, header) } else { TraceWriter::new(file, header) }
    }
}

impl<W: Write> TraceWriter<W> {
    /// A plain-text trace into `out`, its header line written first.
    ///
    /// # Errors
    /// [`TraceError::HeaderRejected`] for a header no reader would read; [`TraceError::Write`].
    pub fn new(out: W, header: Header) -> Result<Self, TraceError> {
        Self::start(Sink::Plain(BufWriter::with_capacity(1 << 16, out)), header)
    }

    /// A zstd-compressed trace into `out` (level [`ZSTD_LEVEL`]).
    ///
    /// # Errors
    /// As [`TraceWriter::new`].
    pub fn zstd(out: W, header: Header) -> Result<Self, TraceError> {
        let enc = zstd::Encoder::new(out, ZSTD_LEVEL).map_err(|source| TraceError::Write { source })?;
        Self::start(Sink::Zstd(BufWriter::with_capacity(1 << 16, enc)), header)
    }

    fn start(mut sink: Sink<W>, header: Header) -> Result<Self, TraceError> {
        // What is written always reads back: the header too.
        Header::parse(&header.to_string()).map_err(|what| TraceError::HeaderRejected { what })?;
        writeln!(sink.out(), "{header}").map_err(|source| TraceError::Write { source })?;
        Ok(Self { sink: Some(sink), header, seq: Sequence::default(), line: String::with_capacity(128) })
    }

    /// The header written.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Events written so far.
    pub fn events(&self) -> u64 {
        self.seq.events
    }

    /// The index of the last frame written.
    pub fn last_frame(&self) -> Option<u64> {
        self.seq.last_frame()
    }

    /// Checks and writes one record. A record a reader would reject is not written.
    ///
    /// # Errors
    /// [`TraceError::Rejected`] (with the event's number and what is wrong: a time going back, a
    /// range outside the window, an event on the wrong thread, ...); [`TraceError::Write`];
    /// [`TraceError::Finished`] after [`TraceWriter::finish`] failed half-way.
    pub fn write(&mut self, r: &Record) -> Result<(), TraceError> {
        use std::fmt::Write as _;
        let sink = self.sink.as_mut().ok_or(TraceError::Finished)?;
        let number = self.seq.events + 1;
        self.seq.accept(r, &self.header).map_err(|what| TraceError::Rejected { number, what })?;
        self.line.clear();
        let _ = writeln!(self.line, "{r}");
        sink.out().write_all(self.line.as_bytes()).map_err(|source| TraceError::Write { source })
    }

    /// Pushes what is buffered to the output (a zstd stream flushes its current block).
    ///
    /// # Errors
    /// [`TraceError::Write`].
    pub fn flush(&mut self) -> Result<(), TraceError> {
        let sink = self.sink.as_mut().ok_or(TraceError::Finished)?;
        sink.out().flush().map_err(|source| TraceError::Write { source })
    }

    /// Writes the `end N` line, ends the zstd stream if any, and returns the output.
    ///
    /// # Errors
    /// [`TraceError::Write`].
    pub fn finish(mut self) -> Result<W, TraceError> {
        self.finish_mut()
    }

    fn finish_mut(&mut self) -> Result<W, TraceError> {
        let mut sink = self.sink.take().ok_or(TraceError::Finished)?;
        writeln!(sink.out(), "end {}", self.seq.events).map_err(|source| TraceError::Write { source })?;
        sink.finish().map_err(|source| TraceError::Write { source })
    }
}

/// Records a trace while an emulator runs: callable from any thread, each event stamped with the
/// time since the recorder was made, taken under the recorder's lock so that times in the file
/// never go back. Buffered (64 KiB) and written by the thread that records; [`Recorder::flush`]
/// pushes the buffer out, [`Recorder::finish`] (or dropping the recorder) ends the trace.
///
/// ```
/// use emuhost::space::{GuestAddr, Prot};
/// use emuhost_lab::trace::{Header, Recorder, Thread, TraceWriter, read_str};
///
/// let rec = Recorder::new(TraceWriter::new(Vec::new(), Header::default()).unwrap());
/// rec.commit(Thread::Game(0), GuestAddr(0), 0x2000, Prot::READ_WRITE).unwrap();
/// assert_eq!(rec.frame().unwrap(), 0);
/// rec.write(0, GuestAddr(0x1008), 4).unwrap();
/// rec.collect(GuestAddr(0), 0x2000).unwrap();
/// let (_, records) = read_str(std::str::from_utf8(&rec.finish().unwrap()).unwrap()).unwrap();
/// assert_eq!(records.len(), 4);
/// ```
pub struct Recorder<W: Write + Send = File> {
    inner: Mutex<Option<TraceWriter<W>>>,
    start: Instant,
}

impl Recorder<File> {
    /// Records into a file (`.zst`: compressed), with the default header and `source=recorder`.
    ///
    /// # Errors
    /// As [`TraceWriter::create`].
    pub fn create(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        Ok(Recorder::new(TraceWriter::create(path, Header::default().option("source", "recorder"))?))
    }
}

impl<W: Write + Send> Recorder<W> {
    /// Records through `writer`; times count from now.
    pub fn new(writer: TraceWriter<W>) -> Self {
        Self { inner: Mutex::new(Some(writer)), start: Instant::now() }
    }

    fn lock(&self) -> MutexGuard<'_, Option<TraceWriter<W>>> {
        // A thread that panicked while recording left at most a partial line in the buffer:
        // keep recording rather than panic in every other thread.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `event` on `thread`, now.
    ///
    /// # Errors
    /// [`TraceError::Rejected`] for an event no reader would accept (not recorded);
    /// [`TraceError::Write`]; [`TraceError::Finished`] after [`Recorder::finish`].
    pub fn record(&self, thread: Thread, event: Event) -> Result<(), TraceError> {
        let mut guard = self.lock();
        let w = guard.as_mut().ok_or(TraceError::Finished)?;
        let t_us = self.start.elapsed().as_micros() as u64;
        w.write(&Record { t_us, thread, event })
    }

    /// A frame boundary on the render thread; returns the new frame's index (0, 1, 2, ...).
    ///
    /// # Errors
    /// As [`Recorder::record`].
    pub fn frame(&self) -> Result<u64, TraceError> {
        let mut guard = self.lock();
        let w = guard.as_mut().ok_or(TraceError::Finished)?;
        let index = w.last_frame().map_or(0, |f| f + 1);
        let t_us = self.start.elapsed().as_micros() as u64;
        w.write(&Record { t_us, thread: Thread::Render, event: Event::Frame { index } })?;
        Ok(index)
    }

    /// The guest made a pool at `lo` of `size` bytes.
    ///
    /// # Errors
    /// As [`Recorder::record`].
    pub fn pool(&self, thread: Thread, lo: GuestAddr, size: u64) -> Result<(), TraceError> {
        self.record(thread, Event::Pool { lo, size })
    }

    /// The guest released the pool at `lo` of `size` bytes.
    ///
    /// # Errors
    /// As [`Recorder::record`].
    pub fn unpool(&self, thread: Thread, lo: GuestAddr, size: u64) -> Result<(), TraceError> {
        self.record(thread, Event::Unpool { lo, size })
    }

    /// The guest committed `size` bytes at `lo` (whole pages) with `prot`.
    ///
    /// # Errors
    /// As [`Recorder::record`].
    pub fn commit(&self, thread: Thread, lo: GuestAddr, size: u64, prot: Prot) -> Result<(), TraceError> {
        self.record(thread, Event::Commit { lo, size, prot })
    }

    /// The guest decommitted `size` bytes at `lo` (whole pages).
    ///
    /// # Errors
    /// As [`Recorder::record`].
    pub fn decommit(&self, thread: Thread, lo: GuestAddr, size: u64) -> Result<(), TraceError> {
        self.record(thread, Event::Decommit { lo, size })
    }

    /// A GPU binding, on the render thread.
    ///
    /// # Errors
    /// As [`Recorder::record`].
    pub fn bind(&self, addr: GuestAddr, size: u64) -> Result<(), TraceError> {
        self.record(Thread::Render, Event::Bind { addr, size })
    }

    /// A guest write on game thread `game`.
    ///
    /// # Errors
    /// As [`Recorder::record`].
    pub fn write(&self, game: u16, addr: GuestAddr, size: u64) -> Result<(), TraceError> {
        self.record(Thread::Game(game), Event::Write { addr, size })
    }

    /// A collect of written pages, on the render thread.
    ///
    /// # Errors
    /// As [`Recorder::record`].
    pub fn collect(&self, lo: GuestAddr, size: u64) -> Result<(), TraceError> {
        self.record(Thread::Render, Event::Collect { lo, size })
    }

    /// One short sleep of `d` (nanoseconds past `u64::MAX` are clamped).
    ///
    /// # Errors
    /// As [`Recorder::record`].
    pub fn sleep(&self, thread: Thread, kind: SleepKind, d: Duration) -> Result<(), TraceError> {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.record(thread, Event::Sleep { kind, ns, count: 1 })
    }

    /// Events recorded so far.
    pub fn events(&self) -> u64 {
        self.lock().as_ref().map_or(0, |w| w.events())
    }

    /// Pushes the buffered events to the output.
    ///
    /// # Errors
    /// [`TraceError::Write`]; [`TraceError::Finished`] after [`Recorder::finish`].
    pub fn flush(&self) -> Result<(), TraceError> {
        self.lock().as_mut().ok_or(TraceError::Finished)?.flush()
    }

    /// Ends the trace (the `end N` line) and returns the output; later records fail with
    /// [`TraceError::Finished`].
    ///
    /// # Errors
    /// [`TraceError::Write`]; [`TraceError::Finished`] when called twice.
    pub fn finish(&self) -> Result<W, TraceError> {
        self.lock().take().ok_or(TraceError::Finished)?.finish()
    }
}

impl<W: Write + Send> Drop for Recorder<W> {
    fn drop(&mut self) {
        if let Some(mut w) = self.lock().take()
            && let Err(e) = w.finish_mut()
        {
            tracing::warn!("finishing the trace when its recorder was dropped failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Malformed, read_str};

    #[test]
    fn a_rejected_event_is_not_written() {
        let mut w = TraceWriter::new(Vec::new(), Header::default()).unwrap();
        w.write(&Record { t_us: 5, thread: Thread::Render, event: Event::Frame { index: 0 } }).unwrap();
        let bad = Record { t_us: 4, thread: Thread::Game(0), event: Event::Write { addr: GuestAddr(0), size: 1 } };
        let e = w.write(&bad).unwrap_err();
        assert!(matches!(e, TraceError::Rejected { number: 2, what: Malformed::TimeBackwards { .. } }), "{e}");
        let bind = Record { t_us: 6, thread: Thread::Game(0), event: Event::Bind { addr: GuestAddr(0), size: 1 } };
        assert!(matches!(w.write(&bind), Err(TraceError::Rejected { what: Malformed::WrongThread { .. }, .. })));
        let out = String::from_utf8(w.finish().unwrap()).unwrap();
        assert_eq!(out, "emuhost-trace 1 window=0x8000000000\n5 r frame 0\nend 1\n");
        assert_eq!(read_str(&out).unwrap().1.len(), 1);
    }

    #[test]
    fn a_header_option_is_written_once_and_a_header_no_reader_reads_is_refused() {
        // Set twice: the later value, written once.
        let h = Header::default().option("seed", 1).option("source", "synth").option("seed", 2);
        let out = String::from_utf8(TraceWriter::new(Vec::new(), h).unwrap().finish().unwrap()).unwrap();
        assert_eq!(out, "emuhost-trace 1 window=0x8000000000 seed=2 source=synth\nend 0\n");
        assert_eq!(read_str(&out).unwrap().0.get("seed"), Some("2"));
        // `window` is the header's field: as an option it would be given twice.
        let e = TraceWriter::new(Vec::new(), Header::default().option("window", "0x1000")).err().unwrap();
        assert!(e.to_string().contains("header option \"window\" is given twice"), "{e}");
        assert!(matches!(e.malformed(), Some(Malformed::HeaderOptionTwice(k)) if k == "window"), "{e}");
        let e = TraceWriter::new(Vec::new(), Header::default().option("a b", 1)).err().unwrap();
        assert!(e.malformed().is_some(), "{e}");
    }

    #[test]
    fn a_dropped_recorder_ends_its_trace() {
        let path = std::env::temp_dir().join(format!("emuhost-trace-drop-{}.trace", std::process::id()));
        {
            let r = Recorder::create(&path).unwrap();
            r.frame().unwrap();
            r.bind(GuestAddr(0x1000), 0x10).unwrap();
        }
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(text.ends_with("end 2\n"), "{text}");
        let (h, records) = read_str(&text).unwrap();
        assert_eq!(h.get("source"), Some("recorder"));
        assert_eq!(records.len(), 2);
    }
}
