//! Encoder models (`tests/fixtures/embedding`, made by
//! `scripts/fixtures/make_encoder_fixtures.py`): BERT and XLM-RoBERTa embedding models give
//! sentence-transformers' embeddings, their cross-encoders its `CrossEncoder` scores (a BERT
//! pair's second text as token type 1); a sequence's output is bitwise the same alone or in a
//! batch; a sequence split over steps, or loading for generation, is refused. The BERT model as
//! llama.cpp converts it (`tests/fixtures/gguf_models/bert-mean-f32.gguf`) tokenizes and embeds
//! as the Hugging Face one.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{EMBEDDING_TOLERANCE, Runner, assert_vector_close, cpu};
use kiln_kernels::Reference;
use kiln_models::{
    LoadOptions, LogitsWanted, PoolAccumulator, PoolerConfig, PoolingType, load_model,
    load_model_with,
};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/embedding").join(name)
}

fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn field<T: serde::de::DeserializeOwned>(v: &Value, key: &str) -> T {
    serde_json::from_value(v[key].clone()).unwrap()
}

fn pooling_runner(name: &str) -> Runner {
    let options = LoadOptions { pooling: true, ..LoadOptions::default() };
    Runner::with(load_model_with(&fixture(name), &options, &cpu()).unwrap())
}

/// Every final hidden row of each sequence, all of them whole in one step.
fn hidden_rows<B: kiln_models::Backend>(
    runner: &mut Runner<B>,
    seqs: &[Vec<u32>],
) -> Vec<Vec<Vec<f32>>> {
    let tables: Vec<_> = seqs.iter().map(|s| runner.blocks(s.len())).collect();
    runner.batch.clear();
    runner.batch.set_hidden_output(true);
    for (seq, table) in seqs.iter().zip(&tables) {
        runner.batch.push_seq(seq, 0, table, LogitsWanted::All).unwrap();
    }
    let mut rows = runner.run().into_iter();
    seqs.iter().map(|s| rows.by_ref().take(s.len()).collect()).collect()
}

fn pooled(config: PoolerConfig, rows: &[Vec<f32>]) -> Vec<f32> {
    let mut pool = PoolAccumulator::new(config.pooling, rows[0].len());
    pool.add(0, &rows.concat()).unwrap();
    pool.finish(config.normalize, None).unwrap()
}

#[test]
fn encoders_embed_as_sentence_transformers_does_and_alone_equals_batched() {
    for (name, pooling) in [("bert-mean", PoolingType::Mean), ("xlmr-cls", PoolingType::Cls)] {
        let config = PoolerConfig::of_model(&fixture(name)).unwrap().unwrap();
        assert_eq!(config, PoolerConfig { pooling, normalize: true }, "{name}");
        let r = reference(name);
        let (ids, want): (Vec<Vec<u32>>, Vec<Vec<f32>>) =
            (field(&r, "prompt_ids"), field(&r, "embeddings"));
        let mut runner = pooling_runner(name);
        let texts: Vec<String> = field(&r, "texts");
        for (text, want_ids) in texts.iter().zip(&ids) {
            assert_eq!(&runner.loaded.tokenizer.encode(text, true).unwrap(), want_ids, "{name}");
        }
        let batched = hidden_rows(&mut runner, &ids);
        for (i, (rows, want)) in batched.iter().zip(&want).enumerate() {
            let got = pooled(config, rows);
            assert_vector_close(&got, want, &format!("{name} text {i}"));
            let alone = hidden_rows(&mut runner, std::slice::from_ref(&ids[i]));
            assert_eq!(&alone[0], rows, "{name} text {i}: alone != batched");
        }
    }
}

#[test]
fn a_bert_gguf_file_tokenizes_and_embeds_as_its_checkpoint() {
    let path = fixture("../gguf_models/bert-mean-f32.gguf");
    let config = PoolerConfig::of_model(&path).unwrap().unwrap();
    assert_eq!(config, PoolerConfig { pooling: PoolingType::Mean, normalize: true });
    let options = LoadOptions { pooling: true, ..LoadOptions::default() };
    let mut runner = Runner::with(load_model_with(&path, &options, &cpu()).unwrap());
    let r = reference("bert-mean");
    let (ids, want): (Vec<Vec<u32>>, Vec<Vec<f32>>) =
        (field(&r, "prompt_ids"), field(&r, "embeddings"));
    let texts: Vec<String> = field(&r, "texts");
    let tokenizer = &runner.loaded.tokenizer;
    for (text, want_ids) in texts.iter().zip(&ids) {
        assert_eq!(&tokenizer.encode(text, true).unwrap(), want_ids, "{text}");
    }
    // Accents stripped and upper case lowered, as BERT's normaliser does; [SEP] in the text
    // is the control token; a pair is `[CLS] a [SEP] b [SEP]`.
    let hf = kiln_models::load_tokenizer(&fixture("bert-mean")).unwrap();
    for text in ["Héllo WORLD, the fox!", "a [SEP] b", "ünïcödé 42"] {
        assert_eq!(tokenizer.encode(text, true).unwrap(), hf.encode(text, true).unwrap());
    }
    let pair = tokenizer.encode_pair("the fox", "a dog", true).unwrap();
    assert_eq!(pair, hf.encode_pair("the fox", "a dog", true).unwrap());
    for (i, (rows, want)) in hidden_rows(&mut runner, &ids).iter().zip(&want).enumerate() {
        assert_vector_close(&pooled(config, rows), want, &format!("GGUF text {i}"));
    }
}

