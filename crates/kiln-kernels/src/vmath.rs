//! Vectorised transcendental functions: `exp`, and the gate activations built on it.
//!
//! Each function has one algorithm written twice: a scalar reference and AVX-512 / AVX2
//! versions that perform the same IEEE operations in the same order (`mul_add` is a fused
//! multiply-add in both), so every lane equals the scalar result bit for bit. That keeps
//! outputs independent of how many elements a SIMD loop happens to cover.
//!
//! `exp` is the Cephes single-precision scheme: `x = n·ln2 + r` with `|r| ≤ ln2/2`, a degree-6
//! polynomial for `e^r`, and `2^n` built in the exponent bits; about 1 ulp, inputs clamped to
//! the range where the result is a normal float.

use crate::SimdLevel;

const EXP_HI: f32 = 88.0;
const EXP_LO: f32 = -87.3;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const P0: f32 = 1.987_569_1e-4;
const P1: f32 = 1.398_199_9e-3;
const P2: f32 = 8.333_452e-3;
const P3: f32 = 4.166_579_6e-2;
const P4: f32 = 0.166_666_65;
const P5: f32 = 0.5;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_CUBIC: f32 = 0.044_715;
// Abramowitz & Stegun 7.1.26: `erf(z) ≈ 1 − t·(a1 + t·(a2 + …)) · e^{−z²}`, `t = 1/(1 + p·z)`
// for `z ≥ 0`, absolute error at most 1.5e-7.
const ERF_P: f32 = 0.327_591_1;
const ERF_A1: f32 = 0.254_829_6;
const ERF_A2: f32 = -0.284_496_74;
const ERF_A3: f32 = 1.421_413_7;
const ERF_A4: f32 = -1.453_152_1;
const ERF_A5: f32 = 1.061_405_4;
const SIGN_BIT: u32 = 0x8000_0000;

/// `e^x` (scalar reference of the SIMD versions).
#[inline]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_LO, EXP_HI);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = P0.mul_add(r, P1);
    p = p.mul_add(r, P2);
    p = p.mul_add(r, P3);
    p = p.mul_add(r, P4);
    p = p.mul_add(r, P5);
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// GeLU with the tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, with
/// `tanh(u) = sign(u)·(1 − e^{−2|u|}) / (1 + e^{−2|u|})`.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_CUBIC * (x * x * x));
    let t = exp(-2.0 * u.abs());
    let th = ((1.0 - t) / (1.0 + t)).copysign(u);
    (0.5 * x) * (1.0 + th)
}

/// Exact GeLU, `0.5·x·(1 + erf(x/√2))`, with `erf` by Abramowitz & Stegun 7.1.26 (error at
/// most 1.5e-7 in `erf`).
#[inline]
pub fn gelu(x: f32) -> f32 {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / ERF_P.mul_add(z, 1.0);
    let mut p = ERF_A5.mul_add(t, ERF_A4);
    p = p.mul_add(t, ERF_A3);
    p = p.mul_add(t, ERF_A2);
    p = p.mul_add(t, ERF_A1);
    let erf_abs = 1.0 - (p * t) * exp(-(z * z));
    let erf = f32::from_bits(erf_abs.to_bits() | (x.to_bits() & SIGN_BIT));
    (0.5 * x) * (1.0 + erf)
}

/// `x · sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// Which gate function [`gated_at`] applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    Silu,
    GeluTanh,
    Gelu,
}

impl Gate {
    /// The function at one point (the scalar reference of the SIMD forms).
    #[inline]
    fn at(self, x: f32) -> f32 {
        match self {
            Self::Silu => silu(x),
            Self::GeluTanh => gelu_tanh(x),
            Self::Gelu => gelu(x),
        }
    }
}

/// `x[i] = f(x[i])` at a chosen SIMD level (scalar if the CPU lacks it): an ungated MLP.
pub(crate) fn activate_at(level: SimdLevel, f: Gate, x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx512 && SimdLevel::detect() >= SimdLevel::Avx512 {
            // SAFETY: AVX-512F is available.
            return unsafe { x86::activate_avx512(f, x) };
        }
        if level >= SimdLevel::Avx2 && SimdLevel::detect() >= SimdLevel::Avx2 {
            // SAFETY: AVX2 and FMA are available.
            return unsafe { x86::activate_avx2(f, x) };
        }
    }
    let _ = level;
    activate_scalar(f, x);
}

fn activate_scalar(f: Gate, x: &mut [f32]) {
    for v in x {
        *v = f.at(*v);
    }
}

