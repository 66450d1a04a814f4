//! One reservation of address space and what is done to pages inside it, on Windows.
//!
//! Two ways, chosen once per process by [`placeholders`]:
//!
//! - **Placeholders** (Windows 10 1803+, Wine 10): the mapping (window and guards) is one
//!   placeholder (`VirtualAlloc2` `MEM_RESERVE | MEM_RESERVE_PLACEHOLDER`). A commit over
//!   placeholder pages cuts exactly that range out (`VirtualFree` `MEM_RELEASE |
//!   MEM_PRESERVE_PLACEHOLDER` splits) and replaces it by one private allocation (`VirtualAlloc2`
//!   `MEM_RESERVE | MEM_COMMIT | MEM_REPLACE_PLACEHOLDER | MEM_WRITE_WATCH`); a shared view
//!   replaces its placeholder (`MapViewOfFile3` `MEM_REPLACE_PLACEHOLDER`). Every allocation and
//!   view is recorded (its extent, a sorted map), because `VirtualProtect`, `VirtualFree` and
//!   `GetWriteWatch` never span two allocations: every call here is split by recorded
//!   allocation. A reset turns whole allocations and views back into placeholders and coalesces
//!   the neighbours (`MEM_COALESCE_PLACEHOLDERS`); a reset over part of a private allocation
//!   decommits that part in place (`MEM_DECOMMIT`), since Windows cannot shrink an allocation.
//!   Splits are page-granular (4 KiB): [`placeholders`] requires it.
//! - **No placeholders** (Wine 8, Windows before 1803, or 4 KiB splits refused): the mapping is
//!   one `VirtualAlloc(MEM_RESERVE | MEM_WRITE_WATCH, PAGE_NOACCESS)`, the one recorded
//!   allocation; a commit is `VirtualAlloc(MEM_COMMIT)` inside it, a reset `VirtualFree
//!   (MEM_DECOMMIT)`. [`Reservation::map_shared`] is [`io::ErrorKind::Unsupported`] there: a view
//!   cannot replace part of an allocation without placeholders.
//!
//! `VirtualAlloc2`, `MapViewOfFile3` and `UnmapViewOfFile2` are looked up in `kernelbase.dll` at
//! run time (`GetProcAddress`), so the executable still starts where they are missing.
//!
//! Bytes are copied in and out by the CPU in a copy whose access violations a vectored exception
//! handler turns into an early return (`guarded`): a page the protection forbids fails the copy,
//! never faults the process, and no protection is changed. (`NtWriteVirtualMemory` ignores
//! protection under Wine; kernel32's `WriteProcessMemory` unprotects the page for the copy, which
//! a write tracker would miss.)
//!
//! Every method takes offsets into the window and checks them (page-aligned, inside the window:
//! `ERROR_INVALID_PARAMETER` otherwise), so no call here touches memory the reservation does not
//! own. Errors are Windows codes: a page that refuses a copy is `ERROR_NOACCESS` (998, the
//! counterpart of `EFAULT`), an address already in use `ERROR_ALREADY_EXISTS` (183, `EEXIST`).

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::io;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use windows_sys::Win32::Foundation::{
    CloseHandle, ERROR_ALREADY_EXISTS, ERROR_INVALID_ADDRESS, ERROR_INVALID_PARAMETER, ERROR_NOACCESS, GetLastError,
    HANDLE, INVALID_HANDLE_VALUE,
};
use windows_sys::Win32::System::LibraryLoader::{GetProcAddress, LoadLibraryW};
use windows_sys::Win32::System::Memory::{
    CreateFileMappingW, MEM_COMMIT, MEM_DECOMMIT, MEM_FREE, MEM_MAPPED, MEM_PRESERVE_PLACEHOLDER, MEM_RELEASE,
    MEM_REPLACE_PLACEHOLDER, MEM_RESERVE, MEM_RESERVE_PLACEHOLDER, MEMORY_BASIC_INFORMATION,
    MEMORY_MAPPED_VIEW_ADDRESS, PAGE_EXECUTE, PAGE_EXECUTE_READ, PAGE_EXECUTE_READWRITE, PAGE_NOACCESS, PAGE_READONLY,
    PAGE_READWRITE, UnmapViewOfFile, VirtualAlloc, VirtualFree, VirtualProtect,
};
use windows_sys::Win32::System::SystemInformation::{GetSystemInfo, SYSTEM_INFO};
use windows_sys::Win32::System::SystemServices::MEM_WRITE_WATCH;
use windows_sys::Win32::System::Threading::GetCurrentProcess;

pub use crate::sys::RawProt;
use crate::sys::RunsError;
use crate::sys::counters::{Call, count};

#[cfg(not(target_arch = "x86_64"))]
compile_error!("emuhost's Windows layer copies guest bytes with x86-64 code (sys/windows/mm.rs, mod guarded)");

/// `winnt.h`'s `MEM_COALESCE_PLACEHOLDERS` (not in windows-sys 0.61).
const MEM_COALESCE_PLACEHOLDERS: u32 = 0x1;

type VirtualAlloc2Fn =
    unsafe extern "system" fn(HANDLE, *const c_void, usize, u32, u32, *mut c_void, u32) -> *mut c_void;
type MapViewOfFile3Fn =
    unsafe extern "system" fn(HANDLE, HANDLE, *const c_void, u64, usize, u32, u32, *mut c_void, u32) -> *mut c_void;
type UnmapViewOfFile2Fn = unsafe extern "system" fn(HANDLE, *mut c_void, u32) -> i32;

/// The placeholder calls of `kernelbase.dll` (Windows 10 1803+), looked up once.
struct Fns {
    alloc2: VirtualAlloc2Fn,
    map3: MapViewOfFile3Fn,
    unmap2: UnmapViewOfFile2Fn,
}

fn fns() -> Option<&'static Fns> {
    static FNS: OnceLock<Option<Fns>> = OnceLock::new();
    FNS.get_or_init(|| {
        let name: Vec<u16> = "kernelbase.dll\0".encode_utf16().collect();
        // SAFETY: a NUL-terminated UTF-16 name; kernelbase.dll is a system library (loaded already).
        let module = unsafe { LoadLibraryW(name.as_ptr()) };
        if module.is_null() {
            return None;
        }
        // SAFETY: NUL-terminated names of functions in a module that stays loaded (never freed).
        let (a, m, u) = unsafe {
            (
                GetProcAddress(module, c"VirtualAlloc2".as_ptr().cast())?,
                GetProcAddress(module, c"MapViewOfFile3".as_ptr().cast())?,
                GetProcAddress(module, c"UnmapViewOfFile2".as_ptr().cast())?,
            )
        };
        // SAFETY: the three exports have these documented signatures (memoryapi.h; a
        // MEMORY_MAPPED_VIEW_ADDRESS is one pointer, passed and returned as one).
        unsafe {
            Some(Fns {
                alloc2: std::mem::transmute::<unsafe extern "system" fn() -> isize, VirtualAlloc2Fn>(a),
                map3: std::mem::transmute::<unsafe extern "system" fn() -> isize, MapViewOfFile3Fn>(m),
                unmap2: std::mem::transmute::<unsafe extern "system" fn() -> isize, UnmapViewOfFile2Fn>(u),
            })
        }
    })
    .as_ref()
}

fn last_error() -> io::Error {
    // SAFETY: no preconditions.
    io::Error::from_raw_os_error(unsafe { GetLastError() } as i32)
}

fn einval() -> io::Error {
    io::Error::from_raw_os_error(ERROR_INVALID_PARAMETER as i32)
}

fn noaccess() -> io::Error {
    io::Error::from_raw_os_error(ERROR_NOACCESS as i32)
}

fn process() -> HANDLE {
    // SAFETY: no preconditions; the pseudo handle needs no closing.
    unsafe { GetCurrentProcess() }
}

fn system_info() -> (usize, usize) {
    static INFO: OnceLock<(usize, usize)> = OnceLock::new();
    *INFO.get_or_init(|| {
        // SAFETY: SYSTEM_INFO is plain data; zero is a valid bit pattern and GetSystemInfo fills it.
        let mut si: SYSTEM_INFO = unsafe { std::mem::zeroed() };
        // SAFETY: `si` is a valid out pointer.
        unsafe { GetSystemInfo(&mut si) };
        (si.dwPageSize as usize, si.dwAllocationGranularity as usize)
    })
}

/// The system's page size (`GetSystemInfo`: 4 KiB).
/// Whether a release or a view over part of a view maps the view's other pages anew: yes on
/// Windows, where a view is unmapped whole and its kept parts mapped again.
pub const CUTS_REMAP: bool = true;

/// The system's page size.
pub fn page_size() -> usize {
    system_info().0
}

/// The granularity of allocation bases (`GetSystemInfo`: 64 KiB). A reservation's mapping starts
/// on it.
pub fn allocation_granularity() -> usize {
    system_info().1
}

