//! The events of a trace, their text form (one line each) and the checks every line must pass.

use std::fmt;

use super::error::Malformed;
use emuhost::space::{GuestAddr, Prot};

/// The version this code writes and reads.
pub const VERSION: u32 = 1;
/// The first word of a trace's first line.
pub const MAGIC: &str = "emuhost-trace";
/// The guest page: pools, commits, decommits and collects are aligned to it.
pub const GUEST_PAGE: u64 = 0x1000;
/// The guest window a trace assumes when its header does not say: 512 GiB.
pub const DEFAULT_WINDOW: u64 = emuhost::space::DEFAULT_WINDOW;

/// Which thread an event happened on. The render thread makes GPU bindings and collects; game
/// threads run guest code (they write guest memory and make the guest's sleeps); host threads are
/// the emulator's own (audio, timers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Thread {
    /// The render thread, `r`.
    Render,
    /// Game thread N, `gN`.
    Game(u16),
    /// Host thread N, `hN`.
    Host(u16),
}

impl fmt::Display for Thread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Thread::Render => f.write_str("r"),
            Thread::Game(n) => write!(f, "g{n}"),
            Thread::Host(n) => write!(f, "h{n}"),
        }
    }
}

/// Whose short sleep: the guest's own (`SleepThread` from a game thread) or the host's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SleepKind {
    /// `guest`: on a game thread.
    Guest,
    /// `host`: on any thread.
    Host,
}

impl fmt::Display for SleepKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SleepKind::Guest => "guest",
            SleepKind::Host => "host",
        })
    }
}

/// One event. Ranges are guest addresses (offsets into the guest window) and byte sizes; the
/// text form writes them in hex (`commit 0x10000 0x4000 rw-`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The start of frame `index` (a present). Frames count up by one.
    Frame {
        /// The frame's number.
        index: u64,
    },
    /// The guest made a memory pool (pools may overlap).
    Pool {
        /// The pool's start.
        lo: GuestAddr,
        /// Its size in bytes.
        size: u64,
    },
    /// The guest released the pool made at `lo` with `size`.
    Unpool {
        /// The pool's start.
        lo: GuestAddr,
        /// Its size in bytes.
        size: u64,
    },
    /// The guest committed pages.
    Commit {
        /// The first page.
        lo: GuestAddr,
        /// The bytes committed (whole pages).
        size: u64,
        /// Their protection.
        prot: Prot,
    },
    /// The guest decommitted pages.
    Decommit {
        /// The first page.
        lo: GuestAddr,
        /// The bytes decommitted (whole pages).
        size: u64,
    },
    /// The renderer bound guest memory to the GPU (any alignment).
    Bind {
        /// The first byte bound.
        addr: GuestAddr,
        /// The bytes bound.
        size: u64,
    },
    /// The guest wrote guest memory (any alignment).
    Write {
        /// The first byte written.
        addr: GuestAddr,
        /// The bytes written.
        size: u64,
    },
    /// The renderer asked which pages of the range were written since the last collect.
    Collect {
        /// The first page.
        lo: GuestAddr,
        /// The bytes asked about (whole pages).
        size: u64,
    },
    /// `count` short sleeps of `ns` each, one after another (an idle loop).
    Sleep {
        /// Whose sleep.
        kind: SleepKind,
        /// Each sleep's length in nanoseconds.
        ns: u64,
        /// How many (at least 1; the text form writes `xN` where N > 1).
        count: u32,
    },
}

