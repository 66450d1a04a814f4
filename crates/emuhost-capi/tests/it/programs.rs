//! The C and C++17 smoke programs (`tests/c/smoke.c`, `tests/cpp/smoke.cpp`) compiled with the
//! system's `cc` and `c++` (or `$CC`, `$CXX`) against the libraries this very test build made, the
//! shared one and the static one, and run.
//!
//! Cargo builds this crate's library, with all its crate types (`cdylib`, `staticlib`, `rlib`),
//! before the test binary that links it, into the `deps` folder beside that binary; so a fresh
//! `cargo test --workspace` finds both libraries there, built with the same profile and features.
//! The Vulkan part needs the Vulkan headers and a device; without them it is skipped, unless
//! `EMUHOST_REQUIRE_VULKAN=1` (the rule of `crates/emuhost/tests/support/vulkan.rs`).

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../../../emuhost/tests/support/vulkan.rs"]
mod vulkan;

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the repository root")
}

/// The folder holding `libemuhost_capi.so` and `libemuhost_capi.a` of this build.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary's folder").to_path_buf();
    for dir in [deps.clone(), deps.parent().unwrap_or(&deps).to_path_buf()] {
        if dir.join("libemuhost_capi.so").is_file() && dir.join("libemuhost_capi.a").is_file() {
            return dir;
        }
    }
    panic!("no libemuhost_capi.so and libemuhost_capi.a beside {} or in its parent", exe.display());
}

fn out_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("capi-programs");
    std::fs::create_dir_all(&d).expect("the programs' folder");
    d
}

#[track_caller]
fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed ({}):\n{text}", out.status);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether `cc` finds the Vulkan headers; where not, a missing device's rule decides (skip, or
/// fail with `EMUHOST_REQUIRE_VULKAN=1`).
/// `name`: the probe's own file (the C and the C++ tests run at once: with one file, one's write
/// could empty it under the other's compile, which then found headers that are not there).
fn vulkan_headers(cc: &str, name: &str) -> bool {
    let probe = out_dir().join(format!("probe-{name}.c"));
    std::fs::write(&probe, "#include <vulkan/vulkan.h>\nint main(void) { return 0; }\n").unwrap();
    let ok = Command::new(cc).args(["-fsyntax-only"]).arg(&probe).status().is_ok_and(|s| s.success());
    if !ok {
        let missing: Result<(), std::io::Error> =
            Err(std::io::Error::other("the Vulkan headers are missing (apt-get install libvulkan-dev)"));
        vulkan::vulkan_or_skip(missing);
    }
    ok
}

/// Builds `source` (C or C++) against the shared and the static library and runs each, the
/// second with `EMUHOST_WATCH=mprotect` (the C program reads its settings from the environment).
/// Returns the two outputs.
fn build_and_run(source: &str, cpp: bool) -> [String; 2] {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiler = if cpp { std::env::var("CXX").unwrap_or_else(|_| "c++".into()) } else { cc.clone() };
    let (root, lib, out) = (root(), lib_dir(), out_dir());
    let name = if cpp { "cpp" } else { "c" };
    let std = if cpp { "-std=c++17" } else { "-std=c11" };
    let vk = vulkan_headers(&cc, name);
    let mut extra: Vec<PathBuf> = Vec::new();
    if vk {
        let obj = out.join(format!("vkdev-{name}.o"));
        run(Command::new(&cc)
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-c"])
            .arg(root.join("tests/c/vkdev.c"))
            .arg("-o")
            .arg(&obj));
        extra.push(obj);
    }
    // The shared library's SONAME (libemuhost_capi.so.0.MINOR) is the name the loader looks for:
    // a link of that name to the build's libemuhost_capi.so, as an installed prefix has.
    let loader_dir = out.join(format!("lib-{name}"));
    std::fs::create_dir_all(&loader_dir).expect("the loader's folder");
    let link = loader_dir.join(crate::version::soname());
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(lib.join("libemuhost_capi.so"), &link).expect("the SONAME's link");
    let mut outputs = [String::new(), String::new()];
    for (i, linkage) in ["shared", "static"].into_iter().enumerate() {
        let exe = out.join(format!("smoke-{name}-{linkage}"));
        let mut cmd = Command::new(&compiler);
        cmd.args([std, "-Wall", "-Wextra", "-Werror", "-pedantic", "-D_GNU_SOURCE"])
            .arg("-I")
            .arg(root.join("include"))
            .arg("-I")
            .arg(root.join("tests/c"))
            .arg(root.join(source))
            .args(&extra)
            .arg("-o")
            .arg(&exe);
        if !vk {
            cmd.arg("-DSMOKE_NO_VULKAN");
        }
        if linkage == "shared" {
            cmd.arg(format!("-L{}", lib.display()))
                .arg("-lemuhost_capi")
                .arg(format!("-Wl,-rpath,{}", loader_dir.display()));
        } else {
            // What the Rust standard library needs from the system (`rustc --print native-static-libs`).
            cmd.arg(lib.join("libemuhost_capi.a")).args([
                "-lgcc_s",
                "-lutil",
                "-lrt",
                "-lpthread",
                "-lm",
                "-ldl",
                "-lc",
            ]);
        }
        if vk {
            cmd.arg("-lvulkan");
        }
        cmd.arg("-lpthread");
        run(&mut cmd);
        let mut go = Command::new(&exe);
        // Cargo's LD_LIBRARY_PATH for tests names target/debug too, where a `cargo build` leaves
        // its own (maybe older) libemuhost_capi.so, and it outranks the program's run path.
        go.env("LD_LIBRARY_PATH", &loader_dir);
        if linkage == "static" && !cpp {
            go.env("EMUHOST_WATCH", "mprotect");
        }
        outputs[i] = run(&mut go);
        let text = &outputs[i];
        let collected = if cpp {
            "collect: 256 pages written from 2 threads, 256 reported to a consumer\ncollect: 256 pages written from 2 threads, 256 reported to a consumer\ncollect: 0 lost"
        } else {
            "collect: 256 pages written from 2 threads, 256 queried, 256 collected, 0 lost"
        };
        let version = format!("version: header {0}, library {0}: compatible\n", env!("CARGO_PKG_VERSION"));
        let snapshot = "pages taken, written over and restored (";
        for line in [collected, "rule: guest ", "smoke: ok", &version, snapshot, "bytes equal\n"] {
            assert!(text.contains(line), "{linkage} {name}: no {line:?} in:\n{text}");
        }
        assert!(text.contains("backend: uffd\n") || text.contains("backend: mprotect\n"), "{text}");
        if vulkan::vulkan_required() {
            assert!(text.contains("read back through the GPU"), "{linkage} {name}:\n{text}");
        }
    }
    outputs
}

