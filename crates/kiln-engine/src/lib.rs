//! The engine: turns a model and sampling parameters into generated tokens.
//!
//! - [`Sampler`]: per-request token sampling with its own seeded [`Rng`].
//! - [`ModelRunner`]: builds each step's `ForwardBatch` from the scheduler's diff, runs the
//!   model, samples.
//! - [`EngineCore`]: scheduler + runner + thread pool; `step()` = schedule → execute → update.
//! - [`EngineHandle`]: the core on its own thread; `submit` returns a [`RequestStream`].
//! - [`Generator`]: the simplest driver (a fixed set of sequences run to completion, no
//!   scheduler), used by `kiln generate`.

mod engine;
mod generator;
mod handle;
mod logprobs;
mod output;
mod runner;
mod sampler;

pub use engine::{EngineConfig, EngineCore, EngineError, EngineStats};
pub use generator::{
    GenerateError, GenerationOutput, Generator, GeneratorConfig, RunStats, StepEvent,
};
pub use handle::{EngineHandle, RequestStream, StreamItem};
pub use kiln_core::Rng;
pub use kiln_models::KvCacheDtype;
pub use kiln_sched::{RequestOutput, SchedulerConfig, SchedulingPolicy};
pub use logprobs::{Logprobs, TokenLogprob, logprobs};
pub use output::{EngineOutput, FirstTokenInfo};
pub use runner::{ModelRunner, PromptLogprobs, SampleExtras};
pub use sampler::Sampler;
