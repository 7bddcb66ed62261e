//! Broken model directories and GGUF files give errors that name the file (and tensor), never a panic.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::path::{Path, PathBuf};

use kiln_kernels::Cpu;
use kiln_models::gguf::GgufValue;
use kiln_models::gguf::writer::GgufWriter;
use kiln_models::load_model;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

/// A private copy of a fixture directory to damage, removed when dropped.
struct Scratch(tempfile::TempDir);

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        self.0.path()
    }
}

fn copy_fixture(name: &str, tag: &str) -> Scratch {
    let dst = tempfile::Builder::new().prefix(&format!("kiln-bad-{tag}-")).tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.path().join(entry.file_name())).unwrap();
    }
    Scratch(dst)
}

fn load_error(dir: &Path) -> String {
    match load_model(dir, &std::sync::Arc::new(Cpu::new(1))) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_and_truncated_files() {
    assert!(load_error(Path::new("/nonexistent/model")).contains("/nonexistent/model"));

    let dir = copy_fixture("llama3", "missing");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let msg = load_error(&dir);
    assert!(msg.contains("tokenizer.json: no such file"), "{msg}");
    assert!(!msg.contains("entity not found: entity not found"), "{msg}");

    let dir = copy_fixture("llama3", "trunc");
    let weights = dir.join("model.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&weights).unwrap();
    f.set_len(len / 2).unwrap();
    let msg = load_error(&dir);
    assert!(msg.contains("model.safetensors") && msg.contains("outside"), "{msg}");

    let dir = copy_fixture("llama2", "shard");
    std::fs::remove_file(dir.join("model-00002-of-00003.safetensors")).unwrap();
    assert!(load_error(&dir).contains("model-00002-of-00003.safetensors"));
}

#[test]
fn config_disagreeing_with_weights_names_the_tensor() {
    let dir = copy_fixture("qwen2", "shape");
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96"))
        .unwrap();
    let msg = load_error(&dir);
    assert!(msg.contains("mlp.gate_proj.weight") && msg.contains("[96, 64]"), "{msg}");

    let dir = copy_fixture("qwen2", "arch");
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("Qwen2ForCausalLM", "FalconForCausalLM")).unwrap();
    assert!(load_error(&dir).contains("unsupported architecture `FalconForCausalLM`"));

    let dir = copy_fixture("qwen2", "vocab");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let huge = text.replace("\"vocab_size\": 503", "\"vocab_size\": 1099511627776");
    assert_ne!(text, huge);
    std::fs::write(dir.join("config.json"), huge).unwrap();
    let msg = load_error(&dir);
    assert!(msg.contains("`vocab_size` = 1099511627776 exceeds the limit"), "{msg}");

    let dir = copy_fixture("qwen2", "eos");
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [502, 70000]}"#)
        .unwrap();
    let msg = load_error(&dir);
    assert!(
        msg.contains("generation_config.json")
            && msg.contains("eos_token_id 70000 is not a token id of the vocabulary"),
        "{msg}"
    );

    let dir = copy_fixture("qwen2", "json");
    std::fs::write(dir.join("config.json"), "{\"architectures\": [").unwrap();
    assert!(load_error(&dir).contains("not valid JSON"));
}

/// A minimal GGUF: `edit` may change metadata and tensors before it is written.
fn write_gguf(
    tag: &str,
    edit: impl FnOnce(&mut Vec<(String, GgufValue)>, &mut Vec<(String, Vec<u64>)>),
) -> PathBuf {
    let mut meta: Vec<(String, GgufValue)> = vec![
        ("general.architecture".into(), GgufValue::String("llama".into())),
        ("llama.embedding_length".into(), GgufValue::U32(32)),
        ("llama.feed_forward_length".into(), GgufValue::U32(64)),
        ("llama.block_count".into(), GgufValue::U32(1)),
        ("llama.attention.head_count".into(), GgufValue::U32(2)),
        ("tokenizer.ggml.model".into(), GgufValue::String("llama".into())),
        (
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array((0..16).map(|i| GgufValue::String(format!("t{i}"))).collect()),
        ),
    ];
    let mut tensors: Vec<(String, Vec<u64>)> = vec![
        ("token_embd.weight".into(), vec![32, 16]),
        ("output_norm.weight".into(), vec![32]),
        ("blk.0.attn_norm.weight".into(), vec![32]),
        ("blk.0.attn_q.weight".into(), vec![32, 32]),
        ("blk.0.attn_k.weight".into(), vec![32, 32]),
        ("blk.0.attn_v.weight".into(), vec![32, 32]),
        ("blk.0.attn_output.weight".into(), vec![32, 32]),
        ("blk.0.ffn_norm.weight".into(), vec![32]),
        ("blk.0.ffn_gate.weight".into(), vec![32, 64]),
        ("blk.0.ffn_up.weight".into(), vec![32, 64]),
        ("blk.0.ffn_down.weight".into(), vec![64, 32]),
    ];
    edit(&mut meta, &mut tensors);
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.metadata(&k, v);
    }
    for (name, dims) in tensors {
        let n: u64 = dims.iter().product();
        w.tensor_f32(&name, &dims, &vec![0.01; n as usize]);
    }
    let path = std::env::temp_dir().join(format!("kiln-bad-{tag}-{}.gguf", std::process::id()));
    std::fs::write(&path, w.to_bytes()).unwrap();
    path
}

