//! The draft-model proposer: a smaller model with the target's vocabulary proposes a
//! continuation of each decoding request, run by the same engine over its own paged KV cache.
//!
//! **Drafts are drawn as the request samples.** Each drafting request's drafts come from a copy
//! of its own sampler ([`crate::Sampler::for_drafting`]): the same penalties, bias, temperature
//! and filters, and the same random numbers the target's sampler will draw at those positions.
//! Greedy requests get the draft's argmax (after penalties and bias); a sampled request's draft
//! `i` is the draw the target's sampler would make from the draft's distribution (the same
//! keyed race), so it is accepted whenever the two races have the same winner: at least
//! `(1 - d) / (1 + d)` of the time for distributions `d` apart in total variation, where the
//! draft's argmax is accepted only with the target's probability of that token. Verification
//! is unchanged (the target samples as decoding alone would), so what the request yields never
//! depends on the drafts.
//!
//! **Its cache shares the target's block tables.** The draft's cache has the target's blocks
//! (same ids, same block size) plus scratch blocks: a request's draft KV for position `p` lives
//! in the draft's copy of the block the target's table holds for `p`, so the draft's blocks are
//! allocated, freed and preempted with the target's, by the target's scheduler. Positions past
//! the target's table (the last token and the drafts, before the scheduler allocated slots for
//! them) go to scratch blocks lent for one round.
//!
//! Each round (after a step, for the next one), in the draft's own forward passes:
//! 1. **catch-up**: every request asking for drafts brings the tokens whose draft KV is missing
//!    (what the target computed since it last drafted, and its last token), at most the
//!    scheduler's step budget in all; one that caught up fully gets its last row's logits, from
//!    which draft 1 is drawn. Requests that do not draft (prefilling, paused, or a batch too large)
//!    cost the draft nothing: they catch up when they next draft, unless that backlog is too
//!    long against the output they may still produce;
//! 2. `k - 1` passes of one token per drafting request: draft `i` in, draft `i + 1` out.
//!
//! **Validity.** Positions `0..valid` of a request hold draft KV of its real tokens. Drafts
//! written in a round become valid in the next one as far as they equal the request's tokens
//! there (the target accepted them) and lie in the target's blocks (not scratch). A preemption
//! (the request's counter moved) resets `valid` to 0, because its blocks may be new ones, and a
//! new request starts at 0 even with a prefix-cache hit: the draft recomputes that KV, writing
//! the same values into a shared block. Nothing here can change the target's output: drafts are
//! proposals, verified exactly by the runner; stale draft KV would only lower acceptance.

use std::sync::{Mutex, PoisonError};

use kiln_core::{RequestId, TokenId};
use kiln_models::{
    Backend, BoundModel, ForwardBatch, ForwardError, Logits, LogitsWanted, Model, ModelConfig,
    StepModel,
};
use kiln_sched::Scheduler;

use super::SpeculativeConfig;
use super::proposer::Proposer;
use crate::requests::RequestTable;
use crate::sampler::argmax;
use crate::{EngineConfig, HostPool, Sampler};

/// A request drafts only while the tokens its draft KV is missing are at most this many times
/// the output tokens it may still produce: catching up costs a draft prefill token each, and
/// drafting saves a fraction of each decode step (with the default model drafting for its F16
/// copy, a decode step costs about 17 of the draft's prefill tokens and drafting saves about a
/// third of it, so a remaining output token repays about 5 tokens of catch-up).
const MAX_CATCH_UP_PER_OUTPUT_TOKEN: usize = 4;

/// What the draft knows of one request (kept in its `LiveRequest`).
#[derive(Debug, Default)]
pub(crate) struct DraftSeq {
    /// The request's preemption count when `valid` was last set.
    preemptions: u32,
    /// Positions `0..valid` hold draft KV of the request's tokens.
    valid: usize,
    /// Drafts written last round at positions `pending_start..`; those below `pending_end` went
    /// to the target's blocks.
    pending: Vec<TokenId>,
    pending_start: usize,
    pending_end: usize,
}

impl DraftSeq {
    /// Brings `valid` up to date with the request's tokens after a step.
    fn refresh(&mut self, preemptions: u32, tokens: &[TokenId]) {
        if self.preemptions != preemptions {
            *self = Self { preemptions, ..Self::default() };
            return;
        }
        if self.valid == self.pending_start {
            for (i, draft) in self.pending.iter().enumerate() {
                let p = self.pending_start + i;
                if p >= self.pending_end || tokens.get(p) != Some(draft) {
                    break;
                }
                self.valid = p + 1;
            }
        }
        self.pending.clear();
    }
}

