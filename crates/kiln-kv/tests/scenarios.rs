//! Hand-written scenarios: LRU eviction order, hash collisions refused, forks sharing blocks.

#![allow(clippy::unwrap_used)]

use kiln_core::{BlockId, RequestId, TokenId};
use kiln_kv::{BlockHash, BlockHashFn, KvCacheConfig, KvCacheManager, hash_block};

fn toks(ids: &[u32]) -> Vec<TokenId> {
    ids.iter().map(|&t| TokenId(t)).collect()
}

fn config(num_blocks: usize, block_size: usize) -> KvCacheConfig {
    KvCacheConfig { block_size, num_blocks, enable_prefix_caching: true, extra_keys: vec![] }
}

fn ids(blocks: impl IntoIterator<Item = BlockId>) -> Vec<u32> {
    blocks.into_iter().map(|b| b.0).collect()
}

/// Allocates and "computes" a whole sequence in one step.
fn run(m: &mut KvCacheManager, req: u64, t: &[TokenId]) {
    m.allocate_slots(RequestId(req), t, 0, t.len(), 0).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn freed_blocks_are_evicted_lru_and_tail_first() {
    let mut m = KvCacheManager::new(config(6, 2));
    let a = toks(&[1, 2, 3, 4]);
    let b = toks(&[5, 6, 7, 8]);
    run(&mut m, 1, &a); // blocks 0, 1
    run(&mut m, 2, &b); // blocks 2, 3
    m.free(RequestId(1));
    m.free(RequestId(2));
    // never-used blocks first, then A tail-first, then B tail-first
    assert_eq!(ids(m.pool().free_blocks()), [4, 5, 1, 0, 3, 2]);
    let with_next = |t: &[TokenId]| [t, &toks(&[0])].concat();
    assert_eq!(m.lookup_prefix(&with_next(&a)).num_cached_tokens, 4);

    // Under pressure: 3 blocks take the 2 unused ones, then A's tail.
    run(&mut m, 3, &toks(&[9; 6]));
    assert_eq!(ids(m.block_table(RequestId(3)).iter().copied()), [4, 5, 1]);
    assert_eq!(m.lookup_prefix(&with_next(&a)).num_cached_tokens, 2);
    assert_eq!(m.lookup_prefix(&with_next(&b)).num_cached_tokens, 4);

    // Two more: A's head, then B's tail; B's head survives.
    run(&mut m, 4, &toks(&[7, 7, 7, 7]));
    assert_eq!(ids(m.block_table(RequestId(4)).iter().copied()), [0, 3]);
    assert_eq!(m.lookup_prefix(&with_next(&a)).num_cached_tokens, 0);
    assert_eq!(m.lookup_prefix(&with_next(&b)).num_cached_tokens, 2);
    assert_eq!(m.pool().num_evictions(), 3);
    m.check_invariants().unwrap();
}

#[test]
fn a_hit_on_a_free_block_protects_it_from_eviction() {
    let mut m = KvCacheManager::new(config(4, 2));
    let a = toks(&[1, 2, 3, 4, 5]);
    run(&mut m, 1, &a); // blocks 0, 1, 2
    m.free(RequestId(1));
    // [5]'s uncached block first, then the unused one, then A tail-first
    assert_eq!(ids(m.pool().free_blocks()), [2, 3, 1, 0]);
    let b = toks(&[1, 2, 8, 8, 8, 8, 8, 8]);
    assert_eq!(m.lookup_prefix(&b).blocks, [BlockId(0)]);
    // B needs every block: 1 hit + 3 new; the hit must not be taken for the new ones
    let new = m.allocate_slots(RequestId(2), &b, 2, 6, 0).unwrap();
    assert_eq!(ids(new), [2, 3, 1]);
    assert_eq!(m.block_table(RequestId(2))[0], BlockId(0));
    m.check_invariants().unwrap();
}

/// Every block of a given depth collides, whatever its tokens.
fn hash_by_depth(parent: Option<BlockHash>, _tokens: &[TokenId], _extra: &[u64]) -> BlockHash {
    BlockHash(parent.map_or(0, |p| p.0 + 1))
}

/// Ignores the parent: the same tokens collide at any depth.
fn hash_without_parent(_parent: Option<BlockHash>, tokens: &[TokenId], e: &[u64]) -> BlockHash {
    hash_block(None, tokens, e)
}

#[test]
fn a_colliding_hash_with_other_tokens_is_not_a_hit() {
    let weak: BlockHashFn = hash_by_depth;
    let mut m = KvCacheManager::with_hash_fn(config(8, 2), weak);
    run(&mut m, 1, &toks(&[1, 2, 3, 4, 5]));
    // same hashes as request 1 at every depth, different tokens in block 0
    let b = toks(&[1, 9, 3, 4, 5]);
    assert_eq!(m.lookup_prefix(&b).num_cached_tokens, 0);
    // B's blocks cannot be registered under the taken hashes: they stay uncached
    run(&mut m, 2, &b);
    assert!(m.block_table(RequestId(2)).iter().all(|&blk| m.pool().block_hash(blk).is_none()));
    // a genuine match still hits under the weak hash
    assert_eq!(m.lookup_prefix(&toks(&[1, 2, 3, 4, 6])).num_cached_tokens, 4);
    assert_eq!(m.lookup_prefix(&toks(&[1, 2, 3, 7, 6])).num_cached_tokens, 2);
}

#[test]
fn same_tokens_after_another_parent_are_not_a_hit() {
    let weak: BlockHashFn = hash_without_parent;
    let mut m = KvCacheManager::with_hash_fn(config(8, 2), weak);
    run(&mut m, 1, &toks(&[1, 2, 3, 4, 5]));
    // block 0 of this sequence has the hash and tokens of request 1's block 1, but its KV was
    // computed after [1, 2]: the stored parent block tells them apart
    assert_eq!(m.lookup_prefix(&toks(&[3, 4, 5])).num_cached_tokens, 0);
    assert_eq!(m.lookup_prefix(&toks(&[1, 2, 3, 4, 5])).num_cached_tokens, 4);
    m.check_invariants().unwrap();
}

#[test]
fn extra_keys_separate_caches() {
    let t = toks(&[1, 2, 3]);
    assert_ne!(hash_block(None, &t[..2], &[1]), hash_block(None, &t[..2], &[2]));
    let mut m = KvCacheManager::new(KvCacheConfig { extra_keys: vec![42], ..config(4, 2) });
    run(&mut m, 1, &t);
    assert_eq!(m.lookup_prefix(&t).num_cached_tokens, 2);
    let h = m.pool().block_hash(m.block_table(RequestId(1))[0]).unwrap();
    assert_eq!(h, hash_block(None, &t[..2], &[42]));
}

#[test]
fn fork_shares_full_blocks_and_the_child_recomputes_the_partial_one() {
    let mut m = KvCacheManager::new(config(8, 4));
    let (p, c) = (RequestId(1), RequestId(2));
    let t = toks(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
    m.allocate_slots(p, &t, 0, 10, 0).unwrap(); // 3 blocks, the last one partial
    let parent_table = m.block_table(p).to_vec();

    let num_computed = m.fork(p, c, 10);
    assert_eq!(num_computed, 8);
    assert_eq!(m.block_table(c), &parent_table[..2]);
    assert_eq!(m.pool().ref_count(parent_table[0]), 2);
    assert_eq!(m.pool().ref_count(parent_table[2]), 1);
    m.check_invariants().unwrap();

    // the child recomputes tokens 8..10 into its own block and samples its own token
    let mut ct = t.clone();
    ct.push(TokenId(77));
    let new = m.allocate_slots(c, &ct, 8, 3, 0).unwrap();
    assert_eq!(new.len(), 1);
    assert!(!parent_table.contains(&new[0]));
    m.check_invariants().unwrap();

    m.free(p);
    assert_eq!(m.pool().ref_count(parent_table[0]), 1);
    m.check_invariants().unwrap();
    m.free(c);
    assert_eq!(m.num_free_blocks(), 8);
    m.check_invariants().unwrap();

    assert_eq!(m.fork(RequestId(9), RequestId(10), 100), 0);
    assert!(!m.contains(RequestId(10)));
}

#[test]
fn a_recomputed_duplicate_block_does_not_stop_caching_what_follows() {
    let mut m = KvCacheManager::new(config(8, 2));
    let prompt = toks(&[1, 2, 3, 4]);
    run(&mut m, 1, &[prompt.clone(), toks(&[7, 7, 0])].concat());
    m.free(RequestId(1));
    // The same prompt again: the hit is capped at 1 block, so [3, 4] is recomputed into a new
    // block, a duplicate of the cached one, which stays uncached...
    let (b, mut t) = (RequestId(2), prompt.clone());
    assert_eq!(m.lookup_prefix(&t).num_cached_tokens, 2);
    m.allocate_slots(b, &t, 2, 2, 0).unwrap();
    assert_eq!(m.pool().block_hash(m.block_table(b)[1]), None);
    // ...yet the blocks B generates after it are cached, chained to the cached duplicate.
    t.extend(toks(&[5, 6]));
    m.allocate_slots(b, &t, 4, 2, 0).unwrap();
    m.check_invariants().unwrap();
    m.free(b);
    let hit = m.lookup_prefix(&toks(&[1, 2, 3, 4, 5, 6, 0]));
    assert_eq!(hit.num_cached_tokens, 6);
    assert_eq!(m.lookup_prefix(&toks(&[1, 2, 3, 4, 7, 7, 0])).num_cached_tokens, 6);
}
