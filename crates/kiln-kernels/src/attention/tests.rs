use super::*;

fn values(n: usize, seed: u64) -> Vec<f32> {
    crate::testing::values(n, seed, 2.0)
}

/// Naive attention over contiguous per-sequence K/V `[len, kv_heads, hd]` (the query sees
/// up to `position`, or every key without a causal mask).
fn reference(q: &[f32], k: &[f32], v: &[f32], position: usize, shape: &AttentionShape) -> Vec<f32> {
    let hd = shape.head_dim;
    let group = shape.num_heads / shape.num_kv_heads;
    let lo = shape.sliding_window.map_or(0, |w| (position + 1).saturating_sub(w));
    let position = if shape.causal { position } else { k.len() / (shape.num_kv_heads * hd) - 1 };
    let mut out = vec![0.0; shape.num_heads * hd];
    for h in 0..shape.num_heads {
        let kvh = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        let scores: Vec<f64> = (lo..=position)
            .map(|j| {
                let kj = &k[(j * shape.num_kv_heads + kvh) * hd..][..hd];
                let mut s = qh.iter().zip(kj).map(|(a, b)| f64::from(a * b)).sum::<f64>()
                    * f64::from(shape.scale);
                if let Some(cap) = shape.softcap {
                    s = f64::from(cap) * (s / f64::from(cap)).tanh();
                }
                s
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = exps.iter().sum();
        for (e, j) in exps.iter().zip(lo..=position) {
            let vj = &v[(j * shape.num_kv_heads + kvh) * hd..][..hd];
            for d in 0..hd {
                out[h * hd + d] += (e / total * f64::from(vj[d])) as f32;
            }
        }
    }
    out
}

#[test]
fn paged_varlen_batch_matches_naive_attention() {
    let pool = ThreadPool::new(2);
    // The last case is an encoder's: every query sees its whole sequence.
    let cases =
        [(None, None, true), (Some(5), None, true), (None, Some(3.0), true), (None, None, false)];
    for (window, softcap, causal) in cases {
        let shape = AttentionShape {
            num_heads: 6,
            num_kv_heads: 2,
            head_dim: 20,
            block_size: 4,
            scale: 0.3,
            sliding_window: window,
            causal,
            softcap,
        };
        let kv_row = shape.num_kv_heads * shape.head_dim;
        let q_row = shape.num_heads * shape.head_dim;
        // (context_len, query_len): a decode, a prefill, a chunk continuing a prefill.
        let specs = [(9usize, 1usize), (7, 7), (13, 5)];
        let num_blocks = 16;
        let mut k_cache = vec![f32::NAN; num_blocks * shape.block_size * kv_row];
        let mut v_cache = k_cache.clone();
        // Physical blocks handed out in a scrambled order.
        let mut free: Vec<u32> = (0..num_blocks as u32).rev().collect();
        free.swap(0, 5);
        let mut tables: Vec<Vec<u32>> = Vec::new();
        let mut contiguous = Vec::new();
        for (s, &(ctx, _)) in specs.iter().enumerate() {
            let table: Vec<u32> =
                (0..ctx.div_ceil(shape.block_size)).map(|_| free.pop().unwrap()).collect();
            let k = values(ctx * kv_row, 10 + s as u64);
            let v = values(ctx * kv_row, 20 + s as u64);
            let slots: Vec<u32> = (0..ctx)
                .map(|j| table[j / shape.block_size] * shape.block_size as u32 + (j % 4) as u32)
                .collect();
            write_kv(&k, &v, &slots, &mut k_cache, &mut v_cache);
            tables.push(table);
            contiguous.push((k, v));
        }
        let mut seqs = Vec::new();
        let mut flat_tables = Vec::new();
        let mut start = 0;
        for (s, &(ctx, qlen)) in specs.iter().enumerate() {
            seqs.push(AttentionSeq {
                query_start: start,
                query_len: qlen,
                context_len: ctx,
                block_table_start: flat_tables.len(),
            });
            flat_tables.extend_from_slice(&tables[s]);
            start += qlen;
        }
        let q = values(start * q_row, 99);
        let mut out = vec![f32::NAN; start * q_row];
        paged_attention(&pool, &q, &k_cache, &v_cache, &seqs, &flat_tables, None, &shape, &mut out);
        for (s, seq) in seqs.iter().enumerate() {
            for i in 0..seq.query_len {
                let t = seq.query_start + i;
                let position = seq.context_len - seq.query_len + i;
                let (k, v) = &contiguous[s];
                let want = reference(&q[t * q_row..(t + 1) * q_row], k, v, position, &shape);
                for (g, w) in out[t * q_row..(t + 1) * q_row].iter().zip(&want) {
                    assert!(
                        (g - w).abs() < 1e-5,
                        "window {window:?} causal {causal} seq {s} token {i}"
                    );
                }
            }
        }
    }
}

#[test]
fn shape_validation() {
    let mut shape = AttentionShape {
        num_heads: 6,
        num_kv_heads: 4,
        head_dim: 8,
        block_size: 16,
        scale: 1.0,
        sliding_window: None,
        causal: true,
        softcap: None,
    };
    assert!(shape.validate().is_err());
    shape.num_kv_heads = 3;
    assert!(shape.validate().is_ok());
    shape.block_size = 0;
    assert!(shape.validate().is_err());
}

#[test]
fn f16_cache_equals_f32_cache_of_the_rounded_values() {
    let pool = ThreadPool::new(2);
    let shape = AttentionShape {
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 40,
        block_size: 8,
        scale: 0.2,
        sliding_window: Some(11),
        causal: true,
        softcap: None,
    };
    let kv_row = shape.num_kv_heads * shape.head_dim;
    let (ctx, qlen) = (29usize, 6usize);
    let num_blocks = ctx.div_ceil(shape.block_size);
    let k = values(ctx * kv_row, 1);
    let v = values(ctx * kv_row, 2);
    let slots: Vec<u32> = (0..ctx as u32).collect();
    let mut k16 = vec![half::f16::ZERO; num_blocks * shape.block_size * kv_row];
    let mut v16 = k16.clone();
    write_kv(&k, &v, &slots, &mut k16, &mut v16);
    // The f32 cache holds the f16-rounded values, widened.
    let k32: Vec<f32> = k16.iter().map(|x| x.to_f32()).collect();
    let v32: Vec<f32> = v16.iter().map(|x| x.to_f32()).collect();
    assert!(k32[..ctx * kv_row].iter().zip(&k).any(|(a, b)| a != b), "f16 rounds");
    let seqs =
        [AttentionSeq { query_start: 0, query_len: qlen, context_len: ctx, block_table_start: 0 }];
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let q = values(qlen * shape.num_heads * shape.head_dim, 3);
    let mut want = vec![0.0; q.len()];
    paged_attention(&pool, &q, &k32, &v32, &seqs, &table, None, &shape, &mut want);
    let mut got = vec![0.0; q.len()];
    paged_attention(&pool, &q, &k16, &v16, &seqs, &table, None, &shape, &mut got);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want));
}

