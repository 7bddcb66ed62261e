//! Rotary position embeddings.
//!
//! Frequencies: `inv_freq[i] = base^(-2i / rotary_dim)`, optionally rescaled (linear, Llama 3):
//! [`RopeConfig::inv_freq`], below the seam, shared with the other backends.
//! The angle of pair `i` at position `p` is `p * inv_freq[i]` computed in f32, as the reference
//! implementations do. Two pairings exist:
//! - [`RopeStyle::Neox`]: element `i` pairs with `i + rotary_dim / 2` (HF `rotate_half`);
//! - [`RopeStyle::Interleaved`]: element `2i` pairs with `2i + 1` (GPT-J, llama.cpp "norm").

use crate::ThreadPool;
use crate::thread_pool::SharedMut;

/// Tokens per parallel task.
const TOKENS_PER_TASK: usize = 8;
/// Largest supported rotary dimension (stack buffers for cos/sin).
pub const MAX_ROTARY_DIM: usize = 1024;

pub use kiln_backend::{RopeConfig, RopeScaling, RopeStyle};

/// Precomputed rotary parameters of one attention layer.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    style: RopeStyle,
    /// Multiplier of every cos and sin ([`RopeConfig::mscale`]).
    mscale: f32,
}

impl Rope {
    /// `rotary_dim` must be even and at most [`MAX_ROTARY_DIM`].
    pub fn new(base: f32, rotary_dim: usize, scaling: RopeScaling, style: RopeStyle) -> Self {
        assert!(rotary_dim.is_multiple_of(2) && rotary_dim <= MAX_ROTARY_DIM && rotary_dim > 0);
        Self {
            inv_freq: kiln_backend::ops::rope_inv_freq(base, rotary_dim, scaling),
            style,
            mscale: 1.0,
        }
    }

    /// The rotary parameters of `config` (its frequencies: [`RopeConfig::inv_freq`]).
    pub fn from_config(config: &RopeConfig) -> Self {
        let rotary_dim = config.rotary_dim;
        assert!(rotary_dim.is_multiple_of(2) && rotary_dim <= MAX_ROTARY_DIM && rotary_dim > 0);
        Self { inv_freq: config.inv_freq(), style: config.style, mscale: config.mscale }
    }

    pub fn rotary_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Rotates `x[num_tokens, num_heads, head_dim]` in place; token `t` sits at `positions[t]`.
    /// Only the first `rotary_dim` elements of each head rotate.
    pub fn apply(&self, pool: &ThreadPool, x: &mut [f32], num_heads: usize, positions: &[u32]) {
        let mut table = vec![0.0; positions.len() * self.rotary_dim()];
        self.table(positions, &mut table);
        self.apply_table(pool, x, num_heads, &table);
    }

    /// `table[t] = [cos θ_0 … cos θ_{d/2−1}, sin θ_0 … sin θ_{d/2−1}]` (`[positions.len(),
    /// rotary_dim]`) with `θ_i = positions[t] · inv_freq[i]`: the angles of a step, computed once
    /// and shared by every layer and by q and k ([`Rope::apply_table`]).
    pub fn table(&self, positions: &[u32], table: &mut [f32]) {
        let d = self.rotary_dim();
        assert_eq!(table.len(), positions.len() * d, "rope table is not [tokens, rotary_dim]");
        for (row, &p) in table.chunks_exact_mut(d).zip(positions) {
            let (cos, sin) = row.split_at_mut(d / 2);
            self.angles(p, cos, sin);
        }
    }

    /// [`Rope::apply`] with the angles of each token from [`Rope::table`] (`[num_tokens,
    /// rotary_dim]`): bitwise the same result.
    pub fn apply_table(&self, pool: &ThreadPool, x: &mut [f32], num_heads: usize, table: &[f32]) {
        let d = self.rotary_dim();
        let num_tokens = table.len() / d;
        if num_tokens == 0 {
            return;
        }
        assert!(table.len().is_multiple_of(d) && x.len().is_multiple_of(num_tokens * num_heads));
        let head_dim = x.len() / (num_tokens * num_heads);
        assert!(d <= head_dim);
        let row = num_heads * head_dim;
        let ptr = SharedMut::new(x);
        pool.run(num_tokens.div_ceil(TOKENS_PER_TASK), |task| {
            let t0 = task * TOKENS_PER_TASK;
            let t1 = (t0 + TOKENS_PER_TASK).min(num_tokens);
            for t in t0..t1 {
                // SAFETY: each task owns rows t0..t1.
                let xs = unsafe { ptr.slice(t * row, row) };
                let (cos, sin) = table[t * d..(t + 1) * d].split_at(d / 2);
                self.rotate(xs, num_heads, head_dim, cos, sin);
            }
        });
    }

    /// `cos[i], sin[i]` of the angle of pair `i` at `position`.
    fn angles(&self, position: u32, cos: &mut [f32], sin: &mut [f32]) {
        let pos = position as f32;
        for ((c, s), f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            (*s, *c) = (pos * f).sin_cos();
            if self.mscale != 1.0 {
                (*s, *c) = (*s * self.mscale, *c * self.mscale);
            }
        }
    }

