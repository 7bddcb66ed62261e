//! Speculative-decoding counters (vLLM's `spec_decode_*` metrics), totals since start.

use super::config::MAX_SPEC_TOKENS;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecDecodeStats {
    /// Verifications: one per request and step that had draft tokens scheduled.
    pub num_drafts: u64,
    /// Draft tokens verified.
    pub num_draft_tokens: u64,
    /// Of those, accepted (the target produced the same token).
    pub num_accepted_tokens: u64,
    /// Entry `i`: drafts whose token at position `i` was accepted (so entry 0 counts the
    /// verifications that accepted at least one token).
    pub num_accepted_tokens_per_pos: [u64; MAX_SPEC_TOKENS],
    /// Time spent proposing drafts, in nanoseconds.
    pub propose_nanos: u64,
}

impl Default for SpecDecodeStats {
    fn default() -> Self {
        Self {
            num_drafts: 0,
            num_draft_tokens: 0,
            num_accepted_tokens: 0,
            num_accepted_tokens_per_pos: [0; MAX_SPEC_TOKENS],
            propose_nanos: 0,
        }
    }
}

impl SpecDecodeStats {
    /// Counts one verification of `num_draft` tokens of which the first `num_accepted` were
    /// accepted.
    pub fn record(&mut self, num_draft: usize, num_accepted: usize) {
        debug_assert!(num_accepted <= num_draft);
        self.num_drafts += 1;
        self.num_draft_tokens += num_draft as u64;
        self.num_accepted_tokens += num_accepted as u64;
        for slot in self.num_accepted_tokens_per_pos.iter_mut().take(num_accepted) {
            *slot += 1;
        }
    }

    /// What was counted since `before` (an earlier reading of the same totals; counters that
    /// went backwards give 0).
    #[must_use]
    pub fn since(&self, before: &Self) -> Self {
        let mut d = Self {
            num_drafts: self.num_drafts.saturating_sub(before.num_drafts),
            num_draft_tokens: self.num_draft_tokens.saturating_sub(before.num_draft_tokens),
            num_accepted_tokens: self
                .num_accepted_tokens
                .saturating_sub(before.num_accepted_tokens),
            propose_nanos: self.propose_nanos.saturating_sub(before.propose_nanos),
            ..Self::default()
        };
        let pairs =
            self.num_accepted_tokens_per_pos.iter().zip(&before.num_accepted_tokens_per_pos);
        for (slot, (now, then)) in d.num_accepted_tokens_per_pos.iter_mut().zip(pairs) {
            *slot = now.saturating_sub(*then);
        }
        d
    }

    /// Accepted draft tokens per draft token (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.num_accepted_tokens, self.num_draft_tokens)
    }

    /// Tokens a verification yields on average: the accepted drafts plus the token sampled
    /// after them (vLLM's "mean acceptance length").
    pub fn mean_acceptance_length(&self) -> f64 {
        if self.num_drafts == 0 {
            0.0
        } else {
            1.0 + ratio(self.num_accepted_tokens, self.num_drafts)
        }
    }

    /// The per-position acceptance rates, up to the last position drafted.
    pub fn acceptance_rate_per_pos(&self) -> Vec<f64> {
        let used =
            self.num_accepted_tokens_per_pos.iter().rposition(|&n| n > 0).map_or(0, |p| p + 1);
        self.num_accepted_tokens_per_pos[..used]
            .iter()
            .map(|&n| ratio(n, self.num_drafts))
            .collect()
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_position() {
        let mut s = SpecDecodeStats::default();
        s.record(3, 2);
        s.record(3, 0);
        s.record(2, 2);
        assert_eq!((s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens), (3, 8, 4));
        assert_eq!(&s.num_accepted_tokens_per_pos[..3], &[2, 2, 0]);
        assert_eq!(s.acceptance_rate(), 0.5);
        assert!((s.mean_acceptance_length() - (1.0 + 4.0 / 3.0)).abs() < 1e-12);
        assert_eq!(s.acceptance_rate_per_pos(), vec![2.0 / 3.0, 2.0 / 3.0]);
        assert_eq!(SpecDecodeStats::default().mean_acceptance_length(), 0.0);
        let mut later = s;
        later.record(4, 1);
        let d = later.since(&s);
        assert_eq!((d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens), (1, 4, 1));
        assert_eq!(&d.num_accepted_tokens_per_pos[..2], &[1, 0]);
        assert_eq!(s.since(&later), SpecDecodeStats::default());
    }
}
