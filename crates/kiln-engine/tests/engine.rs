//! Engine invariants on a tiny fixture model, greedy unless stated, with f32 and f16 KV caches:
//! prefix caching, preemption and batch composition never change a token; aborts free every
//! block; over-long requests are refused with vLLM's message.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::collections::HashMap;
use std::path::PathBuf;

use kiln_core::{FinishReason, RequestId, SamplingParams, TokenId};
use kiln_engine::{
    EngineConfig, EngineCore, EngineError, EngineHandle, KvCacheDtype, KvTierConfig,
    KvTierLocation, PreemptionMode, SchedulerConfig,
};
use kiln_kernels::Cpu;
use kiln_models::load_model;

fn cpu() -> std::sync::Arc<Cpu> {
    std::sync::Arc::new(Cpu::new(2))
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

fn engine(prefix_caching: bool, num_kv_blocks: usize, max_num_batched_tokens: usize) -> EngineCore {
    engine_of(("llama3", KvCacheDtype::F32), prefix_caching, num_kv_blocks, max_num_batched_tokens)
}

/// The invariants below hold for every KV cache element type (8-bit ones included), on a
/// grouped-query model, on a latent-attention one (DeepSeek-V3: one cache row per token,
/// values read from the keys; experts) and on gpt-oss (attention sinks, sliding layers).
fn model_dtypes() -> impl Iterator<Item = (&'static str, KvCacheDtype)> {
    ["llama3", "deepseekv3", "gptoss"].into_iter().flat_map(|m| KvCacheDtype::ALL.map(|d| (m, d)))
}

fn engine_of(
    kv: (&str, KvCacheDtype),
    prefix_caching: bool,
    num_kv_blocks: usize,
    max_num_batched_tokens: usize,
) -> EngineCore {
    engine_with(kv, prefix_caching, num_kv_blocks, max_num_batched_tokens, None)
}

/// [`engine_of`] with a second KV tier (preemption by swap whenever it has room).
fn engine_with(
    (model, kv_cache_dtype): (&str, KvCacheDtype),
    prefix_caching: bool,
    num_kv_blocks: usize,
    max_num_batched_tokens: usize,
    kv_tier: Option<KvTierConfig>,
) -> EngineCore {
    let model = load_model(&fixture(model), &cpu()).unwrap().model;
    let config = EngineConfig {
        // Rows sampled on two host threads, as the CLI does on the CPU backend's pool.
        host_pool: kiln_engine::HostPool::new(std::sync::Arc::new(kiln_models::HostThreads::new(
            2,
        ))),
        kv_tier,
        preemption_mode: PreemptionMode::Swap,
        block_size: 4,
        num_kv_blocks,
        max_model_len: Some(64),
        scheduler: SchedulerConfig {
            max_num_batched_tokens,
            enable_prefix_caching: prefix_caching,
            ..SchedulerConfig::default()
        },
        kv_cache_dtype,
        ..EngineConfig::default()
    };
    EngineCore::new(model, config).unwrap()
}

/// Deterministic pseudo-random prompt of `len` tokens (vocabulary 512).
fn prompt(seed: u32, len: usize) -> Vec<TokenId> {
    (0..len as u32)
        .map(|i| TokenId((seed.wrapping_mul(7919) + i * 131 + i * i * 17) % 500 + 3))
        .collect()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
}

/// Runs every request to completion on `core`; outputs in request order.
fn run(core: &mut EngineCore, requests: &[(Vec<TokenId>, SamplingParams)]) -> Vec<Vec<TokenId>> {
    let ids: Vec<RequestId> = requests
        .iter()
        .map(|(p, params)| core.add_request(p.clone(), params.clone(), 0).unwrap())
        .collect();
    let mut tokens: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
    let mut finished = 0;
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            // The first-token record comes once, with the first token (also when the request
            // was preempted and resumed later).
            let seen = tokens.get(&out.id).map_or(0, Vec::len);
            assert_eq!(out.first.is_some(), seen == 0, "{:?} after {seen} tokens", out.id);
            tokens.entry(out.id).or_default().push(out.new_token);
            if out.finish_reason.is_some() {
                assert_eq!(out.finish_reason, Some(FinishReason::Length));
                finished += 1;
            }
        }
    }
    assert_eq!(finished, requests.len());
    assert_eq!(core.stats().kv_usage, 0.0);
    assert_eq!(core.num_live_requests(), 0, "the request table keeps nothing of finished ones");
    ids.iter().map(|id| tokens.remove(id).unwrap()).collect()
}

