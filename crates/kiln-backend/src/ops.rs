//! Parameters of the coarse operations a [`crate::Backend`] runs: attention shape, rotary
//! embeddings, gated activations. Plain data; the arithmetic lives in the backends.

use crate::MAX_BLOCK_SIZE;

/// Upper bound of query heads per KV head (a tile's per-row state lives on the stack).
pub const MAX_GROUP: usize = 64;

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
    }
    inv_freq
}

/// The gate nonlinearity of a gated MLP: `gate = act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateActivation {
    /// `x * sigmoid(x)` (Llama, Mistral, Qwen).
    Silu,
    /// GeLU with the tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}
