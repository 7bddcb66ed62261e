//! `kiln tune`: for each server configuration of the sweep, start `kiln serve` as a child
//! process on loopback, run `kiln bench serve` against it at each load level, record every run
//! (CSV), choose the best configuration for the objective, print it as a ready `kiln serve`
//! command, and plot the throughput–latency Pareto front and TTFT / TPOT percentiles against
//! load (PNG and SVG).
//!
//! The budget bounds the sweep: a run is skipped when the time left is less than the longest
//! run so far plus the server start-up seen so far; what was skipped is reported. Each load
//! level has its own prompts, the same for every configuration: a server that ran one level
//! must not find the next level's prompts in its prefix cache.

mod objective;
mod plot;
mod report;
mod server;
mod space;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

pub use objective::{Constraint, Goal, Metric, Objective, pareto_front};
pub use report::{Run, TuneReport};
pub use space::{Axis, Load, ServerConfig, combinations, describe, to_args};

use crate::dataset::{BenchRequest, PromptTokenizer};
use crate::result::BenchResult;
use crate::serve::{ServeBenchConfig, run_blocking};

#[derive(Clone, Debug)]
pub struct TuneConfig {
    /// The `kiln` executable to run `serve` with.
    pub kiln_exe: PathBuf,
    /// Flags every server gets (`--model M --threads 2 ...`).
    pub common_args: Vec<String>,
    pub axes: Vec<Axis>,
    pub loads: Vec<Load>,
    pub objective: Objective,
    /// The latency metric the Pareto plot uses.
    pub pareto_metric: Metric,
    pub budget: Duration,
    pub output_dir: PathBuf,
    /// The benchmark settings; target, rate and concurrency are set per run.
    pub bench: ServeBenchConfig,
    pub server_start_timeout: Duration,
}

/// Runs the sweep and writes `runs.csv`, the plots and `best.txt` under `output_dir`.
pub fn run(
    config: &TuneConfig,
    warmups: &[BenchRequest],
    requests_per_load: &[Vec<BenchRequest>],
    tok: &dyn PromptTokenizer,
) -> anyhow::Result<TuneReport> {
    anyhow::ensure!(requests_per_load.len() == config.loads.len(), "one prompt set per load level");
    std::fs::create_dir_all(config.output_dir.join("logs"))
        .with_context(|| format!("creating {}", config.output_dir.display()))?;
    let configs = combinations(&config.axes);
    let total = configs.len() * config.loads.len();
    let start = Instant::now();
    let mut runs: Vec<Run> = Vec::new();
    let mut longest_run = Duration::ZERO;
    let mut longest_start = Duration::ZERO;
    let mut skipped = 0usize;
    for (ci, server_config) in configs.iter().enumerate() {
        let needed = longest_start + longest_run;
        if start.elapsed() + needed > config.budget {
            skipped += config.loads.len();
            continue;
        }
        let name = describe(server_config);
        eprintln!("[tune] config {}/{}: {name}", ci + 1, configs.len());
        let mut args = config.common_args.clone();
        args.extend(to_args(server_config));
        let log = config.output_dir.join("logs").join(format!("server-{ci}.log"));
        let t0 = Instant::now();
        let server = match server::ServerProcess::start(
            &config.kiln_exe,
            &args,
            log,
            config.server_start_timeout,
        ) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("[tune]   skipped: {e:#}");
                skipped += config.loads.len();
                continue;
            }
        };
        longest_start = longest_start.max(t0.elapsed());
        for (&load, requests) in config.loads.iter().zip(requests_per_load) {
            if start.elapsed() + longest_run > config.budget {
                skipped += 1;
                continue;
            }
            let t1 = Instant::now();
            let result = bench_once(config, &server.base_url, load, warmups, requests, tok);
            longest_run = longest_run.max(t1.elapsed());
            match result {
                Ok(result) => {
                    eprintln!(
                        "[tune]   {} {}: {:.1} output tok/s, TTFT p95 {:.0} ms, TPOT p95 {:.1} ms, {} failed",
                        load.kind(),
                        load.value(),
                        result.output_throughput,
                        result.ttft_ms.at(95.0).unwrap_or(f64::NAN),
                        result.tpot_ms.at(95.0).unwrap_or(f64::NAN),
                        result.failed
                    );
                    runs.push(Run {
                        config_index: ci,
                        config: server_config.clone(),
                        load,
                        result,
                    });
                }
                Err(e) => {
                    eprintln!("[tune]   {} {}: failed: {e:#}", load.kind(), load.value());
                    skipped += 1;
                }
            }
        }
        drop(server);
    }
    let report = TuneReport::new(config, runs, total, skipped, start.elapsed());
    report.write(config)?;
    Ok(report)
}

fn bench_once(
    config: &TuneConfig,
    base_url: &str,
    load: Load,
    warmups: &[BenchRequest],
    requests: &[BenchRequest],
    tok: &dyn PromptTokenizer,
) -> anyhow::Result<BenchResult> {
    let mut bench = config.bench.clone();
    base_url.clone_into(&mut bench.target.base_url);
    (bench.request_rate, bench.max_concurrency) = load.bench_settings();
    for p in config
        .objective
        .percentiles()
        .into_iter()
        .chain([config.pareto_metric.percentile()].into_iter().flatten())
    {
        if !bench.percentiles.contains(&p) {
            bench.percentiles.push(p);
        }
    }
    run_blocking(&bench, warmups, requests, tok)
}
