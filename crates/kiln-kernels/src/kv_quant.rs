//! The 8-bit KV cache formats (`int8`, `fp8_e4m3`, `fp8_e5m2`, [`KvCacheDtype::is_8bit`]): one
//! code byte per element and f32 scales, each (token, KV head) row of `head_dim` elements
//! encoded alone by a [`RowCodec`].
//!
//! Invariants:
//! - a row never depends on another: `int8` rows with a power-of-two `head_dim` are first
//!   rotated by the unnormalized Walsh-Hadamard transform ([`hadamard`]); then each scale group
//!   ([`KvCacheDtype::scale_group`]) is quantized alone ([`quantize_row`]): `scale = max|x| /
//!   max_value` (0 for an all-zero group), each element the code nearest to `x / scale`, ties
//!   to the even code, saturating at the largest finite code; no code is NaN or infinite;
//! - a code's value ([`code_value`]) is exact in f32, and the value a kernel reads is
//!   `code_value(c) * scale`: one IEEE multiplication. [`dequantize_row`]'s SIMD variants compute
//!   exactly that (FP8 codes widen through f16 bit patterns, exact by construction; tested over
//!   all 256 codes), so every ISA reads the same bits;
//! - rotated rows hold `H·x`; attention multiplies queries by `H / head_dim` and its output by
//!   the same ([`hadamard_scaled`]), which undoes the rotation (`H·H = head_dim·I`; the division
//!   by a power of two is exact). The transform is one scalar routine, so its bits are the same
//!   on every ISA;
//! - quantization is scalar and in order: every ISA writes the same codes and scales.

use kiln_backend::KvCacheDtype;

use crate::SimdLevel;

/// One 8-bit format: the code layout and its largest finite value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Int8,
    E4M3,
    E5M2,
}

impl Format {
    /// The format of an 8-bit cache dtype (`None` for f32 and f16).
    pub fn of(dtype: KvCacheDtype) -> Option<Self> {
        match dtype {
            KvCacheDtype::Int8 => Some(Self::Int8),
            KvCacheDtype::Fp8E4M3 => Some(Self::E4M3),
            KvCacheDtype::Fp8E5M2 => Some(Self::E5M2),
            KvCacheDtype::F32 | KvCacheDtype::F16 => None,
        }
    }

    /// The largest finite value a code holds.
    pub fn max_value(self) -> f32 {
        match self {
            Self::Int8 => 127.0,
            Self::E4M3 => 448.0,
            Self::E5M2 => 57344.0,
        }
    }

    /// (mantissa bits, exponent bias, largest finite magnitude code) of an FP8 format.
    fn fp8_params(self) -> (i32, i32, u8) {
        match self {
            Self::E4M3 => (3, 7, 0x7E),
            Self::E5M2 => (2, 15, 0x7B),
            Self::Int8 => unreachable!("int8 is not a floating-point format"),
        }
    }

    /// The code nearest to `y` (ties to even), saturating.
    pub fn encode(self, y: f32) -> u8 {
        match self {
            Self::Int8 => (round_ties_even(y.clamp(-127.0, 127.0)) as i8) as u8,
            Self::E4M3 | Self::E5M2 => {
                let (m, bias, max_code) = self.fp8_params();
                let sign = if y.is_sign_negative() { 0x80 } else { 0 };
                let a = y.abs();
                if a.is_nan() {
                    return sign;
                }
                // The exponent of `a`, at least the smallest normal one (subnormals share it).
                let e = floor_log2(a).max(1 - bias);
                // `a` in units of the last mantissa place at exponent `e` (exact: a power of two
                // times `a`, well inside f32's range), rounded to an integer ties to even. A
                // carry into the next binade lands on the right code because codes are ordered
                // like their magnitudes.
                let q = round_ties_even(a * pow2(m - e));
                let code = ((e + bias - 1) as f32) * (1 << m) as f32 + q;
                sign | (code.min(f32::from(max_code)) as u8)
            }
        }
    }
}

/// How rows of one cache are encoded: format, head size, scale groups, rotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowCodec {
    pub format: Format,
    pub head_dim: usize,
    /// Elements per scale.
    pub group: usize,
    /// Whether rows are Hadamard-rotated before quantization.
    pub rotate: bool,
}

