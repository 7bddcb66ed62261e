//! Multi-head latent attention (DeepSeek V2/V3), in its absorbed form: the cache holds one
//! row per token, the latent `c` (`kv_lora_rank`, RMSNormed) and the rotated RoPE key
//! `k_pe` (`qk_rope_head_dim`), and attention runs as one KV head shared by every query head.
//!
//! Per head `h`, with `W_UK[h]` (`[qk_nope, r]`) and `W_UV[h]` (`[v_head, r]`) the key's and
//! value's up projections of the latent:
//! - `q_nope[h] · (W_UK[h] · c_j) = (W_UK[h]ᵀ · q_nope[h]) · c_j`: the query row of head `h`
//!   is `[W_UK[h]ᵀ · q_nope[h], rope(q_pe[h])]`, the key row `[c_j, rope(k_pe_j)]`, so the
//!   scores are those of the expanded keys (transformers' form) up to float rounding;
//! - `Σ_j p_j (W_UV[h] · c_j) = W_UV[h] · Σ_j p_j c_j`: attention reads each key row as its
//!   value row too ([`kiln_backend::KvLayout::values_from_keys`]); the first `r` elements of
//!   head `h`'s output are `Σ_j p_j c_j`, which `W_UV[h]` takes to the head's value.
//!
//! The per-head matmuls run as one grouped call each (`linear_experts`, a "expert" per head,
//! its rows the step's tokens), on head-major copies of the rows (`copy_strided`). Every op
//! computes each token's row alone, so batching, chunking and caching change no bit.

use kiln_backend::ops::MAX_GROUP;
use kiln_backend::{Backend, ExpertLinearJob, LinearJob, Strides};

use super::StepBuffers;
use crate::family::deepseek::LATENT_NORM_EPS;
use crate::names::{LayerTensor as L, Tensor};
use crate::weights::Weights;
use crate::{LoadError, MlaConfig};

/// How the query is projected.
enum QueryProj<B: Backend> {
    /// `q_proj`: `[heads · qk_head, hidden]`.
    Direct(B::Weight),
    /// `q_b_proj(rmsnorm(q_a_proj(x)))`: `[q_lora_rank, hidden]`, `[q_lora_rank]`,
    /// `[heads · qk_head, q_lora_rank]`.
    Low { a: B::Weight, norm: B::Vector, b: B::Weight },
}

/// Per head `W_UK[h]ᵀ`, then per head `W_UV[h]`.
type HeadMatrices<B> = (Vec<<B as Backend>::Weight>, Vec<<B as Backend>::Weight>);

/// One layer's latent attention weights.
pub(super) struct MlaLayer<B: Backend> {
    q: QueryProj<B>,
    /// `[kv_lora_rank, hidden]` the latent's and `[qk_rope, hidden]` the RoPE key's rows of
    /// `kv_a_proj_with_mqa`.
    kv_a_latent: B::Weight,
    kv_a_rope: B::Weight,
    /// `[kv_lora_rank]`
    latent_norm: B::Vector,
    /// Per head `[kv_lora_rank, qk_nope]`: `W_UK[h]ᵀ`.
    key_up_t: Vec<B::Weight>,
    /// Per head `[v_head, kv_lora_rank]`: `W_UV[h]`.
    value_up: Vec<B::Weight>,
    cfg: MlaConfig,
    heads: usize,
}

/// The head-major rows of each head, `h · n` for `h` in `0..=heads` (the "experts" of the
/// per-head matmuls), on the stack: a step's checks keep `heads` within [`MAX_GROUP`] (one
/// KV head).
fn head_offsets(heads: usize, n: usize) -> [usize; MAX_GROUP + 1] {
    std::array::from_fn(|h| h.min(heads) * n)
}