/// Whether placeholders work with page-granular splits, probed once per process and kept: a
/// placeholder of two granules reserved (`VirtualAlloc2 MEM_RESERVE | MEM_RESERVE_PLACEHOLDER`),
/// one page split off at a page (not granule) boundary, replaced by a committed write-watched
/// allocation, turned back into a placeholder, coalesced and released. Wine 8 refuses the
/// reserve (error 87); Windows before 1803 has no `VirtualAlloc2`.
pub fn placeholders() -> io::Result<()> {
    static PROBED: OnceLock<Result<(), String>> = OnceLock::new();
    PROBED
        .get_or_init(probe_placeholders)
        .clone()
        .map_err(|m| io::Error::new(io::ErrorKind::Unsupported, format!("placeholders: {m}")))
}

fn probe_placeholders() -> Result<(), String> {
    let f = fns().ok_or("VirtualAlloc2/MapViewOfFile3/UnmapViewOfFile2 not in kernelbase.dll")?;
    let (page, gran) = system_info();
    let fail = |what: &str| format!("{what} failed: error {}", last_error().raw_os_error().unwrap_or(0));
    let keep = MEM_RESERVE | MEM_RESERVE_PLACEHOLDER;
    // SAFETY: a fresh placeholder where the system chooses; the calls below touch only it.
    let p = unsafe { (f.alloc2)(process(), null(), 2 * gran, keep, PAGE_NOACCESS, null_mut(), 0) };
    if p.is_null() {
        return Err(fail("VirtualAlloc2(MEM_RESERVE | MEM_RESERVE_PLACEHOLDER)"));
    }
    let at = p as usize + page;
    let replace = MEM_RESERVE | MEM_COMMIT | MEM_REPLACE_PLACEHOLDER | MEM_WRITE_WATCH;
    // SAFETY: every address is inside the placeholder made above, which nothing else knows.
    let r = unsafe {
        if VirtualFree(at as *mut c_void, page, MEM_RELEASE | MEM_PRESERVE_PLACEHOLDER) == 0 {
            Err(fail("a split of a placeholder at one page"))
        } else if (f.alloc2)(process(), at as *const c_void, page, replace, PAGE_READWRITE, null_mut(), 0) as usize
            != at
        {
            Err(fail("VirtualAlloc2(MEM_REPLACE_PLACEHOLDER | MEM_WRITE_WATCH) of one page"))
        } else if VirtualFree(at as *mut c_void, page, MEM_RELEASE | MEM_PRESERVE_PLACEHOLDER) == 0 {
            Err(fail("a private page back to a placeholder"))
        } else if VirtualFree(p, 2 * gran, MEM_RELEASE | MEM_COALESCE_PLACEHOLDERS) == 0 {
            Err(fail("MEM_COALESCE_PLACEHOLDERS"))
        } else {
            Ok(())
        }
    };
    // SAFETY: as above; release whatever is left of the probe's pieces (a failed step may have
    // left several: each is its own allocation).
    unsafe { release_allocations(p as usize, p as usize + 2 * gran) };
    r
}

/// Releases every allocation and view that starts inside `start..end`, walking `VirtualQuery`.
///
/// # Safety
/// Everything mapped in `start..end` must be the caller's to release, unused after.
unsafe fn release_allocations(start: usize, end: usize) {
    let mut at = start;
    while at < end {
        let Some(r) = query(at) else { return };
        let next = r.BaseAddress as usize + r.RegionSize;
        let alloc = r.AllocationBase as usize;
        if r.State != MEM_FREE && alloc >= start && alloc < end {
            if r.Type == MEM_MAPPED {
                count(Call::Munmap);
                // SAFETY: a view whose base lies in the caller's range (its contract).
                unsafe { UnmapViewOfFile(MEMORY_MAPPED_VIEW_ADDRESS { Value: alloc as *mut c_void }) };
            } else {
                count(Call::Munmap);
                // SAFETY: an allocation (or placeholder) whose base lies in the caller's range.
                unsafe { VirtualFree(alloc as *mut c_void, 0, MEM_RELEASE) };
            }
        }
        at = next.max(at + page_size());
    }
}

/// `VirtualQuery` of one address (`fault::query`, the one call of it): `None` above the user
/// address space.
fn query(addr: usize) -> Option<MEMORY_BASIC_INFORMATION> {
    super::fault::query(addr).ok()
}

impl RawProt {
    /// The `PAGE_*` constant (write without read is read-write, as on x86 Linux).
    fn page(self) -> u32 {
        match (self.read, self.write, self.exec) {
            (false, false, false) => PAGE_NOACCESS,
            (_, false, false) => PAGE_READONLY,
            (_, true, false) => PAGE_READWRITE,
            (false, false, true) => PAGE_EXECUTE,
            (true, false, true) => PAGE_EXECUTE_READ,
            (_, true, true) => PAGE_EXECUTE_READWRITE,
        }
    }

    fn none(self) -> bool {
        !self.read && !self.write && !self.exec
    }
}

/// A pagefile-backed section (`CreateFileMappingW(INVALID_HANDLE_VALUE, PAGE_EXECUTE_READWRITE)`),
/// zero-filled; a clone shares the handle, closed with the last clone.
#[derive(Clone, Debug)]
pub struct Section {
    handle: Arc<OwnedSection>,
}

#[derive(Debug)]
struct OwnedSection(usize);

impl Drop for OwnedSection {
    fn drop(&mut self) {
        // SAFETY: the handle is this value's own, closed once; views of it stay valid.
        unsafe { CloseHandle(self.0 as HANDLE) };
    }
}

impl Section {
    /// Creates a section of `len` bytes. `name` names it in errors only: the section object is
    /// unnamed (a named one would be shared with every process that opens the name).
    pub fn new(name: &str, len: u64) -> io::Result<Section> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("section {name}: length 0")));
        }
        // SAFETY: a pagefile-backed unnamed section: no pointer but null ones is passed.
        let h = unsafe {
            CreateFileMappingW(
                INVALID_HANDLE_VALUE,
                null(),
                PAGE_EXECUTE_READWRITE,
                (len >> 32) as u32,
                len as u32,
                null(),
            )
        };
        if h.is_null() {
            let e = last_error();
            return Err(io::Error::new(e.kind(), format!("section {name} of {len} bytes: {e}")));
        }
        Ok(Section { handle: Arc::new(OwnedSection(h as usize)) })
    }

    fn raw(&self) -> HANDLE {
        self.handle.0 as HANDLE
    }
}

/// How the reservation was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// One placeholder, carved into recorded allocations and views.
    Placeholder,
    /// One `MEM_RESERVE | MEM_WRITE_WATCH` allocation, the one recorded.
    Plain,
    /// The caller's: nothing recorded, plain calls (no write watch known).
    Adopted,
}

/// A recorded allocation or view: its end, and for a view what it shows.
#[derive(Clone, Debug)]
struct Piece {
    end: usize,
    view: Option<(Section, u64)>,
}

/// One stretch of a range, as the record has it.
#[derive(Clone, Debug)]
enum Seg {
    /// Placeholder pages (no recorded allocation).
    Gap,
    /// Inside private allocation `start..end`.
    Private(usize, usize),
    /// Inside view `start..end` of the section from the offset.
    View(usize, usize, Section, u64),
}

/// A reservation: the window `base..base + len`, with `guard` bytes of reserved pages beyond
/// each end (part of the same mapping; no method reaches them). One it made is released on drop,
/// guards too; an adopted one (the caller's) is left.
#[derive(Debug)]
pub struct Reservation {
    base: usize,
    len: usize,
    guard: usize,
    mode: Mode,
    /// Its number in the process's list of live reservations (later ones have larger ones).
    id: u64,
    /// Released already, part by part ([`Reservation::unmap_parts`]): the drop releases nothing.
    unmapped: AtomicBool,
    /// The recorded allocations and views by start (host addresses; placeholders are the gaps).
    pieces: Mutex<BTreeMap<usize, Piece>>,
}

impl Reservation {
    /// Reserves `len` bytes of address space where the system chooses, with `guard` bytes of
    /// reserved pages below and above it.
    pub fn new(len: usize, guard: usize) -> io::Result<Self> {
        Self::reserve(None, len, guard)
    }

    /// Reserves `base..base + len` with `guard` bytes below and above it, never replacing
    /// anything: `ERROR_ALREADY_EXISTS` where anything is there. `base - guard` must lie on the
    /// allocation granularity (64 KiB; `ERROR_INVALID_PARAMETER` otherwise).
    pub fn at(base: usize, len: usize, guard: usize) -> io::Result<Self> {
        Self::reserve(Some(base), len, guard)
    }