impl RowCodec {
    /// The codec of an 8-bit `dtype` for heads of `head_dim` (`None` for f32 and f16).
    pub fn new(dtype: KvCacheDtype, head_dim: usize) -> Option<Self> {
        Some(Self {
            format: Format::of(dtype)?,
            head_dim,
            group: dtype.scale_group(head_dim),
            rotate: dtype.rotates(head_dim),
        })
    }

    /// Scales per row.
    pub fn scales_per_row(&self) -> usize {
        self.head_dim / self.group
    }

    /// Encodes row `x` (`head_dim`) into `codes` (`head_dim`) and `scales` (`scales_per_row`);
    /// `tmp` is scratch for the rotation.
    pub fn encode(&self, x: &[f32], tmp: &mut Vec<f32>, codes: &mut [u8], scales: &mut [f32]) {
        let x = if self.rotate {
            tmp.clear();
            tmp.extend_from_slice(x);
            hadamard(tmp);
            &tmp[..]
        } else {
            x
        };
        for ((g, c), s) in x.chunks(self.group).zip(codes.chunks_mut(self.group)).zip(scales) {
            *s = quantize_row(self.format, g, c);
        }
    }

    /// The values a kernel reads from a row (rotated rows stay rotated).
    pub fn decode(&self, level: SimdLevel, codes: &[u8], scales: &[f32], out: &mut [f32]) {
        for ((c, &s), o) in codes.chunks(self.group).zip(scales).zip(out.chunks_mut(self.group)) {
            dequantize_row(level, self.format, c, s, o);
        }
    }

    /// The row's values in the model's own basis (rotation undone): what a cache of exact
    /// arithmetic would hold. For references and tests.
    pub fn decode_unrotated(&self, codes: &[u8], scales: &[f32], out: &mut [f32]) {
        self.decode(SimdLevel::Scalar, codes, scales, out);
        if self.rotate {
            hadamard_scaled(out);
        }
    }
}

/// `x ← H·x`, the unnormalized Walsh-Hadamard transform (`x.len()` a power of two): butterflies
/// `(a, b) → (a + b, a − b)` at strides 1, 2, 4, …, in that order.
pub fn hadamard(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for pair in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = pair.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        h *= 2;
    }
}

/// `x ← H·x / n`: [`hadamard`], then an exact division by the power of two `n = x.len()`.
/// Applied to a query it pairs with rows stored as `H·k`; applied to an output accumulated from
/// rows stored as `H·v` it undoes their rotation.
pub fn hadamard_scaled(x: &mut [f32]) {
    hadamard(x);
    let inv = 1.0 / x.len() as f32;
    for v in x {
        *v *= inv;
    }
}

/// `floor(log2(a))` for a finite `a > 0` (very negative for 0 and subnormals: callers clamp).
/// `x` rounded to an integer, ties to even. `f32::round_ties_even` is a libm call (`rintf`)
/// on baseline x86-64, a tenth of the cost of writing an 8-bit cache row; below 2^22 adding
/// and subtracting 1.5 × 2^23 rounds the same (the sum's last place is 1), in two additions.
#[inline]
fn round_ties_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 × 2^23
    if x.abs() < 4_194_304.0 { (x + MAGIC) - MAGIC } else { x.round_ties_even() }
}

fn floor_log2(a: f32) -> i32 {
    let biased = (a.to_bits() >> 23) as i32;
    if biased == 0 { -150 } else { biased - 127 }
}

/// `2^k` for `-126 <= k <= 127`.
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// The exact value of `code` in `format` (without the row's scale).
pub fn code_value(format: Format, code: u8) -> f32 {
    match format {
        Format::Int8 => f32::from(code as i8),
        Format::E4M3 | Format::E5M2 => {
            let (m, bias, _) = format.fp8_params();
            let mag = i32::from(code & 0x7F);
            let (e, frac) = (mag >> m, mag & ((1 << m) - 1));
            let v = if e == 0 {
                frac as f32 * pow2(1 - bias - m)
            } else {
                ((1 << m) + frac) as f32 * pow2(e - bias - m)
            };
            if code & 0x80 != 0 { -v } else { v }
        }
    }
}

