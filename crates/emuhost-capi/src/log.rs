//! The log callback: emuhost's `tracing` events, each as one line of text, handed to the
//! embedder's function. The first `emuhost_set_log_callback` installs a subscriber as the
//! process's global default (refused where the process has one already, e.g. a Rust embedder's);
//! later calls change or clear the function.

use std::ffi::{CString, c_char, c_void};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{OnceLock, RwLock};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt as _};

use crate::entry;
use crate::error::{EMUHOST_ERROR_REFUSED, Error, emuhost_error_t};

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

static SINK: RwLock<Option<Sink>> = RwLock::new(None);
static MAX_LEVEL: AtomicU32 = AtomicU32::new(EMUHOST_LOG_INFO);
static INSTALLED: OnceLock<bool> = OnceLock::new();

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
        let Some(sink) = *SINK.read().unwrap_or_else(|p| p.into_inner()) else { return };
        let mut line = Line::default();
        event.record(&mut line);
        line.message.push_str(&line.fields);
        // Interior NULs cannot pass as C strings: shown as U+FFFD.
        let text = |s: &str| CString::new(s.replace('\0', "\u{fffd}")).unwrap_or_default();
        let (target, message) = (text(event.metadata().target()), text(&line.message));
        // SAFETY: the embedder's function, with its `user` and two strings that live across the
        // call (the contract of `emuhost_set_log_callback`).
        unsafe { (sink.f)(sink.user, code(event.metadata().level()), target.as_ptr(), message.as_ptr()) };
    }
}

/// Sends emuhost's log lines at `EMUHOST_LOG_INFO` and more severe (see `emuhost_set_log_level`)
/// to `callback` with `user`; NULL stops them. The first call makes emuhost's forwarding the
/// process's global `tracing` subscriber: where the process has one already, that is
/// `EMUHOST_ERROR_REFUSED` (the lines go to that one).
///
/// # Safety
/// `callback` may be called from any thread, several at once, until it is replaced, including
/// during the call that replaces it: it and `user` must stay valid and thread-safe that long. It
/// must not call back into emuhost's log functions.
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
        *SINK.write().unwrap_or_else(|p| p.into_inner()) = callback.map(|f| Sink { f, user });
        Ok(())
    })
}

/// The least severe level forwarded (`EMUHOST_LOG_ERROR` .. `EMUHOST_LOG_TRACE`; default
/// `EMUHOST_LOG_INFO`).
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
