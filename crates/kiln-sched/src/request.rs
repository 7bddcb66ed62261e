//! One request's scheduling state: its tokens (prompt then output), how many of them have KV
//! written (`num_computed_tokens`), the draft tokens proposed for its next step
//! (`spec_token_ids`), and where it is in its life.
//!
//! Invariants (between `update` and `schedule`): `num_computed_tokens <= num_tokens()` (after a
//! rollback of rejected draft tokens too); a request that is not running
//! has `num_computed_tokens == 0`, no draft tokens, and holds no KV blocks (preempted by
//! recompute, a resumed request re-prefills prompt plus output, mostly from the prefix cache;
//! preempted by swap, it holds tier slots instead, [`crate::swap`]).
//! Draft tokens are never part of `all_token_ids()`: only tokens the runner returned from a step
//! are appended, and, while a step is planned ahead of the one in flight, a placeholder for the
//! token that step samples (replaced when it is known).

use std::{fmt, mem};

use kiln_core::{FinishReason, RequestId, SamplingParams, TokenId};

use crate::swap::SwappedKv;

/// Where a request is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    /// Added, never scheduled.
    Waiting,
    /// Holds KV blocks and is scheduled each step while the budget allows.
    Running,
    /// Was running, lost its blocks, waits to be resumed.
    Preempted,
    Finished(FinishReason),
}

/// A request's latency objectives (a service-level objective class resolved to times).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline {
    /// The first token is due by this time (milliseconds on the engine's clock).
    pub first_token_ms: u64,
    /// Target time per output token after the first, in milliseconds (`None`: none).
    pub tpot_ms: Option<u32>,
}

/// A generation request as the scheduler tracks it.
#[derive(Clone, Debug)]
pub struct Request {
    id: RequestId,
    /// `[prompt.., output..]`
    tokens: Vec<TokenId>,
    num_prompt_tokens: usize,
    sampling: SamplingParams,
    /// The model's end-of-sequence ids (ignored with `sampling.ignore_eos`).
    eos_token_ids: Vec<TokenId>,
    /// Lower is more urgent (vLLM's convention); used by the priority policy.
    priority: i64,
    /// The LoRA adapter slot it runs with (0: the base model).
    adapter: u32,
    /// The prefix-cache key of its KV (`KvCacheManager::set_cache_key`; 0: the base model's,
    /// shared). A keyed request hits only its key's blocks and skips the second KV tier.
    cache_key: u64,
    /// Caller-given arrival (a timestamp or counter); `None` = the scheduler's add order.
    arrival: Option<u64>,
    /// Latency objectives (the deadline policy orders by them).
    deadline: Option<Deadline>,
    /// Whether the scheduler pushed the first-token deadline back once it had passed while the
    /// request waited (the deadline policy; at most once per request).
    pub(crate) demoted: bool,
    pub(crate) num_computed_tokens: usize,
    pub(crate) status: RequestStatus,
    /// Known tokens handed out by the last `schedule()` and not yet confirmed by `update()`
    /// (speculative tokens not included).
    pub(crate) num_in_flight_tokens: usize,
    /// Draft tokens handed out by the last `schedule()`, verified by the next `update()`.
    pub(crate) num_in_flight_spec_tokens: usize,
    /// Draft tokens proposed for the next step (vLLM's `spec_token_ids`); only a decoding
    /// running request has them.
    pub(crate) spec_token_ids: Vec<TokenId>,
    /// Empty, or the parent of each draft of a token tree (see
    /// [`crate::CachedRequestData::spec_parents`]).
    pub(crate) spec_parents: Vec<u32>,
    /// Leading tokens the runner was sent (in `NewRequestData` or as `new_token_ids`).
    pub(crate) num_sent_tokens: usize,
    /// The scheduler step at `add` (aging is counted from here).
    pub(crate) added_step: u64,
    /// Position in the FCFS waiting queue (preempted requests get negative, front slots).
    pub(crate) queue_seq: i64,
    pub(crate) num_preemptions: u32,
    /// A request preempted by swap: where its KV waits in the second tier.
    pub(crate) swapped: Option<SwappedKv>,
    /// `tokens` ends with a placeholder for the token the step in flight samples (a step
    /// planned ahead, `Scheduler::schedule_ahead`).
    placeholder: bool,
}

