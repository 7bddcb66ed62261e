//! Seeded random operations against a shadow model of KV memory.
//!
//! A handful of requests over a vocabulary of 3 tokens and blocks of 1-4 tokens, so prefixes
//! collide constantly: admit (with or without the prefix hit, whole or partial), prefill in
//! chunks, decode with lookahead, preempt (after a step, or right after an allocation whose step
//! never runs) and resume, finish, abort, fork. Each prompt gets one of three cache keys (0
//! shared, 1 and 2 as two LoRA adapters). The shadow `kv` records, for every slot, the key and
//! the token prefix whose last token's KV was "computed" into it. After every operation: the
//! manager's invariants hold, every running request's computed positions still map to slots
//! holding its own key and prefix, every hit maps to slots holding the querying key and prefix, only
//! unshared blocks are ever written, and allocation takes the free queue's head. At the end,
//! after freeing everything, every block is free.

#![allow(clippy::unwrap_used)]

use kiln_core::{BlockId, RequestId, TokenId};
use kiln_kv::{BlockHash, BlockHashFn, KvCacheConfig, KvCacheManager, hash_block};

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
}

const VOCAB: u32 = 3;
const MAX_LEN: usize = 36;
const NUM_SLOTS: usize = 5;

#[derive(Default)]
struct Req {
    id: Option<RequestId>,
    tokens: Vec<TokenId>,
    /// Its cache key (what else its KV depends on).
    key: u64,
    num_computed: usize,
}

#[derive(Default, Debug)]
struct Counters {
    hit_tokens: usize,
    failed_allocations: usize,
    forks: usize,
    preemptions: usize,
    uncomputed_frees: usize,
}

/// The cache key and the prefix whose last token's KV a slot holds (`None`: never written).
type SlotKv = Option<(u64, Vec<TokenId>)>;

struct Sim {
    m: KvCacheManager,
    bs: usize,
    /// `[num_blocks][block_size]`.
    kv: Vec<Vec<SlotKv>>,
    reqs: Vec<Req>,
    next_id: u64,
    rng: Rng,
    n: Counters,
}

impl Sim {
    fn new(config: KvCacheConfig, hash_fn: BlockHashFn, seed: u64) -> Self {
        let bs = config.block_size;
        let kv = vec![vec![None; bs]; config.num_blocks];
        Self {
            m: KvCacheManager::with_hash_fn(config, hash_fn),
            bs,
            kv,
            reqs: (0..NUM_SLOTS).map(|_| Req::default()).collect(),
            next_id: 0,
            rng: Rng(seed),
            n: Counters::default(),
        }
    }

    fn fresh_id(&mut self) -> RequestId {
        self.next_id += 1;
        RequestId(self.next_id)
    }

    fn random_tokens(&mut self, len: usize) -> Vec<TokenId> {
        (0..len).map(|_| TokenId(self.rng.below(VOCAB as usize) as u32)).collect()
    }

    fn slot(&self, block: BlockId, pos: usize) -> Option<(u64, &[TokenId])> {
        self.kv[block.index()][pos % self.bs].as_ref().map(|(k, t)| (*k, t.as_slice()))
    }

    /// The blocks' slots hold exactly the KV of `tokens[..(i + 1) * bs]` under `key`, block by
    /// block.
    fn assert_blocks_hold(&self, blocks: &[BlockId], key: u64, tokens: &[TokenId], n: usize) {
        for pos in 0..n {
            let held = self.slot(blocks[pos / self.bs], pos);
            assert_eq!(held, Some((key, &tokens[..=pos])), "slot of position {pos} holds other KV");
        }
    }

    /// The "forward pass": writes KV for positions `from..to` of slot `s`.
    fn compute(&mut self, s: usize, from: usize, to: usize) {
        let id = self.reqs[s].id.unwrap();
        for pos in from..to {
            let block = self.m.block_table(id)[pos / self.bs];
            assert_eq!(self.m.pool().ref_count(block), 1, "write into a shared block");
            let r = &self.reqs[s];
            self.kv[block.index()][pos % self.bs] = Some((r.key, r.tokens[..=pos].to_vec()));
        }
        self.reqs[s].num_computed = to;
    }

