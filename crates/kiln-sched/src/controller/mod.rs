//! Adaptive batch control: the token budget and running cap that hold an inter-token-latency
//! target, planned from a step-cost model fitted online ([`StepCostModel`]).
//!
//! Every running request gets one token per step, so a decoding request's inter-token latency
//! is the step time. With a p95 target `T` and a gain `g` (below), the controller gives each
//! step a time budget `g·T` and spends it:
//!
//! - **Running cap** (planned every [`PLAN_INTERVAL`] steps): the most decodes that fit in
//!   `g·T` together with a prefill reserve `R` — the prompt tokens per step that keep up with
//!   the measured arrival rate (at least [`MIN_PREFILL_RESERVE`], at most half the step) — so
//!   new requests are still admitted when every seat decodes: `cap = (g·T − a − v·R) / u`,
//!   with `a` the step's fixed cost, `u` a decode token's cost at the mean decode context and
//!   `v` a prefill token's cost at the mean prefill context.
//! - **Token budget** (every step): the decodes of the requests running now, plus the prefill
//!   tokens that drain the queued prompts (the backlog) within a quarter of the TTFT target —
//!   at least the reserve, at most what the rest of `g·T` pays for:
//!   `n + clamp(backlog·g·T / (TTFT/4), R, (g·T − a − u·n) / v)`. So steps stay short (decodes
//!   keep a low inter-token latency) while the queue is short, and grow up to the ITL target
//!   as it builds. Without a TTFT target the budget is the whole of `g·T` (prefill as fast as
//!   the ITL target allows); without an ITL target, the drain rate up to the configured
//!   budget.
//!
//! Both are clamped to the configured limits (the profile's or flags), which stay the ceiling.
//! A lower cap preempts nothing; admissions wait for seats.
//!
//! **The gain** closes the loop on what the model gets wrong. It starts at 0.9; after each
//! window of [`GAIN_WINDOW`] decode steps, a measured p95 above `T` multiplies it by 0.93
//! (down to 0.3), a p95 under 0.7·T adds 0.02 (up to 1.0) if the limits held work back since
//! the last change (a full cap with requests waiting, or a full budget with prompts queued),
//! and anything else changes nothing. Each change starts a fresh window, so it is judged only
//! on steps run under it: additive increase, multiplicative decrease, a dead band between, one
//! move per window at most. The cap moves at most ×1.5 (+1) up or ×0.5 down per plan. That is
//! the stability argument; `tests/controller.rs` checks it on a simulated engine (converges
//! under constant load, holds the target through a 4× load step, no sustained oscillation).
//!
//! The cap is changed only when the plan differs from it by more than a tenth (and 2 seats),
//! so noise in the fitted costs does not move it. Without an ITL target the cap stays at its
//! ceiling. The model is fitted either way: admission control predicts first-token times
//! with it.
//!
//! Pure and deterministic: no clocks; the engine hands in step loads and durations.

mod cost_model;

use std::collections::VecDeque;

pub use cost_model::StepCostModel;

use crate::{StepLimits, StepLoad};

/// Steps between two plans of the running cap.
pub const PLAN_INTERVAL: u64 = 8;
/// Decode steps a gain decision looks at.
pub const GAIN_WINDOW: usize = 32;
/// Prefill tokens every step keeps room for, whatever the arrival rate.
pub const MIN_PREFILL_RESERVE: usize = 16;
const INITIAL_GAIN: f64 = 0.9;
const MIN_GAIN: f64 = 0.3;
/// Weight of a new step in the mean-context averages.
const EWMA: f64 = 0.1;
/// Time constant of the arrival-rate estimate, in seconds.
const ARRIVAL_TAU: f64 = 10.0;

/// What the controller aims for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ControllerConfig {
    /// p95 inter-token latency target, in seconds (`None`: the limits stay at the ceiling).
    pub target_itl: Option<f64>,
    /// p95 time-to-first-token target, in seconds: the budget drains queued prompts within a
    /// quarter of it; misses are counted.
    pub target_ttft: Option<f64>,
    /// The configured limits: never exceeded.
    pub ceiling: StepLimits,
}

/// The controller's state for metrics and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ControllerStats {
    /// The limits in force.
    pub limits: StepLimits,
    /// The fraction of the ITL target the plan spends per step.
    pub gain: f64,
    /// Decode steps slower than the ITL target, since start.
    pub itl_misses: u64,
    /// First tokens later than their class's TTFT (or the TTFT target), since start.
    pub ttft_misses: u64,
    /// Plans that changed the running cap or the gain, since start.
    pub num_moves: u64,
}

