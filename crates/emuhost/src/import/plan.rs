//! Planning an import: which guest range a binding imports.
//!
//! A binding `addr..addr + size` imports its chunk-aligned cover (one chunk, or both chunks where
//! it runs across a chunk's end). With spans on, the range then grows over every pool that runs
//! across either of its ends strictly (`lo < end < hi`), pass after pass until a pass grows
//! nothing, taking each such pool's chunk-aligned cover whole, so long as the range stays within
//! the cap. A pool whose cover would take the range past the cap is left out; a pool that only
//! touches an end is not across it.
//!
//! The rule, exactly ([`reference`] states it the slow way): each pass takes
//! the pools across the ends of the range as it stood when the pass began, in `(lo, id)` order;
//! each of them that still runs across an end of the range as it stands now, and whose union with
//! it is within the cap, grows the range at once.

use super::ImportError;
use super::pools::Pools;

/// The default chunk: 16 MiB.
pub const DEFAULT_CHUNK: u64 = 16 << 20;
/// The default span cap: 64 MiB.
pub const DEFAULT_SPAN_CAP: u64 = 64 << 20;

/// How ranges are planned ([`PlanConfig::new`]; `#[non_exhaustive]`, so fields can be added).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlanConfig {
    /// Chunk size in bytes: a power of two, at least the host page.
    pub chunk: u64,
    /// The largest range a span may grow to, in bytes; 0 turns spans off.
    pub span_cap: u64,
}

impl Default for PlanConfig {
    fn default() -> Self {
        Self { chunk: DEFAULT_CHUNK, span_cap: DEFAULT_SPAN_CAP }
    }
}

impl PlanConfig {
    /// `chunk` bytes per chunk (checked by [`PlanConfig::check`] where it is used), spans up to
    /// `span_cap` bytes (0: off).
    pub fn new(chunk: u64, span_cap: u64) -> Self {
        Self { chunk, span_cap }
    }

    /// Checks the chunk (a power of two, at least `align`).
    ///
    /// # Errors
    /// [`ImportError::BadChunk`] otherwise.
    pub fn check(&self, align: u64) -> Result<(), ImportError> {
        if !self.chunk.is_power_of_two() || self.chunk < align {
            return Err(ImportError::BadChunk { chunk: self.chunk, align });
        }
        Ok(())
    }
}

/// A planned import: guest bytes `lo..hi`, chunk-aligned (prints as `lo..hi` in hex).
///
/// [`plan`] makes one for a binding: the chunks it lies in, grown over the pools that run across
/// their ends while the whole stays within the span cap.
///
/// ```
/// use emuhost::import::{ImportError, PlanConfig, Planned, Pools, plan};
///
/// const MIB: u64 = 1 << 20;
/// // 16 MiB chunks, spans up to 64 MiB.
/// let cfg = PlanConfig::new(16 * MIB, 64 * MIB);
/// let mut pools = Pools::new();
/// // A pool across the 32 MiB chunk boundary.
/// pools.add(24 * MIB, 16 * MIB).expect("a non-empty pool");
///
/// // A binding across the 16 MiB boundary needs both chunks in one import...
/// let cover = plan(&pools, cfg, 16 * MIB - 0x1000, 0x2000, false)?;
/// assert_eq!(cover, Planned { lo: 0, hi: 32 * MIB });
/// assert_eq!((cover.len(), cover.to_string()), (32 * MIB, "0x0..0x2000000".to_string()));
/// // ...and with the span, the import grows over the pool across its end.
/// let spanned = plan(&pools, cfg, 16 * MIB - 0x1000, 0x2000, true)?;
/// assert_eq!(spanned, Planned { lo: 0, hi: 48 * MIB });
/// assert!(spanned.covers(cover.lo, cover.hi));
///
/// // An empty binding is an error naming it.
/// assert!(matches!(plan(&pools, cfg, 0x1000, 0, true), Err(ImportError::EmptyBinding { addr: 0x1000 })));
/// # Ok::<(), ImportError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Planned {
    /// Guest address of the first byte.
    pub lo: u64,
    /// End (exclusive).
    pub hi: u64,
}

impl Planned {
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.hi - self.lo
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.hi == self.lo
    }

    /// Whether it covers all of `lo..hi`.
    pub fn covers(&self, lo: u64, hi: u64) -> bool {
        self.lo <= lo && hi <= self.hi
    }
}

impl std::fmt::Display for Planned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}..{:#x}", self.lo, self.hi)
    }
}

