//! The Linux half of write tracking by page protection ([`crate::sys::guard`]): the `SIGSEGV`
//! handler, `mprotect`, and the state tables' memory.
//!
//! The handler is async-signal-safe: it calls the claim [`install`] was given (`sys::guard::fault`: atomics and
//! `mprotect`, no lock, no allocation). Faults that are not a tracker's (an address no tracker
//! armed, a page the guest itself made unwritable) go to the handler installed before ours. A
//! `SIGSEGV` sent by a process (`si_code <= 0`, `kill -SEGV`) is no fault: it is passed on, and
//! our handler stays installed whatever the previous one does to the disposition. The handler
//! keeps `errno` as it found it.
//!
//! The handler also makes [`copy`] survive faults: a copy with the CPU that returns what it had
//! left where a page refused it, as `process_vm_readv` does but without a system call per batch
//! or the kernel's walk of each page.

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
    let page = rustix::param::page_size();
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
        // A fault of the copy with the CPU is never a tracker's to claim (its reads need no
        // write access, and a restore's writes are prepared before): it ends the copy, as the
        // kernel's copy fails, and nothing changes a page's protection for it. (Claimed, a read
        // of a page that a decommit beside it had just taken away made the page writable again
        // under a state table that still said armed.)
        if !guarded::resume(ctx) && !CLAIM.get().is_some_and(|claim| claim(addr)) {
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

/// Copies `len` bytes from `src` to `dst` with the CPU; returns the bytes copied (fewer where a
/// page refused the access that no tracker claimed: the next byte of `dst` or `src` lies in it),
/// or `None` where this build or process cannot (not x86-64, or the handler could not be
/// installed): the caller copies through the kernel then.
///
/// A fault ends the copy whatever the page: no tracker is asked to claim it (a write into pages
/// a tracker armed is prepared before, as for the kernel's copy). The copy relies on this
/// handler seeing the fault: a `SIGSEGV` handler installed after ours that does not chain to it
/// turns a refused page into that handler's fault.
///
/// # Safety
/// Both ranges must be memory no Rust reference conflicts with (guest memory, or the caller's
/// own buffer borrowed for the call); a fault in either is survived, nothing else is checked.
pub unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) -> Option<usize> {
    guarded::site()?;
    // SAFETY: the caller's contract; a fault at the copy instruction returns early.
    Some(len - unsafe { guarded::copy_bytes(dst, src, len, 0) })
}

/// The copy instruction the handler resumes past, and the function around it.
#[cfg(target_arch = "x86_64")]
mod guarded {
    use std::sync::OnceLock;

    /// `copy_bytes(dst, src, len, 0)` copies and returns the bytes left (0: all copied);
    /// `copy_bytes(_, _, _, 1)` returns the address of its `rep movsb`, the one instruction
    /// [`resume`] moves past (`rep movsb` stops at the exact byte that faulted, `rcx` the bytes
    /// left).
    ///
    /// # Safety
    /// As [`super::copy`]'s; with `site` set nothing is read or written.
    #[unsafe(naked)]
    pub(super) unsafe extern "sysv64" fn copy_bytes(dst: *mut u8, src: *const u8, len: usize, site: usize) -> usize {
        core::arch::naked_asm!(
            "test rcx, rcx",
            "jnz 3f",
            "mov rcx, rdx",
            "2:",
            "rep movsb",
            "mov rax, rcx",
            "ret",
            "3:",
            "lea rax, [rip + 2b]",
            "ret",
        )
    }

    static SITE: OnceLock<Option<usize>> = OnceLock::new();

    /// The address of `copy_bytes`'s `rep movsb`, with the handler installed (`None` where it
    /// could not be: then nothing may be copied this way).
    pub(super) fn site() -> Option<usize> {
        *SITE.get_or_init(|| {
            // SAFETY: with `site` set the function only returns an address; nothing is copied.
            let at = unsafe { copy_bytes(std::ptr::null_mut(), std::ptr::null(), 0, 1) };
            super::install(crate::sys::guard::fault).ok().map(|()| at)
        })
    }