/// Plans the scheduler's limits from measured steps (module docs).
#[derive(Clone, Debug)]
pub struct BatchController {
    config: ControllerConfig,
    model: StepCostModel,
    /// Durations of recent decode steps, seconds (since the last gain change).
    itl: VecDeque<f64>,
    gain: f64,
    /// Mean context of a decode (EWMA over steps).
    decode_context: f64,
    /// Mean context of a prefill token (attention per prefill token, EWMA over steps).
    prefill_context: f64,
    /// Prompt tokens per second arriving (exponentially decaying estimate).
    arrival_rate: f64,
    last_arrival: Option<f64>,
    /// The cap last planned and the budget last set.
    limits: StepLimits,
    /// Whether the limits held work back since the last gain change (or the start).
    bound: bool,
    steps: u64,
    stats: ControllerStats,
}

impl BatchController {
    pub fn new(config: ControllerConfig) -> Self {
        let limits = config.ceiling;
        Self {
            config,
            model: StepCostModel::default(),
            itl: VecDeque::with_capacity(GAIN_WINDOW),
            gain: INITIAL_GAIN,
            decode_context: 0.0,
            prefill_context: 0.0,
            arrival_rate: 0.0,
            last_arrival: None,
            limits,
            bound: false,
            steps: 0,
            stats: ControllerStats { limits, gain: INITIAL_GAIN, ..ControllerStats::default() },
        }
    }

    pub fn stats(&self) -> ControllerStats {
        ControllerStats { limits: self.limits, gain: self.gain, ..self.stats }
    }

    /// The fitted step-cost model.
    pub fn model(&self) -> &StepCostModel {
        &self.model
    }

    /// A request with `prompt_tokens` arrived at `now` (seconds on the engine's clock).
    pub fn observe_arrival(&mut self, prompt_tokens: usize, now: f64) {
        if let Some(last) = self.last_arrival {
            self.arrival_rate *= (-(now - last).max(0.0) / ARRIVAL_TAU).exp();
        }
        self.arrival_rate += prompt_tokens as f64 / ARRIVAL_TAU;
        self.last_arrival = Some(now);
    }

    /// A request got its first token `seconds` after it arrived; `objective` is its class's
    /// TTFT in seconds (`None`: the TTFT target). Later than that is a miss.
    pub fn observe_ttft(&mut self, seconds: f64, objective: Option<f64>) {
        if objective.or(self.config.target_ttft).is_some_and(|t| seconds > t) {
            self.stats.ttft_misses += 1;
        }
    }

    /// Records a step of `load` that took `seconds`, then plans the limits of the next step for
    /// `num_running` running requests and `backlog` prompt tokens still to prefill; returns
    /// them.
    pub fn observe_step(
        &mut self,
        load: &StepLoad,
        seconds: f64,
        num_running: usize,
        backlog: usize,
    ) -> StepLimits {
        self.model.push(load, seconds);
        self.bound |= backlog > 0
            && (num_running >= self.limits.max_num_seqs
                || load.num_tokens >= self.limits.max_num_batched_tokens);
        if load.num_decodes > 0 {
            let context = load.decode_context / load.num_decodes as f64;
            self.decode_context += EWMA * (context - self.decode_context);
            if self.itl.len() == GAIN_WINDOW {
                self.itl.pop_front();
            }
            self.itl.push_back(seconds);
            if self.config.target_itl.is_some_and(|t| seconds > t) {
                self.stats.itl_misses += 1;
            }
        }
        if load.num_prefill_tokens > 0 {
            let decode_attention = load.decode_context;
            let per_token =
                (load.attention - decode_attention).max(0.0) / load.num_prefill_tokens as f64;
            self.prefill_context += EWMA * (per_token - self.prefill_context);
        }
        self.steps += 1;
        if self.steps.is_multiple_of(PLAN_INTERVAL) {
            self.plan_cap();
        }
        self.limits.max_num_batched_tokens = self.budget_for(num_running, backlog);
        self.limits
    }

    /// The step's time budget `g·T` (`None`: no ITL target), and the model's fixed, decode and
    /// prefill costs.
    fn costs(&self) -> Option<(Option<f64>, f64, f64, f64)> {
        let a = self.model.fixed_seconds()?;
        let u = self.model.seconds_per_token(self.decode_context)?;
        let v = self.model.seconds_per_token(self.prefill_context)?;
        let time = self.config.target_itl.map(|target| self.gain * target);
        Some((time, a, u.max(1e-9), v.max(1e-9)))
    }

