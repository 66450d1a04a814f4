//! Tracking shaped like an emulator's caches, on every usable backend: collects into the
//! caller's bitmap words, queries that take nothing, consumers that do not eat each other's
//! dirty pages, and `handle_fault` called from the test's own `SIGSEGV` handler.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use emuhost::space::{GuestAddr, GuestRange, Prot, Space, page_size};
use emuhost::watch::TrackerConfig;
use emuhost::watch::{self, BackendKind, FaultHandle, Tracker, WatchError};

use crate::watch::usable;

fn p() -> u64 {
    page_size()
}

watch_conformance!(
    collect_into_sets_one_bit_per_grain,
    bad_granularity_or_short_words_are_errors_that_take_nothing,
    a_query_reports_without_taking,
    two_consumers_both_see_every_write,
    every_reader_sees_every_write_whatever_the_order,
    #[cfg(target_os = "linux")]
    handle_fault_from_the_embedders_own_handler,
    #[cfg(target_os = "linux")]
    handle_fault_racing_collects_loses_nothing,
    collect_into_allocates_nothing_once_warm,
);

fn setup(kind: BackendKind, pages: u64) -> Option<(Arc<Space>, Arc<Tracker>, GuestRange)> {
    if !usable(kind) {
        return None;
    }
    let s = Arc::new(Space::with_window(1 << 30).unwrap());
    let t =
        Tracker::new(&s, &emuhost::watch::TrackerConfig::default().backend(Some(kind)).skip_self_test(true)).unwrap();
    let r = s.range(0, pages * p()).unwrap();
    s.commit(r, Prot::READ_WRITE).unwrap();
    t.arm(r).unwrap();
    Some((s, t, r))
}

fn poke(s: &Space, page: u64) {
    s.store(GuestAddr(page * p() + 8), &[0x5a]).unwrap();
}

/// The set bits' numbers.
fn bits(words: &[u64]) -> Vec<u64> {
    (0..words.len() as u64 * 64).filter(|i| words[(i / 64) as usize] & (1 << (i % 64)) != 0).collect()
}

fn collect_into_sets_one_bit_per_grain(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind, 2048) else { return };
    let g = 64 << 10;
    let per = g / p();
    for page in [0, per + 1, per + 2, 6 * per + 3, 64 * per - 1, 64 * per, 2047] {
        poke(&s, page);
    }
    // A word past the need stays as it was; bits already set stay set.
    let mut words = [0, 0, 0, 1 << 7];
    let w = t.collect_into(r, g, &mut words).unwrap();
    assert_eq!(bits(&words), vec![0, 1, 6, 63, 64, 127, 192 + 7]);
    assert_eq!((w.pages, w.untracked_pages), (7, 0), "{w:?}");
    assert_eq!(w.seq, t.collects_started());
    // Taken and armed again: the next collect has nothing until the next write.
    let mut words = [0u64; 2];
    assert_eq!(t.collect_into(r, g, &mut words).unwrap().pages, 0);
    assert_eq!(words, [0, 0]);
    poke(&s, 5 * per);
    t.collect_into(r, g, &mut words).unwrap();
    assert_eq!(bits(&words), vec![5]);
    // A range from a grain's middle: bit 0 is its first `g` bytes; one bit per page at the page
    // size.
    let mid = s.range(3 * p(), 100 * p()).unwrap();
    poke(&s, 3);
    poke(&s, 3 + per);
    poke(&s, 99);
    let mut words = [0u64; 1];
    t.collect_into(mid, g, &mut words).unwrap();
    assert_eq!(bits(&words), vec![0, 1, 6], "page 99 is 96 pages into the range: grain 6 (of 7, the last partial)");
    let mut words = [0u64; 2];
    assert!(t.collect_into(mid, g, &mut words).unwrap().pages == 0);
    poke(&s, 3);
    poke(&s, 99);
    t.collect_into(mid, p(), &mut words).unwrap();
    assert_eq!(bits(&words), vec![0, 96]);
}

