//! [`EngineOutput`]: one sampled token of one request as the engine reports it, with what the
//! API layer needs besides the token (log-probabilities, prefix-cache hit, scheduling time).

use std::time::Instant;

use kiln_core::{FinishReason, RequestId, TokenId};

use crate::Logprobs;
use crate::runner::PromptLogprobs;

#[derive(Clone, Debug)]
pub struct EngineOutput {
    pub id: RequestId,
    pub new_token: TokenId,
    /// Set on the request's last token.
    pub finish_reason: Option<FinishReason>,
    /// When the params ask for `logprobs`.
    pub logprobs: Option<Logprobs>,
    /// First token only, when the params ask for `prompt_logprobs`.
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// First token only: what happened before it.
    pub first: Option<FirstTokenInfo>,
    /// A pooling request's vector, on its one output (whose token is
    /// [`POOLED_TOKEN`](crate::POOLED_TOKEN), not to be shown).
    pub pooled: Option<Vec<f32>>,
    /// A request made with [`crate::PreparedRequest::with_kv_export`], on its last output: its
    /// prompt's KV pinned for a decode worker.
    pub kv_pin: Option<crate::KvPin>,
}

/// Facts known when a request produces its first token.
#[derive(Clone, Copy, Debug)]
pub struct FirstTokenInfo {
    /// When the scheduler first admitted it (the end of its queue time).
    pub scheduled_at: Instant,
    /// Prompt tokens served from the prefix cache at that admission.
    pub num_cached_tokens: usize,
}
