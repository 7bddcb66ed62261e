//! The second KV tier as a step hook: before each forward it copies the step's blocks out to
//! the tier and back (`kv_tier.rs`), and after each step it folds the measured copy and
//! prefill rates into the scheduler's swap-or-recompute rule.
//!
//! Invariants: every copy happens before the forward writes anything; a failed copy turns the
//! tier off for good (nothing in it can be trusted) and fails the step, after which preemption
//! recomputes. While the tier is on, the pipelined executor plans each step after the update
//! of the one before (the copies need the model, which an in-flight forward has).

use std::time::Duration;

use kiln_models::StepModel;
use kiln_sched::{Scheduler, SchedulerOutput};

use super::{HookContext, StepHook, StepView};
use crate::EngineError;
use crate::kv_tier::KvTier;

/// Weight of the newest measurement in the moving averages of rates.
const RATE_SMOOTHING: f64 = 0.2;

/// The tier's storage and the rates measured so far.
pub(crate) struct TierHook {
    /// `None` once a copy failed.
    tier: Option<KvTier>,
    /// Measured seconds per prefill token (moving average; `None` until a prefill step ran).
    prefill_secs_per_token: Option<f64>,
    /// Measured bytes per second of the tier's copies (moving average; `None` until a swap).
    tier_bytes_per_sec: Option<f64>,
}

impl TierHook {
    pub(crate) fn new(tier: KvTier) -> Self {
        Self { tier: Some(tier), prefill_secs_per_token: None, tier_bytes_per_sec: None }
    }

    /// Folds a step that was mostly prefill into the measured seconds per prefill token.
    fn measure_prefill_rate(
        &mut self,
        sched_out: &SchedulerOutput,
        forward: Duration,
        scheduler: &mut Scheduler,
    ) {
        let load = sched_out.load();
        if self.tier.is_none()
            || load.num_prefill_tokens < 16
            || 2 * load.num_prefill_tokens < load.num_tokens
        {
            return;
        }
        let rate = forward.as_secs_f64() / load.num_tokens as f64;
        let smoothed = smooth(self.prefill_secs_per_token, rate);
        self.prefill_secs_per_token = Some(smoothed);
        scheduler.set_swap_rates(None, Some(smoothed));
    }
}

impl StepHook for TierHook {
    /// Copies the step's blocks out to the tier (preempted requests' and evicted prefix-cache
    /// blocks), then its slots back into blocks (resumed requests' and prefix hits in the
    /// tier), and hands the measured copy rate to the scheduler's rule.
    fn before_forward(
        &mut self,
        plan: &SchedulerOutput,
        scheduler: &mut Scheduler,
        model: &mut dyn StepModel,
    ) -> Result<(), EngineError> {
        let Some(tier) = &mut self.tier else { return Ok(()) };
        let moved = tier
            .swap_out(&*model, &plan.swap_out)
            .and_then(|out| Ok(out.or(tier.swap_in(model, &plan.swap_in)?)));
        let rate = match moved {
            Ok(rate) => rate,
            Err(e) => {
                // Nothing in the tier can be trusted now: turn it off and fail this step (the
                // caller aborts its requests); preemption recomputes from here on.
                let unwritten: Vec<_> = plan.swap_in.iter().map(|c| c.block).collect();
                scheduler.disable_swap_space(&unwritten);
                self.tier = None;
                return Err(EngineError::KvTier(std::sync::Arc::new(e)));
            }
        };
        if let Some(rate) = rate {
            let smoothed = smooth(self.tier_bytes_per_sec, rate);
            self.tier_bytes_per_sec = Some(smoothed);
            scheduler.set_swap_rates(Some(smoothed), None);
        }
        Ok(())
    }

    fn after_step(&mut self, step: &StepView<'_>, ctx: &mut HookContext<'_>) {
        self.measure_prefill_rate(step.sched_out, step.timing.forward, ctx.scheduler);
    }

    fn allows_planning_ahead(&self) -> bool {
        self.tier.is_none()
    }
}

/// `old` moved toward `sample` (the first sample when there is none).
fn smooth(old: Option<f64>, sample: f64) -> f64 {
    old.map_or(sample, |old| old + RATE_SMOOTHING * (sample - old))
}
