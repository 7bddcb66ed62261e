//! `kiln bench speculative`: speculative decoding against plain decoding, side by side in one
//! process, `--batch-size` requests at a time (default 1; greedy unless `--temperature`, EOS
//! ignored).
//!
//! Each prompt (from `--prompts`, a JSON-lines file of `{"prompt": "..."}`, or `--random N`
//! prompts of random tokens) runs twice on one engine: with `--speculative-config` and without,
//! in alternating order per group and round. Decode time
//! runs from the step that gave every request of the group its first token to the end, as in
//! `kiln bench latency` (for one request: first token to last). The outputs must be identical (the
//! bench fails otherwise): speculation may change speed, never tokens.
//!
//! Reported: decode tok/s of both and their ratio (sums over all prompts and rounds), the
//! acceptance rate, the mean acceptance length, acceptance per draft position, and the share of
//! the speculative run spent proposing drafts.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use kiln_core::{Rng, SamplingParams, TokenId};
use kiln_engine::{EngineConfig, EngineCore, SchedulerConfig, SpecDecodeStats, SpeculativeConfig};
use serde_json::json;

use crate::engine_args::parse_speculative_config;
use crate::model_arg::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct SpeculativeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The speculative configuration to measure (vLLM's JSON, as `kiln serve`).
    #[arg(long, value_parser = parse_speculative_config)]
    speculative_config: SpeculativeConfig,
    /// JSON lines, one `{"prompt": "..."}` per line (tokenized with the model's tokenizer, special
    /// tokens added).
    #[arg(long, conflicts_with = "random")]
    prompts: Option<PathBuf>,
    /// Instead of `--prompts`: this many prompts of `--input-len` random tokens.
    #[arg(long)]
    random: Option<usize>,
    /// Prompt tokens of `--random` prompts.
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    /// Output tokens per prompt.
    #[arg(long, default_value_t = 256)]
    output_len: usize,
    /// Prompts run together (consecutive prompts of the file, in groups of this many).
    #[arg(long, default_value_t = 1)]
    batch_size: usize,
    /// Times every prompt runs on each engine (alternating which goes first).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Kernel threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Sampling temperature (0 = greedy); request `n` samples with seed `--seed + n`, the same
    /// on both engines, so the outputs must still be identical.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Seed of the `--random` prompts and of sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the results as JSON.
    #[arg(long)]
    save_result: Option<PathBuf>,
}

/// Totals of one engine over every prompt and round.
#[derive(Debug, Default)]
pub(super) struct Totals {
    pub(super) decode_tokens: usize,
    pub(super) decode_time: Duration,
}

