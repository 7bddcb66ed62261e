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
//! - A request aborted while its step is in flight is freed at once; its row is computed but not
//!   sampled, and `update` skips it (it is unknown by then). Its freed blocks are handed out by a
//!   later `schedule`, whose forward runs after the one in flight.
//! - The batch controller sees step N after step N+1 is planned, so its limits apply one step
//!   later than in the synchronous engine. A step's time runs from its planning to the end of
//!   its update, which includes the reporting of the step before (overlapped with its forward).
//! - An error starting step N+1 is returned by the next call, after step N's outputs.

use std::time::Instant;

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

/// A step collected: its plan, its updates and when it was planned and finished.
struct DoneStep {
    sched_out: SchedulerOutput,
    updates: Vec<RequestOutput>,
    start: Instant,
    done: Instant,
}

impl EngineCore {
    /// [`EngineCore::step`] with asynchronous scheduling (module docs).
    pub(super) fn step_async(&mut self) -> Result<Vec<EngineOutput>, EngineError> {
        if let Some(e) = self.pending_error.take() {
            return Err(e);
        }
        let done = match self.in_flight.take() {
            Some(step) => Some(self.collect(step)?),
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
        Ok(match done {
            Some(d) => self.report_step(&d.sched_out, d.updates, d.start, Some(d.done)),
            None => Vec::new(),
        })
    }

    /// Waits for the step in flight, if any, and returns its outputs without starting another
    /// (before the model is read between steps, and at shutdown). A no-op when synchronous.
    pub fn finish_in_flight(&mut self) -> Result<Vec<EngineOutput>, EngineError> {
        let Some(step) = self.in_flight.take() else { return Ok(Vec::new()) };
        let d = self.collect(step)?;
        Ok(self.report_step(&d.sched_out, d.updates, d.start, Some(d.done)))
    }

    /// Waits for `step`'s forward, samples it and updates the scheduler.
    fn collect(&mut self, step: InFlightStep) -> Result<DoneStep, EngineError> {
        let Some(thread) = &self.forward_thread else {
            unreachable!("a step in flight without a forward thread")
        };
        if let Err(e) = self.runner.complete(step.launched, thread, &mut self.runner_output) {
            return Err(self.fail_forward(&step.sched_out, &e));
        }
        let updates = self.scheduler.update(&step.sched_out, &self.runner_output);
        self.debug_check_invariants(step.sched_out.step);
        let InFlightStep { sched_out, start, .. } = step;
        Ok(DoneStep { sched_out, updates, start, done: Instant::now() })
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