    fn reserve(base: Option<usize>, len: usize, guard: usize) -> io::Result<Self> {
        let page = page_size();
        if len == 0 || !len.is_multiple_of(page) || !guard.is_multiple_of(page) {
            return Err(einval());
        }
        let total = guard.checked_mul(2).and_then(|g| g.checked_add(len)).ok_or_else(einval)?;
        let hint = match base {
            None => 0,
            Some(b) => {
                let start = b.checked_sub(guard).filter(|s| *s != 0 && s.is_multiple_of(allocation_granularity()));
                let start = start.ok_or_else(einval)?;
                start.checked_add(total).ok_or_else(einval)?;
                start
            }
        };
        let placeholder = placeholders().is_ok();
        let p = match fns() {
            Some(f) if placeholder => {
                count(Call::Mmap);
                let flags = MEM_RESERVE | MEM_RESERVE_PLACEHOLDER;
                // SAFETY: a new placeholder, where the system chooses or at `hint` only where
                // nothing is: no existing memory is affected.
                unsafe { (f.alloc2)(process(), hint as *const c_void, total, flags, PAGE_NOACCESS, null_mut(), 0) }
            }
            _ => {
                count(Call::Mmap);
                // SAFETY: as above, a new reservation.
                unsafe { VirtualAlloc(hint as *const c_void, total, MEM_RESERVE | MEM_WRITE_WATCH, PAGE_NOACCESS) }
            }
        };
        if p.is_null() || (hint != 0 && p as usize != hint) {
            let e = last_error();
            return Err(match e.raw_os_error() {
                Some(c) if hint != 0 && c == ERROR_INVALID_ADDRESS as i32 => {
                    io::Error::from_raw_os_error(ERROR_ALREADY_EXISTS as i32)
                }
                _ => e,
            });
        }
        let (lo, hi) = (p as usize, p as usize + total);
        let mut pieces = BTreeMap::new();
        let mode = if placeholder { Mode::Placeholder } else { Mode::Plain };
        if mode == Mode::Plain {
            pieces.insert(lo, Piece { end: hi, view: None });
        }
        Ok(Self::registered(lo + guard, len, guard, mode, pieces))
    }

    fn registered(base: usize, len: usize, guard: usize, mode: Mode, pieces: BTreeMap<usize, Piece>) -> Self {
        let id = crate::sys::live::add(base - guard, base + len + guard);
        Self { base, len, guard, mode, id, unmapped: AtomicBool::new(false), pieces: Mutex::new(pieces) }
    }

    /// Takes the caller's reservation `base..base + len` as the window (page-aligned, non-empty,
    /// not wrapping; `ERROR_INVALID_PARAMETER` otherwise). It is not released on drop. Commits
    /// are `VirtualAlloc(MEM_COMMIT)` in it, a reset `VirtualFree(MEM_DECOMMIT)`; nothing is
    /// recorded ([`Reservation::private_allocations`] reports none: the caller's allocation may
    /// have no write watch) and [`Reservation::map_shared`] is unsupported.
    ///
    /// # Safety
    /// The range must be reserved memory (`MEM_RESERVE`, one allocation) the caller made, kept
    /// for as long as the `Reservation` lives, which nothing else changes meanwhile: the methods
    /// commit, decommit and protect it as if they owned it.
    pub unsafe fn adopt(base: usize, len: usize) -> io::Result<Self> {
        let page = page_size();
        if base == 0 || len == 0 || !base.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(einval());
        }
        base.checked_add(len).ok_or_else(einval)?;
        Ok(Self::registered(base, len, 0, Mode::Adopted, BTreeMap::new()))
    }

    /// Whether the window is the caller's ([`Reservation::adopt`]).
    pub fn adopted(&self) -> bool {
        self.mode == Mode::Adopted
    }

    /// The bytes of guard pages reserved beyond each end of the window.
    pub fn guard(&self) -> usize {
        self.guard
    }

    /// The host address of offset 0.
    pub fn base(&self) -> usize {
        self.base
    }

    /// The reservation's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The whole mapping, guards included: host `(start, end)`.
    pub fn mapping(&self) -> (usize, usize) {
        (self.base - self.guard, self.base + self.len + self.guard)
    }

    /// The parts of host `start..end` that reservations made after this one hold (in holes of
    /// this window), in address order.
    pub fn later_within(&self, start: usize, end: usize) -> Vec<(usize, usize)> {
        crate::sys::live::later_within(self.id, start, end)
    }

    /// The recorded write-watched private allocations that overlap host `start..end`, each whole
    /// (host `start, end`), in address order: one `GetWriteWatch` each covers them. Views are
    /// never in it; an adopted window has none. Without placeholders it is the whole mapping.
    pub fn private_allocations(&self, start: usize, end: usize, mut f: impl FnMut(usize, usize)) {
        let pieces = self.pieces();
        let first = pieces.range(..start).next_back().filter(|(_, p)| p.end > start).map(|(s, _)| *s).unwrap_or(start);
        for (&s, p) in pieces.range(first..end) {
            if p.view.is_none() && p.end > start {
                f(s, p.end);
            }
        }
    }

    fn pieces(&self) -> MutexGuard<'_, BTreeMap<usize, Piece>> {
        self.pieces.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Host `(start, end)` of `off..off + len`, after checking that it lies inside the window and
    /// is page-aligned and non-empty.
    fn span(&self, off: usize, len: usize) -> io::Result<(usize, usize)> {
        let page = page_size();
        let end = off.checked_add(len).ok_or_else(einval)?;
        if len == 0 || end > self.len || !off.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(einval());
        }
        Ok((self.base + off, self.base + end))
    }

    /// Host `a..b` cut by the record: `(start, end, what)`, in address order, covering it.
    fn segments(&self, pieces: &BTreeMap<usize, Piece>, a: usize, b: usize) -> Vec<(usize, usize, Seg)> {
        if self.mode == Mode::Adopted {
            return vec![(a, b, Seg::Private(self.base, self.base + self.len))];
        }
        let mut out = Vec::new();
        let mut at = a;
        let first = pieces.range(..a).next_back().filter(|(_, p)| p.end > a).map(|(s, _)| *s).unwrap_or(a);
        for (&s, p) in pieces.range(first..b) {
            if s > at {
                out.push((at, s, Seg::Gap));
            }
            let seg = match &p.view {
                None => Seg::Private(s, p.end),
                Some((sec, off)) => Seg::View(s, p.end, sec.clone(), *off),
            };
            out.push((at.max(s), p.end.min(b), seg));
            at = p.end.min(b);
        }
        if at < b {
            out.push((at, b, Seg::Gap));
        }
        out
    }
}

impl Reservation {
    /// Sets the protection of `off..off + len`: over reserved pages this is the commit, over
    /// committed pages it keeps their bytes. One call per recorded allocation: placeholder pages
    /// are cut out and replaced by a committed write-watched allocation (`VirtualAlloc2
    /// MEM_REPLACE_PLACEHOLDER`; none where `prot` grants nothing: they stay reserved), pages of a
    /// private allocation are committed with `prot` (`VirtualAlloc(MEM_COMMIT)`, which keeps the
    /// bytes of committed pages and sets their protection), a view's pages get `VirtualProtect`.
    pub fn protect(&self, off: usize, len: usize, prot: RawProt) -> io::Result<()> {
        let (a, b) = self.span(off, len)?;
        let mut pieces = self.pieces();
        for (s, e, seg) in self.segments(&pieces, a, b) {
            match seg {
                Seg::Gap if prot.none() => {}
                Seg::Gap => self.carve(&mut pieces, s, e, prot)?,
                Seg::Private(..) => commit(s, e, prot)?,
                Seg::View(..) => virtual_protect(s, e, prot)?,
            }
        }
        Ok(())
    }

    /// Replaces the placeholder pages `s..e` by one committed write-watched private allocation
    /// with `prot`, and records it.
    fn carve(&self, pieces: &mut BTreeMap<usize, Piece>, s: usize, e: usize, prot: RawProt) -> io::Result<()> {
        let f = fns().ok_or_else(einval)?;
        exact_placeholder(s, e)?;
        let flags = MEM_RESERVE | MEM_COMMIT | MEM_REPLACE_PLACEHOLDER | MEM_WRITE_WATCH;
        count(Call::Mmap);
        // SAFETY: `s..e` is exactly one placeholder of this reservation (just made so).
        let p = unsafe { (f.alloc2)(process(), s as *const c_void, e - s, flags, prot.page(), null_mut(), 0) };
        if p as usize != s {
            return Err(last_error());
        }
        pieces.insert(s, Piece { end: e, view: None });
        Ok(())
    }

