//! The outcome of one `kiln bench serve` run: counts, throughputs, goodput and latency
//! distributions (TTFT, TPOT, ITL, E2E), printed as a table and saved as JSON with the field
//! names and value types vLLM's `bench serve` uses (`date` as `YYYYMMDD-HHMMSS`, `backend`,
//! `request_rate` a number or `"inf"`, `mean_ttft_ms`, `p99_tpot_ms`, ... for the
//! `--percentile-metrics` only, `max_output_tokens_per_s`), plus per-request arrays
//! (`input_lens`, `ttfts`, `itls`, `latencies`, ...) with `--save-detailed`.
//!
//! Definitions (vLLM's): TPOT = (E2E − TTFT) / (output tokens − 1) per request with more than
//! one output token; ITL = every gap between text chunks; goodput = requests meeting every SLO
//! per second. Output tokens come from the server's `usage`, else from re-tokenizing the text;
//! input tokens likewise (`usage.prompt_tokens`, else the dataset's count).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{Map, Value, json};

use crate::client::Outcome;
use crate::dataset::{BenchRequest, PromptTokenizer};
use crate::serve::ServeBenchConfig;
use crate::slo::Slos;
use crate::stats::Distribution;

#[derive(Clone, Debug)]
pub struct BenchResult {
    pub date: String,
    pub label: String,
    pub backend: String,
    pub tokenizer_id: String,
    /// Metrics reported with statistics (`ttft`, `tpot`, `itl`, `e2el`).
    pub percentile_metrics: Vec<String>,
    pub base_url: String,
    pub endpoint: String,
    pub model: String,
    /// `None`: infinite (all at once).
    pub request_rate: Option<f64>,
    pub burstiness: f64,
    pub max_concurrency: Option<usize>,
    pub num_prompts: usize,
    pub duration_s: f64,
    pub completed: usize,
    pub failed: usize,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub request_goodput: Option<f64>,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    /// Most output tokens received in one whole second of the run, and the requests in
    /// flight during that second (vLLM's peak metrics).
    pub max_output_tokens_per_s: f64,
    pub max_concurrent_requests: usize,
    pub slos: Slos,
    pub ttft_ms: Distribution,
    pub tpot_ms: Distribution,
    pub itl_ms: Distribution,
    pub e2el_ms: Distribution,
    /// Per request, in dataset order (failed requests have zero lengths and latencies).
    pub input_lens: Vec<usize>,
    pub output_lens: Vec<usize>,
    pub ttfts_s: Vec<f64>,
    pub e2els_s: Vec<f64>,
    pub itls_s: Vec<Vec<f64>>,
    pub generated_texts: Vec<String>,
    pub errors: Vec<String>,
    /// Distinct error messages with their counts.
    pub error_counts: BTreeMap<String, usize>,
    /// The same summary for each `priority` sent, when requests carried more than one
    /// (`--priority-mix`); durations are the whole run's.
    pub by_priority: BTreeMap<i64, BenchResult>,
}

