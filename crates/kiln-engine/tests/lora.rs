//! LoRA adapters through the engine, on the llama3 fixture with two PEFT adapters
//! (`tests/fixtures/lora`): a request with an adapter generates PEFT's greedy tokens; requests
//! of two adapters and of the base model give the same tokens together as alone, with
//! synchronous and asynchronous scheduling, under `max_loras` and with speculative decoding;
//! an adapter's prefix-cache blocks serve only that binding of that adapter; slots are bound
//! and emptied while other requests run, an unload waits for the slot's requests; an unbound
//! slot is refused and changes nothing.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_engine::{
    AdapterBinding, EngineConfig, EngineCore, PreparedRequest, SchedulerConfig, SpeculativeConfig,
};
use kiln_kernels::Cpu;
use kiln_models::load_model;
use kiln_models::lora::LoraAdapter;
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

const ADAPTERS: [&str; 2] = ["llama3-r8-all", "llama3-r4-attn"];

fn engine(async_scheduling: bool, prefix_caching: bool) -> EngineCore {
    engine_with(async_scheduling, prefix_caching, |_| {})
}

fn adapter(slot: u32, core: &EngineCore) -> LoraAdapter {
    let dir = fixtures().join("lora").join(ADAPTERS[slot as usize - 1]);
    LoraAdapter::load_peft(&dir, core.model().config(), 16).unwrap()
}

fn llama3() -> Box<dyn kiln_models::Model<Cpu>> {
    load_model(&fixtures().join("models/llama3"), &Arc::new(Cpu::new(2))).unwrap().model
}

/// [`engine`] with `tweak` applied to the configuration (a draft model for a speculative
/// configuration that names one).
fn engine_with(
    async_scheduling: bool,
    prefix_caching: bool,
    tweak: impl FnOnce(&mut EngineConfig),
) -> EngineCore {
    let mut config = EngineConfig {
        block_size: 4,
        num_kv_blocks: 256,
        max_model_len: Some(96),
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 64,
            enable_prefix_caching: prefix_caching,
            ..SchedulerConfig::default()
        },
        async_scheduling,
        ..EngineConfig::default()
    };
    tweak(&mut config);
    let draft = config.speculative.as_ref().and_then(|s| s.draft_model_name()).map(|_| llama3());
    let mut core = EngineCore::with_draft_model(llama3(), draft, config).unwrap();
    for slot in 1..=ADAPTERS.len() as u32 {
        let adapter = adapter(slot, &core);
        core.set_adapter(slot, Some(&adapter)).unwrap();
    }
    core
}

/// `(prompt, PEFT's greedy ids)` of the first case of adapter `name`.
fn reference(name: &str) -> (Vec<TokenId>, Vec<TokenId>) {
    let path = fixtures().join("lora").join(name).join("reference.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids = |key: &str| -> Vec<TokenId> {
        v["cases"][0][key]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| TokenId(t.as_u64().unwrap() as u32))
            .collect()
    };
    (ids("prompt_ids"), ids("greedy_ids"))
}

/// Runs `(prompt, adapter slot)` requests to the end: each one's tokens, in order.
fn run(
    core: &mut EngineCore,
    requests: &[(Vec<TokenId>, u32)],
    max_tokens: usize,
) -> Vec<Vec<TokenId>> {
    let vocab = core.model().config().vocab_size;
    let ids: Vec<RequestId> = requests
        .iter()
        .map(|(prompt, slot)| {
            let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
            let request = PreparedRequest::new(prompt.clone(), params, vocab, None).unwrap();
            let id = RequestId(NEXT_ID.fetch_add(1, Ordering::Relaxed));
            core.add_prepared(id, request.with_adapter(*slot), 0).unwrap();
            id
        })
        .collect();
    let mut tokens: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            tokens.entry(out.id).or_default().push(out.new_token);
        }
    }
    assert_eq!(core.num_live_requests(), 0);
    ids.iter().map(|id| tokens.remove(id).unwrap()).collect()
}

/// Request ids, unique across the tests' engines.
static NEXT_ID: AtomicU64 = AtomicU64::new(100);

#[test]
fn an_adapter_request_generates_peft_s_tokens() {
    for (slot, name) in ADAPTERS.iter().enumerate() {
        let mut core = engine(false, true);
        let (prompt, greedy) = reference(name);
        let got = run(&mut core, &[(prompt.clone(), slot as u32 + 1)], greedy.len());
        assert_eq!(got[0], greedy, "{name}");
        let base = run(&mut core, &[(prompt, 0)], greedy.len());
        assert_ne!(base[0], greedy, "{name}: the base model gives the adapter's tokens");
    }
}

