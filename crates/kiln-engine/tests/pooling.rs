//! Pooling requests through the engine, on the embedding fixtures (`tests/fixtures/embedding`):
//! each request's vector is sentence-transformers', and bitwise the same alone, batched with
//! others, prefilled in chunks, with asynchronous scheduling and in a cache too small for all;
//! a pooling engine refuses generation requests and a generative one pooling requests.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_engine::{
    EngineConfig, EngineCore, POOLED_TOKEN, PoolerConfig, PoolingParams, PreparedRequest,
    SchedulerConfig, SpeculativeConfig,
};
use kiln_kernels::Cpu;
use kiln_models::{KvCacheDtype, LoadOptions, load_model, load_model_with};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/embedding").join(name)
}

const MODELS: [&str; 2] = ["qwen3-embed", "llama3-mean"];

/// `(prompt ids, sentence-transformers' embeddings)` of a fixture.
fn reference(name: &str) -> (Vec<Vec<TokenId>>, Vec<Vec<f32>>) {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let ids: Vec<Vec<u32>> = serde_json::from_value(v["prompt_ids"].clone()).unwrap();
    let ids = ids.into_iter().map(|p| p.into_iter().map(TokenId).collect()).collect();
    (ids, serde_json::from_value(v["embeddings"].clone()).unwrap())
}

fn engine(name: &str, tweak: impl FnOnce(&mut EngineConfig)) -> EngineCore {
    let options = LoadOptions { pooling: true, ..LoadOptions::default() };
    let model = load_model_with(&fixture(name), &options, &Arc::new(Cpu::new(2))).unwrap().model;
    let pooler = PoolerConfig::of_model(&fixture(name)).unwrap().unwrap();
    let mut config = EngineConfig {
        block_size: 4,
        num_kv_blocks: 256,
        max_model_len: Some(96),
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 64,
            enable_prefix_caching: false,
            ..SchedulerConfig::default()
        },
        pooling: Some(pooler),
        kv_cache_dtype: KvCacheDtype::F32,
        ..EngineConfig::default()
    };
    tweak(&mut config);
    EngineCore::new(model, config).unwrap()
}

fn pooling_request(
    core: &EngineCore,
    prompt: &[TokenId],
    params: PoolingParams,
) -> PreparedRequest {
    let vocab = core.model().config().vocab_size;
    PreparedRequest::new(prompt.to_vec(), SamplingParams::greedy(1), vocab, None)
        .unwrap()
        .with_pooling(params)
}

/// Request ids, unique across the tests' engines.
static NEXT_ID: AtomicU64 = AtomicU64::new(100);

/// Runs pooling requests to the end: each one's vector, in order.
fn embed(core: &mut EngineCore, prompts: &[Vec<TokenId>], params: PoolingParams) -> Vec<Vec<f32>> {
    let ids: Vec<RequestId> = prompts
        .iter()
        .map(|prompt| {
            let id = RequestId(NEXT_ID.fetch_add(1, Ordering::Relaxed));
            core.add_prepared(id, pooling_request(core, prompt, params), 0).unwrap();
            id
        })
        .collect();
    let mut vectors: HashMap<RequestId, Vec<f32>> = HashMap::new();
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            assert_eq!(out.new_token, POOLED_TOKEN);
            assert!(out.finish_reason.is_some(), "a pooling request reports once, at its end");
            assert!(vectors.insert(out.id, out.pooled.unwrap()).is_none());
        }
    }
    assert_eq!(core.num_live_requests(), 0);
    ids.iter().map(|id| vectors.remove(id).unwrap()).collect()
}

#[test]
fn vectors_are_sentence_transformers_embeddings() {
    for name in MODELS {
        let (prompts, want) = reference(name);
        let got = embed(&mut engine(name, |_| {}), &prompts, PoolingParams::default());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let diff = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(diff <= 1e-4, "{name} text {i}: max |diff| {diff}");
        }
    }
}

#[test]
fn a_vector_is_the_same_alone_batched_chunked_and_async() {
    for name in MODELS {
        let (prompts, _) = reference(name);
        let params = PoolingParams::default();
        let mut plain = engine(name, |_| {});
        let alone: Vec<Vec<f32>> = prompts
            .iter()
            .map(|p| embed(&mut plain, std::slice::from_ref(p), params).remove(0))
            .collect();
        assert_eq!(embed(&mut plain, &prompts, params), alone, "{name}: batched");
        let mut chunked = engine(name, |c| c.scheduler.max_num_batched_tokens = 5);
        assert_eq!(embed(&mut chunked, &prompts, params), alone, "{name}: chunks of 5 tokens");
        let mut asynchronous = engine(name, |c| c.async_scheduling = true);
        assert_eq!(embed(&mut asynchronous, &prompts, params), alone, "{name}: async");
        // 16 blocks of 4 tokens for prompts of 220 tokens in all, 8 tokens a step: requests
        // wait for the blocks of those before them, prefilled beside whichever are running.
        let mut tight = engine(name, |c| {
            c.num_kv_blocks = 16;
            c.max_model_len = Some(60);
            c.scheduler.max_num_batched_tokens = 8;
        });
        let many: Vec<Vec<TokenId>> = prompts.iter().chain(&prompts).cloned().collect();
        let got = embed(&mut tight, &many, params);
        assert_eq!(&got[..prompts.len()], &alone[..], "{name}: in a small cache");
        assert_eq!(&got[prompts.len()..], &alone[..], "{name}: in a small cache");
    }
}

