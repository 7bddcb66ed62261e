//! `kiln plan`: what fits and how fast it should run. Prints the model's bytes, KV bytes per
//! token, tokens / sequences / longest context for a memory budget, and a roofline estimate
//! of decode (batch 1..64) and prefill speed from this machine's read bandwidth and matmul rate
//! (quick built-in probes, or given). `--measure` runs the model and prints measured beside
//! predicted. The arithmetic is `kiln_bench::plan`. A pooling model (an embedding model or a
//! sequence classifier, as `kiln serve` detects one) has no decode and no LM head: its plan is
//! the capacity and the prefill rate, also as inputs per second.

use std::fmt::Write as _;

use anyhow::bail;
use kiln_bench::plan::{
    ExpertShape, KvDtype, Machine, ModelShape, capacity, decode_estimate, prefill_estimate,
};
use kiln_core::Rng;
use kiln_engine::{EngineConfig, KvCacheDtype};
use kiln_kernels::{Cpu, GgmlType, ThreadPool, probe};

use crate::bench::latency::{grid_engine, run_cell};
use crate::engine_args::EngineArgs;
use crate::kv_args::{Bytes, available_memory};
use crate::model_arg::ModelArgs;

const BATCHES: [usize; 5] = [1, 4, 16, 32, 64];

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Memory budget (weights + KV cache + reserve); default: the RAM available now.
    #[arg(long)]
    memory: Option<Bytes>,
    /// Memory kept back for activations and the runtime.
    #[arg(long, default_value = "512MiB")]
    reserve: Bytes,
    /// Tokens per request for the sequence count; default: the model's context length.
    #[arg(long)]
    max_model_len: Option<usize>,
    /// KV cache element type to plan for: f32, f16, bf16, int8, fp8 (= fp8_e4m3) or fp8_e5m2
    /// (the engine stores all but bf16; default: the engine's).
    #[arg(long, default_value = EngineConfig::default().kv_cache_dtype.name())]
    kv_cache_dtype: KvDtype,
    /// Context length of the decode estimate.
    #[arg(long, default_value_t = 256)]
    context: usize,
    /// Prompt length of the prefill estimate.
    #[arg(long, default_value_t = 512)]
    prefill_len: usize,
    /// Read bandwidth in GB/s instead of probing it.
    #[arg(long)]
    bandwidth_gbs: Option<f64>,
    /// Matmul rate in GOP/s instead of probing it.
    #[arg(long)]
    peak_gops: Option<f64>,
    /// Run the model and print measured beside predicted (with the KV cache of
    /// `--kv-cache-dtype`; f32 when planning for bf16).
    #[arg(long)]
    measure: bool,
    /// Kernel threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    if args.context == 0 || args.prefill_len == 0 {
        bail!("--context and --prefill-len must be at least 1");
    }
    let path = args.model.resolve()?;
    let pooling = crate::pooling_args::PoolingArgs::default().resolve(&path)?.is_some();
    if pooling && args.measure {
        bail!(
            "--measure runs generation, which a pooling model (embeddings, scores) does not do; \
             measure it served: `kiln serve MODEL --runner pooling` and `kiln bench serve \
             --backend openai-embeddings`"
        );
    }
    let model_args = ModelArgs { pooling, ..args.model.clone() };
    let loaded = model_args.load_path(&path, args.threads)?;
    let config = loaded.model.config().clone();
    let experts = config.moe.as_ref().map(|m| ExpertShape {
        num_experts: m.num_experts,
        experts_per_token: m.experts_per_token,
        intermediate: m.expert_intermediate_size,
        shared_intermediate: m.shared_expert_intermediate_size.unwrap_or(0),
        sparse_layers: m.num_sparse_layers(),
    });
    let shape = ModelShape {
        weight_bytes: loaded.model.weight_bytes() as u64,
        active_weight_bytes: loaded.model.active_weight_bytes() as u64,
        experts,
        num_layers: config.num_layers,
        hidden: config.hidden_size,
        num_heads: config.num_heads,
        num_kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        kv_caches: loaded.model.kv_layout().caches(),
        attn_macs: config.mla.map(|m| latent_attention_macs(&config, &m)),
        intermediate: config.intermediate_size,
        vocab: config.vocab_size,
        encoder: config.encoder.is_some(),
        layer_windows: config.layer_windows.clone(),
        max_position_embeddings: config.max_position_embeddings,
    };
    let dtype = args.kv_cache_dtype;
    let memory = match args.memory {
        Some(Bytes(b)) => b,
        None => available_memory()
            .ok_or_else(|| anyhow::anyhow!("cannot read the available memory; give --memory"))?,
    };
    let max_model_len = args.max_model_len.unwrap_or(config.max_position_embeddings) as u64;
    let mut capacity = describe_capacity(&shape, memory, args.reserve.0, max_model_len, dtype);
    if pooling {
        // Loaded for pooling: the LM head (if the checkpoint has one) is never read.
        let head = format!(" + {:.1} M LM head", shape.lm_head_macs() as f64 / 1e6);
        capacity = capacity.replacen(&head, " (pooling: no LM head)", 1);
    }
    print!("{capacity}");
    let machine = probe_machine(loaded.model.backend().pool(), args);
    if pooling {
        print!("{}", describe_pooling(&shape, machine, args.prefill_len));
        return Ok(());
    }
    let measured = if args.measure { Some(measure(args, loaded.model)?) } else { None };
    print!("{}", describe_speed(&shape, machine, args, dtype, measured.as_ref()));
    Ok(())
}

