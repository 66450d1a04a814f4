//! The kept pages: each page's versions, shared by every snapshot in which its bytes are
//! unchanged, and what a snapshot that goes frees.
//!
//! A take is numbered (its epoch: its id). A page's versions are `(epoch, bytes)` in epoch order;
//! snapshot `k`'s bytes of a page committed at `k` are the last version at or before `k`. A
//! version without bytes (a tombstone) says the page was not committed at that take (so the
//! version before it can go when no snapshot needs it). The pinned epochs are the live snapshots
//! and the newest take (the base the next take shares). A version is kept while a pinned epoch
//! lies between it and the next version; when an epoch `s` stops being pinned, the only versions
//! that may go are those covering `s`, of pages copied by a take after `s` up to the next pinned
//! epoch: so what a release frees costs what was written around it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use super::pages::page;
use super::slab::Slab;
use crate::space::{GuestRange, Prot};

/// One take: its runs (kept while its epoch is pinned) and the pages it copied (kept while a
/// live snapshot is older).
pub(super) struct Take {
    /// The committed runs and their protections at the take; `None` once unpinned.
    pub(super) runs: Option<Vec<(GuestRange, Prot)>>,
    /// The pages (indices in the range) it stored a version of, in order.
    pub(super) copied: Vec<u64>,
}

/// One version of a page: its bytes at the takes from `epoch` on, a slot of the slab (`None`:
/// not committed; [`PENDING`]: bytes to come, copy before write).
pub(super) struct Version {
    pub(super) epoch: u64,
    pub(super) bytes: Option<usize>,
}

/// The slot of a pending version (copy before write): no slot yet, no bytes kept; the page's
/// first copy after the take is written into a slot of its own (`cow::fill`).
pub(super) const PENDING: usize = usize::MAX;

