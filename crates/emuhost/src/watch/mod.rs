//! What the guest wrote: a tracker arms guest ranges and collects the pages written since the last
//! collect, arming them again in the same step.
//!
//! Backends, chosen at run time by a self-test (arm, write one page, collect, expect exactly it),
//! best first, or forced with `EMUHOST_WATCH=uffd|mprotect`:
//! 1. `uffd`: userfaultfd write-protect in asynchronous mode, read and re-armed by one
//!    `PAGEMAP_SCAN` (`PM_SCAN_WP_MATCHING`) per allocation (`sys/linux/uffd.rs`);
//! 2. `mprotect`: armed pages are made read-only and a `SIGSEGV` handler records the first write
//!    (`sys/linux/segv.rs`).
//!
//! There is no soft-dirty backend: its bits are read (`/proc/self/pagemap`) and cleared
//! (`/proc/self/clear_refs`, the whole process) in two steps, so a write landing between the two
//! is lost whatever the order of the reads; under qemu on Debian's 6.1 kernel, about half of the
//! writes one thread made while another read every page and then cleared once were never seen.
//!
//! A collect reads one allocation per read, from `space`'s extent map, with no region query. A
//! failed read asks the kernel about the region: memory released behind the space's back (mapped
//! anew, or unmapped) is reported as not tracked, anything else is an error; the failure is
//! remembered per allocation until the allocation's commit state (its generation) changes.
//! `EMUHOST_VERIFY_COLLECT=1` checks every read against a region query.
//!
//! The tracker observes the space: a commit or protection over armed pages, a release, or a view
//! split keeps the tracking of every other page, and pages mapped anew inside an armed range are
//! armed again and reported written once (their content changed). A write before a decommit is
//! reported by the next collect (the tracker reads the pages just before the release), decommitted
//! pages committed again are reported once, and arming armed pages again keeps their writes. One
//! tracker per space (a second is refused); dropping it gives armed pages their protection back.
//! Transparent huge pages would make a write report its whole 2 MiB page, so arming asks the
//! kernel not to use them there (`MADV_NOHUGEPAGE`; Wine does the same for its write watches).
//!
//! The invariant above all: a write that happens after collect N is reported by collect N + 1.
//!
//! For an emulator's caches: [`Tracker::collect_into`] ORs the written pages into the caller's
//! bitmap words at a chosen granularity without allocating (once the tracker's buffers have
//! grown), [`Tracker::query_into`] reports without arming again, and [`Tracker::consumer`] gives
//! each cache its own dirty state on the one tracker. An embedder that owns `SIGSEGV` makes its
//! tracker with [`TrackerConfig::embedder_handles_faults`] and calls [`Tracker::handle_fault`]
//! (or a [`FaultHandle`], or [`handle_fault`]) from its own handler.

mod backend;
pub mod bare;
mod bitmap;
mod cache;

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};

pub use bitmap::PageBitmap;
pub use cache::{Consumer, Written};

use crate::errors::error_chain as chain;
use crate::space::ranges::RangeMap;
use crate::space::{
    Change, CommitPath, GuestAddr, GuestRange, Layout, Observer, Prot, Region, SectionId, Space, SpaceError, View,
    page_size,
};
use crate::sys::segv::{self, TableKey};
use backend::{Backend, Runs};
use bitmap::Bits;

/// The name of the switch that sets [`TrackerConfig::verify`] (a mismatch names it).
pub const VERIFY_SWITCH: &str = "EMUHOST_VERIFY_COLLECT";

/// A write-tracking backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BackendKind {
    Uffd,
    Mprotect,
}

impl BackendKind {
    /// Its name (the one the `EMUHOST_WATCH` switch takes).
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Uffd => "uffd",
            BackendKind::Mprotect => "mprotect",
        }
    }

    /// Those tried when nothing is forced, best first.
    pub const AUTO: [BackendKind; 2] = [BackendKind::Uffd, BackendKind::Mprotect];
}

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

/// A run of written pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRun {
    pub start: GuestAddr,
    pub pages: u64,
}

impl PageRun {
    pub fn end(&self) -> GuestAddr {
        GuestAddr(self.start.0 + self.pages * page_size())
    }
}

/// What a collect found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Collected {
    /// Pages written since the last collect, in address order, as runs.
    pub runs: Vec<PageRun>,
    /// Armed spans that are not tracked any more (released behind the space's back).
    pub untracked: Vec<GuestRange>,
    /// This collect's number: the tracker's collects are numbered 1, 2, ... in the order they
    /// ran (see [`Tracker::collects_started`]).
    pub seq: u64,
}

impl Collected {
    /// The number of pages written.
    pub fn pages(&self) -> u64 {
        self.runs.iter().map(|r| r.pages).sum()
    }

    /// Every written page's address, in order.
    pub fn page_addrs(&self) -> Vec<GuestAddr> {
        let p = page_size();
        self.runs.iter().flat_map(|r| (0..r.pages).map(move |i| GuestAddr(r.start.0 + i * p))).collect()
    }

    /// The written pages of `range` as a bitmap of `GRAIN` bytes per bit.
    pub fn bitmap<const GRAIN: u64>(&self, range: GuestRange) -> PageBitmap<GRAIN> {
        let mut b = PageBitmap::new(range);
        for r in &self.runs {
            b.set_range(r.start.0, r.end().0);
        }
        b
    }
}

/// Why the backend in use was chosen, for `emuhost probe`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub kind: BackendKind,
    pub why: String,
}

