//! Parameters of the coarse operations a [`crate::Backend`] runs: attention shape, rotary
//! embeddings, gated activations. Plain data; the arithmetic lives in the backends.

use crate::MAX_BLOCK_SIZE;

/// Upper bound of query heads per KV head (a tile's per-row state lives on the stack): 128,
/// the query heads DeepSeek V2/V3 share their one latent KV head among.
pub const MAX_GROUP: usize = 128;

/// Where the segments of a [`crate::Backend::copy_strided`] call lie in a buffer: segment
/// `(i, j)` starts at element `offset + i * outer + j * inner`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strides {
    pub offset: usize,
    pub outer: usize,
    pub inner: usize,
}

impl Strides {
    /// Where segment `(i, j)` starts.
    pub fn at(&self, i: usize, j: usize) -> usize {
        self.offset + i * self.outer + j * self.inner
    }
}

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
    /// `true`: a query sees keys up to its own position (a decoder). `false`: every key of its
    /// sequence (an encoder's bidirectional attention), which needs the whole sequence in the
    /// cache by the time it runs, so an encoder's sequences come whole in one step.
    pub causal: bool,
}

impl AttentionShape {
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Checks the limits every backend shares.
    pub fn validate(&self) -> Result<(), String> {
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.group() > MAX_GROUP {
            return Err(format!("heads per KV head must be at most {MAX_GROUP}"));
        }
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(format!("block size must be in 1..={MAX_BLOCK_SIZE}"));
        }
        Ok(())
    }
}

/// How query/key elements pair up for rotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Element `i` pairs with `i + rotary_dim / 2` (HF `rotate_half`).
    Neox,
    /// Element `2i` pairs with `2i + 1` (GPT-J, llama.cpp "norm").
    Interleaved,
}

/// Frequency scaling applied on top of the base frequencies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth ramp between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: f32,
    },
    /// YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    /// divided by `factor`, those that turn more than `beta_fast` times kept, with a linear
    /// ramp over the pair indices between (bounds floored and ceiled when `truncate`), as
    /// transformers computes it. Its attention factor is the table's [`RopeConfig::mscale`].
    Yarn {
        factor: f32,
        original_max_position: f32,
        beta_fast: f32,
        beta_slow: f32,
        truncate: bool,
    },
}

/// Rotary embeddings of one attention layer: `inv_freq[i] = base^(-2i / rotary_dim)`, scaled
/// by `scaling`, then divided by `freq_factors[i]` when given (llama.cpp's `rope_freqs`).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub base: f32,
    /// Rotated elements of each head (even).
    pub rotary_dim: usize,
    pub scaling: RopeScaling,
    pub style: RopeStyle,
    /// One factor per rotated pair.
    pub freq_factors: Option<Vec<f32>>,
    /// Multiplier of every cos and sin (1 but for LongRoPE's attention factor when only part
    /// of each head rotates, which scales just the rotated part, as transformers does).
    pub mscale: f32,
}

impl RopeConfig {
    /// The frequencies of the rotated pairs, `[rotary_dim / 2]`: `base^(-2i / rotary_dim)`
    /// computed in f32, rescaled by [`Self::scaling`], then divided by [`Self::freq_factors`].
    /// Every backend rotates with these (the RoPE table is a parameter, not arithmetic of a
    /// device). Panics unless `rotary_dim` is even and positive and the factors, when given,
    /// number one per pair.
    pub fn inv_freq(&self) -> Vec<f32> {
        let mut inv_freq = rope_inv_freq(self.base, self.rotary_dim, self.scaling);
        if let Some(factors) = &self.freq_factors {
            assert_eq!(factors.len(), inv_freq.len(), "one factor per rotated pair");
            for (f, factor) in inv_freq.iter_mut().zip(factors) {
                *f /= factor;
            }
        }
        inv_freq
    }
}

