//! `emuhost bench sleep` as a user runs it: every way to wait, the library's and the alternatives
//! a user would compare it with, measured in one run, with the learned margin and the targets.

use std::process::Command;

#[test]
fn bench_sleep_measures_the_learned_hybrid_beside_spin_sleep_in_one_run() {
    let out = Command::new(env!("CARGO_BIN_EXE_emuhost"))
        .args(["bench", "sleep", "--rounds", "1", "--short-sleeps", "100", "--long-sleeps", "100"])
        .args(["--frame-ms", "10", "--sleepers", "1", "--json"])
        .env("EMUHOST_LOG", "warn")
        .output()
        .expect("running emuhost");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["schema"], 1, "{v}");
    // Under Wine the figures are said to be Wine's; on Linux they are this machine's.
    let wine = emuhost::probe::wine_version();
    assert_eq!(v["wine"].as_str(), wine.as_deref(), "{v}");
    assert_eq!(v["figures"].as_str().is_some_and(|f| f.contains("not Windows' timings")), wine.is_some(), "{v}");
    let methods: Vec<(u64, &str)> = v["sleeps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["sleep_us"].as_u64().unwrap(), r["method"].as_str().unwrap()))
        .collect();
    for us in [20, 1000] {
        for m in ["yield", "timer", "hybrid", "hybrid, learned", "std::thread::sleep", "spin_sleep"] {
            assert!(methods.contains(&(us, m)), "{m} at {us} µs missing: {v}");
        }
    }
    let learned = v["learned_margin_us"].as_f64().unwrap();
    assert!((2.0..=1000.0).contains(&learned), "{v}");
    for t in ["host_1ms_hybrid_beats_spin_sleep", "host_1ms_hybrid_p99_le_10us", "host_1ms_hybrid_cpu_le_0_05"] {
        assert!(v["targets"][t].is_boolean(), "{t}: {v}");
    }
}
