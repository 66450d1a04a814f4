//! Replays of small traces with known outcomes, through the real runtime (pin imports here, since
//! lavapipe's imports pin nothing; Vulkan's conformance is in `import`).

use std::time::Duration;

use emuhost::import::{BackendChoice, BackendKind as ImportKind, ImportCost, PoolsConfig};
use emuhost::settings::ImportPolicyName;
use emuhost::watch::BackendKind;
use emuhost_lab::replay::{ReplayConfig, ReplayError, ReplayReport, replay};
use emuhost_lab::synth::{Synth, SynthConfig};
use emuhost_lab::trace::read_str;

const MIB: u64 = 1 << 20;

/// A short session (12 s, 900 pools).
fn short_synth(seed: u64) -> SynthConfig {
    let mut synth = SynthConfig::default().seed(seed);
    (synth.seconds, synth.load_seconds, synth.pools) = (12, 4, 900);
    synth
}

/// The seed's chunks policy with spans of `span_mb` (0: off).
fn cfg(watch: BackendKind, span_mb: u64) -> ReplayConfig {
    let mut c = ReplayConfig::default();
    c.settings.import.policy = ImportPolicyName::Chunks;
    c.settings.import.plan.span_cap = span_mb * MIB;
    c.settings.import_backend = BackendChoice::Only(ImportKind::Pin);
    c.settings.watch = Some(watch);
    c
}

/// The backends a test of every backend runs with here: those the kernel offers (the others print
/// why they are skipped; one the kernel offers that fails its self-test fails the test).
fn backends() -> impl Iterator<Item = BackendKind> {
    BackendKind::AUTO.into_iter().filter(|k| crate::watch_gate::usable(*k))
}

/// The best backend here, for tests that need one and do not care which.
fn best() -> BackendKind {
    backends().next().expect("mprotect works on every kernel")
}

fn run(text: &str, c: &ReplayConfig) -> Result<ReplayReport, ReplayError> {
    let (header, records) = read_str(text).unwrap();
    replay(&header, records.into_iter().enumerate().map(|(i, r)| Ok((i as u64 + 2, r))), c)
}

/// Two chunks joined by a pool across their end at 0x1002000000; pages written on two game
/// threads; collects over both pools; a binding across the chunk end in a later frame. Every
/// write is in a frame before the collect that covers it (a write beside a collect in the same
/// frame may be reported by two collects, when the collect re-arms a page between its bytes).
const SMALL: &str = "emuhost-trace 1 window=0x8000000000
0 g0 commit 0x1001000000 0x2000000 rw-
1 g0 pool 0x1001000000 0x800000
2 g0 pool 0x1001f00000 0x200000
3 r frame 0
4 r bind 0x1001000100 0x100
5 g0 write 0x1001000000 0x10
6 g1 write 0x1001003ff8 0x10
7 g1 write 0x1002000000 0x1
8 g0 sleep guest 20000 x5
9 h0 sleep host 50000
10 r frame 1
11 r collect 0x1001000000 0x800000
12 r collect 0x1001f00000 0x200000
13 r bind 0x1002000000 0x1000
14 r frame 2
15 g1 write 0x1001005000 0x2000
16 r frame 3
17 r collect 0x1001000000 0x2000000
18 r bind 0x1001ffff00 0x200
19 r frame 4
20 g0 unpool 0x1001f00000 0x200000
21 r frame 5
22 g0 decommit 0x1001f00000 0x100000
23 r frame 6
end 24
";

