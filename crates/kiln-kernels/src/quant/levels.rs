//! Where the K-quant tiles of the general kernel (`kernel`) and of the VNNI register tiles
//! (`pairs_k`) read a unit's weight levels: a [`Levels`] hands out two quads at a time, either
//! from the unit unpacked into the scratch ([`Quads`]) or built in registers straight from the
//! record ([`Q4Record`], [`Q5Record`], [`Q6Record`]), right before their `vpdpbusd`.
//!
//! Unpacking stores 4 KiB of levels per unit (and Q6_K loads and stores them once more to add
//! its high bits); a decode-sized call (a few activation rows) then loads each quad only once
//! or twice, so the store and the reload cost more than the 3–6 register operations that build
//! a pair of quads from the record. Calls with many rows reuse every unpacked quad across their
//! row tiles and keep [`Quads`]; the kernels choose by row count ([`from_record`]).
//!
//! Bitwise contract: every source yields exactly the bytes [`super::repack::unpack`] writes
//! (the same masks and shifts, per the record layout of `repack`), so the kernels' integers,
//! and so their outputs, do not depend on the source.

use super::formats::GgmlType;
use super::isa::Isa;
use super::repack::{bit4_of, record_layout};

/// Activation rows up to which a K-quant call builds its levels from the record (decode and
/// small batches).
pub(crate) const FROM_RECORD_MAX_ROWS: usize = 4;

/// Whether a call of `rows` activation rows (one row chunk) on `ty` takes its levels from the
/// record: K-quants on an ISA other than the scalar reference (which keeps [`Quads`], so the
/// tests compare the record sources against the unpacked layout).
pub(crate) fn from_record<S: Isa>(ty: GgmlType, rows: usize) -> bool {
    S::FROM_RECORD
        && matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K)
        && rows <= FROM_RECORD_MAX_ROWS
}

/// The levels of one unit, two quads at a time.
pub(crate) trait Levels<S: Isa>: Copy {
    /// Quads `2v` and `2v + 1` of the unit (each `[16 lanes][4]` unsigned levels).
    ///
    /// # Safety
    /// `S`'s features must be available; `v` below 32 (a unit's 64 quads).
    unsafe fn pair(self, v: usize) -> (S::V, S::V);
}

/// The unit's quads unpacked (by [`super::repack::unpack`]) at this address.
#[derive(Clone, Copy)]
pub(crate) struct Quads(pub *const u8);

impl<S: Isa> Levels<S> for Quads {
    #[inline(always)] // must inline into the `#[target_feature]` entry points
    #[allow(clippy::inline_always)]
    unsafe fn pair(self, v: usize) -> (S::V, S::V) {
        // SAFETY: quads `2v`, `2v + 1` are inside the unpacked unit (the caller's).
        unsafe { (S::load(self.0.add(2 * v * 64)), S::load(self.0.add((2 * v + 1) * 64))) }
    }
}

/// A Q4_K record: nibble vector `v` holds quad `2v` low, `2v + 1` high.
#[derive(Clone, Copy)]
pub(crate) struct Q4Record(*const u8);

/// A Q5_K record: the nibbles of [`Q4Record`] plus bit plane `v / 4` for bit 4.
#[derive(Clone, Copy)]
pub(crate) struct Q5Record {
    rec: *const u8,
    planes: *const u8,
}

/// A Q6_K record: the nibbles of [`Q4Record`] plus high-bit vector `v / 2` for bits 4..6.
#[derive(Clone, Copy)]
pub(crate) struct Q6Record {
    rec: *const u8,
    high: *const u8,
}

impl Q4Record {
    /// The record of a whole Q4_K unit at `rec`.
    pub(crate) fn new(rec: *const u8) -> Self {
        Self(rec)
    }
}

impl Q5Record {
    /// The record of a whole Q5_K unit at `rec`.
    pub(crate) fn new(rec: *const u8) -> Self {
        let planes = rec.wrapping_add(record_layout(GgmlType::Q5K, 1).hi);
        Self { rec, planes }
    }
}

impl Q6Record {
    /// The record of a whole Q6_K unit at `rec`.
    pub(crate) fn new(rec: *const u8) -> Self {
        let high = rec.wrapping_add(record_layout(GgmlType::Q6K, 1).hi);
        Self { rec, high }
    }
}

/// The low and high nibbles of nibble vector `v` of `rec`: quads `2v`, `2v + 1` of 4 bits.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn nibbles<S: Isa>(rec: *const u8, v: usize) -> (S::V, S::V) {
    // SAFETY: nibble vector `v` is inside the record (the caller's); register operations.
    unsafe {
        let m4 = S::splat8(0x0F);
        let x = S::load(rec.add(v * 64));
        (S::and(x, m4), S::and(S::srli16::<4>(x), m4))
    }
}