/// Hashes a page index with one multiply: the keys are the range's own page indices, and the
/// default hasher (SipHash) cost as much as the rest of a lookup.
#[derive(Default)]
pub(super) struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64((self.0 << 8) | u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        let m = u128::from(n ^ self.0) * 0x9e37_79b9_7f4a_7c15;
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

/// The kept pages, the takes and which are live.
pub(super) struct Store {
    pub(super) takes: BTreeMap<u64, Take>,
    pub(super) versions: HashMap<u64, Vec<Version>, BuildHasherDefault<PageHasher>>,
    pub(super) live: BTreeSet<u64>,
    /// The newest take's epoch, pinned as the base of the next take; `None`: nothing kept.
    pub(super) head: Option<u64>,
    /// Bytes of versions kept.
    pub(super) bytes: u64,
    /// The versions' bytes.
    pub(super) slab: Slab,
}

impl Default for Store {
    fn default() -> Store {
        Store {
            takes: BTreeMap::new(),
            versions: HashMap::default(),
            live: BTreeSet::new(),
            head: None,
            bytes: 0,
            slab: Slab::new(page() as usize),
        }
    }
}

impl Store {
    /// Snapshot `k`'s bytes of page `i` (the last version at or before `k`, if it has bytes;
    /// empty where it is pending).
    pub(super) fn bytes_at(&self, i: u64, k: u64) -> Option<&[u8]> {
        self.slot_at(i, k).map(|s| if s == PENDING { &[][..] } else { self.slab.get(s) })
    }

    /// The slab slot of snapshot `k`'s bytes of page `i`, as [`Store::bytes_at`] ([`PENDING`]
    /// where it is pending).
    pub(super) fn slot_at(&self, i: u64, k: u64) -> Option<usize> {
        let chain = self.versions.get(&i)?;
        let n = chain.partition_point(|v| v.epoch <= k);
        chain.get(n.checked_sub(1)?)?.bytes
    }

    /// The pages of the takes after epoch `k` up to `upto` (`None`: the newest), each once per
    /// take.
    pub(super) fn copied_after(&self, k: u64, upto: Option<u64>) -> impl Iterator<Item = u64> + '_ {
        let upto = upto.unwrap_or(u64::MAX);
        let takes = if k < upto { Some(self.takes.range(k + 1..=upto)) } else { None };
        takes.into_iter().flatten().flat_map(|(_, t)| t.copied.iter().copied())
    }

    /// Whether page `i`'s newest version has bytes (a tombstone after it would say something).
    pub(super) fn has_bytes(&self, i: u64) -> bool {
        self.versions.get(&i).and_then(|c| c.last()).is_some_and(|v| v.bytes.is_some())
    }

    /// Adds a version of page `i` at `epoch` (the newest), its bytes in slab slot `bytes` (a
    /// pending one keeps none yet).
    pub(super) fn push(&mut self, i: u64, epoch: u64, bytes: Option<usize>) {
        self.bytes += bytes.filter(|&s| s != PENDING).map_or(0, |_| page());
        self.versions.entry(i).or_default().push(Version { epoch, bytes });
    }

    fn pinned(&self, e: u64) -> bool {
        self.live.contains(&e) || self.head == Some(e)
    }

    /// The pinned epochs just before and just after `s` (`None` where there is none).
    fn neighbours(&self, s: u64) -> (Option<u64>, Option<u64>) {
        let before = self.live.range(..s).next_back().copied();
        let after = self.live.range(s + 1..).next().copied().or(self.head.filter(|&h| h > s));
        (before, after)
    }

    /// Frees what only epoch `s` kept, now that it is not pinned (see the module's doc).
    pub(super) fn unpin(&mut self, s: u64) {
        debug_assert!(!self.pinned(s));
        let (before, after) = self.neighbours(s);
        if let Some(t) = self.takes.get_mut(&s) {
            t.runs = None;
        }
        let Some(after) = after else { return self.clear() };
        let mut pages: Vec<u64> = self.takes.range(s + 1..=after).flat_map(|(_, t)| t.copied.iter().copied()).collect();
        pages.sort_unstable();
        pages.dedup();
        for i in pages {
            self.free_covering(i, s, before, after);
        }
        self.prune();
    }

    /// Frees page `i`'s version covering `s` where no pinned epoch needs it: it starts after
    /// `before` and the next version starts at or before `after`.
    fn free_covering(&mut self, i: u64, s: u64, before: Option<u64>, after: u64) {
        let Some(chain) = self.versions.get_mut(&i) else { return };
        let n = chain.partition_point(|v| v.epoch <= s);
        let Some(at) = n.checked_sub(1) else { return };
        let starts_after_before = before.is_none_or(|b| chain[at].epoch > b);
        let next_by_after = chain.get(at + 1).is_some_and(|v| v.epoch <= after);
        if starts_after_before && next_by_after {
            let v = chain.remove(at);
            if let Some(s) = v.bytes.filter(|&s| s != PENDING) {
                self.bytes -= page();
                self.slab.release(s);
            }
        }
        // A tombstone first says nothing.
        while chain.first().is_some_and(|v| v.bytes.is_none()) {
            chain.remove(0);
        }
        if chain.is_empty() {
            self.versions.remove(&i);
        }
    }

    /// Drops the takes no restore or release needs any more: those at or before the oldest
    /// pinned epoch that are not pinned themselves.
    fn prune(&mut self) {
        let oldest = self.live.first().copied().or(self.head);
        let Some(oldest) = oldest else { return };
        let gone: Vec<u64> = self.takes.range(..oldest).map(|(&e, _)| e).collect();
        for e in gone {
            self.takes.remove(&e);
        }
    }

    /// Frees everything: the next take copies the whole range again, into the slab's memory
    /// (kept: the next takes fault none of it in again).
    pub(super) fn clear(&mut self) {
        let mut slab = std::mem::replace(&mut self.slab, Slab::new(page() as usize));
        slab.release_all();
        *self = Store { live: std::mem::take(&mut self.live), slab, ..Store::default() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pending_version_counts_no_bytes_and_frees_no_slot() {
        let mut s = Store::default();
        s.takes.insert(1, Take { runs: Some(Vec::new()), copied: vec![0] });
        s.push(0, 1, Some(PENDING));
        s.live.insert(1);
        s.head = Some(1);
        assert_eq!(s.bytes, 0);
        let slot = s.slab.alloc(1)[0];
        s.takes.insert(2, Take { runs: Some(Vec::new()), copied: vec![0] });
        s.push(0, 2, Some(slot));
        s.live.insert(2);
        s.head = Some(2);
        assert_eq!(s.bytes, page());
        // Releasing take 1 frees its version of page 0, still pending (a copy not harvested yet).
        s.live.remove(&1);
        s.unpin(1);
        assert_eq!((s.bytes, s.versions[&0].len()), (page(), 1));
        // No slot was freed for it: the next one handed out is a real slot.
        let next = s.slab.put(&vec![7; page() as usize]);
        assert_eq!(s.slab.get(next)[0], 7);
    }
}