impl Request {
    pub fn new(id: RequestId, prompt: Vec<TokenId>, sampling: SamplingParams) -> Self {
        Self {
            id,
            num_prompt_tokens: prompt.len(),
            tokens: prompt,
            sampling,
            eos_token_ids: Vec::new(),
            priority: 0,
            adapter: 0,
            cache_key: 0,
            arrival: None,
            deadline: None,
            demoted: false,
            num_computed_tokens: 0,
            status: RequestStatus::Waiting,
            num_in_flight_tokens: 0,
            num_in_flight_spec_tokens: 0,
            spec_token_ids: Vec::new(),
            spec_parents: Vec::new(),
            num_sent_tokens: 0,
            added_step: 0,
            queue_seq: 0,
            num_preemptions: 0,
            swapped: None,
            placeholder: false,
        }
    }

    #[must_use]
    pub fn with_priority(mut self, priority: i64) -> Self {
        self.priority = priority;
        self
    }

    /// Runs it with the LoRA adapter in `slot` (0: none), whose KV is cached under
    /// `cache_key` (non-zero, one per binding of an adapter to a slot; with slot 0, 0).
    #[must_use]
    pub fn with_adapter(mut self, slot: u32, cache_key: u64) -> Self {
        self.adapter = slot;
        self.cache_key = cache_key;
        self
    }

    /// The prefix-cache key of its KV (0: shared).
    pub fn cache_key(&self) -> u64 {
        self.cache_key
    }

    /// Its LoRA adapter slot (0: the base model).
    pub fn adapter(&self) -> u32 {
        self.adapter
    }

    /// Arrival for FCFS order and ties; give it for every request or for none.
    #[must_use]
    pub fn with_arrival(mut self, arrival: u64) -> Self {
        self.arrival = Some(arrival);
        self
    }

    /// Latency objectives: a first-token deadline on the engine's clock (the clock handed to
    /// [`crate::Scheduler::set_now_ms`]) and an optional time-per-output-token target.
    #[must_use]
    pub fn with_deadline(mut self, deadline: Deadline) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// As [`Request::with_deadline`] for a request that admission control already demoted (its
    /// deadline pushed back): the scheduler does not demote it again.
    #[must_use]
    pub fn with_demoted_deadline(mut self, deadline: Deadline) -> Self {
        self.deadline = Some(deadline);
        self.demoted = true;
        self
    }

    #[must_use]
    pub fn with_eos_token_ids(mut self, eos_token_ids: Vec<TokenId>) -> Self {
        self.eos_token_ids = eos_token_ids;
        self
    }

    pub fn id(&self) -> RequestId {
        self.id
    }

    pub fn priority(&self) -> i64 {
        self.priority
    }

    /// The request's latency objectives, as given or as pushed back by a demotion.
    pub fn deadline(&self) -> Option<Deadline> {
        self.deadline
    }

    /// Whether the scheduler demoted the request (its first-token deadline passed while it
    /// waited under the deadline policy).
    pub fn is_demoted(&self) -> bool {
        self.demoted
    }

    pub(crate) fn set_first_token_deadline(&mut self, first_token_ms: u64) {
        if let Some(d) = &mut self.deadline {
            d.first_token_ms = first_token_ms;
        }
    }

    /// The arrival used for ordering (set by `Scheduler::add` when the caller gave none).
    pub fn arrival(&self) -> u64 {
        self.arrival.unwrap_or(0)
    }

    pub(crate) fn set_default_arrival(&mut self, arrival: u64) {
        self.arrival.get_or_insert(arrival);
    }

    pub fn sampling_params(&self) -> &SamplingParams {
        &self.sampling
    }

    pub fn status(&self) -> RequestStatus {
        self.status
    }

    /// Prompt then output tokens.
    pub fn all_token_ids(&self) -> &[TokenId] {
        &self.tokens
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    pub fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    /// Tokens whose KV is written (confirmed by `update`).
    pub fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens
    }

    /// Draft tokens waiting to be verified in the next step (not part of `all_token_ids`).
    pub fn spec_token_ids(&self) -> &[TokenId] {
        &self.spec_token_ids
    }

    /// Output tokens still allowed by `max_tokens` and `max_model_len` (at least 1 while the
    /// request is unfinished).
    pub fn num_remaining_tokens(&self, max_model_len: usize) -> usize {
        let by_len = max_model_len.saturating_sub(self.tokens.len());
        self.sampling.max_tokens.saturating_sub(self.num_output_tokens()).min(by_len)
    }

    /// How many times this request lost its blocks.
    pub fn num_preemptions(&self) -> u32 {
        self.num_preemptions
    }

    /// Tokens still to compute before the next sample (`> 1` means a prefill, `1` a decode).
    pub fn num_uncomputed_tokens(&self) -> usize {
        self.tokens.len() - self.num_computed_tokens
    }

