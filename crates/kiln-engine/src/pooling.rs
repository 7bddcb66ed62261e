//! Pooling requests (embeddings) on an engine built for a pooling model
//! ([`EngineConfig::pooling`](crate::EngineConfig::pooling)).
//!
//! A pooling request is scheduled as a prompt with one output token: its prompt is prefilled
//! in chunks like any other (continuous batching, the same token budget), every step's batch
//! asks the model for final hidden states instead of logits, and the runner adds each chunk's
//! rows to the request's [`PoolAccumulator`] instead of sampling. The step that computes the
//! prompt's last token finishes the vector and reports it with a placeholder token that no
//! one sees ([`POOLED_TOKEN`]); the scheduler then ends the request (its one output token
//! reached), so no decode step ever runs for it and its KV blocks are freed.
//!
//! Invariants: a request's vector depends only on its own tokens (rows are row-independent
//! and the mean sums them in position order, so batch, chunking and preemption by recompute
//! change no bit); mean and CLS pooling read every row, so a pooling engine with them keeps
//! no prefix cache (`EngineCore::new` refuses one).

use std::sync::Arc;

use kiln_core::TokenId;
use kiln_models::{Classifier, PoolAccumulator, PoolerConfig};

/// The token a pooling request "generates" when its vector is ready (never shown: the API
/// layer reads the vector).
pub const POOLED_TOKEN: TokenId = TokenId(0);

/// What a pooling request asks beyond its tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolingParams {
    /// Keep the first `dimensions` values (a Matryoshka model's shorter embedding), before
    /// normalising; `None`: all.
    pub dimensions: Option<usize>,
    /// Override the model's normalisation (`None`: the pooler's).
    pub normalize: Option<bool>,
}

impl PoolingParams {
    /// `Err` naming the parameter when the model cannot give what it asks.
    pub(crate) fn check(&self, hidden_size: usize) -> Result<(), String> {
        match self.dimensions {
            Some(d) if d == 0 || d > hidden_size => Err(format!(
                "dimensions: {d} is outside 1 to {hidden_size}, the model's embedding size"
            )),
            _ => Ok(()),
        }
    }
}

/// A pooling request's vector being gathered (kept in its `LiveRequest`).
#[derive(Clone, Debug)]
pub(crate) struct PoolState {
    pub(crate) acc: PoolAccumulator,
    normalize: bool,
    dimensions: Option<usize>,
    /// A classifier's head: the output is its scores of the pooled state.
    classifier: Option<Arc<Classifier>>,
    /// The finished vector, until it is reported.
    pub(crate) output: Option<Vec<f32>>,
}

impl PoolState {
    pub(crate) fn new(
        config: PoolerConfig,
        params: PoolingParams,
        hidden_size: usize,
        classifier: Option<Arc<Classifier>>,
    ) -> Self {
        Self {
            acc: PoolAccumulator::new(config.pooling, hidden_size),
            normalize: params.normalize.unwrap_or(config.normalize),
            dimensions: params.dimensions,
            classifier,
            output: None,
        }
    }

    /// Finishes the vector once the prompt's last row was added (a classifier's scores of
    /// it, with one).
    pub(crate) fn finish(&mut self) -> Result<(), String> {
        let vector = self.acc.finish(self.normalize, self.dimensions);
        let vector = vector.ok_or("no hidden row reached the pool")?;
        self.output = Some(match &self.classifier {
            Some(classifier) => classifier.scores(&vector),
            None => vector,
        });
        Ok(())
    }
}
