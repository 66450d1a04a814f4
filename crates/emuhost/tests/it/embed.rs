//! The embedding example (`examples/embed.rs`), run as a test: the emulator's own window at a
//! fixed base, adopted; its own `SIGSEGV` handler forwarding to `handle_fault` (emuhost installs
//! none); two caches collecting into their own bitmap words while a guest thread writes; its own
//! `VkDevice` importing through emuhost (skipped without a device unless
//! `EMUHOST_REQUIRE_VULKAN=1`). In a child process: the handler and the fixed base are the
//! process's.

#[path = "../../examples/embed.rs"]
mod example;

const CHILD: &str = "EMUHOST_EMBED_TEST_CHILD";

#[test]
fn an_emulator_adopts_its_window_handles_its_faults_and_imports_on_its_own_device() {
    let name = "embed::an_emulator_adopts_its_window_handles_its_faults_and_imports_on_its_own_device";
    if std::env::var_os(CHILD).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("test result: ok. 1 passed"), "child: {:?}\n{text}", out.status);
        eprintln!("{text}");
        return;
    }
    let r = example::run().unwrap();
    eprintln!("{r:#?}");
    assert!(r.handler_kept, "emuhost replaced the emulator's SIGSEGV handler");
    let mprotect = r.tracked.iter().find(|t| t.backend == emuhost::watch::BackendKind::Mprotect).expect("mprotect ran");
    assert!(mprotect.faults_taken as u64 >= mprotect.writes, "{mprotect:?}");
    for t in &r.tracked {
        assert!(t.writes > 0, "{t:?}");
        assert_eq!((t.lost_buffer_pages, t.lost_texture_grains), (0, 0), "{t:?}");
    }
    if let Some(n) = r.imported {
        assert!(n > 0);
        assert_eq!(r.wrong_bytes, 0, "bytes read through the emulator's device differ from the guest's");
    }
    assert!(!r.failed());
}
