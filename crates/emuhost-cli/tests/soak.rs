//! `emuhost replay --soak`: a short soak of a tiny trace, as a user runs it.

use std::process::Command;

/// Two chunks joined by a pool, writes on two game threads, a collect and bindings: one import
/// per loop (pinned), released at each loop's end.
const TINY: &str = "emuhost-trace 1 window=0x8000000000
0 g0 commit 0x1001000000 0x2000000 rw-
1 g0 pool 0x1001000000 0x800000
2 g0 pool 0x1001f00000 0x200000
3 r frame 0
4 r bind 0x1001000100 0x100
5 g0 write 0x1001000000 0x10
6 g1 write 0x1002000000 0x1
7 r frame 1
8 r collect 0x1001000000 0x2000000
9 r bind 0x1002000000 0x1000
10 r frame 2
11 r bind 0x1001ffff00 0x200
12 r frame 3
end 13
";

/// Runs the soak over the tiny trace, in a file of the test's own (`name`): tests run in parallel.
fn soak(name: &str, args: &[&str]) -> std::process::Output {
    let dir = std::env::temp_dir().join(format!("emuhost-soak-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let t = dir.join("tiny.trace");
    std::fs::write(&t, TINY).unwrap();
    Command::new(env!("CARGO_BIN_EXE_emuhost"))
        .arg("replay")
        .arg(&t)
        .args(args)
        .env("EMUHOST_LOG", "warn")
        .env("EMUHOST_IMPORT_BACKEND", "pin")
        .output()
        .unwrap()
}

#[test]
fn a_short_soak_prints_every_loop_and_passes() {
    let out = soak("table", &["--soak", "2s"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("soak: ") && lines[0].contains("loops of"), "{text}");
    assert!(text.contains("(malloc_trim)"), "{text}");
    let header = lines.iter().position(|l| l.contains("RSS MiB") && l.contains("live imports")).expect("a table");
    let rows: Vec<Vec<&str>> = lines[header + 1..]
        .iter()
        .take_while(|l| !l.starts_with("summary"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    // Many loops of a trace this small in two seconds; every Nth shown past 40.
    assert!(rows.len() >= 2, "{text}");
    assert_eq!(rows[0][0], "1");
    for r in &rows {
        // loop, wall, CPU, RSS, untrimmed, heap, free, locked, live imports, live MiB, writes, lost, error
        let mib = |i: usize| r[i].parse::<f64>().unwrap();
        assert!(mib(2) >= 0.0, "CPU s: {r:?}");
        assert!(mib(3) > 0.0 && mib(4) >= mib(3), "RSS, untrimmed: {r:?}");
        // With mimalloc (--features mimalloc) Rust's allocations are not glibc's to count.
        assert!(cfg!(feature = "mimalloc") || mib(5) > 0.0, "the allocator has something in use: {r:?}");
        assert_eq!((r[8], r[9], r[10], r[11], r[12]), ("0", "0.0", "2", "0", "-"), "{r:?}");
    }
    for want in [
        "RSS after loop 1",
        "max RSS after it",
        "growth",
        "allocator in use",
        "live imported at the end 0 bytes",
        "check: passed",
    ] {
        assert!(text.contains(want), "{want:?} missing:\n{text}");
    }
}

#[test]
fn a_soak_reports_json_and_passes_flags_on() {
    let out = soak("json", &["--soak", "1s", "--json", "--watch", "mprotect"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["schema"], 1, "{v}");
    // The keys other tools read: the same set as before the report was a struct, and `schema`.
    let keys = |o: &serde_json::Value| {
        let mut k: Vec<String> = o.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k.join(" ")
    };
    assert_eq!(
        keys(&v),
        "elapsed_s errors failures heap_in_use_first_mib heap_in_use_growth_mib heap_in_use_max_after_mib \
         import_backend live_import_bytes_end live_imports_end loops lost_writes passed rss_first_mib \
         rss_growth_allowed_mib rss_growth_mib rss_growth_pct rss_max_after_mib rss_max_loop rust_allocator \
         schema soak_s trim watch_backend"
    );
    assert_eq!(
        keys(&v["loops"][0]),
        "cpu_s error heap_free_mib heap_in_use_mib import_backend live_import_bytes live_imports locked_mib \
         loop lost_writes rss_mib rss_untrimmed_mib wall_s watch_backend writes"
    );
    assert_eq!(v["watch_backend"], "mprotect");
    assert_eq!(
        (v["passed"].as_bool(), v["errors"].as_u64(), v["live_import_bytes_end"].as_u64()),
        (Some(true), Some(0), Some(0))
    );
    let loops = v["loops"].as_array().unwrap();
    assert!(loops.len() >= 2 && v["elapsed_s"].as_f64().unwrap() >= 1.0, "{v}");
    // Each loop's CPU time (the process's, getrusage): a second of loops used some.
    let cpu: f64 = loops.iter().map(|l| l["cpu_s"].as_f64().unwrap()).sum();
    assert!(cpu > 0.0 && loops.iter().all(|l| l["cpu_s"].as_f64().unwrap() >= 0.0), "{v}");
    for l in loops {
        assert_eq!((l["live_imports"].as_u64(), l["lost_writes"].as_u64()), (Some(0), Some(0)), "{l}");
        assert!(l["rss_mib"].as_f64().unwrap() > 0.0);
        assert!(cfg!(feature = "mimalloc") || l["heap_in_use_mib"].as_f64().unwrap() > 0.0, "{l}");
    }
    assert!(v["rss_growth_allowed_mib"].as_f64().unwrap() >= 32.0);
    assert!(v["heap_in_use_growth_mib"].as_f64().unwrap() < 32.0, "{v}");
}

/// RSS before and after the allocator's free memory is given back: with the trim (the default)
/// most loops give some back (the replay's threads leave freed chunks in their arenas), with
/// `--no-trim` none do. In a build with mimalloc, glibc's malloc holds next to nothing of the
/// replay's, so only the flag is checked there (`tests/heap.rs` of the library checks the trim
/// itself).
#[test]
fn a_soak_trims_after_each_loop_unless_told_not_to() {
    let given_back = |l: &serde_json::Value| l["rss_untrimmed_mib"].as_f64().unwrap() - l["rss_mib"].as_f64().unwrap();
    let out = soak("trim", &["--soak", "1s", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["trim"], true);
    let loops = v["loops"].as_array().unwrap();
    // The two reads of RSS are apart in time and the process's other threads (the log's, the
    // allocator's) may touch a page between them: a trim gives back, or nothing, give or take
    // that (a mimalloc build once read 0.06 MiB more after the trim than before it).
    assert!(loops.iter().all(|l| given_back(l) >= -1.0), "{v}");
    let trimmed = loops.iter().filter(|l| given_back(l) > 0.0).count();
    assert!(
        cfg!(feature = "mimalloc") || trimmed * 2 >= loops.len(),
        "{trimmed} of {} loops gave memory back: {v}",
        loops.len()
    );
    let allocator = if cfg!(feature = "mimalloc") { "mimalloc" } else { "system" };
    assert_eq!(v["rust_allocator"], allocator);

    let out = soak("notrim", &["--soak", "1s", "--json", "--no-trim"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["trim"], false);
    assert!(v["loops"].as_array().unwrap().iter().all(|l| given_back(l) == 0.0), "{v}");
    // --no-trim is a soak's flag alone.
    let out = soak("notrim", &["--no-trim"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_bad_duration_is_exit_2_naming_it() {
    for bad in ["10x", "0", "1.5x"] {
        let out = soak("bad", &["--soak", bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains(&format!("--soak \"{bad}\"")), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let out = soak("bad", &["--soak", "1s", "--csv", "x.csv"]);
    assert_eq!(out.status.code(), Some(2));
}
