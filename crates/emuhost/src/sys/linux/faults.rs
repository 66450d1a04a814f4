//! A `SIGSEGV` that is not emuhost's (fault injection, feature `faults`).
//!
//! [`ForeignPage::install`] maps one page of its own and installs a `SA_SIGINFO` handler for
//! `SIGSEGV`, as a runtime or a JIT loaded before emuhost would: a fault on its page makes the page
//! writable and is counted; any other fault goes to the handler installed before it. Installed
//! before emuhost's handler, it is the "previous handler" emuhost must pass foreign faults to;
//! [`ForeignPage::touch`] makes such a fault.

use std::io;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};

use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};

/// The page and a foreign handler, once per process.
#[derive(Debug)]
pub struct ForeignPage {
    addr: usize,
    len: usize,
}

static PAGE: AtomicUsize = AtomicUsize::new(0);
/// Calls of the handler: all, and those for its page.
static CALLS: AtomicU64 = AtomicU64::new(0);
static RESOLVED: AtomicU64 = AtomicU64::new(0);
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
static ONCE: OnceLock<Result<ForeignPage, i32>> = OnceLock::new();

impl ForeignPage {
    /// Maps the page (`PROT_NONE`) and installs the handler, the first time; the same page after.
    pub fn install() -> io::Result<&'static ForeignPage> {
        ONCE.get_or_init(|| {
            let len = rustix::param::page_size();
            // SAFETY: a fresh anonymous mapping chosen by the kernel touches no existing memory.
            let p =
                unsafe { rustix::mm::mmap_anonymous(std::ptr::null_mut(), len, ProtFlags::empty(), MapFlags::PRIVATE) }
                    .map_err(|e| e.raw_os_error())?;
            PAGE.store(p as usize, SeqCst);
            // SAFETY: a zeroed `sigaction` is a valid value to fill in; `on_segv` has the
            // SA_SIGINFO signature; the previous action is stored (leaked, so it lives forever)
            // before our handler can run.
            unsafe {
                let prev: *mut libc::sigaction = Box::into_raw(Box::new(std::mem::zeroed()));
                libc::sigaction(libc::SIGSEGV, std::ptr::null(), prev);
                PREVIOUS.store(prev, SeqCst);
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = on_segv as *const () as usize;
                act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
                libc::sigemptyset(&mut act.sa_mask);
                if libc::sigaction(libc::SIGSEGV, &act, std::ptr::null_mut()) != 0 {
                    return Err(io::Error::last_os_error().raw_os_error().unwrap_or(libc::EINVAL));
                }
            }
            Ok(ForeignPage { addr: p as usize, len })
        })
        .as_ref()
        .map_err(|&e| io::Error::from_raw_os_error(e))
    }

    /// Whether the process's `SIGSEGV` handler now is this one (nothing was installed after it).
    pub fn is_current_handler() -> bool {
        // SAFETY: a zeroed `sigaction` is a valid value for the kernel to fill in; a null new
        // action only reads the current one.
        let now = unsafe {
            let mut cur: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut cur);
            cur.sa_sigaction
        };
        now == on_segv as *const () as usize
    }

    /// Makes the page inaccessible and stores `byte` into it with the CPU: the fault goes to the
    /// process's handler, and the store completes once this page's handler resolved it. Returns
    /// the byte read back.
    pub fn touch(&self, byte: u8) -> io::Result<u8> {
        // SAFETY: the page is ours (mapped in `install`, never unmapped) and no Rust reference
        // points into it.
        unsafe { rustix::mm::mprotect(self.addr as *mut libc::c_void, self.len, MprotectFlags::empty()) }?;
        // SAFETY: as above; the store faults, the handler makes the page writable, and the CPU
        // repeats the store.
        unsafe { std::ptr::write_volatile(self.addr as *mut u8, byte) };
        // SAFETY: the page is readable and writable now (the store went through).
        Ok(unsafe { std::ptr::read_volatile(self.addr as *const u8) })
    }

    /// How many times the handler ran, for any fault.
    pub fn calls(&self) -> u64 {
        CALLS.load(SeqCst)
    }

    /// How many of those were faults on the page, which it resolved.
    pub fn resolved(&self) -> u64 {
        RESOLVED.load(SeqCst)
    }
}

extern "C" fn on_segv(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    CALLS.fetch_add(1, SeqCst);
    // SAFETY: the kernel passes a valid siginfo for SIGSEGV; si_addr is the faulting address.
    let addr = unsafe { (*info).si_addr() } as usize;
    let page = PAGE.load(SeqCst);
    let len = rustix::param::page_size();
    if page != 0 && (page..page + len).contains(&addr) {
        // SAFETY: the page is ours; mprotect is async-signal-safe.
        unsafe { libc::mprotect(page as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE) };
        RESOLVED.fetch_add(1, SeqCst);
        return;
    }
    let prev = PREVIOUS.load(SeqCst);
    // SAFETY: `prev` was filled by sigaction before this handler was installed and is never freed;
    // passing the fault on with the arguments we got is what chaining means, and for SIG_DFL the
    // default action comes back and the fault repeats, so the process dies as it would have.
    unsafe {
        let p = &*prev;
        if p.sa_flags & libc::SA_SIGINFO != 0 && p.sa_sigaction > 1 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(p.sa_sigaction);
            f(sig, info, ctx);
        } else if p.sa_sigaction == libc::SIG_DFL || p.sa_sigaction == libc::SIG_IGN {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGSEGV, &dfl, std::ptr::null_mut());
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(p.sa_sigaction);
            f(sig);
        }
    }
}
