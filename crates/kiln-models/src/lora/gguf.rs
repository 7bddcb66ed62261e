//! llama.cpp's GGUF LoRA files (what its `convert_lora_to_gguf.py` writes and llama-server's
//! `--lora` reads): `general.type` `adapter`, `adapter.type` `lora`, `general.architecture`
//! the base model's, `adapter.lora.alpha`, and per adapted projection two tensors named after
//! the base tensor, `blk.{l}.{attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down}
//! .weight.lora_{a|b}`, with ggml dims `lora_a` `[k, r]` and `lora_b` `[r, n]` (so `[r, k]`
//! and `[n, r]` row-major, PEFT's `A` and `B`), in any ggml type. As in llama.cpp the scale is
//! `alpha / r` with `r` each pair's own rank, or 1 when alpha is 0 (llama-server's
//! `--lora-scaled` multiplies it: [`LoraAdapter::scaled`]).
//! A Llama adapter's q/k `lora_b` rows carry the converter's interleaved-RoPE permutation.
//! Phi-3's fused `attn_qkv` and `ffn_up` (`[gate; up]`) are split into their parts. A tensor
//! kiln cannot apply (the embedding, the output head, expert projections, activated-LoRA
//! metadata) is refused by name.

use std::path::Path;

use kiln_backend::GgmlType;
use kiln_backend::quant::dequantize_row;

use super::{LoraAdapter, LoraMatrix, LoraModule, LoraTarget};
use crate::gguf::{GgufFile, GgufTensorInfo};
use crate::{LoadError, ModelConfig};

pub(super) fn load(
    path: &Path,
    config: &ModelConfig,
    max_rank: usize,
) -> Result<LoraAdapter, LoadError> {
    let file = GgufFile::open(path)?;
    let alpha = check_metadata(&file, config)?;
    let mut adapter = LoraAdapter::empty(config.num_layers);
    let mut names: Vec<&str> = file.tensors().iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    for name in &names {
        let (layer, module, half) = parse_name(name, config)
            .map_err(|why| LoadError::format(path, format!("tensor `{name}`: {why}")))?;
        let base = &name[..name.len() - ".lora_a".len()];
        let other = match half {
            Half::A => format!("{base}.lora_b"),
            Half::B => format!("{base}.lora_a"),
        };
        let Some(other_info) = file.tensor(&other) else {
            return Err(LoadError::MissingTensor { path: path.to_path_buf(), name: other });
        };
        if half == Half::B {
            continue; // read with its lora_a
        }
        let Some(a_info) = file.tensor(name) else { unreachable!("listed above") };
        let mut matrix = read_pair(&file, (a_info, other_info), module.dims(config), max_rank)?;
        let scale = if alpha == 0.0 { 1.0 } else { alpha / matrix.rank as f32 };
        for v in &mut matrix.b_t {
            *v *= scale;
        }
        if let Some(v) = matrix.b_t.iter().find(|v| !v.is_finite()) {
            let message = format!("tensor `{other}` gives {v} once scaled by {scale}");
            return Err(LoadError::format(path, message));
        }
        let permuted = config.architecture.gguf_name() == "llama";
        module.store(matrix, config, permuted, &mut adapter.layers[layer]);
    }
    if adapter.max_rank() == 0 {
        return Err(LoadError::format(path, "the adapter holds no LoRA matrices"));
    }
    Ok(adapter)
}

