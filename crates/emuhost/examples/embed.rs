//! The embedding example: what an emulator does with emuhost, owning everything emuhost could own
//! (its own window, its own fault handler, its own caches and its own `VkDevice`); the code and
//! what it shows are in `embed/linux.rs`.
//!
//! Linux only for now: the emulator's window is its own `mmap` and its fault handler a `SIGSEGV`
//! handler. On Windows the same would be a `VirtualAlloc2` reservation and a vectored exception
//! handler, which come with the embedder's side of Windows (the issue after 35).
//!
//! ```sh
//! cargo run -p emuhost --example embed
//! ```

// `main` too.
#[cfg(target_os = "linux")]
pub use linux::*;
#[cfg(target_os = "linux")]
#[path = "embed/linux.rs"]
mod linux;

#[cfg(not(target_os = "linux"))]
fn main() {
    eprintln!("the embed example is Linux only for now (an mmap'd window and a SIGSEGV handler)");
}
