//! The matmul kernel: register tiles of 4 weight rows × `M` activation rows (`M <= 4`), giving
//! `4·M` independent FMA chains over 16 (AVX-512) or 8 (AVX2) lanes of `k`; `k % lanes` tails
//! are finished in scalar code. Each weight tile is loaded once for all activation rows of a
//! row block, so decode streams the weights once per step whatever the batch size.

use std::cell::RefCell;
use std::ops::Range;

use half::{bf16, f16};

use super::{WeightData, WeightMatrix};
use crate::SimdLevel;
use crate::thread_pool::SharedMut;

/// Activation rows per cache block: a block of `x` (`[ROW_BLOCK, k]`) stays in L2 while the
/// weight tiles stream past it.
const ROW_BLOCK: usize = 64;
/// Above this many activation rows, f16/bf16 weight tiles are converted to f32 once per tile.
const CONVERT_MIN_ROWS: usize = 16;

thread_local! {
    /// f32 copy of one 4-row weight tile (`[4, k]`), reused while many activation rows pass.
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Writes columns `rows` of `out[m, n]` = `x[m, k] · W[rows]ᵀ`.
///
/// `out` must point to an `[m, n]` buffer of which the caller's task owns columns `rows`.
/// Every output element is computed by the same sequence of operations whatever `m` is and
/// whichever tile it falls in, so results are bitwise independent of batch composition.
pub fn gemv_rows(
    level: SimdLevel,
    x: &[f32],
    m: usize,
    w: &WeightMatrix,
    rows: Range<usize>,
    out: SharedMut<f32>,
) {
    let (n, k) = (w.rows, w.cols);
    assert!(x.len() == m * k && rows.end <= n);
    // With many activation rows, f16/bf16 tiles are converted once (exactly, so results do not
    // change) and reused.
    // Quantized weights always take the converting path here (`linear` routes them to the
    // integer kernels instead).
    let convert = (m > CONVERT_MIN_ROWS && !matches!(w.data, WeightData::F32(_)))
        || matches!(w.data, WeightData::Quant(_));
    for r0 in (0..m).step_by(ROW_BLOCK) {
        let r1 = (r0 + ROW_BLOCK).min(m);
        let mut j = rows.start;
        while j < rows.end {
            let nr = if j + 4 <= rows.end { 4 } else { 1 };
            let span = j * k..(j + nr) * k;
            let out_col = out.ptr().wrapping_add(j);
            if convert {
                TILE.with_borrow_mut(|tile| {
                    if tile.len() < nr * k {
                        tile.resize(nr * k, 0.0);
                    }
                    super::convert_to_f32(&w.data, span, &mut tile[..nr * k]);
                    row_groups(level, x, r0..r1, &tile[..nr * k], k, nr, out_col, n);
                });
            } else {
                match &w.data {
                    WeightData::F32(s) => {
                        row_groups(level, x, r0..r1, &s.as_slice()[span], k, nr, out_col, n);
                    }
                    WeightData::F16(s) => {
                        row_groups(level, x, r0..r1, &s.as_slice()[span], k, nr, out_col, n);
                    }
                    WeightData::Bf16(s) => {
                        row_groups(level, x, r0..r1, &s.as_slice()[span], k, nr, out_col, n);
                    }
                    WeightData::Quant(_) => unreachable!("converted above"),
                }
            }
            j += nr;
        }
    }
}

/// Runs one weight tile (`w_tile`, `[nr, k]`) against activation rows `rows` in groups of 4;
/// `out_col` points at the tile's first column of row 0 of `out[m, n]`.
fn row_groups<T: TileElem>(
    level: SimdLevel,
    x: &[f32],
    rows: Range<usize>,
    w_tile: &[T],
    k: usize,
    nr: usize,
    out_col: *mut f32,
    n: usize,
) {
    let mut r = rows.start;
    while r < rows.end {
        let mr = (rows.end - r).min(4);
        let out_tile = out_col.wrapping_add(r * n);
        T::tile(level, &x[r * k..(r + mr) * k], mr, w_tile, k, nr, out_tile, n);
        r += mr;
    }
}

/// Element types the tile kernels read.
pub trait TileElem: Copy {
    fn f32(self) -> f32;
    /// `(x[mr, k], w[nr, k]) -> out[mr, nr]` (row stride `n`) at `level`.
    fn tile(
        level: SimdLevel,
        x: &[f32],
        mr: usize,
        w: &[Self],
        k: usize,
        nr: usize,
        out: *mut f32,
        n: usize,
    );
}

/// Scalar reference: `out[i * n + j] = sum_c x[i * k + c] * w[j * k + c]` for `j in rows`.
pub fn gemv_scalar<T: Copy>(
    x: &[f32],
    m: usize,
    w: &[T],
    k: usize,
    rows: &Range<usize>,
    to_f32: impl Fn(T) -> f32,
    out: *mut f32,
    n: usize,
) {
    for i in 0..m {
        for j in rows.clone() {
            let wr = &w[j * k..(j + 1) * k];
            let xr = &x[i * k..(i + 1) * k];
            let acc: f32 = xr.iter().zip(wr).map(|(a, b)| a * to_f32(*b)).sum();
            // SAFETY: the caller guarantees `out` is [m, n] and that it owns these columns.
            unsafe { *out.add(i * n + j) = acc };
        }
    }
}

macro_rules! tile_elem {
    ($t:ty, $to_f32:expr, $avx512:ident, $avx2:ident) => {
        impl TileElem for $t {
            #[inline]
            fn f32(self) -> f32 {
                $to_f32(self)
            }

            fn tile(
                level: SimdLevel,
                x: &[f32],
                mr: usize,
                w: &[Self],
                k: usize,
                nr: usize,
                out: *mut f32,
                n: usize,
            ) {
                assert!(x.len() >= mr * k && w.len() >= nr * k && mr <= 4 && nr <= 4);
                #[cfg(target_arch = "x86_64")]
                {
                    if level == SimdLevel::Avx512 && SimdLevel::detect() >= SimdLevel::Avx512 {
                        // SAFETY: AVX-512 is available; x and w bounds asserted above; the
                        // caller owns out[..mr, ..nr] with row stride n.
                        unsafe { x86::$avx512(x, mr, w.as_ptr(), k, nr, out, n) };
                        return;
                    }
                    if level >= SimdLevel::Avx2 && SimdLevel::detect() >= SimdLevel::Avx2 {
                        // SAFETY: AVX2/FMA/F16C are available; bounds as above.
                        unsafe { x86::$avx2(x, mr, w.as_ptr(), k, nr, out, n) };
                        return;
                    }
                }
                let _ = level;
                gemv_scalar(x, mr, w, k, &(0..nr), |v: Self| v.f32(), out, n);
            }
        }
    };
}

tile_elem!(f32, |v: f32| v, tile_f32_avx512, tile_f32_avx2);
tile_elem!(f16, |v: f16| v.to_f32(), tile_f16_avx512, tile_f16_avx2);
tile_elem!(bf16, |v: bf16| v.to_f32(), tile_bf16_avx512, tile_bf16_avx2);

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::{bf16, f16};

    use super::TileElem;
    use crate::vec_ops::hsum256;

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16_f32(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        unsafe { _mm512_loadu_ps(p) }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::cast_ptr_alignment)] // unaligned load
    unsafe fn load16_bf16(p: *const bf16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements (32 bytes) at `p`.
        let raw = unsafe { _mm256_loadu_si256(p.cast::<__m256i>()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::cast_ptr_alignment)] // unaligned load
    unsafe fn load16_f16(p: *const f16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements (32 bytes) at `p`.
        let raw = unsafe { _mm256_loadu_si256(p.cast::<__m256i>()) };
        _mm512_cvtph_ps(raw)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8_f32(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements at `p`.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::cast_ptr_alignment)] // unaligned load
    unsafe fn load8_bf16(p: *const bf16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements (16 bytes) at `p`.
        let raw = unsafe { _mm_loadu_si128(p.cast::<__m128i>()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::cast_ptr_alignment)] // unaligned load
    unsafe fn load8_f16(p: *const f16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements (16 bytes) at `p`.
        let raw = unsafe { _mm_loadu_si128(p.cast::<__m128i>()) };
        _mm256_cvtph_ps(raw)
    }

    /// One tile: `NR` weight rows × `M` activation rows; `w` points at the tile's first row.
    macro_rules! tile_fn {
        ($name:ident, $t:ty, $feat:literal, $vec:ty, $lanes:literal, $zero:ident, $load:ident,
         $loadx:ident, $fma:ident, $hsum:expr) => {
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn $name<const M: usize, const NR: usize>(
                x: &[f32],
                w: *const $t,
                k: usize,
                out: *mut f32,
                n: usize,
            ) {
                let mut acc = [[$zero(); NR]; M];
                let kv = k - k % $lanes;
                let mut c = 0;
                // SAFETY (whole body): w holds NR rows of k elements, x holds M rows of k, and
                // all vector loads stay below `kv <= k`; out[..M, ..NR] (stride n) is the
                // caller's.
                unsafe {
                    while c < kv {
                        let mut wv = [$zero(); NR];
                        for (i, wvi) in wv.iter_mut().enumerate() {
                            *wvi = $load(w.add(i * k + c));
                        }
                        for (r, acc_r) in acc.iter_mut().enumerate() {
                            let xv = $loadx(x.as_ptr().add(r * k + c));
                            for (a, wvi) in acc_r.iter_mut().zip(&wv) {
                                *a = $fma(xv, *wvi, *a);
                            }
                        }
                        c += $lanes;
                    }
                    for (r, acc_r) in acc.iter().enumerate() {
                        for (i, a) in acc_r.iter().enumerate() {
                            let mut sum = $hsum(*a);
                            for cc in kv..k {
                                sum += x[r * k + cc] * (*w.add(i * k + cc)).f32();
                            }
                            *out.add(r * n + i) = sum;
                        }
                    }
                }
            }
        };
    }

    macro_rules! gemv_fn {
        ($name:ident, $tile:ident, $t:ty, $feat:literal) => {
            #[target_feature(enable = $feat)]
            pub unsafe fn $name(
                x: &[f32],
                mr: usize,
                w: *const $t,
                k: usize,
                nr: usize,
                out: *mut f32,
                n: usize,
            ) {
                // SAFETY: forwarded from the caller (bounds asserted by `TileElem::tile`).
                unsafe {
                    match (mr, nr) {
                        (1, 4) => $tile::<1, 4>(x, w, k, out, n),
                        (2, 4) => $tile::<2, 4>(x, w, k, out, n),
                        (3, 4) => $tile::<3, 4>(x, w, k, out, n),
                        (_, 4) => $tile::<4, 4>(x, w, k, out, n),
                        (1, _) => $tile::<1, 1>(x, w, k, out, n),
                        (2, _) => $tile::<2, 1>(x, w, k, out, n),
                        (3, _) => $tile::<3, 1>(x, w, k, out, n),
                        (_, _) => $tile::<4, 1>(x, w, k, out, n),
                    }
                }
            }
        };
    }

    tile_fn!(
        kern_f32_avx512,
        f32,
        "avx512f",
        __m512,
        16,
        _mm512_setzero_ps,
        load16_f32,
        load16_f32,
        _mm512_fmadd_ps,
        _mm512_reduce_add_ps
    );
    tile_fn!(
        kern_bf16_avx512,
        bf16,
        "avx512f",
        __m512,
        16,
        _mm512_setzero_ps,
        load16_bf16,
        load16_f32,
        _mm512_fmadd_ps,
        _mm512_reduce_add_ps
    );
    tile_fn!(
        kern_f16_avx512,
        f16,
        "avx512f",
        __m512,
        16,
        _mm512_setzero_ps,
        load16_f16,
        load16_f32,
        _mm512_fmadd_ps,
        _mm512_reduce_add_ps
    );
    tile_fn!(
        kern_f32_avx2,
        f32,
        "avx2,fma,f16c",
        __m256,
        8,
        _mm256_setzero_ps,
        load8_f32,
        load8_f32,
        _mm256_fmadd_ps,
        hsum256
    );
    tile_fn!(
        kern_bf16_avx2,
        bf16,
        "avx2,fma,f16c",
        __m256,
        8,
        _mm256_setzero_ps,
        load8_bf16,
        load8_f32,
        _mm256_fmadd_ps,
        hsum256
    );
    tile_fn!(
        kern_f16_avx2,
        f16,
        "avx2,fma,f16c",
        __m256,
        8,
        _mm256_setzero_ps,
        load8_f16,
        load8_f32,
        _mm256_fmadd_ps,
        hsum256
    );

    gemv_fn!(tile_f32_avx512, kern_f32_avx512, f32, "avx512f");
    gemv_fn!(tile_bf16_avx512, kern_bf16_avx512, bf16, "avx512f");
    gemv_fn!(tile_f16_avx512, kern_f16_avx512, f16, "avx512f");
    gemv_fn!(tile_f32_avx2, kern_f32_avx2, f32, "avx2,fma,f16c");
    gemv_fn!(tile_bf16_avx2, kern_bf16_avx2, bf16, "avx2,fma,f16c");
    gemv_fn!(tile_f16_avx2, kern_f16_avx2, f16, "avx2,fma,f16c");
}
