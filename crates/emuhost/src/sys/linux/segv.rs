//! Write tracking by `mprotect` and a `SIGSEGV` handler, the portable way.
//!
//! Armed pages are made read-only. The first write faults; the handler finds the page in a
//! registered tracker's page-state table, gives the page its guest protection back and marks it
//! written, and the write is retried by the CPU. Faults that are not ours (an address no tracker
//! armed, a page the guest itself made unwritable) go to the handler installed before ours. A
//! `SIGSEGV` sent by a process (`si_code <= 0`, `kill -SEGV`) is no fault: it is passed on, and
//! our handler stays installed whatever the previous one does to the disposition. The handler
//! keeps `errno` as it found it.
//!
//! An embedder that owns `SIGSEGV` registers its trackers without installing the handler
//! (`Registration::new(.., false)`) and calls [`fault`] or [`fault_in`] from its own handler:
//! the same code as ours, one implementation of the protocol below.
//!
//! The handler is async-signal-safe: it takes no lock and allocates nothing. It reads a fixed table
//! of atomic pointers to page-state tables (one byte per page, in an anonymous `MAP_NORESERVE`
//! mapping, so untouched parts cost nothing) and calls `mprotect`, which is a plain system call.
//! A table is freed only after it left the registry and no handler is running (`ACTIVE`).
//!
//! Order matters. The handler marks the page written and raises its busy count in one atomic step,
//! unprotects it, then lowers the count. A collect takes a page's mark only when no handler is
//! busy with it (else it reports the page and leaves the mark for the next collect), and protects
//! it after. So a page is writable only while it is marked (or while the collect that took its mark
//! is still running, which reports it), and a handler that stalls after marking cannot leave a
//! writable page unmarked behind a collect.
//! Arming follows the same rule: a page armed while a handler is busy with it (a disarm and an arm
//! racing a write) keeps its mark, since the handler is about to make it writable.

use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicPtr, AtomicU16, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Mutex, OnceLock};

use super::mm::RawProt;
use crate::sys::counters::{Call, count};

/// Page state bits (a `u16` per page).
pub const ARMED: u16 = 1;
pub const DIRTY: u16 = 2;
pub const READ: u16 = 4;
pub const WRITE: u16 = 8;
pub const EXEC: u16 = 16;
pub const PROT_MASK: u16 = READ | WRITE | EXEC;
/// One handler (or host-write preparation) busy unprotecting the page; the high byte counts them.
const BUSY_ONE: u16 = 1 << 8;
pub const BUSY_MASK: u16 = 0xff00;

/// The state bits of a protection.
pub fn prot_bits(p: RawProt) -> u16 {
    (if p.read { READ } else { 0 }) | (if p.write { WRITE } else { 0 }) | (if p.exec { EXEC } else { 0 })
}

fn flags(bits: u16) -> libc::c_int {
    (if bits & READ != 0 { libc::PROT_READ } else { 0 })
        | (if bits & WRITE != 0 { libc::PROT_WRITE } else { 0 })
        | (if bits & EXEC != 0 { libc::PROT_EXEC } else { 0 })
}

/// One tracker's page-state table: a `u16` per page of `base..base + pages * page`.
#[derive(Debug)]
pub struct Table {
    /// Unique in the process (a slot is reused; the id tells its tables apart).
    id: u64,
    base: usize,
    pages: usize,
    shift: u32,
    states: *mut AtomicU16,
}

// SAFETY: the table's bytes are atomics, and its pointer stays valid until the `Registration` that
// owns it is dropped (after it left the registry and no handler reads it).
unsafe impl Send for Table {}
// SAFETY: as above: shared access is through atomics only.
unsafe impl Sync for Table {}

impl Table {
    /// The state byte of host address `addr`, if the table covers it.
    #[inline]
    fn slot(&self, addr: usize) -> Option<&AtomicU16> {
        let i = addr.checked_sub(self.base)? >> self.shift;
        // SAFETY: `i < pages` and `states` points at `pages` `u16`s mapped read-write for as long as
        // the table lives.
        (i < self.pages).then(|| unsafe { &*self.states.add(i) })
    }
}

