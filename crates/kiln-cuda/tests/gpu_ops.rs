//! Every operation of the CUDA backend against the scalar reference backend on seeded random
//! inputs. Weights are bf16 values (exact on both backends); GEMM inputs are rounded to bf16 on
//! the GPU, so GEMM results agree within bf16 rounding (relative error under 1e-2) and
//! everything else within f32 rounding (under 1e-5; attention 1e-4, its sums run in another
//! order).
//!
//! Needs an NVIDIA GPU: `cargo test -p kiln-cuda --test gpu_ops -- --ignored`.

#![allow(clippy::unwrap_used)]

mod common;

use common::{HostIo, Rng, cuda, rel_err};
use half::bf16;
use kiln_backend::{
    AttentionShape, Backend, GateActivation, HostTensor, KvCacheDtype, KvCacheSpec, KvLayout,
    LinearJob, Logits, RopeConfig, RopeScaling, RopeStyle, SeqSpan,
};
use kiln_kernels::Reference;

const F32_TOL: f64 = 1e-5;
const BF16_TOL: f64 = 1e-2;

/// A `[rows, cols]` f32 tensor holding bf16 values.
fn weight(rng: &mut Rng, rows: usize, cols: usize) -> HostTensor {
    let v: Vec<f32> = rng.vec(rows * cols).iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
    HostTensor::from_f32(rows, cols, &v).unwrap()
}

/// Compares one case's GPU and reference results.
#[allow(clippy::needless_pass_by_value)] // called with freshly computed results
fn check(what: &str, tol: f64, gpu: Vec<f32>, cpu: Vec<f32>) {
    let e = rel_err(&gpu, &cpu);
    println!("{what:<40} rel err {e:.2e} (bound {tol:.0e})");
    assert!(e <= tol, "{what}: relative error {e:.3e} over {tol:.0e}");
}

fn embed_case<B: HostIo>(be: &B) -> Vec<f32> {
    let mut rng = Rng::new(1);
    let table = be.load_weight(weight(&mut rng, 50, 600), None).unwrap();
    let ids: Vec<u32> = (0..10).map(|_| rng.below(50)).collect();
    let mut out = be.put(&vec![0.0; 10 * 600]);
    be.embed(&table, &ids, Some(1.7), B::view_mut(&mut out, 0..6000));
    be.get(&out, 6000)
}

fn linear_case<B: HostIo>(be: &B) -> Vec<f32> {
    let mut rng = Rng::new(2);
    let (m, k) = (5, 96);
    let wq = be.load_weight(weight(&mut rng, 300, k), None).unwrap();
    let wk = be.load_weight(weight(&mut rng, 32, k), None).unwrap();
    let bias = be.load_vector(&rng.vec(300)).unwrap();
    let x = be.put(&rng.vec(m * k));
    let (mut q, mut kk) = (be.put(&vec![0.0; m * 300]), be.put(&vec![0.0; m * 32]));
    be.linear(
        B::view(&x, 0..m * k),
        m,
        &mut [
            LinearJob { weight: &wq, bias: Some(&bias), out: B::view_mut(&mut q, 0..m * 300) },
            LinearJob { weight: &wk, bias: None, out: B::view_mut(&mut kk, 0..m * 32) },
        ],
    );
    let mut r = be.get(&q, m * 300);
    r.extend(be.get(&kk, m * 32));
    r
}

/// Widths of the norms: one warp, some of a block, a whole block (4,096 = 1,024 threads of
/// four), and past the elements a block keeps in registers (9,008 > 8 * 1,024).
const NORM_WIDTHS: [usize; 4] = [80, 656, 4096, 9008];

fn norm_case<B: HostIo>(be: &B, d: usize) -> Vec<f32> {
    let mut rng = Rng::new(3);
    let rows = 7;
    let w = be.load_vector(&rng.vec(d)).unwrap();
    let head_w = be.load_vector(&rng.vec(16)).unwrap();
    let x = be.put(&rng.vec(rows * d));
    let mut out = be.put(&vec![0.0; rows * d]);
    be.rms_norm(B::view(&x, 0..rows * d), &w, 1e-6, B::view_mut(&mut out, 0..rows * d));
    be.rms_norm_inplace(B::view_mut(&mut out, 0..rows * d), &head_w, 1e-6);
    be.get(&out, rows * d)
}

