//! The shared library's SONAME on Linux: `libemuhost_capi.so.MAJOR`, or `libemuhost_capi.so.0.MINOR`
//! before 1.0 (semver: every 0.x minor may change the ABI), so a program linked against one ABI
//! is never loaded with another by the dynamic loader. `scripts/install-capi.sh` installs the file
//! under its full version with the SONAME and the development name (`libemuhost_capi.so`) as
//! links; `emuhost_version_compatible` (the header's `EMUHOST_VERSION_CHECK()`) applies the same
//! rule at run time. The test `soname::the_shared_library_has_its_soname` reads it back.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if os != "linux" {
        return;
    }
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_default();
    let minor = std::env::var("CARGO_PKG_VERSION_MINOR").unwrap_or_default();
    let abi = if major == "0" { format!("0.{minor}") } else { major };
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libemuhost_capi.so.{abi}");
}
