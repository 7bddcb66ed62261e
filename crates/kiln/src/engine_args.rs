//! Engine flags shared by `kiln serve` and `kiln bench throughput`: kernel threads and the
//! scheduler's limits and policy (vLLM's flag names).

use kiln_engine::{SchedulerConfig, SchedulingPolicy};

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Policy {
    Fcfs,
    Priority,
    Sjf,
}

#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    /// Kernel threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one engine step (prefill chunks and decodes).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Prompts longer than this are prefilled in chunks of at most this many tokens (0 = no limit).
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: usize,
    /// Most prompts being prefilled in chunks at once.
    #[arg(long, default_value_t = 1)]
    pub max_num_partial_prefills: usize,
    /// Who runs first: arrival order, the request's `priority` (lower first), or shortest
    /// remaining work; the last two age so nothing starves.
    #[arg(long, value_enum, default_value = "fcfs")]
    pub scheduling_policy: Policy,
}

impl EngineArgs {
    pub fn scheduler_config(&self, enable_prefix_caching: bool) -> SchedulerConfig {
        SchedulerConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            long_prefill_token_threshold: self.long_prefill_token_threshold,
            max_num_partial_prefills: self.max_num_partial_prefills,
            policy: match self.scheduling_policy {
                Policy::Fcfs => SchedulingPolicy::Fcfs,
                Policy::Priority => SchedulingPolicy::Priority,
                Policy::Sjf => SchedulingPolicy::Sjf,
            },
            enable_prefix_caching,
            ..SchedulerConfig::default()
        }
    }
}
