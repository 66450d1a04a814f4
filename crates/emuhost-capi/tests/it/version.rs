//! The version three ways: the header's macros, the library's functions and its compatibility
//! rule, and (Linux) the shared library's SONAME, which follows the same rule.

use std::ffi::CStr;

use emuhost_capi::*;

/// The crate's version as numbers.
fn version() -> [u32; 3] {
    [env!("CARGO_PKG_VERSION_MAJOR"), env!("CARGO_PKG_VERSION_MINOR"), env!("CARGO_PKG_VERSION_PATCH")]
        .map(|f| f.parse().expect("a numeric version field"))
}

#[test]
fn the_library_says_its_version_and_which_headers_it_serves() {
    let [major, minor, patch] = version();
    assert_eq!([emuhost_version_major(), emuhost_version_minor(), emuhost_version_patch()], [major, minor, patch]);
    // SAFETY: emuhost_version returns a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(emuhost_version()) };
    assert_eq!(text.to_str(), Ok(env!("CARGO_PKG_VERSION")));
    // Its own header's numbers pass; another major, and before 1.0 another minor, do not.
    assert!(emuhost_version_compatible(major, minor));
    assert!(!emuhost_version_compatible(major + 1, minor));
    if major == 0 {
        assert!(!emuhost_version_compatible(0, minor + 1));
        assert!(minor == 0 || !emuhost_version_compatible(0, minor - 1));
    } else {
        assert!(!emuhost_version_compatible(major, minor + 1), "a header newer than the library");
        assert!(minor == 0 || emuhost_version_compatible(major, minor - 1), "an older minor is served");
        assert!(!emuhost_version_compatible(major - 1, minor));
    }
}

#[test]
fn the_header_carries_the_crates_version() {
    let header = include_str!("../../../../include/emuhost.h");
    let [major, minor, patch] = version();
    for line in [
        format!("#define EMUHOST_VERSION_MAJOR {major}\n"),
        format!("#define EMUHOST_VERSION_MINOR {minor}\n"),
        format!("#define EMUHOST_VERSION_PATCH {patch}\n"),
        format!("#define EMUHOST_VERSION_STRING \"{}\"\n", env!("CARGO_PKG_VERSION")),
        "#define EMUHOST_VERSION_CHECK() emuhost_version_compatible(EMUHOST_VERSION_MAJOR, EMUHOST_VERSION_MINOR)\n"
            .into(),
    ] {
        assert!(header.contains(&line), "include/emuhost.h lacks {line:?}");
    }
}

/// The SONAME the shared library must have: `libemuhost_capi.so.MAJOR`, `.so.0.MINOR` before 1.0.
#[cfg(target_os = "linux")]
pub(crate) fn soname() -> String {
    let [major, minor, _] = version();
    if major == 0 { format!("libemuhost_capi.so.0.{minor}") } else { format!("libemuhost_capi.so.{major}") }
}

/// `readelf -d` of the `libemuhost_capi.so` this test build made (beside the test binary, as
/// `exports.rs` finds it): its `DT_SONAME`.
#[cfg(target_os = "linux")]
#[test]
fn the_shared_library_has_its_soname() {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary's folder");
    let lib = [deps.join("libemuhost_capi.so"), deps.parent().unwrap_or(deps).join("libemuhost_capi.so")]
        .into_iter()
        .find(|p| p.is_file())
        .expect("libemuhost_capi.so beside the test binary");
    let out = std::process::Command::new("readelf")
        .args(["-d", "-W"])
        .arg(&lib)
        .output()
        .unwrap_or_else(|e| panic!("readelf -d {}: {e}", lib.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "readelf -d {}: {}", lib.display(), String::from_utf8_lossy(&out.stderr));
    let got = text
        .lines()
        .find(|l| l.contains("(SONAME)"))
        .and_then(|l| Some(l.split_once('[')?.1.split_once(']')?.0.to_string()));
    assert_eq!(got, Some(soname()), "{}: the SONAME in readelf -d:\n{text}", lib.display());
}