    /// Prefill tokens per step that keep up with arrivals, at most half of what a step of
    /// `step_seconds` can prefill (an arrival rate beyond capacity must not take every seat).
    fn prefill_reserve(&self, step_seconds: f64, a: f64, v: f64) -> usize {
        let reserve = (1.25 * self.arrival_rate * step_seconds).ceil();
        let half = ((step_seconds - a) / (2.0 * v)).floor().max(0.0);
        let ceiling = self.config.ceiling.max_num_batched_tokens;
        (reserve.min(half) as usize).clamp(MIN_PREFILL_RESERVE.min(ceiling), ceiling)
    }

    /// Adjusts the gain on the last window of decode steps, then plans the running cap.
    fn plan_cap(&mut self) {
        let ceiling = self.config.ceiling;
        if !self.model.fit() {
            return;
        }
        let Some(target) = self.config.target_itl else {
            self.limits.max_num_seqs = ceiling.max_num_seqs;
            return;
        };
        let old = (self.limits.max_num_seqs, self.gain);
        if self.itl.len() >= GAIN_WINDOW {
            let p95 = percentile(self.itl.make_contiguous(), 0.95);
            if p95 > target {
                self.gain = (self.gain * 0.93).max(MIN_GAIN);
                self.itl.clear();
                self.bound = false;
            } else if p95 < 0.7 * target && self.bound && self.gain < 1.0 {
                self.gain = (self.gain + 0.02).min(1.0);
                self.itl.clear();
                self.bound = false;
            }
        }
        let Some((Some(t), a, u, v)) = self.costs() else { return };
        let reserve = self.prefill_reserve(t, a, v) as f64;
        let seats = ((t - a - v * reserve) / u).floor().max(1.0) as usize;
        let current = self.limits.max_num_seqs;
        let (low, high) = (current.div_ceil(2), current + current / 2 + 1);
        let planned = seats.clamp(low, high).clamp(1, ceiling.max_num_seqs);
        if planned.abs_diff(current) > (current / 10).max(2)
            || (planned == ceiling.max_num_seqs) != (current == ceiling.max_num_seqs)
        {
            self.limits.max_num_seqs = planned;
        }
        if (self.limits.max_num_seqs, self.gain) != old {
            self.stats.num_moves += 1;
        }
    }

    /// The token budget of a step that decodes `num_running` requests with `backlog` prompt
    /// tokens queued.
    fn budget_for(&self, num_running: usize, backlog: usize) -> usize {
        let ceiling = self.config.ceiling.max_num_batched_tokens;
        let Some((time, a, u, v)) = self.costs() else { return ceiling };
        // Prefill tokens the rest of the step's time pays for (all of it without an ITL target).
        let affordable = time
            .map_or(ceiling, |t| ((t - a - u * num_running as f64) / v).floor().max(0.0) as usize);
        let prefill = match self.config.target_ttft {
            Some(ttft) => {
                // Steps in a quarter of the TTFT target, at the step time the plan allows.
                let step = time.unwrap_or_else(|| {
                    self.model.predict(ceiling as f64, 0.0).unwrap_or(1.0).max(1e-3)
                });
                let steps = (ttft / 4.0 / step).max(1.0);
                let drain = (backlog as f64 / steps).ceil() as usize;
                let reserve = time.map_or(MIN_PREFILL_RESERVE, |t| self.prefill_reserve(t, a, v));
                drain.max(reserve).min(affordable)
            }
            None => affordable,
        };
        (num_running + prefill.max(MIN_PREFILL_RESERVE)).clamp(1, ceiling)
    }

    /// Predicted seconds to prefill `tokens` more tokens with the limits in force while
    /// `num_running` requests decode (`None` until the model is fitted). Admission control
    /// compares it with a request's deadline.
    pub fn predict_prefill_seconds(&self, tokens: usize, num_running: usize) -> Option<f64> {
        let n = num_running.min(self.limits.max_num_seqs);
        let budget = self.budget_for(n, tokens).max(n + 1);
        let per_step_prefill = (budget - n).min(tokens.max(1));
        let step = self.model.predict(
            (n + per_step_prefill) as f64,
            self.decode_context * n as f64 + self.prefill_context * per_step_prefill as f64,
        )?;
        let steps = (tokens as f64 / per_step_prefill as f64).ceil().max(1.0);
        Some(steps * step)
    }
}

/// The `q` quantile (nearest rank) of `values` (not empty).
pub fn percentile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}
