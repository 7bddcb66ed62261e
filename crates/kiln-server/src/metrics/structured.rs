//! Structured-output metrics under the metrics prefix (kiln's own; vLLM has no such series):
//! counters `kiln:structured_output_tokens_total` (tokens sampled under a grammar),
//! `kiln:structured_output_masks_total` (of those, the ones that needed the vocabulary-wide
//! mask; the rest were admitted by checking the one token picked) and
//! `kiln:structured_output_mask_seconds_total` (time spent computing those masks), advanced by
//! the delta of the engine's totals like the other counters. A mask is computed when the token
//! picked without it is refused or is end of sequence, at least every 32 tokens, and for every
//! token of requests sampled with top-k, top-p or min-p (a model's generation-config defaults
//! count); masks per token near 1 with greedy requests mean the model keeps picking tokens the
//! grammar refuses. Mask seconds per mask is the grammar's cost.

use kiln_engine::structured::ConstraintStats;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

#[derive(Debug, Default)]
pub(super) struct StructuredMetrics {
    tokens: Counter,
    masks: Counter,
    mask_seconds: super::SecondsCounter,
}

impl StructuredMetrics {
    pub(super) fn register(&self, r: &mut Registry, prefix: &str) {
        let name = |n: &str| format!("{prefix}:{n}");
        r.register(
            name("structured_output_tokens"),
            "Tokens sampled under a structured-output grammar",
            self.tokens.clone(),
        );
        r.register(
            name("structured_output_masks"),
            "Structured-output tokens that needed the vocabulary-wide grammar mask",
            self.masks.clone(),
        );
        r.register(
            name("structured_output_mask_seconds"),
            "Time spent computing structured-output grammar masks",
            self.mask_seconds.clone(),
        );
    }

    /// Advances the counters to `now` (totals); a total smaller than one seen is ignored.
    pub(super) fn update(&self, last: &mut ConstraintStats, now: &ConstraintStats) {
        super::advance(&self.tokens, &mut last.tokens, now.tokens);
        super::advance(&self.masks, &mut last.masks, now.masks);
        super::advance_seconds(&self.mask_seconds, &mut last.mask_time, now.mask_time);
    }
}
