//! A bitmap of written memory whose bytes-per-bit is part of its type.

use crate::space::GuestRange;

/// Bits `lo..hi` of one word (`lo < hi <= 64`).
pub(super) fn word_mask(lo: u64, hi: u64) -> u64 {
    (u64::MAX >> (64 - (hi - lo))) << lo
}

/// Sets bits `first..end` of `words` (bit `i` is bit `i % 64` of word `i / 64`), a word at a
/// time: a long run costs a store per 64 bits, not one per bit.
pub(super) fn set_bits(words: &mut [u64], first: u64, end: u64) {
    let mut i = first;
    while i < end {
        let (w, lo) = (i / 64, i % 64);
        let hi = (end - w * 64).min(64);
        words[w as usize] |= word_mask(lo, hi);
        i = w * 64 + hi;
    }
}

/// A caller's bitmap words over a range (bit `i`: the `granularity` bytes from `range.start + i *
/// granularity`), and the bytes of the runs set in them.
pub(super) struct Bits<'a> {
    words: &'a mut [u64],
    start: u64,
    shift: u32,
    pub(super) bytes: u64,
}

impl<'a> Bits<'a> {
    /// `granularity` is a power of two, and `words` long enough for `range` (checked by the
    /// caller before anything is read).
    pub(super) fn new(words: &'a mut [u64], range: GuestRange, granularity: u64) -> Self {
        Self { words, start: range.start().0, shift: granularity.trailing_zeros(), bytes: 0 }
    }

    /// Sets the bits of guest `s..e` (inside the range, not empty) and counts its bytes, with
    /// shifts only (a collect at 50 % written calls this once per written page).
    #[inline]
    pub(super) fn set(&mut self, s: u64, e: u64) {
        let a = self.start;
        set_bits(self.words, (s - a) >> self.shift, ((e - a - 1) >> self.shift) + 1);
        self.bytes += e - s;
    }
}

/// One bit per `GRAIN` bytes of `range`, set where a page was written (a grain partly covered
/// by a written page is set).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageBitmap<const GRAIN: u64> {
    start: u64,
    bits: u64,
    words: Vec<u64>,
}

impl<const GRAIN: u64> PageBitmap<GRAIN> {
    /// An empty bitmap over `range`.
    pub fn new(range: GuestRange) -> Self {
        const { assert!(GRAIN > 0, "a grain of zero bytes") };
        let bits = range.len().div_ceil(GRAIN);
        Self { start: range.start().0, bits, words: vec![0; bits.div_ceil(64) as usize] }
    }

    /// Bytes per bit.
    pub const fn grain(&self) -> u64 {
        GRAIN
    }

    /// The number of bits.
    pub fn len(&self) -> u64 {
        self.bits
    }

    /// Whether it has no bits.
    pub fn is_empty(&self) -> bool {
        self.bits == 0
    }

    /// Sets the bits of guest addresses `s..e` (clipped to the bitmap).
    pub fn set_range(&mut self, s: u64, e: u64) {
        let end = self.start + self.bits * GRAIN;
        let (s, e) = (s.max(self.start), e.min(end));
        if s >= e {
            return;
        }
        set_bits(&mut self.words, (s - self.start) / GRAIN, (e - self.start).div_ceil(GRAIN));
    }

    /// Whether the grain holding guest address `addr` was written.
    pub fn get(&self, addr: u64) -> bool {
        if addr < self.start || (addr - self.start) / GRAIN >= self.bits {
            return false;
        }
        let i = (addr - self.start) / GRAIN;
        self.words[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    /// The number of bits set.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| w.count_ones() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::space::GuestAddr;

    #[test]
    fn grains_are_set_by_the_bytes_they_cover() {
        let r = GuestRange::new(GuestAddr(0x10000), 0x10000).unwrap();
        let mut b = PageBitmap::<0x2000>::new(r);
        assert_eq!((b.len(), b.grain()), (8, 0x2000));
        b.set_range(0x13000, 0x14000); // half of grain 1
        b.set_range(0x0, 0x11000); // clipped: half of grain 0
        b.set_range(0x1f000, 0x30000); // clipped: grain 7
        assert!(b.get(0x10000) && b.get(0x12000) && b.get(0x13fff) && b.get(0x1e000));
        assert!(!b.get(0x14000) && !b.get(0x20000) && !b.get(0xffff));
        assert_eq!(b.count(), 3);
    }
}