    /// Returns `off..off + len` to reserved, its bytes dropped: whole private allocations and
    /// views in it become placeholders again (`VirtualFree MEM_RELEASE | MEM_PRESERVE_PLACEHOLDER`,
    /// `UnmapViewOfFile2 MEM_PRESERVE_PLACEHOLDER`) and are coalesced with neighbouring
    /// placeholders; part of a private allocation is decommitted in place (`MEM_DECOMMIT`); a view
    /// the range cuts is unmapped and its outside parts mapped again as views of the same section
    /// pages, with their protections. Without placeholders: `VirtualFree(MEM_DECOMMIT)`.
    pub fn reset(&self, off: usize, len: usize) -> io::Result<()> {
        let (a, b) = self.span(off, len)?;
        let mut pieces = self.pieces();
        let mut freed = false;
        for (s, e, seg) in self.segments(&pieces, a, b) {
            match seg {
                Seg::Gap => {}
                Seg::Private(x, y) if self.mode == Mode::Placeholder && (x, y) == (s, e) => {
                    release_to_placeholder(x, y)?;
                    pieces.remove(&x);
                    freed = true;
                }
                Seg::Private(..) => decommit(s, e)?,
                Seg::View(x, y, sec, file_off) => {
                    self.cut_view(&mut pieces, (x, y), (s, e), &sec, file_off)?;
                    freed = true;
                }
            }
        }
        if freed {
            self.coalesce(&pieces, a, b);
        }
        Ok(())
    }

    /// Unmaps view `x..y` (back to placeholders) and maps its parts outside `s..e` again over the
    /// same section pages, each page with the protection it had.
    fn cut_view(
        &self,
        pieces: &mut BTreeMap<usize, Piece>,
        (x, y): (usize, usize),
        (s, e): (usize, usize),
        sec: &Section,
        file_off: u64,
    ) -> io::Result<()> {
        let f = fns().ok_or_else(einval)?;
        let mut prots = Vec::new();
        for (p, q) in [(x, s), (e, y)] {
            let mut at = p;
            while at < q {
                let r = query(at).ok_or_else(einval)?;
                let to = (r.BaseAddress as usize + r.RegionSize).min(q);
                prots.push((at, to, r.Protect));
                at = to;
            }
        }
        // Until the kept parts are mapped again, an access to the view's pages waits in the fault
        // handler and is retried after: the split does not kill a guest thread that touches the
        // view meanwhile, as Linux's one MAP_FIXED would not. The kept parts come back writable
        // until their protections are set again; the space tells its observers they were mapped
        // anew (`CUTS_REMAP`), so a write tracker arms them again and reports them once.
        let _remapping = super::fault::remapping(x, y)?;
        count(Call::Munmap);
        // SAFETY: `x` is the base of a view this reservation mapped and recorded.
        if unsafe { (f.unmap2)(process(), x as *mut c_void, MEM_PRESERVE_PLACEHOLDER) } == 0 {
            return Err(last_error());
        }
        pieces.remove(&x);
        for (p, q) in [(x, s), (e, y)] {
            if p < q {
                self.view(pieces, p, q, sec, file_off + (p - x) as u64)?;
            }
        }
        for (p, q, page_prot) in prots {
            let mut old = 0;
            count(Call::Mprotect);
            // SAFETY: pages of a view just mapped again by this reservation.
            if unsafe { VirtualProtect(p as *const c_void, q - p, page_prot, &mut old) } == 0 {
                return Err(last_error());
            }
        }
        Ok(())
    }

    /// Maps section pages from `file_off` over the placeholder pages `s..e` as one view (at
    /// read-write-execute, the most any later protection needs; the caller sets its protection),
    /// and records it.
    fn view(
        &self,
        pieces: &mut BTreeMap<usize, Piece>,
        s: usize,
        e: usize,
        sec: &Section,
        file_off: u64,
    ) -> io::Result<()> {
        let f = fns().ok_or_else(einval)?;
        exact_placeholder(s, e)?;
        count(Call::Mmap);
        // SAFETY: `s..e` is exactly one placeholder of this reservation; the section is live.
        let v = unsafe {
            (f.map3)(
                sec.raw(),
                process(),
                s as *const c_void,
                file_off,
                e - s,
                MEM_REPLACE_PLACEHOLDER,
                PAGE_EXECUTE_READWRITE,
                null_mut(),
                0,
            )
        };
        if v as usize != s {
            return Err(last_error());
        }
        pieces.insert(s, Piece { end: e, view: Some((sec.clone(), file_off)) });
        Ok(())
    }

    /// Coalesces the placeholders of the gap around each stretch of `a..b` the record leaves
    /// unallocated (`VirtualFree MEM_RELEASE | MEM_COALESCE_PLACEHOLDERS`). Best effort: a gap
    /// with a hole (memory released behind the reservation's back) or a later reservation in it
    /// stays split, which changes nothing but the number of regions.
    fn coalesce(&self, pieces: &BTreeMap<usize, Piece>, a: usize, b: usize) {
        let (lo, hi) = self.mapping();
        for (s, _, seg) in self.segments(pieces, a, b) {
            if !matches!(seg, Seg::Gap) {
                continue;
            }
            let from = pieces.range(..s).next_back().map_or(lo, |(_, p)| p.end.max(lo));
            let to = pieces.range(s..).next().map_or(hi, |(&x, _)| x.min(hi));
            if !self.later_within(from, to).is_empty() {
                continue;
            }
            let (mut at, mut n) = (from, 0);
            while at < to {
                match query(at) {
                    Some(r) if r.State == MEM_RESERVE => {
                        at = r.BaseAddress as usize + r.RegionSize;
                        n += 1;
                    }
                    _ => break,
                }
            }
            if at >= to && n > 1 {
                count(Call::Munmap);
                // SAFETY: `from..to` is a run of this reservation's own placeholders; coalescing
                // changes no page.
                if unsafe { VirtualFree(from as *mut c_void, to - from, MEM_RELEASE | MEM_COALESCE_PLACEHOLDERS) } == 0
                {
                    tracing::debug!("coalescing placeholders {from:#x}..{to:#x}: {}", last_error());
                }
            }
        }
    }

    /// Returns `off..off + len` to reserved in place: private pages decommitted (`VirtualFree
    /// MEM_DECOMMIT`; inaccessible, bytes dropped, a commit again reads zeros), allocations kept.
    /// A view in the range is refused (`ERROR_INVALID_PARAMETER`): the caller checks that it
    /// holds only private pages; [`Reservation::reset`] returns any range to reserved.
    pub fn drop_pages(&self, off: usize, len: usize) -> io::Result<()> {
        let (a, b) = self.span(off, len)?;
        let pieces = self.pieces();
        let segs = self.segments(&pieces, a, b);
        if segs.iter().any(|(_, _, s)| matches!(s, Seg::View(..))) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "drop_pages over a shared view"));
        }
        for (s, e, seg) in segs {
            if let Seg::Private(..) = seg {
                decommit(s, e)?;
            }
        }
        Ok(())
    }

    /// Puts fresh pages with `prot` where nothing is (`MEM_FREE`: memory released behind the
    /// reservation's back): a placeholder (`VirtualAlloc2 MEM_RESERVE_PLACEHOLDER`) then carved
    /// and committed as [`Reservation::protect`] does, or without placeholders a write-watched
    /// `VirtualAlloc(MEM_RESERVE | MEM_WRITE_WATCH)` then committed. The released allocations'
    /// records are dropped. `ERROR_ALREADY_EXISTS` where any page of the range is not free;
    /// `ERROR_INVALID_ADDRESS` where the system will not reserve exactly there (a new allocation
    /// starts on the allocation granularity, a placeholder may not).
    pub fn fill_hole(&self, off: usize, len: usize, prot: RawProt) -> io::Result<()> {
        let (a, b) = self.span(off, len)?;
        let mut at = a;
        while at < b {
            let r = query(at).ok_or_else(einval)?;
            if r.State != MEM_FREE {
                return Err(io::Error::from_raw_os_error(ERROR_ALREADY_EXISTS as i32));
            }
            at = r.BaseAddress as usize + r.RegionSize;
        }
        let mut pieces = self.pieces();
        let gone: Vec<usize> = self.segments(&pieces, a, b).into_iter().filter_map(|(_, _, s)| start_of(&s)).collect();
        for s in gone {
            pieces.remove(&s);
        }
        count(Call::Mmap);
        let p = match fns() {
            Some(f) if self.mode == Mode::Placeholder => {
                let flags = MEM_RESERVE | MEM_RESERVE_PLACEHOLDER;
                // SAFETY: a new placeholder only where nothing is (checked free above).
                unsafe { (f.alloc2)(process(), a as *const c_void, b - a, flags, PAGE_NOACCESS, null_mut(), 0) }
            }
            // SAFETY: a new reservation only where nothing is (checked free above).
            _ => unsafe { VirtualAlloc(a as *const c_void, b - a, MEM_RESERVE | MEM_WRITE_WATCH, PAGE_NOACCESS) },
        };
        if p as usize != a {
            let e = last_error();
            if !p.is_null() {
                // SAFETY: the system placed it elsewhere: this function's own, unused.
                unsafe { VirtualFree(p, 0, MEM_RELEASE) };
            }
            return Err(if p.is_null() { e } else { io::Error::from_raw_os_error(ERROR_INVALID_ADDRESS as i32) });
        }
        if self.mode != Mode::Placeholder {
            pieces.insert(a, Piece { end: b, view: None });
        }
        drop(pieces);
        if prot.none() { Ok(()) } else { self.protect(off, len, prot) }
    }

    /// Maps `len` bytes of `section` from `file_off` at `off` as one view (`MapViewOfFile3
    /// MEM_REPLACE_PLACEHOLDER`, then `VirtualProtect` to `prot`), replacing what was there:
    /// private allocations and views in the range become placeholders first (as
    /// [`Reservation::reset`]), and the range one placeholder. A private allocation the range cuts
    /// can become a placeholder only where its pages outside the range hold nothing (Windows
    /// cannot shrink an allocation): [`io::ErrorKind::Unsupported`] otherwise, and nothing is
    /// changed. Without placeholders (Wine 8, Windows before 1803): [`io::ErrorKind::Unsupported`].
    pub fn map_shared(
        &self,
        off: usize,
        len: usize,
        section: &Section,
        file_off: u64,
        prot: RawProt,
    ) -> io::Result<()> {
        let (a, b) = self.span(off, len)?;
        if self.mode != Mode::Placeholder {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "shared views need placeholders (VirtualAlloc2 MEM_RESERVE_PLACEHOLDER: Windows 10 1803+, Wine 10) \
                 in a reservation emuhost made (not an adopted one)",
            ));
        }
        let mut pieces = self.pieces();
        let segs = self.segments(&pieces, a, b);
        for (s, e, seg) in &segs {
            if let Seg::Private(x, y) = *seg
                && (x, y) != (*s, *e)
                && (committed_in(x, *s) || committed_in(*e, y))
            {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "a view over {a:#x}..{b:#x} cuts private allocation {x:#x}..{y:#x} whose pages outside it are committed"
                    ),
                ));
            }
        }
        for (s, e, seg) in segs {
            match seg {
                Seg::Gap => {}
                Seg::Private(x, y) => {
                    release_to_placeholder(x, y)?;
                    pieces.remove(&x);
                }
                Seg::View(x, y, sec, fo) => self.cut_view(&mut pieces, (x, y), (s, e), &sec, fo)?,
            }
        }
        self.view(&mut pieces, a, b, section, file_off)?;
        if prot.page() != PAGE_EXECUTE_READWRITE {
            virtual_protect(a, b, prot)?;
        }
        Ok(())
    }
}

