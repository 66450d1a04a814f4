//! The log callback: emuhost's `tracing` events, each as one line of text, handed to the
//! embedder's function. The first `emuhost_set_log_callback` installs a subscriber as the
//! process's global default (refused where the process has one already, e.g. a Rust embedder's);
//! later calls change or clear the function.
//!
//! The function is never called on the thread that logs: emuhost logs while it holds its locks
//! (an importer's, a space's), and a callback that calls back into emuhost (the importer's
//! figures on an import's warning) would wait for a lock its own thread holds. The layer formats
//! the line and queues it (bounded: [`EMUHOST_LOG_QUEUE`]; a full queue drops the line and counts
//! it, and never holds up the thread that logs); one delivery thread calls the function, in
//! order, holding no lock of emuhost's. `emuhost_log_flush` and `emuhost_set_log_callback` wait
//! for the lines queued before them.
//!
//! What is forwarded is decided by one filter of `EMUHOST_LOG`'s syntax (`tracing`'s
//! `EnvFilter`: `info`, `warn,emuhost::import=debug`), `info` at first; `emuhost_set_log_level`
//! and `emuhost_set_log_filter` each replace it, so the later call wins. The library reads no
//! environment and no settings object for it (logging is the process's, settings are per
//! object): an embedder that wants the environment's `EMUHOST_LOG` passes it on
//! (`emuhost_set_log_filter(getenv("EMUHOST_LOG"))`).

use std::cell::Cell;
use std::ffi::{CString, c_char, c_void};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Mutex, OnceLock, RwLock};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::{EnvFilter, Layer, Registry, reload};

use crate::entry;
use crate::error::{EMUHOST_ERROR_OTHER, EMUHOST_ERROR_REFUSED, EMUHOST_ERROR_SETTING, Error, emuhost_error_t};

pub const EMUHOST_LOG_ERROR: u32 = 1;
pub const EMUHOST_LOG_WARN: u32 = 2;
pub const EMUHOST_LOG_INFO: u32 = 3;
pub const EMUHOST_LOG_DEBUG: u32 = 4;
pub const EMUHOST_LOG_TRACE: u32 = 5;

/// The embedder's log function: `user` as given to `emuhost_set_log_callback`, the level
/// (`EMUHOST_LOG_*`), the module that logged (e.g. `"emuhost::watch"`) and the line (message,
/// then `key=value` fields). Both strings are valid only during the call.
pub type emuhost_log_callback_t =
    Option<unsafe extern "C" fn(user: *mut c_void, level: u32, target: *const c_char, message: *const c_char)>;

#[derive(Clone, Copy)]
struct Sink {
    f: unsafe extern "C" fn(*mut c_void, u32, *const c_char, *const c_char),
    user: *mut c_void,
}

// SAFETY: `user` is the embedder's, handed back to its own function; `emuhost_set_log_callback`'s
// contract makes both callable from any thread.
unsafe impl Send for Sink {}
// SAFETY: as above.
unsafe impl Sync for Sink {}

/// How many lines wait for the callback at most: a line logged while the queue is full is
/// dropped (never waited for), and the callback's next line says how many were.
pub const EMUHOST_LOG_QUEUE: u32 = 1024;

static SINK: RwLock<Option<Sink>> = RwLock::new(None);
/// The filter forwarded lines pass (`EMUHOST_LOG`'s syntax), as the last of
/// `emuhost_set_log_level` and `emuhost_set_log_filter` set it; `info` before either.
static FILTER: Mutex<String> = Mutex::new(String::new());
/// The installed subscriber's filter, reloaded when [`FILTER`] changes; `None` where the process
/// had a subscriber already (nothing of emuhost's to filter).
static INSTALLED: OnceLock<Option<reload::Handle<EnvFilter, Registry>>> = OnceLock::new();
/// The delivery thread's queue (or why it could not start).
static DELIVERY: OnceLock<Result<Delivery, String>> = OnceLock::new();
/// Lines dropped since the last one queued.
static DROPPED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Whether this thread is the delivery thread (the callback's own calls into emuhost).
    static DELIVERING: Cell<bool> = const { Cell::new(false) };
}

/// What the delivery thread is given, in order.
enum Msg {
    /// A line, and how many were dropped just before it.
    Line { level: u32, target: CString, message: CString, dropped: u64 },
    /// Answered once every message before it was delivered.
    Flush(SyncSender<()>),
}

struct Delivery {
    queue: SyncSender<Msg>,
    /// The process the thread runs in: a forked child has no delivery thread to wait for.
    pid: u32,
}

