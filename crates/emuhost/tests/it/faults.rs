//! Fault injection (feature `faults`): each fault, the recovery the contract promises, and nothing
//! leaked at the end.
//!
//! Each test runs alone in a child process of this test binary (the test re-executes the binary
//! with `--exact` its own name and `EMUHOST_TEST_FAULT_CHILD` set): signal handlers are per
//! process, the `EMUHOST_FAULT_*` switches set a plan for the whole process, and the leak check
//! counts the process's mappings (`/proc/self/maps` lines) and descriptors (`/proc/self/fd`),
//! which tests running beside it in one process would disturb. The child logs to a buffer at
//! debug level and prints it, so a failure shows the recovery's log lines.

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use emuhost::faults::{self, ForeignPage, Plan, Schedule, UffdFault};
use emuhost::import::{
    Backend, ChunksConfig, ImportConfig, ImportError, ImportPolicy, Importer, Pin, Planned, Vulkan, error_chain,
};
use emuhost::settings::Settings;
use emuhost::space::{CommitPath, GuestAddr, Prot, Space, SpaceError, page_size};
use emuhost::watch::{self, BackendKind, PageRun, Tracker};

const MIB: u64 = 1 << 20;
const CHILD: &str = "EMUHOST_TEST_FAULT_CHILD";

