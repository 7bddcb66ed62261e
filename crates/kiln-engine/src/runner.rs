//! The model runner: turns the scheduler's step diff into a [`ForwardBatch`], runs the model and
//! samples.
//!
//! It mirrors the scheduler's view of each scheduled request (tokens, computed count, block
//! table): new requests arrive in full (from their `num_computed_tokens`, a prefix-cache hit),
//! cached ones as deltas (tokens to compute, blocks appended). Logits are computed only for rows
//! that reach the end of the known tokens (a prompt's last chunk or a decode), and each such row
//! is sampled with the request's own [`Sampler`], seeded per request, so the batch a request
//! lands in never changes its tokens. Samplers survive preemption (a resumed request keeps its
//! random stream); they are dropped when the request finishes or is aborted.
//!
//! Once warm, a step allocates only for new requests and block-table growth: the batch, the
//! logits, the scratch and the per-step row list are reused.

use std::collections::HashMap;

use kiln_core::{RequestId, TokenId};
use kiln_kernels::ThreadPool;
use kiln_models::{
    ForwardBatch, ForwardError, ForwardScratch, Logits, LogitsWanted, Model, PagedKvCache,
};
use kiln_sched::{ModelRunnerOutput, SchedulerOutput};

use crate::Sampler;

/// The runner's copy of one scheduled request.
#[derive(Debug, Default)]
struct RunnerRequest {
    /// Prompt then output tokens.
    tokens: Vec<u32>,
    /// Tokens whose KV is written (after this step's forward, once scheduled).
    num_computed: usize,
    block_table: Vec<u32>,
}

pub struct ModelRunner {
    model: Box<dyn Model>,
    kv: PagedKvCache,
    scratch: ForwardScratch,
    logits: Logits,
    batch: ForwardBatch,
    requests: HashMap<RequestId, RunnerRequest>,
    samplers: HashMap<RequestId, Sampler>,
    /// Seed of requests whose params carry none: request `id` uses `seed + id`.
    seed: u64,
    /// This step's scheduled requests in batch order, and whether each samples.
    step_rows: Vec<(RequestId, bool)>,
}

impl ModelRunner {
    /// A runner with a KV cache of `num_blocks` blocks of `block_size` tokens.
    pub fn new(model: Box<dyn Model>, block_size: usize, num_blocks: usize, seed: u64) -> Self {
        let kv = PagedKvCache::new(model.kv_layout(), num_blocks, block_size);
        Self {
            model,
            kv,
            scratch: ForwardScratch::new(),
            logits: Logits::default(),
            batch: ForwardBatch::new(block_size),
            requests: HashMap::new(),
            samplers: HashMap::new(),
            seed,
            step_rows: Vec::new(),
        }
    }

    pub fn model(&self) -> &dyn Model {
        &*self.model
    }

    /// Bytes of one KV block across all layers.
    pub fn bytes_per_block(&self) -> usize {
        self.kv.bytes_per_block()
    }

    /// Requests the runner holds batch state for (scheduled and not finished or preempted).
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Drops everything known about `id` (abort).
    pub fn forget(&mut self, id: RequestId) {
        self.requests.remove(&id);
        self.samplers.remove(&id);
    }

    /// Runs one step of `sched_out` and writes one entry per scheduled request into `out`
    /// (cleared first), in `sched_out.scheduled()` order.
    pub fn execute(
        &mut self,
        pool: &ThreadPool,
        sched_out: &SchedulerOutput,
        out: &mut ModelRunnerOutput,
    ) -> Result<(), ForwardError> {
        out.sampled.clear();
        for id in &sched_out.preempted_ids {
            self.requests.remove(id);
        }
        for id in &sched_out.finished_ids {
            self.requests.remove(id);
            self.samplers.remove(id);
        }
        self.batch.clear();
        self.step_rows.clear();
        for new in &sched_out.new_requests {
            let mut r = self.requests.remove(&new.id).unwrap_or_default();
            r.tokens.clear();
            r.tokens.extend(new.token_ids.iter().map(|t| t.0));
            r.num_computed = new.num_computed_tokens;
            r.block_table.clear();
            r.block_table.extend(new.block_table.iter().map(|b| b.0));
            let seed = self.seed.wrapping_add(new.id.0);
            self.samplers
                .entry(new.id)
                .or_insert_with(|| Sampler::new(new.sampling_params.clone(), &r.tokens, seed));
            Self::push(
                &mut self.batch,
                &mut self.step_rows,
                new.id,
                &mut r,
                new.num_scheduled_tokens,
            )?;
            self.requests.insert(new.id, r);
        }
        for cached in &sched_out.cached_requests {
            let r = self.requests.get_mut(&cached.id).ok_or_else(|| {
                ForwardError::Batch(format!("{} was scheduled as cached but is unknown", cached.id))
            })?;
            r.block_table.extend(cached.new_block_ids.iter().map(|b| b.0));
            Self::push(
                &mut self.batch,
                &mut self.step_rows,
                cached.id,
                r,
                cached.num_scheduled_tokens,
            )?;
        }
        if self.step_rows.is_empty() {
            return Ok(());
        }
        self.model.forward(pool, &self.batch, &mut self.kv, &mut self.scratch, &mut self.logits)?;
        let mut row = 0;
        for &(id, wants) in &self.step_rows {
            if !wants {
                out.sampled.push((id, None));
                continue;
            }
            let (Some(sampler), Some(r)) = (self.samplers.get_mut(&id), self.requests.get_mut(&id))
            else {
                return Err(ForwardError::Batch(format!("{id} has no sampler")));
            };
            let token = sampler.sample(self.logits.row_mut(row));
            row += 1;
            r.tokens.push(token.0);
            out.sampled.push((id, Some(TokenId(token.0))));
        }
        Ok(())
    }

    fn push(
        batch: &mut ForwardBatch,
        rows: &mut Vec<(RequestId, bool)>,
        id: RequestId,
        r: &mut RunnerRequest,
        num_scheduled: usize,
    ) -> Result<(), ForwardError> {
        let end = r.num_computed + num_scheduled;
        if end > r.tokens.len() {
            return Err(ForwardError::Batch(format!(
                "{id}: {num_scheduled} tokens scheduled past the {} known",
                r.tokens.len()
            )));
        }
        let wants = end == r.tokens.len();
        let logits = if wants { LogitsWanted::Last } else { LogitsWanted::None };
        batch.push_seq(&r.tokens[r.num_computed..end], r.num_computed, &r.block_table, logits)?;
        rows.push((id, wants));
        r.num_computed = end;
        Ok(())
    }
}
