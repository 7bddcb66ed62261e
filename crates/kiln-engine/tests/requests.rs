//! Requests run to completion on [`EngineCore`], as `kiln generate` and the benchmarks run
//! them, on the tiny fixture models: greedy continuations equal transformers' with chunked
//! prefill mixed into other requests' decodes; end-of-sequence ids and stop tokens finish a
//! request with `stop`, its last token included; a seed gives the same tokens whatever else is
//! in the batch; bad requests are refused with a message naming the problem; and every KV
//! block is free again after success and after refusals.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::collections::HashMap;
use std::path::PathBuf;

use kiln_core::{FinishReason, RequestId, SamplingParams, TokenId};
use kiln_engine::{EngineConfig, EngineCore, EngineError, KvCacheDtype, SchedulerConfig};
use kiln_kernels::Cpu;
use kiln_models::load_model;

fn cpu() -> std::sync::Arc<Cpu> {
    std::sync::Arc::new(Cpu::new(2))
}
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

fn ids(v: &Value) -> Vec<TokenId> {
    v.as_array().unwrap().iter().map(|x| TokenId(x.as_u64().unwrap() as u32)).collect()
}

/// An engine on fixture `name` with blocks of 4 tokens and an f32 KV cache (the references are
/// float32).
fn engine(name: &str, num_kv_blocks: usize, max_num_batched_tokens: usize) -> EngineCore {
    let config = EngineConfig {
        block_size: 4,
        num_kv_blocks,
        scheduler: SchedulerConfig { max_num_batched_tokens, ..SchedulerConfig::default() },
        kv_cache_dtype: KvCacheDtype::F32,
        ..EngineConfig::default()
    };
    EngineCore::new(load_model(&fixture(name), &cpu()).unwrap().model, config).unwrap()
}

/// One finished request: its tokens and why it ended.
#[derive(Debug, PartialEq)]
struct Finished {
    tokens: Vec<TokenId>,
    reason: FinishReason,
}

/// Runs every request to its end; results in request order. Checks that the finish reason
/// comes with the last token and that every block is free afterwards.
fn run(core: &mut EngineCore, requests: &[(Vec<TokenId>, SamplingParams)]) -> Vec<Finished> {
    let ids: Vec<RequestId> = requests
        .iter()
        .map(|(prompt, params)| core.add_request(prompt.clone(), params.clone(), 0).unwrap())
        .collect();
    let mut tokens: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
    let mut reasons = HashMap::new();
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            assert!(!reasons.contains_key(&out.id), "a token after the finish");
            tokens.entry(out.id).or_default().push(out.new_token);
            if let Some(reason) = out.finish_reason {
                reasons.insert(out.id, reason);
            }
        }
    }
    assert_no_blocks_held(core);
    ids.iter()
        .map(|id| Finished { tokens: tokens.remove(id).unwrap(), reason: reasons[id] })
        .collect()
}

fn assert_no_blocks_held(core: &EngineCore) {
    let kv = core.scheduler().kv_cache();
    assert_eq!(kv.num_free_blocks(), kv.num_blocks(), "blocks leaked");
    assert_eq!(core.stats().kv_usage, 0.0);
    core.scheduler().check_invariants().unwrap();
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
}

#[test]
fn greedy_continuations_equal_transformers_batched_and_chunked() {
    for name in [
        "llama3",
        "llama2",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "qwen2moe",
        "qwen3moe",
        "gemma3",
        "deepseekv2",
        "deepseekv3",
        "gptoss",
    ] {
        let reference: Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(name).join("reference.json")).unwrap(),
        )
        .unwrap();
        let cases = reference["cases"].as_array().unwrap();
        let requests: Vec<_> = cases.iter().map(|c| (ids(&c["prompt_ids"]), greedy(16))).collect();
        // A budget of 7 tokens a step chunks every prompt and mixes chunks with decodes.
        let mut core = engine(name, 128, 7);
        for (c, out) in cases.iter().zip(run(&mut core, &requests)) {
            assert_eq!(out.tokens, ids(&c["greedy_ids"]), "{name}: {}", c["prompt"]);
            assert_eq!(out.reason, FinishReason::Length);
        }
    }
}

