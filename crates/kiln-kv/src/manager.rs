//! Per-request KV block tables on top of the [`BlockPool`], with prefix caching.
//!
//! A request's block table maps token position `p` to slot
//! `block_table[p / block_size] * block_size + p % block_size`. The manager never sees KV
//! memory; it decides which blocks hold which positions.
//!
//! Contract with the caller (the scheduler):
//! - **Admission.** [`KvCacheManager::lookup_prefix`] reports the longest verified chain of cached
//!   full blocks (never the whole sequence: at least one token is left to compute, so the cap
//!   is `(len - 1) / block_size` blocks). The first [`KvCacheManager::allocate_slots`] for a
//!   request takes `num_computed_tokens` from that hit: it must be a multiple of the block size
//!   and at most the hit found by a lookup made with no other allocation in between (the hit is
//!   re-derived and pinned; a larger value panics). Passing 0 ignores the cache.
//! - **Growth.** Later calls pass the request's current `num_computed_tokens`; the manager adds
//!   blocks so `num_computed + num_new + num_lookahead` tokens have slots. `None` means not
//!   enough free blocks and nothing changed (the scheduler preempts or waits).
//! - **Caching.** After a successful call, every full block within `num_computed + num_new`
//!   tokens is hashed and registered, so later requests can hit it. The registration happens
//!   before the step runs: the engine must write a step's KV for all requests before any
//!   attention of that step reads it. Lookahead (speculative) slots are never cached.
//! - **Free.** [`KvCacheManager::free`] (finish, abort, preempt) drops the request's references,
//!   tail block first, so its tail is evicted before its head; cached blocks stay hittable.
//!   When the KV of the last allocation was *not* written (the request is preempted in the same
//!   schedule pass that allocated for it, or the step failed), use
//!   [`KvCacheManager::free_with_computed`] with the tokens really computed: it unregisters the
//!   blocks beyond them first. No other request may have hit those blocks in between (vLLM's
//!   rule: no admissions in a pass that preempts).
//! - **Keys.** A request whose KV depends on more than its tokens (a LoRA adapter) gets a
//!   non-zero cache key before its first allocation ([`KvCacheManager::set_cache_key`]): its
//!   blocks are hashed from its key's chain root and registered under the key, so only requests
//!   of the same key hit them ([`KvCacheManager::lookup_prefix_keyed`]).
//! - **Fork.** [`KvCacheManager::fork`] gives a child the parent's fully computed blocks by
//!   reference (no copy on write is needed because shared blocks are full and never written
//!   again). The child starts at `num_computed_tokens = shared blocks * block_size`: the tokens of
//!   the parent's partial last block must be recomputed (or copied by the engine) into the
//!   child's own new blocks.
//!
//! Invariants ([`KvCacheManager::check_invariants`]): the pool's own (see `block_pool`); each
//! block's ref count equals the number of request tables containing it; no table holds a block
//! twice; a cached block at position `i` of a table is registered under that request's `i`-th
//! chain hash, and under its key.

use std::collections::HashMap;

use kiln_core::{BlockId, RequestId, TokenId};

use crate::block_pool::{BlockPool, CachedBlockRef};
use crate::hash::{BlockHash, BlockHashFn, chain_root, hash_block};

mod held;
mod saved;

pub use held::ImportedChain;

/// Sizes and switches of one KV cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Tokens per block.
    pub block_size: usize,
    pub num_blocks: usize,
    pub enable_prefix_caching: bool,
    /// Mixed into every block hash: anything that changes KV content for the same tokens
    /// (KV dtype tag, model revision).
    pub extra_keys: Vec<u64>,
}

/// A verified prefix-cache hit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// `blocks.len() * block_size`.
    pub num_cached_tokens: usize,
    /// The cached blocks in sequence order.
    pub blocks: Vec<BlockId>,
}

/// Prefix-cache counters, accumulated at each request's first allocation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub num_requests: u64,
    /// Tokens known at admission, summed.
    pub num_queried_tokens: u64,
    /// Tokens taken from the cache, summed.
    pub num_hit_tokens: u64,
}

