//! Fault injection (cargo feature `faults`, off by default): chosen driver and system calls fail
//! as they do on a machine short of memory or without userfaultfd, so that the recovery paths run
//! in tests and under `emuhost replay`.
//!
//! Each fault is made where the real failure comes from, and returns the error the real call
//! returns, so everything above sees what it would see from the driver or the kernel:
//! - an import: the backend's driver call (`mlock` for pin, `vkAllocateMemory` with the host
//!   pointer for Vulkan, `cuMemHostRegister` for CUDA) fails (`ENOMEM`,
//!   `VK_ERROR_OUT_OF_DEVICE_MEMORY`, `CUDA_ERROR_OUT_OF_MEMORY`) and the backend's own error
//!   path runs; the Nth imports (a [`Schedule`]) and/or every import above a size fail;
//! - a commit: the `mprotect` of the one-call commit and the `mprotect`/`mmap` of each region of
//!   the region walk count as calls, and the calls the schedule names fail with `ENOMEM`;
//! - userfaultfd: the `userfaultfd` system call fails with `EPERM` or `ENOSYS`;
//! - an old kernel: region queries read `/proc/self/maps` as without `PROCMAP_QUERY` (Linux 6.11),
//!   and populates touch pages as without `MADV_POPULATE_WRITE` (5.14);
//! - a driver that serializes imports ([`ImportCostModel`]): every import holds one process-wide
//!   lock and sleeps a fixed time plus a time per MiB, as NVIDIA's host-pointer imports cost on
//!   the device (a binding's small import waits for a background thread's in the driver); on a
//!   VM whose driver imports for free (lavapipe) the importer then meets what it meets there;
//! - a `SIGSEGV` that is not emuhost's: [`ForeignPage`] installs a handler before emuhost's and
//!   owns a page only it resolves.
//!
//! A plan set from code ([`scoped`]) holds for the calling thread until its [`Scope`] drops, so
//! tests running beside each other do not see each other's faults. The `EMUHOST_FAULT_*` switches
//! set one plan for the whole process ([`install`], given them by
//! [`Settings`](crate::settings::Settings)). Counts (the
//! Nth import) are per plan.
//!
//! A schedule names 1-based call numbers: `N` (the Nth), `N-M` (the Nth to the Mth), `N-` (the
//! Nth and every one after), `%K` (every Kth), several separated by commas (`2,%10`).
//!
//! ```
//! use emuhost::faults::{Plan, Schedule, scoped};
//! use emuhost::space::{Prot, Space};
//!
//! let space = Space::with_window(16 << 20).unwrap();
//! let range = space.range(0, 0x10000).unwrap();
//! // Every system call of a commit fails with ENOMEM, on this thread, while `scope` lives.
//! let scope = scoped(Plan { commit_enomem: Schedule::from_nth(1), ..Plan::default() });
//! assert!(space.commit(range, Prot::READ_WRITE).is_err());
//! assert!(scope.tally().commit_failed >= 1);
//! drop(scope);
//! space.commit(range, Prot::READ_WRITE).unwrap();
//! ```

use std::cell::{Cell, RefCell};
use std::io;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

#[path = "faults_common.rs"]
mod common;
pub use common::*;

#[cfg(target_os = "linux")]
pub use crate::sys::faults::ForeignPage;

/// Whether this build can inject faults.
pub const ENABLED: bool = true;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Item {
    /// The calls `from..=to` (1-based).
    Calls(u64, u64),
    /// Every Kth call.
    Every(u64),
}

/// Which calls fail, by their 1-based number.
///
/// ```
/// use emuhost::faults::Schedule;
///
/// let s: Schedule = "2,%10".parse().unwrap();
/// assert_eq!((s.hits(1), s.hits(2), s.hits(20)), (false, true, true));
/// assert_eq!(s, Schedule::nth(2).and(Schedule::every(10)));
/// assert!("3-1".parse::<Schedule>().is_err());
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule(Vec<Item>);

impl Schedule {
    /// No call.
    pub fn never() -> Self {
        Self::default()
    }

    /// The `n`th call.
    pub fn nth(n: u64) -> Self {
        Self::calls(n, n)
    }

    /// The calls `from..=to`.
    pub fn calls(from: u64, to: u64) -> Self {
        Self(vec![Item::Calls(from, to)])
    }

    /// The `n`th call and every one after it.
    pub fn from_nth(n: u64) -> Self {
        Self::calls(n, u64::MAX)
    }

