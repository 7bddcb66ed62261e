//! `kiln plan`'s arithmetic: memory capacity (KV bytes per token, tokens and sequences that fit,
//! the longest context) and a roofline estimate of decode and prefill speed from the machine's
//! memory bandwidth and peak arithmetic rate.
//!
//! Capacity: `kv_bytes_per_token = caches × num_layers × num_kv_heads × (head_dim ×
//! bytes_per_elem + 4 × scales_per_row)` (f32 scales for the 8-bit types; `caches` is 2, K and
//! V, or 1 for latent attention, whose one row per token serves as both)
//! (kiln stores every layer's full K and V, sliding-window layers included);
//! `max_tokens = (memory − weights − reserve) / kv_bytes_per_token`.
//!
//! Roofline of one decode step over `b` sequences at context `L`: it must read every weight
//! once plus each sequence's K/V (sliding-window layers only their window), and do
//! `b × (2 × matmul MACs + attention FLOPs)`; the step takes the larger of bytes / bandwidth and
//! FLOPs / peak. Prefill is arithmetic: per token, 2 × the blocks' matmul MACs (the LM head
//! runs once per prompt) plus attention at the mean context `L / 2`.
//!
//! A mixture of experts holds all its experts (capacity counts `weight_bytes`), but a token
//! multiplies with its `k` alone: the MACs count `k` experts' FFNs and the router, and a
//! decode step reads the bytes every token shares plus the distinct experts its `b` tokens
//! pick, `E·(1 − (1 − k/E)^b)` per sparse layer on average for uniform routing.

use kiln_backend::KvCacheDtype;

/// The shape facts the estimate needs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    /// Every weight's bytes (what the memory holds).
    pub weight_bytes: u64,
    /// The bytes one token reads (less than `weight_bytes` with experts).
    pub active_weight_bytes: u64,
    /// The sparse layers' experts, when the model has any.
    pub experts: Option<ExpertShape>,
    pub num_layers: usize,
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Caches per layer: 2 (K and V), 1 with latent attention.
    pub kv_caches: usize,
    /// Attention's matmul multiply-adds per token and layer when they are not those of q/k/v/o
    /// projections of `head_dim`-wide heads (latent attention).
    pub attn_macs: Option<usize>,
    /// FFN width; the MLP is gated (gate, up, down), an encoder's ungated (up, down).
    pub intermediate: usize,
    pub vocab: usize,
    /// A bidirectional encoder (BERT): an ungated MLP, and every token of an input attends to
    /// all of its tokens (a causal prefill's token attends to half of them on average).
    pub encoder: bool,
    /// Attention window of each layer (`None` = full).
    pub layer_windows: Vec<Option<usize>>,
    pub max_position_embeddings: usize,
}

/// The experts of a mixture-of-experts model's sparse layers.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertShape {
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// One expert's FFN width.
    pub intermediate: usize,
    /// The FFN width of the shared expert every token also runs (0: none).
    pub shared_intermediate: usize,
    /// How many layers have experts (the others' MLP is dense, of `ModelShape::intermediate`).
    pub sparse_layers: usize,
}

impl ModelShape {
    /// Multiply-adds of the transformer blocks' matmuls per token.
    pub fn block_macs(&self) -> u64 {
        let (h, q, kv) =
            (self.hidden, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim);
        let attn = self.attn_macs.unwrap_or(h * q + 2 * h * kv + q * h);
        let dense = if self.encoder { 2 } else { 3 } * h * self.intermediate;
        let (sparse_layers, sparse) = self.experts.as_ref().map_or((0, 0), |e| {
            let shared =
                if e.shared_intermediate > 0 { 3 * h * e.shared_intermediate + h } else { 0 };
            let routed = 3 * h * e.intermediate * e.experts_per_token + h * e.num_experts;
            (e.sparse_layers, routed + shared)
        });
        let dense_layers = self.num_layers - sparse_layers.min(self.num_layers);
        (attn * self.num_layers + dense * dense_layers + sparse * sparse_layers) as u64
    }

    /// Weight bytes one decode step over `batch` tokens reads: what every token reads, plus
    /// the experts beyond a token's own `k` that the others pick (expected, uniform routing).
    pub fn step_weight_bytes(&self, batch: usize) -> f64 {
        let active = self.active_weight_bytes as f64;
        let Some(e) = self.experts.as_ref().filter(|e| e.num_experts > e.experts_per_token) else {
            return active;
        };
        let (n, k) = (e.num_experts as f64, e.experts_per_token as f64);
        // One expert's bytes over all sparse layers.
        let per_expert = (self.weight_bytes as f64 - active) / (n - k);
        let distinct = n * (1.0 - (1.0 - k / n).powf(batch.max(1) as f64));
        active + (distinct - k).max(0.0) * per_expert
    }

