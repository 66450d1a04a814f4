//! How a space is made: its configuration and placement, and the checks that reserve or adopt its
//! window.

use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Condvar, Mutex, RwLock};

use super::record::{Record, not_a_reservation};
use super::{Prot, Space, SpaceError, State, page_size};
use crate::sys::{mm::Reservation, query::Maps};

/// The default guest window: 512 GiB.
pub const DEFAULT_WINDOW: u64 = 512 << 30;

/// Where the guest window is reserved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Placement {
    /// Where the kernel chooses.
    #[default]
    Anywhere,
    /// At this host address (page-aligned), never replacing a mapping: where anything is mapped
    /// in the range (guard pages included) the build fails naming it ([`SpaceError::ReserveAt`]).
    At(usize),
}

/// How a space is made.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SpaceConfig {
    /// Bytes of guest address space to reserve (a multiple of the page size).
    pub window: u64,
    /// Where the window is reserved.
    pub placement: Placement,
    /// Bytes of guard pages (a multiple of the page size) reserved `PROT_NONE` below and above
    /// the window: nothing else can be mapped there, and a run off either end of the window
    /// faults. The space never commits them; they are unmapped with the window.
    pub guard: u64,
    /// Commit in one system call, walking region by region only where it fails. Set only by
    /// [`SpaceConfig::one_call_commit`] (feature `bench`).
    one_call_commit: bool,
    /// Answer region queries from the text of `/proc/self/maps`. Set only by
    /// [`SpaceConfig::maps_text`] (feature `bench`).
    maps_text: bool,
}

impl Default for SpaceConfig {
    fn default() -> Self {
        Self {
            window: DEFAULT_WINDOW,
            placement: Placement::Anywhere,
            guard: 0,
            one_call_commit: true,
            maps_text: false,
        }
    }
}

impl SpaceConfig {
    /// Bytes of guest address space to reserve: a non-zero multiple of [`page_size`]
    /// ([`DEFAULT_WINDOW`] unless set).
    pub fn window(mut self, bytes: u64) -> Self {
        self.window = bytes;
        self
    }

    /// Reserves the window at host address `base` ([`Placement::At`]).
    pub fn at(mut self, base: usize) -> Self {
        self.placement = Placement::At(base);
        self
    }

    /// Bytes of guard pages below and above the window (a multiple of [`page_size`]; 0, the
    /// default, for none): see [`SpaceConfig::guard`](SpaceConfig#structfield.guard).
    pub fn guard(mut self, bytes: u64) -> Self {
        self.guard = bytes;
        self
    }

    /// Commit in one system call, walking region by region only where it fails (the default).
    /// `false` always walks (the old way; kept to measure against). Feature `bench`.
    #[cfg(feature = "bench")]
    pub fn one_call_commit(mut self, on: bool) -> Self {
        self.one_call_commit = on;
        self
    }

    /// Answer region queries from the text of `/proc/self/maps` even where `PROCMAP_QUERY` works
    /// (to measure one against the other; the fault switch `EMUHOST_FAULT_NO_PROCMAP_QUERY` does
    /// the same for every space). Feature `bench`.
    #[cfg(feature = "bench")]
    pub fn maps_text(mut self, on: bool) -> Self {
        self.maps_text = on;
        self
    }

    /// Reserves the space ([`Space::new`]).
    ///
    /// # Errors
    /// As [`Space::new`].
    pub fn build(self) -> Result<Space, SpaceError> {
        Space::new(self)
    }

