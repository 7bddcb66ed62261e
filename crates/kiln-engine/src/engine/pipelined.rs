//! The pipelined executor, asynchronous scheduling (`--async-scheduling`, vLLM's flag): the
//! forward of step N runs on the forward thread ([`crate::forward_thread`]) while the engine
//! thread plans step N+1 with placeholders for N's tokens, then applies and reports step N
//! during N+1's forward.
//!
//! One `step()` call, with step N's forward running (`step_ahead`):
//! 1. plans step N+1 (`Scheduler::schedule_ahead`: N's tokens taken as computed, a placeholder
//!    for each token N samples) and builds its batch (`ModelRunner::prepare_ahead`);
//! 2. waits for N's forward and samples it;
//! 3. launches N+1 with N's tokens in place of the placeholders (`launch_ahead`);
//! 4. applies N's tokens with the stop checks (`Scheduler::confirm`) and reports step N (its
//!    outputs with their log-probabilities, the batch controller, the counters); the caller's
//!    work with them (the server hands them to the clients' streams, where they are
//!    detokenized) overlaps N+1's forward too.
//!
//! Where planning ahead is not safe (`can_plan_ahead`) the call instead waits for N, updates
//! the scheduler, then plans and launches N+1 (`collect`, `launch_next`), and reports N: after
//! a step planned ahead ran short of blocks (planning ahead never preempts; this order can),
//! while an abort waits for the step in flight (an aborted request must not be planned), and
//! with a second KV tier (its copies need the model, which the forward has). Sampling stays on
//! the critical path either way: step N+1's inputs are step N's tokens.
//!
//! Invariants:
//! - **Outputs equal the synchronous engine's, token for token.** Each request's tokens come
//!   from its own inputs and KV, sampled with its own seeded sampler from batch-invariant
//!   logits, in order; only the steps' compositions differ. A request that stops at N had its
//!   row in N+1 computed: its entry is retired at once, so that row is not sampled.
//! - At most one forward is in flight, and the model is never read on the engine thread while
//!   it is. Between `step` calls no request holds a placeholder.
//! - A request aborted while its step is in flight gets no output from then on: its row is
//!   computed but not sampled. It leaves the scheduler when the step ends, after `update` (its
//!   KV then written) or `fail_step` (a failed step's unwritten blocks dropped), so no block is
//!   cached with KV that was never written, and its freed blocks go to a later step only.
//! - The batch controller sees step N after step N+1 is planned, so its limits apply one step
//!   later than in the synchronous engine. A step's time runs from the start of its forward's
//!   critical path (its planning, or with placeholders the end of the sampling of the step
//!   before) to the end of its update, less the caller's time between `step` calls after its
//!   forward had ended. The counters count reported steps (`num_steps` leaves out the one in
//!   flight).
//! - An error starting step N+1 is returned by the next call, after step N's outputs
//!   (`has_unfinished` stays true until then). A failed forward of N with N+1 planned ahead
//!   (or a failure to build N+1's batch) unwinds the plan (`Scheduler::unwind_ahead`: N's
//!   tokens are lost too) and fails both steps, for the caller to abort their requests; the
//!   requests are retired, so one planned again without an abort fails its step. A forward
//!   that panicked or a forward thread that ended fails every later step: the model's state is
//!   unknown.

use std::time::{Duration, Instant};

use kiln_core::RequestId;
use kiln_sched::{RequestOutput, SchedulerOutput};

use super::executor::Executor;
use super::{EngineCore, EngineError, EngineOutput};
use crate::forward_thread::ForwardThread;

/// A step whose forward was launched and not yet collected.
struct InFlightStep {
    sched_out: SchedulerOutput,
    /// When its planning began.
    start: Instant,
    /// Whether a forward runs (a step that scheduled no row has none).
    launched: bool,
}

/// A step collected: its plan, its updates, when it was planned and when it finished (less
/// the time its caller held the engine thread after its forward had ended).
struct DoneStep {
    sched_out: SchedulerOutput,
    updates: Vec<RequestOutput>,
    start: Instant,
    done: Instant,
}

/// The caller's time between two `step` calls: from the return of one to the next call.
type CallerGap = Option<(Instant, Instant)>;

/// Why speculative decoding does not run pipelined.
pub(crate) const NO_SPECULATION: &str = "asynchronous scheduling does not run with speculative \
     decoding (the drafts of a step need the tokens of the step before)";

