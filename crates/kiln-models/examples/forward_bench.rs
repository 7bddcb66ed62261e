//! Times the forward pass alone: prefill of `P` tokens (after one untimed warm-up pass), then
//! `D` single-token decode steps (batch 1), on a model path (default: the cached default model).
//!
//! `cargo run --release -p kiln-models --example forward_bench -- [MODEL] [P] [D] [THREADS]`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kiln_fetch::{FetchConfig, fetch_default_model};
use kiln_kernels::Cpu;
use kiln_models::{
    Backend, ForwardBatch, KvCacheDtype, KvCacheSpec, Logits, LogitsWanted, Workspace, load_model,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = match args.get(1).map(String::as_str) {
        None | Some("default") => fetch_default_model(&FetchConfig::from_env())?,
        Some(p) => PathBuf::from(p),
    };
    let prefill: usize = args.get(2).map_or(Ok(512), |s| s.parse())?;
    let decode: usize = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let threads: usize = args.get(4).map_or(Ok(0), |s| s.parse())?;
    let start = Instant::now();
    let cpu = Arc::new(Cpu::new(threads));
    let loaded = load_model(&path, &cpu)?;
    println!("load {:.2} s", start.elapsed().as_secs_f64());
    let model = &loaded.model;
    let block_size = 16;
    let total = prefill + decode;
    let num_blocks = total.div_ceil(block_size);
    let spec =
        KvCacheSpec { layout: model.kv_layout(), dtype: KvCacheDtype::F32, num_blocks, block_size };
    let mut kv = cpu.alloc_kv(spec)?;
    let table: Vec<u32> = (0..total.div_ceil(block_size) as u32).collect();
    let vocab = model.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..total as u32).map(|i| (i * 7919 + 13) % vocab.min(30_000)).collect();
    let (mut workspace, mut logits) = (Workspace::new(), Logits::default());
    let mut batch = ForwardBatch::new(block_size);
    batch.push_seq(&tokens[..prefill], 0, &table, LogitsWanted::Last)?;
    // Warm-up (grows the scratch buffers, as a server's first request does), then timed.
    model.forward(&batch, &mut kv, &mut workspace, &mut logits)?;
    let start = Instant::now();
    model.forward(&batch, &mut kv, &mut workspace, &mut logits)?;
    let secs = start.elapsed().as_secs_f64();
    println!("prefill {prefill} tokens: {:.1} ms, {:.0} tok/s", secs * 1e3, prefill as f64 / secs);
    let start = Instant::now();
    for pos in prefill..total {
        batch.clear();
        batch.push_seq(&tokens[pos..=pos], pos, &table, LogitsWanted::Last)?;
        model.forward(&batch, &mut kv, &mut workspace, &mut logits)?;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "decode {decode} steps: {:.2} ms/token, {:.1} tok/s ({} threads)",
        secs * 1e3 / decode as f64,
        decode as f64 / secs,
        cpu.pool().num_threads()
    );
    Ok(())
}
