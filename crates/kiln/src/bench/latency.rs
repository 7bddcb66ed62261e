//! `kiln bench latency`: an in-process grid of batch size × input length × output length, as
//! llama.cpp's `llama-batched-bench`. Each cell queues B random prompts of I tokens (prefix
//! cache off, greedy, EOS ignored) and runs the engine until all have O tokens.
//!
//! Phases: prefill lasts until every request has its first token (decodes of requests that got
//! theirs earlier fall in this phase too, as they would in serving); decode is the rest.
//! Prefill tok/s = B·I / T_pp; aggregate decode tok/s = tokens generated after the prefill
//! phase / T_tg.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kiln_core::{Rng, SamplingParams, TokenId};
use kiln_engine::{EngineConfig, EngineCore, EngineStats};
use serde_json::json;

use crate::engine_args::EngineArgs;
use crate::model_arg::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct LatencyArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Batch sizes (requests at once), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 4, 16, 64])]
    batch_size: Vec<usize>,
    /// Prompt lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [128usize, 512])]
    input_len: Vec<usize>,
    /// Output lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [128usize])]
    output_len: Vec<usize>,
    #[command(flatten)]
    engine: EngineArgs,
    /// Tokens per KV cache block (a power of two up to 256).
    #[arg(long, default_value_t = EngineConfig::default().block_size)]
    block_size: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the grid as JSON.
    #[arg(long)]
    save_result: Option<std::path::PathBuf>,
}

/// One cell's measurement.
#[derive(Clone, Copy, Debug)]
pub struct Cell {
    pub batch: usize,
    pub input_len: usize,
    pub output_len: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub decode_tokens: usize,
    /// Per decode step: the wall time between steps (`decode_s` over the steps), the engine
    /// step, its model forward and its sampling, in ms. (With asynchronous scheduling a step's
    /// time includes the reporting of the step before, which overlaps its forward.)
    pub decode_period_ms: f64,
    pub decode_step_ms: f64,
    pub decode_forward_ms: f64,
    pub decode_sample_ms: f64,
}