/// The pipelined executor's state: the forward thread and the step running on it.
pub(crate) struct Pipelined {
    thread: ForwardThread,
    /// The step whose forward is running.
    in_flight: Option<InFlightStep>,
    /// Why the step after the last one reported could not start (the next `step` returns it).
    pending_error: Option<EngineError>,
    /// Requests aborted while a step was in flight: removed from the scheduler once it ends.
    deferred_aborts: Vec<RequestId>,
    /// The forward thread lost the model or panicked: every later step fails with this.
    broken: Option<EngineError>,
    /// When the last `step` returned (the caller's time until the next one is not the
    /// engine's).
    returned_at: Option<Instant>,
}

impl Pipelined {
    /// Starts the forward thread.
    pub(crate) fn spawn() -> std::io::Result<Self> {
        Ok(Self {
            thread: ForwardThread::spawn()?,
            in_flight: None,
            pending_error: None,
            deferred_aborts: Vec::new(),
            broken: None,
            returned_at: None,
        })
    }
}

impl Executor for Pipelined {
    fn step(&mut self, core: &mut EngineCore) -> Result<Vec<EngineOutput>, EngineError> {
        let gap = self.returned_at.take().map(|returned| (returned, Instant::now()));
        if let Some(broken) = &self.broken {
            return Err(EngineError::Broken(Box::new(broken.clone())));
        }
        if let Some(e) = self.pending_error.take() {
            return Err(e);
        }
        let done = match self.take_in_flight(core) {
            Some(step) if self.can_plan_ahead(core, &step) => {
                return self.step_ahead(core, &step, gap);
            }
            Some(step) => Some(self.collect(core, step, gap)?),
            None => None,
        };
        if core.scheduler.has_unfinished()
            && let Err(e) = self.launch_next(core)
        {
            if done.is_none() {
                return Err(e);
            }
            self.pending_error = Some(e);
        }
        let outputs = if let Some(d) = done {
            core.report_step(&d.sched_out, d.updates, d.start, Some(d.done))
        } else {
            core.refresh_stats();
            Vec::new()
        };
        self.returned_at = self.in_flight.is_some().then(Instant::now);
        Ok(outputs)
    }

    fn finish_in_flight(
        &mut self,
        core: &mut EngineCore,
    ) -> Result<Vec<EngineOutput>, EngineError> {
        let gap = self.returned_at.take().map(|returned| (returned, Instant::now()));
        let Some(step) = self.take_in_flight(core) else { return Ok(Vec::new()) };
        let d = self.collect(core, step, gap)?;
        Ok(core.report_step(&d.sched_out, d.updates, d.start, Some(d.done)))
    }

    fn has_pending(&self) -> bool {
        self.in_flight.is_some() || self.pending_error.is_some()
    }

    fn defer_abort(&mut self, id: RequestId) -> bool {
        if self.in_flight.is_none() {
            return false;
        }
        if !self.deferred_aborts.contains(&id) {
            self.deferred_aborts.push(id);
        }
        true
    }

    fn refuses_speculation(&self) -> Option<&'static str> {
        Some(NO_SPECULATION)
    }
}

impl Pipelined {
    /// Takes the step in flight (the engine's counters no longer leave it out).
    fn take_in_flight(&mut self, core: &mut EngineCore) -> Option<InFlightStep> {
        core.step_in_flight = false;
        self.in_flight.take()
    }

    /// Sets the step in flight (left out of the engine's step count until reported).
    fn set_in_flight(&mut self, core: &mut EngineCore, step: InFlightStep) {
        core.step_in_flight = true;
        self.in_flight = Some(step);
    }

    /// Waits for `step`'s forward, samples it, updates the scheduler, then removes the
    /// requests aborted meanwhile (after a failed step too, once `fail_step` dropped the blocks
    /// it never wrote).
    fn collect(
        &mut self,
        core: &mut EngineCore,
        step: InFlightStep,
        gap: CallerGap,
    ) -> Result<DoneStep, EngineError> {
        let (requests, output) = (&mut core.requests, &mut core.runner_output);
        let completed = core.runner.complete(step.launched, requests, &self.thread, output);
        if let Err(e) = completed {
            let err = core.fail_forward(&step.sched_out, &e);
            if core.runner.forward_broken() {
                self.broken = Some(err.clone());
            }
            self.apply_deferred_aborts(core);
            return Err(err);
        }
        let updates = core.scheduler.update(&step.sched_out, &core.runner_output);
        self.apply_deferred_aborts(core);
        core.debug_check_invariants(step.sched_out.step);
        let done = done_at(core, gap);
        let InFlightStep { sched_out, start, .. } = step;
        Ok(DoneStep { sched_out, updates, start, done })
    }

