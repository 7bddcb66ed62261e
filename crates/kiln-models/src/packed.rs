//! Packed integer checkpoints: Hugging Face directories whose linear layers are stored as
//! packed integers and scales instead of a float `weight`: AWQ and GPTQ (`qweight`, `qzeros`,
//! `scales`, GPTQ's `g_idx`) and llm-compressor's compressed-tensors (`weight_packed` or an i8
//! `weight`, `weight_scale`, `weight_zero_point`, `weight_g_idx`); [`layouts`] reads each.
//!
//! They are read as GGUF block types, repacked at load (never widened to float), so every
//! backend runs them with the kernels it has for those types, and every weight is exactly
//! the checkpoint's `s·(q − z)`:
//! - 4-bit with zero points `z`: `q − z` lies in −15..=15, so `w = s·((q − z + 16) − 16)` is
//!   `Q5_0` (`d = s`; 5.5 bits a weight, where `Q4_1`'s f16 min `−s·z` would round);
//! - 4-bit whose every zero point is 8 (symmetric): `w = s·(q − 8)` is `Q4_0`;
//! - 8-bit whose every zero point is 128 (symmetric): `w = s·(q − 128)` is `Q8_0`.
//!
//! The scale is stored as f16: exact for the f16 scales AWQ and GPTQ store and for bf16 ones
//! in f16's normal range; f32 ones round to f16.
//!
//! Invariant: a block of 32 columns lies in one group (group sizes are multiples of 32). An
//! act-order checkpoint (`desc_act`: `g_idx` numbers the groups in the order GPTQ quantized the
//! inputs) has its columns sorted by group at load; the matrix then comes with that order
//! ([`WeightSource::ordered_matrix`]) and the model permutes its input to match, so
//! `W · x = W_sorted · x[order]`. Plain [`WeightSource::matrix`] refuses such a matrix.

use std::path::Path;

use half::f16;
use kiln_backend::{GgmlType, HostTensor};
use serde_json::Value;

use crate::weights::WeightSource;
use crate::{LoadError, WeightStore};

mod config;
mod layouts;

pub use config::{PackedMethod, PackedQuant};

/// Input features per GGUF block.
pub(crate) const BLOCK: usize = 32;

/// A [`WeightStore`] whose `X.weight` matrices are read from their packed tensors where the
/// checkpoint packed them (the others, such as embeddings and the head, are float).
pub(crate) struct PackedWeights<'a> {
    pub inner: &'a WeightStore,
    pub quant: PackedQuant,
}

/// Which layout a packed matrix is stored in.
#[derive(Clone, Copy)]
enum Stored {
    /// `X.qweight` and companions.
    AwqOrGptq,
    /// `X.weight_packed` or an i8 `X.weight`, with `X.weight_scale`.
    Compressed,
}

