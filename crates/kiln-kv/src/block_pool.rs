//! The block pool: ref counts, the LRU free queue and the prefix-cache index.
//!
//! Every block is in exactly one of two states:
//! - **referenced**: `ref_cnt > 0`, not in the free queue;
//! - **free**: `ref_cnt == 0`, in the free queue exactly once.
//!
//! Independently of that, a block may be **cached**: it holds the KV of a full block whose
//! chained hash and token ids it stores, and `cached[hash] == id`. A free cached
//! block stays in the index and can be revived by a hit ([`BlockPool::touch`] takes it out of
//! the free queue) until allocation reaches it at the head of the queue and evicts it, which
//! removes its hash entry. At most one block is cached per hash: registering a second block
//! under a taken hash is refused and that block simply stays uncached (if the holder has the
//! same tokens after the same parent, it is a duplicate and the holder stands in for it as the
//! parent of the next block).
//!
//! Eviction order: [`BlockPool::free`] appends cached blocks at the tail in the order given (the
//! caller passes a request's blocks last-first, so its tail blocks are evicted first) and puts
//! uncached blocks at the head, since they hold nothing anyone can hit.
//!
//! A hit is never trusted on the hash alone: [`BlockPool::get_cached`] compares the stored token
//! ids and the **parent**: a cached block remembers the cached block holding the same KV as its
//! predecessor when it was computed, as a [`CachedBlockRef`] `(block id, generation)`, where a
//! block's generation is bumped whenever it stops being cached. A chain of hits is therefore
//! exact by induction (block 0 has no parent; block `i` holds the right tokens and was computed
//! after the same KV as the cached block verified at `i - 1`, which has not changed since),
//! whatever the quality of the hash. A block whose predecessor's KV is not cached cannot be
//! reached by a chain, so it is not cached either.
//!
//! A cached block also carries the **cache key** its chain was computed under: 0 for KV that
//! depends only on the tokens, or a non-zero key naming whatever else the KV depends on (the
//! engine uses one per binding of a LoRA adapter). A hit must match the key too, and every
//! block of a chain has its root's key, so a chain never serves a request of another key.
//!
//! Evictions can be logged ([`BlockPool::set_log_evictions`]): each evicted cached block's hash,
//! parent and tokens, with a reference to it as it was, so that its KV can be kept elsewhere
//! (a second tier) before the new owner overwrites it.
//!
//! Cache events can be logged too ([`BlockPool::set_log_events`]): every block that enters the
//! index ([`KvCacheEvent::Stored`], with its parent's hash and its tokens), every block that
//! leaves it by eviction or `uncache` ([`KvCacheEvent::Removed`]), and a reset
//! ([`KvCacheEvent::AllCleared`]), in the order they happen. Replayed in order they give the
//! index's exact set of hashes (what a cache-aware router is told).
//!
//! Complexity: `touch`, `free` and `get_cached` are O(1) per block (plus a token compare);
//! `allocate(n)` is O(n). Nothing allocates per operation except the returned id vectors.

use std::collections::HashMap;

use kiln_core::{BlockId, TokenId};

use crate::free_queue::FreeBlockQueue;
use crate::hash::{BlockHash, BlockHashState};

/// A cached block as it was at one time: stale once the block is evicted or uncached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedBlockRef {
    block: BlockId,
    generation: u64,
}

impl CachedBlockRef {
    /// The block this reference names (it may have been evicted and reused since).
    pub fn block(self) -> BlockId {
        self.block
    }
}

#[derive(Clone, Debug, Default)]
struct Block {
    ref_cnt: u32,
    /// Set iff the block is cached (and then `cached[hash]` is this block).
    hash: Option<BlockHash>,
    /// The cached block holding the KV this block's KV was computed after (`None` for the first
    /// block of a sequence; meaningful only while `hash` is set).
    parent: Option<CachedBlockRef>,
    /// The cache key it was computed under (module docs; 0 while uncached).
    key: u64,
    /// Bumped whenever the block stops being cached, so a stale `CachedBlockRef` never matches.
    generation: u64,
    /// The block's token ids while cached (`len == block_size`), empty otherwise; the capacity is
    /// kept across evictions.
    tokens: Vec<TokenId>,
}

/// A cached block that allocation evicted: what it held, as it was registered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvictedBlock {
    /// The block as it was cached (stale now: the block has a new owner).
    pub was: CachedBlockRef,
    pub hash: BlockHash,
    /// The cached block its KV was computed after, as registered (`None`: a sequence's first).
    pub parent: Option<CachedBlockRef>,
    /// Its cache key (module docs).
    pub key: u64,
    pub tokens: Vec<TokenId>,
}

