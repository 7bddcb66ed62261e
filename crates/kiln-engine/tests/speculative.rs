//! Speculative decoding (prompt lookup and draft models) on the tiny fixture models: every
//! request yields exactly the tokens it yields without speculation (greedy and seeded sampling,
//! with penalties, stop ids, `max_tokens` landing inside an accepted run, chunked prefill, prefix
//! caching and preemption), drafts are really proposed and accepted (so the equality is not
//! vacuous), and aborts mid-verification free every block. A fixture drafting for itself must
//! have every draft accepted, greedy or sampled: its draft KV cache (shared block tables, scratch
//! blocks, catch-up after rejections and preemptions) must then hold exactly the target's keys,
//! and its drafts must be drawn with the request's own sampler and random numbers.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::collections::HashMap;
use std::path::PathBuf;

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_engine::{EngineConfig, EngineCore, SchedulerConfig, SpeculativeConfig, TokenTree};
use kiln_kernels::Cpu;
use kiln_models::load_model;

const FIXTURES: [&str; 12] = [
    "llama2",
    "llama3",
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
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

struct Setup {
    num_kv_blocks: usize,
    max_num_batched_tokens: usize,
    prefix_caching: bool,
}

const ROOMY: Setup =
    Setup { num_kv_blocks: 512, max_num_batched_tokens: 2048, prefix_caching: true };

fn engine(name: &str, setup: &Setup, spec: Option<SpeculativeConfig>) -> EngineCore {
    try_engine(name, None, setup, spec).unwrap()
}

/// An engine on fixture `name`, with fixture `draft` as its draft model when given.
fn try_engine(
    name: &str,
    draft: Option<&str>,
    setup: &Setup,
    spec: Option<SpeculativeConfig>,
) -> Result<EngineCore, kiln_engine::EngineError> {
    let backend = std::sync::Arc::new(Cpu::new(2));
    let model = load_model(&fixture(name), &backend).unwrap().model;
    let draft = draft.map(|d| load_model(&fixture(d), &backend).unwrap().model);
    let config = EngineConfig {
        // Rows sampled on two host threads, as the CLI does on the CPU backend's pool.
        host_pool: kiln_engine::HostPool::new(std::sync::Arc::new(kiln_models::HostThreads::new(
            2,
        ))),
        block_size: 4,
        num_kv_blocks: setup.num_kv_blocks,
        max_model_len: Some(96),
        scheduler: SchedulerConfig {
            max_num_batched_tokens: setup.max_num_batched_tokens,
            enable_prefix_caching: setup.prefix_caching,
            ..SchedulerConfig::default()
        },
        speculative: spec,
        ..EngineConfig::default()
    };
    EngineCore::with_draft_model(model, draft, config)
}

fn ngram(k: usize) -> SpeculativeConfig {
    let mut config = SpeculativeConfig::ngram(k, 1, 3);
    config.disable_by_batch_size = 64;
    config
}

/// Prompt lookup drafting a token tree: three candidates at the root, two after the best, and
/// paths three deep.
fn ngram_tree() -> SpeculativeConfig {
    let shape = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)]";
    let mut config = SpeculativeConfig::ngram_tree(TokenTree::parse(shape, 32).unwrap(), 1, 3);
    config.disable_by_batch_size = 64;
    config
}

/// A prompt that repeats a pseudo-random span of `span` tokens (so prompt lookup finds matches),
/// with a varying head.
fn repetitive_prompt(seed: u32, span: usize, vocab: u32) -> Vec<TokenId> {
    let piece: Vec<u32> =
        (0..span as u32).map(|i| (seed * 7919 + i * 131 + i * i * 17) % (vocab - 3) + 3).collect();
    let mut p = vec![TokenId(seed % (vocab - 3) + 3)];
    for _ in 0..3 {
        p.extend(piece.iter().map(|&t| TokenId(t)));
    }
    p
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
}