    /// Multiply-adds of the LM head per token.
    pub fn lm_head_macs(&self) -> u64 {
        (self.vocab * self.hidden) as u64
    }

    /// Positions each layer attends to at context `len`, summed over layers.
    pub fn attended_positions(&self, len: usize) -> u64 {
        (0..self.num_layers)
            .map(|l| {
                self.layer_windows.get(l).copied().flatten().map_or(len, |w| w.min(len)) as u64
            })
            .sum()
    }

    /// Attention FLOPs of one query token at context `len` (QKᵀ and PV, 2 FLOPs a MAC).
    pub fn attention_flops(&self, len: usize) -> u64 {
        4 * (self.num_heads * self.head_dim) as u64 * self.attended_positions(len)
    }

    /// KV cache bytes per token over all layers (8-bit types: with their scales).
    pub fn kv_bytes_per_token(&self, dtype: KvDtype) -> u64 {
        (self.kv_caches * self.num_layers * self.num_kv_heads) as u64
            * dtype.row_bytes(self.head_dim)
    }

    /// K/V bytes one decode step reads for one sequence at context `len`.
    pub fn kv_bytes_read(&self, len: usize, dtype: KvDtype) -> u64 {
        (self.kv_caches * self.num_kv_heads) as u64
            * dtype.row_bytes(self.head_dim)
            * self.attended_positions(len)
    }
}

/// KV cache element types for planning: the engine's (`--kv-cache-dtype`) and bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
    Bf16,
    Int8,
    Fp8E4M3,
    Fp8E5M2,
}

impl KvDtype {
    const ALL: [Self; 6] =
        [Self::F32, Self::F16, Self::Bf16, Self::Int8, Self::Fp8E4M3, Self::Fp8E5M2];

    /// Bytes of one element (scales not included).
    pub fn bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Int8 | Self::Fp8E4M3 | Self::Fp8E5M2 => 1,
        }
    }

    /// Bytes of one (token, KV head) row of `head_dim` elements, as the engine stores it: the
    /// 8-bit types add the engine's f32 scales ([`KvCacheDtype::scales_per_row`]).
    pub fn row_bytes(self, head_dim: usize) -> u64 {
        let scales = match self {
            Self::Int8 => KvCacheDtype::Int8.scales_per_row(head_dim),
            Self::Fp8E4M3 => KvCacheDtype::Fp8E4M3.scales_per_row(head_dim),
            Self::Fp8E5M2 => KvCacheDtype::Fp8E5M2.scales_per_row(head_dim),
            Self::F32 | Self::F16 | Self::Bf16 => 0,
        };
        (head_dim as u64) * self.bytes() + 4 * scales as u64
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
            Self::Fp8E4M3 => "fp8_e4m3",
            Self::Fp8E5M2 => "fp8_e5m2",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "fp8" {
            return Ok(Self::Fp8E4M3);
        }
        Self::ALL.into_iter().find(|d| d.name() == s).ok_or_else(|| {
            format!("`{s}` is not a KV dtype (f32, f16, bf16, int8, fp8 = fp8_e4m3, fp8_e5m2)")
        })
    }
}

/// How much fits in a memory budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub kv_bytes_per_token: u64,
    /// Bytes left for the KV cache.
    pub kv_budget: u64,
    pub max_tokens: u64,
    /// Sequences of `max_model_len` tokens that fit at once.
    pub max_sequences: u64,
    /// The longest single context that fits (capped by the model's positions).
    pub longest_context: u64,
}

pub fn capacity(
    shape: &ModelShape,
    memory: u64,
    reserve: u64,
    max_model_len: u64,
    dtype: KvDtype,
) -> Capacity {
    let kv_bytes_per_token = shape.kv_bytes_per_token(dtype).max(1);
    let kv_budget = memory.saturating_sub(shape.weight_bytes).saturating_sub(reserve);
    let max_tokens = kv_budget / kv_bytes_per_token;
    Capacity {
        kv_bytes_per_token,
        kv_budget,
        max_tokens,
        max_sequences: max_tokens / max_model_len.max(1),
        longest_context: max_tokens.min(shape.max_position_embeddings as u64),
    }
}

