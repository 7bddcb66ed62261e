//! What the scheduler hands the model runner each step (a diff, as in vLLM v1), what the runner
//! hands back, and what `update` returns for the engine to stream.

use kiln_core::{BlockId, FinishReason, RequestId, SamplingParams, TokenId};

/// A request the runner has no state for yet (first scheduled, or resumed after preemption):
/// sent in full once.
#[derive(Clone, Debug, PartialEq)]
pub struct NewRequestData {
    pub id: RequestId,
    /// Prompt then output tokens (a resumed request recomputes its output too).
    pub token_ids: Vec<TokenId>,
    /// Tokens whose KV is already in `block_table` (a prefix-cache hit, whole blocks).
    pub num_computed_tokens: usize,
    /// Tokens to compute this step: `token_ids[num_computed_tokens..][..num_scheduled_tokens]`.
    pub num_scheduled_tokens: usize,
    /// The whole block table.
    pub block_table: Vec<BlockId>,
    pub sampling_params: SamplingParams,
}

/// A request the runner already holds: only what changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedRequestData {
    pub id: RequestId,
    /// Tokens to compute this step, starting at the runner's `num_computed_tokens` (1 for a
    /// decode, more for a prefill chunk).
    pub num_scheduled_tokens: usize,
    /// Blocks appended to the block table.
    pub new_block_ids: Vec<BlockId>,
}

/// One step's schedule.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SchedulerOutput {
    /// The scheduler step this output belongs to (1-based).
    pub step: u64,
    pub new_requests: Vec<NewRequestData>,
    pub cached_requests: Vec<CachedRequestData>,
    /// Requests that lost their blocks this step: the runner drops their state (they come back
    /// later as new requests).
    pub preempted_ids: Vec<RequestId>,
    /// Requests finished or aborted since the previous output: the runner drops their state.
    pub finished_ids: Vec<RequestId>,
    /// Sum of all `num_scheduled_tokens` (at most `max_num_batched_tokens`).
    pub num_scheduled_tokens: usize,
}

impl SchedulerOutput {
    /// `(id, num_scheduled_tokens)` of every scheduled request, new ones first.
    pub fn scheduled(&self) -> impl Iterator<Item = (RequestId, usize)> + '_ {
        self.new_requests
            .iter()
            .map(|r| (r.id, r.num_scheduled_tokens))
            .chain(self.cached_requests.iter().map(|r| (r.id, r.num_scheduled_tokens)))
    }

    pub fn num_scheduled_requests(&self) -> usize {
        self.new_requests.len() + self.cached_requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.num_scheduled_requests() == 0
    }
}

/// What the runner produced for one step: per scheduled request the sampled token, or `None`
/// for a prefill chunk that did not reach the end of the known tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelRunnerOutput {
    pub sampled: Vec<(RequestId, Option<TokenId>)>,
}

/// One request's news after a step, for the engine to stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestOutput {
    pub id: RequestId,
    pub new_token: TokenId,
    /// `Some` when this token ended the request (its blocks are already freed).
    pub finish_reason: Option<FinishReason>,
}
