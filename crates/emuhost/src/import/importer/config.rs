//! How the importer works: the settings both policies read ([`ImportConfig`]), and the policy
//! with the settings only it reads ([`ImportPolicy`]). Typed values only: the `EMUHOST_IMPORT_*`
//! switches are parsed above, in the settings module.

use std::time::Duration;

use super::super::cost::ImportCost;
use super::super::plan::{DEFAULT_CHUNK, DEFAULT_SPAN_CAP, PlanConfig};

/// The default time a range that failed to import is held before it is tried again.
pub const DEFAULT_COOLING: Duration = Duration::from_secs(1);
/// The default longest time a binding should wait for an import under the pools policy.
pub const DEFAULT_WAIT: Duration = Duration::from_micros(400);
/// The default budget of bytes imported ahead and not yet bound: 256 MiB.
pub const DEFAULT_AHEAD: u64 = 256 << 20;
/// The pools policy's default piece of a background import (`EMUHOST_IMPORT_AHEAD_PIECE_KB`):
/// 4 MiB. NVIDIA's driver serializes imports, so a binding that imports while a background
/// import is in the driver waits for it: about 0.17 ms/MiB of populated pages on the H200, 1.3
/// ms for a 7 MiB pool. On the H200 the worst wait of 7 replays in 4 MiB pieces was 0.53–0.73
/// ms, against 0.65–2.61 ms with pools whole; 1 MiB pieces doubled the time waiting for imports
/// (docs/import.md, "Background imports in pieces", "4 MiB pieces by default").
pub const DEFAULT_AHEAD_PIECE: u64 = 4 << 20;

/// Which ranges bindings import (`EMUHOST_IMPORT_POLICY`), with the settings only that policy
/// reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportPolicy {
    /// The pools a binding lies in, exactly (at the backend's alignment), imported ahead of
    /// their first binding where bindings were seen nearby; a binding whose pool would take
    /// longer than the wait target imports only its part and the rest follows off its thread.
    Pools(PoolsConfig),
    /// The seed's: 16 MiB chunks at the first binding, grown over the pools across their ends
    /// ([`super::super::plan`]), all on the binding thread.
    Chunks(ChunksConfig),
}

impl Default for ImportPolicy {
    /// The platform's: [`ImportPolicy::Pools`] on Linux; on Windows the seed's chunks and spans
    /// ([`ImportPolicy::chunks`]: 16 MiB chunks, spans up to 64 MiB). Windows drivers charge tens
    /// of ms per import (reference/000: 45–103 ms an import on NVIDIA, 14.7–19.5 ms on average on
    /// AMD), and some cap live allocations (`maxMemoryAllocationCount`, 4,096). The pools policy
    /// makes an import per pool, and per piece of a large one: about a thousand a replay on the
    /// H200 (1,080, and 1,642 in 4 MiB pieces: docs/measurements/2026-12-05-import.md), each
    /// paying a Windows driver's fixed cost and holding an allocation; the seed's chunks made
    /// 45–47 imports a session with spans (90–97 without) in its measurements. Nothing measured
    /// on Windows here says otherwise (Wine's timings are not Windows'); `EMUHOST_IMPORT_POLICY`
    /// still chooses either.
    fn default() -> Self {
        if cfg!(windows) { ImportPolicy::chunks() } else { ImportPolicy::Pools(PoolsConfig::default()) }
    }
}

impl ImportPolicy {
    /// The chunks policy with its default settings.
    pub fn chunks() -> Self {
        ImportPolicy::Chunks(ChunksConfig::default())
    }

    /// The pools policy's settings, where it is the policy.
    pub fn pools_config(&self) -> Option<&PoolsConfig> {
        match self {
            ImportPolicy::Pools(p) => Some(p),
            ImportPolicy::Chunks(_) => None,
        }
    }
}

/// The chunks policy's own settings: [`ChunksConfig::default`], then the chained setters. (Its
/// chunk is [`ImportConfig::chunk`], which the pools policy reads too.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChunksConfig {
    /// The largest range a span may grow to, in bytes (`EMUHOST_IMPORT_SPAN_MB`, in bytes
    /// here); 0 turns spans off.
    pub span_cap: u64,
}

impl Default for ChunksConfig {
    fn default() -> Self {
        Self { span_cap: DEFAULT_SPAN_CAP }
    }
}

