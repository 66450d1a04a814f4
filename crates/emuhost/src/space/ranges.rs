//! A map of disjoint half-open ranges `start..end` to values, split where a range is removed
//! from the middle. Holds the private allocations' extents and the shared views.

use std::collections::BTreeMap;

/// Disjoint half-open ranges mapped to values (see the module's docs).
#[derive(Clone, Debug)]
pub struct RangeMap<V> {
    map: BTreeMap<u64, (u64, V)>,
}

impl<V> Default for RangeMap<V> {
    fn default() -> Self {
        Self { map: BTreeMap::new() }
    }
}

impl<V: Clone> RangeMap<V> {
    /// The entries that overlap `a..b`, in address order, unclipped.
    pub fn overlapping(&self, a: u64, b: u64) -> impl Iterator<Item = (u64, u64, &V)> {
        let before = self.map.range(..a).next_back().filter(|(_, (end, _))| *end > a);
        before.into_iter().chain(self.map.range(a..b)).map(|(s, (e, v))| (*s, *e, v))
    }

    /// Every entry, in address order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, &V)> {
        self.map.iter().map(|(s, (e, v))| (*s, *e, v))
    }

    /// Removes `a..b` from the map. An entry that runs across `a` or `b` keeps its part outside;
    /// `cut(old_start, new_start, &value)` gives the value of each such remaining part.
    pub fn remove(&mut self, a: u64, b: u64, mut cut: impl FnMut(u64, u64, &V) -> V) {
        let hit: Vec<(u64, u64, V)> = self.overlapping(a, b).map(|(s, e, v)| (s, e, v.clone())).collect();
        for (s, e, v) in hit {
            self.map.remove(&s);
            if s < a {
                self.map.insert(s, (a, cut(s, s, &v)));
            }
            if e > b {
                self.map.insert(b, (e, cut(s, b, &v)));
            }
        }
    }

    /// Inserts `a..b`, which must not overlap any entry.
    pub fn insert(&mut self, a: u64, b: u64, v: V) {
        debug_assert!(a < b);
        debug_assert!(self.overlapping(a, b).next().is_none(), "{a:#x}..{b:#x} overlaps an entry");
        self.map.insert(a, (b, v));
    }

    /// The parts of `a..b` no entry covers, in address order.
    pub fn gaps(&self, a: u64, b: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = a;
        for (s, e, _) in self.overlapping(a, b) {
            if s > at {
                out.push((at, s));
            }
            at = at.max(e);
        }
        if at < b {
            out.push((at, b));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(m: &RangeMap<u32>) -> Vec<(u64, u64, u32)> {
        m.iter().map(|(s, e, v)| (s, e, *v)).collect()
    }

    #[test]
    fn remove_from_the_middle_splits() {
        let mut m = RangeMap::default();
        m.insert(0x1000, 0x9000, 1);
        m.remove(0x3000, 0x4000, |_, _, v| v + 10);
        assert_eq!(entries(&m), vec![(0x1000, 0x3000, 11), (0x4000, 0x9000, 11)]);
    }

    #[test]
    fn remove_across_several_entries_trims_the_ends() {
        let mut m = RangeMap::default();
        m.insert(0x0, 0x2000, 1);
        m.insert(0x2000, 0x4000, 2);
        m.insert(0x5000, 0x8000, 3);
        m.remove(0x1000, 0x6000, |_, _, v| *v);
        assert_eq!(entries(&m), vec![(0x0, 0x1000, 1), (0x6000, 0x8000, 3)]);
    }

    #[test]
    fn cut_is_told_where_the_part_starts() {
        let mut m = RangeMap::default();
        m.insert(0x1000, 0x5000, 0);
        let mut seen = vec![];
        m.remove(0x2000, 0x3000, |old, new, _| {
            seen.push((old, new));
            0
        });
        assert_eq!(seen, vec![(0x1000, 0x1000), (0x1000, 0x3000)]);
    }

    #[test]
    fn gaps_are_the_uncovered_parts() {
        let mut m = RangeMap::default();
        m.insert(0x2000, 0x3000, 0);
        m.insert(0x5000, 0x6000, 0);
        assert_eq!(m.gaps(0x1000, 0x7000), vec![(0x1000, 0x2000), (0x3000, 0x5000), (0x6000, 0x7000)]);
        assert_eq!(m.gaps(0x2000, 0x3000), vec![]);
        assert_eq!(m.gaps(0x2800, 0x5800), vec![(0x3000, 0x5000)]);
    }

    #[test]
    fn overlapping_finds_an_entry_starting_before() {
        let mut m = RangeMap::default();
        m.insert(0x1000, 0x4000, 7);
        assert_eq!(m.overlapping(0x3000, 0x3001).count(), 1);
        assert_eq!(m.overlapping(0x4000, 0x5000).count(), 0);
        assert_eq!(m.overlapping(0x0, 0x1000).count(), 0);
    }
}