impl Event {
    /// The event's word in the text form.
    pub fn name(&self) -> &'static str {
        match self {
            Event::Frame { .. } => "frame",
            Event::Pool { .. } => "pool",
            Event::Unpool { .. } => "unpool",
            Event::Commit { .. } => "commit",
            Event::Decommit { .. } => "decommit",
            Event::Bind { .. } => "bind",
            Event::Write { .. } => "write",
            Event::Collect { .. } => "collect",
            Event::Sleep { .. } => "sleep",
        }
    }

    /// The guest range the event is about, if any: (start, size, must be page-aligned).
    pub fn range(&self) -> Option<(u64, u64, bool)> {
        match *self {
            Event::Pool { lo, size }
            | Event::Unpool { lo, size }
            | Event::Commit { lo, size, .. }
            | Event::Decommit { lo, size }
            | Event::Collect { lo, size } => Some((lo.0, size, true)),
            Event::Bind { addr, size } | Event::Write { addr, size } => Some((addr.0, size, false)),
            Event::Frame { .. } | Event::Sleep { .. } => None,
        }
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name();
        match *self {
            Event::Frame { index } => write!(f, "{name} {index}"),
            Event::Commit { lo, size, prot } => write!(f, "{name} {:#x} {size:#x} {prot:?}", lo.0),
            Event::Sleep { kind, ns, count: 1 } => write!(f, "{name} {kind} {ns}"),
            Event::Sleep { kind, ns, count } => write!(f, "{name} {kind} {ns} x{count}"),
            _ => {
                let (lo, size, _) = self.range().expect("every other event has a range");
                write!(f, "{name} {lo:#x} {size:#x}")
            }
        }
    }
}

/// An event with its time (microseconds from the start of the session) and its thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// Microseconds from the start of the session (never less than the previous record's).
    pub t_us: u64,
    /// The thread it happened on.
    pub thread: Thread,
    /// What happened.
    pub event: Event,
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}", self.t_us, self.thread, self.event)
    }
}

/// A trace's first line: `emuhost-trace 1` and `KEY=VALUE` options. `window` is the guest window's
/// size (hex); other options (`source=...`, `seed=...`) are kept as they are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The guest window's size in bytes (a non-zero multiple of [`GUEST_PAGE`]; by default
    /// [`DEFAULT_WINDOW`]).
    pub window: u64,
    /// The other options, `(KEY, VALUE)` in the order written.
    pub options: Vec<(String, String)>,
}

impl Default for Header {
    fn default() -> Self {
        Self { window: DEFAULT_WINDOW, options: Vec::new() }
    }
}

impl Header {
    /// Adds a `KEY=VALUE` option, or sets its value where the header has it already (an option
    /// is written once). Neither may hold whitespace, nor the key `=`; the key is not `window`
    /// (the field): a writer refuses a header a reader would not read.
    pub fn option(mut self, key: &str, value: impl fmt::Display) -> Self {
        match self.options.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value.to_string(),
            None => self.options.push((key.to_owned(), value.to_string())),
        }
        self
    }

    /// The value of option `key`, if the header has it.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.options.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// Reads a trace's first line (without its newline).
    ///
    /// # Errors
    /// [`Malformed::NotATrace`], [`Malformed::Version`], or the option that is bad
    /// ([`Malformed::HeaderOption`], [`Malformed::HeaderWindow`], [`Malformed::HeaderOptionTwice`]).
    ///
    /// ```
    /// use emuhost_lab::trace::Header;
    ///
    /// let h = Header::parse("emuhost-trace 1 window=0x40000000 seed=7").unwrap();
    /// assert_eq!((h.window, h.get("seed")), (1 << 30, Some("7")));
    /// assert_eq!(h.to_string(), "emuhost-trace 1 window=0x40000000 seed=7");
    /// assert!(Header::parse("emuhost-trace 2").is_err());
    /// ```
    pub fn parse(line: &str) -> Result<Self, Malformed> {
        let mut words = line.split_ascii_whitespace();
        if words.next() != Some(MAGIC) {
            return Err(Malformed::NotATrace(clip(line)));
        }
        let version = words.next().ok_or_else(|| Malformed::NotATrace(clip(line)))?;
        if version != VERSION.to_string() {
            return Err(Malformed::Version { found: clip(version), supported: VERSION });
        }
        let mut header = Header::default();
        let mut window_seen = false;
        for word in words {
            let (key, value) = word.split_once('=').ok_or_else(|| Malformed::HeaderOption(clip(word)))?;
            if key.is_empty() {
                return Err(Malformed::HeaderOption(clip(word)));
            }
            let seen = if key == "window" { window_seen } else { header.get(key).is_some() };
            if seen {
                return Err(Malformed::HeaderOptionTwice(clip(key)));
            }
            if key == "window" {
                window_seen = true;
                header.window = match parse_hex(value, "window") {
                    Ok(w) if w != 0 && w % GUEST_PAGE == 0 => w,
                    _ => return Err(Malformed::HeaderWindow(clip(value))),
                };
            } else {
                header.options.push((key.to_owned(), value.to_owned()));
            }
        }
        Ok(header)
    }
}

