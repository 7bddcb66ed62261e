//! Prometheus metrics for `GET /metrics`: vLLM's metric names and bucket boundaries under the
//! prefix `kiln:` (or another: `--metrics-prefix vllm` gives vLLM's exact names for existing
//! dashboards), every prefixed series labelled `model_name`. Below, `kiln:` stands for the
//! prefix.
//!
//! What is counted when (all times in seconds, all sizes in tokens unless the name says bytes):
//! - [`Metrics::on_step`], after every engine step, from the engine thread:
//!   - gauges `kiln:num_requests_running`, `kiln:num_requests_waiting` (requests) and
//!     `kiln:kv_cache_usage_perc` (fraction of KV blocks in use, 0..=1 as in vLLM despite the name)
//!     are set to the engine's current values;
//!   - counters `kiln:prefix_cache_queries_total` (prompt tokens looked up in the prefix cache),
//!     `kiln:prefix_cache_hits_total` (of those, tokens found) and `kiln:num_preemptions_total`
//!     (preemptions) advance by the difference from the engine totals of the previous call;
//!     a total smaller than one already seen is ignored, so counters never go backwards;
//!   - the speculative-decoding counters `kiln:spec_decode_*` advance likewise (module
//!     `spec`; the periodic stats log adds vLLM's acceptance line while drafts are verified);
//!   - the batch-control and SLO series `kiln:scheduler_*` and `kiln:slo_*` (module `slo`);
//!   - the second KV tier's `kiln:kv_swapped_*_blocks_total`, `kiln:kv_tier_usage_perc` and
//!     `kiln:num_preemptions_by_mode_total{mode}` (module `swap`);
//!   - the structured-output counters `kiln:structured_output_*` (module `structured`);
//!   - prefill/decode disaggregation's `kiln:kv_transfer_*`, `kiln:kv_pinned_blocks` and
//!     `kiln:kv_pins_expired_total` (module `kv_transfer`; the transfers are counted by the
//!     server's transfer code as they happen);
//!   - `kiln:engine_busy_seconds_total` and `kiln:engine_forward_seconds_total` (module `busy`);
//!   - with LoRA adapters, `kiln:lora_requests_info` when the adapters in use change
//!     ([`Metrics::on_lora`], module `lora`);
//!   - histogram `kiln:iteration_tokens_total` observes the tokens scheduled in that step, once
//!     per step (`EngineStats::num_steps` must have advanced) and only if it scheduled any.
//! - [`Metrics::on_prompt_tokens`], when a request's first token arrives:
//!   `kiln:prompt_tokens_total` += prompt length.
//! - [`Metrics::on_generation_token`], for every generated token including the first:
//!   `kiln:generation_tokens_total` += 1; the gap to the previous token of the same request (absent
//!   for the first) is observed in `kiln:inter_token_latency_seconds`.
//! - [`Metrics::on_request_finished`], once per request, whatever the reason:
//!   `kiln:request_success_total{finished_reason}` += 1 (`stop`, `length`, `abort` exist from the
//!   start at 0); `kiln:e2e_request_latency_seconds`, `kiln:request_prompt_tokens` and
//!   `kiln:request_generation_tokens` always observe; `kiln:time_to_first_token_seconds`,
//!   `kiln:request_queue_time_seconds`, `kiln:request_prefill_time_seconds` and
//!   `kiln:request_decode_time_seconds` observe only the phases the request reached;
//!   `kiln:request_inference_time_seconds` (first scheduled to finish) when it was scheduled;
//!   `kiln:request_time_per_output_token_seconds` (decode time / (tokens − 1)) when it
//!   generated more than one token.
//! - [`Metrics::on_request_params`], once per prompt of an HTTP request once its sequences
//!   started: `kiln:request_params_n` (the `n` parameter), `kiln:request_params_max_tokens` (the
//!   `max_tokens` parameter, when given) and `kiln:request_max_num_generation_tokens` (n × the
//!   effective max_tokens).
//! - [`Metrics::set_cache_config`], once at start: `kiln:cache_config_info`, a gauge at 1 whose
//!   labels describe the KV cache (`block_size`, `cache_dtype`, `enable_prefix_caching`,
//!   `num_gpu_blocks`, as vLLM names them).
//! - [`Metrics::set_model_config`], once at start: `kiln:model_config_info`, a gauge at 1 whose
//!   labels describe the model: `architecture`, `weight_bytes` (what memory holds),
//!   `active_weight_bytes` (what one token reads: less with experts), `num_experts`,
//!   `num_experts_per_tok` and `num_sparse_layers` (0 for a dense model).
//! - [`Metrics::render`], per scrape: `process_cpu_seconds_total`,
//!   `process_resident_memory_bytes`, `process_virtual_memory_bytes`,
//!   `process_start_time_seconds` and `process_open_fds` are read from `/proc/self` (Linux only;
//!   omitted elsewhere or when unreadable). They describe the whole process and carry no label.
//!
//! HTTP request counts (`http_requests_total{handler,method,status}`, unprefixed as vLLM's
//! instrumentator) live in [`http::HttpMetrics`], on the server state, so they count requests
//! made while the model loads too.
//!
//! Exposition: OpenMetrics 1.0 text (prometheus-client's encoder, ending in `# EOF`), to be served
//! with [`CONTENT_TYPE`]. Prometheus' default scrape asks for OpenMetrics first and parses it by
//! that content type. prometheus-client writes metric names verbatim (the colon in `kiln:` is kept)
//! and appends `_total` to counter samples (the `# TYPE` line names the family without it, as
//! OpenMetrics requires). It does not escape label values, so the model name is escaped here.
//! A scraper that does not accept OpenMetrics gets the same metrics in the Prometheus text
//! format 0.0.4 ([`text_format`], chosen from the `Accept` header by [`negotiate`]).
//!
//! Each [`Metrics`] owns its registry: several servers in one process do not share series.
//! Updates are atomic adds (histograms take a short lock inside prometheus-client); `on_step`
//! also locks the last-seen engine totals. `render` is O(number of series), a few hundred lines.

