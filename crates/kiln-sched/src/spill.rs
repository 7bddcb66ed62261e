//! Prefix-cache blocks spilled to the second tier: when allocation evicts a cached block from the
//! KV cache, its KV is copied to a tier slot (before its new owner writes it) and indexed here,
//! so a later prompt whose prefix runs past what the KV cache still holds continues into the
//! tier, gets the blocks copied back and skips their prefill.
//!
//! Hits are exact whatever the hash, as in the KV cache ([`kiln_kv::BlockPool`]): an entry
//! stores its tokens and its **parent**, the KV it was computed after, as it was when spilled:
//! the root (a sequence's first block), a cached block of the KV cache (a
//! [`CachedBlockRef`], stale once that block is evicted), or another spilled entry (its slot and
//! that slot's generation, bumped whenever the slot stops holding the entry). A chain continues
//! only through an entry whose hash, tokens and parent match the block verified before it.
//! When a block is evicted from the KV cache after its spilled children (the LRU evicts a
//! sequence's tail first), the children are re-pointed to its own entry; when a hit brings an
//! entry back into the KV cache, the entries after it are re-pointed to the block that now
//! holds it; otherwise a chain whose parent changed simply ends there.
//!
//! Entries are evicted oldest first when a slot is needed (a preemption by swap counts more
//! than a spilled prefix); slots a hit takes back are not reused before the next step, since
//! the step's copies into the tier run before its copies out of it.

use std::collections::{HashMap, VecDeque};

use kiln_core::{BlockId, TokenId};
use kiln_kv::{BlockHash, CachedBlockRef, EvictedBlock};

/// What a spilled block's KV was computed after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SpillParent {
    /// The first block of a sequence.
    Root,
    /// A block of the KV cache, as it was cached.
    Device(CachedBlockRef),
    /// Another spilled entry: its slot and the slot's generation then.
    Tier { slot: usize, generation: u64 },
}

#[derive(Clone, Debug)]
struct Entry {
    hash: BlockHash,
    tokens: Vec<TokenId>,
    parent: SpillParent,
}

/// What [`SpillIndex::lookup`] continues from: the last verified block of the chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChainEnd {
    /// Its hash (`None`: nothing verified yet, the chain starts at the root).
    pub hash: Option<BlockHash>,
    /// The parent a next entry must name.
    pub parent: SpillParent,
}

/// The spilled entries, by slot.
#[derive(Debug)]
pub(crate) struct SpillIndex {
    entries: Vec<Option<Entry>>,
    /// Bumped whenever a slot stops holding an entry.
    generations: Vec<u64>,
    by_hash: HashMap<BlockHash, usize>,
    /// Spilled slots, oldest first, with their generation then (stale ones are skipped).
    lru: VecDeque<(usize, u64)>,
    /// Entries whose parent is a block of the KV cache, by that block (checked when used).
    device_children: HashMap<BlockId, Vec<(usize, u64)>>,
    /// Entries whose parent is another entry, by its slot (checked when used).
    tier_children: HashMap<usize, Vec<(usize, u64)>>,
}