impl BenchResult {
    pub fn summarise(
        config: &ServeBenchConfig,
        requests: &[BenchRequest],
        outcomes: &[Outcome],
        duration_s: f64,
        tok: &dyn PromptTokenizer,
    ) -> Self {
        let n = outcomes.len();
        let (mut input_lens, mut output_lens) = (vec![0; n], vec![0; n]);
        let (mut ttfts, mut e2els) = (vec![0.0; n], vec![0.0; n]);
        let (mut ttft_ms, mut tpot_ms, mut itl_ms, mut e2el_ms) = (vec![], vec![], vec![], vec![]);
        let mut errors = vec![String::new(); n];
        let mut error_counts = BTreeMap::new();
        let mut good = 0usize;
        for (i, (o, req)) in outcomes.iter().zip(requests).enumerate() {
            if !o.success {
                let e = o.error.clone().unwrap_or_else(|| "unknown error".into());
                *error_counts.entry(e.clone()).or_insert(0) += 1;
                errors[i] = e;
                continue;
            }
            let out = o.usage_output_tokens.unwrap_or_else(|| tok.encode(&o.text).len());
            input_lens[i] = o.usage_prompt_tokens.unwrap_or(req.prompt_len);
            output_lens[i] = out;
            ttfts[i] = o.ttft;
            e2els[i] = o.latency;
            let tpot = if out > 1 { (o.latency - o.ttft) / (out - 1) as f64 * 1e3 } else { 0.0 };
            if out > 1 {
                tpot_ms.push(tpot);
            }
            ttft_ms.push(o.ttft * 1e3);
            e2el_ms.push(o.latency * 1e3);
            itl_ms.extend(o.itl.iter().map(|s| s * 1e3));
            good += usize::from(config.slos.met(o.ttft * 1e3, tpot, o.latency * 1e3));
        }
        let completed = outcomes.iter().filter(|o| o.success).count();
        let by_priority = by_priority(config, requests, outcomes, duration_s, tok);
        let total_input_tokens: usize = input_lens.iter().sum();
        let total_output_tokens: usize = output_lens.iter().sum();
        let d = duration_s.max(1e-9);
        let p = &config.percentiles;
        let (max_output_tokens_per_s, max_concurrent_requests) = peak(outcomes);
        Self {
            date: utc_now(),
            label: config.label.clone(),
            backend: config.backend.clone(),
            tokenizer_id: config.tokenizer_id.clone(),
            percentile_metrics: config.percentile_metrics.clone(),
            base_url: config.target.base_url.clone(),
            endpoint: config.target.endpoint.clone(),
            model: config.target.model.clone(),
            request_rate: match config.request_rate {
                crate::arrival::RequestRate::Infinite => None,
                crate::arrival::RequestRate::PerSecond(r) => Some(r),
            },
            burstiness: config.burstiness,
            max_concurrency: config.max_concurrency,
            num_prompts: n,
            duration_s,
            completed,
            failed: n - completed,
            total_input_tokens,
            total_output_tokens,
            request_throughput: completed as f64 / d,
            request_goodput: (!config.slos.is_empty()).then(|| good as f64 / d),
            output_throughput: total_output_tokens as f64 / d,
            total_token_throughput: (total_input_tokens + total_output_tokens) as f64 / d,
            max_output_tokens_per_s,
            max_concurrent_requests,
            slos: config.slos,
            ttft_ms: Distribution::of(&ttft_ms, p),
            tpot_ms: Distribution::of(&tpot_ms, p),
            itl_ms: Distribution::of(&itl_ms, p),
            e2el_ms: Distribution::of(&e2el_ms, p),
            input_lens,
            output_lens,
            ttfts_s: ttfts,
            e2els_s: e2els,
            itls_s: outcomes.iter().map(|o| o.itl.clone()).collect(),
            generated_texts: outcomes.iter().map(|o| o.text.clone()).collect(),
            errors,
            error_counts,
            by_priority,
        }
    }

    /// The four latency metrics by their JSON names.
    pub fn metrics(&self) -> [(&'static str, &'static str, &Distribution); 4] {
        [
            ("ttft", "Time to First Token", &self.ttft_ms),
            ("tpot", "Time per Output Token (excl. 1st token)", &self.tpot_ms),
            ("itl", "Inter-token Latency", &self.itl_ms),
            ("e2el", "End-to-end Latency", &self.e2el_ms),
        ]
    }

    /// The metrics `--percentile-metrics` selected, in the table's order.
    fn selected_metrics(
        &self,
    ) -> impl Iterator<Item = (&'static str, &'static str, &Distribution)> {
        self.metrics()
            .into_iter()
            .filter(|(name, _, _)| self.percentile_metrics.iter().any(|m| m == name))
    }

