//! What the scheduler hands the model runner each step (a diff, as in vLLM v1), what the runner
//! hands back, and what `update` returns for the engine to stream.
//!
//! The diff is authoritative: for every scheduled request it states the tokens whose KV is
//! valid (`num_computed_tokens`, after any rollback of rejected speculative tokens) and the
//! tokens appended since the runner last saw the request, so a runner that applies it holds
//! exactly the scheduler's tokens and never predicts what `update` will accept.

use std::ops::Range;

use kiln_core::{BlockId, FinishReason, RequestId, SamplingParams, TokenId};

use crate::swap::BlockCopy;

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
    /// Where the output tokens appended since the runner last saw this request (the tokens
    /// `update` accepted) lie in [`SchedulerOutput::cached_new_token_ids`]; read them with
    /// [`SchedulerOutput::new_token_ids`]. The runner appends them to its copy of the tokens.
    pub new_token_range: Range<usize>,
    /// Tokens whose KV is valid; this step computes from here. Rejected speculative tokens of
    /// the previous step are already rolled back.
    pub num_computed_tokens: usize,
    /// Tokens to compute this step (1 for a decode, more for a prefill chunk), speculative
    /// tokens included: the request's known tokens from `num_computed_tokens` on, then
    /// `spec_token_ids`.
    pub num_scheduled_tokens: usize,
    /// Draft tokens to verify this step (vLLM's `scheduled_spec_decode_tokens`), placed after
    /// the request's last known token; their KV slots are lookahead slots.
    pub spec_token_ids: Vec<TokenId>,
    /// Empty for a chain of drafts; for a token tree, the parent of each draft: an earlier
    /// draft's index, or `u32::MAX` for the request's last known token (the tree's root).
    pub spec_parents: Vec<u32>,
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
    /// The cached requests' new tokens back to back (one buffer per step rather than one per
    /// request).
    pub cached_new_token_ids: Vec<TokenId>,
    /// Requests that lost their blocks this step: the runner drops their state (they come back
    /// later as new requests).
    pub preempted_ids: Vec<RequestId>,
    /// Requests finished or aborted since the previous output: the runner drops their state.
    pub finished_ids: Vec<RequestId>,
    /// Sum of all `num_scheduled_tokens` (at most `max_num_batched_tokens`), speculative tokens
    /// included.
    pub num_scheduled_tokens: usize,
    /// Of those, speculative tokens (the sum of all `spec_token_ids` lengths).
    pub num_scheduled_spec_tokens: usize,
    /// KV blocks to copy into tier slots before this step's forward pass: those of requests
    /// preempted by swap and cached blocks the KV cache evicted (spilled), in the order to copy
    /// them (a slot may be written twice; the later copy wins). The blocks may be handed to
    /// other requests in this very step.
    pub swap_out: Vec<BlockCopy>,
    /// Tier slots to copy into KV blocks before this step's forward pass, **after every copy
    /// of `swap_out`**: resumed requests' blocks and prefix hits in the tier ([`crate::swap`]).
    pub swap_in: Vec<BlockCopy>,
}

impl SchedulerOutput {
    /// `(id, num_scheduled_tokens)` of every scheduled request, new ones first.
    pub fn scheduled(&self) -> impl Iterator<Item = (RequestId, usize)> + '_ {
        self.new_requests
            .iter()
            .map(|r| (r.id, r.num_scheduled_tokens))
            .chain(self.cached_requests.iter().map(|r| (r.id, r.num_scheduled_tokens)))
    }

    /// The tokens appended to `cached` since the runner last saw it (vLLM's
    /// `CachedRequestData.new_token_ids`).
    pub fn new_token_ids(&self, cached: &CachedRequestData) -> &[TokenId] {
        &self.cached_new_token_ids[cached.new_token_range.clone()]
    }

    /// `(id, draft tokens)` of every request with speculative tokens scheduled.
    pub fn scheduled_spec_decode_tokens(&self) -> impl Iterator<Item = (RequestId, &[TokenId])> {
        self.cached_requests
            .iter()
            .filter(|r| !r.spec_token_ids.is_empty())
            .map(|r| (r.id, r.spec_token_ids.as_slice()))
    }

    /// What the step asks of the model, for a step-cost model ([`StepLoad`]).
    pub fn load(&self) -> StepLoad {
        let mut load = StepLoad { num_tokens: self.num_scheduled_tokens, ..StepLoad::default() };
        let new =
            self.new_requests.iter().map(|r| (r.num_computed_tokens, r.num_scheduled_tokens, 0));
        let cached = self
            .cached_requests
            .iter()
            .map(|r| (r.num_computed_tokens, r.num_scheduled_tokens, r.spec_token_ids.len()));
        for (computed, scheduled, spec) in new.chain(cached) {
            let context = (computed + scheduled) as f64;
            load.attention += scheduled as f64 * context;
            if scheduled - spec == 1 {
                load.num_decodes += 1;
                load.decode_context += context;
            } else {
                load.num_prefill_tokens += scheduled;
            }
        }
        load
    }

    pub fn num_scheduled_requests(&self) -> usize {
        self.new_requests.len() + self.cached_requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.num_scheduled_requests() == 0
    }
}

