//! What `kiln tune` optimises: the most output throughput subject to latency limits, or the
//! lowest latency subject to a throughput floor (and the same limits). Latency metrics are
//! named `ttft_p95`, `tpot_p99`, `itl_p50`, `e2el_mean`, ... (milliseconds).
//!
//! A run is feasible when no request failed and every constraint holds.

use crate::result::BenchResult;

/// A latency metric of a run: TTFT, TPOT, ITL or E2E at a percentile (or the mean).
#[derive(Clone, Debug, PartialEq)]
pub struct Metric {
    pub name: String,
    kind: usize,
    /// `None` = mean.
    percentile: Option<f64>,
}

const KINDS: [&str; 4] = ["ttft", "tpot", "itl", "e2el"];

impl std::str::FromStr for Metric {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let err = || format!("`{s}` is not a latency metric (e.g. ttft_p95, tpot_p99, e2el_mean)");
        let (kind, stat) = s.split_once('_').ok_or_else(err)?;
        let kind = KINDS.iter().position(|k| *k == kind).ok_or_else(err)?;
        let percentile = match stat {
            "mean" => None,
            "median" => Some(50.0),
            p => match p.strip_prefix('p').and_then(|v| v.parse::<f64>().ok()) {
                Some(v) if (0.0..=100.0).contains(&v) => Some(v),
                _ => return Err(err()),
            },
        };
        Ok(Self { name: s.to_owned(), kind, percentile })
    }
}

impl Metric {
    /// The percentile this metric needs reported, if any.
    pub fn percentile(&self) -> Option<f64> {
        self.percentile
    }

    /// The metric's value in `r` (ms); `None` if its percentile was not computed.
    pub fn of(&self, r: &BenchResult) -> Option<f64> {
        let d = r.metrics()[self.kind].2;
        match self.percentile {
            None => Some(d.mean),
            Some(50.0) => Some(d.median),
            Some(p) => d.at(p),
        }
    }
}

/// `METRIC:MS`, e.g. `ttft_p95:500`.
#[derive(Clone, Debug, PartialEq)]
pub struct Constraint {
    pub metric: Metric,
    pub max_ms: f64,
}

impl std::str::FromStr for Constraint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (m, v) = s
            .split_once(':')
            .ok_or_else(|| format!("`{s}`: expected METRIC:MS, e.g. ttft_p95:500"))?;
        match v.parse::<f64>() {
            Ok(max_ms) if max_ms.is_finite() && max_ms > 0.0 => {
                Ok(Self { metric: m.parse()?, max_ms })
            }
            _ => Err(format!("`{s}`: `{v}` is not a positive number of ms")),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Goal {
    /// Most output tok/s.
    MaxThroughput,
    /// Lowest value of the metric with output tok/s at least the floor.
    MinLatency { metric: Metric, min_output_throughput: f64 },
    /// Most requests per second meeting the bench's `--goodput` SLOs. Failed requests (a
    /// server refusing what it cannot serve in time) count as missed, not as infeasible.
    MaxGoodput,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Objective {
    pub goal: Goal,
    pub constraints: Vec<Constraint>,
}

impl Objective {
    pub fn feasible(&self, r: &BenchResult) -> bool {
        let floor = match &self.goal {
            Goal::MaxThroughput | Goal::MaxGoodput => 0.0,
            Goal::MinLatency { min_output_throughput, .. } => *min_output_throughput,
        };
        (r.failed == 0 || self.goal == Goal::MaxGoodput)
            && r.completed > 0
            && r.output_throughput >= floor
            && self.constraints.iter().all(|c| c.metric.of(r).is_some_and(|v| v <= c.max_ms))
    }

    /// The score to maximise (higher is better).
    fn score(&self, r: &BenchResult) -> f64 {
        match &self.goal {
            Goal::MaxThroughput => r.output_throughput,
            Goal::MinLatency { metric, .. } => -metric.of(r).unwrap_or(f64::INFINITY),
            Goal::MaxGoodput => r.request_goodput.unwrap_or(0.0),
        }
    }

    /// Index of the best feasible result.
    pub fn best<'a>(&self, results: impl IntoIterator<Item = &'a BenchResult>) -> Option<usize> {
        results
            .into_iter()
            .enumerate()
            .filter(|(_, r)| self.feasible(r))
            .max_by(|(_, a), (_, b)| self.score(a).total_cmp(&self.score(b)))
            .map(|(i, _)| i)
    }

    /// Percentiles the constraints and goal need reported.
    pub fn percentiles(&self) -> Vec<f64> {
        let goal = match &self.goal {
            Goal::MinLatency { metric, .. } => metric.percentile(),
            Goal::MaxThroughput | Goal::MaxGoodput => None,
        };
        self.constraints.iter().filter_map(|c| c.metric.percentile()).chain(goal).collect()
    }
}

/// Indices of the throughput–latency Pareto front (higher throughput, lower latency), sorted
/// by throughput.
pub fn pareto_front(points: &[(f64, f64)]) -> Vec<usize> {
    let mut idx: Vec<usize> =
        (0..points.len()).filter(|&i| points[i].0.is_finite() && points[i].1.is_finite()).collect();
    idx.sort_by(|&a, &b| {
        points[b].0.total_cmp(&points[a].0).then(points[a].1.total_cmp(&points[b].1))
    });
    let mut front = Vec::new();
    let mut best_latency = f64::INFINITY;
    for i in idx {
        if points[i].1 < best_latency {
            best_latency = points[i].1;
            front.push(i);
        }
    }
    front.reverse();
    front
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_metrics_and_constraints() {
        let c: Constraint = "ttft_p95:500".parse().unwrap();
        assert_eq!((c.metric.percentile(), c.max_ms), (Some(95.0), 500.0));
        assert_eq!("e2el_mean".parse::<Metric>().unwrap().percentile(), None);
        assert_eq!("itl_median".parse::<Metric>().unwrap().percentile(), Some(50.0));
        for bad in ["ttft", "foo_p95", "ttft_p101", "ttft_x"] {
            assert!(bad.parse::<Metric>().is_err(), "{bad}");
        }
        assert!("ttft_p95".parse::<Constraint>().is_err());
        assert!("ttft_p95:-3".parse::<Constraint>().is_err());
    }

    #[test]
    fn pareto_front_keeps_undominated_points() {
        // (throughput, latency): (3, 5) dominates (2, 6); (1, 1) and (4, 9) are on the front.
        let pts = [(2.0, 6.0), (1.0, 1.0), (3.0, 5.0), (4.0, 9.0), (3.0, 7.0), (f64::NAN, 0.0)];
        assert_eq!(pareto_front(&pts), vec![1, 2, 3]);
        assert!(pareto_front(&[]).is_empty());
    }
}
