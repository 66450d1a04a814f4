//! `emuhost bench watch` as a user runs it: it measures the backends the kernel offers (each
//! passes its self-test), or only the one `EMUHOST_WATCH` names, says which it left out and why,
//! and runs the no-lost-writes stress with arms, disarms and releases racing the writers.

use std::process::{Command, Output};

/// A short run: one round over 8 MiB, the stress's fewest writes.
fn bench_watch(env: &[(&str, &str)], extra: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_emuhost"));
    c.args(["bench", "watch", "--rounds", "1", "--size-mib", "8", "--stress-writes", "1000"])
        .args(extra)
        .env("EMUHOST_LOG", "warn")
        .env_remove("EMUHOST_WATCH");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("running emuhost")
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn emuhost_watch_names_the_only_backend_measured_and_the_others_are_left_out_with_why() {
    if let Err(e) = emuhost::watch::self_test(emuhost::watch::BackendKind::Uffd) {
        eprintln!("skipped: uffd is not usable here: {e}");
        return;
    }
    let out = bench_watch(&[("EMUHOST_WATCH", "uffd")], &["--json"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["schema"], 1, "{v}");
    assert_eq!(v["backends"], serde_json::json!(["uffd"]), "{v}");
    assert!(v.get("mprotect").is_none(), "{v}");
    let left = v["left_out"].as_array().unwrap();
    assert!(
        left.iter().any(|l| l["backend"] == "mprotect" && l["why"] == "EMUHOST_WATCH=uffd measures uffd only"),
        "{v}"
    );
    // The stress ran its races and counted its lost writes.
    let u = &v["uffd"];
    assert_eq!(u["stress_lost_writes"], 0, "{v}");
    assert!(u["stress_writes_checked"].as_u64() > Some(0), "{v}");
    for op in ["arms", "disarms", "releases", "collects"] {
        assert!(u["stress_ops"][op].as_u64() > Some(0), "no {op}: {v}");
    }
    assert_eq!(v["lost_writes"], 0);
    // The bare kernel was measured on the same memory, and emuhost's cost over it printed.
    for key in ["clean_ns_per_page", "dirty_1pct_ns_per_dirty_page", "first_write_ns"] {
        assert!(u[format!("bare_{key}")].as_f64().is_some(), "no bare {key}: {v}");
    }
    for key in ["into_0pct_ns_per_page", "into_1pct_ns_per_page", "first_write_ns"] {
        assert!(v["uffd_over_bare"][key]["target_max"].as_f64().is_some(), "{key}: {v}");
    }
    // Whole collects and first writes take time, so their ratios are positive.
    for key in ["into_0pct_ns_per_page", "into_50pct_ns_per_page", "first_write_ns"] {
        let r = &v["uffd_over_bare"][key];
        assert!(r["ratio"].as_f64().is_some_and(|r| r > 0.0) && r["met"].is_boolean(), "{key}: {v}");
    }
}

#[test]
fn text_output_prints_the_lost_writes_of_each_backend_measured() {
    if let Err(e) = emuhost::watch::self_test(emuhost::watch::BackendKind::Uffd) {
        eprintln!("skipped: uffd is not usable here: {e}");
        return;
    }
    let out = bench_watch(&[("EMUHOST_WATCH", "UFFD")], &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The switch is named by its parsed value (settings are typed).
    assert!(stdout.contains("left out: mprotect (EMUHOST_WATCH=uffd measures uffd only)"), "{stdout}");
    let stress = stdout.lines().find(|l| l.contains("stress uffd")).unwrap_or_default();
    assert!(stress.ends_with(", 0 lost writes"), "{stdout}");
    assert!(stdout.contains(" arms, ") && stdout.contains(" disarms"), "{stdout}");
    assert!(stdout.contains("0 lost writes (0 lost): met"), "{stdout}");
    assert!(!stdout.contains("mprotect  "), "mprotect measured: {stdout}");
    assert!(stdout.contains("uffd over the bare kernel") && stdout.contains("first write"), "{stdout}");
}

#[test]
fn a_bad_emuhost_watch_or_rounds_is_exit_2_naming_it() {
    let out = bench_watch(&[("EMUHOST_WATCH", "fast")], &[]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("EMUHOST_WATCH=\"fast\""), "{stderr}");
    let out = bench_watch(&[], &["--rounds", "0"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--rounds"), "{stderr}");
}

/// A kernel without userfaultfd (before 6.7 it has no `WP_ASYNC`, here the fault switch makes
/// opening one fail): uffd is left out with its self-test's reason, and mprotect is measured.
#[cfg(feature = "faults")]
#[test]
fn without_userfaultfd_uffd_is_left_out_with_its_reason_and_mprotect_is_measured() {
    let out = bench_watch(&[("EMUHOST_FAULT_UFFD", "enosys")], &["--json"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["schema"], 1, "{v}");
    assert_eq!(v["backends"], serde_json::json!(["mprotect"]), "{v}");
    let left = v["left_out"].as_array().unwrap();
    let uffd = left.iter().find(|l| l["backend"] == "uffd").expect("uffd left out");
    assert!(uffd["why"].as_str().unwrap().contains("not available"), "{v}");
    assert_eq!(v["mprotect"]["stress_lost_writes"], 0, "{v}");
    assert_eq!(v["lost_writes"], 0);
}
