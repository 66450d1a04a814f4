//! emuhost's integration tests, in one binary. Each test makes its own `Space`, so they run in
//! parallel; system calls are counted per thread (the `counters` feature is on for tests).

/// Each named test function, once per write-tracking backend (`mod uffd`, `mod mprotect`): the
/// conformance suites of `watch` and `watch_cache`. Defined before the modules that use it.
macro_rules! watch_conformance {
    ($($name:ident),* $(,)?) => {
        mod uffd {
            $( #[test] fn $name() { super::$name(emuhost::watch::BackendKind::Uffd) } )*
        }
        mod mprotect {
            $( #[test] fn $name() { super::$name(emuhost::watch::BackendKind::Mprotect) } )*
        }
    };
}

mod embed;
#[cfg(feature = "faults")]
mod faults;
mod import;
mod import_caller;
#[path = "../support/logs.rs"]
mod logs;
mod sched;
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
