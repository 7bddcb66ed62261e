//! `kiln bench serve`: sends a dataset to an OpenAI-compatible server on an arrival schedule
//! (all at once, or gamma/Poisson arrivals), at most `max_concurrency` in flight, streams every
//! response, and summarises the run ([`BenchResult`]).
//!
//! Warm-up requests (separate prompts, so they do not warm the measured prompts' prefix cache)
//! go first, one at a time; if one fails the run stops before measuring anything.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::sync::Semaphore;

use crate::arrival::{RequestRate, arrival_offsets};
use crate::client::{ApiClient, Outcome, Target};
use crate::dataset::{BenchRequest, PromptTokenizer};
use crate::progress::Progress;
use crate::result::BenchResult;
use crate::slo::Slos;

#[derive(Clone, Debug)]
pub struct ServeBenchConfig {
    pub target: Target,
    pub request_rate: RequestRate,
    /// Gamma shape of the inter-arrival times (1 = Poisson).
    pub burstiness: f64,
    pub max_concurrency: Option<usize>,
    pub slos: Slos,
    pub percentiles: Vec<f64>,
    pub seed: u64,
    pub show_progress: bool,
    /// Free-form description saved with the result (dataset, server flags).
    pub label: String,
    /// vLLM's `backend` / `endpoint_type` saved with the result (`openai`, `openai-chat`).
    pub backend: String,
    /// The tokenizer prompts were measured with (`tokenizer_id`).
    pub tokenizer_id: String,
    /// Metrics whose mean / median / std / percentiles are reported (`ttft`, `tpot`, `itl`,
    /// `e2el`; vLLM's `--percentile-metrics`).
    pub percentile_metrics: Vec<String>,
}

/// vLLM's default `--percentile-metrics`.
pub const DEFAULT_PERCENTILE_METRICS: [&str; 3] = ["ttft", "tpot", "itl"];

/// Runs the benchmark on a fresh current-thread runtime (light: it shares the machine with the
/// server it measures).
pub fn run_blocking(
    config: &ServeBenchConfig,
    warmups: &[BenchRequest],
    requests: &[BenchRequest],
    tok: &dyn PromptTokenizer,
) -> anyhow::Result<BenchResult> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run(config, warmups, requests, tok))
}

pub async fn run(
    config: &ServeBenchConfig,
    warmups: &[BenchRequest],
    requests: &[BenchRequest],
    tok: &dyn PromptTokenizer,
) -> anyhow::Result<BenchResult> {
    if !(config.burstiness.is_finite() && config.burstiness > 0.0) {
        bail!("--burstiness must be a positive number, got {}", config.burstiness);
    }
    if config.max_concurrency == Some(0) {
        bail!("--max-concurrency must be at least 1");
    }
    let client = ApiClient::new(config.target.clone())?;
    for (i, w) in warmups.iter().enumerate() {
        let o = client.send(w, Instant::now()).await;
        if !o.success {
            bail!(
                "warm-up request {} of {} failed, so the benchmark did not start: {}",
                i + 1,
                warmups.len(),
                o.error.unwrap_or_default()
            );
        }
    }
    let offsets =
        arrival_offsets(requests.len(), config.request_rate, config.burstiness, config.seed);
    let limit =
        config.max_concurrency.unwrap_or(Semaphore::MAX_PERMITS).min(Semaphore::MAX_PERMITS);
    let slots = Arc::new(Semaphore::new(limit));
    let progress = Arc::new(Progress::new(requests.len(), config.show_progress));
    let failures = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (req, offset) in requests.iter().zip(offsets) {
        tokio::time::sleep_until((start + Duration::from_secs_f64(offset)).into()).await;
        let permit =
            Arc::clone(&slots).acquire_owned().await.context("the request slots closed")?;
        let (client, req) = (client.clone(), req.clone());
        let (progress, failures) = (Arc::clone(&progress), Arc::clone(&failures));
        tasks.push(tokio::spawn(async move {
            let outcome = client.send(&req, start).await;
            drop(permit);
            if !outcome.success {
                failures.fetch_add(1, Ordering::Relaxed);
            }
            progress.tick(failures.load(Ordering::Relaxed));
            outcome
        }));
    }
    let mut outcomes: Vec<Outcome> = Vec::with_capacity(tasks.len());
    for task in tasks {
        outcomes.push(task.await.context("a request task panicked")?);
    }
    let duration = start.elapsed().as_secs_f64();
    progress.finish();
    Ok(BenchResult::summarise(config, requests, &outcomes, duration, tok))
}