    /// The result as vLLM's `bench serve` saves it; the per-request arrays only if `detailed`.
    pub fn to_json(&self, detailed: bool) -> Value {
        let mut m = Map::new();
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_owned(), v);
        };
        put("date", json!(self.date));
        put("endpoint_type", json!(self.backend));
        put("backend", json!(self.backend));
        put("label", json!(self.label));
        put("model_id", json!(self.model));
        put("tokenizer_id", json!(self.tokenizer_id));
        put("num_prompts", json!(self.num_prompts));
        put("request_rate", self.request_rate.map_or_else(|| json!("inf"), |r| json!(r)));
        put("burstiness", json!(self.burstiness));
        put("max_concurrency", json!(self.max_concurrency));
        put("base_url", json!(self.base_url));
        put("endpoint", json!(self.endpoint));
        put("duration", json!(self.duration_s));
        put("completed", json!(self.completed));
        put("failed", json!(self.failed));
        put("total_input_tokens", json!(self.total_input_tokens));
        put("total_output_tokens", json!(self.total_output_tokens));
        put("request_throughput", json!(self.request_throughput));
        put("request_goodput", json!(self.request_goodput));
        put("output_throughput", json!(self.output_throughput));
        put("total_token_throughput", json!(self.total_token_throughput));
        put("max_output_tokens_per_s", json!(self.max_output_tokens_per_s));
        put("max_concurrent_requests", json!(self.max_concurrent_requests));
        put(
            "goodput_slos_ms",
            json!({"ttft": self.slos.ttft_ms, "tpot": self.slos.tpot_ms, "e2el": self.slos.e2el_ms}),
        );
        for (name, _, d) in self.selected_metrics() {
            put(&format!("mean_{name}_ms"), json!(d.mean));
            put(&format!("median_{name}_ms"), json!(d.median));
            put(&format!("std_{name}_ms"), json!(d.std));
            for &(p, v) in &d.percentiles {
                put(&format!("p{}_{name}_ms", percentile_name(p)), json!(v));
            }
        }
        put("error_counts", json!(self.error_counts));
        if !self.by_priority.is_empty() {
            let classes: Map<String, Value> =
                self.by_priority.iter().map(|(p, r)| (p.to_string(), r.to_json(false))).collect();
            put("by_priority", Value::Object(classes));
        }
        if detailed {
            put("input_lens", json!(self.input_lens));
            put("output_lens", json!(self.output_lens));
            put("ttfts", json!(self.ttfts_s));
            put("itls", json!(self.itls_s));
            put("latencies", json!(self.e2els_s));
            put("generated_texts", json!(self.generated_texts));
            put("errors", json!(self.errors));
        }
        Value::Object(m)
    }

    /// The request rate as printed and as vLLM names result files: `inf` or the number.
    pub fn request_rate_text(&self) -> String {
        self.request_rate.map_or_else(|| "inf".into(), |r| r.to_string())
    }

    /// The human-readable table (vLLM's layout).
    pub fn report(&self) -> String {
        let mut s = String::new();
        let line = |s: &mut String, k: &str, v: String| {
            let _ = writeln!(s, "{k:<40}{v:<10}");
        };
        let _ = writeln!(s, "{:=^50}", " Serving Benchmark Result ");
        line(&mut s, "Successful requests:", self.completed.to_string());
        line(&mut s, "Failed requests:", self.failed.to_string());
        let conc = self.max_concurrency.map_or_else(|| "unlimited".into(), |c| c.to_string());
        line(&mut s, "Maximum request concurrency:", conc);
        line(&mut s, "Request rate (req/s):", self.request_rate_text());
        line(&mut s, "Benchmark duration (s):", format!("{:.2}", self.duration_s));
        line(&mut s, "Total input tokens:", self.total_input_tokens.to_string());
        line(&mut s, "Total generated tokens:", self.total_output_tokens.to_string());
        line(&mut s, "Request throughput (req/s):", format!("{:.2}", self.request_throughput));
        if let Some(g) = self.request_goodput {
            line(&mut s, "Request goodput (req/s):", format!("{g:.2}"));
        }
        line(&mut s, "Output token throughput (tok/s):", format!("{:.2}", self.output_throughput));
        line(
            &mut s,
            "Peak output token throughput (tok/s):",
            format!("{:.2}", self.max_output_tokens_per_s),
        );
        line(&mut s, "Peak concurrent requests:", self.max_concurrent_requests.to_string());
        line(
            &mut s,
            "Total token throughput (tok/s):",
            format!("{:.2}", self.total_token_throughput),
        );
        for (name, title, d) in self.selected_metrics() {
            let short = name.to_uppercase();
            let _ = writeln!(s, "{title:-^50}");
            line(&mut s, &format!("Mean {short} (ms):"), format!("{:.2}", d.mean));
            line(&mut s, &format!("Median {short} (ms):"), format!("{:.2}", d.median));
            line(&mut s, &format!("Std {short} (ms):"), format!("{:.2}", d.std));
            for &(p, v) in &d.percentiles {
                line(&mut s, &format!("P{} {short} (ms):", percentile_name(p)), format!("{v:.2}"));
            }
        }
        // The most frequent errors; messages that differ only in numbers (a predicted time) would
        // otherwise fill the screen.
        let mut errors: Vec<(&String, &usize)> = self.error_counts.iter().collect();
        errors.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
        for (e, n) in errors.iter().take(MAX_ERRORS_SHOWN) {
            let _ = writeln!(s, "error ({n}x): {e}");
        }
        if errors.len() > MAX_ERRORS_SHOWN {
            let rest = &errors[MAX_ERRORS_SHOWN..];
            let count: usize = rest.iter().map(|(_, n)| **n).sum();
            let _ = writeln!(s, "... {} more distinct errors ({count} requests)", rest.len());
        }
        for (priority, r) in &self.by_priority {
            let _ = writeln!(s, "{:-^50}", format!(" priority {priority} "));
            line(
                &mut s,
                "Requests (successful / failed):",
                format!("{} / {}", r.completed, r.failed),
            );
            if let Some(g) = r.request_goodput {
                line(&mut s, "Request goodput (req/s):", format!("{g:.2}"));
            }
            line(&mut s, "Output token throughput (tok/s):", format!("{:.2}", r.output_throughput));
            for (name, _, d) in r.selected_metrics() {
                let short = name.to_uppercase();
                line(&mut s, &format!("Median {short} (ms):"), format!("{:.2}", d.median));
                for &(p, v) in &d.percentiles {
                    line(
                        &mut s,
                        &format!("P{} {short} (ms):", percentile_name(p)),
                        format!("{v:.2}"),
                    );
                }
            }
        }
        let _ = writeln!(s, "{:=^50}", "");
        s
    }
}

