//! `kiln bench throughput` end to end on a tiny fixture model.

#![allow(clippy::unwrap_used)]

use std::process::Command;

#[test]
fn bench_throughput_reports_rates_hits_and_preemptions() {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/models/llama3");
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["bench", "throughput", "--model", model, "--num-prompts", "8"])
            .args([
                "--input-len",
                "20",
                "--output-len",
                "30",
                "--threads",
                "2",
                "--block-size",
                "8",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
    };
    let (stdout, stderr) = run(&["--prefix-len", "16"]);
    assert!(stderr.contains("KV cache: 50 blocks of 8 tokens"), "{stderr}");
    assert!(stderr.contains("max concurrency at 50 tokens per request: 8.00x"), "{stderr}");
    assert!(stdout.contains("requests/s") && stdout.contains("output tok/s"), "{stdout}");
    assert!(stdout.contains("160 prompt + 240 output tokens"), "{stdout}");
    assert!(stdout.contains("(112 of 160 prompt tokens); preemptions: 0"), "{stdout}");
    let (stdout, _) = run(&["--num-kv-blocks", "12"]);
    assert!(!stdout.contains("preemptions: 0"), "{stdout}");
    // 2 layers x 2 KV heads x 16 dims x (K, V) x 2 bytes (f16, the default) = 256 bytes per
    // token, 2 KiB a block; f32 doubles it.
    let (_, stderr) = run(&["--kv-cache-memory", "64KiB"]);
    assert!(stderr.contains("KV cache: 32 blocks of 8 tokens, 2048 bytes per block"), "{stderr}");
    assert!(stderr.contains("f16 KV cache"), "{stderr}");
    let (_, stderr) = run(&["--kv-cache-memory", "64KiB", "--kv-cache-dtype", "f32"]);
    assert!(stderr.contains("KV cache: 16 blocks of 8 tokens, 4096 bytes per block"), "{stderr}");
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["bench", "throughput", "--model", model, "--input-len", "20", "--output-len", "30"])
        .args(["--block-size", "8", "--num-kv-blocks", "3"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("cannot hold one request"), "{stderr}");
}

/// The default model, greedy, 8 input-grounded prompts: speculative decoding yields exactly the
/// plain outputs (the bench fails otherwise) and accepts drafts, with two n-gram chains and a
/// token tree.
#[test]
fn bench_speculative_keeps_every_output_of_the_default_model() {
    let prompts =
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/bench/prompts/input_grounded.jsonl");
    let text = std::fs::read_to_string(prompts).unwrap();
    let dir = std::env::temp_dir().join(format!("kiln-bench-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let eight = dir.join("prompts.jsonl");
    std::fs::write(&eight, text.lines().take(8).collect::<Vec<_>>().join("\n")).unwrap();
    for config in [
        r#"{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}"#,
        r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1}"#,
        r#"{"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5, "speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"}"#,
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["bench", "speculative", "--prompts", eight.to_str().unwrap()])
            .args(["--output-len", "40", "--threads", "2", "--speculative-config", config])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("outputs identical"), "{stdout}");
        let accepted = stdout
            .split("% of draft tokens accepted")
            .next()
            .and_then(|s| s.rsplit(", ").next())
            .and_then(|s| s.trim().parse::<f64>().ok())
            .unwrap();
        assert!(accepted > 10.0, "{stdout}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