/// Chooses a backend as `config` says: the one [`TrackerConfig::backend`] forces (it must pass
/// its self-test), else the first of [`BackendKind::AUTO`] that passes. The self-tests run as
/// `config` makes trackers (with the embedder's fault handling, none of them installs a handler).
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
    let t = Tracker::make(&space, kind, config.verify, !config.embedder_handles_faults)?;
    t.arm(range)?;
    let at = GuestAddr(5 * p + 8);
    if config.embedder_handles_faults && kind == BackendKind::Mprotect && !t.handle_fault(space.host_addr(at)?, true) {
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

#[derive(Default)]
struct Inner {
    armed: RangeMap<()>,
    /// Guest ranges to report written at the next collect (pages mapped anew while armed).
    pending: RangeMap<()>,
    /// Pages the guest made inaccessible itself (not a release).
    noaccess: RangeMap<()>,
    /// Allocations whose read failed, by start: (end, generation).
    failed: HashMap<u64, (u64, u64)>,
    /// Armed pages released by the space: reported when committed or mapped again (new content).
    unmapped: RangeMap<()>,
    /// Host writes in flight ([`Tracker::host_write`]): a collect reports these pages and leaves
    /// them writable.
    hosting: Vec<(u64, u64)>,
    /// Pages an arm met under a host write in flight: armed when the last such write ends.
    deferred: RangeMap<()>,
    /// A collect's buffers, kept between collects.
    scratch: Scratch,
    /// Each consumer's pages written and not yet taken ([`Tracker::consumer`]).
    consumers: Vec<cache::Pending>,
    /// The tracker's own pages written and not yet taken, once it has had a consumer: a
    /// consumer's collect takes the kernel's marks, so from then on the tracker's own reads are
    /// one more consumer.
    own: Option<cache::Pending>,
    /// The last consumer id given out.
    consumer_ids: u64,
}

/// A collect's (or a query's) buffers: taken out of [`Inner`] while it runs and put back, so a
/// collect allocates nothing once they have grown to its size.
#[derive(Default)]
struct Scratch {
    /// Guest `(start, end)` armed in the range.
    armed: Pairs,
    /// The spans to read.
    spans: Vec<Span>,
    /// The result: written guest `(start, end)`, merged, in order (none when the read set them
    /// in the caller's bits).
    runs: Pairs,
    /// The result: spans not tracked any more.
    untracked: Vec<GuestRange>,
}

/// How a read of a range treats the pages: a collect takes them and arms them again, a query
/// only looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Read {
    Collect,
    Query,
}

/// Whose read it is: the tracker's own (its result is the tracker's own pending pages once it
/// has had a consumer), or a consumer's (which takes its pending pages itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reader {
    Own,
    Consumer,
}

/// How a tracker is made ([`Tracker::with_config`]). [`Default`]: the backend chosen by
/// self-test, verify mode off, emuhost's own `SIGSEGV` handler.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
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

    /// Sets [`TrackerConfig::embedder_handles_faults`].
    pub fn embedder_handles_faults(mut self, on: bool) -> Self {
        self.embedder_handles_faults = on;
        self
    }
}

/// What an embedder's `SIGSEGV` handler keeps to hand faults to one tracker: plain integers
/// (`Copy`, `Send`, `Sync`, `'static`), so a handler may read it from a static without holding
/// the tracker. It stays harmless after the tracker is gone: it then takes no fault (but the
/// first one on a page the drop gave back, see [`FaultHandle::handle_fault`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultHandle {
    key: Option<TableKey>,
}

impl FaultHandle {
    /// Hands the fault at host address `addr` (the signal's `si_addr`) to the tracker; call it
    /// from a `SIGSEGV` handler. `is_write`: the fault was a write (pass `true` where the handler
    /// cannot tell; a read never faults on an armed page, so `false` returns false at once).
    ///
    /// True (the fault was the tracker's) in exactly two cases: the page is armed (it is now
    /// writable and marked written: the next collect reports it), or a disarm (or the tracker's
    /// drop) gave this page its writable protection back and this is the first fault on it since
    /// (a write that faulted while the page was still read-only and reached the handler after).
    /// Return from the handler: the CPU retries the write. False for everything else: a page of
    /// the window never armed, one the guest or the space changed after its disarm, a second
    /// fault on the same disarmed page, a page of a tracker whose space is gone. Handle it or pass
    /// it on to the previous handler.
    ///
    /// Async-signal-safe: no allocation, no lock, no panic; atomics and one `mprotect` (more where
    /// the kernel is at its map limit). With the uffd backend it returns false always: writes to
    /// armed pages never fault there.
    pub fn handle_fault(&self, addr: usize, is_write: bool) -> bool {
        match &self.key {
            Some(key) if is_write => segv::fault_in(key, addr),
            _ => false,
        }
    }
}

/// Hands the fault at host address `addr` to whichever tracker of this process has the page
/// armed (what emuhost's own handler does): [`FaultHandle::handle_fault`] for every tracker
/// at once, for an embedder's handler that holds no tracker. Async-signal-safe.
pub fn handle_fault(addr: usize, is_write: bool) -> bool {
    is_write && segv::fault(addr)
}

/// A span to read: guest `start..end`, and the allocation it lies in, `(start, end, generation)`
/// (`None` for a shared view).
type Span = (u64, u64, Option<(u64, u64, u64)>);

fn add(map: &mut RangeMap<()>, a: u64, b: u64) {
    map.remove(a, b, |_, _, _| ());
    map.insert(a, b, ());
}