fn delivery() -> Result<&'static Delivery, Error> {
    let d = DELIVERY.get_or_init(|| {
        let (queue, lines) = sync_channel(EMUHOST_LOG_QUEUE as usize);
        std::thread::Builder::new()
            .name("emuhost-log".into())
            .spawn(move || deliver(lines))
            .map(|_| Delivery { queue, pid: std::process::id() })
            .map_err(|e| e.to_string())
    });
    d.as_ref().map_err(|e| Error::new(EMUHOST_ERROR_OTHER, format!("starting the log delivery thread: {e}")))
}

/// The delivery thread: calls the function that is set when each line's turn comes, with no lock
/// held.
fn deliver(lines: Receiver<Msg>) {
    DELIVERING.with(|d| d.set(true));
    let call = |level: u32, target: &CString, message: &CString| {
        let Some(sink) = *SINK.read().unwrap_or_else(|p| p.into_inner()) else { return };
        // SAFETY: the embedder's function, with its `user` and two strings that live across the
        // call (the contract of `emuhost_set_log_callback`).
        unsafe { (sink.f)(sink.user, level, target.as_ptr(), message.as_ptr()) };
    };
    let report = |dropped: u64| {
        if dropped > 0 {
            let message = format!(
                "{dropped} log lines dropped: the log callback was slower than emuhost logged \
                 (EMUHOST_LOG_QUEUE: {EMUHOST_LOG_QUEUE} lines wait at most)"
            );
            call(EMUHOST_LOG_WARN, &c"emuhost_capi::log".into(), &CString::new(message).unwrap_or_default());
        }
    };
    for msg in lines {
        match msg {
            Msg::Line { level, target, message, dropped } => {
                report(dropped);
                call(level, &target, &message);
            }
            Msg::Flush(done) => {
                report(DROPPED.swap(0, Ordering::Relaxed));
                let _ = done.send(());
            }
        }
    }
}

/// Waits until every line queued before it was delivered. Not on the delivery thread (the
/// callback's own call would wait for itself), nor in a forked child (no delivery thread there).
fn wait_for_delivery() {
    let Some(Ok(d)) = DELIVERY.get() else { return };
    if DELIVERING.with(Cell::get) || d.pid != std::process::id() {
        return;
    }
    let (done, wait) = sync_channel(1);
    // Blocks while the queue is full: the delivery thread empties it.
    if d.queue.send(Msg::Flush(done)).is_ok() {
        let _ = wait.recv();
    }
}

fn code(level: &Level) -> u32 {
    match *level {
        Level::ERROR => EMUHOST_LOG_ERROR,
        Level::WARN => EMUHOST_LOG_WARN,
        Level::INFO => EMUHOST_LOG_INFO,
        Level::DEBUG => EMUHOST_LOG_DEBUG,
        Level::TRACE => EMUHOST_LOG_TRACE,
    }
}

/// The line: the message, then the other fields as `key=value`.
#[derive(Default)]
struct Line {
    message: String,
    fields: String,
}

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

/// The filter that `text` (`EMUHOST_LOG`'s syntax) makes; an error naming it where it does not
/// parse.
fn parse_filter(text: &str) -> Result<EnvFilter, Error> {
    EnvFilter::builder().parse(text).map_err(|e| {
        Error::new(EMUHOST_ERROR_SETTING, format!("log filter {text:?} (EMUHOST_LOG's syntax) does not parse: {e}"))
    })
}

/// Makes `text` the filter: parsed first (a bad one changes nothing), then reloaded into the
/// installed subscriber, if any.
fn set_filter(text: String) -> Result<(), Error> {
    let filter = parse_filter(&text)?;
    let mut current = FILTER.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(Some(handle)) = INSTALLED.get() {
        handle.reload(filter).map_err(|e| Error::new(EMUHOST_ERROR_OTHER, format!("reloading the log filter: {e}")))?;
    }
    *current = text;
    Ok(())
}

/// The filter as set so far (`info` before any).
fn current_filter() -> Result<EnvFilter, Error> {
    let text = FILTER.lock().unwrap_or_else(|p| p.into_inner()).clone();
    parse_filter(if text.is_empty() { "info" } else { &text })
}

struct Forward;

impl<S: Subscriber> Layer<S> for Forward {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        if SINK.read().unwrap_or_else(|p| p.into_inner()).is_none() {
            return;
        }
        let Some(Ok(d)) = DELIVERY.get() else { return };
        let mut line = Line::default();
        event.record(&mut line);
        line.message.push_str(&line.fields);
        // Interior NULs cannot pass as C strings: shown as U+FFFD.
        let text = |s: &str| CString::new(s.replace('\0', "\u{fffd}")).unwrap_or_default();
        let (target, message) = (text(event.metadata().target()), text(&line.message));
        let dropped = DROPPED.swap(0, Ordering::Relaxed);
        let level = code(event.metadata().level());
        // Never waits: a full queue drops the line (the callback is told how many).
        if let Err(TrySendError::Full(_)) = d.queue.try_send(Msg::Line { level, target, message, dropped }) {
            DROPPED.fetch_add(dropped + 1, Ordering::Relaxed);
        }
    }
}