    /// Every `k`th call.
    pub fn every(k: u64) -> Self {
        Self(vec![Item::Every(k.max(1))])
    }

    /// The calls either schedule names.
    pub fn and(mut self, other: Schedule) -> Self {
        self.0.extend(other.0);
        self
    }

    /// Whether the `n`th call (1-based) fails.
    pub fn hits(&self, n: u64) -> bool {
        self.0.iter().any(|i| match *i {
            Item::Calls(a, b) => a <= n && n <= b,
            Item::Every(k) => n.is_multiple_of(k),
        })
    }

    /// Whether it names no call.
    pub fn is_never(&self) -> bool {
        self.0.is_empty()
    }
}

/// Parses the switches' form (`N`, `N-M`, `N-`, `%K`, comma-separated; empty: never). The
/// error names the part that is not a call number (1, 2, ...) or a range that ends before it
/// starts.
impl FromStr for Schedule {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let num = |t: &str| -> Result<u64, String> {
            match t.trim().parse::<u64>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!("{t:?} is not a call number (1, 2, ...)")),
            }
        };
        let mut items = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            items.push(if let Some(k) = part.strip_prefix('%') {
                Item::Every(num(k)?)
            } else if let Some((a, b)) = part.split_once('-') {
                let a = num(a)?;
                let b = if b.trim().is_empty() { u64::MAX } else { num(b)? };
                if b < a {
                    return Err(format!("{part:?} ends before it starts"));
                }
                Item::Calls(a, b)
            } else {
                let n = num(part)?;
                Item::Calls(n, n)
            });
        }
        Ok(Schedule(items))
    }
}

/// How opening a userfaultfd fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UffdFault {
    /// `EPERM`: unprivileged userfaultfd turned off (`vm.unprivileged_userfaultfd=0`, a seccomp
    /// filter).
    Eperm,
    /// `ENOSYS`: a kernel built without userfaultfd.
    Enosys,
}

impl UffdFault {
    /// The `errno` the failed `userfaultfd` call sets.
    #[cfg(target_os = "linux")]
    pub fn errno(self) -> i32 {
        match self {
            UffdFault::Eperm => libc::EPERM,
            UffdFault::Enosys => libc::ENOSYS,
        }
    }
}

/// A model of a driver's import cost (`EMUHOST_FAULT_IMPORT_COST_US=FIXED,PER_MIB`): each import
/// takes one process-wide lock, sleeps `fixed + per_mib × MiB` holding it, then makes its driver
/// call. So imports are serialized across threads, as NVIDIA's driver serializes host-pointer
/// imports (`vkAllocateMemory`): on an H100, about 0.5 ms an import under load and 0.17 ms per
/// populated MiB.
///
/// Unlike the failures, the model also holds for the start-up measurement of the import cost
/// and the backends' start-up checks (under `unfaulted`): a driver costs what it costs there too,
/// and the importer sizes its parts by what it measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ImportCostModel {
    /// What every import costs, whatever its size.
    pub fixed: Duration,
    /// What each MiB of an import adds.
    pub per_mib: Duration,
}

impl ImportCostModel {
    /// What an import of `len` bytes takes under the model.
    pub fn of(&self, len: u64) -> Duration {
        let per = self.per_mib.as_nanos().saturating_mul(u128::from(len)) >> 20;
        self.fixed.saturating_add(Duration::from_nanos(u64::try_from(per).unwrap_or(u64::MAX)))
    }
}

impl FromStr for ImportCostModel {
    type Err = String;

    /// `FIXED,PER_MIB` in µs (integers).
    fn from_str(s: &str) -> Result<Self, String> {
        let us = |t: &str| t.trim().parse::<u64>().map(Duration::from_micros);
        match s.split(',').collect::<Vec<_>>()[..] {
            [f, m] => match (us(f), us(m)) {
                (Ok(fixed), Ok(per_mib)) => Ok(ImportCostModel { fixed, per_mib }),
                _ => Err("expected FIXED,PER_MIB as µs (integers)".into()),
            },
            _ => Err("expected FIXED,PER_MIB as µs (two integers)".into()),
        }
    }
}

