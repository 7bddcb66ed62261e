//! Prometheus metrics for `GET /metrics`: vLLM's metric names and bucket boundaries under the
//! prefix `kiln:`, every `kiln:` series labelled `model_name`.
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
//!   `kiln:request_decode_time_seconds` observe only the phases the request reached.
//! - [`Metrics::render`], per scrape: `process_cpu_seconds_total`,
//!   `process_resident_memory_bytes`, `process_virtual_memory_bytes`,
//!   `process_start_time_seconds` and `process_open_fds` are read from `/proc/self` (Linux only;
//!   omitted elsewhere or when unreadable). They describe the whole process and carry no label.
//!
//! Exposition: OpenMetrics 1.0 text (prometheus-client's encoder, ending in `# EOF`), to be served
//! with [`CONTENT_TYPE`]. Prometheus' default scrape asks for OpenMetrics first and parses it by
//! that content type. prometheus-client writes metric names verbatim (the colon in `kiln:` is kept)
//! and appends `_total` to counter samples (the `# TYPE` line names the family without it, as
//! OpenMetrics requires). It does not escape label values, so the model name is escaped here.
//!
//! Each [`Metrics`] owns its registry: several servers in one process do not share series.
//! Updates are atomic adds (histograms take a short lock inside prometheus-client); `on_step`
//! also locks the last-seen engine totals. `render` is O(number of series), a few hundred lines.

mod process;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kiln_engine::EngineStats;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use self::process::ProcessCollector;

/// `Content-Type` of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

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
}

/// Engine totals as of the previous [`Metrics::on_step`].
#[derive(Debug, Default)]
struct LastTotals {
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    num_preemptions: u64,
    num_steps: u64,
}

type ReasonLabel = [(&'static str, String); 1];

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
    last_totals: Mutex<LastTotals>,
}

impl Metrics {
    /// `max_model_len` bounds the token-count histograms' buckets (vLLM's 1-2-5 series).
    pub fn new(model_name: &str, max_model_len: usize) -> Self {
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
        let r = &mut self.registry;
        r.register(
            "kiln:num_requests_running",
            "Number of requests in model execution batches",
            self.num_requests_running.clone(),
        );
        r.register(
            "kiln:num_requests_waiting",
            "Number of requests waiting to be processed",
            self.num_requests_waiting.clone(),
        );
        r.register(
            "kiln:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage",
            self.kv_cache_usage_perc.clone(),
        );
        r.register(
            "kiln:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens",
            self.prefix_cache_queries.clone(),
        );
        r.register(
            "kiln:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens",
            self.prefix_cache_hits.clone(),
        );
        r.register(
            "kiln:num_preemptions",
            "Cumulative number of preemptions from the engine",
            self.num_preemptions.clone(),
        );
        r.register(
            "kiln:prompt_tokens",
            "Number of prefill tokens processed",
            self.prompt_tokens.clone(),
        );
        r.register(
            "kiln:generation_tokens",
            "Number of generation tokens processed",
            self.generation_tokens.clone(),
        );
        r.register(
            "kiln:request_success",
            "Count of finished requests by finish reason",
            self.request_success.clone(),
        );
        let histograms = [
            (
                "kiln:time_to_first_token_seconds",
                "Histogram of time to first token in seconds",
                &self.time_to_first_token,
            ),
            (
                "kiln:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds",
                &self.inter_token_latency,
            ),
            (
                "kiln:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds",
                &self.e2e_request_latency,
            ),
            (
                "kiln:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request",
                &self.request_queue_time,
            ),
            (
                "kiln:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request",
                &self.request_prefill_time,
            ),
            (
                "kiln:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request",
                &self.request_decode_time,
            ),
            (
                "kiln:iteration_tokens_total",
                "Histogram of number of tokens per engine step",
                &self.iteration_tokens,
            ),
            (
                "kiln:request_prompt_tokens",
                "Number of prefill tokens processed per request",
                &self.request_prompt_tokens,
            ),
            (
                "kiln:request_generation_tokens",
                "Number of generation tokens processed per request",
                &self.request_generation_tokens,
            ),
        ];
        for (name, help, histogram) in histograms {
            r.register(name, help, histogram.clone());
        }
        self.process_registry.register_collector(Box::new(ProcessCollector));
        self
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
            let new_step = stats.num_steps > last.num_steps;
            last.num_steps = last.num_steps.max(stats.num_steps);
            new_step
        };
        if new_step && stats.step_scheduled_tokens > 0 {
            self.iteration_tokens.observe(stats.step_scheduled_tokens as f64);
        }
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
        ];
        for (duration, histogram) in phases {
            if let Some(d) = duration {
                histogram.observe(d.as_secs_f64());
            }
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