/// After a few rounds have grown the tracker's buffers, a collect into words (the tracker's and a
/// consumer's) makes no heap allocation on the calling thread.
fn collect_into_allocates_nothing_once_warm(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind, 512) else { return };
    let c = t.consumer();
    let mut words = [0u64; 8];
    for round in 0..6 {
        for page in [1, 2, 3, 100, 300, 301, 511] {
            poke(&s, page);
        }
        words = [0; 8];
        let before = crate::allocations();
        let got = t.collect_into(r, p(), &mut words).unwrap();
        let mine = c.collect_into(r, p(), &mut words).unwrap();
        let made = crate::allocations() - before;
        assert_eq!((got.pages, mine.pages), (7, 7));
        if round >= 3 {
            assert_eq!(made, 0, "round {round}: a warm collect_into allocated");
        }
    }
    assert_eq!(bits(&words), vec![1, 2, 3, 100, 300, 301, 511]);
}

fn bad_granularity_or_short_words_are_errors_that_take_nothing(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind, 256) else { return };
    poke(&s, 200);
    let mut words = [0u64; 4];
    for g in [0, 3000, p() / 2, 3 * p()] {
        let e = t.collect_into(r, g, &mut words).unwrap_err();
        assert!(matches!(e, WatchError::BadGranularity { granularity, .. } if granularity == g), "{e:?}");
        assert!(e.to_string().starts_with(&format!("granularity {g:#x} is not a power of two")), "{e}");
        assert!(t.query_into(r, g, &mut words).is_err());
    }
    // 256 pages at one bit per page need 4 words.
    let e = t.collect_into(r, p(), &mut words[..3]).unwrap_err();
    assert!(matches!(e, WatchError::WordsTooShort { need: 4, have: 3, .. }), "{e:?}");
    assert!(e.to_string().contains("needs 4 bitmap words; 3 given"), "{e}");
    let c = t.consumer();
    assert!(matches!(c.collect_into(r, p(), &mut words[..1]), Err(WatchError::WordsTooShort { .. })));
    assert!(matches!(c.query_into(r, 5, &mut words), Err(WatchError::BadGranularity { .. })));
    assert_eq!(words, [0; 4], "a refused call writes nothing");
    // Nothing was taken.
    t.collect_into(r, p(), &mut words).unwrap();
    assert_eq!(bits(&words), vec![200]);
}

fn a_query_reports_without_taking(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind, 128) else { return };
    let g = 4 * p();
    poke(&s, 9);
    poke(&s, 70);
    for _ in 0..2 {
        let mut words = [0u64; 1];
        let w = t.query_into(r, g, &mut words).unwrap();
        assert_eq!((bits(&words), w.pages), (vec![2, 17], 2));
    }
    let mut words = [0u64; 1];
    t.collect_into(r, g, &mut words).unwrap();
    assert_eq!(bits(&words), vec![2, 17], "the collect after queries reports the pages");
    let mut words = [0u64; 1];
    t.query_into(r, g, &mut words).unwrap();
    assert_eq!(words, [0], "taken by the collect");
    // A query does not arm: a page it reported is written again and still reported once.
    poke(&s, 1);
    t.query_into(r, g, &mut [0u64; 1]).unwrap();
    poke(&s, 1);
    let c = t.collect(r).unwrap();
    assert_eq!(c.page_addrs(), vec![GuestAddr(p())]);
}

/// A consumer's collect of `r` (at most 128 pages) into words, as the set bits' numbers.
fn take(c: &watch::Consumer, r: GuestRange) -> Vec<u64> {
    let mut words = [0u64; 2];
    c.collect_into(r, p(), &mut words).unwrap();
    bits(&words)
}

