//! Blocks held outside any request, for prefill/decode disaggregation (`kiln-engine`'s
//! `kv_handoff`): a prefill worker holds a finished prompt's cached blocks until a decode worker
//! has fetched them, and a decode worker registers the blocks it fetched as cached blocks of
//! its own, held while their KV is written.
//!
//! Invariants:
//! - a hold is one pool reference, counted per block in `held`, so a held block is never free
//!   and never evicted; [`KvCacheManager::check_invariants`] counts holds with the requests'
//!   tables;
//! - only blocks of cache key 0 (the base model's) are held or imported;
//! - an import registers a block only after the chain of verified cached blocks before it, and
//!   the caller writes the KV of every block it registered before anything else runs (the
//!   engine does both in one command between steps), so a hit never reads unwritten KV.

use kiln_core::{BlockId, TokenId};

use super::KvCacheManager;

/// What [`KvCacheManager::import_prefix`] did: the blocks it holds and those whose KV the
/// caller must write.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportedChain {
    /// Every block held by the import, in chain order: the cached prefix, then the imported
    /// blocks. Release them with [`KvCacheManager::release_held`] once written.
    pub held: Vec<BlockId>,
    /// `(block index in the prompt, block)` for each block registered now, in order: the
    /// caller writes the KV of prompt block `index` into `block`.
    pub to_write: Vec<(usize, BlockId)>,
}

impl KvCacheManager {
    /// The verified cached blocks of key 0 prefixing `tokens` (as
    /// [`KvCacheManager::lookup_prefix`] finds them: at least one token is left to compute),
    /// each held until [`KvCacheManager::release_held`].
    pub fn hold_prefix(&mut self, tokens: &[TokenId]) -> Vec<BlockId> {
        let (blocks, _) = self.find_cached(tokens, 0, usize::MAX);
        self.hold(&blocks);
        blocks
    }