impl Totals {
    pub(super) fn tps(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

pub fn run(args: &SpeculativeArgs) -> anyhow::Result<()> {
    ensure!(
        args.rounds > 0 && args.output_len > 0 && args.batch_size > 0,
        "--rounds, --output-len and --batch-size must be at least 1"
    );
    let (loaded, draft) =
        args.model.load_with_draft(args.threads, Some(&args.speculative_config))?;
    let num_threads = loaded.model.backend().pool().num_threads();
    let vocab = loaded.model.config().vocab_size as u64;
    let prompts: Vec<Vec<TokenId>> = match (&args.prompts, args.random) {
        (Some(path), _) => read_prompts(path, &loaded.tokenizer)?,
        (None, Some(n)) => {
            let mut rng = Rng::new(args.seed);
            (0..n)
                .map(|_| {
                    (0..args.input_len).map(|_| TokenId((rng.next_u64() % vocab) as u32)).collect()
                })
                .collect()
        }
        (None, None) => bail!("give --prompts FILE or --random N"),
    };
    ensure!(!prompts.is_empty(), "no prompts");
    let max_len = prompts.iter().map(Vec::len).max().unwrap_or(0) + args.output_len;
    let config = EngineConfig {
        host_pool: crate::model_arg::cpu_host_pool(&*loaded.model),
        num_kv_blocks: (max_len.div_ceil(16) + 1) * args.batch_size,
        max_model_len: Some(max_len),
        scheduler: SchedulerConfig { enable_prefix_caching: false, ..SchedulerConfig::default() },
        speculative: Some(args.speculative_config.clone()),
        ..EngineConfig::default()
    };
    // One engine, speculation switched between runs: both sides share weights, KV cache and
    // threads (two engines on two copies of the weights differ by several percent on their own).
    let mut core =
        EngineCore::with_draft_model(loaded.model, draft, config).context("building the engine")?;
    let spec_config = Some(args.speculative_config.clone());
    eprintln!(
        "{} prompts, {} rounds, {num_threads} threads; warming up",
        prompts.len(),
        args.rounds
    );
    let warm = [prompts[0][..prompts[0].len().min(16)].to_vec()];
    for config in [None, spec_config.clone()] {
        core.set_speculative_config(config)?;
        decode(&mut core, &warm, &|_| SamplingParams::greedy(4))?;
    }
    let spec_before = core.stats().spec_decode;
    let started = Instant::now();
    let (mut plain_totals, mut spec_totals) = (Totals::default(), Totals::default());
    for round in 0..args.rounds {
        for (g, group) in prompts.chunks(args.batch_size).enumerate() {
            let spec_first = (round + g) % 2 == 1;
            let first = (g * args.batch_size) as u64;
            let params = |n: usize| SamplingParams {
                temperature: args.temperature,
                seed: Some(args.seed + first + n as u64),
                ignore_eos: true,
                ..SamplingParams::greedy(args.output_len)
            };
            let mut run = |speculate: bool, totals: &mut Totals| {
                core.set_speculative_config(if speculate { spec_config.clone() } else { None })?;
                let (outputs, tokens, time) = decode(&mut core, group, &params)?;
                totals.decode_tokens += tokens;
                totals.decode_time += time;
                anyhow::Ok(outputs)
            };
            let (a, b) = if spec_first {
                let b = run(true, &mut spec_totals)?;
                (run(false, &mut plain_totals)?, b)
            } else {
                let a = run(false, &mut plain_totals)?;
                (a, run(true, &mut spec_totals)?)
            };
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                let n = g * args.batch_size + i;
                ensure!(a == b, "prompt {n}: speculative decoding changed the output");
            }
        }
    }
    eprintln!("({:.1} s in all)", started.elapsed().as_secs_f64());
    let s = core.stats().spec_decode.since(&spec_before);
    report(args, prompts.len(), num_threads, &plain_totals, &spec_totals, &s)
}

/// Prints (and with `--save-result` writes) the comparison.
fn report(
    args: &SpeculativeArgs,
    num_prompts: usize,
    num_threads: usize,
    plain_totals: &Totals,
    spec_totals: &Totals,
    s: &SpecDecodeStats,
) -> anyhow::Result<()> {
    let ratio = spec_totals.tps() / plain_totals.tps();
    let per_pos = s.acceptance_rate_per_pos();
    println!("| engine | decode tokens | decode s | tok/s |");
    println!("|---|---:|---:|---:|");
    for (name, t) in [("plain", plain_totals), ("speculative", spec_totals)] {
        println!(
            "| {name} | {} | {:.3} | {:.1} |",
            t.decode_tokens,
            t.decode_time.as_secs_f64(),
            t.tps()
        );
    }
    let propose_share = s.propose_nanos as f64 / 1e9 / spec_totals.decode_time.as_secs_f64();
    println!(
        "\nspeculative / plain: {ratio:.3}x; outputs identical; {} drafts, {:.1} % of draft \
         tokens accepted, mean acceptance length {:.2}; proposing took {:.2} % of the \
         speculative decode time",
        s.num_drafts,
        100.0 * s.acceptance_rate(),
        s.mean_acceptance_length(),
        100.0 * propose_share
    );
    let pos: Vec<String> = per_pos.iter().map(|r| format!("{r:.2}")).collect();
    println!("acceptance per position: [{}]", pos.join(", "));
    if let Some(path) = &args.save_result {
        let result = json!({
            "speculative_config": format!("{:?}", args.speculative_config),
            "num_prompts": num_prompts, "rounds": args.rounds, "output_len": args.output_len,
            "threads": num_threads,
            "plain_decode_tok_s": plain_totals.tps(), "spec_decode_tok_s": spec_totals.tps(),
            "ratio": ratio, "num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "acceptance_rate": s.acceptance_rate(),
            "mean_acceptance_length": s.mean_acceptance_length(),
            "acceptance_rate_per_pos": per_pos, "propose_share": propose_share,
        });
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Runs `prompts` together (prompt `n` with `params(n)`): their tokens, and the tokens generated
/// in the decode phase and its time (from the step that gave every request its first token to
/// the end; for one prompt, its first token to its last).
pub(super) fn decode(
    core: &mut EngineCore,
    prompts: &[Vec<TokenId>],
    params: &dyn Fn(usize) -> SamplingParams,
) -> anyhow::Result<(Vec<Vec<TokenId>>, usize, Duration)> {
    let mut outputs = HashMap::with_capacity(prompts.len());
    let mut ids = Vec::with_capacity(prompts.len());
    for (n, prompt) in prompts.iter().enumerate() {
        let id = core.add_request(prompt.clone(), params(n), 0)?;
        outputs.insert(id, Vec::new());
        ids.push(id);
    }
    let mut decode_start = None;
    let mut decode_tokens = 0;
    while core.has_unfinished() {
        let step = core.step()?;
        if decode_start.is_some() {
            decode_tokens += step.len();
        }
        for out in step {
            outputs
                .get_mut(&out.id)
                .context("an output of an unknown request")?
                .push(out.new_token);
        }
        if decode_start.is_none() && outputs.values().all(|o| !o.is_empty()) {
            decode_start = Some(Instant::now());
        }
    }
    let time = decode_start.map_or(Duration::ZERO, |t| t.elapsed());
    let outputs = ids.iter().map(|id| outputs.remove(id).unwrap_or_default()).collect();
    Ok((outputs, decode_tokens, time))
}

fn read_prompts(
    path: &std::path::Path,
    tokenizer: &kiln_tokenizer::Tokenizer,
) -> anyhow::Result<Vec<Vec<TokenId>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut prompts = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let value: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), n + 1))?;
        let Some(prompt) = value.get("prompt").and_then(|p| p.as_str()) else {
            bail!("{}:{}: needs a string \"prompt\"", path.display(), n + 1);
        };
        let ids = tokenizer.encode(prompt, true).map_err(|e| anyhow::anyhow!(e))?;
        prompts.push(ids.into_iter().map(TokenId).collect());
    }
    Ok(prompts)
}
