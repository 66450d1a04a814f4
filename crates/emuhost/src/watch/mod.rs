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
//! armed again and reported written once (their content changed). Transparent huge pages would
//! make a write report its whole 2 MiB page, so arming asks the kernel not to use them there
//! (`MADV_NOHUGEPAGE`; Wine does the same for its write watches).
//!
//! The invariant above all: a write that happens after collect N is reported by collect N + 1.

mod backend;
mod bitmap;
mod stress;

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};

pub use bitmap::PageBitmap;
pub use stress::{StressOps, StressReport, stress};

use crate::space::ranges::RangeMap;
use crate::space::{Change, CommitPath, GuestAddr, GuestRange, Observer, Prot, Space, SpaceError, page_size};
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

/// Chooses a backend: the one `EMUHOST_WATCH` forces (it must pass its self-test), else (unset or
/// empty) the first of [`BackendKind::AUTO`] that passes.
pub fn choose() -> Result<Choice, WatchError> {
    choose_from(std::env::var(WATCH_SWITCH).ok().as_deref())
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

/// A write tracker over one space.
pub struct Tracker {
    space: Arc<Space>,
    backend: Box<dyn Backend>,
    verify: bool,
    inner: Mutex<Inner>,
    /// Collects started, raised under the lock as each begins.
    started: AtomicU64,
}

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker").field("backend", &self.backend.kind()).field("verify", &self.verify).finish()
    }
}

impl Tracker {
    /// A tracker with the backend [`choose`] picks, and verify mode as `EMUHOST_VERIFY_COLLECT` says.
    pub fn new(space: &Arc<Space>) -> Result<Arc<Tracker>, WatchError> {
        let choice = choose()?;
        tracing::info!(backend = choice.kind.name(), "write tracking: {} ({})", choice.kind.name(), choice.why);
        let t = Self::build(space, choice.kind, verify_from_env()?)?;
        Ok(t)
    }

    /// A tracker with the given backend (no self-test), verify mode off.
    pub fn with_backend(space: &Arc<Space>, kind: BackendKind) -> Result<Arc<Tracker>, WatchError> {
        Self::build(space, kind, false)
    }

    /// A tracker with the given backend and verify mode.
    pub fn build(space: &Arc<Space>, kind: BackendKind, verify: bool) -> Result<Arc<Tracker>, WatchError> {
        let backend =
            backend::make(kind, space).map_err(|source| WatchError::Unavailable { backend: kind.name(), source })?;
        let t = Arc::new(Tracker {
            space: space.clone(),
            backend,
            verify,
            inner: Mutex::new(Inner::default()),
            started: AtomicU64::new(0),
        });
        let weak: std::sync::Weak<dyn Observer> = Arc::downgrade(&(t.clone() as Arc<dyn Observer>));
        space.observe(weak);
        Ok(t)
    }

    pub fn kind(&self) -> BackendKind {
        self.backend.kind()
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
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn host(&self, a: u64) -> usize {
        self.space.host_base() + a as usize
    }

    fn os(&self, op: &'static str, range: GuestRange, source: io::Error) -> WatchError {
        WatchError::Os { op, range, backend: self.kind().name(), source }
    }

    /// Arms `range`: from now on, writes to its pages are reported by the next collect. Pages
    /// written before are forgotten.
    pub fn arm(&self, range: GuestRange) -> Result<(), WatchError> {
        let range = self.space.range(range.start().0, range.len())?;
        self.space.with_layout(range, |_| {
            let regions = self.space.kernel_regions(range)?;
            let mut inner = self.inner();
            self.backend
                .arm(self.host(range.start().0), self.host(range.end().0), &regions, self.space.host_base())
                .map_err(|e| self.os("arm", range, e))?;
            let (a, b) = (range.start().0, range.end().0);
            add(&mut inner.armed, a, b);
            inner.pending.remove(a, b, |_, _, _| ());
            inner.failed.retain(|s, (e, _)| *e <= a || *s >= b);
            Ok(())
        })
    }

    /// Stops tracking `range` (its pages get their protection back).
    pub fn disarm(&self, range: GuestRange) -> Result<(), WatchError> {
        let range = self.space.range(range.start().0, range.len())?;
        self.space.with_layout(range, |_| {
            let mut inner = self.inner();
            let (a, b) = (range.start().0, range.end().0);
            let pieces: Vec<(u64, u64)> =
                inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)).collect();
            for (s, e) in pieces {
                self.backend.disarm(self.host(s), self.host(e)).map_err(|err| self.os("disarm", range, err))?;
            }
            inner.armed.remove(a, b, |_, _, _| ());
            inner.pending.remove(a, b, |_, _, _| ());
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
            self.backend
                .prepare_host_write(self.host(s), self.host(e))
                .map_err(|err| self.os("prepare", range, err))?;
        }
        Ok(())
    }

