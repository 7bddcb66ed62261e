//! `kiln bench serve`, `kiln bench latency`, `kiln tune` and `kiln plan` end to end against the
//! tiny llama3 fixture: the saved JSON has every field with counts and values that add up, the
//! tune sweep writes its CSV, plots and command within a one-minute budget, and plan's numbers
//! are the hand-computed ones.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{start_server, tiny_model};
use serde_json::Value;

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().unwrap()
}

fn ok(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kiln failed: {stderr}");
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("bench-tools-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn bench_serve(url: &str, extra: &[&str]) -> Output {
    let model = tiny_model();
    let mut args =
        vec!["bench", "serve", "--base-url", url, "--model", "tiny", "--api-key", "test-key"];
    args.extend(["--tokenizer", model.to_str().unwrap(), "--input-len", "24", "--seed", "5"]);
    args.extend(extra);
    kiln(&args)
}

const FIELDS: [&str; 35] = [
    "date",
    "backend",
    "endpoint_type",
    "tokenizer_id",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "base_url",
    "endpoint",
    "model_id",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "num_prompts",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "std_ttft_ms",
    "p90_ttft_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "p50_e2el_ms",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "errors",
];

#[test]
fn bench_serve_saves_a_complete_and_consistent_result() {
    let (_server, url) = start_server();
    let dir = scratch("serve");
    let path = dir.join("result.json");
    let out = bench_serve(
        &url,
        &[
            "--num-prompts",
            "12",
            "--output-len",
            "10",
            "--max-concurrency",
            "4",
            "--ignore-eos",
            "--percentiles",
            "50,90,99",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--save-detailed",
            "--goodput",
            "ttft:600000",
            "e2el:600000",
            "--save-result",
            path.to_str().unwrap(),
        ],
    );
    let stdout = ok(&out);
    assert!(
        stdout.contains("Serving Benchmark Result") && stdout.contains("P90 TTFT (ms):"),
        "{stdout}"
    );
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for f in FIELDS {
        assert!(r.get(f).is_some(), "missing {f}");
    }
    assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(12), Some(0)));
    assert_eq!(r["max_concurrency"], 4);
    let outputs: Vec<u64> =
        r["output_lens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(outputs, vec![10; 12], "ignore_eos gives every request its full length");
    assert_eq!(r["total_output_tokens"], 120);
    // The server's count: about 24 random-text tokens (re-tokenizing decoded random ids can
    // merge or split a few) plus its BOS.
    let inputs: Vec<u64> =
        r["input_lens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert!(inputs.iter().all(|&n| (22..=29).contains(&n)), "{inputs:?}");
    assert_eq!(r["total_input_tokens"].as_u64().unwrap(), inputs.iter().sum::<u64>());
    let duration = r["duration"].as_f64().unwrap();
    assert!(duration > 0.0);
    let rps = r["request_throughput"].as_f64().unwrap();
    assert!((rps - 12.0 / duration).abs() < 1e-6 * rps);
    assert!(
        (r["output_throughput"].as_f64().unwrap() - 120.0 / duration).abs() < 1e-6 * rps * 10.0
    );
    assert_eq!(
        r["request_goodput"], r["request_throughput"],
        "every request meets a 10-minute SLO"
    );
    let ttfts = r["ttfts"].as_array().unwrap();
    let e2els = r["latencies"].as_array().unwrap();
    for (t, e) in ttfts.iter().zip(e2els) {
        let (t, e) = (t.as_f64().unwrap(), e.as_f64().unwrap());
        assert!(t > 0.0 && t <= e && e < duration + 1e-3, "ttft {t} e2e {e}");
    }
    assert!(r["itls"].as_array().unwrap().iter().all(|l| l.as_array().unwrap().len() <= 9));
    let p = |k: &str| r[k].as_f64().unwrap();
    assert!(p("median_ttft_ms") <= p("p90_ttft_ms") && p("p90_ttft_ms") <= p("p99_ttft_ms"));
    assert!(p("mean_tpot_ms") >= 0.0 && p("p99_e2el_ms") <= duration * 1e3 + 1.0);
    assert!(r["errors"].as_array().unwrap().iter().all(|e| e == ""));

    // Poisson arrivals against the chat endpoint.
    let out = bench_serve(
        &url,
        &[
            "--num-prompts",
            "6",
            "--output-len",
            "4",
            "--request-rate",
            "40",
            "--burstiness",
            "0.5",
            "--endpoint",
            "/v1/chat/completions",
            "--ignore-eos",
        ],
    );
    let stdout = ok(&out);
    assert!(stdout.contains("Successful requests:                    6"), "{stdout}");
    assert!(stdout.contains("Request rate (req/s):                   40"), "{stdout}");

    // Requests the server refuses are counted with their error, not dropped.
    let out =
        bench_serve(&url, &["--num-prompts", "3", "--output-len", "400", "--num-warmups", "0"]);
    let stdout = ok(&out);
    assert!(stdout.contains("Failed requests:                        3"), "{stdout}");
    assert!(stdout.contains("): HTTP 400 Bad Request: This model's maximum context"), "{stdout}");
    // ... and a failing warm-up stops the run before it measures anything.
    let out = bench_serve(&url, &["--num-prompts", "3", "--output-len", "400"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("warm-up request 1 of 1 failed"));
}

/// A `vllm bench serve` command line (vLLM's spellings, defaults and result file naming) run
/// as `kiln bench serve` against the fixture server.
#[test]
fn a_vllm_bench_serve_command_line_runs() {
    let (_server, url) = start_server();
    let port = url.rsplit(':').next().unwrap().to_owned();
    let dir = scratch("vllm-spelled");
    let model = tiny_model();
    let line = format!(
        "bench serve --backend vllm --host 127.0.0.1 --port {port} --model tiny --tokenizer {} \
         --dataset-name random --random-input-len 24 --random-output-len 6 --num-prompts 5 \
         --max-concurrency 2 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
         --temperature 0 --disable-tqdm --save-result --result-dir {}",
        model.display(),
        dir.display()
    );
    let mut args: Vec<&str> = line.split_whitespace().collect();
    args.extend(["--extra-body", r#"{"top_k": 1}"#, "--api-key", "test-key"]);
    let stdout = ok(&kiln(&args));
    assert!(stdout.contains("P99 E2EL (ms):") && stdout.contains("Peak concurrent requests:"));
    let files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("openai-infqps-concurrency2-tiny-")
            && files[0].extension().is_some_and(|e| e == "json"),
        "{name}"
    );
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
    assert_eq!((r["request_rate"].as_str(), r["backend"].as_str()), (Some("inf"), Some("openai")));
    assert_eq!(r["completed"], 5);
    // The random dataset ignores EOS, as in vLLM: every request has its full length.
    assert_eq!(r["total_output_tokens"], 30);
    let date = r["date"].as_str().unwrap();
    assert!(date.len() == 15 && date.as_bytes()[8] == b'-', "{date}");
    assert!(r["max_output_tokens_per_s"].as_f64().unwrap() > 0.0);
    // Requests in flight at any time during the peak second (the whole run, here).
    assert!((1..=5).contains(&r["max_concurrent_requests"].as_u64().unwrap()));
    assert!(r.get("p99_e2el_ms").is_some() && r.get("p50_itl_ms").is_some());
    assert!(r.get("p95_ttft_ms").is_none() && r.get("itls").is_none(), "no --save-detailed");
    assert_eq!(r["tokenizer_id"].as_str(), model.to_str());
}

#[test]
fn bench_latency_prints_one_row_per_cell() {
    let model = tiny_model();
    let stdout = ok(&kiln(&[
        "bench",
        "latency",
        "--model",
        model.to_str().unwrap(),
        "--batch-size",
        "1,3",
        "--input-len",
        "8,16",
        "--output-len",
        "4",
        "--threads",
        "1",
    ]));
    let rows: Vec<&str> =
        stdout.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| B")).collect();
    assert_eq!(rows.len(), 4, "{stdout}");
    assert!(rows[3].starts_with("| 3 | 16 | 4 |"), "{stdout}");
}

fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 1000, "{}", path.display());
}

#[test]
fn tune_within_a_one_minute_budget_writes_csv_plots_and_the_best_command() {
    let dir = scratch("tune");
    let model = tiny_model();
    let stdout = ok(&kiln(&[
        "tune",
        "--model",
        model.to_str().unwrap(),
        "--server-args",
        "--threads 1 --num-kv-blocks 256 --max-model-len 256",
        "--max-num-seqs",
        "2,8",
        "--concurrency",
        "1,4",
        "--num-prompts",
        "8",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--budget-minutes",
        "1",
        "--output-dir",
        dir.to_str().unwrap(),
        "--constraint",
        "e2el_p99:600000",
    ]));
    assert!(stdout.contains("4 of 4 runs"), "{stdout}");
    assert!(stdout.contains("kiln serve --model") && stdout.contains("--max-num-seqs"), "{stdout}");
    let csv = std::fs::read_to_string(dir.join("runs.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 5, "{csv}");
    assert!(lines[0].starts_with("run,config,max-num-seqs,load_kind,load,completed,failed"));
    assert!(lines[1..].iter().all(|l| l.contains(",concurrency,") && l.contains(",8,0,")), "{csv}");
    assert_eq!(lines.iter().filter(|l| l.ends_with(",true,true")).count(), 1, "one best run");
    for (name, title) in [
        ("pareto", "the line is the Pareto front"),
        ("ttft", "TTFT percentiles against load"),
        ("tpot", "TPOT percentiles against load"),
    ] {
        assert_png(&dir.join(format!("{name}.png")));
        let svg = std::fs::read_to_string(dir.join(format!("{name}.svg"))).unwrap();
        assert!(svg.contains("<svg") && svg.contains("max-num-seqs=8"), "{name}.svg");
        assert!(svg.contains(title), "{name}.svg: {title}");
    }
    assert!(std::fs::read_to_string(dir.join("best.txt")).unwrap().contains("kiln serve"));

    // An objective no run can meet is reported as such.
    let dir = scratch("tune-infeasible");
    let stdout = ok(&kiln(&[
        "tune",
        "--model",
        model.to_str().unwrap(),
        "--server-args",
        "--threads 1",
        "--concurrency",
        "2",
        "--num-prompts",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--budget-minutes",
        "1",
        "--output-dir",
        dir.to_str().unwrap(),
        "--objective",
        "latency",
        "--min-throughput",
        "1e12",
    ]));
    assert!(stdout.contains("no run met"), "{stdout}");
    assert_png(&dir.join("pareto.png"));
}

#[test]
fn tune_maximises_goodput_at_a_bursty_rate() {
    let model = tiny_model();
    let dir = scratch("tune-goodput");
    let goodput = |extra: &[&str]| {
        let mut args = vec![
            "tune",
            "--model",
            model.to_str().unwrap(),
            "--server-args",
            "--threads 1",
            "--request-rate",
            "50",
            "--burstiness",
            "0.5",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--budget-minutes",
            "1",
            "--output-dir",
            dir.to_str().unwrap(),
            "--objective",
            "goodput",
        ];
        args.extend_from_slice(extra);
        kiln(&args)
    };
    let refused = goodput(&[]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("needs --goodput"));
    let stdout = ok(&goodput(&["--goodput", "e2el:600000"]));
    assert!(stdout.contains("best for most goodput"), "{stdout}");
    let csv = std::fs::read_to_string(dir.join("runs.csv")).unwrap();
    assert!(csv.lines().next().unwrap().contains(",request_goodput,"), "{csv}");
}

#[test]
fn plan_reports_hand_computed_capacity_and_roofline() {
    let model = tiny_model();
    let stdout = ok(&kiln(&[
        "plan",
        "--model",
        model.to_str().unwrap(),
        "--memory",
        "64MiB",
        "--reserve",
        "1MiB",
        "--max-model-len",
        "256",
        "--bandwidth-gbs",
        "10",
        "--peak-gops",
        "100",
        "--context",
        "64",
        "--kv-cache-dtype",
        "f32",
    ]));
    // 2 layers × 2 KV heads × 16 dims: 2 × 2 × 2 × 16 × 4 B = 512 B per token in f32.
    assert!(stdout.contains("KV cache (f32): 512 bytes per token"), "{stdout}");
    let weights: u64 = stdout
        .split("weights: ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap();
    let tokens = ((64u64 << 20) - weights - (1 << 20)) / 512;
    assert!(stdout.contains(&format!("of KV cache: {tokens} tokens")), "{stdout}");
    assert!(
        stdout.contains(&format!("sequences of 256 tokens at once: {}", tokens / 256)),
        "{stdout}"
    );
    assert!(stdout.contains("machine (given, "), "{stdout}");
    // Batch 1 at context 64 is memory-bound: (weights + 2 layers × 64 × 2 × 32 × 4 B) / 10 GB/s.
    let step = (weights + 2 * 64 * 2 * 32 * 4) as f64 / 10e9;
    assert!(stdout.contains(&format!("| 1 | memory | {:.1} |", 1.0 / step)), "{stdout}");
    let f16 = ok(&kiln(&[
        "plan",
        "--model",
        model.to_str().unwrap(),
        "--memory",
        "64MiB",
        "--bandwidth-gbs",
        "10",
        "--peak-gops",
        "100",
    ]));
    assert!(f16.contains("KV cache (f16): 256 bytes per token"), "{f16}");
}

/// A pooling model (the Qwen3 embedding fixture, a `Qwen3Model`) plans its capacity and its
/// prefill rate without an LM head (faster than the same decoder with its head), as inputs per
/// second too; it has no decode table, and `--measure`, which runs generation, is refused.
#[test]
fn plan_of_a_pooling_model_is_its_prefill_rate() {
    let fixtures = common::repo().join("tests/fixtures");
    let plan = |dir: PathBuf, extra: &[&str]| {
        let dir = dir.to_str().unwrap().to_owned();
        let mut args = vec!["plan", "--model", &dir, "--memory", "64MiB"];
        args.extend(["--bandwidth-gbs", "10", "--peak-gops", "100", "--prefill-len", "64"]);
        args.extend(extra);
        kiln(&args)
    };
    let pooled = ok(&plan(fixtures.join("embedding/qwen3-embed"), &[]));
    let line = pooled.lines().find(|l| l.starts_with("pooling model")).expect(&pooled);
    assert!(!pooled.contains("| batch |"), "{pooled}");
    let number = |after: &str| -> f64 {
        let rest = line.split(after).nth(1).unwrap().trim_start();
        rest.split(' ').next().unwrap().trim_end_matches(',').parse().unwrap()
    };
    let (tokens, inputs) = (number("predicted"), number("tok/s,"));
    assert!((tokens / 64.0 - inputs).abs() < 0.1, "{line}");
    let generative = ok(&plan(fixtures.join("models/qwen3"), &[]));
    let prefill: f64 = generative
        .split("prefill of 64 tokens: predicted ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .expect(&generative);
    assert!(tokens > prefill, "{tokens} vs {prefill} with the LM head");
    let refused = plan(fixtures.join("embedding/qwen3-embed"), &["--measure"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("openai-embeddings"));
}
