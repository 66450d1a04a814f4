use std::io;

use super::Prot;

/// What went wrong in the guest address space. Addresses and lengths are guest addresses
/// (offsets into the window), in hex; an OS failure keeps the OS error as its source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpaceError {
    /// A guest range or address runs past the window: `addr+len` (bytes) against a window of
    /// `window` bytes. [`GuestRange::new`](super::GuestRange::new) reports a range that wraps past
    /// `u64::MAX` so too, with `window` = `u64::MAX`.
    #[error("guest range {addr:#x}+{len:#x} is outside the guest window 0x0..{window:#x}")]
    OutOfWindow {
        /// Guest address of the range's first byte.
        addr: u64,
        /// The range's length in bytes.
        len: u64,
        /// The window's size in bytes.
        window: u64,
    },
    /// A guest range of zero bytes starting at `addr` ([`GuestRange::new`](super::GuestRange::new)).
    #[error("guest range at {addr:#x} has zero length")]
    ZeroLength {
        /// Guest address of the range's first byte.
        addr: u64,
    },
    /// A guest range `addr+len` whose start or length is not a multiple of the host page
    /// (`page` bytes: 4 KiB on x86-64 Linux and Windows, more on some Linux kernels).
    #[error("guest range {addr:#x}+{len:#x} is not aligned to the {page:#x}-byte page")]
    Unaligned {
        /// Guest address of the range's first byte.
        addr: u64,
        /// The range's length in bytes.
        len: u64,
        /// The host page size in bytes.
        page: u64,
    },
    /// [`Space::new`](super::Space::new): the window of `size` bytes is zero, not a multiple of
    /// the `page`-byte host page, or larger than the host's address space (`usize`).
    #[error("guest window size {size:#x} is not a non-zero multiple of the {page:#x}-byte page")]
    BadWindow {
        /// The window size asked for, in bytes.
        size: u64,
        /// The host page size in bytes.
        page: u64,
    },
    /// Reserving the `size`-byte window where the OS chooses failed (`mmap` on Linux,
    /// `VirtualAlloc2`/`VirtualAlloc` on Windows); `source` is the OS error (out of address
    /// space, say).
    #[error("reserving the {size:#x}-byte guest window failed")]
    Reserve {
        /// Bytes asked for.
        size: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The window's placement was refused before any OS call: `why` says which check failed
    /// (the guard is not a page multiple, the base is not page-aligned, the window and its guards
    /// run past the address space). `base` is the host address asked for (0 for
    /// [`Placement::Anywhere`](super::Placement::Anywhere)), `window` and `guard` are bytes.
    #[error("guest window at host {base:#x}+{window:#x} with {guard:#x}-byte guard pages refused: {why}")]
    BadPlacement {
        /// Host address asked for (0 where none was).
        base: u64,
        /// The window's size in bytes.
        window: u64,
        /// Bytes of guard pages asked for on each side.
        guard: u64,
        /// Which check failed.
        why: &'static str,
    },
    /// Reserving at a fixed base ([`Placement::At`](super::Placement::At)) failed for another
    /// reason than a mapping in the way: `start..end` is the host range (guard pages included),
    /// `source` the OS error.
    #[error("reserving host range {start:#x}..{end:#x} for the guest window (guard pages included) failed")]
    ReserveAt {
        /// First host byte (the lower guard's start).
        start: u64,
        /// End of the host range (exclusive).
        end: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Reserving at a fixed base ([`super::Placement::At`]) met a mapping in the range (guard
    /// pages included): `found` names the first one, which is left as it was.
    #[error("reserving host range {start:#x}..{end:#x} for the guest window (guard pages included) refused: {found}")]
    #[non_exhaustive]
    Exists {
        /// First host byte of the range asked for (the lower guard's start).
        start: u64,
        /// End of the host range (exclusive).
        end: u64,
        /// The first mapping found there (range, protection, kind).
        found: String,
    },
    /// [`SpaceConfig::adopt`](super::SpaceConfig::adopt) refused the caller's range `base+len`
    /// (host address, bytes): `why` says why (a placement or guard was asked for, the range is
    /// null, empty, unaligned or past the address space, or it is not one private anonymous
    /// inaccessible reservation), and nothing was changed.
    #[error("adopting host range {base:#x}+{len:#x} as the guest window refused: {why}")]
    Adopt {
        /// Host address of the caller's range.
        base: u64,
        /// The range's length in bytes.
        len: u64,
        /// Why it was refused.
        why: String,
    },
    /// The OS call `op` (`"commit"`, `"decommit"`, `"protect"`, `"store"`, `"query regions"`,
    /// ...) over guest range `addr+len` failed for a reason the space cannot tell better; `source`
    /// is the OS error. What the call had done before failing stays done.
    #[error("{op} {addr:#x}+{len:#x} failed")]
    Os {
        /// The operation.
        op: &'static str,
        /// Guest address of the range.
        addr: u64,
        /// Bytes.
        len: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `op` (a decommit or a section mapping) over guest range `addr+len` met pages held by
    /// [`Space::hold`](super::Space::hold) (a live GPU import): `lo..hi` are the held guest bytes.
    /// Nothing was changed.
    #[error("{op} of guest range {addr:#x}+{len:#x} refused: pages {lo:#x}..{hi:#x} are held (a live GPU import)")]
    Held {
        /// The operation (`"commit"`, `"decommit"`, `"write"`, `"read"`, ...).
        op: &'static str,
        /// Guest address of the range's first byte.
        addr: u64,
        /// The range's length in bytes.
        len: u64,
        /// First guest byte of the pages at fault.
        lo: u64,
        /// End of those pages (exclusive).
        hi: u64,
    },
    /// `op` over guest range `addr+len` found a mapping the space did not make there (foreign code
    /// unmapped part of the window and something else was mapped): `found` describes it. Nothing
    /// was changed.
    #[error("{op} refused: guest range {addr:#x}+{len:#x} holds {found}, not the space's own memory")]
    Foreign {
        /// The operation (`"commit"`, `"decommit"`, `"write"`, `"read"`, ...).
        op: &'static str,
        /// Guest address of the range's first byte.
        addr: u64,
        /// The range's length in bytes.
        len: u64,
        /// What is mapped there instead.
        found: String,
    },
    /// [`Space::store`](super::Space::store) of `len` bytes at `addr`: a page is not the space's
    /// own, not committed writable, or its access was taken away behind the space's back. The bytes
    /// before the refused page may be stored (see `store`).
    #[error("store {addr:#x}+{len:#x} refused: not every page is the space's own and committed writable")]
    NotWritable {
        /// Guest address of the range's first byte.
        addr: u64,
        /// The range's length in bytes.
        len: u64,
    },
    /// A call in another process than the one that made the space (a `fork`'s child): the
    /// space's region queries read the maker's memory map, so nothing is queried or changed.
    #[error(
        "this space was made in process {made_in}; process {now} (a fork's child) cannot query or change its mappings"
    )]
    OtherProcess {
        /// The id of the process that made the space.
        made_in: u32,
        /// The id of the calling process.
        now: u32,
    },
    /// `op` over guest range `addr+len` met pages the space has not committed (reserved: never
    /// committed, or decommitted): `lo..hi` is the first run of them.
    #[error("{op} {addr:#x}+{len:#x} refused: pages {lo:#x}..{hi:#x} are not committed")]
    #[non_exhaustive]
    NotCommitted {
        /// The operation (`"commit"`, `"decommit"`, `"write"`, `"read"`, ...).
        op: &'static str,
        /// Guest address of the range's first byte.
        addr: u64,
        /// The range's length in bytes.
        len: u64,
        /// First guest byte of the pages at fault.
        lo: u64,
        /// End of those pages (exclusive).
        hi: u64,
    },
    /// `op` over guest range `addr+len` met committed pages whose protection does not allow it
    /// (a write to read-only pages, a read of inaccessible ones): `lo..hi` is the first run of
    /// them, committed `prot`.
    #[error("{op} {addr:#x}+{len:#x} refused: pages {lo:#x}..{hi:#x} are {prot:?}, which does not allow it")]
    #[non_exhaustive]
    Protection {
        /// The operation (`"commit"`, `"decommit"`, `"write"`, `"read"`, ...).
        op: &'static str,
        /// Guest address of the range's first byte.
        addr: u64,
        /// The range's length in bytes.
        len: u64,
        /// First guest byte of the pages at fault.
        lo: u64,
        /// End of those pages (exclusive).
        hi: u64,
        /// The protection those pages were committed with.
        prot: Prot,
    },
    /// No section has this id (never made, or destroyed).
    #[error("section {0} does not exist")]
    NoSection(
        /// The id asked for.
        u64,
    ),
    /// Pages `offset+len` (bytes) of section `section` run past its end of `size` bytes.
    #[error("section {section}: pages at offset {offset:#x}+{len:#x} run past its end {size:#x}")]
    PastSection {
        /// The section's id.
        section: u64,
        /// Byte offset into the section.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The section's size in bytes.
        size: u64,
    },
}

impl SpaceError {
    pub(crate) fn os(op: &'static str, addr: u64, len: u64, source: io::Error) -> Self {
        SpaceError::Os { op, addr, len, source }
    }
}
