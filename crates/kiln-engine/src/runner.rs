//! The model runner: turns the scheduler's step diff into a [`ForwardBatch`], runs the model and
//! samples.
//!
//! It holds each scheduled request's tokens and block table exactly as the scheduler's diffs
//! state them, and predicts nothing: new requests arrive in full (from their
//! `num_computed_tokens`, a prefix-cache hit), cached ones as deltas (the tokens `update`
//! accepted since, blocks appended) with the scheduler's `num_computed_tokens`, so tokens the
//! scheduler dropped or rolled back never linger here. Logits are computed only for rows
//! that reach the end of the known tokens (a prompt's last chunk or a decode), and each such row
//! is sampled with the request's own [`Sampler`], seeded per request, so the batch a request
//! lands in never changes its tokens.
//!
//! Draft tokens (speculative decoding) are verified here: a request with `k` drafts computes its
//! last known token and the drafts (`k + 1` logit rows); row `i` is sampled with the request's
//! sampler as if the tokens before it had been decoded one by one (the sampler observes each
//! token it yields), and verification stops at the first sampled token that differs from draft
//! `i`. The request yields the accepted drafts plus that sampled token (`1..=k + 1` tokens),
//! each with its own log-probabilities; the KV written for rejected drafts is rolled back by the
//! scheduler. Drafts forming a token tree (`spec_parents`) are one tree sequence of the batch
//! ([`ForwardBatch::push_tree`]); sampling walks down from the root, row by row, into the child
//! holding the sampled token, and stops where no child does. The accepted path's K/V is then
//! copied from its nodes' slots to the slots of its positions, so the scheduler's count of
//! accepted tokens describes the cache as it does for a chain. Samplers survive preemption (a
//! resumed request keeps its random stream); they are dropped when the request finishes or is
//! aborted.
//!
//! Requests asking for prompt log-probabilities get logits for every prompt position (their
//! prompt chunks are computed with `LogitsWanted::All`); those are gathered across chunks and
//! delivered with the first sampled token. Recomputation after preemption overwrites them with
//! the same values.
//!
//! The runner keeps no state by request: each request's view of its tokens, its sampler, its
//! prompt log-probabilities and its extras live in its [`crate::requests::LiveRequest`], passed
//! in with each call as the engine's [`RequestTable`].
//!
//! With asynchronous scheduling a step is split: `launch` builds the batch and hands it, the
//! model and the logits buffer to the forward thread; `complete` takes them back and samples.
//! Between the two the engine may remove aborted requests or retire stopped ones (their rows
//! are then not sampled), add new ones, and build the next step's batch ahead
//! (`runner/ahead.rs`: `prepare_ahead`, then `launch_ahead` once the step in flight is sampled).
//!
//! Once warm, a step allocates only for new requests, block-table growth, log-probabilities,
//! each sampled request's short token list (one token, or the accepted drafts plus one) and a
//! step planned ahead's row and placeholder lists: the batches, the logits, the scratch and
//! the synchronous step's row and draft lists are reused.

use std::collections::HashMap;
use std::mem;
use std::time::{Duration, Instant};

use kiln_core::{RequestId, TokenId};
use kiln_models::{
    ForwardBatch, ForwardError, Logits, LogitsWanted, PoolerConfig, StepModel, TREE_ROOT,
};
use kiln_sched::{CachedRequestData, ModelRunnerOutput, SchedulerOutput};

use crate::forward_thread::{ForwardJob, ForwardThread};
use crate::requests::{BatchView, LiveRequest, PromptLogprobState, RequestTable};
use crate::structured::ConstraintStats;
use crate::{HostPool, Logprobs, Sampler};

mod ahead;
mod pool;
mod sample;

/// The model is with the forward thread between `launch` and `complete`.
const MODEL_IN_FLIGHT: &str = "the model is used by an asynchronous step in flight";

/// Log-probabilities of one prompt: entry `p` is for prompt token `p` (`None` for the first).
pub type PromptLogprobs = Vec<Option<Logprobs>>;