fn clip(a: u64, b: u64, s: u64, e: u64) -> Option<(u64, u64)> {
    let (x, y) = (a.max(s), b.min(e));
    (x < y).then_some((x, y))
}

/// What the space's observer and the tracker share. The space holds it weakly and may hold it
/// (while it tells a change) past the tracker's drop, so the tracker's `Drop`, which takes the
/// space's lock, never runs from inside the space.
struct Core {
    backend: Box<dyn Backend>,
    inner: Mutex<Inner>,
}

impl Core {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The spaces that have a tracker, by host base (a live tracker keeps its space, so its base is
/// unique among them).
static TRACKED: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// A space's claim to its one tracker, given back last when the tracker drops.
struct Claim(usize);

impl Claim {
    fn take(base: usize) -> Result<Claim, WatchError> {
        let mut t = TRACKED.lock().unwrap_or_else(|p| p.into_inner());
        if t.contains(&base) {
            return Err(WatchError::SecondTracker { base });
        }
        t.push(base);
        Ok(Claim(base))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        TRACKED.lock().unwrap_or_else(|p| p.into_inner()).retain(|b| *b != self.0);
    }
}

/// A write tracker over one space (one at a time: a second is refused, see the README's table of
/// tracking semantics). Dropping it gives armed pages back the protection the space gave them.
pub struct Tracker {
    // Dropped in this order: the backend (its page-state table), the claim, then the space (so a
    // new space cannot take the address while the claim is held).
    core: Arc<Core>,
    _claim: Claim,
    space: Arc<Space>,
    verify: bool,
    /// Collects started, raised under the lock as each begins.
    started: AtomicU64,
    /// A collect's layout of the space, kept between collects (taken before the space's lock).
    layout: Mutex<Layout>,
    /// The process that made the tracker: its userfaultfd and pagemap act on that process's pages.
    pid: u32,
}

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker").field("backend", &self.core.backend.kind()).field("verify", &self.verify).finish()
    }
}

impl Tracker {
    /// A tracker as `config` says: its backend (or the one the self-tests choose; either way it
    /// must pass its self-test, run as `config` makes trackers, unless the config skips it),
    /// verify mode, and who handles faults. A second tracker on a space that has one is refused
    /// ([`WatchError::SecondTracker`]). `TrackerConfig::default()`: the best backend that passes
    /// its self-test, emuhost's own `SIGSEGV` handler.
    pub fn new(space: &Arc<Space>, config: &TrackerConfig) -> Result<Arc<Tracker>, WatchError> {
        let handler = !config.embedder_handles_faults;
        if let (Some(kind), true) = (config.backend, config.skip_self_test) {
            return Self::make(space, kind, config.verify, handler);
        }
        let choice = choose(config)?;
        tracing::info!(backend = choice.kind.name(), "write tracking: {} ({})", choice.kind.name(), choice.why);
        Self::make(space, choice.kind, config.verify, handler)
    }

    fn make(space: &Arc<Space>, kind: BackendKind, verify: bool, handler: bool) -> Result<Arc<Tracker>, WatchError> {
        let claim = Claim::take(space.host_base())?;
        let backend = backend::make(kind, space, handler)
            .map_err(|source| WatchError::Unavailable { backend: kind.name(), source })?;
        let core = Arc::new(Core { backend, inner: Mutex::new(Inner::default()) });
        let weak: std::sync::Weak<dyn Observer> = Arc::downgrade(&(core.clone() as Arc<dyn Observer>));
        space.observe(weak);
        Ok(Arc::new(Tracker {
            space: space.clone(),
            core,
            verify,
            started: AtomicU64::new(0),
            _claim: claim,
            layout: Mutex::default(),
            pid: std::process::id(),
        }))
    }

    /// The handle an embedder's `SIGSEGV` handler keeps for this tracker (see
    /// [`FaultHandle::handle_fault`]).
    pub fn fault_handle(&self) -> FaultHandle {
        FaultHandle { key: self.core.backend.fault_key() }
    }

    /// [`FaultHandle::handle_fault`] for this tracker: call it from the embedder's `SIGSEGV`
    /// handler with the fault's host address. Async-signal-safe. A handler that reads the tracker
    /// from a static must keep it alive while handlers run; [`Tracker::fault_handle`] needs no
    /// such care.
    pub fn handle_fault(&self, addr: usize, is_write: bool) -> bool {
        self.fault_handle().handle_fault(addr, is_write)
    }

    pub fn kind(&self) -> BackendKind {
        self.core.backend.kind()
    }

    pub fn verifying(&self) -> bool {
        self.verify
    }

    /// The number of the latest collect to start (0 before any). Collects run one at a time, so
    /// a write that reads `e1` before it and `e2` after it must be reported by a collect of its
    /// page numbered from `e1` up to the first one numbered above `e2` (which started after the
    /// write ended), whichever threads collect.
    pub fn collects_started(&self) -> u64 {
        self.started.load(SeqCst)
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.core.inner()
    }

    /// An error unless this is the process that made the tracker: after `fork`, the child's copy
    /// holds the parent's userfaultfd and pagemap, and would read and re-arm the parent's pages.
    fn same_process(&self) -> Result<(), WatchError> {
        let now = std::process::id();
        if now == self.pid { Ok(()) } else { Err(WatchError::OtherProcess { made_in: self.pid, now }) }
    }

    fn host(&self, a: u64) -> usize {
        self.space.host_base() + a as usize
    }

    fn os(&self, op: &'static str, range: GuestRange, source: io::Error) -> WatchError {
        WatchError::Os { op, range, backend: self.kind().name(), source }
    }

