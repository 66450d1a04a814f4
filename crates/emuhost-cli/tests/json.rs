//! The JSON outputs not covered by their commands' own tests: each is one object with `schema`
//! first and the keys other tools read.

use std::process::Command;

fn json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_emuhost")).args(args).env("EMUHOST_LOG", "off").output().unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{args:?}: {stdout} {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with("{\"schema\":1,"), "{args:?}: {stdout}");
    serde_json::from_str(&stdout).unwrap()
}

#[test]
fn probe_json_keeps_its_keys() {
    let v = json(&["probe", "--json"]);
    let o = v.as_object().unwrap();
    for k in ["kernel", "page_size", "cpus", "region_queries", "watch", "watch_self_tests", "import"] {
        assert!(o.contains_key(k), "{k} missing: {v}");
    }
    #[cfg(target_os = "linux")]
    for k in ["uffd_features", "uffd_wp_async", "uffd_wp_unpopulated", "pagemap_scan", "procmap_query", "thp"] {
        assert!(o.contains_key(k), "{k} missing: {v}");
    }
    #[cfg(windows)]
    for k in ["placeholders", "write_watch"] {
        assert!(o.contains_key(k), "{k} missing: {v}");
    }
    // An offer: ok and its value, or ok false and why.
    let cpus = &v["cpus"];
    assert!(cpus["ok"] == true && cpus["value"].as_u64().unwrap() >= 1 || cpus["why"].is_string(), "{v}");
    assert!(v["import"]["ok"].is_boolean() && v["import"]["choice"].is_string(), "{v}");
    assert!(v["watch"]["why"].is_string(), "{v}");
}

#[test]
fn trace_stats_json_keeps_its_keys() {
    let v = json(&["trace", "stats", "--json"]);
    assert_eq!(v["chunk_mib"], 16, "{v}");
    assert!(v["frames"].as_u64().unwrap() > 0 && v["committed_bytes"].as_u64().is_some(), "{v}");
}