impl fmt::Display for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{MAGIC} {VERSION} window={:#x}", self.window)?;
        for (k, v) in &self.options {
            write!(f, " {k}={v}")?;
        }
        Ok(())
    }
}

/// Checks one record on its own, against the header: the thread may make this event, ranges are
/// non-empty, aligned where they must be and inside the guest window.
pub fn check_record(r: &Record, header: &Header) -> Result<(), Malformed> {
    let e = &r.event;
    let wrong = |allowed| Malformed::WrongThread { event: e.name(), thread: r.thread.to_string(), allowed };
    match (e, r.thread) {
        (Event::Frame { .. } | Event::Bind { .. } | Event::Collect { .. }, t) if t != Thread::Render => {
            return Err(wrong("the render thread (r)"));
        }
        (Event::Write { .. }, t) if !matches!(t, Thread::Game(_)) => return Err(wrong("a game thread (gN)")),
        (Event::Sleep { kind: SleepKind::Guest, .. }, t) if !matches!(t, Thread::Game(_)) => {
            return Err(wrong("a game thread (gN) for a guest sleep"));
        }
        (Event::Sleep { count: 0, .. }, _) => return Err(Malformed::BadCount("x0".into())),
        _ => {}
    }
    if let Some((addr, size, aligned)) = e.range() {
        let event = e.name();
        if size == 0 {
            return Err(Malformed::ZeroSize { event, addr });
        }
        if aligned && (addr % GUEST_PAGE != 0 || size % GUEST_PAGE != 0) {
            return Err(Malformed::Unaligned { event, addr, size });
        }
        if addr.checked_add(size).is_none_or(|end| end > header.window) {
            return Err(Malformed::OutOfWindow { event, addr, size, window: header.window });
        }
    }
    Ok(())
}

/// The checks that span records: time never goes back, frames count up by one.
#[derive(Clone, Debug, Default)]
pub struct Sequence {
    last_t: Option<u64>,
    last_frame: Option<u64>,
    /// Events accepted so far.
    pub events: u64,
}

impl Sequence {
    pub fn accept(&mut self, r: &Record, header: &Header) -> Result<(), Malformed> {
        check_record(r, header)?;
        if let Some(previous) = self.last_t.filter(|&p| r.t_us < p) {
            return Err(Malformed::TimeBackwards { t: r.t_us, previous });
        }
        if let Event::Frame { index } = r.event {
            if let Some(previous) = self.last_frame.filter(|&p| p.checked_add(1) != Some(index)) {
                return Err(Malformed::FrameOrder { found: index, previous });
            }
            self.last_frame = Some(index);
        }
        self.last_t = Some(r.t_us);
        self.events += 1;
        Ok(())
    }

    /// The index of the last frame accepted.
    pub fn last_frame(&self) -> Option<u64> {
        self.last_frame
    }
}

