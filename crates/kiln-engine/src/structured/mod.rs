//! Structured outputs: a request whose output must match a JSON schema, a regular expression,
//! a list of choices or a grammar ([`StructuredOutput`]) gets, at every sampled position, the
//! logits of each token that would leave that language set to `-inf` (llguidance's Earley
//! parser over a trie of the vocabulary's bytes).
//!
//! - [`GrammarCompiler`]: built once per model from the tokenizer's token bytes; compiles a
//!   [`StructuredOutput`] into a [`Constraint`] (refusing one whose language is empty, which
//!   would mask every token, and one that compiles past [`MAX_GRAMMAR_BYTES`]) and keeps the
//!   most recently used compiled grammars within [`CACHE_BYTES`] (each measured by its lexer
//!   and source, again at every hit as its lexer grows), so a schema sent again (every turn
//!   of an agent, every `n > 1` sample) costs a clone instead of a compilation. Shared (`Arc`) by the server, which compiles once to refuse
//!   a bad grammar with a 400 before queueing, and the engine, which then hits the cache.
//!   A server builds it in the background ([`PendingCompiler`]) so that it starts at once.
//! - [`Constraint`]: one request's parser state; the sampler masks each row with it, or asks
//!   it whether it admits the one token picked without the mask, and hands it each token it
//!   returns.
//!
//! Invariants:
//! - a constraint has consumed exactly the request's output tokens, in order: the sampler
//!   accepts every token it returns and no other. Rejected speculative drafts are never
//!   consumed (verification samples row by row and stops at the first mismatch), so
//!   speculation needs no parser rollback; preemption by recompute keeps the sampler, hence the
//!   state.
//! - a masked logit is `-inf`, so no penalty, temperature or filter can bring it back; token
//!   ids past the tokenizer's vocabulary (padding rows of the LM head) are never allowed; when
//!   the grammar is complete, only end-of-sequence tokens are.
//! - JSON (schemas and `json_object`) may carry whitespace between tokens only as llama.cpp's
//!   JSON grammars allow it (one space, or a newline and up to 20 spaces or tabs) unless the
//!   schema sets llguidance's `x-guidance` options itself, and after
//!   [`MAX_NUMBER_DIGITS`] digits in a row outside strings, tokens that start with a digit are
//!   masked while the grammar allows anything else (and zero-starting ones while it needs a
//!   digit): a model cannot fill `max_tokens` with whitespace or `0.000…` (llguidance alone
//!   allows both, as vLLM does). Both only narrow what the grammar allows;
//! - every token the sampler returns is one the mask allows: [`Constraint::admits`] says yes
//!   only to tokens the mask would allow, and the sampler keeps an unmasked pick only when
//!   that is exact (see `Sampler::pick_allowed`);
//! - compilation is bounded by llguidance's parser limits (grammar size, lexer states, fuel per
//!   mask), so a hostile schema or grammar is an error, not a hang; a constraint computes a
//!   mask at least every [`MASK_AT_LEAST_EVERY`] tokens, which renews the lexer's fuel.

mod compiler;
mod constraint;
pub mod gbnf;
mod pending;
#[cfg(test)]
pub(crate) mod test_vocab;

pub use compiler::{CACHE_BYTES, CompileInfo, GrammarCompiler, GrammarError, MAX_GRAMMAR_BYTES};
pub use constraint::{Constraint, ConstraintStats, MASK_AT_LEAST_EVERY, MAX_NUMBER_DIGITS};
pub use kiln_core::StructuredOutput;
pub use pending::PendingCompiler;