    /// Rotates all heads of one token (`x` is `[num_heads, head_dim]`).
    pub fn rotate_token(&self, x: &mut [f32], num_heads: usize, head_dim: usize, position: u32) {
        let half = self.inv_freq.len();
        let mut cos = [0.0f32; MAX_ROTARY_DIM / 2];
        let mut sin = [0.0f32; MAX_ROTARY_DIM / 2];
        self.angles(position, &mut cos[..half], &mut sin[..half]);
        self.rotate(x, num_heads, head_dim, &cos[..half], &sin[..half]);
    }

    /// Rotates all heads of one token by the angles whose `cos` and `sin` are given.
    fn rotate(&self, x: &mut [f32], num_heads: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = self.inv_freq.len();
        for h in 0..num_heads {
            let head = &mut x[h * head_dim..(h + 1) * head_dim];
            match self.style {
                RopeStyle::Neox => {
                    for i in 0..half {
                        let (a, b) = (head[i], head[i + half]);
                        head[i] = a * cos[i] - b * sin[i];
                        head[i + half] = b * cos[i] + a * sin[i];
                    }
                }
                RopeStyle::Interleaved => {
                    for i in 0..half {
                        let (a, b) = (head[2 * i], head[2 * i + 1]);
                        head[2 * i] = a * cos[i] - b * sin[i];
                        head[2 * i + 1] = b * cos[i] + a * sin[i];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_preserves_norm_and_position_zero_is_identity() {
        let pool = ThreadPool::new(2);
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            let rope = Rope::new(10_000.0, 8, RopeScaling::None, style);
            let orig: Vec<f32> = (0..2 * 3 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut x = orig.clone();
            rope.apply(&pool, &mut x, 3, &[0, 5]);
            assert_eq!(&x[..24], &orig[..24]);
            let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
            assert!((norm(&x[24..]) - norm(&orig[24..])).abs() < 1e-4);
            assert_ne!(&x[24..], &orig[24..]);
        }
    }

    #[test]
    fn table_gives_bitwise_the_rotation_of_each_token_alone() {
        let pool = ThreadPool::new(2);
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            let rope = Rope::new(10_000.0, 8, RopeScaling::None, style);
            let positions = [0u32, 3, 17, 4095, 3];
            let orig: Vec<f32> = (0..5 * 2 * 12).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut want = orig.clone();
            for (x, &p) in want.chunks_exact_mut(2 * 12).zip(&positions) {
                rope.rotate_token(x, 2, 12, p);
            }
            let mut table = vec![0.0; 5 * 8];
            rope.table(&positions, &mut table);
            let mut got = orig.clone();
            rope.apply_table(&pool, &mut got, 2, &table);
            assert_eq!(got, want, "{style:?}");
        }
    }

    #[test]
    fn relative_property_q_dot_k_depends_on_distance_only() {
        let rope = Rope::new(10_000.0, 16, RopeScaling::None, RopeStyle::Neox);
        let q: Vec<f32> = (0..16).map(|i| (i as f32).cos()).collect();
        let k: Vec<f32> = (0..16).map(|i| (i as f32 * 0.5).sin()).collect();
        let score = |pq: u32, pk: u32| {
            let (mut a, mut b) = (q.clone(), k.clone());
            rope.rotate_token(&mut a, 1, 16, pq);
            rope.rotate_token(&mut b, 1, 16, pk);
            a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>()
        };
        assert!((score(7, 3) - score(104, 100)).abs() < 1e-3);
    }

    /// transformers' `_compute_yarn_parameters` for head 16, base 10000, factor 4 over an
    /// original 64 positions (beta 32 / 1, truncated): its frequencies and attention factor.
    #[test]
    fn yarn_matches_transformers() {
        let scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position: 64.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
        };
        let want = [
            1.0,
            0.237_170_82,
            0.049_999_997,
            0.007_905_695,
            0.0025,
            0.000_790_569_5,
            0.000_25,
            7.905_695e-5,
        ];
        let got = Rope::new(10_000.0, 16, scaling, RopeStyle::Neox).inv_freq().to_vec();
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-6 * w, "{got:?}");
        }
        let factor = kiln_backend::ops::yarn_attention_factor(4.0, None, None);
        assert!((factor - 1.138_629_4).abs() < 1e-6);
    }

    /// gpt-oss's YaRN (head 64, base 150000, factor 32 over 4096 positions, its ramp not
    /// truncated), every fourth frequency as transformers computes it.
    #[test]
    fn untruncated_yarn_matches_transformers() {
        let scaling = RopeScaling::Yarn {
            factor: 32.0,
            original_max_position: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: false,
        };
        let want = [
            1.0,
            0.225_418,
            0.050_813_27,
            0.006_794_959,
            0.000_456_483_9,
            1.818_833_7e-5,
            4.099_978_5e-6,
            9.242_09e-7,
        ];
        let got = Rope::new(150_000.0, 64, scaling, RopeStyle::Neox).inv_freq().to_vec();
        for (g, w) in got.iter().step_by(4).zip(want) {
            assert!((g - w).abs() <= 2e-6 * w, "{got:?}");
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let plain = Rope::new(500_000.0, 16, RopeScaling::None, RopeStyle::Neox);
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64.0,
        };
        let scaled = Rope::new(500_000.0, 16, scaling, RopeStyle::Neox);
        let (p, s) = (plain.inv_freq(), scaled.inv_freq());
        assert_eq!(p[0], s[0]);
        assert!((s[7] - p[7] / 8.0).abs() < 1e-12);
    }
}
