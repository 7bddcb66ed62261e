//! One engine step, phase by phase: plan (schedule, move swapped blocks), execute (the
//! runner's forward and sampling), update (the scheduler applies the tokens and stop checks),
//! report (outputs with their extras, drafts for the next step, the batch controller, the
//! counters). The executor orders them (`executor.rs`): the synchronous one in order, the
//! pipelined one overlapping the report of one step with the forward of the next.

use std::time::{Duration, Instant};

use kiln_models::ForwardError;
use kiln_sched::{Request, RequestOutput, SchedulerOutput};

use super::executor::Executor;
use super::{EngineCore, EngineError, RATE_SMOOTHING};
use crate::{EngineOutput, FirstTokenInfo};

impl EngineCore {
    /// One engine step; returns the sampled tokens in batch order (empty when idle). With
    /// asynchronous scheduling ([`EngineConfig::async_scheduling`]) it returns the tokens of
    /// the step before, whose forward ran meanwhile (`engine/pipelined.rs`).
    pub fn step(&mut self) -> Result<Vec<EngineOutput>, EngineError> {
        self.with_executor(|executor, core| executor.step(core))
    }

    /// Waits for the step in flight, if any, and returns its outputs without starting another
    /// (before the model is read between steps, and at shutdown). A no-op when synchronous.
    pub fn finish_in_flight(&mut self) -> Result<Vec<EngineOutput>, EngineError> {
        self.with_executor(|executor, core| executor.finish_in_flight(core))
    }

    /// Runs `f` with the executor and the engine without it (`engine/executor.rs`).
    fn with_executor<T>(&mut self, f: impl FnOnce(&mut dyn Executor, &mut Self) -> T) -> T {
        let mut executor = self.executor.take().expect("the executor is not re-entered");
        let result = f(&mut *executor, self);
        self.executor = Some(executor);
        result
    }

    /// The executor (between steps).
    pub(super) fn executor(&self) -> &dyn Executor {
        self.executor.as_deref().expect("the executor is not re-entered")
    }

    /// A step's first phase: schedules it and moves its swapped blocks (before the forward
    /// writes anything); its new requests' first-token records start at `start`.
    pub(super) fn plan_step(&mut self, start: Instant) -> Result<SchedulerOutput, EngineError> {
        self.scheduler.set_now_ms(self.now_ms());
        let sched_out = self.scheduler.schedule();
        if let Err(e) = self.move_swapped_blocks(&sched_out) {
            self.scheduler.fail_step(&sched_out);
            return Err(e);
        }
        self.record_first_scheduled(&sched_out, start);
        Ok(sched_out)
    }

    /// Starts the first-token records of `sched_out`'s new requests, scheduled at `at` (not
    /// of those resumed after their first token).
    pub(super) fn record_first_scheduled(&mut self, sched_out: &SchedulerOutput, at: Instant) {
        for new in &sched_out.new_requests {
            let Some(live) = self.requests.get_mut(new.id) else { continue };
            if !live.first_reported {
                live.first.get_or_insert(FirstTokenInfo {
                    scheduled_at: at,
                    num_cached_tokens: new.num_computed_tokens,
                });
            }
        }
    }

    /// Nothing of the step was computed: aborts must not keep its blocks cached.
    pub(super) fn fail_forward(
        &mut self,
        sched_out: &SchedulerOutput,
        e: &ForwardError,
    ) -> EngineError {
        self.scheduler.fail_step(sched_out);
        EngineError::Forward(e.to_string())
    }

