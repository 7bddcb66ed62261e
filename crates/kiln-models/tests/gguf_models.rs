//! GGUF models: the HF fixtures converted to GGUF the way llama.cpp's converter does it (its
//! tensor names and metadata keys, Llama's q/k rows permuted for interleaved RoPE, Gemma's
//! norm weights stored as `1 + w`), loaded through the GGUF path, must give transformers'
//! logits. And quantize-on-load (`q8_0`, `q5_0`, `q4_K`) must stay close to them.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::path::{Path, PathBuf};

use common::{Runner, argmax, assert_rows_close, cases, cpu, fixture, max_abs_diff};
use kiln_kernels::GgmlType;
use kiln_models::gguf::GgufValue;
use kiln_models::gguf::writer::GgufWriter;
use kiln_models::{LoadOptions, WeightStore, load_model, load_model_with};
use serde_json::Value;

/// Max |ours - transformers| on f32 logits (as in hf_parity).
const LOGIT_TOLERANCE: f32 = 1e-3;

/// llama.cpp's name for an HF tensor name (`sandwich`: Gemma's four norms per layer).
fn gguf_name(hf: &str, sandwich: bool) -> String {
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
fn permute_rows(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
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
fn write_vocab(w: &mut GgufWriter, src: &Path, vocab_size: usize) {
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
fn write_config(w: &mut GgufWriter, arch: &str, cfg: &Value) {
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
fn num_experts(cfg: &Value) -> u64 {
    cfg["num_experts"].as_u64().or(cfg["num_local_experts"].as_u64()).unwrap_or(0)
}

/// Writes `fixture`'s weights and config as a GGUF of architecture `arch`.
fn convert(name: &str, arch: &str, dir: &Path) -> PathBuf {
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
fn write_stacked_experts(w: &mut GgufWriter, store: &WeightStore, l: u64, num_experts: u64) {
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

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-gguf-models-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn converted_fixtures_match_transformers() {
    let dir = temp_dir("convert");
    for (name, arch) in [
        ("llama2", "llama"),
        ("qwen2", "qwen2"),
        ("qwen3", "qwen3"),
        ("qwen3moe", "qwen3moe"),
        ("qwen2moe", "qwen2moe"),
        ("mixtral", "llama"),
        ("gemma3", "gemma3"),
        ("phi3", "phi3"),
        ("phi3long", "phi3"),
        ("phi4mini", "phi3"),
    ] {
        let path = convert(name, arch, &dir);
        let mut runner = Runner::with(load_model(&path, &cpu()).unwrap());
        for (i, case) in cases(name, Some(runner.vocab())).iter().enumerate() {
            let tokens: Vec<u32> =
                case.prompt_ids.iter().chain(&case.greedy_ids).copied().collect();
            let got = runner.one_shot(&tokens);
            assert_rows_close(
                &got,
                &case.logits,
                LOGIT_TOLERANCE,
                &format!("{name}.gguf case {i}"),
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Max |Δ logit| against transformers and the share of positions whose argmax agrees, over
/// every reference case of `name` loaded with `ty` quantize-on-load.
fn quantized_error(name: &str, ty: GgmlType) -> (f32, f64) {
    let options = LoadOptions { quantization: Some(ty) };
    let mut runner = Runner::with(load_model_with(&fixture(name), &options, &cpu()).unwrap());
    let (mut worst, mut agree, mut total) = (0.0f32, 0usize, 0usize);
    for case in cases(name, Some(runner.vocab())) {
        let tokens: Vec<u32> = case.prompt_ids.iter().chain(&case.greedy_ids).copied().collect();
        for (g, w) in runner.one_shot(&tokens).iter().zip(&case.logits) {
            worst = worst.max(max_abs_diff(g, w));
            agree += usize::from(argmax(g) == argmax(w));
            total += 1;
        }
    }
    (worst, agree as f64 / total as f64)
}

/// The fixtures are random-weight models with logits of standard deviation 16, chaotic enough
/// that bf16 rounding alone moves a logit by 3: so this checks that every quantization type
/// loads and runs, that the error grows as bits shrink, and that predictions stay far from
/// chance (1 in 500). Quantized kernels are checked exactly in kiln-kernels; the default
/// model's test checks quantized quality on a real model.
#[test]
fn quantize_on_load_degrades_gracefully() {
    for name in ["llama3", "qwen3", "gemma3"] {
        let (f16_err, f16_agree) = quantized_error(name, GgmlType::F16);
        let (q8_err, q8_agree) = quantized_error(name, GgmlType::Q8_0);
        let (q5_err, q5_agree) = quantized_error(name, GgmlType::Q5_0);
        // 64-wide rows are no multiple of 256: q4_K falls back to q5_0, as llama.cpp does.
        let (q4k_err, _) = quantized_error(name, GgmlType::Q4K);
        eprintln!(
            "{name}: max |dlogit| f16 {f16_err:.3}, q8_0 {q8_err:.3}, q5_0 {q5_err:.3}; argmax \
             agreement f16 {f16_agree:.3}, q8_0 {q8_agree:.3}, q5_0 {q5_agree:.3}"
        );
        assert!(f16_err <= 0.5 && f16_agree == 1.0, "{name} f16");
        assert!(f16_err < q8_err && q8_err < q5_err, "{name}: error must grow as bits shrink");
        assert!(q8_agree >= 0.85 && q5_agree >= 0.4, "{name}: agreement");
        assert_eq!(q4k_err, q5_err, "{name}: q4_K falls back to q5_0 on 64-wide rows");
    }
}

/// How a test spoils a split model.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Spoil {
    Nothing,
    /// The last file says it is the one before it.
    WrongNumber,
    /// The second file repeats a tensor of the first.
    RepeatedTensor,
    /// The total in `split.tensors.count` is wrong.
    WrongTotal,
}

/// `single` rewritten as `count` files the way llama.cpp's `gguf-split` writes them: the
/// metadata in the first, `split.no` / `split.count` / `split.tensors.count` in each, the
/// tensors dealt out in order.
fn split(single: &Path, count: u16, dir: &Path, spoil: Spoil) -> Vec<PathBuf> {
    let file = kiln_models::gguf::GgufFile::open(single).unwrap();
    let tensors = file.tensors();
    let per_file = tensors.len().div_ceil(usize::from(count));
    (0..count)
        .map(|no| {
            let mut w = GgufWriter::new();
            if no == 0 {
                for (key, value) in file.metadata() {
                    w.metadata(key, value.clone());
                }
            }
            let said_no = if spoil == Spoil::WrongNumber && no == count - 1 { no - 1 } else { no };
            let total = if spoil == Spoil::WrongTotal { 1 } else { tensors.len() as i32 };
            w.metadata("split.no", GgufValue::U16(said_no))
                .metadata("split.count", GgufValue::U16(count))
                .metadata("split.tensors.count", GgufValue::I32(total));
            let mut mine: Vec<_> =
                tensors.iter().skip(usize::from(no) * per_file).take(per_file).collect();
            if spoil == Spoil::RepeatedTensor && no == 1 {
                mine.push(&tensors[0]);
            }
            for info in mine {
                let data = file.tensor_bytes(info).to_vec();
                w.tensor(&info.name, &info.dims, info.type_id, data);
            }
            let path = dir.join(format!("model-{:05}-of-{count:05}.gguf", no + 1));
            std::fs::write(&path, w.to_bytes()).unwrap();
            path
        })
        .collect()
}

#[test]
fn a_split_model_loads_from_its_first_file_and_gives_the_same_logits() {
    let dir = temp_dir("split");
    let single = convert("llama2", "llama", &dir);
    let tokens: Vec<u32> = {
        let case = &cases("llama2", None)[0];
        case.prompt_ids.iter().chain(&case.greedy_ids).copied().collect()
    };
    let want = Runner::with(load_model(&single, &cpu()).unwrap()).one_shot(&tokens);
    let files = split(&single, 3, &dir, Spoil::Nothing);
    let opened = kiln_models::gguf::GgufFile::open(&files[0]).unwrap();
    assert_eq!(opened.num_files(), 3);
    let got = Runner::with(load_model(&files[0], &cpu()).unwrap()).one_shot(&tokens);
    assert_eq!(got, want, "a split model computes exactly what the single file does");

    let error = |path: &Path| match kiln_models::gguf::GgufFile::open(path) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => e.to_string(),
    };
    let e = error(&files[1]);
    assert!(e.contains("open its first file") && e.contains("model-00001-of-00003.gguf"), "{e}");
    for (spoil, says) in [
        (Spoil::WrongNumber, "expected part 3 of 3"),
        (Spoil::RepeatedTensor, "in more than one file"),
        (Spoil::WrongTotal, "split.tensors.count is 1"),
    ] {
        split(&single, 3, &dir, spoil);
        let e = error(&files[0]);
        assert!(e.contains(says), "{e}");
    }
    split(&single, 3, &dir, Spoil::Nothing);
    std::fs::remove_file(&files[2]).unwrap();
    let e = error(&files[0]);
    assert!(e.contains("model-00003-of-00003.gguf"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
