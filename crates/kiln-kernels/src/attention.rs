//! Paged attention over a block-structured KV cache, with online softmax.
//!
//! KV layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V; the
//! key of sequence position `j` lives in block `block_table[j / block_size]` at offset
//! `j % block_size`. A batch is varlen: each sequence contributes `query_len` new tokens that
//! are the last `query_len` of its `context_len` cached tokens (their K/V must already be
//! written, see [`write_kv`]). Query token `i` of a sequence sits at position
//! `p = context_len - query_len + i` and attends to keys `j` with `lo <= j <= p`, where
//! `lo = p + 1 - window` for sliding-window layers and `0` otherwise (causal mask); a non-causal
//! shape (an encoder) lets every query see keys `0..context_len` instead. A token-tree
//! row ([`kiln_backend::TreeKeys`]) has its own position and sees the keys of its path instead
//! (`tree`).
//!
//! One pass over the blocks per task (a tile of query tokens × the heads of one KV head, or a
//! share of those heads when tasks are fewer than threads; up to 16 rows sharing each K/V block
//! while it is hot, 64 over an 8-bit cache): per row, the scores of a block are
//! computed, the running max and sum are rescaled once per block, and V rows are accumulated
//! into the output row. Consecutive rows that see the same keys of a block (the heads of one
//! token; every row for a block they all see whole) are processed up to 4 at a time so that
//! they share each K/V load; per row, the operations are those of a lone row. No `[seq, seq]`
//! matrix is ever formed; per-task state is on the stack. The inner loops (`micro`) have one
//! fixed arithmetic on every ISA.
//!
//! The cache holds f32 or f16 elements ([`KvElem`]); [`write_kv`] rounds to f16 (nearest even)
//! and the kernels widen exactly, so an f16 cache changes the stored values, never the
//! arithmetic done on them. An 8-bit cache ([`QuantKv`], written by [`write_kv_quant`]) is
//! read the same way: a task dequantizes the rows of a block it attends into per-thread f32
//! scratch (`code_value × scale`, [`crate::kv_quant`]) and runs the f32 inner loops on them, so
//! its output is bitwise that of an f32 cache holding the dequantized values (tested). Where
//! the rows are Hadamard-rotated, the task also rotates its query rows (`H·q / head_dim`) and
//! its output rows back (`H·o / head_dim`), each row alone, so every invariant above holds.

use std::cell::RefCell;
use std::ops::Range;

use crate::kv_quant::{self, RowCodec};
use crate::thread_pool::SharedMut;
use crate::{SimdLevel, ThreadPool, vmath};

#[cfg(target_arch = "x86_64")]
mod avx2;
mod micro;
mod tree;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
}

/// An element type of the KV cache: `f32` or `half::f16`.
pub trait KvElem: Copy + Default + Send + Sync + sealed::Sealed + 'static {
    /// Whether this is the 2-byte IEEE half type (the SIMD loads widen it).
    const IS_F16: bool;
    fn to_f32(self) -> f32;
    /// Rounds to nearest even.
    fn from_f32(x: f32) -> Self;

    /// `dst[i] = from_f32(src[i])`, vectorized where the type allows (same values).
    fn slice_from_f32(dst: &mut [Self], src: &[f32]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(x);
        }
    }
}

impl KvElem for f32 {
    const IS_F16: bool = false;

    #[inline]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl KvElem for half::f16 {
    const IS_F16: bool = true;

    #[inline]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }

    #[inline]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }

    fn slice_from_f32(dst: &mut [Self], src: &[f32]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
}

pub use kiln_backend::MAX_BLOCK_SIZE;
pub use kiln_backend::SeqSpan as AttentionSeq;
pub use kiln_backend::TreeMask;
pub use kiln_backend::ops::{AttentionShape, MAX_GROUP};

/// Writes this step's `k, v` (`[num_tokens, num_kv_heads, head_dim]`) into the cache slots
/// `slot_mapping[t] = block * block_size + offset`. An empty `v_cache` is a cache whose values
/// are read from its keys: `v` is not stored.
pub fn write_kv<E: KvElem>(
    k: &[f32],
    v: &[f32],
    slot_mapping: &[u32],
    k_cache: &mut [E],
    v_cache: &mut [E],
) {
    let num_tokens = slot_mapping.len();
    if num_tokens == 0 {
        return;
    }
    let row = k.len() / num_tokens;
    let with_values = !v_cache.is_empty();
    assert!(k.len() == num_tokens * row && (!with_values || k.len() == v.len()));
    for (t, &slot) in slot_mapping.iter().enumerate() {
        let dst = slot as usize * row;
        E::slice_from_f32(&mut k_cache[dst..dst + row], &k[t * row..(t + 1) * row]);
        if with_values {
            E::slice_from_f32(&mut v_cache[dst..dst + row], &v[t * row..(t + 1) * row]);
        }
    }
}

/// One layer of an 8-bit cache: per K and V, codes `[slots, num_kv_heads, head_dim]` and
/// scales `[slots, num_kv_heads, scales_per_row]`.
#[derive(Clone, Copy)]
pub struct QuantKv<'a> {
    pub codec: RowCodec,
    pub k: (&'a [u8], &'a [f32]),
    pub v: (&'a [u8], &'a [f32]),
}