#[test]
fn the_reference_backend_runs_encoders_too() {
    let options = LoadOptions { pooling: true, ..LoadOptions::default() };
    for name in ["bert-mean", "xlmr-cls"] {
        let loaded = load_model_with(&fixture(name), &options, &Arc::new(Reference)).unwrap();
        let mut runner = Runner::with(loaded);
        let r = reference(name);
        let (ids, want): (Vec<Vec<u32>>, Vec<Vec<f32>>) =
            (field(&r, "prompt_ids"), field(&r, "embeddings"));
        let config = PoolerConfig::of_model(&fixture(name)).unwrap().unwrap();
        for (i, (rows, want)) in hidden_rows(&mut runner, &ids).iter().zip(&want).enumerate() {
            assert_vector_close(
                &pooled(config, rows),
                want,
                &format!("{name} text {i} (reference)"),
            );
        }
    }
}

#[test]
fn cross_encoders_score_as_sentence_transformers_does() {
    for name in ["bert-rerank", "xlmr-rerank"] {
        let r = reference(name);
        let (pairs, want): (Vec<Vec<u32>>, Vec<f32>) = (field(&r, "pair_ids"), field(&r, "scores"));
        let mut runner = pooling_runner(name);
        let (query, documents): (String, Vec<String>) =
            (field(&r, "query"), field(&r, "documents"));
        for (doc, want_ids) in documents.iter().zip(&pairs) {
            let got = runner.loaded.tokenizer.encode_pair(&query, doc, true).unwrap();
            assert_eq!(&got, want_ids, "{name}: pair token ids");
        }
        let rows = hidden_rows(&mut runner, &pairs);
        let head = runner.loaded.classifier.clone().unwrap();
        let cls = PoolerConfig { pooling: PoolingType::Cls, normalize: false };
        for (i, (rows, want)) in rows.iter().zip(&want).enumerate() {
            let score = head.scores(&pooled(cls, rows));
            assert!(
                (score[0] - want).abs() <= EMBEDDING_TOLERANCE,
                "{name} pair {i}: {score:?} vs {want}"
            );
        }
    }
}

#[test]
fn the_second_text_of_a_bert_pair_is_token_type_one() {
    // The same tokens scored with and without the separator that starts type 1 differ only
    // because of the token types: the reference (token type ids from the tokenizer) matched
    // above; here, a pair's rows after its first [SEP] change when the types do.
    let name = "bert-rerank";
    let pairs: Vec<Vec<u32>> = field(&reference(name), "pair_ids");
    let mut runner = pooling_runner(name);
    let sep = runner.loaded.tokenizer.token_to_id("[SEP]").unwrap();
    let pair = &pairs[0];
    let first_sep = pair.iter().position(|&t| t == sep).unwrap();
    let with_types = hidden_rows(&mut runner, std::slice::from_ref(pair));
    let mut one_segment = pair.clone();
    one_segment[first_sep] = runner.loaded.tokenizer.token_to_id("[UNK]").unwrap();
    let without = hidden_rows(&mut runner, &[one_segment]);
    assert_ne!(with_types[0][first_sep + 1], without[0][first_sep + 1]);
}

#[test]
fn an_encoder_runs_whole_sequences_for_pooling_only() {
    let mut runner = pooling_runner("bert-mean");
    let ids: Vec<Vec<u32>> = field(&reference("bert-mean"), "prompt_ids");
    let table = runner.blocks(ids[0].len());
    runner.batch.clear();
    runner.batch.set_hidden_output(true);
    runner.batch.push_seq(&ids[0][4..], 4, &table, LogitsWanted::All).unwrap();
    let (model, kv, ws, out) =
        (&runner.loaded.model, &mut runner.kv, &mut runner.workspace, &mut runner.logits);
    let e = model.forward(&runner.batch, kv, ws, out).unwrap_err().to_string();
    assert!(e.contains("whole in one step"), "{e}");
    let Err(e) = load_model(&fixture("bert-mean"), &cpu()) else { panic!("loaded to generate") };
    assert!(e.to_string().contains("serves pooling only"), "{e}");
}

/// A change to a `config.json`.
type Patch = fn(&mut Value);

/// `name`'s files in a temporary directory, with `patch` applied to its `config.json`.
fn patched(name: &str, patch: impl Fn(&mut Value)) -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix("kiln-encoder-").tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    let path = dir.path().join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    patch(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

#[test]
fn encoder_configs_kiln_does_not_run_are_refused_by_name() {
    let options = LoadOptions { pooling: true, ..LoadOptions::default() };
    let cases: [(&str, Patch, &str); 6] = [
        ("bert-mean", |c| c["position_embedding_type"] = "relative_key".into(), "relative_key"),
        ("bert-mean", |c| c["is_decoder"] = true.into(), "is_decoder"),
        ("bert-mean", |c| c["hidden_act"] = "relu".into(), "relu"),
        ("bert-mean", |c| c["intermediate_size"] = 48.into(), "intermediate.dense.weight"),
        ("bert-mean", |c| c["type_vocab_size"] = 3.into(), "token_type_embeddings"),
        ("xlmr-cls", |c| c["max_position_embeddings"] = 2.into(), "max_position_embeddings"),
    ];
    for (name, patch, needle) in cases {
        let dir = patched(name, patch);
        let Err(e) = load_model_with(dir.path(), &options, &cpu()) else {
            panic!("{name} with {needle}: loaded");
        };
        assert!(e.to_string().contains(needle), "{name}: {e}");
    }
}