/// Parses one event line (`T THREAD EVENT FIELDS...`); the checks against the header come after.
pub fn parse_record(line: &str) -> Result<Record, Malformed> {
    let mut w = line.split_ascii_whitespace();
    let t_us = parse_dec(field(&mut w, "time")?, "time")?;
    let thread = parse_thread(field(&mut w, "thread")?)?;
    let name = field(&mut w, "event")?;
    let range = |w: &mut std::str::SplitAsciiWhitespace<'_>, a: &'static str| -> Result<(GuestAddr, u64), Malformed> {
        let addr = parse_hex(field(w, a)?, a)?;
        let size = parse_hex(field(w, "size")?, "size")?;
        Ok((GuestAddr(addr), size))
    };
    let event = match name {
        "frame" => Event::Frame { index: parse_dec(field(&mut w, "frame index")?, "frame index")? },
        "pool" => range(&mut w, "lo").map(|(lo, size)| Event::Pool { lo, size })?,
        "unpool" => range(&mut w, "lo").map(|(lo, size)| Event::Unpool { lo, size })?,
        "commit" => {
            let (lo, size) = range(&mut w, "lo")?;
            Event::Commit { lo, size, prot: parse_prot(field(&mut w, "protection")?)? }
        }
        "decommit" => range(&mut w, "lo").map(|(lo, size)| Event::Decommit { lo, size })?,
        "bind" => range(&mut w, "address").map(|(addr, size)| Event::Bind { addr, size })?,
        "write" => range(&mut w, "address").map(|(addr, size)| Event::Write { addr, size })?,
        "collect" => range(&mut w, "lo").map(|(lo, size)| Event::Collect { lo, size })?,
        "sleep" => {
            let kind = match field(&mut w, "sleep kind")? {
                "guest" => SleepKind::Guest,
                "host" => SleepKind::Host,
                other => return Err(Malformed::BadSleepKind(clip(other))),
            };
            let ns = parse_dec(field(&mut w, "duration")?, "duration")?;
            let count = match w.next() {
                None => 1,
                Some(c) => match c.strip_prefix('x').map(|n| (n, n.parse::<u32>())) {
                    Some((n, Ok(v))) if v > 0 && n.bytes().all(|b| b.is_ascii_digit()) => v,
                    _ => return Err(Malformed::BadCount(clip(c))),
                },
            };
            Event::Sleep { kind, ns, count }
        }
        other => return Err(Malformed::UnknownEvent(clip(other))),
    };
    if let Some(extra) = w.next() {
        return Err(Malformed::TrailingText(clip(extra)));
    }
    Ok(Record { t_us, thread, event })
}

fn field<'a>(w: &mut impl Iterator<Item = &'a str>, name: &'static str) -> Result<&'a str, Malformed> {
    w.next().ok_or(Malformed::MissingField(name))
}

/// At most 40 characters of some bad text, for an error message.
fn clip(s: &str) -> String {
    s.chars().take(40).collect()
}

pub(crate) fn parse_hex(s: &str, field: &'static str) -> Result<u64, Malformed> {
    let bad = || Malformed::BadHex { field, text: clip(s) };
    let digits = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")).ok_or_else(bad)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    u64::from_str_radix(digits, 16).map_err(|_| bad())
}

pub(crate) fn parse_dec(s: &str, field: &'static str) -> Result<u64, Malformed> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Malformed::BadNumber { field, text: clip(s) });
    }
    s.parse().map_err(|_| Malformed::BadNumber { field, text: clip(s) })
}

fn parse_thread(s: &str) -> Result<Thread, Malformed> {
    let bad = || Malformed::BadThread(clip(s));
    let index = |n: &str| -> Result<u16, Malformed> {
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        n.parse().map_err(|_| bad())
    };
    match s.as_bytes().first() {
        Some(b'r') if s.len() == 1 => Ok(Thread::Render),
        Some(b'g') => index(&s[1..]).map(Thread::Game),
        Some(b'h') => index(&s[1..]).map(Thread::Host),
        _ => Err(bad()),
    }
}

