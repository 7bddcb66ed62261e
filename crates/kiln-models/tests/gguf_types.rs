//! GGUF files of the types kiln reads from files only (Q2_K, Q3_K, Q4_1, Q5_1, IQ4_NL, IQ4_XS,
//! MXFP4), made by llama.cpp's own `llama-quantize` from random-weight f16 models of the
//! `tiny-256` shapes (`scripts/fixtures/make_gguf_type_fixtures.sh`; rows of 256 so that the
//! K-quants apply; MXFP4 in the experts of a Qwen3-MoE file, as gpt-oss ships it):
//! - each file holds the types it is named for (so these tests exercise them);
//! - the int8 kernels give the logits of the same file dequantized to f32 (whose dequantizers
//!   equal gguf-py's bit for bit: `quant::tests::fixture_matches_gguf_py`) within the rounding of
//!   8-bit activations (measured: at most 3–6 % of the largest |logit|; bound 10 %);
//! - against llama.cpp's own outputs on each file (`llama_cpp_reference.json`, from
//!   llama-server), teacher-forced: the same top-1 token wherever llama.cpp's top-1 leads its
//!   top-2 by more than [`CLEAR_MARGIN`], and a mean |Δ logprob| over llama.cpp's top 5 of at
//!   most [`MAX_MEAN_DLOGPROB`] (measured 0.015–0.033 nat; top-1 equal on 267 of 272 steps).

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::path::PathBuf;

use common::{Runner, argmax, cpu};
use kiln_kernels::GgmlType;
use kiln_models::gguf::GgufFile;
use kiln_models::{LoadOptions, load_model, load_model_with};
use serde_json::Value;

/// Bound on the mean |Δ logprob| over llama.cpp's top 5 (the default model's Q4_K_M bar).
const MAX_MEAN_DLOGPROB: f64 = 0.12;
/// A top-1 token llama.cpp prefers by more than this (nat) must be kiln's too.
const CLEAR_MARGIN: f32 = 0.5;

/// Each file and the types it must hold.
const FILES: &[(&str, &[GgmlType])] = &[
    ("tiny-Q2_K.gguf", &[GgmlType::Q2K, GgmlType::Q3K]),
    ("tiny-Q3_K_M.gguf", &[GgmlType::Q3K]),
    ("tiny-IQ4_XS.gguf", &[GgmlType::Iq4Xs]),
    ("tiny-IQ4_NL.gguf", &[GgmlType::Iq4Nl]),
    ("tiny-Q4_1.gguf", &[GgmlType::Q4_1]),
    ("tiny-Q5_1.gguf", &[GgmlType::Q5_1]),
    ("tiny-moe-MXFP4_MOE.gguf", &[GgmlType::Mxfp4]),
    (
        "tiny-IQ2_XXS-IQ3.gguf",
        &[GgmlType::Iq2Xxs, GgmlType::Iq2Xs, GgmlType::Iq2S, GgmlType::Iq3Xxs, GgmlType::Iq3S],
    ),
    ("tiny-IQ1_M-IQ1_S.gguf", &[GgmlType::Iq1M, GgmlType::Iq1S]),
    ("tiny-TQ1_0-TQ2_0.gguf", &[GgmlType::Tq1_0, GgmlType::Tq2_0]),
];

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_types")
}

struct Case {
    prompt: Vec<u32>,
    output: Vec<u32>,
    /// Per output step: llama.cpp's top 5 `(id, logprob)`, best first; `None` where
    /// llama-server reported none of its own (a byte token ending incomplete UTF-8; see
    /// `scripts/fixtures/llama_server_reference.py`).
    top5: Vec<Option<Vec<(u32, f32)>>>,
}

