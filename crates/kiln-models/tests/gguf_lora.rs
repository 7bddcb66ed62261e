//! llama.cpp's GGUF LoRA files against PEFT: the fixture adapters converted by llama.cpp's own
//! `convert_lora_to_gguf.py` (`scripts/fixtures/make_gguf_lora_fixtures.sh`: f32, f16 and
//! q8_0) give PEFT's logits (q8_0: PEFT's matrices rounded) on the HF base model and on the
//! base model read from a GGUF (whose Llama q/k rows are permuted for interleaved RoPE, as are
//! the file's); a PEFT directory on a GGUF base model does too; scales and stacked adapters add up as llama.cpp's do; hostile
//! files are refused naming what is wrong.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::path::{Path, PathBuf};

use common::lora::{base_of, lora_cases, lora_fixture, one_shot};
use common::{Runner, argmax, assert_rows_close, cpu};
use kiln_models::gguf::writer::GgufWriter;
use kiln_models::gguf::{GgufFile, GgufValue};
use kiln_models::lora::{LoraAdapter, LoraTarget};
use kiln_models::{LoraDtype, load_model};

const MAX_RANK: usize = 64;

/// `(PEFT fixture, its llama.cpp conversion, tolerance relative to the largest logit)`.
const CONVERTED: [(&str, &str, f32); 3] = [
    // f32 holds PEFT's values: the bar of a PEFT directory.
    ("llama3-r8-all", "adapter-f32.gguf", 2e-5),
    // Phi-3's fused `attn_qkv` and `ffn_up` ([gate; up]).
    ("phi3-r4-fused", "adapter-f32.gguf", 2e-5),
    // f16 rounds each value once, as `--lora-dtype float16` does.
    ("gemma3-r4-mlp", "adapter-f16.gguf", 5e-3),
];

/// The third conversion, q8_0 `lora_a` and f16 `lora_b` rows of an update as large as the base
/// model's (alpha 32 at rank 4): `q8_0_matrices_are_pefts_rounded` checks its values; its
/// logits move up to 8 % of the largest from PEFT's on these chaotic random models.
const Q8_0: (&str, &str) = ("llama3-r4-attn", "adapter-q8_0.gguf");

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-gguf-lora-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The HF fixture `base` (or, with `gguf_dir`, its GGUF conversion) with `adapter` in slot 1.
fn runner(base: &str, gguf_dir: Option<&Path>, adapter: &LoraAdapterSource<'_>) -> Runner {
    let mut runner = match gguf_dir {
        None => Runner::new(base),
        Some(dir) => {
            let arch = match base {
                "gemma3" | "phi3" => base,
                _ => "llama",
            };
            let path = common::gguf::convert(base, arch, dir);
            Runner::with(load_model(&path, &cpu()).unwrap())
        }
    };
    let config = runner.loaded.model.config().clone();
    let adapter = match adapter {
        LoraAdapterSource::Path(path) => LoraAdapter::load(path, &config, MAX_RANK).unwrap(),
        LoraAdapterSource::Built(build) => build(&config),
    };
    runner.loaded.model.set_adapter(1, Some(&adapter.with_dtype(LoraDtype::F32))).unwrap();
    runner
}

enum LoraAdapterSource<'a> {
    Path(PathBuf),
    Built(&'a dyn Fn(&kiln_models::ModelConfig) -> LoraAdapter),
}

/// Runs every PEFT case of `name` and checks the logits within `tolerance` of the largest and
/// PEFT's greedy tokens.
fn check_against_peft(runner: &mut Runner, name: &str, tolerance: f32, what: &str) {
    for (i, (tokens, want, prompt_len)) in lora_cases(name, runner.vocab()).into_iter().enumerate()
    {
        let got = one_shot(runner, &tokens, 1);
        let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        // The GGUF base model itself is within 1e-3 of transformers.
        let bar = (tolerance * scale).max(2e-3);
        assert_rows_close(&got, &want, bar, &format!("{what} case {i}"));
        // The bar is far below what the adapter changes.
        let plain = one_shot(runner, &tokens, 0);
        let moved = plain.iter().zip(&want).map(|(p, w)| common::max_abs_diff(p, w));
        let moved = moved.fold(0f32, f32::max);
        assert!(moved > 20.0 * bar, "{what} case {i}: the adapter moves the logits by {moved}");
        for (row, &token) in got[prompt_len - 1..tokens.len() - 1].iter().zip(&tokens[prompt_len..])
        {
            assert_eq!(argmax(row), token, "{what} case {i}");
        }
    }
}

