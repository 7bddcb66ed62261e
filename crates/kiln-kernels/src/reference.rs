//! The scalar reference backend: every operation of [`Backend`] as plain f32 loops, one thread,
//! no SIMD, no blocking, no fusion. It exists to prove the seam: the same model code runs on it
//! and on [`crate::Cpu`], and the two agree within float rounding (the model crate's
//! `backend_parity` test). It is not fast and is not meant to be.
//!
//! Sums (dot products, softmax denominators) accumulate in f64.
//!
//! Weights are dequantized to f32 at load with the format reference ([`dequantize_row`]); a
//! conversion (`--quantization`) is applied by quantizing each row and dequantizing it again,
//! so the reference sees the same weight values as the CPU backend. The KV store keeps f32
//! values, rounded through f16 first when the cache dtype is f16, or each (token, KV head) row
//! encoded and decoded again (its rotation undone) for the 8-bit dtypes: the values the CPU
//! backend's kernels work with, in the model's own basis.

use std::ops::Range;

use half::f16;
use kiln_backend::{
    AttentionShape, Backend, ForwardError, GateActivation, GgmlType, HostTensor, KvCacheDtype,
    KvCacheSpec, LinearJob, LoadTensorError, Logits, LoraJob, RopeConfig, RopeStyle, SeqSpan,
    Strides, TreeMask,
};

use crate::le_bytes::{get_all, put_all};
use crate::quant::{dequantize_row, quantize_row};
use crate::rope::Rope;
use crate::{host_rows, kv_quant};

/// The scalar reference backend (tests only; slow by design).
#[derive(Clone, Copy, Debug, Default)]
pub struct Reference;

/// A `[rows, cols]` matrix of f32.
pub struct RefMatrix {
    rows: usize,
    cols: usize,
    /// `[rows, cols]`
    data: Vec<f32>,
    /// Bytes of the stored (or converted) tensor.
    stored_bytes: usize,
}

/// Rotary frequencies and pairing.
pub struct RefRope {
    inv_freq: Vec<f32>,
    style: RopeStyle,
    mscale: f32,
}

/// Per layer K and V, `[num_blocks * block_size, num_kv_heads * head_dim]` each.
pub struct RefKvStore {
    spec: KvCacheSpec,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

/// Dequantizes `bytes` (`rows` rows of `ty`) to f32.
fn to_f32_rows(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0; rows * cols];
    if cols == 0 {
        return out;
    }
    let row_bytes = bytes.len() / rows.max(1);
    for (src, dst) in bytes.chunks_exact(row_bytes).zip(out.chunks_exact_mut(cols)) {
        dequantize_row(ty, src, dst);
    }
    out
}

/// `a · b`, accumulated in f64 so that the reference's own rounding stays far below the
/// CPU kernels' (whose 16-lane sums are what it checks).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut sum = 0.0f64;
    for (x, y) in a.iter().zip(b) {
        sum += f64::from(*x) * f64::from(*y);
    }
    sum as f32
}

fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean_sq = dot(x, x) / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv * w;
    }
}

fn gated(act: GateActivation, x: f32, up: f32) -> f32 {
    match act {
        GateActivation::Silu => x / (1.0 + (-x).exp()) * up,
        GateActivation::GeluTanh => {
            let c = (2.0 / std::f32::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044_715 * x * x * x)).tanh()) * up
        }
        GateActivation::Gelu => {
            let x = f64::from(x);
            (0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))) as f32 * up
        }
        GateActivation::ClampedSwiglu { alpha, limit } => {
            GateActivation::clamped_swiglu(alpha, limit, x, up)
        }
    }
}

