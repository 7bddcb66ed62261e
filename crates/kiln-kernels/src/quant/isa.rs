//! The vector operations the quantized kernels are written in, over "16 lanes":
//! a [`Isa::V`] is 64 bytes seen as `[16 lanes][4 bytes]` or as 16 i32 lanes, a [`Isa::F`] is
//! 16 f32 lanes. Implemented by [`Scalar`] (the reference) and, in `x86`, by AVX-512 VNNI,
//! AVX-512 BW and AVX2 (two 8-lane halves).
//!
//! Every operation is exact integer arithmetic or a single IEEE f32 operation per lane (fused
//! multiply-add included), so one kernel written over this trait gives bitwise identical
//! results on every implementation.

/// Vector operations; all `unsafe` because the x86 implementations need their CPU features
/// (the caller checks them) and the pointer arguments must be readable/writable as stated.
pub(crate) trait Isa: Copy {
    type V: Copy;
    type F: Copy;
    /// When true, [`Isa::dot`] may saturate for weights `>= 128`, and Q8_0 uses
    /// [`Isa::dot_q8`] instead (which computes `Σ (w − 128)·x` directly).
    const SIGNED_Q8: bool;
    /// Whether the K-quant kernels may build decode-sized levels straight from the record
    /// (`levels`); the scalar reference always reads the unpacked quads.
    const FROM_RECORD: bool;

