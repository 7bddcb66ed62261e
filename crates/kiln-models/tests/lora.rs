//! LoRA adapters against PEFT: tiny PEFT adapters over the HF fixtures
//! (`tests/fixtures/lora`, made by `scripts/fixtures/make_lora_fixtures.py`: rank 8 on every
//! projection, rank 4 on attention, rsLoRA on q/v of Qwen3, the MLP of Gemma 3, Phi-3's fused `qkv_proj` and
//! `gate_up_proj`) give PEFT's
//! logits; a sequence's logits are bitwise the same alone and in a batch with other adapters
//! and the base model; hostile adapter files are refused naming what is wrong.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::path::{Path, PathBuf};

use common::lora::{base_of, lora_cases, lora_fixture, one_shot};
use common::{Runner, argmax, assert_rows_close};
use kiln_models::lora::LoraAdapter;
use kiln_models::{LogitsWanted, LoraDtype};
use serde_json::{Value, json};

/// Max |ours - PEFT| on f32 logits (as the base models' bar).
const LOGIT_TOLERANCE: f32 = 1e-3;
const MAX_RANK: usize = 64;

/// Fixture `base` with `adapters` bound to slots 1, 2, ..., kept in f32 (PEFT's values).
fn runner_with(base: &str, adapters: &[&str]) -> Runner {
    runner_in(base, adapters, LoraDtype::F32)
}

/// [`runner_with`] with the adapters kept in `dtype`.
fn runner_in(base: &str, adapters: &[&str], dtype: LoraDtype) -> Runner {
    let mut runner = Runner::new(base);
    for (i, name) in adapters.iter().enumerate() {
        let adapter =
            LoraAdapter::load_peft(&lora_fixture(name), runner.loaded.model.config(), MAX_RANK)
                .unwrap()
                .with_dtype(dtype);
        runner.loaded.model.set_adapter(i as u32 + 1, Some(&adapter)).unwrap();
    }
    runner
}

/// Kept in f32, an adapter gives PEFT's logits (within 2e-5 of the largest logit, 1e-3 in
/// absolute terms here); kept in f16 (`--lora-dtype float16`), each value rounded once, the logits move by
/// up to 0.4 % of the largest (0.27 of 68 on `llama3-r4-attn`, whose random update is as large
/// as the base model's) and the greedy tokens stay PEFT's.
#[test]
fn adapters_match_peft() {
    for name in
        ["llama3-r8-all", "llama3-r4-attn", "qwen3-r4-qv-rslora", "gemma3-r4-mlp", "phi3-r4-fused"]
    {
        // Tolerances relative to the largest logit (60-76 on these fixtures).
        for (dtype, tolerance) in [(LoraDtype::F32, 2e-5), (LoraDtype::F16, 5e-3)] {
            adapter_matches_peft(name, dtype, tolerance);
        }
    }
}

fn adapter_matches_peft(name: &str, dtype: LoraDtype, tolerance: f32) {
    {
        let base = base_of(name);
        let mut runner = runner_in(&base, &[name], dtype);
        for (i, (tokens, want, prompt_len)) in
            lora_cases(name, runner.vocab()).into_iter().enumerate()
        {
            let got = one_shot(&mut runner, &tokens, 1);
            let what = format!("{name} {dtype:?} case {i}");
            let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
            assert_rows_close(&got, &want, tolerance * scale, &what);
            // PEFT's greedy continuation, which differs from the base model's.
            for (row, &token) in
                got[prompt_len - 1..tokens.len() - 1].iter().zip(&tokens[prompt_len..])
            {
                assert_eq!(argmax(row), token, "{name} case {i}");
            }
            // Without the adapter, the base model's logits: the slot is per sequence.
            let plain = one_shot(&mut runner, &tokens, 0);
            assert!(common::max_abs_diff(&plain[prompt_len], &got[prompt_len]) > 1e-2, "{name}");
        }
    }
}