#[test]
fn eos_and_stop_tokens_finish_with_stop_on_that_token() {
    let prompt: Vec<TokenId> = [500, 479, 418, 463].map(TokenId).to_vec();
    let free_run = run(&mut engine("llama3", 64, 512), &[(prompt.clone(), greedy(8))]);
    let expected = &free_run[0].tokens;
    assert_eq!(expected.len(), 8);
    let third = expected[2];
    // The first occurrence of `third` ends the request.
    let stop_at = expected.iter().position(|&t| t == third).unwrap() + 1;

    // As an end-of-sequence id of the engine.
    let config = EngineConfig {
        block_size: 4,
        num_kv_blocks: 64,
        eos_token_ids: vec![third],
        kv_cache_dtype: KvCacheDtype::F32,
        ..EngineConfig::default()
    };
    let mut core =
        EngineCore::new(load_model(&fixture("llama3"), &cpu()).unwrap().model, config).unwrap();
    let params = SamplingParams::greedy(8);
    let out = run(&mut core, &[(prompt.clone(), params.clone())]);
    assert_eq!(
        out[0],
        Finished { tokens: expected[..stop_at].to_vec(), reason: FinishReason::Stop }
    );
    // `ignore_eos` runs through it.
    let out = run(&mut core, &[(prompt.clone(), greedy(8))]);
    assert_eq!(out[0], Finished { tokens: expected.clone(), reason: FinishReason::Length });

    // As a stop token of the request, which `ignore_eos` does not affect.
    let params = SamplingParams { stop_token_ids: vec![third], ..greedy(8) };
    let out = run(&mut engine("llama3", 64, 512), &[(prompt, params)]);
    assert_eq!(
        out[0],
        Finished { tokens: expected[..stop_at].to_vec(), reason: FinishReason::Stop }
    );
}

#[test]
fn a_seed_gives_the_same_tokens_alone_and_in_a_batch() {
    let params = |seed| SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        top_k: 50,
        seed: Some(seed),
        ..greedy(12)
    };
    let target = ([500, 10, 20, 30].map(TokenId).to_vec(), params(7));
    let mut core = engine("llama3", 256, 512);
    let alone = run(&mut core, std::slice::from_ref(&target));
    let others = [
        ([500, 1, 2].map(TokenId).to_vec(), params(1)),
        target.clone(),
        ([vec![TokenId(500)], vec![TokenId(99); 9]].concat(), params(3)),
    ];
    let batched = run(&mut core, &others);
    assert_eq!(alone[0], batched[1]);
    let reseeded = run(&mut core, &[(target.0, params(8))]);
    assert_ne!(alone[0].tokens, reseeded[0].tokens);
}

#[test]
fn bad_requests_are_refused_and_leak_nothing() {
    // 128 blocks of 4 tokens: max_model_len is the fixture's 512 positions.
    let mut core = engine("llama3", 128, 512);
    let mut refuse = |prompt: Vec<TokenId>, params: SamplingParams| {
        let err = core.add_request(prompt, params, 0).unwrap_err();
        assert!(matches!(err, EngineError::Rejected(_)), "{err}");
        err.to_string()
    };
    assert!(refuse(vec![], greedy(4)).contains("at least one token"));
    let bad = SamplingParams { temperature: -1.0, ..SamplingParams::default() };
    let err = refuse(vec![TokenId(1)], bad);
    assert!(err.contains("temperature"), "{err}");
    let err = refuse(vec![TokenId(1); 600], greedy(4));
    assert!(err.contains("maximum context length is 512"), "{err}");
    let err = refuse(vec![TokenId(100_000)], greedy(4));
    assert!(err.contains("outside the vocabulary"), "{err}");
    let stop = SamplingParams { stop_token_ids: vec![TokenId(512)], ..greedy(4) };
    let err = refuse(vec![TokenId(1)], stop);
    assert!(err.contains("stop_token_ids"), "{err}");
    assert!(!core.has_unfinished());
    assert_no_blocks_held(&core);
    // The engine still serves, and returns every block again.
    let out = run(&mut core, &[(vec![TokenId(1); 5], greedy(3))]);
    assert_eq!(out[0].tokens.len(), 3);
}

#[test]
fn an_abort_between_steps_frees_the_request_s_blocks() {
    let mut core = engine("llama3", 64, 8);
    let id = core.add_request(vec![TokenId(7); 30], greedy(20), 0).unwrap();
    core.step().unwrap();
    assert!(core.stats().kv_usage > 0.0);
    assert!(core.abort(id));
    assert!(!core.abort(id), "a second abort finds nothing");
    assert!(!core.has_unfinished());
    assert_no_blocks_held(&core);
}
