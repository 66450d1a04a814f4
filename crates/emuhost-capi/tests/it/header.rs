//! include/emuhost.h is what cbindgen makes of this crate now: regenerated here (the `cbindgen`
//! crate, so CI needs no cbindgen binary) and compared byte for byte.

use std::path::Path;

/// `EMUHOST_VERSION_MAJOR`, `_MINOR`, `_PATCH` and `_STRING`: the crate's version, which a release
/// changes in Cargo.toml only (this test then asks for the header to be taken again).
fn version_macros() -> String {
    format!(
        "\n/* The version of emuhost this header was generated from; emuhost_version_major() etc. give the\n \
         * library's (EMUHOST_VERSION_CHECK() compares them). */\n\
         #define EMUHOST_VERSION_MAJOR {}\n#define EMUHOST_VERSION_MINOR {}\n#define EMUHOST_VERSION_PATCH {}\n\
         #define EMUHOST_VERSION_STRING \"{}\"\n",
        env!("CARGO_PKG_VERSION_MAJOR"),
        env!("CARGO_PKG_VERSION_MINOR"),
        env!("CARGO_PKG_VERSION_PATCH"),
        env!("CARGO_PKG_VERSION"),
    )
}

#[test]
fn header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    config.after_includes = Some(format!("{}{}", version_macros(), config.after_includes.unwrap_or_default()));
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen could not generate the header");
    let mut fresh = Vec::new();
    bindings.write(&mut fresh);
    let committed_path = dir.join("../../include/emuhost.h");
    let committed = std::fs::read(&committed_path).unwrap_or_default();
    if committed != fresh {
        let new = Path::new(env!("CARGO_TARGET_TMPDIR")).join("emuhost.h");
        std::fs::write(&new, &fresh).expect("write the fresh header");
        panic!(
            "include/emuhost.h is not what cbindgen makes of crates/emuhost-capi now.\n  see: diff -u {} {}\n  \
             take it: cp {} {}",
            committed_path.display(),
            new.display(),
            new.display(),
            committed_path.display()
        );
    }
}

/// Every function returning an error carries `EMUHOST_MUST_USE` (warn_unused_result): the
/// `[fn] must_use` of cbindgen.toml, applied to the functions that are `#[must_use]` in Rust.
/// `programs::an_ignored_error_fails_to_compile` checks that a compiler then refuses the ignored one.
#[test]
fn every_function_returning_an_error_is_must_use() {
    let header = include_str!("../../../../include/emuhost.h");
    let returning: Vec<&str> =
        header.lines().filter(|l| !l.starts_with("//") && l.contains("struct emuhost_error_t *emuhost_")).collect();
    assert!(returning.len() > 50, "{returning:?}");
    let bare: Vec<&&str> = returning.iter().filter(|l| !l.starts_with("EMUHOST_MUST_USE ")).collect();
    assert!(bare.is_empty(), "functions returning an error without EMUHOST_MUST_USE:\n{bare:#?}");
    assert!(header.contains("#define EMUHOST_MUST_USE __attribute__((warn_unused_result))\n"));
}
