//! Write tracking by page protection and a fault handler, the portable way: the page-state
//! table and its protocol, shared by every platform. The platform half (`trap`: `SIGSEGV` on
//! Linux, a vectored exception handler on Windows) installs the handler, which calls [`fault`],
//! and changes protections.
//!
//! Armed pages are made read-only. The first write faults; the handler finds the page in a
//! registered tracker's page-state table, gives the page its guest protection back and marks it
//! written, and the write is retried by the CPU. Faults that are not ours (an address no tracker
//! armed, a page the guest itself made unwritable) go on to whatever handles them without us (see
//! the platform half for how).
//!
//! An embedder that owns the fault handler registers its trackers without installing the handler
//! (`Registration::new(.., false)`) and calls [`fault`] or [`fault_in`] from its own handler:
//! the same code as ours, one implementation of the protocol below.
//!
//! The handler is async-signal-safe: it takes no lock and allocates nothing. It reads a fixed table
//! of atomic pointers to page-state tables (two bytes per page, in memory the platform gives
//! zeroed, where untouched parts cost nothing) and changes protections with one system call.
//! A table is freed only after it left the registry and no handler is running (`ACTIVE`).
//!
//! A fault is claimed only where a tracker changed the page's access: an armed page, or a page a
//! disarm just gave its protection back (`STALE`: a write that faulted on it while it was still
//! read-only may reach the handler only after; it is claimed once, and the write retried). A
//! dropped tracker's table stays in the registry, dead, with its stale pages, until its slot is
//! needed or its window is unmapped ([`unmapped`]), so a write that raced the drop is not lost to
//! the default action; a page of a window that was never armed, or that the guest changed since,
//! is never claimed.
//!
//! Order matters. The handler marks the page written and raises its busy count in one atomic step,
//! unprotects it, then lowers the count. A collect takes a page's mark only when no handler is
//! busy with it (else it reports the page and leaves the mark for the next collect), and protects
//! it after. So a page is writable only while it is marked (or while the collect that took its mark
//! is still running, which reports it), and a handler that stalls after marking cannot leave a
//! writable page unmarked behind a collect.
//! Arming follows the same rule: a page armed while a handler is busy with it (a disarm and an arm
//! racing a write) keeps its mark, since the handler is about to make it writable.

