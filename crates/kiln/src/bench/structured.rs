//! `kiln bench structured`: structured outputs against unconstrained decoding, side by side on
//! one engine, `--batch-size` requests at a time (greedy).
//!
//! `scripts/bench/schemas/person20.json` is a 20-field object.
//!
//! Each prompt first runs constrained by `--schema` (a JSON schema file) until its grammar
//! completes or `--output-len`; then unconstrained with `max_tokens` equal to the constrained
//! output's length and EOS ignored, so both runs decode the same number of tokens in the same
//! batch shapes (the order alternates per group and round). Decode time runs from the step that
//! gave every request of the group its first token to the end. Round 0 runs the constrained side
//! first (it yields the lengths); later rounds alternate.
//!
//! Reported: decode tok/s of both and their ratio; the time to build the vocabulary trie, to
//! compile the schema and to fetch it from the cache; the mask time per token (p50, p99, mean),
//! measured by replaying every constrained output through a fresh constraint (what decoding
//! would cost if every token needed the mask); what the engine's constraints actually did
//! (masks computed, single tokens checked, time per token); and whether every output parsed
//! as JSON.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use kiln_core::{SamplingParams, StructuredOutput, TokenId};
use kiln_engine::structured::{ConstraintStats, GrammarCompiler};
use kiln_engine::{EngineConfig, EngineCore, SchedulerConfig};

use super::speculative::{Totals, decode};
use crate::model_arg::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct StructuredArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSON schema every constrained output must follow.
    #[arg(long)]
    schema: PathBuf,
    /// Prompts (each asks for a different record).
    #[arg(long, default_value_t = 8)]
    num_prompts: usize,
    /// Most output tokens per request.
    #[arg(long, default_value_t = 384)]
    output_len: usize,
    /// Prompts run together.
    #[arg(long, default_value_t = 1)]
    batch_size: usize,
    /// Times every prompt runs on each side (alternating which goes first).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Kernel threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

pub fn run(args: &StructuredArgs) -> anyhow::Result<()> {
    ensure!(
        args.rounds > 0 && args.output_len > 0 && args.batch_size > 0 && args.num_prompts > 0,
        "--rounds, --output-len, --batch-size and --num-prompts must be at least 1"
    );
    let schema = std::fs::read_to_string(&args.schema)
        .with_context(|| format!("reading {}", args.schema.display()))?;
    let output = StructuredOutput::JsonSchema(schema);
    let loaded = args.model.load(args.threads)?;
    let num_threads = loaded.model.backend().pool().num_threads();
    let tokenizer = loaded.tokenizer;
    let vocab_size = loaded.model.config().vocab_size;
    let started = Instant::now();
    let compiler =
        GrammarCompiler::new(tokenizer.token_bytes(), vocab_size, tokenizer.eos_token_ids())?;
    let build_time = started.elapsed();
    let (_, first) = compiler.compile_timed(&output)?;
    let (_, cached) = compiler.compile_timed(&output)?;
    let compiler = Arc::new(compiler);
    let prompts: Vec<Vec<TokenId>> = (0..args.num_prompts)
        .map(|i| {
            let text = format!(
                "Record {} of the customer database, as one JSON object with 20 fields:\n",
                i + 1
            );
            tokenizer.encode(&text, true).map(|ids| ids.into_iter().map(TokenId).collect())
        })
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!(e))?;
    let max_len = prompts.iter().map(Vec::len).max().unwrap_or(0) + args.output_len;
    let eos: Vec<TokenId> = tokenizer.eos_token_ids().iter().map(|&t| TokenId(t)).collect();
    let config = EngineConfig {
        host_pool: crate::model_arg::cpu_host_pool(&*loaded.model),
        num_kv_blocks: (max_len.div_ceil(16) + 1) * args.batch_size,
        max_model_len: Some(max_len),
        scheduler: SchedulerConfig { enable_prefix_caching: false, ..SchedulerConfig::default() },
        eos_token_ids: eos,
        ..EngineConfig::default()
    };
    let mut core = EngineCore::new(loaded.model, config).context("building the engine")?;
    core.set_grammar_compiler(Arc::clone(&compiler));
    eprintln!("{} prompts, {} rounds, {num_threads} threads", prompts.len(), args.rounds);
    let constrained = |_: usize| SamplingParams {
        structured: Some(output.clone()),
        ..SamplingParams::greedy(args.output_len)
    };
    decode(&mut core, &prompts[..1], &constrained)?; // warm-up
    let (mut free, mut bound) = (Totals::default(), Totals::default());
    let mut outputs: Vec<Vec<TokenId>> = Vec::new();
    let mut num_parsed = 0;
    for round in 0..args.rounds {
        for (g, group) in prompts.chunks(args.batch_size).enumerate() {
            // Round 0 measures the lengths to match, so it runs constrained first.
            let constrained_first = round == 0 || (round + g) % 2 == 0;
            let mut lengths = Vec::new();
            let mut run_constrained = |core: &mut EngineCore| {
                let (outs, tokens, time) = decode(core, group, &constrained)?;
                bound.decode_tokens += tokens;
                bound.decode_time += time;
                lengths = outs.iter().map(Vec::len).collect();
                anyhow::Ok(outs)
            };
            let outs = if constrained_first {
                run_constrained(&mut core)?
            } else {
                // The lengths to match come from round 0's constrained outputs.
                let base = g * args.batch_size;
                let known: Vec<usize> =
                    outputs[base..base + group.len()].iter().map(Vec::len).collect();
                let unconstrained = |n: usize| SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(known[n])
                };
                let (_, tokens, time) = decode(&mut core, group, &unconstrained)?;
                free.decode_tokens += tokens;
                free.decode_time += time;
                run_constrained(&mut core)?
            };
            if constrained_first {
                let unconstrained = |n: usize| SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(lengths[n])
                };
                let (_, tokens, time) = decode(&mut core, group, &unconstrained)?;
                free.decode_tokens += tokens;
                free.decode_time += time;
            }
            if round == 0 {
                for out in &outs {
                    let ids: Vec<u32> = out.iter().map(|t| t.0).collect();
                    let text = tokenizer.decode(&ids, true).map_err(|e| anyhow::anyhow!(e))?;
                    num_parsed +=
                        usize::from(serde_json::from_str::<serde_json::Value>(&text).is_ok());
                }
                outputs.extend(outs);
            }
        }
    }
    let masks = replay_masks(&compiler, &output, &outputs, vocab_size)?;
    report(args, num_threads, &free, &bound, build_time, first.elapsed, cached.elapsed, &masks);
    report_engine_work(&core.stats().structured);
    println!("outputs that parse as JSON: {num_parsed} of {}", outputs.len());
    Ok(())
}