/// `gate[i] = f(gate[i]) * up[i]` at a chosen SIMD level (scalar if the CPU lacks it).
pub(crate) fn gated_at(level: SimdLevel, f: Gate, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx512 && SimdLevel::detect() >= SimdLevel::Avx512 {
            // SAFETY: AVX-512F is available; lengths are equal.
            return unsafe { x86::gated_avx512(f, gate, up) };
        }
        if level >= SimdLevel::Avx2 && SimdLevel::detect() >= SimdLevel::Avx2 {
            // SAFETY: AVX2 and FMA are available; lengths are equal.
            return unsafe { x86::gated_avx2(f, gate, up) };
        }
    }
    let _ = level;
    gated_scalar(f, gate, up);
}

/// `x[i] = exp(x[i] - shift)` at a chosen SIMD level (softmax numerators).
pub(crate) fn exp_shifted_at(level: SimdLevel, x: &mut [f32], shift: f32) {
    #[cfg(target_arch = "x86_64")]
    if level == SimdLevel::Avx512 && SimdLevel::detect() >= SimdLevel::Avx512 {
        // SAFETY: AVX-512F is available.
        return unsafe { x86::exp_shifted_avx512(x, shift) };
    }
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 && SimdLevel::detect() >= SimdLevel::Avx2 {
        // SAFETY: AVX2 and FMA are available.
        return unsafe { x86::exp_shifted_avx2(x, shift) };
    }
    let _ = level;
    exp_shifted_scalar(x, shift);
}

fn exp_shifted_scalar(x: &mut [f32], shift: f32) {
    for v in x {
        *v = exp(*v - shift);
    }
}