fn residual_case<B: HostIo>(be: &B, d: usize, post: bool, next: bool) -> Vec<f32> {
    let mut rng = Rng::new(4);
    let rows = 6;
    let post_w = be.load_vector(&rng.vec(d)).unwrap();
    let next_w = be.load_vector(&rng.vec(d)).unwrap();
    let mut branch = be.put(&rng.vec(rows * d));
    let mut x = be.put(&rng.vec(rows * d));
    let mut out = be.put(&vec![0.0; rows * d]);
    let n = rows * d;
    let next_arg = next.then(|| (&next_w, B::view_mut(&mut out, 0..n)));
    be.residual_norm(
        d,
        B::view_mut(&mut branch, 0..n),
        post.then_some(&post_w),
        B::view_mut(&mut x, 0..n),
        next_arg,
        1e-6,
    );
    let mut r = be.get(&x, n);
    r.extend(be.get(&branch, n));
    if next {
        r.extend(be.get(&out, n));
    }
    r
}

fn rope_case<B: HostIo>(be: &B, style: RopeStyle, rotary_dim: usize, heads: usize) -> Vec<f32> {
    let mut rng = Rng::new(5);
    let (t, hd) = (9, 32);
    let config = RopeConfig {
        base: 10_000.0,
        rotary_dim,
        scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192.0,
        },
        style,
        freq_factors: None,
        mscale: 1.0,
    };
    let rope = be.load_rope(&config).unwrap();
    let positions: Vec<u32> = (0..t).map(|_| rng.below(40_000)).collect();
    let mut table = be.put(&vec![0.0; t * rotary_dim]);
    be.rope_table(&rope, &positions, B::view_mut(&mut table, 0..t * rotary_dim));
    let mut x = be.put(&rng.vec(t * heads * hd));
    let n = t * heads * hd;
    be.rope_apply(&rope, B::view_mut(&mut x, 0..n), heads, B::view(&table, 0..t * rotary_dim));
    be.get(&x, n)
}

fn act_case<B: HostIo>(be: &B, act: GateActivation) -> Vec<f32> {
    let mut rng = Rng::new(6);
    let n = 1000;
    let gate: Vec<f32> = rng.vec(n).iter().map(|x| x * 8.0).collect();
    let mut g = be.put(&gate);
    let u = be.put(&rng.vec(n));
    be.gated_act(act, B::view_mut(&mut g, 0..n), B::view(&u, 0..n));
    be.get(&g, n)
}

/// (context, new tokens) of each sequence of an attention step.
type Contexts = &'static [(usize, usize)];
/// A prefill step: a 40-token prompt, a decode at position 1,499, a 7-token chunk after 600
/// cached tokens (the tiled kernel for head dimensions up to 128, else the split-K kernel).
const PREFILL: Contexts = &[(40, 40), (1500, 1), (607, 7)];
/// A decode step (the split-K kernel): positions 1,499, 699 and 2, up to six splits of 256.
const DECODE: Contexts = &[(1500, 1), (700, 1), (3, 1)];
/// A long decode row: 17,000 keys take 34 splits of 512 (two chunks each), next to a short one.
const LONG_DECODE: Contexts = &[(17_000, 1), (300, 1)];

