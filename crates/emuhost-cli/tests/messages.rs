//! What `emuhost` says, as a user reads it: log lines without colour codes where stderr is not a
//! terminal (or `NO_COLOR` is set), a failed write naming its path, `-o` for `--out`, and `ab`
//! naming the arm and the signal when a replay dies on one.

use std::io::Write as _;
use std::process::{Command, Output};

fn emuhost(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_emuhost"));
    c.args(args).env("EMUHOST_IMPORT_BACKEND", "pin").env_remove("NO_COLOR");
    c
}

fn run(mut c: Command) -> (Output, String) {
    let out = c.output().expect("running emuhost");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stderr)
}

#[test]
fn log_lines_carry_no_colour_codes_into_a_pipe() {
    let (out, stderr) = run({
        let mut c = emuhost(&["policy"]);
        c.env("EMUHOST_LOG", "info");
        c
    });
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("sched: prepare_workers:"), "the log line is there: {stderr}");
    assert!(!stderr.contains('\x1b'), "no escape codes into a pipe: {stderr:?}");
}

/// On a terminal (util-linux's `script` gives the command one), colour unless `NO_COLOR` is set.
#[test]
fn no_color_turns_colour_off_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        // Written to stderr itself, past the test harness's capture, so the skip shows.
        let _ = writeln!(
            std::io::stderr(),
            "skipped: util-linux's `script` is not installed (it gives the command a terminal)"
        );
        return;
    }
    let on_a_terminal = |no_color: Option<&str>| {
        let cmd = format!("{} policy", env!("CARGO_BIN_EXE_emuhost"));
        let mut c = Command::new("script");
        c.args(["-qec", &cmd, "/dev/null"]).env("EMUHOST_LOG", "info").env_remove("NO_COLOR");
        if let Some(v) = no_color {
            c.env("NO_COLOR", v);
        }
        let out = c.output().expect("running script");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(out.status.code(), Some(0), "{text}");
        assert!(text.contains("sched: prepare_workers:"), "{text}");
        text
    };
    assert!(on_a_terminal(None).contains('\x1b'), "a terminal gets colour");
    assert!(on_a_terminal(Some("")).contains('\x1b'), "NO_COLOR empty is as unset");
    let plain = on_a_terminal(Some("1"));
    assert!(!plain.contains('\x1b'), "NO_COLOR=1: {plain:?}");
}

#[test]
fn trace_synth_takes_o() {
    let path = std::env::temp_dir().join(format!("emuhost-messages-{}.trace", std::process::id()));
    let (out, stderr) = run(emuhost(&["trace", "synth", "--seconds", "2", "-o", path.to_str().unwrap()]));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(text.starts_with("emuhost-trace 1") && text.trim_end().lines().last().unwrap().starts_with("end "));
}

#[test]
fn trace_synth_names_the_path_it_cannot_write() {
    let (out, stderr) = run(emuhost(&["trace", "synth", "--seconds", "2", "--out", "/dev/full"]));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("/dev/full") && stderr.contains("No space left on device"), "{stderr}");
}

/// A replay that dies on a signal: `ab` names the arm, its switches and the signal. The child is
/// limited to 1 s of CPU time (`ulimit -S -t 1`: the soft limit, whose signal is SIGXCPU), which a replay of the built-in session passes, so
/// the kernel ends it with SIGXCPU; `ab` itself waits and stays far below the limit.
#[test]
fn ab_names_the_arm_and_the_signal_a_replay_died_on() {
    let cmd = format!(
        "ulimit -c 0 && ulimit -S -t 1 && exec {} ab --rounds 1 --a EMUHOST_SHORT_SLEEP_TIMER=0 --b EMUHOST_SHORT_SLEEP_TIMER=1",
        env!("CARGO_BIN_EXE_emuhost")
    );
    let mut c = Command::new("sh");
    c.args(["-c", &cmd]).env("EMUHOST_IMPORT_BACKEND", "pin").env("EMUHOST_LOG", "off");
    let (out, stderr) = run(c);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("arm A (EMUHOST_SHORT_SLEEP_TIMER=0): the replay failed, killed by signal: 24 (SIGXCPU)"),
        "{stderr}"
    );
    assert!(!stderr.contains("[(\""), "no Rust debug list: {stderr}");
}
