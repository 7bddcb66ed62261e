//! The runner's sampling: each scheduled request's logit rows, sampled with its own sampler
//! (drafts verified, module docs of `runner.rs`), the requests in parallel; prompt
//! log-probabilities gathered; accepted tree paths moved into place.

use std::mem;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use kiln_core::{RequestId, TokenId};
use kiln_models::{ForwardBatch, ForwardError, Logits};
use kiln_sched::ModelRunnerOutput;

use super::{MODEL_IN_FLIGHT, ModelRunner, SampleExtras, StepRow};
use crate::requests::{LiveRequest, RequestTable};
use crate::{Logprobs, Sampler, logprobs};

/// One request's rows being sampled: its sampler, its logit rows (`[rows, vocab]`: one, or one
/// per draft plus one), its drafts and their parents, the tokens sampled (each with its
/// log-probabilities) and the drafts accepted.
struct SampleJob<'a> {
    sampler: &'a mut Sampler,
    logits: &'a mut [f32],
    drafts: &'a [u32],
    parents: &'a [u32],
    sampled: SampledTokens,
    path: Vec<usize>,
}

/// A request's generated tokens of one step, each with its log-probabilities.
type SampledTokens = Vec<(TokenId, Option<Logprobs>)>;

/// One request to sample: its id, its first logit row, and its drafts in the step's draft
/// buffer.
type SampleRow = (RequestId, usize, std::ops::Range<usize>);

impl ModelRunner {
    /// Samples the rows of the forward that just ran into `out` (one entry per scheduled
    /// request) and moves accepted tree paths into place.
    pub(super) fn sample(
        &mut self,
        table: &mut RequestTable,
        out: &mut ModelRunnerOutput,
    ) -> Result<(), ForwardError> {
        let sample_start = Instant::now();
        // Prompt log-probabilities read every row of a request but its last one, the row that
        // sampling changes in place (penalties, bias), so gathering them all first is the same
        // as gathering request by request.
        let mut row = 0;
        let mut to_sample = Vec::with_capacity(self.step_rows.len());
        for i in 0..self.step_rows.len() {
            let StepRow { id, start, num_rows, samples, ref drafts, .. } = self.step_rows[i];
            let drafts = drafts.clone();
            if let Some(live) = table.get_mut(id) {
                gather_prompt_logprobs(&mut self.logits, live, start, row, num_rows);
            }
            row += num_rows;
            if samples {
                to_sample.push((id, row - 1 - drafts.len(), drafts));
            }
        }
        let mut sampled = self.sample_rows(table, &to_sample)?.into_iter();
        self.timing.sample = sample_start.elapsed();
        self.slot_copies.clear();
        let rows = mem::take(&mut self.step_rows);
        for &StepRow { id, start, samples, tree, .. } in &rows {
            if !samples {
                out.push(id, &[]);
                continue;
            }
            let Some((tokens, path)) = sampled.next().filter(|(t, _)| !t.is_empty()) else {
                return Err(ForwardError::Batch(format!(
                    "{id} was to be sampled but got no token"
                )));
            };
            let live = table.get_mut(id);
            if let Some(r) = live.as_ref().and_then(|l| l.view.as_ref()).filter(|_| tree) {
                path_moves(&path, start, &r.block_table, &self.batch, &mut self.slot_copies);
            }
            // The scheduler hands accepted tokens back in the next diff (`new_token_ids`).
            let ids: Vec<TokenId> = tokens.iter().map(|(t, _)| *t).collect();
            out.push(id, &ids);
            if let Some(live) = live
                && keep_extras(live, tokens)
            {
                self.with_extras.push(id);
            }
        }
        self.step_rows = rows;
        if !self.slot_copies.is_empty() {
            let model = self.model.as_deref_mut().expect(MODEL_IN_FLIGHT);
            model.copy_kv_slots(&self.slot_copies)?;
        }
        Ok(())
    }