/// Every mask computation of every output, replayed through fresh constraints.
fn replay_masks(
    compiler: &GrammarCompiler,
    output: &StructuredOutput,
    outputs: &[Vec<TokenId>],
    vocab_size: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut logits = vec![0.0f32; vocab_size];
    let mut times = Vec::new();
    for out in outputs {
        let mut constraint = compiler.compile(output)?;
        for token in out {
            constraint.mask(&mut logits);
            times.push(constraint.last_mask_time());
            constraint.accept(token.0);
        }
    }
    times.sort_unstable();
    Ok(times)
}

fn report(
    args: &StructuredArgs,
    num_threads: usize,
    free: &Totals,
    bound: &Totals,
    build_time: Duration,
    compile_time: Duration,
    cached_time: Duration,
    masks: &[Duration],
) {
    let pct = |p: f64| {
        masks
            .get(((masks.len() as f64 * p) as usize).min(masks.len().saturating_sub(1)))
            .map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    let mean = masks.iter().map(Duration::as_secs_f64).sum::<f64>() / masks.len().max(1) as f64;
    println!("| decoding | decode tokens | decode s | tok/s |");
    println!("|---|---:|---:|---:|");
    for (name, t) in [("unconstrained", free), ("JSON schema", bound)] {
        println!(
            "| {name} | {} | {:.3} | {:.1} |",
            t.decode_tokens,
            t.decode_time.as_secs_f64(),
            t.tps()
        );
    }
    println!(
        "\nbatch {}, {num_threads} threads: constrained / unconstrained {:.3}x",
        args.batch_size,
        bound.tps() / free.tps()
    );
    println!(
        "vocabulary trie {:.1} ms; schema compile {:.2} ms, from the cache {:.3} ms",
        build_time.as_secs_f64() * 1e3,
        compile_time.as_secs_f64() * 1e3,
        cached_time.as_secs_f64() * 1e3
    );
    println!(
        "mask per token over {} tokens: p50 {:.0} us, p99 {:.0} us, mean {:.0} us",
        masks.len(),
        pct(0.5),
        pct(0.99),
        mean * 1e6
    );
}

/// What the engine's constraints did in the run (warm-up included): how many tokens needed the
/// full mask and how many were admitted by checking the one token picked without it.
fn report_engine_work(work: &ConstraintStats) {
    let per = |time: Duration, n: u64| time.as_secs_f64() * 1e6 / n.max(1) as f64;
    println!(
        "engine: {} constrained tokens, {} masks computed ({:.1} %), {} single-token checks \
         (mean {:.1} us); constraint time per token {:.1} us (masks alone: mean {:.0} us)",
        work.tokens,
        work.masks,
        100.0 * work.masks as f64 / work.tokens.max(1) as f64,
        work.checks,
        per(work.check_time, work.checks),
        per(work.mask_time + work.check_time, work.tokens),
        per(work.mask_time, work.masks)
    );
}