fn sampled(seed: u64, max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.7,
        top_p: 0.95,
        seed: Some(seed),
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

/// Eight requests: greedy, seeded sampling, penalties, a stop id, short `max_tokens`.
fn requests(vocab: u32) -> Vec<(Vec<TokenId>, SamplingParams)> {
    (0..8u32)
        .map(|i| {
            let prompt = repetitive_prompt(i + 1, 4 + i as usize, vocab);
            let params = match i % 4 {
                0 => greedy(24 + i as usize),
                1 => sampled(u64::from(i), 24),
                2 => {
                    SamplingParams { repetition_penalty: 1.2, frequency_penalty: 0.3, ..greedy(20) }
                }
                _ => greedy(3 + i as usize / 4),
            };
            (prompt, params)
        })
        .collect()
}

/// Runs every request to completion; tokens in request order.
fn run(core: &mut EngineCore, requests: &[(Vec<TokenId>, SamplingParams)]) -> Vec<Vec<TokenId>> {
    let ids: Vec<RequestId> = requests
        .iter()
        .map(|(p, params)| core.add_request(p.clone(), params.clone(), 0).unwrap())
        .collect();
    let mut tokens: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            tokens.entry(out.id).or_default().push(out.new_token);
        }
    }
    let stats = core.stats();
    assert_eq!((stats.kv_usage, stats.num_running, stats.num_waiting), (0.0, 0, 0));
    ids.iter().map(|id| tokens.remove(id).unwrap()).collect()
}

#[test]
fn speculated_equals_not_on_every_fixture() {
    let mut accepted = 0;
    for name in FIXTURES {
        let vocab = engine(name, &ROOMY, None).model().config().vocab_size as u32;
        let reqs = requests(vocab);
        let expected = run(&mut engine(name, &ROOMY, None), &reqs);
        for k in [1, 4] {
            let mut core = engine(name, &ROOMY, Some(ngram(k)));
            assert_eq!(run(&mut core, &reqs), expected, "{name}, k = {k}");
            let spec = core.stats().spec_decode;
            assert!(spec.num_drafts > 0, "{name}: nothing drafted");
            assert!(spec.num_accepted_tokens <= spec.num_draft_tokens);
            accepted += spec.num_accepted_tokens;
        }
    }
    assert!(accepted > 0, "no draft was ever accepted: the equality above proves nothing");
}

#[test]
fn speculated_equals_not_with_chunks_prefix_cache_and_preemption() {
    for (name, vocab) in [("llama3", 512), ("qwen3moe", 503)] {
        speculated_equals_not_through_chunks_and_preemption(name, vocab);
    }
}

fn speculated_equals_not_through_chunks_and_preemption(name: &str, vocab: u32) {
    let reqs = requests(vocab);
    let expected = run(&mut engine(name, &ROOMY, None), &reqs);
    // Small steps: prompts prefilled in chunks, drafts cut by the token budget.
    let chunked = Setup { num_kv_blocks: 512, max_num_batched_tokens: 6, prefix_caching: true };
    let mut core = engine(name, &chunked, Some(ngram(4)));
    assert_eq!(run(&mut core, &reqs), expected);
    assert!(core.stats().spec_decode.num_drafts > 0);
    // Few blocks: requests are preempted (lookahead slots for drafts included) and resumed.
    for prefix_caching in [false, true] {
        let tight = Setup { num_kv_blocks: 40, max_num_batched_tokens: 2048, prefix_caching };
        let mut core = engine(name, &tight, Some(ngram(4)));
        assert_eq!(run(&mut core, &reqs), expected);
        let stats = core.stats();
        assert!(stats.num_preemptions > 0 && stats.spec_decode.num_drafts > 0, "{stats:?}");
    }
    // A second run over a warm prefix cache.
    let mut core = engine(name, &ROOMY, Some(ngram(4)));
    assert_eq!(run(&mut core, &reqs), expected);
    assert_eq!(run(&mut core, &reqs), expected);
    assert!(core.stats().prefix_cache.num_hit_tokens > 0);
}

