//! Flow-size distributions as piecewise-linear CDFs (the HPCC artifact's `traffic_gen` format:
//! size in bytes, cumulative percent), sampled by linear interpolation.

use rand::Rng;

/// A flow-size CDF.
pub(super) struct Cdf(pub &'static [(f64, f64)]);

/// WebSearch (DCTCP paper), as used by HPCC.
pub(super) const WEBSEARCH: Cdf = Cdf(&[
    (0.0, 0.0),
    (10_000.0, 15.0),
    (20_000.0, 20.0),
    (30_000.0, 30.0),
    (50_000.0, 40.0),
    (80_000.0, 53.0),
    (200_000.0, 60.0),
    (1_000_000.0, 70.0),
    (2_000_000.0, 80.0),
    (5_000_000.0, 90.0),
    (10_000_000.0, 97.0),
    (30_000_000.0, 100.0),
]);

impl Cdf {
    /// A size drawn from the distribution.
    pub(super) fn sample(&self, rng: &mut impl Rng) -> f64 {
        let u = rng.random::<f64>() * 100.0;
        for w in self.0.windows(2) {
            let ((x0, y0), (x1, y1)) = (w[0], w[1]);
            if u <= y1 && y1 > y0 {
                return x0 + (x1 - x0) * (u - y0) / (y1 - y0);
            }
        }
        self.0.last().map_or(0.0, |p| p.0)
    }

    /// The mean size (trapezoids between the points).
    pub(super) fn mean(&self) -> f64 {
        self.0
            .windows(2)
            .map(|w| (w[0].0 + w[1].0) / 2.0 * (w[1].1 - w[0].1) / 100.0)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn websearch_mean_and_samples_agree() {
        assert!((WEBSEARCH.mean() - 1_711_250.0).abs() < 1.0, "{}", WEBSEARCH.mean());
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let n = 200_000;
        let m: f64 = (0..n).map(|_| WEBSEARCH.sample(&mut rng)).sum::<f64>() / n as f64;
        assert!((m / WEBSEARCH.mean() - 1.0).abs() < 0.03, "{m}");
    }
}
