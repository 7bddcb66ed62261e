//! x86 implementations of [`Isa`]: AVX-512 with VNNI (`vpdpbusd`), AVX-512 BW without VNNI and
//! AVX2 (`vpmaddubsw` + `vpmaddwd`; a 16-lane vector is two 8-lane halves). Weights are the u8
//! operand and activations the i8 one; `vpmaddubsw` cannot saturate because weight levels are
//! at most 63, except Q8_0's `q + 128`, which [`Isa::dot_q8`] handles with the sign trick
//! (`|q| · sign(q)·x`, both operands within ±128).

use std::arch::x86_64::*;

use super::isa::Isa;

/// Broadcast of the 4 activation bytes at `x` as an i32.
///
/// # Safety
/// `x` must be readable for 4 bytes.
#[inline(always)]
#[allow(clippy::inline_always)] // a plain load, inlined into AVX code
unsafe fn x4(x: *const i8) -> i32 {
    // SAFETY: guaranteed by the caller.
    unsafe { x.cast::<i32>().read_unaligned() }
}

macro_rules! avx512_common {
    ($feat:literal) => {
        type V = __m512i;
        type F = __m512;

        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn load(p: *const u8) -> __m512i {
            // SAFETY: the caller guarantees 64 readable bytes.
            unsafe { _mm512_loadu_si512(p.cast()) }
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn store(p: *mut u8, v: __m512i) {
            // SAFETY: the caller guarantees 64 writable bytes.
            unsafe { _mm512_storeu_si512(p.cast(), v) }
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn splat8(v: u8) -> __m512i {
            _mm512_set1_epi8(v.cast_signed())
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
            _mm512_and_si512(a, b)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
            _mm512_or_si512(a, b)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn sub8(a: __m512i, b: __m512i) -> __m512i {
            _mm512_sub_epi8(a, b)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn lut16(table: __m512i, idx: __m512i) -> __m512i {
            _mm512_shuffle_epi8(table, idx)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn srli16<const N: u32>(a: __m512i) -> __m512i {
            _mm512_srli_epi16::<N>(a)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn slli16<const N: u32>(a: __m512i) -> __m512i {
            _mm512_slli_epi16::<N>(a)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn zero() -> __m512i {
            _mm512_setzero_si512()
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn add32(a: __m512i, b: __m512i) -> __m512i {
            _mm512_add_epi32(a, b)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn sub32(a: __m512i, b: __m512i) -> __m512i {
            _mm512_sub_epi32(a, b)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn mullo32(a: __m512i, b: __m512i) -> __m512i {
            _mm512_mullo_epi32(a, b)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn splat32(v: i32) -> __m512i {
            _mm512_set1_epi32(v)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn widen_u8_i32(p: *const u8) -> __m512i {
            // SAFETY: the caller guarantees 16 readable bytes.
            _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p.cast()) })
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn widen_i8_i32(p: *const u8) -> __m512i {
            // SAFETY: the caller guarantees 16 readable bytes.
            _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(p.cast()) })
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn widen_u8_i16(p: *const u8) -> __m512i {
            // SAFETY: the caller guarantees 32 readable bytes.
            _mm512_cvtepu8_epi16(unsafe { _mm256_loadu_si256(p.cast()) })
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn cvt(a: __m512i) -> __m512 {
            _mm512_cvtepi32_ps(a)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn load_f16(p: *const u8) -> __m512 {
            // SAFETY: the caller guarantees 32 readable bytes.
            _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn loadf(p: *const f32) -> __m512 {
            // SAFETY: the caller guarantees 16 readable f32.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn storef(p: *mut f32, v: __m512) {
            // SAFETY: the caller guarantees 16 writable f32.
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn streamf(p: *mut f32, v: __m512) {
            // SAFETY: the caller guarantees 16 writable f32.
            unsafe {
                if (p as usize).is_multiple_of(64) {
                    _mm512_stream_ps(p, v);
                } else {
                    _mm512_storeu_ps(p, v);
                }
            }
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn splatf(v: f32) -> __m512 {
            _mm512_set1_ps(v)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn mulf(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn fnmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fnmadd_ps(a, b, c)
        }
    };
}

/// AVX-512 F/BW/VL + VNNI.
#[derive(Clone, Copy)]
pub(crate) struct Vnni;

/// AVX-512 F/BW/VL without VNNI.
#[derive(Clone, Copy)]
pub(crate) struct Avx512;

/// AVX2 + FMA + F16C.
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

impl Isa for Vnni {
    const SIGNED_Q8: bool = false;
    const FROM_RECORD: bool = true;
    avx512_common!("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c");

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn dot(acc: __m512i, w: __m512i, x: *const i8) -> __m512i {
        // SAFETY: the caller guarantees 4 readable bytes at `x`.
        _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(unsafe { x4(x) }))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn dot_q8(acc: __m512i, w: __m512i, x: *const i8) -> __m512i {
        // SAFETY: the caller guarantees 4 readable bytes at `x`.
        let xb = _mm512_set1_epi32(unsafe { x4(x) });
        let offset = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(-128), xb);
        _mm512_sub_epi32(_mm512_dpbusd_epi32(acc, w, xb), offset)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn madd16(acc: __m512i, a: __m512i, x: i32) -> __m512i {
        _mm512_dpwssd_epi32(acc, a, _mm512_set1_epi32(x))
    }
}

impl Isa for Avx512 {
    const SIGNED_Q8: bool = true;
    const FROM_RECORD: bool = true;
    avx512_common!("avx512f,avx512bw,avx512vl,fma,f16c");

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn dot(acc: __m512i, w: __m512i, x: *const i8) -> __m512i {
        // SAFETY: the caller guarantees 4 readable bytes at `x`.
        let p = _mm512_maddubs_epi16(w, _mm512_set1_epi32(unsafe { x4(x) }));
        _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn dot_q8(acc: __m512i, w: __m512i, x: *const i8) -> __m512i {
        // SAFETY: the caller guarantees 4 readable bytes at `x`.
        let xb = _mm512_set1_epi32(unsafe { x4(x) });
        let q = _mm512_xor_si512(w, _mm512_set1_epi8(-128));
        let neg = _mm512_movepi8_mask(q);
        let xs = _mm512_mask_sub_epi8(xb, neg, _mm512_setzero_si512(), xb);
        let p = _mm512_maddubs_epi16(_mm512_abs_epi8(q), xs);
        _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn madd16(acc: __m512i, a: __m512i, x: i32) -> __m512i {
        _mm512_add_epi32(acc, _mm512_madd_epi16(a, _mm512_set1_epi32(x)))
    }
}

/// Two 8-lane halves.
#[derive(Clone, Copy)]
pub(crate) struct Pair<T>(T, T);

macro_rules! pair2 {
    ($f:ident, $a:expr, $b:expr) => {
        Pair($f($a.0, $b.0), $f($a.1, $b.1))
    };
}

impl Isa for Avx2 {
    type V = Pair<__m256i>;
    type F = Pair<__m256>;
    const SIGNED_Q8: bool = true;
    const FROM_RECORD: bool = true;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(p: *const u8) -> Pair<__m256i> {
        // SAFETY: the caller guarantees 64 readable bytes.
        unsafe { Pair(_mm256_loadu_si256(p.cast()), _mm256_loadu_si256(p.add(32).cast())) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store(p: *mut u8, v: Pair<__m256i>) {
        // SAFETY: the caller guarantees 64 writable bytes.
        unsafe {
            _mm256_storeu_si256(p.cast(), v.0);
            _mm256_storeu_si256(p.add(32).cast(), v.1);
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn splat8(v: u8) -> Pair<__m256i> {
        let s = _mm256_set1_epi8(v.cast_signed());
        Pair(s, s)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn and(a: Pair<__m256i>, b: Pair<__m256i>) -> Pair<__m256i> {
        pair2!(_mm256_and_si256, a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn or(a: Pair<__m256i>, b: Pair<__m256i>) -> Pair<__m256i> {
        pair2!(_mm256_or_si256, a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sub8(a: Pair<__m256i>, b: Pair<__m256i>) -> Pair<__m256i> {
        pair2!(_mm256_sub_epi8, a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn lut16(table: Pair<__m256i>, idx: Pair<__m256i>) -> Pair<__m256i> {
        pair2!(_mm256_shuffle_epi8, table, idx)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn srli16<const N: u32>(a: Pair<__m256i>) -> Pair<__m256i> {
        let c = _mm_cvtsi32_si128(N.cast_signed());
        Pair(_mm256_srl_epi16(a.0, c), _mm256_srl_epi16(a.1, c))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn slli16<const N: u32>(a: Pair<__m256i>) -> Pair<__m256i> {
        let c = _mm_cvtsi32_si128(N.cast_signed());
        Pair(_mm256_sll_epi16(a.0, c), _mm256_sll_epi16(a.1, c))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn zero() -> Pair<__m256i> {
        Pair(_mm256_setzero_si256(), _mm256_setzero_si256())
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(acc: Pair<__m256i>, w: Pair<__m256i>, x: *const i8) -> Pair<__m256i> {
        // SAFETY: the caller guarantees 4 readable bytes at `x`.
        let xb = _mm256_set1_epi32(unsafe { x4(x) });
        let ones = _mm256_set1_epi16(1);
        let d = |w| _mm256_madd_epi16(_mm256_maddubs_epi16(w, xb), ones);
        Pair(_mm256_add_epi32(acc.0, d(w.0)), _mm256_add_epi32(acc.1, d(w.1)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q8(acc: Pair<__m256i>, w: Pair<__m256i>, x: *const i8) -> Pair<__m256i> {
        // SAFETY: the caller guarantees 4 readable bytes at `x`.
        let xb = _mm256_set1_epi32(unsafe { x4(x) });
        let ones = _mm256_set1_epi16(1);
        let d = |w| {
            let q = _mm256_xor_si256(w, _mm256_set1_epi8(-128));
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xb, q));
            _mm256_madd_epi16(p, ones)
        };
        Pair(_mm256_add_epi32(acc.0, d(w.0)), _mm256_add_epi32(acc.1, d(w.1)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add32(a: Pair<__m256i>, b: Pair<__m256i>) -> Pair<__m256i> {
        pair2!(_mm256_add_epi32, a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sub32(a: Pair<__m256i>, b: Pair<__m256i>) -> Pair<__m256i> {
        pair2!(_mm256_sub_epi32, a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mullo32(a: Pair<__m256i>, b: Pair<__m256i>) -> Pair<__m256i> {
        pair2!(_mm256_mullo_epi32, a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn splat32(v: i32) -> Pair<__m256i> {
        let s = _mm256_set1_epi32(v);
        Pair(s, s)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn madd16(acc: Pair<__m256i>, a: Pair<__m256i>, x: i32) -> Pair<__m256i> {
        let xb = _mm256_set1_epi32(x);
        Pair(
            _mm256_add_epi32(acc.0, _mm256_madd_epi16(a.0, xb)),
            _mm256_add_epi32(acc.1, _mm256_madd_epi16(a.1, xb)),
        )
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_u8_i32(p: *const u8) -> Pair<__m256i> {
        // SAFETY: the caller guarantees 16 readable bytes.
        unsafe {
            Pair(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())),
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8).cast())),
            )
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_i8_i32(p: *const u8) -> Pair<__m256i> {
        // SAFETY: the caller guarantees 16 readable bytes.
        unsafe {
            Pair(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())),
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8).cast())),
            )
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_u8_i16(p: *const u8) -> Pair<__m256i> {
        // SAFETY: the caller guarantees 32 readable bytes.
        unsafe {
            Pair(
                _mm256_cvtepu8_epi16(_mm_loadu_si128(p.cast())),
                _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(16).cast())),
            )
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn cvt(a: Pair<__m256i>) -> Pair<__m256> {
        Pair(_mm256_cvtepi32_ps(a.0), _mm256_cvtepi32_ps(a.1))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f16(p: *const u8) -> Pair<__m256> {
        // SAFETY: the caller guarantees 32 readable bytes.
        unsafe {
            Pair(
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast())),
            )
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn loadf(p: *const f32) -> Pair<__m256> {
        // SAFETY: the caller guarantees 16 readable f32.
        unsafe { Pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn storef(p: *mut f32, v: Pair<__m256>) {
        // SAFETY: the caller guarantees 16 writable f32.
        unsafe {
            _mm256_storeu_ps(p, v.0);
            _mm256_storeu_ps(p.add(8), v.1);
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn splatf(v: f32) -> Pair<__m256> {
        let s = _mm256_set1_ps(v);
        Pair(s, s)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mulf(a: Pair<__m256>, b: Pair<__m256>) -> Pair<__m256> {
        pair2!(_mm256_mul_ps, a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fmadd(a: Pair<__m256>, b: Pair<__m256>, c: Pair<__m256>) -> Pair<__m256> {
        Pair(_mm256_fmadd_ps(a.0, b.0, c.0), _mm256_fmadd_ps(a.1, b.1, c.1))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fnmadd(a: Pair<__m256>, b: Pair<__m256>, c: Pair<__m256>) -> Pair<__m256> {
        Pair(_mm256_fnmadd_ps(a.0, b.0, c.0), _mm256_fnmadd_ps(a.1, b.1, c.1))
    }
}
