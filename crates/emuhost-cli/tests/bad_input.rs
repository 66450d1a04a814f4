//! Bad input, class by class, as a user gives it: every case exits 2 with one `emuhost: error:`
//! (or clap's `error:`) message naming the value, or the file and line, and never panics.

use std::path::PathBuf;
use std::process::Command;

fn emuhost() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_emuhost"));
    c.env("EMUHOST_LOG", "warn").env("EMUHOST_IMPORT_BACKEND", "pin");
    for (k, _) in std::env::vars() {
        if k.starts_with("EMUHOST_") && k != "EMUHOST_LOG" && k != "EMUHOST_IMPORT_BACKEND" {
            c.env_remove(k);
        }
    }
    c
}

fn file(name: &str, text: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("emuhost-bad-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Runs `c`, expects exit 2 and every one of `says` in stderr, and no panic.
#[track_caller]
fn refused(mut c: Command, says: &[&str]) {
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{c:?}: exit {:?}, stderr:\n{err}", out.status);
    assert!(!err.contains("panicked"), "{c:?} panicked:\n{err}");
    assert!(err.contains("error"), "{c:?}: no error message:\n{err}");
    for s in says {
        assert!(err.contains(s), "{c:?}: stderr does not say {s:?}:\n{err}");
    }
}

fn args(list: &[&str]) -> Command {
    let mut c = emuhost();
    c.args(list);
    c
}

#[test]
fn bad_flags_are_named() {
    let missing = std::env::temp_dir().join("emuhost-no-such-folder/frames.csv");
    let missing = missing.to_str().unwrap();
    for (list, says) in [
        (&["replay", "--span-mib", "abc"][..], &["--span-mib", "\"abc\""][..]),
        // The old spelling still works (hidden), and the error names the flag as it is now.
        (&["replay", "--span-mb", "abc"][..], &["--span-mib", "\"abc\""][..]),
        (&["replay", "--watch", "fast"], &["--watch", "\"fast\""]),
        (&["replay", "--import-backend", "gpu"], &["--import-backend", "\"gpu\""]),
        (
            &["replay", "--set", "EMUHOST_WACTH=uffd"],
            &["--set", "\"EMUHOST_WACTH\" is not a switch", "did you mean EMUHOST_WATCH?"],
        ),
        (&["replay", "--set", "EMUHOST_WATCH"], &["--set", "\"EMUHOST_WATCH\" is not KEY=VALUE"]),
        (&["replay", "--csv", missing], &["--csv", "emuhost-no-such-folder", "does not exist"]),
        (&["replay", "--plot", "frames.gif"], &["--plot frames.gif", ".svg or .png"]),
        (&["replay", "--frobnicate"], &["--frobnicate"]),
        (&["ab", "--a", "EMUHOST_WATCH=fast", "--b", "EMUHOST_WATCH=uffd"], &["--a", "\"fast\""]),
        (&["ab", "--a", "EMUHOST_WATCH=uffd", "--b", "x"], &["--b", "\"x\" is not KEY=VALUE"]),
        (&["ab", "--a", "A=1", "--b", "B=2", "--rounds", "0"], &["'0'", "--rounds"]),
        (&["plan", "--pools", "/dev/null", "--bind", "0x1000:0x10", "--chunk-mib", "3"], &["--chunk-mib 3"]),
        (&["plan", "--pools", "/dev/null", "--bind", "4096"], &["\"4096\" is not ADDR:SIZE"]),
        (&["plan", "--pools", "/dev/null", "--bind", "0x1000:0"], &["the size is zero"]),
        (&["plan", "--pools", "/dev/null", "--bind", "0xfffffffffffffff0:0x20"], &["runs past the end"]),
        // The binding fits; its chunk cover does not, and the message says which.
        (
            &["plan", "--policy", "chunks", "--pools", "/dev/null", "--bind", "0xffffffffffffff00:0x10"],
            &["the chunk cover of binding 0xffffffffffffff00+0x10 (chunk 0x1000000) runs past the end"],
        ),
        // Under the pools policy the cover is in host pages.
        (
            &["plan", "--policy", "pools", "--pools", "/dev/null", "--bind", "0xfffffffffffffff0:0x8"],
            &["the chunk cover of binding 0xfffffffffffffff0+0x8 (chunk 0x1000) runs past the end"],
        ),
        (&["policy", "--cpus", "0"], &["'0'", "--cpus"]),
        (&["bench", "space", "--rounds", "0"], &["'0'", "--rounds"]),
        (&["trace", "stats", "--chunk-mib", "3"], &["--chunk-mib 3"]),
        (&["trace", "synth", "--seed", "x"], &["'x'", "--seed"]),
    ] {
        refused(args(list), says);
    }
}

#[test]
fn bad_switches_are_named_before_any_work() {
    for (k, v, says) in [
        ("EMUHOST_WATCH", "fast", "EMUHOST_WATCH=\"fast\" is not one of uffd, mprotect"),
        ("EMUHOST_VERIFY_COLLECT", "maybe", "EMUHOST_VERIFY_COLLECT=\"maybe\" is not one of"),
        ("EMUHOST_IMPORT_BACKEND", "gpu", "EMUHOST_IMPORT_BACKEND=\"gpu\""),
        ("EMUHOST_IMPORT_CHUNK_MB", "3", "EMUHOST_IMPORT_CHUNK_MB=\"3\": a power of two"),
        ("EMUHOST_IMPORT_SPAN_MB", "-1", "EMUHOST_IMPORT_SPAN_MB=\"-1\": an unsigned integer"),
        ("EMUHOST_IMPORT_COOLING_MS", "1s", "EMUHOST_IMPORT_COOLING_MS=\"1s\": an unsigned integer"),
        ("EMUHOST_IMPORT_POPULATE_AHEAD", "all", "EMUHOST_IMPORT_POPULATE_AHEAD=\"all\""),
        ("EMUHOST_LOG", "[[[", "EMUHOST_LOG=\"[[[\" is not a log filter"),
    ] {
        // `policy` touches no switch of these: the check is made up front, for every command.
        let mut c = args(&["policy"]);
        c.env(k, v);
        refused(c, &[says]);
        let mut c = args(&["replay"]);
        c.env(k, v);
        refused(c, &[says]);
    }
    // A name that is not a switch is only warned of: the environment is shared with other programs.
    let out = args(&["policy"]).env("EMUHOST_WACTH", "uffd").output().unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("warning: EMUHOST_WACTH is not a switch") && err.contains("did you mean EMUHOST_WATCH?"),
        "{err}"
    );
}

#[test]
fn a_chunk_larger_than_the_window_is_refused_naming_the_switch() {
    // 2^43 MiB: a power of two of bytes (2^63), so the switch parses; no binding could import it.
    let mut c = args(&["replay"]);
    c.env("EMUHOST_IMPORT_CHUNK_MB", "8796093022208").env("EMUHOST_IMPORT_BACKEND", "pin");
    refused(c, &["EMUHOST_IMPORT_CHUNK_MB=8796093022208", "larger than the guest window"]);
    // 2^44 MiB overflows bytes: refused up front.
    let mut c = args(&["policy"]);
    c.env("EMUHOST_IMPORT_CHUNK_MB", "17592186044416");
    refused(c, &["EMUHOST_IMPORT_CHUNK_MB=\"17592186044416\": too large"]);
}

const HEAD: &str = "emuhost-trace 1 window=0x8000000000\n";

#[test]
fn bad_trace_files_are_named_by_line() {
    // Malformed records: the reader refuses them, for a replay and for `trace stats` alike.
    // Records that parse but cannot be replayed (a write where nothing is committed): the replay.
    for (name, body, syntax, says) in [
        ("event.trace", "0 g0 frobnicate 0x1000\nend 1\n", true, &["line 2", "unknown event \"frobnicate\""][..]),
        ("prot.trace", "0 g0 commit 0x1000 0x1000 rwz\nend 1\n", true, &["line 2", "\"rwz\""]),
        ("number.trace", "0 g0 commit 0x10g0 0x1000 rw-\nend 1\n", true, &["line 2", "0x10g0"]),
        ("thread.trace", "0 q7 commit 0x1000 0x1000 rw-\nend 1\n", true, &["line 2", "q7"]),
        ("truncated.trace", "0 g0 commit 0x1000 0x1000 rw-\n", true, &["line 3", "truncated"]),
        ("count.trace", "0 g0 commit 0x1000 0x1000 rw-\nend 7\n", true, &["line 3", "7"]),
        ("align.trace", "0 g0 commit 0x1000 0x1001 rw-\nend 1\n", false, &["line 2", "0x1000+0x1001", "aligned"]),
        ("uncommitted.trace", "0 g0 write 0x1000 0x10\nend 1\n", false, &["line 2", "write 0x1000+0x10"]),
    ] {
        let p = file(name, format!("{HEAD}{body}").as_bytes());
        let mut says = says.to_vec();
        let shown = p.display().to_string();
        says.push(&shown);
        refused(args(&["replay", p.to_str().unwrap()]), &says);
        if syntax {
            refused(args(&["trace", "stats", p.to_str().unwrap()]), &says);
        }
    }
    for (name, text, says) in [
        ("version.trace", &b"emuhost-trace 9 window=0x8000000000\nend 0\n"[..], &["line 1", "version \"9\""][..]),
        ("garbage.trace", b"garbage\n", &["line 1", "not an emuhost trace"]),
        (
            "twice.trace",
            b"emuhost-trace 1 window=0x8000000000 window=0x1000000\nend 0\n",
            &["line 1", "header option \"window\" is given twice"],
        ),
        ("binary.trace", b"\x00\xff\xfe\n", &["line 1"]),
        ("zstd.trace", b"\x28\xb5\x2f\xfd garbage", &["line 1"]),
        ("empty.trace", b"", &["line 1"]),
    ] {
        let p = file(name, text);
        refused(args(&["replay", p.to_str().unwrap()]), says);
    }
    refused(args(&["replay", "/no/such/file.trace"]), &["/no/such/file.trace"]);
    refused(args(&["replay", std::env::temp_dir().to_str().unwrap()]), &["Is a directory"]);
}

/// A valid trace on more threads than the replay runs (one OS thread each; 20,000 game threads
/// aborted the process when the OS refused a thread): exit 2, naming the thread, its line, the
/// count and the cap, before a thread past the cap is asked for.
#[test]
fn a_trace_on_more_threads_than_the_replay_runs_is_refused() {
    let mut text = format!("{HEAD}0 r frame 0\n");
    for n in 0..20_000 {
        text.push_str(&format!("1 g{n} sleep guest 1\n"));
    }
    text.push_str("2 r frame 1\nend 20002\n");
    let p = file("threads.trace", text.as_bytes());
    // The render thread and g0..g1022 are 1,024 threads: g1023 (line 1026) is one too many.
    refused(args(&["replay", p.to_str().unwrap()]), &["line 1026", "g1023", "1025 threads", "1024"]);
}

#[test]
fn bad_pool_files_are_named_by_file_and_line() {
    for (name, text, says) in [
        ("zero.pools", &b"0x1000 0x1000\n0x2000 0\n"[..], &[":2:", "0x2000", "zero size"][..]),
        ("number.pools", b"# pools\n\nzz 1\n", &[":3:", "\"zz\""]),
        ("fields.pools", b"0x1000\n", &[":1:", "`LO SIZE`"]),
        ("wrap.pools", b"0xffffffffffffff00 0x100\n", &[":1:", "0xffffffffffffff00", "runs past"]),
        ("binary.pools", b"0x1000 0x1000\n\xff\xfe 1\n", &["binary.pools"]),
    ] {
        let p = file(name, text);
        let shown = p.display().to_string();
        let mut says = says.to_vec();
        says.push(&shown);
        refused(args(&["plan", "--pools", p.to_str().unwrap(), "--bind", "0x1000:0x10"]), &says);
    }
    refused(args(&["plan", "--pools", "/no/such.pools", "--bind", "0x1000:0x10"]), &["/no/such.pools"]);
}

#[test]
fn addresses_outside_the_window_are_named() {
    for (event, says) in [
        ("0 g0 commit 0x9000000000 0x1000 rw-", &["line 2", "0x9000000000+0x1000", "outside the guest window"][..]),
        ("0 g0 pool 0x7ffffff000 0x2000", &["line 2", "0x7ffffff000+0x2000", "outside the guest window"]),
        ("0 r bind 0x7ffffff000 0x2000", &["line 2", "0x7ffffff000+0x2000", "outside the guest window"]),
        ("0 r collect 0xffffffffffff0000 0x20000", &["line 2", "0xffffffffffff0000"]),
        ("0 g0 write 0x8000000000 0x10", &["line 2", "0x8000000000"]),
    ] {
        let p = file("window.trace", format!("{HEAD}{event}\nend 1\n").as_bytes());
        refused(args(&["replay", p.to_str().unwrap()]), says);
    }
    // A window smaller than the import chunk (16 MiB): the trace's own line outside it is named,
    // not the chunk.
    let p = file("small-window.trace", b"emuhost-trace 1 window=0x100000\n0 g0 commit 0x200000 0x1000 rw-\nend 1\n");
    let mut c = args(&["replay", p.to_str().unwrap()]);
    c.env("EMUHOST_IMPORT_POLICY", "chunks");
    refused(c, &["line 2", "0x200000+0x1000", "outside the guest window 0x0..0x100000"]);
    let out = args(&["replay", p.to_str().unwrap()]).env("EMUHOST_IMPORT_POLICY", "chunks").output().unwrap();
    assert!(!String::from_utf8_lossy(&out.stderr).contains("chunk"), "{}", String::from_utf8_lossy(&out.stderr));
    // A window the host cannot reserve is refused with its size.
    let p = file("huge.trace", b"emuhost-trace 1 window=0xffffffffffff0000\nend 0\n");
    refused(args(&["replay", p.to_str().unwrap()]), &["0xffffffffffff0000"]);
}

#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    // `emuhost trace stats | head -0`: the reader is gone before the first line is written.
    for list in [&["trace", "stats"][..], &["trace", "stats", "--json"], &["probe"], &["policy"]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = args(list).stdout(writer).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{list:?} panicked:\n{err}");
        assert_eq!(out.status.code(), Some(0), "{list:?}: {err}");
    }
}
