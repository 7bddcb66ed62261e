//! `kiln tune`: sweeps `kiln serve` flags × load, benchmarking each server (a child process on
//! loopback) with the same prompts, and picks the best configuration for an objective. The
//! work is `kiln_bench::tune`; this file maps the flags onto it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use kiln_bench::tune::{Axis, Constraint, Goal, Load, Metric, Objective, TuneConfig};
use kiln_bench::{RequestRate, ServeBenchConfig, Slos, Target};

use crate::bench::{BenchTokenizer, DatasetArgs};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ObjectiveKind {
    /// Most output tok/s within the constraints.
    Throughput,
    /// Lowest --latency-metric with at least --min-throughput output tok/s, within the constraints.
    Latency,
    /// Most requests per second meeting every --goodput SLO (refused requests count as missed).
    Goodput,
}

#[derive(clap::Args, Debug)]
pub struct TuneArgs {
    /// The model every server loads (as `kiln serve --model`); also the prompts' tokenizer.
    #[arg(long, default_value = kiln_fetch::DEFAULT_MODEL_NAME)]
    model: String,
    /// More flags for every server, e.g. "--threads 2 --num-kv-blocks 4096".
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    server_args: String,
    /// Values of --profile to try.
    #[arg(long, value_delimiter = ',')]
    profile: Vec<String>,
    /// Values of --block-size to try.
    #[arg(long, value_delimiter = ',')]
    block_size: Vec<String>,
    /// Values of --max-num-seqs to try.
    #[arg(long, value_delimiter = ',')]
    max_num_seqs: Vec<String>,
    /// Values of --max-num-batched-tokens to try.
    #[arg(long, value_delimiter = ',')]
    max_num_batched_tokens: Vec<String>,
    /// Values of --long-prefill-token-threshold to try.
    #[arg(long, value_delimiter = ',')]
    long_prefill_token_threshold: Vec<String>,
    /// Values of --max-num-partial-prefills to try.
    #[arg(long, value_delimiter = ',')]
    max_num_partial_prefills: Vec<String>,
    /// Values of --scheduling-policy to try.
    #[arg(long, value_delimiter = ',')]
    scheduling_policy: Vec<String>,
    /// Values of --kv-cache-dtype to try (f32, f16, int8, fp8, fp8_e5m2).
    #[arg(long, value_delimiter = ',')]
    kv_cache_dtype: Vec<String>,
    /// Load levels: most requests in flight (all queued at once).
    #[arg(long, value_delimiter = ',', conflicts_with = "request_rate")]
    concurrency: Vec<usize>,
    /// Load levels: request rates (req/s), gamma arrivals shaped by --burstiness.
    #[arg(long, value_delimiter = ',')]
    request_rate: Vec<f64>,
    /// Gamma shape of the arrivals at a --request-rate (1 = Poisson; below 1 burstier).
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
    /// SLOs of the goodput objective, `KEY:MS` (ttft, tpot, e2el), as `kiln bench serve`.
    #[arg(long, num_args = 1..)]
    goodput: Vec<String>,
    #[arg(long, value_enum, default_value = "throughput")]
    objective: ObjectiveKind,
    /// Limits every chosen run must meet, `METRIC:MS` (ttft|tpot|itl|e2el _ p50|p95|p99|mean).
    #[arg(long)]
    constraint: Vec<String>,
    /// The latency the `latency` objective minimises and the Pareto plot shows.
    #[arg(long, default_value = "ttft_p95")]
    latency_metric: String,
    /// Output tok/s floor of the `latency` objective.
    #[arg(long, default_value_t = 0.0)]
    min_throughput: f64,
    /// Wall-clock budget of the whole sweep; runs that would not fit are skipped.
    #[arg(long, default_value_t = 30.0)]
    budget_minutes: f64,
    /// Where runs.csv, the plots, best.txt and the server logs go.
    #[arg(long, default_value = "kiln-tune")]
    output_dir: PathBuf,
    #[command(flatten)]
    data: DatasetArgs,
    /// `/v1/completions` or `/v1/chat/completions`.
    #[arg(long, default_value = "/v1/completions")]
    endpoint: String,
    /// Seconds to wait for a server to load.
    #[arg(long, default_value_t = 300)]
    server_timeout: u64,
}