/// The widest per-slice scratch latent attention needs, in elements per token: of `gate`
/// (the raw query), `up` (the compressed query, then the rotated query parts), `picked` (a
/// head-major input) and `picked_out` (a head-major output).
pub(super) fn scratch_widths(cfg: &MlaConfig, heads: usize) -> [usize; 4] {
    let (r, dn, dr, dv) =
        (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
    [
        heads * (dn + dr),
        cfg.q_lora_rank.unwrap_or(0).max(heads * dr),
        heads * dn.max(r),
        heads * r.max(dv),
    ]
}

impl<B: Backend> MlaLayer<B> {
    pub(super) fn load(
        w: &Weights<'_, B>,
        l: usize,
        hidden: usize,
        cfg: MlaConfig,
        heads: usize,
    ) -> Result<Self, LoadError> {
        let t = |x: L| Tensor::Layer(l, x);
        let (r, dn, dr, dv) =
            (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
        let q_rows = heads * cfg.qk_head_dim();
        let q = match cfg.q_lora_rank {
            None => QueryProj::Direct(w.matrix(t(L::Q), q_rows, hidden)?),
            Some(rank) => QueryProj::Low {
                a: w.matrix(t(L::QA), rank, hidden)?,
                norm: w.vector(t(L::QANorm), rank)?,
                b: w.matrix(t(L::QB), q_rows, rank)?,
            },
        };
        let mut kv_a = w.matrix_parts(t(L::KvA), (r + dr, hidden), &[(0, r), (r, dr)])?;
        let kv_a_rope = kv_a.pop().expect("two parts");
        let kv_a_latent = kv_a.pop().expect("two parts");
        let (key_up_t, value_up) = if w.contains(t(L::KB)) {
            // llama.cpp's split: per head `[r, dn]` and `[dv, r]` slices of stacked tensors.
            let stacked = |x: L, rows, cols| {
                let name = w.naming.name(t(x));
                (0..heads)
                    .map(|h| {
                        let m = w.source.expert_matrix(&name, (h, heads), rows, cols)?;
                        w.host_matrix(format!("{name}[{h}]"), m)
                    })
                    .collect::<Result<Vec<_>, LoadError>>()
            };
            (stacked(L::KB, r, dn)?, stacked(L::VB, dv, r)?)
        } else {
            Self::split_kv_b(w, t(L::KvB), (heads, r, dn, dv))?
        };
        Ok(Self {
            q,
            kv_a_latent,
            kv_a_rope,
            latent_norm: w.vector(t(L::KvANorm), r)?,
            key_up_t,
            value_up,
            cfg,
            heads,
        })
    }

    /// `kv_b_proj` (`[heads · (dn + dv), r]`) cut per head into `W_UK[h]ᵀ` (transposed on the
    /// host, so it must be stored as floats) and `W_UV[h]`.
    fn split_kv_b(
        w: &Weights<'_, B>,
        kv_b: Tensor,
        (heads, r, dn, dv): (usize, usize, usize, usize),
    ) -> Result<HeadMatrices<B>, LoadError> {
        let name = w.naming.name(kv_b);
        let tensor = w.source.matrix(&name, heads * (dn + dv), r)?;
        let bad = |m: String| LoadError::Backend { name: name.clone(), message: m };
        let (mut keys, mut values) = (Vec::with_capacity(heads), Vec::with_capacity(heads));
        for h in 0..heads {
            let first = h * (dn + dv);
            let key = tensor.rows_slice(first, dn).and_then(|k| k.to_f32_vec()).ok_or_else(|| {
                bad(format!(
                    "a {:?} kv_b_proj cannot be split per head (it must be stored as floats, or \
                     as attn_k_b / attn_v_b)",
                    tensor.ty()
                ))
            })?;
            // `[dn, r]` → `[r, dn]`.
            let mut key_t = vec![0.0f32; r * dn];
            for (i, row) in key.chunks_exact(r).enumerate() {
                for (j, &x) in row.iter().enumerate() {
                    key_t[j * dn + i] = x;
                }
            }
            let key_t = kiln_backend::HostTensor::from_f32(r, dn, &key_t)
                .ok_or_else(|| bad("transposed key projection".into()))?;
            keys.push(w.host_matrix(format!("{name}[{h}].keys"), key_t)?);
            let value =
                tensor.rows_slice(first + dn, dv).ok_or_else(|| bad("value rows".into()))?;
            values.push(w.host_matrix(format!("{name}[{h}].values"), value)?);
        }
        Ok((keys, values))
    }

    /// Every matrix of the layer.
    pub(super) fn matrices(&self) -> Vec<&B::Weight> {
        let q: Vec<&B::Weight> = match &self.q {
            QueryProj::Direct(q) => vec![q],
            QueryProj::Low { a, b, .. } => vec![a, b],
        };
        q.into_iter()
            .chain([&self.kv_a_latent, &self.kv_a_rope])
            .chain(&self.key_up_t)
            .chain(&self.value_up)
            .collect()
    }

    /// The query and cache rows of token rows `rows` of `b.normed`: `b.q` gets `[n, heads, r
    /// + dr]` (absorbed query, rotated RoPE part), `b.k` `[n, r + dr]` (normed latent, rotated
    /// RoPE key). `rope` rotates with the slice's angles `b.angles`.
    pub(super) fn query_and_key(
        &self,
        be: &B,
        b: &mut StepBuffers<'_, B>,
        rows: &std::ops::Range<usize>,
        (rope, hidden): (&B::Rope, usize),
    ) {
        let (hs, n) = (self.heads, rows.len());
        let (r, dn, dr) =
            (self.cfg.kv_lora_rank, self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim);
        let qk = dn + dr;
        let x = B::view(b.normed, rows.start * hidden..rows.end * hidden);
        // The raw query `[n, heads, dn + dr]` into `gate`.
        let raw = B::view_mut(b.gate, 0..n * hs * qk);
        match &self.q {
            QueryProj::Direct(q) => {
                be.linear(x, n, &mut [LinearJob { weight: q, bias: None, out: raw }]);
            }
            QueryProj::Low { a, norm, b: up } => {
                let rank = self.cfg.q_lora_rank.unwrap_or(0);
                let low = B::view_mut(b.up, 0..n * rank);
                be.linear(x, n, &mut [LinearJob { weight: a, bias: None, out: low }]);
                be.rms_norm_inplace(B::view_mut(b.up, 0..n * rank), norm, LATENT_NORM_EPS);
                let low = B::view(b.up, 0..n * rank);
                be.linear(low, n, &mut [LinearJob { weight: up, bias: None, out: raw }]);
            }
        }
        // The latent `[n, r]` into `v` and the RoPE key `[n, dr]` into `attn` (neither is
        // used before attention otherwise).
        let (lat, pe) = (0..n * r, 0..n * dr);
        be.linear(
            x,
            n,
            &mut [
                LinearJob {
                    weight: &self.kv_a_latent,
                    bias: None,
                    out: B::view_mut(b.v, lat.clone()),
                },
                LinearJob {
                    weight: &self.kv_a_rope,
                    bias: None,
                    out: B::view_mut(b.attn, pe.clone()),
                },
            ],
        );
        be.rms_norm_inplace(B::view_mut(b.v, lat.clone()), &self.latent_norm, LATENT_NORM_EPS);
        let angles = B::view(b.angles, rows.start * dr..rows.end * dr);
        be.rope_apply(rope, B::view_mut(b.attn, pe.clone()), 1, angles);
        // The cache rows `[n, r + dr]`: latent, then RoPE key.
        let row = r + dr;
        let k_out = rows.start * row..rows.end * row;
        let one = |width| Strides { offset: 0, outer: width, inner: 0 };
        be.copy_strided(
            B::view(b.v, lat),
            one(r),
            B::view_mut(b.k, k_out.clone()),
            one(row),
            (n, 1, r),
        );
        let dst = Strides { offset: r, outer: row, inner: 0 };
        be.copy_strided(B::view(b.attn, pe), one(dr), B::view_mut(b.k, k_out), dst, (n, 1, dr));
        // Head-major `q_nope` `[heads, n, dn]` into `picked`; token-major `q_pe` `[n, heads,
        // dr]` into `up`, rotated.
        // Segment (token i, head j) of a token-major and of a head-major layout.
        let token_head = |offset, width| Strides { offset, outer: hs * width, inner: width };
        let head_major = |width| Strides { offset: 0, outer: width, inner: n * width };
        let raw = B::view(b.gate, 0..n * hs * qk);
        let q_nope = B::view_mut(b.picked, 0..hs * n * dn);
        be.copy_strided(raw, token_head(0, qk), q_nope, head_major(dn), (n, hs, dn));
        let raw = B::view(b.gate, 0..n * hs * qk);
        let q_pe = B::view_mut(b.up, 0..n * hs * dr);
        be.copy_strided(raw, token_head(dn, qk), q_pe, token_head(0, dr), (n, hs, dr));
        be.rope_apply(rope, B::view_mut(b.up, 0..n * hs * dr), hs, angles);
        // The absorbed query `[heads, n, r]` into `picked_out`.
        let offsets = head_offsets(hs, n);
        let job = ExpertLinearJob {
            weights: &self.key_up_t,
            width: r,
            biases: None,
            out: &mut *b.picked_out,
        };
        be.linear_experts(&*b.picked, dn, &offsets[..=hs], &mut [job]);
        // The query rows `[n, heads, r + dr]`.
        let q_out = rows.start * hs * row..rows.end * hs * row;
        let q_lat = B::view(b.picked_out, 0..hs * n * r);
        let q_rows = B::view_mut(b.q, q_out.clone());
        be.copy_strided(q_lat, head_major(r), q_rows, token_head(0, row), (n, hs, r));
        let q_pe = B::view(b.up, 0..n * hs * dr);
        be.copy_strided(
            q_pe,
            token_head(0, dr),
            B::view_mut(b.q, q_out),
            token_head(r, row),
            (n, hs, dr),
        );
    }

    /// The heads' values of attention rows `rows` (`b.attn`, `[n, heads, r + dr]`, the first
    /// `r` of each head the attended latent) into `b.q` as `[n, heads · v_head]`, the output
    /// projection's input.
    pub(super) fn values(&self, be: &B, b: &mut StepBuffers<'_, B>, rows: &std::ops::Range<usize>) {
        let (hs, n) = (self.heads, rows.len());
        let (r, dr, dv) = (self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim, self.cfg.v_head_dim);
        let row = r + dr;
        let token_head = |offset, width| Strides { offset, outer: hs * width, inner: width };
        let head_major = |width| Strides { offset: 0, outer: width, inner: n * width };
        let attn = B::view(b.attn, rows.start * hs * row..rows.end * hs * row);
        let lat = B::view_mut(b.picked, 0..hs * n * r);
        be.copy_strided(attn, token_head(0, row), lat, head_major(r), (n, hs, r));
        let offsets = head_offsets(hs, n);
        let job = ExpertLinearJob {
            weights: &self.value_up,
            width: dv,
            biases: None,
            out: &mut *b.picked_out,
        };
        be.linear_experts(&*b.picked, r, &offsets[..=hs], &mut [job]);
        let out = B::view_mut(b.q, rows.start * hs * dv..rows.end * hs * dv);
        let src = B::view(b.picked_out, 0..hs * n * dv);
        be.copy_strided(src, head_major(dv), out, token_head(0, dv), (n, hs, dv));
    }
}