    /// Makes a space whose window is the caller's reservation `base..base + len` (host address,
    /// page-aligned), instead of reserving one: `window`, `placement` and `guard` are not used
    /// (asking for a placement or guards is an error: the caller's reservation is where it is,
    /// and its guards are the caller's to make). The range must be mapped entirely, `PROT_NONE`,
    /// private and anonymous, as a reservation is (`MAP_NORESERVE` keeps commits free of commit
    /// charge); anything else is an error naming the part that is not ([`SpaceError::Adopt`]).
    ///
    /// On drop the window is not unmapped: every page the space committed, protected or mapped a
    /// view over is decommitted (fresh `PROT_NONE`, private, `MAP_NORESERVE` pages, the bytes
    /// dropped), so the caller gets its range back as a reservation, to unmap or reuse.
    ///
    /// # Safety
    /// `base..base + len` must be a reservation the caller made; it must stay mapped for as long
    /// as the space lives (trackers and holds keep it alive), and nothing else may map, unmap or
    /// change protection in it meanwhile: the space maps over its pages (`MAP_FIXED`) as its own.
    /// The checks above cannot tell a reservation the caller owns from someone else's.
    #[allow(unsafe_code)] // adopting a reservation: see the Safety section
    pub unsafe fn adopt(self, base: usize, len: u64) -> Result<Space, SpaceError> {
        // SAFETY: the caller's contract is this fn's.
        unsafe { Space::adopt(self, base, len) }
    }
}

impl Space {
    /// Reserves the window (and its guard pages) where the configuration places it. Nothing is
    /// committed: every page is reserved, inaccessible, without memory or commit charge (Linux:
    /// one `PROT_NONE`, `MAP_NORESERVE` mapping; Windows: reserved address space, see
    /// docs/windows.md).
    ///
    /// # Errors
    /// [`SpaceError::BadWindow`] for a window size that is zero, unaligned or too large;
    /// [`SpaceError::BadPlacement`] for an unaligned guard or base, or a range past the address
    /// space; [`SpaceError::Reserve`] where the OS refuses the reservation;
    /// [`SpaceError::Exists`] where [`Placement::At`] meets a mapping, [`SpaceError::ReserveAt`]
    /// where it fails otherwise; [`SpaceError::Os`] where the region queries cannot be opened.
    pub fn new(config: SpaceConfig) -> Result<Self, SpaceError> {
        let page = page_size();
        if config.window == 0 || !config.window.is_multiple_of(page) || usize::try_from(config.window).is_err() {
            return Err(SpaceError::BadWindow { size: config.window, page });
        }
        let (window, guard) = (config.window, config.guard);
        let base = match config.placement {
            Placement::Anywhere => None,
            Placement::At(b) => Some(b as u64),
        };
        let bad = |why| SpaceError::BadPlacement { base: base.unwrap_or(0), window, guard, why };
        if !guard.is_multiple_of(page) {
            return Err(bad("the guard is not a multiple of the page size"));
        }
        // The whole mapping, guards included, must fit the address space.
        let total = guard.checked_mul(2).and_then(|g| g.checked_add(window)).filter(|t| usize::try_from(*t).is_ok());
        let total = total.ok_or_else(|| bad("the window and its guards run past the address space"))?;
        let res = match base {
            None => Reservation::new(window as usize, guard as usize)
                .map_err(|source| SpaceError::Reserve { size: window, source })?,
            Some(b) => {
                if !b.is_multiple_of(page) {
                    return Err(bad("the base is not page-aligned"));
                }
                let start = b.checked_sub(guard).filter(|s| *s > 0);
                let end = start.and_then(|s| s.checked_add(total)).filter(|e| usize::try_from(*e).is_ok());
                let (Some(start), Some(end)) = (start, end) else {
                    return Err(bad("the window and its guards run past either end of the address space"));
                };
                Reservation::at(b as usize, window as usize, guard as usize)
                    .map_err(|source| reserve_at_failed(start, end, source, &config))?
            }
        };
        Self::with_reservation(res, &config)
    }