/// `lo..hi` rounded out to whole chunks; `None` where the end would pass `u64::MAX` or the chunk is
/// not a power of two.
pub(crate) fn cover(lo: u64, hi: u64, chunk: u64) -> Option<(u64, u64)> {
    if !chunk.is_power_of_two() {
        return None;
    }
    Some((lo & !(chunk - 1), hi.checked_next_multiple_of(chunk)?))
}

/// The chunk-aligned cover of the binding `addr..addr + size`. The chunk must be a power of two.
///
/// # Errors
/// [`ImportError::BadChunk`] (`align` 1) for a chunk that is not a power of two,
/// [`ImportError::EmptyBinding`] for `size` 0, [`ImportError::BindingWraps`] or
/// [`ImportError::CoverWraps`] where the binding or its cover would end past `u64::MAX`.
pub fn binding_cover(addr: u64, size: u64, chunk: u64) -> Result<Planned, ImportError> {
    if !chunk.is_power_of_two() {
        return Err(ImportError::BadChunk { chunk, align: 1 });
    }
    if size == 0 {
        return Err(ImportError::EmptyBinding { addr });
    }
    let end = addr.checked_add(size).ok_or(ImportError::BindingWraps { addr, size })?;
    let (lo, hi) = cover(addr, end, chunk).ok_or(ImportError::CoverWraps { addr, size, chunk })?;
    Ok(Planned { lo, hi })
}

/// Plans the import for the binding `addr..addr + size`: its cover, grown by the span when `span`
/// is set and the cap is not 0 (see [`Planned`]'s example).
///
/// # Errors
/// As [`binding_cover`], with `cfg.chunk`.
pub fn plan(pools: &Pools, cfg: PlanConfig, addr: u64, size: u64, span: bool) -> Result<Planned, ImportError> {
    let start = binding_cover(addr, size, cfg.chunk)?;
    if !span || cfg.span_cap == 0 {
        return Ok(start);
    }
    Ok(grow(pools, cfg, start))
}

/// The range a binding imports under the pools policy ([`ImportPolicy::Pools`]): the pools the
/// binding `addr..addr + size` overlaps, whole, with the binding, rounded out to `align` (the
/// backend's alignment: a power of two). A binding outside every pool imports its own pages.
///
/// # Errors
/// As [`binding_cover`], with `align` as the chunk.
///
/// [`ImportPolicy::Pools`]: super::ImportPolicy::Pools
pub fn pool_range(pools: &Pools, addr: u64, size: u64, align: u64) -> Result<Planned, ImportError> {
    let mut r = binding_cover(addr, size, align)?;
    for p in pools.overlapping(addr, addr + size) {
        let Some((lo, hi)) = cover(p.lo, p.hi, align) else { continue };
        r = Planned { lo: r.lo.min(lo), hi: r.hi.max(hi) };
    }
    Ok(r)
}

/// The part of `whole` a binding `addr..addr + size` (inside it) imports itself when `whole`
/// would take too long: the binding's cover in `granule`s (a power of two), cut to `whole`.
pub fn piece(whole: Planned, addr: u64, size: u64, granule: u64) -> Planned {
    let lo = (addr & !(granule - 1)).max(whole.lo);
    let hi = addr.saturating_add(size).checked_next_multiple_of(granule).unwrap_or(u64::MAX).min(whole.hi);
    Planned { lo, hi }
}

/// Grows `r` over the pools across its ends, as the module says.
pub fn grow(pools: &Pools, cfg: PlanConfig, mut r: Planned) -> Planned {
    loop {
        let mut candidates = pools.across(r.lo);
        candidates.extend(pools.across(r.hi));
        candidates.sort_unstable_by_key(|p| (p.lo, p.id));
        candidates.dedup_by_key(|p| p.id);
        let mut grew = false;
        for p in candidates {
            let across = (p.lo < r.lo && r.lo < p.hi) || (p.lo < r.hi && r.hi < p.hi);
            if !across {
                continue;
            }
            let Some((clo, chi)) = cover(p.lo, p.hi, cfg.chunk) else { continue };
            let (lo, hi) = (r.lo.min(clo), r.hi.max(chi));
            if hi - lo <= cfg.span_cap {
                r = Planned { lo, hi };
                grew = true;
            }
        }
        if !grew {
            return r;
        }
    }
}

