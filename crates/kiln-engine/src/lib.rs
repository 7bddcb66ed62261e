//! The engine: turns a model and sampling parameters into generated tokens.
//!
//! - [`Sampler`]: per-request token sampling with its own seeded [`Rng`].
//! - [`ModelRunner`]: builds each step's `ForwardBatch` from the scheduler's diff, runs the
//!   model, samples.
//! - [`EngineCore`]: scheduler + runner; `step()` = schedule → execute → update (→ propose
//!   drafts, with speculative decoding on); with asynchronous scheduling the forward runs on a
//!   second thread (`forward_thread`) while the engine reports the step before.
//! - [`spec`]: speculative decoding (config, prompt-lookup and draft-model proposers,
//!   acceptance counters).
//! - [`structured`]: structured outputs (JSON schema, regex, choice, grammar) as token masks.
//! - [`PreparedRequest`]: a request checked against the model (ids, compiled structured output)
//!   once, before the engine admits it.
//! - [`EngineHandle`]: the core on its own thread; `submit` returns a [`RequestStream`].
//! - [`prefix_store`]: the prefix cache saved to a file and restored at start.
//!
//! There is one driver: the server, the benchmarks and `kiln generate` (one request) all run
//! [`EngineCore`].

#[cfg(test)]
mod admission_tests;
mod engine;
mod forward_thread;
mod handle;
mod hooks;
mod host_pool;
pub mod kv_handoff;
pub mod kv_tier;
mod logprobs;
mod output;
mod pooling;
pub mod prefix_store;
mod prepared;
mod requests;
mod runner;
mod sampler;
pub mod slo;
pub mod spec;
pub mod structured;

pub use engine::{
    AdapterBinding, AdapterSet, AdapterStats, EngineConfig, EngineCore, EngineError, EngineStats,
    KvEventSink, MAX_ADAPTER_SLOT, ShutdownHook,
};
pub use handle::{EngineHandle, ExportReply, KvImport, KvPort, RequestStream, StreamItem};
pub use host_pool::HostPool;
pub use kiln_core::Rng;
pub use kiln_kv::PrefixCacheStats;
pub use kiln_kv::{BlockHash, KvCacheEvent};
pub use kiln_models::lora::LoraAdapter;
pub use kiln_models::{Classifier, PoolerConfig, PoolingType};
pub use kiln_models::{KvCacheDtype, LoraDtype, ModelConfig};
pub use kiln_sched::{
    AddError, ControllerStats, PreemptionMode, RequestOutput, SchedulerConfig, SchedulingPolicy,
    StepLimits, SwapStats,
};
pub use kv_handoff::{KvGeometry, KvHandoffError, KvHandoffStats, KvPin};
pub use kv_tier::{KvTierConfig, KvTierLocation};
pub use logprobs::{Logprobs, TokenLogprob, logprobs};
pub use output::{EngineOutput, FirstTokenInfo};
pub use pooling::{POOLED_TOKEN, PoolingParams};
pub use prepared::{CompiledOutput, PrepareError, PreparedRequest};
pub use requests::RequestTable;
pub use runner::{ModelRunner, PromptLogprobs, SampleExtras, StepTiming};
pub use sampler::Sampler;
pub use slo::{SloAdmission, SloClass, SloConfig};
pub use spec::{SpecDecodeStats, SpeculativeConfig, TokenTree};