mod busy;
pub mod http;
pub mod kv_transfer;
mod lora;
mod process;
mod slo;
mod spec;
mod structured;
mod swap;
#[cfg(test)]
mod tests;
pub mod text_format;

use std::borrow::Cow;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kiln_engine::{EngineStats, SpecDecodeStats};
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use self::process::ProcessCollector;
pub use self::slo::controller_log_line;
use self::slo::{SloMetrics, SloTotals};
use self::spec::SpecMetrics;
pub use self::spec::log_line as spec_decode_log_line;

/// `Content-Type` of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `Content-Type` of the Prometheus text format 0.0.4 ([`text_format::from_openmetrics`]).
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The default metric prefix.
pub const DEFAULT_PREFIX: &str = "kiln";

/// Whether a scraper's `Accept` header asks for OpenMetrics (Prometheus' own scrapes do);
/// anything else (curl's `*/*`, none) gets the plain text format, as vLLM serves.
pub fn negotiate(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| a.contains("application/openmetrics-text"))
}

/// Values of `finished_reason` whose series exist from the start (vLLM's `FinishReason`).
pub const FINISHED_REASONS: [&str; 3] = ["stop", "length", "abort"];

// Bucket boundaries are vLLM's, from `PrometheusStatLogger.__init__` in
// vllm-project/vllm `vllm/v1/metrics/loggers.py` (read at commit 005a810bc40f and in a later
// revision that has `vllm:inter_token_latency_seconds`; the lists agree).

/// `vllm:time_to_first_token_seconds`.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// `vllm:inter_token_latency_seconds` (the same list as the older
/// `vllm:time_per_output_token_seconds` it replaces).
const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// vLLM's `request_latency_buckets`: e2e, queue, prefill and decode time.
const REQUEST_LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// `vllm:iteration_tokens_total`.
const ITERATION_TOKENS_BUCKETS: [f64; 13] =
    [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];

/// `vllm:request_params_n`.
const N_BUCKETS: [f64; 5] = [1.0, 2.0, 5.0, 10.0, 20.0];

