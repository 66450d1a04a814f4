//! `emuhost bench import` as a user runs it, short: its collects beside commits and pins measure
//! every arm (each pins, collects and commits) and report the figures of each.

use std::process::Command;

/// `emuhost bench import --rounds 1 --sizes-mib 1 --no-session --json` and `args`, with the pin
/// backend: its JSON.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_emuhost"))
        .args(["bench", "import", "--rounds", "1", "--sizes-mib", "1", "--no-session", "--json"])
        .args(args)
        .env("EMUHOST_IMPORT_BACKEND", "pin")
        .env("EMUHOST_LOG", "warn")
        .output()
        .expect("running emuhost");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["schema"], 1, "{v}");
    v
}

#[test]
fn bench_import_measures_collects_beside_commits_and_pins_in_every_arm() {
    let chain = ["--chain-rounds", "1", "--chain-ms", "300", "--chain-pin-mib", "2", "--chain-piece-kib", "512"];
    let v = bench_json(&[&chain[..], &["--beside-rounds", "0"]].concat());
    let chain = &v["chain"];
    assert_eq!((chain["backend"].as_str(), chain["pinned_mib"].as_u64()), (Some("pin"), Some(2)), "{v}");
    assert_eq!(chain["piece_kib"].as_u64(), Some(512), "{v}");
    for arm in ["old", "new", "pieces"] {
        let a = &chain[arm];
        assert!(a["pins_per_s"].as_f64().unwrap() > 0.0, "{arm}: no pin: {v}");
        for f in ["collect_ms_p50", "collect_ms_p99", "collect_ms_worst", "change_ms_p99", "change_ms_worst"] {
            assert!(a[f].as_f64().is_some_and(|x| x > 0.0), "{arm} {f}: {v}");
        }
    }
    assert_eq!(chain["new"]["arm"], "pin as a long read");
    assert_eq!(chain["pieces"]["arm"], "pieces as long reads");
}

#[test]
fn bench_import_times_a_small_import_beside_each_background_size_and_beside_live_imports() {
    let beside = ["--beside-rounds", "2", "--beside-ms", "150", "--beside-kib", "0,64,512", "--beside-live", "20"];
    let v = bench_json(&[&beside[..], &["--chain-rounds", "0"]].concat());
    let beside = &v["beside"];
    assert_eq!((beside["backend"].as_str(), beside["rounds"].as_u64()), (Some("pin"), Some(2)), "{v}");
    let arms = beside["arms"].as_array().unwrap();
    let names: Vec<&str> = arms.iter().map(|a| a["arm"].as_str().unwrap()).collect();
    assert_eq!(names, ["beside nothing", "beside 64 KiB", "beside 512 KiB", "alone, 20 live"], "{v}");
    for a in arms {
        for f in ["import_ms_p50", "import_ms_p99", "import_ms_worst", "release_ms_p50", "release_ms_worst"] {
            assert!(a[f].as_f64().is_some_and(|x| x > 0.0), "{} {f}: {v}", a["arm"]);
        }
        let background = a["beside_kib"].as_u64().unwrap() > 0;
        for f in ["background_import_ms", "background_release_ms", "background_mib_per_s"] {
            // The background's figures exist where a background thread ran, and only there.
            assert_eq!(a[f].as_f64().is_some_and(|x| x > 0.0), background, "{} {f}: {v}", a["arm"]);
        }
    }
    assert_eq!(arms[0]["import_worst_ratio"].as_f64(), Some(1.0), "{v}");
    assert_eq!(arms[3]["live"].as_u64(), Some(20), "{v}");
}

#[test]
fn bench_import_refuses_a_background_size_past_4_gib_naming_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_emuhost"))
        .args(["bench", "import", "--beside-kib", "0,4194305"])
        .output()
        .expect("running emuhost");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("4194305"));
}
