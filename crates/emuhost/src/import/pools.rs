//! The game's memory pools: `lo..hi` guest ranges, possibly overlapping (a long pool behind a
//! shorter one), registered and released at any time.
//!
//! The index is the pools sorted by `(lo, id)` with a max-`hi` segment tree over them (an implicit
//! interval tree). "Which pools run across `x`" walks only the tree nodes whose pools start below
//! `x` and whose largest `hi` lies past it: O((1 + k) log n) for k answers, whatever the pools'
//! lengths. Registering or releasing a pool shifts the sorted vector and rebuilds the tree, O(n)
//! with a tiny constant (a few microseconds for thousands of pools); `extend` adds many at once
//! with one rebuild. Lookups (every binding) are far more frequent than pool changes.

use std::collections::HashMap;

/// A pool's id, unique for the registry's lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(
    /// The number (ids count up from 0 in each registry).
    pub u64,
);

/// One pool: guest bytes `lo..hi` (`lo < hi`; no alignment required).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool {
    /// Its id.
    pub id: PoolId,
    /// Guest address of the first byte.
    pub lo: u64,
    /// End (exclusive).
    pub hi: u64,
}

/// The registry.
#[derive(Debug, Default, Clone)]
pub struct Pools {
    /// Sorted by `(lo, id)`.
    sorted: Vec<Pool>,
    /// `tree[1]` is the root; node `i` has children `2i`, `2i + 1`; leaves start at `leaves`.
    tree: Vec<u64>,
    leaves: usize,
    los: HashMap<PoolId, u64>,
    next: u64,
}