/// [`write_kv`] into an 8-bit cache: each (token, KV head) row of `head_dim` elements of `k`
/// and `v` (`[num_tokens, num_kv_heads, head_dim]`) encoded alone into its slot (`v` only when
/// the cache has V codes).
pub fn write_kv_quant(
    codec: RowCodec,
    k: &[f32],
    v: &[f32],
    slot_mapping: &[u32],
    k_cache: (&mut [u8], &mut [f32]),
    v_cache: (&mut [u8], &mut [f32]),
) {
    let num_tokens = slot_mapping.len();
    if num_tokens == 0 {
        return;
    }
    let (hd, spr) = (codec.head_dim, codec.scales_per_row());
    let row = k.len() / num_tokens;
    let with_values = !v_cache.0.is_empty();
    assert!(k.len() == num_tokens * row && row.is_multiple_of(hd));
    assert!(!with_values || k.len() == v.len());
    let heads = row / hd;
    let mut tmp = Vec::new();
    let caches = if with_values { 2 } else { 1 };
    for (src, (codes, scales)) in [(k, k_cache), (v, v_cache)].into_iter().take(caches) {
        for (t, &slot) in slot_mapping.iter().enumerate() {
            for h in 0..heads {
                let r = slot as usize * heads + h;
                let x = &src[(t * heads + h) * hd..][..hd];
                codec.encode(
                    x,
                    &mut tmp,
                    &mut codes[r * hd..][..hd],
                    &mut scales[r * spr..][..spr],
                );
            }
        }
    }
}

/// Query tokens per task: with the heads of one KV head they form up to `rows` rows that share
/// every K/V block ([`KvSource::TILE_ROWS`]).
fn tile_tokens(group: usize, rows: usize) -> usize {
    (rows / group).max(1)
}

/// How many tasks each (tile, KV head) is split into by query head, and the heads of each:
/// when there are fewer of them than threads (a decode step of one or a few sequences with
/// few KV heads), the heads of a group go to different threads, which then each read the
/// group's keys and values. Otherwise 1 and the whole group.
fn head_splits(tasks: usize, shape: &AttentionShape, pool: &ThreadPool) -> (usize, usize) {
    let group = shape.group();
    let ways = (pool.num_threads() / tasks.max(1)).clamp(1, group);
    let per_split = group.div_ceil(ways);
    (group.div_ceil(per_split), per_split)
}

/// `out[num_tokens, num_heads, head_dim] = attention(q[num_tokens, num_heads, head_dim], cache)`.
///
/// Tasks are (sequence, tile of query tokens, KV head), and when those are fewer than the
/// threads, a share of the KV head's query heads each ([`head_splits`]: a batch-1 decode step
/// with one KV head would otherwise attend on one thread). Each output row is computed by the same
/// sequence of operations whatever tile, batch or chunk it belongs to, so batching and chunked
/// prefill never change a bit of it. Rows `tree` marks as token-tree nodes see their tree's keys
/// ([`kiln_backend::TreeKeys`]), with the bits of the same tokens decoded one at a time.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<E: KvElem>(
    pool: &ThreadPool,
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    seqs: &[AttentionSeq],
    block_tables: &[u32],
    tree: Option<TreeMask<'_>>,
    shape: &AttentionShape,
    out: &mut [f32],
) {
    let source = PlainKv { k: k_cache, v: v_cache };
    run_attention(pool, q, &source, seqs, block_tables, (tree, None), shape, out);
}

