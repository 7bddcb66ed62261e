//! Summary statistics of latency samples: mean, median, population standard deviation and
//! percentiles by linear interpolation between order statistics (numpy's default, which vLLM's
//! `bench serve` reports). An empty sample summarises to zeros.

use serde::Serialize;

/// Summary of one metric, in the samples' unit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Distribution {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    /// `(p, value)` for each requested percentile `p` in `[0, 100]`.
    pub percentiles: Vec<(f64, f64)>,
}

impl Distribution {
    pub fn of(samples: &[f64], percentiles: &[f64]) -> Self {
        let mut sorted: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        sorted.sort_by(f64::total_cmp);
        if sorted.is_empty() {
            return Self {
                mean: 0.0,
                median: 0.0,
                std: 0.0,
                percentiles: percentiles.iter().map(|&p| (p, 0.0)).collect(),
            };
        }
        let n = sorted.len() as f64;
        let mean = sorted.iter().sum::<f64>() / n;
        let var = sorted.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        Self {
            mean,
            median: percentile(&sorted, 50.0),
            std: var.sqrt(),
            percentiles: percentiles.iter().map(|&p| (p, percentile(&sorted, p))).collect(),
        }
    }

    /// The value at percentile `p`, if it was requested.
    pub fn at(&self, p: f64) -> Option<f64> {
        self.percentiles.iter().find(|(q, _)| *q == p).map(|&(_, v)| v)
    }
}

/// `p`-th percentile of ascending `sorted` (non-empty), interpolating linearly.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = p.clamp(0.0, 100.0) / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// Parses `50,95,99` into percentiles, each in `[0, 100]`.
pub fn parse_percentiles(s: &str) -> Result<Vec<f64>, String> {
    s.split(',')
        .map(|p| match p.trim().parse::<f64>() {
            Ok(v) if (0.0..=100.0).contains(&v) => Ok(v),
            _ => Err(format!("`{p}` is not a percentile in [0, 100]")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_numpy_linear_percentiles() {
        // numpy: np.percentile([1, 2, 3, 4, 10], [50, 90, 99]) = [3.0, 7.6, 9.76]
        let d = Distribution::of(&[10.0, 1.0, 3.0, 2.0, 4.0], &[50.0, 90.0, 99.0]);
        assert_eq!(d.median, 3.0);
        assert!((d.at(90.0).unwrap() - 7.6).abs() < 1e-12);
        assert!((d.at(99.0).unwrap() - 9.76).abs() < 1e-12);
        assert_eq!(d.mean, 4.0);
        assert!((d.std - 10f64.sqrt()).abs() < 1e-12); // population std: var = 50 / 5
        assert_eq!(d.at(95.5), None);
    }

    #[test]
    fn empty_and_single_samples() {
        let d = Distribution::of(&[], &[99.0]);
        assert_eq!((d.mean, d.median, d.std, d.at(99.0)), (0.0, 0.0, 0.0, Some(0.0)));
        let d = Distribution::of(&[5.0, f64::NAN], &[1.0, 99.0]);
        assert_eq!((d.mean, d.at(1.0), d.at(99.0)), (5.0, Some(5.0), Some(5.0)));
    }

    #[test]
    fn parses_percentile_lists() {
        assert_eq!(parse_percentiles("50, 95,99.9"), Ok(vec![50.0, 95.0, 99.9]));
        assert!(parse_percentiles("50,101").is_err());
        assert!(parse_percentiles("x").is_err());
    }
}