impl SpillIndex {
    pub fn new(num_slots: usize) -> Self {
        Self {
            entries: vec![None; num_slots],
            generations: vec![0; num_slots],
            by_hash: HashMap::new(),
            lru: VecDeque::new(),
            device_children: HashMap::new(),
            tier_children: HashMap::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Slots holding entries.
    pub fn slots(&self) -> impl Iterator<Item = usize> + '_ {
        self.by_hash.values().copied()
    }

    /// Whether a block with this hash is already spilled.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Indexes `evicted`, whose KV is being copied to the free `slot`, and re-points the entries
    /// that were computed after it to this entry.
    pub fn insert(&mut self, evicted: EvictedBlock, slot: usize) {
        debug_assert!(self.entries[slot].is_none(), "slot {slot} holds an entry");
        let generation = self.generations[slot];
        let parent = match evicted.parent {
            None => SpillParent::Root,
            Some(p) => {
                let list = self.device_children.entry(p.block()).or_default();
                push_child(list, (slot, generation), &self.generations);
                SpillParent::Device(p)
            }
        };
        let children = self.device_children.remove(&evicted.was.block()).unwrap_or_default();
        for (child, child_gen) in children {
            let was = SpillParent::Device(evicted.was);
            if let Some(e) = self.live_mut(child, child_gen).filter(|e| e.parent == was) {
                e.parent = SpillParent::Tier { slot, generation };
                let list = self.tier_children.entry(slot).or_default();
                push_child(list, (child, child_gen), &self.generations);
            }
        }
        self.by_hash.insert(evicted.hash, slot);
        self.entries[slot] = Some(Entry { hash: evicted.hash, tokens: evicted.tokens, parent });
        self.lru.push_back((slot, generation));
        // Hits leave stale records behind; keep the queue within twice the live entries.
        if self.lru.len() > 2 * self.by_hash.len() + 64 {
            let generations = &self.generations;
            self.lru.retain(|&(slot, generation)| generations[slot] == generation);
        }
    }

    fn live_mut(&mut self, slot: usize, generation: u64) -> Option<&mut Entry> {
        if self.generations[slot] == generation { self.entries[slot].as_mut() } else { None }
    }

    /// Frees the oldest entry's slot; `None` when nothing is spilled.
    pub fn evict_oldest(&mut self) -> Option<usize> {
        while let Some((slot, generation)) = self.lru.pop_front() {
            if self.generations[slot] == generation && self.entries[slot].is_some() {
                self.remove(slot);
                return Some(slot);
            }
        }
        None
    }

    /// Drops the entry in `slot` (the slot is the caller's again).
    fn remove(&mut self, slot: usize) -> Entry {
        let entry = self.entries[slot].take().expect("a live entry");
        self.by_hash.remove(&entry.hash);
        self.generations[slot] += 1;
        self.tier_children.remove(&slot);
        entry
    }

    /// The slots of the spilled blocks continuing a verified chain ending at `end` over the full
    /// blocks `chunks`, in order, as far as they match.
    pub fn lookup<'a>(
        &self,
        mut end: ChainEnd,
        chunks: impl Iterator<Item = &'a [TokenId]>,
        hash_of: impl Fn(Option<BlockHash>, &[TokenId]) -> BlockHash,
    ) -> Vec<usize> {
        let mut slots = Vec::new();
        for chunk in chunks {
            let hash = hash_of(end.hash, chunk);
            let Some(&slot) = self.by_hash.get(&hash) else { break };
            let Some(e) = &self.entries[slot] else { break };
            if e.parent != end.parent || e.tokens != chunk {
                break;
            }
            slots.push(slot);
            let generation = self.generations[slot];
            end = ChainEnd { hash: Some(hash), parent: SpillParent::Tier { slot, generation } };
        }
        slots
    }

    /// Takes the entries of a hit out of the index (their slots are the caller's again); the
    /// entries computed after the last one are re-pointed to `last_block`, the KV-cache block
    /// now holding its KV (`None`: not cached there, they are left to end their chains).
    pub fn take_hit(&mut self, slots: &[usize], last_block: Option<CachedBlockRef>) {
        let Some(&last) = slots.last() else { return };
        let children = self.tier_children.remove(&last).unwrap_or_default();
        let was = SpillParent::Tier { slot: last, generation: self.generations[last] };
        for &slot in slots {
            self.remove(slot);
        }
        let Some(block) = last_block else { return };
        for (child, child_gen) in children {
            if let Some(e) = self.live_mut(child, child_gen).filter(|e| e.parent == was) {
                e.parent = SpillParent::Device(block);
                let list = self.device_children.entry(block.block()).or_default();
                push_child(list, (child, child_gen), &self.generations);
            }
        }
    }
}

/// Adds a child to a list, first dropping the children whose slot moved on once the list has
/// grown, so lists stay within twice their live entries (plus a few).
fn push_child(list: &mut Vec<(usize, u64)>, child: (usize, u64), generations: &[u64]) {
    if list.len() >= 8 {
        list.retain(|&(slot, generation)| generations[slot] == generation);
    }
    list.push(child);
}

#[cfg(test)]
mod tests {
    use kiln_kv::BlockPool;

    use super::*;

    const BS: usize = 2;

    /// A hash that ignores the parent: every block with the same tokens collides.
    fn weak_hash(_: Option<BlockHash>, tokens: &[TokenId]) -> BlockHash {
        BlockHash(tokens.iter().map(|t| u64::from(t.0)).sum())
    }

