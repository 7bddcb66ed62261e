//! bf16 matmuls (`--dtype bfloat16`: every float matrix converted to bf16, activations rounded
//! to bf16, f32 sums) on every decoder fixture, against transformers.
//!
//! The bound is transformers' own bf16 run of the same fixture against its f32 reference ("the
//! yardstick", `tests/fixtures/models/bf16_yardstick.json`, written by
//! `scripts/fixtures/make_bf16_yardstick.py`): the largest relative L2 error of a logits row at
//! most twice the yardstick's, and argmax agreement with the f32 run at most two points below
//! it (the CUDA backend's bf16 bound too). The engine's invariants hold bit for bit in bf16 as
//! in f32: batched == alone, chunked prefill == one shot, decode == full recompute.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::sync::Arc;

use common::{DECODER_FIXTURES, Runner, argmax, assert_rows_close, cases, fixture};
use kiln_kernels::{Cpu, FloatMatmul};
use kiln_models::{LogitsWanted, load_model};
use serde_json::Value;

fn bf16_runner(name: &str) -> Runner {
    let backend = Arc::new(Cpu::new(2).with_float_matmul(FloatMatmul::Bf16));
    Runner::with(load_model(&fixture(name), &backend).unwrap())
}

/// transformers' bf16 run of `name`: (max row relative error, argmax agreement).
fn yardstick(name: &str) -> (f64, f64) {
    let path = fixture(name).parent().unwrap().join("bf16_yardstick.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let y = &v["fixtures"][name];
    (y["max_row_rel_err"].as_f64().unwrap(), y["argmax_agreement"].as_f64().unwrap())
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        diff += f64::from(g - w).powi(2);
        norm += f64::from(*w).powi(2);
    }
    (diff / norm).sqrt()
}

#[test]
fn every_decoder_fixture_is_within_transformers_bf16_yardstick() {
    for name in DECODER_FIXTURES {
        let mut runner = bf16_runner(name);
        let (mut worst, mut same, mut rows) = (0.0f64, 0usize, 0usize);
        for case in cases(name, Some(runner.vocab())) {
            let tokens: Vec<u32> =
                case.prompt_ids.iter().chain(&case.greedy_ids).copied().collect();
            for (got, want) in runner.one_shot(&tokens).iter().zip(&case.logits) {
                worst = worst.max(rel_err(got, want));
                same += usize::from(argmax(got) == argmax(want));
                rows += 1;
            }
        }
        let agree = same as f64 / rows as f64;
        let (their_err, their_agree) = yardstick(name);
        println!(
            "{name:<10} bf16 vs transformers f32: max row rel err {worst:.3e}, argmax agreement \
             {agree:.3} (transformers bf16: {their_err:.3e}, {their_agree:.3})"
        );
        assert!(worst <= 2.0 * their_err, "{name}: row error {worst:.3e} vs {their_err:.3e}");
        assert!(agree >= their_agree - 0.02, "{name}: agreement {agree:.3} vs {their_agree:.3}");
    }
}

#[test]
fn bf16_batched_chunked_and_decoded_rows_equal_one_shot_bitwise() {
    for name in ["llama3", "mistral", "gemma3", "qwen3moe", "deepseekv2"] {
        let mut runner = bf16_runner(name);
        let cases = cases(name, None);
        let alone: Vec<_> = cases.iter().map(|c| runner.one_shot(&c.prompt_ids)).collect();
        let prompts: Vec<&[u32]> = cases.iter().map(|c| c.prompt_ids.as_slice()).collect();
        let batched = runner.batched(&prompts);
        for (i, (got, want)) in batched.iter().zip(&alone).enumerate() {
            assert_rows_close(got, want, 0.0, &format!("{name} batched #{i}"));
        }
        // Chunks of 5, then one token at a time, against the one-shot rows.
        let case = cases.iter().max_by_key(|c| c.prompt_ids.len()).unwrap();
        let tokens: Vec<u32> = case.prompt_ids.iter().chain(&case.greedy_ids).copied().collect();
        let want = runner.one_shot(&tokens);
        let table = runner.blocks(tokens.len());
        let n = case.prompt_ids.len();
        let mut got = Vec::new();
        for start in (0..n).step_by(5) {
            let end = (start + 5).min(n);
            runner.batch.clear();
            runner.batch.push_seq(&tokens[start..end], start, &table, LogitsWanted::All).unwrap();
            got.extend(runner.run());
        }
        for pos in n..tokens.len() {
            runner.batch.clear();
            runner.batch.push_seq(&tokens[pos..=pos], pos, &table, LogitsWanted::All).unwrap();
            got.extend(runner.run());
        }
        assert_rows_close(&got, &want, 0.0, &format!("{name} chunked + decoded"));
    }
}

/// `--dtype auto` on a bf16 checkpoint multiplies in bf16, and `float32` keeps the exact f32
/// path: the two differ, and the f32 one is today's (it matches transformers' f32 logits
/// within the f32 tolerance).
#[test]
fn auto_takes_bf16_on_bf16_weights_and_float32_stays_exact() {
    let load = |mode| {
        let backend = Arc::new(Cpu::new(2).with_float_matmul(mode));
        Runner::with(load_model(&fixture("mistral"), &backend).unwrap())
    };
    let case = &cases("mistral", Some(load(FloatMatmul::F32).vocab()))[0];
    let tokens: Vec<u32> = case.prompt_ids.iter().chain(&case.greedy_ids).copied().collect();
    let f32_rows = load(FloatMatmul::F32).one_shot(&tokens);
    assert_rows_close(&f32_rows, &case.logits, 1e-3, "float32");
    let auto_rows = load(FloatMatmul::Bf16Stored).one_shot(&tokens);
    let bf16_rows = bf16_runner("mistral").one_shot(&tokens);
    assert_rows_close(&auto_rows, &bf16_rows, 0.0, "auto == bfloat16 on a bf16 checkpoint");
    assert!(
        f32_rows.iter().zip(&auto_rows).any(|(a, b)| a != b),
        "bf16 matmuls changed nothing: the path was not taken"
    );
}