/// The size of one step: what its cost grows with.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepLoad {
    /// Tokens scheduled (prefill chunks, decode tokens and drafts).
    pub num_tokens: usize,
    /// Requests that compute one known token (plus drafts) this step: decodes.
    pub num_decodes: usize,
    /// Sum of the decodes' context lengths (KV positions each reads).
    pub decode_context: f64,
    /// Tokens of prefill chunks.
    pub num_prefill_tokens: usize,
    /// Attention work: for every request, scheduled tokens × its context length at the end of
    /// the step (an upper bound of the KV positions its queries read).
    pub attention: f64,
}

/// What the runner produced for one step: per scheduled request, in
/// [`SchedulerOutput::scheduled`] order, the tokens it generated. None for a prefill chunk that
/// did not reach the end of the known tokens; one for a decode; with `k` speculative tokens
/// scheduled, the accepted draft tokens followed by the one sampled after them (the bonus or
/// corrected token), so `1..=k + 1`.
///
/// Stored flat (one token buffer, one end offset per request) so that a runner reusing one
/// output across steps allocates nothing once warm.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelRunnerOutput {
    req_ids: Vec<RequestId>,
    /// Request `i`'s tokens are `token_ids[ends[i - 1]..ends[i]]` (`0..ends[0]` for the first).
    ends: Vec<usize>,
    token_ids: Vec<TokenId>,
}

impl ModelRunnerOutput {
    /// Empties the output, keeping its buffers.
    pub fn clear(&mut self) {
        self.req_ids.clear();
        self.ends.clear();
        self.token_ids.clear();
    }

    /// Appends request `id`'s generated tokens (possibly none).
    pub fn push(&mut self, id: RequestId, token_ids: &[TokenId]) {
        self.token_ids.extend_from_slice(token_ids);
        self.req_ids.push(id);
        self.ends.push(self.token_ids.len());
    }

    /// Requests reported.
    pub fn len(&self) -> usize {
        self.req_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.req_ids.is_empty()
    }

    /// Tokens generated, all requests together.
    pub fn num_sampled_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// The `i`-th request and its generated tokens.
    pub fn get(&self, i: usize) -> Option<(RequestId, &[TokenId])> {
        let id = *self.req_ids.get(i)?;
        let start = i.checked_sub(1).map_or(0, |p| self.ends[p]);
        Some((id, &self.token_ids[start..self.ends[i]]))
    }

    /// `(id, generated tokens)` per request, in push order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (RequestId, &[TokenId])> + '_ {
        let mut start = 0;
        self.req_ids.iter().zip(&self.ends).map(move |(&id, &end)| {
            let tokens = &self.token_ids[start..end];
            start = end;
            (id, tokens)
        })
    }
}

impl<T: AsRef<[TokenId]>> FromIterator<(RequestId, T)> for ModelRunnerOutput {
    fn from_iter<I: IntoIterator<Item = (RequestId, T)>>(iter: I) -> Self {
        let mut out = Self::default();
        for (id, tokens) in iter {
            out.push(id, tokens.as_ref());
        }
        out
    }
}

/// One accepted token of one request after a step, for the engine to stream. A step that
/// accepts several tokens of a request reports them as consecutive entries, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestOutput {
    pub id: RequestId,
    pub new_token: TokenId,
    /// `Some` when this token ended the request (its blocks are already freed, and any tokens
    /// generated after it in the same step were dropped).
    pub finish_reason: Option<FinishReason>,
}
