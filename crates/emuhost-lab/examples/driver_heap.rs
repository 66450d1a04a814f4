//! What the import backend's driver keeps of the C heap per operation: opening and dropping a
//! backend, an import and its release on one thread, the same on a new thread each time, and a
//! new thread that does not call the driver. Each is run N times (the first argument, 300 by
//! default) in three rounds, and the growth of the allocator's memory in use (`mallinfo2`, after
//! `malloc_trim`) is printed per operation: the first round includes warm-up, later rounds that
//! stay above a few bytes are memory the driver keeps.
//!
//! ```sh
//! EMUHOST_IMPORT_BACKEND=vulkan cargo run --release -p emuhost-lab --example driver_heap -- 300
//! ```
//!
//! It explains what `emuhost replay --soak` shows with a short trace: each loop's threads are
//! new, and NVIDIA 580.159.04 keeps about 300 bytes for each thread that has imported.

use emuhost::import::{AnyBackend, Backend, HostSpan};
use emuhost::space::{Prot, Space};
use emuhost_lab::soak::{memory, trim_heap};

const ROUNDS: usize = 3;
const SPAN: u64 = 16 << 20;

fn in_use() -> f64 {
    trim_heap();
    memory().expect("reading /proc/self/status").heap_in_use as f64
}

/// Runs `op` `n` times per round and prints the growth per run.
fn rounds(what: &str, n: usize, mut op: impl FnMut()) {
    for round in 1..=ROUNDS {
        let before = in_use();
        for _ in 0..n {
            op();
        }
        println!("{what:<40} round {round}: {:>8.1} B each ({n} runs)", (in_use() - before) / n as f64);
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = match std::env::args().nth(1) {
        Some(a) => a.parse().map_err(|_| format!("the run count {a:?} is not a whole number"))?,
        None => 300,
    };
    // The caller asks for the environment's switches (`EMUHOST_IMPORT_BACKEND`).
    let choice = emuhost::settings::Settings::from_env()?.import_backend;
    let backend = AnyBackend::pick(choice)?.backend;
    println!("backend: {}", backend.describe());
    rounds("open and drop a backend", n, || drop(AnyBackend::pick(choice).expect("opening the backend again")));

    let space = std::sync::Arc::new(Space::with_window(2 * SPAN)?);
    space.commit(space.range(0, SPAN)?, Prot::READ_WRITE)?;
    let import = || {
        let span = HostSpan::of(&space, 0, SPAN).expect("the span is in the window");
        backend.release(backend.import(span).expect("importing 16 MiB"));
    };
    rounds("import and release, one thread", n, import);
    rounds("import and release, a new thread each", n, || std::thread::scope(|s| drop(s.spawn(import))));
    rounds("a new thread alone", n, || std::thread::scope(|s| drop(s.spawn(|| std::hint::black_box(vec![0u8; 64])))));
    Ok(())
}