    fn toks(a: u32) -> Vec<TokenId> {
        vec![TokenId(a), TokenId(a + 1)]
    }

    /// A pool of 4 blocks that cached the chain `chunks` (freed tail first, as a request's
    /// blocks are) and then evicted it all, tail first, into a new index of 8 slots.
    fn spilled(chunks: &[Vec<TokenId>]) -> (BlockPool, SpillIndex) {
        let mut pool = BlockPool::new(4, BS);
        pool.set_log_evictions(true);
        let blocks = pool.allocate(chunks.len()).unwrap();
        let (mut parent, mut parent_hash) = (None, None);
        for (&b, chunk) in blocks.iter().zip(chunks) {
            let hash = weak_hash(parent_hash, chunk);
            parent = pool.cache_block(b, hash, parent, 0, chunk);
            assert!(parent.is_some());
            parent_hash = Some(hash);
        }
        pool.free(blocks.iter().rev().copied());
        let mut index = SpillIndex::new(8);
        let all = pool.allocate(pool.num_free_blocks()).unwrap();
        for (slot, e) in pool.take_evicted().into_iter().enumerate() {
            index.insert(e, slot);
        }
        pool.free(all);
        (pool, index)
    }

    /// A block of `pool` cached as the first of a sequence, holding `tokens`.
    fn cache_first(pool: &mut BlockPool, tokens: &[TokenId]) -> ChainEnd {
        let b = pool.allocate(1).unwrap()[0];
        let r = pool.cache_block(b, weak_hash(None, tokens), None, 0, tokens).unwrap();
        ChainEnd { hash: Some(weak_hash(None, tokens)), parent: SpillParent::Device(r) }
    }

    fn root() -> ChainEnd {
        ChainEnd { hash: None, parent: SpillParent::Root }
    }

    #[test]
    fn a_chain_spilled_tail_first_is_found_whole() {
        let chunks = [toks(10), toks(20), toks(30)];
        let (_, index) = spilled(&chunks);
        assert_eq!(index.len(), 3);
        let found = index.lookup(root(), chunks.iter().map(Vec::as_slice), weak_hash);
        assert_eq!(found.len(), 3, "children were re-pointed to their parents' entries");
    }

    #[test]
    fn a_colliding_hash_after_another_parent_is_no_hit() {
        // [10][30] is spilled; [20][30] collides on its second block (the hash ignores parents).
        let (mut pool, index) = spilled(&[toks(10), toks(30)]);
        let other = [toks(20), toks(30)];
        assert!(index.lookup(root(), other.iter().map(Vec::as_slice), weak_hash).is_empty());
        // From a verified [20] in the KV cache, [30] is still no hit: its parent is [10].
        let end = cache_first(&mut pool, &other[0]);
        assert!(index.lookup(end, std::iter::once(other[1].as_slice()), weak_hash).is_empty());
        let mine = [toks(10), toks(30)];
        assert_eq!(index.lookup(root(), mine.iter().map(Vec::as_slice), weak_hash).len(), 2);
    }

    #[test]
    fn a_hit_taken_back_leaves_its_children_reachable_from_the_new_block() {
        let chunks = [toks(10), toks(20), toks(30)];
        let (mut pool, mut index) = spilled(&chunks);
        // The first block comes back into the KV cache (a hit of one block).
        let first = index.lookup(root(), std::iter::once(chunks[0].as_slice()), weak_hash);
        assert_eq!(first.len(), 1);
        let end = cache_first(&mut pool, &chunks[0]);
        let SpillParent::Device(r) = end.parent else { unreachable!() };
        index.take_hit(&first, Some(r));
        assert_eq!(index.len(), 2);
        let rest = index.lookup(end, chunks[1..].iter().map(Vec::as_slice), weak_hash);
        assert_eq!(rest.len(), 2);
        // Evicting the oldest entry ends the chain there (a stale parent never matches).
        let oldest = index.evict_oldest().unwrap();
        assert!(rest.contains(&oldest));
        let after = index.lookup(end, chunks[1..].iter().map(Vec::as_slice), weak_hash);
        assert!(after.len() < 2);
    }
}