/// [`paged_attention`] with attention sinks (gpt-oss): `sinks[h]` (`[num_heads]`) is one more
/// logit in head `h`'s softmax whose value row is zero, so each output row is the plain one
/// times `sum / (sum + exp(sink - max))`, `sum` and `max` the row's running softmax state.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_with_sinks<E: KvElem>(
    pool: &ThreadPool,
    q: &[f32],
    (k_cache, v_cache): (&[E], &[E]),
    seqs: &[AttentionSeq],
    block_tables: &[u32],
    (tree, sinks): (Option<TreeMask<'_>>, Option<&[f32]>),
    shape: &AttentionShape,
    out: &mut [f32],
) {
    let source = PlainKv { k: k_cache, v: v_cache };
    run_attention(pool, q, &source, seqs, block_tables, (tree, sinks), shape, out);
}

/// [`paged_attention`] over an 8-bit cache: bitwise the result over an f32 cache holding each
/// element's `code_value × scale`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_quant(
    pool: &ThreadPool,
    q: &[f32],
    kv: QuantKv<'_>,
    seqs: &[AttentionSeq],
    block_tables: &[u32],
    tree: Option<TreeMask<'_>>,
    shape: &AttentionShape,
    out: &mut [f32],
) {
    run_attention(pool, q, &kv, seqs, block_tables, (tree, None), shape, out);
}

/// [`paged_attention_quant`] with attention sinks ([`paged_attention_with_sinks`]).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_quant_with_sinks(
    pool: &ThreadPool,
    q: &[f32],
    kv: QuantKv<'_>,
    seqs: &[AttentionSeq],
    block_tables: &[u32],
    (tree, sinks): (Option<TreeMask<'_>>, Option<&[f32]>),
    shape: &AttentionShape,
    out: &mut [f32],
) {
    run_attention(pool, q, &kv, seqs, block_tables, (tree, sinks), shape, out);
}

#[allow(clippy::too_many_arguments)]
fn run_attention<S: KvSource>(
    pool: &ThreadPool,
    q: &[f32],
    source: &S,
    seqs: &[AttentionSeq],
    block_tables: &[u32],
    (tree, sinks): (Option<TreeMask<'_>>, Option<&[f32]>),
    shape: &AttentionShape,
    out: &mut [f32],
) {
    let num_tokens = seqs.last().map_or(0, |s| s.query_start + s.query_len);
    let q_row = shape.num_heads * shape.head_dim;
    assert!(q.len() >= num_tokens * q_row && out.len() >= num_tokens * q_row);
    debug_assert!(shape.validate().is_ok());
    let tile = tile_tokens(shape.group(), S::TILE_ROWS);
    let num_tiles: usize = seqs.iter().map(|s| s.query_len.div_ceil(tile)).sum();
    let (splits, heads_per_split) = head_splits(num_tiles * shape.num_kv_heads, shape, pool);
    let out_ptr = SharedMut::new(out);
    let level = SimdLevel::detect();
    pool.run(num_tiles * shape.num_kv_heads * splits, |task| {
        let split = task % splits;
        let task = task / splits;
        let heads = split * heads_per_split..((split + 1) * heads_per_split).min(shape.group());
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
        let rows = seq.query_start + tokens.start..seq.query_start + tokens.end;
        let tree = tree.filter(|t| t.rows[rows].iter().any(|k| k.len > 0));
        let tile_job = Tile { seq, tokens, kv_head, heads, block_table, sinks };
        SCRATCH.with_borrow_mut(|scratch| {
            // SAFETY: this task alone writes heads `heads` of `kv_head`'s group for its tokens
            // (disjoint from every other task's rows).
            unsafe { attend_tile(level, q, source, &tile_job, tree, shape, scratch, out_ptr) };
        });
    });
}

thread_local! {
    /// Per-thread buffers of 8-bit caches and of token-tree rows (they grow to the largest
    /// block and tile seen).
    static SCRATCH: RefCell<Scratch> = const {
        RefCell::new(Scratch {
            q: Vec::new(),
            kv: KvScratch { k: Vec::new(), v: Vec::new() },
            gather: KvScratch { k: Vec::new(), v: Vec::new() },
        })
    };
}

/// See [`SCRATCH`].
struct Scratch {
    /// A tile's query rows, rotated: `[rows, head_dim]`.
    q: Vec<f32>,
    kv: KvScratch,
    /// The keys and values of a block a token-tree row sees, gathered (`tree`).
    gather: KvScratch,
}

/// K and V rows dequantized from an 8-bit cache, `[block_size, head_dim]` each.
struct KvScratch {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// The K and V rows of one block for one KV head: row `i` of the requested range starts at
/// element `i * stride` of `k` and `v`.
struct BlockKv<'a, E> {
    k: &'a [E],
    v: &'a [E],
    stride: usize,
}

/// Where a task finds its KV head's keys and values, a block at a time.
trait KvSource: Sync {
    type Elem: KvElem;

    /// Rows a task attends together (at most [`MAX_GROUP`]): each block is loaded (or
    /// dequantized) once per task, so a dearer block read wants more rows to share it.
    const TILE_ROWS: usize;

    /// Whether rows are stored Hadamard-rotated (queries and outputs are rotated alike).
    fn rotated(&self) -> bool;

    /// Asks for the rows of `kv_head` in physical block `block` ahead of their use (a hint).
    fn prefetch(&self, block: usize, kv_head: usize, shape: &AttentionShape);

    /// Offsets `rows` of physical block `block` for `kv_head`.
    fn block<'a>(
        &'a self,
        level: SimdLevel,
        block: usize,
        rows: Range<usize>,
        kv_head: usize,
        shape: &AttentionShape,
        scratch: &'a mut KvScratch,
    ) -> BlockKv<'a, Self::Elem>;
}

