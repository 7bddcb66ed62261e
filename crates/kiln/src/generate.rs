//! `kiln generate`: load a model, run one prompt as the one request of an [`EngineCore`],
//! stream the text, report speed on stderr.
//!
//! The engine gets exactly the KV cache the request needs (prompt + `--max-tokens`, capped at
//! the model's maximum positions, where generation stops with `length`), no prefix cache, and
//! an f32 KV cache, so the output is the reference the model's tests compare against.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use kiln_core::{SamplingParams, TokenId};
use kiln_engine::{EngineConfig, EngineCore, KvCacheDtype, SchedulerConfig};
use kiln_tokenizer::Tokenizer;

use crate::model_arg::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Maximum number of new tokens.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 means greedy. Default: the model's generation_config, else 1.0.
    #[arg(long)]
    temperature: Option<f32>,
    /// Nucleus sampling mass (1 disables). Default: the model's generation_config, else 1.0.
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep only the K most likely tokens (0 disables). Default: generation_config, else 0.
    #[arg(long)]
    top_k: Option<usize>,
    /// Drop tokens below this fraction of the top token's probability (0 disables).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalty for tokens already in the prompt or output (1 disables).
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Do not add BOS / special tokens to the prompt.
    #[arg(long)]
    no_special_tokens: bool,
    /// Kernel threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Tokens per KV cache block (a power of two up to 256).
    #[arg(long, default_value_t = EngineConfig::default().block_size)]
    block_size: usize,
    /// Speculative decoding, vLLM's JSON (as `kiln serve`); the output is the same tokens.
    #[arg(long, value_parser = crate::engine_args::parse_speculative_config)]
    speculative_config: Option<kiln_engine::SpeculativeConfig>,
    /// Tokens per forward step (the prefill chunk size).
    #[arg(long, default_value_t = 512)]
    max_num_batched_tokens: usize,
}

/// Timings of the run, as the stats line reports them.
struct RunStats {
    num_prompt_tokens: usize,
    num_output_tokens: usize,
    /// Until the first token (prefill and its sampling).
    prefill_time: Duration,
    /// From the first token to the last.
    decode_time: Duration,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    kiln_models::check_block_size(args.block_size).map_err(|e| anyhow!("--block-size {e}"))?;
    let load_start = Instant::now();
    let (loaded, draft) =
        args.model.load_with_draft(args.threads, args.speculative_config.as_ref())?;
    let num_threads = loaded.model.backend().pool().num_threads();
    let load_time = load_start.elapsed();
    let tokenizer = &loaded.tokenizer;
    let defaults = &loaded.generation_defaults;
    let prompt = tokenizer
        .encode(&args.prompt, !args.no_special_tokens)
        .map_err(|e| anyhow!("tokenizing the prompt: {e}"))?;
    let mut params = SamplingParams {
        temperature: args.temperature.or(defaults.temperature).unwrap_or(1.0),
        top_p: args.top_p.or(defaults.top_p).unwrap_or(1.0),
        top_k: args.top_k.or(defaults.top_k).unwrap_or(0),
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty.or(defaults.repetition_penalty).unwrap_or(1.0),
        max_tokens: args.max_tokens,
        ignore_eos: args.ignore_eos,
        seed: Some(args.seed),
        ..SamplingParams::default()
    };
    // Generation stops at the model's maximum positions; a prompt that reaches it is refused
    // by the engine (the request then asks for more than `max_model_len`).
    let model_max = loaded.model.config().max_position_embeddings;
    let max_model_len = (prompt.len() + args.max_tokens).min(model_max);
    if prompt.len() < max_model_len {
        params.max_tokens = max_model_len - prompt.len();
    }
    let config = EngineConfig {
        host_pool: crate::model_arg::cpu_host_pool(&*loaded.model),
        block_size: args.block_size,
        num_kv_blocks: max_model_len.div_ceil(args.block_size).max(1),
        max_model_len: Some(max_model_len),
        scheduler: SchedulerConfig {
            max_num_batched_tokens: args.max_num_batched_tokens,
            max_num_seqs: 1,
            enable_prefix_caching: false,
            ..SchedulerConfig::default()
        },
        seed: args.seed,
        eos_token_ids: tokenizer.eos_token_ids().iter().map(|&t| TokenId(t)).collect(),
        kv_cache_dtype: KvCacheDtype::F32,
        speculative: args.speculative_config.clone(),
        ..EngineConfig::default()
    };
    let mut core = EngineCore::with_draft_model(loaded.model, draft, config)?;
    let stats = stream(&mut core, tokenizer, prompt, params)?;
    let rate = |n: usize, d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
    eprintln!(
        "load: {:.2} s | prompt: {} tokens, {:.1} tok/s | output: {} tokens, {:.1} tok/s \
         (decode, {} threads)",
        load_time.as_secs_f64(),
        stats.num_prompt_tokens,
        rate(stats.num_prompt_tokens, stats.prefill_time),
        stats.num_output_tokens,
        rate(stats.num_output_tokens.saturating_sub(1), stats.decode_time),
        num_threads,
    );
    if args.speculative_config.is_some() {
        let spec = core.stats().spec_decode;
        eprintln!(
            "speculative decoding: {} drafts, {} draft tokens, {:.1} % accepted, mean acceptance \
             length {:.2}",
            spec.num_drafts,
            spec.num_draft_tokens,
            100.0 * spec.acceptance_rate(),
            spec.mean_acceptance_length()
        );
    }
    Ok(())
}

/// Runs the one request to its end, writing its text to stdout as tokens arrive, then a newline.
fn stream(
    core: &mut EngineCore,
    tokenizer: &Tokenizer,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> anyhow::Result<RunStats> {
    let num_prompt_tokens = prompt.len();
    core.add_request(prompt.into_iter().map(TokenId).collect(), params, 0)?;
    let mut decoder = tokenizer.decode_stream(true);
    let mut stdout = std::io::stdout().lock();
    let mut write_error = None;
    let start = Instant::now();
    let mut first_token_at = None;
    let mut num_output_tokens = 0;
    while core.has_unfinished() {
        for out in core.step()? {
            num_output_tokens += 1;
            if let Ok(Some(text)) = decoder.step(out.new_token.0)
                && let Err(e) = stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush())
            {
                write_error.get_or_insert(e);
            }
        }
        if num_output_tokens > 0 {
            first_token_at.get_or_insert_with(Instant::now);
        }
    }
    writeln!(stdout)?;
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    let first_token_at = first_token_at.unwrap_or_else(Instant::now);
    Ok(RunStats {
        num_prompt_tokens,
        num_output_tokens,
        prefill_time: first_token_at - start,
        decode_time: first_token_at.elapsed(),
    })
}
