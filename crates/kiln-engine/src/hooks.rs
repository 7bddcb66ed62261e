//! Step hooks: what rides on the engine's steps besides the model. Each is one
//! [`StepHook`] implementation, registered in [`Hooks::for_engine`] (and
//! [`crate::EngineCore::set_kv_event_sink`] for KV events, added at run time):
//! - the speculator (`spec/`, `hooks/speculation.rs`): counts how the step's drafts fared and
//!   proposes the next step's;
//! - the SLO batch controller (`hooks/slo.rs`): observes arrivals, first tokens, finished
//!   requests and each step's load and time, and sets the scheduler's limits;
//! - the second KV tier (`hooks/tier.rs`): moves swapped blocks before the forward, measures
//!   the prefill rate the swap-or-recompute rule weighs;
//! - KV events (`hooks/kv_events.rs`): hands the prefix-cache index changes to their sink.
//!
//! A new hook is one file implementing [`StepHook`] plus one registration line.
//!
//! Invariants: hooks run in registration order (the speculator first: it drafts under the
//! limits the step ran with, before the controller moves them); a hook never changes a
//! request's tokens (drafts are verified, limits only change which requests a step holds, the
//! tier's copies restore KV bit for bit); a hook's per-request state lives in the request's
//! `LiveRequest`.

use std::any::Any;
use std::time::{Duration, Instant};

use kiln_models::StepModel;
use kiln_sched::{ModelRunnerOutput, Scheduler, SchedulerOutput};

use crate::requests::RequestTable;
use crate::{EngineError, EngineOutput, EngineStats, StepTiming};

mod kv_events;
pub(crate) mod slo;
mod speculation;
mod tier;

pub(crate) use kv_events::KvEvents;
pub(crate) use slo::SloControl;
pub(crate) use tier::TierHook;

/// A reported step as hooks see it.
pub(crate) struct StepView<'a> {
    pub(crate) sched_out: &'a SchedulerOutput,
    /// The runner's tokens for each scheduled request (`sched_out.scheduled()` order).
    pub(crate) runner_output: &'a ModelRunnerOutput,
    /// The step's outputs, as its caller gets them.
    pub(crate) outputs: &'a [EngineOutput],
    pub(crate) timing: StepTiming,
    /// Wall time of the whole step.
    pub(crate) step_time: Duration,
}

/// What a hook may act on after a step.
pub(crate) struct HookContext<'a> {
    pub(crate) scheduler: &'a mut Scheduler,
    pub(crate) requests: &'a mut RequestTable,
    /// The engine's clock origin (its deadlines count milliseconds from it).
    pub(crate) epoch: Instant,
}

/// Work that rides on the engine's steps (module docs). Every method has a default that does
/// nothing.
pub(crate) trait StepHook: Any + Send {
    /// Before the step's forward, once it is planned (the model is on the engine thread): may
    /// move KV blocks. An error fails the step (its requests are aborted by the caller).
    fn before_forward(
        &mut self,
        _plan: &SchedulerOutput,
        _scheduler: &mut Scheduler,
        _model: &mut dyn StepModel,
    ) -> Result<(), EngineError> {
        Ok(())
    }

    /// After each reported step, its update applied and its outputs built.
    fn after_step(&mut self, _step: &StepView<'_>, _ctx: &mut HookContext<'_>) {}

    /// A request of `num_prompt_tokens` was queued, `at_secs` on the engine's clock.
    fn on_arrival(&mut self, _num_prompt_tokens: usize, _at_secs: f64) {}

    /// A running request left without finishing (aborted).
    fn on_departure(&mut self) {}

    /// Whether the pipelined executor may plan a step while the one before computes (`false`:
    /// this hook needs the model between steps).
    fn allows_planning_ahead(&self) -> bool {
        true
    }

    /// Writes its counters into the engine's.
    fn report(&self, _stats: &mut EngineStats) {}
}

/// The engine's hooks, in order.
#[derive(Default)]
pub(crate) struct Hooks {
    list: Vec<Box<dyn StepHook>>,
}

