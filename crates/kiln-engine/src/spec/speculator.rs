//! The engine's drafting loop: after every step, count how each verified draft fared, then
//! propose drafts for the next step.
//!
//! Back-off, per request: drafts are judged over windows of [`WINDOW_DRAFT_TOKENS`] draft
//! tokens; a window accepting less than [`MIN_ACCEPTANCE_RATE`] of them pauses drafting for the
//! request for `2^strikes` steps (at most [`MAX_PAUSE_STEPS`]), a good window clears the
//! strikes. Globally: no drafting in a step that starts with `disable_by_batch_size` or more
//! running requests (decode is then compute-bound, and verifying drafts costs what it saves).
//!
//! State is kept per request until it finishes or is aborted (`forget`); a preempted request
//! keeps its back-off. Drafts are only proposed for a running request whose next step is a
//! decode; the scheduler drops them if that changes (preemption).

use std::collections::HashMap;
use std::time::Instant;

use kiln_core::{RequestId, TokenId};
use kiln_sched::{ModelRunnerOutput, Scheduler, SchedulerOutput};

use super::config::{SpecMethod, SpeculativeConfig};
use super::ngram;
use super::stats::SpecDecodeStats;

/// Draft tokens per back-off window.
const WINDOW_DRAFT_TOKENS: u32 = 32;
/// Acceptance below which a window counts as a strike.
const MIN_ACCEPTANCE_RATE: f64 = 0.2;
/// Longest pause, in steps.
const MAX_PAUSE_STEPS: u32 = 64;

#[derive(Clone, Copy, Debug, Default)]
struct Backoff {
    window_drafted: u32,
    window_accepted: u32,
    strikes: u32,
    /// Steps left without drafting.
    pause: u32,
}

impl Backoff {
    fn observe(&mut self, num_draft: usize, num_accepted: usize) {
        self.window_drafted += num_draft as u32;
        self.window_accepted += num_accepted as u32;
        if self.window_drafted < WINDOW_DRAFT_TOKENS {
            return;
        }
        let rate = f64::from(self.window_accepted) / f64::from(self.window_drafted);
        if rate < MIN_ACCEPTANCE_RATE {
            self.strikes = (self.strikes + 1).min(MAX_PAUSE_STEPS.ilog2());
            self.pause = 1 << self.strikes;
        } else {
            self.strikes = 0;
        }
        self.window_drafted = 0;
        self.window_accepted = 0;
    }

    /// Whether this step drafts (counts a paused step down).
    fn drafts(&mut self) -> bool {
        if self.pause > 0 {
            self.pause -= 1;
            false
        } else {
            true
        }
    }
}

/// Proposes draft tokens and keeps the acceptance counters.
#[derive(Debug)]
pub struct Speculator {
    config: SpeculativeConfig,
    backoff: HashMap<RequestId, Backoff>,
    stats: SpecDecodeStats,
    /// Scratch: one request's drafts; the running ids.
    draft: Vec<TokenId>,
    running: Vec<RequestId>,
}

impl Speculator {
    pub fn new(config: SpeculativeConfig) -> Self {
        Self {
            config,
            backoff: HashMap::new(),
            stats: SpecDecodeStats::default(),
            draft: Vec::new(),
            running: Vec::new(),
        }
    }

    /// Continues counting from `stats`.
    #[must_use]
    pub fn with_stats(mut self, stats: SpecDecodeStats) -> Self {
        self.stats = stats;
        self
    }

    pub fn config(&self) -> &SpeculativeConfig {
        &self.config
    }

    pub fn stats(&self) -> &SpecDecodeStats {
        &self.stats
    }

    /// Drops what is known about a finished or aborted request.
    pub fn forget(&mut self, id: RequestId) {
        self.backoff.remove(&id);
    }

    /// Counts the verifications of a step: with `k` drafts scheduled and `g` tokens generated,
    /// `g - 1` drafts were accepted. `model_output` is in `sched_out.scheduled()` order.
    pub fn record_step(&mut self, sched_out: &SchedulerOutput, model_output: &ModelRunnerOutput) {
        if sched_out.num_scheduled_spec_tokens == 0 {
            return;
        }
        let first_cached = sched_out.new_requests.len();
        for (i, cached) in sched_out.cached_requests.iter().enumerate() {
            let num_draft = cached.spec_token_ids.len();
            if num_draft == 0 {
                continue;
            }
            let Some((id, generated)) = model_output.get(first_cached + i) else { continue };
            debug_assert_eq!(id, cached.id);
            let num_accepted = generated.len().saturating_sub(1).min(num_draft);
            self.stats.record(num_draft, num_accepted);
            self.backoff.entry(id).or_default().observe(num_draft, num_accepted);
        }
    }

    /// Proposes drafts for the next step of every running request that decodes next.
    pub fn propose(&mut self, scheduler: &mut Scheduler) {
        let start = Instant::now();
        self.propose_drafts(scheduler);
        self.stats.propose_nanos += u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    }

    fn propose_drafts(&mut self, scheduler: &mut Scheduler) {
        self.running.clear();
        self.running.extend_from_slice(scheduler.running_ids());
        if self.running.len() >= self.config.disable_by_batch_size {
            return;
        }
        let max_model_len = scheduler.config().max_model_len;
        let SpecMethod::Ngram { min, max } = self.config.method;
        for &id in &self.running {
            let Some(req) = scheduler.request(id) else { continue };
            if req.num_uncomputed_tokens() != 1 {
                continue; // still prefilling
            }
            // A step yields at most one token more than it verifies.
            let k = self
                .config
                .num_speculative_tokens
                .min(req.num_remaining_tokens(max_model_len).saturating_sub(1));
            if k == 0 || !self.backoff.entry(id).or_default().drafts() {
                continue;
            }
            ngram::propose(req.all_token_ids(), min, max, k, &mut self.draft);
            if !self.draft.is_empty() {
                scheduler.update_draft_token_ids(id, &self.draft);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_pauses_after_bad_windows_and_clears_after_a_good_one() {
        let mut b = Backoff::default();
        b.observe(32, 2); // 6 % accepted
        assert_eq!(b.pause, 2);
        assert!(!b.drafts() && !b.drafts() && b.drafts());
        b.observe(32, 0);
        assert_eq!(b.pause, 4);
        for _ in 0..10 {
            b.observe(32, 0);
        }
        assert_eq!(b.pause, MAX_PAUSE_STEPS);
        b.pause = 0;
        b.observe(16, 16);
        b.observe(16, 0); // one window of 32, half accepted
        assert_eq!((b.strikes, b.pause), (0, 0));
    }
}