    /// Arms `range`: from now on, writes to its pages are reported by the next collect. Pages
    /// armed already keep their tracking: a write to them before this arm is still reported (an
    /// emulator arms after every commit, and a commit over armed pages must not forget writes).
    pub fn arm(&self, range: GuestRange) -> Result<(), WatchError> {
        self.same_process()?;
        let range = self.space.range(range.start().0, range.len())?;
        let _changing = self.space.maybe_changing();
        // Pages armed already (an arm after every commit, most often) need no system call, so
        // nothing to wait for; with uffd not even a region query (which, under the space's
        // lock, would queue behind any writer waiting for the memory-map lock).
        let todo = self.space.with_layout(range, |_| !self.to_arm(&self.inner(), range).is_empty());
        match (todo, self.kind()) {
            (true, _) => self.space.wait_for_long_reads(),
            (false, BackendKind::Uffd) => return Ok(()),
            // The region query keeps verify mode's record of write-only pages.
            (false, BackendKind::Mprotect) => {}
        }
        self.space.with_layout(range, |_| {
            let regions = self.space.kernel_regions(range)?;
            self.arm_locked(&mut self.inner(), range, &regions)
        })
    }

    /// The pages an arm of `range` arms: those not armed yet, and those of allocations whose read
    /// failed (to track them again).
    fn to_arm(&self, inner: &Inner, range: GuestRange) -> Vec<(u64, u64)> {
        let (a, b) = (range.start().0, range.end().0);
        let mut todo = inner.armed.gaps(a, b);
        todo.extend(inner.failed.iter().filter_map(|(s, (e, _))| clip(a, b, *s, *e)));
        todo
    }

    /// Arms the pages [`Tracker::to_arm`] names, but not under a host write in flight: those wait
    /// for its end.
    fn arm_locked(&self, inner: &mut Inner, range: GuestRange, regions: &[Region]) -> Result<(), WatchError> {
        let (a, b) = (range.start().0, range.end().0);
        let base = self.space.host_base();
        for (s, e) in self.to_arm(inner, range) {
            let (outside, inside) = split(s, e, &inner.hosting);
            for (x, y) in inside {
                add(&mut inner.deferred, x, y);
            }
            for (x, y) in outside {
                self.core
                    .backend
                    .arm(self.host(x), self.host(y), regions, base)
                    .map_err(|e| self.os("arm", range, e))?;
                add(&mut inner.armed, x, y);
            }
        }
        if self.kind() == BackendKind::Mprotect {
            // Write-only pages lose their write to arming and look inaccessible (`---`): the guest's
            // doing, for verify mode.
            for r in regions.iter().filter(|r| r.write && !r.read && !r.exec) {
                if let Some((x, y)) = clip(a, b, r.start as u64, r.end as u64) {
                    add(&mut inner.noaccess, x, y);
                }
            }
        }
        inner.failed.retain(|s, (e, _)| *e <= a || *s >= b);
        Ok(())
    }

