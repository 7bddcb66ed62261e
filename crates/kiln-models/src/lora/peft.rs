//! PEFT's LoRA format: `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, the modules)
//! and `adapter_model.safetensors`, whose tensors are named
//! `base_model.model.model.layers.{l}.{self_attn|mlp}.{module}.lora_{A|B}.weight` with `A`
//! `[r, k]` and `B` `[n, r]`. The scale is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with
//! rsLoRA. Phi-3's fused `qkv_proj` and `gate_up_proj` are split into their parts ([`LoraModule`]).
//! The tensors, not `target_modules`, say what is adapted; a tensor kiln cannot apply
//! (an embedding or head adapter, a bias, DoRA magnitudes) is refused by name, as is any
//! setting that changes the arithmetic (DoRA, `modules_to_save`, per-module ranks or alphas,
//! trained biases, layer replication).

use std::path::Path;

use serde_json::Value;

use super::{LoraAdapter, LoraMatrix, LoraModule, LoraTarget};
use crate::{LoadError, ModelConfig, WeightStore};

const CONFIG: &str = "adapter_config.json";
const WEIGHTS: &str = "adapter_model.safetensors";
/// Longest `adapter_config.json` read, in bytes.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// What the config says about the arithmetic.
struct Settings {
    rank: usize,
    scale: f32,
}

