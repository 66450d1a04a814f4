//! emuhost's laboratory: the workloads that exercise the runtime ([`emuhost`]) and the checks
//! made of them. None of it is needed to embed the runtime.
//!
//! - [`trace`]: traces of game sessions (format, recorder, streaming reader, figures).
//! - [`synth`]: a synthetic session, deterministic from a seed, shaped on a measured one.
//! - [`replay`]: a trace replayed through the runtime (space, import, watch, sched), with its
//!   figures and the check that no guest write was lost.
//! - [`soak`]: the check of replays looped in one process: memory flat, nothing left live.
//! - [`stress`]: the no-lost-writes stress of the write-tracking backends.
//! - [`bench`](mod@bench): the measurements of `emuhost bench` (arms, rounds, medians, ratios).
//! - [`quantile`]: the workspace's one rule for percentiles and medians, the runtime's
//!   [`emuhost::quantile`] (re-exported here, where the benches and replays use it).
//! - [`rng`]: the workspace's one deterministic generator, the runtime's [`emuhost::rng`]
//!   (re-exported here, where the sessions, the stress and the benches draw from it).
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod bench;
pub mod replay;
pub use emuhost::{quantile, rng};
pub mod soak;
pub mod stress;
pub mod synth;
pub mod trace;