    /// Releases one hold on each of `blocks`, last first (a chain's tail becomes evictable
    /// before its head). Panics on a block that is not held (a caller's bookkeeping error).
    pub fn release_held(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let n = self.held.get_mut(&b).unwrap_or_else(|| panic!("{b:?} is not held"));
            *n -= 1;
            if *n == 0 {
                self.held.remove(&b);
            }
            self.pool.free([b]);
        }
    }

    /// Blocks held outside requests, counted once per hold.
    pub fn num_held(&self) -> usize {
        self.held.values().map(|&n| n as usize).sum()
    }

    fn hold(&mut self, blocks: &[BlockId]) {
        self.pool.touch(blocks);
        for &b in blocks {
            *self.held.entry(b).or_default() += 1;
        }
    }

    /// Registers up to `count` full blocks of `tokens` as cached blocks of key 0, from prompt
    /// block `first` on, after the verified cached chain of its first `first` blocks; the
    /// caller writes the KV of [`ImportedChain::to_write`] and then releases
    /// [`ImportedChain::held`]. A block already cached is held, not registered again. Stops
    /// early (what was done stays valid) when the prefix chain is no longer cached (nothing is
    /// imported), at the last full block before the prompt's last token (which is always
    /// computed), when no block is free, or when a hash is taken by other content. Nothing
    /// happens with prefix caching off.
    pub fn import_prefix(
        &mut self,
        tokens: &[TokenId],
        first: usize,
        count: usize,
    ) -> ImportedChain {
        let mut chain = ImportedChain::default();
        if !self.enable_prefix_caching || tokens.is_empty() {
            return chain;
        }
        let (prefix, mut hashes) = self.find_cached(tokens, 0, first);
        if prefix.len() != first {
            return chain;
        }
        self.hold(&prefix);
        chain.held = prefix;
        let bs = self.block_size();
        let num_full = (tokens.len() - 1) / bs;
        for i in first..num_full.min(first.saturating_add(count)) {
            let chunk = &tokens[i * bs..(i + 1) * bs];
            let parent = chain.held.last().copied();
            let hash = self.hash(hashes.last().copied(), 0, chunk);
            if let Some(cached) = self.pool.get_cached(hash, parent, 0, chunk) {
                self.hold(&[cached]);
                chain.held.push(cached);
                hashes.push(hash);
                continue;
            }
            let parent_ref = match parent {
                Some(p) => self.pool.cached_ref(p),
                None => None,
            };
            if parent.is_some() && parent_ref.is_none() {
                break;
            }
            let Some(block) = self.pool.allocate(1).map(|b| b[0]) else { break };
            match self.pool.cache_block(block, hash, parent_ref, 0, chunk) {
                Some(r) if r.block() == block => {
                    *self.held.entry(block).or_default() += 1;
                    chain.held.push(block);
                    chain.to_write.push((i, block));
                    hashes.push(hash);
                }
                _ => {
                    self.pool.free([block]);
                    break;
                }
            }
        }
        chain
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::KvCacheConfig;
    use kiln_core::RequestId;

    fn manager(num_blocks: usize) -> KvCacheManager {
        KvCacheManager::new(KvCacheConfig {
            block_size: 4,
            num_blocks,
            enable_prefix_caching: true,
            extra_keys: Vec::new(),
        })
    }

    fn toks(n: u32) -> Vec<TokenId> {
        (0..n).map(|t| TokenId(100 + t)).collect()
    }

    /// Runs a request over `tokens` to the end, leaving its full blocks cached and free.
    fn compute(m: &mut KvCacheManager, id: u64, tokens: &[TokenId]) {
        m.allocate_slots(RequestId(id), tokens, 0, tokens.len(), 0).unwrap();
        m.free(RequestId(id));
    }

    #[test]
    fn held_blocks_survive_eviction_and_count_in_the_invariants() {
        let mut m = manager(4);
        let prompt = toks(13);
        compute(&mut m, 0, &prompt);
        let held = m.hold_prefix(&prompt);
        assert_eq!(held.len(), 3);
        assert_eq!(m.num_held(), 3);
        m.check_invariants().unwrap();
        // Only one block is free: a request wanting two is refused, the held ones stay cached.
        assert!(m.allocate_slots(RequestId(1), &toks(8), 0, 8, 0).is_none());
        assert_eq!(m.lookup_prefix(&prompt).blocks, held);
        m.release_held(&held);
        assert_eq!(m.num_held(), 0);
        assert_eq!(m.num_free_blocks(), 4);
        m.check_invariants().unwrap();
    }

    #[test]
    fn an_import_registers_blocks_a_lookup_then_hits() {
        let prompt = toks(14); // three full blocks before the last token
        let mut m = manager(8);
        let chain = m.import_prefix(&prompt, 0, 10);
        assert_eq!(chain.to_write.iter().map(|&(i, _)| i).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(chain.held.len(), 3);
        m.check_invariants().unwrap();
        m.release_held(&chain.held);
        let hit = m.lookup_prefix(&prompt);
        assert_eq!(hit.blocks, chain.held);
        // The same hashes as blocks computed here: a second manager computing the prompt
        // caches under the same chain.
        let mut computed = manager(8);
        compute(&mut computed, 0, &prompt);
        let ours = computed.lookup_prefix(&prompt).blocks;
        let hashes = |m: &KvCacheManager, b: &[BlockId]| {
            b.iter().map(|&b| m.pool().block_hash(b)).collect::<Vec<_>>()
        };
        assert_eq!(hashes(&m, &hit.blocks), hashes(&computed, &ours));
        m.check_invariants().unwrap();
    }

    #[test]
    fn an_import_after_a_cached_prefix_writes_only_the_rest() {
        let prompt = toks(17);
        let mut m = manager(8);
        compute(&mut m, 0, &prompt[..9]); // two blocks cached
        let chain = m.import_prefix(&prompt, 2, 10);
        assert_eq!(chain.to_write.iter().map(|&(i, _)| i).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(chain.held.len(), 4);
        m.release_held(&chain.held);
        assert_eq!(m.lookup_prefix(&prompt).num_cached_tokens, 16);
        // A prefix that is not cached (asked from block 1 of an unknown prompt): nothing.
        let other: Vec<TokenId> = (0..12).map(|t| TokenId(900 + t)).collect();
        assert_eq!(m.import_prefix(&other, 1, 5), ImportedChain::default());
        m.check_invariants().unwrap();
    }

    #[test]
    fn an_import_stops_when_no_block_is_free() {
        let prompt = toks(40);
        let mut m = manager(3);
        let chain = m.import_prefix(&prompt, 0, 9);
        assert_eq!(chain.to_write.len(), 3);
        m.release_held(&chain.held);
        m.check_invariants().unwrap();
        let mut off = KvCacheManager::new(KvCacheConfig {
            block_size: 4,
            num_blocks: 4,
            enable_prefix_caching: false,
            extra_keys: Vec::new(),
        });
        assert_eq!(off.import_prefix(&prompt, 0, 3), ImportedChain::default());
    }
}
