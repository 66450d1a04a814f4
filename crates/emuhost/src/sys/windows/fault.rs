//! The platform half of the `guard` write tracker on Windows (the twin of the `SIGSEGV` handler of
//! `sys/linux/segv.rs`): a vectored exception handler, `VirtualProtect`, and the memory of the
//! page-state tables. The protocol itself (which page is armed, marked, stale or busy) is
//! `crate::sys::guard`, shared by every platform; this file only reaches the OS for it.
//!
//! The handler is added first in the process's list (`AddVectoredExceptionHandler(1, ..)`), once
//! per process. It looks only at `EXCEPTION_ACCESS_VIOLATION` raised by a write
//! (`ExceptionInformation[0] == 1`; 0 is a read, 8 an execute, DEP): for those it asks
//! the claim [`install`] was given (`sys::guard::fault`) with the faulting address (`ExceptionInformation[1]`) and resumes
//! the write (`EXCEPTION_CONTINUE_EXECUTION`) where the guard claims it. Everything else (a read
//! or execute fault, a write the guard does not claim, any other exception code) goes on to the
//! next vectored handler and then to the frame-based (SEH) handlers
//! (`EXCEPTION_CONTINUE_SEARCH`), so a fault that is not ours ends the process as it would have
//! without us. The handler keeps the thread's last error (`GetLastError`) as it found it.
//!
//! Unlike a signal handler, a vectored handler runs on the faulting thread's own stack (Windows
//! has no alternate stack for it): the guard's work must stay small. It is still async-safe in the
//! same sense: no lock, no allocation (the faulting thread may hold the heap's lock).
//!
//! A write by the system on the process's behalf raises no exception: `ReadFile` into an armed
//! page fails with `ERROR_NOACCESS` (998), the twin of Linux's `EFAULT`. `WriteProcessMemory` is
//! worse: it lifts a read-only page's protection for its write itself and puts it back (Wine 8
//! does, as Windows does for code pages), so its write to an armed page succeeds unseen by the
//! guard. Host writes unprotect first (and mark), as on Linux; never `WriteProcessMemory` into an
//! armed page.

use std::ffi::c_void;
use std::io;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use windows_sys::Win32::System::Threading::SwitchToThread;

use windows_sys::Win32::Foundation::{EXCEPTION_ACCESS_VIOLATION, GetLastError, SetLastError};
use windows_sys::Win32::System::Diagnostics::Debug::{
    AddVectoredExceptionHandler, EXCEPTION_CONTINUE_EXECUTION, EXCEPTION_CONTINUE_SEARCH, EXCEPTION_POINTERS,
};
use windows_sys::Win32::System::Memory::{
    MEM_COMMIT, MEM_FREE, MEM_RELEASE, MEM_RESERVE, MEMORY_BASIC_INFORMATION, PAGE_EXECUTE_READ,
    PAGE_EXECUTE_READWRITE, PAGE_NOACCESS, PAGE_PROTECTION_FLAGS, PAGE_READONLY, PAGE_READWRITE, VirtualAlloc,
    VirtualFree, VirtualProtect, VirtualQuery,
};

use crate::sys::RawProt;
use crate::sys::counters::{Call, count};

/// `ExceptionInformation[0]` of an access violation raised by a write.
const WRITE_ACCESS: usize = 1;

/// Whether the handler is in (false: `AddVectoredExceptionHandler` refused it).
static INSTALL: OnceLock<bool> = OnceLock::new();

/// Adds the vectored exception handler, once per process; later calls return what the first did.
/// It is never removed (a write that faulted before a tracker was dropped may reach it after).
///
/// `claim` decides a write fault at an address: true where it was a tracker's (the write is
/// retried); the first installation's claim holds (there is one: `sys::guard::fault`), given here
/// so that this file names nothing of the protocol that calls it.
pub fn install(claim: fn(usize) -> bool) -> io::Result<()> {
    let _ = CLAIM.set(claim);
    install_handler()
}

