//! The Prometheus text exposition format 0.0.4 from our OpenMetrics text, for scrapers that do
//! not ask for OpenMetrics (vLLM serves this format by default).
//!
//! The differences that matter: counters are named with their `_total` suffix in `# HELP` and
//! `# TYPE` (OpenMetrics names the family without it); `# UNIT` lines, `_created` samples and
//! the `# EOF` marker do not exist; `info` and `unknown` types are `gauge` and `untyped`.
//! Sample lines are the same in both. O(length of the text).

use std::collections::HashSet;
use std::fmt::Write as _;

/// Converts OpenMetrics text (as [`super::Metrics::render`] writes it) to text format 0.0.4.
pub fn from_openmetrics(text: &str) -> String {
    let counters: HashSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ").or_else(|| line.strip_prefix("# TYPE ")) {
            let keyword = &line[..7];
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            let name =
                if counters.contains(name) { format!("{name}_total") } else { name.to_owned() };
            let tail = match tail {
                "info" => "gauge",
                "unknown" => "untyped",
                t => t,
            };
            let _ = writeln!(out, "{keyword}{name} {tail}");
            continue;
        }
        let metric = line.split(['{', ' ']).next().unwrap_or("");
        if metric.ends_with("_created") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::from_openmetrics;

    #[test]
    fn counters_take_their_total_suffix_and_openmetrics_only_lines_go() {
        let om = "# HELP vllm:prompt_tokens Number of prefill tokens processed.\n\
                  # TYPE vllm:prompt_tokens counter\n\
                  vllm:prompt_tokens_total{model_name=\"m\"} 3\n\
                  vllm:prompt_tokens_created{model_name=\"m\"} 1.7e9\n\
                  # HELP vllm:kv_cache_usage_perc KV-cache usage.\n\
                  # TYPE vllm:kv_cache_usage_perc gauge\n\
                  # UNIT vllm:kv_cache_usage_perc ratio\n\
                  vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n\
                  # EOF\n";
        assert_eq!(
            from_openmetrics(om),
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n\
             # TYPE vllm:prompt_tokens_total counter\n\
             vllm:prompt_tokens_total{model_name=\"m\"} 3\n\
             # HELP vllm:kv_cache_usage_perc KV-cache usage.\n\
             # TYPE vllm:kv_cache_usage_perc gauge\n\
             vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n"
        );
    }
}
