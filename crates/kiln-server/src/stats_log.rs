//! The periodic stats line vLLM's servers log (`--log-stats-interval` seconds apart; off with
//! `--disable-log-stats`):
//!
//! ```text
//! Avg prompt throughput: 412.3 tokens/s, Avg generation throughput: 96.1 tokens/s, Running: 8 reqs, Waiting: 2 reqs, KV cache usage: 31.2%, Prefix cache hit rate: 47.9%
//! ```
//!
//! Throughputs are over the interval just ended; running, waiting and KV cache usage are as of
//! the last engine step; the prefix cache hit rate is that of the interval's lookups (the
//! whole run's while the interval had none). As in vLLM, an idle server logs nothing: a line is
//! written when this interval or the one before had tokens. With speculative decoding, an
//! interval that verified drafts adds vLLM's "SpecDecoding metrics" line (acceptance over the
//! interval). With LoRA adapters loaded, the line ends with them: how many are loaded and which
//! run (`, LoRA adapters: 3 loaded, running: sql, chat`). With prefill/decode disaggregation,
//! an interval that moved KV (or failed to) adds a line: `KV transfer: sent 120 blocks (35.2
//! MiB/s), received 0 blocks (0.0 MiB/s), 0 failures, 16 blocks pinned`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::lora::LoraRegistry;
use crate::metrics::{StatsTotals, kv_transfer, spec_decode_log_line};
use crate::state::ServerState;

/// One stats line from the totals at the start and end of an interval of `elapsed`.
pub fn stats_line(before: &StatsTotals, now: &StatsTotals, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64().max(1e-9);
    let rate = |a: u64, b: u64| b.saturating_sub(a) as f64 / secs;
    let queries = now.prefix_cache_queries.saturating_sub(before.prefix_cache_queries);
    let hits = now.prefix_cache_hits.saturating_sub(before.prefix_cache_hits);
    let (hits, queries) = if queries > 0 {
        (hits, queries)
    } else {
        (now.prefix_cache_hits, now.prefix_cache_queries)
    };
    let hit_rate = if queries > 0 { hits as f64 / queries as f64 } else { 0.0 };
    format!(
        "Avg prompt throughput: {:.1} tokens/s, Avg generation throughput: {:.1} tokens/s, \
         Running: {} reqs, Waiting: {} reqs, KV cache usage: {:.1}%, Prefix cache hit rate: \
         {:.1}%",
        rate(before.prompt_tokens, now.prompt_tokens),
        rate(before.generation_tokens, now.generation_tokens),
        now.num_running,
        now.num_waiting,
        now.kv_cache_usage * 100.0,
        hit_rate * 100.0,
    )
}

/// The end of the stats line naming the adapters (empty with none loaded).
pub fn lora_suffix(num_loaded: usize, running: &[String]) -> String {
    match (num_loaded, running.is_empty()) {
        (0, _) => String::new(),
        (n, true) => format!(", LoRA adapters: {n} loaded, none running"),
        (n, false) => format!(", LoRA adapters: {n} loaded, running: {}", running.join(", ")),
    }
}

/// [`lora_suffix`] of the engine's adapters as of its last step.
fn adapters_now(lora: &LoraRegistry, adapters: kiln_engine::AdapterStats) -> String {
    lora_suffix(adapters.loaded.len(), &lora.names(adapters.running))
}

/// Logs a stats line every `interval` while the server runs (from when the model is loaded).
///
/// The first interval's baseline is the model's zero totals as of the tick before the one that
/// first finds it loaded: a request served between the load and that tick is still logged.
pub async fn run(state: Arc<ServerState>, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut before: Option<(StatsTotals, Instant)> = None;
    let mut last_tick = Instant::now();
    let mut was_busy = false;
    loop {
        ticker.tick().await;
        let at = Instant::now();
        let tick_before = std::mem::replace(&mut last_tick, at);
        let Some(loaded) = state.loaded() else { continue };
        let now = loaded.metrics.totals();
        let (prev, prev_at) = before.unwrap_or_else(|| (StatsTotals::default(), tick_before));
        let busy = now.prompt_tokens != prev.prompt_tokens
            || now.generation_tokens != prev.generation_tokens;
        if busy || was_busy {
            let adapters = adapters_now(&loaded.lora, loaded.engine.stats().adapters);
            tracing::info!("{}{adapters}", stats_line(&prev, &now, at - prev_at));
        }
        if now.spec_decode.num_drafts > prev.spec_decode.num_drafts {
            tracing::info!("{}", spec_decode_log_line(&prev.spec_decode, &now.spec_decode));
        }
        let secs = (at - prev_at).as_secs_f64();
        if let Some(line) = kv_transfer::log_line(&prev.kv_transfer, &now.kv_transfer, secs) {
            tracing::info!("{line}");
        }
        was_busy = busy;
        before = Some((now, at));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_rates_usage_and_hit_rate() {
        let before = StatsTotals {
            prompt_tokens: 100,
            generation_tokens: 10,
            prefix_cache_queries: 100,
            prefix_cache_hits: 0,
            ..StatsTotals::default()
        };
        let now = StatsTotals {
            prompt_tokens: 1100,
            generation_tokens: 210,
            num_running: 3,
            num_waiting: 1,
            kv_cache_usage: 0.25,
            prefix_cache_queries: 300,
            prefix_cache_hits: 50,
            ..StatsTotals::default()
        };
        assert_eq!(
            stats_line(&before, &now, Duration::from_secs(10)),
            "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, \
             Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
        );
        // No lookups in the interval: the whole run's rate.
        let idle = StatsTotals { prompt_tokens: 1100, ..now };
        assert!(stats_line(&now, &idle, Duration::from_secs(10)).ends_with("hit rate: 16.7%"));
    }

    #[test]
    fn the_kv_transfer_line_appears_when_kv_moved() {
        use crate::metrics::kv_transfer::{KvTransferTotals, log_line};
        let before = KvTransferTotals::default();
        assert_eq!(log_line(&before, &before, 10.0), None);
        let now = KvTransferTotals {
            blocks_sent: 120,
            bytes_sent: 120 << 20,
            failures: 1,
            pinned_blocks: 16,
            ..before
        };
        assert_eq!(
            log_line(&before, &now, 10.0).unwrap(),
            "KV transfer: sent 120 blocks (12.0 MiB/s), received 0 blocks (0.0 MiB/s), 1 \
             failures, 16 blocks pinned"
        );
    }

    #[test]
    fn the_adapters_end_the_line_when_loaded() {
        assert_eq!(lora_suffix(0, &[]), "");
        assert_eq!(lora_suffix(2, &[]), ", LoRA adapters: 2 loaded, none running");
        let running = ["sql".to_owned(), "chat".to_owned()];
        assert_eq!(lora_suffix(3, &running), ", LoRA adapters: 3 loaded, running: sql, chat");
    }
}