/// The machine's limits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Machine {
    /// Bytes per second read from memory.
    pub bandwidth: f64,
    /// Arithmetic operations per second of the matmul kernels.
    pub peak_ops: f64,
}

/// A predicted decode rate and what bounds it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeEstimate {
    pub batch: usize,
    pub step_seconds: f64,
    pub tokens_per_second: f64,
    /// True when arithmetic, not memory, bounds the step.
    pub compute_bound: bool,
}

pub fn decode_estimate(
    shape: &ModelShape,
    machine: Machine,
    batch: usize,
    context: usize,
    dtype: KvDtype,
) -> DecodeEstimate {
    let b = batch as f64;
    let bytes = shape.step_weight_bytes(batch) + b * shape.kv_bytes_read(context, dtype) as f64;
    let flops = b
        * (2.0 * (shape.block_macs() + shape.lm_head_macs()) as f64
            + shape.attention_flops(context) as f64);
    let t_mem = bytes / machine.bandwidth;
    let t_ops = flops / machine.peak_ops;
    let step = t_mem.max(t_ops);
    DecodeEstimate {
        batch,
        step_seconds: step,
        tokens_per_second: b / step,
        compute_bound: t_ops > t_mem,
    }
}

/// Predicted prefill tokens per second for prompts of `len` tokens.
pub fn prefill_estimate(shape: &ModelShape, machine: Machine, len: usize) -> f64 {
    let attended = if shape.encoder { len } else { len / 2 };
    let per_token = 2.0 * shape.block_macs() as f64 + shape.attention_flops(attended) as f64;
    let lm_head = 2.0 * shape.lm_head_macs() as f64 / len.max(1) as f64;
    machine.peak_ops / (per_token + lm_head)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma 3 270M's shape (18 layers, 5 of 6 sliding with window 512).
    fn gemma() -> ModelShape {
        ModelShape {
            weight_bytes: 246_587_904,
            active_weight_bytes: 246_587_904,
            experts: None,
            num_layers: 18,
            hidden: 640,
            num_heads: 4,
            num_kv_heads: 1,
            head_dim: 256,
            kv_caches: 2,
            attn_macs: None,
            intermediate: 2048,
            vocab: 262_144,
            encoder: false,
            layer_windows: (0..18).map(|l| if l % 6 == 5 { None } else { Some(512) }).collect(),
            max_position_embeddings: 32_768,
        }
    }

    #[test]
    fn gemma_counts_by_hand() {
        let g = gemma();
        // Per layer: q 640·1024 + k,v 2·640·256 + o 1024·640 + gate/up/down 3·640·2048
        // = 655,360 + 327,680 + 655,360 + 3,932,160 = 5,570,560; × 18 = 100,270,080.
        assert_eq!(g.block_macs(), 100_270_080);
        assert_eq!(g.lm_head_macs(), 167_772_160);
        // 2 × 18 × 1 × 256 × 4 B = 36,864 B per token in f32; 18,432 in f16.
        assert_eq!(g.kv_bytes_per_token(KvDtype::F32), 36_864);
        assert_eq!(g.kv_bytes_per_token(KvDtype::F16), 18_432);
        assert_eq!("bf16".parse::<KvDtype>(), Ok(KvDtype::Bf16));
        assert_eq!("fp8".parse::<KvDtype>(), Ok(KvDtype::Fp8E4M3));
        assert!("fp4".parse::<KvDtype>().is_err());
        // 8-bit: one byte per element and f32 scales (int8: 4 per row of 256; fp8: 1).
        assert_eq!(g.kv_bytes_per_token(KvDtype::Int8), 2 * 18 * (256 + 16));
        assert_eq!(g.kv_bytes_per_token(KvDtype::Fp8E4M3), 2 * 18 * (256 + 4));
        // Context 2048: 3 global layers see 2048, 15 sliding see 512 → 13,824 positions.
        assert_eq!(g.attended_positions(2048), 13_824);
        assert_eq!(g.attended_positions(100), 1_800);
        // 4 FLOPs × 1024 (q width) per position: 4 × 1024 × 13,824.
        assert_eq!(g.attention_flops(2048), 56_623_104);
        // One sequence's K and V at 2048: 2 × 256 dims × 4 B × 13,824 positions.
        assert_eq!(g.kv_bytes_read(2048, KvDtype::F32), 28_311_552);
    }

    /// Qwen3-30B-A3B's block shape: 128 experts of width 768, 8 per token.
    #[test]
    fn experts_count_k_of_them_per_token() {
        let expert_bytes = 3 * 2048 * 768; // one expert's three matrices at 1 byte a weight
        let moe = ModelShape {
            weight_bytes: 1000 + 128 * expert_bytes,
            active_weight_bytes: 1000 + 8 * expert_bytes,
            experts: Some(ExpertShape {
                num_experts: 128,
                experts_per_token: 8,
                intermediate: 768,
                shared_intermediate: 0,
                sparse_layers: 1,
            }),
            num_layers: 1,
            hidden: 2048,
            num_heads: 32,
            num_kv_heads: 4,
            head_dim: 128,
            kv_caches: 2,
            attn_macs: None,
            intermediate: 6144,
            vocab: 151_936,
            encoder: false,
            layer_windows: vec![None],
            max_position_embeddings: 4096,
        };
        // Attention: 2048·4096 + 2·2048·512 + 4096·2048; MLP: 8 experts' 3·2048·768, router.
        let attn = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048;
        assert_eq!(moe.block_macs(), (attn + 8 * 3 * 2048 * 768 + 2048 * 128) as u64);
        assert_eq!(moe.step_weight_bytes(1), moe.active_weight_bytes as f64);
        // 16 tokens pick 128·(1 − (15/16)^16) ≈ 82.5 distinct experts on average.
        let b16 = moe.step_weight_bytes(16);
        let distinct = 128.0 * (1.0 - (1.0f64 - 8.0 / 128.0).powi(16));
        assert!((b16 - (1000.0 + distinct * expert_bytes as f64)).abs() < 1.0, "{b16}");
        assert!(moe.step_weight_bytes(10_000) <= moe.weight_bytes as f64 + 1.0);
    }

    #[test]
    fn capacity_by_hand() {
        let g = gemma();
        // 4 GiB − 246,587,904 B weights − 512 MiB reserve = 3,511,287,808 B; / 36,864 = 95,249.
        let c = capacity(&g, 4 << 30, 512 << 20, 4096, KvDtype::F32);
        assert_eq!(c.kv_budget, 4_294_967_296 - 246_587_904 - 536_870_912);
        assert_eq!(c.max_tokens, 3_511_508_480 / 36_864);
        assert_eq!(c.max_tokens, 95_255);
        assert_eq!(c.max_sequences, 23);
        assert_eq!(c.longest_context, 32_768);
        let tiny = capacity(&g, 300 << 20, 0, 4096, KvDtype::F32);
        assert_eq!(tiny.longest_context, (314_572_800 - 246_587_904) / 36_864);
        assert_eq!(capacity(&g, 1, 0, 1, KvDtype::F32).max_tokens, 0);
    }

    #[test]
    fn roofline_by_hand() {
        let g = gemma();
        let m = Machine { bandwidth: 23.5e9, peak_ops: 1.0e12 };
        // Batch 1 at context 256: bytes = weights + 2·256·4·(18·256) = 246,587,904 + 9,437,184.
        let d = decode_estimate(&g, m, 1, 256, KvDtype::F32);
        let want = (246_587_904.0 + 9_437_184.0) / 23.5e9;
        assert!((d.step_seconds - want).abs() < 1e-12 && !d.compute_bound);
        assert!((d.tokens_per_second - 1.0 / want).abs() < 1e-6);
        // Batch 64: 64·(2·268,042,240 + 4·1024·4,608) = 35.5 GFLOP, 71 ms at 0.5 TOP/s, against
        // 246.6 MB + 64 · 9.4 MB = 850.6 MB, 36 ms at 23.5 GB/s: arithmetic bounds the step.
        let slow = Machine { peak_ops: 0.5e12, ..m };
        let d = decode_estimate(&g, slow, 64, 256, KvDtype::F32);
        let flops = 64.0 * (2.0 * 268_042_240.0 + 4.0 * 1024.0 * 4608.0);
        assert!(d.compute_bound && (d.step_seconds - flops / 0.5e12).abs() < 1e-12);
        assert!(!decode_estimate(&g, m, 64, 256, KvDtype::F32).compute_bound);
        // Prefill of 512: per token 2·100,270,080 + 4·1024·4,608, plus the LM head once.
        let p = prefill_estimate(&g, m, 512);
        let per = 2.0 * 100_270_080.0 + 4.0 * 1024.0 * 4608.0 + 2.0 * 167_772_160.0 / 512.0;
        assert!((p - 1e12 / per).abs() < 1e-6);
    }
}