impl ChunksConfig {
    /// Sets [`ChunksConfig::span_cap`].
    pub fn span_cap(mut self, span_cap: u64) -> Self {
        self.span_cap = span_cap;
        self
    }

    /// What the planner takes: `chunk` and this span cap.
    pub fn plan(&self, chunk: u64) -> PlanConfig {
        PlanConfig::new(chunk, self.span_cap)
    }
}

/// The pools policy's own settings: [`PoolsConfig::default`], then the chained setters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolsConfig {
    /// Import ahead (`EMUHOST_IMPORT_AHEAD_MB`, in bytes here; 0: off). A pool made in a
    /// chunk-sized region where a binding was made, and the pools of a region when its first
    /// binding comes, are imported (populated first) on a background thread, so that their
    /// bindings find them ready. At most this many bytes are imported ahead and not yet used by
    /// a binding (in flight included); past it a pool is left to its bindings.
    pub ahead: u64,
    /// The longest a binding should wait (`EMUHOST_IMPORT_WAIT_US`). A binding whose pool's
    /// import is estimated to take longer (from which of its pages are resident) imports only
    /// its part (in the largest power-of-two granule within this time) and leaves the pool to
    /// the background thread; one whose import is in flight waits for it only if it should land
    /// sooner than that part.
    pub wait: Duration,
    /// What an import costs; `None` measures it when the importer is made
    /// ([`ImportCost::measure`]) and then learns from the bindings' imports (the 90th percentile
    /// of their recent times per MiB, untouched and resident pages apart); a cost given is used
    /// as it is.
    pub cost: Option<ImportCost>,
    /// Background import threads (`EMUHOST_IMPORT_AHEAD_THREADS`); 0: a quarter of the
    /// processors, one to four.
    pub ahead_threads: u32,
    /// The longest range a background thread imports at once (`EMUHOST_IMPORT_AHEAD_PIECE_KB`,
    /// in bytes here; [`DEFAULT_AHEAD_PIECE`] by default; 0: a pool whole). A larger pool is
    /// imported in pieces of this size, each reaching on over the next by the largest binding
    /// seen (at least 64 KiB, at most a piece), so that a binding there fits in one of them: a
    /// binding's import, and a change of the space's mappings, then wait for one piece's pin at
    /// most, not a whole pool's. Where the backend refuses a page in two imports (CUDA), pools
    /// are imported whole.
    pub ahead_piece: u64,
    /// The largest range a merge once whole imports in one (`EMUHOST_IMPORT_MERGE_MB`, in bytes
    /// here; [`MERGE_LIMIT`](super::MERGE_LIMIT) by default; 0: no merges): a pool whole in
    /// several live imports is imported again in one, in slices of this size where it is larger,
    /// while the live count is at half the cap or above (module `merge`). A merge holds the driver for its whole pin, as long as a pool's import
    /// would: a binding that comes meanwhile waits for it there.
    pub merge: u64,
}

impl Default for PoolsConfig {
    fn default() -> Self {
        Self {
            ahead: DEFAULT_AHEAD,
            wait: DEFAULT_WAIT,
            cost: None,
            ahead_threads: 0,
            ahead_piece: DEFAULT_AHEAD_PIECE,
            merge: super::MERGE_LIMIT,
        }
    }
}

impl PoolsConfig {
    /// Sets [`PoolsConfig::ahead`].
    pub fn ahead(mut self, ahead: u64) -> Self {
        self.ahead = ahead;
        self
    }

    /// Sets [`PoolsConfig::wait`].
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets [`PoolsConfig::ahead_threads`].
    pub fn ahead_threads(mut self, threads: u32) -> Self {
        self.ahead_threads = threads;
        self
    }

    /// Sets [`PoolsConfig::merge`].
    pub fn merge(mut self, bytes: u64) -> Self {
        self.merge = bytes;
        self
    }

    /// Sets [`PoolsConfig::ahead_piece`].
    pub fn ahead_piece(mut self, piece: u64) -> Self {
        self.ahead_piece = piece;
        self
    }

    /// Sets [`PoolsConfig::cost`].
    pub fn cost(mut self, cost: Option<ImportCost>) -> Self {
        self.cost = cost;
        self
    }
}