    /// Tokens whose KV waits in the second tier (a request preempted by swap; 0 otherwise).
    pub fn num_swapped_tokens(&self) -> usize {
        self.swapped.as_ref().map_or(0, |s| s.num_tokens)
    }

    /// Tokens to prefill before the next sample, not counting those a swap-in restores.
    pub fn num_tokens_to_prefill(&self) -> usize {
        let restored = self.num_swapped_tokens().min(self.tokens.len().saturating_sub(1));
        self.num_uncomputed_tokens() - restored
    }

    /// Estimated remaining work for SJF: tokens to compute now (not those a swap-in restores)
    /// plus outputs still allowed.
    pub fn remaining_work(&self) -> usize {
        self.num_tokens_to_prefill()
            + self.sampling.max_tokens.saturating_sub(self.num_output_tokens())
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }

    /// Whether the last token is a placeholder for a token not sampled yet.
    pub fn has_placeholder(&self) -> bool {
        self.placeholder
    }

    /// Appends a placeholder for the token the step in flight samples.
    pub(crate) fn push_placeholder(&mut self) {
        debug_assert!(!self.placeholder, "{}: a second placeholder", self.id);
        self.tokens.push(crate::PLACEHOLDER_TOKEN);
        self.placeholder = true;
    }

    /// Removes the placeholder, if any; returns whether there was one.
    pub(crate) fn take_placeholder(&mut self) -> bool {
        let had = mem::take(&mut self.placeholder);
        if had {
            self.tokens.pop();
        }
        had
    }

    /// Appends a generated token and reports whether the request is done. A stop token (stop
    /// ids, EOS unless `ignore_eos`) ends it only after `min_tokens` outputs, the same positions
    /// the sampler masks, except under a structured-output constraint: the sampler returns a
    /// masked stop token there only when the grammar allows nothing else (it is complete, or
    /// cannot continue), and `min_tokens` never forces tokens the grammar forbids.
    pub(crate) fn append_output(
        &mut self,
        token: TokenId,
        max_model_len: usize,
    ) -> Option<FinishReason> {
        self.tokens.push(token);
        let past_min = self.num_output_tokens() > self.sampling.min_tokens
            || self.sampling.structured.is_some();
        let stop = past_min
            && (self.sampling.stop_token_ids.contains(&token)
                || (!self.sampling.ignore_eos && self.eos_token_ids.contains(&token)));
        if stop {
            Some(FinishReason::Stop)
        } else if self.num_output_tokens() >= self.sampling.max_tokens
            || self.tokens.len() >= max_model_len
        {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

/// Why `Scheduler::add` refused a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AddError {
    /// The id is already known to the scheduler.
    DuplicateId(RequestId),
    EmptyPrompt(RequestId),
    /// Prompt plus `max_tokens` exceed the model's context.
    TooLong {
        max_model_len: usize,
        num_prompt_tokens: usize,
        max_tokens: usize,
    },
    /// A sampling parameter outside its domain.
    InvalidSampling(String),
    /// A token id (of the prompt, or named by a parameter) outside the vocabulary; the engine
    /// checks this, the scheduler does not know the vocabulary.
    TokenOutOfVocab {
        what: &'static str,
        token: u32,
        vocab_size: usize,
    },
    /// Admission control: the request's first-token deadline cannot be met with the work queued
    /// ahead of it (predicted from the measured step cost); the engine checks this.
    DeadlineUnmeetable {
        /// Predicted time to the first token.
        predicted_ms: u64,
        /// The time the request's class allows.
        ttft_slo_ms: u64,
    },
}

impl fmt::Display for AddError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DuplicateId(id) => write!(f, "request id {id} is already in use"),
            Self::EmptyPrompt(id) => write!(f, "{id}: the prompt must contain at least one token"),
            Self::TooLong { max_model_len, num_prompt_tokens, max_tokens } => write!(
                f,
                "This model's maximum context length is {max_model_len} tokens. However, you \
                 requested {} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the \
                 completion). Please reduce the length of the messages or completion.",
                num_prompt_tokens + max_tokens
            ),
            Self::InvalidSampling(message) => f.write_str(message),
            Self::DeadlineUnmeetable { predicted_ms, ttft_slo_ms } => write!(
                f,
                "the server cannot meet this request's time-to-first-token objective of \
                 {ttft_slo_ms} ms: the work queued ahead of it needs about {predicted_ms} ms. \
                 Retry later."
            ),
            Self::TokenOutOfVocab { what, token, vocab_size } => write!(
                f,
                "{what}: token id {token} is outside the vocabulary (valid ids are 0 to {})",
                vocab_size.saturating_sub(1)
            ),
        }
    }
}

impl std::error::Error for AddError {}