/// vLLM's `build_1_2_5_buckets(max_value)`: 1, 2, 5, 10, 20, 50, … up to and including
/// `max_value` (empty for 0).
pub fn build_1_2_5_buckets(max_value: usize) -> Vec<usize> {
    let mut buckets = Vec::new();
    let mut scale = 1usize;
    loop {
        for m in [1usize, 2, 5] {
            match m.checked_mul(scale) {
                Some(v) if v <= max_value => buckets.push(v),
                _ => return buckets,
            }
        }
        match scale.checked_mul(10) {
            Some(s) => scale = s,
            None => return buckets,
        }
    }
}

/// Per-request timings, recorded once when a request ends.
#[derive(Clone, Debug)]
pub struct FinishedRequest<'a> {
    /// `stop`, `length` or `abort` (see [`FINISHED_REASONS`]); other values get their own series.
    pub finished_reason: &'a str,
    pub num_prompt_tokens: usize,
    pub num_generation_tokens: usize,
    /// Arrival to finish.
    pub e2e: Duration,
    /// Arrival to first scheduled; `None` if never scheduled.
    pub queue: Option<Duration>,
    /// Arrival to first token; `None` if no token was produced.
    pub ttft: Option<Duration>,
    /// First scheduled to first token.
    pub prefill: Option<Duration>,
    /// First token to last token.
    pub decode: Option<Duration>,
    /// First scheduled to finish (prefill and decode).
    pub inference: Option<Duration>,
}

/// What `kiln:cache_config_info` states about the KV cache.
#[derive(Clone, Debug)]
pub struct CacheConfigInfo {
    pub block_size: usize,
    /// kiln's name of the element type (`f16`, `f32`).
    pub cache_dtype: String,
    pub enable_prefix_caching: bool,
    pub num_blocks: usize,
}

/// What `kiln:model_config_info` states about the model.
#[derive(Clone, Debug)]
pub struct ModelConfigInfo {
    /// The model family (`Qwen3Moe`, `Llama`, ...).
    pub architecture: String,
    pub weight_bytes: u64,
    pub active_weight_bytes: u64,
    /// Experts per sparse layer, 0 for a dense model.
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub num_sparse_layers: usize,
}

/// Totals for the periodic stats log ([`crate::stats_log`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StatsTotals {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub num_running: i64,
    pub num_waiting: i64,
    pub kv_cache_usage: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Speculative-decoding totals as of the last engine step.
    pub spec_decode: SpecDecodeStats,
    /// Prefill/decode disaggregation's transfers.
    pub kv_transfer: kv_transfer::KvTransferTotals,
}

/// Engine totals as of the previous [`Metrics::on_step`].
#[derive(Debug, Default)]
struct LastTotals {
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    num_preemptions: u64,
    num_steps: u64,
    spec_decode: SpecDecodeStats,
    slo: SloTotals,
    swap: kiln_engine::SwapStats,
    kv_pins_expired: u64,
    structured: kiln_engine::structured::ConstraintStats,
    busy: busy::BusyTotals,
}