/// How the importer works: [`ImportConfig::default`], then the chained setters (or assign the
/// fields of a value you hold; the struct is `#[non_exhaustive]`, so fields can be added).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportConfig {
    /// The chunk in bytes (`EMUHOST_IMPORT_CHUNK_MB`): a power of two, at least the backend's
    /// alignment. Under the pools policy, the size of the regions where bindings are watched for.
    pub chunk: u64,
    /// How long a range that failed is held before it is tried again (0: not held).
    pub cooling: Duration,
    /// Fault pages in (`Space::populate`) on a background thread when a pool is registered, so
    /// that the import at binding time pays for pinning only.
    pub populate_ahead: PopulateAhead,
    /// Commit the reserved (never committed, or decommitted) pages of the range read-write before
    /// importing it, so that gaps between pools inside a chunk are importable
    /// ([`crate::space::Space::commit_reserved`]). Pages the guest committed keep their bytes and
    /// their protection (`r--` and `---` pages stay so; a driver that cannot pin them fails the
    /// import).
    pub commit: bool,
    /// Which ranges bindings import (`EMUHOST_IMPORT_POLICY`), and that policy's own settings.
    pub policy: ImportPolicy,
    /// The most live imports the importer keeps to (`EMUHOST_IMPORT_MAX_LIVE`); `None`: three
    /// quarters of the backend's limit on live allocations (Vulkan's `maxMemoryAllocationCount`,
    /// 4,096 on some Windows drivers: 3,072), the rest left to the embedder's own allocations on
    /// the device; that limit also bounds a value given (0 is taken as 1). Lower it where the
    /// renderer needs more of the device's allocations, or to test the cap. The importer keeps it
    /// by releasing and merging, and where nothing makes room a binding imports over it (see
    /// [`Importer::max_live`](super::Importer::max_live)).
    pub max_live: Option<u64>,
}

impl Default for ImportConfig {
    fn default() -> Self {
        Self {
            chunk: DEFAULT_CHUNK,
            cooling: DEFAULT_COOLING,
            populate_ahead: PopulateAhead::Off,
            commit: true,
            policy: ImportPolicy::default(),
            max_live: None,
        }
    }
}

impl ImportConfig {
    /// Sets [`ImportConfig::chunk`].
    pub fn chunk(mut self, chunk: u64) -> Self {
        self.chunk = chunk;
        self
    }

    /// Sets [`ImportConfig::cooling`].
    pub fn cooling(mut self, cooling: Duration) -> Self {
        self.cooling = cooling;
        self
    }

    /// Sets [`ImportConfig::populate_ahead`].
    pub fn populate_ahead(mut self, populate_ahead: PopulateAhead) -> Self {
        self.populate_ahead = populate_ahead;
        self
    }

    /// Sets [`ImportConfig::commit`].
    pub fn commit(mut self, commit: bool) -> Self {
        self.commit = commit;
        self
    }

    /// Sets [`ImportConfig::policy`].
    pub fn policy(mut self, policy: ImportPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets [`ImportConfig::max_live`].
    pub fn max_live(mut self, max_live: Option<u64>) -> Self {
        self.max_live = max_live;
        self
    }
}

/// What is populated ahead when a pool is registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PopulateAhead {
    /// Nothing: an import faults in what was never touched.
    #[default]
    Off,
    /// The pool's own pages (they must be committed writable; a failure is counted).
    Pools,
    /// The chunks the pool touches, committed read-write first: everything an import of them
    /// would pin, gaps between pools included. Costs resident memory for every chunk any pool
    /// touches, bound or not.
    Chunks,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default policy is the platform's: the seed's chunks (16 MiB) and spans (64 MiB) on
    /// Windows, for its drivers' cost per import and cap on live allocations; pools elsewhere.
    /// (The settings' default follows it: `settings`' tests; the import module names nothing of
    /// the settings above it.)
    #[test]
    fn windows_default_policy_is_the_seeds_chunks_and_spans() {
        let d = ImportConfig::default();
        if cfg!(windows) {
            assert_eq!(d.policy, ImportPolicy::Chunks(ChunksConfig { span_cap: 64 << 20 }));
            assert_eq!(d.chunk, 16 << 20);
        } else {
            assert_eq!(d.policy, ImportPolicy::Pools(PoolsConfig::default()));
        }
        assert_eq!(d.max_live, None, "the backend's limit");
    }
}