#[test]
fn mixed_adapters_give_each_request_its_tokens_alone() {
    let (p1, _) = reference(ADAPTERS[0]);
    let (p2, _) = reference(ADAPTERS[1]);
    let requests: Vec<(Vec<TokenId>, u32)> =
        vec![(p1.clone(), 1), (p1.clone(), 0), (p2.clone(), 2), (p2[..3].to_vec(), 1), (p1, 2)];
    for async_scheduling in [false, true] {
        let mut core = engine(async_scheduling, false);
        let alone: Vec<Vec<TokenId>> = requests
            .iter()
            .map(|r| run(&mut core, std::slice::from_ref(r), 12).remove(0))
            .collect();
        let together = run(&mut core, &requests, 12);
        assert_eq!(together, alone, "async scheduling {async_scheduling}");
    }
}

/// The same prompt under adapter 1, the base model, adapter 2, adapter 1 and the base model,
/// one after the other with the prefix cache on: each gives what it gives with the cache off;
/// the second runs of adapter 1 and of the base model hit their first runs' blocks, adapter 2
/// hits nothing. Bound again (to the same weights), slot 1 hits nothing either.
#[test]
fn adapters_share_prefix_cache_blocks_only_with_their_own_binding() {
    let (prompt, _) = reference(ADAPTERS[0]);
    let long: Vec<TokenId> = prompt.iter().cycle().take(24).copied().collect();
    let order =
        [(long.clone(), 1), (long.clone(), 0), (long.clone(), 2), (long.clone(), 1), (long, 0)];
    let mut cached = engine(false, true);
    let mut uncached = engine(false, false);
    let mut hits = Vec::new();
    for request in &order {
        let before = cached.stats().prefix_cache.num_hit_tokens;
        let with = run(&mut cached, std::slice::from_ref(request), 8);
        let without = run(&mut uncached, std::slice::from_ref(request), 8);
        assert_eq!(with, without, "slot {}", request.1);
        hits.push(cached.stats().prefix_cache.num_hit_tokens - before);
    }
    // 23 tokens are looked up: 5 full blocks of 4.
    assert_eq!(hits, [0, 0, 0, 20, 20]);
    let same = adapter(1, &cached);
    cached.set_adapter(1, Some(&same)).unwrap();
    let before = cached.stats().prefix_cache.num_hit_tokens;
    let with = run(&mut cached, std::slice::from_ref(&order[0]), 8);
    assert_eq!(with, run(&mut uncached, std::slice::from_ref(&order[0]), 8));
    assert_eq!(cached.stats().prefix_cache.num_hit_tokens, before, "a new binding hit old blocks");
    cached.scheduler().check_invariants().unwrap();
}

/// With `max_loras = 1`, requests of two adapters and of the base model run with at most one
/// adapter in any step, and each still gets its tokens alone.
#[test]
fn max_loras_holds_back_other_adapters_and_changes_no_token() {
    let (p1, _) = reference(ADAPTERS[0]);
    let (p2, _) = reference(ADAPTERS[1]);
    let requests = vec![(p1.clone(), 1), (p2.clone(), 2), (p1, 0), (p2, 1)];
    let mut free = engine(false, false);
    let expected = run(&mut free, &requests, 10);
    let mut core = engine_with(false, false, |c| c.max_loras = Some(1));
    let vocab = core.model().config().vocab_size;
    let mut ids = Vec::new();
    for (prompt, slot) in &requests {
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(10) };
        let request = PreparedRequest::new(prompt.clone(), params, vocab, None).unwrap();
        let id = RequestId(NEXT_ID.fetch_add(1, Ordering::Relaxed));
        core.add_prepared(id, request.with_adapter(*slot), 0).unwrap();
        ids.push(id);
    }
    let mut tokens: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
    let mut held_back = false;
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            tokens.entry(out.id).or_default().push(out.new_token);
        }
        let adapters = core.stats().adapters;
        assert!(adapters.running.len() <= 1, "{adapters:?}");
        held_back |= !adapters.waiting.is_empty();
        core.scheduler().check_invariants().unwrap();
    }
    assert!(held_back, "no request ever waited for its adapter");
    let got: Vec<Vec<TokenId>> = ids.iter().map(|id| tokens.remove(id).unwrap()).collect();
    assert_eq!(got, expected);
}