    /// Stops tracking `range` (its pages get their protection back).
    pub fn disarm(&self, range: GuestRange) -> Result<(), WatchError> {
        self.same_process()?;
        let range = self.space.range(range.start().0, range.len())?;
        let _changing = self.space.changing();
        self.space.with_layout(range, |_| {
            let mut guard = self.inner();
            let inner = &mut *guard;
            let (a, b) = (range.start().0, range.end().0);
            let pieces: Vec<(u64, u64)> =
                inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)).collect();
            for (s, e) in pieces {
                self.core.backend.disarm(self.host(s), self.host(e)).map_err(|err| self.os("disarm", range, err))?;
            }
            for map in [&mut inner.armed, &mut inner.pending, &mut inner.unmapped, &mut inner.deferred] {
                map.remove(a, b, |_, _, _| ());
            }
            Ok(())
        })
    }

    /// Makes the armed pages of `range` writable by the host (a `read(2)` into guest memory, a
    /// copy by the kernel) and reports them written at the next collect. With the mprotect backend
    /// such a write would fail with `EFAULT` otherwise; the other backends need nothing.
    ///
    /// A collect on another thread between this and the write arms the pages again (and the
    /// write fails): use [`Tracker::host_write`] where collects run concurrently.
    pub fn prepare_host_write(&self, range: GuestRange) -> Result<(), WatchError> {
        self.same_process()?;
        let range = self.space.range(range.start().0, range.len())?;
        self.space.with_layout(range, |_| self.prepare_locked(&self.inner(), range))
    }

    fn prepare_locked(&self, inner: &Inner, range: GuestRange) -> Result<(), WatchError> {
        let (a, b) = (range.start().0, range.end().0);
        for (s, e, _) in inner.armed.overlapping(a, b) {
            let (s, e) = clip(a, b, s, e).expect("overlapping");
            self.core
                .backend
                .prepare_host_write(self.host(s), self.host(e))
                .map_err(|err| self.os("prepare", range, err))?;
        }
        Ok(())
    }

    /// Runs `write`, a write by the host through the kernel over `range` ([`Space::write`],
    /// [`Space::populate`], [`Space::zero`], a `read(2)` into guest memory), with the armed pages
    /// there prepared for it as [`Tracker::prepare_host_write`] does. No lock is held while `write`
    /// runs, so it may block (a `read(2)` from a pipe another thread feeds) and collect, commit or
    /// protect on any thread go on meanwhile. Where the backend needs the preparation (mprotect),
    /// until `write` returns a collect reports the pages of `range` as written and leaves them
    /// writable, and an arm there waits for its end (every collect meanwhile reports the pages it
    /// covers too, since they stay writable and untracked); the next collect after it reads them
    /// as usual.
    /// The other backends need nothing and record nothing.
    pub fn host_write<R>(&self, range: GuestRange, write: impl FnOnce() -> R) -> Result<R, WatchError> {
        let hosting = self.begin_host_write(range)?;
        let _end = hosting.map(|range| HostWriteEnd { tracker: self, range });
        Ok(write())
    }

    /// [`Tracker::host_write`] as a begin and an end, for a caller that cannot pass a closure
    /// (the C API's `emuhost_tracker_host_write_begin`): the host's write may be made while the
    /// guard lives, and its drop ends it. The guard keeps the tracker alive.
    pub fn host_write_owned(self: &Arc<Self>, range: GuestRange) -> Result<OwnedHostWrite, WatchError> {
        let range = self.begin_host_write(range)?;
        Ok(OwnedHostWrite { tracker: self.clone(), range })
    }

    /// Prepares `range` for a host write where the backend needs it: the range to end then.
    fn begin_host_write(&self, range: GuestRange) -> Result<Option<GuestRange>, WatchError> {
        self.same_process()?;
        let range = self.space.range(range.start().0, range.len())?;
        if !self.core.backend.needs_host_write_prepare() {
            return Ok(None);
        }
        self.space.with_layout(range, |_| {
            let mut inner = self.inner();
            self.prepare_locked(&inner, range)?;
            inner.hosting.push((range.start().0, range.end().0));
            Ok::<(), WatchError>(())
        })?;
        Ok(Some(range))
    }

    /// Collects the pages of `range` written since the last collect and arms them again.
    pub fn collect(&self, range: GuestRange) -> Result<Collected, WatchError> {
        let p = page_size();
        self.read(range, Read::Collect, Reader::Own, None, |sc, seq, _, _| Collected {
            runs: sc.runs.iter().map(|&(s, e)| PageRun { start: GuestAddr(s), pages: (e - s) / p }).collect(),
            untracked: sc.untracked.clone(),
            seq,
        })
    }

    /// Reads `range` (`how`: a collect or a query, for `who`) under the space's lock and the
    /// tracker's, then gives `out` the result (in the scratch buffers), the collect's number, the
    /// tracker's state and `bits`. Given `bits`, the read may set the runs it finds there
    /// straight from the kernel's output (then the scratch holds none).
    fn read<R>(
        &self,
        range: GuestRange,
        how: Read,
        who: Reader,
        mut bits: Option<&mut Bits>,
        out: impl FnOnce(&Scratch, u64, &mut Inner, Option<&mut Bits>) -> R,
    ) -> Result<R, WatchError> {
        self.same_process()?;
        let range = self.space.range(range.start().0, range.len())?;
        if how == Read::Collect {
            // Fault injection may make a foreign SIGSEGV here first (a no-op in the default build).
            crate::faults::at_collect().map_err(|e| self.os("collect (after a foreign SIGSEGV)", range, e))?;
        }
        let mut layout = self.layout.lock().unwrap_or_else(|p| p.into_inner());
        self.space.with_layout_in(range, &mut layout, |layout| {
            let mut inner = self.inner();
            let seq = match how {
                Read::Collect => self.started.fetch_add(1, SeqCst) + 1,
                Read::Query => self.started.load(SeqCst),
            };
            let mut sc = std::mem::take(&mut inner.scratch);
            let result = self
                .read_locked(&mut inner, layout, range, (how, who), &mut sc, bits.as_deref_mut())
                .map(|()| out(&sc, seq, &mut inner, bits));
            inner.scratch = sc;
            result
        })
    }

    /// The spans of `range` to read into `sc.spans`: allocations and views, clipped to the range
    /// and to what is armed. Pages under a host write in flight go to `sc.runs` instead (they
    /// are reported, and not read: the read would arm them under the write, which would fail).
    /// So do pages whose arm waits for such a write to end: armed for the caller, but writable
    /// and untracked until then.
    fn spans(inner: &Inner, layout: &Layout, a: u64, b: u64, sc: &mut Scratch) {
        sc.runs.extend(inner.deferred.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)));
        sc.armed.extend(inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)));
        for al in &layout.allocations {
            let (s, e) = (al.range.start().0, al.range.end().0);
            for &(x, y) in &sc.armed {
                if let Some((p, q)) = clip(s, e, x, y) {
                    sc.spans.push((p, q, Some((s, e, al.generation))));
                }
            }
        }
        for v in &layout.views {
            for &(x, y) in &sc.armed {
                if let Some((p, q)) = clip(v.range.start().0, v.range.end().0, x, y) {
                    sc.spans.push((p, q, None));
                }
            }
        }
        // Spans do not overlap: an unstable sort gives the order and allocates nothing.
        sc.spans.sort_unstable_by_key(|s| s.0);
        if !inner.hosting.is_empty() {
            let mut rest = Vec::new();
            for &(s, e, alloc) in &sc.spans {
                let (outside, inside) = split(s, e, &inner.hosting);
                sc.runs.extend(inside);
                rest.extend(outside.into_iter().map(|(x, y)| (x, y, alloc)));
            }
            sc.spans = rest;
        }
    }

    /// Reads `range` into `sc.runs` (written pages, merged) and `sc.untracked`. A collect takes
    /// the marks, arms the pages again, takes the pending pages and adds what it found to every
    /// consumer's pending pages; a query changes nothing. With `bits`, when the backend's runs
    /// are the whole result and no consumer needs them, they go into `bits` instead of
    /// `sc.runs`: one pass over the kernel's output, no buffer of runs (2 MiB per GiB at 50 %
    /// written; with it, such a collect took 1.38x the bare kernel's scan on the H200). Once the
    /// tracker has had a consumer, its own read reports its own pending pages instead (see
    /// [`Inner::own`]).
    fn read_locked(
        &self,
        inner: &mut Inner,
        layout: &Layout,
        range: GuestRange,
        (how, who): (Read, Reader),
        sc: &mut Scratch,
        mut bits: Option<&mut Bits>,
    ) -> Result<(), WatchError> {
        let (a, b) = (range.start().0, range.end().0);
        sc.armed.clear();
        sc.spans.clear();
        sc.runs.clear();
        sc.untracked.clear();
        Self::spans(inner, layout, a, b, sc);
        // Runs from here on are the backend's, made guest runs and joined as they are read
        // (`Runs`). Spans are in order and apart, so with nothing else in the result (the common
        // case) the runs are merged already; else a sort and a merge pass make them so.
        let from = sc.runs.len();
        let base = self.space.host_base() as u64;
        let pending = inner.pending.overlapping(a, b).next().is_some();
        let aliased = layout.aliased_inside || !layout.aliases.is_empty();
        let direct = from == 0 && !pending && inner.own.is_none() && !aliased;
        if !direct {
            bits = None;
        }
        for i in 0..sc.spans.len() {
            let (s, e, alloc) = sc.spans[i];
            let span = GuestRange::from_bounds(s, e)?;
            if let Some((start, end, generation)) = alloc
                && inner.failed.get(&start) == Some(&(end, generation))
            {
                sc.untracked.push(span);
                continue;
            }
            let mark = bits.as_ref().map(|b| b.bytes);
            let mut runs = Runs::new(&mut sc.runs, base, from, bits.as_deref_mut());
            let got = match how {
                Read::Collect => {
                    if self.verify {
                        self.verify_span(inner, span)?;
                    }
                    self.core.backend.read(self.host(s), self.host(e), &mut runs)
                }
                Read::Query => self.core.backend.peek(self.host(s), self.host(e), &mut runs),
            };
            if let Err(err) = got {
                if self.unexpected(inner, span)?.is_none() {
                    return Err(self.os(if how == Read::Collect { "collect" } else { "query" }, span, err));
                }
                // The span is reported whole: runs of it set before the read failed are not
                // counted twice.
                if let (Some(b), Some(m)) = (bits.as_deref_mut(), mark) {
                    b.bytes = m;
                }
                sc.untracked.push(span);
                if let (Read::Collect, Some((start, end, generation))) = (how, alloc) {
                    inner.failed.insert(start, (end, generation));
                }
            }
        }
        if aliased {
            self.read_aliases(inner, layout, (a, b), how, sc);
        }
        if from > 0 || pending || aliased {
            sc.runs.extend(inner.pending.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)));
            merge(&mut sc.runs, a, b);
        }
        if how == Read::Collect {
            inner.pending.remove(a, b, |_, _, _| ());
            for c in inner.consumers.iter_mut().chain(inner.own.as_mut()) {
                c.add(sc.runs.iter().copied());
                c.add(sc.untracked.iter().map(|u| (u.start().0, u.end().0)));
            }
        }
        if let (Reader::Own, Some(own)) = (who, inner.own.as_mut()) {
            // The tracker's own result is its own pending pages: a collect takes them (they hold
            // what it just read), a query adds them to what it peeked.
            match how {
                Read::Collect => {
                    sc.runs.clear();
                    own.runs(a, b, true, &mut sc.runs);
                }
                Read::Query => {
                    own.runs(a, b, false, &mut sc.runs);
                    merge(&mut sc.runs, a, b);
                }
            }
        }
        Ok(())
    }

    /// Section pages shown at several armed addresses (aliases): a write through one is reported
    /// at every one. The views of `a..b` report the section pages written through any of their
    /// aliases now; the aliases outside the range are read too (marks taken with a collect, only
    /// looked at with a query), and every alias outside the range gets the section pages written
    /// through any of them as pending pages, for its own next collect. An alias that cannot be
    /// read counts as written whole.
    fn read_aliases(&self, inner: &mut Inner, layout: &Layout, (a, b): (u64, u64), how: Read, sc: &mut Scratch) {
        let base = self.space.host_base() as u64;
        let bytes = |v: &View, x: u64, y: u64| (v.section, v.offset + (x - v.range.start().0), y - x);
        // The section bytes written: (section, offset, length).
        let mut shown: Vec<(SectionId, u64, u64)> = Vec::new();
        for v in &layout.views {
            let (vs, ve) = (v.range.start().0.max(a), v.range.end().0.min(b));
            shown.extend(sc.runs.iter().filter_map(|&(x, y)| clip(vs, ve, x, y)).map(|(x, y)| bytes(v, x, y)));
        }
        let mut runs = Vec::new();
        for av in &layout.aliases {
            let (s, e) = (av.range.start().0, av.range.end().0);
            let armed: Pairs = inner.armed.overlapping(s, e).filter_map(|(x, y, _)| clip(s, e, x, y)).collect();
            for (x, y) in armed.into_iter().flat_map(|(x, y)| split(x, y, &inner.hosting).0) {
                runs.clear();
                let mut out = Runs::new(&mut runs, base, 0, None);
                let got = match how {
                    Read::Collect => self.core.backend.read(self.host(x), self.host(y), &mut out),
                    Read::Query => self.core.backend.peek(self.host(x), self.host(y), &mut out),
                };
                if got.is_err() {
                    runs.clear();
                    runs.push((x, y));
                }
                shown.extend(runs.iter().map(|&(p, q)| bytes(av, p, q)));
            }
        }
        // Every armed page showing a written section byte: reported now inside the range, kept
        // pending outside it (a collect only).
        let at = |v: &View, lo: u64, hi: u64, out: &mut dyn FnMut(u64, u64)| {
            for &(_, off, len) in shown.iter().filter(|w| w.0 == v.section) {
                let start = v.range.start().0;
                let (o1, o2) = (off.max(v.offset), (off + len).min(v.offset + v.range.len()));
                if let Some((x, y)) =
                    (o1 < o2).then(|| clip(lo, hi, start + (o1 - v.offset), start + (o2 - v.offset))).flatten()
                {
                    for (p, q, _) in inner.armed.overlapping(x, y) {
                        if let Some((p, q)) = clip(x, y, p, q) {
                            out(p, q);
                        }
                    }
                }
            }
        };
        let mut now = Vec::new();
        for v in &layout.views {
            at(v, a, b, &mut |p, q| now.push((p, q)));
        }
        let mut later = Vec::new();
        if how == Read::Collect {
            for av in &layout.aliases {
                at(av, 0, u64::MAX, &mut |p, q| later.push((p, q)));
            }
        }
        sc.runs.extend(now);
        for (p, q) in later {
            add(&mut inner.pending, p, q);
        }
    }

    /// What the kernel has in `span` that a committed, armed span should not have, if anything:
    /// no mapping, or an inaccessible one the guest did not ask for (memory released behind the
    /// space's back).
    fn unexpected(&self, inner: &Inner, span: GuestRange) -> Result<Option<String>, WatchError> {
        let regions = self.space.kernel_regions(span)?;
        let mut at = span.start().0 as usize;
        for r in &regions {
            if r.start > at {
                return Ok(Some(format!("nothing mapped at {at:#x}..{:#x}", r.start)));
            }
            if !r.read && !r.write && !r.exec && !inner.noaccess.gaps(r.start as u64, r.end as u64).is_empty() {
                return Ok(Some(format!("reserved (PROT_NONE) memory at {:#x}..{:#x}", r.start, r.end)));
            }
            at = r.end;
        }
        if at < span.end().0 as usize {
            return Ok(Some(format!("nothing mapped at {at:#x}..{:#x}", span.end().0)));
        }
        Ok(None)
    }

    fn verify_span(&self, inner: &Inner, span: GuestRange) -> Result<(), WatchError> {
        match self.unexpected(inner, span)? {
            Some(found) => Err(WatchError::VerifyMismatch { span, found }),
            None => Ok(()),
        }
    }
}

