//! The log callback: it receives emuhost's lines, is never called while emuhost holds a lock (a
//! callback may call back into emuhost), never holds up the thread that logs, and is not called
//! once it was replaced. The callback is the process's one, so these tests run one at a time.

use std::ffi::{CStr, c_char, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::mpsc::channel;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use emuhost_capi::*;

use crate::abi::ok;

/// Long enough for any run under load; a deadlock waits forever, so this only bounds the failure.
const WATCHDOG: Duration = Duration::from_secs(120);

/// The callback is the process's: one test at a time sets it.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn set(callback: emuhost_log_callback_t, user: usize) {
    // SAFETY: the tests' callbacks are thread-safe and live for the process.
    ok(unsafe { emuhost_set_log_callback(callback, std::ptr::without_provenance_mut(user)) });
}

fn flush() {
    emuhost_log_flush();
}

/// Logs one info line (`sched: prepare_workers: ...`).
fn log_one() {
    let mut count = 0;
    // SAFETY: out-pointers to locals.
    ok(unsafe { emuhost_prepare_workers(EMUHOST_ALLOCATOR_LOCKED, &mut count, null_mut(), 0, null_mut()) });
}

/// The message of a callback's line.
///
/// # Safety
/// `message` is the callback's string, valid during the call.
unsafe fn text(message: *const c_char) -> String {
    // SAFETY: as the caller vouches.
    unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
}

static LINES: Mutex<Vec<(u32, String, String)>> = Mutex::new(Vec::new());

unsafe extern "C" fn keep(user: *mut c_void, level: u32, target: *const c_char, message: *const c_char) {
    assert_eq!(user as usize, 0x5eed);
    // SAFETY: the strings live across the call (the callback's contract).
    let (target, message) = unsafe { (CStr::from_ptr(target), text(message)) };
    LINES.lock().unwrap().push((level, target.to_string_lossy().into_owned(), message));
}

#[test]
fn the_log_callback_receives_emuhosts_lines() {
    let _serial = serial();
    set(Some(keep), 0x5eed);
    log_one();
    // The lines reach the callback on emuhost's delivery thread: a flush waits for them.
    flush();
    let lines = LINES.lock().unwrap().clone();
    let line = lines.iter().find(|(_, _, m)| m.contains("sched: prepare_workers:"));
    let (level, target, _) = line.unwrap_or_else(|| panic!("no prepare_workers line in {lines:?}"));
    assert_eq!((*level, target.as_str()), (EMUHOST_LOG_INFO, "emuhost::sched::workers"));
    set(None, 0);
}

/// A callback that calls back into emuhost, on lines that injected faults make.
#[cfg(feature = "faults")]
mod calls_back {
    use super::*;
    use emuhost::faults::{Plan, Schedule, scoped};
    use std::sync::atomic::AtomicUsize;

    /// Handles the callback below calls back into, and what those calls gave.
    static IMPORTER: AtomicUsize = AtomicUsize::new(0);
    static SPACE: AtomicUsize = AtomicUsize::new(0);
    static STATS_CALLS: AtomicU32 = AtomicU32::new(0);
    static ALLOCATION_CALLS: AtomicU32 = AtomicU32::new(0);

    /// A callback that asks emuhost about the object a line is about, as an embedder's log window
    /// does: the importer's figures on an import failure, the space's allocations on a commit's line.
    unsafe extern "C" fn call_back_in(_: *mut c_void, _: u32, _: *const c_char, message: *const c_char) {
        // SAFETY: the callback's string.
        let m = unsafe { text(message) };
        let imp = std::ptr::without_provenance::<emuhost_importer_t>(IMPORTER.load(SeqCst));
        if m.contains("import of") && m.contains("failed") && !imp.is_null() {
            let mut stats = emuhost_import_stats_t::default();
            // SAFETY: an out-pointer to a local.
            if unsafe { emuhost_importer_stats(imp, &mut stats) }.is_null() {
                STATS_CALLS.fetch_add(1, SeqCst);
            }
        }
        let space = std::ptr::without_provenance::<emuhost_space_t>(SPACE.load(SeqCst));
        if m.contains("commit of") && m.contains("one call failed") && !space.is_null() {
            let mut n = 0;
            // SAFETY: no room asked for (NULL, 0), an out-pointer to a local.
            if unsafe { emuhost_space_allocations(space, 0, crate::abi::page(), null_mut(), 0, &mut n) }.is_null() {
                ALLOCATION_CALLS.fetch_add(1, SeqCst);
            }
        }
    }

