//! GGUF files of the types kiln reads from files only (Q2_K, Q3_K, Q4_1, Q5_1, IQ4_NL, IQ4_XS,
//! MXFP4; and a DeepSeek file, latent attention in K-quants), made by llama.cpp's own
//! `llama-quantize` from random-weight f16 models of the `tiny-256` shapes
//! (`scripts/fixtures/make_gguf_type_fixtures.sh`; rows of 256 so that the K-quants apply;
//! MXFP4 in the experts of a Qwen3-MoE file, as gpt-oss ships it):
//! - each file holds the types it is named for (so these tests exercise them);
//! - the int8 kernels give the logits of the same file dequantized to f32 (whose dequantizers
//!   equal gguf-py's bit for bit: `quant::tests::fixture_matches_gguf_py`) within the rounding of
//!   8-bit activations (measured: at most 3–6 % of the largest |logit|; the DeepSeek file,
//!   whose latent attention has two more 8-bit-activation matmuls a layer, 4.6 % at the median,
//!   7 % at the 90th percentile and 18.5 % at one step; bounds 10 % at the 90th percentile, 25 %
//!   at any step);
//! - against llama.cpp's own outputs on each file (`llama_cpp_reference.json`, from
//!   llama-server), teacher-forced: the same top-1 token wherever llama.cpp's top-1 leads its
//!   top-2 by more than [`CLEAR_MARGIN`], and a mean |Δ logprob| over llama.cpp's top 5 of at
//!   most [`MAX_MEAN_DLOGPROB`] (measured 0.015–0.033 nat, the DeepSeek file 0.042; top-1 equal
//!   on 267 of 272 steps, the DeepSeek file's on 39 of 42).

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::path::PathBuf;

use common::{Runner, cpu, llama_ref};
use kiln_kernels::GgmlType;
use kiln_models::gguf::GgufFile;
use kiln_models::{LoadOptions, load_model, load_model_with};

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
    // DeepSeek's latent attention from a quantized file: the per-head slices of a stacked
    // Q5_0 `attn_k_b` and Q4_K `attn_v_b`, `attn_kv_a_mqa` cut in two by rows.
    ("tiny-deepseek-Q4_K_M.gguf", &[GgmlType::Q4K, GgmlType::Q5_0, GgmlType::Q6K]),
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
        // Per step: max |int8 − f32| over the largest |logit|.
        let mut ratios = Vec::new();
        for case in llama_ref::cases(&dir().join("llama_cpp_reference.json"), file) {
            let q = llama_ref::output_logits(&mut quantized, &case);
            let f = llama_ref::output_logits(&mut float, &case);
            for (q, f) in q.iter().zip(&f) {
                let scale = f.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-3);
                ratios.push(common::max_abs_diff(q, f) / scale);
            }
        }
        ratios.sort_by(f32::total_cmp);
        let p90 = ratios[ratios.len() * 9 / 10];
        let max = ratios[ratios.len() - 1];
        assert!(
            p90 <= 0.1 && max <= 0.25,
            "{file}: int8 kernels from f32 by {p90} (90th percentile), {max} (max) of the logits"
        );
    }
}

#[test]
fn teacher_forced_distribution_matches_llama_cpp() {
    let reference = dir().join("llama_cpp_reference.json");
    for (file, _) in FILES {
        let mut runner = Runner::with(load_model(&dir().join(file), &cpu()).unwrap());
        let fit = llama_ref::teacher_forced(
            &mut runner,
            &llama_ref::cases(&reference, file),
            file,
            CLEAR_MARGIN,
        );
        assert!(
            fit.mean_dlogprob <= MAX_MEAN_DLOGPROB,
            "{file}: mean |dlogprob| {}",
            fit.mean_dlogprob
        );
    }
}
