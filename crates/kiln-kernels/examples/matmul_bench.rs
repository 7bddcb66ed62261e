//! Matmul throughput of the kernel paths: `cargo run --release -p kiln-kernels --example
//! matmul_bench -- [threads]`. Prints GFLOP/s per (m, n, k) for bf16 weights two ways: widened
//! to f32 with f32 activations (`--dtype float32`), and bf16 dot products of activations
//! rounded to bf16 (`--dtype bfloat16`, where the CPU has AVX-512 BF16).

use std::time::Instant;

use half::bf16;
use kiln_kernels::{ThreadPool, WeightData, WeightMatrix, linear};

fn main() {
    // The kernels read no environment: this program passes `KILN_ISA` / `KILN_PREFETCH` on.
    kiln_kernels::force_paths(
        std::env::var(kiln_kernels::ISA_ENV).ok().as_deref(),
        std::env::var(kiln_kernels::PREFETCH_ENV).ok().as_deref(),
    );
    let threads = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let pool = ThreadPool::new(threads);
    for &(n, k) in &[(4864usize, 896usize), (896, 4864), (151_936, 896)] {
        let w: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32((i % 13) as f32 * 0.01)).collect();
        let widened = WeightMatrix::new(n, k, WeightData::Bf16(w.clone().into())).expect("shape");
        let dots = WeightMatrix::new(n, k, WeightData::Bf16(w.into())).expect("shape");
        let dots = dots.with_bf16_dots();
        for (&m, (w, mode)) in [1usize, 4, 16, 64, 512]
            .iter()
            .flat_map(|m| [(m, (&widened, "bf16 x f32")), (m, (&dots, "bf16 dots "))])
        {
            if n > 100_000 && m > 16 {
                continue;
            }
            let x = vec![0.5f32; m * k];
            let mut out = vec![0.0f32; m * n];
            linear(&pool, &x, m, w, None, &mut out);
            let reps = (2e10 / (2.0 * (m * n * k) as f64)).clamp(3.0, 200.0) as usize;
            let start = Instant::now();
            for _ in 0..reps {
                linear(&pool, &x, m, w, None, &mut out);
            }
            let secs = start.elapsed().as_secs_f64() / reps as f64;
            let gflops = 2.0 * (m * n * k) as f64 / secs / 1e9;
            let gbs = (n * k * 2) as f64 / secs / 1e9;
            println!(
                "m={m:4} n={n:6} k={k:5} {mode}: {gflops:7.1} GFLOP/s  {gbs:6.1} GB/s weights  {:.3} ms",
                secs * 1e3
            );
        }
    }
}