#[test]
fn converted_adapters_match_peft_on_both_kinds_of_base_model() {
    let dir = temp_dir("match");
    for (name, file, tolerance) in CONVERTED {
        let base = base_of(name);
        let source = LoraAdapterSource::Path(lora_fixture(name).join(file));
        let mut hf = runner(&base, None, &source);
        check_against_peft(&mut hf, name, tolerance, &format!("{file} of {name} on HF"));
        let mut gguf = runner(&base, Some(&dir), &source);
        check_against_peft(&mut gguf, name, tolerance, &format!("{file} of {name} on GGUF"));
    }
    // The q8_0 file gives the same logits on both kinds of base model.
    let (name, file) = Q8_0;
    let source = LoraAdapterSource::Path(lora_fixture(name).join(file));
    let (mut hf, mut gguf) =
        (runner("llama3", None, &source), runner("llama3", Some(&dir), &source));
    for (i, (tokens, _, _)) in lora_cases(name, hf.vocab()).into_iter().enumerate() {
        let want = one_shot(&mut hf, &tokens, 1);
        assert_rows_close(&one_shot(&mut gguf, &tokens, 1), &want, 2e-3, &format!("{file} {i}"));
    }
    // A PEFT directory on a GGUF Llama: its q/k rows are permuted to the model's order.
    let peft = LoraAdapterSource::Path(lora_fixture("llama3-r8-all"));
    let mut gguf = runner("llama3", Some(&dir), &peft);
    check_against_peft(&mut gguf, "llama3-r8-all", 2e-5, "PEFT llama3-r8-all on GGUF");
    std::fs::remove_dir_all(&dir).ok();
}

/// Half a q8_0 step, plus what the step's own f16 rounding adds at the largest code (127 ·
/// 2^-11 steps; measured up to 0.506 on this file, as gguf-py's own quantizer gives).
const HALF_STEP_WITH_F16_SCALE: f32 = 0.5 + 127.0 / 2048.0;

/// The q8_0 file holds PEFT's matrices rounded once: each `lora_a` value within half a q8_0
/// step of PEFT's `A` (a step is the largest |value| of its block of 32 over 127), each
/// `lora_b` value within f16's rounding of PEFT's `B` (the same scale folded into both).
#[test]
fn q8_0_matrices_are_pefts_rounded() {
    let config = Runner::new("llama3").loaded.model.config().clone();
    let name = "llama3-r4-attn";
    let peft = LoraAdapter::load(&lora_fixture(name), &config, MAX_RANK).unwrap();
    let q8 = LoraAdapter::load(&lora_fixture(name).join("adapter-q8_0.gguf"), &config, MAX_RANK)
        .unwrap();
    let mut compared = 0;
    for layer in 0..config.num_layers {
        for target in LoraTarget::ALL {
            let (Some(want), Some(got)) = (peft.matrix(layer, target), q8.matrix(layer, target))
            else {
                assert!(peft.matrix(layer, target).is_none() && q8.matrix(layer, target).is_none());
                continue;
            };
            assert_eq!((got.rank, got.a.len()), (want.rank, want.a.len()));
            for (block_got, block_want) in got.a.chunks(32).zip(want.a.chunks(32)) {
                let step = block_want.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                for (g, w) in block_got.iter().zip(block_want) {
                    let bar = step * HALF_STEP_WITH_F16_SCALE;
                    assert!((g - w).abs() <= bar, "{layer} {target:?}: {g} {w}");
                }
            }
            for (g, w) in got.b_t.iter().zip(&want.b_t) {
                assert!((g - w).abs() <= w.abs() * 1e-3 + 1e-6, "{layer} {target:?}: {g} {w}");
            }
            compared += 1;
        }
    }
    assert_eq!(compared, config.num_layers * 3, "k, v and o of every layer");
}