#[test]
fn a_small_trace_gives_known_counts() {
    for watch in backends() {
        // With spans: the first binding imports both chunks (the pool across their end), the rest
        // reuse it.
        let r = run(SMALL, &cfg(watch, 64)).unwrap();
        assert_eq!((r.imports, r.reimports), (1, 0), "{watch:?}");
        assert_eq!(r.live_import_bytes_peak, 32 * MIB);
        assert_eq!(r.frames.len(), 7);
        assert_eq!(r.collects, 3);
        // Pages 0x1001000, 0x1001003, 0x1001004 (a write across a page end), 0x1002000; then
        // 0x1001005 and 0x1001006.
        assert_eq!(r.writes, 6);
        assert_eq!(r.lost_writes, 0);
        assert_eq!(r.unchecked_writes, 0, "every write has a later collect");
        // Pinning the import faults its pages in for writing, which userfaultfd counts as written:
        // more pages than written may be reported, never fewer.
        assert!(r.pages_reported >= 6, "{watch:?}: {}", r.pages_reported);
        assert_eq!((r.guest_sleeps.count, r.host_sleeps.count), (5, 1));
        assert_eq!(r.zeroed_under_import, 1, "a decommit under a live import zeroes instead");
        assert_eq!(r.threads, 4);
        // Without spans: each chunk on its own, then the binding across their end imports both
        // again as one.
        let r = run(SMALL, &cfg(watch, 0)).unwrap();
        assert_eq!((r.imports, r.reimports), (3, 1), "{watch:?}");
    }
}

#[test]
fn the_pools_policy_serves_every_binding_with_no_reimport() {
    // 100 us an import and 1 ms/MiB: the 8 MiB pool is imported in part by its binding and whole
    // behind it (pools whole: no pieces); the 2 MiB pool is in the region of that binding, so it
    // is imported ahead (or, where the replay's bindings come first, in part by its own binding).
    let mut c = cfg(best(), 64);
    let cost = ImportCost {
        fixed: Duration::from_micros(100),
        untouched_per_mib: Duration::from_millis(1),
        populated_per_mib: Duration::from_millis(1),
    };
    c.settings.import.policy = ImportPolicyName::Pools;
    c.settings.import.pools = PoolsConfig::default().cost(Some(cost)).ahead_piece(0);
    let r = run(SMALL, &c).unwrap();
    // The binding across 0x1002000000 may come before the 2 MiB pool is whole: its part then
    // runs across the part the binding before it imported (one re-import).
    assert_eq!((r.bind_failures, r.lost_writes), (0, 0), "{r:?}");
    assert!(r.reimports <= 1, "{r:?}");
    assert!((2..=6).contains(&r.imports), "{r:?}");
    assert!(r.ahead_imports >= 1, "at least the 8 MiB pool whole: {r:?}");
    assert_eq!((r.live_imports_after_teardown, r.live_import_bytes_after_teardown), (0, 0));
    // In pieces of 1 MiB: the 8 MiB pool in eight of them, and still no binding fails or finds
    // a write lost.
    c.settings.import.pools = PoolsConfig::default().cost(Some(cost)).ahead_piece(1 << 20);
    let r = run(SMALL, &c).unwrap();
    assert_eq!((r.bind_failures, r.lost_writes), (0, 0), "{r:?}");
    assert!(r.reimports <= 1, "{r:?}");
    assert!(r.ahead_imports >= 8, "the 8 MiB pool in pieces: {r:?}");
    assert_eq!((r.live_imports_after_teardown, r.live_import_bytes_after_teardown), (0, 0));
}

#[test]
fn without_imports_uffd_reports_exactly_the_pages_written() {
    if !crate::watch_gate::usable(BackendKind::Uffd) {
        return;
    }
    let lines: Vec<&str> = SMALL.lines().filter(|l| !l.contains(" bind ") && !l.starts_with("end")).collect();
    let text = format!("{}\nend {}\n", lines.join("\n"), lines.len() - 1);
    let r = run(&text, &cfg(BackendKind::Uffd, 64)).unwrap();
    assert_eq!((r.imports, r.writes, r.lost_writes, r.pages_reported), (0, 6, 0, 6));
    assert_eq!(r.zeroed_under_import, 0, "no import: a decommit decommits");
}