pub fn run(args: &LatencyArgs) -> anyhow::Result<()> {
    let grid: Vec<(usize, usize, usize)> = args
        .batch_size
        .iter()
        .flat_map(|&b| {
            args.input_len
                .iter()
                .flat_map(move |&i| args.output_len.iter().map(move |&o| (b, i, o)))
        })
        .collect();
    if grid.is_empty() || grid.iter().any(|&(b, i, o)| b == 0 || i == 0 || o == 0) {
        bail!("--batch-size, --input-len and --output-len need values of at least 1");
    }
    let max_len = grid.iter().map(|&(_, i, o)| i + o).max().unwrap_or(1);
    let max_tokens = grid.iter().map(|&(b, i, o)| b * (i + o)).max().unwrap_or(1);
    let max_batch = grid.iter().map(|&(b, _, _)| b).max().unwrap_or(1);
    let (loaded, draft) =
        args.model.load_with_draft(args.engine.threads, args.engine.speculative_config.as_ref())?;
    let num_threads = loaded.model.backend().pool().num_threads();
    let vocab = loaded.model.config().vocab_size as u64;
    let mut core = grid_engine(
        (loaded.model, draft),
        &args.engine,
        args.block_size,
        max_batch,
        max_len,
        max_tokens,
        args.seed,
    )?;
    eprintln!(
        "{} threads, {} kernels, {} KV cache; warming up",
        num_threads,
        kiln_kernels::CpuIsa::selected(),
        args.engine.kv_cache_dtype.name()
    );
    let mut rng = Rng::new(args.seed);
    run_cell(&mut core, &mut rng, vocab, 1, 16, 4)?;
    println!("| B | PP | TG | T_PP s | S_PP tok/s | T_TG s | S_TG tok/s | T s | S tok/s |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut cells = Vec::with_capacity(grid.len());
    for (b, i, o) in grid {
        let c = run_cell(&mut core, &mut rng, vocab, b, i, o)?;
        println!("{}", row(&c));
        eprintln!(
            "  decode step {:.2} ms: forward {:.2} ms, sampling {:.2} ms, host {:.3} ms ({:.1} %)",
            c.decode_period_ms,
            c.decode_forward_ms,
            c.decode_sample_ms,
            c.decode_host_ms(),
            100.0 * c.decode_host_ms() / c.decode_period_ms.max(1e-9)
        );
        cells.push(c);
    }
    if let Some(path) = &args.save_result {
        let json: Vec<_> = cells.iter().map(cell_json).collect();
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// An engine for cells of up to `max_batch` requests of `max_len` tokens, `max_tokens` in
/// all, with the draft model `engine`'s speculative config names; prefix caching off so every
/// cell computes everything.
pub fn grid_engine(
    (model, draft): (
        Box<dyn kiln_models::Model<kiln_kernels::Cpu>>,
        Option<crate::model_arg::DraftModel<kiln_kernels::Cpu>>,
    ),
    engine: &EngineArgs,
    block_size: usize,
    max_batch: usize,
    max_len: usize,
    max_tokens: usize,
    seed: u64,
) -> anyhow::Result<EngineCore> {
    let mut engine = engine.clone();
    engine.max_num_seqs = Some(engine.resolved().max_num_seqs.max(max_batch));
    let config = EngineConfig {
        host_pool: crate::model_arg::cpu_host_pool(&*model),
        block_size,
        num_kv_blocks: max_tokens.div_ceil(block_size) + max_batch,
        max_model_len: Some(max_len),
        scheduler: engine.scheduler_config(false),
        seed,
        eos_token_ids: Vec::new(),
        kv_cache_dtype: engine.kv_cache_dtype,
        speculative: engine.speculative_config.clone(),
        slo: engine.slo_config()?,
        async_scheduling: engine.async_scheduling,
        ..EngineConfig::default() // no tier: latency runs never preempt
    };
    EngineCore::with_draft_model(model, draft, config).context("building the engine")
}

/// Runs one cell: `batch` random prompts of `input_len` tokens, `output_len` tokens each.
pub fn run_cell(
    core: &mut EngineCore,
    rng: &mut Rng,
    vocab: u64,
    batch: usize,
    input_len: usize,
    output_len: usize,
) -> anyhow::Result<Cell> {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(output_len) };
    let start = Instant::now();
    let mut waiting_first = HashSet::with_capacity(batch);
    for _ in 0..batch {
        let prompt: Vec<TokenId> =
            (0..input_len).map(|_| TokenId((rng.next_u64() % vocab) as u32)).collect();
        waiting_first.insert(core.add_request(prompt, params.clone(), 0)?);
    }
    while !waiting_first.is_empty() {
        for out in core.step()? {
            waiting_first.remove(&out.id);
        }
    }
    let prefill_s = start.elapsed().as_secs_f64();
    let decode_start = Instant::now();
    let before = core.stats();
    let mut decode_tokens = 0;
    while core.has_unfinished() {
        decode_tokens += core.step()?.len();
    }
    let after = core.stats();
    let decode_steps = after.num_steps - before.num_steps;
    let per_step = |total: fn(&EngineStats) -> Duration| {
        total(&after).saturating_sub(total(&before)).as_secs_f64() * 1e3
            / decode_steps.max(1) as f64
    };
    let step_ms = per_step(|s| s.total_step_time);
    let forward_ms = per_step(|s| s.total_forward_time);
    let sample_ms = per_step(|s| s.total_sample_time);
    let decode_s = decode_start.elapsed().as_secs_f64();
    Ok(Cell {
        batch,
        input_len,
        output_len,
        prefill_s,
        decode_s,
        decode_tokens,
        decode_period_ms: decode_s * 1e3 / decode_steps.max(1) as f64,
        decode_step_ms: step_ms,
        decode_forward_ms: forward_ms,
        decode_sample_ms: sample_ms,
    })
}

impl Cell {
    pub fn prefill_tps(&self) -> f64 {
        (self.batch * self.input_len) as f64 / self.prefill_s.max(1e-9)
    }

    pub fn decode_tps(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_s.max(1e-9)
    }

    /// Per decode step: the wall time outside the model forward and sampling (the host work on
    /// the critical path: scheduling, building the batch, updating requests, and whatever of
    /// the outputs' handling does not overlap the forward).
    pub fn decode_host_ms(&self) -> f64 {
        (self.decode_period_ms - self.decode_forward_ms - self.decode_sample_ms).max(0.0)
    }

    fn total_tps(&self) -> f64 {
        (self.batch * (self.input_len + self.output_len)) as f64
            / (self.prefill_s + self.decode_s).max(1e-9)
    }
}

fn row(c: &Cell) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "| {} | {} | {} | {:.3} | {:.1} | {:.3} | {:.1} | {:.3} | {:.1} |",
        c.batch,
        c.input_len,
        c.output_len,
        c.prefill_s,
        c.prefill_tps(),
        c.decode_s,
        c.decode_tps(),
        c.prefill_s + c.decode_s,
        c.total_tps()
    );
    s
}

fn cell_json(c: &Cell) -> serde_json::Value {
    json!({
        "batch_size": c.batch, "input_len": c.input_len, "output_len": c.output_len,
        "prefill_s": c.prefill_s, "prefill_tok_s": c.prefill_tps(),
        "decode_s": c.decode_s, "decode_tokens": c.decode_tokens, "decode_tok_s": c.decode_tps(),
        "decode_period_ms": c.decode_period_ms, "decode_step_ms": c.decode_step_ms,
        "decode_forward_ms": c.decode_forward_ms,
        "decode_sample_ms": c.decode_sample_ms, "decode_host_ms": c.decode_host_ms(),
        "total_tok_s": c.total_tps(),
    })
}