fn two_consumers_both_see_every_write(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind, 128) else { return };
    let (buffers, textures) = (t.consumer(), t.consumer());
    let take = |c: &watch::Consumer| take(c, r);
    poke(&s, 5);
    assert_eq!(take(&buffers), vec![5]);
    poke(&s, 6);
    // The tracker's own collect feeds both consumers too, and reports what the consumer's
    // collect read before it (its reads are one more consumer).
    assert_eq!(t.collect(r).unwrap().pages(), 2);
    assert_eq!(take(&textures), vec![5, 6]);
    assert_eq!(take(&buffers), vec![6]);
    assert_eq!(take(&buffers), Vec::<u64>::new());
    assert_eq!(take(&textures), Vec::<u64>::new());
    // So does its collect into words (which sets the caller's bits straight from the kernel's
    // output only when no consumer needs the runs).
    poke(&s, 9);
    let mut words = [0u64; 2];
    assert_eq!(t.collect_into(r, p(), &mut words).unwrap().pages, 1);
    assert_eq!(bits(&words), vec![9]);
    assert_eq!(take(&buffers), vec![9]);
    assert_eq!(take(&textures), vec![9]);
    // Query then collect, on each: both report, and a query takes nothing from the other.
    poke(&s, 100);
    for c in [&buffers, &textures] {
        let mut words = [0u64; 2];
        let w = c.query_into(r, p(), &mut words).unwrap();
        assert_eq!((bits(&words), w.pages), (vec![100], 1));
        assert_eq!(take(c), vec![100]);
    }
    // A third consumer made now sees what is written from now on; dropping one keeps the others.
    let late = t.consumer();
    drop(buffers);
    poke(&s, 7);
    assert_eq!(take(&late), vec![7]);
    assert_eq!(take(&textures), vec![7]);
    // Only the range asked is taken.
    poke(&s, 8);
    poke(&s, 120);
    let low = s.range(0, 64 * p()).unwrap();
    let mut words = [0u64; 1];
    textures.collect_into(low, p(), &mut words).unwrap();
    assert_eq!(bits(&words), vec![8]);
    assert_eq!(take(&textures), vec![120]);
    assert_eq!(take(&late), vec![8, 120]);
    // A collect into runs: consecutive pages joined, in order, appended, and taken from this
    // consumer alone.
    for i in [12, 10, 11, 40, 127] {
        poke(&s, i);
    }
    let mut runs = vec![(1, 2)];
    let w = late.collect_runs(r, &mut runs).unwrap();
    let at = |i: u64| r.start().0 + i * p();
    assert_eq!(runs, [(1, 2), (at(10), at(13)), (at(40), at(41)), (at(127), at(128))]);
    assert_eq!(w.pages, 5);
    runs.clear();
    assert_eq!((late.collect_runs(r, &mut runs).unwrap().pages, runs.len()), (0, 0));
    assert_eq!(take(&textures), vec![10, 11, 12, 40, 127]);
}

/// Issue 33, item 1: the tracker's own collect is one more reader. A consumer's collect (which
/// reads and re-arms the kernel's marks) must not hide a write from the tracker's own collect,
/// nor the tracker's from a consumer's, in any order, through `collect`, `collect_into` and
/// `query_into` alike.
fn every_reader_sees_every_write_whatever_the_order(kind: BackendKind) {
    let Some((s, t, r)) = setup(kind, 128) else { return };
    let (buffers, textures) = (t.consumer(), t.consumer());
    let take = |c: &watch::Consumer| take(c, r);
    let own = || -> Vec<u64> { t.collect(r).unwrap().page_addrs().iter().map(|a| a.0 / p()).collect() };
    let own_into = || {
        let mut words = [0u64; 2];
        let w = t.collect_into(r, p(), &mut words).unwrap();
        assert_eq!(w.pages, bits(&words).len() as u64);
        bits(&words)
    };
    let own_query = || {
        let mut words = [0u64; 2];
        t.query_into(r, p(), &mut words).unwrap();
        bits(&words)
    };
    // A consumer first, then the tracker's own collect.
    poke(&s, 5);
    assert_eq!(take(&buffers), vec![5]);
    assert_eq!(own_query(), vec![5], "the tracker's query sees what a consumer's collect read");
    assert_eq!(own(), vec![5], "a consumer's collect hid the write from the tracker's own collect");
    assert_eq!(own(), Vec::<u64>::new());
    // Both consumers, then the tracker's collect into words.
    poke(&s, 6);
    assert_eq!(take(&buffers), vec![6]);
    assert_eq!(take(&textures), vec![5, 6]);
    assert_eq!(own_into(), vec![6]);
    assert_eq!(own_into(), Vec::<u64>::new());
    // The tracker first, then the consumers; then a write between two readers.
    poke(&s, 7);
    assert_eq!(own_into(), vec![7]);
    poke(&s, 8);
    assert_eq!(take(&textures), vec![7, 8]);
    poke(&s, 9);
    assert_eq!(own(), vec![8, 9]);
    assert_eq!(take(&buffers), vec![7, 8, 9]);
    assert_eq!(take(&textures), vec![9]);
    for reader in [own(), own_into(), take(&buffers), take(&textures)] {
        assert_eq!(reader, Vec::<u64>::new());
    }
    // With every consumer gone the tracker's own collect still reports what they read.
    poke(&s, 10);
    assert_eq!(take(&buffers), vec![10]);
    drop((buffers, textures));
    poke(&s, 11);
    assert_eq!(own(), vec![10, 11]);
}

