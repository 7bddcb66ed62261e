//! Paged attention throughput, Gemma 3 270M's shape (4 query heads, 1 KV head, head dim 256,
//! f16 cache, blocks of 16): the last `query_len` tokens (default 1, a decode step; the
//! context for a prefill chunk) of each of `seqs` sequences of `context` cached tokens.
//! `distinct` sequences own their blocks (the rest share them); with `EVICT` set, a 600 MiB
//! buffer is read before every call so the cache is cold, as it is in a real decode step
//! after the weights have streamed past.
//!
//! `EVICT=1 cargo run --release -p kiln-kernels --example attn_bench -- [threads] [seqs]
//! [context] [distinct] [query_len]`

use std::time::Instant;

use half::f16;
use kiln_kernels::ThreadPool;
use kiln_kernels::attention::{AttentionSeq, AttentionShape, paged_attention};

fn main() {
    // The kernels read no environment: this program passes `KILN_ISA` / `KILN_PREFETCH` on.
    kiln_kernels::force_paths(
        std::env::var(kiln_kernels::ISA_ENV).ok().as_deref(),
        std::env::var(kiln_kernels::PREFETCH_ENV).ok().as_deref(),
    );
    let mut args = std::env::args().skip(1).map(|s| s.parse::<usize>().expect("a number"));
    let threads = args.next().unwrap_or(2);
    let num_seqs = args.next().unwrap_or(64);
    let context = args.next().unwrap_or(192);
    let distinct = args.next().unwrap_or(num_seqs).clamp(1, num_seqs);
    let query_len = args.next().unwrap_or(1).clamp(1, context);
    let pool = ThreadPool::new(threads);
    let shape = AttentionShape {
        num_heads: 4,
        num_kv_heads: 1,
        head_dim: 256,
        block_size: 16,
        scale: 0.0625,
        sliding_window: None,
        causal: true,
        softcap: None,
    };
    let blocks_per_seq = context.div_ceil(shape.block_size);
    let kv_row = shape.num_kv_heads * shape.head_dim;
    let cache_len = distinct * blocks_per_seq * shape.block_size * kv_row;
    let value = |i: usize| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3;
    let k: Vec<f16> = (0..cache_len).map(|i| f16::from_f32(value(i))).collect();
    let v = k.clone();
    let q_len = num_seqs * query_len * shape.num_heads * shape.head_dim;
    let q: Vec<f32> = (0..q_len).map(value).collect();
    let mut out = vec![0.0f32; q.len()];
    let mut tables = Vec::new();
    let seqs: Vec<AttentionSeq> = (0..num_seqs)
        .map(|s| {
            let block_table_start = tables.len();
            let first = (s % distinct) * blocks_per_seq;
            tables.extend((first..first + blocks_per_seq).map(|b| b as u32));
            AttentionSeq {
                query_start: s * query_len,
                query_len,
                context_len: context,
                block_table_start,
            }
        })
        .collect();
    let evict = std::env::var_os("EVICT").is_some();
    let mut junk = vec![1u8; if evict { 600 << 20 } else { 0 }];
    let reps = if evict { 20 } else { 200 };
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let mut total = 0.0;
        for i in 0..reps {
            if evict {
                let sum = junk.chunks(64).fold(0u8, |a, c| a.wrapping_add(c[0]));
                junk[i] = sum;
            }
            let start = Instant::now();
            paged_attention(&pool, &q, &k, &v, &seqs, &tables, None, &shape, &mut out);
            total += start.elapsed().as_secs_f64();
        }
        best = best.min(total / reps as f64);
    }
    std::hint::black_box(&junk);
    let bytes = (num_seqs * context * kv_row * 2 * 2) as f64;
    // Query `i` of a sequence sees `context - query_len + i + 1` keys (causal).
    let keys_seen: usize = (0..query_len).map(|i| context - query_len + i + 1).sum();
    let flops = (num_seqs * shape.num_heads * keys_seen * shape.head_dim * 4) as f64;
    println!(
        "{num_seqs} seqs × {context} tokens, {query_len} queried ({distinct} distinct): \
         {:.3} ms per layer, \
         {:.1} GB/s of KV, {:.1} GFLOP/s",
        best * 1e3,
        bytes / best / 1e9,
        flops / best / 1e9
    );
}
