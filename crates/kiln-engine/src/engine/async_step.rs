//! Asynchronous scheduling (`--async-scheduling`, vLLM's flag): the forward of step N+1 runs on
//! the forward thread ([`crate::forward_thread`]) while the engine thread reports step N and its
//! caller delivers those outputs and takes new commands.
//!
//! One `step()` call:
//! 1. waits for step N's forward, samples it and updates the scheduler (the stop checks);
//! 2. schedules step N+1, moves its swapped blocks, builds its batch and launches its forward;
//! 3. reports step N (its outputs with their log-probabilities, the batch controller, the
//!    counters) and returns its outputs; the caller's work with them (the server hands them to
//!    the clients' streams, where they are detokenized) overlaps step N+1's forward too.
//!
//! What stays on the critical path, and why: sampling needs step N's logits, and step N+1's
//! inputs are step N's sampled tokens; scheduling needs the stop checks (a finished request is
//! not scheduled again, so no step computes a token that is thrown away).
//!
//! Invariants:
//! - **Outputs equal the synchronous engine's, token for token.** The same steps are scheduled
//!   from the same state (scheduling of N+1 still follows the update of N), and each request is
//!   sampled with its own seeded sampler from batch-invariant logits.
//! - At most one forward is in flight, and the model is never read on the engine thread while
//!   it is: the next step is planned (swap copies included) only after the last one came back.
//! - A request aborted while its step is in flight gets no output from then on: its row is
//!   computed but not sampled. It leaves the scheduler when the step ends, after `update` (its
//!   KV then written) or `fail_step` (a failed step's unwritten blocks dropped), so no block is
//!   cached with KV that was never written, and its freed blocks go to a later step only.
//! - The batch controller sees step N after step N+1 is planned, so its limits apply one step
//!   later than in the synchronous engine. A step's time runs from its planning to the end of
//!   its update, which includes the reporting of the step before (overlapped with its forward),
//!   less the caller's time between `step` calls after its forward had ended. The counters
//!   count reported steps (`num_steps` leaves out the one in flight).
//! - An error starting step N+1 is returned by the next call, after step N's outputs
//!   (`has_unfinished` stays true until then). A forward that panicked or a forward thread
//!   that ended fails every later step: the model's state is unknown.

use std::time::{Duration, Instant};

use kiln_sched::{RequestOutput, SchedulerOutput};

use super::{EngineCore, EngineError, EngineOutput};

/// A step whose forward was launched and not yet collected.
pub(crate) struct InFlightStep {
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

impl EngineCore {
    /// [`EngineCore::step`] with asynchronous scheduling (module docs).
    pub(super) fn step_async(&mut self) -> Result<Vec<EngineOutput>, EngineError> {
        let gap = self.returned_at.take().map(|returned| (returned, Instant::now()));
        if let Some(broken) = &self.broken {
            return Err(EngineError::Forward(broken.clone()));
        }
        if let Some(e) = self.pending_error.take() {
            return Err(e);
        }
        let done = match self.in_flight.take() {
            Some(step) => Some(self.collect(step, gap)?),
            None => None,
        };
        if self.scheduler.has_unfinished()
            && let Err(e) = self.launch_next()
        {
            if done.is_none() {
                return Err(e);
            }
            self.pending_error = Some(e);
        }
        let outputs = if let Some(d) = done {
            self.report_step(&d.sched_out, d.updates, d.start, Some(d.done))
        } else {
            self.refresh_stats();
            Vec::new()
        };
        self.returned_at = self.in_flight.is_some().then(Instant::now);
        Ok(outputs)
    }

    /// Waits for the step in flight, if any, and returns its outputs without starting another
    /// (before the model is read between steps, and at shutdown). A no-op when synchronous.
    pub fn finish_in_flight(&mut self) -> Result<Vec<EngineOutput>, EngineError> {
        let gap = self.returned_at.take().map(|returned| (returned, Instant::now()));
        let Some(step) = self.in_flight.take() else { return Ok(Vec::new()) };
        let d = self.collect(step, gap)?;
        Ok(self.report_step(&d.sched_out, d.updates, d.start, Some(d.done)))
    }

    /// Waits for `step`'s forward, samples it, updates the scheduler, then removes the
    /// requests aborted meanwhile (after a failed step too, once `fail_step` dropped the blocks
    /// it never wrote).
    fn collect(&mut self, step: InFlightStep, gap: CallerGap) -> Result<DoneStep, EngineError> {
        let Some(thread) = &self.forward_thread else {
            unreachable!("a step in flight without a forward thread")
        };
        let completed = self.runner.complete(step.launched, thread, &mut self.runner_output);
        if let Err(e) = completed {
            let err = self.fail_forward(&step.sched_out, &e);
            if self.runner.forward_broken() {
                self.broken = Some(err.to_string());
            }
            self.apply_deferred_aborts();
            return Err(err);
        }
        let updates = self.scheduler.update(&step.sched_out, &self.runner_output);
        self.apply_deferred_aborts();
        self.debug_check_invariants(step.sched_out.step);
        // The caller's time after the forward had ended delayed this step; before, it was free.
        let forward_end = self.runner.forward_finished_at();
        let delay = gap.map_or(Duration::ZERO, |(returned, called)| {
            called.saturating_duration_since(forward_end.map_or(returned, |end| end.max(returned)))
        });
        let now = Instant::now();
        let InFlightStep { sched_out, start, .. } = step;
        Ok(DoneStep { sched_out, updates, start, done: now.checked_sub(delay).unwrap_or(now) })
    }

    fn apply_deferred_aborts(&mut self) {
        for id in std::mem::take(&mut self.deferred_aborts) {
            self.abort_in_scheduler(id);
        }
    }

    /// Plans the next step and launches its forward.
    fn launch_next(&mut self) -> Result<(), EngineError> {
        let start = Instant::now();
        let sched_out = self.plan_step(start)?;
        let Some(thread) = &self.forward_thread else {
            unreachable!("an asynchronous step without a forward thread")
        };
        match self.runner.launch(&sched_out, thread) {
            Ok(launched) => {
                self.in_flight = Some(InFlightStep { sched_out, start, launched });
                Ok(())
            }
            Err(e) => Err(self.fail_forward(&sched_out, &e)),
        }
    }
}