    /// 64 bytes at `p`.
    unsafe fn load(p: *const u8) -> Self::V;
    /// 64 bytes to `p`.
    unsafe fn store(p: *mut u8, v: Self::V);
    unsafe fn splat8(v: u8) -> Self::V;
    unsafe fn and(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn or(a: Self::V, b: Self::V) -> Self::V;
    /// Wrapping byte subtraction.
    unsafe fn sub8(a: Self::V, b: Self::V) -> Self::V;
    /// Byte `i` of `table`'s 16-byte lane `i / 16` at index `idx[i]` (every `idx[i] < 16`):
    /// a 16-entry lookup when all four lanes of `table` hold the same 16 bytes.
    unsafe fn lut16(table: Self::V, idx: Self::V) -> Self::V;
    /// Logical shifts of 16-bit lanes.
    unsafe fn srli16<const N: u32>(a: Self::V) -> Self::V;
    unsafe fn slli16<const N: u32>(a: Self::V) -> Self::V;

    unsafe fn zero() -> Self::V;
    /// `acc[l] + Σ_{b<4} w[l][b] (u8) · x[b] (i8)`: `x` points at 4 activation bytes.
    unsafe fn dot(acc: Self::V, w: Self::V, x: *const i8) -> Self::V;
    /// `acc[l] + Σ_{b<4} (w[l][b] − 128) · x[b]` for `x` in `-127..=127`.
    unsafe fn dot_q8(acc: Self::V, w: Self::V, x: *const i8) -> Self::V;
    unsafe fn add32(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub32(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mullo32(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn splat32(v: i32) -> Self::V;
    /// `acc[l] + a[l].lo16 · x.lo16 + a[l].hi16 · x.hi16` (signed 16-bit pairs).
    unsafe fn madd16(acc: Self::V, a: Self::V, x: i32) -> Self::V;
    /// 16 u8 at `p` widened to i32 lanes.
    unsafe fn widen_u8_i32(p: *const u8) -> Self::V;
    /// 16 i8 at `p` widened to i32 lanes.
    unsafe fn widen_i8_i32(p: *const u8) -> Self::V;
    /// 32 u8 at `p` widened to 16-bit pairs (lane `l` = bytes `2l`, `2l + 1`).
    unsafe fn widen_u8_i16(p: *const u8) -> Self::V;

    unsafe fn cvt(a: Self::V) -> Self::F;
    /// 16 little-endian f16 at `p`.
    unsafe fn load_f16(p: *const u8) -> Self::F;
    unsafe fn loadf(p: *const f32) -> Self::F;
    unsafe fn storef(p: *mut f32, v: Self::F);
    /// [`Isa::storef`] that bypasses the caches where it can (`p` 64-byte aligned).
    unsafe fn streamf(p: *mut f32, v: Self::F) {
        // SAFETY: forwarded.
        unsafe { Self::storef(p, v) }
    }
    unsafe fn splatf(v: f32) -> Self::F;
    unsafe fn mulf(a: Self::F, b: Self::F) -> Self::F;
    /// `a·b + c`, fused.
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `c − a·b`, fused.
    unsafe fn fnmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
}

/// The scalar reference implementation.
#[derive(Clone, Copy)]
pub(crate) struct Scalar;

/// 64 bytes, aligned like a vector register.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Bytes64(pub [u8; 64]);

impl Bytes64 {
    fn i32(&self, l: usize) -> i32 {
        i32::from_le_bytes([self.0[4 * l], self.0[4 * l + 1], self.0[4 * l + 2], self.0[4 * l + 3]])
    }

    fn from_i32(f: impl Fn(usize) -> i32) -> Self {
        let mut out = Self([0; 64]);
        for l in 0..16 {
            out.0[4 * l..4 * l + 4].copy_from_slice(&f(l).to_le_bytes());
        }
        out
    }

    fn zip8(self, b: Self, f: impl Fn(u8, u8) -> u8) -> Self {
        Self(std::array::from_fn(|i| f(self.0[i], b.0[i])))
    }

    fn map16(self, f: impl Fn(u16) -> u16) -> Self {
        let mut out = self;
        for c in out.0.chunks_exact_mut(2) {
            c.copy_from_slice(&f(u16::from_le_bytes([c[0], c[1]])).to_le_bytes());
        }
        out
    }
}

/// Reads `N` bytes at `p`.
///
/// # Safety
/// `p` must be readable for `N` bytes.
unsafe fn read<const N: usize>(p: *const u8) -> [u8; N] {
    // SAFETY: guaranteed by the caller; unaligned read of plain bytes.
    unsafe { p.cast::<[u8; N]>().read_unaligned() }
}

impl Isa for Scalar {
    type V = Bytes64;
    type F = [f32; 16];
    const SIGNED_Q8: bool = false;
    const FROM_RECORD: bool = false;

    unsafe fn load(p: *const u8) -> Bytes64 {
        // SAFETY: forwarded from the caller.
        Bytes64(unsafe { read::<64>(p) })
    }
    unsafe fn store(p: *mut u8, v: Bytes64) {
        // SAFETY: the caller guarantees 64 writable bytes at `p`.
        unsafe { p.cast::<[u8; 64]>().write_unaligned(v.0) };
    }
    unsafe fn splat8(v: u8) -> Bytes64 {
        Bytes64([v; 64])
    }
    unsafe fn and(a: Bytes64, b: Bytes64) -> Bytes64 {
        a.zip8(b, |x, y| x & y)
    }
    unsafe fn or(a: Bytes64, b: Bytes64) -> Bytes64 {
        a.zip8(b, |x, y| x | y)
    }
    unsafe fn sub8(a: Bytes64, b: Bytes64) -> Bytes64 {
        a.zip8(b, u8::wrapping_sub)
    }
    unsafe fn lut16(table: Bytes64, idx: Bytes64) -> Bytes64 {
        Bytes64(std::array::from_fn(|i| table.0[(i / 16) * 16 + usize::from(idx.0[i] & 15)]))
    }
    unsafe fn srli16<const N: u32>(a: Bytes64) -> Bytes64 {
        a.map16(|v| v >> N)
    }
    unsafe fn slli16<const N: u32>(a: Bytes64) -> Bytes64 {
        a.map16(|v| v << N)
    }
    unsafe fn zero() -> Bytes64 {
        Bytes64([0; 64])
    }
    unsafe fn dot(acc: Bytes64, w: Bytes64, x: *const i8) -> Bytes64 {
        // SAFETY: the caller guarantees 4 readable bytes at `x`.
        let x = unsafe { read::<4>(x.cast()) };
        Bytes64::from_i32(|l| {
            let s: i32 =
                (0..4).map(|b| i32::from(w.0[4 * l + b]) * i32::from(x[b].cast_signed())).sum();
            acc.i32(l).wrapping_add(s)
        })
    }
    unsafe fn dot_q8(acc: Bytes64, w: Bytes64, x: *const i8) -> Bytes64 {
        // SAFETY: the caller guarantees 4 readable bytes at `x`.
        let x = unsafe { read::<4>(x.cast()) };
        Bytes64::from_i32(|l| {
            let s: i32 = (0..4)
                .map(|b| (i32::from(w.0[4 * l + b]) - 128) * i32::from(x[b].cast_signed()))
                .sum();
            acc.i32(l).wrapping_add(s)
        })
    }
    unsafe fn add32(a: Bytes64, b: Bytes64) -> Bytes64 {
        Bytes64::from_i32(|l| a.i32(l).wrapping_add(b.i32(l)))
    }
    unsafe fn sub32(a: Bytes64, b: Bytes64) -> Bytes64 {
        Bytes64::from_i32(|l| a.i32(l).wrapping_sub(b.i32(l)))
    }
    unsafe fn mullo32(a: Bytes64, b: Bytes64) -> Bytes64 {
        Bytes64::from_i32(|l| a.i32(l).wrapping_mul(b.i32(l)))
    }
    unsafe fn splat32(v: i32) -> Bytes64 {
        Bytes64::from_i32(|_| v)
    }
    unsafe fn madd16(acc: Bytes64, a: Bytes64, x: i32) -> Bytes64 {
        let (xl, xh) = (i32::from(x as i16), x >> 16);
        Bytes64::from_i32(|l| {
            let v = a.i32(l);
            acc.i32(l).wrapping_add(i32::from(v as i16) * xl + (v >> 16) * xh)
        })
    }
    unsafe fn widen_u8_i32(p: *const u8) -> Bytes64 {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        let b = unsafe { read::<16>(p) };
        Bytes64::from_i32(|l| i32::from(b[l]))
    }
    unsafe fn widen_i8_i32(p: *const u8) -> Bytes64 {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        let b = unsafe { read::<16>(p) };
        Bytes64::from_i32(|l| i32::from(b[l].cast_signed()))
    }
    unsafe fn widen_u8_i16(p: *const u8) -> Bytes64 {
        // SAFETY: the caller guarantees 32 readable bytes at `p`.
        let b = unsafe { read::<32>(p) };
        Bytes64::from_i32(|l| i32::from(b[2 * l]) | (i32::from(b[2 * l + 1]) << 16))
    }
    unsafe fn cvt(a: Bytes64) -> [f32; 16] {
        std::array::from_fn(|l| a.i32(l) as f32)
    }
    unsafe fn load_f16(p: *const u8) -> [f32; 16] {
        // SAFETY: the caller guarantees 32 readable bytes at `p`.
        let b = unsafe { read::<32>(p) };
        std::array::from_fn(|l| half::f16::from_le_bytes([b[2 * l], b[2 * l + 1]]).to_f32())
    }
    unsafe fn loadf(p: *const f32) -> [f32; 16] {
        // SAFETY: the caller guarantees 16 readable f32 at `p`.
        unsafe { p.cast::<[f32; 16]>().read_unaligned() }
    }
    unsafe fn storef(p: *mut f32, v: [f32; 16]) {
        // SAFETY: the caller guarantees 16 writable f32 at `p`.
        unsafe { p.cast::<[f32; 16]>().write_unaligned(v) };
    }
    unsafe fn splatf(v: f32) -> [f32; 16] {
        [v; 16]
    }
    unsafe fn mulf(a: [f32; 16], b: [f32; 16]) -> [f32; 16] {
        std::array::from_fn(|l| a[l] * b[l])
    }
    unsafe fn fmadd(a: [f32; 16], b: [f32; 16], c: [f32; 16]) -> [f32; 16] {
        std::array::from_fn(|l| a[l].mul_add(b[l], c[l]))
    }
    unsafe fn fnmadd(a: [f32; 16], b: [f32; 16], c: [f32; 16]) -> [f32; 16] {
        std::array::from_fn(|l| (-a[l]).mul_add(b[l], c[l]))
    }
}