/// The start of a recorded piece a segment lies in.
fn start_of(s: &Seg) -> Option<usize> {
    match s {
        Seg::Gap => None,
        Seg::Private(x, _) | Seg::View(x, _, _, _) => Some(*x),
    }
}

/// Whether any page of `a..b` is committed.
fn committed_in(a: usize, b: usize) -> bool {
    let mut at = a;
    while at < b {
        match query(at) {
            Some(r) if r.State == MEM_COMMIT => return true,
            Some(r) => at = r.BaseAddress as usize + r.RegionSize,
            None => return false,
        }
    }
    false
}

/// Makes the placeholder pages `a..b` exactly one placeholder: splits the placeholders that run
/// past either end (`VirtualFree MEM_RELEASE | MEM_PRESERVE_PLACEHOLDER`) and coalesces those
/// inside (`MEM_COALESCE_PLACEHOLDERS`). `ERROR_INVALID_ADDRESS` where a page is not a
/// placeholder (released behind the reservation's back).
fn exact_placeholder(a: usize, b: usize) -> io::Result<()> {
    let mut n = 0;
    let mut at = a;
    while at < b {
        let r = query(at).ok_or_else(einval)?;
        if r.State != MEM_RESERVE {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "{at:#x} is not a placeholder (released behind the reservation's back?): error {ERROR_INVALID_ADDRESS}"
                ),
            ));
        }
        let (s, e) = (r.AllocationBase as usize, r.BaseAddress as usize + r.RegionSize);
        if s < a || e > b {
            let (x, y) = (s.max(a), e.min(b));
            count(Call::Munmap);
            // SAFETY: `x..y` lies inside one of this reservation's placeholders; a split changes
            // no page.
            if unsafe { VirtualFree(x as *mut c_void, y - x, MEM_RELEASE | MEM_PRESERVE_PLACEHOLDER) } == 0 {
                return Err(last_error());
            }
        }
        n += 1;
        at = e.min(b);
    }
    if n > 1 {
        count(Call::Munmap);
        // SAFETY: `a..b` is a run of whole placeholders of this reservation (just split so).
        if unsafe { VirtualFree(a as *mut c_void, b - a, MEM_RELEASE | MEM_COALESCE_PLACEHOLDERS) } == 0 {
            return Err(last_error());
        }
    }
    Ok(())
}

/// Turns the private allocation `x..y` back into a placeholder, its pages dropped.
fn release_to_placeholder(x: usize, y: usize) -> io::Result<()> {
    count(Call::Munmap);
    // SAFETY: `x..y` is a whole private allocation this reservation made and recorded.
    if unsafe { VirtualFree(x as *mut c_void, y - x, MEM_RELEASE | MEM_PRESERVE_PLACEHOLDER) } == 0 {
        return Err(last_error());
    }
    Ok(())
}

/// Commits `s..e` (inside one allocation) with `prot`; committed pages keep their bytes.
fn commit(s: usize, e: usize, prot: RawProt) -> io::Result<()> {
    count(Call::Mmap);
    // SAFETY: `s..e` lies inside one allocation of the reservation; a commit keeps the bytes of
    // committed pages and no Rust reference points into guest memory.
    if unsafe { VirtualAlloc(s as *const c_void, e - s, MEM_COMMIT, prot.page()) }.is_null() {
        return Err(last_error());
    }
    Ok(())
}

/// Decommits `s..e` (inside one allocation): reserved, bytes dropped.
fn decommit(s: usize, e: usize) -> io::Result<()> {
    count(Call::Madvise);
    // SAFETY: `s..e` lies inside one private allocation of the reservation; no Rust reference
    // points into guest memory.
    if unsafe { VirtualFree(s as *mut c_void, e - s, MEM_DECOMMIT) } == 0 {
        return Err(last_error());
    }
    Ok(())
}

/// `VirtualProtect` of `s..e` (committed pages of one allocation or view).
fn virtual_protect(s: usize, e: usize, prot: RawProt) -> io::Result<()> {
    let mut old = 0;
    count(Call::Mprotect);
    // SAFETY: `s..e` lies inside one allocation or view of the reservation; bytes are kept.
    if unsafe { VirtualProtect(s as *const c_void, e - s, prot.page(), &mut old) } == 0 {
        return Err(last_error());
    }
    Ok(())
}

impl Reservation {
    /// Would fault every page of `off..off + len` in, writable, ahead of use: always `Ok(false)`
    /// after checking the range (the caller touches the pages instead). `PrefetchVirtualMemory`
    /// reads pages in without checking that they are writable, so it cannot answer as
    /// `MADV_POPULATE_WRITE` does.
    pub fn populate_write(&self, off: usize, len: usize) -> io::Result<bool> {
        self.span(off, len)?;
        Ok(false)
    }

    /// Faults every page of `off..off + len` in, writable, by touching one byte of each: an
    /// atomic read, then an atomic compare-and-swap of the same value (a write access that
    /// changes no byte, whatever other threads store meanwhile; write watch reports the page).
    ///
    /// # Safety
    /// Every page of the range must be committed writable for the whole call (or the process
    /// dies of the access violation), and no Rust reference may point into it.
    pub unsafe fn touch_write(&self, off: usize, len: usize) -> io::Result<()> {
        let (a, b) = self.span(off, len)?;
        // SAFETY: the range is `span`-checked inside the window; writable and referenced by
        // nothing by the caller's contract.
        unsafe { crate::sys::cpu::touch_write(a, b, page_size()) };
        Ok(())
    }

    /// Copies `data` into the window at `off` (any alignment). Fails with `ERROR_NOACCESS`, never
    /// faults, where a page is not writable.
    pub fn write(&self, off: usize, data: &[u8]) -> io::Result<()> {
        self.write_claiming(off, data, |_| false)
    }

    /// [`Reservation::write`] that, where a page refuses the write, asks `claim` with the host
    /// address the copy stopped at (the first byte of `data` in the first refusing page) whether it can be made writable now (a write tracker's armed page), and
    /// goes on from there if so. Fails with `ERROR_NOACCESS` where `claim` says no: the bytes
    /// before that page are written, none after. Never faults.
    pub fn write_claiming(&self, off: usize, data: &[u8], mut claim: impl FnMut(usize) -> bool) -> io::Result<()> {
        let end = off.checked_add(data.len()).ok_or_else(einval)?;
        if end > self.len {
            return Err(einval());
        }
        let at = self.base + off;
        let mut done = 0;
        while done < data.len() {
            // SAFETY: `data[done..]` is a live slice (only read); the remote range lies inside
            // the window, which no Rust reference points into.
            done += unsafe { cpu_copy(data[done..].as_ptr().cast_mut(), at + done, data.len() - done, true) };
            if done < data.len() && !claim(at + done) {
                return Err(noaccess());
            }
        }
        Ok(())
    }