impl Pools {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of pools.
    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    /// Whether it holds no pool.
    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }

    /// Registers `lo..lo + size`. `None` for a zero size or a range that wraps.
    pub fn add(&mut self, lo: u64, size: u64) -> Option<PoolId> {
        let id = self.insert(lo, size)?;
        self.rebuild();
        Some(id)
    }

    /// Registers many pools with one index rebuild; `None` (and nothing added) if any is empty or
    /// wraps.
    pub fn extend(&mut self, pools: impl IntoIterator<Item = (u64, u64)>) -> Option<Vec<PoolId>> {
        let pools: Vec<(u64, u64)> = pools.into_iter().collect();
        if pools.iter().any(|&(lo, size)| size == 0 || lo.checked_add(size).is_none()) {
            return None;
        }
        let mut ids = Vec::with_capacity(pools.len());
        for (lo, size) in pools {
            let id = PoolId(self.next);
            self.next += 1;
            self.sorted.push(Pool { id, lo, hi: lo + size });
            self.los.insert(id, lo);
            ids.push(id);
        }
        self.sorted.sort_unstable_by_key(|p| (p.lo, p.id));
        self.rebuild();
        Some(ids)
    }

    fn insert(&mut self, lo: u64, size: u64) -> Option<PoolId> {
        let hi = lo.checked_add(size).filter(|_| size > 0)?;
        let id = PoolId(self.next);
        self.next += 1;
        let at = self.sorted.partition_point(|p| (p.lo, p.id) < (lo, id));
        self.sorted.insert(at, Pool { id, lo, hi });
        self.los.insert(id, lo);
        Some(id)
    }

    /// Releases a pool; `None` if it is not registered.
    pub fn remove(&mut self, id: PoolId) -> Option<Pool> {
        let lo = self.los.remove(&id)?;
        let at = self.sorted.partition_point(|p| (p.lo, p.id) < (lo, id));
        let pool = self.sorted.remove(at);
        debug_assert_eq!(pool.id, id);
        self.rebuild();
        Some(pool)
    }

    /// The pool `id`, if it is registered.
    pub fn get(&self, id: PoolId) -> Option<Pool> {
        let lo = *self.los.get(&id)?;
        let at = self.sorted.partition_point(|p| (p.lo, p.id) < (lo, id));
        self.sorted.get(at).copied()
    }

    /// Every pool, sorted by `(lo, id)`.
    pub fn iter(&self) -> impl Iterator<Item = &Pool> {
        self.sorted.iter()
    }

    fn rebuild(&mut self) {
        let n = self.sorted.len();
        self.leaves = n.next_power_of_two().max(1);
        self.tree.clear();
        self.tree.resize(2 * self.leaves, 0);
        for (i, p) in self.sorted.iter().enumerate() {
            self.tree[self.leaves + i] = p.hi;
        }
        for i in (1..self.leaves).rev() {
            self.tree[i] = self.tree[2 * i].max(self.tree[2 * i + 1]);
        }
    }

    /// The pools that run across `x` strictly (`lo < x < hi`), sorted by `(lo, id)`.
    pub fn across(&self, x: u64) -> Vec<Pool> {
        let mut out = Vec::new();
        // Pools at positions below `k` start below `x`.
        let k = self.sorted.partition_point(|p| p.lo < x);
        if k > 0 {
            self.walk(1, 0, self.leaves, k, x, &mut out);
        }
        out
    }

    /// The pools that overlap `lo..hi` (`p.lo < hi` and `lo < p.hi`), sorted by `(lo, id)`.
    pub fn overlapping(&self, lo: u64, hi: u64) -> Vec<Pool> {
        let mut out = Vec::new();
        let k = self.sorted.partition_point(|p| p.lo < hi);
        if k > 0 && lo < hi {
            self.walk(1, 0, self.leaves, k, lo, &mut out);
        }
        out
    }

    /// Collects the pools at positions `< k` under node `node` (covering `from..to`) with `hi > x`.
    fn walk(&self, node: usize, from: usize, to: usize, k: usize, x: u64, out: &mut Vec<Pool>) {
        if from >= k || self.tree[node] <= x {
            return;
        }
        if to - from == 1 {
            out.push(self.sorted[from]);
            return;
        }
        let mid = (from + to) / 2;
        self.walk(2 * node, from, mid, k, x, out);
        self.walk(2 * node + 1, mid, to, k, x, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(p: &Pools, x: u64) -> Vec<PoolId> {
        p.iter().filter(|q| q.lo < x && x < q.hi).map(|q| q.id).collect()
    }

    #[test]
    fn across_is_strict_and_finds_long_pools_behind_short_ones() {
        let mut p = Pools::new();
        let long = p.add(0x1000, 0x100_000).unwrap();
        let short = p.add(0x8000, 0x1000).unwrap();
        let touching = p.add(0x20_000, 0x1000).unwrap();
        assert_eq!(p.across(0x8800).iter().map(|q| q.id).collect::<Vec<_>>(), vec![long, short]);
        // Touching an end is not running across it.
        assert_eq!(p.across(0x9000).iter().map(|q| q.id).collect::<Vec<_>>(), vec![long]);
        assert_eq!(p.across(0x20_000).iter().map(|q| q.id).collect::<Vec<_>>(), vec![long]);
        assert_eq!(p.across(0x20_800).iter().map(|q| q.id).collect::<Vec<_>>(), vec![long, touching]);
        assert!(p.across(0x1000).is_empty());
        assert!(p.across(0x101_000).is_empty());
        p.remove(long).unwrap();
        assert_eq!(p.across(0x8800).iter().map(|q| q.id).collect::<Vec<_>>(), vec![short]);
        assert!(p.remove(long).is_none());
    }

    #[test]
    fn zero_sizes_and_wraps_are_refused() {
        let mut p = Pools::new();
        assert!(p.add(0x1000, 0).is_none());
        assert!(p.add(u64::MAX - 10, 100).is_none());
        assert!(p.extend([(0, 1), (5, 0)]).is_none());
        assert!(p.is_empty());
    }

    #[test]
    fn the_index_agrees_with_a_scan_over_random_layouts() {
        let mut rng = crate::rng::Rng::new(0x1234_5678_9abc_def0);
        let mut next = move || rng.next_u64();
        let mut p = Pools::new();
        let mut ids = Vec::new();
        for round in 0..2000 {
            if round % 3 == 2 && !ids.is_empty() {
                let i = (next() % ids.len() as u64) as usize;
                p.remove(ids.swap_remove(i)).unwrap();
            } else {
                let size = if next() % 20 == 0 { 1 + next() % 0x1000_0000 } else { 1 + next() % 0x10_0000 };
                ids.push(p.add(next() % 0x4000_0000, size).unwrap());
            }
            let x = next() % 0x5000_0000;
            assert_eq!(p.across(x).iter().map(|q| q.id).collect::<Vec<_>>(), naive(&p, x), "at {x:#x}");
            let len = next() % 0x100_0000;
            let over: Vec<PoolId> = p.iter().filter(|q| q.lo < x + len && x < q.hi).map(|q| q.id).collect();
            assert_eq!(p.overlapping(x, x + len).iter().map(|q| q.id).collect::<Vec<_>>(), over, "{x:#x}+{len:#x}");
        }
    }
}
