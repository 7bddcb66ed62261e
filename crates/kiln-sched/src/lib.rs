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
//! ```
//! use kiln_core::{RequestId, SamplingParams, TokenId};
//! use kiln_kv::KvCacheConfig;
//! use kiln_sched::{ModelRunnerOutput, Request, Scheduler, SchedulerConfig};
//!
//! let kv = KvCacheConfig { block_size: 16, num_blocks: 512, enable_prefix_caching: true, extra_keys: vec![] };
//! let mut sched = Scheduler::new(SchedulerConfig::default(), kv)?;
//! let prompt = vec![TokenId(1), TokenId(2), TokenId(3)];
//! sched.add(Request::new(RequestId(7), prompt, SamplingParams::greedy(4)))?;
//! while sched.has_unfinished() {
//!     let out = sched.schedule();
//!     // the model runner computes `out` and samples one token per request that completed
//!     let sampled = out.scheduled().map(|(id, _)| (id, Some(TokenId(42)))).collect();
//!     for o in sched.update(&out, &ModelRunnerOutput { sampled }) {
//!         println!("{}: {} {:?}", o.id, o.new_token, o.finish_reason);
//!     }
//! }
//! assert_eq!(sched.kv_cache().usage(), 0.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
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
