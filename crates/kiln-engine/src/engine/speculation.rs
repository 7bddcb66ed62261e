//! Speculative decoding's place in the engine: the speculator built at start (with its draft
//! model bound to the target's KV geometry), and switched on or off between runs.

use kiln_models::{Backend, Model};

use super::{EngineConfig, EngineCore, EngineError};
use crate::ModelRunner;
use crate::spec::{SpeculativeConfig, Speculator, bind_draft_model};

impl EngineCore {
    /// Turns speculative decoding on (with `config`) or off between runs: only while no request
    /// is unfinished, so no draft of the old setting is left (benchmarks compare both on the same
    /// weights and threads). The acceptance counters keep counting. A draft model is kept while
    /// speculation is off; a config naming another draft model, or more drafts at once than its
    /// scratch blocks fit, is refused.
    pub fn set_speculative_config(
        &mut self,
        config: Option<SpeculativeConfig>,
    ) -> Result<(), EngineError> {
        if self.has_unfinished() {
            return Err(EngineError::Config(
                "speculative decoding can only be switched while no request runs".into(),
            ));
        }
        if let Some(why) = self.executor().refuses_speculation().filter(|_| config.is_some()) {
            return Err(EngineError::Config(why.into()));
        }
        // Checked before anything changes: a refused config leaves the engine as it was.
        let trees = self.runner.model().supports_token_trees();
        if let Some(c) = &config {
            crate::spec::check_token_tree(c, trees).map_err(EngineError::Config)?;
        }
        if let Some(c) = config.as_ref().filter(|c| c.draft_model_name().is_some()) {
            let held = self.hooks.get::<Speculator>().and_then(Speculator::draft_model);
            let Some(draft) = held.or(self.idle_draft_model.as_ref()) else {
                return Err(EngineError::Config("this engine has no draft model".into()));
            };
            draft.check_serves(c).map_err(EngineError::Config)?;
        }
        let stats = self.hooks.get::<Speculator>().map_or(self.stats.spec_decode, |s| *s.stats());
        if let Some(draft) = self.hooks.take::<Speculator>().and_then(Speculator::into_draft_model)
        {
            self.idle_draft_model = Some(draft);
        }
        let wants_draft = config.as_ref().is_some_and(|c| c.draft_model_name().is_some());
        let draft = if wants_draft { self.idle_draft_model.take() } else { None };
        // No request runs; finished ones awaiting delivery draft no more either.
        self.requests.reset_spec_state();
        if let Some(c) = config.clone() {
            let speculator = Speculator::new(c, draft, trees).map_err(EngineError::Config)?;
            // First: it drafts under the limits the step ran with (`hooks.rs`).
            self.hooks.push_front(speculator.with_stats(stats));
        }
        self.config.speculative = config;
        Ok(())
    }
}

/// The speculator `config.speculative` asks for, with its draft model bound to the target's
/// KV geometry (`None`: speculation off; a draft model without a config is refused).
pub(super) fn speculator_for<B: Backend>(
    config: &EngineConfig,
    runner: &ModelRunner,
    draft_model: Option<Box<dyn Model<B>>>,
) -> Result<Option<Speculator>, EngineError> {
    let draft = match draft_model {
        None => None,
        Some(draft) => Some(
            bind_draft_model(draft, runner.model().config(), config)
                .map_err(EngineError::Config)?,
        ),
    };
    match config.speculative.clone() {
        Some(spec) => {
            let trees = runner.model().supports_token_trees();
            Ok(Some(Speculator::new(spec, draft, trees).map_err(EngineError::Config)?))
        }
        None if draft.is_some() => {
            Err(EngineError::Config("a draft model was given without a speculative config".into()))
        }
        None => Ok(None),
    }
}