/// The faults to inject.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Which imports fail.
    pub import: Schedule,
    /// Every import costs this, serialized across threads (a model of a driver).
    pub import_cost: Option<ImportCostModel>,
    /// Imports of more bytes than this fail.
    pub import_above: Option<u64>,
    /// Which of the system calls commits make fail with `ENOMEM`.
    pub commit_enomem: Schedule,
    /// Opening a userfaultfd fails so.
    pub uffd: Option<UffdFault>,
    /// Spaces made under the plan query regions from the text of `/proc/self/maps`.
    pub no_procmap_query: bool,
    /// Populates touch the pages instead of `MADV_POPULATE_WRITE`.
    pub no_populate_write: bool,
    /// Every `Space::commit` panics (before it changes anything): for embedders' boundaries (the
    /// C ABI) to show that a panic inside the runtime comes back to them as an error. Set from
    /// code only: no switch.
    pub panic_commit: bool,
}

/// The `EMUHOST_FAULT_*` switches as [`Settings`](crate::settings::Settings) carries them: the
/// plan they describe and whether a foreign `SIGSEGV` handler is asked for. [`install`] makes it
/// the process's plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FaultSettings {
    /// The plan the switches describe (the default plan: no switch set).
    pub plan: Plan,
    /// `EMUHOST_FAULT_FOREIGN_SEGV`.
    pub foreign: bool,
}

/// What a plan has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Imports seen.
    pub imports: u64,
    /// Imports failed.
    pub imports_failed: u64,
    /// Commit system calls seen.
    pub commit_calls: u64,
    /// Commit system calls failed.
    pub commit_failed: u64,
    /// userfaultfd opens failed.
    pub uffd_failed: u64,
}

#[derive(Debug, Default)]
struct Active {
    plan: Plan,
    imports: AtomicU64,
    imports_failed: AtomicU64,
    commit_calls: AtomicU64,
    commit_failed: AtomicU64,
    uffd_failed: AtomicU64,
}

impl Active {
    fn tally(&self) -> Tally {
        Tally {
            imports: self.imports.load(Relaxed),
            imports_failed: self.imports_failed.load(Relaxed),
            commit_calls: self.commit_calls.load(Relaxed),
            commit_failed: self.commit_failed.load(Relaxed),
            uffd_failed: self.uffd_failed.load(Relaxed),
        }
    }
}

thread_local! {
    static SCOPED: RefCell<Option<Arc<Active>>> = const { RefCell::new(None) };
    static PAUSED: Cell<u32> = const { Cell::new(0) };
}

struct Process {
    plan: Option<Arc<Active>>,
    foreign: bool,
}

/// The process's plan: the one [`install`] was given, or none (the environment is not read).
static PROCESS: OnceLock<Process> = OnceLock::new();

fn process() -> &'static Process {
    PROCESS.get_or_init(|| Process { plan: None, foreign: false })
}

/// Makes `settings` the process's fault plan (the `EMUHOST_FAULT_*` switches hold for the whole
/// process). Only the first call, made before any hook ran, takes effect: false where the
/// process's plan was already fixed (and is not this one).
pub fn install(settings: &FaultSettings) -> bool {
    install_hooks();
    let FaultSettings { plan, foreign } = settings.clone();
    let plan = (plan != Plan::default()).then_some(plan);
    let p = PROCESS.get_or_init(|| {
        if let Some(p) = &plan {
            tracing::warn!("fault injection on for this process: {p:?}");
        }
        if foreign {
            tracing::warn!("fault injection: a foreign SIGSEGV before each collect ({FOREIGN_SEGV_SWITCH}=1)");
        }
        Process { plan: plan.clone().map(|plan| Arc::new(Active { plan, ..Active::default() })), foreign }
    });
    p.plan.as_ref().map(|a| &a.plan) == plan.as_ref() && p.foreign == foreign
}

/// What the process's plan (the switches') has done, if there is one.
pub fn process_tally() -> Option<Tally> {
    process().plan.as_ref().map(|a| a.tally())
}

/// A plan in force on the thread that made it, until dropped (the plan before it comes back).
#[must_use = "the plan holds only while the scope lives"]
pub struct Scope {
    active: Arc<Active>,
    before: Option<Arc<Active>>,
}

impl Scope {
    /// What the plan has done so far.
    pub fn tally(&self) -> Tally {
        self.active.tally()
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        SCOPED.with(|s| *s.borrow_mut() = self.before.take());
    }
}

/// Puts `plan` in force on this thread (over the process's plan) until the scope drops.
pub fn scoped(plan: Plan) -> Scope {
    install_hooks();
    let active = Arc::new(Active { plan, ..Active::default() });
    let before = SCOPED.with(|s| s.borrow_mut().replace(active.clone()));
    Scope { active, before }
}