/// A pooling model's speed: every input is one prefill of its tokens, ending at the hidden
/// state (no LM head).
fn describe_pooling(shape: &ModelShape, machine: Machine, len: usize) -> String {
    let headless = ModelShape { vocab: 0, ..shape.clone() };
    let tokens = prefill_estimate(&headless, machine, len);
    format!(
        "pooling model (embeddings / scores): no decode; inputs of {len} tokens (--prefill-len): \
         predicted {tokens:.0} tok/s, {:.1} inputs/s\n",
        tokens / len as f64
    )
}

/// Latent attention's matmul multiply-adds per token and layer: the query (compressed or not),
/// the latent and RoPE key, the per-head absorption and value up-projection, the output.
fn latent_attention_macs(c: &kiln_models::ModelConfig, m: &kiln_models::MlaConfig) -> usize {
    let (h, heads) = (c.hidden_size, c.num_heads);
    let query = match m.q_lora_rank {
        Some(rank) => h * rank + rank * heads * m.qk_head_dim(),
        None => h * heads * m.qk_head_dim(),
    };
    let latent = h * (m.kv_lora_rank + m.qk_rope_head_dim);
    let per_head = heads * m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim);
    query + latent + per_head + heads * m.v_head_dim * h
}

fn describe_capacity(
    shape: &ModelShape,
    memory: u64,
    reserve: u64,
    max_model_len: u64,
    dtype: KvDtype,
) -> String {
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let c = capacity(shape, memory, reserve, max_model_len, dtype);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "model: {} layers, hidden {}, {} heads / {} KV heads × {}, FFN {}, vocab {}, context {}",
        shape.num_layers,
        shape.hidden,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.intermediate,
        shape.vocab,
        shape.max_position_embeddings
    );
    let _ = writeln!(
        s,
        "weights: {} bytes ({:.1} MiB); matmul multiply-adds per token: {:.1} M in the blocks + {:.1} M LM head",
        shape.weight_bytes,
        mib(shape.weight_bytes),
        shape.block_macs() as f64 / 1e6,
        shape.lm_head_macs() as f64 / 1e6
    );
    if let Some(e) = &shape.experts {
        let _ = writeln!(
            s,
            "experts: {} per sparse layer ({} of {} layers), {} per token, FFN {}{}; one token \
             reads {} bytes ({:.1} MiB) of the weights",
            e.num_experts,
            e.sparse_layers,
            shape.num_layers,
            e.experts_per_token,
            e.intermediate,
            if e.shared_intermediate > 0 {
                format!(", a shared expert of FFN {}", e.shared_intermediate)
            } else {
                String::new()
            },
            shape.active_weight_bytes,
            mib(shape.active_weight_bytes)
        );
    }
    let _ = writeln!(
        s,
        "KV cache ({}): {} bytes per token = {} × {} layers × {} KV heads × {} dims × {} bytes",
        dtype.name(),
        c.kv_bytes_per_token,
        shape.kv_caches,
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
        dtype.bytes()
    );
    let _ = writeln!(
        s,
        "memory {:.1} MiB − weights {:.1} MiB − reserve {:.1} MiB = {:.1} MiB of KV cache: {} tokens",
        mib(memory),
        mib(shape.weight_bytes),
        mib(reserve),
        mib(c.kv_budget),
        c.max_tokens
    );
    let _ = writeln!(
        s,
        "sequences of {max_model_len} tokens at once: {}; longest context that fits: {} tokens{}",
        c.max_sequences,
        c.longest_context,
        if c.longest_context == shape.max_position_embeddings as u64 {
            " (the model's limit)"
        } else {
            ""
        }
    );
    s
}

fn probe_machine(pool: &ThreadPool, args: &PlanArgs) -> Machine {
    let bandwidth =
        args.bandwidth_gbs.map_or_else(|| probe::read_bandwidth(pool, 512, 5), |g| g * 1e9);
    let peak_ops = args.peak_gops.map_or_else(
        || probe::matmul_ops(pool, GgmlType::Q8_0, 128, 2048, 2048, 5).unwrap_or(1e9),
        |g| g * 1e9,
    );
    let source =
        if args.bandwidth_gbs.is_some() && args.peak_gops.is_some() { "given" } else { "probed" };
    println!(
        "machine ({source}, {} threads): read bandwidth {:.1} GB/s, quantized matmul {:.0} GOP/s",
        pool.num_threads(),
        bandwidth / 1e9,
        peak_ops / 1e9
    );
    Machine { bandwidth, peak_ops }
}