#[test]
fn dimensions_and_normalize_shape_the_vector() {
    let (prompts, _) = reference("llama3-mean");
    let mut core = engine("llama3-mean", |_| {});
    let full = embed(&mut core, &prompts[..1], PoolingParams::default()).remove(0);
    let params = PoolingParams { dimensions: Some(16), normalize: Some(true) };
    let short = embed(&mut core, &prompts[..1], params).remove(0);
    let norm = full[..16].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert_eq!(short.len(), 16);
    for (s, f) in short.iter().zip(&full) {
        assert!((s - f / norm).abs() < 1e-6);
    }
    for bad in [0, 65] {
        let params = PoolingParams { dimensions: Some(bad), normalize: None };
        let e = core.add_prepared(RequestId(1), pooling_request(&core, &prompts[0], params), 0);
        assert!(e.unwrap_err().to_string().contains("dimensions"), "{bad}");
    }
    assert_eq!(core.num_live_requests(), 0);
}

#[test]
fn each_engine_takes_only_its_kind_of_request() {
    let (prompts, _) = reference("qwen3-embed");
    let mut pooling = engine("qwen3-embed", |_| {});
    let vocab = pooling.model().config().vocab_size;
    let generate = PreparedRequest::new(prompts[0].clone(), SamplingParams::greedy(4), vocab, None);
    let e = pooling.add_prepared(RequestId(1), generate.unwrap(), 0).unwrap_err().to_string();
    assert!(e.contains("pooling model"), "{e}");
    let two_tokens =
        PreparedRequest::new(prompts[0].clone(), SamplingParams::greedy(2), vocab, None).unwrap();
    let e = pooling
        .add_prepared(RequestId(2), two_tokens.with_pooling(PoolingParams::default()), 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("one output token"), "{e}");
    assert_eq!(pooling.num_live_requests(), 0);

    let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models");
    let model = load_model(&models.join("qwen3"), &Arc::new(Cpu::new(1))).unwrap().model;
    let mut generative = EngineCore::new(model, EngineConfig::default()).unwrap();
    let request = pooling_request(&generative, &prompts[0], PoolingParams::default());
    let e = generative.add_prepared(RequestId(3), request, 0).unwrap_err().to_string();
    assert!(e.contains("not a pooling model"), "{e}");
}

#[test]
fn mean_pooling_refuses_the_prefix_cache_and_speculation() {
    let options = LoadOptions { pooling: true, ..LoadOptions::default() };
    let load = || {
        load_model_with(&fixture("llama3-mean"), &options, &Arc::new(Cpu::new(1))).unwrap().model
    };
    let pooler = PoolerConfig::of_model(&fixture("llama3-mean")).unwrap();
    let config = EngineConfig { pooling: pooler, ..EngineConfig::default() };
    // The prefix cache is on unless turned off.
    let e = EngineCore::new(load(), config).err().unwrap().to_string();
    assert!(e.contains("prefix cache"), "{e}");
    let mut config = EngineConfig { pooling: pooler, ..EngineConfig::default() };
    config.scheduler.enable_prefix_caching = false;
    config.speculative = Some(SpeculativeConfig::ngram(3, 1, 3));
    let e = EngineCore::new(load(), config).err().unwrap().to_string();
    assert!(e.contains("speculative"), "{e}");
    // Last-token pooling keeps it: a hit still computes the last token.
    let last = PoolerConfig::of_model(&fixture("qwen3-embed")).unwrap();
    let options_ok = EngineConfig {
        pooling: last,
        kv_cache_dtype: KvCacheDtype::F32,
        ..EngineConfig::default()
    };
    let model =
        load_model_with(&fixture("qwen3-embed"), &options, &Arc::new(Cpu::new(1))).unwrap().model;
    let mut core = EngineCore::new(model, options_ok).unwrap();
    let (prompts, want) = reference("qwen3-embed");
    let twice: Vec<Vec<TokenId>> = vec![prompts[3].clone(), prompts[3].clone()];
    let first = embed(&mut core, &twice[..1], PoolingParams::default());
    let hit = embed(&mut core, &twice[1..], PoolingParams::default());
    assert_eq!(first, hit);
    assert!(
        core.stats().prefix_cache.num_hit_tokens > 0,
        "the second request hit the prefix cache"
    );
    let diff = hit[0].iter().zip(&want[3]).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(diff <= 1e-4);
}
