//! What went wrong in write tracking.

use std::io;

#[cfg(doc)]
use super::Tracker;
use super::VERIFY_SWITCH;
use crate::space::{GuestRange, SpaceError};

/// What went wrong in write tracking.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WatchError {
    #[error(transparent)]
    Space(#[from] SpaceError),
    #[error("the {backend} backend is not available here")]
    Unavailable {
        backend: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the {backend} backend failed its self-test: {why}")]
    SelfTest { backend: &'static str, why: String },
    #[error("no write-tracking backend passed its self-test ({tried})")]
    NoBackend { tried: String },
    #[error("{op} of {range} failed ({backend})")]
    Os {
        op: &'static str,
        range: GuestRange,
        backend: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(
        "this space (host {base:#x}) has a write tracker already: one tracker per space; share it, and \
         hand each consumer the pages a collect reports"
    )]
    SecondTracker { base: usize },
    #[error(
        "collect of {span} read written pages, but the kernel has {found} there ({VERIFY_SWITCH}=1 checks each collect against a region query)"
    )]
    VerifyMismatch { span: GuestRange, found: String },
    /// A bitmap's bytes per bit ([`Tracker::collect_into`]) that is not a power of two at least
    /// the page size.
    #[error("granularity {granularity:#x} is not a power of two of at least the page size ({page:#x})")]
    BadGranularity { granularity: u64, page: u64 },
    /// A call in another process than the one that made the tracker (a `fork`'s child): its
    /// userfaultfd and pagemap read and re-arm the maker's pages, so nothing is done.
    #[error(
        "this tracker was made in process {made_in}; process {now} (a fork's child) cannot use it: it would read and \
         re-arm the other process's pages"
    )]
    OtherProcess { made_in: u32, now: u32 },
    /// Bitmap words too few for the range at the granularity.
    #[error("{range} at granularity {granularity:#x} needs {need} bitmap words; {have} given")]
    WordsTooShort { range: GuestRange, granularity: u64, need: usize, have: usize },
}