/// Token trees: every request yields the tokens it yields without speculation, on every fixture
/// and through chunked prefill, preemption and prefix-cache hits. Verifications accepting two
/// or more tokens move the accepted path's K/V from its nodes' slots to its positions' (the
/// second node of a path is never the second slot with three root candidates), so the later
/// tokens being equal proves the move.
#[test]
fn token_trees_equal_not_speculating() {
    let (mut accepted, mut deep) = (0, 0);
    for name in FIXTURES {
        let vocab = engine(name, &ROOMY, None).model().config().vocab_size as u32;
        let reqs = requests(vocab);
        let expected = run(&mut engine(name, &ROOMY, None), &reqs);
        let mut core = engine(name, &ROOMY, Some(ngram_tree()));
        assert_eq!(run(&mut core, &reqs), expected, "{name}");
        let spec = core.stats().spec_decode;
        assert!(spec.num_drafts > 0, "{name}: nothing drafted");
        accepted += spec.num_accepted_tokens;
        deep += spec.num_accepted_tokens_per_pos[1];
    }
    assert!(accepted > deep && deep > 0, "{accepted} accepted, {deep} at depth 2: no path moved");
    let reqs = requests(512);
    let expected = run(&mut engine("llama3", &ROOMY, None), &reqs);
    let chunked = Setup { num_kv_blocks: 512, max_num_batched_tokens: 6, prefix_caching: true };
    let tight = Setup { num_kv_blocks: 40, max_num_batched_tokens: 2048, prefix_caching: true };
    for setup in [chunked, tight] {
        let mut core = engine("llama3", &setup, Some(ngram_tree()));
        assert_eq!(run(&mut core, &reqs), expected);
        assert_eq!(run(&mut core, &reqs), expected, "over a warm prefix cache");
        core.scheduler().check_invariants().unwrap();
    }
    abort_while_speculating(&mut engine("llama3", &ROOMY, Some(ngram_tree())));
    // A tree its method cannot draft is refused before anything changes.
    let mut core = engine("llama3", &ROOMY, Some(ngram(4)));
    let mut bad = SpeculativeConfig::draft_model(3, "llama3");
    bad.token_tree = ngram_tree().token_tree;
    assert!(core.set_speculative_config(Some(bad)).is_err());
    assert_eq!(run(&mut core, &reqs), expected);
    assert!(core.stats().spec_decode.num_drafts > 0, "still speculating as before");
}

#[test]
fn stop_ids_inside_an_accepted_run_end_the_request_there() {
    let name = "qwen3";
    let prompt = repetitive_prompt(5, 6, 503);
    let free = run(&mut engine(name, &ROOMY, None), &[(prompt.clone(), greedy(40))]).remove(0);
    // Stop at the first token that was generated more than once: a looping output, drafted.
    let stop = free.iter().enumerate().find(|(i, t)| free[..*i].contains(t)).map(|(_, t)| *t);
    let stop = stop.unwrap_or(free[free.len() / 2]);
    let params = SamplingParams { stop_token_ids: vec![stop], ..greedy(40) };
    let expected = run(&mut engine(name, &ROOMY, None), &[(prompt.clone(), params.clone())]);
    let mut core = engine(name, &ROOMY, Some(ngram(6)));
    assert_eq!(run(&mut core, &[(prompt, params)]), expected);
    assert_eq!(expected[0].last(), Some(&stop));
}

/// Tokens with the bits of their log-probabilities: a wrong K/V anywhere shows here even where
/// it leaves the argmax alone.
fn with_logprobs(core: &mut EngineCore, prompt: &[TokenId]) -> Vec<(TokenId, u32, usize)> {
    let params = SamplingParams { logprobs: Some(2), ..greedy(40) };
    core.add_request(prompt.to_vec(), params, 0).unwrap();
    let mut out = Vec::new();
    while core.has_unfinished() {
        for o in core.step().unwrap() {
            let lp = o.logprobs.unwrap();
            out.push((o.new_token, lp.chosen.logprob.to_bits(), lp.top.len()));
        }
    }
    out
}

/// Every accepted token has its log-probabilities, bitwise those of decoding alone; with token
/// trees (on the fixtures whose outputs repeat enough to accept paths two deep), this also
/// proves each accepted path's K/V was moved to its positions.
#[test]
fn logprobs_are_reported_for_every_accepted_token() {
    for (name, spec) in [("llama3", ngram(4)), ("qwen3", ngram_tree()), ("gemma3", ngram_tree())] {
        let mut core = engine(name, &ROOMY, Some(spec));
        let vocab = core.model().config().vocab_size as u32;
        for seed in 1..=8 {
            let prompt = repetitive_prompt(seed, 5, vocab);
            let expected = with_logprobs(&mut engine(name, &ROOMY, None), &prompt);
            assert_eq!(with_logprobs(&mut core, &prompt), expected, "{name}, prompt {seed}");
        }
        let spec = core.stats().spec_decode;
        let deep = spec.num_accepted_tokens_per_pos[usize::from(name != "llama3")];
        assert!(deep > 0, "{name}: {spec:?}");
    }
}