/// Installs the hooks through which `sys/` asks whether to fail a call (`sys/` names nothing
/// above it): before any plan can be in force.
fn install_hooks() {
    crate::sys::hooks::install(crate::sys::hooks::Hooks { fail_import, uffd_errno, before_segv_install });
}

fn active() -> Option<Arc<Active>> {
    if PAUSED.with(Cell::get) > 0 {
        return None;
    }
    if let Some(a) = SCOPED.with(|s| s.borrow().clone()) {
        return Some(a);
    }
    process().plan.clone()
}

/// The lock every import under an [`ImportCostModel`] holds for its cost: one per process, as
/// a driver's.
static DRIVER: Mutex<()> = Mutex::new(());

/// Holds the modelled driver for an import of `len` bytes, where a plan (paused or not) has an
/// [`ImportCostModel`]: one import at a time, each for its cost.
fn charge_import(len: u64) {
    let plan = SCOPED.with(|s| s.borrow().clone()).or_else(|| process().plan.clone());
    let Some(model) = plan.and_then(|a| a.plan.import_cost) else { return };
    let _driver = DRIVER.lock().unwrap_or_else(|p| p.into_inner());
    std::thread::sleep(model.of(len));
}

/// Counts an import of `len` bytes (charging it the modelled driver's cost first, if any);
/// whether it must fail.
pub(crate) fn fail_import(len: u64) -> bool {
    charge_import(len);
    let Some(a) = active() else { return false };
    let n = a.imports.fetch_add(1, Relaxed) + 1;
    let above = a.plan.import_above.is_some_and(|max| len > max);
    let fail = above || a.plan.import.hits(n);
    if fail {
        a.imports_failed.fetch_add(1, Relaxed);
        let why = if above { "larger than the size given" } else { "its number is in the schedule" };
        tracing::warn!("fault injected: import {n} ({len:#x} bytes) fails: {why}");
    }
    fail
}

/// Counts a system call of a commit; whether it must fail (with `ENOMEM`).
pub(crate) fn fail_commit_call() -> bool {
    let Some(a) = active() else { return false };
    let n = a.commit_calls.fetch_add(1, Relaxed) + 1;
    let fail = a.plan.commit_enomem.hits(n);
    if fail {
        a.commit_failed.fetch_add(1, Relaxed);
        tracing::warn!("fault injected: commit system call {n} fails with ENOMEM");
    }
    fail
}

/// Whether region queries must read `/proc/self/maps` (decided when a space is made).
pub(crate) fn no_procmap_query() -> bool {
    active().is_some_and(|a| a.plan.no_procmap_query)
}

/// Whether populates must touch the pages instead of `MADV_POPULATE_WRITE`.
pub(crate) fn no_populate_write() -> bool {
    active().is_some_and(|a| a.plan.no_populate_write)
}

/// Panics where the plan says every commit does.
pub(crate) fn panic_at_commit() {
    if active().is_some_and(|a| a.plan.panic_commit) {
        panic!("fault injected: a panic in Space::commit");
    }
}

/// The error opening a userfaultfd must fail with, if any.
#[cfg(target_os = "linux")]
pub(crate) fn uffd_errno() -> Option<i32> {
    let a = active()?;
    let f = a.plan.uffd?;
    a.uffd_failed.fetch_add(1, Relaxed);
    tracing::warn!("fault injected: userfaultfd fails with {f:?}");
    Some(f.errno())
}

/// userfaultfd is Linux's: nothing to fail elsewhere.
#[cfg(not(target_os = "linux"))]
pub(crate) fn uffd_errno() -> Option<i32> {
    None
}

/// Runs `f` with no fault injected on this thread (a backend's start-up check: a fault there would
/// only pass the backend over, never reach the importer).
pub(crate) fn unfaulted<R>(f: impl FnOnce() -> R) -> R {
    struct Unpause;
    impl Drop for Unpause {
        fn drop(&mut self) {
            PAUSED.with(|p| p.set(p.get() - 1));
        }
    }
    PAUSED.with(|p| p.set(p.get() + 1));
    let _unpause = Unpause;
    f()
}