/// Ends a host write in flight (also when its closure panics): arms what an arm deferred to it.
struct HostWriteEnd<'a> {
    tracker: &'a Tracker,
    range: GuestRange,
}

impl Drop for HostWriteEnd<'_> {
    fn drop(&mut self) {
        self.tracker.end_host_write(self.range);
    }
}

/// A host write in flight ([`Tracker::host_write_owned`]), ended when it drops. It keeps its
/// tracker alive.
pub struct OwnedHostWrite {
    tracker: Arc<Tracker>,
    /// `None` where the backend needed no preparation.
    range: Option<GuestRange>,
}

impl std::fmt::Debug for OwnedHostWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedHostWrite").field("range", &self.range).finish()
    }
}

impl Drop for OwnedHostWrite {
    fn drop(&mut self) {
        if let Some(range) = self.range {
            self.tracker.end_host_write(range);
        }
    }
}

impl Tracker {
    /// Ends the host write of `range` begun by [`Tracker::begin_host_write`].
    fn end_host_write(&self, range: GuestRange) {
        let t = self;
        let (a, b) = (range.start().0, range.end().0);
        t.space.with_layout(range, |_| {
            let mut inner = t.inner();
            if let Some(i) = inner.hosting.iter().position(|h| *h == (a, b)) {
                inner.hosting.swap_remove(i);
            }
            let due: Vec<(u64, u64)> = inner
                .deferred
                .overlapping(a, b)
                .filter_map(|(s, e, _)| clip(a, b, s, e))
                .flat_map(|(s, e)| split(s, e, &inner.hosting).0)
                .collect();
            if due.is_empty() {
                return;
            }
            let armed = t.space.kernel_regions(range).map_err(WatchError::from).and_then(|regions| {
                for &(s, e) in &due {
                    inner.deferred.remove(s, e, |_, _, _| ());
                    // The host may have written them: report them once.
                    add(&mut inner.pending, s, e);
                    let part = GuestRange::from_bounds(s, e)?;
                    t.arm_locked(&mut inner, part, &regions)?;
                }
                Ok(())
            });
            if let Err(e) = armed {
                tracing::warn!("write tracking: arming {range} after a host write failed: {}", chain(&e));
            }
        });
    }
}

