//! `quantization_config` of AWQ, GPTQ and compressed-tensors checkpoints, validated: what
//! kiln cannot read is refused naming the key.

use serde_json::Value;

use super::BLOCK;

/// Which packing a checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedMethod {
    Awq,
    /// `zero_offset`: added to each stored zero point (1 in the original `gptq` format, 0 in
    /// `gptq_v2`).
    Gptq {
        zero_offset: u32,
    },
    /// llm-compressor's `compressed-tensors` (`pack-quantized` W4A16 / W8A16,
    /// `int-quantized` W8A8): each matrix's tensors say its bits and groups.
    CompressedTensors,
}

/// A checkpoint's `quantization_config`, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedQuant {
    pub method: PackedMethod,
    /// 4 or 8 (compressed-tensors: the widest of its config groups).
    pub bits: u32,
    /// Inputs per group; `None`: one group per row (`group_size` −1), or as each matrix's
    /// scales say (compressed-tensors).
    pub group_size: Option<usize>,
}

impl PackedQuant {
    /// Reads `quantization_config`; `Err` names what is not read and what is.
    pub fn from_json(q: &Value) -> Result<Self, String> {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unknown");
        let int = |keys: &[&str]| keys.iter().find_map(|k| q.get(*k)).and_then(Value::as_i64);
        let text = |key: &str| q.get(key).and_then(Value::as_str).map(str::to_ascii_lowercase);
        let flag = |key: &str| q.get(key).and_then(Value::as_bool);
        if method == "compressed-tensors" {
            return compressed_tensors(q);
        }
        if !matches!(method, "awq" | "gptq") {
            return Err(format!(
                "quantized checkpoints of quant_method `{method}` are not supported: kiln reads \
                 `awq`, `gptq` and integer `compressed-tensors` ones, GGUF files, and float \
                 checkpoints (quantized as they load with --quantization q8_0 / q4_k)"
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

/// A `compressed-tensors` config: every config group's weights integer, 4- or 8-bit (8-bit
/// symmetric), by group (multiples of 32) or channel, in the `pack-quantized` layout or (8-bit)
/// `int-quantized`; activations float or dynamic int8 (kiln quantizes them its own way).
fn compressed_tensors(q: &Value) -> Result<PackedQuant, String> {
    // The library writes `{}` for "none".
    let present = |key: &str| {
        q.get(key).is_some_and(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty()))
    };
    for (key, what) in [("sparsity_config", "sparse"), ("transform_config", "transformed")] {
        if present(key) {
            return Err(format!("{what} compressed-tensors checkpoints (`{key}`) are not read"));
        }
    }
    let top_format = q.get("format").and_then(Value::as_str);
    let groups = q
        .get("config_groups")
        .and_then(Value::as_object)
        .filter(|g| !g.is_empty())
        .ok_or("compressed-tensors: missing `config_groups`")?;
    let mut widest = 0;
    for (name, group) in groups {
        let err = |m: String| format!("compressed-tensors group `{name}`: {m}");
        let format = group.get("format").and_then(Value::as_str).or(top_format).unwrap_or("");
        let w = group.get("weights").filter(|w| !w.is_null()).ok_or(err("no `weights`".into()))?;
        let text = |key: &str| w.get(key).and_then(Value::as_str).unwrap_or("");
        let bits = w.get("num_bits").and_then(Value::as_u64).unwrap_or(0);
        let symmetric = w.get("symmetric").and_then(Value::as_bool).unwrap_or(true);
        if text("type") != "int" {
            return Err(err(format!("{} weights are not read (kiln reads int)", text("type"))));
        }
        match (format, bits) {
            ("pack-quantized", 4 | 8) | ("int-quantized" | "naive-quantized", 8) => {}
            _ => {
                return Err(err(format!(
                    "format `{format}` with {bits}-bit weights is not read: kiln reads \
                     pack-quantized 4- and 8-bit and int-quantized 8-bit"
                )));
            }
        }
        if bits == 8 && !symmetric {
            return Err(err("8-bit weights with zero points are not read".into()));
        }
        match text("strategy") {
            "channel" => {}
            "group" => match w.get("group_size").and_then(Value::as_u64) {
                Some(g) if g > 0 && g % BLOCK as u64 == 0 => {}
                g => return Err(err(format!("group_size {g:?} is not a multiple of 32"))),
            },
            other => return Err(err(format!("weight strategy `{other}` is not read"))),
        }
        if w.get("dynamic").and_then(Value::as_bool) == Some(true) {
            return Err(err("dynamic weight quantization is not read".into()));
        }
        if let Some(a) = group.get("input_activations").filter(|a| !a.is_null()) {
            let kind = a.get("type").and_then(Value::as_str).unwrap_or("");
            let abits = a.get("num_bits").and_then(Value::as_u64).unwrap_or(0);
            if kind != "int" || abits != 8 {
                return Err(err(format!(
                    "{kind} {abits}-bit input activations are not read (kiln reads int8 or none)"
                )));
            }
        }
        if group.get("output_activations").is_some_and(|a| !a.is_null()) {
            return Err(err("quantized output activations are not read".into()));
        }
        widest = widest.max(bits as u32);
    }
    Ok(PackedQuant { method: PackedMethod::CompressedTensors, bits: widest, group_size: None })
}
