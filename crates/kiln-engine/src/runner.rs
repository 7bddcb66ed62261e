//! The model runner: turns the scheduler's step diff into a [`ForwardBatch`], runs the model and
//! samples.
//!
//! It holds each scheduled request's tokens and block table exactly as the scheduler's diffs
//! state them, and predicts nothing: new requests arrive in full (from their
//! `num_computed_tokens`, a prefix-cache hit), cached ones as deltas (the tokens `update`
//! accepted since, blocks appended) with the scheduler's `num_computed_tokens`, so tokens the
//! scheduler dropped or rolled back never linger here. Speculative tokens are refused: verifying
//! drafts needs a proposer-aware runner. Logits are computed only for rows
//! that reach the end of the known tokens (a prompt's last chunk or a decode), and each such row
//! is sampled with the request's own [`Sampler`], seeded per request, so the batch a request
//! lands in never changes its tokens. Samplers survive preemption (a resumed request keeps its
//! random stream); they are dropped when the request finishes or is aborted.
//!
//! Requests asking for prompt log-probabilities get logits for every prompt position (their
//! prompt chunks are computed with `LogitsWanted::All`); those are gathered across chunks and
//! delivered with the first sampled token. Recomputation after preemption overwrites them with
//! the same values.
//!
//! Once warm, a step allocates only for new requests, block-table growth and log-probabilities:
//! the batch, the logits, the scratch and the per-step row list are reused.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use kiln_core::{RequestId, TokenId};
use kiln_models::{ForwardBatch, ForwardError, Logits, LogitsWanted, StepModel};
use kiln_sched::{ModelRunnerOutput, SchedulerOutput};

use crate::{Logprobs, Sampler, logprobs};

/// Log-probabilities of one prompt: entry `p` is for prompt token `p` (`None` for the first).
pub type PromptLogprobs = Vec<Option<Logprobs>>;

/// What a sampled row brings besides its token.
#[derive(Debug, Default)]
pub struct SampleExtras {
    pub logprobs: Option<Logprobs>,
    /// With the first sampled token only.
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// Prompt log-probabilities being gathered for one request.
#[derive(Debug)]
struct PromptLogprobState {
    prompt: Vec<u32>,
    top_k: usize,
    /// `None` once delivered.
    entries: Option<PromptLogprobs>,
}

/// A row being sampled: the request's sampler, its logits, and the result.
type SampleJob<'a> = (&'a mut Sampler, &'a mut [f32], Option<(TokenId, Option<Logprobs>)>);

/// One scheduled request's rows in this step's logits.
#[derive(Clone, Copy, Debug)]
struct StepRow {
    id: RequestId,
    /// Position of the first new token.
    start: usize,
    /// Logit rows this request produced (0, 1, or every new token).
    num_rows: usize,
    /// Whether the last row is sampled.
    samples: bool,
}

/// One scheduled request as the scheduler's diffs describe it.
#[derive(Debug, Default)]
struct RunnerRequest {
    /// Prompt then output tokens, as of the last diff.
    tokens: Vec<u32>,
    block_table: Vec<u32>,
}

pub struct ModelRunner {
    /// The model bound to its KV cache and workspace on its backend.
    model: Box<dyn StepModel>,
    logits: Logits,
    batch: ForwardBatch,
    requests: HashMap<RequestId, RunnerRequest>,
    samplers: HashMap<RequestId, Sampler>,
    prompt_logprobs: HashMap<RequestId, PromptLogprobState>,
    /// Seed of requests whose params carry none: request `id` uses `seed + id`.
    seed: u64,
    eos_token_ids: Vec<u32>,
    /// This step's scheduled requests in batch order.
    step_rows: Vec<StepRow>,
    /// This step's log-probabilities, by request.
    extras: HashMap<RequestId, SampleExtras>,
}

impl ModelRunner {
    /// A runner over `model` and the KV cache it is bound to.
    pub fn new(model: Box<dyn StepModel>, seed: u64) -> Self {
        let block_size = model.kv_spec().block_size;
        Self {
            model,
            logits: Logits::default(),
            batch: ForwardBatch::new(block_size),
            requests: HashMap::new(),
            samplers: HashMap::new(),
            prompt_logprobs: HashMap::new(),
            seed,
            eos_token_ids: Vec::new(),
            step_rows: Vec::new(),
            extras: HashMap::new(),
        }
    }