/// What a sampled row brings besides its token.
#[derive(Debug, Default)]
pub struct SampleExtras {
    pub logprobs: Option<Logprobs>,
    /// With the first sampled token only.
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// One scheduled request's rows in this step's logits.
#[derive(Clone, Debug)]
struct StepRow {
    id: RequestId,
    /// Position of the first new token.
    start: usize,
    /// Logit rows this request produced (0, 1, every new token, or one per draft plus one).
    num_rows: usize,
    /// Tokens it brought to the batch (its rows are the last `num_rows` of them).
    num_tokens: usize,
    /// Whether the last row is sampled.
    samples: bool,
    /// The request's drafts in `ModelRunner::step_drafts` (empty without).
    drafts: std::ops::Range<usize>,
    /// Whether the drafts form a tree (pushed with [`ForwardBatch::push_tree`]).
    tree: bool,
}

pub struct ModelRunner {
    /// The model bound to its KV cache and workspace on its backend (`None` while an
    /// asynchronous step's forward has it, with `batch` and `logits`).
    model: Option<Box<dyn StepModel>>,
    /// The model's vocabulary size and hidden size (known while the model is away).
    vocab_size: usize,
    hidden_size: usize,
    /// A pooling model's pooler: steps hand back hidden states, which are pooled
    /// (`runner/pool.rs`) instead of sampled.
    pooling: Option<PoolerConfig>,
    /// When the last collected asynchronous forward ended, and whether the forward thread
    /// failed for good (see `ModelRunner::forward_broken`).
    forward_finished_at: Option<Instant>,
    forward_broken: bool,
    logits: Logits,
    batch: ForwardBatch,
    /// Seed of requests whose params carry none: request `id` uses `seed + id`.
    seed: u64,
    eos_token_ids: Vec<u32>,
    /// Where a step's requests are sampled in parallel.
    host: HostPool,
    /// This step's scheduled requests in batch order.
    step_rows: Vec<StepRow>,
    /// This step's draft tokens, back to back (`StepRow::drafts` indexes them).
    step_drafts: Vec<u32>,
    /// The parent of each of `step_drafts` (a chain's are `TREE_ROOT, 0, 1, ...`).
    step_parents: Vec<u32>,
    /// Scratch: the KV slot copies moving accepted tree paths into place.
    slot_copies: Vec<(u32, u32)>,
    /// Scratch: one request's known tokens then drafts, as pushed to the batch.
    spec_tokens: Vec<u32>,
    /// The requests holding extras of the last step (cleared when the next one samples).
    with_extras: Vec<RequestId>,
    /// Where the last `execute` spent its time.
    timing: StepTiming,
    /// Structured-output work since start (every constraint's, summed after each step).
    constraint_stats: ConstraintStats,
    /// The next step's batch, built ahead while the step in flight computes.
    ahead: Option<ahead::AheadBatch>,
    /// Scratch: the step in flight's sampled token by request, for the placeholders.
    sampled_by_id: HashMap<RequestId, TokenId>,
}

/// Wall time of the last step's model forward and sampling (the rest of an engine step is host
/// work: scheduling, building the batch, updating requests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepTiming {
    pub forward: Duration,
    pub sample: Duration,
}

impl ModelRunner {
    /// A runner over `model` and the KV cache it is bound to.
    pub fn new(model: Box<dyn StepModel>, seed: u64) -> Self {
        let block_size = model.kv_spec().block_size;
        Self {
            vocab_size: model.config().vocab_size,
            hidden_size: model.config().hidden_size,
            pooling: None,
            forward_finished_at: None,
            forward_broken: false,
            model: Some(model),
            logits: Logits::default(),
            batch: ForwardBatch::new(block_size),
            seed,
            eos_token_ids: Vec::new(),
            host: HostPool::serial(),
            step_rows: Vec::new(),
            step_drafts: Vec::new(),
            step_parents: Vec::new(),
            slot_copies: Vec::new(),
            spec_tokens: Vec::new(),
            with_extras: Vec::new(),
            timing: StepTiming::default(),
            constraint_stats: ConstraintStats::default(),
            ahead: None,
            sampled_by_id: HashMap::new(),
        }
    }

    /// The model's end-of-sequence ids (masked by samplers until `min_tokens`).
    #[must_use]
    pub fn with_eos_token_ids(mut self, eos: &[TokenId]) -> Self {
        self.eos_token_ids = eos.iter().map(|t| t.0).collect();
        self
    }

    /// Samples a step's requests in parallel on `host` (default: serially).
    #[must_use]
    pub fn with_host_pool(mut self, host: HostPool) -> Self {
        self.host = host;
        self
    }

