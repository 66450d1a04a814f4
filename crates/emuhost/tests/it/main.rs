//! emuhost's integration tests, in one binary. Each test makes its own `Space`, so they run in
//! parallel; system calls are counted per thread (the `counters` feature is on for tests).

/// Each named test function, once per write-tracking backend of this platform (Linux: `mod uffd`,
/// `mod mprotect`; Windows: `mod writewatch`, `mod guard`; each module is named as its backend,
/// which `watch::in_child` relies on): the conformance suites of `watch` and `watch_cache`, run
/// unchanged against every backend. A name may carry attributes (`#[cfg(target_os = "linux")]`
/// for a test that is Linux by nature). Defined before the modules that use it.
macro_rules! watch_conformance {
    ($($(#[$attr:meta])* $name:ident),* $(,)?) => {
        #[cfg(target_os = "linux")]
        mod uffd {
            $( $(#[$attr])* #[test] fn $name() { super::$name(emuhost::watch::BackendKind::Uffd) } )*
        }
        #[cfg(target_os = "linux")]
        mod mprotect {
            $( $(#[$attr])* #[test] fn $name() { super::$name(emuhost::watch::BackendKind::Mprotect) } )*
        }
        #[cfg(windows)]
        mod writewatch {
            $( $(#[$attr])* #[test] fn $name() { super::$name(emuhost::watch::BackendKind::WriteWatch) } )*
        }
        #[cfg(windows)]
        mod guard {
            $( $(#[$attr])* #[test] fn $name() { super::$name(emuhost::watch::BackendKind::Guard) } )*
        }
    };
}

// Linux by nature, for now (issue 35 brings the space and write watch to Windows; the embedder's
// side comes with the next issue): the embedding example installs a `SIGSEGV` handler and maps
// its window with `mmap`; fault injection counts `/proc/self/maps` and `/proc/self/fd`, injects
// userfaultfd failures and foreign `SIGSEGV`s in every test.
#[cfg(target_os = "linux")]
mod embed;
#[cfg(all(feature = "faults", target_os = "linux"))]
mod faults;
mod import;
mod import_caller;
mod import_cap;
#[path = "../support/logs.rs"]
mod logs;
mod sched;
mod snapshot;
mod snapshot_cow;
mod space;
#[path = "../support/vulkan.rs"]
mod vulkan_gate;
mod watch;
mod watch_cache;
#[path = "../support/watch.rs"]
mod watch_gate;

/// Counts each thread's heap allocations, for the tests that check a path allocates nothing
/// ([`allocations`]).
struct Counting;

std::thread_local! {
    // Const, without a destructor: reading it allocates nothing (no recursion into the allocator).
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

// SAFETY: every call is passed to the system allocator unchanged; the count is a side effect.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { std::alloc::System.alloc(layout) }
    }

    // Passed on as such, so a large zeroed vector stays lazily mapped (the default would write
    // every byte).
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as above.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: as above.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as above.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// The heap allocations (and reallocations) this thread has made so far.
pub(crate) fn allocations() -> u64 {
    ALLOCATIONS.with(|c| c.get())
}
