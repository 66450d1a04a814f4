//! `emuhost prepare` and `emuhost bench prepare`, run as the built binary on lavapipe: the summary
//! and its JSON, exit 1 naming a broken shader, exit 2 on bad input, a user's corpus folder,
//! resumption and the warm cache through the command line.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn emuhost(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_emuhost")).args(args).env("EMUHOST_LOG", "warn").output().expect("running emuhost")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("emuhost-cli-prepare-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn json_of(out: &Output, code: i32) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(code), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

#[test]
fn prepares_the_default_corpus_and_reports() {
    let out = emuhost(&["prepare", "--workers", "2", "--json"]);
    let v = json_of(&out, 0);
    assert_eq!(v["programs"], 12);
    assert_eq!(v["variants"], 36);
    assert_eq!(v["compile"]["pipelines"], 36);
    assert_eq!(v["translate"]["variants"], 36);
    assert_eq!(v["workers"], 2);
    assert_eq!(v["workers_why"], "2 workers: --workers");
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > 1 << 20);
    assert!(v["translate"]["wall_ms"].as_f64().unwrap() > 0.0 && v["compile"]["wall_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(v["failures"].as_array().unwrap().len(), 0);
    // Not a terminal: no progress bar on stderr.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("compile") && !stderr.contains("translate"), "{stderr}");

    // Without --workers the rule decides, and its log line says why.
    let out = Command::new(env!("CARGO_BIN_EXE_emuhost"))
        .args(["prepare", "--programs", "2", "--variants", "1"])
        .env("EMUHOST_LOG", "info")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("sched: prepare_workers:"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("prepared 2 programs, 2 variants") && stdout.contains("peak memory"), "{stdout}");
}

#[test]
fn a_broken_shader_is_named_and_the_run_goes_on_exit_1() {
    let out = emuhost(&["prepare", "--broken-translate", "1", "--broken-compile", "1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("FAILED p0001 [translate]") && stdout.contains("wrong"), "{stdout}");
    assert!(stdout.contains("[compile]") && stdout.contains("WG=4096"), "{stdout}");
    assert!(stdout.contains("compile     33 pipelines"), "{stdout}");
}

#[test]
fn a_corpus_folder_with_an_edited_shader() {
    let dir = scratch("folder");
    let corpus = dir.join("corpus");
    let out = emuhost(&["prepare", "--generate", corpus.to_str().unwrap(), "--programs", "3", "--variants", "2"]);
    assert_eq!(out.status.code(), Some(0));
    let path = corpus.join("p0000.wgsl");
    let src = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, src.replace("return a + b;", "return a + ;")).unwrap();
    let v = json_of(&emuhost(&["prepare", corpus.to_str().unwrap(), "--json", "--workers", "1"]), 1);
    let f = &v["failures"][0];
    assert_eq!(f["program"], "p0000");
    assert_eq!(f["phase"], "translate");
    assert!(f["error"].as_str().unwrap().contains("p0000.wgsl") || f["error"].as_str().unwrap().contains("expected"));
    assert_eq!(v["compile"]["pipelines"], 4, "the other programs' variants");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_input_exits_2_naming_it() {
    for (args, named) in [
        (&["prepare", "--workers", "0"][..], "0"),
        (&["prepare", "--variants", "x"][..], "x"),
        (&["prepare", "/nonexistent-corpus"][..], "/nonexistent-corpus"),
    ] {
        let out = emuhost(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?}: {stderr}");
    }
    let dir = scratch("badmanifest");
    std::fs::write(dir.join("corpus.txt"), "emuhost-corpus 1\nprogram a a.hlsl\n").unwrap();
    let out = emuhost(&["prepare", dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("line 2") && stderr.contains("a.hlsl"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resumes_and_reuses_the_cache_through_the_command_line() {
    let dir = scratch("resume");
    let cache = dir.join("c.vkpc");
    let c = cache.to_str().unwrap();
    let first =
        json_of(&emuhost(&["prepare", "--cache", c, "--stop-after", "7", "--checkpoint-every", "3", "--json"]), 0);
    assert_eq!(first["interrupted"], true);
    let made = first["compile"]["pipelines"].as_u64().unwrap();
    assert!(made >= 7);
    let second = json_of(&emuhost(&["prepare", "--cache", c, "--json"]), 0);
    assert_eq!(second["journal"]["state"], "resumed");
    assert_eq!(second["journal"]["skipped"].as_u64().unwrap(), made);
    assert_eq!(second["compile"]["pipelines"].as_u64().unwrap(), 36 - made);
    assert_eq!(second["cache"]["state"], "warm");
    let third = emuhost(&["prepare", "--cache", c]);
    let stdout = String::from_utf8_lossy(&third.stdout);
    assert_eq!(third.status.code(), Some(0));
    assert!(stdout.contains("warm cache:"), "the warm run says so: {stdout}");
    // A corrupt file: a warning, a cold start, the run goes on.
    std::fs::write(&cache, vec![0xa5u8; 4096]).unwrap();
    let out = emuhost(&["prepare", "--cache", c, "--json"]);
    let v = json_of(&out, 0);
    assert_eq!(v["cache"]["state"], "rejected");
    assert!(String::from_utf8_lossy(&out.stderr).contains("discarded"));
    assert_eq!(v["compile"]["pipelines"], 36);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_prepare_sweeps_cold_and_warm() {
    let out = emuhost(&[
        "bench",
        "prepare",
        "--programs",
        "2",
        "--variants",
        "2",
        "--statements",
        "4",
        "--rounds",
        "1",
        "--workers",
        "1,2",
        "--json",
    ]);
    let v = json_of(&out, 0);
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (r, w) in rows.iter().zip([1, 2]) {
        assert_eq!(r["workers"], w);
        for kind in ["cold", "warm"] {
            assert_eq!(r[kind]["pipelines"], 4, "{r}");
            assert!(r[kind]["total_ms"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r[kind]["peak_mib"].as_f64().unwrap() > 1.0, "{r}");
        }
    }
    assert_eq!(rows[0]["cold"]["speedup"], 1.0);
    assert!(v["prepare_workers"].as_u64().unwrap() >= 1);
}

#[test]
fn a_killed_run_resumes_from_its_journal() {
    let dir = scratch("killed");
    let cache = dir.join("c.vkpc");
    let journal = dir.join("c.vkpc.journal");
    let c = cache.to_str().unwrap();
    let shape = ["--programs", "100", "--variants", "4", "--statements", "4", "--workers", "1"];
    let mut child = Command::new(env!("CARGO_BIN_EXE_emuhost"))
        .args(["prepare", "--cache", c, "--checkpoint-every", "2"])
        .args(shape)
        .env("EMUHOST_LOG", "off")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait for a few saves (the journal's header and at least two keys), then kill it (SIGKILL:
    // no chance to save anything more).
    let journaled = || std::fs::read_to_string(&journal).map_or(0, |t| t.matches('\n').count().saturating_sub(1));
    while journaled() < 2 {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before it could be killed");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let keys = journaled();
    assert!((2..400).contains(&keys), "{keys}");
    let mut args = vec!["prepare", "--cache", c, "--json"];
    args.extend(shape);
    let v = json_of(&emuhost(&args), 0);
    assert_eq!(v["cache"]["state"], "warm", "{v}");
    assert_eq!(v["journal"]["state"], "resumed", "{v}");
    assert_eq!(v["journal"]["skipped"].as_u64().unwrap() as usize, keys);
    assert_eq!(v["compile"]["pipelines"].as_u64().unwrap() as usize, 400 - keys);
    assert!(!journal.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