fn cases(file: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(dir().join("llama_cpp_reference.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| u32::try_from(x.as_u64().unwrap()).unwrap()).collect()
    };
    doc["files"][file]["cases"]
        .as_array()
        .unwrap_or_else(|| panic!("no reference for {file}"))
        .iter()
        .map(|c| Case {
            prompt: ids(&c["prompt_ids"]),
            output: ids(&c["output_ids"]),
            top5: c["top5"]
                .as_array()
                .unwrap()
                .iter()
                .map(|step| {
                    step.as_array().map(|top| {
                        top.iter()
                            .map(|p| {
                                let id = u32::try_from(p[0].as_u64().unwrap()).unwrap();
                                (id, p[1].as_f64().unwrap() as f32)
                            })
                            .collect()
                    })
                })
                .collect(),
        })
        .collect()
}

/// Teacher-forced logits of every output step of `case` (the rows after the prompt's last token
/// and after each output token but the last), one forward pass.
fn output_logits(runner: &mut Runner, case: &Case) -> Vec<Vec<f32>> {
    let mut tokens = case.prompt.clone();
    tokens.extend_from_slice(&case.output[..case.output.len() - 1]);
    runner.one_shot(&tokens).split_off(case.prompt.len() - 1)
}

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&v| f64::from(v - max).exp()).sum();
    let log_sum = sum.ln() as f32;
    row.iter().map(|&v| v - max - log_sum).collect()
}

#[test]
fn each_file_holds_its_types() {
    for (file, types) in FILES {
        let gguf = GgufFile::open(&dir().join(file)).unwrap();
        let held: Vec<u32> = gguf.tensors().iter().map(|t| t.type_id).collect();
        for ty in *types {
            assert!(held.contains(&ty.gguf_id()), "{file} holds no {ty} tensor");
        }
    }
}

#[test]
fn int8_kernels_match_the_file_dequantized_to_f32() {
    let f32_options = LoadOptions { quantization: Some(GgmlType::F32), ..LoadOptions::default() };
    for (file, _) in FILES {
        let path = dir().join(file);
        let mut quantized = Runner::with(load_model(&path, &cpu()).unwrap());
        let mut float = Runner::with(load_model_with(&path, &f32_options, &cpu()).unwrap());
        for case in cases(file) {
            let q = output_logits(&mut quantized, &case);
            let f = output_logits(&mut float, &case);
            for (step, (q, f)) in q.iter().zip(&f).enumerate() {
                let scale = f.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let diff = common::max_abs_diff(q, f);
                assert!(
                    diff <= 0.1 * scale + 1e-3,
                    "{file} step {step}: int8 kernels {diff} from f32 (logits up to {scale})"
                );
            }
        }
    }
}

#[test]
fn teacher_forced_distribution_matches_llama_cpp() {
    for (file, _) in FILES {
        let mut runner = Runner::with(load_model(&dir().join(file), &cpu()).unwrap());
        let (mut sum, mut count, mut agree, mut steps) = (0.0f64, 0u32, 0u32, 0u32);
        for case in cases(file) {
            let rows = output_logits(&mut runner, &case);
            for (step, (row, reference)) in rows.iter().zip(&case.top5).enumerate() {
                let Some(reference) = reference else { continue };
                let lp = log_softmax(row);
                for &(id, want) in reference {
                    sum += f64::from((lp[id as usize] - want).abs());
                    count += 1;
                }
                steps += 1;
                let (ours, (want, want_lp)) = (argmax(row), reference[0]);
                if ours == want {
                    agree += 1;
                } else {
                    let margin = want_lp - reference[1].1;
                    assert!(
                        margin <= CLEAR_MARGIN,
                        "{file} step {step}: top-1 {ours} but llama.cpp's {want} leads by \
                         {margin} nat"
                    );
                }
            }
        }
        assert!(steps >= 20, "{file}: only {steps} steps with llama.cpp's probabilities");
        let mean = sum / f64::from(count);
        eprintln!(
            "{file}: top-1 {agree}/{steps}, mean |dlogprob| over llama.cpp's top 5 {mean:.4}"
        );
        assert!(mean <= MAX_MEAN_DLOGPROB, "{file}: mean |dlogprob| {mean}");
    }
}