#[test]
fn a_write_outside_committed_memory_is_an_error_naming_the_line() {
    let bad = "emuhost-trace 1
0 r frame 0
1 g0 write 0x2000 0x10
end 2
";
    let e = run(bad, &cfg(best(), 64)).unwrap_err();
    assert!(e.to_string().starts_with("line 3: write 0x2000+0x10 on g0 falls outside"), "{e}");
    // Committed in the same frame on another thread: not yet visible.
    let racy = "emuhost-trace 1
0 r frame 0
1 g1 commit 0x0 0x10000 rw-
2 g0 write 0x2000 0x10
end 3
";
    let e = run(racy, &cfg(best(), 64)).unwrap_err();
    assert!(e.to_string().starts_with("line 4:"), "{e}");
    // On the same thread, or a frame later, it is.
    let ok = "emuhost-trace 1
0 r frame 0
1 g1 commit 0x0 0x10000 rw-
2 g1 write 0x2000 0x10
3 r frame 1
4 g0 write 0x3000 0x10
5 g0 commit 0x20000 0x1000 r--
6 r frame 2
7 g0 write 0x20000 0x1
end 8
";
    let e = run(ok, &cfg(best(), 64)).unwrap_err();
    assert!(e.to_string().starts_with("line 9:"), "a read-only page is not writable: {e}");
    let unpool = "emuhost-trace 1
0 r frame 0
1 g0 unpool 0x0 0x1000
end 2
";
    let e = run(unpool, &cfg(best(), 64)).unwrap_err();
    assert!(e.to_string().contains("line 3: no pool 0x0+0x1000"), "{e}");
}

#[test]
fn a_short_synthetic_session_imports_less_with_spans() {
    let synth = short_synth(3);
    let text: String = {
        let s = Synth::new(synth).unwrap();
        let mut out = format!("{}\n", s.header());
        let mut n = 0;
        for r in s {
            out.push_str(&format!("{r}\n"));
            n += 1;
        }
        out + &format!("end {n}\n")
    };
    let on = run(&text, &cfg(best(), 64)).unwrap();
    let off = run(&text, &cfg(best(), 0)).unwrap();
    assert_eq!(on.lost_writes + off.lost_writes, 0);
    assert_eq!(on.reimports, 0);
    assert!(off.reimports > 0 && off.imports > on.imports, "spans on {} / off {} imports", on.imports, off.imports);
    assert_eq!(on.live_import_bytes_end, on.live_import_bytes_peak);
}

/// Replays `text` as a file is replayed: streamed, each record with its line, the reader's
/// errors among them (`run` reads the whole trace first).
fn run_streamed(text: &str, c: &ReplayConfig) -> Result<ReplayReport, ReplayError> {
    let mut reader = emuhost_lab::trace::Reader::new(std::io::Cursor::new(text.as_bytes().to_vec())).unwrap();
    let header = reader.header().clone();
    let records = std::iter::from_fn(move || {
        let r = reader.next()?;
        Some(r.map(|rec| (reader.line(), rec)))
    });
    replay(&header, records, c)
}

/// A window smaller than the import chunk: a trace with a line outside its own window is refused
/// naming that line (the trace's own mistake comes first), not the chunk; a trace whose lines all
/// fit is refused naming the chunk and the window.
#[test]
fn a_window_smaller_than_the_chunk_names_the_traces_own_bad_line_first() {
    let bad = "emuhost-trace 1 window=0x100000
0 g0 commit 0x0 0x1000 rw-
1 r frame 0
2 g0 commit 0x200000 0x1000 rw-
end 3
";
    let e = run_streamed(bad, &cfg(best(), 64)).unwrap_err().to_string();
    assert!(e.starts_with("line 4: commit 0x200000+0x1000 is outside the guest window 0x0..0x100000"), "{e}");
    let fits = "emuhost-trace 1 window=0x100000
0 g0 commit 0x0 0x1000 rw-
end 1
";
    let e = run_streamed(fits, &cfg(best(), 64)).unwrap_err().to_string();
    assert!(e.contains("import chunk 0x1000000") && e.contains("larger than the guest window 0x100000"), "{e}");
}

