//! `kiln generate`: load a model, run one prompt, stream the text, report speed on stderr.

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, bail};
use kiln_core::SamplingParams;
use kiln_engine::{Generator, GeneratorConfig, StepEvent};

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
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Tokens per forward step (the prefill chunk size).
    #[arg(long, default_value_t = 512)]
    max_num_batched_tokens: usize,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    if !(1..=256).contains(&args.block_size) {
        bail!("--block-size must be in 1..=256");
    }
    let load_start = Instant::now();
    let loaded = args.model.load(args.threads)?;
    let num_threads = loaded.model.backend().pool().num_threads();
    let load_time = load_start.elapsed();
    let tokenizer = &loaded.tokenizer;
    let defaults = &loaded.generation_defaults;
    let prompt = tokenizer
        .encode(&args.prompt, !args.no_special_tokens)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
    let params = SamplingParams {
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
    let total = prompt.len() + args.max_tokens;
    let config = GeneratorConfig {
        block_size: args.block_size,
        num_blocks: total.div_ceil(args.block_size),
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len: None,
        seed: args.seed,
    };
    let eos = tokenizer.eos_token_ids().to_vec();
    let mut generator = Generator::new(loaded.model, config)?;
    let mut decoder = tokenizer.decode_stream(true);
    let mut stdout = std::io::stdout().lock();
    let mut write_error = None;
    generator.generate(&[(prompt, params)], &eos, |event| {
        if let StepEvent::Token { token, .. } = event
            && let Ok(Some(text)) = decoder.step(token)
            && let Err(e) = stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush())
        {
            write_error.get_or_insert(e);
        }
    })?;
    writeln!(stdout)?;
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    let stats = generator.stats();
    let rate = |n: usize, d: std::time::Duration| n as f64 / d.as_secs_f64().max(1e-9);
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
    Ok(())
}
