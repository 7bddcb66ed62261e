//! The PEFT adapter fixtures (`tests/fixtures/lora/<name>/`): their directories, PEFT's
//! reference cases and the HF fixture each adapter was made for.

use std::path::PathBuf;

use kiln_models::LogitsWanted;

use serde_json::Value;

use super::Runner;

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

/// Logits of every position of `tokens` with the adapter of `slot`, in one pass.
pub fn one_shot(runner: &mut Runner, tokens: &[u32], slot: u32) -> Vec<Vec<f32>> {
    let table = runner.blocks(tokens.len());
    runner.batch.clear();
    runner.batch.push_seq(tokens, 0, &table, LogitsWanted::All).unwrap();
    runner.batch.set_last_adapter(slot);
    runner.run()
}