impl PrefixCacheStats {
    /// Hit tokens over queried tokens (0 when nothing was queried).
    pub fn hit_rate(&self) -> f64 {
        if self.num_queried_tokens == 0 {
            0.0
        } else {
            self.num_hit_tokens as f64 / self.num_queried_tokens as f64
        }
    }
}

#[derive(Clone, Debug, Default)]
struct RequestBlocks {
    blocks: Vec<BlockId>,
    /// Chain hashes of the request's first full blocks, computed lazily.
    block_hashes: Vec<BlockHash>,
    /// Blocks `[0, num_cached_blocks)` have been offered to the prefix cache.
    num_cached_blocks: usize,
    /// The cached block holding the KV of block `num_cached_blocks - 1` (this request's own or
    /// a duplicate's); `None` when there is none, and then no later block can be cached.
    last_cached: Option<CachedBlockRef>,
}

/// Block tables of all running requests over one block pool.
#[derive(Clone, Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    enable_prefix_caching: bool,
    extra_keys: Vec<u64>,
    hash_fn: BlockHashFn,
    requests: HashMap<RequestId, RequestBlocks>,
    /// The non-zero cache keys of requests ([`KvCacheManager::set_cache_key`]).
    keys: HashMap<RequestId, u64>,
    /// References held outside any request, per block (`manager/held.rs`).
    held: HashMap<BlockId, u32>,
    stats: PrefixCacheStats,
}

impl KvCacheManager {
    pub fn new(config: KvCacheConfig) -> Self {
        Self::with_hash_fn(config, hash_block)
    }

