//! Sets of pages of the snapshots' range (a bit per page), and the space's committed runs with
//! their protections as the snapshots record them.

use std::collections::BTreeMap;

use crate::space::{GuestRange, Prot, page_size};

/// A set of pages of a range: bit `i` is the range's page `i`. Sparse: only the words with a
/// page in them are kept (in order), so a set's cost follows the pages in it, not the range's
/// size (a take over a 512 GiB window with ~150 pages written cost ~10 ms per take in passes
/// over range-sized bitmaps).
#[derive(Clone, Debug, Default)]
pub(super) struct PageSet {
    words: BTreeMap<u64, u64>,
}

impl PageSet {
    /// An empty set.
    pub(super) fn new() -> PageSet {
        PageSet::default()
    }

    pub(super) fn set(&mut self, i: u64) {
        *self.words.entry(i / 64).or_insert(0) |= 1 << (i % 64);
    }

    pub(super) fn has(&self, i: u64) -> bool {
        self.words.get(&(i / 64)).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// Adds pages `a..b`.
    pub(super) fn set_run(&mut self, a: u64, b: u64) {
        let mut i = a;
        while i < b {
            let (lo, hi) = (i % 64, (b - (i - i % 64)).min(64));
            let mask = if hi - lo == 64 { u64::MAX } else { ((1u64 << (hi - lo)) - 1) << lo };
            *self.words.entry(i / 64).or_insert(0) |= mask;
            i = i - lo + 64;
        }
    }

    /// Adds every page of `other` (a set over the same range).
    pub(super) fn or(&mut self, other: &PageSet) {
        for (&k, &o) in &other.words {
            *self.words.entry(k).or_insert(0) |= o;
        }
    }

    pub(super) fn clear(&mut self) {
        self.words.clear();
    }

    /// The pages in the set, in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.words.iter().flat_map(|(&w, &word)| {
            let mut bits = word;
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let b = bits.trailing_zeros() as u64;
                    bits &= bits - 1;
                    w * 64 + b
                })
            })
        })
    }

    pub(super) fn count(&self) -> u64 {
        self.words.values().map(|w| u64::from(w.count_ones())).sum()
    }
}

/// The committed runs of a range, each with the protection the space gave it, in address order
/// and apart ([`Space::protections`](crate::space::Space::protections)).
pub(super) type Runs = [(GuestRange, Prot)];

/// The protection of the page at guest `addr` in `runs` (`None`: not committed).
pub(super) fn prot_at(runs: &Runs, addr: u64) -> Option<Prot> {
    let i = runs.partition_point(|(r, _)| r.end().0 <= addr);
    runs.get(i).filter(|(r, _)| r.start().0 <= addr).map(|&(_, p)| p)
}

/// The parts of the runs `a` that no run of `b` covers.
pub(super) fn subtract(a: &Runs, b: &Runs) -> Vec<GuestRange> {
    let mut out = Vec::new();
    for &(r, _) in a {
        let (mut at, end) = (r.start().0, r.end().0);
        let first = b.partition_point(|(c, _)| c.end().0 <= at);
        for &(c, _) in b[first..].iter().take_while(|(c, _)| c.start().0 < end) {
            if c.start().0 > at {
                out.push(GuestRange::from_bounds(at, c.start().0).expect("page-aligned"));
            }
            at = at.max(c.end().0);
        }
        if at < end {
            out.push(GuestRange::from_bounds(at, end).expect("page-aligned"));
        }
    }
    out
}

/// The parts of the runs `want` whose protection in `have` differs (or which `have` lacks), each
/// with the protection `want` gives it.
pub(super) fn differing(want: &Runs, have: &Runs) -> Vec<(GuestRange, Prot)> {
    let mut out: Vec<(GuestRange, Prot)> = Vec::new();
    let mut push = |a: u64, b: u64, p: Prot| match out.last_mut() {
        Some((r, q)) if r.end().0 == a && *q == p => *r = GuestRange::from_bounds(r.start().0, b).expect("aligned"),
        _ => out.push((GuestRange::from_bounds(a, b).expect("page-aligned"), p)),
    };
    for &(r, p) in want {
        let (mut at, end) = (r.start().0, r.end().0);
        let first = have.partition_point(|(c, _)| c.end().0 <= at);
        for &(c, q) in have[first..].iter().take_while(|(c, _)| c.start().0 < end) {
            if c.start().0 > at {
                push(at, c.start().0, p);
            }
            let (x, y) = (at.max(c.start().0), end.min(c.end().0));
            if q != p && x < y {
                push(x, y, p);
            }
            at = at.max(y);
        }
        if at < end {
            push(at, end, p);
        }
    }
    out
}

