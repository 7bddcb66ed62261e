//! The scale search of the K-quants (Q4_K, Q5_K): for each 32-element sub-block, the best
//! `(scale, min)` with `x ≈ scale·q − min`, `q in 0..=nmax`, `min >= 0`, by least squares over
//! 21 candidate scales (as ggml's `make_qkx2_quants` searches).
//!
//! [`fit_scale_min`] is the reference, one sub-block at a time. [`fit_scale_min_8`] fits a
//! block's 8 sub-blocks at once, one per lane of `[f32; 8]` arrays the compiler vectorizes:
//! every lane does exactly the reference's arithmetic for its sub-block, in the same order
//! (each sum runs over the sub-block's elements in order), so its results are the reference's
//! bit for bit (tested). [`round_half_away`] is `f32::round` without the libm call.

use super::formats::QK;

/// Lanes: the sub-blocks of a 256-element K-quant block.
const LANES: usize = 8;

/// `x.round()` (half away from zero), exactly, for every `x`: integers from 2^23 up, infinities
/// and NaN come back as they are.
#[allow(clippy::inline_always)] // inside the vectorized lanes: a call would stop them
#[inline(always)]
pub(super) fn round_half_away(x: f32) -> f32 {
    // Branch-free and without conversions, so that lanes of it vectorize: |x| rounded to
    // nearest-even by adding and taking away 2^23 (exact below 2^23), a tie that went down
    // moved up (away from zero), then x's sign (so -0.3 gives -0.0 as `round` does).
    const TWO_23: f32 = 8_388_608.0;
    let m = x.abs();
    let even = (m + TWO_23) - TWO_23;
    let away = even + f32::from(u8::from(m - even == 0.5));
    let r = if m < TWO_23 { away } else { m };
    r.copysign(x)
}

/// Best `(scale, min)` of one sub-block (module docs): the reference.
#[cfg(test)]
fn fit_scale_min(x: &[f32], nmax: u8) -> (f32, f32) {
    let lo = x.iter().fold(0.0f32, |a, v| a.min(*v));
    let hi = x.iter().fold(f32::MIN, |a, v| a.max(*v));
    if hi <= lo {
        return (0.0, -lo);
    }
    let nmax_f = f32::from(nmax);
    let mut best = (f32::INFINITY, (hi - lo) / nmax_f, -lo);
    for step in 0..=20 {
        let iscale = (nmax_f - 1.0 + 0.1 * step as f32) / (hi - lo);
        let (mut sl, mut sl2, mut sx, mut sxl) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
        for v in x {
            let l = round_half_away((v - lo) * iscale).clamp(0.0, nmax_f);
            sl += l;
            sl2 += l * l;
            sx += v;
            sxl += v * l;
        }
        let n = x.len() as f32;
        let det = n * sl2 - sl * sl;
        if det <= 0.0 {
            continue;
        }
        let mut a = (n * sxl - sl * sx) / det;
        let mut b = (sl2 * sx - sl * sxl) / det;
        if b > 0.0 {
            b = 0.0;
            a = sxl / sl2;
        }
        if a <= 0.0 {
            continue;
        }
        let err: f32 = x
            .iter()
            .map(|v| {
                let l = round_half_away((v - b) / a).clamp(0.0, nmax_f);
                let e = a * l + b - v;
                e * e
            })
            .sum();
        if err < best.0 {
            best = (err, a, -b);
        }
    }
    (best.1, best.2)
}

/// [`fit_scale_min`] of the 8 sub-blocks of `x` (`[8 * 32]`) at once: `(scales, mins)`, bit
/// for bit the reference's (module docs). On x86-64 with AVX2 the lanes are one 256-bit
/// register (no FMA: the arithmetic is the reference's, operation for operation).
pub(super) fn fit_scale_min_8(x: &[f32], nmax: u8) -> ([f32; LANES], [f32; LANES]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { fit_scale_min_8_avx2(x, nmax) };
    }
    fit_scale_min_8_lanes(x, nmax)
}

/// [`fit_scale_min_8_lanes`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn fit_scale_min_8_avx2(x: &[f32], nmax: u8) -> ([f32; LANES], [f32; LANES]) {
    fit_scale_min_8_lanes(x, nmax)
}