/// One request drafting this round.
#[derive(Debug)]
struct Drafting {
    id: RequestId,
    /// Position of the request's last known token.
    last: usize,
    k: usize,
    /// The target's block table, then scratch blocks.
    table: Vec<u32>,
    drafts: Vec<TokenId>,
    /// Draws the drafts as the request samples (`None`: argmax).
    sampler: Option<Sampler>,
}

impl Drafting {
    /// Draws the next draft from `logits` (`[vocab]`, changed in place by the sampler).
    fn draw(&mut self, logits: &mut [f32]) {
        let token = match &mut self.sampler {
            Some(sampler) => sampler.sample(logits),
            None => TokenId(argmax(logits)),
        };
        self.drafts.push(token);
    }
}

/// Binds the draft model to a KV cache of the target's blocks plus scratch blocks, after
/// checking that it shares the target's vocabulary.
pub fn bind_draft_model<B: Backend>(
    draft: Box<dyn Model<B>>,
    target: &ModelConfig,
    config: &EngineConfig,
) -> Result<DraftProposer, String> {
    let (draft_vocab, vocab) = (draft.config().vocab_size, target.vocab_size);
    if draft_vocab != vocab {
        return Err(format!(
            "the draft model's vocabulary ({draft_vocab} tokens) differs from the target's \
             ({vocab}); a draft model must share the target's tokenizer"
        ));
    }
    let Some(spec) = &config.speculative else {
        return Err("a draft model was given without a speculative config".into());
    };
    let draft_positions = draft.config().max_position_embeddings;
    let max_model_len = config.scheduler.max_model_len;
    if draft_positions < max_model_len {
        return Err(format!(
            "the draft model's maximum positions ({draft_positions}) are fewer than \
             `max_model_len` ({max_model_len})"
        ));
    }
    let max_num_seqs = config.scheduler.max_num_seqs;
    let scratch = DraftProposer::scratch_blocks(spec, max_num_seqs, config.block_size);
    let bound = BoundModel::new(
        draft,
        config.kv_cache_dtype,
        config.num_kv_blocks + scratch,
        config.block_size,
    )
    .map_err(|e| format!("the draft model's KV cache: {e}"))?;
    Ok(DraftProposer::new(
        Box::new(bound),
        spec.draft_model_name().unwrap_or("(unnamed)"),
        config.num_kv_blocks,
        max_num_seqs,
    )
    .with_host_pool(config.host_pool.clone()))
}

/// Runs the draft model (its per-request state is in each request's `LiveRequest`).
pub struct DraftProposer {
    /// The draft bound to its cache: the target's blocks, then the scratch blocks.
    model: Box<dyn StepModel>,
    /// What the draft was loaded from.
    name: String,
    num_target_blocks: usize,
    num_scratch_blocks: usize,
    block_size: usize,
    /// The scheduler's running cap (with `disable_by_batch_size`, it bounds the requests that
    /// draft at once).
    max_num_seqs: usize,
    batch: ForwardBatch,
    logits: Logits,
    drafting: Vec<Drafting>,
    /// Scratch: one sequence's tokens as the batch takes them.
    tokens: Vec<u32>,
    /// Failed draft passes (logged at powers of two).
    num_failures: u64,
    /// Where the drafting requests' draws run in parallel.
    host: HostPool,
}

impl std::fmt::Debug for DraftProposer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftProposer")
            .field("model", &self.model.config().architecture)
            .field("num_target_blocks", &self.num_target_blocks)
            .field("num_scratch_blocks", &self.num_scratch_blocks)
            .finish_non_exhaustive()
    }
}

impl DraftProposer {
    /// Scratch blocks a cache needs for `config` under a running cap of `max_num_seqs`: at
    /// most `min(disable_by_batch_size, max_num_seqs)` requests draft at once, and a request's
    /// positions past its table (`last..last + k`, with the table covering `0..last`) span at
    /// most `ceil(k / block_size)` blocks.
    pub fn scratch_blocks(
        config: &SpeculativeConfig,
        max_num_seqs: usize,
        block_size: usize,
    ) -> usize {
        let max_drafting = config.disable_by_batch_size.min(max_num_seqs);
        max_drafting * config.num_speculative_tokens.div_ceil(block_size)
    }

    /// A proposer over `model` (loaded from `name`), bound to a cache of `num_target_blocks`
    /// (the target's) plus scratch blocks ([`DraftProposer::scratch_blocks`]).
    pub fn new(
        model: Box<dyn StepModel>,
        name: &str,
        num_target_blocks: usize,
        max_num_seqs: usize,
    ) -> Self {
        let spec = model.kv_spec();
        Self {
            name: name.to_owned(),
            num_scratch_blocks: spec.num_blocks.saturating_sub(num_target_blocks),
            num_target_blocks,
            block_size: spec.block_size,
            max_num_seqs,
            batch: ForwardBatch::new(spec.block_size),
            model,
            logits: Logits::default(),
            drafting: Vec::new(),
            tokens: Vec::new(),
            num_failures: 0,
            host: HostPool::serial(),
        }
    }