/// Speculative decoding with adapters: n-gram drafts are verified under the request's adapter,
/// and a draft model runs without it; both give the tokens of plain decoding.
#[test]
fn speculation_with_adapters_gives_the_plain_tokens() {
    let (p1, _) = reference(ADAPTERS[0]);
    // A repetitive prompt, so that prompt lookup drafts.
    let looped: Vec<TokenId> = p1.iter().cycle().take(20).copied().collect();
    let requests = vec![(looped.clone(), 1), (looped.clone(), 0), (looped, 2)];
    let expected = run(&mut engine(false, false), &requests, 16);
    for spec in [SpeculativeConfig::ngram(3, 1, 3), SpeculativeConfig::draft_model(2, "llama3")] {
        let name = format!("{:?}", spec.method);
        let mut core = engine_with(false, false, |c| c.speculative = Some(spec));
        assert_eq!(run(&mut core, &requests, 16), expected, "{name}");
        assert!(core.stats().spec_decode.num_drafts > 0, "{name}: nothing drafted");
    }
}

/// Binding and unloading while requests run: a new slot is bound beside a running request; a
/// slot in use cannot be rebound or emptied at once, but an unload refuses new requests of it
/// and empties it when its last request ends; a request resolved against an older binding is
/// refused.
#[test]
fn slots_change_while_requests_run_and_an_unload_waits_for_them() {
    let mut core = engine(false, true);
    let vocab = core.model().config().vocab_size;
    let prepared = |max: usize| {
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max) };
        PreparedRequest::new(vec![TokenId(5); 6], params, vocab, None).unwrap()
    };
    core.add_prepared(RequestId(1), prepared(12).with_adapter(1), 0).unwrap();
    core.step().unwrap();
    let second = adapter(2, &core);
    let key = core.set_adapter(3, Some(&second)).unwrap();
    assert!(key > 0);
    assert!(core.set_adapter(1, None).is_err(), "emptied under a running request");
    assert!(core.set_adapter(1, Some(&second)).is_err(), "rebound under a running request");
    assert!(!core.unbind_adapter_when_drained(1).unwrap());
    let err = core.add_prepared(RequestId(2), prepared(4).with_adapter(1), 0).unwrap_err();
    assert!(err.to_string().contains("unloading"), "{err}");
    core.add_prepared(RequestId(3), prepared(4).with_adapter(3), 0).unwrap();
    let stale = AdapterBinding { slot: 3, cache_key: key + 100 };
    let err = core.add_prepared(RequestId(4), prepared(4).with_adapter_binding(stale), 0);
    assert!(err.unwrap_err().to_string().contains("was unloaded"));
    let fresh = AdapterBinding { slot: 3, cache_key: key };
    core.add_prepared(RequestId(5), prepared(4).with_adapter_binding(fresh), 0).unwrap();
    let mut finished = 0;
    while core.has_unfinished() {
        let emptied_before = core.stats().adapters.loaded.contains(1);
        finished += core.step().unwrap().iter().filter(|o| o.finish_reason.is_some()).count();
        assert!(emptied_before, "slot 1 emptied while its request ran");
    }
    assert_eq!(finished, 3, "a request was lost");
    assert_eq!(core.unbind_drained(), [1]);
    assert!(!core.stats().adapters.loaded.contains(1));
    let err = core.add_prepared(RequestId(6), prepared(4).with_adapter(1), 0).unwrap_err();
    assert!(err.to_string().contains("no LoRA adapter is loaded in slot 1"), "{err}");
}

#[test]
fn an_unbound_slot_is_refused_and_changes_nothing() {
    let mut core = engine(false, true);
    let vocab = core.model().config().vocab_size;
    let request = PreparedRequest::new(vec![TokenId(5); 4], SamplingParams::greedy(4), vocab, None);
    let err = core.add_prepared(RequestId(1), request.unwrap().with_adapter(3), 0).unwrap_err();
    assert!(err.to_string().contains("no LoRA adapter is loaded in slot 3"), "{err}");
    assert!(!core.has_unfinished());
    assert_eq!(core.num_live_requests(), 0);
    assert!(core.set_adapter(0, None).is_err(), "slot 0 is the base model");
    assert!(core.set_adapter(kiln_engine::MAX_ADAPTER_SLOT + 1, None).is_err());
}