    /// `allocate_slots` with the checks that it is atomic and takes the queue's head.
    fn allocate(&mut self, s: usize, id: RequestId, num_computed: usize, num_new: usize) -> bool {
        let lookahead = if self.rng.one_in(4) { self.rng.range(1, 3) } else { 0 };
        let before_table = self.m.block_table(id).to_vec();
        let before_free: Vec<BlockId> = self.m.pool().free_blocks().collect();
        let (tokens, key) = (&self.reqs[s].tokens, self.reqs[s].key);
        let hit = if self.m.contains(id) {
            vec![]
        } else {
            self.m.lookup_prefix_keyed(tokens, key).blocks
        };
        let Some(new) = self.m.allocate_slots(id, tokens, num_computed, num_new, lookahead) else {
            self.n.failed_allocations += 1;
            assert_eq!(self.m.block_table(id), before_table.as_slice());
            assert_eq!(self.m.pool().free_blocks().collect::<Vec<_>>(), before_free);
            return false;
        };
        let table = self.m.block_table(id);
        assert_eq!(&table[..before_table.len()], before_table.as_slice());
        assert_eq!(&table[table.len() - new.len()..], new.as_slice());
        assert!(table.len() * self.bs >= num_computed + num_new + lookahead);
        let pinned = &table[before_table.len()..table.len() - new.len()];
        assert_eq!(pinned, &hit[..pinned.len()]);
        let expected: Vec<BlockId> =
            before_free.into_iter().filter(|b| !pinned.contains(b)).take(new.len()).collect();
        assert_eq!(new, expected, "allocation must take the LRU head");
        true
    }

    fn admit(&mut self, s: usize) {
        if self.reqs[s].tokens.is_empty() {
            // a fresh prompt, often behind a shared "system prompt" so that hits are long
            let mut t = if self.rng.one_in(2) { vec![TokenId(0); 2 * self.bs] } else { vec![] };
            let len = self.rng.range(1, 14);
            t.extend(self.random_tokens(len));
            self.reqs[s].tokens = t;
            self.reqs[s].key = self.rng.below(3) as u64;
        }
        let id = self.fresh_id();
        let key = self.reqs[s].key;
        self.m.set_cache_key(id, key);
        let tokens = &self.reqs[s].tokens;
        let hit = self.m.lookup_prefix_keyed(tokens, key);
        assert!(hit.num_cached_tokens < tokens.len());
        assert_eq!(hit.num_cached_tokens, hit.blocks.len() * self.bs);
        for (i, &b) in hit.blocks.iter().enumerate() {
            let cached = self.m.pool().cached_tokens(b).unwrap();
            assert_eq!(cached, &tokens[i * self.bs..(i + 1) * self.bs]);
        }
        self.assert_blocks_hold(&hit.blocks, key, tokens, hit.num_cached_tokens);
        let num_blocks_used = if self.rng.one_in(5) {
            let n = hit.blocks.len();
            self.rng.range(0, n)
        } else {
            hit.blocks.len()
        };
        let num_cached = num_blocks_used * self.bs;
        let num_new = self.rng.range(1, tokens.len() - num_cached);
        if self.allocate(s, id, num_cached, num_new) {
            self.n.hit_tokens += num_cached;
            self.reqs[s].id = Some(id);
            self.compute(s, num_cached, num_cached + num_new);
        } else {
            self.m.free(id); // never admitted: forgets its key
        }
    }

    fn step(&mut self, s: usize) {
        let id = self.reqs[s].id.unwrap();
        let r = &self.reqs[s];
        let (num_computed, len) = (r.num_computed, r.tokens.len());
        if num_computed == len && len >= MAX_LEN {
            self.finish(s, false);
            return;
        }
        let num_new = if num_computed < len {
            self.rng.range(1, len - num_computed) // prefill chunk
        } else {
            let t = self.random_tokens(1); // decode: the sampled token is computed next step
            self.reqs[s].tokens.extend(t);
            1
        };
        if !self.allocate(s, id, num_computed, num_new) {
            if self.rng.one_in(2) {
                self.finish(s, true);
            }
        } else if self.rng.one_in(10) {
            // preempted in the same pass, before the step ran: the new slots hold nothing
            self.m.free_with_computed(id, num_computed);
            self.reqs[s].id = None;
            self.reqs[s].num_computed = 0;
            self.n.uncomputed_frees += 1;
        } else {
            self.compute(s, num_computed, num_computed + num_new);
        }
    }

    /// Finish/abort (`keep == false`) or preempt (`keep == true`: resumes with the same tokens).
    fn finish(&mut self, s: usize, keep: bool) {
        let id = self.reqs[s].id.take().unwrap();
        let table = self.m.block_table(id).to_vec();
        self.m.free(id);
        self.reqs[s].num_computed = 0;
        if keep {
            self.n.preemptions += 1;
        } else {
            self.reqs[s].tokens.clear();
        }
        // newly free cached blocks sit at the tail, the request's tail block first
        let freed_cached: Vec<BlockId> = table
            .iter()
            .rev()
            .copied()
            .filter(|&b| self.m.pool().ref_count(b) == 0 && self.m.pool().block_hash(b).is_some())
            .collect();
        let free: Vec<BlockId> = self.m.pool().free_blocks().collect();
        assert_eq!(&free[free.len() - freed_cached.len()..], freed_cached.as_slice());
    }

