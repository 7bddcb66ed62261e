//! Times the forward pass on the GPU: decode steps at several batch sizes (each sequence with
//! `CONTEXT` tokens already cached, 128 unless given), eagerly and replayed from CUDA graphs, and one prefill of
//! `PREFILL` tokens, and relates them to the device's limits: weight bytes read per second
//! against HBM bandwidth, FLOP/s against the bf16 tensor-core peak.
//!
//! `cargo run --release -p kiln-cuda --example cuda_bench -- MODEL_DIR [HBM_GBPS] [PEAK_TFLOPS]
//! [CONTEXT]` (defaults: an H100 SXM's 3,350 GB/s and 989 TFLOP/s dense bf16, 128 tokens).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kiln_backend::{
    Backend, ForwardBatch, KvCacheDtype, KvCacheSpec, Logits, LogitsWanted, Workspace,
};
use kiln_cuda::Cuda;
use kiln_models::{ModelConfig, load_model};

const BLOCK: usize = 16;
const DECODE_STEPS: usize = 32;
const PREFILL: usize = 2048;
const BATCHES: [usize; 6] = [1, 2, 8, 16, 32, 64];

/// The kernels' cache folder from the environment (this program is an edge: it reads it).
fn kernel_cache() -> Option<PathBuf> {
    kiln_cuda::kernels::kernel_cache_dir(
        std::env::var_os(kiln_cuda::kernels::CACHE_ENV),
        std::env::var_os("XDG_CACHE_HOME"),
        std::env::var_os("HOME"),
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = PathBuf::from(
        args.get(1).ok_or("usage: cuda_bench MODEL_DIR [HBM_GBPS] [TFLOPS] [CONTEXT]")?,
    );
    let hbm_gbps: f64 = args.get(2).map_or(Ok(3350.0), |s| s.parse())?;
    let peak_tflops: f64 = args.get(3).map_or(Ok(989.0), |s| s.parse())?;
    let context: usize = args.get(4).map_or(Ok(128), |s| s.parse())?;
    let start = Instant::now();
    let cuda = Arc::new(Cuda::new(0, kernel_cache().as_deref())?);
    let loaded = load_model(&path, &cuda)?;
    let model = &loaded.model;
    let c = model.config();
    let weight_bytes = model.weight_bytes() as f64;
    // Parameters that multiply each token (the LM head included, the embedding table not).
    let params = weight_bytes / 2.0;
    println!(
        "{} | {} | load {:.1} s | weights {:.2} GB bf16 | {} layers, hidden {}",
        cuda.describe(),
        path.display(),
        start.elapsed().as_secs_f64(),
        weight_bytes / 1e9,
        c.num_layers,
        c.hidden_size
    );
    let max_batch = *BATCHES.iter().max().unwrap_or(&1);
    let per_seq = (context + DECODE_STEPS + 2).div_ceil(BLOCK);
    let num_blocks = (max_batch * per_seq).max(PREFILL.div_ceil(BLOCK)) + 1;
    let spec = KvCacheSpec {
        layout: model.kv_layout(),
        dtype: KvCacheDtype::F16,
        num_blocks,
        block_size: BLOCK,
    };
    let mut kv = cuda.alloc_kv(spec)?;
    let (mut ws, mut logits) = (Workspace::new(), Logits::default());
    let vocab = c.vocab_size as u32;
    let token = |i: usize| (i as u32).wrapping_mul(7919).wrapping_add(13) % vocab;
    let mut batch = ForwardBatch::new(BLOCK);

    println!(
        "decode (context {context}, {DECODE_STEPS} steps, f16 KV cache), eager vs CUDA graphs:"
    );
    println!(
        "| batch | eager ms/step | graphs ms/step | graphs/eager | tokens/s | weight GB/s | of HBM | TFLOP/s |"
    );
    for &b in &BATCHES {
        let tables: Vec<Vec<u32>> =
            (0..b).map(|s| (0..per_seq).map(|j| (s * per_seq + j) as u32).collect()).collect();
        let mut ms = [0.0f64; 2];
        for (graphs, ms) in [false, true].into_iter().zip(&mut ms) {
            cuda.set_graphs(graphs);
            batch.clear();
            for table in &tables {
                let prompt: Vec<u32> = (0..context).map(token).collect();
                batch.push_seq(&prompt, 0, table, LogitsWanted::Last)?;
            }
            model.forward(&batch, &mut kv, &mut ws, &mut logits)?;
            let mut step = |pos: usize| -> Result<(), Box<dyn std::error::Error>> {
                batch.clear();
                for table in &tables {
                    batch.push_seq(&[token(pos)], pos, table, LogitsWanted::Last)?;
                }
                cuda.run_step(&batch, &mut logits, &mut |l| {
                    model.forward(&batch, &mut kv, &mut ws, l)
                })?;
                Ok(())
            };
            // Warm-up: buffers grow, cuBLAS picks its kernels, the graph is captured.
            step(context)?;
            step(context + 1)?;
            let t = Instant::now();
            for pos in context + 2..context + 2 + DECODE_STEPS {
                step(pos)?;
            }
            *ms = t.elapsed().as_secs_f64() / DECODE_STEPS as f64;
        }
        let secs = ms[1];
        let gbps = weight_bytes / secs / 1e9;
        let tflops = 2.0 * params * b as f64 / secs / 1e12;
        println!(
            "| {b} | {:.2} | {:.2} | {:.2}x | {:.0} | {gbps:.0} | {:.1} % | {tflops:.1} |",
            ms[0] * 1e3,
            secs * 1e3,
            ms[0] / secs,
            b as f64 / secs,
            100.0 * gbps / hbm_gbps
        );
    }
    println!("graph steps: {:?}", cuda.graph_stats());

    let table: Vec<u32> = (0..PREFILL.div_ceil(BLOCK) as u32).collect();
    let prompt: Vec<u32> = (0..PREFILL).map(token).collect();
    batch.clear();
    batch.push_seq(&prompt, 0, &table, LogitsWanted::Last)?;
    model.forward(&batch, &mut kv, &mut ws, &mut logits)?; // warm-up
    let runs = 3;
    let t = Instant::now();
    for _ in 0..runs {
        model.forward(&batch, &mut kv, &mut ws, &mut logits)?;
    }
    let secs = t.elapsed().as_secs_f64() / f64::from(runs);
    report_prefill(c, params, secs, peak_tflops);
    Ok(())
}

/// Prints a prefill's time against the bf16 tensor-core peak.
fn report_prefill(c: &ModelConfig, params: f64, secs: f64, peak_tflops: f64) {
    // Matmul FLOPs plus causal attention's QKᵀ and PV (2 · 2 · T² / 2 · q_dim per layer).
    let q_dim = (c.num_heads * c.head_dim) as f64;
    let t2 = (PREFILL * PREFILL) as f64;
    let flops = 2.0 * params * PREFILL as f64 + 2.0 * t2 * q_dim * c.num_layers as f64;
    println!(
        "prefill {PREFILL} tokens: {:.1} ms, {:.0} tokens/s, {:.0} TFLOP/s = {:.1} % of {peak_tflops} TFLOP/s",
        secs * 1e3,
        PREFILL as f64 / secs,
        flops / secs / 1e12,
        100.0 * flops / secs / 1e12 / peak_tflops
    );
}
