//! Prefill/decode disaggregation between two engines: a prefill engine pins a finished
//! prompt's KV, a decode engine imports the blocks it lacks, and its greedy tokens equal a
//! colocated engine's bit for bit (f16 and 8-bit KV); pins expire, only pinned blocks are
//! read, and data that is not whole blocks is refused with nothing changed.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_engine::{
    EngineConfig, EngineCore, EngineOutput, KvCacheDtype, KvHandoffError, PreparedRequest,
    SchedulerConfig,
};
use kiln_kernels::Cpu;
use kiln_models::load_model;

const BLOCK: usize = 4;

fn engine(dtype: KvCacheDtype) -> EngineCore {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama3");
    let model = load_model(&path, &std::sync::Arc::new(Cpu::new(2))).unwrap().model;
    let config = EngineConfig {
        block_size: BLOCK,
        num_kv_blocks: 48,
        max_model_len: Some(64),
        scheduler: SchedulerConfig::default(),
        kv_cache_dtype: dtype,
        ..EngineConfig::default()
    };
    EngineCore::new(model, config).unwrap()
}

fn prompt(seed: u32, len: u32) -> Vec<TokenId> {
    (0..len).map(|i| TokenId((seed.wrapping_mul(7919) + i * 131 + i * i * 17) % 500 + 3)).collect()
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
}

/// Runs one request to its end; its outputs in order.
fn run(core: &mut EngineCore, id: u64, request: PreparedRequest) -> Vec<EngineOutput> {
    core.add_prepared(RequestId(id), request, 0).unwrap();
    let mut outs = Vec::new();
    while core.has_unfinished() {
        outs.extend(core.step().unwrap().into_iter().filter(|o| o.id == RequestId(id)));
    }
    outs
}

fn prepared(prompt: &[TokenId], max_tokens: usize) -> PreparedRequest {
    PreparedRequest::compile(prompt.to_vec(), params(max_tokens), 512, None).unwrap()
}

fn tokens(outs: &[EngineOutput]) -> Vec<TokenId> {
    outs.iter().map(|o| o.new_token).collect()
}

#[test]
fn a_disaggregated_request_decodes_exactly_as_a_colocated_one() {
    for dtype in [KvCacheDtype::F16, KvCacheDtype::Int8] {
        let (mut prefill, mut decode, mut colocated) =
            (engine(dtype), engine(dtype), engine(dtype));
        prefill.enable_kv_export(Duration::from_secs(60)).unwrap();
        // The second prompt shares its first two blocks with the first, which the decode
        // engine then holds: it fetches only the rest.
        let first = prompt(1, 19);
        let mut second = first[..8].to_vec();
        second.extend(prompt(7, 13));
        for (i, p) in [first, second].iter().enumerate() {
            let id = i as u64;
            let outs = run(&mut prefill, id, prepared(p, 1).with_kv_export());
            let pin = outs.last().unwrap().kv_pin.clone().expect("the last output carries the pin");
            assert_eq!(pin.blocks.len(), (p.len() - 1) / BLOCK, "{dtype:?}");
            let cached = decode.kv_cached_prefix_blocks(p);
            assert_eq!(cached, if i == 0 { 0 } else { 2 });
            let mut data = Vec::new();
            let range = (cached, pin.blocks.len() - cached);
            prefill.export_kv(pin.id, p, range, true, &mut data).unwrap();
            assert_eq!(prefill.num_kv_pins(), 0, "fetched with release");
            let imported = decode.import_kv(p, cached, &data).unwrap();
            assert_eq!(imported, pin.blocks.len() - cached);
            let got = run(&mut decode, id, prepared(p, 12));
            let hit = got[0].first.unwrap().num_cached_tokens;
            assert_eq!(hit, pin.blocks.len() * BLOCK, "{dtype:?}: the imported blocks are hit");
            let want = run(&mut colocated, id + 100, prepared(p, 12));
            assert_eq!(tokens(&got), tokens(&want), "{dtype:?}, prompt {i}");
            decode.scheduler().check_invariants().unwrap();
            prefill.scheduler().check_invariants().unwrap();
        }
        let stats = prefill.stats().kv_handoff;
        assert_eq!((stats.pins, stats.pinned_blocks), (0, 0));
        assert_eq!(stats.exported_blocks, 4 + 3);
        assert_eq!(decode.stats().kv_handoff.imported_blocks, 4 + 3);
    }
}

#[test]
fn pins_expire_and_only_pinned_blocks_are_read() {
    let mut core = engine(KvCacheDtype::F16);
    core.enable_kv_export(Duration::from_millis(0)).unwrap();
    let p = prompt(3, 14);
    let pin = run(&mut core, 0, prepared(&p, 1).with_kv_export()).pop().unwrap().kv_pin.unwrap();
    assert_eq!(core.stats().kv_handoff.pinned_blocks, 3);
    let mut out = Vec::new();
    assert_eq!(
        core.export_kv(pin.id, &p, (1, 3), false, &mut out),
        Err(KvHandoffError::OutOfRange { pin: pin.id, end: 4, pinned: 3 })
    );
    // Another prompt with the same last blocks: the first block differs, nothing is read.
    let mut other = p.clone();
    other[0] = TokenId(p[0].0 + 1);
    assert_eq!(
        core.export_kv(pin.id, &other, (2, 1), false, &mut out),
        Err(KvHandoffError::PromptMismatch { block: 0 })
    );
    assert!(out.is_empty());
    core.export_kv(pin.id, &p, (0, 3), false, &mut out).unwrap();
    assert_eq!(out.len(), 3 * core.model().kv_block_bytes());
    assert_eq!(core.expire_kv_pins(Instant::now()), 1);
    assert_eq!(
        core.export_kv(pin.id, &p, (0, 3), true, &mut out),
        Err(KvHandoffError::UnknownPin(pin.id))
    );
    let stats = core.stats().kv_handoff;
    assert_eq!((stats.pins, stats.pinned_blocks, stats.pins_expired), (0, 0, 1));
    core.scheduler().check_invariants().unwrap();
}

#[test]
fn refusals_change_nothing() {
    let mut core = engine(KvCacheDtype::F16);
    let p = prompt(5, 10);
    let err = core.add_prepared(RequestId(0), prepared(&p, 1).with_kv_export(), 0).unwrap_err();
    assert!(err.to_string().contains("KV export is off"), "{err}");
    assert!(!core.has_unfinished());
    let block_bytes = core.model().kv_block_bytes();
    let err = core.import_kv(&p, 0, &vec![0u8; block_bytes + 1]).unwrap_err();
    assert!(matches!(err, KvHandoffError::BadData(_)), "{err}");
    assert_eq!(core.kv_cached_prefix_blocks(&p), 0);
    assert_eq!(core.stats().kv_handoff.imported_blocks, 0);
}