#[test]
fn the_c_program_runs_against_both_libraries() {
    let [shared_run, static_run] = build_and_run("tests/c/smoke.c", false);
    // The environment reached the settings: the static run was told to use mprotect. Its
    // faults went through the program's own handler to emuhost_handle_fault (256 writes, at
    // least one fault each).
    assert!(static_run.contains("backend: mprotect\n"), "{static_run}");
    let handed =
        static_run.split("lost; ").nth(1).and_then(|t| t.split(' ').next()).and_then(|n| n.parse::<u32>().ok());
    assert!(handed.is_some_and(|n| n >= 256), "{static_run}");
    for run in [&shared_run, &static_run] {
        assert!(run.contains("fault handle: deleted twice and a tracker passed as one: refused\n"), "{run}");
        for line in [
            "pages collected, its 2 among them\n",
            "change: the program's own mprotect marked in flight: ok\n",
            "; host wait hybrid\n",
        ] {
            assert!(run.contains(line), "no {line:?} in:\n{run}");
        }
    }
}

#[test]
fn the_cpp_program_runs_against_both_libraries() {
    for run in build_and_run("tests/cpp/smoke.cpp", true) {
        for line in [
            "bytes into armed memory, page 300 collected\n",
            "hybrid: host wait hybrid\n",
            "bytes: a vector, an array of words, a string, a C array and a pointer written and read back\n",
            "fault handle: owned, deleted with its owner\n",
        ] {
            assert!(run.contains(line), "no {line:?} in:\n{run}");
        }
    }
}

/// `tests/c/ignored_error.c` ignores the error of `emuhost_space_reserve`: under
/// `-Werror=unused-result` (EMUHOST_MUST_USE is `warn_unused_result`) neither `cc` nor `c++` compiles
/// it, naming the call; without the flag both do (a warning), so the refusal is the attribute's.
#[test]
fn an_ignored_error_fails_to_compile() {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let root = root();
    for (compiler, lang) in [(cc, "c"), (cxx, "c++")] {
        let compile = |werror: bool| {
            let mut cmd = Command::new(&compiler);
            // An object file, not -fsyntax-only: GCC checks unused results after parsing.
            let obj = out_dir().join(format!("ignored-{lang}-{werror}.o"));
            cmd.args(["-x", lang, "-c", "-I"])
                .arg(root.join("include"))
                .arg(root.join("tests/c/ignored_error.c"))
                .arg("-o")
                .arg(obj);
            if werror {
                cmd.arg("-Werror=unused-result");
            }
            cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
        };
        let warned = compile(false);
        let text = String::from_utf8_lossy(&warned.stderr);
        assert!(warned.status.success(), "{compiler} -x {lang} without -Werror: {text}");
        assert!(text.contains("emuhost_space_reserve"), "{compiler} -x {lang}: no warning naming the call:\n{text}");
        let refused = compile(true);
        let text = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "{compiler} -x {lang} -Werror=unused-result compiled an ignored error");
        assert!(
            text.contains("emuhost_space_reserve") && text.contains("unused-result"),
            "{compiler} -x {lang}:\n{text}"
        );
    }
}

/// `emuhost.hpp` says what it needs, first: C++17, and exceptions (`#error` naming emuhost.h).
#[test]
fn the_cpp_wrapper_refuses_old_standards_and_no_exceptions_plainly() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let source = out_dir().join("wrapper-needs.cpp");
    std::fs::write(&source, "#include \"emuhost.hpp\"\nint main() { return 0; }\n").unwrap();
    for (flags, says) in [
        (&["-std=c++14"][..], "emuhost.hpp needs C++17"),
        (&["-std=c++17", "-fno-exceptions"][..], "emuhost.hpp reports errors as exceptions"),
        (&["-std=c++17"][..], ""),
    ] {
        let out = Command::new(&cxx)
            .args(flags)
            .arg("-fsyntax-only")
            .arg("-I")
            .arg(root().join("include"))
            .arg(&source)
            .output()
            .unwrap_or_else(|e| panic!("{cxx}: {e}"));
        let text = String::from_utf8_lossy(&out.stderr);
        if says.is_empty() {
            assert!(out.status.success(), "{cxx} {flags:?}: {text}");
        } else {
            assert!(!out.status.success() && text.contains(says), "{cxx} {flags:?}: no {says:?} in:\n{text}");
        }
    }
}