/// Runs this module's test `name` alone in a child process with `env` set; panics unless it ran
/// and passed. Gives up after five minutes (a fault that is never resolved repeats forever).
fn in_child(name: &str, env: &[(&str, &str)]) {
    let dir = std::env::temp_dir();
    let out_path = dir.join(format!("emuhost-fault-{name}-{}.out", std::process::id()));
    let out = std::fs::File::create(&out_path).unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([&format!("faults::{name}"), "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .env_remove("EMUHOST_WATCH")
        // One malloc arena: the census counts mappings, and a thread of the driver's that mallocs
        // under load makes glibc map a new 64 MiB arena (two lines), which is not ours to count.
        .env("MALLOC_ARENA_MAX", "1")
        // No cache of ended threads' stacks: glibc keeps up to 40 MiB of them mapped for reuse,
        // which the census would count as a leak of the mprotect tracker's reader thread
        // (`emuhost-drops`, joined when the tracker goes).
        .env("GLIBC_TUNABLES", "glibc.pthread.stack_cache_size=0")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    for s in faults::SWITCHES {
        cmd.env_remove(s);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    let ran = text.contains("test result: ok. 1 passed");
    assert!(status.is_some_and(|s| s.success()) && ran, "child {name} ({status:?}):\n{text}");
    eprintln!("{text}");
    // A skip in the child shows as one would here (past the harness's capture); the child's
    // harness may have put `test NAME ... ` before it on the line.
    for skip in text.lines().filter_map(|l| l.find("skipped:").map(|at| &l[at..])) {
        let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{skip}\n").as_bytes());
    }
}

fn is_child(name: &str) -> bool {
    std::env::var(CHILD).is_ok_and(|v| v == name)
}

/// A test whose body runs in a child process (see the module's comment).
macro_rules! child_test {
    ($name:ident, $env:expr, |$log:ident| $body:block) => {
        #[test]
        fn $name() {
            if !is_child(stringify!($name)) {
                return in_child(stringify!($name), $env);
            }
            let $log = capture_log();
            $body
            eprintln!("--- log of {} ---\n{}", stringify!($name), $log.text());
        }
    };
}

#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Log {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Log {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The child's log, at debug level (the process is the child's alone).
fn capture_log() -> Log {
    let log = Log::default();
    let w = log.clone();
    let sub = tracing_subscriber::fmt()
        .with_writer(move || w.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .finish();
    tracing::subscriber::set_global_default(sub).unwrap();
    log
}

/// The process's mappings and open descriptors.
fn census() -> (usize, usize) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap().lines().count();
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    (maps, fds)
}

fn vulkan() -> Option<Vulkan> {
    crate::vulkan_gate::vulkan_or_skip(Vulkan::open())
}

// ---- a: imports ----

/// The import faults of the contract, through the importer: a spanned import over the size fails
/// and is made again without the span; the third import fails and its binding gets the driver's
/// error; the next binding goes on; the failed range cools and is imported once it has cooled.
/// With `scoped`, the plan is set from code; otherwise the switches (`EMUHOST_FAULT_IMPORT=3`,
/// `EMUHOST_FAULT_IMPORT_ABOVE_MB=1`) must have set it. `driver` is what the driver's error says.
fn imports_fail_and_recover<B: Backend + 'static>(b: B, scoped: bool, driver: &str, log: &Log) {
    let b = Arc::new(b);
    let budget0 = b.budget().get();
    let before = census();
    let failed_line;
    {
        let scope = scoped
            .then(|| faults::scoped(Plan { import: Schedule::nth(3), import_above: Some(MIB), ..Plan::default() }));
        let tally = || match &scope {
            Some(s) => s.tally(),
            None => faults::process_tally().expect("the switches set a plan"),
        };
        let space = Arc::new(Space::with_window(64 * MIB).unwrap());
        // Bindings are over committed pages.
        space.commit(space.range(0, 64 * MIB).unwrap(), Prot::READ_WRITE).unwrap();
        // Chunks are aligned in guest addresses (the host base is 2 MiB-aligned on 6.18, not on 6.1).
        let base = 0;
        let cooling = Duration::from_secs(30);
        let cfg = ImportConfig::default()
            .chunk(MIB)
            .cooling(cooling)
            .policy(ImportPolicy::Chunks(ChunksConfig::default().span_cap(4 * MIB)));
        let imp = Importer::new(space.clone(), b.clone(), cfg).unwrap();
        // A pool across the chunk end at base + 2 MiB: a binding in the chunk before plans 2 MiB.
        imp.add_pool(base + 2 * MIB - 0x3000, 0x6000).unwrap();
        let t0 = Instant::now();
        let r = |lo: u64, hi: u64| Planned { lo: base + lo * MIB, hi: base + hi * MIB };

        let bound = imp.bind_at(base + MIB + 0x100, 0x100, t0).unwrap();
        assert_eq!((bound.range, bound.made, bound.spanned), (r(1, 2), true, false));
        assert_eq!((tally().imports, tally().imports_failed), (2, 1));

        let e = imp.bind_at(base + 5 * MIB + 0x10, 0x10, t0).unwrap_err();
        failed_line = format!("import of {} failed: ", r(5, 6));
        assert!(matches!(&e, ImportError::Import { lo, .. } if *lo == base + 5 * MIB), "{e}");
        assert!(error_chain(&e).contains(driver), "the driver's error, not {}", error_chain(&e));

        let next = imp.bind_at(base + 6 * MIB + 0x10, 0x10, t0).unwrap();
        assert_eq!((next.range, next.made), (r(6, 7), true));

        let e = imp.bind_at(base + 5 * MIB + 0x10, 0x10, t0 + Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, ImportError::Cooling { .. }), "{e}");
        let again = imp.bind_at(base + 5 * MIB + 0x10, 0x10, t0 + cooling).unwrap();
        assert_eq!((again.range, again.made), (r(5, 6), true));

        let s = imp.stats();
        assert_eq!((s.imports, s.failures, s.unspanned_retries, s.cooled), (3, 2, 1, 1));
        assert_eq!((s.live, s.live_bytes), (3, 3 * MIB));
        assert_eq!(tally().imports, 5);
        assert_eq!((b.budget().get().count, b.budget().get().bytes), (budget0.count + 3, budget0.bytes + 3 * MIB));
        imp.release_all();
        assert_eq!((imp.stats().live, imp.stats().live_bytes), (0, 0));
        assert_eq!(b.budget().get(), budget0, "the backend's budget is back to its start");
    }
    assert_eq!(census(), before, "mappings and descriptors are back to their count before");
    let text = log.text();
    assert!(text.contains("failed (") && text.contains("made again without the span"), "{text}");
    assert!(text.contains(&failed_line), "{text}");
}

child_test!(pin_imports_fail_and_recover, &[], |log| {
    imports_fail_and_recover(Pin::new(), true, "mlock", &log);
    assert!(log.text().contains("Cannot allocate memory"));
});

child_test!(vulkan_imports_fail_and_recover, &[], |log| {
    if let Some(v) = vulkan() {
        imports_fail_and_recover(v, true, "ERROR_OUT_OF_DEVICE_MEMORY", &log);
    }
});

child_test!(
    pin_imports_fail_and_recover_under_the_switches,
    &[("EMUHOST_FAULT_IMPORT", "3"), ("EMUHOST_FAULT_IMPORT_ABOVE_MB", "1")],
    |log| {
        // The plan comes from the environment only where the caller asks for it.
        assert!(faults::install(&Settings::from_env().unwrap().faults));
        imports_fail_and_recover(Pin::new(), false, "mlock", &log);
    }
);

// ---- b: commit ----

/// Commit under `ENOMEM` with a tracker armed over the range.
fn commit_fails_with_enomem(kind: BackendKind, log: &Log) {
    let p = page_size();
    let before = census();
    {
        let space = Arc::new(Space::with_window(64 * p).unwrap());
        let range = |a: u64, n: u64| space.range(a * p, n * p).unwrap();
        // Only the one call fails: the region walk commits the range.
        let s = faults::scoped(Plan { commit_enomem: Schedule::nth(1), ..Plan::default() });
        let path = space.commit(range(40, 8), Prot::READ_WRITE).unwrap();
        assert_eq!(path, CommitPath::RegionWalk { regions: 1, holes: 0 });
        assert_eq!(s.tally().commit_failed, 1);
        drop(s);
        space.write(GuestAddr(41 * p), &[7]).unwrap();

        // A (pages 0..16) committed and B (16..32) reserved, both armed.
        space.commit(range(0, 16), Prot::READ_WRITE).unwrap();
        let t =
            Tracker::new(&space, &emuhost::watch::TrackerConfig::default().backend(Some(kind)).skip_self_test(true))
                .unwrap();
        let whole = range(0, 32);
        t.arm(whole).unwrap();
        let allocations = space.allocations();

        let check_unchanged = |e: SpaceError, t: &Tracker| {
            assert!(matches!(&e, SpaceError::Os { op: "commit", addr: 0, len, .. } if *len == 32 * p), "{e}");
            let src = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<std::io::Error>());
            assert_eq!(src.and_then(|s| s.raw_os_error()), Some(libc::ENOMEM), "{e:?}");
            assert_eq!(space.allocations(), allocations, "the extent map is unchanged");
            let b = space.kernel_regions(range(16, 16)).unwrap();
            assert!(b.iter().all(|r| !r.read && !r.write), "B stays reserved: {b:?}");
            assert_eq!(t.collect(whole).unwrap().pages(), 0, "nothing reported");
            // A's pages are still armed: a write is reported, once.
            space.store(GuestAddr(3 * p + 1), &[1]).unwrap();
            assert_eq!(
                t.collect(whole).unwrap().runs,
                vec![PageRun { start: GuestAddr(3 * p), pages: 1 }],
                "a write after the failed commit is reported, not lost"
            );
        };

        // The one call and the walk's first region fail: nothing was done.
        let s = faults::scoped(Plan { commit_enomem: Schedule::calls(1, 2), ..Plan::default() });
        let e = space.commit(whole, Prot::READ_WRITE).unwrap_err();
        assert_eq!(s.tally().commit_failed, 2);
        drop(s);
        check_unchanged(e, &t);

        // The walk commits A, then B fails: A is put back as it was.
        let s = faults::scoped(Plan { commit_enomem: Schedule::nth(1).and(Schedule::nth(3)), ..Plan::default() });
        let e = space.commit(whole, Prot::READ_WRITE).unwrap_err();
        let tally = s.tally();
        drop(s);
        check_unchanged(e, &t);
        assert_eq!((tally.commit_calls, tally.commit_failed), (4, 2), "A was put back (call 4)");

        // Putting A back fails too: A stays committed, and is recorded and reported so.
        let s = faults::scoped(Plan { commit_enomem: Schedule::nth(1).and(Schedule::calls(3, 4)), ..Plan::default() });
        let e = space.commit(whole, Prot::READ_WRITE).unwrap_err();
        drop(s);
        assert!(matches!(&e, SpaceError::Os { op: "commit", .. }), "{e}");
        let got = t.collect(whole).unwrap();
        assert_eq!(got.runs, vec![PageRun { start: GuestAddr(0), pages: 16 }], "A reported, not lost");
        space.store(GuestAddr(5 * p), &[1]).unwrap();
        assert_eq!(t.collect(whole).unwrap().runs, vec![PageRun { start: GuestAddr(5 * p), pages: 1 }]);

        // A later commit of the range works, and B is tracked from its first write.
        assert_eq!(space.commit(whole, Prot::READ_WRITE).unwrap(), CommitPath::OneCall);
        let extents: Vec<_> = space.allocations().iter().map(|a| a.range).collect();
        assert_eq!(extents, vec![range(0, 16), range(16, 16), range(40, 8)], "A keeps its extent, B is new");
        t.collect(whole).unwrap();
        space.store(GuestAddr(20 * p), &[1]).unwrap();
        assert_eq!(t.collect(whole).unwrap().runs, vec![PageRun { start: GuestAddr(20 * p), pages: 1 }]);
    }
    assert_eq!(census(), before, "mappings and descriptors are back to their count before");
    let text = log.text();
    assert!(text.contains("one call failed (Cannot allocate memory"), "{text}");
    assert!(text.contains("stays committed: recorded as such"), "{text}");
}

