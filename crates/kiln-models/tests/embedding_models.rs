//! Embedding models (`tests/fixtures/embedding`, made by
//! `scripts/fixtures/make_embedding_fixtures.py`): decoders loaded for pooling, as
//! sentence-transformers saved them (a base model without its head), give
//! sentence-transformers' embeddings; a text's embedding is bitwise the same alone, in a
//! batch, and prefilled in chunks.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::path::PathBuf;

use common::{Runner, assert_vector_close, cpu};
use kiln_models::gguf::GgufValue;
use kiln_models::{
    LoadOptions, LogitsWanted, PoolAccumulator, PoolerConfig, PoolingType, load_model,
    load_model_with,
};
use serde_json::Value;

struct Reference {
    prompt_ids: Vec<Vec<u32>>,
    embeddings: Vec<Vec<f32>>,
    dimensions: usize,
    embeddings_short: Vec<Vec<f32>>,
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/embedding").join(name)
}

fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let rows = |key: &str| -> Vec<Vec<f32>> { serde_json::from_value(v[key].clone()).unwrap() };
    Reference {
        prompt_ids: serde_json::from_value(v["prompt_ids"].clone()).unwrap(),
        embeddings: rows("embeddings"),
        dimensions: v["dimensions"].as_u64().unwrap() as usize,
        embeddings_short: rows("embeddings_16"),
    }
}

fn pooling_runner(name: &str) -> Runner {
    let options = LoadOptions { pooling: true, ..LoadOptions::default() };
    Runner::with(load_model_with(&fixture(name), &options, &cpu()).unwrap())
}

/// The sequences' pooled vectors from one step holding all of them, each prefilled from
/// position `start` (earlier positions were written by a step before: `chunk` tokens each).
fn embed(
    runner: &mut Runner,
    config: PoolerConfig,
    seqs: &[Vec<u32>],
    chunk: usize,
) -> Vec<Vec<f32>> {
    let width = runner.loaded.model.config().hidden_size;
    let mut pools: Vec<_> =
        seqs.iter().map(|_| PoolAccumulator::new(config.pooling, width)).collect();
    let tables: Vec<_> = seqs.iter().map(|s| runner.blocks(s.len())).collect();
    let mut start = 0;
    while seqs.iter().any(|s| start < s.len()) {
        runner.batch.clear();
        runner.batch.set_hidden_output(true);
        let mut firsts = Vec::new();
        for (i, seq) in seqs.iter().enumerate().filter(|(_, s)| start < s.len()) {
            let end = (start + chunk).min(seq.len());
            let wanted = if pools[i].wants_all_rows(start) {
                LogitsWanted::All
            } else if end == seq.len() {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            };
            let n = match wanted {
                LogitsWanted::All => end - start,
                LogitsWanted::Last => 1,
                LogitsWanted::None => 0,
            };
            runner.batch.push_seq(&seq[start..end], start, &tables[i], wanted).unwrap();
            firsts.push((i, end - n, n));
        }
        let rows = runner.run();
        let mut r = 0;
        for (i, first, n) in firsts {
            let flat: Vec<f32> = rows[r..r + n].concat();
            pools[i].add(first, &flat).unwrap();
            r += n;
        }
        start += chunk;
    }
    pools.iter().map(|p| p.finish(config.normalize, None).unwrap()).collect()
}

#[test]
fn pooler_configs_come_from_the_checkpoints() {
    let last = PoolerConfig::of_model(&fixture("qwen3-embed")).unwrap().unwrap();
    assert_eq!(last, PoolerConfig { pooling: PoolingType::Last, normalize: true });
    let mean = PoolerConfig::of_model(&fixture("llama3-mean")).unwrap().unwrap();
    assert_eq!(mean, PoolerConfig { pooling: PoolingType::Mean, normalize: false });
}

