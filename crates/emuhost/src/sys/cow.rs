//! Copy before write: the arena where the protection backend's fault handler copies a page just
//! before the first write after a snapshot's take makes it writable (`snapshot`'s copy-before-write
//! mode; see docs/snapshot_cow.md).
//!
//! Async-signal-safe where the handler uses it ([`CowArena::before_write`]): atomics only, no lock,
//! no allocation but a fresh chunk of copy slots mapped by the platform (`mmap`, `VirtualAlloc`).
//!
//! Each page of the range has a state word: the epoch of its last copy (`<< 2`), `COPYING` while a
//! copy is in progress (whoever else wants the page waits for it), `PENDING` while a snapshot
//! needs the page's bytes as they are now (set by a take, cleared by the next copy). The epoch is
//! the newest take's number. The handler copies a page whose last copy is older than the epoch,
//! before making it writable, so the copy holds the page's bytes at that take. Other threads (the
//! snapshots' copier running ahead, the space's observer before a protection or a release) copy
//! through the kernel ([`super::mm::read_host`]), which fails instead of faulting where a page is
//! not readable (the copy is then given up and the page left as it was).
//!
//! Copies go to slots of chunks of [`CHUNK_SLOTS`] pages, numbered in the order they are claimed
//! (a page's copies in epoch order); each slot's log entry (page + 1, epoch) is written once its
//! bytes are. The harvester ([`CowArena::harvest`], one at a time: the caller's lock) reads the
//! slots in order and frees each chunk once every slot of it is read.

use std::io;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};

use super::trap;

/// Slots of a chunk (pages copied into it).
pub const CHUNK_SLOTS: usize = 256;
/// Chunks in flight at most (copied and not yet harvested): 4 GiB of 4 KiB pages. A handler that
/// needs a chunk past it waits for the harvester.
const CHUNKS: usize = 4096;

/// Chunks mapped (and touched) when the arena is made, and the most a harvester keeps mapped
/// ahead of the copies for reuse (a chunk read through is reused for a chunk to come, so copies
/// land in memory the kernel has paged in already).
const POOL: usize = 8;

const COPYING: u64 = 1;
const PENDING: u64 = 2;

/// The copy-before-write arena of one range (see the module's doc).
#[derive(Debug)]
pub struct CowArena {
    base: usize,
    pages: usize,
    shift: u32,
    /// The newest take's epoch; 0: nothing to copy.
    epoch: AtomicU64,
    /// A state word per page (see the module's doc), from `trap::alloc_states`.
    states: *mut AtomicU64,
    /// The chunks, by chunk number modulo [`CHUNKS`].
    chunks: Box<[AtomicPtr<u8>]>,
    /// The next slot to claim.
    next: AtomicU64,
    /// The next slot to harvest (the harvester's own).
    harvested: AtomicU64,
    /// Threads looking at a chunk pointer (a chunk is freed only when none is).
    users: AtomicUsize,
    /// The next chunk number a harvester may map ahead (the harvester's own).
    ahead: AtomicU64,
    /// The epoch up to which every page a snapshot needs is marked pending
    /// ([`CowArena::all_pending`]): from it on, only pending pages are copied.
    flagged: AtomicU64,
}

// SAFETY: the states and chunks are shared through atomics (a slot's bytes are written by the one
// thread that claimed it, and read by the harvester after its log entry says they are complete).
unsafe impl Send for CowArena {}
// SAFETY: as above.
unsafe impl Sync for CowArena {}

