//! Asynchronous scheduling on a tiny fixture model: the forward of each step runs on a second
//! thread while the next step is planned (with placeholders for the tokens in flight), and
//! every request's outputs (tokens, finish reasons, log-probabilities) equal the synchronous
//! engine's, through chunked prefill, prefix-cache hits, preemption, stop tokens, seeded
//! sampling, arrivals and aborts while a step is in flight; no block leaks.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_core::{FinishReason, RequestId, SamplingParams, TokenId};
use kiln_engine::{
    EngineConfig, EngineCore, EngineHandle, Logprobs, PromptLogprobs, SchedulerConfig,
    SpeculativeConfig,
};
use kiln_kernels::Cpu;
use kiln_models::{
    Backend, ForwardBatch, ForwardError, KvLayout, Logits, Model, ModelConfig, Workspace,
    load_model,
};

/// One output as compared: token, finish reason, log-probabilities, prompt log-probabilities.
type Out = (TokenId, Option<FinishReason>, Option<Logprobs>, Option<PromptLogprobs>);

fn engine(
    async_scheduling: bool,
    num_kv_blocks: usize,
    max_num_batched_tokens: usize,
) -> EngineCore {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama3");
    let model = load_model(&path, &std::sync::Arc::new(Cpu::new(2))).unwrap().model;
    let config = EngineConfig {
        // Rows sampled on two host threads, as the CLI does on the CPU backend's pool.
        host_pool: kiln_engine::HostPool::new(std::sync::Arc::new(kiln_models::HostThreads::new(
            2,
        ))),
        block_size: 4,
        num_kv_blocks,
        max_model_len: Some(64),
        scheduler: SchedulerConfig {
            max_num_batched_tokens,
            long_prefill_token_threshold: 8,
            max_num_partial_prefills: 2,
            enable_prefix_caching: true,
            ..SchedulerConfig::default()
        },
        async_scheduling,
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

/// Twelve requests: greedy and seeded sampling, log-probabilities, prompt log-probabilities, a
/// shared prefix, and stop tokens (`stop`: request 3 meets it early).
fn requests(stop: Option<TokenId>) -> Vec<(Vec<TokenId>, SamplingParams)> {
    let common = prompt(99, 13);
    (0..12u32)
        .map(|i| {
            let base = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(20) };
            let params = match i % 4 {
                0 => base,
                1 => SamplingParams { temperature: 0.9, top_p: 0.8, seed: Some(7), ..base },
                2 => SamplingParams { logprobs: Some(3), prompt_logprobs: Some(2), ..base },
                _ => SamplingParams { stop_token_ids: stop.into_iter().collect(), ..base },
            };
            let mut p = if i % 3 == 0 { common.clone() } else { Vec::new() };
            p.extend(prompt(i, 10 + (i as usize * 7) % 25));
            (p, params)
        })
        .collect()
}

/// Runs `requests`, the second half added after three `step` calls; outputs in request order.
fn run(core: &mut EngineCore, requests: &[(Vec<TokenId>, SamplingParams)]) -> Vec<Vec<Out>> {
    let (first, second) = requests.split_at(requests.len() / 2);
    let add = |core: &mut EngineCore, part: &[(Vec<TokenId>, SamplingParams)]| -> Vec<RequestId> {
        part.iter().map(|(p, s)| core.add_request(p.clone(), s.clone(), 0).unwrap()).collect()
    };
    let mut ids = add(core, first);
    let mut outs: HashMap<RequestId, Vec<Out>> = HashMap::new();
    let mut steps = 0;
    while core.has_unfinished() {
        if steps == 3 {
            ids.extend(add(core, second));
        }
        for o in core.step().unwrap() {
            let out = (o.new_token, o.finish_reason, o.logprobs, o.prompt_logprobs);
            outs.entry(o.id).or_default().push(out);
        }
        steps += 1;
    }
    let stats = core.stats();
    assert_eq!((stats.kv_usage, stats.num_running, stats.num_waiting), (0.0, 0, 0));
    assert_eq!(core.num_live_requests(), 0);
    ids.iter().map(|id| outs.remove(id).unwrap()).collect()
}

#[test]
fn async_scheduling_gives_the_synchronous_outputs() {
    // The stop token: request 3's sixth token in a greedy run of its prompt.
    let probe = requests(None)[3].0.clone();
    let mut sync = engine(false, 512, 2048);
    let greedy = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(20) };
    sync.add_request(probe, greedy, 0).unwrap();
    let mut probe_tokens = Vec::new();
    while sync.has_unfinished() {
        probe_tokens.extend(sync.step().unwrap().into_iter().map(|o| o.new_token));
    }
    let requests = requests(Some(probe_tokens[5]));

    // Plenty of blocks, a large budget; then few blocks (preemption) and small chunks.
    for (blocks, budget) in [(512, 2048), (40, 24)] {
        let expected = run(&mut engine(false, blocks, budget), &requests);
        assert!(expected.iter().any(|r| r.len() < 20), "no request stopped early");
        let mut core = engine(true, blocks, budget);
        assert_eq!(run(&mut core, &requests), expected, "{blocks} blocks, budget {budget}");
        // Steps are planned ahead (with placeholders) except after one that ran short of
        // blocks, where the next is planned after the update so that preemption can work.
        let stats = core.stats();
        assert!(stats.num_steps_planned_ahead > stats.num_steps / 2, "{stats:?}");
        if blocks == 40 {
            assert!(stats.num_preemptions > 0, "{stats:?}");
            assert!(stats.num_steps_planned_ahead < stats.num_steps, "{stats:?}");
        }
        assert!(core.stats().prefix_cache.num_hit_tokens > 0);
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
}

/// `prompt`'s greedy tokens on a synchronous engine, alone.
fn alone(prompt: &[TokenId], max_tokens: usize) -> Vec<TokenId> {
    let mut core = engine(false, 256, 64);
    core.add_request(prompt.to_vec(), greedy(max_tokens), 0).unwrap();
    let mut tokens = Vec::new();
    while core.has_unfinished() {
        tokens.extend(core.step().unwrap().into_iter().map(|o| o.new_token));
    }
    tokens
}

#[test]
fn aborts_while_a_step_is_in_flight_change_no_other_token_and_free_every_block() {
    let mut core = engine(true, 256, 64);
    let prompts: Vec<_> = (0..6).map(|i| prompt(i, 20)).collect();
    let ids: Vec<_> =
        prompts.iter().map(|p| core.add_request(p.clone(), greedy(30), 0).unwrap()).collect();
    let mut tokens: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
    for _ in 0..4 {
        for out in core.step().unwrap() {
            tokens.entry(out.id).or_default().push(out.new_token);
        }
        // The step in flight is not counted until it is reported.
        assert_eq!(core.stats().num_steps + 1, core.scheduler().step());
    }
    // The running requests are in the step the fourth call launched (decoding by now, so their
    // rows are sampled unless aborted); one waiting request goes too.
    let running = core.scheduler().running_ids().to_vec();
    assert!(running.len() >= 2, "{running:?}");
    let waiting = *ids.iter().rev().find(|id| !running.contains(id)).unwrap();
    let aborted = [running[0], running[1], waiting];
    for id in aborted {
        assert!(core.abort(id));
    }
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            assert!(!aborted.contains(&out.id), "{} was aborted", out.id);
            tokens.entry(out.id).or_default().push(out.new_token);
        }
    }
    let stats = core.stats();
    assert_eq!((stats.kv_usage, stats.num_running, stats.num_waiting), (0.0, 0, 0));
    assert_eq!(stats.num_steps, core.scheduler().step());
    assert_eq!(core.num_live_requests(), 0, "aborted in flight: nothing is left in the table");
    // The survivors' tokens are their tokens alone; the aborted requests' cached blocks hold
    // KV that was written: their prompts, run again on this engine, give their tokens alone.
    for (id, p) in ids.iter().zip(&prompts) {
        if !aborted.contains(id) {
            assert_eq!(tokens[id], alone(p, 30), "{id}");
        }
    }
    let again: Vec<_> = ids
        .iter()
        .zip(&prompts)
        .filter(|(id, _)| aborted.contains(id))
        .map(|(_, p)| (core.add_request(p.clone(), greedy(30), 0).unwrap(), p))
        .collect();
    let mut rerun: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            rerun.entry(out.id).or_default().push(out.new_token);
        }
    }
    for (id, p) in again {
        assert_eq!(rerun[&id], alone(p, 30), "{id} run again");
    }
    assert!(core.stats().prefix_cache.num_hit_tokens > 0);
}