/// The claim the handler asks about a write fault (set once).
static CLAIM: OnceLock<fn(usize) -> bool> = OnceLock::new();

/// Adds the handler (once), with or without a claim yet (a view split needs only its waits).
fn install_handler() -> io::Result<()> {
    let added = *INSTALL.get_or_init(|| {
        // Fault injection may want a foreign handler in first (a no-op on Windows for now).
        crate::sys::hooks::before_segv_install();
        // SAFETY: `on_exception` has the PVECTORED_EXCEPTION_HANDLER signature and, a function of
        // this image, lives as long as the process; the handle is never removed.
        !unsafe { AddVectoredExceptionHandler(1, Some(on_exception)) }.is_null()
    });
    if added { Ok(()) } else { Err(io::Error::other("AddVectoredExceptionHandler returned no handle")) }
}

/// The vectored exception handler (see the module's doc).
unsafe extern "system" fn on_exception(info: *mut EXCEPTION_POINTERS) -> i32 {
    // SAFETY: GetLastError only reads the calling thread's TEB.
    let saved = unsafe { GetLastError() };
    // SAFETY: the system passes a valid EXCEPTION_POINTERS whose record lives for this call; both
    // pointers are checked for null all the same.
    let record = unsafe { info.as_ref().and_then(|i| i.ExceptionRecord.as_ref()) };
    let fault = record
        .filter(|r| r.ExceptionCode == EXCEPTION_ACCESS_VIOLATION && r.NumberParameters >= 2)
        .map(|r| (r.ExceptionInformation[0], r.ExceptionInformation[1]));
    // A page of a view being mapped again (a split): wait until it is, then retry the access.
    let ours = fault.is_some_and(|(_, addr)| wait_remapped(addr))
        || fault.is_some_and(|(how, addr)| how == WRITE_ACCESS && CLAIM.get().is_some_and(|claim| claim(addr)));
    #[cfg(test)]
    tests::passed_on(record, ours);
    // SAFETY: SetLastError only writes the calling thread's TEB.
    unsafe { SetLastError(saved) };
    if ours { EXCEPTION_CONTINUE_EXECUTION } else { EXCEPTION_CONTINUE_SEARCH }
}

/// Ranges being mapped anew (a view split: Windows unmaps the whole view and maps its parts
/// again, where Linux replaces one page in place), host `(start, end)`; `(0, 0)` is a free slot.
/// An access to such a page in between faults, and the handler waits for the remap to end and
/// retries it, so a split is atomic to the guest's threads as it is on Linux.
static REMAPS: [(AtomicUsize, AtomicUsize); REMAP_SLOTS] =
    [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; REMAP_SLOTS];
const REMAP_SLOTS: usize = 16;

/// A range being mapped anew, until dropped (see [`REMAPS`]).
pub struct Remapping(usize);

/// Marks host `start..end` as being mapped anew until the returned value drops; installs the
/// handler that makes accesses there wait. Waits for a free slot (there are 16; a slot is held
/// for a few system calls).
pub fn remapping(start: usize, end: usize) -> io::Result<Remapping> {
    install_handler()?;
    loop {
        for (i, (s, e)) in REMAPS.iter().enumerate() {
            if s.compare_exchange(0, start, SeqCst, SeqCst).is_ok() {
                e.store(end, SeqCst);
                return Ok(Remapping(i));
            }
        }
        std::thread::yield_now();
    }
}

impl Drop for Remapping {
    fn drop(&mut self) {
        let (s, e) = &REMAPS[self.0];
        e.store(0, SeqCst);
        s.store(0, SeqCst);
    }
}

/// Whether `addr` lies in a range being mapped anew.
fn remapping_now(addr: usize) -> bool {
    REMAPS.iter().any(|(s, e)| {
        let start = s.load(SeqCst);
        start != 0 && start <= addr && addr < e.load(SeqCst)
    })
}

