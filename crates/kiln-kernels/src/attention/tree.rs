//! Token-tree rows ([`kiln_backend::TreeKeys`]): a node of a speculative token tree sees the
//! keys of its sequence up to the tree's root through the block table, then its ancestors' and
//! its own keys, which sit in the tree's slots rather than at their positions.
//!
//! A tree row takes part in its tile's shared pass for the blocks of positions that hold no
//! tree key (read in place, their loads shared with the tile's other rows). The blocks from the
//! one holding its first tree key on are attended here, the row alone: their visible keys are
//! gathered, in position order, into per-thread f32 scratch (widened exactly, or dequantized as
//! an 8-bit cache's block reads are). The micro kernels give the same bits whatever the element
//! type of equal values, the stride and the rows sharing a call, so a node row equals, bitwise,
//! the row of the same tokens decoded one at a time (tested).

use super::{
    BlockKv, KvElem, KvScratch, KvSource, RowState, Rows, Scratch, Tile, TreeMask, attend_rows,
    tree_keys,
};
use crate::SimdLevel;
use crate::thread_pool::SharedMut;
use kiln_backend::TreeKeys;
use kiln_backend::ops::AttentionShape;

/// The end (exclusive) of the positions a tree row reads in place with its tile: every block
/// before the one holding its first tree key.
pub(super) fn shared_end(keys: TreeKeys, block_size: usize) -> usize {
    let first_tree_pos = (keys.pos - keys.len + 1) as usize;
    first_tree_pos / block_size * block_size
}

/// Attends the tree rows of a tile (their shared blocks done, `st` holding every row's state)
/// over the blocks holding their tree keys, each row alone.
///
/// # Safety
/// No other thread may access the tile's rows of `out` meanwhile.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attend_tree_rows<S: KvSource>(
    level: SimdLevel,
    q: &[f32],
    source: &S,
    tile: &Tile<'_>,
    tree: TreeMask<'_>,
    shape: &AttentionShape,
    st: &mut RowState,
    scratch: &mut Scratch,
    out: SharedMut<f32>,
) {
    // Rows are (token, head) pairs, `nh` heads per token, as `attend_tile` lays them out.
    let nh = tile.heads.len();
    let q: &[f32] = if source.rotated() { &scratch.q } else { q };
    for r in 0..tile.tokens.len() * nh {
        let token = tile.seq.query_start + tile.tokens.start + r / nh;
        if let Some(keys) = tree_keys(Some(tree), token) {
            let slots = &tree.slots[keys.start as usize..][..keys.len as usize];
            let bufs = (&mut scratch.kv, &mut scratch.gather);
            // SAFETY: forwarded from the caller.
            unsafe {
                attend_tree_keys(level, q, source, tile, (r, keys, slots), shape, st, bufs, out);
            }
        }
    }
}

/// Attends row `r` of the tile (a tree row with `keys`, whose shared blocks are done) over
/// the blocks from `st.end[r]` on: the positions up to its root through the block table, then
/// `slots` (its tree keys, in position order).
///
/// # Safety
/// No other thread may access the row of `out` meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn attend_tree_keys<S: KvSource>(
    level: SimdLevel,
    q: &[f32],
    source: &S,
    tile: &Tile<'_>,
    (r, keys, slots): (usize, TreeKeys, &[u32]),
    shape: &AttentionShape,
    st: &mut RowState,
    (kv, gather): (&mut KvScratch, &mut KvScratch),
    out: SharedMut<f32>,
) {
    let (hd, bs) = (shape.head_dim, shape.block_size);
    let pos = keys.pos as usize;
    let first_tree_pos = pos + 1 - keys.len as usize;
    let lo = st.lo[r];
    for block in st.end[r].max(lo) / bs..=pos / bs {
        let (b0, b1) = (block * bs, (block + 1) * bs);
        // Keys of this block through the block table, then tree keys (by position).
        let (j0, j1) = (b0.max(lo), b1.min(first_tree_pos));
        let (t0, t1) = (b0.max(lo).max(first_tree_pos), b1.min(pos + 1));
        let n = j1.saturating_sub(j0) + t1.saturating_sub(t0);
        if n == 0 {
            continue;
        }
        gather.k.resize(n * hd, 0.0);
        gather.v.resize(n * hd, 0.0);
        let mut at = 0;
        if j0 < j1 {
            let id = tile.block_table[block] as usize;
            let rows = source.block(level, id, j0 - b0..j1 - b0, tile.kv_head, shape, kv);
            for i in 0..j1 - j0 {
                widen_row(
                    &rows,
                    i,
                    hd,
                    (&mut gather.k[at * hd..][..hd], &mut gather.v[at * hd..][..hd]),
                );
                at += 1;
            }
        }
        for p in t0..t1 {
            let slot = slots[p - first_tree_pos] as usize;
            let (id, offset) = (slot / bs, slot % bs);
            let rows = source.block(level, id, offset..offset + 1, tile.kv_head, shape, kv);
            widen_row(
                &rows,
                0,
                hd,
                (&mut gather.k[at * hd..][..hd], &mut gather.v[at * hd..][..hd]),
            );
            at += 1;
        }
        let job = Rows { first: r, keys: n, k: &gather.k[..], v: &gather.v[..], stride: hd };
        // SAFETY: forwarded from the caller.
        unsafe { attend_rows::<f32, 1>(level, q, &job, shape, st, out) };
    }
}

/// Copies key and value row `i` of `kv`, widened to f32 (exactly), into `k` and `v`.
fn widen_row<E: KvElem>(
    kv: &BlockKv<'_, E>,
    i: usize,
    hd: usize,
    (k, v): (&mut [f32], &mut [f32]),
) {
    for (d, s) in k.iter_mut().zip(&kv.k[i * kv.stride..][..hd]) {
        *d = s.to_f32();
    }
    for (d, s) in v.iter_mut().zip(&kv.v[i * kv.stride..][..hd]) {
        *d = s.to_f32();
    }
}