    /// The model's end-of-sequence ids (masked by samplers until `min_tokens`).
    #[must_use]
    pub fn with_eos_token_ids(mut self, eos: &[TokenId]) -> Self {
        self.eos_token_ids = eos.iter().map(|t| t.0).collect();
        self
    }

    /// Takes the log-probabilities the last step produced for `id`, if any.
    pub fn take_extras(&mut self, id: RequestId) -> Option<SampleExtras> {
        self.extras.remove(&id)
    }

    pub fn model(&self) -> &dyn StepModel {
        &*self.model
    }

    /// Drops everything known about `id` (abort).
    pub fn forget(&mut self, id: RequestId) {
        self.requests.remove(&id);
        self.samplers.remove(&id);
        self.prompt_logprobs.remove(&id);
    }

    /// Runs one step of `sched_out` and writes one entry per scheduled request into `out`
    /// (cleared first), in `sched_out.scheduled()` order.
    pub fn execute(
        &mut self,
        sched_out: &SchedulerOutput,
        out: &mut ModelRunnerOutput,
    ) -> Result<(), ForwardError> {
        out.clear();
        self.extras.clear();
        for id in &sched_out.preempted_ids {
            self.requests.remove(id);
        }
        for id in &sched_out.finished_ids {
            self.forget(*id);
        }
        self.batch.clear();
        self.step_rows.clear();
        for new in &sched_out.new_requests {
            let mut r = self.requests.remove(&new.id).unwrap_or_default();
            r.tokens.clear();
            r.tokens.extend(new.token_ids.iter().map(|t| t.0));
            r.block_table.clear();
            r.block_table.extend(new.block_table.iter().map(|b| b.0));
            let seed = self.seed.wrapping_add(new.id.0);
            let eos = &self.eos_token_ids;
            self.samplers.entry(new.id).or_insert_with(|| {
                Sampler::new(new.sampling_params.clone(), &r.tokens, seed).with_eos_token_ids(eos)
            });
            if let Some(top_k) = new.sampling_params.prompt_logprobs {
                self.prompt_logprobs.entry(new.id).or_insert_with(|| PromptLogprobState {
                    prompt: r.tokens.clone(),
                    top_k,
                    entries: Some(vec![None; r.tokens.len()]),
                });
            }
            let num_computed = new.num_computed_tokens;
            let all = wants_all_logits(&self.prompt_logprobs, new.id, num_computed);
            Self::push(
                &mut self.batch,
                &mut self.step_rows,
                new.id,
                &r,
                num_computed,
                new.num_scheduled_tokens,
                all,
            )?;
            self.requests.insert(new.id, r);
        }
        for cached in &sched_out.cached_requests {
            let r = self.requests.get_mut(&cached.id).ok_or_else(|| {
                ForwardError::Batch(format!("{} was scheduled as cached but is unknown", cached.id))
            })?;
            if !cached.spec_token_ids.is_empty() {
                return Err(ForwardError::Batch(format!(
                    "{}: speculative tokens scheduled, but this runner verifies none",
                    cached.id
                )));
            }
            r.tokens.extend(sched_out.new_token_ids(cached).iter().map(|t| t.0));
            r.block_table.extend(cached.new_block_ids.iter().map(|b| b.0));
            let (num_computed, n) = (cached.num_computed_tokens, cached.num_scheduled_tokens);
            let all = wants_all_logits(&self.prompt_logprobs, cached.id, num_computed);
            Self::push(&mut self.batch, &mut self.step_rows, cached.id, r, num_computed, n, all)?;
        }
        if self.step_rows.is_empty() {
            return Ok(());
        }
        self.model.forward(&self.batch, &mut self.logits)?;
        // Prompt log-probabilities read every row of a request but its last one, the row that
        // sampling changes in place (penalties, bias), so gathering them all first is the same
        // as gathering request by request.
        let mut row = 0;
        let mut to_sample = Vec::with_capacity(self.step_rows.len());
        for i in 0..self.step_rows.len() {
            let StepRow { id, start, num_rows, samples } = self.step_rows[i];
            self.gather_prompt_logprobs(id, start, row, num_rows);
            row += num_rows;
            if samples {
                to_sample.push((id, row - 1));
            }
        }
        let mut sampled = self.sample_rows(&to_sample)?.into_iter();
        for &StepRow { id, samples, .. } in &self.step_rows {
            if !samples {
                out.push(id, &[]);
                continue;
            }
            let Some((token, lp)) = sampled.next() else {
                return Err(ForwardError::Batch(format!(
                    "{id} was to be sampled but got no token"
                )));
            };
            // The scheduler hands accepted tokens back in the next diff (`new_token_ids`).
            out.push(id, &[token]);
            let prompt_logprobs = self.prompt_logprobs.get_mut(&id).and_then(|s| s.entries.take());
            if lp.is_some() || prompt_logprobs.is_some() {
                self.extras.insert(id, SampleExtras { logprobs: lp, prompt_logprobs });
            }
        }
        Ok(())
    }

