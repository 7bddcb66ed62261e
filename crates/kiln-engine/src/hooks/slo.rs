//! The SLO batch controller as a step hook: it observes every arrival, first token, finished
//! request and step (load and time), and sets the scheduler's limits for the next step. The
//! admission rule (`engine/admission.rs`) asks it for predicted first-token times.
//!
//! A request's arrival and decoding records live in its `LiveRequest` (kept only with this
//! hook registered).

use std::time::Instant;

use kiln_sched::{BatchController, Request};

use super::{HookContext, StepHook, StepView};
use crate::{EngineOutput, EngineStats};

/// The batch controller (`None` of it: no latency objective configured).
pub(crate) struct SloControl {
    pub(crate) controller: BatchController,
}

/// A request waiting for its first token: when it arrived and its objectives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Arrival {
    pub(crate) at: Instant,
    /// Its class's TTFT (`None`: the TTFT target).
    pub(crate) ttft_ms: Option<u64>,
    /// Its TPOT objective (`None`: none).
    pub(crate) tpot_ms: Option<f64>,
    /// Seconds to its first token predicted at admission, before calibration (`None`: none, or
    /// demoted).
    pub(crate) predicted: Option<f64>,
}

/// A request past its first token with a TPOT objective.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Decoding {
    first: Instant,
    /// Tokens since the first.
    tokens: usize,
    tpot_ms: f64,
}

impl StepHook for SloControl {
    /// Feeds the step to the controller and applies the limits it plans.
    fn after_step(&mut self, step: &StepView<'_>, ctx: &mut HookContext<'_>) {
        self.observe_latencies(step.outputs, ctx);
        let limits = self.controller.observe_step(
            &step.sched_out.load(),
            step.step_time.as_secs_f64(),
            ctx.scheduler.num_running(),
            ctx.scheduler.pending_prefill_tokens(None),
        );
        ctx.scheduler.set_limits(limits);
    }

    fn on_arrival(&mut self, num_prompt_tokens: usize, at_secs: f64) {
        self.controller.observe_arrival(num_prompt_tokens, at_secs);
    }

    fn on_departure(&mut self) {
        self.controller.observe_departure();
    }

    fn report(&self, stats: &mut EngineStats) {
        stats.controller = Some(self.controller.stats());
    }
}

impl SloControl {
    /// Gives the controller each first token's TTFT and each finished request's TPOT (its
    /// mean gap after the first token), against their objectives, as of now.
    fn observe_latencies(&mut self, outputs: &[EngineOutput], ctx: &mut HookContext<'_>) {
        let controller = &mut self.controller;
        let now = Instant::now();
        for out in outputs {
            if out.first.is_some() {
                // A request's first output carries `first`, so its arrival is removed there
                // (aborts remove theirs).
                let live = ctx.requests.get_mut(out.id);
                if let Some(live) = live.filter(|l| l.arrival.is_some()) {
                    let arrival = live.arrival.take().expect("filtered on its arrival");
                    let objective = arrival.ttft_ms.map(|ms| ms as f64 / 1e3);
                    let ttft = now.saturating_duration_since(arrival.at).as_secs_f64();
                    let at = now.duration_since(ctx.epoch).as_secs_f64();
                    // A request demoted while it waited (deadline policy) waited behind on-time
                    // work by design: its time says nothing of the prediction.
                    let demoted = ctx.scheduler.request(out.id).is_some_and(Request::is_demoted);
                    let predicted = arrival.predicted.filter(|_| !demoted);
                    controller.observe_ttft(at, ttft, objective, predicted);
                    if let Some(tpot_ms) = arrival.tpot_ms {
                        live.decoding = Some(Decoding { first: now, tokens: 0, tpot_ms });
                    }
                }
            } else if let Some(decoding) =
                ctx.requests.get_mut(out.id).and_then(|l| l.decoding.as_mut())
            {
                decoding.tokens += 1;
            }
            if out.finish_reason.is_none() {
                continue;
            }
            controller.observe_departure();
            if let Some(d) = ctx.requests.get_mut(out.id).and_then(|l| l.decoding.take())
                && d.tokens > 0
            {
                let seconds = now.saturating_duration_since(d.first).as_secs_f64();
                controller.observe_tpot(seconds / d.tokens as f64, Some(d.tpot_ms / 1e3));
            }
        }
    }
}