/// llama-server's `--lora-scaled FILE:0` leaves the base model's logits bitwise, and two
/// halves of an adapter stacked are the adapter (ranks concatenated; within rounding).
#[test]
fn scales_and_stacks_add_up() {
    let name = "llama3-r8-all";
    let path = lora_fixture(name).join("adapter-f32.gguf");
    let zero = |c: &kiln_models::ModelConfig| {
        LoraAdapter::load_gguf(&path, c, 64).unwrap().scaled(0.0).unwrap()
    };
    let mut runner_zero = runner("llama3", None, &LoraAdapterSource::Built(&zero));
    let tokens = lora_cases(name, runner_zero.vocab())[0].0.clone();
    let base = one_shot(&mut runner_zero, &tokens, 0);
    assert_eq!(one_shot(&mut runner_zero, &tokens, 1), base, "scale 0");

    let halves = |c: &kiln_models::ModelConfig| {
        let half = || LoraAdapter::load_gguf(&path, c, 64).unwrap().scaled(0.5).unwrap();
        LoraAdapter::stack(vec![half(), half()]).unwrap()
    };
    let mut stacked = runner("llama3", None, &LoraAdapterSource::Built(&halves));
    assert_eq!(LoraAdapter::stack(Vec::new()).unwrap_err(), "no adapter to stack");
    let mut whole = runner("llama3", None, &LoraAdapterSource::Path(path.clone()));
    let want = one_shot(&mut whole, &tokens, 1);
    let got = one_shot(&mut stacked, &tokens, 1);
    assert_rows_close(&got, &want, 1e-3, "two halves stacked");
    assert!(common::max_abs_diff(&want[3], &base[3]) > 1e-2, "the adapter changes the logits");
}