child_test!(commit_fails_with_enomem_under_uffd, &[], |log| {
    if !crate::watch::usable(BackendKind::Uffd) {
        return;
    }
    commit_fails_with_enomem(BackendKind::Uffd, &log);
});

child_test!(commit_fails_with_enomem_under_mprotect, &[], |log| {
    commit_fails_with_enomem(BackendKind::Mprotect, &log);
});

// ---- c: userfaultfd unavailable ----

child_test!(without_userfaultfd_the_tracker_falls_back_to_mprotect_and_says_why, &[], |log| {
    let p = page_size();
    let before = census();
    for (fault, says) in
        [(UffdFault::Eperm, "Operation not permitted"), (UffdFault::Enosys, "Function not implemented")]
    {
        let s = faults::scoped(Plan { uffd: Some(fault), ..Plan::default() });
        let choice = watch::choose(&emuhost::watch::TrackerConfig::default()).unwrap();
        assert_eq!(choice.kind, BackendKind::Mprotect);
        assert!(choice.why.contains("not uffd:") && choice.why.contains(says), "{}", choice.why);
        let space = Arc::new(Space::with_window(16 * p).unwrap());
        let t = Tracker::new(&space, &emuhost::watch::TrackerConfig::default()).unwrap();
        assert_eq!(t.kind(), BackendKind::Mprotect);
        assert!(s.tally().uffd_failed >= 2, "both choices met the fault");
        let whole = space.range(0, 16 * p).unwrap();
        space.commit(whole, Prot::READ_WRITE).unwrap();
        t.arm(whole).unwrap();
        space.store(GuestAddr(9 * p + 3), &[1]).unwrap();
        assert_eq!(t.collect(whole).unwrap().runs, vec![PageRun { start: GuestAddr(9 * p), pages: 1 }]);
        let text = log.text();
        let line = text.lines().rfind(|l| l.contains("write tracking: mprotect (")).unwrap_or("");
        assert!(line.contains("not uffd:") && line.contains(says), "{text}");
    }
    assert_eq!(census(), before, "mappings and descriptors are back to their count before");
});