/// The planner's rule stated the slow way, for tests and fuzzing to check [`plan`] against: every
/// pass looks at every pool, with no index.
///
/// `pools` are `(lo, size)` in the order they were registered (a [`Pools`] registry holding the
/// same pools, added in this order, gives the same plans). It gives the same result as [`plan`]
/// over those pools, errors included, and never panics: a chunk that is not a power of two is
/// [`ImportError::BadChunk`], a binding that is empty, that ends past `u64::MAX` or whose cover
/// would is [`ImportError::EmptyBinding`], [`ImportError::BindingWraps`] or
/// [`ImportError::CoverWraps`]; a pool whose cover would end past
/// `u64::MAX` never grows a range. A pool that a registry refuses (empty, or wrapping) is
/// [`ImportError::BadPool`] here.
pub fn reference(
    pools: &[(u64, u64)],
    cfg: PlanConfig,
    addr: u64,
    size: u64,
    span: bool,
) -> Result<Planned, ImportError> {
    let ch = cfg.chunk;
    if !ch.is_power_of_two() {
        return Err(ImportError::BadChunk { chunk: ch, align: 1 });
    }
    if size == 0 {
        return Err(ImportError::EmptyBinding { addr });
    }
    let wraps = ImportError::BindingWraps { addr, size };
    let cover_wraps = ImportError::CoverWraps { addr, size, chunk: ch };
    let up = |x: u64| x.div_ceil(ch).checked_mul(ch);
    let (mut lo, mut hi) = (addr / ch * ch, up(addr.checked_add(size).ok_or(wraps)?).ok_or(cover_wraps)?);
    let mut sorted = Vec::with_capacity(pools.len());
    for (i, &(l, s)) in pools.iter().enumerate() {
        match l.checked_add(s) {
            Some(h) if s > 0 => sorted.push((i, l, h)),
            _ => return Err(ImportError::BadPool { lo: l, size: s }),
        }
    }
    if !span || cfg.span_cap == 0 {
        return Ok(Planned { lo, hi });
    }
    // Sorted by (lo, registration order), as a registry orders pools (by lo, then id).
    sorted.sort_by_key(|&(i, l, _)| (l, i));
    let crosses = |l: u64, h: u64, a: u64, b: u64| (l < a && a < h) || (l < b && b < h);
    loop {
        let (lo0, hi0) = (lo, hi);
        let mut grew = false;
        for &(_, l, h) in sorted.iter().filter(|&&(_, l, h)| crosses(l, h, lo0, hi0)) {
            if !crosses(l, h, lo, hi) {
                continue;
            }
            let Some(ph) = up(h) else { continue };
            let (nl, nh) = (lo.min(l / ch * ch), hi.max(ph));
            if nh - nl <= cfg.span_cap {
                (lo, hi) = (nl, nh);
                grew = true;
            }
        }
        if !grew {
            return Ok(Planned { lo, hi });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const CHUNK: u64 = 16 * MIB;

    fn cfg(cap_mib: u64) -> PlanConfig {
        PlanConfig { chunk: CHUNK, span_cap: cap_mib * MIB }
    }

    fn pools(list: &[(u64, u64)]) -> Pools {
        let mut p = Pools::new();
        p.extend(list.iter().copied()).unwrap();
        p
    }

    fn planned(p: &Pools, c: PlanConfig, addr: u64, size: u64) -> (u64, u64) {
        let r = plan(p, c, addr, size, true).unwrap();
        (r.lo, r.hi)
    }

    /// The reference PR's layout: a 16 MiB pool at 0x1021745000, bound at 0x1021ffff00+0x160
    /// across the chunk end 0x1022000000.
    const KOKIRI: u64 = 0x10_2174_5000;

    #[test]
    fn kokiri_from_both_sides() {
        let p = pools(&[(KOKIRI, 16 * MIB)]);
        let both = (0x10_2100_0000, 0x10_2300_0000);
        // The binding across the end needs both chunks, with or without the span.
        assert_eq!(planned(&p, cfg(64), 0x10_21ff_ff00, 0x160), both);
        assert_eq!(planned(&p, cfg(0), 0x10_21ff_ff00, 0x160), both);
        // A first binding in the lower chunk alone takes the pool's upper chunk too ...
        assert_eq!(planned(&p, cfg(64), KOKIRI, 0x100), both);
        // ... and one in the upper chunk its lower chunk, so the binding across the end later
        // finds one import covering it.
        assert_eq!(planned(&p, cfg(64), 0x10_2270_0000, 0x1000), both);
        // Without the span each side stays one chunk.
        assert_eq!(planned(&p, cfg(0), KOKIRI, 0x100), (0x10_2100_0000, 0x10_2200_0000));
        assert_eq!(planned(&p, cfg(0), 0x10_2270_0000, 0x1000), (0x10_2200_0000, 0x10_2300_0000));
    }

    #[test]
    fn growth_chains_across_several_pools_up_to_the_cap() {
        // Pools each across one chunk end: 0|1, 1|2, 2|3, 3|4, 4|5.
        let p = pools(&(1..=5).map(|i| (i * CHUNK - MIB, 2 * MIB)).collect::<Vec<_>>());
        // A binding in chunk 0 chains to 4 chunks (64 MiB) and stops at the cap.
        assert_eq!(planned(&p, cfg(64), 0x1000, 0x1000), (0, 4 * CHUNK));
        assert_eq!(planned(&p, cfg(48), 0x1000, 0x1000), (0, 3 * CHUNK));
        assert_eq!(planned(&p, cfg(1024), 0x1000, 0x1000), (0, 6 * CHUNK));
        // From the middle it grows both ways.
        assert_eq!(planned(&p, cfg(1024), 3 * CHUNK + 0x1000, 0x1000), (0, 6 * CHUNK));
    }

    #[test]
    fn a_long_pool_behind_a_shorter_one() {
        // A 200 MiB pool (past the cap) behind a short one across the chunk end at 3 * CHUNK.
        let p = pools(&[(0x1000, 200 * MIB), (3 * CHUNK - MIB, 2 * MIB)]);
        assert_eq!(planned(&p, cfg(64), 2 * CHUNK + 0x1000, 0x1000), (2 * CHUNK, 4 * CHUNK));
        // The short pool behind a long one that fits the cap.
        let p = pools(&[(CHUNK + 0x1000, 40 * MIB), (2 * CHUNK - MIB, 2 * MIB)]);
        assert_eq!(planned(&p, cfg(64), 2 * CHUNK + 0x1000, 0x1000), (CHUNK, 4 * CHUNK));
    }

    #[test]
    fn pools_only_touching_an_end_do_not_grow_it() {
        let p = pools(&[(CHUNK, CHUNK), (3 * CHUNK, 4096), (CHUNK - 4096, 4096)]);
        assert_eq!(planned(&p, cfg(64), 2 * CHUNK + 0x1000, 0x1000), (2 * CHUNK, 3 * CHUNK));
        assert_eq!(planned(&p, cfg(64), CHUNK + 0x1000, 0x1000), (CHUNK, 2 * CHUNK));
    }

    #[test]
    fn a_pool_past_the_cap_is_left_out() {
        // Its cover is 5 chunks (80 MiB): past 64.
        let p = pools(&[(CHUNK + 0x1000, 64 * MIB)]);
        assert_eq!(planned(&p, cfg(64), 2 * CHUNK + 0x1000, 0x1000), (2 * CHUNK, 3 * CHUNK));
        assert_eq!(planned(&p, cfg(80), 2 * CHUNK + 0x1000, 0x1000), (CHUNK, 6 * CHUNK));
        // A cover of exactly the cap is within it.
        let p = pools(&[(CHUNK + 0x1000, 40 * MIB)]);
        assert_eq!(planned(&p, cfg(48), CHUNK + 0x1000, 0x1000), (CHUNK, 4 * CHUNK));
    }

    #[test]
    fn zero_turns_spans_off() {
        let p = pools(&[(CHUNK - MIB, 2 * MIB)]);
        assert_eq!(planned(&p, cfg(0), 0x1000, 0x1000), (0, CHUNK));
        assert_eq!(planned(&p, cfg(32), 0x1000, 0x1000), (0, 2 * CHUNK));
        assert_eq!(plan(&p, cfg(32), 0x1000, 0x1000, false).unwrap(), Planned { lo: 0, hi: CHUNK });
    }

    #[test]
    fn ranges_are_chunk_aligned() {
        let p = pools(&[(0x1234_5000, 0x3000)]);
        for c in [4 * MIB, CHUNK, 64 * MIB] {
            let c = PlanConfig { chunk: c, span_cap: 64 * MIB };
            let r = plan(&p, c, 0x1234_6000, 0x10, true).unwrap();
            assert_eq!((r.lo % c.chunk, r.hi % c.chunk), (0, 0), "{r}");
            assert!(r.covers(0x1234_6000, 0x1234_6010));
        }
        assert_eq!(planned(&p, cfg(64), 0x1234_6000, 0x10), (0x1200_0000, 0x1300_0000));
    }

    #[test]
    fn bad_bindings_are_errors() {
        let p = Pools::new();
        assert!(matches!(plan(&p, cfg(64), 0x1000, 0, true), Err(ImportError::EmptyBinding { .. })));
        assert!(matches!(plan(&p, cfg(64), u64::MAX - 1, 4, true), Err(ImportError::BindingWraps { .. })));
        // The binding ends at u64::MAX; its chunk cover would not, and the error says so.
        let e = plan(&p, cfg(64), u64::MAX - 1, 1, true).unwrap_err();
        assert!(matches!(e, ImportError::CoverWraps { chunk: CHUNK, .. }), "{e}");
        assert!(e.to_string().contains("chunk cover") && e.to_string().contains("chunk 0x1000000"), "{e}");
        assert!(PlanConfig { chunk: 3 << 20, span_cap: 0 }.check(4096).is_err());
        assert!(PlanConfig { chunk: 2048, span_cap: 0 }.check(4096).is_err());
    }

    #[test]
    fn the_reference_model_agrees_at_the_top_of_the_address_space() {
        // Pools whose cover ends past u64::MAX never grow a range; a binding whose cover would is
        // refused by both.
        let top = u64::MAX - CHUNK + 1;
        let list = [(top - 0x1000, 0x2000), (top + 0x1000, CHUNK - 0x2000), (top - CHUNK, 0x1000)];
        let p = pools(&list);
        for (addr, size) in [(top - 0x800, 0x100), (top - CHUNK + 0x10, 0x10), (top, 0x10), (u64::MAX, 1), (0, 0)] {
            for c in [cfg(0), cfg(64), PlanConfig { chunk: 4096, span_cap: 1 << 40 }] {
                let got = plan(&p, c, addr, size, true).map_err(|e| e.to_string());
                let want = reference(&list, c, addr, size, true).map_err(|e| e.to_string());
                assert_eq!(got, want, "{addr:#x}+{size:#x} {c:?}");
            }
        }
        assert!(matches!(plan(&p, cfg(64), top, 0x10, true), Err(ImportError::CoverWraps { .. })));
        assert_eq!(plan(&p, cfg(64), top - 0x800, 0x100, true).unwrap(), Planned { lo: top - CHUNK, hi: top });
        // Pools a registry refuses are errors of the model, not panics.
        assert!(matches!(reference(&[(u64::MAX, 1)], cfg(64), 0, 1, true), Err(ImportError::BadPool { .. })));
        assert!(matches!(reference(&[(5, 0)], cfg(64), 0, 1, false), Err(ImportError::BadPool { .. })));
    }

    #[test]
    fn a_chunk_that_is_not_a_power_of_two_is_refused_not_a_panic() {
        // Found by fuzz/import_plan: a chunk of 0 overflowed `chunk - 1` in `cover`.
        let list = [(0x1000, 0x10_0000)];
        let p = pools(&list);
        for chunk in [0, 3, 0x3000, u64::MAX] {
            let c = PlanConfig { chunk, span_cap: 64 * MIB };
            let e = plan(&p, c, 0x2000, 0x10, true).unwrap_err();
            assert!(matches!(e, ImportError::BadChunk { chunk: c, align: 1 } if c == chunk), "{e}");
            assert_eq!(e.to_string(), reference(&list, c, 0x2000, 0x10, true).unwrap_err().to_string());
            assert!(binding_cover(0x2000, 0x10, chunk).is_err());
            // `grow` on its own leaves the range as it is.
            let r = Planned { lo: 0, hi: 0x8000 };
            assert_eq!(grow(&p, c, r), r);
        }
    }

    #[test]
    fn the_planner_matches_the_reference_model_over_random_layouts() {
        let mut rng = crate::rng::Rng::new(0x9e37_79b9_7f4a_7c15);
        let mut next = move || rng.next_u64();
        let mut grew = 0;
        for case in 0..400 {
            let n = 1 + next() % 60;
            let window = 16 * CHUNK;
            let list: Vec<(u64, u64)> = (0..n)
                .map(|_| {
                    let size = match next() % 4 {
                        0 => 4096 * (1 + next() % 16),
                        1 => MIB * (1 + next() % 16),
                        2 => MIB * (1 + next() % 96),
                        _ => 4096 * (1 + next() % 4096),
                    };
                    (next() % window / 4096 * 4096, size)
                })
                .collect();
            let p = pools(&list);
            for _ in 0..20 {
                let c = PlanConfig { chunk: CHUNK >> (next() % 3), span_cap: [0, 32, 64, 128][case % 4] * MIB };
                let addr = next() % window;
                let size = 1 + next() % (2 * MIB);
                let got = plan(&p, c, addr, size, true).unwrap();
                let want = reference(&list, c, addr, size, true).unwrap();
                assert_eq!(got, want, "case {case}: {list:x?} cfg {c:?} bind {addr:#x}+{size:#x}");
                if got.len() > binding_cover(addr, size, c.chunk).unwrap().len() {
                    grew += 1;
                }
            }
        }
        // The layouts must exercise the span, not only the plain cover.
        assert!(grew > 500, "only {grew} plans grew");
    }
}