impl Hooks {
    /// The registry: the hooks an engine starts with, in the order they run.
    pub(crate) fn for_engine(
        speculator: Option<crate::spec::Speculator>,
        slo: Option<SloControl>,
        tier: Option<TierHook>,
    ) -> Self {
        let mut hooks = Self::default();
        hooks.push(speculator);
        hooks.push(slo);
        hooks.push(tier);
        hooks
    }

    /// Appends `hook`, if any.
    pub(crate) fn push<H: StepHook>(&mut self, hook: Option<H>) {
        if let Some(hook) = hook {
            self.list.push(Box::new(hook));
        }
    }

    /// Puts `hook` first (the speculator, switched at run time).
    pub(crate) fn push_front<H: StepHook>(&mut self, hook: H) {
        self.list.insert(0, Box::new(hook));
    }

    /// The hook of type `H`, if registered.
    pub(crate) fn get<H: StepHook>(&self) -> Option<&H> {
        self.list.iter().find_map(|h| (&**h as &dyn Any).downcast_ref::<H>())
    }

    pub(crate) fn get_mut<H: StepHook>(&mut self) -> Option<&mut H> {
        self.list.iter_mut().find_map(|h| (&mut **h as &mut dyn Any).downcast_mut::<H>())
    }

    /// Removes the hook of type `H` and returns it.
    pub(crate) fn take<H: StepHook>(&mut self) -> Option<H> {
        let index = self.list.iter().position(|h| (&**h as &dyn Any).is::<H>())?;
        let hook: Box<dyn Any> = self.list.remove(index);
        hook.downcast::<H>().ok().map(|h| *h)
    }

    pub(crate) fn before_forward(
        &mut self,
        plan: &SchedulerOutput,
        scheduler: &mut Scheduler,
        model: &mut dyn StepModel,
    ) -> Result<(), EngineError> {
        self.list.iter_mut().try_for_each(|h| h.before_forward(plan, scheduler, model))
    }

    pub(crate) fn after_step(&mut self, step: &StepView<'_>, ctx: &mut HookContext<'_>) {
        for hook in &mut self.list {
            hook.after_step(step, ctx);
        }
    }

    pub(crate) fn on_arrival(&mut self, num_prompt_tokens: usize, at_secs: f64) {
        for hook in &mut self.list {
            hook.on_arrival(num_prompt_tokens, at_secs);
        }
    }

    pub(crate) fn on_departure(&mut self) {
        for hook in &mut self.list {
            hook.on_departure();
        }
    }

    pub(crate) fn allow_planning_ahead(&self) -> bool {
        self.list.iter().all(|h| h.allows_planning_ahead())
    }

    pub(crate) fn report(&self, stats: &mut EngineStats) {
        for hook in &self.list {
            hook.report(stats);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Counting(u32);
    impl StepHook for Counting {
        fn on_departure(&mut self) {
            self.0 += 1;
        }
    }

    struct NeedsModel;
    impl StepHook for NeedsModel {
        fn allows_planning_ahead(&self) -> bool {
            false
        }
    }

    #[test]
    fn hooks_are_found_by_type_taken_whole_and_all_see_each_event() {
        let mut hooks = Hooks::default();
        hooks.push(Some(Counting(0)));
        hooks.push(None::<NeedsModel>);
        assert!(hooks.allow_planning_ahead());
        hooks.push_front(NeedsModel);
        assert!(!hooks.allow_planning_ahead());
        hooks.on_departure();
        hooks.on_departure();
        assert_eq!(hooks.get::<Counting>().map(|c| c.0), Some(2));
        assert!(hooks.take::<NeedsModel>().is_some());
        assert!(hooks.get::<NeedsModel>().is_none());
        assert!(hooks.allow_planning_ahead());
        hooks.get_mut::<Counting>().unwrap().0 = 7;
        assert_eq!(hooks.take::<Counting>().map(|c| c.0), Some(7));
        assert!(hooks.list.is_empty());
    }
}
