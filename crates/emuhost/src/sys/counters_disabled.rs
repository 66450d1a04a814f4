//! System-call counters, compiled out: the default build updates none.

pub use super::counts::{Call, Counts};

/// Does nothing: the `counters` feature is off.
#[inline(always)]
pub fn count(_call: Call) {}

/// Always `None`: this build counts nothing.
pub fn snapshot() -> Option<Counts> {
    None
}