    /// Runs `write`, a write by the host through the kernel over `range` ([`Space::write`],
    /// [`Space::populate`], [`Space::zero`]), with the armed pages there prepared for it as
    /// [`Tracker::prepare_host_write`] does. Where the backend needs that preparation (mprotect),
    /// no collect runs between it and the write, so none arms the pages again in between (the
    /// write would fail with `EFAULT`); the others need nothing and take no lock. `write` must
    /// not commit, release, protect or map (those wait for the lock held here).
    pub fn host_write<R>(&self, range: GuestRange, write: impl FnOnce() -> R) -> Result<R, WatchError> {
        let range = self.space.range(range.start().0, range.len())?;
        if !self.backend.needs_host_write_prepare() {
            return Ok(write());
        }
        self.space.with_layout(range, |_| {
            let inner = self.inner();
            self.prepare_locked(&inner, range)?;
            Ok(write())
        })
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
                if let Err(err) = self.backend.read(self.host(s), self.host(e), &mut host_runs) {
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

/// Parses an `EMUHOST_VERIFY_COLLECT` value (trimmed, any case): `1`, `true`, `on`, `yes` turn
/// verify mode on; `0`, `false`, `off`, `no` or empty leave it off; anything else is an error, so a
/// typo never silently leaves the check off.
pub fn parse_verify(value: &str) -> Result<bool, WatchError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "" | "0" | "false" | "off" | "no" => Ok(false),
        _ => Err(WatchError::BadSwitch {
            name: VERIFY_SWITCH,
            value: value.to_string(),
            why: "is not one of 1, true, on, yes, 0, false, off, no",
        }),
    }
}

/// Whether `EMUHOST_VERIFY_COLLECT` asks for verify mode (unset: no); a value [`parse_verify`]
/// refuses is an error.
pub fn verify_from_env() -> Result<bool, WatchError> {
    std::env::var(VERIFY_SWITCH).map_or(Ok(false), |v| parse_verify(&v))
}

impl Observer for Tracker {
    fn changed(&self, _space: &Space, change: Change) {
        let mut inner = self.inner();
        let (range, prot) = match change {
            Change::Committed { range, prot, .. }
            | Change::Protected { range, prot }
            | Change::Mapped { range, prot } => (range, prot),
            Change::Released { range } => (range, Prot::NONE),
        };
        let (a, b) = (range.start().0, range.end().0);
        match change {
            Change::Released { .. } => inner.noaccess.remove(a, b, |_, _, _| ()),
            _ if prot == Prot::NONE => add(&mut inner.noaccess, a, b),
            _ => inner.noaccess.remove(a, b, |_, _, _| ()),
        }
        if let Change::Released { .. } | Change::Mapped { .. } = change {
            inner.failed.retain(|s, (e, _)| *e <= a || *s >= b);
        }
        let pieces: Vec<(u64, u64)> = inner.armed.overlapping(a, b).filter_map(|(s, e, _)| clip(a, b, s, e)).collect();
        for (s, e) in pieces {
            let (hs, he) = (self.host(s), self.host(e));
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
            if let Change::Released { .. } = change {
                inner.pending.remove(s, e, |_, _, _| ());
            }
        }
    }
}
