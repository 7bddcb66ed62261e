//! The runner's pooling (a pooling model's steps, `pooling.rs`): each scheduled request's
//! hidden rows added to its pool in position order; a request whose prompt ends in this step
//! gets its vector and reports [`POOLED_TOKEN`].

use kiln_models::ForwardError;
use kiln_sched::ModelRunnerOutput;

use super::{ModelRunner, StepRow};
use crate::POOLED_TOKEN;
use crate::requests::RequestTable;

impl ModelRunner {
    /// Pools the rows of the forward that just ran into each request's vector; one entry per
    /// scheduled request in `out`.
    pub(super) fn pool(
        &mut self,
        table: &mut RequestTable,
        out: &mut ModelRunnerOutput,
    ) -> Result<(), ForwardError> {
        let width = self.hidden_size;
        if self.logits.vocab_size() != width && self.logits.num_rows() > 0 {
            return Err(ForwardError::Batch(format!(
                "a pooling step gave rows of {} values, not the hidden size {width}",
                self.logits.vocab_size()
            )));
        }
        let mut row = 0;
        for &StepRow { id, start, num_rows, num_tokens, samples, .. } in &self.step_rows {
            let rows = row..row + num_rows;
            row += num_rows;
            // A request removed meanwhile (asynchronous steps) gets nothing.
            let Some(pool) = table.get_mut(id).and_then(|l| l.pool.as_mut()) else {
                out.push(id, &[]);
                continue;
            };
            let flat = &self.logits.as_slice()[rows.start * width..rows.end * width];
            let first_position = start + num_tokens - num_rows;
            let failed = |why: String| ForwardError::Batch(format!("{id}: {why}"));
            pool.acc.add(first_position, flat).map_err(failed)?;
            if samples {
                pool.finish().map_err(failed)?;
                out.push(id, &[POOLED_TOKEN]);
            } else {
                out.push(id, &[]);
            }
        }
        Ok(())
    }
}
