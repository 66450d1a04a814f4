//! emuhost's integration tests, in one binary. Each test makes its own `Space`, so they run in
//! parallel; system calls are counted per thread (the `counters` feature is on for tests).

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
#[path = "../support/watch.rs"]
mod watch_gate;