/// `erf(z)` in f64: its Taylor series for `|z| < 2.5`, else `1 − erfc` by its continued
/// fraction.
fn erf(z: f64) -> f64 {
    let a = z.abs();
    let value = if a < 2.5 {
        let (mut term, mut sum) = (a, a);
        for n in 1..120 {
            term *= -a * a / f64::from(n);
            sum += term / f64::from(2 * n + 1);
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        let mut fraction = 0.0;
        for n in (1..=80).rev() {
            fraction = (f64::from(n) / 2.0) / (a + fraction);
        }
        1.0 - (-a * a).exp() / std::f64::consts::PI.sqrt() / (a + fraction)
    };
    value.copysign(z)
}

impl Backend for Reference {
    type Weight = RefMatrix;
    type Vector = Vec<f32>;
    type LoraMatrix = crate::lora::LoraValues;
    type Rope = RefRope;
    type KvStore = RefKvStore;
    type Buffer = Vec<f32>;
    type View<'a> = &'a [f32];
    type ViewMut<'a> = &'a mut [f32];

    fn name(&self) -> &'static str {
        "reference"
    }

    fn load_weight(
        &self,
        tensor: HostTensor,
        convert: Option<GgmlType>,
    ) -> Result<RefMatrix, LoadTensorError> {
        let (ty, rows, cols) = (tensor.ty(), tensor.rows(), tensor.cols());
        let bytes = tensor.bytes().as_slice();
        let data = to_f32_rows(ty, rows, cols, bytes);
        let Some(to) = convert else {
            return Ok(RefMatrix { rows, cols, data, stored_bytes: bytes.len() });
        };
        let row_bytes = to.row_bytes(cols).ok_or(LoadTensorError::Convert {
            ty: to,
            cols,
            block: to.block_elems(),
        })?;
        let mut converted = vec![0u8; rows * row_bytes];
        for (src, dst) in data.chunks_exact(cols.max(1)).zip(converted.chunks_exact_mut(row_bytes))
        {
            quantize_row(to, src, dst);
        }
        let data = to_f32_rows(to, rows, cols, &converted);
        Ok(RefMatrix { rows, cols, data, stored_bytes: converted.len() })
    }

    fn weight_bytes(&self, weight: &RefMatrix) -> usize {
        weight.stored_bytes
    }

    fn load_vector(&self, values: &[f32]) -> Result<Vec<f32>, LoadTensorError> {
        Ok(values.to_vec())
    }

    fn load_lora_matrix(
        &self,
        values: &[f32],
        dtype: kiln_backend::LoraDtype,
    ) -> Result<Self::LoraMatrix, LoadTensorError> {
        crate::lora::LoraValues::load(values, dtype)
    }

    fn load_rope(&self, config: &RopeConfig) -> Result<RefRope, LoadTensorError> {
        if config.rotary_dim == 0 || !config.rotary_dim.is_multiple_of(2) {
            return Err(LoadTensorError::Unsupported("an odd rotary dimension".into()));
        }
        // The frequencies are parameters, not arithmetic under test: the same as the CPU's.
        let inv_freq = Rope::from_config(config).inv_freq().to_vec();
        Ok(RefRope { inv_freq, style: config.style, mscale: config.mscale })
    }

    fn alloc_kv(&self, spec: KvCacheSpec) -> Result<RefKvStore, ForwardError> {
        kiln_backend::check_block_size(spec.block_size)
            .map_err(|e| ForwardError::KvLayout(format!("block size {e}")))?;
        // V buffers are empty when values are read from the keys.
        let n = spec.layout.num_layers;
        Ok(RefKvStore {
            spec,
            k: (0..n).map(|_| vec![0.0; spec.layer_elems()]).collect(),
            v: (0..n).map(|_| vec![0.0; spec.value_elems()]).collect(),
        })
    }

    fn kv_spec(&self, kv: &RefKvStore) -> KvCacheSpec {
        kv.spec
    }

    /// The reference cache holds f32 values whatever the dtype: per layer, K's then V's block
    /// (K's alone when values are read from the keys).
    fn kv_block_bytes(&self, kv: &RefKvStore) -> usize {
        let s = kv.spec;
        let caches = s.layout.caches();
        caches * s.layout.num_layers * s.block_size * s.layout.num_kv_heads * s.layout.head_dim * 4
    }

    fn read_kv_block(&self, kv: &RefKvStore, block: usize, out: &mut [u8]) {
        assert_eq!(out.len(), self.kv_block_bytes(kv), "block buffer size");
        let n = kv.spec.layer_elems() / kv.spec.num_blocks;
        let mut out = out;
        let bufs = kv.k.iter().zip(&kv.v).flat_map(|(k, v)| [k, v]);
        for buf in bufs.filter(|b| !b.is_empty()) {
            out = put_all(&buf[block * n..][..n], out);
        }
    }

    fn write_kv_block(&self, kv: &mut RefKvStore, block: usize, data: &[u8]) {
        assert_eq!(data.len(), self.kv_block_bytes(kv), "block buffer size");
        let n = kv.spec.layer_elems() / kv.spec.num_blocks;
        let mut data = data;
        let bufs = kv.k.iter_mut().zip(kv.v.iter_mut()).flat_map(|(k, v)| [k, v]);
        for buf in bufs.filter(|b| !b.is_empty()) {
            data = get_all(&mut buf[block * n..][..n], data);
        }
    }

    fn new_buffer(&self) -> Vec<f32> {
        Vec::new()
    }

    fn reserve(&self, buf: &mut Vec<f32>, len: usize) {
        host_rows::reserve(buf, len);
    }

    fn view(buf: &Vec<f32>, range: Range<usize>) -> &[f32] {
        &buf[range]
    }

    fn view_mut(buf: &mut Vec<f32>, range: Range<usize>) -> &mut [f32] {
        &mut buf[range]
    }

    fn embed(&self, table: &RefMatrix, token_ids: &[u32], scale: Option<f32>, out: &mut [f32]) {
        let h = table.cols;
        for (row, &token) in out.chunks_exact_mut(h).zip(token_ids) {
            let t = token as usize;
            row.copy_from_slice(&table.data[t * h..(t + 1) * h]);
            for x in row.iter_mut() {
                *x *= scale.unwrap_or(1.0);
            }
        }
    }

    fn linear(&self, x: &[f32], m: usize, jobs: &mut [LinearJob<'_, Self>]) {
        for job in jobs {
            let w = job.weight;
            for r in 0..m {
                let xr = &x[r * w.cols..(r + 1) * w.cols];
                for n in 0..w.rows {
                    let bias = job.bias.map_or(0.0, |b| b[n]);
                    job.out[r * w.rows + n] = dot(xr, &w.data[n * w.cols..(n + 1) * w.cols]) + bias;
                }
            }
        }
    }

    fn rms_norm(&self, x: &[f32], weight: &Vec<f32>, eps: f32, out: &mut [f32]) {
        let d = weight.len();
        for (xr, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            rms_norm_row(xr, weight, eps, o);
        }
    }

    fn rms_norm_inplace(&self, x: &mut [f32], weight: &Vec<f32>, eps: f32) {
        let d = weight.len();
        let mut row = vec![0.0; d];
        for xr in x.chunks_exact_mut(d) {
            rms_norm_row(xr, weight, eps, &mut row);
            xr.copy_from_slice(&row);
        }
    }

    fn residual_norm(
        &self,
        d: usize,
        branch: &mut [f32],
        post: Option<&Vec<f32>>,
        x: &mut [f32],
        next: Option<(&Vec<f32>, &mut [f32])>,
        eps: f32,
    ) {
        if let Some(w) = post {
            self.rms_norm_inplace(branch, w, eps);
        }
        for (a, b) in x.iter_mut().zip(branch.iter()) {
            *a += b;
        }
        if let Some((w, out)) = next {
            debug_assert_eq!(w.len(), d);
            self.rms_norm(x, w, eps, out);
        }
    }

    fn rope_table(&self, rope: &RefRope, positions: &[u32], table: &mut [f32]) {
        let half = rope.inv_freq.len();
        for (row, &p) in table.chunks_exact_mut(2 * half).zip(positions) {
            for (i, f) in rope.inv_freq.iter().enumerate() {
                let angle = p as f32 * f;
                row[i] = angle.cos() * rope.mscale;
                row[half + i] = angle.sin() * rope.mscale;
            }
        }
    }

    fn rope_apply(&self, rope: &RefRope, x: &mut [f32], num_heads: usize, table: &[f32]) {
        let half = rope.inv_freq.len();
        let num_tokens = table.len() / (2 * half);
        if num_tokens == 0 {
            return;
        }
        let head_dim = x.len() / num_tokens / num_heads;
        for (t, token) in x.chunks_exact_mut(num_heads * head_dim).enumerate() {
            let (cos, sin) = table[t * 2 * half..(t + 1) * 2 * half].split_at(half);
            for head in token.chunks_exact_mut(head_dim) {
                for i in 0..half {
                    let (ia, ib) = match rope.style {
                        RopeStyle::Neox => (i, i + half),
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (a, b) = (head[ia], head[ib]);
                    head[ia] = a * cos[i] - b * sin[i];
                    head[ib] = b * cos[i] + a * sin[i];
                }
            }
        }
    }

    fn gated_act(&self, act: GateActivation, gate: &mut [f32], up: &[f32]) {
        for (g, u) in gate.iter_mut().zip(up) {
            *g = gated(act, *g, *u);
        }
    }

    fn write_kv(&self, kv: &mut RefKvStore, layer: usize, k: &[f32], v: &[f32], slots: &[u32]) {
        let hd = kv.spec.layout.head_dim;
        let row = kv.spec.layout.num_kv_heads * hd;
        let dtype = kv.spec.dtype;
        // The value the CPU backend's kernels read back: f16-rounded, or an 8-bit row's
        // `code_value × scale` (rotated back where the codec rotates).
        let store = |src: &[f32], dst: &mut [f32]| match kv_quant::RowCodec::new(dtype, hd) {
            Some(codec) => {
                let mut codes = vec![0u8; hd];
                let mut scales = vec![0.0; codec.scales_per_row()];
                codec.encode(src, &mut Vec::new(), &mut codes, &mut scales);
                codec.decode_unrotated(&codes, &scales, dst);
            }
            None if dtype == KvCacheDtype::F16 => {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = f16::from_f32(x).to_f32();
                }
            }
            None => dst.copy_from_slice(src),
        };
        for (t, &slot) in slots.iter().enumerate() {
            let dst = slot as usize * row;
            for i in (0..row).step_by(hd) {
                store(&k[t * row + i..][..hd], &mut kv.k[layer][dst + i..][..hd]);
                if !kv.spec.layout.values_from_keys {
                    store(&v[t * row + i..][..hd], &mut kv.v[layer][dst + i..][..hd]);
                }
            }
        }
    }

    fn paged_attention(
        &self,
        kv: &RefKvStore,
        layer: usize,
        q: &[f32],
        seqs: &[SeqSpan],
        block_tables: &[u32],
        (tree, sinks): (Option<TreeMask<'_>>, Option<&Vec<f32>>),
        shape: &AttentionShape,
        out: &mut [f32],
    ) {
        let (hd, bs) = (shape.head_dim, shape.block_size);
        let kv_row = shape.num_kv_heads * hd;
        let q_row = shape.num_heads * hd;
        let kc = &kv.k[layer];
        let vc = if kv.spec.layout.values_from_keys { kc } else { &kv.v[layer] };
        for seq in seqs {
            let table = &block_tables[seq.block_table_start..];
            for i in 0..seq.query_len {
                let row = seq.query_start + i;
                // The slot of every key the row sees, in position order: through the block
                // table, then (a token-tree node) its tree keys.
                let keys = tree.map(|t| t.rows[row]).filter(|k| k.len > 0);
                let p = keys.map_or(seq.context_len - seq.query_len + i, |k| k.pos as usize);
                let lo = shape.sliding_window.map_or(0, |w| (p + 1).saturating_sub(w));
                let shared_end = match keys {
                    _ if !shape.causal => seq.context_len - 1,
                    Some(k) => p - k.len as usize,
                    None => p,
                };
                let mut slots: Vec<usize> =
                    (lo..=shared_end).map(|j| table[j / bs] as usize * bs + j % bs).collect();
                if let (Some(k), Some(tree)) = (keys, tree) {
                    let tree_slots = &tree.slots[k.start as usize..][..k.len as usize];
                    let first = shared_end + 1;
                    slots.extend(
                        (first..=p).filter(|&j| j >= lo).map(|j| tree_slots[j - first] as usize),
                    );
                }
                for h in 0..shape.num_heads {
                    let kvh = h / shape.group();
                    let qh = &q[row * q_row + h * hd..][..hd];
                    let mut scores: Vec<f32> = slots
                        .iter()
                        .map(|&slot| {
                            let s = dot(qh, &kc[slot * kv_row + kvh * hd..][..hd]) * shape.scale;
                            shape.softcap.map_or(s, |cap| cap * (s / cap).tanh())
                        })
                        .collect();
                    let sink = sinks.map(|s| s[h]);
                    let max = scores.iter().copied().chain(sink).fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0f64;
                    for s in &mut scores {
                        *s = (*s - max).exp();
                        sum += f64::from(*s);
                    }
                    // A sink is one more softmax term whose value row is zero.
                    if let Some(sink) = sink {
                        sum += f64::from((sink - max).exp());
                    }
                    let mut acc = vec![0.0f64; hd];
                    for (&slot, s) in slots.iter().zip(&scores) {
                        let vr = &vc[slot * kv_row + kvh * hd..][..hd];
                        for (a, b) in acc.iter_mut().zip(vr) {
                            *a += f64::from(*s) * f64::from(*b);
                        }
                    }
                    let o = &mut out[row * q_row + h * hd..][..hd];
                    for (o, a) in o.iter_mut().zip(&acc) {
                        *o = (a / sum) as f32;
                    }
                }
            }
        }
    }

    fn supports_token_trees(&self) -> bool {
        true
    }

    fn supports_attention_sinks(&self) -> bool {
        true
    }

    fn copy_kv_slots(&self, kv: &mut RefKvStore, pairs: &[(u32, u32)]) {
        let row = kv.spec.layout.num_kv_heads * kv.spec.layout.head_dim;
        for &(src, dst) in pairs {
            let (src, dst) = (src as usize * row, dst as usize * row);
            for buf in kv.k.iter_mut().chain(kv.v.iter_mut()).filter(|b| !b.is_empty()) {
                buf.copy_within(src..src + row, dst);
            }
        }
    }

    fn supports_latent_attention(&self) -> bool {
        true
    }

    fn copy_strided(
        &self,
        src: &[f32],
        s: Strides,
        dst: &mut [f32],
        d: Strides,
        counts: (usize, usize, usize),
    ) {
        host_rows::copy_strided(src, s, dst, d, counts);
    }

    fn compact_rows(&self, buf: &mut [f32], width: usize, rows: &[usize]) {
        host_rows::compact_rows(buf, width, rows);
    }

    fn gather_rows(&self, src: &[f32], width: usize, rows: &[usize], dst: &mut [f32]) {
        host_rows::gather_rows(src, width, rows, dst);
    }

    fn supports_lora(&self) -> bool {
        true
    }

    fn supports_pooling(&self) -> bool {
        true
    }

    fn supports_encoders(&self) -> bool {
        true
    }

    fn layer_norm(
        &self,
        d: usize,
        x: &mut [f32],
        branch: Option<&[f32]>,
        (weight, bias): (&Vec<f32>, &Vec<f32>),
        eps: f32,
    ) {
        for (r, row) in x.chunks_exact_mut(d).enumerate() {
            if let Some(b) = branch {
                for (a, v) in row.iter_mut().zip(&b[r * d..][..d]) {
                    *a += v;
                }
            }
            let mean = row.iter().map(|v| f64::from(*v)).sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (f64::from(*v) - mean).powi(2)).sum::<f64>() / d as f64;
            let inv = 1.0 / (var + f64::from(eps)).sqrt();
            for ((v, w), b) in row.iter_mut().zip(weight).zip(bias) {
                *v = ((f64::from(*v) - mean) * inv * f64::from(*w) + f64::from(*b)) as f32;
            }
        }
    }

    fn activation(&self, act: GateActivation, x: &mut [f32]) {
        for v in x {
            *v = gated(act, *v, 1.0);
        }
    }

    fn rows_to_host(&self, x: &[f32], m: usize, width: usize, out: &mut Logits) {
        out.reset(m, width);
        out.as_mut_slice().copy_from_slice(&x[..m * width]);
    }

    fn lora_add(&self, x: &[f32], k: usize, n: usize, jobs: &[LoraJob<'_, Self>], out: &mut [f32]) {
        crate::lora::lora_add_scalar(x, k, n, jobs, out);
    }

    fn supports_permuted_inputs(&self) -> bool {
        true
    }

    fn permute_cols(&self, x: &[f32], m: usize, order: &[usize], out: &mut [f32]) {
        let len = m * order.len();
        host_rows::permute_cols(&x[..len], order, &mut out[..len]);
    }

    fn supports_experts(&self) -> bool {
        true
    }

    fn combine_rows(
        &self,
        src: &[f32],
        width: usize,
        k: usize,
        rows: &[usize],
        weights: &[f32],
        out: &mut [f32],
    ) {
        host_rows::combine_rows(src, width, k, rows, weights, out);
    }

    fn logits(
        &self,
        x: &[f32],
        m: usize,
        head: &RefMatrix,
        softcap: Option<f32>,
        out: &mut Logits,
    ) {
        out.reset(m, head.rows);
        for r in 0..m {
            let xr = &x[r * head.cols..(r + 1) * head.cols];
            for (n, o) in out.row_mut(r).iter_mut().enumerate() {
                let z = dot(xr, &head.data[n * head.cols..(n + 1) * head.cols]);
                *o = softcap.map_or(z, |cap| cap * (z / cap).tanh());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kiln_backend::{KvCacheDtype, KvLayout};

    use super::*;

    #[test]
    fn a_block_read_out_and_written_back_is_the_same_block() {
        let layout = KvLayout::new(2, 2, 8);
        let spec = KvCacheSpec { layout, dtype: KvCacheDtype::F16, num_blocks: 3, block_size: 4 };
        let mut kv = Reference.alloc_kv(spec).unwrap();
        let n = Reference.kv_block_bytes(&kv);
        assert_eq!(n, 2 * 2 * 4 * 2 * 8 * 4); // f32 values whatever the dtype
        let pattern: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        Reference.write_kv_block(&mut kv, 1, &pattern);
        let mut out = vec![0u8; n];
        Reference.read_kv_block(&kv, 1, &mut out);
        assert_eq!(out, pattern);
        for other in [0, 2] {
            Reference.read_kv_block(&kv, other, &mut out);
            assert!(out.iter().all(|&b| b == 0), "block {other} was touched");
        }
    }
}