    /// Runs a pooling model's steps: hidden states pooled into each request's vector.
    #[must_use]
    pub fn with_pooling(mut self, pooling: Option<PoolerConfig>) -> Self {
        self.pooling = pooling;
        self
    }

    /// The model's hidden size (also while an asynchronous step has the model).
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    pub fn model(&self) -> &dyn StepModel {
        self.model.as_deref().expect(MODEL_IN_FLIGHT)
    }

    /// Whether the model is here (not on the forward thread, nor lost with it).
    pub(crate) fn has_model(&self) -> bool {
        self.model.is_some()
    }

    /// The model's vocabulary size (also while an asynchronous step has the model).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The model, mutable (its KV cache is written outside steps: a restored prefix cache).
    pub fn model_mut(&mut self) -> &mut dyn StepModel {
        self.model.as_deref_mut().expect(MODEL_IN_FLIGHT)
    }

    /// Where the last [`ModelRunner::execute`] spent its time.
    pub fn timing(&self) -> StepTiming {
        self.timing
    }

    /// Structured-output work since start.
    pub fn constraint_stats(&self) -> ConstraintStats {
        self.constraint_stats
    }

    /// Drops the batch views of requests preempted (they come back as new requests; their
    /// samplers stay) and retires finished ones still held (their delivery removes them).
    fn drop_gone(sched_out: &SchedulerOutput, table: &mut RequestTable) {
        for id in &sched_out.preempted_ids {
            if let Some(r) = table.get_mut(*id) {
                r.view = None;
            }
        }
        for id in &sched_out.finished_ids {
            if let Some(r) = table.get_mut(*id) {
                r.retire();
            }
        }
    }

    /// Runs one step of `sched_out` and writes one entry per scheduled request into `out`
    /// (cleared first), in `sched_out.scheduled()` order.
    pub fn execute(
        &mut self,
        sched_out: &SchedulerOutput,
        table: &mut RequestTable,
        out: &mut ModelRunnerOutput,
    ) -> Result<(), ForwardError> {
        self.clear_last_step(table, out);
        if !self.prepare(sched_out, table)? {
            return Ok(());
        }
        let forward_start = Instant::now();
        let model = self.model.as_deref_mut().expect(MODEL_IN_FLIGHT);
        model.forward(&self.batch, &mut self.logits)?;
        self.timing.forward = forward_start.elapsed();
        self.collect(table, out)
    }

    /// The rows of the forward that just ran: sampled, or pooled on a pooling model.
    fn collect(
        &mut self,
        table: &mut RequestTable,
        out: &mut ModelRunnerOutput,
    ) -> Result<(), ForwardError> {
        if self.pooling.is_some() { self.pool(table, out) } else { self.sample(table, out) }
    }

    /// [`ModelRunner::execute`]'s forward started on `thread`: builds the batch and hands it,
    /// the model and the logits buffer to the thread. `false`: nothing to run (no job started;
    /// [`ModelRunner::complete`] then reports the step's rows as unsampled).
    pub(crate) fn launch(
        &mut self,
        sched_out: &SchedulerOutput,
        table: &mut RequestTable,
        thread: &ForwardThread,
    ) -> Result<bool, ForwardError> {
        if !self.prepare(sched_out, table)? {
            return Ok(false);
        }
        let block_size = self.batch.block_size();
        let job = ForwardJob::new(
            self.model.take().expect(MODEL_IN_FLIGHT),
            mem::replace(&mut self.batch, ForwardBatch::new(block_size)),
            mem::take(&mut self.logits),
        );
        if let Err(job) = thread.launch(job) {
            let _never_ran = self.take_back(*job);
            return Err(ForwardError::Device("the forward thread has ended".into()));
        }
        Ok(true)
    }

    /// Waits for the forward [`ModelRunner::launch`] started (`launched`), then samples as
    /// `execute` does. Requests removed or retired meanwhile get no token.
    pub(crate) fn complete(
        &mut self,
        launched: bool,
        table: &mut RequestTable,
        thread: &ForwardThread,
        out: &mut ModelRunnerOutput,
    ) -> Result<(), ForwardError> {
        self.clear_last_step(table, out);
        if !launched {
            return Ok(());
        }
        let Some(job) = thread.wait() else {
            self.forward_broken = true;
            return Err(ForwardError::Device("the forward thread ended with the model".into()));
        };
        self.timing.forward = job.elapsed;
        self.forward_finished_at = job.finished_at;
        self.forward_broken |= job.panicked;
        let result = self.take_back(job);
        result?;
        for row in &mut self.step_rows {
            row.samples &= table.get(row.id).is_some_and(|r| r.sampler.is_some());
        }
        self.collect(table, out)
    }