impl PackedWeights<'_> {
    /// The packed tensors' common prefix when `name` is a packed matrix.
    fn stem<'n>(&self, name: &'n str) -> Option<(&'n str, Stored)> {
        let stem = name.strip_suffix(".weight")?;
        let has = |t: &str| self.inner.contains(&format!("{stem}.{t}"));
        match self.quant.method {
            PackedMethod::Awq | PackedMethod::Gptq { .. } => {
                has("qweight").then_some((stem, Stored::AwqOrGptq))
            }
            PackedMethod::CompressedTensors => (has("weight_packed")
                || has("weight_scale") && self.inner.is_int8(name))
            .then_some((stem, Stored::Compressed)),
        }
    }

    /// Reads the packed `[rows = out, cols = in]` matrix `stem` and repacks it, its columns
    /// sorted by group when `g_idx` is an act order (then with that order: column `j` is input
    /// `order[j]`).
    fn unpack(
        &self,
        (stem, stored): (&str, Stored),
        rows: usize,
        cols: usize,
    ) -> Result<(HostTensor, Option<Vec<usize>>), LoadError> {
        let (out, inp) = (rows, cols);
        let bad = |m: String| LoadError::format(self.inner.path_of(&format!("{stem}.weight")), m);
        if !inp.is_multiple_of(BLOCK) || !out.is_multiple_of(8) {
            return Err(bad(format!("{stem}: [{out}, {inp}] is not a multiple of [8, {BLOCK}]")));
        }
        let group = self.quant.group_size.unwrap_or(inp);
        let m = match (stored, self.quant.method) {
            (Stored::AwqOrGptq, PackedMethod::Gptq { zero_offset }) => {
                layouts::gptq(self.inner, stem, (out, inp), (self.quant.bits, group, zero_offset))?
            }
            (Stored::AwqOrGptq, _) => layouts::awq(self.inner, stem, (out, inp), group)?,
            (Stored::Compressed, _) => layouts::compressed(self.inner, stem, (out, inp))?,
        };
        let (order, block_groups) =
            group_order(&m.g_idx, m.groups).map_err(|e| bad(format!("{stem} groups: {e}")))?;
        let centre = 1u32 << (m.bits - 1);
        let symmetric = m.zeros.iter().all(|&z| z == centre);
        let ty = match (m.bits, symmetric) {
            (4, true) => GgmlType::Q4_0,
            (4, false) => GgmlType::Q5_0,
            (8, true) => GgmlType::Q8_0,
            _ => {
                return Err(bad(format!(
                    "{stem}: 8-bit zero points other than {centre} are not read (symmetric only)"
                )));
            }
        };
        let row_bytes = ty.row_bytes(inp).ok_or_else(|| bad(format!("{stem}: row size")))?;
        let mut bytes = Vec::with_capacity(out * row_bytes);
        let mut q = [0u8; BLOCK];
        for o in 0..out {
            for (b, &g) in block_groups.iter().enumerate() {
                let (s, z) = (m.scales[g * out + o], m.zeros[g * out + o]);
                for (k, v) in q.iter_mut().enumerate() {
                    let j = b * BLOCK + k;
                    *v = m.levels[o * inp + order.as_ref().map_or(j, |order| order[j])];
                }
                bytes.extend_from_slice(&f16::from_f32(s).to_le_bytes());
                match ty {
                    // q − 128 as i8.
                    GgmlType::Q8_0 => bytes.extend(q.iter().map(|&v| v ^ 0x80)),
                    // q − z + 16 in 1..=31: Q5_0's five bits, the fifth in `qh`.
                    GgmlType::Q5_0 => {
                        for v in &mut q {
                            *v = (u32::from(*v) + 16 - z) as u8;
                        }
                        let qh = (0..BLOCK).fold(0u32, |h, j| h | u32::from(q[j] >> 4) << j);
                        bytes.extend_from_slice(&qh.to_le_bytes());
                        bytes.extend(
                            (0..BLOCK / 2).map(|j| q[j] & 15 | (q[j + BLOCK / 2] & 15) << 4),
                        );
                    }
                    _ => bytes.extend((0..BLOCK / 2).map(|j| q[j] | (q[j + BLOCK / 2] << 4))),
                }
            }
        }
        let tensor = HostTensor::new(ty, out, inp, bytes.into())
            .ok_or_else(|| bad(format!("{stem}: size")))?;
        Ok((tensor, order))
    }
}

