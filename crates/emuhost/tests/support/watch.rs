//! The one rule for every test that names a write-tracking backend: which backends this kernel
//! should have (by its probed capabilities) and whether a test of one runs here. Included by path
//! from the runtime's and the lab's integration tests.

#![allow(dead_code)]

#[cfg(target_os = "linux")]
use emuhost::probe::{Offer, Probe};
use emuhost::watch::{self, BackendKind};

/// This platform's protection backend (armed pages read-only, a write claimed by the fault
/// handler): for the tests of what only such a backend does (`handle_fault`, a store from a thread
/// that blocks faults, the embedder's own handler).
#[cfg(target_os = "linux")]
pub const PROTECTION: BackendKind = BackendKind::Mprotect;
/// This platform's protection backend (armed pages read-only, a write claimed by the fault
/// handler): for the tests of what only such a backend does (`handle_fault`, a store from a thread
/// that blocks faults, the embedder's own handler).
#[cfg(windows)]
pub const PROTECTION: BackendKind = BackendKind::Guard;

/// Whether this machine should have `kind`, by its probed capabilities (not by the backend's own
/// self-test): `Err(why not)` where the kernel lacks what it needs.
pub fn expected(kind: BackendKind) -> Result<(), String> {
    match kind {
        BackendKind::Uffd => uffd_expected(),
        BackendKind::Mprotect if cfg!(target_os = "linux") => Ok(()),
        // Windows: write watch is in every Windows and Wine; the guard is the portable one.
        BackendKind::WriteWatch | BackendKind::Guard if cfg!(windows) => Ok(()),
        _ => Err(format!("{} is not a backend of this platform", kind.name())),
    }
}

/// Whether this kernel offers what the uffd backend needs (`WP_ASYNC` and `PAGEMAP_SCAN`).
#[cfg(target_os = "linux")]
fn uffd_expected() -> Result<(), String> {
    let p = Probe::run();
    if !p.uffd_wp_async() {
        return Err(format!("userfaultfd has no WP_ASYNC (features: {:?})", p.uffd_features));
    }
    match p.pagemap_scan {
        Offer::Yes(()) => Ok(()),
        Offer::No(why) => Err(format!("PAGEMAP_SCAN: {why}")),
    }
}

/// userfaultfd is Linux's.
#[cfg(not(target_os = "linux"))]
fn uffd_expected() -> Result<(), String> {
    Err("userfaultfd is Linux only".into())
}

/// Whether a test of `kind` can run here: `false` (a test that then returns) after printing
/// `skipped: <backend>: <reason>` where the kernel lacks what the backend needs. A backend the
/// probed capabilities say this machine has must pass its self-test: a failing one fails the test.
pub fn usable(kind: BackendKind) -> bool {
    match (watch::self_test(kind), expected(kind)) {
        (Ok(()), _) => true,
        (Err(e), Err(why)) => {
            eprintln!("skipped: {}: {why} (its self-test: {e})", kind.name());
            false
        }
        (Err(e), Ok(())) => panic!("{}: this kernel offers what it needs, but its self-test failed: {e}", kind.name()),
    }
}

/// The environment switch that marks a child process running one test alone.
pub const ALONE: &str = "EMUHOST_TEST_WATCH_CHILD";

/// Runs the test `test` (its path in the binary) alone in a child process of this test binary
/// (for what is the process's: the map limit, signal handlers); panics unless it ran and passed.
pub fn in_child_alone(test: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env(ALONE, test)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && text.contains("test result: ok. 1 passed"),
        "child {test}: {:?}\n{text}",
        out.status
    );
    eprintln!("{text}");
}

/// Whether shared views can be mapped here: always on Linux; on Windows where placeholders work
/// (Windows 10 1803+, Wine 10; not Wine 8). `false` (a test that then returns) after printing
/// `skipped: <test>: <reason>`, so a run never counts an unrun view test as passed silently.
pub fn views(test: &str) -> bool {
    #[cfg(windows)]
    if let emuhost::probe::Offer::No(why) = emuhost::probe::Probe::run().placeholders {
        // Past libtest's capture (which takes `eprintln!`): a skip is always seen.
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!("skipped: {test}: shared views need placeholders: {why}\n"),
        );
        return false;
    }
    let _ = test;
    true
}