/// Measured decode tok/s per batch of [`BATCHES`] and prefill tok/s.
struct Measured {
    decode: Vec<f64>,
    prefill: f64,
}

const DECODE_TOKENS: usize = 32;

fn measure(args: &PlanArgs, model: Box<dyn kiln_models::Model<Cpu>>) -> anyhow::Result<Measured> {
    let vocab = model.config().vocab_size as u64;
    let max_b = BATCHES[BATCHES.len() - 1];
    let len = args.context.max(args.prefill_len) + DECODE_TOKENS;
    let engine = EngineArgs {
        threads: args.threads,
        kv_cache_dtype: match args.kv_cache_dtype {
            KvDtype::F16 => KvCacheDtype::F16,
            KvDtype::Int8 => KvCacheDtype::Int8,
            KvDtype::Fp8E4M3 => KvCacheDtype::Fp8E4M3,
            KvDtype::Fp8E5M2 => KvCacheDtype::Fp8E5M2,
            KvDtype::F32 | KvDtype::Bf16 => KvCacheDtype::F32,
        },
        ..EngineArgs::default()
    };
    let block_size = EngineConfig::default().block_size;
    let mut core = grid_engine((model, None), &engine, block_size, max_b, len, max_b * len, 0)?;
    let mut rng = Rng::new(0);
    run_cell(&mut core, &mut rng, vocab, 1, 16, 4)?;
    let prefill = run_cell(&mut core, &mut rng, vocab, 1, args.prefill_len, 1)?.prefill_tps();
    let mut decode = Vec::with_capacity(BATCHES.len());
    for b in BATCHES {
        let input = args.context.saturating_sub(DECODE_TOKENS / 2).max(1);
        decode.push(run_cell(&mut core, &mut rng, vocab, b, input, DECODE_TOKENS)?.decode_tps());
    }
    Ok(Measured { decode, prefill })
}

fn describe_speed(
    shape: &ModelShape,
    machine: Machine,
    args: &PlanArgs,
    dtype: KvDtype,
    measured: Option<&Measured>,
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "roofline at context {} ({} KV cache):", args.context, dtype.name());
    let _ =
        writeln!(s, "| batch | bound | predicted decode tok/s | measured | measured / predicted |");
    let _ = writeln!(s, "|---:|---|---:|---:|---:|");
    for (i, b) in BATCHES.into_iter().enumerate() {
        let d = decode_estimate(shape, machine, b, args.context, dtype);
        let bound = if d.compute_bound { "arithmetic" } else { "memory" };
        let m = measured.map(|m| m.decode[i]);
        let _ = writeln!(
            s,
            "| {b} | {bound} | {:.1} | {} | {} |",
            d.tokens_per_second,
            fmt_opt(m),
            ratio(m, d.tokens_per_second)
        );
    }
    let p = prefill_estimate(shape, machine, args.prefill_len);
    let m = measured.map(|m| m.prefill);
    let _ = writeln!(
        s,
        "prefill of {} tokens: predicted {p:.0} tok/s; measured {}; measured / predicted {}",
        args.prefill_len,
        fmt_opt(m),
        ratio(m, p)
    );
    s
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

fn ratio(measured: Option<f64>, predicted: f64) -> String {
    measured.map_or_else(|| "-".into(), |m| format!("{:.0}%", 100.0 * m / predicted))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        plan: PlanArgs,
    }

    #[test]
    fn plans_for_the_kv_dtype_serve_uses() {
        let plan = Cli::try_parse_from(["kiln"]).unwrap().plan;
        let serve = EngineArgs::default().kv_cache_dtype;
        assert_eq!(plan.kv_cache_dtype.name(), serve.name());
    }

    /// `kiln plan` and the engine (its start-up log) count the same bytes per token for every
    /// dtype the engine stores.
    #[test]
    fn plan_and_engine_agree_on_kv_bytes() {
        let layout = kiln_models::KvLayout::new(18, 2, 256);
        let shape = ModelShape {
            weight_bytes: 0,
            active_weight_bytes: 0,
            experts: None,
            num_layers: 18,
            hidden: 640,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 256,
            kv_caches: 2,
            attn_macs: None,
            intermediate: 2048,
            vocab: 1000,
            encoder: false,
            layer_windows: vec![None; 18],
            max_position_embeddings: 4096,
        };
        for dtype in KvCacheDtype::ALL {
            let planned: KvDtype = dtype.name().parse().unwrap();
            assert_eq!(
                shape.kv_bytes_per_token(planned),
                layout.bytes_per_token(dtype) as u64,
                "{}",
                dtype.name()
            );
        }
        let f16 = layout.bytes_per_token(KvCacheDtype::F16) as f64;
        let int8 = layout.bytes_per_token(KvCacheDtype::Int8) as f64;
        assert!(f16 / int8 > 1.88, "int8 holds {:.3}x the tokens of f16", f16 / int8);
    }
}