    /// Moves a fault at `copy_bytes`'s `rep movsb` past it (2 bytes: `f3 a4`), so the copy
    /// returns what it had left; false for a fault anywhere else. Async-signal-safe.
    pub(super) fn resume(ctx: *mut libc::c_void) -> bool {
        // Set before the handler is installed for the copy (a fault at the site can only come
        // after): a plain read of the cell.
        let Some(Some(at)) = SITE.get() else { return false };
        // SAFETY: for SA_SIGINFO handlers the kernel passes the interrupted thread's ucontext.
        let rip = unsafe { &mut (*(ctx as *mut libc::ucontext_t)).uc_mcontext.gregs[libc::REG_RIP as usize] };
        if *rip as usize != *at {
            return false;
        }
        *rip += 2;
        true
    }
}

/// No copy with the CPU on other architectures: the kernel copies.
#[cfg(not(target_arch = "x86_64"))]
mod guarded {
    pub(super) fn site() -> Option<usize> {
        None
    }

    pub(super) fn resume(_: *mut libc::c_void) -> bool {
        false
    }

    pub(super) unsafe fn copy_bytes(_: *mut u8, _: *const u8, len: usize, _: usize) -> usize {
        len
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Three pages: read-write, then none, then read-only.
    struct Pages(usize, usize);

    impl Pages {
        fn new() -> Pages {
            let p = rustix::param::page_size();
            // SAFETY: a fresh anonymous mapping chosen by the kernel touches no existing memory.
            let at = unsafe {
                rustix::mm::mmap_anonymous(
                    std::ptr::null_mut(),
                    3 * p,
                    rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                    rustix::mm::MapFlags::PRIVATE,
                )
            }
            .unwrap() as usize;
            // SAFETY: the pages are this test's own mapping, referenced by nothing.
            unsafe {
                std::ptr::write_bytes(at as *mut u8, 7, 3 * p);
                assert_eq!(libc::mprotect((at + p) as *mut libc::c_void, p, libc::PROT_NONE), 0);
                assert_eq!(libc::mprotect((at + 2 * p) as *mut libc::c_void, p, libc::PROT_READ), 0);
            }
            Pages(at, p)
        }
    }

    impl Drop for Pages {
        fn drop(&mut self) {
            // SAFETY: the mapping is this test's own, unused after.
            unsafe { libc::munmap(self.0 as *mut libc::c_void, 3 * self.1) };
        }
    }

    /// A copy with the CPU that runs into a page it may not read, or write, stops at that page's
    /// first byte and returns the bytes copied; the process goes on (without the handler's
    /// resume it dies of the fault), and a whole copy of readable bytes is whole.
    #[test]
    fn a_copy_with_the_cpu_stops_at_the_page_that_refuses_and_the_process_goes_on() {
        let m = Pages::new();
        let (at, p) = (m.0, m.1);
        let mut buf = vec![0u8; 2 * p];
        // SAFETY: `buf` is this test's, borrowed for the copy; the pages are its own mapping.
        let n = unsafe { copy(buf.as_mut_ptr(), (at + 100) as *const u8, 2 * p) };
        assert_eq!(n, Some(p - 100), "read up to the page without access");
        assert!(buf[..p - 100].iter().all(|&b| b == 7) && buf[p - 100..].iter().all(|&b| b == 0));
        // SAFETY: as above.
        let n = unsafe { copy((at + 2 * p - 8) as *mut u8, buf.as_ptr(), 16) };
        assert_eq!(n, Some(0), "no byte written into the page without access");
        // SAFETY: as above.
        let n = unsafe { copy((at + 3 * p - 16) as *mut u8, buf.as_ptr(), 16) };
        assert_eq!(n, Some(0), "no byte written into the read-only page");
        // SAFETY: as above.
        let n = unsafe { copy(buf.as_mut_ptr(), (at + 2 * p) as *const u8, p) };
        assert_eq!(n, Some(p), "a readable page read whole");
        assert!(buf[..p].iter().all(|&b| b == 7));
    }
}