    /// When the forward `complete` collected ended on its thread (`None`: no forward ran).
    pub(crate) fn forward_finished_at(&self) -> Option<Instant> {
        self.forward_finished_at
    }

    /// Whether the forward thread lost the model or a forward panicked: no step may run again.
    pub(crate) fn forward_broken(&self) -> bool {
        self.forward_broken
    }

    /// Drops what the last step left for its report (its output, extras and timing): a new
    /// step's sampling starts.
    fn clear_last_step(&mut self, table: &mut RequestTable, out: &mut ModelRunnerOutput) {
        out.clear();
        for id in self.with_extras.drain(..) {
            if let Some(r) = table.get_mut(id) {
                r.extras.clear();
            }
        }
        self.timing = StepTiming::default();
        self.forward_finished_at = None;
    }

    /// Puts the model and the buffers of a job that came back in place; returns its result.
    fn take_back(&mut self, job: ForwardJob) -> Result<(), ForwardError> {
        self.model = Some(job.model);
        self.batch = job.batch;
        self.logits = job.logits;
        job.result
    }

    /// Builds the step's batch from `sched_out`; `false` when no row is scheduled. The last
    /// step's extras and timing stay until the next `execute` or `complete`; its draft lists do
    /// not (asynchronous steps, which `prepare_ahead` builds during the step before, never
    /// carry drafts).
    fn prepare(
        &mut self,
        sched_out: &SchedulerOutput,
        table: &mut RequestTable,
    ) -> Result<bool, ForwardError> {
        Self::drop_gone(sched_out, table);
        self.batch.clear();
        self.batch.set_hidden_output(self.pooling.is_some());
        self.step_rows.clear();
        self.step_drafts.clear();
        self.step_parents.clear();
        for new in &sched_out.new_requests {
            let live = table.get_or_default(new.id);
            let r = live.view.get_or_insert_with(BatchView::default);
            r.tokens.clear();
            r.tokens.extend(new.token_ids.iter().map(|t| t.0));
            r.block_table.clear();
            r.block_table.extend(new.block_table.iter().map(|b| b.0));
            let seed = self.seed.wrapping_add(new.id.0);
            let eos = &self.eos_token_ids;
            if live.sampler.is_none() {
                let sampler = Sampler::new(new.sampling_params.clone(), &r.tokens, seed)
                    .with_eos_token_ids(eos)
                    .with_constraint(live.constraint.take());
                live.sampler = Some(sampler);
            }
            if let Some(top_k) = new.sampling_params.prompt_logprobs {
                live.prompt_logprobs.get_or_insert_with(|| PromptLogprobState {
                    prompt: r.tokens.clone(),
                    top_k,
                    entries: Some(vec![None; r.tokens.len()]),
                });
            }
            let num_computed = new.num_computed_tokens;
            let all = wants_all_logits(live, num_computed);
            let r = live.view.as_ref().expect("the view was just built");
            let (batch, rows) = (&mut self.batch, &mut self.step_rows);
            Self::push(batch, rows, new.id, r, num_computed, new.num_scheduled_tokens, all)?;
            batch.set_last_adapter(live.adapter);
        }
        for cached in &sched_out.cached_requests {
            let unknown = || {
                ForwardError::Batch(format!("{} was scheduled as cached but is unknown", cached.id))
            };
            let live = table.get_mut(cached.id).ok_or_else(unknown)?;
            let all = wants_all_logits(live, cached.num_computed_tokens);
            let r = live.view.as_mut().ok_or_else(unknown)?;
            r.tokens.extend(sched_out.new_token_ids(cached).iter().map(|t| t.0));
            r.block_table.extend(cached.new_block_ids.iter().map(|b| b.0));
            let (num_computed, n) = (cached.num_computed_tokens, cached.num_scheduled_tokens);
            if cached.spec_token_ids.is_empty() {
                let (batch, rows) = (&mut self.batch, &mut self.step_rows);
                Self::push(batch, rows, cached.id, r, num_computed, n, all)?;
            } else {
                Self::push_with_drafts(
                    &mut self.batch,
                    &mut self.step_rows,
                    (&mut self.step_drafts, &mut self.step_parents, &mut self.spec_tokens),
                    cached,
                    r,
                )?;
            }
            self.batch.set_last_adapter(live.adapter);
        }
        Ok(!self.step_rows.is_empty())
    }

