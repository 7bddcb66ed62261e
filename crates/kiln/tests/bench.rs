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