fn gated_scalar(f: Gate, gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = f.at(*g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::f32::consts::FRAC_1_SQRT_2;

    use super::*;

    /// Lane-wise [`super::exp`]; `$v` maps an operation name to the ISA's intrinsic.
    macro_rules! exp_body {
        ($v:ident, $x:expr) => {{
            let x = $v!(min, $v!(max, $x, $v!(set1, EXP_LO)), $v!(set1, EXP_HI));
            let n = $v!(round, $v!(mul, x, $v!(set1, LOG2E)));
            let r = $v!(fmadd, n, $v!(set1, -LN2_HI), x);
            let r = $v!(fmadd, n, $v!(set1, -LN2_LO), r);
            let mut p = $v!(fmadd, $v!(set1, P0), r, $v!(set1, P1));
            p = $v!(fmadd, p, r, $v!(set1, P2));
            p = $v!(fmadd, p, r, $v!(set1, P3));
            p = $v!(fmadd, p, r, $v!(set1, P4));
            p = $v!(fmadd, p, r, $v!(set1, P5));
            let y = $v!(add, $v!(fmadd, p, $v!(mul, r, r), r), $v!(set1, 1.0));
            $v!(mul, y, $v!(pow2, n))
        }};
    }

    /// Lane-wise gate function.
    macro_rules! gate_body {
        ($v:ident, $f:expr, $x:expr) => {{
            let x = $x;
            let one = $v!(set1, 1.0);
            match $f {
                Gate::Silu => {
                    let e = exp_body!($v, $v!(sub, $v!(set1, 0.0), x));
                    $v!(div, x, $v!(add, one, e))
                }
                Gate::GeluTanh => {
                    let x3 = $v!(mul, $v!(mul, x, x), x);
                    let inner = $v!(add, x, $v!(mul, $v!(set1, GELU_CUBIC), x3));
                    let u = $v!(mul, $v!(set1, SQRT_2_OVER_PI), inner);
                    let sign = $v!(and, u, $v!(set1, -0.0));
                    let abs = $v!(andnot, $v!(set1, -0.0), u);
                    let t = exp_body!($v, $v!(mul, $v!(set1, -2.0), abs));
                    let th = $v!(or, $v!(div, $v!(sub, one, t), $v!(add, one, t)), sign);
                    $v!(mul, $v!(mul, $v!(set1, 0.5), x), $v!(add, one, th))
                }
                Gate::Gelu => {
                    let sign = $v!(and, x, $v!(set1, -0.0));
                    let z = $v!(mul, $v!(andnot, $v!(set1, -0.0), x), $v!(set1, FRAC_1_SQRT_2));
                    let t = $v!(div, one, $v!(fmadd, $v!(set1, ERF_P), z, one));
                    let mut p = $v!(fmadd, $v!(set1, ERF_A5), t, $v!(set1, ERF_A4));
                    p = $v!(fmadd, p, t, $v!(set1, ERF_A3));
                    p = $v!(fmadd, p, t, $v!(set1, ERF_A2));
                    p = $v!(fmadd, p, t, $v!(set1, ERF_A1));
                    let e = exp_body!($v, $v!(sub, $v!(set1, 0.0), $v!(mul, z, z)));
                    let erf = $v!(or, $v!(sub, one, $v!(mul, $v!(mul, p, t), e)), sign);
                    $v!(mul, $v!(mul, $v!(set1, 0.5), x), $v!(add, one, erf))
                }
            }
        }};
    }

    macro_rules! v512 {
        (round, $a:expr) => {
            _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>($a)
        };
        (pow2, $n:expr) => {
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32($n),
                _mm512_set1_epi32(127),
            )))
        };
        (set1, $a:expr) => {
            _mm512_set1_ps($a)
        };
        (min, $a:expr, $b:expr) => {
            _mm512_min_ps($a, $b)
        };
        (max, $a:expr, $b:expr) => {
            _mm512_max_ps($a, $b)
        };
        (mul, $a:expr, $b:expr) => {
            _mm512_mul_ps($a, $b)
        };
        (add, $a:expr, $b:expr) => {
            _mm512_add_ps($a, $b)
        };
        (sub, $a:expr, $b:expr) => {
            _mm512_sub_ps($a, $b)
        };
        (div, $a:expr, $b:expr) => {
            _mm512_div_ps($a, $b)
        };
        (and, $a:expr, $b:expr) => {
            // Through the integer form: `_mm512_and_ps` needs AVX-512 DQ, not enabled here.
            _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512($a), _mm512_castps_si512($b)))
        };
        (andnot, $a:expr, $b:expr) => {
            // Through the integer form: `_mm512_andnot_ps` needs AVX-512 DQ, not enabled here.
            _mm512_castsi512_ps(_mm512_andnot_si512(
                _mm512_castps_si512($a),
                _mm512_castps_si512($b),
            ))
        };
        (or, $a:expr, $b:expr) => {
            // Through the integer form: `_mm512_or_ps` needs AVX-512 DQ, not enabled here.
            _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512($a), _mm512_castps_si512($b)))
        };
        (fmadd, $a:expr, $b:expr, $c:expr) => {
            _mm512_fmadd_ps($a, $b, $c)
        };
    }

    macro_rules! v256 {
        (round, $a:expr) => {
            _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>($a)
        };
        (pow2, $n:expr) => {
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32($n),
                _mm256_set1_epi32(127),
            )))
        };
        (set1, $a:expr) => {
            _mm256_set1_ps($a)
        };
        (min, $a:expr, $b:expr) => {
            _mm256_min_ps($a, $b)
        };
        (max, $a:expr, $b:expr) => {
            _mm256_max_ps($a, $b)
        };
        (mul, $a:expr, $b:expr) => {
            _mm256_mul_ps($a, $b)
        };
        (add, $a:expr, $b:expr) => {
            _mm256_add_ps($a, $b)
        };
        (sub, $a:expr, $b:expr) => {
            _mm256_sub_ps($a, $b)
        };
        (div, $a:expr, $b:expr) => {
            _mm256_div_ps($a, $b)
        };
        (and, $a:expr, $b:expr) => {
            _mm256_and_ps($a, $b)
        };
        (andnot, $a:expr, $b:expr) => {
            _mm256_andnot_ps($a, $b)
        };
        (or, $a:expr, $b:expr) => {
            _mm256_or_ps($a, $b)
        };
        (fmadd, $a:expr, $b:expr, $c:expr) => {
            _mm256_fmadd_ps($a, $b, $c)
        };
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn gated_avx512(f: Gate, gate: &mut [f32], up: &[f32]) {
        let n = gate.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= n <= len of both slices.
            unsafe {
                let x = _mm512_loadu_ps(gate.as_ptr().add(i));
                let g = gate_body!(v512, f, x);
                let u = _mm512_loadu_ps(up.as_ptr().add(i));
                _mm512_storeu_ps(gate.as_mut_ptr().add(i), _mm512_mul_ps(g, u));
            }
        }
        gated_scalar(f, &mut gate[n..], &up[n..]);
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn activate_avx512(f: Gate, x: &mut [f32]) {
        let n = x.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= n <= x.len().
            unsafe {
                let v = _mm512_loadu_ps(x.as_ptr().add(i));
                _mm512_storeu_ps(x.as_mut_ptr().add(i), gate_body!(v512, f, v));
            }
        }
        activate_scalar(f, &mut x[n..]);
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn activate_avx2(f: Gate, x: &mut [f32]) {
        let n = x.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= x.len().
            unsafe {
                let v = _mm256_loadu_ps(x.as_ptr().add(i));
                _mm256_storeu_ps(x.as_mut_ptr().add(i), gate_body!(v256, f, v));
            }
        }
        activate_scalar(f, &mut x[n..]);
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_shifted_avx512(x: &mut [f32], shift: f32) {
        let n = x.len() / 16 * 16;
        let shift_v = _mm512_set1_ps(shift);
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= n <= x.len().
            unsafe {
                let v = _mm512_sub_ps(_mm512_loadu_ps(x.as_ptr().add(i)), shift_v);
                _mm512_storeu_ps(x.as_mut_ptr().add(i), exp_body!(v512, v));
            }
        }
        exp_shifted_scalar(&mut x[n..], shift);
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted_avx2(x: &mut [f32], shift: f32) {
        let n = x.len() / 8 * 8;
        let shift_v = _mm256_set1_ps(shift);
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= x.len().
            unsafe {
                let v = _mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), shift_v);
                _mm256_storeu_ps(x.as_mut_ptr().add(i), exp_body!(v256, v));
            }
        }
        exp_shifted_scalar(&mut x[n..], shift);
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gated_avx2(f: Gate, gate: &mut [f32], up: &[f32]) {
        let n = gate.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= len of both slices.
            unsafe {
                let x = _mm256_loadu_ps(gate.as_ptr().add(i));
                let g = gate_body!(v256, f, x);
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(g, u));
            }
        }
        gated_scalar(f, &mut gate[n..], &up[n..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::values;

    #[test]
    fn exp_is_accurate() {
        for i in -8700..=8800 {
            let x = i as f32 / 100.0;
            let (got, want) = (exp(x), f64::from(x).exp());
            let rel = ((f64::from(got) - want) / want).abs();
            assert!(rel < 3e-7, "exp({x}) = {got}, want {want}");
        }
        assert!(exp(-1000.0) > 0.0 && exp(1000.0).is_finite());
    }

    #[test]
    fn activations_match_their_definitions() {
        for i in -2000..=2000 {
            let x = i as f32 / 200.0;
            let xd = f64::from(x);
            let gelu =
                0.5 * xd * (1.0 + (0.797_884_560_802_865_4 * (xd + 0.044_715 * xd.powi(3))).tanh());
            let silu_want = xd / (1.0 + (-xd).exp());
            assert!(
                (f64::from(gelu_tanh(x)) - gelu).abs() < 1e-6 * (1.0 + gelu.abs()),
                "gelu({x})"
            );
            assert!(
                (f64::from(silu(x)) - silu_want).abs() < 1e-6 * (1.0 + silu_want.abs()),
                "silu({x})"
            );
        }
    }

    /// `erf` by its Taylor series in f64 (exact enough for `|z| ≤ 4`).
    fn erf_series(z: f64) -> f64 {
        let (mut term, mut sum) = (z, z);
        for n in 1..200 {
            term *= -z * z / f64::from(n);
            sum += term / f64::from(2 * n + 1);
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn exact_gelu_matches_erf() {
        for i in -1000..=1000 {
            let x = i as f32 / 200.0;
            let xd = f64::from(x);
            let want = 0.5 * xd * (1.0 + erf_series(xd / std::f64::consts::SQRT_2));
            let got = f64::from(gelu(x));
            assert!(
                (got - want).abs() < 3e-7 * (1.0 + want.abs()),
                "gelu({x}) = {got}, want {want}"
            );
        }
        assert_eq!(gelu(30.0), 30.0);
        assert_eq!(gelu(-30.0), 0.0);
    }

    #[test]
    fn activate_simd_equals_scalar_bitwise() {
        for n in [1, 7, 8, 15, 16, 17, 33, 100, 1000] {
            let x = values(n, 3, 8.0);
            for f in [Gate::Silu, Gate::GeluTanh, Gate::Gelu] {
                let mut want = x.clone();
                activate_scalar(f, &mut want);
                for level in SimdLevel::available() {
                    let mut got = x.clone();
                    activate_at(level, f, &mut got);
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{f:?} {level:?} n={n}");
                }
            }
        }
    }

    #[test]
    fn exp_shifted_simd_equals_scalar_bitwise() {
        for n in [1, 15, 16, 17, 64, 100] {
            let x = values(n, 5, 60.0);
            let mut want = x.clone();
            exp_shifted_scalar(&mut want, 3.5);
            for level in SimdLevel::available() {
                let mut got = x.clone();
                exp_shifted_at(level, &mut got, 3.5);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{level:?} n={n}");
            }
        }
    }

    #[test]
    fn simd_equals_scalar_bitwise() {
        for n in [1, 7, 8, 15, 16, 17, 33, 100, 1000] {
            let x = values(n, 3, 8.0);
            let up = values(n, 4, 1.0);
            for f in [Gate::Silu, Gate::GeluTanh, Gate::Gelu] {
                let mut want = x.clone();
                gated_scalar(f, &mut want, &up);
                for level in SimdLevel::available() {
                    let mut got = x.clone();
                    gated_at(level, f, &mut got, &up);
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{f:?} {level:?} n={n}");
                }
            }
        }
    }
}
