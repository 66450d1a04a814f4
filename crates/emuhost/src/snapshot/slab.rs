//! The kept pages' bytes: page-sized slots in chunks of many pages, recycled when a version goes
//! (and all of them when every snapshot goes), so a take's copies land in memory touched before
//! (no fault per copy once warm) and cost no allocation each. The memory stays until the
//! snapshots go: as much as the most bytes kept at once, rounded up to a chunk.

/// Pages per chunk: 1 MiB of 4 KiB pages.
const CHUNK_PAGES: usize = 256;

/// Page-sized slots, numbered from 0: slot `s` is page `s % CHUNK_PAGES` of chunk
/// `s / CHUNK_PAGES`.
pub(super) struct Slab {
    page: usize,
    chunks: Vec<Box<[u8]>>,
    /// The free slots; the last freed is handed out first (still in the caches).
    free: Vec<usize>,
}

impl Slab {
    /// An empty slab of `page`-byte slots.
    pub(super) fn new(page: usize) -> Slab {
        Slab { page, chunks: Vec::new(), free: Vec::new() }
    }

    /// `n` free slots, in ascending order (new chunks where the free ones run out).
    pub(super) fn alloc(&mut self, n: usize) -> Vec<usize> {
        while self.free.len() < n {
            self.grow();
        }
        let mut slots = self.free.split_off(self.free.len() - n);
        slots.sort_unstable();
        slots
    }

    /// A free slot holding a copy of `bytes` (a page; copy before write's copies, one at a time).
    pub(super) fn put(&mut self, bytes: &[u8]) -> usize {
        if self.free.is_empty() {
            self.grow();
        }
        let s = self.free.pop().expect("a chunk was just added");
        let at = s % CHUNK_PAGES * self.page;
        self.chunks[s / CHUNK_PAGES][at..at + self.page].copy_from_slice(bytes);
        s
    }

    /// One more chunk, its slots free.
    fn grow(&mut self) {
        let first = self.chunks.len() * CHUNK_PAGES;
        self.chunks.push(vec![0; self.page * CHUNK_PAGES].into_boxed_slice());
        self.free.extend((first..first + CHUNK_PAGES).rev());
    }

    /// Frees slot `s` for a later [`Slab::alloc`].
    pub(super) fn release(&mut self, s: usize) {
        self.free.push(s);
    }

    /// Frees every slot (the memory stays, for the next allocations).
    pub(super) fn release_all(&mut self) {
        self.free.clear();
        self.free.extend((0..self.chunks.len() * CHUNK_PAGES).rev());
    }

    /// Slot `s`'s bytes.
    pub(super) fn get(&self, s: usize) -> &[u8] {
        let at = s % CHUNK_PAGES * self.page;
        &self.chunks[s / CHUNK_PAGES][at..at + self.page]
    }

    /// The bytes of the `slots` (ascending, each once), each writable, in that order.
    pub(super) fn slices_mut(&mut self, slots: &[usize]) -> Vec<&mut [u8]> {
        debug_assert!(slots.is_sorted_by(|a, b| a < b));
        let p = self.page;
        let mut out = Vec::with_capacity(slots.len());
        // The chunks after the current one, the current chunk's pages after the last handed out.
        let mut rest: &mut [Box<[u8]>] = &mut self.chunks;
        let mut rest_first = 0;
        let (mut tail, mut tail_chunk, mut tail_at): (&mut [u8], usize, usize) = (&mut [], usize::MAX, 0);
        for &s in slots {
            let (c, i) = (s / CHUNK_PAGES, s % CHUNK_PAGES);
            if c != tail_chunk {
                let (first, after) =
                    std::mem::take(&mut rest)[c - rest_first..].split_first_mut().expect("a slot's chunk");
                (rest, rest_first) = (after, c + 1);
                (tail, tail_chunk, tail_at) = (&mut first[..], c, 0);
            }
            let (page, after) = std::mem::take(&mut tail)[(i - tail_at) * p..].split_at_mut(p);
            out.push(page);
            (tail, tail_at) = (after, i + 1);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_recycled_and_hand_out_their_own_bytes() {
        let mut slab = Slab::new(16);
        let a = slab.alloc(CHUNK_PAGES + 3);
        assert_eq!(a.len(), CHUNK_PAGES + 3);
        assert!(a.is_sorted_by(|x, y| x < y));
        for (n, page) in slab.slices_mut(&a).into_iter().enumerate() {
            page.fill(n as u8);
        }
        for (n, &s) in a.iter().enumerate() {
            assert_eq!(slab.get(s), &[n as u8; 16]);
        }
        // Freed slots come back before any new chunk.
        slab.release(a[5]);
        slab.release(a[CHUNK_PAGES + 1]);
        let chunks = slab.chunks.len();
        let mut b = slab.alloc(2);
        b.sort_unstable();
        assert_eq!(b, [a[5], a[CHUNK_PAGES + 1]]);
        assert_eq!(slab.chunks.len(), chunks);
        let pages = slab.slices_mut(&b);
        assert_eq!(pages.len(), 2);
        assert_eq!((pages[0][0], pages[1][0]), (5, (CHUNK_PAGES + 1) as u8));
        // A page put in takes a free slot and holds its bytes.
        let s = slab.put(&[9; 16]);
        assert_eq!(slab.get(s), &[9; 16]);
        slab.release(s);
        // Every slot freed at once: all come back, in the same memory.
        slab.release_all();
        let all = slab.alloc(2 * CHUNK_PAGES);
        assert_eq!(all, (0..2 * CHUNK_PAGES).collect::<Vec<_>>());
        assert_eq!(slab.chunks.len(), chunks);
    }
}
