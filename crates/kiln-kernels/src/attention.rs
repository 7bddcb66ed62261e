//! Paged attention over a block-structured KV cache, with online softmax.
//!
//! KV layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V; the
//! key of sequence position `j` lives in block `block_table[j / block_size]` at offset
//! `j % block_size`. A batch is varlen: each sequence contributes `query_len` new tokens that
//! are the last `query_len` of its `context_len` cached tokens (their K/V must already be
//! written, see [`write_kv`]). Query token `i` of a sequence sits at position
//! `p = context_len - query_len + i` and attends to keys `j` with `lo <= j <= p`, where
//! `lo = p + 1 - window` for sliding-window layers and `0` otherwise (causal mask).
//!
//! One pass over the blocks per task (a tile of query tokens × the heads of one KV head, up to
//! 16 rows sharing each K/V block while it is hot): per row, the scores of a block are
//! computed, the running max and sum are rescaled once per block, and V rows are accumulated
//! into the output row. No `[seq, seq]` matrix is ever formed; per-task state is on the stack.
//! The inner loops (`micro`) have one fixed arithmetic on every ISA.

use crate::thread_pool::SharedMut;
use crate::{SimdLevel, ThreadPool, vmath};

mod micro;

/// Upper bound of `(num_heads / num_kv_heads) * head_dim` (stack accumulators).
pub const MAX_GROUP_DIM: usize = 8192;
/// Upper bound of query heads per KV head.
pub const MAX_GROUP: usize = 64;
/// Upper bound of the KV block size.
pub const MAX_BLOCK_SIZE: usize = 256;

/// Static shape of one attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Multiplies `q · k` (usually `head_dim^-0.5`).
    pub scale: f32,
    /// Keys older than `window` positions are masked (sliding-window layers).
    pub sliding_window: Option<usize>,
    /// `score = cap * tanh(score / cap)` when set.
    pub softcap: Option<f32>,
}

impl AttentionShape {
    fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Checks the static limits of this kernel.
    pub fn validate(&self) -> Result<(), String> {
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.group() > MAX_GROUP || self.group() * self.head_dim > MAX_GROUP_DIM {
            return Err(format!(
                "heads per KV head must be at most {MAX_GROUP} and, times head_dim, at most \
                 {MAX_GROUP_DIM}"
            ));
        }
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(format!("block size must be in 1..={MAX_BLOCK_SIZE}"));
        }
        Ok(())
    }
}

/// One sequence of a varlen batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionSeq {
    /// First row of this sequence in the batch's `[num_tokens, ...]` buffers.
    pub query_start: usize,
    pub query_len: usize,
    /// Tokens in the cache for this sequence, including this step's.
    pub context_len: usize,
    /// Where this sequence's block table starts in the batch's flat block-table buffer; it
    /// has `context_len.div_ceil(block_size)` entries (physical block of each logical block).
    pub block_table_start: usize,
}

/// Writes this step's `k, v` (`[num_tokens, num_kv_heads, head_dim]`) into the cache slots
/// `slot_mapping[t] = block * block_size + offset`.
pub fn write_kv(
    k: &[f32],
    v: &[f32],
    slot_mapping: &[u32],
    k_cache: &mut [f32],
    v_cache: &mut [f32],
) {
    let num_tokens = slot_mapping.len();
    if num_tokens == 0 {
        return;
    }
    let row = k.len() / num_tokens;
    assert!(k.len() == v.len() && k.len() == num_tokens * row);
    for (t, &slot) in slot_mapping.iter().enumerate() {
        let dst = slot as usize * row;
        k_cache[dst..dst + row].copy_from_slice(&k[t * row..(t + 1) * row]);
        v_cache[dst..dst + row].copy_from_slice(&v[t * row..(t + 1) * row]);
    }
}

/// Query tokens per task: with the heads of one KV head they form up to 16 rows that share
/// every K/V block while it is in L1.
fn tile_tokens(group: usize) -> usize {
    (16 / group).max(1)
}

/// `out[num_tokens, num_heads, head_dim] = attention(q[num_tokens, num_heads, head_dim], cache)`.
///
/// Tasks are (sequence, tile of query tokens, KV head). Each output row is computed by the same
/// sequence of operations whatever tile, batch or chunk it belongs to, so batching and chunked
/// prefill never change a bit of it.
pub fn paged_attention(
    pool: &ThreadPool,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    seqs: &[AttentionSeq],
    block_tables: &[u32],
    shape: &AttentionShape,
    out: &mut [f32],
) {
    let num_tokens = seqs.last().map_or(0, |s| s.query_start + s.query_len);
    let q_row = shape.num_heads * shape.head_dim;
    assert!(q.len() >= num_tokens * q_row && out.len() >= num_tokens * q_row);
    debug_assert!(shape.validate().is_ok());
    let tile = tile_tokens(shape.group());
    let num_tiles: usize = seqs.iter().map(|s| s.query_len.div_ceil(tile)).sum();
    let out_ptr = SharedMut::new(out);
    let level = SimdLevel::detect();
    pool.run(num_tiles * shape.num_kv_heads, |task| {
        let kv_head = task % shape.num_kv_heads;
        let mut t = task / shape.num_kv_heads;
        let mut seq_idx = 0;
        while t >= seqs[seq_idx].query_len.div_ceil(tile) {
            t -= seqs[seq_idx].query_len.div_ceil(tile);
            seq_idx += 1;
        }
        let seq = &seqs[seq_idx];
        let first = t * tile;
        let tokens = first..(first + tile).min(seq.query_len);
        let block_table = &block_tables[seq.block_table_start..];
        let tile_job = Tile { seq, tokens, kv_head, block_table };
        // SAFETY: this task alone writes the heads of `kv_head` for its tokens (disjoint from
        // every other task's rows).
        unsafe { attend_tile(level, q, k_cache, v_cache, &tile_job, shape, out_ptr) };
    });
}