#[test]
fn embeddings_match_sentence_transformers() {
    for name in ["qwen3-embed", "llama3-mean"] {
        let config = PoolerConfig::of_model(&fixture(name)).unwrap().unwrap();
        let want = reference(name);
        let (tok, _) = kiln_tokenizer::Tokenizer::from_dir(&fixture(name)).unwrap();
        let texts: Vec<String> = {
            let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
            let v: Value = serde_json::from_str(&text).unwrap();
            serde_json::from_value(v["texts"].clone()).unwrap()
        };
        for (text, ids) in texts.iter().zip(&want.prompt_ids) {
            assert_eq!(&tok.encode(text, true).unwrap(), ids, "{name}: {text:?}");
        }
        let mut runner = pooling_runner(name);
        let got = embed(&mut runner, config, &want.prompt_ids, usize::MAX);
        for (i, (g, w)) in got.iter().zip(&want.embeddings).enumerate() {
            assert_vector_close(g, w, &format!("{name} text {i}"));
        }
        // `dimensions`: the first values, normalised again where the model normalises.
        for (i, ids) in want.prompt_ids.iter().enumerate() {
            let mut pool =
                PoolAccumulator::new(config.pooling, runner.loaded.model.config().hidden_size);
            let rows = embed_rows(&mut runner, ids);
            pool.add(0, &rows).unwrap();
            let short = pool.finish(config.normalize, Some(want.dimensions)).unwrap();
            assert_vector_close(
                &short,
                &want.embeddings_short[i],
                &format!("{name} text {i}, 16 dims"),
            );
        }
    }
}

/// Every final hidden row of `ids`, one pass.
fn embed_rows(runner: &mut Runner, ids: &[u32]) -> Vec<f32> {
    let table = runner.blocks(ids.len());
    runner.batch.clear();
    runner.batch.set_hidden_output(true);
    runner.batch.push_seq(ids, 0, &table, LogitsWanted::All).unwrap();
    runner.run().concat()
}

#[test]
fn an_embedding_is_the_same_alone_batched_and_chunked() {
    for name in ["qwen3-embed", "llama3-mean"] {
        let config = PoolerConfig::of_model(&fixture(name)).unwrap().unwrap();
        let seqs = reference(name).prompt_ids;
        let mut runner = pooling_runner(name);
        let batched = embed(&mut runner, config, &seqs, usize::MAX);
        for (i, seq) in seqs.iter().enumerate() {
            let alone = embed(&mut runner, config, std::slice::from_ref(seq), usize::MAX);
            assert_eq!(alone[0], batched[i], "{name} text {i} alone");
        }
        for chunk in [1, 3, 7] {
            assert_eq!(
                embed(&mut runner, config, &seqs, chunk),
                batched,
                "{name} chunks of {chunk}"
            );
        }
    }
}

#[test]
fn a_base_model_without_its_head_loads_only_for_pooling() {
    let e = load_model(&fixture("qwen3-embed"), &cpu()).err().unwrap().to_string();
    assert!(e.contains("without an LM head") && e.contains("--runner pooling"), "{e}");
    // A generative checkpoint loads for pooling too (its head is not read), and a step
    // asking it for logits is refused.
    let options = LoadOptions { pooling: true, ..LoadOptions::default() };
    let mut runner =
        Runner::with(load_model_with(&common::fixture("qwen3"), &options, &cpu()).unwrap());
    let table = runner.blocks(3);
    runner.batch.clear();
    runner.batch.push_seq(&[1, 2, 3], 0, &table, LogitsWanted::Last).unwrap();
    let e = runner
        .loaded
        .model
        .forward(&runner.batch, &mut runner.kv, &mut runner.workspace, &mut runner.logits)
        .unwrap_err()
        .to_string();
    assert!(e.contains("loaded for pooling"), "{e}");
}

