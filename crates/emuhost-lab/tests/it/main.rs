//! emuhost-lab's integration tests, in one binary: traces, replays through the real runtime and
//! the write-tracking stress.

mod bench_progress;
mod replay;
mod settings;
mod stress;
mod trace;
#[path = "../../../emuhost/tests/support/watch.rs"]
mod watch_gate;
