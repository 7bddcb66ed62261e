//! The sweep: server flag combinations (the cartesian product of each flag's values, in the
//! order given) × load levels (concurrencies or request rates).

use crate::arrival::RequestRate;

/// One server flag and the values to try, e.g. `--max-num-seqs` with `["16", "64"]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Axis {
    pub flag: String,
    pub values: Vec<String>,
}

/// One server configuration: `(flag, value)` pairs.
pub type ServerConfig = Vec<(String, String)>;

/// Every combination of the axes' values; one empty configuration when there are no axes.
pub fn combinations(axes: &[Axis]) -> Vec<ServerConfig> {
    let mut out: Vec<ServerConfig> = vec![Vec::new()];
    for axis in axes {
        if axis.values.is_empty() {
            continue;
        }
        out = out
            .into_iter()
            .flat_map(|c| {
                axis.values.iter().map(move |v| {
                    let mut c = c.clone();
                    c.push((axis.flag.clone(), v.clone()));
                    c
                })
            })
            .collect();
    }
    out
}

/// Flags for the command line: `["--max-num-seqs", "16", ...]`.
pub fn to_args(config: &ServerConfig) -> Vec<String> {
    config.iter().flat_map(|(f, v)| [f.clone(), v.clone()]).collect()
}

/// A short name such as `max-num-seqs=16 block-size=32` (`default` when empty).
pub fn describe(config: &ServerConfig) -> String {
    if config.is_empty() {
        return "default".into();
    }
    config
        .iter()
        .map(|(f, v)| format!("{}={v}", f.trim_start_matches('-')))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One load level of the sweep.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Load {
    /// All requests queued at once, at most this many in flight.
    Concurrency(usize),
    /// Poisson arrivals at this rate, unbounded concurrency.
    Rate(f64),
}

impl Load {
    pub fn value(self) -> f64 {
        match self {
            Self::Concurrency(c) => c as f64,
            Self::Rate(r) => r,
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Self::Concurrency(_) => "concurrency",
            Self::Rate(_) => "request_rate",
        }
    }

    /// `(rate, max_concurrency)` for the benchmark.
    pub fn bench_settings(self) -> (RequestRate, Option<usize>) {
        match self {
            Self::Concurrency(c) => (RequestRate::Infinite, Some(c)),
            Self::Rate(r) => (RequestRate::PerSecond(r), None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cartesian_product_in_order() {
        let axes = [
            Axis { flag: "--a".into(), values: vec!["1".into(), "2".into()] },
            Axis { flag: "--b".into(), values: vec![] },
            Axis { flag: "--c".into(), values: vec!["x".into(), "y".into(), "z".into()] },
        ];
        let all = combinations(&axes);
        assert_eq!(all.len(), 6);
        assert_eq!(to_args(&all[0]), ["--a", "1", "--c", "x"]);
        assert_eq!(describe(&all[5]), "a=2 c=z");
        assert_eq!(combinations(&[]), vec![Vec::new()]);
        assert_eq!(describe(&Vec::new()), "default");
        assert_eq!(Load::Rate(2.5).bench_settings(), (RequestRate::PerSecond(2.5), None));
    }
}