/// Guest `(start, end)` pairs.
type Pairs = Vec<(u64, u64)>;

/// The parts of `s..e` outside and inside the ranges `over`.
fn split(s: u64, e: u64, over: &[(u64, u64)]) -> (Pairs, Pairs) {
    let mut inside = RangeMap::default();
    for &(x, y) in over {
        if let Some((x, y)) = clip(s, e, x, y) {
            add(&mut inside, x, y);
        }
    }
    let outside = inside.gaps(s, e);
    (outside, inside.overlapping(s, e).map(|(x, y, _)| (x, y)).collect())
}

/// Sorts guest `(start, end)` pairs, clips them to `a..b` and merges those that touch or
/// overlap, in place (allocating nothing).
fn merge(v: &mut Pairs, a: u64, b: u64) {
    v.sort_unstable();
    let mut n = 0;
    for i in 0..v.len() {
        let Some((s, e)) = clip(a, b, v[i].0, v[i].1) else { continue };
        if n > 0 && s <= v[n - 1].1 {
            v[n - 1].1 = v[n - 1].1.max(e);
        } else {
            v[n] = (s, e);
            n += 1;
        }
    }
    v.truncate(n);
}

impl Drop for Tracker {
    /// Gives armed pages back the protection the space gave them (with mprotect they would stay
    /// read-only, and the next store would die), under the space's lock so no change of the space
    /// runs in between.
    fn drop(&mut self) {
        // In a fork's child the backend's files act on the parent's pages: leave them be.
        if self.same_process().is_err() {
            return;
        }
        let Ok(first) = self.space.range(0, page_size()) else { return };
        self.space.with_layout(first, |_| {
            let mut inner = self.inner();
            let pieces: Vec<(u64, u64)> = inner.armed.iter().map(|(s, e, _)| (s, e)).collect();
            for (s, e) in pieces {
                if let Err(err) = self.core.backend.disarm(self.host(s), self.host(e)) {
                    tracing::warn!("write tracking: giving {s:#x}..{e:#x} its protection back failed: {err}");
                }
            }
            *inner = Inner::default();
        });
    }
}

