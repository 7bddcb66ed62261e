//! LoRA adapters through the engine, on the llama3 fixture with two PEFT adapters
//! (`tests/fixtures/lora`): a request with an adapter generates PEFT's greedy tokens; requests
//! of two adapters and of the base model give the same tokens together as alone, with
//! synchronous and asynchronous scheduling; an adapter's blocks never serve another adapter or
//! the base model from the prefix cache; an unbound slot is refused and changes nothing.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_engine::{EngineConfig, EngineCore, PreparedRequest, SchedulerConfig};
use kiln_kernels::Cpu;
use kiln_models::load_model;
use kiln_models::lora::LoraAdapter;
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

const ADAPTERS: [&str; 2] = ["llama3-r8-all", "llama3-r4-attn"];

fn engine(async_scheduling: bool, prefix_caching: bool) -> EngineCore {
    let model = load_model(&fixtures().join("models/llama3"), &Arc::new(Cpu::new(2))).unwrap();
    let config = EngineConfig {
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
    let mut core = EngineCore::new(model.model, config).unwrap();
    let model_config = core.model().config().clone();
    for (i, name) in ADAPTERS.iter().enumerate() {
        let dir = fixtures().join("lora").join(name);
        let adapter = LoraAdapter::load_peft(&dir, &model_config, 16).unwrap();
        core.set_adapter(i as u32 + 1, Some(&adapter)).unwrap();
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

/// The same prompt under adapter 1, the base model and adapter 2, one after the other with
/// the prefix cache on: each gives what it gives with the cache off, and only the base model's
/// second run hits the cache.
#[test]
fn adapters_never_share_prefix_cache_blocks() {
    let (prompt, _) = reference(ADAPTERS[0]);
    let long: Vec<TokenId> = prompt.iter().cycle().take(24).copied().collect();
    let order =
        [(long.clone(), 1), (long.clone(), 0), (long.clone(), 2), (long.clone(), 1), (long, 0)];
    let mut cached = engine(false, true);
    let mut uncached = engine(false, false);
    for request in &order {
        let with = run(&mut cached, std::slice::from_ref(request), 8);
        let without = run(&mut uncached, std::slice::from_ref(request), 8);
        assert_eq!(with, without, "slot {}", request.1);
    }
    let stats = cached.stats().prefix_cache;
    // Only the two base-model requests looked the cache up; the second hit the first's blocks.
    assert_eq!(stats.num_requests, 2, "{stats:?}");
    assert!(stats.num_hit_tokens >= 20, "{stats:?}");
}

#[test]
fn an_unbound_slot_is_refused_and_binding_waits_for_idle() {
    let mut core = engine(false, true);
    let vocab = core.model().config().vocab_size;
    let params = SamplingParams::greedy(4);
    let request = PreparedRequest::new(vec![TokenId(5); 4], params.clone(), vocab, None).unwrap();
    let err = core.add_prepared(RequestId(1), request.with_adapter(3), 0).unwrap_err();
    assert!(err.to_string().contains("no LoRA adapter is loaded in slot 3"), "{err}");
    assert!(!core.has_unfinished());
    // Emptying a slot while a request runs is refused; once idle it is done.
    let request = PreparedRequest::new(vec![TokenId(5); 4], params, vocab, None).unwrap();
    core.add_prepared(RequestId(2), request.with_adapter(1), 0).unwrap();
    assert!(core.set_adapter(1, None).is_err());
    while core.has_unfinished() {
        core.step().unwrap();
    }
    core.set_adapter(1, None).unwrap();
    let request =
        PreparedRequest::new(vec![TokenId(5); 4], SamplingParams::greedy(4), vocab, None).unwrap();
    assert!(core.add_prepared(RequestId(3), request.with_adapter(1), 0).is_err());
}
