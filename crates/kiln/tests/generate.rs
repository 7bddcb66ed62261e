//! `kiln generate` end to end on the tiny fixture models: it runs each reference prompt as the
//! one request of the engine and reports the right counts; where transformers' greedy text is
//! whole characters (random weights mostly emit stray bytes, which streaming holds back), the
//! printed text equals it; flags outside their domain are refused with a message naming them.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::process::{Command, Output};

use serde_json::Value;

fn generate(model: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["generate", "--model"])
        .arg(common::repo().join("tests/fixtures/models").join(model))
        .args(["--threads", "1"])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn greedy_generation_of_every_reference_prompt() {
    let mut num_exact = 0;
    for model in ["llama3", "llama2", "mistral", "qwen2", "qwen3", "gemma3"] {
        let path = common::repo().join("tests/fixtures/models").join(model).join("reference.json");
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        for case in reference["cases"].as_array().unwrap() {
            let prompt = case["prompt"].as_str().unwrap();
            let args = ["--prompt", prompt, "--temperature", "0", "--max-tokens", "16"];
            let out = generate(model, &[&args[..], &["--ignore-eos"]].concat());
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{model}: {stderr}");
            let num_prompt = case["prompt_ids"].as_array().unwrap().len();
            assert!(stderr.contains(&format!("prompt: {num_prompt} tokens")), "{stderr}");
            assert!(stderr.contains("output: 16 tokens"), "{stderr}");
            let expected = case["greedy_text_skip_special"].as_str().unwrap();
            if !expected.contains('\u{fffd}') {
                assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{expected}\n"));
                num_exact += 1;
            }
        }
    }
    assert!(num_exact > 0, "no reference text to compare exactly");
}

#[test]
fn flags_outside_their_domain_are_refused() {
    let out = generate("llama3", &["--prompt", "Hi", "--block-size", "12"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--block-size must be a power of two up to 256, got 12"), "{stderr}");
    let out = generate("llama3", &["--prompt", "Hi", "--temperature=-1"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("invalid sampling parameter `temperature`"), "{stderr}");
}

/// `--isa` end to end: every path this CPU runs gives the same greedy text on a model quantized
/// as it loads (Q4_K and Q5_0 weights, the quantized kernels' two families), and a path the CPU
/// lacks is refused before anything loads.
#[test]
fn every_supported_isa_generates_the_same_text_and_missing_ones_are_refused() {
    let supported = kiln_kernels::CpuIsa::supported_paths();
    for quantization in ["q4_k", "q5_0"] {
        let run = |isa: kiln_kernels::CpuIsa| {
            let args = ["--prompt", "The capital of France is", "--temperature", "0"];
            let rest = ["--max-tokens", "24", "--ignore-eos", "--quantization", quantization];
            let out = generate("gemma3", &[&args[..], &rest, &["--isa", isa.name()]].concat());
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{isa}: {stderr}");
            assert!(stderr.contains("output: 24 tokens"), "{stderr}");
            out.stdout
        };
        let want = run(kiln_kernels::CpuIsa::Scalar);
        assert!(!want.is_empty(), "{quantization}: no text to compare");
        for &isa in &supported[1..] {
            assert_eq!(run(isa), want, "{quantization}: {isa} differs from scalar");
        }
    }
    if let Some(missing) = kiln_kernels::CpuIsa::ALL.iter().find(|i| !supported.contains(i)) {
        let out = generate("gemma3", &["--prompt", "Hi", "--isa", missing.name()]);
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(&format!("cannot run the {missing} path")), "{stderr}");
    }
}
