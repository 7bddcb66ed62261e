//! GGUF quantized tensor formats and the integer-dot quantized matmul.
//!
//! - [`GgmlType`]: the supported GGUF types and their block geometry ([`formats`]).
//! - [`dequantize_row`] / [`quantize_row`]: the scalar format reference and quantize-on-load
//!   (re-exported from `kiln_backend::quant`, where every backend reaches them).
//! - [`QuantMatrix`]: a `[rows, cols]` quantized weight matrix, repacked at load time into the
//!   kernel layout described in `repack` (16 rows interleaved per record, scales widened; about
//!   the size of the original). The original bytes are not kept: [`QuantMatrix::row_to_f32`]
//!   dequantizes from the repacked form with exactly [`dequantize_row`]'s arithmetic.
//!
//! Matmuls with a [`QuantMatrix`] go through [`crate::linear`]: the activations are quantized to
//! 8 bits per call (`act`), then `kernel` computes integer dot products (AMX-INT8 tiles
//! for every 16 activation rows, AVX-512 VNNI, AVX-512 BW or scalar; AVX2 has kernels of its
//! own in `avx2`; all bitwise identical) and applies the scales in a fixed order, so a row's
//! output never depends on the batch it is in.

mod act;
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_k;
mod isa;
mod kernel;
mod levels;
#[cfg(target_arch = "x86_64")]
mod pairs;
#[cfg(target_arch = "x86_64")]
mod pairs_k;
#[cfg(target_arch = "x86_64")]
mod prefetch;
mod repack;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

pub(crate) use act::QuantActs;
pub use formats::GgmlType;
pub(crate) use kernel::qgemm_groups;
/// The codecs live below the seam (`kiln_backend::quant`), shared with the other backends.
pub use kiln_backend::quant::{dequantize_row, formats, iq, quantize_row};

/// Whether AMX-INT8 tiles are usable here (CPU and OS).
pub(crate) fn amx_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

use formats::QK_K;
use isa::Scalar;
use repack::{LANES, UNIT, Unpacked, blocks_in, dequant_lane, pack, record_layout, unpack};

/// One 64-byte line of repacked data (keeps records 64-byte aligned).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A `[rows, cols]` block-quantized matrix in the kernel layout.
pub struct QuantMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    /// Units (256-column slices) per row; the last may hold fewer blocks.
    units: usize,
    /// Bytes of a record of a full unit, and of the last unit.
    full_record: usize,
    last_record: usize,
    /// Bytes per 16-row group.
    group_bytes: usize,
    data: Vec<Line>,
}

impl QuantMatrix {
    /// Repacks `rows` rows of `ty.row_bytes(cols)` bytes each; `None` when `ty` is not a
    /// quantized type, `cols` is not a multiple of its block, or `bytes` has the wrong length.
    pub fn from_bytes(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        if !ty.is_quantized() || cols == 0 {
            return None;
        }
        let row_bytes = ty.row_bytes(cols)?;
        if rows.checked_mul(row_bytes)? != bytes.len() {
            return None;
        }
        let units = cols.div_ceil(UNIT);
        let full_nb = blocks_in(ty, UNIT.min(cols));
        let last_nb = blocks_in(ty, cols - (units - 1) * UNIT);
        let full_record = record_layout(ty, full_nb).size;
        let last_record = record_layout(ty, last_nb).size;
        let group_bytes = (units - 1) * full_record + last_record;
        let groups = rows.div_ceil(LANES);
        let mut data = vec![Line([0; 64]); (groups.checked_mul(group_bytes)?) / 64];
        let unit_bytes = full_nb * ty.block_bytes();
        let pack_group = |g: usize, out: &mut [u8]| {
            let mut at = 0;
            for u in 0..units {
                let nb = if u + 1 == units { last_nb } else { full_nb };
                let lanes: [Option<&[u8]>; LANES] = std::array::from_fn(|l| {
                    let r = g * LANES + l;
                    (r < rows).then(|| {
                        let start = r * row_bytes + u * unit_bytes;
                        &bytes[start..start + nb * ty.block_bytes()]
                    })
                });
                let size = record_layout(ty, nb).size;
                pack(ty, nb, &lanes, &mut out[at..at + size]);
                at += size;
            }
        };
        let flat = lines_as_bytes_mut(&mut data);
        let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        let per_thread = groups.div_ceil(threads).max(1);
        std::thread::scope(|scope| {
            for (t, chunk) in flat.chunks_mut(per_thread * group_bytes).enumerate() {
                let pack_group = &pack_group;
                scope.spawn(move || {
                    for (i, out) in chunk.chunks_mut(group_bytes).enumerate() {
                        pack_group(t * per_thread + i, out);
                    }
                });
            }
        });
        crate::huge_pages::advise(&data, true);
        Some(Self { ty, rows, cols, units, full_record, last_record, group_bytes, data })
    }

