//! `kiln serve --speculative-config` end to end on the tiny fixture: completions are the same
//! text as without speculation, with prompt lookup and with a draft model, drafts are verified
//! (vLLM's `spec_decode_*` metrics count them), and an invalid configuration (a bad field, a
//! draft model with another vocabulary) stops start-up with the reason named.

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
            let body = serde_json::json!({
                "model": "tiny", "prompt": prompt, "max_tokens": 60, "temperature": 0,
                "ignore_eos": true,
            });
            let (status, text) = common::http(addr, "POST", "/v1/completions", &body.to_string());
            assert_eq!(status, 200, "{text}");
            let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|_| {
                // A chunked body: the JSON is the second line.
                serde_json::from_str(text.lines().nth(1).unwrap()).unwrap()
            });
            v["choices"][0]["text"].as_str().unwrap().to_owned()
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
    let other = common::tiny_model().with_file_name("qwen2");
    let spec = serde_json::json!({"model": other, "num_speculative_tokens": 3});
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "--model"])
        .arg(common::tiny_model())
        .args(["--port", "0", "--speculative-config", &spec.to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr
            .contains("the draft model's vocabulary (503 tokens) differs from the target's (512)"),
        "{stderr}"
    );
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