#[test]
fn broken_gguf_models_name_what_is_wrong() {
    let ok = write_gguf("ok", |_, _| {});
    assert!(load_model(&ok, &std::sync::Arc::new(Cpu::new(1))).is_ok());
    let cases: Vec<(PathBuf, &str)> = vec![
        (
            write_gguf("arch", |m, _| m[0].1 = GgufValue::String("falcon".into())),
            "unsupported architecture `falcon`",
        ),
        (write_gguf("dim", |m, _| m[1].1 = GgufValue::U32(0)), "llama.embedding_length"),
        (
            write_gguf("heads", |m, _| m[4].1 = GgufValue::String("two".into())),
            "llama.attention.head_count",
        ),
        (
            write_gguf("missing", |_, t| t.retain(|x| x.0 != "blk.0.ffn_up.weight")),
            "blk.0.ffn_up.weight",
        ),
        (
            write_gguf("shape", |_, t| t[9].1 = vec![32, 65]),
            "tensor `blk.0.ffn_up.weight` has shape [65, 32], expected [64, 32]",
        ),
        (
            write_gguf("tok", |m, _| m.retain(|x| x.0 != "tokenizer.ggml.model")),
            "tokenizer.ggml.model",
        ),
        (write_gguf("vocab", |_, t| t[0].1 = vec![32, 15]), "16 tokens but token_embd.weight"),
    ];
    for (path, needle) in cases {
        let e = load_error(&path);
        assert!(e.contains(needle) && e.contains(".gguf"), "expected `{needle}` in `{e}`");
        std::fs::remove_file(&path).unwrap();
    }
    std::fs::remove_file(&ok).unwrap();
}

/// Mixture-of-experts settings that disagree with each other or the weights are refused with
/// the key or the tensor named.
#[test]
fn bad_expert_configs_are_refused() {
    let edit_of = |name: &str, tag: &str, from: &str, to: &str| {
        let dir = copy_fixture(name, tag);
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{from}");
        std::fs::write(&path, text.replace(from, to)).unwrap();
        load_error(&dir)
    };
    let edit = |tag: &str, from: &str, to: &str| edit_of("qwen3moe", tag, from, to);
    let msg = edit("topk", "\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 9");
    assert!(msg.contains("9 experts per token is out of range 1..=8"), "{msg}");
    let msg = edit("count", "\"num_experts\": 8", "\"num_experts\": 9");
    assert!(msg.contains("mlp.gate.weight") && msg.contains("expected [9, 64]"), "{msg}");
    let msg = edit("width", "\"moe_intermediate_size\": 32", "\"moe_intermediate_size\": 48");
    assert!(msg.contains("mlp.experts.0.gate_proj.weight") && msg.contains("[48, 64]"), "{msg}");
    let msg = edit("dense", "\"mlp_only_layers\": [\n    1\n  ]", "\"mlp_only_layers\": [7]");
    assert!(msg.contains("`mlp_only_layers` must list layer indices below 3"), "{msg}");
    let msg = edit("step", "\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 0");
    assert!(msg.contains("`decoder_sparse_step` must be at least 1"), "{msg}");
    let (from, to) = ("\"shared_expert_intermediate_size\": 48", "\"shared_expert_width\": 48");
    let msg = edit_of("qwen2moe", "shared", from, to);
    assert!(msg.contains("shared_expert_intermediate_size"), "{msg}");
    let (from, to) =
        ("\"shared_expert_intermediate_size\": 48", "\"shared_expert_intermediate_size\": 40");
    let msg = edit_of("qwen2moe", "shared-width", from, to);
    assert!(
        msg.contains("mlp.shared_expert.gate_proj.weight") && msg.contains("[40, 64]"),
        "{msg}"
    );
    let (from, to) = ("\"num_local_experts\": 4", "\"num_local_experts\": 0");
    let msg = edit_of("mixtral", "mixtral-count", from, to);
    assert!(msg.contains("`num_local_experts` = 0 is out of range"), "{msg}");
}