#[test]
fn an_engine_dropped_with_a_step_in_flight_ends_its_forward_thread() {
    let mut core = engine(true, 64, 256);
    core.add_request(prompt(1, 30), greedy(8), 0).unwrap();
    core.step().unwrap();
    assert!(core.has_unfinished());
    drop(core); // joins the forward thread once the forward ends: returns, does not hang
}

#[test]
fn the_handle_streams_the_synchronous_tokens() {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(16) };
    let streams = |async_scheduling| {
        let handle = EngineHandle::spawn(engine(async_scheduling, 256, 2048)).unwrap();
        let streams: Vec<_> = (0..6)
            .map(|i| handle.submit(prompt(i, 9 + i as usize), params.clone(), 0).unwrap())
            .collect();
        let tokens: Vec<Vec<TokenId>> =
            streams.into_iter().map(|s| s.map(|o| o.unwrap().new_token).collect()).collect();
        handle.shutdown();
        tokens
    };
    let expected = streams(false);
    assert!(expected.iter().all(|t| t.len() == 16));
    assert_eq!(streams(true), expected);
}

#[test]
fn speculative_decoding_is_refused_with_async_scheduling() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama3");
    let model = load_model(&path, &std::sync::Arc::new(Cpu::new(1))).unwrap().model;
    let speculative = SpeculativeConfig::ngram(2, 1, 3);
    let config = EngineConfig {
        block_size: 4,
        num_kv_blocks: 64,
        speculative: Some(speculative.clone()),
        async_scheduling: true,
        ..EngineConfig::default()
    };
    let err = EngineCore::new(model, config).err().unwrap().to_string();
    assert!(err.contains("speculative decoding"), "{err}");

    let mut core = engine(true, 64, 256);
    let err = core.set_speculative_config(Some(speculative)).unwrap_err().to_string();
    assert!(err.contains("asynchronous scheduling"), "{err}");
}