/// One attention step of `contexts` over a scrambled block table (2 KV heads of `hd`, 8 query
/// heads).
fn attention_case<B: HostIo>(
    be: &B,
    dtype: KvCacheDtype,
    (window, softcap): (Option<usize>, Option<f32>),
    hd: usize,
    contexts: Contexts,
) -> Vec<f32> {
    let mut rng = Rng::new(7);
    let (kvh, nh, bs) = (2, 8, 16);
    let layout = KvLayout::new(2, kvh, hd);
    // Blocks are handed out as (i * 37) mod num_blocks: distinct while 37 does not divide it.
    let needed: usize = contexts.iter().map(|&(ctx, _)| ctx.div_ceil(bs)).sum();
    let num_blocks = if (needed + 1).is_multiple_of(37) { needed + 2 } else { needed + 1 };
    let spec = KvCacheSpec { layout, dtype, num_blocks, block_size: bs };
    let mut kv = be.alloc_kv(spec).unwrap();
    let shape = AttentionShape {
        num_heads: nh,
        num_kv_heads: kvh,
        head_dim: hd,
        block_size: bs,
        scale: 1.0 / (hd as f32).sqrt(),
        sliding_window: window,
        causal: true,
        softcap,
    };
    let mut seqs = Vec::new();
    let mut tables = Vec::new();
    let mut next_block = 0u32;
    let mut rows = 0;
    for &(ctx, new) in contexts {
        let blocks = ctx.div_ceil(bs);
        let table: Vec<u32> = (0..blocks)
            .map(|_| {
                next_block += 1;
                (next_block * 37) % num_blocks as u32
            })
            .collect();
        // The whole context's K/V, written as one chunk.
        let slots: Vec<u32> =
            (0..ctx).map(|p| table[p / bs] * bs as u32 + (p % bs) as u32).collect();
        let n = ctx * kvh * hd;
        let (k, v) = (be.put(&rng.vec(n)), be.put(&rng.vec(n)));
        be.write_kv(&mut kv, 1, B::view(&k, 0..n), B::view(&v, 0..n), &slots);
        seqs.push(SeqSpan {
            query_start: rows,
            query_len: new,
            context_len: ctx,
            block_table_start: tables.len(),
        });
        tables.extend(table);
        rows += new;
    }
    let n = rows * nh * hd;
    let q = be.put(&rng.vec(n));
    let mut out = be.put(&vec![0.0; n]);
    be.paged_attention(
        &kv,
        1,
        B::view(&q, 0..n),
        &seqs,
        &tables,
        (None, None),
        &shape,
        B::view_mut(&mut out, 0..n),
    );
    be.get(&out, n)
}

fn rows_case<B: HostIo>(be: &B) -> Vec<f32> {
    let mut rng = Rng::new(8);
    let (rows, w) = (10, 300);
    let src = be.put(&rng.vec(rows * w));
    let mut dst = be.put(&vec![0.0; 4 * w]);
    be.gather_rows(B::view(&src, 0..rows * w), w, &[9, 2, 2, 5], B::view_mut(&mut dst, 0..4 * w));
    let mut buf = be.put(&rng.vec(rows * w));
    be.compact_rows(B::view_mut(&mut buf, 0..rows * w), w, &[1, 3, 4, 8]);
    let mut r = be.get(&dst, 4 * w);
    r.extend(be.get(&buf, 4 * w));
    r
}

fn logits_case<B: HostIo>(be: &B, softcap: Option<f32>) -> Vec<f32> {
    let mut rng = Rng::new(9);
    let (m, h, vocab) = (3, 96, 500);
    let head = be.load_weight(weight(&mut rng, vocab, h), None).unwrap();
    let x = be.put(&rng.vec(m * h));
    let mut logits = Logits::default();
    be.logits(B::view(&x, 0..m * h), m, &head, softcap, &mut logits);
    (0..m).flat_map(|r| logits.row(r).to_vec()).collect()
}

/// `out[m, n] = x · wᵀ` of one product shape through `linear`.
fn product<B: HostIo>(be: &B, (m, n, k): (usize, usize, usize), seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let w = be.load_weight(weight(&mut rng, n, k), None).unwrap();
    let x = be.put(&rng.vec(m * k));
    let mut out = be.put(&vec![0.0; m * n]);
    let job = LinearJob { weight: &w, bias: None, out: B::view_mut(&mut out, 0..m * n) };
    be.linear(B::view(&x, 0..m * k), m, &mut [job]);
    be.get(&out, m * n)
}

/// Products of decode's row counts (1 to 16) and odd shapes against the reference.
#[test]
#[ignore = "needs an NVIDIA GPU (scripts/gpu/check.sh)"]
fn products_match_the_reference_at_every_row_count() {
    let (gpu, cpu) = (&*cuda(), &Reference);
    for m in [1, 2, 3, 5, 8, 9, 16] {
        for (n, k) in [(1, 8), (17, 96), (300, 200), (33, 1032), (64, 100), (5, 4100)] {
            let shape = (m, n, k);
            check(
                &format!("product {shape:?}"),
                BF16_TOL,
                product(gpu, shape, 7),
                product(cpu, shape, 7),
            );
        }
    }
}