    /// A step's last phase, after `update`: its outputs with their extras, drafts for the next
    /// step, the batch controller and the counters. The step took from `start` to `done`
    /// (`None`: now, after this bookkeeping).
    pub(super) fn report_step(
        &mut self,
        sched_out: &SchedulerOutput,
        updates: Vec<RequestOutput>,
        start: Instant,
        done: Option<Instant>,
    ) -> Vec<EngineOutput> {
        let outputs: Vec<EngineOutput> = updates
            .into_iter()
            .map(|out| {
                let live = self.requests.get_mut(out.id);
                let (extras, first) = match live {
                    Some(live) => {
                        live.first_reported = true;
                        (live.extras.pop_front().unwrap_or_default(), live.first.take())
                    }
                    None => Default::default(),
                };
                EngineOutput {
                    id: out.id,
                    new_token: out.new_token,
                    finish_reason: out.finish_reason,
                    logprobs: extras.logprobs,
                    prompt_logprobs: extras.prompt_logprobs,
                    first,
                }
            })
            .collect();
        if let Some(spec) = &mut self.speculator {
            let forward = self.runner.timing().forward;
            spec.record_step(sched_out, &self.runner_output, forward, &mut self.requests);
            spec.propose(&mut self.scheduler, &mut self.requests);
            self.stats.spec_decode = *spec.stats();
        }
        self.stats.step_scheduled_tokens = sched_out.num_scheduled_tokens;
        self.stats.total_sampled_tokens += outputs.len() as u64;
        let step_time = done.unwrap_or_else(Instant::now).saturating_duration_since(start);
        self.control(sched_out, &outputs, step_time);
        self.remove_finished_without_sink(&outputs);
        self.refresh_stats();
        self.stats.step_time = step_time;
        let timing = self.runner.timing();
        self.measure_prefill_rate(sched_out, timing.forward);
        self.stats.total_step_time += step_time;
        self.stats.total_forward_time += timing.forward;
        self.stats.total_sample_time += timing.sample;
        outputs
    }

    /// Finished requests without a sink leave the table now (the caller of `step` takes their
    /// outputs); those with one leave once delivered (`engine/deliver.rs`).
    fn remove_finished_without_sink(&mut self, outputs: &[EngineOutput]) {
        for out in outputs.iter().filter(|o| o.finish_reason.is_some()) {
            if self.requests.get(out.id).is_some_and(|r| r.sink.is_none()) {
                self.requests.remove(out.id);
            }
        }
    }

    /// Debug builds: the scheduler's invariants, which hold between `update` and `schedule`.
    pub(super) fn debug_check_invariants(&self, step: u64) {
        if cfg!(debug_assertions)
            && let Err(e) = self.scheduler.check_invariants()
        {
            panic!("scheduler invariant broken after step {step}: {e}");
        }
    }

    /// Copies the step's blocks out to the tier (preempted requests' and evicted prefix-cache
    /// blocks), then its slots back into blocks (resumed requests' and prefix hits in the tier),
    /// all before the forward pass writes anything, and hands the measured copy rate to the
    /// scheduler's swap-or-recompute rule. A failed copy turns the tier off for good.
    fn move_swapped_blocks(&mut self, sched_out: &SchedulerOutput) -> Result<(), EngineError> {
        let Some(tier) = &mut self.tier else { return Ok(()) };
        let moved = tier
            .swap_out(self.runner.model(), &sched_out.swap_out)
            .and_then(|out| Ok(out.or(tier.swap_in(self.runner.model_mut(), &sched_out.swap_in)?)));
        let rate = match moved {
            Ok(rate) => rate,
            Err(e) => {
                // Nothing in the tier can be trusted now: turn it off and fail this step (the
                // caller aborts its requests); preemption recomputes from here on.
                let unwritten: Vec<_> = sched_out.swap_in.iter().map(|c| c.block).collect();
                self.scheduler.disable_swap_space(&unwritten);
                self.tier = None;
                return Err(EngineError::Forward(format!(
                    "KV tier: {e}; the tier is turned off, preempted requests will be recomputed"
                )));
            }
        };
        if let Some(rate) = rate {
            let smoothed =
                self.tier_bytes_per_sec.map_or(rate, |old| old + RATE_SMOOTHING * (rate - old));
            self.tier_bytes_per_sec = Some(smoothed);
            self.scheduler.set_swap_rates(Some(smoothed), None);
        }
        Ok(())
    }