/// The fixture model, failing its forward number `fail_at` (counted from 1 across clones).
struct FailingModel {
    inner: Box<dyn Model<Cpu>>,
    forwards: Arc<AtomicUsize>,
    fail_at: usize,
}

impl Model<Cpu> for FailingModel {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn backend(&self) -> &Cpu {
        self.inner.backend()
    }
    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn forward(
        &self,
        batch: &ForwardBatch,
        kv: &mut <Cpu as Backend>::KvStore,
        workspace: &mut Workspace<Cpu>,
        logits: &mut Logits,
    ) -> Result<(), ForwardError> {
        if self.forwards.fetch_add(1, Ordering::SeqCst) + 1 == self.fail_at {
            return Err(ForwardError::Device("injected failure".into()));
        }
        self.inner.forward(batch, kv, workspace, logits)
    }
}

/// An asynchronous engine over the fixture model whose forward number `fail_at` fails.
fn failing_engine(fail_at: usize) -> EngineCore {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama3");
    let inner = load_model(&path, &Arc::new(Cpu::new(2))).unwrap().model;
    let model = FailingModel { inner, forwards: Arc::new(AtomicUsize::new(0)), fail_at };
    let config = EngineConfig {
        block_size: 4,
        num_kv_blocks: 256,
        max_model_len: Some(64),
        scheduler: SchedulerConfig { enable_prefix_caching: true, ..SchedulerConfig::default() },
        async_scheduling: true,
        ..EngineConfig::default()
    };
    EngineCore::new(Box::new(model), config).unwrap()
}

/// Steps `core` until a step fails; returns the error's text.
fn step_until_error(core: &mut EngineCore) -> String {
    loop {
        if let Err(e) = core.step() {
            return e.to_string();
        }
    }
}

/// Aborts `ids` in order (as the server does after a failed step), checks that every block
/// came back, then runs `prompts` again: each gives its tokens alone, so no block kept in the
/// prefix cache holds KV the failed steps never wrote.
fn abort_and_rerun(core: &mut EngineCore, ids: &[RequestId], prompts: &[Vec<TokenId>]) {
    for id in ids {
        core.abort(*id);
    }
    let stats = core.stats();
    assert_eq!((stats.kv_usage, stats.num_running, stats.num_waiting), (0.0, 0, 0));
    assert_eq!(core.num_live_requests(), 0, "a failed step's requests leave with their aborts");
    let again: Vec<_> =
        prompts.iter().map(|p| (core.add_request(p.clone(), greedy(12), 0).unwrap(), p)).collect();
    let mut tokens: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            tokens.entry(out.id).or_default().push(out.new_token);
        }
    }
    for (id, p) in again {
        assert_eq!(tokens[&id], alone(p, 12), "{id}");
    }
}

#[test]
fn a_failed_forward_with_a_step_planned_ahead_frees_every_block_and_caches_no_unwritten_kv() {
    // The fifth forward fails while decoding, the step after it planned ahead.
    let mut core = failing_engine(5);
    let prompts: Vec<_> = (0..4).map(|i| prompt(i, 18)).collect();
    let ids: Vec<_> =
        prompts.iter().map(|p| core.add_request(p.clone(), greedy(12), 0).unwrap()).collect();
    let err = step_until_error(&mut core);
    assert!(err.contains("injected failure"), "{err}");
    assert!(core.stats().num_steps_planned_ahead > 0);
    abort_and_rerun(&mut core, &ids, &prompts);
    assert!(core.stats().prefix_cache.num_hit_tokens > 0);
}

#[test]
fn a_prefix_hit_planned_ahead_on_blocks_a_failed_forward_never_wrote_is_dropped() {
    // The first forward (request 1's prefill) fails; request 2, sharing its first 16 tokens,
    // arrived meanwhile and was admitted in the step planned ahead with a hit on those
    // blocks. Aborting request 1 first must not find them shared, nor leave them cached.
    let mut core = failing_engine(1);
    let common = prompt(7, 16);
    let prompts: Vec<Vec<TokenId>> = [prompt(1, 2), prompt(2, 3)]
        .into_iter()
        .map(|tail| common.iter().copied().chain(tail).collect())
        .collect();
    let first = core.add_request(prompts[0].clone(), greedy(12), 0).unwrap();
    assert!(core.step().unwrap().is_empty()); // the prefill is launched
    let second = core.add_request(prompts[1].clone(), greedy(12), 0).unwrap();
    let err = step_until_error(&mut core);
    assert!(err.contains("injected failure"), "{err}");
    let hits = core.scheduler().kv_cache().prefix_cache_stats();
    assert!(hits.num_hit_tokens >= 16, "request 2 was to hit request 1's blocks: {hits:?}");
    abort_and_rerun(&mut core, &[first, second], &prompts);
}
