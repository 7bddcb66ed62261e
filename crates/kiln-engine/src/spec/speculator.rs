//! The engine's drafting loop: after every step, count how each verified draft fared, then
//! propose drafts for the next step.
//!
//! Back-off, per request: drafts are judged over windows of [`WINDOW_DRAFT_TOKENS`] draft
//! tokens; a window accepting less than the break-even rate of them pauses drafting for the
//! request for `2^strikes` steps (at most [`MAX_PAUSE_STEPS`]), a good window clears the
//! strikes. Globally: no drafting in a step that starts with `disable_by_batch_size` or more
//! running requests (decode is then compute-bound, and verifying drafts costs what it saves).
//!
//! The break-even rate ([`break_even_acceptance`]) comes from measured costs: a step with `k`
//! drafts yields `E(a) = (1 - a^(k+1)) / (1 - a)` tokens at acceptance `a`, and costs
//! `(1 + VERIFY_ROW_COST · k) · (1 + propose / verify)` plain steps, where `propose / verify` is
//! the ratio of the measured proposing time (moving averages over steady rounds: drafting
//! without a long catch-up) to the measured forward time of verification steps. Drafting pays
//! when `E(a)` exceeds that cost; the rate never goes below [`MIN_ACCEPTANCE_RATE`]. Prompt
//! lookup proposes in microseconds (the floor holds); a draft model's passes cost about as much
//! as the verification itself, so it needs most of its drafts accepted.
//!
//! With a token tree of `n` nodes and `depth` levels the rate is that of drafted nodes accepted,
//! and its break-even ([`tree_break_even_acceptance`]) weighs `1 + a · n` tokens against the
//! cost of `n` verified rows; its floor is the chain's scaled by `depth / n`.
//!
//! A request's back-off lives in its `LiveRequest` and leaves with it; a preempted request
//! keeps it. Drafts are only proposed for a running request whose next step is a decode; the
//! scheduler drops them if that changes (preemption).
//!
//! The requests that draft in a step are collected first, then the method's [`Proposer`]
//! (`proposer.rs`) drafts for all of them at once (a draft model runs one batch; a failed
//! draft pass is logged, forgets the draft's state and proposes nothing in that step: the
//! target's outputs never depend on drafts).

use std::time::Instant;

use kiln_core::RequestId;
use kiln_sched::{ModelRunnerOutput, Scheduler, SchedulerOutput};

use super::config::{SpecMethod, SpeculativeConfig};
use super::draft::DraftProposer;
use super::proposer::{Proposer, proposer_for};
use super::stats::SpecDecodeStats;
use crate::requests::RequestTable;

/// Draft tokens per back-off window.
const WINDOW_DRAFT_TOKENS: u32 = 32;
/// Acceptance below which a window always counts as a strike.
const MIN_ACCEPTANCE_RATE: f64 = 0.2;
/// What each verified draft row adds to a step's forward time, in plain steps (at batch 1 the
/// weights are read once per step: 6 rows measured 1.22× one row on the default model).
const VERIFY_ROW_COST: f64 = 0.05;
/// Weight of the newest measurement in the cost averages.
const COST_SMOOTHING: f64 = 0.1;
/// Longest pause, in steps.
const MAX_PAUSE_STEPS: u32 = 64;

/// The acceptance rate above which `k` drafts per step pay, when proposing takes
/// `propose_over_verify` times a verification step's forward time (module docs).
pub fn break_even_acceptance(k: usize, propose_over_verify: f64) -> f64 {
    let cost = (1.0 + VERIFY_ROW_COST * k as f64) * (1.0 + propose_over_verify.max(0.0));
    let tokens = |a: f64| (0..=k).map(|i| a.powi(i as i32)).sum::<f64>();
    if tokens(1.0) <= cost {
        return 1.0;
    }
    // `tokens` rises with `a`: bisect for `tokens(a) = cost`.
    let (mut lo, mut hi) = (0.0, 1.0);
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        if tokens(mid) < cost { lo = mid } else { hi = mid }
    }
    hi.max(MIN_ACCEPTANCE_RATE)
}

/// Refuses a token tree that `config`'s method does not draft (only `ngram` does) or that the
/// backend cannot run.
pub fn check_token_tree(
    config: &SpeculativeConfig,
    supports_token_trees: bool,
) -> Result<(), String> {
    if config.token_tree.is_none() {
        return Ok(());
    }
    if matches!(config.method, SpecMethod::DraftModel { .. }) {
        return Err("speculative_token_tree: only method \"ngram\" drafts token trees".into());
    }
    if !supports_token_trees {
        return Err(
            "speculative_token_tree: this backend does not run token trees (the CPU backend does)"
                .into(),
        );
    }
    Ok(())
}