pub fn run(args: &TuneArgs) -> anyhow::Result<()> {
    if !(args.budget_minutes.is_finite() && args.budget_minutes > 0.0) {
        bail!("--budget-minutes must be positive");
    }
    let loads: Vec<Load> = if args.request_rate.is_empty() {
        let c = if args.concurrency.is_empty() { vec![1, 4, 16] } else { args.concurrency.clone() };
        if c.contains(&0) {
            bail!("--concurrency values must be at least 1");
        }
        c.into_iter().map(Load::Concurrency).collect()
    } else {
        if args.request_rate.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            bail!("--request-rate values must be positive numbers");
        }
        args.request_rate.iter().map(|&r| Load::Rate(r)).collect()
    };
    let latency_metric: Metric = args.latency_metric.parse().map_err(anyhow::Error::msg)?;
    let constraints = args
        .constraint
        .iter()
        .map(|c| c.parse::<Constraint>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(anyhow::Error::msg)?;
    let goal = match args.objective {
        ObjectiveKind::Throughput => Goal::MaxThroughput,
        ObjectiveKind::Latency => Goal::MinLatency {
            metric: latency_metric.clone(),
            min_output_throughput: args.min_throughput,
        },
        ObjectiveKind::Goodput => Goal::MaxGoodput,
    };
    let slos = Slos::parse(&args.goodput).map_err(anyhow::Error::msg)?;
    if args.objective == ObjectiveKind::Goodput && slos.is_empty() {
        bail!("--objective goodput needs --goodput SLOs, e.g. --goodput ttft:1000 tpot:60");
    }
    if !(args.burstiness.is_finite() && args.burstiness > 0.0) {
        bail!("--burstiness must be a positive number");
    }
    if args.burstiness != 1.0 && args.request_rate.is_empty() {
        bail!("--burstiness shapes arrivals at a --request-rate; give --request-rate");
    }
    let axis = |flag: &str, values: &[String]| Axis { flag: flag.into(), values: values.to_vec() };
    let axes = vec![
        axis("--profile", &args.profile),
        axis("--block-size", &args.block_size),
        axis("--max-num-seqs", &args.max_num_seqs),
        axis("--max-num-batched-tokens", &args.max_num_batched_tokens),
        axis("--long-prefill-token-threshold", &args.long_prefill_token_threshold),
        axis("--max-num-partial-prefills", &args.max_num_partial_prefills),
        axis("--scheduling-policy", &args.scheduling_policy),
        axis("--kv-cache-dtype", &args.kv_cache_dtype),
    ];
    let mut common_args = vec!["--model".to_owned(), args.model.clone()];
    common_args.extend(args.server_args.split_whitespace().map(str::to_owned));
    let tokenizer = BenchTokenizer::load(&args.model)?;
    // Distinct prompts per load level (seeds seed, seed + 1, ...), the same for every config.
    let (warmups, _) = args.data.build(1, &tokenizer)?;
    let mut requests_per_load = Vec::with_capacity(loads.len());
    for i in 0..loads.len() {
        let mut data = args.data.clone();
        data.seed = data.seed.wrapping_add(1 + i as u64);
        requests_per_load.push(data.build(0, &tokenizer)?.1);
    }
    let config = TuneConfig {
        kiln_exe: std::env::current_exe().context("finding the kiln executable")?,
        common_args,
        axes,
        loads,
        objective: Objective { goal, constraints },
        pareto_metric: latency_metric,
        budget: Duration::from_secs_f64(args.budget_minutes * 60.0),
        output_dir: args.output_dir.clone(),
        bench: ServeBenchConfig {
            target: Target {
                base_url: String::new(),
                endpoint: args.endpoint.clone(),
                model: args.model.clone(),
                api_key: None,
                ignore_eos: true,
                temperature: None,
                extra_body: None,
            },
            request_rate: RequestRate::Infinite,
            burstiness: args.burstiness,
            max_concurrency: None,
            slos,
            percentiles: vec![50.0, 95.0, 99.0],
            seed: args.data.seed,
            show_progress: false,
            label: String::new(),
            backend: "openai".into(),
            tokenizer_id: args.model.clone(),
            percentile_metrics: vec!["ttft".into(), "tpot".into(), "itl".into(), "e2el".into()],
        },
        server_start_timeout: Duration::from_secs(args.server_timeout),
    };
    let report = kiln_bench::tune::run(&config, &warmups, &requests_per_load, &tokenizer)?;
    print!("{}", report.summary(&config));
    eprintln!("wrote {}", args.output_dir.display());
    Ok(())
}
