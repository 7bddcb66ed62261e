//! Continuous-batching scheduler of kiln, after vLLM v1: no prefill and decode phases, one token
//! budget per step. Each request has `num_computed_tokens` and `num_tokens` (prompt + output);
//! every step running requests advance first (decodes and continuing prefill chunks), then
//! waiting ones are admitted while the budget, `max_num_seqs`, `max_num_partial_prefills` and
//! free KV blocks allow. Chunked prefill, prefix-cache hits, preemption (by recompute, or by
//! swap to a second tier, [`swap`]) and speculative tokens fall out of that one loop.
//!
//! A step may give a request several tokens: draft tokens set with
//! [`Scheduler::update_draft_token_ids`] are scheduled after its last token (in the budget,
//! with lookahead KV slots), and the runner returns the accepted drafts plus one token;
//! `update` rolls the rejected ones back.
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
//! let id = RequestId(7);
//! sched.add(Request::new(id, prompt, SamplingParams::greedy(6)))?;
//! while sched.has_unfinished() {
//!     let out = sched.schedule();
//!     // The model runner computes `out` and returns the tokens each request generated: here
//!     // every draft is accepted, plus one more token (a partial prefill chunk would get none).
//!     let model_output: ModelRunnerOutput = out
//!         .new_requests
//!         .iter()
//!         .map(|n| (n.id, vec![TokenId(42)]))
//!         .chain(out.cached_requests.iter().map(|c| {
//!             (c.id, [c.spec_token_ids.as_slice(), &[TokenId(42)]].concat())
//!         }))
//!         .collect();
//!     for o in sched.update(&out, &model_output) {
//!         println!("{}: {} {:?}", o.id, o.new_token, o.finish_reason);
//!     }
//!     // A proposer drafts the next tokens of the decoding request.
//!     sched.update_draft_token_ids(id, &[TokenId(43), TokenId(44)]);
//! }
//! assert_eq!(sched.kv_cache().usage(), 0.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Modules: `config` (typed limits, validation), `request` (per-request state and deadlines),
//! `policy` (ordering keys and aging, earliest deadline first), `output` (the step diff, its
//! load and runner results), `scheduler` (the loop, limits settable at run time),
//! `controller` (adaptive batch control from a step-cost model fitted online), `swap` (the
//! second KV tier's slots and the swap-or-recompute rule), `spill` (prefix-cache blocks kept in
//! the tier after the KV cache evicts them).

mod config;
pub mod controller;
mod output;
pub mod policy;
mod request;
mod scheduler;
pub mod spill;
pub mod swap;

pub use config::{ConfigError, SchedulerConfig, SchedulingPolicy};
pub use controller::{BatchController, ControllerConfig, ControllerStats, QueueAhead};
pub use output::{
    CachedRequestData, ModelRunnerOutput, NewRequestData, RequestOutput, SchedulerOutput, StepLoad,
};
pub use request::{AddError, Deadline, Request, RequestStatus};
pub use scheduler::{PLACEHOLDER_TOKEN, Scheduler, SchedulerStats, StepLimits};
pub use swap::{BlockCopy, PreemptionMode, SwapConfig, SwapStats};
