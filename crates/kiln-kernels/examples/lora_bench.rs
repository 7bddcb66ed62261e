//! LoRA update throughput (`Backend::lora_add`) on one layer, rank 16, of the default model's
//! shape (Gemma 3 270M: hidden 640, q 1024, kv 256, intermediate 2048) or Llama-3.2-1B's
//! (`llama-1b`: hidden 2048, q 2048, kv 512, intermediate 8192):
//! `cargo run --release -p kiln-kernels --example lora_bench -- [threads] [gemma-270m|llama-1b]
//! [layers]` (distinct layers cycled through, default 1: one layer's adapters stay in cache).
//! Cases: a decode step of 16 rows over 4 adapters (4 rows each, alternating, or 7/5/3/1) and
//! a prefill chunk of 220 rows of one adapter, adapters kept in f32 and in f16. Prints µs per
//! layer (all seven projections) and the adapters' bytes read per second. `KILN_ISA=avx2`
//! forces the AVX2 kernel on an AVX-512 machine.

use std::time::Instant;

use kiln_backend::{Backend, LoraDtype, LoraJob};
use kiln_kernels::Cpu;
use kiln_kernels::lora::LoraValues;

const RANK: usize = 16;
/// `(k, n)` of q, k, v, o, gate, up, down, from `(hidden, q, kv, intermediate)`.
fn projections((h, q, kv, i): (usize, usize, usize, usize)) -> [(usize, usize); 7] {
    [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
}

/// One adapter's `(a, b_t)` per projection.
type Adapter = Vec<(LoraValues, LoraValues)>;

fn adapter(seed: usize, dtype: LoraDtype, shape: &[(usize, usize); 7]) -> Adapter {
    let value = |i: usize| ((i * 7 + seed * 13) % 29) as f32 * 0.01 - 0.14;
    shape
        .iter()
        .map(|&(k, n)| {
            let a: Vec<f32> = (0..RANK * k).map(value).collect();
            let b: Vec<f32> = (0..RANK * n).map(|i| value(i + 5)).collect();
            let load = |v: &[f32]| LoraValues::new(v, dtype).expect("finite");
            (load(&a), load(&b))
        })
        .collect()
}

fn main() {
    // The kernels read no environment: this program passes `KILN_ISA` on.
    kiln_kernels::force_paths(std::env::var(kiln_kernels::ISA_ENV).ok().as_deref(), None);
    let threads = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let dims = match std::env::args().nth(2).as_deref() {
        None | Some("gemma-270m") => (640, 1024, 256, 2048),
        Some("llama-1b") => (2048, 2048, 512, 8192),
        Some(other) => panic!("unknown shape {other}: gemma-270m or llama-1b"),
    };
    // Distinct layers cycled through: 1 keeps one layer's adapters in cache; a model's
    // depth (18 for the default model) reads them from memory as serving does.
    let layers: usize = std::env::args().nth(3).and_then(|s| s.parse().ok()).unwrap_or(1);
    let shape = projections(dims);
    let cpu = Cpu::new(threads);
    for dtype in [LoraDtype::F32, LoraDtype::F16] {
        // `[layer][adapter]`
        let adapters: Vec<Vec<Adapter>> = (0..layers)
            .map(|l| (0..4).map(|s| adapter(s + 4 * l, dtype, &shape)).collect())
            .collect();
        let bytes_per = if dtype == LoraDtype::F16 { 2 } else { 4 };
        // (label, run lengths, adapters): run `i` is that many consecutive rows of adapter
        // `i % adapters` (16 runs of one row: a decode batch whose sequences alternate; uneven
        // runs: a decode batch whose adapters have 7, 5, 3 and 1 sequences).
        for (label, lengths, used) in [
            ("decode 4x4 rows", vec![4usize; 4], 4usize),
            ("decode alternating", vec![1; 16], 4),
            ("decode 7/5/3/1 rows", vec![7, 5, 3, 1], 4),
            ("prefill 220 rows", vec![220], 1),
        ] {
            let rows: usize = lengths.iter().sum();
            let starts: Vec<usize> =
                lengths.iter().scan(0, |s, l| Some(std::mem::replace(s, *s + l))).collect();
            let layer = |outs: &mut [Vec<f32>], xs: &[Vec<f32>], l: usize| {
                let adapters = &adapters[l];
                for (p, &(k, n)) in shape.iter().enumerate() {
                    let jobs: Vec<LoraJob<'_, Cpu>> = (0..lengths.len())
                        .map(|i| LoraJob {
                            rows: starts[i]..starts[i] + lengths[i],
                            rank: RANK,
                            a: &adapters[i % used][p].0,
                            b_t: &adapters[i % used][p].1,
                        })
                        .collect();
                    cpu.lora_add(&xs[p], k, n, &jobs, &mut outs[p]);
                }
            };
            let xs: Vec<Vec<f32>> = shape.iter().map(|&(k, _)| vec![0.25; rows * k]).collect();
            let mut outs: Vec<Vec<f32>> = shape.iter().map(|&(_, n)| vec![0.0; rows * n]).collect();
            layer(&mut outs, &xs, 0);
            let reps = if rows > 16 { 200 } else { 2000 };
            let start = Instant::now();
            for rep in 0..reps {
                layer(&mut outs, &xs, rep % layers);
            }
            let secs = start.elapsed().as_secs_f64() / reps as f64;
            let elements: usize = shape.iter().map(|&(k, n)| RANK * (k + n)).sum();
            let gbs = (elements * bytes_per * used) as f64 / secs / 1e9;
            println!("{dtype:?} {label:18} {:8.1} us/layer {gbs:6.1} GB/s of adapters", secs * 1e6);
        }
    }
}
