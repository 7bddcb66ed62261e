//! What `kiln tune` leaves behind in `--output-dir`: `runs.csv` (one row per run: the
//! configuration's flags, the load, throughputs and latency percentiles, feasibility),
//! `pareto.{png,svg}` (output throughput against the chosen latency metric, every run and the
//! front), `ttft.{png,svg}` and `tpot.{png,svg}` (p50 / p95 against load per configuration),
//! and `best.txt` (the chosen `kiln serve` command).

use std::fmt::Write as _;
use std::time::Duration;

use super::objective::pareto_front;
use super::plot::{Chart, Series, Style};
use super::space::{Load, ServerConfig, describe, to_args};
use super::{Goal, TuneConfig};
use crate::result::BenchResult;
use anyhow::Context;

const PLOT_SIZE: (u32, u32) = (960, 600);

/// One benchmark run of the sweep.
#[derive(Clone, Debug)]
pub struct Run {
    pub config_index: usize,
    pub config: ServerConfig,
    pub load: Load,
    pub result: BenchResult,
}

#[derive(Clone, Debug)]
pub struct TuneReport {
    pub runs: Vec<Run>,
    /// Index into `runs` of the best feasible run.
    pub best: Option<usize>,
    pub feasible: Vec<bool>,
    pub planned_runs: usize,
    pub skipped_runs: usize,
    pub elapsed: Duration,
    /// The ready `kiln serve` command of the best configuration.
    pub command: Option<String>,
}