    /// Like [`KvCacheManager::new`] with another block hash function (tests force collisions).
    pub fn with_hash_fn(config: KvCacheConfig, hash_fn: BlockHashFn) -> Self {
        Self {
            pool: BlockPool::new(config.num_blocks, config.block_size),
            enable_prefix_caching: config.enable_prefix_caching,
            extra_keys: config.extra_keys,
            hash_fn,
            requests: HashMap::new(),
            keys: HashMap::new(),
            held: HashMap::new(),
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    /// Fraction of blocks referenced by requests (free cached blocks count as free).
    pub fn usage(&self) -> f32 {
        match self.pool.num_blocks() {
            0 => 0.0,
            n => 1.0 - self.pool.num_free_blocks() as f32 / n as f32,
        }
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Read access to the pool (ref counts, cached tokens, free order) for tests and metrics.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Whether the request holds a block table.
    pub fn contains(&self, req: RequestId) -> bool {
        self.requests.contains_key(&req)
    }

    /// The request's blocks in position order (empty if it holds none).
    pub fn block_table(&self, req: RequestId) -> &[BlockId] {
        self.requests.get(&req).map_or(&[], |r| r.blocks.as_slice())
    }

    /// Leading blocks of the request's table offered to the prefix cache (registered, unless a
    /// collision or an eviction broke the chain); 0 for an unknown request. They all lie within
    /// the `num_computed + num_new` tokens of its allocations: lookahead slots never count.
    pub fn num_registered_blocks(&self, req: RequestId) -> usize {
        self.requests.get(&req).map_or(0, |r| r.num_cached_blocks)
    }

    /// The hash of a block of `tokens` after the block hashed `parent` (`None`: the first
    /// block of a chain of cache key `key`).
    fn hash(&self, parent: Option<BlockHash>, key: u64, tokens: &[TokenId]) -> BlockHash {
        (self.hash_fn)(parent.or_else(|| chain_root(key)), tokens, &self.extra_keys)
    }

    /// The chained hash of a full block holding `tokens` after a block hashed `parent` (`None`:
    /// the first block), as the prefix cache hashes it for cache key 0.
    pub fn block_hash_of(&self, parent: Option<BlockHash>, tokens: &[TokenId]) -> BlockHash {
        self.hash(parent, 0, tokens)
    }

    /// `req`'s cache key (0 unless [`KvCacheManager::set_cache_key`] gave it one).
    pub fn cache_key(&self, req: RequestId) -> u64 {
        self.keys.get(&req).copied().unwrap_or(0)
    }

    /// Whether prefix caching is on.
    pub fn prefix_caching(&self) -> bool {
        self.enable_prefix_caching
    }

    /// Starts (or stops) logging the cached blocks allocation evicts ([`BlockPool::take_evicted`]).
    pub fn set_log_evictions(&mut self, on: bool) {
        self.pool.set_log_evictions(on);
    }

    /// Drops a held block from the prefix cache because its KV was never written (a failed
    /// copy); free or uncached blocks are left alone.
    pub fn uncache_held(&mut self, block: BlockId) {
        if self.pool.ref_count(block) > 0 {
            self.pool.uncache(block);
        }
    }

    /// Starts (or stops) logging prefix-cache index changes ([`BlockPool::take_events`]).
    pub fn set_log_events(&mut self, on: bool) {
        self.pool.set_log_events(on);
    }

    /// The prefix-cache index changes since the last call, in order.
    pub fn take_events(&mut self) -> Vec<crate::KvCacheEvent> {
        self.pool.take_events()
    }

    /// The cached blocks evicted since the last call, in eviction order.
    pub fn take_evicted(&mut self) -> Vec<crate::EvictedBlock> {
        self.pool.take_evicted()
    }

    /// The longest chain of verified cached full blocks that prefixes `tokens`, leaving at least
    /// one token to compute (cache key 0).
    pub fn lookup_prefix(&self, tokens: &[TokenId]) -> PrefixHit {
        self.lookup_prefix_keyed(tokens, 0)
    }

    /// [`KvCacheManager::lookup_prefix`] for a request of cache key `key`: only blocks cached
    /// under that key.
    pub fn lookup_prefix_keyed(&self, tokens: &[TokenId], key: u64) -> PrefixHit {
        let (blocks, _) = self.find_cached(tokens, key, usize::MAX);
        PrefixHit { num_cached_tokens: blocks.len() * self.block_size(), blocks }
    }

    /// At most `max_blocks` verified cached blocks of key `key` prefixing `tokens` (capped as in
    /// `lookup_prefix`), with their chain hashes.
    fn find_cached(
        &self,
        tokens: &[TokenId],
        key: u64,
        max_blocks: usize,
    ) -> (Vec<BlockId>, Vec<BlockHash>) {
        let (mut blocks, mut hashes) = (Vec::new(), Vec::new());
        if !self.enable_prefix_caching || tokens.is_empty() {
            return (blocks, hashes);
        }
        for chunk in tokens[..tokens.len() - 1].chunks_exact(self.block_size()).take(max_blocks) {
            let h = self.hash(hashes.last().copied(), key, chunk);
            let parent = blocks.last().copied();
            let Some(id) = self.pool.get_cached(h, parent, key, chunk) else { break };
            blocks.push(id);
            hashes.push(h);
        }
        (blocks, hashes)
    }

    /// Gives `req` the cache key `key` until it is freed (module docs; 0 removes it): call it
    /// before the request's first allocation, and again after a preemption freed it.
    pub fn set_cache_key(&mut self, req: RequestId, key: u64) {
        debug_assert!(!self.requests.contains_key(&req), "{req}: a key set after allocation");
        if key == 0 {
            self.keys.remove(&req);
        } else {
            self.keys.insert(req, key);
        }
    }

    /// Gives `req` slots for `num_computed_tokens + num_new_tokens + num_lookahead` tokens and
    /// returns the blocks added to its table; `None` (nothing changed) if too few are free.
    ///
    /// `tokens` are all tokens known so far (`num_computed + num_new <= tokens.len()`).
    pub fn allocate_slots(
        &mut self,
        req: RequestId,
        tokens: &[TokenId],
        num_computed_tokens: usize,
        num_new_tokens: usize,
        num_lookahead: usize,
    ) -> Option<Vec<BlockId>> {
        let bs = self.block_size();
        let num_known = num_computed_tokens + num_new_tokens;
        let num_tokens = tokens.len();
        assert!(num_known <= num_tokens, "{req}: {num_known} tokens scheduled, {num_tokens} known");
        let first = !self.requests.contains_key(&req);
        let shared = self.enable_prefix_caching;
        let (hits, hit_hashes) = if first && num_computed_tokens > 0 {
            self.pinned_hit(req, tokens, num_computed_tokens)
        } else {
            (Vec::new(), Vec::new())
        };
        let num_held = self.block_table(req).len() + hits.len();
        let num_required = (num_known + num_lookahead).div_ceil(bs);
        let num_new_blocks = num_required.saturating_sub(num_held);
        let num_free_hits = hits.iter().filter(|&&b| self.pool.ref_count(b) == 0).count();
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks() {
            return None;
        }
        // Pin the hits first so that allocation cannot evict them.
        self.pool.touch(&hits);
        let new_blocks = self.pool.allocate(num_new_blocks).expect("free blocks counted above");
        if first && shared {
            self.stats.num_requests += 1;
            self.stats.num_queried_tokens += tokens.len() as u64;
            self.stats.num_hit_tokens += num_computed_tokens as u64;
        }
        let entry = self.requests.entry(req).or_default();
        if first {
            entry.last_cached = hits.last().and_then(|&b| self.pool.cached_ref(b));
            entry.num_cached_blocks = hits.len();
            entry.block_hashes = hit_hashes;
            entry.blocks = hits;
        }
        entry.blocks.extend_from_slice(&new_blocks);
        if shared {
            self.cache_full_blocks(req, tokens, num_known);
        }
        Some(new_blocks)
    }

    /// The hit blocks (and their hashes) covering `num_computed_tokens` on a request's first
    /// allocation.
    fn pinned_hit(
        &self,
        req: RequestId,
        tokens: &[TokenId],
        num_computed_tokens: usize,
    ) -> (Vec<BlockId>, Vec<BlockHash>) {
        let bs = self.block_size();
        assert!(
            num_computed_tokens.is_multiple_of(bs),
            "{req}: first allocation with {num_computed_tokens} computed tokens, not whole blocks"
        );
        let n = num_computed_tokens / bs;
        let hit = self.find_cached(tokens, self.cache_key(req), n);
        assert!(
            hit.0.len() == n,
            "{req}: {num_computed_tokens} computed tokens but the prefix cache holds {}",
            hit.0.len() * bs
        );
        hit
    }

    /// Hashes and registers the request's full blocks within its first `num_tokens` tokens.
    fn cache_full_blocks(&mut self, req: RequestId, tokens: &[TokenId], num_tokens: usize) {
        let bs = self.block_size();
        let num_full = num_tokens / bs;
        let key = self.cache_key(req);
        let Some(entry) = self.requests.get_mut(&req) else { return };
        if entry.num_cached_blocks >= num_full {
            return;
        }
        while entry.block_hashes.len() < num_full {
            let i = entry.block_hashes.len();
            let parent = i.checked_sub(1).map(|p| entry.block_hashes[p]).or(chain_root(key));
            let chunk = &tokens[i * bs..(i + 1) * bs];
            entry.block_hashes.push((self.hash_fn)(parent, chunk, &self.extra_keys));
        }
        let mut parent = entry.last_cached;
        for i in entry.num_cached_blocks..num_full {
            if i > 0 && parent.is_none() {
                break; // the chain is broken (a collision, an eviction): nothing after is reachable
            }
            let chunk = &tokens[i * bs..(i + 1) * bs];
            let hash = entry.block_hashes[i];
            parent = self.pool.cache_block(entry.blocks[i], hash, parent, key, chunk);
        }
        entry.last_cached = parent;
        entry.num_cached_blocks = num_full;
    }

    /// Releases the request's blocks (finish, abort, preempt), tail first. Unknown ids are a
    /// no-op.
    pub fn free(&mut self, req: RequestId) {
        self.keys.remove(&req);
        if let Some(entry) = self.requests.remove(&req) {
            self.pool.free(entry.blocks.into_iter().rev());
        }
    }

    /// Removes from the prefix cache `req`'s blocks from the one holding position
    /// `num_computed_tokens` on, shared or not (they were registered for tokens of a step
    /// that failed, so their KV was never written); the request keeps them, its record of
    /// registered blocks cut to match.
    pub fn uncache_past(&mut self, req: RequestId, num_computed_tokens: usize) {
        let first = num_computed_tokens / self.block_size();
        let Some(entry) = self.requests.get_mut(&req) else { return };
        for &b in entry.blocks.iter().skip(first) {
            self.pool.uncache(b);
        }
        if entry.num_cached_blocks > first {
            entry.num_cached_blocks = first;
            let last = first.checked_sub(1).map(|i| entry.blocks[i]);
            entry.last_cached = last.and_then(|b| self.pool.cached_ref(b));
        }
    }

    /// Like [`KvCacheManager::free`], for a request whose KV holds only its first
    /// `num_computed_tokens` tokens: blocks from the one holding position `num_computed_tokens`
    /// on are removed from the prefix cache first (they were registered for tokens that were
    /// never computed).
    pub fn free_with_computed(&mut self, req: RequestId, num_computed_tokens: usize) {
        let Some(entry) = self.requests.get(&req) else {
            self.keys.remove(&req);
            return;
        };
        for &b in entry.blocks.iter().skip(num_computed_tokens / self.block_size()) {
            debug_assert!(
                self.pool.ref_count(b) == 1 || self.pool.block_hash(b).is_none(),
                "{req}: an uncomputed cached block {b:?} is shared"
            );
            self.pool.uncache(b);
        }
        self.free(req);
    }

    /// Shares `parent`'s full blocks within its first `num_computed_tokens` tokens with the new
    /// request `child` and returns the child's `num_computed_tokens` (a multiple of the block
    /// size). An unknown parent shares nothing.
    pub fn fork(
        &mut self,
        parent: RequestId,
        child: RequestId,
        num_computed_tokens: usize,
    ) -> usize {
        assert!(!self.requests.contains_key(&child), "fork into existing {child}");
        let bs = self.block_size();
        let Some(p) = self.requests.get(&parent) else { return 0 };
        let n = (num_computed_tokens / bs).min(p.blocks.len());
        let num_cached_blocks = p.num_cached_blocks.min(n);
        let last_cached = if num_cached_blocks == p.num_cached_blocks {
            p.last_cached
        } else {
            num_cached_blocks.checked_sub(1).and_then(|i| self.pool.cached_ref(p.blocks[i]))
        };
        let entry = RequestBlocks {
            blocks: p.blocks[..n].to_vec(),
            block_hashes: p.block_hashes[..n.min(p.block_hashes.len())].to_vec(),
            num_cached_blocks,
            last_cached,
        };
        self.pool.touch(&entry.blocks);
        self.requests.insert(child, entry);
        if let Some(&key) = self.keys.get(&parent) {
            self.keys.insert(child, key);
        }
        n * bs
    }

    /// Forgets every cached prefix; refused (`false`) while any request holds blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.requests.is_empty() {
            return false;
        }
        self.pool.reset_prefix_cache()
    }

    /// Checks the pool's and the manager's invariants (module docs).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let mut refs = vec![0u32; self.pool.num_blocks()];
        for (req, e) in &self.requests {
            let mut sorted = e.blocks.clone();
            sorted.sort_unstable();
            if sorted.windows(2).any(|w| w[0] == w[1]) {
                return Err(format!("{req} holds a block twice: {:?}", e.blocks));
            }
            if e.num_cached_blocks > e.blocks.len() || e.block_hashes.len() > e.blocks.len() {
                return Err(format!("{req}: cached/hashed block counts exceed its table"));
            }
            for (i, &b) in e.blocks.iter().enumerate() {
                refs[b.index()] += 1;
                let registered = self.pool.block_hash(b);
                if let (Some(h), Some(&mine)) = (registered, e.block_hashes.get(i))
                    && h != mine
                {
                    return Err(format!(
                        "{req}: block {i} ({b:?}) is cached under {h:?}, not {mine:?}"
                    ));
                }
                let key = self.pool.cached_key(b);
                if registered.is_some()
                    && i < e.num_cached_blocks
                    && key != Some(self.cache_key(*req))
                {
                    return Err(format!("{req}: block {i} ({b:?}) is cached under key {key:?}"));
                }
            }
        }
        for (&b, &n) in &self.held {
            refs[b.index()] += n;
        }
        for (i, &r) in refs.iter().enumerate() {
            let id = BlockId(i as u32);
            if self.pool.ref_count(id) != r {
                return Err(format!(
                    "{id:?}: ref count {} but in {r} tables and holds",
                    self.pool.ref_count(id)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(ids: &[u32]) -> Vec<TokenId> {
        ids.iter().map(|&t| TokenId(t)).collect()
    }

    fn manager(num_blocks: usize, block_size: usize) -> KvCacheManager {
        KvCacheManager::new(KvCacheConfig {
            block_size,
            num_blocks,
            enable_prefix_caching: true,
            extra_keys: vec![],
        })
    }

    #[test]
    fn saved_chains_restore_into_a_fresh_manager_and_hit_alike() {
        let mut m = manager(16, 4);
        // Two sequences sharing their first block; a third whose head is then evicted.
        let a = toks(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]);
        let b = toks(&[1, 2, 3, 4, 20, 21, 22, 23, 24]);
        m.allocate_slots(RequestId(1), &a, 0, a.len(), 0).unwrap();
        m.free(RequestId(1));
        let hit = m.lookup_prefix(&b);
        assert_eq!(hit.num_cached_tokens, 4);
        m.allocate_slots(RequestId(2), &b, 4, b.len() - 4, 0).unwrap();
        m.free(RequestId(2));
        let chains = m.cached_chains();
        assert_eq!(chains.len(), 4); // a: 3 full blocks, b: 1 more
        for (i, &(block, parent)) in chains.iter().enumerate() {
            assert!(parent.is_none_or(|p| p < i), "parent after child");
            assert_eq!(parent.is_none(), m.pool().cached_parent(block) == Some(None));
        }
        let mut fresh = manager(16, 4);
        let mut restored: Vec<Option<BlockId>> = Vec::new();
        for &(block, parent) in &chains {
            let tokens = m.pool().cached_tokens(block).unwrap().to_vec();
            let parent = parent.map(|p| restored[p].expect("parent restored"));
            restored.push(fresh.restore_block(parent, &tokens));
        }
        let blocks: Vec<BlockId> = restored.iter().map(|b| b.unwrap()).collect();
        fresh.finish_restore(&blocks);
        fresh.check_invariants().unwrap();
        assert_eq!(fresh.num_free_blocks(), 16);
        for (seq, cached) in [(&a, 12), (&b, 8)] {
            assert_eq!(fresh.lookup_prefix(seq).num_cached_tokens, cached);
        }
        // A second restore of the same content registers nothing; a request blocks restoring.
        assert_eq!(fresh.restore_block(None, &toks(&[1, 2, 3, 4])), None);
        fresh.allocate_slots(RequestId(3), &a, 0, 1, 0).unwrap();
        assert_eq!(fresh.restore_block(None, &toks(&[9, 9, 9, 9])), None);
        fresh.free(RequestId(3));
        // Restoring never evicts: with every block cached, nothing more is taken.
        let mut full = manager(2, 4);
        let first = full.restore_block(None, &toks(&[1, 1, 1, 1])).unwrap();
        let second = full.restore_block(Some(first), &toks(&[2, 2, 2, 2])).unwrap();
        assert_eq!(full.restore_block(None, &toks(&[3, 3, 3, 3])), None);
        full.finish_restore(&[first, second]);
        assert_eq!(full.restore_block(None, &toks(&[3, 3, 3, 3])), None);
        // The tail of a restored chain is evicted before its head.
        assert_eq!(full.pool().free_blocks().collect::<Vec<_>>(), vec![second, first]);
        full.check_invariants().unwrap();
    }

    #[test]
    fn grows_a_request_by_chunks_and_decode_steps() {
        let mut m = manager(8, 4);
        let r = RequestId(1);
        let mut t = toks(&[1, 2, 3, 4, 5, 6]);
        assert_eq!(m.allocate_slots(r, &t, 0, 5, 0), Some(vec![BlockId(0), BlockId(1)]));
        assert_eq!(m.allocate_slots(r, &t, 5, 1, 0), Some(vec![]));
        t.extend(toks(&[7, 8, 9]));
        assert_eq!(m.allocate_slots(r, &t, 6, 3, 0), Some(vec![BlockId(2)]));
        // lookahead slots: 9 + 4 tokens need 4 blocks
        assert_eq!(m.allocate_slots(r, &t, 9, 0, 4), Some(vec![BlockId(3)]));
        assert_eq!(m.block_table(r).len(), 4);
        assert_eq!(m.usage(), 0.5);
        m.check_invariants().unwrap();
        m.free(r);
        assert_eq!(m.num_free_blocks(), 8);
        assert!(!m.contains(r));
        m.check_invariants().unwrap();
    }

    #[test]
    fn lookahead_slots_are_never_registered_even_when_they_fill_a_block() {
        let mut m = manager(8, 4);
        let r = RequestId(1);
        let t = toks(&[1, 2, 3, 4, 5, 6]);
        // 6 known tokens computed and 2 speculative ones: block 1 fills, but only with
        // lookahead slots past position 5.
        m.allocate_slots(r, &t, 0, 6, 2).unwrap();
        assert_eq!(m.block_table(r).len(), 2);
        assert_eq!(m.num_registered_blocks(r), 1);
        assert_eq!(m.pool().num_cached_blocks(), 1);
        let longer = toks(&[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(m.lookup_prefix(&longer).num_cached_tokens, 4);
        // once known tokens fill it, the block is registered under those tokens
        m.allocate_slots(r, &longer, 6, 3, 0).unwrap();
        assert_eq!(m.num_registered_blocks(r), 2);
        assert_eq!(m.lookup_prefix(&longer).num_cached_tokens, 8);
        m.check_invariants().unwrap();
        m.free(r);
        assert_eq!(m.num_free_blocks(), 8);
        assert_eq!(m.num_registered_blocks(r), 0);
    }

    #[test]
    fn failed_allocation_changes_nothing() {
        let mut m = manager(3, 2);
        let t = toks(&[1; 10]);
        assert_eq!(m.allocate_slots(RequestId(1), &t, 0, 4, 0).map(|b| b.len()), Some(2));
        assert_eq!(m.allocate_slots(RequestId(1), &t, 4, 6, 0), None);
        assert_eq!(m.allocate_slots(RequestId(2), &t, 0, 6, 0), None);
        assert_eq!(m.block_table(RequestId(1)).len(), 2);
        assert!(!m.contains(RequestId(2)));
        assert_eq!(m.num_free_blocks(), 1);
        m.check_invariants().unwrap();
    }

    #[test]
    fn lookup_never_covers_the_whole_sequence() {
        let mut m = manager(8, 2);
        let t = toks(&[1, 2, 3, 4]);
        m.allocate_slots(RequestId(1), &t, 0, 4, 0).unwrap();
        // both blocks are cached, but the same 4 tokens may reuse only the first
        assert_eq!(m.lookup_prefix(&t).num_cached_tokens, 2);
        assert_eq!(m.lookup_prefix(&toks(&[1, 2, 3, 4, 5])).num_cached_tokens, 4);
        assert_eq!(m.lookup_prefix(&toks(&[1, 2, 3])).num_cached_tokens, 2);
        assert_eq!(m.lookup_prefix(&toks(&[1, 3, 3, 4, 5])).num_cached_tokens, 0);
        assert_eq!(m.lookup_prefix(&[]).num_cached_tokens, 0);
    }

    #[test]
    fn a_hit_is_pinned_and_counted() {
        let mut m = manager(8, 2);
        let a = toks(&[1, 2, 3, 4, 5]);
        m.allocate_slots(RequestId(1), &a, 0, 5, 0).unwrap();
        m.free(RequestId(1));
        let b = toks(&[1, 2, 3, 4, 9, 9]);
        let hit = m.lookup_prefix(&b);
        assert_eq!(hit.num_cached_tokens, 4);
        let new = m.allocate_slots(RequestId(2), &b, 4, 2, 0).unwrap();
        assert_eq!(new.len(), 1);
        assert_eq!(&m.block_table(RequestId(2))[..2], hit.blocks.as_slice());
        assert!(hit.blocks.iter().all(|&blk| m.pool().ref_count(blk) == 1));
        let s = m.prefix_cache_stats();
        assert_eq!((s.num_requests, s.num_queried_tokens, s.num_hit_tokens), (2, 11, 4));
        m.check_invariants().unwrap();
    }

    #[test]
    fn keyed_requests_hit_only_blocks_of_their_own_key() {
        let mut m = manager(16, 2);
        let a = toks(&[1, 2, 3, 4, 5]);
        m.set_cache_key(RequestId(1), 7);
        m.allocate_slots(RequestId(1), &a, 0, 5, 0).unwrap();
        assert_eq!(m.num_registered_blocks(RequestId(1)), 2);
        m.free(RequestId(1));
        // The same tokens: no hit for key 0 or another key, a hit for key 7.
        assert_eq!(m.lookup_prefix(&a).num_cached_tokens, 0);
        assert_eq!(m.lookup_prefix_keyed(&a, 8).num_cached_tokens, 0);
        assert_eq!(m.lookup_prefix_keyed(&a, 7).num_cached_tokens, 4);
        // Key 0 caches the same tokens alongside, under other hashes.
        m.allocate_slots(RequestId(2), &a, 0, 5, 0).unwrap();
        assert_eq!(m.num_registered_blocks(RequestId(2)), 2);
        m.free(RequestId(2));
        assert_eq!(m.lookup_prefix(&a).num_cached_tokens, 4);
        // A keyed hit pins its blocks; freed, the id loses its key.
        m.set_cache_key(RequestId(3), 7);
        let hit = m.lookup_prefix_keyed(&a, 7);
        m.allocate_slots(RequestId(3), &a, 4, 1, 0).unwrap();
        assert_eq!(&m.block_table(RequestId(3))[..2], hit.blocks.as_slice());
        m.check_invariants().unwrap();
        m.free(RequestId(3));
        assert_eq!(m.cache_key(RequestId(3)), 0);
        // A key set while waiting and aborted before any allocation is forgotten too.
        m.set_cache_key(RequestId(4), 9);
        m.free_with_computed(RequestId(4), 0);
        assert_eq!(m.cache_key(RequestId(4)), 0);
        // A saved prefix cache leaves keyed chains out.
        assert_eq!(m.cached_chains().len(), 2);
        m.check_invariants().unwrap();
    }

    #[test]
    fn free_with_computed_unregisters_blocks_whose_kv_was_never_written() {
        let mut m = manager(8, 2);
        let (r, t) = (RequestId(1), toks(&[1, 2, 3, 4, 5, 6, 7]));
        m.allocate_slots(r, &t, 0, 2, 0).unwrap(); // step 1 computes [1, 2]
        m.allocate_slots(r, &t, 2, 5, 0).unwrap(); // step 2 is never run
        assert_eq!(m.lookup_prefix(&t).num_cached_tokens, 6);
        m.free_with_computed(r, 2);
        assert_eq!(m.lookup_prefix(&t).num_cached_tokens, 2);
        assert_eq!(m.pool().num_cached_blocks(), 1);
        m.check_invariants().unwrap();
        // a partially computed block is not kept either
        m.allocate_slots(r, &t, 0, 6, 0).unwrap();
        m.free_with_computed(r, 5);
        assert_eq!(m.lookup_prefix(&t).num_cached_tokens, 4);
        m.check_invariants().unwrap();
    }

    #[test]
    #[should_panic(expected = "prefix cache holds")]
    fn claiming_more_computed_tokens_than_cached_panics() {
        let mut m = manager(8, 2);
        m.allocate_slots(RequestId(1), &toks(&[1, 2, 3]), 2, 1, 0);
    }

    #[test]
    fn disabled_prefix_caching_never_hashes_or_hits() {
        let mut m = KvCacheManager::new(KvCacheConfig {
            block_size: 2,
            num_blocks: 4,
            enable_prefix_caching: false,
            extra_keys: vec![],
        });
        let t = toks(&[1, 2, 3, 4, 5]);
        m.allocate_slots(RequestId(1), &t, 0, 5, 0).unwrap();
        assert_eq!(m.pool().num_cached_blocks(), 0);
        assert_eq!(m.lookup_prefix(&t), PrefixHit::default());
        assert_eq!(m.prefix_cache_stats(), PrefixCacheStats::default());
        m.check_invariants().unwrap();
    }

    #[test]
    fn reset_prefix_cache_only_when_idle() {
        let mut m = manager(4, 2);
        let t = toks(&[1, 2, 3]);
        m.allocate_slots(RequestId(1), &t, 0, 3, 0).unwrap();
        assert!(!m.reset_prefix_cache());
        m.free(RequestId(1));
        assert_eq!(m.lookup_prefix(&t).num_cached_tokens, 2);
        assert!(m.reset_prefix_cache());
        assert_eq!(m.lookup_prefix(&t).num_cached_tokens, 0);
        m.check_invariants().unwrap();
    }
}