fn shared_prefix_requests() -> Vec<(Vec<TokenId>, SamplingParams)> {
    let common = prompt(1, 17);
    (0..6)
        .map(|i| {
            let mut p = common.clone();
            p.extend(prompt(100 + i, 3 + i as usize));
            (p, greedy(12))
        })
        .collect()
}

#[test]
fn prefix_caching_on_equals_off_and_hits_on_the_second_run() {
    for (model, dtype) in model_dtypes() {
        let requests = shared_prefix_requests();
        let mut off = engine_of((model, dtype), false, 256, 2048);
        let expected = run(&mut off, &requests);
        assert_eq!(off.stats().prefix_cache.num_hit_tokens, 0);
        for r in &expected {
            assert_eq!(r.len(), 12);
        }

        let mut on = engine_of((model, dtype), true, 256, 2048);
        assert_eq!(run(&mut on, &requests), expected);
        let hits_first = on.stats().prefix_cache.num_hit_tokens;
        assert_eq!(run(&mut on, &requests), expected);
        let stats = on.stats();
        assert!(stats.prefix_cache.num_hit_tokens > hits_first, "{stats:?}");
        assert!(stats.prefix_cache.hit_rate() > 0.0);

        // Small chunks: requests admitted one by one hit the prefix the first one cached.
        let mut chunked = engine_of((model, dtype), true, 256, 8);
        assert_eq!(run(&mut chunked, &requests), expected);
        assert!(chunked.stats().prefix_cache.num_hit_tokens > 0);
    }
}

/// Eight requests of ~40 tokens each, more than 24 blocks of 4 hold at once; odd ones sample
/// (seeded): a resumed request keeps its random stream.
fn preempting_requests() -> Vec<(Vec<TokenId>, SamplingParams)> {
    (0..8u32)
        .map(|i| {
            let params = if i % 2 == 0 {
                greedy(24)
            } else {
                SamplingParams { temperature: 1.0, seed: Some(u64::from(i)), ..greedy(24) }
            };
            (prompt(i, 14 + i as usize), params)
        })
        .collect()
}

#[test]
fn a_run_forced_to_preempt_equals_one_with_plenty_of_blocks() {
    for (model, dtype) in model_dtypes() {
        let requests = preempting_requests();
        let mut plenty = engine_of((model, dtype), true, 512, 2048);
        let expected = run(&mut plenty, &requests);
        assert_eq!(plenty.stats().num_preemptions, 0);
        for prefix_caching in [false, true] {
            // 16 blocks of 4 = one request of max_model_len (64); 8 requests of ~40 tokens each.
            let mut tight = engine_of((model, dtype), prefix_caching, 24, 2048);
            assert_eq!(run(&mut tight, &requests), expected);
            assert!(tight.stats().num_preemptions > 0, "{:?}", tight.stats());
        }
    }
}

/// The tier is large enough for every preempted request, in memory and in a file under `dir`.
fn tiers(dir: &std::path::Path) -> [KvTierConfig; 2] {
    let dir = dir.to_path_buf();
    [
        KvTierConfig { location: KvTierLocation::Memory, bytes: 1 << 20 },
        KvTierConfig { location: KvTierLocation::Directory(dir), bytes: 1 << 20 },
    ]
}

#[test]
fn a_run_forced_to_swap_equals_one_with_plenty_of_blocks_and_recomputes_less() {
    let scratch = tempfile::tempdir().unwrap();
    for (model, dtype) in model_dtypes() {
        let requests = preempting_requests();
        let expected = run(&mut engine_of((model, dtype), true, 512, 2048), &requests);
        for prefix_caching in [false, true] {
            let mut recompute = engine_of((model, dtype), prefix_caching, 24, 2048);
            assert_eq!(run(&mut recompute, &requests), expected);
            for tier in tiers(scratch.path()) {
                let mut swapping =
                    engine_with((model, dtype), prefix_caching, 24, 2048, Some(tier.clone()));
                assert_eq!(run(&mut swapping, &requests), expected, "{dtype:?} {tier:?}");
                let stats = swapping.stats();
                assert!(stats.swap.num_swap_preemptions > 0, "{dtype:?} {tier:?}: {stats:?}");
                assert!(stats.swap.num_swapped_in_blocks > 0, "{stats:?}");
                assert_eq!(stats.swap.num_used_slots, 0, "{stats:?}");
                // Swapped requests skip what they had computed.
                let (swapped, recomputed) =
                    (stats.total_scheduled_tokens, recompute.stats().total_scheduled_tokens);
                assert!(swapped < recomputed, "{swapped} vs {recomputed} tokens scheduled");
            }
        }
    }
}

