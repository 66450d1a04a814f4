//! The `EMUHOST_FAULT_*` switches, run as a user runs them: a bad one is an error naming it (in
//! every build), and with the `faults` feature a replay runs under the faults and recovers.

use std::process::Command;

fn emuhost() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_emuhost"));
    c.env("EMUHOST_LOG", "warn").env("EMUHOST_IMPORT_BACKEND", "pin").env_remove("EMUHOST_WATCH");
    c
}

#[test]
fn a_bad_fault_switch_stops_emuhost_with_exit_2_naming_it() {
    let out = emuhost().arg("probe").env("EMUHOST_FAULT_UFFD", "sometimes").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("EMUHOST_FAULT_UFFD"), "{err}");
}

#[cfg(feature = "faults")]
#[test]
fn a_replay_under_the_commit_userfaultfd_and_foreign_sigsegv_faults_recovers() {
    const TRACE: &str = "emuhost-trace 1 window=0x8000000000
0 g0 commit 0x1001000000 0x2000000 rw-
1 r frame 0
2 g0 write 0x1001000000 0x10
3 r collect 0x1001000000 0x2000000
4 r frame 1
5 g0 write 0x1001001000 0x10
6 r collect 0x1001000000 0x2000000
7 r frame 2
end 8
";
    let dir = std::env::temp_dir().join(format!("emuhost-cli-faults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let t = dir.join("faults.trace");
    std::fs::write(&t, TRACE).unwrap();
    let out = emuhost()
        .arg("replay")
        .arg(&t)
        .arg("--json")
        .env("EMUHOST_LOG", "warn,emuhost::watch=info")
        .env("EMUHOST_FAULT_COMMIT_ENOMEM", "1")
        .env("EMUHOST_FAULT_UFFD", "eperm")
        .env("EMUHOST_FAULT_FOREIGN_SEGV", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((v["lost_writes"].as_u64(), v["frames"].as_u64()), (Some(0), Some(3)), "{v}");
    assert!(err.contains("fault injected: commit system call 1 fails with ENOMEM"), "{err}");
    let choice = err.lines().find(|l| l.contains("write tracking: mprotect (")).unwrap_or_default();
    assert!(choice.contains("Operation not permitted"), "{err}");
}

#[cfg(feature = "faults")]
#[test]
fn a_replay_goes_on_past_bindings_whose_import_fails() {
    // Three bindings in three chunks, then the first chunk again: import 2 fails, its binding goes
    // without (cooling holds the range), the replay goes on to the end and releases everything.
    const TRACE: &str = "emuhost-trace 1 window=0x8000000000
0 g0 commit 0x1000000000 0x4000000 rw-
1 r frame 0
2 r bind 0x1000000000 0x1000
3 r bind 0x1001000000 0x1000
4 r frame 1
5 r bind 0x1002000000 0x1000
6 r bind 0x1001000000 0x1000
7 r frame 2
end 8
";
    let dir = std::env::temp_dir().join(format!("emuhost-cli-faults-bind-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let t = dir.join("binds.trace");
    std::fs::write(&t, TRACE).unwrap();
    let out = emuhost()
        .arg("replay")
        .arg(&t)
        .arg("--json")
        .env("EMUHOST_IMPORT_CHUNK_MB", "1")
        .env("EMUHOST_FAULT_IMPORT", "2")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["frames"], 3, "{v}");
    // Binding 2 failed; binding 4 found its range cooling.
    assert_eq!((v["imports"].as_u64(), v["import_failures"].as_u64()), (Some(2), Some(1)), "{v}");
    assert_eq!(v["bind_failures"], 2, "{v}");
    assert!(err.contains("fault injected: import 2"), "{err}");
}
