//! Flags of `vllm serve` and `llama-server` that `kiln serve` does not define itself, so that
//! their command lines work after changing the binary name, or fail saying what to write.
//!
//! Each foreign flag is one of:
//! - **renamed** to kiln's flag of the same meaning (`-np 4` → `--max-num-seqs 4`,
//!   `--num-gpu-blocks-override` is an alias clap knows, so not listed here);
//! - **accepted with one warning** when it means nothing on this backend
//!   (`--max-seq-len-to-capture`, `--tensor-parallel-size 1`, `-ngl 99`), with its value if
//!   it takes one;
//! - **refused** with a message naming what to use instead (`--tensor-parallel-size 2`, LoRA,
//!   `-c 4096`).
//!
//! Values of kiln's own flags that only vLLM spells (`--kv-cache-dtype auto`,
//! `--quantization awq`) are checked here too. The table is the documentation's source:
//! docs/FROM_VLLM.md and docs/FROM_LLAMA_SERVER.md list the same entries.

use super::Flags;

/// What a foreign flag does.
#[derive(Clone, Copy, Debug)]
enum Rule {
    /// Becomes this kiln flag (keeping its value).
    Rename(&'static str),
    /// Dropped with a warning: the reason; whether it takes a value.
    Ignore(&'static str, Arity),
    /// Refused: what to use instead.
    Refuse(&'static str, Arity),
}

/// Whether a foreign flag takes a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Arity {
    None,
    One,
    /// A value only if the next argument is one of these (llama-server's `-fa [on|off|auto]`).
    Optional(&'static [&'static str]),
}

use Arity::{None as NoValue, One};

const CPU_ONLY: &str = "kiln runs on one CPU device";
const ALWAYS_ON_BATCHING: &str = "continuous batching is always on";

/// (flag names, rule). Long names without `--`; short (single-dash) ones with their `-`.
const TABLE: &[(&[&str], Rule)] = &[
    // ---- vllm serve: meaningless on this backend ----
    (&["trust-remote-code"], Rule::Ignore("kiln runs no model code from the Hub", NoValue)),
    (&["uvicorn-log-level"], Rule::Ignore("the log level comes from RUST_LOG", One)),
    (&["cpu-offload-gb"], Rule::Ignore("weights already live in CPU memory", One)),
    (&["disable-custom-all-reduce"], Rule::Ignore(CPU_ONLY, NoValue)),
    (&["distributed-executor-backend"], Rule::Ignore(CPU_ONLY, One)),
    (
        &["load-format"],
        Rule::Ignore("the format is read from the files (GGUF or safetensors)", One),
    ),
    (&["tokenizer-mode"], Rule::Ignore("the model's own tokenizer files decide", One)),
    (&["disable-frontend-multiprocessing"], Rule::Ignore("the server is one process", NoValue)),
    (
        &["max-seq-len-to-capture"],
        Rule::Ignore("kiln's CUDA graphs cover decode steps of any context length", One),
    ),
    (&["enable-chunked-prefill"], Rule::Ignore("chunked prefill is always on in kiln", NoValue)),
    (
        &["no-enable-chunked-prefill"],
        Rule::Ignore(
            "chunked prefill is always on in kiln; --long-prefill-token-threshold 0 prefills a \
         prompt in as few steps as --max-num-batched-tokens allows",
            NoValue,
        ),
    ),
    (&["disable-fastapi-docs"], Rule::Ignore("kiln serves no API docs pages", NoValue)),
    (
        &["config-format", "tokenizer-revision", "code-revision"],
        Rule::Ignore("the model's files and --revision decide", One),
    ),
    (&["hf-token"], Rule::Ignore("set HF_TOKEN in the environment instead", One)),
    // ---- vllm serve: refused ----
    (
        &["limit-mm-per-prompt", "mm-processor-kwargs"],
        Rule::Refuse("multimodal inputs are not supported; serve a text-only model", One),
    ),
    // `--task embed`: `--runner`'s parser takes its values (`--convert` is kiln's own).
    (&["task"], Rule::Rename("runner")),
    // ---- llama-server: the same meaning under kiln's name ----
    (&["-m", "hf-repo", "-hf", "-hfr"], Rule::Rename("model")),
    (&["-t"], Rule::Rename("threads")),
    (&["-np", "parallel"], Rule::Rename("max-num-seqs")),
    (&["-b", "batch-size"], Rule::Rename("max-num-batched-tokens")),
    (&["-a", "alias"], Rule::Rename("served-model-name")),
    (&["chat-template-file"], Rule::Rename("chat-template")),
    (&["-s"], Rule::Rename("seed")),
    (&["-ctk", "cache-type-k", "-ctv", "cache-type-v"], Rule::Rename("kv-cache-dtype")),
    // ---- llama-server: meaningless here ----
    (
        &["-ngl", "gpu-layers", "n-gpu-layers"],
        Rule::Ignore("every layer runs on --device (cpu, or cuda with a CUDA build)", One),
    ),
    (
        &["-fa", "flash-attn"],
        Rule::Ignore(
            "the attention kernel is always the fused paged one",
            Arity::Optional(&["on", "off", "auto"]),
        ),
    ),
    (&["jinja"], Rule::Ignore("chat templates are always rendered with Jinja", NoValue)),
    (&["metrics"], Rule::Ignore("/metrics is always served", NoValue)),
    (&["-cb", "cont-batching"], Rule::Ignore(ALWAYS_ON_BATCHING, NoValue)),
    (
        &["-tb", "threads-batch"],
        Rule::Ignore("one thread pool runs prefill and decode (--threads)", One),
    ),
    (&["-ub", "ubatch-size"], Rule::Ignore("there is no separate physical batch size", One)),
    (&["mlock", "no-mmap", "mmap"], Rule::Ignore("weights are memory-mapped read-only", NoValue)),
    (&["no-webui"], Rule::Ignore("kiln serves no web UI", NoValue)),
    (&["cache-reuse"], Rule::Ignore("the prefix cache reuses whole KV blocks by itself", One)),
    (&["slots", "props"], Rule::Ignore("kiln has no /slots or /props endpoints", NoValue)),
    (
        &["log-disable", "verbose", "-v", "log-verbose"],
        Rule::Ignore("the log level comes from RUST_LOG", NoValue),
    ),
    (&["-dev"], Rule::Ignore("kiln's --device cpu|cuda|cuda:N chooses the device", One)),
    (
        &["-kvu", "kv-unified"],
        Rule::Ignore("the paged KV cache is always shared by all requests", NoValue),
    ),
    // ---- llama-server: refused ----
    (
        &["lora-init-without-apply"],
        Rule::Refuse(
            "kiln applies the --lora adapters at the scales given at start and cannot change \
         them later (POST /lora-adapters); leave out the adapter, or serve it by name with \
         --enable-lora --lora-modules NAME=PATH",
            NoValue,
        ),
    ),
    (
        &["-c", "ctx-size"],
        Rule::Refuse(
            "llama-server's -c sizes the whole KV cache shared by its slots; kiln says \
         --max-model-len N for the longest request and --kv-cache-memory-bytes (or \
         --num-gpu-blocks-override) for the cache",
            One,
        ),
    ),
    (
        &["-hff", "hf-file"],
        Rule::Refuse(
            "name the file's quantization in the model id: kiln serve org/name:Q4_K_M",
            One,
        ),
    ),
    (
        &["-n", "n-predict", "predict"],
        Rule::Refuse(
            "the output length is each request's max_tokens (default: the rest of the context)",
            One,
        ),
    ),
    (
        &["temp", "top-k", "top-p", "min-p", "repeat-penalty"],
        Rule::Refuse(
            "sampling defaults come from the model's generation_config.json (--generation-config \
         DIR to use another) or from each request",
            One,
        ),
    ),
    (
        &["api-key-file"],
        Rule::Refuse("give the keys with --api-key KEY [KEY...] or KILN_ARG_API_KEY", One),
    ),
    (
        &["reranking", "rerank"],
        Rule::Refuse("reranking is not supported yet (embeddings are: --embedding)", NoValue),
    ),
    (
        &["rope-scaling", "rope-freq-base", "rope-freq-scale"],
        Rule::Refuse(
            "RoPE settings come from the model's config; edit config.json to change them",
            One,
        ),
    ),
    (
        &["-ot", "override-tensor", "override-kv"],
        Rule::Refuse("tensor and metadata overrides are not supported", One),
    ),
    (
        &["reasoning-format", "reasoning-budget"],
        Rule::Refuse(
            "use --reasoning-parser deepseek_r1 (or qwen3) to split the thinking from the answer",
            One,
        ),
    ),
];

/// The rule for a flag as written (`--name` or `-x`).
fn rule(flag: &str) -> Option<Rule> {
    let key = flag.strip_prefix("--").unwrap_or(flag);
    TABLE.iter().find(|(names, _)| names.contains(&key)).map(|&(_, r)| r)
}

/// Translates the foreign flags of `args` (see the module docs); kiln's own flags and their
/// values pass through unchanged.
pub fn translate(
    args: Vec<String>,
    flags: &Flags,
    warnings: &mut Vec<String>,
) -> Result<Vec<String>, String> {
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter().peekable();
    while let Some(arg) = it.next() {
        if arg == "--" {
            out.push(arg);
            out.extend(it);
            break;
        }
        if !arg.starts_with('-') || arg == "-" {
            out.push(arg);
            continue;
        }
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) => (n.to_owned(), Some(v.to_owned())),
            None => (arg.clone(), None),
        };
        if let Some(long) = name.strip_prefix("--")
            && let Some(info) = flags.get(long)
        {
            if !info.takes_value {
                out.push(arg);
                continue;
            }
            let attached = inline.is_some();
            let value = match inline {
                Some(v) => Some(v),
                None => it.next_if(|v| !v.starts_with("--")),
            };
            match value {
                Some(v) => own_value(long, &v, attached, &mut out, warnings)?,
                None => out.push(arg),
            }
            continue;
        }
        let Some(rule) = rule(&name).or_else(|| special(&name)) else {
            out.push(arg);
            continue;
        };
        let arity = match rule {
            Rule::Rename(_) => One,
            Rule::Ignore(_, a) | Rule::Refuse(_, a) => a,
        };
        let attached = inline.is_some();
        let value = match (inline, arity) {
            (Some(v), _) => Some(v),
            (None, NoValue) => None,
            (None, One) => it.next_if(|v| !v.starts_with("--")),
            (None, Arity::Optional(allowed)) => it.next_if(|v| allowed.contains(&v.as_str())),
        };
        let shown = value.as_ref().map_or_else(|| name.clone(), |v| format!("{name} {v}"));
        match rule {
            Rule::Rename(to) if flags.get(to).is_some() => match value {
                // `-ctk f16 -ctv f16`: one kiln flag given twice with one value.
                Some(v) if repeats(&out, to, &v) => {}
                Some(v) => own_value(to, &v, attached, &mut out, warnings)?,
                None => out.push(format!("--{to}")),
            },
            Rule::Rename(to) => return Err(format!("{shown}: kiln has no --{to} here")),
            Rule::Ignore(why, _) => {
                if let Some(reason) = tensor_parallel(&name, value.as_deref())? {
                    warnings.push(format!("{shown}: ignored ({reason})"));
                } else {
                    warnings.push(format!("{shown}: ignored ({why})"));
                }
            }
            Rule::Refuse(why, _) => return Err(format!("{shown} is not supported: {why}")),
        }
    }
    Ok(out)
}