/// Distinct errors listed by [`BenchResult::report`] (all are in the saved JSON).
const MAX_ERRORS_SHOWN: usize = 5;

/// One summary per `priority` the requests carried, when they carried more than one.
fn by_priority(
    config: &ServeBenchConfig,
    requests: &[BenchRequest],
    outcomes: &[Outcome],
    duration_s: f64,
    tok: &dyn PromptTokenizer,
) -> BTreeMap<i64, BenchResult> {
    let priorities: std::collections::BTreeSet<i64> =
        requests.iter().filter_map(|r| r.priority).collect();
    if priorities.len() < 2 {
        return BTreeMap::new();
    }
    priorities
        .into_iter()
        .map(|p| {
            let (reqs, outs): (Vec<BenchRequest>, Vec<Outcome>) = requests
                .iter()
                .zip(outcomes)
                .filter(|(r, _)| r.priority == Some(p))
                .map(|(r, o)| (r.clone(), o.clone()))
                .unzip();
            (p, BenchResult::summarise(config, &reqs, &outs, duration_s, tok))
        })
        .collect()
}

/// vLLM's peak metrics: the most output tokens (text chunks, as vLLM counts them) received in
/// one whole second of the run, and how many requests were in flight during that second.
fn peak(outcomes: &[Outcome]) -> (f64, usize) {
    let mut per_second: BTreeMap<u64, u64> = BTreeMap::new();
    for o in outcomes.iter().filter(|o| o.success) {
        let mut t = o.sent_at + o.ttft;
        *per_second.entry(t as u64).or_default() += 1;
        for gap in &o.itl {
            t += gap;
            *per_second.entry(t as u64).or_default() += 1;
        }
    }
    let Some((&second, &tokens)) =
        per_second.iter().max_by_key(|&(s, n)| (*n, std::cmp::Reverse(*s)))
    else {
        return (0.0, 0);
    };
    let (lo, hi) = (second as f64, second as f64 + 1.0);
    let concurrent = outcomes
        .iter()
        .filter(|o| o.success && o.sent_at < hi && o.sent_at + o.latency >= lo)
        .count();
    (tokens as f64, concurrent)
}

/// `99` for 99.0, `99.9` for 99.9.
fn percentile_name(p: f64) -> String {
    if p.fract() == 0.0 { format!("{}", p as u64) } else { format!("{p}") }
}

/// The current UTC time as `YYYYMMDD-HHMMSS` (vLLM's `date`, which is in local time).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_utc(secs)
}

