//! The executor: how a step's phases are ordered against its model forward. Every step is
//! plan (schedule, swap blocks) → execute (the runner's forward and sampling) → update (the
//! scheduler applies the tokens and stop checks) → report (`step.rs`: outputs, hooks,
//! counters); an [`Executor`] runs them:
//! - [`Synchronous`]: in that order, on the engine thread;
//! - [`Pipelined`] (`pipelined.rs`, `--async-scheduling`): the forward on a second thread, the
//!   next step planned and the step before reported while it runs.
//!
//! The engine holds one, chosen at construction ([`executor_for`]); nothing else in the engine
//! knows which. Invariant: both give every request the same tokens (the asynchronous
//! scheduling tests compare them token for token).

use kiln_core::RequestId;

use super::pipelined::{NO_SPECULATION, Pipelined};
use super::{EngineConfig, EngineCore, EngineError, EngineOutput};

/// Runs the engine's steps (module docs). Its methods get the engine without its executor.
pub(crate) trait Executor: Send {
    /// Runs one step; returns the outputs of the step it reports (the synchronous executor's
    /// own; the pipelined one's step before).
    fn step(&mut self, core: &mut EngineCore) -> Result<Vec<EngineOutput>, EngineError>;

    /// Ends the step in flight, if any, and returns its outputs without starting another.
    fn finish_in_flight(&mut self, core: &mut EngineCore)
    -> Result<Vec<EngineOutput>, EngineError>;

    /// Whether it owes the engine work: a step in flight, or the error of one that could not
    /// start (returned by the next `step`).
    fn has_pending(&self) -> bool;

    /// Takes the abort of a request the scheduler holds: `true` when a step is in flight, and
    /// the request leaves the scheduler once that step ends; `false`: it may leave now.
    fn defer_abort(&mut self, id: RequestId) -> bool;

    /// Why speculative decoding cannot run with this executor (`None`: it can).
    fn refuses_speculation(&self) -> Option<&'static str>;
}

/// The executor `config` asks for: [`Pipelined`] with asynchronous scheduling (refused next to
/// speculative decoding), [`Synchronous`] otherwise.
pub(crate) fn executor_for(
    config: &EngineConfig,
    speculating: bool,
) -> Result<Box<dyn Executor>, EngineError> {
    if !config.async_scheduling {
        return Ok(Box::new(Synchronous));
    }
    if speculating {
        return Err(EngineError::Config(NO_SPECULATION.into()));
    }
    let pipelined = Pipelined::spawn()
        .map_err(|e| EngineError::Config(format!("starting the forward thread: {e}")))?;
    Ok(Box::new(pipelined))
}

/// Runs each step's phases in order on the engine thread.
pub(crate) struct Synchronous;

impl Executor for Synchronous {
    fn step(&mut self, core: &mut EngineCore) -> Result<Vec<EngineOutput>, EngineError> {
        let start = std::time::Instant::now();
        let sched_out = core.plan_step(start)?;
        let (requests, output) = (&mut core.requests, &mut core.runner_output);
        if let Err(e) = core.runner.execute(&sched_out, requests, output) {
            return Err(core.fail_forward(&sched_out, &e));
        }
        let updates = core.scheduler.update(&sched_out, &core.runner_output);
        let outputs = core.report_step(&sched_out, updates, start, None);
        core.debug_check_invariants(sched_out.step);
        Ok(outputs)
    }

    fn finish_in_flight(&mut self, _: &mut EngineCore) -> Result<Vec<EngineOutput>, EngineError> {
        Ok(Vec::new())
    }

    fn has_pending(&self) -> bool {
        false
    }

    fn defer_abort(&mut self, _: RequestId) -> bool {
        false
    }

    fn refuses_speculation(&self) -> Option<&'static str> {
        None
    }
}
