//! The benches' progress: every round a bench plans is begun, and none it did not plan.

use emuhost_lab::bench::progress;
use emuhost_lab::bench::workers::{WorkersBench, workers};

/// The workers bench plans its rounds and begins each once (no other test in this binary runs a
/// bench, so the process's counts move by this one's alone).
#[test]
fn a_bench_begins_the_rounds_it_planned() {
    let (begun, planned) = progress::rounds();
    workers(&WorkersBench::new(3, 8, Some(2)));
    let (b, p) = progress::rounds();
    assert_eq!((b - begun, p - planned), (3, 3));
}
