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
    /// A space call failed: a range outside the window or unaligned, or a call from another
    /// process than the space's maker (see [`SpaceError`]).
    #[error(transparent)]
    Space(#[from] SpaceError),
    /// Making the backend failed (no userfaultfd or `PAGEMAP_SCAN` on this kernel, a handler
    /// that could not be installed, ...): `source` is the OS error.
    #[error("the {backend} backend is not available here")]
    Unavailable {
        /// The backend's name (`uffd`, `mprotect`, `writewatch`, `guard`).
        backend: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The backend forced by [`TrackerConfig::backend`](super::TrackerConfig::backend) or
    /// `EMUHOST_WATCH` (or one tried in turn) did not report exactly the page its self-test wrote.
    #[error("the {backend} backend failed its self-test: {why}")]
    SelfTest {
        /// The backend's name (`uffd`, `mprotect`, `writewatch`, `guard`).
        backend: &'static str,
        /// What the self-test saw.
        why: String,
    },
    /// No backend of [`BackendKind::AUTO`](super::BackendKind::AUTO) passed its self-test.
    #[error("no write-tracking backend passed its self-test ({tried})")]
    NoBackend {
        /// Each backend tried and why it failed, `; `-separated.
        tried: String,
    },
    /// A backend's OS call failed for another reason than memory released behind the space's
    /// back (which is reported as not tracked): `source` is the OS error.
    #[error("{op} of {range} failed ({backend})")]
    Os {
        /// The operation (`arm`, `disarm`, `collect`, `query`, `prepare`, ...).
        op: &'static str,
        /// The guest range it was over.
        range: GuestRange,
        /// The backend's name.
        backend: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// [`Tracker::new`] on a space that has a live tracker already: one per space.
    #[error(
        "this space (host {base:#x}) has a write tracker already: one tracker per space; share it, and \
         hand each consumer the pages a collect reports"
    )]
    SecondTracker {
        /// The space's host base address.
        base: usize,
    },
    /// With `EMUHOST_VERIFY_COLLECT=1` ([`TrackerConfig::verify`](super::TrackerConfig::verify)):
    /// a read found the pages of `span` mapped otherwise than the space's layout says.
    #[error(
        "collect of {span} read written pages, but the kernel has {found} there ({VERIFY_SWITCH}=1 checks each collect against a region query)"
    )]
    VerifyMismatch {
        /// The guest range the read covered.
        span: GuestRange,
        /// What a region query found there instead.
        found: String,
    },
    /// A bitmap's bytes per bit ([`Tracker::collect_into`]) that is not a power of two at least
    /// the page size.
    #[error("granularity {granularity:#x} is not a power of two of at least the page size ({page:#x})")]
    BadGranularity {
        /// Bytes per bit asked for.
        granularity: u64,
        /// The host page size in bytes.
        page: u64,
    },
    /// A call in another process than the one that made the tracker (a `fork`'s child): its
    /// userfaultfd and pagemap read and re-arm the maker's pages, so nothing is done.
    #[error(
        "this tracker was made in process {made_in}; process {now} (a fork's child) cannot use it: it would read and \
         re-arm the other process's pages"
    )]
    OtherProcess {
        /// The id of the process that made the tracker.
        made_in: u32,
        /// The id of the calling process.
        now: u32,
    },
    /// Bitmap words too few for the range at the granularity.
    #[error("{range} at granularity {granularity:#x} needs {need} bitmap words; {have} given")]
    WordsTooShort {
        /// The guest range collected.
        range: GuestRange,
        /// Bytes per bit asked for.
        granularity: u64,
        /// Words the range needs.
        need: usize,
        /// Words given.
        have: usize,
    },
}