/// The test's own handler: a fault on its foreign page maps it in (a fault of the embedder's
/// own); any other goes to the tracker's handle, and one it refuses restores the default action
/// (the process dies, and the test with it).
#[cfg(target_os = "linux")]
static HANDLE: std::sync::OnceLock<FaultHandle> = std::sync::OnceLock::new();
#[cfg(target_os = "linux")]
static FOREIGN: AtomicUsize = AtomicUsize::new(0);
#[cfg(target_os = "linux")]
static FOREIGN_SEEN: AtomicUsize = AtomicUsize::new(0);
#[cfg(target_os = "linux")]
static TAKEN: AtomicUsize = AtomicUsize::new(0);

/// What a signal handler may keep: a handle is plain data, and a consumer moves between threads.
#[test]
fn a_fault_handle_is_plain_data_and_a_consumer_is_send_and_sync() {
    fn plain<T: Copy + Send + Sync + 'static>() {}
    fn shared<T: Send + Sync>() {}
    plain::<FaultHandle>();
    shared::<watch::Consumer>();
    shared::<Tracker>();
}

/// Whether the fault was a write: the page-fault error code's write bit.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn is_write(ctx: *mut libc::c_void) -> bool {
    // SAFETY: for SA_SIGINFO handlers the third argument is the thread's ucontext.
    unsafe { (*(ctx as *const libc::ucontext_t)).uc_mcontext.gregs[libc::REG_ERR as usize] & 2 != 0 }
}

#[cfg(all(target_os = "linux", not(target_arch = "x86_64")))]
fn is_write(_ctx: *mut libc::c_void) -> bool {
    true
}

#[cfg(target_os = "linux")]
extern "C" fn embedder_segv(_sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo; for a fault si_addr is the address.
    let addr = unsafe { (*info).si_addr() } as usize;
    let foreign = FOREIGN.load(SeqCst);
    if foreign != 0 && (foreign..foreign + p() as usize).contains(&addr) {
        let ours = HANDLE.get().is_some_and(|h| h.handle_fault(addr, is_write(ctx)));
        FOREIGN_SEEN.fetch_add(if ours { 1000 } else { 1 }, SeqCst);
        // SAFETY: the page is the test's own mapping; mprotect is async-signal-safe.
        unsafe { libc::mprotect(foreign as *mut libc::c_void, p() as usize, libc::PROT_READ | libc::PROT_WRITE) };
        return;
    }
    if HANDLE.get().is_some_and(|h| h.handle_fault(addr, is_write(ctx))) {
        TAKEN.fetch_add(1, SeqCst);
        return;
    }
    // SAFETY: a zeroed sigaction with SIG_DFL is the default action; the fault repeats fatally.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGSEGV, &dfl, std::ptr::null_mut());
    }
}

/// The `SIGSEGV` handler now.
#[cfg(target_os = "linux")]
fn current_handler() -> usize {
    // SAFETY: reads the action into a zeroed struct.
    unsafe {
        let mut now: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut now), 0);
        now.sa_sigaction
    }
}

/// In a child process (handlers are the process's): installs the test's handler, makes a tracker
/// that installs none, and returns it with its space, the range armed; `None` in the parent (the
/// child ran and passed) or where the backend is not usable.
#[cfg(target_os = "linux")]
fn embedded(kind: BackendKind, name: &str, pages: u64) -> Option<(Arc<Space>, Arc<Tracker>, GuestRange)> {
    let full = format!("watch_cache::{}::{name}", kind.name());
    if std::env::var("EMUHOST_WATCH_CACHE_CHILD").ok().as_deref() != Some(full.as_str()) {
        if usable(kind) {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([&full, "--exact", "--nocapture", "--test-threads=1"])
                .env("EMUHOST_WATCH_CACHE_CHILD", &full)
                .stdin(std::process::Stdio::null())
                .output()
                .unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success() && text.contains("test result: ok. 1 passed"), "child {full}: {text}");
        }
        return None;
    }
    // SAFETY: a zeroed sigaction filled in with a SA_SIGINFO handler.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = embedder_segv as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
        libc::sigemptyset(&mut act.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGSEGV, &act, std::ptr::null_mut()), 0);
    }
    let s = Arc::new(Space::with_window(1 << 30).unwrap());
    let config = TrackerConfig::default().backend(Some(kind)).embedder_handles_faults(true);
    let t = Tracker::new(&s, &config).unwrap();
    assert_eq!(t.kind(), kind);
    assert_eq!(current_handler(), embedder_segv as *const () as usize, "emuhost installed a SIGSEGV handler");
    HANDLE.set(t.fault_handle()).unwrap();
    let r = s.range(0, pages * p()).unwrap();
    s.commit(r, Prot::READ_WRITE).unwrap();
    t.arm(r).unwrap();
    Some((s, t, r))
}