    /// Stores `data` at `off` with the CPU, as guest code would, one atomic byte store at a time.
    /// A page the protection forbids raises an access violation, unlike [`Reservation::write`].
    ///
    /// # Safety
    /// Every page of the bytes must be writable for the whole call, or armed by a write tracker
    /// whose exception handler makes it writable; otherwise the process dies of the fault. No
    /// Rust reference may point into the bytes.
    pub unsafe fn store(&self, off: usize, data: &[u8]) -> io::Result<()> {
        let end = off.checked_add(data.len()).ok_or_else(einval)?;
        if end > self.len {
            return Err(einval());
        }
        // SAFETY: the bytes lie inside the window (checked above); no Rust reference points into
        // them, and they are writable (or their fault handled) by the caller's contract.
        unsafe { crate::sys::cpu::store(self.base + off, data) };
        Ok(())
    }

    /// Copies the runs `runs` (`(offset, len)` in the window, in any order) one after the other
    /// into `bufs`, filled in turn (their lengths add up to the runs'): one [`Reservation::read`]
    /// per piece. Fails, never faults, where a page is not readable: the error names the run that
    /// refused and the bytes of it copied before at least (every earlier run was copied whole).
    /// `EINVAL` (nothing copied) for a run outside the window or lengths that do not add up.
    pub fn read_runs(&self, runs: &[(usize, usize)], bufs: &mut [&mut [u8]], _cpu: bool) -> Result<(), RunsError> {
        RunsError::check(self.len, runs, bufs.iter().map(|b| b.len()), einval)?;
        let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let start = |run: usize| self.base + runs[run].0;
        RunsError::walk(runs, &lens, noaccess, |run, done, b, at, n| {
            let piece = &mut bufs[b][at..at + n];
            // SAFETY: `piece` is a live slice borrowed mutably for the call; the run was checked
            // to lie inside the window, and a read changes none of it.
            unsafe { cpu_copy(piece.as_mut_ptr(), start(run) + done, n, false) }
        })
    }

    /// [`Reservation::read_runs`] the other way: copies `data`, taken in turn, into the runs one
    /// after the other, one [`Reservation::write`] per piece; the error names the run that
    /// refused and the bytes of it written before at least.
    pub fn write_runs(&self, runs: &[(usize, usize)], data: &[&[u8]], _cpu: bool) -> Result<(), RunsError> {
        RunsError::check(self.len, runs, data.iter().map(|b| b.len()), einval)?;
        let lens: Vec<usize> = data.iter().map(|b| b.len()).collect();
        let start = |run: usize| self.base + runs[run].0;
        RunsError::walk(runs, &lens, noaccess, |run, done, b, at, n| {
            let piece = &data[b][at..at + n];
            // SAFETY: `piece` is a live slice, only read from; the run was checked to lie inside
            // the window, guest memory no Rust reference points into.
            unsafe { cpu_copy(piece.as_ptr().cast_mut(), start(run) + done, n, true) }
        })
    }

    /// Copies bytes out of the window at `off` into `buf`. Fails with `ERROR_NOACCESS` where a
    /// page is not readable.
    pub fn read(&self, off: usize, buf: &mut [u8]) -> io::Result<()> {
        let end = off.checked_add(buf.len()).ok_or_else(einval)?;
        if end > self.len {
            return Err(einval());
        }
        read_host(self.base + off, buf)
    }

    /// Writes zeros over `off..off + len` in place (the pages stay committed). Fails with
    /// `ERROR_NOACCESS` where a page is not writable.
    pub fn zero(&self, off: usize, len: usize) -> io::Result<()> {
        let (a, b) = self.span(off, len)?;
        static ZEROS: [u8; 1 << 16] = [0; 1 << 16];
        let mut at = a;
        while at < b {
            let n = (b - at).min(ZEROS.len());
            // SAFETY: the local buffer is static and only read; the remote range lies inside the
            // `span`-checked range, which no Rust reference points into.
            if unsafe { cpu_copy(ZEROS.as_ptr().cast_mut(), at, n, true) } != n {
                return Err(noaccess());
            }
            at += n;
        }
        Ok(())
    }
}

/// Copies `len` bytes between `local` and host address `remote` of this process (`write`: into
/// `remote`) with the CPU, through [`guarded::copy`]: a page the protection forbids (or that is
/// not committed) stops the copy instead of faulting, and no protection is changed. Returns the
/// bytes copied, all of them unless a page refused (then the first byte not copied lies in it).
///
/// # Safety
/// `local` must point to `len` bytes valid for the copy's direction (only read for a write).
/// For a write, `remote..+len` must be memory no Rust reference points into.
unsafe fn cpu_copy(local: *mut u8, remote: usize, len: usize, write: bool) -> usize {
    if len == 0 {
        return 0;
    }
    count(Call::Copy);
    let (dst, src) = if write { (remote as *mut u8, local.cast_const()) } else { (local, remote as *const u8) };
    // SAFETY: the caller's contract covers both ranges; a fault on `remote` is caught.
    unsafe { guarded::copy(dst, src, len) }
}

/// A copy that survives a fault on either side: `rep movsb` in a naked function, and a vectored
/// exception handler (registered once, first in the list) that moves an access violation at that
/// very instruction past it, so the copy returns what it had left (`rcx`: `rep movsb` stops at the
/// exact byte that faulted). Neither `NtWriteVirtualMemory` nor `NtReadVirtualMemory` serves: under
/// Wine (8.0 measured) they go through `/proc/PID/mem` and ignore protection (a write to a
/// `PAGE_READONLY` page succeeds, a read of a decommitted page too), and kernel32's
/// `WriteProcessMemory` makes a page writable for the copy, which a write tracker would miss.
mod guarded {
    use std::sync::OnceLock;

    use windows_sys::Win32::Foundation::EXCEPTION_ACCESS_VIOLATION;
    use windows_sys::Win32::System::Diagnostics::Debug::{
        AddVectoredExceptionHandler, EXCEPTION_CONTINUE_EXECUTION, EXCEPTION_POINTERS,
    };

    const EXCEPTION_CONTINUE_SEARCH: i32 = 0;

    /// `copy_bytes(dst, src, len, 0)` copies and returns the bytes left (0: all copied);
    /// `copy_bytes(_, _, _, 1)` returns the address of its `rep movsb`, the one instruction the
    /// handler resumes past.
    ///
    /// # Safety
    /// As [`copy`]'s; with `site` set nothing is read or written.
    #[unsafe(naked)]
    unsafe extern "win64" fn copy_bytes(dst: *mut u8, src: *const u8, len: usize, site: usize) -> usize {
        core::arch::naked_asm!(
            "test r9, r9",
            "jnz 3f",
            "push rdi",
            "push rsi",
            "mov rdi, rcx",
            "mov rsi, rdx",
            "mov rcx, r8",
            "2:",
            "rep movsb",
            "mov rax, rcx",
            "pop rsi",
            "pop rdi",
            "ret",
            "3:",
            "lea rax, [rip + 2b]",
            "ret",
        )
    }

    /// The address of `copy_bytes`'s `rep movsb`, with the handler registered (`None` where the
    /// system refused the handler: then nothing may be copied).
    fn site() -> Option<usize> {
        static SITE: OnceLock<Option<usize>> = OnceLock::new();
        *SITE.get_or_init(|| {
            // SAFETY: with `site` set the function only returns an address; nothing is copied.
            let at = unsafe { copy_bytes(std::ptr::null_mut(), std::ptr::null(), 0, 1) };
            let _ = SITE_ADDR.set(at);
            // SAFETY: `handler` is a valid vectored handler for the life of the process (never
            // removed); 1 puts it first.
            let h = unsafe { AddVectoredExceptionHandler(1, Some(handler)) };
            (!h.is_null()).then_some(at)
        })
    }

    static SITE_ADDR: OnceLock<usize> = OnceLock::new();

    /// Resumes an access violation at `copy_bytes`'s `rep movsb` after it (2 bytes: `f3 a4`);
    /// passes every other exception on.
    ///
    /// # Safety
    /// Called by the system only, with valid exception pointers.
    unsafe extern "system" fn handler(info: *mut EXCEPTION_POINTERS) -> i32 {
        let Some(&at) = SITE_ADDR.get() else { return EXCEPTION_CONTINUE_SEARCH };
        // SAFETY: the system passes valid exception and context records, this thread's own.
        let (rec, ctx) = unsafe { (&*(*info).ExceptionRecord, &mut *(*info).ContextRecord) };
        if rec.ExceptionCode != EXCEPTION_ACCESS_VIOLATION || ctx.Rip as usize != at {
            return EXCEPTION_CONTINUE_SEARCH;
        }
        ctx.Rip += 2;
        EXCEPTION_CONTINUE_EXECUTION
    }