    /// Whether the step after `step` can be planned while `step` computes: `step` runs a
    /// forward, a request is left to plan, no abort waits for it (an aborted request must not
    /// be planned again), no hook needs the model between steps (a second KV tier's copies),
    /// and the last step planned ahead did not run short of blocks (this one is planned after
    /// the update, where preemption can free them).
    fn can_plan_ahead(&self, core: &EngineCore, step: &InFlightStep) -> bool {
        step.launched
            && core.scheduler.has_unfinished()
            && core.hooks.allow_planning_ahead()
            && self.deferred_aborts.is_empty()
            && !core.scheduler.ahead_starved()
    }

    /// One step with the next planned ahead: plans step N+1 while step N computes, then
    /// collects and samples N, launches N+1 with N's tokens in place of its placeholders, and
    /// confirms (the stop checks) and reports N.
    fn step_ahead(
        &mut self,
        core: &mut EngineCore,
        step: &InFlightStep,
        gap: CallerGap,
    ) -> Result<Vec<EngineOutput>, EngineError> {
        let planned_at = Instant::now();
        core.scheduler.set_now_ms(core.now_ms());
        let next = core.scheduler.schedule_ahead(&step.sched_out);
        core.record_first_scheduled(&next, planned_at);
        let prepared = core.runner.prepare_ahead(&next, &mut core.requests);
        let (requests, output) = (&mut core.requests, &mut core.runner_output);
        let completed = core.runner.complete(true, requests, &self.thread, output);
        if let Err(e) = completed.and(prepared) {
            // The caller aborts the requests; each frees the KV really written. They are
            // retired now, so a request planned again without an abort fails its step instead
            // of running on the undone plan.
            core.runner.drop_ahead();
            core.scheduler.unwind_ahead(&step.sched_out, &next);
            for (id, _) in step.sched_out.scheduled().chain(next.scheduled()) {
                retire(core, id);
            }
            let err = EngineError::Forward(e);
            if core.runner.forward_broken() {
                self.broken = Some(err.clone());
            }
            return Err(err);
        }
        // Step N+1's time starts here, where its forward's critical path does.
        let start = Instant::now();
        let (requests, output) = (&mut core.requests, &core.runner_output);
        let launched = core.runner.launch_ahead(output, requests, &self.thread);
        let updates = core.scheduler.confirm(&step.sched_out, &core.runner_output);
        for out in updates.iter().filter(|o| o.finish_reason.is_some()) {
            retire(core, out.id); // its row in step N+1 is computed, not sampled
        }
        core.debug_check_invariants(step.sched_out.step);
        match launched {
            Ok(launched) => {
                core.stats.num_steps_planned_ahead += 1;
                self.set_in_flight(core, InFlightStep { sched_out: next, start, launched });
            }
            Err(e) => {
                // As after a failed forward: N+1's requests are retired.
                for (id, _) in next.scheduled() {
                    retire(core, id);
                }
                self.pending_error = Some(core.fail_forward(&next, &e));
            }
        }
        let done = done_at(core, gap);
        let outputs = core.report_step(&step.sched_out, updates, step.start, Some(done));
        self.returned_at = self.in_flight.is_some().then(Instant::now);
        Ok(outputs)
    }

    fn apply_deferred_aborts(&mut self, core: &mut EngineCore) {
        for id in std::mem::take(&mut self.deferred_aborts) {
            core.abort_in_scheduler(id);
        }
    }

    /// Plans the next step and launches its forward.
    fn launch_next(&mut self, core: &mut EngineCore) -> Result<(), EngineError> {
        let start = Instant::now();
        let sched_out = core.plan_step(start)?;
        match core.runner.launch(&sched_out, &mut core.requests, &self.thread) {
            Ok(launched) => {
                self.set_in_flight(core, InFlightStep { sched_out, start, launched });
                Ok(())
            }
            Err(e) => Err(core.fail_forward(&sched_out, &e)),
        }
    }
}

/// Now, less the caller's time after the collected forward had ended: that time delayed the
/// step; before the forward ended, it was free.
fn done_at(core: &EngineCore, gap: CallerGap) -> Instant {
    let forward_end = core.runner.forward_finished_at();
    let delay = gap.map_or(Duration::ZERO, |(returned, called)| {
        called.saturating_duration_since(forward_end.map_or(returned, |end| end.max(returned)))
    });
    let now = Instant::now();
    now.checked_sub(delay).unwrap_or(now)
}

/// Retires `id`'s entry (`requests.rs`): its row in the step in flight is not sampled.
fn retire(core: &mut EngineCore, id: RequestId) {
    if let Some(live) = core.requests.get_mut(id) {
        live.retire();
    }
}