    /// Adds `id`'s `num_scheduled` tokens from `num_computed` on to the batch.
    fn push(
        batch: &mut ForwardBatch,
        rows: &mut Vec<StepRow>,
        id: RequestId,
        r: &BatchView,
        num_computed: usize,
        num_scheduled: usize,
        all_logits: bool,
    ) -> Result<(), ForwardError> {
        let end = num_computed + num_scheduled;
        if end > r.tokens.len() {
            return Err(ForwardError::Batch(format!(
                "{id}: {num_scheduled} tokens scheduled past the {} known",
                r.tokens.len()
            )));
        }
        let samples = end == r.tokens.len();
        let (logits, num_rows) = match (all_logits, samples) {
            (true, _) => (LogitsWanted::All, num_scheduled),
            (false, true) => (LogitsWanted::Last, 1),
            (false, false) => (LogitsWanted::None, 0),
        };
        batch.push_seq(&r.tokens[num_computed..end], num_computed, &r.block_table, logits)?;
        rows.push(StepRow {
            id,
            start: num_computed,
            num_rows,
            num_tokens: num_scheduled,
            samples,
            drafts: 0..0,
            tree: false,
        });
        Ok(())
    }

    /// Adds a decoding request's last known token and its drafts (a chain, or a tree) to the
    /// batch, with a logit row for each; its drafts go to `drafts`, their parents to `parents`.
    fn push_with_drafts(
        batch: &mut ForwardBatch,
        rows: &mut Vec<StepRow>,
        (drafts, parents, scratch): (&mut Vec<u32>, &mut Vec<u32>, &mut Vec<u32>),
        cached: &CachedRequestData,
        r: &BatchView,
    ) -> Result<(), ForwardError> {
        let id = cached.id;
        let (num_computed, num_spec) = (cached.num_computed_tokens, cached.spec_token_ids.len());
        if r.tokens.len() != num_computed + 1 || cached.num_scheduled_tokens != 1 + num_spec {
            return Err(ForwardError::Batch(format!(
                "{id}: drafts must follow a decode's one token ({num_computed} computed, {} \
                 scheduled, {num_spec} drafts, {} known)",
                cached.num_scheduled_tokens,
                r.tokens.len()
            )));
        }
        scratch.clear();
        scratch.extend_from_slice(&r.tokens[num_computed..]);
        scratch.extend(cached.spec_token_ids.iter().map(|t| t.0));
        let tree = !cached.spec_parents.is_empty();
        if tree {
            if cached.spec_parents.len() != num_spec {
                return Err(ForwardError::Batch(format!(
                    "{id}: {} tree parents for {num_spec} drafts",
                    cached.spec_parents.len()
                )));
            }
            batch.push_tree(scratch, &cached.spec_parents, num_computed, &r.block_table)?;
            parents.extend_from_slice(&cached.spec_parents);
        } else {
            batch.push_seq(scratch, num_computed, &r.block_table, LogitsWanted::All)?;
            parents.push(TREE_ROOT);
            parents.extend(0..num_spec as u32 - 1);
        }
        let start = drafts.len();
        drafts.extend(cached.spec_token_ids.iter().map(|t| t.0));
        rows.push(StepRow {
            id,
            start: num_computed,
            num_rows: scratch.len(),
            num_tokens: scratch.len(),
            samples: true,
            drafts: start..drafts.len(),
            tree,
        });
        Ok(())
    }
}

/// Whether `live` still gathers prompt log-probabilities from position `num_computed` on, or
/// pools every row of a chunk from there (mean pooling; CLS from position 0).
fn wants_all_logits(live: &LiveRequest, num_computed: usize) -> bool {
    live.prompt_logprobs
        .as_ref()
        .is_some_and(|s| s.entries.is_some() && num_computed + 1 < s.prompt.len())
        || live.pool.as_ref().is_some_and(|p| p.acc.wants_all_rows(num_computed))
}
