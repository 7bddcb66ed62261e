//! Adaptive batch control: the token budget and running cap that hold an inter-token-latency
//! (ITL) or time-per-output-token (TPOT) target, planned from a step-cost model fitted online
//! ([`StepCostModel`]).
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
//! **A TPOT target** (`target_tpot`, vLLM's time per output token: a request's mean gap between
//! tokens after the first) is looser than an ITL target: a step may run longer than `g·T` as
//! long as the steps around it are shorter. The controller plans with `T` the lower of the two
//! targets and keeps a *bank* under a TPOT target: after each step that decoded, the bank gains
//! `g·T − seconds`, clamped to `±BANK_STEPS·T_tpot`, and the next step's prefill spends what is
//! saved on the queued prompts (`g·T + bank` instead of `g·T` in the budget, never more than
//! `g` times the ITL target when there is one). A step that ran over what it was given (the
//! cost model is a fit) leaves a debt that shorter steps pay back. Over any `K` decode steps of
//! a request the step times sum to `K·g·T + bank before − bank after` (outside the clamp), so
//! its TPOT is at most `g·T + 2·BANK_STEPS·T/K` (at 128 output tokens, `g·T` + 6 % of `T`).
//! Queued prompts are thus drained in fewer, longer steps when a burst comes, which a per-step
//! ITL target forbids. The gain is judged on the window's mean (the TPOT of a request
//! that decoded through it) against the TPOT target and on its p95 against the ITL target.
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
//! so noise in the fitted costs does not move it. Without an ITL or TPOT target the cap stays
//! at its ceiling. The model is fitted either way: admission control predicts first-token times
//! with it.
//!
//! **First-token predictions** ([`BatchController::predict_first_token_seconds`]), which
//! admission control compares with a request's deadline: the prefill of the prompt tokens
//! ahead of it and its own at the rate the plan allows, or, when every running seat is taken
//! (by running requests and the waiting ones ahead of it), the wait for enough seats to free
//! at the measured departure rate (finished or aborted requests per second of steps, so idle
//! time does not dilute it) and then its own prefill, whichever is longer.
//!
//! **Admission calibration.** The prediction plans with the running requests of the moment;
//! requests admitted later start decoding, and arrivals of more urgent work go ahead under the
//! deadline policy, so under load first tokens come later than predicted. Each admitted
//! request's observed time to its first token is divided by the time predicted at its
//! admission ([`BatchController::observe_ttft`]); the p95 of the last [`TTFT_WINDOW`] ratios
//! of the last [`CALIBRATION_SECONDS`] (once [`MIN_TTFT_SAMPLES`] are in; clamped to `[1, 4]`)
//! scales the prediction admission control compares with a deadline
//! ([`BatchController::calibrated_first_token_seconds`]). So a request admitted at the margin
//! meets its deadline about 19 times in 20, which aims to keep the p95 of the served requests'
//! TTFT under the target. Ratios of predictions under a tenth of their objective are left out:
//! their queue is short and their ratio mostly the step's noise. So are demoted requests (the
//! engine passes no prediction for them): they wait behind on-time work by design.
//!
//! Stability: refusing more lightens the load, which lowers later ratios and so the factor
//! (negative feedback), and the window moves it one sample at a time. Ratios age out, so a
//! factor raised by a transient (the start-up queue, a burst) falls back to 1 even when it
//! refuses nearly everything that would teach it otherwise. It never goes under 1: that would
//! admit requests that the plan itself predicts late.
//!
//! Pure and deterministic: no clocks; the engine hands in step loads and durations.

mod cost_model;
mod rate;

use std::collections::VecDeque;

pub use cost_model::StepCostModel;
use rate::DecayingRate;

use crate::{StepLimits, StepLoad};