impl Core {
    /// The space is about to release `range`: the writes to its armed pages are kept for the next
    /// collect (as Windows' write watch keeps them), since the release takes the record with it.
    fn releasing(&self, inner: &mut Inner, space: &Space, range: GuestRange) {
        let (a, b) = (range.start().0, range.end().0);
        let base = space.host_base();
        let pieces: Vec<(u64, u64)> = inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)).collect();
        for (s, e) in pieces {
            let mut runs = Vec::new();
            match self.backend.read(
                base + s as usize,
                base + e as usize,
                &mut Runs::new(&mut runs, base as u64, 0, None),
            ) {
                Ok(()) => {
                    for (x, y) in runs {
                        add(&mut inner.pending, x, y);
                    }
                }
                // Unreadable (released behind the space's back): report it all, so nothing is lost.
                Err(_) => add(&mut inner.pending, s, e),
            }
        }
    }
}

impl Observer for Core {
    // With uffd a release that keeps the mappings keeps their registration: the re-arm of the
    // released pages and a later arm of them register nothing.
    fn keeps_mappings(&self) -> bool {
        self.backend.kind() == BackendKind::Uffd
    }

    fn changed(&self, space: &Space, change: Change) {
        let mut inner = self.inner();
        let (range, prot) = match change {
            Change::Releasing { range } => return self.releasing(&mut inner, space, range),
            Change::Committed { range, prot, .. }
            | Change::Protected { range, prot }
            | Change::Mapped { range, prot } => (range, prot),
            Change::Released { range, .. } => (range, Prot::NONE),
        };
        let (a, b) = (range.start().0, range.end().0);
        // With mprotect, armed write-only pages look inaccessible (`---`): the guest's doing too.
        let hidden =
            if self.backend.kind() == BackendKind::Mprotect { !prot.read && !prot.exec } else { prot == Prot::NONE };
        match change {
            Change::Released { .. } => inner.noaccess.remove(a, b, |_, _, _| ()),
            _ if hidden => add(&mut inner.noaccess, a, b),
            _ => inner.noaccess.remove(a, b, |_, _, _| ()),
        }
        if let Change::Released { .. } | Change::Mapped { .. } = change {
            inner.failed.retain(|s, (e, _)| *e <= a || *s >= b);
        }
        let host = |x: u64| space.host_base() + x as usize;
        // Pages a disarm gave back and the space changed since: their faults are the guest's.
        self.backend.unstale(host(a), host(b));
        let pieces: Vec<(u64, u64)> = inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)).collect();
        for (s, e) in pieces {
            let (hs, he) = (host(s), host(e));
            let fresh =
                matches!(change, Change::Mapped { .. } | Change::Committed { path: CommitPath::RegionWalk { .. }, .. });
            let result = match change {
                Change::Released { in_place, .. } => self.backend.released(hs, he, in_place),
                _ if fresh => self.backend.remapped(hs, he, prot),
                _ => self.backend.protected(hs, he, prot),
            };
            match result {
                Ok(true) => add(&mut inner.pending, s, e),
                Ok(false) => {}
                // The tracking of these pages could not be kept: report them written, so nothing
                // is lost, and say so.
                Err(err) => {
                    tracing::warn!("write tracking: re-arming {s:#x}..{e:#x} after {change:?} failed: {err}");
                    add(&mut inner.pending, s, e);
                }
            }
            // Released pages are reported once when they are mapped again (their content is new),
            // whichever backend; the writes before the release stay pending (see `releasing`).
            if let Change::Released { .. } = change {
                add(&mut inner.unmapped, s, e);
            } else {
                let back: Vec<(u64, u64)> =
                    inner.unmapped.overlapping(s, e).filter_map(|(x, y, _)| clip(s, e, x, y)).collect();
                for (x, y) in back {
                    add(&mut inner.pending, x, y);
                }
                inner.unmapped.remove(s, e, |_, _, _| ());
            }
        }
    }
}