fn format_utc(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}-{:02}{:02}{:02}", rem / 3600, rem / 60 % 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arrival::RequestRate;
    use crate::client::Target;
    use crate::dataset::tests::Letters;

    #[test]
    fn formats_utc_dates() {
        assert_eq!(format_utc(0), "19700101-000000");
        assert_eq!(format_utc(951_782_400 + 3_661), "20000229-010101");
        assert_eq!(format_utc(1_795_305_600), "20261122-000000");
        assert_eq!((percentile_name(99.0), percentile_name(99.9)), ("99".into(), "99.9".into()));
    }

    #[test]
    fn summarises_outcomes() {
        let config = ServeBenchConfig {
            target: Target {
                base_url: "http://x".into(),
                endpoint: "/v1/completions".into(),
                model: "m".into(),
                api_key: None,
                ignore_eos: true,
                temperature: None,
                extra_body: None,
            },
            request_rate: RequestRate::Infinite,
            burstiness: 1.0,
            max_concurrency: Some(2),
            slos: Slos { ttft_ms: Some(150.0), ..Slos::default() },
            percentiles: vec![50.0, 99.0],
            seed: 0,
            show_progress: false,
            label: String::new(),
            backend: "openai".into(),
            tokenizer_id: "tok".into(),
            percentile_metrics: vec!["ttft".into(), "tpot".into(), "itl".into(), "e2el".into()],
        };
        let req = BenchRequest {
            prompt: "abc".into(),
            prompt_len: 3,
            output_len: 4,
            priority: None,
            model: None,
        };
        let ok = |ttft: f64, usage: Option<usize>| Outcome {
            success: true,
            ttft,
            latency: ttft + 0.3,
            itl: vec![0.1; 3],
            usage_output_tokens: usage,
            text: "wxyz".into(),
            ..Outcome::default()
        };
        let failed = Outcome { error: Some("HTTP 500: boom".into()), ..Outcome::default() };
        let outcomes = [ok(0.1, Some(4)), ok(0.2, None), failed];
        let r = BenchResult::summarise(
            &config,
            &[req.clone(), req.clone(), req],
            &outcomes,
            2.0,
            &Letters,
        );
        assert_eq!((r.completed, r.failed), (2, 1));
        assert_eq!((r.total_input_tokens, r.total_output_tokens), (6, 8));
        assert_eq!(r.output_lens, vec![4, 4, 0]);
        assert!((r.request_throughput - 1.0).abs() < 1e-12);
        assert!((r.request_goodput.unwrap() - 0.5).abs() < 1e-12);
        assert!((r.tpot_ms.mean - 100.0).abs() < 1e-9);
        assert!((r.ttft_ms.mean - 150.0).abs() < 1e-9);
        assert_eq!(r.itl_ms.percentiles.len(), 2);
        assert_eq!(r.error_counts.get("HTTP 500: boom"), Some(&1));
        assert!(r.by_priority.is_empty(), "requests without priorities get no breakdown");
        let with = |p| BenchRequest {
            prompt: "abc".into(),
            prompt_len: 3,
            output_len: 4,
            priority: Some(p),
            model: None,
        };
        let m =
            BenchResult::summarise(&config, &[with(0), with(1), with(1)], &outcomes, 2.0, &Letters);
        assert_eq!(m.by_priority.keys().copied().collect::<Vec<_>>(), vec![0, 1]);
        let (p0, p1) = (&m.by_priority[&0], &m.by_priority[&1]);
        assert_eq!((p0.completed, p1.completed, p1.failed), (1, 1, 1));
        assert_eq!(m.to_json(false)["by_priority"]["1"]["failed"], 1);
        assert!(m.report().contains(" priority 0 "), "{}", m.report());
        let j = r.to_json(true);
        for key in
            ["p99_ttft_ms", "median_itl_ms", "std_e2el_ms", "request_goodput", "itls", "errors"]
        {
            assert!(j.get(key).is_some(), "{key}");
        }
        assert_eq!(
            (j["request_rate"].as_str(), j["backend"].as_str()),
            (Some("inf"), Some("openai"))
        );
        assert!(r.to_json(false).get("itls").is_none());
        // Each success: first token at 0.1 / 0.2 s, then three more 0.1 s apart, all in second 0.
        assert_eq!((r.max_output_tokens_per_s, r.max_concurrent_requests), (8.0, 2));
        let text = r.report();
        assert!(text.contains("Successful requests:") && text.contains("P99 TPOT (ms):"), "{text}");
    }
}