/// Two adapters and the base model in one batch, with every row's logits and with only the
/// last (the last layer then runs the logits rows alone): each sequence bitwise as alone.
#[test]
fn mixed_batches_give_each_sequence_its_own_logits() {
    let mut runner = runner_with("llama3", &["llama3-r8-all", "llama3-r4-attn"]);
    let cases = lora_cases("llama3-r8-all", runner.vocab());
    let seqs: Vec<(Vec<u32>, u32)> = vec![
        (cases[0].0.clone(), 1),
        (cases[1 % cases.len()].0.clone(), 0),
        (cases[0].0.clone(), 2),
        (cases[2 % cases.len()].0[..5].to_vec(), 1),
        (cases[0].0[..7].to_vec(), 2),
    ];
    for wanted in [LogitsWanted::All, LogitsWanted::Last] {
        let alone: Vec<Vec<Vec<f32>>> = seqs
            .iter()
            .map(|(tokens, slot)| {
                let table = runner.blocks(tokens.len());
                runner.batch.clear();
                runner.batch.push_seq(tokens, 0, &table, wanted).unwrap();
                runner.batch.set_last_adapter(*slot);
                runner.run()
            })
            .collect();
        runner.batch.clear();
        for (tokens, slot) in &seqs {
            let table = runner.blocks(tokens.len());
            runner.batch.push_seq(tokens, 0, &table, wanted).unwrap();
            runner.batch.set_last_adapter(*slot);
        }
        let together = runner.run();
        let expected: Vec<Vec<f32>> = alone.into_iter().flatten().collect();
        assert_eq!(together.len(), expected.len());
        for (i, (t, a)) in together.iter().zip(&expected).enumerate() {
            assert!(t == a, "{wanted:?}: row {i} differs in a mixed batch");
        }
    }
}

/// The scalar reference backend gives PEFT's logits too (its own one-thread kernel).
#[test]
fn the_reference_backend_matches_peft() {
    let name = "llama3-r8-all";
    let mut runner = Runner::on("llama3", &std::sync::Arc::new(kiln_kernels::Reference));
    let config = runner.loaded.model.config();
    let adapter = LoraAdapter::load_peft(&lora_fixture(name), config, MAX_RANK).unwrap();
    runner.loaded.model.set_adapter(1, Some(&adapter.with_dtype(LoraDtype::F32))).unwrap();
    let (tokens, want, _) = lora_cases(name, runner.vocab()).swap_remove(0);
    let table = runner.blocks(tokens.len());
    runner.batch.clear();
    runner.batch.push_seq(&tokens, 0, &table, LogitsWanted::All).unwrap();
    runner.batch.set_last_adapter(1);
    assert_rows_close(&runner.run(), &want, LOGIT_TOLERANCE, "reference backend");
}

#[test]
fn a_batch_naming_an_empty_slot_is_refused() {
    let mut runner = runner_with("llama3", &["llama3-r4-attn"]);
    let table = runner.blocks(3);
    runner.batch.clear();
    runner.batch.push_seq(&[1, 2, 3], 0, &table, LogitsWanted::Last).unwrap();
    runner.batch.set_last_adapter(2);
    let err = runner
        .loaded
        .model
        .forward(&runner.batch, &mut runner.kv, &mut runner.workspace, &mut runner.logits)
        .unwrap_err();
    assert!(err.to_string().contains("no LoRA adapter is loaded in slot 2"), "{err}");
    // Emptied, slot 1 is refused too; slot 0 cannot hold an adapter.
    runner.loaded.model.set_adapter(1, None).unwrap();
    runner.batch.set_last_adapter(1);
    let model = &runner.loaded.model;
    assert!(
        model
            .forward(&runner.batch, &mut runner.kv, &mut runner.workspace, &mut runner.logits)
            .is_err()
    );
    let adapter = LoraAdapter::load_peft(
        &lora_fixture("llama3-r4-attn"),
        runner.loaded.model.config(),
        MAX_RANK,
    )
    .unwrap();
    assert!(runner.loaded.model.set_adapter(0, Some(&adapter)).is_err());
}

/// A tensor to write: name, shape, f32 values.
type RawTensor<'a> = (&'a str, Vec<usize>, Vec<f32>);