/// Sends emuhost's log lines at `EMUHOST_LOG_INFO` and more severe (see `emuhost_set_log_level`)
/// to `callback` with `user`; NULL stops them. The first call makes emuhost's forwarding the
/// process's global `tracing` subscriber: where the process has one already, that is
/// `EMUHOST_ERROR_REFUSED` (the lines go to that one).
///
/// The callback is called on one thread of emuhost's ("emuhost-log"), one line at a time, in
/// the order they were logged, and never while emuhost holds a lock: it may call any emuhost
/// function, these included. The thread that logs never waits for it: where
/// [`EMUHOST_LOG_QUEUE`] lines wait already, a line is dropped, and the next line delivered is a
/// warning saying how many were. This call first waits until the lines logged before it were
/// delivered (to the callback it replaces), and, once it returns, the callback it replaced is
/// not called again (its `user` may be freed). Called from the callback itself it waits for
/// nothing (its own thread delivers). See [`emuhost_log_flush`].
///
/// # Safety
/// `callback` is called from emuhost's delivery thread until it is replaced: it and `user` must
/// stay valid that long, and be callable from that thread.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_set_log_callback(
    callback: emuhost_log_callback_t,
    user: *mut c_void,
) -> *mut emuhost_error_t {
    entry(|| {
        let filter = current_filter()?;
        let installed = INSTALLED.get_or_init(|| {
            let (filter, handle) = reload::Layer::new(filter);
            let subscriber = tracing_subscriber::registry().with(Forward.with_filter(filter));
            tracing::subscriber::set_global_default(subscriber).is_ok().then_some(handle)
        });
        if installed.is_none() {
            return Err(Error::new(
                EMUHOST_ERROR_REFUSED,
                "the process has a global tracing subscriber already: emuhost's lines go to it",
            ));
        }
        delivery()?;
        // The lines logged before this call go to the callback set when they were logged.
        wait_for_delivery();
        *SINK.write().unwrap_or_else(|p| p.into_inner()) = callback.map(|f| Sink { f, user });
        // A delivery to the replaced callback that was under way has returned.
        wait_for_delivery();
        Ok(())
    })
}

/// Waits until every line logged before this call has been handed to the log callback (and the
/// callback returned). Call it before reading what the callback collected, and before the
/// process exits (lines still queued then are lost). It returns at once where no callback was
/// ever set, when called from the callback itself, and in a forked child (no delivery thread
/// there: the child's lines are not delivered). The callback runs on another thread meanwhile:
/// call this (and `emuhost_set_log_callback`) holding no lock of yours that the callback takes.
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_log_flush() {
    crate::entry_or((), wait_for_delivery);
}

/// The least severe level forwarded to the log callback, for every module (`EMUHOST_LOG_ERROR` ..
/// `EMUHOST_LOG_TRACE`; before any call `EMUHOST_LOG_INFO`). It replaces the filter that
/// `emuhost_set_log_filter` set, and that one replaces it: the later call wins.
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_set_log_level(level: u32) -> *mut emuhost_error_t {
    entry(|| {
        let name = match level {
            EMUHOST_LOG_ERROR => "error",
            EMUHOST_LOG_WARN => "warn",
            EMUHOST_LOG_INFO => "info",
            EMUHOST_LOG_DEBUG => "debug",
            EMUHOST_LOG_TRACE => "trace",
            _ => {
                return Err(Error::invalid(format!(
                    "log level {level} is not one of EMUHOST_LOG_ERROR (1) .. _TRACE (5)"
                )));
            }
        };
        set_filter(name.into())
    })
}

/// The log callback's filter, in `EMUHOST_LOG`'s syntax (`tracing`'s `EnvFilter`: a level,
/// `module=level` pairs, comma-separated, e.g. `"warn,emuhost::import=debug"`). It replaces the
/// level `emuhost_set_log_level` set, and that one replaces it: the later call wins. NULL or an
/// empty string change nothing, so `emuhost_set_log_filter(getenv("EMUHOST_LOG"))` passes on the
/// environment's switch where it is set (the library reads no environment itself, and no
/// settings object's `EMUHOST_LOG`: logging is the process's). A filter that does not parse is
/// `EMUHOST_ERROR_SETTING`, naming it, and changes nothing.
///
/// # Safety
/// `filter` is NULL or a NUL-terminated string.
#[must_use]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emuhost_set_log_filter(filter: *const c_char) -> *mut emuhost_error_t {
    entry(|| {
        if filter.is_null() {
            return Ok(());
        }
        // SAFETY: a NUL-terminated string (the caller vouches).
        let text = unsafe { crate::ffi::text(filter, "filter") }?;
        if text.trim().is_empty() {
            return Ok(());
        }
        set_filter(text.to_string())
    })
}