    /// A callback that calls back into emuhost (`importer_stats` on an import's warning, logged
    /// under the importer's lock; `space_allocations` on a commit's debug line, logged under the
    /// space's lock) deadlocked. Both lines come from injected faults on the scenario's thread; a
    /// watchdog fails the test where that thread never ends.
    #[test]
    fn a_callback_that_calls_back_into_emuhost_does_not_deadlock() {
        let _serial = serial();
        set(Some(call_back_in), 0);
        ok(emuhost_set_log_level(EMUHOST_LOG_DEBUG));
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let p = crate::abi::page();
            // This thread's first commit call and first import fail.
            let _faults = scoped(Plan { import: Schedule::nth(1), commit_enomem: Schedule::nth(1), ..Plan::default() });
            let s = crate::abi::space(4096);
            SPACE.store(s.addr(), SeqCst);
            // The one-call commit fails: a debug line under the space's lock, then the region walk.
            ok(emuhost_space_commit(s, 0, 64 * p, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
            // No import ahead on other threads: the binding's import is this thread's first.
            let imp = crate::abi::pin_importer(s, &[(c"EMUHOST_IMPORT_AHEAD_THREADS", c"0")]);
            IMPORTER.store(imp.addr(), SeqCst);
            let mut pool = 0;
            let mut b = emuhost_binding_t::default();
            // SAFETY: out-pointers to locals.
            unsafe {
                ok(emuhost_importer_add_pool(imp, 0, 16 * p, &mut pool));
                // The import fails: a warning under the importer's lock (the binding's outcome is
                // not what this test is about).
                crate::abi::outcome(emuhost_importer_bind(imp, p, p, &mut b));
            }
            let _ = tx.send((s.addr(), imp.addr()));
        });
        let (s, imp) = rx.recv_timeout(WATCHDOG).expect("deadlocked: the callback was called under emuhost's lock");
        flush();
        let (stats, allocations) = (STATS_CALLS.load(SeqCst), ALLOCATION_CALLS.load(SeqCst));
        assert!(stats >= 1 && allocations >= 1, "the callback called back {stats} and {allocations} times");
        ok(emuhost_set_log_level(EMUHOST_LOG_INFO));
        set(None, 0);
        IMPORTER.store(0, SeqCst);
        SPACE.store(0, SeqCst);
        ok(emuhost_importer_delete(std::ptr::without_provenance_mut(imp)));
        ok(emuhost_space_delete(std::ptr::without_provenance_mut(s)));
    }
}

/// Whether the slow callback may return, and the lines it saw.
static GATE: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());
static SLOW_LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn slow(_: *mut c_void, _: u32, _: *const c_char, message: *const c_char) {
    let (open, wake) = &GATE;
    let mut g = open.lock().unwrap();
    while !*g {
        g = wake.wait(g).unwrap();
    }
    // SAFETY: the callback's string.
    SLOW_LINES.lock().unwrap().push(unsafe { text(message) });
}

/// A callback that does not return (for now) never holds up the thread that logs: past
/// `EMUHOST_LOG_QUEUE` waiting lines, lines are dropped, and the callback is told how many.
#[test]
fn a_slow_callback_never_holds_up_the_thread_that_logs() {
    let _serial = serial();
    *GATE.0.lock().unwrap() = false;
    set(Some(slow), 0);
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for _ in 0..EMUHOST_LOG_QUEUE + 50 {
            log_one();
        }
        let _ = tx.send(());
    });
    let logged = rx.recv_timeout(WATCHDOG);
    *GATE.0.lock().unwrap() = true;
    GATE.1.notify_all();
    logged.expect("the thread that logs waited for the callback");
    flush();
    let lines = SLOW_LINES.lock().unwrap().clone();
    let dropped = lines.iter().find(|m| m.contains("log lines dropped"));
    assert!(dropped.is_some(), "no line says lines were dropped, in {} lines", lines.len());
    let kept = lines.iter().filter(|m| m.contains("sched: prepare_workers:")).count();
    assert!(kept >= 1 && kept <= EMUHOST_LOG_QUEUE as usize + 1, "{kept} lines kept");
    set(None, 0);
    SLOW_LINES.lock().unwrap().clear();
}

