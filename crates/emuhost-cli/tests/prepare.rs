//! `emuhost prepare` and `emuhost bench prepare`, run as the built binary on lavapipe: the summary
//! and its JSON, exit 1 naming a broken shader, exit 2 on bad input, a user's corpus folder,
//! resumption and the warm cache through the command line. Without a Vulkan device the tests that
//! need one skip (the shared rule of `vulkan_gate`); bad input and files that are not emuhost's
//! are refused before a device is looked for, so those tests run anywhere.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

#[path = "../../emuhost/tests/support/vulkan.rs"]
mod vulkan_gate;

/// Whether the device a preparation would use opens here (in this process: the binary's own
/// choice is the same); `false`: the test skips, see `vulkan_gate`.
#[track_caller]
fn device() -> bool {
    vulkan_gate::vulkan_or_skip(emuhost_prepare::probe_device(None)).is_some()
}

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
    if !device() {
        return;
    }
    let out = emuhost(&["prepare", "--workers", "2", "--json"]);
    let v = json_of(&out, 0);
    assert_eq!(v["schema"], 1, "{v}");
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
    if !device() {
        return;
    }
    let out = emuhost(&["prepare", "--broken-translate", "1", "--broken-compile", "1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("FAILED p0001 [translate]") && stdout.contains("wrong"), "{stdout}");
    assert!(stdout.contains("[compile]") && stdout.contains("WG=4096"), "{stdout}");
    assert!(stdout.contains("compile     33 pipelines"), "{stdout}");
}

#[test]
fn a_corpus_folder_with_an_edited_shader() {
    if !device() {
        return;
    }
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
    if !device() {
        return;
    }
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
    // A corrupt file of emuhost's: a warning, a cold start, the run goes on.
    let mut corrupt = std::fs::read(&cache).unwrap();
    *corrupt.last_mut().unwrap() ^= 0x10;
    std::fs::write(&cache, corrupt).unwrap();
    let out = emuhost(&["prepare", "--cache", c, "--json"]);
    let v = json_of(&out, 0);
    assert_eq!(v["cache"]["state"], "rejected");
    assert!(String::from_utf8_lossy(&out.stderr).contains("discarded"));
    assert_eq!(v["compile"]["pipelines"], 36);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_prepare_sweeps_cold_and_warm() {
    if !device() {
        return;
    }
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
    if !device() {
        return;
    }
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

/// `--cache FILE` where FILE, FILE.journal or FILE.tmp is a file emuhost did not write: exit 2
/// naming it, the file as it was. Refused before a device is looked for: runs anywhere.
#[test]
fn a_cache_path_holding_a_users_file_is_refused() {
    let dir = scratch("users-file");
    let cache = dir.join("notes.txt");
    let text = "a user's notes, not a pipeline cache\n";
    for suffix in ["", ".journal", ".tmp"] {
        let path = PathBuf::from(format!("{}{suffix}", cache.display()));
        std::fs::write(&path, text).unwrap();
        let out = emuhost(&["prepare", "--cache", cache.to_str().unwrap(), "--programs", "1", "--variants", "1"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{suffix}: {stderr}");
        assert!(stderr.contains(path.to_str().unwrap()) && stderr.contains("not emuhost's"), "{suffix}: {stderr}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text, "{suffix}: left as it was");
        std::fs::remove_file(&path).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--generate DIR` over files that are there: exit 2 naming one, nothing written; `--force`
/// writes over them. Needs no device.
#[test]
fn generate_does_not_write_over_files_without_force() {
    let dir = scratch("generate");
    let corpus = dir.join("corpus");
    let generate = |extra: &[&str]| {
        let mut args = vec!["prepare", "--generate", corpus.to_str().unwrap(), "--programs", "2", "--variants", "1"];
        args.extend(extra);
        emuhost(&args)
    };
    assert_eq!(generate(&[]).status.code(), Some(0));
    let source = corpus.join("p0000.wgsl");
    std::fs::write(&source, "// edited by hand\n").unwrap();
    let out = generate(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("exists") && stderr.contains(corpus.to_str().unwrap()), "{stderr}");
    assert_eq!(std::fs::read_to_string(&source).unwrap(), "// edited by hand\n", "left as it was");
    let out = generate(&["--force"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_ne!(std::fs::read_to_string(&source).unwrap(), "// edited by hand\n", "--force writes over it");
    let out = emuhost(&["prepare", "--force"]);
    assert_eq!(out.status.code(), Some(2), "--force needs --generate");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The skip rule itself, on a machine made one without a device for the purpose (the loader
/// pointed at no driver): a test that needs one skips and says why; with
/// `EMUHOST_REQUIRE_VULKAN=1` it fails; a value that is not 1, 0 or empty fails naming it.
#[test]
fn without_a_device_a_test_skips_or_fails_as_required() {
    let run = |require: Option<&str>| {
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.args(["prepares_the_default_corpus_and_reports", "--exact", "--nocapture", "--test-threads=1"])
            .env("VK_ICD_FILENAMES", "/nonexistent")
            .env("VK_DRIVER_FILES", "/nonexistent")
            .env_remove("VK_ADD_DRIVER_FILES")
            .env_remove("EMUHOST_REQUIRE_VULKAN");
        if let Some(v) = require {
            c.env("EMUHOST_REQUIRE_VULKAN", v);
        }
        let out = c.output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    };
    for unset in [None, Some(""), Some("0")] {
        let (passed, text) = run(unset);
        assert!(passed && text.contains("1 passed"), "{unset:?}: {text}");
        assert!(text.contains("skipped: no Vulkan device: "), "{unset:?}: the skip says why: {text}");
    }
    let (passed, text) = run(Some("1"));
    assert!(!passed && text.contains("EMUHOST_REQUIRE_VULKAN=1 and no Vulkan device: "), "{text}");
    let (passed, text) = run(Some("yes"));
    assert!(!passed && text.contains("EMUHOST_REQUIRE_VULKAN=\"yes\": expected 1, 0 or empty"), "{text}");
}
