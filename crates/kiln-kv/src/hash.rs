//! Chained block hashes for prefix caching.
//!
//! The hash of full block `i` of a sequence is
//! `hash(parent = hash of block i-1 (None for block 0), the block's token ids, extra keys)`,
//! so equal hashes mean "same tokens after the same prefix" up to collisions. Extra keys are
//! `u64`s that change what the KV content means without changing the tokens (the KV dtype, a
//! LoRA adapter, a cache salt); every block of a sequence is hashed with the same keys.
//!
//! Invariants:
//! - Deterministic across runs, processes and platforms: the function is a fixed
//!   multiply-fold over explicit little-endian-independent `u64` words (no `RandomState`), and
//!   a golden-value test pins it.
//! - Lengths are absorbed, so `[a, b] + []` and `[a] + [b]` cannot collide structurally.
//! - A hash is only an index: the pool verifies a hit against the stored token ids and the
//!   identity of the preceding cached block before handing a block out (see `block_pool`), so a
//!   collision costs a missed hit, never wrong KV.
//!
//! Cost: one 64x64→128 multiply per two tokens.

use kiln_core::TokenId;

/// The chained hash of one full block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// A block hash function: `(parent, block tokens, extra keys) -> hash`.
///
/// [`hash_block`] is the default; tests inject weak functions to force collisions.
pub type BlockHashFn = fn(Option<BlockHash>, &[TokenId], &[u64]) -> BlockHash;

const SEED: u64 = 0x243f_6a88_85a3_08d3; // digits of pi
const K_MUL: u64 = 0x9e37_79b9_7f4a_7c15; // 2^64 / golden ratio
const K_XOR: u64 = 0xbf58_476d_1ce4_e5b9;

/// Folded multiply: the xor of the two halves of the 128-bit product.
#[inline]
fn fold_mul(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// A small streaming 64-bit hasher with fixed keys.
struct Hasher64 {
    state: u64,
}

impl Hasher64 {
    fn new() -> Self {
        Self { state: SEED }
    }

    #[inline]
    fn write(&mut self, word: u64) {
        self.state = fold_mul(self.state ^ word ^ K_XOR, K_MUL).rotate_left(29);
    }

    /// splitmix64's finaliser: every input bit affects every output bit.
    fn finish(self) -> u64 {
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// The default chained block hash.
pub fn hash_block(parent: Option<BlockHash>, tokens: &[TokenId], extra_keys: &[u64]) -> BlockHash {
    let mut h = Hasher64::new();
    match parent {
        None => h.write(0),
        Some(p) => {
            h.write(1);
            h.write(p.0);
        }
    }
    h.write(tokens.len() as u64);
    let mut pairs = tokens.chunks_exact(2);
    for pair in &mut pairs {
        h.write(u64::from(pair[0].0) | (u64::from(pair[1].0) << 32));
    }
    if let [last] = pairs.remainder() {
        h.write(u64::from(last.0));
    }
    h.write(extra_keys.len() as u64);
    for &k in extra_keys {
        h.write(k);
    }
    BlockHash(h.finish())
}

/// The parent hash that a chain of cache key `key` starts from (`None` for key 0, the shared
/// chains): mixed into a keyed chain's first block, it makes every hash of the chain differ from
/// the same tokens' hashes under any other key.
pub fn chain_root(key: u64) -> Option<BlockHash> {
    (key != 0).then(|| {
        let mut h = Hasher64::new();
        h.write(0x6b65_7965_645f_726f); // a tag: no token block hashes to this alone
        h.write(key);
        BlockHash(h.finish())
    })
}

/// `BuildHasher` for maps keyed by [`BlockHash`]: the key already is a hash, so hashing it again
/// with SipHash is wasted work; one folded multiply keeps a weak injected hash function usable.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BlockHashState;

pub(crate) struct BlockHashHasher(u64);

impl std::hash::Hasher for BlockHashHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = fold_mul(self.0 ^ u64::from(b), K_MUL);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = fold_mul(self.0 ^ v, K_MUL);
    }
}

impl std::hash::BuildHasher for BlockHashState {
    type Hasher = BlockHashHasher;

    fn build_hasher(&self) -> BlockHashHasher {
        BlockHashHasher(SEED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn toks(ids: &[u32]) -> Vec<TokenId> {
        ids.iter().map(|&t| TokenId(t)).collect()
    }

    #[test]
    fn golden_value_is_stable() {
        // Pinned so that a change of the function (which would silently invalidate any
        // persisted or cross-process cache) is a deliberate decision.
        let h0 = hash_block(None, &toks(&[1, 2, 3]), &[]);
        let h1 = hash_block(Some(h0), &toks(&[4, 5, 6]), &[7]);
        assert_eq!(h0, hash_block(None, &toks(&[1, 2, 3]), &[]));
        assert_eq!((h0.0, h1.0), GOLDEN);
    }

    const GOLDEN: (u64, u64) = (0x8338_93a0_98ee_92bf, 0x82fc_3d93_1a7f_0d7f);

    #[test]
    fn every_input_part_matters() {
        let base = hash_block(None, &toks(&[1, 2, 3, 4]), &[9]);
        assert_ne!(base, hash_block(None, &toks(&[1, 2, 3, 5]), &[9]));
        assert_ne!(base, hash_block(None, &toks(&[2, 1, 3, 4]), &[9]));
        assert_ne!(base, hash_block(None, &toks(&[1, 2, 3, 4]), &[8]));
        assert_ne!(base, hash_block(None, &toks(&[1, 2, 3, 4]), &[]));
        assert_ne!(base, hash_block(Some(BlockHash(0)), &toks(&[1, 2, 3, 4]), &[9]));
        assert_ne!(
            hash_block(Some(BlockHash(1)), &toks(&[1]), &[]),
            hash_block(Some(BlockHash(2)), &toks(&[1]), &[])
        );
        // length is absorbed: a trailing zero token is not the same block
        assert_ne!(hash_block(None, &toks(&[1]), &[]), hash_block(None, &toks(&[1, 0]), &[]));
    }

    #[test]
    fn no_collisions_over_a_small_exhaustive_space() {
        // every block of 4 tokens over a vocabulary of 16, under two parents: 131,072 hashes
        let mut seen = HashSet::new();
        for parent in [None, Some(BlockHash(12345))] {
            for code in 0u32..16 * 16 * 16 * 16 {
                let t = toks(&[code & 15, (code >> 4) & 15, (code >> 8) & 15, code >> 12]);
                assert!(seen.insert(hash_block(parent, &t, &[])));
            }
        }
    }
}
