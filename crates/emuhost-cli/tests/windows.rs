//! `emuhost.exe` on Windows as a user runs it (under Wine in CI: `.ci/windows test8`): the
//! commands whose Linux subject has a Windows counterpart measure that counterpart, and what has
//! none is left out saying why.
#![cfg(windows)]

use std::process::{Command, Output};

fn emuhost(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_emuhost"))
        .args(args)
        .env("EMUHOST_LOG", "warn")
        .env_remove("EMUHOST_WATCH")
        .output()
        .expect("running emuhost")
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// Whether this Windows has placeholders (shared views): Wine 10 does, Wine 8 does not.
fn placeholders() -> bool {
    matches!(emuhost::probe::Probe::run().placeholders, emuhost::probe::Offer::Yes(()))
}

#[test]
fn replay_help_names_windows_write_tracking_backends() {
    let out = emuhost(&["replay", "--help"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("(EMUHOST_WATCH): writewatch, guard"), "{stdout}");
    assert!(!stdout.contains("uffd"), "{stdout}");
}

/// `bench watch` measures writewatch and guard, with guard over writewatch in the ratio column;
/// the stress runs where shared views can be mapped and is left out, saying why, where not.
#[test]
fn bench_watch_measures_writewatch_and_guard() {
    let args = ["bench", "watch", "--rounds", "1", "--size-mib", "8", "--stress-writes", "1000"];
    let out = emuhost(&[&args[..], &["--json"]].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["backends"], serde_json::json!(["writewatch", "guard"]), "{v}");
    for kind in ["writewatch", "guard"] {
        assert!(v[kind]["clean_ns_per_page"].as_f64().is_some(), "{kind}: {v}");
        assert!(v[kind]["first_write_ns"].as_f64().is_some(), "{kind}: {v}");
    }
    if placeholders() {
        assert!(v["stress_left_out"].is_null(), "{v}");
        assert_eq!(v["writewatch"]["stress_lost_writes"], 0, "{v}");
    } else {
        assert!(v["stress_left_out"].as_str().is_some_and(|w| w.contains("placeholders")), "{v}");
        assert!(v["writewatch"].get("stress_lost_writes").is_none(), "{v}");
    }
    assert_eq!(v["lost_writes"], 0, "{v}");

    let out = emuhost(&args);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let head = stdout.lines().find(|l| l.contains("writewatch") && l.contains("guard")).unwrap_or_default();
    assert!(head.trim_end().ends_with("ratio"), "no ratio column: {stdout}");
    let clean = stdout.lines().find(|l| l.trim_start().starts_with("clean_ns_per_page")).unwrap_or_default();
    assert!(clean.trim_end().ends_with('x'), "no guard/writewatch ratio: {stdout}");
    assert!(!stdout.contains("uffd clean page"), "Linux's targets: {stdout}");
    assert!(stdout.contains("0 lost writes"), "{stdout}");
}

/// `bench space` measures the commit (and the shared views where placeholders exist) and leaves
/// out the region-query comparison, Linux's two ways, naming Windows' one.
#[test]
fn bench_space_leaves_out_linux_region_queries() {
    let args = ["bench", "space", "--rounds", "1", "--window-gib", "1", "--stride-mib", "64", "--shared-pages", "16"];
    let out = emuhost(&[&args[..], &["--json"]].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["region_queries"], "VirtualQuery", "{v}");
    let names: Vec<&str> = v["left_out"].as_array().unwrap().iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert!(names.iter().any(|n| n.contains("PROCMAP_QUERY")), "{v}");
    assert_eq!(names.iter().any(|n| n.contains("shared pages")), !placeholders(), "{v}");
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), if placeholders() { 2 } else { 1 }, "{v}");
    assert!(results[0]["name"].as_str().unwrap().starts_with("commit over a fragmented"), "{v}");

    let out = emuhost(&args);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("left out: region queries: PROCMAP_QUERY"), "{stdout}");
}

/// A trace in a 4 GiB window: small enough that Wine's own table of page protections (a byte
/// per page of every reservation it has placed, never given back) cannot make the soak's resident
/// memory grow past its allowance when a loop's window lands somewhere new.
const TINY: &str = "emuhost-trace 1 window=0x100000000
0 g0 commit 0x1000000 0x2000000 rw-
1 g0 pool 0x1000000 0x800000
3 r frame 0
4 r bind 0x1000100 0x100
5 g0 write 0x1000000 0x10
6 g1 write 0x2000000 0x1
7 r frame 1
8 r collect 0x1000000 0x2000000
9 r frame 2
end 9
";

/// The soak reads the working set and the process's CPU time (GetProcessMemoryInfo,
/// GetProcessTimes) and says how the heap is given back on Windows.
#[test]
fn soak_reads_the_working_set_and_cpu_time() {
    let dir = std::env::temp_dir().join(format!("emuhost-win-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let t = dir.join("tiny.trace");
    std::fs::write(&t, TINY).unwrap();
    let t = t.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_emuhost"));
        c.args(["replay", t, "--soak", "1s"]).args(extra).env("EMUHOST_LOG", "warn");
        c.env("EMUHOST_IMPORT_BACKEND", "pin").output().unwrap()
    };
    let out = run(&["--json"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["watch_backend"], "writewatch", "{v}");
    let loops = v["loops"].as_array().unwrap();
    assert!(!loops.is_empty(), "{v}");
    for l in loops {
        assert!(l["rss_mib"].as_f64().unwrap() > 0.0, "{l}");
        assert!(l["cpu_s"].as_f64().is_some_and(|c| c >= 0.0), "{l}");
    }
    let out = run(&[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("(HeapCompact of the process heap)") && stdout.contains("working set"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}