    fn fork(&mut self, parent: usize, child: usize) {
        let pid = self.reqs[parent].id.unwrap();
        let cid = self.fresh_id();
        let num_computed = self.m.fork(pid, cid, self.reqs[parent].num_computed);
        assert_eq!(num_computed, self.reqs[parent].num_computed / self.bs * self.bs);
        self.n.forks += 1;
        let (tokens, key) = (self.reqs[parent].tokens.clone(), self.reqs[parent].key);
        assert_eq!(self.m.cache_key(cid), key);
        self.reqs[child] = Req { id: Some(cid), tokens, key, num_computed };
    }

    fn random_op(&mut self) {
        let s = self.rng.below(NUM_SLOTS);
        match (self.reqs[s].id.is_some(), self.rng.below(10)) {
            (false, 0) => {
                let running: Vec<usize> =
                    (0..NUM_SLOTS).filter(|&p| self.reqs[p].id.is_some()).collect();
                if !running.is_empty() {
                    let p = running[self.rng.below(running.len())];
                    self.fork(p, s);
                }
            }
            (false, 1) => self.reqs[s].tokens.clear(), // a preempted request is aborted
            (false, _) => self.admit(s),
            (true, 0) => {
                let preempt = self.rng.one_in(2);
                self.finish(s, preempt);
            }
            (true, _) => self.step(s),
        }
    }

    fn check(&self) {
        self.m.check_invariants().unwrap();
        for r in &self.reqs {
            if let Some(id) = r.id {
                assert_eq!(self.m.cache_key(id), r.key);
                self.assert_blocks_hold(self.m.block_table(id), r.key, &r.tokens, r.num_computed);
            }
        }
    }

    fn run(mut self, num_ops: usize) -> Counters {
        for _ in 0..num_ops {
            self.random_op();
            self.check();
        }
        for s in 0..NUM_SLOTS {
            if self.reqs[s].id.is_some() {
                self.finish(s, false);
            }
        }
        self.m.check_invariants().unwrap();
        assert_eq!(self.m.num_free_blocks(), self.m.num_blocks(), "leaked blocks");
        assert_eq!(self.m.usage(), 0.0);
        assert!(self.m.reset_prefix_cache());
        assert_eq!(self.m.pool().num_cached_blocks(), 0);
        self.n
    }
}

fn config(block_size: usize, num_blocks: usize, enable_prefix_caching: bool) -> KvCacheConfig {
    KvCacheConfig { block_size, num_blocks, enable_prefix_caching, extra_keys: vec![7] }
}

const NUM_OPS: usize = 4000;

#[test]
fn random_operations_keep_every_invariant() {
    for seed in 0..4 {
        for (bs, num_blocks) in [(1, 24), (2, 14), (3, 12), (4, 9)] {
            let n = Sim::new(config(bs, num_blocks, true), hash_block, seed).run(NUM_OPS);
            assert!(n.hit_tokens > 0 && n.failed_allocations > 0, "{bs}/{num_blocks}: {n:?}");
            assert!(n.forks > 0 && n.preemptions > 0, "{bs}/{num_blocks}: {n:?}");
            assert!(n.uncomputed_frees > 0, "{bs}/{num_blocks}: {n:?}");
        }
    }
}

#[test]
fn random_operations_without_prefix_caching() {
    for seed in 10..12 {
        let n = Sim::new(config(2, 14, false), hash_block, seed).run(NUM_OPS);
        assert_eq!(n.hit_tokens, 0);
    }
}

/// A terrible hash: the depth and the block's first token only.
fn weak_hash(parent: Option<BlockHash>, tokens: &[TokenId], _extra: &[u64]) -> BlockHash {
    let depth = parent.map_or(0, |p| (p.0 >> 8) + 1);
    BlockHash((depth << 8) | u64::from(tokens[0].0))
}

#[test]
fn random_operations_under_constant_hash_collisions() {
    for seed in 20..24 {
        for (bs, num_blocks) in [(2, 14), (3, 12)] {
            let n = Sim::new(config(bs, num_blocks, true), weak_hash, seed).run(NUM_OPS);
            assert!(n.hit_tokens > 0, "{n:?}");
        }
    }
}