static FIRST: AtomicU32 = AtomicU32::new(0);
static SECOND: AtomicU32 = AtomicU32::new(0);

unsafe extern "C" fn count(user: *mut c_void, _: u32, _: *const c_char, message: *const c_char) {
    // SAFETY: the callback's string.
    if unsafe { text(message) }.contains("sched: prepare_workers:") {
        [&FIRST, &SECOND][user as usize].fetch_add(1, SeqCst);
    }
}

/// A callback replaced gets every line logged before the call that replaces it, and none after
/// that call returned (so its `user` may be freed then).
#[test]
fn a_replaced_callback_gets_the_lines_before_and_none_after() {
    let _serial = serial();
    set(Some(count), 0);
    for _ in 0..100 {
        log_one();
    }
    set(Some(count), 1);
    assert_eq!(FIRST.load(SeqCst), 100, "the lines logged before the replacement");
    for _ in 0..10 {
        log_one();
    }
    set(None, 0);
    assert_eq!((FIRST.load(SeqCst), SECOND.load(SeqCst)), (100, 10));
    log_one();
    flush();
    assert_eq!((FIRST.load(SeqCst), SECOND.load(SeqCst)), (100, 10), "a line after NULL");
}

/// Whether `log_one`'s info line (target `emuhost::sched::workers`) reaches the callback now.
fn info_line_delivered() -> bool {
    LINES.lock().unwrap().clear();
    log_one();
    flush();
    LINES.lock().unwrap().iter().any(|(_, _, m)| m.contains("sched: prepare_workers:"))
}

fn filter(text: Option<&CStr>) -> *mut emuhost_error_t {
    // SAFETY: NULL or a NUL-terminated literal.
    unsafe { emuhost_set_log_filter(text.map_or(std::ptr::null(), CStr::as_ptr)) }
}

/// `emuhost_set_log_level` and `emuhost_set_log_filter` (EMUHOST_LOG's syntax) each replace what
/// the other set: the later call wins. NULL and "" change nothing; a bad filter is an error
/// naming it and changes nothing.
#[test]
fn the_later_of_log_level_and_log_filter_wins() {
    let _serial = serial();
    set(Some(keep), 0x5eed);
    assert!(info_line_delivered(), "info is the default");
    ok(filter(Some(c"warn")));
    assert!(!info_line_delivered(), "a filter of warn let an info line through");
    ok(emuhost_set_log_level(EMUHOST_LOG_INFO));
    assert!(info_line_delivered(), "the level set after the filter did not win");
    ok(filter(Some(c"warn,emuhost::sched=info")));
    assert!(info_line_delivered(), "a module's own level was not applied");
    ok(filter(Some(c"info,emuhost::sched=warn")));
    assert!(!info_line_delivered(), "the module's warn did not hold back its info line");
    // NULL (getenv of an unset switch) and "" change nothing.
    ok(filter(None));
    ok(filter(Some(c"")));
    assert!(!info_line_delivered(), "NULL or \"\" changed the filter");
    let e = filter(Some(c"emuhost=loud"));
    crate::abi::fails(e, EMUHOST_ERROR_SETTING, "\"emuhost=loud\"");
    assert!(!info_line_delivered(), "a refused filter changed the filter");
    ok(emuhost_set_log_level(EMUHOST_LOG_WARN));
    assert!(!info_line_delivered());
    ok(emuhost_set_log_level(EMUHOST_LOG_INFO));
    assert!(info_line_delivered());
    set(None, 0);
}