/// [`break_even_acceptance`] for a token tree of `nodes` nodes and `depth` levels: a step
/// verifying them yields `1 + a · nodes` tokens when `a` of the drafted tokens are accepted, and
/// costs `(1 + VERIFY_ROW_COST · nodes) · (1 + propose / verify)` plain steps. The floor is the
/// chain's, scaled to the share of the nodes one path can accept.
pub fn tree_break_even_acceptance(nodes: usize, depth: usize, propose_over_verify: f64) -> f64 {
    let n = nodes.max(1) as f64;
    let cost = (1.0 + VERIFY_ROW_COST * n) * (1.0 + propose_over_verify.max(0.0));
    let floor = MIN_ACCEPTANCE_RATE * depth as f64 / n;
    ((cost - 1.0) / n).max(floor).min(1.0)
}

/// One request's drafting record (kept in its `LiveRequest`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Backoff {
    window_drafted: u32,
    window_accepted: u32,
    strikes: u32,
    /// Steps left without drafting.
    pause: u32,
}

impl Backoff {
    fn observe(&mut self, num_draft: usize, num_accepted: usize, min_rate: f64) {
        self.window_drafted += num_draft as u32;
        self.window_accepted += num_accepted as u32;
        if self.window_drafted < WINDOW_DRAFT_TOKENS {
            return;
        }
        let rate = f64::from(self.window_accepted) / f64::from(self.window_drafted);
        if rate < min_rate {
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

/// Decides which requests draft and how many tokens, has the proposer draft them, and keeps
/// the acceptance counters.
#[derive(Debug)]
pub struct Speculator {
    config: SpeculativeConfig,
    stats: SpecDecodeStats,
    /// Drafts for the method of `config` (`proposer.rs`).
    proposer: Box<dyn Proposer>,
    /// Scratch: the running ids; the requests that draft this round, with their `k`.
    running: Vec<RequestId>,
    wanted: Vec<(RequestId, usize)>,
    /// Moving averages of the proposing time of steps that drafted, and of the forward time of
    /// steps that verified drafts, in seconds (`None` until measured).
    propose_secs: Option<f64>,
    verify_secs: Option<f64>,
}

impl Speculator {
    /// A speculator for `config`; method `draft_model` needs the draft (`draft_model`), a token
    /// tree a backend that runs them (`supports_token_trees`).
    pub fn new(
        config: SpeculativeConfig,
        draft_model: Option<DraftProposer>,
        supports_token_trees: bool,
    ) -> Result<Self, String> {
        check_token_tree(&config, supports_token_trees)?;
        let proposer = proposer_for(&config, draft_model)?;
        Ok(Self {
            config,
            stats: SpecDecodeStats::default(),
            proposer,
            running: Vec::new(),
            wanted: Vec::new(),
            propose_secs: None,
            verify_secs: None,
        })
    }

    /// The draft model, with method `draft_model`.
    pub fn draft_model(&self) -> Option<&DraftProposer> {
        self.proposer.draft_model()
    }

    /// Gives the draft model back (to keep it while speculation is switched off).
    pub fn into_draft_model(self) -> Option<DraftProposer> {
        self.proposer.into_draft_model()
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

    /// The acceptance rate a request's drafts need for drafting to pay, from the costs
    /// measured so far (the floor until both are measured).
    pub fn min_acceptance(&self) -> f64 {
        let ratio = match (self.propose_secs, self.verify_secs) {
            (Some(p), Some(v)) if v > 0.0 => Some(p / v),
            _ => None,
        };
        match (&self.config.token_tree, ratio) {
            (Some(tree), r) => {
                tree_break_even_acceptance(tree.num_nodes(), tree.depth, r.unwrap_or(0.0))
            }
            (None, Some(r)) => break_even_acceptance(self.config.num_speculative_tokens, r),
            (None, None) => MIN_ACCEPTANCE_RATE,
        }
    }

    /// Counts the verifications of a step whose model forward took `forward`: with `k` drafts
    /// scheduled and `g` tokens generated, `g - 1` drafts were accepted. `model_output` is in
    /// `sched_out.scheduled()` order.
    pub(crate) fn record_step(
        &mut self,
        sched_out: &SchedulerOutput,
        model_output: &ModelRunnerOutput,
        forward: std::time::Duration,
        requests: &mut RequestTable,
    ) {
        if sched_out.num_scheduled_spec_tokens == 0 {
            return;
        }
        smooth(&mut self.verify_secs, forward.as_secs_f64());
        let min_rate = self.min_acceptance();
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
            if let Some(live) = requests.get_mut(id) {
                live.spec.backoff.observe(num_draft, num_accepted, min_rate);
            }
        }
    }

    /// Proposes drafts for the next step of every running request that decodes next (a draft
    /// model draws them with a [`crate::Sampler::for_drafting`] copy of the request's sampler). The proposing time of a round counts in the break-even rate only
    /// when the round was a steady one ([`DraftProposer::propose`]): a new request's
    /// whole-prompt catch-up is not what drafting costs per step.
    pub(crate) fn propose(&mut self, scheduler: &mut Scheduler, requests: &mut RequestTable) {
        let start = Instant::now();
        let steady = self.propose_drafts(scheduler, requests);
        let elapsed = start.elapsed();
        self.stats.propose_nanos += u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        if steady {
            smooth(&mut self.propose_secs, elapsed.as_secs_f64());
        }
    }

    /// Proposes, and says whether the round was a steady one (its time counts as the cost).
    fn propose_drafts(&mut self, scheduler: &mut Scheduler, requests: &mut RequestTable) -> bool {
        self.running.clear();
        self.running.extend_from_slice(scheduler.running_ids());
        if self.running.len() >= self.config.disable_by_batch_size {
            return false;
        }
        let max_model_len = scheduler.config().max_model_len;
        self.wanted.clear();
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
            let Some(live) = requests.get_mut(id) else { continue };
            if k > 0 && live.spec.backoff.drafts() {
                self.wanted.push((id, k));
            }
        }
        !self.wanted.is_empty() && self.proposer.propose(scheduler, &self.wanted, requests)
    }
}

/// Folds `sample` into the moving average `avg`.
fn smooth(avg: &mut Option<f64>, sample: f64) {
    *avg = Some(avg.map_or(sample, |a| a + COST_SMOOTHING * (sample - a)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_pauses_after_bad_windows_and_clears_after_a_good_one() {
        let mut b = Backoff::default();
        let min = MIN_ACCEPTANCE_RATE;
        b.observe(32, 2, min); // 6 % accepted
        assert_eq!(b.pause, 2);
        assert!(!b.drafts() && !b.drafts() && b.drafts());
        b.observe(32, 0, min);
        assert_eq!(b.pause, 4);
        for _ in 0..10 {
            b.observe(32, 0, min);
        }
        assert_eq!(b.pause, MAX_PAUSE_STEPS);
        b.pause = 0;
        b.observe(16, 16, min);
        b.observe(16, 0, min); // one window of 32, half accepted
        assert_eq!((b.strikes, b.pause), (0, 0));
        // The same window is a strike when drafting costs enough to need 60 %.
        b.observe(16, 16, 0.6);
        b.observe(16, 0, 0.6);
        assert_eq!((b.strikes, b.pause), (1, 2));
    }

    #[test]
    fn the_break_even_rate_follows_the_measured_cost() {
        // Free proposals (prompt lookup): the floor, which is about the break-even at k = 5.
        assert_eq!(break_even_acceptance(1, 0.0), MIN_ACCEPTANCE_RATE);
        assert_eq!(break_even_acceptance(3, 0.0), MIN_ACCEPTANCE_RATE);
        assert!((break_even_acceptance(5, 0.0) - MIN_ACCEPTANCE_RATE).abs() < 1e-3);
        // A draft model whose 3 passes take 1.19× the verification (the default model's Q4_K_M
        // drafting for its F16 copy): E(a) = 1 + a + a² + a³ must reach 1.15 · 2.19 = 2.52.
        let a = break_even_acceptance(3, 1.19);
        let tokens = 1.0 + a + a * a + a * a * a;
        assert!((tokens - 1.15 * 2.19).abs() < 1e-6 && (0.65..0.75).contains(&a), "{a}");
        // Dearer proposals need more; a cost above k + 1 tokens never pays.
        assert!(break_even_acceptance(3, 2.0) > a);
        assert_eq!(break_even_acceptance(3, 4.0), 1.0);
    }
}
