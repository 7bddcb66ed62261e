//! Second-tier KV metrics under the metrics prefix (`kiln:` by default; kiln's own, vLLM has no
//! such series): counters `kiln:kv_swapped_out_blocks_total` and
//! `kiln:kv_swapped_in_blocks_total` (KV blocks of preempted requests copied to and from the
//! tier), `kiln:kv_tier_spilled_blocks_total` (prefix-cache blocks copied to the tier when the
//! KV cache evicted them) and `kiln:kv_tier_prefix_hits_total` (prompt tokens found there past
//! the KV cache's hits, in the unit of `prefix_cache_hits_total`: divided by
//! `prefix_cache_queries_total` it is the tier's hit rate),
//! `kiln:num_preemptions_by_mode_total{mode}` (`swap`: the KV went to the tier; `recompute`: it
//! was dropped; both series exist from the start at 0, and count only with a tier), advanced by
//! the delta of the engine's totals like the others; gauge `kiln:kv_tier_usage_perc` (fraction of
//! the tier's slots in use, by swapped requests or spilled blocks, 0..=1; 0 without a tier).

use kiln_engine::SwapStats;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

type ModeLabel = [(&'static str, &'static str); 1];

const SWAP: ModeLabel = [("mode", "swap")];
const RECOMPUTE: ModeLabel = [("mode", "recompute")];

#[derive(Debug, Default)]
pub(super) struct SwapMetrics {
    swapped_out_blocks: Counter,
    swapped_in_blocks: Counter,
    spilled_blocks: Counter,
    tier_prefix_hits: Counter,
    preemptions_by_mode: Family<ModeLabel, Counter>,
    tier_usage: Gauge<f64, AtomicU64>,
}

impl SwapMetrics {
    pub(super) fn register(&self, r: &mut Registry, prefix: &str) {
        let name = |n: &str| format!("{prefix}:{n}");
        r.register(
            name("kv_swapped_out_blocks"),
            "KV blocks copied to the second tier by preemption",
            self.swapped_out_blocks.clone(),
        );
        r.register(
            name("kv_swapped_in_blocks"),
            "KV blocks copied back from the second tier on resume",
            self.swapped_in_blocks.clone(),
        );
        r.register(
            name("kv_tier_spilled_blocks"),
            "Prefix-cache blocks copied to the second tier when the KV cache evicted them",
            self.spilled_blocks.clone(),
        );
        r.register(
            name("kv_tier_prefix_hits"),
            "Prompt tokens found in the second tier past the prefix cache's hits",
            self.tier_prefix_hits.clone(),
        );
        for mode in [SWAP, RECOMPUTE] {
            drop(self.preemptions_by_mode.get_or_create(&mode));
        }
        r.register(
            name("num_preemptions_by_mode"),
            "Preemptions with a second KV tier, by what happened to the KV (swap or recompute)",
            self.preemptions_by_mode.clone(),
        );
        r.register(
            name("kv_tier_usage_perc"),
            "Second KV tier usage. 1 means 100 percent usage",
            self.tier_usage.clone(),
        );
    }

    /// Advances the counters to `now` (totals); a total smaller than one seen is ignored.
    pub(super) fn update(&self, last: &mut SwapStats, now: &SwapStats) {
        use super::advance;
        advance(
            &self.swapped_out_blocks,
            &mut last.num_swapped_out_blocks,
            now.num_swapped_out_blocks,
        );
        advance(
            &self.swapped_in_blocks,
            &mut last.num_swapped_in_blocks,
            now.num_swapped_in_blocks,
        );
        advance(&self.spilled_blocks, &mut last.num_spilled_blocks, now.num_spilled_blocks);
        advance(&self.tier_prefix_hits, &mut last.num_tier_hit_tokens, now.num_tier_hit_tokens);
        let swap = self.preemptions_by_mode.get_or_create(&SWAP);
        advance(&swap, &mut last.num_swap_preemptions, now.num_swap_preemptions);
        let recompute = self.preemptions_by_mode.get_or_create(&RECOMPUTE);
        advance(&recompute, &mut last.num_recompute_preemptions, now.num_recompute_preemptions);
        self.tier_usage.set(f64::from(now.usage()));
    }
}
