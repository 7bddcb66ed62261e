//! A small, fast, seedable PRNG (xoshiro256**, seeded through splitmix64). Each request owns
//! one, so its samples depend only on its seed and its own logits, never on the batch.

#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        Self { s: [splitmix64(&mut x), splitmix64(&mut x), splitmix64(&mut x), splitmix64(&mut x)] }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A uniform in the open `(0, 1)` (53 random bits, at the midpoints of a `2^-53` grid) for
/// `index` under `key`: a counter-based stream (splitmix64 of the two), so any index is drawn
/// in O(1) and the same `(key, index)` always gives the same value. Never 0 or 1, so its
/// `-ln` is finite and positive.
pub fn keyed_uniform(key: u64, index: u64) -> f64 {
    let mut x = key ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03);
    ((splitmix64(&mut x) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_uniform_enough() {
        let (mut a, mut b) = (Rng::new(42), Rng::new(42));
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(Rng::new(1).next_u64(), Rng::new(2).next_u64());
        let mut r = Rng::new(7);
        let mean: f64 = (0..100_000).map(|_| r.next_f64()).sum::<f64>() / 100_000.0;
        assert!((mean - 0.5).abs() < 0.01);
    }

    #[test]
    fn keyed_uniforms_are_fixed_by_key_and_index_and_uniform_enough() {
        assert_eq!(keyed_uniform(3, 9), keyed_uniform(3, 9));
        assert_ne!(keyed_uniform(3, 9), keyed_uniform(4, 9));
        assert_ne!(keyed_uniform(3, 9), keyed_uniform(3, 10));
        // Neighbouring indices and keys are uncorrelated: mean and lag-one correlation.
        let n = 100_000u64;
        let u: Vec<f64> = (0..n).map(|i| keyed_uniform(i / 100, i % 100)).collect();
        assert!(u.iter().all(|&u| u > 0.0 && u < 1.0));
        let mean = u.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.005, "{mean}");
        let lag: f64 = u.windows(2).map(|w| (w[0] - 0.5) * (w[1] - 0.5)).sum::<f64>() / n as f64;
        assert!(lag.abs() < 0.002, "{lag}");
    }
}
