//! The C ABI called as C calls it: results, and misuse (NULL, stale and mistyped handles, ranges
//! outside the window, bad constants and text, small buffers) coming back as errors.

use std::ffi::{CStr, c_char};
use std::ptr::{null, null_mut};

use emuhost_capi::*;

/// The code and message of `e` (deleted), or `None` for success.
pub(crate) fn outcome(e: *mut emuhost_error_t) -> Option<(u32, String)> {
    if e.is_null() {
        return None;
    }
    let code = emuhost_error_code(e);
    // SAFETY: a NULL buffer of capacity 0 asks for the length; then a buffer of that much more one.
    let message = unsafe {
        let n = emuhost_error_message(e, null_mut(), 0);
        let mut buf = vec![0 as c_char; n + 1];
        assert_eq!(emuhost_error_message(e, buf.as_mut_ptr(), buf.len()), n);
        CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
    };
    assert!(emuhost_error_delete(e));
    Some((code, message))
}

#[track_caller]
pub(crate) fn ok(e: *mut emuhost_error_t) {
    if let Some((code, message)) = outcome(e) {
        panic!("error {code}: {message}");
    }
}

#[track_caller]
pub(crate) fn fails(e: *mut emuhost_error_t, code: u32, says: &str) -> String {
    let (got, message) = outcome(e).expect("the call succeeded");
    assert_eq!(got, code, "{message}");
    assert!(message.contains(says), "{message:?} does not say {says:?}");
    message
}

/// The platform's protection backend (armed pages read-only, a write claimed by the fault
/// handler): its code, and its name as `EMUHOST_WATCH` takes it.
#[cfg(target_os = "linux")]
const PROTECTION: (u32, &CStr) = (EMUHOST_WATCH_MPROTECT, c"mprotect");
/// The platform's protection backend (armed pages read-only, a write claimed by the fault
/// handler): its code, and its name as `EMUHOST_WATCH` takes it.
#[cfg(windows)]
const PROTECTION: (u32, &CStr) = (EMUHOST_WATCH_GUARD, c"guard");

pub(crate) fn page() -> u64 {
    emuhost::space::page_size()
}

pub(crate) fn space(pages: u64) -> *mut emuhost_space_t {
    let mut s = null_mut();
    // SAFETY: an out-pointer to a local.
    ok(unsafe { emuhost_space_reserve(pages * page(), 0, &mut s) });
    s
}

#[test]
fn null_handles_and_out_pointers_are_errors() {
    let p = page();
    fails(emuhost_space_commit(null(), 0, p, EMUHOST_PROT_READ), EMUHOST_ERROR_NULL, "space handle is NULL");
    fails(emuhost_tracker_arm(null(), 0, p), EMUHOST_ERROR_NULL, "tracker handle is NULL");
    fails(emuhost_importer_release_all(null()), EMUHOST_ERROR_NULL, "importer handle is NULL");
    fails(emuhost_sleeper_sleep(null(), EMUHOST_CALLER_GUEST, 1), EMUHOST_ERROR_NULL, "sleeper handle is NULL");
    // SAFETY: NULL out-pointers, which the calls check.
    unsafe {
        fails(emuhost_space_reserve(16 * p, 0, null_mut()), EMUHOST_ERROR_NULL, "out-pointer is NULL");
        fails(emuhost_settings_new(null_mut()), EMUHOST_ERROR_NULL, "out-pointer is NULL");
        let s = space(4);
        fails(emuhost_space_info(s, null_mut()), EMUHOST_ERROR_NULL, "NULL");
        fails(emuhost_space_write(s, 0, null(), 8), EMUHOST_ERROR_NULL, "data is NULL");
        ok(emuhost_space_delete(s));
    }
    // Deleting NULL does nothing.
    ok(emuhost_space_delete(null_mut()));
    assert!(emuhost_error_delete(null_mut()));
    assert_eq!(emuhost_error_code(null()), EMUHOST_ERROR_NULL);
}

#[test]
fn ranges_outside_the_window_and_bad_constants_are_errors() {
    let p = page();
    let s = space(16);
    fails(
        emuhost_space_commit(s, 16 * p, p, EMUHOST_PROT_READ),
        EMUHOST_ERROR_OUT_OF_RANGE,
        "outside the guest window",
    );
    fails(emuhost_space_commit(s, 15 * p, 2 * p, EMUHOST_PROT_READ), EMUHOST_ERROR_OUT_OF_RANGE, "outside");
    fails(emuhost_space_commit(s, u64::MAX - p + 1, 2 * p, EMUHOST_PROT_READ), EMUHOST_ERROR_OUT_OF_RANGE, "outside");
    fails(emuhost_space_commit(s, 1, p, EMUHOST_PROT_READ), EMUHOST_ERROR_INVALID_ARGUMENT, "not aligned");
    fails(emuhost_space_commit(s, 0, 0, EMUHOST_PROT_READ), EMUHOST_ERROR_INVALID_ARGUMENT, "zero length");
    fails(emuhost_space_commit(s, 0, p, 8), EMUHOST_ERROR_INVALID_ARGUMENT, "protection 0x8");
    // SAFETY: a local buffer and its length.
    unsafe {
        let buf = [0u8; 8];
        fails(emuhost_space_write(s, 16 * p - 4, buf.as_ptr().cast(), 8), EMUHOST_ERROR_OUT_OF_RANGE, "outside");
        let mut t = null_mut();
        ok(emuhost_tracker_new(s, null(), EMUHOST_WATCH_AUTO, 0, &mut t));
        fails(emuhost_tracker_arm(t, 0, 17 * p), EMUHOST_ERROR_OUT_OF_RANGE, "outside");
        fails(emuhost_tracker_new(s, null(), 7, 0, &mut t), EMUHOST_ERROR_INVALID_ARGUMENT, "backend 7");
        let mut t2 = null_mut();
        fails(
            emuhost_tracker_new(s, null(), EMUHOST_WATCH_AUTO, 2, &mut t2),
            EMUHOST_ERROR_INVALID_ARGUMENT,
            "flags 0x2",
        );
        // Words: a granularity that is no power of two, too few words, a range past the window.
        let mut words = [0u64; 1];
        let w = words.as_mut_ptr();
        fails(
            emuhost_tracker_collect_into(t, 0, p, 3 * p, w, 1, 0, null_mut()),
            EMUHOST_ERROR_INVALID_ARGUMENT,
            "granularity",
        );
        fails(
            emuhost_tracker_collect_into(t, 0, 16 * p, p, w, 0, 0, null_mut()),
            EMUHOST_ERROR_INVALID_ARGUMENT,
            "words",
        );
        fails(
            emuhost_tracker_collect_into(t, 0, 17 * p, p, w, 1, 1, null_mut()),
            EMUHOST_ERROR_OUT_OF_RANGE,
            "outside",
        );
        fails(emuhost_tracker_collect_into(t, 0, p, p, null_mut(), 1, 0, null_mut()), EMUHOST_ERROR_NULL, "words");
        let mut c = null_mut();
        ok(emuhost_consumer_new(t, &mut c));
        ok(emuhost_consumer_delete(c));
        fails(emuhost_consumer_delete(c), EMUHOST_ERROR_BAD_HANDLE, "not a live consumer handle");
        fails(
            emuhost_consumer_collect_into(c, 0, p, p, w, 1, 0, null_mut()),
            EMUHOST_ERROR_BAD_HANDLE,
            "not a live consumer",
        );
        // A fault handle of no tracker, and a NULL one, take no fault.
        assert_eq!(emuhost_fault_handle_handle(null(), 0x1000, 1), 0);
        assert_eq!(emuhost_handle_fault(0x1000, 1), 0);
        ok(emuhost_tracker_delete(t));
    }
    fails(emuhost_sleeper_sleep(null(), 9, 1), EMUHOST_ERROR_NULL, "NULL");
    fails(emuhost_set_log_level(0), EMUHOST_ERROR_INVALID_ARGUMENT, "log level 0");
    assert!(emuhost_watch_backend_name(9).is_null() && emuhost_wait_name(9).is_null());
    // Every backend code has its name, on every platform (a kind of another platform too).
    for (code, name) in [
        (EMUHOST_WATCH_AUTO, "auto"),
        (EMUHOST_WATCH_UFFD, "uffd"),
        (EMUHOST_WATCH_MPROTECT, "mprotect"),
        (EMUHOST_WATCH_WRITEWATCH, "writewatch"),
        (EMUHOST_WATCH_GUARD, "guard"),
    ] {
        // SAFETY: a non-null name is a static NUL-terminated string.
        let got = unsafe { std::ffi::CStr::from_ptr(emuhost_watch_backend_name(code)) };
        assert_eq!(got.to_str(), Ok(name));
    }
    ok(emuhost_space_delete(s));
}

