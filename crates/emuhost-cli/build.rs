//! `emuhost.exe`'s application manifest (Windows targets only; nothing on Linux): it asks for the
//! segment heap (`<heapType>SegmentHeap</heapType>`, honoured from Windows 10 2004; older Windows
//! and Wine ignore it), so that compile workers allocating side by side do not queue on the NT
//! heap's one lock (reference/001), and runs as the invoker. Embedded by `embed-manifest`: on the
//! gnu target as a resource object it writes itself (no windres needed), on msvc through
//! `/MANIFEST:EMBED /MANIFESTINPUT:`. `emuhost bench workers` on Windows measures this heap against
//! a copy of the exe without the manifest, and says which heap each process had.

use embed_manifest::manifest::{ExecutionLevel, HeapType};
use embed_manifest::{embed_manifest, empty_manifest};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_CFG_WINDOWS").is_none() {
        return;
    }
    let part = |key: &str| std::env::var(key).ok().and_then(|v| v.parse::<u16>().ok()).unwrap_or(0);
    let manifest = empty_manifest()
        .name("emuhost")
        .version(part("CARGO_PKG_VERSION_MAJOR"), part("CARGO_PKG_VERSION_MINOR"), part("CARGO_PKG_VERSION_PATCH"), 0)
        .heap_type(HeapType::SegmentHeap)
        .requested_execution_level(ExecutionLevel::AsInvoker);
    if let Err(e) = embed_manifest(manifest) {
        eprintln!("emuhost-cli build: embedding the Windows manifest failed: {e}");
        std::process::exit(1);
    }
}