/// Whether `out` already holds `--flag value` or `--flag=value`.
fn repeats(out: &[String], flag: &str, value: &str) -> bool {
    let (flag, joined) = (format!("--{flag}"), format!("--{flag}={value}"));
    out.contains(&joined) || out.windows(2).any(|w| w[0] == flag && w[1] == value)
}

/// Parallelism flags: accepted at 1 (what kiln does), refused above.
fn special(name: &str) -> Option<Rule> {
    let key = name.trim_start_matches('-');
    matches!(
        key,
        "tensor-parallel-size"
            | "tp"
            | "pipeline-parallel-size"
            | "pp"
            | "data-parallel-size"
            | "dp"
    )
    .then_some(Rule::Ignore(CPU_ONLY, One))
}

/// For the parallelism flags: `Ok(Some(reason))` at size 1, an error above; `Ok(None)` for
/// other flags.
fn tensor_parallel(name: &str, value: Option<&str>) -> Result<Option<&'static str>, String> {
    if special(name).is_none() {
        return Ok(None);
    }
    match value.map(str::trim) {
        Some("1") => Ok(Some("one device: kiln already runs the whole model on it")),
        other => Err(format!(
            "{name} {} is not supported: kiln runs one model on one device (the CPU backend \
             uses every core through --threads); leave the flag out",
            other.unwrap_or("")
        )),
    }
}

