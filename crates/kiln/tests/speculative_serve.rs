//! `kiln serve --speculative-config` end to end on the tiny fixture: completions are the same
//! text as without speculation, with prompt lookup and with a draft model, drafts are verified
//! (vLLM's `spec_decode_*` metrics count them), and an invalid configuration (a bad field, a
//! draft model with another vocabulary) stops start-up (`serve`, `generate`) with the reason
//! named.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

const SPEC: &str = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}"#;

/// Greedy completions of prompts (token ids) that repeat a span, so prompt lookup drafts.
fn completions(addr: &str) -> Vec<String> {
    (0..6u32)
        .map(|i| {
            let span: Vec<u32> = (0..5).map(|t| (i * 37 + t * 11) % 400 + 10).collect();
            let prompt: Vec<u32> = span.iter().chain(&span).chain(&span).copied().collect();
            common::greedy_completion(addr, &prompt, 60)
        })
        .collect()
}

#[test]
fn serving_with_speculation_gives_the_same_completions() {
    let (plain, url) = common::start_server();
    let expected = completions(url.trim_start_matches("http://"));
    drop(plain);
    let (_spec, url) = common::start_server_with(&["--speculative-config", SPEC]);
    let addr = url.trim_start_matches("http://");
    assert_eq!(completions(addr), expected);
    let drafts = common::metric(addr, "kiln:spec_decode_num_drafts_total");
    let accepted = common::metric(addr, "kiln:spec_decode_num_accepted_tokens_total");
    assert!(drafts > 0.0 && accepted > 0.0, "drafts {drafts}, accepted {accepted}");
    assert!(accepted <= common::metric(addr, "kiln:spec_decode_num_draft_tokens_total"));
}

#[test]
fn serving_with_a_draft_model_gives_the_same_completions() {
    let (plain, url) = common::start_server();
    let expected = completions(url.trim_start_matches("http://"));
    drop(plain);
    // The fixture drafting for itself: every greedy draft is accepted.
    let spec = serde_json::json!({
        "model": common::tiny_model(), "num_speculative_tokens": 3,
    });
    let (_spec, url) = common::start_server_with(&["--speculative-config", &spec.to_string()]);
    let addr = url.trim_start_matches("http://");
    assert_eq!(completions(addr), expected);
    let drafted = common::metric(addr, "kiln:spec_decode_num_draft_tokens_total");
    let accepted = common::metric(addr, "kiln:spec_decode_num_accepted_tokens_total");
    assert!(drafted > 0.0 && accepted == drafted, "drafted {drafted}, accepted {accepted}");
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused_at_start_up() {
    // The same model with two tokens' ids swapped in its tokenizer: same size, other tokens.
    let swapped = std::env::temp_dir().join(format!("kiln-swapped-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&swapped).unwrap();
    for entry in std::fs::read_dir(common::tiny_model()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, swapped.join(path.file_name().unwrap())).unwrap();
    }
    let tokenizer_path = swapped.join("tokenizer.json");
    let mut tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tokenizer_path).unwrap()).unwrap();
    let vocab = tokenizer["model"]["vocab"].as_object_mut().unwrap();
    let (a, b) = (vocab["!"].clone(), vocab["\""].clone());
    vocab.insert("!".into(), b);
    vocab.insert("\"".into(), a);
    std::fs::write(&tokenizer_path, tokenizer.to_string()).unwrap();
    // Another size (qwen2: 503 tokens), and the same size with other tokens.
    let qwen2 = common::tiny_model().with_file_name("qwen2");
    for (draft, message) in [
        (qwen2, "the draft model's vocabulary (503 tokens) differs from the target's (512)"),
        (swapped.clone(), "the draft model's tokenizer differs from the target's (token 0 is"),
    ] {
        let spec = serde_json::json!({"model": draft, "num_speculative_tokens": 3});
        // `generate` exits by itself even if the check were missing (a server would not).
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["generate", "--model"])
            .arg(common::tiny_model())
            .args(["--prompt", "hi", "--max-tokens", "2", "--speculative-config"])
            .arg(spec.to_string())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(stderr.contains(message), "{stderr}");
    }
    std::fs::remove_dir_all(&swapped).unwrap();
}

#[test]
fn an_invalid_speculative_config_is_refused_at_start_up() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "--model"])
        .arg(common::tiny_model())
        .args(["--port", "0", "--speculative-config", r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}"#])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("`prompt_lookup_min` (4) must not exceed prompt_lookup_max (2)"),
        "{stderr}"
    );
}
