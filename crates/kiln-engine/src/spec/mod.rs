//! Speculative decoding: propose draft tokens cheaply, verify them in the next step's forward
//! pass, keep the longest verified prefix plus the token sampled after it.
//!
//! - [`SpeculativeConfig`]: `--speculative-config`, vLLM's JSON.
//! - [`ngram::propose`]: prompt-lookup drafting over the prompt and the output so far;
//!   [`ngram::propose_tree`] fills a [`TokenTree`] shape with the ranked candidates of each
//!   node, verified together in one pass (a tree sequence of the batch).
//! - [`DraftProposer`]: a smaller draft model's continuation, drawn with a copy of each
//!   request's sampler (its random numbers included), run over its own paged KV cache that
//!   shares the target's block tables.
//! - [`Speculator`]: after each step, records how the drafts fared and has the method's
//!   proposer (`proposer.rs`: one `Proposer` implementation per method, registered in
//!   `proposer_for`) draft the next ones for every decoding request (through
//!   `Scheduler::update_draft_token_ids`), backing off per request when its drafts are mostly
//!   rejected and for the whole step when the batch is large.
//!
//! Verification is the runner's (`ModelRunner::execute`): the drafts' logit rows are sampled in
//! order with the request's own sampler, exactly as if each token had been decoded alone, and
//! the run stops at the first sampled token that differs from the draft (for a token tree: that
//! no child of the current node holds; the accepted path's K/V then moves to its positions). With bitwise
//! batch-invariant kernels the logits of a draft row equal those of decoding that position
//! alone, so greedy and seeded random requests produce exactly the tokens they produce without
//! speculation, whatever the drafts are: the output distribution is the target's because the
//! tokens are. Drafts only decide how far a step gets. A prompt-lookup draft `x` is accepted
//! with the target's probability `p(x)`; a draft model draws its drafts with the keys the
//! request's sampler will race its tokens with at those positions, so a sampled draft is
//! accepted whenever the draft's race and the target's have the same winner (for nearby
//! distributions, far more often than `p` of the draft's argmax).

mod config;
mod draft;
pub mod ngram;
mod proposer;
mod speculator;
mod stats;
mod tree;

pub use config::{
    DEFAULT_DISABLE_BY_BATCH_SIZE, MAX_PROMPT_LOOKUP, MAX_SPEC_TOKENS, SpecConfigError, SpecMethod,
    SpeculativeConfig,
};
pub use draft::{DraftProposer, bind_draft_model};
pub use speculator::{Speculator, check_token_tree};
pub use stats::SpecDecodeStats;
pub use tree::{MAX_TREE_RANK, TokenTree};

/// What the speculators keep about one request, in its `LiveRequest` (dropped with it).
#[derive(Debug, Default)]
pub(crate) struct SpecState {
    /// Its drafts' acceptance windows and pause.
    pub(crate) backoff: speculator::Backoff,
    /// With a draft model: what the draft's cache holds of it.
    pub(crate) draft: draft::DraftSeq,
}
