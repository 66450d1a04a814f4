//! `emuhost policy`, run as the built binary: the JSON contract, the rule over the flags, and
//! exit status 2 naming a bad value.

use std::process::{Command, Output};

fn policy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_emuhost"))
        .arg("policy")
        .args(args)
        // The flag stands in for the switch; make sure the environment cannot.
        .env("EMUHOST_SHORT_SLEEP_TIMER", "1")
        .env("EMUHOST_LOG", "off")
        .output()
        .expect("running emuhost")
}

/// Runs it, checks exit 0 and one JSON object on stdout with exactly the contract's keys.
fn json(args: &[&str]) -> serde_json::Value {
    let out = policy(args);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{args:?}: {stdout} {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.lines().count(), 1, "one line: {stdout}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let o = v.as_object().unwrap();
    let mut keys: Vec<_> = o.keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(keys, ["prepare_workers", "schema", "short_sleep", "why"], "{stdout}");
    assert_eq!(o["schema"], 1, "{stdout}");
    let ss = o["short_sleep"].as_object().unwrap();
    assert_eq!(ss.len(), 2, "{stdout}");
    assert!(["timer", "yield"].contains(&ss["guest"].as_str().unwrap()), "{stdout}");
    assert!(["timer", "yield", "hybrid"].contains(&ss["host"].as_str().unwrap()), "{stdout}");
    assert!(o["prepare_workers"].as_u64().unwrap() >= 1, "{stdout}");
    assert!(!o["why"].as_str().unwrap().is_empty());
    // The keys in the contract's order.
    assert!(stdout.starts_with("{\"schema\":1,"), "{stdout}");
    let (a, b, c) = (
        stdout.find("\"short_sleep\"").unwrap(),
        stdout.find("\"prepare_workers\"").unwrap(),
        stdout.find("\"why\"").unwrap(),
    );
    assert!(a < b && b < c, "{stdout}");
    v
}

fn sleeps(v: &serde_json::Value) -> (String, String) {
    (v["short_sleep"]["guest"].as_str().unwrap().into(), v["short_sleep"]["host"].as_str().unwrap().into())
}

#[test]
fn this_machine() {
    json(&[]);
}

#[test]
fn unset_switch_follows_the_processor_count() {
    let exact = sleeps(&json(&["--cpus", "1"])).1;
    assert!(exact == "hybrid" || exact == "yield", "the host's exact wait: {exact}");
    for n in 1..=16 {
        let (guest, host) = sleeps(&json(&["--cpus", &n.to_string()]));
        assert_eq!(guest, if n <= 6 { "timer" } else { "yield" }, "--cpus {n}");
        assert_eq!(host, exact, "--cpus {n}");
    }
}

#[test]
fn set_switch_decides_for_guest_and_host() {
    for cpus in ["2", "6", "7", "16"] {
        for v in ["", " ", "0", " 0 ", "false", "FALSE", "off", "OFF", "no", "No"] {
            let got = sleeps(&json(&["--cpus", cpus, "--short-sleep-timer", v]));
            assert_eq!(got, ("yield".into(), "yield".into()), "--cpus {cpus} --short-sleep-timer {v:?}");
        }
        for v in ["1", "on", "true", "yes", "timer", " On ", "-1"] {
            let got = sleeps(&json(&["--cpus", cpus, "--short-sleep-timer", v]));
            assert_eq!(got, ("timer".into(), "timer".into()), "--cpus {cpus} --short-sleep-timer {v:?}");
        }
    }
    // `--flag=` is the empty value too.
    assert_eq!(sleeps(&json(&["--cpus", "2", "--short-sleep-timer="])), ("yield".into(), "yield".into()));
}

#[test]
fn workers_follow_the_rule() {
    let w = |args: &[&str]| json(args)["prepare_workers"].as_u64().unwrap();
    assert_eq!(w(&["--cpus", "16", "--available-mib", "65536", "--allocator", "locked"]), 8);
    assert_eq!(w(&["--cpus", "1", "--available-mib", "65536", "--allocator", "locked"]), 1);
    assert_eq!(w(&["--cpus", "16", "--available-mib", "4096", "--allocator", "scales"]), 8);
    assert_eq!(w(&["--cpus", "16", "--available-mib", "4863", "--allocator", "scales"]), 8);
    assert_eq!(w(&["--cpus", "16", "--available-mib", "4864", "--allocator", "scales"]), 9);
    assert_eq!(w(&["--cpus", "16", "--available-mib", "65536", "--allocator", "scales"]), 16);
    assert_eq!(w(&["--cpus", "64", "--available-mib", "1048576", "--allocator", "scales"]), 32);
    assert_eq!(w(&["--cpus", "12", "--available-mib", "0", "--allocator", "scales"]), 6);
    // The cap of 32 holds for both allocators, at the largest count the flag takes.
    for allocator in ["locked", "scales"] {
        let v = json(&["--cpus", "1048576", "--available-mib", "1048576", "--allocator", allocator]);
        assert_eq!(v["prepare_workers"], 32, "{allocator}: {v}");
        assert!(v["why"].as_str().unwrap().contains("limited to 32"), "{allocator}: {v}");
    }
}

#[test]
fn bad_values_exit_2_naming_them() {
    for (args, named) in [
        (&["--cpus", "abc"][..], "abc"),
        (&["--cpus", "0"][..], "0"),
        (&["--cpus", "-3"][..], "-3"),
        (&["--cpus", ""][..], "--cpus"),
        (&["--available-mib", "lots"][..], "lots"),
        (&["--available-mib", "-1"][..], "-1"),
        (&["--allocator", "fast"][..], "fast"),
        (&["--short-sleep-timer"][..], "--short-sleep-timer"),
    ] {
        let out = policy(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}: nothing on stdout");
        assert!(stderr.contains(named), "{args:?}: {stderr} must name {named:?}");
    }
}
