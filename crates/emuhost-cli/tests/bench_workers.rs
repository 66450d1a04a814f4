//! `emuhost bench workers` as a user runs it: every worker count measured; on Windows both heaps
//! in one run (this exe, whose manifest asks for the segment heap, and a copy without the
//! manifest), each arm naming the heap its process had. And the manifest itself: `emuhost.exe`
//! carries `heapType` `SegmentHeap`, and a copy with it taken out still runs.

use std::path::PathBuf;
use std::process::Command;

/// The built `emuhost`. A cross-built test under Wine gets the build machine's path (`/work/...`):
/// Wine's drive Z: is that machine's root.
fn emuhost() -> PathBuf {
    let p = env!("CARGO_BIN_EXE_emuhost");
    if cfg!(windows) && p.starts_with('/') { PathBuf::from(format!("Z:{}", p.replace('/', "\\"))) } else { p.into() }
}

fn json_of(out: &std::process::Output) -> serde_json::Value {
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
    // The report (not an arm's round, which its parent reads).
    if v["bench"] == "workers" {
        assert_eq!(v["schema"], 1, "{v}");
    }
    v
}

fn workers_of(results: &serde_json::Value) -> Vec<u64> {
    results.as_array().unwrap().iter().map(|r| r["workers"].as_u64().unwrap()).collect()
}

#[test]
fn bench_workers_measures_every_count_and_on_windows_both_heaps() {
    let out = Command::new(emuhost())
        .args(["bench", "workers", "--rounds", "2", "--jobs", "2", "--max-workers", "2", "--json"])
        .env("EMUHOST_LOG", "warn")
        .output()
        .expect("running emuhost");
    let v = json_of(&out);
    assert_eq!(workers_of(&v["results"]), [1, 2], "{v}");
    for r in v["results"].as_array().unwrap() {
        assert!(r["median_ms"].as_f64().unwrap() > 0.0, "{v}");
    }
    if cfg!(not(windows)) {
        assert!(v.get("arms").is_none(), "Linux runs one arm: {v}");
        return;
    }
    let arms = v["arms"].as_array().unwrap();
    assert_eq!(arms.len(), 2, "{v}");
    assert_eq!((&arms[0]["arm"], &arms[1]["arm"]), (&"manifest".into(), &"no manifest".into()), "{v}");
    assert_eq!(arms[0]["exe_asks_segment_heap"], true, "this exe's manifest asks for the segment heap: {v}");
    assert_eq!(arms[1]["exe_asks_segment_heap"], false, "{v}");
    assert_eq!(workers_of(&arms[1]["results"]), [1, 2], "{v}");
    assert_eq!(v["time_ratios"].as_array().unwrap().len(), 2, "{v}");
    let kinds: Vec<&str> = arms.iter().map(|a| a["heap"]["kind"].as_str().unwrap()).collect();
    if v["wine"].is_string() {
        // Wine ignores heapType: both processes have Wine's heap, and the figures are Wine's.
        assert_eq!(kinds, ["wine", "wine"], "{v}");
        assert_eq!(v["figures"], "Wine's", "{v}");
    } else {
        // Windows 10 2004 and later honour the manifest; the copy has the NT heap unless the
        // system forces the segment heap on every process.
        assert_eq!(v["figures"], "Windows'", "{v}");
        assert!(kinds.iter().all(|k| ["segment", "nt", "unknown"].contains(k)), "{v}");
    }
}

/// The manifest is in the built exe (the resource `RT_MANIFEST` 1), and the bench's other arm is
/// a copy without it that still runs, as its own process with its own heap.
#[cfg(windows)]
#[test]
fn emuhost_exe_asks_for_the_segment_heap_and_a_copy_without_the_manifest_runs() {
    use emuhost::probe::{exe_manifest, strip_manifest};

    let exe = emuhost();
    let manifest = exe_manifest(&exe).unwrap().expect("emuhost.exe has no manifest");
    let text = String::from_utf8_lossy(&manifest);
    assert!(
        text.contains(
            r#"<heapType xmlns="http://schemas.microsoft.com/SMI/2020/WindowsSettings">SegmentHeap</heapType>"#
        ),
        "{text}"
    );
    assert!(text.contains(r#"<assemblyIdentity name="emuhost""#), "{text}");
    let dir = std::env::temp_dir().join(format!("emuhost-test-manifest-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("emuhost.exe");
    std::fs::copy(&exe, &copy).unwrap();
    strip_manifest(&copy).unwrap();
    assert_eq!(exe_manifest(&copy).unwrap(), None);
    let out = Command::new(&copy)
        .args(["bench", "workers", "--jobs", "1", "--max-workers", "1", "--arm-round", "0"])
        .env("EMUHOST_LOG", "warn")
        .output()
        .expect("running the copy");
    let _ = std::fs::remove_dir_all(&dir);
    let v = json_of(&out);
    assert_eq!(v["workers"], serde_json::json!([1]), "{v}");
    assert!(v["heap"]["signature"].is_string(), "the heap's header was read: {v}");
}
