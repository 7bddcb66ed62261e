//! bf16 × bf16 matmuls on the CPU's 16-bit units: AVX-512 BF16 `vdpbf16ps`, for bf16 weights
//! whose activations run in bf16 (`--dtype bfloat16`, the default for bf16 checkpoints).
//!
//! Activations are rounded to bf16 once per call ([`round_to_bf16`], the hardware's
//! conversion: nearest even, subnormals to signed zero, NaN kept quiet); weights are read as
//! stored (row-major `[n, k]`, mapped in place). Sums are f32.
//!
//! The order, which makes results bitwise reproducible: output `(i, j)` accumulates in 16 f32
//! lanes from zero; for every 32-element chunk of `k` in turn (the last one padded with zeros),
//! lane `l` adds `x[2l+1]·w[2l+1]` and then `x[2l]·w[2l]`, each a fused multiply-add rounded to
//! nearest even with subnormal inputs read as zero and subnormal results flushed to zero (what
//! `vdpbf16ps` does); then the lanes are summed `l + (l+8)`, then `+4`, `+2`, `+1` in plain
//! f32 ([`hsum16`]). [`dot_scalar`] computes exactly this and the AVX-512 kernel is tested bit
//! for bit against it. Nothing in the order depends on `m` or on which tile a row falls in, so
//! a row's result is the same alone, batched or in a prefill chunk; a CPU without AVX-512 BF16
//! runs [`dot_scalar`] and gets the same bits (slowly: the backend only chooses this path where
//! the instructions exist).

use std::cell::RefCell;
use std::ops::Range;

use half::bf16;

use crate::thread_pool::SharedMut;
use crate::{CpuIsa, SimdLevel};

/// Elements of one chunk: one 512-bit register of bf16.
const CHUNK: usize = 32;
/// Activation rows per cache block (`[ROW_BLOCK, k]` bf16 stays in L2 while weights stream).
const ROW_BLOCK: usize = 64;