// ---- d: a SIGSEGV that is not ours ----

child_test!(a_foreign_sigsegv_reaches_the_handler_installed_before_ours, &[], |log| {
    let p = page_size();
    let foreign = ForeignPage::install().unwrap();
    assert!(ForeignPage::is_current_handler(), "the foreign handler is installed first");
    let before = census();
    {
        let space = Arc::new(Space::with_window(16 * p).unwrap());
        let whole = space.range(0, 16 * p).unwrap();
        space.commit(whole, Prot::READ_WRITE).unwrap();
        let t = Tracker::new(
            &space,
            &emuhost::watch::TrackerConfig::default().backend(Some(BackendKind::Mprotect)).skip_self_test(true),
        )
        .unwrap();
        assert!(!ForeignPage::is_current_handler(), "emuhost's handler went in over it");
        t.arm(whole).unwrap();
        assert_eq!(foreign.touch(0xa5).unwrap(), 0xa5, "the store completed");
        assert_eq!((foreign.calls(), foreign.resolved()), (1, 1), "the prior handler ran once");
        // A store by the CPU (`Space::store` never faults).
        // SAFETY: the page is committed read-write and armed; emuhost's handler takes its fault.
        unsafe { space.store_unchecked(GuestAddr(2 * p), &[1]) }.unwrap();
        assert_eq!(t.collect(whole).unwrap().runs, vec![PageRun { start: GuestAddr(2 * p), pages: 1 }]);
        assert_eq!(foreign.calls(), 1, "a write to an armed page is ours and not passed on");
        assert_eq!(foreign.touch(0x5a).unwrap(), 0x5a);
        assert_eq!((foreign.calls(), foreign.resolved()), (2, 2));
    }
    assert_eq!(census(), before, "mappings and descriptors are back to their count before");
});

child_test!(
    under_the_foreign_sigsegv_switch_every_collect_passes_a_foreign_fault_on,
    &[("EMUHOST_FAULT_FOREIGN_SEGV", "1")],
    |log| {
        assert!(faults::install(&Settings::from_env().unwrap().faults));
        let p = page_size();
        let space = Arc::new(Space::with_window(16 * p).unwrap());
        let whole = space.range(0, 16 * p).unwrap();
        space.commit(whole, Prot::READ_WRITE).unwrap();
        let t = Tracker::new(
            &space,
            &emuhost::watch::TrackerConfig::default().backend(Some(BackendKind::Mprotect)).skip_self_test(true),
        )
        .unwrap();
        let foreign = ForeignPage::install().unwrap();
        assert!(!ForeignPage::is_current_handler(), "the switch put the foreign handler in before emuhost's");
        t.arm(whole).unwrap();
        for i in 0..5 {
            space.store(GuestAddr(i * p), &[1]).unwrap();
            assert_eq!(t.collect(whole).unwrap().runs, vec![PageRun { start: GuestAddr(i * p), pages: 1 }]);
        }
        assert_eq!((foreign.calls(), foreign.resolved()), (5, 5), "one foreign fault per collect, and only those");
    }
);
