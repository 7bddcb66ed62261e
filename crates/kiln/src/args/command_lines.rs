//! Real-world `vllm serve` and `llama-server` command lines (from the projects' documentation,
//! README files and issue reports) with the binary renamed to `kiln serve`: each is accepted
//! with the same meaning, or refused with the message docs/FROM_VLLM.md and
//! docs/FROM_LLAMA_SERVER.md give.

#![allow(clippy::unwrap_used)]

use super::ServeArgs;
use crate::kv_args::HumanCount;

/// What a command line must give.
enum Expect {
    /// Parsed, with this many warnings, and the check holds.
    Ok(usize, fn(&ServeArgs)),
    /// Refused with a message containing this.
    Refused(&'static str),
}

fn parse(line: &str, env: &[(&str, &str)]) -> Result<(ServeArgs, Vec<String>), String> {
    let argv: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
    let env: Vec<(String, String)> =
        env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    match crate::parse(&argv, &env) {
        Ok((crate::Cli { command: crate::Command::Serve(args), .. }, warnings)) => {
            Ok((*args, warnings))
        }
        Ok(_) => Err("not kiln serve".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn model(a: &ServeArgs) -> &str {
    a.model.spec().unwrap()
}

fn len(a: &ServeArgs) -> Option<u64> {
    a.kv.max_model_len.map(|HumanCount(n)| n)
}

#[rustfmt::skip]
const LINES: &[(&str, Expect)] = &[
    // vLLM quickstart and OpenAI-compatible server docs
    ("kiln serve Qwen/Qwen3-0.6B", Expect::Ok(0, |a| assert_eq!(model(a), "Qwen/Qwen3-0.6B"))),
    ("kiln serve Qwen/Qwen2.5-1.5B-Instruct", Expect::Ok(0, |a| assert!(a.served_model_name.is_empty()))),
    ("kiln serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123",
        Expect::Ok(0, |a| assert_eq!(a.api_key, ["token-abc123"]))),
    ("kiln serve Qwen/Qwen2.5-1.5B-Instruct --max-model-len 32k",
        Expect::Ok(0, |a| assert_eq!(len(a), Some(32_000)))),
    ("kiln serve Qwen/Qwen2.5-1.5B-Instruct --max-model-len 32K",
        Expect::Ok(0, |a| assert_eq!(len(a), Some(32_768)))),
    ("kiln serve facebook/opt-125m --chat-template ./examples/template_chatml.jinja",
        Expect::Ok(0, |a| assert!(a.chat_template.as_deref().unwrap().ends_with("chatml.jinja")))),
    ("kiln serve meta-llama/Llama-3.2-1B-Instruct --enforce-eager --max-num-seqs 16 --max-model-len 4096",
        Expect::Ok(0, |a| assert!(a.device.enforce_eager && (a.engine.max_num_seqs, len(a)) == (Some(16), Some(4096))))),
    ("kiln serve Qwen/Qwen3-0.6B --async-scheduling --max-num-seqs 64",
        Expect::Ok(0, |a| assert!(a.engine.async_scheduling && a.engine.max_num_seqs == Some(64)))),
    ("kiln serve unsloth/gpt-oss-20b --host 0.0.0.0 --port 8000 --tensor-parallel-size 1 --gpu-memory-utilization 0.9 --max-model-len 8192",
        Expect::Ok(1, |a| {
            assert_eq!((a.host.as_str(), a.port), ("0.0.0.0", 8000));
            assert_eq!(a.device.gpu_memory_utilization, Some(0.9));
        })),
    ("kiln serve Qwen/Qwen2.5-7B-Instruct --device cuda:1 --gpu-memory-utilization 0.8",
        Expect::Ok(0, |a| assert_eq!(a.device.device, crate::device::Device::Cuda(1)))),
    ("kiln serve Qwen/Qwen2.5-7B-Instruct --enable-prefix-caching --enable-chunked-prefill --max-num-batched-tokens 2048",
        Expect::Ok(1, |a| assert!(!a.kv.no_enable_prefix_caching && a.engine.max_num_batched_tokens == Some(2048)))),
    ("kiln serve Qwen/Qwen2.5-7B-Instruct --no-enable-prefix-caching",
        Expect::Ok(0, |a| assert!(a.kv.no_enable_prefix_caching))),
    ("kiln serve deepseek-ai/DeepSeek-R1-Distill-Qwen-7B --trust-remote-code --uvicorn-log-level warning --disable-log-stats",
        Expect::Ok(2, |a| assert!(a.vllm.disable_log_stats))),
    ("kiln serve Qwen/Qwen3-0.6B --metrics-prefix vllm --log-stats-interval 5",
        Expect::Ok(0, |a| assert_eq!((a.vllm.metrics_prefix.as_str(), a.vllm.log_stats_interval), ("vllm", 5.0)))),
    ("kiln serve Qwen/Qwen3-8B --max_model_len 2048 --max_num_seqs 8 --served_model_name qwen",
        Expect::Ok(0, |a| assert_eq!((len(a), a.served_model_name.as_slice()), (Some(2048), &["qwen".to_owned()][..])))),
    ("kiln serve Qwen/Qwen3-8B --served-model-name gpt-4o gpt-4 --api-key k1 k2",
        Expect::Ok(0, |a| assert_eq!((a.served_model_name.len(), a.api_key.len()), (2, 2)))),
    ("kiln serve --model Qwen/Qwen3-0.6B --generation-config vllm --enable-log-requests",
        Expect::Ok(0, |a| assert!(a.vllm.enable_log_requests && a.vllm.generation_config == "vllm"))),
    ("kiln serve meta-llama/Llama-3.1-8B --kv-cache-memory-bytes 4G --block-size 32",
        Expect::Ok(0, |a| assert_eq!(a.kv.kv_cache_memory_bytes, Some(HumanCount(4 << 30))))),
    ("kiln serve meta-llama/Llama-3.1-8B --num-gpu-blocks-override 2048 --swap-space 16 --disable-log-requests",
        Expect::Ok(0, |a| assert_eq!((a.kv.num_kv_blocks, a.kv.swap_space), (Some(2048), Some(16 << 30))))),
    ("kiln serve Qwen/Qwen3-0.6B --seed 42 --max-logprobs 5 --scheduling-policy priority --kv-cache-dtype auto",
        Expect::Ok(1, |a| assert_eq!(a.seed, 42))),
    ("kiln serve mistralai/Mistral-7B-Instruct-v0.3 --tokenizer-mode mistral --load-format mistral",
        Expect::Ok(2, |a| assert_eq!(model(a), "mistralai/Mistral-7B-Instruct-v0.3"))),
    ("kiln serve Qwen/Qwen3-0.6B --tokenizer Qwen/Qwen3-0.6B --revision main --download-dir /models/hf",
        Expect::Ok(0, |a| assert_eq!(a.vllm.tokenizer.as_deref(), Some("Qwen/Qwen3-0.6B")))),
    ("kiln serve meta-llama/Llama-3.1-70B-Instruct --tensor-parallel-size 4",
        Expect::Refused("runs one model on one device")),
    ("kiln serve meta-llama/Llama-3.1-8B-Instruct --enable-auto-tool-choice --tool-call-parser llama3_json",
        Expect::Ok(0, |a| assert!(a.enable_auto_tool_choice && a.tool_call_parser == Some(kiln_server::tools::ToolCallParser::Llama3Json)))),
    ("kiln serve Qwen/Qwen3-8B --tool-call-parser qwen3_xml",
        Expect::Refused("unknown tool-call parser")),
    ("kiln serve Qwen/QwQ-32B --reasoning-parser deepseek_r1",
        Expect::Ok(0, |a| assert_eq!(a.reasoning_parser, Some(kiln_server::reasoning::ReasoningParser::DeepSeekR1)))),
    ("kiln serve meta-llama/Llama-2-7b-hf --enable-lora --lora-modules sql-lora=/adapters/sql",
        Expect::Ok(0, |a| assert_eq!(a.lora.lora_modules, ["sql-lora=/adapters/sql"]))),
    ("kiln serve -m model.gguf --lora adapter.gguf --lora-scaled b.gguf:0.5,c.gguf:2",
        Expect::Ok(0, |a| assert!(a.lora.lora == ["adapter.gguf"] && a.lora.lora_scaled == ["b.gguf:0.5,c.gguf:2"]))),
    ("kiln serve meta-llama/Llama-2-7b-hf --enable-lora --max-cpu-loras 2 --lora-modules a=/x",
        Expect::Ok(0, |a| assert_eq!(a.lora.max_cpu_loras, Some(2)))),
    ("kiln serve meta-llama/Llama-2-7b-hf --enable-lora --max-loras 4 --max-lora-rank 64 --lora-modules a=/x b=/y",
        Expect::Ok(0, |a| assert!(a.lora.enable_lora && a.lora.max_lora_rank == 64 && a.lora.lora_modules.len() == 2 && a.lora.max_loras == Some(4)))),
    ("kiln serve TheBloke/Llama-2-7b-Chat-AWQ --quantization awq",
        Expect::Ok(0, |a| assert_eq!(a.model.quantization, Some(crate::model_arg::Quantization::Awq)))),
    ("kiln serve Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4 --quantization gptq_marlin",
        Expect::Ok(0, |a| assert_eq!(a.model.quantization, Some(crate::model_arg::Quantization::Gptq)))),
    ("kiln serve meta-llama/Llama-3.1-8B-Instruct --quantization fp8",
        Expect::Refused("kiln reads AWQ, GPTQ and integer compressed-tensors")),
    ("kiln serve RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16 --quantization compressed-tensors",
        Expect::Ok(0, |a| assert_eq!(a.model.quantization, Some(crate::model_arg::Quantization::CompressedTensors)))),
    ("kiln serve meta-llama/Llama-3.1-8B-Instruct --kv-cache-dtype fp8",
        Expect::Ok(0, |a| assert_eq!(a.engine.kv_cache_dtype.name(), "fp8_e4m3"))),
    ("kiln serve meta-llama/Llama-3.1-8B-Instruct --kv-cache-dtype fp8_e5m2",
        Expect::Ok(0, |a| assert_eq!(a.engine.kv_cache_dtype.name(), "fp8_e5m2"))),
    ("kiln serve meta-llama/Llama-3.1-8B-Instruct --kv-cache-dtype fp8_inc",
        Expect::Refused("use f16 (the default), f32, int8, fp8")),
    // llama-server README and server docs
    ("kiln serve -m models/gemma-3-1b-it-Q4_K_M.gguf --port 8080",
        Expect::Ok(0, |a| assert_eq!((model(a), a.port), ("models/gemma-3-1b-it-Q4_K_M.gguf", 8080)))),
    ("kiln serve -hf ggml-org/gemma-3-1b-it-GGUF",
        Expect::Ok(0, |a| assert_eq!(model(a), "ggml-org/gemma-3-1b-it-GGUF"))),
    ("kiln serve -hf ggml-org/gemma-3-1b-it-GGUF:Q4_K_M -ngl 99 -fa on --jinja -np 4 -t 8",
        Expect::Ok(3, |a| assert_eq!((a.engine.max_num_seqs, a.engine.threads), (Some(4), 8)))),
    ("kiln serve -m model.gguf --host 0.0.0.0 --port 8080 -np 4 -cb --metrics --api-key secret -a my-model",
        Expect::Ok(2, |a| assert_eq!(a.served_model_name, ["my-model"]))),
    ("kiln serve -m model.gguf --chat-template-file tmpl.jinja -b 2048 -ub 512 --no-webui",
        Expect::Ok(2, |a| assert_eq!((a.chat_template.as_deref(), a.engine.max_num_batched_tokens), (Some("tmpl.jinja"), Some(2048))))),
    ("kiln serve -m model.gguf -ctk f16 -ctv f16 -s 1",
        Expect::Ok(0, |a| assert_eq!((a.engine.kv_cache_dtype.name(), a.seed), ("f16", 1)))),
    ("kiln serve -m model.gguf -ctk q8_0 -ctv q8_0",
        Expect::Ok(1, |a| assert_eq!(a.engine.kv_cache_dtype.name(), "int8"))),
    ("kiln serve -m model.gguf -c 4096", Expect::Refused("--max-model-len N for the longest request")),
    ("kiln serve -m model.gguf --embedding --pooling mean",
        Expect::Ok(0, |a| assert!(a.pooling.embedding && a.pooling.pooling.as_deref() == Some("mean")))),
    ("kiln serve -m model.gguf --reranking", Expect::Refused("reranking is not supported yet")),
    ("kiln serve Qwen/Qwen3-Embedding-0.6B --task embed",
        Expect::Ok(0, |a| assert_eq!(a.pooling.runner, crate::pooling_args::Runner::Pooling))),
    ("kiln serve intfloat/e5-mistral-7b-instruct --runner pooling --convert embed",
        Expect::Ok(0, |a| assert_eq!(a.pooling.runner, crate::pooling_args::Runner::Pooling))),
    ("kiln serve tomaarsen/Qwen3-Reranker-0.6B-seq-cls --task score",
        Expect::Ok(0, |a| assert_eq!(a.pooling.runner, crate::pooling_args::Runner::Pooling))),
    ("kiln serve some/reward-model --task reward", Expect::Refused("not supported yet")),
    ("kiln serve -hf ggml-org/gemma-3-1b-it-GGUF -hff gemma-3-1b-it-Q8_0.gguf",
        Expect::Refused("kiln serve org/name:Q4_K_M")),
    ("kiln serve -m model.gguf -n 256", Expect::Refused("each request's max_tokens")),
    ("kiln serve -m model.gguf --temp 0.7", Expect::Refused("--generation-config")),
];

#[test]
fn vllm_and_llama_server_command_lines() {
    assert!(LINES.len() >= 30);
    for (line, expect) in LINES {
        let parsed = parse(line, &[]);
        match (expect, parsed) {
            (Expect::Ok(n, check), Ok((args, warnings))) => {
                assert_eq!(warnings.len(), *n, "{line}: {warnings:?}");
                check(&args);
            }
            (Expect::Refused(msg), Err(e)) => assert!(e.contains(msg), "{line}: {e}"),
            (Expect::Ok(..), Err(e)) => panic!("{line}: refused: {e}"),
            (Expect::Refused(_), Ok(_)) => panic!("{line}: accepted"),
        }
    }
}

#[test]
fn unknown_flags_are_clap_errors() {
    let e = parse("kiln serve m/x --max-modle-len 5", &[]).unwrap_err();
    assert!(e.contains("--max-modle-len") && e.contains("--max-model-len"), "{e}");
}

#[test]
fn the_model_is_given_once() {
    let (a, _) = parse("kiln serve a/b --model a/b", &[]).unwrap();
    assert_eq!(model(&a), "a/b");
    let (a, _) = parse("kiln serve a/b --model c/d", &[]).unwrap();
    assert!(a.model.spec().unwrap_err().to_string().contains("given twice"));
    let (a, _) = parse("kiln serve", &[]).unwrap();
    assert_eq!(model(&a), "gemma-3-270m");
}

#[test]
fn environment_variables_set_flags_and_the_command_line_wins() {
    let env = [
        ("KILN_ARG_MAX_MODEL_LEN", "16k"),
        ("KILN_ARG_ENABLE_LOG_REQUESTS", "1"),
        ("KILN_ARG_PORT", "9000"),
        ("KILN_ARG_API_KEY", "a,b"),
        ("KILN_ARG_MODEL", "org/from-env"),
        ("KILN_ARG_NO_SUCH_FLAG", "1"),
        ("OTHER", "x"),
    ];
    let (a, warnings) = parse("kiln serve --port 8001", &env).unwrap();
    assert_eq!((len(&a), a.port, model(&a)), (Some(16_000), 8001, "org/from-env"));
    assert!(a.vllm.enable_log_requests);
    assert_eq!(a.api_key, ["a", "b"]);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("KILN_ARG_NO_SUCH_FLAG"));
    let (a, _) = parse("kiln serve", &[("KILN_ARG_ENABLE_LOG_REQUESTS", "false")]).unwrap();
    assert!(!a.vllm.enable_log_requests);
}

#[test]
fn a_config_file_gives_flags_that_env_and_command_line_override() {
    let dir = std::env::temp_dir().join(format!("kiln-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("config.yaml");
    std::fs::write(
        &file,
        "model: Qwen/Qwen3-0.6B\nport: 6379\nmax_model_len: 32k\nenable-prefix-caching: false\n\
         served-model-name: [qwen, default]\nuvicorn-log-level: info\nseed: 7\n",
    )
    .unwrap();
    let line = format!("kiln serve --config {} --seed 9", file.display());
    let (a, warnings) = parse(&line, &[("KILN_ARG_PORT", "7000")]).unwrap();
    assert_eq!(model(&a), "Qwen/Qwen3-0.6B");
    assert_eq!((a.port, a.seed, len(&a)), (7000, 9, Some(32_000)));
    assert!(a.kv.no_enable_prefix_caching);
    assert_eq!(a.served_model_name, ["qwen", "default"]);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    std::fs::write(&file, "- not\n- a mapping\n").unwrap();
    assert!(parse(&line, &[]).unwrap_err().contains("mapping"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn merged_values_never_swallow_the_positional_model_or_read_as_flags() {
    // The documented form: a list flag from the environment before a positional model.
    let (a, _) = parse("kiln serve /path/model.gguf", &[("KILN_ARG_API_KEY", "secret")]).unwrap();
    assert_eq!((model(&a), a.api_key.as_slice()), ("/path/model.gguf", &["secret".to_owned()][..]));
    let (a, _) =
        parse("kiln serve /path/model.gguf", &[("KILN_ARG_SERVED_MODEL_NAME", "x,y")]).unwrap();
    assert_eq!(model(&a), "/path/model.gguf");
    assert_eq!(a.served_model_name, ["x", "y"]);
    // A value that looks like a flag stays a value.
    let (a, _) = parse("kiln serve m.gguf", &[("KILN_ARG_API_KEY", "--port")]).unwrap();
    assert_eq!((a.api_key.as_slice(), a.port), (&["--port".to_owned()][..], 8000));
    let (a, _) = parse("kiln serve m.gguf", &[("KILN_ARG_CHAT_TEMPLATE", "--x y")]).unwrap();
    assert_eq!(a.chat_template.as_deref(), Some("--x y"));
    // The positional model wins over the environment's and the file's, as any flag would.
    let (a, _) = parse("kiln serve cli/model", &[("KILN_ARG_MODEL", "env/model")]).unwrap();
    let runtime_lora = [("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")];
    let (b, _) = parse("kiln serve m --enable-lora", &runtime_lora).unwrap();
    assert!(b.lora.allow_runtime_lora_updating);
    let (c, _) = parse("kiln serve m --enable-lora", &[]).unwrap();
    assert!(!c.lora.allow_runtime_lora_updating);
    assert_eq!(model(&a), "cli/model");
    let (a, _) = parse("kiln serve -m cli.gguf", &[("KILN_ARG_MODEL", "env/model")]).unwrap();
    assert_eq!(model(&a), "cli.gguf");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.yaml");
    std::fs::write(&file, "api-key: [k1, --k2]\nserved-model-name: [a]\nmodel: file/model\n")
        .unwrap();
    let line = format!("kiln serve /m.gguf --config {}", file.display());
    let (a, _) = parse(&line, &[]).unwrap();
    assert_eq!(model(&a), "/m.gguf");
    assert_eq!(a.api_key, ["k1", "--k2"]);
    assert_eq!(a.served_model_name, ["a"]);
    // Before a `--`, which would make them positionals.
    let (a, _) = parse("kiln serve -- m.gguf", &[("KILN_ARG_PORT", "9")]).unwrap();
    assert_eq!((model(&a), a.port), ("m.gguf", 9));
}

/// A deterministic xorshift stream for the merger's property test.
struct Xorshift(u64);

impl Xorshift {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }

    /// A word made of the pieces that confuse argument parsers.
    fn word(&mut self) -> String {
        const PIECES: [&str; 12] =
            ["--", "-", "=", ",", " ", "port", "api-key", "m.gguf", "x", "--model", "\"", "é"];
        (0..=self.below(4)).map(|_| PIECES[self.below(PIECES.len())]).collect()
    }
}

/// The arguments merger over random values (the fuzz target of the argument sources; it lives
/// in this binary crate, so the property runs here on every `cargo test`): any value from the
/// environment or a config file arrives whole in its own flag, the positional model is the one
/// served, and no input panics.
#[test]
fn random_merged_values_arrive_whole_and_keep_the_positional_model() {
    let mut rng = Xorshift(0x9e37_79b9_7f4a_7c15);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.yaml");
    for case in 0..2000 {
        let template = rng.word();
        let key = rng.word().replace(',', "");
        let names: Vec<String> = (0..=rng.below(3)).map(|_| rng.word().replace(',', "")).collect();
        let env =
            [("KILN_ARG_CHAT_TEMPLATE", template.as_str()), ("KILN_ARG_API_KEY", key.as_str())];
        let (a, _) = parse("kiln serve some/model", &env).unwrap();
        assert_eq!(model(&a), "some/model", "case {case}: {env:?}");
        assert_eq!(a.chat_template.as_deref(), Some(template.as_str()), "case {case}");
        let want: Vec<&str> = [key.trim()].into_iter().filter(|k| !k.is_empty()).collect();
        assert_eq!(a.api_key, want, "case {case}: {key:?}");
        let yaml = serde_json::json!({"served-model-name": names, "model": "file/model"});
        std::fs::write(&file, yaml.to_string()).unwrap();
        let line = format!("kiln serve cli/model --config {}", file.display());
        let (a, _) = parse(&line, &[]).unwrap();
        assert_eq!((model(&a), &a.served_model_name), ("cli/model", &names), "case {case}");
        // Arbitrary words anywhere: an error or a parse, never a panic.
        let words: Vec<String> = (0..rng.below(6)).map(|_| rng.word()).collect();
        let line = format!("kiln serve {}", words.join(" "));
        let _ = parse(&line, &[("KILN_ARG_SERVED_MODEL_NAME", template.as_str())]);
    }
}