/// A short synthesized session with six game threads and three host threads, where the host
/// threads take a share of the game threads' writes and of the render thread's bindings and
/// collects: writes, bindings and collects on ten threads at once.
fn many_threads_session() -> (emuhost_lab::trace::Header, Vec<emuhost_lab::trace::Record>) {
    use emuhost_lab::trace::{Event, Thread};
    let mut synth = SynthConfig::default().seed(11);
    (synth.seconds, synth.load_seconds, synth.pools) = (8, 3, 600);
    (synth.game_threads, synth.host_threads) = (6, 3);
    (synth.writes_per_thread_frame, synth.collects_per_frame) = (6, 6);
    synth.guest_sleeps_per_s = 1000;
    let s = Synth::new(synth).unwrap();
    let header = s.header();
    let (mut renders, mut writes) = (0usize, 0usize);
    let records = s
        .map(|mut r| {
            match (r.thread, &r.event) {
                (Thread::Render, Event::Bind { .. } | Event::Collect { .. }) => {
                    renders += 1;
                    if renders % 4 != 0 {
                        r.thread = Thread::Host((renders % 4 - 1) as u16);
                    }
                }
                (Thread::Game(_), Event::Write { .. }) => {
                    writes += 1;
                    if writes % 3 == 0 {
                        r.thread = Thread::Host((writes / 3 % 3) as u16);
                    }
                }
                _ => {}
            }
            r
        })
        .collect();
    (header, records)
}

#[test]
fn a_session_on_many_threads_loses_no_write_and_leaks_no_import() {
    use emuhost_lab::trace::{Event, Thread};
    let (header, records) = many_threads_session();
    // What the trace asks for, and that every kind of event runs on several threads.
    let p = emuhost::space::page_size();
    let mut want_writes = 0;
    let mut want_collects = 0;
    let mut on: std::collections::BTreeMap<&str, std::collections::BTreeSet<Thread>> = Default::default();
    for r in &records {
        let kind = match r.event {
            Event::Write { addr, size } => {
                want_writes += (addr.0 + size).div_ceil(p) - addr.0 / p;
                "write"
            }
            Event::Collect { .. } => {
                want_collects += 1;
                "collect"
            }
            Event::Bind { .. } => "bind",
            _ => continue,
        };
        on.entry(kind).or_default().insert(r.thread);
    }
    assert!(on["write"].len() >= 9 && on["write"].iter().filter(|t| matches!(t, Thread::Host(_))).count() == 3);
    assert!(on["bind"].len() == 4 && on["collect"].len() == 4, "{on:?}");
    for watch in backends() {
        let mut c = cfg(watch, 64);
        c.settings.verify_collect = true;
        let numbered = records.iter().cloned().enumerate().map(|(i, r)| Ok((i as u64 + 2, r)));
        let r = replay(&header, numbered, &c).unwrap_or_else(|e| panic!("{watch:?}: {e}"));
        eprintln!(
            "{watch:?}: {} threads, {} writes ({} unchecked), {} collects, {} pages reported, {} imports",
            r.threads, r.writes, r.unchecked_writes, r.collects, r.pages_reported, r.imports
        );
        assert!(r.verify_collect, "every collect checked against a region query");
        assert_eq!(r.threads, 10);
        assert_eq!((r.writes, r.collects), (want_writes, want_collects), "{watch:?}");
        assert_eq!(r.lost_writes, 0, "{watch:?}: {} of {} writes lost", r.lost_writes, r.writes);
        // Every pool written is collected after the write (the synthesizer's rule): all writes
        // but the last frames' are checked.
        let checked = r.writes - r.unchecked_writes;
        assert!(r.checked_share() >= 0.99, "{watch:?}: {checked} of {} writes checked", r.writes);
        assert!(r.imports > 0 && r.live_import_bytes_peak > 0);
        assert_eq!(
            (r.live_imports_after_teardown, r.live_import_bytes_after_teardown),
            (0, 0),
            "{watch:?}: imports left live"
        );
    }
}