/// An f32 or f16 cache, read in place.
struct PlainKv<'a, E> {
    k: &'a [E],
    v: &'a [E],
}

impl<E: KvElem> KvSource for PlainKv<'_, E> {
    type Elem = E;
    /// 16 rows share each block while it is in L1.
    const TILE_ROWS: usize = 16;

    fn rotated(&self) -> bool {
        false
    }

    fn prefetch(&self, block: usize, kv_head: usize, shape: &AttentionShape) {
        let (hd, bs, kv_row) =
            (shape.head_dim, shape.block_size, shape.num_kv_heads * shape.head_dim);
        let start = block * bs * kv_row + kv_head * hd;
        let bytes = hd * size_of::<E>();
        prefetch_rows(self.k, start, bs, kv_row, bytes);
        prefetch_rows(self.v, start, bs, kv_row, bytes);
    }

    fn block<'a>(
        &'a self,
        _level: SimdLevel,
        block: usize,
        rows: Range<usize>,
        kv_head: usize,
        shape: &AttentionShape,
        _scratch: &'a mut KvScratch,
    ) -> BlockKv<'a, E> {
        let kv_row = shape.num_kv_heads * shape.head_dim;
        let start = (block * shape.block_size + rows.start) * kv_row + kv_head * shape.head_dim;
        BlockKv { k: &self.k[start..], v: &self.v[start..], stride: kv_row }
    }
}

impl KvSource for QuantKv<'_> {
    type Elem = f32;
    /// Dequantizing a block costs about what 16 rows' scores and sums on it cost, so up to 64
    /// rows share each (an 8,000-token prefill of the default model gained 5-15 %, see
    /// docs/BENCHMARKS.md).
    const TILE_ROWS: usize = 64;

    fn rotated(&self) -> bool {
        self.codec.rotate
    }

    fn prefetch(&self, block: usize, kv_head: usize, shape: &AttentionShape) {
        let (hd, bs, heads) = (shape.head_dim, shape.block_size, shape.num_kv_heads);
        let spr = self.codec.scales_per_row();
        let first_row = block * bs * heads + kv_head;
        for (codes, scales) in [self.k, self.v] {
            prefetch_rows(codes, first_row * hd, bs, heads * hd, hd);
            prefetch_rows(scales, first_row * spr, 1, 0, bs * heads * spr * size_of::<f32>());
        }
    }

    fn block<'a>(
        &'a self,
        level: SimdLevel,
        block: usize,
        rows: Range<usize>,
        kv_head: usize,
        shape: &AttentionShape,
        scratch: &'a mut KvScratch,
    ) -> BlockKv<'a, f32> {
        let (hd, heads, spr) = (shape.head_dim, shape.num_kv_heads, self.codec.scales_per_row());
        let len = rows.len() * hd;
        for ((codes, scales), buf) in [(self.k, &mut scratch.k), (self.v, &mut scratch.v)] {
            if buf.len() < len {
                buf.resize(len, 0.0);
            }
            for (i, offset) in rows.clone().enumerate() {
                let r = (block * shape.block_size + offset) * heads + kv_head;
                let dst = &mut buf[i * hd..][..hd];
                self.codec.decode(level, &codes[r * hd..][..hd], &scales[r * spr..][..spr], dst);
            }
        }
        BlockKv { k: &scratch.k[..len], v: &scratch.v[..len], stride: hd }
    }
}

