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

mod backend;
mod bitmap;

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};

pub use bitmap::PageBitmap;

use crate::space::ranges::RangeMap;
use crate::space::{Change, CommitPath, GuestAddr, GuestRange, Observer, Prot, Region, Space, SpaceError, page_size};
use backend::Backend;

/// The environment switch that forces a backend.
pub const WATCH_SWITCH: &str = "EMUHOST_WATCH";
/// The environment switch that checks every collect against a region query.
pub const VERIFY_SWITCH: &str = "EMUHOST_VERIFY_COLLECT";

/// A write-tracking backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BackendKind {
    Uffd,
    Mprotect,
}

impl BackendKind {
    /// The name `EMUHOST_WATCH` takes.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Uffd => "uffd",
            BackendKind::Mprotect => "mprotect",
        }
    }

    /// Parses an `EMUHOST_WATCH` value (trimmed, any case).
    pub fn parse(value: &str) -> Result<Self, WatchError> {
        match value.trim().to_ascii_lowercase().as_str() {
            "uffd" => Ok(BackendKind::Uffd),
            "mprotect" => Ok(BackendKind::Mprotect),
            "softdirty" => Err(WatchError::BadSwitch {
                name: WATCH_SWITCH,
                value: value.to_string(),
                why: "is no longer offered: soft-dirty bits cannot be read and cleared in one step, so it lost \
                      writes made during a collect (use mprotect on kernels without uffd WP_ASYNC)",
            }),
            _ => Err(WatchError::BadSwitch {
                name: WATCH_SWITCH,
                value: value.to_string(),
                why: "is not one of uffd, mprotect",
            }),
        }
    }

    /// Those tried when nothing is forced, best first.
    pub const AUTO: [BackendKind; 2] = [BackendKind::Uffd, BackendKind::Mprotect];
}

/// What went wrong in write tracking.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("{name}={value:?} {why}")]
    BadSwitch { name: &'static str, value: String, why: &'static str },
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

/// Chooses a backend: the one `settings.watch` (`EMUHOST_WATCH`) forces (it must pass its
/// self-test), else the first of [`BackendKind::AUTO`] that passes.
pub fn choose(settings: &crate::settings::Settings) -> Result<Choice, WatchError> {
    choose_from(settings.watch.map(BackendKind::name))
}

