//! Streaming reader: one line in memory at a time, every line checked.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

use super::error::{Malformed, TraceError};
use super::event::{Header, Record, Sequence, parse_dec, parse_record};

/// The longest line accepted (a valid event line is under 100 bytes).
pub const MAX_LINE: usize = 4096;

/// Reads a trace one event at a time: an iterator of records that stops at the first error (the
/// error names the line). It checks each line as it comes (see `docs/trace-format.md`), and at the
/// end that the `end N` line is there and counts the events.
///
/// ```
/// use emuhost_lab::trace::{Event, Reader};
///
/// let text = "emuhost-trace 1\n0 r frame 0\n3 g0 sleep guest 500 x2\nend 2\n";
/// let mut r = Reader::new(text.as_bytes()).unwrap();
/// let frame = r.next().unwrap().unwrap();
/// assert_eq!(frame.event, Event::Frame { index: 0 });
/// assert_eq!(r.by_ref().count(), 1);
/// // A bad line is an error naming it.
/// let e = Reader::new("emuhost-trace 1\n0 r fly 0\nend 1\n".as_bytes()).unwrap().next().unwrap().unwrap_err();
/// assert_eq!(e.line(), Some(2));
/// ```
pub struct Reader<R> {
    input: R,
    header: Header,
    line: u64,
    text: String,
    seq: Sequence,
    done: bool,
    /// Read through zstd: an input that ends early is a cut stream, not a bad line.
    compressed: bool,
}

/// A reader of a file, plain or zstd.
pub type FileReader = Reader<Box<dyn BufRead + Send>>;

impl FileReader {
    /// Opens a trace file and reads its header; a name ending in `.zst` is read through zstd.
    ///
    /// # Errors
    /// [`TraceError::Open`] naming the file, else as [`Reader::new`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        let path = path.as_ref();
        let open_err = |source| TraceError::Open { path: path.to_owned(), source };
        let file = File::open(path).map_err(open_err)?;
        let input: Box<dyn BufRead + Send> = if is_zstd(path) {
            Box::new(BufReader::with_capacity(1 << 16, zstd::Decoder::new(file).map_err(open_err)?))
        } else {
            Box::new(BufReader::with_capacity(1 << 16, file))
        };
        Reader::start(input, is_zstd(path))
    }
}

/// Whether a path names a zstd-compressed trace (by its extension, `.zst`).
pub fn is_zstd(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "zst")
}

impl<R: Read> Reader<BufReader<zstd::Decoder<'static, BufReader<R>>>> {
    /// Reads a zstd-compressed trace from `input`.
    ///
    /// # Errors
    /// As [`Reader::new`]; [`TraceError::Read`] where the zstd stream cannot start.
    pub fn zstd(input: R) -> Result<Self, TraceError> {
        let d = zstd::Decoder::new(input).map_err(|source| TraceError::Read { line: 1, source })?;
        Reader::start(BufReader::new(d), true)
    }
}

impl<R: BufRead> Reader<R> {
    /// Reads the header line.
    ///
    /// # Errors
    /// [`TraceError::Malformed`] (line 1) where it is not a trace of a version this code reads;
    /// [`TraceError::Read`].
    pub fn new(input: R) -> Result<Self, TraceError> {
        Self::start(input, false)
    }

    fn start(input: R, compressed: bool) -> Result<Self, TraceError> {
        let mut r = Reader {
            input,
            header: Header::default(),
            line: 0,
            text: String::new(),
            seq: Sequence::default(),
            done: false,
            compressed,
        };
        if !r.next_line()? {
            return Err(r.malformed(Malformed::NotATrace(String::new())));
        }
        r.header = Header::parse(&r.text).map_err(|what| r.malformed(what))?;
        Ok(r)
    }

    /// The trace's header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The number of the last line read.
    pub fn line(&self) -> u64 {
        self.line
    }

    fn malformed(&self, what: Malformed) -> TraceError {
        TraceError::Malformed { line: self.line, what }
    }

    /// Reads the next line into `self.text` without its newline; `false` at the end of the input.
    fn next_line(&mut self) -> Result<bool, TraceError> {
        let mut buf = std::mem::take(&mut self.text).into_bytes();
        buf.clear();
        self.line += 1;
        let n =
            (&mut self.input).take(MAX_LINE as u64 + 1).read_until(b'\n', &mut buf).map_err(|source| {
                match source.kind() {
                    io::ErrorKind::UnexpectedEof if self.compressed => {
                        TraceError::Truncated { lines: self.line - 1, source }
                    }
                    _ => TraceError::Read { line: self.line, source },
                }
            })?;
        if n == 0 {
            return Ok(false);
        }
        if buf.last() != Some(&b'\n') {
            return Err(self.malformed(if n > MAX_LINE {
                Malformed::LineTooLong(MAX_LINE)
            } else {
                Malformed::NoNewline
            }));
        }
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        self.text = String::from_utf8(buf).map_err(|_| self.malformed(Malformed::NotUtf8))?;
        Ok(true)
    }

    fn next_record(&mut self) -> Result<Option<Record>, TraceError> {
        loop {
            if !self.next_line()? {
                return Err(self.malformed(Malformed::MissingEnd));
            }
            let line = self.line;
            let bad = |what| TraceError::Malformed { line, what };
            let text = self.text.trim();
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            if let Some(rest) = text.strip_prefix("end") {
                if let Some(count) = rest.strip_prefix([' ', '\t']) {
                    let said = parse_dec(count.trim(), "end count").map_err(bad)?;
                    if said != self.seq.events {
                        return Err(bad(Malformed::EndCount { said, counted: self.seq.events }));
                    }
                    self.finish_after_end()?;
                    return Ok(None);
                } else if rest.is_empty() {
                    return Err(bad(Malformed::MissingField("end count")));
                }
            }
            let record = parse_record(text).map_err(bad)?;
            self.seq.accept(&record, &self.header).map_err(bad)?;
            return Ok(Some(record));
        }
    }

    /// After the end line only blank lines and comments may follow.
    fn finish_after_end(&mut self) -> Result<(), TraceError> {
        while self.next_line()? {
            let text = self.text.trim();
            if !(text.is_empty() || text.starts_with('#')) {
                return Err(self.malformed(Malformed::AfterEnd));
            }
        }
        Ok(())
    }
}

impl<R: BufRead> Iterator for Reader<R> {
    type Item = Result<Record, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.next_record() {
            Ok(Some(r)) => Some(Ok(r)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

/// Reads a whole trace from text (for tests and small traces).
///
/// # Errors
/// The first bad line's, as [`Reader`] gives it.
pub fn read_str(text: &str) -> Result<(Header, Vec<Record>), TraceError> {
    let mut r = Reader::new(io::Cursor::new(text.as_bytes()))?;
    let records = r.by_ref().collect::<Result<Vec<_>, _>>()?;
    Ok((r.header, records))
}