#[test]
fn aborting_swapped_requests_frees_their_tier_slots() {
    let scratch = tempfile::tempdir().unwrap();
    for tier in tiers(scratch.path()) {
        let mut core = engine_with(("llama3", KvCacheDtype::F16), true, 24, 2048, Some(tier));
        let ids: Vec<_> = (0..8)
            .map(|i| core.add_request(prompt(i, 14 + i as usize), greedy(24), 0).unwrap())
            .collect();
        let mut steps = 0;
        while core.stats().swap.num_used_slots == 0 {
            core.step().unwrap();
            steps += 1;
            assert!(steps < 500, "no request was swapped: {:?}", core.stats());
        }
        let swapped: Vec<_> = ids
            .into_iter()
            .filter(|id| core.scheduler().request(*id).is_some_and(|r| r.num_swapped_tokens() > 0))
            .collect();
        for id in swapped {
            assert!(core.abort(id));
        }
        assert_eq!(core.stats().swap.num_used_slots, 0);
        while core.has_unfinished() {
            core.step().unwrap();
        }
        let stats = core.stats();
        assert_eq!((stats.kv_usage, stats.swap.num_used_slots), (0.0, 0), "{stats:?}");
    }
}

#[test]
fn a_prefix_evicted_to_the_tier_and_hit_again_gives_the_same_tokens_and_skips_its_prefill() {
    let scratch = tempfile::tempdir().unwrap();
    let cases = ["llama3", "deepseekv3"].map(|m| [(m, KvCacheDtype::F16), (m, KvCacheDtype::Int8)]);
    for (model, dtype) in cases.into_iter().flatten() {
        let shared = (prompt(3, 41), greedy(8));
        let other = (prompt(9, 41), greedy(8));
        let mut plain = engine_of((model, dtype), true, 16, 2048);
        let expected = run(&mut plain, std::slice::from_ref(&shared));
        for tier in tiers(scratch.path()) {
            // 16 blocks of 4: the second request evicts most of the first one's blocks.
            let mut core = engine_with((model, dtype), true, 16, 2048, Some(tier.clone()));
            assert_eq!(run(&mut core, std::slice::from_ref(&shared)), expected);
            run(&mut core, std::slice::from_ref(&other));
            let before = core.stats();
            assert!(before.swap.num_spilled_blocks > 0, "{tier:?}: {before:?}");
            assert_eq!(
                run(&mut core, std::slice::from_ref(&shared)),
                expected,
                "{dtype:?} {tier:?}"
            );
            let after = core.stats();
            // Every full block of the 40 tokens before the last came back: 10 blocks, some from
            // the cache, the rest from the tier; one token and the outputs were computed.
            let hits = after.prefix_cache.num_hit_tokens - before.prefix_cache.num_hit_tokens;
            let tier_hits = after.swap.num_tier_hit_tokens - before.swap.num_tier_hit_tokens;
            assert!(tier_hits > 0, "{tier:?}: {after:?}");
            assert_eq!(hits + tier_hits, 40, "{tier:?}");
            let scheduled = after.total_scheduled_tokens - before.total_scheduled_tokens;
            assert_eq!(scheduled, 1 + 7, "{tier:?}: the prompt's last token, then 7 decodes");
        }
    }
}

#[test]
fn a_tier_too_small_for_one_block_is_refused() {
    let model = load_model(&fixture("llama3"), &cpu()).unwrap().model;
    let config = EngineConfig {
        // Rows sampled on two host threads, as the CLI does on the CPU backend's pool.
        host_pool: kiln_engine::HostPool::new(std::sync::Arc::new(kiln_models::HostThreads::new(
            2,
        ))),
        block_size: 4,
        num_kv_blocks: 16,
        kv_tier: Some(KvTierConfig { location: KvTierLocation::Memory, bytes: 100 }),
        ..EngineConfig::default()
    };
    let err = EngineCore::new(model, config).err().unwrap().to_string();
    assert!(err.contains("holds no KV block"), "{err}");
}

