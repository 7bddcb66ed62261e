//! A prefix cache saved to a file and restored into a new engine: the restored blocks are hit
//! and give bitwise the tokens of a run without any cache, for every KV dtype; hostile files
//! (foreign, truncated, bit-flipped) are refused whole and leave the cache empty and working.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_engine::prefix_store::PrefixStoreError;
use kiln_engine::{EngineConfig, EngineCore, KvCacheDtype, SchedulerConfig};
use kiln_kernels::Cpu;
use kiln_models::load_model;

const FINGERPRINT: u64 = 0x1234_5678_9abc_def0;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama3")
}

fn engine(
    dtype: KvCacheDtype,
    block_size: usize,
    num_kv_blocks: usize,
    caching: bool,
) -> EngineCore {
    let model = load_model(&fixture(), &std::sync::Arc::new(Cpu::new(2))).unwrap().model;
    let config = EngineConfig {
        block_size,
        num_kv_blocks,
        max_model_len: Some(64.min(num_kv_blocks * block_size)),
        scheduler: SchedulerConfig { enable_prefix_caching: caching, ..SchedulerConfig::default() },
        kv_cache_dtype: dtype,
        ..EngineConfig::default()
    };
    EngineCore::new(model, config).unwrap()
}

/// Six prompts sharing a 17-token prefix (vocabulary 512).
fn requests() -> Vec<Vec<TokenId>> {
    let tokens = |seed: u32, len: u32| -> Vec<TokenId> {
        (0..len)
            .map(|i| TokenId((seed.wrapping_mul(7919) + i * 131 + i * i * 17) % 500 + 3))
            .collect()
    };
    (0..6)
        .map(|i| {
            let mut p = tokens(1, 17);
            p.extend(tokens(100 + i, 3 + i));
            p
        })
        .collect()
}

/// Runs the prompts one after another (12 greedy tokens each); outputs in order.
fn run(core: &mut EngineCore, prompts: &[Vec<TokenId>]) -> Vec<Vec<TokenId>> {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(12) };
    let mut outputs = Vec::new();
    for p in prompts {
        let id = core.add_request(p.clone(), params.clone(), 0).unwrap();
        let mut tokens: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
        while core.has_unfinished() {
            for out in core.step().unwrap() {
                tokens.entry(out.id).or_default().push(out.new_token);
            }
        }
        outputs.push(tokens.remove(&id).unwrap());
    }
    assert_eq!(core.stats().kv_usage, 0.0);
    outputs
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-prefix-store-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("prefix-cache.bin")
}

fn cached_blocks(core: &EngineCore) -> usize {
    core.scheduler().kv_cache().pool().num_cached_blocks()
}