/// The vectorized f16 row conversion of `write_kv` rounds every value as the scalar one does:
/// ties to even, subnormals, overflow to infinity, signed zeros, over every tail length.
#[test]
fn f16_row_conversion_equals_elementwise() {
    let mut src = values(300, 7);
    let specials = [
        0.0,
        -0.0,
        1.0 + f32::EPSILON,
        1.000_488_3, // halfway between two f16 values
        65_519.0,    // rounds down to the largest f16
        65_520.0,    // rounds up to infinity
        1e-7,        // f16 subnormal
        -3e-8,       // rounds to a signed zero or the smallest subnormal
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MIN_POSITIVE,
    ];
    src[..specials.len()].copy_from_slice(&specials);
    for len in [0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 64, 255, 300] {
        let mut fast = vec![half::f16::ZERO; len];
        half::f16::slice_from_f32(&mut fast, &src[..len]);
        for (i, (&got, &x)) in fast.iter().zip(&src).enumerate() {
            let want = half::f16::from_f32(x);
            assert_eq!(got.to_bits(), want.to_bits(), "len {len}, element {i}: {x}");
        }
    }
}

/// An 8-bit cache gives bitwise the output of an f32 cache holding its dequantized values
/// (each row's `code_value × scale`; for rotated int8 rows, with the queries rotated and the
/// output rotated back as the kernel does), for every format, with sliding windows, a
/// softcap, chunks and a partial last block; and it stays close to exact attention.
#[test]
fn quant_cache_equals_f32_cache_of_the_dequantized_values() {
    use crate::kv_quant::{RowCodec, hadamard_scaled};
    use kiln_backend::KvCacheDtype;
    let pool = ThreadPool::new(2);
    let cases =
        [(Some(11), None, 40), (None, Some(5.0), 64), (None, None, 19), (Some(20), None, 128)];
    for (window, softcap, head_dim) in cases {
        let shape = AttentionShape {
            num_heads: 8,
            num_kv_heads: 2,
            head_dim,
            block_size: 8,
            scale: 0.2,
            sliding_window: window,
            causal: true,
            softcap,
        };
        let hd = shape.head_dim;
        let kv_row = shape.num_kv_heads * hd;
        let q_row = shape.num_heads * hd;
        let (ctx, qlen) = (29usize, 6usize);
        let slots_total = (ctx.div_ceil(shape.block_size) + 1) * shape.block_size;
        let k = values(ctx * kv_row, 1);
        let v = values(ctx * kv_row, 2);
        // Blocks in a scrambled order.
        let table: Vec<u32> = vec![3, 0, 2, 1];
        let slots: Vec<u32> = (0..ctx)
            .map(|j| table[j / shape.block_size] * shape.block_size as u32 + (j % 8) as u32)
            .collect();
        let seqs = [AttentionSeq {
            query_start: 0,
            query_len: qlen,
            context_len: ctx,
            block_table_start: 0,
        }];
        let q = values(qlen * q_row, 3);
        for dtype in [KvCacheDtype::Int8, KvCacheDtype::Fp8E4M3, KvCacheDtype::Fp8E5M2] {
            let codec = RowCodec::new(dtype, hd).unwrap();
            let rows = slots_total * shape.num_kv_heads;
            let spr = codec.scales_per_row();
            let mut kc = (vec![0u8; rows * hd], vec![0.0f32; rows * spr]);
            let mut vc = kc.clone();
            write_kv_quant(codec, &k, &v, &slots, (&mut kc.0, &mut kc.1), (&mut vc.0, &mut vc.1));
            let widen = |(codes, scales): &(Vec<u8>, Vec<f32>)| -> Vec<f32> {
                let mut out = vec![0.0; rows * hd];
                for r in 0..rows {
                    let (c, s) = (&codes[r * hd..][..hd], &scales[r * spr..][..spr]);
                    codec.decode(SimdLevel::Scalar, c, s, &mut out[r * hd..][..hd]);
                }
                out
            };
            let (k32, v32) = (widen(&kc), widen(&vc));
            let mut q_in = q.clone();
            if codec.rotate {
                q_in.chunks_mut(hd).for_each(hadamard_scaled);
            }
            let mut want = vec![0.0; q.len()];
            paged_attention(&pool, &q_in, &k32, &v32, &seqs, &table, None, &shape, &mut want);
            if codec.rotate {
                want.chunks_mut(hd).for_each(hadamard_scaled);
            }
            let mut got = vec![0.0; q.len()];
            let kv = QuantKv { codec, k: (&kc.0, &kc.1), v: (&vc.0, &vc.1) };
            paged_attention_quant(&pool, &q, kv, &seqs, &table, None, &shape, &mut got);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{} window {window:?} hd {hd}", dtype.name());
            // And close to attention over the exact values.
            let mut exact = vec![0.0; q.len()];
            let mut kx = vec![0.0; slots_total * kv_row];
            let mut vx = kx.clone();
            write_kv(&k, &v, &slots, &mut kx, &mut vx);
            paged_attention(&pool, &q, &kx, &vx, &seqs, &table, None, &shape, &mut exact);
            let err = got.iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            let tol = match dtype {
                KvCacheDtype::Int8 => 0.05,
                KvCacheDtype::Fp8E4M3 => 0.3,
                _ => 0.6,
            };
            assert!(err < tol, "{}: max error {err}", dtype.name());
        }
    }
}