impl<S: Isa> Levels<S> for Q4Record {
    #[inline(always)] // must inline into the `#[target_feature]` entry points
    #[allow(clippy::inline_always)]
    unsafe fn pair(self, v: usize) -> (S::V, S::V) {
        // SAFETY: forwarded from the caller.
        unsafe { nibbles::<S>(self.0, v) }
    }
}

impl<S: Isa> Levels<S> for Q5Record {
    #[inline(always)] // must inline into the `#[target_feature]` entry points
    #[allow(clippy::inline_always)]
    unsafe fn pair(self, v: usize) -> (S::V, S::V) {
        // SAFETY: nibble vector `v` and bit plane `v / 4` are inside the record.
        unsafe {
            let (lo, hi) = nibbles::<S>(self.rec, v);
            let plane = S::load(self.planes.add(v / 4 * 64));
            let t = v % 4;
            (S::or(lo, bit4_of::<S>(plane, 2 * t)), S::or(hi, bit4_of::<S>(plane, 2 * t + 1)))
        }
    }
}

impl<S: Isa> Levels<S> for Q6Record {
    #[inline(always)] // must inline into the `#[target_feature]` entry points
    #[allow(clippy::inline_always)]
    unsafe fn pair(self, v: usize) -> (S::V, S::V) {
        // SAFETY: nibble vector `v` and high-bit vector `v / 2` are inside the record.
        unsafe {
            let (lo, hi) = nibbles::<S>(self.rec, v);
            let h = S::load(self.high.add(v / 2 * 64));
            let m3 = S::splat8(0x30);
            // Quad `4w + t` of high-bit vector `w` has its bits 4..6 in bit pair `(2t, 2t + 1)`.
            let (h0, h1) = if v.is_multiple_of(2) {
                (S::and(S::slli16::<4>(h), m3), S::and(S::slli16::<2>(h), m3))
            } else {
                (S::and(h, m3), S::and(S::srli16::<2>(h), m3))
            };
            (S::or(lo, h0), S::or(hi, h1))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Levels, Q4Record, Q5Record, Q6Record, Quads};
    use crate::quant::formats::GgmlType;
    use crate::quant::isa::{Isa, Scalar};
    use crate::quant::repack::{LANES, Unpacked, pack, record_layout, unpack};
    use crate::testing::values;

    /// Every quad a record source builds equals the quad `unpack` writes, for every level
    /// (random rows plus all-ones bytes, which set every high bit).
    fn record_sources_equal_unpacked<S: Isa>() {
        for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
            for fill in [None, Some(0xFFu8)] {
                let bytes: Vec<u8> = match fill {
                    Some(b) => vec![b; LANES * ty.block_bytes()],
                    None => values(LANES * ty.block_bytes(), ty as u64 + 3, 1.0)
                        .iter()
                        .map(|v| (v.to_bits() >> 7) as u8)
                        .collect(),
                };
                let lanes: [Option<&[u8]>; LANES] = std::array::from_fn(|l| {
                    Some(&bytes[l * ty.block_bytes()..][..ty.block_bytes()])
                });
                let mut rec = vec![0u8; record_layout(ty, 1).size + 64];
                let at = rec.as_ptr().align_offset(64);
                pack(ty, 1, &lanes, &mut rec[at..at + record_layout(ty, 1).size]);
                let rec = rec[at..].as_ptr();
                let mut un = Unpacked::new();
                // SAFETY: `S` is available (the callers check); `rec` is a whole record.
                unsafe { unpack::<S>(ty, 1, rec, &mut un) };
                let quads = Quads(un.quads.as_ptr().cast());
                for v in 0..32 {
                    // SAFETY: as above; `v` is below 32.
                    let (want, got) = unsafe {
                        let want = Levels::<S>::pair(quads, v);
                        let got = match ty {
                            GgmlType::Q4K => Levels::<S>::pair(Q4Record::new(rec), v),
                            GgmlType::Q5K => Levels::<S>::pair(Q5Record::new(rec), v),
                            _ => Levels::<S>::pair(Q6Record::new(rec), v),
                        };
                        (want, got)
                    };
                    for (w, g) in [(want.0, got.0), (want.1, got.1)] {
                        let mut wb = [0u8; 64];
                        let mut gb = [0u8; 64];
                        // SAFETY: 64 writable bytes each.
                        unsafe {
                            S::store(wb.as_mut_ptr(), w);
                            S::store(gb.as_mut_ptr(), g);
                        }
                        assert_eq!(wb, gb, "{ty} fill {fill:?} pair {v}");
                    }
                }
            }
        }
    }

    #[test]
    fn record_levels_equal_unpacked_quads() {
        record_sources_equal_unpacked::<Scalar>();
        #[cfg(target_arch = "x86_64")]
        if crate::CpuIsa::best() >= crate::CpuIsa::Avx512Vnni {
            record_sources_equal_unpacked::<crate::quant::x86::Vnni>();
        }
    }
}