/// A store by the CPU, as guest code makes (`Space::store` never faults: it hands a refused page
/// to the tracker without a signal).
#[cfg(target_os = "linux")]
fn cpu_poke(s: &Space, page: u64) {
    // SAFETY: the test's pages are committed read-write and armed, and the test's handler hands
    // their faults to the tracker; nothing decommits or protects them meanwhile.
    unsafe { s.store_unchecked(GuestAddr(page * p() + 8), &[0x5a]) }.unwrap();
}

#[cfg(target_os = "linux")]
fn handle_fault_from_the_embedders_own_handler(kind: BackendKind) {
    let Some((s, t, r)) = embedded(kind, "handle_fault_from_the_embedders_own_handler", 64) else { return };
    cpu_poke(&s, 2);
    cpu_poke(&s, 9);
    cpu_poke(&s, 9);
    // With mprotect each first write faults once, into the handle; uffd's never fault.
    let want = if kind.protects() { 2 } else { 0 };
    assert_eq!(TAKEN.load(SeqCst), want);
    let mut words = [0u64; 1];
    t.collect_into(r, p(), &mut words).unwrap();
    assert_eq!(bits(&words), vec![2, 9]);
    cpu_poke(&s, 9);
    let want = if kind.protects() { 3 } else { 0 };
    assert_eq!(TAKEN.load(SeqCst), want, "armed again by the collect");
    assert_eq!(t.collect(r).unwrap().page_addrs(), vec![GuestAddr(9 * p())]);
    // A fault outside the window: the handle refuses it, and the test's handler sees it.
    // SAFETY: a fresh mapping chosen by the kernel.
    let own = unsafe {
        libc::mmap(std::ptr::null_mut(), p() as usize, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    assert_ne!(own, libc::MAP_FAILED);
    FOREIGN.store(own as usize, SeqCst);
    // SAFETY: the page is the test's own; its handler maps it writable.
    unsafe { (own as *mut u8).write_volatile(1) };
    assert_eq!(FOREIGN_SEEN.load(SeqCst), 1, "one fault, refused by the handle");
    // Called directly: outside the window, a read, or the uffd backend: false; a write to an
    // armed page of the window (mprotect): taken, marked, reported by the next collect.
    let host = |page: u64| s.host_addr(GuestAddr(page * p())).unwrap();
    assert!(!t.handle_fault(own as usize, true));
    assert!(!t.handle_fault(host(30), false));
    // A page of the window never armed is not the tracker's (the self-test's trackers were
    // dropped: that changes nothing here).
    assert!(!t.handle_fault(host(100), true), "never armed");
    assert_eq!(t.handle_fault(host(30) + 5, true), kind.protects());
    assert_eq!(watch::handle_fault(host(31), true), kind.protects());
    let marked: Vec<u64> = if kind.protects() { vec![30, 31] } else { vec![] };
    assert_eq!(t.collect(r).unwrap().page_addrs(), marked.iter().map(|&i| GuestAddr(i * p())).collect::<Vec<_>>());
    // Still no handler of emuhost's.
    assert_eq!(current_handler(), embedder_segv as *const () as usize);
}

/// A writer stores to every page of the range, round after round, through the CPU (faults go to
/// the test's handler and on to the handle) while a collector collects into words; each round
/// starts after a collect, so every page must be in the round's collects: none lost.
#[cfg(target_os = "linux")]
fn handle_fault_racing_collects_loses_nothing(kind: BackendKind) {
    let pages = 512;
    let Some((s, t, r)) = embedded(kind, "handle_fault_racing_collects_loses_nothing", pages) else { return };
    let base = s.host_addr(GuestAddr(0)).unwrap();
    let mut lost = 0;
    for round in 0..20u64 {
        let done = std::sync::atomic::AtomicBool::new(false);
        let mut seen = [0u64; 8];
        std::thread::scope(|sc| {
            sc.spawn(|| {
                for i in 0..pages {
                    let page = (i * 97 + round * 13) % pages;
                    // SAFETY: the page is committed read-write in the space's window; the tracker
                    // may have it read-only, and its handle (through the test's handler) gives
                    // write access back.
                    unsafe { ((base + (page * p()) as usize) as *mut u64).write_volatile(round) };
                }
                done.store(true, SeqCst);
            });
            while !done.load(SeqCst) {
                t.collect_into(r, p(), &mut seen).unwrap();
            }
        });
        t.collect_into(r, p(), &mut seen).unwrap();
        lost += seen.iter().map(|w| w.count_zeros() as u64).sum::<u64>();
    }
    assert_eq!(lost, 0, "pages written and never reported");
    if kind.protects() {
        assert!(TAKEN.load(SeqCst) >= pages as usize, "the handle took {} faults", TAKEN.load(SeqCst));
    }
}

/// Windows: the embedder owns exception handling. emuhost adds no vectored handler of its own
/// (`embedder_handles_faults`, checked in a child process where no other test added one); the
/// embedder's handler hands write faults to the tracker's `FaultHandle` and resumes where it
/// takes them, and passes everything else on.
#[cfg(windows)]
#[test]
fn an_embedders_vectored_handler_hands_faults_to_the_guard() {
    use windows_sys::Win32::Foundation::EXCEPTION_ACCESS_VIOLATION;
    use windows_sys::Win32::System::Diagnostics::Debug::{
        AddVectoredExceptionHandler, EXCEPTION_CONTINUE_EXECUTION, EXCEPTION_CONTINUE_SEARCH, EXCEPTION_POINTERS,
    };
    static EMBEDDED: std::sync::OnceLock<FaultHandle> = std::sync::OnceLock::new();
    static SEEN: AtomicUsize = AtomicUsize::new(0);
    unsafe extern "system" fn embedder(info: *mut EXCEPTION_POINTERS) -> i32 {
        // SAFETY: the system passes a valid record for this call.
        let r = unsafe { &*(*info).ExceptionRecord };
        if r.ExceptionCode == EXCEPTION_ACCESS_VIOLATION && r.NumberParameters >= 2 {
            SEEN.fetch_add(1, SeqCst);
            let write = r.ExceptionInformation[0] == 1;
            if EMBEDDED.get().is_some_and(|h| h.handle_fault(r.ExceptionInformation[1], write)) {
                return EXCEPTION_CONTINUE_EXECUTION;
            }
        }
        EXCEPTION_CONTINUE_SEARCH
    }
    const NAME: &str = "watch_cache::an_embedders_vectored_handler_hands_faults_to_the_guard";
    if std::env::var_os(crate::watch_gate::ALONE).is_none() {
        return crate::watch_gate::in_child_alone(NAME);
    }
    // SAFETY: `embedder` has the handler's signature and lives as long as the process.
    assert!(!unsafe { AddVectoredExceptionHandler(1, Some(embedder)) }.is_null());
    let s = Arc::new(Space::with_window(1 << 24).unwrap());
    let config = TrackerConfig::default().backend(Some(BackendKind::Guard)).embedder_handles_faults(true);
    let t = Tracker::new(&s, &config).unwrap();
    EMBEDDED.set(t.fault_handle()).unwrap();
    let r = s.range(0, 16 * p()).unwrap();
    s.commit(r, Prot::READ_WRITE).unwrap();
    t.arm(r).unwrap();
    let seen = SEEN.load(SeqCst);
    for page in [2, 9, 9] {
        // SAFETY: the pages are committed read-write and armed; the embedder's handler hands
        // their faults to the tracker; nothing decommits or protects them meanwhile.
        unsafe { s.store_unchecked(GuestAddr(page * p() + 8), &[0x5a]) }.unwrap();
    }
    // Each first write faulted once, into the embedder's handler (emuhost has none here).
    assert_eq!(SEEN.load(SeqCst) - seen, 2);
    assert_eq!(t.collect(r).unwrap().page_addrs(), vec![GuestAddr(2 * p()), GuestAddr(9 * p())]);
    // Outside the window and for reads the handle takes nothing.
    let host = s.host_addr(GuestAddr(3 * p())).unwrap();
    assert!(!t.handle_fault(host, false));
    assert!(!t.handle_fault(usize::MAX - 4096, true));
}