const SLOTS: usize = 64;
static REGISTRY: [AtomicPtr<Table>; SLOTS] = [const { AtomicPtr::new(std::ptr::null_mut()) }; SLOTS];
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
static INSTALL: OnceLock<io::Result<()>> = OnceLock::new();
static REGISTER: Mutex<()> = Mutex::new(());
/// Each slot's window, host `(base, end)`: set before its table is published and kept after the
/// table is dropped (until the slot is taken again), so a stale fault of a tracker just dropped
/// still counts as inside a window (see [`retry_stale`]).
static WINDOWS: [(AtomicUsize, AtomicUsize); SLOTS] = [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; SLOTS];
/// The last table id given out.
static IDS: AtomicU64 = AtomicU64::new(0);
/// Disarms so far (and tables dropped): see [`disarmed`].
static DISARMS: AtomicU64 = AtomicU64::new(0);

std::thread_local! {
    /// The fault this thread last retried as possibly stale: (address, `DISARMS` then). Const
    /// initialised and without a destructor, so the handler may read it.
    static RETRIED: Cell<(usize, u64)> = const { Cell::new((usize::MAX, 0)) };
}

/// Says that armed pages were given their protection back and are about to leave the armed
/// state (a disarm, a tracker's drop). A write that faulted on such a page while it was still
/// read-only may reach the handler only after the page left the table: the handler then finds no
/// armed page, and instead of passing the fault on it retries the write once (the page is
/// writable now). A fault that repeats at the same address with no disarm in between is a real
/// one and is passed on, and so is any fault outside every tracker's window at once.
pub fn disarmed() {
    DISARMS.fetch_add(1, SeqCst);
}

/// Whether a fault that is not ours should be retried once as possibly stale (see [`disarmed`]):
/// only one inside a tracker's window (`only`: inside that window), whose page a racing disarm may
/// have changed. Any other fault (an emulator's own, fastmem or a JIT) is passed on at once.
fn retry_stale(addr: usize, only: Option<(usize, usize)>) -> bool {
    let now = (addr, DISARMS.load(SeqCst));
    let inside = match only {
        Some((b, e)) => (b..e).contains(&addr),
        None => WINDOWS.iter().any(|(b, e)| (b.load(SeqCst)..e.load(SeqCst)).contains(&addr)),
    };
    if now.1 == 0 || !inside {
        return false;
    }
    RETRIED
        .try_with(|r| {
            let fresh = r.get() != now;
            r.set(now);
            fresh
        })
        .unwrap_or(false)
}

/// Which registered table a fault is for, in a form a signal handler may hold: plain integers,
/// valid (and harmless) after the table is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableKey {
    slot: usize,
    id: u64,
    base: usize,
    end: usize,
}

impl TableKey {
    /// The host window `(base, end)` of the table.
    pub fn window(&self) -> (usize, usize) {
        (self.base, self.end)
    }
}

/// A tracker's table, in the registry until dropped.
#[derive(Debug)]
pub struct Registration {
    slot: usize,
    table: Box<Table>,
}

