//! The packed layouts, each read into one form ([`Unpacked`]): unsigned levels, unsigned zero
//! points, scales, and each input's group. `w[o, i] = s[g, o] · (q[o, i] − z[g, o])` with
//! `g = g_idx[i]`.
//!
//! - AWQ (`version` `gemm`): `qweight` i32 `[in, out/8]`: nibble `AWQ_NIBBLE[j]` of
//!   `qweight[i][c]` is column `8c + j`; `qzeros` i32 `[G, out/8]` likewise; `scales` `[G, out]`.
//! - GPTQ: `qweight` i32 `[in·bits/32, out]`, input `i` in bits `bits·(i mod 32/bits)` of row
//!   `i / (32/bits)`; `qzeros` i32 `[G, out·bits/32]` packed the same way along `out`, holding
//!   `z − 1` in the original (`gptq`) format and `z` in `gptq_v2`; `scales` `[G, out]`; `g_idx`
//!   i32 `[in]`.
//! - compressed-tensors `pack-quantized`: `weight_packed` i32 `[out, in·bits/32]`, input `i` in
//!   bits `bits·(i mod 32/bits)` of word `i / (32/bits)`, each level stored plus `2^(bits−1)`
//!   (so unsigned); `weight_scale` `[out, G]`; `weight_zero_point` (asymmetric only) i32
//!   `[out·bits/32, G]` packed along `out`, stored the same way; `weight_g_idx` i32 `[in]`.
//!   The bits follow from the packed width, the groups from the scale's.
//! - compressed-tensors `int-quantized` (8-bit, W8A8 / W8A16): `weight` i8 `[out, in]`,
//!   `weight_scale` `[out, G]`, `weight_zero_point` i8 `[out, G]` when asymmetric.

use crate::{LoadError, WeightStore};

/// AWQ's packing order: column `8c + j` sits in nibble `AWQ_NIBBLE[j]` of word `c`.
const AWQ_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// One matrix's integers, unpacked.
pub(super) struct Unpacked {
    /// 4 or 8.
    pub bits: u32,
    /// `[out, in]`, each in `0..2^bits`.
    pub levels: Vec<u8>,
    /// `[G, out]`, each in `0..2^bits`.
    pub zeros: Vec<u32>,
    /// `[G, out]`
    pub scales: Vec<f32>,
    /// `[in]` the group of each input (not yet checked against `G`).
    pub g_idx: Vec<i32>,
    /// `G`
    pub groups: usize,
}

/// Bits `bits·k ..` of `word`.
fn field(word: i32, bits: u32, k: usize) -> u32 {
    (word as u32 >> (bits as usize * k)) & ((1 << bits) - 1)
}

/// `i / group` for every input: groups in input order.
fn plain_groups(inp: usize, group: usize) -> Vec<i32> {
    (0..inp).map(|i| (i / group) as i32).collect()
}

/// The group of each of `inp` inputs: the `g_idx` tensor `name` when stored, else
/// [`plain_groups`].
fn groups_of(
    store: &WeightStore,
    name: &str,
    inp: usize,
    group: usize,
) -> Result<Vec<i32>, LoadError> {
    Ok(store.try_int32s(name, &[inp])?.unwrap_or_else(|| plain_groups(inp, group)))
}

/// An AWQ matrix `stem` of `[out, inp]` in groups of `group` inputs.
pub(super) fn awq(
    store: &WeightStore,
    stem: &str,
    (out, inp): (usize, usize),
    group: usize,
) -> Result<Unpacked, LoadError> {
    let groups = inp.div_ceil(group);
    let qw = store.int32s(&format!("{stem}.qweight"), &[inp, out / 8])?;
    let qz = store.int32s(&format!("{stem}.qzeros"), &[groups, out / 8])?;
    let mut levels = vec![0u8; out * inp];
    let mut zeros = vec![0u32; groups * out];
    for (o, &nibble) in (0..out).zip(AWQ_NIBBLE.iter().cycle()) {
        for i in 0..inp {
            levels[o * inp + i] = field(qw[i * (out / 8) + o / 8], 4, nibble) as u8;
        }
        for g in 0..groups {
            zeros[g * out + o] = field(qz[g * (out / 8) + o / 8], 4, nibble);
        }
    }
    let scales = store.floats(&format!("{stem}.scales"), &[groups, out])?;
    Ok(Unpacked { bits: 4, levels, zeros, scales, g_idx: plain_groups(inp, group), groups })
}

