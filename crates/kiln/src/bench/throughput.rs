//! `kiln bench throughput`: an offline, in-process throughput benchmark (no HTTP). Random prompt
//! tokens (seeded; with `--prefix-len` every prompt shares its first P tokens), `ignore_eos`, all
//! requests queued at once; prints requests/s, output tok/s, total tok/s, the prefix-cache hit
//! rate and preemptions.

use std::time::Instant;

use anyhow::{Context, bail};
use kiln_core::{SamplingParams, TokenId};
use kiln_engine::{EngineConfig, EngineCore, Rng};

use crate::engine_args::EngineArgs;
use crate::kv_args::{HumanCount, KvCacheArgs, available_memory};
use crate::model_arg::ModelArgs;

/// KV cache cap when `--num-kv-blocks` is not given.
const DEFAULT_KV_CACHE_CAP_BYTES: usize = 8 << 30;

#[derive(clap::Args, Debug)]
pub struct ThroughputArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 64)]
    num_prompts: usize,
    /// Prompt tokens per request (including the shared prefix).
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    /// Output tokens per request (EOS is ignored).
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Leading prompt tokens shared by every request.
    #[arg(long, default_value_t = 0)]
    prefix_len: usize,
    #[command(flatten)]
    engine: EngineArgs,
    /// KV cache sizing; default: enough blocks for every request at once, capped at 8 GiB.
    #[command(flatten)]
    kv: KvCacheArgs,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(args: &ThroughputArgs) -> anyhow::Result<()> {
    if args.num_prompts == 0 || args.input_len == 0 || args.output_len == 0 {
        bail!("--num-prompts, --input-len and --output-len must be at least 1");
    }
    if args.prefix_len > args.input_len {
        bail!("--prefix-len ({}) exceeds --input-len ({})", args.prefix_len, args.input_len);
    }
    let (loaded, draft) =
        args.model.load_with_draft(args.engine.threads, args.engine.speculative_config.as_ref())?;
    let num_threads = loaded.model.backend().pool().num_threads();
    let model = loaded.model;
    let vocab = model.config().vocab_size as u64;
    let max_model_len =
        args.kv.max_model_len.map_or(args.input_len + args.output_len, HumanCount::as_usize);
    if max_model_len < args.input_len + args.output_len {
        bail!(
            "--max-model-len ({max_model_len}) is shorter than --input-len + --output-len ({})",
            args.input_len + args.output_len
        );
    }
    let block_size = args.kv.block_size(model.config().encoder.is_some());
    let dtype = args.engine.kv_cache_dtype;
    // A draft model's cache has as many blocks as the target's: a block costs both.
    let draft_bytes_per_token = draft.as_ref().map_or(0, |d| d.kv_layout().bytes_per_token(dtype));
    let bytes_per_block =
        (model.kv_layout().bytes_per_token(dtype) + draft_bytes_per_token) * block_size;
    let wanted = (args.num_prompts * (args.input_len + args.output_len)).div_ceil(block_size);
    let cap = (DEFAULT_KV_CACHE_CAP_BYTES / bytes_per_block.max(1)).max(1);
    let weight_bytes =
        (model.weight_bytes() + draft.as_ref().map_or(0, |d| d.weight_bytes())) as u64;
    let sizing = args.kv.resolve(
        (block_size, bytes_per_block),
        max_model_len,
        || available_memory().map(|a| a.saturating_sub(weight_bytes)),
        wanted.min(cap).max(max_model_len.div_ceil(block_size)),
    )?;
    let num_kv_blocks = sizing.num_blocks;
    let mut config = EngineConfig {
        host_pool: crate::model_arg::cpu_host_pool(&*model),
        block_size,
        num_kv_blocks,
        max_model_len: Some(max_model_len),
        scheduler: args.engine.scheduler_config(!args.kv.no_enable_prefix_caching),
        seed: args.seed,
        eos_token_ids: Vec::new(),
        kv_cache_dtype: dtype,
        speculative: args.engine.speculative_config.clone(),
        slo: args.engine.slo_config()?,
        async_scheduling: args.engine.async_scheduling,
        ..EngineConfig::default()
    };
    args.kv.apply_tier(&mut config)?;
    let mut core =
        EngineCore::with_draft_model(model, draft, config).context("building the engine")?;
    eprintln!(
        "{}; {} KV cache; {} threads",
        sizing.describe(block_size, max_model_len),
        dtype.name(),
        num_threads
    );

    let mut rng = Rng::new(args.seed);
    let mut token = || TokenId((rng.next_u64() % vocab) as u32);
    let prefix: Vec<TokenId> = (0..args.prefix_len).map(|_| token()).collect();
    let prompts: Vec<Vec<TokenId>> = (0..args.num_prompts)
        .map(|_| {
            let mut p = prefix.clone();
            p.extend((args.prefix_len..args.input_len).map(|_| token()));
            p
        })
        .collect();
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(args.output_len) };

    let start = Instant::now();
    for p in prompts {
        core.add_request(p, params.clone(), 0)?;
    }
    let mut num_output = 0usize;
    while core.has_unfinished() {
        num_output += core.step()?.len();
    }
    let elapsed = start.elapsed().as_secs_f64().max(1e-9);
    let stats = core.stats();
    let num_input = args.num_prompts * args.input_len;
    println!(
        "Throughput: {:.2} requests/s, {:.1} output tok/s, {:.1} total tok/s ({} requests, {} \
         prompt + {} output tokens in {:.2} s, {} steps)",
        args.num_prompts as f64 / elapsed,
        num_output as f64 / elapsed,
        (num_input + num_output) as f64 / elapsed,
        args.num_prompts,
        num_input,
        num_output,
        elapsed,
        stats.num_steps,
    );
    println!(
        "Prefix cache hit rate: {:.1}% ({} of {} prompt tokens); preemptions: {}",
        100.0 * stats.prefix_cache.hit_rate(),
        stats.prefix_cache.num_hit_tokens,
        stats.prefix_cache.num_queried_tokens,
        stats.num_preemptions,
    );
    Ok(())
}