type ReasonLabel = [(&'static str, String); 1];
type CacheConfigLabels = [(&'static str, String); 4];
type ModelConfigLabels = [(&'static str, String); 6];

/// The server's metrics; `Send + Sync`, shared as `Arc<Metrics>`.
#[derive(Debug)]
pub struct Metrics {
    /// `kiln:` metrics, with the `model_name` label on every series.
    registry: Registry,
    /// `process_*` metrics, unlabelled.
    process_registry: Registry,
    num_requests_running: Gauge,
    num_requests_waiting: Gauge,
    kv_cache_usage_perc: Gauge<f64, AtomicU64>,
    prefix_cache_queries: Counter,
    prefix_cache_hits: Counter,
    num_preemptions: Counter,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    request_success: Family<ReasonLabel, Counter>,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    e2e_request_latency: Histogram,
    request_queue_time: Histogram,
    request_prefill_time: Histogram,
    request_decode_time: Histogram,
    iteration_tokens: Histogram,
    request_prompt_tokens: Histogram,
    request_generation_tokens: Histogram,
    spec_decode: SpecMetrics,
    slo: SloMetrics,
    swap: swap::SwapMetrics,
    /// Prefill/decode disaggregation (module `kv_transfer`).
    pub(crate) kv_transfer: kv_transfer::KvTransferMetrics,
    structured: structured::StructuredMetrics,
    busy: busy::BusyMetrics,
    lora: lora::LoraMetrics,
    request_inference_time: Histogram,
    request_time_per_output_token: Histogram,
    request_params_n: Histogram,
    request_params_max_tokens: Histogram,
    request_max_num_generation_tokens: Histogram,
    cache_config_info: Family<CacheConfigLabels, Gauge>,
    model_config_info: Family<ModelConfigLabels, Gauge>,
    prefix: String,
    last_totals: Mutex<LastTotals>,
}

impl Metrics {
    /// `max_model_len` bounds the token-count histograms' buckets (vLLM's 1-2-5 series).
    pub fn new(model_name: &str, max_model_len: usize) -> Self {
        Self::with_prefix(DEFAULT_PREFIX, model_name, max_model_len)
    }

    /// [`Self::new`] with the metric names under `prefix:` (`vllm` for vLLM's names).
    pub fn with_prefix(prefix: &str, model_name: &str, max_model_len: usize) -> Self {
        let token_buckets = || build_1_2_5_buckets(max_model_len).into_iter().map(|b| b as f64);
        let m = Self {
            registry: Registry::with_labels(std::iter::once((
                Cow::Borrowed("model_name"),
                Cow::Owned(escape_label_value(model_name)),
            ))),
            process_registry: Registry::default(),
            num_requests_running: Gauge::default(),
            num_requests_waiting: Gauge::default(),
            kv_cache_usage_perc: Gauge::default(),
            prefix_cache_queries: Counter::default(),
            prefix_cache_hits: Counter::default(),
            num_preemptions: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            request_success: Family::default(),
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            inter_token_latency: Histogram::new(ITL_BUCKETS),
            e2e_request_latency: Histogram::new(REQUEST_LATENCY_BUCKETS),
            request_queue_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            request_prefill_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            request_decode_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            iteration_tokens: Histogram::new(ITERATION_TOKENS_BUCKETS),
            request_prompt_tokens: Histogram::new(token_buckets()),
            request_generation_tokens: Histogram::new(token_buckets()),
            spec_decode: SpecMetrics::default(),
            slo: SloMetrics::default(),
            swap: swap::SwapMetrics::default(),
            kv_transfer: kv_transfer::KvTransferMetrics::default(),
            structured: structured::StructuredMetrics::default(),
            busy: busy::BusyMetrics::default(),
            lora: lora::LoraMetrics::default(),
            request_inference_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            request_time_per_output_token: Histogram::new(ITL_BUCKETS),
            request_params_n: Histogram::new(N_BUCKETS),
            request_params_max_tokens: Histogram::new(token_buckets()),
            request_max_num_generation_tokens: Histogram::new(token_buckets()),
            cache_config_info: Family::default(),
            model_config_info: Family::default(),
            prefix: prefix.to_owned(),
            last_totals: Mutex::new(LastTotals::default()),
        };
        for reason in FINISHED_REASONS {
            drop(m.request_success.get_or_create(&reason_label(reason)));
        }
        m.register_all()
    }

    /// Registers the handles (clones share their values) under vLLM's names with `kiln:`.
    /// Counter names are given without `_total`; the encoder appends it.
    fn register_all(mut self) -> Self {
        let p = self.prefix.clone();
        let name = |n: &str| format!("{p}:{n}");
        let r = &mut self.registry;
        r.register(
            name("num_requests_running"),
            "Number of requests in model execution batches",
            self.num_requests_running.clone(),
        );
        r.register(
            name("num_requests_waiting"),
            "Number of requests waiting to be processed",
            self.num_requests_waiting.clone(),
        );
        r.register(
            name("kv_cache_usage_perc"),
            "KV-cache usage. 1 means 100 percent usage",
            self.kv_cache_usage_perc.clone(),
        );
        r.register(
            name("prefix_cache_queries"),
            "Prefix cache queries, in terms of number of queried tokens",
            self.prefix_cache_queries.clone(),
        );
        r.register(
            name("prefix_cache_hits"),
            "Prefix cache hits, in terms of number of cached tokens",
            self.prefix_cache_hits.clone(),
        );
        r.register(
            name("num_preemptions"),
            "Cumulative number of preemptions from the engine",
            self.num_preemptions.clone(),
        );
        r.register(
            name("prompt_tokens"),
            "Number of prefill tokens processed",
            self.prompt_tokens.clone(),
        );
        r.register(
            name("generation_tokens"),
            "Number of generation tokens processed",
            self.generation_tokens.clone(),
        );
        r.register(
            name("request_success"),
            "Count of finished requests by finish reason",
            self.request_success.clone(),
        );
        let histograms = [
            (
                name("time_to_first_token_seconds"),
                "Histogram of time to first token in seconds",
                &self.time_to_first_token,
            ),
            (
                name("inter_token_latency_seconds"),
                "Histogram of inter-token latency in seconds",
                &self.inter_token_latency,
            ),
            (
                name("e2e_request_latency_seconds"),
                "Histogram of e2e request latency in seconds",
                &self.e2e_request_latency,
            ),
            (
                name("request_queue_time_seconds"),
                "Histogram of time spent in WAITING phase for request",
                &self.request_queue_time,
            ),
            (
                name("request_prefill_time_seconds"),
                "Histogram of time spent in PREFILL phase for request",
                &self.request_prefill_time,
            ),
            (
                name("request_decode_time_seconds"),
                "Histogram of time spent in DECODE phase for request",
                &self.request_decode_time,
            ),
            (
                name("iteration_tokens_total"),
                "Histogram of number of tokens per engine step",
                &self.iteration_tokens,
            ),
        ];
        for (name, help, histogram) in histograms {
            r.register(name, help, histogram.clone());
        }
        self.spec_decode.register(r, &p);
        self.slo.register(r, &p);
        self.swap.register(r, &p);
        self.kv_transfer.register(r, &p);
        self.structured.register(r, &p);
        self.busy.register(r, &p);
        self.lora.register(r, &p);
        self.register_request_metrics();
        self.process_registry.register_collector(Box::new(ProcessCollector));
        self
    }

    /// The per-request token, timing and parameter histograms and `cache_config_info`.
    fn register_request_metrics(&mut self) {
        let p = self.prefix.clone();
        let name = |n: &str| format!("{p}:{n}");
        let histograms = [
            (
                name("request_prompt_tokens"),
                "Number of prefill tokens processed per request",
                &self.request_prompt_tokens,
            ),
            (
                name("request_generation_tokens"),
                "Number of generation tokens processed per request",
                &self.request_generation_tokens,
            ),
            (
                name("request_inference_time_seconds"),
                "Histogram of time spent in RUNNING phase for request",
                &self.request_inference_time,
            ),
            (
                name("request_time_per_output_token_seconds"),
                "Histogram of time_per_output_token_seconds per request",
                &self.request_time_per_output_token,
            ),
            (
                name("request_params_n"),
                "Histogram of the n request parameter",
                &self.request_params_n,
            ),
            (
                name("request_params_max_tokens"),
                "Histogram of the max_tokens request parameter",
                &self.request_params_max_tokens,
            ),
            (
                name("request_max_num_generation_tokens"),
                "Histogram of maximum number of requested generation tokens",
                &self.request_max_num_generation_tokens,
            ),
        ];
        for (name, help, histogram) in histograms {
            self.registry.register(name, help, histogram.clone());
        }
        self.registry.register(
            name("cache_config_info"),
            "Information of the LLMEngine CacheConfig",
            self.cache_config_info.clone(),
        );
        self.registry.register(
            name("model_config_info"),
            "The model: its family, weight bytes held and read per token, and its experts",
            self.model_config_info.clone(),
        );
    }

    /// Called by the engine thread after every step with the engine's counters (totals since
    /// start, gauges as of now). Counters advance by the delta since the last call; a total
    /// smaller than one already seen is ignored. `kiln:iteration_tokens_total` observes
    /// `stats.step_scheduled_tokens` when `stats.num_steps` advanced and the step scheduled any,
    /// so repeated calls for the same step observe it once.
    pub fn on_step(&self, stats: &EngineStats) {
        self.num_requests_running.set(saturating_i64(stats.num_running));
        self.num_requests_waiting.set(saturating_i64(stats.num_waiting));
        self.kv_cache_usage_perc.set(f64::from(stats.kv_usage));
        let new_step = {
            let mut last = self.last_totals.lock().unwrap_or_else(PoisonError::into_inner);
            advance(
                &self.prefix_cache_queries,
                &mut last.prefix_cache_queries,
                stats.prefix_cache.num_queried_tokens,
            );
            advance(
                &self.prefix_cache_hits,
                &mut last.prefix_cache_hits,
                stats.prefix_cache.num_hit_tokens,
            );
            advance(&self.num_preemptions, &mut last.num_preemptions, stats.num_preemptions);
            self.spec_decode.update(&mut last.spec_decode, &stats.spec_decode);
            self.slo.update(&mut last.slo, stats);
            self.swap.update(&mut last.swap, &stats.swap);
            self.kv_transfer.update(&mut last.kv_pins_expired, &stats.kv_handoff);
            self.structured.update(&mut last.structured, &stats.structured);
            self.busy.update(&mut last.busy, stats.total_step_time, stats.total_forward_time);
            let new_step = stats.num_steps > last.num_steps;
            last.num_steps = last.num_steps.max(stats.num_steps);
            new_step
        };
        if new_step && stats.step_scheduled_tokens > 0 {
            self.iteration_tokens.observe(stats.step_scheduled_tokens as f64);
        }
    }

    /// The LoRA adapters of running and of waiting requests changed (by name), under a limit of
    /// `max_lora` adapters per step (`kiln:lora_requests_info`).
    pub fn on_lora(&self, running: &[String], waiting: &[String], max_lora: Option<usize>) {
        self.lora.set(running, waiting, max_lora);
    }

    /// A request's first token arrived; `n` is its prompt length.
    pub fn on_prompt_tokens(&self, n: usize) {
        self.prompt_tokens.inc_by(n as u64);
    }

    /// A token was generated. `inter_token` is the gap to the request's previous token: `None`
    /// for the first token, `Some` for every later one.
    pub fn on_generation_token(&self, inter_token: Option<Duration>) {
        self.generation_tokens.inc();
        if let Some(gap) = inter_token {
            self.inter_token_latency.observe(gap.as_secs_f64());
        }
    }

    /// The parameters of one prompt of a request whose sequences started: its `n`, the
    /// `max_tokens` it gave (if any), and the most tokens its samples may generate together.
    pub fn on_request_params(
        &self,
        n: usize,
        max_tokens: Option<usize>,
        max_num_generation: usize,
    ) {
        self.request_params_n.observe(n as f64);
        if let Some(m) = max_tokens {
            self.request_params_max_tokens.observe(m as f64);
        }
        self.request_max_num_generation_tokens.observe(max_num_generation as f64);
    }

    /// States the KV cache's configuration (`cache_config_info`); call once.
    pub fn set_cache_config(&self, c: &CacheConfigInfo) {
        let python_bool = if c.enable_prefix_caching { "True" } else { "False" };
        let labels = [
            ("block_size", c.block_size.to_string()),
            ("cache_dtype", escape_label_value(&c.cache_dtype)),
            ("enable_prefix_caching", python_bool.to_owned()),
            ("num_gpu_blocks", c.num_blocks.to_string()),
        ];
        self.cache_config_info.get_or_create(&labels).set(1);
    }

    /// States the model's shape (`model_config_info`); call once.
    pub fn set_model_config(&self, c: &ModelConfigInfo) {
        let labels = [
            ("architecture", escape_label_value(&c.architecture)),
            ("weight_bytes", c.weight_bytes.to_string()),
            ("active_weight_bytes", c.active_weight_bytes.to_string()),
            ("num_experts", c.num_experts.to_string()),
            ("num_experts_per_tok", c.num_experts_per_tok.to_string()),
            ("num_sparse_layers", c.num_sparse_layers.to_string()),
        ];
        self.model_config_info.get_or_create(&labels).set(1);
    }

    /// The running totals the periodic stats log turns into rates.
    pub fn totals(&self) -> StatsTotals {
        StatsTotals {
            prompt_tokens: self.prompt_tokens.get(),
            generation_tokens: self.generation_tokens.get(),
            num_running: self.num_requests_running.get(),
            num_waiting: self.num_requests_waiting.get(),
            kv_cache_usage: self.kv_cache_usage_perc.get(),
            prefix_cache_queries: self.prefix_cache_queries.get(),
            prefix_cache_hits: self.prefix_cache_hits.get(),
            spec_decode: self
                .last_totals
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .spec_decode,
            kv_transfer: self.kv_transfer.totals(),
        }
    }

    /// A request ended (any reason, aborts included).
    pub fn on_request_finished(&self, r: &FinishedRequest<'_>) {
        self.request_success.get_or_create(&reason_label(r.finished_reason)).inc();
        self.e2e_request_latency.observe(r.e2e.as_secs_f64());
        self.request_prompt_tokens.observe(r.num_prompt_tokens as f64);
        self.request_generation_tokens.observe(r.num_generation_tokens as f64);
        let phases = [
            (r.ttft, &self.time_to_first_token),
            (r.queue, &self.request_queue_time),
            (r.prefill, &self.request_prefill_time),
            (r.decode, &self.request_decode_time),
            (r.inference, &self.request_inference_time),
        ];
        for (duration, histogram) in phases {
            if let Some(d) = duration {
                histogram.observe(d.as_secs_f64());
            }
        }
        if let (Some(decode), true) = (r.decode, r.num_generation_tokens > 1) {
            let per_token = decode.as_secs_f64() / (r.num_generation_tokens - 1) as f64;
            self.request_time_per_output_token.observe(per_token);
        }
    }

    /// The OpenMetrics text exposition of all metrics, ending in `# EOF`; serve it with
    /// [`CONTENT_TYPE`].
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        let result = encode_registry(&mut out, &self.registry)
            .and_then(|()| encode_registry(&mut out, &self.process_registry))
            .and_then(|()| encode_eof(&mut out));
        // Writing into a String cannot fail and our collector reports no errors of its own.
        debug_assert!(result.is_ok(), "metrics encoding failed");
        out
    }

    /// The exposition for a scraper's `Accept` header, with its content type: OpenMetrics when
    /// asked for, else the Prometheus text format 0.0.4. `extra` (OpenMetrics text without
    /// `# EOF`, e.g. the HTTP counts) is added before the end.
    pub fn render_for(&self, accept: Option<&str>, extra: &str) -> (&'static str, String) {
        let mut text = self.render();
        if let Some(body) = text.strip_suffix("# EOF\n") {
            text = format!("{body}{extra}# EOF\n");
        }
        if negotiate(accept) {
            (CONTENT_TYPE, text)
        } else {
            (TEXT_CONTENT_TYPE, text_format::from_openmetrics(&text))
        }
    }
}

/// A counter of seconds.
type SecondsCounter = Counter<f64, AtomicU64>;

/// Advances `counter` by `total - last` seconds when the total grew.
fn advance_seconds(counter: &SecondsCounter, last: &mut Duration, total: Duration) {
    if let Some(delta) = total.checked_sub(*last).filter(|d| !d.is_zero()) {
        counter.inc_by(delta.as_secs_f64());
        *last = total;
    }
}

/// Adds `total - last` to `counter` if the total grew; a smaller total is ignored.
fn advance(counter: &Counter, last: &mut u64, total: u64) {
    if total > *last {
        counter.inc_by(total - *last);
        *last = total;
    }
}

fn saturating_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn reason_label(reason: &str) -> ReasonLabel {
    [("finished_reason", escape_label_value(reason))]
}

/// Escapes `\`, `"` and newline as the text formats require (prometheus-client writes label
/// values verbatim).
fn escape_label_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}
