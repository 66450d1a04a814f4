//! What went wrong with a snapshot.

use super::{SnapshotId, SnapshotMode};
use crate::space::{GuestAddr, GuestRange, SpaceError};
use crate::watch::WatchError;

/// What went wrong taking, restoring or releasing a snapshot. Each names the value at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// No live snapshot has this id: never taken, released, or dropped for the budget.
    #[error("snapshot {0} is not live (never taken, released, or dropped for the memory budget)")]
    UnknownSnapshot(SnapshotId),
    /// A restore would decommit `range`, which a hold keeps mapped (a GPU import,
    /// [`Space::hold`](crate::space::Space::hold)): nothing was changed.
    #[error("restoring snapshot {id} would decommit {range}, which a hold keeps mapped ({held}); nothing was changed")]
    Held {
        /// The snapshot asked for.
        id: SnapshotId,
        /// The pages the restore would decommit.
        range: GuestRange,
        /// The range the hold keeps.
        held: GuestRange,
    },
    /// The snapshots' range holds a shared view (a section's pages, which may show at several
    /// addresses): snapshots cover private memory only. Nothing was taken or changed.
    #[error("{range} holds a shared view at {view}: snapshots cover private memory only; nothing was changed")]
    Views {
        /// The snapshots' range.
        range: GuestRange,
        /// The view found in it.
        view: GuestRange,
    },
    /// Guest writes ran beside a restore (see [`Snapshots::restore`](super::Snapshots::restore)):
    /// `pages` pages were written while it ran, the first at `first`. The range holds the
    /// snapshot's bytes but for those pages, which every later take and restore counts as
    /// changed; restore again with the guest stopped.
    #[error(
        "guest writes ran beside the restore of snapshot {id}: {pages} pages written meanwhile, the first {first}; \
         stop the guest's threads and restore again"
    )]
    ConcurrentWrites {
        /// The snapshot asked for.
        id: SnapshotId,
        /// Pages written while the restore ran.
        pages: u64,
        /// The first of them.
        first: GuestRange,
    },
    /// [`Snapshots::read`](super::Snapshots::read) of bytes the snapshot does not hold: outside
    /// its range, or on a page not committed at the take.
    #[error("snapshot {id} holds no bytes at {addr}: outside its range {range}, or not committed at the take")]
    NoBytes {
        /// The snapshot asked for.
        id: SnapshotId,
        /// The first byte it does not hold.
        addr: GuestAddr,
        /// The snapshots' range.
        range: GuestRange,
    },
    /// The snapshots' [`SnapshotMode`] cannot work with the tracker's backend (copy before write
    /// needs a protection backend, whose fault handler sees each first write): `why` says more.
    #[error("snapshot mode `{mode}` cannot work with the `{backend}` write-tracking backend: {why}")]
    Mode {
        /// The mode asked for.
        mode: SnapshotMode,
        /// The tracker's backend.
        backend: &'static str,
        /// Why.
        why: String,
    },
    /// A call of the space failed (a range outside the window, a mapping the space did not make,
    /// an OS failure): its error names the range.
    #[error(transparent)]
    Space(#[from] SpaceError),
    /// A call of the write tracker failed: its error names the range.
    #[error(transparent)]
    Watch(#[from] WatchError),
}