/// Whether every page of `a..b` is committed writable in `runs`.
pub(super) fn writable(runs: &Runs, a: u64, b: u64) -> bool {
    let first = runs.partition_point(|(r, _)| r.end().0 <= a);
    let mut at = a;
    for &(r, p) in runs[first..].iter().take_while(|(r, _)| r.start().0 < b) {
        if r.start().0 > at || !p.write {
            return false;
        }
        at = r.end().0;
    }
    at >= b
}

/// The host page size, as the snapshots count pages.
pub(super) fn page() -> u64 {
    page_size()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(a: u64, b: u64, p: Prot) -> (GuestRange, Prot) {
        (GuestRange::from_bounds(a * page(), b * page()).unwrap(), p)
    }

    #[test]
    fn subtract_leaves_the_parts_no_run_covers() {
        let rw = Prot::READ_WRITE;
        let got = subtract(&[r(0, 10, rw), r(12, 14, rw)], &[r(2, 3, rw), r(5, 11, rw)]);
        let want: Vec<GuestRange> = [r(0, 2, rw), r(3, 5, rw), r(12, 14, rw)].iter().map(|x| x.0).collect();
        assert_eq!(got, want);
        assert!(subtract(&[r(0, 4, rw)], &[r(0, 4, Prot::READ)]).is_empty());
    }

    #[test]
    fn differing_names_the_parts_to_protect() {
        let (rw, ro) = (Prot::READ_WRITE, Prot::READ);
        let got = differing(&[r(0, 10, ro)], &[r(2, 4, ro), r(4, 6, rw)]);
        assert_eq!(got, [r(0, 2, ro), r(4, 10, ro)]);
        assert!(differing(&[r(0, 4, rw)], &[r(0, 4, rw)]).is_empty());
        assert!(writable(&[r(0, 2, rw), r(2, 4, Prot::ALL)], 0, 4 * page()));
        assert!(!writable(&[r(0, 2, rw), r(3, 4, rw)], 0, 4 * page()));
        assert!(!writable(&[r(0, 4, ro)], page(), 2 * page()));
        assert_eq!((prot_at(&[r(2, 4, ro)], 3 * page()), prot_at(&[r(2, 4, ro)], 4 * page())), (Some(ro), None));
    }

    #[test]
    fn page_sets_iterate_in_order() {
        let mut s = PageSet::new();
        for i in [0, 63, 64, 130, 199] {
            s.set(i);
        }
        assert_eq!(s.iter().collect::<Vec<_>>(), [0, 63, 64, 130, 199]);
        assert_eq!(s.count(), 5);
        assert!(s.has(130) && !s.has(131));
    }

    #[test]
    fn page_set_runs_match_a_bit_at_a_time() {
        for a in [0, 1, 63, 64, 65, 127, 130] {
            for n in [0, 1, 2, 63, 64, 65, 128, 200] {
                let mut s = PageSet::new();
                s.set_run(a, a + n);
                assert_eq!(s.iter().collect::<Vec<_>>(), (a..a + n).collect::<Vec<_>>(), "{a} + {n}");
            }
        }
        let mut s = PageSet::new();
        for i in [3, 64 * 9 + 5, 64 * 39 + 63] {
            s.set(i);
        }
        assert_eq!(s.iter().collect::<Vec<_>>(), [3, 64 * 9 + 5, 64 * 39 + 63]);
        let mut o = PageSet::new();
        o.set_run(2, 5);
        s.or(&o);
        assert_eq!(s.iter().take(3).collect::<Vec<_>>(), [2, 3, 4]);
        s.clear();
        assert_eq!(s.count(), 0);
    }
}
