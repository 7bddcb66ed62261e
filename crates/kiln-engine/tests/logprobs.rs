//! Log-probabilities against transformers, n>1 sharing, and the per-request parameters the
//! server passes through (logit bias, min_tokens, out-of-vocabulary ids), on the llama3 fixture.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::path::PathBuf;

use kiln_core::{SamplingParams, TokenId};
use kiln_engine::{EngineConfig, EngineCore, EngineError, EngineHandle, EngineOutput};
use kiln_engine::{KvCacheDtype, PromptLogprobs, SchedulerConfig};
use kiln_kernels::Cpu;
use kiln_models::{WeightStore, load_model};
use serde_json::Value;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama3")
}

fn engine(max_num_batched_tokens: usize) -> EngineCore {
    let model = load_model(&fixture(), &std::sync::Arc::new(Cpu::new(2))).unwrap().model;
    let config = EngineConfig {
        // Rows sampled on two host threads, as the CLI does on the CPU backend's pool.
        host_pool: kiln_engine::HostPool::new(std::sync::Arc::new(kiln_models::HostThreads::new(
            2,
        ))),
        block_size: 4,
        num_kv_blocks: 128,
        max_model_len: Some(64),
        scheduler: SchedulerConfig { max_num_batched_tokens, ..SchedulerConfig::default() },
        // The references are float32: keep K and V unrounded.
        kv_cache_dtype: KvCacheDtype::F32,
        ..EngineConfig::default()
    };
    EngineCore::new(model, config).unwrap()
}

/// transformers' reference: prompt + greedy ids and the logits after each of them.
fn reference() -> (Vec<u32>, usize, Vec<Vec<f32>>) {
    let dir = fixture();
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let case = &r["cases"][0];
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    let mut tokens = ids(&case["prompt_ids"]);
    let num_prompt = tokens.len();
    tokens.extend(ids(&case["greedy_ids"]));
    let vocab = r["dims"]["vocab_size"].as_u64().unwrap() as usize;
    let store = WeightStore::open_files(&[dir.join("reference_logits.safetensors")]).unwrap();
    let m = store.matrix(case["logits_tensor"].as_str().unwrap(), tokens.len(), vocab).unwrap();
    let logits = m.to_f32_vec().unwrap().chunks_exact(vocab).map(<[f32]>::to_vec).collect();
    (tokens, num_prompt, logits)
}

fn log_softmax_at(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    logits[token as usize] - max - z.ln() as f32
}

fn run_one(core: &mut EngineCore, prompt: &[u32], params: SamplingParams) -> Vec<EngineOutput> {
    let prompt = prompt.iter().map(|&t| TokenId(t)).collect();
    let id = core.add_request(prompt, params, 0).unwrap();
    let mut outs = Vec::new();
    while core.has_unfinished() {
        outs.extend(core.step().unwrap().into_iter().filter(|o| o.id == id));
    }
    outs
}

fn prompt_logprobs_of(core: &mut EngineCore, tokens: &[u32]) -> PromptLogprobs {
    let params =
        SamplingParams { prompt_logprobs: Some(3), ignore_eos: true, ..SamplingParams::greedy(1) };
    let outs = run_one(core, tokens, params);
    assert_eq!(outs.len(), 1);
    outs[0].prompt_logprobs.clone().unwrap()
}

#[test]
fn prompt_logprobs_match_transformers_and_do_not_depend_on_chunking() {
    let (tokens, _, logits) = reference();
    let one_shot = prompt_logprobs_of(&mut engine(2048), &tokens);
    assert_eq!(one_shot.len(), tokens.len());
    assert!(one_shot[0].is_none());
    for (p, entry) in one_shot.iter().enumerate().skip(1) {
        let lp = entry.as_ref().unwrap();
        assert_eq!(lp.chosen.token.0, tokens[p]);
        let want = log_softmax_at(&logits[p - 1], tokens[p]);
        assert!(
            (lp.chosen.logprob - want).abs() < 2e-3,
            "position {p}: {} vs {want}",
            lp.chosen.logprob
        );
        assert_eq!(lp.top.len(), 3);
        assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
    }
    // Chunks of 3 tokens: the same values, bit for bit.
    let chunked = prompt_logprobs_of(&mut engine(3), &tokens);
    assert_eq!(chunked, one_shot);
    // A warm prefix cache is bypassed: still every position.
    let mut core = engine(2048);
    run_one(&mut core, &tokens, SamplingParams { ignore_eos: true, ..SamplingParams::greedy(1) });
    assert_eq!(prompt_logprobs_of(&mut core, &tokens), one_shot);
}

