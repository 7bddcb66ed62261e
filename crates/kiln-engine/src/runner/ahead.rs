//! A step planned ahead (asynchronous scheduling with placeholders, the scheduler's
//! `schedule_ahead`): its batch is built while the step before computes, with
//! [`PLACEHOLDER_TOKEN`] where a decoding request's input is the token that step samples. Once
//! that step is sampled, each placeholder is replaced, in the batch and in the request's batch
//! view, by the request's sampled token, and the forward starts.
//!
//! Invariant: a batch never reaches the model with a placeholder in it. Every placeholder
//! belongs to a request the step before sampled (the scheduler places one only on a row that
//! samples, and asynchronous steps plan ahead only when no abort is pending); a placeholder
//! without its token fails the step instead.

use std::mem;

use kiln_core::{RequestId, TokenId};
use kiln_models::{ForwardBatch, ForwardError};
use kiln_sched::{ModelRunnerOutput, PLACEHOLDER_TOKEN, SchedulerOutput};

use super::{MODEL_IN_FLIGHT, ModelRunner, StepRow};
use crate::forward_thread::{ForwardJob, ForwardThread};
use crate::requests::RequestTable;

/// A step's batch built ahead, waiting for the tokens of the step in flight.
pub(crate) struct AheadBatch {
    batch: ForwardBatch,
    rows: Vec<StepRow>,
    /// `(token index in the batch, request, position in its tokens)` of each placeholder.
    placeholders: Vec<(usize, RequestId, usize)>,
}

impl ModelRunner {
    /// Builds the batch of `sched_out`, planned while the step launched last computes; that
    /// step's rows stay for its `complete`.
    pub(crate) fn prepare_ahead(
        &mut self,
        sched_out: &SchedulerOutput,
        table: &mut RequestTable,
    ) -> Result<(), ForwardError> {
        let in_flight_rows = mem::take(&mut self.step_rows);
        let built = self.prepare(sched_out, table);
        let rows = mem::replace(&mut self.step_rows, in_flight_rows);
        let block_size = self.batch.block_size();
        let batch = mem::replace(&mut self.batch, ForwardBatch::new(block_size));
        built?;
        let mut placeholders = Vec::new();
        for (row, seq) in rows.iter().zip(batch.seqs()) {
            let query = &batch.token_ids()[seq.query_start..seq.query_start + seq.query_len];
            for (j, _) in query.iter().enumerate().filter(|(_, t)| **t == PLACEHOLDER_TOKEN.0) {
                placeholders.push((seq.query_start + j, row.id, row.start + j));
            }
        }
        self.ahead = Some(AheadBatch { batch, rows, placeholders });
        Ok(())
    }

    /// Starts the forward of the step `prepare_ahead` built, its placeholders replaced by the
    /// tokens in `sampled` (the output of the step before). `false`: the step has no row (no
    /// job started).
    pub(crate) fn launch_ahead(
        &mut self,
        sampled: &ModelRunnerOutput,
        table: &mut RequestTable,
        thread: &ForwardThread,
    ) -> Result<bool, ForwardError> {
        let Some(AheadBatch { mut batch, rows, placeholders }) = self.ahead.take() else {
            return Err(ForwardError::Batch("no step was planned ahead".into()));
        };
        if !placeholders.is_empty() {
            self.sampled_by_id.clear();
            self.sampled_by_id.extend(sampled.iter().filter_map(|(id, t)| match t {
                [token] => Some((id, *token)),
                _ => None,
            }));
        }
        for (index, id, pos) in placeholders {
            let Some(&TokenId(token)) = self.sampled_by_id.get(&id) else {
                return Err(ForwardError::Batch(format!(
                    "{id}: its next step was planned on a token its step did not sample"
                )));
            };
            batch.set_token_id(index, token);
            let view = table.get_mut(id).and_then(|r| r.view.as_mut());
            if let Some(t) = view.and_then(|v| v.tokens.get_mut(pos)) {
                *t = token;
            }
        }
        self.step_rows = rows;
        if self.step_rows.is_empty() {
            self.batch = batch;
            return Ok(false);
        }
        let job = ForwardJob::new(
            self.model.take().expect(MODEL_IN_FLIGHT),
            batch,
            mem::take(&mut self.logits),
        );
        if let Err(job) = thread.launch(job) {
            let _never_ran = self.take_back(*job);
            return Err(ForwardError::Device("the forward thread has ended".into()));
        }
        Ok(true)
    }

    /// Drops a step built ahead that will not run (the step before failed).
    pub(crate) fn drop_ahead(&mut self) {
        self.ahead = None;
    }
}
