//! The proposer interface: how a speculative method drafts. The [`Speculator`] decides which
//! requests draft in a step and how many tokens each may get (back-off, batch size, remaining
//! length); a [`Proposer`] drafts them and hands them to the scheduler.
//!
//! A new method is one file implementing [`Proposer`] plus one arm in [`proposer_for`] (and its
//! name in `SpecMethod`). Prompt lookup is the example (`ngram.rs`):
//!
//! ```text
//! impl Proposer for PromptLookup {
//!     fn propose(&mut self, scheduler: &mut Scheduler, wanted: &[(RequestId, usize)],
//!                _: &mut RequestTable) -> bool {
//!         let mut drafted = false;
//!         for &(id, k) in wanted {
//!             let Some(req) = scheduler.request(id) else { continue };
//!             propose(req.all_token_ids(), self.min, self.max, k, &mut self.draft);
//!             drafted |= !self.draft.is_empty()
//!                 && scheduler.update_draft_token_ids(id, &self.draft);
//!         }
//!         drafted
//!     }
//! }
//! // proposer_for:
//! (&SpecMethod::Ngram { min, max }, None, None) => Box::new(PromptLookup::new(min, max)),
//! ```
//!
//! Invariant: whatever a proposer drafts, the tokens a request yields are those it yields
//! without speculation (the runner verifies every draft with the request's own sampler); a
//! proposer only decides how far a step gets. Per-request state it needs lives in the request's
//! `LiveRequest` (`SpecState`), so it leaves with the request.
//!
//! [`Speculator`]: super::Speculator

use kiln_core::RequestId;
use kiln_sched::Scheduler;

use super::config::{SpecMethod, SpeculativeConfig};
use super::draft::DraftProposer;
use super::ngram::{PromptLookup, PromptLookupTree};
use crate::requests::RequestTable;

/// Drafts tokens for the requests that decode next (module docs).
pub(crate) trait Proposer: Send + std::fmt::Debug {
    /// Proposes up to `k` drafts for each `(id, k)` of `wanted` (running requests whose next
    /// step is a decode), handing them to the scheduler (`update_draft_token_ids`, or
    /// `update_draft_tree` for a token tree). Returns whether the round was a steady one: it
    /// drafted, and its time is what drafting costs per step (the break-even rate counts it).
    fn propose(
        &mut self,
        scheduler: &mut Scheduler,
        wanted: &[(RequestId, usize)],
        requests: &mut RequestTable,
    ) -> bool;

    /// The draft model it runs, if any.
    fn draft_model(&self) -> Option<&DraftProposer> {
        None
    }

    /// Gives its draft model back, if any (kept while speculation is switched off).
    fn into_draft_model(self: Box<Self>) -> Option<DraftProposer> {
        None
    }
}

/// The proposer `config` names, with the draft model its method needs (the registry: one arm
/// per method).
pub(crate) fn proposer_for(
    config: &SpeculativeConfig,
    draft: Option<DraftProposer>,
) -> Result<Box<dyn Proposer>, String> {
    match (&config.method, &config.token_tree, draft) {
        (&SpecMethod::Ngram { min, max }, None, None) => Ok(Box::new(PromptLookup::new(min, max))),
        (&SpecMethod::Ngram { min, max }, Some(tree), None) => {
            Ok(Box::new(PromptLookupTree::new(min, max, tree.clone())))
        }
        (SpecMethod::DraftModel { .. }, None, Some(draft)) => {
            draft.check_serves(config)?;
            Ok(Box::new(draft))
        }
        (SpecMethod::DraftModel { model }, _, None) => {
            Err(format!("the draft model `{model}` was not loaded"))
        }
        (SpecMethod::DraftModel { .. }, Some(_), Some(_)) => {
            Err("speculative_token_tree: only method \"ngram\" drafts token trees".into())
        }
        (SpecMethod::Ngram { .. }, _, Some(_)) => {
            Err("a draft model was given for method \"ngram\"".into())
        }
    }
}
