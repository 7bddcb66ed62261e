//! One engine step, phase by phase: plan (schedule; hooks before the forward: the KV tier's
//! copies), execute (the runner's forward and sampling), update (the scheduler applies the
//! tokens and stop checks), report (outputs with their extras; hooks after the step: drafts
//! for the next step, the batch controller, the tier's rates, KV events; the counters). The
//! executor orders them (`executor.rs`): the synchronous one in order, the pipelined one
//! overlapping the report of one step with the forward of the next.

use std::time::Instant;

use kiln_models::ForwardError;
use kiln_sched::{RequestOutput, SchedulerOutput};

use super::executor::Executor;
use super::{EngineCore, EngineError};
use crate::hooks::{HookContext, StepView};
use crate::{EngineOutput, FirstTokenInfo};

impl EngineCore {
    /// One engine step; returns the sampled tokens in batch order (empty when idle). With
    /// asynchronous scheduling ([`crate::EngineConfig::async_scheduling`]) it returns the
    /// tokens of the step before, whose forward ran meanwhile (`engine/pipelined.rs`).
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
        let model = self.runner.model_mut();
        if let Err(e) = self.hooks.before_forward(&sched_out, &mut self.scheduler, model) {
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
        EngineError::Forward(e.clone())
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
        let mut outputs: Vec<EngineOutput> = Vec::with_capacity(updates.len());
        for out in updates {
            let live = self.requests.get_mut(out.id);
            let (extras, first, pooled, export) = match live {
                Some(live) => {
                    live.first_reported = true;
                    let pooled = live.pool.as_mut().and_then(|p| p.output.take());
                    let finished = out.finish_reason.is_some();
                    let export = if finished { live.kv_export.take() } else { None };
                    let extras = live.extras.pop_front().unwrap_or_default();
                    (extras, live.first.take(), pooled, export)
                }
                None => Default::default(),
            };
            // Pinned now, before another step can evict the finished prompt's blocks.
            let kv_pin = export.map(|prompt| self.pin_prompt(&prompt));
            outputs.push(EngineOutput {
                id: out.id,
                new_token: out.new_token,
                finish_reason: out.finish_reason,
                logprobs: extras.logprobs,
                prompt_logprobs: extras.prompt_logprobs,
                first,
                pooled,
                kv_pin,
            });
        }
        self.stats.step_scheduled_tokens = sched_out.num_scheduled_tokens;
        self.stats.total_sampled_tokens += outputs.len() as u64;
        let step_time = done.unwrap_or_else(Instant::now).saturating_duration_since(start);
        let timing = self.runner.timing();
        let view = StepView {
            sched_out,
            runner_output: &self.runner_output,
            outputs: &outputs,
            timing,
            step_time,
        };
        let mut ctx = HookContext {
            scheduler: &mut self.scheduler,
            requests: &mut self.requests,
            epoch: self.epoch,
        };
        self.hooks.after_step(&view, &mut ctx);
        self.remove_finished_without_sink(&outputs);
        self.refresh_stats();
        self.stats.step_time = step_time;
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
}