/// Called just before emuhost installs its `SIGSEGV` handler: with `EMUHOST_FAULT_FOREIGN_SEGV=1`
/// the foreign handler goes in first.
pub(crate) fn before_segv_install() {
    #[cfg(target_os = "linux")]
    if process().foreign
        && let Err(e) = ForeignPage::install()
    {
        tracing::error!("fault injection: the foreign SIGSEGV handler could not be installed: {e}");
    }
}

/// Called at each collect: with `EMUHOST_FAULT_FOREIGN_SEGV=1`, faults once on the foreign page;
/// an error where its handler did not resolve the fault exactly once.
pub(crate) fn at_collect() -> io::Result<()> {
    if !process().foreign {
        return Ok(());
    }
    foreign_fault_once()
}

/// Faults once on the foreign page; an error where its handler did not resolve it exactly once.
#[cfg(target_os = "linux")]
fn foreign_fault_once() -> io::Result<()> {
    let page = ForeignPage::install()?;
    let (calls, resolved) = (page.calls(), page.resolved());
    if page.touch(0x5a)? != 0x5a {
        return Err(io::Error::other("a store to the foreign page did not complete"));
    }
    let (calls, resolved) = (page.calls() - calls, page.resolved() - resolved);
    if (calls, resolved) != (1, 1) {
        return Err(io::Error::other(format!(
            "a foreign SIGSEGV reached its own handler {calls} times ({resolved} resolved), not once"
        )));
    }
    Ok(())
}

/// A foreign fault handler is injected on Linux only.
#[cfg(not(target_os = "linux"))]
fn foreign_fault_once() -> io::Result<()> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "a foreign fault handler is injected on Linux only"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_parse_and_hit_the_calls_they_name() {
        let s: Schedule = "2, 5-6,%10".parse().unwrap();
        let hit: Vec<u64> = (1..=20).filter(|&n| s.hits(n)).collect();
        assert_eq!(hit, vec![2, 5, 6, 10, 20]);
        let s: Schedule = "3-".parse().unwrap();
        assert!(!s.hits(2) && s.hits(3) && s.hits(u64::MAX));
        assert!("".parse::<Schedule>().unwrap().is_never());
        for bad in ["0", "x", "%0", "4-2", "-3", "1-x"] {
            assert!(bad.parse::<Schedule>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_import_cost_model_parses_and_charges_per_mib() {
        let m: ImportCostModel = " 500, 170".parse().unwrap();
        assert_eq!(m, ImportCostModel { fixed: Duration::from_micros(500), per_mib: Duration::from_micros(170) });
        assert_eq!(m.of(4 << 20), Duration::from_micros(500 + 4 * 170));
        assert_eq!(m.of(512 << 10), Duration::from_micros(500 + 85));
        for bad in ["", "500", "500,x", "1,2,3", "-1,2"] {
            assert!(bad.parse::<ImportCostModel>().is_err(), "{bad}");
        }
    }

    /// An import under the model waits for the modelled driver another import holds, then
    /// sleeps its cost (at least; a test under load may take longer), even under `unfaulted`.
    #[test]
    fn imports_under_the_cost_model_wait_for_the_driver_and_pay_their_cost() {
        let model = ImportCostModel { fixed: Duration::from_millis(30), per_mib: Duration::from_millis(10) };
        let done = std::sync::atomic::AtomicBool::new(false);
        let driver = DRIVER.lock().unwrap();
        std::thread::scope(|sc| {
            let t = sc.spawn(|| {
                let _s = scoped(Plan { import_cost: Some(model), ..Plan::default() });
                let t0 = std::time::Instant::now();
                assert!(!unfaulted(|| fail_import(2 << 20)));
                done.store(true, Relaxed);
                t0.elapsed()
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(!done.load(Relaxed), "the import did not wait for the driver another held");
            drop(driver);
            assert!(t.join().unwrap() >= Duration::from_millis(50));
        });
        assert!(done.load(Relaxed));
    }

    #[test]
    fn a_scoped_plan_counts_on_its_thread_only_and_goes_with_its_scope() {
        let s = scoped(Plan { import: Schedule::nth(2), import_above: Some(100), ..Plan::default() });
        assert!(!fail_import(10));
        assert!(std::thread::spawn(|| !fail_import(1000)).join().unwrap(), "another thread has no plan");
        assert!(fail_import(10));
        assert!(fail_import(101));
        assert!(!unfaulted(|| fail_import(101)));
        assert_eq!((s.tally().imports, s.tally().imports_failed), (3, 2));
        drop(s);
        assert!(!fail_import(1000));
    }
}
