//! Where the engine runs its host work in parallel: sampling a step's rows (each request with
//! its own sampler) and a draft model's draws. The program that builds the engine chooses it
//! ([`crate::EngineConfig::host_pool`]): the CPU backend's thread pool (the kernels' threads,
//! idle between forwards), [`kiln_models::HostThreads`] next to a GPU, or the default
//! [`HostPool::serial`]. Results never depend on it: each task touches only its own request.

use std::sync::Arc;

use kiln_models::{HostParallel, Serial};

/// A shared [`HostParallel`] (module docs).
#[derive(Clone)]
pub struct HostPool(Arc<dyn HostParallel>);

impl HostPool {
    pub fn new(pool: Arc<dyn HostParallel>) -> Self {
        Self(pool)
    }

    /// Every task on the engine thread, in order.
    pub fn serial() -> Self {
        Self(Arc::new(Serial))
    }

    /// Runs `task(i)` for every `i` in `0..num_tasks`.
    pub(crate) fn run(&self, num_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        self.0.host_parallel(num_tasks, task);
    }
}

impl Default for HostPool {
    fn default() -> Self {
        Self::serial()
    }
}

impl std::fmt::Debug for HostPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostPool")
    }
}