/// A cache of one kind with rows written at given slots, attended.
#[derive(Clone, Copy, Debug)]
enum CacheKind {
    F32,
    F16,
    Quant(kiln_backend::KvCacheDtype),
}

/// Attention on `pool` over a fresh cache of `kind` and `num_slots` slots holding each
/// `(k, v, slots)` group of `writes`.
#[allow(clippy::too_many_arguments)]
fn attend_over_on(
    pool: &ThreadPool,
    kind: CacheKind,
    shape: &AttentionShape,
    num_slots: usize,
    writes: &[(&[f32], &[f32], &[u32])],
    q: &[f32],
    seqs: &[AttentionSeq],
    table: &[u32],
    tree: Option<TreeMask<'_>>,
) -> Vec<f32> {
    let kv_row = shape.num_kv_heads * shape.head_dim;
    let mut out = vec![f32::NAN; q.len()];
    match kind {
        CacheKind::F32 | CacheKind::F16 => {
            let mut k32 = vec![0.0f32; num_slots * kv_row];
            let mut v32 = k32.clone();
            let mut k16 = vec![half::f16::ZERO; num_slots * kv_row];
            let mut v16 = k16.clone();
            for (k, v, slots) in writes {
                write_kv(k, v, slots, &mut k32, &mut v32);
                write_kv(k, v, slots, &mut k16, &mut v16);
            }
            if let CacheKind::F32 = kind {
                paged_attention(pool, q, &k32, &v32, seqs, table, tree, shape, &mut out);
            } else {
                paged_attention(pool, q, &k16, &v16, seqs, table, tree, shape, &mut out);
            }
        }
        CacheKind::Quant(dtype) => {
            let codec = crate::kv_quant::RowCodec::new(dtype, shape.head_dim).unwrap();
            let rows = num_slots * shape.num_kv_heads;
            let spr = codec.scales_per_row();
            let mut kc = (vec![0u8; rows * shape.head_dim], vec![0.0f32; rows * spr]);
            let mut vc = kc.clone();
            for (k, v, slots) in writes {
                let (kc, vc) = ((&mut kc.0[..], &mut kc.1[..]), (&mut vc.0[..], &mut vc.1[..]));
                write_kv_quant(codec, k, v, slots, kc, vc);
            }
            let kv = QuantKv { codec, k: (&kc.0, &kc.1), v: (&vc.0, &vc.1) };
            paged_attention_quant(pool, q, kv, seqs, table, tree, shape, &mut out);
        }
    }
    out
}