/// Waits while `addr` lies in a range being mapped anew; whether it did (the access is then to
/// be retried). No lock, no allocation.
fn wait_remapped(addr: usize) -> bool {
    if !remapping_now(addr) {
        return false;
    }
    while remapping_now(addr) {
        std::hint::spin_loop();
        // SAFETY: SwitchToThread only yields the processor.
        unsafe { SwitchToThread() };
    }
    true
}

/// The page protection of `prot`. Windows has no write-only or execute-only page that x86 would
/// honour: write without read is `PAGE_READWRITE`, execute without read `PAGE_EXECUTE_READ`
/// (Linux's `PROT_WRITE` and `PROT_EXEC` alone read the same on x86).
pub fn page_flags(prot: RawProt) -> PAGE_PROTECTION_FLAGS {
    match (prot.read, prot.write, prot.exec) {
        (false, false, false) => PAGE_NOACCESS,
        (true, false, false) => PAGE_READONLY,
        (_, true, false) => PAGE_READWRITE,
        (_, false, true) => PAGE_EXECUTE_READ,
        (_, true, true) => PAGE_EXECUTE_READWRITE,
    }
}

/// Gives `addr..addr + len` the protection `prot` (`VirtualProtect`). `VirtualProtect` refuses a
/// range over two allocations, so where the one call for the whole range fails, the range is
/// walked allocation by allocation (`VirtualQuery`'s `AllocationBase` and `RegionSize`) with one
/// call each; a range inside one allocation (a page, always) costs one call. Every page must be
/// committed: a reserved or free page fails with the system's error (`ERROR_INVALID_ADDRESS`,
/// 487), as memory released behind the space's back must. No lock, no allocation: the handler's
/// path (through the guard).
///
/// No access over pages that are only reserved (a placeholder, a decommitted page) is what they
/// have already: those are left as they are and only the committed regions are protected (Linux
/// takes `PROT_NONE` over `PROT_NONE` pages; `VirtualProtect` refuses reserved ones with 487).
pub fn protect(addr: usize, len: usize, prot: RawProt) -> io::Result<()> {
    let flags = page_flags(prot);
    per_allocation(addr, len, |a, l| match virtual_protect(a, l, flags) {
        Err(e) if flags == PAGE_NOACCESS => committed_only(a, l, flags).map_err(|_| e),
        r => r,
    })
}

/// Protects the committed regions of `addr..addr + len` with `flags`, skipping reserved ones.
fn committed_only(addr: usize, len: usize, flags: PAGE_PROTECTION_FLAGS) -> io::Result<()> {
    let end = addr + len;
    let mut a = addr;
    while a < end {
        let m = query(a)?;
        let region_end = (m.BaseAddress as usize).saturating_add(m.RegionSize).min(end);
        if region_end <= a {
            return Err(io::Error::other("VirtualQuery made no progress"));
        }
        match m.State {
            MEM_COMMIT => virtual_protect(a, region_end - a, flags)?,
            MEM_RESERVE => {}
            _ => return Err(io::Error::from_raw_os_error(487)),
        }
        a = region_end;
    }
    Ok(())
}

fn virtual_protect(addr: usize, len: usize, flags: PAGE_PROTECTION_FLAGS) -> io::Result<()> {
    count(Call::Mprotect);
    let mut old = 0;
    // SAFETY: callers pass pages a tracker armed inside its space's reservation (or their own
    // test pages); changing their protection affects no Rust reference (guest memory is never
    // lent out as one). `old` is a valid out pointer.
    if unsafe { VirtualProtect(addr as *const c_void, len, flags, &mut old) } == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Calls `f` once over `addr..addr + len`; where that fails and the range crosses allocations,
/// once per allocation in it, in address order, stopping at the first error. Where the range lies
/// in one allocation the first error stands. A free hole is one piece of its own (so `f` fails
/// on it with the system's error). `f` must be idempotent: the whole-range call may have done
/// part of its work before it failed. No lock, no allocation.
pub(crate) fn per_allocation(
    addr: usize,
    len: usize,
    mut f: impl FnMut(usize, usize) -> io::Result<()>,
) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let Some(end) = addr.checked_add(len) else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "range wraps the address space"));
    };
    let first = match f(addr, len) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    let mut a = addr;
    while a < end {
        let piece_end = allocation_end(a, end)?;
        if a == addr && piece_end >= end {
            return Err(first);
        }
        f(a, piece_end - a)?;
        a = piece_end;
    }
    Ok(())
}

