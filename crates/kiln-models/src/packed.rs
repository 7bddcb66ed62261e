//! AWQ and GPTQ checkpoints: Hugging Face directories whose linear layers are stored as packed
//! integer weights (`qweight`, `qzeros`, `scales`, GPTQ's `g_idx`) instead of `weight`.
//!
//! They are read as GGUF block types, repacked at load (never widened to float), so every
//! backend runs them with the kernels it has for those types, and every weight is exactly
//! the checkpoint's `s·(q − z)`:
//! - 4-bit with zero points `z`: `q − z` lies in −15..=15, so `w = s·((q − z + 16) − 16)` is
//!   `Q5_0` (`d = s`; 5.5 bits a weight, where `Q4_1`'s f16 min `−s·z` would round);
//! - 4-bit whose every zero point is 8 (GPTQ `sym`): `w = s·(q − 8)` is `Q4_0`;
//! - 8-bit whose every zero point is 128 (GPTQ `sym`): `w = s·(q − 128)` is `Q8_0`.
//!
//! The scale is stored as f16: exact for the f16 scales checkpoints store (bf16 and f32 ones
//! round to f16).
//!
//! Layouts (`in` = input features, `out` = output features, `G` = groups = ⌈in / group⌉):
//! - AWQ (`version` `gemm`): `qweight` i32 `[in, out/8]`: nibble `AWQ_NIBBLE[j]` of
//!   `qweight[i][c]` is column `8c + j`; `qzeros` i32 `[G, out/8]` likewise; `scales` `[G, out]`.
//! - GPTQ: `qweight` i32 `[in·bits/32, out]`, input `i` in bits `bits·(i mod 32/bits)` of row
//!   `i / (32/bits)`; `qzeros` i32 `[G, out·bits/32]` packed the same way along `out`, holding
//!   `z − 1` in the original (`gptq`) format and `z` in `gptq_v2`; `scales` `[G, out]`; `g_idx`
//!   i32 `[in]`, the group of each input.
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

/// Input features per GGUF block.
const BLOCK: usize = 32;
/// AWQ's packing order: column `8c + j` sits in nibble `AWQ_NIBBLE[j]` of word `c`.
const AWQ_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// Which packing a checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedMethod {
    Awq,
    /// `zero_offset`: added to each stored zero point (1 in the original `gptq` format, 0 in
    /// `gptq_v2`).
    Gptq {
        zero_offset: u32,
    },
}

/// A checkpoint's `quantization_config`, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedQuant {
    pub method: PackedMethod,
    /// 4 or 8.
    pub bits: u32,
    /// Inputs per group; `None`: one group per row (`group_size` −1).
    pub group_size: Option<usize>,
}

impl PackedQuant {
    /// The method's name as `quant_method` and `--quantization` spell it.
    pub fn method_name(&self) -> &'static str {
        match self.method {
            PackedMethod::Awq => "awq",
            PackedMethod::Gptq { .. } => "gptq",
        }
    }

    /// Reads `quantization_config`; `Err` names what is not read and what is.
    pub fn from_json(q: &Value) -> Result<Self, String> {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unknown");
        let int = |keys: &[&str]| keys.iter().find_map(|k| q.get(*k)).and_then(Value::as_i64);
        let text = |key: &str| q.get(key).and_then(Value::as_str).map(str::to_ascii_lowercase);
        let flag = |key: &str| q.get(key).and_then(Value::as_bool);
        if !matches!(method, "awq" | "gptq") {
            return Err(format!(
                "quantized checkpoints of quant_method `{method}` are not supported: kiln reads \
                 `awq` and `gptq` ones, GGUF files, and float checkpoints (quantized as they \
                 load with --quantization q8_0 / q4_k)"
            ));
        }
        let bits = int(&["bits", "w_bit"]).ok_or(format!("{method}: missing `bits`"))?;
        let group = int(&["group_size", "q_group_size"]).unwrap_or(-1);
        let method = match method {
            "awq" => {
                if let Some(v) = text("version").filter(|v| v != "gemm") {
                    return Err(format!(
                        "AWQ version `{v}` is not read: kiln reads the `gemm` layout (AutoAWQ's \
                         default)"
                    ));
                }
                if flag("zero_point") == Some(false) {
                    return Err("AWQ without zero points (`zero_point: false`) is not read".into());
                }
                if bits != 4 {
                    return Err(format!("AWQ with {bits} bits is not read: AWQ is 4-bit"));
                }
                PackedMethod::Awq
            }
            "gptq" => {
                let zero_offset = match text("checkpoint_format").as_deref() {
                    None | Some("gptq") => 1,
                    Some("gptq_v2") => 0,
                    Some(other) => {
                        return Err(format!(
                            "GPTQ checkpoint_format `{other}` is not read: kiln reads `gptq` \
                             and `gptq_v2`"
                        ));
                    }
                };
                if let Some(d) = text("pack_dtype").filter(|d| !d.ends_with("int32")) {
                    return Err(format!("GPTQ pack_dtype `{d}` is not read: kiln reads int32"));
                }
                if bits != 4 && bits != 8 {
                    return Err(format!("GPTQ with {bits} bits is not read: kiln reads 4 and 8"));
                }
                if bits == 8 && flag("sym") == Some(false) {
                    return Err("8-bit GPTQ with zero points (`sym: false`) is not read: \
                                kiln reads 8-bit `sym: true`"
                        .into());
                }
                PackedMethod::Gptq { zero_offset }
            }
            other => return Err(format!("quant_method `{other}`")),
        };
        let group_size = match group {
            -1 => None,
            g if g > 0 && g % BLOCK as i64 == 0 => Some(g as usize),
            g => {
                return Err(format!(
                    "group_size {g} is not read: kiln reads -1 and multiples of 32"
                ));
            }
        };
        Ok(Self { method, bits: bits as u32, group_size })
    }
}

