//! include/emuhost.h is what cbindgen makes of this crate now: regenerated here (the `cbindgen`
//! crate, so CI needs no cbindgen binary) and compared byte for byte.

use std::path::Path;

#[test]
fn header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
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