#[test]
fn each_of_16_requests_in_one_batch_equals_it_alone() {
    for (model, dtype) in model_dtypes() {
        let requests: Vec<_> = (0..16u32)
            .map(|i| {
                let params = if i % 2 == 0 {
                    greedy(10)
                } else {
                    SamplingParams {
                        temperature: 0.8,
                        top_p: 0.95,
                        seed: Some(u64::from(i) * 31),
                        ..greedy(10)
                    }
                };
                (prompt(i, 5 + i as usize * 2), params)
            })
            .collect();
        let mut batch = engine_of((model, dtype), false, 512, 2048);
        let together = run(&mut batch, &requests);
        assert!(batch.stats().num_steps <= 11, "one batch: {:?}", batch.stats());
        for (request, expected) in requests.iter().zip(&together) {
            let mut alone = engine_of((model, dtype), false, 512, 2048);
            assert_eq!(&run(&mut alone, std::slice::from_ref(request))[0], expected);
        }
    }
}

#[test]
fn aborts_mid_flight_free_every_block() {
    // Directly on the core, between steps.
    let mut core = engine(true, 256, 16);
    let ids: Vec<_> =
        (0..6).map(|i| core.add_request(prompt(i, 20), greedy(30), 0).unwrap()).collect();
    for _ in 0..4 {
        core.step().unwrap();
    }
    assert!(core.stats().kv_usage > 0.0);
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

    // Through the handle: explicit aborts and dropped streams.
    let handle = EngineHandle::spawn(engine(true, 256, 2048)).unwrap();
    let mut streams: Vec<_> =
        (0..8).map(|i| handle.submit(prompt(i, 12), greedy(40), 0).unwrap()).collect();
    for s in &mut streams {
        let first = s.recv().unwrap().unwrap();
        assert_eq!(first.id, s.id());
    }
    let kept = streams.split_off(4);
    for s in &streams[..2] {
        handle.abort(s.id());
    }
    drop(streams);
    for mut s in kept {
        let rest: Vec<_> = s.by_ref().map(Result::unwrap).collect();
        assert_eq!(rest.len(), 39);
        assert_eq!(rest.last().unwrap().finish_reason, Some(FinishReason::Length));
        assert!(s.is_finished());
    }
    // The counters are published after the step that sent the last tokens.
    let start = std::time::Instant::now();
    let mut stats = handle.stats();
    while stats.num_running > 0 && start.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(5));
        stats = handle.stats();
    }
    assert_eq!((stats.kv_usage, stats.num_running, stats.num_waiting), (0.0, 0, 0));
    handle.shutdown();
}

/// A step's counters reach the observer (the server's metrics) before its outputs reach the
/// sinks: a client that has its tokens reads metrics that count them.
#[test]
fn a_steps_counters_are_published_before_its_outputs_are_delivered() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let observed = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&observed);
    let observer = Box::new(move |s: &kiln_engine::EngineStats| {
        seen.store(s.total_sampled_tokens, Ordering::SeqCst);
    });
    let handle =
        EngineHandle::spawn_with_observer(engine(true, 256, 2048), Some(observer)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let mut delivered = 0u64;
    // Runs on the engine thread: what the observer had seen when this token was delivered.
    let sink = Box::new(move |item: kiln_engine::StreamItem| {
        delivered += 1;
        tx.send((item.is_ok(), delivered, observed.load(Ordering::SeqCst))).is_ok()
    });
    handle.submit_with_sink(prompt(0, 12), greedy(5), 0, sink).unwrap();
    for _ in 0..5 {
        let (ok, delivered, counted) = rx.recv().unwrap();
        assert!(ok);
        assert!(counted >= delivered, "token {delivered} delivered when {counted} were counted");
    }
    handle.shutdown();
}

