//! Broken model directories give errors that name the file (and tensor), never a panic.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::path::{Path, PathBuf};

use kiln_models::load_model;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

/// A private copy of a fixture directory to damage.
fn copy_fixture(name: &str, tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("kiln-bad-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
    dst
}

fn load_error(dir: &Path) -> String {
    match load_model(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_and_truncated_files() {
    assert!(load_error(Path::new("/nonexistent/model")).contains("/nonexistent/model"));

    let dir = copy_fixture("llama3", "missing");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert!(load_error(&dir).contains("tokenizer.json"));

    let dir = copy_fixture("llama3", "trunc");
    let weights = dir.join("model.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&weights).unwrap();
    f.set_len(len / 2).unwrap();
    let msg = load_error(&dir);
    assert!(msg.contains("model.safetensors") && msg.contains("outside"), "{msg}");

    let dir = copy_fixture("llama2", "shard");
    std::fs::remove_file(dir.join("model-00002-of-00003.safetensors")).unwrap();
    assert!(load_error(&dir).contains("model-00002-of-00003.safetensors"));
}

#[test]
fn config_disagreeing_with_weights_names_the_tensor() {
    let dir = copy_fixture("qwen2", "shape");
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96"))
        .unwrap();
    let msg = load_error(&dir);
    assert!(msg.contains("mlp.gate_proj.weight") && msg.contains("[96, 64]"), "{msg}");

    let dir = copy_fixture("qwen2", "arch");
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("Qwen2ForCausalLM", "FalconForCausalLM")).unwrap();
    assert!(load_error(&dir).contains("unsupported architecture `FalconForCausalLM`"));

    let dir = copy_fixture("qwen2", "json");
    std::fs::write(dir.join("config.json"), "{\"architectures\": [").unwrap();
    assert!(load_error(&dir).contains("not valid JSON"));
}
