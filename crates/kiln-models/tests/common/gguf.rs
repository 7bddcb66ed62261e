//! HF fixtures written as GGUF files the way llama.cpp's converter writes them: its tensor
//! names and metadata keys, Llama's q/k rows permuted for interleaved RoPE, Gemma's norm
//! weights stored as `1 + w`, experts stacked per matrix kind.

use std::path::{Path, PathBuf};

use kiln_models::WeightStore;
use kiln_models::gguf::GgufValue;
use kiln_models::gguf::writer::GgufWriter;
use serde_json::Value;

use super::fixture;

/// llama.cpp's name for an HF tensor name (`sandwich`: Gemma's four norms per layer).
pub fn gguf_name(hf: &str, sandwich: bool) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, leaf) = rest.split_once('.').unwrap();
    let leaf = match leaf {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" if sandwich => "post_attention_norm.weight",
        "post_attention_layernorm.weight" | "pre_feedforward_layernorm.weight" => "ffn_norm.weight",
        "post_feedforward_layernorm.weight" => "post_ffw_norm.weight",
        other => {
            let (module, kind) = other.rsplit_once('.').unwrap();
            let name = match module {
                "self_attn.q_proj" => "attn_q",
                "self_attn.qkv_proj" => "attn_qkv",
                "self_attn.k_proj" => "attn_k",
                "self_attn.v_proj" => "attn_v",
                "self_attn.o_proj" => "attn_output",
                "self_attn.q_norm" => "attn_q_norm",
                "self_attn.k_norm" => "attn_k_norm",
                "mlp.gate_proj" => "ffn_gate",
                // Phi-3's fused `gate_up_proj` is llama.cpp's `ffn_up` too.
                "mlp.up_proj" | "mlp.gate_up_proj" => "ffn_up",
                "mlp.down_proj" => "ffn_down",
                "mlp.gate" | "block_sparse_moe.gate" => "ffn_gate_inp",
                "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
                "mlp.shared_expert.up_proj" => "ffn_up_shexp",
                "mlp.shared_expert.down_proj" => "ffn_down_shexp",
                "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
                m => panic!("unmapped tensor {m}"),
            };
            return format!("blk.{layer}.{name}.{kind}");
        }
    };
    format!("blk.{layer}.{leaf}")
}

