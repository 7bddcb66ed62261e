//! The speculator as a step hook: after each step it counts how the step's drafts fared, then
//! has the method's proposer draft the next step's (`spec/`).

use super::{HookContext, StepHook, StepView};
use crate::EngineStats;
use crate::spec::Speculator;

impl StepHook for Speculator {
    fn after_step(&mut self, step: &StepView<'_>, ctx: &mut HookContext<'_>) {
        let forward = step.timing.forward;
        self.record_step(step.sched_out, step.runner_output, forward, ctx.requests);
        self.propose(ctx.scheduler, ctx.requests);
    }

    fn report(&self, stats: &mut EngineStats) {
        stats.spec_decode = *self.stats();
    }
}
