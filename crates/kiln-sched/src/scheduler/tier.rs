//! The scheduler's side of the second KV tier ([`crate::swap`], [`crate::spill`]): setting it
//! up, its measured rates, turning it off after a failed copy, spilling what allocation evicted,
//! and finding spilled blocks that continue a prefix-cache hit. Preemption by swap and the
//! swap-ins of admissions stay in the scheduling loop (`scheduler.rs`), where they happen.

use kiln_core::{BlockId, TokenId};

use super::Scheduler;
use crate::spill::{ChainEnd, SpillParent};
use crate::swap::{BlockCopy, SwapConfig, SwapSpace};

impl Scheduler {
    /// Gives the scheduler a second KV tier of `config.num_slots` blocks for preemption by swap
    /// and, with prefix caching, for the cached blocks the KV cache evicts (replacing any
    /// earlier tier); only while no request is known.
    ///
    /// # Panics
    /// If requests are queued or running (their slots would be lost).
    pub fn set_swap_space(&mut self, config: SwapConfig) {
        assert!(self.requests.is_empty(), "the tier changes only while the scheduler is idle");
        let spill = config.num_slots > 0 && self.kv.prefix_caching();
        self.kv.set_log_evictions(spill);
        self.swap = (config.num_slots > 0).then(|| SwapSpace::new(config, spill));
    }

    /// Turns the second tier off after copies to or from it failed: blocks whose copy in never
    /// happened (`unwritten`, still held by their requests) leave the prefix cache, requests
    /// preempted by swap will recompute, spilled blocks are forgotten, and preemption recomputes
    /// from now on. The requests of the failed step must be aborted by the caller (their KV is
    /// not what the scheduler believes).
    pub fn disable_swap_space(&mut self, unwritten: &[BlockId]) {
        for &block in unwritten {
            self.kv.uncache_held(block);
        }
        self.kv.set_log_evictions(false);
        for id in &self.waiting {
            if let Some(req) = self.requests.get_mut(id) {
                req.swapped = None;
            }
        }
        self.swap = None;
    }

    /// Updates the swap-or-recompute rates with measurements (bytes per second one copy
    /// direction moves, seconds per prefill token); `None`, non-positive and non-finite values
    /// keep the previous rate.
    pub fn set_swap_rates(
        &mut self,
        tier_bytes_per_sec: Option<f64>,
        prefill_secs_per_token: Option<f64>,
    ) {
        if let Some(space) = &mut self.swap {
            space.set_rates(tier_bytes_per_sec, prefill_secs_per_token);
        }
    }

    /// Copies the cached blocks of cache key 0 that allocation evicted since the last call to
    /// the tier (a keyed block's binding may not outlive it).
    pub(super) fn spill_evicted(&mut self, swap_out: &mut Vec<BlockCopy>) {
        if let Some(space) = &mut self.swap {
            let mut evicted = self.kv.take_evicted();
            evicted.retain(|e| e.key == 0);
            space.spill(evicted, swap_out);
        }
    }

    /// Spilled blocks continuing the prefix-cache hit `device_blocks` of `tokens` (full blocks
    /// of all but the last token, as a lookup covers).
    pub(super) fn tier_hit(&self, tokens: &[TokenId], device_blocks: &[BlockId]) -> Vec<usize> {
        let Some(space) = &self.swap else { return Vec::new() };
        let pool = self.kv.pool();
        let end = match device_blocks.last() {
            None => ChainEnd { hash: None, parent: SpillParent::Root },
            Some(&b) => match (pool.block_hash(b), pool.cached_ref(b)) {
                (Some(hash), Some(r)) => {
                    ChainEnd { hash: Some(hash), parent: SpillParent::Device(r) }
                }
                _ => return Vec::new(),
            },
        };
        let bs = self.kv.block_size();
        let chunks = tokens[..tokens.len() - 1].chunks_exact(bs).skip(device_blocks.len());
        space.lookup(end, chunks, |parent, chunk| self.kv.block_hash_of(parent, chunk))
    }
}
