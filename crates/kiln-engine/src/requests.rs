//! The request table: one [`LiveRequest`] per request the engine knows, holding everything the
//! engine keeps about it — the runner's copy of its tokens and block table, its sampler (with
//! its seeded random stream and structured-output state), its prompt log-probabilities being
//! gathered, the extras of its last step's tokens, its first-token record, its SLO arrival and
//! decoding record, its speculative-decoding state, and the sink its outputs go to.
//!
//! Invariants:
//! - Nothing else in the engine keeps state by request id (the scheduler keeps its own
//!   `Request`s and their KV blocks).
//! - A request leaves in one place: [`EngineCore::abort`](crate::EngineCore::abort) (or a
//!   finished request's delivery) removes its entry, which drops all of it, and frees its KV
//!   blocks in the scheduler at the same time.
//! - An entry outlives preemption: a resumed request keeps its sampler (its random stream and
//!   penalties) and only its batch view is rebuilt from the scheduler's diff.
//! - A *retired* entry (asynchronous scheduling: the request stopped, or its step failed, while
//!   the next step was already built) has no sampler and no batch view: its row in the step in
//!   flight is computed but never sampled, and scheduling it again as a running request fails
//!   that step.

use std::collections::HashMap;
use std::collections::VecDeque;

use kiln_core::RequestId;

use crate::handle::OutputSink;
use crate::hooks::slo::{Arrival, Decoding};
use crate::pooling::PoolState;
use crate::runner::{PromptLogprobs, SampleExtras};
use crate::spec::SpecState;
use crate::structured::Constraint;
use crate::{FirstTokenInfo, Sampler};

/// One scheduled request as the scheduler's diffs describe it (the runner's view).
#[derive(Debug, Default)]
pub(crate) struct BatchView {
    /// Prompt then output tokens, as of the last diff.
    pub(crate) tokens: Vec<u32>,
    pub(crate) block_table: Vec<u32>,
}

/// Prompt log-probabilities being gathered for one request.
#[derive(Debug)]
pub(crate) struct PromptLogprobState {
    pub(crate) prompt: Vec<u32>,
    pub(crate) top_k: usize,
    /// `None` once delivered.
    pub(crate) entries: Option<PromptLogprobs>,
}

/// Everything the engine keeps about one request (module docs).
#[derive(Default)]
pub(crate) struct LiveRequest {
    /// Its tokens and block table as the runner last built them (`None` before it is first
    /// scheduled, while preempted, and once retired).
    pub(crate) view: Option<BatchView>,
    /// Made when it is first scheduled; survives preemption (`None` once retired).
    pub(crate) sampler: Option<Sampler>,
    /// Its structured-output state until its sampler is made (which takes it).
    pub(crate) constraint: Option<Constraint>,
    /// With `prompt_logprobs` in its params: gathered across its prompt's chunks.
    pub(crate) prompt_logprobs: Option<PromptLogprobState>,
    /// The log-probabilities of its tokens of the last step, one entry per generated token in
    /// order (cleared when a step's sampling starts).
    pub(crate) extras: VecDeque<SampleExtras>,
    /// When it was first scheduled, until its first token is reported.
    pub(crate) first: Option<FirstTokenInfo>,
    /// Whether its first token was reported (a resumed request gets no second record).
    pub(crate) first_reported: bool,
    /// When it arrived, with its objectives, until its first token (kept with a batch
    /// controller only).
    pub(crate) arrival: Option<Arrival>,
    /// Past its first token with a TPOT objective (kept with a batch controller only).
    pub(crate) decoding: Option<Decoding>,
    /// Speculative decoding: its back-off and what the draft model's cache holds of it.
    pub(crate) spec: SpecState,
    /// Where its outputs go (`EngineCore::deliver`); `None`: the caller of `step` takes them.
    pub(crate) sink: Option<OutputSink>,
    /// The LoRA adapter slot it runs with (0: the base model alone).
    pub(crate) adapter: u32,
    /// A pooling request's vector being gathered, then finished until reported.
    pub(crate) pool: Option<PoolState>,
    /// Its prompt, kept to pin its KV when it finishes (`kv_handoff`; `None`: no export).
    pub(crate) kv_export: Option<Vec<kiln_core::TokenId>>,
}

impl std::fmt::Debug for LiveRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveRequest")
            .field("view", &self.view)
            .field("sampler", &self.sampler.is_some())
            .field("first_reported", &self.first_reported)
            .field("sink", &self.sink.is_some())
            .finish_non_exhaustive()
    }
}

impl LiveRequest {
    /// Drops its sampler and batch view: its row in a step in flight is not sampled, and it
    /// cannot be scheduled again (module docs). What the report of its last step needs (its
    /// extras, first-token record, sink) stays.
    pub(crate) fn retire(&mut self) {
        self.sampler = None;
        self.view = None;
        self.constraint = None;
        self.prompt_logprobs = None;
    }
}

/// The engine's requests by id (module docs).
#[derive(Debug, Default)]
pub struct RequestTable {
    live: HashMap<RequestId, LiveRequest>,
}

impl RequestTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests held (unfinished, or finished and not yet delivered).
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub fn contains(&self, id: RequestId) -> bool {
        self.live.contains_key(&id)
    }

    /// Adds a request's entry (the caller refused a held `id` before anything changed).
    pub(crate) fn insert(&mut self, id: RequestId, request: LiveRequest) {
        let previous = self.live.insert(id, request);
        debug_assert!(previous.is_none(), "{id} was held already");
    }

    pub(crate) fn get(&self, id: RequestId) -> Option<&LiveRequest> {
        self.live.get(&id)
    }

    pub(crate) fn get_mut(&mut self, id: RequestId) -> Option<&mut LiveRequest> {
        self.live.get_mut(&id)
    }

    /// `id`'s entry, made empty if it has none (a runner driven without an engine).
    pub(crate) fn get_or_default(&mut self, id: RequestId) -> &mut LiveRequest {
        self.live.entry(id).or_default()
    }

    /// Removes `id`'s entry with all of it (the caller frees its KV blocks).
    pub(crate) fn remove(&mut self, id: RequestId) -> Option<LiveRequest> {
        self.live.remove(&id)
    }

    /// Every entry with its id (in no particular order).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (RequestId, &LiveRequest)> {
        self.live.iter().map(|(&id, live)| (id, live))
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut LiveRequest> {
        self.live.values_mut()
    }

    /// Forgets every request's speculative-decoding state (speculation switched).
    pub(crate) fn reset_spec_state(&mut self) {
        for live in self.live.values_mut() {
            live.spec = SpecState::default();
        }
    }

    /// Ids of the requests whose outputs go to a sink.
    pub(crate) fn ids_with_sinks(&self) -> Vec<RequestId> {
        self.live.iter().filter(|(_, r)| r.sink.is_some()).map(|(id, _)| *id).collect()
    }
}