/// One step of a wait for another thread's copy (a few microseconds): spins, then gives the CPU up
/// (`sched_yield`, `SwitchToThread`: async-signal-safe), so a handler waiting for a thread that
/// is not running lets it run.
fn wait(spins: &mut u32) {
    *spins += 1;
    if *spins < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// A chunk's bytes: its slots' pages, then a log entry (page + 1, epoch) per slot, then its number.
fn chunk_bytes(page: usize) -> usize {
    CHUNK_SLOTS * page + CHUNK_SLOTS * 16 + 8
}

impl CowArena {
    /// An arena for the `pages` pages from host address `base`.
    pub fn new(base: usize, pages: usize) -> io::Result<CowArena> {
        let page = super::mm::page_size();
        let states = trap::alloc_states(pages.max(1) * 8)? as *mut AtomicU64;
        let chunks = (0..CHUNKS).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect();
        let arena = CowArena {
            base,
            pages,
            shift: page.trailing_zeros(),
            epoch: AtomicU64::new(0),
            states,
            chunks,
            next: AtomicU64::new(0),
            harvested: AtomicU64::new(0),
            users: AtomicUsize::new(0),
            ahead: AtomicU64::new(0),
            flagged: AtomicU64::new(0),
        };
        for _ in 0..POOL {
            let Ok(c) = trap::alloc_states(chunk_bytes(page)) else { break };
            // Touched now, so the first copies into it take no page fault.
            (0..CHUNK_SLOTS).for_each(|at| {
                // SAFETY: a fresh read-write mapping of `chunk_bytes` bytes, ours alone.
                unsafe { c.add(at * page).write_volatile(0) }
            });
            arena.reuse(c);
        }
        Ok(arena)
    }

    /// A chunk's number (its last word: written before it is published).
    fn number(&self, c: *mut u8) -> &AtomicU64 {
        // SAFETY: `c` is a live chunk of `chunk_bytes` bytes, 8-aligned.
        unsafe { &*(c.add(chunk_bytes(self.page()) - 8) as *const AtomicU64) }
    }

    /// Gives the chunk `c`, read through (its log entries zero), to a chunk to come, or unmaps it
    /// where [`POOL`] chunks wait ahead already. The harvester's (or the maker's) own.
    fn reuse(&self, c: *mut u8) {
        let claiming = self.next.load(SeqCst) as usize / CHUNK_SLOTS;
        let mut m = (self.ahead.load(SeqCst) as usize).max(claiming);
        while m < claiming + POOL {
            self.number(c).store(m as u64, SeqCst);
            if self.chunks[m % CHUNKS].compare_exchange(std::ptr::null_mut(), c, SeqCst, SeqCst).is_ok() {
                self.ahead.store(m as u64 + 1, SeqCst);
                return;
            }
            m += 1;
        }
        // SAFETY: not published (or no longer: see `harvest`): ours alone.
        unsafe { trap::free_states(c, chunk_bytes(self.page())) };
    }

    fn page(&self) -> usize {
        1 << self.shift
    }

    fn state(&self, i: usize) -> Option<&AtomicU64> {
        // SAFETY: `i < pages`, and `states` holds `pages` words for as long as the arena lives.
        (i < self.pages).then(|| unsafe { &*self.states.add(i) })
    }

    /// The page index of host address `addr`, if in the range.
    pub fn index(&self, addr: usize) -> Option<usize> {
        let i = addr.checked_sub(self.base)? >> self.shift;
        (i < self.pages).then_some(i)
    }

    /// Starts epoch `e` (a take): from now on, the first write to each page copies it first.
    pub fn set_epoch(&self, e: u64) {
        self.epoch.store(e, SeqCst);
    }

    /// Marks page `i` as needed by a snapshot: the observer's copies ([`CowArena::copy_pending`])
    /// take it.
    pub fn set_pending(&self, i: usize) {
        if let Some(s) = self.state(i) {
            s.fetch_or(PENDING, SeqCst);
        }
    }

    /// Every page a snapshot needs as it is now is marked pending ([`CowArena::set_pending`]) for
    /// the current epoch: from now on a page not pending is not copied. (A copy fills the version
    /// of the page at the take it belongs to where that version waits for bytes; such a version
    /// keeps its page pending until the page's next copy, so a page not pending needs none.)
    pub fn all_pending(&self) {
        self.flagged.store(self.epoch.load(SeqCst), SeqCst);
    }

    /// Claims page `i` for a copy at the current epoch: `Some((epoch, old state))` where it has no
    /// copy at this epoch (and it is pending, where `pending_only` or where every page needed is
    /// marked: see [`CowArena::all_pending`]; an odd epoch, a take's collect, copies bytes of the
    /// take before); `None` where it has one (after waiting for a copy in progress), it need not
    /// be copied, or copies are off.
    fn claim(&self, i: usize, pending_only: bool) -> Option<(u64, u64)> {
        let e = self.epoch.load(SeqCst);
        let st = self.state(i)?;
        if e == 0 {
            return None;
        }
        let pending_only = pending_only || self.flagged.load(SeqCst) + (e % 2) >= e;
        let mut s = st.load(SeqCst);
        let mut spins = 0u32;
        loop {
            if s & COPYING != 0 {
                wait(&mut spins);
                s = st.load(SeqCst);
                continue;
            }
            if s >> 2 >= e || (pending_only && s & PENDING == 0) {
                return None;
            }
            match st.compare_exchange_weak(s, (e << 2) | COPYING, SeqCst, SeqCst) {
                Ok(_) => return Some((e, s)),
                Err(now) => s = now,
            }
        }
    }

    /// Copies page `i` with `copy(src, dst)` (true where it copied) into a fresh slot after a
    /// claim; gives the claim back (the state as it was) where the copy failed.
    fn copy_claimed(&self, i: usize, e: u64, old: u64, copy: impl FnOnce(usize, &mut [u8]) -> bool) {
        let st = self.state(i).expect("claimed");
        let Some((chunk, at)) = self.slot() else {
            st.store(old, SeqCst);
            return;
        };
        let page = self.page();
        // SAFETY: the slot `at` of `chunk` is this thread's alone (claimed by `slot`), and the chunk
        // is not freed before its log entry is written and harvested.
        let dst = unsafe { std::slice::from_raw_parts_mut(chunk.add(at * page), page) };
        let ok = copy(self.base + (i << self.shift), dst);
        // SAFETY: the log entries follow the pages, 8-aligned (pages are).
        let log = unsafe { &*(chunk.add(CHUNK_SLOTS * page + at * 16) as *const [AtomicU64; 2]) };
        log[1].store(if ok { e } else { 0 }, SeqCst);
        log[0].store(if ok { i as u64 + 1 } else { u64::MAX }, SeqCst);
        self.users.fetch_sub(1, SeqCst);
        st.store(if ok { e << 2 } else { old }, SeqCst);
    }

    /// Claims the next slot: its chunk (mapped here if it is not yet) and its place in it. The
    /// arena's `users` count stays raised (lowered by the caller once the log entry is written).
    fn slot(&self) -> Option<(*mut u8, usize)> {
        self.users.fetch_add(1, SeqCst);
        let s = self.next.fetch_add(1, SeqCst) as usize;
        let (n, at) = (s / CHUNK_SLOTS, s % CHUNK_SLOTS);
        let entry = &self.chunks[n % CHUNKS];
        let bytes = chunk_bytes(self.page());
        let mut spins = 0u32;
        let number = |c: *mut u8| {
            // SAFETY: a chunk's last word holds its number (written before it was published).
            unsafe { &*(c.add(bytes - 8) as *const AtomicU64) }
        };
        loop {
            let c = entry.load(SeqCst);
            if c.is_null() {
                let Ok(fresh) = trap::alloc_states(bytes) else {
                    // No memory for a copy: the page stays pending (the harvester wakes on it).
                    self.users.fetch_sub(1, SeqCst);
                    return None;
                };
                number(fresh).store(n as u64, SeqCst);
                if entry.compare_exchange(std::ptr::null_mut(), fresh, SeqCst, SeqCst).is_err() {
                    // SAFETY: never published: ours alone.
                    unsafe { trap::free_states(fresh, bytes) };
                }
                continue;
            }
            if number(c).load(SeqCst) == n as u64 {
                return Some((c, at));
            }
            // An older chunk still being harvested (past CHUNKS chunks of copies in flight).
            wait(&mut spins);
        }
    }

    /// The fault handler's hook: page `page_addr` is about to be made writable; copies it first if
    /// it has no copy at the current epoch. `readable`: the page can be read now (the handler's
    /// copy is a plain one). Async-signal-safe.
    pub fn before_write(&self, page_addr: usize, readable: bool) {
        let Some(i) = self.index(page_addr) else { return };
        if !readable {
            return;
        }
        if let Some((e, old)) = self.claim(i, false) {
            self.copy_claimed(i, e, old, |src, dst| {
                // SAFETY: the page is mapped readable and cannot be written while claimed (it is
                // protected until this handler makes it writable; others wait for the claim).
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
                true
            });
        }
    }

    /// A thread's copy of page `i` through the kernel (a copy ahead of the writes, a fallback at a
    /// take): if it has none at the current epoch (and is pending, if `pending_only`). A page that
    /// cannot be read is left as it was.
    pub fn copy_now(&self, i: usize, pending_only: bool) {
        if let Some((e, old)) = self.claim(i, pending_only) {
            self.copy_claimed(i, e, old, |src, dst| super::mm::read_host(src, dst).is_ok());
        }
    }

    /// Copies the pending pages of host `start..end` that have no copy at the current epoch (the
    /// space is about to change their mapping or protection).
    pub fn copy_pending(&self, start: usize, end: usize) {
        let (a, b) = (start.max(self.base), end.min(self.base + (self.pages << self.shift)));
        let mut at = a;
        while at < b {
            if let Some(i) = self.index(at) {
                self.copy_now(i, true);
            }
            at += self.page();
        }
    }

    /// Hands each copy made since the last harvest, in the order they were claimed, to
    /// `f(page, epoch, bytes)`, waiting for copies in progress; frees the chunks read through.
    /// One harvester at a time (the caller's lock).
    pub fn harvest(&self, mut f: impl FnMut(usize, u64, &[u8])) {
        let page = self.page();
        let bytes = chunk_bytes(page);
        let end = self.next.load(SeqCst);
        let mut s = self.harvested.load(SeqCst);
        while s < end {
            let (n, at) = (s as usize / CHUNK_SLOTS, s as usize % CHUNK_SLOTS);
            let entry = &self.chunks[n % CHUNKS];
            let c = loop {
                let c = entry.load(SeqCst);
                // SAFETY: a published chunk's last word holds its number; only this harvester
                // frees chunks.
                if !c.is_null() && unsafe { &*(c.add(bytes - 8) as *const AtomicU64) }.load(SeqCst) == n as u64 {
                    break Some(c);
                }
                // The claimer of slot `s` found no memory for a chunk: it gave up (its page stays
                // as it was), and so does this slot.
                if self.users.load(SeqCst) == 0 && entry.load(SeqCst) == c {
                    let c = entry.load(SeqCst);
                    // SAFETY: as above.
                    if c.is_null() || unsafe { &*(c.add(bytes - 8) as *const AtomicU64) }.load(SeqCst) != n as u64 {
                        break None;
                    }
                    continue;
                }
                std::thread::yield_now();
            };
            if let Some(c) = c {
                // SAFETY: as in `copy_claimed`.
                let log = unsafe { &*(c.add(CHUNK_SLOTS * page + at * 16) as *const [AtomicU64; 2]) };
                // A copy in progress: its claimer holds `users` raised until the entry is written;
                // an entry still empty once nobody holds it was given up (no memory for a chunk).
                let mut p = log[0].load(SeqCst);
                while p == 0 {
                    if self.users.load(SeqCst) == 0 {
                        p = log[0].load(SeqCst);
                        if p == 0 {
                            p = u64::MAX;
                        }
                        break;
                    }
                    std::thread::yield_now();
                    p = log[0].load(SeqCst);
                }
                if p != u64::MAX {
                    // SAFETY: the slot's bytes are complete (its log entry is written) and nobody
                    // writes them again.
                    let b = unsafe { std::slice::from_raw_parts(c.add(at * page), page) };
                    f(p as usize - 1, log[1].load(SeqCst), b);
                }
                // For the chunk's reuse.
                log[0].store(0, SeqCst);
                log[1].store(0, SeqCst);
                if at == CHUNK_SLOTS - 1 {
                    entry.store(std::ptr::null_mut(), SeqCst);
                    let mut spins = 0u32;
                    while self.users.load(SeqCst) != 0 {
                        wait(&mut spins);
                    }
                    // Every slot of the chunk is read, it left the table, and no thread looks at a
                    // chunk pointer any more.
                    self.reuse(c);
                }
            }
            s += 1;
            self.harvested.store(s, SeqCst);
        }
    }
}

impl Drop for CowArena {
    fn drop(&mut self) {
        let bytes = chunk_bytes(self.page());
        for c in self.chunks.iter() {
            let c = c.swap(std::ptr::null_mut(), SeqCst);
            if !c.is_null() {
                // SAFETY: the arena is going: no handler, copier or harvester uses it any more.
                unsafe { trap::free_states(c, bytes) };
            }
        }
        // SAFETY: as above; the states came from `alloc_states` with this size.
        unsafe { trap::free_states(self.states as *mut u8, self.pages.max(1) * 8) };
    }
}