/// Whether this CPU runs the bf16 dot products in hardware on the selected kernel path.
pub fn bf16_dot_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        CpuIsa::selected().level() == SimdLevel::Avx512
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `v` rounded to bf16 bits as `vcvtneps2bf16` does: nearest even; zero and subnormal inputs
/// become a zero of their sign; NaN stays NaN (made quiet).
pub fn round_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    let sign = (bits >> 16) as u16 & 0x8000;
    if bits & 0x7f80_0000 == 0 {
        return sign;
    }
    if v.is_nan() {
        return (bits >> 16) as u16 | 0x0040;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// A bf16 input as `vdpbf16ps` reads it: subnormals are zero.
fn daz(b: u16) -> f32 {
    let b = if b & 0x7f80 == 0 { b & 0x8000 } else { b };
    f32::from_bits(u32::from(b) << 16)
}

/// A result as `vdpbf16ps` writes it: subnormals flushed to a zero of their sign.
fn ftz(v: f32) -> f32 {
    if v.is_subnormal() { f32::from_bits(v.to_bits() & 0x8000_0000) } else { v }
}

/// The lanes summed in the fixed order: `l + (l+8)`, then `+4`, `+2`, `+1`.
#[inline]
pub fn hsum16(v: &[f32; 16]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
    let s4: [f32; 4] = std::array::from_fn(|i| s8[i] + s8[i + 4]);
    let s2: [f32; 2] = std::array::from_fn(|i| s4[i] + s4[i + 2]);
    s2[0] + s2[1]
}

/// The reference dot product of `x` and `w` (bf16 bits, equal lengths) in the module's order.
pub fn dot_scalar(x: &[u16], w: &[u16]) -> f32 {
    assert_eq!(x.len(), w.len());
    let mut lanes = [0.0f32; 16];
    for c in (0..x.len()).step_by(CHUNK) {
        for (l, lane) in lanes.iter_mut().enumerate() {
            for e in [c + 2 * l + 1, c + 2 * l] {
                let (a, b) = (x.get(e).copied().unwrap_or(0), w.get(e).copied().unwrap_or(0));
                *lane = ftz(daz(a).mul_add(daz(b), *lane));
            }
        }
    }
    hsum16(&lanes)
}

thread_local! {
    /// The current call's activations rounded to bf16 (`[m, k]`); grows, never shrinks.
    static ROUNDED: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with `x` rounded to bf16 (elementwise, so any row range of the result is that
/// range of `x` rounded).
pub fn with_rounded<R>(x: &[f32], f: impl FnOnce(&[u16]) -> R) -> R {
    ROUNDED.with_borrow_mut(|buf| {
        buf.resize(x.len(), 0);
        round_slice(x, buf);
        f(buf)
    })
}

/// `out[i] = round_to_bf16(x[i])`.
pub fn round_slice(x: &[f32], out: &mut [u16]) {
    assert_eq!(x.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if bf16_dot_supported() {
        // SAFETY: AVX-512 F/BW/BF16 are available; the lengths are equal.
        unsafe { x86::round_slice(x, out) };
        return;
    }
    for (o, v) in out.iter_mut().zip(x) {
        *o = round_to_bf16(*v);
    }
}

/// Writes columns `rows` of `out[m, n]` = `xb[m, k] · W[rows]ᵀ` for bf16 weights `w` (`[n,
/// k]`) and activations `xb` already rounded to bf16.
///
/// `out` must point to an `[m, n]` buffer of which the caller's task owns columns `rows`.
pub fn gemv_rows_bf16(
    xb: &[u16],
    m: usize,
    w: &[bf16],
    (n, k): (usize, usize),
    rows: Range<usize>,
    out: SharedMut<f32>,
) {
    assert!(xb.len() == m * k && w.len() == n * k && rows.end <= n);
    let hw = bf16_dot_supported();
    // SAFETY: bf16 is a 16-bit plain value; the slice is reinterpreted as its bits.
    let w: &[u16] = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u16>(), w.len()) };
    for r0 in (0..m).step_by(ROW_BLOCK) {
        let r1 = (r0 + ROW_BLOCK).min(m);
        let mut j = rows.start;
        while j < rows.end {
            let nr = if j + 4 <= rows.end { 4 } else { 1 };
            let wt = &w[j * k..(j + nr) * k];
            let mut r = r0;
            while r < r1 {
                let mr = (r1 - r).min(4);
                let xt = &xb[r * k..(r + mr) * k];
                let o = out.ptr().wrapping_add(r * n + j);
                #[cfg(target_arch = "x86_64")]
                if hw {
                    // SAFETY: AVX-512 BF16 is available; xt is [mr, k], wt is [nr, k]; the
                    // caller owns out[r.., j..j + nr] with row stride n.
                    unsafe { x86::tile(xt, mr, wt, k, nr, o, n) };
                    r += mr;
                    continue;
                }
                let _ = hw;
                for a in 0..mr {
                    for b in 0..nr {
                        let d = dot_scalar(&xt[a * k..(a + 1) * k], &wt[b * k..(b + 1) * k]);
                        // SAFETY: the caller owns these columns of out, [m, n].
                        unsafe { *o.add(a * n + b) = d };
                    }
                }
                r += mr;
            }
            j += nr;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::CHUNK;

    /// [`super::hsum16`] in registers: the same additions in the same order.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn hsum16(a: __m512) -> f32 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
        let s8 = _mm256_add_ps(_mm512_castps512_ps256(a), hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }

    /// [`super::hsum16`] of four accumulators at once: each step adds the same lanes of every
    /// accumulator, gathered by shuffles, so each result is bitwise its own `hsum16`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn hsum16x4(a: &[__m512; 4]) -> [f32; 4] {
        // l + (l+8): [lo256 of a0 | lo256 of a1] + [hi256 of a0 | hi256 of a1], and a2, a3.
        let s01 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a[0], a[1]),
            _mm512_shuffle_f32x4::<0xEE>(a[0], a[1]),
        );
        let s23 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a[2], a[3]),
            _mm512_shuffle_f32x4::<0xEE>(a[2], a[3]),
        );
        // +4: 128-bit lane j becomes accumulator j's lanes 0..4 plus its lanes 4..8.
        let s4 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(s01, s23),
            _mm512_shuffle_f32x4::<0xDD>(s01, s23),
        );
        // +2, then +1, within each 128-bit lane.
        let s2 = _mm512_add_ps(s4, _mm512_shuffle_ps::<0x4E>(s4, s4));
        let s1 = _mm512_add_ps(s2, _mm512_shuffle_ps::<0xB1>(s2, s2));
        // SAFETY: __m512 is 16 plain f32.
        let v: [f32; 16] = unsafe { std::mem::transmute(s1) };
        [v[0], v[4], v[8], v[12]]
    }

    /// `out[i] = round_to_bf16(x[i])` with `vcvtneps2bf16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub unsafe fn round_slice(x: &[f32], out: &mut [u16]) {
        let full = x.len() - x.len() % 16;
        let mut i = 0;
        // SAFETY: every access is below `full <= len` of both slices.
        unsafe {
            while i < full {
                let v = _mm512_loadu_ps(x.as_ptr().add(i));
                let b: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
                _mm256_storeu_si256(out.as_mut_ptr().add(i).cast(), b);
                i += 16;
            }
        }
        for (o, v) in out[full..].iter_mut().zip(&x[full..]) {
            *o = super::round_to_bf16(*v);
        }
    }

    /// 32 bf16 at `p`, the lanes at and after `len` zero.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn load(p: *const u16, len: usize) -> __m512bh {
        // SAFETY: the caller guarantees `min(len, 32)` readable elements; masked lanes are not
        // read. __m512i and __m512bh are both 512 bits of plain data.
        unsafe {
            let v = if len >= CHUNK {
                _mm512_loadu_si512(p.cast())
            } else {
                _mm512_maskz_loadu_epi16((1u32 << len) - 1, p.cast())
            };
            std::mem::transmute::<__m512i, __m512bh>(v)
        }
    }

    /// `out[a * n + b] = x[a] · w[b]` for `a < M`, `b < NR` (rows of `k`), in the module's order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn kern<const M: usize, const NR: usize>(
        x: *const u16,
        w: *const u16,
        k: usize,
        out: *mut f32,
        n: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NR]; M];
        let mut c = 0;
        // SAFETY (whole body): x holds M rows of k, w holds NR rows of k; loads are masked at
        // k; out[..M, ..NR] (stride n) is the caller's.
        unsafe {
            while c < k {
                let len = k - c;
                let mut wv = [load(w.add(c), len); NR];
                for (i, wvi) in wv.iter_mut().enumerate().skip(1) {
                    *wvi = load(w.add(i * k + c), len);
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xv = load(x.add(r * k + c), len);
                    for (a, wvi) in acc_r.iter_mut().zip(&wv) {
                        *a = _mm512_dpbf16_ps(*a, xv, *wvi);
                    }
                }
                c += CHUNK;
            }
            for (r, acc_r) in acc.iter().enumerate() {
                if let Ok(four) = <&[__m512; 4]>::try_from(&acc_r[..]) {
                    for (i, s) in hsum16x4(four).into_iter().enumerate() {
                        *out.add(r * n + i) = s;
                    }
                } else {
                    for (i, a) in acc_r.iter().enumerate() {
                        *out.add(r * n + i) = hsum16(*a);
                    }
                }
            }
        }
    }

    /// One tile of `mr <= 4` activation rows × `nr` (1 or 4) weight rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn tile(
        x: &[u16],
        mr: usize,
        w: &[u16],
        k: usize,
        nr: usize,
        out: *mut f32,
        n: usize,
    ) {
        assert!(x.len() >= mr * k && w.len() >= nr * k && mr <= 4 && (nr == 1 || nr == 4));
        let (x, w) = (x.as_ptr(), w.as_ptr());
        // SAFETY: bounds asserted above; out is forwarded from the caller.
        unsafe {
            match (mr, nr) {
                (1, 4) => kern::<1, 4>(x, w, k, out, n),
                (2, 4) => kern::<2, 4>(x, w, k, out, n),
                (3, 4) => kern::<3, 4>(x, w, k, out, n),
                (_, 4) => kern::<4, 4>(x, w, k, out, n),
                (1, _) => kern::<1, 1>(x, w, k, out, n),
                (2, _) => kern::<2, 1>(x, w, k, out, n),
                (3, _) => kern::<3, 1>(x, w, k, out, n),
                (_, _) => kern::<4, 1>(x, w, k, out, n),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values over a wide exponent range, with zeros, subnormals and exact cancellations.
    fn awkward(n: usize, seed: u64) -> Vec<f32> {
        crate::testing::values(n, seed, 1.0)
            .into_iter()
            .enumerate()
            .map(|(i, unit)| {
                match i % 11 {
                    0 => 0.0,
                    1 => f32::from_bits(unit.to_bits() & 0x807f_ffff), // subnormal (or zero)
                    2 => unit * 1e-38,
                    3 => unit * 1e20,
                    4 => -unit * 1e20,
                    5 => 1.0,
                    6 => f32::EPSILON * 0.5,
                    _ => unit * 4.0,
                }
            })
            .collect()
    }

    fn rounded(v: &[f32]) -> Vec<u16> {
        v.iter().map(|x| round_to_bf16(*x)).collect()
    }

    #[test]
    fn rounding_matches_the_hardware_conversion_and_nearest_even() {
        assert_eq!(round_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(round_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        assert_eq!(round_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(round_to_bf16(-f32::from_bits(1)), 0x8000);
        assert_eq!(round_to_bf16(f32::MAX), 0x7f80);
        assert!(f32::from_bits(u32::from(round_to_bf16(f32::NAN)) << 16).is_nan());
        let x = awkward(1000, 3);
        let mut out = vec![0u16; x.len()];
        round_slice(&x, &mut out);
        assert_eq!(out, rounded(&x), "the vector conversion differs from round_to_bf16");
    }

    /// The kernel equals the scalar order bit for bit on every tile shape and `k` tail, and a
    /// row's result does not depend on how many rows share the call.
    #[test]
    fn kernel_is_bitwise_the_scalar_order_whatever_the_batch() {
        for (n, k) in [(1, 1), (5, 17), (9, 32), (13, 95), (36, 640)] {
            let w = rounded(&awkward(n * k, 7));
            let w: Vec<bf16> = w.iter().map(|b| bf16::from_bits(*b)).collect();
            let w_bits: Vec<u16> = w.iter().map(|b| b.to_bits()).collect();
            let x = rounded(&awkward(70 * k, 11));
            let mut alone = vec![0f32; n];
            for m in [1usize, 2, 3, 4, 5, 9, 70] {
                let mut out = vec![f32::NAN; m * n];
                let xs = &x[..m * k];
                gemv_rows_bf16(xs, m, &w, (n, k), 0..n, SharedMut::new(&mut out));
                for i in 0..m {
                    for j in 0..n {
                        let want = dot_scalar(&xs[i * k..(i + 1) * k], &w_bits[j * k..(j + 1) * k]);
                        let got = out[i * n + j];
                        assert_eq!(got.to_bits(), want.to_bits(), "n={n} k={k} m={m} ({i},{j})");
                    }
                }
                if m == 1 {
                    alone.copy_from_slice(&out);
                }
                assert_eq!(
                    out[..n].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "row 0 changed with m={m}"
                );
            }
        }
    }

    /// The order is sequential fused multiply-adds, odd element first: `1 + 2^-24 + 2^-24`
    /// stays 1 (each half-ulp add ties to even), where one rounding of the pair's sum would
    /// give the next float.
    #[test]
    fn each_product_is_rounded_into_the_lane_in_turn() {
        let one = round_to_bf16(1.0);
        let tiny = round_to_bf16(2f32.powi(-12));
        // lane 0: x[0]·w[0] = 1, then (next chunk) 2^-24 twice.
        let mut x = vec![0u16; 64];
        let mut w = vec![0u16; 64];
        (x[0], w[0]) = (one, one);
        (x[32], w[32], x[33], w[33]) = (tiny, tiny, tiny, tiny);
        assert_eq!(dot_scalar(&x, &w), 1.0);
        let wb: Vec<bf16> = w.iter().map(|b| bf16::from_bits(*b)).collect();
        let mut out = [0f32];
        gemv_rows_bf16(&x, 1, &wb, (1, 64), 0..1, SharedMut::new(&mut out));
        assert_eq!(out[0], 1.0, "the hardware rounded the pair's sum once");
    }
}