/// Attention over both cache types, with and without a window and softcap, over head
/// dimensions that take the decode kernel's 16-byte key loads (64, 128, 256), take them only
/// for f32 caches (68) or never (66), and that take the prefill kernel (up to 128) or not (256).
fn attention_cases(gpu: &kiln_cuda::Cuda) {
    let cpu = &Reference;
    for dtype in [KvCacheDtype::F16, KvCacheDtype::F32] {
        for limits in [(None, None), (Some(100), Some(20.0))] {
            for hd in [64, 128, 256, 66, 68] {
                for (step, contexts) in [("prefill", PREFILL), ("decode", DECODE)] {
                    let what = format!("attention {step} {} hd {hd} {limits:?}", dtype.name());
                    let g = attention_case(gpu, dtype, limits, hd, contexts);
                    check(&what, 1e-4, g, attention_case(cpu, dtype, limits, hd, contexts));
                }
            }
            let what = format!("attention long decode {} {limits:?}", dtype.name());
            let g = attention_case(gpu, dtype, limits, 64, LONG_DECODE);
            check(&what, 1e-4, g, attention_case(cpu, dtype, limits, 64, LONG_DECODE));
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (scripts/gpu/check.sh)"]
fn every_operation_matches_the_reference() {
    let (gpu, cpu) = (&*cuda(), &Reference);
    check("embed", F32_TOL, embed_case(gpu), embed_case(cpu));
    check("linear (bias, two jobs)", BF16_TOL, linear_case(gpu), linear_case(cpu));
    for d in NORM_WIDTHS {
        let what = format!("rms_norm {d} + per-head in place");
        check(&what, F32_TOL, norm_case(gpu, d), norm_case(cpu, d));
        for (post, next) in [(true, true), (false, true), (true, false), (false, false)] {
            let what = format!("residual_norm {d} post={post} next={next}");
            let g = residual_case(gpu, d, post, next);
            check(&what, F32_TOL, g, residual_case(cpu, d, post, next));
        }
    }
    let ropes =
        [(RopeStyle::Neox, 32, 3), (RopeStyle::Interleaved, 32, 3), (RopeStyle::Neox, 16, 3)];
    // 20 heads of 16 pairs: 320 pairs, two blocks of 256 along the row.
    for (style, rot, heads) in ropes.into_iter().chain([(RopeStyle::Interleaved, 32, 20)]) {
        let what = format!("rope {style:?} rotary {rot} heads {heads}");
        let g = rope_case(gpu, style, rot, heads);
        check(&what, F32_TOL, g, rope_case(cpu, style, rot, heads));
    }
    for act in [GateActivation::Silu, GateActivation::GeluTanh] {
        check(&format!("gated_act {act:?}"), F32_TOL, act_case(gpu, act), act_case(cpu, act));
    }
    attention_cases(gpu);
    check("gather_rows + compact_rows", 0.0, rows_case(gpu), rows_case(cpu));
    for cap in [None, Some(30.0)] {
        check(
            &format!("logits softcap {cap:?}"),
            BF16_TOL,
            logits_case(gpu, cap),
            logits_case(cpu, cap),
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (scripts/gpu/check.sh)"]
fn kv_blocks_round_trip_and_touch_nothing_else() {
    let gpu = cuda();
    let layout = KvLayout::new(2, 2, 64);
    let spec = KvCacheSpec { layout, dtype: KvCacheDtype::F16, num_blocks: 3, block_size: 4 };
    let mut kv = gpu.alloc_kv(spec).unwrap();
    let n = gpu.kv_block_bytes(&kv);
    assert_eq!(n, 2 * 2 * 4 * 2 * 64 * 2);
    let pattern: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    gpu.write_kv_block(&mut kv, 1, &pattern);
    let mut out = vec![0u8; n];
    gpu.read_kv_block(&kv, 1, &mut out);
    assert_eq!(out, pattern);
    for other in [0, 2] {
        gpu.read_kv_block(&kv, other, &mut out);
        assert!(out.iter().all(|&b| b == 0), "block {other} was touched");
    }
    let int8 = KvCacheSpec { dtype: KvCacheDtype::Int8, ..spec };
    let err = gpu.alloc_kv(int8).err().unwrap().to_string();
    assert!(err.contains("f16 or f32"), "{err}");
}