/// Every row of a token tree equals, bitwise, the row of the same tokens decoded one at a time
/// (the node's path written at its positions), over f32, f16 and 8-bit caches, with a sliding
/// window, a softcap, and trees inside one block or across block boundaries.
#[test]
fn tree_rows_equal_their_paths_decoded_one_by_one() {
    use kiln_backend::{ForwardBatch, KvCacheDtype, TREE_ROOT};
    // Node parents: a chain of three off the root, a second branch of two, a third branch off
    // the first node.
    let parents = [TREE_ROOT, 0, 1, TREE_ROOT, 3, 0];
    let n = parents.len() + 1; // tree tokens: the root, then the nodes
    // The one-token reference runs on 2 threads (2 tasks: no head split).
    let two = ThreadPool::new(2);
    let kinds = [
        CacheKind::F32,
        CacheKind::F16,
        CacheKind::Quant(KvCacheDtype::Int8),
        CacheKind::Quant(KvCacheDtype::Fp8E4M3),
    ];
    for (num_cached, window, softcap) in [(5, None, None), (2, Some(4), None), (9, None, Some(4.0))]
    {
        let shape = AttentionShape {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 32,
            block_size: 4,
            scale: 0.25,
            sliding_window: window,
            causal: true,
            softcap,
        };
        let (bs, kv_row) = (shape.block_size, shape.num_kv_heads * shape.head_dim);
        let q_row = shape.num_heads * shape.head_dim;
        let table: Vec<u32> = vec![5, 1, 4, 0, 2, 3];
        let num_slots = table.len() * bs;
        let slot = |p: usize| table[p / bs] * bs as u32 + (p % bs) as u32;
        let mut batch = ForwardBatch::new(bs);
        batch.push_tree(&vec![0; n], &parents, num_cached, &table).unwrap();
        let (prefix_k, prefix_v) = (values(num_cached * kv_row, 1), values(num_cached * kv_row, 2));
        let prefix_slots: Vec<u32> = (0..num_cached).map(slot).collect();
        let (tree_k, tree_v) = (values(n * kv_row, 3), values(n * kv_row, 4));
        let q = values(n * q_row, 5);
        // The tree tokens (0: the root, 1 + i: node i) from the root down to token `t`.
        let path = |t: usize| {
            let mut path = vec![t];
            while let Some(&node) = path.last().filter(|&&node| node > 0) {
                let parent = parents[node - 1];
                path.push(if parent == TREE_ROOT { 0 } else { parent as usize + 1 });
            }
            path.reverse();
            path
        };
        for kind in kinds {
            let writes = [
                (&prefix_k[..], &prefix_v[..], &prefix_slots[..]),
                (&tree_k[..], &tree_v[..], batch.slot_mapping()),
            ];
            let (seqs, tables) = (batch.seqs(), batch.block_tables());
            // The reference: each token alone, its path written at its positions.
            let wants: Vec<(Vec<usize>, Vec<f32>)> = (0..n)
                .map(|t| {
                    let path = path(t);
                    let rows = |src: &[f32]| -> Vec<f32> {
                        path.iter().flat_map(|&i| src[i * kv_row..][..kv_row].to_vec()).collect()
                    };
                    let (k, v) = (rows(&tree_k), rows(&tree_v));
                    let slots: Vec<u32> = (0..path.len()).map(|j| slot(num_cached + j)).collect();
                    let writes = [
                        (&prefix_k[..], &prefix_v[..], &prefix_slots[..]),
                        (&k[..], &v[..], &slots[..]),
                    ];
                    let seq = [AttentionSeq {
                        query_start: 0,
                        query_len: 1,
                        context_len: num_cached + path.len(),
                        block_table_start: 0,
                    }];
                    let q_t = &q[t * q_row..][..q_row];
                    let want = attend_over_on(
                        &two, kind, &shape, num_slots, &writes, q_t, &seq, &table, None,
                    );
                    (path, want)
                })
                .collect();
            // On 4 threads the 2 (tile, KV head) tasks split their query heads (`head_splits`).
            for threads in [2, 4] {
                let pool = ThreadPool::new(threads);
                let mask = batch.tree_mask();
                let got =
                    attend_over_on(&pool, kind, &shape, num_slots, &writes, &q, seqs, tables, mask);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for (t, (path, want)) in wants.iter().enumerate() {
                    assert_eq!(
                        bits(&got[t * q_row..][..q_row]),
                        bits(want),
                        "{kind:?}, {threads} threads, {num_cached} cached, window {window:?}, \
                         token {t} (path {path:?})"
                    );
                }
            }
        }
    }
}