use std::io;
use std::sync::atomic::{AtomicPtr, AtomicU16, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use super::RawProt;
use super::cow::CowArena;
use super::trap;

/// Page state bits (a `u16` per page).
pub const ARMED: u16 = 1;
pub const DIRTY: u16 = 2;
pub const READ: u16 = 4;
pub const WRITE: u16 = 8;
pub const EXEC: u16 = 16;
pub const PROT_MASK: u16 = READ | WRITE | EXEC;
/// Not armed: a disarm gave the page its (writable) protection back, and a write that faulted
/// before may still reach the handler, which claims it once.
pub const STALE: u16 = 32;
/// The page's mapping was replaced or unmapped by someone else than the space (the kernel said
/// so: `watch`'s listener on Linux): it is no tracker's. It is neither protected nor unprotected,
/// its faults are not claimed, and collects report it untracked, until the space maps, commits or
/// protects it again. Kept across disarms and arms.
pub const FOREIGN: u16 = 64;
/// One handler (or host-write preparation) busy unprotecting the page; the high byte counts them.
const BUSY_ONE: u16 = 1 << 8;
pub const BUSY_MASK: u16 = 0xff00;

/// The state bits of a protection.
pub fn prot_bits(p: RawProt) -> u16 {
    (if p.read { READ } else { 0 }) | (if p.write { WRITE } else { 0 }) | (if p.exec { EXEC } else { 0 })
}

/// The protection of state bits `bits` (their protection part).
fn raw(bits: u16) -> RawProt {
    RawProt { read: bits & READ != 0, write: bits & WRITE != 0, exec: bits & EXEC != 0 }
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
    /// Its registration was dropped: only its stale pages are claimed.
    dead: std::sync::atomic::AtomicBool,
    /// The copy-before-write hook (`Arc::into_raw`; null: none): see [`copy_hook`].
    cow: AtomicPtr<CowArena>,
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
static REGISTER: Mutex<()> = Mutex::new(());
/// The last table id given out.
static IDS: AtomicU64 = AtomicU64::new(0);
/// Which registered table a fault is for, in a form a signal handler may hold: plain integers,
/// valid (and harmless) after the table is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableKey {
    slot: usize,
    id: u64,
    base: usize,
    end: usize,
}

/// A tracker's table, in the registry while it lives; dropped, the table stays there, dead, until
/// its slot is needed or its window is unmapped (see the module's doc).
#[derive(Debug)]
pub struct Registration {
    slot: usize,
    /// From `Box::into_raw`: owned by the registration while it lives, then by the registry.
    table: *mut Table,
}

// SAFETY: the table is shared through atomics only, and stays valid while the registration lives
// (it is freed only after it left the registry, by `evict`).
unsafe impl Send for Registration {}
// SAFETY: as above.
unsafe impl Sync for Registration {}

impl Registration {
    /// Makes a table for `pages` pages from host address `base`, and installs the handler (once
    /// per process) if `install_handler`; without it, faults reach the table only through
    /// [`fault`] or [`fault_in`], called by the embedder's own handler.
    pub fn new(base: usize, pages: usize, install_handler: bool) -> io::Result<Self> {
        if install_handler {
            trap::install(fault)?;
        }
        let page = super::mm::page_size();
        let states = trap::alloc_states(pages.max(1) * 2)? as *mut AtomicU16;
        let id = IDS.fetch_add(1, SeqCst) + 1;
        let dead = std::sync::atomic::AtomicBool::new(false);
        let cow = AtomicPtr::new(std::ptr::null_mut());
        let table = Box::new(Table { id, base, pages, shift: page.trailing_zeros(), states, dead, cow });
        let _guard = REGISTER.lock().unwrap_or_else(|p| p.into_inner());
        // Under REGISTER, so the slot found stays free until it is published below: an empty
        // one, else the one of a dead table (whose stale pages are then forgotten).
        let empty = REGISTRY.iter().position(|s| s.load(SeqCst).is_null());
        let slot = empty.or_else(|| {
            // SAFETY: a table in the registry is valid until evicted, which needs REGISTER (held).
            let dead = REGISTRY.iter().position(|s| unsafe { s.load(SeqCst).as_ref() }.is_some_and(Table::is_dead))?;
            evict(dead);
            Some(dead)
        });
        match slot {
            Some(slot) => {
                let table = Box::into_raw(table);
                REGISTRY[slot].store(table, SeqCst);
                Ok(Self { slot, table })
            }
            None => {
                free(&table);
                Err(io::Error::other(format!("more than {SLOTS} mprotect trackers at once")))
            }
        }
    }

    fn table(&self) -> &Table {
        // SAFETY: the registration owns the table while it lives (see the field).
        unsafe { &*self.table }
    }

    /// The key [`fault_in`] takes for this table.
    pub fn key(&self) -> TableKey {
        let t = self.table();
        let end = t.base + (t.pages << t.shift);
        TableKey { slot: self.slot, id: t.id, base: t.base, end }
    }

    /// The state of the page at host address `addr`.
    pub fn state(&self, addr: usize) -> Option<&AtomicU16> {
        self.table().slot(addr)
    }

    /// Makes the armed page at host address `page` writable for a write about to happen (the
    /// handler's work; also before a host write through the kernel). Returns false where the page
    /// is not armed or the guest may not write it.
    pub fn unprotect_for_write(&self, page: usize) -> bool {
        unprotect(self.table(), page)
    }

    /// Protects `addr..addr + len` as the state bits `bits` say (their protection part).
    pub fn protect(&self, addr: usize, len: usize, bits: u16) -> io::Result<()> {
        let t = self.table();
        if addr < t.base || (addr + len - t.base) >> t.shift > t.pages {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{addr:#x}+{len:#x} outside the tracked window"),
            ));
        }
        mprotect(addr, len, bits)
    }

    /// Sets the copy-before-write hook (`None`: takes it away): before a handler (or a host write's
    /// preparation) makes an armed page writable, the hook's arena copies it
    /// ([`CowArena::before_write`]). Returns false where another hook is set.
    pub fn set_copy_hook(&self, hook: Option<&Arc<CowArena>>) -> bool {
        let t = self.table();
        match hook {
            Some(h) => {
                let raw = Arc::into_raw(h.clone()) as *mut CowArena;
                let set = t.cow.compare_exchange(std::ptr::null_mut(), raw, SeqCst, SeqCst).is_ok();
                if !set {
                    // SAFETY: from `Arc::into_raw` just above, never published.
                    drop(unsafe { Arc::from_raw(raw) });
                }
                set
            }
            None => {
                let old = t.cow.swap(std::ptr::null_mut(), SeqCst);
                // A handler that loaded the pointer before the swap has ACTIVE raised until done.
                while ACTIVE.load(SeqCst) != 0 {
                    std::hint::spin_loop();
                }
                if !old.is_null() {
                    // SAFETY: from `Arc::into_raw` in the set above; out of the table, and no
                    // handler holds it.
                    drop(unsafe { Arc::from_raw(old) });
                }
                true
            }
        }
    }

    /// [`Registration::protect`] for a collect's re-protection: `Ok(false)` where the kernel
    /// refused it for want of a mapping to split (`ENOMEM` at `vm.max_map_count`, every page of
    /// the range mapped); the caller then keeps the pages' marks (they stay writable and are
    /// reported again). `ENOMEM` over a range with a hole (memory unmapped behind the space's back)
    /// stays an error.
    pub fn reprotect(&self, addr: usize, len: usize, bits: u16) -> io::Result<bool> {
        match self.protect(addr, len, bits) {
            Ok(()) => Ok(true),
            Err(e) if trap::split_refused(&e, addr, len) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

fn mprotect(addr: usize, len: usize, bits: u16) -> io::Result<()> {
    trap::protect(addr, len, raw(bits))
}

fn free(table: &Table) {
    // SAFETY: the table's states are no longer reachable from the registry and no handler is
    // running (or it was never registered), so nothing reads them after this; they came from
    // `trap::alloc_states` with this size.
    unsafe { trap::free_states(table.states as *mut u8, table.pages.max(1) * 2) };
}

impl Drop for Registration {
    /// The table stays in the registry, dead: a write that faulted on a page before the tracker
    /// gave it back may reach the handler after this (see the module's doc).
    fn drop(&mut self) {
        self.set_copy_hook(None);
        self.table().dead.store(true, SeqCst);
    }
}

impl Table {
    fn is_dead(&self) -> bool {
        self.dead.load(SeqCst)
    }
}

/// Takes the dead table out of `slot` and frees it once no handler can be reading it. REGISTER
/// is held.
fn evict(slot: usize) {
    let t = REGISTRY[slot].swap(std::ptr::null_mut(), SeqCst);
    if t.is_null() {
        return;
    }
    // A handler that loaded the pointer before the swap has ACTIVE raised until it is done.
    while ACTIVE.load(SeqCst) != 0 {
        std::hint::spin_loop();
    }
    // SAFETY: the table came from `Box::into_raw` in `Registration::new`; its registration is
    // dropped (it is dead) and it left the registry with no handler running, so nothing reads it.
    let table = unsafe { Box::from_raw(t) };
    free(&table);
}

/// Host `start..end` is being unmapped: dead tables over it are freed (a fault there from now on
/// is on memory mapped anew, never a tracker's).
pub fn unmapped(start: usize, end: usize) {
    let _guard = REGISTER.lock().unwrap_or_else(|p| p.into_inner());
    for (slot, entry) in REGISTRY.iter().enumerate() {
        // SAFETY: a table in the registry is valid until evicted, which needs REGISTER (held).
        let over = unsafe { entry.load(SeqCst).as_ref() }
            .is_some_and(|t| t.is_dead() && t.base < end && start < t.base + (t.pages << t.shift));
        if over {
            evict(slot);
        }
    }
}

/// Marks the pages of `start..end` in `table` given back by a disarm: those armed and writable to
/// the guest become stale (a raced write is claimed once), the others plain.
pub fn disarm_states(reg: &Registration, start: usize, end: usize) {
    let t = reg.table();
    let len = 1usize << t.shift;
    for a in (start..end).step_by(len) {
        if let Some(s) = t.slot(a) {
            let _ = s.fetch_update(SeqCst, SeqCst, |old| {
                let stale = if old & (ARMED | WRITE | FOREIGN) == ARMED | WRITE { STALE } else { 0 };
                Some((old & (BUSY_MASK | FOREIGN)) | stale)
            });
        }
    }
}

/// Marks a page written and busy in one step, if it is armed and the guest may write it with
/// protection `want` (any, if `None`); returns its protection bits.
fn mark_busy(state: &AtomicU16, want: Option<u16>) -> Option<u16> {
    let mut s = state.load(SeqCst);
    loop {
        if s & (ARMED | WRITE | FOREIGN) != ARMED | WRITE || want.is_some_and(|w| s & PROT_MASK != w) || s >= BUSY_MASK
        {
            return None;
        }
        match state.compare_exchange_weak(s, (s | DIRTY).wrapping_add(BUSY_ONE), SeqCst, SeqCst) {
            Ok(_) => return Some(s & PROT_MASK),
            Err(now) => s = now,
        }
    }
}

/// Copies the page at `page` (marked busy, about to be made writable with protection `bits`)
/// into the table's copy-before-write arena, if it has one. Async-signal-safe.
fn copy_hook(table: &Table, page: usize, bits: u16) {
    ACTIVE.fetch_add(1, SeqCst);
    // SAFETY: the arena stays alive while ACTIVE is raised (see `Registration::set_copy_hook`).
    if let Some(arena) = unsafe { table.cow.load(SeqCst).as_ref() } {
        arena.before_write(page, bits & READ != 0);
    }
    ACTIVE.fetch_sub(1, SeqCst);
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
    copy_hook(table, page, bits);
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
    let same = |a: usize| table.slot(a).is_some_and(|s| s.load(SeqCst) & (ARMED | FOREIGN | PROT_MASK) == ARMED | bits);
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
        copy_hook(table, a, bits);
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
    let tables = || {
        slots.iter().filter_map(|slot| {
            // SAFETY: a table in the registry stays alive while ACTIVE is raised (see `evict`).
            let table = unsafe { slot.load(SeqCst).as_ref() }?;
            let state = table.slot(addr)?;
            only.is_none_or(|k| k.id == table.id).then_some((table, state))
        })
    };
    // An armed page of a live table first; else a page a disarm just gave back, claimed once.
    // Arms and disarms of this very page may change it between a look and the act on it (a
    // disarm takes it before its mark, an arm takes the stale mark back): then look again, a
    // bounded number of times, and refuse only a page that is neither armed nor stale.
    for _ in 0..LOOKS {
        let claimable = |s: &AtomicU16| s.load(SeqCst) & (ARMED | FOREIGN) == ARMED;
        if let Some((table, _)) = tables().find(|(t, s)| !t.is_dead() && claimable(s)) {
            if unprotect(table, addr & !((1usize << table.shift) - 1)) {
                return true;
            }
            continue;
        }
        if tables().any(|(_, s)| s.fetch_and(!STALE, SeqCst) & STALE != 0) {
            return true;
        }
        if tables().all(|(t, s)| t.is_dead() || !claimable(s)) {
            return false;
        }
    }
    false
}

/// How many times [`handle`] looks at a page that arms and disarms keep changing under it.
const LOOKS: usize = 8;

/// The fault at host address `addr`, for the tables `only` allows: whether it was ours (the
/// page was armed and is now writable and marked, or it is the first fault on a page a disarm
/// just made writable again). Either way the faulting write is to be retried: return from the
/// handler. Async-signal-safe: atomics and `mprotect`, no lock, no allocation.
fn fault_for(addr: usize, only: Option<&TableKey>) -> bool {
    ACTIVE.fetch_add(1, SeqCst);
    let ours = handle(addr, only);
    ACTIVE.fetch_sub(1, SeqCst);
    ours
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