    /// Folds a step that was mostly prefill into the measured seconds per prefill token, which
    /// the swap-or-recompute rule weighs against the tier's copy rate.
    fn measure_prefill_rate(&mut self, sched_out: &SchedulerOutput, forward: Duration) {
        let load = sched_out.load();
        if self.tier.is_none()
            || load.num_prefill_tokens < 16
            || 2 * load.num_prefill_tokens < load.num_tokens
        {
            return;
        }
        let rate = forward.as_secs_f64() / load.num_tokens as f64;
        let smoothed =
            self.prefill_secs_per_token.map_or(rate, |old| old + RATE_SMOOTHING * (rate - old));
        self.prefill_secs_per_token = Some(smoothed);
        self.scheduler.set_swap_rates(None, Some(smoothed));
    }

    /// Feeds the step to the batch controller and applies the limits it plans.
    fn control(
        &mut self,
        sched_out: &kiln_sched::SchedulerOutput,
        outputs: &[EngineOutput],
        step_time: Duration,
    ) {
        self.observe_latencies(outputs);
        let Some(controller) = &mut self.controller else { return };
        let limits = controller.observe_step(
            &sched_out.load(),
            step_time.as_secs_f64(),
            self.scheduler.num_running(),
            self.scheduler.pending_prefill_tokens(None),
        );
        self.scheduler.set_limits(limits);
    }

    /// Gives the batch controller each first token's TTFT and each finished request's TPOT
    /// (its mean gap after the first token), against their objectives, as of now.
    fn observe_latencies(&mut self, outputs: &[EngineOutput]) {
        let Some(controller) = &mut self.controller else { return };
        let now = Instant::now();
        for out in outputs {
            if out.first.is_some() {
                // A request's first output carries `first`, so its arrival is removed there
                // (aborts remove theirs).
                let live = self.requests.get_mut(out.id);
                if let Some(live) = live.filter(|l| l.arrival.is_some()) {
                    let arrival = live.arrival.take().expect("filtered on its arrival");
                    let objective = arrival.ttft_ms.map(|ms| ms as f64 / 1e3);
                    let ttft = now.saturating_duration_since(arrival.at).as_secs_f64();
                    let at = now.duration_since(self.epoch).as_secs_f64();
                    // A request demoted while it waited (deadline policy) waited behind on-time
                    // work by design: its time says nothing of the prediction.
                    let demoted = self.scheduler.request(out.id).is_some_and(Request::is_demoted);
                    let predicted = arrival.predicted.filter(|_| !demoted);
                    controller.observe_ttft(at, ttft, objective, predicted);
                    if let Some(tpot_ms) = arrival.tpot_ms {
                        live.decoding = Some(Decoding { first: now, tokens: 0, tpot_ms });
                    }
                }
            } else if let Some(decoding) =
                self.requests.get_mut(out.id).and_then(|l| l.decoding.as_mut())
            {
                decoding.tokens += 1;
            }
            if out.finish_reason.is_none() {
                continue;
            }
            controller.observe_departure();
            if let Some(d) = self.requests.get_mut(out.id).and_then(|l| l.decoding.take())
                && d.tokens > 0
            {
                let seconds = now.saturating_duration_since(d.first).as_secs_f64();
                controller.observe_tpot(seconds / d.tokens as f64, Some(d.tpot_ms / 1e3));
            }
        }
    }
}

/// A request waiting for its first token: when it arrived and its objectives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Arrival {
    pub(super) at: Instant,
    /// Its class's TTFT (`None`: the TTFT target).
    pub(super) ttft_ms: Option<u64>,
    /// Its TPOT objective (`None`: none).
    pub(super) tpot_ms: Option<f64>,
    /// Seconds to its first token predicted at admission, before calibration (`None`: none, or
    /// demoted).
    pub(super) predicted: Option<f64>,
}

/// A request past its first token with a TPOT objective.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Decoding {
    first: Instant,
    /// Tokens since the first.
    tokens: usize,
    tpot_ms: f64,
}
