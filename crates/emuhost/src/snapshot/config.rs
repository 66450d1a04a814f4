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
    /// How a take keeps the bytes ([`SnapshotMode`]; `EMUHOST_SNAPSHOT_MODE`).
    pub mode: SnapshotMode,
}

/// How the snapshots keep the pages' bytes (`EMUHOST_SNAPSHOT_MODE`). [`Default`]: copy at take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum SnapshotMode {
    /// A take copies the pages written since the previous take (every backend, every platform).
    #[default]
    CopyAtTake,
    /// A take copies nothing: each page is copied just before its first write after the take, by
    /// the protection backend's fault handler, and a background thread copies the pages likely to
    /// be written ahead of the writes (the `mprotect` and `guard` backends only: see
    /// docs/snapshot_cow.md).
    CopyBeforeWrite,
}

impl SnapshotMode {
    /// Its name as `EMUHOST_SNAPSHOT_MODE` spells it: `take` or `cow`.
    pub fn name(self) -> &'static str {
        match self {
            SnapshotMode::CopyAtTake => "take",
            SnapshotMode::CopyBeforeWrite => "cow",
        }
    }
}

impl std::fmt::Display for SnapshotMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl SnapshotConfig {
    /// Sets [`SnapshotConfig::budget_bytes`].
    pub fn budget_bytes(mut self, bytes: Option<u64>) -> Self {
        self.budget_bytes = bytes;
        self
    }

    /// Sets [`SnapshotConfig::mode`].
    pub fn mode(mut self, mode: SnapshotMode) -> Self {
        self.mode = mode;
        self
    }
}