/// Six requests; once drafts are verified, three are aborted at once and the rest one per step:
/// every block must come back.
fn abort_while_speculating(core: &mut EngineCore) {
    let ids: Vec<_> = (0..6)
        .map(|i| core.add_request(repetitive_prompt(i + 1, 5, 512), greedy(60), 0).unwrap())
        .collect();
    let mut steps = 0;
    while core.stats().spec_decode.num_drafts == 0 {
        core.step().unwrap();
        steps += 1;
        assert!(steps < 200, "never drafted");
    }
    for id in &ids[..3] {
        assert!(core.abort(*id));
    }
    while core.has_unfinished() {
        core.step().unwrap();
        if let Some(id) = ids[3..].iter().find(|id| core.scheduler().request(**id).is_some()) {
            core.abort(*id);
        }
    }
    let stats = core.stats();
    assert_eq!((stats.kv_usage, stats.num_running, stats.num_waiting), (0.0, 0, 0));
    core.scheduler().check_invariants().unwrap();
}

#[test]
fn aborts_during_speculation_free_every_block() {
    abort_while_speculating(&mut engine("llama3", &ROOMY, Some(ngram(4))));
}

#[test]
fn no_drafts_at_or_above_disable_by_batch_size() {
    let mut config = SpeculativeConfig::ngram(4, 1, 3);
    config.disable_by_batch_size = 2;
    let reqs: Vec<_> = (0..3).map(|i| (repetitive_prompt(i + 1, 5, 512), greedy(16))).collect();
    let expected = run(&mut engine("llama3", &ROOMY, None), &reqs);
    let mut core = engine("llama3", &ROOMY, Some(config.clone()));
    assert_eq!(run(&mut core, &reqs), expected);
    // Three requests run together from the first step to the end... until the short ones end;
    // with one left it drafts.
    let mut alone = engine("llama3", &ROOMY, Some(config));
    assert_eq!(run(&mut alone, &reqs[..1]), expected[..1]);
    assert!(alone.stats().spec_decode.num_drafts > 0);
    let together = core.stats().spec_decode.num_drafts;
    assert_eq!(together, 0, "three running requests, threshold 2: {together} drafts");
}

fn draft_model(k: usize, name: &str) -> SpeculativeConfig {
    let mut config = SpeculativeConfig::draft_model(k, name);
    config.disable_by_batch_size = 64;
    config
}

/// Greedy requests only: a model drafting for itself proposes exactly what it then samples.
fn greedy_requests(vocab: u32) -> Vec<(Vec<TokenId>, SamplingParams)> {
    (0..6u32)
        .map(|i| (repetitive_prompt(i + 1, 3 + i as usize, vocab), greedy(20 + i as usize)))
        .collect()
}

#[test]
fn draft_model_speculation_equals_not() {
    // A fixture drafting for itself (everything accepted), and a different model with the same
    // vocabulary (mostly rejected: the verification is what keeps the tokens).
    for (name, draft, vocab) in
        [("llama3", "llama3", 512), ("llama3", "mistral", 512), ("qwen2", "qwen3", 503)]
    {
        let reqs = requests(vocab);
        let expected = run(&mut engine(name, &ROOMY, None), &reqs);
        for k in [1, 3] {
            let mut core =
                try_engine(name, Some(draft), &ROOMY, Some(draft_model(k, draft))).unwrap();
            assert_eq!(run(&mut core, &reqs), expected, "{name} drafted by {draft}, k = {k}");
            let spec = core.stats().spec_decode;
            assert!(spec.num_drafts > 0, "{name} drafted by {draft}: nothing drafted");
        }
    }
}

/// Greedy and sampled requests of every kind the sampler has (temperature alone, top-k, top-p,
/// min-p, penalties, bias, `min_tokens`; seeded, so every run draws the same): a model drafting for
/// itself draws each draft as the request then samples it.
fn self_draft_requests(vocab: u32) -> Vec<(Vec<TokenId>, SamplingParams)> {
    let hot = |seed| SamplingParams { temperature: 1.0, top_p: 1.0, ..sampled(seed, 22) };
    let kinds = [
        greedy(20),
        sampled(11, 24),
        hot(12),
        SamplingParams { top_k: 8, presence_penalty: 0.5, ..hot(13) },
        SamplingParams { min_p: 0.05, repetition_penalty: 1.3, ..hot(14) },
        SamplingParams { logit_bias: vec![(TokenId(7), 2.0)], min_tokens: 10, ..hot(15) },
        SamplingParams { repetition_penalty: 1.2, frequency_penalty: 0.3, ..greedy(21) },
    ];
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, params)| (repetitive_prompt(i as u32 + 1, 3 + i, vocab), params))
        .collect()
}

