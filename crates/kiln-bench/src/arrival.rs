//! When each request is sent: all at once (`--request-rate inf`), or a gamma-distributed
//! arrival process with mean rate `rate` and shape `burstiness` (1 = Poisson; below 1 burstier,
//! above 1 more regular), as vLLM's `bench serve` does.
//!
//! Invariant: offsets are non-decreasing and start at 0 for the first request; the same seed
//! gives the same offsets.

use kiln_core::Rng;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RequestRate {
    Infinite,
    PerSecond(f64),
}

impl std::str::FromStr for RequestRate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("inf") {
            return Ok(Self::Infinite);
        }
        match s.parse::<f64>() {
            Ok(r) if r.is_finite() && r > 0.0 => Ok(Self::PerSecond(r)),
            Ok(r) if r.is_infinite() && r > 0.0 => Ok(Self::Infinite),
            _ => Err(format!("`{s}` is not a request rate (a positive number or `inf`)")),
        }
    }
}

impl std::fmt::Display for RequestRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Infinite => f.write_str("inf"),
            Self::PerSecond(r) => write!(f, "{r}"),
        }
    }
}

/// Send times in seconds after the start, one per request.
pub fn arrival_offsets(n: usize, rate: RequestRate, burstiness: f64, seed: u64) -> Vec<f64> {
    let RequestRate::PerSecond(rate) = rate else {
        return vec![0.0; n];
    };
    let mut rng = Rng::new(seed ^ 0x5EED_A881_7A1E);
    let scale = 1.0 / (rate * burstiness);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += gamma(&mut rng, burstiness) * scale;
            }
            t
        })
        .collect()
}

/// A Gamma(shape, 1) draw (Marsaglia and Tsang; shapes below 1 boosted by `U^(1/shape)`).
fn gamma(rng: &mut Rng, shape: f64) -> f64 {
    if shape < 1.0 {
        let u = open01(rng);
        return gamma(rng, shape + 1.0) * u.powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u = open01(rng);
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v;
        }
    }
}

/// Uniform in `(0, 1)`.
fn open01(rng: &mut Rng) -> f64 {
    loop {
        let u = rng.next_f64();
        if u > 0.0 {
            return u;
        }
    }
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut Rng) -> f64 {
    let (u1, u2) = (open01(rng), rng.next_f64());
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean_and_cv(gaps: &[f64]) -> (f64, f64) {
        let n = gaps.len() as f64;
        let mean = gaps.iter().sum::<f64>() / n;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn infinite_rate_sends_everything_at_once() {
        assert_eq!(arrival_offsets(3, RequestRate::Infinite, 1.0, 0), vec![0.0; 3]);
        assert_eq!("inf".parse::<RequestRate>(), Ok(RequestRate::Infinite));
        assert_eq!("2.5".parse::<RequestRate>(), Ok(RequestRate::PerSecond(2.5)));
        assert!("0".parse::<RequestRate>().is_err() && "-1".parse::<RequestRate>().is_err());
        assert!("NaN".parse::<RequestRate>().is_err());
    }

    #[test]
    fn gamma_arrivals_have_the_rate_and_burstiness_asked() {
        // Gamma(k, 1/(rate k)) gaps: mean 1/rate, coefficient of variation 1/sqrt(k).
        for (rate, k) in [(4.0, 1.0), (10.0, 0.25), (2.0, 4.0)] {
            let t = arrival_offsets(40_001, RequestRate::PerSecond(rate), k, 7);
            assert_eq!(t[0], 0.0);
            assert!(t.windows(2).all(|w| w[1] >= w[0]));
            let gaps: Vec<f64> = t.windows(2).map(|w| w[1] - w[0]).collect();
            let (mean, cv) = mean_and_cv(&gaps);
            assert!((mean * rate - 1.0).abs() < 0.03, "rate {rate} k {k}: mean gap {mean}");
            let want_cv = 1.0 / f64::sqrt(k);
            assert!((cv / want_cv - 1.0).abs() < 0.05, "rate {rate} k {k}: cv {cv}");
        }
        assert_eq!(
            arrival_offsets(5, RequestRate::PerSecond(1.0), 1.0, 1),
            arrival_offsets(5, RequestRate::PerSecond(1.0), 1.0, 1)
        );
    }
}