/// The query rows one task computes.
struct Tile<'a> {
    seq: &'a AttentionSeq,
    /// Query indices within the sequence.
    tokens: std::ops::Range<usize>,
    kv_head: usize,
    block_table: &'a [u32],
}

/// Attention of the `group` heads of `kv_head` for each token of the tile.
///
/// # Safety
/// No other thread may access the tile's rows of `out` meanwhile.
unsafe fn attend_tile(
    level: SimdLevel,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    tile: &Tile<'_>,
    shape: &AttentionShape,
    out: SharedMut<f32>,
) {
    let (hd, bs, group) = (shape.head_dim, shape.block_size, shape.group());
    let kv_row = shape.num_kv_heads * hd;
    let q_row = shape.num_heads * hd;
    let seq = tile.seq;
    let num_rows = tile.tokens.len() * group;
    // Per row r = (token i, head g): position, first visible key, running max and sum.
    let mut pos = [0usize; MAX_GROUP];
    let mut lo = [0usize; MAX_GROUP];
    let mut max = [f32::NEG_INFINITY; MAX_GROUP];
    let mut sum = [0.0f32; MAX_GROUP];
    let mut scores = [0.0f32; MAX_BLOCK_SIZE];
    let row_offset = |r: usize| {
        let token = seq.query_start + tile.tokens.start + r / group;
        token * q_row + (tile.kv_head * group + r % group) * hd
    };
    for r in 0..num_rows {
        pos[r] = seq.context_len - seq.query_len + tile.tokens.start + r / group;
        lo[r] = shape.sliding_window.map_or(0, |w| (pos[r] + 1).saturating_sub(w));
        // SAFETY: the caller grants this tile's rows.
        unsafe { out.slice(row_offset(r), hd) }.fill(0.0);
    }
    // Where the K and V rows of key `j` start in the caches.
    let kv_offset = |j: usize| {
        let slot = tile.block_table[j / bs] as usize * bs + j % bs;
        slot * kv_row + tile.kv_head * hd
    };
    let first_block = lo[..num_rows].iter().min().copied().unwrap_or(0) / bs;
    let last_block = pos[..num_rows].iter().max().copied().unwrap_or(0) / bs;
    for block in first_block..=last_block {
        for r in 0..num_rows {
            let j0 = (block * bs).max(lo[r]);
            let j1 = ((block + 1) * bs).min(pos[r] + 1);
            if j0 >= j1 {
                continue;
            }
            let qr = &q[row_offset(r)..][..hd];
            let block_scores = &mut scores[..j1 - j0];
            let (k_rows, v_rows) = (&k_cache[kv_offset(j0)..], &v_cache[kv_offset(j0)..]);
            micro::scores(level, qr, k_rows, kv_row, block_scores);
            let mut block_max = f32::NEG_INFINITY;
            for s in block_scores.iter_mut() {
                *s *= shape.scale;
                if let Some(cap) = shape.softcap {
                    *s = cap * (*s / cap).tanh();
                }
                block_max = block_max.max(*s);
            }
            // SAFETY: the caller grants this tile's rows.
            let acc = unsafe { out.slice(row_offset(r), hd) };
            let new_max = max[r].max(block_max);
            if max[r] != f32::NEG_INFINITY && new_max > max[r] {
                let correction = vmath::exp(max[r] - new_max);
                sum[r] *= correction;
                for a in acc.iter_mut() {
                    *a *= correction;
                }
            }
            max[r] = new_max;
            vmath::exp_shifted_at(level, block_scores, new_max);
            for &p in block_scores.iter() {
                sum[r] += p;
            }
            micro::accumulate(level, acc, block_scores, v_rows, kv_row);
        }
    }
    for (r, total) in sum[..num_rows].iter().enumerate() {
        let inv = 1.0 / total;
        // SAFETY: the caller grants this tile's rows.
        for a in unsafe { out.slice(row_offset(r), hd) } {
            *a *= inv;
        }
    }
}

#[cfg(test)]
mod tests;