/// Steps between two plans of the running cap.
pub const PLAN_INTERVAL: u64 = 8;
/// Decode steps a gain decision looks at.
pub const GAIN_WINDOW: usize = 32;
/// Prefill tokens every step keeps room for, whatever the arrival rate.
pub const MIN_PREFILL_RESERVE: usize = 16;
const INITIAL_GAIN: f64 = 0.9;
const MIN_GAIN: f64 = 0.3;
/// Under a TPOT target, the most step time saved for later, in multiples of the target.
pub const BANK_STEPS: f64 = 4.0;
/// Weight of a new step in the mean-context averages.
const EWMA: f64 = 0.1;
/// Time constant of the arrival-rate estimate, in seconds.
const ARRIVAL_TAU: f64 = 10.0;
/// First tokens whose observed-to-predicted ratio the admission calibration keeps.
pub const TTFT_WINDOW: usize = 64;
/// Ratios needed before the calibration departs from 1.
pub const MIN_TTFT_SAMPLES: usize = 16;
/// Age after which a ratio no longer counts, seconds.
pub const CALIBRATION_SECONDS: f64 = 30.0;
/// Bounds of the admission calibration factor.
const CALIBRATION_RANGE: (f64, f64) = (1.0, 4.0);
/// Predictions shorter than this share of their objective are not calibrated on.
const MIN_CALIBRATED_SHARE: f64 = 0.1;

/// What is ahead of a request when admission control looks at it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueAhead {
    /// Its own prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served before its own: running prefills and the waiting requests ahead.
    pub tokens_ahead: usize,
    /// Requests running now.
    pub num_running: usize,
    /// Running seats that must free before it gets one: the waiting requests ahead and itself,
    /// less the free seats (0: one is free for it).
    pub seats_needed: usize,
}

