//! AWQ, GPTQ and compressed-tensors checkpoints against transformers: tiny fixtures
//! (`tests/fixtures/models/awq`, `gptq*`, `ct-*`, made by
//! `scripts/fixtures/make_packed_fixtures.py` from the `llama3` fixture, packed by AutoAWQ's,
//! AutoGPTQ's and compressed-tensors' own code) whose reference logits come from transformers
//! running the weights as those libraries dequantize them (W8A8's with float activations).
//!
//! - The matrices kiln reads equal the libraries' dequantization exactly (the unit test
//!   `packed::tests::fixture_matrices_equal_the_libraries_own_dequantization`), so dequantized
//!   to f32 (no activation quantization) kiln's logits are transformers' within f32 rounding,
//!   act-order inputs permuted.
//! - As they load (Q5_0 / Q4_0 / Q8_0, run with int8 activations by kernels checked against
//!   their scalar and f64 references elsewhere): batched == alone and chunked == one shot, bit
//!   for bit. (These tiny random models amplify any rounding, int8 activations' included, by
//!   two orders of magnitude, so their logits are not compared with transformers'.)

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use common::{Runner, assert_rows_close, cases, cpu, fixture};
use kiln_kernels::GgmlType;
use kiln_models::{LoadOptions, LogitsWanted, load_model_with};

/// AWQ 4-bit g32; GPTQ 4-bit g64 with zero points; GPTQ 8-bit symmetric g32; GPTQ 4-bit
/// symmetric per row (`group_size` −1); GPTQ 4-bit g32 act order (`desc_act`);
/// compressed-tensors W4A16 symmetric g32 (bf16 scales), W4A16 with zero points g64, W8A8
/// `int-quantized` per channel (bf16 scales), W8A16 `pack-quantized` per channel; GPTQ
/// Qwen3-MoE (every expert packed, the routers float); AWQ Phi-3 (fused `qkv_proj` and
/// `gate_up_proj` packed whole, read as their parts).
const FIXTURES: [&str; 11] = [
    "awq",
    "gptq",
    "gptq-sym8",
    "gptq-sym4",
    "gptq-act",
    "ct-w4a16",
    "ct-w4a16-asym",
    "ct-w8a8",
    "ct-w8a16",
    "gptq-qwen3moe",
    "awq-phi3",
];
/// Max |kiln − transformers| of the f32 logits with the weights dequantized (as
/// `hf_parity`'s float models).
const DEQUANTIZED_TOLERANCE: f32 = 1e-3;

fn dequantized(name: &str) -> Runner {
    let options = LoadOptions { quantization: Some(GgmlType::F32), ..LoadOptions::default() };
    Runner::with(load_model_with(&fixture(name), &options, &cpu()).unwrap())
}

#[test]
fn dequantized_logits_match_transformers() {
    for name in FIXTURES {
        let mut runner = dequantized(name);
        for (i, case) in cases(name, Some(runner.vocab())).iter().enumerate() {
            let tokens: Vec<u32> =
                case.prompt_ids.iter().chain(&case.greedy_ids).copied().collect();
            let got = runner.one_shot(&tokens);
            let what = format!("{name} case {i}");
            assert_rows_close(&got, &case.logits, DEQUANTIZED_TOLERANCE, &what);
        }
    }
}

#[test]
fn batched_and_chunked_equal_alone_bitwise() {
    for name in FIXTURES {
        let mut runner = Runner::new(name);
        let cases = cases(name, None);
        let alone: Vec<_> = cases.iter().map(|c| runner.one_shot(&c.prompt_ids)).collect();
        let prompts: Vec<&[u32]> = cases.iter().map(|c| c.prompt_ids.as_slice()).collect();
        let batched = runner.batched(&prompts);
        for (i, (got, want)) in batched.iter().zip(&alone).enumerate() {
            assert_rows_close(got, want, 0.0, &format!("{name} batched #{i}"));
        }
        // The longest prompt in chunks of 3 tokens.
        let prompt = &cases.iter().max_by_key(|c| c.prompt_ids.len()).unwrap().prompt_ids;
        let whole = runner.one_shot(prompt);
        let table = runner.blocks(prompt.len());
        let mut chunked = Vec::new();
        for start in (0..prompt.len()).step_by(3) {
            let end = (start + 3).min(prompt.len());
            runner.batch.clear();
            runner.batch.push_seq(&prompt[start..end], start, &table, LogitsWanted::All).unwrap();
            chunked.extend(runner.run());
        }
        assert_rows_close(&chunked, &whole, 0.0, &format!("{name} chunked"));
    }
}