/// The query rows one task computes.
struct Tile<'a> {
    seq: &'a AttentionSeq,
    /// Query indices within the sequence.
    tokens: std::ops::Range<usize>,
    kv_head: usize,
    /// The query heads of `kv_head`'s group this task computes (indices within the group).
    heads: std::ops::Range<usize>,
    block_table: &'a [u32],
    /// `[num_heads]` the heads' attention sinks, if the layer has them.
    sinks: Option<&'a [f32]>,
}

/// Attention of heads `tile.heads` of `kv_head`'s group for each token of the tile.
///
/// # Safety
/// No other thread may access the tile's rows of `out` meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn attend_tile<S: KvSource>(
    level: SimdLevel,
    q: &[f32],
    source: &S,
    tile: &Tile<'_>,
    tree: Option<TreeMask<'_>>,
    shape: &AttentionShape,
    scratch: &mut Scratch,
    out: SharedMut<f32>,
) {
    let (hd, bs, group) = (shape.head_dim, shape.block_size, shape.group());
    let q_row = shape.num_heads * hd;
    let seq = tile.seq;
    // Rows are (token, head) pairs, `nh` heads per token.
    let nh = tile.heads.len();
    let num_rows = tile.tokens.len() * nh;
    let mut st = RowState::new();
    let rotated = source.rotated();
    if rotated && scratch.q.len() < num_rows * hd {
        scratch.q.resize(num_rows * hd, 0.0);
    }
    for r in 0..num_rows {
        let token = seq.query_start + tile.tokens.start + r / nh;
        st.offset[r] = token * q_row + (tile.kv_head * group + tile.heads.start + r % nh) * hd;
        st.q_offset[r] = st.offset[r];
        if rotated {
            // Rows stored as `H·k` pair with `H·q / head_dim`.
            let qr = &mut scratch.q[r * hd..][..hd];
            qr.copy_from_slice(&q[st.offset[r]..][..hd]);
            kv_quant::hadamard_scaled(qr);
            st.q_offset[r] = r * hd;
        }
        st.pos[r] = seq.context_len - seq.query_len + tile.tokens.start + r / nh;
        st.end[r] = if shape.causal { st.pos[r] + 1 } else { seq.context_len };
        if let Some(keys) = tree_keys(tree, token) {
            st.pos[r] = keys.pos as usize;
            st.end[r] = tree::shared_end(keys, bs);
        }
        st.lo[r] = shape.sliding_window.map_or(0, |w| (st.pos[r] + 1).saturating_sub(w));
        // SAFETY: the caller grants this tile's rows.
        unsafe { out.slice(st.offset[r], hd) }.fill(0.0);
    }
    let first_block = st.lo[..num_rows].iter().min().copied().unwrap_or(0) / bs;
    let last_block = st.end[..num_rows].iter().max().map_or(0, |e| e.saturating_sub(1)) / bs;
    let range = |st: &RowState, r: usize, block: usize| {
        ((block * bs).max(st.lo[r]), ((block + 1) * bs).min(st.end[r]))
    };
    let prefetch_block = |block: usize| {
        source.prefetch(tile.block_table[block] as usize, tile.kv_head, shape);
    };
    for block in first_block..(first_block + PREFETCH_BLOCKS).min(last_block + 1) {
        prefetch_block(block);
    }
    for block in first_block..=last_block {
        if block + PREFETCH_BLOCKS <= last_block {
            prefetch_block(block + PREFETCH_BLOCKS);
        }
        // The keys of this block any row sees.
        let (mut u0, mut u1) = (usize::MAX, 0);
        for r in 0..num_rows {
            let (j0, j1) = range(&st, r, block);
            if j0 < j1 {
                (u0, u1) = (u0.min(j0), u1.max(j1));
            }
        }
        if u0 >= u1 {
            continue;
        }
        let (id, base) = (tile.block_table[block] as usize, block * bs);
        let kv =
            source.block(level, id, u0 - base..u1 - base, tile.kv_head, shape, &mut scratch.kv);
        let q: &[f32] = if rotated { &scratch.q } else { q };
        let mut r = 0;
        while r < num_rows {
            let (j0, j1) = range(&st, r, block);
            if j0 >= j1 {
                r += 1;
                continue;
            }
            // Consecutive rows with the same keys (the heads of a token, or every row of a
            // block all of them see whole) share the K/V loads.
            let mut n = 1;
            while n < micro::MAX_ROWS && r + n < num_rows && range(&st, r + n, block) == (j0, j1) {
                n += 1;
            }
            // Where the K and V rows of key `j0` start.
            let at = (j0 - u0) * kv.stride;
            let job =
                Rows { first: r, keys: j1 - j0, k: &kv.k[at..], v: &kv.v[at..], stride: kv.stride };
            // SAFETY: the caller grants this tile's rows.
            unsafe {
                match n {
                    1 => attend_rows::<S::Elem, 1>(level, q, &job, shape, &mut st, out),
                    2 => attend_rows::<S::Elem, 2>(level, q, &job, shape, &mut st, out),
                    3 => attend_rows::<S::Elem, 3>(level, q, &job, shape, &mut st, out),
                    _ => attend_rows::<S::Elem, 4>(level, q, &job, shape, &mut st, out),
                }
            }
            r += n;
        }
    }
    if let Some(tree) = tree {
        // SAFETY: the caller grants this tile's rows.
        unsafe {
            tree::attend_tree_rows(level, q, source, tile, tree, shape, &mut st, scratch, out);
        }
    }
    for (r, &sum) in st.sum[..num_rows].iter().enumerate() {
        let sink = tile.sinks.map(|s| s[tile.kv_head * group + tile.heads.start + r % nh]);
        let inv = output_scale(sum, st.max[r], sink);
        // SAFETY: the caller grants this tile's rows.
        let row = unsafe { out.slice(st.offset[r], hd) };
        for a in row.iter_mut() {
            *a *= inv;
        }
        if rotated {
            // The output accumulated `H·v` rows: `H·o / head_dim` is `o`.
            kv_quant::hadamard_scaled(row);
        }
    }
}