/// Quantizes one row: writes `codes[i]` for `x[i]` and returns the row's scale.
pub fn quantize_row(format: Format, x: &[f32], codes: &mut [u8]) -> f32 {
    assert_eq!(x.len(), codes.len());
    let absmax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if absmax == 0.0 || !absmax.is_finite() {
        codes.fill(0);
        return 0.0;
    }
    let scale = absmax / format.max_value();
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = format.encode(v / scale);
    }
    scale
}

/// `out[i] = code_value(codes[i]) * scale`: the values a kernel reads from a row.
pub fn dequantize_row(level: SimdLevel, format: Format, codes: &[u8], scale: f32, out: &mut [f32]) {
    assert_eq!(codes.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx512 {
            // SAFETY: `level` is at most the detected level; lengths checked above.
            return unsafe { x86::dequantize_avx512(format, codes, scale, out) };
        }
        if level == SimdLevel::Avx2 {
            // SAFETY: as above.
            return unsafe { x86::dequantize_avx2(format, codes, scale, out) };
        }
    }
    let _ = level;
    dequantize_row_scalar(format, codes, scale, out);
}

pub(crate) fn dequantize_row_scalar(format: Format, codes: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = code_value(format, c) * scale;
    }
}

/// The multiplier the SIMD paths apply to a code widened through its f16 bit pattern: E4M3's
/// pattern is its value / 256 (an exact power-of-two shift), E5M2's is its value. `scale *
/// 256` is exact (scales are at most `f32::MAX / 448`), so `(code / 256) * (scale * 256)` is
/// the single rounding of `code * scale`.
#[cfg(target_arch = "x86_64")]
fn f16_pattern_scale(format: Format, scale: f32) -> f32 {
    match format {
        Format::E4M3 => scale * 256.0,
        Format::E5M2 | Format::Int8 => scale,
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Format, f16_pattern_scale};

    /// Codes of 16 bytes (as 16 u16 lanes) to the f16 bit patterns of [`f16_pattern_scale`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn fp8_to_f16_bits_512(format: Format, c: __m256i) -> __m256i {
        match format {
            // sign to bit 15, exponent and mantissa to bits 7..15 (f16's exponent bias is 8
            // more than E4M3's: the pattern is the value / 256).
            Format::E4M3 => _mm256_or_si256(
                _mm256_slli_epi16::<8>(_mm256_and_si256(c, _mm256_set1_epi16(0x80))),
                _mm256_slli_epi16::<7>(_mm256_and_si256(c, _mm256_set1_epi16(0x7F))),
            ),
            // E5M2 is the high byte of the f16 of the same value.
            _ => _mm256_slli_epi16::<8>(c),
        }
    }

    /// # Safety
    /// AVX-512 F/BW/VL available; `codes.len() == out.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn dequantize_avx512(
        format: Format,
        codes: &[u8],
        scale: f32,
        out: &mut [f32],
    ) {
        let n = codes.len();
        let s = _mm512_set1_ps(f16_pattern_scale(format, scale));
        let mut i = 0;
        while i < n {
            let mask: __mmask16 = if n - i >= 16 { u16::MAX } else { (1u16 << (n - i)) - 1 };
            // SAFETY: the mask covers only elements `i..n`.
            let bytes = unsafe { _mm_maskz_loadu_epi8(mask, codes.as_ptr().add(i).cast()) };
            let v = match format {
                Format::Int8 => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)),
                _ => _mm512_cvtph_ps(fp8_to_f16_bits_512(format, _mm256_cvtepu8_epi16(bytes))),
            };
            // SAFETY: as above.
            unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), mask, _mm512_mul_ps(v, s)) };
            i += 16;
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C available; `codes.len() == out.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequantize_avx2(
        format: Format,
        codes: &[u8],
        scale: f32,
        out: &mut [f32],
    ) {
        let n = codes.len();
        let s = _mm256_set1_ps(f16_pattern_scale(format, scale));
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: 8 bytes readable and 8 floats writable at `i`.
            let bytes = unsafe { _mm_loadl_epi64(codes.as_ptr().add(i).cast()) };
            let v = match format {
                Format::Int8 => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                Format::E4M3 => {
                    let c = _mm_cvtepu8_epi16(bytes);
                    let bits = _mm_or_si128(
                        _mm_slli_epi16::<8>(_mm_and_si128(c, _mm_set1_epi16(0x80))),
                        _mm_slli_epi16::<7>(_mm_and_si128(c, _mm_set1_epi16(0x7F))),
                    );
                    _mm256_cvtph_ps(bits)
                }
                Format::E5M2 => _mm256_cvtph_ps(_mm_slli_epi16::<8>(_mm_cvtepu8_epi16(bytes))),
            };
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(v, s)) };
            i += 8;
        }
        super::dequantize_row_scalar(format, &codes[i..], scale, &mut out[i..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [Format; 3] = [Format::Int8, Format::E4M3, Format::E5M2];

    #[test]
    fn round_ties_even_is_std_s_up_to_the_sign_of_zero() {
        let mut x = 0x1234_5678u32;
        let mut values = vec![0.5, 1.5, 2.5, -0.5, -2.5, 4_194_303.5, 4_194_304.5, 1e30, -1e30];
        values.extend([f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN_POSITIVE]);
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            values.push(f32::from_bits(x));
        }
        for v in values {
            let (ours, std) = (round_ties_even(v), v.round_ties_even());
            assert!(ours == std || (ours.is_nan() && std.is_nan()), "{v}: {ours} vs {std}");
        }
    }

    fn finite_codes(format: Format) -> Vec<u8> {
        (0..=255u8)
            .filter(|&c| match format {
                Format::Int8 => c != 0x80,
                Format::E4M3 => c & 0x7F != 0x7F,
                Format::E5M2 => c & 0x7F <= 0x7B,
            })
            .collect()
    }

    #[test]
    fn code_values_are_the_formats() {
        assert_eq!(code_value(Format::E4M3, 0x7E), 448.0);
        assert_eq!(code_value(Format::E4M3, 0x08), 2f32.powi(-6));
        assert_eq!(code_value(Format::E4M3, 0x01), 2f32.powi(-9));
        assert_eq!(code_value(Format::E4M3, 0xB8), -1.0);
        assert_eq!(code_value(Format::E5M2, 0x7B), 57344.0);
        assert_eq!(code_value(Format::E5M2, 0x01), 2f32.powi(-16));
        assert_eq!(code_value(Format::E5M2, 0x3C), 1.0);
        assert_eq!(code_value(Format::Int8, 0x81), -127.0);
        // E5M2 is the top byte of the f16 of the same value.
        for c in finite_codes(Format::E5M2) {
            let f16 = half::f16::from_bits(u16::from(c) << 8).to_f32();
            assert_eq!(code_value(Format::E5M2, c), f16, "code {c:#x}");
        }
    }

    #[test]
    fn encode_inverts_code_value_and_rounds_to_nearest_even() {
        for format in FORMATS {
            let codes = finite_codes(format);
            for &c in &codes {
                let v = code_value(format, c);
                if v == 0.0 {
                    continue; // -0 and +0 both encode by sign
                }
                assert_eq!(format.encode(v), c, "{format:?} code {c:#x}");
            }
            // Between neighbours: below the midpoint goes down, above goes up, the midpoint to
            // the even code.
            let mut pos: Vec<(f32, u8)> = codes
                .iter()
                .map(|&c| (code_value(format, c), c))
                .filter(|&(v, c)| v > 0.0 || c == 0)
                .collect();
            pos.sort_by(|a, b| a.0.total_cmp(&b.0));
            pos.dedup_by(|a, b| a.0 == b.0);
            for w in pos.windows(2) {
                let ((lo, cl), (hi, ch)) = (w[0], w[1]);
                let mid = f32::midpoint(lo, hi);
                let even = if format == Format::Int8 {
                    if (lo as i32) % 2 == 0 { cl } else { ch }
                } else if cl % 2 == 0 {
                    cl
                } else {
                    ch
                };
                assert_eq!(format.encode(mid), even, "{format:?} midpoint {mid}");
                assert_eq!(format.encode(lo + (mid - lo) * 0.5), cl);
                assert_eq!(format.encode(mid + (hi - mid) * 0.5), ch);
                let neg = format.encode(-(mid + (hi - mid) * 0.5));
                assert_eq!(code_value(format, neg), -hi, "{format:?} negative of {hi}");
            }
            // Saturation.
            let max = format.max_value();
            assert_eq!(code_value(format, format.encode(max * 4.0)), max);
            assert_eq!(code_value(format, format.encode(f32::INFINITY)), max);
            assert_eq!(code_value(format, format.encode(-max * 1.001)), -max);
        }
    }

    #[test]
    fn rows_quantize_alone_and_within_half_a_step() {
        let x: Vec<f32> = (0..70).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173).collect();
        for format in FORMATS {
            let mut codes = vec![0u8; x.len()];
            let scale = quantize_row(format, &x, &mut codes);
            let absmax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(scale, absmax / format.max_value());
            let mut back = vec![0.0; x.len()];
            dequantize_row_scalar(format, &codes, scale, &mut back);
            for (a, b) in x.iter().zip(&back) {
                // Half a step: int8 steps are `scale`; FP8 steps are relative (half an ulp of
                // 3 or 2 mantissa bits), down to the subnormal step.
                let half_step = match format {
                    Format::Int8 => 0.5 * scale,
                    Format::E4M3 => (a.abs() / 16.0).max(scale * 2f32.powi(-10)),
                    Format::E5M2 => (a.abs() / 8.0).max(scale * 2f32.powi(-17)),
                };
                assert!((a - b).abs() <= half_step * 1.0001, "{format:?}: {a} -> {b}");
            }
            // The largest element maps to the largest code (up to the rounding of the scale).
            let back_max = back.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!((back_max - absmax).abs() <= absmax * 1e-6, "{format:?}: {back_max}");
            // An all-zero row.
            let zeros = [0.0f32; 9];
            let mut zc = [7u8; 9];
            assert_eq!(quantize_row(format, &zeros, &mut zc), 0.0);
            assert_eq!(zc, [0; 9]);
        }
    }

    #[test]
    fn hadamard_twice_is_n_times_identity_and_codecs_round_trip() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 29 % 17) as f32 - 8.0) * 0.37).collect();
        let mut y = x.clone();
        hadamard(&mut y);
        hadamard_scaled(&mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-5, "{a} {b}");
        }
        // An outlier channel: rotation spreads it, so int8 keeps the small channels.
        let mut row: Vec<f32> = (0..256).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.01).collect();
        row[17] = 40.0;
        let err = |dtype: KvCacheDtype| {
            let codec = RowCodec::new(dtype, 256).unwrap();
            let mut codes = vec![0u8; 256];
            let mut scales = vec![0.0; codec.scales_per_row()];
            codec.encode(&row, &mut Vec::new(), &mut codes, &mut scales);
            let mut back = vec![0.0; 256];
            codec.decode_unrotated(&codes, &scales, &mut back);
            row.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
        };
        let int8 = RowCodec::new(KvCacheDtype::Int8, 256).unwrap();
        assert!(int8.rotate && int8.group == 64 && int8.scales_per_row() == 4);
        // Without the rotation, one scale per row would round the small channels to multiples
        // of 40 / 127: errors up to half of that.
        let unrotated = 40.0 / 127.0 / 2.0;
        assert!(err(KvCacheDtype::Int8) < unrotated / 2.0, "{}", err(KvCacheDtype::Int8));
        assert!(err(KvCacheDtype::Fp8E4M3) < 40.0 / 16.0);
        assert_eq!(RowCodec::new(KvCacheDtype::F16, 256), None);
    }

    #[test]
    fn simd_dequantize_is_bitwise_scalar() {
        let scales = [1.0f32, 0.0123, 3.7e-5, 1.9e4, 1e-30, 7.0e33];
        for format in FORMATS {
            for level in SimdLevel::available() {
                for n in [1usize, 7, 8, 15, 16, 17, 64, 100, 256, 300] {
                    let codes: Vec<u8> = (0..n).map(|i| (i * 151 + 7) as u8).collect();
                    let codes: Vec<u8> = codes
                        .into_iter()
                        .map(|c| if finite_codes(format).contains(&c) { c } else { 0 })
                        .collect();
                    for &scale in &scales {
                        let mut want = vec![0.0; n];
                        let mut got = vec![0.0; n];
                        dequantize_row_scalar(format, &codes, scale, &mut want);
                        dequantize_row(level, format, &codes, scale, &mut got);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&want), "{format:?} {level:?} n={n} s={scale}");
                    }
                }
            }
        }
    }
}