/// The f32 fixture rewritten by `spoil`, which may change its metadata and tensors
/// (`(name, ggml dims, f32 values)`).
fn spoiled(
    dir: &Path,
    tag: &str,
    spoil: impl FnOnce(&mut Vec<(String, GgufValue)>, &mut Vec<(String, Vec<u64>, Vec<f32>)>),
) -> PathBuf {
    let file = GgufFile::open(&lora_fixture("llama3-r8-all").join("adapter-f32.gguf")).unwrap();
    let mut metadata: Vec<(String, GgufValue)> = file
        .metadata()
        .iter()
        .filter(|(k, _)| !k.starts_with("GGUF."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    metadata.sort_by(|a, b| a.0.cmp(&b.0));
    let mut tensors: Vec<(String, Vec<u64>, Vec<f32>)> = file
        .tensors()
        .iter()
        .map(|t| {
            let values = file
                .tensor_bytes(t)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (t.name.clone(), t.dims.clone(), values)
        })
        .collect();
    spoil(&mut metadata, &mut tensors);
    let mut w = GgufWriter::new();
    for (k, v) in metadata {
        w.metadata(&k, v);
    }
    for (name, dims, values) in &tensors {
        w.tensor_f32(name, dims, values);
    }
    let path = dir.join(format!("{tag}.gguf"));
    std::fs::write(&path, w.to_bytes()).unwrap();
    path
}

fn set(metadata: &mut [(String, GgufValue)], key: &str, value: &str) {
    metadata.iter_mut().find(|(k, _)| k == key).unwrap().1 = GgufValue::String(value.into());
}

#[test]
fn hostile_adapter_files_are_refused() {
    let dir = temp_dir("hostile");
    let config = Runner::new("llama3").loaded.model.config().clone();
    let q_a = "blk.0.attn_q.weight.lora_a";
    let q_b = "blk.0.attn_q.weight.lora_b";
    let cases: Vec<(&str, PathBuf, &str)> = vec![
        (
            "a model file",
            spoiled(&dir, "model", |m, _| set(m, "general.type", "model")),
            "general.type is `model`",
        ),
        (
            "a control vector",
            spoiled(&dir, "cvec", |m, _| set(m, "adapter.type", "control_vector")),
            "only LoRA adapters",
        ),
        (
            "another architecture",
            spoiled(&dir, "arch", |m, _| set(m, "general.architecture", "qwen2")),
            "an adapter for `qwen2` models, but the model is `llama`",
        ),
        (
            "activated LoRA",
            spoiled(&dir, "alora", |m, _| {
                let tokens = GgufValue::Array(vec![GgufValue::U32(5)]);
                m.push(("adapter.alora.invocation_tokens".into(), tokens));
            }),
            "activated LoRA",
        ),
        (
            "a negative alpha",
            spoiled(&dir, "alpha", |m, _| {
                m.iter_mut().find(|(k, _)| k == "adapter.lora.alpha").unwrap().1 =
                    GgufValue::F32(-1.0);
            }),
            "adapter.lora.alpha -1",
        ),
        ("a missing lora_b", spoiled(&dir, "half", |_, t| t.retain(|(n, _, _)| n != q_b)), q_b),
        (
            "lora_a transposed",
            spoiled(&dir, "transposed", |_, t| {
                let a = t.iter_mut().find(|(n, _, _)| n == q_a).unwrap();
                a.1.reverse();
            }),
            q_a,
        ),
        (
            "an embedding adapter",
            spoiled(&dir, "embd", |_, t| {
                t.push(("token_embd.weight.lora_a".into(), vec![4, 8], vec![0.0; 32]));
                t.push(("token_embd.weight.lora_b".into(), vec![8, 4], vec![0.0; 32]));
            }),
            "`token_embd.weight` cannot be adapted",
        ),
        (
            "a layer the model lacks",
            spoiled(&dir, "layer", |_, t| {
                for (n, _, _) in t.iter_mut().filter(|(n, _, _)| n.starts_with("blk.1.")) {
                    *n = n.replacen("blk.1.", "blk.9.", 1);
                }
            }),
            "layer 9, but the model has 2 layers",
        ),
        (
            "a NaN",
            spoiled(&dir, "nan", |_, t| {
                t.iter_mut().find(|(n, _, _)| n == q_b).unwrap().2[7] = f32::NAN;
            }),
            "holds NaN at element 7",
        ),
        (
            "a tensor that is not LoRA's",
            spoiled(&dir, "norm", |_, t| {
                t.push(("blk.0.attn_norm.weight".into(), vec![64], vec![1.0; 64]));
            }),
            "not a LoRA tensor",
        ),
    ];
    for (what, path, why) in cases {
        let err = LoraAdapter::load(&path, &config, MAX_RANK).unwrap_err().to_string();
        assert!(err.contains(why), "{what}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A rank above the limit, a scale that is not a number, a truncated file and a file of
/// another model's shapes are refused.
#[test]
fn limits_and_other_models_files_are_refused() {
    let dir = temp_dir("limits");
    let config = Runner::new("llama3").loaded.model.config().clone();
    let q_b = "blk.0.attn_q.weight.lora_b";
    let good = lora_fixture("llama3-r8-all").join("adapter-f32.gguf");
    // A rank above the limit, a scale that is not a number.
    let err = LoraAdapter::load_gguf(&good, &config, 4).unwrap_err().to_string();
    assert!(err.contains("rank 8 is above the limit of 4"), "{err}");
    let adapter = LoraAdapter::load_gguf(&good, &config, 64).unwrap();
    assert!(adapter.clone().scaled(f32::NAN).unwrap_err().contains("not finite"));
    let twice = adapter.scaled(f32::MAX).and_then(|a| a.scaled(f32::MAX));
    assert!(twice.unwrap_err().contains("overflow"));
    // A truncated file.
    let bytes = std::fs::read(&good).unwrap();
    let truncated = dir.join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    assert!(LoraAdapter::load(&truncated, &config, MAX_RANK).is_err());
    // An adapter of another model's shape: the Gemma one on Llama is refused by architecture;
    // its tensors renamed for Llama by shape.
    let gemma = lora_fixture("gemma3-r4-mlp").join("adapter-f16.gguf");
    let err = LoraAdapter::load(&gemma, &config, MAX_RANK).unwrap_err().to_string();
    assert!(err.contains("`gemma3`"), "{err}");
    let wide = spoiled(&dir, "wide", |_, t| {
        let b = t.iter_mut().find(|(n, _, _)| n == q_b).unwrap();
        b.1[1] *= 2;
        b.2 = [b.2.clone(), b.2.clone()].concat();
    });
    let err = LoraAdapter::load(&wide, &config, MAX_RANK).unwrap_err().to_string();
    assert!(err.contains(q_b) && err.contains("[128, 8]"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