    /// A space over the caller's reservation `base..base + len`: see [`SpaceConfig::adopt`].
    ///
    /// # Safety
    /// As [`SpaceConfig::adopt`].
    #[allow(unsafe_code)] // adopting a reservation: see the Safety section
    unsafe fn adopt(config: SpaceConfig, base: usize, len: u64) -> Result<Self, SpaceError> {
        let page = page_size();
        let refuse = |why: String| SpaceError::Adopt { base: base as u64, len, why };
        if config.placement != Placement::Anywhere || config.guard != 0 {
            return Err(refuse(
                "a placement or guard pages were asked for; the caller's reservation is where it is, \
                 its guards are the caller's to make"
                    .into(),
            ));
        }
        if base == 0 || len == 0 {
            return Err(refuse("the range is null or empty".into()));
        }
        if !(base as u64).is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(refuse(format!("the range is not aligned to the {page:#x}-byte page")));
        }
        let Some(end) = usize::try_from(len).ok().and_then(|l| base.checked_add(l)) else {
            return Err(refuse("the range runs past the end of the address space".into()));
        };
        let maps = Maps::open(config.maps_text || crate::faults::no_procmap_query())
            .map_err(|source| SpaceError::os("open /proc/self/maps", 0, 0, source))?;
        let regions = maps.regions(base, end).map_err(|e| SpaceError::os("query regions", 0, len, e))?;
        if let Some(why) = not_a_reservation(&regions, base, end) {
            return Err(refuse(why));
        }
        // SAFETY: the caller's contract is the one `Reservation::adopt` asks for; alignment and
        // length were checked above (it checks them again).
        let res = unsafe { Reservation::adopt(base, len as usize) }.map_err(|e| refuse(e.to_string()))?;
        Ok(Self::from_parts(res, maps, &config))
    }

    /// A space over `res`, its region queries answered as `config` asks.
    fn with_reservation(res: Reservation, config: &SpaceConfig) -> Result<Self, SpaceError> {
        let maps = Maps::open(config.maps_text || crate::faults::no_procmap_query())
            .map_err(|source| SpaceError::os("open /proc/self/maps", 0, 0, source))?;
        Ok(Self::from_parts(res, maps, config))
    }

    fn from_parts(res: Reservation, maps: Maps, config: &SpaceConfig) -> Self {
        // Every page starts reserved in the record: an adopted window was checked to be so.
        Self {
            res,
            maps,
            one_call_commit: config.one_call_commit,
            state: Mutex::new(State::default()),
            record: RwLock::new(Record::default()),
            changing: AtomicU32::new(0),
            long_reads: AtomicU32::new(0),
            reads_done: (Mutex::new(()), Condvar::new()),
            long_read_waits: AtomicU64::new(0),
            lock_waiters: AtomicU32::new(0),
            published: Mutex::default(),
            publishing: Default::default(),
            pid: std::process::id(),
        }
    }

    /// A space with the default configuration (one-call commit, no guard) and a window of
    /// `window` bytes.
    ///
    /// # Errors
    /// As [`Space::new`].
    pub fn with_window(window: u64) -> Result<Self, SpaceError> {
        SpaceConfig::default().window(window).build()
    }
}

/// The error of a reservation at host `start..end` that failed with `source`: where something is
/// mapped there (`EEXIST`; `ERROR_ALREADY_EXISTS` on Windows), [`SpaceError::Exists`] naming the first mapping (one region query).
fn reserve_at_failed(start: u64, end: u64, source: std::io::Error, config: &SpaceConfig) -> SpaceError {
    if !crate::sys::codes::is_taken(&source) {
        return SpaceError::ReserveAt { start, end, source };
    }
    let first = Maps::open(config.maps_text || crate::faults::no_procmap_query())
        .and_then(|maps| maps.regions(start as usize, end as usize))
        .ok()
        .and_then(|regions| regions.into_iter().next());
    let found = match first {
        Some(r) => {
            let prot = Prot { read: r.read, write: r.write, exec: r.exec };
            let kind = if r.file { "file" } else { "anonymous" };
            let shared = if r.shared { "shared" } else { "private" };
            format!("{:#x}..{:#x} is mapped there (a {prot:?} {shared} {kind} mapping)", r.start, r.end)
        }
        None => "something is mapped there".to_string(),
    };
    SpaceError::Exists { start, end, found }
}
