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
    let table = be.load_weight(weight(&mut rng, 50, 96), None).unwrap();
    let ids: Vec<u32> = (0..10).map(|_| rng.below(50)).collect();
    let mut out = be.put(&vec![0.0; 10 * 96]);
    be.embed(&table, &ids, Some(1.7), B::view_mut(&mut out, 0..960));
    be.get(&out, 960)
}

fn linear_case<B: HostIo>(be: &B) -> Vec<f32> {
    let mut rng = Rng::new(2);
    let (m, k) = (5, 96);
    let wq = be.load_weight(weight(&mut rng, 64, k), None).unwrap();
    let wk = be.load_weight(weight(&mut rng, 32, k), None).unwrap();
    let bias = be.load_vector(&rng.vec(64)).unwrap();
    let x = be.put(&rng.vec(m * k));
    let (mut q, mut kk) = (be.put(&vec![0.0; m * 64]), be.put(&vec![0.0; m * 32]));
    be.linear(
        B::view(&x, 0..m * k),
        m,
        &mut [
            LinearJob { weight: &wq, bias: Some(&bias), out: B::view_mut(&mut q, 0..m * 64) },
            LinearJob { weight: &wk, bias: None, out: B::view_mut(&mut kk, 0..m * 32) },
        ],
    );
    let mut r = be.get(&q, m * 64);
    r.extend(be.get(&kk, m * 32));
    r
}

fn norm_case<B: HostIo>(be: &B) -> Vec<f32> {
    let mut rng = Rng::new(3);
    let (rows, d) = (7, 96);
    let w = be.load_vector(&rng.vec(d)).unwrap();
    let head_w = be.load_vector(&rng.vec(16)).unwrap();
    let x = be.put(&rng.vec(rows * d));
    let mut out = be.put(&vec![0.0; rows * d]);
    be.rms_norm(B::view(&x, 0..rows * d), &w, 1e-6, B::view_mut(&mut out, 0..rows * d));
    be.rms_norm_inplace(B::view_mut(&mut out, 0..rows * d), &head_w, 1e-6);
    be.get(&out, rows * d)
}

fn residual_case<B: HostIo>(be: &B, post: bool, next: bool) -> Vec<f32> {
    let mut rng = Rng::new(4);
    let (rows, d) = (6, 96);
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

fn rope_case<B: HostIo>(be: &B, style: RopeStyle, rotary_dim: usize) -> Vec<f32> {
    let mut rng = Rng::new(5);
    let (t, heads, hd) = (9, 3, 32);
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

/// A prefill step (a 40-token prompt, a decode at position 1,499, a 7-token chunk after 600
/// cached tokens: the tiled kernel) or a decode step (positions 1,499, 699 and 2: the split-K
/// kernel, up to three key splits), over a scrambled block table.
fn attention_case<B: HostIo>(
    be: &B,
    dtype: KvCacheDtype,
    window: Option<usize>,
    softcap: Option<f32>,
    decode: bool,
) -> Vec<f32> {
    let mut rng = Rng::new(7);
    let (kvh, hd, nh, bs) = (2, 64, 8, 16);
    let layout = KvLayout { num_layers: 2, num_kv_heads: kvh, head_dim: hd };
    let spec = KvCacheSpec { layout, dtype, num_blocks: 300, block_size: bs };
    let mut kv = be.alloc_kv(spec).unwrap();
    let shape = AttentionShape {
        num_heads: nh,
        num_kv_heads: kvh,
        head_dim: hd,
        block_size: bs,
        scale: 0.125,
        sliding_window: window,
        softcap,
    };
    // (context, new tokens)
    let contexts: [(usize, usize); 3] =
        if decode { [(1500, 1), (700, 1), (3, 1)] } else { [(40, 40), (1500, 1), (607, 7)] };
    let mut seqs = Vec::new();
    let mut tables = Vec::new();
    let mut next_block = 0u32;
    let mut rows = 0;
    for &(ctx, new) in &contexts {
        let blocks = ctx.div_ceil(bs);
        let table: Vec<u32> = (0..blocks)
            .map(|_| {
                next_block += 1;
                (next_block * 37) % 300
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
        None,
        &shape,
        B::view_mut(&mut out, 0..n),
    );
    be.get(&out, n)
}

fn rows_case<B: HostIo>(be: &B) -> Vec<f32> {
    let mut rng = Rng::new(8);
    let (rows, w) = (10, 24);
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

#[test]
#[ignore = "needs an NVIDIA GPU (scripts/gpu/check.sh)"]
fn every_operation_matches_the_reference() {
    let (gpu, cpu) = (&*cuda(), &Reference);
    check("embed", F32_TOL, embed_case(gpu), embed_case(cpu));
    check("linear (bias, two jobs)", BF16_TOL, linear_case(gpu), linear_case(cpu));
    check("rms_norm + per-head in place", F32_TOL, norm_case(gpu), norm_case(cpu));
    for (post, next) in [(true, true), (false, true), (true, false), (false, false)] {
        let what = format!("residual_norm post={post} next={next}");
        check(&what, F32_TOL, residual_case(gpu, post, next), residual_case(cpu, post, next));
    }
    for (style, rot) in [(RopeStyle::Neox, 32), (RopeStyle::Interleaved, 32), (RopeStyle::Neox, 16)]
    {
        let what = format!("rope {style:?} rotary {rot}");
        check(&what, F32_TOL, rope_case(gpu, style, rot), rope_case(cpu, style, rot));
    }
    for act in [GateActivation::Silu, GateActivation::GeluTanh] {
        check(&format!("gated_act {act:?}"), F32_TOL, act_case(gpu, act), act_case(cpu, act));
    }
    for dtype in [KvCacheDtype::F16, KvCacheDtype::F32] {
        for (window, cap) in [(None, None), (Some(100), Some(20.0))] {
            for decode in [false, true] {
                let step = if decode { "decode" } else { "prefill" };
                let what =
                    format!("attention {step} {} window {window:?} cap {cap:?}", dtype.name());
                let g = attention_case(gpu, dtype, window, cap, decode);
                check(&what, 1e-4, g, attention_case(cpu, dtype, window, cap, decode));
            }
        }
    }
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
    let layout = KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 64 };
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