    /// Copies `len` bytes from `src` to `dst`; returns the bytes copied (fewer where a page
    /// refused: the next byte of `dst` or `src` lies in it). Copies nothing where the handler
    /// could not be registered.
    ///
    /// # Safety
    /// Both ranges must be memory no Rust reference conflicts with (guest memory or the caller's
    /// own buffer); a fault in either is caught, anything else (a write into Rust-owned memory
    /// outside the caller's buffer) is not.
    pub(super) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) -> usize {
        if site().is_none() {
            return 0;
        }
        // SAFETY: the caller's contract; a fault at the copy instruction returns early.
        len - unsafe { copy_bytes(dst, src, len, 0) }
    }
}

/// Reads bytes at any host address of this process into `buf`: `ERROR_NOACCESS`, never a fault,
/// where a page is not readable or not committed.
pub fn read_host(remote: usize, buf: &mut [u8]) -> io::Result<()> {
    let n = buf.len();
    // SAFETY: `buf` is a live, writable slice of its length, and a read changes no remote memory.
    if unsafe { cpu_copy(buf.as_mut_ptr(), remote, n, false) } == n { Ok(()) } else { Err(noaccess()) }
}

impl Reservation {
    /// Releases the host ranges `parts` (each inside the mapping, page-aligned): every allocation,
    /// view and placeholder that starts in a part, and nothing on drop.
    pub fn unmap_parts(&self, parts: &[(usize, usize)]) {
        let (lo, hi) = self.mapping();
        self.unmapped.store(true, Relaxed);
        for &(s, e) in parts {
            if s < lo || e > hi || s >= e {
                continue;
            }
            // SAFETY: the part lies inside this reservation's mapping and the caller found it
            // the reservation's own; the reservation is being dropped, nothing uses it after.
            unsafe { release_allocations(s, e) };
        }
        self.pieces().clear();
    }
}

impl Drop for Reservation {
    /// A reservation it made is released, guards too, but for what reservations made later hold
    /// (in holes of it) and what the space found not its own ([`Reservation::unmap_parts`]); an
    /// adopted one is the caller's.
    fn drop(&mut self) {
        if self.mode != Mode::Adopted && !self.unmapped.load(Relaxed) {
            let (mut at, end) = self.mapping();
            let mut parts = Vec::new();
            for (s, e) in self.later_within(at, end) {
                parts.push((at, s.max(at)));
                at = at.max(e);
            }
            parts.push((at, end));
            parts.retain(|(s, e)| s < e);
            self.unmap_parts(&parts);
        }
        crate::sys::live::remove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RW: RawProt = RawProt { read: true, write: true, exec: false };
    const R: RawProt = RawProt { read: true, write: false, exec: false };
    const NONE: RawProt = RawProt { read: false, write: false, exec: false };
    const K: usize = 1024;

    /// Skips a placeholder test where this Wine or Windows has none, saying so on stderr past
    /// libtest's capture (which hides a passing test's `println!`).
    fn need_placeholders(test: &str) -> bool {
        match placeholders() {
            Ok(()) => true,
            Err(e) => {
                skipped(test, &e.to_string());
                false
            }
        }
    }

    fn skipped(test: &str, why: &str) {
        use std::io::Write;
        let _ = writeln!(io::stderr(), "SKIPPED {test}: {why}");
    }

    fn info(addr: usize) -> MEMORY_BASIC_INFORMATION {
        query(addr).expect("VirtualQuery")
    }

    #[test]
    fn shared_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Reservation>();
        send_sync::<Section>();
    }

    #[test]
    fn commit_decommit_recommit_reads_zeros() {
        let r = Reservation::new(1 << 20, 64 * K).unwrap();
        for decommit in [Reservation::drop_pages, Reservation::reset] {
            r.protect(64 * K, 64 * K, RW).unwrap();
            r.write(64 * K + 10, &[1, 2, 3]).unwrap();
            let mut b = [0u8; 3];
            r.read(64 * K + 10, &mut b).unwrap();
            assert_eq!(b, [1, 2, 3]);
            decommit(&r, 64 * K, 64 * K).unwrap();
            assert_eq!(info(r.base() + 64 * K).State, MEM_RESERVE);
            assert!(r.read(64 * K + 10, &mut b).is_err(), "decommitted page must not read");
            r.protect(64 * K, 64 * K, RW).unwrap();
            r.read(64 * K + 10, &mut b).unwrap();
            assert_eq!(b, [0, 0, 0], "a recommitted page reads zeros");
            r.reset(0, 1 << 20).unwrap();
        }
    }

    #[test]
    fn write_to_read_only_fails_without_fault_and_keeps_protection() {
        let r = Reservation::new(256 * K, 0).unwrap();
        r.protect(0, 8 * K, RW).unwrap();
        r.write(100, &[7; 8]).unwrap();
        r.protect(0, 8 * K, R).unwrap();
        let e = r.write(100, &[9; 8]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(ERROR_NOACCESS as i32));
        assert_eq!(info(r.base()).Protect, PAGE_READONLY, "the failed write changed the protection");
        let mut b = [0u8; 8];
        r.read(100, &mut b).unwrap();
        assert_eq!(b, [7; 8]);
        // A protection change over committed pages keeps their bytes.
        r.protect(0, 8 * K, NONE).unwrap();
        assert!(r.read(100, &mut b).is_err());
        r.protect(0, 8 * K, RW).unwrap();
        r.read(100, &mut b).unwrap();
        assert_eq!(b, [7; 8]);
        assert!(r.zero(0, 8 * K).is_ok());
        r.read(100, &mut b).unwrap();
        assert_eq!(b, [0; 8]);
        // read_host on a reserved page: an error, no fault.
        assert!(read_host(r.base() + 64 * K, &mut b).is_err());
    }

