//! Continuous-batching scheduler of kiln, after vLLM v1: no prefill and decode phases, one token
//! budget per step. Each request has `num_computed_tokens` and `num_tokens` (prompt + output);
//! every step running requests advance first (decodes and continuing prefill chunks), then
//! waiting ones are admitted while the budget, `max_num_seqs`, `max_num_partial_prefills` and
//! free KV blocks allow. Chunked prefill, prefix-cache hits and preemption by recompute fall out
//! of that one loop.
//!
//! Pure and deterministic: no threads, clocks, I/O or tensors. The engine drives it:
//! `schedule()` → run the model on the [`SchedulerOutput`] → `update(&output, &model_output)`.
//!
//! Modules: `config` (typed limits, validation), `request` (per-request state), `policy`
//! (ordering keys and aging), `output` (the step diff and runner results), `scheduler` (the
//! loop).

mod config;
mod output;
pub mod policy;
mod request;
mod scheduler;

pub use config::{ConfigError, SchedulerConfig, SchedulingPolicy};
pub use output::{
    CachedRequestData, ModelRunnerOutput, NewRequestData, RequestOutput, SchedulerOutput,
};
pub use request::{AddError, Request, RequestStatus};
pub use scheduler::{Scheduler, SchedulerStats};
