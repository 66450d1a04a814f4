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

use std::cell::Cell;
use std::ffi::{CString, c_char, c_void};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{OnceLock, RwLock};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt as _};

use crate::entry;
use crate::error::{EMUHOST_ERROR_OTHER, EMUHOST_ERROR_REFUSED, Error, emuhost_error_t};

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
static MAX_LEVEL: AtomicU32 = AtomicU32::new(EMUHOST_LOG_INFO);
static INSTALLED: OnceLock<bool> = OnceLock::new();
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

struct Forward;

impl<S: Subscriber> Layer<S> for Forward {
    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        code(meta.level()) <= MAX_LEVEL.load(Ordering::Relaxed)
    }

    fn register_callsite(&self, _: &'static Metadata<'static>) -> tracing::subscriber::Interest {
        // Asked every time: the level may change at run time.
        tracing::subscriber::Interest::sometimes()
    }

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
        let installed = *INSTALLED.get_or_init(|| {
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Forward)).is_ok()
        });
        if !installed {
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

/// The least severe level forwarded (`EMUHOST_LOG_ERROR` .. `EMUHOST_LOG_TRACE`; default
/// `EMUHOST_LOG_INFO`).
#[must_use]
#[unsafe(no_mangle)]
pub extern "C" fn emuhost_set_log_level(level: u32) -> *mut emuhost_error_t {
    entry(|| {
        if !(EMUHOST_LOG_ERROR..=EMUHOST_LOG_TRACE).contains(&level) {
            return Err(Error::invalid(format!("log level {level} is not one of EMUHOST_LOG_ERROR (1) .. _TRACE (5)")));
        }
        MAX_LEVEL.store(level, Ordering::Relaxed);
        Ok(())
    })
}
