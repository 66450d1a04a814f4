//! Choosing a backend: the backends, a tracker's configuration, and the self-test that picks one.

use std::sync::Arc;

#[cfg(doc)]
use super::{FaultHandle, handle_fault};
use super::{PageRun, Tracker, WatchError};
use crate::errors::error_chain as chain;
use crate::space::{GuestAddr, Prot, Space, page_size};

/// The name of the switch that sets [`TrackerConfig::verify`] (a mismatch names it).
pub const VERIFY_SWITCH: &str = "EMUHOST_VERIFY_COLLECT";

/// A write-tracking backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BackendKind {
    /// Linux: userfaultfd write-protection, read by `PAGEMAP_SCAN`.
    Uffd,
    /// Linux: armed pages read-only (`mprotect`), writes claimed by a `SIGSEGV` handler.
    Mprotect,
    /// Windows: `MEM_WRITE_WATCH` private allocations, read by one `GetWriteWatch` each.
    WriteWatch,
    /// Windows: armed pages read-only (`VirtualProtect`), writes claimed by a vectored exception
    /// handler; the one for views and adopted memory, which write watch cannot see.
    Guard,
}

impl BackendKind {
    /// Its name (the one the `EMUHOST_WATCH` switch takes).
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Uffd => "uffd",
            BackendKind::Mprotect => "mprotect",
            BackendKind::WriteWatch => "writewatch",
            BackendKind::Guard => "guard",
        }
    }

    /// Every backend, of every platform.
    pub const ALL: [BackendKind; 4] =
        [BackendKind::Uffd, BackendKind::Mprotect, BackendKind::WriteWatch, BackendKind::Guard];

    /// This platform's backends, tried in this order when nothing is forced, best first.
    #[cfg(target_os = "linux")]
    pub const AUTO: [BackendKind; 2] = [BackendKind::Uffd, BackendKind::Mprotect];
    /// This platform's backends, tried in this order when nothing is forced, best first.
    #[cfg(windows)]
    pub const AUTO: [BackendKind; 2] = [BackendKind::WriteWatch, BackendKind::Guard];

    /// Whether armed pages are read-only and a write to one faults (the handler claims it): the
    /// protection backends.
    pub fn protects(self) -> bool {
        matches!(self, BackendKind::Mprotect | BackendKind::Guard)
    }
}

/// Why the backend in use was chosen, for `emuhost probe`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    /// The backend chosen.
    pub kind: BackendKind,
    /// Why: forced, or the self-tests' results.
    pub why: String,
}

/// Chooses a backend as `config` says: the one [`TrackerConfig::backend`] forces (it must pass
/// its self-test), else the first of [`BackendKind::AUTO`] that passes. The self-tests run as
/// `config` makes trackers (with the embedder's fault handling, none of them installs a handler).
///
/// # Errors
/// [`WatchError::SelfTest`] (or [`WatchError::Unavailable`]) where the forced backend fails,
/// [`WatchError::NoBackend`] where none of [`BackendKind::AUTO`] passes.
pub fn choose(config: &TrackerConfig) -> Result<Choice, WatchError> {
    if let Some(kind) = config.backend {
        self_test_with(kind, config)?;
        return Ok(Choice { kind, why: format!("forced ({}); its self-test passed", kind.name()) });
    }
    let mut tried = Vec::new();
    for kind in BackendKind::AUTO {
        match self_test_with(kind, config) {
            Ok(()) => {
                let why = if tried.is_empty() {
                    "the best backend; its self-test passed".to_string()
                } else {
                    format!("its self-test passed; not {}", tried.join("; "))
                };
                return Ok(Choice { kind, why });
            }
            Err(e) => tried.push(format!("{}: {}", kind.name(), chain(&e))),
        }
    }
    Err(WatchError::NoBackend { tried: tried.join("; ") })
}

/// The backend for `space` when `chosen` passed its self-test: write watch sees private
/// allocations only, so over a space with views or over a caller's (adopted) reservation the
/// guard backend tracks instead, and the choice says why.
pub(super) fn for_space(chosen: Choice, space: &Space) -> Choice {
    if chosen.kind != BackendKind::WriteWatch {
        return chosen;
    }
    let why = match (space.has_views(), space.adopted()) {
        (true, _) => "the space has shared views, which write watch cannot see",
        (false, true) => "the window is the caller's reservation, which write watch cannot see",
        (false, false) => return chosen,
    };
    Choice { kind: BackendKind::Guard, why: format!("guard, not writewatch: {why} ({})", chosen.why) }
}