/// [`choose`] with the switch's value given.
pub fn choose_from(switch: Option<&str>) -> Result<Choice, WatchError> {
    if let Some(v) = switch.filter(|v| !v.trim().is_empty()) {
        let kind = BackendKind::parse(v)?;
        self_test(kind)?;
        return Ok(Choice { kind, why: format!("forced by {WATCH_SWITCH}={v}; its self-test passed") });
    }
    let mut tried = Vec::new();
    for kind in BackendKind::AUTO {
        match self_test(kind) {
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

/// An error and its sources on one line (a backend's failure names the OS error under it).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}

/// Arms a few pages of a small space of its own, writes one, collects, and expects exactly it.
pub fn self_test(kind: BackendKind) -> Result<(), WatchError> {
    let fail = |why: String| WatchError::SelfTest { backend: kind.name(), why };
    let p = page_size();
    let space = Arc::new(Space::with_window(16 * p)?);
    let range = space.range(0, 16 * p)?;
    space.commit(range, Prot::READ_WRITE)?;
    let t = Tracker::with_backend(&space, kind)?;
    t.arm(range)?;
    space.store(GuestAddr(5 * p + 8), &[1])?;
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
}

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker").field("backend", &self.core.backend.kind()).field("verify", &self.verify).finish()
    }
}

impl Tracker {
    /// A tracker with the default settings: [`Tracker::new_with`].
    pub fn new(space: &Arc<Space>) -> Result<Arc<Tracker>, WatchError> {
        Self::new_with(space, &crate::settings::Settings::default())
    }

    /// A tracker with the backend [`choose`] picks, and verify mode as `settings` say.
    pub fn new_with(space: &Arc<Space>, settings: &crate::settings::Settings) -> Result<Arc<Tracker>, WatchError> {
        let choice = choose(settings)?;
        tracing::info!(backend = choice.kind.name(), "write tracking: {} ({})", choice.kind.name(), choice.why);
        let t = Self::build(space, choice.kind, settings.verify_collect)?;
        Ok(t)
    }

    /// A tracker with the given backend (no self-test), verify mode off.
    pub fn with_backend(space: &Arc<Space>, kind: BackendKind) -> Result<Arc<Tracker>, WatchError> {
        Self::build(space, kind, false)
    }

    /// A tracker with the given backend and verify mode.
    /// A second tracker on a space that has one is refused ([`WatchError::SecondTracker`]).
    pub fn build(space: &Arc<Space>, kind: BackendKind, verify: bool) -> Result<Arc<Tracker>, WatchError> {
        let claim = Claim::take(space.host_base())?;
        let backend =
            backend::make(kind, space).map_err(|source| WatchError::Unavailable { backend: kind.name(), source })?;
        let core = Arc::new(Core { backend, inner: Mutex::new(Inner::default()) });
        let weak: std::sync::Weak<dyn Observer> = Arc::downgrade(&(core.clone() as Arc<dyn Observer>));
        space.observe(weak);
        Ok(Arc::new(Tracker { space: space.clone(), core, verify, started: AtomicU64::new(0), _claim: claim }))
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
        let range = self.space.range(range.start().0, range.len())?;
        self.space.with_layout(range, |_| {
            let regions = self.space.kernel_regions(range)?;
            self.arm_locked(&mut self.inner(), range, &regions)
        })
    }

    /// Arms the pages of `range` not armed yet (and those of allocations whose read failed, to
    /// track them again), but not under a host write in flight: those wait for its end.
    fn arm_locked(&self, inner: &mut Inner, range: GuestRange, regions: &[Region]) -> Result<(), WatchError> {
        let (a, b) = (range.start().0, range.end().0);
        let mut todo = inner.armed.gaps(a, b);
        todo.extend(inner.failed.iter().filter_map(|(s, (e, _))| clip(a, b, *s, *e)));
        let base = self.space.host_base();
        for (s, e) in todo {
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
        let range = self.space.range(range.start().0, range.len())?;
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
    /// writable, and an arm there waits for its end; the next collect after it reads them as usual.
    /// The other backends need nothing and record nothing.
    pub fn host_write<R>(&self, range: GuestRange, write: impl FnOnce() -> R) -> Result<R, WatchError> {
        let range = self.space.range(range.start().0, range.len())?;
        if !self.core.backend.needs_host_write_prepare() {
            return Ok(write());
        }
        self.space.with_layout(range, |_| {
            let mut inner = self.inner();
            self.prepare_locked(&inner, range)?;
            inner.hosting.push((range.start().0, range.end().0));
            Ok::<(), WatchError>(())
        })?;
        let _end = HostWriteEnd { tracker: self, range };
        Ok(write())
    }

    /// Collects the pages of `range` written since the last collect and arms them again.
    pub fn collect(&self, range: GuestRange) -> Result<Collected, WatchError> {
        let range = self.space.range(range.start().0, range.len())?;
        let (a, b) = (range.start().0, range.end().0);
        // Fault injection may make a foreign SIGSEGV here first (a no-op in the default build).
        crate::faults::at_collect().map_err(|e| self.os("collect (after a foreign SIGSEGV)", range, e))?;
        self.space.with_layout(range, |layout| {
            let mut inner = self.inner();
            let seq = self.started.fetch_add(1, SeqCst) + 1;
            // The spans to read: allocations and views, clipped to the range and to what is armed.
            let mut spans: Vec<Span> = Vec::new();
            let armed: Vec<(u64, u64)> =
                inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)).collect();
            for al in &layout.allocations {
                let (s, e) = (al.range.start().0, al.range.end().0);
                for &(x, y) in &armed {
                    if let Some((p, q)) = clip(s, e, x, y) {
                        spans.push((p, q, Some((s, e, al.generation))));
                    }
                }
            }
            for v in &layout.views {
                for &(x, y) in &armed {
                    if let Some((p, q)) = clip(v.range.start().0, v.range.end().0, x, y) {
                        spans.push((p, q, None));
                    }
                }
            }
            spans.sort_by_key(|s| s.0);
            // Pages under a host write in flight are reported, and not read: the read would arm
            // them under the write (which would fail).
            let mut hosted = Vec::new();
            if !inner.hosting.is_empty() {
                let mut rest = Vec::new();
                for (s, e, alloc) in spans {
                    let (outside, inside) = split(s, e, &inner.hosting);
                    hosted.extend(inside);
                    rest.extend(outside.into_iter().map(|(x, y)| (x, y, alloc)));
                }
                spans = rest;
            }
            let mut host_runs = Vec::new();
            let mut out = Collected { seq, ..Collected::default() };
            for (s, e, alloc) in spans {
                let span = GuestRange::from_bounds(s, e)?;
                if let Some((start, end, generation)) = alloc
                    && inner.failed.get(&start) == Some(&(end, generation))
                {
                    out.untracked.push(span);
                    continue;
                }
                if self.verify {
                    self.verify_span(&inner, span)?;
                }
                if let Err(err) = self.core.backend.read(self.host(s), self.host(e), &mut host_runs) {
                    if self.unexpected(&inner, span)?.is_some() {
                        out.untracked.push(span);
                        if let Some((start, end, generation)) = alloc {
                            inner.failed.insert(start, (end, generation));
                        }
                    } else {
                        return Err(self.os("collect", span, err));
                    }
                }
            }
            let base = self.space.host_base() as u64;
            let mut guest: Vec<(u64, u64)> =
                host_runs.into_iter().map(|(s, e)| (s as u64 - base, e as u64 - base)).collect();
            let pending: Vec<(u64, u64)> =
                inner.pending.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)).collect();
            inner.pending.remove(a, b, |_, _, _| ());
            guest.extend(pending);
            guest.extend(hosted);
            out.runs = merge(guest, a, b);
            Ok(out)
        })
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
        let t = self.tracker;
        let (a, b) = (self.range.start().0, self.range.end().0);
        t.space.with_layout(self.range, |_| {
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
            let armed = t.space.kernel_regions(self.range).map_err(WatchError::from).and_then(|regions| {
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
                tracing::warn!("write tracking: arming {} after a host write failed: {}", self.range, chain(&e));
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

/// Sorts and merges guest `(start, end)` pairs into page runs, clipped to `a..b`.
fn merge(mut v: Vec<(u64, u64)>, a: u64, b: u64) -> Vec<PageRun> {
    v.sort_unstable();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (s, e) in v {
        let Some((s, e)) = clip(a, b, s, e) else { continue };
        match runs.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => runs.push((s, e)),
        }
    }
    let p = page_size();
    runs.into_iter().map(|(s, e)| PageRun { start: GuestAddr(s), pages: (e - s) / p }).collect()
}

impl Drop for Tracker {
    /// Gives armed pages back the protection the space gave them (with mprotect they would stay
    /// read-only, and the next store would die), under the space's lock so no change of the space
    /// runs in between.
    fn drop(&mut self) {
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
            match self.backend.read(base + s as usize, base + e as usize, &mut runs) {
                Ok(()) => {
                    for (x, y) in runs {
                        add(&mut inner.pending, (x - base) as u64, (y - base) as u64);
                    }
                }
                // Unreadable (released behind the space's back): report it all, so nothing is lost.
                Err(_) => add(&mut inner.pending, s, e),
            }
        }
    }
}

impl Observer for Core {
    fn changed(&self, space: &Space, change: Change) {
        let mut inner = self.inner();
        let (range, prot) = match change {
            Change::Releasing { range } => return self.releasing(&mut inner, space, range),
            Change::Committed { range, prot, .. }
            | Change::Protected { range, prot }
            | Change::Mapped { range, prot } => (range, prot),
            Change::Released { range } => (range, Prot::NONE),
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
        let pieces: Vec<(u64, u64)> = inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)).collect();
        for (s, e) in pieces {
            let (hs, he) = (host(s), host(e));
            let fresh =
                matches!(change, Change::Mapped { .. } | Change::Committed { path: CommitPath::RegionWalk { .. }, .. });
            let result = match change {
                Change::Released { .. } => self.backend.released(hs, he),
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