#[test]
fn a_model_drafting_for_itself_has_every_draft_accepted() {
    let reqs = self_draft_requests(512);
    let expected = run(&mut engine("llama3", &ROOMY, None), &reqs);
    let chunked = Setup { num_kv_blocks: 512, max_num_batched_tokens: 7, prefix_caching: true };
    let tight = Setup { num_kv_blocks: 36, max_num_batched_tokens: 2048, prefix_caching: true };
    let uncached = Setup { num_kv_blocks: 36, max_num_batched_tokens: 2048, prefix_caching: false };
    for (what, setup) in [
        ("roomy", &ROOMY),
        ("chunked", &chunked),
        ("preempted", &tight),
        ("preempted, no prefix cache", &uncached),
    ] {
        for k in [1, 2, 5] {
            let mut core =
                try_engine("llama3", Some("llama3"), setup, Some(draft_model(k, "llama3")))
                    .unwrap();
            // Twice: the second run hits the prefix cache the first one filled.
            for round in 0..2 {
                assert_eq!(run(&mut core, &reqs), expected, "{what}, k = {k}, round {round}");
            }
            let stats = core.stats();
            let spec = stats.spec_decode;
            assert!(spec.num_draft_tokens > 0, "{what}, k = {k}: nothing drafted");
            assert_eq!(
                spec.num_accepted_tokens, spec.num_draft_tokens,
                "{what}, k = {k}: a draft of the model itself was rejected: its KV is wrong"
            );
            if setup.num_kv_blocks < 100 {
                assert!(stats.num_preemptions > 0, "{what}: nothing preempted");
            }
            core.scheduler().check_invariants().unwrap();
        }
    }
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let Err(e) = try_engine("llama3", Some("qwen2"), &ROOMY, Some(draft_model(3, "qwen2"))) else {
        panic!("a draft with 503 tokens was accepted for a 512-token target");
    };
    let e = e.to_string();
    assert!(e.contains("vocabulary (503 tokens) differs from the target's (512)"), "{e}");
    // The method needs the model, and the model needs the method.
    let e = try_engine("llama3", None, &ROOMY, Some(draft_model(3, "x"))).err().unwrap();
    assert!(e.to_string().contains("draft model `x` was not loaded"), "{e}");
    let e = try_engine("llama3", Some("llama3"), &ROOMY, Some(ngram(3))).err().unwrap();
    assert!(e.to_string().contains("for method \"ngram\""), "{e}");
    let e = try_engine("llama3", Some("llama3"), &ROOMY, None).err().unwrap();
    assert!(e.to_string().contains("without a speculative config"), "{e}");
}

#[test]
fn aborts_during_draft_model_speculation_free_every_block() {
    let spec = Some(draft_model(4, "mistral"));
    abort_while_speculating(&mut try_engine("llama3", Some("mistral"), &ROOMY, spec).unwrap());
}

#[test]
fn switching_speculation_off_and_on_keeps_the_draft_model() {
    let reqs = greedy_requests(512);
    let expected = run(&mut engine("llama3", &ROOMY, None), &reqs);
    let spec = draft_model(3, "llama3");
    let mut core = try_engine("llama3", Some("llama3"), &ROOMY, Some(spec.clone())).unwrap();
    core.set_speculative_config(None).unwrap();
    assert_eq!(run(&mut core, &reqs), expected);
    assert_eq!(core.stats().spec_decode.num_drafts, 0);
    core.set_speculative_config(Some(draft_model(2, "llama3"))).unwrap();
    core.set_speculative_config(Some(spec)).unwrap();
    // Another draft model, or more drafts than its scratch blocks were sized for (64 requests
    // of 3 drafts in 4-token blocks: 64 blocks), needs a new engine; a refused switch changes
    // nothing.
    let e = core.set_speculative_config(Some(draft_model(3, "mistral"))).unwrap_err();
    assert!(e.to_string().contains("draft model is `llama3`, not `mistral`"), "{e}");
    let e = core.set_speculative_config(Some(draft_model(5, "llama3"))).unwrap_err();
    assert!(e.to_string().contains("has 64 scratch blocks, and 5 drafts"), "{e}");
    assert_eq!(run(&mut core, &reqs), expected);
    let spec = core.stats().spec_decode;
    assert!(spec.num_draft_tokens > 0);
    assert_eq!(spec.num_accepted_tokens, spec.num_draft_tokens);
}
