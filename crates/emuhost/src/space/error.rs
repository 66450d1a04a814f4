use std::io;

use super::Prot;

/// What went wrong in the guest address space. Addresses and lengths are guest addresses
/// (offsets into the window), in hex; an OS failure keeps the OS error as its source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpaceError {
    #[error("guest range {addr:#x}+{len:#x} is outside the guest window 0x0..{window:#x}")]
    OutOfWindow { addr: u64, len: u64, window: u64 },
    #[error("guest range at {addr:#x} has zero length")]
    ZeroLength { addr: u64 },
    #[error("guest range {addr:#x}+{len:#x} is not aligned to the {page:#x}-byte page")]
    Unaligned { addr: u64, len: u64, page: u64 },
    #[error("guest window size {size:#x} is not a non-zero multiple of the {page:#x}-byte page")]
    BadWindow { size: u64, page: u64 },
    #[error("reserving the {size:#x}-byte guest window failed")]
    Reserve {
        size: u64,
        #[source]
        source: io::Error,
    },
    #[error("guest window at host {base:#x}+{window:#x} with {guard:#x}-byte guard pages refused: {why}")]
    BadPlacement { base: u64, window: u64, guard: u64, why: &'static str },
    #[error("reserving host range {start:#x}..{end:#x} for the guest window (guard pages included) failed")]
    ReserveAt {
        start: u64,
        end: u64,
        #[source]
        source: io::Error,
    },
    /// Reserving at a fixed base ([`super::Placement::At`]) met a mapping in the range (guard
    /// pages included): `found` names the first one, which is left as it was.
    #[error("reserving host range {start:#x}..{end:#x} for the guest window (guard pages included) refused: {found}")]
    #[non_exhaustive]
    Exists { start: u64, end: u64, found: String },
    #[error("adopting host range {base:#x}+{len:#x} as the guest window refused: {why}")]
    Adopt { base: u64, len: u64, why: String },
    #[error("{op} {addr:#x}+{len:#x} failed")]
    Os {
        op: &'static str,
        addr: u64,
        len: u64,
        #[source]
        source: io::Error,
    },
    #[error("{op} of guest range {addr:#x}+{len:#x} refused: pages {lo:#x}..{hi:#x} are held (a live GPU import)")]
    Held { op: &'static str, addr: u64, len: u64, lo: u64, hi: u64 },
    #[error("{op} refused: guest range {addr:#x}+{len:#x} holds {found}, not the space's own memory")]
    Foreign { op: &'static str, addr: u64, len: u64, found: String },
    #[error("store {addr:#x}+{len:#x} refused: not every page is the space's own and committed writable")]
    NotWritable { addr: u64, len: u64 },
    /// A call in another process than the one that made the space (a `fork`'s child): the
    /// space's region queries read the maker's memory map, so nothing is queried or changed.
    #[error(
        "this space was made in process {made_in}; process {now} (a fork's child) cannot query or change its mappings"
    )]
    OtherProcess { made_in: u32, now: u32 },
    /// `op` over guest range `addr+len` met pages the space has not committed (reserved: never
    /// committed, or decommitted): `lo..hi` is the first run of them.
    #[error("{op} {addr:#x}+{len:#x} refused: pages {lo:#x}..{hi:#x} are not committed")]
    #[non_exhaustive]
    NotCommitted { op: &'static str, addr: u64, len: u64, lo: u64, hi: u64 },
    /// `op` over guest range `addr+len` met committed pages whose protection does not allow it
    /// (a write to read-only pages, a read of inaccessible ones): `lo..hi` is the first run of
    /// them, committed `prot`.
    #[error("{op} {addr:#x}+{len:#x} refused: pages {lo:#x}..{hi:#x} are {prot:?}, which does not allow it")]
    #[non_exhaustive]
    Protection { op: &'static str, addr: u64, len: u64, lo: u64, hi: u64, prot: Prot },
    #[error("section {0} does not exist")]
    NoSection(u64),
    #[error("section {section}: pages at offset {offset:#x}+{len:#x} run past its end {size:#x}")]
    PastSection { section: u64, offset: u64, len: u64, size: u64 },
}

impl SpaceError {
    pub(crate) fn os(op: &'static str, addr: u64, len: u64, source: io::Error) -> Self {
        SpaceError::Os { op, addr, len, source }
    }
}