#[test]
fn deleted_and_mistyped_handles_are_errors_and_a_double_delete_changes_nothing() {
    let s = space(4);
    let mut settings = null_mut();
    // SAFETY: out-pointers to locals.
    unsafe { ok(emuhost_settings_new(&mut settings)) };
    // A settings handle is not a space.
    let as_space = settings.cast::<emuhost_space_t>();
    fails(emuhost_space_zero(as_space, 0, page()), EMUHOST_ERROR_BAD_HANDLE, "not a live space handle");
    fails(emuhost_space_delete(as_space), EMUHOST_ERROR_BAD_HANDLE, "not a live space handle");
    ok(emuhost_settings_delete(settings));
    fails(emuhost_settings_delete(settings), EMUHOST_ERROR_BAD_HANDLE, "deleted already");

    ok(emuhost_space_delete(s));
    fails(emuhost_space_delete(s), EMUHOST_ERROR_BAD_HANDLE, "not a live space handle");
    fails(emuhost_space_commit(s, 0, page(), EMUHOST_PROT_READ), EMUHOST_ERROR_BAD_HANDLE, "not a live space");
    // A made-up value.
    let bogus = std::ptr::without_provenance_mut::<emuhost_tracker_t>(0xdead_0000);
    fails(emuhost_tracker_arm(bogus, 0, page()), EMUHOST_ERROR_BAD_HANDLE, "not a live tracker handle");

    // Errors: a second delete says false and does nothing.
    let e = emuhost_space_delete(s);
    assert!(!e.is_null());
    assert!(emuhost_error_delete(e));
    assert!(!emuhost_error_delete(e));
    assert_eq!(emuhost_error_code(e), EMUHOST_ERROR_BAD_HANDLE);
}

