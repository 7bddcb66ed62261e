//! `kiln serve` with a second KV tier end to end on the tiny fixture: eight concurrent requests
//! over a KV cache too small for them are preempted by swap (to host memory, and to a file) and
//! complete with the same text as on a server with room for all; the tier's metrics count the
//! swaps and the spilled prefix blocks, and without prefix caching show it empty at the end; the tier's file never shows in its directory; a swap
//! mode without a tier stops start-up.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

/// Greedy completions of eight 40-token prompts, sent at once.
fn completions(addr: &str) -> Vec<String> {
    let prompts = (0..8u32)
        .map(|i| (0..40).map(|t| (i * 53 + t * 17 + t * t) % 480 + 10).collect())
        .collect();
    common::concurrent_completions(addr, prompts, 60)
}

/// A server whose cache holds 16 blocks of 16 tokens: two of the eight requests at most.
fn tight_server(tier: &[&str]) -> (common::Server, String) {
    let tiny = common::tiny_model();
    let mut args = vec!["--model", tiny.to_str().unwrap(), "--served-model-name", "tiny"];
    args.extend(["--num-kv-blocks", "16", "--max-model-len", "128", "--threads", "1"]);
    args.extend(["--preemption-mode", "swap"]);
    args.extend(tier);
    common::start_kiln_serve(&args)
}

#[test]
fn preempted_requests_swapped_to_memory_or_a_file_complete_as_without_pressure() {
    let (plenty, url) = common::start_server();
    let expected = completions(url.trim_start_matches("http://"));
    drop(plenty);
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let dir_arg = dir.to_str().unwrap().to_owned();
    // In memory with prefix caching (evicted cached blocks spill to the tier too), and in a
    // file without (the tier then holds only preempted requests: empty at the end).
    for tier in [
        &["--swap-space", "0.01"][..],
        &["--kv-offload-dir", &dir_arg, "--kv-offload-size", "8MiB", "--no-enable-prefix-caching"],
    ] {
        let (_server, url) = tight_server(tier);
        let addr = url.trim_start_matches("http://");
        if tier[0] == "--kv-offload-dir" {
            // The file is unlinked as soon as it is made: nothing outlives the process.
            assert_eq!(std::fs::read_dir(dir).unwrap().count(), 0);
        }
        assert_eq!(completions(addr), expected, "{tier:?}");
        let swaps =
            common::metric_where(addr, "kiln:num_preemptions_by_mode_total", "mode=\"swap\"");
        assert!(swaps > 0.0, "{tier:?}: no preemption by swap");
        assert!(common::metric(addr, "kiln:kv_swapped_in_blocks_total") > 0.0);
        let spilled = common::metric(addr, "kiln:kv_tier_spilled_blocks_total");
        if tier[0] == "--swap-space" {
            assert!(spilled > 0.0, "finished requests' cached blocks were evicted and kept");
        } else {
            assert_eq!(spilled, 0.0);
            assert_eq!(common::metric(addr, "kiln:kv_tier_usage_perc"), 0.0);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn swap_mode_without_a_tier_is_refused_at_start_up() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "--model"])
        .arg(common::tiny_model())
        .args(["--port", "0", "--preemption-mode", "swap"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--preemption-mode swap needs a tier"), "{stderr}");
}