/// A GGUF embedding model (llama.cpp's converter writes `{arch}.pooling_type`; 3 is last):
/// the qwen3 fixture's weights, which `qwen3-embed` holds too, as a GGUF file. Read as a
/// pooler, loaded for pooling, it gives sentence-transformers' vectors.
#[test]
fn a_gguf_with_a_pooling_type_gives_the_same_vectors() {
    let dir = tempfile::tempdir().unwrap();
    let pooling = [("qwen3.pooling_type", GgufValue::U32(3))];
    let path = common::gguf::convert_with("qwen3", "qwen3", dir.path(), &pooling);
    let config = PoolerConfig::of_model(&path).unwrap().unwrap();
    assert_eq!(config, PoolerConfig { pooling: PoolingType::Last, normalize: true });
    let options = LoadOptions { pooling: true, ..LoadOptions::default() };
    let mut runner = Runner::with(load_model_with(&path, &options, &cpu()).unwrap());
    let want = reference("qwen3-embed");
    let got = embed(&mut runner, config, &want.prompt_ids, usize::MAX);
    for (i, (g, w)) in got.iter().zip(&want.embeddings).enumerate() {
        assert_vector_close(g, w, &format!("GGUF text {i}"));
    }
    // Mean and CLS by number; rank (4) is refused by name; none (0) declares no pooler.
    for (value, want) in [(1, Some(PoolingType::Mean)), (2, Some(PoolingType::Cls)), (0, None)] {
        let pooling = [("qwen3.pooling_type", GgufValue::U32(value))];
        let path = common::gguf::convert_with("qwen3", "qwen3", dir.path(), &pooling);
        assert_eq!(PoolerConfig::of_model(&path).unwrap().map(|c| c.pooling), want);
    }
    let rank = [("qwen3.pooling_type", GgufValue::U32(4))];
    let path = common::gguf::convert_with("qwen3", "qwen3", dir.path(), &rank);
    let e = PoolerConfig::of_model(&path).unwrap_err().to_string();
    assert!(e.contains("rank"), "{e}");
}

/// A cross-encoder (`Qwen3ForSequenceClassification`, one label) loads for pooling only, with
/// its score head on the host; its tokenizer encodes pairs as transformers does, and the
/// classifier on the last token's hidden state gives sentence-transformers' `CrossEncoder`
/// scores.
#[test]
fn a_cross_encoder_gives_cross_encoder_scores() {
    let dir = fixture("qwen3-rerank");
    let config = kiln_models::ModelConfig::from_file(&dir.join("config.json")).unwrap();
    assert_eq!(config.head, kiln_models::OutputHead::Classifier { num_labels: 1 });
    let e = load_model(&dir, &cpu()).err().unwrap().to_string();
    assert!(e.contains("sequence classifier"), "{e}");
    let options = LoadOptions { pooling: true, ..LoadOptions::default() };
    let loaded = load_model_with(&dir, &options, &cpu()).unwrap();
    let classifier = loaded.classifier.clone().unwrap();
    assert_eq!(classifier.num_labels(), 1);
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let pair_ids: Vec<Vec<u32>> = serde_json::from_value(v["pair_ids"].clone()).unwrap();
    let scores: Vec<f32> = serde_json::from_value(v["scores"].clone()).unwrap();
    let query = v["query"].as_str().unwrap();
    for (doc, ids) in v["documents"].as_array().unwrap().iter().zip(&pair_ids) {
        assert_eq!(&loaded.tokenizer.encode_pair(query, doc.as_str().unwrap(), true).unwrap(), ids);
    }
    let mut runner = Runner::with(loaded);
    let last = PoolerConfig { pooling: PoolingType::Last, normalize: false };
    let hidden = embed(&mut runner, last, &pair_ids, usize::MAX);
    for (i, (h, want)) in hidden.iter().zip(&scores).enumerate() {
        let got = classifier.scores(h);
        assert!((got[0] - want).abs() < 1e-4, "pair {i}: {} vs {want}", got[0]);
    }
}
