//! Quantized matmul throughput: `cargo run --release -p kiln-kernels --example quant_bench --
//! [threads] [filter] [cold]`. For each (type, n, k) of gemma-3-270m's matrices (plus the LM
//! head) and m = 1, 4, 16, 64 (decode batches) and 256, 2048 (prefill chunks; not for the LM
//! head), prints GB/s of weights read and GOP/s (2·m·n·k per call), best of 3 runs. With `cold`,
//! each call takes the next of enough copies of the matrix to fill 128 MiB, so weights come
//! from memory as in a decode step rather than from the caches. `KILN_ISA` picks the path;
//! `QUANT_BENCH_ROWS=1,4` limits the row counts; `QUANT_BENCH_SHAPES=llama-1b` takes the
//! matrices of a Llama-3.2-1B Q4_K_M file instead (Q4_K and Q6_K, the tied Q6_K LM head), and
//! two of its Q5_K_M file's Q5_K ones; `QUANT_BENCH_SHAPES=llama-1b-types` takes three of those
//! matrices in every type kiln reads (the types of Q2_K, Q3_K_M, IQ4_XS, Q4_1, ... files).

use std::time::Instant;

use kiln_kernels::probe::pseudo_random_matrix;
use kiln_kernels::{GgmlType, ThreadPool, linear};

fn main() {
    // The kernels read no environment: this program passes `KILN_ISA` / `KILN_PREFETCH` on.
    kiln_kernels::force_paths(
        std::env::var(kiln_kernels::ISA_ENV).ok().as_deref(),
        std::env::var(kiln_kernels::PREFETCH_ENV).ok().as_deref(),
    );
    let mut args = std::env::args().skip(1);
    let threads = args.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let filter = args.next().unwrap_or_default();
    let cold = args.next().is_some_and(|a| a == "cold");
    let pool = ThreadPool::new(threads);
    // `QUANT_BENCH_ROWS=1,4` measures only those activation row counts.
    let rows: Vec<usize> = match std::env::var("QUANT_BENCH_ROWS") {
        Ok(list) => list
            .split(',')
            .map(|m| m.trim().parse().expect("QUANT_BENCH_ROWS: row counts, e.g. 1,4"))
            .collect(),
        Err(_) => vec![1, 4, 16, 64, 256, 2048],
    };
    let gemma = [
        (GgmlType::Q5_0, 1024usize, 640usize),
        (GgmlType::Q4K, 640, 1024),
        (GgmlType::Q5_0, 2048, 640),
        (GgmlType::Q6K, 640, 2048),
        (GgmlType::Q8_0, 2048, 640),
        (GgmlType::Q4_0, 2048, 640),
        (GgmlType::Q5K, 2048, 1024),
        (GgmlType::Q8_0, 262_144, 640),
    ];
    let llama_1b = [
        (GgmlType::Q4K, 2048usize, 2048usize),
        (GgmlType::Q4K, 512, 2048),
        (GgmlType::Q6K, 512, 2048),
        (GgmlType::Q4K, 8192, 2048),
        (GgmlType::Q4K, 2048, 8192),
        (GgmlType::Q6K, 2048, 8192),
        (GgmlType::Q5K, 2048, 2048),
        (GgmlType::Q5K, 8192, 2048),
        (GgmlType::Q6K, 128_256, 2048),
    ];
    let every_type: Vec<(GgmlType, usize, usize)> = GgmlType::QUANTIZED
        .iter()
        .flat_map(|&ty| [(ty, 2048, 2048), (ty, 8192, 2048), (ty, 2048, 8192)])
        .collect();
    let shapes: &[(GgmlType, usize, usize)] = match std::env::var("QUANT_BENCH_SHAPES").as_deref() {
        Ok("llama-1b") => &llama_1b,
        Ok("llama-1b-types") => &every_type,
        Ok(other) => {
            panic!("QUANT_BENCH_SHAPES: unknown set {other:?} (known: llama-1b, llama-1b-types)")
        }
        Err(_) => &gemma,
    };
    for &(ty, n, k) in shapes {
        if !ty.name().contains(&filter) && !filter.is_empty() {
            continue;
        }
        let matrix = || pseudo_random_matrix(ty, n, k).expect("k is a multiple of the block");
        let mut ws = vec![matrix()];
        let bytes = ws[0].data().num_bytes();
        let copies = if cold { (128usize << 20).div_ceil(bytes) } else { 1 };
        ws.extend((1..copies).map(|_| matrix()));
        for &m in &rows {
            if n > 100_000 && m > 64 {
                continue;
            }
            let x: Vec<f32> =
                (0..m * k).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3).collect();
            // 64-byte aligned like the engine's logits (vocabulary-sized outputs are streamed).
            let mut buf = vec![0.0f32; m * n + 15];
            let start = buf.as_ptr().align_offset(64);
            let out = &mut buf[start..start + m * n];
            linear(&pool, &x, m, &ws[0], None, out);
            let reps = (3e8 / bytes as f64).clamp(3.0, 2000.0) as usize;
            let reps = reps.max(copies);
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let start = Instant::now();
                for rep in 0..reps {
                    linear(&pool, &x, m, &ws[rep % copies], None, out);
                }
                best = best.min(start.elapsed().as_secs_f64() / reps as f64);
            }
            let gops = 2.0 * (m * n * k) as f64 / best / 1e9;
            let gbs = bytes as f64 / best / 1e9;
            println!(
                "{:5} n={n:6} k={k:5} m={m:3}: {:8.3} ms  {gbs:6.1} GB/s  {gops:7.1} GOP/s",
                ty.name(),
                best * 1e3
            );
        }
    }
}
