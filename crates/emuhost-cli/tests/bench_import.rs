//! `emuhost bench import` as a user runs it, short: its collects beside commits and pins measure
//! every arm (each pins, collects and commits) and report the figures of each.

use std::process::Command;

#[test]
fn bench_import_measures_collects_beside_commits_and_pins_in_every_arm() {
    let out = Command::new(env!("CARGO_BIN_EXE_emuhost"))
        .args(["bench", "import", "--rounds", "1", "--sizes-mib", "1", "--no-session"])
        .args([
            "--chain-rounds",
            "1",
            "--chain-ms",
            "300",
            "--chain-pin-mib",
            "2",
            "--chain-piece-kib",
            "512",
            "--json",
        ])
        .env("EMUHOST_IMPORT_BACKEND", "pin")
        .env("EMUHOST_LOG", "warn")
        .output()
        .expect("running emuhost");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
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