/// The column order that makes `g_idx`'s groups contiguous (`None` when they already are:
/// input `i` in group `i / group`), and the group of each block of 32 columns in that order.
/// Act-order checkpoints (`desc_act`) number the groups in the order GPTQ quantized the
/// inputs, so sorting the inputs by group (stably) gives whole groups; every block of 32
/// sorted inputs must then lie in one group.
fn group_order(g_idx: &[i32], groups: usize) -> Result<(Option<Vec<usize>>, Vec<usize>), String> {
    let group_of = |i: usize| -> Result<usize, String> {
        usize::try_from(g_idx[i])
            .ok()
            .filter(|&g| g < groups)
            .ok_or_else(|| format!("input {i} is in group {}, outside 0..{groups}", g_idx[i]))
    };
    let mut order: Vec<usize> = (0..g_idx.len()).collect();
    let keys = (0..g_idx.len()).map(group_of).collect::<Result<Vec<_>, _>>()?;
    order.sort_by_key(|&i| keys[i]);
    let mut block_groups = Vec::with_capacity(g_idx.len() / BLOCK);
    for (b, block) in order.chunks_exact(BLOCK).enumerate() {
        let (first, last) = (keys[block[0]], keys[block[BLOCK - 1]]);
        if first != last {
            return Err(format!(
                "inputs {}..{} in group order span groups {first} to {last}: kiln needs each \
                 group to be whole blocks of {BLOCK} inputs",
                b * BLOCK,
                (b + 1) * BLOCK
            ));
        }
        block_groups.push(first);
    }
    let sorted = order.iter().enumerate().all(|(j, &i)| i == j);
    Ok(((!sorted).then_some(order), block_groups))
}

impl WeightSource for PackedWeights<'_> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostTensor, LoadError> {
        match self.ordered_matrix(name, rows, cols)? {
            (tensor, None) => Ok(tensor),
            (_, Some(_)) => Err(LoadError::format(
                self.inner.path_of(name),
                format!(
                    "`{name}` is act-order (desc_act) GPTQ, which kiln reads for the attention \
                     and dense MLP matrices only (not experts)"
                ),
            )),
        }
    }

    fn ordered_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(HostTensor, Option<Vec<usize>>), LoadError> {
        match self.stem(name) {
            Some(packed) => self.unpack(packed, rows, cols),
            None => Ok((self.inner.matrix(name, rows, cols)?, None)),
        }
    }

    fn expert_matrix(
        &self,
        name: &str,
        expert: (usize, usize),
        rows: usize,
        cols: usize,
    ) -> Result<HostTensor, LoadError> {
        WeightSource::expert_matrix(self.inner, name, expert, rows, cols)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        self.inner.vector(name, len)
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name) || self.stem(name).is_some()
    }
}

/// How many bytes more than its files a packed checkpoint in `dir` takes once repacked (0 for
/// any other model): a 4-bit matrix's 4 bits become at most `Q5_0`'s 5.5, an 8-bit one's
/// `Q8_0`'s 8.5; the scales and zero points' bytes, dropped, are not counted off.
pub fn repack_growth_bytes(dir: &Path) -> Result<u64, LoadError> {
    let config = dir.join("config.json");
    if !dir.is_dir() || !config.exists() {
        return Ok(0);
    }
    let Some(quant) = crate::ModelConfig::from_file(&config)?.packed else { return Ok(0) };
    let store = WeightStore::open_dir(dir)?;
    let packed = |name: &str| name.ends_with(".qweight") || name.ends_with(".weight_packed");
    let growth = store
        .tensor_sizes()
        .map(|(name, bytes, int8)| match (packed(name), int8, quant.bits) {
            (true, _, 4) => bytes * 3 / 8,
            (true, ..) | (false, true, _) => bytes / 16,
            _ => 0,
        })
        .sum::<usize>();
    Ok(growth as u64)
}

/// Whether the directory's `config.json` names a packed checkpoint of `method`; for
/// `--quantization awq|gptq`, which must match the checkpoint as vLLM's does.
pub fn check_method(dir: &Path, method: &str) -> Result<(), LoadError> {
    let config = dir.join("config.json");
    let stated = std::fs::read_to_string(&config)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|j| {
            j.get("quantization_config")?.get("quant_method")?.as_str().map(String::from)
        });
    match stated {
        Some(m) if m == method => Ok(()),
        Some(m) => Err(LoadError::config(
            &config,
            format!("--quantization {method} was asked but the checkpoint is `{m}`"),
        )),
        None => Err(LoadError::config(
            &config,
            format!(
                "--quantization {method} was asked but the checkpoint has no \
                 quantization_config of that method"
            ),
        )),
    }
}

#[cfg(test)]
mod tests;