    /// Draws the drafting requests' drafts in parallel on `host` (default: serially).
    #[must_use]
    pub fn with_host_pool(mut self, host: HostPool) -> Self {
        self.host = host;
        self
    }

    /// The draft model, bound to its cache.
    pub fn model(&self) -> &dyn StepModel {
        &*self.model
    }

    /// Whether this draft serves `config`: the same draft model, and no more drafts at once
    /// than its scratch blocks were sized for.
    pub fn check_serves(&self, config: &SpeculativeConfig) -> Result<(), String> {
        let name = config.draft_model_name().unwrap_or("(none)");
        if name != self.name {
            return Err(format!(
                "the engine's draft model is `{}`, not `{name}`: another draft needs a new engine",
                self.name
            ));
        }
        let needed = Self::scratch_blocks(config, self.max_num_seqs, self.block_size);
        if needed > self.num_scratch_blocks {
            return Err(format!(
                "the draft model's cache has {} scratch blocks, and {} drafts per request with \
                 disable_by_batch_size {} need {needed}: that needs a new engine",
                self.num_scratch_blocks,
                config.num_speculative_tokens,
                config.disable_by_batch_size
            ));
        }
        Ok(())
    }

    /// Catches the requests of `wanted` up and proposes up to `k` drafts for each `(id, k)` of
    /// `wanted` (requests that decode next), handing them to the scheduler. Returns whether the
    /// round was a steady one: some request drafted, with at most two catch-up tokens per
    /// drafting request, so its time is what drafting costs per step.
    fn try_propose(
        &mut self,
        scheduler: &mut Scheduler,
        wanted: &[(RequestId, usize)],
        requests: &mut RequestTable,
    ) -> Result<bool, ForwardError> {
        self.plan_first_pass(scheduler, wanted, requests)?;
        let num_drafting = self.drafting.len();
        let steady = num_drafting > 0 && self.batch.num_tokens() <= 2 * num_drafting;
        if self.batch.num_tokens() == 0 {
            return Ok(steady);
        }
        self.model.forward(&self.batch, &mut self.logits)?;
        self.draw_drafts(0)?;
        let max_k = self.drafting.iter().map(|d| d.k).max().unwrap_or(0);
        for step in 1..max_k {
            self.batch.clear();
            for d in self.drafting.iter().filter(|d| d.k > step) {
                let token = d.drafts[step - 1].0;
                self.batch.push_seq(&[token], d.last + step, &d.table, LogitsWanted::Last)?;
            }
            self.model.forward(&self.batch, &mut self.logits)?;
            self.draw_drafts(step)?;
        }
        for d in &self.drafting {
            let real_end = scheduler.kv_cache().block_table(d.id).len() * self.block_size;
            if let Some(seq) = requests.get_mut(d.id).map(|r| &mut r.spec.draft) {
                // Drafts 1..k-1 were written at the positions after the last token.
                seq.pending.extend_from_slice(&d.drafts[..d.k - 1]);
                seq.pending_start = d.last + 1;
                seq.pending_end = real_end;
            }
            scheduler.update_draft_token_ids(d.id, &d.drafts);
        }
        Ok(steady)
    }

    /// Forgets what the draft's cache holds of every request (after a failed pass, whose KV
    /// writes are unknown).
    fn reset(requests: &mut RequestTable) {
        for live in requests.values_mut() {
            live.spec.draft = DraftSeq::default();
        }
    }

    /// Draws draft `step` (0-based) of every request drafting more than `step` tokens from
    /// this pass's logit rows (one per such request, in `self.drafting` order), the requests in
    /// parallel on the engine's host pool: each draws from its own row with its own
    /// sampler (a sampled row of a 262k vocabulary is about a millisecond of one core).
    fn draw_drafts(&mut self, step: usize) -> Result<(), ForwardError> {
        let vocab = self.logits.vocab_size();
        let rows = self.logits.as_mut_slice().chunks_exact_mut(vocab);
        let num_rows = rows.len();
        let wanted = self.drafting.iter().filter(|d| d.k > step).count();
        let jobs: Vec<Mutex<(&mut Drafting, &mut [f32])>> =
            self.drafting.iter_mut().filter(|d| d.k > step).zip(rows).map(Mutex::new).collect();
        if num_rows != wanted {
            return Err(ForwardError::Batch(format!(
                "the draft pass returned {num_rows} logit rows for {wanted} drafting requests"
            )));
        }
        self.host.run(jobs.len(), &|i| {
            let mut job = jobs[i].lock().unwrap_or_else(PoisonError::into_inner);
            let (drafting, row) = &mut *job;
            drafting.draw(row);
        });
        Ok(())
    }

