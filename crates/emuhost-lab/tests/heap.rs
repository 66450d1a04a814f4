//! The C allocator's figures and `trim_heap`, in a process of their own (resident memory is the
//! process's: other tests running beside this one would move it). Linux only: the figures are
//! glibc's and the kernel's (`/proc/self/status`).
#![cfg(target_os = "linux")]

use emuhost_lab::soak::{memory, trim_heap};

const MIB: u64 = 1 << 20;

/// 64 MiB of 8 KiB blocks made and touched on a thread, then all freed but one in 64: the thread's
/// arena keeps the freed memory (the kept blocks stop it from shrinking), resident, until
/// `trim_heap` gives the free pages back to the kernel.
#[test]
fn the_allocator_keeps_freed_memory_until_trimmed() {
    let before = memory().unwrap();
    let kept = std::thread::spawn(|| {
        let mut blocks: Vec<Vec<u8>> = (0..8192).map(|i| vec![i as u8 | 1; 8 << 10]).collect();
        let kept: Vec<Vec<u8>> = blocks.iter_mut().step_by(64).map(std::mem::take).collect();
        drop(blocks);
        kept
    })
    .join()
    .unwrap();
    let held = memory().unwrap();
    assert!(held.heap_in_use >= before.heap_in_use + MIB, "the kept blocks are in use: {before:?} {held:?}");
    assert!(held.heap_free >= 48 * MIB, "the freed blocks are held: {held:?}");
    assert!(held.rss >= before.rss + 48 * MIB, "and resident: {before:?} {held:?}");
    assert!(trim_heap(), "something was given back");
    let trimmed = memory().unwrap();
    assert!(trimmed.rss + 40 * MIB <= held.rss, "the trim gave the free pages back: {held:?} {trimmed:?}");
    assert!(kept.iter().all(|b| b.len() == 8 << 10 && b[0] & 1 == 1), "the kept blocks are intact");
}
