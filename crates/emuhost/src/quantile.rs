//! Quantiles of measured samples: the one rule behind every percentile and median of the
//! workspace: the importer's learned cost (the 90th percentile of recent imports), and what the
//! lab and the CLI print (replays, benches, A/B runs; the lab re-exports this module).
//!
//! - [`quantile`]: the nearest rank. The value at quantile `q` of `n` sorted samples is the
//!   `ceil(n * q)`-th smallest (at least the first): `q` = 0.5 the lower middle, 0.99 the
//!   99th percentile, 1.0 the largest.
//! - [`median`]: the middle sample, or the mean of the two middle ones for an even count.
//! - [`top_mean`]: the mean of the largest share of the samples (a replay's 1 % low is the frame
//!   rate of the slowest 1 % of frames, averaged).
//! - No samples: all give 0.0, not NaN, so that a figure of nothing stays a number in the
//!   JSON reports (serde_json writes NaN as `null`) and in the tables.

/// The value at quantile `q` (0.0 to 1.0) of `sorted` (ascending), by nearest rank; 0.0 for no
/// samples.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// The median of `v` (sorted in place first); 0.0 for no samples.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The mean of the largest `frac` (0.0 to 1.0) of `v`: of its `ceil(n * frac)` largest samples,
/// at least one; 0.0 for no samples. `v` need not be sorted.
pub fn top_mean(v: &[f64], frac: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    let n = ((v.len() as f64 * frac).ceil() as usize).clamp(1, v.len());
    v[..n].iter().sum::<f64>() / n as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&v, 0.0), 1.0, "at least the first");
        assert_eq!(quantile(&[7.0], 0.999), 7.0);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn top_mean_of_the_largest_share() {
        let v: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(top_mean(&v, 0.01), 199.5, "the largest 2");
        assert_eq!(top_mean(&v, 0.001), 200.0, "at least one");
        assert_eq!(top_mean(&[3.0, 9.0, 1.0], 1.0), 13.0 / 3.0);
    }

    #[test]
    fn no_samples_give_zero() {
        assert_eq!(quantile(&[], 0.5), 0.0);
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(top_mean(&[], 0.01), 0.0);
    }
}
