//! Read bandwidth of this machine, the bound on batch-1 decode:
//! `cargo run --release -p kiln-kernels --example membw -- [threads] [MiB]`.
//! Sums a buffer far larger than the last-level cache with the kernel thread pool and prints
//! the best of 10 passes in GB/s.

use std::time::Instant;

use kiln_kernels::{ThreadPool, vec_ops};

fn main() {
    let mut args = std::env::args().skip(1);
    let threads = args.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let mib: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(2048);
    let pool = ThreadPool::new(threads);
    let len = mib * 1024 * 1024 / 4;
    let data: Vec<f32> = (0..len).map(|i| (i % 7) as f32).collect();
    let ones = vec![1.0f32; 1 << 16];
    let chunk = ones.len();
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let start = Instant::now();
        pool.run(len.div_ceil(chunk), |t| {
            let s = &data[t * chunk..((t + 1) * chunk).min(len)];
            std::hint::black_box(vec_ops::dot(s, &ones[..s.len()]));
        });
        best = best.min(start.elapsed().as_secs_f64());
    }
    println!(
        "read bandwidth: {:.1} GB/s ({} threads, {mib} MiB buffer, best of 10)",
        (len * 4) as f64 / best / 1e9,
        pool.num_threads()
    );
}
