//! Quantiles of measured samples: the one rule behind every percentile and median the lab and
//! the CLI print (replays, benches, A/B runs).
//!
//! - [`quantile`]: the nearest rank. The value at quantile `q` of `n` sorted samples is the
//!   `ceil(n * q)`-th smallest (at least the first): `q` = 0.5 the lower middle, 0.99 the
//!   99th percentile, 1.0 the largest.
//! - [`median`]: the middle sample, or the mean of the two middle ones for an even count.
//! - No samples: both give 0.0, not NaN, so that a figure of nothing stays a number in the
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
    fn no_samples_give_zero() {
        assert_eq!(quantile(&[], 0.5), 0.0);
        assert_eq!(median(&mut []), 0.0);
    }
}