impl Registration {
    /// Makes a table for `pages` pages from host address `base`, and installs the handler (once
    /// per process) if `install_handler`; without it, faults reach the table only through
    /// [`fault`] or [`fault_in`], called by the embedder's own handler.
    pub fn new(base: usize, pages: usize, install_handler: bool) -> io::Result<Self> {
        if install_handler {
            install()?;
        }
        let page = super::mm::page_size();
        count(Call::Mmap);
        // SAFETY: a fresh anonymous mapping chosen by the kernel (null hint, no MAP_FIXED) touches
        // no existing memory.
        let states = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                pages.max(1) * 2,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::NORESERVE,
            )
        }? as *mut AtomicU16;
        let id = IDS.fetch_add(1, SeqCst) + 1;
        let mut table = Box::new(Table { id, base, pages, shift: page.trailing_zeros(), states });
        let _guard = REGISTER.lock().unwrap_or_else(|p| p.into_inner());
        let ptr: *mut Table = &mut *table;
        // Under REGISTER, so the free slot found stays free until it is published below.
        let slot = REGISTRY.iter().position(|s| s.load(SeqCst).is_null());
        match slot {
            Some(slot) => {
                // Empty while it changes: a handler never sees half of one window and half of another.
                WINDOWS[slot].1.store(0, SeqCst);
                WINDOWS[slot].0.store(base, SeqCst);
                WINDOWS[slot].1.store(base + pages * page, SeqCst);
                REGISTRY[slot].store(ptr, SeqCst);
                Ok(Self { slot, table })
            }
            None => {
                free(&table);
                Err(io::Error::other(format!("more than {SLOTS} mprotect trackers at once")))
            }
        }
    }

    /// The key [`fault_in`] takes for this table.
    pub fn key(&self) -> TableKey {
        let end = self.table.base + (self.table.pages << self.table.shift);
        TableKey { slot: self.slot, id: self.table.id, base: self.table.base, end }
    }

    /// The state of the page at host address `addr`.
    pub fn state(&self, addr: usize) -> Option<&AtomicU16> {
        self.table.slot(addr)
    }

    /// Makes the armed page at host address `page` writable for a write about to happen (the
    /// handler's work; also before a host write through the kernel). Returns false where the page
    /// is not armed or the guest may not write it.
    pub fn unprotect_for_write(&self, page: usize) -> bool {
        unprotect(&self.table, page)
    }

    /// Protects `addr..addr + len` as the state bits `bits` say (their protection part).
    pub fn protect(&self, addr: usize, len: usize, bits: u16) -> io::Result<()> {
        if addr < self.table.base || (addr + len - self.table.base) >> self.table.shift > self.table.pages {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        mprotect(addr, len, bits)
    }

    /// [`Registration::protect`] for a collect's re-protection: `Ok(false)` where the kernel
    /// refused it for want of a mapping to split (`ENOMEM` at `vm.max_map_count`, every page of
    /// the range mapped); the caller then keeps the pages' marks (they stay writable and are
    /// reported again). `ENOMEM` over a range with a hole (memory unmapped behind the space's back)
    /// stays an error.
    pub fn reprotect(&self, addr: usize, len: usize, bits: u16) -> io::Result<bool> {
        match self.protect(addr, len, bits) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::ENOMEM) && all_mapped(addr, len) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Whether every page of `addr..addr + len` is mapped (`mincore` fails with `ENOMEM` on a hole).
fn all_mapped(addr: usize, len: usize) -> bool {
    let page = 1usize << super::mm::page_size().trailing_zeros();
    let mut vec = [0u8; 256];
    let mut a = addr;
    while a < addr + len {
        let n = ((addr + len - a) / page).min(vec.len());
        // SAFETY: mincore only reads the page tables of `a..a + n * page` and writes `n` bytes
        // into `vec`, which has room for them.
        if unsafe { libc::mincore(a as *mut libc::c_void, n * page, vec.as_mut_ptr()) } != 0 {
            return false;
        }
        a += n * page;
    }
    true
}

fn mprotect(addr: usize, len: usize, bits: u16) -> io::Result<()> {
    count(Call::Mprotect);
    // SAFETY: callers pass pages of a range a tracker armed inside its space's reservation; changing
    // their protection affects no Rust reference (guest memory is never lent out as one).
    let r = unsafe { libc::mprotect(addr as *mut libc::c_void, len, flags(bits)) };
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

fn free(table: &Table) {
    count(Call::Munmap);
    // SAFETY: the table's mapping is no longer reachable from the registry and no handler is
    // running (or it was never registered), so nothing reads it after this.
    let _ = unsafe { rustix::mm::munmap(table.states as *mut libc::c_void, table.pages.max(1) * 2) };
}

impl Drop for Registration {
    fn drop(&mut self) {
        disarmed();
        REGISTRY[self.slot].store(std::ptr::null_mut(), SeqCst);
        // A handler that loaded the pointer before the store above has ACTIVE raised until it is done.
        while ACTIVE.load(SeqCst) != 0 {
            std::hint::spin_loop();
        }
        free(&self.table);
    }
}

fn install() -> io::Result<()> {
    INSTALL
        .get_or_init(|| {
            // Fault injection may put a foreign handler in first, to be chained to.
            crate::faults::before_segv_install();
            // SAFETY: a zeroed `sigaction` is a valid value to fill in; `on_segv` has the
            // SA_SIGINFO signature; the previous action is stored (leaked, so it lives forever)
            // before it can be read by the handler, since sigaction installs ours atomically after.
            unsafe {
                let prev: *mut libc::sigaction = Box::into_raw(Box::new(std::mem::zeroed()));
                let act = our_action();
                libc::sigaction(libc::SIGSEGV, std::ptr::null(), prev);
                PREVIOUS.store(prev, SeqCst);
                if libc::sigaction(libc::SIGSEGV, &act, std::ptr::null_mut()) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        })
        .as_ref()
        .map(|_| ())
        .map_err(|e| io::Error::new(e.kind(), e.to_string()))
}

/// Marks a page written and busy in one step, if it is armed and the guest may write it with
/// protection `want` (any, if `None`); returns its protection bits.
fn mark_busy(state: &AtomicU16, want: Option<u16>) -> Option<u16> {
    let mut s = state.load(SeqCst);
    loop {
        if s & ARMED == 0 || s & WRITE == 0 || want.is_some_and(|w| s & PROT_MASK != w) || s >= BUSY_MASK {
            return None;
        }
        match state.compare_exchange_weak(s, (s | DIRTY).wrapping_add(BUSY_ONE), SeqCst, SeqCst) {
            Ok(_) => return Some(s & PROT_MASK),
            Err(now) => s = now,
        }
    }
}

/// Pages of the block a handler unprotects at once when the kernel refuses to split its mappings
/// further (`ENOMEM`: one page in two written leaves as many mappings as pages, past
/// `vm.max_map_count`): 2 MiB.
const BLOCK_PAGES: usize = 512;

/// Marks the page written and busy, unprotects it, and lowers the busy count. Where the kernel
/// has no mapping left to split (`ENOMEM` at `vm.max_map_count`), the run of armed pages of the
/// same protection around it in its 2 MiB block is marked and unprotected as one (their writes are
/// then reported, conservatively); where that needs a split too (the block's mapping goes on past
/// its end), the whole run of such pages, whose ends border other protections or other mappings.
fn unprotect(table: &Table, page: usize) -> bool {
    let len = 1usize << table.shift;
    let Some(state) = table.slot(page) else { return false };
    let Some(bits) = mark_busy(state, None) else { return false };
    let ok = mprotect(page, len, bits).is_ok();
    state.fetch_sub(BUSY_ONE, SeqCst);
    if ok {
        return true;
    }
    let block = BLOCK_PAGES * len;
    let first = page & !(block - 1);
    unprotect_run(table, page, bits, first, first + block)
        || unprotect_run(table, page, bits, table.base, table.base + table.pages * len)
}

/// Marks and unprotects the run of armed pages of protection `bits` around `page` inside
/// `first..last`; returns whether `page` was made writable.
fn unprotect_run(table: &Table, page: usize, bits: u16, first: usize, last: usize) -> bool {
    let len = 1usize << table.shift;
    let same = |a: usize| table.slot(a).is_some_and(|s| s.load(SeqCst) & (ARMED | PROT_MASK) == ARMED | bits);
    let mut lo = page;
    while lo > first && same(lo - len) {
        lo -= len;
    }
    let mut hi = page + len;
    while hi < last && same(hi) {
        hi += len;
    }
    let mut marked = 0;
    let mut a = lo;
    while a < hi {
        // Inside the table (lo..hi lies in first..last); no panic in a signal handler all the same.
        let Some(state) = table.slot(a) else { break };
        if mark_busy(state, Some(bits)).is_none() {
            break;
        }
        marked += 1;
        a += len;
    }
    let ok = marked > 0 && mprotect(lo, marked * len, bits).is_ok();
    for i in 0..marked {
        if let Some(state) = table.slot(lo + i * len) {
            state.fetch_sub(BUSY_ONE, SeqCst);
        }
    }
    ok && lo + marked * len > page
}

/// A collect's step for one page: whether it was written, and whether the collect took the mark
/// (and so must protect the page again). A page a handler is busy with is reported and keeps its
/// mark for the next collect.
pub fn take_written(state: &AtomicU16) -> (bool, bool) {
    let mut s = state.load(SeqCst);
    loop {
        if s & ARMED == 0 || s & DIRTY == 0 {
            return (false, false);
        }
        if s >= BUSY_ONE {
            return (true, false);
        }
        match state.compare_exchange_weak(s, s & !DIRTY, SeqCst, SeqCst) {
            Ok(_) => return (true, true),
            Err(now) => s = now,
        }
    }
}

/// Handles a write to an armed page of the tables `only` allows (any, if `None`); returns false
/// for a fault that is not theirs. The first table that has the page armed handles it: a space
/// has one tracker at a time, but the table of a tracker being dropped may still be registered
/// (its pages disarmed) beside its successor's. `ACTIVE` is raised by the caller.
fn handle(addr: usize, only: Option<&TableKey>) -> bool {
    let slots = match only {
        Some(k) => &REGISTRY[k.slot..=k.slot],
        None => &REGISTRY[..],
    };
    for slot in slots {
        let t = slot.load(SeqCst);
        if t.is_null() {
            continue;
        }
        // SAFETY: a table in the registry stays alive while ACTIVE is raised (see Drop).
        let table = unsafe { &*t };
        if only.is_some_and(|k| k.id != table.id) || table.slot(addr).is_none_or(|s| s.load(SeqCst) & ARMED == 0) {
            continue;
        }
        return unprotect(table, addr & !((1usize << table.shift) - 1));
    }
    false
}

/// The fault at host address `addr`, for the tables `only` allows: whether it was ours (the
/// page was armed and is now writable and marked, or it is a stale fault of a page just disarmed
/// that is writable again). Either way the faulting write is to be retried: return from the
/// handler. Async-signal-safe: atomics and `mprotect`, no lock, no allocation.
fn fault_for(addr: usize, only: Option<&TableKey>) -> bool {
    ACTIVE.fetch_add(1, SeqCst);
    let ours = handle(addr, only);
    ACTIVE.fetch_sub(1, SeqCst);
    ours || retry_stale(addr, only.map(TableKey::window))
}

/// A fault at host address `addr`, for any registered table (what emuhost's own handler does):
/// true where it was a tracker's (return from the handler: the write is retried), false where it
/// is not (pass it on). Async-signal-safe.
pub fn fault(addr: usize) -> bool {
    fault_for(addr, None)
}

/// [`fault`] for the one table `key` names: false for any other address, and for every address
/// once that table is gone. Async-signal-safe.
pub fn fault_in(key: &TableKey, addr: usize) -> bool {
    if !(key.base..key.end).contains(&addr) {
        return false;
    }
    fault_for(addr, Some(key))
}

/// The `sigaction` that installs [`on_segv`].
fn our_action() -> libc::sigaction {
    // SAFETY: a zeroed `sigaction` is a valid value to fill in; sigemptyset only writes the mask
    // (async-signal-safe, so this runs in the handler too).
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_segv as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
        libc::sigemptyset(&mut act.sa_mask);
        act
    }
}

/// The thread's `errno`: the handler's own system calls must not change it for the code it
/// interrupted.
fn errno() -> *mut libc::c_int {
    // SAFETY: __errno_location returns the calling thread's errno slot, valid for the thread's life.
    unsafe { libc::__errno_location() }
}

extern "C" fn on_segv(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: errno() points at this thread's errno.
    let saved = unsafe { *errno() };
    // SAFETY: the kernel passes a valid siginfo for SIGSEGV.
    let code = unsafe { (*info).si_code };
    // si_code <= 0: sent by a process (kill, tgkill, sigqueue), not a fault: there is no address
    // to handle and nothing repeats after the handler returns.
    if code > 0 {
        // SAFETY: for a fault (si_code > 0) si_addr is the faulting address.
        let addr = unsafe { (*info).si_addr() } as usize;
        if !fault(addr) {
            chain_fault(sig, info, ctx);
        }
    } else {
        chain_sent(sig, info, ctx);
    }
    // SAFETY: as above.
    unsafe { *errno() = saved };
}

/// Calls the previous handler if it is a function; returns whether it was one.
fn call_previous(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) -> bool {
    let prev = PREVIOUS.load(SeqCst);
    // SAFETY: `prev` was filled by sigaction before our handler was installed and is never freed.
    // Calling the previous handler with the arguments we got is what chaining means.
    unsafe {
        let p = &*prev;
        if p.sa_sigaction == libc::SIG_DFL || p.sa_sigaction == libc::SIG_IGN {
            return false;
        }
        if p.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(p.sa_sigaction);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(p.sa_sigaction);
            f(sig);
        }
    }
    true
}

/// A fault that is not ours goes to the previous handler; for `SIG_DFL` we restore the default
/// action and return, so the fault repeats and the process dies as it would have without us.
fn chain_fault(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    if !call_previous(sig, info, ctx) {
        // SAFETY: a zeroed sigaction with SIG_DFL is the default action; sigaction is
        // async-signal-safe.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGSEGV, &dfl, std::ptr::null_mut());
        }
    }
}

/// A `SIGSEGV` sent by a process goes to the previous handler if it is a function. Such a handler
/// (Rust's own stack-overflow handler, for one) may reset the disposition to the default so that a
/// fault repeats fatally; for a sent signal nothing repeats, and the next write to an armed page
/// would kill the process, so ours is put back. With no previous function the signal is ignored:
/// a sent `SIGSEGV` is not a fault of any page, and tracking must go on.
fn chain_sent(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    if !call_previous(sig, info, ctx) {
        return;
    }
    // SAFETY: reading and setting the action of SIGSEGV with valid structs; sigaction is
    // async-signal-safe.
    unsafe {
        let mut now: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut now);
        if now.sa_sigaction == libc::SIG_DFL {
            let act = our_action();
            libc::sigaction(libc::SIGSEGV, &act, std::ptr::null_mut());
        }
    }
}