/// `VirtualQuery` of the region at `addr`.
pub(crate) fn query(addr: usize) -> io::Result<MEMORY_BASIC_INFORMATION> {
    count(Call::Query);
    // SAFETY: an all-zero MEMORY_BASIC_INFORMATION is a valid value (integers and pointers).
    let mut mbi: MEMORY_BASIC_INFORMATION = unsafe { std::mem::zeroed() };
    // SAFETY: `mbi` is a valid out buffer of the size passed; VirtualQuery only reads the
    // process's address-space description.
    let n = unsafe { VirtualQuery(addr as *const c_void, &mut mbi, size_of::<MEMORY_BASIC_INFORMATION>()) };
    if n == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(mbi)
}

/// The end of the allocation `addr` is in, or of the free hole at `addr`, at most `limit`: the
/// regions after `addr`'s are walked while they have its `AllocationBase`.
fn allocation_end(addr: usize, limit: usize) -> io::Result<usize> {
    let first = query(addr)?;
    let region_end = |m: &MEMORY_BASIC_INFORMATION| (m.BaseAddress as usize).saturating_add(m.RegionSize);
    let mut end = region_end(&first);
    if first.State != MEM_FREE {
        while end < limit {
            let next = query(end)?;
            if next.State == MEM_FREE || next.AllocationBase != first.AllocationBase || region_end(&next) <= end {
                break;
            }
            end = region_end(&next);
        }
    }
    // A region always ends past its own address; the clamp keeps the walk moving all the same.
    Ok(end.clamp(addr + 1, limit))
}

/// Whether a [`protect`] failed only for want of mappings to split. On Linux that is `ENOMEM` at
/// `vm.max_map_count`, and the guard then keeps the pages' marks instead of failing the collect.
/// Windows has no such limit: `VirtualProtect` splits a region's page protections without a
/// per-process count of regions, so every failure is a real one (a hole, an uncommitted page,
/// a protection the memory refuses).
pub fn split_refused(_e: &io::Error, _addr: usize, _len: usize) -> bool {
    false
}