    /// Samples each request of `rows` (increasing rows) from its first logit row on, with its
    /// sampler, verifying its drafts (module docs); the requests in parallel on the engine's
    /// host pool: each request's sampler owns its random state and touches only its own
    /// rows, so the tokens are those of sampling the requests one by one (a greedy row of a 262k
    /// vocabulary reads 1 MiB of logits, 64 of them 5 ms on one core).
    fn sample_rows(
        &mut self,
        table: &mut RequestTable,
        rows: &[SampleRow],
    ) -> Result<Vec<(SampledTokens, Vec<usize>)>, ForwardError> {
        let mut samplers = Vec::with_capacity(rows.len());
        for (id, _, _) in rows {
            let Some(sampler) = table.get_mut(*id).and_then(|r| r.sampler.take()) else {
                put_back(table, rows, samplers);
                return Err(ForwardError::Batch(format!("{id} has no sampler")));
            };
            samplers.push(sampler);
        }
        let vocab = self.logits.vocab_size();
        // Split the logits into each request's rows, in increasing row order.
        let mut rest = self.logits.as_mut_slice();
        let mut consumed = 0;
        let mut jobs: Vec<Mutex<SampleJob<'_>>> = Vec::with_capacity(rows.len());
        for ((_, first_row, drafts), sampler) in rows.iter().zip(samplers.iter_mut()) {
            let num_rows = drafts.len() + 1;
            let skip = (first_row - consumed) * vocab;
            let (mine, tail) = mem::take(&mut rest)[skip..].split_at_mut(num_rows * vocab);
            rest = tail;
            consumed = first_row + num_rows;
            jobs.push(Mutex::new(SampleJob {
                sampler,
                logits: mine,
                drafts: &self.step_drafts[drafts.clone()],
                parents: &self.step_parents[drafts.clone()],
                sampled: Vec::with_capacity(num_rows),
                path: Vec::new(),
            }));
        }
        self.host.run(jobs.len(), &|i| {
            let mut job = jobs[i].lock().unwrap_or_else(PoisonError::into_inner);
            let SampleJob { sampler, logits, drafts, parents, sampled, path } = &mut *job;
            sampler.verify(logits, drafts, parents, sampled, path);
        });
        let results = jobs
            .into_iter()
            .map(|job| {
                let job = job.into_inner().unwrap_or_else(PoisonError::into_inner);
                (job.sampled, job.path)
            })
            .collect();
        for sampler in &mut samplers {
            if let Some(stats) = sampler.take_constraint_stats() {
                self.constraint_stats += stats;
            }
        }
        put_back(table, rows, samplers);
        Ok(results)
    }
}

/// The KV slot copies that put an accepted tree path (`path`: node indices, root's child first)
/// of a request whose root sits at position `start` into the slots of its positions: node `n`
/// at depth `d + 1` moves from the slot of `start + 1 + n` to that of `start + 1 + d`. In path
/// order no copy overwrites a later one's source (nodes come after their parents: `n >= d`).
fn path_moves(
    path: &[usize],
    start: usize,
    table: &[u32],
    batch: &ForwardBatch,
    out: &mut Vec<(u32, u32)>,
) {
    let bs = batch.block_size();
    let slot = |p: usize| table[p / bs] * bs as u32 + (p % bs) as u32;
    for (d, &n) in path.iter().enumerate().filter(|&(d, &n)| n != d) {
        out.push((slot(start + 1 + n), slot(start + 1 + d)));
    }
}

/// Stores the log-probabilities of `live`'s prompt tokens `start + 1 ..` found in logit rows
/// `first_row .. first_row + num_rows` (positions `start ..`).
fn gather_prompt_logprobs(
    logits: &mut Logits,
    live: &mut LiveRequest,
    start: usize,
    first_row: usize,
    num_rows: usize,
) {
    let Some(state) = live.prompt_logprobs.as_mut() else { return };
    let Some(entries) = state.entries.as_mut() else { return };
    for i in 0..num_rows {
        let target = start + i + 1;
        if target >= state.prompt.len() {
            break;
        }
        let row = logits.row_mut(first_row + i);
        entries[target] = Some(logprobs(row, TokenId(state.prompt[target]), state.top_k));
    }
}

/// Keeps the log-probabilities of `live`'s generated tokens of this step (its prompt's with
/// the first) for the report; `true` if it kept any.
fn keep_extras(live: &mut LiveRequest, tokens: SampledTokens) -> bool {
    let mut prompt_logprobs = live.prompt_logprobs.as_mut().and_then(|s| s.entries.take());
    let mut kept = false;
    for (_, lp) in tokens {
        if lp.is_some() || prompt_logprobs.is_some() {
            let extras = SampleExtras { logprobs: lp, prompt_logprobs: prompt_logprobs.take() };
            live.extras.push_back(extras);
            kept = true;
        }
    }
    kept
}

/// Gives each of `rows`' requests its sampler back (in `rows` order).
fn put_back(table: &mut RequestTable, rows: &[SampleRow], samplers: Vec<Sampler>) {
    for ((id, _, _), sampler) in rows.iter().zip(samplers) {
        if let Some(r) = table.get_mut(*id) {
            r.sampler = Some(sampler);
        }
    }
}
