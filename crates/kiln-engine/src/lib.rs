//! The engine: turns a model and sampling parameters into generated tokens.
//!
//! Today it holds the per-request [`Sampler`] and a [`Generator`] that runs a set of sequences
//! to completion over a paged KV cache (prefill in chunks, then batched decode). The scheduler
//! with continuous batching and prefix caching builds on the same `ForwardBatch` / KV layout.

mod generator;
mod rng;
mod sampler;

pub use generator::{
    GenerateError, GenerationOutput, Generator, GeneratorConfig, RunStats, StepEvent,
};
pub use rng::Rng;
pub use sampler::Sampler;