/// Memory for a page-state table of `bytes` bytes: read-write, zeroed (`VirtualAlloc`
/// `MEM_RESERVE | MEM_COMMIT`, `PAGE_READWRITE`). Windows charges the commit now (Linux maps it
/// `MAP_NORESERVE`), but a page takes physical memory only once touched: two bytes per guest
/// page, 8 MiB of commit for a 16 GiB window.
pub fn alloc_states(bytes: usize) -> io::Result<*mut u8> {
    count(Call::Mmap);
    // SAFETY: a fresh allocation placed by the system (null address) touches no existing memory.
    let p = unsafe { VirtualAlloc(std::ptr::null(), bytes.max(1), MEM_RESERVE | MEM_COMMIT, PAGE_READWRITE) };
    if p.is_null() {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

/// Gives back a table's memory (`VirtualFree` `MEM_RELEASE`).
///
/// # Safety
/// `p` came from [`alloc_states`] (with this `bytes`) and is not freed yet, and nothing reads or
/// writes the table any more: it left the guard's registry and no handler is running that could
/// have loaded it.
pub unsafe fn free_states(p: *mut u8, bytes: usize) {
    let _ = bytes;
    count(Call::Munmap);
    // SAFETY: `p` is the base of an allocation of ours that no one uses any more (the caller's
    // contract); MEM_RELEASE with size 0 releases exactly that allocation.
    unsafe { VirtualFree(p.cast(), 0, MEM_RELEASE) };
}

#[cfg(test)]
mod tests {
    //! The handler's tests use the guard's table protocol through its `Registration` (the names of
    //! `sys/linux/segv.rs`): a page is armed when its state has `ARMED`, and a write to it is
    //! claimed only where the state also has `WRITE`.
    use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering::SeqCst};
    use std::sync::{Barrier, Mutex};

    use windows_sys::Win32::System::Diagnostics::Debug::EXCEPTION_RECORD;

    use super::*;
    use crate::sys::guard::{ARMED, DIRTY, READ, Registration, WRITE};
    use windows_sys::Win32::System::Memory::MEM_DECOMMIT;

    const PAGE: usize = 4096;
    const RO: RawProt = RawProt { read: true, write: false, exec: false };
    const RW: RawProt = RawProt { read: true, write: true, exec: false };

    /// The page whose access violations the handler counts when it passes them on.
    static WATCHED: AtomicUsize = AtomicUsize::new(0);
    static PASSED: AtomicUsize = AtomicUsize::new(0);
    /// The page the catcher (a handler added last) fixes, and what it saw.
    static CATCH: AtomicUsize = AtomicUsize::new(0);
    static CAUGHT: AtomicUsize = AtomicUsize::new(0);
    static CAUGHT_KIND: AtomicUsize = AtomicUsize::new(usize::MAX);
    /// One catcher test at a time (they share the statics above).
    static SERIAL: Mutex<()> = Mutex::new(());

    /// Called by the handler: counts an access violation on the watched page it passes on.
    pub(super) fn passed_on(record: Option<&EXCEPTION_RECORD>, ours: bool) {
        let Some(r) = record else { return };
        let page = WATCHED.load(SeqCst);
        if !ours && r.ExceptionCode == EXCEPTION_ACCESS_VIOLATION && r.ExceptionInformation[1] & !(PAGE - 1) == page {
            PASSED.fetch_add(1, SeqCst);
        }
    }

    /// A handler added last: fixes an access violation on the page in `CATCH` (makes it
    /// read-write) and resumes; passes on everything else.
    unsafe extern "system" fn catcher(info: *mut EXCEPTION_POINTERS) -> i32 {
        // SAFETY: the system passes a valid record (as in `on_exception`).
        let Some(r) = (unsafe { info.as_ref().and_then(|i| i.ExceptionRecord.as_ref()) }) else {
            return EXCEPTION_CONTINUE_SEARCH;
        };
        let page = CATCH.load(SeqCst);
        if r.ExceptionCode != EXCEPTION_ACCESS_VIOLATION || page == 0 || r.ExceptionInformation[1] & !(PAGE - 1) != page
        {
            return EXCEPTION_CONTINUE_SEARCH;
        }
        CAUGHT.fetch_add(1, SeqCst);
        CAUGHT_KIND.store(r.ExceptionInformation[0], SeqCst);
        if protect(page, PAGE, RW).is_err() {
            return EXCEPTION_CONTINUE_SEARCH;
        }
        EXCEPTION_CONTINUE_EXECUTION
    }

    fn add_catcher() {
        static ADDED: OnceLock<()> = OnceLock::new();
        ADDED.get_or_init(|| {
            // SAFETY: `catcher` has the handler signature and lives as long as the process.
            assert!(!unsafe { AddVectoredExceptionHandler(0, Some(catcher)) }.is_null());
        });
    }

    /// `pages` fresh read-write committed pages (released on drop).
    struct Pages(*mut u8, usize);
    impl Pages {
        fn new(pages: usize) -> Pages {
            Pages(alloc_states(pages * PAGE).unwrap(), pages)
        }
        fn at(&self, i: usize) -> usize {
            self.0 as usize + i * PAGE
        }
    }
    impl Drop for Pages {
        fn drop(&mut self) {
            // SAFETY: our own allocation; every test is done with it here.
            unsafe { free_states(self.0, self.1 * PAGE) };
        }
    }

    /// Arms `page` of `reg` as the guard's arm does: state armed with the guest's read-write
    /// protection, the page made read-only.
    fn arm(reg: &Registration, page: usize) {
        reg.state(page).unwrap().store(ARMED | READ | WRITE, SeqCst);
        protect(page, PAGE, RO).unwrap();
    }

    fn write(addr: usize, v: u8) {
        // SAFETY: a page of this test's own allocation; the write either succeeds or faults into
        // a handler that resumes it.
        unsafe { (addr as *mut u8).write_volatile(v) };
    }

    fn read(addr: usize) -> u8 {
        // SAFETY: as `write`.
        unsafe { (addr as *const u8).read_volatile() }
    }

    /// Runs `f` (an access that faults) on a thread of its own and waits for it: a handler that
    /// wrongly claims the fault retries it forever, and the test fails after a minute instead of
    /// hanging (no timing is asserted; a correct access returns at once).
    fn faulting<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(f()));
        rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the access was retried forever: claimed")
    }

    #[test]
    fn an_armed_write_is_claimed_and_resumed() {
        let pages = Pages::new(2);
        let reg = Registration::new(pages.at(0), 2, true).unwrap();
        arm(&reg, pages.at(1));
        // SAFETY: SetLastError only writes this thread's TEB.
        unsafe { SetLastError(4242) };
        write(pages.at(1) + 7, 42);
        // SAFETY: GetLastError only reads this thread's TEB.
        assert_eq!(unsafe { GetLastError() }, 4242, "the handler keeps the thread's last error");
        assert_eq!(read(pages.at(1) + 7), 42);
        assert_ne!(reg.state(pages.at(1)).unwrap().load(SeqCst) & DIRTY, 0, "the guard marked the page");
        assert_eq!(query(pages.at(1)).unwrap().Protect, PAGE_READWRITE);
    }

    /// A write to a read-only page that no tracker armed, and a read fault on an armed page, are
    /// passed on by our handler (once: it is installed once): the catcher added after it sees
    /// them.
    #[test]
    fn faults_not_ours_are_passed_on() {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        add_catcher();
        install(crate::sys::guard::fault).unwrap();
        install(crate::sys::guard::fault).unwrap();
        let pages = Pages::new(2);
        let reg = Registration::new(pages.at(0), 2, true).unwrap();
        // Unarmed (the state says nothing), read-only.
        protect(pages.at(0), PAGE, RO).unwrap();
        WATCHED.store(pages.at(0), SeqCst);
        CATCH.store(pages.at(0), SeqCst);
        let (passed, caught) = (PASSED.load(SeqCst), CAUGHT.load(SeqCst));
        let at = pages.at(0);
        faulting(move || write(at, 1));
        assert_eq!(CAUGHT.load(SeqCst) - caught, 1, "the catcher saw the unarmed write");
        assert_eq!(CAUGHT_KIND.load(SeqCst), WRITE_ACCESS);
        assert_eq!(PASSED.load(SeqCst) - passed, 1, "one handler of ours passed it on (installed once)");
        assert_eq!(reg.state(pages.at(0)).unwrap().load(SeqCst), 0, "not claimed");
        // A read fault on a page the guard would claim a write to (armed, writable to the guest):
        // only writes go to the guard, so the read is passed on.
        reg.state(pages.at(1)).unwrap().store(ARMED | READ | WRITE, SeqCst);
        protect(pages.at(1), PAGE, RawProt::default()).unwrap();
        WATCHED.store(pages.at(1), SeqCst);
        CATCH.store(pages.at(1), SeqCst);
        let (passed, caught) = (PASSED.load(SeqCst), CAUGHT.load(SeqCst));
        let at = pages.at(1);
        assert_eq!(faulting(move || read(at)), 0);
        assert_eq!(CAUGHT.load(SeqCst) - caught, 1, "the catcher saw the read");
        assert_eq!(CAUGHT_KIND.load(SeqCst), 0, "a read");
        assert_eq!(PASSED.load(SeqCst) - passed, 1);
        assert_eq!(reg.state(pages.at(1)).unwrap().load(SeqCst), ARMED | READ | WRITE, "not claimed");
        CATCH.store(0, SeqCst);
        WATCHED.store(0, SeqCst);
    }

    /// Run by `an_unclaimed_write_ends_the_process` in a child: a write to a read-only page no
    /// tracker armed, with our handler in, must end the process with the access violation.
    #[test]
    #[ignore = "run by an_unclaimed_write_ends_the_process in a child process"]
    fn child_writes_an_unarmed_page() {
        use windows_sys::Win32::System::Diagnostics::Debug::{SEM_NOGPFAULTERRORBOX, SetErrorMode};
        // SAFETY: SetErrorMode only sets this process's error mode: no crash dialog, no debugger.
        unsafe { SetErrorMode(SEM_NOGPFAULTERRORBOX) };
        let pages = Pages::new(1);
        let _reg = Registration::new(pages.at(0), 1, true).unwrap();
        protect(pages.at(0), PAGE, RO).unwrap();
        write(pages.at(0), 1);
        // Not reached where the handler passes the fault on.
        std::process::exit(3);
    }

    #[test]
    fn an_unclaimed_write_ends_the_process() {
        let name = module_path!().split_once("::").map_or("", |m| m.1).to_string() + "::child_writes_an_unarmed_page";
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name.as_str(), "--exact", "--ignored", "--test-threads=1", "--nocapture"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // A handler that claimed the fault would resume the write forever: give up after a
        // minute (no timing is asserted; a correct child dies at once).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("the child still runs: the write was claimed and retried forever");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        // Wine ends a process whose fault no handler took with the fault's code, or, where its
        // debugger (winedbg) was to start and could not, with STATUS_DEBUGGER_INACTIVE.
        const DEBUGGER_INACTIVE: i32 = 0xC000_0354_u32 as i32;
        assert!(matches!(status.code(), Some(EXCEPTION_ACCESS_VIOLATION | DEBUGGER_INACTIVE)), "{status:?}");
    }

    /// Many threads write the same armed pages at once: every write lands (a claim lost would end
    /// the process), every page is marked.
    #[test]
    fn concurrent_writes_to_armed_pages_are_all_claimed() {
        const THREADS: usize = 8;
        const N: usize = 64;
        for _round in 0..4 {
            let pages = Pages::new(N);
            let reg = Registration::new(pages.at(0), N, true).unwrap();
            for i in 0..N {
                reg.state(pages.at(i)).unwrap().store(ARMED | READ | WRITE, SeqCst);
            }
            protect(pages.at(0), N * PAGE, RO).unwrap();
            let barrier = Barrier::new(THREADS);
            std::thread::scope(|s| {
                for t in 0..THREADS {
                    let (base, barrier) = (pages.at(0), &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        for i in 0..N {
                            write(base + ((i + t) % N) * PAGE + t, t as u8 + 1);
                        }
                    });
                }
            });
            for i in 0..N {
                for t in 0..THREADS {
                    assert_eq!(read(pages.at(i) + t), t as u8 + 1, "page {i} thread {t}");
                }
                let st: &AtomicU16 = reg.state(pages.at(i)).unwrap();
                assert_ne!(st.load(SeqCst) & DIRTY, 0, "page {i} marked");
            }
        }
    }

    /// One protect over three allocations (which one `VirtualProtect` refuses) changes them all.
    #[test]
    fn protect_splits_at_allocations() {
        // Three adjacent allocations: reserve 3 x 64 KiB, release it, and allocate each part at
        // its address (another thread may take the hole meanwhile: then try again).
        const GRAN: usize = 64 * 1024;
        let base = (0..16)
            .find_map(|_| {
                let hole = Pages::new(3 * GRAN / PAGE);
                let base = hole.at(0);
                drop(hole);
                let parts: Vec<_> = (0..3)
                    .map(|i| {
                        // SAFETY: a fresh allocation at an address just released: it touches no
                        // memory of anyone's (it fails where someone took the address).
                        unsafe {
                            VirtualAlloc(
                                (base + i * GRAN) as *const c_void,
                                GRAN,
                                MEM_RESERVE | MEM_COMMIT,
                                PAGE_READWRITE,
                            )
                        }
                    })
                    .collect();
                if parts.iter().enumerate().all(|(i, p)| *p as usize == base + i * GRAN) {
                    return Some(base);
                }
                for p in parts.into_iter().filter(|p| !p.is_null()) {
                    // SAFETY: an allocation just made here and used by no one.
                    unsafe { VirtualFree(p, 0, MEM_RELEASE) };
                }
                None
            })
            .expect("three adjacent allocations");
        let (start, len) = (base + GRAN - PAGE, GRAN + 2 * PAGE);
        let mut old = 0;
        // SAFETY: our own allocations (as above); `old` is a valid out pointer.
        let one_call = unsafe { VirtualProtect(start as *const c_void, len, PAGE_READONLY, &mut old) };
        assert_eq!(one_call, 0, "one VirtualProtect over two allocations fails");
        protect(start, len, RO).unwrap();
        for a in (start..start + len).step_by(PAGE) {
            assert_eq!(query(a).unwrap().Protect, PAGE_READONLY, "{a:#x}");
        }
        assert_eq!(query(start - PAGE).unwrap().Protect, PAGE_READWRITE);
        assert_eq!(query(start + len).unwrap().Protect, PAGE_READWRITE);
        // The middle allocation decommitted (as memory taken behind the space's back): the protect
        // fails, it does not crash.
        // SAFETY: the allocation made above, used by no one else.
        unsafe { VirtualFree((base + GRAN) as *mut c_void, GRAN, MEM_DECOMMIT) };
        assert!(protect(start, len, RW).is_err());
        for i in 0..3 {
            // SAFETY: the allocations made above, used by no one now.
            unsafe { VirtualFree((base + i * GRAN) as *mut c_void, 0, MEM_RELEASE) };
        }
    }

    #[test]
    fn protections_map_to_page_flags() {
        let p = |read, write, exec| page_flags(RawProt { read, write, exec });
        assert_eq!(p(false, false, false), PAGE_NOACCESS);
        assert_eq!(p(true, false, false), PAGE_READONLY);
        assert_eq!(p(true, true, false), PAGE_READWRITE);
        assert_eq!(p(false, true, false), PAGE_READWRITE, "write-only reads too");
        assert_eq!(p(true, false, true), PAGE_EXECUTE_READ);
        assert_eq!(p(true, true, true), PAGE_EXECUTE_READWRITE);
        let pages = Pages::new(1);
        for prot in [RawProt::default(), RO, RW, RawProt { read: true, write: false, exec: true }] {
            protect(pages.at(0), PAGE, prot).unwrap();
            assert_eq!(query(pages.at(0)).unwrap().Protect, page_flags(prot));
        }
        protect(pages.at(0), PAGE, RW).unwrap();
    }

    #[test]
    fn states_are_zeroed_and_no_split_is_refused() {
        let p = alloc_states(3 * PAGE + 5).unwrap();
        // SAFETY: a fresh allocation of at least 3 pages + 5 bytes, ours alone.
        let s = unsafe { std::slice::from_raw_parts(p, 3 * PAGE + 5) };
        assert!(s.iter().all(|&b| b == 0));
        // SAFETY: allocated above with this size, and nothing uses it any more.
        unsafe { free_states(p, 3 * PAGE + 5) };
        assert!(!split_refused(&io::Error::from_raw_os_error(8), 0, PAGE));
    }
}