/// Writes a safetensors file of f32 tensors.
fn write_safetensors(path: &Path, tensors: &[RawTensor<'_>]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        header.insert(
            (*name).to_owned(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = serde_json::to_vec(&Value::Object(header)).unwrap();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

const PREFIX: &str = "base_model.model.model.layers";

/// A rank-2 adapter of layer 0's `q_proj` on the llama3 fixture (hidden 64, q 64), with
/// `config` merged into a valid adapter config and `tensors` instead of the valid ones.
fn adapter_dir(dir: &Path, config: &Value, tensors: Option<Vec<RawTensor<'_>>>) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut cfg = json!({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none",
                         "target_modules": ["q_proj"], "use_dora": false});
    for (k, v) in config.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    std::fs::write(dir.join("adapter_config.json"), cfg.to_string()).unwrap();
    let a = format!("{PREFIX}.0.self_attn.q_proj.lora_A.weight");
    let b = format!("{PREFIX}.0.self_attn.q_proj.lora_B.weight");
    let valid = vec![
        (a.as_str(), vec![2, 64], vec![0.01; 128]),
        (b.as_str(), vec![64, 2], vec![0.02; 128]),
    ];
    write_safetensors(&dir.join("adapter_model.safetensors"), &tensors.unwrap_or(valid));
    dir.to_path_buf()
}

#[test]
fn hostile_adapters_are_refused_naming_the_problem() {
    let runner = Runner::new("llama3");
    let config = runner.loaded.model.config();
    let root = std::env::temp_dir().join(format!("kiln-lora-{}", std::process::id()));
    let load = |dir: PathBuf| LoraAdapter::load_peft(&dir, config, 16).map(|_| ()).unwrap_err();
    // A valid one loads.
    let ok = adapter_dir(&root.join("ok"), &json!({}), None);
    let adapter = LoraAdapter::load_peft(&ok, config, 16).unwrap();
    assert_eq!(adapter.max_rank(), 2);
    let a = format!("{PREFIX}.0.self_attn.q_proj.lora_A.weight");
    let b = format!("{PREFIX}.0.self_attn.q_proj.lora_B.weight");
    let cases: Vec<(&str, Value, Option<Vec<RawTensor<'_>>>, &str)> = vec![
        ("dora", json!({"use_dora": true}), None, "DoRA"),
        ("save", json!({"modules_to_save": ["lm_head"]}), None, "modules_to_save"),
        ("pattern", json!({"rank_pattern": {"q_proj": 4}}), None, "rank_pattern"),
        ("bias", json!({"bias": "all"}), None, "bias"),
        ("type", json!({"peft_type": "IA3"}), None, "only LORA"),
        ("rank", json!({"r": 64}), None, "above --max-lora-rank 16"),
        ("zero", json!({"r": 0}), None, "positive integer"),
        (
            "shape",
            json!({}),
            Some(vec![
                (a.as_str(), vec![2, 65], vec![0.0; 130]),
                (b.as_str(), vec![64, 2], vec![0.0; 128]),
            ]),
            "lora_A.weight` has shape [2, 65], expected [2, 64]",
        ),
        (
            "nan",
            json!({}),
            Some(vec![
                (a.as_str(), vec![2, 64], vec![f32::NAN; 128]),
                (b.as_str(), vec![64, 2], vec![0.0; 128]),
            ]),
            "holds NaN",
        ),
        (
            "lonely",
            json!({}),
            Some(vec![(a.as_str(), vec![2, 64], vec![0.0; 128])]),
            "lora_B.weight",
        ),
        (
            "embed",
            json!({}),
            Some(vec![(
                "base_model.model.model.embed_tokens.lora_embedding_A",
                vec![2, 64],
                vec![0.0; 128],
            )]),
            "embed_tokens.lora_embedding_A`: not a LoRA matrix of a layer",
        ),
        (
            "layer",
            json!({}),
            Some(vec![(
                "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight",
                vec![2, 64],
                vec![0.0; 128],
            )]),
            "layer 9, but the model has 2 layers",
        ),
        (
            "module",
            json!({}),
            Some(vec![(
                "base_model.model.model.layers.0.self_attn.qk_proj.lora_A.weight",
                vec![2, 64],
                vec![0.0; 128],
            )]),
            "module `qk_proj` cannot be adapted",
        ),
    ];
    for (name, cfg, tensors, expected) in cases {
        let err = load(adapter_dir(&root.join(name), &cfg, tensors)).to_string();
        assert!(err.contains(expected), "{name}: {err}");
    }
    // Truncated weights and a missing file.
    let cut = adapter_dir(&root.join("cut"), &json!({}), None);
    let file = cut.join("adapter_model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 9]).unwrap();
    load(cut);
    std::fs::remove_file(file).unwrap();
    let err = load(root.join("cut")).to_string();
    assert!(err.contains("no adapter_model.safetensors"), "{err}");
    // An MLP adapter on a mixture-of-experts layer.
    let moe = Runner::new("qwen3moe");
    let moe_config = moe.loaded.model.config();
    let h = moe_config.hidden_size;
    let down = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight";
    let dir = adapter_dir(
        &root.join("moe"),
        &json!({}),
        Some(vec![(down, vec![2, h], vec![0.0; 2 * h])]),
    );
    let err = LoraAdapter::load_peft(&dir, moe_config, 16).unwrap_err().to_string();
    assert!(err.contains("mixture of experts"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}
