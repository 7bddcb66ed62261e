//! A saved prefix cache (`kiln-engine`'s `prefix_store`): the cached chains to write out, and
//! their blocks registered again in a fresh manager. Only chains of cache key 0 are saved: a
//! key names a LoRA binding, which does not outlive the process.

use std::collections::HashMap;

use kiln_core::{BlockId, TokenId};

use super::KvCacheManager;

impl KvCacheManager {
    /// Every cached block of cache key 0 still reachable by a chain of hits, with the position
    /// of its parent in the returned list (`None`: the first block of a sequence); parents come
    /// before their children. What a saved prefix cache holds (keys name bindings that do not
    /// outlive the process).
    pub fn cached_chains(&self) -> Vec<(BlockId, Option<usize>)> {
        // Depth of each reachable cached block (0: no parent); unreachable ones are absent.
        let mut depth: HashMap<BlockId, usize> = HashMap::new();
        for start in self.pool.cached_blocks().filter(|&b| self.pool.cached_key(b) == Some(0)) {
            // Walk up to a block of known depth (or a root, or a broken link), then fill in.
            let mut path = vec![start];
            let mut base = None;
            loop {
                let b = *path.last().expect("non-empty");
                if let Some(&d) = depth.get(&b) {
                    path.pop();
                    base = Some(d + 1);
                    break;
                }
                match self.pool.cached_parent(b) {
                    Some(Some(parent)) => path.push(parent),
                    Some(None) => {
                        base = Some(0);
                        break;
                    }
                    None => break,
                }
            }
            let Some(mut d) = base else { continue };
            // `path` runs from `start` down to the block of depth `d`.
            for &b in path.iter().rev() {
                depth.insert(b, d);
                d += 1;
            }
        }
        let mut order: Vec<(usize, BlockId)> = depth.iter().map(|(&b, &d)| (d, b)).collect();
        order.sort_unstable();
        let position: HashMap<BlockId, usize> =
            order.iter().enumerate().map(|(i, &(_, b))| (b, i)).collect();
        order
            .iter()
            .map(|&(_, b)| {
                let parent = self.pool.cached_parent(b).flatten().map(|p| position[&p]);
                (b, parent)
            })
            .collect()
    }

    /// Restoring a saved prefix cache (see [`KvCacheManager::cached_chains`]) into a manager
    /// with no requests: registers a block holding `tokens` after `parent` (a block this call
    /// returned before; `None` for the first block of a sequence) and returns it, referenced,
    /// for the caller to fill with the saved KV before any request runs. `None`, changing
    /// nothing, when prefix caching is off, a request holds blocks, no uncached block is free,
    /// or the block cannot be registered (its hash is taken). End with
    /// [`KvCacheManager::finish_restore`] over every block returned.
    pub fn restore_block(
        &mut self,
        parent: Option<BlockId>,
        tokens: &[TokenId],
    ) -> Option<BlockId> {
        if !self.enable_prefix_caching || !self.requests.is_empty() {
            return None;
        }
        let parent_ref = match parent {
            Some(p) => Some(self.pool.cached_ref(p)?),
            None => None,
        };
        let parent_hash = parent.and_then(|p| self.pool.block_hash(p));
        let hash = self.hash(parent_hash, 0, tokens);
        if self.pool.get_cached(hash, parent, 0, tokens).is_some() {
            return None;
        }
        // Never evict: only an uncached free block (they sit at the head of the queue) is taken.
        let head = self.pool.free_blocks().next()?;
        if self.pool.block_hash(head).is_some() {
            return None;
        }
        let block = self.pool.allocate(1)?[0];
        match self.pool.cache_block(block, hash, parent_ref, 0, tokens) {
            Some(r) if self.pool.cached_ref(block) == Some(r) => Some(block),
            _ => {
                self.pool.free([block]);
                None
            }
        }
    }

    /// Releases the blocks [`KvCacheManager::restore_block`] returned, last first, so that a
    /// chain's tail is evicted before its head; they stay cached and free.
    pub fn finish_restore(&mut self, blocks: &[BlockId]) {
        self.pool.free(blocks.iter().rev().copied());
    }
}