/// llama.cpp's `permute` of q/k rows: within each head, the two rotated halves interleave.
pub fn permute_rows(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let hd = rows / heads;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for half in 0..2 {
            for j in 0..hd / 2 {
                let src = h * hd + half * hd / 2 + j;
                let dst = h * hd + 2 * j + half;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// A plain vocabulary: these tests feed token ids, the tokenizer is tested elsewhere.
pub fn write_vocab(w: &mut GgufWriter, src: &Path, vocab_size: usize) {
    let tok: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    let mut tokens = vec![String::new(); vocab_size];
    for (text, id) in tok["model"]["vocab"].as_object().unwrap() {
        tokens[id.as_u64().unwrap() as usize].clone_from(text);
    }
    for (i, t) in tokens.iter_mut().enumerate() {
        if t.is_empty() {
            *t = format!("<unused{i}>");
        }
    }
    w.metadata("tokenizer.ggml.model", GgufValue::String("llama".into())).metadata(
        "tokenizer.ggml.tokens",
        GgufValue::Array(tokens.into_iter().map(GgufValue::String).collect()),
    );
}

/// `cfg`'s hyperparameters as `arch`'s GGUF metadata keys.
pub fn write_config(w: &mut GgufWriter, arch: &str, cfg: &Value) {
    let num = |k: &str| cfg[k].as_u64().unwrap();
    let heads = num("num_attention_heads");
    let kv_heads = num("num_key_value_heads");
    let head_dim = cfg["head_dim"].as_u64().unwrap_or(num("hidden_size") / heads);
    let layers = num("num_hidden_layers");
    let key = |k: &str| format!("{arch}.{k}");
    w.metadata("general.architecture", GgufValue::String(arch.into()))
        .metadata(&key("embedding_length"), GgufValue::U32(num("hidden_size") as u32))
        .metadata(&key("feed_forward_length"), GgufValue::U32(num("intermediate_size") as u32))
        .metadata(&key("block_count"), GgufValue::U32(layers as u32))
        .metadata(&key("attention.head_count"), GgufValue::U32(heads as u32))
        .metadata(&key("attention.head_count_kv"), GgufValue::U32(kv_heads as u32))
        .metadata(&key("attention.key_length"), GgufValue::U32(head_dim as u32))
        .metadata(&key("attention.value_length"), GgufValue::U32(head_dim as u32))
        .metadata(&key("context_length"), GgufValue::U32(num("max_position_embeddings") as u32))
        .metadata(
            &key("attention.layer_norm_rms_epsilon"),
            GgufValue::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32),
        );
    let theta = cfg["rope_theta"]
        .as_f64()
        .or_else(|| cfg["rope_parameters"]["rope_theta"].as_f64())
        .unwrap_or(10_000.0);
    w.metadata(&key("rope.freq_base"), GgufValue::F32(theta as f32));
    // llama.cpp's `rope.dimension_count`: the rotated dimensions (Phi-4-mini's partial factor).
    let partial = cfg["partial_rotary_factor"].as_f64().unwrap_or(1.0);
    let rotary = (head_dim as f64 * partial) as u32;
    w.metadata(&key("rope.dimension_count"), GgufValue::U32(rotary));
    if arch == "gemma3" {
        w.metadata(&key("attention.sliding_window"), GgufValue::U32(num("sliding_window") as u32));
        let sliding = cfg["layer_types"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| GgufValue::Bool(t == "sliding_attention"))
            .collect();
        w.metadata(&key("attention.sliding_window_pattern"), GgufValue::Array(sliding));
    }
    // LongRoPE as llama.cpp's converter writes it: the factors as tensors, the original context
    // and the attention factor as keys.
    let rope = &cfg["rope_scaling"];
    if rope["rope_type"] == "longrope" {
        let original = cfg["original_max_position_embeddings"].as_u64().unwrap();
        let scale = num("max_position_embeddings") as f64 / original as f64;
        let attn_factor = (1.0 + scale.ln() / (original as f64).ln()).sqrt();
        w.metadata(&key("rope.scaling.original_context_length"), GgufValue::U32(original as u32))
            .metadata(&key("rope.scaling.attn_factor"), GgufValue::F32(attn_factor as f32));
        for (name, factors) in [("long", &rope["long_factor"]), ("short", &rope["short_factor"])] {
            let factors: Vec<f32> =
                factors.as_array().unwrap().iter().map(|f| f.as_f64().unwrap() as f32).collect();
            w.tensor_f32(&format!("rope_factors_{name}.weight"), &[factors.len() as u64], &factors);
        }
    }
    // Llama 3's scaling as llama.cpp's converter writes it: per frequency, the divisor
    // transformers applies, as the tensor `rope_freqs.weight`.
    if rope["rope_type"] == "llama3" {
        let num_f = |k: &str| rope[k].as_f64().unwrap();
        let (factor, low, high) =
            (num_f("factor"), num_f("low_freq_factor"), num_f("high_freq_factor"));
        let original = num_f("original_max_position_embeddings");
        let (low_wavelen, high_wavelen) = (original / low, original / high);
        let divisors: Vec<f32> = (0..head_dim / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let divisor = if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    factor
                } else {
                    let smooth = (original / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                divisor as f32
            })
            .collect();
        w.tensor_f32("rope_freqs.weight", &[divisors.len() as u64], &divisors);
    }
    let num_experts = num_experts(cfg);
    if num_experts > 0 {
        w.metadata(&key("expert_count"), GgufValue::U32(num_experts as u32))
            .metadata(&key("expert_used_count"), GgufValue::U32(num("num_experts_per_tok") as u32));
        // Mixtral's experts are `intermediate_size` wide: its files have no expert width key.
        if let Some(width) = cfg["moe_intermediate_size"].as_u64() {
            w.metadata(&key("expert_feed_forward_length"), GgufValue::U32(width as u32));
        }
        if let Some(width) = cfg["shared_expert_intermediate_size"].as_u64() {
            w.metadata(&key("expert_shared_feed_forward_length"), GgufValue::U32(width as u32));
        }
    }
}

/// `num_experts` (Qwen) or `num_local_experts` (Mixtral); 0 for a dense model.
pub fn num_experts(cfg: &Value) -> u64 {
    cfg["num_experts"].as_u64().or(cfg["num_local_experts"].as_u64()).unwrap_or(0)
}

/// Writes `fixture`'s weights and config as a GGUF of architecture `arch`.
pub fn convert(name: &str, arch: &str, dir: &Path) -> PathBuf {
    convert_with(name, arch, dir, &[])
}

/// [`convert`] with more metadata (`{arch}.pooling_type` of an embedding model).
pub fn convert_with(name: &str, arch: &str, dir: &Path, extra: &[(&str, GgufValue)]) -> PathBuf {
    let src = fixture(name);
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let num = |k: &str| cfg[k].as_u64().unwrap();
    let heads = num("num_attention_heads");
    let kv_heads = num("num_key_value_heads");
    let layers = num("num_hidden_layers");
    let gemma = arch == "gemma3";
    let num_experts = num_experts(&cfg);
    let mut w = GgufWriter::new();
    write_config(&mut w, arch, &cfg);
    for (key, value) in extra {
        w.metadata(key, value.clone());
    }
    write_vocab(&mut w, &src, num("vocab_size") as usize);
    let store = WeightStore::open_dir(&src).unwrap();
    for l in 0..layers {
        write_stacked_experts(&mut w, &store, l, num_experts);
    }
    let mut names: Vec<String> =
        vec!["model.embed_tokens.weight".into(), "model.norm.weight".into()];
    if store.contains("lm_head.weight") {
        names.push("lm_head.weight".into());
    }
    let leaves = [
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "self_attn.q_norm",
        "self_attn.k_norm",
    ];
    for l in 0..layers {
        for leaf in leaves {
            names.push(format!("model.layers.{l}.{leaf}.weight"));
        }
        for m in [
            "self_attn.q_proj",
            "self_attn.qkv_proj",
            "mlp.gate_up_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "mlp.gate",
            "block_sparse_moe.gate",
            "mlp.shared_expert.gate_proj",
            "mlp.shared_expert.up_proj",
            "mlp.shared_expert.down_proj",
            "mlp.shared_expert_gate",
        ] {
            names.push(format!("model.layers.{l}.{m}.weight"));
            names.push(format!("model.layers.{l}.{m}.bias"));
        }
    }
    for hf in names.iter().filter(|n| store.contains(n)) {
        let shape = store.shape(hf).unwrap().to_vec();
        let (rows, cols) = if shape.len() == 2 { (shape[0], shape[1]) } else { (1, shape[0]) };
        let mut data = match store.matrix(hf, rows, cols) {
            Ok(m) => m.to_f32_vec().unwrap(),
            Err(_) => store.vector(hf, cols).unwrap(),
        };
        if arch == "llama" && hf.ends_with("q_proj.weight") {
            data = permute_rows(&data, rows, cols, heads as usize);
        }
        if arch == "llama" && hf.ends_with("k_proj.weight") {
            data = permute_rows(&data, rows, cols, kv_heads as usize);
        }
        if gemma && hf.ends_with("norm.weight") {
            for x in &mut data {
                *x += 1.0;
            }
        }
        let mut dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        if hf.ends_with("shared_expert_gate.weight") {
            dims.truncate(1); // llama.cpp's `ffn_gate_inp_shexp` is 1-D
        }
        w.tensor_f32(&gguf_name(hf, gemma), &dims, &data);
    }
    let path = dir.join(format!("{name}.gguf"));
    std::fs::write(&path, w.to_bytes()).unwrap();
    path
}

/// Layer `l`'s experts as llama.cpp stacks them: `ffn_{gate,up,down}_exps.weight`, one tensor
/// per matrix kind holding every expert (ggml dims `[cols, rows, num_experts]`), from Qwen's
/// `mlp.experts.{e}.{gate,up,down}_proj` or Mixtral's `block_sparse_moe.experts.{e}.w{1,3,2}`.
pub fn write_stacked_experts(w: &mut GgufWriter, store: &WeightStore, l: u64, num_experts: u64) {
    let qwen = |e: u64, m: &str| format!("model.layers.{l}.mlp.experts.{e}.{m}.weight");
    let mixtral = |e: u64, m: &str| {
        let w = match m {
            "gate_proj" => "w1",
            "up_proj" => "w3",
            _ => "w2",
        };
        format!("model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight")
    };
    if num_experts == 0 {
        return;
    }
    let expert: &dyn Fn(u64, &str) -> String = if store.contains(&qwen(0, "gate_proj")) {
        &qwen
    } else if store.contains(&mixtral(0, "gate_proj")) {
        &mixtral
    } else {
        return;
    };
    for (m, gguf) in
        [("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")]
    {
        let shape = store.shape(&expert(0, m)).unwrap().to_vec();
        let mut data = Vec::new();
        for e in 0..num_experts {
            data.extend(
                store.matrix(&expert(e, m), shape[0], shape[1]).unwrap().to_f32_vec().unwrap(),
            );
        }
        let dims = [shape[1] as u64, shape[0] as u64, num_experts];
        w.tensor_f32(&format!("blk.{l}.{gguf}.weight"), &dims, &data);
    }
}
