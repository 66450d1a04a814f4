//! The log lines and the progress bars on stderr. Long runs (`replay`, `ab`, `soak`, `prepare`,
//! `bench`) show a bar with their frames, rounds or parts, the time elapsed and the time left;
//! the bars are `tracing-indicatif`'s, so a log line is written above a bar instead of through it.
//! Where stderr is not a terminal (a pipe, a file, tests, CI) there is no bar: only log lines.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tracing_indicatif::IndicatifLayer;
use tracing_indicatif::filter::IndicatifFilter;
use tracing_indicatif::span_ext::IndicatifSpanExt;
use tracing_indicatif::style::ProgressStyle;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Whether bars are drawn: stderr is a terminal.
pub fn shown() -> bool {
    std::io::stderr().is_terminal()
}

/// Sets up the process's log subscriber: lines through `filter` (`EMUHOST_LOG`, the one place the
/// level is set; checked before, `info` if it does not parse), in colour where `colour`; and the
/// bars, which no log filter hides, where stderr is a terminal.
pub fn init(filter: &str, colour: bool) {
    let lines = || EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_ansi(colour);
    if shown() {
        let bars = IndicatifLayer::new();
        let fmt = fmt.with_writer(bars.get_stderr_writer()).with_filter(lines());
        // Only the spans made by `Bar::new` (the field `indicatif.pb_show`) get a bar.
        let _ = tracing_subscriber::registry().with(fmt).with(bars.with_filter(IndicatifFilter::new(false))).try_init();
    } else {
        let fmt = fmt.with_writer(std::io::stderr).with_filter(lines());
        let _ = tracing_subscriber::registry().with(fmt).try_init();
    }
}

/// A bar on stderr while it lives (nothing where stderr is not a terminal).
pub struct Bar(tracing::Span);

impl Bar {
    /// A bar of `len` `unit`s (frames, rounds, parts), `what` before it; with `len` unknown, a
    /// spinner with the count (none with `unit` empty) and the time elapsed.
    pub fn new(what: &str, unit: &str, len: Option<u64>) -> Bar {
        let span = tracing::info_span!("progress", "indicatif.pb_show" = tracing::field::Empty);
        if !shown() {
            return Bar(span);
        }
        let template = match len {
            Some(_) => format!("{{msg}} [{{bar:30}}] {{pos}}/{{len}} {unit}, {{elapsed}} elapsed, {{eta}} left"),
            None if unit.is_empty() => "{spinner} {msg}, {elapsed} elapsed".to_string(),
            None => format!("{{spinner}} {{msg}} {{pos}} {unit}, {{elapsed}} elapsed"),
        };
        let style = ProgressStyle::with_template(&template)
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        span.pb_set_style(&style);
        span.pb_set_message(what);
        if let Some(n) = len {
            span.pb_set_length(n);
        }
        span.pb_start();
        Bar(span)
    }

    /// Where the run is now.
    pub fn set(&self, pos: u64) {
        self.0.pb_set_position(pos);
    }

    /// One more done.
    pub fn inc(&self) {
        self.0.pb_inc(1);
    }

    /// The text before the bar.
    pub fn message(&self, what: &str) {
        self.0.pb_set_message(what);
    }

    /// Starts over with `len` and the text `what` (a new phase).
    pub fn restart(&self, what: &str, len: u64) {
        self.0.pb_reset();
        self.0.pb_set_length(len);
        self.0.pb_set_message(what);
    }
}

/// A [`Bar`] that a thread of its own sets from `pos` ten times a second, until it is dropped;
/// `None` where stderr is not a terminal.
pub struct Ticking {
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// See [`Ticking`]: a bar of `len` `unit`s (unknown: a spinner), `what` before it.
pub fn ticking(
    what: String,
    unit: &'static str,
    len: Option<u64>,
    pos: impl Fn() -> u64 + Send + 'static,
) -> Option<Ticking> {
    ticking_to(what, unit, len, move || (pos(), None))
}

/// [`ticking`] whose length `pos` gives too, as it grows (a bench plans its rounds part by part:
/// `emuhost_lab::bench::progress`); the bar starts at `len`.
pub fn ticking_to(
    what: String,
    unit: &'static str,
    len: Option<u64>,
    pos: impl Fn() -> (u64, Option<u64>) + Send + 'static,
) -> Option<Ticking> {
    if !shown() {
        return None;
    }
    let done = Arc::new(AtomicBool::new(false));
    let stop = done.clone();
    let thread = std::thread::spawn(move || {
        let bar = Bar::new(&what, unit, len);
        while !stop.load(Ordering::SeqCst) {
            let (at, len) = pos();
            if let Some(n) = len {
                bar.0.pb_set_length(n);
            }
            bar.set(at);
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    Some(Ticking { done, thread: Some(thread) })
}

impl Drop for Ticking {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