#[test]
fn a_tracker_keeps_its_space_and_collects_into_the_callers_words() {
    let p = page();
    let s = space(16);
    let mut t = null_mut();
    // SAFETY: out-pointers and buffers are locals with their lengths.
    unsafe {
        ok(emuhost_space_commit(s, 0, 16 * p, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
        ok(emuhost_tracker_new(s, null(), EMUHOST_WATCH_AUTO, 0, &mut t));
        let mut info = std::mem::zeroed::<emuhost_space_info_t>();
        ok(emuhost_space_info(s, &mut info));
        // The space handle goes; the tracker keeps the space.
        ok(emuhost_space_delete(s));
        fails(emuhost_space_info(s, &mut info), EMUHOST_ERROR_BAD_HANDLE, "space");
        ok(emuhost_tracker_arm(t, 0, 16 * p));
        let mut backend = 0;
        ok(emuhost_tracker_backend(t, &mut backend));
        assert!(!emuhost_watch_backend_name(backend).is_null());
        // Writes straight to guest memory, as guest code makes them.
        let base = info.host_base.cast::<u8>();
        for i in [3u64, 4, 9] {
            std::ptr::write_volatile(base.add((i * p + 1) as usize), 7u8);
        }
        let mut pages = [0u64; 16];
        let mut r = emuhost_collect_t::default();
        // Too little room: refused before anything is collected, so nothing is lost.
        fails(
            emuhost_tracker_collect(t, 0, 16 * p, pages.as_mut_ptr(), 15, &mut r),
            EMUHOST_ERROR_INVALID_ARGUMENT,
            "room for 15 pages",
        );
        fails(emuhost_tracker_collect(t, 0, 16 * p, pages.as_mut_ptr(), 16, null_mut()), EMUHOST_ERROR_NULL, "result");
        ok(emuhost_tracker_collect(t, 0, 16 * p, pages.as_mut_ptr(), 16, &mut r));
        assert_eq!(&pages[..r.pages], &[3 * p, 4 * p, 9 * p]);
        assert_eq!(r.seq, 1);
        ok(emuhost_tracker_collect(t, 0, 16 * p, pages.as_mut_ptr(), 16, &mut r));
        assert_eq!(r.pages, 0);
        ok(emuhost_tracker_delete(t));
    }
}

#[test]
fn settings_are_set_by_name_and_a_bad_one_is_named() {
    let mut st = null_mut();
    // SAFETY: out-pointers to locals; NUL-terminated literals.
    unsafe {
        ok(emuhost_settings_new(&mut st));
        let m = fails(
            emuhost_settings_set(st, c"EMUHOST_WACTH".as_ptr(), c"uffd".as_ptr()),
            EMUHOST_ERROR_SETTING,
            "EMUHOST_WACTH",
        );
        assert!(m.contains("EMUHOST_WATCH"), "{m}");
        fails(emuhost_settings_set(st, c"EMUHOST_WATCH".as_ptr(), c"fast".as_ptr()), EMUHOST_ERROR_SETTING, "\"fast\"");
        fails(emuhost_settings_set(st, c"EMUHOST_WATCH".as_ptr(), null()), EMUHOST_ERROR_NULL, "value is NULL");
        let bad = [0xffu8, 0];
        fails(
            emuhost_settings_set(st, bad.as_ptr().cast(), c"1".as_ptr()),
            EMUHOST_ERROR_INVALID_ARGUMENT,
            "not UTF-8",
        );
        // A setting reaches what is made with it: the tracker's backend.
        ok(emuhost_settings_set(st, c"EMUHOST_WATCH".as_ptr(), PROTECTION.1.as_ptr()));
        let s = space(4);
        let mut t = null_mut();
        ok(emuhost_tracker_new(s, st, EMUHOST_WATCH_AUTO, 0, &mut t));
        let mut backend = 0;
        ok(emuhost_tracker_backend(t, &mut backend));
        assert_eq!(backend, PROTECTION.0);
        // One tracker per space.
        let mut t2 = null_mut();
        fails(emuhost_tracker_new(s, st, PROTECTION.0, 0, &mut t2), EMUHOST_ERROR_REFUSED, "one tracker per space");
        ok(emuhost_tracker_delete(t));
        ok(emuhost_space_delete(s));
        // The sleep switch reaches the sleeper's rule.
        ok(emuhost_settings_set(st, c"EMUHOST_SHORT_SLEEP_TIMER".as_ptr(), c"off".as_ptr()));
        let mut sl = null_mut();
        ok(emuhost_sleeper_new(st, &mut sl));
        let mut rule = emuhost_sleep_rule_t::default();
        let mut why = [0 as c_char; 16];
        let mut len = 0;
        ok(emuhost_sleeper_rule(sl, &mut rule, why.as_mut_ptr(), why.len(), &mut len));
        assert_eq!((rule.guest, rule.host), (EMUHOST_WAIT_YIELD, EMUHOST_WAIT_YIELD));
        // Cut to the buffer, NUL-terminated, with the full length given.
        let cut = CStr::from_ptr(why.as_ptr()).to_str().unwrap();
        assert_eq!(cut.len(), 15);
        assert!(len > 15 && "EMUHOST_SHORT_SLEEP_TIMER".starts_with(cut), "{cut:?} {len}");
        let t0 = std::time::Instant::now();
        ok(emuhost_sleeper_sleep(sl, EMUHOST_CALLER_GUEST, 20_000));
        assert!(t0.elapsed() >= std::time::Duration::from_micros(20));
        fails(emuhost_sleeper_sleep(sl, 2, 1), EMUHOST_ERROR_INVALID_ARGUMENT, "caller 2");
        ok(emuhost_sleeper_delete(sl));
        ok(emuhost_settings_delete(st));
    }
}

#[test]
fn sections_map_views_that_alias() {
    let p = page();
    let s = space(16);
    // SAFETY: out-pointers and buffers are locals with their lengths.
    unsafe {
        let mut id = 0;
        ok(emuhost_space_create_section(s, 4 * p, &mut id));
        let first = emuhost_space_map_section(s, 0, p, id, 0, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE);
        // Windows without placeholders (before 10 1803, Wine 8) has no shared views: a code of
        // its own (not OS) that says why, and the space is as it was.
        if cfg!(windows) && !first.is_null() && emuhost_error_code(first) == EMUHOST_ERROR_UNAVAILABLE {
            let message = fails(first, EMUHOST_ERROR_UNAVAILABLE, "shared views need placeholders");
            let mut n = 1;
            ok(emuhost_space_views(s, 0, 16 * p, null_mut(), 0, &mut n));
            assert_eq!(n, 0);
            ok(emuhost_space_destroy_section(s, id));
            ok(emuhost_space_delete(s));
            println!("skipped: {message}");
            return;
        }
        ok(first);
        let mut views = 0;
        let pages = [0u64, 1, 3];
        ok(emuhost_space_map_pages(
            s,
            8 * p,
            id,
            pages.as_ptr(),
            3,
            EMUHOST_PROT_READ | EMUHOST_PROT_WRITE,
            &mut views,
        ));
        assert_eq!(views, 2);
        ok(emuhost_space_write(s, 8, b"alias".as_ptr().cast(), 5));
        let mut back = [0u8; 5];
        ok(emuhost_space_read(s, 8 * p + 8, back.as_mut_ptr().cast(), 5));
        assert_eq!(&back, b"alias");
        let mut out = [emuhost_view_t::default(); 2];
        let mut n = 0;
        ok(emuhost_space_views(s, 0, 16 * p, out.as_mut_ptr(), 2, &mut n));
        assert_eq!(n, 3, "three views, two returned");
        assert_eq!(out[1], emuhost_view_t { addr: 8 * p, len: 2 * p, section: id, offset: 0 });
        fails(
            emuhost_space_map_section(s, 0, p, id, 4 * p, EMUHOST_PROT_READ),
            EMUHOST_ERROR_OUT_OF_RANGE,
            "past its end",
        );
        fails(
            emuhost_space_map_section(s, 0, p, id + 1, 0, EMUHOST_PROT_READ),
            EMUHOST_ERROR_INVALID_ARGUMENT,
            "does not exist",
        );
        ok(emuhost_space_commit(s, 4 * p, 2 * p, EMUHOST_PROT_READ));
        let mut allocs = [emuhost_allocation_t::default(); 4];
        ok(emuhost_space_allocations(s, 0, 16 * p, allocs.as_mut_ptr(), 4, &mut n));
        assert_eq!((n, allocs[0].addr, allocs[0].len), (1, 4 * p, 2 * p));
        ok(emuhost_space_decommit(s, 4 * p, p));
        ok(emuhost_space_allocations(s, 0, 16 * p, null_mut(), 0, &mut n));
        assert_eq!(n, 1);
        ok(emuhost_space_destroy_section(s, id));
        fails(emuhost_space_destroy_section(s, id), EMUHOST_ERROR_INVALID_ARGUMENT, "does not exist");
        ok(emuhost_space_delete(s));
    }
}

/// An importer on `s` with the pin backend and `more` switches.
pub(crate) fn pin_importer(s: *mut emuhost_space_t, more: &[(&CStr, &CStr)]) -> *mut emuhost_importer_t {
    let mut st = null_mut();
    let mut imp = null_mut();
    // SAFETY: out-pointers are locals; NUL-terminated strings.
    unsafe {
        ok(emuhost_settings_new(&mut st));
        ok(emuhost_settings_set(st, c"EMUHOST_IMPORT_BACKEND".as_ptr(), c"pin".as_ptr()));
        for (k, v) in more {
            ok(emuhost_settings_set(st, k.as_ptr(), v.as_ptr()));
        }
        ok(emuhost_importer_new(s, st, &mut imp));
        ok(emuhost_settings_delete(st));
    }
    imp
}

#[test]
fn an_importer_binds_pools_and_counts() {
    let p = page();
    let s = space(4096);
    // SAFETY: out-pointers are locals; NUL-terminated literals.
    unsafe {
        let imp = pin_importer(s, &[(c"EMUHOST_IMPORT_CHUNK_MB", c"1")]);
        let mut gpu = 9;
        let mut len = 0;
        ok(emuhost_importer_backend(imp, &mut gpu, null_mut(), 0, &mut len));
        assert_eq!(gpu, EMUHOST_GPU_NONE);
        assert!(len > 0);
        ok(emuhost_space_commit(s, 0, 512 * p, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
        let mut pool = 0;
        ok(emuhost_importer_add_pool(imp, 0, 64 * p, &mut pool));
        let mut b = emuhost_binding_t::default();
        ok(emuhost_importer_bind(imp, 4 * p, p, &mut b));
        assert!(b.made && b.import_lo == 0 && b.offset == 4 * p, "{b:?}");
        ok(emuhost_importer_bind(imp, 5 * p, p, &mut b));
        assert!(!b.made);
        let mut stats = emuhost_import_stats_t::default();
        ok(emuhost_importer_stats(imp, &mut stats));
        assert_eq!((stats.imports, stats.reuses, stats.live), (1, 1, 1));
        fails(emuhost_importer_bind(imp, 0, 0, &mut b), EMUHOST_ERROR_INVALID_ARGUMENT, "zero size");
        // The import holds its pages: a decommit under it is refused.
        fails(emuhost_space_decommit(s, 0, p), EMUHOST_ERROR_REFUSED, "held");
        ok(emuhost_importer_remove_pool(imp, pool));
        fails(emuhost_importer_remove_pool(imp, pool), EMUHOST_ERROR_INVALID_ARGUMENT, "not a live pool");
        ok(emuhost_importer_release_all(imp));
        ok(emuhost_space_decommit(s, 0, p));
        ok(emuhost_importer_delete(imp));
        ok(emuhost_space_delete(s));
    }
}

/// A long read the caller marks (its own driver's pin of guest memory) holds a commit back until
/// it ends; none is given while a change is marked (`*out` is NULL); one ended twice is a stale
/// handle.
#[test]
fn a_long_read_the_caller_marks_holds_a_commit_back() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let p = page();
    let s = space(64);
    // SAFETY: out-pointers are locals; `s` lives until the end, and the thread is joined before.
    unsafe {
        let mut read = null_mut();
        ok(emuhost_space_long_read_begin(s, &mut read));
        assert!(!read.is_null());
        let ended = Arc::new(AtomicBool::new(false));
        let (addr, seen) = (s as usize, ended.clone());
        let committer = std::thread::spawn(move || {
            // The space lives until the thread is joined.
            let s = addr as *mut emuhost_space_t;
            ok(emuhost_space_commit(s, 0, p, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
            seen.load(Ordering::SeqCst)
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        ended.store(true, Ordering::SeqCst);
        ok(emuhost_long_read_end(read));
        assert!(committer.join().unwrap(), "the commit returned before the long read ended");
        fails(emuhost_long_read_end(read), EMUHOST_ERROR_BAD_HANDLE, "");
        let mut change = null_mut();
        ok(emuhost_space_change_begin(s, &mut change));
        let mut refused = std::ptr::NonNull::<emuhost_long_read_t>::dangling().as_ptr();
        ok(emuhost_space_long_read_begin(s, &mut refused));
        assert!(refused.is_null(), "no long read while a change is marked");
        ok(emuhost_change_end(change));
        let mut again = null_mut();
        ok(emuhost_space_long_read_begin(s, &mut again));
        assert!(!again.is_null());
        ok(emuhost_long_read_end(again));
        fails(emuhost_space_long_read_begin(s, null_mut()), EMUHOST_ERROR_NULL, "out-pointer");
        ok(emuhost_long_read_end(null_mut()));
        ok(emuhost_space_delete(s));
    }
}

/// While the caller marks a change of its own in flight, the importer's background threads
/// import nothing ahead; once it ends, they do. A change ended twice is a stale handle. (Imports
/// ahead are the pools policy's, named here: Windows' default is chunks.)
#[test]
fn a_change_the_caller_marks_holds_the_background_imports_back() {
    let p = page();
    let s = space(4096);
    let imports = |imp| {
        let mut stats = emuhost_import_stats_t::default();
        // SAFETY: the out-pointer is a local.
        ok(unsafe { emuhost_importer_stats(imp, &mut stats) });
        stats.imports
    };
    // SAFETY: out-pointers are locals; NUL-terminated literals.
    unsafe {
        let imp = pin_importer(s, &[(c"EMUHOST_IMPORT_POLICY", c"pools")]);
        ok(emuhost_space_commit(s, 0, 512 * p, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
        let mut pool = 0;
        ok(emuhost_importer_add_pool(imp, 0, 16 * p, &mut pool));
        let mut b = emuhost_binding_t::default();
        ok(emuhost_importer_bind(imp, p, p, &mut b));
        assert_eq!(imports(imp), 1);
        let mut change = null_mut();
        ok(emuhost_space_change_begin(s, &mut change));
        // A pool where a binding came: imported ahead, but not while the change is marked.
        ok(emuhost_importer_add_pool(imp, 32 * p, 16 * p, &mut pool));
        std::thread::sleep(std::time::Duration::from_millis(100));
        let meanwhile = imports(imp);
        ok(emuhost_change_end(change));
        fails(emuhost_change_end(change), EMUHOST_ERROR_BAD_HANDLE, "");
        let start = std::time::Instant::now();
        while imports(imp) < 2 && start.elapsed() < std::time::Duration::from_secs(20) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!((meanwhile, imports(imp)), (1, 2));
        fails(emuhost_space_change_begin(s, null_mut()), EMUHOST_ERROR_NULL, "out-pointer");
        ok(emuhost_change_end(null_mut()));
        ok(emuhost_importer_delete(imp));
        ok(emuhost_space_delete(s));
    }
}

/// A panic inside the runtime (injected in `Space::commit`) comes back as an error, and the space
/// still works afterwards.
#[cfg(feature = "faults")]
#[test]
fn a_panic_inside_emuhost_comes_back_as_an_error() {
    use emuhost::faults::{Plan, scoped};
    let p = page();
    let s = space(4);
    let scope = scoped(Plan { panic_commit: true, ..Plan::default() });
    fails(
        emuhost_space_commit(s, 0, p, EMUHOST_PROT_READ),
        EMUHOST_ERROR_PANIC,
        "fault injected: a panic in Space::commit",
    );
    drop(scope);
    ok(emuhost_space_commit(s, 0, p, EMUHOST_PROT_READ));
    ok(emuhost_space_delete(s));
}

// The caller's reservation is made with libc's mmap; the Windows twin is below.
#[cfg(target_os = "linux")]
#[test]
fn an_adopted_window_goes_back_to_the_caller_reserved() {
    let p = page();
    let len = 16 * p;
    // SAFETY: a fresh anonymous reservation the test owns and unmaps at the end.
    let base = unsafe {
        libc::mmap(
            null_mut(),
            len as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    // SAFETY: the reservation is the test's; nothing else maps in it while the space lives.
    unsafe {
        let mut s = null_mut();
        ok(emuhost_space_adopt(base, len, &mut s));
        let mut info = std::mem::zeroed::<emuhost_space_info_t>();
        ok(emuhost_space_info(s, &mut info));
        assert!(info.adopted && info.host_base == base && info.window == len && info.guard == 0);
        ok(emuhost_space_commit(s, 0, 2 * p, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
        *base.cast::<u8>() = 9;
        ok(emuhost_space_delete(s));
        // Still mapped (reserved): a window cannot be reserved over it.
        let mut again = null_mut();
        fails(emuhost_space_reserve_at(base, len, 0, &mut again), EMUHOST_ERROR_EXISTS, "is mapped there");
        assert_eq!(libc::munmap(base, len as usize), 0);
        // Unmapped now: not a reservation to adopt.
        fails(emuhost_space_adopt(base, len, &mut again), EMUHOST_ERROR_REFUSED, "adopting host range");
    }
}

/// The Windows twin of the test above: the caller's reservation is `VirtualAlloc(MEM_RESERVE)`;
/// a tracker over it is the guard (write watch cannot see memory emuhost did not allocate), and
/// shared views there are `UNAVAILABLE`, saying why.
#[cfg(windows)]
#[test]
fn an_adopted_window_goes_back_to_the_caller_reserved() {
    use windows_sys::Win32::System::Memory::{MEM_RELEASE, MEM_RESERVE, PAGE_NOACCESS, VirtualAlloc, VirtualFree};
    let p = page();
    let len = 16 * p;
    // SAFETY: a fresh reservation the test owns and releases at the end.
    let base = unsafe { VirtualAlloc(null(), len as usize, MEM_RESERVE, PAGE_NOACCESS) };
    assert!(!base.is_null());
    // SAFETY: the reservation is the test's; nothing else maps in it while the space lives.
    unsafe {
        let mut s = null_mut();
        ok(emuhost_space_adopt(base, len, &mut s));
        let mut info = std::mem::zeroed::<emuhost_space_info_t>();
        ok(emuhost_space_info(s, &mut info));
        assert!(info.adopted && info.host_base == base && info.window == len && info.guard == 0);
        ok(emuhost_space_commit(s, 0, 2 * p, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
        let mut t = null_mut();
        ok(emuhost_tracker_new(s, null(), EMUHOST_WATCH_AUTO, 0, &mut t));
        let mut kind = 0;
        ok(emuhost_tracker_backend(t, &mut kind));
        assert_eq!(kind, EMUHOST_WATCH_GUARD);
        ok(emuhost_tracker_arm(t, 0, 2 * p));
        std::ptr::write_volatile(base.cast::<u8>().add(p as usize), 9);
        let mut out = [0u64; 16];
        let mut r = emuhost_collect_t::default();
        ok(emuhost_tracker_collect(t, 0, len, out.as_mut_ptr(), out.len(), &mut r));
        assert_eq!(out[..r.pages], [p]);
        ok(emuhost_tracker_delete(t));
        let mut id = 0;
        ok(emuhost_space_create_section(s, p, &mut id));
        fails(emuhost_space_map_section(s, 4 * p, p, id, 0, EMUHOST_PROT_READ), EMUHOST_ERROR_UNAVAILABLE, "adopted");
        ok(emuhost_space_delete(s));
        // Still reserved: a window cannot be reserved over it.
        let mut again = null_mut();
        fails(emuhost_space_reserve_at(base, len, 0, &mut again), EMUHOST_ERROR_EXISTS, "");
        assert_ne!(VirtualFree(base, 0, MEM_RELEASE), 0);
        // Released now: not a reservation to adopt.
        fails(emuhost_space_adopt(base, len, &mut again), EMUHOST_ERROR_REFUSED, "adopting host range");
    }
}

/// The other platform's backends are `UNAVAILABLE` by name, never a crash.
#[test]
fn a_backend_of_the_other_platform_is_unavailable() {
    let s = space(4);
    let mut t = null_mut();
    #[cfg(windows)]
    let others = [(EMUHOST_WATCH_UFFD, "uffd"), (EMUHOST_WATCH_MPROTECT, "mprotect")];
    #[cfg(not(windows))]
    let others = [(EMUHOST_WATCH_WRITEWATCH, "writewatch"), (EMUHOST_WATCH_GUARD, "guard")];
    for (backend, name) in others {
        // SAFETY: an out-pointer to a local.
        fails(unsafe { emuhost_tracker_new(s, null(), backend, 0, &mut t) }, EMUHOST_ERROR_UNAVAILABLE, name);
        assert!(t.is_null());
    }
    ok(emuhost_space_delete(s));
}

#[test]
fn protect_zero_populate_and_commit_reserved() {
    let p = page();
    let s = space(8);
    // SAFETY: out-pointers and buffers are locals with their lengths.
    unsafe {
        let rw = EMUHOST_PROT_READ | EMUHOST_PROT_WRITE;
        ok(emuhost_space_commit(s, 0, 2 * p, rw));
        let mut n = 0;
        ok(emuhost_space_commit_reserved(s, 0, 4 * p, rw, &mut n));
        assert_eq!(n, 2 * p, "only the two reserved pages");
        ok(emuhost_space_populate(s, 0, 4 * p));
        ok(emuhost_space_write(s, 16, b"bytes".as_ptr().cast(), 5));
        ok(emuhost_space_zero(s, 0, p));
        let mut back = [1u8; 5];
        ok(emuhost_space_read(s, 16, back.as_mut_ptr().cast(), 5));
        assert_eq!(back, [0; 5]);
        ok(emuhost_space_protect(s, 0, p, EMUHOST_PROT_READ));
        fails(emuhost_space_write(s, 16, b"x".as_ptr().cast(), 1), EMUHOST_ERROR_PROTECTION, "are r--");
        fails(emuhost_space_protect(s, 8 * p, p, EMUHOST_PROT_READ), EMUHOST_ERROR_OUT_OF_RANGE, "outside");
        ok(emuhost_space_delete(s));
    }
}

#[test]
fn importers_on_callers_objects_refuse_null_ones() {
    let s = space(16);
    let mut imp = null_mut();
    // SAFETY: NULL and zeroed descriptions, which the calls check before any use.
    unsafe {
        fails(emuhost_importer_new_cuda(s, null(), null_mut(), &mut imp), EMUHOST_ERROR_UNAVAILABLE, "");
        fails(emuhost_importer_new_vulkan(s, null(), null(), &mut imp), EMUHOST_ERROR_NULL, "device is NULL");
        let dev = emuhost_vulkan_device_t {
            get_instance_proc_addr: None,
            instance: null_mut(),
            physical_device: null_mut(),
            device: null_mut(),
            enabled_extensions: null(),
            enabled_extension_count: 0,
            buffer_usage: 0,
        };
        fails(emuhost_importer_new_vulkan(s, null(), &dev, &mut imp), EMUHOST_ERROR_NULL, "get_instance_proc_addr");
    }
    assert!(imp.is_null());
    ok(emuhost_space_delete(s));
}

#[test]
fn fault_switches_are_installed_once() {
    let mut st = null_mut();
    // SAFETY: out-pointers to locals; NUL-terminated literals.
    unsafe {
        ok(emuhost_settings_new(&mut st));
        // No fault: the process's plan is fixed as none.
        ok(emuhost_settings_install_faults(st));
        let e = emuhost_settings_set(st, c"EMUHOST_FAULT_UFFD".as_ptr(), c"eperm".as_ptr());
        if cfg!(feature = "faults") {
            ok(e);
            fails(emuhost_settings_install_faults(st), EMUHOST_ERROR_REFUSED, "fixed already");
        } else {
            fails(e, EMUHOST_ERROR_SETTING, "no fault injection");
        }
        ok(emuhost_settings_delete(st));
    }
}

/// Issue 33, item 11: caller mistakes have codes of their own, not `EMUHOST_ERROR_OS` with errno
/// text (nor OK, nor REFUSED): a pool or binding outside the window (`OUT_OF_RANGE`), a zero,
/// populate, read or write over pages not committed and a binding over them (`NOT_COMMITTED`), a
/// write to read-only pages (`PROTECTION`), a window reserved over a mapping (`EXISTS`).
#[test]
fn caller_mistakes_have_codes_of_their_own() {
    let p = page();
    let s = space(4096);
    // SAFETY: out-pointers and buffers are locals with their lengths.
    unsafe {
        let rw = EMUHOST_PROT_READ | EMUHOST_PROT_WRITE;
        ok(emuhost_space_commit(s, 0, 512 * p, rw));
        ok(emuhost_space_protect(s, 8 * p, p, EMUHOST_PROT_READ));
        let nc = EMUHOST_ERROR_NOT_COMMITTED;
        fails(emuhost_space_zero(s, 512 * p, p), nc, "not committed");
        fails(emuhost_space_populate(s, 511 * p, 2 * p), nc, "not committed");
        let mut buf = [0u8; 8];
        fails(emuhost_space_read(s, 512 * p - 4, buf.as_mut_ptr().cast(), 8), nc, "not committed");
        fails(emuhost_space_write(s, 600 * p, buf.as_ptr().cast(), 8), nc, "not committed");
        fails(emuhost_space_write(s, 8 * p + 1, buf.as_ptr().cast(), 8), EMUHOST_ERROR_PROTECTION, "are r--");
        let imp = pin_importer(s, &[(c"EMUHOST_IMPORT_CHUNK_MB", c"1")]);
        let mut pool = 0;
        fails(emuhost_importer_add_pool(imp, 4095 * p, 2 * p, &mut pool), EMUHOST_ERROR_OUT_OF_RANGE, "outside");
        let mut b = emuhost_binding_t::default();
        fails(emuhost_importer_bind(imp, 4096 * p, 16, &mut b), EMUHOST_ERROR_OUT_OF_RANGE, "outside");
        fails(emuhost_importer_bind(imp, 600 * p, 16, &mut b), nc, "not committed");
        let mut stats = emuhost_import_stats_t::default();
        ok(emuhost_importer_stats(imp, &mut stats));
        assert_eq!((stats.imports, stats.live), (0, 0), "nothing imported");
        ok(emuhost_importer_bind(imp, 4 * p, 16, &mut b));
        ok(emuhost_importer_delete(imp));
        let mut info = std::mem::zeroed::<emuhost_space_info_t>();
        ok(emuhost_space_info(s, &mut info));
        let mut again = null_mut();
        let e = emuhost_space_reserve_at(info.host_base, 16 * p, 0, &mut again);
        fails(e, EMUHOST_ERROR_EXISTS, "is mapped there");
        assert!(again.is_null());
        ok(emuhost_space_delete(s));
    }
}

/// A fault handle is checked as every handle is, with atomics only (it is used from a signal
/// handler): deleted twice, or another kind of handle or a made-up value passed as one, it takes
/// no fault and its delete says false; a live one hands its tracker's fault over.
#[test]
fn fault_handles_are_checked_deleted_twice_or_mistyped() {
    let p = page();
    let s = space(4);
    let mut t = null_mut();
    // SAFETY: out-pointers are locals; the fault is handed over by a direct call (no signal).
    unsafe {
        ok(emuhost_space_commit(s, 0, 4 * p, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
        ok(emuhost_tracker_new(s, null(), PROTECTION.0, 0, &mut t));
        let mut info = std::mem::zeroed::<emuhost_space_info_t>();
        ok(emuhost_space_info(s, &mut info));
        ok(emuhost_tracker_arm(t, 0, 4 * p));
        let mut fh = null_mut();
        ok(emuhost_tracker_fault_handle(t, &mut fh));
        let mut other = null_mut();
        ok(emuhost_tracker_fault_handle(t, &mut other));
        assert_ne!(fh, other, "each call gives its own handle");
        let at = info.host_base.addr() + 2 * p as usize;
        // A handle of another kind, a made-up value, a pointer to the caller's own memory: no
        // fault taken, nothing read through them.
        let local = [0u64; 8];
        for bogus in [t.addr(), s.addr(), 0xdead_0000, 0xdead_0009, usize::MAX, local.as_ptr().addr()] {
            let h = std::ptr::without_provenance::<emuhost_fault_handle_t>(bogus);
            assert_eq!(emuhost_fault_handle_handle(h, at, 1), 0, "{bogus:#x} taken as a fault handle");
            assert!(!emuhost_fault_handle_delete(h.cast_mut()), "{bogus:#x} deleted as a fault handle");
        }
        assert_eq!(emuhost_fault_handle_handle(fh, at, 0), 0, "a read fault is not the tracker's");
        assert_eq!(emuhost_fault_handle_handle(fh, at, 1), 1, "the armed page's write fault");
        // The tracker survived being passed as a fault handle, and the handed fault is a write.
        let mut pages = [0u64; 4];
        let mut r = emuhost_collect_t::default();
        ok(emuhost_tracker_collect(t, 0, 4 * p, pages.as_mut_ptr(), 4, &mut r));
        assert_eq!(&pages[..r.pages], &[2 * p]);
        // Deleted once: true; twice: false, and nothing else changes (the other handle works).
        assert!(emuhost_fault_handle_delete(fh));
        assert!(!emuhost_fault_handle_delete(fh));
        assert_eq!(emuhost_fault_handle_handle(fh, at, 1), 0, "a deleted handle took a fault");
        assert_eq!(emuhost_fault_handle_handle(other, at, 1), 1);
        // A new handle may take the freed slot: the old value still says no.
        let mut again = null_mut();
        ok(emuhost_tracker_fault_handle(t, &mut again));
        assert_ne!(again, fh);
        assert_eq!(emuhost_fault_handle_handle(fh, at, 1), 0);
        assert!(!emuhost_fault_handle_delete(fh));
        // A fault handle passed as another kind of handle is a stale handle too.
        fails(emuhost_tracker_arm(again.cast(), 0, p), EMUHOST_ERROR_BAD_HANDLE, "not a live tracker");
        assert!(emuhost_fault_handle_delete(again) && emuhost_fault_handle_delete(other));
        assert!(emuhost_fault_handle_delete(null_mut()), "NULL is nothing to delete");
        // The table is fixed: past its size a new handle is refused, and a delete makes room.
        let mut live = Vec::new();
        let refused = loop {
            let mut h = null_mut();
            match outcome(emuhost_tracker_fault_handle(t, &mut h)) {
                None => live.push(h),
                Some(e) => break e,
            }
            assert!(live.len() <= EMUHOST_FAULT_HANDLES_MAX as usize);
        };
        assert_eq!(refused.0, EMUHOST_ERROR_REFUSED, "{}", refused.1);
        assert!(refused.1.contains("EMUHOST_FAULT_HANDLES_MAX"), "{}", refused.1);
        assert!(emuhost_fault_handle_delete(live.pop().unwrap()));
        let mut h = null_mut();
        ok(emuhost_tracker_fault_handle(t, &mut h));
        live.push(h);
        assert!(live.into_iter().all(|h| emuhost_fault_handle_delete(h)));
        ok(emuhost_tracker_delete(t));
        ok(emuhost_space_delete(s));
    }
}

/// A sleep longer than `EMUHOST_SLEEP_MAX_NS` (a negative count cast to unsigned, most often)
/// is an error naming it and the bound, at once; it does not sleep for centuries. A watchdog
/// fails the test where the call sleeps instead.
#[test]
fn a_sleep_past_the_bound_is_an_error_not_centuries() {
    let mut sl = null_mut();
    // SAFETY: an out-pointer to a local.
    unsafe { ok(emuhost_sleeper_new(null(), &mut sl)) };
    let addr = sl as usize;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let sl = addr as *const emuhost_sleeper_t;
        let mut got = Vec::new();
        for (caller, ns) in [
            (EMUHOST_CALLER_GUEST, u64::MAX),
            (EMUHOST_CALLER_HOST, -1_000_000i64 as u64),
            (EMUHOST_CALLER_GUEST, EMUHOST_SLEEP_MAX_NS + 1),
        ] {
            got.push((ns, outcome(emuhost_sleeper_sleep(sl, caller, ns))));
        }
        let _ = tx.send(got);
    });
    let got = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("a huge sleep slept (60 s and counting)");
    for (ns, outcome) in got {
        let (code, message) = outcome.unwrap_or_else(|| panic!("a sleep of {ns} ns succeeded"));
        assert_eq!(code, EMUHOST_ERROR_INVALID_ARGUMENT, "{message}");
        assert!(
            message.contains(&ns.to_string()) && message.contains("EMUHOST_SLEEP_MAX_NS (1000000000 ns"),
            "{message}"
        );
    }
    ok(emuhost_sleeper_delete(sl));
}

/// `read(2)` from a pipe into `len` bytes at `at`: the bytes read, or the OS error.
#[cfg(target_os = "linux")]
fn read_pipe_into(at: *mut u8, len: usize, fill: u8) -> std::io::Result<usize> {
    let mut fds = [0; 2];
    // SAFETY: a fresh pipe the function owns and closes; `at` is memory the caller vouches for
    // (the kernel checks its access: a page it may not write is EFAULT, not a fault).
    unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        let data = vec![fill; len];
        assert_eq!(libc::write(fds[1], data.as_ptr().cast(), len), len as isize);
        let n = libc::read(fds[0], at.cast(), len);
        let result = if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) };
        libc::close(fds[0]);
        libc::close(fds[1]);
        result
    }
}

/// `ReadFile` from an anonymous pipe into `len` bytes at `at`: the bytes read, or the OS error.
#[cfg(windows)]
fn read_pipe_into(at: *mut u8, len: usize, fill: u8) -> std::io::Result<usize> {
    use windows_sys::Win32::Foundation::{CloseHandle, HANDLE};
    use windows_sys::Win32::Storage::FileSystem::{ReadFile, WriteFile};
    use windows_sys::Win32::System::Pipes::CreatePipe;
    let (mut r, mut w): (HANDLE, HANDLE) = (null_mut(), null_mut());
    let data = vec![fill; len];
    // SAFETY: a fresh pipe the function owns and closes; `at` is memory the caller vouches for
    // (the kernel checks its access: a page it may not write is ERROR_NOACCESS, not a fault).
    unsafe {
        assert_ne!(CreatePipe(&mut r, &mut w, null(), len as u32), 0);
        let mut n = 0;
        assert_ne!(WriteFile(w, data.as_ptr(), len as u32, &mut n, null_mut()), 0);
        assert_eq!(n as usize, len);
        let ok = ReadFile(r, at, len as u32, &mut n, null_mut()) != 0;
        let result = if ok { Ok(n as usize) } else { Err(std::io::Error::last_os_error()) };
        CloseHandle(r);
        CloseHandle(w);
        result
    }
}

/// What the kernel's write into a page the protection backend armed fails with: `EFAULT`; on
/// Windows `ERROR_NOACCESS`.
#[cfg(target_os = "linux")]
const KERNEL_WRITE_REFUSED: i32 = libc::EFAULT;
/// What the kernel's write into a page the protection backend armed fails with: `EFAULT`; on
/// Windows `ERROR_NOACCESS`.
#[cfg(windows)]
const KERNEL_WRITE_REFUSED: i32 = windows_sys::Win32::Foundation::ERROR_NOACCESS as i32;

/// The pages a collect of the first `pages` pages reports.
fn collected(t: *const emuhost_tracker_t, pages: u64) -> Vec<u64> {
    let mut out = vec![0u64; pages as usize];
    let mut r = emuhost_collect_t::default();
    // SAFETY: room for every page of the range; a local result.
    ok(unsafe { emuhost_tracker_collect(t, 0, pages * page(), out.as_mut_ptr(), out.len(), &mut r) });
    out.truncate(r.pages);
    out
}

/// The embedder's own kernel write into armed memory (a `read(2)` from a pipe; on Windows a
/// `ReadFile`) between `emuhost_tracker_host_write_begin` and `emuhost_host_write_end`: with the
/// protection backend (mprotect; guard) it fails (EFAULT; ERROR_NOACCESS) without them, succeeds
/// with them, and the next collect reports its pages.
#[test]
fn a_read_into_armed_memory_between_host_write_begin_and_end() {
    let p = page();
    for backend in [PROTECTION.0, EMUHOST_WATCH_AUTO] {
        let s = space(16);
        let mut t = null_mut();
        // SAFETY: out-pointers are locals; the reads go to the space's committed pages.
        unsafe {
            ok(emuhost_space_commit(s, 0, 16 * p, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
            ok(emuhost_tracker_new(s, null(), backend, 0, &mut t));
            let mut info = std::mem::zeroed::<emuhost_space_info_t>();
            ok(emuhost_space_info(s, &mut info));
            let mut kind = 0;
            ok(emuhost_tracker_backend(t, &mut kind));
            ok(emuhost_tracker_arm(t, 0, 16 * p));
            let at = info.host_base.cast::<u8>().add(4 * p as usize);
            if kind == PROTECTION.0 {
                let e = read_pipe_into(at, 2 * p as usize, 1).expect_err("a read into armed pages");
                assert_eq!(e.raw_os_error(), Some(KERNEL_WRITE_REFUSED), "{e}");
            }
            let mut w = null_mut();
            ok(emuhost_tracker_host_write_begin(t, 4 * p, 2 * p, &mut w));
            assert_eq!(read_pipe_into(at, 2 * p as usize, 7).expect("the read between begin and end"), 2 * p as usize);
            ok(emuhost_host_write_end(w));
            assert_eq!((*at, *at.add(2 * p as usize - 1)), (7, 7));
            assert_eq!(collected(t, 16), [4 * p, 5 * p], "backend {kind}");
            // Armed again after the end: a later guest write is reported as usual.
            std::ptr::write_volatile(at, 9);
            assert_eq!(collected(t, 16), [4 * p], "backend {kind}");
            // A collect between the begin and the write reports the pages and leaves them
            // writable; the write after it is reported by the first collect after the end.
            // (With uffd or writewatch nothing is prepared, so nothing is reported before the
            // write.)
            ok(emuhost_tracker_host_write_begin(t, 4 * p, 2 * p, &mut w));
            let before: &[u64] = if kind == PROTECTION.0 { &[4 * p, 5 * p] } else { &[] };
            assert_eq!(collected(t, 16), before, "backend {kind}");
            assert_eq!(read_pipe_into(at, p as usize, 8).expect("the read after a collect"), p as usize);
            ok(emuhost_host_write_end(w));
            assert_eq!(collected(t, 16)[..1], [4 * p], "backend {kind}");
            // Misuse: ended twice, a range past the window, a NULL out-pointer.
            fails(emuhost_host_write_end(w), EMUHOST_ERROR_BAD_HANDLE, "not a live host write");
            ok(emuhost_host_write_end(null_mut()));
            fails(emuhost_tracker_host_write_begin(t, 15 * p, 2 * p, &mut w), EMUHOST_ERROR_OUT_OF_RANGE, "outside");
            fails(emuhost_tracker_host_write_begin(t, 0, p, null_mut()), EMUHOST_ERROR_NULL, "out-pointer");
            // A host write keeps its tracker: deleted meanwhile, the end still arms again.
            ok(emuhost_tracker_host_write_begin(t, 0, p, &mut w));
            ok(emuhost_tracker_delete(t));
            ok(emuhost_host_write_end(w));
            ok(emuhost_space_delete(s));
        }
    }
}

/// The hybrid wait (a timer wait, then yields) as the host's exact wait, chosen from C.
#[test]
fn a_sleeper_with_the_hybrid_as_the_hosts_exact_wait() {
    let mut sl = null_mut();
    // SAFETY: out-pointers to locals.
    unsafe {
        ok(emuhost_sleeper_new_host_wait(null(), EMUHOST_WAIT_HYBRID, &mut sl));
        let mut rule = emuhost_sleep_rule_t::default();
        ok(emuhost_sleeper_rule(sl, &mut rule, null_mut(), 0, null_mut()));
        assert_eq!(rule.host, EMUHOST_WAIT_HYBRID);
        for ns in [200_000, 2_000_000] {
            let t0 = std::time::Instant::now();
            ok(emuhost_sleeper_sleep(sl, EMUHOST_CALLER_HOST, ns));
            assert!(t0.elapsed() >= std::time::Duration::from_nanos(ns));
        }
        ok(emuhost_sleeper_delete(sl));
        let mut bad = null_mut();
        fails(emuhost_sleeper_new_host_wait(null(), 3, &mut bad), EMUHOST_ERROR_INVALID_ARGUMENT, "host wait 3");
        assert!(bad.is_null());
        fails(
            emuhost_sleeper_new_host_wait(null(), EMUHOST_WAIT_HYBRID, null_mut()),
            EMUHOST_ERROR_NULL,
            "out-pointer",
        );
    }
}

/// Pools policy through the C ABI: a pool whole in a binding's part and the background thread's
/// pieces is merged into one import once the live imports are at half the cap; the stats report
/// the merge and the cap, and the part (given to the binding) goes at
/// `emuhost_importer_handles_done`, not before.
#[test]
fn a_merged_away_part_goes_at_handles_done() {
    const MIB: u64 = 1 << 20;
    let p = page();
    let s = space(16 * MIB / p);
    // SAFETY: out-pointers are locals; NUL-terminated literals.
    unsafe {
        // 1 ms a MiB: a 2 MiB pool does not fit the 400 us wait, so the binding imports a part.
        let imp = pin_importer(
            s,
            &[
                (c"EMUHOST_IMPORT_POLICY", c"pools"),
                (c"EMUHOST_IMPORT_CHUNK_MB", c"1"),
                (c"EMUHOST_IMPORT_AHEAD_MB", c"0"),
                (c"EMUHOST_IMPORT_AHEAD_THREADS", c"1"),
                (c"EMUHOST_IMPORT_AHEAD_PIECE_KB", c"64"),
                (c"EMUHOST_IMPORT_COST_US", c"100,1000,1000"),
                (c"EMUHOST_IMPORT_MAX_LIVE", c"48"),
            ],
        );
        ok(emuhost_space_commit(s, 0, 8 * MIB, EMUHOST_PROT_READ | EMUHOST_PROT_WRITE));
        let mut pool = 0;
        ok(emuhost_importer_add_pool(imp, 4 * MIB, 2 * MIB, &mut pool));
        let mut part = emuhost_binding_t::default();
        ok(emuhost_importer_bind(imp, 5 * MIB, 0x100, &mut part));
        assert!(part.made && part.import_hi - part.import_lo < 2 * MIB, "{part:?}");
        let stats = |imp| {
            let mut st = emuhost_import_stats_t::default();
            ok(emuhost_importer_stats(imp, &mut st));
            st
        };
        // The background thread's widening and merge: wait for the merge (no time bound to
        // assert on; a minute is only there so a broken build ends).
        let t = std::time::Instant::now();
        while stats(imp).merges == 0 && t.elapsed() < std::time::Duration::from_secs(60) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let st = stats(imp);
        assert_eq!((st.merges, st.max_live), (1, 48), "{st:?}");
        assert!(st.merged_away >= 1 && st.peak_live >= 3 && st.pieces >= 1, "{st:?}");
        // The merge lands before its replaced imports are counted out; the part stays.
        let mut b = emuhost_binding_t::default();
        ok(emuhost_importer_bind(imp, 5 * MIB + 0x10, 0x10, &mut b));
        assert!(!b.made && (b.import_lo, b.import_hi) == (4 * MIB, 6 * MIB), "{b:?}");
        assert_eq!(stats(imp).live, 2, "the merged import and the part a binding holds");
        ok(emuhost_importer_handles_done(imp));
        assert_eq!(stats(imp).live, 1, "the part went");
        fails(emuhost_importer_handles_done(null()), EMUHOST_ERROR_NULL, "importer handle is NULL");
        ok(emuhost_importer_delete(imp));
        ok(emuhost_space_delete(s));
    }
}