    /// Samples logit row `row` with the sampler of `id` for every `(id, row)` (rows increasing),
    /// the rows in parallel on the backend's host threads: each request's sampler owns its random state and touches
    /// only its own row, so the tokens are those of sampling the rows one by one (a greedy row
    /// of a 262k vocabulary reads 1 MiB of logits, 64 of them 5 ms on one core).
    fn sample_rows(
        &mut self,
        rows: &[(RequestId, usize)],
    ) -> Result<Vec<(TokenId, Option<Logprobs>)>, ForwardError> {
        let mut samplers = Vec::with_capacity(rows.len());
        for &(id, _) in rows {
            let Some(sampler) = self.samplers.remove(&id) else {
                for (&(id, _), sampler) in rows.iter().zip(samplers) {
                    self.samplers.insert(id, sampler);
                }
                return Err(ForwardError::Batch(format!("{id} has no sampler")));
            };
            samplers.push(sampler);
        }
        let vocab = self.logits.vocab_size();
        // `rows` is in increasing row order (the step's order), one row per request.
        let mut logit_rows = self.logits.as_mut_slice().chunks_exact_mut(vocab).enumerate();
        let jobs: Vec<Mutex<SampleJob<'_>>> = rows
            .iter()
            .zip(samplers.iter_mut())
            .map(|(&(_, row), sampler)| {
                let (_, logits) =
                    logit_rows.find(|&(i, _)| i == row).expect("rows in increasing order");
                Mutex::new((sampler, logits, None))
            })
            .collect();
        self.model.host_parallel(jobs.len(), &|i| {
            let mut job = jobs[i].lock().unwrap_or_else(PoisonError::into_inner);
            let (sampler, logits, result) = &mut *job;
            *result = Some(sampler.sample_with_logprobs(logits));
        });
        let results = jobs
            .into_iter()
            .map(|job| job.into_inner().unwrap_or_else(PoisonError::into_inner).2)
            .collect::<Option<Vec<_>>>()
            .expect("every job ran");
        for (&(id, _), sampler) in rows.iter().zip(samplers) {
            self.samplers.insert(id, sampler);
        }
        Ok(results)
    }

    /// Stores the log-probabilities of prompt tokens `start + 1 ..` found in logit rows
    /// `first_row .. first_row + num_rows` (positions `start ..`).
    fn gather_prompt_logprobs(
        &mut self,
        id: RequestId,
        start: usize,
        first_row: usize,
        num_rows: usize,
    ) {
        let Some(state) = self.prompt_logprobs.get_mut(&id) else { return };
        let Some(entries) = state.entries.as_mut() else { return };
        for i in 0..num_rows {
            let target = start + i + 1;
            if target >= state.prompt.len() {
                break;
            }
            let row = self.logits.row_mut(first_row + i);
            entries[target] = Some(logprobs(row, TokenId(state.prompt[target]), state.top_k));
        }
    }

    /// Adds `id`'s `num_scheduled` tokens from `num_computed` on to the batch.
    fn push(
        batch: &mut ForwardBatch,
        rows: &mut Vec<StepRow>,
        id: RequestId,
        r: &RunnerRequest,
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
        rows.push(StepRow { id, start: num_computed, num_rows, samples });
        Ok(())
    }
}

/// Whether `id` still gathers prompt log-probabilities from position `num_computed` on.
fn wants_all_logits(
    states: &HashMap<RequestId, PromptLogprobState>,
    id: RequestId,
    num_computed: usize,
) -> bool {
    states.get(&id).is_some_and(|s| s.entries.is_some() && num_computed + 1 < s.prompt.len())
}