/// Arms a few pages of a small space of its own, writes one, collects, and expects exactly it.
pub fn self_test(kind: BackendKind) -> Result<(), WatchError> {
    self_test_with(kind, &TrackerConfig::default())
}

/// [`self_test`] with the tracker made as `config` says (its `backend` is not used). With
/// [`TrackerConfig::embedder_handles_faults`] no handler is installed, and the write is handed
/// to [`Tracker::handle_fault`] first, as the embedder's handler would (the page must be armed
/// and is then writable), so the test cannot fault.
pub fn self_test_with(kind: BackendKind, config: &TrackerConfig) -> Result<(), WatchError> {
    let fail = |why: String| WatchError::SelfTest { backend: kind.name(), why };
    let p = page_size();
    let space = Arc::new(Space::with_window(16 * p)?);
    let range = space.range(0, 16 * p)?;
    space.commit(range, Prot::READ_WRITE)?;
    let t = Tracker::make(&space, kind, config)?;
    t.arm(range)?;
    let at = GuestAddr(5 * p + 8);
    if config.embedder_handles_faults && kind.protects() && !t.handle_fault(space.host_addr(at)?, true) {
        return Err(fail("handle_fault did not take a write to an armed page".into()));
    }
    space.store(at, &[1])?;
    let got = t.collect(range)?;
    let want = vec![PageRun { start: GuestAddr(5 * p), pages: 1 }];
    if got.runs != want {
        let found = if got.runs.is_empty() { "nothing".to_string() } else { format!("{:?}", got.runs) };
        return Err(fail(format!("wrote page 0x{:x}, collect reported {found}", 5 * p)));
    }
    if t.collect(range)?.pages() != 0 {
        return Err(fail("a second collect reported pages again".into()));
    }
    Ok(())
}

/// How a tracker is made ([`Tracker::new`]). [`Default`]: the backend chosen by
/// self-test, verify mode off, emuhost's own `SIGSEGV` handler, collects that read the published
/// layout.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TrackerConfig {
    /// The backend (it must pass its self-test, unless [`TrackerConfig::skip_self_test`]);
    /// `None`: the first of [`BackendKind::AUTO`] that passes (`EMUHOST_WATCH` sets it).
    pub backend: Option<BackendKind>,
    /// With a backend given, make the tracker without running its self-test first (tests and
    /// benches that make many trackers of a backend known to work).
    pub skip_self_test: bool,
    /// Check every collect against a region query (`EMUHOST_VERIFY_COLLECT`).
    pub verify: bool,
    /// The embedder owns `SIGSEGV`: emuhost installs no handler (not even for the self-test), and
    /// the embedder's handler calls [`Tracker::handle_fault`] (or a [`FaultHandle`]'s, or
    /// [`handle_fault`]) for every fault and passes on those it returns false for. A write to
    /// an armed page that reaches no such call faults as it would without a tracker (with the
    /// mprotect backend; the uffd backend's writes never fault).
    pub embedder_handles_faults: bool,
    /// Collects and queries read the layout the space publishes after each change, and never
    /// wait for the space's lock (`EMUHOST_WATCH_PUBLISHED_LAYOUT`, on by default); off, they
    /// read the layout under the space's lock, so they wait for any change in progress (the old
    /// way, kept for A/B measurements). See docs/watch.md, "The published layout".
    pub published_layout: bool,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        TrackerConfig {
            backend: None,
            skip_self_test: false,
            verify: false,
            embedder_handles_faults: false,
            published_layout: true,
        }
    }
}

impl TrackerConfig {
    /// Sets [`TrackerConfig::skip_self_test`].
    pub fn skip_self_test(mut self, on: bool) -> Self {
        self.skip_self_test = on;
        self
    }

    /// Sets [`TrackerConfig::backend`].
    pub fn backend(mut self, kind: Option<BackendKind>) -> Self {
        self.backend = kind;
        self
    }

    /// Sets [`TrackerConfig::verify`].
    pub fn verify(mut self, on: bool) -> Self {
        self.verify = on;
        self
    }

    /// Sets [`TrackerConfig::published_layout`].
    pub fn published_layout(mut self, on: bool) -> Self {
        self.published_layout = on;
        self
    }

    /// Sets [`TrackerConfig::embedder_handles_faults`].
    pub fn embedder_handles_faults(mut self, on: bool) -> Self {
        self.embedder_handles_faults = on;
        self
    }
}