#[test]
fn a_restored_prefix_cache_is_hit_and_changes_no_token() {
    for dtype in KvCacheDtype::ALL {
        let prompts = requests();
        let expected = run(&mut engine(dtype, 4, 64, false), &prompts);

        let mut first = engine(dtype, 4, 64, true);
        assert_eq!(run(&mut first, &prompts), expected);
        let path = scratch(&format!("roundtrip-{}", dtype.name()));
        let saved = first.save_prefix_cache(&path, FINGERPRINT).unwrap();
        assert_eq!(saved, cached_blocks(&first), "{dtype:?}: every cached block is reachable");
        assert!(saved > 4);

        let mut second = engine(dtype, 4, 64, true);
        let summary = second.restore_prefix_cache(&path, FINGERPRINT).unwrap();
        assert_eq!((summary.blocks, summary.skipped), (saved, 0), "{dtype:?}");
        second.scheduler().kv_cache().check_invariants().unwrap();
        // The very first request hits what the other process computed.
        assert_eq!(run(&mut second, &prompts[..1]), expected[..1]);
        assert_eq!(second.stats().prefix_cache.num_hit_tokens, 16, "{dtype:?}");
        assert_eq!(run(&mut second, &prompts[1..]), expected[1..]);

        // A smaller cache restores what fits, chains from their heads, and stays exact.
        let mut small = engine(dtype, 4, 12, true);
        let summary = small.restore_prefix_cache(&path, FINGERPRINT).unwrap();
        assert_eq!((summary.blocks, summary.blocks + summary.skipped), (12, saved), "{dtype:?}");
        assert_eq!(run(&mut small, &prompts), expected, "{dtype:?}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}

/// Applies `damage` to a copy of `good` and checks the restore is refused as `expect` says,
/// with the cache left empty and the engine still exact.
fn refused(
    good: &Path,
    core: &mut EngineCore,
    fingerprint: u64,
    damage: impl FnOnce(&mut Vec<u8>),
    expect: fn(&PrefixStoreError) -> bool,
) -> String {
    let mut bytes = std::fs::read(good).unwrap();
    damage(&mut bytes);
    let bad = good.with_file_name("bad.bin");
    std::fs::write(&bad, &bytes).unwrap();
    let err = core.restore_prefix_cache(&bad, fingerprint).unwrap_err();
    assert!(expect(&err), "unexpected refusal: {err}");
    assert_eq!(cached_blocks(core), 0, "{err}");
    core.scheduler().kv_cache().check_invariants().unwrap();
    err.to_string()
}

#[test]
fn hostile_cache_files_are_refused_whole() {
    let prompts = requests();
    let expected = run(&mut engine(KvCacheDtype::F16, 4, 64, false), &prompts);
    let mut first = engine(KvCacheDtype::F16, 4, 64, true);
    run(&mut first, &prompts);
    let path = scratch("hostile");
    first.save_prefix_cache(&path, FINGERPRINT).unwrap();
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    let foreign = |e: &PrefixStoreError| matches!(e, PrefixStoreError::Foreign(_));
    let corrupted = |e: &PrefixStoreError| matches!(e, PrefixStoreError::Corrupted(_));

    let mut core = engine(KvCacheDtype::F16, 4, 64, true);
    let msg = refused(&path, &mut core, FINGERPRINT ^ 1, |_| {}, foreign);
    assert!(msg.contains("model file"), "{msg}");
    let msg = refused(&path, &mut core, FINGERPRINT, |b| b.truncate(len - 1), corrupted);
    assert!(msg.contains("the header promises"), "{msg}");
    refused(&path, &mut core, FINGERPRINT, |b| b.truncate(20), corrupted);
    refused(&path, &mut core, FINGERPRINT, Vec::clear, corrupted);
    refused(&path, &mut core, FINGERPRINT, |b| b.extend_from_slice(&[0; 7]), corrupted);
    // A flipped bit anywhere: the header, a parent index, a token, KV bytes, the last CRC.
    for at in [13, 89, 100, len / 2, len - 1] {
        let msg = refused(&path, &mut core, FINGERPRINT, |b| b[at] ^= 0x10, corrupted);
        assert!(msg.contains("checksum"), "{at}: {msg}");
    }
    let msg = refused(
        &path,
        &mut core,
        FINGERPRINT,
        |b| b[..8].copy_from_slice(b"GGUF\0\0\0\0"),
        foreign,
    );
    assert!(msg.contains("not a kiln prefix cache"), "{msg}");
    // The engine was never touched: it is exact and caches as usual.
    assert_eq!(run(&mut core, &prompts), expected);
    assert!(cached_blocks(&core) > 0);

    // Another dtype, block size or cache off: refused by name before any block is read.
    let mut int8 = engine(KvCacheDtype::Int8, 4, 64, true);
    let msg = refused(&path, &mut int8, FINGERPRINT, |_| {}, foreign);
    assert!(msg.contains("KV cache dtype f16, this server has int8"), "{msg}");
    let mut wide = engine(KvCacheDtype::F16, 8, 64, true);
    let msg = refused(&path, &mut wide, FINGERPRINT, |_| {}, foreign);
    assert!(msg.contains("block size 4, this server has 8"), "{msg}");
    let mut off = engine(KvCacheDtype::F16, 4, 64, false);
    let err = off.restore_prefix_cache(&path, FINGERPRINT).unwrap_err();
    assert!(matches!(err, PrefixStoreError::NotIdle(_)), "{err}");
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// The files in `dir` other than `keep`.
fn others(dir: &Path, keep: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != keep)
        .collect();
    names.sort();
    names
}

/// Issue 53: a symlink planted at the old fixed temporary name is never written through, two
/// saves never share a temporary file, and a failed save leaves neither a temporary file nor a
/// changed target.
#[cfg(unix)]
#[test]
fn saves_never_write_through_planted_names_and_clean_up_when_they_fail() {
    let dtype = KvCacheDtype::F16;
    let mut core = engine(dtype, 4, 64, true);
    run(&mut core, &requests());
    let path = scratch("planted");
    let dir = path.parent().unwrap().to_owned();
    std::fs::remove_dir_all(&dir).unwrap(); // a crashed run's links
    std::fs::create_dir_all(&dir).unwrap();
    let victim = dir.join("victim.txt");
    std::fs::write(&victim, "precious").unwrap();
    // Every name the old code or a guess would use, pointing at the victim.
    for name in ["prefix-cache.tmp", ".prefix-cache.bin.tmp"] {
        std::os::unix::fs::symlink(&victim, dir.join(name)).unwrap();
    }
    let pid = std::process::id();
    for n in 0..3 {
        let planted = dir.join(format!(".prefix-cache.bin.{pid}.{n}.tmp"));
        std::os::unix::fs::symlink(&victim, planted).unwrap();
    }
    let saved = core.save_prefix_cache(&path, FINGERPRINT).unwrap();
    assert!(saved > 4);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert!(std::fs::symlink_metadata(&path).unwrap().is_file());
    // Only the planted links remain beside the saved file: no temporary file of ours.
    let left = others(&dir, "prefix-cache.bin");
    assert_eq!(left.len(), 6, "{left:?}");
    assert!(left.iter().all(|n| n == "victim.txt" || n.contains("tmp")), "{left:?}");

    // A symlink at the saved name is replaced by the file, not written through.
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(&victim, &path).unwrap();
    core.save_prefix_cache(&path, FINGERPRINT).unwrap();
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert!(std::fs::symlink_metadata(&path).unwrap().is_file());
    // ... and a restore does not follow one.
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(&victim, &path).unwrap();
    assert!(engine(dtype, 4, 64, true).restore_prefix_cache(&path, FINGERPRINT).is_err());

    // A save that cannot complete (here the rename: a directory holds the name) removes its
    // temporary file.
    let blocked = dir.join("blocked.bin");
    std::fs::create_dir_all(blocked.join("inside")).unwrap();
    let before = others(&dir, "");
    assert!(core.save_prefix_cache(&blocked, FINGERPRINT).is_err());
    assert_eq!(others(&dir, ""), before);
    std::fs::remove_dir_all(&dir).unwrap();
}