/// A change to the prefix-cache index, as [`BlockPool::take_events`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvCacheEvent {
    /// A full block entered the index: its hash, the hash of the cached block its KV was
    /// computed after (`None`: a sequence's first block), its `block_size` tokens and its cache
    /// key (module docs).
    Stored { hash: BlockHash, parent: Option<BlockHash>, tokens: Vec<TokenId>, key: u64 },
    /// A block left the index (evicted for reuse, or uncached).
    Removed { hash: BlockHash },
    /// Every hash left the index at once.
    AllCleared,
}

/// Owns every KV block's bookkeeping (not its memory).
#[derive(Clone, Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    block_size: usize,
    free_queue: FreeBlockQueue,
    cached: HashMap<BlockHash, BlockId, BlockHashState>,
    num_evictions: u64,
    /// Evictions since the last `take_evicted` (`None`: not logged).
    evicted: Option<Vec<EvictedBlock>>,
    /// Index changes since the last `take_events` (`None`: not logged).
    events: Option<Vec<KvCacheEvent>>,
}

impl BlockPool {
    /// `num_blocks` free, uncached blocks of `block_size` tokens each.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        Self {
            blocks: vec![Block::default(); num_blocks],
            block_size,
            free_queue: FreeBlockQueue::full(num_blocks),
            cached: HashMap::default(),
            num_evictions: 0,
            evicted: None,
            events: None,
        }
    }

    /// Starts (or stops) logging index changes for [`BlockPool::take_events`]. The log starts
    /// with the index as it is: every cached block reachable from a sequence's start (as a
    /// prefix hit can reach it) as [`KvCacheEvent::Stored`], parents before children.
    pub fn set_log_events(&mut self, on: bool) {
        self.events = on.then(|| self.snapshot_events());
    }

    /// The reachable cached blocks as `Stored` events, each after its parent.
    fn snapshot_events(&self) -> Vec<KvCacheEvent> {
        // Depth of each reachable block in its chain (`None`: a parent changed), memoized.
        let mut depth: HashMap<BlockId, Option<usize>> = HashMap::new();
        for start in self.cached_blocks() {
            let mut path = Vec::new();
            let mut at = start;
            let base = loop {
                if let Some(&d) = depth.get(&at) {
                    break d;
                }
                path.push(at);
                match self.cached_parent(at) {
                    Some(Some(parent)) => at = parent,
                    Some(None) => break Some(0),
                    None => break None,
                }
            };
            // `path` ends at the block whose depth is `base` (or at the root, depth 0).
            let known = depth.contains_key(&at);
            for (i, id) in path.iter().rev().enumerate() {
                let d = base.map(|b| if known { b + 1 + i } else { b + i });
                depth.insert(*id, d);
            }
        }
        let mut order: Vec<(usize, BlockId)> =
            depth.into_iter().filter_map(|(id, d)| d.map(|d| (d, id))).collect();
        order.sort_unstable();
        order
            .into_iter()
            .filter_map(|(_, id)| {
                let b = &self.blocks[id.index()];
                let parent = b.parent.and_then(|p| self.blocks[p.block.index()].hash);
                let (hash, tokens, key) = (b.hash?, b.tokens.clone(), b.key);
                Some(KvCacheEvent::Stored { hash, parent, tokens, key })
            })
            .collect()
    }

    /// The index changes since the last call, in order (empty when not logging).
    pub fn take_events(&mut self) -> Vec<KvCacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn log_event(&mut self, event: KvCacheEvent) {
        if let Some(log) = &mut self.events {
            log.push(event);
        }
    }

    /// Starts (or stops) logging evicted cached blocks for [`BlockPool::take_evicted`].
    pub fn set_log_evictions(&mut self, on: bool) {
        self.evicted = on.then(Vec::new);
    }

    /// The cached blocks evicted since the last call, in eviction order (empty when not
    /// logging).
    pub fn take_evicted(&mut self) -> Vec<EvictedBlock> {
        self.evicted.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks that allocation may take (free, cached or not).
    pub fn num_free_blocks(&self) -> usize {
        self.free_queue.len()
    }

    /// Blocks currently registered in the prefix-cache index (free or referenced).
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Cached blocks evicted by allocation so far.
    pub fn num_evictions(&self) -> u64 {
        self.num_evictions
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks[block.index()].ref_cnt
    }

    /// The hash a cached block is registered under.
    pub fn block_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.blocks[block.index()].hash
    }

    /// The token ids a cached block holds; `None` if it is not cached.
    pub fn cached_tokens(&self, block: BlockId) -> Option<&[TokenId]> {
        let b = &self.blocks[block.index()];
        b.hash.map(|_| b.tokens.as_slice())
    }

    /// Free blocks from the next to be taken to the last.
    pub fn free_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free_queue.iter()
    }

    /// A reference to `block` as cached now; `None` if it is not cached.
    pub fn cached_ref(&self, block: BlockId) -> Option<CachedBlockRef> {
        let b = &self.blocks[block.index()];
        b.hash.map(|_| CachedBlockRef { block, generation: b.generation })
    }

    /// Every cached block (free or referenced), in no particular order.
    pub fn cached_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.cached.values().copied()
    }

    /// The cached block a cached `block` was computed after: `Some(None)` for the first block
    /// of a sequence, `Some(Some(parent))` while that parent is still the same cached KV, `None`
    /// if `block` is not cached or its parent changed (nothing reaches it any more).
    pub fn cached_parent(&self, block: BlockId) -> Option<Option<BlockId>> {
        let b = &self.blocks[block.index()];
        b.hash?;
        match b.parent {
            None => Some(None),
            Some(p) => self.is_current(p).then_some(Some(p.block)),
        }
    }

    /// The cache key of a cached block (`None`: not cached).
    pub fn cached_key(&self, block: BlockId) -> Option<u64> {
        let b = &self.blocks[block.index()];
        b.hash.map(|_| b.key)
    }

    /// Whether `r` still names a cached block with unchanged content.
    pub fn is_current(&self, r: CachedBlockRef) -> bool {
        self.cached_ref(r.block) == Some(r)
    }

    /// The cached block for `hash`, if it really holds `tokens`, was computed right after the
    /// cached block `parent` (`None` for the first block of a sequence) and under cache key
    /// `key`.
    pub fn get_cached(
        &self,
        hash: BlockHash,
        parent: Option<BlockId>,
        key: u64,
        tokens: &[TokenId],
    ) -> Option<BlockId> {
        let &id = self.cached.get(&hash)?;
        let b = &self.blocks[id.index()];
        let parent_ok = match parent {
            None => b.parent.is_none(),
            Some(p) => b.parent.is_some() && b.parent == self.cached_ref(p),
        };
        (parent_ok && b.key == key && b.tokens == tokens).then_some(id)
    }

    pub fn can_allocate(&self, num_blocks: usize) -> bool {
        num_blocks <= self.free_queue.len()
    }

    /// Takes `num_blocks` blocks from the head of the free queue (evicting cached ones) with a
    /// ref count of 1; `None`, changing nothing, if there are not enough free blocks.
    pub fn allocate(&mut self, num_blocks: usize) -> Option<Vec<BlockId>> {
        if !self.can_allocate(num_blocks) {
            return None;
        }
        let mut out = Vec::with_capacity(num_blocks);
        for _ in 0..num_blocks {
            let id = self.free_queue.pop_front()?;
            self.evict(id);
            self.blocks[id.index()].ref_cnt = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Drops `id` from the prefix-cache index, if it is there.
    fn evict(&mut self, id: BlockId) {
        let b = &mut self.blocks[id.index()];
        if let Some(hash) = b.hash.take() {
            let removed = self.cached.remove(&hash);
            debug_assert_eq!(removed, Some(id));
            if let Some(log) = &mut self.evicted {
                log.push(EvictedBlock {
                    was: CachedBlockRef { block: id, generation: b.generation },
                    hash,
                    parent: b.parent,
                    key: b.key,
                    tokens: b.tokens.clone(),
                });
            }
            b.parent = None;
            b.key = 0;
            b.tokens.clear();
            b.generation += 1;
            self.num_evictions += 1;
            self.log_event(KvCacheEvent::Removed { hash });
        }
    }

    /// Removes a referenced block from the prefix-cache index (its KV will never be written);
    /// returns whether it was cached. Blocks cached after it no longer match it as a parent.
    pub fn uncache(&mut self, block: BlockId) -> bool {
        assert!(self.blocks[block.index()].ref_cnt > 0, "uncaching a free block {block:?}");
        let b = &mut self.blocks[block.index()];
        let Some(hash) = b.hash.take() else { return false };
        self.cached.remove(&hash);
        b.parent = None;
        b.key = 0;
        b.tokens.clear();
        b.generation += 1;
        self.log_event(KvCacheEvent::Removed { hash });
        true
    }

    /// Adds a reference to each block (a cache hit or a fork); free blocks leave the queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &id in blocks {
            let b = &mut self.blocks[id.index()];
            if b.ref_cnt == 0 {
                self.free_queue.remove(id);
            }
            b.ref_cnt += 1;
        }
    }

    /// Drops one reference from each block, in the order given; blocks reaching zero become
    /// free (cached ones at the tail of the queue, uncached ones at the head).
    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for id in blocks {
            let b = &mut self.blocks[id.index()];
            assert!(b.ref_cnt > 0, "double free of {id:?}");
            b.ref_cnt -= 1;
            if b.ref_cnt == 0 {
                if b.hash.is_some() {
                    self.free_queue.push_back(id);
                } else {
                    self.free_queue.push_front(id);
                }
            }
        }
    }

    /// Registers a referenced, full block holding `tokens` under `hash`, computed after the KV
    /// that the cached block `parent` holds (`None`: the first block of a sequence) under cache
    /// key `key` (a parent's own key: a chain has one key).
    ///
    /// Returns the cached block that now holds this KV, to pass as the next block's parent:
    /// `block` itself (registered now or already), or the block that already holds `hash` with
    /// the same tokens after the same parent (a duplicate; `block` stays uncached). `None` (and
    /// `block` stays uncached) if the hash is taken by other content or `parent` is stale.
    pub fn cache_block(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        parent: Option<CachedBlockRef>,
        key: u64,
        tokens: &[TokenId],
    ) -> Option<CachedBlockRef> {
        assert_eq!(tokens.len(), self.block_size, "only full blocks are cached");
        assert!(self.blocks[block.index()].ref_cnt > 0, "caching an unreferenced {block:?}");
        if parent.is_some_and(|p| !self.is_current(p)) {
            return None;
        }
        debug_assert!(
            parent.is_none_or(|p| self.blocks[p.block.index()].key == key),
            "a chain changes its cache key"
        );
        let holder = match (self.blocks[block.index()].hash, self.cached.get(&hash)) {
            (Some(_), _) => Some(block),
            (None, Some(&other)) => Some(other),
            (None, None) => None,
        };
        if let Some(h) = holder {
            let b = &self.blocks[h.index()];
            let same = b.parent == parent && b.key == key && b.tokens == tokens;
            return if same { self.cached_ref(h) } else { None };
        }
        let b = &mut self.blocks[block.index()];
        b.hash = Some(hash);
        b.parent = parent;
        b.key = key;
        b.tokens.clear();
        b.tokens.extend_from_slice(tokens);
        self.cached.insert(hash, block);
        if self.events.is_some() {
            // A current parent is cached, so it has a hash.
            let parent = parent.and_then(|p| self.blocks[p.block.index()].hash);
            self.log_event(KvCacheEvent::Stored { hash, parent, tokens: tokens.to_vec(), key });
        }
        self.cached_ref(block)
    }

    /// Forgets every cached hash. Refused (returns `false`) while any block is referenced, since
    /// running requests may still be registering blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.free_queue.len() != self.blocks.len() {
            return false;
        }
        for b in &mut self.blocks {
            if b.hash.take().is_some() {
                b.generation += 1;
            }
            b.parent = None;
            b.key = 0;
            b.tokens.clear();
        }
        if !self.cached.is_empty() {
            self.log_event(KvCacheEvent::AllCleared);
        }
        self.cached.clear();
        true
    }

    /// Checks the invariants in the module docs.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.free_queue.check()?;
        let mut num_free = 0;
        let mut num_cached = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            let id = BlockId(i as u32);
            let queued = self.free_queue.contains(id);
            if queued != (b.ref_cnt == 0) {
                return Err(format!("{id:?}: ref_cnt {} but in free queue = {queued}", b.ref_cnt));
            }
            num_free += usize::from(queued);
            match b.hash {
                Some(h) => {
                    num_cached += 1;
                    if self.cached.get(&h) != Some(&id) {
                        return Err(format!("{id:?} has hash {h:?} but the index disagrees"));
                    }
                    if b.tokens.len() != self.block_size {
                        return Err(format!("{id:?} is cached with {} tokens", b.tokens.len()));
                    }
                }
                None if !b.tokens.is_empty() || b.parent.is_some() || b.key != 0 => {
                    return Err(format!("{id:?} is uncached but keeps tokens, a parent or a key"));
                }
                None => {}
            }
        }
        if num_free != self.free_queue.len() {
            return Err(format!("{num_free} free blocks, queue len {}", self.free_queue.len()));
        }
        if num_cached != self.cached.len() {
            return Err(format!("{num_cached} cached blocks, index has {}", self.cached.len()));
        }
        for (h, id) in &self.cached {
            if self.blocks.get(id.index()).and_then(|b| b.hash) != Some(*h) {
                return Err(format!("index maps {h:?} to {id:?}, which does not hold it"));
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

    #[test]
    fn allocate_takes_from_the_head_and_fails_atomically() {
        let mut pool = BlockPool::new(4, 2);
        assert_eq!(pool.allocate(3), Some(vec![BlockId(0), BlockId(1), BlockId(2)]));
        assert_eq!(pool.allocate(2), None);
        assert_eq!(pool.num_free_blocks(), 1);
        pool.check_invariants().unwrap();
        pool.free([BlockId(2), BlockId(1), BlockId(0)]);
        assert_eq!(pool.num_free_blocks(), 4);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn cached_free_block_is_revived_by_a_hit_and_evicted_by_allocation() {
        let mut pool = BlockPool::new(2, 2);
        let a = pool.allocate(1).unwrap()[0];
        let h = BlockHash(7);
        assert!(pool.cache_block(a, h, None, 0, &toks(&[1, 2])).is_some());
        pool.free([a]);
        assert_eq!(pool.get_cached(h, None, 0, &toks(&[1, 2])), Some(a));
        // a hit on a free block takes it out of the queue
        pool.touch(&[a]);
        assert_eq!(pool.ref_count(a), 1);
        assert_eq!(pool.num_free_blocks(), 1);
        pool.check_invariants().unwrap();
        pool.free([a]);
        // the uncached block goes first, then the cached one is evicted
        let first = pool.allocate(1).unwrap()[0];
        assert_ne!(first, a);
        assert_eq!(pool.num_cached_blocks(), 1);
        assert_eq!(pool.allocate(1).unwrap()[0], a);
        assert_eq!(pool.num_cached_blocks(), 0);
        assert_eq!(pool.num_evictions(), 1);
        assert_eq!(pool.get_cached(h, None, 0, &toks(&[1, 2])), None);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn a_hash_hit_is_verified_against_tokens_and_parent() {
        let mut pool = BlockPool::new(5, 2);
        let ids = pool.allocate(2).unwrap();
        let (p, a) = (ids[0], ids[1]);
        let pr = pool.cache_block(p, BlockHash(9), None, 0, &toks(&[7, 7]));
        assert_eq!(pr, pool.cached_ref(p));
        assert_eq!(pool.cache_block(a, BlockHash(1), pr, 0, &toks(&[1, 2])), pool.cached_ref(a));
        assert_eq!(pool.get_cached(BlockHash(1), Some(p), 0, &toks(&[1, 2])), Some(a));
        assert_eq!(pool.get_cached(BlockHash(1), Some(p), 0, &toks(&[1, 3])), None);
        assert_eq!(pool.get_cached(BlockHash(1), None, 0, &toks(&[1, 2])), None);
        assert_eq!(pool.get_cached(BlockHash(1), Some(a), 0, &toks(&[1, 2])), None);
        // a second block under the same hash with other content is refused and stays uncached
        let b = pool.allocate(1).unwrap()[0];
        assert_eq!(pool.cache_block(b, BlockHash(1), None, 0, &toks(&[5, 6])), None);
        assert_eq!(pool.block_hash(b), None);
        // a duplicate stays uncached too, and the holder stands in for it
        assert_eq!(pool.cache_block(b, BlockHash(1), pr, 0, &toks(&[1, 2])), pool.cached_ref(a));
        assert_eq!(pool.block_hash(b), None);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn an_evicted_and_recached_parent_does_not_match_its_old_children() {
        let mut pool = BlockPool::new(2, 1);
        let ids = pool.allocate(2).unwrap();
        let (p, a) = (ids[0], ids[1]);
        let old = pool.cache_block(p, BlockHash(1), None, 0, &toks(&[1]));
        assert!(pool.cache_block(a, BlockHash(2), old, 0, &toks(&[2])).is_some());
        // free the parent first so that it is evicted before its child
        pool.free([p, a]);
        assert_eq!(pool.allocate(1).unwrap(), [p]);
        assert!(!pool.is_current(old.unwrap()));
        // same content again, but a new generation: the old child is unreachable
        let new = pool.cache_block(p, BlockHash(1), None, 0, &toks(&[1]));
        assert!(new.is_some() && new != old);
        assert_eq!(pool.get_cached(BlockHash(2), Some(p), 0, &toks(&[2])), None);
        // and nothing is registered after a stale parent
        let c = pool.allocate(1).unwrap()[0];
        assert_eq!(pool.cache_block(c, BlockHash(3), old, 0, &toks(&[3])), None);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn index_changes_are_logged_in_order_and_replay_to_the_index() {
        use KvCacheEvent::{AllCleared, Removed, Stored};
        let mut pool = BlockPool::new(3, 1);
        pool.set_log_events(true);
        let ids = pool.allocate(3).unwrap();
        let p = pool.cache_block(ids[0], BlockHash(1), None, 0, &toks(&[1]));
        assert!(pool.cache_block(ids[1], BlockHash(2), p, 0, &toks(&[2])).is_some());
        // a refused registration and a duplicate log nothing
        assert!(pool.cache_block(ids[2], BlockHash(2), None, 0, &toks(&[9])).is_none());
        assert!(pool.cache_block(ids[2], BlockHash(2), p, 0, &toks(&[2])).is_some());
        assert!(pool.uncache(ids[1]));
        pool.free(ids.iter().rev().copied());
        pool.allocate(3).unwrap(); // evicts block 0
        let events = pool.take_events();
        assert_eq!(
            events,
            [
                Stored { hash: BlockHash(1), parent: None, tokens: toks(&[1]), key: 0 },
                Stored {
                    hash: BlockHash(2),
                    parent: Some(BlockHash(1)),
                    tokens: toks(&[2]),
                    key: 0
                },
                Removed { hash: BlockHash(2) },
                Removed { hash: BlockHash(1) },
            ]
        );
        assert!(pool.take_events().is_empty());
        let all: Vec<BlockId> = (0..3).map(BlockId).collect();
        pool.free(all.iter().copied());
        let b = pool.allocate(1).unwrap();
        assert!(pool.cache_block(b[0], BlockHash(5), None, 0, &toks(&[5])).is_some());
        pool.free(b);
        assert!(pool.reset_prefix_cache());
        assert!(pool.reset_prefix_cache()); // nothing cached: nothing logged
        let events = pool.take_events();
        assert_eq!(events.last(), Some(&AllCleared));
        assert_eq!(events.iter().filter(|e| **e == AllCleared).count(), 1);
        // Logging again starts from the index as it is, parents first.
        pool.set_log_events(false);
        let ids = pool.allocate(3).unwrap();
        let a = pool.cache_block(ids[2], BlockHash(10), None, 0, &toks(&[1]));
        let b = pool.cache_block(ids[1], BlockHash(11), a, 0, &toks(&[2]));
        assert!(pool.cache_block(ids[0], BlockHash(12), b, 0, &toks(&[3])).is_some());
        pool.set_log_events(true);
        assert_eq!(
            pool.take_events(),
            [
                Stored { hash: BlockHash(10), parent: None, tokens: toks(&[1]), key: 0 },
                Stored {
                    hash: BlockHash(11),
                    parent: Some(BlockHash(10)),
                    tokens: toks(&[2]),
                    key: 0
                },
                Stored {
                    hash: BlockHash(12),
                    parent: Some(BlockHash(11)),
                    tokens: toks(&[3]),
                    key: 0
                },
            ]
        );
        pool.free(ids);
        // Not logging: nothing kept.
        pool.set_log_events(false);
        let c = pool.allocate(1).unwrap();
        assert!(pool.cache_block(c[0], BlockHash(6), None, 0, &toks(&[6])).is_some());
        assert!(pool.take_events().is_empty());
    }

    #[test]
    fn reset_is_refused_while_blocks_are_in_use() {
        let mut pool = BlockPool::new(2, 1);
        let a = pool.allocate(1).unwrap();
        assert!(pool.cache_block(a[0], BlockHash(3), None, 0, &toks(&[4])).is_some());
        assert!(!pool.reset_prefix_cache());
        pool.free(a);
        assert!(pool.reset_prefix_cache());
        assert_eq!(pool.num_cached_blocks(), 0);
        pool.check_invariants().unwrap();
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut pool = BlockPool::new(1, 1);
        let a = pool.allocate(1).unwrap();
        pool.free(a.iter().copied());
        pool.free(a);
    }
}
