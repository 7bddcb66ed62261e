//! The PEFT adapter fixtures (`tests/fixtures/lora/<name>/`): their directories, PEFT's
//! reference cases and the HF fixture each adapter was made for.

use std::path::PathBuf;

use serde_json::Value;

/// The directory of adapter fixture `name`.
pub fn lora_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lora").join(name)
}

/// `(prompt + greedy ids, PEFT's logits rows, prompt length)` of each case of adapter `name`.
pub fn lora_cases(name: &str, vocab: usize) -> Vec<(Vec<u32>, Vec<Vec<f32>>, usize)> {
    super::cases_in(&lora_fixture(name), Some(vocab))
        .into_iter()
        .map(|c| {
            let tokens: Vec<u32> = c.prompt_ids.iter().chain(&c.greedy_ids).copied().collect();
            (tokens, c.logits, c.prompt_ids.len())
        })
        .collect()
}

/// The HF fixture adapter `name` was made for.
pub fn base_of(name: &str) -> String {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(lora_fixture(name).join("reference.json")).unwrap(),
    )
    .unwrap();
    reference["base"].as_str().unwrap().to_owned()
}