/// What the controller aims for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ControllerConfig {
    /// p95 inter-token latency target, in seconds (`None`: the limits stay at the ceiling).
    pub target_itl: Option<f64>,
    /// Target of a request's mean time per output token after the first, in seconds (`None`:
    /// none): steps may run longer than it on time that shorter steps saved (module docs).
    pub target_tpot: Option<f64>,
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
    /// Finished requests whose mean time per output token was over their class's TPOT (or the
    /// TPOT target), since start.
    pub tpot_misses: u64,
    /// Step time saved under a TPOT target for longer steps later, seconds (negative: a debt).
    pub bank: f64,
    /// What admission control multiplies its first-token predictions by: the p95 of recent
    /// observed-to-predicted ratios (1 until enough are in; module docs), as of the latest
    /// arrival or first token (an idle engine's gauge keeps its last value).
    pub ttft_calibration: f64,
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
    /// Step time saved under a TPOT target, seconds (module docs).
    bank: f64,
    /// Mean context of a decode (EWMA over steps).
    decode_context: f64,
    /// Mean context of a prefill token (attention per prefill token, EWMA over steps).
    prefill_context: f64,
    /// Prompt tokens per second arriving (exponentially decaying estimate).
    arrival_rate: DecayingRate,
    /// Seconds of the steps observed so far: the clock of the departure rate, which so stands
    /// still while the engine is idle.
    busy: f64,
    /// Requests leaving their running seats per busy second.
    departure_rate: DecayingRate,
    /// Observed over predicted first-token times of recent admissions (module docs).
    /// `(when, ratio)`, oldest first.
    ttft_ratios: VecDeque<(f64, f64)>,
    /// The calibration factor of `ttft_ratios` and the time until which it holds (when its
    /// oldest ratio ages out), so the per-step stats and each admission do not recompute it.
    calibration: (f64, f64),
    /// The latest time handed in (arrivals, first tokens, departures), seconds.
    clock: f64,
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
            bank: 0.0,
            decode_context: 0.0,
            prefill_context: 0.0,
            arrival_rate: DecayingRate::default(),
            busy: 0.0,
            departure_rate: DecayingRate::default(),
            ttft_ratios: VecDeque::with_capacity(TTFT_WINDOW),
            calibration: (1.0, f64::INFINITY),
            clock: 0.0,
            limits,
            bound: false,
            steps: 0,
            stats: ControllerStats { limits, gain: INITIAL_GAIN, ..ControllerStats::default() },
        }
    }

    pub fn stats(&self) -> ControllerStats {
        ControllerStats {
            limits: self.limits,
            gain: self.gain,
            bank: self.bank,
            ttft_calibration: self.ttft_calibration(self.clock),
            ..self.stats
        }
    }

    /// The fitted step-cost model.
    pub fn model(&self) -> &StepCostModel {
        &self.model
    }

    /// A request with `prompt_tokens` arrived at `now` (seconds on the engine's clock).
    pub fn observe_arrival(&mut self, prompt_tokens: usize, now: f64) {
        self.clock = self.clock.max(now);
        self.arrival_rate.record(prompt_tokens as f64, now, ARRIVAL_TAU);
    }

    /// A request left its running seat (it finished or was aborted) after the steps observed so
    /// far. The rate is kept on the engine's busy time (the sum of its steps), so an idle spell
    /// does not read as seats freeing slowly.
    pub fn observe_departure(&mut self) {
        self.departure_rate.record(1.0, self.busy, ARRIVAL_TAU);
    }

    /// Seconds until `seats` running seats free at the departure rate measured so far,
    /// corrected for the busy time it has covered, so the first departures do not read as a
    /// rate ten times too low (`None`: no departure seen yet).
    fn seat_wait_seconds(&self, seats: usize) -> Option<f64> {
        if seats == 0 {
            return Some(0.0);
        }
        let rate = self.departure_rate.corrected_at(self.busy, ARRIVAL_TAU)?;
        (rate > 0.0).then(|| seats as f64 / rate)
    }

    /// Seconds to the first token of a request behind `queue`, before calibration (module
    /// docs). `None` until the model is fitted, and while it waits for a seat before any
    /// request has left one (the wait cannot be told yet).
    pub fn predict_first_token_seconds(&self, queue: &QueueAhead) -> Option<f64> {
        let running = queue.num_running;
        let behind_tokens =
            self.predict_prefill_seconds(queue.tokens_ahead + queue.prompt_tokens, running)?;
        let wait = self.seat_wait_seconds(queue.seats_needed)?;
        let behind_seats = if wait > 0.0 {
            wait + self.predict_prefill_seconds(queue.prompt_tokens, running)?
        } else {
            0.0
        };
        Some(behind_tokens.max(behind_seats))
    }

    /// A request got its first token at `now` (seconds on the engine's clock), `seconds` after
    /// it arrived; `objective` is its class's TTFT in seconds (`None`: the TTFT target). Later
    /// than that is a miss. `predicted` is what
    /// [`BatchController::predict_first_token_seconds`] said when it was admitted (`None`: no
    /// prediction, or not held to it, e.g. demoted): the admission calibration learns from it
    /// (module docs).
    pub fn observe_ttft(
        &mut self,
        now: f64,
        seconds: f64,
        objective: Option<f64>,
        predicted: Option<f64>,
    ) {
        self.clock = self.clock.max(now);
        let objective = objective.or(self.config.target_ttft);
        if objective.is_some_and(|t| seconds > t) {
            self.stats.ttft_misses += 1;
        }
        let (Some(predicted), Some(objective)) = (predicted, objective) else { return };
        if !(predicted >= MIN_CALIBRATED_SHARE * objective && seconds.is_finite()) {
            return;
        }
        while self.ttft_ratios.len() >= TTFT_WINDOW
            || self.ttft_ratios.front().is_some_and(|&(t, _)| t < now - CALIBRATION_SECONDS)
        {
            self.ttft_ratios.pop_front();
        }
        self.ttft_ratios.push_back((now, seconds / predicted));
        let factor = calibration_of(self.ttft_ratios.iter().map(|&(_, ratio)| ratio));
        let oldest = self.ttft_ratios.front().map_or(now, |&(t, _)| t);
        self.calibration = (factor, oldest + CALIBRATION_SECONDS);
    }

    /// The admission calibration factor at `now` (module docs): the one computed when the last
    /// ratio came in, until its oldest ratio ages out.
    fn ttft_calibration(&self, now: f64) -> f64 {
        let (factor, valid_until) = self.calibration;
        if now <= valid_until {
            return factor;
        }
        let recent = self.ttft_ratios.iter().filter(|&&(t, _)| t >= now - CALIBRATION_SECONDS);
        calibration_of(recent.map(|&(_, ratio)| ratio))
    }

    /// [`BatchController::predict_first_token_seconds`] scaled by the admission calibration at
    /// `now` (seconds on the engine's clock): the first-token time admission control holds
    /// against a deadline (module docs).
    pub fn calibrated_first_token_seconds(&self, queue: &QueueAhead, now: f64) -> Option<f64> {
        Some(self.predict_first_token_seconds(queue)? * self.ttft_calibration(now))
    }

    /// A request finished with a mean of `seconds` per output token after its first;
    /// `objective` is its class's TPOT in seconds (`None`: the TPOT target). Over that is a
    /// miss.
    pub fn observe_tpot(&mut self, seconds: f64, objective: Option<f64>) {
        if objective.or(self.config.target_tpot).is_some_and(|t| seconds > t) {
            self.stats.tpot_misses += 1;
        }
    }

    /// The mean step time the plan holds: the lower of the ITL and TPOT targets.
    fn mean_target(&self) -> Option<f64> {
        match (self.config.target_itl, self.config.target_tpot) {
            (Some(itl), Some(tpot)) => Some(itl.min(tpot)),
            (itl, tpot) => itl.or(tpot),
        }
    }

    /// The longest a step may take when the plan gives it `planned` seconds and `bank` is
    /// saved: their sum, never more than `g` times the ITL target.
    fn step_allowance(&self, planned: f64, bank: f64) -> f64 {
        let banked = planned + bank;
        self.config.target_itl.map_or(banked, |itl| banked.min(self.gain * itl))
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
        if seconds.is_finite() && seconds > 0.0 {
            self.busy += seconds;
        }
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
            if let (Some(tpot), Some((Some(planned), ..))) = (self.config.target_tpot, self.costs())
            {
                let limit = BANK_STEPS * tpot;
                self.bank = (self.bank + planned - seconds).clamp(-limit, limit);
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
        self.limits.max_num_batched_tokens = self.budget_for(num_running, backlog, self.bank);
        self.limits
    }

    /// The step's planned time `g·T` (`None`: no ITL or TPOT target), and the model's fixed,
    /// decode and prefill costs.
    fn costs(&self) -> Option<(Option<f64>, f64, f64, f64)> {
        let a = self.model.fixed_seconds()?;
        let u = self.model.seconds_per_token(self.decode_context)?;
        let v = self.model.seconds_per_token(self.prefill_context)?;
        let time = self.mean_target().map(|target| self.gain * target);
        Some((time, a, u.max(1e-9), v.max(1e-9)))
    }

    /// Prefill tokens per step that keep up with arrivals, at most half of what a step of
    /// `step_seconds` can prefill (an arrival rate beyond capacity must not take every seat).
    fn prefill_reserve(&self, step_seconds: f64, a: f64, v: f64) -> usize {
        let reserve = (1.25 * self.arrival_rate.as_of_last_event() * step_seconds).ceil();
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
        if self.mean_target().is_none() {
            self.limits.max_num_seqs = ceiling.max_num_seqs;
            return;
        }
        let old = (self.limits.max_num_seqs, self.gain);
        if self.itl.len() >= GAIN_WINDOW {
            let window = self.itl.make_contiguous();
            let p95 = percentile(window, 0.95);
            let mean = window.iter().sum::<f64>() / window.len() as f64;
            let (itl, tpot) = (self.config.target_itl, self.config.target_tpot);
            let over = itl.is_some_and(|t| p95 > t) || tpot.is_some_and(|t| mean > t);
            let under = itl.is_none_or(|t| p95 < 0.7 * t) && tpot.is_none_or(|t| mean < 0.7 * t);
            if over {
                self.gain = (self.gain * 0.93).max(MIN_GAIN);
                self.itl.clear();
                self.bound = false;
            } else if under && self.bound && self.gain < 1.0 {
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

    /// Prompt tokens per step that prefill `backlog` tokens within a quarter of the TTFT target
    /// at the step time the plan allows (`None`: no TTFT target).
    fn drain_for(&self, backlog: usize) -> Option<usize> {
        let ttft = self.config.target_ttft?;
        let ceiling = self.config.ceiling.max_num_batched_tokens;
        let step = match self.costs() {
            Some((Some(t), ..)) => t,
            _ => self.model.predict(ceiling as f64, 0.0).unwrap_or(1.0).max(1e-3),
        };
        let steps = (ttft / 4.0 / step).max(1.0);
        Some((backlog as f64 / steps).ceil() as usize)
    }

    /// The token budget of a step that decodes `num_running` requests with `backlog` prompt
    /// tokens queued and may spend `bank` seconds saved.
    fn budget_for(&self, num_running: usize, backlog: usize, bank: f64) -> usize {
        let ceiling = self.config.ceiling.max_num_batched_tokens;
        let Some((time, a, u, v)) = self.costs() else { return ceiling };
        // Prefill tokens the rest of the step's time (with the bank) pays for: all of it
        // without a target.
        let affordable = time.map_or(ceiling, |t| {
            let seconds = self.step_allowance(t, bank) - a - u * num_running as f64;
            (seconds / v).floor().max(0.0) as usize
        });
        let prefill = match self.drain_for(backlog) {
            Some(drain) => {
                let reserve = time.map_or(MIN_PREFILL_RESERVE, |t| self.prefill_reserve(t, a, v));
                // Saved time is there to be spent on the queue: all of it, as far as it pays.
                let banked = if bank > 0.0 { backlog } else { 0 };
                drain.max(reserve).max(banked).min(affordable)
            }
            None => affordable,
        };
        (num_running + prefill.max(MIN_PREFILL_RESERVE)).clamp(1, ceiling)
    }

    /// Predicted seconds to prefill `tokens` more tokens with the limits in force while
    /// `num_running` requests decode (`None` until the model is fitted). Admission control
    /// compares it with a request's deadline. The first step may spend the bank; the later
    /// ones take the rate planned without it (the bank refills only in steps shorter than
    /// planned).
    pub fn predict_prefill_seconds(&self, tokens: usize, num_running: usize) -> Option<f64> {
        let n = num_running.min(self.limits.max_num_seqs);
        let per_step = |backlog: usize, bank: f64| {
            let budget = self.budget_for(n, backlog, bank).max(n + 1);
            (budget - n).min(backlog.max(1))
        };
        let step_seconds = |prefill: usize| {
            let attention = self.decode_context * n as f64 + self.prefill_context * prefill as f64;
            self.model.predict((n + prefill) as f64, attention)
        };
        let first = per_step(tokens, self.bank);
        let mut seconds = step_seconds(first)?;
        let rest = tokens.saturating_sub(first);
        if rest > 0 {
            let prefill = per_step(tokens, 0.0);
            seconds += (rest as f64 / prefill as f64).ceil() * step_seconds(prefill)?;
        }
        Some(seconds)
    }
}

/// The calibration factor of `ratios`: their p95, clamped; 1 with too few of them.
fn calibration_of(ratios: impl Iterator<Item = f64>) -> f64 {
    let ratios: Vec<f64> = ratios.collect();
    if ratios.len() < MIN_TTFT_SAMPLES {
        return 1.0;
    }
    percentile(&ratios, 0.95).clamp(CALIBRATION_RANGE.0, CALIBRATION_RANGE.1)
}

/// The `q` quantile (nearest rank) of `values` (not empty).
pub fn percentile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}