pub(super) fn load(
    dir: &Path,
    config: &ModelConfig,
    max_rank: usize,
) -> Result<LoraAdapter, LoadError> {
    let settings = settings(&dir.join(CONFIG), max_rank)?;
    let path = dir.join(WEIGHTS);
    if !path.exists() {
        let message = if dir.join("adapter_model.bin").exists() {
            "adapter_model.bin (a pickle) is not read: convert it to adapter_model.safetensors"
        } else {
            "no adapter_model.safetensors"
        };
        return Err(LoadError::format(dir, message));
    }
    let store = WeightStore::open_files(std::slice::from_ref(&path))?;
    let mut adapter = LoraAdapter::empty(config.num_layers);
    let mut names: Vec<String> = store.tensor_sizes().map(|(n, _, _)| n.to_owned()).collect();
    names.sort();
    for name in &names {
        let (layer, module, half) = parse_name(name, config)
            .map_err(|why| LoadError::format(&path, format!("tensor `{name}`: {why}")))?;
        if half == Half::B {
            continue; // read with its A
        }
        let b_name = format!("{}lora_B.weight", &name[..name.len() - "lora_A.weight".len()]);
        let matrix = read_pair(&store, &path, (name, &b_name), module.dims(config), &settings)?;
        module.store(matrix, config, false, &mut adapter.layers[layer]);
    }
    // Every B needs its A.
    for name in names.iter().filter(|n| n.ends_with("lora_B.weight")) {
        let a_name = format!("{}lora_A.weight", &name[..name.len() - "lora_B.weight".len()]);
        if !store.contains(&a_name) {
            return Err(LoadError::MissingTensor { path: path.clone(), name: a_name });
        }
    }
    if adapter.max_rank() == 0 {
        return Err(LoadError::format(&path, "the adapter holds no LoRA matrices"));
    }
    Ok(adapter)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Half {
    A,
    B,
}

/// `(layer, module, A or B)` of a tensor name, or why kiln cannot apply it.
fn parse_name(name: &str, config: &ModelConfig) -> Result<(usize, LoraModule, Half), String> {
    let parts: Vec<&str> = name.split('.').collect();
    let at = parts.iter().position(|p| *p == "layers").ok_or("not a LoRA matrix of a layer")?;
    let [layer, block, module, half, "weight"] = parts[at + 1..] else {
        return Err("not a `layers.{l}.{block}.{module}.lora_{A|B}.weight` tensor".into());
    };
    let half = match half {
        "lora_A" => Half::A,
        "lora_B" => Half::B,
        other => return Err(format!("`{other}` tensors (not LoRA A/B) are not supported")),
    };
    let layer: usize = layer.parse().map_err(|_| format!("layer `{layer}` is not a number"))?;
    if layer >= config.num_layers {
        return Err(format!("layer {layer}, but the model has {} layers", config.num_layers));
    }
    let target = match module {
        "qkv_proj" => Some(LoraModule::QKV),
        "gate_up_proj" => Some(LoraModule::GATE_UP),
        _ => LoraTarget::from_module(module).map(LoraModule::One),
    };
    let target = target.ok_or_else(|| {
        format!(
            "module `{module}` cannot be adapted (supported: q_proj, k_proj, v_proj, o_proj, \
             gate_proj, up_proj, down_proj, and Phi-3's qkv_proj and gate_up_proj)"
        )
    })?;
    let expected_block = if target.is_mlp() { "mlp" } else { "self_attn" };
    if block != expected_block {
        return Err(format!("`{module}` sits under `{expected_block}`, not `{block}`"));
    }
    target.check_layer(layer, config)?;
    Ok((layer, target, half))
}

/// `A` and `B` of one projection, checked and turned into a [`LoraMatrix`].
fn read_pair(
    store: &WeightStore,
    path: &Path,
    (a_name, b_name): (&str, &str),
    (k, n): (usize, usize),
    settings: &Settings,
) -> Result<LoraMatrix, LoadError> {
    let r = settings.rank;
    let shape_err = |name: &str, expected: [usize; 2]| LoadError::Shape {
        path: path.to_path_buf(),
        name: name.to_owned(),
        expected: expected.to_vec(),
        found: store.shape(name).map(<[usize]>::to_vec).unwrap_or_default(),
    };
    if !store.contains(b_name) {
        return Err(LoadError::MissingTensor { path: path.to_path_buf(), name: b_name.to_owned() });
    }
    if store.shape(a_name) != Some(&[r, k][..]) {
        return Err(shape_err(a_name, [r, k]));
    }
    if store.shape(b_name) != Some(&[n, r][..]) {
        return Err(shape_err(b_name, [n, r]));
    }
    let a = finite(store, path, a_name, r, k)?;
    let b = finite(store, path, b_name, n, r)?;
    let mut b_t = vec![0f32; r * n];
    for o in 0..n {
        for j in 0..r {
            b_t[j * n + o] = b[o * r + j] * settings.scale;
        }
    }
    if b_t.iter().any(|v| !v.is_finite()) {
        let message = format!("tensor `{b_name}` overflows f32 once scaled by {}", settings.scale);
        return Err(LoadError::format(path, message));
    }
    Ok(LoraMatrix { rank: r, a, b_t })
}

/// Tensor `name` (`[rows, cols]`) as f32, refused when a value is NaN or infinite.
fn finite(
    store: &WeightStore,
    path: &Path,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, LoadError> {
    let values = store.matrix(name, rows, cols)?.to_f32_vec().ok_or_else(|| {
        LoadError::format(path, format!("tensor `{name}`: dtype not readable as floats"))
    })?;
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(LoadError::format(
            path,
            format!("tensor `{name}` holds {} at element {i}", values[i]),
        ));
    }
    Ok(values)
}

/// Reads `adapter_config.json`: rank and scale, refusing settings kiln does not apply.
fn settings(path: &Path, max_rank: usize) -> Result<Settings, LoadError> {
    let bad = |message: String| LoadError::config(path, message);
    let len = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?.len();
    if len > MAX_CONFIG_BYTES {
        return Err(bad(format!("{len} bytes, more than an adapter config needs")));
    }
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let obj = v.as_object().ok_or_else(|| bad("not a JSON object".into()))?;
    match obj.get("peft_type").and_then(Value::as_str) {
        None | Some("LORA") => {}
        Some(other) => return Err(bad(format!("peft_type `{other}`: only LORA adapters"))),
    }
    let set = |key: &str| obj.get(key).filter(|v| !is_unset(v));
    for (key, what) in [
        ("use_dora", "DoRA"),
        ("modules_to_save", "`modules_to_save` (fully trained copies of modules)"),
        ("rank_pattern", "per-module ranks (`rank_pattern`)"),
        ("alpha_pattern", "per-module alphas (`alpha_pattern`)"),
        ("lora_bias", "trained LoRA biases (`lora_bias`)"),
        ("layer_replication", "`layer_replication`"),
        ("use_qalora", "QA-LoRA"),
        ("alora_invocation_tokens", "activated LoRA (`alora_invocation_tokens`)"),
        ("trainable_token_indices", "`trainable_token_indices`"),
        ("target_parameters", "`target_parameters` (adapters of raw parameters)"),
        ("fan_in_fan_out", "`fan_in_fan_out` (Conv1D weights)"),
    ] {
        if let Some(value) = set(key) {
            return Err(bad(format!("{what} is not supported (`{key}`: {value})")));
        }
    }
    if let Some(bias) = obj.get("bias").and_then(Value::as_str)
        && bias != "none"
    {
        return Err(bad(format!("`bias: {bias}` (trained biases) is not supported")));
    }
    // PEFT's defaults: r 8, lora_alpha 8.
    let rank = match obj.get("r") {
        None => 8,
        Some(r) => r
            .as_u64()
            .filter(|&r| r > 0)
            .and_then(|r| usize::try_from(r).ok())
            .ok_or_else(|| bad(format!("`r` must be a positive integer, got {r}")))?,
    };
    if rank > max_rank {
        return Err(bad(format!("rank {rank} is above --max-lora-rank {max_rank}")));
    }
    let alpha = match obj.get("lora_alpha") {
        None => 8.0,
        Some(a) => a
            .as_f64()
            .filter(|a| a.is_finite())
            .ok_or_else(|| bad(format!("`lora_alpha` must be a number, got {a}")))?,
    };
    let rslora = obj.get("use_rslora").and_then(Value::as_bool).unwrap_or(false);
    let divisor = if rslora { (rank as f64).sqrt() } else { rank as f64 };
    Ok(Settings { rank, scale: (alpha / divisor) as f32 })
}

/// `null`, `false`, `{}`, `[]` or `""`: the setting is off.
fn is_unset(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Object(o) => o.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::String(s) => s.is_empty(),
        Value::Number(_) => false,
    }
}
