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
//! One pass over the blocks per (token, kv head): scores of a block are computed, the running
//! max and sum are rescaled once per block, and V rows are accumulated. No `[seq, seq]` matrix
//! is ever formed; memory is `O(group × head_dim)` per task on the stack.

use crate::thread_pool::SharedMut;
use crate::{SimdLevel, ThreadPool, vec_ops, vmath};

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

/// `out[num_tokens, num_heads, head_dim] = attention(q[num_tokens, num_heads, head_dim], cache)`.
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
    let out_ptr = SharedMut::new(out);
    pool.run(num_tokens * shape.num_kv_heads, |task| {
        let token = task / shape.num_kv_heads;
        let kv_head = task % shape.num_kv_heads;
        let seq_idx = seqs.partition_point(|s| s.query_start + s.query_len <= token);
        let seq = &seqs[seq_idx];
        let position = seq.context_len - seq.query_len + (token - seq.query_start);
        let group = shape.group();
        let first_head = kv_head * group;
        let q_heads = &q[token * q_row + first_head * shape.head_dim..][..group * shape.head_dim];
        // SAFETY: each task writes the `group` heads of one (token, kv_head), disjoint from all
        // other tasks.
        let o = unsafe {
            out_ptr.slice(token * q_row + first_head * shape.head_dim, group * shape.head_dim)
        };
        let block_table = &block_tables[seq.block_table_start..];
        attend_one(q_heads, k_cache, v_cache, block_table, position, kv_head, shape, o);
    });
}

/// Attention of the `group` query heads sharing `kv_head`, for the query at `position`.
fn attend_one(
    q_heads: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    block_table: &[u32],
    position: usize,
    kv_head: usize,
    shape: &AttentionShape,
    out: &mut [f32],
) {
    let (hd, bs, group) = (shape.head_dim, shape.block_size, shape.group());
    let level = SimdLevel::detect();
    let kv_row = shape.num_kv_heads * hd;
    let lo = shape.sliding_window.map_or(0, |w| (position + 1).saturating_sub(w));
    let mut max = [f32::NEG_INFINITY; MAX_GROUP];
    let mut sum = [0.0f32; MAX_GROUP];
    let mut scores = [0.0f32; MAX_BLOCK_SIZE];
    out.fill(0.0);
    let mut j = lo;
    while j <= position {
        let logical = j / bs;
        let end = ((logical + 1) * bs).min(position + 1);
        let block_base = block_table[logical] as usize * bs;
        for g in 0..group {
            let qh = &q_heads[g * hd..(g + 1) * hd];
            let mut block_max = f32::NEG_INFINITY;
            for (s, jj) in scores.iter_mut().zip(j..end) {
                let slot = block_base + jj % bs;
                let k = &k_cache[slot * kv_row + kv_head * hd..][..hd];
                let mut score = vec_ops::dot(qh, k) * shape.scale;
                if let Some(cap) = shape.softcap {
                    score = cap * (score / cap).tanh();
                }
                *s = score;
                block_max = block_max.max(score);
            }
            let new_max = max[g].max(block_max);
            let acc = &mut out[g * hd..(g + 1) * hd];
            if max[g] != f32::NEG_INFINITY && new_max > max[g] {
                let correction = vmath::exp(max[g] - new_max);
                sum[g] *= correction;
                for a in acc.iter_mut() {
                    *a *= correction;
                }
            }
            max[g] = new_max;
            let block_scores = &mut scores[..end - j];
            vmath::exp_shifted_at(level, block_scores, new_max);
            for (&p, jj) in block_scores.iter().zip(j..end) {
                sum[g] += p;
                let slot = block_base + jj % bs;
                let v = &v_cache[slot * kv_row + kv_head * hd..][..hd];
                vec_ops::axpy(p, v, acc);
            }
        }
        j = end;
    }
    for g in 0..group {
        let inv = 1.0 / sum[g];
        out[g * hd..(g + 1) * hd].iter_mut().for_each(|a| *a *= inv);
    }
}

#[cfg(test)]
mod tests;
