//! The one deterministic generator of the workspace: xoshiro256** seeded through splitmix64.
//! Small, fast and the same on every platform, so a seed names one synthetic session, one shader
//! corpus, one stress run or one benchmark layout everywhere. Not for anything secret.

/// splitmix64: advances `x` and returns its next output (also how [`Rng::new`] seeds).
pub fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// xoshiro256**: [`Rng::new`] with a seed, then draws.
///
/// ```
/// use emuhost::rng::Rng;
///
/// let mut a = Rng::new(42);
/// let mut b = Rng::new(42);
/// // A seed names one sequence, on every platform.
/// assert_eq!(a.next_u64(), b.next_u64());
/// let d = a.range(10, 20);
/// assert!((10..20).contains(&d));
/// let mut v = [1, 2, 3, 4];
/// a.shuffle(&mut v);
/// v.sort();
/// assert_eq!(v, [1, 2, 3, 4]);
/// ```
#[derive(Clone, Debug)]
pub struct Rng([u64; 4]);

impl Rng {
    /// The generator a seed names (any seed, 0 included).
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        Rng([splitmix(&mut x), splitmix(&mut x), splitmix(&mut x), splitmix(&mut x)])
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in `lo..hi`; `lo` where the range is empty.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + ((u128::from(self.next_u64()) * u128::from(hi - lo)) >> 64) as u64
    }

    /// Uniform in `0..n`; 0 where `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        self.range(0, n)
    }

    /// One element of `v`, uniformly.
    ///
    /// # Panics
    /// Where `v` is empty.
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }

    /// Shuffles `v` (Fisher–Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.range(0, i as u64 + 1) as usize);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_names_one_sequence_and_draws_are_uniform_enough() {
        let mut r = Rng::new(1);
        let first: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        let mut again = Rng::new(1);
        assert_eq!(first, (0..3).map(|_| again.next_u64()).collect::<Vec<_>>());
        assert_ne!(first, (0..3).map(|_| Rng::new(2).next_u64()).collect::<Vec<_>>());
        let mut counts = [0u32; 10];
        for _ in 0..10_000 {
            counts[r.range(0, 10) as usize] += 1;
        }
        assert!(counts.iter().all(|&c| (900..1100).contains(&c)), "{counts:?}");
        assert_eq!((r.below(0), r.range(7, 7), r.range(9, 3)), (0, 7, 9));
    }

    /// The published xoshiro256** and splitmix64 outputs: a seed's session stays the same.
    #[test]
    fn the_outputs_are_the_reference_algorithms() {
        let mut x = 0;
        assert_eq!(splitmix(&mut x), 0xe220_a839_7b1d_cdaf);
        let mut r = Rng([1, 2, 3, 4]);
        assert_eq!(r.next_u64(), 11520);
        assert_eq!(r.next_u64(), 0);
        assert_eq!(r.next_u64(), 1509978240);
    }
}
