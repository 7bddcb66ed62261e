//! gpt-oss's MXFP4 experts as its checkpoints store them, repacked into GGUF's MXFP4 blocks.
//!
//! A checkpoint stacks every expert of a layer: `{name}_blocks` `[experts, rows, cols / 32,
//! 16]` bytes, each byte two FP4 (E2M1) codes, element `2k` in the low nibble of byte `k`,
//! `2k + 1` in the high one; `{name}_scales` `[experts, rows, cols / 32]`, one E8M0 exponent per
//! 32 elements. GGUF's MXFP4 block is the exponent byte then 16 bytes holding element `j` in the
//! low nibble of byte `j` and element `j + 16` in its high nibble; the codes and exponents are
//! the same numbers, so the repacking moves nibbles and changes no value (llama.cpp's converter
//! does the same).

use kiln_backend::{GgmlType, HostTensor};

use super::WeightStore;
use crate::LoadError;

/// Elements per MXFP4 block.
const BLOCK: usize = 32;

/// Expert `e`'s `[rows, cols]` matrix: rows `part.map_or(r, |p| 2r + p)` of the stacks
/// (gpt-oss's alternating gate and up rows), as GGUF MXFP4 rows.
pub(crate) fn expert(
    store: &WeightStore,
    name: &str,
    (e, num_experts): (usize, usize),
    part: Option<usize>,
    (rows, cols): (usize, usize),
) -> Result<HostTensor, LoadError> {
    let bad = |m: String| LoadError::format(store.path_of(name), format!("`{name}`: {m}"));
    if !cols.is_multiple_of(BLOCK) {
        return Err(bad(format!("{cols} columns is not a whole number of MXFP4 blocks")));
    }
    let groups = cols / BLOCK;
    let stored_rows = if part.is_some() { 2 * rows } else { rows };
    let blocks =
        store.uint8s(&format!("{name}_blocks"), &[num_experts, stored_rows, groups, 16])?;
    let scales = store.uint8s(&format!("{name}_scales"), &[num_experts, stored_rows, groups])?;
    let mut out = Vec::with_capacity(rows * groups * 17);
    for r in 0..rows {
        let row = e * stored_rows + part.map_or(r, |p| 2 * r + p);
        for g in 0..groups {
            out.push(scales[row * groups + g]);
            let codes = &blocks[(row * groups + g) * 16..][..16];
            // Element `i`'s nibble in the checkpoint's order.
            let nibble = |i: usize| (codes[i / 2] >> (4 * (i % 2))) & 0x0f;
            out.extend((0..16).map(|j| nibble(j) | (nibble(j + 16) << 4)));
        }
    }
    HostTensor::new(GgmlType::Mxfp4, rows, cols, out.into())
        .ok_or_else(|| bad("MXFP4 row size".into()))
}