/// A GPTQ matrix `stem` of `[out, inp]`, `bits` wide, in groups of `group` inputs (or as its
/// `g_idx` says), each stored zero point plus `zero_offset`.
pub(super) fn gptq(
    store: &WeightStore,
    stem: &str,
    (out, inp): (usize, usize),
    (bits, group, zero_offset): (u32, usize, u32),
) -> Result<Unpacked, LoadError> {
    let per = (32 / bits) as usize;
    let groups = inp.div_ceil(group);
    let qw = store.int32s(&format!("{stem}.qweight"), &[inp / per, out])?;
    let qz = store.int32s(&format!("{stem}.qzeros"), &[groups, out / per])?;
    let mut levels = vec![0u8; out * inp];
    let mut zeros = vec![0u32; groups * out];
    let mask = (1u32 << bits) - 1;
    for o in 0..out {
        for i in 0..inp {
            levels[o * inp + i] = field(qw[(i / per) * out + o], bits, i % per) as u8;
        }
        for g in 0..groups {
            let stored = field(qz[g * (out / per) + o / per], bits, o % per);
            zeros[g * out + o] = (stored + zero_offset) & mask;
        }
    }
    let scales = store.floats(&format!("{stem}.scales"), &[groups, out])?;
    let g_idx = groups_of(store, &format!("{stem}.g_idx"), inp, group)?;
    Ok(Unpacked { bits, levels, zeros, scales, g_idx, groups })
}

/// A compressed-tensors matrix `stem` of `[out, inp]`: `pack-quantized` when it has
/// `weight_packed`, else `int-quantized` (an i8 `weight`).
pub(super) fn compressed(
    store: &WeightStore,
    stem: &str,
    (out, inp): (usize, usize),
) -> Result<Unpacked, LoadError> {
    let name = |t: &str| format!("{stem}.{t}");
    let bad = |m: String| LoadError::format(store.path_of(&name("weight_scale")), m);
    let groups = match store.shape(&name("weight_scale")) {
        Some(&[rows, g]) if rows == out && g > 0 && inp.is_multiple_of(g) => g,
        shape => {
            return Err(bad(format!(
                "{stem}.weight_scale has shape {shape:?}: expected [{out}, G] with G dividing \
                 {inp}"
            )));
        }
    };
    let group = inp / groups;
    let by_row = store.floats(&name("weight_scale"), &[out, groups])?;
    let scales = transpose(&by_row, out, groups);
    let (bits, levels, stored_zeros) = if store.contains(&name("weight_packed")) {
        compressed_packed(store, stem, (out, inp), groups)?
    } else {
        compressed_int8(store, stem, (out, inp), groups)?
    };
    let zeros = match stored_zeros {
        Some(by_row) => transpose(&by_row, out, groups),
        None => vec![1 << (bits - 1); groups * out],
    };
    let g_idx = groups_of(store, &name("weight_g_idx"), inp, group)?;
    Ok(Unpacked { bits, levels, zeros, scales, g_idx, groups })
}

/// A matrix's bits, unsigned levels `[out, in]` and zero points `[out, G]` when stored.
type Integers = (u32, Vec<u8>, Option<Vec<u32>>);

/// The [`Integers`] of a `pack-quantized` matrix.
fn compressed_packed(
    store: &WeightStore,
    stem: &str,
    (out, inp): (usize, usize),
    groups: usize,
) -> Result<Integers, LoadError> {
    let name = |t: &str| format!("{stem}.{t}");
    let shape = store.shape(&name("weight_packed")).unwrap_or(&[]);
    let bits = match *shape {
        [rows, words] if rows == out && words * 8 == inp => 4,
        [rows, words] if rows == out && words * 4 == inp => 8,
        _ => {
            return Err(LoadError::format(
                store.path_of(&name("weight_packed")),
                format!(
                    "{stem}.weight_packed has shape {shape:?}: expected [{out}, {}] (4-bit) or \
                     [{out}, {}] (8-bit)",
                    inp / 8,
                    inp / 4
                ),
            ));
        }
    };
    let per = (32 / bits) as usize;
    let words = store.int32s(&name("weight_packed"), &[out, inp / per])?;
    let levels = (0..out * inp).map(|k| field(words[k / per], bits, k % per) as u8).collect();
    let zeros = if store.contains(&name("weight_zero_point")) {
        let zp = store.int32s(&name("weight_zero_point"), &[out / per, groups])?;
        let at = |o: usize, g: usize| field(zp[(o / per) * groups + g], bits, o % per);
        Some((0..out * groups).map(|k| at(k / groups, k % groups)).collect())
    } else {
        None
    };
    Ok((bits, levels, zeros))
}

/// The [`Integers`] of an `int-quantized` (i8) matrix.
fn compressed_int8(
    store: &WeightStore,
    stem: &str,
    (out, inp): (usize, usize),
    groups: usize,
) -> Result<Integers, LoadError> {
    let name = |t: &str| format!("{stem}.{t}");
    let unsigned = |v: i8| (i32::from(v) + 128) as u32;
    let levels = store.int8s(&name("weight"), &[out, inp])?;
    let levels = levels.into_iter().map(|v| unsigned(v) as u8).collect();
    let zeros = if store.contains(&name("weight_zero_point")) {
        let zp = store.int8s(&name("weight_zero_point"), &[out, groups])?;
        Some(zp.into_iter().map(unsigned).collect())
    } else {
        None
    };
    Ok((8, levels, zeros))
}

/// `[cols, rows]` from `[rows, cols]`.
fn transpose<T: Copy>(m: &[T], rows: usize, cols: usize) -> Vec<T> {
    (0..rows * cols).map(|k| m[(k % rows) * cols + k / rows]).collect()
}