    /// Fills the batch with the catch-up of every request of `wanted`, a logit row for each
    /// that drafts this round (in `self.drafting` order, which their rows follow), and lends
    /// the scratch blocks. A request whose catch-up is long against the output it may still
    /// produce ([`MAX_CATCH_UP_PER_OUTPUT_TOKEN`]) is left out: the draft's prefill would cost
    /// more than its drafts can save.
    fn plan_first_pass(
        &mut self,
        scheduler: &Scheduler,
        wanted: &[(RequestId, usize)],
        requests: &mut RequestTable,
    ) -> Result<(), ForwardError> {
        self.batch.clear();
        self.drafting.clear();
        let bs = self.block_size;
        let max_model_len = scheduler.config().max_model_len;
        let scratch_end = self.num_target_blocks + self.num_scratch_blocks;
        let mut next_scratch = self.num_target_blocks;
        // The step budget in force (a batch controller may have lowered it).
        let mut budget = scheduler.limits().max_num_batched_tokens.max(1);
        for &(id, k) in wanted {
            let Some(req) = scheduler.request(id) else { continue };
            if k == 0 || req.num_uncomputed_tokens() != 1 {
                continue; // only a request that decodes next drafts
            }
            let Some(live) = requests.get_mut(id) else { continue };
            let seq = &mut live.spec.draft;
            let tokens = req.all_token_ids();
            seq.refresh(req.num_preemptions(), tokens);
            // The last known token's position. A request not scheduled in the last step may
            // have its draft KV already: writing it again writes the same values.
            let last = req.num_computed_tokens();
            seq.valid = seq.valid.min(last);
            let missing = last + 1 - seq.valid;
            let remaining = req.num_remaining_tokens(max_model_len);
            if missing > MAX_CATCH_UP_PER_OUTPUT_TOKEN * remaining {
                continue;
            }
            let table = scheduler.kv_cache().block_table(id);
            let real_end = table.len() * bs;
            let scratch = (last + k).div_ceil(bs).saturating_sub(table.len());
            if missing <= budget && scratch <= scratch_end - next_scratch {
                let mut ext: Vec<u32> = table.iter().map(|b| b.0).collect();
                ext.extend((next_scratch..next_scratch + scratch).map(|b| b as u32));
                next_scratch += scratch;
                self.tokens.clear();
                self.tokens.extend(tokens[seq.valid..=last].iter().map(|t| t.0));
                self.batch.push_seq(&self.tokens, seq.valid, &ext, LogitsWanted::Last)?;
                budget -= missing;
                seq.valid = (last + 1).min(real_end);
                // Drafts are drawn as the request samples (`None`: the draft's argmax).
                let sampler = live.sampler.as_ref().map(Sampler::for_drafting);
                let drafts = Vec::with_capacity(k);
                self.drafting.push(Drafting { id, last, k, table: ext, drafts, sampler });
                continue;
            }
            // Catch-up only, within the target's blocks and the round's budget; the drafts
            // come in a later round.
            let end = (last + 1).min(real_end).min(seq.valid + budget);
            if end > seq.valid {
                self.tokens.clear();
                self.tokens.extend(tokens[seq.valid..end].iter().map(|t| t.0));
                let table: Vec<u32> = table.iter().map(|b| b.0).collect();
                self.batch.push_seq(&self.tokens, seq.valid, &table, LogitsWanted::None)?;
                budget -= end - seq.valid;
                seq.valid = end;
            }
        }
        Ok(())
    }
}

impl Proposer for DraftProposer {
    /// A failed draft pass is logged, forgets the draft's state and proposes nothing in this
    /// step (the target's outputs never depend on drafts).
    fn propose(
        &mut self,
        scheduler: &mut Scheduler,
        wanted: &[(RequestId, usize)],
        requests: &mut RequestTable,
    ) -> bool {
        match self.try_propose(scheduler, wanted, requests) {
            Ok(steady) => steady,
            Err(e) => {
                self.num_failures += 1;
                if self.num_failures.is_power_of_two() {
                    tracing::warn!(
                        "draft model pass failed ({} so far), no drafts in this step: {e}",
                        self.num_failures
                    );
                }
                Self::reset(requests);
                false
            }
        }
    }

    fn draft_model(&self) -> Option<&DraftProposer> {
        Some(self)
    }

    fn into_draft_model(self: Box<Self>) -> Option<DraftProposer> {
        Some(*self)
    }
}