fn parse_prot(s: &str) -> Result<Prot, Malformed> {
    let b = s.as_bytes();
    let bit = |i: usize, ch: u8| match b.get(i) {
        Some(&c) if c == ch => Ok(true),
        Some(b'-') => Ok(false),
        _ => Err(Malformed::BadProt(clip(s))),
    };
    if b.len() != 3 {
        return Err(Malformed::BadProt(clip(s)));
    }
    Ok(Prot { read: bit(0, b'r')?, write: bit(1, b'w')?, exec: bit(2, b'x')? })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(t: u64, thread: Thread, event: Event) -> Record {
        Record { t_us: t, thread, event }
    }

    #[test]
    fn every_event_round_trips_through_its_line() {
        let a = GuestAddr(0x1021745000);
        let all = [
            rec(0, Thread::Render, Event::Frame { index: 7 }),
            rec(1, Thread::Game(0), Event::Commit { lo: a, size: 0x1000000, prot: Prot::READ_WRITE }),
            rec(1, Thread::Game(0), Event::Commit { lo: a, size: 0x1000, prot: Prot::ALL }),
            rec(2, Thread::Game(0), Event::Pool { lo: a, size: 0x1000000 }),
            rec(3, Thread::Render, Event::Bind { addr: GuestAddr(0x1021ffff00), size: 0x160 }),
            rec(4, Thread::Game(3), Event::Write { addr: GuestAddr(0x1021745008), size: 0x10 }),
            rec(5, Thread::Render, Event::Collect { lo: a, size: 0x2000 }),
            rec(6, Thread::Game(1), Event::Sleep { kind: SleepKind::Guest, ns: 20_000, count: 63 }),
            rec(6, Thread::Host(0), Event::Sleep { kind: SleepKind::Host, ns: 250_000, count: 1 }),
            rec(7, Thread::Game(0), Event::Unpool { lo: a, size: 0x1000000 }),
            rec(8, Thread::Game(0), Event::Decommit { lo: a, size: 0x1000000 }),
        ];
        for r in all {
            let line = r.to_string();
            assert_eq!(parse_record(&line), Ok(r), "{line}");
            check_record(&r, &Header::default()).unwrap();
        }
        assert_eq!(all[4].to_string(), "3 r bind 0x1021ffff00 0x160");
        assert_eq!(all[6].to_string(), "5 r collect 0x1021745000 0x2000");
        assert_eq!(all[7].to_string(), "6 g1 sleep guest 20000 x63");
        assert_eq!(all[1].to_string(), "1 g0 commit 0x1021745000 0x1000000 rw-");
    }

    #[test]
    fn the_header_round_trips_and_checks_its_version() {
        let h = Header::default().option("source", "synth").option("seed", 3);
        assert_eq!(h.to_string(), "emuhost-trace 1 window=0x8000000000 source=synth seed=3");
        assert_eq!(Header::parse(&h.to_string()), Ok(h.clone()));
        assert_eq!(h.get("seed"), Some("3"));
        assert!(matches!(Header::parse("emuhost-trace 2"), Err(Malformed::Version { .. })));
        assert!(matches!(Header::parse("emuhost-trace"), Err(Malformed::NotATrace(_))));
        assert!(matches!(Header::parse("trace 1"), Err(Malformed::NotATrace(_))));
        assert!(matches!(Header::parse("emuhost-trace 1 window=0x0"), Err(Malformed::HeaderWindow(_))));
        assert!(matches!(Header::parse("emuhost-trace 1 oops"), Err(Malformed::HeaderOption(_))));
        assert_eq!(Header::parse("emuhost-trace 1 window=0x40000000").unwrap().window, 1 << 30);
    }

    #[test]
    fn bad_fields_are_named() {
        use Malformed as M;
        type Is = fn(&Malformed) -> bool;
        let cases: [(&str, Is); 12] = [
            ("1 r blit 0x0 0x1", |m| matches!(m, M::UnknownEvent(e) if e == "blit")),
            ("1 r bind 0x10", |m| matches!(m, M::MissingField("size"))),
            ("1 r bind 10 0x10", |m| matches!(m, M::BadHex { field: "address", .. })),
            ("1 r bind 0x1g 0x10", |m| matches!(m, M::BadHex { field: "address", .. })),
            ("1 r bind 0x 0x10", |m| matches!(m, M::BadHex { .. })),
            ("1 r bind 0x10 0x10 junk", |m| matches!(m, M::TrailingText(t) if t == "junk")),
            ("x r frame 1", |m| matches!(m, M::BadNumber { field: "time", .. })),
            ("1 q frame 1", |m| matches!(m, M::BadThread(_))),
            ("1 g frame 1", |m| matches!(m, M::BadThread(_))),
            ("1 g0 commit 0x0 0x1000 rw", |m| matches!(m, M::BadProt(_))),
            ("1 g0 sleep nap 1", |m| matches!(m, M::BadSleepKind(_))),
            ("1 g0 sleep guest 1 x", |m| matches!(m, M::BadCount(_))),
        ];
        for (line, ok) in cases {
            let e = parse_record(line).unwrap_err();
            assert!(ok(&e), "{line}: {e:?}");
        }
        assert_eq!(parse_record("1 g0 sleep guest 5 x-1"), Err(M::BadCount("x-1".into())));
        assert_eq!(parse_record("1 g0 frame +1"), Err(M::BadNumber { field: "frame index", text: "+1".into() }));
        assert!(matches!(parse_record("99999999999999999999 r frame 1"), Err(M::BadNumber { field: "time", .. })));
    }

    #[test]
    fn records_are_checked_against_threads_alignment_and_window() {
        let h = Header { window: 1 << 30, options: vec![] };
        let check = |line: &str| check_record(&parse_record(line).unwrap(), &h);
        assert!(matches!(check("1 g0 bind 0x0 0x10"), Err(Malformed::WrongThread { .. })));
        assert!(matches!(check("1 g0 frame 0"), Err(Malformed::WrongThread { .. })));
        assert!(matches!(check("1 g0 collect 0x0 0x1000"), Err(Malformed::WrongThread { .. })));
        assert!(matches!(check("1 r write 0x0 0x10"), Err(Malformed::WrongThread { .. })));
        assert!(matches!(check("1 h0 sleep guest 10"), Err(Malformed::WrongThread { .. })));
        assert!(matches!(check("1 g0 pool 0x800 0x1000"), Err(Malformed::Unaligned { .. })));
        assert!(matches!(check("1 g0 commit 0x0 0x10 rw-"), Err(Malformed::Unaligned { .. })));
        assert!(matches!(check("1 g0 write 0x10 0x0"), Err(Malformed::ZeroSize { .. })));
        assert!(matches!(check("1 g0 pool 0x3ffff000 0x2000"), Err(Malformed::OutOfWindow { .. })));
        assert!(matches!(check("1 g0 write 0xffffffffffffffff 0x2"), Err(Malformed::OutOfWindow { .. })));
        check("1 g0 pool 0x3ffff000 0x1000").unwrap();
        check("1 h0 sleep host 10").unwrap();
        check("1 r sleep host 10").unwrap();
        check("1 g2 write 0x3 0x5").unwrap();
    }

    #[test]
    fn time_never_goes_back_and_frames_count_up_by_one() {
        let h = Header::default();
        let mut s = Sequence::default();
        let mut go = |line: &str| s.accept(&parse_record(line).unwrap(), &h);
        go("5 r frame 10").unwrap();
        go("5 g0 write 0x0 0x1").unwrap();
        assert_eq!(go("4 g0 write 0x0 0x1"), Err(Malformed::TimeBackwards { t: 4, previous: 5 }));
        assert_eq!(go("6 r frame 12"), Err(Malformed::FrameOrder { found: 12, previous: 10 }));
        go("7 r frame 11").unwrap();
    }
}
