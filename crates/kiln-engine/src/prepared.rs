//! A request checked against the model once, before it reaches the engine thread: every token
//! id (prompt, `logit_bias`, `stop_token_ids`) inside the vocabulary, and its structured output
//! compiled into a [`Constraint`]. The engine admits a [`PreparedRequest`] without redoing
//! either; the server prepares on a blocking thread of its own, so a slow grammar never stalls a
//! step.
//!
//! Invariants: a [`PreparedRequest`] holds a constraint exactly when its params carry a
//! structured output, and that constraint is a fresh compile (or an untouched copy of one) of
//! those params' output; its ids are all below the `vocab_size` it records, which the engine
//! compares with its model's (one comparison, not a second scan). The `n` samples of one request
//! share one [`CompiledOutput`]: it is compiled once, each sample starts from its own copy.

use kiln_core::{SamplingParams, StructuredOutput, TokenId};
use kiln_sched::AddError;

use crate::AdapterBinding;
use crate::EngineError;
use crate::PoolingParams;
use crate::structured::{Constraint, GrammarError, PendingCompiler};

/// Why a request could not be prepared. Every variant is the caller's fault except
/// [`PrepareError::Unavailable`] (the model has no grammar compiler).
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// A token id of `what` (`prompt`, `logit_bias`, `stop_token_ids`) outside the vocabulary.
    #[error("{what}: token id {token} is outside the vocabulary (valid ids are 0 to {})", vocab_size.saturating_sub(1))]
    TokenOutOfVocab { what: &'static str, token: u32, vocab_size: usize },
    /// Structured outputs cannot be compiled for this model.
    #[error("structured outputs are not available for this model: {0}")]
    Unavailable(String),
    /// The structured output does not compile.
    #[error("invalid structured output ({kind}): {error}")]
    Grammar { kind: &'static str, error: GrammarError },
    /// The compiled output given is not the one the params ask for (a caller bug).
    #[error("the compiled structured output does not match the request's sampling parameters")]
    OutputMismatch,
    /// Prepared against another vocabulary than the engine's model has.
    #[error(
        "the request was prepared for a vocabulary of {prepared} tokens; the model has {model}"
    )]
    VocabMismatch { prepared: usize, model: usize },
}

impl From<PrepareError> for EngineError {
    fn from(e: PrepareError) -> Self {
        match e {
            PrepareError::TokenOutOfVocab { what, token, vocab_size } => {
                AddError::TokenOutOfVocab { what, token, vocab_size }.into()
            }
            other => AddError::InvalidSampling(other.to_string()).into(),
        }
    }
}

/// A structured output compiled once for all the samples of a request.
#[derive(Clone, Debug)]
pub struct CompiledOutput {
    output: StructuredOutput,
    constraint: Constraint,
}

impl CompiledOutput {
    /// Compiles `output` (waiting for the compiler's background build if it still runs).
    pub fn compile(
        output: &StructuredOutput,
        grammar: Option<&PendingCompiler>,
    ) -> Result<Self, PrepareError> {
        let Some(pending) = grammar else {
            return Err(PrepareError::Unavailable(
                "the engine has no grammar compiler (no tokenizer vocabulary)".into(),
            ));
        };
        let compiler = pending.wait().map_err(|why| PrepareError::Unavailable(why.to_owned()))?;
        let constraint = compiler
            .compile(output)
            .map_err(|error| PrepareError::Grammar { kind: output.kind(), error })?;
        Ok(Self { output: output.clone(), constraint })
    }

    /// The output this was compiled from.
    pub fn output(&self) -> &StructuredOutput {
        &self.output
    }
}

/// A request ready for [`crate::EngineCore::add_prepared`] (or the handle's `submit_prepared`).
#[derive(Debug)]
pub struct PreparedRequest {
    prompt: Vec<TokenId>,
    params: SamplingParams,
    constraint: Option<Constraint>,
    vocab_size: usize,
    /// The LoRA adapter slot it runs with (0: the base model).
    adapter: u32,
    /// The binding of that slot it was resolved against (`None`: whatever the slot holds).
    adapter_key: Option<u64>,
    /// A pooling request's parameters (`None`: a generation request).
    pooling: Option<PoolingParams>,
    /// Pin its prompt's KV for a decode worker when it finishes ([`Self::with_kv_export`]).
    kv_export: bool,
}

impl PreparedRequest {
    /// Checks the ids against a vocabulary of `vocab_size` tokens and compiles the structured
    /// output, if the params ask for one.
    pub fn compile(
        prompt: Vec<TokenId>,
        params: SamplingParams,
        vocab_size: usize,
        grammar: Option<&PendingCompiler>,
    ) -> Result<Self, PrepareError> {
        check_vocab(&prompt, &params, vocab_size)?;
        let constraint = match &params.structured {
            None => None,
            Some(output) => Some(CompiledOutput::compile(output, grammar)?.constraint),
        };
        Ok(Self::unbound(prompt, params, constraint, vocab_size))
    }