/// Decode steps with fewer (tile, KV head) tasks than threads split a group's query heads over
/// the threads: every row keeps the bits of the unsplit run (one thread), whatever the pool
/// size, group size and cache kind.
#[test]
fn head_splits_keep_every_row_bitwise() {
    use kiln_backend::KvCacheDtype;
    let kinds = [CacheKind::F32, CacheKind::F16, CacheKind::Quant(KvCacheDtype::Int8)];
    for (num_heads, num_kv_heads) in [(4, 1), (8, 1), (8, 2), (3, 1)] {
        let shape = AttentionShape {
            num_heads,
            num_kv_heads,
            head_dim: 40,
            block_size: 8,
            scale: 0.2,
            sliding_window: None,
            causal: true,
            softcap: Some(5.0),
        };
        let kv_row = num_kv_heads * shape.head_dim;
        // Two sequences of 21 and 13 cached tokens, one query token each.
        let ctx = [21usize, 13];
        let k = values(ctx.iter().sum::<usize>() * kv_row, 1);
        let v = values(k.len(), 2);
        let slots: Vec<u32> = (0..ctx[0] as u32).chain(24..24 + ctx[1] as u32).collect();
        let table: Vec<u32> = vec![0, 1, 2, 3, 4];
        let q = values(2 * num_heads * shape.head_dim, 3);
        for seqs in [&ctx[..1], &ctx[..]] {
            let seqs: Vec<AttentionSeq> = seqs
                .iter()
                .enumerate()
                .map(|(i, &c)| AttentionSeq {
                    query_start: i,
                    query_len: 1,
                    context_len: c,
                    block_table_start: 3 * i,
                })
                .collect();
            let q = &q[..seqs.len() * num_heads * shape.head_dim];
            let writes = [(&k[..], &v[..], &slots[..])];
            for kind in kinds {
                let run = |threads| {
                    let pool = ThreadPool::new(threads);
                    attend_over_on(&pool, kind, &shape, 40, &writes, q, &seqs, &table, None)
                };
                let want = run(1);
                assert!(want.iter().all(|x| x.is_finite()));
                for threads in [2, 3, 4, 8] {
                    let got = run(threads);
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{kind:?} {num_heads}/{num_kv_heads} heads, {threads} threads");
                }
            }
        }
    }
}