/// A value of one of kiln's own flags, checked for vLLM's spellings, pushed as `--flag value`,
/// or as `--flag=value` when it was `attached` so (values from `KILN_ARG_*` and `--config`
/// always are: a value written so is never read as a flag or followed by more values).
fn own_value(
    flag: &str,
    value: &str,
    attached: bool,
    out: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Result<(), String> {
    match (flag, value) {
        ("kv-cache-dtype", "auto") => {
            warnings.push(
                "--kv-cache-dtype auto: using kiln's default KV cache dtype (f16)".to_owned(),
            );
            return Ok(());
        }
        ("kv-cache-dtype", "q8_0") => {
            // `-ctk q8_0 -ctv q8_0`: one kiln flag.
            if !repeats(out, flag, "int8") {
                warnings.push(
                    "--kv-cache-dtype q8_0: using int8 (kiln's 8-bit KV cache has one scale per \
                     token and KV head where llama.cpp's q8_0 has one per 32 elements)"
                        .to_owned(),
                );
                value_push(out, flag, "int8", attached);
            }
        }
        (
            "kv-cache-dtype",
            "fp8_inc" | "fp8_ds_mla" | "bfloat16" | "q4_0" | "q4_1" | "q5_0" | "q5_1" | "iq4_nl",
        ) => {
            return Err(format!(
                "--kv-cache-dtype {value} is not supported: use f16 (the default), f32, int8, \
                 fp8 (= fp8_e4m3) or fp8_e5m2"
            ));
        }
        ("kv-cache-dtype", "float16" | "half") => value_push(out, flag, "f16", attached),
        ("kv-cache-dtype", "float32" | "float") => value_push(out, flag, "f32", attached),
        // vLLM's Marlin variants name a GPU kernel for the same checkpoints.
        ("quantization", "awq_marlin") => value_push(out, flag, "awq", attached),
        ("quantization", "gptq_marlin") => value_push(out, flag, "gptq", attached),
        (
            "quantization",
            "fp8" | "bitsandbytes" | "marlin" | "modelopt" | "mxfp4" | "gguf" | "experts_int8"
            | "fbgemm_fp8" | "petit_nvfp4",
        ) => {
            return Err(format!(
                "--quantization {value} is not supported: kiln reads AWQ, GPTQ and integer \
                 compressed-tensors checkpoints (--quantization awq / gptq / \
                 compressed-tensors), GGUF files (e.g. org/name:Q4_K_M), and quantizes float \
                 checkpoints on load with --quantization q8_0, q4_k or q5_0"
            ));
        }
        _ => value_push(out, flag, value, attached),
    }
    Ok(())
}

fn value_push(out: &mut Vec<String>, flag: &str, value: &str, attached: bool) {
    if attached {
        out.push(format!("--{flag}={value}"));
    } else {
        out.push(format!("--{flag}"));
        out.push(value.to_owned());
    }
}