/// The lanes of [`fit_scale_min_8`], in plain Rust the compiler vectorizes.
#[allow(clippy::inline_always)] // compiled into the AVX2 function, not called from it
#[inline(always)]
fn fit_scale_min_8_lanes(x: &[f32], nmax: u8) -> ([f32; LANES], [f32; LANES]) {
    type V = [f32; LANES];
    // `[32][8]`: element `l` of every sub-block side by side.
    let mut t = [[0.0f32; LANES]; QK];
    for (s, sub) in x.chunks_exact(QK).take(LANES).enumerate() {
        for (l, v) in sub.iter().enumerate() {
            t[l][s] = *v;
        }
    }
    let (mut lo, mut hi, mut sx): (V, V, V) = ([0.0; LANES], [f32::MIN; LANES], [0.0; LANES]);
    for row in &t {
        for s in 0..LANES {
            lo[s] = lo[s].min(row[s]);
            hi[s] = hi[s].max(row[s]);
            sx[s] += row[s];
        }
    }
    let nmax_f = f32::from(nmax);
    let n = QK as f32;
    let mut best_err: V = [f32::INFINITY; LANES];
    let mut best_a: V = std::array::from_fn(|s| (hi[s] - lo[s]) / nmax_f);
    let mut best_m: V = std::array::from_fn(|s| -lo[s]);
    for step in 0..=20 {
        let iscale: V =
            std::array::from_fn(|s| (nmax_f - 1.0 + 0.1 * step as f32) / (hi[s] - lo[s]));
        let (mut sl, mut sl2, mut sxl): (V, V, V) = ([0.0; LANES], [0.0; LANES], [0.0; LANES]);
        for row in &t {
            for s in 0..LANES {
                let l = round_half_away((row[s] - lo[s]) * iscale[s]).clamp(0.0, nmax_f);
                sl[s] += l;
                sl2[s] += l * l;
                sxl[s] += row[s] * l;
            }
        }
        let mut a: V = [0.0; LANES];
        let mut b: V = [0.0; LANES];
        let mut valid = [false; LANES];
        for s in 0..LANES {
            let det = n * sl2[s] - sl[s] * sl[s];
            a[s] = (n * sxl[s] - sl[s] * sx[s]) / det;
            b[s] = (sl2[s] * sx[s] - sl[s] * sxl[s]) / det;
            if b[s] > 0.0 {
                b[s] = 0.0;
                a[s] = sxl[s] / sl2[s];
            }
            valid[s] = not_at_most_zero(det) && not_at_most_zero(a[s]);
        }
        let mut err: V = [0.0; LANES];
        for row in &t {
            for s in 0..LANES {
                let l = round_half_away((row[s] - b[s]) / a[s]).clamp(0.0, nmax_f);
                let e = a[s] * l + b[s] - row[s];
                err[s] += e * e;
            }
        }
        for s in 0..LANES {
            if valid[s] && err[s] < best_err[s] {
                (best_err[s], best_a[s], best_m[s]) = (err[s], a[s], -b[s]);
            }
        }
    }
    for s in 0..LANES {
        if hi[s] <= lo[s] {
            (best_a[s], best_m[s]) = (0.0, -lo[s]);
        }
    }
    (best_a, best_m)
}

/// Whether the reference goes on past its `if v <= 0.0 { continue }`: `v > 0`, or NaN.
#[allow(clippy::inline_always)] // inside the vectorized lanes
#[inline(always)]
fn not_at_most_zero(v: f32) -> bool {
    !matches!(v.partial_cmp(&0.0), Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_half_away_is_round() {
        let mut specials = vec![
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -1.5,
            2.5,
            -2.5,
            0.499_999_97,
            -0.499_999_97,
            0.3,
            -0.3,
            8_388_607.5,
            8_388_608.0,
            -8_388_609.0,
            1e30,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            16_777_217.0,
        ];
        specials.extend((0..100_000).map(|i| ((i as f32) * 0.618_034).sin() * 40.0));
        for x in specials {
            assert_eq!(round_half_away(x).to_bits(), x.round().to_bits(), "{x}");
        }
        assert!(round_half_away(f32::NAN).is_nan());
    }

    #[test]
    fn eight_lanes_are_the_reference_bit_for_bit() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for case in 0..400 {
            let mut x: Vec<f32> = (0..256).map(|_| next() * 0.05).collect();
            match case % 5 {
                // A constant sub-block, an all-positive one, one with an outlier, zeros.
                1 => x[32..64].fill(0.01),
                2 => x[64..96].iter_mut().for_each(|v| *v = v.abs() + 0.1),
                3 => x[100] = 3.0,
                4 => x[..32].fill(0.0),
                _ => {}
            }
            for nmax in [15, 31] {
                let (scales, mins) = fit_scale_min_8(&x, nmax);
                assert_eq!((scales, mins), fit_scale_min_8_lanes(&x, nmax));
                for s in 0..LANES {
                    let (a, m) = fit_scale_min(&x[s * QK..(s + 1) * QK], nmax);
                    assert_eq!(
                        (scales[s].to_bits(), mins[s].to_bits()),
                        (a.to_bits(), m.to_bits()),
                        "case {case} nmax {nmax} sub-block {s}"
                    );
                }
            }
        }
    }
}