    #[test]
    fn write_claiming_asks_at_the_first_refusing_page() {
        let page = page_size();
        let r = Reservation::new(256 * K, 0).unwrap();
        r.protect(0, 4 * page, RW).unwrap();
        r.protect(2 * page, page, R).unwrap();
        let data = vec![0xAB; 2 * page];
        let mut asked = Vec::new();
        let e = r
            .write_claiming(page + 100, &data, |a| {
                asked.push(a);
                false
            })
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(ERROR_NOACCESS as i32));
        assert_eq!(asked, [r.base() + 2 * page]);
        let mut b = [0u8; 1];
        r.read(2 * page - 1, &mut b).unwrap();
        assert_eq!(b, [0xAB], "bytes before the refusing page are written");
        r.read(2 * page, &mut b).unwrap();
        assert_eq!(b, [0], "none on the refusing page");
        // A claim that makes the page writable lets the write go on.
        let mut asked = Vec::new();
        r.write_claiming(page + 100, &data, |a| {
            asked.push(a);
            r.protect(a - r.base(), page, RW).is_ok()
        })
        .unwrap();
        assert_eq!(asked, [r.base() + 2 * page]);
        r.read(3 * page + 99, &mut b).unwrap();
        assert_eq!(b, [0xAB]);
    }

    #[test]
    fn copies_race_protection_changes_without_faulting() {
        let page = page_size();
        let r = Reservation::new(256 * K, 0).unwrap();
        r.protect(0, 2 * page, RW).unwrap();
        let (mut ok, mut refused) = (0, 0);
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..2000 {
                    r.protect(page, page, if i % 2 == 0 { NONE } else { RW }).unwrap();
                }
                r.protect(page, page, RW).unwrap();
            });
            for _ in 0..2000 {
                match r.write(page - 8, &[1; 16]) {
                    Ok(()) => ok += 1,
                    Err(e) => {
                        assert_eq!(e.raw_os_error(), Some(ERROR_NOACCESS as i32));
                        refused += 1;
                    }
                }
            }
        });
        assert_eq!(ok + refused, 2000);
        r.write(page - 8, &[2; 16]).unwrap();
    }

    #[test]
    fn out_of_range_and_unaligned_are_invalid() {
        let page = page_size();
        let r = Reservation::new(64 * K, 0).unwrap();
        let inval = Some(ERROR_INVALID_PARAMETER as i32);
        assert_eq!(r.protect(64 * K, page, RW).unwrap_err().raw_os_error(), inval);
        assert_eq!(r.protect(1, page, RW).unwrap_err().raw_os_error(), inval);
        assert_eq!(r.protect(0, 0, RW).unwrap_err().raw_os_error(), inval);
        assert_eq!(r.reset(usize::MAX - page + 1, page).unwrap_err().raw_os_error(), inval);
        assert_eq!(r.write(64 * K - 1, &[1, 2]).unwrap_err().raw_os_error(), inval);
        assert_eq!(r.read(usize::MAX, &mut [0]).unwrap_err().raw_os_error(), inval);
        assert_eq!(r.zero(0, 128 * K).unwrap_err().raw_os_error(), inval);
        assert_eq!(r.fill_hole(0, 128 * K, RW).unwrap_err().raw_os_error(), inval);
        assert_eq!(Reservation::new(100, 0).unwrap_err().raw_os_error(), inval);
        assert_eq!(Reservation::at(r.base() + page, 64 * K, 0).unwrap_err().raw_os_error(), inval);
        // Where something is: refused, nothing replaced.
        let e = Reservation::at(r.base(), 64 * K, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(ERROR_ALREADY_EXISTS as i32), "{e}");
    }

    #[test]
    fn released_behind_the_back_is_an_error_then_fill_hole_refills() {
        let r = Reservation::new(1 << 20, 0).unwrap();
        r.protect(128 * K, 64 * K, RW).unwrap();
        r.write(128 * K, &[5]).unwrap();
        // What to release: the recorded allocation over it (the whole mapping without placeholders).
        let mut allocs = Vec::new();
        r.private_allocations(r.base() + 128 * K, r.base() + 192 * K, |s, e| allocs.push((s, e)));
        assert_eq!(allocs.len(), 1);
        let (s, e) = allocs[0];
        // SAFETY: the test's own reservation; released on purpose, as foreign code might.
        assert_ne!(unsafe { VirtualFree(s as *mut c_void, 0, MEM_RELEASE) }, 0);
        let (o, n) = (s - r.base(), e - s);
        assert!(r.protect(o, n, RW).is_err());
        assert!(r.write(128 * K, &[1]).is_err());
        assert!(r.read(128 * K, &mut [0]).is_err());
        assert!(r.zero(128 * K, 4 * K).is_err());
        assert!(r.reset(o, n).is_err() || placeholders().is_err());
        r.fill_hole(o, n, RW).unwrap();
        let mut b = [9u8];
        r.read(128 * K, &mut b).unwrap();
        assert_eq!(b, [0], "refilled pages read zeros");
        r.write(128 * K, &[3]).unwrap();
        let e = r.fill_hole(o, n, RW).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(ERROR_ALREADY_EXISTS as i32));
    }

    #[test]
    fn without_placeholders_map_shared_is_unsupported() {
        if placeholders().is_ok() {
            skipped("without_placeholders_map_shared_is_unsupported", "placeholders work here");
            return;
        }
        let r = Reservation::new(256 * K, 0).unwrap();
        let s = Section::new("t", 64 * K as u64).unwrap();
        let e = r.map_shared(0, 64 * K, &s, 0, RW).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported);
        assert!(e.to_string().contains("placeholder"), "{e}");
    }

    #[test]
    fn placeholder_section_mapped_twice_aliases() {
        if !need_placeholders("placeholder_section_mapped_twice_aliases") {
            return;
        }
        let page = page_size();
        let r = Reservation::new(1 << 20, 64 * K).unwrap();
        let s = Section::new("t", 64 * K as u64).unwrap();
        r.map_shared(0, 64 * K, &s, 0, RW).unwrap();
        // The second view of the section's second page lands at 16 KiB past a granule.
        r.map_shared(256 * K + 16 * K, page, &s, page as u64, RW).unwrap();
        assert_eq!(info(r.base() + 256 * K + 16 * K).AllocationBase as usize, r.base() + 256 * K + 16 * K);
        assert_eq!(info(r.base() + 256 * K + 12 * K).State, MEM_RESERVE);
        r.write(page + 8, &[0x11, 0x22]).unwrap();
        let mut b = [0u8; 2];
        r.read(256 * K + 16 * K + 8, &mut b).unwrap();
        assert_eq!(b, [0x11, 0x22]);
        r.write(256 * K + 16 * K, &[0x33]).unwrap();
        r.read(page, &mut b[..1]).unwrap();
        assert_eq!(b[0], 0x33);
        // A view protected read-only refuses a write; its bytes stay.
        r.protect(0, page, R).unwrap();
        assert!(r.write(0, &[1]).is_err());
        // A reset cutting the first view keeps the rest of it mapped, bytes and protection.
        r.reset(2 * page, page).unwrap();
        r.read(page, &mut b[..1]).unwrap();
        assert_eq!(b[0], 0x33);
        assert_eq!(info(r.base()).Protect, PAGE_READONLY);
        assert_eq!(info(r.base() + 2 * page).State, MEM_RESERVE);
        // Replacing a view with private pages: reset, then commit.
        r.reset(0, 64 * K).unwrap();
        r.protect(0, 64 * K, RW).unwrap();
        r.read(page, &mut b[..1]).unwrap();
        assert_eq!(b[0], 0);
    }

    #[test]
    fn placeholder_commit_at_16k_lands_exactly() {
        if !need_placeholders("placeholder_commit_at_16k_lands_exactly") {
            return;
        }
        let r = Reservation::new(1 << 20, 0).unwrap();
        let base = r.base();
        r.protect(16 * K, 4 * K, RW).unwrap();
        let m = info(base + 16 * K);
        assert_eq!((m.AllocationBase as usize, m.RegionSize, m.State), (base + 16 * K, 4 * K, MEM_COMMIT));
        assert_eq!(info(base + 12 * K).State, MEM_RESERVE);
        assert_eq!(info(base + 20 * K).State, MEM_RESERVE);
        let mut n = 0;
        r.private_allocations(base, base + (1 << 20), |s, e| {
            assert_eq!((s, e), (base + 16 * K, base + 20 * K));
            n += 1;
        });
        assert_eq!(n, 1);
        // A commit over it and its neighbours: one more allocation on each side; the bytes stay.
        r.write(16 * K, &[4]).unwrap();
        r.protect(8 * K, 24 * K, RW).unwrap();
        let mut b = [0u8];
        r.read(16 * K, &mut b).unwrap();
        assert_eq!(b, [4]);
        let mut v = Vec::new();
        r.private_allocations(base, base + (1 << 20), |s, e| v.push((s - base, e - base)));
        assert_eq!(v, [(8 * K, 16 * K), (16 * K, 20 * K), (20 * K, 32 * K)]);
    }

    #[test]
    fn placeholder_reset_coalesces() {
        if !need_placeholders("placeholder_reset_coalesces") {
            return;
        }
        let r = Reservation::new(1 << 20, 64 * K).unwrap();
        let (lo, hi) = r.mapping();
        r.protect(16 * K, 16 * K, RW).unwrap();
        r.protect(128 * K, 64 * K, RW).unwrap();
        r.protect(512 * K + 4 * K, 4 * K, RW).unwrap();
        r.protect(128 * K + 4 * K, 4 * K, R).unwrap();
        r.reset(0, 1 << 20).unwrap();
        let m = info(lo);
        assert_eq!(
            (m.AllocationBase as usize, m.RegionSize, m.State),
            (lo, hi - lo, MEM_RESERVE),
            "one placeholder again"
        );
        let mut n = 0;
        r.private_allocations(lo, hi, |_, _| n += 1);
        assert_eq!(n, 0);
        // Part of an allocation reset: decommitted in place, the rest keeps its bytes.
        r.protect(0, 64 * K, RW).unwrap();
        r.write(60 * K, &[8]).unwrap();
        r.reset(0, 32 * K).unwrap();
        assert_eq!(info(r.base()).State, MEM_RESERVE);
        let mut b = [0u8];
        r.read(60 * K, &mut b).unwrap();
        assert_eq!(b, [8]);
    }

    #[test]
    fn placeholder_view_over_part_of_a_private_allocation() {
        if !need_placeholders("placeholder_view_over_part_of_a_private_allocation") {
            return;
        }
        let r = Reservation::new(1 << 20, 0).unwrap();
        let s = Section::new("t", 64 * K as u64).unwrap();
        r.protect(0, 64 * K, RW).unwrap();
        r.write(0, &[6]).unwrap();
        // Committed pages outside the view: Windows cannot shrink the allocation; nothing changes.
        let e = r.map_shared(16 * K, 16 * K, &s, 0, RW).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{e}");
        let mut b = [0u8];
        r.read(0, &mut b).unwrap();
        assert_eq!(b, [6]);
        r.read(16 * K, &mut b).unwrap();
        // Nothing committed outside: the allocation becomes placeholders and the view lands exactly.
        r.reset(0, 16 * K).unwrap();
        r.reset(32 * K, 32 * K).unwrap();
        r.map_shared(16 * K, 16 * K, &s, 0, RW).unwrap();
        let m = info(r.base() + 16 * K);
        assert_eq!((m.AllocationBase as usize, m.RegionSize, m.Type), (r.base() + 16 * K, 16 * K, MEM_MAPPED));
        let mut n = 0;
        r.private_allocations(r.base(), r.base() + (1 << 20), |_, _| n += 1);
        assert_eq!(n, 0, "views are never private allocations");
    }

    #[test]
    fn drop_gives_back_the_mapping() {
        let r = Reservation::new(1 << 20, 64 * K).unwrap();
        let (lo, _) = r.mapping();
        r.protect(0, 64 * K, RW).unwrap();
        drop(r);
        assert_eq!(info(lo).State, MEM_FREE);
        let r = Reservation::new(1 << 20, 64 * K).unwrap();
        // SAFETY: adopts the window of a reservation that outlives it and is otherwise unused.
        let a = unsafe { Reservation::adopt(r.base(), r.len()) }.unwrap();
        drop(a);
        assert_ne!(info(r.base()).State, MEM_FREE, "an adopted window is the caller's");
    }
}