/// Checks that the file is a LoRA adapter for `config`'s architecture; returns its alpha.
fn check_metadata(file: &GgufFile, config: &ModelConfig) -> Result<f32, LoadError> {
    let bad = |m: String| LoadError::config(file.path(), m);
    match file.str("general.type")? {
        Some("adapter") => {}
        Some(other) => {
            return Err(bad(format!("general.type is `{other}`: not a LoRA adapter file")));
        }
        None => return Err(bad("no general.type: not a LoRA adapter file".into())),
    }
    match file.str("adapter.type")? {
        Some("lora") => {}
        Some(other) => {
            return Err(bad(format!("adapter.type is `{other}`: only LoRA adapters are read")));
        }
        None => return Err(bad("no adapter.type: not a LoRA adapter file".into())),
    }
    let model = config.architecture.gguf_name();
    match file.str("general.architecture")? {
        Some(arch) if arch == model => {}
        Some(arch) => {
            return Err(bad(format!("an adapter for `{arch}` models, but the model is `{model}`")));
        }
        None => return Err(bad("missing `general.architecture`".into())),
    }
    if file.get("adapter.alora.invocation_tokens").is_some() {
        return Err(bad(
            "activated LoRA (`adapter.alora.invocation_tokens`) is not supported".into()
        ));
    }
    let alpha = file.f32("adapter.lora.alpha")?.unwrap_or(0.0);
    if !alpha.is_finite() || alpha < 0.0 {
        return Err(bad(format!("adapter.lora.alpha {alpha} must be a finite number >= 0")));
    }
    Ok(alpha)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Half {
    A,
    B,
}

/// `(layer, module, lora_a or lora_b)` of a tensor name, or why kiln cannot apply it.
fn parse_name(name: &str, config: &ModelConfig) -> Result<(usize, LoraModule, Half), String> {
    let (base, half) = if let Some(base) = name.strip_suffix(".lora_a") {
        (base, Half::A)
    } else if let Some(base) = name.strip_suffix(".lora_b") {
        (base, Half::B)
    } else {
        return Err("not a LoRA tensor (`<base tensor>.lora_a` or `.lora_b`)".into());
    };
    let parts: Vec<&str> = base.split('.').collect();
    let ["blk", layer, module, "weight"] = parts[..] else {
        return Err(format!(
            "`{base}` cannot be adapted (kiln adapts the attention and MLP projections of the \
             layers)"
        ));
    };
    let layer: usize = layer.parse().map_err(|_| format!("layer `{layer}` is not a number"))?;
    if layer >= config.num_layers {
        return Err(format!("layer {layer}, but the model has {} layers", config.num_layers));
    }
    // Phi-3's GGUF keeps its fused matrices: `attn_qkv`, and `ffn_up` holding [gate; up].
    let phi3 = config.architecture.gguf_name() == "phi3";
    let target = match module {
        "attn_q" => LoraModule::One(LoraTarget::Q),
        "attn_k" => LoraModule::One(LoraTarget::K),
        "attn_v" => LoraModule::One(LoraTarget::V),
        "attn_qkv" if phi3 => LoraModule::QKV,
        "attn_output" => LoraModule::One(LoraTarget::O),
        "ffn_gate" => LoraModule::One(LoraTarget::Gate),
        "ffn_up" if phi3 => LoraModule::GATE_UP,
        "ffn_up" => LoraModule::One(LoraTarget::Up),
        "ffn_down" => LoraModule::One(LoraTarget::Down),
        other => {
            return Err(format!(
                "`{other}` cannot be adapted (supported: attn_q, attn_k, attn_v, attn_output, \
                 ffn_gate, ffn_up, ffn_down, and Phi-3's attn_qkv)"
            ));
        }
    };
    target.check_layer(layer, config)?;
    Ok((layer, target, half))
}

/// `lora_a` and `lora_b` of one projection of width `(k, n)`, checked and turned into a
/// [`LoraMatrix`] (unscaled).
fn read_pair(
    file: &GgufFile,
    (a, b): (&GgufTensorInfo, &GgufTensorInfo),
    (k, n): (usize, usize),
    max_rank: usize,
) -> Result<LoraMatrix, LoadError> {
    let path = file.path();
    let shape_err = |info: &GgufTensorInfo, expected: Vec<usize>| LoadError::Shape {
        path: path.to_path_buf(),
        name: info.name.clone(),
        expected,
        found: info.dims.iter().rev().map(|&d| d as usize).collect(),
    };
    // ggml dims, innermost first: lora_a [k, r], lora_b [r, n].
    let [a_k, r] = a.dims[..] else { return Err(shape_err(a, vec![0, k])) };
    let r = usize::try_from(r).unwrap_or(usize::MAX);
    if a_k != k as u64 || r == 0 {
        return Err(shape_err(a, vec![r, k]));
    }
    if r > max_rank {
        let m = format!("tensor `{}`: rank {r} is above the limit of {max_rank}", a.name);
        return Err(LoadError::format(path, m));
    }
    if b.dims != [r as u64, n as u64] {
        return Err(shape_err(b, vec![n, r]));
    }
    let a_values = finite_rows(file, a, r, k)?;
    let b_values = finite_rows(file, b, n, r)?;
    let mut b_t = vec![0f32; r * n];
    for o in 0..n {
        for j in 0..r {
            b_t[j * n + o] = b_values[o * r + j];
        }
    }
    Ok(LoraMatrix { rank: r, a: a_values, b_t })
}

/// Tensor `info` (`[rows, cols]`, any ggml type) as f32, refused when a value is not finite.
fn finite_rows(
    file: &GgufFile,
    info: &GgufTensorInfo,
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, LoadError> {
    let err = |m: String| LoadError::format(file.path(), format!("tensor `{}`: {m}", info.name));
    let ty = GgmlType::from_gguf_id(info.type_id)
        .ok_or_else(|| err(format!("unsupported type {}", info.type_id)))?;
    let row_bytes = ty
        .row_bytes(cols)
        .filter(|b| b.checked_mul(rows) == Some(info.num_bytes))
        .ok_or_else(|| err(format!("{} bytes do not hold [{rows}, {cols}]", info.num_bytes)))?;
    let bytes = file.tensor_bytes(info);
    let mut values = vec![0f32; rows * cols];
    for (src, dst) in bytes.chunks_exact(row_bytes).zip(values.chunks_exact_mut(cols)) {
        dequantize_row(ty, src, dst);
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(err(format!("holds {} at element {i}", values[i])));
    }
    Ok(values)
}
