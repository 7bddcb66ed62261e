//! The generator on the tiny fixture models: greedy continuations equal transformers', a seed
//! gives the same tokens whatever else is in the batch, and every block is free afterwards.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::path::PathBuf;

use kiln_core::{FinishReason, SamplingParams};
use kiln_engine::{GenerateError, Generator, GeneratorConfig, StepEvent};
use kiln_models::load_model;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn generator(name: &str, config: GeneratorConfig) -> Generator {
    let cpu = std::sync::Arc::new(kiln_kernels::Cpu::new(2));
    Generator::new(load_model(&fixture(name), &cpu).unwrap().model, config).unwrap()
}

#[test]
fn greedy_continuations_equal_transformers_batched_and_chunked() {
    for name in ["llama3", "llama2", "mistral", "qwen2", "qwen3"] {
        let reference: Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(name).join("reference.json")).unwrap(),
        )
        .unwrap();
        let cases = reference["cases"].as_array().unwrap();
        let requests: Vec<_> = cases
            .iter()
            .map(|c| {
                let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(16) };
                (ids(&c["prompt_ids"]), params)
            })
            .collect();
        // A small token budget forces chunked prefill mixed with other sequences' decodes.
        let config = GeneratorConfig {
            block_size: 4,
            num_blocks: 128,
            max_num_batched_tokens: 7,
            ..Default::default()
        };
        let mut g = generator(name, config);
        let outputs = g.generate(&requests, &[], |_| {}).unwrap();
        for (c, out) in cases.iter().zip(&outputs) {
            assert_eq!(out.token_ids, ids(&c["greedy_ids"]), "{name}");
            assert_eq!(out.finish_reason, FinishReason::Length);
        }
        assert_eq!(g.num_free_blocks(), 128, "{name}: blocks leaked");
    }
}

#[test]
fn seeded_sampling_does_not_depend_on_the_batch() {
    let mut g = generator(
        "llama3",
        GeneratorConfig { block_size: 4, num_blocks: 256, ..Default::default() },
    );
    let params = |seed| SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        top_k: 50,
        max_tokens: 12,
        ignore_eos: true,
        seed: Some(seed),
        ..Default::default()
    };
    let target = (vec![500, 10, 20, 30], params(7));
    let alone = g.generate(std::slice::from_ref(&target), &[], |_| {}).unwrap();
    let others = [
        (vec![500, 1, 2], params(1)),
        target.clone(),
        ([vec![500], vec![99; 9]].concat(), params(3)),
    ];
    let batched = g.generate(&others, &[], |_| {}).unwrap();
    assert_eq!(alone[0].token_ids, batched[1].token_ids);
    let different = g.generate(&[(vec![500, 10, 20, 30], params(8))], &[], |_| {}).unwrap();
    assert_ne!(alone[0].token_ids, different[0].token_ids);
}

#[test]
fn stops_on_eos_and_stop_tokens_and_reports_events_in_order() {
    let mut g = generator("llama3", GeneratorConfig::default());
    let prompt = vec![500, 479, 418, 463];
    let greedy = g.generate(&[(prompt.clone(), SamplingParams::greedy(8))], &[], |_| {}).unwrap();
    let third = greedy[0].token_ids[2];
    let mut events = Vec::new();
    let out = g
        .generate(&[(prompt.clone(), SamplingParams::greedy(8))], &[third], |e| events.push(e))
        .unwrap();
    assert_eq!(out[0].token_ids, greedy[0].token_ids[..3]);
    assert_eq!(out[0].finish_reason, FinishReason::Stop);
    assert_eq!(events.last(), Some(&StepEvent::Finished { seq: 0, reason: FinishReason::Stop }));
    assert_eq!(events.iter().filter(|e| matches!(e, StepEvent::Token { .. })).count(), 3);
}

#[test]
fn bad_requests_are_rejected_and_leak_nothing() {
    let config = GeneratorConfig { block_size: 4, num_blocks: 8, ..Default::default() };
    let mut g = generator("llama3", config);
    let err = g.generate(&[(vec![], SamplingParams::greedy(4))], &[], |_| {}).unwrap_err();
    assert!(matches!(err, GenerateError::EmptyPrompt { .. }));
    let bad = SamplingParams { temperature: -1.0, ..Default::default() };
    let err = g.generate(&[(vec![1], bad)], &[], |_| {}).unwrap_err();
    assert!(err.to_string().contains("temperature"), "{err}");
    let err = g.generate(&[(vec![1; 600], SamplingParams::greedy(4))], &[], |_| {}).unwrap_err();
    assert!(err.to_string().contains("maximum context length is 512"), "{err}");
    let err = g.generate(&[(vec![100_000], SamplingParams::greedy(4))], &[], |_| {}).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    // 8 blocks of 4 tokens cannot hold 40 tokens: a clear error, and every block comes back.
    let err = g.generate(&[(vec![1; 30], SamplingParams::greedy(10))], &[], |_| {}).unwrap_err();
    assert!(matches!(err, GenerateError::OutOfBlocks { .. }), "{err}");
    assert_eq!(g.num_free_blocks(), 8);
    let ok = g.generate(&[(vec![1; 5], SamplingParams::greedy(3))], &[], |_| {}).unwrap();
    assert_eq!(ok[0].token_ids.len(), 3);
}