/// `base^(-2i / rotary_dim)` for each rotated pair `i`, rescaled by `scaling` (linear, or
/// Llama 3's smooth per-wavelength rule). `rotary_dim` must be even and positive.
pub fn rope_inv_freq(base: f32, rotary_dim: usize, scaling: RopeScaling) -> Vec<f32> {
    assert!(rotary_dim.is_multiple_of(2) && rotary_dim > 0, "rotary_dim {rotary_dim}");
    let half = rotary_dim / 2;
    let mut inv_freq: Vec<f32> = (0..half)
        .map(|i| {
            let exponent = (2 * i) as f32 / rotary_dim as f32;
            1.0 / base.powf(exponent)
        })
        .collect();
    match scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let low_freq_wavelen = original_max_position / low_freq_factor;
            let high_freq_wavelen = original_max_position / high_freq_factor;
            for f in &mut inv_freq {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                if wavelen > low_freq_wavelen {
                    *f /= factor;
                } else if wavelen >= high_freq_wavelen {
                    let smooth = (original_max_position / wavelen - low_freq_factor)
                        / (high_freq_factor - low_freq_factor);
                    *f = (1.0 - smooth) * *f / factor + smooth * *f;
                }
            }
        }
        RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, truncate } => {
            // The pair index at which a frequency turns `rotations` times over the original
            // context, computed in f64 as Python does.
            let dim = rotary_dim as f64;
            let correction = |rotations: f32| {
                let turns = f64::from(original_max_position)
                    / (f64::from(rotations) * 2.0 * std::f64::consts::PI);
                dim * turns.ln() / (2.0 * f64::from(base).ln())
            };
            let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
            if truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0) as f32, high.min(dim - 1.0) as f32);
            if low == high {
                high += 0.001;
            }
            for (i, f) in inv_freq.iter_mut().enumerate() {
                // `pos_freq = base^(2i / dim)`: the extrapolated frequency is its inverse,
                // the interpolated one that of `factor · pos_freq`.
                let pos_freq = base.powf((2 * i) as f32 / rotary_dim as f32);
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                *f = (1.0 / (factor * pos_freq)) * (1.0 - extrapolation)
                    + (1.0 / pos_freq) * extrapolation;
            }
        }
    }
    inv_freq
}

/// YaRN's attention factor (the cos/sin multiplier) as transformers infers it when a config
/// gives none: `m(factor, mscale) / m(factor, mscale_all_dim)` with both, else `m(factor, 1)`,
/// where `m(s, k) = 0.1 · k · ln(s) + 1` (1 for `s <= 1`).
pub fn yarn_attention_factor(factor: f32, mscale: Option<f32>, mscale_all_dim: Option<f32>) -> f32 {
    let m = |k: f32| if factor <= 1.0 { 1.0 } else { 0.1 * k * factor.ln() + 1.0 };
    match (mscale, mscale_all_dim) {
        (Some(a), Some(b)) if a != 0.0 && b != 0.0 => m(a) / m(b),
        _ => m(1.0),
    }
}

/// The gate nonlinearity of a gated MLP: `gate = act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GateActivation {
    /// `x * sigmoid(x)` (Llama, Mistral, Qwen).
    Silu,
    /// GeLU with the tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
    /// Exact GeLU, `0.5·x·(1 + erf(x/√2))` (BERT's `gelu`).
    Gelu,
    /// gpt-oss's clamped SwiGLU: with `g = min(gate, limit)` and `u = clamp(up, -limit,
    /// limit)`, `gate = g · sigmoid(alpha · g) · (u + 1)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl GateActivation {
    /// `act(gate) · up` at one point, for the activations without a vectorised form.
    pub fn clamped_swiglu(alpha: f32, limit: f32, gate: f32, up: f32) -> f32 {
        let g = gate.min(limit);
        let u = up.clamp(-limit, limit);
        g / (1.0 + (-alpha * g).exp()) * (u + 1.0)
    }
}