/// A [`WeightStore`] whose `X.weight` matrices are read from `X.qweight` and its companions
/// where the checkpoint packed them (the others, such as embeddings and the head, are float).
pub(crate) struct PackedWeights<'a> {
    pub inner: &'a WeightStore,
    pub quant: PackedQuant,
}

impl PackedWeights<'_> {
    /// The packed tensors' common prefix when `name` is a packed matrix.
    fn stem<'n>(&self, name: &'n str) -> Option<&'n str> {
        let stem = name.strip_suffix(".weight")?;
        self.inner.contains(&format!("{stem}.qweight")).then_some(stem)
    }

    /// Reads the packed `[rows = out, cols = in]` matrix `stem` and repacks it, its columns
    /// sorted by group when `g_idx` is an act order (then with that order: column `j` is input
    /// `order[j]`).
    fn unpack(
        &self,
        stem: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(HostTensor, Option<Vec<usize>>), LoadError> {
        let (out, inp) = (rows, cols);
        let bad = |m: String| LoadError::format(self.inner.path_of(&format!("{stem}.qweight")), m);
        if !inp.is_multiple_of(BLOCK) {
            return Err(bad(format!("{stem}: {inp} inputs are not a multiple of {BLOCK}")));
        }
        let per_word = (32 / self.quant.bits) as usize;
        if !out.is_multiple_of(per_word) {
            return Err(bad(format!("{stem}: {out} outputs are not a multiple of {per_word}")));
        }
        let group = self.quant.group_size.unwrap_or(inp);
        let groups = inp.div_ceil(group);
        let name = |t: &str| format!("{stem}.{t}");
        let scales = self.inner.floats(&name("scales"), &[groups, out])?;
        let levels = Levels::read(self, stem, out, inp, groups)?;
        let g_idx = match self.inner.try_int32s(&name("g_idx"), &[inp])? {
            Some(g_idx) => g_idx,
            None => (0..inp).map(|i| (i / group) as i32).collect(),
        };
        let (order, block_groups) =
            group_order(&g_idx, groups).map_err(|m| bad(format!("{stem}.g_idx: {m}")))?;
        let centre = 1u32 << (self.quant.bits - 1);
        let symmetric = levels.zeros.iter().all(|&z| z == centre);
        let ty = match (self.quant.bits, symmetric) {
            (4, true) => GgmlType::Q4_0,
            (4, false) => GgmlType::Q5_0,
            (8, true) => GgmlType::Q8_0,
            _ => {
                return Err(bad(format!(
                    "{stem}: 8-bit zero points other than {centre} are not read (sym: true only)"
                )));
            }
        };
        let row_bytes = ty.row_bytes(inp).ok_or_else(|| bad(format!("{stem}: row size")))?;
        let mut bytes = Vec::with_capacity(out * row_bytes);
        let mut q = [0u8; BLOCK];
        for o in 0..out {
            for (b, &g) in block_groups.iter().enumerate() {
                let (s, z) = (scales[g * out + o], levels.zeros[g * out + o]);
                for (k, v) in q.iter_mut().enumerate() {
                    let j = b * BLOCK + k;
                    *v = levels.weight(o, order.as_ref().map_or(j, |order| order[j]));
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

/// A matrix's integer levels and zero points, unpacked.
struct Levels {
    /// `[out, in]`, each in `0..2^bits`.
    weights: Vec<u8>,
    /// `[G, out]`, each in `0..2^bits`.
    zeros: Vec<u32>,
    inp: usize,
}

impl Levels {
    fn read(
        p: &PackedWeights<'_>,
        stem: &str,
        out: usize,
        inp: usize,
        groups: usize,
    ) -> Result<Self, LoadError> {
        let bits = p.quant.bits;
        let per_word = (32 / bits) as usize;
        let mask = (1u32 << bits) - 1;
        let field = |word: i32, k: usize| (word as u32 >> (bits as usize * k)) & mask;
        let name = |t: &str| format!("{stem}.{t}");
        let mut weights = vec![0u8; out * inp];
        let mut zeros = vec![0u32; groups * out];
        match p.quant.method {
            PackedMethod::Awq => {
                let qw = p.inner.int32s(&name("qweight"), &[inp, out / 8])?;
                let qz = p.inner.int32s(&name("qzeros"), &[groups, out / 8])?;
                for (o, &nibble) in (0..out).zip(AWQ_NIBBLE.iter().cycle()) {
                    for i in 0..inp {
                        weights[o * inp + i] = field(qw[i * (out / 8) + o / 8], nibble) as u8;
                    }
                    for g in 0..groups {
                        zeros[g * out + o] = field(qz[g * (out / 8) + o / 8], nibble);
                    }
                }
            }
            PackedMethod::Gptq { zero_offset } => {
                let qw = p.inner.int32s(&name("qweight"), &[inp / per_word, out])?;
                let qz = p.inner.int32s(&name("qzeros"), &[groups, out / per_word])?;
                for o in 0..out {
                    for i in 0..inp {
                        weights[o * inp + i] =
                            field(qw[(i / per_word) * out + o], i % per_word) as u8;
                    }
                    for g in 0..groups {
                        let stored = field(qz[g * (out / per_word) + o / per_word], o % per_word);
                        zeros[g * out + o] = (stored + zero_offset) & mask;
                    }
                }
            }
        }
        Ok(Self { weights, zeros, inp })
    }

    fn weight(&self, o: usize, i: usize) -> u8 {
        self.weights[o * self.inp + i]
    }
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
            Some(stem) => self.unpack(stem, rows, cols),
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
