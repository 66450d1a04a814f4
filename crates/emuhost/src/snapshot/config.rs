//! How a set of snapshots is kept: its memory budget.

/// How a [`Snapshots`](super::Snapshots) keeps its pages. [`Default`]: no budget.
///
/// Built by its methods, or by [`Settings::snapshot_config`](crate::settings::Settings::snapshot_config)
/// (`EMUHOST_SNAPSHOT_BUDGET_MB`), which reads the environment only when the caller asks.
///
/// ```
/// use emuhost::snapshot::SnapshotConfig;
///
/// let c = SnapshotConfig::default().budget_bytes(Some(64 << 20));
/// assert_eq!(c.budget_bytes, Some(64 << 20));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SnapshotConfig {
    /// The most bytes of page copies kept ([`SnapshotStats::bytes_kept`](super::SnapshotStats::bytes_kept)):
    /// past it, a take drops the oldest snapshots first (a rewind ring), never the newest.
    /// `None`: no limit.
    pub budget_bytes: Option<u64>,
}

impl SnapshotConfig {
    /// Sets [`SnapshotConfig::budget_bytes`].
    pub fn budget_bytes(mut self, bytes: Option<u64>) -> Self {
        self.budget_bytes = bytes;
        self
    }
}
