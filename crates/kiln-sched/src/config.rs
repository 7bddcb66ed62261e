//! Typed scheduler configuration, validated once before a [`crate::Scheduler`] is built.

use std::fmt;

/// The order in which requests get the step's token budget and, reversed, which running request
/// is preempted first. See [`crate::policy`] for the keys and the aging rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SchedulingPolicy {
    /// First come, first served by arrival.
    #[default]
    Fcfs,
    /// Lower `Request::priority` first (vLLM's convention), aged so nothing starves.
    Priority,
    /// Shortest estimated remaining work first, aged so nothing starves.
    Sjf,
    /// Earliest first-token deadline first ([`crate::Deadline`]); a request whose deadline
    /// passes while it waits is demoted once (its deadline pushed `slo_demotion_ms` past that
    /// moment), so late work does not make everyone else late.
    Deadline,
}

impl SchedulingPolicy {
    /// The CLI name (`--scheduling-policy`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fcfs => "fcfs",
            Self::Priority => "priority",
            Self::Sjf => "sjf",
            Self::Deadline => "deadline",
        }
    }
}

/// Scheduler limits and policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Token budget of one step (prefill chunks plus decode tokens).
    pub max_num_batched_tokens: usize,
    /// At most this many requests are running (hold KV blocks) at once.
    pub max_num_seqs: usize,
    /// Prompt plus output tokens of one request.
    pub max_model_len: usize,
    /// A prefill chunk is at most this many tokens; 0 = no cap beyond the budget.
    pub long_prefill_token_threshold: usize,
    /// At most this many requests end a step with their prefill still incomplete (>= 1).
    pub max_num_partial_prefills: usize,
    pub policy: SchedulingPolicy,
    /// Priority aging: every this many steps since `add`, a request's effective priority
    /// improves (decreases) by one (>= 1).
    pub priority_aging_steps: u64,
    /// SJF aging: every step since `add` subtracts this many tokens from a request's estimated
    /// remaining work (>= 1).
    pub sjf_aging_tokens_per_step: u64,
    /// Deadline policy: a waiting request whose first-token deadline has passed gets a new one
    /// this many milliseconds later (>= 1).
    pub slo_demotion_ms: u64,
    /// Passed to the KV cache manager (overrides the flag in its config).
    pub enable_prefix_caching: bool,
    /// Admit a prompt only whole, in one step (no chunked prefill, no prefill chunk cap): an
    /// encoder's tokens attend to every token of their sequence. The caller keeps
    /// `max_num_batched_tokens` at least the longest prompt it admits.
    pub whole_prompts: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: 4096,
            long_prefill_token_threshold: 0,
            max_num_partial_prefills: 1,
            policy: SchedulingPolicy::Fcfs,
            priority_aging_steps: 64,
            sjf_aging_tokens_per_step: 16,
            slo_demotion_ms: 60_000,
            enable_prefix_caching: true,
            whole_prompts: false,
        }
    }
}

/// A configuration value outside its domain; the message names the flag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid scheduler configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

impl SchedulerConfig {
    /// Checks every field, and that one request of `max_model_len` tokens fits in a KV cache of
    /// `num_blocks` blocks of `block_size` tokens (otherwise it could never finish).
    pub fn validate(&self, block_size: usize, num_blocks: usize) -> Result<(), ConfigError> {
        let positive = [
            ("max_num_batched_tokens", self.max_num_batched_tokens as u64),
            ("max_num_seqs", self.max_num_seqs as u64),
            ("max_model_len", self.max_model_len as u64),
            ("max_num_partial_prefills", self.max_num_partial_prefills as u64),
            ("priority_aging_steps", self.priority_aging_steps),
            ("sjf_aging_tokens_per_step", self.sjf_aging_tokens_per_step),
            ("slo_demotion_ms", self.slo_demotion_ms),
            ("block_size", block_size as u64),
            ("num_kv_blocks", num_blocks as u64),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(ConfigError(format!("`{name}` must be at least 1")));
            }
        }
        let capacity = block_size * num_blocks;
        if self.max_model_len > capacity {
            return Err(ConfigError(format!(
                "`max_model_len` ({}) exceeds the KV cache capacity ({num_blocks} blocks of \
                 {block_size} tokens = {capacity} tokens); lower it or give the cache more memory",
                self.max_model_len
            )));
        }
        Ok(())
    }
}