#[test]
fn sampled_logprobs_match_transformers() {
    let (tokens, num_prompt, logits) = reference();
    let num_new = tokens.len() - num_prompt;
    let params =
        SamplingParams { logprobs: Some(2), ignore_eos: true, ..SamplingParams::greedy(num_new) };
    let outs = run_one(&mut engine(2048), &tokens[..num_prompt], params);
    assert_eq!(outs.len(), num_new);
    for (i, out) in outs.iter().enumerate() {
        assert_eq!(out.new_token.0, tokens[num_prompt + i]);
        let lp = out.logprobs.as_ref().unwrap();
        assert_eq!(lp.chosen.rank, 1);
        assert_eq!(lp.top[0].token, out.new_token);
        let want = log_softmax_at(&logits[num_prompt + i - 1], out.new_token.0);
        assert!((lp.chosen.logprob - want).abs() < 2e-3);
    }
    assert!(outs[0].first.is_some() && outs[1..].iter().all(|o| o.first.is_none()));
}

#[test]
fn parallel_samples_of_one_prompt_share_its_full_blocks() {
    let (tokens, num_prompt, _) = reference();
    let prompt: Vec<TokenId> = tokens.iter().take(18).map(|&t| TokenId(t)).collect();
    assert!(num_prompt < 18);
    let handle = EngineHandle::spawn(engine(2048)).unwrap();
    let params = |seed| SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ignore_eos: true,
        max_tokens: 6,
        ..SamplingParams::default()
    };
    let streams: Vec<_> =
        (0..4).map(|i| handle.submit(prompt.clone(), params(i), 0).unwrap()).collect();
    let mut cached = Vec::new();
    for s in streams {
        let outs: Vec<EngineOutput> = s.map(Result::unwrap).collect();
        assert_eq!(outs.len(), 6);
        cached.push(outs[0].first.unwrap().num_cached_tokens);
    }
    // 18 tokens = 4 full blocks of 4 and a partial one: samples after the first reuse 16.
    assert_eq!(cached, vec![0, 16, 16, 16]);
    let start = std::time::Instant::now();
    let mut stats = handle.stats();
    while stats.num_running > 0 && start.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(5));
        stats = handle.stats();
    }
    assert_eq!(stats.prefix_cache.num_hit_tokens, 48);
    assert_eq!(stats.kv_usage, 0.0);
}

#[test]
fn out_of_vocabulary_ids_are_refused_and_change_nothing() {
    let mut core = engine(2048);
    let bad_prompt = core.add_request(vec![TokenId(3), TokenId(512)], SamplingParams::greedy(2), 0);
    assert_eq!(
        bad_prompt.unwrap_err().to_string(),
        "prompt: token id 512 is outside the vocabulary (valid ids are 0 to 511)"
    );
    let bias =
        SamplingParams { logit_bias: vec![(TokenId(9999), 1.0)], ..SamplingParams::greedy(2) };
    assert!(matches!(core.add_request(vec![TokenId(3)], bias, 0), Err(EngineError::Rejected(_))));
    let stop = SamplingParams { stop_token_ids: vec![TokenId(600)], ..SamplingParams::greedy(2) };
    assert!(matches!(core.add_request(vec![TokenId(3)], stop, 0), Err(EngineError::Rejected(_))));
    assert!(!core.has_unfinished());
    assert_eq!(core.stats().kv_usage, 0.0);
}

#[test]
fn min_tokens_holds_back_the_stop_token() {
    let (tokens, num_prompt, _) = reference();
    let prompt = &tokens[..num_prompt];
    let free = run_one(
        &mut engine(2048),
        prompt,
        SamplingParams { ignore_eos: true, ..SamplingParams::greedy(4) },
    );
    // Make the first greedy token a stop token: without min_tokens the request ends at once.
    let stop = free[0].new_token;
    let stopping = SamplingParams { stop_token_ids: vec![stop], ..SamplingParams::greedy(4) };
    assert_eq!(run_one(&mut engine(2048), prompt, stopping.clone()).len(), 1);
    let held = run_one(&mut engine(2048), prompt, SamplingParams { min_tokens: 3, ..stopping });
    assert!(held.len() >= 3);
    assert!(held[..2].iter().all(|o| o.new_token != stop));
}
