//! Speculative-decoding metrics, vLLM's names under the metrics prefix (`kiln:` by default; all counters, advanced by the
//! delta of the engine's totals, like the others):
//! `kiln:spec_decode_num_drafts_total` (verifications), `kiln:spec_decode_num_draft_tokens_total`,
//! `kiln:spec_decode_num_accepted_tokens_total` and
//! `kiln:spec_decode_num_accepted_tokens_per_pos_total{position}` (a series per draft position,
//! created when that position is first drafted and accepted).
//!
//! [`log_line`] is vLLM's "SpecDecoding metrics" line over an interval, logged with the periodic
//! stats line (`crate::stats_log`) when drafts were verified in it.

use kiln_engine::SpecDecodeStats;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

type PositionLabel = [(&'static str, String); 1];

#[derive(Debug, Default)]
pub(super) struct SpecMetrics {
    drafts: Counter,
    draft_tokens: Counter,
    accepted_tokens: Counter,
    accepted_tokens_per_pos: Family<PositionLabel, Counter>,
}

impl SpecMetrics {
    pub(super) fn register(&self, r: &mut Registry, prefix: &str) {
        let name = |n: &str| format!("{prefix}:{n}");
        r.register(
            name("spec_decode_num_drafts"),
            "Number of spec decoding drafts",
            self.drafts.clone(),
        );
        r.register(
            name("spec_decode_num_draft_tokens"),
            "Number of draft tokens",
            self.draft_tokens.clone(),
        );
        r.register(
            name("spec_decode_num_accepted_tokens"),
            "Number of accepted tokens",
            self.accepted_tokens.clone(),
        );
        r.register(
            name("spec_decode_num_accepted_tokens_per_pos"),
            "Accepted tokens per draft position",
            self.accepted_tokens_per_pos.clone(),
        );
    }

    /// Advances the counters to `now` (totals); a total smaller than one seen is ignored.
    pub(super) fn update(&self, last: &mut SpecDecodeStats, now: &SpecDecodeStats) {
        super::advance(&self.drafts, &mut last.num_drafts, now.num_drafts);
        super::advance(&self.draft_tokens, &mut last.num_draft_tokens, now.num_draft_tokens);
        super::advance(
            &self.accepted_tokens,
            &mut last.num_accepted_tokens,
            now.num_accepted_tokens,
        );
        let positions =
            last.num_accepted_tokens_per_pos.iter_mut().zip(now.num_accepted_tokens_per_pos);
        for (pos, (seen, total)) in positions.enumerate() {
            if total > *seen {
                let label = [("position", pos.to_string())];
                super::advance(&self.accepted_tokens_per_pos.get_or_create(&label), seen, total);
            }
        }
    }
}

/// vLLM's "SpecDecoding metrics" line for the drafts verified between `before` and `now`.
pub fn log_line(before: &SpecDecodeStats, now: &SpecDecodeStats) -> String {
    let d = now.since(before);
    let per_pos: Vec<String> =
        d.acceptance_rate_per_pos().iter().map(|r| format!("{r:.3}")).collect();
    format!(
        "SpecDecoding metrics: Mean acceptance length: {:.2}, Accepted: {} tokens, Drafted: {} \
         tokens, Per-position acceptance rate: {}, Avg Draft acceptance rate: {:.1}%",
        d.mean_acceptance_length(),
        d.num_accepted_tokens,
        d.num_draft_tokens,
        per_pos.join(", "),
        100.0 * d.acceptance_rate()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_line_covers_the_interval_only() {
        let mut before = SpecDecodeStats::default();
        before.record(4, 4);
        let mut now = before;
        now.record(4, 2);
        now.record(4, 0);
        assert_eq!(
            log_line(&before, &now),
            "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted: 2 tokens, Drafted: 8 \
             tokens, Per-position acceptance rate: 0.500, 0.500, Avg Draft acceptance rate: 25.0%"
        );
    }
}