    /// Bytes a `[rows, cols]` matrix of `ty` takes in the kernel layout (what
    /// [`Self::from_bytes`] allocates); `None` as there.
    pub fn held_bytes(ty: GgmlType, rows: usize, cols: usize) -> Option<usize> {
        if !ty.is_quantized() || cols == 0 || !cols.is_multiple_of(ty.block_elems()) {
            return None;
        }
        let units = cols.div_ceil(UNIT);
        let full = record_layout(ty, blocks_in(ty, UNIT.min(cols))).size;
        let last = record_layout(ty, blocks_in(ty, cols - (units - 1) * UNIT)).size;
        let group = (units - 1).checked_mul(full)?.checked_add(last)?;
        rows.div_ceil(LANES).checked_mul(group)
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of the repacked data (what one full matmul reads).
    pub fn num_bytes(&self) -> usize {
        self.data.len() * 64
    }

    /// Activation block size the kernels need for this matrix.
    pub(crate) fn act_block(&self) -> usize {
        // IQ4_XS runs as 8 blocks of 32 per super-block.
        if self.ty.block_elems() == QK_K && self.ty != GgmlType::Iq4Xs { QK_K } else { formats::QK }
    }

    /// Blocks in unit `u`.
    pub(crate) fn unit_blocks(&self, u: usize) -> usize {
        let elems = (self.cols - u * UNIT).min(UNIT);
        blocks_in(self.ty, elems)
    }

    /// The record of group `g`, unit `u`.
    pub(crate) fn record(&self, g: usize, u: usize) -> *const u8 {
        let at = g * self.group_bytes + u * self.full_record;
        debug_assert!(at + self.last_record.min(self.full_record) <= self.num_bytes());
        lines_as_bytes(&self.data)[at..].as_ptr()
    }

    /// Row `r` dequantized into `out` (`[cols]`), bitwise as [`dequantize_row`] of the
    /// original bytes.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols, "row_to_f32: bad row or length");
        let mut un = Unpacked::new();
        let (g, lane) = (r / LANES, r % LANES);
        for u in 0..self.units {
            let nb = self.unit_blocks(u);
            let rec = self.record(g, u);
            let size = record_layout(self.ty, nb).size;
            // SAFETY: the scalar implementation needs no CPU features; `rec` is a whole record.
            unsafe { unpack::<Scalar>(self.ty, nb, rec, &mut un) };
            let quads = if self.ty == GgmlType::Q8_0 {
                &lines_as_bytes(&self.data)[g * self.group_bytes + u * self.full_record..][..size]
            } else {
                un.quads.as_flattened()
            };
            let o = &mut out[u * UNIT..u * UNIT + nb * self.ty.block_elems()];
            dequant_lane(self.ty, nb, &un, quads, lane, o);
        }
    }
}

fn lines_as_bytes(l: &[Line]) -> &[u8] {
    // SAFETY: `Line` is `repr(C)` around `[u8; 64]` with no padding (size 64, align 64).
    unsafe { std::slice::from_raw_parts(l.as_ptr().cast::<u8>(), l.len() * 64) }
}

fn lines_as_bytes_mut(l: &mut [Line]) -> &mut [u8] {
    // SAFETY: as in `lines_as_bytes`.
    unsafe { std::slice::from_raw_parts_mut(l.as_mut_ptr().cast::<u8>(), l.len() * 64) }
}