/// What a row's accumulated output is multiplied by: `1 / sum`, or with a sink, whose
/// `exp(sink - max)` joins the softmax denominator, that rescaled to the larger of the two
/// maxima (so neither exponential overflows).
fn output_scale(sum: f32, max: f32, sink: Option<f32>) -> f32 {
    match sink {
        None => 1.0 / sum,
        Some(sink) if sink > max => {
            let shrink = vmath::exp(max - sink);
            shrink / (sum * shrink + 1.0)
        }
        Some(sink) => 1.0 / (sum + vmath::exp(sink - max)),
    }
}

/// The tree keys of query row `token`, if it is a token-tree node.
fn tree_keys(tree: Option<TreeMask<'_>>, token: usize) -> Option<kiln_backend::TreeKeys> {
    tree.map(|t| t.rows[token]).filter(|k| k.len > 0)
}

/// KV blocks requested ahead of the one being attended ([`prefetch_rows`]).
const PREFETCH_BLOCKS: usize = 2;

/// Asks for the `rows` rows of `bytes` bytes at elements `start + i * stride` of `cache`, so
/// that the next blocks' keys and values stream in while this block computes: cache blocks
/// are scattered, so the hardware prefetchers would restart at every block (64 decode rows
/// over 192 cached tokens, f16, cache cold: 1.1–1.3 → 0.92–0.97 ms per layer). Into L1
/// (`T0`): on AMD Zen 5 batch-16 and batch-64 decode gained 3–12 % over `T1` (A/B of the
/// hint alone). A hint only: results never depend on it.
#[inline]
fn prefetch_rows<T>(cache: &[T], start: usize, rows: usize, stride: usize, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for i in 0..rows {
        let row = cache.as_ptr().wrapping_add(start + i * stride).cast::<u8>();
        for off in (0..bytes).step_by(64) {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            // SAFETY: prefetching never faults; the addresses are computed without dereference.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(off).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (cache, start, rows, stride, bytes);
}

/// Per row `r` = (token, head) of a tile: position, first visible key, end of the keys read in
/// place, running max and sum, offset of its output row (and of its query row in `q`, or in the
/// rotated queries); and the scores of the rows being processed.
struct RowState {
    pos: [usize; MAX_GROUP],
    lo: [usize; MAX_GROUP],
    /// End (exclusive) of the positions read in place with the tile: `pos + 1`, or for a
    /// token-tree row the start of the block holding its first tree key (`tree`).
    end: [usize; MAX_GROUP],
    max: [f32; MAX_GROUP],
    sum: [f32; MAX_GROUP],
    offset: [usize; MAX_GROUP],
    q_offset: [usize; MAX_GROUP],
    scores: [[f32; MAX_BLOCK_SIZE]; micro::MAX_ROWS],
}

impl RowState {
    /// No row set up yet: every running max at -inf, every sum at 0.
    fn new() -> Self {
        Self {
            pos: [0; MAX_GROUP],
            lo: [0; MAX_GROUP],
            end: [0; MAX_GROUP],
            max: [f32::NEG_INFINITY; MAX_GROUP],
            sum: [0.0; MAX_GROUP],
            offset: [0; MAX_GROUP],
            q_offset: [0; MAX_GROUP],
            scores: [[0.0; MAX_BLOCK_SIZE]; micro::MAX_ROWS],
        }
    }
}

/// Rows `first..first + R` of a tile against the same `keys` consecutive keys of one block,
/// whose K and V rows start at `k` and `v`, `stride` elements apart.
struct Rows<'a, E> {
    first: usize,
    keys: usize,
    k: &'a [E],
    v: &'a [E],
    stride: usize,
}

/// One block's online-softmax step for `R` rows: scores, rescaling by the new running max,
/// `exp`, and the P·V accumulation, each row with exactly the operations of a lone row.
///
/// # Safety
/// No other thread may access these rows of `out` meanwhile.
unsafe fn attend_rows<E: KvElem, const R: usize>(
    level: SimdLevel,
    q: &[f32],
    job: &Rows<'_, E>,
    shape: &AttentionShape,
    st: &mut RowState,
    out: SharedMut<f32>,
) {
    let (hd, stride, n, r0) = (shape.head_dim, job.stride, job.keys, job.first);
    let offset: [usize; R] = std::array::from_fn(|i| st.offset[r0 + i]);
    let qr: [&[f32]; R] = std::array::from_fn(|i| &q[st.q_offset[r0 + i]..][..hd]);
    let [s0, s1, s2, s3] = &mut st.scores;
    let all = [s0, s1, s2, s3];
    let mut scores: [&mut [f32]; R] = {
        let mut it = all.into_iter();
        std::array::from_fn(|_| &mut it.next().expect("R <= MAX_ROWS")[..n])
    };
    micro::scores_rows(level, qr, job.k, stride, scores.each_mut().map(|s| &mut **s));
    // SAFETY: the rows are distinct and granted by the caller.
    let mut acc: [&mut [f32]; R] = offset.map(|o| unsafe { out.slice(o, hd) });
    // The rows' running values are independent chains, interleaved so that their latencies
    // overlap; each row's own operations and their order are those of a lone row.
    let mut block_max = [f32::NEG_INFINITY; R];
    #[allow(clippy::needless_range_loop)] // key `j` of every row
    for j in 0..n {
        for i in 0..R {
            let s = &mut scores[i][j];
            *s *= shape.scale;
            if let Some(cap) = shape.softcap {
                *s = cap * (*s / cap).tanh();
            }
            block_max[i] = block_max[i].max(*s);
        }
    }
    let mut sum: [f32; R] = std::array::from_fn(|i| st.sum[r0 + i]);
    for i in 0..R {
        let r = r0 + i;
        let new_max = st.max[r].max(block_max[i]);
        if st.max[r] != f32::NEG_INFINITY && new_max > st.max[r] {
            let correction = vmath::exp(st.max[r] - new_max);
            sum[i] *= correction;
            for a in acc[i].iter_mut() {
                *a *= correction;
            }
        }
        st.max[r] = new_max;
        vmath::exp_shifted_at(level, scores[i], new_max);
    }
    #[allow(clippy::needless_range_loop)] // key `j` of every row
    for j in 0..n {
        for i in 0..R {
            sum[i] += scores[i][j];
        }
    }
    st.sum[r0..r0 + R].copy_from_slice(&sum);
    let p = scores.each_ref().map(|s| &**s);
    micro::accumulate_rows(level, acc.each_mut().map(|a| &mut **a), p, job.v, stride);
}

#[cfg(test)]
mod tests;