#[test]
fn too_long_requests_are_rejected_with_vllms_message() {
    let mut core = engine(true, 256, 2048);
    let err = core.add_request(prompt(0, 60), greedy(10), 0).unwrap_err();
    assert!(matches!(err, EngineError::Rejected(_)));
    assert_eq!(
        err.to_string(),
        "This model's maximum context length is 64 tokens. However, you requested 70 tokens \
         (60 in the messages, 10 in the completion). Please reduce the length of the messages \
         or completion."
    );
    let handle = EngineHandle::spawn(core).unwrap();
    let err = handle.submit(prompt(0, 60), greedy(10), 0).err().unwrap();
    assert!(err.to_string().starts_with("This model's maximum context length is 64 tokens."));
    // The engine keeps serving.
    let out: Vec<_> =
        handle.submit(prompt(0, 10), greedy(3), 0).unwrap().map(Result::unwrap).collect();
    assert_eq!(out.len(), 3);
}

#[test]
fn engine_config_is_validated() {
    let model = || load_model(&fixture("llama3"), &cpu()).unwrap().model;
    let bad_block = EngineConfig { block_size: 6, ..EngineConfig::default() };
    assert!(matches!(EngineCore::new(model(), bad_block), Err(EngineError::Config(_))));
    let too_long = EngineConfig { max_model_len: Some(100_000), ..EngineConfig::default() };
    assert!(matches!(EngineCore::new(model(), too_long), Err(EngineError::Config(_))));
    let small_cache =
        EngineConfig { num_kv_blocks: 2, max_model_len: Some(64), ..EngineConfig::default() };
    assert!(matches!(EngineCore::new(model(), small_cache), Err(EngineError::Config(_))));
}

/// The runner applies the scheduler's diff (tokens accepted since, `num_computed_tokens`) and
/// reports one token per finished row; with drafts it reports the accepted ones plus one.
#[test]
fn the_runner_follows_the_diff_and_verifies_draft_tokens() {
    use kiln_engine::{ModelRunner, RequestTable};
    use kiln_kv::KvCacheConfig;
    use kiln_models::BoundModel;
    use kiln_sched::{ModelRunnerOutput, Request, Scheduler};

    let mut core = engine(true, 64, 2048);
    let want = run(&mut core, &[(prompt(3, 10), greedy(12))]).remove(0);

    let model = load_model(&fixture("llama3"), &cpu()).unwrap().model;
    let bound = BoundModel::new(model, KvCacheDtype::F32, 64, 4).unwrap();
    let mut runner = ModelRunner::new(Box::new(bound), 0);
    let kv = KvCacheConfig {
        block_size: 4,
        num_blocks: 64,
        enable_prefix_caching: true,
        extra_keys: vec![],
    };
    let config = SchedulerConfig { max_model_len: 64, ..SchedulerConfig::default() };
    let mut s = Scheduler::new(config, kv).unwrap();
    let id = RequestId(0);
    s.add(Request::new(id, prompt(3, 10), greedy(12))).unwrap();
    let mut res = ModelRunnerOutput::default();
    let mut table = RequestTable::new();
    let mut got = Vec::new();
    let mut step = |s: &mut Scheduler, got: &mut Vec<TokenId>| {
        let out = s.schedule();
        runner.execute(&out, &mut table, &mut res).unwrap();
        let n = res.get(0).unwrap().1.len();
        got.extend(s.update(&out, &res).iter().map(|o| o.new_token));
        (out.num_scheduled_spec_tokens, n)
    };
    for _ in 0..2 {
        assert_eq!(step(&mut s, &mut got), (0, 1));
    }
    // The right continuation: both drafts accepted, plus one token.
    assert!(s.update_draft_token_ids(id, &want[2..4]));
    assert_eq!(step(&mut s, &mut got), (2, 3));
    // A wrong first draft: rejected, the model's token instead.
    let wrong = TokenId((want[5].0 + 1) % 512);
    assert!(s.update_draft_token_ids(id, &[wrong, want[6]]));
    assert_eq!(step(&mut s, &mut got), (2, 1));
    // Right then wrong: one accepted, then the correction.
    let wrong = TokenId((want[7].0 + 1) % 512);
    assert!(s.update_draft_token_ids(id, &[want[6], wrong, want[8]]));
    assert_eq!(step(&mut s, &mut got), (3, 2));
    while s.has_unfinished() {
        step(&mut s, &mut got);
    }
    assert_eq!(got, want);
    assert_eq!(s.kv_cache().usage(), 0.0);
}
