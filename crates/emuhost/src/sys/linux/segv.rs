//! The Linux half of write tracking by page protection ([`crate::sys::guard`]): the `SIGSEGV`
//! handler, `mprotect`, and the state tables' memory.
//!
//! The handler is async-signal-safe: it calls the claim [`install`] was given (`sys::guard::fault`: atomics and
//! `mprotect`, no lock, no allocation). Faults that are not a tracker's (an address no tracker
//! armed, a page the guest itself made unwritable) go to the handler installed before ours. A
//! `SIGSEGV` sent by a process (`si_code <= 0`, `kill -SEGV`) is no fault: it is passed on, and
//! our handler stays installed whatever the previous one does to the disposition. The handler
//! keeps `errno` as it found it.

use std::io;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, Ordering::SeqCst};

use crate::sys::RawProt;
use crate::sys::counters::{Call, count};

static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
static INSTALL: OnceLock<io::Result<()>> = OnceLock::new();
/// The claim the handler asks first (set once, before the handler goes in).
static CLAIM: OnceLock<fn(usize) -> bool> = OnceLock::new();

fn flags(p: RawProt) -> libc::c_int {
    (if p.read { libc::PROT_READ } else { 0 })
        | (if p.write { libc::PROT_WRITE } else { 0 })
        | (if p.exec { libc::PROT_EXEC } else { 0 })
}

/// Sets the protection of host `addr..addr + len` (pages a tracker armed) in one `mprotect`.
/// Async-signal-safe.
pub fn protect(addr: usize, len: usize, prot: RawProt) -> io::Result<()> {
    count(Call::Mprotect);
    // SAFETY: callers pass pages of a range a tracker armed inside its space's reservation; changing
    // their protection affects no Rust reference (guest memory is never lent out as one).
    let r = unsafe { libc::mprotect(addr as *mut libc::c_void, len, flags(prot)) };
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Whether a [`protect`] of `addr..addr + len` failed only for want of a mapping to split
/// (`ENOMEM` at `vm.max_map_count`, every page of the range mapped): the caller keeps the pages'
/// marks. `ENOMEM` over a range with a hole (memory unmapped behind the space's back) is an error.
pub fn split_refused(e: &io::Error, addr: usize, len: usize) -> bool {
    e.raw_os_error() == Some(libc::ENOMEM) && all_mapped(addr, len)
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

/// Zeroed memory for a page-state table: an anonymous `MAP_NORESERVE` mapping, so untouched
/// parts cost nothing.
pub fn alloc_states(bytes: usize) -> io::Result<*mut u8> {
    count(Call::Mmap);
    // SAFETY: a fresh anonymous mapping chosen by the kernel (null hint, no MAP_FIXED) touches
    // no existing memory.
    let p = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            bytes,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::NORESERVE,
        )
    }?;
    Ok(p as *mut u8)
}

/// Gives back a table's memory.
///
/// # Safety
/// `p` and `bytes` come from one [`alloc_states`], and nothing reads or writes it after.
pub unsafe fn free_states(p: *mut u8, bytes: usize) {
    count(Call::Munmap);
    // SAFETY: the caller's contract: the mapping is ours and unused.
    let _ = unsafe { rustix::mm::munmap(p as *mut libc::c_void, bytes) };
}

/// Installs the `SIGSEGV` handler, once per process.
///
/// `claim` decides a fault at an address: true where it was a tracker's (the write is retried).
/// The first installation's claim holds (there is one: `sys::guard::fault`); it is given here so
/// that this file names nothing of the protocol that calls it.
pub fn install(claim: fn(usize) -> bool) -> io::Result<()> {
    let _ = CLAIM.set(claim);
    INSTALL
        .get_or_init(|| {
            // Fault injection may put a foreign handler in first, to be chained to.
            crate::sys::hooks::before_segv_install();
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
        if !CLAIM.get().is_some_and(|claim| claim(addr)) {
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