impl TuneReport {
    pub fn new(
        config: &TuneConfig,
        runs: Vec<Run>,
        planned_runs: usize,
        skipped_runs: usize,
        elapsed: Duration,
    ) -> Self {
        let best = config.objective.best(runs.iter().map(|r| &r.result));
        let feasible = runs.iter().map(|r| config.objective.feasible(&r.result)).collect();
        let command = best.map(|i| {
            let mut args = vec!["kiln".to_owned(), "serve".to_owned()];
            args.extend(config.common_args.iter().cloned());
            args.extend(to_args(&runs[i].config));
            args.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" ")
        });
        Self { runs, best, feasible, planned_runs, skipped_runs, elapsed, command }
    }

    /// The closing summary printed to stdout and saved as `best.txt`.
    pub fn summary(&self, config: &TuneConfig) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} of {} runs in {:.0} s ({} skipped: budget or errors)",
            self.runs.len(),
            self.planned_runs,
            self.elapsed.as_secs_f64(),
            self.skipped_runs
        );
        match (self.best, &self.command) {
            (Some(i), Some(cmd)) => {
                let r = &self.runs[i];
                let goal = match &config.objective.goal {
                    Goal::MaxThroughput => "most output throughput".to_owned(),
                    Goal::MaxGoodput => "most goodput".to_owned(),
                    Goal::MinLatency { metric, min_output_throughput } => {
                        format!(
                            "lowest {} with at least {min_output_throughput} output tok/s",
                            metric.name
                        )
                    }
                };
                let _ = writeln!(
                    s,
                    "best for {goal}: {} at {} {}",
                    describe(&r.config),
                    r.load.kind(),
                    r.load.value()
                );
                let _ = writeln!(
                    s,
                    "  {:.1} output tok/s, TTFT p95 {:.0} ms, TPOT p95 {:.1} ms, E2E p95 {:.0} ms",
                    r.result.output_throughput,
                    r.result.ttft_ms.at(95.0).unwrap_or(f64::NAN),
                    r.result.tpot_ms.at(95.0).unwrap_or(f64::NAN),
                    r.result.e2el_ms.at(95.0).unwrap_or(f64::NAN)
                );
                let _ = writeln!(s, "{cmd}");
            }
            _ => {
                let _ = writeln!(s, "no run met the objective's constraints; see runs.csv");
            }
        }
        s
    }

    /// Writes the CSV, the plots and best.txt.
    pub fn write(&self, config: &TuneConfig) -> anyhow::Result<()> {
        let dir = &config.output_dir;
        let csv_path = dir.join("runs.csv");
        std::fs::write(&csv_path, self.csv())
            .with_context(|| format!("writing {}", csv_path.display()))?;
        let (w, h) = PLOT_SIZE;
        self.pareto_chart(config)
            .save(&dir.join("pareto"), w, h)
            .context("writing the Pareto plot")?;
        for (name, pick) in [("ttft", 0usize), ("tpot", 1)] {
            self.load_chart(name, pick)
                .save(&dir.join(name), w, h)
                .with_context(|| format!("writing the {name} plot"))?;
        }
        let best = dir.join("best.txt");
        std::fs::write(&best, self.summary(config))
            .with_context(|| format!("writing {}", best.display()))?;
        Ok(())
    }

    fn flags(&self) -> Vec<String> {
        let mut flags: Vec<String> = Vec::new();
        for run in &self.runs {
            for (f, _) in &run.config {
                if !flags.contains(f) {
                    flags.push(f.clone());
                }
            }
        }
        flags
    }

    fn csv(&self) -> String {
        let flags = self.flags();
        let mut s = String::from("run,config");
        for f in &flags {
            let _ = write!(s, ",{}", f.trim_start_matches('-'));
        }
        s.push_str(",load_kind,load,completed,failed,duration_s,request_throughput,request_goodput,output_throughput,total_token_throughput");
        for m in ["ttft", "tpot", "itl", "e2el"] {
            for stat in ["mean", "p50", "p95", "p99"] {
                let _ = write!(s, ",{m}_{stat}_ms");
            }
        }
        s.push_str(",feasible,best\n");
        for (i, run) in self.runs.iter().enumerate() {
            let r = &run.result;
            let _ = write!(s, "{i},{}", run.config_index);
            for f in &flags {
                let v = run.config.iter().find(|(k, _)| k == f).map_or("", |(_, v)| v.as_str());
                let _ = write!(s, ",{}", csv_field(v));
            }
            let _ = write!(
                s,
                ",{},{},{},{},{:.3},{:.4},{},{:.3},{:.3}",
                run.load.kind(),
                run.load.value(),
                r.completed,
                r.failed,
                r.duration_s,
                r.request_throughput,
                r.request_goodput.map_or_else(String::new, |g| format!("{g:.4}")),
                r.output_throughput,
                r.total_token_throughput
            );
            for (_, _, d) in r.metrics() {
                let p = |q: f64| d.at(q).map_or_else(String::new, |v| format!("{v:.3}"));
                let _ = write!(s, ",{:.3},{},{},{}", d.mean, p(50.0), p(95.0), p(99.0));
            }
            let _ = writeln!(s, ",{},{}", self.feasible[i], self.best == Some(i));
        }
        s
    }

    fn pareto_chart(&self, config: &TuneConfig) -> Chart {
        let metric = &config.pareto_metric;
        let points: Vec<(f64, f64)> = self
            .runs
            .iter()
            .map(|r| (r.result.output_throughput, metric.of(&r.result).unwrap_or(f64::NAN)))
            .collect();
        let mut chart = Chart::new(
            "Throughput vs latency (every run; the line is the Pareto front)",
            "output throughput (tok/s)",
            format!("{} (ms)", metric.name),
        );
        let front: Vec<(f64, f64)> = pareto_front(&points).into_iter().map(|i| points[i]).collect();
        chart = chart.with_series(Series::new("Pareto front", front, Style::Line));
        for (ci, name) in self.config_names() {
            let pts = self
                .runs
                .iter()
                .zip(&points)
                .filter(|(r, _)| r.config_index == ci)
                .map(|(_, p)| *p)
                .collect();
            chart = chart.with_series(Series::new(&name, pts, Style::Markers));
        }
        chart
    }

    /// `pick`: 0 = TTFT, 1 = TPOT; p50 and p95 against load for each configuration.
    fn load_chart(&self, name: &str, pick: usize) -> Chart {
        let kind = self.runs.first().map_or("load", |r| r.load.kind());
        let mut chart = Chart::new(
            format!("{} percentiles against load", name.to_uppercase()),
            kind,
            format!("{name} (ms)"),
        );
        let loads: Vec<f64> =
            self.runs.iter().map(|r| r.load.value()).filter(|v| *v > 0.0).collect();
        let (lo, hi) =
            loads.iter().fold((f64::INFINITY, 0.0f64), |(a, b), &v| (a.min(v), b.max(v)));
        chart.x_log = hi / lo >= 8.0;
        for (ci, cname) in self.config_names() {
            for p in [50.0, 95.0] {
                let mut pts: Vec<(f64, f64)> = self
                    .runs
                    .iter()
                    .filter(|r| r.config_index == ci)
                    .filter_map(|r| Some((r.load.value(), r.result.metrics()[pick].2.at(p)?)))
                    .collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                chart = chart.with_series(Series::new(
                    format!("{cname} p{p}"),
                    pts,
                    Style::LineAndMarkers,
                ));
            }
        }
        chart
    }

    fn config_names(&self) -> Vec<(usize, String)> {
        let mut names: Vec<(usize, String)> = Vec::new();
        for r in &self.runs {
            if !names.iter().any(|(i, _)| *i == r.config_index) {
                names.push((r.config_index, describe(&r.config)));
            }
        }
        names
    }
}

fn csv_field(v: &str) -> String {
    if v.contains([',', '"', '\n']) {
        format!("\"{}\"", v.replace('"', "\"\""))
    } else {
        v.to_owned()
    }
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@".contains(c)) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("--max-num-seqs"), "--max-num-seqs");
        assert_eq!(shell_quote("/a b/m.gguf"), "'/a b/m.gguf'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("plain"), "plain");
    }
}