    /// Checks the ids and starts from a copy of `compiled`, which must be the compile of the
    /// params' structured output (`None` when they have none).
    pub fn new(
        prompt: Vec<TokenId>,
        params: SamplingParams,
        vocab_size: usize,
        compiled: Option<&CompiledOutput>,
    ) -> Result<Self, PrepareError> {
        check_vocab(&prompt, &params, vocab_size)?;
        let constraint = match (&params.structured, compiled) {
            (None, None) => None,
            (Some(output), Some(compiled)) if *output == compiled.output => {
                Some(compiled.constraint.clone())
            }
            _ => return Err(PrepareError::OutputMismatch),
        };
        Ok(Self::unbound(prompt, params, constraint, vocab_size))
    }

    /// A checked request with its constraint: the base model, a generation request.
    fn unbound(
        prompt: Vec<TokenId>,
        params: SamplingParams,
        constraint: Option<Constraint>,
        vocab_size: usize,
    ) -> Self {
        Self {
            prompt,
            params,
            constraint,
            vocab_size,
            adapter: 0,
            adapter_key: None,
            pooling: None,
            kv_export: false,
        }
    }

    /// Runs it with the LoRA adapter in `slot` (0: none); the engine refuses a slot it has
    /// not bound ([`crate::EngineCore::set_adapter`]).
    #[must_use]
    pub fn with_adapter(mut self, slot: u32) -> Self {
        self.adapter = slot;
        self
    }

    /// Runs it with the adapter `binding` names: the engine refuses it if the slot has been
    /// bound again since (a name resolved just before an unload and a reload of its slot).
    #[must_use]
    pub fn with_adapter_binding(mut self, binding: AdapterBinding) -> Self {
        self.adapter = binding.slot;
        self.adapter_key = (binding.slot != 0).then_some(binding.cache_key);
        self
    }

    /// Its LoRA adapter slot (0: the base model).
    pub fn adapter(&self) -> u32 {
        self.adapter
    }

    /// Makes it a pooling request (an engine of a pooling model takes only these): its
    /// prompt's vector instead of tokens. `params` must ask for one output token.
    #[must_use]
    pub fn with_pooling(mut self, pooling: PoolingParams) -> Self {
        self.pooling = Some(pooling);
        self
    }

    /// Pins its prompt's KV when it finishes, for a decode worker to fetch: its last output
    /// carries the pin ([`crate::EngineOutput::kv_pin`]). The engine refuses it unless
    /// [`crate::EngineCore::enable_kv_export`] was called, and for a LoRA adapter's or a
    /// pooling request.
    #[must_use]
    pub fn with_kv_export(mut self) -> Self {
        self.kv_export = true;
        self
    }

    /// Whether it pins its prompt's KV when it finishes.
    pub fn kv_export(&self) -> bool {
        self.kv_export
    }

    /// A pooling request's parameters (`None`: a generation request).
    pub fn pooling(&self) -> Option<PoolingParams> {
        self.pooling
    }

    /// The binding its slot was resolved against, if given.
    pub fn adapter_key(&self) -> Option<u64> {
        self.adapter_key
    }

    pub fn prompt(&self) -> &[TokenId] {
        &self.prompt
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The vocabulary size the ids were checked against.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub(crate) fn into_parts(self) -> (Vec<TokenId>, SamplingParams, Option<Constraint>, u32) {
        (self.prompt, self.params, self.constraint, self.adapter)
    }
}

/// The first id of the prompt, then of `logit_bias`, then of `stop_token_ids` at or above
/// `vocab_size`.
fn check_vocab(
    prompt: &[TokenId],
    params: &SamplingParams,
    vocab_size: usize,
) -> Result<(), PrepareError> {
    let first_bad = |ids: &mut dyn Iterator<Item = TokenId>| {
        ids.map(|t| t.0).find(|&t| t as usize >= vocab_size)
    };
    let bad = first_bad(&mut prompt.iter().copied())
        .map(|t| ("prompt", t))
        .or_else(|| {
            first_bad(&mut params.logit_bias.iter().map(|b| b.0)).map(|t| ("logit_bias", t))
        })
        .or_else(|| {
            first_bad(&mut params.stop_token_ids.iter().copied()).map(|t| ("stop_token_ids", t))
        });
    match bad {
        Some((what, token)) => Err(PrepareError::TokenOutOfVocab { what, token, vocab_size }),
        None => Ok(()),
    }
}
